//! `osdp-tui calibrate`: measure this machine with the trainer's own kernels and write a layout
//! the planner prices with. Per operator kind a curve of forward and backward times against
//! work (timed inside real training steps of small models at growing micro-batches, all ranks
//! running at once as in training), the optimizer's cost per tensor and per parameter, memory
//! bandwidth, the collectives' latency and bandwidth, and the runtime's fixed memory.

pub mod gpu;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::collective::Collective;
use super::exec::Profile;
use super::exec::{adamw_update, OptimConfig, Target};
use super::measure::{measure_plan, median, on_rank_threads, threads_per_rank, StepSample, Timing};
use super::TrainError;
use osdp_core::cluster::calibration::{
    fit_ring, Calibration, CollectivePoint, CurvePoint, OptimizerPoint,
};
use osdp_core::cluster::{DeviceKind, Figure, HostSpec, Layout, LinkKind, LinkSpec};
use osdp_core::cost::{self, Machine, Strategy};
use osdp_core::model::ModelSpec;

/// GPT-2- and LLaMA-shaped models small enough to time at many micro-batches: between them
/// every operator kind the trainer runs, at the widths small models use.
const GENERIC_MODELS: [(&str, &str); 2] = [
    (
        "calibration-gpt",
        r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 128, "n_embd": 256,
            "n_layer": 2, "n_head": 4, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-05, "tie_word_embeddings": true}"#,
    ),
    (
        "calibration-llama",
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 256,
            "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-05, "tie_word_embeddings": false}"#,
    ),
];

/// The built-in models `calibrate` times when no `--model` is given.
pub fn generic_models() -> Vec<ModelSpec> {
    GENERIC_MODELS
        .iter()
        .filter_map(|(name, config)| {
            let opts = osdp_core::model::hf::ImportOptions {
                name: Some((*name).to_string()),
                ..Default::default()
            };
            osdp_core::model::hf::import_str(Path::new(name), config, &opts).ok()
        })
        .collect()
}

pub struct CalibrateConfig {
    /// Ranks of the layout written (and run concurrently while timing).
    pub ranks: usize,
    pub models: Vec<ModelSpec>,
    /// Largest micro-batch timed per model.
    pub max_batch: u64,
    /// Stop growing a model's micro-batch once one step takes longer than this.
    pub max_step_s: f64,
    /// Timed steps per micro-batch (after one warm-up step).
    pub steps: usize,
    /// Layout the measurements are written into (name, memory, description are kept).
    pub base: Layout,
    pub command: String,
}

/// What `calibrate` reports as it goes: a fraction done and what it is doing.
pub type Progress<'a> = &'a mut dyn FnMut(f64, &str);

pub fn calibrate(cfg: &CalibrateConfig, progress: Progress<'_>) -> Result<Layout, TrainError> {
    let ranks = cfg.ranks.max(1);
    let started = Instant::now();
    let overhead_bytes = resident_bytes();
    let ladder: Vec<u64> = std::iter::successors(Some(1u64), |b| Some(b * 2))
        .take_while(|&b| b <= cfg.max_batch.max(1))
        .collect();
    // Work items for the progress bar: each (model, batch) pair, the ZeRO-3 runs that time the
    // collectives, the split-linear runs, then five micro-benchmarks.
    let total = (cfg.models.len() * (ladder.len() + 2) + 5) as f64;
    let mut done = 0.0;

    let (mut raw, others) = time_kernels(cfg, ranks, &ladder, progress, &mut done, total)?;
    progress(done / total, "optimizer");
    let optimizer = measure_optimizer(ranks)?;
    done += 1.0;
    progress(done / total, "memory bandwidth");
    let bandwidth = measure_bandwidth(ranks)?;
    done += 1.0;
    let mut phase = 0.0;
    let host = measure_host(Device::Cpu, ranks, &mut |what| {
        progress((done + phase) / total, what);
        phase += 1.0;
    })?;
    done += 2.0;
    let calls =
        time_collectives_and_splits(cfg, ranks, &ladder, &mut raw, progress, &mut done, total)?;
    let kernels: Curves = raw.into_iter().map(|(k, v)| (k, fold_points(v))).collect();
    let collectives = bin_collectives(calls);
    progress(done / total, "writing the layout");

    let layout = measured_layout(
        cfg,
        ranks,
        Measured {
            kernels,
            collectives,
            optimizer,
            bandwidth,
            host,
            overhead_bytes,
            others,
        },
    )?;
    progress(
        1.0,
        &format!("done in {:.0} s", started.elapsed().as_secs_f64()),
    );
    Ok(layout)
}

