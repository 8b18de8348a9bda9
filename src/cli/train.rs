//! `osdp-tui train`: run a plan with the libtorch trainer, headless. Progress on the terminal,
//! one JSON line per event in the metrics file, SIGINT/SIGTERM/SIGHUP finish the step, checkpoint and
//! exit 0.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::Failure;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// Everything in fp32.
    Fp32,
    /// bf16 compute, fp32 master weights and Adam moments (the planner's GPU accounting).
    Bf16,
}

#[derive(Debug, Clone, PartialEq, Args)]
pub struct TrainArgs {
    /// Model description (model.json): GPT-2, OPT or LLaMA family.
    pub model: PathBuf,
    /// Plan file written by `plan -o` (or by hand) for this model.
    #[arg(long)]
    pub plan: PathBuf,
    /// Data-parallel ranks, as threads of this process [default: 1]. Under torchrun or Slurm
    /// (`WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT` set) this process is one rank and
    /// the world size is `WORLD_SIZE`.
    #[arg(long, value_name = "N", value_parser = parse_world_size)]
    pub world_size: Option<usize>,
    /// Arrange the ranks as nodes of N consecutive ranks: what an hsdp plan shards over
    /// (inside a node) and replicates across (the nodes). N divides the world size [default:
    /// under torchrun or Slurm `LOCAL_WORLD_SIZE` or `SLURM_NTASKS_PER_NODE`; else all ranks
    /// one node].
    #[arg(long, value_name = "N", value_parser = parse_world_size)]
    pub ranks_per_node: Option<usize>,
    /// Samples per optimizer step over all ranks, run as the plan's micro-batches with
    /// gradient accumulation [default: micro-batch × accumulation × world size, the global
    /// batch the plan was made for; when resuming, the checkpoint's].
    #[arg(long, value_name = "N", value_parser = parse_global_batch)]
    pub global_batch: Option<u64>,
    /// Where the ranks compute. `cuda`: one process per GPU (launched by torchrun, srun or the
    /// dashboard), collectives over NCCL; needs a build with `--features cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Number format [default: fp32 on cpu, bf16 on cuda].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Optimizer steps to run (after the resumed step, when resuming); 0 runs until stopped.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub steps: u64,
    /// Seed of the initial weights and of the data order [default: 0, or the checkpoint's
    /// when resuming].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Training text: `shakespeare` (built in), `random` (random tokens, for speed runs) or a
    /// path to a text file (tokenised byte by byte) [default: shakespeare, or the checkpoint's
    /// when resuming].
    #[arg(long, value_name = "SOURCE")]
    pub data: Option<String>,
    /// Peak learning rate (AdamW, linear warm-up over the first 10 steps).
    #[arg(long, default_value_t = 1e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    pub lr: f64,
    /// Write one JSON line per event (started, step, checkpoint, stopped, failed) here.
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// Directory for checkpoints (written when the run ends or stops, and every K steps).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every K steps.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub checkpoint_every: u64,
    /// Continue from the latest checkpoint in --checkpoint-dir (under this plan and world size).
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Continue from this checkpoint (a `step-…` directory).
    #[arg(long, value_name = "CHECKPOINT", conflicts_with = "resume")]
    pub resume_from: Option<PathBuf>,
    /// Print the run's summary as JSON at the end.
    #[arg(long)]
    pub json: bool,
    /// The read end of the lifeline from the dashboard that started this worker: when it
    /// closes without the dashboard detaching first, the run stops as on SIGTERM
    /// (`osdp_tui::lifeline`).
    #[arg(long, value_name = "FD", hide = true)]
    pub supervisor_fd: Option<i32>,
}

