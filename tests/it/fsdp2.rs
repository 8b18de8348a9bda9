//! Planning for PyTorch FSDP2 (`plan --target fsdp2`), exporting a plan for it (`export --to
//! fsdp2`), and running the export with `osdp_torch` (the Python package in `python/`).

use osdp_core::cost::{Choice, Machine, Offload, Strategy};
use osdp_core::model::ModelSpec;
use osdp_core::plan::{evaluate, PlanOptions, Planner, Target};
use proptest::prelude::*;

use crate::planner::{all_plans_where, machine, offload_machine, small_model, LAYOUTS};

/// Every plan at `batch` whose choices FSDP2 can run (whole modules, no zero1, offload only of
/// parameters): (peak, samples/s).
fn all_fsdp2_plans(
    model: &ModelSpec,
    m: &Machine,
    (batch, accumulation): (u64, u64),
    max_split: u32,
) -> Vec<(u64, f64)> {
    let fsdp2 =
        |c: Choice| c.split == 1 && c.strategy != Strategy::Zero1 && c.offload != Offload::Opt;
    all_plans_where(
        model,
        m,
        &[(batch, accumulation)],
        max_split,
        &|_| true,
        &fsdp2,
    )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// The Python `OSDP_TEST_PYTHON` names (scripts/test.sh sets it, with torch and transformers);
/// `None`, with a note that the test is skipped, where it is unset.
pub(crate) fn test_python() -> Option<std::ffi::OsString> {
    let python = std::env::var_os("OSDP_TEST_PYTHON");
    if python.is_none() {
        eprintln!("skipped: OSDP_TEST_PYTHON is not set (scripts/test.sh sets it)");
    }
    python
}

/// `python python/tests/SCRIPT ARGS…`: its standard output, once it exits 0 (the test fails
/// with both streams otherwise).
pub(crate) fn python_ok(
    python: &std::ffi::OsStr,
    script: &str,
    args: &[&dyn AsRef<std::ffi::OsStr>],
) -> String {
    let out = std::process::Command::new(python)
        .arg(crate::root().join("python/tests").join(script))
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `plan MODEL --layout LAYOUT --target fsdp2 FLAGS… -o DIR/p.json`, then `export` of that plan
/// `--to fsdp2 -o DIR/e.json`: the export, parsed.
pub(crate) fn plan_and_export(
    dir: &std::path::Path,
    model: &std::path::Path,
    layout: impl AsRef<std::ffi::OsStr>,
    flags: &[&str],
) -> serde_json::Value {
    let (plan, export) = (dir.join("p.json"), dir.join("e.json"));
    crate::osdp()
        .arg("plan")
        .arg(model)
        .arg("--layout")
        .arg(layout.as_ref())
        .args(["--target", "fsdp2"])
        .args(flags)
        .arg("-o")
        .arg(&plan)
        .assert()
        .success();
    crate::osdp()
        .arg("export")
        .arg(model)
        .arg("--plan")
        .arg(&plan)
        .arg("--layout")
        .arg(layout.as_ref())
        .args(["--to", "fsdp2", "-o"])
        .arg(&export)
        .assert()
        .success();
    serde_json::from_str(&std::fs::read_to_string(&export).unwrap()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Under `--target fsdp2` the planner is exact over the plans FSDP2 can run, priced as
    /// FSDP2 runs them (with splitting allowed, on one and two nodes, with and without a host
    /// to offload to, with and without accumulation), and never chooses one it cannot.
    #[test]
    fn fsdp2_planner_matches_exhaustive_search_over_what_fsdp2_runs(
        hidden in prop::sample::select(vec![64u64, 256, 1024]),
        seq in prop::sample::select(vec![16u64, 128]),
        (blocks, tied) in prop::sample::select(vec![(1u64, false), (1, true), (2, true)]),
        layout in prop::sample::select(LAYOUTS.iter().copied().chain(["host"]).collect::<Vec<_>>()),
        batch in 1u64..=2,
        accumulation in 1u64..=2,
        budget_frac in 0.0f64..1.0,
    ) {
        let model = small_model(hidden, seq, 64, blocks, tied);
        let mut m = match layout {
            "host" => offload_machine(&model, u64::MAX / 4),
            name => machine(name, &model),
        };
        m.set_target(Target::Fsdp2, &model);
        let plans = all_fsdp2_plans(&model, &m, (batch, accumulation), 4);
        let (lo, hi) = plans.iter().fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
        let budget = lo + ((hi - lo) as f64 * budget_frac) as u64;
        let want = plans.iter().filter(|p| p.0 <= budget).map(|p| p.1).reduce(f64::max).unwrap();
        let options = PlanOptions {
            batch: Some(batch),
            global_batch: Some(batch * accumulation * u64::from(m.ranks)),
            max_split: 4,
            target: Target::Fsdp2,
            ..Default::default()
        };
        let got = Planner::new(&model, m.clone(), options, budget).best(budget).expect("fits");
        prop_assert!(got.prediction.peak_memory_bytes <= budget);
        prop_assert!(close(got.prediction.throughput_samples_per_s, want),
            "planner {} vs exhaustive {want}", got.prediction.throughput_samples_per_s);
        for c in &got.plan.choices {
            prop_assert!(Target::Fsdp2.allows(*c).is_ok(), "{}", c.label());
        }
        prop_assert_eq!(evaluate(&model, &m, &got.plan), got.prediction);
    }
}

/// `plan --target fsdp2 -o` then `export --to fsdp2`: one entry per module with parameters,
/// named by its module path; a plan with a split op is refused in one line naming the op.
#[test]
fn export_writes_module_paths_and_refuses_a_split_plan() {
    let dir = tempfile::tempdir().unwrap();
    let (plan, export) = (dir.path().join("p.json"), dir.path().join("e.json"));
    crate::osdp()
        .args([
            "plan",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "cpu",
            "--target",
            "fsdp2",
        ])
        .args([
            "--global-batch",
            "8",
            "--pin",
            "h0.mlp.c_fc=zero2",
            "--pin",
            "wpe=dp",
        ])
        .args(["--recompute-block", "1=on", "-o"])
        .arg(&plan)
        .assert()
        .success();
    crate::osdp()
        .args([
            "export",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "cpu",
            "--to",
            "fsdp2",
        ])
        .arg("--plan")
        .arg(&plan)
        .arg("-o")
        .arg(&export)
        .assert()
        .success();
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&export).unwrap()).unwrap();
    assert_eq!(e["target"], "fsdp2");
    assert_eq!(e["global_batch"], 8);
    assert_eq!(e["checkpoint"], serde_json::json!(["transformer.h.1"]));
    let modules = e["modules"].as_array().unwrap();
    let find = |p: &str| modules.iter().find(|m| m["path"] == p).unwrap();
    assert_eq!(find("transformer.h.0.mlp.c_fc")["sharding"], "zero2");
    assert_eq!(
        find("transformer.h.0.mlp.c_fc")["reshard_after_forward"],
        false
    );
    assert_eq!(find("transformer.wpe")["mesh"], serde_json::json!([2, 1]));

    let split = dir.path().join("split.json");
    crate::osdp()
        .args([
            "plan",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "cpu",
            "--global-batch",
            "8",
        ])
        .args(["--pin", "h2.attn.c_attn=zero3/2:1", "-o"])
        .arg(&split)
        .assert()
        .success();
    let out = crate::osdp()
        .args([
            "export",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "cpu",
            "--to",
            "fsdp2",
        ])
        .arg("--plan")
        .arg(&split)
        .arg("-o")
        .arg(dir.path().join("x.json"))
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("op \"h2.attn.c_attn\" is zero3/2:1"), "{err}");
    assert!(!dir.path().join("x.json").exists());
}

