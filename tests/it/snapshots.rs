//! Whole-screen snapshots through ratatui's `TestBackend` at the sizes people use, with a fake
//! GPU source; and the key-driven changes a user would see.

use osdp_core::cluster::read_layout;
use osdp_core::model::read_model;
use osdp_tui::monitor::{GpuEvent, GpuSample};
use osdp_tui::tui::app::{Action, App, Row};
use osdp_tui::tui::render_text;

use crate::root;

const GIB: u64 = 1 << 30;

/// gpt2-medium on 8×A100 at 8 GiB with two fake GPUs reporting, timings zeroed so the screen is
/// the same on every run.
fn app() -> App {
    let m = read_model(&root().join("sample-models/gpt2-medium.json")).unwrap();
    let l = read_layout(&root().join("layouts/a100-80gb-8x-nvlink.json")).unwrap();
    let mut a = App::new(m, l, vec![8 * GIB; 8], 8);
    a.replan();
    a.apply_gpu(GpuEvent::Samples(
        (0..8)
            .map(|i| GpuSample {
                index: i,
                name: "NVIDIA A100-SXM4-80GB".into(),
                used_bytes: Some((5 + i as u64) * GIB),
                total_bytes: Some(80 * GIB),
                utilization_pct: Some(90 + i as u32),
                processes: vec![(1000 + i as u32, Some((4 + i as u64) * GIB))],
                compute_capability: None,
            })
            .collect(),
    ));
    freeze(&mut a);
    a
}

fn freeze(a: &mut App) {
    if let Some(p) = a.plan.as_mut() {
        p.elapsed_ms = 0.0;
    }
}

#[test]
fn screen_80x24() {
    insta::assert_snapshot!(render_text(&app(), 80, 24));
}

#[test]
fn screen_120x40() {
    insta::assert_snapshot!(render_text(&app(), 120, 40));
}

#[test]
fn screen_200x60() {
    insta::assert_snapshot!(render_text(&app(), 200, 60));
}

#[test]
fn screen_too_small() {
    insta::assert_snapshot!(render_text(&app(), 70, 20));
}

#[test]
fn screen_with_help() {
    let mut a = app();
    a.update(Action::ToggleHelp);
    insta::assert_snapshot!(render_text(&a, 120, 40));
}

fn throughput(a: &App) -> f64 {
    a.planned()
        .expect("a plan fits")
        .prediction
        .throughput_samples_per_s
}

/// The plan's choices: each op's strategy and each block's recomputation.
fn strip(a: &App) -> Vec<String> {
    let p = &a.planned().expect("a plan fits").plan;
    let ops = p.choices.iter().map(|c| c.label());
    ops.chain(p.recompute.iter().map(|r| r.to_string()))
        .collect()
}

#[test]
fn lowering_the_budget_until_the_plan_changes() {
    let mut a = app();
    let (t0, s0) = (throughput(&a), strip(&a));
    let mut steps = 0;
    while strip(&a) == s0 && steps < 6 {
        a.update(Action::LowerBudget);
        steps += 1;
    }
    assert_ne!(strip(&a), s0, "six GiB less must change the plan");
    assert!(throughput(&a) < t0, "less memory, fewer samples/s");
    freeze(&mut a);
    insta::assert_snapshot!(render_text(&a, 120, 40));
}

#[test]
fn below_the_minimum_the_screen_says_what_would_fit() {
    let mut a = app();
    for _ in 0..7 {
        a.update(Action::LowerBudget);
    }
    freeze(&mut a);
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("nothing fits 1.0 GiB per GPU; the smallest budget that fits is"),
        "{screen}"
    );
    insta::assert_snapshot!(screen);
}

