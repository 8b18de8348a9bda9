//! The baselines a plan is measured against, set up the way their users run them: one strategy
//! on every op — DDP, ZeRO-2, FSDP's `FULL_SHARD` (ZeRO-3), and on several nodes FSDP's
//! `HYBRID_SHARD` (hsdp) — with or without full activation
//! checkpointing, each at its own best micro-batch (and, at a fixed global batch, the
//! accumulation that goes with it) under the same budget. Comparing a plan that recomputes
//! with a baseline that may not would flatter the plan.

use crate::cost::{self, Choice, Machine, OpBase, OpCost, Strategy};
use crate::model::ModelSpec;

use super::search::{batch_ladder, batch_options, PastFit};
use super::{evaluate_priced, Blocks, NoFit, Plan, PlanOptions, Planned, Planner};

/// One baseline: a strategy everywhere, with or without full activation checkpointing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Baseline {
    pub strategy: Strategy,
    pub checkpointing: bool,
}

impl Baseline {
    /// The baselines of machine `m`: each strategy of [`Strategy::ALL`] that has one
    /// ([`StrategyInfo::baseline`](crate::cost::StrategyInfo)) and that `m` can run, without
    /// and with checkpointing, in the order reports list them.
    pub fn of(m: &Machine) -> Vec<Baseline> {
        Strategy::ALL
            .iter()
            .filter(|i| i.baseline.is_some() && m.refuses(i.strategy).is_none())
            .flat_map(|i| [false, true].map(|c| Baseline::new(i.strategy, c)))
            .collect()
    }

    const fn new(strategy: Strategy, checkpointing: bool) -> Baseline {
        Baseline {
            strategy,
            checkpointing,
        }
    }

    /// `ddp`, `ddp+ckpt`, `zero2`, `fsdp`, `fsdp+ckpt`: the names users know them by.
    pub fn name(self) -> &'static str {
        match self.strategy.info().baseline {
            Some([plain, _]) if !self.checkpointing => plain,
            Some([_, ckpt]) => ckpt,
            None => self.strategy.as_str(),
        }
    }

    /// The plan of this baseline at micro-batch `batch` and `accumulation`.
    pub fn plan(self, model: &ModelSpec, batch: u64, accumulation: u64) -> Plan {
        Plan {
            batch,
            accumulation,
            choices: model
                .ops
                .iter()
                .map(|op| {
                    if cost::owns_params(op) {
                        Choice::plain(self.strategy)
                    } else {
                        Choice::NONE
                    }
                })
                .collect(),
            recompute: vec![self.checkpointing; model.config.layers as usize],
            keep_weights: Vec::new(),
        }
    }
}

/// How one baseline fares under the budget: its best plan, or the least budget it needs.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Fits(Box<Planned>),
    /// Nothing fits; the smallest per-GPU budget any of its plans needs (`None`: there is no
    /// batch to run at all, e.g. a global batch the ranks cannot share).
    Needs(Option<u64>),
}

impl Outcome {
    pub fn planned(&self) -> Option<&Planned> {
        match self {
            Outcome::Fits(p) => Some(p),
            Outcome::Needs(_) => None,
        }
    }
}

/// Every baseline's plans over its batch candidates, priced once: a budget then picks from
/// them without pricing anything (the dashboard's budget keys).
#[derive(Debug, Clone)]
pub struct BaselineTable {
    /// The machine's baselines ([`Baseline::of`]).
    baselines: Vec<Baseline>,
    /// Per baseline: its plan at every candidate priced.
    plans: Vec<Vec<Planned>>,
}

