//! Published training runs, priced: the cost model checked against throughput and memory
//! that other people measured (`docs/published-runs.json`, with a link for every figure).
//!
//! Each run is reproduced as a plan the planner could have chosen — one strategy on every
//! op (FSDP `FULL_SHARD` is ZeRO-3, `SHARD_GRAD_OP` ZeRO-2, `HYBRID_SHARD` hsdp, DDP), full
//! activation checkpointing as recomputation of every block, the run's micro-batch and
//! accumulation — on the layout of its GPUs, and priced by [`osdp_core::plan::evaluate`], the same
//! function `osdp-tui evaluate` uses.

// Shared by the example and tests/it/published.rs, each of which uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use osdp_core::cluster::{read_layout, Figure, Layout};
use osdp_core::cost::{
    EagerRotary, Machine, Owned, Strategy, Target, Zero1Groups, HF_TRAINER_STEP_BYTES_PER_PARAM,
};
use osdp_core::model::hf::{import_str, ImportOptions};
use osdp_core::model::{AttentionImpl, Kernels, ModelSpec};
use osdp_core::plan::baseline::Baseline;
use osdp_core::plan::{evaluate, Prediction};

/// The data file: what it is, and the runs.
#[derive(Debug, Clone, Deserialize)]
pub struct RunSet {
    #[serde(default)]
    pub about: String,
    pub runs: Vec<PublishedRun>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Source {
    pub url: String,
    #[serde(default)]
    pub what: String,
    #[serde(default)]
    pub accessed: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Interconnect {
    #[serde(default)]
    pub intra: Option<String>,
    #[serde(default)]
    pub inter: Option<String>,
}

/// A model's shape as a run reports it.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Shape {
    /// `mpt`, `gpt2`, `llama` or `bert` (a BERT encoder with its masked-LM head).
    pub family: String,
    pub name: String,
    pub d_model: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    #[serde(default)]
    pub n_kv_heads: Option<u64>,
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    pub vocab: u64,
    #[serde(default)]
    pub tied_embeddings: Option<bool>,
    #[serde(default)]
    pub gated_mlp: Option<bool>,
    #[serde(default)]
    pub params: Option<f64>,
    /// Dropout probability the run trains with, on attention's probabilities and the hidden
    /// states (the code's default where the source sets none, with where it comes from in the
    /// run's notes); absent: the family's config default (none for GPT-style and Llama runs,
    /// BERT's 0.1).
    #[serde(default)]
    pub dropout: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Published {
    #[serde(default)]
    pub tokens_per_s_per_gpu: Option<f64>,
    #[serde(default)]
    pub tokens_per_s_total: Option<f64>,
    #[serde(default)]
    pub mfu: Option<f64>,
    #[serde(default)]
    pub memory_reserved_gib: Option<f64>,
    #[serde(default)]
    pub memory_allocated_gib: Option<f64>,
    /// Samples per second over all GPUs, where the source gives that instead of tokens.
    #[serde(default)]
    pub samples_per_s_total: Option<f64>,
    /// Seconds per optimizer step, where the source gives only that (Megatron-LM's "elapsed
    /// time per iteration"): each GPU's micro-batches × accumulation × sequence over it.
    #[serde(default)]
    pub step_time_s: Option<f64>,
    /// Achieved TFLOP/s per GPU, where the source gives only that; with
    /// [`Published::flops_per_token`] naming the source's own FLOP count.
    #[serde(default)]
    pub tflops_per_gpu: Option<f64>,
    /// The source's FLOPs-per-token formula behind `tflops_per_gpu`: `megatron-eq3`
    /// (arXiv:2104.04473 Eq. 3, recomputation counted).
    #[serde(default)]
    pub flops_per_token: Option<String>,
}

/// The software a run was measured with, as data: where a stack is faster or slower, that is
/// a property named here, not a constant fitted to the run.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Stack {
    pub framework: String,
    /// Year of the software the figures come from.
    pub era: String,
    pub compile: bool,
    /// Whether its attention is a fused causal kernel (flash, memory-efficient) that skips the
    /// masked half; false for materialised attention (Megatron-LM 2021's fused softmax).
    #[serde(default = "yes")]
    pub fused_attention: bool,
    /// fp32 copies of the logits its loss code holds ([`Machine::loss_fp32_logit_copies`];
    /// Hugging Face's 2023–24 `LlamaForCausalLM`: 2), with the code that says so in the notes.
    #[serde(default)]
    pub loss_fp32_logit_copies: u32,
    /// Whether it issues each module's collectives on their own (DeepSpeed ZeRO-3's
    /// per-submodule fetch) rather than one per transformer block (FSDP units): each op then
    /// pays a whole collective latency ([`Machine::block_collectives`] off).
    #[serde(default)]
    pub per_module_collectives: bool,
    /// Whether it gathers parameters tensor by tensor after a device synchronisation
    /// (DeepSpeed ZeRO-3 before its PR #1188 of mid-2021; [`Machine::serial_gathers`]): the
    /// gathers and their host time hide behind no compute.
    #[serde(default)]
    pub serial_gathers: bool,
    /// Whether the model runs as PyTorch's eager modules (Hugging Face transformers' code),
    /// which keep more for backward than osdp-tui's fused kernels: norm statistics, RMSNorm's
    /// fp32 upcast, a contiguous copy of attention's output, the gated MLP's activation output
    /// (the model is imported with [`Kernels::Pytorch`], as `import-hf --kernels pytorch`).
    #[serde(default)]
    pub eager_modules: bool,
    /// Where attention is materialised, whether scale, mask and softmax are one kernel
    /// (Megatron-LM's `FusedScaleMaskSoftmax`; [`Machine::fused_softmax`]) rather than one
    /// PyTorch op each.
    #[serde(default)]
    pub fused_softmax: bool,
    /// Whether it keeps fp32 parameters and computes under `torch.autocast` (PyTorch AMP;
    /// [`Machine::autocast`]) rather than on a model cast to half (DeepSpeed's fp16) or a
    /// mixed-precision policy.
    #[serde(default)]
    pub autocast: bool,
    /// Whether its optimizer step is the Hugging Face Trainer's own (without DeepSpeed): one
    /// PyTorch op per update term ([`HF_TRAINER_STEP_BYTES_PER_PARAM`]).
    #[serde(default)]
    pub hf_trainer_optimizer: bool,
    /// Whether it runs its collectives with nothing beside them ([`Machine::overlap`] off):
    /// DeepSpeed's ZeRO stage 1 reduces the gradients after the whole backward ("none of the
    /// backward hooks are triggered by stage 1, there is no overlapping",
    /// microsoft/DeepSpeed#1246, July 2021) and gathers the updated parameters after the step.
    #[serde(default)]
    pub collectives_not_overlapped: bool,
    /// Whether it reduces every gradient in one flat buffer, one collective a step (NVIDIA's
    /// BERT with `--allreduce_post_accumulation`, Megatron-LM's local DDP): one collective
    /// latency a step ([`Machine::gradient_bucket_elements`] infinite).
    #[serde(default)]
    pub flat_gradients: bool,
    /// Where it reduces gradients in flat buckets of a set size after the backward, that size
    /// in elements (DeepSpeed's `allreduce_bucket_size` / `reduce_bucket_size`, apex DDP's
    /// `message_size`): one collective latency a bucket.
    #[serde(default)]
    pub gradient_bucket_elements: Option<u64>,
    /// Whether it gathers a recomputed module's parameters again for the recomputation
    /// ([`Machine::regather_on_recompute`]; DeepSpeed ZeRO-3 releases each submodule after
    /// every forward). Off for the PyTorch FSDP runs, which keep the unit gathered.
    #[serde(default)]
    pub regathers_on_recompute: bool,
    /// DeepSpeed ZeRO-3's `stage3_param_persistence_threshold` where the stack has it
    /// ([`Machine::persistence_threshold`]).
    #[serde(default)]
    pub param_persistence_threshold: u64,
    /// Whether it is PyTorch FSDP2's `fully_shard`, priced as `plan --target fsdp2` prices it
    /// ([`Target::Fsdp2`]): two units' gathered buffers at once, and with accumulation every
    /// module's unsharded gradient held in the reduce dtype until the last micro-batch
    /// (`set_requires_gradient_sync(False)` before it, in the run's code).
    #[serde(default)]
    pub fsdp2: bool,
    /// FSDP2 with a unit per block and the rest in the root unit, which 2024's FSDP2 never
    /// resharded after its forward ([`Machine::fsdp2_root_unsharded`]; torchtitan's
    /// `apply_fsdp`).
    #[serde(default)]
    pub fsdp2_root_unit: bool,
    /// FSDP2 with one unit per block and a root unit of the rest (torchtitan's `apply_fsdp`),
    /// not one per module that owns parameters: the size of what its side streams hold per
    /// collective ([`Machine::fsdp2_block_units`]).
    #[serde(default)]
    pub fsdp2_block_units: bool,
    /// FSDP2's last block is not resharded after its forward (torchtitan's `apply_fsdp`;
    /// [`Machine::fsdp2_last_block_unsharded`]).
    #[serde(default)]
    pub fsdp2_last_block_unsharded: bool,
    /// The loop frees the logits before the backward (torchtitan's `del pred`;
    /// [`Machine::loss_frees_logits`]).
    #[serde(default)]
    pub loss_frees_logits: bool,
    /// Bytes a parameter its micro-batches pass over outside the kernels, where its code says
    /// (read there, the notes name the lines): a model kept in 16 bits that only accumulates
    /// or unscales gradients passes far fewer than the FSDP runs the default
    /// ([`osdp_core::cost::PARAM_PASS_BYTES`]) was fitted on.
    #[serde(default)]
    pub param_pass_bytes: Option<f64>,
    /// Whether its fused attention is FlashAttention 1 (flash-attn 1.x), priced slower than
    /// the FlashAttention-2 figures the efficiencies were fitted with
    /// ([`osdp_core::cost::FLASH_ATTENTION_1_EXTRA_RATE`]).
    #[serde(default)]
    pub flash_attention_1: bool,
    /// Where its loss is a chain of PyTorch ops over the logits (Megatron-LM's vocab-parallel
    /// cross entropy, Hugging Face's upcast and shifted copy before `CrossEntropyLoss`), the
    /// bytes those ops move per logit element, forward and backward, as its code makes them
    /// (the notes name the lines; [`Machine::loss_bytes_per_logit`]).
    #[serde(default)]
    pub loss_bytes_per_logit: Option<[f64; 2]>,
    /// Where its code applies rotary embeddings as eager PyTorch ops, their form:
    /// `rotate_half` (transformers), `complex` (Meta's Llama code, torchtitan) or
    /// `pair_matrix` (foundation-model-stack) or `halves` (KempnerForge); each priced as the passes its code makes
    /// ([`osdp_core::cost::EagerRotary`], counted by `scripts/eager-passes.py`).
    #[serde(default)]
    pub rotary: Option<EagerRotary>,
    /// Whether its `scaled_dot_product_attention` ran cuDNN's kernels (PyTorch 2.11 on Hopper,
    /// [`Machine::cudnn_attention`]); false for the stacks that predate that default.
    #[serde(default)]
    pub cudnn_attention: bool,
    /// Where it shards the optimizer state of its data-parallel (all-reduced) model over groups
    /// of this many ranks, dealing them whole tensors, and broadcasts each rank's updated
    /// tensors to its group after the step (InternLM's `HybridZeroOptimizer`: `zero1` = 8, a
    /// node, or -1, every rank, written here as the run's GPU count;
    /// [`Machine::zero1_groups`]).
    #[serde(default)]
    pub zero1_ranks: Option<u32>,
    /// Bytes its optimizer step moves per updated parameter, where its code was read (the notes
    /// name the lines; [`Machine::optimizer_bytes_per_param`]): absent, a fused AdamW's
    /// ([`osdp_core::cost::OPTIMIZER_BYTES_PER_PARAM`]).
    #[serde(default)]
    pub optimizer_bytes_per_param: Option<u64>,
}

fn yes() -> bool {
    true
}

/// How a run takes part in the check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The efficiencies were fitted on it.
    Fit,
    /// Held out: priced with the fitted constants, never used to fit them.
    #[default]
    HeldOut,
    /// Listed for the record, not priced (the doc says why).
    Excluded,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct PublishedRun {
    pub id: String,
    pub source: Source,
    pub gpu: String,
    /// Absent where the source does not say (such runs cannot be priced).
    #[serde(default)]
    pub nodes: Option<u32>,
    #[serde(default)]
    pub gpus_per_node: Option<u32>,
    #[serde(default)]
    pub interconnect: Option<Interconnect>,
    pub model: Shape,
    pub seq_len: u64,
    pub micro_batch: u64,
    #[serde(default)]
    pub grad_accum: Option<u64>,
    #[serde(default)]
    pub global_batch: Option<u64>,
    #[serde(default)]
    pub sharding: Option<String>,
    pub activation_checkpointing: String,
    #[serde(default)]
    pub attention: Option<String>,
    #[serde(default)]
    pub compile: Option<bool>,
    #[serde(default)]
    pub precision: Option<String>,
    /// The network between nodes, all NICs of a node together, as the source states it
    /// (GB/s); absent: the shipped multi-node layout's.
    #[serde(default)]
    pub network_gb_per_s_per_node: Option<f64>,
    /// Selective checkpointing that recomputes every n-th block.
    #[serde(default)]
    pub recompute_every: Option<usize>,
    /// Selective checkpointing that recomputes this fraction of the blocks, spread as
    /// fms-fsdp's `apply_fsdp_checkpointing` spreads them (block `i`, counted from 1, where
    /// `i × p` first reaches ½, 1½, 2½, …).
    #[serde(default)]
    pub recompute_fraction: Option<f64>,
    /// Selective checkpointing op by op in every block: torchtitan's op-level policy, which
    /// keeps attention's and every other matmul's output ([`Machine::selective_ops`]).
    #[serde(default)]
    pub selective_ops: bool,
    /// The dtype gradients were reduced in (`fp32`: FSDP's and llm-foundry's default).
    #[serde(default)]
    pub reduce_dtype: Option<String>,
    pub published: Published,
    /// Framework, era and compile (the runs added for issue 36 record it).
    #[serde(default)]
    pub stack: Option<Stack>,
    /// NICs per node where the source says (overrides the shipped layout's).
    #[serde(default)]
    pub nics_per_node: Option<u32>,
    #[serde(default)]
    pub notes: Option<String>,
    #[serde(default)]
    pub role: Role,
    /// Why a run is excluded.
    #[serde(default)]
    pub excluded_because: Option<String>,
    /// An excluded run whose throughput cannot be priced (its GPU's rates are unstated) but
    /// whose published memory can: the GPU whose rates stand in, for its memory only (which
    /// no rate changes). Its memory is checked like a priced run's; its throughput is not.
    #[serde(default)]
    pub memory_priced_on: Option<String>,
    /// Predicted over published peak memory range this run must stay in, where it is not
    /// [`MEMORY_BAND`] (the notes say why: a finding, not a pass).
    #[serde(default)]
    pub memory_band: Option<[f64; 2]>,
    /// Predicted/published range this run must stay in, where it differs from the default
    /// (the notes say why).
    #[serde(default)]
    pub band: Option<[f64; 2]>,
    /// What the published figure times: `step` (a steady step, the default: what the cost
    /// model prices), `whole_run` (samples over a whole run's wall time from its start, which
    /// the source itself shows is slower than its steady steps) or `unstated` (the source does
    /// not say).
    #[serde(default)]
    pub timing: Timing,
}

/// What a published throughput times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Timing {
    #[default]
    Step,
    WholeRun,
    Unstated,
}

