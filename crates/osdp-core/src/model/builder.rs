//! Builds a consistent operator graph op by op, computing output shapes, forward FLOPs and the
//! bytes each op saves for backward from the model's hyperparameters. The Hugging Face importer
//! uses it; so can tests that need valid graphs.
//!
//! Saved-for-backward accounting follows what the kernels keep ([`super::saved`], after
//! Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
//! section 4.1): a linear keeps its input, a norm its input, GELU/SiLU their input, ReLU its
//! output, eager attention its Q, K, V and the softmax probabilities, dropout a 1-byte mask. A
//! tensor kept by several ops is counted once, at the first op that keeps it. Per-row norm
//! statistics (a few bytes per token) are left out, as in that paper, so a GPT block sums to
//! exactly `34·s·h + 5·a·s²` bytes per sample — for osdp-tui's kernels; a model for PyTorch's
//! eager modules ([`Kernels::Pytorch`]) also keeps what those modules keep beside it.

use std::collections::{HashMap, HashSet};

use super::saved::{
    backward_reads, log_sum_exp_bytes, pytorch_norm_fp32_bytes, token_ids_bytes, FP32_BYTES,
};
use super::{
    Activation, AttentionImpl, DType, Family, Kernels, ModelConfig, ModelSpec, OpKind, OpSpec,
    ParamSpec, MODEL_FORMAT_VERSION,
};

/// Master weights are stored in fp32 whatever the compute dtype.
const PARAM_DTYPE: DType = DType::F32;

/// Approximate FLOPs per element of the element-wise kernels (their time is bandwidth-bound;
/// the figure only keeps FLOP totals honest).
const LAYER_NORM_FLOPS_PER_ELEM: u64 = 7;
const RMS_NORM_FLOPS_PER_ELEM: u64 = 4;
const SOFTMAX_XENT_FLOPS_PER_ELEM: u64 = 4;

/// Figures saturate rather than wrap: a config whose sizes do not fit in 64 bits gives a
/// description that `validate` refuses (it checks the totals), never a panic or a small number.
pub struct GraphBuilder {
    config: ModelConfig,
    ops: Vec<OpSpec>,
    shapes: HashMap<String, Vec<i64>>,
    /// Ops whose output some op already keeps for backward.
    kept: HashSet<String>,
    block: Option<u32>,
}

impl GraphBuilder {
    pub fn new(config: ModelConfig) -> Self {
        GraphBuilder {
            config,
            ops: Vec::new(),
            shapes: HashMap::new(),
            kept: HashSet::new(),
            block: None,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Ops added from now on belong to `block` (`None`: outside the repeated blocks).
    pub fn set_block(&mut self, block: Option<u32>) {
        self.block = block;
    }

    /// The figures are for PyTorch's eager modules ([`Kernels::Pytorch`]).
    fn pytorch(&self) -> bool {
        self.config.kernels == Kernels::Pytorch
    }

    fn act_bytes(&self) -> u64 {
        self.config.dtype.bytes()
    }

    fn seq(&self) -> u64 {
        self.config.seq_len
    }

    fn shape(&self, id: &str) -> &[i64] {
        self.shapes
            .get(id)
            .unwrap_or_else(|| panic!("GraphBuilder: op {id:?} used before it was added"))
    }

    fn numel(shape: &[i64]) -> u64 {
        shape.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64))
    }

    /// Bytes to keep `id`'s output for backward, or 0 when another op already keeps it.
    fn keep(&mut self, id: &str) -> u64 {
        if self.kept.insert(id.to_string()) {
            Self::numel(self.shape(id)).saturating_mul(self.act_bytes())
        } else {
            0
        }
    }

    /// Bytes of the graph tensors `kind`'s backward reads ([`backward_reads`]) that no earlier
    /// op keeps: some of `inputs`, and the op's own output of `output_shape`.
    fn keep_reads(&mut self, id: &str, kind: OpKind, inputs: &[&str], output_shape: &[i64]) -> u64 {
        let reads = backward_reads(kind, inputs.len(), &self.config);
        let mut bytes = inputs[..reads.inputs]
            .iter()
            .fold(0u64, |n, i| n.saturating_add(self.keep(i)));
        if reads.output && self.kept.insert(id.to_string()) {
            bytes =
                bytes.saturating_add(Self::numel(output_shape).saturating_mul(self.act_bytes()));
        }
        bytes
    }