impl TrainArgs {
    /// The command line (after `train`) that parses back to these arguments: how the dashboard
    /// starts its workers, so a worker runs exactly what the launcher meant and a new option
    /// cannot be forgotten on one side (the destructuring below names every field).
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let TrainArgs {
            model,
            plan,
            world_size,
            ranks_per_node,
            global_batch,
            device,
            precision,
            steps,
            seed,
            data,
            lr,
            metrics,
            checkpoint_dir,
            checkpoint_every,
            resume,
            resume_from,
            json,
            supervisor_fd,
        } = self;
        fn name(v: impl ValueEnum) -> String {
            v.to_possible_value()
                .map(|p| p.get_name().to_owned())
                .unwrap_or_default()
        }
        let mut out: Vec<std::ffi::OsString> = Vec::new();
        // `--flag=value`, one word: a value that starts with `-` stays a value.
        let mut opt = |flag: &str, value: Option<std::ffi::OsString>| {
            if let Some(v) = value {
                let mut word = std::ffi::OsString::from(format!("{flag}="));
                word.push(v);
                out.push(word);
            }
        };
        opt("--plan", Some(plan.into()));
        opt("--world-size", world_size.map(|n| n.to_string().into()));
        opt(
            "--ranks-per-node",
            ranks_per_node.map(|n| n.to_string().into()),
        );
        opt("--global-batch", global_batch.map(|n| n.to_string().into()));
        opt("--device", Some(name(*device).into()));
        opt("--precision", precision.map(|p| name(p).into()));
        opt("--steps", Some(steps.to_string().into()));
        opt("--seed", seed.map(|n| n.to_string().into()));
        opt("--data", data.as_ref().map(Into::into));
        // `{}` of an f64 is the shortest text that reads back to the same value.
        opt("--lr", Some(lr.to_string().into()));
        opt("--metrics", metrics.as_ref().map(Into::into));
        opt("--checkpoint-dir", checkpoint_dir.as_ref().map(Into::into));
        opt(
            "--checkpoint-every",
            Some(checkpoint_every.to_string().into()),
        );
        opt("--resume-from", resume_from.as_ref().map(Into::into));
        opt(
            "--supervisor-fd",
            supervisor_fd.map(|n| n.to_string().into()),
        );
        if *resume {
            out.push("--resume".into());
        }
        if *json {
            out.push("--json".into());
        }
        // After `--`, a model path that starts with `-` is still the model.
        out.push("--".into());
        out.push(model.into());
        out
    }

    /// The arguments `train MODEL --plan PLAN` parses to: every other field at the default the
    /// CLI itself declares.
    pub fn new(model: PathBuf, plan: PathBuf) -> TrainArgs {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            args: TrainArgs,
        }
        let mut plan_arg = std::ffi::OsString::from("--plan=");
        plan_arg.push(plan);
        let argv: [std::ffi::OsString; 4] = ["train".into(), plan_arg, "--".into(), model.into()];
        <Only as clap::Parser>::try_parse_from(argv)
            .expect("a model and a plan are all `train` requires")
            .args
    }
}

/// Most ranks a run may have: more GPUs than the largest clusters hold, few enough that
/// per-rank tables stay small.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

fn parse_world_size(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_WORLD_SIZE).contains(&n) => Ok(n),
        Ok(n) if n > MAX_WORLD_SIZE => {
            Err(format!("{n} ranks are too many (at most {MAX_WORLD_SIZE})"))
        }
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// Samples per step: at most a full micro-batch on every rank of the largest world.
fn parse_global_batch(s: &str) -> Result<u64, String> {
    let most = crate::plan::MAX_BATCH * MAX_WORLD_SIZE as u64;
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=most).contains(&n) => Ok(n),
        Ok(n) if n > most => Err(format!(
            "{n} samples per step are too many (at most {most})"
        )),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// A learning rate: a finite number above zero (NaN, inf and negative rates train nothing).
fn parse_lr(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr > 0.0 => Ok(lr),
        Ok(lr) => Err(format!(
            "{lr} is not a learning rate: expected a finite number above 0"
        )),
        Err(_) => Err(format!("expected a number, got {s:?}")),
    }
}