impl PublishedRun {
    /// The run as its memory is priced: on the stand-in GPU where it names one
    /// ([`PublishedRun::memory_priced_on`]), else as it is.
    pub fn for_memory(&self) -> PublishedRun {
        PublishedRun {
            gpu: self
                .memory_priced_on
                .clone()
                .unwrap_or_else(|| self.gpu.clone()),
            ..self.clone()
        }
    }

    pub fn gpus(&self) -> u32 {
        self.nodes.unwrap_or(1) * self.gpus_per_node.unwrap_or(1)
    }

    fn multi_node(&self) -> bool {
        self.nodes.unwrap_or(1) > 1
    }

    /// Published tokens/s per GPU: as given, else from the total, from samples/s × sequence
    /// length, or from the stated TFLOP/s per GPU over the source's own FLOPs per token.
    pub fn tokens_per_s_per_gpu(&self) -> Option<f64> {
        let gpus = f64::from(self.gpus().max(1));
        let p = &self.published;
        p.tokens_per_s_per_gpu
            .or_else(|| p.tokens_per_s_total.map(|t| t / gpus))
            .or_else(|| {
                p.samples_per_s_total
                    .map(|s| s * self.seq_len as f64 / gpus)
            })
            .or_else(|| {
                let tokens = self.micro_batch * self.grad_accum.unwrap_or(1).max(1) * self.seq_len;
                p.step_time_s.map(|t| tokens as f64 / t)
            })
            .or_else(|| {
                let per_token = match p.flops_per_token.as_deref()? {
                    "megatron-eq3" => megatron_eq3_flops_per_token(&self.model, self.seq_len),
                    _ => return None,
                };
                p.tflops_per_gpu.map(|t| t * 1e12 / per_token)
            })
    }

