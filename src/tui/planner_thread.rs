//! The planner off the UI thread: a single-job runner where a newer job replaces a pending
//! one. A job that changes only the budget reuses the frontiers already built. (The training
//! process is the "worker"; this thread only plans.)

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use osdp_core::cost::Machine;
use osdp_core::model::ModelSpec;
use osdp_core::plan::baseline::{self, Baseline, BaselineTable, Outcome};
use osdp_core::plan::{NoFit, PlanOptions, Planned, Planner, Request};

/// One request to plan, numbered so that the answer to an older one is known for what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub id: u64,
    pub request: Request,
}

/// A finished plan.
#[derive(Debug, Clone)]
pub struct PlanReady {
    pub id: u64,
    pub result: Result<Planned, NoFit>,
    /// Every baseline of the machine ([`Baseline::of`]) at the same budget and batch.
    pub baselines: Vec<(Baseline, Outcome)>,
    /// (peak bytes, samples/s) of the best plans over budgets.
    pub curve: Vec<(u64, f64)>,
    /// Whether host memory was priced rather than searched ([`Planner::host_priced`]): the
    /// curve is then empty, and the plan's step may be up to its `host_gap_s` too long.
    pub host_priced: bool,
    pub elapsed_ms: f64,
    /// Whether the frontiers were reused (a budget-only change).
    pub reused: bool,
}

pub struct PlannerThread {
    tx: Sender<Job>,
    pub rx: Receiver<PlanReady>,
}

impl PlannerThread {
    pub fn spawn(model: Arc<ModelSpec>, machine: Machine, max_budget: u64) -> PlannerThread {
        let (tx, jobs) = mpsc::channel::<Job>();
        let (done, rx) = mpsc::channel::<PlanReady>();
        thread::spawn(move || serve(&model, machine, max_budget, jobs, done));
        PlannerThread { tx, rx }
    }

    pub fn send(&self, job: Job) {
        let _ = self.tx.send(job);
    }
}

/// Plan one job synchronously (for `--once`).
pub fn plan_now(model: &ModelSpec, machine: &Machine, max_budget: u64, job: &Job) -> PlanReady {
    let started = Instant::now();
    let cover = max_budget.max(job.request.budget());
    let opts = job.request.options(model, machine, max_budget);
    let planner = Planner::new(model, machine.clone(), opts.clone(), cover);
    let table = BaselineTable::new(model, machine, &opts, cover);
    finish(&planner, &table, job, &opts, started, false)
}

/// The plan and the baselines at the request's budget, from frontiers and baseline plans
/// already built: a budget change prices nothing.
fn finish(
    planner: &Planner,
    table: &BaselineTable,
    job: &Job,
    opts: &PlanOptions,
    started: Instant,
    reused: bool,
) -> PlanReady {
    // Plans keep the request's headroom free under the budget.
    let budget = job.request.usable_budget();
    let baselines = table.at(budget);
    let mut result = planner.best(budget);
    if let Ok(best) = &mut result {
        baseline::adopt(best, &baselines, opts);
    }
    PlanReady {
        id: job.id,
        result,
        baselines,
        curve: planner.curve(),
        host_priced: planner.host_priced(),
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        reused,
    }
}

fn serve(
    model: &ModelSpec,
    machine: Machine,
    max_budget: u64,
    jobs: Receiver<Job>,
    done: Sender<PlanReady>,
) {
    // Frontiers built for (options, largest budget they cover).
    let mut cached: Option<(PlanOptions, u64, Planner, BaselineTable)> = None;
    while let Ok(mut job) = jobs.recv() {
        // Latest request wins: skip everything already superseded.
        loop {
            match jobs.try_recv() {
                Ok(newer) => job = newer,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let started = Instant::now();
        let opts = job.request.options(model, &machine, max_budget);
        let budget = job.request.budget();
        let reused = cached
            .as_ref()
            .is_some_and(|(o, cover, _, _)| *o == opts && budget <= *cover);
        if !reused {
            let cover = max_budget.max(budget);
            let planner = Planner::new(model, machine.clone(), opts.clone(), cover);
            let table = BaselineTable::new(model, &machine, &opts, cover);
            cached = Some((opts, cover, planner, table));
        }
        let (opts, _, planner, table) = cached.as_ref().expect("just built");
        if done
            .send(finish(planner, table, &job, opts, started, reused))
            .is_err()
        {
            return;
        }
    }
}
