//! Plans: per operator a sharding choice, per block whether to recompute activations, and the
//! micro-batch size. [`evaluate`] prices any plan with the cost model; the [`Planner`] finds the
//! plan of highest throughput under a memory budget, exactly.

pub mod baseline;
pub mod explain;
pub mod export;
mod file;
mod frontier;
pub mod request;
pub use request::Request;
mod search;
pub use crate::cost::Target;

pub use baseline::plan_with_baselines;
pub use file::{
    check_choice, fingerprint, read_plan, read_plan_for, PlanFile, PlanFileOp, PLAN_FORMAT_VERSION,
};
pub use search::{
    batch_options, max_global_batch, BatchError, NoFit, PlanOptions, Planned, Planner,
};

use serde::Serialize;

use crate::cost::{self, Choice, Machine, OpBase, OpCost, Strategy};
use crate::model::ModelSpec;

/// Largest micro-batch per GPU the planner searches or accepts: far beyond any that trains
/// well, and small enough that per-sample figures times the batch stay far from overflowing.
pub const MAX_BATCH: u64 = 1 << 20;

/// Largest memory budget per GPU (1 PiB): budgets are summed with held memory and overheads,
/// and the automatic micro-batch search climbs until a plan no longer fits.
pub const MAX_BUDGET_BYTES: u64 = 1 << 50;

/// The largest operator split `plan` and the dashboard start with (`--max-split`).
pub const DEFAULT_MAX_SPLIT: u32 = 8;

/// Largest figure of a micro-batch's ops that the planner adds up (2^58 bytes): sums of many
/// of them, plus budgets and overheads, stay within 64 bits.
const MAX_BATCH_FIGURE: u64 = 1 << 58;

/// The largest micro-batch of `model`: [`MAX_BATCH`], or less when its per-sample activations
/// are so large that a batch of them would pass [`MAX_BATCH_FIGURE`]. At least 1.
pub fn max_batch(model: &ModelSpec) -> u64 {
    // Kept and output bytes per sample, twice over for gradient buffers, twice again for
    // fp32 (bf16 figures double on CPUs).
    let per_sample = model.ops.iter().fold(0u64, |n, op| {
        n.saturating_add(op.saved_bytes_per_sample)
            .saturating_add(op.output_bytes_per_sample)
    });
    (MAX_BATCH_FIGURE / per_sample.saturating_mul(4).max(1)).clamp(1, MAX_BATCH)
}

/// A fixed micro-batch `batch` of `model`, checked against [`max_batch`].
pub fn check_batch(model: &ModelSpec, batch: u64) -> Result<u64, String> {
    let most = max_batch(model);
    match batch {
        0 => Err("a micro-batch must be at least 1".into()),
        b if b > most => Err(format!(
            "micro-batch {b} is too large (at most {most} for {})",
            crate::text::printable(&model.name)
        )),
        b => Ok(b),
    }
}

/// A complete plan for one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Micro-batch: samples per rank per forward/backward.
    pub batch: u64,
    /// Micro-batches per optimizer step (gradient accumulation); 1 for none.
    pub accumulation: u64,
    /// One choice per op, in the model's op order.
    pub choices: Vec<Choice>,
    /// Recompute flag per block index (`config.layers` entries).
    pub recompute: Vec<bool>,
    /// Per block index, whether a recomputed block keeps the weights its recomputation fetches
    /// for the backward that follows, as FSDP keeps a unit gathered, instead of fetching them a
    /// third time ([`kept_weights`]): faster where those fetches show, at the price of the
    /// block's weights held through its backward. Missing entries are `false`.
    pub keep_weights: Vec<bool>,
}

impl Plan {
    /// Whether block `b` recomputes and keeps the weights its recomputation fetches.
    pub fn keeps(&self, b: usize) -> bool {
        self.recompute.get(b) == Some(&true) && self.keep_weights.get(b) == Some(&true)
    }
}

