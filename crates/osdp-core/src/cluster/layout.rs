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
    /// The dtype gradients are reduced in (reduce-scatter / all-reduce): `bf16` halves the
    /// bytes on the wire, `fp32` is PyTorch FSDP's and llm-foundry's default. Absent: the
    /// compute dtype, which is what osdp-tui's trainer reduces in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_reduce_dtype: Option<ReduceDType>,
    /// Host memory, the link to it and the CPUs: what offloading optimizer state or
    /// parameters to the host is priced with. Absent: offload is not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostSpec>,
    /// What `osdp-tui calibrate` measured here; the cost model prefers it to the rates above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

/// A node's host side, as offloading sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Host memory of one node, in GiB.
    pub memory_gib_per_node: Figure,
    /// Copy bandwidth between one device and host memory, each direction, with pinned
    /// buffers, in GB/s (PCIe: what a host-to-device copy sustains, not the lane rate).
    pub link_gb_per_s: Figure,
    /// CPU cores of one node that run the offloaded optimizer steps.
    pub cpu_cores_per_node: Figure,
    /// AdamW updates one core does per second (fp32 master, both moments), in millions of
    /// parameters.
    pub adam_mparams_per_s_per_core: Figure,
}

/// Share of host memory the default host budget takes; the rest is the OS's, the data
/// loader's and the framework's.
pub const HOST_BUDGET_SHARE: f64 = 0.8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceDType {
    Bf16,
    Fp32,
}

impl ReduceDType {
    pub fn bytes(self) -> u64 {
        match self {
            ReduceDType::Bf16 => 2,
            ReduceDType::Fp32 => 4,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Gpu,
    Cpu,
}

impl DeviceKind {
    /// What one rank is, for budgets said per rank: `8.0 GiB per GPU`, or on the CPU layout,
    /// whose ranks are processes sharing the host, `8.0 GiB per rank`.
    pub fn rank_noun(self) -> &'static str {
        match self {
            DeviceKind::Gpu => "GPU",
            DeviceKind::Cpu => "rank",
        }
    }
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
    /// Fractions of those peaks that real training kernels reach. Absent ones come from the
    /// device's generation (`cluster::known`), else from generic defaults; a calibration's
    /// measured curves replace all of them.
    #[serde(default, skip_serializing_if = "Efficiency::is_empty")]
    pub efficiency: Efficiency,
    /// CUDA compute capability, `"8.9"` (NVML reports it): a GPU whose name the known-GPU
    /// table lacks is priced with its architecture's kernels (FlashAttention or not, the
    /// generation's efficiencies) instead of generic ones (`cluster::known::row_of`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
}

/// Kernel efficiencies: achieved rate over the datasheet peak, each with its source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    /// Transformer-sized bf16/fp16 GEMMs (forward and both backward GEMMs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul: Option<Figure>,
    /// Features at which a narrow GEMM reaches half of `matmul` (efficiency
    /// `matmul · k / (k + matmul_half_width)` for a linear whose smaller side is `k`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul_half_width: Option<Figure>,
    /// A fused (flash) attention forward, on its causal FLOPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_forward: Option<Figure>,
    /// A fused (flash) attention backward, on its causal FLOPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_backward: Option<Figure>,
    /// Element-wise and normalisation kernels against memory bandwidth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Figure>,
    /// Layer and RMS norms, forward and backward, against memory bandwidth on the bytes the
    /// cost model prices them by; absent: `memory`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm: Option<Figure>,
    /// The loss (log-softmax over the vocabulary and its gradient), likewise; absent: `memory`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<Figure>,
    /// A 16-bit GEMM with a dimension not a multiple of 8 (a 50,257-word LM head), forward and
    /// backward; absent: the generation's measurement, or priced as an aligned one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unaligned_matmul: Option<Figure>,
    /// When these figures were measured on the device (`osdp-tui calibrate --device cuda`,
    /// RFC 3339); absent for fitted or estimated ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<String>,
}

impl Efficiency {
    pub fn is_empty(&self) -> bool {
        self.figures().iter().all(|(_, f)| f.is_none())
            && self.matmul_half_width.is_none()
            && self.measured_at.is_none()
    }

    pub fn figures(&self) -> [(&'static str, &Option<Figure>); 7] {
        [
            ("matmul", &self.matmul),
            ("attention_forward", &self.attention_forward),
            ("attention_backward", &self.attention_backward),
            ("memory", &self.memory),
            ("norm", &self.norm),
            ("loss", &self.loss),
            ("unaligned_matmul", &self.unaligned_matmul),
        ]
    }
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
    /// Between nodes: network adapters per node that collectives use at once (NCCL runs one
    /// ring channel per NIC), `bus_bandwidth_gb_per_s` being one NIC's. Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics_per_node: Option<Figure>,
}

impl LinkSpec {
    /// NICs used at once (1 unless the layout says more).
    pub fn nics(&self) -> f64 {
        self.nics_per_node.as_ref().map_or(1.0, |f| f.value)
    }
}

impl Layout {
    /// When this layout's time figures were measured on a machine by `osdp-tui calibrate`
    /// (RFC 3339): its CPU calibration's, else its measured GPU efficiencies'; `None` for
    /// datasheet rates and fitted efficiencies.
    pub fn measured_at(&self) -> Option<&str> {
        match &self.calibration {
            Some(c) => Some(&c.measured_at),
            None => self.device.efficiency.measured_at.as_deref(),
        }
    }

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

