//! The machine the cost model prices on: [`Machine`], a layout's rates resolved once for a
//! model, with the kernel [`Efficiencies`] and the constants behind them; the time of kernels,
//! ring collectives (α–β) and copies to host memory on it.

use std::sync::Arc;

use crate::cluster::{Calibration, DeviceKind, Layout};
use crate::model::ModelSpec;

use super::{Choice, Needs, Precision, Strategy, Target, OPTIMIZER_BYTES_PER_PARAM};

/// Fraction of the dense peak a large matmul reaches where neither the layout nor the GPU's
/// generation says (the CPU layout, unknown GPUs).
pub const MATMUL_EFFICIENCY: f64 = 0.7;
/// Fraction of memory bandwidth element-wise kernels reach, likewise.
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// A ring collective's fixed latency on GPUs besides its per-step ones: NCCL's tuning model
/// (src/graph/tuning.cc) gives 8.4 µs for the Simple protocol large collectives use.
pub const NCCL_BASE_LATENCY_S: f64 = 8.4e-6;
/// NCCL's tree, Simple protocol: the latency of each step up or down the tree, inside a node
/// and across nodes alike (`hwLat[..][Tree][Simple]` = 28 µs, "the latency a 256kB chunk",
/// and `baseLat[Tree][Simple]` = 0, in NCCL 2.8's src/graph/tuning.cc).
pub const NCCL_TREE_HOP_LATENCY_S: f64 = 28e-6;
/// The share of the ring's bus bandwidth NCCL's tuning model gives its tree (`busBw * .92`,
/// same file; its per-channel cap, which needs the channel count, is not priced).
pub const NCCL_TREE_BANDWIDTH: f64 = 0.92;
/// Memory traffic per parameter of every micro-batch outside the kernels the graph lists, on
/// GPUs: casting the gathered weights to the compute dtype, casting and scaling the gradient
/// for its reduction, copying it into and out of the collective's buffers, accumulating it;
/// priced every micro-batch under every strategy, on layouts of two GPUs or more.
/// PyTorch FSDP's mixed-precision passes count 14–30 bytes (a bf16 gradient cast to fp32, read
/// 2 + write 4; divided in place, 8; autocast's weight casts, 6 each way; FSDP2's copy-in and
/// copy-out, 4 each); fitted to 37.6 on the single-node runs of docs/published-runs.md, where it
/// took the held-out error from 0.113 to 0.085 (rms log). The CPU trainer's own passes are in
/// its calibrated step overhead. A published run whose code was read for its own passes (a model
/// kept in 16 bits that only accumulates or unscales gradients) sets `param_pass_bytes` to them
/// (docs/published-runs.md, item 13).
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
/// Host time of one parameter tensor's all-gather under DeepSpeed ZeRO-3 as of mid-2021 (0.3.x,
/// PyTorch 1.8), measured on one node of 8 A100s (the commenter's p4d setup, stated in #1174):
/// 130 µs preparing it ("pre_launch") and 250 µs launching it, between a
/// `torch.cuda.synchronize()` and the next gather
/// (<https://github.com/deepspeedai/DeepSpeed/issues/1069>, comment of 2021-06-21: "all_gathers
/// for one parameter takes about 0.5ms to finish ... pre_launch typically takes 130us, the
/// launch takes 250us about"). Over more ranks, see [`Machine::serial_gather_host_s`].
pub const DS_2021_GATHER_HOST_S: f64 = 380e-6;
/// The rank count [`DS_2021_GATHER_HOST_S`] was measured at.
pub const DS_2021_GATHER_HOST_RANKS: u32 = 8;
/// Backward of a matmul is two matmuls (input and weight gradients).
pub const LINEAR_BWD_FACTOR: f64 = 2.0;
/// Fused attention backward recomputes the scores: about 2.5× its forward.
pub const ATTENTION_BWD_FACTOR: f64 = 2.5;

/// PyTorch's flash backend (FlashAttention-2) on Hopper, bf16, head dim 128, as fractions of
/// the 989.4 TFLOP/s peak, (forward, backward), causal and not: NVIDIA's cudnn-frontend
/// benchmark (benchmark/sdpa_benchmark/benchmark_results.csv at 7606332, its 4k rows: batch 4,
/// 16 heads, clocks locked at 1,980 MHz) 296.52 and 245.18 TFLOP/s causal, 362.03 and 290.47
/// not, counting a causal kernel's FLOPs as half and backward's as 2.5 times forward's, as the
/// cost model does.
pub const HOPPER_SDPA_FLASH_RATES: [(f64, f64); 2] = [
    (296.52 / HOPPER_PEAK_TFLOPS, 245.18 / HOPPER_PEAK_TFLOPS),
    (362.03 / HOPPER_PEAK_TFLOPS, 290.47 / HOPPER_PEAK_TFLOPS),
];
/// cuDNN's attention in the same rows of the same benchmark: 613.49 and 438.45 TFLOP/s causal,
/// 704.41 and 535.06 not. cuDNN 9.19.1 (torch 2.11 bundles 9.19.0) runs the Llama-3.1
/// shape at 4k causal at 591 and 474 on an H200 (the same repository's
/// results/h200_919_only_cudnn/llama3.1_20260227_034703.csv; batch 1, 64 heads): within 4 %
/// forward and 8 % faster backward.
pub const HOPPER_SDPA_CUDNN_RATES: [(f64, f64); 2] = [
    (613.49 / HOPPER_PEAK_TFLOPS, 438.45 / HOPPER_PEAK_TFLOPS),
    (704.41 / HOPPER_PEAK_TFLOPS, 535.06 / HOPPER_PEAK_TFLOPS),
];
/// The H100 and H200 SXM's dense 16-bit peak the rates above are fractions of.
const HOPPER_PEAK_TFLOPS: f64 = 989.4;
/// What FlashAttention 1 costs beyond FlashAttention-2, as the fraction of the 16-bit peak at
/// which each causal attention FLOP's extra runs (forward and backward alike): a stack on
/// flash-attn 1.x ([`Machine::flash_attention_1`]) spends `flops / (this × peak)` more than the
/// fitted FlashAttention-2 figures. Fitted on the two 8k-context rows of the FlashAttention-2
/// paper's Table 1 (arXiv:2307.08691, GPT3-1.3B and 2.7B on 8 × A100 80GB: 170 → 220 and
/// 175 → 225 TFLOP/s from FlashAttention to FlashAttention-2, 16.9 and 30.8 µs a token over 2.8
/// and 4.7 GFLOP of causal attention: 0.535 and 0.489 of the A100's 312 TFLOP/s); the 2.7B
/// 2k-context row, held out, is within 3 % (7.4 µs priced, 7.5 published); the 1.3B
/// 2k-context one is not (4.4 µs priced, 1.7 published). The paper's kernel benchmarks put
/// FlashAttention-2 "around 2× faster than FlashAttention" (Section 4.1); here, where the fitted
/// FlashAttention-2 figures also carry the work around the kernel, FlashAttention 1's
/// attention is priced about 1.6× FlashAttention-2's on an A100. Fitted on A100s only: other
/// GPUs take the same fraction of their own peak.
pub const FLASH_ATTENTION_1_EXTRA_RATE: f64 = 0.511;
/// Element-wise backward reads and writes about twice the forward's bytes.
pub const ELEMENTWISE_BWD_FACTOR: f64 = 2.0;

