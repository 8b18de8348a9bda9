//! Running a worker: launch its processes (one for CPU threads, one per GPU), follow what it
//! writes to its run directory, and stop it. The protocol and the run directory themselves live
//! in `osdp_core::run`; this is the process side, which only the app needs.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cli::train::{DeviceArg, TrainArgs};
use osdp_core::run::{Predicted, RunDir, RunState, RunStatus, WorkerEvent, RUN_TOKEN_VAR};

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
        osdp_core::input::write_atomically(&dir.plan(), launch.plan_json.as_bytes())?;
        if let Some(p) = &launch.predicted {
            osdp_core::input::write_json_atomically(&dir.predicted(), p)?;
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
            let args = TrainArgs {
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
                // Until stopped.
                steps: 0,
                metrics: Some(dir.metrics()),
                checkpoint_dir: Some(dir.checkpoints()),
                checkpoint_every: spec.checkpoint_every.max(1),
                resume: dir.has_checkpoint(),
                ..TrainArgs::new(spec.model.clone(), dir.plan())
            };
            let mut cmd = Command::new(&spec.exe);
            cmd.arg("train").args(args.to_args());
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
            if launch.ranks == Ranks::GpuProcesses {
                {
                    let n = processes.to_string();
                    cmd.env("RANK", rank.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_start_of_a_run_gets_its_own_token() {
        let (a, b) = (new_run_token(), new_run_token());
        assert_eq!(a.len(), 32, "{a}");
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b, "two starts, two tokens");
    }
}
