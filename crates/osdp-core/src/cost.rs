//! The cost model: memory and time of one operator under one sharding strategy, at micro-batch
//! `b` on a layout of `N` ranks. Pure arithmetic: no GPU, no I/O.
//!
//! Accounting (DESIGN §4): on GPUs mixed precision — bf16 parameters and gradients (2 + 2
//! bytes), fp32 master weights and Adam moments (12 bytes), the ZeRO paper's 16 bytes per
//! parameter; on CPUs, where the trainer runs in fp32, parameters and gradients take 4 + 4 and
//! Adam's moments 8 (no separate master copy): the same 16 bytes, split differently, and
//! activations twice the bf16 size. [`Precision`] holds the split.
//! Collectives follow the ring α–β model; communication overlaps the op's own compute on a
//! separate stream and only the excess is exposed.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::cluster::{Calibration, DeviceKind, Layout};
use crate::model::{saved, AttentionImpl, ModelConfig, ModelSpec, OpKind, OpSpec};

/// Parameter + gradient + optimizer bytes per parameter, in either precision: what the model
/// reader bounds sizes by and what an unsharded parameter costs.
pub const STATE_BYTES_PER_PARAM: u64 = Precision::FP32.state_bytes_per_param();
const _: () = assert!(Precision::MIXED_BF16.state_bytes_per_param() == STATE_BYTES_PER_PARAM);

/// How training stores numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    pub name: &'static str,
    /// The compute copy of a parameter.
    pub param_bytes: u64,
    pub grad_bytes: u64,
    /// fp32 master copy (mixed precision only) and Adam's two moments.
    pub optimizer_bytes: u64,
    /// One activation element.
    pub activation_bytes: u64,
}

impl Precision {
    /// bf16 compute, fp32 master weights and moments (GPUs).
    pub const MIXED_BF16: Precision = Precision {
        name: "bf16 mixed",
        param_bytes: 2,
        grad_bytes: 2,
        optimizer_bytes: 12,
        activation_bytes: 2,
    };
    /// Everything in fp32 (the trainer's default on CPUs).
    pub const FP32: Precision = Precision {
        name: "fp32",
        param_bytes: 4,
        grad_bytes: 4,
        optimizer_bytes: 8,
        activation_bytes: 4,
    };

    /// Compute copy, gradient and optimizer state of one parameter.
    pub const fn state_bytes_per_param(&self) -> u64 {
        self.param_bytes + self.grad_bytes + self.optimizer_bytes
    }
}
/// AdamW step traffic per updated parameter: read master, m, v (fp32) and the bf16 grad; write
/// master, m, v and the bf16 copy.
pub const OPTIMIZER_BYTES_PER_PARAM: u64 = 28;

/// Host bytes per parameter an offloaded optimizer keeps for every parameter it updates: an
/// fp32 master copy, Adam's two fp32 moments and the fp32 gradient the device's is copied into
/// (ZeRO-Offload's accounting; on the fp32 CPU trainer the master copy is the host's own
/// copy of the weights).
pub const HOST_STATE_BYTES_PER_PARAM: u64 = 16;

/// Fraction of the dense peak a large matmul reaches where neither the layout nor the GPU's
/// generation says (the CPU layout, unknown GPUs).
pub const MATMUL_EFFICIENCY: f64 = 0.7;
/// Fraction of memory bandwidth element-wise kernels reach, likewise.
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// A ring collective's fixed latency on GPUs besides its per-step ones: NCCL's tuning model
/// (src/graph/tuning.cc) gives 8.4 µs for the Simple protocol large collectives use.
pub const NCCL_BASE_LATENCY_S: f64 = 8.4e-6;
/// Memory traffic per parameter of every micro-batch outside the kernels the graph lists, on
/// GPUs: casting the gathered weights to the compute dtype, casting and scaling the gradient
/// for its reduction, copying it into and out of the collective's buffers, accumulating it;
/// priced every micro-batch under every strategy, on layouts of two GPUs or more.
/// PyTorch FSDP's mixed-precision passes count 14–30 bytes (a bf16 gradient cast to fp32, read
/// 2 + write 4; divided in place, 8; autocast's weight casts, 6 each way; FSDP2's copy-in and
/// copy-out, 4 each); fitted to 37.6 on the single-node runs of docs/published-runs.md, where it
/// took the held-out error from 0.113 to 0.085 (rms log). The CPU trainer's own passes are in
/// its calibrated step overhead.
pub const PARAM_PASS_BYTES: f64 = 37.6;
/// The bytes per parameter a layout's micro-batches pass over outside the kernels:
/// [`PARAM_PASS_BYTES`] on two GPUs or more (the figure was fitted on runs sharded over 8 or
/// more; one GPU gathers and reduces nothing), none on CPUs, where the trainer's own passes are
/// part of its calibrated step overhead.
pub fn param_pass_bytes(layout: &Layout) -> f64 {
    match layout.device.kind {
        DeviceKind::Gpu if layout.world_size() > 1 => PARAM_PASS_BYTES,
        _ => 0.0,
    }
}
/// Backward of a matmul is two matmuls (input and weight gradients).
pub const LINEAR_BWD_FACTOR: f64 = 2.0;
/// Fused attention backward recomputes the scores: about 2.5× its forward.
pub const ATTENTION_BWD_FACTOR: f64 = 2.5;
/// Element-wise backward reads and writes about twice the forward's bytes.
pub const ELEMENTWISE_BWD_FACTOR: f64 = 2.0;

/// How one operator's parameters are held across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// The op owns no parameters: nothing to shard.
    None,
    /// Replicated (DDP): gradients all-reduced.
    Dp,
    /// Optimizer states sharded.
    Zero1,
    /// Optimizer states and gradients sharded.
    Zero2,
    /// Everything sharded (FSDP FULL_SHARD); parameters gathered for use.
    Zero3,
    /// Hybrid sharding (FSDP HYBRID_SHARD, ZeRO++ hpZ): everything sharded over the ranks of
    /// a node and replicated across nodes; parameters gathered inside the node, gradient
    /// shards all-reduced across the nodes once a step. Multi-node layouts only.
    Hsdp,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Dp => "dp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::Hsdp => "hsdp",
        }
    }

    pub fn parse(s: &str) -> Option<Strategy> {
        Some(match s {
            "none" => Strategy::None,
            "dp" | "ddp" => Strategy::Dp,
            "zero1" => Strategy::Zero1,
            "zero2" => Strategy::Zero2,
            "zero3" | "fsdp" => Strategy::Zero3,
            "hsdp" => Strategy::Hsdp,
            _ => return None,
        })
    }
}

/// What of an op's state lives in host memory instead of the device's (ZeRO-Offload,
/// Colossal-AI's heterogeneous training, Hydra's spilling), on top of its sharding strategy.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Offload {
    /// Everything on the device.
    #[default]
    #[serde(rename = "none")]
    None,
    /// `offload-opt`: the fp32 master copy and both Adam moments of the part this rank
    /// updates live in host memory and the AdamW step runs on the CPU; gradients are copied
    /// device → host and the updated weights host → device once a step.
    #[serde(rename = "offload-opt")]
    Opt,
    /// `offload-param`: as `Opt`, and the compute copy of the parameters lives in host memory
    /// too, fetched to the device for each forward and backward (the next op's fetch runs
    /// beside this op's compute where the device has a copy engine).
    #[serde(rename = "offload-param")]
    Param,
}

impl Offload {
    pub fn as_str(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Opt => "offload-opt",
            Offload::Param => "offload-param",
        }
    }

    pub fn parse(s: &str) -> Option<Offload> {
        Some(match s {
            "none" => Offload::None,
            "offload-opt" | "opt" => Offload::Opt,
            "offload-param" | "param" => Offload::Param,
            _ => return None,
        })
    }

    pub fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

/// A strategy with OSDP's operator splitting: the op is cut into `split` slices along its input
/// features, of which the first `sharded` are ZeRO-3 sharded and the rest replicated; and
/// optionally offloaded to host memory (unsplit choices only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Choice {
    pub strategy: Strategy,
    pub split: u32,
    pub sharded: u32,
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
}

impl Choice {
    pub const NONE: Choice = Choice::plain(Strategy::None);
    pub const DP: Choice = Choice::plain(Strategy::Dp);

    pub const fn plain(strategy: Strategy) -> Choice {
        let sharded = matches!(strategy, Strategy::Zero3) as u32;
        Choice {
            strategy,
            split: 1,
            sharded,
            offload: Offload::None,
        }
    }

    pub const fn zero3(split: u32, sharded: u32) -> Choice {
        Choice {
            strategy: Strategy::Zero3,
            split,
            sharded,
            offload: Offload::None,
        }
    }

    /// This choice with its state offloaded as `offload` says.
    pub const fn offloaded(self, offload: Offload) -> Choice {
        Choice { offload, ..self }
    }

    /// `zero3/4:3` for split ops, `zero2+offload-opt` for offloaded ones, the strategy name
    /// otherwise.
    pub fn label(&self) -> String {
        let base = if self.strategy == Strategy::Zero3 && self.split > 1 {
            format!("zero3/{}:{}", self.split, self.sharded)
        } else {
            self.strategy.as_str().to_string()
        };
        match self.offload {
            Offload::None => base,
            o => format!("{base}+{}", o.as_str()),
        }
    }

    /// [`Choice::label`] for narrow columns: `+ofl-opt` and `+ofl-par` for the offloads.
    pub fn short_label(&self) -> String {
        let full = self.label();
        match self.offload {
            Offload::None => full,
            Offload::Opt => full.replace("+offload-opt", "+ofl-opt"),
            Offload::Param => full.replace("+offload-param", "+ofl-par"),
        }
    }

    /// Parse a label ([`Choice::label`]): `dp`, `zero3/4:2`, `zero3+offload-param`, … (not
    /// checked against any op: see `plan::check_choice`).
    pub fn parse(s: &str) -> Option<Choice> {
        let (base, offload) = match s.split_once('+') {
            Some((b, o)) => (b, Offload::parse(o).filter(|o| !o.is_none())?),
            None => (s, Offload::None),
        };
        let choice = match base.split_once('/') {
            None => Strategy::parse(base).map(Choice::plain),
            Some(("zero3", rest)) => rest
                .split_once(':')
                .and_then(|(k, m)| Some(Choice::zero3(k.parse().ok()?, m.parse().ok()?))),
            Some(_) => None,
        }?;
        Some(choice.offloaded(offload))
    }
}

/// How one rank holds a unit of parameters — a whole tensor, or one column slice of a split
/// linear's weight: the unit the trainer shards, reduces and updates, and the cost model
/// prices state and optimizer time by ([`Choice::units`] says which units an op has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holding {
    /// Every rank holds all of it (dp, and the unsharded slices of a split op).
    Replicated,
    /// Optimizer states sharded.
    Zero1,
    /// Optimizer states and gradients sharded.
    Zero2,
    /// Everything sharded; gathered for use.
    Zero3,
    /// Everything sharded over the ranks of a node (hsdp), replicated across nodes.
    Hybrid,
}

impl Holding {
    /// How many ranks a unit held this way is shared among: a node's for [`Holding::Hybrid`],
    /// all of them otherwise. The share every rank holds, gathers and updates is of this many.
    pub fn shard_ranks(self, ranks: u64, ranks_per_node: u64) -> u64 {
        match self {
            Holding::Hybrid => ranks_per_node.clamp(1, ranks.max(1)),
            _ => ranks,
        }
    }

