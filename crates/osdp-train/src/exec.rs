//! The executor: runs a model.json graph forward and backward op by op under a plan, holding
//! exactly the tensors the plan says. A `zero3` weight is gathered for its op and dropped, then
//! gathered again in backward; a split linear gathers one column slice at a time; a recomputed
//! block keeps only its inputs and re-runs its forward when backward reaches it. Every byte it
//! holds goes through the [`Ledger`], which is the "measured" side of predicted vs measured.

use std::collections::HashMap;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::checkpoint::{RegionKey, Saved};
use super::collective::{Aborted, Collective};
use super::data::{Batch, SplitMix};
use super::memory::{Category, Ledger};
use super::ops::{self, AttentionShape};
use osdp_core::cost::{self, Holding, Offload};
use osdp_core::model::{Activation, AttentionImpl, ModelConfig, ModelSpec, OpKind, Positional};
use osdp_core::plan::{Blocks, Plan};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("the trainer cannot run this: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Aborted(#[from] Aborted),
}

pub type Result<T> = std::result::Result<T, ExecError>;

/// How the executor stores and computes numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numerics {
    /// Everything in fp32: parameters, gradients, activations, moments.
    Fp32,
    /// bf16 compute copies of the parameters, bf16 gradients and activations; an fp32 master
    /// copy of what this rank updates and fp32 moments (the cost model's mixed precision: 2 + 2
    /// + 12 bytes per parameter). The loss head keeps fp32 log-probabilities.
    Bf16Mixed,
}

impl Numerics {
    /// The kind parameters, activations and gradients are computed in.
    pub fn compute_kind(self) -> Kind {
        match self {
            Numerics::Fp32 => Kind::Float,
            Numerics::Bf16Mixed => Kind::BFloat16,
        }
    }

    pub fn name(self) -> &'static str {
        self.precision().name
    }

    /// The cost model's accounting of these numerics: bytes per parameter of the compute
    /// copy, the gradient and the optimizer states (master and moments), and per activation
    /// element. The executor allocates exactly these (the ledger test holds it to them).
    pub fn precision(self) -> cost::Precision {
        match self {
            Numerics::Fp32 => cost::Precision::FP32,
            Numerics::Bf16Mixed => cost::Precision::MIXED_BF16,
        }
    }
}

/// Where one rank computes and in what precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub device: Device,
    pub numerics: Numerics,
}

impl Target {
    /// The CPU in fp32: the trainer's default, and what calibration and validation time.
    pub const CPU: Target = Target {
        device: Device::Cpu,
        numerics: Numerics::Fp32,
    };
}

/// AdamW with global-norm gradient clipping and a linear warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 disables).
    pub clip_norm: f64,
    pub warmup_steps: u64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-5,
            weight_decay: 0.1,
            clip_norm: 1.0,
            warmup_steps: 10,
        }
    }
}

impl OptimConfig {
    /// The learning rate of optimizer step `step` (1-based): linear warm-up, then constant.
    pub fn lr_at(&self, step: u64) -> f64 {
        if self.warmup_steps == 0 {
            return self.lr;
        }
        self.lr * (step as f64 / self.warmup_steps as f64).min(1.0)
    }
}

/// A parameter, or one column slice of a split linear's weight: the granularity of sharding.
struct Unit {
    /// `op.param` of the full parameter.
    key: String,
    /// The op that owns the parameter.
    op: usize,
    /// Column range `(start, len)` of a split weight.
    cols: Option<(i64, i64)>,
    shape: Vec<i64>,
    numel: i64,
    class: Holding,
    /// `ceil(numel / ranks)`: each rank's share of the padded flat unit, over the ranks it is
    /// sharded among (all of them; a node's for hsdp).
    shard_len: i64,
    /// This rank's real (unpadded) share: `(start, len)` in the flat unit.
    region: (i64, i64),
    /// Full unit (dp, zero1, zero2) or this rank's padded shard (zero3, hsdp), in the compute
    /// kind.
    data: Tensor,
    /// Mixed precision only: the fp32 master of what this rank updates — the full unit (dp)
    /// or its padded share (zero1, zero2, zero3). In fp32 `data` is its own master.
    master: Option<Tensor>,
    /// Full gradient (dp, zero1) or this rank's padded shard (zero2, zero3), while held.
    grad: Option<Tensor>,
    /// AdamW moments: full (dp) or this rank's padded share.
    m: Tensor,
    v: Tensor,
    decay: bool,
    /// What of the unit lives in host memory (`cost::Offload`): under offload-opt the master
    /// (fp32, always), the moments and `host_grad`; under offload-param `data` too.
    offload: Offload,
    /// Offloaded units: the fp32 gradient of what this rank updates, in host memory. Where
    /// gradients are sharded every micro-batch (`Holding::streams_grads`) each micro-batch's
    /// shard is summed here and the device holds none; otherwise the synchronised gradient
    /// is copied here at the step.
    host_grad: Option<Tensor>,
}

/// Where offloaded state lives.
const HOST: Device = Device::Cpu;

/// `t` in host memory, in storage of its own (on a CPU "device" too: the two are accounted
/// apart, so they must not share). From a GPU the host copy is page-locked: copies to and from
/// it run at the link's DMA rate, which is what the cost model prices, and later in-place
/// updates keep it pinned.
fn to_host(t: &Tensor) -> Tensor {
    match t.device() {
        HOST => t.copy(),
        d => t.to_device(HOST).pin_memory(d),
    }
}

/// Full (unsharded) values of one parameter in host memory: weights and AdamW moments (empty
/// when zero). What checkpoints hold; plain data, so rank threads can share it.
pub struct FullState {
    pub shape: Vec<i64>,
    pub param: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl FullState {
    fn tensors(&self) -> (Tensor, Tensor, Tensor) {
        let t = |v: &[f32]| {
            if v.is_empty() {
                Tensor::zeros(self.shape.as_slice(), (Kind::Float, Device::Cpu))
            } else {
                Tensor::from_slice(v).reshape(self.shape.as_slice())
            }
        };
        (t(&self.param), t(&self.m), t(&self.v))
    }
}

/// Where initial values come from.
pub enum Init<'a> {
    /// Deterministic from the seed and the parameter's name, whatever the plan or world size.
    Fresh { seed: u64 },
    /// Values from a checkpoint, keyed by `op.param`, with the optimizer's step count.
    Restored {
        params: &'a HashMap<String, FullState>,
        step: u64,
    },
}

fn nbytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// A held activation and the ledger category it is counted in.
struct Held {
    t: Tensor,
    cat: Category,
}

pub struct Executor {
    model: ModelSpec,
    comm: Box<dyn Collective>,
    device: Device,
    kind: Kind,
    units: Vec<Unit>,
    /// Per op, per parameter slot: its units (column slices in order).
    uses: Vec<Vec<Vec<usize>>>,
    /// Who reads what, what forward keeps, which blocks recompute.
    flow: Dataflow,
    attn: AttentionShape,
    rope: Option<(Tensor, Tensor)>,
    act: Activation,
    norm_eps: f64,
    position_offset: i64,
    pub optim: OptimConfig,
    /// AdamW steps taken.
    pub step: u64,
    pub ledger: Ledger,
    outs: Vec<Option<Held>>,
    extras: Vec<Vec<Tensor>>,
    grads: Vec<Option<Tensor>>,
    ids: Option<Tensor>,
    labels: Option<Tensor>,
    /// Samples per forward/backward (the plan's micro-batch); a step's rows run in
    /// micro-batches of this size, gradients accumulated, the optimizer once.
    micro_batch: usize,
    /// Filled by each step when set.
    pub profile: Option<Profile>,
    /// Filled by each forward pass when set (see [`Executor::enable_memory_trace`]).
    pub forward_memory: Option<ForwardMemory>,
}