/// Points of curves by kernel key (`linear`, `linear/split`, …).
type Curves = BTreeMap<String, Vec<CurvePoint>>;

/// The kernel curves' raw points by kernel key: every model trained under dp at each
/// micro-batch of `ladder` (until a step takes longer than `max_step_s`), each op's forward and
/// backward timed. Also, per step, what the step spent beyond rank 0's operators, collectives
/// and optimizer.
fn time_kernels(
    cfg: &CalibrateConfig,
    ranks: usize,
    ladder: &[u64],
    progress: Progress<'_>,
    done: &mut f64,
    total: f64,
) -> Result<(Curves, Vec<f64>), TrainError> {
    let mut raw: Curves = BTreeMap::new();
    let mut others: Vec<f64> = Vec::new();
    for model in &cfg.models {
        let machine = Machine::new(&cfg.base, model);
        let inputs = cost::input_bytes_per_sample(model);
        for (li, &batch) in ladder.iter().enumerate() {
            progress(
                *done / total,
                &format!("kernels: {} at micro-batch {batch}", model.name),
            );
            let plan = osdp_core::plan::uniform_plan(model, Strategy::Dp, batch);
            let samples = measure_plan(
                model,
                &plan,
                Target::CPU,
                Timing::seeded(ranks, 1, cfg.steps),
                |_| {},
            )?;
            let mut slowest = 0.0f64;
            for (i, op) in model.ops.iter().enumerate() {
                let work = cost::op_work(op, inputs[i], &machine, batch);
                raw.entry(cost::kernel_key(model, op).to_string())
                    .or_default()
                    .push(CurvePoint {
                        work,
                        fwd_s: slowest_rank_median(&samples, &|p| p.fwd_s[i]),
                        bwd_s: slowest_rank_median(&samples, &|p| p.bwd_s[i]),
                    });
            }
            for s in &samples {
                slowest = slowest.max(s.step_s);
                // What the step (the slowest rank's) spends beyond rank 0's operators,
                // collectives and optimizer: bookkeeping, and the ranks waiting for each other.
                let p = &s.profiles[0];
                let ops: f64 = p.fwd_s.iter().chain(&p.bwd_s).sum();
                others.push((s.step_s - ops - p.optimizer_s - p.sync_s).max(0.0));
            }
            *done += 1.0;
            if slowest > cfg.max_step_s {
                *done += (ladder.len() - li - 1) as f64;
                break;
            }
        }
    }
    Ok((raw, others))
}

/// Per model: the collectives of ZeRO-3 steps (with more than one rank), returned as
/// `(bytes, seconds)` calls, and the split linears' points, added to `raw` as `linear/split`.
fn time_collectives_and_splits(
    cfg: &CalibrateConfig,
    ranks: usize,
    ladder: &[u64],
    raw: &mut Curves,
    progress: Progress<'_>,
    done: &mut f64,
    total: f64,
) -> Result<Vec<(f64, f64)>, TrainError> {
    let mut calls: Vec<(f64, f64)> = Vec::new();
    for model in &cfg.models {
        progress(
            *done / total,
            &format!("collectives: {} under ZeRO-3", model.name),
        );
        if ranks > 1 {
            let plan = osdp_core::plan::uniform_plan(model, Strategy::Zero3, 1);
            for s in measure_plan(
                model,
                &plan,
                Target::CPU,
                Timing::seeded(ranks, 1, cfg.steps),
                |_| {},
            )? {
                for p in &s.profiles {
                    calls.extend_from_slice(&p.collectives);
                }
            }
        }
        *done += 1.0;
        progress(
            *done / total,
            &format!(
                "split linears: {} under ZeRO-3 in {SPLIT} slices",
                model.name
            ),
        );
        let slices = time_split_linears(model, &cfg.base, ranks, ladder, cfg)?;
        if !slices.is_empty() {
            raw.entry("linear/split".to_string())
                .or_default()
                .extend(slices);
        }
        *done += 1.0;
    }
    Ok(calls)
}

