//! What the memory panel says, as plain data computed from the [`App`]: with NVML, each GPU's
//! measured memory beside the plan's predicted peak and budget, and the parts of the gap that
//! are not the plan's (the caching allocator's reserve, the CUDA context with NCCL's buffers,
//! other processes) from the worker's own figures, or else the cost model's runtime estimate,
//! marked as one. Without NVML, or on the CPU layout, the panel lists ranks instead: each rank's
//! memory as the worker reports it. Nothing here makes a figure up: what was not measured is
//! `None` or an estimate by name.

use crate::monitor::GpuSample;
use osdp_core::cluster::DeviceKind;
use osdp_core::protocol::DeviceMemory;

use super::app::App;

/// The plan's memory per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanMemory {
    /// Predicted peak, runtime included: what must fit the budget.
    pub peak_bytes: u64,
    /// The cost model's allowance for the runtime (CUDA context, NCCL, allocator): an
    /// estimate from the layout, never measured.
    pub runtime_bytes: u64,
}

impl PlanMemory {
    /// The peak of what the plan itself holds (states, activations, transients): what the
    /// worker's executor measures.
    pub fn tensors_bytes(&self) -> u64 {
        self.peak_bytes.saturating_sub(self.runtime_bytes)
    }
}

/// The parts of one GPU's memory the worker measured for its rank; `None` where it could not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Measured {
    /// Peak bytes the CUDA caching allocator handed out: the tensors.
    pub tensors_bytes: Option<u64>,
    /// Reserved from the driver beyond that: the allocator's cache and fragments.
    pub reserve_bytes: Option<u64>,
    /// The rank's process beyond the allocator: CUDA context, NCCL buffers, workspaces.
    pub context_bytes: Option<u64>,
    /// The GPU's use beyond the rank's process: other processes and the driver.
    pub others_bytes: Option<u64>,
}

impl Measured {
    fn of(d: &DeviceMemory, used_bytes: Option<u64>) -> Measured {
        let less = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        Measured {
            tensors_bytes: d.allocated_peak_bytes,
            reserve_bytes: less(d.reserved_peak_bytes, d.allocated_peak_bytes),
            context_bytes: less(d.process_bytes, d.reserved_peak_bytes),
            others_bytes: less(used_bytes, d.process_bytes),
        }
    }
}

/// What is known of a GPU's memory beyond the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gap {
    /// No run of this dashboard's on the GPU: nothing of the plan's there to compare.
    NoRun,
    /// The run's worker measured its rank on this GPU.
    Measured(Measured),
    /// A run is on the GPU but its worker has reported no such figures (before its first step,
    /// or a trainer without the allocator's statistics): only the cost model's estimate.
    Estimated { runtime_bytes: u64 },
}

/// One GPU's row: NVML's reading, the plan, the budget, the gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMemory {
    pub index: usize,
    pub used_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub budget_bytes: u64,
    pub plan: Option<PlanMemory>,
    pub gap: Gap,
}

/// One rank's row: its executor's peak in the last step, when the worker has reported one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMemory {
    pub rank: usize,
    pub measured_bytes: Option<u64>,
    pub budget_bytes: u64,
}

/// The panel without NVML: every rank of the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranks {
    pub ranks: Vec<RankMemory>,
    pub plan: Option<PlanMemory>,
    /// The step the measurements are of; `None`: none yet.
    pub step: Option<u64>,
}

/// Whether the panel lists ranks: on the CPU layout (its ranks are not GPUs), or when NVML
/// gives no reading.
pub fn shows_ranks(app: &App) -> bool {
    app.layout.device.kind == DeviceKind::Cpu
        || matches!(app.gpus, super::app::GpuView::Unavailable(_))
}

/// The run's plan while its figures are on screen, else the plan on screen.
fn plan(app: &App, run_first: bool) -> Option<PlanMemory> {
    let run = app
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .filter(|_| run_first)
        .and_then(|r| r.status.predicted)
        .map(|p| PlanMemory {
            peak_bytes: p.peak_memory_bytes,
            runtime_bytes: p.runtime_overhead_bytes,
        });
    run.or_else(|| {
        app.planned().map(|p| PlanMemory {
            peak_bytes: p.prediction.peak_memory_bytes,
            runtime_bytes: p.prediction.overhead_bytes,
        })
    })
}

fn budget_of(app: &App, i: usize) -> u64 {
    app.request.budgets.get(i).copied().unwrap_or(app.budget())
}

/// The GPUs' rows from NVML's `samples`. Rank `r` of a run started here is GPU `r` (one process
/// per GPU, `LOCAL_RANK`), so a live run's rank figures go beside the GPU of that index.
pub fn gpus(app: &App, samples: &[GpuSample]) -> Vec<GpuMemory> {
    let run = app
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .filter(|r| r.is_live() && app.layout.device.kind == DeviceKind::Gpu);
    let plan = plan(app, run.is_some());
    let ranks = run.map(|r| match r.status.world_size {
        0 => app.layout.world_size() as usize,
        n => n,
    });
    let reported = run
        .and_then(|r| r.status.last())
        .and_then(|p| p.device_memory.as_ref());
    samples
        .iter()
        .map(|g| {
            let gap = match (ranks, reported.and_then(|d| d.get(g.index))) {
                (Some(n), _) if g.index >= n => Gap::NoRun,
                (Some(_), Some(d)) => Gap::Measured(Measured::of(d, g.used_bytes)),
                (Some(_), None) => Gap::Estimated {
                    runtime_bytes: plan.map_or(0, |p| p.runtime_bytes),
                },
                (None, _) => Gap::NoRun,
            };
            GpuMemory {
                index: g.index,
                used_bytes: g.used_bytes,
                total_bytes: g.total_bytes,
                budget_bytes: budget_of(app, g.index),
                plan,
                gap,
            }
        })
        .collect()
}

/// The ranks' rows: each rank of the layout, with its executor's peak from the run's last
/// step when there is one.
pub fn ranks(app: &App) -> Ranks {
    let last = app
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .and_then(|r| r.status.last());
    Ranks {
        ranks: (0..app.request.budgets.len().max(1))
            .map(|r| RankMemory {
                rank: r,
                measured_bytes: last.and_then(|p| p.memory_bytes.get(r).copied()),
                budget_bytes: budget_of(app, r),
            })
            .collect(),
        plan: plan(app, last.is_some()),
        step: last.map(|p| p.step),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gap_is_split_where_the_worker_measured_and_nowhere_else() {
        let gib = 1u64 << 30;
        let d = DeviceMemory {
            allocated_peak_bytes: Some(50 * gib),
            reserved_peak_bytes: Some(53 * gib),
            process_bytes: Some(55 * gib),
        };
        assert_eq!(
            Measured::of(&d, Some(56 * gib)),
            Measured {
                tensors_bytes: Some(50 * gib),
                reserve_bytes: Some(3 * gib),
                context_bytes: Some(2 * gib),
                others_bytes: Some(gib),
            }
        );
        // A trainer without the allocator's statistics: only NVML's process figure.
        let nvml_only = DeviceMemory {
            process_bytes: Some(55 * gib),
            ..DeviceMemory::default()
        };
        assert_eq!(
            Measured::of(&nvml_only, Some(56 * gib)),
            Measured {
                others_bytes: Some(gib),
                ..Measured::default()
            }
        );
    }
}
