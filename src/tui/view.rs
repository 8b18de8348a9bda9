//! Drawing: reads the [`App`] and changes nothing in it but `app.hit`, where each panel
//! landed on screen (a `Cell`, for mouse clicks). ratatui's `Layout` is imported as `Split`
//! so that "layout" here means the cluster's.

use ratatui::layout::{Constraint, Layout as Split, Rect};
use ratatui::style::{Modifier, Style, Stylize};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Axis, Block, Cell, Chart, Clear, Dataset, GraphType, Paragraph, Row as TableRow, Table,
    TableState, Wrap,
};
use ratatui::Frame;

mod devices;
mod log;
mod training;

pub use devices::sparkline;
pub use training::{fit, Rank, NBSP};

use super::app::{App, Confirm, Focus, Row, View};
use super::{keymap, theme};
use osdp_core::cost::{Choice, Strategy, Target};
use osdp_core::model::ModelSpec;
use osdp_core::plan::Planned;
use osdp_core::text::printable;
use osdp_core::units;

pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 24;
/// From this height the header shows the memory and time split bars.
const SPLIT_BARS_MIN_HEIGHT: u16 = 30;

pub fn draw(app: &App, f: &mut Frame) {
    let area = f.area();
    // Panels this frame does not draw take no clicks.
    app.hit.set(super::app::HitMap::default());
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        let msg = format!(
            "terminal too small: osdp-tui needs at least {MIN_WIDTH}×{MIN_HEIGHT}, this one is {}×{}",
            area.width, area.height
        );
        f.render_widget(Paragraph::new(msg).wrap(Wrap { trim: true }), area);
        return;
    }
    // Tall screens get the plan's memory and time split into parts, two lines more.
    let header_height = if area.height >= SPLIT_BARS_MIN_HEIGHT {
        6
    } else {
        4
    };
    let [header, strip, main, footer] = Split::vertical([
        Constraint::Length(header_height),
        Constraint::Length(1),
        Constraint::Min(10),
        Constraint::Length(footer_height(app, area.width)),
    ])
    .areas(area);
    if app.log_view.is_some() {
        draw_log_screen(app, f, area);
        return;
    }
    draw_header(app, f, header);
    // Short screens, and any view but the plan, name the views where the strip was.
    if area.height < SPLIT_BARS_MIN_HEIGHT || app.view != View::Plan {
        draw_tabs(app, f, strip);
    } else {
        draw_strip(app, f, strip);
    }
    // A run (going, or with history) gets a panel under the plan when there is room.
    let has_run = app
        .run_control
        .as_ref()
        .is_some_and(|t| t.supervisor.is_some());
    if app.view != View::Plan {
        draw_other_view(app, f, main, has_run);
        draw_footer(app, f, footer, footer_keys(app, footer.width));
        if let Some(lines) = &app.compare {
            draw_compare(lines, app.compare_scroll, f, main);
        }
        if app.show_help {
            draw_help(app, f, area);
        }
        return;
    }
    let main = if has_run && main.height >= 26 {
        // A third of a tall screen: more of the run's lines (fewer give way).
        let panel_height = (main.height / 3).clamp(12, 16);
        let [top, panel] =
            Split::vertical([Constraint::Min(12), Constraint::Length(panel_height)]).areas(main);
        training::draw_training(app, f, panel);
        top
    } else {
        main
    };
    let [ops, right] =
        Split::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)]).areas(main);
    draw_ops(app, f, ops);
    draw_plan_side(app, f, right);
    draw_footer(app, f, footer, footer_keys(app, footer.width));
    if let Some(d) = &app.detail {
        draw_detail(app, d, f, main);
    }
    if let Some(lines) = &app.compare {
        draw_compare(lines, app.compare_scroll, f, main);
    }
    if app.show_help {
        draw_help(app, f, area);
    }
}

/// The footer's reminder of the keys that act now: those of what is on top (help, the
/// comparison, an operator's choices), else the focused panel's; `?` always.
fn footer_keys(app: &App, width: u16) -> String {
    let on_top = if app.show_help {
        Some(" ↑↓ j k scroll  PgUp/PgDn page  / filter  Esc or ? close")
    } else if app.compare.is_some() {
        Some(" ↑↓ PgUp/PgDn scroll  c or Esc close  ? help")
    } else if app.detail.is_some() {
        Some(" Enter or Esc close  ? help")
    } else {
        None
    };
    if let Some(keys) = on_top {
        return keys.to_string();
    }
    let scope = match app.focus {
        Focus::Ops => keymap::Scope::Ops,
        Focus::Gpus => keymap::Scope::Gpus,
    };
    keymap::footer(usize::from(width), scope)
}

/// The worker's log over everything but the header's first line (the run's state) and the
/// footer.
fn draw_log_screen(app: &App, f: &mut Frame, area: Rect) {
    let [title, log, footer] = Split::vertical([
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(footer_height(app, area.width)),
    ])
    .areas(area);
    draw_header(app, f, title);
    log::draw_log(app, f, log);
    draw_footer(
        app,
        f,
        footer,
        keymap::log_footer(usize::from(footer.width)),
    );
    if app.show_help {
        draw_help(app, f, area);
    }
}

/// Views 2–4 (graph and frontier, GPUs, training) in `main`.
fn draw_other_view(app: &App, f: &mut Frame, main: Rect, has_run: bool) {
    match app.view {
        View::Graph => {
            let [graph, chart] =
                Split::vertical([Constraint::Percentage(60), Constraint::Percentage(40)])
                    .areas(main);
            draw_graph(app, f, graph);
            draw_frontier(app, f, chart);
        }
        View::Gpus => devices::draw_devices(app, f, main),
        View::Training if has_run => training::draw_training(app, f, main),
        View::Training | View::Plan => f.render_widget(
            Paragraph::new(format!(
                " no run here yet: s starts one with the plan on screen, {} (:steps N sets it)",
                match app.run_steps {
                    0 => "to run until stopped".to_string(),
                    1 => "to run 1 step".to_string(),
                    n => format!("to run {n} steps"),
                }
            ))
            .wrap(Wrap { trim: true })
            .style(theme::MUTED)
            .block(Block::bordered().title(" training ")),
            main,
        ),
    }
}