/// Whether a 16-bit GEMM dimension suits the tensor-core kernels: a multiple of 8 elements
/// (16 bytes; "Tensor Core requirements", NVIDIA's Matrix Multiplication Background guide).
/// The one place the rule is written: pricing, `plan`'s note and `calibrate` all ask here.
pub fn gemm_aligned(dim: i64) -> bool {
    dim % 8 == 0
}

/// The rows osdp-tui's trainer multiplies a 16-bit `[out, in]` weight with on a GPU where `out`
/// is not [`gemm_aligned`]: `out` rounded up to a multiple of 64 with zero rows, where that adds
/// under 1 % (the heads of large vocabularies: GPT-2's 50,257 → 50,304). `None`: as it is.
pub fn padded_gemm_rows(out: i64) -> Option<i64> {
    if gemm_aligned(out) {
        return None;
    }
    let rows = (out + 63) / 64 * 64;
    ((rows - out) * 100 < out).then_some(rows)
}

/// [`padded_gemm_rows`] of a linear's `[out, in]` weight of this shape: the one rule the trainer
/// pads by, `plan`'s note names and the trainer's start-up note lists.
pub fn padded_weight_rows(shape: &[i64]) -> Option<i64> {
    match shape {
        [out, _] => padded_gemm_rows(*out),
        _ => None,
    }
}

