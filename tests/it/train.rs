//! The trainer (feature `train`): every plan computes the same training as one plain rank,
//! checkpoints carry a run across plans and world sizes, bad input is refused cleanly.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use osdp_core::cost::{self, Choice, Strategy};
use osdp_core::model::{self, ModelSpec, OpKind};
use osdp_core::plan::{Plan, PlanFile};
use osdp_train::exec::{Numerics, OptimConfig, Target};
use osdp_train::tch::{self, Tensor};
use osdp_train::{data, TrainConfig, TrainSummary};

use super::{osdp, root, stdout_ok};

const GLOBAL_BATCH: u64 = 8;

pub(crate) fn tiny(name: &str) -> ModelSpec {
    model::read_model(&root().join(format!("sample-models/{name}.json"))).expect("sample loads")
}

pub(crate) fn dp_plan(m: &ModelSpec) -> Plan {
    Plan {
        batch: GLOBAL_BATCH,
        accumulation: 1,
        choices: m
            .ops
            .iter()
            .map(|o| {
                if cost::owns_params(o) {
                    Choice::DP
                } else {
                    Choice::NONE
                }
            })
            .collect(),
        recompute: vec![false; m.config.layers as usize],
        keep_weights: Vec::new(),
    }
}

/// Every strategy at once: linears cycle through zero3 split 4 with 2 of 4 slices sharded,
/// zero1, zero2, zero3 split 2 with 1 sharded and dp; other ops through zero3, zero1, zero2, dp;
/// blocks 1 and 3 recompute.
fn mixed_plan(m: &ModelSpec, per_rank_batch: u64) -> Plan {
    let linear = [
        Choice::zero3(4, 2),
        Choice::plain(Strategy::Zero1),
        Choice::plain(Strategy::Zero2),
        Choice::zero3(2, 1),
        Choice::DP,
    ];
    let other = [
        Choice::zero3(1, 1),
        Choice::plain(Strategy::Zero1),
        Choice::plain(Strategy::Zero2),
        Choice::DP,
    ];
    let (mut li, mut oi) = (0, 0);
    let choices = m
        .ops
        .iter()
        .map(|o| {
            if !cost::owns_params(o) {
                Choice::NONE
            } else if o.kind == OpKind::Linear {
                li += 1;
                linear[(li - 1) % linear.len()]
            } else {
                oi += 1;
                other[(oi - 1) % other.len()]
            }
        })
        .collect();
    Plan {
        batch: per_rank_batch,
        accumulation: 1,
        choices,
        recompute: (0..m.config.layers).map(|b| b % 2 == 1).collect(),
        keep_weights: Vec::new(),
    }
}

/// Hybrid sharding among the others: linears cycle through hsdp, zero3 split 4 with 2 of 4
/// slices sharded, zero1, hsdp, zero2 and dp; other ops through hsdp, zero3, zero2, dp; blocks
/// 0 and 2 recompute.
fn hsdp_plan(m: &ModelSpec, micro_batch: u64, accumulation: u64) -> Plan {
    let hsdp = Choice::plain(Strategy::Hsdp);
    let linear = [
        hsdp,
        Choice::zero3(4, 2),
        Choice::plain(Strategy::Zero1),
        hsdp,
        Choice::plain(Strategy::Zero2),
        Choice::DP,
    ];
    let other = [
        hsdp,
        Choice::zero3(1, 1),
        Choice::plain(Strategy::Zero2),
        Choice::DP,
    ];
    let (mut li, mut oi) = (0, 0);
    let choices = m
        .ops
        .iter()
        .map(|o| {
            if !cost::owns_params(o) {
                Choice::NONE
            } else if o.kind == OpKind::Linear {
                li += 1;
                linear[(li - 1) % linear.len()]
            } else {
                oi += 1;
                other[(oi - 1) % other.len()]
            }
        })
        .collect();
    Plan {
        batch: micro_batch,
        accumulation,
        choices,
        recompute: (0..m.config.layers).map(|b| b % 2 == 0).collect(),
        keep_weights: Vec::new(),
    }
}

/// ZeRO-3 (FSDP) everywhere.
fn zero3_plan(m: &ModelSpec, per_rank_batch: u64) -> Plan {
    Plan {
        batch: per_rank_batch,
        accumulation: 1,
        choices: m
            .ops
            .iter()
            .map(|o| {
                if cost::owns_params(o) {
                    Choice::zero3(1, 1)
                } else {
                    Choice::NONE
                }
            })
            .collect(),
        recompute: vec![true; m.config.layers as usize],
        keep_weights: Vec::new(),
    }
}

fn config(m: &ModelSpec, plan: Plan, world: usize, steps: u64) -> TrainConfig {
    TrainConfig {
        model: m.clone(),
        plan,
        world_size: world,
        ranks_per_node: None,
        global_batch: GLOBAL_BATCH,
        steps,
        seed: 3,
        source: data::Source::shakespeare(),
        optim: OptimConfig::default(),
        target: Target::CPU,
        checkpoint_dir: None,
        checkpoint_every: 0,
        resume_from: None,
        init_from: None,
        eval: None,
        collect_params: true,
        membership: None,
    }
}

fn train(cfg: &TrainConfig) -> TrainSummary {
    osdp_train::train(cfg, &AtomicBool::new(false), |_| {}).expect("training runs")
}

fn assert_same_losses(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: step counts differ");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let rel = (x - y).abs() / x.abs();
        assert!(
            rel < 1e-5,
            "{what}: step {} loss {x} vs {y} (rel {rel:e})",
            step + 1
        );
    }
}

fn assert_same_params(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_params_within(a, b, 1e-5, what);
}

