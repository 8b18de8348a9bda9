//! What to plan: one [`Request`] that the `plan` command, the dashboard, its undo history and
//! its planner thread all hold, and the planner's [`PlanOptions`] derived from it. How a
//! request is spelled on a command line is the app's.

use crate::cost::{Choice, Machine};
use crate::model::ModelSpec;

use super::{PlanOptions, Target};

/// What to plan, besides the model and the machine: budgets, batch, split, pins and
/// recomputation fixes, as the user set them.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// One budget per GPU; the plan must fit the smallest ([`binding`]).
    pub budgets: Vec<u64>,
    /// Largest operator split (a power of two; 1 disables splitting).
    pub max_split: u32,
    /// Fixed micro-batch; `None`: searched.
    pub batch: Option<u64>,
    /// Samples per optimizer step over all ranks; `None`: the highest throughput at any batch.
    pub global_batch: Option<u64>,
    /// Whether blocks may recompute their activations.
    pub recompute: bool,
    /// Ops whose choice is fixed: (op index, choice).
    pub pins: Vec<(usize, Choice)>,
    /// Blocks whose recomputation is fixed: (block index, recompute).
    pub block_recompute: Vec<(usize, bool)>,
    /// Memory resolution of the search; `None`: [`search_resolution`]'s default.
    pub resolution_bytes: Option<u64>,
    /// What will run the plan ([`Target`]): the choices it can express.
    pub target: Target,
    /// Share of the budget plans leave free (0.05: plans peak within 95 % of it), for what the
    /// memory model does not see yet (issue 36); [`DEFAULT_HEADROOM`] unless set, 0 allowed.
    pub headroom: f64,
}

impl Request {
    /// Plan for `budgets` with every other setting at its default.
    pub fn new(budgets: Vec<u64>, max_split: u32) -> Request {
        Request {
            budgets,
            max_split,
            batch: None,
            global_batch: None,
            recompute: true,
            pins: Vec::new(),
            block_recompute: Vec::new(),
            resolution_bytes: None,
            target: Target::Osdp,
            headroom: DEFAULT_HEADROOM,
        }
    }

    /// What plans may peak at: the binding budget less the headroom ([`usable`]).
    pub fn usable_budget(&self) -> u64 {
        usable(self.budget(), self.headroom)
    }

    /// The budget that binds: the smallest GPU's.
    pub fn budget(&self) -> u64 {
        binding(&self.budgets).1
    }

    /// The planner's options for this request; `device_bytes` is the GPU's memory, which the
    /// default resolution follows (see [`search_resolution`]).
    pub fn options(&self, model: &ModelSpec, m: &Machine, device_bytes: u64) -> PlanOptions {
        PlanOptions {
            batch: self.batch,
            global_batch: self.global_batch,
            max_split: self.max_split,
            recompute: self.recompute,
            pins: self.pins.clone(),
            resolution_bytes: search_resolution(self.resolution_bytes, model, m, device_bytes),
            block_recompute: self.block_recompute.clone(),
            target: self.target,
        }
    }
}

/// The headroom plans keep unless told otherwise: 5 % of the budget. Until GPU measurements
/// prove the memory model (issue 36: published peaks run 10–75 % above its predictions), a
/// plan packed to within a resolution step of the device's memory is an out-of-memory crash
/// on its first step.
pub const DEFAULT_HEADROOM: f64 = 0.05;

/// Largest headroom accepted: past half the budget a headroom hides more than it guards.
pub const MAX_HEADROOM: f64 = 0.5;

/// What plans may peak at under `budget` with `headroom` (a share, 0 to [`MAX_HEADROOM`]):
/// the budget less the headroom, rounded down to a byte.
pub fn usable(budget: u64, headroom: f64) -> u64 {
    let h = headroom.clamp(0.0, MAX_HEADROOM);
    if h == 0.0 {
        return budget;
    }
    (budget as f64 * (1.0 - h)).floor() as u64
}

/// The smallest budget whose [`usable`] part holds `peak` bytes under `headroom`.
pub fn budget_for(peak: u64, headroom: f64) -> u64 {
    let h = headroom.clamp(0.0, MAX_HEADROOM);
    let mut b = (peak as f64 / (1.0 - h)).ceil() as u64;
    while b > 0 && usable(b - 1, h) >= peak {
        b -= 1;
    }
    while usable(b, h) < peak {
        b += 1;
    }
    b
}

