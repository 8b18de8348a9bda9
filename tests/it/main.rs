//! Integration tests: the CLI as a user runs it, and properties of the model format.

mod bad_input;
#[cfg(feature = "train")]
mod bounds;
#[cfg(feature = "train")]
mod calibrate;
#[cfg(feature = "train")]
mod checkpoints;
mod dashboard;
#[cfg(feature = "train")]
mod dashboard_train;
mod describe;
mod follow;
mod fsdp2;
#[cfg(feature = "train")]
mod gpu_check;
#[cfg(feature = "train")]
mod hf;
mod import;
#[cfg(feature = "train")]
mod ledger;
mod odd_flags;
mod plan_cli;
mod planner;
mod published;
#[cfg(feature = "train")]
mod rendezvous;
mod roundtrip;
mod snapshots;
mod stand_in;
#[cfg(feature = "train")]
mod train;
mod workspace;

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

/// Most memory a refusal of bad input may take (data, as `prlimit --data`): 1 GB for the work,
/// plus, in a trainer build, the ~0.7 GB of writable data segments libtorch's CUDA libraries
/// map before `main` runs (measured: `inspect` aborts under 0.6 GB, runs under 0.8 GB).
pub const REFUSAL_MEMORY_BYTES: u64 = if cfg!(feature = "train") {
    1_800_000_000
} else {
    1_000_000_000
};

/// `osdp-tui` as a hostile input meets it: at most [`REFUSAL_MEMORY_BYTES`] of data
/// (an allocation beyond fails, which a Rust program reports by aborting) and killed after 20 s,
/// generous for a command that should answer in well under a second.
pub fn osdp_bounded() -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("osdp-tui"));
    cmd.current_dir(root());
    // SAFETY: setrlimit is async-signal-safe, and the closure allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: REFUSAL_MEMORY_BYTES as libc::rlim_t,
                rlim_max: REFUSAL_MEMORY_BYTES as libc::rlim_t,
            };
            // The data limit, not the address space: a trainer build maps libtorch's CUDA
            // libraries (gigabytes of code, never resident) before main runs; what a hostile
            // input can make it allocate is data.
            if libc::setrlimit(libc::RLIMIT_DATA, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut cmd = Command::from_std(cmd);
    cmd.timeout(std::time::Duration::from_secs(20));
    cmd
}

/// Run `cmd` and check that it failed the way a user should see: exit `code`, nothing on
/// stdout, one line `error: …` on stderr containing each of `needles`; that line.
pub fn refused(cmd: &mut Command, code: i32, needles: &[&str]) -> String {
    let out = cmd.output().expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let killed = if out.status.code().is_none() {
        " (killed: past the time limit, or aborted at the memory limit)"
    } else {
        ""
    };
    assert_eq!(
        out.status.code(),
        Some(code),
        "{cmd:?}: {}{killed}; stderr: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{cmd:?} panicked: {stderr}");
    assert!(stderr.starts_with("error: "), "{cmd:?}: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "{cmd:?}: one line: {stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{cmd:?}: expected {needle:?} in: {stderr}"
        );
    }
    assert!(out.stdout.is_empty(), "{cmd:?}: nothing on stdout");
    stderr
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
