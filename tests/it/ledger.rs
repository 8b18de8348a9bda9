//! Prediction equals execution (issue 21 §1, issue 17 item 5): for the tiny models on the CPU
//! with two ranks, under every strategy, with and without recomputation, one training step's
//! ledger holds exactly the bytes the cost model prices — op by op for state and for kept
//! activations, and per category — and never more than `plan::evaluate`'s peak. hsdp likewise on
//! four ranks arranged as two nodes of two. Offloaded state (issue 20) likewise, device and host
//! memory apart.

use osdp_core::cost::{self, Choice, Machine, OpBase, Strategy};
use osdp_core::model::{self, saved, ModelSpec, OpKind};
use osdp_core::plan::{self, Blocks, Plan, Prediction};
use osdp_train::collective::Collective;
use osdp_train::data::{Sampler, Source};
use osdp_train::exec::{Executor, ForwardMemory, Init, OptimConfig, Target};
use osdp_train::measure::on_rank_threads_in_nodes;
use osdp_train::memory::Breakdown;
use osdp_train::TrainError;

use super::root;

/// Ranks and ranks per node: two on one node, as the CPU layout has them.
const RANKS: (usize, usize) = (2, 2);
/// Four as two nodes of two, for hsdp.
const NODES: (usize, usize) = (4, 2);
/// Samples per rank per micro-batch.
const BATCH: u64 = 2;

fn tiny(name: &str) -> ModelSpec {
    model::read_model(&root().join(format!("sample-models/{name}.json"))).expect("sample loads")
}

/// The CPU layout (fp32 states and activations, as the CPU trainer runs) at `(ranks, ranks
/// per node)`: its two ranks, or nodes of it joined by its own link.
fn machine(m: &ModelSpec, (ranks, per_node): (usize, usize)) -> Machine {
    let mut layout = osdp_core::cluster::read_layout(&root().join("layouts/cpu.json")).unwrap();
    layout.gpus_per_node = per_node as u32;
    layout.nodes = (ranks / per_node) as u32;
    if layout.nodes > 1 {
        layout.inter_node = Some(layout.intra_node.clone());
    }
    // A host to offload into (issue 20): its figures price time only; bytes are what is checked.
    let fig = |value: f64| osdp_core::cluster::Figure {
        value,
        source: "test".into(),
    };
    layout.host = Some(osdp_core::cluster::HostSpec {
        memory_gib_per_node: fig(16.0),
        link_gb_per_s: fig(4.0),
        cpu_cores_per_node: fig(2.0),
        adam_mparams_per_s_per_core: fig(50.0),
    });
    let machine = Machine::new(&layout, m);
    assert_eq!(machine.ranks as usize, ranks);
    machine
}

/// `linear` on every linear owning parameters, `other` on the other ops owning parameters.
fn plan_of(m: &ModelSpec, linear: Choice, other: Choice, recompute: bool) -> Plan {
    Plan {
        batch: BATCH,
        accumulation: 1,
        choices: m
            .ops
            .iter()
            .map(|o| match o.kind {
                _ if !cost::owns_params(o) => Choice::NONE,
                OpKind::Linear => linear,
                _ => other,
            })
            .collect(),
        recompute: vec![recompute; m.config.layers as usize],
        keep_weights: Vec::new(),
    }
}

