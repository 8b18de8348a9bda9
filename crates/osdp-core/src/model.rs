//! The model description: an operator graph with parameter shapes, FLOPs and activation sizes
//! (`model.json`, format version 1), how it is read and checked, how it is built from a
//! Hugging Face `config.json`, and the summary `inspect` prints.
//!
//! Every per-op figure is **per sample** (one sequence of `config.seq_len` tokens): the planner
//! multiplies by the micro-batch size.

mod builder;
pub mod hf;
mod load;
pub mod saved;
mod summary;

pub use crate::input::{InputError, Problem};
pub use builder::GraphBuilder;
pub use load::{from_json_str, read_model, validate, write_model};
pub use summary::{KindSummary, ModelSummary};

use serde::{Deserialize, Serialize};

/// The `version` this build reads and writes.
pub const MODEL_FORMAT_VERSION: u32 = 1;

/// Most transformer layers a description may have. The deepest trained models have about a
/// hundred; the planner and the dashboard size per-layer tables by this, so a small file
/// claiming 2^31 layers must not reach them.
pub const MAX_LAYERS: u64 = 10_000;

/// Largest width a model may have (hidden, embedding, FFN, heads, head size; the widest models
/// have a few tens of thousands), and the longest sequence it may be priced at. With these
/// bounds every figure the graph builder multiplies out fits in 64 bits.
pub const MAX_WIDTH: u64 = 1 << 20;
/// Largest vocabulary, of tokens or of token types (real ones reach a few hundred thousand).
pub const MAX_VOCAB: u64 = 1 << 22;
/// Largest position table, and the most rows a table may skip (`position_offset`); only
/// `seq_len` of it is priced, so it may be longer than [`MAX_WIDTH`].
pub const MAX_POSITIONS: u64 = 1 << 31;

/// A whole model description, as stored in `model.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub version: u32,
    pub name: String,
    pub family: Family,
    /// Where the description came from (e.g. the Hugging Face config it was imported from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    pub config: ModelConfig,
    pub ops: Vec<OpSpec>,
    /// The Hugging Face `config.json` this description was imported from, kept whole so that
    /// `export-hf` can write it back beside trained weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_config: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Architecture family: decides how the trainer wires the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Gpt2,
    Opt,
    Llama,
    Bert,
    /// Any PyTorch `nn.Module`, described from the live module by `osdp_torch.describe`: its
    /// ops are `module` ops (one per module that owns parameters or computes outside its
    /// children), priced from their measured figures. The planner reads only `config.seq_len`
    /// (items per sample, for tokens/s), `config.layers` (the block count) and `config.dtype`;
    /// the other config fields hold neutral values. `plan`, `evaluate` and `export --to fsdp2`
    /// take it; osdp-tui's own trainer cannot build it and `train` says so.
    Torch,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Opt => "opt",
            Family::Llama => "llama",
            Family::Bert => "bert",
            Family::Torch => "torch",
        }
    }
}

