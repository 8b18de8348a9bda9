//! Training runs as seen from outside the worker: the JSON-lines protocol a worker writes to
//! its metrics stream, the run directory and its lock, the status folded from the stream, and
//! where a run stands (stream and lock together). No libtorch here, so the dashboard and
//! `osdp-tui status` read runs without it; starting and stopping worker processes is the app's
//! (`osdp_tui::supervisor`).

use std::path::{Path, PathBuf};

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

/// The files of one run: the plan it uses, the metrics stream, checkpoints, the worker's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDir(pub PathBuf);

impl RunDir {
    /// Where the dashboard keeps a model's runs unless told: `runs/NAME`, with the name made a
    /// single plain directory name (it comes from the model file, which anyone may write).
    pub fn default_for(model_name: &str) -> RunDir {
        RunDir(PathBuf::from("runs").join(crate::text::file_component(model_name)))
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
    pub fn read_predicted(&self) -> Option<Predicted> {
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
    pub fn owner(&self) -> Option<crate::lock::LockOwner> {
        crate::lock::owner(&self.0).or_else(|| crate::lock::owner(&self.checkpoints()))
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

/// A line of the worker's log as a reader sees it: of a line a terminal would have redrawn
/// (`\r`, progress), what was drawn last; without the erase-line sequence; `None` when blank.
pub fn log_line(raw: &str) -> Option<String> {
    let shown = raw.rsplit('\r').next().unwrap_or(raw);
    let shown = shown.trim_end_matches('\n').replace("\u{1b}[2K", "");
    (!shown.trim().is_empty()).then_some(shown)
}

/// Follows the worker's log as it grows and keeps its last lines, cleaned by [`log_line`], for
/// the dashboard's log view. A long log already there is read from its last [`LogTail::KEEP`]
/// lines' worth of bytes, not whole.
#[derive(Debug)]
pub struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
    lines: std::collections::VecDeque<String>,
    current: Option<String>,
    /// Lines dropped from the front (past [`LogTail::KEEP`]): line `i` is the log's line
    /// `dropped + i` of those read.
    dropped: u64,
    /// Started in the middle of the log: the first line read is cut.
    cut: bool,
}

impl LogTail {
    /// Lines kept; older ones are dropped.
    pub const KEEP: usize = 5_000;
    /// Bytes read of a log that is already long when the tail starts.
    const FIRST_READ_BYTES: u64 = 1 << 20;

    pub fn new(path: PathBuf) -> LogTail {
        let offset = std::fs::metadata(&path)
            .map(|m| m.len().saturating_sub(Self::FIRST_READ_BYTES))
            .unwrap_or(0);
        LogTail {
            path,
            offset,
            partial: String::new(),
            lines: std::collections::VecDeque::new(),
            current: None,
            dropped: 0,
            cut: offset > 0,
        }
    }

    /// Read what the log gained; how many whole lines that added.
    pub fn read_new(&mut self) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return 0;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if len < self.offset {
            // Truncated or replaced: start again.
            self.offset = 0;
            self.partial.clear();
        }
        if len == self.offset || f.seek(SeekFrom::Start(self.offset)).is_err() {
            return 0;
        }
        let mut buf = Vec::new();
        let Ok(n) = f.read_to_end(&mut buf) else {
            return 0;
        };
        self.offset += n as u64;
        self.partial.push_str(&String::from_utf8_lossy(&buf));
        let mut added = 0;
        while let Some(nl) = self.partial.find('\n') {
            let raw: String = self.partial.drain(..=nl).collect();
            if std::mem::take(&mut self.cut) {
                continue;
            }
            if let Some(line) = log_line(&raw) {
                if self.lines.len() == Self::KEEP {
                    self.lines.pop_front();
                    self.dropped += 1;
                }
                self.lines.push_back(line);
                added += 1;
            }
        }
        // A line redrawn for ever (a progress bar) keeps only what was drawn last.
        if self.partial.len() > 1 << 16 {
            if let Some(cr) = self.partial.rfind('\r') {
                self.partial.drain(..cr);
            }
        }
        self.current = log_line(&self.partial).filter(|_| !self.cut);
        added
    }

    /// Lines on hand: the whole lines kept and the line being written (a progress line the
    /// worker redraws), if any.
    pub fn len(&self) -> usize {
        self.lines.len() + usize::from(self.current.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Line `i` of [`LogTail::len`], oldest first.
    pub fn get(&self, i: usize) -> Option<&str> {
        match self.lines.get(i) {
            Some(l) => Some(l),
            None if i == self.lines.len() => self.current.as_deref(),
            None => None,
        }
    }

    /// Lines dropped from the front so far: with [`LogTail::get`], a position in the log that
    /// stays put as lines come and go.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A process killed mid-line leaves a cut line at the end of `path`: end it, through `f` (open
/// for appending), so the next event starts on a line of its own instead of being swallowed by
/// the broken one.
pub fn end_cut_line(path: &Path, f: &mut std::fs::File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut last = [0u8; 1];
    let cut = std::fs::File::open(path)
        .and_then(|mut r| {
            if r.seek(SeekFrom::End(0))? == 0 {
                return Ok(false);
            }
            r.seek(SeekFrom::End(-1))?;
            r.read_exact(&mut last)?;
            Ok(last[0] != b'\n')
        })
        .unwrap_or(false);
    if cut {
        f.write_all(b"\n")?;
    }
    Ok(())
}

/// Follows a metrics stream as it grows: each read returns the events of the lines completed
/// since the last one (a line still being written waits for its end).
#[derive(Debug)]
pub struct MetricsTail {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl MetricsTail {
    /// From byte `offset` of the stream at `path` (0: from the start).
    pub fn new(path: PathBuf, offset: u64) -> MetricsTail {
        MetricsTail {
            path,
            offset,
            partial: String::new(),
        }
    }

    /// The events written since the last read; none when the file is missing or unreadable.
    /// Lines that do not parse are skipped, as [`RunStatus::from_text`] skips them.
    pub fn read_new(&mut self) -> Vec<WorkerEvent> {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        if f.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::new();
        let Ok(n) = f.read_to_end(&mut buf) else {
            return Vec::new();
        };
        self.offset += n as u64;
        self.partial.push_str(&String::from_utf8_lossy(&buf));
        let mut events = Vec::new();
        while let Some(nl) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=nl).collect();
            if let Ok(ev) = serde_json::from_str::<WorkerEvent>(line.trim_end()) {
                events.push(ev);
            }
        }
        // A last line without its newline is whole when it parses: a JSON object has no
        // complete prefix.
        if let Ok(ev) = serde_json::from_str::<WorkerEvent>(&self.partial) {
            events.push(ev);
            self.partial.clear();
        }
        events
    }
}

/// The planner's figures for a run's plan, beside which its measurements are shown.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicted {
    pub samples_per_s: f64,
    pub tokens_per_s: f64,
    pub step_time_s: f64,
    /// Peak per rank, runtime overhead included.
    pub peak_memory_bytes: u64,
    pub runtime_overhead_bytes: u64,
}

/// One step as the run reported it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPoint {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub step_time_s: f64,
    pub samples_per_s: f64,
    pub tokens_per_s: f64,
    pub memory_bytes: Vec<u64>,
    /// On GPUs, each rank's memory as the CUDA allocator and NVML saw it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<Vec<DeviceMemory>>,
}

/// How long a run has left, from [`RunStatus::remaining`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Remaining {
    /// The run has no last step (`--steps 0`): it trains until stopped.
    UntilStopped,
    /// `steps` to go at `step_time_s` each, measured over the last steps or (before the first
    /// step of the segment) the planner's prediction.
    Steps {
        steps: u64,
        step_time_s: f64,
        measured: bool,
    },
    /// At its last step, or no step time to go by.
    Unknown,
}

impl Remaining {
    /// Seconds left, when known.
    pub fn seconds(&self) -> Option<f64> {
        match *self {
            Remaining::Steps {
                steps, step_time_s, ..
            } => Some(steps as f64 * step_time_s),
            _ => None,
        }
    }
}

/// Everything the metrics stream says so far, folded.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunStatus {
    pub model: Option<String>,
    pub world_size: usize,
    pub global_batch: u64,
    /// Steps of every segment of the run (restarts append), in order.
    pub steps: Vec<StepPoint>,
    pub last_checkpoint: Option<(u64, String)>,
    /// A checkpoint being written (no `checkpoint` event yet).
    pub checkpointing: Option<u64>,
    /// Step each segment (start or restart) began at.
    pub segments: Vec<u64>,
    /// Where the last segment stops by itself; `None`: it runs until stopped.
    pub last_step: Option<u64>,
    /// How the last segment ended: `completed`, `signal`, or the failure message.
    pub ended: Option<String>,
    pub failed: bool,
    /// The planner's figures for the run's plan, when the run directory has them.
    pub predicted: Option<Predicted>,
}