#[test]
fn enter_on_an_operator_shows_every_choice_priced() {
    let mut a = app();
    // Block 0 is expanded: its header, then its first op (a norm), then the qkv projection.
    let target = a
        .rows()
        .iter()
        .position(|r| matches!(r, Row::Op(i) if a.model.ops[*i].id == "h0.attn.c_attn"))
        .expect("block 0's qkv projection is listed");
    for _ in a.selected_row..target {
        a.update(Action::Down);
    }
    a.update(Action::Toggle);
    assert_eq!(
        a.detail.as_ref().map(|d| a.model.ops[d.op].id.as_str()),
        Some("h0.attn.c_attn")
    );
    let screen = render_text(&a, 120, 40);
    for want in ["why not", "chosen", "zero3/4:4", "Δ step"] {
        assert!(screen.contains(want), "{want}:\n{screen}");
    }
    insta::assert_snapshot!(screen);
    // Enter closes it again; Esc does too, without quitting.
    a.update(Action::Toggle);
    assert!(a.detail.is_none());
    a.update(Action::Toggle);
    a.update(Action::Quit);
    assert!(a.detail.is_none() && !a.quit);
}

/// Issue 19: on a tall screen the header splits the plan's peak into states, activations,
/// transient and runtime (their sizes add up to the peak shown above them), and the step into
/// compute, communication and optimizer; a 24-row screen keeps its rows for the operators.
#[test]
fn tall_screens_split_the_peak_and_the_step_into_parts() {
    let a = app();
    let p = a.planned().expect("a plan").prediction.clone();
    let screen = render_text(&a, 120, 40);
    let memory = screen
        .lines()
        .find(|l| l.starts_with("memory "))
        .unwrap_or_else(|| panic!("no memory bar:\n{screen}"));
    for (name, bytes) in [
        ("states", p.persistent_bytes),
        ("activations", p.activation_bytes),
        ("transient", p.max_transient_bytes),
        ("runtime", p.overhead_bytes),
    ] {
        let want = format!("{name} {}", osdp_core::units::bytes(bytes));
        assert!(memory.contains(&want), "{want:?} not in {memory:?}");
    }
    assert_eq!(
        p.persistent_bytes + p.activation_bytes + p.max_transient_bytes + p.overhead_bytes,
        p.peak_memory_bytes
    );
    let time = screen
        .lines()
        .find(|l| l.starts_with("time "))
        .unwrap_or_else(|| panic!("no time bar:\n{screen}"));
    assert!(time.contains("compute "), "{time}");
    let short = render_text(&a, 80, 24);
    assert!(!short.lines().any(|l| l.starts_with("memory ")), "{short}");
}

/// Issue 19: a CPU run of 100 steps, five steps in and 75 s after it began. The training panel
/// says how long it has gone and has left (95 steps × their measured mean, 0.2 s); the memory panel is
/// "ranks", each rank's measured peak beside the plan's and the budget, with the runtime the
/// worker does not measure marked as the layout's estimate. 80×24 has no room for the training
/// panel; the header still says the run's state and step.
#[test]
fn a_cpu_run_with_its_eta_and_each_ranks_memory() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let mut metrics = vec![started(2, Some(100))];
    metrics.extend((1..=5).map(|k| step(k, &[600 * MIB, 612 * MIB], None)));
    let exe = worker(dir.path(), &metrics, 3, "");
    let mut a = start(
        app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/cpu-eta",
    );
    poll_until(&mut a, "step 5", |a| last_step(a) == 5);
    at(&mut a, 75);
    let screen = render_text(&a, 120, 40);
    for want in [
        "elapsed 1 min 15 s · ETA 19 s (95 steps × 200.0 ms, recent mean)",
        "┌ ranks ",
        "0 ",
        "600.0 MiB measured",
        "612.0 MiB measured",
        "runtime ≈307.2 MiB/rank, estimated",
    ] {
        assert!(screen.contains(want), "{want:?} not in\n{screen}");
    }
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        let screen = mask_pid(&mask(&render_text(&a, w, h), "first step ", "│"));
        insta::assert_snapshot!(format!("cpu_run_{w}x{h}"), screen);
    }
    // Issue 19: at 80×24 the run's panel has no room beside the plan; the views show each
    // panel alone (`1`–`4`), named on the line under the header.
    let small = render_text(&a, 80, 24);
    assert!(
        small.contains(" 1 plan  2 graph  3 GPUs  4 training "),
        "{small}"
    );
    for (key, view) in [('2', "graph"), ('3', "gpus"), ('4', "training")] {
        a.update(
            osdp_tui::tui::action_for(
                crossterm::event::KeyCode::Char(key),
                crossterm::event::KeyModifiers::NONE,
            )
            .unwrap(),
        );
        for (w, h) in [(80, 24), (120, 40), (200, 60)] {
            let screen = mask_pid(&mask_wrapped(&mask(
                &render_text(&a, w, h),
                "first step ",
                "│",
            )));
            insta::assert_snapshot!(format!("view_{view}_{w}x{h}"), screen);
        }
    }
    let training = render_text(&a, 80, 24);
    assert!(training.contains("step 5 · loss"), "{training}");
    assert!(training.contains("ETA"), "{training}");
    a.update(Action::NextView);
    assert_eq!(
        a.view,
        osdp_tui::tui::app::View::Plan,
        "v wraps round to the plan"
    );
}