    fn param(name: &str, shape: &[u64], tied_to: Option<&str>) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            dtype: PARAM_DTYPE,
            tied_to: tied_to.map(str::to_string),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        id: &str,
        name: &str,
        kind: OpKind,
        inputs: &[&str],
        params: Vec<ParamSpec>,
        output_shape: Vec<i64>,
        fwd_flops: u64,
        saved_bytes: u64,
    ) -> String {
        let output_bytes = if kind == OpKind::CrossEntropy {
            DType::F32.bytes()
        } else {
            Self::numel(&output_shape).saturating_mul(self.act_bytes())
        };
        self.shapes.insert(id.to_string(), output_shape.clone());
        self.ops.push(OpSpec {
            id: id.to_string(),
            name: name.to_string(),
            kind,
            block: self.block,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            params,
            output_shape,
            fwd_flops_per_sample: fwd_flops,
            saved_bytes_per_sample: saved_bytes,
            output_bytes_per_sample: output_bytes,
        });
        id.to_string()
    }

    /// Token or segment embedding `[rows, dim]`. Backward needs only the token ids (8 bytes each).
    pub fn embedding(&mut self, id: &str, name: &str, rows: u64, dim: u64) -> String {
        let s = self.seq();
        self.push(
            id,
            name,
            OpKind::Embedding,
            &[],
            vec![Self::param("weight", &[rows, dim], None)],
            vec![s as i64, dim as i64],
            0,
            token_ids_bytes(&self.config),
        )
    }

    pub fn positional(&mut self, id: &str, name: &str, rows: u64, dim: u64) -> String {
        let s = self.seq();
        self.push(
            id,
            name,
            OpKind::PositionalEmbedding,
            &[],
            vec![Self::param("weight", &[rows, dim], None)],
            vec![s as i64, dim as i64],
            0,
            0,
        )
    }

    /// Layer or RMS norm over the last dimension; `dropout_after` adds the mask of a dropout
    /// applied to its output (BERT's embedding norm).
    pub fn norm(
        &mut self,
        id: &str,
        name: &str,
        input: &str,
        affine: bool,
        dropout_after: bool,
    ) -> String {
        let shape = self.shape(input).to_vec();
        let width = *shape.last().expect("shapes are never empty") as u64;
        let (kind, flops_per_elem) = match self.config.norm {
            super::NormKind::LayerNorm => (OpKind::LayerNorm, LAYER_NORM_FLOPS_PER_ELEM),
            super::NormKind::RmsNorm => (OpKind::RmsNorm, RMS_NORM_FLOPS_PER_ELEM),
        };
        let mut params = Vec::new();
        if affine {
            params.push(Self::param("weight", &[width], None));
            if kind == OpKind::LayerNorm && self.config.bias.norm {
                params.push(Self::param("bias", &[width], None));
            }
        }
        let n = Self::numel(&shape);
        let mut saved = if self.pytorch() && kind == OpKind::RmsNorm {
            // Its normalised output, in the compute dtype; the input it reads is an fp32 copy.
            n.saturating_mul(self.act_bytes())
        } else {
            self.keep_reads(id, kind, &[input], &shape)
        };
        if self.pytorch() {
            saved = saved.saturating_add(pytorch_norm_fp32_bytes(kind, n, width));
        }
        if dropout_after && self.config.dropout > 0.0 {
            saved = saved.saturating_add(n);
        }
        self.push(
            id,
            name,
            kind,
            &[input],
            params,
            shape,
            flops_per_elem.saturating_mul(n),
            saved,
        )
    }

    /// `y = x Wᵀ (+ b)`; `tied_to` shares the weight with another op's parameter.
    pub fn linear(
        &mut self,
        id: &str,
        name: &str,
        input: &str,
        out_features: u64,
        bias: bool,
        tied_to: Option<&str>,
    ) -> String {
        let mut shape = self.shape(input).to_vec();
        let in_features = *shape.last().expect("shapes are never empty") as u64;
        let rows = Self::numel(&shape) / in_features;
        *shape.last_mut().expect("shapes are never empty") = out_features as i64;
        let mut params = vec![Self::param("weight", &[out_features, in_features], tied_to)];
        if bias {
            params.push(Self::param("bias", &[out_features], None));
        }
        let after_attention = self
            .ops
            .last()
            .is_some_and(|o| o.id == input && o.kind == OpKind::Attention);
        let saved = if self.pytorch() && after_attention {
            // A contiguous copy of the heads' output, whatever attention itself keeps.
            self.kept.insert(input.to_string());
            Self::numel(self.shape(input)).saturating_mul(self.act_bytes())
        } else {
            self.keep_reads(id, OpKind::Linear, &[input], &shape)
        };
        self.push(
            id,
            name,
            OpKind::Linear,
            &[input],
            params,
            shape,
            rows.saturating_mul(2 * in_features)
                .saturating_mul(out_features),
            saved,
        )
    }

    /// Attention core over a fused `qkv` input or separate `q`, `k`, `v` inputs.
    pub fn attention(&mut self, id: &str, name: &str, inputs: &[&str]) -> String {
        let c = &self.config;
        let (s, heads, hd) = (c.seq_len, c.heads, c.head_dim);
        let attention_dropout = c.attention_dropout > 0.0;
        let imp = c.attention;
        let output_shape = vec![s as i64, (heads * hd) as i64];
        // Its inputs, and fused its own output.
        let mut saved = self.keep_reads(id, OpKind::Attention, inputs, &output_shape);
        let scores = heads.saturating_mul(s).saturating_mul(s);
        let a = self.act_bytes();
        match imp {
            AttentionImpl::Eager => {
                saved = saved.saturating_add(scores.saturating_mul(a));
                if attention_dropout {
                    saved = saved.saturating_add(scores.saturating_mul(a + 1));
                }
            }
            AttentionImpl::Flash => {
                saved = saved.saturating_add(log_sum_exp_bytes(&self.config));
            }
        }
        let flops = scores.saturating_mul(4 * hd);
        self.push(
            id,
            name,
            OpKind::Attention,
            inputs,
            Vec::new(),
            output_shape,
            flops,
            saved,
        )
    }

    /// The model's activation on one input, or gated (`act(gate) * up`) on two.
    pub fn activation(&mut self, id: &str, name: &str, inputs: &[&str]) -> String {
        let shape = self.shape(inputs[0]).to_vec();
        let n = Self::numel(&shape);
        let act = self.config.activation;
        let per_elem = match act {
            Activation::Gelu | Activation::GeluTanh => 8,
            Activation::Relu => 1,
            Activation::Silu => 4,
        } + if inputs.len() == 2 { 1 } else { 0 };
        // ReLU keeps its output, which the next linear also reads; the others their inputs.
        let mut saved = self.keep_reads(id, OpKind::Activation, inputs, &shape);
        if self.pytorch() && inputs.len() == 2 {
            // Eager `act(gate) * up` keeps the activation's output for the product's backward.
            saved = saved.saturating_add(n.saturating_mul(self.act_bytes()));
        }
        if let (true, Some(gelu)) = (self.pytorch(), self.config.composed_gelu) {
            // A GELU written as PyTorch ops keeps its intermediates as well.
            let kept = n.saturating_mul(self.act_bytes());
            saved = saved.saturating_add(kept.saturating_mul(gelu.kept_tensors()));
        }
        self.push(
            id,
            name,
            OpKind::Activation,
            inputs,
            Vec::new(),
            shape,
            n.saturating_mul(per_elem),
            saved,
        )
    }

    /// Sum of `inputs`; `dropout_on_branch` adds the mask of the dropout on the residual branch.
    pub fn add(
        &mut self,
        id: &str,
        name: &str,
        inputs: &[&str],
        dropout_on_branch: bool,
    ) -> String {
        let shape = self.shape(inputs[0]).to_vec();
        let n = Self::numel(&shape);
        let saved = if dropout_on_branch && self.config.dropout > 0.0 {
            n
        } else {
            0
        };
        self.push(
            id,
            name,
            OpKind::Add,
            inputs,
            Vec::new(),
            shape,
            n.saturating_mul(inputs.len() as u64 - 1),
            saved,
        )
    }

    /// Softmax cross-entropy over `logits`; keeps fp32 log-probabilities for backward.
    pub fn cross_entropy(&mut self, id: &str, name: &str, logits: &str) -> String {
        let n = Self::numel(self.shape(logits));
        self.push(
            id,
            name,
            OpKind::CrossEntropy,
            &[logits],
            Vec::new(),
            vec![1],
            n.saturating_mul(SOFTMAX_XENT_FLOPS_PER_ELEM),
            n.saturating_mul(FP32_BYTES),
        )
    }

    pub fn finish(self, name: &str, family: Family, source: Option<String>) -> ModelSpec {
        ModelSpec {
            version: MODEL_FORMAT_VERSION,
            name: name.to_string(),
            family,
            source,
            config: self.config,
            ops: self.ops,
            hf_config: None,
        }
    }
}
