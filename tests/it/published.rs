//! The cost model against training runs other people measured (docs/published-runs.json, each
//! with its link): a change to the prices that breaks a published run fails here.

use std::collections::BTreeMap;

// The pricing of published runs lives with the example that prints their table.
#[path = "../../examples/published-runs/runs.rs"]
mod runs;

use runs::{
    geometric_mean, price_run, price_run_tuned, read_runs, Priced, PublishedRun, Role, DEFAULT_BAND,
};

use crate::root;
use osdp_core::cost::EagerRotary;

fn runs() -> Vec<PublishedRun> {
    read_runs(&root().join("docs/published-runs.json"))
        .expect("the data file reads")
        .runs
}

fn priced() -> Vec<(PublishedRun, Priced)> {
    let layouts = root().join("layouts");
    runs()
        .into_iter()
        .filter(|r| r.role != Role::Excluded)
        .map(|r| {
            let p = price_run(&r, &layouts, &|_| {})
                .unwrap_or_else(|e| panic!("{}: cannot be priced: {e}", r.id));
            (r, p)
        })
        .collect()
}

#[test]
fn the_data_file_links_every_run_and_says_why_one_is_left_out() {
    let all = runs();
    let priced = all.iter().filter(|r| r.role != Role::Excluded).count();
    assert!(priced >= 15, "only {priced} runs are priced");
    assert!(all.iter().filter(|r| r.role == Role::Fit).count() >= 10);
    for r in &all {
        assert!(
            r.source.url.starts_with("https://"),
            "{}: no link to its source",
            r.id
        );
        if r.role == Role::Excluded {
            assert!(
                r.excluded_because.as_deref().is_some_and(|w| !w.is_empty()),
                "{}: excluded without a reason",
                r.id
            );
        }
    }
}

#[test]
fn every_published_run_stays_in_its_band() {
    let mut out = Vec::new();
    for (r, p) in priced() {
        let [lo, hi] = r.band.unwrap_or(DEFAULT_BAND);
        if !(lo..=hi).contains(&p.ratio) {
            out.push(format!(
                "{}: predicted {:.0} tokens/s per GPU, published {:.0} (ratio {:.2}, band {lo}–{hi})",
                r.id, p.predicted_tokens_per_s_per_gpu, p.published_tokens_per_s_per_gpu, p.ratio
            ));
        }
    }
    assert!(out.is_empty(), "{}", out.join("\n"));
}

#[test]
fn every_group_is_right_on_average_and_most_runs_within_15_percent() {
    // The sources the constants were fitted near (issue 17's); the new ones are checked below.
    let all: Vec<_> = priced()
        .into_iter()
        .filter(|(r, _)| !r.new_source())
        .collect();
    let mut groups: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (_, p) in &all {
        groups.entry(p.group.clone()).or_default().push(p.ratio);
    }
    assert!(groups.len() >= 4, "groups: {:?}", groups.keys());
    // Every group within ±10 % on average (the target).
    for (group, ratios) in &groups {
        let g = geometric_mean(ratios.iter().copied());
        assert!(
            (0.9..=1.1).contains(&g),
            "{group}: predicted/published geometric mean {g:.3} over {} runs",
            ratios.len()
        );
    }
    let within = all
        .iter()
        .filter(|(_, p)| p.ratio.ln().abs() <= 1.15f64.ln())
        .count();
    assert!(
        within * 100 >= all.len() * 85,
        "{within} of {} runs within ±15 %",
        all.len()
    );
    // The held-out runs alone (never used to fit a constant) meet the same bar.
    let held: Vec<f64> = all
        .iter()
        .filter(|(r, _)| r.role == Role::HeldOut)
        .map(|(_, p)| p.ratio)
        .collect();
    let g = geometric_mean(held.iter().copied());
    assert!((0.9..=1.1).contains(&g), "held out: {g:.3}");
}

/// From run `from` to run `to`: (published, predicted) tokens/s per GPU of `to` over `from`'s.
fn change(all: &[(PublishedRun, Priced)], from: &str, to: &str) -> (f64, f64) {
    let by_id = |id: &str| {
        all.iter()
            .find(|(r, _)| r.id == id)
            .map(|(_, p)| p)
            .unwrap_or_else(|| panic!("{id} is in the data file"))
    };
    let (a, b) = (by_id(from), by_id(to));
    (
        b.published_tokens_per_s_per_gpu / a.published_tokens_per_s_per_gpu,
        b.predicted_tokens_per_s_per_gpu / a.predicted_tokens_per_s_per_gpu,
    )
}

