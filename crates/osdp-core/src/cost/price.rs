//! What one operator costs under one choice: [`price`] gives its [`OpCost`] — bytes held on
//! the device and in host memory, compute, communication and how much of it compute cannot
//! hide, the optimizer step — from the units the choice holds the op's parameters as, the
//! collectives its strategy runs, its copies over the host link and its kernels' times.

use crate::cluster::Calibration;

use super::{
    Choice, Holding, Machine, Offload, OpBase, ParamTensor, Strategy, Target, LINEAR_BWD_FACTOR,
    SHARDED_GRAD_BYTES,
};

/// What one op costs under one choice.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OpCost {
    /// Parameters, gradients and optimizer states held on each rank all step long.
    pub persistent_bytes: u64,
    /// Of `persistent_bytes`, what the caching allocator keeps reserved for the op at the peak
    /// with no live tensor in it: FSDP2's sharded gradient under accumulation, which `zero_grad`
    /// freed and the reduce-scatter stream keeps cached. Part of the plan's peak, not of what
    /// PyTorch reports allocated.
    pub cached_bytes: u64,
    /// Held only while the op runs: gathered weights, unsharded gradients, gradient buffers.
    pub transient_bytes: u64,
    /// Held all step in host memory (offloaded optimizer state and parameters).
    pub host_bytes: u64,
    /// Forward + backward compute.
    pub compute_s: f64,
    /// Total communication time (before overlap).
    pub comm_s: f64,
    /// Communication left after overlapping with the op's compute.
    pub exposed_comm_s: f64,
    pub optimizer_s: f64,
    /// Exposed time of the fetches a recomputation of the op repeats, over a step: where the
    /// executor gathers a sharded op's parameters again to recompute it
    /// ([`Machine::regather_on_recompute`]), hidden only behind the recomputed forward, and
    /// copies an offloaded op's parameters from host memory again, in line.
    pub recompute_comm_s: f64,
    /// Where the op's recomputation fetches its parameters whole and a block may keep them for
    /// the op's backward ([`Plan::keep_weights`](crate::plan::Plan::keep_weights)): the exposed time of what
    /// it then fetches again — only its second tensor, a bias its backward does not read (the
    /// block's last op with parameters is priced so in every recomputed block). `None` where
    /// there is nothing whole to keep: a replicated op's own copy, a split op's slices, an op
    /// used twice, or a stack that does not fetch again.
    pub kept_recompute_comm_s: Option<f64>,
}

impl OpCost {
    /// Time the op adds to a step (recomputation is accounted per block).
    pub fn time_s(&self) -> f64 {
        self.compute_s + self.exposed_comm_s + self.optimizer_s
    }

    /// What recomputing the op adds to a step: its forward again, and any gathers with it.
    pub fn recompute_s(&self, base: &OpBase) -> f64 {
        base.recompute_s() + self.recompute_comm_s
    }
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Price `choice` for an op described by `base` on machine `m`, as `m`'s [`Target`] runs it.
pub fn price(base: &OpBase, choice: Choice, m: &Machine) -> OpCost {
    if m.target == Target::Fsdp2 && choice.strategy != Strategy::None {
        return fsdp2_price(base, choice, m);
    }
    let held = Held::of(base, choice, m);
    let (param_transient, comm) = collectives(base, choice, m, held.replicated);
    let (fetched, host_micro_s) = host_copies(base, choice, m, &held);
    let a = f64::from(base.accumulation.max(1));
    let exposed = comm.exposed_s(base, m, a);
    let refetched_s = if m.regather_on_recompute {
        refetch_s(base, choice, m, (&held, &comm), base.ends_block_params)
    } else {
        0.0
    };
    let keeps =
        m.regather_on_recompute && base.params > 0 && base.uses <= 1 && choice.fetches_whole();
    let kept_s = keeps.then(|| refetch_s(base, choice, m, (&held, &comm), true));
    OpCost {
        persistent_bytes: held.device,
        cached_bytes: 0,
        transient_bytes: param_transient + fetched + base.working_bytes,
        host_bytes: held.host,
        compute_s: compute_s(base, choice, m, a),
        comm_s: comm.total(a) + a * host_micro_s,
        exposed_comm_s: exposed + a * host_micro_s,
        optimizer_s: optimizer_s(base, choice, m, &held),
        recompute_comm_s: refetched_s,
        kept_recompute_comm_s: kept_s,
    }
}

/// What recomputing the op fetches again, over a step: its parameters as its forward fetched
/// them — gathered where sharded (hidden only behind the recomputed forward), copied from host
/// memory once a use where offloaded. An op that keeps the unsplit weight its recomputation
/// fetched for its backward (`keeps`: the block's last op with parameters, whose backward comes
/// next, [`OpBase::ends_block_params`]; every op of a block that keeps them) fetches only its
/// second tensor again, a bias its backward does not read. `priced`: the op's own units and
/// collectives under `choice`.
fn refetch_s(
    base: &OpBase,
    choice: Choice,
    m: &Machine,
    priced: (&Held, &Comm),
    keeps: bool,
) -> f64 {
    let a = f64::from(base.accumulation.max(1));
    let of = |base: &OpBase, (held, comm): (&Held, &Comm)| {
        let copies = if choice.offload == Offload::Param {
            f64::from(base.uses.max(1))
                * m.host_copy_s((m.precision.param_bytes * held.params) as f64)
        } else {
            0.0
        };
        comm.regathered_s(base, m, a) + a * copies
    };
    if !(keeps && choice.split <= 1) {
        return of(base, priced);
    }
    let bias = base.tensors[1];
    if bias.numel == 0 {
        return 0.0;
    }
    let rest = OpBase {
        params: bias.numel,
        tensors: [bias, ParamTensor::default()],
        ..base.clone()
    };
    let held = Held::of(&rest, choice, m);
    let (_, comm) = collectives(&rest, choice, m, held.replicated);
    of(&rest, (&held, &comm))
}

/// `choice` as PyTorch FSDP2 runs it: `fully_shard` per module as `osdp_torch.apply_plan` wraps
/// it, micro-batches accumulated as `examples/fsdp2/train.py` does (gradient sync on the last
/// one only). Where that differs from the trainer (read from PyTorch 2.11's `_fully_shard`):
///
/// - **State**: every module keeps its parameters sharded between steps, zero2
///   (`reshard_after_forward=False`) too, and dp on a mesh whose shard dimension is 1: the
///   state is zero3's, hsdp's, or whole for dp.
/// - **Gathered parameters**: each micro-batch's forward all-gathers them (every backward
///   reshards), zero3 and hsdp again in the backward. zero2 and dp keep the gathered copy (a
///   separate buffer even on a one-rank shard group) from the forward to the end of the
///   backward, across the step's peak: held bytes. FSDP2 issues the next unit's all-gather
///   while the current one computes, so two units' buffers are live at once; a unit's buffer is
///   priced twice — a bound on any two neighbours' sum that keeps each op's price its own.
/// - **Gradients**: the backward's unsharded gradient is copied, in the reduce dtype, into the
///   collective's buffer. With accumulation, the micro-batches before the last one skip the
///   sync (`set_requires_gradient_sync(False)`) and the module keeps its unsharded gradient,
///   in the reduce dtype, from the first backward to the last: held bytes, one
///   reduce-scatter (dp: all-reduce; hsdp: both) a step.
/// - **`CPUOffloadPolicy`**: the sharded parameter is copied to the device before each
///   all-gather; the gradient shard goes to the host once a step, where the optimizer steps.
fn fsdp2_price(base: &OpBase, choice: Choice, m: &Machine) -> OpCost {
    let p = base.params;
    let a = f64::from(base.accumulation.max(1));
    let (pb, gb, rb) = (
        m.precision.param_bytes,
        m.precision.grad_bytes,
        m.reduce_bytes,
    );
    let share = base.latency_share;
    let uses = f64::from(base.uses.max(1));
    // zero2 holds its state as zero3 does; the gathered copy is what differs.
    let sharded = match choice.strategy {
        Strategy::Zero2 => Choice {
            offload: choice.offload,
            ..Choice::plain(Strategy::Zero3)
        },
        _ => choice,
    };
    let held = Held::of(base, sharded, m);
    let gathered = pb * p;
    // A unit not resharded after its forward — the root of a 2024 FSDP2, torchtitan's last
    // block — is gathered once a micro-batch and held, like zero2's copy.
    let kept = m.fsdp2_keeps_gathered(base.outside_blocks, base.in_last_block);
    let regathers = matches!(choice.strategy, Strategy::Zero3 | Strategy::Hsdp) && !kept;
    let (gathered_held, gathered_transient) = if regathers {
        (0, 2 * gathered)
    } else {
        (gathered, 0)
    };
    // With accumulation every module holds its unsharded gradient, in the reduce dtype, from
    // the first backward to its last one. Its sharded gradient (fp32, a view of the
    // reduce-scatter's output) is priced held too. Under accumulation `zero_grad` freed it
    // before the first backward and the next exists only after the last, but the
    // reduce-scatter stream keeps its memory cached ([`super::pools`], which prices the rest of
    // that stream): reserved, not allocated. Without accumulation it is priced live, although
    // `zero_grad` has freed it when the activations peak: the peak is one phase, and those
    // bytes stand in for what the end of the backward (every unit's sharded gradient beside the
    // last blocks' activations) and a foreach AdamW step's temporaries hold, which are not
    // priced as phases of their own.
    let (accumulated, cached) = if base.accumulation > 1 {
        (rb * p, SHARDED_GRAD_BYTES * held.grads)
    } else {
        (0, 0)
    };
    let grad = (rb * p) as f64;
    let (micro_fwd, micro_bwd, sync) = match choice.strategy {
        Strategy::Dp => (0.0, 0.0, m.all_reduce_shared_s(grad, share)),
        Strategy::Zero2 => (m.ring_s(gathered as f64, share), 0.0, m.ring_s(grad, share)),
        Strategy::Hsdp => {
            let node = m.node_ring_s(gathered as f64, share);
            let per_node = m.ranks_per_node.clamp(1, m.ranks.max(1));
            let across = m.replica_all_reduce_s(grad / f64::from(per_node), share);
            // A kept unit gathers once a micro-batch, however often its ops run.
            let (fwd, bwd) = if kept {
                (node, 0.0)
            } else {
                (uses * node, uses * node)
            };
            (fwd, bwd, m.node_ring_s(grad, share) + across)
        }
        _ => {
            let g = m.ring_s(gathered as f64, share);
            let (fwd, bwd) = if kept { (g, 0.0) } else { (uses * g, uses * g) };
            (fwd, bwd, m.ring_s(grad, share))
        }
    };
    let comm = Comm {
        micro_fwd,
        micro_bwd,
        step_fwd: 0.0,
        step_bwd: sync,
        micro_serial: 0.0,
        micro_serial_reduce: 0.0,
        step_serial: 0.0,
    };
    // Offloaded: the shard fetched before every all-gather, a sharded gradient sent once a
    // step (a replicated one is the optimizer step's copy); in line, like the trainer's copies.
    let (fetched, host_s) = if choice.offload == Offload::Param {
        let gathers = if regathers { 2.0 * uses } else { 1.0 };
        let shard = (pb * held.params) as f64;
        (
            pb * held.params,
            a * gathers * m.host_copy_s(shard) + m.host_copy_s((gb * held.streamed) as f64),
        )
    } else {
        (0, 0.0)
    };
    OpCost {
        persistent_bytes: held.device + gathered_held + accumulated,
        cached_bytes: cached.min(held.device),
        transient_bytes: gathered_transient + (gb + rb) * p + fetched + base.working_bytes,
        host_bytes: held.host,
        compute_s: compute_s(base, choice, m, a),
        comm_s: comm.total(a) + host_s,
        exposed_comm_s: comm.exposed_s(base, m, a) + host_s,
        optimizer_s: optimizer_s(base, sharded, m, &held),
        // FSDP2 keeps a unit unsharded from its pre-backward gather through the recomputation.
        recompute_comm_s: 0.0,
        kept_recompute_comm_s: None,
    }
}

/// What one rank holds of an op's parameters under a choice, summed over its units.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    /// Bytes held all step on the device and in host memory.
    device: u64,
    host: u64,
    /// Elements this rank's optimizer updates (and keeps optimizer states for).
    updated: u64,
    /// Elements of the units every rank holds whole.
    replicated: u64,
    /// Elements of the compute copy this rank holds.
    params: u64,
    /// Offloaded gradients copied to the host every micro-batch / once a step (elements).
    streamed: u64,
    stepped: u64,
    /// Elements of the gradient this rank holds on the device all step.
    grads: u64,
}

