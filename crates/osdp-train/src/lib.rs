//! The trainer (cargo feature `train`): runs a plan with libtorch. Ranks are threads of this
//! process exchanging tensors through the local collective backend; each runs an [`Executor`]
//! on its share of every global batch. Progress goes out as [`WorkerEvent`]s.

pub mod aten;
pub mod calibrate;
pub mod checkpoint;
pub mod collective;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device_memory;
pub mod env;
pub mod eval;
pub mod exec;
pub mod hf_weights;
pub mod measure;
pub mod memory;
pub mod ops;
pub mod tcp;

/// The libtorch binding the trainer is built on, for the app's few direct uses (devices).
pub use tch;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use tch::Tensor;

use collective::{Collective, LocalGroup};
use exec::{Executor, Init, OptimConfig, Target};
use osdp_core::model::ModelSpec;
use osdp_core::plan::Plan;
use osdp_core::protocol::WorkerEvent;

/// Keep freed tensor memory inside the process rather than handing it back to the kernel after
/// every op. The CPU trainer allocates and frees the same buffers (gathered weights, padded
/// gradients, activations) hundreds of times a step; with glibc's defaults each large one is a
/// fresh `mmap` or a trimmed heap whose pages fault in again, which made ZeRO-3 steps of small
/// models ~20 % slower than their kernels (measured: tiny-gpt2, 2 ranks, 75 → 61 ms). Allocations
/// below 32 MiB come from the heap, and up to 256 MiB freed at its top is kept (64 MiB grown
/// ahead). A parameter the user set through glibc's own `MALLOC_*` variable is left alone. Call
/// before any thread starts; a no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, value, var) in [
        (libc::M_MMAP_THRESHOLD, 32 << 20, env::MALLOC_MMAP_THRESHOLD),
        (
            libc::M_TRIM_THRESHOLD,
            256 << 20,
            env::MALLOC_TRIM_THRESHOLD,
        ),
        (libc::M_TOP_PAD, 64 << 20, env::MALLOC_TOP_PAD),
    ] {
        if !env::malloc_tunable_set(var) {
            // SAFETY: mallopt only changes glibc's allocator tunables; it is called from the
            // main thread before the ranks start.
            unsafe { libc::mallopt(param, value) };
        }
    }
}

/// The CUDA caching allocator's settings for this process and the workers it starts: expandable
/// segments ([`env::CUDA_ALLOC_DEFAULT`]), unless the user set `PYTORCH_CUDA_ALLOC_CONF` or
/// `PYTORCH_ALLOC_CONF` themselves. The cost model predicts the allocated peak plus a runtime overhead; fixed-size
/// segments left several GiB reserved beyond it on a model with tensors of many sizes. Call
/// before any thread starts and before anything touches a GPU; harmless without one.
pub fn allocator_defaults() {
    if !env::cuda_alloc_conf_set() {
        std::env::set_var(env::PYTORCH_CUDA_ALLOC_CONF, env::CUDA_ALLOC_DEFAULT);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("rank {rank}: {message}")]
    Rank { rank: usize, message: String },
}

/// Everything a run needs, checked.
pub struct TrainConfig {
    pub model: ModelSpec,
    pub plan: Plan,
    pub world_size: usize,
    /// The ranks arranged as nodes of this many consecutive ranks (hsdp shards inside a node
    /// and replicates across nodes); `None`: all ranks are one node.
    pub ranks_per_node: Option<usize>,
    pub global_batch: u64,
    /// Steps to run in this invocation (0: until stopped).
    pub steps: u64,
    pub seed: u64,
    pub source: data::Source,
    pub optim: OptimConfig,
    /// Device and precision of every rank (a CUDA rank computes on `cuda:LOCAL_RANK`).
    pub target: Target,
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every K steps (0: only when the run ends or stops).
    pub checkpoint_every: u64,
    /// Checkpoint directory (`step-…`) to resume from.
    pub resume_from: Option<PathBuf>,
    /// A Hugging Face checkpoint, opened and checked, to take the initial weights from (when
    /// not resuming); `None`: weights from the seed.
    pub init_from: Option<hf_weights::HfWeights>,
    /// Held-out loss every so many steps (`--eval-data`); `None`: none.
    pub eval: Option<EvalConfig>,
    /// Return every parameter's final value (tests and equivalence checks).
    pub collect_params: bool,
    /// This process is one rank of a multi-process group (torchrun/Slurm environment);
    /// `None`: all ranks are threads of this process.
    pub membership: Option<tcp::Membership>,
}

