//! Drawing: reads the [`App`], never changes it.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Axis, Block, Cell, Chart, Clear, Dataset, GraphType, Paragraph, Row as TableRow, Table,
    TableState, Wrap,
};
use ratatui::Frame;

use super::app::{App, Confirm, Focus, GpuView, Row};
use crate::cost::{Choice, Strategy};
use crate::model::ModelSpec;
use crate::run::RunState;
use crate::text::printable;
use crate::units;

pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 24;

/// Colour of a strategy badge.
pub fn color(c: Choice) -> Color {
    match c.strategy {
        Strategy::None => Color::DarkGray,
        Strategy::Dp => Color::Blue,
        Strategy::Zero1 => Color::Cyan,
        Strategy::Zero2 => Color::Green,
        Strategy::Zero3 if c.split > 1 => Color::Magenta,
        Strategy::Zero3 => Color::Yellow,
    }
}

pub fn draw(app: &App, f: &mut Frame) {
    let area = f.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        let msg = format!(
            "terminal too small: osdp-tui needs at least {MIN_WIDTH}×{MIN_HEIGHT}, this one is {}×{}",
            area.width, area.height
        );
        f.render_widget(Paragraph::new(msg).wrap(Wrap { trim: true }), area);
        return;
    }
    let [header, strip, main, footer] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(1),
        Constraint::Min(10),
        Constraint::Length(1),
    ])
    .areas(area);
    draw_header(app, f, header);
    draw_strip(app, f, strip);
    // A run (going, or with history) gets a panel under the plan when there is room.
    let has_run = app.training.as_ref().is_some_and(|t| t.run.is_some());
    let main = if has_run && main.height >= 26 {
        let [top, panel] =
            Layout::vertical([Constraint::Min(12), Constraint::Length(12)]).areas(main);
        draw_training(app, f, panel);
        top
    } else {
        main
    };
    let [ops, right] =
        Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)]).areas(main);
    draw_ops(app, f, ops);
    if right.height >= 40 {
        // Tall screens show everything: GPUs, the selected block's graph, the frontier.
        let [gpus, graph, chart] = Layout::vertical([
            Constraint::Percentage(30),
            Constraint::Percentage(40),
            Constraint::Percentage(30),
        ])
        .areas(right);
        draw_gpus(app, f, gpus);
        draw_graph(app, f, graph);
        draw_frontier(app, f, chart);
    } else {
        let [gpus, lower] =
            Layout::vertical([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(right);
        draw_gpus(app, f, gpus);
        if app.show_graph {
            draw_graph(app, f, lower);
        } else {
            draw_frontier(app, f, lower);
        }
    }
    let footer_line = match (app.confirm, &app.message) {
        (Some(Confirm::StartUnpriced), _) => Line::from(Span::styled(
            " the plan on screen is still being priced: start with it anyway? y / n",
            Style::new().fg(Color::Black).bg(Color::Yellow),
        )),
        (Some(Confirm::QuitWhileRunning), _) => Line::from(Span::styled(
            " a run is going: d detach (the run keeps going) · s stop (checkpoint and stop) · esc cancel",
            Style::new().fg(Color::Black).bg(Color::Yellow),
        )),
        (Some(Confirm::RestartNewBatch { from, to }), _) => Line::from(Span::styled(
            format!(
                " restarting changes the global batch from {from} to {to} samples per step \
                 (B sets it): restart anyway? y / n"
            ),
            Style::new().fg(Color::Black).bg(Color::Yellow),
        )),
        (None, Some(m)) => Line::from(Span::styled(
            format!(" {}", printable(m)),
            Style::new().fg(Color::Yellow),
        )),
        (None, None) => Line::from(Span::styled(
            " +/- budget  ]/[ split  b/B batch  p pin  g graph  s start  x stop  r restart  ? help  q quit",
            Style::new().fg(Color::DarkGray),
        )),
    };
    f.render_widget(Paragraph::new(footer_line), footer);
    if let Some(d) = &app.detail {
        draw_detail(app, d, f, main);
    }
    if app.show_help {
        draw_help(f, area);
    }
}

/// Every choice the selected operator could have, priced as the whole plan with only that op
/// changed: Δ step time and Δ peak against the plan, and what stops the faster ones.
fn draw_detail(app: &App, detail: &super::app::OpDetail, f: &mut Frame, area: Rect) {
    let spec = &app.model.ops[detail.op];
    let alts = &detail.alternatives;
    let w = 104.min(area.width);
    let h = (alts.len() as u16 + 3).min(area.height);
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    let signed_ms = |s: f64| {
        if s == 0.0 {
            "±0".to_string()
        } else {
            format!("{:+.2} ms", s * 1e3)
        }
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
            TableRow::new(vec![
                Cell::from(Span::styled(
                    a.choice.label(),
                    Style::new().fg(color(a.choice)),
                )),
                Cell::from(signed_ms(a.delta_step_s)),
                Cell::from(signed_bytes(a.delta_peak_bytes)),
                Cell::from(units::bytes(a.persistent_bytes)),
                Cell::from(units::bytes(a.transient_bytes)),
                Cell::from(a.verdict.text()),
            ])
            .style(style)
        })
        .collect();
    let title = format!(
        " {} · {} · {} params · each choice priced in the plan · Enter closes ",
        printable(&spec.id),
        spec.kind.as_str(),
        units::count(ModelSpec::op_param_count(spec))
    );
    let table = Table::new(
        rows,
        [
            Constraint::Length(12),
            Constraint::Length(12),
            Constraint::Length(12),
            Constraint::Length(11),
            Constraint::Length(11),
            Constraint::Min(10),
        ],
    )
    .header(
        TableRow::new(vec![
            "choice",
            "Δ step",
            "Δ peak",
            "held",
            "transient",
            "why not",
        ])
        .style(Style::new().fg(Color::DarkGray)),
    )
    .block(Block::bordered().title(title));
    f.render_widget(Clear, r);
    f.render_widget(table, r);
}

