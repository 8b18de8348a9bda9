//! Running a worker: launch its processes (one for CPU threads, one per GPU), follow what it
//! writes to its run directory, stop it, or leave it running (detach). A run another process
//! owns is followed read-only. The protocol, the run directory and its lock live in
//! `osdp_core`; this is the process side, which only the app needs.
//!
//! Who owns a run: starting a worker takes the run directory's lock and names the worker's
//! rank 0 in it; rank 0 inherits the lock file, so the lock is held exactly as long as the
//! worker lives, whether a dashboard watches it or not. A later dashboard (or `osdp-tui status`)
//! reads the lock to know whether the run is alive. Each worker process has a lifeline
//! ([`crate::lifeline`]) and sits in the run's own process group: a dashboard that dies stops
//! its worker (step, checkpoint, exit); one that detaches leaves it running, and SIGTERM to the
//! group stops it later.

use std::io::Read;
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cli::train::{DeviceArg, TrainArgs};
use crate::lifeline::{self, Lifeline};
use crate::run::lock::{DirLock, LockOwner};
use crate::run::{LogTail, MetricsTail, RunDir, RunState, RunStatus, Standing};
use osdp_core::protocol::{RunPrediction, WorkerEvent, RUN_TOKEN_VAR};
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
    /// What runs train on and from: kept for every start and restart.
    pub data: RunData,
}

/// The weights and data of the dashboard's runs (`--init-from`, `--data`, `--tokenizer`,
/// `--eval-data`), as `train` takes them; all `None`: seeded weights on the built-in text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunData {
    pub init_from: Option<PathBuf>,
    pub data: Option<String>,
    pub tokenizer: Option<PathBuf>,
    pub eval_data: Option<String>,
    /// Steps between held-out losses [default: train's].
    pub eval_every: Option<u64>,
}

impl RunData {
    /// One line for the training panel, `None` when everything is the default.
    pub fn describe(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(i) = &self.init_from {
            parts.push(format!("from {}", i.display()));
        }
        if let Some(d) = &self.data {
            parts.push(format!("data {d}"));
        }
        if let Some(t) = &self.tokenizer {
            parts.push(format!("tokenizer {}", t.display()));
        }
        if let Some(e) = &self.eval_data {
            parts.push(format!("held-out {e}"));
        }
        (!parts.is_empty()).then(|| parts.join(" · "))
    }
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
    /// The step the run ends after (`train --steps`); 0: until stopped.
    pub steps: u64,
    pub predicted: Option<RunPrediction>,
}

/// Who runs the run a [`Supervisor`] shows.
enum Workers {
    /// Processes this dashboard started, rank 0 first; the run directory's lock, shared with
    /// rank 0 and released here when they end; a lifeline to each.
    Own {
        children: Vec<Child>,
        lock: Option<DirLock>,
        lifelines: Vec<Lifeline>,
    },
    /// A run another process holds (named in the lock), followed read-only.
    Attached(LockOwner),
    /// No process: the run has ended (or this dashboard detached from it).
    Ended,
}

/// A run and what it has said: one this dashboard started, or one it found in the run
/// directory. Poll it; it never blocks.
pub struct Supervisor {
    pub dir: RunDir,
    pub state: RunState,
    pub status: RunStatus,
    workers: Workers,
    tail: MetricsTail,
    /// When the last event arrived.
    last_progress: Instant,
    /// When the last step arrived (seen by this dashboard).
    last_step_at: Option<Instant>,
    /// When this supervisor started the workers (`None` for a run it attached to).
    started_at: Option<Instant>,
    /// When the worker began, for the elapsed time: this dashboard's start, or the start the
    /// lock records for another process's worker.
    began_at: Option<Instant>,
    /// When this dashboard saw the run end.
    ended_at: Option<Instant>,
    /// The worker's output (`worker.log`), for the log view.
    pub log: LogTail,
    /// From the start to the first step this start ran: start-up (libtorch, rendezvous,
    /// building the model, a checkpoint read) plus one step.
    pub first_step_after: Option<Duration>,
    hang_after: Duration,
    term_sent: bool,
    kill_sent: bool,
    /// When this dashboard saw the last checkpoint land.
    pub last_checkpoint_at: Option<Instant>,
    /// What the state alone does not say about how the run ended (a kill that lost steps).
    pub note: Option<String>,
}