impl TrainArgs {
    /// What the parsers cannot check alone: each rank's share of the global batch is a
    /// micro-batch the planner would accept.
    fn check(&self) -> Result<(), Failure> {
        let (Some(global), world) = (self.global_batch, self.world_size.unwrap_or(1)) else {
            return Ok(());
        };
        let per_rank = global.div_ceil(world as u64);
        if per_rank > crate::plan::MAX_BATCH {
            return Err(Failure::input(format!(
                "--global-batch {global} over {world} rank(s) is {per_rank} samples per rank \
                 (at most {})",
                crate::plan::MAX_BATCH
            )));
        }
        Ok(())
    }
}

#[cfg(not(feature = "train"))]
pub fn train(args: TrainArgs) -> Result<(), Failure> {
    args.check()?;
    Err(Failure::input(
        "this osdp-tui was built without the trainer; build it with \
         `. scripts/libtorch-env.sh && cargo build --release --features train`",
    ))
}

/// The device and number format of this process's rank(s), checked: a GPU rank needs the
/// `cuda` build, a usable GPU for its `LOCAL_RANK`, NCCL, and one process per GPU.
#[cfg(feature = "train")]
fn target(
    args: &TrainArgs,
    membership: Option<&crate::train::tcp::Membership>,
) -> Result<crate::train::exec::Target, Failure> {
    use crate::train::exec::{Numerics, Target};
    let numerics = match (args.precision, args.device) {
        (Some(PrecisionArg::Fp32), _) | (None, DeviceArg::Cpu) => Numerics::Fp32,
        (Some(PrecisionArg::Bf16), _) | (None, DeviceArg::Cuda) => Numerics::Bf16Mixed,
    };
    if args.device == DeviceArg::Cpu {
        return Ok(Target {
            device: crate::train::tch::Device::Cpu,
            numerics,
        });
    }
    if membership.is_none() && args.world_size.is_some_and(|w| w > 1) {
        return Err(Failure::input(
            "--device cuda runs one process per GPU: launch N of them with \
             `torchrun --nproc-per-node N --no-python osdp-tui train …` (or srun, or the \
             dashboard) instead of --world-size",
        ));
    }
    #[cfg(feature = "cuda")]
    {
        let local_rank = std::env::var("LOCAL_RANK")
            .or_else(|_| std::env::var("SLURM_LOCALID"))
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let device = crate::train::cuda::preflight(local_rank).map_err(Failure::input)?;
        Ok(Target { device, numerics })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = numerics;
        Err(Failure::input(
            "--device cuda: this osdp-tui was built without GPU support; build it with \
             `. scripts/libtorch-env.sh && cargo build --release --features cuda`, or train on \
             the CPU with --device cpu",
        ))
    }
}

/// Check the checkpoint directory against --resume before anything is written.
#[cfg(feature = "train")]
fn resume_point(args: &TrainArgs) -> Result<Option<PathBuf>, Failure> {
    use crate::train::checkpoint;
    if let Some(from) = &args.resume_from {
        checkpoint::verify(from).map_err(Failure::input)?;
        return Ok(Some(from.clone()));
    }
    let Some(dir) = &args.checkpoint_dir else {
        return Ok(None);
    };
    let latest = checkpoint::latest(dir).map_err(Failure::input)?;
    match (args.resume, latest) {
        (false, None) => Ok(None),
        (false, Some(l)) => Err(Failure::input(format!(
            "{} already holds checkpoints (latest {}); pass --resume to continue from it, or choose another --checkpoint-dir",
            dir.display(),
            l.display()
        ))),
        (true, None) => Err(Failure::input(format!(
            "--resume: {} holds no checkpoint to resume from",
            dir.display()
        ))),
        (true, Some(l)) => match checkpoint::verify(&l) {
            Ok(_) => Ok(Some(l)),
            Err(e) => {
                let older: Vec<String> = checkpoint::list(dir)
                    .into_iter()
                    .filter(|(_, p)| p != &l && checkpoint::verify(p).is_ok())
                    .map(|(_, p)| p.display().to_string())
                    .collect();
                let hint = match older.last() {
                    Some(p) => format!("; the previous good checkpoint is kept: resume from it with --resume-from {p}"),
                    None => String::new(),
                };
                Err(Failure::input(format!("refusing to resume: {e}{hint}")))
            }
        },
    }
}