#[test]
fn tokens_per_gpu_stay_flat_from_one_node_to_many_where_published_runs_do() {
    let all = priced();
    // llm-foundry's H100 tables: the same model on one node and on 8 to 64 nodes.
    for (one, many) in [
        (
            "foundry-h100-mpt-7b-s2048-g8-noac",
            "foundry-h100-mpt-7b-s2048-g512-noac",
        ),
        (
            "foundry-h100-mpt-1b-s2048-g8-noac",
            "foundry-h100-mpt-1b-s2048-g64-noac",
        ),
        (
            "foundry-h100-mpt-7b-s2048-g8-noac",
            "foundry-h100-mpt-7b-s2048-g128-noac",
        ),
        (
            "foundry-h100-mpt-13b-s2048-g8-noac",
            "foundry-h100-mpt-13b-s2048-g64-noac",
        ),
    ] {
        let (published, predicted) = change(&all, one, many);
        assert!(
            (0.85..=1.15).contains(&published),
            "{one} → {many}: published runs are not flat ({published:.2})"
        );
        assert!(
            (0.85..=1.15).contains(&predicted),
            "{one} → {many}: predicted tokens/s per GPU changes by {predicted:.2}× (published {published:.2}×)"
        );
    }
}

/// A stack whose code was read for its per-parameter passes (NVIDIA's BERT under apex AMP O2:
/// 10 bytes a parameter a micro-batch, not the 37.6 fitted on FSDP runs) is priced with them:
/// NVIDIA's 2020 BERT-large tables, at 256–1,024 micro-batches a step, land within 10 % of the
/// published rows, where the fitted passes made them 9–17 % pessimistic.
#[test]
fn a_stacks_own_parameter_passes_are_priced_where_its_code_was_read() {
    let layouts = root().join("layouts");
    let all = runs();
    let bert: Vec<&PublishedRun> = all
        .iter()
        .filter(|r| r.id.starts_with("dle-v100-bert-large") && r.timing == runs::Timing::Step)
        .collect();
    assert_eq!(bert.len(), 6, "NVIDIA's 2020 single-node BERT rows");
    for r in bert {
        let own = price_run(r, &layouts, &|_| {}).unwrap();
        let fitted = price_run_tuned(r, &layouts, &|_| {}, &|m| {
            m.param_pass_bytes = osdp_core::cost::PARAM_PASS_BYTES
        })
        .unwrap();
        assert_eq!(
            r.stack.as_ref().and_then(|s| s.param_pass_bytes),
            Some(10.0),
            "{}",
            r.id
        );
        assert!(
            (0.9..=1.1).contains(&own.ratio),
            "{}: {:.2}",
            r.id,
            own.ratio
        );
        assert!(
            fitted.ratio < 0.93 * own.ratio,
            "{}: the fitted passes price it {:.2}, its own {:.2}",
            r.id,
            fitted.ratio,
            own.ratio
        );
    }
}

/// Megatron-LM's GPT-2 code computes its loss as PyTorch ops over an fp32 copy of the logits
/// (`stack.loss_bytes_per_logit`, read in each stack's code): DeepSpeed 0.3.0's one-node rows
/// on DLPerf's V100s, a 124M-parameter model with 206M logits a micro-batch, come within 15 %
/// where the fused kernel's price made them 20–25 % optimistic (each more than 8 % higher); the
/// same cluster's larger Megatron-LM runs, where the loss is a smaller share, move by under 4 %
/// (2–3 %) and stay within 20 %.
#[test]
fn a_loss_written_as_pytorch_ops_is_priced_as_its_code_runs_it() {
    let layouts = root().join("layouts");
    let all = runs();
    let stack_passes = |r: &PublishedRun| r.stack.as_ref().and_then(|s| s.loss_bytes_per_logit);
    let one_node: Vec<&PublishedRun> = all
        .iter()
        .filter(|r| r.id.starts_with("dlperf-deepspeed") && r.nodes == Some(1))
        .collect();
    assert_eq!(one_node.len(), 2);
    let fused = |r: &PublishedRun| {
        price_run_tuned(r, &layouts, &|_| {}, &|m| m.loss_bytes_per_logit = None).unwrap()
    };
    for r in one_node {
        assert_eq!(stack_passes(r), Some([46.0, 14.0]), "{}", r.id);
        let ops = price_run(r, &layouts, &|_| {}).unwrap();
        assert!(
            (1.0 / 1.15..=1.15).contains(&ops.ratio),
            "{}: {:.3}",
            r.id,
            ops.ratio
        );
        assert!(fused(r).ratio > 1.08 * ops.ratio, "{}", r.id);
    }
    for r in all.iter().filter(|r| r.id.starts_with("dlperf-megatron")) {
        assert_eq!(stack_passes(r), Some([38.0, 14.0]), "{}", r.id);
        let ops = price_run(r, &layouts, &|_| {}).unwrap();
        assert!(
            (1.0 / 1.2..=1.2).contains(&ops.ratio),
            "{}: {:.3}",
            r.id,
            ops.ratio
        );
        assert!((fused(r).ratio / ops.ratio - 1.0).abs() < 0.04, "{}", r.id);
    }
}