/// How long a worker may go without an event before it is declared hung: not at all before
/// its first step (loading, joining the other ranks, resuming and the first step take as long
/// as they take) nor while it writes a checkpoint (an interrupted write is the worst outcome);
/// otherwise `hang_after`, or ten predicted steps when that is longer (a plan with slow steps
/// is not hung).
pub fn hang_limit(
    hang_after: Duration,
    stepped: bool,
    checkpointing: bool,
    predicted_step_s: Option<f64>,
) -> Option<Duration> {
    if !stepped || checkpointing {
        return None;
    }
    let steps = predicted_step_s
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::ZERO, |s| Duration::from_secs_f64(10.0 * s));
    Some(hang_after.max(steps))
}

impl Supervisor {
    /// Start a worker on `plan_json` (written into the run directory first). Resumes from the
    /// run's latest checkpoint when it has one. Fails when another live process holds the run
    /// directory.
    pub fn start(spec: &LaunchSpec, dir: RunDir, launch: &Launch) -> std::io::Result<Supervisor> {
        // Before the spawn: a loaded machine may run the worker a while before this process
        // gets back (the first step's time read 273 ms for a worker that slept 300 ms).
        let started = Instant::now();
        std::fs::create_dir_all(&dir.0)?;
        // A lock taken over from a worker that is gone needs no note: the run on screen says
        // how that worker ended.
        let (lock, _) = DirLock::acquire(&dir.0, "run directory").map_err(std::io::Error::other)?;
        osdp_core::input::write_atomically(&dir.plan(), launch.plan_json.as_bytes())?;
        if let Some(p) = &launch.predicted {
            osdp_core::input::write_json_atomically(&dir.predicted(), p)?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.log())?;
        // Earlier segments' events give the loss curve its history; read before the worker
        // starts, so that its own events are read once, by the tail.
        let earlier = std::fs::read(dir.metrics()).unwrap_or_default();
        let metrics_len = earlier.len() as u64;
        let earlier = String::from_utf8_lossy(&earlier);
        let (children, lifelines) = WorkerStart::new(spec, &dir, launch)?.spawn_all(&lock, &log)?;
        let mut status = RunStatus::from_text(&earlier);
        status.predicted = launch.predicted;
        // What the worker will say when it starts; the screen shows it while it loads.
        status.global_batch = launch.global_batch;
        let log_path = dir.log();
        Ok(Supervisor {
            status,
            tail: MetricsTail::new(dir.metrics(), metrics_len),
            dir,
            state: RunState::Starting,
            workers: Workers::Own {
                children,
                lock: Some(lock),
                lifelines,
            },
            last_progress: Instant::now(),
            last_step_at: None,
            started_at: Some(started),
            began_at: Some(started),
            ended_at: None,
            log: LogTail::new(log_path),
            first_step_after: None,
            hang_after: spec.hang_after,
            term_sent: false,
            kill_sent: false,
            last_checkpoint_at: None,
            note: None,
        })
    }

    /// The run already in `dir`: followed read-only while a live process holds the
    /// directory, else shown as it ended. `None` when there is no run there.
    pub fn open(dir: RunDir, hang_after: Duration) -> Option<Supervisor> {
        let owner = dir.owner();
        let live = owner.as_ref().is_some_and(|o| o.alive);
        if !live && !dir.metrics().exists() {
            return None;
        }
        let log_path = dir.log();
        let mut run = Supervisor {
            status: RunStatus {
                predicted: dir.read_predicted(),
                ..RunStatus::default()
            },
            tail: MetricsTail::new(dir.metrics(), 0),
            dir,
            state: RunState::Idle,
            workers: Workers::Ended,
            last_progress: Instant::now(),
            last_step_at: None,
            started_at: None,
            began_at: None,
            ended_at: None,
            log: LogTail::new(log_path),
            first_step_after: None,
            hang_after,
            term_sent: false,
            kill_sent: false,
            last_checkpoint_at: None,
            note: None,
        };
        run.read_events();
        run.settle(owner);
        run.log.read_new();
        Some(run)
    }

