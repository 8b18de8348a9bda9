//! The GPU check script on a machine without a GPU: it finds PyTorch, runs the CPU half of its
//! smoke test, reaches the first GPU step and stops there with the trainer's own message,
//! leaving a table and a summary that say what failed.

use std::process::Command;

use crate::root;

#[test]
fn gpu_check_without_a_gpu_reaches_the_cuda_step_and_says_why_it_stops() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(root().join("scripts/gpu-check.sh"))
        .env("OSDP_BIN", env!("CARGO_BIN_EXE_osdp-tui"))
        .args([
            "--models",
            "tiny-gpt2",
            "--smoke-steps",
            "3",
            "--steps",
            "2",
            "--out",
        ])
        .arg(out_dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("CPU done (3 steps); now the GPU"), "{err}");
    // The trainer's one-line reason: a build without GPU support, or no usable GPU.
    assert!(
        err.contains("FAILED smoke") && err.contains("--device cuda"),
        "{err}"
    );
    assert!(err.contains("stopping before the expensive ones"), "{err}");
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.path().join("summary.json")).unwrap(),
    )
    .unwrap();
    // Each failed step, in order, with its own reason; the check goes on after each.
    let failed = |i: usize, step: &str, reason: &str| {
        let f = &summary["failures"][i];
        assert_eq!(f["step"], step, "{summary}");
        assert!(
            f["error"].as_str().is_some_and(|e| e.contains(reason)),
            "{summary}"
        );
    };
    failed(0, "calibrate", "no CUDA device is usable");
    // The local layout needs NVML: without a driver it fails with that reason.
    failed(1, "layout-local", "layout local: no NVIDIA driver");
    assert_eq!(summary["failures"][2]["step"], "smoke", "{summary}");
    let table = std::fs::read_to_string(out_dir.path().join("table.md")).unwrap();
    assert!(table.contains("FAILED smoke"), "{table}");
}

/// A linker that drops "unused" libraries (`--as-needed`) leaves CUDA unavailable without a
/// word: against a CUDA libtorch, the binary must name libtorch_cuda.so as NEEDED.
#[test]
fn the_trainer_binary_needs_libtorch_cuda_when_libtorch_has_it() {
    let lib_dir = std::path::PathBuf::from(env!("OSDP_TORCH_LIB_DIR"));
    if !lib_dir.join("libtorch_cuda.so").exists() {
        eprintln!(
            "a CPU-only libtorch in {}: nothing to link",
            lib_dir.display()
        );
        return;
    }
    let needed = needed(env!("CARGO_BIN_EXE_osdp-tui-trainer"));
    assert!(
        needed.iter().any(|l| l.contains("[libtorch_cuda.so]")),
        "libtorch_cuda.so is not NEEDED: {needed:#?}"
    );
}

/// The shared libraries a binary names as NEEDED (readelf -d).
fn needed(bin: &str) -> Vec<String> {
    let out = Command::new("readelf")
        .args(["-d", bin])
        .output()
        .expect("readelf (binutils) runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .map(str::to_string)
        .collect()
}

/// The planner, the dashboard and `status` load no libtorch: `osdp-tui` names none of its
/// libraries, stays small in memory, and still runs a training run by handing over to
/// `osdp-tui-trainer` beside it.
#[test]
fn osdp_tui_itself_loads_no_libtorch_and_hands_training_to_the_trainer() {
    let needed = needed(env!("CARGO_BIN_EXE_osdp-tui"));
    assert!(
        !needed
            .iter()
            .any(|l| l.contains("torch") || l.contains("c10")),
        "osdp-tui links libtorch: {needed:#?}"
    );
    // Planning gpt2-xl and drawing the dashboard in 400 MB of address space: a binary that
    // links libtorch cannot even start in it (its CUDA libraries map ~2.7 GB; before the
    // split, `plan` held ~465 MiB resident).
    for args in [
        &[
            "plan",
            "sample-models/gpt2-xl.json",
            "--layout",
            "a100-80gb-8x-nvlink",
        ][..],
        &["sample-models/gpt2-xl.json", "--once"][..],
    ] {
        let out = in_address_space(env!("CARGO_BIN_EXE_osdp-tui"), 400_000_000)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let trainer = in_address_space(env!("CARGO_BIN_EXE_osdp-tui-trainer"), 400_000_000)
        .arg("--version")
        .output()
        .unwrap();
    assert!(!trainer.status.success(), "the limit would catch libtorch");

    // `train` through osdp-tui is the trainer's: it checks the plan file as the trainer does.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_osdp-tui"))
        .args(["train", "sample-models/tiny-gpt2.json", "--plan"])
        .arg(dir.path().join("no-such-plan.json"))
        .current_dir(root())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no-such-plan.json"), "{err}");
}

/// A command run from the project root with at most `bytes` of address space (RLIMIT_AS).
fn in_address_space(bin: &str, bytes: u64) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(bin);
    cmd.current_dir(root());
    // SAFETY: setrlimit is async-signal-safe, and the closure allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes as libc::rlim_t,
                rlim_max: bytes as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}
