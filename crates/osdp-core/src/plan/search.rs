//! The exact planner.
//!
//! Peak memory is `overhead + Σ held + max transient`; the max makes it no plain knapsack. For
//! each cap `T` on the transient term (every distinct value a choice can produce), restricting
//! every op to choices whose transient fits under `T` turns it into a multiple-choice knapsack:
//! minimise Σ time subject to Σ held ≤ budget − overhead − T. The optimum under the true peak is
//! the best over caps. Each knapsack is solved as a Pareto frontier of (memory → best time),
//! built once per (micro-batch, cap); identical transformer blocks are merged by doubling. A
//! budget change is then a binary search per frontier, not a new search.

use std::collections::HashMap;

use super::frontier::{self, Arena, Cut, Frontier, Hull, Node, Point, RepeatCut, Way};
use super::{evaluate_with, kept_weight_bytes, Blocks, Plan, Prediction, Target};
use crate::cost::{self, Choice, Machine, OpBase};
use crate::model::ModelSpec;

/// What the search may choose.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Fixed micro-batch size, or `None` to search it.
    pub batch: Option<u64>,
    /// Samples per optimizer step over all ranks. `Some`: the planner picks the micro-batch
    /// and the accumulation that run exactly this many (micro-batch × accumulation × ranks)
    /// in the least time. `None`: largest throughput at any batch, one micro-batch a step.
    pub global_batch: Option<u64>,
    /// Largest operator split (a power of two; 1 disables splitting).
    pub max_split: u32,
    /// Whether blocks may recompute their activations.
    pub recompute: bool,
    /// Ops whose choice is fixed: (op index, choice).
    pub pins: Vec<(usize, Choice)>,
    /// Memory resolution of the frontiers in bytes; 0 = exact. See [`frontier::sum`].
    pub resolution_bytes: u64,
    /// Blocks whose recomputation is fixed: (block index, recompute). The others are searched
    /// (when `recompute` allows it).
    pub block_recompute: Vec<(usize, bool)>,
    /// What will run the plan: the choices it can express ([`Target::choices`]).
    pub target: Target,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            batch: None,
            global_batch: None,
            max_split: 8,
            recompute: true,
            pins: Vec::new(),
            resolution_bytes: 0,
            block_recompute: Vec::new(),
            target: Target::Osdp,
        }
    }
}

/// A plan with its prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub plan: Plan,
    pub prediction: Prediction,
    /// When the model had too many distinct transient caps to search exactly: the memory
    /// resolution the search was coarsened to (the plan's peak may be up to this much above
    /// the best one's at the same throughput); 0 when exact. See [`MAX_CAP_SLOTS`].
    pub coarsened_bytes: u64,
    /// When the host budget bound on a model too large to search host memory exactly: the
    /// plan was found by pricing host memory, and no plan's step is shorter than this plan's
    /// by more than this many seconds (a Lagrangian bound; `Some(0.0)`: it is the best).
    /// `None`: exact.
    pub host_gap_s: Option<f64>,
    /// A baseline's plan as osdp-tui's trainer would run it, where that differs from how its
    /// users run it (`prediction`): the trainer fetches a recomputed op's parameters again,
    /// which FSDP does not ([`crate::cost::Machine::regather_on_recompute`]). `None`: the same.
    pub trainer_prediction: Option<Box<Prediction>>,
}

impl Planned {
    /// Whether this baseline's plan outruns a plan of `plan_samples_per_s` only as its users
    /// run it: as osdp-tui's trainer would run it ([`Planned::trainer_prediction`]) it does not.
    pub fn ahead_only_as_users_run_it(&self, plan_samples_per_s: f64) -> bool {
        self.trainer_prediction.as_deref().is_some_and(|t| {
            self.prediction.throughput_samples_per_s > plan_samples_per_s
                && t.throughput_samples_per_s <= plan_samples_per_s
        })
    }

    /// What pricing host memory means for a plan, in words (`plan`'s note, the dashboard's
    /// frontier panel): `gap_s` is [`Planned::host_gap_s`], known where the global batch is fixed.
    pub fn host_priced_note(gap_s: Option<f64>) -> String {
        let bound = gap_s.map_or(String::new(), |g| {
            format!(
                ", and no plan's step is more than {} shorter",
                crate::units::seconds(g)
            )
        });
        format!(
            "the host budget binds and the model is too large to search host memory exactly; \
             the plan was found by pricing host memory{bound}"
        )
    }
}

/// Most (transient cap × class slot) pairs one micro-batch searches: each cap is a sum over
/// every class, so a model of many distinct blocks (hundreds of caps, thousands of slots) would
/// otherwise take gigabytes. Past it, caps closer than a resolution that doubles until they fit
/// are merged (see [`Planned::coarsened_bytes`]).
pub const MAX_CAP_SLOTS: usize = 50_000;

/// Nothing fits the budget; the smallest budget that would, if any does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoFit {
    /// The smallest per-GPU budget some plan fits; `None`: no budget is enough (see
    /// `host_budget_bytes`, or no plan can be made at all).
    pub min_budget_bytes: Option<u64>,
    /// `Some(h)`: no plan keeps its offloaded state within the host budget `h`, at any
    /// device budget (`min_budget_bytes` is then `None`).
    pub host_budget_bytes: Option<u64>,
}

impl NoFit {
    /// What would fit, in words: `budget` per rank is what was asked, and `rank` names one
    /// ([`crate::cluster::DeviceKind::rank_noun`]: `GPU`, or `rank` on the CPU layout).
    pub fn describe(&self, budget: u64, rank: &str) -> String {
        let asked = crate::units::bytes(budget);
        match (self.min_budget_bytes, self.host_budget_bytes) {
            (Some(least), _) => format!(
                "nothing fits {asked} per {rank}; the smallest budget that fits is {}",
                crate::units::bytes(least)
            ),
            (None, Some(0)) => format!(
                "nothing fits {asked} per {rank}, nor any budget: ops pinned to offload keep \
                 state in host memory, but the host budget is 0 (unpin them, or give a host \
                 budget)"
            ),
            (None, Some(h)) => format!(
                "nothing fits {asked} per {rank}: even the plans that offload to host memory \
                 need more than the host budget of {} per {rank} (raise the host budget, or add \
                 {rank}s)",
                crate::units::bytes(h)
            ),
            (None, None) => format!(
                "nothing fits {asked} per {rank}, nor any budget: no plan of this model can be \
                 made with these settings"
            ),
        }
    }
}

/// A group of identical instances: blocks with the same structure, or one op outside the blocks.
#[derive(Debug, Clone)]
struct Class {
    /// Op indices of each instance, by slot.
    instances: Vec<Vec<usize>>,
    /// Block index of each instance, when the class is made of blocks.
    blocks: Option<Vec<usize>>,
    /// Its blocks' recomputation when fixed ([`PlanOptions::block_recompute`]).
    forced: Option<bool>,
}

/// One option of one slot of a class.
#[derive(Debug, Clone, Copy)]
struct Opt {
    choice: Choice,
    held: u64,
    time: f64,
    transient: u64,
    /// With recomputation: nothing kept, forward run again.
    held_r: u64,
    time_r: f64,
    /// Of `time_r`, the fetches a recomputation repeats (`OpCost::recompute_comm_s`): the
    /// only part of a recomputation's cost that depends on the choice.
    refetch: f64,
    /// With recomputation in a block that keeps what it fetched ([`Way::Keep`]): the time;
    /// infinite where the choice fetches nothing whole to keep.
    time_k: f64,
    /// The least time of a recomputed way this option can run in: `time_r`, or `time_k` where
    /// its class may keep ([`KeepSlots`]). What bounds read.
    time_rb: f64,
    /// Host memory (offloaded state), where it can bind; 0 otherwise.
    host: u64,
}

/// A block class's third way, where it is worth a frontier: its instances recompute and keep
/// the weights their recomputation fetches ([`Way::Keep`]), open where some option of an op it
/// keeps runs faster so (its fetches again show).
#[derive(Debug, Clone)]
struct KeepSlots {
    /// Per slot: the bytes rematerialised while it runs backward, and the weights the ops
    /// before it in the block hold ([`kept_weight_bytes`]).
    extra: Vec<u64>,
    /// Per slot: whether its weight is kept (its block's recomputation runs it again and it
    /// owns parameters): only options that fetch them whole are open to it, at `time_k`.
    /// Other slots run as recomputed (`time_r`).
    kept: Vec<bool>,
    /// The least transient cap any instance run this way needs: over its slots, the largest of
    /// their least `transient + extra`. A cap below it is no instance's own.
    floor: u64,
}

impl KeepSlots {
    /// Slot `s`'s time with option `o` in this way, if open to it.
    fn time(&self, s: usize, o: &Opt) -> Option<f64> {
        if self.kept[s] {
            o.time_k.is_finite().then_some(o.time_k)
        } else {
            Some(o.time_r)
        }
    }
}

#[derive(Default)]
struct BatchTable {
    batch: u64,
    accumulation: u64,
    /// The ops' base facts at this batch, for pricing the plan found.
    bases: Vec<OpBase>,
    arena: Arena,
    /// (transient cap, frontier of the whole model under it).
    caps: Vec<(u64, Frontier)>,
    /// See [`Prepared::coarsened`].
    coarsened: u64,
}

/// Throughputs this close are equal but for rounding (the same plan summed in another order
/// differs in the last bits): of such plans, the one of smaller peak is the better
/// ([`Planner::best`]).
const SAME_THROUGHPUT: f64 = 1e-12;

/// What a bound on a plan's time or throughput is loosened by (to the plans' advantage): the
/// bound and a plan's own figures are sums in different orders, which differ in the last bits.
const ROUNDING_MARGIN: f64 = 1e-7;

/// How far above each breakpoint [`Planner::priced_host`] searches, as a fraction of it.
///
/// At the breakpoint itself a search finds the plans over the host budget whose prices lie just
/// above it, one per search (tinyllama-1.1b on `cpu`: breakpoints 1.934, 1.961 and 1.965 × 10⁻⁸
/// s/B, three searches, the plan the same as the first search's). A little above it, those are
/// no longer cheaper than the plan within, and the one search proves it. The price of that
/// proof is a bound at most this much wider ([`Planned::host_gap_s`] is the proven price times
/// the host bytes left), and a plan within the host budget whose price lies between the
/// breakpoint and the probe can be missed: it is faster than the plan found by less than that
/// bound, which the plan states.
const PROBE_ABOVE_TIE: f64 = 1.0 / 32.0;

/// Of plans as fast as each other ([`SAME_THROUGHPUT`]), the better is the one of smaller key:
/// its peak (held memory and transient cap, without the overhead), then its transient cap, then
/// its micro-batch. Every search answers with the same plan of several that tie, whichever
/// order it finds them in.
type TieKey = (u64, u64, u64);

/// Whether a plan of throughput `tput` and tie key `key` is better than one of `than`.
fn better(tput: f64, key: TieKey, than: (f64, TieKey)) -> bool {
    let (bt, bkey) = than;
    if (tput - bt).abs() <= SAME_THROUGHPUT * bt.abs() {
        key < bkey
    } else {
        tput > bt
    }
}

/// The best plan a search for one budget has found so far ([`Reach::Only`]): its throughput
/// (0: none yet) and its [`TieKey`].
#[derive(Debug, Clone, Copy)]
struct Incumbent {
    tput: f64,
    key: TieKey,
}

impl Default for Incumbent {
    fn default() -> Self {
        Incumbent {
            tput: 0.0,
            key: (u64::MAX, u64::MAX, u64::MAX),
        }
    }
}

impl Incumbent {
    /// Takes a plan found if it is the better ([`better`]).
    fn offer(&mut self, tput: f64, key: TieKey) {
        if self.tput == 0.0 || better(tput, key, (self.tput, self.key)) {
            *self = Incumbent { tput, key };
        }
    }

    /// The most held memory a plan under transient cap `cap` at micro-batch `batch` may have
    /// and still win a tie with this one; `None` when none can.
    fn tie_held(&self, cap: u64, batch: u64) -> Option<u64> {
        let (peak, icap, ibatch) = self.key;
        let room = peak.checked_sub(cap)?;
        if (cap, batch) < (icap, ibatch) {
            Some(room)
        } else {
            room.checked_sub(1)
        }
    }

    /// Whether plans that could reach at most `could_reach` (a [`Planner::could_reach`]
    /// bound, with its margin) can at best tie this one: then only a smaller [`TieKey`] can
    /// beat it. The bound's own rounding (sums of a few thousand terms) is far below the tie's
    /// width.
    fn ties_at_most(&self, could_reach: f64) -> bool {
        self.tput > 0.0
            && could_reach / (1.0 + ROUNDING_MARGIN) <= self.tput * (1.0 + SAME_THROUGHPUT / 2.0)
    }
}

/// A micro-batch's frontiers while they are summed, cap by cap ([`Planner::start_building`]).
struct Building {
    /// What it becomes: the frontiers summed so far (under `caps`, in the order summed), in
    /// its arena.
    table: BatchTable,
    opts: Vec<Vec<Opt>>,
    /// Per class, per slot of its first instance: the bytes rematerialised while it runs
    /// backward recomputed.
    remat_of: Vec<Vec<u64>>,
    /// Per class, its third way where open.
    keep: Vec<Option<KeepSlots>>,
    class_floor: Vec<u64>,
    all_floor: u64,
    /// The caps still to sum, with the best throughput each could reach (0 where that is not
    /// asked), the next last.
    steps: Vec<(f64, u64, Vec<Vec<usize>>)>,
    /// (class, key) → (the held-bytes limit it was summed under, its frontier).
    cache: ClassCache,
}

impl Building {
    /// The best throughput the next cap's plans could reach; `None` when every cap is summed.
    fn next_reach(&self) -> Option<f64> {
        self.steps.last().map(|s| s.0)
    }
}

/// A micro-batch's budget-free facts; see [`Planner::prepare`].
struct Prepared {
    batch: u64,
    accumulation: u64,
    bases: Vec<OpBase>,
    opts: Vec<Vec<Opt>>,
    remat: Vec<u64>,
    /// Per class, its third way where open.
    keep: Vec<Option<KeepSlots>>,
    /// The transient no plan avoids: the largest of the ops' least.
    transient_floor: u64,
    /// Least memory each class holds (all its instances); the sum.
    class_floor: Vec<u64>,
    all_floor: u64,
    /// The transient caps worth a frontier, with what each leaves each class: per slot, how
    /// many options fit (then, for blocks that may recompute, how many fit recomputed, then,
    /// where the class may keep, how many of its options fit that way before it filters them).
    steps: Vec<(u64, Vec<Vec<usize>>)>,
    /// The resolution caps were merged at to stay under [`MAX_CAP_SLOTS`]; 0 if they were not.
    coarsened: u64,
    /// For [`Reach::Only`]: per step, the best throughput its plans could reach within the
    /// budget ([`Planner::could_reach`]); empty otherwise.
    reach: Vec<f64>,
}