/// The held-out loss a run reports: every `every` steps (and after its last), the mean loss
/// over the first `samples` samples of `tokens` taken in order, each rank evaluating an equal
/// share with the plan's own sharding.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    pub tokens: std::sync::Arc<Vec<i64>>,
    pub every: u64,
    pub samples: usize,
}

/// What a finished run returns besides its events.
#[derive(Default)]
pub struct TrainSummary {
    pub first_step: u64,
    pub last_step: u64,
    pub losses: Vec<f64>,
    /// Per step, each rank's peak bytes.
    pub memory_bytes: Vec<Vec<u64>>,
    pub final_params: Vec<(String, Tensor)>,
    pub stopped_by_signal: bool,
    /// Rank 0's linears whose GEMMs ran padded ([`exec::Executor::padded_linears`]).
    pub padded_linears: Vec<osdp_core::protocol::PaddedLinear>,
}

enum RankMsg {
    /// Sent by rank 0 with every rank's figures (gathered).
    Step {
        step: u64,
        loss: f64,
        grad_norm: f64,
        lr: f64,
        /// The slowest rank's step time.
        time_s: f64,
        /// Each rank's peak bytes.
        memory_bytes: Vec<u64>,
        peak: memory::Breakdown,
        /// Each rank's allocator and NVML figures (empty on the CPU).
        device_memory: Vec<device_memory::DeviceMemory>,
        /// Rank 0's linears whose GEMMs have run padded.
        padded: Vec<osdp_core::protocol::PaddedLinear>,
    },
    Eval {
        step: u64,
        loss: f64,
        samples: u64,
    },
    Checkpointing {
        step: u64,
    },
    Checkpoint {
        step: u64,
        path: PathBuf,
        time_s: f64,
    },
}

struct RankEnd {
    last_step: u64,
    by_signal: bool,
    params: Vec<(String, Tensor)>,
}

/// Train: run the plan for the configured steps. `stop` asks for a graceful stop (finish the
/// step, checkpoint, return).
pub fn train(
    cfg: &TrainConfig,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&WorkerEvent),
) -> Result<TrainSummary, TrainError> {
    let world = cfg.world_size;
    check_config(cfg)?;
    let start = start(cfg)?;
    let first_step = match &start {
        Start::Resumed(r) => r.0.step,
        _ => 0,
    };
    let last_step = last_step(first_step, cfg.steps).map_err(TrainError::Invalid)?;
    on_event(&WorkerEvent::Started {
        model: cfg.model.name.clone(),
        world_size: world,
        global_batch: cfg.global_batch,
        first_step,
        last_step,
        resumed_from: cfg.resume_from.as_ref().map(|p| p.display().to_string()),
        data: cfg.source.label().to_string(),
        device: device_label(cfg.target),
    });
    // Ranks on this machine share its cores.
    let local_ranks = env::local_ranks().unwrap_or(world).max(1);
    tch::set_num_threads(measure::threads_per_rank(local_ranks) as i32);

    let sampler = data::Sampler {
        source: cfg.source.clone(),
        seed: cfg.seed,
        seq: cfg.model.config.seq_len as usize,
        vocab: cfg.model.config.vocab_size,
    };
    let rows = (cfg.global_batch as usize) / world;
    let end = last_step.unwrap_or(u64::MAX);
    let members = members(cfg, first_step)?;
    let (tx, rx) = mpsc::channel::<RankMsg>();
    let mut summary = TrainSummary {
        first_step,
        last_step: first_step,
        ..TrainSummary::default()
    };
    let results: Vec<Result<RankEnd, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = members
            .into_iter()
            .map(|(group, aborter)| {
                let tx = tx.clone();
                let sampler = &sampler;
                let start = &start;
                scope.spawn(move || {
                    let rank = group.rank();
                    let body = std::panic::AssertUnwindSafe(|| {
                        let span = first_step..end;
                        rank_main(cfg, stop, group, sampler, rows, span, start, &tx)
                    });
                    let out = std::panic::catch_unwind(body)
                        .unwrap_or_else(|payload| Err(panicked(rank, payload.as_ref())));
                    if let (Err(e), Some(aborter)) = (&out, &aborter) {
                        aborter.abort(&e.to_string());
                    }
                    out
                })
            })
            .collect();
        drop(tx);
        for msg in rx {
            report(cfg, msg, &mut summary, &mut on_event);
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Rank {
                        rank,
                        message: "panicked".into(),
                    })
                })
            })
            .collect()
    });
    let ends = collect_ranks(results).inspect_err(|e| {
        on_event(&WorkerEvent::Failed {
            message: e.to_string(),
        })
    })?;
    let end = ends.into_iter().next().unwrap_or(RankEnd {
        last_step: first_step,
        by_signal: false,
        params: Vec::new(),
    });
    summary.last_step = end.last_step;
    summary.stopped_by_signal = end.by_signal;
    summary.final_params = end.params;
    on_event(&WorkerEvent::Stopped {
        step: end.last_step,
        reason: if end.by_signal { "signal" } else { "completed" }.into(),
    });
    Ok(summary)
}