/// Every strategy, and ZeRO-3 splits with a sharded minority (bias replicated), half and all
/// of the slices sharded; then all of them at once, odd blocks recomputed.
fn plans(m: &ModelSpec) -> Vec<(String, Plan)> {
    use osdp_core::cost::Offload::{Opt, Param};
    let zero3 = Choice::zero3(1, 1);
    let (zero1, zero2) = (
        Choice::plain(Strategy::Zero1),
        Choice::plain(Strategy::Zero2),
    );
    let each = [
        (Choice::DP, Choice::DP),
        (zero1, zero1),
        (zero2, zero2),
        (zero3, zero3),
        (Choice::zero3(4, 1), zero3),
        (Choice::zero3(4, 2), zero3),
        (Choice::zero3(4, 4), zero3),
        // Offloaded (issue 20): optimizer state, and the compute copy too.
        (Choice::DP.offloaded(Opt), Choice::DP.offloaded(Param)),
        (zero1.offloaded(Opt), zero1.offloaded(Opt)),
        (zero2.offloaded(Opt), zero2.offloaded(Opt)),
        (zero3.offloaded(Opt), zero3.offloaded(Param)),
        (zero3.offloaded(Param), Choice::DP.offloaded(Opt)),
    ];
    let mut out = Vec::new();
    for recompute in [false, true] {
        for (linear, other) in each {
            let what = format!("{} (recompute: {recompute})", linear.label());
            out.push((what, plan_of(m, linear, other, recompute)));
        }
    }
    // Recomputed blocks that keep the weights their recomputation fetches whole.
    for (linear, other) in each {
        if linear.fetches_whole() || other.fetches_whole() {
            let what = format!("{} (recompute, keep)", linear.label());
            out.push((what, kept(plan_of(m, linear, other, true))));
        }
    }
    let mut mixed = plan_of(m, Choice::DP, Choice::DP, false);
    for (i, (choice, op)) in mixed.choices.iter_mut().zip(&m.ops).enumerate() {
        if *choice != Choice::NONE {
            let (linear, other) = each[i % each.len()];
            *choice = if op.kind == OpKind::Linear {
                linear
            } else {
                other
            };
        }
    }
    mixed.recompute = (0..m.config.layers).map(|b| b % 2 == 1).collect();
    out.push(("mixed".into(), mixed.clone()));
    out.push(("mixed, keep".into(), kept(mixed)));
    out
}

/// `plan` with every block keeping what its recomputation fetches (where it recomputes).
fn kept(plan: Plan) -> Plan {
    Plan {
        keep_weights: vec![true; plan.recompute.len()],
        ..plan
    }
}

/// One training step on each rank thread of `(ranks, ranks per node)`, `watch` switching on
/// what to record first and `read` taking what the step left: each rank's reading.
fn step_on_ranks<R: Send>(
    m: &ModelSpec,
    plan: &Plan,
    (ranks, per_node): (usize, usize),
    watch: fn(&mut Executor),
    read: fn(&Executor) -> R,
) -> Vec<R> {
    let sampler = Sampler {
        source: Source::Random,
        seed: 0,
        seq: m.config.seq_len as usize,
        vocab: m.config.vocab_size,
    };
    let rows = plan.batch as usize;
    on_rank_threads_in_nodes(ranks, per_node, |group| {
        let rank = group.rank();
        let failed = |e: osdp_train::exec::ExecError| TrainError::Invalid(e.to_string());
        let mut exec = Executor::new(
            m,
            plan,
            Box::new(group),
            Target::CPU,
            Init::Fresh { seed: 0 },
            OptimConfig::default(),
        )
        .map_err(failed)?;
        watch(&mut exec);
        exec.train_step(&sampler.batch(0, rank * rows, rows))
            .map_err(failed)?;
        Ok(read(&exec))
    })
    .expect("the step runs")
}

/// One training step on each rank thread of `(ranks, ranks per node)`: what each held when
/// its forward pass ended, and its ledger's peak over the step.
fn one_step(m: &ModelSpec, plan: &Plan, ranks: (usize, usize)) -> Vec<(ForwardMemory, Breakdown)> {
    step_on_ranks(m, plan, ranks, Executor::enable_memory_trace, |exec| {
        let traced = exec.forward_memory.clone().unwrap_or_default();
        (traced, exec.ledger.peak())
    })
}

/// Bytes per sample the trainer keeps that the model's saved figures leave out, as
/// Korthikanti et al. do: a norm's per-row statistics in fp32 — LayerNorm's mean and reciprocal
/// standard deviation, RMSNorm's reciprocal root mean square.
fn norm_statistics_bytes(m: &ModelSpec, kind: OpKind) -> u64 {
    let per_row = match kind {
        OpKind::LayerNorm => 2,
        OpKind::RmsNorm => 1,
        _ => 0,
    };
    per_row * saved::FP32_BYTES * m.config.seq_len
}