    /// The default host budget of one rank: [`HOST_BUDGET_SHARE`] of the node's host memory,
    /// split over its devices. `None` without host figures.
    pub fn host_budget_bytes(&self) -> Option<u64> {
        let h = self.host.as_ref()?;
        Some(
            (h.memory_gib_per_node.value * GIB * HOST_BUDGET_SHARE
                / f64::from(self.gpus_per_node.max(1))) as u64,
        )
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
    check_shape(l)?;
    check_device(&l.device)?;
    check_runtime_overhead(l)?;
    check_links(l)?;
    if let Some(h) = &l.host {
        check_host(h)?;
    }
    if let Some(c) = &l.calibration {
        c.validate()?;
    }
    Ok(())
}

/// The name and the node × device grid.
fn check_shape(l: &Layout) -> Result<(), Problem> {
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
    Ok(())
}

/// Memory, bandwidth, at least one dense rate, and the efficiencies.
fn check_device(d: &DeviceSpec) -> Result<(), Problem> {
    check_figure("device.memory_gib", &d.memory_gib)?;
    check_figure(
        "device.memory_bandwidth_gb_per_s",
        &d.memory_bandwidth_gb_per_s,
    )?;
    check_rates(&d.dense_tflops)?;
    if let Some(cc) = &d.compute_capability {
        if super::known::parse_compute_capability(cc).is_none() {
            return Err(Problem::field(
                "device.compute_capability",
                format!(
                    "must be MAJOR.MINOR as NVML reports it (\"8.9\"), got \"{}\"",
                    crate::text::excerpt(cc)
                ),
            ));
        }
    }
    check_efficiency(&d.efficiency)
}

fn check_rates(r: &Rates) -> Result<(), Problem> {
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
    Ok(())
}

/// Fractions of the peak, when they were measured, and the GEMM half-width.
fn check_efficiency(e: &Efficiency) -> Result<(), Problem> {
    for (name, f) in e.figures() {
        if let Some(f) = f {
            check_figure(&format!("device.efficiency.{name}"), f)?;
            if f.value > 1.0 {
                return Err(Problem::field(
                    &format!("device.efficiency.{name}"),
                    format!("is a fraction of the peak (at most 1), got {}", f.value),
                ));
            }
        }
    }
    if e.measured_at.as_ref().is_some_and(|w| w.trim().is_empty()) {
        return Err(Problem::field(
            "device.efficiency.measured_at",
            "must say when the efficiencies were measured",
        ));
    }
    if let Some(f) = &e.matmul_half_width {
        // 0 is a measurement too: narrow GEMMs as fast as wide ones.
        if f.value != 0.0 {
            check_figure("device.efficiency.matmul_half_width", f)?;
        } else if f.source.trim().is_empty() {
            return Err(Problem::field(
                "device.efficiency.matmul_half_width.source",
                "every figure needs a source note (datasheet, measurement or estimate)",
            ));
        }
    }
    Ok(())
}

/// The runtime's own share must leave some of the device's memory.
fn check_runtime_overhead(l: &Layout) -> Result<(), Problem> {
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
    Ok(())
}

/// The link inside a node, and the one between nodes when there is more than one.
fn check_links(l: &Layout) -> Result<(), Problem> {
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
    Ok(())
}

/// Host figures: each a positive figure, none past any real machine.
fn check_host(h: &HostSpec) -> Result<(), Problem> {
    check_figure("host.memory_gib_per_node", &h.memory_gib_per_node)?;
    check_figure("host.link_gb_per_s", &h.link_gb_per_s)?;
    check_figure("host.cpu_cores_per_node", &h.cpu_cores_per_node)?;
    check_figure(
        "host.adam_mparams_per_s_per_core",
        &h.adam_mparams_per_s_per_core,
    )?;
    // 64 TiB of host memory per node, 4,096 cores, a 10 TB/s link: past any machine.
    for (field, f, most) in [
        ("host.memory_gib_per_node", &h.memory_gib_per_node, 65536.0),
        ("host.link_gb_per_s", &h.link_gb_per_s, 10_000.0),
        ("host.cpu_cores_per_node", &h.cpu_cores_per_node, 4096.0),
        (
            "host.adam_mparams_per_s_per_core",
            &h.adam_mparams_per_s_per_core,
            100_000.0,
        ),
    ] {
        if f.value > most {
            return Err(Problem::field(
                field,
                format!("{} is more than any machine has (at most {most})", f.value),
            ));
        }
    }
    Ok(())
}

fn check_link(field: &str, link: &LinkSpec) -> Result<(), Problem> {
    check_figure(
        &format!("{field}.bus_bandwidth_gb_per_s"),
        &link.bus_bandwidth_gb_per_s,
    )?;
    check_figure(&format!("{field}.latency_us"), &link.latency_us)?;
    if let Some(n) = &link.nics_per_node {
        check_figure(&format!("{field}.nics_per_node"), n)?;
        if n.value.fract() != 0.0 || n.value > 64.0 {
            return Err(Problem::field(
                &format!("{field}.nics_per_node"),
                format!("must be a whole number of adapters (1-64), got {}", n.value),
            ));
        }
    }
    Ok(())
}