/// InternLM's 2023 stack runs flash-attn 1.0.5: priced with FlashAttention 1's extra
/// (`stack.flash_attention_1`, from the FlashAttention-2 paper's Table 1), its rows where the
/// all-reduce hides land within 12 % of the published ones at every scale from 1 node to 64,
/// where FlashAttention-2's figures priced each more than 4 % higher (5.2–5.7 %).
#[test]
fn a_stack_on_flash_attention_1_is_priced_with_its_slower_kernels() {
    let layouts = root().join("layouts");
    let all = runs();
    let hidden: Vec<&PublishedRun> = all
        .iter()
        .filter(|r| {
            // The FLOPS tables' rows (zero1=8); the zero1=-1 rows pay their broadcasts.
            r.id.starts_with("internlm-a100")
                && r.id.contains("-zero1in8-")
                && r.nodes.is_some_and(|n| n <= 64)
                && r.grad_accum.unwrap_or(1) * r.micro_batch >= 8
        })
        .collect();
    assert_eq!(
        hidden.len(),
        14,
        "InternLM's rows with 8 sequences a step, 1 to 64 nodes"
    );
    for r in hidden {
        assert!(
            r.stack.as_ref().is_some_and(|s| s.flash_attention_1),
            "{}",
            r.id
        );
        let v1 = price_run(r, &layouts, &|_| {}).unwrap();
        let v2 = price_run_tuned(r, &layouts, &|_| {}, &|m| m.flash_attention_1 = false).unwrap();
        assert!(
            (0.95..=1.12).contains(&v1.ratio),
            "{}: {:.3}",
            r.id,
            v1.ratio
        );
        assert!(
            v2.ratio > 1.04 * v1.ratio,
            "{}: FlashAttention-2's figures price it {:.3}, FlashAttention 1's {:.3}",
            r.id,
            v2.ratio,
            v1.ratio
        );
    }
}

/// InternLM's 7B tables (A100s, 4 × 100 Gb RoCE a node, gradients all-reduced over every
/// rank): with four micro-batches a step the all-reduce hides behind the last backward, and
/// tokens/s per GPU stay flat from one node to 64 (published 0.95×, predicted within 5 % of
/// that); at 1,024 GPUs, with one micro-batch instead of four, the all-reduce is exposed and
/// both fall, the prediction less than the published run (docs/published-runs.md).
#[test]
fn tokens_per_gpu_stay_flat_while_the_all_reduce_hides_and_fall_when_it_cannot() {
    let all = priced();
    let id = |s: &str| format!("internlm-a100-internlm-7b-s2048-{s}");
    let (published, predicted) = change(
        &all,
        &id("g8-zero1in8-noac-mb2x4"),
        &id("g512-zero1in8-noac-mb2x4"),
    );
    assert!((0.9..=1.0).contains(&published), "published {published:.2}");
    assert!(
        (predicted / published - 1.0).abs() < 0.05,
        "8 → 512 GPUs: predicted {predicted:.2}×, published {published:.2}×"
    );
    let (published, predicted) = change(
        &all,
        &id("g1024-zero1in8-noac-mb2x4"),
        &id("g1024-zero1in8-noac-mb2x1"),
    );
    assert!(published < 0.7, "published {published:.2}");
    assert!(
        (published..0.85).contains(&predicted),
        "four micro-batches → one at 1,024 GPUs: predicted {predicted:.2}×, published {published:.2}×"
    );
}

/// DeepSpeed ZeRO-3 of 2021 at 384 to 2,240 A100s (arXiv:2104.04473 Table 2): as the GPUs
/// double and the micro-batch halves, published tokens/s per GPU fall to 0.49–0.71×, because
/// the step stops shrinking: its parameter gathers, tensor by tensor with the device
/// synchronised, and its gradients' reduce-scatters, tensor by tensor between two
/// synchronisations, cost the same or more over more ranks. The predicted fall follows within
/// 15 % (with the gathers overlapped it was 1.2–1.5× too shallow; with the reduce-scatters
/// hidden behind the backward, up to 25 % too shallow: docs/collectives.md).
#[test]
fn tokens_per_gpu_fall_with_scale_where_deepspeed_2021_runs_do() {
    let all = priced();
    let id = |s: &str| format!("megatron-zero3-a100-gpt-{s}");
    for (fewer, more) in [
        ("175b-s2048-g384-mb4", "175b-s2048-g768-mb2"),
        ("175b-s2048-g768-mb2", "175b-s2048-g1536-mb1"),
        ("530b-s2048-g640-mb4", "530b-s2048-g1120-mb2"),
        ("530b-s2048-g1120-mb2", "530b-s2048-g2240-mb1"),
    ] {
        let (published, predicted) = change(&all, &id(fewer), &id(more));
        assert!(
            published < 0.75,
            "{fewer} → {more}: published runs do not fall ({published:.2})"
        );
        assert!(
            (0.85..=1.15).contains(&(predicted / published)),
            "{fewer} → {more}: predicted tokens/s per GPU change by {predicted:.2}×, published by {published:.2}×"
        );
    }
}