/// Whether `cfg` can run before anything starts: the world (the launcher's and the one asked
/// for), the batch's split into micro-batches, the plan on this model, the nodes.
fn check_config(cfg: &TrainConfig) -> Result<(), TrainError> {
    let world = cfg.world_size;
    if let Some(m) = &cfg.membership {
        if m.world != world {
            return Err(TrainError::Invalid(format!(
                "WORLD_SIZE is {} but the world size asked for is {world}",
                m.world
            )));
        }
    }
    if world == 0 {
        return Err(TrainError::Invalid(
            "the world size must be at least 1".into(),
        ));
    }
    if cfg.membership.is_none() {
        measure::check_rank_threads(world).map_err(TrainError::Invalid)?;
    }
    osdp_core::plan::accumulation(cfg.global_batch, world, cfg.plan.batch)
        .map_err(TrainError::Invalid)?;
    exec::check_runnable(&cfg.model, &cfg.plan).map_err(|e| TrainError::Invalid(e.to_string()))?;
    check_plan_nodes(
        &cfg.model,
        &cfg.plan,
        world,
        cfg.ranks_per_node,
        cfg.target.device,
    )
    .map_err(TrainError::Invalid)
}

/// The step a run of `steps` steps from `first_step` ends at (`None`: `steps` is 0, the run
/// goes until stopped). Refused past [`checkpoint::MAX_STEP`], the last step a checkpoint
/// holds (and far short of where the sum would overflow).
pub fn last_step(first_step: u64, steps: u64) -> Result<Option<u64>, String> {
    if steps == 0 {
        return Ok(None);
    }
    match first_step.checked_add(steps) {
        Some(last) if last <= checkpoint::MAX_STEP => Ok(Some(last)),
        _ => Err(format!(
            "--steps {steps} from step {first_step} would end past step {}, the last a \
             checkpoint holds: give fewer steps, or --steps 0 to run until stopped",
            checkpoint::MAX_STEP
        )),
    }
}

/// A checkpoint's manifest and full parameter values, as every rank starts from them.
type Restored = (
    checkpoint::Manifest,
    std::collections::HashMap<String, exec::FullState>,
);

/// Where every rank's first values come from.
enum Start<'a> {
    /// Weights from the seed.
    Fresh,
    /// A checkpoint of this run (weights, moments, step).
    Resumed(Box<Restored>),
    /// A Hugging Face checkpoint's weights, each rank reading its own shares.
    Pretrained(&'a hf_weights::HfWeights),
}

/// The checkpoint `cfg` resumes from, loaded and checked to be of this model; else the Hugging
/// Face weights it starts from; else fresh.
fn start(cfg: &TrainConfig) -> Result<Start<'_>, TrainError> {
    if let Some(dir) = &cfg.resume_from {
        let (manifest, params) = checkpoint::load_for(dir, &cfg.model)?;
        return Ok(Start::Resumed(Box::new((manifest, params))));
    }
    Ok(cfg
        .init_from
        .as_ref()
        .map_or(Start::Fresh, Start::Pretrained))
}