/// The hyperparameters the trainer needs to build and run the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: u64,
    /// Tokens per sample the description is priced at.
    pub seq_len: u64,
    /// Longest sequence the positional scheme supports.
    pub max_positions: u64,
    /// Width of the residual stream.
    pub hidden: u64,
    /// Width of the token embedding (differs from `hidden` for some OPT models, which project in/out).
    pub embed_dim: u64,
    pub layers: u64,
    pub heads: u64,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Inner width of the MLP.
    pub ffn_hidden: u64,
    pub norm: NormKind,
    pub norm_eps: f64,
    pub norm_position: NormPosition,
    /// Whether a norm follows the last block.
    pub final_norm: bool,
    pub activation: Activation,
    /// SwiGLU-style MLP (`act(gate(x)) * up(x)`).
    pub gated_mlp: bool,
    /// The output head shares the token-embedding weight.
    pub tied_embeddings: bool,
    pub bias: Biases,
    pub positional: Positional,
    /// Learned positional tables of OPT start at this row.
    pub position_offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Rows of the segment (token-type) embedding; 0 when the model has none.
    pub type_vocab_size: u64,
    /// Causal (decoder) attention, or bidirectional (encoder).
    pub causal: bool,
    /// Dropout probability on embeddings and residual branches.
    pub dropout: f64,
    pub attention_dropout: f64,
    /// How attention is computed: decides what the attention core saves for backward.
    pub attention: AttentionImpl,
    /// Whose kernels the other ops' saved bytes assume (absent: osdp-tui's own).
    #[serde(default, skip_serializing_if = "Kernels::is_osdp")]
    pub kernels: Kernels,
    /// Under [`Kernels::Pytorch`], a tanh GELU that the model's code composes of one PyTorch op
    /// per arithmetic step (absent: one fused kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub composed_gelu: Option<ComposedGelu>,
    /// Compute and activation dtype the per-op byte figures are given in.
    pub dtype: DType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Biases {
    pub qkv: bool,
    pub attn_out: bool,
    pub mlp: bool,
    pub norm: bool,
    pub lm_head: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    LayerNorm,
    RmsNorm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPosition {
    /// Norm before each sub-layer (GPT-2, LLaMA, most OPT).
    Pre,
    /// Norm after each residual add (BERT, OPT-350m).
    Post,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Exact (erf) GELU.
    Gelu,
    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    Relu,
    Silu,
}

impl Activation {
    /// The name model.json uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Positional {
    /// A learned table of position embeddings.
    Learned,
    /// Rotary embeddings applied to queries and keys (no parameters).
    Rotary,
}

/// Whose kernels run the model, which decides what its norms, out-projections and gated MLPs
/// keep for backward ([`saved`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernels {
    /// osdp-tui's trainer: a norm keeps its input and recomputes its statistics, the
    /// out-projection reads attention's output in place, a gated MLP recomputes its activation.
    #[default]
    Osdp,
    /// PyTorch's eager modules (transformers' code, as FSDP2 runs it): LayerNorm also keeps an
    /// fp32 mean and reciprocal deviation per row; RMSNorm its fp32 upcast input, the normalised
    /// tensor and an fp32 reciprocal per row; the out-projection a contiguous copy of the heads'
    /// output; a gated MLP the activation's output as well as both inputs.
    Pytorch,
}

impl Kernels {
    pub fn is_osdp(&self) -> bool {
        *self == Kernels::Osdp
    }
}

/// transformers' tanh GELUs written as PyTorch expressions rather than the fused
/// `gelu(approximate="tanh")`: `gelu_new` (`NewGELUActivation`, GPT-2's default) and
/// `gelu_fast` (`FastGELUActivation`). Each step is its own kernel, a pass through memory each
/// way ([`crate::cost::graph::EAGER_GELU_NEW_PASSES`]), and autograd keeps intermediates.
/// Counted by `scripts/eager-passes.py` (torch 2.11, transformers 5.24: the expressions are
/// unchanged since 4.x).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComposedGelu {
    New,
    Fast,
}

impl ComposedGelu {
    /// The config's activation name, when it is one of these.
    pub fn from_hf(name: &str) -> Option<ComposedGelu> {
        match name {
            "gelu_new" => Some(ComposedGelu::New),
            "gelu_fast" => Some(ComposedGelu::Fast),
            _ => None,
        }
    }

