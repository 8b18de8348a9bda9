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
    // Calibration comes first and fails with its own reason; the smoke test still runs.
    assert_eq!(summary["failures"][0]["step"], "calibrate", "{summary}");
    assert!(
        summary["failures"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("no CUDA device is usable")),
        "{summary}"
    );
    assert_eq!(summary["failures"][1]["step"], "smoke", "{summary}");
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
    let out = Command::new("readelf")
        .args(["-d", env!("CARGO_BIN_EXE_osdp-tui")])
        .output()
        .expect("readelf (binutils) runs");
    let dynamic = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        needed.iter().any(|l| l.contains("[libtorch_cuda.so]")),
        "libtorch_cuda.so is not NEEDED: {needed:#?}"
    );
}