/// Lines `time ≥ g − λ·(peak − fixed)`; see [`Planner::time_bound`].
struct TimeBound {
    lines: Vec<(f64, f64)>,
    fixed_bytes: u64,
}

impl TimeBound {
    /// The least step time (without the step overhead) of a plan of peak `peak`.
    fn at(&self, peak: u64) -> f64 {
        let held = peak.saturating_sub(self.fixed_bytes) as f64;
        self.lines
            .iter()
            .map(|&(g, lambda)| g - lambda * held)
            .fold(0.0, f64::max)
    }
}

pub struct Planner<'m> {
    model: &'m ModelSpec,
    machine: Machine,
    blocks: Blocks,
    options: PlanOptions,
    classes: Vec<Class>,
    graph: cost::OpGraph,
    tables: Vec<BatchTable>,
    searched: Vec<u64>,
    /// `Some(h)`: this planner's frontiers are three-dimensional, host memory cut at `h`
    /// ([`Arena::host_limit`]). Planners are built with `None` (host memory ignored: the
    /// relaxation), and build a three-dimensional one only when a plan they find exceeds the
    /// host budget.
    host_limit: Option<u64>,
    /// The host budget, where some plan's offloaded state could exceed it (offload offered,
    /// and offloading everything would not fit).
    host_can_bind: Option<u64>,
    /// The budget the tables cover, for building the three-dimensional planner.
    max_budget_bytes: u64,
    /// Seconds of step time each byte of host memory costs in the search (a Lagrange
    /// multiplier; 0 but in [`Planner::priced_host`]).
    host_price: f64,
    /// The three-dimensional planner, once a query needed it.
    exact_host: std::sync::OnceLock<Box<Planner<'m>>>,
    /// What the tables answer: every budget up to `max_budget_bytes`, or that budget alone.
    reach: Reach,
    /// Caps a relaxed search left to sum ([`Search::defer_proof`]); `None` when it summed all.
    pending: Option<Pending>,
}

/// How one search runs: the budgets its tables answer, and what it makes of host memory.
#[derive(Debug, Clone, Copy)]
struct Search {
    reach: Reach,
    /// `Some(h)`: three-dimensional frontiers, host memory cut at `h` ([`Planner::host_limit`]).
    host_limit: Option<u64>,
    /// Seconds of step time each host byte costs ([`Planner::host_price`]).
    host_price: f64,
    /// For [`Reach::Only`]: `(samples, cost)`, a plan of `samples` samples per step known to take
    /// `cost` seconds per step under this search's pricing; the search then keeps only what
    /// could beat it, and may find nothing (nothing cheaper than that plan).
    seed: Option<(u64, f64)>,
    /// For the relaxation of a search for one budget at a fixed global batch, where the host
    /// budget can bind: stop once a plan is found, leaving the caps that could still beat it
    /// [`Pending`] ([`Planner::best_at`] decides whether they need summing).
    defer_proof: bool,
}

impl Search {
    /// Host memory ignored (the relaxation), nothing known to beat.
    fn relaxed(reach: Reach) -> Search {
        Search {
            reach,
            host_limit: None,
            host_price: 0.0,
            seed: None,
            defer_proof: false,
        }
    }
}

/// A relaxed search for one budget stopped at its first plan ([`Search::defer_proof`]): the
/// micro-batches' sums with the caps still to sum (their tables are the planner's, in the same
/// order, while this waits), and the best plan found so far.
struct Pending {
    building: Vec<Building>,
    incumbent: Incumbent,
}

/// Which budgets a planner's tables answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Every budget up to the largest: a budget change walks the frontiers (the dashboard).
    Every,
    /// The largest alone (`plan`): a micro-batch or a transient cap whose plans cannot beat
    /// the best found so far at that budget (a Lagrangian bound says so) is never summed.
    Only,
}

/// Why a global batch cannot be run on `ranks` ranks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("a global batch of {global} samples cannot be shared by {ranks} ranks (it is not a multiple of {ranks}); the nearest that can are {below} and {above}")]
    NotDivisible {
        global: u64,
        ranks: u64,
        below: u64,
        above: u64,
    },
    #[error("micro-batch {batch} does not divide the {per_rank} samples each rank runs per step (global batch {global} over {ranks} ranks); micro-batches that do: {divisors}")]
    BatchNotDivisor {
        batch: u64,
        per_rank: u64,
        global: u64,
        ranks: u64,
        divisors: String,
    },
    #[error(
        "a global batch of {global} samples is too large: at most {most} on {ranks} rank(s) \
         ({max} per rank)"
    )]
    TooLarge {
        global: u64,
        ranks: u64,
        max: u64,
        most: u64,
    },
}

/// The largest global batch `ranks` ranks run: the most samples per rank a run takes
/// ([`super::file::MAX_SAMPLES_PER_RANK`]) on each.
pub fn max_global_batch(ranks: u32) -> u64 {
    super::file::MAX_SAMPLES_PER_RANK.saturating_mul(u64::from(ranks.max(1)))
}

/// The (micro-batch, accumulation) pairs the planner tries, smallest micro-batch first: the
/// batch ladder with no accumulation, or every way to split a global batch over `ranks`.
pub fn batch_options(options: &PlanOptions, ranks: u32) -> Result<Vec<(u64, u64)>, BatchError> {
    let Some(global) = options.global_batch else {
        return Ok(match options.batch {
            Some(b) => vec![(b, 1)],
            None => Vec::new(),
        });
    };
    let max = super::file::MAX_SAMPLES_PER_RANK;
    // The range first: the nearest multiples named below are then within it (`most` is one).
    let most = max_global_batch(ranks);
    let ranks = u64::from(ranks.max(1));
    if global > most {
        return Err(BatchError::TooLarge {
            global,
            ranks,
            max,
            most,
        });
    }
    if global == 0 || global % ranks != 0 {
        let below = global / ranks * ranks;
        return Err(BatchError::NotDivisible {
            global,
            ranks,
            below: below.max(ranks),
            above: below.saturating_add(ranks).min(most),
        });
    }
    let per_rank = global / ranks;
    let divisors: Vec<u64> = (1..=per_rank.isqrt())
        .filter(|d| per_rank % d == 0)
        .flat_map(|d| [d, per_rank / d])
        .collect::<std::collections::BTreeSet<u64>>()
        .into_iter()
        .collect();
    match options.batch {
        Some(b) if per_rank % b != 0 || b == 0 => Err(BatchError::BatchNotDivisor {
            batch: b,
            per_rank,
            global,
            ranks,
            divisors: divisors
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        }),
        Some(b) => Ok(vec![(b, per_rank / b)]),
        None => Ok(divisors.into_iter().map(|b| (b, per_rank / b)).collect()),
    }
}

/// Which micro-batch candidates, taken smallest first, can still fit once some did not. A
/// plan's peak grows with its micro-batch, so past one that does not fit no larger one does —
/// but where accumulating holds memory ([`Machine::accumulation_holds_memory`]), a larger
/// micro-batch that accumulates fewer micro-batches sheds that memory: past an accumulating one
/// that does not fit, the one that accumulates nothing (the last at a fixed global batch) still
/// may. The planner and the baselines walk their candidates by it.
#[derive(Debug, Default)]
pub(crate) struct PastFit {
    /// No later candidate fits.
    none: bool,
    /// No later candidate that accumulates fits.
    accumulating: bool,
}

impl PastFit {
    /// Whether a later candidate accumulating `accumulation` micro-batches cannot fit.
    pub(crate) fn rules_out(&self, accumulation: u64) -> bool {
        self.none || (self.accumulating && accumulation > 1)
    }

    /// A candidate accumulating `accumulation` micro-batches did not fit.
    pub(crate) fn missed(&mut self, accumulation: u64, m: &Machine) {
        if accumulation > 1 && m.accumulation_holds_memory() {
            self.accumulating = true;
        } else {
            self.none = true;
        }
    }
}

/// Micro-batch sizes tried by the automatic search: roughly 1.25–1.5× apart.
pub(crate) fn batch_ladder() -> impl Iterator<Item = u64> {
    let head = [1u64, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64];
    head.into_iter().chain((0..).flat_map(|i| {
        let base = 64u64 << i;
        [
            base + base / 4,
            base + base / 2,
            base + 3 * base / 4,
            2 * base,
        ]
    }))
}