/// Per op, whether a block's recomputation keeps the weight it fetched for the op's backward:
/// ops of a block that keeps ([`Plan::keeps`]) which its recomputation runs again
/// ([`Blocks::reruns`]), that own parameters used once, and whose choice fetches them whole
/// ([`Choice::fetches_whole`]). The trainer keeps exactly these; the cost model prices each
/// one's weight held from its recomputation to its backward ([`kept_weight_bytes`]) and its
/// fetches as [`OpCost::kept_recompute_comm_s`] says.
pub fn kept_ops(model: &ModelSpec, plan: &Plan) -> Vec<bool> {
    let blocks = Blocks::of(model);
    let uses = cost::parameter_uses(model);
    (0..model.ops.len())
        .map(|i| {
            blocks.of_op[i].is_some_and(|b| plan.keeps(b))
                && blocks.reruns(i)
                && cost::owns_params(&model.ops[i])
                && uses[i] <= 1
                && plan.choices[i].fetches_whole()
        })
        .collect()
}

/// The bytes a block that keeps holds of op `base`'s weight from its recomputation to its
/// backward: its first tensor whole in the compute dtype (the second, a bias, is released).
pub fn kept_weight_bytes(base: &OpBase, m: &Machine) -> u64 {
    m.precision.param_bytes * base.tensors[0].numel
}

/// The cost model's figures for a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    pub batch_size: u64,
    /// Micro-batches per optimizer step.
    pub accumulation: u64,
    /// Samples per optimizer step over all ranks: micro-batch × accumulation × ranks.
    pub global_batch: u64,
    pub step_time_s: f64,
    pub throughput_samples_per_s: f64,
    pub tokens_per_s: f64,
    pub peak_memory_bytes: u64,
    pub persistent_bytes: u64,
    pub activation_bytes: u64,
    pub max_transient_bytes: u64,
    pub overhead_bytes: u64,
    /// What the caching allocator reserves beside the compute stream's peak for the target's
    /// collectives (FSDP2's side streams, [`crate::cost::side_pool_bytes`]): part of the peak,
    /// not of the tensors live at it.
    pub side_pool_bytes: u64,
    /// Of `persistent_bytes` and `max_transient_bytes`, what is reserved with no live tensor at
    /// the peak ([`crate::cost::OpCost::cached_bytes`], [`crate::cost::OpBase::cached_working_bytes`]).
    pub cached_bytes: u64,
    /// Host memory the plan's offloaded state takes on each rank (0 without offload).
    pub host_bytes: u64,
    pub compute_s: f64,
    pub exposed_comm_s: f64,
    pub optimizer_s: f64,
    pub recompute_s: f64,
    /// Measured fixed cost of a step beyond its ops (calibrated layouts only).
    pub step_overhead_s: f64,
    /// Per op: memory it holds (persistent + kept activations) and time it adds.
    pub ops: Vec<OpFigures>,
}

impl Prediction {
    /// Bytes live in tensors at the peak, PyTorch's `max_memory_allocated`: the peak less the
    /// runtime's own (CUDA context, NCCL's buffers) and what other streams keep cached.
    pub fn allocated_bytes(&self) -> u64 {
        self.reserved_bytes()
            .saturating_sub(self.side_pool_bytes + self.cached_bytes)
    }

    /// Bytes the caching allocator holds at the peak, PyTorch's `max_memory_reserved`: the
    /// peak less the runtime's own.
    pub fn reserved_bytes(&self) -> u64 {
        self.peak_memory_bytes.saturating_sub(self.overhead_bytes)
    }

    /// `8` or, with accumulation, `8×4` (micro-batch × micro-batches per step).
    pub fn batch_label(&self) -> String {
        if self.accumulation > 1 {
            format!("{}×{}", self.batch_size, self.accumulation)
        } else {
            self.batch_size.to_string()
        }
    }

