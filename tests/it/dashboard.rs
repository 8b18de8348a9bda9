//! The dashboard: its text rendering, its keys, and what it says when things are missing.

use osdp_tui::cluster::read_layout;
use osdp_tui::model::read_model;
use osdp_tui::monitor::{GpuEvent, GpuSample};
use osdp_tui::tui::app::{Action, App, Focus, Row};
use osdp_tui::tui::render_text;

use crate::{osdp, root};

const GIB: u64 = 1 << 30;

fn app(model: &str, layout: &str, budget: u64) -> App {
    let m = read_model(&root().join(format!("sample-models/{model}.json"))).unwrap();
    let l = read_layout(&root().join(format!("layouts/{layout}.json"))).unwrap();
    let n = l.world_size() as usize;
    let mut a = App::new(m, l, vec![budget; n], 8);
    a.replan();
    a
}

fn throughput(a: &App) -> f64 {
    a.planned()
        .expect("a plan fits")
        .prediction
        .throughput_samples_per_s
}

#[test]
fn once_prints_the_screen_without_a_terminal() {
    let out = osdp()
        .args([
            "sample-models/gpt2.json",
            "--layout",
            "layouts/a100-80gb-8x-nvlink.json",
            "--budget",
            "8GiB",
            "--once",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let screen = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "gpt2 (124.4 M params, 126 ops) on a100-80gb-8x-nvlink",
        "samples/s",
        "peak",
        "vs FSDP",
        "operators",
        "h0.attn.c_attn",
        "GPUs",
        "samples/s vs budget",
    ] {
        assert!(
            screen.contains(needle),
            "{needle:?} missing from:\n{screen}"
        );
    }
    assert!(screen.lines().count() >= 40);
}

#[test]
fn without_a_layout_it_says_what_it_plans_for() {
    let out = osdp()
        .args(["sample-models/tiny-gpt2.json", "--once"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let screen = String::from_utf8(out.stdout).unwrap();
    assert!(
        screen.contains("planning for layout h100-sxm-8x-nvlink"),
        "{screen}"
    );
}

#[test]
fn lowering_the_budget_replans_within_it() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 12 * GIB);
    let before = throughput(&a);
    for _ in 0..6 {
        a.update(Action::LowerBudget);
    }
    assert_eq!(a.budget(), 6 * GIB);
    let p = &a.planned().unwrap().prediction;
    assert!(p.peak_memory_bytes <= 6 * GIB);
    assert!(throughput(&a) < before, "half the memory, fewer samples/s");
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("/ 6.0 GiB"), "{screen}");
}

#[test]
fn an_impossible_budget_shows_the_smallest_that_fits() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 3 * GIB);
    a.update(Action::LowerBudget);
    a.update(Action::LowerBudget);
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("nothing fits 1.0 GiB per GPU; the smallest budget that fits is"),
        "{screen}"
    );
}

#[test]
fn gpu_focus_changes_one_gpus_budget() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 10 * GIB);
    a.update(Action::FocusNext);
    assert_eq!(a.focus, Focus::Gpus);
    a.update(Action::Down);
    a.update(Action::Down);
    a.update(Action::LowerBudget);
    assert_eq!(a.budgets[2], 9 * GIB);
    assert_eq!(a.budgets[0], 10 * GIB);
    assert_eq!(a.budget(), 9 * GIB, "the tightest GPU binds");
}

#[test]
fn blocks_expand_and_ops_can_be_pinned() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 8 * GIB);
    let rows = a.rows().len();
    // Move to block 1's header and expand it.
    let target = a.rows().iter().position(|r| *r == Row::Block(1)).unwrap();
    for _ in 0..target {
        a.update(Action::Down);
    }
    a.update(Action::Toggle);
    assert_eq!(a.rows().len(), rows + 10);
    a.update(Action::Down);
    let Some(Row::Op(op)) = a.selected() else {
        panic!("an op is selected")
    };
    assert_eq!(a.model.ops[op].id, "h1.ln_1");
    a.update(Action::CyclePin);
    let plan = &a.planned().unwrap().plan;
    assert_eq!(plan.choices[op].label(), "dp");
    a.update(Action::CyclePin);
    let plan = &a.planned().unwrap().plan;
    assert_eq!(plan.choices[op].label(), "zero1");
}

#[test]
fn split_limit_and_batch_keys_replan() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 8 * GIB);
    a.update(Action::SplitDown);
    assert_eq!(a.max_split, 4);
    a.update(Action::CycleBatch);
    assert_eq!(a.batch, Some(1));
    assert_eq!(a.planned().unwrap().prediction.batch_size, 1);
}

#[test]
fn a_small_terminal_gets_a_clear_message() {
    let a = app("tiny-gpt2", "cpu", 4 * GIB);
    let screen = render_text(&a, 60, 20);
    assert!(screen.contains("terminal too small"), "{screen}");
    let usable = render_text(&a, 80, 24);
    assert!(usable.contains("operators") && !usable.contains("too small"));
}

#[test]
fn live_gpu_samples_are_shown() {
    let mut a = app("gpt2", "h100-1x", 40 * GIB);
    a.apply_gpu(GpuEvent::Samples(vec![GpuSample {
        index: 0,
        name: "NVIDIA H100".into(),
        used_bytes: Some(12 * GIB),
        total_bytes: Some(80 * GIB),
        utilization_pct: Some(97),
        processes: vec![(4242, Some(11 * GIB))],
    }]));
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("NVIDIA H100")
            && screen.contains("12.0 GiB/80.0 GiB")
            && screen.contains("util  97%"),
        "{screen}"
    );
    a.apply_gpu(GpuEvent::Unavailable("GPU 0 stopped answering".into()));
    assert!(render_text(&a, 120, 40).contains("GPU 0 stopped answering"));
}

#[test]
fn gpu_memory_history_is_drawn_as_a_sparkline() {
    let mut a = app("gpt2", "h100-1x", 40 * GIB);
    for used in [10u64, 20, 40, 80] {
        a.apply_gpu(GpuEvent::Samples(vec![GpuSample {
            index: 0,
            name: "NVIDIA H100".into(),
            used_bytes: Some(used * GIB),
            total_bytes: Some(80 * GIB),
            utilization_pct: Some(50),
            processes: vec![],
        }]));
    }
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("▁▂▄█"), "{screen}");
}