/// Everything `calibrate` measured, for [`measured_layout`] to write down.
struct Measured {
    kernels: Curves,
    collectives: Vec<CollectivePoint>,
    optimizer: Vec<OptimizerPoint>,
    /// Bytes per second of a tensor copy, all ranks copying at once.
    bandwidth: f64,
    host: HostMeasurement,
    /// Resident bytes of the process before any tensor.
    overhead_bytes: Option<u64>,
    /// Per step, seconds beyond the operators, collectives and optimizer.
    others: Vec<f64>,
}

/// `cfg.base` with what was measured written in, every figure saying how it was measured;
/// checked to be a valid layout.
fn measured_layout(
    cfg: &CalibrateConfig,
    ranks: usize,
    measured: Measured,
) -> Result<Layout, TrainError> {
    let Measured {
        kernels,
        collectives,
        optimizer,
        bandwidth,
        host,
        overhead_bytes,
        others,
    } = measured;
    let measured_at = now_utc();
    let threads = threads_per_rank(ranks);
    let device = format!(
        "{}, {threads} thread(s) per rank, {ranks} rank(s)",
        cpu_model()
    );
    let measured =
        |what: &str| format!("measured by `osdp-tui calibrate` on {measured_at}: {what}");
    let mut layout = cfg.base.clone();
    layout.gpus_per_node = ranks as u32;
    layout.nodes = 1;
    layout.inter_node = None;
    layout.device.kind = DeviceKind::Cpu;
    layout.device.model = cpu_model();
    let best_linear = kernels
        .get("linear")
        .and_then(|pts| {
            pts.iter()
                .map(|p| p.work / p.fwd_s.max(1e-12))
                .max_by(f64::total_cmp)
        })
        .unwrap_or(1e9);
    layout.device.dense_tflops.fp32 = Some(Figure {
        value: best_linear / 1e12,
        source: measured("fastest forward linear of the curve, per rank"),
    });
    layout.device.memory_bandwidth_gb_per_s = Figure {
        value: bandwidth / 1e9,
        source: measured("tensor copy, read + write bytes, all ranks copying at once"),
    };
    if let Some(bytes) = overhead_bytes {
        let gib = bytes as f64 / f64::from(1u32 << 30) / ranks as f64;
        if gib > 0.0 && gib < layout.device.memory_gib.value {
            layout.runtime_overhead_gib = Figure {
                value: gib,
                source: measured("resident memory of the process with libtorch loaded, before any tensor, per rank"),
            };
        }
    }
    let timed: Vec<(f64, f64)> = collectives.iter().map(|c| (c.bytes, c.seconds)).collect();
    if let Some((alpha, beta)) = fit_ring(ranks as u32, &timed) {
        layout.intra_node = LinkSpec {
            kind: LinkKind::SharedMemory,
            bus_bandwidth_gb_per_s: Figure {
                value: beta / 1e9,
                source: measured(
                    "all-gathers and reduce-scatters inside ZeRO-3 training steps, α–β fit over message sizes",
                ),
            },
            latency_us: Figure {
                value: (alpha * 1e6).max(0.1),
                source: measured(
                    "all-gathers and reduce-scatters inside ZeRO-3 training steps, α–β fit over message sizes",
                ),
            },
            nics_per_node: None,
        };
    }
    layout.host = Some(host_spec(&layout, &host, &measured_at));
    let mut other = others;
    layout.calibration = Some(Calibration {
        measured_at,
        device,
        command: cfg.command.clone(),
        ranks: ranks as u32,
        kernels,
        optimizer,
        step_overhead_s: median(&mut other),
        cpu_steal_fraction: None,
        collectives,
    });
    osdp_core::cluster::validate_layout(&layout)
        .map_err(|p| TrainError::Invalid(format!("the measured layout is not valid: {p}")))?;
    Ok(layout)
}

