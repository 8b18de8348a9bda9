//! The dashboard: its text rendering, its keys, and what it says when things are missing.

use osdp_tui::cluster::read_layout;
use osdp_tui::model::read_model;
use osdp_tui::monitor::{GpuEvent, GpuSample};
use osdp_tui::tui::app::{Action, App, Focus, Row};
use osdp_tui::tui::render_text;

use crate::{osdp, root, stdout_ok};

const GIB: u64 = 1 << 30;

fn app(model: &str, layout: &str, budget: u64) -> App {
    let m = read_model(&root().join(format!("sample-models/{model}.json"))).unwrap();
    let l = read_layout(&root().join(format!("layouts/{layout}.json"))).unwrap();
    let n = l.world_size() as usize;
    let mut a = App::new(m, l, vec![budget; n], 8);
    a.replan();
    a
}

fn throughput(a: &App) -> f64 {
    a.planned()
        .expect("a plan fits")
        .prediction
        .throughput_samples_per_s
}

#[test]
fn once_prints_the_screen_without_a_terminal() {
    let screen = stdout_ok(osdp().args([
        "sample-models/gpt2.json",
        "--layout",
        "layouts/a100-80gb-8x-nvlink.json",
        "--budget",
        "8GiB",
        "--once",
    ]));
    for needle in [
        "gpt2 (124.4 M params, 126 ops) on a100-80gb-8x-nvlink",
        "samples/s",
        "peak",
        "vs FSDP",
        "operators",
        "h0.attn.c_attn",
        "GPUs",
        "samples/s vs budget",
    ] {
        assert!(
            screen.contains(needle),
            "{needle:?} missing from:\n{screen}"
        );
    }
    assert!(screen.lines().count() >= 40);
}

#[test]
fn without_a_layout_it_says_what_it_plans_for() {
    let out = osdp()
        .args(["sample-models/tiny-gpt2.json", "--once"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let screen = String::from_utf8(out.stdout).unwrap();
    assert!(
        screen.contains("planning for layout h100-sxm-8x-nvlink"),
        "{screen}"
    );
}

#[test]
fn lowering_the_budget_replans_within_it() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 12 * GIB);
    let before = throughput(&a);
    for _ in 0..6 {
        a.update(Action::LowerBudget);
    }
    assert_eq!(a.budget(), 6 * GIB);
    let p = &a.planned().unwrap().prediction;
    assert!(p.peak_memory_bytes <= 6 * GIB);
    assert!(throughput(&a) < before, "half the memory, fewer samples/s");
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("/ 6.0 GiB"), "{screen}");
}

#[test]
fn an_impossible_budget_shows_the_smallest_that_fits() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 3 * GIB);
    a.update(Action::LowerBudget);
    a.update(Action::LowerBudget);
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("nothing fits 1.0 GiB per GPU; the smallest budget that fits is"),
        "{screen}"
    );
}

#[test]
fn gpu_focus_changes_one_gpus_budget() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 10 * GIB);
    a.update(Action::FocusNext);
    assert_eq!(a.focus, Focus::Gpus);
    a.update(Action::Down);
    a.update(Action::Down);
    a.update(Action::LowerBudget);
    assert_eq!(a.budgets[2], 9 * GIB);
    assert_eq!(a.budgets[0], 10 * GIB);
    assert_eq!(a.budget(), 9 * GIB, "the tightest GPU binds");
}

#[test]
fn blocks_expand_and_ops_can_be_pinned() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 8 * GIB);
    let rows = a.rows().len();
    // Move to block 1's header and expand it.
    let target = a.rows().iter().position(|r| *r == Row::Block(1)).unwrap();
    assert_eq!(
        a.selected(),
        Some(Row::Block(0)),
        "the cursor starts on block 0"
    );
    for _ in a.selected_row..target {
        a.update(Action::Down);
    }
    a.update(Action::Toggle);
    assert_eq!(a.rows().len(), rows + 10);
    a.update(Action::Down);
    let Some(Row::Op(op)) = a.selected() else {
        panic!("an op is selected")
    };
    assert_eq!(a.model.ops[op].id, "h1.ln_1");
    a.update(Action::CyclePin);
    let plan = &a.planned().unwrap().plan;
    assert_eq!(plan.choices[op].label(), "dp");
    a.update(Action::CyclePin);
    let plan = &a.planned().unwrap().plan;
    assert_eq!(plan.choices[op].label(), "zero1");
}

#[test]
fn split_limit_and_batch_keys_replan() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 8 * GIB);
    a.update(Action::SplitDown);
    assert_eq!(a.max_split, 4);
    a.update(Action::CycleBatch);
    assert_eq!(a.batch, Some(1));
    assert_eq!(a.planned().unwrap().prediction.batch_size, 1);
}