/// What a finished run did: `train`'s report, computed once and rendered as text or JSON.
/// The fields are in the JSON's (alphabetical) key order. Only a build with the trainer makes
/// one; its renderers are tested without.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TrainReport {
    /// The last checkpoint written, if any.
    pub checkpoint: Option<String>,
    pub elapsed_s: f64,
    pub first_loss: Option<f64>,
    pub first_step: u64,
    pub last_loss: Option<f64>,
    pub last_step: u64,
    /// The highest of every rank's peak.
    pub peak_memory_bytes: u64,
    pub stopped_by_signal: bool,
}

#[cfg_attr(not(feature = "train"), allow(dead_code))]
impl TrainReport {
    /// The text form: one line.
    pub fn text(&self) -> String {
        let how = if self.stopped_by_signal {
            "stopped"
        } else {
            "done"
        };
        let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
        format!(
            "{how}: steps {}→{} in {:.1} s, loss {} → {}, peak {} per rank{}",
            self.first_step,
            self.last_step,
            self.elapsed_s,
            loss(self.first_loss),
            loss(self.last_loss),
            crate::units::bytes(self.peak_memory_bytes),
            self.checkpoint
                .as_ref()
                .map(|p| format!(", checkpoint {p}"))
                .unwrap_or_default()
        )
    }
}

/// Everything a run needs before it starts: its configuration, and what this process holds
/// for it (the checkpoint directory's lock, the metrics file).
#[cfg(feature = "train")]
struct Setup {
    cfg: crate::train::TrainConfig,
    /// Rank 0 of a multi-process run, or the only process: it writes the metrics and the
    /// report.
    lead: bool,
    accumulation: u64,
    metrics: Option<std::fs::File>,
    _dir_lock: Option<crate::lock::DirLock>,
}