/// A rank this process runs: its collective handle and, for threads, a way to release the
/// others when it fails (a failed process drops its connections instead).
type Member = (Box<dyn Collective>, Option<collective::AbortHandle>);

/// The ranks this process runs: every rank as a thread, or this process's one rank of a
/// multi-process group (joined here).
fn members(cfg: &TrainConfig, first_step: u64) -> Result<Vec<Member>, TrainError> {
    let world = cfg.world_size;
    Ok(match &cfg.membership {
        None => LocalGroup::with_nodes(world, cfg.ranks_per_node.unwrap_or(world))
            .map_err(TrainError::Invalid)?
            .into_iter()
            .map(|g| {
                let abort = g.abort_handle();
                (Box::new(g) as Box<dyn Collective>, Some(abort))
            })
            .collect(),
        Some(m) => vec![(
            join_group(
                m,
                cfg.target.device,
                &terms(cfg, first_step),
                cfg.ranks_per_node.unwrap_or(world),
            )?,
            None,
        )],
    })
}

/// A rank thread's panic as its error, with the first line of the panic's message.
fn panicked(rank: usize, payload: &(dyn std::any::Any + Send)) -> TrainError {
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked".into());
    // libtorch's errors carry a C++ backtrace (escaped): keep the message.
    let first = msg.lines().next().unwrap_or("panicked");
    let first = first.split("\\n").next().unwrap_or(first);
    TrainError::Rank {
        rank,
        message: first.to_string(),
    }
}

/// Pass on what rank 0 sent as an event, keeping the step's figures in `summary`.
fn report(
    cfg: &TrainConfig,
    msg: RankMsg,
    summary: &mut TrainSummary,
    on_event: &mut impl FnMut(&WorkerEvent),
) {
    match msg {
        RankMsg::Step {
            step,
            loss,
            grad_norm,
            lr,
            time_s,
            memory_bytes,
            peak,
            device_memory,
            padded,
        } => {
            let samples_per_s = cfg.global_batch as f64 / time_s.max(1e-9);
            summary.padded_linears = padded;
            summary.losses.push(loss);
            summary.memory_bytes.push(memory_bytes.clone());
            summary.last_step = step;
            on_event(&WorkerEvent::Step {
                step,
                loss,
                grad_norm,
                lr,
                step_time_s: time_s,
                samples_per_s,
                tokens_per_s: samples_per_s * cfg.model.config.seq_len as f64,
                memory_bytes,
                memory_breakdown: peak,
                device_memory: device_memory
                    .iter()
                    .any(|d| !device_memory::is_empty(d))
                    .then_some(device_memory),
            });
        }
        RankMsg::Checkpointing { step } => on_event(&WorkerEvent::Checkpointing { step }),
        RankMsg::Eval {
            step,
            loss,
            samples,
        } => on_event(&WorkerEvent::Eval {
            step,
            loss,
            samples,
        }),
        RankMsg::Checkpoint { step, path, time_s } => on_event(&WorkerEvent::Checkpoint {
            step,
            path: path.display().to_string(),
            write_time_s: time_s,
        }),
    }
}