fn assert_params_within(a: &[(String, Tensor)], b: &[(String, Tensor)], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: parameter counts differ");
    for ((ka, ta), (kb, tb)) in a.iter().zip(b) {
        assert_eq!(ka, kb, "{what}");
        assert_eq!(ta.size(), tb.size(), "{what}: {ka}");
        // Absolute, or relative for parameters larger than 1 (all are ~0.02–1 here).
        let diff = (ta - tb).abs().max().double_value(&[]);
        let scale = ta.abs().max().double_value(&[]).max(1.0);
        assert!(diff / scale < tol, "{what}: {ka} differs by {diff:e}");
    }
}

/// For ReLU models: a pre-activation within rounding of zero can take the other side in
/// another summation order (which the CPU's BLAS picks) and switch its unit's gradient off for
/// a step; AdamW then moves weights whose gradients are near zero by up to about one step, and
/// the difference spreads. Measured (tiny-opt, 4 ranks, 20 steps, AMD EPYC): largest 1.1e-4,
/// mean 1.1e-6. With the gradients' reduce-scatter broken (each rank keeping its own), the
/// largest difference was 2.1e-2 on 2 ranks, losses unchecked. So: none beyond 1e-3, and the
/// mean over every element under 1e-5.
fn assert_params_relu(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_params_within(a, b, 1e-3, what);
    let (mut sum, mut total) = (0.0, 0i64);
    for ((_, ta), (_, tb)) in a.iter().zip(b) {
        sum += (ta - tb).abs().sum(tch::Kind::Double).double_value(&[]);
        total += ta.numel() as i64;
    }
    let mean = sum / total as f64;
    assert!(
        mean < 1e-5,
        "{what}: parameters differ by {mean:e} on average"
    );
}

fn check_equivalence(name: &str, relu: bool) {
    let m = tiny(name);
    let reference = train(&config(&m, dp_plan(&m), 1, 20));
    assert!(
        reference.losses[19] < reference.losses[0] * 0.8,
        "{name} learns: {:?}",
        reference.losses
    );
    for world in [2, 4] {
        let per_rank = GLOBAL_BATCH / world as u64;
        let run = train(&config(&m, mixed_plan(&m, per_rank), world, 20));
        let what = format!("{name}, {world} ranks, mixed plan");
        assert_same_losses(&reference.losses, &run.losses, &what);
        if relu {
            assert_params_relu(&reference.final_params, &run.final_params, &what);
        } else {
            assert_same_params(&reference.final_params, &run.final_params, &what);
        }
    }
}

/// Gradient accumulation: a micro-batches of m samples train as one micro-batch of a·m, for
/// every strategy, split and recompute mix at once, on 1, 2 and 4 ranks.
#[test]
fn accumulated_micro_batches_train_exactly_like_one_large_micro_batch() {
    // AdamW hardly sees a gradient's scale, so the gradient norms are compared too: a wrong
    // loss scale under accumulation shows there first.
    let run = |cfg: &TrainConfig| {
        let mut norms = Vec::new();
        let summary = osdp_train::train(cfg, &AtomicBool::new(false), |ev| {
            if let osdp_core::protocol::WorkerEvent::Step { grad_norm, .. } = ev {
                norms.push(*grad_norm);
            }
        })
        .expect("training runs");
        (summary, norms)
    };
    let m = tiny("tiny-gpt2");
    for world in [1usize, 2, 4] {
        let per_rank = GLOBAL_BATCH / world as u64;
        let (whole, whole_norms) = run(&config(&m, mixed_plan(&m, per_rank), world, 8));
        for micro in [1, per_rank / 2]
            .into_iter()
            .filter(|&b| b >= 1 && b < per_rank)
        {
            let mut plan = mixed_plan(&m, micro);
            plan.accumulation = per_rank / micro;
            let (accumulated, norms) = run(&config(&m, plan, world, 8));
            let what = format!(
                "{world} ranks, {} × {micro} accumulated vs 1 × {per_rank}",
                per_rank / micro
            );
            assert_same_losses(&whole.losses, &accumulated.losses, &what);
            assert_same_losses(&whole_norms, &norms, &format!("{what}, gradient norms"));
            assert_same_params(&whole.final_params, &accumulated.final_params, &what);
        }
    }
}

/// The same through the command line: `train --global-batch` with a plan's smaller
/// micro-batch runs the plan's accumulation and logs the losses of one large micro-batch.
#[test]
fn train_global_batch_accumulates_the_plans_micro_batches() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let losses_of = |micro: u64| {
        let plan = write_plan(
            dir.path(),
            &m,
            &mixed_plan(&m, micro),
            &format!("p{micro}.json"),
        );
        let metrics = dir.path().join(format!("m{micro}.jsonl"));
        let out = osdp()
            .arg("train")
            .arg(sample("tiny-gpt2"))
            .arg("--plan")
            .arg(&plan)
            .args([
                "--world-size",
                "2",
                "--global-batch",
                "8",
                "--steps",
                "4",
                "--metrics",
            ])
            .arg(&metrics)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            losses(&metrics),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (whole, _) = losses_of(4);
    let (accumulated, log) = losses_of(2);
    assert!(
        log.contains("8 samples per step (2 × 2 micro-batches per rank)"),
        "{log}"
    );
    assert_same_losses(
        &whole,
        &accumulated,
        "--global-batch 8 at micro-batch 2 vs 4",
    );
    // A global batch the plan's micro-batches cannot make is refused before anything runs.
    let plan = write_plan(dir.path(), &m, &mixed_plan(&m, 3), "p3.json");
    let out = osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--world-size", "2", "--global-batch", "8", "--steps", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a whole number of the plan's micro-batches of 3"),
        "{err}"
    );
}