/// Issue 19: a run on four GPUs. Each GPU's row has NVML's reading beside the plan's peak and
/// the budget, and then what the worker measured on it: the tensors (beside the plan's), the
/// allocator's reserve, the CUDA context with NCCL's buffers, and the other processes.
#[test]
fn a_gpu_run_with_the_parts_of_each_gpus_memory() {
    use crate::stand_in::*;
    use osdp_core::protocol::DeviceMemory;
    let dir = tempfile::tempdir().unwrap();
    let device = DeviceMemory {
        allocated_peak_bytes: Some(14 * GIB),
        reserved_peak_bytes: Some(15 * GIB + GIB / 2),
        process_bytes: Some(17 * GIB),
    };
    let metrics = vec![
        started(4, None),
        step(1, &[13 * GIB; 4], Some(vec![device; 4])),
        step(2, &[13 * GIB; 4], Some(vec![device; 4])),
    ];
    let exe = worker(dir.path(), &metrics, 3, "");
    let mut a = start(
        app(
            "gpt2-medium",
            "rtx4090-4x-pcie",
            20 * GIB,
            Some(gpus(4, 17 * GIB + GIB / 2)),
        ),
        exe,
        "target/snapshot-runs/gpu-gap",
    );
    poll_until(&mut a, "step 2", |a| last_step(a) == 2);
    at(&mut a, 12);
    let screen = render_text(&a, 200, 60);
    for want in [
        "tensors 14.0 GiB (plan ",
        "allocator reserve 1.5 GiB",
        "CUDA context+NCCL 1.5 GiB",
        "other processes 512.0 MiB",
        "runs until stopped",
    ] {
        assert!(screen.contains(want), "{want:?} not in\n{screen}");
    }
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        let screen = mask_pid(&mask(&render_text(&a, w, h), "first step ", "│"));
        insta::assert_snapshot!(format!("gpu_run_{w}x{h}"), screen);
    }
}

/// Issue 19: `l` shows the worker's log over the screen, its tail in view, at every size; a
/// line longer than the screen is wrapped, not cut.
#[test]
fn the_workers_log_at_every_size() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let metrics = vec![started(2, None), step(1, &[600 * MIB, 612 * MIB], None)];
    let long = format!(
        "echo 'stopped: a long line{} and its end'",
        " ·".repeat(100)
    );
    let exe = worker(dir.path(), &metrics, 70, &long);
    let mut a = start(
        app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/log-view",
    );
    poll_until(&mut a, "71 log lines", |a| log_len(a) == 71);
    a.update(Action::ToggleLog);
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        a.screen = (w, h);
        let screen = render_text(&a, w, h);
        assert!(screen.contains("log line 70"), "{screen}");
        assert!(screen.contains("and its end"), "{screen}");
        insta::assert_snapshot!(format!("log_view_{w}x{h}"), mask_pid(&screen));
    }
}