impl<'m> Planner<'m> {
    /// Build every frontier needed to answer any budget up to `max_budget_bytes`. Plans that
    /// cannot fit it are left out, so a larger budget may miss some.
    ///
    /// Host memory is searched lazily: the tables built here ignore it (so they price every
    /// offloaded choice but never refuse one for the host budget). Where the best plan for a
    /// budget keeps within the host budget it is the best of all — the relaxation's optimum is
    /// feasible. Where it does not, [`Planner::best`] builds once a planner whose frontiers
    /// carry host memory and answers from it.
    pub fn new(
        model: &'m ModelSpec,
        machine: Machine,
        options: PlanOptions,
        max_budget_bytes: u64,
    ) -> Planner<'m> {
        Planner::with_host_limit(
            model,
            machine,
            options,
            max_budget_bytes,
            Search::relaxed(Reach::Every),
        )
    }

    /// The best plan within `budget_bytes` (and the host budget), searching only what can
    /// answer that one budget: the same plan as `Planner::new(…, budget).best(budget)`, found
    /// without the frontiers that only smaller budgets need.
    pub fn best_at(
        model: &'m ModelSpec,
        machine: Machine,
        options: PlanOptions,
        budget_bytes: u64,
    ) -> Result<Planned, NoFit> {
        let mut only = Planner::with_host_limit(
            model,
            machine.clone(),
            options.clone(),
            budget_bytes,
            Search {
                defer_proof: true,
                ..Search::relaxed(Reach::Only)
            },
        );
        let answer = match only.answer_deferred(budget_bytes) {
            Some(answer) => answer,
            None => only.best(budget_bytes),
        };
        match answer {
            Ok(p) => Ok(p),
            // Host memory was priced and no price finds a plan within the host budget: the
            // whole frontiers' planner would search host memory for this budget first, give up
            // the same way ([`Planner::exact_host`]) and price it to the same end.
            Err(nf) if only.host_priced() => Err(nf),
            // Nothing fits: the smallest budget that would is read off the whole frontiers,
            // which a search for one budget leaves out.
            Err(_) => Planner::new(model, machine, options, budget_bytes).best(budget_bytes),
        }
    }

    /// Where the relaxed search stopped at its first plan ([`Search::defer_proof`]): the
    /// answer [`Planner::best`] would give, found without summing the caps it left, where they
    /// cannot change it; `None` once they are summed (then `best` answers).
    ///
    /// They matter only if the relaxation's best plan keeps within the host budget (it is then
    /// the answer): that plan is at least as fast as the first one found. So where the first
    /// is over the host budget, host memory is searched (or priced) as `best` would, and the
    /// caps left are summed only if a plan within the host budget could be as fast as the
    /// first. The three-dimensional search answers exactly whatever they hold. Priced, the
    /// answer comes with its bound: no plan within the host budget is faster than it by more
    /// than [`Planned::host_gap_s`] (a fixed global batch: every plan runs the same samples).
    /// Where the caps left hold a faster plan over the host budget, the walk of prices starts
    /// from the first plan rather than from it; the bound holds either way.
    fn answer_deferred(&mut self, budget: u64) -> Option<Result<Planned, NoFit>> {
        self.pending.as_ref()?;
        let (host, first) = match (self.host_can_bind, self.best_ignoring_host(budget)) {
            (Some(host), Ok(first)) if first.prediction.host_bytes > host => (host, first),
            _ => {
                self.finish_pending();
                return None;
            }
        };
        let exact = self.exact_host(budget);
        if !exact.overflowed() {
            return Some(exact.best_ignoring_host(budget));
        }
        let priced = self.priced_host(budget, host, &first);
        // Every plan within the host budget takes at least the priced plan's step less its
        // gap: if that is longer than the first plan's, the relaxation's best plan (no slower
        // than the first) is over the host budget.
        if let Ok(p) = &priced {
            if p.host_gap_s.is_some_and(|gap| {
                p.prediction.step_time_s - gap
                    > first.prediction.step_time_s * (1.0 + ROUNDING_MARGIN)
            }) {
                return Some(priced);
            }
        }
        self.finish_pending();
        match self.best_ignoring_host(budget) {
            // The relaxation's best is the first plan after all: host memory was priced from
            // it, as `best` would.
            Ok(best) if best == first => Some(priced),
            _ => None,
        }
    }

    fn with_host_limit(
        model: &'m ModelSpec,
        machine: Machine,
        options: PlanOptions,
        max_budget_bytes: u64,
        search: Search,
    ) -> Planner<'m> {
        // Prices follow what runs the plan.
        let mut machine = machine;
        machine.set_target(options.target, model);
        let blocks = Blocks::of(model);
        let pins: HashMap<usize, Choice> = options.pins.iter().copied().collect();
        let graph = cost::OpGraph::of(model);
        let bases_1 = graph.bases(model, &machine, 1);
        let forced: HashMap<usize, bool> = options.block_recompute.iter().copied().collect();
        let classes = classify(&bases_1, &blocks, &pins, &forced);
        let host_can_bind = host_can_bind(
            &bases_1,
            &classes,
            &machine,
            &pins,
            options.max_split,
            options.target,
        );
        Planner {
            model,
            machine,
            blocks,
            options,
            classes,
            graph,
            tables: Vec::new(),
            searched: Vec::new(),
            host_limit: search.host_limit,
            host_can_bind,
            max_budget_bytes,
            host_price: search.host_price,
            exact_host: std::sync::OnceLock::new(),
            reach: search.reach,
            pending: None,
        }
        .search(search.seed, search.defer_proof)
    }

    /// Another search of the same model, machine and options: what does not depend on the
    /// search (the op graph, the blocks, the classes) is taken from this planner, not found
    /// again (host memory is searched by several planners in turn). `max_budget_bytes`: the
    /// largest budget its tables answer (for [`Reach::Only`], the one).
    fn derived(&self, search: Search, max_budget_bytes: u64) -> Planner<'m> {
        Planner {
            model: self.model,
            machine: self.machine.clone(),
            blocks: self.blocks.clone(),
            options: self.options.clone(),
            classes: self.classes.clone(),
            graph: self.graph.clone(),
            tables: Vec::new(),
            searched: Vec::new(),
            host_limit: search.host_limit,
            host_can_bind: self.host_can_bind,
            max_budget_bytes,
            host_price: search.host_price,
            exact_host: std::sync::OnceLock::new(),
            reach: search.reach,
            pending: None,
        }
        .search(search.seed, search.defer_proof)
    }

    /// Builds this planner's tables: every micro-batch's frontiers, or for [`Reach::Only`]
    /// what answers its one budget (`seed`: [`Search::seed`]).
    fn search(self, seed: Option<(u64, f64)>, defer_proof: bool) -> Planner<'m> {
        let mut planner = self;
        let max_budget_bytes = planner.max_budget_bytes;
        let pins: HashMap<usize, Choice> = planner.options.pins.iter().copied().collect();
        // A global batch the ranks cannot share leaves nothing to search (callers check it
        // first with [`batch_options`] to say why). Micro-batches past `max_batch` are never
        // priced: their figures would overflow (callers check a fixed one with `check_batch`).
        let most = super::max_batch(planner.model);
        let listed = batch_options(&planner.options, planner.machine.ranks).unwrap_or_default();
        let batches: Box<dyn Iterator<Item = (u64, u64)>> =
            if listed.is_empty() && planner.options.global_batch.is_none() {
                // A tiny model under a huge budget fits every batch: stop at the largest.
                Box::new(
                    batch_ladder()
                        .take_while(move |&b| b <= most)
                        .map(|b| (b, 1)),
                )
            } else if planner.options.global_batch.is_some() {
                // A micro-batch too large to price cannot make the global batch: leave it out
                // (clamping it would run fewer samples than asked).
                Box::new(listed.into_iter().filter(move |&(b, _)| b <= most))
            } else {
                Box::new(listed.into_iter().map(move |(b, a)| (b.clamp(1, most), a)))
            };
        let fixed = planner.options.batch.is_some();
        // (micro-batch, accumulation, least peak): the facts of each are prepared again when
        // its table is built, so only one micro-batch's are held at a time.
        let mut prepared: Vec<(u64, u64, u64)> = Vec::new();
        // For `Reach::Only`, each micro-batch's facts are kept, with the best throughput its
        // plans could reach within the budget.
        let mut kept: Vec<(f64, Prepared)> = Vec::new();
        let mut past = PastFit::default();
        for (batch, accumulation) in batches {
            if past.rules_out(accumulation) {
                continue;
            }
            let prep = planner.prepare(batch, accumulation, &pins);
            let min_peak = planner.min_peak(&prep);
            let fits = min_peak <= max_budget_bytes;
            if fits || fixed || prepared.is_empty() {
                prepared.push((batch, accumulation, min_peak));
                if planner.reach == Reach::Only {
                    let reach = planner.could_reach(&prep, max_budget_bytes);
                    let best = reach.iter().copied().fold(0.0, f64::max);
                    kept.push((best, Prepared { reach, ..prep }));
                }
            }
            if !fits && !fixed {
                past.missed(accumulation, &planner.machine);
            }
        }
        if planner.reach == Reach::Only {
            // Best first over every micro-batch's caps: the cap whose plans could reach the
            // most is summed next, whichever micro-batch it belongs to, so a plan found at one
            // micro-batch leaves out every cap of another that cannot beat it. (Summing a
            // micro-batch's caps all before the next, a cap of the first whose bound is just
            // above its own best plan was summed although another micro-batch beats it.) Of
            // equal bounds, the micro-batch sorted first (the most promising, then the largest).
            kept.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.batch.cmp(&a.1.batch)));
            let mut incumbent = Incumbent::default();
            if let Some((samples, cost)) = seed {
                // A plan of `samples` samples per step is known to cost `cost` seconds here:
                // as the best found so far, it leaves out what cannot beat it. Its peak is
                // unknown (the largest), so a plan as fast is never left out for its peak.
                // Throughputs of other sample counts weigh cost otherwise: no seed then.
                if kept
                    .iter()
                    .all(|(_, p)| p.batch * p.accumulation == samples)
                {
                    incumbent = Incumbent {
                        tput: samples as f64 / cost,
                        ..Incumbent::default()
                    };
                }
            }
            let mut building: Vec<Building> = kept
                .into_iter()
                .map(|(_, prep)| planner.start_building(prep, true))
                .collect();
            planner.searched = prepared.iter().map(|p| p.0).collect();
            // Only a relaxation stops early ([`Planner::best_at`] asks it of no other search).
            debug_assert!(
                !defer_proof || (planner.host_limit.is_none() && planner.host_price == 0.0)
            );
            let defer = defer_proof
                && planner.host_can_bind.is_some()
                && planner.options.global_batch.is_some();
            if planner.sum_caps(&mut building, &mut incumbent, defer) {
                // Its tables stay the planner's, in the micro-batches' order, while it waits.
                planner.tables = building
                    .iter_mut()
                    .map(|b| std::mem::take(&mut b.table))
                    .collect();
                planner.pending = Some(Pending {
                    building,
                    incumbent,
                });
            } else {
                planner.tables = finished(building);
            }
            return planner;
        }
        // Largest micro-batches first: their plans bound what a smaller one can still win. No
        // plan at batch `b` beats `b / (its fastest ops' times + step overhead)`, so a plan
        // already found that is faster than that, at peak `w`, makes every batch-`b` plan of
        // peak `w` or more useless at every budget: batch `b` need only cover budgets below `w`.
        planner.searched = prepared.iter().map(|p| p.0).collect();
        let step_overhead = planner.machine.step_overhead_s();
        let mut witnesses: Vec<(u64, f64)> = Vec::new();
        let mut tables: Vec<BatchTable> = Vec::with_capacity(prepared.len());
        for (batch, accumulation, min_peak) in prepared.into_iter().rev() {
            let prep = planner.prepare(batch, accumulation, &pins);
            let bound = planner.time_bound(&prep);
            // The best throughput a batch-`b` plan of peak `peak` could reach, with a margin
            // for rounding (sums in another order may differ in the last bits).
            let samples = (prep.batch * prep.accumulation) as f64;
            let could_reach =
                |peak: u64| samples / (bound.at(peak) + step_overhead) * (1.0 + ROUNDING_MARGIN);
            // Witnesses are a staircase: throughput `w.1` from peak `w.0` on. Batch `b` must
            // cover a budget only while it could match the witnesses' best within it; its bound
            // rises with the peak, so each stair is decided at its top.
            let mut cover = 0u64;
            for k in (0..=witnesses.len()).rev() {
                let bottom = if k == 0 { 0 } else { witnesses[k - 1].0 };
                if bottom > max_budget_bytes {
                    continue;
                }
                let top = witnesses.get(k).map_or(max_budget_bytes, |w| {
                    max_budget_bytes.min(w.0.saturating_sub(1))
                });
                let best = if k == 0 { 0.0 } else { witnesses[k - 1].1 };
                if could_reach(top) >= best {
                    cover = top;
                    break;
                }
            }
            if cover < max_budget_bytes && cover < min_peak {
                continue;
            }
            let table = planner.build(prep, cover);
            let samples = table.samples();
            let fixed = planner.machine.fixed_bytes();
            witnesses.extend(table.caps.iter().flat_map(|(cap, f)| {
                f.iter()
                    .map(move |p| (fixed + p.mem + cap, samples / (p.time + step_overhead)))
            }));
            witnesses.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
            witnesses.dedup_by(|later, kept| later.1 <= kept.1);
            tables.push(table);
        }
        tables.reverse();
        planner.tables = tables;
        planner
    }

    /// Sums caps of the micro-batches being built, the most promising first, until none left
    /// could beat the best plan found (`incumbent`) or a three-dimensional sum gives up.
    /// `defer`: stop at the first plan found instead, and say whether caps that could beat it
    /// are left ([`Search::defer_proof`]).
    fn sum_caps(&self, building: &mut [Building], incumbent: &mut Incumbent, defer: bool) -> bool {
        let max_budget_bytes = self.max_budget_bytes;
        loop {
            let mut next: Option<(usize, f64)> = None;
            for (k, b) in building.iter().enumerate() {
                if let Some(r) = b.next_reach() {
                    if next.is_none_or(|(_, best)| r > best) {
                        next = Some((k, r));
                    }
                }
            }
            let Some((k, could_reach)) = next else {
                return false;
            };
            if could_reach < incumbent.tput {
                // The most promising cap left cannot beat the plan found: nor can any.
                return false;
            }
            if defer && incumbent.tput > 0.0 {
                return true;
            }
            self.sum_next(&mut building[k], max_budget_bytes, Some(&mut *incumbent));
            if building[k].table.arena.overflow {
                // The three-dimensional search gave up: its tables will not be read
                // ([`Planner::best`] prices host memory instead), so nothing more is summed.
                return false;
            }
        }
    }

    /// Sums the caps a relaxed search left ([`Pending`]), as it would have without stopping.
    fn finish_pending(&mut self) {
        let Some(Pending {
            mut building,
            mut incumbent,
        }) = self.pending.take()
        else {
            return;
        };
        for (b, t) in building.iter_mut().zip(std::mem::take(&mut self.tables)) {
            b.table = t;
        }
        self.sum_caps(&mut building, &mut incumbent, false);
        self.tables = finished(building);
    }

    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// Micro-batch sizes searched: the ladder up to the last that fits the largest budget
    /// (or the fixed one). Some may have no frontier: larger ones beat them at every budget.
    pub fn batches(&self) -> Vec<u64> {
        self.searched.clone()
    }

    /// Largest throughput within `budget_bytes` (and the host budget).
    pub fn best(&self, budget_bytes: u64) -> Result<Planned, NoFit> {
        let relaxed = self.best_ignoring_host(budget_bytes);
        let Some(host) = self.host_can_bind.filter(|_| self.host_limit.is_none()) else {
            return relaxed;
        };
        match &relaxed {
            Ok(p) if p.prediction.host_bytes <= host => relaxed,
            // No plan fits the device budget even ignoring the host's.
            Err(_) => relaxed,
            // Over the host budget: ask the planner that counts host memory, or where that
            // search is too large, price host memory.
            Ok(over) => {
                let exact = self.exact_host(budget_bytes);
                if !exact.overflowed() {
                    return exact.best_ignoring_host(budget_bytes);
                }
                self.priced_host(budget_bytes, host, over)
            }
        }
    }

    /// Whether a three-dimensional search gave up ([`frontier::MAX_PAIRS_3D`]).
    fn overflowed(&self) -> bool {
        self.tables.iter().any(|t| t.arena.overflow)
    }

    /// The best plan within the host budget `host` found by pricing host memory: a plan that
    /// minimises step time + λ · host bytes within the device budget is the best of all plans
    /// of its host memory or less. λ rises from a step's time over the whole host budget until
    /// the plan fits the host; then each next λ is the one at which the fastest plan over the
    /// host budget and the fastest within it found so far cost the same (the breakpoint of
    /// the Lagrangian between them), raised by [`PROBE_ABOVE_TIE`]. A search at that λ finds
    /// either a plan between them, which replaces one, or none cheaper, and then the one within
    /// is the best within the budget the pricing can reach at that λ — in a few searches where
    /// bisecting λ took a dozen. With a fixed global batch every plan runs the same samples, so
    /// any plan's step time is at least `T(p) + λ·(host(p) − host)`: the gap to the best is at
    /// most `λ·(host − host(p))`.
    fn priced_host(&self, budget: u64, host: u64, relaxed: &Planned) -> Result<Planned, NoFit> {
        // Each price answers this one budget, whatever budgets this planner's own tables
        // answer: a search for one budget finds the same plan as the whole one (a budget change
        // in the dashboard then costs these searches, not whole frontiers at every price).
        let at = |price: f64, seed: Option<(u64, f64)>| -> Result<Planned, NoFit> {
            self.derived(
                Search {
                    host_price: price,
                    seed,
                    ..Search::relaxed(Reach::Only)
                },
                budget,
            )
            .best_ignoring_host(budget)
        };
        let fits = |p: &Planned| p.prediction.host_bytes <= host;
        let figures = |p: &Planned| (p.prediction.step_time_s, p.prediction.host_bytes as f64);
        // (price, step time, host bytes) of the fastest plan over the host budget so far.
        let (t0, h0) = figures(relaxed);
        let mut over = (0.0, t0, h0);
        let mut price = t0 / host.max(1) as f64;
        let mut found: Option<(f64, Planned)> = None;
        for _ in 0..24 {
            // The relaxation's plan fits the device budget, so a search that finds none has
            // priced every plan out of reach (the price has grown past what a step's time can
            // carry): none is within the host budget at any price the walk can use.
            let Ok(p) = at(price, None) else { break };
            if fits(&p) {
                found = Some((price, p));
                break;
            }
            let (t, h) = figures(&p);
            over = (price, t, h);
            price *= 8.0;
        }
        let Some((mut within_price, mut best)) = found else {
            return Err(NoFit {
                min_budget_bytes: None,
                host_budget_bytes: Some(host),
            });
        };
        // The price at which `best` is known to be the cheapest plan.
        let mut proven = within_price;
        for _ in 0..10 {
            let (t, h) = figures(&best);
            let tie = (t - over.1) / (over.2 - h);
            // Off the bracket (micro-batches of other sizes weigh time differently): halve it.
            let price = if tie > over.0 && tie < within_price {
                (tie * (1.0 + PROBE_ABOVE_TIE)).min(0.5 * (tie + within_price))
            } else {
                0.5 * (over.0 + within_price)
            };
            // Only a plan cheaper than `best` at this price matters (else `best` is proven):
            // the search starts from `best`'s cost, and finding nothing as cheap is that proof.
            let seed = (best.plan.batch * best.plan.accumulation, t + price * h);
            let Ok(p) = at(price, Some(seed)) else {
                proven = price;
                break;
            };
            let (pt, ph) = figures(&p);
            if pt + price * ph >= (t + price * h) * (1.0 - 1e-9) {
                // Nothing cheaper than `best` at this price.
                proven = price;
                break;
            }
            if fits(&p) {
                within_price = price;
                proven = price;
                best = p;
            } else {
                over = (price, pt, ph);
            }
        }
        let fixed_batch = self.options.global_batch.is_some();
        best.host_gap_s =
            fixed_batch.then(|| proven * host.saturating_sub(best.prediction.host_bytes) as f64);
        Ok(best)
    }

    /// Whether a query has needed the planner that counts host memory (it was over budget).
    pub fn host_binds(&self) -> bool {
        self.exact_host.get().is_some()
    }

    /// Whether the host budget binds and the model was too large to search host memory
    /// exactly: plans were found by pricing it ([`Planner::priced_host`]), and there is no
    /// [`Planner::curve`].
    pub fn host_priced(&self) -> bool {
        self.exact_host
            .get()
            .is_some_and(|exact| exact.overflowed())
    }

    /// The planner that counts host memory, built by the first query over the host budget
    /// (`budget`, that query's).
    fn exact_host(&self, budget: u64) -> &Planner<'m> {
        self.exact_host.get_or_init(|| {
            let search = Search {
                host_limit: self.host_can_bind,
                ..Search::relaxed(self.reach)
            };
            if self.reach == Reach::Every {
                // The search for this one budget first, as `plan` runs it. Where it gives up,
                // host memory is priced at every budget, as `plan` prices it. The search for
                // every budget sums the same frontiers cut at a larger budget, so it gives up
                // too, but later (tinyllama-1.1b on `cpu`: ~1 ms against ~90) — unless the
                // sum that gave up here belongs to a micro-batch that larger ones beat, which
                // it covers only below this budget: such a case is priced here, not searched.
                let one = self.derived(
                    Search {
                        reach: Reach::Only,
                        ..search
                    },
                    budget,
                );
                if one.overflowed() {
                    return Box::new(one);
                }
            }
            Box::new(self.derived(search, self.max_budget_bytes))
        })
    }

    /// The best plan of this planner's own tables (host memory counted only in a
    /// three-dimensional planner).
    fn best_ignoring_host(&self, budget_bytes: u64) -> Result<Planned, NoFit> {
        let mut best: Option<(f64, TieKey, usize, Point)> = None;
        for (ti, table) in self.tables.iter().enumerate() {
            for (cap, f) in &table.caps {
                let Some(usable) = budget_bytes
                    .checked_sub(self.machine.fixed_bytes())
                    .and_then(|u| u.checked_sub(*cap))
                else {
                    continue;
                };
                if let Some(p) = frontier::best_within(f, usable, self.host_limit.is_some()) {
                    let tput = table.samples() / (p.time + self.machine.step_overhead_s());
                    let key = (p.mem + cap, *cap, table.batch);
                    if best.is_none_or(|(bt, bkey, _, _)| better(tput, key, (bt, bkey))) {
                        best = Some((tput, key, ti, *p));
                    }
                }
            }
        }
        let Some((_, _, ti, point)) = best else {
            let min_budget_bytes = self
                .tables
                .iter()
                .filter_map(|t| t.cheapest(self.machine.fixed_bytes()))
                .min();
            return Err(NoFit {
                min_budget_bytes,
                host_budget_bytes: self.host_limit.filter(|_| min_budget_bytes.is_none()),
            });
        };
        let table = &self.tables[ti];
        let plan = self.reconstruct(table, point.node);
        let prediction =
            evaluate_with(self.model, &self.machine, &plan, &table.bases, &self.blocks);
        Ok(Planned {
            plan,
            prediction,
            coarsened_bytes: table.coarsened,
            host_gap_s: None,
            trainer_prediction: None,
        })
    }

    /// Points of the memory → throughput frontier over all micro-batch sizes, for charts:
    /// (peak bytes, samples/s).
    ///
    /// From the planner that counts host memory once a query has needed it; before that the
    /// chart ignores the host budget (every plan found so far kept within it).
    ///
    /// Empty where host memory was priced ([`Planner::host_priced`]): the three-dimensional
    /// search gave up, so no frontier says what each budget buys within the host budget.
    pub fn curve(&self) -> Vec<(u64, f64)> {
        if let Some(exact) = self.exact_host.get() {
            return if exact.overflowed() {
                Vec::new()
            } else {
                exact.curve()
            };
        }
        let mut pts: Vec<(u64, f64)> = Vec::new();
        for table in &self.tables {
            for (cap, f) in &table.caps {
                for p in f {
                    let peak = self.machine.fixed_bytes() + p.mem + cap;
                    pts.push((
                        peak,
                        table.samples() * f64::from(self.machine.ranks)
                            / (p.time + self.machine.step_overhead_s()),
                    ));
                }
            }
        }
        pts.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut out: Vec<(u64, f64)> = Vec::new();
        for p in pts {
            if out.last().is_none_or(|l| p.1 > l.1) {
                out.push(p);
            }
        }
        out
    }

    /// Everything about micro-batch `batch` that does not depend on the budget: the ops'
    /// options, the transient caps worth a frontier and what each cap leaves each class.
    fn prepare(&self, batch: u64, accumulation: u64, pins: &HashMap<usize, Choice>) -> Prepared {
        let mut bases = self.graph.bases(self.model, &self.machine, batch);
        cost::set_accumulation(&mut bases, accumulation);
        let remat = self.blocks.remat_at(&bases);
        let (opts, keep) = self.class_options(&bases, pins, &remat);
        // Transient the plan cannot avoid: every op's cheapest choice.
        let floor = opts
            .iter()
            .map(|o| o.first().map_or(0, |x| x.transient))
            .max()
            .unwrap_or(0);
        let caps = self.candidate_caps(&opts, &remat, &keep, floor);
        let (caps, coarsened) = self.fit_caps(caps, &keep);
        let class_floor = self.class_floors(&opts, batch);
        let all_floor: u64 = class_floor.iter().fold(0u64, |a, &b| a.saturating_add(b));
        let steps = self.cap_steps(caps, &opts, &remat, &keep);
        Prepared {
            batch,
            accumulation,
            bases,
            opts,
            remat,
            keep,
            transient_floor: floor,
            class_floor,
            all_floor,
            steps,
            coarsened,
            reach: Vec::new(),
        }
    }

    /// Each op's undominated options, sorted by transient, and each class's third way where
    /// it is open ([`KeepSlots`]).
    ///
    /// Options of each class's first instance: the other instances price the same (that is
    /// what makes them one class), so their lists stay empty and are never read.
    fn class_options(
        &self,
        bases: &[OpBase],
        pins: &HashMap<usize, Choice>,
        remat: &[u64],
    ) -> (Vec<Vec<Opt>>, Vec<Option<KeepSlots>>) {
        let m = &self.machine;
        let mut opts: Vec<Vec<Opt>> = vec![Vec::new(); bases.len()];
        let mut keep = Vec::with_capacity(self.classes.len());
        for class in &self.classes {
            let rep = &class.instances[0];
            let all: Vec<Vec<Opt>> = rep
                .iter()
                .map(|&i| {
                    let base = &bases[i];
                    let choices = match pins.get(&i) {
                        Some(c) => vec![*c],
                        None => self.options.target.choices(base, m, self.options.max_split),
                    };
                    let mut v: Vec<Opt> = choices
                        .into_iter()
                        .map(|choice| {
                            option(base, choice, m, self.host_limit.is_some(), self.host_price)
                        })
                        .collect();
                    v.sort_by_key(|o| o.transient);
                    v
                })
                .collect();
            // The third way is worth a frontier where keeping saves some kept op time.
            let kept: Vec<bool> = rep
                .iter()
                .map(|&i| self.blocks.reruns(i) && bases[i].params > 0)
                .collect();
            let open = self.recomputes(class)
                && kept
                    .iter()
                    .zip(&all)
                    .any(|(&k, v)| k && v.iter().any(|o| o.time_k < o.time_r));
            let slots = open.then(|| {
                let mut before = 0u64;
                let extra = rep
                    .iter()
                    .zip(&kept)
                    .map(|(&i, &k)| {
                        let e = remat[i] + before;
                        if k {
                            before += kept_weight_bytes(&bases[i], m);
                        }
                        e
                    })
                    .collect();
                let mut k = KeepSlots {
                    extra,
                    kept,
                    floor: 0,
                };
                k.floor = all
                    .iter()
                    .enumerate()
                    .map(|(s, v)| {
                        v.iter()
                            .filter(|o| k.time(s, o).is_some())
                            .map(|o| o.transient + k.extra[s])
                            .min()
                            .unwrap_or(u64::MAX)
                    })
                    .max()
                    .unwrap_or(0);
                k
            });
            for ((s, &i), mut v) in rep.iter().enumerate().zip(all) {
                let kept = slots.as_ref().is_some_and(|k| k.kept[s]);
                if kept {
                    for o in &mut v {
                        o.time_rb = o.time_r.min(o.time_k);
                    }
                }
                opts[i] = undominated(v, kept);
            }
            keep.push(slots);
        }
        (opts, keep)
    }

    /// Whether `class`'s instances may run recomputed (a block class with recomputation on, as
    /// its blocks are fixed or else as the options allow), which gives each slot a second,
    /// recomputed count. A fix wins over [`PlanOptions::recompute`]: blocks fixed on recompute
    /// even where the others may not.
    fn recomputes(&self, class: &Class) -> bool {
        class.blocks.is_some() && class.forced.unwrap_or(self.options.recompute)
    }

    /// Every transient some option (or recomputed block option) reaches, from `floor` up,
    /// sorted, distinct, and merged at the resolution.
    fn candidate_caps(
        &self,
        opts: &[Vec<Opt>],
        remat: &[u64],
        keep: &[Option<KeepSlots>],
        floor: u64,
    ) -> Vec<u64> {
        let mut caps: Vec<u64> = opts.iter().flatten().map(|o| o.transient).collect();
        for (class, keep) in self.classes.iter().zip(keep) {
            if !self.recomputes(class) {
                continue;
            }
            for (s, &i) in class.instances[0].iter().enumerate() {
                caps.extend(opts[i].iter().map(|o| o.transient + remat[i]));
                if let Some(k) = keep {
                    caps.extend(
                        opts[i]
                            .iter()
                            .filter(|o| k.time(s, o).is_some())
                            .map(|o| o.transient + k.extra[s])
                            .filter(|&c| c >= k.floor),
                    );
                }
            }
        }
        caps.retain(|&c| c >= floor);
        caps.sort_unstable();
        caps.dedup();
        let res = self.options.resolution_bytes;
        if res > 0 {
            caps = merge_caps(&caps, res);
        }
        caps
    }

    /// `caps`, merged coarser when there are too many, with the resolution they were merged
    /// at (0 if they were not).
    ///
    /// Every cap is a sum over every slot of every class: past `MAX_CAP_SLOTS` pairs, merge
    /// caps at a resolution that doubles until they fit (each cap is some option's
    /// transient, so distinct caps give distinct keys: the count is the steps').
    fn fit_caps(&self, caps: Vec<u64>, keep: &[Option<KeepSlots>]) -> (Vec<u64>, u64) {
        let slots: usize = self
            .classes
            .iter()
            .zip(keep)
            .map(|(c, k)| {
                let n = c.instances[0].len();
                match (self.recomputes(c), k) {
                    (true, Some(_)) => 3 * n,
                    (true, None) => 2 * n,
                    _ => n,
                }
            })
            .sum::<usize>()
            .max(1);
        let most_caps = (MAX_CAP_SLOTS / slots).max(1);
        if caps.len() <= most_caps {
            return (caps, 0);
        }
        let mut coarse = self.options.resolution_bytes.max(1 << 20);
        loop {
            let merged = merge_caps(&caps, coarse);
            if merged.len() <= most_caps || merged.len() == 1 {
                return (merged, coarse);
            }
            coarse = coarse.saturating_mul(2);
        }
    }

    /// Least memory all instances of each class hold, under any cap: what the rest of the
    /// model adds at the very least to a partial sum.
    fn class_floors(&self, opts: &[Vec<Opt>], batch: u64) -> Vec<u64> {
        self.classes
            .iter()
            .map(|class| {
                let rep = &class.instances[0];
                let min_of = |f: fn(&Opt) -> u64| -> u64 {
                    rep.iter()
                        .map(|&i| opts[i].iter().map(f).min().unwrap_or(0))
                        .sum()
                };
                let plain = min_of(|o| o.held);
                let one = match self.kept_bytes(class, batch) {
                    Some(kept) => plain.min(min_of(|o| o.held_r) + kept),
                    None => plain,
                };
                one.saturating_mul(class.instances.len() as u64)
            })
            .collect()
    }

    /// The caps worth a frontier, each with what it leaves each class.
    ///
    /// Caps that leave every class the same feasible options give the same frontier: only
    /// the smallest of them (the tightest peak for those plans) is worth a sum.
    fn cap_steps(
        &self,
        caps: Vec<u64>,
        opts: &[Vec<Opt>],
        remat: &[u64],
        keep: &[Option<KeepSlots>],
    ) -> Vec<(u64, Vec<Vec<usize>>)> {
        let mut previous_keys: Option<Vec<Vec<usize>>> = None;
        let mut steps: Vec<(u64, Vec<Vec<usize>>)> = Vec::new();
        for cap in caps {
            let keys = self.cap_keys(cap, opts, remat, keep);
            if previous_keys.as_ref() == Some(&keys) {
                continue;
            }
            previous_keys = Some(keys.clone());
            steps.push((cap, keys));
        }
        steps
    }

    /// What `cap` leaves each class: per slot, how many options fit (then, for blocks that
    /// may recompute, how many fit recomputed, then how many fit under the third way's extra,
    /// where open).
    fn cap_keys(
        &self,
        cap: u64,
        opts: &[Vec<Opt>],
        remat: &[u64],
        keep: &[Option<KeepSlots>],
    ) -> Vec<Vec<usize>> {
        self.classes
            .iter()
            .zip(keep)
            .map(|(class, keep)| {
                let rep = &class.instances[0];
                // Feasible options are a prefix of each slot's list (sorted by transient).
                let mut key: Vec<usize> = rep
                    .iter()
                    .map(|&i| opts[i].partition_point(|o| o.transient <= cap))
                    .collect();
                if self.recomputes(class) {
                    key.extend(
                        rep.iter()
                            .map(|&i| opts[i].partition_point(|o| o.transient + remat[i] <= cap)),
                    );
                    if let Some(k) = keep {
                        key.extend(rep.iter().enumerate().map(|(s, &i)| {
                            opts[i].partition_point(|o| o.transient + k.extra[s] <= cap)
                        }));
                    }
                }
                key
            })
            .collect()
    }

    /// The smallest peak any plan at this micro-batch reaches (before frontiers are thinned).
    fn min_peak(&self, prep: &Prepared) -> u64 {
        let least = |slots: &[usize], key: &[usize], mem: fn(&Opt) -> u64| -> Option<u64> {
            slots.iter().zip(key).try_fold(0u64, |acc, (&i, &k)| {
                let m = prep.opts[i][..k].iter().map(mem).min()?;
                Some(acc.saturating_add(m))
            })
        };
        prep.steps
            .iter()
            .filter_map(|(cap, keys)| {
                self.classes.iter().zip(keys).try_fold(
                    self.machine.fixed_bytes().saturating_add(*cap),
                    |acc, (class, key)| {
                        let rep = &class.instances[0];
                        let plain = least(rep, &key[..rep.len()], |o| o.held);
                        let recomputed = self.kept_bytes(class, prep.batch).and_then(|kept| {
                            let held = least(rep, key.get(rep.len()..)?, |o| o.held_r)?;
                            Some(held.saturating_add(kept))
                        });
                        let one = match (plain, recomputed) {
                            _ if class.forced == Some(true) => recomputed?,
                            (Some(a), Some(b)) => a.min(b),
                            (a, b) => a.or(b)?,
                        };
                        Some(acc.saturating_add(one.saturating_mul(class.instances.len() as u64)))
                    },
                )
            })
            .min()
            .unwrap_or(u64::MAX)
    }

    /// What a recomputed instance of `class` keeps (its block's input) at `batch`, when the
    /// class is a block that may recompute (as fixed, or as the options allow).
    fn kept_bytes(&self, class: &Class, batch: u64) -> Option<u64> {
        let b = class.blocks.as_ref().filter(|_| self.recomputes(class))?[0];
        Some(
            self.machine
                .activation_bytes(self.blocks.input_bytes_per_sample[b])
                * batch,
        )
    }

    /// A lower bound on the step time of any plan at this micro-batch, by its peak.
    ///
    /// For any `λ ≥ 0` every plan has `time + λ·held ≥ g(λ)`, the sum over ops of their least
    /// `time + λ·held` (per instance, recomputed or not). Held memory is at most the peak less
    /// the overhead and the least transient, so `time ≥ g(λ) − λ·(peak − fixed)`; the bound is
    /// the best of these lines over a spread of `λ` (the lower convex hull of the frontier,
    /// sampled). `λ = 0` gives the fastest ops' time, whatever their memory.
    fn time_bound(&self, prep: &Prepared) -> TimeBound {
        let mut slopes: Vec<f64> = Vec::new();
        for class in &self.classes {
            for &i in &class.instances[0] {
                for pick in [|o: &Opt| (o.held, o.time), |o: &Opt| (o.held_r, o.time_rb)] {
                    let mut pts: Vec<(u64, f64)> = prep.opts[i].iter().map(pick).collect();
                    pts.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
                    slopes.extend(pts.windows(2).filter_map(|w| {
                        let s = (w[0].1 - w[1].1) / (w[1].0 - w[0].0) as f64;
                        (s.is_finite() && s > 0.0).then_some(s)
                    }));
                }
            }
        }
        let (lo, hi) = slopes.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &s| {
            (lo.min(s), hi.max(s))
        });
        let mut lambdas = vec![0.0];
        if hi > 0.0 {
            const SAMPLES: usize = 24;
            let ratio = (hi / lo).powf(1.0 / (SAMPLES - 1) as f64);
            lambdas.extend((0..SAMPLES).map(|k| lo * ratio.powi(k as i32)));
        }
        let least = |slots: &[usize], lambda: f64, pick: fn(&Opt) -> (u64, f64)| -> f64 {
            slots
                .iter()
                .map(|&i| {
                    prep.opts[i]
                        .iter()
                        .map(|o| {
                            let (held, time) = pick(o);
                            time + lambda * held as f64
                        })
                        .fold(f64::INFINITY, f64::min)
                })
                .sum()
        };
        let lines = lambdas
            .into_iter()
            .map(|lambda| {
                let g: f64 = self
                    .classes
                    .iter()
                    .map(|class| {
                        let rep = &class.instances[0];
                        let plain = least(rep, lambda, |o| (o.held, o.time));
                        let one = match self.kept_bytes(class, prep.batch) {
                            Some(kept) => {
                                let recomputed = least(rep, lambda, |o| (o.held_r, o.time_rb))
                                    + lambda * kept as f64;
                                if class.forced == Some(true) {
                                    recomputed
                                } else {
                                    plain.min(recomputed)
                                }
                            }
                            None => plain,
                        };
                        one * class.instances.len() as f64
                    })
                    .sum();
                (g, lambda)
            })
            .collect();
        TimeBound {
            lines,
            fixed_bytes: self
                .machine
                .fixed_bytes()
                .saturating_add(prep.transient_floor),
        }
    }

    /// The linear relaxation of all `class`'s instances under what `key` admits (each
    /// instance plain, recomputed or keeping weights, as open; `keep`: the class's third way);
    /// `None` when no way is open.
    fn class_hull(
        &self,
        class: &Class,
        key: &[usize],
        opts: &[Vec<Opt>],
        batch: u64,
        keep: Option<&KeepSlots>,
    ) -> Option<Hull> {
        let rep = &class.instances[0];
        let n = rep.len();
        let way = |counts: &[usize], priced: Priced| -> Option<Hull> {
            rep.iter()
                .zip(counts)
                .enumerate()
                .try_fold(Hull::default(), |acc, (s, (&i, &k))| {
                    // Admitted by the count already: any cap passes.
                    let h = Hull::of(
                        opts[i][..k]
                            .iter()
                            .filter_map(|o| priced.of(s, o, u64::MAX))
                            .map(|(m, t)| (m as f64, t)),
                    )?;
                    Some(acc.plus(&h))
                })
        };
        let plain = (class.forced != Some(true))
            .then(|| way(&key[..n], Priced::Plain))
            .flatten();
        let zeros = vec![0u64; n];
        let recomputed = |counts: Option<&[usize]>, priced: Priced| {
            let kept = self.kept_bytes(class, batch)?;
            Some(way(counts?, priced)?.shifted(kept as f64, 0.0))
        };
        let either = |a: Option<Hull>, b: Option<Hull>| match (a, b) {
            (Some(a), Some(b)) => Some(a.either(&b)),
            (a, b) => a.or(b),
        };
        let again = recomputed(key.get(n..2 * n), Priced::Recompute(&zeros));
        let kept = keep.and_then(|k| recomputed(key.get(2 * n..3 * n), Priced::Keep(k)));
        let one = either(either(plain, again), kept)?;
        Some(one.times(class.instances.len() as f64))
    }

    /// Per step of `prep`, the most throughput (samples per second, with a margin for sums in
    /// another order) a plan under that cap could reach within `budget`; 0 where none fits.
    fn could_reach(&self, prep: &Prepared, budget: u64) -> Vec<f64> {
        let room = budget.saturating_sub(self.machine.fixed_bytes());
        let samples = (prep.batch * prep.accumulation) as f64;
        let step_overhead = self.machine.step_overhead_s();
        let lean = self.lean_options(&prep.opts, &prep.keep);
        prep.steps
            .iter()
            .map(|(cap, keys)| {
                let t = room.checked_sub(*cap).map_or(f64::INFINITY, |held| {
                    self.cap_time_bound(&lean, keys, prep.batch, held)
                });
                samples / (t + step_overhead) * (1.0 + ROUNDING_MARGIN)
            })
            .collect()
    }

    /// For each op of the classes' first instances and each count `k` of admitted options (a
    /// prefix of its list), the (held bytes, time) of those of the first `k` that no other of
    /// them beats on both, kept and recomputed: all [`Planner::cap_time_bound`] reads.
    ///
    /// An option another is no worse than on both never decides that bound's minimum: with
    /// `λ ≥ 0`, `t' ≤ t` and `h' ≤ h` give `t' + λ·h' ≤ t + λ·h` in floating point too (every
    /// step rounds monotonically), and of equal values the minimum takes the least held
    /// bytes, so the minimum's (value, held bytes) are the same bit for bit without it.
    fn lean_options(&self, opts: &[Vec<Opt>], keep: &[Option<KeepSlots>]) -> LeanOptions {
        let mut lean = LeanOptions {
            first: vec![(0, 0, 0); opts.len()],
            ranges: Vec::new(),
            points: Vec::new(),
        };
        let mut scratch = Vec::new();
        for (class, keep) in self.classes.iter().zip(keep) {
            for (s, &i) in class.instances[0].iter().enumerate() {
                let plain = lean.add(opts[i].iter().map(|o| Some((o.held, o.time))), &mut scratch);
                let recomputed = lean.add(
                    opts[i].iter().map(|o| Some((o.held_r, o.time_r))),
                    &mut scratch,
                );
                // The third way's points where open (an option it does not admit adds none).
                let kept = match keep {
                    Some(k) => lean.add(
                        opts[i].iter().map(|o| k.time(s, o).map(|t| (o.held_r, t))),
                        &mut scratch,
                    ),
                    None => recomputed,
                };
                lean.first[i] = (plain, recomputed, kept);
            }
        }
        lean
    }

    /// A lower bound on the step time (without the step overhead) of every plan whose ops
    /// keep to `keys` (what a cap admits, [`Planner::cap_keys`]) and hold at most `held`
    /// bytes; infinite when none can.
    ///
    /// For any `λ ≥ 0`, every such plan has `time ≥ g(λ) − λ·held`, `g(λ)` the sum over
    /// instances of their least `time + λ·held` (the Lagrangian dual of the knapsack: its
    /// linear relaxation). The bound is concave in `λ` and peaks where the held memory of
    /// the minimisers crosses `held`; that `λ` is found where the tangents at the two ends of
    /// a bracket cross, a breakpoint of the dual a step (every `λ` tried gives a valid bound:
    /// the best is kept). Bisecting it instead took ~40 evaluations a cap, 70 % of
    /// [`Planner::could_reach`]. Summing the classes' [`Planner::class_hull`]s and reading
    /// them at `held` gives the same bound exactly, but building the hulls for every cap of
    /// every micro-batch made `plan` about 10 % slower (measured 2026-11-27), so the hulls are
    /// built only for the caps that are summed.
    fn cap_time_bound(
        &self,
        lean: &LeanOptions,
        keys: &[Vec<usize>],
        batch: u64,
        held: u64,
    ) -> f64 {
        // (g(λ), the held bytes of the minimisers); None when some instance has no way.
        let dual = |lambda: f64| -> Option<(f64, f64)> {
            let (mut g, mut mem) = (0.0f64, 0.0f64);
            for (class, key) in self.classes.iter().zip(keys) {
                let rep = &class.instances[0];
                let n = rep.len();
                let least = |counts: &[usize], way: Way| -> Option<(f64, f64)> {
                    rep.iter()
                        .zip(counts)
                        .try_fold((0.0, 0.0), |(g, m), (&i, &k)| {
                            let (v, h) = lean
                                .of(i, way, k)
                                .iter()
                                .map(|&(h, t)| (t + lambda * h as f64, h as f64))
                                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))?;
                            Some((g + v, m + h))
                        })
                };
                let plain = (class.forced != Some(true))
                    .then(|| least(&key[..n], Way::Plain))
                    .flatten();
                // The recomputed ways, each with the block input it keeps; the third reads its
                // own counts (after the recomputed way's) where open.
                let recomputed = |way: Way, counts: Option<&[usize]>| {
                    let kept = self.kept_bytes(class, batch)?;
                    let (v, h) = least(counts?, way)?;
                    Some((v + lambda * kept as f64, h + kept as f64))
                };
                let better = |a: Option<(f64, f64)>, b: Option<(f64, f64)>| match (a, b) {
                    (Some(a), Some(b)) => Some(if b.0 < a.0 || (b.0 == a.0 && b.1 < a.1) {
                        b
                    } else {
                        a
                    }),
                    (a, b) => a.or(b),
                };
                let (v, h) = better(
                    better(plain, recomputed(Way::Recompute, key.get(n..2 * n))),
                    recomputed(Way::Keep, key.get(2 * n..3 * n)),
                )?;
                let n = class.instances.len() as f64;
                g += n * v;
                mem += n * h;
            }
            Some((g, mem))
        };
        let room = held as f64;
        let Some((g0, m0)) = dual(0.0) else {
            return f64::INFINITY;
        };
        if m0 <= room {
            // The fastest choices fit: nothing better can be said.
            return g0;
        }
        let mut best = g0;
        // Bracket the crossing: raise λ until the minimisers fit (or their memory stops
        // falling: then no plan fits). (λ, g(λ), held of the minimisers) at each end.
        let mut lo = (0.0f64, g0, m0);
        let mut hi = (1e-12f64, 0.0, 0.0);
        loop {
            let (g, m) = dual(hi.0).expect("open at λ = 0");
            best = best.max(g - hi.0 * room);
            hi = (hi.0, g, m);
            if m <= room {
                break;
            }
            lo = hi;
            hi.0 *= 4.0;
            if hi.0 > 1e6 {
                return f64::INFINITY;
            }
        }
        // `g` is concave and `m` is its slope: `g(λ) ≤ g(λ₀) + m₀·(λ − λ₀)` at either end, so
        // the bound is at most where the two tangents cross (the one rising, the other not).
        // `g` there meeting the tangents is the peak; else the minimisers there replace the
        // end on their side. Each step passes a breakpoint of `g`, so this ends in a few.
        for _ in 0..64 {
            if hi.2 >= lo.2 {
                break;
            }
            let lambda = ((hi.1 - hi.0 * hi.2) - (lo.1 - lo.0 * lo.2)) / (lo.2 - hi.2);
            if !(lambda > lo.0 && lambda < hi.0) {
                break;
            }
            let ceiling = lo.1 + lo.2 * (lambda - lo.0) - lambda * room;
            let (g, m) = dual(lambda).expect("open at λ = 0");
            let value = g - lambda * room;
            best = best.max(value);
            if value >= ceiling - 1e-12 * ceiling.abs() || m == room {
                break;
            }
            if m < room {
                hi = (lambda, g, m);
            } else {
                lo = (lambda, g, m);
            }
        }
        best
    }

    /// Frontiers at one micro-batch, every cap summed, without the plans that cannot fit
    /// `max_budget` (each frontier keeps its smallest point, for [`NoFit`]).
    fn build(&self, prep: Prepared, max_budget: u64) -> BatchTable {
        let mut b = self.start_building(prep, false);
        while b.next_reach().is_some() {
            self.sum_next(&mut b, max_budget, None);
            if b.table.arena.overflow {
                break;
            }
        }
        b.table
    }

    /// A micro-batch's frontiers to be summed cap by cap ([`Planner::sum_next`]). `with_reach`
    /// (for [`Reach::Only`]): its caps in the order of the best throughput each could reach
    /// within the budget, the most promising first, none that cannot fit.
    fn start_building(&self, prep: Prepared, with_reach: bool) -> Building {
        let Prepared {
            batch,
            accumulation,
            bases,
            opts,
            remat,
            keep,
            transient_floor: _,
            class_floor,
            all_floor,
            steps,
            coarsened,
            reach,
        } = prep;
        let remat_of: Vec<Vec<u64>> = self
            .classes
            .iter()
            .map(|c| c.instances[0].iter().map(|&i| remat[i]).collect())
            .collect();
        let mut steps: Vec<(f64, u64, Vec<Vec<usize>>)> = if with_reach {
            debug_assert_eq!(reach.len(), steps.len());
            let mut v: Vec<_> = steps
                .into_iter()
                .zip(reach)
                .filter(|(_, r)| *r > 0.0)
                .map(|((cap, keys), r)| (r, cap, keys))
                .collect();
            v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            v
        } else {
            steps.into_iter().map(|(c, k)| (0.0, c, k)).collect()
        };
        // Taken from the end.
        steps.reverse();
        Building {
            table: BatchTable {
                batch,
                accumulation,
                bases,
                arena: Arena {
                    host_limit: self.host_limit,
                    ..Arena::default()
                },
                caps: Vec::new(),
                coarsened,
            },
            opts,
            remat_of,
            keep,
            class_floor,
            all_floor,
            steps,
            cache: HashMap::new(),
        }
    }

    /// Sums the frontier under `b`'s next cap.
    ///
    /// `incumbent` (for [`Reach::Only`]): the best plan found within `max_budget` so far,
    /// replaced by a better one this cap finds; partial sums that cannot beat it are left out.
    fn sum_next(&self, b: &mut Building, max_budget: u64, mut incumbent: Option<&mut Incumbent>) {
        let Some((could_reach, cap, keys)) = b.steps.pop() else {
            return;
        };
        let res = self.options.resolution_bytes;
        let room = max_budget.saturating_sub(self.machine.fixed_bytes());
        let samples = b.table.samples();
        let step_overhead = self.machine.step_overhead_s();
        // Held memory any plan under this cap may use within `max_budget`.
        let mut limit = room.saturating_sub(cap);
        if let Some(best) = incumbent.as_deref().filter(|i| i.ties_at_most(could_reach)) {
            // No plan here is faster than the best found, but one as fast with a smaller tie
            // key would be the better: only plans that could win the tie are worth summing.
            match best.tie_held(cap, b.table.batch) {
                Some(held) if held >= b.all_floor => limit = limit.min(held),
                _ => return,
            }
        }
        let sum = CapSum {
            opts: &b.opts,
            keys: &keys,
            cap,
            limit,
            batch: b.table.batch,
            class_floor: &b.class_floor,
            all_floor: b.all_floor,
            remat_of: &b.remat_of,
            keep: &b.keep,
        };
        let arena = &mut b.table.arena;
        // The first cap of a search for one budget has no plan to beat, and sums every
        // partial sum. A sum at a coarser resolution first (a fraction of the work) finds
        // a real plan within the budget, and that plan's time cuts the sum at the
        // resolution asked for as a plan found under an earlier cap would. Its frontier is
        // kept beside the fine one, so the coarse plan answers when it is the faster.
        if res > 0
            && self.host_limit.is_none()
            && incumbent.as_deref().is_some_and(|best| best.tput == 0.0)
        {
            let coarse = sum.total(self, res.saturating_mul(COARSE_FIRST), None, None, arena);
            if let (Some(best), Some(p)) = (
                incumbent.as_deref_mut(),
                frontier::best_within(&coarse, limit, false),
            ) {
                best.offer(
                    samples / (p.time + step_overhead),
                    (p.mem + cap, cap, b.table.batch),
                );
            }
            if !coarse.is_empty() {
                b.table.caps.push((cap, coarse));
            }
        }
        // With a plan to beat: the time it takes, and each class's linear relaxation, so
        // that partial sums that cannot beat it are left out (branch and bound). Such
        // frontiers are cut for this cap alone and are not reused.
        let bound: Option<(f64, Vec<Hull>)> = incumbent
            .as_deref()
            .filter(|best| best.tput > 0.0)
            .and_then(|best| {
                let t_max = (samples / best.tput - step_overhead) * (1.0 + ROUNDING_MARGIN);
                let hulls = self
                    .classes
                    .iter()
                    .zip(&keys)
                    .zip(&b.keep)
                    .map(|((class, key), keep)| {
                        self.class_hull(class, key, &b.opts, b.table.batch, keep.as_ref())
                    })
                    .collect::<Option<Vec<Hull>>>()?;
                Some((t_max, hulls))
            });
        let total = sum.total(self, res, bound, Some(&mut b.cache), arena);
        if let Some(best) = incumbent {
            if let Some(p) = frontier::best_within(&total, limit, self.host_limit.is_some()) {
                best.offer(
                    samples / (p.time + step_overhead),
                    (p.mem + cap, cap, b.table.batch),
                );
            }
        }
        if !total.is_empty() {
            b.table.caps.push((cap, total));
        }
    }

    fn reconstruct(&self, table: &BatchTable, root: u32) -> Plan {
        let mut choices: Vec<Choice> = vec![Choice::NONE; self.model.ops.len()];
        let mut recompute = vec![false; self.blocks.ops.len()];
        let mut keep = vec![false; self.blocks.ops.len()];
        let mut next_instance = vec![0usize; self.classes.len()];
        let mut stack = vec![root];
        while let Some(n) = stack.pop() {
            match table.arena.nodes[n as usize] {
                Node::Empty | Node::Op { .. } | Node::Way(_) => {}
                Node::Pair(a, b) => {
                    stack.push(a);
                    stack.push(b);
                }
                Node::Times { node, count } => stack.extend((0..count).map(|_| node)),
                Node::Dealt { class, inner } => {
                    // Each slot's choices and the ways, one per instance, dealt out in order.
                    let class = &self.classes[class as usize];
                    let mut dealt = vec![0usize; class.instances[0].len()];
                    let mut ways = 0usize;
                    let mut inner_stack = vec![inner];
                    while let Some(x) = inner_stack.pop() {
                        match table.arena.nodes[x as usize] {
                            Node::Op { slot, choice } => {
                                let slot = slot as usize;
                                choices[class.instances[dealt[slot]][slot]] = choice;
                                dealt[slot] += 1;
                            }
                            Node::Way(way) => {
                                if let Some(blocks) = &class.blocks {
                                    recompute[blocks[ways]] = way.recomputes();
                                    keep[blocks[ways]] = way == Way::Keep;
                                }
                                ways += 1;
                            }
                            Node::Pair(a, b) => {
                                inner_stack.push(a);
                                inner_stack.push(b);
                            }
                            Node::Times { node, count } => {
                                inner_stack.extend((0..count).map(|_| node))
                            }
                            _ => {}
                        }
                    }
                }
                Node::Instance { class, way, inner } => {
                    let ci = class as usize;
                    let class = &self.classes[ci];
                    let idx = next_instance[ci];
                    next_instance[ci] += 1;
                    let ops = &class.instances[idx];
                    if let Some(blocks) = &class.blocks {
                        recompute[blocks[idx]] = way.recomputes();
                        keep[blocks[idx]] = way == Way::Keep;
                    }
                    let mut inner_stack = vec![inner];
                    while let Some(x) = inner_stack.pop() {
                        match table.arena.nodes[x as usize] {
                            Node::Op { slot, choice } => choices[ops[slot as usize]] = choice,
                            Node::Pair(a, b) => {
                                inner_stack.push(a);
                                inner_stack.push(b);
                            }
                            Node::Times { node, count } => {
                                inner_stack.extend((0..count).map(|_| node))
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        Plan {
            batch: table.batch,
            accumulation: table.accumulation,
            choices,
            recompute,
            keep_weights: keep,
        }
    }
}

/// How much coarser than the search's resolution the first cap of a one-budget search is
/// summed first, for a plan to beat ([`Planner::build`]).
const COARSE_FIRST: u64 = 16;

/// One transient cap's sum in [`Planner::build`]: what the cap leaves each class, and the
/// held bytes its plans may use.
struct CapSum<'a> {
    opts: &'a [Vec<Opt>],
    keys: &'a [Vec<usize>],
    cap: u64,
    limit: u64,
    batch: u64,
    class_floor: &'a [u64],
    all_floor: u64,
    remat_of: &'a [Vec<u64>],
    keep: &'a [Option<KeepSlots>],
}

impl CapSum<'_> {
    /// The frontier of the whole model under the cap, at resolution `res`. `bound`: the time a
    /// plan must beat and each class's linear relaxation (branch and bound). `cache`: class
    /// frontiers by (class, key), with the held-bytes limit each was summed under; a frontier
    /// summed under a looser limit, and not cut, is still whole under this one. Without a
    /// cache, class frontiers are summed for this call alone.
    fn total(
        &self,
        planner: &Planner,
        res: u64,
        bound: Option<(f64, Vec<Hull>)>,
        mut cache: Option<&mut ClassCache>,
        arena: &mut Arena,
    ) -> Frontier {
        let mut own: Vec<Frontier> = Vec::with_capacity(self.keys.len());
        for (ci, (class, key)) in planner.classes.iter().zip(self.keys).enumerate() {
            let rep = &class.instances[0];
            let others = self.all_floor.saturating_sub(self.class_floor[ci]);
            let class_limit = self.limit.saturating_sub(others);
            if let Some(cache) = cache.as_deref() {
                if bound.is_none()
                    && cache
                        .get(&(ci, key.clone()))
                        .is_some_and(|(l, _)| *l >= class_limit)
                {
                    continue;
                }
            }
            let cut = bound.as_ref().map(|(t_max, hulls)| ClassCut {
                outside: hulls
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != ci)
                    .fold(Hull::default(), |acc, (_, h)| acc.plus(h)),
                limit: self.limit,
                t_max: *t_max,
            });
            let f = class_total(
                ci as u32,
                rep,
                class.instances.len() as u64,
                self.opts,
                self.cap,
                planner.kept_bytes(class, self.batch).map(|kept| Recompute {
                    remat: &self.remat_of[ci],
                    kept,
                    only: class.forced == Some(true),
                    keep: self.keep[ci].as_ref(),
                }),
                res,
                class_limit,
                arena,
                cut,
            );
            match cache.as_deref_mut() {
                Some(cache) => {
                    // A cut frontier is marked as summed under no room, so no other cap
                    // reuses it.
                    let summed_under = if bound.is_some() { 0 } else { class_limit };
                    cache.insert((ci, key.clone()), (summed_under, f));
                }
                None => own.push(f),
            }
        }
        let parts = self
            .keys
            .iter()
            .enumerate()
            .map(|(ci, key)| {
                let f = match cache.as_deref() {
                    Some(cache) => cache[&(ci, key.clone())].1.as_slice(),
                    None => own[ci].as_slice(),
                };
                (f, self.class_floor[ci])
            })
            .collect();
        let cut = bound.map(|(t_max, hulls)| PartsCut {
            hulls,
            outside: Hull::default(),
            limit: self.limit,
            t_max,
        });
        sum_parts(parts, 0, res, self.limit, arena, cut)
    }
}

/// Per op, per count of admitted options: the (held bytes, time) pairs that can decide a
/// cap's Lagrangian bound, each way ([`Planner::lean_options`]), in one buffer.
struct LeanOptions {
    /// Per op: where its counts' ranges start in `ranges`, plain, recomputed and recomputed
    /// keeping weights (the recomputed way's where that is not open).
    first: Vec<(usize, usize, usize)>,
    /// Per op, way and count (from 0): its points' range in `points`.
    ranges: Vec<(usize, usize)>,
    points: Vec<(u64, f64)>,
}

impl LeanOptions {
    /// Adds each prefix's lean points of one op's options, one way ([`lean_push`]); where
    /// its ranges start.
    fn add(
        &mut self,
        options: impl Iterator<Item = Option<(u64, f64)>>,
        scratch: &mut Vec<(u64, f64)>,
    ) -> usize {
        let first = self.ranges.len();
        scratch.clear();
        self.ranges.push((self.points.len(), self.points.len()));
        for p in options {
            if let Some(p) = p {
                lean_push(scratch, p);
            }
            let start = self.points.len();
            self.points.extend_from_slice(scratch);
            self.ranges.push((start, self.points.len()));
        }
        first
    }

    /// Op `op`'s lean points among its first `k` options, run `way`.
    fn of(&self, op: usize, way: Way, k: usize) -> &[(u64, f64)] {
        let (plain, again, kept) = self.first[op];
        let first = match way {
            Way::Plain => plain,
            Way::Recompute => again,
            Way::Keep => kept,
        };
        let (start, end) = self.ranges[first + k];
        &self.points[start..end]
    }
}

/// Adds `p` to the lean points `cur`: left out where one of them is at least as good on both
/// held bytes and time, else in, and those it is at least as good as out.
fn lean_push(cur: &mut Vec<(u64, f64)>, p: (u64, f64)) {
    if !cur.iter().any(|q| q.0 <= p.0 && q.1 <= p.1) {
        cur.retain(|q| !(p.0 <= q.0 && p.1 <= q.1));
        cur.push(p);
    }
}

/// For each prefix of `points` (held bytes, time), by length: its points that no other of
/// them is at least as good as on both (of equal ones, the first).
#[cfg(test)]
fn lean_prefixes(points: impl Iterator<Item = (u64, f64)>) -> Vec<Vec<(u64, f64)>> {
    let mut cur: Vec<(u64, f64)> = Vec::new();
    let mut by_count = vec![cur.clone()];
    for p in points {
        lean_push(&mut cur, p);
        by_count.push(cur.clone());
    }
    by_count
}

/// Class frontiers by (class, key): the held-bytes limit each was summed under, and it.
type ClassCache = HashMap<(usize, Vec<usize>), (u64, Frontier)>;

/// The tables of a search for one budget once summed: those with a frontier (or a
/// three-dimensional sum that gave up).
fn finished(building: Vec<Building>) -> Vec<BatchTable> {
    building
        .into_iter()
        .map(|b| b.table)
        .filter(|t| !t.caps.is_empty() || t.arena.overflow)
        .collect()
}

impl BatchTable {
    /// Samples one rank runs per step: micro-batch × accumulation.
    fn samples(&self) -> f64 {
        (self.batch * self.accumulation) as f64
    }

    /// Smallest peak any plan at this batch reaches.
    fn cheapest(&self, overhead: u64) -> Option<u64> {
        self.caps
            .iter()
            .filter_map(|(cap, f)| f.first().map(|p| overhead + p.mem + cap))
            .min()
    }
}

/// Sorted `caps` with those less than `res` apart merged: each run keeps its largest (it admits
/// the most plans), at a cost of under `res` bytes of budget.
fn merge_caps(caps: &[u64], res: u64) -> Vec<u64> {
    let mut merged: Vec<u64> = Vec::with_capacity(caps.len());
    let mut start = 0u64;
    for &c in caps {
        match merged.last_mut() {
            Some(last) if c < start.saturating_add(res) => *last = c,
            _ => {
                start = c;
                merged.push(c);
            }
        }
    }
    merged
}

/// The options no other is at least as good as on every count: transient, memory held and
/// time (kept, recomputed, and recomputed keeping weights where `kept`: the op's block may
/// keep its weight, [`KeepSlots`]), host memory. A plan using a dropped option can swap in the
/// one that beats it with no larger peak and no longer step, so dropping it loses nothing —
/// and keeps the caps and frontiers it would have added (on one GPU, zero1–3 are dp with more
/// transient). Of identical options the first is kept. The order (by transient) is kept.
fn undominated(v: Vec<Opt>, kept: bool) -> Vec<Opt> {
    let no_worse = |a: &Opt, b: &Opt| {
        a.transient <= b.transient
            && a.held <= b.held
            && a.time <= b.time
            && a.held_r <= b.held_r
            && a.time_r <= b.time_r
            && (!kept || a.time_k <= b.time_k)
            && a.host <= b.host
    };
    let keep: Vec<bool> = (0..v.len())
        .map(|k| {
            !(0..v.len())
                .any(|j| j != k && no_worse(&v[j], &v[k]) && (j < k || !no_worse(&v[k], &v[j])))
        })
        .collect();
    v.into_iter()
        .zip(keep)
        .filter_map(|(o, k)| k.then_some(o))
        .collect()
}

/// `host`: whether host memory can bind (it is carried in the option; 0 otherwise).
/// `host_price`: seconds each host byte adds to the option's time in the search.
fn option(base: &OpBase, choice: Choice, m: &Machine, host: bool, host_price: f64) -> Opt {
    let c = cost::price(base, choice, m);
    let time = c.time_s() + host_price * c.host_bytes as f64;
    Opt {
        choice,
        held: c.persistent_bytes + base.saved_bytes,
        time,
        transient: c.transient_bytes,
        held_r: c.persistent_bytes,
        time_r: time + c.recompute_s(base),
        refetch: c.recompute_comm_s,
        time_k: c
            .kept_recompute_comm_s
            .map_or(f64::INFINITY, |k| time + base.recompute_s() + k),
        time_rb: time + c.recompute_s(base),
        host: if host { c.host_bytes } else { 0 },
    }
}

/// The host budget where it can bind: where offload can be priced and the most host memory
/// any plan could take (every op at its most host-hungry choice; host bytes do not depend on
/// the micro-batch) exceeds it. A host budget of 0 offers no offload, but an op pinned to
/// offload still takes host memory: that budget binds too.
fn host_can_bind(
    bases: &[OpBase],
    classes: &[Class],
    m: &Machine,
    pins: &HashMap<usize, Choice>,
    max_split: u32,
    target: Target,
) -> Option<u64> {
    if !m.prices_offload() {
        return None;
    }
    // Each class's first instance, times its instances: they price the same.
    let most = classes
        .iter()
        .flat_map(|class| {
            let n = class.instances.len() as u64;
            class.instances[0].iter().map(move |&i| (i, n))
        })
        .map(|(i, n)| {
            let base = &bases[i];
            let choices = match pins.get(&i) {
                Some(c) => vec![*c],
                None => target.choices(base, m, max_split),
            };
            choices
                .into_iter()
                .map(|c| cost::price(base, c, m).host_bytes)
                .max()
                .unwrap_or(0)
                .saturating_mul(n)
        })
        .fold(0u64, u64::saturating_add);
    (most > m.host_budget_bytes).then_some(m.host_budget_bytes)
}

/// What makes two ops price the same under the same choice: their facts (a key for finding
/// equal ones; callers compare the facts themselves).
fn op_signature(b: &OpBase) -> [u64; 16] {
    [
        u64::from(b.accumulation),
        b.latency_share.to_bits(),
        b.params,
        u64::from(b.uses),
        u64::from(b.splittable),
        b.fwd_s.to_bits(),
        b.bwd_s.to_bits(),
        b.work.to_bits(),
        b.saved_bytes,
        b.working_bytes,
        b.output_bytes,
        b.tensors[0].numel,
        u64::from(b.tensors[0].cut),
        b.tensors[1].numel,
        u64::from(b.tensors[1].cut),
        u64::from(b.ends_block_params),
    ]
}

/// For each op, the first op with the same facts' key (itself if none before has it): where
/// their facts are equal, it prices the same under the same choice.
pub(crate) fn same_priced(bases: &[OpBase]) -> Vec<usize> {
    let mut first: HashMap<[u64; 16], usize> = HashMap::new();
    bases
        .iter()
        .enumerate()
        .map(|(i, b)| *first.entry(op_signature(b)).or_insert(i))
        .collect()
}

/// How one instance's slots are priced in one way: plain, recomputed (with, per slot, the
/// bytes rematerialised while it runs backward), or recomputed keeping its weights.
#[derive(Clone, Copy)]
enum Priced<'a> {
    Plain,
    Recompute(&'a [u64]),
    Keep(&'a KeepSlots),
}

impl Priced<'_> {
    /// Slot `s`'s (held bytes, time) with option `o` under transient cap `cap`, if open to it.
    fn of(self, s: usize, o: &Opt, cap: u64) -> Option<(u64, f64)> {
        match self {
            Priced::Plain => (o.transient <= cap).then_some((o.held, o.time)),
            Priced::Recompute(remat) => {
                (o.transient + remat[s] <= cap).then_some((o.held_r, o.time_r))
            }
            Priced::Keep(k) => {
                let time = k.time(s, o).filter(|_| o.transient + k.extra[s] <= cap)?;
                Some((o.held_r, time))
            }
        }
    }
}

/// One instance of a class run one way under transient cap `cap`: the frontier of each
/// slot's options, or `None` when a slot has none under the cap.
fn slot_frontiers(
    slots: &[usize],
    opts: &[Vec<Opt>],
    cap: u64,
    priced: Priced,
    arena: &mut Arena,
) -> Option<Vec<Frontier>> {
    slots
        .iter()
        .enumerate()
        .map(|(slot, &i)| {
            let pts: Vec<Point> = opts[i]
                .iter()
                .filter_map(|o| priced.of(slot, o, cap).map(|p| (o, p)))
                .map(|(o, (mem, time))| {
                    let node = arena.push(Node::Op {
                        slot: slot as u32,
                        choice: o.choice,
                    });
                    Point {
                        mem,
                        time,
                        node,
                        host: o.host,
                    }
                })
                .collect();
            (!pts.is_empty()).then(|| frontier::prune(pts))
        })
        .collect()
}

/// The sum of `parts`, each with the least memory it adds, starting from `start` (memory
/// already held): nothing above `limit` but the first point. Single points go first (they
/// add up to one point; adding one to a large frontier would copy it).
///
/// `cut`: each part's [`Hull`] (in the order of `parts`) and what the rest of the plan adds;
/// partial sums that cannot lead to a plan faster than the cut's `t_max` are left out.
fn sum_parts(
    parts: Vec<(&[Point], u64)>,
    start: u64,
    resolution: u64,
    limit: u64,
    arena: &mut Arena,
    cut: Option<PartsCut>,
) -> Frontier {
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&k| parts[k].0.len() > 1);
    let mut later: u64 = parts.iter().fold(0, |a, p| a.saturating_add(p.1));
    // What the parts after each position add, at the least: the rest of the plan, then each
    // later part's hull, summed from the end.
    let rests: Vec<Hull> = match &cut {
        None => Vec::new(),
        Some(c) => {
            let mut rests = vec![c.outside.clone(); order.len()];
            for pos in (0..order.len().saturating_sub(1)).rev() {
                rests[pos] = rests[pos + 1].plus(&c.hulls[order[pos + 1]]);
            }
            rests
        }
    };
    let mut total: Frontier = vec![Point {
        mem: start,
        time: 0.0,
        node: arena.push(Node::Empty),
        host: 0,
    }];
    for (pos, &k) in order.iter().enumerate() {
        let (f, floor) = parts[k];
        later = later.saturating_sub(floor);
        total = frontier::sum(&total, f, resolution, limit.saturating_sub(later), arena);
        if let Some(c) = &cut {
            total = Cut {
                rest: rests[pos].clone(),
                limit: c.limit,
                t_max: c.t_max,
            }
            .apply(total);
        }
        if total.is_empty() {
            break;
        }
    }
    total
}

/// What [`sum_parts`] may leave out: each part's hull, what the rest of the plan adds at the
/// least, and the held-bytes limit and the time a plan must beat.
struct PartsCut {
    hulls: Vec<Hull>,
    outside: Hull,
    limit: u64,
    t_max: f64,
}

/// What a class's sum may leave out: what the rest of the plan adds at the least, the whole
/// plan's held-bytes limit, and the time a plan must beat.
#[derive(Clone)]
struct ClassCut {
    outside: Hull,
    limit: u64,
    t_max: f64,
}

/// The hull of a frontier's points.
fn hull_of(f: &[Point]) -> Hull {
    Hull::of(f.iter().map(|p| (p.mem as f64, p.time))).unwrap_or_default()
}

/// How a block instance may run: its ops' options under the cap, and what recomputing
/// changes.
struct Recompute<'a> {
    /// Per slot, the bytes rematerialised while it runs backward.
    remat: &'a [u64],
    /// The block input a recomputed instance keeps.
    kept: u64,
    /// Recomputation is fixed on: the plain way is closed.
    only: bool,
    /// The third way, where open ([`KeepSlots`]).
    keep: Option<&'a KeepSlots>,
}

