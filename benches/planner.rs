//! Planner latency: a full re-plan (every micro-batch size, every transient cap, plus the six
//! baselines) and a budget-only change (a lookup in the frontiers already built), at any batch
//! and at a fixed global batch (every micro-batch × accumulation that makes it).
//!
//! Run: `cargo bench --bench planner`.

use std::hint::black_box;
use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, Criterion};
use osdp_core::cluster::read_layout;
use osdp_core::cost::Machine;
use osdp_core::model::{hf, read_model, ModelSpec};
use osdp_core::plan::plan_with_baselines;
use osdp_core::plan::{PlanOptions, Planner};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn machine(layout: &str, model: &ModelSpec) -> (Machine, u64) {
    let l = read_layout(&root().join(format!("layouts/{layout}.json"))).expect("layout");
    (Machine::new(&l, model), l.memory_bytes())
}

/// A 200-block GPT-2 (2,006 ops) for scale.
fn synthetic() -> ModelSpec {
    let config = r#"{"architectures": ["GPT2LMHeadModel"], "n_embd": 1024, "n_layer": 200,
        "n_head": 16, "n_positions": 1024, "vocab_size": 50257}"#;
    hf::import_str(
        Path::new("synthetic.json"),
        config,
        &hf::ImportOptions::default(),
    )
    .expect("imports")
}

fn bench(c: &mut Criterion) {
    let cases: Vec<(&str, ModelSpec, &str, u64)> = vec![
        (
            "gpt2-xl on 8xA100 at 16 GiB",
            read_model(&root().join("sample-models/gpt2-xl.json")).unwrap(),
            "a100-80gb-8x-nvlink",
            16 << 30,
        ),
        (
            "llama-2-13b on 2x8 H100 at 40 GiB",
            read_model(&root().join("sample-models/llama-2-13b.json")).unwrap(),
            "h100-sxm-2x8-ib-ndr",
            40 << 30,
        ),
        (
            "synthetic 2006 ops on 8xH100 at 40 GiB",
            synthetic(),
            "h100-sxm-8x-nvlink",
            40 << 30,
        ),
    ];
    let any_batch = PlanOptions {
        resolution_bytes: 1 << 20,
        ..Default::default()
    };
    // 512 samples of 1,024 tokens per step: GPT-3's 0.5 M-token batch for models of this size.
    let fixed = PlanOptions {
        global_batch: Some(512),
        ..any_batch.clone()
    };
    let mut group = c.benchmark_group("planner");
    group.sample_size(10);
    let gpt2_xl = &cases[0];
    let runs = cases
        .iter()
        .map(|(name, model, layout, budget)| {
            (name.to_string(), model, *layout, *budget, &any_batch)
        })
        .chain(std::iter::once((
            format!("{} at global batch 512", gpt2_xl.0),
            &gpt2_xl.1,
            gpt2_xl.2,
            gpt2_xl.3,
            &fixed,
        )));
    for (name, model, layout, budget, options) in runs {
        let budget = &budget;
        let (m, device) = machine(layout, model);
        group.bench_function(format!("full re-plan: {name}"), |b| {
            b.iter(|| {
                plan_with_baselines(black_box(model), &m, options.clone(), *budget).expect("fits")
            })
        });
        let planner = Planner::new(model, m.clone(), options.clone(), device);
        let mut step = 0u64;
        group.bench_function(format!("budget change: {name}"), |b| {
            b.iter(|| {
                step = (step + 1) % 16;
                planner
                    .best(black_box(*budget - step * (256 << 20)))
                    .expect("fits")
            })
        });
    }
    // Offload: llama-2-7b's state alone is 108 GB, so one 80 GiB H100 plans only by offloading;
    // the search runs at the resolution `plan` picks where offload is offered.
    let llama = read_model(&root().join("sample-models/llama-2-7b.json")).unwrap();
    let (m, device) = machine("h100-1x", &llama);
    let offload = PlanOptions {
        global_batch: Some(512),
        resolution_bytes: osdp_core::plan::request::search_resolution(None, &llama, &m, device),
        ..Default::default()
    };
    group.bench_function("full re-plan: llama-2-7b on 1xH100 offloading", |b| {
        b.iter(|| {
            plan_with_baselines(black_box(&llama), &m, offload.clone(), device).expect("fits")
        })
    });
    let planner = Planner::new(&llama, m.clone(), offload.clone(), device);
    let mut step = 0u64;
    group.bench_function("budget change: llama-2-7b on 1xH100 offloading", |b| {
        b.iter(|| {
            step = (step + 1) % 16;
            planner
                .best(black_box(device - step * (256 << 20)))
                .expect("fits")
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