/// The panel line after a masked "first step ####" line, masked too when it continues the
/// sentence (a narrow panel wraps it, and where it breaks depends on the measured time).
fn mask_wrapped(screen: &str) -> String {
    let lines: Vec<&str> = screen.lines().collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    for (k, line) in lines.iter().enumerate() {
        let after_mask = k > 0 && lines[k - 1].contains("first step #");
        match line.strip_prefix('│').and_then(|rest| rest.split_once('│')) {
            Some((text, tail)) if after_mask && text.trim_end().ends_with(')') => {
                let hidden: String = "#".repeat(text.chars().count());
                out.push(format!("│{hidden}│{tail}"));
            }
            _ => out.push((*line).to_string()),
        }
    }
    out.join("\n") + "\n"
}

/// The worker's pid in the header (` · pid 12345`) as `pid #`: it differs on every run.
fn mask_pid(screen: &str) -> String {
    let mut out = String::new();
    let mut rest = screen;
    while let Some(i) = rest.find(" · pid ") {
        let start = i + " · pid ".len();
        out.push_str(&rest[..start]);
        rest = rest[start..].trim_start_matches(|c: char| c.is_ascii_digit());
        out.push('#');
    }
    out.push_str(rest);
    out
}

/// The screen as text, its colours stripped first when `no_color` (as `NO_COLOR` draws it),
/// and the rows that carry reverse video (the selection).
fn render(a: &App, w: u16, h: u16, no_color: bool) -> (String, usize) {
    let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(w, h)).unwrap();
    t.draw(|f| {
        osdp_tui::tui::view::draw(a, f);
        if no_color {
            osdp_tui::tui::strip_colors(f.buffer_mut());
        }
    })
    .unwrap();
    let b = t.backend().buffer();
    let reversed = b
        .content
        .iter()
        .filter(|c| c.modifier.contains(ratatui::style::Modifier::REVERSED))
        .count();
    (render_text(a, w, h), reversed)
}

/// The header's fields: its lines under the title split at ` · ` and ` ■ `.
fn fields(line: &str) -> Vec<String> {
    line.split(" · ")
        .flat_map(|f| f.split(" ■ "))
        .map(|f| f.trim().to_string())
        .filter(|f| !f.is_empty())
        .collect()
}

/// The notice the dashboard opens with when it chose the global batch (the longest header
/// line a new user meets), and the driver's message on a machine without NVIDIA's driver.
fn as_a_new_user_meets_it(a: &mut App) {
    a.notice = Some(
        "global batch 1024 (1.05 M tokens per step, as published runs of a model this size use); \
         B changes it, --global-batch sets it (`any`: no accumulation, the fastest micro-batch that fits)"
            .into(),
    );
    if !matches!(a.gpus, osdp_tui::tui::app::GpuView::Live(_)) {
        a.apply_gpu(GpuEvent::Unavailable(
            "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded: cannot open shared object file)"
                .into(),
        ));
    }
}

/// The model on the layout at the layout's memory per GPU (as `osdp-tui MODEL --layout L`
/// opens), as a new user meets it.
fn opened(model: &str, layout: &str) -> App {
    let l = read_layout(&root().join(format!("layouts/{layout}.json"))).unwrap();
    let mut a = crate::stand_in::app(model, layout, l.memory_bytes(), None);
    as_a_new_user_meets_it(&mut a);
    a
}