/// What one rank holds when a forward pass ends, by category and op by op: the moment every
/// kept activation and every byte of state is held, which the cost model's per-op figures
/// (`cost::price(..).persistent_bytes`, `OpBase::saved_bytes`) are checked against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardMemory {
    /// The ledger's categories then.
    pub ledger: super::memory::Breakdown,
    /// Per op: bytes of the parameters it owns on the device (compute copy, fp32 master,
    /// moments, gradient).
    pub state_bytes: Vec<u64>,
    /// Per op: bytes of its parameters' state in host memory (offloaded).
    pub host_state_bytes: Vec<u64>,
    /// Per op: bytes of its output held for backward (or as a recomputed block's restart).
    pub kept_output_bytes: Vec<u64>,
    /// Per op: bytes its kernels keep beside the graph's tensors (norm statistics,
    /// log-sum-exp, log-probabilities).
    pub kept_extra_bytes: Vec<u64>,
}

/// Where one rank's last step spent its time (when profiling is on): what `calibrate` fits
/// the cost model's curves to, and what `validate` compares with the prediction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// Per op: forward and backward seconds, collectives of the op included.
    pub fwd_s: Vec<f64>,
    pub bwd_s: Vec<f64>,
    /// Per op: seconds of `fwd_s` and `bwd_s` spent in the op's collectives (gathering its
    /// sharded weights, reduce-scattering its gradients), so compute can be told apart.
    pub fwd_coll_s: Vec<f64>,
    pub bwd_coll_s: Vec<f64>,
    /// Recomputed forwards.
    pub recompute_s: f64,
    /// Gradient buffers, norm and AdamW.
    pub optimizer_s: f64,
    /// Gradient synchronisation and the re-gather of zero1/zero2 parameters.
    pub sync_s: f64,
    pub step_s: f64,
    /// Every all-gather and reduce-scatter of a sharded weight or gradient inside the ops:
    /// (bytes of the full tensor, seconds), waiting for the other ranks included.
    pub collectives: Vec<(f64, f64)>,
}

impl Profile {
    /// Seconds of the collectives recorded after the first `from`.
    fn collective_s_since(&self, from: usize) -> f64 {
        self.collectives
            .get(from..)
            .map_or(0.0, |c| c.iter().map(|x| x.1).sum())
    }
}

/// What one training step measured on one rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Mean token loss over the global batch.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
}

/// Whether the executor can run `plan` on `model`; says why not. Cheap: no tensors.
pub fn check_runnable(model: &ModelSpec, plan: &Plan) -> Result<()> {
    let c = &model.config;
    if model.family == osdp_core::model::Family::Bert || !c.causal {
        return Err(ExecError::Unsupported(
            "masked-language (encoder) models; the trainer runs causal LMs (GPT-2, OPT, LLaMA families)".into(),
        ));
    }
    if plan.choices.len() != model.ops.len() {
        return Err(ExecError::Unsupported(format!(
            "the plan has {} choices for {} ops",
            plan.choices.len(),
            model.ops.len()
        )));
    }
    if c.attention == AttentionImpl::Eager {
        // The trainer's kernels are fused: they keep what `flash` prices, not probabilities.
        return Err(ExecError::Unsupported(
            "eager attention; the trainer's attention is fused: describe the model with \"attention\": \"flash\" (import-hf --attention flash)".into(),
        ));
    }
    let blocks = Blocks::of(model);
    for (b, members) in blocks.ops.iter().enumerate() {
        if let (Some(&lo), Some(&hi)) = (members.first(), members.last()) {
            if hi - lo + 1 != members.len() {
                return Err(ExecError::Unsupported(format!(
                    "block {b}'s ops are not contiguous in the op list"
                )));
            }
        }
    }
    for (i, op) in model.ops.iter().enumerate() {
        let split = i64::from(plan.choices[i].split.max(1));
        if op.kind == OpKind::Linear && split > 1 {
            let in_features = op
                .params
                .first()
                .and_then(|p| p.shape.get(1))
                .copied()
                .unwrap_or(0);
            if in_features % split != 0 {
                return Err(ExecError::Unsupported(format!(
                    "op {:?} has {in_features} input features, which {split} slices do not divide",
                    op.id
                )));
            }
        }
        for p in &op.params {
            if p.tied_to.is_some() && p.name != "weight" {
                return Err(ExecError::Unsupported(format!(
                    "op {:?} ties its {:?}; only weights can be tied",
                    op.id, p.name
                )));
            }
        }
        for p in &op.params {
            if let (Some(j), Some(target)) = (model.tie_owner(p), &p.tied_to) {
                if plan.choices[j].split > 1 {
                    return Err(ExecError::Unsupported(format!(
                        "op {:?} shares {target:?}, which the plan splits; keep {:?} unsplit",
                        op.id, model.ops[j].id
                    )));
                }
            }
        }
    }
    Ok(())
}

fn init_values(seed: u64, key: &str, shape: &[i64]) -> Vec<f32> {
    let numel: i64 = shape.iter().product();
    let name = osdp_core::model::split_param_key(key).map_or("", |(_, name)| name);
    if name == "bias" {
        return vec![0.0; numel as usize];
    }
    if shape.len() == 1 {
        return vec![1.0; numel as usize];
    }
    let mut rng = SplitMix::for_name(seed, key);
    (0..numel)
        .map(|_| (rng.next_normal() * 0.02) as f32)
        .collect()
}

/// The graph as the executor walks it: each op's inputs and consumers, what backward reads,
/// what forward keeps, and which ops recompute in which block.
struct Dataflow {
    /// Each op's inputs (op indices).
    inputs: Vec<Vec<usize>>,
    /// The ops that read each op's output.
    consumers: Vec<Vec<usize>>,
    /// Outputs some op reads in backward (ignoring recomputation).
    need_bwd: Vec<bool>,
    /// Outputs kept through the forward pass: `need_bwd` minus recomputed blocks, plus the
    /// inputs those blocks restart from.
    keep_fwd: Vec<bool>,
    /// Block of each op when that block recomputes.
    recomputed_block: Vec<Option<usize>>,
    blocks: Blocks,
}

impl Dataflow {
    fn of(model: &ModelSpec, plan: &Plan) -> Dataflow {
        let c = &model.config;
        let n = model.ops.len();
        let index = model.op_index();
        let inputs: Vec<Vec<usize>> = model
            .ops
            .iter()
            .map(|o| o.inputs.iter().map(|id| index[id.as_str()]).collect())
            .collect();
        let mut consumers = vec![Vec::new(); n];
        for (i, ins) in inputs.iter().enumerate() {
            for &j in ins {
                consumers[j].push(i);
            }
        }
        let blocks = Blocks::of(model);
        let recomputed_block: Vec<Option<usize>> = (0..n)
            .map(|i| blocks.of_op[i].filter(|&b| plan.recompute.get(b) == Some(&true)))
            .collect();
        // Who reads each output in backward: the one rule behind what forward keeps.
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, op) in model.ops.iter().enumerate() {
            for j in bwd_reads(op.kind, i, &inputs[i], c) {
                readers[j].push(i);
            }
        }
        let need_bwd: Vec<bool> = readers.iter().map(|r| !r.is_empty()).collect();
        // Kept through forward if an op outside any recomputed block reads it in backward, or a
        // recomputed block restarts from it.
        let keep_fwd: Vec<bool> = (0..n)
            .map(|i| {
                readers[i].iter().any(|&r| recomputed_block[r].is_none())
                    || consumers[i].iter().any(|&c2| {
                        recomputed_block[c2].is_some()
                            && recomputed_block[c2] != recomputed_block[i]
                    })
            })
            .collect();

        Dataflow {
            inputs,
            consumers,
            need_bwd,
            keep_fwd,
            recomputed_block,
            blocks,
        }
    }
}

/// The parameter units this rank holds (its shares, gathered on use).
struct Units {
    units: Vec<Unit>,
    /// Per op, per parameter: the units it reads.
    uses: Vec<Vec<Vec<usize>>>,
    /// Per parameter key: its units (several when split by columns).
    by_key: HashMap<String, Vec<usize>>,
    /// What the units hold, by category.
    ledger: Ledger,
}