/// On V100s, where the stack decides the price: vanilla Hugging Face under DDP (AMP's fp32
/// softmax and GELU passes, the Trainer's unfused AdamW) makes 0.71× the tokens/s of the same
/// micro-batch under DeepSpeed ZeRO-1 (an fp16 model, fused Adam), and Megatron-LM's data
/// parallelism loses ~28 % per GPU when its all-reduce, after the backward, first crosses the
/// network (8 → 16 GPUs, one 100 Gb/s NIC per node). The predicted ratios follow within 10 %.
#[test]
fn v100_stacks_and_the_network_cost_what_published_runs_say() {
    let all = priced();
    for (from, to) in [
        (
            "dsexamples-v100-hf-gpt2-s1024-g16-zero1-mb8",
            "dsexamples-v100-hf-gpt2-s1024-g16-ddp-mb8",
        ),
        (
            "dlperf-megatron-v100-gpt-1536x16-s2048-g8-dp-mb2",
            "dlperf-megatron-v100-gpt-1536x16-s2048-g16-dp-mb2",
        ),
    ] {
        let (published, predicted) = change(&all, from, to);
        assert!(published < 0.8, "{from} → {to}: published {published:.2}");
        assert!(
            (0.9..=1.1).contains(&(predicted / published)),
            "{from} → {to}: predicted tokens/s per GPU change by {predicted:.2}×, published by {published:.2}×"
        );
    }
}

/// One source, two measures: DeepSpeedExamples' Hugging Face GPT-2 on 16 V100s gives DeepSpeed's
/// own timers of a steady step (forward, backward and optimizer step: the `-dstimers` rows) and
/// the Trainer's end-to-end rate over a 200-step run counted from its start. The cost model
/// prices a steady step, so the timers are what it must meet: each within ±20 % and the lot
/// within ±5 % on average, over ZeRO stages 0–2 and four model sizes. For the one configuration
/// recorded both ways (gpt2-xl, ZeRO-1, micro-batch 1) the end-to-end rate is 0.68× the timers';
/// the prediction is one number, so that row sits above 1 by as much.
#[test]
fn a_steady_step_is_what_the_cost_model_prices() {
    let all = priced();
    let timers: Vec<f64> = all
        .iter()
        .filter(|(r, _)| r.id.ends_with("-dstimers"))
        .map(|(r, p)| {
            assert!(
                (0.8..=1.2).contains(&p.ratio),
                "{}: predicted {:.0} tokens/s per GPU, DeepSpeed's timers {:.0} ({:.2})",
                r.id,
                p.predicted_tokens_per_s_per_gpu,
                p.published_tokens_per_s_per_gpu,
                p.ratio
            );
            p.ratio
        })
        .collect();
    assert!(timers.len() >= 10, "{} timed runs", timers.len());
    let g = geometric_mean(timers.iter().copied());
    assert!(
        (0.95..=1.05).contains(&g),
        "timed runs: geometric mean {g:.3}"
    );
    let (published, predicted) = change(
        &all,
        "dsexamples-v100-hf-gpt2-xl-s1024-g16-zero1-mb1-dstimers",
        "dsexamples-v100-hf-gpt2-xl-s1024-g16-zero1-mb1",
    );
    assert!(published < 0.75, "end to end over timers: {published:.2}");
    assert!(
        (predicted - 1.0).abs() < 1e-9,
        "one configuration, one price"
    );
    // The data file says which is which: the timers time a steady step, the Trainer's
    // end-to-end figures a whole run, so the group table can set the latter aside.
    let hf: Vec<&(PublishedRun, Priced)> = all
        .iter()
        .filter(|(r, _)| r.id.starts_with("dsexamples-v100-hf-"))
        .collect();
    assert!(hf.len() >= 17, "{} Hugging Face rows", hf.len());
    for (r, p) in hf {
        let want = if r.id.ends_with("-dstimers") {
            runs::Timing::Step
        } else {
            runs::Timing::WholeRun
        };
        assert_eq!((r.timing, p.timing), (want, want), "{}", r.id);
    }
}

