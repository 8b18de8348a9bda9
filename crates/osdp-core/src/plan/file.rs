//! The plan file (`plan -o PLAN.json`, format version 1): what `evaluate` and the trainer read.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Blocks, Plan, Prediction, Target};
use crate::cost::{self, Choice, Offload, Strategy};
use crate::input::{self, InputError, Problem};
use crate::model::{ModelSpec, OpKind};

pub const PLAN_FORMAT_VERSION: u32 = 1;

/// Samples one rank may process in a step (micro-batch × accumulation): far beyond any real run,
/// small enough that byte counts computed from it never overflow.
pub const MAX_SAMPLES_PER_RANK: u64 = 1 << 24;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub version: u32,
    /// Name of the model the plan is for.
    pub model: String,
    /// Structure hash of that model: a plan only applies to the graph it was made for.
    pub model_fingerprint: String,
    /// Layout the plan was priced on (informational; `evaluate` may price it on another).
    pub layout: String,
    /// Micro-batch: samples per rank per forward/backward.
    pub batch_size: u64,
    /// Micro-batches per optimizer step (gradient accumulation); absent means 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub accumulation: u64,
    /// What the plan was made to run on (`plan --target`); `evaluate` prices it as that runs
    /// it. Absent: osdp-tui's trainer.
    #[serde(default, skip_serializing_if = "Target::is_osdp")]
    pub target: Target,
    pub ops: Vec<PlanFileOp>,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

fn is_false(v: &bool) -> bool {
    !*v
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFileOp {
    pub id: String,
    pub strategy: Strategy,
    pub split: u32,
    pub sharded_slices: u32,
    /// What of the op's state lives in host memory: `offload-opt` or `offload-param`;
    /// absent: nothing.
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// Whether the op's block recomputes its activations (the same for every op of a block).
    pub recompute: bool,
    /// Whether the op's recomputed block keeps the weights its recomputation fetches for the
    /// backward ([`Plan::keep_weights`]; the same for every op of a block); absent: `false`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub keep_weights: bool,
    /// Predicted figures when the plan was written (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_s: Option<f64>,
}

/// Structure hash of a model (FNV-1a over ids, kinds, shapes and sequence length).
pub fn fingerprint(model: &ModelSpec) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&model.config.seq_len.to_le_bytes());
    for op in &model.ops {
        eat(op.id.as_bytes());
        eat(op.kind.as_str().as_bytes());
        for p in &op.params {
            for d in &p.shape {
                eat(&d.to_le_bytes());
            }
        }
    }
    format!("{h:016x}")
}

impl PlanFile {
    pub fn new(
        model: &ModelSpec,
        layout: &str,
        plan: &Plan,
        prediction: Option<&Prediction>,
    ) -> PlanFile {
        let blocks = Blocks::of(model);
        PlanFile {
            version: PLAN_FORMAT_VERSION,
            model: model.name.clone(),
            model_fingerprint: fingerprint(model),
            layout: layout.to_string(),
            batch_size: plan.batch,
            accumulation: plan.accumulation,
            target: Target::Osdp,
            ops: model
                .ops
                .iter()
                .enumerate()
                .map(|(i, op)| {
                    let c = plan.choices[i];
                    PlanFileOp {
                        id: op.id.clone(),
                        strategy: c.strategy,
                        split: c.split,
                        sharded_slices: c.sharded,
                        offload: c.offload,
                        recompute: blocks.of_op[i].is_some_and(|b| plan.recompute[b]),
                        keep_weights: blocks.of_op[i].is_some_and(|b| plan.keeps(b)),
                        memory_bytes: prediction.map(|p| p.ops[i].memory_bytes),
                        time_s: prediction.map(|p| p.ops[i].time_s),
                    }
                })
                .collect(),
        }
    }