fn draw_header(app: &App, f: &mut Frame, area: Rect) {
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
    if let Some(c) = &app.layout.calibration {
        title.push(Span::styled(
            format!(
                " · calibrated {}",
                printable(c.measured_at.get(..10).unwrap_or_default())
            ),
            Style::new().fg(Color::Green),
        ));
    } else {
        // Datasheet rates × efficiencies fitted to published runs (or generic ones):
        // `osdp-tui calibrate` measures the machine itself.
        title.push(Span::styled(
            " · uncalibrated",
            Style::new().fg(Color::Yellow),
        ));
    }
    if let Some(t) = &app.training {
        let state = t.state();
        let step = t
            .run
            .as_ref()
            .and_then(|r| r.status.last())
            .map(|p| format!(" step {}", p.step))
            .unwrap_or_default();
        title.push(Span::raw(" · run: "));
        title.push(Span::styled(
            format!("{}{step}", state.label()),
            Style::new().bold().fg(run_color(&state)),
        ));
    }
    let mut lines = vec![Line::from(title)];
    let budget = app.budget();
    let batch_mode = if app.batch.is_some() { "fixed" } else { "auto" };
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
                        "global batch {} = {} ({batch_mode}) · ",
                        pr.global_batch,
                        batch_breakdown(pr)
                    )
                } else {
                    format!(
                        "global batch {} = {}×{} · ",
                        pr.global_batch,
                        pr.batch_label(),
                        pr.global_batch / (pr.batch_size * pr.accumulation).max(1)
                    )
                };
                let mut spans = vec![
                    Span::raw(batch),
                    Span::styled(
                        format!("{:.1} samples/s", pr.throughput_samples_per_s),
                        Style::new().bold().fg(Color::Green),
                    ),
                    Span::raw(" · peak "),
                    Span::styled(
                        format!(
                            "{} / {}",
                            units::bytes(pr.peak_memory_bytes),
                            units::bytes(budget)
                        ),
                        Style::new().fg(if over { Color::Red } else { Color::Reset }),
                    ),
                    Span::raw(format!(" · step {}", units::seconds(pr.step_time_s))),
                ];
                if wide {
                    spans.push(Span::raw(format!(
                        " · {}/s tokens",
                        units::count(pr.tokens_per_s as u64)
                    )));
                }
                lines.push(Line::from(spans));
            }
            Err(nf) => lines.push(Line::from(Span::styled(
                format!(
                    "nothing fits {} per GPU; the smallest budget that fits is {}",
                    units::bytes(budget),
                    units::bytes(nf.min_budget_bytes)
                ),
                Style::new().fg(Color::Red).bold(),
            ))),
        },
    }
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
        Some((Ok(p), baselines)) => format!(
            "vs DDP {} · vs FSDP {} · ",
            versus(&p.prediction, baselines, crate::cost::Strategy::Dp),
            versus(&p.prediction, baselines, crate::cost::Strategy::Zero3)
        ),
        _ => String::new(),
    };
    lines.push(Line::from(format!(
        "budget {} per GPU · split ≤ {} · {} pinned · {versus_all}{}{}",
        units::bytes(budget),
        app.max_split,
        app.pins.len(),
        replan,
        if app.pending { " · planning…" } else { "" }
    )));
    if let Some(n) = &app.notice {
        lines.push(Line::from(Span::styled(
            n.clone(),
            Style::new().fg(Color::Yellow),
        )));
    }
    f.render_widget(Paragraph::new(lines), area);
}

