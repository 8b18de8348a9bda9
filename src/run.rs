//! Training runs as seen from outside the worker: the run directory and its lock, the
//! worker's log and metrics stream followed as they grow, the status folded from the stream,
//! and where a run stands (stream and lock together). No libtorch here, so the dashboard and
//! `osdp-tui status` read runs without it; starting and stopping worker processes is the
//! [`crate::supervisor`]'s. What the worker writes is `osdp_core::protocol`.

pub mod lock;
mod status;
mod tail;

use std::path::PathBuf;

use osdp_core::protocol::{RunPrediction, WorkerEvent};

pub use status::{read_status, Remaining, RunState, RunStatus, Standing, StepPoint};
pub use tail::{end_cut_line, log_line, Fresh, LogTail, MetricsTail, Reread};

/// What a file that should be a regular one is instead, for a message: `a directory`.
fn file_kind(kind: std::fs::FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_file() {
        "a file"
    } else {
        "not a regular file"
    }
}

/// The files of one run: the plan it uses, the metrics stream, checkpoints, the worker's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDir(pub PathBuf);

impl RunDir {
    /// Where the dashboard keeps a model's runs unless told: `runs/NAME`, with the name made a
    /// single plain directory name (it comes from the model file, which anyone may write).
    pub fn default_for(model_name: &str) -> RunDir {
        RunDir(PathBuf::from("runs").join(osdp_core::text::file_component(model_name)))
    }

    pub fn plan(&self) -> PathBuf {
        self.0.join("plan.json")
    }
    pub fn metrics(&self) -> PathBuf {
        self.0.join("metrics.jsonl")
    }
    pub fn checkpoints(&self) -> PathBuf {
        self.0.join("checkpoints")
    }
    pub fn log(&self) -> PathBuf {
        self.0.join("worker.log")
    }
    /// The planner's prediction for the plan the run uses (written by the dashboard).
    pub fn predicted(&self) -> PathBuf {
        self.0.join("predicted.json")
    }
    /// The planner's figures for the run's plan, when the directory has them.
    pub fn read_predicted(&self) -> Option<RunPrediction> {
        std::fs::read_to_string(self.predicted())
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
    }
    /// Whether a checkpoint to resume from exists (`latest.json` written by the worker).
    pub fn has_checkpoint(&self) -> bool {
        self.checkpoints().join("latest.json").exists()
    }
    /// Who holds the run: the run directory's lock (a dashboard names its worker there), else
    /// the checkpoint directory's (held by any `train --checkpoint-dir` while it runs).
    pub fn owner(&self) -> Option<lock::LockOwner> {
        lock::owner(&self.0).or_else(|| lock::owner(&self.checkpoints()))
    }
    /// Where the run's locks stand: a live holder of the run directory's lock or else of the
    /// checkpoint directory's holds the run; else what the run directory's lock says, else the
    /// checkpoint directory's.
    pub fn lock_state(&self) -> lock::LockState {
        let run = lock::state(&self.0);
        if run.is_live() {
            return run;
        }
        let checkpoints = lock::state(&self.checkpoints());
        if checkpoints.is_live() || run == lock::LockState::Absent {
            checkpoints
        } else {
            run
        }
    }

    /// Append `ev` to the metrics stream: how a supervisor records an end the worker could
    /// not write (killed, hung), so that whoever reads the run later knows how it ended.
    pub fn append_event(&self, ev: &WorkerEvent) -> std::io::Result<()> {
        use std::io::Write;
        let path = self.metrics();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        end_cut_line(&path, &mut f)?;
        let line = serde_json::to_string(ev).map_err(std::io::Error::other)?;
        writeln!(f, "{line}")?;
        f.flush()
    }

    /// The last `n` lines of the worker's log.
    pub fn log_tail(&self, n: usize) -> Vec<String> {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<String> = text.lines().filter_map(log_line).collect();
        lines[lines.len().saturating_sub(n)..].to_vec()
    }
}