/// Per rank the median over `samples` of `f`, and the largest of those: the ranks meet at every
/// collective, so a step goes at the pace of the slowest (one core of a VM is often slower).
fn slowest_rank_median(samples: &[StepSample], f: &dyn Fn(&Profile) -> f64) -> f64 {
    let ranks = samples.first().map_or(0, |s| s.profiles.len());
    (0..ranks)
        .map(|r| {
            let mut v: Vec<f64> = samples.iter().map(|s| f(&s.profiles[r])).collect();
            median(&mut v)
        })
        .fold(0.0, f64::max)
}

/// Slices a split linear is cut into while calibrating.
const SPLIT: u32 = 4;

/// Per-slice times of linears split in [`SPLIT`] column slices under ZeRO-3, as the trainer
/// runs them (a narrowed input, a partial product added into the output, the input gradient
/// put back together), by each slice's work, with the slices' collectives taken out (they are
/// priced as collectives): the `linear/split` curve. Every op the planner may split so is
/// split; micro-batches 1, 4, 16 of the ladder, stopping early as the kernel runs do; no points
/// when the trainer cannot run that plan.
fn time_split_linears(
    model: &ModelSpec,
    base: &Layout,
    ranks: usize,
    ladder: &[u64],
    cfg: &CalibrateConfig,
) -> Result<Vec<CurvePoint>, TrainError> {
    let machine = Machine::new(base, model);
    let graph = cost::OpGraph::of(model);
    let split = cost::Choice::zero3(SPLIT, SPLIT);
    let k = f64::from(SPLIT);
    let mut points = Vec::new();
    for &batch in ladder.iter().filter(|b| [1, 4, 16].contains(*b)) {
        let bases = graph.bases(model, &machine, batch);
        let mut plan = osdp_core::plan::uniform_plan(model, Strategy::Zero3, batch);
        let splits: Vec<usize> = (0..bases.len())
            .filter(|&i| cost::choices(&bases[i], &machine, SPLIT).contains(&split))
            .collect();
        for &i in &splits {
            plan.choices[i] = split;
        }
        if super::exec::check_runnable(model, &plan).is_err() {
            break;
        }
        let samples = measure_plan(
            model,
            &plan,
            Target::CPU,
            Timing::seeded(ranks, 1, cfg.steps),
            |_| {},
        )?;
        for &i in &splits {
            points.push(CurvePoint {
                work: bases[i].work / k,
                fwd_s: slowest_rank_median(&samples, &|p| (p.fwd_s[i] - p.fwd_coll_s[i]).max(0.0))
                    / k,
                bwd_s: slowest_rank_median(&samples, &|p| (p.bwd_s[i] - p.bwd_coll_s[i]).max(0.0))
                    / k,
            });
        }
        if samples.iter().any(|s| s.step_s > cfg.max_step_s) {
            break;
        }
    }
    Ok(points)
}

/// Sort by work and merge points within 2 % of each other's work (the same kernel size met in
/// several places), so that the curve's work strictly increases.
fn fold_points(mut pts: Vec<CurvePoint>) -> Vec<CurvePoint> {
    pts.retain(|p| p.work > 0.0);
    pts.sort_by(|a, b| a.work.total_cmp(&b.work));
    let mut out: Vec<CurvePoint> = Vec::new();
    let mut group: Vec<CurvePoint> = Vec::new();
    let flush = |group: &mut Vec<CurvePoint>, out: &mut Vec<CurvePoint>| {
        if group.is_empty() {
            return;
        }
        let n = group.len() as f64;
        let work = group.iter().map(|p| p.work).sum::<f64>() / n;
        let mut f: Vec<f64> = group.iter().map(|p| p.fwd_s).collect();
        let mut b: Vec<f64> = group.iter().map(|p| p.bwd_s).collect();
        out.push(CurvePoint {
            work,
            fwd_s: median(&mut f),
            bwd_s: median(&mut b),
        });
        group.clear();
    };
    for p in pts {
        if group.first().is_some_and(|g| p.work > g.work * 1.02) {
            flush(&mut group, &mut out);
        }
        group.push(p);
    }
    flush(&mut group, &mut out);
    out.truncate(osdp_core::cluster::calibration::MAX_POINTS);
    out
}