    /// The GPU generation a run is reported under (an A800 is an A100-class part).
    pub fn generation(&self) -> &str {
        let g = self.gpu.to_uppercase();
        ["H200", "H100", "A100", "V100"]
            .into_iter()
            .find(|n| g.contains(n))
            .or_else(|| g.contains("A800").then_some("A100"))
            .unwrap_or(self.gpu.as_str())
    }

    /// `A100, 1 node`, `H100, 2–32 nodes`, `A100, 33+ nodes`: the group a run is reported in.
    pub fn group(&self) -> String {
        let scale = match self.nodes.unwrap_or(1) {
            0 | 1 => "1 node",
            2..=32 => "2–32 nodes",
            _ => "33+ nodes",
        };
        format!("{}, {scale}", self.generation())
    }

    /// Whether the run comes from the sources added for issue 36 (other frameworks, eras and
    /// scales than the ones the constants were fitted near); reported on their own. Runs of
    /// the first sources may record a stack too.
    pub fn new_source(&self) -> bool {
        !FIRST_SOURCES.iter().any(|repo| {
            self.source
                .url
                .starts_with(&format!("https://github.com/{repo}/"))
        })
    }
}

/// The repositories the data file was first compiled from (its `about`), which the constants
/// were fitted near.
const FIRST_SOURCES: [&str; 6] = [
    "mosaicml/llm-foundry",
    "karpathy/llm.c",
    "pytorch/torchtitan",
    "foundation-model-stack/fms-fsdp",
    "jzhang38/TinyLlama",
    "allenai/OLMo-core",
];