/// What every process of a multi-process run must agree on, for the join to compare: the
/// model, the plan, the world, the step it starts from and every hyper-parameter the ranks
/// must share. A field's name is what a refusal names ("rank 2 has lr 0.001, rank 0 has …").
fn terms(cfg: &TrainConfig, first_step: u64) -> tcp::Terms {
    let o = &cfg.optim;
    let data = match &cfg.source {
        data::Source::Text { bytes, .. } => format!("{:08x}", crc32fast::hash(bytes)),
        data::Source::Tokens { tokens, .. } => {
            let mut h = crc32fast::Hasher::new();
            for t in tokens.iter() {
                h.update(&t.to_le_bytes());
            }
            format!("{:08x}", h.finalize())
        }
        data::Source::Random => "-".into(),
    };
    // The plan as its file would hold it, without the informational layout and figures: two
    // copies of one plan agree whatever their formatting.
    let plan = osdp_core::plan::PlanFile::new(&cfg.model, "", &cfg.plan, None);
    let plan = format!(
        "{:08x}",
        crc32fast::hash(&serde_json::to_vec(&plan).unwrap_or_default())
    );
    let accumulation =
        osdp_core::plan::accumulation(cfg.global_batch, cfg.world_size, cfg.plan.batch)
            .map_or_else(|e| e, |a| a.to_string());
    tcp::Terms::default()
        .with("model", osdp_core::plan::fingerprint(&cfg.model))
        .with("plan", plan)
        .with("world size", cfg.world_size)
        .with(
            "ranks per node",
            cfg.ranks_per_node.unwrap_or(cfg.world_size),
        )
        .with("device", device_label(cfg.target))
        .with("seed", cfg.seed)
        .with("data", osdp_core::text::printable(cfg.source.label()))
        .with("data checksum", data)
        .with("global batch", cfg.global_batch)
        .with("accumulation", accumulation)
        .with("lr", o.lr)
        .with("beta1", o.beta1)
        .with("beta2", o.beta2)
        .with("eps", o.eps)
        .with("weight decay", o.weight_decay)
        .with("clip norm", o.clip_norm)
        .with("warm-up steps", o.warmup_steps)
        .with("first step", first_step)
        .with("steps", cfg.steps)
        .with("checkpointing", cfg.checkpoint_dir.is_some())
        .with("checkpoint every", cfg.checkpoint_every)
}

/// Whether `world` ranks on `device`, as nodes of `ranks_per_node` (`None`: one node), can
/// run `plan`: the nodes divide the ranks, and a strategy that needs several nodes (hsdp) has
/// them on the CPU backends. Says why not.
pub fn check_plan_nodes(
    model: &ModelSpec,
    plan: &Plan,
    world: usize,
    ranks_per_node: Option<usize>,
    device: tch::Device,
) -> Result<(), String> {
    if let Some(n) = ranks_per_node {
        collective::check_node_size(world, n).map_err(|e| format!("--ranks-per-node: {e}"))?;
    }
    let Some(i) = plan
        .choices
        .iter()
        .position(|c| c.strategy.info().needs == osdp_core::cost::Needs::SeveralNodes)
    else {
        return Ok(());
    };
    let op = &model.ops[i].id;
    if device.is_cuda() {
        return Err(format!(
            "op {op:?} is hsdp, which the GPU trainer does not run yet (its NCCL backend has one \
             communicator, without the node and replica groups hsdp needs); plan with zero3 \
             instead, or train the hsdp plan on the CPU"
        ));
    }
    if ranks_per_node.unwrap_or(world) >= world {
        return Err(format!(
            "op {op:?} is hsdp, which shards inside a node and replicates across nodes, but \
             the {world} ranks are one node: give --ranks-per-node N (N dividing {world} and \
             smaller), or plan for one node"
        ));
    }
    Ok(())
}

/// This process's handle on a multi-process group: NCCL between GPUs, TCP between CPU ranks
/// (arranged in nodes of `ranks_per_node`).
fn join_group(
    m: &tcp::Membership,
    device: tch::Device,
    terms: &tcp::Terms,
    ranks_per_node: usize,
) -> Result<Box<dyn Collective>, TrainError> {
    if device.is_cuda() {
        #[cfg(feature = "cuda")]
        return Ok(Box::new(
            cuda::NcclGroup::join(m, device, terms).map_err(TrainError::Invalid)?,
        ));
        #[cfg(not(feature = "cuda"))]
        return Err(TrainError::Invalid(
            "this osdp-tui was built without the cuda feature".into(),
        ));
    }
    Ok(Box::new(
        tcp::TcpGroup::join(m, terms)
            .and_then(|g| g.with_nodes(ranks_per_node))
            .map_err(TrainError::Invalid)?,
    ))
}

/// The GPU ordinal of local rank `local_rank` when this process sees `count` GPUs: its own
/// when it sees them all, the only one when a launcher gives each process one GPU
/// (`CUDA_VISIBLE_DEVICES` per rank, where `LOCAL_RANK` counts GPUs it cannot see).
pub fn device_ordinal(local_rank: usize, count: usize) -> Option<usize> {
    match count {
        0 => None,
        1 => Some(0),
        _ => (local_rank < count).then_some(local_rank),
    }
}

