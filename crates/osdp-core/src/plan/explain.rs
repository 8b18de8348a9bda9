//! Why an op runs the way the plan says: every choice it could have had, priced as the whole
//! plan with only that op changed, and what stops the faster ones.

use serde::Serialize;

use crate::cost::{self, Choice, Machine};
use crate::model::ModelSpec;

use super::{evaluate_with, Blocks, Plan, Prediction};

/// One choice for the op, with the plan's figures when only this op changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alternative {
    pub choice: Choice,
    /// The plan's own choice.
    pub chosen: bool,
    /// Step time and peak memory of the whole plan with this choice, against the plan's.
    pub delta_step_s: f64,
    pub delta_peak_bytes: i64,
    /// What the op holds all step (parameters, gradients, optimizer states) and only while it
    /// runs (gathered weights, gradient buffers).
    pub persistent_bytes: u64,
    pub transient_bytes: u64,
    pub verdict: Verdict,
}

/// Why a choice is not the plan's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Chosen,
    /// Slower than the chosen one.
    Slower,
    /// As fast, and needs more memory (or the same: a tie the planner broke).
    AsFastMoreMemory,
    AsFast,
    /// Faster, but the plan's peak would pass the budget by its state memory.
    OverBudget,
    /// Faster, but its transient peak (gathered weights and gradient buffers while it runs)
    /// would raise the plan's peak past the budget.
    TransientPeak,
    /// Faster and within the budget: the op is pinned to its choice.
    Pinned,
}

impl Verdict {
    pub fn text(self) -> &'static str {
        match self {
            Verdict::Chosen => "chosen",
            Verdict::Slower => "slower",
            Verdict::AsFastMoreMemory => "as fast, more memory",
            Verdict::AsFast => "as fast (a tie)",
            Verdict::OverBudget => "over budget",
            Verdict::TransientPeak => "transient peak over budget",
            Verdict::Pinned => "faster, but pinned",
        }
    }
}

/// Every choice the planner may make for op `op`, at the plan's micro-batch and accumulation,
/// fastest first. `budget`: the per-GPU budget the plan was made for.
pub fn alternatives(
    model: &ModelSpec,
    m: &Machine,
    plan: &Plan,
    op: usize,
    max_split: u32,
    budget: u64,
) -> Vec<Alternative> {
    let mut bases = cost::op_bases(model, m, plan.batch);
    cost::set_accumulation(&mut bases, plan.accumulation);
    let blocks = Blocks::of(model);
    let Some(base) = bases.get(op) else {
        return Vec::new();
    };
    let now: Prediction = evaluate_with(model, m, plan, &bases, &blocks);
    let chosen = plan.choices[op];
    // What `m`'s target can run (the chosen one always listed).
    let mut options = m.target.choices(base, m, max_split.max(chosen.split));
    if !options.contains(&chosen) {
        options.push(chosen);
    }
    let mut out: Vec<Alternative> = options
        .into_iter()
        .map(|choice| {
            let mut p = plan.clone();
            p.choices[op] = choice;
            let with = evaluate_with(model, m, &p, &bases, &blocks);
            let c = cost::price(base, choice, m);
            let delta_step_s = with.step_time_s - now.step_time_s;
            let verdict = if choice == chosen {
                Verdict::Chosen
            } else if delta_step_s > 0.0 {
                Verdict::Slower
            } else if delta_step_s == 0.0 && with.peak_memory_bytes > now.peak_memory_bytes {
                Verdict::AsFastMoreMemory
            } else if delta_step_s == 0.0 {
                Verdict::AsFast
            } else if with.peak_memory_bytes <= budget {
                Verdict::Pinned
            } else if with.max_transient_bytes > now.max_transient_bytes
                && with.persistent_bytes
                    + with.activation_bytes
                    + with.overhead_bytes
                    + with.side_pool_bytes
                    + now.max_transient_bytes
                    <= budget
            {
                Verdict::TransientPeak
            } else {
                Verdict::OverBudget
            };
            Alternative {
                choice,
                chosen: choice == chosen,
                delta_step_s,
                delta_peak_bytes: with.peak_memory_bytes as i64 - now.peak_memory_bytes as i64,
                persistent_bytes: c.persistent_bytes,
                transient_bytes: c.transient_bytes,
                verdict,
            }
        })
        .collect();
    out.sort_by(|a, b| {
        a.delta_step_s
            .total_cmp(&b.delta_step_s)
            .then(a.delta_peak_bytes.cmp(&b.delta_peak_bytes))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::model::read_model;
    use crate::plan::{PlanOptions, Planner};
    use std::path::Path;

    #[test]
    fn the_plans_choice_is_listed_and_nothing_faster_fits_unpinned() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/gpt2-medium.json")).unwrap();
        let layout = read_layout(&root.join("layouts/a100-80gb-8x-nvlink.json")).unwrap();
        let m = Machine::new(&layout, &model);
        let budget = 6u64 << 30;
        let options = PlanOptions {
            global_batch: Some(40),
            ..PlanOptions::default()
        };
        let planned = Planner::new(&model, m.clone(), options.clone(), budget)
            .best(budget)
            .expect("a plan fits 6 GiB");
        for (op, spec) in model.ops.iter().enumerate() {
            if !cost::owns_params(spec) {
                continue;
            }
            let alts = alternatives(&model, &m, &planned.plan, op, options.max_split, budget);
            assert_eq!(alts.iter().filter(|a| a.chosen).count(), 1, "{}", spec.id);
            // The planner is exact: an unpinned op has no faster choice that fits.
            assert!(
                alts.iter().all(|a| a.verdict != Verdict::Pinned),
                "{}: {alts:?}",
                spec.id
            );
            assert!(alts.iter().any(|a| a.verdict == Verdict::Slower));
        }
    }
}
