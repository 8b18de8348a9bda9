//! Issue 32, items 6 and 7: what would panic, hang or exhaust the host is refused up front with
//! one line and exit 2 (thousands of rank threads, a validation the host's memory cannot hold,
//! a step count past the last step, a launcher's world contradicting `--world-size`, an output
//! `calibrate` cannot write); and what a killed checkpoint writer leaves is removed by the next
//! run that holds the directory, and nothing else is.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use osdp_train::checkpoint;

use super::checkpoints::{checked, snapshot, stepping, train};
use super::train::{dp_plan, tiny, write_plan};
use super::{osdp_bounded, refused};

/// Longest a training command of these tests may take: a regression is a hang.
const RUN_LIMIT: Duration = Duration::from_secs(180);

/// `cmd` as [`refused`] takes it, killed after 20 s (a refusal answers in about one).
fn bounded(cmd: Command) -> assert_cmd::Command {
    let mut cmd = checked(cmd);
    cmd.timeout(Duration::from_secs(20));
    cmd
}

/// Run `cmd` (killed after [`RUN_LIMIT`]), check that it succeeds; its stderr.
fn ok(cmd: Command) -> String {
    let out = checked(cmd).timeout(RUN_LIMIT).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{}: {stderr}", out.status);
    stderr
}

/// The most rank threads `osdp-tui` runs here: 8 per core, as the trainer counts them.
fn rank_thread_limit() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()) * 8
}

/// A tiny-gpt2 data-parallel plan in `dir`.
fn tiny_plan(dir: &Path) -> PathBuf {
    let m = tiny("tiny-gpt2");
    write_plan(dir, &m, &dp_plan(&m), "plan.json")
}

#[test]
fn thousands_of_rank_threads_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let started = Instant::now();
    refused(
        osdp_bounded()
            .args(["train", "sample-models/tiny-gpt2.json", "--plan"])
            .arg(&plan)
            .args(["--world-size", "4096", "--steps", "1"]),
        2,
        &[
            "--world-size 4096: 4096 ranks as threads of one process are too many here: at most",
            "train with fewer ranks, or as one process per rank over several machines",
        ],
    );

    // A CPU layout of 4096 ranks, validated: each rank would be a thread.
    let mut layout: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("layouts/cpu.json")).unwrap(),
    )
    .unwrap();
    layout["gpus_per_node"] = 4096.into();
    let big = dir.path().join("big.json");
    std::fs::write(&big, layout.to_string()).unwrap();
    refused(
        osdp_bounded()
            .args(["validate", "sample-models/tiny-gpt2.json", "--plan"])
            .arg(&plan)
            .arg("--layout")
            .arg(&big),
        2,
        &[
            "big.json: 4096 ranks as threads of one process are too many here",
            "validate a layout of fewer ranks",
        ],
    );

    // calibrate --ranks: past what its parser takes, then (on a machine of under 8 cores)
    // past this machine's limit.
    let out = dir.path().join("out.json");
    let calibrate = |ranks: usize| {
        let mut cmd = osdp_bounded();
        cmd.args(["calibrate", "--quick", "--ranks", &ranks.to_string(), "-o"])
            .arg(&out);
        cmd
    };
    refused(&mut calibrate(4096), 2, &["--ranks", "4096"]);
    let over = rank_thread_limit() + 1;
    if over <= 64 {
        refused(
            &mut calibrate(over),
            2,
            &[
                &format!("--ranks {over}: {over} ranks as threads of one process are too many"),
                "calibrate fewer ranks",
            ],
        );
    }
    assert!(!out.exists(), "nothing written");
    assert!(started.elapsed() < Duration::from_secs(60), "at once");
}

/// llama-2-7b data-parallel at micro-batch 64 on the CPU layout's two ranks needs terabytes:
/// refused with the figure and the host's, before a byte of it is allocated (the command runs
/// under a memory limit far below it).
#[test]
fn validating_more_than_the_host_holds_is_refused_with_both_figures() {
    let m = tiny("llama-2-7b");
    let dir = tempfile::tempdir().unwrap();
    let mut plan = dp_plan(&m);
    plan.batch = 64;
    let plan = write_plan(dir.path(), &m, &plan, "plan.json");
    let line = refused(
        osdp_bounded()
            .args([
                "validate",
                "sample-models/llama-2-7b.json",
                "--layout",
                "cpu",
            ])
            .args(["--steps", "1", "--warmup", "0", "--plan"])
            .arg(&plan),
        2,
        &[
            "llama-2-7b on 2 rank(s) needs about ",
            " per rank, as predicted), and this machine has ",
            " available: validate a smaller model, or a plan made with --budget ",
        ],
    );
    assert!(line.contains(" TiB of memory"), "terabytes: {line}");
}