impl BaselineTable {
    /// The plans of every baseline at the batch `options` fixes (a micro-batch, a global batch,
    /// or neither: the batch ladder up to the first micro-batch none fits `max_budget` with).
    pub fn new(
        model: &ModelSpec,
        machine: &Machine,
        options: &PlanOptions,
        max_budget: u64,
    ) -> BaselineTable {
        // Baselines are priced as the plan's target runs them, but as their users run them
        // where the trainer differs: FSDP keeps a unit gathered from its backward's gather
        // through its recomputation, where the trainer fetches a recomputed op's parameters
        // again (`OpCost::recompute_comm_s`, the one cost `Machine::regather_on_recompute`
        // adds); pricing that into a baseline would flatter the plan. What the trainer would
        // make of a baseline's plan is kept beside it (`Planned::trainer_prediction`), for
        // `adopt`.
        let mut machine = machine.clone();
        machine.set_target(options.target, model);
        let machine = &machine;
        // Micro-batches past `max_batch` are never priced (their figures would overflow).
        let most = super::max_batch(model);
        let listed = batch_options(options, machine.ranks).unwrap_or_default();
        let ladder = listed.is_empty() && options.global_batch.is_none();
        let candidates: Box<dyn Iterator<Item = (u64, u64)>> = if ladder {
            Box::new(
                batch_ladder()
                    .take_while(move |&b| b <= most)
                    .map(|b| (b, 1)),
            )
        } else {
            Box::new(listed.into_iter().filter(move |&(b, _)| b <= most))
        };
        let graph = cost::OpGraph::of(model);
        let blocks = Blocks::of(model);
        let baselines = Baseline::of(machine);
        let mut plans: Vec<Vec<Planned>> = vec![Vec::new(); baselines.len()];
        // Each baseline's plan, made once. Its choices follow its strategy alone (with or
        // without checkpointing), so each strategy is priced once per micro-batch, under the
        // first baseline that has it.
        let templates: Vec<Plan> = baselines.iter().map(|b| b.plan(model, 1, 1)).collect();
        let priced_as: Vec<usize> = baselines
            .iter()
            .map(|b| {
                baselines
                    .iter()
                    .position(|o| o.strategy == b.strategy)
                    .expect("itself")
            })
            .collect();
        // Which ops price the same, from the first micro-batch's facts: ops whose facts are
        // equal at one micro-batch are at every one, and `price_shared` compares the facts
        // before it shares a price.
        let mut same: Option<Vec<usize>> = None;
        let mut past = PastFit::default();
        for (batch, accumulation) in candidates {
            if past.rules_out(accumulation) {
                continue;
            }
            let mut bases = graph.bases(model, machine, batch);
            cost::set_accumulation(&mut bases, accumulation);
            let remat = blocks.remat_at(&bases);
            let same = &*same.get_or_insert_with(|| super::search::same_priced(&bases));
            let mut any_fits = false;
            // Per strategy: its ops priced as the trainer runs them, and as FSDP does where
            // that differs (the same costs without the recomputation's refetch).
            let mut costs: Vec<Option<Vec<OpCost>>> = vec![None; templates.len()];
            let mut fsdp_costs: Vec<Option<Option<Vec<OpCost>>>> = vec![None; templates.len()];
            for (k, template) in templates.iter().enumerate() {
                let first = priced_as[k];
                let trainer = costs[first].get_or_insert_with(|| {
                    Self::price_shared(machine, &template.choices, &bases, same)
                });
                let plan = Plan {
                    batch,
                    accumulation,
                    ..template.clone()
                };
                let run = |priced: &[OpCost]| {
                    evaluate_priced(model, machine, &plan, &bases, &blocks, &remat, priced)
                };
                let as_trainer = run(trainer);
                let fsdp = template
                    .recompute
                    .contains(&true)
                    .then(|| fsdp_costs[first].get_or_insert_with(|| without_refetch(trainer)));
                let (prediction, trainer_prediction) = match fsdp.and_then(|c| c.as_deref()) {
                    Some(fsdp) => {
                        let prediction = run(fsdp);
                        let differs = as_trainer != prediction;
                        (prediction, differs.then(|| Box::new(as_trainer)))
                    }
                    None => (as_trainer, None),
                };
                any_fits |= prediction.peak_memory_bytes <= max_budget;
                plans[k].push(Planned {
                    plan,
                    prediction,
                    coarsened_bytes: 0,
                    host_gap_s: None,
                    trainer_prediction,
                });
            }
            if !any_fits {
                past.missed(accumulation, machine);
            }
        }
        BaselineTable { baselines, plans }
    }

