//! The one-way rule as the compiler sees it: the core crate (model, cluster, prices, planner,
//! worker protocol) builds with none of the terminal, GPU, libtorch or OS crates in its tree,
//! and the trainer never reaches the terminal or the app.

use std::process::Command;

/// Names of the crates in `package`'s dependency tree (`cargo tree`; on a machine that built
/// only the default members, cargo fetches the trainer's crates' manifests first).
fn crates_in_tree(package: &str, extra: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--package", package])
        .args(["--prefix", "none", "--format", "{p}"])
        .args(extra)
        .current_dir(super::root())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

fn assert_tree(package: &str, extra: &[&str], needs: &[&str], banned: &[&str]) {
    let names = crates_in_tree(package, extra);
    for n in needs {
        assert!(
            names.iter().any(|c| c == n),
            "{package} lacks {n}: {names:?}"
        );
    }
    for b in banned {
        assert!(
            !names.iter().any(|c| c == b),
            "{package} depends on {b}: {names:?}"
        );
    }
}

#[test]
fn the_core_crate_holds_no_terminal_gpu_libtorch_or_os_crate() {
    assert_tree(
        "osdp-core",
        &["--edges", "normal,build"],
        &["osdp-core", "serde"],
        &[
            "ratatui",
            "crossterm",
            "tokio",
            "nvml-wrapper",
            "tch",
            "torch-sys",
            "cudarc",
            "clap",
            // Locks, signals and processes are the app's and the trainer's.
            "libc",
        ],
    );
}

#[test]
fn the_trainer_crate_never_reaches_the_terminal_or_the_app() {
    assert_tree(
        "osdp-train",
        &["--edges", "normal", "--features", "cuda"],
        &["tch", "cudarc", "osdp-core"],
        &["ratatui", "crossterm", "tokio", "clap", "osdp-tui"],
    );
}