/// Build this rank's [`Units`] under `plan`, from fresh or restored values.
fn build_units(
    model: &ModelSpec,
    plan: &Plan,
    comm: &dyn Collective,
    target: Target,
    init: &Init<'_>,
) -> Result<Units> {
    let device = target.device;
    let kind = target.numerics.compute_kind();
    let mixed = target.numerics == Numerics::Bf16Mixed;
    // The ranks a unit is sharded among: all of them, or for hsdp this rank's node.
    let sharding = |class: Holding| -> (i64, i64) {
        match (class, comm.nodes()) {
            (Holding::Hybrid, Some(n)) => (n.shard.rank() as i64, n.shard.world() as i64),
            _ => (comm.rank() as i64, comm.world() as i64),
        }
    };
    let mut units = Vec::new();
    let mut uses: Vec<Vec<Vec<usize>>> = model
        .ops
        .iter()
        .map(|o| vec![Vec::new(); o.params.len()])
        .collect();
    let mut by_key: HashMap<String, Vec<usize>> = HashMap::new();
    let mut ledger = Ledger::default();
    for (i, op) in model.ops.iter().enumerate() {
        let choice = plan.choices[i];
        for (p, param) in op.params.iter().enumerate() {
            if param.tied_to.is_some() {
                continue;
            }
            let key = osdp_core::model::param_key(&op.id, &param.name);
            if key.contains('|') {
                return Err(ExecError::Unsupported(format!(
                    "parameter name {key:?} contains '|'"
                )));
            }
            let (full_p, full_m, full_v) = match init {
                Init::Fresh { seed } => FullState {
                    shape: param.shape.clone(),
                    param: init_values(*seed, &key, &param.shape),
                    m: Vec::new(),
                    v: Vec::new(),
                }
                .tensors(),
                Init::Restored { params, .. } => {
                    let s = params.get(&key).ok_or_else(|| {
                        ExecError::Unsupported(format!("the checkpoint has no parameter {key:?}"))
                    })?;
                    if s.shape != param.shape {
                        return Err(ExecError::Unsupported(format!(
                            "the checkpoint's {key:?} has shape {:?}, the model says {:?}",
                            s.shape, param.shape
                        )));
                    }
                    s.tensors()
                }
            };
            // The cost model prices the same units (`cost::Choice::units`).
            let cut = cost::cut_by_split(op.kind, &param.name);
            for unit in choice.units(param.numel(), cut) {
                let class = unit.holding;
                let cols = match unit.slice {
                    Some((j, k)) => {
                        let (j, k, in_features) = (i64::from(j), i64::from(k), param.shape[1]);
                        if in_features % k != 0 {
                            return Err(ExecError::Unsupported(format!(
                                "op {:?} has {in_features} input features, which {k} slices do not divide",
                                op.id
                            )));
                        }
                        Some((j * in_features / k, in_features / k))
                    }
                    None => None,
                };
                let take = |t: &Tensor| match cols {
                    Some((start, len)) => t.narrow(1, start, len).contiguous(),
                    None => t.shallow_clone(),
                };
                let (pv, mv, vv) = (take(&full_p), take(&full_m), take(&full_v));
                let shape = pv.size();
                let numel: i64 = shape.iter().product();
                let (rank, world) = sharding(class);
                let shard_len = (numel + world - 1) / world;
                let start = (rank * shard_len).min(numel);
                let len = (numel - start).clamp(0, shard_len);
                let padded_share = |t: &Tensor| {
                    let flat = t.reshape([-1]);
                    let share = Tensor::zeros([shard_len], (Kind::Float, Device::Cpu));
                    if len > 0 {
                        share.narrow(0, 0, len).copy_(&flat.narrow(0, start, len));
                    }
                    share.to_device(device)
                };
                let owned = match class {
                    Holding::Replicated => pv.to_kind(Kind::Float).to_device(device),
                    _ => padded_share(&pv),
                };
                let data = match class {
                    Holding::Zero3 | Holding::Hybrid => owned.to_kind(kind),
                    _ => pv.to_kind(kind).to_device(device),
                };
                let (m, v) = match class {
                    Holding::Replicated => (mv.to_device(device), vv.to_device(device)),
                    _ => (padded_share(&mv), padded_share(&vv)),
                };
                // Offloaded: the fp32 master, the moments and a gradient buffer of what this
                // rank updates in host memory (the cost model's `Holding::placed_bytes`), and
                // under offload-param the compute copy too.
                let offload = choice.offload;
                let (data, master, m, v, host_grad) = if offload.is_none() {
                    (data, mixed.then_some(owned), m, v, None)
                } else {
                    let updated = match class {
                        Holding::Replicated => numel,
                        _ => shard_len,
                    };
                    let data = match offload {
                        Offload::Param => to_host(&data),
                        _ => data,
                    };
                    (
                        data,
                        Some(to_host(&owned.to_kind(Kind::Float))),
                        to_host(&m),
                        to_host(&v),
                        Some(Tensor::zeros([updated], (Kind::Float, HOST))),
                    )
                };
                let master_bytes = master.as_ref().map_or(0, nbytes);
                let moments = nbytes(&m) + nbytes(&v);
                match offload {
                    Offload::None => {
                        ledger.add(Category::Params, nbytes(&data));
                        ledger.add(Category::Optimizer, moments + master_bytes);
                    }
                    _ => {
                        let host_data = match offload {
                            Offload::Param => nbytes(&data),
                            _ => {
                                ledger.add(Category::Params, nbytes(&data));
                                0
                            }
                        };
                        let grad_bytes = host_grad.as_ref().map_or(0, nbytes);
                        ledger.add_host(host_data + master_bytes + moments + grad_bytes);
                    }
                }
                by_key.entry(key.clone()).or_default().push(units.len());
                uses[i][p].push(units.len());
                units.push(Unit {
                    key: key.clone(),
                    op: i,
                    cols,
                    numel,
                    shape,
                    class,
                    shard_len,
                    region: (start, len),
                    data,
                    master,
                    grad: None,
                    m,
                    v,
                    decay: param.shape.len() >= 2,
                    offload,
                    host_grad,
                });
            }
        }
    }
    Ok(Units {
        units,
        uses,
        by_key,
        ledger,
    })
}

/// Point every tied parameter at its owner's unit (a tie to a split or unknown parameter is
/// refused).
fn resolve_ties(
    model: &ModelSpec,
    by_key: &HashMap<String, Vec<usize>>,
    uses: &mut [Vec<Vec<usize>>],
) -> Result<()> {
    for (i, op) in model.ops.iter().enumerate() {
        for (p, param) in op.params.iter().enumerate() {
            if let Some(target) = &param.tied_to {
                let owner = by_key.get(target).ok_or_else(|| {
                    ExecError::Unsupported(format!("op {:?} is tied to unknown {target:?}", op.id))
                })?;
                if owner.len() != 1 {
                    return Err(ExecError::Unsupported(format!(
                        "op {:?} is tied to {target:?}, which is split",
                        op.id
                    )));
                }
                uses[i][p] = owner.clone();
            }
        }
    }
    Ok(())
}

