//! The protocol between a training worker and whoever watches it: the JSON lines a worker
//! writes to its metrics stream ([`WorkerEvent`]), the memory figures they carry, the
//! planner's prediction stored beside a run, and the variable that hands a run's token to its
//! ranks. The trainer writes these and the app reads them; run directories, tails, status and
//! locks are the app's (`osdp_tui::run`).

use serde::{Deserialize, Serialize};

/// Bytes one rank held at its peak, by category (the executor's ledger).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryBreakdown {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub gathered: u64,
    pub grad_buffers: u64,
    pub activations: u64,
    pub working: u64,
    /// Held in host memory (offloaded optimizer state and parameters): not part of the
    /// device's [`MemoryBreakdown::total`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl MemoryBreakdown {
    /// Device bytes: every category but host memory.
    pub fn total(&self) -> u64 {
        self.params
            + self.grads
            + self.optimizer
            + self.gathered
            + self.grad_buffers
            + self.activations
            + self.working
    }
}

/// One GPU rank's memory over a step from outside the executor's ledger; `None`: not
/// available (a build without the allocator shim, or no NVML).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceMemory {
    /// Peak bytes the CUDA caching allocator handed out during the step.
    pub allocated_peak_bytes: Option<u64>,
    /// Peak bytes the allocator reserved from the driver (handed out plus cached).
    pub reserved_peak_bytes: Option<u64>,
    /// NVML's memory of the rank's process after the step: the reserve plus the CUDA context,
    /// NCCL's buffers and library workspaces.
    pub process_bytes: Option<u64>,
}

/// A linear whose weight the trainer's executor multiplied with zero rows added (so that its
/// GEMMs run on aligned tensor-core kernels), as the kernels ran, not as the model says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaddedLinear {
    pub op: String,
    /// The weight's rows, and the rows its GEMMs ran with.
    pub rows: i64,
    pub padded_rows: i64,
    /// Whether the forward's and the backward's GEMMs ran padded.
    pub forward: bool,
    pub backward: bool,
}

/// A number, or `null` (what serde_json writes for NaN and infinities) as NaN.
fn number_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One line of a worker's metrics stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerEvent {
    Started {
        model: String,
        world_size: usize,
        global_batch: u64,
        /// The step the run starts at (non-zero when resumed).
        first_step: u64,
        /// Where it will stop by itself; `None`: until stopped.
        last_step: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumed_from: Option<String>,
        data: String,
        device: String,
    },
    Step {
        /// Optimizer steps completed.
        step: u64,
        /// NaN or infinite when training diverged: JSON has no such numbers, so they are
        /// written as `null` and read back as NaN.
        #[serde(deserialize_with = "number_or_nan")]
        loss: f64,
        #[serde(deserialize_with = "number_or_nan")]
        grad_norm: f64,
        lr: f64,
        step_time_s: f64,
        samples_per_s: f64,
        tokens_per_s: f64,
        /// Peak bytes each rank's executor held during the step.
        memory_bytes: Vec<u64>,
        /// Rank 0's peak by category.
        memory_breakdown: MemoryBreakdown,
        /// On GPUs, each rank's memory as the CUDA allocator and NVML see it (absent on CPUs).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device_memory: Option<Vec<DeviceMemory>>,
    },
    /// The loss on held-out data (`--eval-data`) after `step`: the mean next-token loss over
    /// its first `samples` samples, in order.
    Eval {
        step: u64,
        #[serde(deserialize_with = "number_or_nan")]
        loss: f64,
        samples: u64,
    },
    /// A checkpoint of `step` is being written.
    Checkpointing {
        step: u64,
    },
    Checkpoint {
        step: u64,
        path: String,
        write_time_s: f64,
    },
    Stopped {
        step: u64,
        /// `completed` or `signal`.
        reason: String,
    },
    Failed {
        message: String,
    },
}

/// The part of the planner's [`Prediction`](crate::plan::Prediction) a run directory keeps
/// (`predicted.json`), beside which the run's measurements are shown.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunPrediction {
    pub samples_per_s: f64,
    pub tokens_per_s: f64,
    pub step_time_s: f64,
    /// Peak per rank, runtime overhead included.
    pub peak_memory_bytes: u64,
    pub runtime_overhead_bytes: u64,
}

impl From<&crate::plan::Prediction> for RunPrediction {
    fn from(p: &crate::plan::Prediction) -> RunPrediction {
        RunPrediction {
            samples_per_s: p.throughput_samples_per_s,
            tokens_per_s: p.tokens_per_s,
            step_time_s: p.step_time_s,
            peak_memory_bytes: p.peak_memory_bytes,
            runtime_overhead_bytes: p.overhead_bytes,
        }
    }
}

/// The environment variable that carries a run's token to its rank processes: every rank
/// presents it when it joins, and rank 0 turns away a process that does not.
pub const RUN_TOKEN_VAR: &str = "OSDP_RUN_TOKEN";
