//! The memory panel: GPUs from NVML with the plan and the gap's parts beside each, or (without
//! NVML, or on the CPU layout) the ranks as the worker reports them. The figures come from
//! [`crate::tui::memory`]; this only lays them out.

use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::super::app::{App, Focus, GpuView};
use super::super::memory::{self, Gap, Measured, PlanMemory};
use super::super::theme;
use osdp_core::text::printable;
use osdp_core::units;

/// The most recent `width` samples as `▁▂▃▅▇`, scaled to `max`.
pub fn sparkline(values: &std::collections::VecDeque<u64>, max: u64, width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let skip = values.len().saturating_sub(width);
    values
        .iter()
        .skip(skip)
        .map(|&v| {
            let level = (v.min(max) * 7).checked_div(max).unwrap_or(0);
            BARS[level as usize]
        })
        .collect()
}

/// A memory bar over `scale` bytes: `█` `solid` bytes, then `▒` `estimated` bytes, `░` the
/// rest; `┊` at `mark` (the plan's predicted peak) and `│` at the budget, drawn over the rest.
fn bar(
    solid: u64,
    estimated: u64,
    mark: Option<u64>,
    budget: u64,
    scale: u64,
    width: usize,
) -> String {
    if scale == 0 || width == 0 {
        return String::new();
    }
    let cells = |b: u64| ((b.min(scale) as f64 / scale as f64) * width as f64).round() as usize;
    let last = width.saturating_sub(1);
    let (s, e) = (cells(solid), cells(solid.saturating_add(estimated)));
    let budget_at = cells(budget).min(last);
    let mark_at = mark.map(|m| cells(m).min(last));
    (0..width)
        .map(|x| {
            if x == budget_at {
                '│'
            } else if Some(x) == mark_at {
                '┊'
            } else if x < s {
                '█'
            } else if x < e {
                '▒'
            } else {
                '░'
            }
        })
        .collect()
}

/// The panel: GPUs when NVML reads them (and the layout's ranks are GPUs), else ranks.
pub fn draw_devices(app: &App, f: &mut Frame, area: Rect) {
    let mut hit = app.hit.get();
    hit.gpus = area;
    app.hit.set(hit);
    let focused = app.focus == Focus::Gpus;
    let border = theme::border(focused);
    let inner = usize::from(area.width.saturating_sub(2));
    let rows = usize::from(area.height.saturating_sub(2));
    let (title, lines, selected) = match &app.gpus {
        GpuView::Live(samples) if !memory::shows_ranks(app) => {
            let (lines, selected) = gpu_lines(app, samples, inner, rows);
            // One model of GPU (the usual machine): named once, in the title.
            let title = match samples.first() {
                Some(g) if samples.iter().all(|s| s.name == g.name) => {
                    format!(" GPUs · {} ", printable(&g.name))
                }
                _ => " GPUs ".into(),
            };
            (title, lines, selected)
        }
        _ => {
            let cpu = app.layout.device.kind == osdp_core::cluster::DeviceKind::Cpu;
            let (lines, selected) = rank_lines(app, inner);
            let title = if cpu { " ranks " } else { " GPUs " };
            (title.to_string(), lines, selected)
        }
    };
    // Keep the selected row's lines in view.
    let scroll = selected.end.saturating_sub(rows).min(selected.start);
    f.render_widget(
        Paragraph::new(lines)
            .block(
                Block::bordered()
                    .title(title)
                    .border_style(border)
                    .border_type(theme::border_type(focused)),
            )
            .scroll((scroll as u16, 0)),
        area,
    );
}