impl Held {
    fn of(base: &OpBase, choice: Choice, m: &Machine) -> Held {
        let n = u64::from(m.ranks.max(1));
        // State and optimizer work follow the units the trainer holds (padded shares per unit).
        let per_node = u64::from(m.ranks_per_node);
        let mut held = Held::default();
        for u in base.units(choice) {
            let over = u.holding.shard_ranks(n, per_node);
            let placed = u
                .holding
                .placed_bytes(u.numel, over, m.precision, choice.offload);
            held.device += placed.device;
            held.host += placed.host;
            held.updated += u.holding.updated(u.numel, over);
            let (params, grads) = u.holding.held(u.numel, over);
            held.params += params;
            if choice.offload == Offload::None || !u.holding.streams_grads() {
                held.grads += grads;
            }
            if u.holding.streams_grads() {
                held.streamed += u.holding.updated(u.numel, over);
            } else {
                held.stepped += u.holding.updated(u.numel, over);
            }
            if u.holding == Holding::Replicated {
                held.replicated += u.numel;
            }
        }
        // A replicated op whose optimizer state is sharded over groups of ranks
        // ([`Machine::zero1_groups`]) updates, and keeps the state of, only the slowest rank's
        // share: the step waits for the rank that steps the most.
        if let Some(z) = m.zero1_groups.filter(|z| z.ranks > 1) {
            if choice.strategy == Strategy::Dp && choice.offload == Offload::None {
                let share = (held.updated as f64 * z.slowest_share).ceil() as u64;
                let dropped = m.precision.optimizer_bytes * held.updated.saturating_sub(share);
                held.device = held.device.saturating_sub(dropped);
                (held.updated, held.stepped) = (share, share);
            }
        }
        held
    }
}