    /// Ranks the global batch is shared by: global batch over micro-batch × accumulation.
    pub fn ranks(&self) -> u64 {
        self.global_batch / (self.batch_size * self.accumulation).max(1)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpFigures {
    pub memory_bytes: u64,
    pub time_s: f64,
}

/// Facts about the blocks the planner and `evaluate` share.
#[derive(Debug, Clone, PartialEq)]
pub struct Blocks {
    /// Block index of each op, if any.
    pub of_op: Vec<Option<usize>>,
    /// Ops of each block.
    pub ops: Vec<Vec<usize>>,
    /// Per-sample bytes a recomputed block keeps: the outputs it reads from outside itself.
    pub input_bytes_per_sample: Vec<u64>,
}

/// Consecutive blocks a plan treats alike: `first..=last`, and what it does to each op that
/// owns parameters (`attn.c_attn=zero3 mlp.c_fc=zero2 recompute`, ids without the block prefix;
/// `recompute+keep-weights` where the block keeps the weights its recomputation fetches).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRun {
    pub first: usize,
    pub last: usize,
    pub description: String,
}

impl BlockRun {
    /// `block 3` or `blocks 0-16`.
    pub fn range(&self) -> String {
        if self.first == self.last {
            format!("block {}", self.first)
        } else {
            format!("blocks {}-{}", self.first, self.last)
        }
    }
}

impl Blocks {
    /// What `plan` does to block `b`'s ops, as [`BlockRun::description`] words.
    pub fn describe(&self, model: &ModelSpec, plan: &Plan, b: usize) -> String {
        let mut parts: Vec<String> = self.ops[b]
            .iter()
            .filter(|&&i| plan.choices[i].strategy != Strategy::None)
            .map(|&i| {
                let id = &model.ops[i].id;
                let short = id.split_once('.').map_or(id.as_str(), |(_, rest)| rest);
                format!(
                    "{}={}",
                    crate::text::printable(short),
                    plan.choices[i].label()
                )
            })
            .collect();
        if plan.keeps(b) {
            parts.push("recompute+keep-weights".into());
        } else if plan.recompute.get(b).copied().unwrap_or(false) {
            parts.push("recompute".into());
        }
        parts.join(" ")
    }

    /// The plan's blocks grouped into runs of alike blocks, in order: collapsed blocks hide no
    /// difference when shown this way.
    pub fn runs(&self, model: &ModelSpec, plan: &Plan) -> Vec<BlockRun> {
        let mut out: Vec<BlockRun> = Vec::new();
        for b in 0..self.ops.len() {
            let d = self.describe(model, plan, b);
            match out.last_mut() {
                Some(run) if run.description == d => run.last = b,
                _ => out.push(BlockRun {
                    first: b,
                    last: b,
                    description: d,
                }),
            }
        }
        out
    }

    /// The run of alike blocks that block `b` belongs to, looking only at its neighbours (what
    /// the dashboard draws every frame for the selected block).
    pub fn run_of(&self, model: &ModelSpec, plan: &Plan, b: usize) -> BlockRun {
        let d = self.describe(model, plan, b);
        let alike = |x: usize| self.describe(model, plan, x) == d;
        let first = (0..b).rev().take_while(|&x| alike(x)).last().unwrap_or(b);
        let last = (b + 1..self.ops.len())
            .take_while(|&x| alike(x))
            .last()
            .unwrap_or(b);
        BlockRun {
            first,
            last,
            description: d,
        }
    }

    pub fn of(model: &ModelSpec) -> Blocks {
        let n = model.config.layers as usize;
        let index = model.op_index();
        let of_op: Vec<Option<usize>> = model
            .ops
            .iter()
            .map(|o| o.block.map(|b| b as usize))
            .collect();
        let mut ops = vec![Vec::new(); n];
        for (i, b) in of_op.iter().enumerate() {
            if let Some(b) = b {
                ops[*b].push(i);
            }
        }
        let input_bytes_per_sample = ops
            .iter()
            .enumerate()
            .map(|(b, members)| {
                let mut outside: Vec<usize> = members
                    .iter()
                    .flat_map(|&i| model.ops[i].inputs.iter().map(|id| index[id.as_str()]))
                    .filter(|&j| of_op[j] != Some(b))
                    .collect();
                outside.sort_unstable();
                outside.dedup();
                outside
                    .iter()
                    .map(|&j| model.ops[j].output_bytes_per_sample)
                    .sum()
            })
            .collect();
        Blocks {
            of_op,
            ops,
            input_bytes_per_sample,
        }
    }