/// `items` on lines of `width` columns, ` · ` between them, as many on a line as fit; lines
/// after the first start with two spaces. An item wider than a line is broken between words
/// onto lines of its own (in its first span's style).
fn pack(items: Vec<Vec<Span<'static>>>, width: usize) -> Vec<Line<'static>> {
    let mut lines: Vec<Line> = Vec::new();
    let mut line: Vec<Span> = Vec::new();
    let (mut used, mut items_on_line) = (0, 0);
    for item in items {
        let n: usize = item.iter().map(Span::width).sum();
        if n + 2 > width && item.len() == 1 {
            if items_on_line > 0 {
                lines.push(Line::from(std::mem::take(&mut line)));
            }
            let style = item[0].style;
            let text: String = item.iter().map(|s| s.content.as_ref()).collect();
            for (k, l) in super::wrap_words(text.trim_start(), width.saturating_sub(2), 4)
                .into_iter()
                .enumerate()
            {
                let lead = if k == 0 && lines.is_empty() { "" } else { "  " };
                lines.push(Line::from(Span::styled(format!("{lead}{l}"), style)));
            }
            line.push(Span::raw("  "));
            (used, items_on_line) = (2, 0);
            continue;
        }
        if items_on_line > 0 && used + 3 + n > width {
            lines.push(Line::from(std::mem::take(&mut line)));
            line.push(Span::raw("  "));
            (used, items_on_line) = (2, 0);
        } else if items_on_line > 0 {
            line.push(Span::raw(" · "));
            used += 3;
        }
        used += n;
        items_on_line += 1;
        line.extend(item);
    }
    if items_on_line > 0 {
        lines.push(Line::from(line));
    }
    lines
}

fn item(text: String) -> Vec<Span<'static>> {
    vec![Span::raw(text)]
}

fn row_style(app: &App, i: usize) -> Style {
    if app.focus == Focus::Gpus && app.selected_gpu == i {
        Style::new().reversed()
    } else {
        Style::new()
    }
}

/// `5.0/80.0 GiB` (one unit for both when they share it), `—` for what was not measured.
fn used_of(used: Option<u64>, total: Option<u64>) -> String {
    let (Some(u), Some(t)) = (used, total) else {
        return format!(
            "{}/{}",
            used.map_or("—".into(), units::bytes),
            total.map_or("—".into(), units::bytes)
        );
    };
    let (u, t) = (units::bytes(u), units::bytes(t));
    match (u.rsplit_once(' '), t.rsplit_once(' ')) {
        (Some((n, unit)), Some((_, same))) if unit == same => format!("{n}/{t}"),
        _ => format!("{u}/{t}"),
    }
}

fn gpu_lines(
    app: &App,
    samples: &[crate::monitor::GpuSample],
    inner: usize,
    rows: usize,
) -> (Vec<Line<'static>>, std::ops::Range<usize>) {
    let figures = memory::gpus(app, samples);
    let bar_width = (inner / 3).clamp(8, 30);
    let wide = inner >= 76;
    let one_model = samples
        .iter()
        .all(|s| Some(&s.name) == samples.first().map(|g| &g.name));
    let mut groups: Vec<(usize, Vec<Line>)> = Vec::new();
    for (g, m) in samples.iter().zip(&figures) {
        let total = m.total_bytes.unwrap_or(0);
        let used = m.used_bytes.unwrap_or(0);
        let over = m.used_bytes.is_some_and(|u| u > m.budget_bytes);
        let mut items = vec![vec![
            Span::styled(format!("{}", g.index), row_style(app, g.index)),
            Span::raw(format!(
                " {} {}",
                bar(
                    used,
                    0,
                    m.plan.map(|p| p.peak_bytes),
                    m.budget_bytes,
                    total,
                    bar_width
                ),
                used_of(m.used_bytes, m.total_bytes)
            )),
        ]];
        if !one_model {
            items.push(item(printable(&g.name).into_owned()));
        }
        if let Some(p) = m.plan {
            items.push(item(format!("plan {}", units::bytes(p.peak_bytes))));
        }
        items.push(vec![
            Span::raw("budget "),
            Span::styled(
                units::bytes(m.budget_bytes),
                if over { theme::LIMIT } else { Style::new() },
            ),
        ]);
        items.push(item(format!(
            "util {}",
            g.utilization_pct
                .map_or("n/a".into(), |u| format!("{u:>3}%"))
        )));
        let procs: u64 = g.processes.iter().filter_map(|p| p.1).sum();
        items.push(item(format!(
            "{} proc{} {}",
            g.processes.len(),
            if g.processes.len() == 1 { "" } else { "s" },
            units::bytes(procs)
        )));
        let mut lines = pack(items, inner);
        match m.gap {
            Gap::NoRun => {}
            Gap::Measured(parts) => {
                let mut items = measured_items(parts, m.plan, wide);
                if let Some(first) = items.first_mut() {
                    first.insert(0, Span::raw("  "));
                }
                lines.extend(pack(items, inner));
            }
            Gap::Estimated { runtime_bytes } => {
                let items = vec![
                    item(format!(
                        "  not the plan's: runtime ≈{}",
                        units::bytes(runtime_bytes)
                    )),
                    item("estimated (CUDA context, NCCL, allocator)".into()),
                    item("the worker has not measured it yet".into()),
                ];
                lines.extend(
                    pack(items, inner)
                        .into_iter()
                        .map(|l| l.style(theme::MUTED)),
                );
            }
        }
        groups.push((g.index, lines));
    }
    // A memory history line per GPU when the panel has room for it.
    let needed: usize = groups.iter().map(|(_, l)| l.len() + 1).sum();
    let mut lines = Vec::new();
    let mut selected = 0..0;
    for (index, group) in groups {
        let start = lines.len();
        lines.extend(group);
        if needed <= rows {
            if let Some(h) = app.history.get(index) {
                let total = samples
                    .iter()
                    .find(|s| s.index == index)
                    .and_then(|s| s.total_bytes)
                    .unwrap_or(0);
                lines.push(Line::styled(
                    format!("  {}", sparkline(h, total, inner.saturating_sub(2))),
                    theme::SERIES,
                ));
            }
        }
        if app.selected_gpu == index {
            selected = start..lines.len();
        }
    }
    (lines, selected)
}

