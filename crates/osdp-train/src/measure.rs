//! Timed training steps for `calibrate` and `validate`: a plan run on rank threads with the
//! executor's profiler on, every rank's timings and memory peak kept per step.

use std::time::Instant;

use super::collective::{Collective, LocalGroup};
use super::data::{Sampler, Source};
use super::exec::{Executor, Init, OptimConfig, Profile, Target};
use super::memory::Breakdown;
use super::TrainError;
use osdp_core::model::ModelSpec;
use osdp_core::plan::Plan;

/// One measured step.
#[derive(Debug, Clone)]
pub struct StepSample {
    /// The step's wall time: the slowest rank's (ranks wait for each other in collectives).
    pub step_s: f64,
    /// Per rank.
    pub profiles: Vec<Profile>,
    /// Per rank: the ledger's peak and what it held then.
    pub peaks: Vec<Breakdown>,
}

/// One rank's steps: time, profile, memory peak.
type RankSteps = Vec<(f64, Profile, Breakdown)>;

/// The cores this process may run threads on.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads for libtorch's intra-op pool when `ranks` ranks share this machine's cores.
pub fn threads_per_rank(ranks: usize) -> usize {
    (cores() / ranks.max(1)).max(1)
}

/// Most ranks one process runs as threads, per core: more only wait for each other, and
/// thousands of threads exhaust the process before the first step.
pub const RANK_THREADS_PER_CORE: usize = 8;

/// The most ranks this process runs as threads: [`RANK_THREADS_PER_CORE`] per core.
pub fn max_rank_threads() -> usize {
    cores() * RANK_THREADS_PER_CORE
}

/// Why `ranks` rank threads are too many for this machine, if they are (the caller says what
/// asked for them and what to do instead).
pub fn check_rank_threads(ranks: usize) -> Result<(), String> {
    let most = max_rank_threads();
    if ranks <= most {
        return Ok(());
    }
    Err(format!(
        "{ranks} ranks as threads of one process are too many here: at most {most} \
         ({RANK_THREADS_PER_CORE} per core, {} core(s))",
        cores()
    ))
}

/// The memory this machine can give a new workload without swapping, in bytes (Linux
/// `MemAvailable`); `None` where the kernel does not say.
pub fn available_memory_bytes() -> Option<u64> {
    meminfo_kib("MemAvailable").map(|kib| kib.saturating_mul(1024))
}

/// Field `key` of `/proc/meminfo`, in KiB.
pub(crate) fn meminfo_kib(key: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let rest = info
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// Run `f` on `ranks` rank threads of one [`LocalGroup`] at once, libtorch's threads shared
/// out among them; every rank's result in rank order. A rank that fails releases the others,
/// and the error reported is the one that failed for its own reason.
pub fn on_rank_threads<T: Send>(
    ranks: usize,
    f: impl Fn(LocalGroup) -> Result<T, TrainError> + Sync,
) -> Result<Vec<T>, TrainError> {
    on_rank_threads_in_nodes(ranks, ranks, f)
}

/// [`on_rank_threads`] with the ranks arranged as nodes of `ranks_per_node` (for hsdp).
pub fn on_rank_threads_in_nodes<T: Send>(
    ranks: usize,
    ranks_per_node: usize,
    f: impl Fn(LocalGroup) -> Result<T, TrainError> + Sync,
) -> Result<Vec<T>, TrainError> {
    if ranks == 0 {
        return Err(TrainError::Invalid("at least one rank is needed".into()));
    }
    check_rank_threads(ranks).map_err(TrainError::Invalid)?;
    let groups = LocalGroup::with_nodes(ranks, ranks_per_node).map_err(TrainError::Invalid)?;
    tch::set_num_threads(threads_per_rank(ranks) as i32);
    let results: Vec<Result<T, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let f = &f;
                scope.spawn(move || {
                    let abort = group.abort_handle();
                    let rank = group.rank();
                    f(group).map_err(|e| {
                        abort.abort(&e.to_string());
                        match e {
                            TrainError::Rank { .. } => e,
                            other => TrainError::Rank {
                                rank,
                                message: other.to_string(),
                            },
                        }
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(TrainError::Invalid("a rank thread panicked".into())))
            })
            .collect()
    });
    super::collect_ranks(results)
}

/// What [`measure_plan`] runs: ranks (threads), untimed and timed steps, and the weights
/// (a Hugging Face checkpoint's, else seeded).
#[derive(Clone, Copy)]
pub struct Timing<'a> {
    pub ranks: usize,
    pub warmup: usize,
    pub steps: usize,
    pub weights: Option<&'a crate::hf_weights::HfWeights>,
}

impl Timing<'_> {
    /// `ranks`, `warmup` and `steps` with seeded weights.
    pub fn seeded(ranks: usize, warmup: usize, steps: usize) -> Timing<'static> {
        Timing {
            ranks,
            warmup,
            steps,
            weights: None,
        }
    }
}