/// The collectives `choice` runs for the op, and the bytes its strategy holds on the device
/// only while the op runs (gathered parameters, unsharded gradients). `replicated`: elements
/// of the op's replicated units, whose gradients a split ZeRO-3 op all-reduces once a step.
fn collectives(base: &OpBase, choice: Choice, m: &Machine, replicated: u64) -> (u64, Comm) {
    let p = base.params;
    let extra_gathers = f64::from(base.uses.max(1));
    let share = base.latency_share;
    let gather = |bytes: f64| m.ring_s(bytes, share);
    let all_reduce = |bytes: f64| m.all_reduce_shared_s(bytes, share);
    let pr = m.precision;
    let (pb, gb) = (pr.param_bytes, pr.grad_bytes);
    // Gradients travel in the reduce dtype.
    let rb = m.reduce_bytes;
    // Collectives as the executor runs them under gradient accumulation: DDP and ZeRO-1 sync
    // gradients once a step (the last micro-batch's backward), ZeRO-1/2 gather the updated
    // parameters once (before the first forward), ZeRO-2 reduce-scatters every micro-batch's
    // gradients, ZeRO-3 gathers and reduce-scatters for every micro-batch.
    let none = Comm::default();
    let per_node = u64::from(m.ranks_per_node);
    match choice.strategy {
        Strategy::None => (0, none),
        Strategy::Dp => (
            0,
            Comm {
                step_bwd: all_reduce((rb * p) as f64),
                step_serial: zero1_broadcasts_s(base, m),
                ..none
            },
        ),
        Strategy::Zero1 => (
            0,
            Comm {
                step_fwd: gather((pb * p) as f64),
                step_bwd: gather((rb * p) as f64),
                ..none
            },
        ),
        Strategy::Zero2 => (
            gb * p,
            Comm {
                step_fwd: gather((pb * p) as f64),
                micro_bwd: gather((rb * p) as f64),
                ..none
            },
        ),
        Strategy::Zero3 => {
            let (k, s) = (u64::from(choice.split.max(1)), u64::from(choice.sharded));
            let slice = (pb * p) as f64 / k as f64;
            let grad_slice = (rb * p) as f64 / k as f64;
            let slices = s as f64;
            let step_bwd = if replicated > 0 {
                all_reduce((rb * replicated) as f64)
            } else {
                0.0
            };
            let gathers = extra_gathers * slices;
            let comm = if m.serial_gathers {
                // Tensor by tensor after a synchronisation (`Machine::serial_gathers`): each
                // tensor pays a whole collective's latency (whatever the block would share) and
                // its host time, forward and backward, while no kernel runs. Tensors under the
                // stack's persistence threshold stay whole on every rank and are not gathered.
                let gathered = |t: &&crate::cost::graph::ParamTensor| {
                    t.numel > 0 && t.numel >= m.persistence_threshold
                };
                let tensors = base.tensors.iter().filter(gathered).count() as f64;
                let bytes: u64 = base.tensors.iter().filter(gathered).map(|t| t.numel).sum();
                let gathered_slice = (pb * bytes.min(p)) as f64 / k as f64;
                let one = m.ring_s(gathered_slice, tensors) + tensors * m.serial_gather_host_s();
                // The gradients go the same way: one list reduce-scatter per tensor, persistent
                // ones included, each after one copy per rank into the collective's flat input
                // (`Machine::serial_reduce_copies_s`), and the next module's synchronisation
                // before its gather drains them, so the backward hides none of it.
                let reduced = base.tensors.iter().filter(|t| t.numel > 0).count() as f64;
                Comm {
                    micro_serial: 2.0 * gathers * one,
                    micro_serial_reduce: slices
                        * (m.ring_s(grad_slice, reduced) + reduced * m.serial_reduce_copies_s()),
                    step_bwd,
                    ..none
                }
            } else {
                Comm {
                    micro_fwd: gathers * gather(slice),
                    micro_bwd: gathers * gather(slice) + slices * gather(grad_slice),
                    step_bwd,
                    ..none
                }
            };
            // One slice's gathered parameters and its full gradient.
            (ceil_div((pb + gb) * p, k), comm)
        }
        // ZeRO-3 inside the node for every micro-batch; the node's gradient shards summed
        // across nodes once a step (a rank's 1/ranks-per-node share, over its NICs' share).
        Strategy::Hsdp => {
            let node = |bytes: f64| m.node_ring_s(bytes, share);
            let shard = (rb * p) as f64 / per_node.max(1) as f64;
            (
                (pb + gb) * p,
                Comm {
                    micro_fwd: extra_gathers * node((pb * p) as f64),
                    micro_bwd: extra_gathers * node((pb * p) as f64) + node((rb * p) as f64),
                    step_bwd: m.replica_all_reduce_s(shard, share),
                    ..none
                },
            )
        }
    }
}

/// Copies over the host link every micro-batch: the device bytes an offloaded compute copy is
/// fetched into, and the seconds the copies take.
fn host_copies(base: &OpBase, choice: Choice, m: &Machine, held: &Held) -> (u64, f64) {
    let extra_gathers = f64::from(base.uses.max(1));
    let (pb, gb) = (m.precision.param_bytes, m.precision.grad_bytes);
    // Offloaded parameters are fetched from host memory for every forward and backward (each
    // use), into a device buffer of this rank's part; the fetches overlap compute like the
    // collectives do (a copy engine beside the kernels), in line on CPUs.
    // Copies over the host link every micro-batch: a streamed gradient shard after the
    // backward, an offloaded compute copy before each use. The executor makes them in line
    // (no copy stream yet), so none of their time hides behind compute.
    let mut fetched = 0;
    let mut host_micro_s = 0.0;
    if !choice.offload.is_none() && held.streamed > 0 {
        host_micro_s += m.host_copy_s((gb * held.streamed) as f64);
    }
    if choice.offload == Offload::Param {
        host_micro_s += 2.0 * extra_gathers * m.host_copy_s((pb * held.params) as f64);
        fetched = pb * held.params;
    }
    (fetched, host_micro_s)
}

/// Forward and backward compute of the op over a step of `a` micro-batches: its kernels, a
/// split's slices and the per-parameter passes around the kernels, every micro-batch.
fn compute_s(base: &OpBase, choice: Choice, m: &Machine, a: f64) -> f64 {
    let split_s = split_s(base, choice, m);
    // The per-parameter passes around the kernels: memory-bound over the whole parameter, every
    // micro-batch whatever the strategy — each one touches every weight and gradient then (the
    // weights cast or gathered for compute, the gradient accumulated or cast and scaled for its
    // reduce-scatter). The published runs, all sharded, cannot tell the strategies' shares
    // apart, so one rule prices them all.
    let passes = m.streamed_s(m.param_pass_bytes * base.params as f64);
    a * (base.fwd_s + base.bwd_s + split_s + passes)
}

/// What running a split op slice by slice adds to its kernels' time, forward and backward.
fn split_s(base: &OpBase, choice: Choice, m: &Machine) -> f64 {
    let split_launches = f64::from(choice.split.saturating_sub(1)) * m.launch_s;
    // A split op runs its matmuls slice by slice: k smaller matmuls instead of one, forward and
    // backward. A calibration prices the k slices from its `linear/split` curve (slices timed
    // as the trainer runs them, narrowing and summing included) or, without one, from the plain
    // linear curve; otherwise each slice costs a launch.
    match m.calibration.as_ref().filter(|_| base.splittable) {
        Some(cal) if choice.split > 1 => {
            let k = f64::from(choice.split);
            cal.kernel_s("linear/split", base.work / k)
                .map_or((1.0 + LINEAR_BWD_FACTOR) * split_launches, |(f, b)| {
                    (k * (f + b) - base.fwd_s - base.bwd_s).max(0.0)
                })
        }
        _ => {
            // Slices narrower than a multiple of 8 columns fall to the unaligned GEMM rate
            // where the machine has one, though the whole weight is aligned.
            let k = u64::from(choice.split.max(1));
            let slow = choice.split > 1
                && base.unaligned_s > 0.0
                && base.in_features > 0
                && !super::gemm_aligned((base.in_features / k) as i64);
            let unaligned = if slow {
                (base.unaligned_s - base.fwd_s - base.bwd_s).max(0.0)
            } else {
                0.0
            };
            (1.0 + LINEAR_BWD_FACTOR) * split_launches + unaligned
        }
    }
}

/// Where the optimizer state of replicated parameters is sharded over groups of ranks
/// ([`Machine::zero1_groups`]), the broadcasts that share the updated parameters after the step:
/// the op's bytes once over the group's links, and its share of every broadcast's latency.
fn zero1_broadcasts_s(base: &OpBase, m: &Machine) -> f64 {
    match m.zero1_groups {
        Some(z) if z.ranks > 1 && base.params > 0 => {
            let bytes = (m.precision.param_bytes * base.params) as f64;
            let latency = m.broadcast_s(0.0, z.ranks, base.param_share);
            f64::from(z.broadcasts) * latency + m.broadcast_s(bytes, z.ranks, 0.0)
        }
        _ => 0.0,
    }
}

