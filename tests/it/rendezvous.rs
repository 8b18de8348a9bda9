//! The TCP rendezvous of rank processes against strangers on its port and against ranks started
//! with other settings (issue 21, item 1): the run token keeps strangers out, the join's
//! deadline holds whatever they send, and ranks that disagree are refused by name. Issue 32,
//! item 2: the token is required and never crosses the wire (a squatter on the port learns
//! nothing and starts no one), and past the join a stopped rank ends the run at the deadline.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use super::train::{free_port, one_step_args, rank_process};

/// Rank `rank` of 2 as a process, with `token` (none: unset) and `extra` arguments.
fn rank(r: usize, port: u16, args: &[OsString], extra: &[&str], token: Option<&str>) -> Child {
    let mut all: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    all.extend(extra.iter().map(OsStr::new));
    let mut cmd = rank_process(r, 2, port, &all);
    cmd.env_remove("OSDP_RUN_TOKEN");
    if let Some(t) = token {
        cmd.env("OSDP_RUN_TOKEN", t);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

/// Wait for rank 0 to listen on `port`.
fn listening(port: u16) {
    let until = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "rank 0 never listened on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The process's last line on stderr, checked to be an `error:` line, after a non-zero exit.
fn failed(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected a failure: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err.trim_end().lines().last().unwrap_or("").to_string();
    assert!(last.starts_with("error: "), "{err}");
    last
}

/// The join's first bytes as a stranger may send them: magic, protocol 3, rank 1, world 2, a
/// terms length, then a nonce and a seal (zeros).
fn hello_head(terms_len: u32) -> Vec<u8> {
    let mut head: Vec<u8> = [0x05D9_7C01u32, 3, 1, 2, terms_len]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    head.resize(20 + 64, 0);
    head
}

#[test]
fn issue_21_strangers_on_the_rendezvous_port_cannot_stop_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("run.jsonl");
    let mut args = one_step_args(dir.path());
    args.extend(["--metrics".into(), metrics.clone().into()]);
    let port = free_port();
    let r0 = rank(0, port, &args, &[], Some("right"));
    listening(port);
    // A stranger that says nothing and stays, one that speaks HTTP, one announcing a hello of
    // 4 GiB, one speaking the old handshake with a 1 TiB tensor behind it.
    let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _silent = connect();
    let _ = connect().write_all(b"GET / HTTP/1.1\r\n\r\n");
    let _ = connect().write_all(&hello_head(u32::MAX));
    let mut old = connect();
    let mut old_hello: Vec<u8> = [0x05D9_7C01u32, 1, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    old_hello.push(0);
    old_hello.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let _ = old.write_all(&old_hello);
    // A rank process of another run (another token) is refused at once, by name.
    let started = Instant::now();
    let stray = rank(1, port, &args, &[], Some("wrong"))
        .wait_with_output()
        .unwrap();
    let line = failed(&stray);
    assert!(line.contains("run token"), "{line}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "refused quickly"
    );
    // The real rank 1 joins and the run completes.
    let r1 = rank(1, port, &args, &[], Some("right"));
    for (r, child) in [(0, r0), (1, r1)] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.contains("\"event\":\"step\""), "{text}");
    // The stranger speaking an older handshake got rank 0's challenge, then one refusal that
    // names the protocols (its 1 TiB tensor never read), and was hung up on.
    let mut rest = Vec::new();
    let _ = old.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = old.read_to_end(&mut rest);
    let said = String::from_utf8_lossy(&rest[(8 + 32).min(rest.len())..]).into_owned();
    assert!(
        said.ends_with(
            "rank 0 speaks join protocol 3, this process 1: run the same osdp-tui on every rank"
        ),
        "{said:?}"
    );
}

#[test]
fn issue_21_a_join_among_strangers_fails_within_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let args = one_step_args(dir.path());
    let port = free_port();
    let started = Instant::now();
    let mut all: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    all.push(OsStr::new("--lr"));
    all.push(OsStr::new("0.001"));
    let r0 = rank_process(0, 2, port, &all)
        .env("OSDP_JOIN_TIMEOUT_S", "2")
        .env("OSDP_RUN_TOKEN", "right")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    listening(port);
    let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _silent: Vec<TcpStream> = (0..20).map(|_| connect()).collect();
    let mut huge = connect();
    let _ = huge.write_all(&hello_head(1 << 30));
    let out = r0.wait_with_output().unwrap();
    let took = started.elapsed();
    let line = failed(&out);
    assert!(
        line.contains("rank(s) 1 did not join") && line.contains("within 2 s"),
        "{line}"
    );
    assert!(line.contains("turned away"), "{line}");
    // Start-up (loading libtorch and the model) plus the 2 s deadline.
    assert!(
        took < Duration::from_secs(20),
        "the deadline held: {took:?}"
    );
}

/// Run ranks 0 and 1 with their own extra arguments; their last error lines.
fn disagreeing(extra0: &[&str], extra1: &[&str]) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let args = one_step_args(dir.path());
    let port = free_port();
    let r0 = rank(0, port, &args, extra0, Some("t"));
    let r1 = rank(1, port, &args, extra1, Some("t"));
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    (failed(&o0), failed(&o1))
}