/// Check the arguments against the model, plan, launcher and checkpoint, and settle what the
/// run will do (resumed runs take the checkpoint's global batch, seed and data unless told
/// otherwise, and say so).
#[cfg(feature = "train")]
fn setup(args: &TrainArgs) -> Result<Setup, Failure> {
    use std::sync::Arc;

    use crate::train::{data, exec::OptimConfig, TrainConfig};

    args.check()?;
    let model = crate::model::read_model(&args.model).map_err(Failure::input)?;
    let plan = crate::plan::read_plan(&args.plan, &model).map_err(Failure::input)?;
    crate::train::exec::check_runnable(&model, &plan)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    let mut membership = crate::train::tcp::Membership::from_env().map_err(Failure::input)?;
    let target = target(args, membership.as_ref())?;
    if membership.as_ref().is_some_and(|m| m.world == 1) {
        // A group of one (torchrun with one process): nothing to exchange, so no TCP
        // rendezvous and no NCCL; the in-process group runs the one rank.
        membership = None;
    }
    let world_size = match (&membership, args.world_size) {
        (Some(m), Some(w)) if w != m.world => {
            return Err(Failure::input(format!(
                "--world-size {w} disagrees with WORLD_SIZE {}",
                m.world
            )))
        }
        (Some(m), _) => m.world,
        (None, w) => w.unwrap_or(1),
    };
    // Only rank 0 of a multi-process run writes the metrics stream and the progress line.
    let lead = membership.as_ref().is_none_or(|m| m.rank == 0);
    if let Some(note) = membership.as_ref().and_then(|m| m.exposure()) {
        eprintln!("{note}");
    }
    if world_size == 0 {
        return Err(Failure::input("--world-size must be at least 1"));
    }
    // Under a launcher, its processes per machine are a node (what an hsdp plan needs; other
    // plans are left alone, whatever the launcher's shape).
    let hybrid = plan
        .choices
        .iter()
        .any(|c| c.strategy == crate::cost::Strategy::Hsdp);
    let ranks_per_node = args.ranks_per_node.or_else(|| {
        membership.as_ref().filter(|_| hybrid).and_then(|_| {
            ["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"]
                .iter()
                .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        })
    });
    crate::train::check_nodes(&model, &plan, world_size, ranks_per_node, target.device)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    // One trainer per checkpoint directory: a second would interleave its checkpoints with
    // ours. Rank 0 holds the lock for a run of several processes, which share the directory.
    // An existing directory is locked before its checkpoints are looked at.
    let early_lock = match args.checkpoint_dir.as_ref().filter(|d| lead && d.is_dir()) {
        Some(dir) => Some(lock_checkpoint_dir(dir)?),
        None => None,
    };
    let resume_from = resume_point(args)?;
    // A resumed run continues the same run: the global batch, seed and data the checkpoint
    // was written with, unless the user says otherwise (then say so).
    let resumed = match &resume_from {
        Some(dir) => Some(crate::train::checkpoint::verify(dir).map_err(Failure::input)?),
        None => None,
    };
    let mut notes: Vec<String> = Vec::new();
    let mut inherit =
        |what: &str, given: Option<String>, saved: Option<String>| match (given, saved) {
            (Some(g), Some(s)) if g != s => {
                notes.push(format!(
                    "{what} {g} as given (the checkpoint's run used {s})"
                ));
                Some(g)
            }
            (Some(g), _) => Some(g),
            (None, Some(s)) => {
                notes.push(format!("{what} {s} from the checkpoint"));
                Some(s)
            }
            (None, None) => None,
        };
    let global_batch_s = inherit(
        "global batch",
        args.global_batch.map(|g| g.to_string()),
        resumed.as_ref().map(|m| m.global_batch.to_string()),
    );
    let seed_s = inherit(
        "seed",
        args.seed.map(|s| s.to_string()),
        resumed.as_ref().map(|m| m.seed.to_string()),
    );
    let data_name = inherit(
        "data",
        args.data.clone(),
        // Checkpoints from before data sources had names say only "text".
        resumed
            .as_ref()
            .map(|m| m.data.clone())
            .filter(|d| d != "text"),
    )
    .unwrap_or_else(|| "shakespeare".into());
    let global_batch = global_batch_s
        .and_then(|g| g.parse::<u64>().ok())
        .unwrap_or(plan.batch * plan.accumulation * world_size as u64);
    let seed = seed_s.and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let accumulation =
        crate::train::accumulation(global_batch, world_size, plan.batch).map_err(Failure::input)?;
    let source = match data_name.as_str() {
        "shakespeare" => data::Source::shakespeare(),
        "random" => data::Source::Random,
        path => {
            let bytes =
                std::fs::read(path).map_err(|e| Failure::input(format!("--data {path}: {e}")))?;
            if bytes.len() <= model.config.seq_len as usize + 1 {
                return Err(Failure::input(format!(
                    "--data {path}: {} bytes is shorter than one sample of {} tokens",
                    bytes.len(),
                    model.config.seq_len + 1
                )));
            }
            data::Source::Text {
                name: path.to_string(),
                bytes: Arc::new(bytes),
            }
        }
    };
    if lead && !notes.is_empty() {
        eprintln!("resuming with {}", notes.join(", "));
    }
    if let Some(dir) = &args.checkpoint_dir {
        std::fs::create_dir_all(dir).map_err(|e| Failure::output(dir, e))?;
    }
    let dir_lock = match (early_lock, &args.checkpoint_dir) {
        (Some(lock), _) => Some(lock),
        (None, Some(dir)) if lead => Some(lock_checkpoint_dir(dir)?),
        (None, _) => None,
    };
    let metrics = match &args.metrics {
        Some(path) if lead => Some(open_metrics(path, resume_from.is_some())?),
        _ => None,
    };
    let cfg = TrainConfig {
        model,
        plan,
        world_size,
        ranks_per_node,
        global_batch,
        steps: args.steps,
        seed,
        source,
        optim: OptimConfig {
            lr: args.lr,
            ..OptimConfig::default()
        },
        target,
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        resume_from,
        collect_params: false,
        membership,
    };
    Ok(Setup {
        cfg,
        lead,
        accumulation,
        metrics,
        _dir_lock: dir_lock,
    })
}