/// FLOPs per token of arXiv:2104.04473's Eq. 3 (with activation recomputation):
/// `96 l h² (1 + s/(6h) + V/(16 l h))`, the count behind that paper's TFLOP/s.
pub fn megatron_eq3_flops_per_token(shape: &Shape, seq_len: u64) -> f64 {
    let (l, h) = (shape.n_layers as f64, shape.d_model as f64);
    let (s, v) = (seq_len as f64, shape.vocab as f64);
    96.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
}

/// A run priced.
#[derive(Debug, Clone, Serialize)]
pub struct Priced {
    pub id: String,
    pub group: String,
    pub role: Role,
    /// From the sources added for issue 36 ([`PublishedRun::new_source`]).
    pub new_source: bool,
    pub published_tokens_per_s_per_gpu: f64,
    pub predicted_tokens_per_s_per_gpu: f64,
    /// Predicted over published.
    pub ratio: f64,
    pub timing: Timing,
    /// The published peak memory and what it counts: `reserved` (PyTorch's
    /// `max_memory_reserved`) or `allocated` (`max_memory_allocated`).
    pub published_memory_gib: Option<f64>,
    pub published_memory: Option<&'static str>,
    /// The predicted peak of what was published, like for like: reserved
    /// ([`Prediction::reserved_bytes`]: the tensors live at the peak and what the collectives'
    /// streams keep cached) or allocated ([`Prediction::allocated_bytes`]).
    pub predicted_memory_gib: Option<f64>,
    /// The plan's peak as the planner budgets it: the reserved bytes and the runtime's own.
    pub predicted_peak_gib: f64,
    pub prediction: Prediction,
}