#[test]
fn a_small_terminal_gets_a_clear_message() {
    let a = app("tiny-gpt2", "cpu", 4 * GIB);
    let screen = render_text(&a, 60, 20);
    assert!(screen.contains("terminal too small"), "{screen}");
    let usable = render_text(&a, 80, 24);
    assert!(usable.contains("operators") && !usable.contains("too small"));
}

#[test]
fn live_gpu_samples_are_shown() {
    let mut a = app("gpt2", "h100-1x", 40 * GIB);
    a.apply_gpu(GpuEvent::Samples(vec![GpuSample {
        index: 0,
        name: "NVIDIA H100".into(),
        used_bytes: Some(12 * GIB),
        total_bytes: Some(80 * GIB),
        utilization_pct: Some(97),
        processes: vec![(4242, Some(11 * GIB))],
    }]));
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("NVIDIA H100")
            && screen.contains("12.0 GiB/80.0 GiB")
            && screen.contains("util  97%"),
        "{screen}"
    );
    a.apply_gpu(GpuEvent::Unavailable("GPU 0 stopped answering".into()));
    assert!(render_text(&a, 120, 40).contains("GPU 0 stopped answering"));
}

#[test]
fn gpu_memory_history_is_drawn_as_a_sparkline() {
    let mut a = app("gpt2", "h100-1x", 40 * GIB);
    for used in [10u64, 20, 40, 80] {
        a.apply_gpu(GpuEvent::Samples(vec![GpuSample {
            index: 0,
            name: "NVIDIA H100".into(),
            used_bytes: Some(used * GIB),
            total_bytes: Some(80 * GIB),
            utilization_pct: Some(50),
            processes: vec![],
        }]));
    }
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("▁▂▄█"), "{screen}");
}