/// The runs from the sources added for issue 36 (DeepSpeed ZeRO-3 at 384–2,240 A100s,
/// Colossal-AI on 32 A800s, Hugging Face GPT-2 with DDP and DeepSpeed ZeRO-1 on 16 V100s,
/// Megatron-LM on 1–32 V100s): each records its stack, and none was used to fit anything.
fn new_sources() -> Vec<(PublishedRun, Priced)> {
    priced()
        .into_iter()
        .filter(|(r, _)| r.new_source())
        .collect()
}

#[test]
fn runs_from_new_sources_record_their_stack_and_are_held_out() {
    let runs = new_sources();
    assert!(runs.len() >= 18, "{} runs from new sources", runs.len());
    for (r, _) in &runs {
        let stack = r
            .stack
            .as_ref()
            .expect("a new-source run records its stack");
        assert!(
            !stack.framework.is_empty() && !stack.era.is_empty(),
            "{}",
            r.id
        );
        assert_eq!(r.role, Role::HeldOut, "{}: never fitted", r.id);
    }
    // Groups by generation and scale: one node, 2–32 nodes, 33+ nodes.
    let groups: std::collections::BTreeSet<String> =
        runs.iter().map(|(_, p)| p.group.clone()).collect();
    assert!(groups.contains("A100, 33+ nodes"), "{groups:?}");
    assert!(groups.contains("A100, 2–32 nodes"), "{groups:?}");
    assert!(groups.contains("V100, 1 node"), "{groups:?}");
    assert!(groups.contains("V100, 2–32 nodes"), "{groups:?}");
}

/// KempnerForge's FSDP2 run on 2 × 4 H200s accumulates four micro-batches with
/// `set_requires_gradient_sync(False)` before the last, so every module keeps its unsharded
/// gradient, upcast to the fp32 reduce dtype, until the step's one reduce-scatter: 55 GiB of a
/// 14.8B model on every GPU. Its log's peak (`max_memory_allocated`) is 88.5 GiB. Priced as
/// osdp-tui's own trainer runs the plan (a reduce-scatter every micro-batch) the peak is far
/// below that; priced as `--target fsdp2` prices `fully_shard`, it is not.
#[test]
fn fsdp2_accumulation_holds_every_unsharded_gradient() {
    let layouts = root().join("layouts");
    let run = runs()
        .into_iter()
        .find(|r| r.id == "kempner-h200-llama3-14.8b-s4096-g8-fsdp2-ac")
        .expect("the run is in the data file");
    let published = run
        .published
        .memory_allocated_gib
        .expect("a published peak");
    let as_fsdp2 = price_run(&run, &layouts, &|_| {}).expect("priced");
    let as_trainer = price_run_tuned(&run, &layouts, &|_| {}, &|m| {
        m.target = osdp_core::cost::Target::Osdp;
        m.side_pool_bytes = 0;
    })
    .expect("priced");
    assert!(
        as_trainer.predicted_peak_gib < 0.7 * published,
        "as the trainer runs it: {:.1} GiB",
        as_trainer.predicted_peak_gib
    );
    let allocated = as_fsdp2.predicted_memory_gib.expect("a published peak");
    assert!(
        allocated >= published,
        "as FSDP2 runs it: {allocated:.1} GiB allocated, published {published} GiB"
    );
    // The unsharded fp32 gradients account for the difference: 4 bytes a parameter, within
    // the prefetched unit's buffers.
    let held = (as_fsdp2.predicted_peak_gib - as_trainer.predicted_peak_gib) * GIB;
    let grads = 4.0 * 14.84e9;
    assert!(
        (held / grads - 1.0).abs() < 0.15,
        "held {:.1} GiB more, the gradients are {:.1} GiB",
        held / GIB,
        grads / GIB
    );
}

/// A run on FSDP2 is priced only with a plan FSDP2 can run: a sharding it has no equivalent for
/// is refused with the reason, not priced as osdp-tui's trainer would run it.
#[test]
fn an_fsdp2_run_is_priced_only_as_fsdp2_can_run_it() {
    let layouts = root().join("layouts");
    let mut run = runs()
        .into_iter()
        .find(|r| r.id == "kempner-h200-llama3-14.8b-s4096-g8-fsdp2-ac")
        .expect("the run is in the data file");
    run.sharding = Some("ZERO1".into());
    let why = price_run(&run, &layouts, &|_| {}).expect_err("zero1 is not FSDP2's");
    assert!(why.contains("zero1") && why.contains("FSDP2"), "{why}");
    // The same run on a stack without that limit prices.
    run.stack.as_mut().expect("a stack").fsdp2 = false;
    assert!(price_run(&run, &layouts, &|_| {}).is_ok());
}

