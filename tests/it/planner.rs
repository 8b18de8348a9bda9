//! Planner properties on random small graphs: optimal against exhaustive enumeration priced by
//! `evaluate`, every plan fits, more budget never lowers throughput.

use osdp_core::cluster::read_layout;
use osdp_core::cost::{self, Choice, Machine};
use osdp_core::model::{
    Activation, AttentionImpl, Biases, DType, Family, GraphBuilder, Kernels, ModelConfig,
    ModelSpec, NormKind, NormPosition, Positional,
};
use osdp_core::plan::{evaluate, Plan, PlanOptions, Planner};
use proptest::prelude::*;

pub(crate) fn small_model(hidden: u64, seq: u64, vocab: u64, blocks: u64, tied: bool) -> ModelSpec {
    let cfg = ModelConfig {
        vocab_size: vocab,
        seq_len: seq,
        max_positions: seq,
        hidden,
        embed_dim: hidden,
        layers: blocks,
        heads: 1,
        kv_heads: 1,
        head_dim: hidden,
        ffn_hidden: 2 * hidden,
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
        norm_position: NormPosition::Pre,
        final_norm: false,
        activation: Activation::Relu,
        gated_mlp: false,
        tied_embeddings: tied,
        bias: Biases {
            qkv: false,
            attn_out: false,
            mlp: true,
            norm: false,
            lm_head: false,
        },
        positional: Positional::Learned,
        position_offset: 0,
        rope_theta: None,
        type_vocab_size: 0,
        causal: true,
        dropout: 0.0,
        attention_dropout: 0.0,
        attention: AttentionImpl::Flash,
        kernels: Kernels::Osdp,
        composed_gelu: None,
        dtype: DType::Bf16,
    };
    let mut g = GraphBuilder::new(cfg);
    let mut x = g.embedding("emb", "emb", vocab, hidden);
    for b in 0..blocks {
        g.set_block(Some(b as u32));
        let n = g.norm(&format!("b{b}.norm"), "norm", &x, true, false);
        let up = g.linear(&format!("b{b}.up"), "up", &n, 2 * hidden, true, None);
        let act = g.activation(&format!("b{b}.act"), "act", &[&up]);
        let down = g.linear(&format!("b{b}.down"), "down", &act, hidden, true, None);
        x = g.add(&format!("b{b}.add"), "add", &[&x, &down], false);
    }
    g.set_block(None);
    let logits = g.linear(
        "head",
        "head",
        &x,
        vocab,
        false,
        tied.then_some("emb.weight"),
    );
    g.cross_entropy("loss", "loss", &logits);
    g.finish("small", Family::Gpt2, None)
}

/// The machine of `layouts/{layout}.json`; `NAME+1nic`: that layout's nodes with one NIC
/// each, where hybrid sharding's node-local gathers beat rings across the slow network.
pub(crate) fn machine(layout: &str, model: &ModelSpec) -> Machine {
    let (name, one_nic) = match layout.strip_suffix("+1nic") {
        Some(name) => (name, true),
        None => (layout, false),
    };
    let mut l = read_layout(&crate::root().join(format!("layouts/{name}.json"))).unwrap();
    // Offload has its own exhaustive test (below); here it would multiply every op's choices.
    l.host = None;
    if one_nic {
        if let Some(n) = l.inter_node.as_mut().and_then(|i| i.nics_per_node.as_mut()) {
            n.value = 1.0;
        }
    }
    Machine::new(&l, model)
}

/// Layouts the exhaustive comparisons run on: one node (NVLink, PCIe, the CPU) and two nodes
/// (with every NIC, and with one), where hsdp is a choice.
pub(crate) const LAYOUTS: [&str; 5] = [
    "a100-80gb-8x-nvlink",
    "osdp-paper-8x-titan-rtx-pcie3",
    "cpu",
    "a100-80gb-2x8-ib-hdr",
    "a100-80gb-2x8-ib-hdr+1nic",
];