    /// Elements of a sharded unit of `numel` each of `ranks` holds: an equal share of the unit
    /// padded to a multiple of the ranks, so that collectives move equal pieces.
    pub fn share(numel: u64, ranks: u64) -> u64 {
        numel.div_ceil(ranks.max(1))
    }

    /// Elements of the unit this rank's optimizer updates (and keeps optimizer states for).
    pub fn updated(self, numel: u64, ranks: u64) -> u64 {
        match self {
            Holding::Replicated => numel,
            _ => Holding::share(numel, ranks),
        }
    }

    /// Elements of the unit's compute copy and gradient one of `ranks` holds all step: each
    /// whole or as this rank's padded share.
    pub fn held(self, numel: u64, ranks: u64) -> (u64, u64) {
        let share = Holding::share(numel, ranks);
        match self {
            Holding::Replicated | Holding::Zero1 => (numel, numel),
            Holding::Zero2 => (numel, share),
            Holding::Zero3 | Holding::Hybrid => (share, share),
        }
    }

    /// Bytes one of `ranks` holds all step for a unit of `numel` elements in `precision`:
    /// compute copy, gradient and optimizer state, each whole or as this rank's padded share.
    pub fn state_bytes(self, numel: u64, ranks: u64, precision: Precision) -> u64 {
        self.placed_bytes(numel, ranks, precision, Offload::None)
            .device
    }

    /// Whether an offloaded unit held this way moves its gradient to the host every
    /// micro-batch (ZeRO-Offload's way): where gradients are reduced to this rank's shard every
    /// micro-batch (zero2, zero3, hsdp), the shard goes to the host's fp32 buffer and is summed
    /// there; where they are synchronised once a step (dp, zero1), the gradient stays on the
    /// device until then.
    pub fn streams_grads(self) -> bool {
        matches!(self, Holding::Zero2 | Holding::Zero3 | Holding::Hybrid)
    }

    /// The device bytes of an offloaded unit's gradient of `grad_bytes`: none where it streams
    /// to the host ([`Holding::streams_grads`]).
    fn device_grad(self, grad_bytes: u64) -> u64 {
        if self.streams_grads() {
            0
        } else {
            grad_bytes
        }
    }

    /// [`Holding::state_bytes`] split between the device and host memory under `offload`.
    pub fn placed_bytes(
        self,
        numel: u64,
        ranks: u64,
        precision: Precision,
        offload: Offload,
    ) -> Placed {
        let (params, grads) = self.held(numel, ranks);
        let updated = self.updated(numel, ranks);
        let (param_b, grad_b) = (precision.param_bytes * params, precision.grad_bytes * grads);
        match offload {
            Offload::None => Placed {
                device: param_b + grad_b + precision.optimizer_bytes * updated,
                host: 0,
            },
            Offload::Opt => Placed {
                device: param_b + self.device_grad(grad_b),
                host: HOST_STATE_BYTES_PER_PARAM * updated,
            },
            Offload::Param => Placed {
                device: self.device_grad(grad_b),
                host: HOST_STATE_BYTES_PER_PARAM * updated + param_b,
            },
        }
    }
}

/// Bytes held all step on the device and in host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placed {
    pub device: u64,
    pub host: u64,
}

/// One unit of an op's parameter tensor under a choice (see [`Choice::units`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// `(j, k)`: the unit is column slice `j` of `k` equal ones; `None`: the whole tensor.
    pub slice: Option<(u32, u32)>,
    pub numel: u64,
    pub holding: Holding,
}

/// Whether splitting an op cuts its parameter `param` into column slices: only a linear's
/// weight is cut (along its input features); its other parameters stay whole.
pub fn cut_by_split(kind: OpKind, param: &str) -> bool {
    kind == OpKind::Linear && param == "weight"
}

impl Choice {
    /// The units a tensor of `numel` elements is held as under this choice. A tensor a split cuts ([`cut_by_split`]) becomes `split` equal column slices,
    /// the first `sharded` ZeRO-3 and the others replicated; any other tensor is one unit held
    /// as the strategy says, except under a split, where it follows the majority of the
    /// slices (a split linear's bias is sharded when at least half its weight is).
    pub fn units(self, numel: u64, cut: bool) -> impl Iterator<Item = Unit> {
        let k = if cut { self.split.max(1) } else { 1 };
        let whole = match self.strategy {
            Strategy::None | Strategy::Dp => Holding::Replicated,
            Strategy::Zero1 => Holding::Zero1,
            Strategy::Zero2 => Holding::Zero2,
            Strategy::Zero3 if self.split > 1 && self.sharded * 2 < self.split => {
                Holding::Replicated
            }
            Strategy::Zero3 => Holding::Zero3,
            Strategy::Hsdp => Holding::Hybrid,
        };
        (0..k).map(move |j| match k {
            1 => Unit {
                slice: None,
                numel,
                holding: whole,
            },
            _ => Unit {
                slice: Some((j, k)),
                numel: numel / u64::from(k),
                holding: if j < self.sharded {
                    Holding::Zero3
                } else {
                    Holding::Replicated
                },
            },
        })
    }
}

/// Rates of the layout the cost model needs, resolved once.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    pub ranks: u32,
    /// Dense FLOP/s for the model's compute dtype.
    pub flops_per_s: f64,
    pub memory_bytes_per_s: f64,
    /// Nodes the ranks are spread over (ranks / nodes per node).
    pub nodes: u32,
    /// Bus bandwidth of a ring over all ranks, bytes/s: the intra-node link's, or across
    /// nodes the lesser of it and a node's NICs together (one ring channel per NIC).
    pub link_bytes_per_s: f64,
    /// Per-step latency of a ring collective between ranks of one node, seconds.
    pub link_latency_s: f64,
    /// Per-step latency of the ring steps that cross nodes (`nodes − 1` of a ring's steps).
    pub cross_node_latency_s: f64,
    /// Ranks in one node (hybrid sharding's shard group); `ranks` on one node.
    pub ranks_per_node: u32,
    /// Bus bandwidth of a ring over the ranks of one node (the intra-node link), bytes/s.
    pub node_link_bytes_per_s: f64,
    /// Bus bandwidth of one cross-node ring of one rank per node (hybrid sharding's replica
    /// group), bytes/s: each of a node's ranks runs its own such ring at once, so each gets
    /// its share of the node's NICs.
    pub replica_link_bytes_per_s: f64,
    /// Fixed latency of one collective besides its steps (NCCL's launch and set-up).
    pub collective_base_s: f64,
    /// Bytes per element of reduced gradients on the wire.
    pub reduce_bytes: u64,
    /// Fractions of the peaks kernels reach: matmuls, fused attention forward and backward
    /// (on causal FLOPs), memory-bound kernels.
    pub efficiency: Efficiencies,
    /// Collectives of a block's ops are issued together (one latency per block, shared by
    /// its ops in proportion to their parameters), as FSDP units and DDP buckets do on GPUs.
    /// The CPU trainer issues one collective per op.
    pub block_collectives: bool,
    /// Bytes moved per parameter every micro-batch outside the listed kernels
    /// ([`PARAM_PASS_BYTES`] on two GPUs or more, 0 on one GPU and on CPUs).
    pub param_pass_bytes: f64,
    /// Fixed cost of launching one kernel, seconds.
    pub launch_s: f64,
    pub overhead_bytes: u64,
    /// Which dtype the compute rate is for (for messages).
    pub compute_dtype: &'static str,
    pub precision: Precision,
    /// Bytes of one activation element in the model description's figures.
    pub model_activation_bytes: u64,
    /// Whether collectives run on their own stream beside compute (GPUs); the CPU trainer
    /// runs them in line, so all of their time is exposed.
    pub overlap: bool,
    /// Measured kernel curves and fixed costs (`osdp-tui calibrate`), preferred to the rates.
    pub calibration: Option<Arc<Calibration>>,
    /// Copy bandwidth between one device and host memory, each way, bytes/s; 0 where the
    /// layout has no host figures (offload cannot be priced).
    pub host_link_bytes_per_s: f64,
    /// AdamW updates per second of the CPU cores that serve one rank (its share of the node's).
    pub cpu_adam_params_per_s: f64,
    /// Host memory one rank's offloaded state may take (the layout's default: 80 % of the
    /// node's host memory over its devices; `--host-budget` sets it). 0: offload is not
    /// offered.
    pub host_budget_bytes: u64,
}

/// Kernel efficiencies the cost model prices with, resolved from the layout, the GPU's
/// generation, or generic defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiencies {
    /// Where they come from, in words (for `plan`'s "prices" line).
    pub source: &'static str,
    /// Of a large GEMM.
    pub matmul: f64,
    /// Narrow GEMMs reach less: a linear whose smaller side is `k` features runs at
    /// `matmul · k / (k + matmul_half_width)`. 0 where not known.
    pub matmul_half_width: f64,
    pub attention_forward: f64,
    pub attention_backward: f64,
    pub memory: f64,
}

impl Efficiencies {
    /// The fractions used where nothing better is known.
    pub const GENERIC: Efficiencies = Efficiencies {
        source: "generic efficiencies",
        matmul: MATMUL_EFFICIENCY,
        matmul_half_width: 0.0,
        attention_forward: MATMUL_EFFICIENCY,
        attention_backward: MATMUL_EFFICIENCY,
        memory: MEMORY_EFFICIENCY,
    };

    /// The source of efficiencies `osdp-tui calibrate --device cuda` measured.
    pub const MEASURED: &'static str =
        "efficiencies measured on this GPU by `osdp-tui calibrate --device cuda`";

    /// The layout's own figures, else its GPU generation's (`cluster::known`), else generic.
    pub fn of(layout: &Layout) -> Efficiencies {
        let d = &layout.device;
        let base = match (d.kind, crate::cluster::known::lookup(&d.model)) {
            (DeviceKind::Gpu, Some(g)) => Efficiencies {
                source: g.efficiency.summary,
                matmul: g.efficiency.matmul.value,
                matmul_half_width: g.efficiency.matmul_half_width.value,
                attention_forward: g.efficiency.attention_forward.value,
                attention_backward: g.efficiency.attention_backward.value,
                memory: g.efficiency.memory.value,
            },
            _ => Efficiencies::GENERIC,
        };
        let e = &d.efficiency;
        let pick = |f: &Option<crate::cluster::Figure>, default: f64| {
            f.as_ref().map_or(default, |f| f.value)
        };
        Efficiencies {
            source: if e.is_empty() {
                base.source
            } else if layout.calibration.is_none() && e.measured_at.is_some() {
                Efficiencies::MEASURED
            } else {
                "the layout's own efficiencies"
            },
            matmul: pick(&e.matmul, base.matmul),
            matmul_half_width: pick(&e.matmul_half_width, base.matmul_half_width),
            attention_forward: pick(&e.attention_forward, base.attention_forward),
            attention_backward: pick(&e.attention_backward, base.attention_backward),
            memory: pick(&e.memory, base.memory),
        }
    }
}