/// The op's optimizer step on this rank, once a step.
fn optimizer_s(base: &OpBase, choice: Choice, m: &Machine, held: &Held) -> f64 {
    let (pb, gb) = (m.precision.param_bytes, m.precision.grad_bytes);
    let updated = held.updated;
    match &m.calibration {
        _ if updated == 0 => 0.0,
        // Once a step, after the last backward: this rank's gradients to the host, the
        // AdamW step on its CPU cores, the updated weights back (an offloaded compute copy
        // is updated in place on the host).
        _ if !choice.offload.is_none() => {
            let back = if choice.offload == Offload::Opt {
                m.host_copy_s((pb * updated) as f64)
            } else {
                0.0
            };
            m.host_copy_s((gb * held.stepped) as f64) + host_adam_s(base, choice, m) + back
        }
        Some(cal) => calibrated_optimizer_s(cal, base, choice, m),
        None => m.streamed_s((m.optimizer_bytes_per_param * updated) as f64),
    }
}

/// One op's collective time in a step, split by phase and by how often it runs.
#[derive(Debug, Clone, Copy, Default)]
struct Comm {
    /// Per micro-batch, in its forward / backward.
    micro_fwd: f64,
    micro_bwd: f64,
    /// Once a step: before the first forward / after the last backward.
    step_fwd: f64,
    step_bwd: f64,
    /// Per micro-batch, between kernels: collectives and their host time that a stack runs
    /// with the device synchronised ([`Machine::serial_gathers`]), hidden behind nothing.
    micro_serial: f64,
    /// Per micro-batch, in the backward: the gradients' collectives such a stack runs between
    /// two synchronisations, hidden behind nothing either (a recomputation repeats none).
    micro_serial_reduce: f64,
    /// Once a step, after the optimizer: collectives waited for before the next forward,
    /// hidden behind nothing ([`Machine::zero1_groups`]' broadcasts).
    step_serial: f64,
}

impl Comm {
    fn total(&self, accumulation: f64) -> f64 {
        accumulation
            * (self.micro_fwd + self.micro_bwd + self.micro_serial + self.micro_serial_reduce)
            + self.step_fwd
            + self.step_bwd
            + self.step_serial
    }

    /// The forward's per-micro-batch gathers once more, over `accumulation` micro-batches, as a
    /// recomputation repeats them: hidden behind the recomputed forward where collectives
    /// overlap, and the serial ones (half of [`Comm::micro_serial`], which counts forward and
    /// backward) behind nothing.
    fn regathered_s(&self, base: &OpBase, m: &Machine, accumulation: f64) -> f64 {
        let fwd = if m.overlap {
            (self.micro_fwd - base.fwd_s).max(0.0)
        } else {
            self.micro_fwd
        };
        accumulation * (fwd + self.micro_serial / 2.0)
    }

    /// The part of this communication the op's compute does not hide, over `accumulation`
    /// micro-batches of its forward and backward.
    fn exposed_s(&self, base: &OpBase, m: &Machine, accumulation: f64) -> f64 {
        let (comm, a) = (self, accumulation);
        // Each micro-batch's collectives overlap its own compute; the once-a-step ones overlap
        // the first forward (gathers) or the last backward (gradient syncs) beside that
        // micro-batch's own. With one micro-batch this is the plain per-op overlap.
        if m.overlap {
            let hidden = |comm: f64, compute: f64| (comm - compute).max(0.0);
            (a - 1.0) * (hidden(comm.micro_fwd, base.fwd_s) + hidden(comm.micro_bwd, base.bwd_s))
                + hidden(comm.micro_fwd + comm.step_fwd, base.fwd_s)
                + hidden(comm.micro_bwd + comm.step_bwd, base.bwd_s)
                + a * (comm.micro_serial + comm.micro_serial_reduce)
                + comm.step_serial
        } else {
            comm.total(a)
        }
    }
}

/// The host's AdamW step of an offloaded op, tensor by tensor at the CPU cores' rate. A
/// calibrated optimizer curve carries each tensor's fixed cost (below its range, its smallest
/// step's time); the host's step pays it too, or a small tensor (a LayerNorm's weight and bias)
/// would look cheaper to update on the host than where it is.
fn host_adam_s(base: &OpBase, choice: Choice, m: &Machine) -> f64 {
    let (n, per_node) = (u64::from(m.ranks.max(1)), u64::from(m.ranks_per_node));
    let fixed = m.calibration.as_ref().map_or(0.0, |cal| cal.optimizer_s(1));
    base.units(choice)
        .map(|u| {
            u.holding
                .updated(u.numel, u.holding.shard_ranks(n, per_node))
        })
        .filter(|&updated| updated > 0)
        .map(|updated| (updated as f64 / m.cpu_adam_params_per_s.max(1.0)).max(fixed))
        .sum()
}