/// Best throughput that fits `budget` over every plan of `batches` (see [`all_plans`]).
fn exhaustive(
    model: &ModelSpec,
    m: &Machine,
    batches: &[u64],
    max_split: u32,
    budget: u64,
) -> Option<f64> {
    all_plans(model, m, batches, max_split)
        .into_iter()
        .filter(|p| p.0 <= budget)
        .map(|p| p.1)
        .reduce(f64::max)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn planner_matches_exhaustive_search(
        hidden in prop::sample::select(vec![64u64, 256, 1024]),
        seq in prop::sample::select(vec![16u64, 128, 512]),
        vocab in prop::sample::select(vec![64u64, 1000]),
        // Exhaustive search grows as options^ops: two blocks only without splitting.
        (blocks, max_split, tied) in prop::sample::select(vec![(1u64, 1u32, false), (1, 2, false), (1, 2, true), (2, 1, true)]),
        layout in prop::sample::select(LAYOUTS.to_vec()),
        batch in 1u64..=3,
        budget_frac in 0.0f64..1.0,
    ) {
        let model = small_model(hidden, seq, vocab, blocks, tied);
        let m = machine(layout, &model);
        // Budgets between the smallest and the largest peak of any plan at this batch.
        let lo = Planner::new(&model, m.clone(), PlanOptions { batch: Some(batch), max_split, ..Default::default() }, u64::MAX)
            .best(u64::MAX).unwrap();
        let hi = lo.prediction.peak_memory_bytes;
        let min_fit = match Planner::new(&model, m.clone(), PlanOptions { batch: Some(batch), max_split, ..Default::default() }, 0).best(0) {
            Err(nf) => nf.min_budget_bytes.expect("some budget fits"),
            Ok(_) => 0,
        };
        let budget = min_fit + ((hi.saturating_sub(min_fit)) as f64 * budget_frac) as u64;
        let options = PlanOptions { batch: Some(batch), max_split, ..Default::default() };
        let planner = Planner::new(&model, m.clone(), options.clone(), budget);
        let got = planner.best(budget).expect("fits: budget is at least the minimum");
        // `plan`'s search for this one budget finds the same.
        let one = Planner::best_at(&model, m.clone(), options, budget).expect("fits");
        prop_assert_eq!(&one.prediction, &got.prediction);
        prop_assert!(got.prediction.peak_memory_bytes <= budget);
        let want = exhaustive(&model, &m, &[batch], max_split, budget).expect("some plan fits");
        prop_assert!(close(got.prediction.throughput_samples_per_s, want),
            "planner {} vs exhaustive {}", got.prediction.throughput_samples_per_s, want);
        // The planner's figures are evaluate's.
        prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction.clone());
        // One byte less than the minimum fits nothing, and says so.
        if min_fit > 0 {
            let nf = planner.best(min_fit - 1).unwrap_err();
            prop_assert_eq!(nf.min_budget_bytes, Some(min_fit));
        }
    }

    #[test]
    fn more_budget_never_lowers_throughput(
        hidden in prop::sample::select(vec![256u64, 1024]),
        blocks in 1u64..=3,
        steps in prop::collection::vec(0.0f64..1.0, 2..8),
    ) {
        let model = small_model(hidden, 256, 1000, blocks, true);
        let m = machine("a100-80gb-8x-nvlink", &model);
        let planner = Planner::new(&model, m.clone(), PlanOptions::default(), 80 << 30);
        let mut budgets: Vec<u64> = steps.iter().map(|f| (f * (8u64 << 30) as f64) as u64).collect();
        budgets.sort_unstable();
        let mut last = 0.0f64;
        for b in budgets {
            if let Ok(p) = planner.best(b) {
                prop_assert!(p.prediction.peak_memory_bytes <= b);
                prop_assert!(p.prediction.throughput_samples_per_s >= last);
                last = p.prediction.throughput_samples_per_s;
            } else {
                prop_assert_eq!(last, 0.0, "a smaller budget fitted but a larger one did not");
            }
        }
    }
}