/// A plan made for FSDP2 is priced as FSDP2 runs it everywhere: `plan --target fsdp2`,
/// `evaluate` of its file (which records the target) and the export's predicted figures agree.
/// Under accumulation FSDP2 keeps every module's unsharded gradient between micro-batches, so
/// the same choices priced for osdp-tui's trainer peak lower; and a plan file for FSDP2 with a
/// choice FSDP2 cannot run is refused, naming the op.
#[test]
fn plan_evaluate_and_export_price_an_fsdp2_plan_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (plan, export) = (dir.path().join("p.json"), dir.path().join("e.json"));
    let model = "sample-models/gpt2-xl.json";
    let layout = ["--layout", "a100-80gb-8x-nvlink"];
    let json = |out: std::process::Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let planned = json(
        crate::osdp()
            .args(["plan", model])
            .args(layout)
            .args(["--target", "fsdp2", "--global-batch", "512", "--json", "-o"])
            .arg(&plan)
            .output()
            .unwrap(),
    );
    assert!(planned["accumulation"].as_u64().unwrap() > 1, "{planned}");
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(file["target"], "fsdp2");
    let evaluate = |path: &std::path::Path| {
        json(
            crate::osdp()
                .args(["evaluate", model])
                .args(layout)
                .arg("--plan")
                .arg(path)
                .arg("--json")
                .output()
                .unwrap(),
        )
    };
    let evaluated = evaluate(&plan);
    for field in [
        "peak_memory_bytes",
        "throughput_samples_per_s",
        "step_time_s",
    ] {
        assert_eq!(evaluated[field], planned[field], "{field}");
    }
    crate::osdp()
        .args(["export", model])
        .args(layout)
        .arg("--plan")
        .arg(&plan)
        .args(["--to", "fsdp2", "-o"])
        .arg(&export)
        .assert()
        .success();
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&export).unwrap()).unwrap();
    assert_eq!(
        e["predicted"]["peak_memory_bytes"],
        planned["peak_memory_bytes"]
    );
    assert_eq!(e["predicted"]["step_time_s"], planned["step_time_s"]);

    // The same choices for osdp-tui's trainer: no unsharded gradients held across micro-batches.
    let mut mine = file.clone();
    mine.as_object_mut().unwrap().remove("target");
    let osdp = dir.path().join("osdp.json");
    std::fs::write(&osdp, mine.to_string()).unwrap();
    let trainer = evaluate(&osdp);
    assert!(
        trainer["peak_memory_bytes"].as_u64() < planned["peak_memory_bytes"].as_u64(),
        "trainer {} vs fsdp2 {}",
        trainer["peak_memory_bytes"],
        planned["peak_memory_bytes"]
    );

    let mut forged = file;
    forged["ops"][0]["strategy"] = "zero1".into();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, forged.to_string()).unwrap();
    let out = crate::osdp()
        .args(["evaluate", model])
        .args(layout)
        .arg("--plan")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("ops[0]") && err.contains("zero1") && err.contains("fsdp2"),
        "{err}"
    );
}