impl Executor {
    /// Build one rank's executor. Checks everything about the model and plan the executor
    /// needs before it allocates.
    pub fn new(
        model: &ModelSpec,
        plan: &Plan,
        comm: Box<dyn Collective>,
        target: Target,
        init: Init<'_>,
        optim: OptimConfig,
    ) -> Result<Executor> {
        check_runnable(model, plan)?;
        let device = target.device;
        let kind = target.numerics.compute_kind();
        let c = &model.config;
        if let Some(i) = plan
            .choices
            .iter()
            .position(|c| c.strategy.info().needs == cost::Needs::SeveralNodes)
        {
            if comm.nodes().is_none() {
                return Err(ExecError::Unsupported(format!(
                    "op {:?} is hsdp, which shards inside a node and replicates across nodes, \
                     but these {} ranks are one node: arrange them in nodes (train \
                     --ranks-per-node N, N dividing the world size and smaller than it)",
                    model.ops[i].id,
                    comm.world()
                )));
            }
        }
        let n = model.ops.len();
        let flow = Dataflow::of(model, plan);
        let Units {
            units,
            mut uses,
            by_key,
            ledger,
        } = build_units(model, plan, comm.as_ref(), target, &init)?;
        resolve_ties(model, &by_key, &mut uses)?;
        let attn = AttentionShape {
            heads: c.heads as i64,
            kv_heads: c.kv_heads as i64,
            head_dim: c.head_dim as i64,
            causal: c.causal,
            rope_theta: (c.positional == Positional::Rotary)
                .then(|| c.rope_theta.unwrap_or(10000.0)),
        };
        let rope = attn
            .rope_theta
            .map(|t| ops::rope_tables(c.seq_len as i64, attn.head_dim, t, device));
        let step = match init {
            Init::Fresh { .. } => 0,
            Init::Restored { step, .. } => step,
        };
        Ok(Executor {
            micro_batch: plan.batch.max(1) as usize,
            model: model.clone(),
            comm,
            device,
            kind,
            units,
            uses,
            flow,
            attn,
            rope,
            act: c.activation,
            norm_eps: c.norm_eps,
            position_offset: c.position_offset as i64,
            optim,
            step,
            ledger,
            outs: (0..n).map(|_| None).collect(),
            extras: (0..n).map(|_| Vec::new()).collect(),
            grads: (0..n).map(|_| None).collect(),
            ids: None,
            labels: None,
            profile: None,
            forward_memory: None,
        })
    }

    /// Time every op of the following steps (see [`Profile`]).
    pub fn enable_profiling(&mut self) {
        self.profile = Some(Profile::default());
    }

    /// Record what is held at the end of every forward pass (see [`ForwardMemory`]).
    pub fn enable_memory_trace(&mut self) {
        self.forward_memory = Some(ForwardMemory::default());
    }

    fn trace_forward_memory(&mut self) {
        if self.forward_memory.is_none() {
            return;
        }
        let n = self.model.ops.len();
        let mut state_bytes = vec![0; n];
        let mut host_state_bytes = vec![0; n];
        for unit in &self.units {
            let master = unit.master.as_ref().map_or(0, nbytes);
            let grads = unit.grad.as_ref().map_or(0, nbytes);
            let moments = nbytes(&unit.m) + nbytes(&unit.v);
            let host_grad = unit.host_grad.as_ref().map_or(0, nbytes);
            let (device, host) = match unit.offload {
                Offload::None => (nbytes(&unit.data) + master + grads + moments, 0),
                Offload::Opt => (nbytes(&unit.data) + grads, master + moments + host_grad),
                Offload::Param => (grads, nbytes(&unit.data) + master + moments + host_grad),
            };
            state_bytes[unit.op] += device;
            host_state_bytes[unit.op] += host;
        }
        let kept_output_bytes = self
            .outs
            .iter()
            .map(|h| match h {
                Some(h) if h.cat == Category::Activations => nbytes(&h.t),
                _ => 0,
            })
            .collect();
        let kept_extra_bytes = self
            .extras
            .iter()
            .map(|e| e.iter().map(nbytes).sum())
            .collect();
        self.forward_memory = Some(ForwardMemory {
            ledger: self.ledger.now(),
            state_bytes,
            host_state_bytes,
            kept_output_bytes,
            kept_extra_bytes,
        });
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    pub fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }

    /// The ranks a unit held as `class` is sharded among: hsdp's node, else all of them.
    fn sharding(&self, class: Holding) -> &dyn Collective {
        match (class, self.comm.nodes()) {
            (Holding::Hybrid, Some(n)) => n.shard.as_ref(),
            _ => self.comm.as_ref(),
        }
    }

    /// Whether this rank writes and counts the shards of hsdp units: those of the first node
    /// (the other nodes hold copies).
    fn first_node(&self) -> bool {
        self.comm.nodes().is_none_or(|n| n.node() == 0)
    }

    /// The full weight of a unit for compute: gathered (and counted) for ZeRO-3 and hsdp.
    fn weight(&mut self, u: usize) -> Result<Tensor> {
        let class = self.units[u].class;
        // An offloaded compute copy is fetched from host memory first (this rank's part).
        let fetched = (self.units[u].offload == Offload::Param).then(|| {
            let data = &self.units[u].data;
            match self.device {
                HOST => data.copy(),
                d => data.to_device(d),
            }
        });
        if let Some(f) = &fetched {
            self.ledger.add(Category::Gathered, nbytes(f));
        }
        let unit = &self.units[u];
        if !matches!(class, Holding::Zero3 | Holding::Hybrid) {
            return Ok(fetched.unwrap_or_else(|| unit.data.shallow_clone()));
        }
        let t0 = Instant::now();
        let full = self
            .sharding(class)
            .all_gather(fetched.as_ref().unwrap_or(&unit.data))?;
        let w = full.narrow(0, 0, unit.numel).reshape(unit.shape.as_slice());
        self.record_collective(nbytes(&full), t0);
        self.ledger.add(Category::Gathered, nbytes(&full));
        if let Some(f) = fetched {
            self.ledger.sub(Category::Gathered, nbytes(&f));
        }
        Ok(w)
    }

    /// A profiler clock reading. On a GPU kernels run after the host queues them, so while
    /// profiling it first waits for the device: the times are then the kernels', at the cost
    /// of a synchronisation per reading (a few µs).
    fn clock(&self) -> Instant {
        if self.profile.is_some() {
            if let Device::Cuda(i) = self.device {
                tch::Cuda::synchronize(i as i64);
            }
        }
        Instant::now()
    }

    /// Seconds since `t0`, read as [`Executor::clock`] reads.
    fn since(&self, t0: Instant) -> f64 {
        (self.clock() - t0).as_secs_f64()
    }

    /// How many collectives the profile holds (0 when not profiling).
    fn collectives_so_far(&self) -> usize {
        self.profile.as_ref().map_or(0, |p| p.collectives.len())
    }

    fn record_collective(&mut self, bytes: u64, t0: Instant) {
        if let Some(p) = self.profile.as_mut() {
            p.collectives
                .push((bytes as f64, t0.elapsed().as_secs_f64()));
        }
    }

    fn release(&mut self, u: usize, w: Tensor) {
        let class = self.units[u].class;
        let fetched = self.units[u].offload == Offload::Param;
        if fetched && !matches!(class, Holding::Zero3 | Holding::Hybrid) {
            self.ledger.sub(Category::Gathered, nbytes(&w));
        }
        if matches!(class, Holding::Zero3 | Holding::Hybrid) {
            let padded = self.units[u].shard_len * self.sharding(class).world() as i64;
            self.ledger.sub(
                Category::Gathered,
                padded as u64 * w.kind().elt_size_in_bytes() as u64,
            );
        }
        drop(w);
    }

    /// Add one use's gradient to a unit: kept whole (dp, zero1) or reduce-scattered now (over
    /// the node for hsdp).
    fn add_param_grad(&mut self, u: usize, g: Tensor) -> Result<()> {
        let (class, shard_len) = (self.units[u].class, self.units[u].shard_len);
        let g = g.to_kind(self.kind);
        let contribution = match class {
            Holding::Replicated | Holding::Zero1 => g,
            Holding::Zero2 | Holding::Zero3 | Holding::Hybrid => {
                let padded = pad_flat(&g, shard_len * self.sharding(class).world() as i64);
                let bytes = nbytes(&padded);
                self.ledger.add(Category::GradBuffers, bytes);
                let t0 = Instant::now();
                let shard = self.sharding(class).reduce_scatter(&padded)?;
                self.record_collective(bytes, t0);
                drop(padded);
                self.ledger.sub(Category::GradBuffers, bytes);
                shard
            }
        };
        let unit = &mut self.units[u];
        if !unit.offload.is_none() && class.streams_grads() {
            // Offloaded: the shard leaves for the host buffer now.
            if let Some(h) = &mut unit.host_grad {
                *h += contribution
                    .to_kind(Kind::Float)
                    .to_device(HOST)
                    .reshape([-1]);
            }
        } else if let Some(acc) = &mut unit.grad {
            *acc += contribution;
        }
        Ok(())
    }