/// A model whose config asks for dropout trains without it, and the trainer says so at the
/// start (what the run leaves out, and that the plan's memory counts dropout's masks); a model
/// without dropout gets no such line.
#[test]
fn the_trainer_says_it_applies_no_dropout_where_the_config_asks_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let dry = tiny("tiny-gpt2");
    let mut wet = dry.clone();
    wet.config.dropout = 0.1;
    wet.config.attention_dropout = 0.1;
    let wet_file = dir.path().join("tiny-gpt2-dropout.json");
    std::fs::write(&wet_file, serde_json::to_string(&wet).unwrap()).unwrap();
    let log = |model: &Path, m: &ModelSpec, name: &str| {
        let plan = write_plan(dir.path(), m, &dp_plan(m), &format!("{name}.plan.json"));
        let out = osdp()
            .arg("train")
            .arg(model)
            .arg("--plan")
            .arg(&plan)
            .args(["--steps", "1", "--metrics"])
            .arg(dir.path().join(format!("{name}.jsonl")))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        err
    };
    let said = log(&wet_file, &wet, "wet");
    assert!(
        said.contains(
            "note: tiny-gpt2's config sets dropout 0.1 (attention 0.1); osdp-tui's trainer \
             applies no dropout"
        ),
        "{said}"
    );
    let quiet = log(&sample("tiny-gpt2"), &dry, "dry");
    assert!(!quiet.contains("dropout"), "{quiet}");
}

/// A value of OSDP_GEMM_PADDING the trainer does not know is said once, not silently taken
/// for "on"; the run goes on with the default (on the CPU in fp32: nothing padded).
#[test]
fn an_unknown_gemm_padding_setting_is_warned_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny("tiny-gpt2");
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "dp.plan.json");
    let out = osdp()
        .env("OSDP_GEMM_PADDING", "yes")
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--steps", "1", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.matches("warning: OSDP_GEMM_PADDING=yes is not 0")
            .count(),
        1,
        "{err}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report.get("padded_linears").is_none(), "{report}");
}

#[test]
fn mixed_plans_on_two_and_four_ranks_train_exactly_like_one_dp_rank_gpt2() {
    check_equivalence("tiny-gpt2", false);
}

#[test]
fn mixed_plans_on_two_and_four_ranks_train_exactly_like_one_dp_rank_llama() {
    check_equivalence("tiny-llama", false);
}

#[test]
fn mixed_plans_on_two_and_four_ranks_train_exactly_like_one_dp_rank_opt() {
    check_equivalence("tiny-opt", true);
}

/// Hybrid sharding (issue 18 item 4): 4 ranks as 2 nodes × 2, hsdp among every other
/// strategy, with and without accumulation (the nodes' shards meet once a step), train as one
/// dp rank does.
#[test]
fn hsdp_plans_on_two_nodes_of_two_ranks_train_exactly_like_one_dp_rank() {
    for name in ["tiny-gpt2", "tiny-llama"] {
        let m = tiny(name);
        let reference = train(&config(&m, dp_plan(&m), 1, 20));
        // 2 samples per rank: one micro-batch of 2, or 2 of 1 accumulated.
        for (micro, accumulation) in [(2, 1), (1, 2)] {
            let mut cfg = config(&m, hsdp_plan(&m, micro, accumulation), 4, 20);
            cfg.ranks_per_node = Some(2);
            let run = train(&cfg);
            let what = format!("{name}, 2 nodes × 2 ranks, hsdp plan {micro} × {accumulation}");
            assert_same_losses(&reference.losses, &run.losses, &what);
            assert_same_params(&reference.final_params, &run.final_params, &what);
        }
    }
}

/// A run checkpointed under hsdp (2 nodes × 2) resumes under a plan without it on 2 ranks,
/// then under hsdp again on 4 nodes of one rank, and continues the same run.
#[test]
fn an_hsdp_checkpoint_resumes_under_other_plans_and_node_shapes() {
    let m = tiny("tiny-llama");
    let straight = train(&config(&m, dp_plan(&m), 1, 30));
    let dir = tempfile::tempdir().unwrap();
    let mut first = config(&m, hsdp_plan(&m, 2, 1), 4, 10);
    first.ranks_per_node = Some(2);
    first.checkpoint_dir = Some(dir.path().to_path_buf());
    let a = train(&first);
    let resume = |cfg: &mut TrainConfig| {
        cfg.resume_from = Some(
            osdp_train::checkpoint::latest(dir.path())
                .unwrap()
                .expect("a checkpoint"),
        );
        cfg.checkpoint_dir = Some(dir.path().to_path_buf());
    };
    let mut second = config(&m, mixed_plan(&m, 4), 2, 10);
    resume(&mut second);
    let b = train(&second);
    let mut third = config(&m, hsdp_plan(&m, 2, 1), 4, 10);
    third.ranks_per_node = Some(1);
    resume(&mut third);
    let c = train(&third);
    assert_eq!((c.first_step, c.last_step), (20, 30));
    let joined: Vec<f64> = [a.losses, b.losses, c.losses].concat();
    assert_same_losses(&straight.losses, &joined, "hsdp 10 + mixed 10 + hsdp 10");
    assert_same_params(&straight.final_params, &c.final_params, "hsdp, mixed, hsdp");
}

/// hsdp needs ranks in several nodes: on one, or with nodes that do not divide the ranks, the
/// run is refused with the reason.
#[test]
fn hsdp_without_nodes_is_refused_with_the_reason() {
    let m = tiny("tiny-gpt2");
    let refused = |ranks_per_node: Option<usize>, needle: &str| {
        let mut cfg = config(&m, hsdp_plan(&m, 2, 1), 4, 1);
        cfg.ranks_per_node = ranks_per_node;
        let err = osdp_train::train(&cfg, &AtomicBool::new(false), |_| {})
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(needle), "{err}");
    };
    refused(None, "the 4 ranks are one node: give --ranks-per-node");
    refused(Some(4), "the 4 ranks are one node");
    refused(Some(3), "3 ranks per node do not divide the 4 ranks");
}