/// What the worker measured on a GPU: the tensors (beside the plan's), then what the plan does
/// not price, each with its measured size.
fn measured_items(m: Measured, plan: Option<PlanMemory>, wide: bool) -> Vec<Vec<Span<'static>>> {
    let [reserve, context, others] = if wide {
        ["allocator reserve", "CUDA context+NCCL", "other processes"]
    } else {
        ["reserve", "ctx+NCCL", "others"]
    };
    let mut items = Vec::new();
    if let Some(t) = m.tensors_bytes {
        let mut tensors = vec![Span::raw(format!("tensors {}", units::bytes(t)))];
        if let Some(p) = plan {
            tensors.push(Span::styled(
                format!(" (plan {})", units::bytes(p.tensors_bytes())),
                theme::MUTED,
            ));
        }
        items.push(tensors);
    }
    for (name, bytes, color) in [
        (reserve, m.reserve_bytes, theme::MEMORY_PARTS[2]),
        (context, m.context_bytes, theme::MEMORY_PARTS[3]),
        (others, m.others_bytes, theme::MEMORY_PARTS[3]),
    ] {
        if let Some(b) = bytes {
            items.push(vec![Span::styled(
                format!("{name} {}", units::bytes(b)),
                Style::new().fg(color),
            )]);
        }
    }
    items
}