    /// Zeroed gradient buffers for the step, held from its start as DDP's buckets and ZeRO's
    /// gradient partitions are: full for dp and zero1, this rank's padded shard otherwise.
    fn allocate_grads(&mut self) {
        for unit in &mut self.units {
            if !unit.offload.is_none() && unit.class.streams_grads() {
                continue;
            }
            let shape = match unit.class {
                Holding::Replicated | Holding::Zero1 => unit.shape.clone(),
                Holding::Zero2 | Holding::Zero3 | Holding::Hybrid => vec![unit.shard_len],
            };
            let g = Tensor::zeros(shape.as_slice(), (self.kind, self.device));
            self.ledger.add(Category::Grads, nbytes(&g));
            unit.grad = Some(g);
        }
    }

    fn input(&self, i: usize, k: usize) -> Tensor {
        let j = self.flow.inputs[i][k];
        match &self.outs[j] {
            Some(h) => h.t.shallow_clone(),
            None => panic!(
                "op {}'s input {} is not held",
                self.model.ops[i].id, self.model.ops[j].id
            ),
        }
    }

    fn hold(&mut self, i: usize, t: Tensor, cat: Category) {
        self.ledger.add(cat, nbytes(&t));
        self.outs[i] = Some(Held { t, cat });
    }

    fn drop_out(&mut self, i: usize) {
        if let Some(h) = self.outs[i].take() {
            self.ledger.sub(h.cat, nbytes(&h.t));
        }
    }

    fn set_extras(&mut self, i: usize, extras: Vec<Tensor>) {
        for t in &extras {
            self.ledger.add(Category::Activations, nbytes(t));
        }
        self.extras[i] = extras;
    }

    fn drop_extras(&mut self, i: usize) {
        for t in std::mem::take(&mut self.extras[i]) {
            self.ledger.sub(Category::Activations, nbytes(&t));
        }
    }

    /// An attention op's queries, keys and values, from a fused input or three.
    fn qkv(&self, i: usize) -> (Tensor, Tensor, Tensor) {
        let ins: Vec<Tensor> = (0..self.flow.inputs[i].len())
            .map(|k| self.input(i, k))
            .collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        ops::split_qkv(&refs, &self.attn)
    }

    fn labels(&self) -> Result<Tensor> {
        self.labels
            .as_ref()
            .map(Tensor::shallow_clone)
            .ok_or_else(|| ExecError::Unsupported("no labels for the loss".into()))
    }

    fn ids(&self) -> Tensor {
        self.ids
            .as_ref()
            .map(Tensor::shallow_clone)
            .unwrap_or_else(|| Tensor::zeros([1, 1], (Kind::Int64, self.device)))
    }

    fn positions(&self) -> Tensor {
        let ids = self.ids();
        let (b, s) = (ids.size()[0], ids.size()[1]);
        (Tensor::arange(s, (Kind::Int64, self.device)) + self.position_offset)
            .unsqueeze(0)
            .expand([b, s], false)
    }

    /// Whether an embedding op reads token ids (else segment ids, all zero).
    fn token_ids_for(&self, i: usize) -> Tensor {
        let rows = self.model.ops[i].params[0].shape[0] as u64;
        if rows == self.model.config.vocab_size {
            self.ids()
        } else {
            self.ids().zeros_like()
        }
    }

    /// Run op `i` forward; keep what its backward needs beside the output when `keep_extras`.
    fn forward_op(&mut self, i: usize, keep_extras: bool) -> Result<Tensor> {
        let kind = self.model.ops[i].kind;
        let out = match kind {
            OpKind::Embedding | OpKind::PositionalEmbedding => {
                let u = self.uses[i][0][0];
                let w = self.weight(u)?;
                let ids = if kind == OpKind::Embedding {
                    self.token_ids_for(i)
                } else {
                    self.positions()
                };
                let y = ops::embedding_fwd(&w, &ids);
                self.release(u, w);
                y
            }
            OpKind::Add => {
                let mut y = self.input(i, 0).copy();
                for k in 1..self.flow.inputs[i].len() {
                    y += self.input(i, k);
                }
                y
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let x = self.input(i, 0);
                let uw = self.uses[i][0][0];
                let ub = self.uses[i].get(1).map(|v| v[0]);
                let w = self.weight(uw)?;
                let b = match ub {
                    Some(ub) => Some(self.weight(ub)?),
                    None => None,
                };
                let (y, stats) = if kind == OpKind::LayerNorm {
                    let (y, mean, rstd) = ops::layer_norm_fwd(&x, &w, b.as_ref(), self.norm_eps);
                    (y, vec![mean, rstd])
                } else {
                    let (y, rstd) = ops::rms_norm_fwd(&x, &w, self.norm_eps);
                    (y, vec![rstd])
                };
                self.release(uw, w);
                if let (Some(ub), Some(b)) = (ub, b) {
                    self.release(ub, b);
                }
                if keep_extras {
                    self.set_extras(i, stats);
                }
                y
            }
            OpKind::Linear => {
                let x = self.input(i, 0);
                let slices = self.uses[i][0].clone();
                let mut y: Option<Tensor> = None;
                for u in slices {
                    let w = self.weight(u)?;
                    let xs = match self.units[u].cols {
                        Some((start, len)) => x.narrow(-1, start, len),
                        None => x.shallow_clone(),
                    };
                    let part = ops::linear_fwd(&xs, &w);
                    self.release(u, w);
                    y = Some(match y {
                        Some(acc) => acc + part,
                        None => part,
                    });
                }
                let mut y =
                    y.ok_or_else(|| ExecError::Unsupported("a linear without weight".into()))?;
                if let Some(bias) = self.uses[i].get(1).map(|v| v[0]) {
                    let b = self.weight(bias)?;
                    y += &b;
                    self.release(bias, b);
                }
                y
            }
            OpKind::Attention => {
                let (q, k, v) = self.qkv(i);
                let (out, saved) = ops::attention_fwd(&q, &k, &v, &self.attn, self.rope.as_ref());
                if keep_extras {
                    self.set_extras(i, saved);
                }
                out
            }
            OpKind::Activation => {
                if self.flow.inputs[i].len() == 2 {
                    ops::gated_fwd(self.act, &self.input(i, 0), &self.input(i, 1))
                } else {
                    ops::act_fwd(self.act, &self.input(i, 0))
                }
            }
            OpKind::CrossEntropy => {
                let logits = self.input(i, 0);
                let labels = self.labels()?;
                let (loss, logp) = ops::cross_entropy_fwd(&logits, &labels);
                if keep_extras {
                    self.set_extras(i, vec![logp]);
                }
                loss
            }
        };
        Ok(out)
    }

    /// Run ops `range` forward. `full_pass`: the step's forward (keep what `keep_fwd` says);
    /// otherwise the recomputation of one block (keep what its backward needs).
    fn forward_range(
        &mut self,
        range: std::ops::Range<usize>,
        full_pass: bool,
    ) -> Result<Option<Tensor>> {
        let mut remaining: Vec<usize> = self
            .flow
            .consumers
            .iter()
            .map(|c| c.iter().filter(|&&k| range.contains(&k)).count())
            .collect();
        let mut loss = None;
        for i in range.clone() {
            if !full_pass && self.outs[i].is_some() {
                // Already held (kept as the next block's restart point): no need to redo it.
                continue;
            }
            let keep_extras = !full_pass || self.flow.recomputed_block[i].is_none();
            let t0 = self.profile.is_some().then(|| self.clock());
            let c0 = self.collectives_so_far();
            let y = self.forward_op(i, keep_extras)?;
            let dt = t0.map(|t0| self.since(t0));
            if let (Some(p), Some(dt)) = (self.profile.as_mut(), dt) {
                if full_pass {
                    p.fwd_s[i] += dt;
                    p.fwd_coll_s[i] += p.collective_s_since(c0);
                } else {
                    p.recompute_s += dt;
                }
            }
            if self.model.ops[i].kind == OpKind::CrossEntropy {
                loss = Some(y.shallow_clone());
            }
            let kept = if full_pass {
                self.flow.keep_fwd[i]
            } else {
                self.flow.need_bwd[i]
            };
            if kept || remaining[i] > 0 || !full_pass {
                self.hold(
                    i,
                    y,
                    if kept {
                        Category::Activations
                    } else {
                        Category::Working
                    },
                );
            }
            for k in 0..self.flow.inputs[i].len() {
                let j = self.flow.inputs[i][k];
                remaining[j] = remaining[j].saturating_sub(1);
                let keep_j = if full_pass {
                    self.flow.keep_fwd[j]
                } else {
                    self.flow.need_bwd[j] || !range.contains(&j)
                };
                if remaining[j] == 0 && !keep_j {
                    self.drop_out(j);
                }
            }
        }
        Ok(loss)
    }