/// The whole model in one line, coloured by strategy (ops with parameters only).
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
            Span::styled("▆", Style::new().fg(color(p.plan.choices[i])))
        })
        .collect();
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn draw_ops(app: &App, f: &mut Frame, area: Rect) {
    let plan = app.planned();
    let total_time = plan.map_or(1.0, |p| p.prediction.step_time_s);
    let rows = app.rows();
    // Narrow screens drop the kind and parameter columns.
    let narrow = area.width < 90;
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
                    Cell::from(if recompute { "recompute" } else { "" }).fg(Color::Magenta),
                    Cell::from(units::bytes(mem)),
                    Cell::from(format!("{:.1}%", 100.0 * time / total_time)),
                ])
            }
            Row::Op(i) => {
                let op = &app.model.ops[i];
                let choice = plan.map_or(Choice::NONE, |p| p.plan.choices[i]);
                let pinned = app.pin_of(i).is_some();
                let (mem, time) = plan.map_or((0, 0.0), |p| {
                    (p.prediction.ops[i].memory_bytes, p.prediction.ops[i].time_s)
                });
                let indent = if op.block.is_some() { "   " } else { "" };
                mk(vec![
                    Cell::from(format!("{indent}{}", printable(&op.id))),
                    Cell::from(op.kind.as_str()),
                    Cell::from(units::count(ModelSpec::op_param_count(op))),
                    Cell::from(format!(
                        "{}{}",
                        choice.label(),
                        if pinned { " 📌" } else { "" }
                    ))
                    .style(Style::new().fg(color(choice)).add_modifier(Modifier::BOLD)),
                    Cell::from(units::bytes(mem)),
                    Cell::from(format!("{:.1}%", 100.0 * time / total_time)),
                ])
            }
        })
        .collect();
    let border = if app.focus == Focus::Ops {
        Color::White
    } else {
        Color::DarkGray
    };
    let mut widths = vec![
        Constraint::Min(18),
        Constraint::Length(12),
        Constraint::Length(9),
        Constraint::Length(13),
        Constraint::Length(11),
        Constraint::Length(6),
    ];
    let mut titles = vec!["operator", "kind", "params", "strategy", "memory", "time"];
    if narrow {
        widths.drain(1..3);
        titles.drain(1..3);
    }
    let table = Table::new(table_rows, widths)
        .header(TableRow::new(titles).style(Style::new().bold().underlined()))
        .block(
            Block::bordered()
                .title(" operators ")
                .border_style(Style::new().fg(border)),
        )
        .row_highlight_style(Style::new().bg(Color::DarkGray));
    let mut state = TableState::default()
        .with_selected(Some(app.selected_row.min(rows.len().saturating_sub(1))));
    f.render_stateful_widget(table, area, &mut state);
}

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

