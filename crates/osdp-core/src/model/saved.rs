//! What each op keeps from forward for its backward: one rule for the bytes the builder writes
//! into `saved_bytes_per_sample`, the tensors the trainer keeps, and the part of those bytes
//! whose dtype does not follow the compute dtype (which the cost model must not convert).

use super::{Activation, AttentionImpl, DType, Kernels, ModelConfig, OpKind, OpSpec};

/// Bytes of a token id (int64), which an embedding keeps to scatter its gradient.
pub const TOKEN_ID_BYTES: u64 = 8;

/// Bytes of what kernels keep in fp32 whatever the compute dtype: fused attention's
/// log-sum-exp per row and head, the loss's log-probabilities.
pub const FP32_BYTES: u64 = DType::F32.bytes();

/// The graph's tensors an op's backward reads: the first `inputs` of its inputs, and its own
/// output when `output`. Whoever keeps a tensor for several ops keeps it once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardReads {
    pub inputs: usize,
    pub output: bool,
}

/// What the kernels of an op of `kind` with `inputs` inputs read in backward (Korthikanti et
/// al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §4.1): a linear
/// or a norm its input; attention its inputs and, fused, its own output (eager attention keeps
/// its probabilities instead, counted apart); ReLU its own output, other activations their
/// inputs; embeddings, adds and the loss none of the graph's tensors.
pub fn backward_reads(kind: OpKind, inputs: usize, config: &ModelConfig) -> BackwardReads {
    let (inputs, output) = match kind {
        OpKind::Linear | OpKind::LayerNorm | OpKind::RmsNorm => (inputs.min(1), false),
        OpKind::Attention => (inputs, config.attention == AttentionImpl::Flash),
        OpKind::Activation if inputs == 1 && config.activation == Activation::Relu => (0, true),
        OpKind::Activation => (inputs, false),
        OpKind::Embedding | OpKind::PositionalEmbedding | OpKind::Add | OpKind::CrossEntropy => {
            (0, false)
        }
        // A described module's measured saved bytes are all it keeps (graph tensors included).
        OpKind::Module => (0, false),
    };
    BackwardReads { inputs, output }
}

/// Per-sample bytes a token (or segment) embedding keeps: its ids.
pub fn token_ids_bytes(config: &ModelConfig) -> u64 {
    config.seq_len.saturating_mul(TOKEN_ID_BYTES)
}

/// Per-sample bytes fused attention keeps besides its output: an fp32 log-sum-exp per row and
/// head.
pub fn log_sum_exp_bytes(config: &ModelConfig) -> u64 {
    config
        .heads
        .saturating_mul(config.seq_len)
        .saturating_mul(FP32_BYTES)
}

/// Per-sample fp32 bytes PyTorch's eager norm of `elements` per sample over rows of `width`
/// keeps besides a tensor of its own size in the compute dtype: LayerNorm (`native_layer_norm`)
/// an fp32 mean and reciprocal deviation per row; RMSNorm as transformers writes it
/// (`x.float()`, `pow`, `mean`, `rsqrt`, two products) the fp32 input its products read and an
/// fp32 reciprocal per row, the normalised tensor being the compute-dtype one.
pub fn pytorch_norm_fp32_bytes(kind: OpKind, elements: u64, width: u64) -> u64 {
    let rows = elements / width.max(1);
    match kind {
        OpKind::LayerNorm => rows.saturating_mul(2 * FP32_BYTES),
        OpKind::RmsNorm => elements.saturating_add(rows).saturating_mul(FP32_BYTES),
        _ => 0,
    }
}

/// Per-sample bytes of `op`'s saved figure whose dtype is fixed rather than the compute dtype:
/// an embedding's token ids, fused attention's log-sum-exp, all of the loss's (fp32
/// log-probabilities), PyTorch's eager norms' fp32 statistics and upcast input. The cost model
/// converts the rest to the training precision and keeps these as they are. Never more than
/// the op's figure (a hand-written one may be smaller).
pub fn fixed_dtype_saved_bytes(op: &OpSpec, config: &ModelConfig) -> u64 {
    let fixed = match op.kind {
        OpKind::Embedding => token_ids_bytes(config),
        OpKind::Attention if config.attention == AttentionImpl::Flash => log_sum_exp_bytes(config),
        OpKind::CrossEntropy => op.saved_bytes_per_sample,
        OpKind::LayerNorm | OpKind::RmsNorm if config.kernels == Kernels::Pytorch => {
            let elements = op
                .output_shape
                .iter()
                .fold(1u64, |n, &d| n.saturating_mul(d.max(0) as u64));
            let width = op.output_shape.last().map_or(1, |&w| w.max(1) as u64);
            pytorch_norm_fp32_bytes(op.kind, elements, width)
        }
        _ => 0,
    };
    fixed.min(op.saved_bytes_per_sample)
}