    /// Rank 0's process (for a run another process holds: the one its lock names).
    pub fn pid(&self) -> Option<u32> {
        match &self.workers {
            Workers::Own { children, .. } => children.first().map(Child::id),
            Workers::Attached(o) => Some(o.pid),
            Workers::Ended => None,
        }
    }

    /// Whether a worker is going (this dashboard's or another's).
    pub fn is_live(&self) -> bool {
        match &self.workers {
            Workers::Own { children, .. } => !children.is_empty(),
            Workers::Attached(_) => true,
            Workers::Ended => false,
        }
    }

    /// Who holds the run when another process does (this dashboard only follows it).
    pub fn owner(&self) -> Option<&LockOwner> {
        match &self.workers {
            Workers::Attached(o) => Some(o),
            _ => None,
        }
    }

    /// Read new events, notice an exit, a hang, or (for a run another process holds) its
    /// end. The run has ended when every process has; one process failing ends the others
    /// (their collectives could only wait for it).
    pub fn poll(&mut self) {
        let was_live = self.is_live();
        self.poll_workers();
        self.log.read_new();
        if was_live && !self.is_live() {
            self.ended_at = Some(Instant::now());
        }
    }

    /// How long the run has gone: from its worker's start to `now`, or to when this dashboard
    /// saw it end. `None` when the start is not known (a run found ended).
    pub fn elapsed(&self, now: Instant) -> Option<Duration> {
        let began = self.began_at?;
        Some(
            self.ended_at
                .unwrap_or(now)
                .saturating_duration_since(began),
        )
    }

    /// When the worker began (see [`Supervisor::elapsed`]).
    pub fn began_at(&self) -> Option<Instant> {
        self.began_at
    }

    fn poll_workers(&mut self) {
        match self.workers {
            Workers::Own { .. } => self.poll_own(),
            // Another process's run, or none: the lock says whether one is going (a run may
            // start here from another dashboard).
            Workers::Attached(_) | Workers::Ended => {
                let owner = self.dir.owner();
                let was_live = self.is_live();
                self.read_events();
                if was_live || owner.as_ref().is_some_and(|o| o.alive) {
                    self.settle(owner);
                }
            }
        }
    }

    /// Where a run not started here stands, from `owner` (read before the last events).
    fn settle(&mut self, owner: Option<LockOwner>) {
        let was_live = self.is_live();
        match Standing::of(&self.status, owner) {
            Standing::Running { owner: Some(o) } => {
                if !was_live {
                    // A (new) worker: nothing asked of the previous one applies.
                    self.term_sent = false;
                    self.kill_sent = false;
                    self.note = None;
                    self.began_at = began_at(&o.started);
                    self.ended_at = None;
                }
                self.workers = Workers::Attached(o);
                self.state = self.live_state();
            }
            // (`Standing::of` never says abandoned; a lock naming no one names no worker.)
            Standing::Running { owner: None } | Standing::Abandoned { .. } => {
                self.workers = Workers::Ended;
                self.fail(
                    "the run never said it ended and no lock names a worker: it is not \
                     running (see worker.log)"
                        .into(),
                );
            }
            Standing::Stopped { .. } => {
                self.workers = Workers::Ended;
                self.state = RunState::Stopped;
            }
            Standing::Failed { message } => {
                self.workers = Workers::Ended;
                self.fail(message);
            }
            Standing::Dead { owner } => {
                self.workers = Workers::Ended;
                if self.kill_sent {
                    self.record_kill();
                } else {
                    self.fail(Standing::dead_text(&owner));
                }
            }
        }
    }