/// Bytes per sample the model's saved figures count that the trainer's ledger does not: a
/// token embedding's ids, which the trainer holds for the whole step as its input data rather
/// than as the op's (and the labels beside them, which the figures leave out).
fn uncounted_ids_bytes(m: &ModelSpec, op: &model::OpSpec) -> u64 {
    match op.kind {
        OpKind::Embedding => saved::token_ids_bytes(&m.config),
        _ => 0,
    }
}

/// What the cost model says of one op, and what one rank held for it.
struct OpCheck<'a> {
    model: &'a ModelSpec,
    plan: &'a Plan,
    what: &'a str,
}

impl OpCheck<'_> {
    /// Each op's state, priced by `cost::price`, is what the rank holds for the op's units.
    fn state(&self, bases: &[OpBase], m: &Machine, held: &ForwardMemory) {
        for (i, op) in self.model.ops.iter().enumerate() {
            let cost = cost::price(&bases[i], self.plan.choices[i], m);
            assert_eq!(
                held.state_bytes[i],
                cost.persistent_bytes,
                "{}: {} under {}: state held vs priced",
                self.what,
                op.id,
                self.plan.choices[i].label()
            );
            assert_eq!(
                held.host_state_bytes[i],
                cost.host_bytes,
                "{}: {} under {}: host memory held vs priced",
                self.what,
                op.id,
                self.plan.choices[i].label()
            );
        }
    }

    /// Each op's kept activations (`OpBase::saved_bytes`; none in a recomputed block) are what
    /// the rank keeps for it: the graph's outputs counted at their first reader in backward
    /// (as the model's figures count them) and its kernels' own tensors, less the known
    /// differences. Returns the kept restart points of recomputed blocks.
    fn kept(&self, bases: &[OpBase], blocks: &Blocks, held: &ForwardMemory) -> u64 {
        let ops = &self.model.ops;
        let index = self.model.op_index();
        let recomputed = |i: usize| {
            blocks.of_op[i].is_some_and(|b| self.plan.recompute.get(b).copied().unwrap_or(false))
        };
        let mut first_reader: Vec<Option<usize>> = vec![None; ops.len()];
        for (i, op) in ops.iter().enumerate() {
            let reads = saved::backward_reads(op.kind, op.inputs.len(), &self.model.config);
            let outputs = op.inputs[..reads.inputs]
                .iter()
                .map(|id| index[id.as_str()])
                .chain(reads.output.then_some(i));
            for j in outputs {
                first_reader[j].get_or_insert(i);
            }
        }
        let mut held_for = held.kept_extra_bytes.clone();
        let mut restarts = 0;
        for (j, &bytes) in held.kept_output_bytes.iter().enumerate() {
            match first_reader[j] {
                Some(r) if !recomputed(r) => held_for[r] += bytes,
                _ => restarts += bytes,
            }
        }
        for (i, op) in ops.iter().enumerate() {
            let priced = if recomputed(i) {
                0
            } else {
                bases[i].saved_bytes
            };
            let (extra, uncounted) = if recomputed(i) {
                (0, 0)
            } else {
                (
                    norm_statistics_bytes(self.model, op.kind) * BATCH,
                    uncounted_ids_bytes(self.model, op) * BATCH,
                )
            };
            assert_eq!(
                held_for[i] + uncounted,
                priced + extra,
                "{}: {}: kept for backward vs priced (+ {extra} norm statistics, - {uncounted} ids)",
                self.what,
                op.id
            );
        }
        restarts
    }
}