impl Machine {
    /// Resolve a layout's figures for a model computing in `model.config.dtype`.
    pub fn new(layout: &Layout, model: &ModelSpec) -> Machine {
        let r = &layout.device.dense_tflops;
        let precision = match layout.device.kind {
            DeviceKind::Cpu => Precision::FP32,
            DeviceKind::Gpu => Precision::MIXED_BF16,
        };
        let fp32 = [("fp32", &r.fp32), ("tf32", &r.tf32), ("bf16", &r.bf16)];
        let wanted = match model.config.dtype {
            _ if precision == Precision::FP32 => fp32,
            crate::model::DType::Bf16 => [("bf16", &r.bf16), ("fp16", &r.fp16), ("fp32", &r.fp32)],
            crate::model::DType::F16 => [("fp16", &r.fp16), ("bf16", &r.bf16), ("fp32", &r.fp32)],
            crate::model::DType::F32 => fp32,
        };
        // A validated layout has at least one rate; fall back through the others.
        let (compute_dtype, tflops) = wanted
            .iter()
            .find_map(|(n, f)| f.as_ref().map(|f| (*n, f.value)))
            .or_else(|| {
                [
                    ("tf32", &r.tf32),
                    ("fp32", &r.fp32),
                    ("fp16", &r.fp16),
                    ("bf16", &r.bf16),
                ]
                .iter()
                .find_map(|(n, f)| f.as_ref().map(|f| (*n, f.value)))
            })
            .unwrap_or(("fp32", 1.0));
        // A ring over several nodes runs one channel per NIC: its bus bandwidth is the
        // lesser of the NVLink (or PCIe) one and all of a node's NICs together, and only
        // the steps that cross nodes pay the network's latency.
        let intra = &layout.intra_node;
        let per_node = layout.gpus_per_node.max(1);
        let (bw, cross_lat, replica_bw) = match &layout.inter_node {
            Some(inter) if layout.nodes > 1 => {
                let nics = inter.bus_bandwidth_gb_per_s.value * inter.nics();
                (
                    nics.min(intra.bus_bandwidth_gb_per_s.value),
                    inter.latency_us.value,
                    // A node's ranks each run a ring of one rank per node, side by side:
                    // they share the node's NICs.
                    (nics / f64::from(per_node)).min(intra.bus_bandwidth_gb_per_s.value),
                )
            }
            _ => (
                intra.bus_bandwidth_gb_per_s.value,
                intra.latency_us.value,
                intra.bus_bandwidth_gb_per_s.value,
            ),
        };
        Machine {
            ranks: layout.world_size(),
            nodes: layout.nodes.max(1),
            flops_per_s: tflops * 1e12,
            memory_bytes_per_s: layout.device.memory_bandwidth_gb_per_s.value * 1e9,
            link_bytes_per_s: bw * 1e9,
            link_latency_s: intra.latency_us.value * 1e-6,
            cross_node_latency_s: cross_lat * 1e-6,
            ranks_per_node: per_node.min(layout.world_size().max(1)),
            node_link_bytes_per_s: intra.bus_bandwidth_gb_per_s.value * 1e9,
            replica_link_bytes_per_s: replica_bw * 1e9,
            collective_base_s: match layout.device.kind {
                DeviceKind::Gpu => NCCL_BASE_LATENCY_S,
                // Calibrated CPU links fold it into the per-step figure.
                DeviceKind::Cpu => 0.0,
            },
            reduce_bytes: layout
                .gradient_reduce_dtype
                .map_or(precision.grad_bytes, |d| d.bytes()),
            efficiency: Efficiencies::of(layout),
            block_collectives: layout.device.kind == DeviceKind::Gpu,
            param_pass_bytes: param_pass_bytes(layout),
            launch_s: match layout.device.kind {
                DeviceKind::Gpu => 5e-6,
                DeviceKind::Cpu => 10e-6,
            },
            overhead_bytes: layout.runtime_overhead_bytes(),
            compute_dtype,
            precision,
            model_activation_bytes: model.config.dtype.bytes(),
            overlap: layout.device.kind == DeviceKind::Gpu,
            calibration: layout.calibration.clone().map(Arc::new),
            host_link_bytes_per_s: layout
                .host
                .as_ref()
                .map_or(0.0, |h| h.link_gb_per_s.value * 1e9),
            cpu_adam_params_per_s: layout.host.as_ref().map_or(0.0, |h| {
                h.adam_mparams_per_s_per_core.value * 1e6 * h.cpu_cores_per_node.value
                    / f64::from(per_node)
            }),
            host_budget_bytes: layout.host_budget_bytes().unwrap_or(0),
        }
    }

    /// Whether offloaded state can be priced here: the layout says what its host has.
    pub fn prices_offload(&self) -> bool {
        self.host_link_bytes_per_s > 0.0 && self.cpu_adam_params_per_s > 0.0
    }

    /// Whether the planner may offload: the host can be priced and has a budget.
    pub fn offers_offload(&self) -> bool {
        self.prices_offload() && self.host_budget_bytes > 0
    }

    /// Why `choice` cannot run on this machine, if it cannot: hybrid sharding on one node,
    /// offload without host figures.
    pub fn refuses_choice(&self, choice: Choice) -> Option<String> {
        self.refuses(choice.strategy).or_else(|| {
            (!choice.offload.is_none() && !self.prices_offload()).then(|| {
                format!(
                    "{} keeps state in host memory, but the layout has no `host` figures (host \
                     memory, the link to it, CPU cores and their AdamW rate); add them to price \
                     offload",
                    choice.offload.as_str()
                )
            })
        })
    }

    /// One copy of `bytes` between the device and host memory.
    fn host_copy_s(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            0.0
        } else {
            bytes / self.host_link_bytes_per_s + self.launch_s
        }
    }

    /// Where the time figures come from, for `plan` output.
    pub fn timing_source(&self) -> String {
        match &self.calibration {
            Some(c) => c.summary(),
            None if self.efficiency.source == Efficiencies::MEASURED => {
                format!("datasheet peaks × {}", self.efficiency.source)
            }
            None => format!(
                "datasheet rates × {} (not calibrated: `osdp-tui calibrate` measures a machine)",
                self.efficiency.source
            ),
        }
    }

    /// The fixed cost of a step outside operators, collectives and the optimizer (measured by
    /// calibration; 0 otherwise).
    pub fn step_overhead_s(&self) -> f64 {
        self.calibration.as_ref().map_or(0.0, |c| c.step_overhead_s)
    }

    /// Activation bytes of the model description converted to this machine's precision.
    pub fn activation_bytes(&self, model_bytes: u64) -> u64 {
        model_bytes * self.precision.activation_bytes / self.model_activation_bytes.max(1)
    }

    /// Ring all-gather (or reduce-scatter) of a tensor of `bytes` in total.
    pub fn all_gather_s(&self, bytes: f64) -> f64 {
        self.ring_s(bytes, 1.0)
    }

    /// A ring collective of `bytes` that pays `latency_share` of the ring's latency (the
    /// rest is paid by the other ops issued with it).
    fn ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let n = f64::from(self.ranks);
        if self.ranks <= 1 {
            return 0.0;
        }
        let nodes = f64::from(self.nodes.clamp(1, self.ranks));
        latency_share
            * (self.collective_base_s
                + (n - nodes) * self.link_latency_s
                + (nodes - 1.0) * self.cross_node_latency_s)
            + (n - 1.0) / n * bytes / self.link_bytes_per_s
    }

    pub fn reduce_scatter_s(&self, bytes: f64) -> f64 {
        self.all_gather_s(bytes)
    }

    /// Whether hybrid sharding applies: the ranks span more than one node.
    pub fn hybrid(&self) -> bool {
        self.nodes > 1 && self.ranks > self.ranks_per_node
    }

    /// Why `strategy` cannot run on this machine, if it cannot: hybrid sharding on one node.
    pub fn refuses(&self, strategy: Strategy) -> Option<String> {
        (strategy == Strategy::Hsdp && !self.hybrid()).then(|| {
            format!(
                "hsdp shards inside a node and replicates across nodes, but all {} ranks are on \
                 one node: use zero3 (the same sharding over all ranks), or a layout of several \
                 nodes",
                self.ranks
            )
        })
    }

    /// A ring collective of `bytes` over the ranks of one node (hybrid sharding's gathers and
    /// reduce-scatters), paying `latency_share` of its latency.
    fn node_ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let n = f64::from(self.ranks_per_node.min(self.ranks));
        if n <= 1.0 {
            return 0.0;
        }
        latency_share * (self.collective_base_s + (n - 1.0) * self.link_latency_s)
            + (n - 1.0) / n * bytes / self.node_link_bytes_per_s
    }

    /// A ring collective of `bytes` over one rank per node (hybrid sharding's replica group):
    /// every step crosses nodes.
    fn replica_ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let n = f64::from(self.nodes.clamp(1, self.ranks.max(1)));
        if n <= 1.0 {
            return 0.0;
        }
        latency_share * (self.collective_base_s + (n - 1.0) * self.cross_node_latency_s)
            + (n - 1.0) / n * bytes / self.replica_link_bytes_per_s
    }

    /// Ring all-reduce = reduce-scatter + all-gather.
    pub fn all_reduce_s(&self, bytes: f64) -> f64 {
        2.0 * self.all_gather_s(bytes)
    }

    /// A GEMM of `flops` whose smaller side is `width` features.
    fn matmul_s(&self, flops: f64, width: f64, calls: u32) -> f64 {
        let e = &self.efficiency;
        let efficiency = e.matmul * width / (width + e.matmul_half_width);
        flops / (self.flops_per_s * efficiency) + f64::from(calls) * self.launch_s
    }

    /// A fused attention kernel doing `flops` (causal ones: the masked half is skipped).
    fn attention_s(&self, flops: f64, efficiency: f64) -> f64 {
        flops / (self.flops_per_s * efficiency) + self.launch_s
    }

    /// One element-wise kernel over `bytes`: [`Machine::streamed_s`] plus its launch.
    fn memory_s(&self, bytes: f64) -> f64 {
        self.streamed_s(bytes) + self.launch_s
    }

    /// `bytes` read or written at the rate element-wise kernels reach of memory bandwidth.
    fn streamed_s(&self, bytes: f64) -> f64 {
        bytes / (self.memory_bytes_per_s * self.efficiency.memory)
    }
}

/// Strategy-independent facts of one op at one micro-batch size.
#[derive(Debug, Clone, PartialEq)]
pub struct OpBase {
    /// Parameters the op owns (tied ones belong to their owner).
    pub params: u64,
    /// How many ops use these parameters (1 + tied users): each use gathers them under ZeRO-3.
    pub uses: u32,
    /// Whether OSDP's operator splitting applies (linears).
    pub splittable: bool,
    pub fwd_s: f64,
    pub bwd_s: f64,
    /// Activations kept for backward at this micro-batch.
    pub saved_bytes: u64,
    /// Gradient buffers while the op runs backward: its output's and its inputs' gradients.
    pub working_bytes: u64,
    /// Output at this micro-batch (what a recomputed block keeps of its input).
    pub output_bytes: u64,
    /// Work at this micro-batch, the calibration curves' axis: FLOPs for linears and attention,
    /// bytes moved at the training precision for the others.
    pub work: f64,
    /// The parameter tensors the op owns (a validated op has at most two: weight and bias),
    /// in the model's order; absent ones have no elements.
    pub tensors: [ParamTensor; 2],
    /// Micro-batches per optimizer step (gradient accumulation): the op's compute, and the
    /// collectives a strategy repeats per micro-batch, run this many times a step.
    pub accumulation: u32,
    /// The share of a collective's latency this op pays: 1 where each op communicates on its
    /// own; its fraction of its block's parameters where a block's ops communicate together.
    pub latency_share: f64,
}