    /// Every op's price under `choices` ([`super::price_all`]), pricing once each op that prices the same as an earlier one under the same
    /// choice (`same`: [`super::search::same_priced`]).
    fn price_shared(
        m: &Machine,
        choices: &[Choice],
        bases: &[OpBase],
        same: &[usize],
    ) -> Vec<OpCost> {
        let mut out: Vec<OpCost> = Vec::with_capacity(bases.len());
        for (i, base) in bases.iter().enumerate() {
            let j = same[i];
            let c = if j < i && choices[j] == choices[i] && bases[j] == bases[i] {
                out[j]
            } else {
                cost::price(base, choices[i], m)
            };
            out.push(c);
        }
        out
    }

    /// Each baseline under `budget`: its fastest plan that fits, or the least budget it needs.
    pub fn at(&self, budget: u64) -> Vec<(Baseline, Outcome)> {
        self.baselines
            .iter()
            .zip(&self.plans)
            .map(|(&b, plans)| {
                let best = plans
                    .iter()
                    .filter(|p| p.prediction.peak_memory_bytes <= budget)
                    .reduce(|best, p| {
                        if p.prediction.throughput_samples_per_s
                            > best.prediction.throughput_samples_per_s
                        {
                            p
                        } else {
                            best
                        }
                    });
                let outcome = match best {
                    Some(p) => Outcome::Fits(Box::new(p.clone())),
                    None => {
                        Outcome::Needs(plans.iter().map(|p| p.prediction.peak_memory_bytes).min())
                    }
                };
                (b, outcome)
            })
            .collect()
    }
}

/// `costs` as FSDP runs the ops: without the parameters a recomputation fetches again
/// (`OpCost::recompute_comm_s`), which FSDP keeps gathered; `None` where no op fetches any.
fn without_refetch(costs: &[OpCost]) -> Option<Vec<OpCost>> {
    costs.iter().any(|c| c.recompute_comm_s > 0.0).then(|| {
        costs
            .iter()
            .map(|&c| OpCost {
                recompute_comm_s: 0.0,
                ..c
            })
            .collect()
    })
}

/// Every baseline of the machine ([`Baseline::of`]) under `budget`, at the batch `options` fixes (a
/// micro-batch, a global batch, or neither: the batch ladder up to what fits).
pub fn baselines(
    model: &ModelSpec,
    machine: &Machine,
    budget: u64,
    options: &PlanOptions,
) -> Vec<(Baseline, Outcome)> {
    BaselineTable::new(model, machine, options, budget).at(budget)
}

/// The fastest FSDP baseline (with or without checkpointing), the one a plan's "vs FSDP" is
/// measured against.
pub fn best_of(
    results: &[(Baseline, Outcome)],
    strategy: Strategy,
) -> Option<(Baseline, &Planned)> {
    results
        .iter()
        .filter(|(b, _)| b.strategy == strategy)
        .filter_map(|(b, o)| o.planned().map(|p| (*b, p)))
        .max_by(|a, b| {
            a.1.prediction
                .throughput_samples_per_s
                .total_cmp(&b.1.prediction.throughput_samples_per_s)
        })
}

/// Take a baseline instead of the searched plan when it is faster as the trainer runs it: with
/// a memory resolution the search may miss a plan within a few MiB of the budget, and a
/// baseline's plan must never beat the plan. (A baseline as its users run it may: FSDP keeps
/// a recomputed unit gathered, which the trainer does not.) Only baselines inside the search's space count: none when ops are pinned, and
/// no checkpointing one when the search may not recompute, none that breaks a block's fixed
/// recomputation.
pub fn adopt(searched: &mut Planned, results: &[(Baseline, Outcome)], options: &PlanOptions) {
    if !options.pins.is_empty() {
        return;
    }
    for (b, o) in results {
        let Some(p) = o.planned() else { continue };
        if b.checkpointing && !options.recompute {
            continue;
        }
        let honours = |&(block, r): &(usize, bool)| p.plan.recompute.get(block) == Some(&r);
        if !options.block_recompute.iter().all(honours) {
            continue;
        }
        // Compared, and taken, as the trainer would run it.
        let run = p.trainer_prediction.as_deref().unwrap_or(&p.prediction);
        if run.throughput_samples_per_s > searched.prediction.throughput_samples_per_s {
            *searched = Planned {
                prediction: run.clone(),
                trainer_prediction: None,
                ..p.clone()
            };
        }
    }
}