/// Run `f` on every rank thread at once; every rank's result.
fn on_ranks<T: Send>(
    ranks: usize,
    f: impl Fn(&dyn Collective) -> Result<T, TrainError> + Sync,
) -> Result<Vec<T>, TrainError> {
    on_rank_threads(ranks, |g| f(&g))
}

fn aborted(e: super::collective::Aborted) -> TrainError {
    TrainError::Invalid(e.to_string())
}

/// Median seconds of `reps` runs of `f` after one warm-up, all ranks starting together.
fn timed(
    comm: &dyn Collective,
    reps: usize,
    mut f: impl FnMut() -> Result<(), TrainError>,
) -> Result<f64, TrainError> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        comm.barrier().map_err(aborted)?;
        let t0 = Instant::now();
        f()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(&mut times))
}

/// One parameter tensor's optimizer work as the executor does it — a zeroed gradient buffer,
/// its square-sum for the global norm, the AdamW update — at sizes from a bias to a large
/// weight: small tensors pay fixed costs, large ones stream from memory.
fn measure_optimizer(ranks: usize) -> Result<Vec<OptimizerPoint>, TrainError> {
    let per_rank = on_ranks(ranks, |comm| {
        let o = OptimConfig::default();
        let opts = (Kind::Float, Device::Cpu);
        let mut out = Vec::new();
        for n in [64i64, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22] {
            let mut p = Tensor::randn([n], opts);
            let g = Tensor::randn([n], opts);
            let mut m = Tensor::zeros([n], opts);
            let mut v = Tensor::zeros([n], opts);
            let reps = if n >= 1 << 20 { 5 } else { 50 };
            let seconds = timed(comm, reps, || {
                let z = Tensor::zeros([n], opts);
                let sq = g.square().sum(Kind::Double).double_value(&[]);
                adamw_update(&mut p, &g, &mut m, &mut v, &o, 1e-3, 0.1, 1.0, (0.1, 0.001));
                drop(z);
                std::hint::black_box(sq);
                Ok(())
            })?;
            out.push(OptimizerPoint {
                params: n as f64,
                seconds,
            });
        }
        Ok(out)
    })?;
    // The slowest rank's time per size.
    let mut points = per_rank.first().cloned().unwrap_or_default();
    for rank in &per_rank {
        for (p, q) in points.iter_mut().zip(rank) {
            p.seconds = p.seconds.max(q.seconds);
        }
    }
    Ok(points)
}

/// Bytes per second one rank moves through memory (read + write) while every rank copies.
fn measure_bandwidth(ranks: usize) -> Result<f64, TrainError> {
    let per_rank = on_ranks(ranks, |comm| {
        let n = 1i64 << 24; // 64 MiB of fp32
        let src = Tensor::ones([n], (Kind::Float, Device::Cpu));
        let mut dst = Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let t = timed(comm, 5, || {
            dst.copy_(&src);
            Ok(())
        })?;
        Ok(2.0 * 4.0 * n as f64 / t)
    })?;
    // The slowest rank's.
    Ok(per_rank.into_iter().fold(f64::INFINITY, f64::min))
}

/// Parameters of the host AdamW and bytes of the host-link copies `calibrate` times: 64 MiB per
/// fp32 tensor, far past any CPU's caches, so the rates are memory's (as a large model's are).
const HOST_ELEMENTS: i64 = 1 << 24;

/// The host side of offloading, timed with the trainer's own code paths: what a layout's
/// `host` section prices the CPU AdamW step and the device↔host copies with.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMeasurement {
    /// Parameters per second of the offloaded optimizer step on one thread, alone.
    pub adam_one_thread: f64,
    /// Parameters per second per core with every core busy: each rank stepping its own
    /// tensors on its share of the threads, all at once (the slowest rank's rate per thread).
    pub adam_per_core: f64,
    /// Threads that ran at once for `adam_per_core`.
    pub threads: usize,
    /// Bytes per second of one copy between device and host memory, per rank, the slower
    /// direction.
    pub link_bytes_per_s: f64,
    /// How the link was measured, in words.
    pub link_how: String,
}