/// Issue 34, item 5: what `screen` (`w`×`h`) shows is whole. The header's fields (split at
/// ` · ` and ` ■ `) are those of the same screen 400 columns wide, or dropped (one that does
/// not fit goes whole), or cut after a whole word with `…`; no text runs into a panel's
/// border; and every operator's row names an operator and gives its memory with a unit.
fn assert_nothing_cut(a: &App, screen: &str, w: u16, h: u16, what: &str) {
    let wide = render_text(a, 400, h);
    let header = if a.show_help {
        // Help is drawn over the header.
        0
    } else if a.log_view.is_some() {
        1
    } else if h >= 30 {
        6
    } else {
        4
    };
    for (k, (line, full)) in screen.lines().zip(wide.lines()).take(header).enumerate() {
        let whole = fields(full);
        for (i, field) in fields(line).iter().enumerate() {
            if k == 0 && i == 0 {
                // The title's description is shortened on purpose: whole names, closed
                // brackets.
                assert!(
                    field.ends_with(')') || field.ends_with(a.layout.name.as_str()),
                    "{what} {w}×{h}: {field:?}"
                );
                continue;
            }
            // A bar is as wide as the screen allows.
            if whole.contains(field)
                || (i == 0 && (line.starts_with("memory ") || line.starts_with("time ")))
            {
                continue;
            }
            if let Some(short) = field
                .strip_prefix("global batch ")
                .filter(|_| !field.ends_with('…'))
            {
                // The deliberate short form on narrow screens: `40 = 5×8` (micro-batch ×
                // ranks), the same global batch as the long one.
                let n = short.split(' ').next().unwrap();
                assert!(
                    whole
                        .iter()
                        .any(|f| f.starts_with(&format!("global batch {n} ")))
                        && short.ends_with(|c: char| c.is_ascii_digit()),
                    "{what} {w}×{h}: {field:?}"
                );
                continue;
            }
            if field.ends_with('…') {
                let kept = field.trim_end_matches('…');
                assert!(full.contains(kept), "{what} {w}×{h}: {field:?} in {full:?}");
                let next = full[full.find(kept).unwrap() + kept.len()..].chars().next();
                assert!(
                    next.is_none_or(|c| !c.is_alphanumeric()),
                    "{what} {w}×{h}: cut mid-word: {field:?}"
                );
                continue;
            }
            panic!("{what} {w}×{h}: {field:?} is cut; whole fields: {whole:?}\n{screen}");
        }
    }
    // Text that runs into a border was cut there (a chart's axis labels stand against their
    // axis and its right edge: `0.46│`, `│ 0.0   4.0   8.0│`).
    let grid: Vec<Vec<char>> = screen.lines().map(|l| l.chars().collect()).collect();
    // What a vertical edge at (y, x) starts from: the first other character above it.
    let top = |y: usize, x: usize| {
        (0..y)
            .rev()
            .map(|y| grid[y].get(x).copied().unwrap_or(' '))
            .find(|c| !"│║".contains(*c))
    };
    // A popup's edges stand over what it hides: its left one (`║ h0│choice`) under `┌` or
    // `╔`, its right one (`choice…│ted│`) under `┐` or `╗`.
    let left_edge = |y: usize, x: usize| top(y, x).is_some_and(|c| "┌╔".contains(c));
    let right_edge = |y: usize, x: usize| top(y, x).is_some_and(|c| "┐╗".contains(c));
    for (y, chars) in grid.iter().enumerate().skip(header) {
        for (x, pair) in chars.windows(2).enumerate() {
            if !(pair[0].is_alphanumeric() && "│║┐╗┘╝".contains(pair[1])) || left_edge(y, x + 1)
            {
                continue;
            }
            let edge = chars[..x].iter().rposition(|c| "│║".contains(*c));
            // Text right of a popup's right edge is what the popup hides the rest of, not
            // text cut by a border.
            if edge.is_some_and(|e| right_edge(y, e)) {
                continue;
            }
            let start = edge.map_or(0, |p| p + 1);
            let text: String = chars[start..=x].iter().collect();
            // A line that fills its panel exactly ends with a word the wide screen has
            // whole too.
            let last = text.rsplit(' ').next().unwrap_or_default();
            let whole_word = wide.match_indices(last).any(|(k, _)| {
                let before = wide[..k].chars().next_back();
                let after = wide[k + last.len()..].chars().next();
                before.is_none_or(|c| !c.is_alphanumeric())
                    && after.is_none_or(|c| !c.is_alphanumeric())
            });
            assert!(
                whole_word
                    || text
                        .chars()
                        .all(|c| c.is_ascii_digit() || c == '.' || c == ' '),
                "{what} {w}×{h}: {text:?} runs into the border:\n{screen}"
            );
        }
    }
    // The operators' table: each name is an operator's (whole, or its end after `…`), each
    // size has its unit.
    let lines: Vec<&str> = screen.lines().collect();
    let Some(top) = lines
        .iter()
        .position(|l| l.contains("operator ") && l.contains("strategy"))
    else {
        return;
    };
    if a.detail.is_some() || a.show_help {
        // A popup hides part of every row.
        return;
    }
    let head: Vec<char> = lines[top].chars().collect();
    let col = |name: &str| {
        let text: String = head.iter().collect();
        text.find(name).map(|b| text[..b].chars().count())
    };
    let (strategy, memory) = (
        col("strategy").unwrap(),
        col("mem").unwrap_or_else(|| panic!("{what} {w}×{h}: no memory column")),
    );
    for line in &lines[top + 1..] {
        let chars: Vec<char> = line.chars().collect();
        if chars.first() != Some(&'║') && chars.first() != Some(&'│') {
            break;
        }
        let cell = |from: usize, to: usize| -> String {
            chars[from.min(chars.len())..to.min(chars.len())]
                .iter()
                .collect::<String>()
                .trim()
                .to_string()
        };
        let name = cell(1, col("kind").unwrap_or(strategy));
        if name.is_empty() || name.starts_with(['▾', '▸']) {
            continue;
        }
        let known = a.model.ops.iter().any(|o| {
            o.id == name
                || name.strip_prefix('…').is_some_and(|tail| {
                    o.id.ends_with(tail)
                        || tail
                            .strip_suffix('…')
                            .is_some_and(|mid| o.id.contains(&format!(".{mid}_")))
                })
        });
        assert!(
            known,
            "{what} {w}×{h}: {name:?} names no operator\n{screen}"
        );
        let size = cell(memory, memory + 11);
        let words: Vec<&str> = size.split_whitespace().collect();
        let size = match words.as_slice() {
            [n, unit, ..] if ["B", "KiB", "MiB", "GiB", "TiB"].contains(unit) => {
                format!("{n} {unit}")
            }
            [n, ..] => n.to_string(),
            [] => String::new(),
        };
        assert!(
            size.ends_with('B') || size.ends_with(['K', 'M', 'G', 'T']),
            "{what} {w}×{h}: {size:?} has no unit\n{screen}"
        );
    }
}