    /// Whether op `i`'s block's recomputation runs it again: every op of a block but its last,
    /// whose output the next block holds as its own input (the trainer skips an op whose output
    /// it still holds).
    pub fn reruns(&self, i: usize) -> bool {
        self.of_op[i].is_some_and(|b| self.ops[b].last() != Some(&i))
    }

    /// Activations a block keeps for backward at micro-batch `batch` without recomputation.
    pub fn saved_bytes(&self, block: usize, bases: &[OpBase]) -> u64 {
        self.ops[block].iter().map(|&i| bases[i].saved_bytes).sum()
    }

    /// Per op, what a recomputed block has rematerialised while that op runs backward: the
    /// activations kept by it and by the block's ops before it (those after it have run their
    /// backward and let theirs go). 0 for ops outside blocks.
    pub fn remat_at(&self, bases: &[OpBase]) -> Vec<u64> {
        let mut at = vec![0; self.of_op.len()];
        for members in &self.ops {
            let mut sum = 0;
            for &i in members {
                sum += bases[i].saved_bytes;
                at[i] = sum;
            }
        }
        at
    }
}

/// Whether machine `m` can run every choice of `plan`: names the first op it cannot (hsdp
/// on a layout of one node, offload on a layout without host figures).
pub fn check_machine(model: &ModelSpec, plan: &Plan, m: &Machine) -> Result<(), String> {
    for (op, choice) in model.ops.iter().zip(&plan.choices) {
        if let Some(why) = m.refuses_choice(*choice) {
            return Err(format!(
                "op {:?} is {}: {why}",
                crate::text::printable(&op.id),
                choice.label()
            ));
        }
    }
    Ok(())
}

/// Price a plan. The planner's figures are these, by construction.
pub fn evaluate(model: &ModelSpec, m: &Machine, plan: &Plan) -> Prediction {
    let mut bases = cost::op_bases(model, m, plan.batch);
    cost::set_accumulation(&mut bases, plan.accumulation);
    let blocks = Blocks::of(model);
    evaluate_with(model, m, plan, &bases, &blocks)
}

pub(crate) fn evaluate_with(
    model: &ModelSpec,
    m: &Machine,
    plan: &Plan,
    bases: &[OpBase],
    blocks: &Blocks,
) -> Prediction {
    let costs = price_all(m, &plan.choices, bases);
    let remat = blocks.remat_at(bases);
    evaluate_priced(model, m, plan, bases, blocks, &remat, &costs)
}

/// Each op's price under its choice.
pub(crate) fn price_all(m: &Machine, choices: &[Choice], bases: &[OpBase]) -> Vec<OpCost> {
    bases
        .iter()
        .zip(choices)
        .map(|(base, &c)| cost::price(base, c, m))
        .collect()
}

/// [`evaluate_with`] on prices already made ([`price_all`] of the plan's choices) and the
/// bases' rematerialised bytes ([`Blocks::remat_at`]): plans that differ only in recomputation
/// share them.
pub(crate) fn evaluate_priced(
    model: &ModelSpec,
    m: &Machine,
    plan: &Plan,
    bases: &[OpBase],
    blocks: &Blocks,
    remat: &[u64],
    costs: &[OpCost],
) -> Prediction {
    let (mut persistent, mut activations, mut max_transient, mut host) = (0u64, 0u64, 0u64, 0u64);
    let mut cached = 0u64;
    // Of the largest transient, what the allocator holds free (OpBase::cached_working_bytes).
    let mut transient_cached = 0u64;
    let (mut compute, mut exposed, mut optimizer, mut recompute) = (0.0, 0.0, 0.0, 0.0);
    let policy_saved = if m.selective_ops {
        selectively_saved(model, blocks)
    } else {
        Vec::new()
    };
    let mut ops = Vec::with_capacity(model.ops.len());
    // Per block, the weights its kept ops so far hold through the backward of the ops after
    // them (in the block's order, whatever ops outside it come between).
    let mut held_by_block = vec![0u64; blocks.ops.len()];
    for (i, base) in bases.iter().enumerate() {
        let c = &costs[i];
        let block = blocks.of_op[i];
        let held_before = block.map_or(0, |b| held_by_block[b]);
        let recomputed = block.is_some_and(|b| plan.recompute.get(b).copied().unwrap_or(false));
        // Under a selective policy a recomputed block keeps these ops' outputs and runs them
        // only once.
        let saved_by_policy = recomputed && policy_saved.get(i).copied().unwrap_or(false);
        let kept = match (recomputed, saved_by_policy) {
            (false, _) => base.saved_bytes,
            (true, true) => base.output_bytes,
            (true, false) => 0,
        };
        // `kept_ops`' rule on the op's own facts: its price says whether its choice fetches
        // whole what it uses once (and a machine that fetches nothing again keeps nothing).
        let keeps_i = block.is_some_and(|b| plan.keeps(b))
            && blocks.reruns(i)
            && c.kept_recompute_comm_s.is_some();
        let extra_s = match c.kept_recompute_comm_s.filter(|_| keeps_i) {
            _ if saved_by_policy => 0.0,
            Some(fetched) => base.recompute_s() + fetched,
            None if recomputed => c.recompute_s(base),
            None => 0.0,
        };
        persistent += c.persistent_bytes;
        cached += c.cached_bytes;
        host += c.host_bytes;
        activations += kept;
        let rematerialised = if recomputed {
            remat[i] + held_before
        } else {
            0
        };
        if let Some(b) = block.filter(|_| keeps_i) {
            held_by_block[b] += kept_weight_bytes(base, m);
        }
        if c.transient_bytes + rematerialised > max_transient {
            max_transient = c.transient_bytes + rematerialised;
            transient_cached = base.cached_working_bytes;
        }
        compute += c.compute_s;
        exposed += c.exposed_comm_s;
        optimizer += c.optimizer_s;
        recompute += extra_s;
        ops.push(OpFigures {
            memory_bytes: c.persistent_bytes + kept,
            time_s: c.time_s() + extra_s,
        });
    }
    for (b, &on) in plan.recompute.iter().enumerate() {
        if on && b < blocks.input_bytes_per_sample.len() {
            activations += m.activation_bytes(blocks.input_bytes_per_sample[b]) * plan.batch;
        }
    }
    let step = ops.iter().map(|o| o.time_s).sum::<f64>() + m.step_overhead_s();
    let global_batch = plan.batch * plan.accumulation * u64::from(m.ranks);
    let samples = global_batch as f64;
    Prediction {
        batch_size: plan.batch,
        accumulation: plan.accumulation,
        global_batch,
        step_time_s: step,
        throughput_samples_per_s: samples / step,
        tokens_per_s: samples * model.config.seq_len as f64 / step,
        peak_memory_bytes: m.fixed_bytes() + persistent + activations + max_transient,
        persistent_bytes: persistent,
        activation_bytes: activations,
        max_transient_bytes: max_transient,
        overhead_bytes: m.overhead_bytes,
        side_pool_bytes: m.side_pool_bytes,
        cached_bytes: cached + transient_cached,
        host_bytes: host,
        compute_s: compute,
        exposed_comm_s: exposed,
        optimizer_s: optimizer,
        recompute_s: recompute,
        step_overhead_s: m.step_overhead_s(),
        ops,
    }
}

/// Per op, whether torchtitan's op-level selective checkpointing saves its output
/// ([`Machine::selective_ops`]): inside a block, every attention core (its `_save_list` holds
/// SDPA's kernels) and the odd-numbered linears in forward order (it saves `aten.mm` outputs
/// except every second one: `mm_count % 2 == 0` is recomputed). Ops outside blocks: false.
pub fn selectively_saved(model: &ModelSpec, blocks: &Blocks) -> Vec<bool> {
    let mut saved = vec![false; model.ops.len()];
    for members in &blocks.ops {
        let mut matmuls = 0;
        for &i in members {
            match model.ops[i].kind {
                crate::model::OpKind::Attention => saved[i] = true,
                crate::model::OpKind::Linear => {
                    matmuls += 1;
                    saved[i] = matmuls % 2 == 1;
                }
                _ => {}
            }
        }
    }
    saved
}

/// Micro-batches per rank and step when `global` samples run on `world` ranks in micro-batches
/// of `micro` (a rank's share smaller than one micro-batch runs as one); why not, when the
/// ranks cannot share the batch or the micro-batches cannot make it. The rule the trainer runs
/// a plan by, at whatever global batch it is given: every (micro-batch, accumulation) pair
/// [`batch_options`] offers the planner passes it; a rank's share smaller than one
/// micro-batch, which the planner never picks, runs as one smaller micro-batch.
pub fn accumulation(global: u64, world: usize, micro: u64) -> Result<u64, String> {
    let world = world as u64;
    if global == 0 || world == 0 || global % world != 0 {
        return Err(format!(
            "world size {world} does not divide the global batch of {global} samples"
        ));
    }
    let (per_rank, micro) = (global / world, micro.max(1));
    if per_rank > micro && per_rank % micro != 0 {
        return Err(format!(
            "a global batch of {global} samples is {per_rank} per rank on {world} ranks, not a \
             whole number of the plan's micro-batches of {micro}; use a multiple of {}",
            micro * world
        ));
    }
    Ok((per_rank / micro).max(1))
}

/// What a plan's global batch is, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalBatch {
    /// The user fixed it (`--global-batch`, `--tokens-per-step`).
    Given(u64),
    /// Chosen for the user: a batch a real run of this model would use (see
    /// [`default_global_batch`]).
    Default(u64),
    /// None fixed: the highest samples/s at any batch (`--global-batch any`, or a fixed
    /// `--batch` alone).
    Any,
}