/// The flag SIGINT, SIGTERM and SIGHUP (the terminal that started the run closed) set: the run
/// then finishes its step, checkpoints and exits. With `--supervisor-fd`, the dashboard's end
/// sets it too.
#[cfg(feature = "train")]
fn stop_flag(args: &TrainArgs) -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>, Failure> {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| Failure::input(format!("cannot install the signal handler: {e}")))?;
    }
    if let Some(fd) = args.supervisor_fd {
        let line = crate::lifeline::adopt(fd).map_err(Failure::input)?;
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("lifeline".into())
            .spawn(move || {
                if crate::lifeline::watch(line) == crate::lifeline::Ended::Gone {
                    eprintln!(
                        "the dashboard that started this run is gone: stopping with a checkpoint"
                    );
                    stop.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            })
            .map_err(|e| Failure::input(format!("cannot watch the dashboard: {e}")))?;
    }
    Ok(stop)
}

/// What the run says while it goes: every event to the metrics file, a start line, a live
/// progress line on a terminal, each checkpoint.
#[cfg(feature = "train")]
struct Progress<'a> {
    cfg: &'a crate::train::TrainConfig,
    accumulation: u64,
    metrics: Option<std::fs::File>,
    /// The first failure to write the metrics file (reported when the run ends).
    write_error: Option<std::io::Error>,
    last_checkpoint: Option<String>,
    /// `/N` when the run ends at step N.
    goal: String,
    tty: bool,
}

#[cfg(feature = "train")]
impl Progress<'_> {
    fn event(&mut self, ev: &crate::run::WorkerEvent) {
        use std::io::Write;

        use crate::run::WorkerEvent;

        if let Some(f) = self.metrics.as_mut() {
            let line = serde_json::to_string(ev).unwrap_or_default();
            if let Err(e) = writeln!(f, "{line}").and_then(|()| f.flush()) {
                self.write_error.get_or_insert(e);
            }
        }
        match ev {
            WorkerEvent::Started {
                first_step,
                last_step,
                world_size,
                global_batch,
                resumed_from,
                ..
            } => {
                self.goal = last_step.map_or(String::new(), |l| format!("/{l}"));
                let from = resumed_from
                    .as_deref()
                    .map(|p| format!(", resuming from {p}"))
                    .unwrap_or_default();
                let accumulated = if self.accumulation > 1 {
                    format!(
                        " ({} × {} micro-batches per rank)",
                        self.cfg.plan.batch, self.accumulation
                    )
                } else {
                    String::new()
                };
                eprintln!(
                    "training {} from step {first_step} {}: {world_size} rank(s), {global_batch} samples per step{accumulated}{from}",
                    self.cfg.model.name,
                    last_step.map_or("until stopped".to_string(), |l| format!("to {l}"))
                );
            }
            WorkerEvent::Step {
                step,
                loss,
                samples_per_s,
                memory_bytes,
                ..
            } if self.tty => {
                let peak = memory_bytes.iter().copied().max().unwrap_or(0);
                eprint!(
                    "\r\x1b[2Kstep {step}{}  loss {loss:.4}  {samples_per_s:.1} samples/s  peak {} per rank",
                    self.goal,
                    crate::units::bytes(peak)
                );
            }
            WorkerEvent::Checkpoint { path, .. } => {
                self.last_checkpoint = Some(path.clone());
                if self.tty {
                    eprint!("\r\x1b[2K");
                }
                eprintln!("checkpoint {path}");
            }
            _ => {}
        }
    }
}