/// The screen and the cells in reverse video (the selection), with and without colour; the
/// text is the same either way.
fn check_screen(a: &App, w: u16, h: u16, what: &str) {
    let (plain, marked) = render(a, w, h, false);
    let (stripped, marked_plain) = render(a, w, h, true);
    assert_eq!(plain, stripped, "NO_COLOR changes colours, not text");
    // Help covers the screen and has no cursor of its own.
    assert!(
        (marked > 0 || a.show_help) && marked_plain == marked,
        "{what} {w}×{h}: the selection shows"
    );
    assert_nothing_cut(a, &plain, w, h, what);
}

/// Issue 34, item 5: at 80×24, 120×40 and 200×60, with and without colour, in every view and
/// with help or an operator's choices open, for the models and layouts a new user starts
/// with: every field of the header is whole (one that does not fit is dropped, not cut), the
/// long notice and the driver's message are cut only between words, nothing runs into a
/// panel's edge, and the selection shows.
#[test]
fn nothing_is_cut_at_any_size_in_any_view_with_or_without_colour() {
    let mut live = app();
    as_a_new_user_meets_it(&mut live);
    let apps = [
        ("gpt2-medium on 8×A100, live GPUs", live),
        (
            "gpt2-xl on a100-80gb-8x-nvlink",
            opened("gpt2-xl", "a100-80gb-8x-nvlink"),
        ),
        (
            "llama-2-7b on rtx4090-1x",
            opened("llama-2-7b", "rtx4090-1x"),
        ),
        (
            "llama-2-13b on h100-sxm-2x8-ib-ndr",
            opened("llama-2-13b", "h100-sxm-2x8-ib-ndr"),
        ),
    ];
    for (what, mut a) in apps {
        for view in osdp_tui::tui::app::View::ALL {
            a.update(Action::ShowView(view));
            for (w, h) in [(80, 24), (120, 40), (200, 60)] {
                a.screen = (w, h);
                check_screen(&a, w, h, &format!("{what}, view {}", view.name()));
            }
        }
        a.update(Action::ShowView(osdp_tui::tui::app::View::Plan));
        // An operator inside block 0: its choices, priced.
        a.update(Action::Down);
        a.update(Action::Down);
        a.update(Action::Toggle);
        assert!(a.detail.is_some(), "{what}");
        for (w, h) in [(80, 24), (120, 40), (200, 60)] {
            a.screen = (w, h);
            check_screen(&a, w, h, &format!("{what}, an operator's choices"));
        }
        a.update(Action::Back);
        a.update(Action::ToggleHelp);
        for (w, h) in [(80, 24), (120, 40), (200, 60)] {
            a.screen = (w, h);
            check_screen(&a, w, h, &format!("{what}, help"));
        }
    }
}

