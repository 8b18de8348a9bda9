//! Training runs as seen from outside the worker: the JSON-lines protocol a worker writes to
//! its metrics stream. No libtorch here, so the dashboard and scripts read runs without it.

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
}

impl MemoryBreakdown {
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
        last_step: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumed_from: Option<String>,
        data: String,
        device: String,
    },
    Step {
        /// Optimizer steps completed.
        step: u64,
        loss: f64,
        grad_norm: f64,
        lr: f64,
        step_time_s: f64,
        samples_per_s: f64,
        tokens_per_s: f64,
        /// Peak bytes each rank's executor held during the step.
        memory_bytes: Vec<u64>,
        /// Rank 0's peak by category.
        memory_breakdown: MemoryBreakdown,
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
