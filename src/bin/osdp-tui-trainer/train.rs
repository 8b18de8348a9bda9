//! `train`: run a plan with the libtorch trainer.

use std::path::PathBuf;

use osdp_tui::cli::train::*;
use osdp_tui::cli::Failure;

/// The device and number format of this process's rank(s), checked: a GPU rank needs the
/// `cuda` build, a usable GPU for its `LOCAL_RANK`, NCCL, and one process per GPU.
fn target(
    args: &TrainArgs,
    membership: Option<&osdp_train::tcp::Membership>,
) -> Result<osdp_train::exec::Target, Failure> {
    use osdp_train::exec::{Numerics, Target};
    let numerics = match (args.precision, args.device) {
        (Some(PrecisionArg::Fp32), _) | (None, DeviceArg::Cpu) => Numerics::Fp32,
        (Some(PrecisionArg::Bf16), _) | (None, DeviceArg::Cuda) => Numerics::Bf16Mixed,
    };
    if args.device == DeviceArg::Cpu {
        return Ok(Target {
            device: osdp_train::tch::Device::Cpu,
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
        let device =
            osdp_train::cuda::preflight(osdp_train::env::local_rank()).map_err(Failure::input)?;
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
fn resume_point(args: &TrainArgs) -> Result<Option<PathBuf>, Failure> {
    use osdp_train::checkpoint;
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

/// Everything a run needs before it starts: its configuration, and what this process holds
/// for it (the checkpoint directory's lock, the metrics file).
struct Setup {
    cfg: osdp_train::TrainConfig,
    /// Rank 0 of a multi-process run, or the only process: it writes the metrics and the
    /// report.
    lead: bool,
    accumulation: u64,
    metrics: Option<std::fs::File>,
    _dir_lock: Option<osdp_tui::run::lock::DirLock>,
}

/// Check the arguments against the model, plan, launcher and checkpoint, and settle what the
/// run will do (resumed runs take the checkpoint's global batch, seed and data unless told
/// otherwise, and say so).
fn setup(args: &TrainArgs) -> Result<Setup, Failure> {
    use osdp_train::{exec::OptimConfig, TrainConfig};

    args.check()?;
    let model = osdp_core::model::read_model(&args.model).map_err(Failure::input)?;
    let plan = osdp_core::plan::read_plan(&args.plan, &model).map_err(Failure::input)?;
    osdp_train::exec::check_runnable(&model, &plan)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    let Group {
        membership,
        target,
        world_size,
        lead,
    } = group(args)?;
    let ranks_per_node = ranks_per_node(args, &plan, membership.as_ref());
    osdp_train::check_plan_nodes(&model, &plan, world_size, ranks_per_node, target.device)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    // One trainer per checkpoint directory: a second would interleave its checkpoints with
    // ours. Rank 0 holds the lock for a run of several processes, which share the directory.
    // An existing directory is locked before its checkpoints are looked at.
    let early_lock = match args.checkpoint_dir.as_ref().filter(|d| lead && d.is_dir()) {
        Some(dir) => Some(lock_checkpoint_dir(dir)?),
        None => None,
    };
    let resume_from = resume_point(args)?;
    let resumed = match &resume_from {
        Some(dir) => Some(resumed_manifest(dir, &model)?),
        None => None,
    };
    osdp_train::last_step(resumed.as_ref().map_or(0, |m| m.step), args.steps)
        .map_err(Failure::input)?;
    // The weights to start from, opened and checked now (headers only) so that a wrong
    // checkpoint is bad input, refused before any rank starts; a resumed run has its own.
    let init_from = match (&args.init_from, &resume_from) {
        (Some(dir), None) => {
            Some(osdp_train::hf_weights::HfWeights::open(dir, &model).map_err(Failure::input)?)
        }
        _ => None,
    };
    // A resumed run continues the same run: the global batch, seed and data the checkpoint
    // was written with, unless the user says otherwise (then say so).
    let settled = Settled::of(
        args,
        resumed.as_ref(),
        plan.batch * plan.accumulation * world_size as u64,
    );
    let accumulation = osdp_core::plan::accumulation(settled.global_batch, world_size, plan.batch)
        .map_err(Failure::input)?;
    let source = data_source(&settled.data, &model)?;
    if lead && !settled.notes.is_empty() {
        eprintln!("resuming with {}", settled.notes.join(", "));
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
    if let (Some(dir), Some(_)) = (&args.checkpoint_dir, &dir_lock) {
        // Locked, and no checkpoint of this run is being written yet.
        sweep_checkpoint_dir(dir);
    }
    let eval = eval_config(args, &model, world_size)?;
    let cfg = TrainConfig {
        model,
        plan,
        world_size,
        ranks_per_node,
        global_batch: settled.global_batch,
        steps: args.steps,
        seed: settled.seed,
        source,
        optim: OptimConfig {
            lr: args.lr,
            ..OptimConfig::default()
        },
        target,
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        resume_from,
        init_from,
        eval,
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

/// The manifest of the checkpoint in `dir`, verified and checked to be of `model` before
/// anything is allocated for its state.
fn resumed_manifest(
    dir: &std::path::Path,
    model: &osdp_core::model::ModelSpec,
) -> Result<osdp_train::checkpoint::Manifest, Failure> {
    let m = osdp_train::checkpoint::verify(dir).map_err(Failure::input)?;
    m.check_model(model).map_err(|problem| {
        Failure::input(format!(
            "checkpoint {}: {problem}",
            dir.join("manifest.json").display()
        ))
    })?;
    Ok(m)
}

/// Remove what interrupted checkpoints left in `dir` (the caller holds its lock), saying so.
fn sweep_checkpoint_dir(dir: &std::path::Path) {
    let removed = osdp_train::checkpoint::sweep(dir);
    if removed.is_empty() {
        return;
    }
    let names: Vec<String> = removed
        .iter()
        .filter_map(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    eprintln!(
        "note: removed what interrupted checkpoints left in {}: {}",
        dir.display(),
        names.join(", ")
    );
}

/// The ranks this process runs and the group they belong to.
struct Group {
    /// The launcher's group; `None` for a run in this process alone.
    membership: Option<osdp_train::tcp::Membership>,
    target: osdp_train::exec::Target,
    world_size: usize,
    /// Rank 0 of a multi-process run, or the only process.
    lead: bool,
}

/// Join what the launcher's environment says with `--world-size` and `--device`.
fn group(args: &TrainArgs) -> Result<Group, Failure> {
    let mut membership = osdp_train::tcp::Membership::from_env().map_err(Failure::input)?;
    // The launcher's world and the one asked for agree, a launcher's group of one included.
    if let (Some(m), Some(w)) = (&membership, args.world_size) {
        if w != m.world {
            return Err(Failure::input(format!(
                "--world-size {w} disagrees with the launcher's WORLD_SIZE {} (from the \
                 environment): give one of them, or the same number to both",
                m.world
            )));
        }
    }
    let target = target(args, membership.as_ref())?;
    if membership.as_ref().is_some_and(|m| m.world == 1) {
        // A group of one (torchrun with one process): nothing to exchange, so no TCP
        // rendezvous and no NCCL; the in-process group runs the one rank.
        membership = None;
    }
    let world_size = membership
        .as_ref()
        .map_or(args.world_size.unwrap_or(1), |m| m.world);
    // Only rank 0 of a multi-process run writes the metrics stream and the progress line.
    let lead = membership.as_ref().is_none_or(|m| m.rank == 0);
    if world_size == 0 {
        return Err(Failure::input("--world-size must be at least 1"));
    }
    if membership.is_none() {
        // Every rank a thread of this process.
        osdp_train::measure::check_rank_threads(world_size).map_err(|e| {
            Failure::input(format!(
                "--world-size {world_size}: {e}; train with fewer ranks, or as one process per \
                 rank over several machines (torchrun, srun)"
            ))
        })?;
    }
    Ok(Group {
        membership,
        target,
        world_size,
        lead,
    })
}

/// `--ranks-per-node`, else, under a launcher, its processes per machine are a node (what an
/// hsdp plan needs; other plans are left alone, whatever the launcher's shape).
fn ranks_per_node(
    args: &TrainArgs,
    plan: &osdp_core::plan::Plan,
    membership: Option<&osdp_train::tcp::Membership>,
) -> Option<usize> {
    let hybrid = plan
        .choices
        .iter()
        .any(|c| c.strategy.info().needs == osdp_core::cost::Needs::SeveralNodes);
    args.ranks_per_node.or_else(|| {
        membership
            .filter(|_| hybrid)
            .and_then(|_| osdp_train::env::local_ranks())
    })
}

/// The global batch, seed and data a run uses: as given, else a resumed checkpoint's, else
/// the defaults; with a note for each taken from (or overriding) the checkpoint.
struct Settled {
    global_batch: u64,
    seed: u64,
    data: String,
    notes: Vec<String>,
}

impl Settled {
    /// `resumed`: the checkpoint resumed from; `default_global_batch`: the plan's.
    fn of(
        args: &TrainArgs,
        resumed: Option<&osdp_train::checkpoint::Manifest>,
        default_global_batch: u64,
    ) -> Settled {
        let mut notes: Vec<String> = Vec::new();
        let global_batch_s = inherit(
            &mut notes,
            "global batch",
            args.global_batch.map(|g| g.to_string()),
            resumed.map(|m| m.global_batch.to_string()),
        );
        let seed_s = inherit(
            &mut notes,
            "seed",
            args.seed.map(|s| s.to_string()),
            resumed.map(|m| m.seed.to_string()),
        );
        let data = inherit(
            &mut notes,
            "data",
            (args.data.is_some() || args.tokenizer.is_some()).then(|| {
                osdp_train::data::load::label(
                    args.data.as_deref().unwrap_or("shakespeare"),
                    args.tokenizer.as_deref(),
                )
            }),
            // Checkpoints from before data sources had names say only "text".
            resumed.map(|m| m.data.clone()).filter(|d| d != "text"),
        )
        .unwrap_or_else(|| "shakespeare".into());
        let global_batch = global_batch_s
            .and_then(|g| g.parse::<u64>().ok())
            .unwrap_or(default_global_batch);
        let seed = seed_s.and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        Settled {
            global_batch,
            seed,
            data,
            notes,
        }
    }
}

/// One setting of a resumed run: the value `given`, else the checkpoint's (`saved`), with a
/// note in `notes` when the checkpoint's was taken or overridden.
fn inherit(
    notes: &mut Vec<String>,
    what: &str,
    given: Option<String>,
    saved: Option<String>,
) -> Option<String> {
    match (given, saved) {
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
    }
}

/// The held-out loss `--eval-data` asks for: its tokens (with the run's --tokenizer) and as
/// many of its samples as asked and held, a multiple of the world size.
fn eval_config(
    args: &TrainArgs,
    model: &osdp_core::model::ModelSpec,
    world: usize,
) -> Result<Option<osdp_train::EvalConfig>, Failure> {
    let Some(spec) = &args.eval_data else {
        return Ok(None);
    };
    let seq = model.config.seq_len as usize;
    let source = osdp_train::data::load::open(
        "--eval-data",
        spec,
        args.tokenizer.as_deref(),
        model.config.vocab_size,
        seq,
    )
    .map_err(Failure::input)?;
    let tokens = source
        .tokens()
        .ok_or_else(|| Failure::input("--eval-data random: held-out loss needs real data"))?;
    let held = osdp_train::eval::samples_in(tokens.len(), seq);
    let samples = (args.eval_samples as usize).min(held) / world * world;
    if samples == 0 {
        return Err(Failure::input(format!(
            "--eval-data {spec}: {held} samples of {seq} tokens, fewer than one per rank ({world})"
        )));
    }
    Ok(Some(osdp_train::EvalConfig {
        tokens: std::sync::Arc::new(tokens),
        every: args.eval_every,
        samples,
    }))
}

/// The training data a label names (`--data`, with `--tokenizer` when given): the built-in
/// Shakespeare, random tokens, or a file (osdp_train::data::load).
fn data_source(
    label: &str,
    model: &osdp_core::model::ModelSpec,
) -> Result<osdp_train::data::Source, Failure> {
    use osdp_train::data::load;
    let (spec, tokenizer) = load::parse_label(label);
    load::open(
        "--data",
        spec,
        tokenizer,
        model.config.vocab_size,
        model.config.seq_len as usize,
    )
    .map_err(Failure::input)
}

/// The flag SIGINT, SIGTERM and SIGHUP (the terminal that started the run closed) set: the run
/// then finishes its step, checkpoints and exits. With `--supervisor-fd`, the dashboard's end
/// sets it too.
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
        let line = osdp_tui::lifeline::adopt(fd).map_err(Failure::input)?;
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("lifeline".into())
            .spawn(move || {
                if osdp_tui::lifeline::watch(line) == osdp_tui::lifeline::Ended::Gone {
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
struct Progress<'a> {
    cfg: &'a osdp_train::TrainConfig,
    accumulation: u64,
    metrics: Option<std::fs::File>,
    /// The first failure to write the metrics file (reported when the run ends).
    write_error: Option<std::io::Error>,
    last_checkpoint: Option<String>,
    /// `/N` when the run ends at step N.
    goal: String,
    tty: bool,
}

impl Progress<'_> {
    fn event(&mut self, ev: &osdp_core::protocol::WorkerEvent) {
        use std::io::Write;

        use osdp_core::protocol::WorkerEvent;

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
                if let Some(note) = dropout_note(&self.cfg.model) {
                    eprintln!("{note}");
                }
                if let Some(note) = padding_note(self.cfg) {
                    eprintln!("{note}");
                }
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
                    osdp_core::units::bytes(peak)
                );
            }
            WorkerEvent::Eval {
                step,
                loss,
                samples,
            } => {
                if self.tty {
                    eprint!("\r\x1b[2K");
                }
                eprintln!("step {step}: eval loss {loss:.4} over {samples} held-out samples");
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
    let result = osdp_train::train(&setup.cfg, &stop, |ev| progress.event(ev));
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
        padded_linears: summary.padded_linears,
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
        osdp_tui::report::print_json(&report);
    } else {
        println!("{}", report.text());
    }
    Ok(())
}

/// Lock a checkpoint directory for this run, saying so when a dead run's lock is taken over.
fn lock_checkpoint_dir(dir: &std::path::Path) -> Result<osdp_tui::run::lock::DirLock, Failure> {
    let (lock, note) = osdp_tui::run::lock::DirLock::acquire(dir, "checkpoint directory")
        .map_err(Failure::input)?;
    if let Some(note) = note {
        eprintln!("note: {note}");
    }
    Ok(lock)
}

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
        osdp_tui::run::end_cut_line(path, &mut f).map_err(|e| Failure::output(path, e))?;
    }
    Ok(f)
}

/// What a user of a model whose config asks for dropout should know: the trainer applies none
/// (its equivalence with PyTorch holds step for step without it), so the run regularises less
/// than transformers' training would, and keeps less memory than the plan, which counts
/// dropout's masks as the model describes them.
fn dropout_note(model: &osdp_core::model::ModelSpec) -> Option<String> {
    let c = &model.config;
    (c.dropout > 0.0 || c.attention_dropout > 0.0).then(|| {
        format!(
            "note: {}'s config sets dropout {} (attention {}); osdp-tui's trainer applies no \
             dropout, so this run regularises less than transformers' training would, and keeps \
             a little less memory than the plan counts for dropout's masks",
            osdp_core::text::printable(&model.name),
            c.dropout,
            c.attention_dropout
        )
    })
}

/// The weights the trainer pads with zero rows so that every GEMM dimension suits the tensor
/// cores, and how to turn that off (a user comparing against another stack should know).
fn padding_note(cfg: &osdp_train::TrainConfig) -> Option<String> {
    let padded = cfg.target.linears_to_pad(&cfg.model);
    let (id, rows, to) = padded.first()?;
    let others = match padded.len() {
        1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    Some(format!(
        "note: {}{others}: its {} weight rows are multiplied with zero rows added up to {}, a \
         multiple of 64, so its GEMMs run at the aligned rate; the gradients and the saved model \
         keep {} rows (OSDP_GEMM_PADDING=0 turns this off)",
        osdp_core::text::printable(id),
        osdp_core::units::thousands(*rows as u64),
        osdp_core::units::thousands(*to as u64),
        osdp_core::units::thousands(*rows as u64),
    ))
}

#[cfg(test)]
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
        let status = osdp_tui::run::RunStatus::from_text(&std::fs::read_to_string(&path).unwrap());
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
