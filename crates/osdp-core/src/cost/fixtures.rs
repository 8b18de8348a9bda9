//! Machines and ops with round numbers, and the sample models, that the cost model's tests
//! price.

use std::sync::Arc;

use crate::cluster::{Calibration, Layout};
use crate::model::ModelSpec;

use super::{Efficiencies, Machine, OpBase, ParamTensor, Precision};

/// A machine with round numbers: 8 ranks, 100 TFLOP/s, 1 TB/s memory, 100 GB/s links,
/// 10 µs latency, 5 µs launches.
pub(super) fn machine(ranks: u32) -> Machine {
    Machine {
        rates_guessed: false,
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
        gradient_bucket_elements: None,
        nccl_tree: false,
        param_pass_bytes: 0.0,
        fused_attention: true,
        flash_attention_1: false,
        cudnn_attention: false,
        fused_softmax: false,
        autocast: false,
        optimizer_bytes_per_param: super::OPTIMIZER_BYTES_PER_PARAM,
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
        launch_s: 5e-6,
        overhead_bytes: 0,
        side_pool_bytes: 0,
        compute_dtype: "bf16",
        precision: Precision::MIXED_BF16,
        model_activation_bytes: 2,
        overlap: true,
        target: super::Target::Osdp,
        calibration: None,
        host_link_bytes_per_s: 0.0,
        cpu_adam_params_per_s: 0.0,
        host_budget_bytes: 0,
    }
}

/// [`machine`] with a host: 25 GB/s each way, 1 G AdamW updates/s, 100 GB of budget.
pub(super) fn with_host(mut m: Machine) -> Machine {
    m.host_link_bytes_per_s = 25e9;
    m.cpu_adam_params_per_s = 1e9;
    m.host_budget_bytes = 100_000_000_000;
    m
}

pub(super) fn linear_base(params: u64) -> OpBase {
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
        param_share: 1.0,
        ends_block_params: false,
        outside_blocks: false,
        cached_working_bytes: 0,
        in_last_block: false,
        in_features: 0,
        unaligned_s: 0.0,
    }
}

pub(super) fn calibrated(mut m: Machine) -> Machine {
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

pub(super) fn sample(name: &str) -> ModelSpec {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(format!("sample-models/{name}.json"));
    crate::model::read_model(&path).unwrap()
}

/// Machines of `nodes` × 8 GPUs with a layout's links: NVLink 370 GB/s and 10 µs inside a
/// node; between nodes `nics` NICs of 46 GB/s and 15 µs.
pub(super) fn cluster(nodes: u32, nics: f64) -> Machine {
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