/// What an op owns, whatever the batch: made once per graph ([`OpGraph`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Owned {
    /// [`ModelSpec::op_param_count`].
    pub params: u64,
    /// [`OpBase::uses`] ([`parameter_uses`]).
    pub uses: u32,
    /// [`OpBase::tensors`].
    pub tensors: [ParamTensor; 2],
}

impl Owned {
    pub fn of(op: &OpSpec, uses: u32) -> Owned {
        let mut owned = op
            .params
            .iter()
            .filter(|p| p.tied_to.is_none())
            .map(|p| ParamTensor {
                numel: p.shape.iter().product::<i64>().max(0) as u64,
                cut: cut_by_split(op.kind, &p.name),
            });
        Owned {
            params: ModelSpec::op_param_count(op),
            uses,
            tensors: [
                owned.next().unwrap_or_default(),
                owned.next().unwrap_or_default(),
            ],
        }
    }
}

/// One parameter tensor an op owns, as sharding sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ParamTensor {
    pub numel: u64,
    /// A split cuts it into column slices ([`cut_by_split`]).
    pub cut: bool,
}

impl OpBase {
    /// The units `choice` holds the op's parameters as ([`Choice::units`]).
    pub fn units(&self, choice: Choice) -> impl Iterator<Item = Unit> + '_ {
        self.tensors
            .iter()
            .filter(|t| t.numel > 0)
            .flat_map(move |t| choice.units(t.numel, t.cut))
    }

    /// `input_bytes_per_sample`: the summed outputs of the op's inputs. `config`: the model's,
    /// whose attention may be a fused causal kernel (which skips the masked half of its FLOPs).
    pub fn new(
        op: &OpSpec,
        kernel: &str,
        input_bytes_per_sample: u64,
        m: &Machine,
        batch: u64,
        config: &ModelConfig,
        owned: &Owned,
    ) -> OpBase {
        let causal_fused = config.causal && config.attention == AttentionImpl::Flash;
        let b = batch as f64;
        let flops = op.fwd_flops_per_sample as f64 * b;
        let moved = (input_bytes_per_sample + op.output_bytes_per_sample) as f64 * b;
        let work = op_work(op, input_bytes_per_sample, m, batch);
        let measured = m
            .calibration
            .as_ref()
            .and_then(|c| c.kernel_s(kernel, work));
        let (fwd_s, bwd_s) = match op.kind {
            _ if measured.is_some() => measured.unwrap_or_default(),
            OpKind::Linear => {
                // The GEMM's smallest side: its narrower feature count, or the rows of the
                // micro-batch (tokens) when fewer.
                let weight = op.params.first().map(|p| p.shape.as_slice()).unwrap_or(&[]);
                let features = weight.iter().copied().min().unwrap_or(1).max(1) as f64;
                let rows = flops / (2.0 * weight.iter().product::<i64>().max(1) as f64);
                let width = features.min(rows.max(1.0));
                (
                    m.matmul_s(flops, width, 1),
                    LINEAR_BWD_FACTOR * m.matmul_s(flops, width, 1),
                )
            }
            OpKind::Attention if causal_fused => {
                let done = flops / 2.0;
                (
                    m.attention_s(done, m.efficiency.attention_forward),
                    m.attention_s(ATTENTION_BWD_FACTOR * done, m.efficiency.attention_backward),
                )
            }
            OpKind::Attention => (
                m.attention_s(flops, m.efficiency.attention_forward),
                m.attention_s(
                    ATTENTION_BWD_FACTOR * flops,
                    m.efficiency.attention_backward,
                ),
            ),
            _ => (
                m.memory_s(moved),
                ELEMENTWISE_BWD_FACTOR * m.memory_s(moved),
            ),
        };
        // Activations in the training precision; token ids, fused attention's log-sum-exp and
        // the loss's log-probabilities in their own dtypes whatever the precision.
        let fixed = saved::fixed_dtype_saved_bytes(op, config);
        let saved = m.activation_bytes(op.saved_bytes_per_sample - fixed) + fixed;
        OpBase {
            params: owned.params,
            uses: owned.uses,
            splittable: op.kind == OpKind::Linear,
            fwd_s,
            bwd_s,
            saved_bytes: saved * batch,
            working_bytes: m.activation_bytes(input_bytes_per_sample + op.output_bytes_per_sample)
                * batch,
            output_bytes: m.activation_bytes(op.output_bytes_per_sample) * batch,
            work,
            tensors: owned.tensors,
            accumulation: 1,
            latency_share: 1.0,
        }
    }

    /// Forward time of the op over a whole step (every micro-batch): what recomputing it adds.
    pub fn recompute_s(&self) -> f64 {
        self.fwd_s * f64::from(self.accumulation.max(1))
    }
}

/// Which calibration curve prices `op`: its kind (`linear`), and for activations also the
/// function and whether it is gated (`activation/gelu_tanh`, `activation/silu_gated`), whose
/// kernels differ several-fold at the same bytes.
pub fn kernel_key(model: &ModelSpec, op: &OpSpec) -> &'static str {
    use crate::model::Activation::{Gelu, GeluTanh, Relu, Silu};
    let gated = op.inputs.len() == 2;
    match (op.kind, model.config.activation, gated) {
        (OpKind::Activation, Gelu, false) => "activation/gelu",
        (OpKind::Activation, Gelu, true) => "activation/gelu_gated",
        (OpKind::Activation, GeluTanh, false) => "activation/gelu_tanh",
        (OpKind::Activation, GeluTanh, true) => "activation/gelu_tanh_gated",
        (OpKind::Activation, Relu, false) => "activation/relu",
        (OpKind::Activation, Relu, true) => "activation/relu_gated",
        (OpKind::Activation, Silu, false) => "activation/silu",
        (OpKind::Activation, Silu, true) => "activation/silu_gated",
        (kind, _, _) => kind.as_str(),
    }
}

/// The calibration curves' measure of an op's work at micro-batch `batch`: forward FLOPs for
/// linears and attention, bytes read and written (at the machine's activation precision) for
/// the memory-bound kinds.
pub fn op_work(op: &OpSpec, input_bytes_per_sample: u64, m: &Machine, batch: u64) -> f64 {
    match op.kind {
        OpKind::Linear | OpKind::Attention => op.fwd_flops_per_sample as f64 * batch as f64,
        _ => {
            m.activation_bytes(input_bytes_per_sample + op.output_bytes_per_sample) as f64
                * batch as f64
        }
    }
}

/// What one op costs under one choice.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OpCost {
    /// Parameters, gradients and optimizer states held on each rank all step long.
    pub persistent_bytes: u64,
    /// Held only while the op runs: gathered weights, unsharded gradients, gradient buffers.
    pub transient_bytes: u64,
    /// Held all step in host memory (offloaded optimizer state and parameters).
    pub host_bytes: u64,
    /// Forward + backward compute.
    pub compute_s: f64,
    /// Total communication time (before overlap).
    pub comm_s: f64,
    /// Communication left after overlapping with the op's compute.
    pub exposed_comm_s: f64,
    pub optimizer_s: f64,
}