/// Read the data file.
pub fn read_runs(path: &Path) -> Result<RunSet, String> {
    let text = osdp_core::input::read_text(path, 16 << 20).map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The Hugging Face config a run's shape corresponds to. MPT (ALiBi, no biases) is priced
/// as a GPT-2-style block of the same widths: a learned position table and biases add well
/// under 1 % of the parameters and nothing measurable to the step.
pub fn hf_config(shape: &Shape, seq_len: u64) -> Result<serde_json::Value, String> {
    let ffn = shape.ffn_hidden.unwrap_or(4 * shape.d_model);
    let dropout = |default: f64| shape.dropout.unwrap_or(default);
    let tied = shape.tied_embeddings.unwrap_or(shape.family != "llama");
    Ok(match shape.family.as_str() {
        "mpt" | "gpt2" => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "n_embd": shape.d_model,
            "n_layer": shape.n_layers,
            "n_head": shape.n_heads,
            "n_inner": ffn,
            "n_positions": seq_len,
            "vocab_size": shape.vocab,
            "activation_function": "gelu_new",
            "tie_word_embeddings": tied,
            "resid_pdrop": dropout(0.0), "embd_pdrop": dropout(0.0), "attn_pdrop": dropout(0.0),
        }),
        "llama" => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": shape.d_model,
            "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_kv_heads.unwrap_or(shape.n_heads),
            "intermediate_size": ffn,
            "max_position_embeddings": seq_len,
            "vocab_size": shape.vocab,
            "tie_word_embeddings": tied,
            "hidden_act": "silu",
            "attention_dropout": dropout(0.0),
        }),
        "bert" => serde_json::json!({
            "architectures": ["BertForMaskedLM"],
            "hidden_size": shape.d_model,
            "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads,
            "intermediate_size": ffn,
            "max_position_embeddings": seq_len.max(512),
            "vocab_size": shape.vocab,
            "hidden_act": "gelu",
            "hidden_dropout_prob": dropout(0.1),
            "attention_probs_dropout_prob": dropout(0.1),
        }),
        other => return Err(format!("model family {other:?} is not priced here")),
    })
}

/// The run's model as a description at its sequence length.
pub fn model_of(run: &PublishedRun) -> Result<ModelSpec, String> {
    let config = hf_config(&run.model, run.seq_len)?;
    let eager = run.stack.as_ref().is_some_and(|s| s.eager_modules);
    // A stack that materialises attention keeps its scores for backward (the probabilities,
    // and with attention dropout its mask and output), as the model's eager attention says.
    let materialised = run.stack.as_ref().is_some_and(|s| !s.fused_attention);
    let opts = ImportOptions {
        seq_len: Some(run.seq_len),
        name: Some(run.model.name.clone()),
        kernels: if eager {
            Kernels::Pytorch
        } else {
            Kernels::Osdp
        },
        attention: materialised.then_some(AttentionImpl::Eager),
        ..Default::default()
    };
    import_str(
        Path::new(&format!("{}.json", run.model.name)),
        &config.to_string(),
        &opts,
    )
    .map_err(|e| e.to_string())
}

/// Give a layout's device and its link inside the node a known-GPU row's figures and `model`
/// (the name the cost model finds that row by again).
fn take_row(l: &mut Layout, k: &osdp_core::cluster::known::KnownGpu, model: String) {
    let fig = |value: f64| Figure {
        value,
        source: k.source.into(),
    };
    l.device.model = model;
    l.device.dense_tflops.bf16 = k.bf16_tflops.map(fig);
    l.device.dense_tflops.fp16 = Some(fig(k.fp16_tflops));
    l.device.dense_tflops.fp32 = Some(fig(k.fp32_tflops));
    l.device.memory_bandwidth_gb_per_s = fig(k.memory_gb_per_s);
    l.intra_node.kind = k.link;
    l.intra_node.bus_bandwidth_gb_per_s = fig(k.link_gb_per_s);
}

/// The layout file a run's GPUs are described by, under `layouts`.
fn layout_file(run: &PublishedRun) -> Result<&'static str, String> {
    let g = run.gpu.to_uppercase();
    let ampere = g.contains("A100") || g.contains("A800");
    // An H200 is an H100's Hopper die with more and faster memory: the H100's node and network,
    // the H200's own device ([`layout_of`]).
    let hopper = g.contains("H100") || g.contains("H200");
    Ok(match (hopper, ampere, run.multi_node()) {
        (true, _, false) => "h100-sxm-8x-nvlink.json",
        (true, _, true) => "h100-sxm-2x8-ib-ndr.json",
        (_, true, false) => "a100-80gb-8x-nvlink.json",
        (_, true, true) => "a100-80gb-2x8-ib-hdr.json",
        // A DGX-2's V100s: its 16 GPUs in one node; other V100 nodes start from it
        // ([`layout_of`] sets their memory, and the network of a multi-node run).
        _ if g.contains("V100") => "v100-dgx2-1x.json",
        _ => return Err(format!("no layout for GPU {:?}", run.gpu)),
    })
}

