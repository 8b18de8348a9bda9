//! The training panel: the run's progress, time and measured figures beside the plan's
//! prediction, and its loss curve. Its lines carry a rank: when the panel is short, the least
//! important give way, whatever the run's state.

use ratatui::layout::{Constraint, Layout as Split, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, Paragraph, Wrap};
use ratatui::Frame;

use super::super::app::App;
use super::super::theme;
use crate::run::{Remaining, RunState, StepPoint};
use crate::supervisor::Supervisor;
use osdp_core::protocol::RunPrediction;
use osdp_core::text::printable;
use osdp_core::units;

/// How much a line of the panel matters: a short panel drops the highest ranks first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// Why the run stopped or failed, what `x` is waiting for.
    Essential,
    /// Where the run is: whose plan, step and loss, time and ETA.
    Progress,
    /// The worker's last words on a failure.
    LogTail,
    /// Measured against predicted.
    Figures,
    /// Worth a look when there is room.
    Detail,
    /// What another line implies (tokens/s is samples/s × the sequence length).
    Derived,
}

/// Rows `line` takes wrapped at word boundaries to `width` columns (as the panel wraps it).
fn rows_of(line: &Line, width: usize) -> usize {
    let width = width.max(1);
    // A no-break space joins its words (as the panel's wrapping keeps them together).
    let text = line.to_string();
    let (mut rows, mut used) = (1, 0);
    for word in text.split(' ') {
        let n = word.chars().count();
        if used > 0 && used + 1 + n <= width {
            used += 1 + n;
            continue;
        }
        if used > 0 {
            rows += 1;
        }
        // The word starts a row; one longer than a row takes several.
        used = n;
        while used > width {
            rows += 1;
            used -= width;
        }
    }
    rows
}