/// A tiny random GPT-2 (transformers' own), planned for FSDP2 with pins forcing zero3, zero2,
/// dp, a recomputed block and one `+offload-param` module, exported, and trained 5 steps in
/// fp32 on 2 gloo ranks by `osdp_torch.apply_plan`: every loss equals one process training
/// the same global batch without FSDP (1e-5 relative), each rank's local shards take the
/// predicted parameter bytes, and an export naming a module the model lacks, or applied to
/// another model, is refused naming the module.
/// Needs OSDP_TEST_PYTHON (torch and transformers; scripts/test.sh sets it); skipped without.
#[test]
fn a_gpt2_export_trains_under_fsdp2_as_one_process_does() {
    let Some(python) = test_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    std::fs::write(
        at("tiny.json"),
        r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256,
            "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new", "tie_word_embeddings": true,
            "bos_token_id": 0, "eos_token_id": 0}"#,
    )
    .unwrap();
    crate::osdp()
        .args(["import-hf"])
        .arg(at("tiny.json"))
        .arg("-o")
        .arg(at("m.json"))
        .assert()
        .success();
    let mut bad = plan_and_export(
        dir.path(),
        &at("m.json"),
        "cpu",
        &[
            "--global-batch",
            "8",
            "--batch",
            "2",
            "--pin",
            "h0.attn.c_attn=zero3",
            "--pin",
            "h0.mlp.c_fc=zero2",
            "--pin",
            "wpe=dp",
            "--pin",
            "h1.mlp.c_proj=zero3+offload-param",
            "--recompute-block",
            "1=on",
        ],
    );
    bad["modules"][3]["path"] = "transformer.h.0.attn.c_nope".into();
    std::fs::write(at("bad.json"), bad.to_string()).unwrap();
    let stdout = python_ok(
        &python,
        "fsdp2_gpt2.py",
        &[&at("tiny.json"), &at("e.json"), &at("bad.json")],
    );
    assert!(stdout.contains("losses ok"), "{stdout}");
    assert!(stdout.contains("shard bytes ok"), "{stdout}");
    assert!(
        stdout.contains("refused: ") && stdout.contains("'transformer.h.0.attn.c_nope'"),
        "{stdout}"
    );
    assert!(
        stdout.contains("refused other model: module 'transformer.wte' has 32768 parameters"),
        "{stdout}"
    );
}