/// The plan view's right side: GPUs, and the selected block's graph or the frontier (both on
/// tall screens).
fn draw_plan_side(app: &App, f: &mut Frame, right: Rect) {
    if right.height >= 40 {
        let [gpus, graph, chart] = Split::vertical([
            Constraint::Percentage(30),
            Constraint::Percentage(40),
            Constraint::Percentage(30),
        ])
        .areas(right);
        devices::draw_devices(app, f, gpus);
        draw_graph(app, f, graph);
        draw_frontier(app, f, chart);
    } else {
        let [gpus, lower] =
            Split::vertical([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(right);
        devices::draw_devices(app, f, gpus);
        if app.show_graph {
            draw_graph(app, f, lower);
        } else {
            draw_frontier(app, f, lower);
        }
    }
}

/// What the footer says besides the keys: a question waiting for its answer, else the last
/// message; `None`: the keys.
fn footer_text(app: &App) -> Option<(String, Style)> {
    let question = match &app.confirm {
        Some(Confirm::StartUnpriced) => {
            "the plan on screen is still being priced: start with it anyway? y / n".to_string()
        }
        Some(Confirm::QuitWhileRunning) => "a run is going: d detach (the run keeps going) · \
             s stop (checkpoint and stop) · esc cancel"
            .to_string(),
        Some(Confirm::Overwrite(path)) => format!(
            "{} exists: overwrite it with the plan on screen? y / n",
            printable(&path.display().to_string())
        ),
        Some(Confirm::OverwriteExport(path)) => format!(
            "{} exists: overwrite it with the plan on screen for FSDP2? y / n",
            printable(&path.display().to_string())
        ),
        Some(Confirm::RestartNewBatch { from, to }) => format!(
            "restarting changes the global batch from {from} to {to} samples per step \
             (B sets it): restart anyway? y / n"
        ),
        None => {
            return app
                .message
                .as_ref()
                .map(|m| (printable(m).into_owned(), theme::WARN))
        }
    };
    Some((question, theme::PROMPT))
}

/// Most rows a message or question takes in the footer before its end is cut.
const FOOTER_MAX_LINES: usize = 3;

/// `text` as the footer shows it in `width` columns: broken between words onto up to
/// [`FOOTER_MAX_LINES`] rows, each led by a space.
fn footer_lines(text: &str, width: u16) -> Vec<String> {
    wrap_words(text, usize::from(width).saturating_sub(1), FOOTER_MAX_LINES)
        .into_iter()
        .map(|l| format!(" {l}"))
        .collect()
}

/// Rows the footer takes: one for the keys or the command line, as many as a long message or
/// question needs (up to [`FOOTER_MAX_LINES`]), so that nothing it says is cut at 80 columns.
fn footer_height(app: &App, width: u16) -> u16 {
    match footer_text(app) {
        Some((text, _)) if app.command.is_none() => footer_lines(&text, width).len().max(1) as u16,
        _ => 1,
    }
}

/// The footer: a question waiting for its answer, else the last message, else `keys`.
fn draw_footer(app: &App, f: &mut Frame, area: Rect, keys: String) {
    if let Some(line) = &app.command {
        draw_prompt(line, f, area);
        return;
    }
    let lines: Vec<Line> = match footer_text(app) {
        Some((text, style)) => footer_lines(&text, area.width)
            .into_iter()
            .map(|l| Line::from(Span::styled(l, style)))
            .collect(),
        None => vec![Line::from(Span::styled(keys, theme::MUTED))],
    };
    f.render_widget(Paragraph::new(lines), area);
}

/// The command line or a search prompt: the text with the cursor where it is, then what Tab
/// offered, or a reminder of what the prompt takes.
fn draw_prompt(line: &super::cmdline::CommandLine, f: &mut Frame, area: Rect) {
    use super::cmdline::Prompt;
    let text = line.text();
    let at = line.cursor();
    let before: String = text.chars().take(at).collect();
    // At the end a block; on a character, that character in reverse video.
    let (under, cursor) = match text.chars().nth(at) {
        Some(c) => (
            c.to_string(),
            theme::PROMPT.add_modifier(Modifier::REVERSED),
        ),
        None => ("█".to_string(), theme::PROMPT),
    };
    let after: String = text.chars().skip(at + 1).collect();
    let hint = match (&line.hint, line.prompt) {
        (Some(h), _) => format!("   {}", printable(h)),
        (None, Prompt::Command) => format!(
            "   Enter runs · Tab completes · ↑↓ history · Esc closes · {}",
            super::app::COMMANDS
        ),
        (None, Prompt::FindOps) => {
            "   name or strategy · Enter keeps the filter · Esc drops it".into()
        }
        (None, Prompt::FilterHelp) => "   Enter keeps the filter · Esc drops it".into(),
    };
    let spans = vec![
        Span::styled(
            format!("{}{}", line.prompt.sigil(), printable(&before)),
            theme::PROMPT,
        ),
        Span::styled(printable(&under).into_owned(), cursor),
        Span::styled(printable(&after).into_owned(), theme::PROMPT),
        Span::styled(hint, theme::MUTED),
    ];
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// Every choice the selected operator could have, priced as the whole plan with only that op
/// changed: Δ step time and Δ peak against the plan, and what stops the faster ones.
fn draw_detail(app: &App, detail: &super::app::OpDetail, f: &mut Frame, area: Rect) {
    let spec = &app.model.ops[detail.op];
    let alts = &detail.alternatives;
    let w = 112.min(area.width);
    let h = (alts.len() as u16 + 3).min(area.height);
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    // Narrow screens give up the `held` column and the long offload labels, so that the
    // reason (`transient peak over budget`) shows whole.
    let narrow = w < 100;
    let label = |c: Choice| {
        if narrow {
            c.short_label()
        } else {
            c.label()
        }
    };
    let signed_ms = |s: f64| match s {
        0.0 => "±0".to_string(),
        s if s.abs() >= 1.0 => format!("{s:+.2} s"),
        s => format!("{:+.2} ms", s * 1e3),
    };
    let signed_bytes = |b: i64| match b {
        0 => "±0".to_string(),
        b if b > 0 => format!("+{}", units::bytes(b as u64)),
        b => format!("−{}", units::bytes(b.unsigned_abs())),
    };
    let rows: Vec<TableRow> = alts
        .iter()
        .map(|a| {
            let style = if a.chosen {
                Style::new().add_modifier(Modifier::BOLD)
            } else {
                Style::new()
            };
            let mut cells = vec![
                Cell::from(Span::styled(
                    label(a.choice),
                    Style::new().fg(theme::strategy(a.choice)),
                )),
                Cell::from(signed_ms(a.delta_step_s)),
                Cell::from(signed_bytes(a.delta_peak_bytes)),
                Cell::from(units::bytes(a.persistent_bytes)),
                Cell::from(units::bytes(a.transient_bytes)),
                Cell::from(a.verdict.text()),
            ];
            if narrow {
                cells.remove(3);
            }
            TableRow::new(cells).style(style)
        })
        .collect();
    // The title's parts, the last dropped first while they do not fit.
    let mut parts = vec![
        printable(&spec.id).into_owned(),
        spec.kind.as_str().to_string(),
        format!("{} params", units::count(ModelSpec::op_param_count(spec))),
        "each choice priced in the plan".to_string(),
        "Enter closes".to_string(),
    ];
    let title = loop {
        let t = format!(" {} ", parts.join(" · "));
        if t.chars().count() + 2 <= usize::from(w) || parts.len() == 1 {
            break t;
        }
        parts.remove(parts.len() - if parts.len() > 3 { 2 } else { 1 });
    };
    // The choice column as wide as its longest label (`zero3/4:4+offload-opt`): never cut.
    let choice_width = alts
        .iter()
        .map(|a| label(a.choice).chars().count())
        .max()
        .unwrap_or(6)
        .max(6) as u16;
    let mut widths = vec![
        Constraint::Length(choice_width),
        Constraint::Length(12),
        Constraint::Length(12),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Min(10),
    ];
    let mut titles = vec!["choice", "Δ step", "Δ peak", "held", "transient", "why not"];
    if narrow {
        widths = vec![
            Constraint::Length(choice_width),
            Constraint::Length(10),
            Constraint::Length(11),
            Constraint::Length(10),
            Constraint::Min(10),
        ];
        titles.remove(3);
    }
    let mut block = Block::bordered().title(title);
    if let Some(words) = crate::report::unaligned_op_words(&app.machine, spec) {
        block = block.title_bottom(format!(
            " {} ",
            clip_words(&words, usize::from(w).saturating_sub(4))
        ));
    }
    let table = Table::new(rows, widths)
        .header(TableRow::new(titles).style(theme::MUTED))
        .block(block);
    f.render_widget(Clear, r);
    f.render_widget(table, r);
}

fn draw_header(app: &App, f: &mut Frame, area: Rect) {
    let mut lines = vec![header_title(app, area.width)];
    lines.extend(header_plan(app, area));
    lines.push(header_settings(app, usize::from(area.width)));
    if let Some(n) = &app.notice {
        lines.push(Line::from(Span::styled(
            clip_words(n, usize::from(area.width)),
            theme::WARN,
        )));
    }
    f.render_widget(Paragraph::new(lines), area);
}

/// The header's first line: model, layout, pricing source, and the run's state.
fn header_title(app: &App, width: u16) -> Line<'static> {
    let m: &ModelSpec = &app.model;
    let mut title = vec![
        Span::styled("osdp-tui ", Style::new().bold()),
        Span::raw(format!(
            "{} ({} params, {} ops) on {} ({} × {})",
            printable(&m.name),
            units::count(m.param_count()),
            m.ops.len(),
            printable(&app.layout.name),
            app.layout.world_size(),
            printable(&app.layout.device.model)
        )),
    ];
    // Whether the time figures are this machine's measurements or datasheet rates.
    if let Some(when) = app.layout.measured_at() {
        title.push(Span::styled(
            format!(
                " · calibrated {}",
                printable(when.get(..10).unwrap_or_default())
            ),
            theme::GOOD,
        ));
    } else if app.machine.rates_guessed {
        // A GPU the known-GPU table does not name: its architecture's stand-in rates.
        title.push(Span::styled(" · guessed rates", theme::WARN));
    } else {
        // Datasheet rates × efficiencies fitted to published runs (or generic ones):
        // `osdp-tui calibrate` measures the machine itself.
        title.push(Span::styled(" · uncalibrated", theme::WARN));
    }
    if let Some(t) = &app.run_control {
        let state = t.state();
        let step = t
            .supervisor
            .as_ref()
            .and_then(|r| r.status.last())
            .map(|p| format!(" step {}", p.step))
            .unwrap_or_default();
        title.push(Span::raw(" · run: "));
        title.push(Span::styled(
            format!("{}{step}", t.state_label()),
            Style::new().bold().fg(theme::run_state(&state)),
        ));
        // The worker's pid while it lives (this dashboard's, or the one it follows); before
        // `s`, how long the run it starts goes (`:steps N`), so that its ETA is no surprise.
        // Either stays when the description's short forms make room, else goes whole.
        if let Some(pid) = t
            .supervisor
            .as_ref()
            .filter(|r| r.is_live())
            .and_then(|r| r.pid())
        {
            title.push(Span::raw(format!(" · pid {pid}")));
        } else if !t.is_live() {
            title.push(Span::styled(
                match app.run_steps {
                    0 => " · next: until stopped".to_string(),
                    1 => " · next: 1 step".to_string(),
                    n => format!(" · next: {n} steps"),
                },
                theme::MUTED,
            ));
        }
    }
    let extra = title
        .last()
        .filter(|s| s.content.starts_with(" · next: ") || s.content.starts_with(" · pid "))
        .map(|_| title.len() - 1);
    // The state of the run and the pricing source matter more than the device's full name: on
    // a narrow terminal the description shortens before they are cut.
    if Line::from(title.clone()).width() > usize::from(width) {
        title[1] = Span::raw(format!(
            "{} ({} params, {} ops) on {} ({})",
            printable(&m.name),
            units::count(m.param_count()),
            m.ops.len(),
            printable(&app.layout.name),
            ranks_words(app.layout.world_size()),
        ));
    }
    if Line::from(title.clone()).width() > usize::from(width) {
        title[1] = Span::raw(format!(
            "{} ({}) on {} ({})",
            printable(&m.name),
            units::count(m.param_count()),
            printable(&app.layout.name),
            ranks_words(app.layout.world_size()),
        ));
    }
    // Narrower still (80 columns with a run's step): the model and the layout by name alone.
    if Line::from(title.clone()).width() > usize::from(width) {
        title[1] = Span::raw(format!(
            "{} on {}",
            printable(&m.name),
            printable(&app.layout.name)
        ));
    }
    // The pid or the next run's length gives way before anything else.
    if let Some(k) = extra {
        if Line::from(title.clone()).width() > usize::from(width) {
            title.remove(k);
        }
    }
    Line::from(title)
}

/// `1 rank`, `8 ranks`.
fn ranks_words(n: u32) -> String {
    if n == 1 {
        "1 rank".into()
    } else {
        format!("{n} ranks")
    }
}

/// The plan's figures (batch, speed, peak, step) and its memory and time bars, or why there is
/// no plan.
fn header_plan(app: &App, area: Rect) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let budget = app.budget();
    let batch_mode = if app.request.batch.is_some() {
        "fixed"
    } else {
        "auto"
    };
    match &app.plan {
        None => lines.push(Line::from("planning…")),
        Some(ready) => match &ready.result {
            Ok(p) => {
                let pr = &p.prediction;
                let over = pr.peak_memory_bytes > budget;
                // Narrow terminals keep what decides a run: batch, speed, memory, step time.
                let wide = area.width >= 110;
                let batch = if wide {
                    format!(
                        "global batch {} = {} ({batch_mode})",
                        pr.global_batch,
                        batch_breakdown(pr)
                    )
                } else {
                    format!(
                        "global batch {} = {}×{}",
                        pr.global_batch,
                        pr.batch_label(),
                        pr.ranks()
                    )
                };
                // Fields by priority (0 first to stay): what does not fit is dropped whole.
                let mut fields = vec![
                    (2, vec![Span::raw(batch)]),
                    (
                        0,
                        vec![Span::styled(
                            format!(
                                "{} samples/s",
                                units::figure(pr.throughput_samples_per_s, 1)
                            ),
                            theme::GOOD_BOLD,
                        )],
                    ),
                    (
                        0,
                        vec![
                            Span::raw("peak "),
                            Span::styled(
                                format!(
                                    "{} / {}",
                                    units::bytes(pr.peak_memory_bytes),
                                    units::bytes(budget)
                                ),
                                if over { theme::LIMIT } else { Style::new() },
                            ),
                        ],
                    ),
                    (
                        1,
                        vec![Span::raw(format!(
                            "step {}",
                            units::seconds(pr.step_time_s)
                        ))],
                    ),
                ];
                if wide {
                    fields.push((
                        3,
                        vec![Span::raw(format!(
                            "{}/s tokens",
                            units::count(pr.tokens_per_s as u64)
                        ))],
                    ));
                }
                let spans = fit_fields(fields, usize::from(area.width));
                lines.push(Line::from(spans));
                if area.height >= 5 {
                    // Host memory once the plan offloads (a layout with a host that the plan
                    // does not use needs no word of it).
                    let host = (app.machine.offers_offload() && pr.host_bytes > 0)
                        .then_some(app.machine.host_budget_bytes);
                    lines.extend(split_bars(pr, budget, host, usize::from(area.width)));
                }
            }
            Err(nf) => lines.push(Line::from(Span::styled(
                nf.describe(budget, app.layout.device.kind.rank_noun()),
                theme::BAD,
            ))),
        },
    }
    lines
}

/// What the plan was asked for (budgets, split, pins, fixes) and how it compares.
fn header_settings(app: &App, width: usize) -> Line<'static> {
    let replan = app
        .plan
        .as_ref()
        .map(|r| {
            format!(
                "re-plan {:.1} ms{}",
                r.elapsed_ms,
                if r.reused { " (budget lookup)" } else { "" }
            )
        })
        .unwrap_or_default();
    // Against the baselines a user would otherwise run, at the same budget and batch.
    let versus_all = match app.plan.as_ref().map(|r| (&r.result, &r.baselines)) {
        Some((Ok(p), baselines)) => vec![
            format!(
                "vs DDP {}",
                versus(&p.prediction, baselines, osdp_core::cost::Strategy::Dp)
            ),
            format!(
                "vs FSDP {}",
                versus(&p.prediction, baselines, osdp_core::cost::Strategy::Zero3)
            ),
        ],
        _ => Vec::new(),
    };
    // The headroom rides with the budget (never dropped apart from it): what plans fill.
    let headroom = if app.request.headroom > 0.0 {
        format!(
            " ({:.0} % headroom: plans within {})",
            app.request.headroom * 100.0,
            units::bytes(app.request.usable_budget())
        )
    } else {
        String::new()
    };
    let mut fields = vec![
        (0, format!("budget {}{headroom}", app.budget_summary())),
        (2, format!("split ≤ {}", app.request.max_split)),
        (3, format!("{} pinned", app.request.pins.len())),
    ];

    if !app.request.block_recompute.is_empty() {
        fields.push((3, format!("{} rc fixed", app.request.block_recompute.len())));
    }
    // Figures priced as FSDP2 runs the plan, not as osdp-tui's trainer does: said beside them.
    if app.request.target == osdp_core::plan::Target::Fsdp2 {
        fields.push((0, "for FSDP2".into()));
    }
    fields.extend(versus_all.into_iter().map(|v| (1, v)));
    if !replan.is_empty() {
        fields.push((4, replan));
    }
    if app.pending {
        fields.push((0, "planning…".into()));
    }
    let fields = fields
        .into_iter()
        .map(|(p, f)| (p, vec![Span::raw(f)]))
        .collect();
    Line::from(fit_fields(fields, width))
}

