//! Checkpoint directories against hand edits and a second trainer (issue 21): an edited
//! manifest is refused with nothing touched, and one trainer at a time holds a directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use osdp_tui::train::checkpoint::{self, Manifest};

use super::train::{dp_plan, sample, step_lines, tiny, write_plan};
use super::{refused, root};

/// Run `cmd` and check that it succeeds.
fn succeeds(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cmd` as `refused` takes it.
fn checked(cmd: Command) -> assert_cmd::Command {
    assert_cmd::Command::from_std(cmd)
}

/// `osdp-tui train tiny-gpt2` on a data-parallel plan, 2 samples of random tokens per step,
/// checkpointing into `ckpt`, plus `extra`.
fn train(plan: &Path, ckpt: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(assert_cmd::cargo::cargo_bin("osdp-tui"));
    cmd.current_dir(root())
        .arg("train")
        .arg(sample("tiny-gpt2"))
        .arg("--plan")
        .arg(plan)
        .args(["--global-batch", "2", "--data", "random", "--seed", "7"])
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .args(extra);
    cmd
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else {
                out.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

#[test]
fn issue_21_an_edited_manifest_is_refused_and_nothing_saved_is_touched() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let ckpt = dir.path().join("ckpt");
    let two_ranks = [
        "--world-size",
        "2",
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
    ];
    succeeds(&mut train(&plan, &ckpt, &two_ranks));
    let manifest = ckpt.join("step-00000002/manifest.json");
    let original = std::fs::read_to_string(&manifest).unwrap();
    let resume = || {
        train(
            &plan,
            &ckpt,
            &["--world-size", "2", "--steps", "1", "--resume"],
        )
    };
    let parsed: Manifest = serde_json::from_str(&original).unwrap();
    assert_eq!(parsed.manifest_crc32, Some(parsed.checksum()));

    // Rank 0's file listed twice, the checksum made to match: rank 1's state would be zeros.
    let mut twice = parsed.clone();
    twice.files[1] = twice.files[0].clone();
    twice.manifest_crc32 = Some(twice.checksum());
    std::fs::write(&manifest, serde_json::to_string_pretty(&twice).unwrap()).unwrap();
    let before = snapshot(&ckpt);
    refused(
        &mut checked(resume()),
        2,
        &[
            "step-00000002/manifest.json",
            "lists rank-00000.safetensors twice",
            "resume from it with --resume-from",
        ],
    );
    assert_eq!(snapshot(&ckpt), before, "nothing saved is touched");

    // One rank's file left out: as refused.
    let mut short = parsed.clone();
    short.files.pop();
    short.manifest_crc32 = Some(short.checksum());
    std::fs::write(&manifest, serde_json::to_string_pretty(&short).unwrap()).unwrap();
    refused(
        &mut checked(resume()),
        2,
        &["lists no file for rank 1 of 2 (rank-00001.safetensors)"],
    );

    // A hand edit that leaves the checksum as it was.
    let edited = original.replace("\"global_batch\": 2", "\"global_batch\": 4");
    assert_ne!(edited, original);
    std::fs::write(&manifest, &edited).unwrap();
    let before = snapshot(&ckpt);
    refused(
        &mut checked(resume()),
        2,
        &["manifest.json: does not match its checksum (edited or damaged)"],
    );
    assert_eq!(snapshot(&ckpt), before, "nothing saved is touched");

    // A checkpoint of format version 1 (no checksum) still resumes.
    let mut old = parsed;
    old.version = 1;
    old.manifest_crc32 = None;
    std::fs::write(&manifest, serde_json::to_string_pretty(&old).unwrap()).unwrap();
    succeeds(&mut resume());
    let sealed = checkpoint::verify(&ckpt.join("step-00000003")).unwrap();
    assert_eq!(sealed.version, checkpoint::CHECKPOINT_FORMAT_VERSION);
}

#[test]
fn issue_21_a_second_trainer_on_a_checkpoint_directory_is_refused_at_once() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let ckpt = dir.path().join("ckpt");
    let metrics = dir.path().join("run.jsonl");
    // The first runs until stopped.
    let mut first = train(&plan, &ckpt, &["--steps", "0"]);
    first.arg("--metrics").arg(&metrics);
    let mut first = first
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    while step_lines(&metrics).is_empty() {
        assert!(Instant::now() < until, "the first trainer never stepped");
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first trainer ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = first.id();
    let in_use = format!(
        "checkpoint directory {} is in use by pid {pid} (started ",
        ckpt.display()
    );
    for extra in [&["--steps", "1", "--resume"][..], &["--steps", "1"][..]] {
        let started = Instant::now();
        refused(
            &mut checked(train(&plan, &ckpt, extra)),
            2,
            &[&in_use, " UTC)"],
        );
        assert!(started.elapsed() < Duration::from_secs(10), "at once");
    }
    // Stopped, the first lets go, and the directory resumes.
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    assert!(first.wait().unwrap().success());
    succeeds(&mut train(&plan, &ckpt, &["--steps", "1", "--resume"]));
}