/// `--headroom`'s words: a percentage of the budget, `5`, `5%` or `2.5 %`, from 0 to 50.
pub fn parse_headroom(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let num = t.strip_suffix('%').unwrap_or(t).trim();
    let bad = || {
        format!(
            "expected a headroom in percent of the budget, 0 to {}, such as 5 or 2.5%, got {s:?}",
            MAX_HEADROOM * 100.0
        )
    };
    let pct: f64 = num.parse().map_err(|_| bad())?;
    if !pct.is_finite() || !(0.0..=MAX_HEADROOM * 100.0).contains(&pct) {
        return Err(bad());
    }
    Ok(pct / 100.0)
}

/// The GPU whose budget binds (the smallest) and that budget.
pub fn binding(budgets: &[u64]) -> (usize, u64) {
    budgets
        .iter()
        .copied()
        .enumerate()
        .min_by_key(|&(_, b)| b)
        .unwrap_or((0, 0))
}

/// The memory resolution a search runs at: `requested` if given (0 is exact), else 1 MiB, or
/// where offload is offered 1/512 of the GPU's memory or of the model's training state,
/// whichever is less (at least 1 MiB). It does not depend on the budget asked for, so that the
/// least budget one search reports is one the next search at that budget finds.
///
/// Offloading an op trades its state bytes for host-link and CPU time at nearly one rate for
/// every op, so no subset of offloaded ops dominates another: at 1 MiB the frontiers hold every
/// subset sum of the ops' states (~20,000 points on a 7B model) and a full search of llama-2-7b
/// on one H100 takes 1.5 s. At 1/512 of its 80 GiB (159 MiB) it takes ~20 ms and the plan found
/// is within 0.01 % of the 1 MiB one's step time (docs/offload.md). A small model keeps 1 MiB:
/// what it can offload is small, and so is its search.
pub fn search_resolution(
    requested: Option<u64>,
    model: &ModelSpec,
    m: &Machine,
    device_bytes: u64,
) -> u64 {
    const MIB: u64 = 1 << 20;
    let state = model
        .param_count()
        .saturating_mul(crate::cost::HOST_STATE_BYTES_PER_PARAM);
    requested.unwrap_or(if m.offers_offload() {
        (device_bytes.min(state) / OFFLOAD_RESOLUTION_SHARE / MIB).max(1) * MIB
    } else {
        MIB
    })
}

/// Share of the GPU's memory (or the state) that one step of memory resolution is in an offloading search (see
/// [`search_resolution`]).
pub const OFFLOAD_RESOLUTION_SHARE: u64 = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_keeps_its_share_of_the_budget_free() {
        let gib = 1u64 << 30;
        assert_eq!(usable(80 * gib, 0.0), 80 * gib);
        assert_eq!(usable(80 * gib, 0.05), 76 * gib);
        let r = Request::new(vec![20 * gib, 10 * gib], 8);
        assert_eq!(r.headroom, DEFAULT_HEADROOM);
        assert_eq!(r.usable_budget(), usable(10 * gib, DEFAULT_HEADROOM));
        for peak in [0, 1, 12_345_678, 76 * gib, 76 * gib + 1] {
            for h in [0.0, 0.05, 0.125, 0.5] {
                let b = budget_for(peak, h);
                assert!(usable(b, h) >= peak, "{peak} {h}");
                assert!(
                    b == 0 || usable(b - 1, h) < peak,
                    "{peak} {h}: {b} is not the least"
                );
            }
        }
    }

    #[test]
    fn headroom_words() {
        assert_eq!(parse_headroom("5"), Ok(0.05));
        assert_eq!(parse_headroom("2.5 %"), Ok(0.025));
        assert_eq!(parse_headroom("0"), Ok(0.0));
        assert_eq!(parse_headroom("50%"), Ok(0.5));
        for bad in ["-1", "51", "NaN", "inf", "five", "", "5GiB"] {
            let e = parse_headroom(bad).unwrap_err();
            assert!(!e.contains('\n') && e.contains("0 to 50"), "{bad}: {e}");
        }
    }
}