/// Measured optimizer time of one op's tensors on one rank, unit by unit as the trainer
/// updates them ([`Choice::units`]): each unit whole or as this rank's share.
fn calibrated_optimizer_s(cal: &Calibration, base: &OpBase, choice: Choice, m: &Machine) -> f64 {
    let (n, per_node) = (u64::from(m.ranks.max(1)), u64::from(m.ranks_per_node));
    base.units(choice)
        .map(|u| {
            let over = u.holding.shard_ranks(n, per_node);
            cal.optimizer_s(u.holding.updated(u.numel, over))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::fixtures::{calibrated, cluster, linear_base, machine, with_host};
    use crate::cost::{
        choices, ParamTensor, DS_2021_GATHER_HOST_S, NCCL_BASE_LATENCY_S, PARAM_PASS_BYTES,
    };

    /// `--target fsdp2` prices what `fully_shard` holds and sends: zero2 keeps its state sharded
    /// and the gathered copy through the step, zero3 holds two units' gathered buffers (the
    /// prefetched one), every micro-batch re-gathers, and with accumulation each module keeps
    /// its unsharded gradient and reduces it once a step.
    #[test]
    fn fsdp2_prices_what_fully_shard_holds_and_sends() {
        let osdp = machine(8);
        let fsdp2 = Machine {
            target: Target::Fsdp2,
            ..machine(8)
        };
        let p = 1u64 << 20;
        let (pb, gb, rb) = (2, 2, osdp.reduce_bytes);
        let at = |accumulation: u32| OpBase {
            accumulation,
            ..linear_base(p)
        };
        let base = at(1);
        let (z2, z3) = (
            Choice::plain(Strategy::Zero2),
            Choice::plain(Strategy::Zero3),
        );
        // State: zero3's sharded 16 bytes per parameter under both; FSDP2's zero2 is zero3's
        // plus the gathered copy, where the trainer keeps the whole compute copy instead.
        let shard = 16 * p / 8;
        assert_eq!(price(&base, z3, &osdp).persistent_bytes, shard);
        assert_eq!(price(&base, z3, &fsdp2).persistent_bytes, shard);
        assert_eq!(price(&base, z2, &fsdp2).persistent_bytes, shard + pb * p);
        assert_eq!(
            price(&base, z2, &osdp).persistent_bytes,
            pb * p + 14 * p / 8
        );
        // While it runs, zero3 holds its gathered buffer and the prefetched unit's, the
        // unsharded gradient and the reduce dtype's copy of it.
        let w = base.working_bytes;
        assert_eq!(
            price(&base, z3, &fsdp2).transient_bytes,
            2 * pb * p + (gb + rb) * p + w
        );
        assert_eq!(price(&base, z3, &osdp).transient_bytes, (pb + gb) * p + w);
        // Four micro-batches: FSDP2's zero2 gathers in each, the trainer's once a step.
        let acc = at(4);
        let more = |c: Choice, m: &Machine| price(&acc, c, m).comm_s - price(&base, c, m).comm_s;
        let gather = fsdp2.ring_s((pb * p) as f64, base.latency_share);
        let reduce = fsdp2.ring_s((rb * p) as f64, base.latency_share);
        assert!((more(z2, &fsdp2) - 3.0 * gather).abs() < 1e-12);
        assert!((more(z2, &osdp) - 3.0 * reduce).abs() < 1e-12);
        // FSDP2's zero3 gathers twice a micro-batch and reduces once a step.
        assert!((more(z3, &fsdp2) - 6.0 * gather).abs() < 1e-12);
        assert!((more(z3, &osdp) - 3.0 * (2.0 * gather + reduce)).abs() < 1e-12);
        // ... and every module holds its unsharded gradient, in the reduce dtype, meanwhile,
        // beside the memory of its sharded one, which the reduce-scatter stream keeps reserved.
        for c in [Choice::DP, z2, z3] {
            assert_eq!(
                price(&acc, c, &fsdp2).persistent_bytes - price(&base, c, &fsdp2).persistent_bytes,
                rb * p,
                "{}",
                c.label()
            );
            assert_eq!(
                price(&acc, c, &osdp).persistent_bytes,
                price(&base, c, &osdp).persistent_bytes
            );
        }
    }

    /// 2024's FSDP2 never reshards its root unit after the forward: where the root holds the
    /// ops outside the blocks, such an op under zero3 gathers once a micro-batch and holds its
    /// gathered copy through the step, as zero2 does; so does an op of torchtitan's last
    /// block; another block's op is unchanged.
    #[test]
    fn fsdp2s_root_unit_gathers_once_and_holds_its_copy() {
        let mut fsdp2 = Machine {
            target: Target::Fsdp2,
            ..machine(8)
        };
        let p = 1u64 << 20;
        let z3 = Choice::plain(Strategy::Zero3);
        let root = OpBase {
            outside_blocks: true,
            ..linear_base(p)
        };
        let plain = price(&root, z3, &fsdp2);
        fsdp2.fsdp2_root_unsharded = true;
        let held = price(&root, z3, &fsdp2);
        let gathered = 2 * p;
        assert_eq!(held.persistent_bytes, plain.persistent_bytes + gathered);
        assert_eq!(held.transient_bytes, plain.transient_bytes - 2 * gathered);
        let gather = fsdp2.ring_s(gathered as f64, root.latency_share);
        assert!((plain.comm_s - held.comm_s - gather).abs() < 1e-12);
        let inside = OpBase {
            outside_blocks: false,
            ..root.clone()
        };
        assert_eq!(price(&inside, z3, &fsdp2), plain);
        // torchtitan's last block, never resharded after its forward either, is held alike.
        let last = OpBase {
            in_last_block: true,
            ..inside.clone()
        };
        assert_eq!(price(&last, z3, &fsdp2), plain);
        fsdp2.fsdp2_last_block_unsharded = true;
        assert_eq!(price(&last, z3, &fsdp2), held);
        assert_eq!(price(&inside, z3, &fsdp2), plain);
    }

    /// A stack that gathers tensor by tensor after a device synchronisation (DeepSpeed ZeRO-3 of
    /// 2021) hides none of its gathers behind compute, however long the op computes: each
    /// tensor pays its own collective latency and its host time, forward and backward, every
    /// micro-batch; and that host time grows with the ranks (one copy per rank). Its gradients'
    /// reduce-scatters, tensor by tensor too and drained by the next synchronisation, hide
    /// behind nothing either, and copy every rank's view first.
    #[test]
    fn serial_gathers_hide_behind_no_compute_and_cost_more_with_more_ranks() {
        let p = 1u64 << 20;
        let mut base = OpBase {
            fwd_s: 1.0,
            bwd_s: 2.0,
            ..linear_base(p)
        };
        base.tensors[1] = ParamTensor {
            numel: 1024,
            cut: false,
        };
        let z3 = Choice::plain(Strategy::Zero3);
        // Overlapped, a second of compute hides the gathers and the reduce-scatter.
        assert_eq!(price(&base, z3, &machine(8)).exposed_comm_s, 0.0);
        let serial = Machine {
            serial_gathers: true,
            ..machine(8)
        };
        let gather = serial.ring_s((2 * p) as f64, 2.0) + 2.0 * DS_2021_GATHER_HOST_S;
        let reduce =
            serial.ring_s((serial.reduce_bytes * p) as f64, 2.0) + 2.0 * 8.0 * serial.launch_s;
        let one = price(&base, z3, &serial);
        assert!((one.exposed_comm_s - (2.0 * gather + reduce)).abs() < 1e-12);
        // A block sharing its latency does not help: each tensor is a collective of its own.
        let shared = OpBase {
            latency_share: 0.25,
            ..base.clone()
        };
        assert_eq!(
            price(&shared, z3, &serial).exposed_comm_s,
            one.exposed_comm_s
        );
        // Every micro-batch gathers and reduce-scatters again.
        let four = OpBase {
            accumulation: 4,
            ..base.clone()
        };
        let more = price(&four, z3, &serial).exposed_comm_s;
        assert!(
            (more - 4.0 * (2.0 * gather + reduce)).abs() < 1e-12,
            "{more}"
        );
        // On 1,536 ranks a tensor's gather costs 1,528 more copy launches on the host: 8 ms.
        let wide = Machine {
            serial_gathers: true,
            ..machine(1536)
        };
        let host = wide.serial_gather_host_s();
        assert!((host - (DS_2021_GATHER_HOST_S + 1528.0 * 5e-6)).abs() < 1e-12);
        // ... and its reduce-scatter 1,536 copies on the collective's stream: 7.7 ms a tensor.
        assert!((wide.serial_reduce_copies_s() - 1536.0 * 5e-6).abs() < 1e-12);
        assert!(price(&base, z3, &wide).exposed_comm_s > one.exposed_comm_s + 6.0 * 7e-3);
    }

    /// DeepSpeed ZeRO-3 (2021) keeps tensors under its persistence threshold whole, so a linear
    /// gathers its weight alone and a norm nothing; and it releases a module after every
    /// forward, so a recomputation gathers again. FSDP does not (nor the planner's default).
    #[test]
    fn persistent_tensors_are_not_gathered_and_a_recomputation_gathers_again() {
        let p = 1u64 << 20;
        let small = ParamTensor {
            numel: 1024,
            cut: false,
        };
        let mut base = OpBase {
            fwd_s: 1.0,
            bwd_s: 2.0,
            ..linear_base(p)
        };
        base.tensors[1] = small;
        let z3 = Choice::plain(Strategy::Zero3);
        let ds = Machine {
            serial_gathers: true,
            persistence_threshold: 100_000,
            regather_on_recompute: true,
            ..machine(8)
        };
        let weight = ds.ring_s((2 * p) as f64, 1.0) + DS_2021_GATHER_HOST_S;
        // Gradients are reduce-scattered tensor by tensor, the persistent ones too.
        let reduce = |params: u64| {
            ds.ring_s((ds.reduce_bytes * params) as f64, 2.0) + 2.0 * ds.serial_reduce_copies_s()
        };
        let linear = price(&base, z3, &ds);
        assert!((linear.exposed_comm_s - (2.0 * weight + reduce(p))).abs() < 1e-12);
        let norm = OpBase {
            params: 2048,
            tensors: [small, small],
            ..base.clone()
        };
        let gathers_nothing = price(&norm, z3, &ds).exposed_comm_s;
        assert!((gathers_nothing - reduce(2048)).abs() < 1e-12);
        // Serial: the recomputation's gather hides behind nothing.
        assert!((linear.recompute_comm_s - weight).abs() < 1e-12);
        assert!((linear.recompute_s(&base) - (base.fwd_s + weight)).abs() < 1e-12);
        // Overlapped: behind the recomputed forward, what it does not hide.
        let m = Machine {
            regather_on_recompute: true,
            ..machine(8)
        };
        assert_eq!(price(&base, z3, &m).recompute_comm_s, 0.0);
        let quick = OpBase {
            fwd_s: 0.0,
            ..base.clone()
        };
        let gather = m.ring_s((2 * p) as f64, 1.0);
        assert!((price(&quick, z3, &m).recompute_comm_s - gather).abs() < 1e-12);
        // FSDP keeps the unit gathered through the recomputation; replicated ops gather nothing.
        let fsdp = Machine {
            regather_on_recompute: false,
            ..machine(8)
        };
        assert_eq!(price(&quick, z3, &fsdp).recompute_comm_s, 0.0);
        let fsdp2 = Machine {
            target: Target::Fsdp2,
            ..machine(8)
        };
        assert_eq!(price(&quick, z3, &fsdp2).recompute_comm_s, 0.0);
        assert_eq!(price(&quick, Choice::DP, &m).recompute_comm_s, 0.0);
    }

    /// The block's last op with parameters keeps the weight its recomputation gathered for its
    /// backward, which follows at once: only its bias is gathered again, and a split op, whose
    /// slices are gathered one at a time, keeps nothing.
    #[test]
    fn a_blocks_last_op_gathers_only_its_bias_again() {
        let p = 1u64 << 20;
        let mut base = OpBase {
            fwd_s: 0.0,
            ends_block_params: true,
            ..linear_base(p)
        };
        base.tensors[1] = ParamTensor {
            numel: 1024,
            cut: false,
        };
        let m = machine(8);
        let z3 = Choice::plain(Strategy::Zero3);
        let bias = m.ring_s((2 * 1024) as f64, 1.0);
        let kept = price(&base, z3, &m).recompute_comm_s;
        assert!((kept - bias).abs() < 1e-12, "{kept} vs {bias}");
        let inside = OpBase {
            ends_block_params: false,
            ..base.clone()
        };
        let whole = price(&inside, z3, &m).recompute_comm_s;
        // Inside the block the weight's 2 MiB are gathered again as well.
        assert!(
            whole - kept > 0.5 * (2 * p) as f64 * 7.0 / 8.0 / m.link_bytes_per_s,
            "{whole}"
        );
        let split = price(&base, Choice::zero3(2, 2), &m).recompute_comm_s;
        let split_inside = price(&inside, Choice::zero3(2, 2), &m).recompute_comm_s;
        assert_eq!(split, split_inside);
    }

    /// osdp-tui's trainer fetches a recomputed op's parameters again, as its forward did: an
    /// offloaded op's are copied from host memory once more, in line, and the planner prices it.
    #[test]
    fn a_recomputation_copies_offloaded_parameters_again() {
        let m = with_host(machine(1));
        assert!(
            m.regather_on_recompute,
            "the trainer's machine prices what it does"
        );
        let base = linear_base(1 << 20);
        let off = price(&base, Choice::DP.offloaded(Offload::Param), &m);
        let copy = m.host_copy_s((m.precision.param_bytes << 20) as f64);
        assert!(
            (off.recompute_comm_s - copy).abs() < 1e-12,
            "{}",
            off.recompute_comm_s
        );
        // Kept on the device, nothing is copied; without the trainer's refetch, neither.
        assert_eq!(price(&base, Choice::DP, &m).recompute_comm_s, 0.0);
        let fsdp = Machine {
            regather_on_recompute: false,
            ..m
        };
        let off = price(&base, Choice::DP.offloaded(Offload::Param), &fsdp);
        assert_eq!(off.recompute_comm_s, 0.0);
    }

    /// On a calibrated layout a tiny tensor's host AdamW step pays the curve's fixed cost, as
    /// its device step does: offloading a LayerNorm never looks like it saves time.
    #[test]
    fn a_small_tensor_offloaded_pays_the_optimizers_fixed_cost() {
        let m = calibrated(with_host(machine(1)));
        let base = linear_base(768);
        let kept = price(&base, Choice::DP, &m).optimizer_s;
        let off = price(&base, Choice::DP.offloaded(Offload::Opt), &m).optimizer_s;
        assert!((kept - 50e-6).abs() < 1e-12, "{kept}");
        assert!(off >= kept, "offloaded {off} s < kept {kept} s");
        // A large tensor is priced at the host's rate, fixed cost long passed.
        let big = linear_base(1 << 24);
        let off = price(&big, Choice::DP.offloaded(Offload::Opt), &m).optimizer_s;
        let adam = (1u64 << 24) as f64 / 1e9;
        assert!(off > adam && off < adam + 0.1, "{off}");
    }

    #[test]
    fn offload_moves_state_to_the_host_byte_for_byte() {
        let m = with_host(machine(4));
        let base = linear_base(1 << 20);
        let p = (1u64 << 20) as f64;
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ] {
            let plain = price(&base, Choice::plain(strategy), &m);
            let opt = price(&base, Choice::plain(strategy).offloaded(Offload::Opt), &m);
            let updated = base
                .units(Choice::plain(strategy))
                .map(|u| u.holding.updated(u.numel, 4))
                .sum::<u64>();
            // The device lets go of the fp32 master and moments (12 bytes per parameter it
            // updates) and, where gradients are sharded every micro-batch, of the gradient
            // shard too (2); the host takes master, moments and an fp32 gradient (16).
            let streams = matches!(strategy, Strategy::Zero2 | Strategy::Zero3);
            let freed = 12 * updated + if streams { 2 * updated } else { 0 };
            assert_eq!(
                plain.persistent_bytes - opt.persistent_bytes,
                freed,
                "{strategy:?}"
            );
            assert_eq!(opt.host_bytes, 16 * updated, "{strategy:?}");
            assert_eq!(plain.host_bytes, 0);
            // Once a step: the gradient out (2 B) unless it streamed, AdamW on the CPU,
            // weights back (2 B).
            let copy = (2 * updated) as f64 / 25e9 + 5e-6;
            let out = if streams { 0.0 } else { copy };
            let want = out + updated as f64 / 1e9 + copy;
            assert!((opt.optimizer_s - want).abs() < 1e-12, "{strategy:?}");
            assert!(opt.optimizer_s > plain.optimizer_s);
            // A streamed gradient crosses the host link every micro-batch, beside the backward.
            let every = if streams { copy } else { 0.0 };
            assert!(
                (opt.comm_s - plain.comm_s - every).abs() < 1e-12,
                "{strategy:?}"
            );
            assert_eq!(opt.transient_bytes, plain.transient_bytes);
        }
        // offload-param: the compute copy (2 B per held parameter) moves too, and is fetched
        // for the forward and the backward; on one rank it is the whole tensor.
        let one = with_host(machine(1));
        let dp = price(&base, Choice::DP, &one);
        let param = price(&base, Choice::DP.offloaded(Offload::Param), &one);
        assert_eq!(dp.persistent_bytes - param.persistent_bytes, 14 * (1 << 20));
        assert_eq!(param.host_bytes, 18 * (1 << 20));
        assert_eq!(param.transient_bytes, dp.transient_bytes + 2 * (1 << 20));
        let fetch = 2.0 * p / 25e9 + 5e-6;
        assert!((param.comm_s - dp.comm_s - 2.0 * fetch).abs() < 1e-12);
    }

    #[test]
    fn parameter_passes_run_every_micro_batch_under_every_strategy() {
        let mut m = machine(8);
        m.param_pass_bytes = PARAM_PASS_BYTES;
        let pass_s = m.streamed_s(PARAM_PASS_BYTES * 50e6);
        let four = OpBase {
            accumulation: 4,
            ..linear_base(50_000_000)
        };
        let mut none = m.clone();
        none.param_pass_bytes = 0.0;
        // Four micro-batches: four passes, whether the gradient is reduced every micro-batch
        // (zero2, zero3, hsdp) or accumulated and synchronised once (dp, zero1).
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
            Strategy::Hsdp,
        ] {
            let with = price(&four, Choice::plain(strategy), &m).compute_s;
            let without = price(&four, Choice::plain(strategy), &none).compute_s;
            assert!(
                ((with - without) - 4.0 * pass_s).abs() < 1e-12,
                "{strategy:?}: {} passes, expected 4",
                (with - without) / pass_s
            );
        }
        // An op without parameters makes none.
        let act = OpBase {
            params: 0,
            tensors: [ParamTensor::default(); 2],
            ..four
        };
        assert_eq!(
            price(&act, Choice::plain(Strategy::None), &m).compute_s,
            price(&act, Choice::plain(Strategy::None), &none).compute_s
        );
    }

    #[test]
    fn accumulation_repeats_compute_and_the_per_micro_batch_collectives_only() {
        let mut m = machine(8);
        m.overlap = false;
        let one = linear_base(50_000_000);
        let four = OpBase {
            accumulation: 4,
            ..one.clone()
        };
        for strategy in [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ] {
            let (c1, c4) = (
                price(&one, Choice::plain(strategy), &m),
                price(&four, Choice::plain(strategy), &m),
            );
            assert!(
                (c4.compute_s - 4.0 * c1.compute_s).abs() < 1e-15,
                "{strategy:?}"
            );
            assert_eq!(c4.persistent_bytes, c1.persistent_bytes, "{strategy:?}");
            assert_eq!(
                c4.optimizer_s, c1.optimizer_s,
                "the optimizer runs once a step"
            );
            let (rs, ag, ar) = (
                m.reduce_scatter_s(2.0 * 50e6),
                m.all_gather_s(2.0 * 50e6),
                m.all_reduce_s(2.0 * 50e6),
            );
            let want = match strategy {
                // Gradients synced once a step, after the last micro-batch.
                Strategy::Dp => ar,
                Strategy::Zero1 => ag + rs,
                // Reduce-scattered every micro-batch; the update gathered once.
                Strategy::Zero2 => ag + 4.0 * rs,
                // Gathered for forward and backward and reduce-scattered, every micro-batch.
                _ => 4.0 * (2.0 * ag + rs),
            };
            assert!(
                (c4.comm_s - want).abs() < 1e-12,
                "{strategy:?}: {} vs {want}",
                c4.comm_s
            );
        }
        // With overlap, a once-a-step sync hides behind one micro-batch's backward only.
        m.overlap = true;
        let d = price(&four, Choice::DP, &m);
        let one_bwd_hides = (m.all_reduce_s(2.0 * 50e6) - one.bwd_s).max(0.0);
        assert!((d.exposed_comm_s - one_bwd_hides).abs() < 1e-15);
    }

    #[test]
    fn memory_matches_the_zero_paper_table() {
        // ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ parameters, N_d = 64 ranks, K = 12.
        let (psi, n) = (7_500_000_000u64, 64u32);
        let m = machine(n);
        let b = linear_base(psi);
        let held = |c| price(&b, c, &m).persistent_bytes;
        assert_eq!(held(Choice::DP), 16 * psi); // 120 GB
        assert_eq!(
            held(Choice::plain(Strategy::Zero1)),
            4 * psi + 12 * psi / 64
        ); // 31.4 GB
        assert_eq!(
            held(Choice::plain(Strategy::Zero2)),
            2 * psi + 14 * psi / 64
        ); // 16.6 GB
        assert_eq!(held(Choice::zero3(1, 1)), 16 * psi / 64); // 1.9 GB
        assert_eq!(16 * psi / 64, 1_875_000_000);
    }

    #[test]
    fn partial_sharding_interpolates_between_dp_and_zero3() {
        let m = machine(8);
        let b = linear_base(8_000);
        // 4 slices, 3 sharded: 2,000 params replicated (16 B each), 6,000 sharded over 8 ranks.
        let c = price(&b, Choice::zero3(4, 3), &m);
        assert_eq!(c.persistent_bytes, 16 * 2_000 + 16 * 6_000 / 8);
        // One slice of bf16 params and its bf16 gradient is gathered at a time.
        assert_eq!(c.transient_bytes, 4 * 8_000 / 4);
        assert_eq!(
            price(&b, Choice::zero3(1, 1), &m).transient_bytes,
            4 * 8_000
        );
        assert_eq!(
            price(&b, Choice::plain(Strategy::Zero2), &m).transient_bytes,
            2 * 8_000
        );
        assert_eq!(price(&b, Choice::DP, &m).transient_bytes, 0);
    }

    #[test]
    fn zero3_moves_one_and_a_half_times_the_bytes_of_dp() {
        // Bandwidth term only: make latency vanish.
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let b = linear_base(1_000_000_000);
        let dp = price(&b, Choice::DP, &m).comm_s;
        let z1 = price(&b, Choice::plain(Strategy::Zero1), &m).comm_s;
        let z3 = price(&b, Choice::zero3(1, 1), &m).comm_s;
        // DP all-reduces 2 GB of grads: 2 · 7/8 · 2e9 / 100e9 = 35 ms.
        assert!((dp - 0.035).abs() < 1e-12, "{dp}");
        assert!((z1 - dp).abs() < 1e-12);
        assert!((z3 - 1.5 * dp).abs() < 1e-12, "{z3}");
        // Splitting keeps the volume; each slice pays the latency again.
        let mut m2 = machine(8);
        m2.link_bytes_per_s = f64::INFINITY;
        let one = price(&b, Choice::zero3(1, 1), &m2).comm_s;
        let four = price(&b, Choice::zero3(4, 4), &m2).comm_s;
        assert!((one - 3.0 * 70e-6).abs() < 1e-12);
        assert!((four - 4.0 * one).abs() < 1e-12);
    }

    #[test]
    fn communication_hides_behind_the_ops_compute() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        // 10M params: DP all-reduce of 20 MB = 2·7/8·20e6/100e9 = 350 µs < 2 ms backward.
        let small = linear_base(10_000_000);
        let c = price(&small, Choice::DP, &m);
        assert_eq!(c.exposed_comm_s, 0.0);
        // 1B params: 35 ms of all-reduce against 2 ms backward leaves 33 ms exposed.
        let big = linear_base(1_000_000_000);
        let c = price(&big, Choice::DP, &m);
        assert!(
            (c.exposed_comm_s - 0.033).abs() < 1e-12,
            "{}",
            c.exposed_comm_s
        );
    }

    #[test]
    fn optimizer_step_is_bandwidth_bound_over_the_local_shard() {
        let m = machine(8);
        let b = linear_base(8_000_000);
        // DP updates all 8M params: 28 B each at 0.8 TB/s = 280 µs.
        let dp = price(&b, Choice::DP, &m).optimizer_s;
        assert!((dp - 8e6 * 28.0 / 0.8e12).abs() < 1e-15);
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((z3 - dp / 8.0).abs() < 1e-15);
    }

    /// InternLM's hybrid ZeRO: a replicated op all-reduces its gradients as DDP does, steps only
    /// the slowest rank's share, and pays its bytes once and its share of every broadcast's
    /// latency after the step, hidden behind nothing.
    #[test]
    fn zero1_groups_step_a_share_and_broadcast_it_after_the_step() {
        let mut m = machine(8);
        let mut b = linear_base(8_000_000);
        b.param_share = 0.25;
        let dp = price(&b, Choice::DP, &m);
        m.zero1_groups = Some(crate::cost::Zero1Groups {
            ranks: 8,
            broadcasts: 6,
            slowest_share: 0.2,
        });
        let z = price(&b, Choice::DP, &m);
        assert!((z.optimizer_s - 0.2 * dp.optimizer_s).abs() < 1e-15);
        // The optimizer state held is the slowest rank's share: 12 bytes a parameter × 0.2.
        let state = 12 * 8_000_000;
        assert_eq!(dp.persistent_bytes - z.persistent_bytes, state - state / 5);
        // 6 broadcasts × a quarter of 7 hops × 10 µs, and 16 MB once over 100 GB/s.
        let broadcasts = 6.0 * 0.25 * 70e-6 + 16e6 / 100e9;
        assert!((z.comm_s - dp.comm_s - broadcasts).abs() < 1e-12);
        assert!((z.exposed_comm_s - dp.exposed_comm_s - broadcasts).abs() < 1e-12);
        // Only replicated ops are stepped so; a sharded one is as before.
        let z3 = Choice::zero3(1, 1);
        m.zero1_groups = None;
        let before = price(&b, z3, &m);
        m.zero1_groups = Some(crate::cost::Zero1Groups {
            ranks: 8,
            broadcasts: 6,
            slowest_share: 0.2,
        });
        let after = price(&b, z3, &m);
        assert_eq!(before.optimizer_s, after.optimizer_s);
        assert_eq!(before.comm_s, after.comm_s);
    }

    #[test]
    fn calibrated_curves_price_kernels_slices_and_the_optimizer() {
        let m = calibrated(machine(8));
        let mut b = linear_base(8_000_000);
        b.work = 1e9;
        (b.fwd_s, b.bwd_s) = m
            .calibration
            .as_ref()
            .and_then(|c| c.kernel_s("linear", b.work))
            .unwrap();
        assert_eq!((b.fwd_s, b.bwd_s), (1e-2, 2e-2));
        // Four slices of 250 MFLOP: log-log interpolation between the two points gives
        // 10 ms · (1/4)^(1/3) each forward, twice that backward.
        let slice_fwd = 1e-2 * 0.25f64.powf(1.0 / 3.0);
        let one = price(&b, Choice::zero3(1, 1), &m).compute_s;
        let four = price(&b, Choice::zero3(4, 4), &m).compute_s;
        assert!((one - 3e-2).abs() < 1e-12, "{one}");
        assert!((four - 4.0 * 3.0 * slice_fwd).abs() < 1e-9, "{four}");
        // The optimizer follows its curve by tensor size: dp updates the 8M weight (1 ms per
        // 1M beyond the curve's end), zero3 its 1M share, zero3/4:4 four shares of 250k, each
        // log-log between the points: 50 µs · 20^(log(250)/log(1000)).
        let dp = price(&b, Choice::DP, &m).optimizer_s;
        assert!((dp - 8e-3).abs() < 1e-12, "{dp}");
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((z3 - 1e-3).abs() < 1e-12, "{z3}");
        let quarter = 50e-6 * 20f64.powf(250f64.ln() / 1000f64.ln());
        let z3_split = price(&b, Choice::zero3(4, 4), &m).optimizer_s;
        assert!((z3_split - 4.0 * quarter).abs() < 1e-12, "{z3_split}");
        // Two of four slices sharded: two shares and two whole slices of 2M.
        let half = price(&b, Choice::zero3(4, 2), &m).optimizer_s;
        assert!(
            (half - (2.0 * quarter + 2.0 * 2e-3)).abs() < 1e-12,
            "{half}"
        );
        // A `linear/split` curve (slices timed as the trainer runs them) prices the slices
        // instead of the plain linear curve: 4 slices of 250 MFLOP at 4 ms + 8 ms each.
        let mut ms = m.clone();
        if let Some(c) = ms.calibration.as_mut().map(std::sync::Arc::make_mut) {
            c.kernels.insert(
                "linear/split".into(),
                vec![crate::cluster::calibration::CurvePoint {
                    work: 1e8,
                    fwd_s: 1e-3,
                    bwd_s: 2e-3,
                }],
            );
        }
        let four = price(&b, Choice::zero3(4, 4), &ms).compute_s;
        assert!(
            (four - 4.0 * (1e-3 * 2.5 + 2e-3 * 2.5)).abs() < 1e-12,
            "{four}"
        );
        assert_eq!(price(&b, Choice::zero3(1, 1), &ms).compute_s, one);
        assert_eq!(m.step_overhead_s(), 2e-3);
        assert!(m.timing_source().starts_with("calibrated 2026-11-22"));
        assert!(machine(8).timing_source().contains("not calibrated"));
    }

    #[test]
    fn without_overlap_all_communication_is_exposed() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let small = linear_base(10_000_000);
        assert_eq!(price(&small, Choice::DP, &m).exposed_comm_s, 0.0);
        m.overlap = false;
        let c = price(&small, Choice::DP, &m);
        assert!((c.exposed_comm_s - 350e-6).abs() < 1e-12 && c.exposed_comm_s == c.comm_s);
    }

    #[test]
    fn a_split_ops_state_is_priced_unit_by_unit_as_the_trainer_holds_it() {
        let m = machine(8);
        // A 1000-element weight cut in 4 and a 10-element bias, in bf16 mixed (16 B each).
        let b = OpBase {
            tensors: [
                ParamTensor {
                    numel: 1000,
                    cut: true,
                },
                ParamTensor {
                    numel: 10,
                    cut: false,
                },
            ],
            params: 1010,
            ..linear_base(1010)
        };
        // 1 of 4 slices sharded: one share of 250 (32 each) and three whole slices; the bias
        // whole. Not 16 · 757.5 + 16 · 252.5 / 8, the sharded fraction of all parameters.
        let one = price(&b, Choice::zero3(4, 1), &m).persistent_bytes;
        assert_eq!(one, 16 * 32 + 16 * 3 * 250 + 16 * 10);
        // 2 of 4: the bias is sharded too (10 over 8 ranks: 2 each).
        let two = price(&b, Choice::zero3(4, 2), &m).persistent_bytes;
        assert_eq!(two, 16 * 2 * 32 + 16 * 2 * 250 + 16 * 2);
    }

    #[test]
    fn hsdp_holds_a_nodes_share_gathers_over_nvlink_and_syncs_across_nodes_once_a_step() {
        // Two nodes of 8: NVLink 370 GB/s and 10 µs per step; eight 46 GB/s NICs, 15 µs.
        let mut m = cluster(2, 8.0);
        m.overlap = false;
        assert_eq!((m.ranks, m.ranks_per_node, m.nodes), (16, 8, 2));
        // Each of a node's 8 ranks runs its own cross-node ring over one NIC.
        assert!((m.replica_link_bytes_per_s - 46e9).abs() < 1e-3);
        let p = 1_000_000_000u64;
        let mut b = linear_base(p);
        b.accumulation = 4;
        let hsdp = Choice::plain(Strategy::Hsdp);
        let c = price(&b, hsdp, &m);
        // ZeRO's 16 bytes per parameter over the node's 8 ranks, not all 16.
        assert_eq!(c.persistent_bytes, 16 * p / 8);
        assert_eq!(
            c.transient_bytes,
            price(&b, Choice::zero3(1, 1), &m).transient_bytes
        );
        // Per micro-batch two gathers and a reduce-scatter of 2 GB inside the node; once a
        // step an all-reduce of the rank's 1/8 gradient shard over the 2 nodes.
        let base = NCCL_BASE_LATENCY_S;
        let node = base + 7.0 * 10e-6 + 7.0 / 8.0 * 2e9 / 370e9;
        let across = 2.0 * (base + 15e-6 + 0.5 * (2e9 / 8.0) / 46e9);
        let want = 4.0 * 3.0 * node + across;
        assert!((c.comm_s - want).abs() < 1e-12, "{} vs {want}", c.comm_s);
        // The optimizer updates the node share.
        let z3 = price(&b, Choice::zero3(1, 1), &m).optimizer_s;
        assert!((c.optimizer_s - 2.0 * z3).abs() < 1e-15);
        // Offered, and runnable, only where the ranks span nodes.
        assert!(choices(&b, &m, 1).contains(&hsdp));
        assert_eq!(m.refuses(Strategy::Hsdp), None);
        let one = cluster(1, 8.0);
        assert!(!choices(&b, &one, 8).contains(&hsdp));
        let why = one.refuses(Strategy::Hsdp).unwrap();
        assert!(why.contains("one node"), "{why}");
        assert_eq!(one.refuses(Strategy::Zero3), None);
    }

    #[test]
    fn gradients_travel_in_the_reduce_dtype() {
        let mut m = machine(8);
        m.link_latency_s = 0.0;
        let b = linear_base(1_000_000_000);
        let bf16 = price(&b, Choice::DP, &m).comm_s;
        m.reduce_bytes = 4;
        assert!((price(&b, Choice::DP, &m).comm_s / bf16 - 2.0).abs() < 1e-12);
        // ZeRO-3: two bf16 gathers and an fp32 reduce-scatter = (2 + 2 + 4) / 6 of bf16's.
        let z = |m: &Machine| price(&b, Choice::zero3(1, 1), m).comm_s;
        let fp32 = z(&m);
        m.reduce_bytes = 2;
        assert!((fp32 / z(&m) - 8.0 / 6.0).abs() < 1e-12);
    }
}
