//! `export --to fsdp2`: a plan written out for PyTorch FSDP2 (`osdp_torch.apply_plan`), self-
//! contained: per module path how `fully_shard` wraps it, the precision, the batch the plan
//! was made for, its prediction and the model's fingerprint.

use serde::{Deserialize, Serialize};

use super::{fingerprint, Blocks, Plan, Target};
use crate::cost::{self, Machine, Offload, Precision, Strategy};
use crate::model::{Family, Kernels, ModelSpec};

/// Why a plan for `target` may under-price activations: a model imported for osdp-tui's own
/// kernels, planned for FSDP2, which runs PyTorch's eager modules (they keep more for backward:
/// norm statistics, RMSNorm's fp32 upcast, a copy of attention's output, the gated MLP's
/// activation). `None` where the figures are the runtime's own.
pub fn kernels_note(spec: &ModelSpec, target: Target) -> Option<&'static str> {
    (target == Target::Fsdp2
        && spec.family != Family::Torch
        && spec.config.kernels == Kernels::Osdp)
        .then_some(
            "activations priced for osdp-tui's kernels, FSDP2 runs PyTorch's: import-hf \
             --kernels pytorch prices what they keep",
        )
}

/// The `version` of the export this build writes.
pub const FSDP2_EXPORT_VERSION: u32 = 1;