/// The frontier of all `class`'s instances under transient cap `cap`, within `limit` bytes
/// held.
///
/// An instance's memory and time add up over its slots, plus what its way of running adds:
/// kept activations and nothing, or its kept input and the forward run again. When both ways
/// admit the same options (or only one way is open, or one is never worse), the instances'
/// sum is a sum of independent parts — each slot's options repeated, and the ways repeated —
/// since `n × (a ⊕ b) = n × a ⊕ n × b`: a few short frontiers instead of `n` sums of a long
/// one. Otherwise instances are repeated whole, each run its own way.
#[allow(clippy::too_many_arguments)]
fn class_total(
    class: u32,
    slots: &[usize],
    count: u64,
    opts: &[Vec<Opt>],
    cap: u64,
    recompute: Option<Recompute>,
    resolution: u64,
    limit: u64,
    arena: &mut Arena,
    cut: Option<ClassCut>,
) -> Frontier {
    let admitted = |extra: &dyn Fn(usize) -> u64| -> Vec<usize> {
        slots
            .iter()
            .enumerate()
            .map(|(s, &i)| opts[i].partition_point(|o| o.transient + extra(s) <= cap))
            .collect()
    };
    let plain_n = admitted(&|_| 0);
    let forced = recompute.as_ref().is_some_and(|r| r.only);
    let plain_ok = !forced && plain_n.iter().all(|&n| n > 0);
    let recompute = recompute.filter(|r| admitted(&|s| r.remat[s]).iter().all(|&n| n > 0));
    let keep = recompute.as_ref().and_then(|r| r.keep).filter(|&k| {
        slots.iter().enumerate().all(|(s, &i)| {
            opts[i]
                .iter()
                .any(|o| Priced::Keep(k).of(s, o, cap).is_some())
        })
    });
    // Each way's (memory, time) over the slots' own: kept activations, or the kept input and
    // the forward again.
    let saved: u64 = slots
        .iter()
        .map(|&i| opts[i][0].held - opts[i][0].held_r)
        .sum();
    let mut ways: Vec<(Way, u64)> = Vec::new();
    if plain_ok {
        ways.push((Way::Plain, saved));
    }
    if let Some(r) = &recompute {
        ways.push((Way::Recompute, r.kept));
        if keep.is_some() {
            ways.push((Way::Keep, r.kept));
        }
    }
    // Instances split into independent parts only where an op's choice does not change what
    // recomputing it costs: where a recomputation fetches again what the op's choice gathers
    // or copies from host (`Opt::refetch`), its choices and its way are priced together.
    let separable = match &recompute {
        _ if keep.is_some() => false,
        Some(r) => {
            !plain_ok
                || (admitted(&|s| r.remat[s]) == plain_n
                    && slots
                        .iter()
                        .all(|&i| opts[i].iter().all(|o| o.refetch == opts[i][0].refetch)))
        }
        None => true,
    };
    if ways.is_empty() {
        return Vec::new();
    }
    let sum = ClassSum {
        class,
        slots,
        count,
        opts,
        cap,
        resolution,
        limit,
        cut,
        keep,
    };
    let remat = recompute.as_ref().map(|r| r.remat);
    if count > 1 && separable {
        sum.dealt(&ways, remat, !plain_ok, arena)
    } else {
        sum.whole(&ways, remat, arena)
    }
}

