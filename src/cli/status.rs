//! `osdp-tui status RUN_DIR [--follow] [--json]`: a run seen from another terminal, from its
//! metrics stream and its lock (which names the worker while it lives). `--follow` prints each
//! new event until the run ends (reading the stream again from its start when it is truncated,
//! rewritten or replaced), and reports a run that ended without a word (its worker died, or its
//! lock names no one and no process holds it) as such.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::Failure;
use crate::run::lock::LockOwner;
use crate::run::{MetricsTail, Reread, RunDir, RunStatus, Standing};
use osdp_core::protocol::WorkerEvent;
use osdp_core::text::{excerpt, printable};
use osdp_core::units;

/// The exit code of `status --follow` when the run failed or ended without a word.
pub const RUN_FAILED_EXIT: u8 = 4;

/// How often `--follow` looks at the stream and the lock.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// `status --json`: the folded stream and where the run stands.
#[derive(Serialize)]
struct StatusJson<'a> {
    #[serde(flatten)]
    status: &'a RunStatus,
    #[serde(flatten)]
    standing: &'a Standing,
}

/// Lines of `status --follow --json` besides the stream's own events (printed as the stream
/// has them): the status at the start, `reread` when the stream was truncated, rewritten or
/// replaced (the events that follow are the new stream's, from its start), and `dead` when
/// the run ended without a word (its worker died: `owner` names it; or its lock names no one
/// and no process holds it).
#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum FollowLine<'a> {
    Status(StatusJson<'a>),
    Reread {
        reread: Reread,
    },
    Dead {
        #[serde(skip_serializing_if = "Option::is_none")]
        owner: Option<&'a LockOwner>,
        message: String,
    },
}

pub fn status(dir: &Path, json: bool, follow: bool) -> Result<(), Failure> {
    let run = RunDir(dir.to_path_buf());
    // The lock before the stream: a worker that wrote its end and exited in between is then
    // stopped, never dead.
    let lock = run.lock_state();
    let mut tail = MetricsTail::new(run.metrics(), 0);
    let fresh = tail.read().map_err(|e| unreadable(&run, e))?;
    let mut status = new_status(&run);
    for ev in fresh.events {
        status.apply(&ev);
    }
    let standing = Standing::of_lock(&status, lock);
    let mut out = std::io::stdout().lock();
    let written = if json && follow {
        line(
            &mut out,
            &FollowLine::Status(StatusJson {
                status: &status,
                standing: &standing,
            }),
        )
    } else if json {
        crate::report::print_json(&StatusJson {
            status: &status,
            standing: &standing,
        });
        Ok(())
    } else {
        summary(&mut out, dir, &status, &standing)
    };
    written.or_else(quiet_on_broken_pipe)?;
    if !follow {
        return Ok(());
    }
    let mut following = Following {
        run,
        json,
        tail,
        status,
        standing,
    };
    following.run(&mut out).or_else(quiet_on_broken_pipe)
}

/// A run's status before its stream is read: nothing but the plan's prediction.
fn new_status(run: &RunDir) -> RunStatus {
    RunStatus {
        predicted: run.read_predicted(),
        ..RunStatus::default()
    }
}

/// A metrics stream that cannot be read: no run here, or a stream that is not a file.
fn unreadable(run: &RunDir, e: std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::NotFound {
        return Failure::input(format!("{}: no run here ({e})", run.0.display()));
    }
    Failure::input(format!(
        "{}: cannot read the run's metrics stream: {e}",
        printable(&run.metrics().display().to_string())
    ))
}

/// `status --follow` after its first look: the stream as it grows and the locks, until the run
/// ends.
struct Following {
    run: RunDir,
    json: bool,
    tail: MetricsTail,
    status: RunStatus,
    standing: Standing,
}