/// `█████░░░│░░` with `│` at the budget.
fn bar(used: u64, total: u64, budget: u64, width: usize) -> String {
    if total == 0 || width == 0 {
        return String::new();
    }
    let cells = |b: u64| ((b.min(total) as f64 / total as f64) * width as f64).round() as usize;
    let (u, mark) = (cells(used), cells(budget).min(width.saturating_sub(1)));
    (0..width)
        .map(|x| {
            if x == mark {
                '│'
            } else if x < u {
                '█'
            } else {
                '░'
            }
        })
        .collect()
}

fn draw_gpus(app: &App, f: &mut Frame, area: Rect) {
    let border = if app.focus == Focus::Gpus {
        Color::White
    } else {
        Color::DarkGray
    };
    let block = Block::bordered()
        .title(" GPUs ")
        .border_style(Style::new().fg(border));
    let inner_width = area.width.saturating_sub(2) as usize;
    let bar_width = inner_width.saturating_sub(26).clamp(8, 40);
    let predicted = app.planned().map(|p| p.prediction.peak_memory_bytes);
    let mut lines: Vec<Line> = Vec::new();
    match &app.gpus {
        GpuView::Live(samples) => {
            // A memory history line per GPU when the panel has room for three lines each.
            let roomy = samples.len() * 3 <= area.height.saturating_sub(2) as usize;
            for g in samples {
                let budget = app.budgets.get(g.index).copied().unwrap_or(app.budget());
                let total = g.total_bytes.unwrap_or(0);
                let used = g.used_bytes.unwrap_or(0);
                let util = g
                    .utilization_pct
                    .map_or("n/a".into(), |u| format!("{u:>3}%"));
                let sel = app.focus == Focus::Gpus && app.selected_gpu == g.index;
                let style = if sel {
                    Style::new().reversed()
                } else {
                    Style::new()
                };
                let procs: u64 = g.processes.iter().filter_map(|p| p.1).sum();
                lines.push(Line::styled(
                    format!(
                        "{} {} · util {util} · {} procs ({})",
                        g.index,
                        printable(&g.name),
                        g.processes.len(),
                        units::bytes(procs)
                    ),
                    style,
                ));
                lines.push(Line::from(format!(
                    "  {} {}/{} · budget {}",
                    bar(used, total, budget, bar_width),
                    units::bytes(used),
                    units::bytes(total),
                    units::bytes(budget)
                )));
                if roomy {
                    if let Some(h) = app.history.get(g.index) {
                        lines.push(Line::styled(
                            format!("  {}", sparkline(h, total, inner_width.saturating_sub(2))),
                            Style::new().fg(Color::Cyan),
                        ));
                    }
                }
            }
        }
        GpuView::Unavailable(why) => {
            lines.push(Line::styled(
                "live memory not available:",
                Style::new().fg(Color::Yellow),
            ));
            lines.push(Line::styled(
                format!("  {}", printable(why)),
                Style::new().fg(Color::Yellow),
            ));
            let total = app.layout.memory_bytes();
            for (i, &budget) in app.budgets.iter().enumerate() {
                let sel = app.focus == Focus::Gpus && app.selected_gpu == i;
                let style = if sel {
                    Style::new().reversed()
                } else {
                    Style::new()
                };
                lines.push(Line::styled(
                    format!(
                        "{i} {} {} of {}",
                        bar(predicted.unwrap_or(0), total, budget, bar_width),
                        predicted.map(units::bytes).unwrap_or_default(),
                        units::bytes(budget),
                    ),
                    style,
                ));
            }
        }
    }
    f.render_widget(
        Paragraph::new(lines)
            .block(block)
            .wrap(Wrap { trim: false }),
        area,
    );
}