impl RunStatus {
    /// The loss smoothed over recent steps (an exponential average with weight 0.1 on the
    /// newest, over the finite losses): the trend under the noise of single batches.
    pub fn smoothed_loss(&self) -> Option<f64> {
        self.steps
            .iter()
            .map(|p| p.loss)
            .filter(|l| l.is_finite())
            .reduce(|avg, l| 0.9 * avg + 0.1 * l)
    }

    pub fn apply(&mut self, ev: &WorkerEvent) {
        match ev {
            WorkerEvent::Started {
                model,
                world_size,
                global_batch,
                first_step,
                last_step,
                ..
            } => {
                self.model = Some(model.clone());
                self.last_step = *last_step;
                self.world_size = *world_size;
                self.global_batch = *global_batch;
                self.segments.push(*first_step);
                // A resumed segment replays nothing: drop steps past where it resumes.
                self.steps.retain(|s| s.step <= *first_step);
                self.ended = None;
                self.failed = false;
                self.checkpointing = None;
            }
            WorkerEvent::Step {
                step,
                loss,
                grad_norm,
                lr,
                step_time_s,
                samples_per_s,
                tokens_per_s,
                memory_bytes,
                device_memory,
                ..
            } => self.steps.push(StepPoint {
                step: *step,
                loss: *loss,
                grad_norm: *grad_norm,
                lr: *lr,
                step_time_s: *step_time_s,
                samples_per_s: *samples_per_s,
                tokens_per_s: *tokens_per_s,
                memory_bytes: memory_bytes.clone(),
                device_memory: device_memory.clone(),
            }),
            WorkerEvent::Checkpointing { step } => self.checkpointing = Some(*step),
            WorkerEvent::Checkpoint { step, path, .. } => {
                self.checkpointing = None;
                self.last_checkpoint = Some((*step, path.clone()));
            }
            WorkerEvent::Stopped { reason, .. } => self.ended = Some(reason.clone()),
            WorkerEvent::Failed { message } => {
                self.ended = Some(message.clone());
                self.failed = true;
            }
        }
    }