impl GlobalBatch {
    pub fn samples(self) -> Option<u64> {
        match self {
            GlobalBatch::Given(n) | GlobalBatch::Default(n) => Some(n),
            GlobalBatch::Any => None,
        }
    }

    /// Why a default was chosen, for the user who did not choose it: `global batch 1024 (1.05 M
    /// tokens per step, as published runs of a model this size use)`. `None` unless a default.
    /// `m`: the machine the default was chosen for ([`default_global_batch`]).
    pub fn explain_default(self, model: &ModelSpec, m: &Machine, cpu: bool) -> Option<String> {
        let GlobalBatch::Default(n) = self else {
            return None;
        };
        // Where the default is one sample per rank, the DDP step of it (the aim may be missed).
        let least_step = (cpu && n <= u64::from(m.ranks.max(1)))
            .then(|| evaluate(model, m, &uniform_plan(model, Strategy::Dp, 1)).step_time_s);
        let why = if let Some(step) = least_step.filter(|&s| s > CPU_DEFAULT_STEP_S) {
            format!(
                "one sample per rank, the least: even its DDP step takes {} on this layout",
                crate::units::seconds(step)
            )
        } else if cpu {
            "a step of about 2 s on this layout".to_string()
        } else {
            format!(
                "{} tokens per step, as published runs of a model this size use",
                crate::units::count(n * model.config.seq_len)
            )
        };
        Some(format!("global batch {n} ({why})"))
    }
}