/// Rates of the layout the cost model needs, resolved once.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// Whether the compute rate is a guess (a GPU the known-GPU table does not name, priced
    /// at its architecture's stand-in: `cluster::known::local_layout`), not a datasheet's.
    pub rates_guessed: bool,
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
    /// Gradients reduced in flat buffers of this many elements, one collective a buffer
    /// ([`f64::INFINITY`]: every gradient in one buffer, one collective a step), as stacks
    /// that reduce after the whole backward do (DeepSpeed's `allreduce_bucket_size`, apex
    /// DDP's `message_size`, a flattened all-reduce): each op then pays its parameters' share
    /// of one collective latency a buffer instead of its block's. `None` (osdp-tui's trainer,
    /// FSDP): [`Machine::block_collectives`] decides. It sets the share of every collective
    /// an op issues, so it describes plans whose parameters stay whole on every rank (dp,
    /// zero1, zero2: their collectives are the gradients' reduction and the step's gather, both
    /// bucketed alike), not ones that gather parameters per module; the FSDP2 target ignores it.
    pub gradient_bucket_elements: Option<f64>,
    /// Whether all-reduces across nodes may take NCCL's tree ([`Machine::all_reduce_shared_s`]):
    /// GPUs. The CPU trainer's all-reduce is a ring.
    pub nccl_tree: bool,
    /// Bytes moved per parameter every micro-batch outside the listed kernels
    /// ([`PARAM_PASS_BYTES`] on two GPUs or more, 0 on one GPU and on CPUs).
    pub param_pass_bytes: f64,
    /// Whether the GPU runs fused (flash) attention kernels: false on Volta and Turing
    /// ([`crate::cluster::known::FLASH_ATTENTION_SOURCE`]), where a causal attention is priced
    /// at its full FLOPs whatever the model description asks for.
    pub fused_attention: bool,
    /// Where attention is fused, the executor's kernels are FlashAttention 1's (flash-attn
    /// 1.x, as InternLM's 2023 stack ran), slower than the FlashAttention-2 figures the
    /// efficiencies hold ([`FLASH_ATTENTION_1_EXTRA_RATE`]). Set for published runs that name
    /// such a stack; false otherwise.
    pub flash_attention_1: bool,
    /// Where attention is fused, the executor's kernels are cuDNN's (PyTorch 2.11 on Hopper:
    /// [`crate::cluster::known::Generation::cudnn_attention`]), faster than the
    /// FlashAttention-2 kernels the Hopper efficiencies were fitted with: each causal FLOP
    /// costs what the two kernels' published rates differ by less
    /// ([`HOPPER_SDPA_FLASH_RATES`], [`HOPPER_SDPA_CUDNN_RATES`]); the rest of the fitted
    /// figure, the work around the kernel, stays. Off for published runs whose stack predates it.
    pub cudnn_attention: bool,
    /// Where attention is materialised: the executor scales, masks and takes the softmax of
    /// the scores in one kernel (Megatron-LM's `FusedScaleMaskSoftmax`) rather than one
    /// PyTorch op each ([`super::graph::materialised_attention_passes`]).
    pub fused_softmax: bool,
    /// The executor keeps fp32 parameters and computes under `torch.autocast` (PyTorch AMP, as
    /// the Hugging Face Trainer's `--fp16` does without DeepSpeed): the ops on autocast's fp32
    /// list write fp32 and the next matmul casts back. Priced where eager code makes that a
    /// pass of its own: a materialised softmax and what follows it, and `gelu_new`'s `pow`
    /// ([`super::graph::EAGER_GELU_NEW_AUTOCAST_PASSES`]).
    pub autocast: bool,
    /// Bytes the optimizer step moves per updated parameter ([`OPTIMIZER_BYTES_PER_PARAM`] for
    /// a fused AdamW; [`super::precision::HF_TRAINER_STEP_BYTES_PER_PARAM`] for a step made of
    /// one PyTorch op per update term).
    pub optimizer_bytes_per_param: u64,
    /// A recomputed op fetches its parameters again for the recomputation, beside the
    /// forward's and the backward's fetches: sharded ones gathered (as DeepSpeed ZeRO-3 does,
    /// releasing each submodule after every forward, recomputed ones included), offloaded ones
    /// copied from host memory. osdp-tui's trainer does both (`exec::forward` fetches and
    /// releases per op), so the planner prices it: on by default. PyTorch FSDP keeps a unit
    /// unsharded from its pre-backward gather through the recomputation, so the FSDP2 target and
    /// the published FSDP runs price none (docs/collectives.md).
    pub regather_on_recompute: bool,
    /// A recomputed block keeps some of its ops' outputs and recomputes only the rest, as
    /// torchtitan's op-level selective activation checkpointing does (its `_save_list` policy):
    /// every attention's output and every other matmul's (the 1st, 3rd, … of the block's
    /// linears in forward order) are saved for backward; the block's other ops — the even
    /// matmuls, the norms, activations and adds — run again
    /// ([`crate::plan::selectively_saved`]). False for the planner and the trainer, which
    /// recompute whole blocks; set for published runs that ran that policy.
    pub selective_ops: bool,
    /// FSDP2 as PyTorch shipped it in 2024 never resharded the root unit after its forward
    /// (`FSDPState._lazy_init`: "For the root, do not reshard after forward since for training,
    /// the parameters would be freed and all-gathered immediately"; since 2025 only where
    /// `reshard_after_forward` is left to its automatic default): with a unit per block, the ops
    /// outside the blocks are the root's, gathered once a micro-batch and held from the forward
    /// through the backward. Set for published runs whose stack wraps so (torchtitan of 2024);
    /// `osdp_torch.apply_plan` gives every planned module a unit of its own.
    pub fsdp2_root_unsharded: bool,
    /// FSDP2 wraps one unit per block and a root unit of the ops outside them (torchtitan),
    /// rather than a unit per op that owns parameters (`osdp_torch.apply_plan`): what its side
    /// streams hold per collective ([`super::pools::fsdp2_units`]).
    pub fsdp2_block_units: bool,
    /// FSDP2's last block is not resharded after its forward (torchtitan's `apply_fsdp`: "do
    /// not reshard after forward for the last transformer block since FSDP would prefetch it
    /// immediately"): its ops gather once a micro-batch and hold the gathered copy from the
    /// forward through the backward, as the 2024 root does.
    pub fsdp2_last_block_unsharded: bool,
    /// Where the executor frees the logits before the backward (torchtitan's `del pred`), the
    /// loss's input is not live at its backward's peak, only its fp32 copies
    /// ([`Machine::loss_fp32_logit_copies`]) beside the log-probabilities: the loss holds the
    /// larger of the logits with one copy (the forward) and its copies (the backward); with no
    /// copies, the logits alone, as without this flag.
    pub loss_frees_logits: bool,
    /// Parameter tensors of fewer elements stay whole on every rank and are never gathered
    /// (DeepSpeed ZeRO-3's `stage3_param_persistence_threshold`, 1e5 by default: biases and
    /// norm weights); 0 for the trainer. Priced where gathers are serial
    /// ([`Machine::serial_gathers`]), where each gathered tensor costs its own latency.
    pub persistence_threshold: u64,
    /// fp32 copies of the logits the executor holds around the loss beyond the graph's own
    /// (0 for osdp-tui's trainer, whose loss the graph describes). Hugging Face's
    /// `LlamaForCausalLM` of 2023–24 upcasts the logits (`logits.float()`) and copies them
    /// shifted (`logits[..., :-1, :].contiguous()`): 2. Set for published runs that name
    /// such a stack.
    pub loss_fp32_logit_copies: u32,
    /// Where the executor's loss is a chain of PyTorch ops over the logits rather than one
    /// fused log-softmax kernel, the bytes those ops read and write per logit element, forward
    /// and backward (an upcast to fp32, a clone, max, subtract, exp, sum, divide: Megatron-LM's
    /// `vocab_parallel_cross_entropy` on `output.float()` moves 38 and 14): the loss is priced
    /// as those passes at the loss's memory efficiency. `None` for osdp-tui's trainer, whose
    /// loss the graph prices as its fused kernel. Set for published runs whose loss code was
    /// read.
    pub loss_bytes_per_logit: Option<(f64, f64)>,
    /// Where the executor applies rotary embeddings as eager PyTorch ops, their form: each is
    /// priced as the passes its code makes over the queries and keys
    /// ([`super::graph::EagerRotary::passes`]). `None`: inside attention's fused price, or
    /// transformers' form on a model imported with [`crate::model::Kernels::Pytorch`].
    /// osdp-tui's trainer applies them in its attention op; set for published runs whose
    /// stack's code was read.
    pub eager_rotary: Option<super::graph::EagerRotary>,
    /// Parameter all-gathers are issued tensor by tensor, each after a device-wide
    /// synchronisation, as DeepSpeed ZeRO-3 did before its PR #1188 (opened June 2021: "the async
    /// version is not async at all, because each all_gather calls torch.cuda.synchronize()"):
    /// they and their host time ([`Machine::serial_gather_host_s`]) run between the kernels,
    /// none hidden behind compute; so do the gradients' reduce-scatters, tensor by tensor
    /// ([`Machine::serial_reduce_copies_s`]), which the next gather's synchronisation drains.
    /// False for FSDP and osdp-tui's trainer.
    pub serial_gathers: bool,
    /// Where the optimizer state of replicated parameters is sharded over groups of ranks while
    /// their gradients are all-reduced over every rank (InternLM's `HybridZeroOptimizer`):
    /// how, [`Zero1Groups`]. `None`: every rank steps every replicated parameter (DDP).
    pub zero1_groups: Option<Zero1Groups>,
    /// Fixed cost of launching one kernel, seconds.
    pub launch_s: f64,
    pub overhead_bytes: u64,
    /// What the caching allocator reserves beside the compute stream's peak for the target's
    /// collectives ([`super::side_pool_bytes`]): FSDP2's side streams; 0 for the trainer.
    /// Set with the target ([`Machine::set_target`]).
    pub side_pool_bytes: u64,
    /// Which dtype the compute rate is for (for messages).
    pub compute_dtype: &'static str,
    pub precision: Precision,
    /// Bytes of one activation element in the model description's figures.
    pub model_activation_bytes: u64,
    /// Whether collectives run on their own stream beside compute (GPUs); the CPU trainer
    /// runs them in line, so all of their time is exposed.
    pub overlap: bool,
    /// What runs the plan: the choices it can express and how it runs them ([`Target`]), which
    /// [`price`](super::price()) follows. The planner sets it from its options.
    pub target: Target,
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
    /// Of layer and RMS norms against memory bandwidth, where measured ([`Efficiencies::norm`]).
    pub norm_measured: Option<f64>,
    /// Of the loss against memory bandwidth, where measured ([`Efficiencies::loss`]).
    pub loss_measured: Option<f64>,
    /// Of a 16-bit GEMM with a dimension not a multiple of 8; 0: priced as an aligned one.
    pub unaligned_matmul: f64,
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
        norm_measured: None,
        loss_measured: None,
        unaligned_matmul: 0.0,
    };

    /// Layer and RMS norms: as measured, else as the element-wise kernels.
    pub fn norm(&self) -> f64 {
        self.norm_measured.unwrap_or(self.memory)
    }

    /// The loss: as measured, else as the element-wise kernels.
    pub fn loss(&self) -> f64 {
        self.loss_measured.unwrap_or(self.memory)
    }

    /// The source of efficiencies `osdp-tui calibrate --device cuda` measured.
    pub const MEASURED: &'static str =
        "efficiencies measured on this GPU by `osdp-tui calibrate --device cuda`";

    /// The layout's own figures, else its GPU generation's (`cluster::known`), else generic.
    pub fn of(layout: &Layout) -> Efficiencies {
        let d = &layout.device;
        let base = match (d.kind, crate::cluster::known::row_of(d)) {
            (DeviceKind::Gpu, Some(g)) => Efficiencies {
                source: g.efficiency.summary,
                matmul: g.efficiency.matmul.value,
                matmul_half_width: g.efficiency.matmul_half_width.value,
                attention_forward: g.efficiency.attention_forward.value,
                attention_backward: g.efficiency.attention_backward.value,
                memory: g.efficiency.memory.value,
                norm_measured: None,
                loss_measured: None,
                unaligned_matmul: g.efficiency.unaligned_matmul.value,
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
            norm_measured: e.norm.as_ref().map(|f| f.value),
            loss_measured: e.loss.as_ref().map(|f| f.value),
            unaligned_matmul: pick(&e.unaligned_matmul, base.unaligned_matmul),
        }
    }
}

