//! Integration tests: the CLI as a user runs it, and properties of the model format.

mod bad_input;
#[cfg(feature = "train")]
mod calibrate;
mod dashboard;
#[cfg(feature = "train")]
mod dashboard_train;
#[cfg(feature = "train")]
mod gpu_check;
mod import;
mod plan_cli;
mod planner;
mod roundtrip;
mod snapshots;
#[cfg(feature = "train")]
mod train;

use std::path::{Path, PathBuf};

use assert_cmd::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn osdp() -> Command {
    let mut cmd = Command::cargo_bin("osdp-tui").expect("binary builds");
    cmd.current_dir(root());
    cmd
}

/// Run `cmd`, failing the test with its stderr unless it succeeds; its stdout.
pub fn stdout_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// [`stdout_ok`], parsed as JSON.
pub fn json_ok(cmd: &mut Command) -> serde_json::Value {
    serde_json::from_str(&stdout_ok(cmd)).expect("prints JSON")
}

/// Run `osdp-tui inspect PATH --json` and return the parsed summary.
pub fn inspect_json(path: &Path) -> serde_json::Value {
    let out = osdp()
        .args(["inspect", "--json"])
        .arg(path)
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "inspect {} failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON")
}