/// `cpu`, `cpu bf16 mixed`, `cuda bf16 mixed`: what the run computes on, as events report it.
fn device_label(target: Target) -> String {
    let device = if target.device.is_cuda() {
        "cuda"
    } else {
        "cpu"
    };
    match target.numerics {
        exec::Numerics::Fp32 if !target.device.is_cuda() => device.to_string(),
        n => format!("{device} {}", n.name()),
    }
}

fn rank_err(rank: usize) -> impl Fn(exec::ExecError) -> TrainError {
    move |e| TrainError::Rank {
        rank,
        message: e.to_string(),
    }
}

#[allow(clippy::too_many_arguments)]
fn rank_main(
    cfg: &TrainConfig,
    stop: &AtomicBool,
    group: Box<dyn Collective>,
    sampler: &data::Sampler,
    rows: usize,
    steps: std::ops::Range<u64>,
    start: &Start<'_>,
    tx: &mpsc::Sender<RankMsg>,
) -> Result<RankEnd, TrainError> {
    let rank = group.rank();
    let err = rank_err(rank);
    let init = match start {
        Start::Resumed(r) => Init::Restored {
            params: &r.1,
            step: r.0.step,
        },
        Start::Pretrained(weights) => Init::Pretrained { weights },
        Start::Fresh => Init::Fresh { seed: cfg.seed },
    };
    let mut exec =
        Executor::new(&cfg.model, &cfg.plan, group, cfg.target, init, cfg.optim).map_err(&err)?;
    let (mut step, last) = (steps.start, steps.end);
    let mut saved_at = step;
    let mut by_signal = false;
    while step < last {
        // A stop asked of any rank (a signal may reach one process of a multi-process run)
        // stops them all after the same step.
        let flag = if stop.load(Ordering::SeqCst) {
            1.0
        } else {
            0.0
        };
        let stop_now = exec
            .comm()
            .all_reduce(&Tensor::from(flag))
            .map_err(|e| err(e.into()))?
            .double_value(&[])
            > 0.5;
        if stop_now {
            by_signal = true;
            break;
        }
        let batch = sampler.batch(step, rank * rows, rows);
        device_memory::reset_peak(cfg.target.device);
        let t0 = Instant::now();
        let out = exec.train_step(&batch).map_err(&err)?;
        let time_s = t0.elapsed().as_secs_f64();
        step += 1;
        let lr = exec.optim.lr_at(step);
        // Every rank's peak, step time and device figures, so rank 0 reports them all.
        const PER_RANK: usize = 5;
        let mut mine = vec![exec.ledger.peak().total() as f64, time_s];
        mine.extend(device_memory::to_wire(device_memory::read(
            cfg.target.device,
        )));
        let mine = Tensor::from_slice(&mine);
        let all = exec.comm().all_gather(&mine).map_err(|e| err(e.into()))?;
        let all = Vec::<f64>::try_from(all.to_device(tch::Device::Cpu)).unwrap_or_default();
        if rank == 0 {
            let _ = tx.send(RankMsg::Step {
                step,
                loss: out.loss,
                grad_norm: out.grad_norm,
                lr,
                time_s: all.chunks(PER_RANK).map(|c| c[1]).fold(0.0, f64::max),
                memory_bytes: all.chunks(PER_RANK).map(|c| c[0] as u64).collect(),
                peak: exec.ledger.peak(),
                device_memory: all
                    .chunks(PER_RANK)
                    .map(|c| device_memory::from_wire(&c[2..]))
                    .collect(),
                padded: exec.padded_linears(),
            });
        }
        if let Some(ev) = cfg
            .eval
            .as_ref()
            .filter(|e| step % e.every == 0 || step == last)
        {
            held_out(&mut exec, ev, step, tx).map_err(&err)?;
        }
        if cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0 && step < last {
            save(cfg, &exec, step, tx)?;
            saved_at = step;
        }
    }
    if cfg.checkpoint_dir.is_some() && saved_at != step {
        save(cfg, &exec, step, tx)?;
    }
    let params = if cfg.collect_params {
        exec.full_params().map_err(&err)?
    } else {
        Vec::new()
    };
    Ok(RankEnd {
        last_step: step,
        by_signal,
        params: if rank == 0 { params } else { Vec::new() },
    })
}

