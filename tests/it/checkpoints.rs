//! Checkpoint directories against hand edits, a second trainer and `kill -9` (issue 21): an
//! edited manifest is refused with nothing touched, one trainer at a time holds a directory,
//! and a run killed twenty times while it checkpoints resumes to exactly the uninterrupted run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use osdp_train::checkpoint::{self, Manifest};

use super::train::{dp_plan, losses, sample, step_lines, tiny, write_plan};
use super::{refused, root};

/// Run `cmd` and check that it succeeds.
pub(crate) fn succeeds(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cmd` as `refused` takes it.
pub(crate) fn checked(cmd: Command) -> assert_cmd::Command {
    assert_cmd::Command::from_std(cmd)
}

/// `osdp-tui train tiny-gpt2` on a data-parallel plan, 2 samples of random tokens per step,
/// checkpointing into `ckpt`, plus `extra`.
pub(crate) fn train(plan: &Path, ckpt: &Path, extra: &[&str]) -> Command {
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
pub(crate) fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
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
    let mut first = stepping(&mut train(&plan, &ckpt, &["--steps", "0"]), &metrics);
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

/// A seeded generator for the kill times (SplitMix64), so a failure replays.
struct KillClock(u64);

impl KillClock {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn millis_below(&mut self, most: u64) -> Duration {
        Duration::from_millis(self.next() % most)
    }
}

/// The step of the checkpoint `latest.json` names (0 with none), after checking that it and
/// the checkpoint before it verify and that it is not older than `sealed`, the latest seen.
fn check_sealed(ckpt: &Path, sealed: u64, kill: usize) -> u64 {
    let Some(latest) = checkpoint::latest(ckpt).unwrap_or_else(|e| panic!("kill {kill}: {e}"))
    else {
        assert_eq!(sealed, 0, "kill {kill}: latest.json vanished");
        return 0;
    };
    let manifest =
        checkpoint::verify(&latest).unwrap_or_else(|e| panic!("kill {kill}: latest: {e}"));
    assert!(
        manifest.step >= sealed,
        "kill {kill}: latest went back from step {sealed} to {}",
        manifest.step
    );
    // The two newest directories are the ones kept: both whole (an older one may be half
    // pruned, which resuming never offers).
    let all = checkpoint::list(ckpt);
    for (step, path) in all.iter().rev().take(2) {
        checkpoint::verify(path).unwrap_or_else(|e| panic!("kill {kill}: step {step}: {e}"));
    }
    assert!(
        all.iter().rev().take(2).any(|(_, p)| *p == latest),
        "kill {kill}: latest is not among the newest checkpoints"
    );
    manifest.step
}

/// `kill -9` at 20 seeded random times of a run that checkpoints every step, each followed by
/// `--resume`: no sealed checkpoint is ever lost or corrupt, every replayed step's loss is the
/// uninterrupted run's, and so are the final parameters and AdamW moments, bit for bit.
#[test]
fn issue_21_twenty_kills_while_checkpointing_lose_nothing_and_resume_exactly() {
    const KILLS: usize = 20;
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let (ckpt, metrics) = (dir.path().join("killed"), dir.path().join("killed.jsonl"));
    let mut clock = KillClock(21);
    let mut sealed = 0;
    for kill in 1..=KILLS {
        let seen = step_lines(&metrics).len();
        let mut segment = train(&plan, &ckpt, &["--steps", "0", "--checkpoint-every", "1"]);
        segment.arg("--metrics").arg(&metrics);
        if sealed > 0 {
            segment.arg("--resume");
        }
        let mut child = segment
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Most kills land while it trains and checkpoints (after its first step of this
        // segment); one in four at any moment of its start (loading, resuming, locking).
        if clock.next() % 4 == 0 {
            std::thread::sleep(clock.millis_below(1500));
        } else {
            let until = Instant::now() + Duration::from_secs(60);
            while step_lines(&metrics).len() <= seen {
                assert!(Instant::now() < until, "kill {kill}: no step in 60 s");
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("kill {kill}: the run ended by itself: {status}");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(clock.millis_below(400));
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("kill {kill}: the run ended by itself: {status}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        sealed = check_sealed(&ckpt, sealed, kill);
    }
    assert!(sealed > 0, "twenty segments sealed no checkpoint");
    // The last segment runs two more steps and ends by itself.
    let mut last = train(&plan, &ckpt, &["--steps", "2", "--resume"]);
    succeeds(last.arg("--metrics").arg(&metrics));
    let end = sealed + 2;
    assert_eq!(check_sealed(&ckpt, sealed, KILLS + 1), end);

    // The same run, uninterrupted.
    let (straight, straight_metrics) = (dir.path().join("straight"), dir.path().join("s.jsonl"));
    let mut run = train(&plan, &straight, &["--steps", &end.to_string()]);
    succeeds(run.arg("--metrics").arg(&straight_metrics));
    let expected = losses(&straight_metrics);
    assert_eq!(expected.len() as u64, end);
    // Every step the killed run reported, replays included, has the uninterrupted loss, to
    // 1e-5: libtorch's CPU kernels now and then round one step's loss differently in the last
    // bits (about one process in 150 from an unchanged checkpoint, and once on step 4 of an
    // uninterrupted run), killed or not, and that rounding carries into the weights' last bits
    // (seen once, on a machine loaded by other builds). The final state is held to 1e-5 of each
    // tensor's scale: a lost, repeated or half-restored step moves weights and moments by
    // orders of magnitude more (one AdamW step at lr 1e-3 moves a weight of 0.02 by ~5 %).
    // The second moment holds squared gradients, so such a rounding shows in it doubled
    // (seen once: 1.6e-5 of its scale); a lost or repeated step moves it by ~1e-3.
    let mut reported = vec![false; end as usize];
    for line in step_lines(&metrics) {
        let step = line["step"].as_u64().unwrap();
        let (loss, straight) = (line["loss"].as_f64().unwrap(), expected[step as usize - 1]);
        assert!(
            (loss - straight).abs() / straight < 1e-5,
            "step {step}: loss {loss} after kills, {straight} straight"
        );
        reported[step as usize - 1] = true;
    }
    assert!(reported.iter().all(|&r| r), "every step was reported");
    let (_, killed) = checkpoint::load(&checkpoint::latest(&ckpt).unwrap().unwrap()).unwrap();
    let (_, uninterrupted) =
        checkpoint::load(&checkpoint::latest(&straight).unwrap().unwrap()).unwrap();
    assert_eq!(killed.len(), uninterrupted.len());
    for (name, a) in &killed {
        let b = &uninterrupted[name];
        for (what, x, y, tolerance) in [
            ("weights", &a.param, &b.param, 1e-5),
            ("m", &a.m, &b.m, 1e-5),
            ("v", &a.v, &b.v, 2e-5),
        ] {
            assert_eq!(x.len(), y.len(), "{name} {what}");
            let scale = y.iter().fold(0f32, |s, v| s.max(v.abs()));
            let worst = x.iter().zip(y).fold(0f32, |s, (p, q)| s.max((p - q).abs()));
            assert!(
                worst <= tolerance * scale,
                "{name} {what} differ from the uninterrupted run by {worst} (scale {scale})"
            );
        }
    }
}

/// Issue 32: a manifest forged and re-checksummed — an absurd or negative shape, a parameter the
/// model lacks, a step or global batch no run writes — panicked or allocated terabytes. Each is
/// refused with one line naming the field, before any state is allocated, and nothing saved is
/// touched.
#[test]
fn a_forged_but_checksummed_manifest_is_refused_by_the_field_it_forges() {
    let m = tiny("tiny-gpt2");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &m, &dp_plan(&m), "plan.json");
    let ckpt = dir.path().join("ckpt");
    succeeds(&mut train(&plan, &ckpt, &["--steps", "1"]));
    let manifest = ckpt.join("step-00000001/manifest.json");
    let parsed: Manifest =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let (first, shape) = parsed.params.iter().next().unwrap();
    let (first, shape) = (first.clone(), shape.clone());
    let forge = |edit: &dyn Fn(&mut Manifest)| {
        let mut forged = parsed.clone();
        edit(&mut forged);
        forged.manifest_crc32 = Some(forged.checksum());
        std::fs::write(&manifest, serde_json::to_string_pretty(&forged).unwrap()).unwrap();
    };
    let resume = || train(&plan, &ckpt, &["--steps", "1", "--resume"]);
    type Edit<'a> = Box<dyn Fn(&mut Manifest) + 'a>;
    let cases: Vec<(Edit, String)> = vec![
        (
            Box::new(|f: &mut Manifest| {
                f.params.insert(first.clone(), vec![1 << 20, 1 << 20]);
            }),
            format!("says parameter {first:?} has shape [1048576, 1048576]"),
        ),
        (
            Box::new(|f: &mut Manifest| {
                f.params.insert(first.clone(), vec![-4, 8]);
            }),
            format!("says parameter {first:?} has shape [-4, 8]"),
        ),
        (
            Box::new(|f: &mut Manifest| {
                let mut wider = shape.clone();
                wider[0] += 1;
                f.params.insert(first.clone(), wider);
            }),
            format!("says parameter {first:?} has shape"),
        ),
        (
            Box::new(|f: &mut Manifest| {
                f.params.insert("h9.extra.weight".into(), vec![2, 2]);
            }),
            "lists parameter \"h9.extra.weight\", which the model does not have".into(),
        ),
        (
            Box::new(|f: &mut Manifest| f.step = u64::MAX),
            "says step 18446744073709551615".into(),
        ),
        (
            Box::new(|f: &mut Manifest| f.global_batch = 1 << 40),
            "says global batch 1099511627776".into(),
        ),
    ];
    for (edit, needle) in &cases {
        forge(edit.as_ref());
        let before = snapshot(&ckpt);
        refused(
            &mut checked(resume()),
            2,
            &["step-00000001/manifest.json", needle.as_str()],
        );
        assert_eq!(snapshot(&ckpt), before, "nothing saved is touched");
    }
}

/// Start `cmd` (output discarded) writing its metrics to `metrics`, and wait until it has
/// trained a step: the trainer, still running (the test fails after 60 s, or if it ends).
pub(crate) fn stepping(cmd: &mut Command, metrics: &Path) -> std::process::Child {
    let mut child = cmd
        .arg("--metrics")
        .arg(metrics)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    while step_lines(metrics).is_empty() {
        assert!(Instant::now() < until, "the trainer never stepped");
        assert!(child.try_wait().unwrap().is_none(), "the trainer ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}