/// The whole-plan figures: state, kept activations and the peak.
fn check_totals(
    c: &OpCheck,
    m: &Machine,
    predicted: &Prediction,
    held: &ForwardMemory,
    restarts: u64,
    peak: &Breakdown,
) {
    let what = c.what;
    let l = &held.ledger;
    let state = l.params + l.grads + l.optimizer;
    assert_eq!(state, predicted.persistent_bytes, "{what}: state");
    assert_eq!(state, held.state_bytes.iter().sum::<u64>(), "{what}");
    assert_eq!(l.host, predicted.host_bytes, "{what}: host memory");
    // Restart points of recomputed blocks: their inputs from outside the block.
    let blocks = Blocks::of(c.model);
    let restart_priced: u64 = c
        .plan
        .recompute
        .iter()
        .enumerate()
        .filter(|(_, &on)| on)
        .map(|(b, _)| m.activation_bytes(blocks.input_bytes_per_sample[b]) * BATCH)
        .sum();
    assert_eq!(
        restarts, restart_priced,
        "{what}: recomputed blocks' inputs"
    );
    // Kept activations: the ledger's category, and evaluate's figure less the known
    // differences of the ops that keep theirs.
    let kept: u64 =
        held.kept_output_bytes.iter().sum::<u64>() + held.kept_extra_bytes.iter().sum::<u64>();
    assert_eq!(l.activations, kept, "{what}: ledger vs kept tensors");
    let (mut extra, mut uncounted) = (0, 0);
    for (i, op) in c.model.ops.iter().enumerate() {
        let recomputed = blocks.of_op[i].is_some_and(|b| c.plan.recompute[b]);
        if !recomputed {
            extra += norm_statistics_bytes(c.model, op.kind) * BATCH;
            uncounted += uncounted_ids_bytes(c.model, op) * BATCH;
        }
    }
    assert_eq!(
        l.activations + uncounted,
        predicted.activation_bytes + extra,
        "{what}: kept activations"
    );
    // Nothing else is in flight when a forward pass ends.
    assert_eq!(
        (l.gathered, l.grad_buffers, l.working),
        (0, 0, 0),
        "{what}: transient bytes after forward"
    );
    // The peak holds the same state exactly. Its activations and transients are bounded,
    // not equal: `evaluate` adds the largest transient of any op to every kept activation,
    // while the ledger's peak is one moment of the schedule (on these models the start of
    // backward, or the last recomputed block's rematerialisation), when some of that
    // transient is not held.
    assert_eq!(
        peak.params + peak.grads + peak.optimizer,
        predicted.persistent_bytes,
        "{what}: state at the peak"
    );
    let priced = predicted.peak_memory_bytes - predicted.overhead_bytes + extra;
    assert!(
        state + l.activations <= peak.total() && peak.total() <= priced,
        "{what}: peak {} outside [{}, {priced}]: {peak:?}",
        peak.total(),
        state + l.activations
    );
}

fn check_model(name: &str) {
    let m = tiny(name);
    check_plans(&m, name, RANKS, plans(&m));
}

fn check_plans(m: &ModelSpec, name: &str, ranks: (usize, usize), plans: Vec<(String, Plan)>) {
    let machine = machine(m, ranks);
    for (what, plan) in plans {
        let what = format!("{name} {what}");
        let bases = cost::op_bases(m, &machine, plan.batch);
        let blocks = Blocks::of(m);
        let predicted = plan::evaluate(m, &machine, &plan);
        let check = OpCheck {
            model: m,
            plan: &plan,
            what: &what,
        };
        for (rank, (held, peak)) in one_step(m, &plan, ranks).iter().enumerate() {
            let what = format!("{what} rank {rank}");
            let check = OpCheck {
                what: &what,
                ..check
            };
            check.state(&bases, &machine, held);
            let restarts = check.kept(&bases, &blocks, held);
            check_totals(&check, &machine, &predicted, held, restarts, peak);
        }
    }
}

#[test]
fn the_ledger_holds_exactly_what_the_cost_model_prices_gpt2() {
    check_model("tiny-gpt2");
}

#[test]
fn the_ledger_holds_exactly_what_the_cost_model_prices_llama() {
    check_model("tiny-llama");
}

/// hsdp on 2 nodes × 2 ranks: a node's share of every unit, priced over the node's ranks.
#[test]
fn the_ledger_holds_exactly_what_the_cost_model_prices_for_hsdp() {
    let hsdp = Choice::plain(Strategy::Hsdp);
    for name in ["tiny-gpt2", "tiny-llama"] {
        let m = tiny(name);
        let mut plans: Vec<(String, Plan)> = [false, true]
            .into_iter()
            .map(|r| (format!("hsdp (recompute: {r})"), plan_of(&m, hsdp, hsdp, r)))
            .collect();
        let mixed = plan_of(&m, hsdp, Choice::zero3(1, 1), true);
        plans.push(("hsdp linears, zero3 others".into(), mixed.clone()));
        plans.push(("hsdp linears, zero3 others, keep".into(), kept(mixed)));
        check_plans(&m, name, NODES, plans);
    }
}