/// The held-out loss after `step`: this rank's equal share of the samples in micro-batches of
/// the plan's size (every rank runs as many forward passes, so sharded weights are gathered
/// in step), summed over the ranks; rank 0 reports it.
fn held_out(
    exec: &mut Executor,
    ev: &EvalConfig,
    step: u64,
    tx: &mpsc::Sender<RankMsg>,
) -> exec::Result<()> {
    let (rank, world) = (exec.rank(), exec.world());
    let seq = exec.model().config.seq_len as usize;
    let per_rank = ev.samples / world;
    let micro = exec.micro_batch().min(per_rank.max(1));
    let mut sum = 0.0;
    let mut done = 0;
    while done < per_rank {
        let rows = micro.min(per_rank - done);
        let batch = eval::windows(&ev.tokens, seq, rank * per_rank + done, rows);
        sum += exec.forward_only(&batch)?.0 * rows as f64;
        done += rows;
    }
    let total = exec
        .comm()
        .all_reduce(&Tensor::from(sum))?
        .double_value(&[]);
    let samples = per_rank * world;
    if rank == 0 {
        let _ = tx.send(RankMsg::Eval {
            step,
            loss: total / samples.max(1) as f64,
            samples: samples as u64,
        });
    }
    Ok(())
}

/// Every rank's result in rank order, or the error of the first rank that failed for its own
/// reason rather than one merely released ("collective aborted") because another failed.
pub(crate) fn collect_ranks<T>(results: Vec<Result<T, TrainError>>) -> Result<Vec<T>, TrainError> {
    let is_abort = |e: &TrainError| e.to_string().contains("collective aborted");
    let mut ends = Vec::with_capacity(results.len());
    let mut failure: Option<TrainError> = None;
    for r in results {
        match r {
            Ok(end) => ends.push(end),
            Err(e) => {
                if failure
                    .as_ref()
                    .is_none_or(|f| is_abort(f) && !is_abort(&e))
                {
                    failure = Some(e);
                }
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(ends),
    }
}

/// Test hook: `OSDP_FAULT=kill-mid-checkpoint` ends the process after the rank files are
/// written and before the checkpoint is committed, as a crash or `kill -9` would. Built only
/// with feature `fault-injection` (tests); release builds never read `OSDP_FAULT`.
#[cfg(feature = "fault-injection")]
fn fault_requested(what: &str) -> bool {
    env::fault().is_some_and(|v| v == what)
}

/// Without feature `fault-injection` no fault is ever requested: a constant the compiler
/// removes with the code it guards.
#[cfg(not(feature = "fault-injection"))]
const fn fault_requested(_what: &str) -> bool {
    false
}

fn save(
    cfg: &TrainConfig,
    exec: &Executor,
    step: u64,
    tx: &mpsc::Sender<RankMsg>,
) -> Result<(), TrainError> {
    let Some(root) = &cfg.checkpoint_dir else {
        return Ok(());
    };
    let rank = exec.rank();
    let err = rank_err(rank);
    let sync = |exec: &Executor| exec.comm().barrier().map_err(|e| err(e.into()));
    let t0 = Instant::now();
    if rank == 0 {
        let _ = tx.send(RankMsg::Checkpointing { step });
        checkpoint::begin(root, step)?;
    }
    sync(exec)?;
    let tmp = checkpoint::tmp_dir(root, step);
    checkpoint::write_rank(&tmp, rank, &exec.checkpoint_tensors())?;
    sync(exec)?;
    if rank == 0 {
        if fault_requested("kill-mid-checkpoint") {
            std::process::exit(137);
        }
        let manifest = checkpoint::Manifest {
            version: checkpoint::CHECKPOINT_FORMAT_VERSION,
            model: cfg.model.name.clone(),
            model_fingerprint: osdp_core::plan::fingerprint(&cfg.model),
            step,
            seed: cfg.seed,
            global_batch: cfg.global_batch,
            data: cfg.source.label().to_string(),
            world_size: exec.world(),
            files: Vec::new(),
            params: checkpoint::params_of(&cfg.model),
            manifest_crc32: None,
        };
        let path = checkpoint::commit(root, &tmp, manifest)?;
        let _ = tx.send(RankMsg::Checkpoint {
            step,
            path,
            time_s: t0.elapsed().as_secs_f64(),
        });
    }
    sync(exec)
}
