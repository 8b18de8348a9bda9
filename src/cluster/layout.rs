//! The layout file (`layouts/*.json`, format version 1), read as strictly as a model.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::calibration::Calibration;
use crate::input::{self, InputError, Problem};

pub const LAYOUT_FORMAT_VERSION: u32 = 1;

const GIB: f64 = (1u64 << 30) as f64;

/// A number with where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    pub value: f64,
    /// Datasheet, measurement (with date and command) or estimate, in words.
    pub source: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub version: u32,
    pub name: String,
    pub description: String,
    pub nodes: u32,
    /// Devices (GPUs, or CPU ranks for the `cpu` layout) per node.
    pub gpus_per_node: u32,
    pub device: DeviceSpec,
    /// Memory each rank loses before the model gets any: CUDA context, NCCL buffers, allocator
    /// slack, workspaces.
    pub runtime_overhead_gib: Figure,
    /// Link between devices of one node.
    pub intra_node: LinkSpec,
    /// Link between nodes (required when `nodes` > 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_node: Option<LinkSpec>,
    /// What `osdp-tui calibrate` measured here; the cost model prefers it to the rates above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Gpu,
    Cpu,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3 (SXM5)`.
    pub model: String,
    /// Memory one rank may use, in GiB (2^30 bytes).
    pub memory_gib: Figure,
    /// Dense (no sparsity) peak rates in TFLOP/s, per dtype the device supports.
    pub dense_tflops: Rates,
    /// Device memory bandwidth in GB/s (10^9 bytes per second).
    pub memory_bandwidth_gb_per_s: Figure,
}

/// Peak rates per compute dtype; a dtype the device lacks is left out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<Figure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16: Option<Figure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tf32: Option<Figure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32: Option<Figure>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    Nvlink,
    Pcie,
    Infiniband,
    Ethernet,
    /// Ranks of one host exchanging through shared memory (CPU training).
    SharedMemory,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub kind: LinkKind,
    /// NCCL-style bus bandwidth per rank in GB/s: what a ring all-gather or reduce-scatter
    /// sustains, so `time ≈ (N−1)/N · bytes / bus_bandwidth`.
    pub bus_bandwidth_gb_per_s: Figure,
    /// Per-step latency of a collective (the α of the α–β model), in microseconds.
    pub latency_us: Figure,
}

impl Layout {
    /// Total ranks.
    pub fn world_size(&self) -> u32 {
        self.nodes * self.gpus_per_node
    }

    /// Memory of one device in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.device.memory_gib.value * GIB) as u64
    }

    pub fn runtime_overhead_bytes(&self) -> u64 {
        (self.runtime_overhead_gib.value * GIB) as u64
    }
}

/// Read and check a layout.
pub fn read_layout(path: &Path) -> Result<Layout, InputError> {
    let layout: Layout = input::read_strict(path, LAYOUT_FORMAT_VERSION)?;
    validate_layout(&layout).map_err(|problem| InputError::Invalid {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok(layout)
}

fn check_figure(field: &str, f: &Figure) -> Result<(), Problem> {
    if !(f.value.is_finite() && f.value > 0.0) {
        return Err(Problem::field(
            field,
            format!("must be a positive number, got {}", f.value),
        ));
    }
    if f.source.trim().is_empty() {
        return Err(Problem::field(
            &format!("{field}.source"),
            "every figure needs a source note (datasheet, measurement or estimate)",
        ));
    }
    Ok(())
}

pub fn validate_layout(l: &Layout) -> Result<(), Problem> {
    if l.name.trim().is_empty() {
        return Err(Problem::field("name", "must not be empty"));
    }
    if l.nodes == 0 {
        return Err(Problem::field("nodes", "must be at least 1"));
    }
    if l.gpus_per_node == 0 {
        return Err(Problem::field("gpus_per_node", "must be at least 1"));
    }
    if l.nodes
        .checked_mul(l.gpus_per_node)
        .is_none_or(|n| n > 1 << 20)
    {
        return Err(Problem::field(
            "nodes",
            "nodes × gpus_per_node is implausibly large",
        ));
    }
    check_figure("device.memory_gib", &l.device.memory_gib)?;
    check_figure(
        "device.memory_bandwidth_gb_per_s",
        &l.device.memory_bandwidth_gb_per_s,
    )?;
    let r = &l.device.dense_tflops;
    let rates = [
        ("bf16", &r.bf16),
        ("fp16", &r.fp16),
        ("tf32", &r.tf32),
        ("fp32", &r.fp32),
    ];
    let mut any = false;
    for (name, rate) in rates {
        if let Some(f) = rate {
            check_figure(&format!("device.dense_tflops.{name}"), f)?;
            any = true;
        }
    }
    if !any {
        return Err(Problem::field(
            "device.dense_tflops",
            "needs at least one rate (bf16, fp16, tf32 or fp32)",
        ));
    }
    check_figure("runtime_overhead_gib", &l.runtime_overhead_gib)?;
    if l.runtime_overhead_gib.value >= l.device.memory_gib.value {
        return Err(Problem::field(
            "runtime_overhead_gib",
            format!(
                "{} GiB leaves nothing of the device's {} GiB",
                l.runtime_overhead_gib.value, l.device.memory_gib.value
            ),
        ));
    }
    check_link("intra_node", &l.intra_node)?;
    match (&l.inter_node, l.nodes) {
        (Some(link), _) => check_link("inter_node", link)?,
        (None, n) if n > 1 => {
            return Err(Problem::field(
                "inter_node",
                format!("a layout of {n} nodes needs the link between them"),
            ))
        }
        (None, _) => {}
    }
    if let Some(c) = &l.calibration {
        c.validate()?;
    }
    Ok(())
}

fn check_link(field: &str, link: &LinkSpec) -> Result<(), Problem> {
    check_figure(
        &format!("{field}.bus_bandwidth_gb_per_s"),
        &link.bus_bandwidth_gb_per_s,
    )?;
    check_figure(&format!("{field}.latency_us"), &link.latency_us)
}
