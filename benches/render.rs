//! Dashboard latency: one full frame at 200×60 for llama-2-13b, and a key press (budget down)
//! until the new plan is on screen with the frontiers already built.
//!
//! Run: `cargo bench --bench render`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use osdp_core::cluster::read_layout;
use osdp_core::model::read_model;
use osdp_tui::tui::app::{Action, App};
use osdp_tui::tui::{render_text, view};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn app() -> App {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let m = read_model(&root.join("sample-models/llama-2-13b.json")).expect("model");
    let l = read_layout(&root.join("layouts/h100-sxm-8x-nvlink.json")).expect("layout");
    let n = l.world_size() as usize;
    let mut a = App::new(m, l, vec![40 << 30; n], 8);
    a.replan();
    a
}

fn bench(c: &mut Criterion) {
    let a = app();
    // One frame as the dashboard draws it: a terminal that lives across frames.
    let mut terminal = Terminal::new(TestBackend::new(200, 60)).expect("test backend");
    c.bench_function("frame 200x60 llama-2-13b", |b| {
        b.iter(|| {
            terminal
                .draw(|f| view::draw(black_box(&a), f))
                .expect("draws")
                .area
        })
    });
    // With a background worker, a budget key re-uses the frontiers: time from the key to the
    // plan being ready and drawn.
    let mut live = app().with_planner_thread();
    while live.plan.is_none() || live.pending {
        live.poll_background();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut group = c.benchmark_group("key to screen");
    group.sample_size(20);
    let mut up = false;
    group.bench_function("budget key to new plan on screen, llama-2-13b", |b| {
        b.iter(|| {
            live.update(if up {
                Action::RaiseBudget
            } else {
                Action::LowerBudget
            });
            up = !up;
            loop {
                live.poll_background();
                if !live.pending {
                    break;
                }
                std::thread::yield_now();
            }
            render_text(&live, 200, 60)
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