/// Run `warmup` untimed and then `steps` timed steps of `plan` on `ranks` rank threads (random
/// tokens: the data does not change the time) computing on `target` (a GPU target takes one
/// rank: GPU ranks are processes), calling `progress` after each of rank 0's steps.
pub fn measure_plan(
    model: &ModelSpec,
    plan: &Plan,
    target: Target,
    run: Timing<'_>,
    progress: impl FnMut(usize) + Send,
) -> Result<Vec<StepSample>, TrainError> {
    let Timing {
        ranks,
        warmup,
        steps,
        weights,
    } = run;
    super::exec::check_runnable(model, plan).map_err(|e| TrainError::Invalid(e.to_string()))?;
    if target.device != tch::Device::Cpu && ranks != 1 {
        return Err(TrainError::Invalid(format!(
            "{ranks} ranks on {:?}: timing on a GPU takes one rank (several GPUs are several \
             processes)",
            target.device
        )));
    }
    let sampler = Sampler {
        source: Source::Random,
        seed: 0,
        seq: model.config.seq_len as usize,
        vocab: model.config.vocab_size,
    };
    let progress = std::sync::Mutex::new(progress);
    let per_rank: Vec<RankSteps> = on_rank_threads(ranks, |group| {
        let on_step = |done: usize| {
            if let Ok(mut p) = progress.lock() {
                p(done);
            }
        };
        let steps = rank_steps(
            model,
            plan,
            target,
            Box::new(group),
            &sampler,
            warmup + steps,
            weights,
            on_step,
        )?;
        Ok(steps.into_iter().skip(warmup).collect())
    })?;
    Ok((0..steps)
        .map(|s| StepSample {
            step_s: per_rank.iter().map(|r| r[s].0).fold(0.0, f64::max),
            profiles: per_rank.iter().map(|r| r[s].1.clone()).collect(),
            peaks: per_rank.iter().map(|r| r[s].2).collect(),
        })
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn rank_steps(
    model: &ModelSpec,
    plan: &Plan,
    target: Target,
    group: Box<dyn Collective>,
    sampler: &Sampler,
    steps: usize,
    weights: Option<&crate::hf_weights::HfWeights>,
    on_step: impl Fn(usize),
) -> Result<RankSteps, TrainError> {
    // A step is the plan's: its micro-batches, accumulated, then one optimizer update.
    let rows = (plan.batch * plan.accumulation.max(1)) as usize;
    let rank = group.rank();
    let err = |e: super::exec::ExecError| TrainError::Rank {
        rank,
        message: e.to_string(),
    };
    let mut exec = Executor::new(
        model,
        plan,
        group,
        target,
        match weights {
            Some(weights) => Init::Pretrained { weights },
            None => Init::Fresh { seed: 0 },
        },
        OptimConfig::default(),
    )
    .map_err(err)?;
    exec.enable_profiling();
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let batch = sampler.batch(step as u64, rank * rows, rows);
        // Start together, so that a step's time is not another rank's lateness.
        exec.comm().barrier().map_err(|e| err(e.into()))?;
        let t0 = Instant::now();
        exec.train_step(&batch).map_err(err)?;
        let time_s = t0.elapsed().as_secs_f64();
        let profile = exec.profile.clone().unwrap_or_default();
        out.push((time_s, profile, exec.ledger.peak()));
        if rank == 0 {
            on_step(step + 1);
        }
    }
    Ok(out)
}

/// Median of `values` (0 for none).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// CPU time counters of the whole machine (Linux `/proc/stat`, in clock ticks): (total, steal).
/// Steal is time the hypervisor gave this VM's CPUs to someone else.
pub fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    Some((fields.iter().sum(), fields.get(7).copied().unwrap_or(0)))
}

/// The share of CPU time stolen by the hypervisor between two [`cpu_ticks`] readings.
pub fn steal_fraction(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((t0, s0), (t1, s1)) = (before?, after?);
    let total = t1.checked_sub(t0)?;
    (total > 0).then(|| s1.saturating_sub(s0) as f64 / total as f64)
}

/// A warning when more than 5 % of the CPU was stolen: the timings then say more about the
/// neighbours than about this machine.
pub fn steal_warning(fraction: Option<f64>) -> Option<String> {
    fraction.filter(|&f| f > 0.05).map(|f| {
        format!(
            "warning: the hypervisor took {:.0} % of the CPU time while measuring (steal); timings are not trustworthy, measure again when the machine is quieter",
            f * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_the_stolen_share_of_the_ticks_between_readings() {
        assert_eq!(steal_fraction(Some((100, 10)), Some((300, 60))), Some(0.25));
        assert_eq!(steal_fraction(Some((100, 10)), Some((100, 10))), None);
        assert_eq!(steal_fraction(None, Some((1, 1))), None);
        assert!(steal_warning(Some(0.43)).unwrap().contains("43 %"));
        assert_eq!(steal_warning(Some(0.01)), None);
    }
}