/// A description that prices eager attention (seq² probabilities) is refused: the trainer's
/// attention is fused and would keep something else than the planner counted.
#[test]
fn the_trainer_refuses_eager_attention_which_it_would_not_keep_as_priced() {
    let mut m = tiny("tiny-gpt2");
    m.config.attention = model::AttentionImpl::Eager;
    let plan = plan_of(&m, Choice::DP, Choice::DP, false);
    let err = osdp_train::exec::check_runnable(&m, &plan).unwrap_err();
    assert!(err.to_string().contains("--attention flash"), "{err}");
}

/// A description priced for PyTorch's eager modules (`import-hf --kernels pytorch`) is refused
/// likewise: the trainer's kernels keep less than it counts.
#[test]
fn the_trainer_refuses_a_model_priced_for_pytorchs_kernels() {
    let mut m = tiny("tiny-gpt2");
    m.config.kernels = model::Kernels::Pytorch;
    let plan = plan_of(&m, Choice::DP, Choice::DP, false);
    let err = osdp_train::exec::check_runnable(&m, &plan).unwrap_err();
    assert!(err.to_string().contains("--kernels pytorch"), "{err}");
}

/// Every collective one rank makes in one step of `plan` (bytes of the full tensor), in order.
fn collectives_of_one_step(m: &ModelSpec, plan: &Plan) -> Vec<f64> {
    let per_rank = step_on_ranks(m, plan, RANKS, Executor::enable_profiling, |exec| {
        let profile = exec.profile.clone().unwrap_or_default();
        profile
            .collectives
            .iter()
            .map(|c| c.0)
            .collect::<Vec<f64>>()
    });
    per_rank.into_iter().next().expect("a rank")
}

/// The CPU layout with collectives that cost their bytes only: their times read back as bytes.
fn without_latency(m: &ModelSpec) -> Machine {
    Machine {
        link_latency_s: 0.0,
        cross_node_latency_s: 0.0,
        collective_base_s: 0.0,
        ..machine(m, RANKS)
    }
}

/// A recomputed block's sharded weights are gathered again, as the trainer runs it, and the
/// cost model prices exactly that: the bytes one step gathers more with every block recomputed
/// are the bytes the cost model prices a recomputation's gathers for (`OpCost::recompute_comm_s`
/// of the blocks' ops, read back as bytes on a link without latency): each op's parameters, but
/// of the block's last op with parameters only its bias, as its backward takes the weight its
/// recomputation gathered.
#[test]
fn a_recomputation_gathers_again_what_the_cost_model_prices_it_to() {
    for name in ["tiny-gpt2", "tiny-llama"] {
        let m = tiny(name);
        let machine = without_latency(&m);
        assert!(machine.regather_on_recompute);
        let zero3 = Choice::zero3(1, 1);
        let plain = plan_of(&m, zero3, zero3, false);
        let recomputed = plan_of(&m, zero3, zero3, true);
        let bases = cost::op_bases(&m, &machine, BATCH);
        // A ring all-gather moves (n - 1) / n of its bytes over each rank's link.
        let n = RANKS.0 as f64;
        let per_byte = (n - 1.0) / n / machine.link_bytes_per_s;
        let priced: f64 = m
            .ops
            .iter()
            .zip(&bases)
            .zip(&recomputed.choices)
            // A recomputation is priced per block: its ops' refetches.
            .filter(|((op, _), _)| op.block.is_some())
            .map(|((_, base), &c)| cost::price(base, c, &machine).recompute_comm_s / per_byte)
            .sum();
        let (before, after) = (
            collectives_of_one_step(&m, &plain),
            collectives_of_one_step(&m, &recomputed),
        );
        let more = after.iter().sum::<f64>() - before.iter().sum::<f64>();
        assert!(more > 0.0, "{name}: a recomputation gathered nothing");
        assert!(
            (more - priced).abs() < 1e-6 * more,
            "{name}: {more} bytes gathered again, {priced} priced"
        );
        // The last op with parameters of each block keeps its gathered weight: what a block
        // gathers again is less than all its parameters.
        let block_bytes: f64 = m
            .ops
            .iter()
            .filter(|op| op.block.is_some())
            .flat_map(|op| &op.params)
            .map(|p| 4.0 * p.shape.iter().map(|&d| d as f64).product::<f64>())
            .sum();
        assert!(more < block_bytes, "{name}: {more} of {block_bytes}");
        // Without the trainer's refetch priced, the planner would count none of them.
        let fsdp = Machine {
            regather_on_recompute: false,
            ..machine.clone()
        };
        let none = bases
            .iter()
            .zip(&recomputed.choices)
            .all(|(base, &c)| cost::price(base, c, &fsdp).recompute_comm_s == 0.0);
        assert!(none, "{name}");
    }
}