#[test]
fn auto_batch_search_matches_exhaustive_over_the_ladder() {
    let model = small_model(256, 128, 1000, 1, true);
    let m = machine("a100-80gb-8x-nvlink", &model);
    let budget = 2u64 << 30;
    let planner = Planner::new(
        &model,
        m.clone(),
        PlanOptions {
            max_split: 2,
            ..Default::default()
        },
        budget,
    );
    let got = planner.best(budget).unwrap();
    let batches = planner.batches();
    // The ladder went past the last batch that fits.
    let last = *batches.last().unwrap();
    let beyond = Planner::new(
        &model,
        m.clone(),
        PlanOptions {
            batch: Some(last * 2),
            max_split: 2,
            ..Default::default()
        },
        budget,
    );
    assert!(beyond.best(budget).is_err() || batches.len() > 8);
    let want = exhaustive(&model, &m, &batches, 2, budget).unwrap();
    assert!(close(got.prediction.throughput_samples_per_s, want));
    assert!(
        got.prediction.batch_size > 1,
        "a 2 GiB budget fits more than one sample of this model"
    );
}

/// Every plan over `batches` as (peak bytes, samples/s): all choices per op, every block plain,
/// recomputed or recomputed keeping its weights ([`ways`]).
fn all_plans(model: &ModelSpec, m: &Machine, batches: &[u64], max_split: u32) -> Vec<(u64, f64)> {
    let pairs: Vec<(u64, u64)> = batches.iter().map(|&b| (b, 1)).collect();
    all_plans_accumulated(model, m, &pairs, max_split)
}

/// [`all_plans`] over (micro-batch, accumulation) pairs.
fn all_plans_accumulated(
    model: &ModelSpec,
    m: &Machine,
    batches: &[(u64, u64)],
    max_split: u32,
) -> Vec<(u64, f64)> {
    all_plans_where(model, m, batches, max_split, &|_| true, &|_| true)
}

/// Each block's way, three to a block: plain, recomputed, recomputed keeping the weights its
/// recomputation fetches — where every op the block keeps fetches its weight whole (the
/// planner's search space; a plan mixing kept and unkept weights in one block is priced, not
/// searched).
fn ways(model: &ModelSpec, m: &Machine, plan: &Plan) -> Vec<(Vec<bool>, Vec<bool>)> {
    let blocks = osdp_core::plan::Blocks::of(model);
    let bases = cost::op_bases(model, m, 1);
    let layers = model.config.layers as usize;
    let keepable: Vec<bool> = (0..layers)
        .map(|b| {
            blocks.ops[b].iter().all(|&i| {
                !(blocks.reruns(i) && bases[i].params > 0)
                    || cost::price(&bases[i], plan.choices[i], m)
                        .kept_recompute_comm_s
                        .is_some()
            })
        })
        .collect();
    let mut out = Vec::new();
    for code in 0..3u32.pow(layers as u32) {
        let digit = |l: usize| code / 3u32.pow(l as u32) % 3;
        if (0..layers).any(|l| digit(l) == 2 && !keepable[l]) {
            continue;
        }
        out.push((
            (0..layers).map(|l| digit(l) >= 1).collect(),
            (0..layers).map(|l| digit(l) == 2).collect(),
        ));
    }
    out
}