/// Issue 34, item 5: a CPU training run (as `s` starts one) in every view and in its log.
#[test]
fn nothing_is_cut_in_a_cpu_runs_views() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let mut metrics = vec![started(2, Some(100))];
    metrics.extend((1..=5).map(|k| step(k, &[600 * MIB, 612 * MIB], None)));
    let exe = worker(dir.path(), &metrics, 30, "");
    let mut a = crate::stand_in::app("tiny-gpt2", "cpu", GIB, None);
    as_a_new_user_meets_it(&mut a);
    let mut a = start(a, exe, "target/snapshot-runs/nothing-cut-cpu");
    poll_until(&mut a, "step 5", |a| last_step(a) == 5);
    at(&mut a, 75);
    for view in osdp_tui::tui::app::View::ALL {
        a.update(Action::ShowView(view));
        for (w, h) in [(80, 24), (120, 40), (200, 60)] {
            a.screen = (w, h);
            check_screen(&a, w, h, &format!("a CPU run, view {}", view.name()));
        }
    }
    a.update(Action::ToggleLog);
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        a.screen = (w, h);
        assert_nothing_cut(&a, &render_text(&a, w, h), w, h, "a CPU run's log");
    }
    a.update(Action::ToggleLog);
    a.update(Action::StopRun);
    a.update(Action::StopRun);
}

/// Issue 34, item 2: the strip of the whole model reads without colour: a letter per strategy
/// (`3` zero3, `D` dp, …), and pinning a block to dp puts `D`s in it.
#[test]
fn the_strategy_strip_reads_without_colour() {
    let mut a = app();
    let strip = |a: &App| {
        let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
        t.draw(|f| {
            osdp_tui::tui::view::draw(a, f);
            osdp_tui::tui::strip_colors(f.buffer_mut());
        })
        .unwrap();
        let b = t.backend().buffer();
        // The row under the six header lines.
        (0..120u16)
            .map(|x| b[(x, 6)].symbol().to_string())
            .collect::<String>()
    };
    let before = strip(&a);
    assert!(
        before.chars().all(|c| "D123sHo".contains(c)) && before.len() == 120,
        "{before:?}"
    );
    assert!(!before.contains('D'), "no op is dp at 8 GiB: {before:?}");
    // Block 0 (expanded, the cursor on it) pinned to dp: its ops show as D.
    a.update(Action::CyclePin);
    let after = strip(&a);
    assert!(after.contains('D'), "{after:?}");
    a.update(Action::ToggleHelp);
    assert!(render_text(&a, 120, 40).contains("D dp · 1 zero1"));
}

/// Issue 34, item 9: "last checkpoint … 10 s ago" said of a checkpoint written 23 s before.
/// The age comes from the checkpoint's file, not from when the dashboard read the event: a
/// checkpoint written a minute before the dashboard saw it is a minute old.
#[test]
fn a_checkpoints_age_is_the_files_not_when_the_event_was_read() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("step-5.ckpt");
    let file = std::fs::File::create(&ckpt).unwrap();
    file.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60))
        .unwrap();
    let mut metrics = vec![started(2, Some(100))];
    metrics.extend((1..=5).map(|k| step(k, &[600 * MIB, 612 * MIB], None)));
    metrics.push(format!(
        r#"{{"event":"checkpoint","step":5,"path":"{}","write_time_s":0.1}}"#,
        ckpt.display()
    ));
    let exe = worker(dir.path(), &metrics, 0, "");
    let mut a = start(
        app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/checkpoint-age",
    );
    poll_until(&mut a, "the checkpoint", |a| {
        a.run_control
            .as_ref()
            .and_then(|t| t.supervisor.as_ref())
            .is_some_and(|r| r.status.last_checkpoint.is_some())
    });
    let screen = render_text(&a, 120, 40);
    assert!(
        ["59 s ago", "60 s ago", "61 s ago"]
            .iter()
            .any(|w| screen.contains(&format!("last checkpoint: step 5, {w}"))),
        "{screen}"
    );
    a.update(Action::StopRun);
    a.update(Action::StopRun);
}

