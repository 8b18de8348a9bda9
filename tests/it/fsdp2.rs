//! Planning for PyTorch FSDP2 (`plan --target fsdp2`), exporting a plan for it (`export --to
//! fsdp2`), and running the export with `osdp_torch` (the Python package in `python/`).

use osdp_core::cost::{self, Choice, Machine, Offload, Strategy};
use osdp_core::model::ModelSpec;
use osdp_core::plan::{evaluate, Plan, PlanOptions, Planner, Target};
use proptest::prelude::*;

use crate::planner::{machine, offload_machine, small_model, LAYOUTS};

/// Every plan at `batch` whose choices FSDP2 can run: (peak, samples/s).
fn all_fsdp2_plans(model: &ModelSpec, m: &Machine, batch: u64, max_split: u32) -> Vec<(u64, f64)> {
    let bases = cost::op_bases(model, m, 1);
    let options: Vec<Vec<Choice>> = bases
        .iter()
        .map(|b| {
            cost::choices(b, m, max_split)
                .into_iter()
                .filter(|&c| {
                    c.split == 1 && c.strategy != Strategy::Zero1 && c.offload != Offload::Opt
                })
                .collect()
        })
        .collect();
    let layers = model.config.layers as usize;
    let mut out = Vec::new();
    let mut idx = vec![0usize; options.len()];
    'plans: loop {
        for flags in 0..(1u32 << layers) {
            let plan = Plan {
                batch,
                accumulation: 1,
                choices: idx.iter().zip(&options).map(|(&i, o)| o[i]).collect(),
                recompute: (0..layers).map(|l| flags >> l & 1 == 1).collect(),
            };
            let p = evaluate(model, m, &plan);
            out.push((p.peak_memory_bytes, p.throughput_samples_per_s));
        }
        for k in 0..idx.len() {
            idx[k] += 1;
            if idx[k] < options[k].len() {
                continue 'plans;
            }
            idx[k] = 0;
        }
        break;
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Under `--target fsdp2` the planner is exact over the plans FSDP2 can run (with splitting
    /// allowed, on one and two nodes, with and without a host to offload to), and never
    /// chooses one it cannot.
    #[test]
    fn fsdp2_planner_matches_exhaustive_search_over_what_fsdp2_runs(
        hidden in prop::sample::select(vec![64u64, 256, 1024]),
        seq in prop::sample::select(vec![16u64, 128]),
        (blocks, tied) in prop::sample::select(vec![(1u64, false), (1, true), (2, true)]),
        layout in prop::sample::select(LAYOUTS.iter().copied().chain(["host"]).collect::<Vec<_>>()),
        batch in 1u64..=2,
        budget_frac in 0.0f64..1.0,
    ) {
        let model = small_model(hidden, seq, 64, blocks, tied);
        let m = match layout {
            "host" => offload_machine(&model, u64::MAX / 4),
            name => machine(name, &model),
        };
        let plans = all_fsdp2_plans(&model, &m, batch, 4);
        let (lo, hi) = plans.iter().fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
        let budget = lo + ((hi - lo) as f64 * budget_frac) as u64;
        let want = plans.iter().filter(|p| p.0 <= budget).map(|p| p.1).reduce(f64::max).unwrap();
        let options = PlanOptions {
            batch: Some(batch),
            max_split: 4,
            target: Target::Fsdp2,
            ..Default::default()
        };
        let got = Planner::new(&model, m.clone(), options, budget).best(budget).expect("fits");
        prop_assert!(got.prediction.peak_memory_bytes <= budget);
        prop_assert!(close(got.prediction.throughput_samples_per_s, want),
            "planner {} vs exhaustive {want}", got.prediction.throughput_samples_per_s);
        for c in &got.plan.choices {
            prop_assert!(Target::Fsdp2.allows(*c).is_ok(), "{}", c.label());
        }
        prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction);
    }
}