    fn add_act_grad(&mut self, j: usize, g: Tensor) {
        match &mut self.grads[j] {
            Some(acc) => *acc += g,
            None => {
                self.ledger.add(Category::Working, nbytes(&g));
                self.grads[j] = Some(g);
            }
        }
    }

    fn backward_op(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let kind = self.model.ops[i].kind;
        match kind {
            OpKind::CrossEntropy => {
                let labels = self.labels()?;
                let scale = g.double_value(&[]);
                let logp = std::mem::take(&mut self.extras[i])
                    .pop()
                    .ok_or_else(|| ExecError::Unsupported("the loss kept nothing".into()))?;
                let (kept, in_place) = (nbytes(&logp), logp.kind() == self.kind);
                let d = ops::cross_entropy_bwd(scale, logp, &labels, self.kind);
                // The gradient is the log-probabilities' buffer itself when the compute dtype
                // is theirs (fp32); otherwise a copy in the compute dtype that exists beside
                // them until they are freed here.
                if in_place {
                    self.ledger.sub(Category::Activations, kept);
                    self.add_act_grad(self.flow.inputs[i][0], d);
                } else {
                    self.add_act_grad(self.flow.inputs[i][0], d);
                    self.ledger.sub(Category::Activations, kept);
                }
            }
            OpKind::Embedding | OpKind::PositionalEmbedding => {
                let u = self.uses[i][0][0];
                let rows = self.units[u].shape[0];
                let ids = if kind == OpKind::Embedding {
                    self.token_ids_for(i)
                } else {
                    self.positions()
                };
                let dw = ops::embedding_bwd(g, &ids, rows);
                self.add_param_grad(u, dw)?;
            }
            OpKind::Add => {
                for k in 0..self.flow.inputs[i].len() {
                    self.add_act_grad(self.flow.inputs[i][k], g.shallow_clone());
                }
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let x = self.input(i, 0);
                let uw = self.uses[i][0][0];
                let w = self.weight(uw)?;
                if kind == OpKind::LayerNorm {
                    let (dx, dw, db) = ops::layer_norm_bwd(
                        g,
                        &x,
                        &self.extras[i][0],
                        &self.extras[i][1],
                        &w,
                        self.norm_eps,
                    );
                    self.release(uw, w);
                    self.add_param_grad(uw, dw)?;
                    if let Some(ub) = self.uses[i].get(1).map(|v| v[0]) {
                        self.add_param_grad(ub, db)?;
                    }
                    self.add_act_grad(self.flow.inputs[i][0], dx);
                } else {
                    let (dx, dw) = ops::rms_norm_bwd(g, &x, &self.extras[i][0], &w, self.norm_eps);
                    self.release(uw, w);
                    self.add_param_grad(uw, dw)?;
                    self.add_act_grad(self.flow.inputs[i][0], dx);
                }
            }
            OpKind::Linear => {
                let x = self.input(i, 0);
                let slices = self.uses[i][0].clone();
                let mut dxs = Vec::with_capacity(slices.len());
                for u in slices {
                    let w = self.weight(u)?;
                    let xs = match self.units[u].cols {
                        Some((start, len)) => x.narrow(-1, start, len),
                        None => x.shallow_clone(),
                    };
                    let (dx, dw) = ops::linear_bwd(g, &xs, &w);
                    self.release(u, w);
                    self.add_param_grad(u, dw)?;
                    dxs.push(dx);
                }
                if let Some(ub) = self.uses[i].get(1).map(|v| v[0]) {
                    self.add_param_grad(ub, ops::bias_grad(g))?;
                }
                let dx = if dxs.len() == 1 {
                    dxs.pop().unwrap_or_else(|| g.zeros_like())
                } else {
                    Tensor::cat(&dxs, -1)
                };
                self.add_act_grad(self.flow.inputs[i][0], dx);
            }
            OpKind::Attention => {
                let (q, k, v) = self.qkv(i);
                let out = self.outs[i]
                    .as_ref()
                    .map(|h| h.t.shallow_clone())
                    .ok_or_else(|| ExecError::Unsupported("attention output not kept".into()))?;
                let (dq, dk, dv) = ops::attention_bwd(
                    g,
                    &q,
                    &k,
                    &v,
                    &out,
                    &self.extras[i],
                    &self.attn,
                    self.rope.as_ref(),
                );
                if self.flow.inputs[i].len() == 1 {
                    self.add_act_grad(self.flow.inputs[i][0], Tensor::cat(&[dq, dk, dv], -1));
                } else {
                    let ins = self.flow.inputs[i].clone();
                    self.add_act_grad(ins[0], dq);
                    self.add_act_grad(ins[1], dk);
                    self.add_act_grad(ins[2], dv);
                }
            }
            OpKind::Activation => {
                if self.flow.inputs[i].len() == 2 {
                    let (dg, du) =
                        ops::gated_bwd(self.act, g, &self.input(i, 0), &self.input(i, 1));
                    let ins = self.flow.inputs[i].clone();
                    self.add_act_grad(ins[0], dg);
                    self.add_act_grad(ins[1], du);
                } else {
                    let kept = if self.act == Activation::Relu {
                        self.outs[i]
                            .as_ref()
                            .map(|h| h.t.shallow_clone())
                            .ok_or_else(|| ExecError::Unsupported("ReLU output not kept".into()))?
                    } else {
                        self.input(i, 0)
                    };
                    let dx = ops::act_bwd(self.act, g, &kept);
                    self.add_act_grad(self.flow.inputs[i][0], dx);
                }
            }
        }
        Ok(())
    }