    /// Fold a whole metrics stream; lines that do not parse (a line cut by a crash) are skipped.
    pub fn from_text(text: &str) -> RunStatus {
        let mut s = RunStatus::default();
        for line in text.lines() {
            if let Ok(ev) = serde_json::from_str::<WorkerEvent>(line) {
                s.apply(&ev);
            }
        }
        s
    }

    pub fn last(&self) -> Option<&StepPoint> {
        self.steps.last()
    }

    /// Steps of the last segment (a restart's, or the whole run's).
    pub fn segment_steps(&self) -> &[StepPoint] {
        let from = self.segments.last().copied().unwrap_or(0);
        let first = self.steps.partition_point(|p| p.step <= from);
        &self.steps[first..]
    }

    /// The mean step time over the last (up to) ten steps of this segment: the rate now,
    /// not the first step's start-up.
    pub fn recent_step_time_s(&self) -> Option<f64> {
        let times: Vec<f64> = self
            .segment_steps()
            .iter()
            .rev()
            .take(10)
            .map(|p| p.step_time_s)
            .filter(|t| t.is_finite() && *t > 0.0)
            .collect();
        (!times.is_empty()).then(|| times.iter().sum::<f64>() / times.len() as f64)
    }

    /// How long the last segment has left: steps to its last step × the recent step time,
    /// or the predicted one before its first step.
    pub fn remaining(&self) -> Remaining {
        let Some(last) = self.last_step else {
            return Remaining::UntilStopped;
        };
        let steps = last.saturating_sub(self.step());
        let (time, measured) = match self.recent_step_time_s() {
            Some(t) => (Some(t), true),
            None => (
                self.predicted
                    .map(|p| p.step_time_s)
                    .filter(|t| t.is_finite() && *t > 0.0),
                false,
            ),
        };
        match time {
            Some(step_time_s) if steps > 0 => Remaining::Steps {
                steps,
                step_time_s,
                measured,
            },
            _ => Remaining::Unknown,
        }
    }

