//! `calibrate` and `validate` (feature `train`): a measured layout the planner prices with, and
//! a report of predicted against measured step time and memory.

use std::path::Path;

use assert_cmd::Command;
use osdp_core::cluster::read_layout;

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
    host_figures_are_measured_and_price_offload(dir.path(), &path, &model);
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
    // Plan with h0.mlp.c_fc split into 4 sharded slices, then validate one step of it.
    let split_and_validate = |name: &str, batch: &[&str]| {
        let file = dir.path().join(name);
        stdout_ok(
            on_layout("plan", &model, &path)
                .args(["--budget", "4GiB"])
                .args(batch)
                .args(["--pin", "h0.mlp.c_fc=zero3/4:4", "-o"])
                .arg(&file),
        );
        json_ok(
            on_layout("validate", &model, &path)
                .arg("--plan")
                .arg(&file)
                .args(["--warmup", "0", "--steps", "1", "--json"]),
        )
    };
    let v = split_and_validate("split.json", &["--batch", "2"]);
    for rank in v["measured"]["per_rank"].as_array().unwrap() {
        // Forward gathers 4 slices, backward gathers and reduce-scatters each again.
        assert!(rank["collective_calls"].as_f64().unwrap() >= 12.0, "{rank}");
    }
    // A plan that accumulates runs every micro-batch of its step, as training does (and as the
    // prediction prices it): four micro-batches, four times the split op's collectives.
    let acc = split_and_validate(
        "accumulating.json",
        &["--batch", "1", "--global-batch", "8"],
    );
    assert_eq!(acc["accumulation"], 4, "{acc}");
    for rank in acc["measured"]["per_rank"].as_array().unwrap() {
        assert!(rank["collective_calls"].as_f64().unwrap() >= 48.0, "{rank}");
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

/// Issue 20: the calibrated layout's `host` section holds what calibrate measured on this
/// machine (the offloaded CPU AdamW step per core, the copy between "device" and host tensors),
/// keeps the base layout's host memory, and `plan` / `evaluate` price offload with those
/// figures: making the link and the AdamW rate twice as fast takes exactly half of an offloaded
/// op's host time off the predicted optimizer time. No timings are asserted, only that the
/// figures are positive, plausible and used.
fn host_figures_are_measured_and_price_offload(dir: &Path, path: &Path, model: &Path) {
    use osdp_core::cost::Machine;

    let layout = read_layout(path).expect("a valid layout");
    let host = layout.host.as_ref().expect("a host section");
    let (link, adam) = (&host.link_gb_per_s, &host.adam_mparams_per_s_per_core);
    // Between a slow disk and past any memory bus; between a microcontroller and past any core.
    assert!(link.value > 0.01 && link.value < 1000.0, "{link:?}");
    assert!(adam.value > 0.1 && adam.value < 100_000.0, "{adam:?}");
    for f in [link, adam] {
        assert!(
            f.source.contains("measured by `osdp-tui calibrate`"),
            "{f:?}"
        );
    }
    assert!(adam.source.contains("on one thread alone"), "{adam:?}");
    // Host memory is the base layout's (a budget choice); the cores are this machine's.
    let base = read_layout(&super::root().join("layouts/cpu.json")).unwrap();
    assert_eq!(
        host.memory_gib_per_node,
        base.host.as_ref().unwrap().memory_gib_per_node
    );
    let cores = std::thread::available_parallelism().unwrap().get() as f64;
    assert_eq!(host.cpu_cores_per_node.value, cores);

    // The cost model's host rates are the layout's.
    let spec = osdp_core::model::read_model(model).unwrap();
    let m = Machine::new(&layout, &spec);
    assert_eq!(m.host_link_bytes_per_s, link.value * 1e9);
    let per_rank = adam.value * 1e6 * cores / f64::from(layout.gpus_per_node);
    assert!((m.cpu_adam_params_per_s / per_rank - 1.0).abs() < 1e-12);

    // `plan` prices offload on the calibrated layout: it offloads where asked, and finds
    // host memory for it.
    let op = "h0.mlp.c_fc";
    let p = json_ok(
        on_layout("plan", model, path)
            .args(["--budget", "4GiB", "--batch", "2", "--json"])
            .args(["--pin", &format!("{op}=dp+offload-opt")]),
    );
    let pinned = p["ops"].as_array().unwrap().iter().find(|o| o["id"] == op);
    assert_eq!(pinned.unwrap()["offload"], "offload-opt", "{p}");
    assert!(p["prediction"]["host_bytes"].as_u64().unwrap() > 0);
    // A plan that offloads that op alone: the planner's without offload, the op set by hand.
    let plan_file = dir.join("offload.json");
    stdout_ok(
        on_layout("plan", model, path)
            .args([
                "--budget",
                "4GiB",
                "--batch",
                "2",
                "--host-budget",
                "0",
                "-o",
            ])
            .arg(&plan_file),
    );
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_file).unwrap()).unwrap();
    for o in plan["ops"].as_array_mut().unwrap() {
        assert!(o.get("offload").is_none(), "{o}");
        if o["id"] == op {
            o["strategy"] = "dp".into();
            o["offload"] = "offload-opt".into();
        }
    }
    std::fs::write(&plan_file, plan.to_string()).unwrap();
    // The same plan on a copy of the layout whose host link and AdamW rate are twice as fast.
    let mut fast = layout.clone();
    let h = fast.host.as_mut().unwrap();
    h.link_gb_per_s.value *= 2.0;
    h.adam_mparams_per_s_per_core.value *= 2.0;
    let fast_path = dir.join("fast-host.json");
    std::fs::write(&fast_path, serde_json::to_string(&fast).unwrap()).unwrap();
    let optimizer_s = |layout: &Path| {
        json_ok(
            on_layout("evaluate", model, layout)
                .arg("--plan")
                .arg(&plan_file)
                .arg("--json"),
        )["prediction"]["optimizer_s"]
            .as_f64()
            .unwrap()
    };
    // dp + offload-opt, once a step: the fp32 gradient to the host, AdamW on the CPU tensor by
    // tensor (each at least the calibrated curve's fixed cost, as on the device), the fp32
    // weights back (launch costs are the same on both layouts).
    let spec_op = spec.ops.iter().find(|o| o.id == op).unwrap();
    let params = osdp_core::model::ModelSpec::op_param_count(spec_op) as f64;
    let fixed = m.calibration.as_ref().unwrap().optimizer_s(1);
    let adam_s = |rate: f64| -> f64 {
        spec_op
            .params
            .iter()
            .map(|t| (t.numel() as f64 / rate).max(fixed))
            .sum()
    };
    let rate = m.cpu_adam_params_per_s;
    let expected = 4.0 * params / m.host_link_bytes_per_s + adam_s(rate) - adam_s(2.0 * rate);
    let saved = optimizer_s(path) - optimizer_s(&fast_path);
    assert!(
        (saved / expected - 1.0).abs() < 1e-6,
        "twice as fast a host saves {saved} s; the figures say {expected} s"
    );
}