    /// One training step on this rank's share of the global batch: forward, backward,
    /// gradient synchronisation, clipping and the AdamW update.
    /// One optimizer step over `batch` (this rank's rows): the rows run as micro-batches of
    /// the plan's size, gradients accumulated as the strategies do (dp and zero1 keep full
    /// gradients and sync them once; zero2 and zero3 reduce-scatter every micro-batch; zero3
    /// gathers for every micro-batch), then one AdamW update.
    pub fn train_step(&mut self, batch: &Batch) -> Result<StepOutcome> {
        // A step smaller than one planned micro-batch runs as one (it holds less than planned).
        let micro = self.micro_batch.min(batch.rows.max(1));
        if batch.rows % micro != 0 {
            return Err(ExecError::Unsupported(format!(
                "{} samples per rank is not a whole number of micro-batches of {micro}",
                batch.rows
            )));
        }
        let accumulation = batch.rows / micro;
        let shape = [batch.rows as i64, batch.seq as i64];
        let ids = Tensor::from_slice(&batch.inputs)
            .reshape(shape)
            .to_device(self.device);
        let labels = Tensor::from_slice(&batch.labels)
            .reshape(shape)
            .to_device(self.device);
        let n = self.model.ops.len();
        let step_t0 = self.clock();
        if let Some(p) = self.profile.as_mut() {
            *p = Profile {
                fwd_s: vec![0.0; n],
                bwd_s: vec![0.0; n],
                fwd_coll_s: vec![0.0; n],
                bwd_coll_s: vec![0.0; n],
                ..Profile::default()
            };
        }
        self.ledger.reset_peak();
        let t0 = self.clock();
        self.allocate_grads();
        let alloc_s = self.since(t0);
        // Each micro-batch's loss is its tokens' mean: scaled by 1/(ranks × micro-batches),
        // the accumulated gradients are those of the mean over the whole global batch.
        let scale = 1.0 / (self.comm.world() * accumulation) as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Double, self.device));
        for k in 0..accumulation {
            let rows = (k * micro) as i64;
            self.ids = Some(ids.narrow(0, rows, micro as i64));
            self.labels = Some(labels.narrow(0, rows, micro as i64));
            let loss = self.forward_backward(scale)?;
            loss_sum += loss.to_kind(Kind::Double);
        }
        self.ids = None;
        self.labels = None;
        // Read once: a read per micro-batch would wait for the device each time.
        let local_loss = loss_sum.double_value(&[]) / accumulation as f64;

        let grad_norm = self.optimizer_step()?;
        let world = self.comm.world() as f64;
        let loss = self
            .comm
            .all_reduce(&Tensor::from(local_loss))?
            .double_value(&[])
            / world;
        let step_s = self.since(step_t0);
        if let Some(p) = self.profile.as_mut() {
            p.optimizer_s += alloc_s;
            p.step_s = step_s;
        }
        Ok(StepOutcome { loss, grad_norm })
    }

    /// Forward and backward of the micro-batch in `ids`/`labels`, adding its gradients (of
    /// `loss_scale` × its mean loss) to the step's; returns its mean loss.
    fn forward_backward(&mut self, loss_scale: f64) -> Result<Tensor> {
        let n = self.model.ops.len();
        let loss = self
            .forward_range(0..n, true)?
            .ok_or_else(|| ExecError::Unsupported("the graph has no loss op".into()))?;
        self.trace_forward_memory();
        for i in (0..n).rev() {
            if let Some(b) = self.flow.recomputed_block[i] {
                if self.flow.blocks.ops[b].last() == Some(&i) {
                    let first = self.flow.blocks.ops[b][0];
                    self.forward_range(first..i + 1, false)?;
                }
            }
            let g = if self.model.ops[i].kind == OpKind::CrossEntropy {
                Some(Tensor::from(loss_scale))
            } else {
                self.grads[i].take()
            };
            if let Some(g) = g {
                if self.model.ops[i].kind != OpKind::CrossEntropy {
                    self.ledger.sub(Category::Working, nbytes(&g));
                }
                let t0 = self.clock();
                let c0 = self.collectives_so_far();
                self.backward_op(i, &g)?;
                let dt = self.since(t0);
                if let Some(p) = self.profile.as_mut() {
                    p.bwd_s[i] += dt;
                    p.bwd_coll_s[i] += p.collective_s_since(c0);
                }
            }
            self.drop_extras(i);
            self.drop_out(i);
        }
        Ok(loss)
    }

    fn optimizer_step(&mut self) -> Result<f64> {
        let world = self.comm.world() as i64;
        let rank = self.comm.rank();
        let t_sync = self.clock();
        // 1. Synchronise: dp all-reduces, zero1 reduce-scatters; zero2/3 already hold shards;
        // hsdp's node shards are summed across the nodes.
        let mut shards: Vec<Option<Tensor>> = Vec::with_capacity(self.units.len());
        let mut held_bytes = 0;
        for u in 0..self.units.len() {
            let class = self.units[u].class;
            let offloaded = !self.units[u].offload.is_none();
            let Some(grad) = self.units[u].grad.take() else {
                // An offloaded unit whose shards streamed to the host: summed there (hsdp's
                // node shards still across the nodes).
                let streamed = match (offloaded, &self.units[u].host_grad) {
                    (true, Some(h)) => Some(match (class, self.comm.nodes()) {
                        (Holding::Hybrid, Some(n)) => n.replica.all_reduce(h)?,
                        _ => h.shallow_clone(),
                    }),
                    _ => None,
                };
                shards.push(streamed);
                continue;
            };
            let held = nbytes(&grad);
            let synced = match class {
                Holding::Replicated => self.comm.all_reduce(&grad)?,
                Holding::Zero1 => {
                    let padded = pad_flat(&grad, self.units[u].shard_len * world);
                    self.comm.reduce_scatter(&padded)?
                }
                Holding::Zero2 | Holding::Zero3 => grad,
                Holding::Hybrid => match self.comm.nodes() {
                    Some(n) => n.replica.all_reduce(&grad)?,
                    None => grad,
                },
            };
            self.ledger.sub(Category::Grads, held);
            if offloaded {
                // dp / zero1 offloaded: the synchronised gradient moves to the host buffer.
                if let Some(h) = &mut self.units[u].host_grad {
                    h.copy_(&synced.to_kind(Kind::Float).to_device(HOST).reshape([-1]));
                    shards.push(Some(h.shallow_clone()));
                    continue;
                }
            }
            held_bytes += nbytes(&synced);
            self.ledger.add(Category::Grads, nbytes(&synced));
            shards.push(Some(synced));
        }
        let mut sync_s = self.since(t_sync);
        let t_update = self.clock();
        // 2. Global norm: replicated gradients counted once (by rank 0), shards by their owner
        // (hsdp's by their owner in the first node).
        // Summed on the device and read once: a read per tensor would wait for the device
        // hundreds of times a step.
        let mut local_sq = Tensor::zeros([], (Kind::Double, self.device));
        let first_node = self.first_node();
        for (u, g) in shards.iter().enumerate() {
            if let Some(g) = g {
                let counted = match self.units[u].class {
                    Holding::Replicated => rank == 0,
                    Holding::Hybrid => first_node,
                    _ => true,
                };
                if counted {
                    local_sq += g.square().sum(Kind::Double).to_device(self.device);
                }
            }
        }
        let total_sq = self.comm.all_reduce(&local_sq)?.double_value(&[]);
        let norm = total_sq.sqrt();
        let o = self.optim;
        let clip = if o.clip_norm > 0.0 && norm > o.clip_norm {
            o.clip_norm / (norm + 1e-6)
        } else {
            1.0
        };
        // 3. AdamW on what this rank owns.
        self.step += 1;
        let t = self.step as f64;
        let lr = o.lr_at(self.step);
        let bc1 = 1.0 - o.beta1.powf(t);
        let bc2 = 1.0 - o.beta2.powf(t);
        for (u, g) in shards.into_iter().enumerate() {
            let Some(g) = g else { continue };
            let unit = &mut self.units[u];
            let (start, len) = unit.region;
            let g = g.to_kind(Kind::Float);
            let (mut p, g, mut m, mut v) = match unit.class {
                Holding::Replicated | Holding::Zero3 | Holding::Hybrid => (
                    unit.master.as_ref().unwrap_or(&unit.data).reshape([-1]),
                    g.reshape([-1]),
                    unit.m.reshape([-1]),
                    unit.v.reshape([-1]),
                ),
                Holding::Zero1 | Holding::Zero2 => (
                    match &unit.master {
                        Some(master) => master.narrow(0, 0, len),
                        None => unit.data.reshape([-1]).narrow(0, start, len),
                    },
                    g.narrow(0, 0, len),
                    unit.m.narrow(0, 0, len),
                    unit.v.narrow(0, 0, len),
                ),
            };
            let decay = if unit.decay { o.weight_decay } else { 0.0 };
            adamw_update(&mut p, &g, &mut m, &mut v, &o, lr, decay, clip, (bc1, bc2));
            // The compute copy follows the master (zero1/zero2 after the gather below).
            if let (Some(master), Holding::Replicated | Holding::Zero3 | Holding::Hybrid) =
                (&unit.master, unit.class)
            {
                unit.data.reshape([-1]).copy_(&master.reshape([-1]));
            }
            if let Some(h) = &mut unit.host_grad {
                let _ = h.zero_();
            }
        }
        let update_s = self.since(t_update);
        let t_gather = self.clock();
        self.ledger.sub(Category::Grads, held_bytes);
        // 4. zero1/zero2 replicas get the updated parameters back.
        for u in 0..self.units.len() {
            let unit = &self.units[u];
            if !matches!(unit.class, Holding::Zero1 | Holding::Zero2) {
                continue;
            }
            let (start, len) = unit.region;
            let share = match &unit.master {
                Some(master) => master.to_kind(self.kind).to_device(self.device),
                None => {
                    let share = Tensor::zeros([unit.shard_len], (self.kind, self.device));
                    if len > 0 {
                        share
                            .narrow(0, 0, len)
                            .copy_(&unit.data.reshape([-1]).narrow(0, start, len));
                    }
                    share
                }
            };
            let full = self.comm.all_gather(&share)?;
            let bytes = nbytes(&full);
            self.ledger.add(Category::GradBuffers, bytes);
            let unit = &mut self.units[u];
            let mut flat = unit.data.reshape([-1]);
            flat.copy_(&full.narrow(0, 0, unit.numel));
            self.ledger.sub(Category::GradBuffers, bytes);
        }
        sync_s += self.since(t_gather);
        if let Some(p) = self.profile.as_mut() {
            p.optimizer_s += update_s;
            p.sync_s += sync_s;
        }
        Ok(norm)
    }

    /// This rank's part of a checkpoint: `(key, tensor)` pairs whose keys say which region of
    /// which parameter they hold (see `checkpoint`).
    pub fn checkpoint_tensors(&self) -> Vec<(String, Tensor)> {
        let rank = self.comm.rank();
        let first_node = self.first_node();
        let mut out = Vec::new();
        for unit in &self.units {
            // The fp32 values this rank updates: the master in mixed precision. Replicated
            // units are written by rank 0, hsdp's shards by the first node.
            let (flat_start, len, data, m, v) = match (unit.class, &unit.master) {
                (Holding::Replicated, _) if rank != 0 => continue,
                (Holding::Hybrid, _) if !first_node => continue,
                (Holding::Replicated, master) => (
                    0,
                    unit.numel,
                    master.as_ref().unwrap_or(&unit.data).reshape([-1]),
                    unit.m.reshape([-1]),
                    unit.v.reshape([-1]),
                ),
                (Holding::Zero1 | Holding::Zero2, None) => {
                    let (s, l) = unit.region;
                    (
                        s,
                        l,
                        unit.data.reshape([-1]).narrow(0, s, l),
                        unit.m.narrow(0, 0, l),
                        unit.v.narrow(0, 0, l),
                    )
                }
                (_, master) => {
                    let (s, l) = unit.region;
                    (
                        s,
                        l,
                        master.as_ref().unwrap_or(&unit.data).narrow(0, 0, l),
                        unit.m.narrow(0, 0, l),
                        unit.v.narrow(0, 0, l),
                    )
                }
            };
            if len == 0 {
                continue;
            }
            for (saved, t) in Saved::ALL.into_iter().zip([data, m, v]) {
                let key = RegionKey {
                    param: unit.key.clone(),
                    saved,
                    cols: unit.cols,
                    flat: (flat_start, len),
                };
                out.push((key.to_string(), t.to_device(Device::Cpu).contiguous()));
            }
        }
        out
    }

    /// The full value of every parameter by `op.param` (gathered and reassembled from column
    /// slices; for tests and equivalence checks). Every rank must call it.
    pub fn full_params(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Vec<Tensor>)> = Vec::new();
        for u in 0..self.units.len() {
            let w = self.weight(u)?;
            let copy = w.to_device(Device::Cpu).to_kind(Kind::Float).copy();
            self.release(u, w);
            let key = &self.units[u].key;
            match out.last_mut() {
                Some((k, parts)) if k == key => parts.push(copy),
                _ => out.push((key.clone(), vec![copy])),
            }
        }
        Ok(out
            .into_iter()
            .map(|(k, parts)| {
                let full = if parts.len() == 1 {
                    parts
                        .into_iter()
                        .next()
                        .unwrap_or_else(|| Tensor::zeros([0], (Kind::Float, Device::Cpu)))
                } else {
                    Tensor::cat(&parts, 1)
                };
                (k, full)
            })
            .collect())
    }
}