    /// The step the run is at: its last step, or where its last segment began.
    pub fn step(&self) -> u64 {
        self.last()
            .map(|p| p.step)
            .or(self.segments.last().copied())
            .unwrap_or(0)
    }
}

/// Where a run stands, from its metrics stream and its lock together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Standing {
    /// A live process holds the run (`owner`), or no lock says who does and the stream has not
    /// ended (`owner` is `None`: it cannot be told).
    Running {
        owner: Option<crate::lock::LockOwner>,
    },
    /// The stream's last segment ended: `completed`, `signal`, `killed`.
    Stopped {
        reason: String,
    },
    Failed {
        message: String,
    },
    /// The lock names a worker that is gone, and the stream never said it ended.
    Dead {
        owner: crate::lock::LockOwner,
    },
}

impl Standing {
    /// `owner` is [`RunDir::owner`] read *before* the stream was last read: a worker that wrote
    /// its end and then exited is then stopped, never dead.
    pub fn of(status: &RunStatus, owner: Option<crate::lock::LockOwner>) -> Standing {
        match (owner, &status.ended) {
            // A live holder may be a new worker that has not written `started` yet.
            (Some(o), _) if o.alive => Standing::Running { owner: Some(o) },
            (_, Some(m)) if status.failed => Standing::Failed { message: m.clone() },
            (_, Some(r)) => Standing::Stopped { reason: r.clone() },
            (Some(o), None) => Standing::Dead { owner: o },
            (None, None) => Standing::Running { owner: None },
        }
    }

    /// Whether the run has ended (stopped, failed or dead).
    pub fn is_over(&self) -> bool {
        !matches!(self, Standing::Running { .. })
    }

    /// What a dead worker is, in words.
    pub fn dead_text(owner: &crate::lock::LockOwner) -> String {
        format!(
            "the worker ({owner}) is gone without a stopped or failed event (killed, or its \
             machine went down): see worker.log"
        )
    }
}

/// What a run is doing, as the dashboard's header shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunState {
    /// No run in this directory yet.
    Idle,
    Starting,
    Running,
    Checkpointing,
    Stopping,
    /// The run ended: stopped, completed or killed (its history stays on screen).
    Stopped,
    /// Why, and the last lines of the worker's log.
    Failed {
        why: String,
        log_tail: Vec<String>,
    },
}

impl RunState {
    pub fn label(&self) -> &'static str {
        match self {
            RunState::Idle => "idle",
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Checkpointing => "checkpointing",
            RunState::Stopping => "stopping",
            RunState::Stopped => "stopped",
            RunState::Failed { .. } => "failed",
        }
    }
}