#[test]
fn resuming_under_another_plan_and_world_size_continues_the_same_run() {
    let m = tiny("tiny-llama");
    let straight = train(&config(&m, dp_plan(&m), 1, 20));
    let dir = tempfile::tempdir().unwrap();
    let mut first = config(&m, mixed_plan(&m, 4), 2, 10);
    first.checkpoint_dir = Some(dir.path().to_path_buf());
    let a = train(&first);
    let ckpt = osdp_train::checkpoint::latest(dir.path())
        .unwrap()
        .expect("a checkpoint");
    assert!(ckpt.ends_with("step-00000010"), "{}", ckpt.display());
    let mut second = config(&m, zero3_plan(&m, 2), 4, 10);
    second.resume_from = Some(ckpt);
    let b = train(&second);
    assert_eq!((b.first_step, b.last_step), (10, 20));
    let joined: Vec<f64> = a.losses.iter().chain(&b.losses).copied().collect();
    assert_same_losses(&straight.losses, &joined, "10 + 10 resumed");
    assert_same_params(&straight.final_params, &b.final_params, "10 + 10 resumed");
}

#[test]
fn executor_memory_matches_the_planners_prediction_within_ten_percent() {
    let m = tiny("tiny-gpt2");
    let layout = osdp_core::cluster::read_layout(&root().join("layouts/cpu.json")).unwrap();
    let machine = cost::Machine::new(&layout, &m);
    for plan in [dp_plan(&m), mixed_plan(&m, 4)] {
        let plan = Plan { batch: 4, ..plan };
        let predicted = osdp_core::plan::evaluate(&m, &machine, &plan);
        let predicted = predicted.peak_memory_bytes - predicted.overhead_bytes;
        let run = train(&config(&m, plan, 2, 2));
        let measured = run.memory_bytes.iter().flatten().copied().max().unwrap();
        let ratio = measured as f64 / predicted as f64;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "measured {measured} vs predicted {predicted}"
        );
    }
}

#[test]
fn bf16_mixed_precision_follows_fp32_and_holds_what_the_planner_predicts_for_gpus() {
    let m = tiny("tiny-gpt2");
    let plan = mixed_plan(&m, 4);
    let fp32 = train(&config(&m, plan.clone(), 2, 10));
    let mut cfg = config(&m, plan.clone(), 2, 10);
    cfg.target = Target {
        numerics: Numerics::Bf16Mixed,
        ..Target::CPU
    };
    let bf16 = train(&cfg);
    // bf16 has 8 bits of mantissa: the losses agree to a few parts in a thousand, not 1e-5.
    for (step, (a, b)) in fp32.losses.iter().zip(&bf16.losses).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(rel < 0.02, "step {}: fp32 {a} vs bf16 {b}", step + 1);
    }
    assert!(bf16.losses.last() < bf16.losses.first(), "bf16 learns");
    assert_params_within(&fp32.final_params, &bf16.final_params, 0.05, "bf16 vs fp32");
    // A GPU layout's accounting (2 + 2 + 12 bytes per parameter, bf16 activations) is what the
    // bf16 executor holds.
    let mut layout =
        osdp_core::cluster::read_layout(&root().join("layouts/h100-sxm-8x-nvlink.json")).unwrap();
    layout.gpus_per_node = 2;
    let machine = cost::Machine::new(&layout, &m);
    let predicted = osdp_core::plan::evaluate(&m, &machine, &plan);
    let predicted = predicted.peak_memory_bytes - predicted.overhead_bytes;
    let measured = bf16.memory_bytes.iter().flatten().copied().max().unwrap();
    let ratio = measured as f64 / predicted as f64;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "bf16 measured {measured} vs GPU prediction {predicted}"
    );
    let fp32_peak = fp32.memory_bytes.iter().flatten().copied().max().unwrap();
    assert!(measured < fp32_peak, "bf16 {measured} vs fp32 {fp32_peak}");
}

#[test]
fn train_refuses_cuda_without_a_gpu_or_gpu_support() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let out = osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--device", "cuda", "--steps", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    // A build with the cuda feature finds no GPU here; one without says how to get it.
    assert!(
        err.contains("NVIDIA driver")
            || err.contains("no GPU is visible")
            || err.contains("not linked against libtorch_cuda.so")
            || err.contains("built without GPU support"),
        "{err}"
    );
    assert!(err.contains("--device cpu"), "{err}");
    let out = osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--device", "cuda", "--world-size", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("one process per GPU") && err.contains("torchrun"),
        "{err}"
    );
}

// ---- the CLI ----

pub(crate) fn write_plan(dir: &Path, m: &ModelSpec, plan: &Plan, name: &str) -> PathBuf {
    let path = dir.join(name);
    let file = PlanFile::new(m, "cpu", plan, None);
    std::fs::write(&path, serde_json::to_string_pretty(&file).unwrap()).unwrap();
    path
}

pub(crate) fn sample(name: &str) -> PathBuf {
    root().join(format!("sample-models/{name}.json"))
}

pub(crate) fn step_lines(metrics: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(metrics)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .collect()
}