    /// The state of a going run, from what it has said.
    fn live_state(&self) -> RunState {
        let segment_start = self.status.segments.last().copied();
        let stepped = self
            .status
            .last()
            .is_some_and(|p| Some(p.step) > segment_start);
        if self.term_sent {
            RunState::Stopping
        } else if self.status.checkpointing.is_some() {
            RunState::Checkpointing
        } else if stepped {
            RunState::Running
        } else {
            RunState::Starting
        }
    }

    fn poll_own(&mut self) {
        self.read_events();
        let Workers::Own { children, .. } = &mut self.workers else {
            return;
        };
        let mut failure: Option<String> = None;
        let mut i = 0;
        while i < children.len() {
            match children[i].try_wait() {
                Ok(Some(status)) => {
                    let _ = children.remove(i).wait(); // already reaped: returns its status
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
        let all_exited = children.is_empty();
        if let Some(why) = failure {
            self.kill_all();
            self.read_events();
            if self.kill_sent {
                self.record_kill();
                return;
            }
            let why = match self.status.ended.clone() {
                Some(msg) if self.status.failed => msg,
                _ => why,
            };
            self.record_end(WorkerEvent::Failed {
                message: why.clone(),
            });
            self.fail(why);
            return;
        }
        if all_exited {
            // The lock and the lifelines go with the processes.
            self.workers = Workers::Ended;
            self.read_events();
            if self.status.failed {
                let why = self.status.ended.clone().unwrap_or_default();
                self.fail(why);
            } else {
                self.state = RunState::Stopped;
            }
            return;
        }
        let limit = hang_limit(
            self.hang_after,
            self.last_step_at.is_some(),
            self.status.checkpointing.is_some(),
            self.status.predicted.map(|p| p.step_time_s),
        );
        if let Some(limit) = limit.filter(|_| self.state != RunState::Stopping) {
            if self.last_progress.elapsed() > limit {
                self.kill_all();
                let why = format!(
                    "no progress for {} s after step {}: the worker was hung and is stopped",
                    limit.as_secs(),
                    self.status.step()
                );
                self.record_end(WorkerEvent::Failed {
                    message: why.clone(),
                });
                self.fail(why);
            }
        }
    }

    /// Kill every process this dashboard started and let go of the run.
    fn kill_all(&mut self) {
        if let Workers::Own { children, .. } = &mut self.workers {
            for mut c in children.drain(..) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.workers = Workers::Ended;
    }

    fn fail(&mut self, why: String) {
        self.state = RunState::Failed {
            why,
            log_tail: self.dir.log_tail(8),
        };
    }

    /// Write the end the worker could not (killed, hung) into the stream, so whoever reads the
    /// run later knows how it ended; nothing when the stream already says.
    fn record_end(&mut self, ev: WorkerEvent) {
        if self.status.ended.is_none() && self.dir.append_event(&ev).is_ok() {
            self.read_events();
        }
    }

    /// The run was killed on the user's word: say what that cost.
    fn record_kill(&mut self) {
        let at = self.status.step();
        self.record_end(WorkerEvent::Stopped {
            step: at,
            reason: "killed".into(),
        });
        self.state = RunState::Stopped;
        let saved = self
            .status
            .last_checkpoint
            .as_ref()
            .map(|c| c.0)
            .filter(|_| self.dir.has_checkpoint());
        self.note = Some(match saved {
            None => format!("killed at step {at} with no checkpoint: a new start begins at step 0"),
            Some(k) if k < at => format!(
                "killed at step {at}: the last checkpoint is step {k}, where a new start resumes"
            ),
            Some(_) => format!("killed at step {at}, which the last checkpoint holds"),
        });
    }

    fn read_events(&mut self) {
        for ev in self.tail.read_new() {
            self.status.apply(&ev);
            self.last_progress = Instant::now();
            match &ev {
                WorkerEvent::Step { .. } => {
                    self.last_step_at = Some(Instant::now());
                    if self.first_step_after.is_none() {
                        self.first_step_after = self.started_at.map(|t| t.elapsed());
                    }
                }
                // Its age from the file itself: a dashboard that reads the events late (opening
                // on a run, or after a slow frame) would otherwise make an old one new.
                WorkerEvent::Checkpoint { path, .. } => {
                    self.last_checkpoint_at = Some(written_at(&self.dir, path))
                }
                _ => {}
            }
            if self.is_live() && self.state != RunState::Stopping {
                self.state = match (&ev, self.status.checkpointing) {
                    (_, Some(_)) => RunState::Checkpointing,
                    (WorkerEvent::Started { .. }, _) => RunState::Starting,
                    _ => RunState::Running,
                };
            }
        }
    }

    /// When this dashboard read the last step.
    pub fn last_step_at(&self) -> Option<Instant> {
        self.last_step_at
    }

    /// The step the worker is finishing after `x`, and about how long that takes in whole
    /// seconds: the last step's time (else the predicted one) less the time since it ended,
    /// at least 1 s; while it writes the last step's checkpoint, that step. `None` before the
    /// first step.
    pub fn finishing(&self) -> Option<(u64, f64)> {
        let last = self.status.last()?;
        if Some(last.step) <= self.status.segments.last().copied() {
            return None;
        }
        let step_s = match last.step_time_s {
            t if t.is_finite() && t > 0.0 => t,
            _ => self.status.predicted.map_or(0.0, |p| p.step_time_s),
        };
        // Writing the last step's checkpoint: the worker looks for a stop before it starts the
        // next step, so the last step it reported is its last.
        if self.status.checkpointing == Some(last.step) {
            return Some((last.step, 1.0));
        }
        let since = self.last_step_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Some((last.step + 1, (step_s - since).ceil().max(1.0)))
    }

    /// Ask the worker to stop: the first call lets it finish the step and checkpoint
    /// (SIGTERM); a second call kills it. A run another process holds is signalled the same
    /// way when it is this machine's; otherwise why not.
    pub fn stop(&mut self) -> Result<(), String> {
        let signal = if self.term_sent {
            libc::SIGKILL
        } else {
            libc::SIGTERM
        };
        match &mut self.workers {
            Workers::Ended => return Ok(()),
            Workers::Own { children, .. } => {
                for c in children.iter() {
                    send(c.id(), signal);
                }
            }
            Workers::Attached(o) => {
                if !o.local {
                    return Err(format!("run owned by {o}: stop it there"));
                }
                // The lock is read again just before the signal: the pid must still be the
                // process that holds it.
                match self.dir.owner() {
                    Some(now) if now.alive && now.pid == o.pid => send_group(o.pid, signal)
                        .map_err(|e| format!("cannot signal the worker (pid {}): {e}", o.pid))?,
                    _ => return Ok(()),
                }
            }
        }
        if self.term_sent {
            self.kill_sent = true;
        } else {
            self.term_sent = true;
            self.state = RunState::Stopping;
        }
        Ok(())
    }

    /// Leave the run going when this dashboard exits: tell each worker process it is on its
    /// own and hand the run directory's lock to rank 0, which the lock already names.
    pub fn detach(&mut self) {
        if let Workers::Own {
            children,
            lock,
            lifelines,
        } = std::mem::replace(&mut self.workers, Workers::Ended)
        {
            for line in lifelines {
                line.detach();
            }
            if let Some(lock) = lock {
                lock.hand_over();
            }
            // Not waited for: they outlive this process, and init reaps them.
            drop(children);
        }
    }

    /// Stop and wait up to `limit` for the worker to exit (killing it after that).
    pub fn stop_and_wait(&mut self, limit: Duration) {
        let _ = self.stop();
        let deadline = Instant::now() + limit;
        while matches!(self.workers, Workers::Own { .. }) && Instant::now() < deadline {
            self.poll();
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(self.workers, Workers::Own { .. }) {
            self.kill_all();
            self.state = RunState::Stopped;
        }
    }
}

/// The instant a lock's start time (`YYYY-MM-DD HH:MM:SS UTC`) names, on this process's clock.
fn began_at(started: &str) -> Option<Instant> {
    let secs = osdp_core::units::parse_utc(started)?;
    let ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH + Duration::from_secs(secs))
        .unwrap_or(Duration::ZERO);
    Instant::now().checked_sub(ago)
}

/// What every process of one start of a worker shares: how to launch, where, the run's
/// shape, and (for GPU processes) the rendezvous port and the run token.
struct WorkerStart<'a> {
    spec: &'a LaunchSpec,
    dir: &'a RunDir,
    launch: &'a Launch<'a>,
    processes: usize,
    port: u16,
    token: String,
}

impl<'a> WorkerStart<'a> {
    fn new(spec: &'a LaunchSpec, dir: &'a RunDir, launch: &'a Launch<'a>) -> std::io::Result<Self> {
        let processes = match launch.ranks {
            Ranks::CpuThreads => 1,
            Ranks::GpuProcesses => launch.world_size.max(1),
        };
        let port = match launch.ranks {
            Ranks::CpuThreads => 0,
            Ranks::GpuProcesses => free_port()?,
        };
        Ok(WorkerStart {
            spec,
            dir,
            launch,
            processes,
            port,
            // One token per start: a process of another run (or a stranger) cannot join this one.
            token: new_run_token(),
        })
    }

    /// Spawn every process, rank 0 first, each with its lifeline; rank 0 inherits `lock` and
    /// is named its holder. On a failure the processes already started are killed.
    fn spawn_all(
        &self,
        lock: &DirLock,
        log: &std::fs::File,
    ) -> std::io::Result<(Vec<Child>, Vec<Lifeline>)> {
        let mut children: Vec<Child> = Vec::with_capacity(self.processes);
        let mut lifelines: Vec<Lifeline> = Vec::with_capacity(self.processes);
        for rank in 0..self.processes {
            let (line, line_end) = match Lifeline::new() {
                Ok(l) => l,
                Err(e) => return give_up(children, e),
            };
            // A command that cannot be made (its log not cloned) ends the ranks already started.
            let mut cmd = match self.command(rank, line_end.as_raw_fd(), log) {
                Ok(cmd) => cmd,
                Err(e) => return give_up(children, e),
            };
            // The run's own process group (rank 0's pid): the terminal's signals (^C, a closed
            // window) do not reach it, and one signal to the group reaches every rank.
            match children.first() {
                None => {
                    lifeline::inherit(&mut cmd, lock.as_raw_fd());
                    cmd.process_group(0);
                }
                Some(first) => {
                    cmd.process_group(first.id() as i32);
                }
            }
            match cmd.spawn() {
                Ok(child) => {
                    if children.is_empty() {
                        if let Err(e) = lock.name_holder(child.id()) {
                            children.push(child);
                            return give_up(children, e);
                        }
                    }
                    children.push(child);
                    lifelines.push(line);
                }
                Err(e) => return give_up(children, e),
            }
        }
        Ok((children, lifelines))
    }

    /// Rank `rank`'s `osdp-tui train` command: its arguments, its environment, output to
    /// `log`, and the lifeline end `line_end` kept open across exec.
    fn command(
        &self,
        rank: usize,
        line_end: RawFd,
        log: &std::fs::File,
    ) -> std::io::Result<Command> {
        let mut cmd = Command::new(&self.spec.exe);
        cmd.arg("train").args(self.args(line_end).to_args());
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
        if self.launch.ranks == Ranks::GpuProcesses {
            let n = self.processes.to_string();
            cmd.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", &n)
                .env("LOCAL_WORLD_SIZE", &n)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", self.port.to_string())
                .env(RUN_TOKEN_VAR, &self.token)
                .env_remove("OSDP_PORT");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log.try_clone()?));
        lifeline::inherit(&mut cmd, line_end);
        Ok(cmd)
    }

    /// The trainer's arguments: the run directory's plan, metrics and checkpoints, until
    /// stopped, resuming when there is a checkpoint; `supervisor_fd`: the lifeline's end.
    fn args(&self, supervisor_fd: RawFd) -> TrainArgs {
        let (spec, dir, launch) = (self.spec, self.dir, self.launch);
        let mut args = TrainArgs {
            model: spec.model.clone(),
            plan: dir.plan(),
            world_size: match launch.ranks {
                Ranks::CpuThreads => Some(launch.world_size),
                Ranks::GpuProcesses => None,
            },
            ranks_per_node: match launch.ranks {
                Ranks::CpuThreads => launch.ranks_per_node,
                Ranks::GpuProcesses => None,
            },
            global_batch: Some(launch.global_batch),
            device: match launch.ranks {
                Ranks::CpuThreads => DeviceArg::Cpu,
                Ranks::GpuProcesses => DeviceArg::Cuda,
            },
            // 0: until stopped.
            steps: launch.steps,
            metrics: Some(dir.metrics()),
            checkpoint_dir: Some(dir.checkpoints()),
            checkpoint_every: spec.checkpoint_every.max(1),
            resume: dir.has_checkpoint(),
            supervisor_fd: Some(supervisor_fd),
            init_from: spec.data.init_from.clone(),
            data: spec.data.data.clone(),
            tokenizer: spec.data.tokenizer.clone(),
            eval_data: spec.data.eval_data.clone(),
            ..TrainArgs::new(spec.model.clone(), dir.plan())
        };
        if let Some(k) = spec.data.eval_every {
            args.eval_every = k;
        }
        args
    }
}

/// When the checkpoint at `path` (as the worker names it; a relative path from here or from
/// the run directory) was written: its modification time on this clock, else now.
fn written_at(dir: &RunDir, path: &str) -> Instant {
    let p = std::path::Path::new(path);
    let now = Instant::now();
    [p.to_path_buf(), dir.0.join(p)]
        .iter()
        .find_map(|c| std::fs::metadata(c).and_then(|m| m.modified()).ok())
        .and_then(|t| t.elapsed().ok())
        .and_then(|age| now.checked_sub(age))
        .unwrap_or(now)
}

/// Kill and reap the processes started so far, and fail with `e`.
fn give_up<T>(children: Vec<Child>, e: std::io::Error) -> std::io::Result<T> {
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    Err(e)
}

/// A loopback port nobody listens on now, for a run's rank 0.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Never leave a worker behind the dashboard unless it detached: ask it to checkpoint
        // and go.
        if self.is_live() && matches!(self.workers, Workers::Own { .. }) {
            self.stop_and_wait(Duration::from_secs(30));
        }
    }
}