/// The same for a tiny random LLaMA (grouped-query attention, gated MLP, RMSNorm, untied
/// head): planned for FSDP2 with pins forcing zero3, zero2, dp, a recomputed block and one
/// `+offload-param` module, exported, and trained 5 steps in fp32 on 2 gloo ranks: every loss
/// equals one process's (1e-5 relative) and each rank's local shards take the predicted
/// parameter bytes.
/// Needs OSDP_TEST_PYTHON (torch and transformers; scripts/test.sh sets it); skipped without.
#[test]
fn a_llama_export_trains_under_fsdp2_as_one_process_does() {
    let Some(python) = test_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    std::fs::write(
        at("tiny.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
            "max_position_embeddings": 32, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": false, "hidden_act": "silu", "bos_token_id": 0,
            "eos_token_id": 0}"#,
    )
    .unwrap();
    crate::osdp()
        .args(["import-hf"])
        .arg(at("tiny.json"))
        .arg("-o")
        .arg(at("m.json"))
        .assert()
        .success();
    let e = plan_and_export(
        dir.path(),
        &at("m.json"),
        "cpu",
        &[
            "--global-batch",
            "8",
            "--batch",
            "2",
            "--pin",
            "layers0.self_attn.q_proj=zero3",
            "--pin",
            "layers0.mlp.up_proj=zero2",
            "--pin",
            "embed_tokens=dp",
            "--pin",
            "layers1.mlp.down_proj=zero3+offload-param",
            "--recompute-block",
            "1=on",
        ],
    );
    assert_eq!(e["checkpoint"], serde_json::json!(["model.layers.1"]));
    let stdout = python_ok(&python, "fsdp2_gpt2.py", &[&at("tiny.json"), &at("e.json")]);
    assert!(stdout.contains("losses ok"), "{stdout}");
    assert!(stdout.contains("shard bytes ok"), "{stdout}");
}

/// A Hugging Face model imported for osdp-tui's own kernels and planned for FSDP2 is flagged
/// (FSDP2 runs PyTorch's eager modules, which keep more), by `plan` and by `export`; imported
/// with `--kernels pytorch` it is not, and its plan predicts more activation memory.
#[test]
fn a_model_priced_for_osdps_kernels_is_flagged_when_planned_for_fsdp2() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 96,
        "max_position_embeddings": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )
    .unwrap();
    let mut peaks = Vec::new();
    for kernels in ["osdp", "pytorch"] {
        let (model, plan) = (
            dir.path().join(format!("{kernels}.json")),
            dir.path().join(format!("{kernels}-plan.json")),
        );
        crate::osdp()
            .arg("import-hf")
            .arg(&config)
            .args(["--kernels", kernels, "-o"])
            .arg(&model)
            .assert()
            .success();
        let planned = crate::osdp()
            .arg("plan")
            .arg(&model)
            .args([
                "--layout",
                "cpu",
                "--target",
                "fsdp2",
                "--global-batch",
                "8",
            ])
            .args(["--pin", "layers0.mlp.up_proj=zero3", "-o"])
            .arg(&plan)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let exported = crate::osdp()
            .arg("export")
            .arg(&model)
            .args(["--layout", "cpu", "--to", "fsdp2", "--plan"])
            .arg(&plan)
            .arg("-o")
            .arg(dir.path().join(format!("{kernels}-export.json")))
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        for out in [planned, exported] {
            let out = String::from_utf8(out).unwrap();
            assert_eq!(
                out.contains("import-hf --kernels pytorch"),
                kernels == "osdp",
                "{kernels}: {out}"
            );
        }
        let export = dir.path().join(format!("{kernels}-export.json"));
        let e: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&export).unwrap()).unwrap();
        peaks.push(e["predicted"]["peak_memory_bytes"].as_u64().unwrap());
    }
    assert!(peaks[1] > peaks[0], "{peaks:?}");
}