/// `text` in lines of at most `width` columns, broken between words; at most `max` lines, the
/// last ending `…` when there was more.
pub(super) fn wrap_words(text: &str, width: usize, max: usize) -> Vec<String> {
    let width = width.max(8);
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let n = line.chars().count();
        if n > 0 && n + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    if lines.len() > max {
        let rest = lines[max - 1..].join(" ");
        lines.truncate(max - 1);
        lines.push(clip_words(&rest, width));
    }
    lines
        .into_iter()
        .map(|l| {
            if l.chars().count() > width {
                clip_words(&l, width)
            } else {
                l
            }
        })
        .collect()
}

/// `text` within `width` columns, cut after a whole word with `…` when it is longer.
fn clip_words(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let room: String = text.chars().take(width.saturating_sub(1)).collect();
    let cut = room.rfind(' ').unwrap_or(room.len());
    format!(
        "{}…",
        room[..cut].trim_end_matches([' ', '·', ',', ';', ':'])
    )
}

/// Fields joined by ` · ` within `width` columns: while they do not fit, the field of lowest
/// priority (highest number; the last of equals) goes, whole, so nothing is cut mid-word.
fn fit_fields(mut fields: Vec<(u8, Vec<Span<'static>>)>, width: usize) -> Vec<Span<'static>> {
    let len = |fields: &[(u8, Vec<Span>)]| {
        let text: usize = fields.iter().flat_map(|(_, f)| f).map(|s| s.width()).sum();
        text + 3 * fields.len().saturating_sub(1)
    };
    while fields.len() > 1 && len(&fields) > width {
        let worst = fields.iter().map(|(p, _)| *p).max().unwrap_or(0);
        let k = fields.iter().rposition(|(p, _)| *p == worst).unwrap_or(0);
        fields.remove(k);
    }
    let mut spans = Vec::new();
    for (k, (_, f)) in fields.into_iter().enumerate() {
        if k > 0 {
            spans.push(Span::raw(" · "));
        }
        spans.extend(f);
    }
    spans
}

/// The plan's memory against the budget and its step time, each a bar of coloured parts with
/// the parts named beside it: what the peak is made of and where the time goes.
/// Spans of a bar in [`split_bars`]: one per part, and the unused rest.
const MEMORY_PARTS_SPANS: usize = 5;

/// `host_budget`: where the plan offloads, the memory line ends with its host memory against
/// the host budget.
fn split_bars(
    pr: &osdp_core::plan::Prediction,
    budget: u64,
    host_budget: Option<u64>,
    width: usize,
) -> [Line<'static>; 2] {
    let bar_width = (width / 5).clamp(10, 30);
    let memory = [
        (
            "states",
            pr.persistent_bytes as f64,
            units::bytes(pr.persistent_bytes),
        ),
        (
            "activations",
            pr.activation_bytes as f64,
            units::bytes(pr.activation_bytes),
        ),
        (
            "transient",
            pr.max_transient_bytes as f64,
            units::bytes(pr.max_transient_bytes),
        ),
        // The fixed part: the runtime's own and, under FSDP2, what its collectives' streams
        // keep cached.
        (
            "runtime",
            (pr.overhead_bytes + pr.side_pool_bytes) as f64,
            units::bytes(pr.overhead_bytes + pr.side_pool_bytes),
        ),
    ];
    let step = pr.step_time_s.max(f64::MIN_POSITIVE);
    let pct = |s: f64| format!("{:.0}%", 100.0 * s / step);
    let time = [
        ("compute", pr.compute_s, pct(pr.compute_s)),
        ("recompute", pr.recompute_s, pct(pr.recompute_s)),
        ("comm", pr.exposed_comm_s, pct(pr.exposed_comm_s)),
        ("optimizer", pr.optimizer_s, pct(pr.optimizer_s)),
        ("overhead", pr.step_overhead_s, pct(pr.step_overhead_s)),
    ];
    let line = |title: &'static str,
                parts: &[(&'static str, f64, String)],
                colors: &[ratatui::style::Color],
                whole: f64| {
        let mut spans = vec![Span::raw(title)];
        let mut used = 0;
        for ((_, v, _), &c) in parts.iter().zip(colors) {
            let cells = ((v / whole) * bar_width as f64).round() as usize;
            let cells = cells.min(bar_width - used);
            used += cells;
            spans.push(Span::styled("█".repeat(cells), Style::new().fg(c)));
        }
        spans.push(Span::styled("·".repeat(bar_width - used), theme::MUTED));
        for ((name, v, label), &c) in parts.iter().zip(colors) {
            if *v <= 0.0 {
                continue;
            }
            spans.push(Span::styled(" ■", Style::new().fg(c)));
            spans.push(Span::raw(format!(" {name} {label}")));
        }
        Line::from(spans)
    };
    // A part's name and size that do not fit are dropped whole, the last part first (its
    // colour stays in the bar): never `■ transient 2.` or a `■` with no name. `keep`: the
    // spans before the names (the title, the bar, and the host's figures).
    let fit = |mut line: Line<'static>, keep: usize| {
        while line.width() > width && line.spans.len() >= keep + 2 {
            let n = line.spans.len();
            line.spans.truncate(n - 2);
        }
        line
    };
    let whole = (budget.max(pr.peak_memory_bytes) as f64).max(1.0);
    let mut memory_line = line("memory ", &memory, &theme::MEMORY_PARTS, whole);
    let mut memory_keep = 1 + MEMORY_PARTS_SPANS;
    // Right after the bar: the parts' names are what a narrow terminal cuts.
    if let Some(host) = host_budget {
        let offloaded = Choice::DP.offloaded(osdp_core::cost::Offload::Opt);
        memory_line.spans.insert(
            1 + MEMORY_PARTS_SPANS,
            Span::styled(
                format!(
                    " host {} / {}",
                    units::bytes(pr.host_bytes),
                    units::bytes(host)
                ),
                Style::new().fg(theme::strategy(offloaded)),
            ),
        );
        memory_keep += 1;
    }
    [
        fit(memory_line, memory_keep),
        fit(
            line("time   ", &time, &theme::TIME_PARTS, step),
            2 + time.len(),
        ),
    ]
}

/// The whole model in one line, coloured by strategy (ops with parameters only).
/// The views, the one on screen marked: `1 plan  2 graph  3 GPUs  4 training`.
fn draw_tabs(app: &App, f: &mut Frame, area: Rect) {
    let mut spans: Vec<Span> = Vec::new();
    for (k, v) in View::ALL.iter().enumerate() {
        let label = format!(" {} {} ", k + 1, v.name());
        spans.push(if *v == app.view {
            Span::styled(label, Style::new().add_modifier(Modifier::REVERSED))
        } else {
            Span::styled(label, theme::MUTED)
        });
    }
    spans.push(Span::styled(" · v next view", theme::MUTED));
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn draw_strip(app: &App, f: &mut Frame, area: Rect) {
    let Some(p) = app.planned() else {
        return;
    };
    let owners: Vec<usize> = (0..app.model.ops.len())
        .filter(|&i| p.plan.choices[i].strategy != Strategy::None)
        .collect();
    if owners.is_empty() {
        return;
    }
    let width = area.width as usize;
    let spans: Vec<Span> = (0..width)
        .map(|x| {
            let i = owners[x * owners.len() / width];
            let c = p.plan.choices[i];
            // A letter on the strategy's colour: without colour the letters still read.
            Span::styled(
                theme::strategy_letter(c).to_string(),
                Style::new()
                    .fg(ratatui::style::Color::Black)
                    .bg(theme::strategy(c)),
            )
        })
        .collect();
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// A collapsed block's strategy cell: the choice most of its parameter-owning ops take, `*` when
/// some differ (the graph panel names them), and `rc` when the block is recomputed (`rc+w` when
/// it keeps the weights its recomputation fetches).
fn block_badge(app: &App, b: usize, recompute: bool) -> Line<'static> {
    let Some(p) = app.planned() else {
        return Line::from("");
    };
    let choices: Vec<Choice> = app.blocks.ops[b]
        .iter()
        .map(|&i| p.plan.choices[i])
        .filter(|c| c.strategy != Strategy::None)
        .collect();
    let most = choices
        .iter()
        .max_by_key(|c| choices.iter().filter(|d| d == c).count())
        .copied();
    let mut spans = Vec::new();
    if let Some(c) = most {
        let mixed = choices.iter().any(|&d| d != c);
        spans.push(Span::styled(
            format!("{}{}", c.short_label(), if mixed { "*" } else { "" }),
            Style::new()
                .fg(theme::strategy(c))
                .add_modifier(Modifier::BOLD),
        ));
    }
    // A recomputation the user fixed (`R`) carries a pin, as pinned ops do.
    let keeps = if p.plan.keeps(b) { "+w" } else { "" };
    match (recompute, app.recompute_fixed(b).is_some()) {
        (true, fixed) => spans.push(Span::styled(
            format!(" rc{keeps}{}", if fixed { "📌" } else { "" }),
            theme::RECOMPUTE,
        )),
        (false, true) => spans.push(Span::styled(" no rc📌", theme::RECOMPUTE)),
        (false, false) => {}
    }
    Line::from(spans)
}

/// An op's kind as the operator table shows it: whole in its 13 columns.
fn kind_label(kind: osdp_core::model::OpKind) -> &'static str {
    match kind {
        osdp_core::model::OpKind::PositionalEmbedding => "pos_embedding",
        other => other.as_str(),
    }
}

fn draw_ops(app: &App, f: &mut Frame, area: Rect) {
    let plan = app.planned();
    let total_time = plan.map_or(1.0, |p| p.prediction.step_time_s);
    let rows = app.rows();
    // Narrow screens drop the kind and parameter columns; the narrowest give sizes as `386M`.
    let narrow = area.width < 90;
    let compact = area.width < 60;
    let size = |b: u64| {
        if compact {
            short_bytes(b)
        } else {
            units::bytes(b)
        }
    };
    let focused = app.focus == Focus::Ops;
    let border = theme::border(focused);
    let mut widths = vec![
        Constraint::Min(18),
        Constraint::Length(13),
        Constraint::Length(9),
        Constraint::Length(13),
        Constraint::Length(11),
        Constraint::Length(6),
    ];
    let mut titles = vec!["operator", "kind", "params", "strategy", "memory", "time"];
    if narrow {
        // The strategy column as wide as the plan's longest label (`zero3/4:4`,
        // `zero2+ofl-opt`, and a pin's mark); the operator's name gets the rest.
        let label = plan
            .map(|p| {
                p.plan
                    .choices
                    .iter()
                    .map(|c| c.short_label().chars().count())
                    .max()
                    .unwrap_or(8)
            })
            .unwrap_or(8);
        let pin = if app.request.pins.is_empty() { 0 } else { 3 };
        widths = vec![
            Constraint::Min(12),
            Constraint::Length((label + pin).clamp(8, 16) as u16),
            Constraint::Length(if compact { 5 } else { 9 }),
            Constraint::Length(if compact { 5 } else { 6 }),
        ];
        titles = vec![
            "operator",
            "strategy",
            if compact { "mem" } else { "memory" },
            "time",
        ];
    }
    // What the name column gets: the panel less its borders, the other columns and the
    // spaces between them.
    let fixed: u16 = widths
        .iter()
        .skip(1)
        .map(|c| match c {
            Constraint::Length(n) => *n + 1,
            _ => 1,
        })
        .sum();
    let name_width = usize::from(area.width.saturating_sub(2 + fixed));
    let mk = |mut cells: Vec<Cell<'static>>| -> TableRow<'static> {
        if narrow {
            cells.drain(1..3);
        }
        TableRow::new(cells)
    };
    let table_rows: Vec<TableRow> = rows
        .iter()
        .map(|row| match *row {
            Row::Block(b) => {
                let ops = &app.blocks.ops[b];
                let (mem, time) = plan.map_or((0, 0.0), |p| {
                    (
                        ops.iter()
                            .map(|&i| p.prediction.ops[i].memory_bytes)
                            .sum::<u64>(),
                        ops.iter().map(|&i| p.prediction.ops[i].time_s).sum::<f64>(),
                    )
                });
                let params: u64 = ops
                    .iter()
                    .map(|&i| ModelSpec::op_param_count(&app.model.ops[i]))
                    .sum();
                let recompute = plan.is_some_and(|p| p.plan.recompute[b]);
                let marker = if app.expanded.contains(&b) {
                    "▾"
                } else {
                    "▸"
                };
                mk(vec![
                    Cell::from(format!("{marker} block {b}")).bold(),
                    Cell::from(format!("{} ops", ops.len())),
                    Cell::from(units::count(params)),
                    Cell::from(block_badge(app, b, recompute)),
                    Cell::from(size(mem)),
                    Cell::from(percent(time / total_time)),
                ])
            }
            Row::Op(i) => {
                let op = &app.model.ops[i];
                let choice = plan.map_or(Choice::NONE, |p| p.plan.choices[i]);
                let pinned = app.pin_of(i).is_some();
                let (mem, time) = plan.map_or((0, 0.0), |p| {
                    (p.prediction.ops[i].memory_bytes, p.prediction.ops[i].time_s)
                });
                // Narrow: one column of indent, so that `h10.attn.c_proj` shows whole.
                let indent = match (op.block.is_some(), narrow) {
                    (false, _) => "",
                    (true, true) => " ",
                    (true, false) => "   ",
                };
                let room = name_width.saturating_sub(indent.len());
                mk(vec![
                    Cell::from(format!("{indent}{}", fit_name(&printable(&op.id), room))),
                    Cell::from(kind_label(op.kind)),
                    Cell::from(units::count(ModelSpec::op_param_count(op))),
                    Cell::from(format!(
                        "{}{}",
                        choice.short_label(),
                        if pinned { " 📌" } else { "" }
                    ))
                    .style(
                        Style::new()
                            .fg(theme::strategy(choice))
                            .add_modifier(Modifier::BOLD),
                    ),
                    Cell::from(size(mem)),
                    Cell::from(percent(time / total_time)),
                ])
            }
        })
        .collect();
    let table = Table::new(table_rows, widths)
        .header(TableRow::new(titles).style(Style::new().bold().underlined()))
        .block(
            Block::bordered()
                .title(ops_title(app, rows.len()))
                .title_bottom(fit_legend(
                    strategy_legend(
                        false,
                        app.machine.offers_offload(),
                        Some(app.request.target),
                    ),
                    usize::from(area.width.saturating_sub(2)),
                ))
                .border_style(border)
                .border_type(theme::border_type(focused)),
        )
        .row_highlight_style(theme::SELECTED);
    let mut state = TableState::default()
        .with_selected(Some(app.selected_row.min(rows.len().saturating_sub(1))));
    f.render_stateful_widget(table, area, &mut state);
    let mut hit = app.hit.get();
    hit.ops = area;
    hit.ops_offset = state.offset();
    app.hit.set(hit);
}

/// A size in at most five columns for the narrow operator table: `386M`, `1.6G`, `64K`, `0B`.
fn short_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b}B")
    } else if v < 10.0 {
        format!("{v:.1}{}", UNITS[u])
    } else {
        format!("{v:.0}{}", UNITS[u])
    }
}

