//! The planner off the UI thread: a single-job runner where a newer request replaces a pending
//! one. A request that changes only the budget reuses the frontiers already built.

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use crate::cost::{Choice, Machine};
use crate::model::ModelSpec;
use crate::plan::baseline::{self, Baseline, BaselineTable, Outcome};
use crate::plan::{NoFit, PlanOptions, Planned, Planner};

/// What to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    pub id: u64,
    pub budget_bytes: u64,
    pub max_split: u32,
    pub batch: Option<u64>,
    /// Samples per optimizer step over all ranks, when the user fixed it.
    pub global_batch: Option<u64>,
    pub pins: Vec<(usize, Choice)>,
    /// Blocks whose recomputation the user fixed (`R`): (block, recompute).
    pub block_recompute: Vec<(usize, bool)>,
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
    pub elapsed_ms: f64,
    /// Whether the frontiers were reused (a budget-only change).
    pub reused: bool,
}

pub struct Worker {
    tx: Sender<PlanRequest>,
    pub rx: Receiver<PlanReady>,
}

impl Worker {
    pub fn spawn(model: Arc<ModelSpec>, machine: Machine, max_budget: u64) -> Worker {
        let (tx, jobs) = mpsc::channel::<PlanRequest>();
        let (done, rx) = mpsc::channel::<PlanReady>();
        thread::spawn(move || serve(&model, machine, max_budget, jobs, done));
        Worker { tx, rx }
    }

    pub fn request(&self, r: PlanRequest) {
        let _ = self.tx.send(r);
    }
}

/// Plan one request synchronously (for `--once`).
pub fn plan_now(
    model: &ModelSpec,
    machine: &Machine,
    max_budget: u64,
    r: &PlanRequest,
) -> PlanReady {
    let started = Instant::now();
    let cover = max_budget.max(r.budget_bytes);
    let opts = options(r, resolution(model, machine, max_budget));
    let planner = Planner::new(model, machine.clone(), opts.clone(), cover);
    let table = BaselineTable::new(model, machine, &opts, cover);
    finish(&planner, &table, r, &opts, started, false)
}

/// The dashboard's memory resolution: the CLI's default at the largest budget it plans for, so
/// that a budget change reuses the frontiers.
fn resolution(model: &ModelSpec, machine: &Machine, max_budget: u64) -> u64 {
    osdp_core::plan::request::search_resolution(None, model, machine, max_budget)
}

fn options(r: &PlanRequest, resolution_bytes: u64) -> PlanOptions {
    PlanOptions {
        batch: r.batch,
        global_batch: r.global_batch,
        max_split: r.max_split,
        recompute: true,
        pins: r.pins.clone(),
        resolution_bytes,
        block_recompute: r.block_recompute.clone(),
    }
}

/// The plan and the baselines at the request's budget, from frontiers and baseline plans
/// already built: a budget change prices nothing.
fn finish(
    planner: &Planner,
    table: &BaselineTable,
    r: &PlanRequest,
    opts: &PlanOptions,
    started: Instant,
    reused: bool,
) -> PlanReady {
    let baselines = table.at(r.budget_bytes);
    let mut result = planner.best(r.budget_bytes);
    if let Ok(best) = &mut result {
        baseline::adopt(best, &baselines, opts);
    }
    PlanReady {
        id: r.id,
        result,
        baselines,
        curve: planner.curve(),
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        reused,
    }
}

fn serve(
    model: &ModelSpec,
    machine: Machine,
    max_budget: u64,
    jobs: Receiver<PlanRequest>,
    done: Sender<PlanReady>,
) {
    // Frontiers built for (options, largest budget they cover).
    let mut cached: Option<(PlanOptions, u64, Planner, BaselineTable)> = None;
    let resolution = resolution(model, &machine, max_budget);
    while let Ok(mut r) = jobs.recv() {
        // Latest request wins: skip everything already superseded.
        loop {
            match jobs.try_recv() {
                Ok(newer) => r = newer,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let started = Instant::now();
        let opts = options(&r, resolution);
        let reused = cached
            .as_ref()
            .is_some_and(|(o, cover, _, _)| *o == opts && r.budget_bytes <= *cover);
        if !reused {
            let cover = max_budget.max(r.budget_bytes);
            let planner = Planner::new(model, machine.clone(), opts.clone(), cover);
            let table = BaselineTable::new(model, &machine, &opts, cover);
            cached = Some((opts, cover, planner, table));
        }
        let (opts, _, planner, table) = cached.as_ref().expect("just built");
        if done
            .send(finish(planner, table, &r, opts, started, reused))
            .is_err()
        {
            return;
        }
    }
}