/// One AdamW update of `p` from gradient `g` (scaled by `clip`), in place on `p`, `m`, `v`;
/// `decay` is the weight decay for this tensor (0 for biases and norms), `bias_correction` the
/// two moments' `1 − βᵗ`. The optimizer's one code path: `calibrate` times this function.
///
/// In place with one scratch tensor (two when clipping): an update of a large tensor written
/// as tensor arithmetic allocated ten of them, and past glibc's mmap threshold (32 MiB) every
/// one was fresh pages from the kernel — five times slower on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    o: &OptimConfig,
    lr: f64,
    decay: f64,
    clip: f64,
    bias_correction: (f64, f64),
) {
    let clipped = (clip != 1.0).then(|| g * clip);
    let g = clipped.as_ref().unwrap_or(g);
    if decay > 0.0 {
        let _ = p.g_mul_scalar_(1.0 - lr * decay);
    }
    // m ← β₁·m + (1 − β₁)·g; v ← β₂·v + (1 − β₂)·g².
    let _ = m.lerp_(g, 1.0 - o.beta1);
    if lr == 0.0 {
        let _ = v.g_mul_scalar_(o.beta2);
        let _ = v.addcmul_(g, &(g * (1.0 - o.beta2)));
        return;
    }
    let mut scratch = g.square();
    let _ = v.lerp_(&scratch, 1.0 - o.beta2);
    // p ← p − lr · (m / bc₁) / (√(v / bc₂) + ε), the step's sign and scale folded into the
    // divisor so that one fused `addcdiv_` applies it.
    let _ = v.sqrt_out(&scratch);
    let _ = scratch.g_div_scalar_(bias_correction.1.sqrt());
    let _ = scratch.g_add_scalar_(o.eps);
    let _ = scratch.g_mul_scalar_(-bias_correction.0 / lr);
    let _ = p.addcdiv_(m, &scratch);
}

/// The ops whose outputs op `i` reads in its backward: the rule the model description's
/// saved-bytes figures are written by ([`osdp_core::model::saved::backward_reads`]).
fn bwd_reads(kind: OpKind, i: usize, inputs: &[usize], config: &ModelConfig) -> Vec<usize> {
    let reads = osdp_core::model::saved::backward_reads(kind, inputs.len(), config);
    let output = reads.output.then_some(i);
    inputs[..reads.inputs]
        .iter()
        .copied()
        .chain(output)
        .collect()
}

fn pad_flat(t: &Tensor, len: i64) -> Tensor {
    let flat = t.reshape([-1]);
    let n = flat.size()[0];
    if n == len {
        return flat;
    }
    Tensor::cat(&[flat, Tensor::zeros([len - n], (t.kind(), t.device()))], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place update is AdamW as written in the paper (Loshchilov & Hutter), to fp32
    /// rounding: with and without clipping and decay, over a few steps.
    #[test]
    fn adamw_in_place_matches_the_formula() {
        let o = OptimConfig::default();
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(7);
        for (clip, decay) in [(1.0, 0.0), (0.5, 0.1)] {
            let mut p = Tensor::randn([1000], opts);
            let (mut m, mut v) = (Tensor::zeros([1000], opts), Tensor::zeros([1000], opts));
            let (mut p2, mut m2, mut v2) = (p.copy(), m.copy(), v.copy());
            for step in 1..=3 {
                let g = Tensor::randn([1000], opts);
                let t = f64::from(step);
                let bc = (1.0 - o.beta1.powf(t), 1.0 - o.beta2.powf(t));
                let lr = 1e-3;
                adamw_update(&mut p, &g, &mut m, &mut v, &o, lr, decay, clip, bc);
                let g = &g * clip;
                p2 *= 1.0 - lr * decay;
                m2 = &m2 * o.beta1 + &g * (1.0 - o.beta1);
                v2 = &v2 * o.beta2 + g.square() * (1.0 - o.beta2);
                p2 -= (&m2 / bc.0) / ((&v2 / bc.1).sqrt() + o.eps) * lr;
            }
            for (a, b) in [(&p, &p2), (&m, &m2), (&v, &v2)] {
                let err = (a - b).abs().max().double_value(&[]);
                let scale = b.abs().max().double_value(&[]);
                assert!(err <= 1e-6 * scale, "{err} of {scale}");
            }
        }
    }
}