// Needs the `OSDP_FAULT` hook, built only with feature `fault-injection` (scripts/test.sh).
#[cfg(feature = "fault-injection")]
#[test]
fn a_crash_while_checkpointing_leaves_the_last_good_checkpoint() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &mixed_plan(&m, 4), "plan.json");
    let ckpt = dir.path().join("ckpt");
    let metrics = dir.path().join("run.jsonl");
    let run = |extra: &[&str], fault: bool| {
        let mut cmd = osdp();
        cmd.arg("train")
            .arg(sample("tiny-gpt2"))
            .arg("--plan")
            .arg(&plan);
        cmd.args(["--world-size", "2", "--steps", "2"]);
        cmd.arg("--checkpoint-dir")
            .arg(&ckpt)
            .arg("--metrics")
            .arg(&metrics);
        cmd.args(extra);
        if fault {
            cmd.env("OSDP_FAULT", "kill-mid-checkpoint");
        }
        cmd.output().unwrap()
    };
    assert!(run(&[], false).status.success());
    let killed = run(&["--resume"], true);
    assert!(!killed.status.success(), "the fault ends the process");
    let latest = osdp_train::checkpoint::latest(&ckpt).unwrap().unwrap();
    assert!(
        latest.ends_with("step-00000002"),
        "latest still the good one"
    );
    osdp_train::checkpoint::load(&latest).expect("and it loads");
    let resumed = run(&["--resume"], false);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let steps: Vec<u64> = step_lines(&metrics)
        .iter()
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps.last(), Some(&4), "{steps:?}");
    assert!(osdp_train::checkpoint::latest(&ckpt)
        .unwrap()
        .unwrap()
        .ends_with("step-00000004"));
}

#[test]
fn a_corrupt_checkpoint_is_refused_and_the_previous_one_named() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let ckpt = dir.path().join("ckpt");
    osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args([
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--global-batch",
            "2",
        ])
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .assert()
        .success();
    let file = ckpt.join("step-00000004/rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let out = osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--steps", "1", "--resume", "--global-batch", "2"])
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("corrupt") && err.contains("rank-00000.safetensors"),
        "{err}"
    );
    assert!(
        err.contains("step-00000002"),
        "names the previous good one: {err}"
    );
    assert!(ckpt.join("step-00000002/manifest.json").exists());
}

#[test]
fn sigterm_finishes_the_step_checkpoints_and_exits_zero() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let ckpt = dir.path().join("ckpt");
    let metrics = dir.path().join("run.jsonl");
    let bin = assert_cmd::cargo::cargo_bin("osdp-tui");
    let mut child = std::process::Command::new(bin)
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&plan)
        .args(["--steps", "100000", "--global-batch", "2"])
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .arg("--metrics")
        .arg(&metrics)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while step_lines(&metrics).len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no progress");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert_eq!(exit.code(), Some(0));
    let last = step_lines(&metrics).last().unwrap()["step"]
        .as_u64()
        .unwrap();
    let latest = osdp_train::checkpoint::latest(&ckpt).unwrap().unwrap();
    assert!(
        latest.ends_with(format!("step-{last:08}")),
        "{}",
        latest.display()
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(
        text.lines()
            .last()
            .unwrap()
            .contains("\"reason\":\"signal\""),
        "{text}"
    );
}