/// Flat gradient buffers (one collective latency a buffer) describe stacks whose parameters stay
/// whole on every rank; a run that gathers them per module, or names both kinds of buffer, is
/// refused rather than priced with the wrong latencies.
#[test]
fn gradient_buckets_are_priced_only_where_parameters_stay_whole() {
    let layouts = root().join("layouts");
    let all = runs();
    let find = |id: &str| all.iter().find(|r| r.id == id).cloned().expect(id);
    let mut zero3 = find("megatron-zero3-a100-gpt-175b-s2048-g384-mb4");
    zero3.stack.as_mut().expect("a stack").flat_gradients = true;
    let why = price_run(&zero3, &layouts, &|_| {}).expect_err("ZeRO-3 gathers per module");
    assert!(why.contains("parameters stay whole"), "{why}");
    let mut both = find("dle-v100-bert-large-s128-g16-dgx2-ddp-mb16");
    both.stack
        .as_mut()
        .expect("a stack")
        .gradient_bucket_elements = Some(1000);
    let why = price_run(&both, &layouts, &|_| {}).expect_err("both kinds");
    assert!(why.contains("not both"), "{why}");
}

const GIB: f64 = (1u64 << 30) as f64;

#[test]
fn predicted_peak_memory_reaches_every_published_peak_but_the_findings() {
    let layouts = root().join("layouts");
    let memory_only: Vec<(PublishedRun, Priced)> = runs()
        .into_iter()
        .filter(|r| r.memory_priced_on.is_some())
        .map(|r| {
            let p = runs::price_memory(&r, &layouts)
                .unwrap_or_else(|e| panic!("{}: memory cannot be priced: {e}", r.id));
            (r, p)
        })
        .collect();
    assert!(
        memory_only.len() >= 4,
        "torchtitan's H100 peaks are checked"
    );
    let mut checked = 0;
    let mut short = std::collections::BTreeSet::new();
    for (r, p) in priced().into_iter().chain(memory_only) {
        if let Some(published) = p.published_memory_gib {
            let predicted = p.predicted_memory_gib.expect("a prediction");
            let [lo, hi] = r.memory_band.unwrap_or(runs::MEMORY_BAND);
            let ratio = predicted / published;
            assert!(
                (lo..=hi).contains(&ratio),
                "{}: predicted {predicted:.1} GiB, published {published:.1} GiB, both {}: \
                 {ratio:.3}, outside {lo}-{hi}",
                r.id,
                p.published_memory.unwrap_or("?")
            );
            checked += 1;
            // A reserved peak of FSDP2 on GPUs counts what its side streams keep cached.
            let fsdp2 = r.stack.as_ref().is_some_and(|s| s.fsdp2);
            if p.published_memory == Some("reserved") && fsdp2 {
                assert!(p.prediction.side_pool_bytes > 0, "{}", r.id);
            }
            if ratio < 1.0 {
                short.insert(r.id.clone());
            }
        }
    }
    assert!(checked >= 6, "{checked} published peaks");
    // Only torchtitan's H100 peaks without torch.compile are short (docs/published-runs.md,
    // items 21 and 22): a finding that keeps the memory item open, each with its own
    // band.
    assert!(
        short
            .iter()
            .all(|id| id.starts_with("titan-h100-") && id.ends_with("-fsdp-sac"))
            && short.len() <= 2,
        "published peaks above the prediction: {short:?}"
    );
}

/// The pricer describes each run's model as its stack trains it: a stack that materialises
/// attention keeps the scores for backward (eager attention), and the dropout its code
/// defaults to (0.1 in Megatron-LM and in Hugging Face's GPT-2 configs) costs attention-dropout
/// passes and masks. Priced without its dropout, a DLPerf Megatron-LM row comes out about 9 %
/// faster and lighter; on a fused-attention stack it keeps flash attention.
#[test]
fn runs_are_priced_with_their_dropout_and_their_attention_as_their_stack_runs_them() {
    use osdp_core::model::AttentionImpl;
    let layouts = root().join("layouts");
    let all = runs();
    let find = |id: &str| all.iter().find(|r| r.id == id).expect(id).clone();
    let dlperf = find("dlperf-megatron-v100-gpt-1536x16-s2048-g8-dp-mb2");
    let model = runs::model_of(&dlperf).expect("imports");
    assert_eq!(model.config.attention, AttentionImpl::Eager);
    assert_eq!(model.config.attention_dropout, 0.1);
    let dry = PublishedRun {
        model: runs::Shape {
            dropout: None,
            ..dlperf.model.clone()
        },
        ..dlperf.clone()
    };
    let price = |r: &PublishedRun| price_run(r, &layouts, &|_| {}).expect("priced");
    let (wet, dry) = (price(&dlperf), price(&dry));
    let faster = dry.predicted_tokens_per_s_per_gpu / wet.predicted_tokens_per_s_per_gpu;
    assert!(faster > 1.05, "dropout costs only {faster:.3}×");
    assert!(dry.predicted_peak_gib < wet.predicted_peak_gib);
    // The same run on a stack with fused attention keeps flash attention's saved bytes.
    let mut fused = dlperf.clone();
    fused.stack.as_mut().expect("a stack").fused_attention = true;
    let model = runs::model_of(&fused).expect("imports");
    assert_eq!(model.config.attention, AttentionImpl::Flash);
    // An MPT run of llm-foundry trains without dropout (its configs set 0).
    let mpt = all
        .iter()
        .find(|r| r.model.family == "mpt")
        .expect("an MPT run");
    assert_eq!(
        runs::model_of(mpt)
            .expect("imports")
            .config
            .attention_dropout,
        0.0
    );
}

