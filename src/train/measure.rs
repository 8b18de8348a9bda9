//! Timed training steps for `calibrate` and `validate`: a plan run on rank threads with the
//! executor's profiler on, every rank's timings and memory peak kept per step.

use std::time::Instant;

use tch::Device;

use super::collective::{Collective, LocalGroup};
use super::data::{Sampler, Source};
use super::exec::{Executor, Init, OptimConfig, Profile};
use super::memory::Breakdown;
use super::TrainError;
use crate::model::ModelSpec;
use crate::plan::Plan;

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

/// Threads for libtorch's intra-op pool when `ranks` ranks share this machine's cores.
pub fn threads_per_rank(ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks.max(1)).max(1)
}

/// Run `warmup` untimed and then `steps` timed steps of `plan` on `ranks` rank threads (random
/// tokens: the data does not change the time), calling `progress` after each step.
pub fn measure_plan(
    model: &ModelSpec,
    plan: &Plan,
    ranks: usize,
    warmup: usize,
    steps: usize,
    mut progress: impl FnMut(usize),
) -> Result<Vec<StepSample>, TrainError> {
    if ranks == 0 {
        return Err(TrainError::Invalid("at least one rank is needed".into()));
    }
    super::exec::check_runnable(model, plan).map_err(|e| TrainError::Invalid(e.to_string()))?;
    tch::set_num_threads(threads_per_rank(ranks) as i32);
    let sampler = Sampler {
        source: Source::Random,
        seed: 0,
        seq: model.config.seq_len as usize,
        vocab: model.config.vocab_size,
    };
    let rows = plan.batch as usize;
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let results: Vec<Result<RankSteps, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = LocalGroup::new(ranks)
            .into_iter()
            .map(|group| {
                let tx = tx.clone();
                let sampler = &sampler;
                scope.spawn(move || {
                    let abort = group.abort_handle();
                    let rank = group.rank();
                    let out = rank_steps(
                        model,
                        plan,
                        Box::new(group),
                        sampler,
                        rows,
                        warmup + steps,
                        &tx,
                    );
                    if let Err(e) = &out {
                        abort.abort(&e.to_string());
                    }
                    out.map(|v| v.into_iter().skip(warmup).collect())
                        .map_err(|e| match e {
                            TrainError::Rank { .. } => e,
                            other => TrainError::Rank {
                                rank,
                                message: other.to_string(),
                            },
                        })
                })
            })
            .collect();
        drop(tx);
        for done in rx {
            progress(done);
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(TrainError::Invalid("a rank thread panicked".into())))
            })
            .collect()
    });
    // Report the rank that failed for its own reason, not one merely released by it.
    let aborted = |e: &TrainError| e.to_string().contains("collective aborted");
    let mut per_rank: Vec<RankSteps> = Vec::with_capacity(ranks);
    let mut failure: Option<TrainError> = None;
    for r in results {
        match r {
            Ok(v) => per_rank.push(v),
            Err(e) => {
                if failure.as_ref().is_none_or(|f| aborted(f) && !aborted(&e)) {
                    failure = Some(e);
                }
            }
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok((0..steps)
        .map(|s| StepSample {
            step_s: per_rank.iter().map(|r| r[s].0).fold(0.0, f64::max),
            profiles: per_rank.iter().map(|r| r[s].1.clone()).collect(),
            peaks: per_rank.iter().map(|r| r[s].2).collect(),
        })
        .collect())
}

fn rank_steps(
    model: &ModelSpec,
    plan: &Plan,
    group: Box<dyn Collective>,
    sampler: &Sampler,
    rows: usize,
    steps: usize,
    tx: &std::sync::mpsc::Sender<usize>,
) -> Result<RankSteps, TrainError> {
    let rank = group.rank();
    let err = |e: super::exec::ExecError| TrainError::Rank {
        rank,
        message: e.to_string(),
    };
    let mut exec = Executor::new(
        model,
        plan,
        group,
        Device::Cpu,
        Init::Fresh { seed: 0 },
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
            let _ = tx.send(step + 1);
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
