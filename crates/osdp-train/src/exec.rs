//! The executor: runs a model.json graph forward and backward op by op under a plan, holding
//! exactly the tensors the plan says. A `zero3` weight is gathered for its op and dropped, then
//! gathered again in backward; a split linear gathers one column slice at a time; a recomputed
//! block keeps only its inputs and re-runs its forward when backward reaches it, gathering its
//! weights again (all but its last op with parameters, whose weight it keeps for that op's
//! backward, which comes next: `cost::ends_block_params`, priced the same way). Every byte it
//! holds goes through the [`Ledger`], which is the "measured" side of predicted vs measured.
//!
//! This file holds the executor's types and its construction; the work is split by concern:
//! - `graph`: what the executor can run, and the dataflow it walks;
//! - `units`: this rank's parameter units, built from a plan and initial values;
//! - `shards`: a unit's weight gathered for compute, its gradients reduce-scattered;
//! - `forward` and `backward`: the ops, and the activations they hold;
//! - `step`: one training step, micro-batch by micro-batch;
//! - `optimizer`: gradient synchronisation, the global norm and AdamW;
//! - `profile`: the profiler's clock and what it records, and the memory trace;
//! - `state`: the parameters read back out (checkpoints, full values).

mod backward;
mod forward;
mod graph;
mod optimizer;
mod profile;
mod shards;
mod state;
mod step;
mod units;

pub use graph::check_runnable;
pub use optimizer::adamw_update;
pub use profile::{ForwardMemory, Profile};
pub use units::{FullState, Init};

use tch::{Device, Kind, Tensor};

use super::collective::{Aborted, Collective};
use super::memory::{Category, Ledger};
use super::ops::{self, AttentionShape};
use graph::Dataflow;
use osdp_core::cost;
use osdp_core::model::{Activation, ModelSpec, Positional};
use osdp_core::plan::Plan;
use units::{build_units, resolve_ties, Unit, Units};

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

    /// The linears of `model` whose weights this target multiplies with zero rows added
    /// ([`crate::ops::gemm_rows`]): `(op id, rows, padded rows)`, in the model's order.
    pub fn linears_to_pad(&self, model: &osdp_core::model::ModelSpec) -> Vec<(String, i64, i64)> {
        if !crate::ops::pads_on(self.device, self.numerics.compute_kind()) {
            return Vec::new();
        }
        model
            .ops
            .iter()
            .filter(|op| op.kind == osdp_core::model::OpKind::Linear)
            .filter_map(|op| {
                let w = op.params.first()?;
                let rows = osdp_core::cost::padded_weight_rows(&w.shape)?;
                Some((op.id.clone(), w.shape[0], rows))
            })
            .collect()
    }
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
    /// Units a recomputation gathered and kept for the backward that follows it
    /// (`Dataflow::keeps_gathered`), by unit.
    kept: std::collections::HashMap<usize, Tensor>,
    /// While a block is recomputed: its ops flagged in `Dataflow::keeps_gathered` keep the
    /// weights they gather.
    keeping: bool,
    /// The linears whose GEMMs ran with zero rows added ([`ops::gemm_rows`]), by op: what
    /// the kernels did, not what the model says they should.
    padded: std::collections::BTreeMap<usize, osdp_core::protocol::PaddedLinear>,
}

/// What one training step measured on one rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Mean token loss over the global batch.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
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
            Init::Fresh { .. } | Init::Pretrained { .. } => 0,
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
            kept: Default::default(),
            keeping: false,
            padded: Default::default(),
        })
    }

    /// Record that op `i`'s GEMMs on weight `w` ran padded to `rows` (forward or backward).
    fn note_padded(&mut self, i: usize, w: &Tensor, rows: Option<i64>, forward: bool) {
        let Some(padded_rows) = rows else {
            return;
        };
        let e = self
            .padded
            .entry(i)
            .or_insert_with(|| osdp_core::protocol::PaddedLinear {
                op: self.model.ops[i].id.clone(),
                rows: w.size()[0],
                padded_rows,
                forward: false,
                backward: false,
            });
        if forward {
            e.forward = true;
        } else {
            e.backward = true;
        }
    }

    /// The linears whose GEMMs have run padded so far, in the model's order.
    pub fn padded_linears(&self) -> Vec<osdp_core::protocol::PaddedLinear> {
        self.padded.values().cloned().collect()
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// Samples per forward/backward on this rank (the plan's micro-batch).
    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    pub fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }
}

fn pad_flat(t: &Tensor, len: i64) -> Tensor {
    let flat = t.reshape([-1]);
    let n = flat.size()[0];
    if n == len {
        return flat;
    }
    Tensor::cat(&[flat, Tensor::zeros([len - n], (t.kind(), t.device()))], 0)
}