/// The run's cluster: the shipped layout of its GPUs with its node count, memory size and
/// gradient reduce dtype.
pub fn layout_of(run: &PublishedRun, layouts: &Path) -> Result<Layout, String> {
    let path: PathBuf = layouts.join(layout_file(run)?);
    let mut l = read_layout(&path).map_err(|e| e.to_string())?;
    let (Some(nodes), Some(per_node)) = (run.nodes, run.gpus_per_node) else {
        return Err("the source does not say how many GPUs".into());
    };
    l.nodes = nodes;
    l.gpus_per_node = per_node;
    if run.gpu.to_uppercase().contains("H200") {
        l.device = read_layout(&layouts.join("h200-1x.json"))
            .map_err(|e| e.to_string())?
            .device;
    }
    for (size, gib) in [("40GB", 40.0), ("96GB", 94.0)] {
        if run.gpu.to_uppercase().contains(size) {
            l.device.memory_gib = Figure {
                value: gib,
                source: format!("{} as the run names it", run.gpu),
            };
        }
    }
    // The 16 GB V100 (DGX-1 class); between nodes, InfiniBand at the run's stated rate.
    if run.gpu.to_uppercase().contains("V100-SXM2-16GB") {
        l.device.model = format!("Tesla {}", run.gpu.trim_start_matches("Tesla "));
        l.device.memory_gib = Figure {
            value: 15.78,
            source: "NVIDIA V100 SXM2 16 GB: nvidia-smi reports 16160 MiB".into(),
        };
    }
    // A V100 part with its own row (the DGX-2H's, at 450 W): that row's figures.
    if let Some(k) = osdp_core::cluster::known::lookup(&run.gpu)
        .filter(|k| k.pattern.starts_with("V100") && k.pattern != "V100")
    {
        take_row(
            &mut l,
            k,
            format!("Tesla {}", run.gpu.trim_start_matches("Tesla ")),
        );
    }
    if run.gpu.to_uppercase().contains("V100") && run.multi_node() && l.inter_node.is_none() {
        let ib =
            read_layout(&layouts.join("a100-80gb-2x8-ib-hdr.json")).map_err(|e| e.to_string())?;
        l.inter_node = ib.inter_node;
    }
    // The 40 GB A100 has HBM2, not the 80 GB one's HBM2e: element-wise ops run at its rate.
    if run.gpu.to_uppercase().contains("A100-40GB") {
        l.device.memory_bandwidth_gb_per_s = Figure {
            value: A100_40GB_MEMORY_GB_PER_S,
            source: "NVIDIA A100 datasheet: 1,555 GB/s HBM2 on the 40 GB SXM".into(),
        };
    }
    // An A800 is the A100 part with a slower NVLink: its own row (cluster::known).
    if let Some(k) =
        osdp_core::cluster::known::lookup(&run.gpu).filter(|_| run.gpu.contains("A800"))
    {
        take_row(&mut l, k, format!("NVIDIA {}", run.gpu));
    }
    // A node with fewer GPUs than the layout's NICs, where the run does not say: one NIC per
    // GPU, as the shipped layouts' DGX nodes have (rail-optimised), not the layout's count.
    if let Some(nics) = l.inter_node.as_mut().and_then(|i| i.nics_per_node.as_mut()) {
        if run.nics_per_node.is_none() && nics.value > f64::from(per_node) {
            *nics = Figure {
                value: f64::from(per_node),
                source: format!(
                    "not stated by the run: one per GPU ({per_node} a node), as on the layout's DGX"
                ),
            };
        }
    }
    if let (Some(n), Some(inter)) = (run.nics_per_node, l.inter_node.as_mut()) {
        inter.nics_per_node = Some(Figure {
            value: f64::from(n),
            source: "NICs per node as the run's source names them".into(),
        });
    }
    l.gradient_reduce_dtype = match run.reduce_dtype.as_deref().unwrap_or("fp32") {
        "fp32" => Some(osdp_core::cluster::ReduceDType::Fp32),
        // fp16 gradients are as many bytes on the wire as bf16 ones.
        "bf16" | "fp16" => Some(osdp_core::cluster::ReduceDType::Bf16),
        other => return Err(format!("reduce dtype {other:?}")),
    };
    if let (Some(net), Some(inter)) = (run.network_gb_per_s_per_node, l.inter_node.as_mut()) {
        inter.nics_per_node = None;
        inter.bus_bandwidth_gb_per_s = Figure {
            value: net * NCCL_NETWORK_EFFICIENCY,
            source: format!(
                "{net} GB/s per node as the run's source states it, at NCCL's ~92 % of line rate"
            ),
        };
    }
    Ok(l)
}

/// The A100 40 GB SXM's memory bandwidth (NVIDIA A100 datasheet; the 80 GB SXM has 2,039).
const A100_40GB_MEMORY_GB_PER_S: f64 = 1555.0;

/// What NCCL achieves of a network's line rate (46 of 50 GB/s on InfiniBand NDR).
const NCCL_NETWORK_EFFICIENCY: f64 = 0.92;

