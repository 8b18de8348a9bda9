//! `status --follow` (issue 32): it ends, and says true things, when the metrics stream is
//! truncated, rewritten or replaced under it, when it is no file, when the run's lock names no
//! one, and when a message is megabytes long.

use std::path::Path;
use std::time::Duration;

use osdp_tui::run::lock::LOCK_FILE;

use crate::dashboard::{stale_lock, STARTED, STEP1, STEP2};
use crate::{osdp, refused};

/// `status --follow` as a child, its stdout read line by line as it comes.
pub struct Follow {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
    seen: Vec<String>,
}

impl Follow {
    pub fn start(run_dir: &Path, json: bool) -> Follow {
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("osdp-tui"));
        cmd.arg("status").arg(run_dir).arg("--follow");
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            text
        });
        Follow {
            child,
            lines,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Lines until one contains `needle`.
    pub fn until(&mut self, needle: &str) {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(20)) {
                Ok(l) => {
                    let found = l.contains(needle);
                    self.seen.push(l);
                    if found {
                        return;
                    }
                }
                Err(_) => panic!("no {needle:?} in:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// Whether it still runs.
    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The exit code, every line printed, and what it wrote to stderr; a failure when it has
    /// not ended within 20 s.
    pub fn finish(mut self) -> (Option<i32>, Vec<String>, String) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("--follow never ended:\n{}", self.seen.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(l);
        }
        let stderr = self.stderr.join().unwrap();
        (status.code(), self.seen, stderr)
    }
}

/// A run directory (no lock) whose metrics stream holds `lines`.
fn run_with(lines: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    dir
}

/// `status RUN --follow` run to its end (killed after 10 s: it must end by itself well
/// before): its exit code, stdout lines and stderr.
fn follow_to_end(dir: &Path) -> (Option<i32>, Vec<String>, String) {
    let out = osdp()
        .arg("status")
        .arg(dir)
        .arg("--follow")
        .timeout(Duration::from_secs(10))
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    (
        out.status.code(),
        stdout.lines().map(str::to_owned).collect(),
        stderr,
    )
}

/// Append `line` to the run's metrics stream, as a worker does.
fn append(dir: &Path, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("metrics.jsonl"))
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

/// Lines of `seen` from the first that contains `from`.
fn from<'a>(seen: &'a [String], from: &str) -> Vec<&'a str> {
    let at = seen
        .iter()
        .position(|l| l.contains(from))
        .unwrap_or(seen.len());
    seen[at..].iter().map(String::as_str).collect()
}

const STOPPED: &str = r#"{"event":"stopped","step":2,"reason":"completed"}"#;
/// Another run's start (another model): a stream beginning with it is another stream.
const STARTED_OTHER: &str = r#"{"event":"started","model":"gpt2-other","world_size":2,"global_batch":4,"first_step":0,"last_step":null,"data":"text","device":"cpu"}"#;