/// An operator's name in `width` columns: whole when it fits, else its last parts (between
/// dots) after `…` (`…self_attn.q_proj`: the block's prefix goes first, and the row sits under
/// its block), else the last part cut between words (`…post_attention…`).
fn fit_name(name: &str, width: usize) -> String {
    let len = |s: &str| s.chars().count();
    if len(name) <= width {
        return name.to_string();
    }
    let mut tail = String::new();
    for part in name.rsplit('.') {
        let longer = if tail.is_empty() {
            part.to_string()
        } else {
            format!("{part}.{tail}")
        };
        if len(&longer) + 1 > width {
            break;
        }
        tail = longer;
    }
    if !tail.is_empty() {
        return format!("…{tail}");
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    let keep = width.saturating_sub(2);
    let room: String = last.chars().take(keep).collect();
    // Cut where a word of the name ends (`post_attention` of `post_attention_layernorm`).
    let cut = match last.chars().nth(keep) {
        None | Some('_') => room.len(),
        Some(_) => room
            .rfind('_')
            .filter(|&k| k >= room.len() / 2)
            .unwrap_or(room.len()),
    };
    format!("…{}…", &room[..cut])
}

/// A share in at most five columns: `3.1%`, `100%`.
fn percent(share: f64) -> String {
    let p = 100.0 * share;
    if p >= 99.95 {
        format!("{p:.0}%")
    } else {
        format!("{p:.1}%")
    }
}

/// The operator panel's title: where the cursor is among the operators (`123/486`), and the
/// filter with its count while one is on (`/attn · 3/48 matches`).
fn ops_title(app: &App, rows: usize) -> String {
    let ops = app.model.ops.len();
    match &app.op_filter {
        Some(q) => format!(
            " operators /{} · {}/{rows} matches ",
            printable(q),
            (app.selected_row + 1).min(rows)
        ),
        None => {
            let at = app.selected_op().map_or(0, |op| op + 1);
            format!(" operators · {at}/{ops} ")
        }
    }
}

/// The best throughput the frontier `curve` (memory, samples/s) offers within `budget`.
fn throughput_within(curve: &[(u64, f64)], budget: u64) -> Option<f64> {
    curve
        .iter()
        .filter(|&&(m, _)| m <= budget)
        .map(|&(_, t)| t)
        .reduce(f64::max)
}

/// An axis label with as many decimals as the axis' span needs (no two labels read "0").
fn tick(v: f64, span: f64) -> String {
    match span {
        s if s >= 20.0 => format!("{v:.0}"),
        s if s >= 2.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

/// The frontier: the best samples/s at every per-GPU budget, the budget as a cursor, and what
/// one press of + or - would gain or cost.
fn draw_frontier(app: &App, f: &mut Frame, area: Rect) {
    let Some(ready) = &app.plan else {
        let block = Block::bordered().title(" samples/s vs budget (GiB) ");
        f.render_widget(Paragraph::new("planning…").block(block), area);
        return;
    };
    let budget = app.budget();
    // Plans keep the headroom free: what a budget buys is what fits within its usable part.
    let within = |b: u64| {
        throughput_within(
            &ready.curve,
            osdp_core::plan::request::usable(b, app.request.headroom),
        )
    };
    let now = within(budget);
    // A change `{:+.1}` would print as ±0.0 (a slow model: 2.6/s gaining 0.012) keeps two
    // significant digits.
    let signed = |d: f64| {
        let sign = if d < 0.0 { '−' } else { '+' };
        if d == 0.0 || d.abs() >= 0.05 {
            format!("{sign}{:.1}", d.abs())
        } else {
            format!("{sign}{}", units::figure(d.abs(), 1))
        }
    };
    let delta = |up: bool| {
        let b = super::app::budget_step(budget, up);
        let t = within(b);
        let step = units::bytes(b.abs_diff(budget));
        let sign = if up { '+' } else { '−' };
        match (now, t) {
            (Some(a), Some(b)) => format!("{sign}{step} {}", signed(b - a)),
            (_, None) => format!("{sign}{step} no fit"),
            (None, Some(b)) => format!("{sign}{step} {}", units::figure(b, 1)),
        }
    };
    let mut block = Block::bordered().title(" samples/s vs budget (GiB) ");
    if let Some(t) = now {
        // What − would cost goes first where the edge is short: nothing is cut.
        let room = usize::from(area.width.saturating_sub(2));
        let t = units::figure(t, 1);
        let full = format!(" {t}/s · {} · {} ", delta(true), delta(false));
        let short = format!(" {t}/s · {} ", delta(true));
        block = block.title_bottom(if full.chars().count() <= room {
            full
        } else {
            short
        });
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let pts: Vec<(f64, f64)> = ready.curve.iter().map(|&(m, t)| (gib(m), t)).collect();
    if pts.is_empty() {
        // Host memory priced: nothing says what each budget buys within the host budget.
        let text = if ready.host_priced {
            let gap = ready.result.as_ref().ok().and_then(|p| p.host_gap_s);
            format!("no curve: {}", Planned::host_priced_note(gap))
        } else {
            "no plan fits any budget".to_string()
        };
        f.render_widget(
            Paragraph::new(text).wrap(Wrap { trim: true }).block(block),
            area,
        );
        return;
    }
    let x_max = gib(app.layout.memory_bytes()).max(gib(budget));
    let pts: Vec<(f64, f64)> = pts.into_iter().filter(|p| p.0 <= x_max).collect();
    if pts.is_empty() {
        f.render_widget(
            Paragraph::new("no plan fits the device's memory").block(block),
            area,
        );
        return;
    }
    // From a little below the smallest budget that fits (or the cursor, if lower).
    let first = pts.first().map_or(0.0, |p| p.0).min(gib(budget));
    let x_min = (first - 0.05 * (x_max - first)).max(0.0);
    let y_max = pts.iter().map(|p| p.1).fold(0.0f64, f64::max) * 1.1;
    // The curve as a staircase: the best throughput at every budget.
    let mut stairs: Vec<(f64, f64)> = Vec::new();
    for w in pts.windows(2) {
        stairs.push(w[0]);
        stairs.push((w[1].0, w[0].1));
    }
    stairs.push(*pts.last().expect("non-empty"));
    stairs.push((x_max, pts.last().expect("non-empty").1));
    let cursor = [(gib(budget), 0.0), (gib(budget), y_max)];
    let datasets = vec![
        Dataset::default()
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(theme::GOOD)
            .data(&stairs),
        Dataset::default()
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(theme::LIMIT)
            .data(&cursor),
    ];
    let x_span = x_max - x_min;
    let chart = Chart::new(datasets)
        .block(block)
        .x_axis(Axis::default().bounds([x_min, x_max]).labels(vec![
            Span::raw(tick(x_min, x_span)),
            Span::raw(tick((x_min + x_max) / 2.0, x_span)),
            Span::raw(tick(x_max, x_span)),
        ]))
        .y_axis(Axis::default().bounds([0.0, y_max]).labels(vec![
            Span::raw("0"),
            Span::raw(tick(y_max / 2.0, y_max)),
            Span::raw(tick(y_max, y_max)),
        ]));
    f.render_widget(chart, area);
}

/// What each strategy colour means (the operators panel's bottom edge; `long` in help).
/// `offload`: the layout offers offload (its colour is listed only then); `target`: only the
/// choices it can run (help lists them all).
fn strategy_legend(long: bool, offload: bool, target: Option<Target>) -> Line<'static> {
    let badge = |label: String, c: Choice| Span::styled(label, Style::new().fg(theme::strategy(c)));
    let runs = |c: Choice| target.is_none_or(|t| t.allows(c).is_ok());
    let mut spans = vec![Span::raw(" ")];
    for s in Strategy::for_params() {
        if !runs(Choice::plain(s)) {
            continue;
        }
        spans.push(badge(format!("{} ", s.as_str()), Choice::plain(s)));
        if s == Strategy::Zero3 && runs(Choice::zero3(2, 1)) {
            let split = if long {
                "zero3/K:M (split K, M sharded) "
            } else {
                "zero3/K:M "
            };
            spans.push(badge(split.into(), Choice::zero3(2, 1)));
        }
    }
    if offload {
        spans.push(badge(
            "+offload ".into(),
            Choice::DP.offloaded(osdp_core::cost::Offload::Opt),
        ));
    }
    spans.push(Span::styled("recompute ", theme::RECOMPUTE));
    Line::from(spans)
}

/// Rows of the main area under the header at screen size `screen` (as [`draw`] splits it).
fn main_rows(screen: (u16, u16)) -> u16 {
    let header = if screen.1 >= SPLIT_BARS_MIN_HEIGHT {
        6
    } else {
        4
    };
    screen.1.saturating_sub(header + 2)
}

/// Lines of the comparison on screen at once, at screen size `screen`.
pub fn compare_rows(screen: (u16, u16)) -> usize {
    usize::from(main_rows(screen).saturating_sub(2)).max(1)
}

/// The legend's entries that fit `width` columns, whole (the last ones go first).
/// `zero3/K:M` goes first: the strategy column's own labels say it.
fn fit_legend(mut legend: Line<'static>, width: usize) -> Line<'static> {
    if legend.width() > width {
        legend.spans.retain(|s| !s.content.starts_with("zero3/K:M"));
    }
    while legend.width() > width && legend.spans.len() > 1 {
        legend.spans.pop();
    }
    legend
}

/// The plan on screen against the running one (`c`), over the main area, from line `top`.
fn draw_compare(lines: &[String], top: usize, f: &mut Frame, area: Rect) {
    let w = 100.min(area.width);
    let h = (lines.len() as u16 + 2).min(area.height);
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    let room = usize::from(h.saturating_sub(2));
    let top = top.min(lines.len().saturating_sub(room));
    let text: Vec<Line> = lines
        .iter()
        .skip(top)
        .take(room)
        .map(|l| Line::from(l.clone()))
        .collect();
    let mut block =
        Block::bordered().title(" the plan on screen vs the running one · c or Esc closes ");
    if lines.len() > room {
        block = block.title_bottom(format!(
            " lines {}–{} of {} · ↑↓ PgUp/PgDn scroll ",
            top + 1,
            top + text.len(),
            lines.len()
        ));
    }
    f.render_widget(Clear, r);
    f.render_widget(Paragraph::new(text).block(block), r);
}

/// The help overlay's width, its lines and the rows it shows them in, in `area`: as narrow as
/// reads well, wider where the terminal is too short for the wrapped lines, and scrolled
/// where even the widest is too long.
fn help_layout(app: &App, area: Rect) -> (u16, Vec<Line<'static>>, usize) {
    // The footer's row stays: it names help's keys.
    let area = Rect {
        height: area.height.saturating_sub(1),
        ..area
    };
    let widest = area.width.min(116);
    let mut w = 76.min(area.width);
    let mut text = help_text(w, &app.help_filter);
    while text.len() as u16 + 2 > area.height && w + 4 <= widest {
        w += 4;
        text = help_text(w, &app.help_filter);
    }
    let rows = usize::from(area.height.saturating_sub(2)).max(1);
    (w, text, rows)
}

/// Help's lines in all and the rows that show them, at the app's last screen size.
pub fn help_rows(app: &App) -> (usize, usize) {
    let area = Rect::new(0, 0, app.screen.0, app.screen.1);
    let (_, text, rows) = help_layout(app, area);
    (text.len(), rows)
}

fn draw_help(app: &App, f: &mut Frame, area: Rect) {
    let (w, text, rows) = help_layout(app, area);
    let area = Rect {
        height: area.height.saturating_sub(1),
        ..area
    };
    let total = text.len();
    let h = (total.min(rows) as u16 + 2).min(area.height);
    let top = app.help_scroll.min(total.saturating_sub(rows));
    let shown: Vec<Line> = text.into_iter().skip(top).take(rows).collect();
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    let mut title = String::from(" help ");
    if !app.help_filter.is_empty() {
        title.push_str(&format!("· /{} ", printable(&app.help_filter)));
    }
    let mut block = Block::bordered().title(title);
    // Where the view is, when it does not show everything.
    if total > rows {
        block = block.title_bottom(format!(
            " lines {}–{} of {total} · ↑↓ j k PgUp PgDn scroll ",
            top + 1,
            top + shown.len()
        ));
    }
    f.render_widget(Clear, r);
    f.render_widget(Paragraph::new(shown).block(block), r);
}

/// The help overlay's lines at width `w` (border included): the keys, then the legends; only
/// what mentions `filter`.
fn help_text(w: u16, filter: &str) -> Vec<Line<'static>> {
    let mut text: Vec<Line> = keymap::help_lines(usize::from(w.saturating_sub(2)), filter)
        .into_iter()
        .map(Line::from)
        .collect();
    let calibration = [
        "uncalibrated: datasheet rates × efficiencies fitted to published runs;",
        "              `osdp-tui calibrate` measures this machine instead",
    ];
    let legend = strategy_legend(true, false, None);
    let offload = Line::from(vec![
        Span::styled(
            " +offload-opt, +offload-param",
            Style::new().fg(theme::strategy(
                Choice::DP.offloaded(osdp_core::cost::Offload::Opt),
            )),
        ),
        Span::raw(": state kept in host memory"),
    ]);
    let mut legends: Vec<Line> = Vec::new();
    if keymap::mentions(theme::STRIP_LETTERS, filter) {
        legends.push(Line::from(theme::STRIP_LETTERS));
    }
    if keymap::mentions(&calibration.concat(), filter) {
        legends.extend(calibration.map(Line::from));
    }
    for l in [legend, offload] {
        if keymap::mentions(&l.to_string(), filter) {
            legends.push(l);
        }
    }
    if !legends.is_empty() {
        text.push(Line::from(""));
        text.extend(legends);
    }
    if text.is_empty() {
        text.push(Line::styled(
            format!(
                "nothing in help mentions {:?} (Esc: all of it)",
                printable(filter)
            ),
            theme::WARN,
        ));
    }
    text
}

/// Lines of the selected block's DAG: one node per op in order, with the edges that skip ops
/// (residual branches) drawn as lanes on the left. Row 0 is the block's input.
pub fn graph_lines(app: &App, block: usize) -> Vec<Line<'static>> {
    let ops = &app.blocks.ops[block];
    let row_of = |id: &str| -> Option<usize> {
        ops.iter()
            .position(|&i| app.model.ops[i].id == id)
            .map(|p| p + 1)
    };
    // Edges (from row, to row) that skip at least one op.
    let mut edges: Vec<(usize, usize)> = Vec::new();
    for (p, &i) in ops.iter().enumerate() {
        let dst = p + 1;
        for input in &app.model.ops[i].inputs {
            let src = row_of(input).unwrap_or(0);
            if src + 1 < dst {
                edges.push((src, dst));
            }
        }
    }
    edges.sort_unstable();
    edges.dedup();
    let mut lane_end: Vec<usize> = Vec::new();
    let mut lanes: Vec<usize> = Vec::new();
    for &(src, dst) in &edges {
        let lane = match lane_end.iter().position(|&end| end < src) {
            Some(l) => l,
            None => {
                lane_end.push(0);
                lane_end.len() - 1
            }
        };
        lane_end[lane] = dst;
        lanes.push(lane);
    }
    let width = lane_end.len() * 2;
    let rows = ops.len() + 1;
    let mut grid = vec![vec![' '; width]; rows];
    for (&(src, dst), &lane) in edges.iter().zip(&lanes) {
        let x = width - 2 - 2 * lane;
        grid[src][x] = '┌';
        grid[dst][x] = '└';
        for row in grid.iter_mut().take(dst).skip(src + 1) {
            row[x] = '│';
        }
        for r in [src, dst] {
            for c in grid[r].iter_mut().skip(x + 1) {
                *c = match *c {
                    ' ' | '─' => '─',
                    '│' => '┼',
                    other => other,
                };
            }
        }
    }
    let plan = app.planned();
    let mut out = Vec::with_capacity(rows);
    for (r, gutter) in grid.into_iter().enumerate() {
        let gutter: String = gutter.into_iter().collect();
        if r == 0 {
            out.push(Line::from(format!("{gutter}○ block {block} input")));
            continue;
        }
        let i = ops[r - 1];
        let op = &app.model.ops[i];
        let choice = plan.map_or(Choice::NONE, |p| p.plan.choices[i]);
        let short = op
            .id
            .split_once('.')
            .map_or(op.id.as_str(), |(_, rest)| rest);
        let short = printable(short).into_owned();
        let mut spans = vec![
            Span::raw(gutter),
            Span::styled("● ", Style::new().fg(theme::strategy(choice))),
            Span::raw(format!("{short} ")),
            Span::styled(op.kind.as_str().to_string(), theme::MUTED),
        ];
        if choice.strategy != Strategy::None {
            spans.push(Span::styled(
                format!(" {}", choice.label()),
                Style::new().fg(theme::strategy(choice)).bold(),
            ));
        }
        out.push(Line::from(spans));
    }
    out
}

fn draw_graph(app: &App, f: &mut Frame, area: Rect) {
    let Some(b) = app.selected_block() else {
        let block = Block::bordered().title(" graph ");
        f.render_widget(
            Paragraph::new("select a block or one of its ops to see its graph").block(block),
            area,
        );
        return;
    };
    let recompute = app.planned().is_some_and(|p| p.plan.recompute[b]);
    let keeps = app.planned().is_some_and(|p| p.plan.keeps(b));
    let title = format!(
        " block {b} graph{}{} ",
        match (recompute, keeps) {
            (true, true) => " · recomputed, weights kept",
            (true, false) => " · recomputed",
            _ => "",
        },
        if app.recompute_fixed(b).is_some() {
            " (fixed: R)"
        } else {
            ""
        }
    );
    let mut lines = Vec::new();
    if let Some(p) = app.planned() {
        let run = app.blocks.run_of(&app.model, &p.plan, b);
        lines.push(Line::styled(
            format!("{}: {}", run.range(), run.description),
            theme::MUTED,
        ));
    }
    lines.extend(graph_lines(app, b));
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(Block::bordered().title(title)),
        area,
    );
}

/// `8 × 4 accum × 16 ranks`: how a step's samples are made.
fn batch_breakdown(p: &osdp_core::plan::Prediction) -> String {
    let ranks = p.ranks();
    if p.accumulation > 1 {
        format!(
            "{} × {} accum × {}",
            p.batch_size,
            p.accumulation,
            units::counted(ranks, "rank")
        )
    } else {
        format!("{} × {}", p.batch_size, units::counted(ranks, "rank"))
    }
}

/// The plan against the faster of a baseline with and without checkpointing, named with the
/// batch it runs at (`1.26× fsdp+ckpt @ 8`), or what it would need (`needs ≥ 25 GiB`); where
/// the baseline is ahead only as FSDP runs it, that said.
fn versus(
    pr: &osdp_core::plan::Prediction,
    baselines: &[(
        osdp_core::plan::baseline::Baseline,
        osdp_core::plan::baseline::Outcome,
    )],
    strategy: osdp_core::cost::Strategy,
) -> String {
    use osdp_core::plan::baseline::{best_of, Outcome};
    if let Some((b, p)) = best_of(baselines, strategy) {
        // Ahead only as FSDP runs it, which keeps a recomputed unit's weights gathered where
        // the trainer gathers them again (`plan` prints the same note).
        let plan = pr.throughput_samples_per_s;
        let why = if p.ahead_only_as_users_run_it(plan) {
            " (FSDP keeps recomputed weights)"
        } else {
            ""
        };
        return format!(
            "{:.2}× {} @ {}{why}",
            plan / p.prediction.throughput_samples_per_s,
            b.name(),
            p.prediction.batch_label()
        );
    }
    let needs = baselines
        .iter()
        .filter(|(b, _)| b.strategy == strategy)
        .filter_map(|(_, o)| match o {
            Outcome::Needs(n) => *n,
            Outcome::Fits(_) => None,
        })
        .min();
    match needs {
        Some(n) => format!("— needs ≥ {}", units::bytes(n)),
        None => "— does not fit".into(),
    }
}