impl Following {
    fn run(&mut self, out: &mut impl Write) -> Result<(), Failure> {
        // A lock naming no one ends the follow only when two looks in a row say so: a new
        // holder's lock file is empty for a moment before it locks it.
        let mut abandoned_before = false;
        loop {
            let abandoned = matches!(self.standing, Standing::Abandoned { .. });
            if self.standing.is_over() && (abandoned_before || !abandoned) {
                return self.finish(out);
            }
            abandoned_before = abandoned;
            std::thread::sleep(FOLLOW_EVERY);
            let lock = self.run.lock_state();
            let fresh = match self.tail.read() {
                Ok(fresh) => fresh,
                // Removed, maybe to be written again: the lock says whether the run goes on.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Default::default(),
                Err(e) => return Err(unreadable(&self.run, e)),
            };
            if let Some(reread) = fresh.reread {
                self.status = new_status(&self.run);
                let text = format!(
                    "metrics.jsonl was {}: reading it again from its start",
                    reread.text()
                );
                emit(out, self.json, &FollowLine::Reread { reread }, &text)?;
            }
            for ev in fresh.events {
                self.status.apply(&ev);
                emit(out, self.json, &ev, &event_text(&ev))?;
            }
            self.standing = Standing::of_lock(&self.status, lock);
        }
    }

    /// The last word of `--follow`: a run gone without a word said as such (the stream's own
    /// end was printed as it came); the exit code for how the run ended.
    fn finish(&self, out: &mut impl Write) -> Result<(), Failure> {
        let dir_text = printable(&self.run.0.display().to_string()).into_owned();
        if let Standing::Failed { message } = &self.standing {
            return Err(Failure {
                code: RUN_FAILED_EXIT,
                message: format!("run {dir_text} failed: {}", excerpt(message)),
            });
        }
        let Some(gone) = Gone::of(&self.standing) else {
            return Ok(());
        };
        let dead = FollowLine::Dead {
            owner: gone.owner,
            message: gone.text.clone(),
        };
        emit(out, self.json, &dead, &gone.line())?;
        let last = match self.status.last() {
            Some(p) => format!(" (its last step: {})", p.step),
            None => " (before its first step)".into(),
        };
        Err(Failure {
            code: RUN_FAILED_EXIT,
            message: format!("run {dir_text} is no longer running{last}: {}", gone.why),
        })
    }
}

/// A run that ended without a word: its worker is dead, or its lock names no one and no
/// process holds it.
struct Gone<'a> {
    /// The state, in a word or two.
    state: &'static str,
    /// What happened, in a sentence.
    text: String,
    /// What happened, in short.
    why: String,
    /// The worker, when the lock named one.
    owner: Option<&'a LockOwner>,
}

impl Gone<'_> {
    fn of(standing: &Standing) -> Option<Gone<'_>> {
        match standing {
            Standing::Dead { owner } => Some(Gone {
                state: "dead",
                text: Standing::dead_text(owner),
                why: format!("its worker ({owner}) is gone without a word"),
                owner: Some(owner),
            }),
            Standing::Abandoned { lock } => Some(Gone {
                state: "not running",
                text: Standing::abandoned_text(lock),
                why: format!("{lock} and no process holds it"),
                owner: None,
            }),
            _ => None,
        }
    }

    /// `STATE: TEXT`, as the summary's state line and `--follow`'s last line.
    fn line(&self) -> String {
        format!("{}: {}", self.state, self.text)
    }
}

/// One line of `--follow`: `value` as JSON, or `text`.
fn emit(
    out: &mut impl Write,
    json: bool,
    value: &impl Serialize,
    text: &str,
) -> Result<(), Failure> {
    if json {
        line(out, value)
    } else {
        writeln!(out, "{text}").map_err(output_failure)
    }
}

fn line(out: &mut impl Write, value: &impl Serialize) -> Result<(), Failure> {
    let text = serde_json::to_string(value).map_err(|e| Failure {
        code: 1,
        message: format!("cannot write JSON: {e}"),
    })?;
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(output_failure)
}

/// A write to stdout that failed; code 0 when the reader went away, which
/// [`quiet_on_broken_pipe`] turns into a quiet end.
fn output_failure(e: std::io::Error) -> Failure {
    Failure {
        code: if e.kind() == std::io::ErrorKind::BrokenPipe {
            0
        } else {
            1
        },
        message: format!("cannot write to stdout: {e}"),
    }
}

/// A reader that went away (`status --follow | head`) ends the command quietly.
fn quiet_on_broken_pipe(f: Failure) -> Result<(), Failure> {
    match f.code {
        0 => Ok(()),
        _ => Err(f),
    }
}