/// Tokens per optimizer step published runs use for a model of `params` parameters: GPT-3's
/// (Brown et al. 2020, Table 2.1: 0.5 M tokens up to 760 M parameters, 1 M for 1.3–2.7 B, 2 M
/// for 6.7–13 B) and Llama 2's 4 M (Touvron et al. 2023, Table 1) beyond.
pub fn recipe_tokens_per_step(params: u64) -> u64 {
    match params {
        p if p < 1_000_000_000 => 1 << 19,
        p if p < 5_000_000_000 => 1 << 20,
        p if p < 50_000_000_000 => 1 << 21,
        _ => 1 << 22,
    }
}

/// Longest step the CPU default aims at: a first loss within seconds of pressing `s`.
pub const CPU_DEFAULT_STEP_S: f64 = 2.0;

/// The global batch a new user gets without `--global-batch`: on GPU layouts the published
/// recipe's tokens per step for the model's size ([`recipe_tokens_per_step`]) in whole
/// sequences; on CPU layouts the largest whose predicted DDP step stays within
/// [`CPU_DEFAULT_STEP_S`]. Either way a power of two per rank (many micro-batches divide it),
/// at least one sample per rank.
pub fn default_global_batch(model: &ModelSpec, m: &Machine, cpu: bool) -> u64 {
    let ranks = u64::from(m.ranks.max(1));
    let per_rank = if cpu {
        let step = |b: u64| evaluate(model, m, &uniform_plan(model, Strategy::Dp, b)).step_time_s;
        let mut b = 1u64;
        while b < 1 << 16 && step(b * 2) <= CPU_DEFAULT_STEP_S {
            b *= 2;
        }
        b
    } else {
        let samples = recipe_tokens_per_step(model.param_count()) / model.config.seq_len.max(1);
        let per_rank = (samples as f64 / ranks as f64).max(1.0);
        // The nearest power of two, in log terms.
        1u64 << (per_rank.log2().round() as u32).min(20)
    };
    per_rank * ranks
}