fn refused(args: &[&str], plan: &Path, needle: &str) {
    let out = osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(plan)
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_training_input_is_refused_before_anything_is_written() {
    let gpt = tiny("tiny-gpt2");
    let llama = tiny("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let good = write_plan(dir.path(), &gpt, &dp_plan(&gpt), "good.json");
    let other = write_plan(dir.path(), &llama, &dp_plan(&llama), "other.json");
    let metrics = dir.path().join("m.jsonl");
    let ckpt = dir.path().join("ckpt");
    let m = metrics.to_str().unwrap();
    let c = ckpt.to_str().unwrap();

    refused(&["--metrics", m], &other, "made for model");
    let mut unsplittable = dp_plan(&gpt);
    let i = gpt
        .ops
        .iter()
        .position(|o| o.id == "h0.attn.c_proj")
        .unwrap();
    unsplittable.choices[i] = Choice::zero3(256, 1);
    let bad = write_plan(dir.path(), &gpt, &unsplittable, "unsplittable.json");
    refused(&["--metrics", m], &bad, "cannot be split into 256 slices");
    let hsdp = write_plan(dir.path(), &gpt, &hsdp_plan(&gpt, 2, 1), "hsdp.json");
    refused(
        &["--world-size", "4", "--metrics", m, "--checkpoint-dir", c],
        &hsdp,
        "the 4 ranks are one node: give --ranks-per-node",
    );
    refused(
        &["--world-size", "4", "--ranks-per-node", "3", "--metrics", m],
        &hsdp,
        "3 ranks per node do not divide the 4 ranks",
    );
    refused(
        &[
            "--world-size",
            "3",
            "--global-batch",
            "8",
            "--metrics",
            m,
            "--checkpoint-dir",
            c,
        ],
        &good,
        "does not divide",
    );
    refused(&["--resume", "--checkpoint-dir", c], &good, "no checkpoint");
    refused(
        &["--resume-from", "/nonexistent/step-00000001"],
        &good,
        "manifest",
    );
    assert!(!metrics.exists(), "no metrics file for a refused run");
    assert!(!ckpt.exists(), "no checkpoint directory for a refused run");

    // A directory with checkpoints is not overwritten by a fresh run.
    osdp()
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(&good)
        .args(["--steps", "1", "--global-batch", "2", "--checkpoint-dir", c])
        .assert()
        .success();
    let before = std::fs::read(ckpt.join("latest.json")).unwrap();
    refused(&["--steps", "1", "--checkpoint-dir", c], &good, "--resume");
    assert_eq!(std::fs::read(ckpt.join("latest.json")).unwrap(), before);
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn rank_process(
    rank: usize,
    world: usize,
    port: u16,
    args: &[&std::ffi::OsStr],
) -> std::process::Command {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("osdp-tui"));
    cmd.current_dir(root())
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OSDP_JOIN_TIMEOUT_S", "30")
        .env("OSDP_RUN_TOKEN", "test-run-token");
    cmd
}

/// `train tiny-gpt2 --plan <dp plan in dir> --steps 1`, for rank processes.
pub(crate) fn one_step_args(dir: &Path) -> Vec<std::ffi::OsString> {
    let m = tiny("tiny-gpt2");
    let plan = write_plan(dir, &m, &dp_plan(&m), "plan.json");
    vec![
        "train".into(),
        sample("tiny-gpt2").into(),
        "--plan".into(),
        plan.into(),
        "--steps".into(),
        "1".into(),
    ]
}

pub(crate) fn losses(metrics: &Path) -> Vec<f64> {
    step_lines(metrics)
        .iter()
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn ranks_as_processes_over_tcp_train_exactly_like_ranks_as_threads() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &mixed_plan(&m, 4), "plan.json");
    let model = sample("tiny-gpt2");
    let (threads, procs) = (
        dir.path().join("threads.jsonl"),
        dir.path().join("procs.jsonl"),
    );
    let common = |metrics: &Path| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> =
            vec!["train".into(), model.clone().into(), "--plan".into()];
        v.push(plan.clone().into());
        for a in ["--global-batch", "8", "--steps", "5", "--metrics"] {
            v.push(a.into());
        }
        v.push(metrics.into());
        v
    };
    osdp()
        .args(common(&threads))
        .args(["--world-size", "2"])
        .assert()
        .success();
    let port = free_port();
    let args = common(&procs);
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let children: Vec<_> = (0..2)
        .map(|r| {
            rank_process(r, 2, port, &refs)
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let (a, b) = (losses(&threads), losses(&procs));
    assert_eq!(a.len(), 5);
    assert_same_losses(&a, &b, "2 processes over TCP vs 2 threads");
    let mem = &step_lines(&procs)[0]["memory_bytes"];
    assert_eq!(
        mem.as_array().unwrap().len(),
        2,
        "rank 0 reports both ranks' memory"
    );
}

/// hsdp across processes: 4 processes over TCP as 2 nodes × 2 (`--ranks-per-node 2`) log the
/// losses of 4 threads arranged the same way.
#[test]
fn hsdp_over_tcp_processes_trains_like_hsdp_over_threads() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &hsdp_plan(&m, 2, 1), "plan.json");
    let (threads, procs) = (
        dir.path().join("threads.jsonl"),
        dir.path().join("procs.jsonl"),
    );
    let common = |metrics: &Path| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> =
            vec!["train".into(), sample("tiny-gpt2").into(), "--plan".into()];
        v.push(plan.clone().into());
        for a in ["--ranks-per-node", "2", "--steps", "3", "--metrics"] {
            v.push(a.into());
        }
        v.push(metrics.into());
        v
    };
    osdp()
        .args(common(&threads))
        .args(["--world-size", "4"])
        .assert()
        .success();
    let port = free_port();
    let args = common(&procs);
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let children: Vec<_> = (0..4)
        .map(|r| {
            rank_process(r, 4, port, &refs)
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let (a, b) = (losses(&threads), losses(&procs));
    assert_eq!(a.len(), 3);
    assert_same_losses(&a, &b, "hsdp: 4 processes over TCP vs 4 threads");
}

#[test]
fn a_rank_that_never_joins_ends_the_run_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let args = one_step_args(dir.path());
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let port = free_port();
    let out = rank_process(0, 2, port, &args)
        .env("OSDP_JOIN_TIMEOUT_S", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank(s) 1 did not join") && err.contains("within 1 s"),
        "{err}"
    );
    let out = rank_process(1, 2, free_port(), &args)
        .env("OSDP_JOIN_TIMEOUT_S", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 could not reach rank 0"), "{err}");
}

/// Peak resident memory of `osdp-tui ARGS` (the child's own, from `wait4`) and the largest
/// ledger peak its metrics report.
#[allow(
    clippy::zombie_processes,
    reason = "reaped by wait4, which also gives its rusage"
)]
fn peak_rss_and_ledger(args: &[&std::ffi::OsStr], metrics: &Path) -> (u64, u64) {
    let log = metrics.with_extension("log");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_osdp-tui"))
        .args(args)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "train failed: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let ledger = step_lines(metrics)
        .iter()
        .flat_map(|s| s["memory_bytes"].as_array().unwrap().clone())
        .filter_map(|v| v.as_u64())
        .max()
        .unwrap();
    (usage.ru_maxrss as u64 * 1024, ledger)
}

/// The loss of a large vocabulary: what the process really holds grows with the vocabulary as
/// the executor's ledger says (the kept fp32 log-probabilities, the bf16 gradient), not by the
/// two or three further fp32 `[tokens, vocab]` temporaries a plain log-softmax and its
/// backward would add — the memory a planner cannot see is memory that runs out.
#[test]
fn a_large_vocabulary_costs_what_the_ledger_counts() {
    let dir = tempfile::tempdir().unwrap();
    let run = |vocab: u64| {
        let hf = dir.path().join(format!("v{vocab}.hf.json"));
        let config = std::fs::read_to_string(root().join("sample-models/hf/tiny-gpt2.json"))
            .unwrap()
            .replace("\"vocab_size\": 256", &format!("\"vocab_size\": {vocab}"))
            .replace("\"n_layer\": 4", "\"n_layer\": 1");
        std::fs::write(&hf, config).unwrap();
        let model = dir.path().join(format!("v{vocab}.json"));
        stdout_ok(osdp().arg("import-hf").arg(&hf).arg("-o").arg(&model));
        let plan = dir.path().join(format!("v{vocab}.plan.json"));
        stdout_ok(
            osdp()
                .arg("plan")
                .arg(&model)
                .args([
                    "--layout",
                    "layouts/cpu.json",
                    "--budget",
                    "16GiB",
                    "--batch",
                    "8",
                ])
                .arg("-o")
                .arg(&plan),
        );
        let metrics = dir.path().join(format!("v{vocab}.jsonl"));
        let args: Vec<std::ffi::OsString> = vec![
            "train".into(),
            model.into(),
            "--plan".into(),
            plan.into(),
            "--precision".into(),
            "bf16".into(),
            "--data".into(),
            "random".into(),
            "--steps".into(),
            "2".into(),
            "--metrics".into(),
            metrics.clone().into(),
        ];
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        peak_rss_and_ledger(&args, &metrics)
    };
    let (rss_small, ledger_small) = run(256);
    let (rss_large, ledger_large) = run(65536);
    let (rss, ledger) = (
        rss_large.saturating_sub(rss_small),
        ledger_large - ledger_small,
    );
    // 1,024 tokens × 65,536 words: 256 MiB per fp32 copy. Allow the bounded chunk
    // temporaries and allocator slack, not another copy.
    assert!(
        rss <= ledger + ledger / 4 + (64 << 20),
        "resident memory grew by {} MiB for {} MiB the ledger counts",
        rss >> 20,
        ledger >> 20
    );
}