/// The environment variable that carries a run's token to its rank processes: every rank
/// presents it when it joins, and rank 0 turns away a process that does not.
pub const RUN_TOKEN_VAR: &str = "OSDP_RUN_TOKEN";

/// `osdp-tui status RUN_DIR`: the run's status from its metrics stream.
pub fn read_status(dir: &Path) -> std::io::Result<RunStatus> {
    let run = RunDir(dir.to_path_buf());
    let text = std::fs::read_to_string(run.metrics())?;
    let mut status = RunStatus::from_text(&text);
    status.predicted = run.read_predicted();
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smoothed_loss_follows_the_trend_and_skips_diverged_steps() {
        let mut status = RunStatus::default();
        assert_eq!(status.smoothed_loss(), None);
        for (step, loss) in [(1, 5.0), (2, f64::NAN), (3, 4.0)] {
            status.apply(&WorkerEvent::Step {
                step,
                loss,
                grad_norm: 1.0,
                lr: 1e-3,
                step_time_s: 0.1,
                samples_per_s: 1.0,
                tokens_per_s: 1.0,
                memory_bytes: vec![],
                memory_breakdown: MemoryBreakdown::default(),
                device_memory: Default::default(),
            });
        }
        let s = status.smoothed_loss().unwrap();
        assert!((s - (0.9 * 5.0 + 0.1 * 4.0)).abs() < 1e-12, "{s}");
        assert_eq!(
            status.last().map(|p| (p.lr, p.grad_norm)),
            Some((1e-3, 1.0))
        );
    }

    #[test]
    fn a_resumed_segment_continues_the_step_count_and_drops_replayed_steps() {
        let lines = [
            r#"{"event":"started","model":"m","world_size":2,"global_batch":8,"first_step":0,"last_step":null,"data":"text","device":"cpu"}"#,
            r#"{"event":"step","step":1,"loss":5.0,"grad_norm":1.0,"lr":0.1,"step_time_s":0.1,"samples_per_s":80.0,"tokens_per_s":1.0,"memory_bytes":[1,2],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"working":0}}"#,
            r#"{"event":"checkpointing","step":1}"#,
            r#"{"event":"checkpoint","step":1,"path":"c/step-00000001","write_time_s":0.01}"#,
            r#"{"event":"step","step":2,"loss":4.0,"grad_norm":1.0,"lr":0.1,"step_time_s":0.1,"samples_per_s":80.0,"tokens_per_s":1.0,"memory_bytes":[1,2],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"working":0}}"#,
            r#"{"event":"failed","message":"boom"}"#,
            r#"{"event":"started","model":"m","world_size":2,"global_batch":8,"first_step":1,"last_step":9,"data":"text","device":"cpu"}"#,
            r#"{"event":"step","step":2,"loss":4.1,"grad_norm":1.0,"lr":0.1,"step_time_s":0.1,"samples_per_s":80.0,"tokens_per_s":1.0,"memory_bytes":[1,2],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"work"#,
        ];
        let s = RunStatus::from_text(&lines.join("\n"));
        assert_eq!(s.segments, vec![0, 1]);
        assert_eq!(s.steps.iter().map(|p| p.step).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.last_checkpoint.as_ref().map(|c| c.0), Some(1));
        assert!(!s.failed, "the restart cleared the failure");
    }

    #[test]
    fn a_diverged_step_is_written_and_read_back_as_nan() {
        let step = WorkerEvent::Step {
            step: 3,
            loss: f64::NAN,
            grad_norm: f64::INFINITY,
            lr: 0.1,
            step_time_s: 0.1,
            samples_per_s: 80.0,
            tokens_per_s: 1.0,
            memory_bytes: vec![1],
            memory_breakdown: MemoryBreakdown::default(),
            device_memory: None,
        };
        let line = serde_json::to_string(&step).unwrap();
        assert!(line.contains(r#""loss":null"#), "{line}");
        let s = RunStatus::from_text(&line);
        assert_eq!(
            s.steps.len(),
            1,
            "the step is read, not skipped as a broken line"
        );
        assert!(s.steps[0].loss.is_nan());
    }

    fn step(step: u64, step_time_s: f64) -> WorkerEvent {
        WorkerEvent::Step {
            step,
            loss: 1.0,
            grad_norm: 1.0,
            lr: 1e-3,
            step_time_s,
            samples_per_s: 1.0,
            tokens_per_s: 1.0,
            memory_bytes: vec![1],
            memory_breakdown: MemoryBreakdown::default(),
            device_memory: None,
        }
    }

    fn started(first_step: u64, last_step: Option<u64>) -> WorkerEvent {
        WorkerEvent::Started {
            model: "m".into(),
            world_size: 2,
            global_batch: 8,
            first_step,
            last_step,
            resumed_from: None,
            data: "text".into(),
            device: "cpu".into(),
        }
    }

    #[test]
    fn the_time_left_is_steps_left_times_the_recent_step_time() {
        let mut s = RunStatus {
            predicted: Some(Predicted {
                samples_per_s: 1.0,
                tokens_per_s: 1.0,
                step_time_s: 0.5,
                peak_memory_bytes: 1,
                runtime_overhead_bytes: 0,
            }),
            ..RunStatus::default()
        };
        s.apply(&started(0, None));
        s.apply(&step(1, 9.0));
        assert_eq!(s.remaining(), Remaining::UntilStopped);
        // A resumed segment of 100 steps: before its first step, the prediction.
        s.apply(&started(1, Some(101)));
        assert_eq!(
            s.remaining(),
            Remaining::Steps {
                steps: 100,
                step_time_s: 0.5,
                measured: false
            }
        );
        // Then the last ten steps of this segment (not the earlier one's 9 s step).
        for k in 2..=13 {
            s.apply(&step(k, if k < 4 { 5.0 } else { 2.0 }));
        }
        assert_eq!(
            s.remaining(),
            Remaining::Steps {
                steps: 88,
                step_time_s: 2.0,
                measured: true
            }
        );
        assert_eq!(s.remaining().seconds(), Some(176.0));
        s.apply(&step(101, 2.0));
        assert_eq!(s.remaining(), Remaining::Unknown, "at its last step");
    }

    #[test]
    fn the_log_tail_follows_whole_lines_and_shows_the_one_being_redrawn() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker.log");
        let mut f = std::fs::File::create(&path).unwrap();
        let mut tail = LogTail::new(path.clone());
        assert_eq!(tail.read_new(), 0);
        assert!(tail.is_empty());
        write!(f, "training m\n\n\x1b[2Kstep 1\r\x1b[2Kstep 2").unwrap();
        assert_eq!(
            tail.read_new(),
            1,
            "one whole line; the blank one is skipped"
        );
        assert_eq!(tail.len(), 2);
        assert_eq!(tail.get(0), Some("training m"));
        assert_eq!(
            tail.get(1),
            Some("step 2"),
            "what a terminal would show now"
        );
        writeln!(f, "\r\x1b[2Kcheckpoint c/step-2").unwrap();
        assert_eq!(tail.read_new(), 1);
        let lines: Vec<_> = (0..tail.len()).filter_map(|i| tail.get(i)).collect();
        assert_eq!(lines, ["training m", "checkpoint c/step-2"]);
        // Never more than KEEP lines; the newest stay.
        for i in 0..LogTail::KEEP + 10 {
            writeln!(f, "line {i}").unwrap();
        }
        tail.read_new();
        assert_eq!(tail.len(), LogTail::KEEP);
        assert_eq!(tail.dropped(), 12);
        assert_eq!(
            tail.get(LogTail::KEEP - 1).map(str::to_owned),
            Some(format!("line {}", LogTail::KEEP + 9))
        );
    }
}