fn draw_frontier(app: &App, f: &mut Frame, area: Rect) {
    let block = Block::bordered().title(" samples/s vs budget (GiB) ");
    let Some(ready) = &app.plan else {
        f.render_widget(Paragraph::new("planning…").block(block), area);
        return;
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let pts: Vec<(f64, f64)> = ready.curve.iter().map(|&(m, t)| (gib(m), t)).collect();
    if pts.is_empty() {
        f.render_widget(Paragraph::new("no plan fits any budget").block(block), area);
        return;
    }
    let x_max = gib(app.layout.memory_bytes()).max(gib(app.budget()));
    let pts: Vec<(f64, f64)> = pts.into_iter().filter(|p| p.0 <= x_max).collect();
    if pts.is_empty() {
        f.render_widget(
            Paragraph::new("no plan fits the device's memory").block(block),
            area,
        );
        return;
    }
    let y_max = pts.iter().map(|p| p.1).fold(0.0f64, f64::max) * 1.1;
    // The curve as a staircase: the best throughput at every budget.
    let mut stairs: Vec<(f64, f64)> = Vec::new();
    for w in pts.windows(2) {
        stairs.push(w[0]);
        stairs.push((w[1].0, w[0].1));
    }
    stairs.push(*pts.last().expect("non-empty"));
    stairs.push((x_max, pts.last().expect("non-empty").1));
    let budget = [(gib(app.budget()), 0.0), (gib(app.budget()), y_max)];
    let datasets = vec![
        Dataset::default()
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(Color::Green))
            .data(&stairs),
        Dataset::default()
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(Color::Red))
            .data(&budget),
    ];
    let chart = Chart::new(datasets)
        .block(block)
        .x_axis(Axis::default().bounds([0.0, x_max]).labels(vec![
            Span::raw("0"),
            Span::raw(format!("{:.0}", x_max / 2.0)),
            Span::raw(format!("{x_max:.0}")),
        ]))
        .y_axis(
            Axis::default()
                .bounds([0.0, y_max])
                .labels(vec![Span::raw("0"), Span::raw(format!("{:.0}", y_max))]),
        );
    f.render_widget(chart, area);
}

fn run_color(state: &RunState) -> Color {
    match state {
        RunState::Idle | RunState::Stopped => Color::DarkGray,
        RunState::Starting | RunState::Checkpointing | RunState::Stopping => Color::Yellow,
        RunState::Running => Color::Green,
        RunState::Failed { .. } => Color::Red,
    }
}