/// Eager PyTorch and compiled code, each priced as it runs. IBM's fms-fsdp published its
/// Llama-2 tables twice, eager (March 2024) and compiled (May 2024), on the same 128 A100s
/// and 96 H100s. Its eager model's norms are transformers' RMSNorm op for op and its rotary
/// embeddings multiply fp32 pairs by 2 × 2 rotations (`stack.eager_modules`, `stack.rotary`):
/// priced so, the eager rows land within 0.96–1.06 (0.97–1.05 measured), each at least 3 %
/// under its price with fused kernels (1.04–1.24 before). The compiled rows, whose element-wise
/// ops TorchInductor fuses, are priced with the fused kernels and land within 0.92–1.02
/// (0.935–0.995), faster than the eager rows as published. torchtitan's April 2024 rows (a
/// fused Triton RMSNorm, eager complex rotary embeddings, FSDP2; three with op-level selective
/// checkpointing, `Machine::selective_ops`, within 0.95–1.11) within 0.95–1.09.
#[test]
fn eager_and_compiled_code_are_priced_as_each_runs() {
    let layouts = root().join("layouts");
    let all = runs();
    let fms: Vec<&PublishedRun> = all.iter().filter(|r| r.id.starts_with("fms-")).collect();
    let compiled = |r: &PublishedRun| r.stack.as_ref().is_some_and(|s| s.compile);
    assert_eq!(fms.iter().filter(|r| compiled(r)).count(), 8);
    let fused = |r: &PublishedRun| {
        let mut plain = r.clone();
        plain.stack = Some(runs::Stack {
            eager_modules: false,
            rotary: None,
            ..r.stack.clone().unwrap()
        });
        price_run(&plain, &layouts, &|_| {}).unwrap().ratio
    };
    for r in &fms {
        assert_eq!(r.role, Role::HeldOut, "{}", r.id);
        let p = price_run(r, &layouts, &|_| {}).unwrap();
        if compiled(r) {
            assert!((0.92..=1.02).contains(&p.ratio), "{}: {:.3}", r.id, p.ratio);
            // Its eager twin: same model and GPU, published slower and priced slower.
            let twin = fms
                .iter()
                .find(|e| !compiled(e) && r.id.starts_with(&e.id[..e.id.find("-s4096").unwrap()]))
                .unwrap();
            let e = price_run(twin, &layouts, &|_| {}).unwrap();
            assert!(p.published_tokens_per_s_per_gpu > e.published_tokens_per_s_per_gpu);
            assert!(p.predicted_tokens_per_s_per_gpu > e.predicted_tokens_per_s_per_gpu);
        } else {
            let stack = r.stack.as_ref().unwrap();
            assert!(stack.eager_modules && stack.rotary == Some(EagerRotary::PairMatrix));
            assert!((0.96..=1.06).contains(&p.ratio), "{}: {:.3}", r.id, p.ratio);
            assert!(fused(r) > 1.03 * p.ratio, "{}: {:.3}", r.id, fused(r));
        }
    }
    let titan: Vec<&PublishedRun> = all
        .iter()
        .filter(|r| r.id.starts_with("titan-a100") && r.role == Role::HeldOut)
        .collect();
    // Three with op-level selective checkpointing (`selective_ops`) since item 20.
    assert_eq!(titan.len(), 8);
    assert_eq!(titan.iter().filter(|r| r.selective_ops).count(), 3);
    for r in titan {
        assert_eq!(r.stack.as_ref().unwrap().rotary, Some(EagerRotary::Complex));
        let p = price_run(r, &layouts, &|_| {}).unwrap();
        // The layer-checkpointed and unchecked rows 0.98–1.08; the op-checkpointed ones
        // 1.01–1.10 (op-level priced 4–5 % faster than layer-level, published within 2.4 %).
        let top = if r.selective_ops { 1.11 } else { 1.09 };
        assert!((0.95..=top).contains(&p.ratio), "{}: {:.3}", r.id, p.ratio);
    }
}