fn rank_lines(app: &App, inner: usize) -> (Vec<Line<'static>>, std::ops::Range<usize>) {
    let r = memory::ranks(app);
    let cpu = app.layout.device.kind == osdp_core::cluster::DeviceKind::Cpu;
    let mut lines: Vec<Line> = Vec::new();
    if let GpuView::Unavailable(why) = &app.gpus {
        if !cpu {
            lines.push(Line::styled("live memory not available:", theme::WARN));
            let width = inner.saturating_sub(2);
            for l in super::wrap_words(&printable(why), width, 2) {
                lines.push(Line::styled(format!("  {l}"), theme::WARN));
            }
        }
    }
    // What the bars' lighter part is goes above the ranks, beside what their figures are: with
    // many ranks the panel's end is out of sight, and each rank's figure leaves the runtime out.
    let mut head = vec![item(match r.step {
        Some(s) => format!("measured peaks, step {s}"),
        None => "no step yet".into(),
    })];
    if let Some(p) = r.plan {
        head.push(item(format!(
            "▒ runtime ≈{}/rank, estimated",
            units::bytes(p.runtime_bytes)
        )));
    }
    lines.extend(pack(head, inner).into_iter().map(|l| l.style(theme::MUTED)));
    let bar_width = (inner / 4).clamp(8, 30);
    let mut selected = 0..0;
    for rank in &r.ranks {
        let start = lines.len();
        let plan_tensors = r.plan.map(|p| p.tensors_bytes());
        let runtime = r.plan.map_or(0, |p| p.runtime_bytes);
        // The measured peak when there is one, else the plan's; then the runtime's estimate.
        let solid = rank.measured_bytes.or(plan_tensors).unwrap_or(0);
        let scale = rank
            .budget_bytes
            .max(solid + runtime)
            .max(r.plan.map_or(0, |p| p.peak_bytes));
        let mut first = vec![
            Span::styled(format!("{}", rank.rank), row_style(app, rank.rank)),
            Span::raw(format!(
                " {}",
                bar(
                    solid,
                    runtime,
                    r.plan.map(|p| p.peak_bytes),
                    rank.budget_bytes,
                    scale,
                    bar_width,
                )
            )),
        ];
        let mut items = Vec::new();
        match rank.measured_bytes {
            Some(b) => {
                first.push(Span::styled(
                    format!(" {} measured", units::bytes(b)),
                    theme::SERIES,
                ));
                items.push(first);
                if let Some(t) = plan_tensors {
                    items.push(item(format!("plan {}", units::bytes(t))));
                }
            }
            None => {
                if let Some(t) = plan_tensors {
                    first.push(Span::raw(format!(" plan {}", units::bytes(t))));
                }
                items.push(first);
            }
        }
        items.push(item(format!("budget {}", units::bytes(rank.budget_bytes))));
        lines.extend(pack(items, inner));
        if app.selected_gpu == rank.rank {
            selected = start..lines.len();
        }
    }
    if r.plan.is_some() {
        let source = format!(
            "runtime not measured: {}",
            printable(&app.layout.runtime_overhead_gib.source)
        );
        lines.extend(
            pack(vec![item(source)], inner)
                .into_iter()
                .map(|l| l.style(theme::MUTED)),
        );
    }
    (lines, selected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_marks_the_plan_and_the_budget_over_what_is_used() {
        // 40 of 80 used, 20 estimated, the plan at 70 and the budget at 60, in 8 cells.
        assert_eq!(bar(40, 20, Some(70), 60, 80, 8), "████▒▒│┊");
        assert_eq!(
            bar(0, 0, None, 80, 80, 4),
            "░░░│",
            "the budget at the end stays visible"
        );
        assert_eq!(bar(1, 0, None, 1, 0, 4), "", "nothing to scale to");
    }

    #[test]
    fn items_pack_onto_lines_that_fit() {
        let items = [
            "0 ███ 5.0/80.0 GiB",
            "util 90%",
            "plan 7.7 GiB",
            "budget 8.0 GiB",
        ]
        .map(|t| item(t.into()))
        .to_vec();
        let text = |w| -> Vec<String> {
            pack(items.clone(), w)
                .iter()
                .map(|l| l.to_string())
                .collect()
        };
        assert_eq!(
            text(80),
            ["0 ███ 5.0/80.0 GiB · util 90% · plan 7.7 GiB · budget 8.0 GiB"]
        );
        assert_eq!(
            text(32),
            [
                "0 ███ 5.0/80.0 GiB · util 90%",
                "  plan 7.7 GiB · budget 8.0 GiB"
            ]
        );
        assert_eq!(used_of(Some(5 << 30), Some(80 << 30)), "5.0/80.0 GiB");
        assert_eq!(
            used_of(Some(512 << 20), Some(80 << 30)),
            "512.0 MiB/80.0 GiB"
        );
        assert_eq!(used_of(None, Some(80 << 30)), "—/80.0 GiB");
    }
}