/// The training panel: the run's progress and measured figures beside the plan's prediction,
/// and its loss curve.
fn draw_training(app: &App, f: &mut Frame, area: Rect) {
    let Some(t) = &app.training else {
        return;
    };
    let Some(run) = &t.run else {
        return;
    };
    let state = t.state();
    let [text_area, chart_area] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(area);
    let title = format!(
        " training: {} · {} ",
        state.label(),
        printable(&t.dir.0.display().to_string())
    );
    let block = Block::bordered()
        .title(title)
        .border_style(Style::new().fg(run_color(&state)));
    let mut lines: Vec<Line> = Vec::new();
    let pred = run.status.predicted.as_ref();
    let last = run.status.last();
    let plan_line = if let Some(owner) = run.owner() {
        Span::styled(
            format!(
                "attached, read-only: {}",
                printable(&super::app::owned_by(owner))
            ),
            Style::new().fg(Color::Cyan),
        )
    } else if app.plan_differs_from_run() {
        Span::styled(
            "the plan on screen differs from the run's: r restarts under it",
            Style::new().fg(Color::Yellow),
        )
    } else {
        Span::raw("the run uses the plan on screen")
    };
    lines.push(Line::from(plan_line));
    match last {
        Some(p) => {
            lines.push(Line::from(format!(
                "step {} · loss {:.4} · {} a step measured · {} predicted",
                p.step,
                p.loss,
                units::seconds(p.step_time_s),
                pred.map_or("—".into(), |x| units::seconds(x.step_time_s))
            )));
            let (ps, pt) = pred.map_or((0.0, 0.0), |x| (x.samples_per_s, x.tokens_per_s));
            lines.push(Line::from(format!(
                "samples/s {:.1} measured · {:.1} predicted",
                p.samples_per_s, ps
            )));
            lines.push(Line::from(format!(
                "tokens/s  {} measured · {} predicted",
                units::count(p.tokens_per_s as u64),
                units::count(pt as u64)
            )));
            let measured: Vec<String> = p.memory_bytes.iter().map(|&b| units::bytes(b)).collect();
            let predicted = pred
                .map(|x| {
                    format!(
                        "{} (+{} runtime)",
                        units::bytes(x.peak_memory_bytes.saturating_sub(x.runtime_overhead_bytes)),
                        units::bytes(x.runtime_overhead_bytes)
                    )
                })
                .unwrap_or_else(|| "—".into());
            lines.push(Line::from(format!(
                "memory/rank {} measured · {predicted} predicted",
                measured.join(" ")
            )));
        }
        None => lines.push(Line::from(match pred {
            Some(x) => format!(
                "waiting for the first step (predicted {} a step, global batch {})…",
                units::seconds(x.step_time_s),
                run.status.global_batch
            ),
            None => "waiting for the first step…".into(),
        })),
    }
    let ckpt = match (&run.status.last_checkpoint, run.last_checkpoint_at) {
        (Some((step, _)), Some(at)) => {
            format!(
                "last checkpoint: step {step}, {:.0} s ago",
                at.elapsed().as_secs_f64()
            )
        }
        (Some((step, _)), None) => format!("last checkpoint: step {step}"),
        (None, _) => "no checkpoint yet".into(),
    };
    lines.push(Line::from(ckpt));
    if state == RunState::Stopping {
        let finishing = match run.finishing() {
            Some((step, secs)) => format!("finishing step {step} (~{secs:.0} s)"),
            None => "stopping before the first step".into(),
        };
        lines.push(Line::from(Span::styled(
            format!("{finishing}, then a checkpoint; x again to kill"),
            Style::new().fg(Color::Yellow),
        )));
    }
    if let Some(note) = &run.note {
        lines.push(Line::from(Span::styled(
            printable(note).into_owned(),
            Style::new().fg(Color::Yellow).bold(),
        )));
    }
    if let RunState::Failed { why, log_tail } = &state {
        lines.push(Line::from(Span::styled(
            format!(
                "failed: {} · r restarts from the last checkpoint",
                printable(why)
            ),
            Style::new().fg(Color::Red).bold(),
        )));
        for l in log_tail.iter().rev().take(3).rev() {
            lines.push(Line::from(Span::styled(
                format!("  {}", printable(l)),
                Style::new().fg(Color::DarkGray),
            )));
        }
    }
    f.render_widget(
        Paragraph::new(lines)
            .block(block)
            .wrap(Wrap { trim: false }),
        text_area,
    );
    draw_loss(&run.status, f, chart_area);
}

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
        .style(Style::new().fg(Color::Cyan))
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