#[test]
fn steps_past_the_last_step_are_refused_and_nothing_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ckpt = dir.path().join("ckpt");
    ok(train(&plan, &ckpt, &["--steps", "1"]));
    let before = snapshot(&ckpt);
    let most = u64::MAX.to_string();
    refused(
        &mut bounded(train(&plan, &ckpt, &["--resume", "--steps", &most])),
        2,
        &[
            &format!("--steps {most} from step 1 would end past step 281474976710656"),
            "give fewer steps, or --steps 0 to run until stopped",
        ],
    );
    assert_eq!(snapshot(&ckpt), before, "nothing saved is touched");
    // From the start too, and the largest that fits still resumes.
    refused(
        &mut bounded(train(&plan, &dir.path().join("fresh"), &["--steps", &most])),
        2,
        &[&format!("--steps {most} from step 0 would end past step")],
    );
    let mut resumed = train(&plan, &ckpt, &["--resume", "--steps", "1"]);
    resumed.arg("--json");
    ok(resumed);
    assert!(checkpoint::latest(&ckpt)
        .unwrap()
        .unwrap()
        .ends_with("step-00000002"));
}

#[test]
fn a_launcher_world_that_contradicts_world_size_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    for launcher in ["1", "3"] {
        refused(
            osdp_bounded()
                .env("WORLD_SIZE", launcher)
                .env("RANK", "0")
                .env("OSDP_RUN_TOKEN", "t")
                .args(["train", "sample-models/tiny-gpt2.json", "--plan"])
                .arg(&plan)
                .args(["--world-size", "2", "--steps", "1"]),
            2,
            &[&format!(
                "--world-size 2 disagrees with the launcher's WORLD_SIZE {launcher} (from the \
                 environment)"
            )],
        );
    }
}

#[test]
fn calibrate_refuses_an_output_it_cannot_write_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let calibrate = |out: &Path| {
        let mut cmd = osdp_bounded();
        cmd.args(["calibrate", "--quick", "-o"]).arg(out);
        cmd
    };
    // Measuring takes longer than the 20 s the command is given: a refusal after it fails.
    refused(
        &mut calibrate(dir.path()),
        2,
        &["-o ", "cannot write: it is a directory; give a file name"],
    );
    let fifo = dir.path().join("fifo.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    refused(&mut calibrate(&fifo), 2, &["cannot write: it is a FIFO"]);
    // A directory this user may not write (root may write any).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        use std::os::unix::fs::PermissionsExt;
        let locked = dir.path().join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
        refused(
            &mut calibrate(&locked.join("out.json")),
            2,
            &["cannot write: ", "ermission denied"],
        );
    }
    let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert!(entries.len() <= 2, "nothing left beside: {entries:?}");
}

