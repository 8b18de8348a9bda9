//! Training runs as seen from outside the worker: the JSON-lines protocol a worker writes to
//! its metrics stream, the run directory, the status folded from the stream, and the supervisor
//! that starts, watches and stops a worker process. No libtorch here, so the dashboard and
//! `osdp-tui status` read runs without it.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    /// Whether a checkpoint to resume from exists (`latest.json` written by the worker).
    pub fn has_checkpoint(&self) -> bool {
        self.checkpoints().join("latest.json").exists()
    }
    /// The last `n` lines of the worker's log.
    pub fn log_tail(&self, n: usize) -> Vec<String> {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .flat_map(|l| l.rsplit('\r').next())
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.replace("\u{1b}[2K", ""))
            .collect();
        lines[lines.len().saturating_sub(n)..].to_vec()
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
    pub step_time_s: f64,
    pub samples_per_s: f64,
    pub tokens_per_s: f64,
    pub memory_bytes: Vec<u64>,
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
    /// How the last segment ended: `completed`, `signal`, or the failure message.
    pub ended: Option<String>,
    pub failed: bool,
    /// The planner's figures for the run's plan, when the run directory has them.
    pub predicted: Option<Predicted>,
}

impl RunStatus {
    pub fn apply(&mut self, ev: &WorkerEvent) {
        match ev {
            WorkerEvent::Started {
                model,
                world_size,
                global_batch,
                first_step,
                ..
            } => {
                self.model = Some(model.clone());
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
                step_time_s,
                samples_per_s,
                tokens_per_s,
                memory_bytes,
                ..
            } => self.steps.push(StepPoint {
                step: *step,
                loss: *loss,
                step_time_s: *step_time_s,
                samples_per_s: *samples_per_s,
                tokens_per_s: *tokens_per_s,
                memory_bytes: memory_bytes.clone(),
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
}

/// What a run is doing, as the dashboard's header shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunState {
    Idle,
    Starting,
    Running,
    Checkpointing,
    Stopping,
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
            RunState::Failed { .. } => "failed",
        }
    }
}

/// The environment variable that carries a run's token to its rank processes: every rank
/// presents it when it joins, and rank 0 turns away a process that does not.
pub const RUN_TOKEN_VAR: &str = "OSDP_RUN_TOKEN";

/// A fresh run token: 128 bits from the kernel's generator, as hex.
pub fn new_run_token() -> String {
    let mut bytes = [0u8; 16];
    let from_kernel = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok();
    if !from_kernel {
        // std seeds its hash keys from the OS's generator: the next best source.
        use std::hash::{BuildHasher, Hasher};
        for half in bytes.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::UNIX_EPOCH
                    .elapsed()
                    .map_or(0, |d| d.as_nanos()),
            );
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// How to launch workers (fixed for a dashboard session).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSpec {
    /// The `osdp-tui` binary built with the trainer.
    pub exe: PathBuf,
    pub model: PathBuf,
    pub checkpoint_every: u64,
    /// Declare the worker hung after this long without a new step.
    pub hang_after: Duration,
}

/// How a run's ranks are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// One worker process, its ranks threads on the CPU.
    CpuThreads,
    /// One worker process per GPU of this machine (`--device cuda`, NCCL), joined over
    /// loopback as torchrun would: `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR/PORT`.
    GpuProcesses,
}

/// One start of a worker: the plan and the shape of the run.
pub struct Launch<'a> {
    pub plan_json: &'a str,
    pub ranks: Ranks,
    pub world_size: usize,
    /// The ranks as nodes of this many (a CPU layout of several nodes, for hsdp plans);
    /// `None`: one node.
    pub ranks_per_node: Option<usize>,
    /// Samples per step over all ranks.
    pub global_batch: u64,
    pub predicted: Option<Predicted>,
}

/// A worker process and what it has said. Poll it; it never blocks.
pub struct Supervisor {
    pub dir: RunDir,
    pub state: RunState,
    pub status: RunStatus,
    /// The worker processes, rank 0 first (one for CPU threads, one per GPU otherwise).
    children: Vec<Child>,
    read_offset: u64,
    partial: String,
    last_progress: Instant,
    hang_after: Duration,
    term_sent: bool,
    /// When this dashboard saw the last checkpoint land.
    pub last_checkpoint_at: Option<Instant>,
}