#[test]
fn a_truncated_or_rewritten_stream_is_read_again_from_its_start_until_the_run_stops() {
    let dir = run_with(&[STARTED, STEP1, STEP2]);
    let metrics = dir.path().join("metrics.jsonl");
    let mut text = Follow::start(dir.path(), false);
    text.until("state: running");
    let mut json = Follow::start(dir.path(), true);
    json.until(r#""event":"status""#);

    // Truncated and written again, shorter: read again from its start.
    std::fs::write(&metrics, [STARTED, STEP1].join("\n") + "\n").unwrap();
    text.until("step 1 · loss 4.5000");
    json.until(r#""step":1"#);
    assert_eq!(
        from(&text.seen, "metrics.jsonl was"),
        [
            "metrics.jsonl was truncated: reading it again from its start",
            "started at step 0: 8 rank(s), 8 samples per step",
            "step 1 · loss 4.5000 · 0.200 s/step · 40.0 samples/s · 5.12 k tokens/s",
        ]
    );
    assert!(
        json.seen
            .iter()
            .any(|l| l == r#"{"event":"reread","reread":"truncated"}"#),
        "{:?}",
        json.seen
    );

    // Written over from its start, past where it was read to (never shorter): another
    // stream, told by its first bytes.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&metrics)
        .unwrap();
    std::io::Write::write_all(
        &mut f,
        ([STARTED_OTHER, STEP1, STEP2].join("\n") + "\n").as_bytes(),
    )
    .unwrap();
    drop(f);
    text.until("step 2 · loss 4.2500");
    assert_eq!(
        from(&text.seen, "metrics.jsonl was rewritten")[..2],
        [
            "metrics.jsonl was rewritten: reading it again from its start",
            "started at step 0: 2 rank(s), 4 samples per step",
        ]
    );

    // The new stream ends: so does --follow.
    append(dir.path(), STOPPED);
    let (code, lines, stderr) = text.finish();
    assert_eq!(code, Some(0), "{lines:?} {stderr}");
    assert_eq!(lines.last().unwrap(), "stopped at step 2 (completed)");
    let (code, lines, _) = json.finish();
    assert_eq!(code, Some(0), "{lines:?}");
    assert!(lines.last().unwrap().contains(r#""event":"stopped""#));
}

#[test]
fn a_stream_replaced_by_another_file_is_read_from_the_new_files_start() {
    let dir = run_with(&[STARTED, STEP1]);
    let mut text = Follow::start(dir.path(), false);
    text.until("state: running");
    // The new file begins as the old one did and is longer: only its inode tells it.
    let new = dir.path().join("metrics.new");
    std::fs::write(&new, [STARTED, STEP1, STEP2].join("\n") + "\n").unwrap();
    std::fs::rename(&new, dir.path().join("metrics.jsonl")).unwrap();
    text.until("step 2 · loss 4.2500");
    assert_eq!(
        from(&text.seen, "metrics.jsonl was"),
        [
            "metrics.jsonl was replaced: reading it again from its start",
            "started at step 0: 8 rank(s), 8 samples per step",
            "step 1 · loss 4.5000 · 0.200 s/step · 40.0 samples/s · 5.12 k tokens/s",
            "step 2 · loss 4.2500 · 0.200 s/step · 40.0 samples/s · 5.12 k tokens/s",
        ]
    );
    append(dir.path(), STOPPED);
    let (code, lines, stderr) = text.finish();
    assert_eq!(code, Some(0), "{lines:?} {stderr}");
    assert_eq!(lines.last().unwrap(), "stopped at step 2 (completed)");
}

#[test]
fn a_metrics_stream_that_is_a_directory_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("metrics.jsonl")).unwrap();
    let path = dir.path().join("metrics.jsonl").display().to_string();
    for follow in [false, true] {
        let mut cmd = osdp();
        cmd.arg("status").arg(dir.path());
        if follow {
            cmd.arg("--follow");
        }
        let err = refused(cmd.timeout(Duration::from_secs(10)), 2, &[]);
        assert_eq!(
            err.trim_end(),
            format!(
                "error: {path}: cannot read the run's metrics stream: it is a directory, not a \
                 file"
            )
        );
    }
}

/// A lock file that names no one (empty, garbage, a directory) or names a process that is gone,
/// and no process holds it, on a run whose stream never said it ended: not running, and
/// `--follow` ends at once with exit 4, saying so in one line.
#[test]
fn a_run_whose_lock_no_live_process_holds_ends_follow_with_exit_4() {
    type Make = fn(&Path) -> String;
    let cases: [(&str, Make); 4] = [
        ("empty", |d| {
            std::fs::write(d.join(LOCK_FILE), "").unwrap();
            "is empty".into()
        }),
        ("garbage", |d| {
            std::fs::write(d.join(LOCK_FILE), "\u{0}{\"pid\": garbage").unwrap();
            "holds no lock record".into()
        }),
        ("a directory", |d| {
            std::fs::create_dir(d.join(LOCK_FILE)).unwrap();
            "is a directory".into()
        }),
        ("a record of a process that is gone", |d| {
            let pid = stale_lock(d);
            format!("pid {pid} on ")
        }),
    ];
    for (what, make) in cases {
        let dir = run_with(&[STARTED, STEP1, STEP2]);
        let lock = dir.path().join(LOCK_FILE).display().to_string();
        let said = make(dir.path());
        let problem = format!("{lock} {said}");
        let plain = crate::stdout_ok(osdp().arg("status").arg(dir.path()));
        let state = plain.lines().last().unwrap();
        // Killed (no exit code) if it has not ended within 10 s.
        let (code, lines, stderr) = follow_to_end(dir.path());
        assert_eq!(code, Some(4), "{what}: {lines:?} {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{what}: one line: {stderr}");
        let dir_text = dir.path().display();
        let last = lines.last().unwrap();
        if what.starts_with("a record") {
            assert!(
                state.starts_with(&format!("state: dead: the worker ({said}")),
                "{state}"
            );
            assert!(
                last.starts_with(&format!("dead: the worker ({said}")),
                "{last}"
            );
            assert!(
                stderr.starts_with(&format!(
                    "error: run {dir_text} is no longer running (its last step: 2): its worker \
                     ({said}"
                )),
                "{stderr}"
            );
            continue;
        }
        let text = format!(
            "{problem} and no process holds it, and the run never said it ended: nothing runs \
             it (see worker.log)"
        );
        assert!(
            state.starts_with(&format!("state: not running: {text} · segments")),
            "{what}: {state}"
        );
        assert_eq!(last, &format!("not running: {text}"), "{what}");
        assert_eq!(
            stderr.trim_end(),
            format!(
                "error: run {dir_text} is no longer running (its last step: 2): {problem} and \
                 no process holds it"
            ),
            "{what}"
        );
    }
}

/// A lock file naming no one that a process holds (as a new holder does for a moment before
/// it writes its record) is a run going on: `--follow` waits, and ends when it is let go.
#[test]
fn a_lock_naming_no_one_that_a_process_holds_keeps_follow_going_until_let_go() {
    use std::os::unix::io::AsRawFd;
    let dir = run_with(&[STARTED, STEP1]);
    let lock = std::fs::File::create(dir.path().join(LOCK_FILE)).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let mut text = Follow::start(dir.path(), false);
    text.until("state: running");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(text.running(), "a held lock is a run going on");
    drop(lock);
    let (code, lines, _) = text.finish();
    assert_eq!(code, Some(4), "{lines:?}");
    assert!(
        lines.last().unwrap().starts_with("not running: ")
            && lines
                .last()
                .unwrap()
                .contains("is empty and no process holds it"),
        "{lines:?}"
    );
}

/// Issue 32 item 6: a failure message of 50 MB is echoed as its first 300 characters and how
/// much was left out, by `status`, by `--follow` as the event comes, and in the error line.
#[test]
fn a_huge_failure_message_is_echoed_cut_with_how_much_was_left_out() {
    let dir = run_with(&[STARTED, STEP1]);
    let mut text = Follow::start(dir.path(), false);
    text.until("state: running");
    let message = format!("CUDA error: {}", "x".repeat(50 << 20));
    let failed = serde_json::json!({"event": "failed", "message": message}).to_string();
    append(dir.path(), &failed);
    let kept = &message[..osdp_core::text::EXCERPT_CHARS];
    let note = format!(
        "{kept}… ({} more left out)",
        osdp_core::units::bytes((message.len() - kept.len()) as u64)
    );
    let (code, lines, stderr) = text.finish();
    assert_eq!(code, Some(4));
    assert_eq!(lines.last().unwrap(), &format!("failed: {note}"));
    let dir_text = dir.path().display();
    assert_eq!(
        stderr.trim_end(),
        format!("error: run {dir_text} failed: {note}")
    );

    let plain = crate::stdout_ok(osdp().arg("status").arg(dir.path()));
    assert!(plain.len() < 2000, "{} bytes printed", plain.len());
    assert!(
        plain.contains(&format!("state: failed: {note} · segments")),
        "{plain}"
    );
    let (code, lines, stderr) = follow_to_end(dir.path());
    assert_eq!(code, Some(4));
    assert!(lines.concat().len() < 2000 && stderr.len() < 1000);
    assert!(stderr.ends_with(&format!("{note}\n")), "{stderr}");
}