impl OpCost {
    /// Time the op adds to a step (recomputation is accounted per block).
    pub fn time_s(&self) -> f64 {
        self.compute_s + self.exposed_comm_s + self.optimizer_s
    }
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Price `choice` for an op described by `base` on machine `m`.
pub fn price(base: &OpBase, choice: Choice, m: &Machine) -> OpCost {
    let p = base.params;
    let n = u64::from(m.ranks.max(1));
    let extra_gathers = f64::from(base.uses.max(1));
    let share = base.latency_share;
    let gather = |bytes: f64| m.ring_s(bytes, share);
    let all_reduce = |bytes: f64| 2.0 * m.ring_s(bytes, share);
    let split_launches = f64::from(choice.split.saturating_sub(1)) * m.launch_s;
    let pr = m.precision;
    let (pb, gb) = (pr.param_bytes, pr.grad_bytes);
    // Gradients travel in the reduce dtype.
    let rb = m.reduce_bytes;
    // Collectives as the executor runs them under gradient accumulation: DDP and ZeRO-1 sync
    // gradients once a step (the last micro-batch's backward), ZeRO-1/2 gather the updated
    // parameters once (before the first forward), ZeRO-2 reduce-scatters every micro-batch's
    // gradients, ZeRO-3 gathers and reduce-scatters for every micro-batch.
    let none = Comm::default();
    // State and optimizer work follow the units the trainer holds (padded shares per unit).
    let per_node = u64::from(m.ranks_per_node);
    let (mut persistent, mut host, mut updated, mut replicated_p, mut params_held) =
        (0, 0, 0, 0, 0);
    // Offloaded gradients copied to the host every micro-batch / once a step (elements).
    let (mut streamed, mut stepped) = (0, 0);
    for u in base.units(choice) {
        let over = u.holding.shard_ranks(n, per_node);
        let placed = u.holding.placed_bytes(u.numel, over, pr, choice.offload);
        persistent += placed.device;
        host += placed.host;
        updated += u.holding.updated(u.numel, over);
        params_held += u.holding.held(u.numel, over).0;
        if u.holding.streams_grads() {
            streamed += u.holding.updated(u.numel, over);
        } else {
            stepped += u.holding.updated(u.numel, over);
        }
        if u.holding == Holding::Replicated {
            replicated_p += u.numel;
        }
    }
    let (param_transient, comm) = match choice.strategy {
        Strategy::None => (0, none),
        Strategy::Dp => (
            0,
            Comm {
                step_bwd: all_reduce((rb * p) as f64),
                ..none
            },
        ),
        Strategy::Zero1 => (
            0,
            Comm {
                step_fwd: gather((pb * p) as f64),
                step_bwd: gather((rb * p) as f64),
                ..none
            },
        ),
        Strategy::Zero2 => (
            gb * p,
            Comm {
                step_fwd: gather((pb * p) as f64),
                micro_bwd: gather((rb * p) as f64),
                ..none
            },
        ),
        Strategy::Zero3 => {
            let (k, s) = (u64::from(choice.split.max(1)), u64::from(choice.sharded));
            let slice = (pb * p) as f64 / k as f64;
            let grad_slice = (rb * p) as f64 / k as f64;
            let slices = s as f64;
            let step_bwd = if replicated_p > 0 {
                all_reduce((rb * replicated_p) as f64)
            } else {
                0.0
            };
            (
                // One slice's gathered parameters and its full gradient.
                ceil_div((pb + gb) * p, k),
                Comm {
                    micro_fwd: extra_gathers * slices * gather(slice),
                    micro_bwd: slices * (extra_gathers * gather(slice) + gather(grad_slice)),
                    step_bwd,
                    ..none
                },
            )
        }
        // ZeRO-3 inside the node for every micro-batch; the node's gradient shards summed
        // across nodes once a step (a rank's 1/ranks-per-node share, over its NICs' share).
        Strategy::Hsdp => {
            let node = |bytes: f64| m.node_ring_s(bytes, share);
            let shard = (rb * p) as f64 / per_node.max(1) as f64;
            (
                (pb + gb) * p,
                Comm {
                    micro_fwd: extra_gathers * node((pb * p) as f64),
                    micro_bwd: extra_gathers * node((pb * p) as f64) + node((rb * p) as f64),
                    step_bwd: 2.0 * m.replica_ring_s(shard, share),
                    ..none
                },
            )
        }
    };
    // Offloaded parameters are fetched from host memory for every forward and backward (each
    // use), into a device buffer of this rank's part; the fetches overlap compute like the
    // collectives do (a copy engine beside the kernels), in line on CPUs.
    // Copies over the host link every micro-batch: a streamed gradient shard after the
    // backward, an offloaded compute copy before each use. The executor makes them in line
    // (no copy stream yet), so none of their time hides behind compute.
    let mut fetched = 0;
    let mut host_micro_s = 0.0;
    if !choice.offload.is_none() && streamed > 0 {
        host_micro_s += m.host_copy_s((gb * streamed) as f64);
    }
    if choice.offload == Offload::Param {
        host_micro_s += 2.0 * extra_gathers * m.host_copy_s((pb * params_held) as f64);
        fetched = pb * params_held;
    }
    // A split op runs its matmuls slice by slice: k smaller matmuls instead of one, forward and
    // backward. A calibration prices the k slices from its `linear/split` curve (slices timed
    // as the trainer runs them, narrowing and summing included) or, without one, from the plain
    // linear curve; otherwise each slice costs a launch.
    let split_s = match m.calibration.as_ref().filter(|_| base.splittable) {
        Some(cal) if choice.split > 1 => {
            let k = f64::from(choice.split);
            cal.kernel_s("linear/split", base.work / k)
                .map_or((1.0 + LINEAR_BWD_FACTOR) * split_launches, |(f, b)| {
                    (k * (f + b) - base.fwd_s - base.bwd_s).max(0.0)
                })
        }
        _ => (1.0 + LINEAR_BWD_FACTOR) * split_launches,
    };
    let a = f64::from(base.accumulation.max(1));
    // The per-parameter passes around the kernels: memory-bound over the whole parameter, every
    // micro-batch whatever the strategy — each one touches every weight and gradient then (the
    // weights cast or gathered for compute, the gradient accumulated or cast and scaled for its
    // reduce-scatter). The published runs, all sharded, cannot tell the strategies' shares
    // apart, so one rule prices them all.
    let passes = m.streamed_s(m.param_pass_bytes * base.params as f64);
    let compute = a * (base.fwd_s + base.bwd_s + split_s + passes);
    // Each micro-batch's collectives overlap its own compute; the once-a-step ones overlap
    // the first forward (gathers) or the last backward (gradient syncs) beside that
    // micro-batch's own. With one micro-batch this is the plain per-op overlap.
    let exposed = if m.overlap {
        let hidden = |comm: f64, compute: f64| (comm - compute).max(0.0);
        (a - 1.0) * (hidden(comm.micro_fwd, base.fwd_s) + hidden(comm.micro_bwd, base.bwd_s))
            + hidden(comm.micro_fwd + comm.step_fwd, base.fwd_s)
            + hidden(comm.micro_bwd + comm.step_bwd, base.bwd_s)
    } else {
        comm.total(a)
    };
    OpCost {
        persistent_bytes: persistent,
        transient_bytes: param_transient + fetched + base.working_bytes,
        host_bytes: host,
        compute_s: compute,
        comm_s: comm.total(a) + a * host_micro_s,
        exposed_comm_s: exposed + a * host_micro_s,
        optimizer_s: match &m.calibration {
            _ if updated == 0 => 0.0,
            // Once a step, after the last backward: this rank's gradients to the host, the
            // AdamW step on its CPU cores, the updated weights back (an offloaded compute copy
            // is updated in place on the host).
            _ if !choice.offload.is_none() => {
                let back = if choice.offload == Offload::Opt {
                    m.host_copy_s((pb * updated) as f64)
                } else {
                    0.0
                };
                m.host_copy_s((gb * stepped) as f64) + host_adam_s(base, choice, m) + back
            }
            Some(cal) => calibrated_optimizer_s(cal, base, choice, m),
            None => m.streamed_s((OPTIMIZER_BYTES_PER_PARAM * updated) as f64),
        },
    }
}

/// One op's collective time in a step, split by phase and by how often it runs.
#[derive(Debug, Clone, Copy, Default)]
struct Comm {
    /// Per micro-batch, in its forward / backward.
    micro_fwd: f64,
    micro_bwd: f64,
    /// Once a step: before the first forward / after the last backward.
    step_fwd: f64,
    step_bwd: f64,
}

impl Comm {
    fn total(&self, accumulation: f64) -> f64 {
        accumulation * (self.micro_fwd + self.micro_bwd) + self.step_fwd + self.step_bwd
    }
}

/// Measured optimizer time of one op's tensors on one rank, unit by unit as the trainer
/// updates them ([`Choice::units`]): each unit whole or as this rank's share.
/// The host's AdamW step of an offloaded op, tensor by tensor at the CPU cores' rate. A
/// calibrated optimizer curve carries each tensor's fixed cost (below its range, its smallest
/// step's time); the host's step pays it too, or a small tensor (a LayerNorm's weight and bias)
/// would look cheaper to update on the host than where it is.
fn host_adam_s(base: &OpBase, choice: Choice, m: &Machine) -> f64 {
    let (n, per_node) = (u64::from(m.ranks.max(1)), u64::from(m.ranks_per_node));
    let fixed = m.calibration.as_ref().map_or(0.0, |cal| cal.optimizer_s(1));
    base.units(choice)
        .map(|u| {
            u.holding
                .updated(u.numel, u.holding.shard_ranks(n, per_node))
        })
        .filter(|&updated| updated > 0)
        .map(|updated| (updated as f64 / m.cpu_adam_params_per_s.max(1.0)).max(fixed))
        .sum()
}

fn calibrated_optimizer_s(cal: &Calibration, base: &OpBase, choice: Choice, m: &Machine) -> f64 {
    let (n, per_node) = (u64::from(m.ranks.max(1)), u64::from(m.ranks_per_node));
    base.units(choice)
        .map(|u| {
            let over = u.holding.shard_ranks(n, per_node);
            cal.optimizer_s(u.holding.updated(u.numel, over))
        })
        .sum()
}

/// Every choice the planner may make for an op on `m`: `None` for parameter-free ops; DP,
/// ZeRO-1/2/3 otherwise, and HSDP where the ranks span several nodes; and for splittable ops
/// ZeRO-3 split into `k` = 2, 4, … ≤ `max_split` slices with 1..=k of them sharded.
pub fn choices(base: &OpBase, m: &Machine, max_split: u32) -> Vec<Choice> {
    if base.params == 0 {
        return vec![Choice::NONE];
    }
    let mut out = vec![
        Choice::DP,
        Choice::plain(Strategy::Zero1),
        Choice::plain(Strategy::Zero2),
        Choice::zero3(1, 1),
    ];
    if m.hybrid() {
        out.push(Choice::plain(Strategy::Hsdp));
    }
    if m.offers_offload() {
        let unsplit: Vec<Choice> = out.clone();
        for c in unsplit {
            out.extend(
                [Offload::Opt, Offload::Param]
                    .into_iter()
                    .filter(|&o| offload_applies(c.strategy, o))
                    .map(|o| c.offloaded(o)),
            );
        }
    }
    if base.splittable {
        let mut k = 2;
        while k <= max_split {
            out.extend((1..=k).map(|s| Choice::zero3(k, s)));
            k *= 2;
        }
    }
    out
}

/// Whether `offload` combines with `strategy`: optimizer state may leave the device under
/// any strategy that owns parameters; the compute copy only where each rank updates exactly
/// what it holds (dp, zero3, hsdp) — under zero1/zero2 the updated shard would have to be
/// gathered back into a host copy.
pub fn offload_applies(strategy: Strategy, offload: Offload) -> bool {
    match offload {
        Offload::None => true,
        _ if strategy == Strategy::None => false,
        Offload::Opt => true,
        Offload::Param => matches!(strategy, Strategy::Dp | Strategy::Zero3 | Strategy::Hsdp),
    }
}

/// How many ops use each op's parameters: 1 for the owner plus its tied users.
pub fn parameter_uses(model: &ModelSpec) -> Vec<u32> {
    let mut uses: Vec<u32> = model
        .ops
        .iter()
        .map(|o| u32::from(ModelSpec::op_param_count(o) > 0))
        .collect();
    for p in model.ops.iter().flat_map(|op| &op.params) {
        if let Some(j) = model.tie_owner(p) {
            uses[j] += 1;
        }
    }
    uses
}

/// Per-sample bytes each op reads: the summed outputs of its inputs.
pub fn input_bytes_per_sample(model: &ModelSpec) -> Vec<u64> {
    let index = model.op_index();
    model
        .ops
        .iter()
        .map(|op| {
            op.inputs
                .iter()
                .filter_map(|id| index.get(id.as_str()))
                .map(|&j| model.ops[j].output_bytes_per_sample)
                .sum()
        })
        .collect()
}

/// The base facts of every op at micro-batch `batch`.
pub fn op_bases(model: &ModelSpec, m: &Machine, batch: u64) -> Vec<OpBase> {
    OpGraph::of(model).bases(model, m, batch)
}

/// What the graph says of each op whatever the batch: who uses its parameters, what flows
/// into it. Worth keeping when pricing many batch sizes (finding them means name lookups).
#[derive(Debug, Clone)]
pub struct OpGraph {
    inputs: Vec<u64>,
    /// Each op's fraction of its block's parameters (1 outside blocks).
    block_share: Vec<f64>,
    owned: Vec<Owned>,
}

impl OpGraph {
    pub fn of(model: &ModelSpec) -> OpGraph {
        let mut block_params: std::collections::HashMap<u32, u64> = Default::default();
        for op in &model.ops {
            if let Some(b) = op.block {
                *block_params.entry(b).or_default() += ModelSpec::op_param_count(op);
            }
        }
        let block_share = model
            .ops
            .iter()
            .map(|op| match op.block.and_then(|b| block_params.get(&b)) {
                Some(&total) if total > 0 => ModelSpec::op_param_count(op) as f64 / total as f64,
                _ => 1.0,
            })
            .collect();
        OpGraph {
            inputs: input_bytes_per_sample(model),
            block_share,
            owned: model
                .ops
                .iter()
                .zip(parameter_uses(model))
                .map(|(op, uses)| Owned::of(op, uses))
                .collect(),
        }
    }

    /// The base facts of every op of `model` (the one this was made of) at `batch`.
    pub fn bases(&self, model: &ModelSpec, m: &Machine, batch: u64) -> Vec<OpBase> {
        model
            .ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                OpBase::new(
                    op,
                    kernel_key(model, op),
                    self.inputs[i],
                    m,
                    batch,
                    &model.config,
                    &self.owned[i],
                )
            })
            .zip(&self.block_share)
            .map(|(mut base, &share)| {
                if m.block_collectives {
                    base.latency_share = share;
                }
                base
            })
            .collect()
    }
}

/// Price `bases` for `accumulation` micro-batches per optimizer step.
pub fn set_accumulation(bases: &mut [OpBase], accumulation: u64) {
    let a = u32::try_from(accumulation.max(1)).unwrap_or(u32::MAX);
    for b in bases {
        b.accumulation = a;
    }
}