/// The strategy a run's sharding names.
pub fn strategy_of(sharding: &str) -> Result<Strategy, String> {
    Ok(match sharding.to_uppercase().as_str() {
        "FULL_SHARD" | "ZERO3" => Strategy::Zero3,
        "HYBRID_SHARD" | "HSDP" => Strategy::Hsdp,
        "SHARD_GRAD_OP" | "ZERO2" => Strategy::Zero2,
        "ZERO1" => Strategy::Zero1,
        "NO_SHARD" | "DDP" => Strategy::Dp,
        other => return Err(format!("sharding {other} has no single-strategy plan")),
    })
}

/// Which blocks a run recomputes.
enum Recompute {
    None,
    /// Every n-th block from the first (n = 1: all of them).
    Every(usize),
    /// A fraction of the blocks, spread by fms-fsdp's rule.
    Fraction(f64),
}

impl Recompute {
    fn of(run: &PublishedRun) -> Result<Recompute, String> {
        let ac = run.activation_checkpointing.as_str();
        if run.selective_ops && ac != "selective" {
            return Err(format!(
                "{}: selective_ops needs activation checkpointing \"selective\", not {ac:?}",
                run.id
            ));
        }
        Ok(match (ac, run.recompute_every, run.recompute_fraction) {
            ("full", None, None) => Recompute::Every(1),
            // Op by op in every block (`Machine::selective_ops` says which ops run again).
            ("selective", None, None) if run.selective_ops => Recompute::Every(1),
            ("none", None, None) => Recompute::None,
            ("selective", Some(n), None) if n > 0 => Recompute::Every(n),
            ("selective", None, Some(p)) if p > 0.0 && p <= 1.0 => Recompute::Fraction(p),
            _ => {
                return Err(format!(
                    "{}: activation checkpointing {ac:?} (every {:?}, fraction {:?})",
                    run.id, run.recompute_every, run.recompute_fraction
                ))
            }
        })
    }

    /// Whether block `b` (from 0) is recomputed.
    fn on(&self, b: usize) -> bool {
        match *self {
            Recompute::None => false,
            Recompute::Every(n) => b % n == 0,
            // fms-fsdp's rule: block i (from 1) is wrapped where i·p reaches the next cut-off,
            // ½, 1½, 2½, …, which is where ⌊i·p + ½⌋ first grows.
            Recompute::Fraction(p) => {
                let reached = |i: usize| (i as f64 * p + 0.5).floor();
                reached(b + 1) > reached(b)
            }
        }
    }
}

/// Price one run on the layouts under `layouts`, `adjust` changing the layout first (to fit
/// efficiencies).
pub fn price_run(
    run: &PublishedRun,
    layouts: &Path,
    adjust: &dyn Fn(&mut Layout),
) -> Result<Priced, String> {
    price_run_tuned(run, layouts, adjust, &|_| {})
}

/// Price a run for its published memory: as [`price_run`], on the stand-in GPU's rates where
/// its own are unstated ([`PublishedRun::memory_priced_on`]).
pub fn price_memory(run: &PublishedRun, layouts: &Path) -> Result<Priced, String> {
    price_run(&run.for_memory(), layouts, &|_| {})
}