/// Write `files` (paths under `root`, with their bytes), making their directories.
fn plant(root: &Path, files: &[(&str, &[u8])]) {
    for (name, bytes) in files {
        let path = root.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

/// The names directly under `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A `.latest.json` temp file as a writer killed before its rename leaves it.
const LATEST_TMP: &str = ".latest.json.tmp-4242-0-000000001";

/// The debris a resumed run removes, beside what it must not: sealed checkpoints, a step after
/// the latest, names the trainer does not write, a directory holding a file it does not write,
/// a symbolic link. A run that is refused touches none of it.
#[test]
fn resuming_removes_what_killed_checkpoints_left_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ckpt = dir.path().join("ckpt");
    ok(train(
        &plan,
        &ckpt,
        &["--steps", "4", "--checkpoint-every", "2"],
    ));
    let rank = std::fs::read(ckpt.join("step-00000002/rank-00000.safetensors")).unwrap();
    let debris = [
        "step-00000001",
        "step-00000003",
        LATEST_TMP,
        ".tmp-step-00000007",
    ];
    std::fs::create_dir(ckpt.join("step-00000001")).unwrap();
    plant(
        &ckpt,
        &[
            // Half removed by a pruning or replacing that was killed.
            ("step-00000003/rank-00000.safetensors", &rank),
            (LATEST_TMP, b"{\"version\":1,"),
            // Never committed.
            (".tmp-step-00000007/rank-00000.safetensors", &rank),
            (".tmp-step-00000007/manifest.json", b"{}"),
            (
                ".tmp-step-00000007/.manifest.json.tmp-4242-1-000000002",
                b"{",
            ),
            // Not provably debris.
            ("step-00000000/notes.txt", b"mine"),
            ("step-00000009/rank-00000.safetensors", &rank),
            ("step-00000001-old/rank-00000.safetensors", &rank),
            ("step-0000001/rank-00000.safetensors", &rank),
            (".latest.json.tmp-mine", b"mine"),
            ("notes.txt", b"mine"),
            ("../elsewhere/rank-00000.safetensors", &rank),
        ],
    );
    std::os::unix::fs::symlink(
        dir.path().join("elsewhere"),
        ckpt.join(".tmp-step-00000008"),
    )
    .unwrap();
    let everything = names(&ckpt);
    refused(
        &mut bounded(train(&plan, &ckpt, &["--steps", "1"])),
        2,
        &["already holds checkpoints", "pass --resume"],
    );
    assert_eq!(names(&ckpt), everything, "a refused run removes nothing");

    let sealed = snapshot(&ckpt.join("step-00000004"));
    let elsewhere = snapshot(&dir.path().join("elsewhere"));
    let stderr = ok(train(&plan, &ckpt, &["--resume", "--steps", "1"]));
    assert!(
        stderr.contains(&format!(
            "note: removed what interrupted checkpoints left in {}: ",
            ckpt.display()
        )),
        "{stderr}"
    );
    let left = names(&ckpt);
    for gone in debris {
        assert!(!left.iter().any(|n| n == gone), "{gone} is left: {left:?}");
    }
    // step-00000002 went as the oldest of three sealed checkpoints, as ever.
    let expected: Vec<String> = everything
        .iter()
        .filter(|n| !debris.contains(&n.as_str()) && *n != "step-00000002")
        .cloned()
        .chain(["step-00000005".to_string()])
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(left, expected);
    assert_eq!(snapshot(&ckpt.join("step-00000004")), sealed, "untouched");
    assert_eq!(snapshot(&dir.path().join("elsewhere")), elsewhere);
    assert_eq!(
        std::fs::read(ckpt.join("step-00000000/notes.txt")).unwrap(),
        b"mine"
    );
    checkpoint::verify(&ckpt.join("step-00000005")).unwrap();
    ok(train(&plan, &ckpt, &["--resume", "--steps", "1"]));
    assert!(checkpoint::latest(&ckpt)
        .unwrap()
        .unwrap()
        .ends_with("step-00000006"));
}

/// A run killed while writing its first checkpoint leaves a `.tmp-step-…` and no
/// `latest.json`; a half-removed step folder beside it cannot be proven debris until a
/// checkpoint is sealed after it. The next run removes the first at its start and the second
/// with its first checkpoint.
#[cfg(feature = "fault-injection")]
#[test]
fn a_killed_first_checkpoint_is_cleared_by_the_next_run_and_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ckpt = dir.path().join("ckpt");
    let mut killed = train(&plan, &ckpt, &["--steps", "2", "--checkpoint-every", "1"]);
    killed.env("OSDP_FAULT", "kill-mid-checkpoint");
    let out = checked(killed).timeout(RUN_LIMIT).output().unwrap();
    assert!(!out.status.success(), "the fault ends the process");
    assert!(ckpt
        .join(".tmp-step-00000001/rank-00000.safetensors")
        .is_file());
    assert!(checkpoint::latest(&ckpt).unwrap().is_none());
    let rank = std::fs::read(ckpt.join(".tmp-step-00000001/rank-00000.safetensors")).unwrap();
    plant(&ckpt, &[("step-00000001/rank-00000.safetensors", &rank)]);

    ok(train(&plan, &ckpt, &["--steps", "2"]));
    assert_eq!(names(&ckpt), ["latest.json", "step-00000002"]);
    checkpoint::verify(&ckpt.join("step-00000002")).unwrap();
    ok(train(&plan, &ckpt, &["--resume", "--steps", "1"]));
}

/// While a trainer holds the directory, a second one (refused) removes nothing, though the
/// debris is plain; the holder's next checkpoint removes it.
#[test]
fn only_the_trainer_holding_the_directory_removes_debris() {
    let dir = tempfile::tempdir().unwrap();
    let plan = tiny_plan(dir.path());
    let ckpt = dir.path().join("ckpt");
    let metrics = dir.path().join("run.jsonl");
    // Sealed: steps 2 and 3 (step 1 pruned).
    ok(train(
        &plan,
        &ckpt,
        &["--steps", "3", "--checkpoint-every", "1"],
    ));
    let mut first = stepping(
        &mut train(&plan, &ckpt, &["--resume", "--steps", "0"]),
        &metrics,
    );
    std::fs::create_dir(ckpt.join("step-00000001")).unwrap();
    plant(&ckpt, &[(LATEST_TMP, b"{")]);
    let everything = names(&ckpt);
    refused(
        &mut bounded(train(&plan, &ckpt, &["--resume", "--steps", "1"])),
        2,
        &["is in use by pid"],
    );
    assert_eq!(names(&ckpt), everything, "the second removes nothing");
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + RUN_LIMIT;
    let status = loop {
        if let Some(status) = first.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the first never stopped");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    let left = names(&ckpt);
    assert!(
        !left.contains(&"step-00000001".to_string()) && !left.contains(&LATEST_TMP.to_string()),
        "{left:?}"
    );
}