    /// Activation-sized tensors autograd keeps beside the input (pow/tanh/product operands).
    pub fn kept_tensors(self) -> u64 {
        match self {
            ComposedGelu::New => 3,
            ComposedGelu::Fast => 6,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionImpl {
    /// Materialised softmax: saves the `heads × seq²` probabilities (and dropout mask).
    Eager,
    /// Fused (flash / SDPA): saves only the output and a log-sum-exp per row.
    Flash,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub const fn bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

/// One operator of the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpSpec {
    /// Unique, stable identifier (what `--pin` and plan files name).
    pub id: String,
    /// Module path in the source framework (e.g. `transformer.h.0.attn.c_attn`).
    pub name: String,
    pub kind: OpKind,
    /// Index of the repeated block the op belongs to; `null` for ops outside the blocks.
    #[serde(default)]
    pub block: Option<u32>,
    /// Ids of the ops whose outputs this op reads, in argument order.
    pub inputs: Vec<String>,
    pub params: Vec<ParamSpec>,
    /// Shape of the output for one sample (e.g. `[seq, hidden]`).
    pub output_shape: Vec<i64>,
    /// Forward FLOPs for one sample.
    pub fwd_flops_per_sample: u64,
    /// Bytes this op keeps alive from forward to backward, for one sample. A tensor saved by
    /// several ops is counted once, at the first of them.
    pub saved_bytes_per_sample: u64,
    /// Bytes of the op's output, for one sample.
    pub output_bytes_per_sample: u64,
}

/// Operator kinds the planner prices and the trainer executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Token (or segment) embedding lookup: weight `[rows, dim]`.
    Embedding,
    /// Learned position table: weight `[positions, dim]`.
    PositionalEmbedding,
    LayerNorm,
    RmsNorm,
    /// `y = x Wᵀ + b`, weight `[out, in]`.
    Linear,
    /// Attention core (scores, softmax, weighted sum; rotary when the model uses it): inputs are
    /// a fused `qkv` or separate `q`, `k`, `v`.
    Attention,
    /// Element-wise activation; with two inputs, gated (`act(gate) * up`).
    Activation,
    /// Element-wise sum of its inputs (residual connections), with the branch dropout if any.
    Add,
    /// Softmax cross-entropy over the vocabulary: the loss head.
    CrossEntropy,
    /// A PyTorch module described by `osdp_torch.describe` (family `torch`): parameters of any
    /// shape, any inputs, and only its measured figures (forward FLOPs, saved and output
    /// bytes), from which it is priced. osdp-tui's own trainer does not run it.
    Module,
}

impl OpKind {
    pub const ALL: [OpKind; 10] = [
        OpKind::Embedding,
        OpKind::PositionalEmbedding,
        OpKind::LayerNorm,
        OpKind::RmsNorm,
        OpKind::Linear,
        OpKind::Attention,
        OpKind::Activation,
        OpKind::Add,
        OpKind::CrossEntropy,
        OpKind::Module,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::PositionalEmbedding => "positional_embedding",
            OpKind::LayerNorm => "layer_norm",
            OpKind::RmsNorm => "rms_norm",
            OpKind::Linear => "linear",
            OpKind::Attention => "attention",
            OpKind::Activation => "activation",
            OpKind::Add => "add",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Module => "module",
        }
    }
}

/// One parameter tensor of an op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    pub name: String,
    /// Dimensions; signed so that a negative value is reported as such, not as a type error.
    pub shape: Vec<i64>,
    pub dtype: DType,
    /// `OP_ID.PARAM` of the parameter this one shares storage with (tied embeddings): counted
    /// once, at its owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_to: Option<String>,
}

impl ParamSpec {
    /// Element count; only meaningful on a validated model (dimensions positive, no overflow).
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }

    /// The op id and parameter name this parameter is tied to, when it is (see
    /// [`split_param_key`]; `None` also for a malformed target, which `validate` refuses).
    pub fn tie_target(&self) -> Option<(&str, &str)> {
        self.tied_to.as_deref().and_then(split_param_key)
    }
}

/// `OP_ID.PARAM`: how a parameter is named across the model (`tied_to`, the trainer's units,
/// checkpoints).
pub fn param_key(op_id: &str, param: &str) -> String {
    format!("{op_id}.{param}")
}

/// The op id and parameter name of an `OP_ID.PARAM` key. Op ids may hold dots
/// (`h0.attn.c_attn`), parameter names do not: the name is what follows the last one.
pub fn split_param_key(key: &str) -> Option<(&str, &str)> {
    key.rsplit_once('.')
}

impl ModelSpec {
    /// Parameters owned by this model, tied ones counted once (Hugging Face's `num_parameters()`).
    pub fn param_count(&self) -> u64 {
        self.ops
            .iter()
            .flat_map(|op| &op.params)
            .filter(|p| p.tied_to.is_none())
            .map(ParamSpec::numel)
            .sum()
    }

    /// Parameters owned by one op (tied ones excluded).
    pub fn op_param_count(op: &OpSpec) -> u64 {
        op.params
            .iter()
            .filter(|p| p.tied_to.is_none())
            .map(ParamSpec::numel)
            .sum()
    }

    /// Position in `ops` of the op that owns the storage `p` is tied to; `None` when `p` is
    /// not tied (or, before validation, names no op).
    pub fn tie_owner(&self, p: &ParamSpec) -> Option<usize> {
        let (owner, _) = p.tie_target()?;
        self.ops.iter().position(|o| o.id == owner)
    }

    /// Op id → position in `ops`.
    pub fn op_index(&self) -> std::collections::HashMap<&str, usize> {
        self.ops
            .iter()
            .enumerate()
            .map(|(i, o)| (o.id.as_str(), i))
            .collect()
    }

    /// Number of distinct blocks.
    pub fn block_count(&self) -> usize {
        let mut blocks: Vec<u32> = self.ops.iter().filter_map(|o| o.block).collect();
        blocks.sort_unstable();
        blocks.dedup();
        blocks.len()
    }
}