/// Optimizer state sharded over groups of ranks while gradients are all-reduced over all of
/// them, as InternLM's `HybridZeroOptimizer` runs it (`zero1` in its config: 8, a node, or -1,
/// every rank): the parameters are dealt to the group's ranks whole, largest first, each to
/// the least loaded rank; each rank steps what it was dealt, then every rank that holds
/// parameters broadcasts them to its group, one broadcast after another, all waited before
/// the next forward (`broadcast_params(overlap=False)`). Priced as those broadcasts
/// ([`Machine::broadcast_s`]), hidden behind nothing, and the slowest rank's step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Zero1Groups {
    /// Ranks in a group (the broadcasts span them).
    pub ranks: u32,
    /// Broadcasts after a step: the group's ranks that hold parameters (fewer than `ranks`
    /// where the model has fewer parameter tensors than a group has ranks).
    pub broadcasts: u32,
    /// The most any rank steps, as a share of the model's parameters (at least `1 / ranks`;
    /// the largest tensor's share where one tensor outweighs a fair share).
    pub slowest_share: f64,
}

impl Zero1Groups {
    /// How InternLM deals tensors of `sizes` elements to a group of `ranks`: largest first,
    /// each to the rank holding the fewest elements so far.
    pub fn dealt(sizes: &[u64], ranks: u32) -> Zero1Groups {
        let ranks = ranks.max(1);
        let mut sorted: Vec<u64> = sizes.iter().copied().filter(|&n| n > 0).collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let mut load = vec![0u64; ranks as usize];
        for n in &sorted {
            // The first of the least loaded ranks, as Python's `list.index(min(...))` picks.
            let (i, _) = load
                .iter()
                .enumerate()
                .min_by_key(|&(i, &l)| (l, i))
                .expect("a group has a rank");
            load[i] += n;
        }
        let total: u64 = sorted.iter().sum();
        Zero1Groups {
            ranks,
            broadcasts: load.iter().filter(|&&l| l > 0).count() as u32,
            slowest_share: load
                .iter()
                .max()
                .map_or(0.0, |&m| m as f64 / total.max(1) as f64),
        }
    }
}