impl Supervisor {
    /// Start a worker on `plan_json` (written into the run directory first). Resumes from the
    /// run's latest checkpoint when it has one.
    pub fn start(spec: &LaunchSpec, dir: RunDir, launch: &Launch) -> std::io::Result<Supervisor> {
        std::fs::create_dir_all(&dir.0)?;
        crate::input::write_atomically(&dir.plan(), launch.plan_json.as_bytes())?;
        if let Some(p) = &launch.predicted {
            crate::input::write_json_atomically(&dir.predicted(), p)?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.log())?;
        let metrics_len = std::fs::metadata(dir.metrics())
            .map(|m| m.len())
            .unwrap_or(0);
        let processes = match launch.ranks {
            Ranks::CpuThreads => 1,
            Ranks::GpuProcesses => launch.world_size.max(1),
        };
        let port = match launch.ranks {
            Ranks::CpuThreads => 0,
            Ranks::GpuProcesses => free_port()?,
        };
        // One token per start: a process of another run (or a stranger) cannot join this one.
        let token = new_run_token();
        let mut children: Vec<Child> = Vec::with_capacity(processes);
        for rank in 0..processes {
            let mut cmd = Command::new(&spec.exe);
            cmd.arg("train")
                .arg(&spec.model)
                .arg("--plan")
                .arg(dir.plan())
                .arg("--global-batch")
                .arg(launch.global_batch.to_string())
                .args(["--steps", "0"])
                .arg("--metrics")
                .arg(dir.metrics())
                .arg("--checkpoint-dir")
                .arg(dir.checkpoints())
                .arg("--checkpoint-every")
                .arg(spec.checkpoint_every.max(1).to_string());
            if dir.has_checkpoint() {
                cmd.arg("--resume");
            }
            // Whatever launcher started the dashboard, its workers are laid out here.
            for var in [
                "RANK",
                "WORLD_SIZE",
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "TORCHELASTIC_RUN_ID",
            ] {
                cmd.env_remove(var);
            }
            match launch.ranks {
                Ranks::CpuThreads => {
                    cmd.arg("--world-size").arg(launch.world_size.to_string());
                    if let Some(n) = launch.ranks_per_node {
                        cmd.arg("--ranks-per-node").arg(n.to_string());
                    }
                }
                Ranks::GpuProcesses => {
                    let n = processes.to_string();
                    cmd.args(["--device", "cuda"])
                        .env("RANK", rank.to_string())
                        .env("LOCAL_RANK", rank.to_string())
                        .env("WORLD_SIZE", &n)
                        .env("LOCAL_WORLD_SIZE", &n)
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", port.to_string())
                        .env(RUN_TOKEN_VAR, &token)
                        .env_remove("OSDP_PORT");
                }
            }
            cmd.stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone()?))
                .stderr(Stdio::from(log.try_clone()?));
            stop_with_parent(&mut cmd);
            match cmd.spawn() {
                Ok(child) => children.push(child),
                Err(e) => {
                    for mut c in children {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    return Err(e);
                }
            }
        }
        // Earlier segments' events give the loss curve its history.
        let earlier = std::fs::read_to_string(dir.metrics()).unwrap_or_default();
        Ok(Supervisor {
            status: RunStatus::from_text(&earlier),
            dir,
            state: RunState::Starting,
            children,
            read_offset: metrics_len,
            partial: String::new(),
            last_progress: Instant::now(),
            hang_after: spec.hang_after,
            term_sent: false,
            last_checkpoint_at: None,
        })
    }

    /// Rank 0's process.
    pub fn pid(&self) -> Option<u32> {
        self.children.first().map(Child::id)
    }

    pub fn is_live(&self) -> bool {
        !self.children.is_empty()
    }

    /// Read new events, notice an exit or a hang. The run has ended when every process has;
    /// one process failing ends the others (their collectives could only wait for it).
    pub fn poll(&mut self) {
        self.read_events();
        if self.children.is_empty() {
            return;
        }
        let mut failure: Option<String> = None;
        let mut i = 0;
        while i < self.children.len() {
            match self.children[i].try_wait() {
                Ok(Some(status)) => {
                    let _ = self.children.remove(i).wait(); // already reaped: returns its status
                    if !status.success() && failure.is_none() {
                        failure = Some(match status.code() {
                            Some(c) => format!("the worker exited with status {c}"),
                            None => "the worker was killed (by a signal: out of memory, or from outside)"
                                .to_string(),
                        });
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    failure.get_or_insert(format!("cannot watch the worker: {e}"));
                    i += 1;
                }
            }
        }
        if let Some(why) = failure {
            self.kill_all();
            self.read_events();
            let why = match self.status.ended.clone() {
                Some(msg) if self.status.failed => msg,
                _ => why,
            };
            self.fail(why);
            return;
        }
        if self.children.is_empty() {
            self.read_events();
            if self.status.failed {
                let why = self.status.ended.clone().unwrap_or_default();
                self.fail(why);
            } else {
                self.state = RunState::Idle;
            }
            return;
        }
        if !matches!(self.state, RunState::Stopping)
            && self.last_progress.elapsed() > self.hang_after
        {
            let secs = self.hang_after.as_secs();
            self.kill_all();
            self.fail(format!(
                "no progress for {secs} s: the worker was hung and is stopped"
            ));
        }
    }

    fn kill_all(&mut self) {
        for mut c in self.children.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn fail(&mut self, why: String) {
        self.state = RunState::Failed {
            why,
            log_tail: self.dir.log_tail(8),
        };
    }

    fn read_events(&mut self) {
        let Ok(mut f) = std::fs::File::open(self.dir.metrics()) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.read_offset)).is_err() {
            return;
        }
        let mut buf = String::new();
        let Ok(n) = f.read_to_string(&mut buf) else {
            return;
        };
        self.read_offset += n as u64;
        self.partial.push_str(&buf);
        while let Some(nl) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=nl).collect();
            if let Ok(ev) = serde_json::from_str::<WorkerEvent>(line.trim_end()) {
                self.status.apply(&ev);
                self.last_progress = Instant::now();
                if matches!(ev, WorkerEvent::Checkpoint { .. }) {
                    self.last_checkpoint_at = Some(Instant::now());
                }
                if !self.children.is_empty() && self.state != RunState::Stopping {
                    self.state = match (&ev, self.status.checkpointing) {
                        (_, Some(_)) => RunState::Checkpointing,
                        (WorkerEvent::Started { .. }, _) => RunState::Starting,
                        _ => RunState::Running,
                    };
                }
            }
        }
    }

    /// Ask the worker to stop: the first call lets it finish the step and checkpoint
    /// (SIGTERM); a second call kills it.
    pub fn stop(&mut self) {
        if self.children.is_empty() {
            return;
        }
        if self.term_sent {
            for c in &mut self.children {
                let _ = c.kill();
            }
            return;
        }
        self.term_sent = true;
        self.state = RunState::Stopping;
        for c in &self.children {
            terminate(c.id());
        }
    }

    /// Stop and wait up to `limit` for the worker to exit (killing it after that).
    pub fn stop_and_wait(&mut self, limit: Duration) {
        self.stop();
        let deadline = Instant::now() + limit;
        while !self.children.is_empty() && Instant::now() < deadline {
            self.poll();
            std::thread::sleep(Duration::from_millis(20));
        }
        if !self.children.is_empty() {
            self.kill_all();
            self.state = RunState::Idle;
        }
    }
}