/// One class's sum in [`class_total`]: its instances' slots, how many instances, and the
/// transient cap, resolution and held-bytes limit the sum is taken under.
struct ClassSum<'a> {
    class: u32,
    slots: &'a [usize],
    count: u64,
    opts: &'a [Vec<Opt>],
    cap: u64,
    resolution: u64,
    limit: u64,
    cut: Option<ClassCut>,
    /// The third way's pricing, where it is among the ways.
    keep: Option<&'a KeepSlots>,
}

impl ClassSum<'_> {
    /// The sum as independent parts, each repeated `count` times: every slot's options, then
    /// the ways (`(way, memory)`, never [`Way::Keep`]). `remat`: per slot, the bytes
    /// rematerialised by the recomputed way, if open; `only_recompute`: the plain way is closed.
    fn dealt(
        &self,
        ways: &[(Way, u64)],
        remat: Option<&[u64]>,
        only_recompute: bool,
        arena: &mut Arena,
    ) -> Frontier {
        // Slots priced held without activations, at plain time; the recomputed way adds the
        // forward again (the same whatever the choice, as `class_total` checked) and the plain
        // way holds `saved`. Where only the recomputed way is open, each slot is priced at its
        // own recomputed time, which may depend on the choice (`Opt::refetch`).
        let total_fwd: f64 = if only_recompute {
            0.0
        } else {
            self.slots
                .iter()
                .map(|&i| self.opts[i][0].time_r - self.opts[i][0].time)
                .sum()
        };
        let mut parts = self.slot_parts(remat.filter(|_| only_recompute), only_recompute, arena);
        parts.push(way_part(ways, total_fwd, arena));
        let Some(repeated) = self.repeat_parts(&parts, arena) else {
            // A part with no point within the host limit leaves the class nothing.
            return Vec::new();
        };
        let parts = repeated.iter().map(|f| (f.as_slice(), f[0].mem)).collect();
        let cut = self.cut.as_ref().map(|c| {
            let hulls: Vec<Hull> = repeated.iter().map(|f| hull_of(f)).collect();
            PartsCut {
                hulls,
                outside: c.outside.clone(),
                limit: c.limit,
                t_max: c.t_max,
            }
        });
        sum_parts(parts, 0, self.resolution, self.limit, arena, cut)
            .into_iter()
            .map(|p| Point {
                node: arena.push(Node::Dealt {
                    class: self.class,
                    inner: p.node,
                }),
                ..p
            })
            .collect()
    }

    /// Each slot's options whose transient, plus the slot's `extra` (rematerialised bytes,
    /// when only the recomputed way is open), fits the cap; priced held without activations,
    /// at plain time or, `recomputed`, at recomputed time. The vector has room for the ways'
    /// part.
    fn slot_parts(
        &self,
        extra: Option<&[u64]>,
        recomputed: bool,
        arena: &mut Arena,
    ) -> Vec<Frontier> {
        let mut parts: Vec<Frontier> = Vec::with_capacity(self.slots.len() + 1);
        for (s, &i) in self.slots.iter().enumerate() {
            let extra = extra.map_or(0, |r| r[s]);
            let pts: Vec<Point> = self.opts[i]
                .iter()
                .filter(|o| o.transient + extra <= self.cap)
                .map(|o| Point {
                    mem: o.held_r,
                    time: if recomputed { o.time_r } else { o.time },
                    node: arena.push(Node::Op {
                        slot: s as u32,
                        choice: o.choice,
                    }),
                    host: o.host,
                })
                .collect();
            parts.push(frontier::prune(pts));
        }
        parts
    }

    /// Each part repeated `count` times, within what the limit leaves it beside the others'
    /// least; `None` when one has no point left.
    fn repeat_parts(&self, parts: &[Frontier], arena: &mut Arena) -> Option<Vec<Frontier>> {
        let count = self.count;
        let least: u64 = parts.iter().map(|f| f[0].mem * count).sum();
        // With a cut: each part's hull, and all of them repeated.
        let hulls: Vec<Hull> = match &self.cut {
            Some(_) => parts.iter().map(|f| hull_of(f)).collect(),
            None => Vec::new(),
        };
        let repeated: Vec<Frontier> = parts
            .iter()
            .enumerate()
            .map(|(k, f)| {
                let others = least - f[0].mem * count;
                let cut = self.cut.as_ref().map(|c| {
                    let outside = hulls
                        .iter()
                        .enumerate()
                        .filter(|&(j, _)| j != k)
                        .fold(c.outside.clone(), |acc, (_, h)| {
                            acc.plus(&h.times(count as f64))
                        });
                    RepeatCut {
                        one: hulls[k].clone(),
                        outside,
                        limit: c.limit,
                        t_max: c.t_max,
                    }
                });
                frontier::repeat(
                    f,
                    count,
                    self.resolution,
                    self.limit.saturating_sub(others),
                    f[0].mem,
                    arena,
                    cut.as_ref(),
                )
            })
            .collect();
        (!repeated.iter().any(|f| f.is_empty())).then_some(repeated)
    }

    /// Instances whole: each way's one-instance frontier, pruned together, repeated.
    fn whole(&self, ways: &[(Way, u64)], remat: Option<&[u64]>, arena: &mut Arena) -> Frontier {
        if self.overflow_certain(ways, remat, arena) {
            arena.overflow = true;
            return Vec::new();
        }
        let one = self.one_instance(ways, remat, arena);
        let floor = one.first().map_or(0, |p| p.mem);
        let cut = self.cut.as_ref().map(|c| RepeatCut {
            one: hull_of(&one),
            outside: c.outside.clone(),
            limit: c.limit,
            t_max: c.t_max,
        });
        frontier::repeat(
            &one,
            self.count,
            self.resolution,
            self.limit,
            floor,
            arena,
            cut.as_ref(),
        )
    }

    /// Whether the three-dimensional sum of this class must overflow
    /// ([`frontier::repeat_overflows`]), decided on part of its one-instance frontier where
    /// that part is already too large: building the whole of it can take many times longer.
    ///
    /// Whether a point with at most `h` bytes of host memory is dominated depends only on the
    /// points with at most `h` (a point that dominates it holds no more), so the one-instance
    /// frontier under a host limit `h` is exactly the whole one's points up to `h` — no more
    /// points than the whole — and each partial sum building it is the whole's partial sum's
    /// points up to `h` (so one of its sums overflows only where the whole's would). A few
    /// limits well under what one instance can hold are tried; where none decides, the whole
    /// frontier is built as before, and the arena is left as it was.
    fn overflow_certain(
        &self,
        ways: &[(Way, u64)],
        remat: Option<&[u64]>,
        arena: &mut Arena,
    ) -> bool {
        let Some(host_limit) = arena.host_limit else {
            return false;
        };
        if arena.overflow || self.count < 2 {
            return false;
        }
        // The most host memory one instance can hold: every slot at its most.
        let most = self
            .slots
            .iter()
            .map(|&i| self.opts[i].iter().map(|o| o.host).max().unwrap_or(0))
            .fold(0u64, u64::saturating_add);
        let mark = arena.nodes.len();
        for part in [64, 16] {
            let h = most / part;
            if h == 0 || h >= host_limit {
                continue;
            }
            arena.host_limit = Some(h);
            let len = self.one_instance(ways, remat, arena).len();
            arena.host_limit = Some(host_limit);
            // A sum that overflowed under `h` overflows in the whole frontier too.
            if arena.overflow || frontier::repeat_overflows(len, self.count) {
                return true;
            }
            arena.nodes.truncate(mark);
        }
        false
    }

    /// One instance's frontier: each way's, pruned together.
    fn one_instance(
        &self,
        ways: &[(Way, u64)],
        remat: Option<&[u64]>,
        arena: &mut Arena,
    ) -> Frontier {
        let mut all: Vec<Point> = Vec::new();
        for &(way, kept) in ways {
            let priced = match (way, remat, self.keep) {
                (Way::Recompute, Some(r), _) => Priced::Recompute(r),
                (Way::Keep, _, Some(k)) => Priced::Keep(k),
                _ => Priced::Plain,
            };
            let Some(fs) = slot_frontiers(self.slots, self.opts, self.cap, priced, arena) else {
                continue;
            };
            let parts = fs.iter().map(|f| (f.as_slice(), f[0].mem)).collect();
            let start = if way.recomputes() { kept } else { 0 };
            for p in sum_parts(parts, start, self.resolution, u64::MAX, arena, None) {
                all.push(Point {
                    node: arena.push(Node::Instance {
                        class: self.class,
                        way,
                        inner: p.node,
                    }),
                    ..p
                });
            }
        }
        frontier::prune(all)
    }
}

