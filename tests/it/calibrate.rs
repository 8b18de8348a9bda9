//! `calibrate` and `validate` (feature `train`): a measured layout the planner prices with, and
//! a report of predicted against measured step time and memory.

use std::path::Path;

use assert_cmd::Command;
use osdp_tui::cluster::read_layout;

use super::{json_ok, osdp, stdout_ok};

/// `osdp-tui SUB MODEL --layout LAYOUT`, more arguments to follow.
fn on_layout(sub: &str, model: &Path, layout: &Path) -> Command {
    let mut cmd = osdp();
    cmd.arg(sub).arg(model).arg("--layout").arg(layout);
    cmd
}

fn calibrate_quick(dir: &std::path::Path) -> std::path::PathBuf {
    let layout = dir.join("local-cpu.json");
    let stdout = stdout_ok(
        osdp()
            .args(["calibrate", "--quick", "--ranks", "2", "-o"])
            .arg(&layout),
    );
    assert!(stdout.contains("kernel curves"), "{stdout}");
    layout
}

#[test]
fn calibrate_writes_a_layout_that_plan_and_validate_price_with() {
    let dir = tempfile::tempdir().unwrap();
    let path = calibrate_quick(dir.path());

    // The layout reads back as a valid one, named after the file, with a curve for every
    // operator kind the built-in models run and the date it was measured.
    let layout = read_layout(&path).expect("a valid layout");
    assert_eq!(layout.name, "local-cpu");
    assert_eq!(layout.world_size(), 2);
    let cal = layout.calibration.as_ref().expect("a calibration section");
    for key in [
        "linear",
        "attention",
        "layer_norm",
        "rms_norm",
        "embedding",
        "positional_embedding",
        "add",
        "cross_entropy",
        "activation/gelu_tanh",
        "activation/silu_gated",
        "linear/split",
    ] {
        let pts = cal
            .kernels
            .get(key)
            .unwrap_or_else(|| panic!("no {key} curve"));
        assert!(
            pts.iter().all(|p| p.work > 0.0 && p.fwd_s > 0.0),
            "{key}: {pts:?}"
        );
    }
    // Split slices are timed at a quarter of the linears' work, below the plain curve.
    let smallest = |key: &str| cal.kernels[key].first().map_or(0.0, |p| p.work);
    assert!(smallest("linear/split") < smallest("linear"));
    assert!(cal.measured_at.starts_with("20") && cal.measured_at.ends_with('Z'));
    assert!(cal.optimizer.len() >= 2 && cal.optimizer.iter().all(|p| p.seconds > 0.0));
    assert!(
        !cal.collectives.is_empty(),
        "collectives timed inside training steps"
    );
    assert!(layout
        .device
        .memory_bandwidth_gb_per_s
        .source
        .contains("measured"));

    // `plan` says its prices are the calibration's, in words and in JSON.
    let model = super::root().join("sample-models/tiny-gpt2.json");
    let plan_file = dir.path().join("plan.json");
    let text = stdout_ok(
        on_layout("plan", &model, &path)
            .args(["--budget", "4GiB", "--batch", "2", "-o"])
            .arg(&plan_file),
    );
    assert!(text.contains("prices: calibrated"), "{text}");
    let v = json_ok(on_layout("plan", &model, &path).args(["--budget", "4GiB", "--json"]));
    assert!(v["timing_source"]
        .as_str()
        .unwrap()
        .starts_with("calibrated"));
    let d = json_ok(
        on_layout("plan", &model, Path::new("layouts/cpu.json"))
            .args(["--budget", "4GiB", "--json"]),
    );
    assert!(d["timing_source"]
        .as_str()
        .unwrap()
        .contains("not calibrated"));

    // `validate` runs the plan and sets measured figures beside the predicted ones. Memory is
    // the executor's own ledger, so it must agree with the prediction within 10 %.
    let v = json_ok(
        on_layout("validate", &model, &path)
            .arg("--plan")
            .arg(&plan_file)
            .args(["--warmup", "1", "--steps", "2", "--repeat", "2", "--json"]),
    );
    assert_eq!(v["ranks"], 2);
    // How much CPU the hypervisor took meanwhile (Linux reports it).
    assert!(v["cpu_steal_fraction"]
        .as_f64()
        .is_some_and(|f| (0.0..=1.0).contains(&f)));
    assert_eq!(
        v["measured"]["step_time_s_per_repeat"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert!(v["measured"]["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(v["predicted"]["step_time_s"].as_f64().unwrap() > 0.0);
    let mem = v["ratio"]["peak_memory"].as_f64().unwrap();
    assert!(
        (0.9..=1.1).contains(&mem),
        "peak memory measured/predicted {mem}"
    );
    // At the peak (the end of forward) a plan without recomputation holds what the model
    // description says forward keeps.
    let (m_act, p_act) = (
        v["measured"]["activation_bytes"].as_f64().unwrap(),
        v["predicted"]["activation_bytes"].as_f64().unwrap(),
    );
    assert!(
        (m_act / p_act - 1.0).abs() < 0.01,
        "activations {m_act} vs {p_act}"
    );

    // A sharded, split op's collectives are told apart from its compute: counted per rank and
    // compared as a row of their own.
    let split_plan = dir.path().join("split.json");
    stdout_ok(
        on_layout("plan", &model, &path)
            .args(["--budget", "4GiB", "--batch", "2"])
            .args(["--pin", "h0.mlp.c_fc=zero3/4:4", "-o"])
            .arg(&split_plan),
    );
    let v = json_ok(
        on_layout("validate", &model, &path)
            .arg("--plan")
            .arg(&split_plan)
            .args(["--warmup", "0", "--steps", "1", "--json"]),
    );
    for rank in v["measured"]["per_rank"].as_array().unwrap() {
        // Forward gathers 4 slices, backward gathers and reduce-scatters each again.
        assert!(rank["collective_calls"].as_f64().unwrap() >= 12.0, "{rank}");
    }
    let coll = &v["collectives"];
    assert!(coll["measured_s"].as_f64().unwrap() > 0.0, "{coll}");
    assert!(coll["predicted_s"].as_f64().unwrap() > 0.0, "{coll}");
    // Compute per kind and the collectives split the operators' time without a gap or an
    // overlap (one timed step: no medians to blur the sum).
    let kinds: f64 = v["compute_by_kind"]
        .as_object()
        .unwrap()
        .values()
        .map(|k| k["measured_s"].as_f64().unwrap())
        .sum();
    let ops = v["measured"]["operators_s"].as_f64().unwrap();
    let parts = kinds + coll["measured_s"].as_f64().unwrap();
    assert!((parts / ops - 1.0).abs() < 1e-9, "{parts} vs {ops}");

    // The human table names each category.
    let out = on_layout("validate", &model, &path)
        .arg("--plan")
        .arg(&plan_file)
        .args(["--warmup", "0", "--steps", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for row in [
        "step time",
        "optimizer",
        "peak memory per rank",
        "activations",
    ] {
        assert!(text.contains(row), "no {row:?} row in\n{text}");
    }
}

#[test]
fn validate_refuses_gpu_layouts_and_plans_of_other_models() {
    let dir = tempfile::tempdir().unwrap();
    let plan_file = dir.path().join("plan.json");
    osdp()
        .args([
            "plan",
            "sample-models/tiny-llama.json",
            "--layout",
            "layouts/cpu.json",
            "--budget",
            "4GiB",
            "-o",
        ])
        .arg(&plan_file)
        .assert()
        .success();
    let out = osdp()
        .args([
            "validate",
            "sample-models/tiny-llama.json",
            "--layout",
            "layouts/h100-1x.json",
            "--plan",
        ])
        .arg(&plan_file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("GPU layout"));
    let out = osdp()
        .args([
            "validate",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "layouts/cpu.json",
            "--plan",
        ])
        .arg(&plan_file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!out.stderr.is_empty());
}

#[test]
fn calibrate_checks_its_output_and_models_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let out = osdp()
        .args(["calibrate", "-o"])
        .arg(dir.path().join("no/such/dir/local.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    // A model the trainer cannot run is refused by name.
    let out = osdp()
        .args([
            "calibrate",
            "--model",
            "sample-models/bert-large-uncased.json",
            "-o",
        ])
        .arg(dir.path().join("local.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bert-large-uncased"), "{err}");
    assert!(!dir.path().join("local.json").exists());
}