/// A loopback port nobody listens on now, for a run's rank 0.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Never leave a worker behind the dashboard: ask it to checkpoint and go.
        if !self.children.is_empty() {
            self.stop_and_wait(Duration::from_secs(30));
        }
    }
}

/// If the dashboard dies without stopping its worker (killed, terminal closed), the worker gets
/// SIGTERM: it finishes its step, checkpoints and exits instead of training on unseen.
#[cfg(target_os = "linux")]
fn stop_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn stop_with_parent(_cmd: &mut Command) {}

#[cfg(unix)]
fn terminate(pid: u32) {
    // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory effects.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
}

#[cfg(not(unix))]
fn terminate(_pid: u32) {}

/// `osdp-tui status RUN_DIR`: the run's status from its metrics stream.
pub fn read_status(dir: &Path) -> std::io::Result<RunStatus> {
    let run = RunDir(dir.to_path_buf());
    let text = std::fs::read_to_string(run.metrics())?;
    let mut status = RunStatus::from_text(&text);
    status.predicted = std::fs::read_to_string(run.predicted())
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn every_start_of_a_run_gets_its_own_token() {
        let (a, b) = (new_run_token(), new_run_token());
        assert_eq!(a.len(), 32, "{a}");
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b, "two starts, two tokens");
    }
}