/// `--resume` continues the run the checkpoint holds: its global batch, seed and data unless
/// the user gives others (and then says so), so a resume without repeating the flags trains
/// exactly like the straight run.
#[test]
fn resume_takes_the_checkpoints_global_batch_seed_and_data() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &mixed_plan(&m, 4), "plan.json");
    let run = |args: &[&str], ckpt: &str, metrics: &str| {
        let out = osdp()
            .arg("train")
            .arg(sample("tiny-gpt2"))
            .arg("--plan")
            .arg(&plan)
            .args(args)
            .arg("--checkpoint-dir")
            .arg(dir.path().join(ckpt))
            .arg("--metrics")
            .arg(dir.path().join(metrics))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{args:?}: {err}");
        (losses(&dir.path().join(metrics)), err)
    };
    let recipe = ["--global-batch", "16", "--seed", "5", "--data", "random"];
    let (straight, _) = run(&[&recipe[..], &["--steps", "6"]].concat(), "a", "a.jsonl");
    run(&[&recipe[..], &["--steps", "3"]].concat(), "b", "b.jsonl");
    let (resumed, log) = run(&["--resume", "--steps", "3"], "b", "b.jsonl");
    assert!(
        log.contains("global batch 16 from the checkpoint")
            && log.contains("seed 5 from the checkpoint")
            && log.contains("data random from the checkpoint"),
        "{log}"
    );
    assert_same_losses(&straight, &resumed, "resumed without repeating the flags");
    // An explicit flag wins, and the run says it differs from the checkpoint's.
    let (_, log) = run(&["--resume", "--steps", "1", "--seed", "6"], "b", "b.jsonl");
    assert!(
        log.contains("seed 6 as given (the checkpoint's run used 5)"),
        "{log}"
    );
}

/// Offload among the others (issue 20): linears cycle through dp+offload-opt, zero3+
/// offload-param, zero2+offload-opt, dp+offload-param, zero1+offload-opt, zero3+offload-opt,
/// plain zero3 and dp; other ops through zero3+offload-param, zero2, dp+offload-opt, dp; blocks
/// 1 and 3 recompute. On 2 nodes (`hybrid`), hsdp with each offload joins the linears.
fn offload_plan(m: &ModelSpec, micro_batch: u64, accumulation: u64, hybrid: bool) -> Plan {
    use osdp_core::cost::Offload::{Opt, Param};
    let mut linear = vec![
        Choice::DP.offloaded(Opt),
        Choice::zero3(1, 1).offloaded(Param),
        Choice::plain(Strategy::Zero2).offloaded(Opt),
        Choice::DP.offloaded(Param),
        Choice::plain(Strategy::Zero1).offloaded(Opt),
        Choice::zero3(1, 1).offloaded(Opt),
        Choice::zero3(1, 1),
        Choice::DP,
    ];
    if hybrid {
        let hsdp = Choice::plain(Strategy::Hsdp);
        linear.splice(0..0, [hsdp.offloaded(Opt), hsdp.offloaded(Param)]);
    }
    let other = [
        Choice::zero3(1, 1).offloaded(Param),
        Choice::plain(Strategy::Zero2),
        Choice::DP.offloaded(Opt),
        Choice::DP,
    ];
    let (mut li, mut oi) = (0, 0);
    let choices = m
        .ops
        .iter()
        .map(|o| {
            if !cost::owns_params(o) {
                Choice::NONE
            } else if o.kind == OpKind::Linear {
                li += 1;
                linear[(li - 1) % linear.len()]
            } else {
                oi += 1;
                other[(oi - 1) % other.len()]
            }
        })
        .collect();
    Plan {
        batch: micro_batch,
        accumulation,
        choices,
        recompute: (0..m.config.layers).map(|b| b % 2 == 1).collect(),
        keep_weights: Vec::new(),
    }
}

/// Issue 20: plans mixing offload-opt and offload-param with every other strategy train
/// exactly like one DP rank, on 1, 2 and 4 ranks (and as 2 nodes × 2 with hsdp), with and
/// without gradient accumulation.
#[test]
fn offloading_plans_train_exactly_like_one_dp_rank() {
    for name in ["tiny-gpt2", "tiny-llama"] {
        let m = tiny(name);
        let reference = train(&config(&m, dp_plan(&m), 1, 12));
        for world in [1usize, 2, 4] {
            let per_rank = GLOBAL_BATCH / world as u64;
            for (micro, accumulation) in [(per_rank, 1), (per_rank / 2, 2)] {
                let run = train(&config(
                    &m,
                    offload_plan(&m, micro, accumulation, false),
                    world,
                    12,
                ));
                let what = format!("{name}, {world} ranks, offload plan {micro} × {accumulation}");
                assert_same_losses(&reference.losses, &run.losses, &what);
                assert_same_params(&reference.final_params, &run.final_params, &what);
            }
        }
        let mut cfg = config(&m, offload_plan(&m, 1, 2, true), 4, 12);
        cfg.ranks_per_node = Some(2);
        let run = train(&cfg);
        let what = format!("{name}, 2 nodes × 2 ranks, offload plan with hsdp");
        assert_same_losses(&reference.losses, &run.losses, &what);
        assert_same_params(&reference.final_params, &run.final_params, &what);
    }
}