/// Plan with the search and price every baseline at the same budget (and batch options).
pub fn plan_with_baselines(
    model: &ModelSpec,
    machine: &Machine,
    options: PlanOptions,
    budget: u64,
) -> Result<(Planned, Vec<(Baseline, Outcome)>), NoFit> {
    let results = baselines(model, machine, budget, &options);
    let mut best = Planner::best_at(model, machine.clone(), options.clone(), budget)?;
    adopt(&mut best, &results, &options);
    Ok((best, results))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::model::read_model;
    use std::path::Path;

    fn setup(model: &str, layout: &str) -> (ModelSpec, Machine) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join(format!("sample-models/{model}.json"))).unwrap();
        let layout = read_layout(&root.join(format!("layouts/{layout}.json"))).unwrap();
        let m = Machine::new(&layout, &model);
        (model, m)
    }

    #[test]
    fn at_a_global_batch_every_baseline_runs_exactly_that_batch() {
        let (model, m) = setup("gpt2-xl", "a100-80gb-8x-nvlink");
        let options = PlanOptions {
            global_batch: Some(512),
            ..Default::default()
        };
        let results = baselines(&model, &m, 40 << 30, &options);
        for (b, o) in &results {
            let Outcome::Fits(p) = o else {
                panic!("{} does not fit 40 GiB: {o:?}", b.name())
            };
            assert_eq!(p.prediction.global_batch, 512, "{}", b.name());
            assert_eq!(p.plan.batch * p.plan.accumulation * 8, 512, "{}", b.name());
        }
        // Checkpointing fits a larger micro-batch, so it needs fewer micro-batches per step.
        let fsdp = results[4].1.planned().unwrap();
        let ckpt = results[5].1.planned().unwrap();
        assert!(ckpt.plan.batch >= fsdp.plan.batch);
    }

    #[test]
    fn hsdp_is_a_baseline_on_several_nodes_only() {
        let names = |layout| {
            let (model, m) = setup("gpt2-xl", layout);
            let options = PlanOptions {
                global_batch: Some(512),
                ..Default::default()
            };
            baselines(&model, &m, 40 << 30, &options)
                .into_iter()
                .map(|(b, o)| {
                    let batch = o.planned().map(|p| p.prediction.global_batch);
                    (b.name(), batch)
                })
                .collect::<Vec<_>>()
        };
        let one = names("a100-80gb-8x-nvlink");
        assert!(one.iter().all(|(n, _)| !n.starts_with("hsdp")), "{one:?}");
        let two = names("a100-80gb-2x8-ib-hdr");
        assert_eq!(two.len(), one.len() + 2);
        assert_eq!(
            &two[one.len()..],
            &[("hsdp", Some(512)), ("hsdp+ckpt", Some(512))]
        );
    }

    #[test]
    fn a_table_built_for_a_large_budget_answers_a_smaller_one_as_a_fresh_search() {
        let (model, m) = setup("gpt2-xl", "a100-80gb-8x-nvlink");
        let table = BaselineTable::new(&model, &m, &PlanOptions::default(), 80 << 30);
        for budget in [8u64 << 30, 16 << 30, 40 << 30] {
            assert_eq!(
                table.at(budget),
                baselines(&model, &m, budget, &PlanOptions::default()),
                "at {budget}"
            );
        }
    }

    #[test]
    fn a_baseline_that_does_not_fit_says_what_it_needs() {
        let (model, m) = setup("gpt2-xl", "a100-80gb-8x-nvlink");
        let results = baselines(&model, &m, 8 << 30, &PlanOptions::default());
        let (_, ddp) = &results[0];
        let Outcome::Needs(Some(need)) = ddp else {
            panic!("DDP of gpt2-xl (16 bytes × 1.6 B parameters) fits 8 GiB: {ddp:?}")
        };
        assert!(*need > 8 << 30);
        // And it is the least peak of DDP at micro-batch 1.
        let one = crate::plan::evaluate(
            &model,
            &m,
            &Baseline::new(Strategy::Dp, false).plan(&model, 1, 1),
        );
        assert_eq!(*need, one.peak_memory_bytes);
    }
}