/// Time the host side of offloading on this machine: the CPU AdamW step an offloaded unit
/// takes in `exec` (its gradient's square-sum for the global norm, [`adamw_update`] on the
/// host tensors, the host gradient buffer zeroed), on one thread and then on every core, and
/// the copies between `device` and host memory. On the CPU (where "device" and host are both
/// RAM, kept in separate tensors as the executor keeps them) a tensor copy on each of `ranks`
/// ranks at once; on a CUDA device, pinned host memory to and from the GPU (run only when a
/// GPU is present). `progress` is told each phase.
pub fn measure_host(
    device: Device,
    ranks: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<HostMeasurement, TrainError> {
    let ranks = ranks.max(1);
    let threads = threads_per_rank(ranks);
    progress(&format!(
        "host: CPU AdamW, one thread, then {ranks} rank(s) × {threads} thread(s)"
    ));
    let before = tch::get_num_threads();
    tch::set_num_threads(1);
    let one = host_adam_seconds(None);
    tch::set_num_threads(before);
    let one = one?;
    let per_rank = on_ranks(ranks, |comm| host_adam_seconds(Some(comm)))?;
    tch::set_num_threads(before);
    let slowest = per_rank.into_iter().fold(0.0, f64::max);
    let n = HOST_ELEMENTS as f64;
    progress(&match device {
        Device::Cpu => "host: link, tensor copies on every rank at once".to_string(),
        d => format!("host: link, pinned host memory to and from {d:?}"),
    });
    let (link_bytes_per_s, link_how) = match device {
        Device::Cpu => {
            let per_rank = on_ranks(ranks, |comm| {
                let src = Tensor::randn([HOST_ELEMENTS], (Kind::Float, Device::Cpu));
                let mut dst = Tensor::zeros([HOST_ELEMENTS], (Kind::Float, Device::Cpu));
                timed(comm, 5, || {
                    dst.copy_(&src);
                    Ok(())
                })
            })?;
            let t = per_rank.into_iter().fold(0.0, f64::max);
            (
                4.0 * n / t,
                format!(
                    "a 64 MiB fp32 copy between a rank's \"device\" and host tensors (`copy_`, as \
                     the executor's CPU path copies), {ranks} rank(s) at once, the slowest"
                ),
            )
        }
        Device::Cuda(index) => {
            let (h2d, d2h) = cuda_link_seconds(index)?;
            (
                4.0 * n / h2d.max(d2h),
                format!(
                    "64 MiB fp32 copies between pinned host memory and GPU {index}: {:.1} GB/s \
                     host→device, {:.1} GB/s device→host, the slower",
                    4.0 * n / h2d / 1e9,
                    4.0 * n / d2h / 1e9
                ),
            )
        }
        d => {
            return Err(TrainError::Invalid(format!(
                "calibrate: the host link to {d:?} cannot be measured"
            )))
        }
    };
    Ok(HostMeasurement {
        adam_one_thread: n / one,
        adam_per_core: n / slowest / threads as f64,
        threads: ranks * threads,
        link_bytes_per_s,
        link_how,
    })
}

/// Median seconds of the offloaded unit's CPU step on [`HOST_ELEMENTS`] parameters, as `exec`
/// runs it on host tensors: the gradient's square-sum, AdamW, the host gradient buffer zeroed.
/// With `comm` every rank starts each repetition together.
fn host_adam_seconds(comm: Option<&dyn Collective>) -> Result<f64, TrainError> {
    let o = OptimConfig::default();
    let opts = (Kind::Float, Device::Cpu);
    let mut p = Tensor::randn([HOST_ELEMENTS], opts);
    let mut g = Tensor::randn([HOST_ELEMENTS], opts);
    let mut m = Tensor::zeros([HOST_ELEMENTS], opts);
    let mut v = Tensor::zeros([HOST_ELEMENTS], opts);
    let mut step = || -> Result<(), TrainError> {
        let sq = g.square().sum(Kind::Double).double_value(&[]);
        adamw_update(&mut p, &g, &mut m, &mut v, &o, 1e-3, 0.1, 1.0, (0.1, 0.001));
        let _ = g.zero_();
        std::hint::black_box(sq);
        Ok(())
    };
    match comm {
        Some(comm) => timed(comm, 5, step),
        None => {
            step()?;
            let mut times = Vec::with_capacity(5);
            for _ in 0..5 {
                let t0 = Instant::now();
                step()?;
                times.push(t0.elapsed().as_secs_f64());
            }
            Ok(median(&mut times))
        }
    }
}

/// Median seconds of a [`HOST_ELEMENTS`] fp32 copy from pinned host memory to CUDA device
/// `index` and back: (host→device, device→host). Refused without a usable GPU.
fn cuda_link_seconds(index: usize) -> Result<(f64, f64), TrainError> {
    if !tch::Cuda::is_available() || index as i64 >= tch::Cuda::device_count() {
        return Err(TrainError::Invalid(format!(
            "calibrate: no CUDA device {index} to measure the host link to"
        )));
    }
    let gpu = Device::Cuda(index);
    let mut host = Tensor::randn([HOST_ELEMENTS], (Kind::Float, Device::Cpu)).pin_memory(gpu);
    let mut dev = Tensor::zeros([HOST_ELEMENTS], (Kind::Float, gpu));
    let time = |f: &mut dyn FnMut()| {
        f();
        tch::Cuda::synchronize(index as i64);
        let mut times = Vec::with_capacity(10);
        for _ in 0..10 {
            let t0 = Instant::now();
            f();
            tch::Cuda::synchronize(index as i64);
            times.push(t0.elapsed().as_secs_f64());
        }
        median(&mut times)
    };
    let h2d = time(&mut || dev.copy_(&host));
    let d2h = time(&mut || host.copy_(&dev));
    Ok((h2d, d2h))
}

/// `layout`'s `host` section with what [`measure_host`] measured: the link and the AdamW rate
/// per core (all cores busy; the one-thread rate in its source). Host memory is the layout's
/// where it has it (a budget choice), else this machine's (`/proc/meminfo`; on a CPU layout
/// less what its ranks' "device" memory takes of the same RAM); cores are this machine's.
pub fn host_spec(layout: &Layout, host: &HostMeasurement, measured_at: &str) -> HostSpec {
    let measured =
        |what: &str| format!("measured by `osdp-tui calibrate` on {measured_at}: {what}");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let memory = layout
        .host
        .as_ref()
        .map(|h| h.memory_gib_per_node.clone())
        .or_else(|| {
            let total = mem_total_gib()?;
            Some(match layout.device.kind {
                DeviceKind::Cpu => {
                    let ranks = f64::from(layout.gpus_per_node.max(1));
                    let left = total - ranks * layout.device.memory_gib.value;
                    if left >= 1.0 {
                        Figure {
                            value: left,
                            source: format!(
                                "this machine's {total:.1} GiB (/proc/meminfo) less what its \
                                 {ranks} ranks' device memory takes of the same RAM"
                            ),
                        }
                    } else {
                        Figure {
                            value: total / 4.0,
                            source: format!(
                                "a quarter of this machine's {total:.1} GiB (/proc/meminfo): \
                                 the ranks' device memory takes the rest of the same RAM"
                            ),
                        }
                    }
                }
                DeviceKind::Gpu => Figure {
                    value: total,
                    source: format!("this machine's {total:.1} GiB (/proc/meminfo)"),
                },
            })
        })
        .unwrap_or(Figure {
            value: 8.0,
            source: "choice: 8 GiB (this machine's memory could not be read)".into(),
        });
    let cores = match &layout.host {
        Some(h) if h.cpu_cores_per_node.value == cores => h.cpu_cores_per_node.clone(),
        _ => Figure {
            value: cores,
            source: format!("this machine's {cores} cores (available parallelism)"),
        },
    };
    HostSpec {
        memory_gib_per_node: memory,
        link_gb_per_s: Figure {
            value: host.link_bytes_per_s / 1e9,
            source: measured(&host.link_how),
        },
        cpu_cores_per_node: cores,
        adam_mparams_per_s_per_core: Figure {
            value: host.adam_per_core / 1e6,
            source: measured(&format!(
                "the offloaded CPU step (norm square-sum, AdamW, gradient buffer zeroed) on 16.8 M \
                 fp32 parameters per rank, {} threads at once, per thread; {:.0} M/s on one \
                 thread alone",
                host.threads,
                host.adam_one_thread / 1e6
            )),
        },
    }
}

/// This machine's memory in GiB (Linux `MemTotal`).
fn mem_total_gib() -> Option<f64> {
    let kib = super::measure::meminfo_kib("MemTotal")?;
    Some(kib as f64 / f64::from(1u32 << 20))
}

/// Collective calls grouped by size (within a factor of 1.5), the median time of each group.
fn bin_collectives(mut calls: Vec<(f64, f64)>) -> Vec<CollectivePoint> {
    calls.retain(|c| c.0 > 0.0);
    calls.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = Vec::new();
    let mut i = 0;
    while i < calls.len() {
        let start = calls[i].0;
        let mut j = i;
        while j < calls.len() && calls[j].0 <= start * 1.5 {
            j += 1;
        }
        let group = &calls[i..j];
        let mut secs: Vec<f64> = group.iter().map(|c| c.1).collect();
        let mut bytes: Vec<f64> = group.iter().map(|c| c.0).collect();
        out.push(CollectivePoint {
            bytes: median(&mut bytes),
            seconds: median(&mut secs),
            calls: group.len() as u64,
        });
        i = j;
    }
    out.truncate(osdp_core::cluster::calibration::MAX_POINTS);
    out
}

/// Resident memory of this process now (Linux), in bytes.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH))
}