#[test]
fn issue_21_a_rank_started_with_another_lr_is_refused_with_the_field_named() {
    let (e0, e1) = disagreeing(&["--lr", "0.0003"], &["--lr", "0.001"]);
    let said = "rank 1 has lr 0.001, rank 0 has 0.0003";
    assert_eq!(e1, format!("error: rank 0 refused this rank: {said}"));
    assert_eq!(e0, format!("error: the ranks disagree: {said}"));
}

#[test]
fn issue_21_a_rank_started_with_another_seed_is_refused_with_the_field_named() {
    let (e0, e1) = disagreeing(&["--seed", "1"], &["--seed", "2"]);
    assert!(e1.contains("rank 1 has seed 2, rank 0 has 1"), "{e1}");
    assert!(e0.contains("rank 1 has seed 2, rank 0 has 1"), "{e0}");
}

#[test]
fn issue_32_a_rank_without_the_run_token_is_refused_before_it_joins() {
    let dir = tempfile::tempdir().unwrap();
    let args = one_step_args(dir.path());
    let started = Instant::now();
    let out = rank(1, free_port(), &args, &[], None)
        .wait_with_output()
        .unwrap();
    let line = failed(&out);
    assert!(line.contains("OSDP_RUN_TOKEN is not set"), "{line}");
    assert_eq!(out.status.code(), Some(2), "{line}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Read exactly `n` bytes from `s` (the test fails after 20 s).
fn read_n(mut s: &TcpStream, n: usize) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

#[test]
fn issue_32_a_squatter_on_the_port_learns_nothing_and_starts_no_one() {
    let dir = tempfile::tempdir().unwrap();
    let args = one_step_args(dir.path());
    let port = free_port();
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let token = "the-real-secret-of-this-run";
    let r1 = rank(1, port, &args, &[], Some(token));
    let (s, _) = squatter.accept().unwrap();
    // It plays rank 0: a challenge, then reads the whole hello.
    let mut challenge: Vec<u8> = [0x05D9_7C01u32, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    challenge.extend_from_slice(&[7; 32]);
    (&s).write_all(&challenge).unwrap();
    let mut hello = read_n(&s, 84);
    let terms_len = u32::from_le_bytes(hello[16..20].try_into().unwrap()) as usize;
    hello.extend(read_n(&s, terms_len));
    let text = String::from_utf8_lossy(&hello);
    assert!(!text.contains(token), "the token crossed the wire: {text}");
    // It welcomes the rank with a seal it had to guess.
    let mut welcome: Vec<u8> = [0x05D9_7C01u32, 0, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    welcome.extend_from_slice(&[0; 32]);
    (&s).write_all(&welcome).unwrap();
    let line = failed(&r1.wait_with_output().unwrap());
    assert!(
        line.contains("without proving it holds the run token"),
        "{line}"
    );
}

/// Send `signal` to process `pid`.
fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

#[test]
fn issue_32_a_stopped_rank_ends_the_run_at_the_deadline_with_its_checkpoint_intact() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("run.jsonl");
    let ckpt = dir.path().join("ckpt");
    let mut args = one_step_args(dir.path());
    // Train until stopped, sealing a checkpoint every step.
    args[5] = "0".into();
    args.extend(["--checkpoint-every".into(), "1".into()]);
    args.extend(["--checkpoint-dir".into(), ckpt.clone().into()]);
    let port = free_port();
    let mut with_metrics = args.clone();
    with_metrics.extend(["--metrics".into(), metrics.clone().into()]);
    let deadline = ["OSDP_COLLECTIVE_TIMEOUT_S", "3"];
    let spawn = |r: usize, a: &[OsString]| {
        let refs: Vec<&OsStr> = a.iter().map(|a| a.as_os_str()).collect();
        rank_process(r, 2, port, &refs)
            .env(deadline[0], deadline[1])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let r0 = spawn(0, &with_metrics);
    let mut r1 = spawn(1, &args);
    let until = Instant::now() + Duration::from_secs(60);
    while super::train::step_lines(&metrics).len() < 2 {
        assert!(Instant::now() < until, "no steps in 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(r1.id(), libc::SIGSTOP);
    let stopped = Instant::now();
    let out = r0.wait_with_output().unwrap();
    let took = stopped.elapsed();
    signal(r1.id(), libc::SIGKILL);
    let _ = r1.wait();
    let line = failed(&out);
    assert!(line.contains("rank 1 sent nothing for 3 s"), "{line}");
    assert!(
        took < Duration::from_secs(15),
        "the deadline held: {took:?}"
    );
    // The last sealed checkpoint is whole: a run resumes from it.
    let latest = osdp_train::checkpoint::latest(&ckpt).unwrap().unwrap();
    assert!(osdp_train::checkpoint::load(&latest).is_ok(), "{latest:?}");
}