/// [`price_run`], `tune` changing the resolved machine too (to fit figures that are not the
/// layout's).
pub fn price_run_tuned(
    run: &PublishedRun,
    layouts: &Path,
    adjust: &dyn Fn(&mut Layout),
    tune: &dyn Fn(&mut Machine),
) -> Result<Priced, String> {
    let published = run
        .tokens_per_s_per_gpu()
        .ok_or_else(|| format!("{}: no published tokens/s", run.id))?;
    let model = model_of(run)?;
    let mut layout = layout_of(run, layouts)?;
    adjust(&mut layout);
    let mut m = Machine::new(&layout, &model);
    let strategy = strategy_of(run.sharding.as_deref().unwrap_or("(not stated)"))?;
    // A run fetches again to recompute only where its stack says so (DeepSpeed ZeRO-3 of
    // 2021); FSDP keeps a unit gathered from its backward's gather through the recomputation.
    m.regather_on_recompute = false;
    // cuDNN's attention is PyTorch's default on Hopper only since 2.11's bundled cuDNN: a
    // published run's stack says so where it ran it.
    m.cudnn_attention = false;
    if let Some(stack) = &run.stack {
        m.fused_attention &= stack.fused_attention;
        m.flash_attention_1 = stack.flash_attention_1;
        m.cudnn_attention = stack.cudnn_attention && m.fused_attention;
        m.loss_fp32_logit_copies = stack.loss_fp32_logit_copies;
        m.loss_frees_logits = stack.loss_frees_logits;
        m.fsdp2_root_unsharded = stack.fsdp2_root_unit;
        m.fsdp2_block_units = stack.fsdp2_block_units;
        m.fsdp2_last_block_unsharded = stack.fsdp2_last_block_unsharded;
        m.block_collectives &= !stack.per_module_collectives;
        m.serial_gathers = stack.serial_gathers;
        m.fused_softmax = stack.fused_softmax;
        m.autocast = stack.autocast;
        m.overlap &= !stack.collectives_not_overlapped;
        m.gradient_bucket_elements = match (stack.flat_gradients, stack.gradient_bucket_elements) {
            (false, None) => None,
            (true, None) => Some(f64::INFINITY),
            (false, Some(n)) if n > 0 => Some(n as f64),
            _ => {
                return Err(format!(
                    "{}: a stack has flat gradients or buckets of a positive size, not both",
                    run.id
                ))
            }
        };
        // Buckets describe the gradients' reduction of replicated parameters; a stack that
        // gathers parameters per module issues those collectives otherwise.
        let sharded_params = matches!(strategy, Strategy::Zero3 | Strategy::Hsdp);
        if m.gradient_bucket_elements.is_some() && (sharded_params || stack.fsdp2) {
            return Err(format!(
                "{}: gradient buckets are priced only where parameters stay whole (DDP, ZeRO-1/2)",
                run.id
            ));
        }
        m.regather_on_recompute = stack.regathers_on_recompute;
        m.persistence_threshold = stack.param_persistence_threshold;
        if stack.fsdp2 {
            m.set_target(Target::Fsdp2, &model);
        }
        if stack.hf_trainer_optimizer {
            m.optimizer_bytes_per_param = HF_TRAINER_STEP_BYTES_PER_PARAM;
        }
        if let Some([fwd, bwd]) = stack.loss_bytes_per_logit {
            if !(fwd.is_finite() && bwd.is_finite() && fwd >= 0.0 && bwd >= 0.0) {
                return Err(format!("{}: loss_bytes_per_logit [{fwd}, {bwd}]", run.id));
            }
            m.loss_bytes_per_logit = Some((fwd, bwd));
        }
        m.eager_rotary = stack.rotary;
        if let Some(g) = stack.zero1_ranks {
            if strategy != Strategy::Dp || g < 2 || m.ranks % g != 0 {
                return Err(format!(
                    "{}: zero1_ranks {g} needs DDP's all-reduced gradients and a group size \
                     above 1 that divides the {} ranks",
                    run.id, m.ranks
                ));
            }
            // Every parameter tensor the model owns (tied ones once), as the cost model holds it.
            let sizes: Vec<u64> = model
                .ops
                .iter()
                .flat_map(|op| Owned::of(op, 1).tensors)
                .map(|t| t.numel)
                .collect();
            m.zero1_groups = Some(Zero1Groups::dealt(&sizes, g));
        }
        match (stack.optimizer_bytes_per_param, stack.hf_trainer_optimizer) {
            (Some(_), true) => {
                return Err(format!(
                    "{}: optimizer_bytes_per_param or hf_trainer_optimizer, not both",
                    run.id
                ))
            }
            (Some(bytes), false) => m.optimizer_bytes_per_param = bytes,
            _ => {}
        }
        if let Some(bytes) = stack.param_pass_bytes {
            if !(bytes.is_finite() && bytes >= 0.0) {
                return Err(format!("{}: param_pass_bytes {bytes}", run.id));
            }
            m.param_pass_bytes = bytes;
        }
    }
    m.selective_ops = run.selective_ops;
    tune(&mut m);
    let recompute = Recompute::of(run)?;
    let baseline = Baseline {
        strategy,
        checkpointing: !matches!(recompute, Recompute::None),
    };
    let mut plan = baseline.plan(&model, run.micro_batch, run.grad_accum.unwrap_or(1).max(1));
    for (b, on) in plan.recompute.iter_mut().enumerate() {
        *on = recompute.on(b);
    }
    // A stack that can express fewer plans (FSDP2: no zero1, no splits) prices only those.
    for c in &plan.choices {
        m.target
            .allows(*c)
            .map_err(|why| format!("{}: {why}", run.id))?;
    }
    let p = evaluate(&model, &m, &plan);
    let predicted = p.tokens_per_s / f64::from(m.ranks);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let memory = run
        .published
        .memory_reserved_gib
        .map(|r| (r, "reserved"))
        .or(run.published.memory_allocated_gib.map(|a| (a, "allocated")));
    Ok(Priced {
        id: run.id.clone(),
        group: run.group(),
        timing: run.timing,
        role: run.role,
        new_source: run.new_source(),
        published_tokens_per_s_per_gpu: published,
        predicted_tokens_per_s_per_gpu: predicted,
        ratio: predicted / published,
        published_memory_gib: memory.map(|(published, _)| published),
        published_memory: memory.map(|(_, kind)| kind),
        predicted_memory_gib: memory.map(|(_, kind)| {
            gib(if kind == "reserved" {
                p.reserved_bytes()
            } else {
                p.allocated_bytes()
            })
        }),
        predicted_peak_gib: gib(p.peak_memory_bytes),
        prediction: p,
    })
}

/// The predicted/published peak memory range a run must stay in unless it names its own:
/// never below (an under-predicted peak is an out-of-memory crash), at most 1.5 times.
pub const MEMORY_BAND: [f64; 2] = [1.0, 1.5];

/// The predicted/published range a run must stay in unless it names its own.
pub const DEFAULT_BAND: [f64; 2] = [0.8, 1.25];

/// Geometric mean of predicted/published.
pub fn geometric_mean(ratios: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = ratios
        .into_iter()
        .fold((0.0, 0usize), |(s, n), r| (s + r.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}