/// PyTorch 2.11 runs cuDNN's attention on Hopper (`Machine::cudnn_attention`), priced from the
/// kernel rates NVIDIA's cudnn-frontend benchmark publishes for FlashAttention-2 and cuDNN. Its
/// other benchmark trains Llama-3.2-1B on one H200 with each SDPA backend at six (batch,
/// sequence) pairs: the iteration time under cuDNN over the time under FlashAttention-2 falls
/// from 0.98 at 768 tokens to 0.85 at 16,384 as attention's share grows. Priced with the same
/// model code (nothing taken from these runs), each pair's ratio lands within 1.5 points of
/// the published one (0.3 to 1.0 measured); priced without the cuDNN rates it would be 1.
#[test]
fn cudnn_attention_on_hopper_saves_what_nvidias_training_benchmark_measured() {
    let layouts = root().join("layouts");
    let all = runs();
    let pairs: Vec<(&PublishedRun, &PublishedRun)> = all
        .iter()
        .filter(|r| r.id.starts_with("cudnnfe-") && r.id.ends_with("-cudnn"))
        .map(|c| {
            let flash = c.id.replace("-cudnn", "-flash");
            (c, all.iter().find(|r| r.id == flash).unwrap())
        })
        .collect();
    assert_eq!(pairs.len(), 6);
    let mut last = f64::INFINITY;
    for (c, f) in pairs {
        assert!(c.stack.as_ref().unwrap().cudnn_attention);
        assert!(!f.stack.as_ref().unwrap().cudnn_attention);
        let (pc, pf) = (
            price_run(c, &layouts, &|_| {}).unwrap(),
            price_run(f, &layouts, &|_| {}).unwrap(),
        );
        // Time under cuDNN over time under FlashAttention-2.
        let published = pf.published_tokens_per_s_per_gpu / pc.published_tokens_per_s_per_gpu;
        let predicted = pf.predicted_tokens_per_s_per_gpu / pc.predicted_tokens_per_s_per_gpu;
        assert!(
            (predicted - published).abs() < 0.015,
            "{}: predicted {predicted:.3}, published {published:.3}",
            c.id
        );
        // Longer sequences, larger savings: the pairs run from 768 tokens to 16,384.
        assert!(predicted < last, "{}", c.id);
        last = predicted;
    }
}

/// InternLM's optimizer state over every rank (`zero1=-1`): every rank that holds parameters
/// broadcasts them to all ranks after the step, so the published tokens/s a GPU fall from 64
/// GPUs to 1,024 (3,690 → 2,271) where the same table's `zero1=8` row stays flat. The priced
/// rows must fall too, at every doubling, and by a clear part of the published fall; without
/// the broadcasts they would stay flat.
#[test]
fn optimizer_state_over_every_rank_slows_each_doubling_as_its_broadcasts_grow() {
    let layouts = root().join("layouts");
    let all = runs();
    let row = |g: u32| {
        let id = format!("internlm-a100-internlm-7b-s2048-g{g}-zero1all-noac-mb2x4");
        let r = all.iter().find(|r| r.id == id).unwrap();
        assert_eq!(r.stack.as_ref().unwrap().zero1_ranks, Some(g));
        price_run(r, &layouts, &|_| {}).unwrap()
    };
    let sizes = [64, 128, 256, 512, 1024];
    let priced: Vec<Priced> = sizes.iter().map(|&g| row(g)).collect();
    for pair in priced.windows(2) {
        assert!(
            pair[1].predicted_tokens_per_s_per_gpu < 0.99 * pair[0].predicted_tokens_per_s_per_gpu,
            "{} is not slower than {}",
            pair[1].id,
            pair[0].id
        );
    }
    let fall = |p: &Priced, q: &Priced, f: fn(&Priced) -> f64| 1.0 - f(q) / f(p);
    let (first, last) = (&priced[0], &priced[4]);
    let published = fall(first, last, |p| p.published_tokens_per_s_per_gpu);
    let predicted = fall(first, last, |p| p.predicted_tokens_per_s_per_gpu);
    // Published 38 %, priced 24 % (the broadcasts' hops priced at NCCL's per-step latencies,
    // about half what the published steps imply: the rows' band_because).
    assert!(
        predicted > 0.5 * published && predicted < published,
        "falls 64 → 1,024 GPUs: predicted {predicted:.3}, published {published:.3}"
    );
}