#[cfg(feature = "train")]
pub fn train(args: TrainArgs) -> Result<(), Failure> {
    use std::io::IsTerminal;

    let setup = setup(&args)?;
    let stop = stop_flag(&args)?;
    let lead = setup.lead;
    let mut progress = Progress {
        cfg: &setup.cfg,
        accumulation: setup.accumulation,
        metrics: setup.metrics,
        write_error: None,
        last_checkpoint: None,
        goal: String::new(),
        tty: lead && std::io::stderr().is_terminal(),
    };
    let started = std::time::Instant::now();
    let result = crate::train::train(&setup.cfg, &stop, |ev| progress.event(ev));
    if progress.tty {
        eprint!("\r\x1b[2K");
    }
    let summary = result.map_err(|e| Failure {
        code: 1,
        message: e.to_string(),
    })?;
    if let (Some(e), Some(path)) = (progress.write_error, &args.metrics) {
        return Err(Failure::output(path, e));
    }
    if !lead {
        // Rank 0 reports the run; the others only say they ended well.
        eprintln!("rank done at step {}", summary.last_step);
        return Ok(());
    }
    let report = TrainReport {
        checkpoint: progress.last_checkpoint,
        elapsed_s: started.elapsed().as_secs_f64(),
        first_loss: summary.losses.first().copied(),
        first_step: summary.first_step,
        last_loss: summary.losses.last().copied(),
        last_step: summary.last_step,
        peak_memory_bytes: summary
            .memory_bytes
            .iter()
            .flatten()
            .copied()
            .max()
            .unwrap_or(0),
        stopped_by_signal: summary.stopped_by_signal,
    };
    if args.json {
        crate::report::print_json(&report);
    } else {
        println!("{}", report.text());
    }
    Ok(())
}

/// Lock a checkpoint directory for this run, saying so when a dead run's lock is taken over.
#[cfg(feature = "train")]
fn lock_checkpoint_dir(dir: &std::path::Path) -> Result<crate::lock::DirLock, Failure> {
    let (lock, note) =
        crate::lock::DirLock::acquire(dir, "checkpoint directory").map_err(Failure::input)?;
    if let Some(note) = note {
        eprintln!("note: {note}");
    }
    Ok(lock)
}

#[cfg(feature = "train")]
fn open_metrics(path: &std::path::Path, append: bool) -> Result<std::fs::File, Failure> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true);
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(true);
    }
    let mut f = o.open(path).map_err(|e| Failure::output(path, e))?;
    if append {
        crate::run::end_cut_line(path, &mut f).map_err(|e| Failure::output(path, e))?;
    }
    Ok(f)
}

#[cfg(test)]
mod report_tests {
    use super::TrainReport;

    fn report() -> TrainReport {
        TrainReport {
            checkpoint: Some("runs/x/step-000040".into()),
            elapsed_s: 12.34,
            first_loss: Some(4.17259),
            first_step: 0,
            last_loss: Some(2.5),
            last_step: 40,
            peak_memory_bytes: 3 << 29,
            stopped_by_signal: true,
        }
    }

    #[test]
    fn the_text_report_is_one_line_with_what_the_run_did() {
        assert_eq!(
            report().text(),
            "stopped: steps 0→40 in 12.3 s, loss 4.1726 → 2.5000, peak 1.5 GiB per rank, \
             checkpoint runs/x/step-000040"
        );
        let none = TrainReport {
            checkpoint: None,
            first_loss: None,
            last_loss: None,
            stopped_by_signal: false,
            ..report()
        };
        assert_eq!(
            none.text(),
            "done: steps 0→40 in 12.3 s, loss - → -, peak 1.5 GiB per rank"
        );
    }

    #[test]
    fn the_json_report_keeps_its_keys_and_their_order() {
        let text = serde_json::to_string(&report()).unwrap();
        assert_eq!(
            text,
            "{\"checkpoint\":\"runs/x/step-000040\",\"elapsed_s\":12.34,\"first_loss\":4.17259,\
             \"first_step\":0,\"last_loss\":2.5,\"last_step\":40,\"peak_memory_bytes\":1610612736,\
             \"stopped_by_signal\":true}"
        );
    }
}

#[cfg(all(test, feature = "train"))]
mod tests {
    use super::*;