/// One event of the stream, as `--follow` prints it.
fn event_text(ev: &WorkerEvent) -> String {
    match ev {
        WorkerEvent::Started {
            first_step,
            world_size,
            global_batch,
            resumed_from,
            ..
        } => format!(
            "started at step {first_step}: {world_size} rank(s), {global_batch} samples per step{}",
            resumed_from
                .as_deref()
                .map(|p| format!(", resuming from {}", excerpt(p)))
                .unwrap_or_default()
        ),
        WorkerEvent::Step {
            step,
            loss,
            step_time_s,
            samples_per_s,
            tokens_per_s,
            ..
        } => format!(
            "step {step} · loss {loss:.4} · {step_time_s:.3} s/step · {samples_per_s:.1} samples/s · {} tokens/s",
            units::count(*tokens_per_s as u64)
        ),
        WorkerEvent::Checkpointing { step } => format!("checkpointing step {step}"),
        WorkerEvent::Eval {
            step,
            loss,
            samples,
        } => format!("eval loss {loss:.4} at step {step} ({samples} held-out samples)"),
        WorkerEvent::Checkpoint {
            step,
            path,
            write_time_s,
        } => format!(
            "checkpoint step {step} ({}, written in {write_time_s:.2} s)",
            excerpt(path)
        ),
        WorkerEvent::Stopped { step, reason } => {
            format!("stopped at step {step} ({})", excerpt(reason))
        }
        WorkerEvent::Failed { message } => format!("failed: {}", excerpt(message)),
    }
}

/// The run in a few lines: what it is, its last step beside the plan's prediction, its last
/// checkpoint, where it stands.
fn summary(
    out: &mut impl Write,
    dir: &Path,
    status: &RunStatus,
    standing: &Standing,
) -> Result<(), Failure> {
    let mut lines: Vec<String> = Vec::new();
    let model = excerpt(status.model.as_deref().unwrap_or("?"));
    lines.push(format!(
        "run {} · {model} · {} rank(s) · {} samples per step",
        printable(&dir.display().to_string()),
        status.world_size,
        status.global_batch
    ));
    match status.last() {
        Some(p) => {
            let first = status.steps.first().map_or(p.loss, |s| s.loss);
            let mem: Vec<String> = p.memory_bytes.iter().map(|&b| units::bytes(b)).collect();
            lines.push(format!(
                "step {} · loss {:.4} (first {first:.4}) · {:.3} s/step · {:.1} samples/s · {} tokens/s",
                p.step,
                p.loss,
                p.step_time_s,
                p.samples_per_s,
                units::count(p.tokens_per_s as u64)
            ));
            lines.push(format!("memory per rank {}", mem.join(" ")));
            if let Some(pr) = &status.predicted {
                lines.push(format!(
                    "predicted by the plan: {:.1} samples/s · {:.3} s/step · peak {} per rank ({} of it runtime)",
                    pr.samples_per_s,
                    pr.step_time_s,
                    units::bytes(pr.peak_memory_bytes),
                    units::bytes(pr.runtime_overhead_bytes)
                ));
            }
        }
        None => lines.push("no step yet".into()),
    }
    if let (Some(&(step, loss)), Some(&(_, first))) = (status.evals.last(), status.evals.first()) {
        lines.push(format!(
            "held-out loss {loss:.4} at step {step} (first {first:.4}, {} evaluations)",
            status.evals.len()
        ));
    }
    lines.push(match &status.last_checkpoint {
        Some((step, path)) => format!("last checkpoint: step {step} ({})", excerpt(path)),
        None => "no checkpoint yet".into(),
    });
    let state = match standing {
        Standing::Running { owner: Some(o) } => match status.checkpointing {
            Some(s) => format!("checkpointing step {s} ({o})"),
            None => format!("running ({o})"),
        },
        Standing::Running { owner: None } => {
            "running (or killed without a word: no lock names its worker; see worker.log)".into()
        }
        Standing::Stopped { reason } => format!("stopped ({})", excerpt(reason)),
        Standing::Failed { message } => format!("failed: {}", excerpt(message)),
        Standing::Dead { .. } | Standing::Abandoned { .. } => {
            Gone::of(standing).map(|g| g.line()).unwrap_or_default()
        }
    };
    lines.push(format!(
        "state: {state} · segments started at steps {:?}",
        status.segments
    ));
    for l in lines {
        writeln!(out, "{l}").map_err(output_failure)?;
    }
    out.flush().map_err(output_failure)
}