/// Now in UTC, RFC 3339 to the second.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    osdp_core::units::rfc3339(secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use osdp_core::model::OpKind;

    #[test]
    fn points_of_the_same_size_merge_and_work_strictly_increases() {
        let p = |work: f64, t: f64| CurvePoint {
            work,
            fwd_s: t,
            bwd_s: 2.0 * t,
        };
        let folded = fold_points(vec![
            p(100.0, 3.0),
            p(1.0, 1.0),
            p(101.0, 5.0),
            p(100.5, 4.0),
        ]);
        assert_eq!(folded.len(), 2);
        assert_eq!(folded[0], p(1.0, 1.0));
        assert!((folded[1].work - 100.5).abs() < 1e-9);
        assert_eq!(folded[1].fwd_s, 4.0);
        assert_eq!(folded[1].bwd_s, 8.0);
    }

    #[test]
    fn collective_calls_are_grouped_by_size() {
        let calls = vec![(1000.0, 3.0), (1200.0, 1.0), (1100.0, 2.0), (1e6, 9.0)];
        let pts = bin_collectives(calls);
        assert_eq!(pts.len(), 2);
        assert_eq!(
            (pts[0].bytes, pts[0].seconds, pts[0].calls),
            (1100.0, 2.0, 3)
        );
        assert_eq!((pts[1].bytes, pts[1].seconds, pts[1].calls), (1e6, 9.0, 1));
    }

    #[test]
    fn the_generic_models_cover_every_kind_the_trainer_runs() {
        let models = generic_models();
        assert_eq!(models.len(), 2);
        let kinds: std::collections::BTreeSet<OpKind> = models
            .iter()
            .flat_map(|m| m.ops.iter().map(|o| o.kind))
            .collect();
        // `module` ops (models described from PyTorch) are not run by this trainer.
        for k in OpKind::ALL.into_iter().filter(|&k| k != OpKind::Module) {
            assert!(kinds.contains(&k), "{k:?} is not timed");
        }
    }

    #[test]
    fn dates_are_rfc3339() {
        let d = now_utc();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.starts_with("20") && d.ends_with('Z') && d.as_bytes()[10] == b'T');
    }
}