    #[test]
    fn appending_after_a_cut_line_starts_the_next_event_on_its_own_line() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"event\":\"checkpointing\",\"step\":1}\n{\"event\":\"ste",
        )
        .unwrap();
        let Ok(mut f) = open_metrics(&path, true) else {
            panic!("cannot open {}", path.display())
        };
        writeln!(f, "{{\"event\":\"checkpointing\",\"step\":2}}").unwrap();
        drop(f);
        let status = crate::run::RunStatus::from_text(&std::fs::read_to_string(&path).unwrap());
        assert_eq!(
            status.checkpointing,
            Some(2),
            "the event after the cut line is read"
        );
        // A whole file gains nothing.
        let before = std::fs::read_to_string(&path).unwrap();
        assert!(open_metrics(&path, true).is_ok());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    }
}

#[cfg(test)]
mod command_line {
    use super::*;
    use clap::Parser;
    use proptest::prelude::*;

    fn parse(args: &TrainArgs) -> TrainArgs {
        let argv = std::iter::once("osdp-tui".into())
            .chain(std::iter::once("train".into()))
            .chain(args.to_args());
        match super::super::Cli::try_parse_from(argv) {
            Ok(super::super::Cli {
                command: Some(super::super::Command::Train(parsed)),
                ..
            }) => parsed,
            Ok(_) => panic!("{:?} did not parse as `train`", args.to_args()),
            Err(e) => panic!("{:?} did not parse: {e}", args.to_args()),
        }
    }

    fn path() -> impl Strategy<Value = PathBuf> {
        prop_oneof![
            Just("model.json"),
            Just("-starts-with-a-dash.json"),
            Just("runs/a b/plan.json"),
            Just("--resume"),
            Just("/abs/ünïcode.json"),
        ]
        .prop_map(PathBuf::from)
    }

    fn args() -> impl Strategy<Value = TrainArgs> {
        (
            (path(), path(), proptest::option::of(1..=MAX_WORLD_SIZE)),
            (
                proptest::option::of(1u64..1 << 20),
                any::<bool>(),
                any::<bool>(),
            ),
            (0u64..1 << 40, proptest::option::of(any::<u64>())),
            (proptest::option::of("[a-z./ -]{1,12}"), 1e-12f64..10.0),
            (proptest::option::of(path()), proptest::option::of(path())),
            (0u64..1000, 0u8..3, any::<bool>()),
            proptest::option::of(3i32..1 << 20),
        )
            .prop_map(
                |(
                    (model, plan, world_size),
                    (global_batch, cuda, bf16),
                    (steps, seed),
                    (data, lr),
                    (metrics, dir),
                    (every, resume, json),
                    supervisor_fd,
                )| {
                    TrainArgs {
                        model,
                        plan,
                        world_size,
                        // Nodes of half the ranks where the world splits in two.
                        ranks_per_node: world_size.filter(|w| w % 2 == 0).map(|w| w / 2),
                        global_batch,
                        device: if cuda {
                            DeviceArg::Cuda
                        } else {
                            DeviceArg::Cpu
                        },
                        precision: bf16.then_some(PrecisionArg::Bf16),
                        steps,
                        seed,
                        data,
                        lr,
                        metrics,
                        // `--resume` needs a directory; `--resume-from` excludes `--resume`.
                        checkpoint_dir: dir.clone().or_else(|| (resume == 1).then(|| "ck".into())),
                        checkpoint_every: every,
                        resume: resume == 1,
                        resume_from: (resume == 2).then(|| PathBuf::from("ck/step-00000001")),
                        json,
                        supervisor_fd,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn a_worker_command_line_parses_back_to_the_arguments_it_came_from(a in args()) {
            prop_assert_eq!(parse(&a), a);
        }
    }

    #[test]
    fn new_takes_every_default_from_the_cli() {
        let a = TrainArgs::new("m.json".into(), "p.json".into());
        assert_eq!(parse(&a), a);
        assert_eq!((a.steps, a.lr, a.device), (100, 1e-3, DeviceArg::Cpu));
        assert!(a.world_size.is_none() && !a.resume && a.metrics.is_none());
        assert!(a.supervisor_fd.is_none());
    }
}