/// [`all_plans_accumulated`] whose recompute flags pass `keep`, of the choices `allow` passes.
pub(crate) fn all_plans_where(
    model: &ModelSpec,
    m: &Machine,
    batches: &[(u64, u64)],
    max_split: u32,
    keep: &dyn Fn(&[bool]) -> bool,
    allow: &dyn Fn(Choice) -> bool,
) -> Vec<(u64, f64)> {
    let bases = cost::op_bases(model, m, 1);
    let options: Vec<Vec<Choice>> = bases
        .iter()
        .map(|b| {
            cost::choices(b, m, max_split)
                .into_iter()
                .filter(|&c| allow(c))
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for &(batch, accumulation) in batches {
        let mut idx = vec![0usize; options.len()];
        'plans: loop {
            let mut plan = Plan {
                batch,
                accumulation,
                choices: idx.iter().zip(&options).map(|(&i, o)| o[i]).collect(),
                recompute: Vec::new(),
                keep_weights: Vec::new(),
            };
            for (recompute, kept) in ways(model, m, &plan) {
                if !keep(&recompute) {
                    continue;
                }
                (plan.recompute, plan.keep_weights) = (recompute, kept);
                let p = evaluate(model, m, &plan);
                out.push((p.peak_memory_bytes, p.throughput_samples_per_s));
            }
            for k in 0..idx.len() {
                idx[k] += 1;
                if idx[k] < options[k].len() {
                    continue 'plans;
                }
                idx[k] = 0;
            }
            break;
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// One planner built for the largest budget answers every smaller one exactly, over the
    /// whole batch ladder: what larger micro-batches let it leave out of the smaller ones'
    /// frontiers never costs a plan.
    #[test]
    fn one_planner_answers_every_budget_over_the_ladder(
        hidden in prop::sample::select(vec![128u64, 512]),
        seq in prop::sample::select(vec![64u64, 256]),
        layout in prop::sample::select(vec!["a100-80gb-8x-nvlink", "osdp-paper-8x-titan-rtx-pcie3", "a100-80gb-2x8-ib-hdr+1nic"]),
        fracs in prop::collection::vec(0.0f64..1.0, 6),
    ) {
        let model = small_model(hidden, seq, 1000, 1, true);
        let m = machine(layout, &model);
        let max_budget = m.overhead_bytes + (1u64 << 30);
        let options = PlanOptions { max_split: 2, ..Default::default() };
        let planner = Planner::new(&model, m.clone(), options, max_budget);
        let plans = all_plans(&model, &m, &planner.batches(), 2);
        let least = plans.iter().map(|p| p.0).min().unwrap();
        for f in fracs {
            let budget = least + ((max_budget - least) as f64 * f * f) as u64;
            let want = plans.iter().filter(|p| p.0 <= budget).map(|p| p.1).fold(0.0, f64::max);
            let got = planner.best(budget).expect("the least plan fits");
            prop_assert!(got.prediction.peak_memory_bytes <= budget);
            prop_assert!(close(got.prediction.throughput_samples_per_s, want),
                "budget {budget}: planner {} vs exhaustive {want}", got.prediction.throughput_samples_per_s);
        }
    }
}

/// Two nodes with one NIC each: a flat ring crawls at one NIC's speed, while hsdp gathers over
/// NVLink and sends only each rank's 1/8 gradient shard across, once a step. The planner takes
/// it where it pays, exactly (against every plan, hsdp ones included), at a fixed global batch.
#[test]
fn on_two_nodes_of_one_nic_the_planner_takes_hsdp_exactly() {
    use osdp_core::cost::Strategy;
    let model = small_model(1024, 512, 1000, 1, true);
    let m = machine("a100-80gb-2x8-ib-hdr+1nic", &model);
    assert!(m.hybrid());
    let global = 8 * u64::from(m.ranks);
    let options = PlanOptions {
        global_batch: Some(global),
        max_split: 2,
        ..Default::default()
    };
    let pairs = osdp_core::plan::batch_options(&options, m.ranks).unwrap();
    let plans = all_plans_accumulated(&model, &m, &pairs, 2);
    let want = plans.iter().map(|p| p.1).fold(0.0, f64::max);
    let budget = 80u64 << 30;
    let got = Planner::new(&model, m.clone(), options, budget)
        .best(budget)
        .unwrap();
    assert!(close(got.prediction.throughput_samples_per_s, want));
    assert!(
        got.plan
            .choices
            .iter()
            .any(|c| c.strategy == Strategy::Hsdp),
        "{:?}",
        got.plan.choices
    );
    assert_eq!(evaluate(&model, &m, &got.plan), got.prediction);
    // One node offers no hsdp.
    let one = machine("a100-80gb-8x-nvlink", &model);
    let bases = cost::op_bases(&model, &one, 1);
    assert!(bases.iter().all(|b| cost::choices(b, &one, 8)
        .iter()
        .all(|c| c.strategy != Strategy::Hsdp)));
}

#[test]
fn pins_are_honoured() {
    let model = small_model(256, 128, 1000, 2, false);
    let m = machine("a100-80gb-8x-nvlink", &model);
    let up = model.ops.iter().position(|o| o.id == "b1.up").unwrap();
    let pin = Choice::zero3(2, 1);
    let options = PlanOptions {
        pins: vec![(up, pin)],
        max_split: 2,
        ..Default::default()
    };
    let p = Planner::new(&model, m, options, 80 << 30)
        .best(80 << 30)
        .unwrap();
    assert_eq!(p.plan.choices[up], pin);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// At a fixed global batch the planner picks the micro-batch, the accumulation and every
    /// op's choice exactly: the best over all of them by exhaustive enumeration, and every plan
    /// runs exactly the global batch.
    #[test]
    fn at_a_fixed_global_batch_the_planner_matches_exhaustive_search(
        hidden in prop::sample::select(vec![128u64, 512]),
        seq in prop::sample::select(vec![64u64, 256]),
        layout in prop::sample::select(LAYOUTS.to_vec()),
        per_rank in prop::sample::select(vec![1u64, 4, 6, 12]),
        frac in 0.0f64..1.0,
    ) {
        let model = small_model(hidden, seq, 1000, 1, true);
        let m = machine(layout, &model);
        let global = per_rank * u64::from(m.ranks);
        let options = PlanOptions { global_batch: Some(global), max_split: 2, ..Default::default() };
        let pairs = osdp_core::plan::batch_options(&options, m.ranks).unwrap();
        prop_assert!(pairs.iter().all(|(b, a)| b * a == per_rank));
        let plans = all_plans_accumulated(&model, &m, &pairs, 2);
        let least = plans.iter().map(|p| p.0).min().unwrap();
        let most = plans.iter().map(|p| p.0).max().unwrap();
        let budget = least + ((most - least) as f64 * frac) as u64;
        let want = plans.iter().filter(|p| p.0 <= budget).map(|p| p.1).fold(0.0, f64::max);
        let got = Planner::new(&model, m.clone(), options.clone(), budget).best(budget).expect("fits");
        let one = Planner::best_at(&model, m.clone(), options, budget).expect("fits");
        prop_assert!(close(one.prediction.throughput_samples_per_s, want),
            "budget {budget}: one-budget search {} vs exhaustive {want}", one.prediction.throughput_samples_per_s);
        prop_assert!(one.prediction.peak_memory_bytes <= budget);
        prop_assert_eq!(got.prediction.global_batch, global);
        prop_assert_eq!(got.plan.batch * got.plan.accumulation * u64::from(m.ranks), global);
        prop_assert!(got.prediction.peak_memory_bytes <= budget);
        prop_assert!(close(got.prediction.throughput_samples_per_s, want),
            "budget {budget}: planner {} vs exhaustive {want}", got.prediction.throughput_samples_per_s);
        prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction);
    }
}

#[test]
fn a_global_batch_the_ranks_cannot_share_is_refused_with_the_nearest_that_can() {
    let options = PlanOptions {
        global_batch: Some(100),
        ..Default::default()
    };
    let err = osdp_core::plan::batch_options(&options, 8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("96 and 104"), "{err}");
    let options = PlanOptions {
        global_batch: Some(96),
        batch: Some(5),
        ..Default::default()
    };
    let err = osdp_core::plan::batch_options(&options, 8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("1, 2, 3, 4, 6, 12"), "{err}");
}

/// The `cpu` layout's two ranks with a host of `host_budget` bytes per rank to offload into.
pub(crate) fn offload_machine(model: &ModelSpec, host_budget: u64) -> Machine {
    use osdp_core::cluster::{Figure, HostSpec};
    let mut l = read_layout(&crate::root().join("layouts/cpu.json")).unwrap();
    let fig = |value: f64| Figure {
        value,
        source: "test".into(),
    };
    l.host = Some(HostSpec {
        memory_gib_per_node: fig(16.0),
        link_gb_per_s: fig(4.0),
        cpu_cores_per_node: fig(2.0),
        adam_mparams_per_s_per_core: fig(50.0),
    });
    let mut m = Machine::new(&l, model);
    m.host_budget_bytes = host_budget;
    m
}

/// Every plan at `batch` (no splits): (peak, host bytes, samples/s).
fn all_offload_plans(model: &ModelSpec, m: &Machine, batch: u64) -> Vec<(u64, u64, f64)> {
    let bases = cost::op_bases(model, m, 1);
    let options: Vec<Vec<Choice>> = bases.iter().map(|b| cost::choices(b, m, 1)).collect();
    let mut out = Vec::new();
    let mut idx = vec![0usize; options.len()];
    'plans: loop {
        let mut plan = Plan {
            batch,
            accumulation: 1,
            choices: idx.iter().zip(&options).map(|(&i, o)| o[i]).collect(),
            recompute: Vec::new(),
            keep_weights: Vec::new(),
        };
        for (recompute, kept) in ways(model, m, &plan) {
            (plan.recompute, plan.keep_weights) = (recompute, kept);
            let p = evaluate(model, m, &plan);
            out.push((
                p.peak_memory_bytes,
                p.host_bytes,
                p.throughput_samples_per_s,
            ));
        }
        for k in 0..idx.len() {
            idx[k] += 1;
            if idx[k] < options[k].len() {
                continue 'plans;
            }
            idx[k] = 0;
        }
        break;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// With offload offered and a host budget that binds (searched in three dimensions: device
    /// memory, host memory, time), the planner's plan is the best of every plan within both
    /// budgets, and it says so when none is.
    #[test]
    fn offload_planner_matches_exhaustive_search_under_both_budgets(
        hidden in prop::sample::select(vec![64u64, 256]),
        seq in prop::sample::select(vec![16u64, 128]),
        batch in 1u64..=2,
        host_frac in 0.0f64..1.2,
        budget_frac in 0.0f64..1.0,
    ) {
        let model = small_model(hidden, seq, 64, 1, false);
        let open = offload_machine(&model, u64::MAX / 4);
        let plans = all_offload_plans(&model, &open, batch);
        let most_host = plans.iter().map(|p| p.1).max().unwrap();
        let host = (most_host as f64 * host_frac) as u64;
        let m = offload_machine(&model, host.max(1));
        let (lo, hi) = plans.iter().fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
        let budget = lo + ((hi - lo) as f64 * budget_frac) as u64;
        let want = plans
            .iter()
            .filter(|p| p.0 <= budget && p.1 <= host.max(1))
            .map(|p| p.2)
            .reduce(f64::max);
        let options = PlanOptions { batch: Some(batch), max_split: 1, ..Default::default() };
        let planner = Planner::new(&model, m.clone(), options.clone(), budget);
        let one = Planner::best_at(&model, m.clone(), options.clone(), budget);
        prop_assert_eq!(
            one.as_ref().map(|p| p.prediction.throughput_samples_per_s).ok(),
            want.and(planner.best(budget).ok().map(|p| p.prediction.throughput_samples_per_s)),
            "one-budget search against the whole one"
        );
        // The same plans at a fixed global batch (this micro-batch, no accumulation): the
        // one-budget search then stops its relaxation at its first plan where that plan is
        // over the host budget, and searches host memory without the rest of its caps.
        let fixed = PlanOptions { global_batch: Some(batch * u64::from(m.ranks)), ..options };
        let at_global = Planner::best_at(&model, m.clone(), fixed, budget);
        prop_assert_eq!(
            at_global.as_ref().map(|p| p.prediction.throughput_samples_per_s).ok(),
            one.as_ref().map(|p| p.prediction.throughput_samples_per_s).ok(),
            "at a fixed global batch"
        );
        match (planner.best(budget), want) {
            (Ok(got), Some(want)) => {
                prop_assert!(got.prediction.peak_memory_bytes <= budget);
                prop_assert!(got.prediction.host_bytes <= host.max(1));
                prop_assert_eq!(got.host_gap_s, None, "a small graph is searched exactly");
                prop_assert!(close(got.prediction.throughput_samples_per_s, want),
                    "planner {} vs exhaustive {}", got.prediction.throughput_samples_per_s, want);
                prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction.clone());
            }
            (Err(_), None) => {}
            (got, want) => prop_assert!(false, "planner {:?} vs exhaustive {:?}", got.map(|p| p.prediction.throughput_samples_per_s), want),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Issue 19's `R`: with some blocks' recomputation fixed, the planner is still exact over
    /// the plans that honour it, and honours it. Issue 32: a block fixed on recomputes also
    /// where the others may not (`--no-recompute`), which leaves its neighbours off.
    #[test]
    fn fixed_recomputation_is_honoured_exactly(
        hidden in prop::sample::select(vec![64u64, 256, 1024]),
        seq in prop::sample::select(vec![16u64, 128, 512]),
        layout in prop::sample::select(LAYOUTS.to_vec()),
        // Per block: searched, fixed off, fixed on.
        fixed in prop::collection::vec(0u8..3, 2),
        batch in 1u64..=3,
        budget_frac in 0.0f64..1.0,
        recompute in any::<bool>(),
    ) {
        let model = small_model(hidden, seq, 1000, 2, true);
        let m = machine(layout, &model);
        let block_recompute: Vec<(usize, bool)> = fixed
            .iter()
            .enumerate()
            .filter(|&(_, &f)| f > 0)
            .map(|(b, &f)| (b, f == 2))
            .collect();
        let honours = |r: &[bool]| {
            (0..r.len()).all(|b| match block_recompute.iter().find(|f| f.0 == b) {
                Some(&(_, on)) => r[b] == on,
                None => recompute || !r[b],
            })
        };
        let plans = all_plans_where(&model, &m, &[(batch, 1)], 1, &honours, &|_| true);
        let lo = plans.iter().map(|p| p.0).min().unwrap();
        let hi = plans.iter().map(|p| p.0).max().unwrap();
        let budget = lo + ((hi - lo) as f64 * budget_frac) as u64;
        let options = PlanOptions {
            batch: Some(batch),
            max_split: 1,
            recompute,
            block_recompute: block_recompute.clone(),
            ..Default::default()
        };
        let got = Planner::new(&model, m.clone(), options.clone(), budget)
            .best(budget)
            .expect("the least plan that honours the flags fits");
        prop_assert!(honours(&got.plan.recompute), "{:?} vs {block_recompute:?}", got.plan.recompute);
        prop_assert!(got.prediction.peak_memory_bytes <= budget);
        let want = plans.iter().filter(|p| p.0 <= budget).map(|p| p.1).fold(0.0, f64::max);
        prop_assert!(close(got.prediction.throughput_samples_per_s, want),
            "planner {} vs exhaustive {want}", got.prediction.throughput_samples_per_s);
        prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction.clone());
        // Below the least plan that honours them, nothing, and the minimum is that plan's.
        if lo > 0 {
            let nf = Planner::new(&model, m.clone(), options, lo - 1).best(lo - 1).unwrap_err();
            prop_assert_eq!(nf.min_budget_bytes, Some(lo));
        }
    }
}

/// `plan` answers one budget (`Planner::best_at`): it leaves out every micro-batch and
/// transient cap that a Lagrangian bound says cannot beat a plan already found. On the shipped
/// models and layouts, at budgets from tight to roomy and at the default global batch, its
/// plan is the one the whole frontiers give at that budget: the same throughput and peak.
#[test]
fn the_one_budget_search_finds_what_the_whole_search_finds_on_shipped_models() {
    use osdp_core::model::read_model;
    let cases = [
        ("gpt2-xl", "a100-80gb-8x-nvlink"),
        ("gpt2-xl", "h100-1x"),
        ("small-gpt2", "h100-1x"),
        ("bert-large-uncased", "rtx4090-1x"),
        ("llama-2-7b", "h100-sxm-2x8-ib-ndr"),
        ("opt-1.3b", "osdp-paper-8x-titan-rtx-pcie3"),
        ("osdp-gpt-48x1536", "rtx4090-4x-pcie"),
        // Micro-batches 32 and 64 compete: one's plan prunes the other's caps.
        ("osdp-gpt-48x2048", "osdp-paper-8x-titan-rtx-pcie3"),
    ];
    let mut compared = 0;
    for (name, layout) in cases {
        let model = read_model(&crate::root().join(format!("sample-models/{name}.json"))).unwrap();
        let l = read_layout(&crate::root().join(format!("layouts/{layout}.json"))).unwrap();
        let m = Machine::new(&l, &model);
        let options = PlanOptions {
            global_batch: Some(64 * u64::from(m.ranks)),
            resolution_bytes: 1 << 20,
            ..Default::default()
        };
        for frac in [0.35, 0.7, 0.95] {
            let budget = (l.memory_bytes() as f64 * frac) as u64;
            let whole = Planner::new(&model, m.clone(), options.clone(), budget).best(budget);
            let one = Planner::best_at(&model, m.clone(), options.clone(), budget);
            match (&whole, &one) {
                (Ok(w), Ok(o)) => {
                    assert!(
                        close(
                            w.prediction.throughput_samples_per_s,
                            o.prediction.throughput_samples_per_s
                        ),
                        "{name} on {layout} at {frac}: whole {} vs one-budget {}",
                        w.prediction.throughput_samples_per_s,
                        o.prediction.throughput_samples_per_s
                    );
                    assert_eq!(
                        w.prediction.peak_memory_bytes, o.prediction.peak_memory_bytes,
                        "{name} on {layout} at {frac}"
                    );
                    compared += 1;
                }
                (Err(w), Err(o)) => assert_eq!(w, o, "{name} on {layout} at {frac}"),
                _ => panic!(
                    "{name} on {layout} at {frac}: whole {:?} vs one-budget {:?}",
                    whole.map(|p| p.prediction.throughput_samples_per_s),
                    one.map(|p| p.prediction.throughput_samples_per_s)
                ),
            }
        }
    }
    assert!(compared >= 15, "only {compared} budgets fit");
}

/// At a fixed global batch the planner picks the micro-batch too, and what it picks is never
/// slower than any micro-batch fixed by hand. With the FSDP2 target an accumulating plan keeps
/// every module's unsharded gradient, so a larger micro-batch that accumulates nothing can fit
/// where a smaller one that accumulates does not: llama-2-7b on one RTX 4090 at a global batch
/// of 8 runs 8 × 1 faster than the 2 × 4 the search once stopped at.
#[test]
fn at_a_global_batch_no_fixed_micro_batch_beats_the_planners_choice() {
    use osdp_core::cost::Target;
    use osdp_core::model::read_model;
    let model = read_model(&crate::root().join("sample-models/llama-2-7b.json")).unwrap();
    let l = read_layout(&crate::root().join("layouts/rtx4090-1x.json")).unwrap();
    let m = Machine::new(&l, &model);
    // The default 5 % headroom, as `plan` leaves it.
    let budget = l.memory_bytes() / 100 * 95;
    let options = PlanOptions {
        global_batch: Some(8),
        target: Target::Fsdp2,
        ..Default::default()
    };
    let chosen = Planner::best_at(&model, m.clone(), options.clone(), budget).expect("fits");
    let mut fitted = 0;
    for batch in [1, 2, 4, 8] {
        let fixed = PlanOptions {
            batch: Some(batch),
            ..options.clone()
        };
        if let Ok(p) = Planner::best_at(&model, m.clone(), fixed, budget) {
            fitted += 1;
            assert!(
                chosen.prediction.throughput_samples_per_s
                    >= p.prediction.throughput_samples_per_s * (1.0 - 1e-9),
                "micro-batch {batch}: {} samples/s, the planner's {} × {}: {}",
                p.prediction.throughput_samples_per_s,
                chosen.plan.batch,
                chosen.plan.accumulation,
                chosen.prediction.throughput_samples_per_s
            );
        }
    }
    assert!(fitted >= 2, "only {fitted} micro-batches fit");
    assert_eq!(chosen.plan.batch * chosen.plan.accumulation, 8);
}