/// The same strategy on every op that owns parameters, no recomputation.
pub fn uniform_plan(model: &ModelSpec, strategy: Strategy, batch: u64) -> Plan {
    Plan {
        batch,
        accumulation: 1,
        choices: model
            .ops
            .iter()
            .map(|op| {
                if cost::owns_params(op) {
                    Choice::plain(strategy)
                } else {
                    Choice::NONE
                }
            })
            .collect(),
        recompute: vec![false; model.config.layers as usize],
        keep_weights: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::model::read_model;
    use std::path::Path;

    fn setup() -> (ModelSpec, Machine) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/gpt2.json")).unwrap();
        let layout = read_layout(&root.join("layouts/a100-80gb-8x-nvlink.json")).unwrap();
        let m = Machine::new(&layout, &model);
        (model, m)
    }

    /// torchtitan's op-level selective checkpointing in a Llama block: q, v, gate and down (the
    /// 1st, 3rd, 5th and 7th matmuls) and attention keep their outputs; k, o, up, the norms,
    /// the activation and the adds run again. Priced, a step recomputes less than whole blocks
    /// do and keeps more activations, and less than no recomputation keeps.
    #[test]
    fn selective_ops_keep_attention_and_every_other_matmul() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/llama-3-8b.json")).unwrap();
        let blocks = Blocks::of(&model);
        let saved = selectively_saved(&model, &blocks);
        let kept: Vec<&str> = blocks.ops[0]
            .iter()
            .filter(|&&i| saved[i])
            .map(|&i| model.ops[i].id.as_str())
            .collect();
        assert_eq!(
            kept,
            [
                "layers0.self_attn.q_proj",
                "layers0.self_attn.v_proj",
                "layers0.self_attn.core",
                "layers0.mlp.gate_proj",
                "layers0.mlp.down_proj",
            ]
        );
        let layout = read_layout(&root.join("layouts/h100-sxm-8x-nvlink.json")).unwrap();
        let mut m = Machine::new(&layout, &model);
        let mut plan = uniform_plan(&model, Strategy::Zero3, 1);
        let none = evaluate(&model, &m, &plan);
        plan.recompute.iter_mut().for_each(|r| *r = true);
        let whole = evaluate(&model, &m, &plan);
        m.selective_ops = true;
        let ops = evaluate(&model, &m, &plan);
        assert!(0.0 < ops.recompute_s && ops.recompute_s < 0.6 * whole.recompute_s);
        assert!(whole.activation_bytes < ops.activation_bytes);
        assert!(ops.activation_bytes < none.activation_bytes);
        assert!(ops.step_time_s < whole.step_time_s);
    }

    #[test]
    fn block_runs_group_alike_blocks_and_show_every_difference() {
        let (model, _) = setup();
        let blocks = Blocks::of(&model);
        let mut plan = uniform_plan(&model, Strategy::Zero3, 1);
        let n = blocks.ops.len();
        let whole = blocks.runs(&model, &plan);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].range(), format!("blocks 0-{}", n - 1));
        assert!(whole[0].description.contains("attn.c_attn=zero3"));
        // One op of block 3 differs, block 5 is recomputed: five runs, and each says why.
        let c_proj = model
            .ops
            .iter()
            .position(|o| o.id == "h3.attn.c_proj")
            .unwrap();
        plan.choices[c_proj] = Choice::DP;
        plan.recompute[5] = true;
        let runs = blocks.runs(&model, &plan);
        let ranges: Vec<String> = runs.iter().map(BlockRun::range).collect();
        assert_eq!(
            ranges,
            [
                "blocks 0-2",
                "block 3",
                "block 4",
                "block 5",
                &format!("blocks 6-{}", n - 1)
            ]
        );
        assert!(runs[1].description.contains("attn.c_proj=dp"), "{runs:?}");
        assert!(runs[3].description.ends_with("recompute"), "{runs:?}");
        assert_eq!(runs[2].description, runs[0].description);
        for run in &runs {
            for b in run.first..=run.last {
                assert_eq!(&blocks.run_of(&model, &plan, b), run, "block {b}");
            }
        }
    }

    #[test]
    fn recomputing_a_block_keeps_only_its_input() {
        let (model, m) = setup();
        let base = uniform_plan(&model, Strategy::Zero3, 4);
        let mut re = base.clone();
        re.recompute[3] = true;
        let (a, b) = (evaluate(&model, &m, &base), evaluate(&model, &m, &re));
        let bases = cost::op_bases(&model, &m, 4);
        let blocks = Blocks::of(&model);
        let saved = blocks.saved_bytes(3, &bases);
        // The block's input is the residual stream: seq × hidden bf16 per sample.
        assert_eq!(blocks.input_bytes_per_sample[3], 1024 * 768 * 2);
        assert_eq!(
            b.activation_bytes,
            a.activation_bytes - saved + 4 * 1024 * 768 * 2
        );
        let fwd: f64 = blocks.ops[3].iter().map(|&i| bases[i].fwd_s).sum();
        assert!((b.recompute_s - fwd).abs() < 1e-15);
        assert!((b.step_time_s - a.step_time_s - fwd).abs() < 1e-12);
        // While the block runs backward its activations exist again.
        assert!(b.max_transient_bytes >= saved);
    }

    #[test]
    fn peak_is_the_sum_of_its_parts() {
        let (model, m) = setup();
        let p = evaluate(&model, &m, &uniform_plan(&model, Strategy::Dp, 2));
        assert_eq!(
            p.peak_memory_bytes,
            p.overhead_bytes
                + p.side_pool_bytes
                + p.persistent_bytes
                + p.activation_bytes
                + p.max_transient_bytes
        );
        // DDP holds 16 bytes for every parameter.
        assert_eq!(p.persistent_bytes, 16 * model.param_count());
        let samples = 2.0 * 8.0;
        assert!((p.throughput_samples_per_s - samples / p.step_time_s).abs() < 1e-9);
    }

    /// Issue 32: a global batch near 2^64 overflowed the nearest multiple ("… and 0"), and a
    /// search with no answer named a budget of 2^64 − 1 bytes.
    #[test]
    fn odd_requests_are_refused_in_words_without_overflow() {
        let at = |global| PlanOptions {
            global_batch: Some(global),
            ..PlanOptions::default()
        };
        let most = max_global_batch(2);
        assert_eq!(
            batch_options(&at(u64::MAX), 2),
            Err(BatchError::TooLarge {
                global: u64::MAX,
                ranks: 2,
                max: most / 2,
                most,
            })
        );
        assert!(batch_options(&at(most + 1), 2).is_err());
        assert_eq!(batch_options(&at(most), 2).map(|o| o.is_empty()), Ok(false));
        match batch_options(&at(most - 1), 2) {
            Err(BatchError::NotDivisible { below, above, .. }) => {
                assert_eq!((below, above), (most - 2, most))
            }
            other => panic!("{other:?}"),
        }
        for host in [None, Some(0), Some(1 << 20)] {
            let nf = NoFit {
                min_budget_bytes: None,
                host_budget_bytes: host,
            };
            let said = nf.describe(8 << 30, "GPU");
            assert!(said.starts_with("nothing fits 8.0 GiB per GPU"), "{said}");
            assert!(
                !said.contains("EiB") && !said.contains("smallest"),
                "{said}"
            );
        }
    }
}