/// A recomputed block that keeps what its recomputation fetched gathers again only the biases
/// of the ops it keeps (their backward reads no bias), as the cost model prices it
/// (`OpCost::kept_recompute_comm_s`); and it holds those weights through the block's backward,
/// which its peak shows and the cost model prices (`plan::kept_weight_bytes`).
#[test]
fn a_block_that_keeps_gathers_again_only_its_biases() {
    for name in ["tiny-gpt2", "tiny-llama"] {
        let m = tiny(name);
        let machine = without_latency(&m);
        let zero3 = Choice::zero3(1, 1);
        let plain = plan_of(&m, zero3, zero3, false);
        let recomputed = plan_of(&m, zero3, zero3, true);
        let keeping = kept(recomputed.clone());
        let bases = cost::op_bases(&m, &machine, BATCH);
        let n = RANKS.0 as f64;
        let per_byte = (n - 1.0) / n / machine.link_bytes_per_s;
        let keeps = plan::kept_ops(&m, &keeping);
        assert!(keeps.iter().filter(|&&k| k).count() > m.config.layers as usize);
        let priced: f64 = m
            .ops
            .iter()
            .enumerate()
            .filter(|(_, op)| op.block.is_some())
            .map(|(i, _)| {
                let c = cost::price(&bases[i], keeping.choices[i], &machine);
                let fetched = if keeps[i] {
                    c.kept_recompute_comm_s.expect("a kept op fetches whole")
                } else {
                    c.recompute_comm_s
                };
                fetched / per_byte
            })
            .sum();
        let before = collectives_of_one_step(&m, &plain).iter().sum::<f64>();
        let again = collectives_of_one_step(&m, &recomputed).iter().sum::<f64>() - before;
        let kept_again = collectives_of_one_step(&m, &keeping).iter().sum::<f64>() - before;
        assert!(
            (kept_again - priced).abs() <= 1e-6 * again,
            "{name}: {kept_again} bytes gathered again, {priced} priced"
        );
        // Only biases: a small part of what the block gathers again otherwise.
        assert!(kept_again < 0.1 * again, "{name}: {kept_again} of {again}");
        // Held through the backward: the keeping plan's peak is above the other's, and its
        // prediction says so by the weights kept.
        let peak = |plan: &Plan| one_step(&m, plan, RANKS)[0].1.total();
        let (p_again, p_kept) = (peak(&recomputed), peak(&keeping));
        let (e_again, e_kept) = (
            plan::evaluate(&m, &machine, &recomputed),
            plan::evaluate(&m, &machine, &keeping),
        );
        assert!(p_kept > p_again, "{name}: {p_kept} vs {p_again}");
        assert!(
            e_kept.peak_memory_bytes >= e_again.peak_memory_bytes + (p_kept - p_again),
            "{name}: predicted {} → {}, held {p_again} → {p_kept}",
            e_again.peak_memory_bytes,
            e_kept.peak_memory_bytes
        );
        assert!(e_kept.step_time_s < e_again.step_time_s, "{name}");
    }
}
