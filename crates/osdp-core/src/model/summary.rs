//! What `osdp-tui inspect` reports about a model.

use serde::Serialize;

use super::{ModelSpec, OpKind};

/// Ops and owned parameters of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindSummary {
    pub kind: &'static str,
    pub ops: usize,
    pub params: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub name: String,
    pub family: &'static str,
    /// Number of operators.
    pub ops: usize,
    /// Distinct repeated blocks in the graph.
    pub blocks: usize,
    pub layers: u64,
    pub hidden: u64,
    pub seq_len: u64,
    pub vocab_size: u64,
    /// Parameters, tied ones counted once.
    pub params: u64,
    pub params_bytes_fp32: u64,
    pub params_bytes_bf16: u64,
    pub fwd_flops_per_token: f64,
    pub fwd_flops_per_sample: u64,
    /// Activations kept for backward by one sample with no recomputation.
    pub saved_activation_bytes_per_sample: u64,
    pub by_kind: Vec<KindSummary>,
}

impl ModelSummary {
    pub fn of(m: &ModelSpec) -> Self {
        let params = m.param_count();
        let by_kind = OpKind::ALL
            .iter()
            .filter_map(|&kind| {
                let ops: Vec<_> = m.ops.iter().filter(|o| o.kind == kind).collect();
                (!ops.is_empty()).then(|| KindSummary {
                    kind: kind.as_str(),
                    ops: ops.len(),
                    params: ops.iter().map(|o| ModelSpec::op_param_count(o)).sum(),
                })
            })
            .collect();
        let fwd: u64 = m.ops.iter().map(|o| o.fwd_flops_per_sample).sum();
        ModelSummary {
            name: m.name.clone(),
            family: m.family.as_str(),
            ops: m.ops.len(),
            blocks: m.block_count(),
            layers: m.config.layers,
            hidden: m.config.hidden,
            seq_len: m.config.seq_len,
            vocab_size: m.config.vocab_size,
            params,
            params_bytes_fp32: params * 4,
            params_bytes_bf16: params * 2,
            fwd_flops_per_token: fwd as f64 / m.config.seq_len as f64,
            fwd_flops_per_sample: fwd,
            saved_activation_bytes_per_sample: m.ops.iter().map(|o| o.saved_bytes_per_sample).sum(),
            by_kind,
        }
    }
}