/// Issue 34, item 9: "finishing step 22" for a run that stopped at 21. A worker writing step
/// 21's checkpoint looks for the stop before it starts step 22: `x` then names step 21.
#[test]
fn x_during_a_checkpoint_names_the_step_the_run_ends_at() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let mut metrics = vec![started(2, None)];
    metrics.extend((1..=3).map(|k| step(k, &[600 * MIB, 612 * MIB], None)));
    metrics.push(r#"{"event":"checkpointing","step":3}"#.to_string());
    let exe = worker(dir.path(), &metrics, 0, "");
    let mut a = start(
        app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/stop-while-checkpointing",
    );
    poll_until(&mut a, "the checkpoint", |a| {
        a.run_control
            .as_ref()
            .and_then(|t| t.supervisor.as_ref())
            .is_some_and(|r| r.status.checkpointing == Some(3))
    });
    a.update(Action::StopRun);
    let said = a.message.clone().unwrap_or_default();
    assert!(said.starts_with("finishing step 3 "), "{said}");
    a.update(Action::StopRun);
}

/// An operator's choices are judged against the budget the plan was made within (the budget
/// less its headroom): on llama-2-7b at 24 GiB a faster choice that would eat the headroom
/// said "faster, but pinned" of an operator nobody pinned.
#[test]
fn an_unpinned_operators_faster_choices_are_over_budget_not_pinned() {
    let mut a = opened("llama-2-7b", "rtx4090-1x");
    assert!(a.request.pins.is_empty());
    // Block 0's first projection.
    for _ in 0..2 {
        a.update(Action::Down);
    }
    a.update(Action::Toggle);
    let d = a.detail.as_ref().expect("its choices");
    assert_eq!(a.model.ops[d.op].id, "layers0.self_attn.q_proj");
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("over budget"), "{screen}");
    assert!(!screen.contains("pinned"), "{screen}");
}

/// Issue 34, item 9: the ETA counts down while a step runs (it held "34 s" for a whole 5 s
/// step of a real CPU run), never below the steps after the one running; one step left reads
/// "1 step".
#[test]
fn the_eta_counts_down_between_steps() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let slow = |k: u64| {
        step(k, &[600 * MIB, 612 * MIB], None)
            .replace("\"step_time_s\":0.2", "\"step_time_s\":10.0")
    };
    let mut metrics = vec![started(2, Some(10))];
    metrics.extend((1..=5).map(slow));
    let exe = worker(dir.path(), &metrics, 0, "");
    let mut a = start(
        crate::stand_in::app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/eta-countdown",
    );
    poll_until(&mut a, "step 5", |a| last_step(a) == 5);
    let read = a
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .and_then(|r| r.last_step_at())
        .expect("step 5 was read");
    let eta = |a: &App| {
        let screen = render_text(a, 120, 40);
        let line = screen
            .lines()
            .find(|l| l.contains("ETA "))
            .unwrap_or_else(|| panic!("no ETA:\n{screen}"))
            .to_string();
        line[line.find("ETA ").unwrap()..].to_string()
    };
    a.now = read;
    assert!(
        eta(&a).starts_with("ETA 50 s (5 steps × 10.00 s, recent mean)"),
        "{}",
        eta(&a)
    );
    a.now = read + std::time::Duration::from_secs(4);
    assert!(eta(&a).starts_with("ETA 46 s (5 steps"), "{}", eta(&a));
    a.now = read + std::time::Duration::from_secs(30);
    assert!(eta(&a).starts_with("ETA 40 s (5 steps"), "{}", eta(&a));
    a.update(Action::StopRun);
    a.update(Action::StopRun);
}
