//! `osdp-tui status RUN_DIR [--follow] [--json]`: a run seen from another terminal, from its
//! metrics stream and its lock (which names the worker while it lives). `--follow` prints each
//! new event until the run ends, and reports a worker that died without a word as dead.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::Failure;
use crate::run::{MetricsTail, RunDir, RunStatus, Standing};
use osdp_core::protocol::WorkerEvent;
use osdp_core::text::printable;
use osdp_core::units;

/// The exit code of `status --follow` when the run failed or its worker died.
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
/// has them): the status at the start, and `dead` when the worker died without a word.
#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum FollowLine<'a> {
    Status(StatusJson<'a>),
    Dead {
        owner: &'a crate::run::lock::LockOwner,
        message: String,
    },
}

pub fn status(dir: &Path, json: bool, follow: bool) -> Result<(), Failure> {
    let run = RunDir(dir.to_path_buf());
    // The lock before the stream: a worker that wrote its end and exited in between is then
    // stopped, never dead.
    let owner = run.owner();
    std::fs::File::open(run.metrics())
        .map_err(|e| Failure::input(format!("{}: no run here ({e})", dir.display())))?;
    let mut tail = MetricsTail::new(run.metrics(), 0);
    let mut status = RunStatus {
        predicted: run.read_predicted(),
        ..RunStatus::default()
    };
    for ev in tail.read_new() {
        status.apply(&ev);
    }
    let mut standing = Standing::of(&status, owner);
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
    if !follow {
        return written.or_else(quiet_on_broken_pipe);
    }
    written.or_else(quiet_on_broken_pipe)?;
    loop {
        if standing.is_over() {
            return finish(&mut out, dir, json, &standing).or_else(quiet_on_broken_pipe);
        }
        std::thread::sleep(FOLLOW_EVERY);
        let owner = run.owner();
        for ev in tail.read_new() {
            status.apply(&ev);
            let written = if json {
                line(&mut out, &ev)
            } else {
                writeln!(out, "{}", event_text(&ev)).map_err(output_failure)
            };
            written.or_else(quiet_on_broken_pipe)?;
        }
        standing = Standing::of(&status, owner);
    }
}

/// The last word of `--follow`: a dead worker said as such (the stream's own end was printed
/// as it came); the exit code for how the run ended.
fn finish(
    out: &mut impl Write,
    dir: &Path,
    json: bool,
    standing: &Standing,
) -> Result<(), Failure> {
    let dir_text = printable(&dir.display().to_string()).into_owned();
    match standing {
        Standing::Dead { owner } => {
            let message = Standing::dead_text(owner);
            if json {
                line(
                    out,
                    &FollowLine::Dead {
                        owner,
                        message: message.clone(),
                    },
                )?;
            } else {
                writeln!(out, "dead: {message}").map_err(output_failure)?;
            }
            Err(Failure {
                code: RUN_FAILED_EXIT,
                message: format!("run {dir_text}: its worker is dead"),
            })
        }
        Standing::Failed { message } => Err(Failure {
            code: RUN_FAILED_EXIT,
            message: format!("run {dir_text} failed: {}", printable(message)),
        }),
        Standing::Stopped { .. } | Standing::Running { .. } => Ok(()),
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
                .map(|p| format!(", resuming from {}", printable(p)))
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
        WorkerEvent::Checkpoint {
            step,
            path,
            write_time_s,
        } => format!(
            "checkpoint step {step} ({}, written in {write_time_s:.2} s)",
            printable(path)
        ),
        WorkerEvent::Stopped { step, reason } => {
            format!("stopped at step {step} ({})", printable(reason))
        }
        WorkerEvent::Failed { message } => format!("failed: {}", printable(message)),
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
    let model = printable(status.model.as_deref().unwrap_or("?"));
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
    lines.push(match &status.last_checkpoint {
        Some((step, path)) => format!("last checkpoint: step {step} ({})", printable(path)),
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
        Standing::Stopped { reason } => format!("stopped ({})", printable(reason)),
        Standing::Failed { message } => format!("failed: {}", printable(message)),
        Standing::Dead { owner } => format!("dead: {}", Standing::dead_text(owner)),
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