/// Issue 20: a checkpoint written under an offloading plan resumes under a plain one and the
/// other way round, and the run continues as one.
#[test]
fn offloaded_state_checkpoints_and_resumes_under_other_plans() {
    let m = tiny("tiny-llama");
    let straight = train(&config(&m, dp_plan(&m), 1, 30));
    let dir = tempfile::tempdir().unwrap();
    let resume = |cfg: &mut TrainConfig| {
        cfg.resume_from = Some(
            osdp_train::checkpoint::latest(dir.path())
                .unwrap()
                .expect("a checkpoint"),
        );
        cfg.checkpoint_dir = Some(dir.path().to_path_buf());
    };
    let mut first = config(&m, offload_plan(&m, 4, 1, false), 2, 10);
    first.checkpoint_dir = Some(dir.path().to_path_buf());
    let a = train(&first);
    let mut second = config(&m, mixed_plan(&m, 2), 4, 10);
    resume(&mut second);
    let b = train(&second);
    let mut third = config(&m, offload_plan(&m, 1, 2, false), 4, 10);
    resume(&mut third);
    let c = train(&third);
    assert_eq!((c.first_step, c.last_step), (20, 30));
    let joined: Vec<f64> = [a.losses, b.losses, c.losses].concat();
    assert_same_losses(
        &straight.losses,
        &joined,
        "offload 10 + mixed 10 + offload 10",
    );
    assert_same_params(
        &straight.final_params,
        &c.final_params,
        "offload, mixed, offload",
    );
}

/// `name`'s HF config with a 6,401-token vocabulary: its head's 6,401 rows are not a multiple
/// of 8, and 63 zero rows (under 1 %) make them 6,464, so the trainer pads them.
#[cfg(feature = "fault-injection")]
fn unaligned_vocab(dir: &Path, name: &str) -> (ModelSpec, PathBuf) {
    let hf = root().join(format!("sample-models/hf/{name}.json"));
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&hf).unwrap()).unwrap();
    config["vocab_size"] = 6401.into();
    let opts = model::hf::ImportOptions {
        name: Some(format!("{name}-6401")),
        ..Default::default()
    };
    let m = model::hf::import_str(&hf, &config.to_string(), &opts).expect("imports");
    assert_eq!(cost::padded_gemm_rows(6401), Some(6464));
    let path = dir.join(format!("{name}-6401.json"));
    model::write_model(&path, &m).unwrap();
    (m, path)
}

/// The zero rows the trainer adds to an unaligned head on a GPU (issue 30) change no number.
/// Forced on the CPU (test hook `OSDP_GEMM_PADDING=everywhere`), GPT-2 with its head tied to
/// the embedding, and Llama with its own head sharded and split in two, each under every
/// strategy at once with recompute on 2 ranks, train the same losses as without them; and the
/// run says which weight it pads, where the plain run says nothing. Needs the hook, built only
/// with feature `fault-injection` (scripts/test.sh).
#[cfg(feature = "fault-injection")]
#[test]
fn padding_an_unaligned_head_trains_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["tiny-gpt2", "tiny-llama"] {
        let (m, model) = unaligned_vocab(dir.path(), name);
        let mut plan = mixed_plan(&m, 4);
        let head = m.ops.iter().position(|o| o.id == "lm_head").unwrap();
        if cost::owns_params(&m.ops[head]) {
            plan.choices[head] = Choice::zero3(2, 1);
        }
        let plan = write_plan(dir.path(), &m, &plan, &format!("{name}.plan.json"));
        let run = |pad: &str| {
            let metrics = dir.path().join(format!("{name}-{pad}.jsonl"));
            let out = osdp()
                .env("OSDP_GEMM_PADDING", pad)
                .arg("train")
                .arg(&model)
                .arg("--plan")
                .arg(&plan)
                .args(["--world-size", "2", "--global-batch", "8", "--steps", "4"])
                .args(["--json", "--metrics"])
                .arg(&metrics)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(
                out.status.success(),
                "{name}, OSDP_GEMM_PADDING={pad}: {err}"
            );
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            (losses(&metrics), err, report)
        };
        let (plain, quiet, plain_report) = run("0");
        let (padded, said, padded_report) = run("everywhere");
        assert!(
            said.contains("note: lm_head: its 6,401 weight rows are multiplied with zero rows added up to 6,464"),
            "{name}: {said}"
        );
        assert!(!quiet.contains("zero rows"), "{name}: {quiet}");
        // What the executor's kernels did, not what the model says: the head's forward and
        // backward GEMMs ran padded, and nothing ran padded with padding off.
        assert_eq!(
            padded_report["padded_linears"],
            serde_json::json!([{"op": "lm_head", "rows": 6401, "padded_rows": 6464,
                                "forward": true, "backward": true}]),
            "{name}"
        );
        assert!(
            plain_report.get("padded_linears").is_none(),
            "{name}: {plain_report}"
        );
        assert_eq!(plain.len(), 4, "{name}");
        assert!(plain[3] < plain[0], "{name} learns: {plain:?}");
        assert_same_losses(&plain, &padded, &format!("{name}, padded head"));
    }
}