    /// Check the file against `model` and turn it into a plan.
    pub fn to_plan(&self, model: &ModelSpec) -> Result<Plan, Problem> {
        if self.model_fingerprint != fingerprint(model) {
            return Err(Problem::field(
                "model_fingerprint",
                format!(
                    "this plan was made for model {:?}, not for {:?} (the operator graphs differ)",
                    self.model, model.name
                ),
            ));
        }
        super::check_batch(model, self.batch_size)
            .map_err(|why| Problem::field("batch_size", why))?;
        if self.accumulation == 0 {
            return Err(Problem::field("accumulation", "must be at least 1"));
        }
        if self
            .batch_size
            .checked_mul(self.accumulation)
            .is_none_or(|s| s > MAX_SAMPLES_PER_RANK)
        {
            return Err(Problem::field(
                "accumulation",
                format!(
                    "{} × accumulation {} samples per rank and step is more than any run \
                     takes (at most {MAX_SAMPLES_PER_RANK})",
                    self.batch_size, self.accumulation
                ),
            ));
        }
        let blocks = Blocks::of(model);
        let index = model.op_index();
        let mut choices: Vec<Option<Choice>> = vec![None; model.ops.len()];
        let mut recompute: Vec<Option<bool>> = vec![None; blocks.ops.len()];
        let mut keep: Vec<Option<bool>> = vec![None; blocks.ops.len()];
        for (k, entry) in self.ops.iter().enumerate() {
            let at = format!("ops[{k}] ({:?})", entry.id);
            let Some(&i) = index.get(entry.id.as_str()) else {
                return Err(Problem::field(
                    &at,
                    format!("model {:?} has no op {:?}", model.name, entry.id),
                ));
            };
            if choices[i].is_some() {
                return Err(Problem::field(&at, "appears twice"));
            }
            let choice = Choice {
                strategy: entry.strategy,
                split: entry.split,
                sharded: entry.sharded_slices,
                offload: entry.offload,
            };
            check_choice(model, i, choice).map_err(|m| Problem::field(&at, m))?;
            self.target.allows(choice).map_err(|why| {
                Problem::field(&at, format!("target {}: {why}", self.target.as_str()))
            })?;
            choices[i] = Some(choice);
            if entry.keep_weights && blocks.of_op[i].is_none() {
                return Err(Problem::field(
                    &at,
                    "keep_weights applies to ops inside blocks only",
                ));
            }
            if entry.keep_weights && !entry.recompute {
                return Err(Problem::field(
                    &at,
                    "keep_weights applies to recomputed blocks only (set recompute too)",
                ));
            }
            if let Some(b) = blocks.of_op[i] {
                match keep[b] {
                    Some(prev) if prev != entry.keep_weights => {
                        return Err(Problem::field(
                            &at,
                            format!("block {b} must keep_weights for all its ops or none"),
                        ))
                    }
                    _ => keep[b] = Some(entry.keep_weights),
                }
            }
            match (blocks.of_op[i], entry.recompute) {
                (None, true) => {
                    return Err(Problem::field(
                        &at,
                        "recompute applies to ops inside blocks only",
                    ))
                }
                (None, false) => {}
                (Some(b), r) => match recompute[b] {
                    Some(prev) if prev != r => {
                        return Err(Problem::field(
                            &at,
                            format!("block {b} must recompute all its ops or none"),
                        ))
                    }
                    _ => recompute[b] = Some(r),
                },
            }
        }
        if let Some(i) = choices.iter().position(Option::is_none) {
            return Err(Problem::field(
                "ops",
                format!("op {:?} has no entry", model.ops[i].id),
            ));
        }
        Ok(Plan {
            batch: self.batch_size,
            accumulation: self.accumulation,
            choices: choices
                .into_iter()
                .map(|c| c.unwrap_or(Choice::NONE))
                .collect(),
            recompute: recompute.into_iter().map(|r| r.unwrap_or(false)).collect(),
            keep_weights: keep.into_iter().map(|k| k.unwrap_or(false)).collect(),
        })
    }
}

/// Is `choice` one the cost model can price for op `i`? Says why not.
pub fn check_choice(model: &ModelSpec, i: usize, c: Choice) -> Result<(), String> {
    let op = &model.ops[i];
    let owns = cost::owns_params(op);
    match c.strategy {
        Strategy::None if owns => {
            return Err(format!(
                "op {:?} owns parameters: strategy must be {}",
                op.id,
                Strategy::names_for_params()
            ))
        }
        Strategy::None => {}
        _ if !owns => {
            return Err(format!(
                "op {:?} owns no parameters: its strategy must be \"none\"",
                op.id
            ))
        }
        _ => {}
    }
    match c.strategy {
        Strategy::Zero3 => {
            if !c.split.is_power_of_two() {
                return Err(format!("split must be a power of two, got {}", c.split));
            }
            if c.split > 1 && op.kind != OpKind::Linear {
                return Err(format!(
                    "only linear ops can be split; {:?} is {}",
                    op.id,
                    op.kind.as_str()
                ));
            }
            // The trainer slices a split linear's weight by input features: each slice needs
            // at least one.
            let in_features = op
                .params
                .iter()
                .find(|p| p.name == "weight")
                .and_then(|w| w.shape.get(1))
                .map_or(1, |&d| d.max(1) as u64);
            if u64::from(c.split) > in_features {
                return Err(format!(
                    "op {:?} has {in_features} input features: it cannot be split into {} slices \
                     (at most {in_features})",
                    crate::text::printable(&op.id),
                    c.split
                ));
            }
            if c.sharded == 0 || c.sharded > c.split {
                return Err(format!(
                    "sharded_slices must be 1..={} for split {}, got {}",
                    c.split, c.split, c.sharded
                ));
            }
        }
        _ => {
            if c.split != 1 || c.sharded != 0 {
                return Err(format!(
                    "{} does not split: use split 1 and sharded_slices 0 (got {} and {})",
                    c.strategy.as_str(),
                    c.split,
                    c.sharded
                ));
            }
        }
    }
    if !c.offload.is_none() {
        if c.split > 1 {
            return Err(format!(
                "{} applies to unsplit ops: use split 1 (got {})",
                c.offload.as_str(),
                c.split
            ));
        }
        if !cost::offload_applies(c.strategy, c.offload) {
            let takers: Vec<&str> = Strategy::ALL
                .iter()
                .filter(|i| i.offloads_params)
                .map(|i| i.name)
                .collect();
            return Err(format!(
                "{} combines with {} (each rank updates exactly the part it holds), not {}",
                c.offload.as_str(),
                crate::text::or_list(&takers),
                c.strategy.as_str()
            ));
        }
    }
    Ok(())
}

/// Read a plan file and check it against `model`.
pub fn read_plan(path: &Path, model: &ModelSpec) -> Result<Plan, InputError> {
    read_plan_for(path, model).map(|(plan, _)| plan)
}

/// [`read_plan`], with the target the plan was made for.
pub fn read_plan_for(path: &Path, model: &ModelSpec) -> Result<(Plan, Target), InputError> {
    let file: PlanFile = input::read_strict(path, PLAN_FORMAT_VERSION)?;
    let plan = file.to_plan(model).map_err(|problem| InputError::Invalid {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok((plan, file.target))
}