/// Send `signal` to this machine's process `pid`.
fn send(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) with a valid signal number has no memory effects.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// Send `signal` to the process group `pid` leads (every rank of a run started here), or to
/// `pid` alone when it leads none.
fn send_group(pid: u32, signal: libc::c_int) -> std::io::Result<()> {
    let pid = pid as libc::pid_t;
    // SAFETY: getpgid and kill(2) read and signal processes; no memory is involved.
    let sent = unsafe {
        let target = if libc::getpgid(pid) == pid { -pid } else { pid };
        libc::kill(target, signal)
    };
    match sent {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hang_detector_waits_for_the_first_step_and_for_slow_plans() {
        let two_min = Duration::from_secs(120);
        assert_eq!(
            hang_limit(two_min, false, false, Some(0.5)),
            None,
            "loading and the first step take what they take"
        );
        assert_eq!(
            hang_limit(two_min, true, true, Some(0.5)),
            None,
            "a checkpoint being written is never cut"
        );
        assert_eq!(hang_limit(two_min, true, false, Some(0.5)), Some(two_min));
        assert_eq!(hang_limit(two_min, true, false, None), Some(two_min));
        assert_eq!(
            hang_limit(two_min, true, false, Some(60.0)),
            Some(Duration::from_secs(600)),
            "ten steps of a plan with one-minute steps"
        );
        assert_eq!(
            hang_limit(two_min, true, false, Some(f64::NAN)),
            Some(two_min)
        );
    }

    #[test]
    fn every_start_of_a_run_gets_its_own_token() {
        let (a, b) = (new_run_token(), new_run_token());
        assert_eq!(a.len(), 32, "{a}");
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b, "two starts, two tokens");
    }
}