/// Whether the op owns parameters (and so has a sharding choice).
pub fn owns_params(op: &OpSpec) -> bool {
    ModelSpec::op_param_count(op) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine with round numbers: 8 ranks, 100 TFLOP/s, 1 TB/s memory, 100 GB/s links,
    /// 10 µs latency, 5 µs launches.
    fn machine(ranks: u32) -> Machine {
        Machine {
            ranks,
            flops_per_s: 100e12,
            memory_bytes_per_s: 1e12,
            nodes: 1,
            link_bytes_per_s: 100e9,
            link_latency_s: 10e-6,
            cross_node_latency_s: 10e-6,
            ranks_per_node: ranks,
            node_link_bytes_per_s: 100e9,
            replica_link_bytes_per_s: 100e9,
            collective_base_s: 0.0,
            reduce_bytes: 2,
            efficiency: Efficiencies::GENERIC,
            block_collectives: false,
            param_pass_bytes: 0.0,
            launch_s: 5e-6,
            overhead_bytes: 0,
            compute_dtype: "bf16",
            precision: Precision::MIXED_BF16,
            model_activation_bytes: 2,
            overlap: true,
            calibration: None,
            host_link_bytes_per_s: 0.0,
            cpu_adam_params_per_s: 0.0,
            host_budget_bytes: 0,
        }
    }

    /// [`machine`] with a host: 25 GB/s each way, 1 G AdamW updates/s, 100 GB of budget.
    fn with_host(mut m: Machine) -> Machine {
        m.host_link_bytes_per_s = 25e9;
        m.cpu_adam_params_per_s = 1e9;
        m.host_budget_bytes = 100_000_000_000;
        m
    }

    /// On a calibrated layout a tiny tensor's host AdamW step pays the curve's fixed cost, as
    /// its device step does: offloading a LayerNorm never looks like it saves time.
    #[test]
    fn a_small_tensor_offloaded_pays_the_optimizers_fixed_cost() {
        let m = calibrated(with_host(machine(1)));
        let base = linear_base(768);
        let kept = price(&base, Choice::DP, &m).optimizer_s;
        let off = price(&base, Choice::DP.offloaded(Offload::Opt), &m).optimizer_s;
        assert!((kept - 50e-6).abs() < 1e-12, "{kept}");
        assert!(off >= kept, "offloaded {off} s < kept {kept} s");
        // A large tensor is priced at the host's rate, fixed cost long passed.
        let big = linear_base(1 << 24);
        let off = price(&big, Choice::DP.offloaded(Offload::Opt), &m).optimizer_s;
        let adam = (1u64 << 24) as f64 / 1e9;
        assert!(off > adam && off < adam + 0.1, "{off}");
    }

    #[test]
    fn offload_moves_state_to_the_host_byte_for_byte() {
        let m = with_host(machine(4));
        let base = linear_base(1 << 20);
        let p = (1u64 << 20) as f64;
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ] {
            let plain = price(&base, Choice::plain(strategy), &m);
            let opt = price(&base, Choice::plain(strategy).offloaded(Offload::Opt), &m);
            let updated = base
                .units(Choice::plain(strategy))
                .map(|u| u.holding.updated(u.numel, 4))
                .sum::<u64>();
            // The device lets go of the fp32 master and moments (12 bytes per parameter it
            // updates) and, where gradients are sharded every micro-batch, of the gradient
            // shard too (2); the host takes master, moments and an fp32 gradient (16).
            let streams = matches!(strategy, Strategy::Zero2 | Strategy::Zero3);
            let freed = 12 * updated + if streams { 2 * updated } else { 0 };
            assert_eq!(
                plain.persistent_bytes - opt.persistent_bytes,
                freed,
                "{strategy:?}"
            );
            assert_eq!(opt.host_bytes, 16 * updated, "{strategy:?}");
            assert_eq!(plain.host_bytes, 0);
            // Once a step: the gradient out (2 B) unless it streamed, AdamW on the CPU,
            // weights back (2 B).
            let copy = (2 * updated) as f64 / 25e9 + 5e-6;
            let out = if streams { 0.0 } else { copy };
            let want = out + updated as f64 / 1e9 + copy;
            assert!((opt.optimizer_s - want).abs() < 1e-12, "{strategy:?}");
            assert!(opt.optimizer_s > plain.optimizer_s);
            // A streamed gradient crosses the host link every micro-batch, beside the backward.
            let every = if streams { copy } else { 0.0 };
            assert!(
                (opt.comm_s - plain.comm_s - every).abs() < 1e-12,
                "{strategy:?}"
            );
            assert_eq!(opt.transient_bytes, plain.transient_bytes);
        }
        // offload-param: the compute copy (2 B per held parameter) moves too, and is fetched
        // for the forward and the backward; on one rank it is the whole tensor.
        let one = with_host(machine(1));
        let dp = price(&base, Choice::DP, &one);
        let param = price(&base, Choice::DP.offloaded(Offload::Param), &one);
        assert_eq!(dp.persistent_bytes - param.persistent_bytes, 14 * (1 << 20));
        assert_eq!(param.host_bytes, 18 * (1 << 20));
        assert_eq!(param.transient_bytes, dp.transient_bytes + 2 * (1 << 20));
        let fetch = 2.0 * p / 25e9 + 5e-6;
        assert!((param.comm_s - dp.comm_s - 2.0 * fetch).abs() < 1e-12);
    }

    #[test]
    fn offload_is_offered_only_with_a_host_and_only_where_it_applies() {
        let base = linear_base(1 << 20);
        let none = choices(&base, &machine(4), 4);
        assert!(none.iter().all(|c| c.offload.is_none()));
        let some = choices(&base, &with_host(machine(4)), 4);
        let offloaded: Vec<String> = some
            .iter()
            .filter(|c| !c.offload.is_none())
            .map(Choice::label)
            .collect();
        assert_eq!(
            offloaded,
            [
                "dp+offload-opt",
                "dp+offload-param",
                "zero1+offload-opt",
                "zero2+offload-opt",
                "zero3+offload-opt",
                "zero3+offload-param"
            ]
        );
        for c in &some {
            assert_eq!(Choice::parse(&c.label()), Some(*c), "{}", c.label());
        }
        assert_eq!(Choice::parse("zero3+offload"), None);
        assert_eq!(Choice::parse("dp+none"), None);
        let why = machine(4)
            .refuses_choice(Choice::DP.offloaded(Offload::Opt))
            .unwrap();
        assert!(why.contains("no `host` figures"), "{why}");
    }

    fn linear_base(params: u64) -> OpBase {
        OpBase {
            params,
            uses: 1,
            splittable: true,
            fwd_s: 1e-3,
            bwd_s: 2e-3,
            saved_bytes: 0,
            working_bytes: 0,
            output_bytes: 0,
            work: 1e9,
            tensors: [
                ParamTensor {
                    numel: params,
                    cut: true,
                },
                ParamTensor::default(),
            ],
            accumulation: 1,
            latency_share: 1.0,
        }
    }

    #[test]
    fn parameter_passes_run_every_micro_batch_under_every_strategy() {
        let mut m = machine(8);
        m.param_pass_bytes = PARAM_PASS_BYTES;
        let pass_s = m.streamed_s(PARAM_PASS_BYTES * 50e6);
        let four = OpBase {
            accumulation: 4,
            ..linear_base(50_000_000)
        };
        let mut none = m.clone();
        none.param_pass_bytes = 0.0;
        // Four micro-batches: four passes, whether the gradient is reduced every micro-batch
        // (zero2, zero3, hsdp) or accumulated and synchronised once (dp, zero1).
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
            Strategy::Hsdp,
        ] {
            let with = price(&four, Choice::plain(strategy), &m).compute_s;
            let without = price(&four, Choice::plain(strategy), &none).compute_s;
            assert!(
                ((with - without) - 4.0 * pass_s).abs() < 1e-12,
                "{strategy:?}: {} passes, expected 4",
                (with - without) / pass_s
            );
        }
        // An op without parameters makes none.
        let act = OpBase {
            params: 0,
            tensors: [ParamTensor::default(); 2],
            ..four
        };
        assert_eq!(
            price(&act, Choice::plain(Strategy::None), &m).compute_s,
            price(&act, Choice::plain(Strategy::None), &none).compute_s
        );
    }

    #[test]
    fn accumulation_repeats_compute_and_the_per_micro_batch_collectives_only() {
        let mut m = machine(8);
        m.overlap = false;
        let one = linear_base(50_000_000);
        let four = OpBase {
            accumulation: 4,
            ..one.clone()
        };
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ] {
            let (c1, c4) = (
                price(&one, Choice::plain(strategy), &m),
                price(&four, Choice::plain(strategy), &m),
            );
            assert!(
                (c4.compute_s - 4.0 * c1.compute_s).abs() < 1e-15,
                "{strategy:?}"
            );
            assert_eq!(c4.persistent_bytes, c1.persistent_bytes, "{strategy:?}");
            assert_eq!(
                c4.optimizer_s, c1.optimizer_s,
                "the optimizer runs once a step"
            );
            let (rs, ag, ar) = (
                m.reduce_scatter_s(2.0 * 50e6),
                m.all_gather_s(2.0 * 50e6),
                m.all_reduce_s(2.0 * 50e6),
            );
            let want = match strategy {
                // Gradients synced once a step, after the last micro-batch.
                Strategy::Dp => ar,
                Strategy::Zero1 => ag + rs,
                // Reduce-scattered every micro-batch; the update gathered once.
                Strategy::Zero2 => ag + 4.0 * rs,
                // Gathered for forward and backward and reduce-scattered, every micro-batch.
                _ => 4.0 * (2.0 * ag + rs),
            };
            assert!(
                (c4.comm_s - want).abs() < 1e-12,
                "{strategy:?}: {} vs {want}",
                c4.comm_s
            );
        }
        // With overlap, a once-a-step sync hides behind one micro-batch's backward only.
        m.overlap = true;
        let d = price(&four, Choice::DP, &m);
        let one_bwd_hides = (m.all_reduce_s(2.0 * 50e6) - one.bwd_s).max(0.0);
        assert!((d.exposed_comm_s - one_bwd_hides).abs() < 1e-15);
    }

    #[test]
    fn memory_matches_the_zero_paper_table() {
        // ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ parameters, N_d = 64 ranks, K = 12.
        let (psi, n) = (7_500_000_000u64, 64u32);
        let m = machine(n);
        let b = linear_base(psi);
        let held = |c| price(&b, c, &m).persistent_bytes;
        assert_eq!(held(Choice::DP), 16 * psi); // 120 GB
        assert_eq!(
            held(Choice::plain(Strategy::Zero1)),
            4 * psi + 12 * psi / 64
        ); // 31.4 GB
        assert_eq!(
            held(Choice::plain(Strategy::Zero2)),
            2 * psi + 14 * psi / 64
        ); // 16.6 GB
        assert_eq!(held(Choice::zero3(1, 1)), 16 * psi / 64); // 1.9 GB
        assert_eq!(16 * psi / 64, 1_875_000_000);
    }

    #[test]
    fn partial_sharding_interpolates_between_dp_and_zero3() {
        let m = machine(8);
        let b = linear_base(8_000);
        // 4 slices, 3 sharded: 2,000 params replicated (16 B each), 6,000 sharded over 8 ranks.
        let c = price(&b, Choice::zero3(4, 3), &m);
        assert_eq!(c.persistent_bytes, 16 * 2_000 + 16 * 6_000 / 8);
        // One slice of bf16 params and its bf16 gradient is gathered at a time.
        assert_eq!(c.transient_bytes, 4 * 8_000 / 4);
        assert_eq!(
            price(&b, Choice::zero3(1, 1), &m).transient_bytes,
            4 * 8_000
        );
        assert_eq!(
            price(&b, Choice::plain(Strategy::Zero2), &m).transient_bytes,
            2 * 8_000
        );
        assert_eq!(price(&b, Choice::DP, &m).transient_bytes, 0);
    }

    #[test]
    fn ring_collectives_follow_alpha_beta() {
        let m = machine(8);
        // 1 GB all-gather over 8 ranks: 7·10 µs + 7/8 · 1e9 / 100e9 s = 70 µs + 8.75 ms.
        assert!((m.all_gather_s(1e9) - (70e-6 + 8.75e-3)).abs() < 1e-12);
        assert!((m.all_reduce_s(1e9) - 2.0 * (70e-6 + 8.75e-3)).abs() < 1e-12);
        assert_eq!(machine(1).all_reduce_s(1e9), 0.0);
    }

    #[test]
    fn zero3_moves_one_and_a_half_times_the_bytes_of_dp() {
        // Bandwidth term only: make latency vanish.
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let b = linear_base(1_000_000_000);
        let dp = price(&b, Choice::DP, &m).comm_s;
        let z1 = price(&b, Choice::plain(Strategy::Zero1), &m).comm_s;
        let z3 = price(&b, Choice::zero3(1, 1), &m).comm_s;
        // DP all-reduces 2 GB of grads: 2 · 7/8 · 2e9 / 100e9 = 35 ms.
        assert!((dp - 0.035).abs() < 1e-12, "{dp}");
        assert!((z1 - dp).abs() < 1e-12);
        assert!((z3 - 1.5 * dp).abs() < 1e-12, "{z3}");
        // Splitting keeps the volume; each slice pays the latency again.
        let mut m2 = machine(8);
        m2.link_bytes_per_s = f64::INFINITY;
        let one = price(&b, Choice::zero3(1, 1), &m2).comm_s;
        let four = price(&b, Choice::zero3(4, 4), &m2).comm_s;
        assert!((one - 3.0 * 70e-6).abs() < 1e-12);
        assert!((four - 4.0 * one).abs() < 1e-12);
    }

    #[test]
    fn communication_hides_behind_the_ops_compute() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        // 10M params: DP all-reduce of 20 MB = 2·7/8·20e6/100e9 = 350 µs < 2 ms backward.
        let small = linear_base(10_000_000);
        let c = price(&small, Choice::DP, &m);
        assert_eq!(c.exposed_comm_s, 0.0);
        // 1B params: 35 ms of all-reduce against 2 ms backward leaves 33 ms exposed.
        let big = linear_base(1_000_000_000);
        let c = price(&big, Choice::DP, &m);
        assert!(
            (c.exposed_comm_s - 0.033).abs() < 1e-12,
            "{}",
            c.exposed_comm_s
        );
    }

    #[test]
    fn optimizer_step_is_bandwidth_bound_over_the_local_shard() {
        let m = machine(8);
        let b = linear_base(8_000_000);
        // DP updates all 8M params: 28 B each at 0.8 TB/s = 280 µs.
        let dp = price(&b, Choice::DP, &m).optimizer_s;
        assert!((dp - 8e6 * 28.0 / 0.8e12).abs() < 1e-15);
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((z3 - dp / 8.0).abs() < 1e-15);
    }

    #[test]
    fn compute_time_uses_efficiency_and_launches() {
        let m = machine(8);
        // 1 TFLOP at 70 % of 100 TFLOP/s = 1/70 s, plus one 5 µs launch.
        assert!((m.matmul_s(1e12, 4096.0, 1) - (1.0 / 70.0 + 5e-6)).abs() < 1e-12);
        // A narrow GEMM (256 features) with a 256-feature half width runs at half speed.
        let mut narrow = machine(8);
        narrow.efficiency.matmul_half_width = 256.0;
        assert!((narrow.matmul_s(1e12, 256.0, 1) - (2.0 / 70.0 + 5e-6)).abs() < 1e-12);
        // 1 GB through memory at 80 % of 1 TB/s = 1.25 ms, plus a launch.
        assert!((m.memory_s(1e9) - (1.25e-3 + 5e-6)).abs() < 1e-12);
        // Splitting into 4 slices adds 3 launches to forward and 6 to backward.
        let b = linear_base(1000);
        let one = price(&b, Choice::zero3(1, 1), &m).compute_s;
        let four = price(&b, Choice::zero3(4, 4), &m).compute_s;
        assert!((four - one - 9.0 * 5e-6).abs() < 1e-12);
    }

    fn calibrated(mut m: Machine) -> Machine {
        use crate::cluster::calibration::{CurvePoint, OptimizerPoint};
        let pt = |work: f64, fwd_s: f64, bwd_s: f64| CurvePoint { work, fwd_s, bwd_s };
        m.calibration = Some(Arc::new(Calibration {
            measured_at: "2026-11-22T09:00:00Z".into(),
            device: "test".into(),
            command: "test".into(),
            ranks: 8,
            // 1 GFLOP takes 10 ms forward, 1 MFLOP 1 ms: small matmuls are 100× less efficient.
            kernels: std::collections::BTreeMap::from([(
                "linear".to_string(),
                vec![pt(1e6, 1e-3, 2e-3), pt(1e9, 1e-2, 2e-2)],
            )]),
            // 50 µs for a tensor of up to 1,000 elements, 1 ns per element from 1M up.
            optimizer: vec![
                OptimizerPoint {
                    params: 1e3,
                    seconds: 50e-6,
                },
                OptimizerPoint {
                    params: 1e6,
                    seconds: 1e-3,
                },
            ],
            step_overhead_s: 2e-3,
            cpu_steal_fraction: None,
            collectives: vec![],
        }));
        m
    }

    #[test]
    fn calibrated_curves_price_kernels_slices_and_the_optimizer() {
        let m = calibrated(machine(8));
        let mut b = linear_base(8_000_000);
        b.work = 1e9;
        (b.fwd_s, b.bwd_s) = m
            .calibration
            .as_ref()
            .and_then(|c| c.kernel_s("linear", b.work))
            .unwrap();
        assert_eq!((b.fwd_s, b.bwd_s), (1e-2, 2e-2));
        // Four slices of 250 MFLOP: log-log interpolation between the two points gives
        // 10 ms · (1/4)^(1/3) each forward, twice that backward.
        let slice_fwd = 1e-2 * 0.25f64.powf(1.0 / 3.0);
        let one = price(&b, Choice::zero3(1, 1), &m).compute_s;
        let four = price(&b, Choice::zero3(4, 4), &m).compute_s;
        assert!((one - 3e-2).abs() < 1e-12, "{one}");
        assert!((four - 4.0 * 3.0 * slice_fwd).abs() < 1e-9, "{four}");
        // The optimizer follows its curve by tensor size: dp updates the 8M weight (1 ms per
        // 1M beyond the curve's end), zero3 its 1M share, zero3/4:4 four shares of 250k, each
        // log-log between the points: 50 µs · 20^(log(250)/log(1000)).
        let dp = price(&b, Choice::DP, &m).optimizer_s;
        assert!((dp - 8e-3).abs() < 1e-12, "{dp}");
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((z3 - 1e-3).abs() < 1e-12, "{z3}");
        let quarter = 50e-6 * 20f64.powf(250f64.ln() / 1000f64.ln());
        let z3_split = price(&b, Choice::zero3(4, 4), &m).optimizer_s;
        assert!((z3_split - 4.0 * quarter).abs() < 1e-12, "{z3_split}");
        // Two of four slices sharded: two shares and two whole slices of 2M.
        let half = price(&b, Choice::zero3(4, 2), &m).optimizer_s;
        assert!(
            (half - (2.0 * quarter + 2.0 * 2e-3)).abs() < 1e-12,
            "{half}"
        );
        // A `linear/split` curve (slices timed as the trainer runs them) prices the slices
        // instead of the plain linear curve: 4 slices of 250 MFLOP at 4 ms + 8 ms each.
        let mut ms = m.clone();
        if let Some(c) = ms.calibration.as_mut().map(std::sync::Arc::make_mut) {
            c.kernels.insert(
                "linear/split".into(),
                vec![crate::cluster::calibration::CurvePoint {
                    work: 1e8,
                    fwd_s: 1e-3,
                    bwd_s: 2e-3,
                }],
            );
        }
        let four = price(&b, Choice::zero3(4, 4), &ms).compute_s;
        assert!(
            (four - 4.0 * (1e-3 * 2.5 + 2e-3 * 2.5)).abs() < 1e-12,
            "{four}"
        );
        assert_eq!(price(&b, Choice::zero3(1, 1), &ms).compute_s, one);
        assert_eq!(m.step_overhead_s(), 2e-3);
        assert!(m.timing_source().starts_with("calibrated 2026-11-22"));
        assert!(machine(8).timing_source().contains("not calibrated"));
    }

    #[test]
    fn without_overlap_all_communication_is_exposed() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let small = linear_base(10_000_000);
        assert_eq!(price(&small, Choice::DP, &m).exposed_comm_s, 0.0);
        m.overlap = false;
        let c = price(&small, Choice::DP, &m);
        assert!((c.exposed_comm_s - 350e-6).abs() < 1e-12 && c.exposed_comm_s == c.comm_s);
    }

    #[test]
    fn kernel_keys_name_the_kind_and_the_activation_as_model_json_does() {
        use crate::model::Activation;
        // tiny-llama's activations are gated, tiny-gpt2's plain.
        for name in ["tiny-llama", "tiny-gpt2"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(format!("sample-models/{name}.json"));
            let mut model = crate::model::read_model(&path).unwrap();
            for act in [
                Activation::Gelu,
                Activation::GeluTanh,
                Activation::Relu,
                Activation::Silu,
            ] {
                assert_eq!(serde_json::to_value(act).unwrap(), act.as_str());
                model.config.activation = act;
                for op in &model.ops {
                    let want = match op.kind {
                        OpKind::Activation if op.inputs.len() == 2 => {
                            format!("activation/{}_gated", act.as_str())
                        }
                        OpKind::Activation => format!("activation/{}", act.as_str()),
                        kind => serde_json::to_value(kind).unwrap().as_str().unwrap().into(),
                    };
                    assert_eq!(kernel_key(&model, op), want);
                }
            }
        }
    }

    #[test]
    fn a_split_weight_is_held_as_slices_and_its_bias_follows_the_majority() {
        let holdings = |c: Choice, cut: bool| c.units(800, cut).collect::<Vec<Unit>>();
        let unit = |slice, numel, holding| Unit {
            slice,
            numel,
            holding,
        };
        use Holding::{Replicated as R, Zero3 as Z};
        assert_eq!(
            holdings(Choice::zero3(4, 1), true),
            vec![
                unit(Some((0, 4)), 200, Z),
                unit(Some((1, 4)), 200, R),
                unit(Some((2, 4)), 200, R),
                unit(Some((3, 4)), 200, R)
            ]
        );
        // The bias: replicated under a sharded minority, sharded from half up.
        assert_eq!(
            holdings(Choice::zero3(4, 1), false),
            vec![unit(None, 800, R)]
        );
        assert_eq!(
            holdings(Choice::zero3(4, 2), false),
            vec![unit(None, 800, Z)]
        );
        assert_eq!(
            holdings(Choice::zero3(1, 1), true),
            vec![unit(None, 800, Z)]
        );
        assert_eq!(holdings(Choice::DP, true), vec![unit(None, 800, R)]);
        // State per rank: whole, or a share padded to the ranks (7 elements over 2: 4 each).
        let fp32 = Precision::FP32;
        assert_eq!(Holding::Replicated.state_bytes(7, 2, fp32), 16 * 7);
        assert_eq!(Holding::Zero1.state_bytes(7, 2, fp32), 8 * 7 + 8 * 4);
        assert_eq!(Holding::Zero2.state_bytes(7, 2, fp32), 4 * 7 + 12 * 4);
        assert_eq!(Holding::Zero3.state_bytes(7, 2, fp32), 16 * 4);
    }

    #[test]
    fn a_split_ops_state_is_priced_unit_by_unit_as_the_trainer_holds_it() {
        let m = machine(8);
        // A 1000-element weight cut in 4 and a 10-element bias, in bf16 mixed (16 B each).
        let b = OpBase {
            tensors: [
                ParamTensor {
                    numel: 1000,
                    cut: true,
                },
                ParamTensor {
                    numel: 10,
                    cut: false,
                },
            ],
            params: 1010,
            ..linear_base(1010)
        };
        // 1 of 4 slices sharded: one share of 250 (32 each) and three whole slices; the bias
        // whole. Not 16 · 757.5 + 16 · 252.5 / 8, the sharded fraction of all parameters.
        let one = price(&b, Choice::zero3(4, 1), &m).persistent_bytes;
        assert_eq!(one, 16 * 32 + 16 * 3 * 250 + 16 * 10);
        // 2 of 4: the bias is sharded too (10 over 8 ranks: 2 each).
        let two = price(&b, Choice::zero3(4, 2), &m).persistent_bytes;
        assert_eq!(two, 16 * 2 * 32 + 16 * 2 * 250 + 16 * 2);
    }

    #[test]
    fn fp32_training_doubles_bf16_activations_but_not_ids_log_sum_exp_or_log_probabilities() {
        let model = sample("tiny-gpt2");
        let mut m = machine(2);
        m.precision = Precision::FP32;
        assert_eq!(m.model_activation_bytes, 2);
        let bases = op_bases(&model, &m, 1);
        let c = &model.config;
        for (op, base) in model.ops.iter().zip(&bases) {
            let saved = op.saved_bytes_per_sample;
            let want = match op.kind {
                // 8-byte token ids.
                OpKind::Embedding => c.seq_len * 8,
                // Inputs and output doubled, one fp32 log-sum-exp per row and head as it is.
                OpKind::Attention => {
                    2 * (saved - c.heads * c.seq_len * 4) + c.heads * c.seq_len * 4
                }
                OpKind::CrossEntropy => saved,
                _ => 2 * saved,
            };
            assert_eq!(base.saved_bytes, want, "{}", op.id);
        }
    }

    #[test]
    fn choices_cover_the_osdp_space() {
        let b = linear_base(1000);
        let m = machine(8);
        let c = choices(&b, &m, 4);
        // dp, zero1, zero2, zero3; then k = 2 with 1..=2 sharded, k = 4 with 1..=4.
        assert_eq!(c.len(), 4 + 2 + 4);
        assert!(c.contains(&Choice::zero3(4, 3)));
        let norm = OpBase {
            splittable: false,
            ..linear_base(1000)
        };
        assert_eq!(choices(&norm, &m, 8).len(), 4);
        let free = OpBase {
            params: 0,
            ..linear_base(0)
        };
        assert_eq!(choices(&free, &m, 8), vec![Choice::NONE]);
    }

    fn sample(name: &str) -> ModelSpec {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(format!("sample-models/{name}.json"));
        crate::model::read_model(&path).unwrap()
    }

    /// Machines of `nodes` × 8 GPUs with a layout's links: NVLink 370 GB/s and 10 µs inside a
    /// node; between nodes `nics` NICs of 46 GB/s and 15 µs.
    fn cluster(nodes: u32, nics: f64) -> Machine {
        let text = format!(
            r#"{{"version": 1, "name": "t", "description": "t", "nodes": {nodes}, "gpus_per_node": 8,
            "device": {{"kind": "gpu", "model": "NVIDIA H100 80GB HBM3",
              "memory_gib": {{"value": 80, "source": "s"}},
              "dense_tflops": {{"bf16": {{"value": 989, "source": "s"}}}},
              "memory_bandwidth_gb_per_s": {{"value": 3350, "source": "s"}}}},
            "runtime_overhead_gib": {{"value": 1, "source": "s"}},
            "intra_node": {{"kind": "nvlink", "bus_bandwidth_gb_per_s": {{"value": 370, "source": "s"}},
              "latency_us": {{"value": 10, "source": "s"}}}},
            "inter_node": {{"kind": "infiniband", "bus_bandwidth_gb_per_s": {{"value": 46, "source": "s"}},
              "latency_us": {{"value": 15, "source": "s"}}, "nics_per_node": {{"value": {nics}, "source": "s"}}}}}}"#
        );
        let layout: Layout = serde_json::from_str(&text).unwrap();
        crate::cluster::validate_layout(&layout).unwrap();
        let model = sample("tiny-gpt2");
        Machine::new(&layout, &model)
    }

    #[test]
    fn a_node_of_nics_keeps_the_ring_at_nvlink_speed_and_only_crossings_pay_network_latency() {
        // 1 GB gathered: with eight 46 GB/s NICs a node sends 368 GB/s, about NVLink's 370,
        // so the bandwidth term hardly moves from 8 to 64 GPUs.
        let bw = |m: &Machine| m.all_gather_s(1e9) - m.all_gather_s(0.0);
        let (one, eight) = (cluster(1, 8.0), cluster(8, 8.0));
        let per_byte = |m: &Machine, n: f64| bw(m) / ((n - 1.0) / n);
        assert!((per_byte(&eight, 64.0) / per_byte(&one, 8.0) - 370.0 / 368.0).abs() < 1e-9);
        // One NIC per node: the ring crawls at 46 GB/s.
        assert!((per_byte(&cluster(8, 1.0), 64.0) - 1e9 / 46e9).abs() < 1e-12);
        // Latency: NCCL's fixed 8.4 µs, then 64 ranks on 8 nodes = 56 steps inside nodes at
        // 10 µs and 7 across at 15 µs.
        let base = NCCL_BASE_LATENCY_S;
        assert!((eight.all_gather_s(0.0) - (base + 56.0 * 10e-6 + 7.0 * 15e-6)).abs() < 1e-12);
        assert!((one.all_gather_s(0.0) - (base + 7.0 * 10e-6)).abs() < 1e-12);
    }

    #[test]
    fn hsdp_holds_a_nodes_share_gathers_over_nvlink_and_syncs_across_nodes_once_a_step() {
        // Two nodes of 8: NVLink 370 GB/s and 10 µs per step; eight 46 GB/s NICs, 15 µs.
        let mut m = cluster(2, 8.0);
        m.overlap = false;
        assert_eq!((m.ranks, m.ranks_per_node, m.nodes), (16, 8, 2));
        // Each of a node's 8 ranks runs its own cross-node ring over one NIC.
        assert!((m.replica_link_bytes_per_s - 46e9).abs() < 1e-3);
        let p = 1_000_000_000u64;
        let mut b = linear_base(p);
        b.accumulation = 4;
        let hsdp = Choice::plain(Strategy::Hsdp);
        let c = price(&b, hsdp, &m);
        // ZeRO's 16 bytes per parameter over the node's 8 ranks, not all 16.
        assert_eq!(c.persistent_bytes, 16 * p / 8);
        assert_eq!(
            c.transient_bytes,
            price(&b, Choice::zero3(1, 1), &m).transient_bytes
        );
        // Per micro-batch two gathers and a reduce-scatter of 2 GB inside the node; once a
        // step an all-reduce of the rank's 1/8 gradient shard over the 2 nodes.
        let base = NCCL_BASE_LATENCY_S;
        let node = base + 7.0 * 10e-6 + 7.0 / 8.0 * 2e9 / 370e9;
        let across = 2.0 * (base + 15e-6 + 0.5 * (2e9 / 8.0) / 46e9);
        let want = 4.0 * 3.0 * node + across;
        assert!((c.comm_s - want).abs() < 1e-12, "{} vs {want}", c.comm_s);
        // The optimizer updates the node share.
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((c.optimizer_s - 2.0 * z3).abs() < 1e-15);
        // Offered, and runnable, only where the ranks span nodes.
        assert!(choices(&b, &m, 1).contains(&hsdp));
        assert_eq!(m.refuses(Strategy::Hsdp), None);
        let one = cluster(1, 8.0);
        assert!(!choices(&b, &one, 8).contains(&hsdp));
        let why = one.refuses(Strategy::Hsdp).unwrap();
        assert!(why.contains("one node"), "{why}");
        assert_eq!(one.refuses(Strategy::Zero3), None);
    }

    #[test]
    fn a_blocks_ops_share_one_collective_latency_on_gpus() {
        let m = cluster(8, 8.0);
        assert!(m.block_collectives);
        let model = sample("gpt2");
        let bases = op_bases(&model, &m, 1);
        // Per block, the shares of the ops owning parameters add up to one latency.
        let block0: f64 = model
            .ops
            .iter()
            .zip(&bases)
            .filter(|(o, _)| o.block == Some(0) && owns_params(o))
            .map(|(_, b)| b.latency_share)
            .sum();
        assert!((block0 - 1.0).abs() < 1e-12, "{block0}");
        // The embedding, outside blocks, pays a whole one.
        assert_eq!(bases[0].latency_share, 1.0);
    }

    #[test]
    fn causal_flash_attention_skips_the_masked_half() {
        let causal = sample("gpt2");
        let mut full = causal.clone();
        full.config.causal = false;
        let m = cluster(1, 8.0);
        let attention = |model: &ModelSpec| {
            let i = model
                .ops
                .iter()
                .position(|o| o.kind == OpKind::Attention)
                .unwrap();
            let b = &op_bases(model, &m, 8)[i];
            (b.fwd_s - m.launch_s, b.bwd_s - m.launch_s)
        };
        let (c, f) = (attention(&causal), attention(&full));
        assert!((c.0 / f.0 - 0.5).abs() < 1e-9 && (c.1 / f.1 - 0.5).abs() < 1e-9);
        // Backward: 2.5× the forward's FLOPs at the backward's own efficiency.
        let e = m.efficiency;
        let want = ATTENTION_BWD_FACTOR * e.attention_forward / e.attention_backward;
        assert!((c.1 / c.0 - want).abs() < 1e-9);
    }

    #[test]
    fn gradients_travel_in_the_reduce_dtype() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let b = linear_base(1_000_000_000);
        let bf16 = price(&b, Choice::DP, &m).comm_s;
        m.reduce_bytes = 4;
        assert!((price(&b, Choice::DP, &m).comm_s / bf16 - 2.0).abs() < 1e-12);
        // ZeRO-3: two bf16 gathers and an fp32 reduce-scatter = (2 + 2 + 4) / 6 of bf16's.
        let z = |m: &Machine| price(&b, Choice::zero3(1, 1), m).comm_s;
        let fp32 = z(&m);
        m.reduce_bytes = 2;
        assert!((fp32 / z(&m) - 8.0 / 6.0).abs() < 1e-12);
    }
}
