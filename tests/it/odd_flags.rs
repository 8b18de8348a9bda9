//! Issue 32, item 5: odd combinations of flags and figures give a right plan or one clear line
//! with a non-zero exit (2 bad input, 3 nothing fits), never a wrong answer, a panic or a
//! budget of 2^64 − 1 bytes.

use std::path::{Path, PathBuf};

use crate::{json_ok, osdp_bounded, refused};

/// `plan sample-models/tiny-gpt2.json --layout cpu ARGS`, bounded as hostile input is.
fn plan(args: &[&str]) -> assert_cmd::Command {
    let mut cmd = osdp_bounded();
    cmd.args(["plan", "sample-models/tiny-gpt2.json", "--layout", "cpu"])
        .args(args);
    cmd
}

/// What a no-answer message must never show: the largest u64, or the size it reads as.
const NO_INFINITE_BUDGET: [&str; 2] = ["18446744073709551615", "EiB"];

fn assert_no_infinite_budget(message: &str) {
    for shown in NO_INFINITE_BUDGET {
        assert!(!message.contains(shown), "{shown} in: {message}");
    }
}

/// `--no-recompute --recompute-block 0=on` planned nothing and named a 16 EiB budget. The fix
/// wins (as `--help` says): block 0 recomputes, the others do not, and the plan fits.
#[test]
fn a_block_fixed_on_recomputes_under_no_recompute() {
    let out = json_ok(&mut plan(&[
        "--no-recompute",
        "--recompute-block",
        "0=on",
        "--json",
    ]));
    let ops = out["ops"].as_array().expect("ops");
    let recomputed = |prefix: &str| -> Vec<bool> {
        ops.iter()
            .filter(|o| o["id"].as_str().unwrap().starts_with(prefix))
            .map(|o| o["recompute"].as_bool().unwrap())
            .collect()
    };
    let (h0, h1) = (recomputed("h0."), recomputed("h1."));
    assert!(!h0.is_empty() && h0.iter().all(|&r| r), "block 0: {h0:?}");
    assert!(!h1.is_empty() && h1.iter().all(|&r| !r), "block 1: {h1:?}");
    let peak = out["peak_memory_bytes"].as_u64().expect("a peak");
    assert!(peak <= 8 << 30, "{peak}");
}

/// `--host-budget 0` with an op pinned to offload planned 792,576 host bytes and exit 0. No plan
/// may pass the host budget: nothing fits (exit 3) and the line says why, in words.
#[test]
fn a_pinned_offload_never_passes_the_host_budget() {
    let pin = ["--pin", "h0.attn.c_attn=zero3+offload-opt"];
    let message = refused(
        &mut plan(&[&pin[..], &["--host-budget", "0"]].concat()),
        3,
        &[
            "no plan of tiny-gpt2 on cpu",
            "pinned to offload",
            "host budget is 0",
        ],
    );
    assert_no_infinite_budget(&message);
    // A host budget under the pinned op's state: nothing fits either.
    let message = refused(
        &mut plan(&[&pin[..], &["--host-budget", "1KiB"]].concat()),
        3,
        // The CPU layout's ranks are processes: budgets are per rank, not per GPU.
        &[
            "more than the host budget of 1.0 KiB per rank",
            "or add ranks",
        ],
    );
    assert_no_infinite_budget(&message);
    // One over it: the plan keeps within it.
    let out = json_ok(&mut plan(
        &[&pin[..], &["--host-budget", "1MiB", "--json"]].concat(),
    ));
    let host = out["prediction"]["host_bytes"]
        .as_u64()
        .expect("host bytes");
    assert!(host > 0 && host <= 1 << 20, "{host}");
}

/// `--global-batch 2^64 − 1` named "nearest … and 0" (an overflow): the range is refused,
/// and a batch within it that the ranks cannot share names two multiples within it.
#[test]
fn a_huge_global_batch_is_refused_by_its_range() {
    // layouts/cpu.json has 2 ranks, each taking at most 2^24 samples a step.
    let most = (2u64 << 24).to_string();
    let message = refused(
        &mut plan(&["--global-batch", "18446744073709551615"]),
        2,
        &[
            "global batch of 18446744073709551615 samples is too large",
            &format!("at most {most} on 2 rank(s)"),
        ],
    );
    assert!(!message.contains("and 0"), "{message}");
    refused(
        &mut plan(&["--global-batch", &((2u64 << 24) - 1).to_string()]),
        2,
        &[&format!(
            "nearest that can are {} and {most}",
            (2u64 << 24) - 2
        )],
    );
    // In tokens (tiny-gpt2's sequences are 128 tokens): the same range, and no overflow.
    refused(
        &mut plan(&["--tokens-per-step", "18446744073709551615"]),
        2,
        &[
            "--tokens-per-step 18446744073709551615 is too large",
            &format!("tokens on 2 rank(s) ({most} sequences of 128)"),
        ],
    );
}