/// The ways an instance may run (`(way, memory)`), as one part: the recomputed way takes the
/// forward again, `total_fwd` seconds.
fn way_part(ways: &[(Way, u64)], total_fwd: f64, arena: &mut Arena) -> Frontier {
    let way_points: Vec<Point> = ways
        .iter()
        .map(|&(way, mem)| Point {
            mem,
            time: if way.recomputes() { total_fwd } else { 0.0 },
            node: arena.push(Node::Way(way)),
            host: 0,
        })
        .collect();
    frontier::prune(way_points)
}

/// Group ops into classes of identical instances.
/// `bases`: the ops' facts at batch 1 (identical at batch 1 means identical at any batch).
fn classify(
    bases: &[OpBase],
    blocks: &Blocks,
    pins: &HashMap<usize, Choice>,
    forced: &HashMap<usize, bool>,
) -> Vec<Class> {
    let sig = |i: usize| -> Vec<u64> {
        let pin = pins.get(&i).map_or(u64::MAX, |c| {
            (c.offload as u64) << 56
                | (c.strategy as u64) << 40
                | u64::from(c.split) << 20
                | u64::from(c.sharded)
        });
        let mut v = op_signature(&bases[i]).to_vec();
        v.push(pin);
        v
    };
    let mut classes: Vec<Class> = Vec::new();
    let mut by_sig: HashMap<Vec<u64>, usize> = HashMap::new();
    for (b, members) in blocks.ops.iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let mut key: Vec<u64> = members.iter().flat_map(|&i| sig(i)).collect();
        key.push(blocks.input_bytes_per_sample[b]);
        // A block whose recomputation is fixed is a class apart from the searched ones.
        key.push(forced.get(&b).map_or(0, |&r| 1 + u64::from(r)));
        match by_sig.get(&key) {
            Some(&c) => {
                classes[c].instances.push(members.clone());
                if let Some(bs) = classes[c].blocks.as_mut() {
                    bs.push(b);
                }
            }
            None => {
                by_sig.insert(key, classes.len());
                classes.push(Class {
                    instances: vec![members.clone()],
                    blocks: Some(vec![b]),
                    forced: forced.get(&b).copied(),
                });
            }
        }
    }
    for (i, block) in blocks.of_op.iter().enumerate() {
        if block.is_none() {
            classes.push(Class {
                instances: vec![vec![i]],
                blocks: None,
                forced: None,
            });
        }
    }
    classes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::model::read_model;
    use crate::plan::frontier::test_rng;

    /// Where the host budget binds, `plan`'s search stops its relaxation at its first plan
    /// ([`Search::defer_proof`]) and sums the caps it left only where they could change the
    /// answer: on shipped models, at `plan`'s defaults (headroom, global batch, resolution), its
    /// answer is the one the relaxation summed whole gives — the same plan, prediction and
    /// stated gap — whether the deferral answered (host memory priced and no plan within the
    /// host budget as fast as the first) or the caps were summed after all (the first plan
    /// within the host budget; a plan within it that could be as fast; the relaxation's best
    /// within it, or over it and priced again).
    #[test]
    fn stopping_the_relaxation_at_its_first_plan_changes_no_answer() {
        const GIB: u64 = 1 << 30;
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        // (model, layout, host budget in tenths of a GiB, 0 for the layout's).
        let cases = [
            ("tinyllama-1.1b", "cpu", 0),
            ("tinyllama-1.1b", "cpu", 50),
            ("tinyllama-1.1b", "cpu", 84),
            ("tinyllama-1.1b", "cpu", 130),
            ("gpt2-xl", "cpu", 80),
            ("gpt2-xl", "v100-dgx2-1x", 80),
            ("gpt2-medium", "h100-1x", 20),
        ];
        let (mut answered, mut summed, mut deferring) = (0, 0, 0);
        for (name, layout, tenths) in cases {
            let model = read_model(&root.join(format!("sample-models/{name}.json"))).unwrap();
            let l = read_layout(&root.join(format!("layouts/{layout}.json"))).unwrap();
            let mut m = Machine::new(&l, &model);
            if tenths > 0 {
                m.host_budget_bytes = tenths * GIB / 10;
            }
            let budget = l.memory_bytes() / 100 * 95;
            let options = PlanOptions {
                global_batch: Some(crate::plan::default_global_batch(
                    &model,
                    &m,
                    layout == "cpu",
                )),
                resolution_bytes: crate::plan::request::search_resolution(
                    None,
                    &model,
                    &m,
                    l.memory_bytes(),
                ),
                ..PlanOptions::default()
            };
            let search = |defer_proof| {
                Planner::with_host_limit(
                    &model,
                    m.clone(),
                    options.clone(),
                    budget,
                    Search {
                        defer_proof,
                        ..Search::relaxed(Reach::Only)
                    },
                )
            };
            let whole = search(false).best(budget);
            let mut deferred = search(true);
            // Where the first plan's bounds leave no cap that could beat it, nothing is left
            // to defer (the relaxation summed whole took the same one cap).
            deferring += usize::from(deferred.pending.is_some());
            let got = match deferred.answer_deferred(budget) {
                Some(answer) => {
                    answered += 1;
                    answer
                }
                None => {
                    summed += 1;
                    assert!(deferred.pending.is_none());
                    deferred.best(budget)
                }
            };
            let figures = |r: &Result<Planned, NoFit>| {
                r.clone().map(|p| {
                    let f = p.prediction;
                    (f.throughput_samples_per_s, f.host_bytes, p.host_gap_s)
                })
            };
            assert!(
                got == whole,
                "{name} on {layout}, host budget {tenths}/10 GiB: deferred {:?}, whole {:?}",
                figures(&got),
                figures(&whole)
            );
        }
        assert!(
            answered >= 2 && summed >= 3 && deferring >= 4,
            "answered {answered}, summed {summed}, deferring {deferring}"
        );
    }

    /// A cap's bound is the peak of its Lagrangian dual, which is the linear relaxation: the
    /// classes' hulls ([`Planner::class_hull`]) summed and read at the held bytes give the same
    /// time, at every cap of real models, from the least held memory to more than any plan
    /// holds, with host memory priced or not.
    #[test]
    fn a_caps_bound_is_the_linear_relaxation_read_at_its_held_bytes() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for (model, layout, price) in [
            ("gpt2-medium", "a100-80gb-8x-nvlink", 0.0),
            ("llama-2-7b", "h100-1x", 0.0),
            ("tinyllama-1.1b", "cpu", 2e-8),
        ] {
            let model = read_model(&root.join(format!("sample-models/{model}.json"))).unwrap();
            let layout = read_layout(&root.join(format!("layouts/{layout}.json"))).unwrap();
            let machine = Machine::new(&layout, &model);
            let planner = Planner::with_host_limit(
                &model,
                machine,
                PlanOptions::default(),
                layout.memory_bytes(),
                Search {
                    host_price: price,
                    ..Search::relaxed(Reach::Only)
                },
            );
            let prep = planner.prepare(2, 1, &HashMap::new());
            let lean = planner.lean_options(&prep.opts, &prep.keep);
            assert!(!prep.steps.is_empty(), "{}", model.name);
            for (cap, keys) in &prep.steps {
                let sum = planner
                    .classes
                    .iter()
                    .zip(keys)
                    .zip(&prep.keep)
                    .map(|((c, k), keep)| {
                        planner
                            .class_hull(c, k, &prep.opts, prep.batch, keep.as_ref())
                            .unwrap()
                    })
                    .fold(Hull::default(), |acc, h| acc.plus(&h));
                let most = sum.mem + sum.edges.iter().map(|e| e.0).sum::<f64>();
                let mut least_time = sum.least_time();
                for frac in [0.0, 0.001, 0.1, 0.37, 0.5, 0.9, 1.0, 1.5] {
                    let held = (sum.mem + frac * (most - sum.mem)).ceil();
                    let got = planner.cap_time_bound(&lean, keys, prep.batch, held as u64);
                    let want = least_time(held);
                    assert!(
                        (got - want).abs() <= 1e-9 * want,
                        "{} cap {cap} at {frac}: {got} against {want}",
                        model.name
                    );
                }
            }
        }
    }

    /// The least `t + λ·h` over a prefix of options, and the held bytes of the minimiser (of
    /// equal values, the least), are the same bit for bit over the prefix's lean points.
    #[test]
    fn lean_options_decide_every_dual_minimum_as_all_options_do() {
        let mut rand = test_rng(23);
        let least = |pts: &[(u64, f64)], lambda: f64| {
            pts.iter()
                .map(|&(h, t)| (t + lambda * h as f64, h as f64))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))
                .map(|(v, h)| (v.to_bits(), h.to_bits()))
        };
        for _ in 0..500 {
            // Few distinct figures: ties in held bytes, in time and in both.
            let pts: Vec<(u64, f64)> = (0..(rand() % 12))
                .map(|_| ((rand() % 6) << 20, (rand() % 8) as f64 * 0.37))
                .collect();
            let lean = lean_prefixes(pts.iter().copied());
            assert_eq!(lean.len(), pts.len() + 1);
            let mut flat = LeanOptions {
                first: vec![(0, 0, 0)],
                ranges: Vec::new(),
                points: Vec::new(),
            };
            let mut scratch = Vec::new();
            let other = flat.add([Some((1u64, 1.0))].into_iter(), &mut scratch);
            let ours = flat.add(pts.iter().copied().map(Some), &mut scratch);
            // The third way's: every other point left out.
            let some = flat.add(
                pts.iter()
                    .enumerate()
                    .map(|(j, &p)| (j % 2 == 0).then_some(p)),
                &mut scratch,
            );
            flat.first[0] = (other, ours, some);
            for (k, points) in lean.iter().enumerate() {
                assert_eq!(flat.of(0, Way::Recompute, k), points.as_slice());
            }
            let evens: Vec<(u64, f64)> = pts.iter().step_by(2).copied().collect();
            for (k, points) in lean_prefixes(evens.iter().copied()).iter().enumerate() {
                assert_eq!(
                    flat.of(0, Way::Keep, (2 * k).min(pts.len())),
                    points.as_slice()
                );
            }
            for (k, points) in lean.iter().enumerate() {
                for lambda in [0.0, 1e-9, 3.7e-8, 1e-7, 2.5e-6, 1.0] {
                    assert_eq!(
                        least(points, lambda),
                        least(&pts[..k], lambda),
                        "{pts:?} {k}"
                    );
                }
            }
        }
    }
}