fn draw_help(f: &mut Frame, area: Rect) {
    let w = 68.min(area.width);
    let h = 22.min(area.height);
    let r = Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    );
    let text = vec![
        Line::from("+ / -      budget up / down (1 GiB steps; 16 MiB under 1 GiB)"),
        Line::from("           (the selected GPU's when the GPU panel has focus)"),
        Line::from("] / [      raise / lower the operator split limit"),
        Line::from("b          micro-batch: auto, then 1, 2, 4, … fixed"),
        Line::from("B          global batch: any (highest samples/s), then GPUs × 1, 2, 4, …"),
        Line::from("p          pin the selected op: dp, zero1, zero2, zero3, none"),
        Line::from("g          show the selected block's graph / the frontier chart"),
        Line::from("Tab        move focus between operators and GPUs"),
        Line::from("↑ ↓ PgUp PgDn  move          Enter  expand / collapse a block,"),
        Line::from("               or an operator's choices, priced (Enter closes)"),
        Line::from("s / x / r  start / stop (x twice: kill) / restart the training run"),
        Line::from("?          this help         q      quit"),
        Line::from("uncalibrated: datasheet rates × efficiencies fitted to published runs;"),
        Line::from("           `osdp-tui calibrate` measures this machine instead"),
        Line::from(""),
        Line::from(vec![
            Span::styled("dp ", Style::new().fg(color(Choice::DP))),
            Span::styled(
                "zero1 ",
                Style::new().fg(color(Choice::plain(Strategy::Zero1))),
            ),
            Span::styled(
                "zero2 ",
                Style::new().fg(color(Choice::plain(Strategy::Zero2))),
            ),
            Span::styled("zero3 ", Style::new().fg(color(Choice::zero3(1, 1)))),
            Span::styled(
                "zero3/K:M (split K, M sharded)",
                Style::new().fg(color(Choice::zero3(2, 1))),
            ),
        ]),
    ];
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(text).block(Block::bordered().title(" help ")),
        r,
    );
}

/// The block an operator row belongs to (for the graph view).
pub fn selected_block(app: &App) -> Option<usize> {
    match app.selected()? {
        Row::Block(b) => Some(b),
        Row::Op(i) => app.blocks.of_op[i],
    }
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
            Span::styled("● ", Style::new().fg(color(choice))),
            Span::raw(format!("{short} ")),
            Span::styled(
                op.kind.as_str().to_string(),
                Style::new().fg(Color::DarkGray),
            ),
        ];
        if choice.strategy != Strategy::None {
            spans.push(Span::styled(
                format!(" {}", choice.label()),
                Style::new().fg(color(choice)).bold(),
            ));
        }
        out.push(Line::from(spans));
    }
    out
}

fn draw_graph(app: &App, f: &mut Frame, area: Rect) {
    let Some(b) = selected_block(app) else {
        let block = Block::bordered().title(" graph ");
        f.render_widget(
            Paragraph::new("select a block or one of its ops to see its graph").block(block),
            area,
        );
        return;
    };
    let recompute = app.planned().is_some_and(|p| p.plan.recompute[b]);
    let title = format!(
        " block {b} graph{} ",
        if recompute { " · recomputed" } else { "" }
    );
    f.render_widget(
        Paragraph::new(graph_lines(app, b)).block(Block::bordered().title(title)),
        area,
    );
}

/// `8 × 4 accum × 16 ranks`: how a step's samples are made.
fn batch_breakdown(p: &crate::plan::Prediction) -> String {
    let ranks = p.global_batch / (p.batch_size * p.accumulation).max(1);
    if p.accumulation > 1 {
        format!(
            "{} × {} accum × {ranks} ranks",
            p.batch_size, p.accumulation
        )
    } else {
        format!("{} × {ranks} ranks", p.batch_size)
    }
}

/// The plan against the faster of a baseline with and without checkpointing, named with the
/// batch it runs at (`1.26× fsdp+ckpt @ 8`), or what it would need (`needs ≥ 25 GiB`).
fn versus(
    pr: &crate::plan::Prediction,
    baselines: &[(
        crate::plan::baseline::Baseline,
        crate::plan::baseline::Outcome,
    )],
    strategy: crate::cost::Strategy,
) -> String {
    use crate::plan::baseline::{best_of, Outcome};
    if let Some((b, p)) = best_of(baselines, strategy) {
        return format!(
            "{:.2}× {} @ {}",
            pr.throughput_samples_per_s / p.prediction.throughput_samples_per_s,
            b.name(),
            p.prediction.batch_label()
        );
    }
    let needs = baselines
        .iter()
        .filter(|(b, _)| b.strategy == strategy)
        .filter_map(|(_, o)| match o {
            Outcome::Needs(n) if *n < u64::MAX => Some(*n),
            _ => None,
        })
        .min();
    match needs {
        Some(n) => format!("— needs ≥ {}", units::bytes(n)),
        None => "— does not fit".into(),
    }
}