/// tiny-opt's model.json with `config.FIELD` set to `value`, written to `dir`.
fn opt_with(dir: &Path, field: &str, value: u64) -> PathBuf {
    let mut model: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("sample-models/tiny-opt.json")).unwrap(),
    )
    .unwrap();
    model["config"][field] = value.into();
    let path = dir.join(format!("{field}.json"));
    std::fs::write(&path, model.to_string()).unwrap();
    path
}

/// `position_offset` 2^64 − 1 was read and made `train` panic. Config integers are bounded
/// where a model is read: exit 2, one line naming the file and the field.
#[test]
fn config_integers_past_their_bounds_are_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    for (field, value, most) in [
        ("position_offset", u64::MAX, 1u64 << 31),
        ("type_vocab_size", 1 << 40, 1 << 22),
        ("vocab_size", 1 << 40, 1 << 22),
        ("hidden", u64::MAX, 1 << 20),
    ] {
        let path = opt_with(dir.path(), field, value);
        let p = path.to_str().unwrap();
        let needles = [
            p,
            &format!("config.{field}"),
            &format!("{value} "),
            &format!("at most {most}"),
        ];
        refused(osdp_bounded().args(["inspect", p]), 2, &needles);
        // The trainer reads the model before the plan (which need not exist).
        if cfg!(feature = "train") {
            let mut train = osdp_bounded();
            train.args(["train", p, "--steps", "1", "--plan"]);
            refused(train.arg(dir.path().join("plan.json")), 2, &needles);
        }
    }
}

/// A calibrated layout with negative (or unreal) collective figures or steal was accepted.
/// Each is refused when the layout is read, naming the field.
#[test]
fn a_calibration_with_negative_figures_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let calibrated = crate::plan_cli::calibrated_cpu_layout(dir.path(), 0.01);
    let good = || -> serde_json::Value {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&calibrated).unwrap()).unwrap();
        v["calibration"]["cpu_steal_fraction"] = serde_json::json!(0.01);
        v["calibration"]["collectives"] = serde_json::json!([
            { "bytes": 1e3, "seconds": 1e-4, "calls": 5 },
            { "bytes": 1e6, "seconds": 1e-3, "calls": 5 }
        ]);
        v
    };
    let path = dir.path().join("odd.json");
    let p = path.to_str().unwrap();
    std::fs::write(&path, good().to_string()).unwrap();
    crate::stdout_ok(osdp_bounded().args(["layout", p]));
    let cases: [(&str, &str, serde_json::Value, &str); 5] = [
        (
            "collectives",
            "1",
            serde_json::json!({ "bytes": -1e6, "seconds": 1e-3, "calls": 5 }),
            "calibration.collectives[1].bytes",
        ),
        (
            "collectives",
            "1",
            serde_json::json!({ "bytes": 1e6, "seconds": -1e-3, "calls": 5 }),
            "calibration.collectives[1].seconds",
        ),
        (
            "cpu_steal_fraction",
            "",
            serde_json::json!(-0.2),
            "calibration.cpu_steal_fraction",
        ),
        (
            "cpu_steal_fraction",
            "",
            serde_json::json!(3.0),
            "calibration.cpu_steal_fraction",
        ),
        (
            "cpu_steal_fraction",
            "",
            serde_json::json!(1e300),
            "calibration.cpu_steal_fraction",
        ),
    ];
    for (field, index, value, named) in cases {
        let mut v = good();
        match index.parse::<usize>() {
            Ok(i) => v["calibration"][field][i] = value,
            Err(_) => v["calibration"][field] = value,
        }
        std::fs::write(&path, v.to_string()).unwrap();
        refused(osdp_bounded().args(["layout", p]), 2, &[p, named]);
        refused(
            osdp_bounded().args(["plan", "sample-models/tiny-gpt2.json", "--layout", p]),
            2,
            &[p, named],
        );
    }
}