impl Machine {
    /// Run plans of `model` on `target`: its prices, and what its collectives' streams reserve
    /// ([`Machine::side_pool_bytes`], priced from the machine as it is now: set the target
    /// after the fields that describe the stack).
    pub fn set_target(&mut self, target: Target, model: &ModelSpec) {
        self.target = target;
        self.side_pool_bytes = super::side_pool_bytes(model, self);
    }

    /// Whether FSDP2 keeps an op's unit gathered from its forward through its backward (not
    /// resharded after the forward): the root's ops where the root is never resharded
    /// ([`Machine::fsdp2_root_unsharded`]), the last block's where torchtitan leaves it so
    /// ([`Machine::fsdp2_last_block_unsharded`]). Such a unit gathers once a micro-batch.
    pub fn fsdp2_keeps_gathered(&self, outside_blocks: bool, in_last_block: bool) -> bool {
        (self.fsdp2_root_unsharded && outside_blocks)
            || (self.fsdp2_last_block_unsharded && in_last_block)
    }

    /// Bytes every plan's peak has whatever its choices: the runtime's own and the side
    /// streams' reserve.
    pub fn fixed_bytes(&self) -> u64 {
        self.overhead_bytes.saturating_add(self.side_pool_bytes)
    }

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
            rates_guessed: crate::cluster::known::rates_guessed(&layout.device),
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
            gradient_bucket_elements: None,
            nccl_tree: layout.device.kind == DeviceKind::Gpu,
            param_pass_bytes: param_pass_bytes(layout),
            // The CPU trainer's attention is what the model description says.
            fused_attention: layout.device.kind == DeviceKind::Cpu
                || crate::cluster::known::row_of(&layout.device)
                    .is_none_or(|g| g.efficiency.flash_attention),
            flash_attention_1: false,
            cudnn_attention: layout.device.kind == DeviceKind::Gpu
                && crate::cluster::known::row_of(&layout.device)
                    .is_some_and(|g| g.efficiency.cudnn_attention),
            fused_softmax: false,
            autocast: false,
            optimizer_bytes_per_param: OPTIMIZER_BYTES_PER_PARAM,
            regather_on_recompute: true,
            selective_ops: false,
            persistence_threshold: 0,
            fsdp2_root_unsharded: false,
            fsdp2_block_units: false,
            fsdp2_last_block_unsharded: false,
            loss_frees_logits: false,
            loss_fp32_logit_copies: 0,
            loss_bytes_per_logit: None,
            eager_rotary: None,
            serial_gathers: false,
            zero1_groups: None,
            launch_s: match layout.device.kind {
                DeviceKind::Gpu => 5e-6,
                DeviceKind::Cpu => 10e-6,
            },
            overhead_bytes: layout.runtime_overhead_bytes(),
            side_pool_bytes: 0,
            compute_dtype,
            precision,
            model_activation_bytes: model.config.dtype.bytes(),
            overlap: layout.device.kind == DeviceKind::Gpu,
            target: Target::Osdp,
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
    pub(super) fn host_copy_s(&self, bytes: f64) -> f64 {
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
            None if self.rates_guessed => format!(
                "guessed rates (the GPU is not in the known-GPU table: give its datasheet's in \
                 the layout) × {} (not calibrated)",
                self.efficiency.source
            ),
            None => format!(
                "datasheet rates × {} (not calibrated: `osdp-tui calibrate` measures a machine)",
                self.efficiency.source
            ),
        }
    }

    /// Whether a plan that accumulates micro-batches holds more memory for it than one that does
    /// not: FSDP2 keeps each module's unsharded gradient, in the reduce dtype, from the first
    /// backward to the last (`fsdp2_price`); osdp-tui's executor accumulates into the gradient
    /// it keeps anyway.
    pub fn accumulation_holds_memory(&self) -> bool {
        self.target == Target::Fsdp2
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
    pub(super) fn ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
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

    /// A broadcast of `bytes` from one rank to a group of `group` ranks (consecutive ranks, so
    /// spread over as few nodes as they fit in), paying `latency_share` of its latency. NCCL
    /// broadcasts along a ring: the buffer is pipelined over the `group − 1` hops of the chain,
    /// every link carries all of it (bus bandwidth = algorithm bandwidth), and the hops that
    /// cross nodes pay the network's latency.
    pub fn broadcast_s(&self, bytes: f64, group: u32, latency_share: f64) -> f64 {
        let group = group.min(self.ranks);
        if group <= 1 {
            return 0.0;
        }
        let per_node = self.ranks_per_node.max(1);
        let nodes = group.div_ceil(per_node).min(self.nodes.max(1));
        let (hops, crossings) = (f64::from(group - nodes), f64::from(nodes - 1));
        let bytes_per_s = if nodes > 1 {
            self.link_bytes_per_s
        } else {
            self.node_link_bytes_per_s
        };
        latency_share
            * (self.collective_base_s
                + hops * self.link_latency_s
                + crossings * self.cross_node_latency_s)
            + bytes / bytes_per_s
    }

    /// Whether hybrid sharding applies: the ranks span more than one node.
    pub fn hybrid(&self) -> bool {
        self.nodes > 1 && self.ranks > self.ranks_per_node
    }

    /// Why `strategy` cannot run on this machine, if it cannot: what it needs of the layout
    /// ([`StrategyInfo::needs`](super::StrategyInfo)) missing, e.g. hybrid sharding on one node.
    pub fn refuses(&self, strategy: Strategy) -> Option<String> {
        match strategy.info().needs {
            Needs::Nothing => None,
            Needs::SeveralNodes if self.hybrid() => None,
            Needs::SeveralNodes => Some(format!(
                "{} shards inside a node and replicates across nodes, but all {} ranks are on \
                 one node: use zero3 (the same sharding over all ranks), or a layout of several \
                 nodes",
                strategy.as_str(),
                self.ranks
            )),
        }
    }

    /// A ring collective of `bytes` over the ranks of one node (hybrid sharding's gathers and
    /// reduce-scatters), paying `latency_share` of its latency.
    pub(super) fn node_ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let n = f64::from(self.ranks_per_node.min(self.ranks));
        if n <= 1.0 {
            return 0.0;
        }
        latency_share * (self.collective_base_s + (n - 1.0) * self.link_latency_s)
            + (n - 1.0) / n * bytes / self.node_link_bytes_per_s
    }

    /// A ring collective of `bytes` over one rank per node (hybrid sharding's replica group):
    /// every step crosses nodes.
    pub(super) fn replica_ring_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let n = f64::from(self.nodes.clamp(1, self.ranks.max(1)));
        if n <= 1.0 {
            return 0.0;
        }
        latency_share * (self.collective_base_s + (n - 1.0) * self.cross_node_latency_s)
            + (n - 1.0) / n * bytes / self.replica_link_bytes_per_s
    }

    /// An all-reduce of `bytes` over one rank per node (hybrid sharding's replicas), as
    /// [`Machine::all_reduce_shared_s`] chooses: the ring over the nodes or, on GPUs, the tree
    /// over them (`2 · ⌊log₂ nodes⌋` steps).
    pub(super) fn replica_all_reduce_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let ring = 2.0 * self.replica_ring_s(bytes, latency_share);
        self.tree_or_ring_s(ring, 1, bytes, latency_share, self.replica_link_bytes_per_s)
    }

    /// The faster of `ring` and NCCL's tree for an all-reduce of `bytes` over this machine's
    /// nodes with `per_node` ranks in each, on links of `bytes_per_s` bus bandwidth: on GPUs
    /// over two nodes or more, `ring` otherwise.
    fn tree_or_ring_s(
        &self,
        ring: f64,
        per_node: u32,
        bytes: f64,
        latency_share: f64,
        bytes_per_s: f64,
    ) -> f64 {
        let nodes = self.nodes.clamp(1, self.ranks.max(1));
        if !self.nccl_tree || nodes <= 1 {
            return ring;
        }
        let steps = 2.0 * f64::from(per_node.max(1) - 1 + nodes.ilog2());
        let tree = latency_share * steps * NCCL_TREE_HOP_LATENCY_S
            + 2.0 * bytes / (NCCL_TREE_BANDWIDTH * bytes_per_s);
        ring.min(tree)
    }

    /// Host time of one tensor's all-gather where gathers are serial ([`Machine::serial_gathers`]):
    /// [`DS_2021_GATHER_HOST_S`] as measured on 8 ranks, plus one copy launch per further rank.
    /// The gather's output is a list of one view per rank, which PyTorch's list `all_gather`
    /// (before `_all_gather_base`, PyTorch 1.10) gathers into a flat buffer of its own and copies
    /// back view by view, one `copy_` per rank (PR #1188: "the existing _allgather_params has
    /// explicit memcpy after the all-gather op"); the Python loop that builds the views costs
    /// more per rank, with no published figure, so it is left out.
    pub fn serial_gather_host_s(&self) -> f64 {
        let more = self.ranks.saturating_sub(DS_2021_GATHER_HOST_RANKS);
        DS_2021_GATHER_HOST_S + f64::from(more) * self.launch_s
    }

    /// Time of the copies one tensor's gradient reduce-scatter makes where gathers are serial
    /// ([`Machine::serial_gathers`]): DeepSpeed ZeRO-3 of 2021 (`_reduce_scatter_gradient`)
    /// hands PyTorch's list `reduce_scatter` one view of the gradient per rank, and PyTorch
    /// (before `_reduce_scatter_base`, 1.10) copies each into a flat buffer of its own first,
    /// one `copy_` per rank on the collective's stream. Each copy is priced at a kernel launch.
    pub fn serial_reduce_copies_s(&self) -> f64 {
        f64::from(self.ranks) * self.launch_s
    }

    /// An all-reduce of `bytes` paying one whole latency ([`Machine::all_reduce_shared_s`]).
    pub fn all_reduce_s(&self, bytes: f64) -> f64 {
        self.all_reduce_shared_s(bytes, 1.0)
    }

    /// An all-reduce of `bytes` that pays `latency_share` of its latency, as NCCL runs it: of
    /// the algorithms its tuning model prices (NCCL 2.8's src/graph/tuning.cc, Simple
    /// protocol), the faster — the ring (a reduce-scatter and an all-gather: `2(N−1)` steps,
    /// linear in the ranks) or, across nodes on GPUs, the tree (a chain inside each node and a
    /// binary tree over the nodes, up and down: `2 · (N/nodes − 1 + ⌊log₂ nodes⌋)` steps of
    /// [`NCCL_TREE_HOP_LATENCY_S`], at [`NCCL_TREE_BANDWIDTH`] of the ring's bus bandwidth,
    /// moving the whole buffer each way). The ring wins small rank counts and large buffers,
    /// the tree large rank counts; one node always runs the ring.
    pub fn all_reduce_shared_s(&self, bytes: f64, latency_share: f64) -> f64 {
        let ring = 2.0 * self.ring_s(bytes, latency_share);
        self.tree_or_ring_s(
            ring,
            self.ranks_per_node,
            bytes,
            latency_share,
            self.link_bytes_per_s,
        )
    }

    /// A GEMM of `flops` whose smaller side is `width` features.
    pub(super) fn matmul_s(&self, flops: f64, width: f64, calls: u32) -> f64 {
        let e = &self.efficiency;
        let efficiency = e.matmul * width / (width + e.matmul_half_width);
        flops / (self.flops_per_s * efficiency) + f64::from(calls) * self.launch_s
    }

    /// [`Machine::matmul_s`] of a linear whose weight has these dimensions: in 16-bit, one not
    /// a multiple of 8 takes the generation's unaligned rate where it was measured.
    pub(super) fn linear_s(&self, flops: f64, width: f64, dims: &[i64]) -> f64 {
        match self.unaligned_linear_s(flops, width) {
            Some(slow) if self.slowed_unaligned(dims) => slow,
            _ => self.matmul_s(flops, width, 1),
        }
    }

    /// A 16-bit GEMM of `flops` (smaller side `width`) at the unaligned rate, where this
    /// machine has one; `None` where it prices unaligned GEMMs as aligned ones.
    pub(super) fn unaligned_linear_s(&self, flops: f64, width: f64) -> Option<f64> {
        let e = &self.efficiency;
        (self.precision.activation_bytes <= 2 && e.unaligned_matmul > 0.0).then(|| {
            let efficiency =
                (e.matmul * width / (width + e.matmul_half_width)).min(e.unaligned_matmul);
            flops / (self.flops_per_s * efficiency) + self.launch_s
        })
    }

    /// Whether a linear's weight of these dimensions is priced at the unaligned rate: 16-bit
    /// compute, a dimension not a multiple of 8, and a rate measured for this generation.
    pub(super) fn slowed_unaligned(&self, dims: &[i64]) -> bool {
        self.precision.activation_bytes <= 2
            && self.efficiency.unaligned_matmul > 0.0
            && !dims.iter().all(|&d| gemm_aligned(d))
    }

    /// The weight shape of `op` where it is a linear this machine prices at the unaligned rate:
    /// what `plan` and the dashboard name so the user can pad it. `None` also where a
    /// calibration's measured linear curve prices linears instead ([`OpBase::new`]).
    pub fn unaligned_weight<'a>(&self, op: &'a crate::model::OpSpec) -> Option<&'a [i64]> {
        if op.kind != crate::model::OpKind::Linear
            || self
                .calibration
                .as_ref()
                .is_some_and(|c| c.kernel_s("linear", 1.0).is_some())
        {
            return None;
        }
        let w = op.params.first()?;
        self.slowed_unaligned(&w.shape)
            .then_some(w.shape.as_slice())
    }

    /// Every linear of `model` [`Machine::unaligned_weight`] names, with its shape.
    pub fn unaligned_linears<'a>(&self, model: &'a ModelSpec) -> Vec<(&'a str, &'a [i64])> {
        model
            .ops
            .iter()
            .filter_map(|op| Some((op.id.as_str(), self.unaligned_weight(op)?)))
            .collect()
    }

    /// A fused attention kernel doing `flops` (causal ones: the masked half is skipped).
    pub(super) fn attention_s(&self, flops: f64, efficiency: f64) -> f64 {
        flops / (self.flops_per_s * efficiency) + self.launch_s
    }

    /// One element-wise kernel over `bytes`: [`Machine::streamed_s`] plus its launch.
    pub(super) fn memory_s(&self, bytes: f64) -> f64 {
        self.memory_at_s(bytes, self.efficiency.memory)
    }

    /// A memory-bound kernel over `bytes` reaching `efficiency` of the bandwidth, plus its
    /// launch.
    pub(super) fn memory_at_s(&self, bytes: f64, efficiency: f64) -> f64 {
        bytes / (self.memory_bytes_per_s * efficiency) + self.launch_s
    }

    /// `bytes` read or written at the rate element-wise kernels reach of memory bandwidth.
    pub(super) fn streamed_s(&self, bytes: f64) -> f64 {
        bytes / (self.memory_bytes_per_s * self.efficiency.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::fixtures::{cluster, linear_base, machine};
    use crate::cost::price;

    #[test]
    fn only_large_unaligned_weights_are_padded_and_to_a_multiple_of_64() {
        assert_eq!(padded_gemm_rows(50_257), Some(50_304)); // GPT-2's head
        assert_eq!(padded_gemm_rows(50_304), None); // already aligned
        assert_eq!(padded_gemm_rows(32_000), None);
        assert_eq!(padded_gemm_rows(6_401), Some(6_464)); // 0.98 % more
        assert_eq!(padded_gemm_rows(1_001), None); // 2.3 % more: not worth it

        // A weight's shape: its output rows, 2-D only.
        assert_eq!(padded_weight_rows(&[50_257, 1_600]), Some(50_304));
        assert_eq!(padded_weight_rows(&[50_257]), None);
    }

    #[test]
    fn zero1_groups_deal_whole_tensors_largest_first_to_the_least_loaded_rank() {
        // 10 → rank 0, 7 → 1, 5 → 1 (12), 3 → 0 (13), 1 → 1 (13): the slowest steps half.
        let two = Zero1Groups::dealt(&[3, 10, 1, 7, 5], 2);
        assert_eq!((two.ranks, two.broadcasts), (2, 2));
        assert!((two.slowest_share - 13.0 / 26.0).abs() < 1e-12);
        // More ranks than tensors: only the holders broadcast, and the largest tensor's rank is
        // the slowest whatever the group's size (InternLM-7B's embedding at 1,024 ranks).
        let many = Zero1Groups::dealt(&[423, 45, 45, 17, 0], 1024);
        assert_eq!(many.broadcasts, 4);
        assert!((many.slowest_share - 423.0 / 530.0).abs() < 1e-12);
    }

    #[test]
    fn a_broadcast_sends_the_whole_buffer_down_the_ring_of_its_group() {
        let mut m = machine(32);
        (m.nodes, m.ranks_per_node) = (4, 8);
        (m.cross_node_latency_s, m.node_link_bytes_per_s) = (50e-6, 200e9);
        // Inside a node: 7 hops of 10 µs, 1 GB over the node's 200 GB/s.
        assert!((m.broadcast_s(1e9, 8, 1.0) - (70e-6 + 5e-3)).abs() < 1e-12);
        // All 32 ranks: 28 hops inside nodes, 3 across, 1 GB over the ring's 100 GB/s.
        assert!((m.broadcast_s(1e9, 32, 1.0) - (280e-6 + 150e-6 + 10e-3)).abs() < 1e-12);
        // A share of the latency, and nothing on one rank.
        assert!((m.broadcast_s(0.0, 32, 0.5) - 215e-6).abs() < 1e-12);
        assert_eq!(m.broadcast_s(1e9, 1, 1.0), 0.0);
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

    /// NCCL picks its tree for all-reduces over many nodes (its latency grows with the log of
    /// the nodes, the ring's with the ranks) and its ring over few or on one node.
    #[test]
    fn all_reduces_take_the_tree_over_many_nodes_and_the_ring_over_few() {
        let ring = |m: &Machine, bytes: f64| 2.0 * m.ring_s(bytes, 1.0);
        let tree = |m: &Machine, bytes: f64, steps: f64| {
            steps * NCCL_TREE_HOP_LATENCY_S
                + 2.0 * bytes / (NCCL_TREE_BANDWIDTH * m.link_bytes_per_s)
        };
        // 128 nodes of 8: a 50 MB bucket. Ring: 8.4 µs + 896 steps at 10 µs + 127 at 15 µs,
        // twice, ~22 ms; tree: 2 · (7 + 7) steps of 28 µs, ~0.8 ms, and a little more
        // bandwidth time.
        let many = cluster(128, 8.0);
        let t = tree(&many, 50e6, 28.0);
        assert!(t < ring(&many, 50e6) / 5.0);
        assert!((many.all_reduce_s(50e6) - t).abs() < 1e-12);
        // 2 nodes: the ring's 16 steps cost less than the tree's 16 hops of 28 µs.
        let two = cluster(2, 8.0);
        assert!((two.all_reduce_s(50e6) - ring(&two, 50e6)).abs() < 1e-12);
        // One node, or the CPU trainer's gloo: the ring, whatever the size.
        let one = cluster(1, 8.0);
        assert!((one.all_reduce_s(1e3) - ring(&one, 1e3)).abs() < 1e-12);
        let cpu = Machine {
            nccl_tree: false,
            ..cluster(128, 8.0)
        };
        assert!((cpu.all_reduce_s(50e6) - ring(&cpu, 50e6)).abs() < 1e-12);
        // Hybrid sharding's replicas, one rank per node: the tree over 128 nodes, 2 · 7 hops.
        let replicas = 2.0 * 7.0 * NCCL_TREE_HOP_LATENCY_S
            + 2.0 * 50e6 / (NCCL_TREE_BANDWIDTH * many.replica_link_bytes_per_s);
        assert!((many.replica_all_reduce_s(50e6, 1.0) - replicas).abs() < 1e-12);
        assert!(replicas < 2.0 * many.replica_ring_s(50e6, 1.0));
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

    /// A 16-bit linear with a dimension not a multiple of 8 (GPT-2's 50,257-word head) runs
    /// at the generation's unaligned rate where one was measured; aligned shapes, fp32 and
    /// generations without a measurement are priced as before.
    #[test]
    fn an_unaligned_gemm_takes_the_measured_rate() {
        let mut hopper = machine(8);
        hopper.efficiency.unaligned_matmul = 0.12;
        let aligned = hopper.matmul_s(1e12, 1024.0, 1);
        assert_eq!(hopper.linear_s(1e12, 1024.0, &[50264, 1024]), aligned);
        let slow = hopper.linear_s(1e12, 1024.0, &[50257, 1024]);
        assert!((slow - (1.0 / 12.0 + 5e-6)).abs() < 1e-12, "{slow}");
        let mut fp32 = hopper.clone();
        fp32.precision = Precision::FP32;
        assert_eq!(fp32.linear_s(1e12, 1024.0, &[50257, 1024]), aligned);
        assert_eq!(machine(8).linear_s(1e12, 1024.0, &[50257, 1024]), aligned);
        // The shipped Hopper layouts carry the measured figure; Ampere's was not measured.
        let layout = |name: &str| {
            crate::input::parse_strict(
                std::path::Path::new(name),
                &std::fs::read_to_string(
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("../../layouts")
                        .join(name),
                )
                .unwrap(),
                crate::cluster::LAYOUT_FORMAT_VERSION,
            )
            .unwrap()
        };
        assert_eq!(
            Efficiencies::of(&layout("h200-1x.json")).unaligned_matmul,
            0.12
        );
        assert_eq!(
            Efficiencies::of(&layout("a100-80gb-8x-nvlink.json")).unaligned_matmul,
            0.0
        );
    }

    /// An aligned linear split into slices that are not a multiple of 8 columns wide pays the
    /// unaligned rate for them; slices of a multiple of 8 do not.
    #[test]
    fn unaligned_split_slices_take_the_measured_rate() {
        let mut hopper = machine(8);
        hopper.efficiency.unaligned_matmul = 0.12;
        let mut b = linear_base(1600 * 1600);
        b.in_features = 1600;
        // Forward and backward at 12 % instead of the fixture's 3 ms.
        b.unaligned_s = 0.02;
        let time = |k: u32| price(&b, Choice::zero3(k, k), &hopper).compute_s;
        // 1600 / 8 = 200 columns: launches only.
        assert!((time(8) - time(1) - 21.0 * 5e-6).abs() < 1e-12);
        // 1600 / 16 = 100 columns: the unaligned rate.
        let extra = b.unaligned_s - b.fwd_s - b.bwd_s;
        assert!(
            (time(16) - time(1) - 45.0 * 5e-6 - extra).abs() < 1e-12,
            "{}",
            time(16)
        );
    }
}