/// A stand-in worker: a shell script that writes the given metrics lines, prints to its log,
/// then behaves as `tail` says (hang, or exit with a status).
fn fake_worker(dir: &std::path::Path, lines: &[&str], tail: &str) -> std::path::PathBuf {
    let script = dir.join("worker.sh");
    let mut body = String::from(
        "#!/bin/sh\nwhile [ $# -gt 0 ]; do case \"$1\" in --metrics=*) metrics=${1#--metrics=};; esac; shift; done\n",
    );
    for l in lines {
        body.push_str(&format!("echo '{l}' >> \"$metrics\"\n"));
    }
    body.push_str(tail);
    std::fs::write(&script, body).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn failed_run(worker_lines: &[&str], tail: &str, hang_after_s: u64) -> (String, String) {
    use osdp_tui::run::RunState;
    use osdp_tui::supervisor::LaunchSpec;
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(dir.path(), worker_lines, tail);
    let mut a = app("tiny-gpt2", "cpu", GIB);
    let launch = LaunchSpec {
        exe,
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(hang_after_s),
    };
    a = a.with_training(osdp_tui::tui::app::Training::new(
        launch,
        dir.path().join("run"),
    ));
    a.update(Action::StartRun);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        a.poll_background();
        if let RunState::Failed { why, .. } = a.training.as_ref().unwrap().state() {
            return (why, render_text(&a, 120, 40));
        }
        assert!(std::time::Instant::now() < deadline, "never failed");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

const STARTED: &str = r#"{"event":"started","model":"gpt2","world_size":8,"global_batch":8,"first_step":0,"last_step":null,"data":"text","device":"cpu"}"#;

#[test]
fn a_gpu_layout_whose_gpus_are_not_here_starts_nothing_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let launch = osdp_tui::supervisor::LaunchSpec {
        exe: fake_worker(dir.path(), &[], "exit 0\n"),
        model: root().join("sample-models/gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(60),
    };
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 20 * GIB).with_training(
        osdp_tui::tui::app::Training::new(launch, dir.path().join("run")),
    );
    a.update(Action::StartRun);
    assert!(
        a.training.as_ref().unwrap().run.is_none(),
        "nothing started"
    );
    let message = a.message.clone().unwrap_or_default();
    assert!(
        message.contains("trains on 8 GPUs and this machine")
            && message.contains("--layout layouts/cpu.json"),
        "{message}"
    );
}

/// A one-node GPU run is one worker process per GPU, joined as torchrun would join them; when
/// one of them dies the others are stopped and the run shows the failure.
#[test]
fn gpu_ranks_are_one_process_each_and_one_failing_ends_the_run() {
    use osdp_tui::run::{RunDir, RunState};
    use osdp_tui::supervisor::{Launch, LaunchSpec, Ranks, Supervisor};
    let dir = tempfile::tempdir().unwrap();
    let seen = dir.path().join("seen");
    let tail = format!(
        "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $*\" >> {seen}\n\
         if [ \"$RANK\" = 1 ]; then sleep 0.3; echo 'rank 1: NCCL error' >&2; exit 4; fi\n\
         echo '{STARTED}' >> \"$metrics\"\nexec sleep 600\n",
        seen = seen.display()
    );
    // The fake worker keeps its arguments for the record line.
    let exe = fake_worker(dir.path(), &[], "");
    let body = std::fs::read_to_string(&exe).unwrap().replace(
        "while [ $# -gt 0 ]; do case \"$1\" in --metrics=*) metrics=${1#--metrics=};; esac; shift; done\n",
        "args=\"$*\"\nwhile [ $# -gt 0 ]; do case \"$1\" in --metrics=*) metrics=${1#--metrics=};; esac; shift; done\nset -- $args\n",
    );
    std::fs::write(&exe, body + &tail).unwrap();
    let spec = LaunchSpec {
        exe,
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(60),
    };
    let launch = Launch {
        plan_json: "{}",
        ranks: Ranks::GpuProcesses,
        world_size: 2,
        ranks_per_node: None,
        global_batch: 8,
        predicted: None,
    };
    let mut run = Supervisor::start(&spec, RunDir(dir.path().join("run")), &launch).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while run.is_live() {
        run.poll();
        assert!(std::time::Instant::now() < deadline, "the run never ended");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    match &run.state {
        RunState::Failed { why, log_tail } => {
            assert_eq!(why, "the worker exited with status 4");
            assert!(
                log_tail.iter().any(|l| l.contains("rank 1: NCCL error")),
                "{log_tail:?}"
            );
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    let seen = std::fs::read_to_string(&seen).unwrap();
    let mut lines: Vec<&str> = seen.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{seen}");
    let port = lines[0].split_whitespace().nth(3).unwrap();
    for (rank, line) in lines.iter().enumerate() {
        assert!(
            line.starts_with(&format!("{rank} {rank} 2 127.0.0.1:")),
            "{line}"
        );
        assert!(
            line.contains(port),
            "every rank meets at the same address: {seen}"
        );
        assert!(line.contains("--device=cuda"), "{line}");
        assert!(!line.contains("--world-size"), "{line}");
    }
}

#[test]
fn a_crashing_worker_is_shown_failed_with_its_log() {
    let (why, screen) = failed_run(
        &[STARTED],
        "echo 'CUDA error: out of memory' >&2\nexit 3\n",
        60,
    );
    assert_eq!(why, "the worker exited with status 3");
    assert!(screen.contains("run: failed"), "{screen}");
    assert!(
        screen.contains("CUDA error: out of memory"),
        "the log tail: {screen}"
    );
}

#[test]
fn a_worker_without_progress_is_declared_hung_and_stopped() {
    let (why, screen) = failed_run(&[STARTED], "exec sleep 600\n", 1);
    assert!(why.starts_with("no progress for 1 s"), "{why}");
    assert!(screen.contains("run: failed"), "{screen}");
}

#[test]
fn status_reads_a_run_directory_from_another_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let step = r#"{"event":"step","step":7,"loss":3.5,"grad_norm":1.0,"lr":0.001,"step_time_s":0.2,"samples_per_s":40.0,"tokens_per_s":5120.0,"memory_bytes":[1048576,1048576],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"working":0}}"#;
    let ckpt = r#"{"event":"checkpoint","step":5,"path":"ck/step-00000005","write_time_s":0.1}"#;
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        [STARTED, ckpt, step].join("\n"),
    )
    .unwrap();
    let out = osdp().arg("status").arg(dir.path()).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("step 7 · loss 3.5000"), "{text}");
    assert!(text.contains("last checkpoint: step 5"), "{text}");
    let json = osdp()
        .arg("status")
        .arg(dir.path())
        .arg("--json")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["steps"][0]["step"], 7);
    assert_eq!(v["world_size"], 8);
    let missing = osdp()
        .arg("status")
        .arg(dir.path().join("nope"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
}

/// Issue 19: the frontier's read-out says what one press of + would gain, and pressing + gains
/// exactly that (the curve and the planner agree).
#[test]
fn the_frontier_read_out_matches_what_plus_really_gives() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 4 * GIB);
    let screen = render_text(&a, 120, 40);
    let line = screen
        .lines()
        .find(|l| l.contains("/s · +1.0 GiB "))
        .unwrap_or_else(|| panic!("no read-out:\n{screen}"));
    let gain: f64 = line
        .split("+1.0 GiB ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .map(|g| g.replace('−', "-"))
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no gain in {line:?}"));
    let before = a.planned().unwrap().prediction.throughput_samples_per_s;
    a.update(Action::RaiseBudget);
    let after = a.planned().unwrap().prediction.throughput_samples_per_s;
    assert!(
        ((after - before) - gain).abs() < 0.051,
        "read-out {gain:+.1}, pressing + gave {:+.2}",
        after - before
    );
    assert!(gain > 0.0, "4 GiB binds gpt2 on 8×A100: {line}");
}