/// The input of `osdp_torch.apply_plan`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fsdp2Export {
    pub version: u32,
    /// Always `fsdp2`.
    pub target: String,
    pub model: String,
    /// [`fingerprint`] of the model description: `apply_plan` checks the module it is given
    /// against it (module paths and parameter shapes).
    pub model_fingerprint: String,
    pub layout: String,
    /// Parameters of the whole model, tied ones once.
    pub param_count: u64,
    pub world_size: u32,
    /// Ranks of one node: an hsdp module shards over these and replicates across nodes.
    pub ranks_per_node: u32,
    pub precision: Fsdp2Precision,
    pub micro_batch: u64,
    pub accumulation: u64,
    pub global_batch: u64,
    pub predicted: Fsdp2Predicted,
    /// One entry per module that owns parameters, in the model's order (innermost modules
    /// before the root: `apply_plan` wraps them in this order, then the root).
    pub modules: Vec<Fsdp2Module>,
    /// Module paths of the blocks that recompute their activations (`checkpoint_wrapper`).
    pub checkpoint: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fsdp2Precision {
    /// `MixedPrecisionPolicy.param_dtype`: `float32` or `bfloat16`.
    pub param_dtype: String,
    /// `MixedPrecisionPolicy.reduce_dtype`.
    pub reduce_dtype: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fsdp2Predicted {
    /// The plan's peak as the planner budgets it: what the caching allocator reserves and the
    /// runtime's own (CUDA context, NCCL): what `nvidia-smi` would show.
    pub peak_memory_bytes: u64,
    /// What to set beside `torch.cuda.max_memory_reserved()`: the peak less the runtime's own.
    #[serde(default)]
    pub reserved_bytes: u64,
    /// What to set beside `torch.cuda.max_memory_allocated()`: the tensors live at the peak,
    /// without what FSDP2's side streams and `zero_grad`'s freed gradients leave cached.
    #[serde(default)]
    pub allocated_bytes: u64,
    pub step_time_s: f64,
    pub throughput_samples_per_s: f64,
    /// Bytes of the parameters each rank holds between steps, as FSDP2 holds them: the fp32
    /// local shard (dim 0 cut into equal chunks, the last padded) of every sharded parameter,
    /// the whole of every replicated one (rank 0's figure; with dimensions the ranks divide,
    /// every rank's).
    pub param_bytes_per_rank: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fsdp2Module {
    /// The module's path in the `nn.Module` (`transformer.h.0.attn.c_attn`).
    pub path: String,
    /// The op of the model description it is.
    pub op: String,
    /// `dp`, `zero2`, `zero3` or `hsdp`.
    pub sharding: String,
    /// `fully_shard(reshard_after_forward=…)`: true for zero3 and hsdp, false for zero2 and dp.
    pub reshard_after_forward: bool,
    /// The mesh it is sharded on, outermost dimension first: `[world]` (shard over all ranks),
    /// `[world, 1]` (dp: replicate over all, shard over none) or `[nodes, ranks_per_node]`.
    pub mesh: Vec<u32>,
    /// `CPUOffloadPolicy`: parameters, gradients and the optimizer step on the CPU.
    pub offload: bool,
    /// Modules sharing this module's parameters (tied weights), wrapped with it as one group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<String>,
    /// Parameter elements the module owns (tied ones counted at their owner): `apply_plan`
    /// checks the live module against it.
    pub numel: u64,
    /// Parameter bytes this rank holds between steps ([`Fsdp2Predicted::param_bytes_per_rank`]).
    pub param_bytes_per_rank: u64,
}

/// Write `plan` for FSDP2, its figures priced as FSDP2 runs it ([`Target::Fsdp2`] on `m`);
/// refuses, naming the op, a choice FSDP2 cannot run (a split op, zero1, `+offload-opt`).
pub fn fsdp2_export(
    model: &ModelSpec,
    layout: &str,
    m: &Machine,
    plan: &Plan,
) -> Result<Fsdp2Export, String> {
    for (op, c) in model.ops.iter().zip(&plan.choices) {
        Target::Fsdp2.allows(*c).map_err(|why| {
            format!(
                "op {:?} is {}: {why}; plan again with --target fsdp2",
                crate::text::printable(&op.id),
                c.label()
            )
        })?;
    }
    let mut m = m.clone();
    m.set_target(Target::Fsdp2, model);
    let (m, prediction) = (&m, super::evaluate(model, &m, plan));
    let (world, per_node) = (m.ranks.max(1), m.ranks_per_node.clamp(1, m.ranks.max(1)));
    let mut modules = Vec::new();
    for (i, op) in model.ops.iter().enumerate() {
        let c = plan.choices[i];
        if c.strategy == Strategy::None || !cost::owns_params(op) {
            continue;
        }
        let (reshard, mesh, shard_over) = match c.strategy {
            Strategy::Zero3 => (true, vec![world], world),
            Strategy::Zero2 => (false, vec![world], world),
            Strategy::Hsdp => (true, vec![world / per_node, per_node], per_node),
            _ => (false, vec![world, 1], 1),
        };
        let tied: Vec<String> = model
            .ops
            .iter()
            .filter(|o| {
                o.params
                    .iter()
                    .any(|p| p.tie_target().is_some_and(|(owner, _)| owner == op.id))
            })
            .map(|o| o.name.clone())
            .collect();
        let elements: u64 = op
            .params
            .iter()
            .filter(|p| p.tied_to.is_none())
            .map(|p| local_shard(&p.shape, u64::from(shard_over)))
            .sum();
        modules.push(Fsdp2Module {
            path: op.name.clone(),
            op: op.id.clone(),
            sharding: c.strategy.as_str().to_string(),
            reshard_after_forward: reshard,
            mesh,
            offload: c.offload == Offload::Param,
            tied,
            numel: crate::model::ModelSpec::op_param_count(op),
            param_bytes_per_rank: 4 * elements,
        });
    }
    let blocks = Blocks::of(model);
    let checkpoint = (0..blocks.ops.len())
        .filter(|&b| plan.recompute.get(b).copied().unwrap_or(false))
        .map(|b| block_path(model, &blocks.ops[b]))
        .collect();
    let dtype = |bytes: u64| if bytes >= 4 { "float32" } else { "bfloat16" }.to_string();
    let precision = if m.precision == Precision::FP32 {
        Fsdp2Precision {
            param_dtype: "float32".into(),
            reduce_dtype: "float32".into(),
        }
    } else {
        Fsdp2Precision {
            param_dtype: dtype(m.precision.param_bytes),
            reduce_dtype: dtype(m.reduce_bytes),
        }
    };
    Ok(Fsdp2Export {
        version: FSDP2_EXPORT_VERSION,
        target: Target::Fsdp2.as_str().into(),
        model: model.name.clone(),
        model_fingerprint: fingerprint(model),
        layout: layout.to_string(),
        param_count: model.param_count(),
        world_size: world,
        ranks_per_node: per_node,
        precision,
        micro_batch: plan.batch,
        accumulation: plan.accumulation,
        global_batch: prediction.global_batch,
        predicted: Fsdp2Predicted {
            peak_memory_bytes: prediction.peak_memory_bytes,
            reserved_bytes: prediction.reserved_bytes(),
            allocated_bytes: prediction.allocated_bytes(),
            step_time_s: prediction.step_time_s,
            throughput_samples_per_s: prediction.throughput_samples_per_s,
            param_bytes_per_rank: modules.iter().map(|m| m.param_bytes_per_rank).sum(),
        },
        modules,
        checkpoint,
    })
}

/// Elements of rank 0's local shard of a tensor of `shape` sharded on dim 0 over `ranks`
/// (FSDP2's `Shard(0)`: chunks of ⌈d0 / ranks⌉ rows).
fn local_shard(shape: &[i64], ranks: u64) -> u64 {
    let dims: Vec<u64> = shape.iter().map(|&d| d.max(0) as u64).collect();
    let rest: u64 = dims.iter().skip(1).product();
    dims.first().map_or(1, |&d0| d0.div_ceil(ranks.max(1))) * rest
}

/// A block's module path: the longest dotted prefix its ops' module paths share
/// (`transformer.h.0`).
fn block_path(model: &ModelSpec, ops: &[usize]) -> String {
    let mut prefix: Option<Vec<&str>> = None;
    for &i in ops {
        let parts: Vec<&str> = model.ops[i].name.split('.').collect();
        prefix = Some(match prefix {
            None => parts[..parts.len().saturating_sub(1)].to_vec(),
            Some(p) => p
                .iter()
                .zip(&parts)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    prefix.unwrap_or_default().join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::cost::Choice;
    use crate::model::read_model;
    use crate::plan::uniform_plan;
    use std::path::Path;

    #[test]
    fn an_fsdp2_export_names_module_paths_and_refuses_a_split_op() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/tiny-gpt2.json")).unwrap();
        let layout = read_layout(&root.join("layouts/cpu.json")).unwrap();
        let m = Machine::new(&layout, &model);
        let mut plan = uniform_plan(&model, Strategy::Zero3, 2);
        plan.recompute[1] = true;
        let at = |id: &str| model.ops.iter().position(|o| o.id == id).unwrap();
        plan.choices[at("h0.mlp.c_fc")] = Choice::plain(Strategy::Zero2);
        plan.choices[at("wpe")] = Choice::DP;
        let e = fsdp2_export(&model, "cpu", &m, &plan).unwrap();
        assert_eq!(e.checkpoint, ["transformer.h.1"]);
        let module = |path: &str| e.modules.iter().find(|x| x.path == path).unwrap();
        assert_eq!(module("transformer.wte").tied, ["lm_head"]);
        assert!(!module("transformer.h.0.mlp.c_fc").reshard_after_forward);
        assert_eq!(module("transformer.wpe").mesh, [2, 1]);
        // wte 256×128 sharded over 2 ranks: 128 rows each, fp32.
        assert_eq!(
            module("transformer.wte").param_bytes_per_rank,
            128 * 128 * 4
        );
        assert_eq!(
            module("transformer.wpe").param_bytes_per_rank,
            128 * 128 * 4
        );
        assert!(e.modules.iter().all(|x| x.path != "lm_head"));
        assert_eq!(e.precision.param_dtype, "float32");
        plan.choices[at("h2.attn.c_attn")] = Choice::zero3(2, 1);
        let why = fsdp2_export(&model, "cpu", &m, &plan).unwrap_err();
        assert!(
            why.starts_with("op \"h2.attn.c_attn\" is zero3/2:1"),
            "{why}"
        );
    }

    #[test]
    fn an_hsdp_module_shards_within_a_node_on_a_2d_mesh() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/gpt2.json")).unwrap();
        let layout = read_layout(&root.join("layouts/a100-80gb-2x8-ib-hdr.json")).unwrap();
        let m = Machine::new(&layout, &model);
        let plan = uniform_plan(&model, Strategy::Hsdp, 1);
        let e = fsdp2_export(&model, &layout.name, &m, &plan).unwrap();
        assert_eq!((e.world_size, e.ranks_per_node), (16, 8));
        assert_eq!(e.precision.param_dtype, "bfloat16");
        let c_fc = e.modules.iter().find(|x| x.op == "h0.mlp.c_fc").unwrap();
        assert_eq!(c_fc.mesh, [2, 8]);
        assert!(c_fc.reshard_after_forward);
        // weight [3072, 768] and bias [3072], each 1/8 in fp32.
        assert_eq!(c_fc.param_bytes_per_rank, (3072 / 8 * 768 + 3072 / 8) * 4);
    }
}