/// The lines of `lines` that fit `rows` rows of `width` columns, in their order: while they do
/// not fit, the last of the least important goes.
pub fn fit(lines: Vec<(Rank, Line<'static>)>, width: usize, rows: usize) -> Vec<Line<'static>> {
    let heights: Vec<usize> = lines.iter().map(|(_, l)| rows_of(l, width)).collect();
    let mut keep = vec![true; lines.len()];
    let mut used: usize = heights.iter().sum();
    while used > rows {
        let Some(drop) = (0..lines.len())
            .filter(|&i| keep[i])
            .max_by_key(|&i| (lines[i].0, i))
        else {
            break;
        };
        keep[drop] = false;
        used -= heights[drop];
    }
    lines
        .into_iter()
        .zip(keep)
        .filter_map(|((_, l), k)| k.then_some(l))
        .collect()
}

/// `elapsed 3 min 12 s · ETA 4 min 10 s (120 steps × 2.08 s, recent mean)`, or `… ·
/// runs until stopped`: how long the run has gone and has left. The recent mean is of the last
/// ten steps (a checkpoint's slower step included), so it may differ from the last step's time.
pub fn time_line(app: &App, run: &Supervisor) -> Option<String> {
    let live = run.is_live();
    let elapsed = run.elapsed(app.now).map(|d| {
        let e = units::duration(d.as_secs_f64());
        if live {
            format!("elapsed {e}")
        } else {
            format!("ran {e}")
        }
    });
    let left = match run.status.remaining() {
        _ if !live => None,
        Remaining::UntilStopped => Some("runs until stopped (no last step; x stops it)".into()),
        r @ Remaining::Steps {
            steps,
            step_time_s,
            measured,
        } => {
            // Counted down while a step runs: less the time since the last step ended, but
            // never below the steps after this one.
            let since = run
                .last_step_at()
                .map_or(0.0, |t| app.now.saturating_duration_since(t).as_secs_f64());
            let full = r.seconds().unwrap_or(0.0);
            let left = (full - since).max(full - step_time_s).max(0.0);
            Some(format!(
                "ETA {}{} ({steps} step{} × {}{})",
                if measured { "" } else { "~" },
                units::duration(left),
                if steps == 1 { "" } else { "s" },
                units::seconds(step_time_s),
                if measured {
                    ", recent mean"
                } else {
                    " predicted"
                }
            ))
        }
        Remaining::Unknown => None,
    };
    match (elapsed, left) {
        (Some(e), Some(l)) => Some(format!("{e} · {l}")),
        (e, l) => e.or(l),
    }
}

/// The panel's lines, each with its rank.
fn lines(app: &App, run: &Supervisor, state: &RunState) -> Vec<(Rank, Line<'static>)> {
    let mut lines: Vec<(Rank, Line)> = Vec::new();
    let pred = run.status.predicted.as_ref();
    lines.push((Rank::Progress, Line::from(plan_line(app, run))));
    lines.push((Rank::Progress, Line::from(step_line(app, run, pred))));
    if let Some(time) = time_line(app, run) {
        lines.push((Rank::Progress, Line::from(time)));
    }
    if let Some(p) = run.status.last() {
        push_step_figures(&mut lines, run, p, pred);
    }
    if let Some((step, loss)) = run.status.evals.last() {
        lines.push((
            Rank::Figures,
            Line::from(format!("held-out loss {loss:.4} at step {step}")),
        ));
    }
    lines.push((Rank::Figures, Line::from(checkpoint_line(app, run))));
    if let Some(data) = app
        .run_control
        .as_ref()
        .and_then(|t| t.spec.data.describe())
    {
        lines.push((Rank::Detail, Line::from(printable(&data).into_owned())));
    }
    push_endings(&mut lines, run, state);
    lines
}

/// Whose plan the run uses: another process's (read-only), or the one on screen or not.
fn plan_line(app: &App, run: &Supervisor) -> Span<'static> {
    if let Some(owner) = run.owner() {
        Span::styled(
            format!(
                "attached, read-only: {}",
                printable(&super::super::app::owned_by(owner))
            ),
            theme::ATTACHED,
        )
    } else if app.plan_differs_from_run() {
        Span::styled(
            "the plan on screen differs from the run's: r restarts under it",
            theme::WARN,
        )
    } else {
        Span::raw("the run uses the plan on screen")
    }
}

/// The last step, its loss and the tokens seen; before the first, what is awaited.
fn step_line(app: &App, run: &Supervisor, pred: Option<&RunPrediction>) -> String {
    match run.status.last() {
        Some(p) => format!(
            "step {} · loss {:.4} (smoothed {}) · {} tokens seen",
            p.step,
            p.loss,
            run.status
                .smoothed_loss()
                .map_or("—".into(), |l| format!("{l:.4}")),
            units::count(p.step * run.status.global_batch * app.model.config.seq_len)
        ),
        None => match pred {
            Some(x) => format!(
                "waiting for the first step (predicted {} a step, global batch {})…",
                units::seconds(x.step_time_s),
                run.status.global_batch
            ),
            None => "waiting for the first step…".into(),
        },
    }
}

/// The last step `p`'s figures beside the prediction, its lr and grad-norm, and how long the
/// first step took.
fn push_step_figures(
    lines: &mut Vec<(Rank, Line<'static>)>,
    run: &Supervisor,
    p: &StepPoint,
    pred: Option<&RunPrediction>,
) {
    // A run started elsewhere has no prediction beside it: a dash, not a zero.
    let ps = pred.map_or("—".into(), |x| format!("{:.1}", x.samples_per_s));
    let pt = pred.map_or("—".into(), |x| units::count(x.tokens_per_s as u64));
    lines.push((
        Rank::Figures,
        Line::from(format!(
            "step time {} measured · {} predicted",
            units::seconds(p.step_time_s),
            pred.map_or("—".into(), |x| units::seconds(x.step_time_s))
        )),
    ));
    lines.push((
        Rank::Figures,
        Line::from(format!(
            "samples/s {:.1} measured · {ps} predicted",
            p.samples_per_s
        )),
    ));
    lines.push((
        Rank::Derived,
        Line::from(format!(
            "tokens/s  {} measured · {pt} predicted",
            units::count(p.tokens_per_s as u64)
        )),
    ));
    lines.push((Rank::Figures, Line::from(memory_line(p, pred))));
    lines.push((
        Rank::Detail,
        Line::from(format!("lr {:.2e} · grad-norm {:.3}", p.lr, p.grad_norm)),
    ));
    if let Some(t) = run.first_step_after {
        lines.push((
            Rank::Detail,
            Line::from(format!(
                "first step {} after start (start-up and one step)",
                units::seconds(t.as_secs_f64())
            )),
        ));
    }
}

/// The largest rank's memory (each rank's is in the memory panel), against the plan's
/// tensors: the runtime is the layout's estimate, which the worker does not measure.
fn memory_line(p: &StepPoint, pred: Option<&RunPrediction>) -> String {
    let measured = p
        .memory_bytes
        .iter()
        .copied()
        .max()
        .map_or("—".into(), units::bytes);
    let predicted = pred
        .map(|x| {
            format!(
                "{} predicted (+{} runtime, est.)",
                units::bytes(x.peak_memory_bytes.saturating_sub(x.runtime_overhead_bytes)),
                units::bytes(x.runtime_overhead_bytes)
            )
        })
        .unwrap_or_else(|| "— predicted".into());
    format!("memory/rank {measured} measured · {predicted}")
}

/// The last checkpoint's step and age.
fn checkpoint_line(app: &App, run: &Supervisor) -> String {
    match (&run.status.last_checkpoint, run.last_checkpoint_at) {
        (Some((step, _)), Some(at)) => format!(
            "last checkpoint: step {step}, {:.0} s ago",
            app.now.saturating_duration_since(at).as_secs_f64()
        ),
        (Some((step, _)), None) => format!("last checkpoint: step {step}"),
        (None, _) => "no checkpoint yet".into(),
    }
}

/// How the run is ending or ended: a stop under way, a note, a failure and the log's last
/// lines.
fn push_endings(lines: &mut Vec<(Rank, Line<'static>)>, run: &Supervisor, state: &RunState) {
    if *state == RunState::Stopping {
        let finishing = match run.finishing() {
            Some((step, secs)) => format!("finishing step {step} (~{secs:.0} s)"),
            None => "stopping before the first step".into(),
        };
        lines.push((
            Rank::Essential,
            Line::from(Span::styled(
                format!("{finishing}, then a checkpoint; x again to kill"),
                theme::WARN,
            )),
        ));
    }
    if let Some(note) = &run.note {
        lines.push((
            Rank::Essential,
            Line::from(Span::styled(
                printable(note).into_owned(),
                theme::WARN.add_modifier(Modifier::BOLD),
            )),
        ));
    }
    if let RunState::Failed { why, log_tail } = state {
        lines.push((
            Rank::Essential,
            Line::from(Span::styled(
                format!(
                    "failed: {} · r restarts from the last checkpoint · l shows the log",
                    printable(why)
                ),
                theme::BAD,
            )),
        ));
        for l in log_tail.iter().rev().take(3).rev() {
            lines.push((
                Rank::LogTail,
                Line::from(Span::styled(format!("  {}", printable(l)), theme::MUTED)),
            ));
        }
    }
}

pub fn draw_training(app: &App, f: &mut Frame, area: Rect) {
    let Some(t) = &app.run_control else {
        return;
    };
    let Some(run) = &t.supervisor else {
        return;
    };
    let state = t.state();
    let [text_area, chart_area] =
        Split::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(area);
    let width = usize::from(text_area.width.saturating_sub(2));
    let title = format!(
        " training: {} · {} ",
        t.state_label(),
        fit_path(
            &printable(&t.dir.0.display().to_string()),
            width.saturating_sub(14 + t.state_label().chars().count())
        )
    );
    let block = Block::bordered()
        .title(title)
        .border_style(Style::new().fg(theme::run_state(&state)));
    let rows = usize::from(text_area.height.saturating_sub(2));
    let lines = lines(app, run, &state)
        .into_iter()
        .map(|(rank, line)| (rank, keep_units(line)))
        .collect();
    f.render_widget(
        Paragraph::new(fit(lines, width, rows))
            .block(block)
            .wrap(Wrap { trim: false }),
        text_area,
    );
    draw_loss(&run.status, f, chart_area);
}

/// `path` in `width` columns: whole, else its last parts after `…/` (the run directory's own
/// name is what tells runs apart).
fn fit_path(path: &str, width: usize) -> String {
    if path.chars().count() <= width {
        return path.to_string();
    }
    let mut tail = String::new();
    for part in path.rsplit('/') {
        let longer = if tail.is_empty() {
            part.to_string()
        } else {
            format!("{part}/{tail}")
        };
        if longer.chars().count() + 2 > width {
            break;
        }
        tail = longer;
    }
    format!("…/{tail}")
}

/// Units that stay with their figure when a line wraps.
const UNITS: [&str; 14] = [
    "B", "KiB", "MiB", "GiB", "TiB", "k", "M", "T", "ms", "µs", "s", "min", "h", "steps",
];

/// `line` with a no-break space between each figure and its unit, so that wrapping never
/// leaves `5.12` at a line's end and `k tokens` on the next (drawn as a space).
fn keep_units(line: Line<'static>) -> Line<'static> {
    let spans = line
        .spans
        .into_iter()
        .map(|span| {
            let text = span.content.as_ref();
            let words: Vec<&str> = text.split(' ').collect();
            let mut out = String::with_capacity(text.len());
            for (k, word) in words.iter().enumerate() {
                if k > 0 {
                    let glue = words[k - 1].ends_with(|c: char| c.is_ascii_digit())
                        && UNITS.contains(&word.trim_end_matches([',', ')', ';']));
                    out.push(if glue { NBSP } else { ' ' });
                }
                out.push_str(word);
            }
            Span::styled(out, span.style)
        })
        .collect::<Vec<_>>();
    Line::from(spans).style(line.style)
}

/// The no-break space [`keep_units`] puts between a figure and its unit; `render_text` and
/// the terminal show it as a space.
pub const NBSP: char = '\u{a0}';

fn draw_loss(status: &crate::run::RunStatus, f: &mut Frame, area: Rect) {
    let block = Block::bordered().title(" loss by step ");
    let pts: Vec<(f64, f64)> = status
        .steps
        .iter()
        .map(|p| (p.step as f64, p.loss))
        .collect();
    if pts.len() < 2 {
        f.render_widget(Paragraph::new("no steps yet").block(block), area);
        return;
    }
    let x_min = pts.first().map_or(0.0, |p| p.0);
    let x_max = pts.last().map_or(1.0, |p| p.0).max(x_min + 1.0);
    let y_max = pts.iter().map(|p| p.1).fold(0.0f64, f64::max) * 1.05;
    let y_min = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min) * 0.95;
    let datasets = vec![Dataset::default()
        .marker(Marker::Braille)
        .graph_type(GraphType::Line)
        .style(theme::SERIES)
        .data(&pts)];
    let chart = Chart::new(datasets)
        .block(block)
        .x_axis(Axis::default().bounds([x_min, x_max]).labels(vec![
            Span::raw(format!("{x_min:.0}")),
            Span::raw(format!("{x_max:.0}")),
        ]))
        .y_axis(Axis::default().bounds([y_min, y_max]).labels(vec![
            Span::raw(format!("{y_min:.2}")),
            Span::raw(format!("{y_max:.2}")),
        ]));
    f.render_widget(chart, area);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(lines: &[Line]) -> Vec<String> {
        lines.iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn a_short_panel_drops_the_least_important_lines_and_keeps_the_order() {
        let lines = vec![
            (Rank::Progress, Line::from("step")),
            (Rank::Detail, Line::from("lr")),
            (Rank::Figures, Line::from("samples/s")),
            (Rank::Detail, Line::from("first step")),
            (Rank::Essential, Line::from("failed")),
            (Rank::LogTail, Line::from("log 1")),
            (Rank::LogTail, Line::from("log 2")),
        ];
        assert_eq!(fit(lines.clone(), 40, 7).len(), 7, "room for all");
        assert_eq!(
            text(&fit(lines.clone(), 40, 5)),
            ["step", "samples/s", "failed", "log 1", "log 2"]
        );
        assert_eq!(
            text(&fit(lines.clone(), 40, 3)),
            ["step", "failed", "log 1"]
        );
        assert_eq!(text(&fit(lines, 40, 1)), ["failed"]);
    }

    #[test]
    fn a_line_wider_than_the_panel_counts_the_rows_it_wraps_to() {
        assert_eq!(rows_of(&Line::from("step 12 · loss 4.1"), 40), 1);
        assert_eq!(rows_of(&Line::from("aaaa bbbb cccc"), 9), 2);
        assert_eq!(rows_of(&Line::from("aaaaaaaaaaaaaaaaaaaa"), 8), 3);
        let long = vec![
            (
                Rank::Essential,
                Line::from("failed: a reason long enough for two rows"),
            ),
            (Rank::LogTail, Line::from("log")),
        ];
        assert_eq!(
            text(&fit(long, 24, 2)),
            ["failed: a reason long enough for two rows"]
        );
    }
}
