//! The graph as the executor sees it: whether it can run a plan at all
//! ([`check_runnable`]), and the dataflow it walks (each op's inputs and consumers, what
//! backward reads, what forward keeps, which ops recompute).

use super::{ExecError, Result};
use osdp_core::model::{AttentionImpl, Kernels, ModelConfig, ModelSpec, OpKind};
use osdp_core::plan::{Blocks, Plan};

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
    if c.kernels == Kernels::Pytorch {
        // Priced for PyTorch's eager modules, which keep more than the trainer's kernels.
        return Err(ExecError::Unsupported(
            "activations priced for PyTorch's eager modules (import-hf --kernels pytorch); the trainer keeps what its own kernels keep: import the model without --kernels pytorch".into(),
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

/// The graph as the executor walks it: each op's inputs and consumers, what backward reads,
/// what forward keeps, and which ops recompute in which block.
pub(super) struct Dataflow {
    /// Each op's inputs (op indices).
    pub(super) inputs: Vec<Vec<usize>>,
    /// The ops that read each op's output.
    pub(super) consumers: Vec<Vec<usize>>,
    /// Outputs some op reads in backward (ignoring recomputation).
    pub(super) need_bwd: Vec<bool>,
    /// Outputs kept through the forward pass: `need_bwd` minus recomputed blocks, plus the
    /// inputs those blocks restart from.
    pub(super) keep_fwd: Vec<bool>,
    /// Block of each op when that block recomputes.
    pub(super) recomputed_block: Vec<Option<usize>>,
    /// Ops whose recomputation keeps the weights it gathered for their backward: the last op
    /// with parameters of a recomputed block, unsplit (`cost::ends_block_params`, which the
    /// cost model prices as fetching nothing again), and every op a block that keeps keeps
    /// (`plan::kept_ops`).
    pub(super) keeps_gathered: Vec<bool>,
    pub(super) blocks: Blocks,
}

impl Dataflow {
    pub(super) fn of(model: &ModelSpec, plan: &Plan) -> Dataflow {
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

        let keeps_gathered = osdp_core::cost::ends_block_params(model)
            .into_iter()
            .zip(osdp_core::plan::kept_ops(model, plan))
            .enumerate()
            .map(|(i, (ends, kept))| {
                kept || (ends && recomputed_block[i].is_some() && plan.choices[i].split <= 1)
            })
            .collect();
        Dataflow {
            inputs,
            consumers,
            need_bwd,
            keep_fwd,
            recomputed_block,
            keeps_gathered,
            blocks,
        }
    }
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
