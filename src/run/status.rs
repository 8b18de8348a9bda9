//! A run's status folded from its metrics stream, and where it stands.

use std::path::Path;

use serde::Serialize;

use osdp_core::protocol::{DeviceMemory, RunPrediction, WorkerEvent};

use super::lock::{LockOwner, LockState};
use super::RunDir;

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
    pub predicted: Option<RunPrediction>,
    /// Held-out losses (`--eval-data`): `(step, loss)`, in order.
    pub evals: Vec<(u64, f64)>,
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
            WorkerEvent::Eval { step, loss, .. } => self.evals.push((*step, *loss)),
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
        owner: Option<LockOwner>,
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
        owner: LockOwner,
    },
    /// The stream never said it ended, and its lock names no one (`lock` says what it is:
    /// empty, not a record, a directory) and no process holds it: whatever ran it is gone.
    Abandoned {
        lock: String,
    },
}

impl Standing {
    /// `owner` is [`RunDir::owner`] read *before* the stream was last read: a worker that wrote
    /// its end and then exited is then stopped, never dead.
    pub fn of(status: &RunStatus, owner: Option<LockOwner>) -> Standing {
        match (owner, &status.ended) {
            // A live holder may be a new worker that has not written `started` yet.
            (Some(o), _) if o.alive => Standing::Running { owner: Some(o) },
            (_, Some(m)) if status.failed => Standing::Failed { message: m.clone() },
            (_, Some(r)) => Standing::Stopped { reason: r.clone() },
            (Some(o), None) => Standing::Dead { owner: o },
            (None, None) => Standing::Running { owner: None },
        }
    }

    /// [`Standing::of`] from everything the run's locks say ([`RunDir::lock_state`]): a lock
    /// that names no one is either held (running) or abandoned.
    pub fn of_lock(status: &RunStatus, lock: LockState) -> Standing {
        match lock {
            LockState::Named(o) => Standing::of(status, Some(o)),
            LockState::Absent => Standing::of(status, None),
            LockState::Unnamed { held: true, .. } => Standing::Running { owner: None },
            LockState::Unnamed {
                problem,
                held: false,
            } => match Standing::of(status, None) {
                Standing::Running { .. } => Standing::Abandoned { lock: problem },
                ended => ended,
            },
        }
    }

    /// Whether the run has ended (stopped, failed, dead or abandoned).
    pub fn is_over(&self) -> bool {
        !matches!(self, Standing::Running { .. })
    }

    /// What a dead worker is, in words.
    pub fn dead_text(owner: &LockOwner) -> String {
        format!(
            "the worker ({owner}) is gone without a stopped or failed event (killed, or its \
             machine went down): see worker.log"
        )
    }

    /// What an abandoned run is, in words.
    pub fn abandoned_text(lock: &str) -> String {
        format!(
            "{lock} and no process holds it, and the run never said it ended: nothing runs it \
             (see worker.log)"
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
    use osdp_core::protocol::MemoryBreakdown;

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
            predicted: Some(RunPrediction {
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
}
