//! The dashboard: its text rendering, its keys, and what it says when things are missing.

use osdp_core::cluster::read_layout;
use osdp_core::model::read_model;
use osdp_tui::monitor::{GpuEvent, GpuSample};
use osdp_tui::tui::app::{Action, App, Focus, Row};
use osdp_tui::tui::render_text;

use crate::follow::Follow;
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

/// Select block `b`'s row.
fn select_block(a: &mut App, b: usize) {
    a.selected_row = a
        .rows()
        .iter()
        .position(|r| matches!(r, Row::Block(x) if *x == b))
        .expect("a row of the block");
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
        // 120 columns: the description shortens so that the next run's length shows.
        "gpt2 (124.4 M) on a100-80gb-8x-nvlink (8 ranks) · uncalibrated · run: idle · next: until stopped",
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

/// Where FSDP with checkpointing is ahead of the plan only because FSDP keeps a recomputed
/// unit's weights gathered (the trainer gathers some again: a kept op's bias, every weight of a
/// block that does not keep), the header says why, as `plan` does: tiny-gpt2 at the least
/// budget it fits on 8 H100s. Where blocks keep their weights the plan is ahead again: the OSDP
/// paper's GPT 48×2048 at global batch 256 on its 8 TITAN RTX (behind, 0.97×, before blocks
/// could keep them).
#[test]
fn the_header_says_why_fsdp_is_ahead_where_it_is() {
    let vs_fsdp = |a: &App| -> String {
        let screen = render_text(a, 200, 48);
        screen
            .lines()
            .find(|l| l.contains("vs FSDP"))
            .unwrap_or_else(|| panic!("no vs FSDP in:\n{screen}"))
            .to_string()
    };
    let line = vs_fsdp(&app("tiny-gpt2", "h100-sxm-8x-nvlink", 1_698_780_969));
    assert!(line.contains("(FSDP keeps recomputed weights)"), "{line}");
    let mut a = app("osdp-gpt-48x2048", "osdp-paper-8x-titan-rtx-pcie3", 8 * GIB);
    a.request.global_batch = Some(256);
    a.replan();
    let line = vs_fsdp(&a);
    assert!(line.contains("1.03× fsdp+ckpt @ 32"), "{line}");
    assert!(!line.contains("FSDP keeps"), "{line}");
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

/// Where the host budget binds on a model too large to search host memory exactly
/// (tinyllama-1.1b on the `cpu` layout), the frontier panel says why it has no curve and how
/// far from the best the plan may be, instead of claiming nothing fits; a lower budget then
/// says the host budget is what nothing fits, as `plan` does.
#[test]
fn a_priced_host_budget_explains_the_missing_curve() {
    let mut a = app("tinyllama-1.1b", "cpu", 8 * GIB);
    // The global batch `osdp-tui` picks on this layout (one sample per rank, the least): with
    // it fixed, the plan states how much shorter the best step could be.
    a.request.global_batch = Some(2);
    a.replan();
    let planned = a.planned().expect("a plan fits 8 GiB").clone();
    let gap = planned
        .host_gap_s
        .expect("the plan was found by pricing host memory");
    let screen = render_text(&a, 160, 48);
    assert!(!screen.contains("no plan fits any budget"), "{screen}");
    // A step of minutes is a rate well under one sample a second: the header still shows it.
    let rate = format!(
        "{} samples/s",
        osdp_core::units::figure(planned.prediction.throughput_samples_per_s, 1)
    );
    assert!(planned.prediction.throughput_samples_per_s < 0.05);
    assert!(
        screen.contains(&rate) && !screen.contains(" 0.0 samples/s"),
        "{rate}: {screen}"
    );
    let flat = screen.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("no curve: the host budget binds"), "{screen}");
    let said = osdp_core::units::seconds(gap);
    assert!(
        flat.contains(&format!("more than {said} shorter")),
        "{said}: {screen}"
    );
    a.update(Action::LowerBudget);
    let screen = render_text(&a, 160, 48);
    assert!(
        screen.contains("nothing fits 7.0 GiB per rank: even the plans that offload"),
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
    assert_eq!(a.request.budgets[2], 9 * GIB);
    assert_eq!(a.request.budgets[0], 10 * GIB);
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
    assert_eq!(a.request.max_split, 4);
    a.update(Action::CycleBatch);
    assert_eq!(a.request.batch, Some(1));
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
        compute_capability: None,
    }]));
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("NVIDIA H100")
            && screen.contains("12.0/80.0 GiB")
            && screen.contains("plan 31.8 GiB")
            && screen.contains("budget 40.0 GiB")
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
            compute_capability: None,
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
    // Steps of about 20 ms: the hang limit is --hang-after, not ten predicted steps.
    a.request.batch = Some(1);
    a.replan();
    let launch = LaunchSpec {
        exe,
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(hang_after_s),
        data: Default::default(),
    };
    a = a.with_run_control(osdp_tui::tui::app::RunControl::new(
        launch,
        dir.path().join("run"),
    ));
    a.update(Action::StartRun);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        a.poll_background();
        if let RunState::Failed { why, .. } = a.run_control.as_ref().unwrap().state() {
            return (why, render_text(&a, 120, 40));
        }
        assert!(std::time::Instant::now() < deadline, "never failed");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

pub(crate) const STARTED: &str = r#"{"event":"started","model":"gpt2","world_size":8,"global_batch":8,"first_step":0,"last_step":null,"data":"text","device":"cpu"}"#;

#[test]
fn a_gpu_layout_whose_gpus_are_not_here_starts_nothing_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let launch = osdp_tui::supervisor::LaunchSpec {
        exe: fake_worker(dir.path(), &[], "exit 0\n"),
        model: root().join("sample-models/gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(60),
        data: Default::default(),
    };
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 20 * GIB).with_run_control(
        osdp_tui::tui::app::RunControl::new(launch, dir.path().join("run")),
    );
    a.update(Action::StartRun);
    assert!(
        a.run_control.as_ref().unwrap().supervisor.is_none(),
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
        data: Default::default(),
    };
    let launch = Launch {
        plan_json: "{}",
        ranks: Ranks::GpuProcesses,
        world_size: 2,
        ranks_per_node: None,
        steps: 0,
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
fn a_worker_without_progress_after_a_step_is_declared_hung_and_stopped() {
    let (why, screen) = failed_run(&[STARTED, STEP1], "exec sleep 600\n", 1);
    assert!(why.starts_with("no progress for 1 s after step 1"), "{why}");
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

pub(crate) const STEP1: &str = r#"{"event":"step","step":1,"loss":4.5,"grad_norm":1.0,"lr":0.001,"step_time_s":0.2,"samples_per_s":40.0,"tokens_per_s":5120.0,"memory_bytes":[1048576],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"working":0}}"#;
pub(crate) const STEP2: &str = r#"{"event":"step","step":2,"loss":4.25,"grad_norm":1.0,"lr":0.001,"step_time_s":0.2,"samples_per_s":40.0,"tokens_per_s":5120.0,"memory_bytes":[1048576],"memory_breakdown":{"params":0,"grads":0,"optimizer":0,"gathered":0,"grad_buffers":0,"activations":0,"working":0}}"#;

/// A stand-in for a real worker: counts its starts in `starts`, writes a start and step 1,
/// writes step 2 on SIGUSR1, and on SIGTERM writes `stopped` and exits 0, as `train` does.
fn polite_worker(dir: &std::path::Path) -> std::path::PathBuf {
    // The traps first: a signal may come as soon as step 1 is seen.
    let tail = format!(
        "echo start >> {starts}\n\
         trap 'echo '\\''{STEP2}'\\'' >> \"$metrics\"' USR1\n\
         trap 'echo '\\''{{\"event\":\"stopped\",\"step\":2,\"reason\":\"signal\"}}'\\'' >> \"$metrics\"; kill $sleeper; exit 0' TERM\n\
         echo '{STARTED}' >> \"$metrics\"\n\
         echo '{STEP1}' >> \"$metrics\"\n\
         sleep 600 & sleeper=$!\n\
         while kill -0 $sleeper 2>/dev/null; do wait $sleeper; done\n",
        starts = dir.join("starts").display()
    );
    fake_worker(dir, &[], &tail)
}

/// A dashboard for tiny-gpt2 on the CPU whose runs start `exe` in `run_dir`.
fn dashboard_with(exe: &std::path::Path, run_dir: &std::path::Path, hang_after_s: u64) -> App {
    let launch = osdp_tui::supervisor::LaunchSpec {
        exe: exe.to_path_buf(),
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(hang_after_s),
        data: Default::default(),
    };
    app("tiny-gpt2", "cpu", GIB).with_run_control(osdp_tui::tui::app::RunControl::new(
        launch,
        run_dir.to_path_buf(),
    ))
}

/// Poll `a` as the event loop does until `done`; its screen then (wide enough for the whole
/// header).
fn poll_until(a: &mut App, what: &str, done: impl Fn(&App) -> bool) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        a.poll_background();
        if done(a) {
            return render_text(a, 180, 44);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}:\n{}",
            render_text(a, 180, 44)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn key(a: &mut App, c: char) {
    use crossterm::event::{KeyCode, KeyModifiers};
    let code = if c == '\u{1b}' {
        KeyCode::Esc
    } else {
        KeyCode::Char(c)
    };
    a.update(osdp_tui::tui::action_for(code, KeyModifiers::NONE).expect("a mapped key"));
}

fn last_step(a: &App) -> u64 {
    let run = a.run_control.as_ref().and_then(|t| t.supervisor.as_ref());
    run.and_then(|r| r.status.last()).map_or(0, |p| p.step)
}

fn run_state(a: &App) -> osdp_tui::run::RunState {
    a.run_control.as_ref().unwrap().state()
}

fn worker_pid(a: &App) -> u32 {
    a.run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .and_then(|r| r.pid())
        .expect("a worker")
}

/// Whether process `pid` runs (a zombie has ended).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 1..].trim_start().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z'))
}

/// `kill -SIG PID`; a `-` before SIG signals the process group PID leads.
fn signal(pid: u32, sig: &str) {
    let (sig, target) = match sig.strip_prefix('-') {
        Some(s) => (s, format!("-{pid}")),
        None => (sig, pid.to_string()),
    };
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), "--", &target])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -{sig} {target}");
}

/// Reap `pid` if it is this process's child (a worker a dashboard of this test left behind).
fn reap(pid: u32) {
    // SAFETY: waitpid on a pid; no memory is shared.
    unsafe {
        libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG);
    }
}

fn starts(dir: &std::path::Path) -> usize {
    std::fs::read_to_string(dir.join("starts"))
        .unwrap_or_default()
        .lines()
        .count()
}

#[test]
fn a_second_dashboard_attaches_read_only_and_its_x_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let exe = polite_worker(dir.path());
    let run_dir = dir.path().join("run");
    let mut first = dashboard_with(&exe, &run_dir, 60);
    key(&mut first, 's');
    poll_until(&mut first, "step 1", |a| last_step(a) == 1);
    let pid = worker_pid(&first);

    let mut second = dashboard_with(&exe, &run_dir, 60);
    let screen = poll_until(&mut second, "the attached run", |_| true);
    assert!(screen.contains("run: running step 1"), "{screen}");
    assert!(
        screen.contains(&format!("attached, read-only: run owned by pid {pid} on ")),
        "{screen}"
    );
    assert!(screen.contains("loss by step"), "{screen}");
    for k in ['s', 'r'] {
        key(&mut second, k);
        let message = second.message.clone().unwrap_or_default();
        assert!(
            message.starts_with(&format!("run owned by pid {pid} on "))
                && message.contains(" since ")
                && message.ends_with("; stop it there or x here to ask it to stop"),
            "{k}: {message}"
        );
    }
    assert_eq!(
        starts(dir.path()),
        1,
        "the second dashboard started nothing"
    );

    // It follows the run: a new step shows up on its screen.
    signal(pid, "USR1");
    let screen = poll_until(&mut second, "step 2", |a| last_step(a) == 2);
    assert!(screen.contains("run: running step 2"), "{screen}");

    key(&mut second, 'x');
    let message = second.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("finishing step 3 (~") && message.ends_with(" s); x again to kill"),
        "{message}"
    );
    let screen = poll_until(&mut second, "the stop", |a| {
        run_state(a) == osdp_tui::run::RunState::Stopped
    });
    assert!(screen.contains("run: stopped step 2"), "{screen}");
    assert_eq!(second.message, None, "the stop is no longer pending");
    poll_until(&mut first, "the stop, in the first", |a| {
        run_state(a) == osdp_tui::run::RunState::Stopped
    });
    assert!(!alive(pid));
}

#[test]
fn quitting_asks_and_a_detached_worker_runs_on_until_a_later_dashboard_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let exe = polite_worker(dir.path());
    let run_dir = dir.path().join("run");
    let mut first = dashboard_with(&exe, &run_dir, 60);
    key(&mut first, 's');
    poll_until(&mut first, "step 1", |a| last_step(a) == 1);
    let pid = worker_pid(&first);

    key(&mut first, 'q');
    let screen = render_text(&first, 180, 44);
    assert!(
        screen.contains(
            "a run is going: d detach (the run keeps going) · s stop (checkpoint and stop) · esc cancel"
        ),
        "{screen}"
    );
    key(&mut first, '\u{1b}');
    assert!(!first.quit && first.confirm.is_none(), "esc cancels");
    // Issue 34, item 8: the owning dashboard names the worker's pid; detaching says where the
    // run goes on and how to follow and reattach to it.
    let header = render_text(&first, 180, 44);
    assert!(
        header.contains(&format!("run: running step 1 · pid {pid}")),
        "{header}"
    );
    key(&mut first, 'q');
    key(&mut first, 'd');
    assert!(first.quit, "d quits");
    let words = first.farewell.clone().expect("words on detaching");
    let dir_shown = run_dir.display().to_string();
    for want in [
        format!("worker pid {pid}"),
        format!("run directory {dir_shown}"),
        format!("osdp-tui status {dir_shown} --follow"),
        // With the request on screen (the test's 1 GiB, not the layout's memory), so that it
        // reopens on the plan the run was started from.
        format!(
            "--layout cpu --budget 1GiB --global-batch {} --run-dir {dir_shown}",
            first
                .request
                .global_batch
                .map_or("any".to_string(), |g| g.to_string())
        ),
        format!("kill {pid}"),
    ] {
        assert!(words.contains(&want), "{want:?} not in:\n{words}");
    }

    drop(first);
    // The command it gives follows the run.
    let out = crate::osdp().arg("status").arg(&run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&pid.to_string()), "{text}");
    assert!(alive(pid), "the detached worker outlives its dashboard");

    // The next dashboard finds it running and follows it; quitting it asks again, s stops it.
    let mut later = dashboard_with(&exe, &run_dir, 60);
    let screen = poll_until(&mut later, "the attached run", |_| true);
    assert!(screen.contains("run: running step 1"), "{screen}");
    key(&mut later, 's');
    assert_eq!(starts(dir.path()), 1, "no second worker");
    key(&mut later, 'q');
    key(&mut later, 's');
    poll_until(&mut later, "the quit", |a| a.quit);
    reap(pid);
    assert!(!alive(pid), "stopped");
    let out = crate::osdp().arg("status").arg(&run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("state: stopped (signal)"), "{text}");

    // The run directory is free again: a new start is this dashboard's own.
    let mut again = dashboard_with(&exe, &run_dir, 60);
    key(&mut again, 's');
    assert_eq!(again.message, None, "started");
    let counted = dir.path().to_path_buf();
    poll_until(&mut again, "the new run", |a| {
        starts(&counted) == 2 && run_state(a) == osdp_tui::run::RunState::Running
    });
    assert!(
        again.run_control.as_ref().unwrap().owner().is_none(),
        "its own"
    );
}

#[test]
fn x_names_the_step_it_finishes_and_a_kill_without_a_checkpoint_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // A worker deaf to SIGTERM: only the second x ends it.
    let exe = fake_worker(
        dir.path(),
        &[STARTED, STEP1],
        "trap '' TERM\nexec sleep 600\n",
    );
    let run_dir = dir.path().join("run");
    let mut a = dashboard_with(&exe, &run_dir, 60);
    key(&mut a, 's');
    poll_until(&mut a, "step 1", |a| last_step(a) == 1);
    key(&mut a, 'x');
    let message = a.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("finishing step 2 (~") && message.ends_with("x again to kill"),
        "{message}"
    );
    let screen = render_text(&a, 180, 44);
    assert!(screen.contains("run: stopping"), "{screen}");
    assert!(
        screen.contains("finishing step 2 (~")
            && screen.contains("then a checkpoint; x again to kill"),
        "{screen}"
    );
    key(&mut a, 'x');
    let screen = poll_until(&mut a, "the kill", |a| {
        run_state(a) == osdp_tui::run::RunState::Stopped
    });
    assert!(
        screen.contains("killed at step 1 with no checkpoint: a new start begins at step 0"),
        "{screen}"
    );
    assert_eq!(
        a.message.as_deref(),
        Some("killed at step 1 with no checkpoint: a new start begins at step 0"),
        "the footer too (the panel is hidden on small screens)"
    );
    let out = crate::osdp().arg("status").arg(&run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("state: stopped (killed)"), "{text}");
}

/// The lock record of a process of this machine that has ended.
pub(crate) fn stale_lock(dir: &std::path::Path) -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    std::fs::write(
        dir.join(osdp_tui::run::lock::LOCK_FILE),
        format!(
            r#"{{"pid":{pid},"start_ticks":1,"started":"2026-01-01 00:00:00 UTC","host":"{}"}}"#,
            host.trim()
        ),
    )
    .unwrap();
    pid
}

#[test]
fn opening_a_run_directory_shows_how_its_run_ended() {
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(dir.path(), &[], "exit 0\n");
    let failed = r#"{"event":"failed","message":"CUDA error: out of memory"}"#;
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        [STARTED, STEP1, STEP2, failed].join("\n") + "\n",
    )
    .unwrap();
    let mut a = dashboard_with(&exe, dir.path(), 60);
    let screen = poll_until(&mut a, "a frame", |_| true);
    assert!(screen.contains("run: failed step 2"), "{screen}");
    assert!(
        screen.contains("failed: CUDA error: out of memory"),
        "{screen}"
    );
    assert!(screen.contains("loss by step"), "{screen}");

    // A stream that never ended, and a lock naming a worker that is gone: dead.
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        [STARTED, STEP1].join("\n") + "\n",
    )
    .unwrap();
    let pid = stale_lock(dir.path());
    let mut a = dashboard_with(&exe, dir.path(), 60);
    let screen = poll_until(&mut a, "a frame", |_| true);
    assert!(screen.contains("run: failed step 1"), "{screen}");
    assert!(
        screen.contains(&format!("the worker (pid {pid} on ")),
        "{screen}"
    );
    let out = crate::osdp()
        .arg("status")
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "a plain status reports");
    assert!(
        text.contains(&format!("state: dead: the worker (pid {pid} on ")),
        "{text}"
    );
    let out = crate::osdp()
        .arg("status")
        .arg(dir.path())
        .arg("--follow")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(4),
        "a dead run ends --follow at once"
    );
}

#[test]
fn status_follow_prints_new_steps_until_the_run_stops() {
    let dir = tempfile::tempdir().unwrap();
    let exe = polite_worker(dir.path());
    let run_dir = dir.path().join("run");
    let mut a = dashboard_with(&exe, &run_dir, 60);
    key(&mut a, 's');
    poll_until(&mut a, "step 1", |a| last_step(a) == 1);
    let pid = worker_pid(&a);

    let mut text = Follow::start(&run_dir, false);
    text.until(&format!("state: running (pid {pid} on "));
    let mut json = Follow::start(&run_dir, true);
    json.until(r#""event":"status""#);
    signal(pid, "USR1");
    text.until("step 2 · loss 4.2500");
    json.until(r#""step":2"#);
    key(&mut a, 'x');
    let (code, lines, _) = text.finish();
    assert_eq!(code, Some(0), "{lines:?}");
    assert_eq!(lines.last().unwrap(), "stopped at step 2 (signal)");
    let (code, lines, _) = json.finish();
    assert_eq!(code, Some(0), "{lines:?}");
    let events: Vec<String> = lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("one JSON object a line");
            v["event"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(events, ["status", "step", "stopped"], "{lines:?}");
}

#[test]
fn status_follow_calls_a_worker_killed_without_a_word_dead() {
    let dir = tempfile::tempdir().unwrap();
    let exe = polite_worker(dir.path());
    let run_dir = dir.path().join("run");
    let mut a = dashboard_with(&exe, &run_dir, 60);
    key(&mut a, 's');
    poll_until(&mut a, "step 1", |a| last_step(a) == 1);
    let pid = worker_pid(&a);
    // Detached, so that no dashboard records the end.
    key(&mut a, 'q');
    key(&mut a, 'd');
    drop(a);
    let mut text = Follow::start(&run_dir, false);
    text.until("state: running");
    let mut json = Follow::start(&run_dir, true);
    json.until(r#""event":"status""#);
    // The whole group, as the out-of-memory killer or a crash would leave nothing behind.
    signal(pid, "KILL");
    signal(pid, "-KILL");
    reap(pid);
    let (code, lines, _) = text.finish();
    assert_eq!(code, Some(4), "{lines:?}");
    assert!(
        lines
            .last()
            .unwrap()
            .starts_with(&format!("dead: the worker (pid {pid} on ")),
        "{lines:?}"
    );
    let (code, lines, _) = json.finish();
    assert_eq!(code, Some(4), "{lines:?}");
    let last: serde_json::Value = serde_json::from_str(lines.last().unwrap()).unwrap();
    assert_eq!(last["event"], "dead");
    assert_eq!(last["owner"]["pid"], pid);
}

/// Issue 18: once the first step of a start lands, the training panel says how long it took
/// from pressing `s` (start-up and one step), beside the predicted step time.
#[test]
fn the_panel_says_how_long_the_first_step_took() {
    use osdp_tui::supervisor::LaunchSpec;
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(
        dir.path(),
        &[STARTED],
        &format!("sleep 0.3\necho '{STEP1}' >> \"$metrics\"\nexec sleep 600\n"),
    );
    let mut a = app("tiny-gpt2", "cpu", GIB);
    let launch = LaunchSpec {
        exe,
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(60),
        data: Default::default(),
    };
    a = a.with_run_control(osdp_tui::tui::app::RunControl::new(
        launch,
        dir.path().join("run"),
    ));
    let pressed = std::time::Instant::now();
    a.update(Action::StartRun);
    let deadline = pressed + std::time::Duration::from_secs(20);
    let took = loop {
        a.poll_background();
        if let Some(t) = a
            .run_control
            .as_ref()
            .and_then(|t| t.supervisor.as_ref()?.first_step_after)
        {
            break t;
        }
        assert!(std::time::Instant::now() < deadline, "no first step");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(took >= std::time::Duration::from_millis(300), "{took:?}");
    assert!(took <= pressed.elapsed(), "{took:?}");
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("first step ") && screen.contains(" after start"),
        "{screen}"
    );
    // Step 1's own figures, as the worker wrote them.
    assert!(screen.contains("lr 1.00e-3 · grad-norm 1.000"), "{screen}");
    assert!(
        screen.contains("step 1 · loss 4.5000 (smoothed 4.5000) · 1.02 k tokens seen"),
        "{screen}"
    );
    a.update(Action::StopRun);
    a.update(Action::StopRun);
}

/// Issue 20: on a layout with a host, the header shows the plan's host memory against the host
/// budget, offloaded operators wear their badge, and the legend names the colour.
#[test]
fn offloaded_operators_and_host_memory_are_on_screen() {
    let a = app("llama-2-7b", "rtx4090-1x", 24 * GIB);
    let p = a.planned().expect("fits by offloading").clone();
    let host = p.prediction.host_bytes;
    assert!(host > 0);
    let screen = render_text(&a, 120, 40);
    let want = format!(
        "host {} / {}",
        osdp_core::units::bytes(host),
        osdp_core::units::bytes(a.machine.host_budget_bytes)
    );
    assert!(screen.contains(&want), "{want} not in\n{screen}");
    assert!(screen.contains("+ofl-"), "{screen}");
    assert!(screen.contains("+offload"), "{screen}");
    // A plan that offloads nothing says nothing of host memory, though the layout has a host.
    let plain = app("gpt2-xl", "h200-1x", 140 * GIB);
    assert!(plain.machine.offers_offload());
    assert_eq!(plain.planned().unwrap().prediction.host_bytes, 0);
    let screen = render_text(&plain, 120, 40);
    assert!(!screen.contains("host "), "{screen}");
    // Without a host the layout never offloads, and its legend has no offload colour.
    let hostless = app("gpt2-xl", "a100-80gb-8x-nvlink", 16 * GIB);
    let screen = render_text(&hostless, 120, 40);
    assert!(!screen.contains("host "), "{screen}");
    assert!(!screen.contains("+offload"), "{screen}");
}

fn press(a: &mut App, code: crossterm::event::KeyCode) {
    let action = osdp_tui::tui::action_for(code, crossterm::event::KeyModifiers::NONE);
    a.update(action.expect("a mapped key"));
}

/// The log view's title: where it is in the log and whether it follows.
fn log_title(a: &App) -> String {
    let screen = render_text(a, a.screen.0, a.screen.1);
    screen
        .lines()
        .find(|l| l.contains("worker log"))
        .unwrap_or_else(|| panic!("no log view:\n{screen}"))
        .to_string()
}

/// Issue 19: `l` opens the worker's log at its tail and follows it; scrolling up holds the
/// view where it is while lines arrive; End follows again; Home goes to the top; Esc and q
/// close it without quitting.
#[test]
fn l_opens_the_workers_log_which_follows_its_tail_until_scrolled_up() {
    use crate::stand_in::*;
    use crossterm::event::KeyCode;
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let more = format!(
        "while [ ! -e {go} ]; do sleep 0.05; done\n\
         i=71; while [ $i -le 90 ]; do echo \"log line $i\"; i=$((i+1)); done",
        go = go.display()
    );
    let exe = worker(dir.path(), &[started(2, None)], 70, &more);
    let mut a = start(
        crate::stand_in::app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/log-keys",
    );
    a.screen = (80, 24);
    poll_until(&mut a, "70 log lines", |a| log_len(a) == 70);
    key(&mut a, 'l');
    let title = log_title(&a);
    assert!(title.contains("lines 51–70 of 70 · following"), "{title}");
    // Up a line, then a page: the view leaves the tail.
    press(&mut a, KeyCode::Up);
    press(&mut a, KeyCode::PageUp);
    assert!(log_title(&a).contains("lines 30–49 of 70 · scrolled"));
    std::fs::write(&go, "").unwrap();
    poll_until(&mut a, "90 log lines", |a| log_len(a) == 90);
    let screen = render_text(&a, 80, 24);
    assert!(screen.contains("lines 30–49 of 90 · scrolled"), "{screen}");
    assert!(screen.contains("log line 30") && !screen.contains("log line 90"));
    press(&mut a, KeyCode::End);
    let screen = render_text(&a, 80, 24);
    assert!(screen.contains("lines 71–90 of 90 · following"), "{screen}");
    assert!(screen.contains("log line 90"));
    press(&mut a, KeyCode::Home);
    assert!(log_title(&a).contains("lines 1–20 of 90 · scrolled"));
    // Scrolling down to the tail follows it again.
    for _ in 0..7 {
        press(&mut a, KeyCode::PageDown);
    }
    assert!(log_title(&a).contains("lines 71–90 of 90 · following"));
    key(&mut a, '\u{1b}');
    assert!(a.log_view.is_none() && !a.quit, "Esc closes the log only");
    key(&mut a, 'l');
    key(&mut a, 'q');
    assert!(a.log_view.is_none() && !a.quit, "q closes the log only");
    key(&mut a, 'x');
    key(&mut a, 'x');
}

/// Issue 19: the training panel says how long the run has gone and has left: before the first
/// step from the predicted step time, then from the measured one; a run with no last step says
/// it runs until stopped.
#[test]
fn the_training_panel_gives_the_elapsed_time_and_an_eta() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let steps: Vec<String> = (1..=4).map(|k| step(k, &[600 * MIB; 2], None)).collect();
    let more = format!(
        "while [ ! -e {go} ]; do sleep 0.05; done\n{}",
        steps
            .iter()
            .map(|s| format!("echo '{s}' >> \"$metrics\"\n"))
            .collect::<String>(),
        go = go.display()
    );
    let exe = worker(dir.path(), &[started(2, Some(40))], 0, &more);
    let mut a = start(
        crate::stand_in::app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/eta-keys",
    );
    poll_until(&mut a, "the start", |a| {
        a.run_control
            .as_ref()
            .unwrap()
            .supervisor
            .as_ref()
            .unwrap()
            .status
            .last_step
            == Some(40)
    });
    at(&mut a, 30);
    let predicted = a.planned().unwrap().prediction.step_time_s;
    let want = format!(
        "elapsed 30 s · ETA ~{} (40 steps × {} predicted)",
        osdp_core::units::duration(40.0 * predicted),
        osdp_core::units::seconds(predicted)
    );
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains(&want), "{want}\n{screen}");
    std::fs::write(&go, "").unwrap();
    poll_until(&mut a, "step 4", |a| last_step(a) == 4);
    at(&mut a, 200);
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("elapsed 3 min 20 s · ETA 7 s (36 steps × 200.0 ms, recent mean)"),
        "{screen}"
    );
    key(&mut a, 'x');
    key(&mut a, 'x');
    poll_until(&mut a, "the end", |a| {
        !a.run_control.as_ref().unwrap().is_live()
    });
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("ran "), "{screen}");
    assert!(
        !screen.contains("ETA"),
        "no ETA for a run that ended:\n{screen}"
    );

    let exe = worker(dir.path(), &[started(2, None)], 0, "");
    let mut a = start(
        crate::stand_in::app("tiny-gpt2", "cpu", GIB, None),
        exe,
        "target/snapshot-runs/eta-keys",
    );
    poll_until(&mut a, "the start", |a| {
        a.run_control
            .as_ref()
            .unwrap()
            .supervisor
            .as_ref()
            .unwrap()
            .status
            .world_size
            == 2
    });
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("runs until stopped (no last step; x stops it)"),
        "{screen}"
    );
    key(&mut a, 'x');
    key(&mut a, 'x');
}

/// Issue 19: a GPU's row says nothing of a gap without a run; with a run whose worker has not
/// measured it yet, only the cost model's runtime, as an estimate; then the worker's figures.
#[test]
fn the_gap_on_a_gpu_is_measured_or_named_an_estimate() {
    use crate::stand_in::*;
    use osdp_core::protocol::DeviceMemory;
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let device = DeviceMemory {
        allocated_peak_bytes: Some(14 * GIB),
        reserved_peak_bytes: Some(15 * GIB),
        process_bytes: Some(16 * GIB),
    };
    let more = format!(
        "while [ ! -e {go} ]; do sleep 0.05; done\necho '{}' >> \"$metrics\"",
        step(1, &[13 * GIB; 4], Some(vec![device; 4])),
        go = go.display()
    );
    let mut idle = crate::stand_in::app(
        "gpt2-medium",
        "rtx4090-4x-pcie",
        20 * GIB,
        Some(gpus(4, 17 * GIB)),
    );
    // A plan that fills the budget (no headroom), so the gap is the runtime's.
    idle.request.headroom = 0.0;
    idle.replan();
    let screen = render_text(&idle, 200, 60);
    assert!(screen.contains("plan 19.9 GiB"), "{screen}");
    assert!(!screen.contains("not the plan's") && !screen.contains("tensors"));

    let exe = worker(dir.path(), &[started(4, None)], 0, &more);
    let mut a = start(idle, exe, "target/snapshot-runs/gap-keys");
    poll_until(&mut a, "the start", |a| {
        a.run_control
            .as_ref()
            .unwrap()
            .supervisor
            .as_ref()
            .unwrap()
            .status
            .world_size
            == 4
    });
    let runtime = osdp_core::units::bytes(a.planned().unwrap().prediction.overhead_bytes);
    let screen = render_text(&a, 200, 60);
    let want =
        format!("not the plan's: runtime ≈{runtime} · estimated (CUDA context, NCCL, allocator)");
    assert!(screen.contains(&want), "{want}\n{screen}");
    assert!(!screen.contains("tensors"), "{screen}");
    std::fs::write(&go, "").unwrap();
    poll_until(&mut a, "step 1", |a| last_step(a) == 1);
    let screen = render_text(&a, 200, 60);
    assert!(!screen.contains("not the plan's"), "{screen}");
    assert!(
        screen.contains("tensors 14.0 GiB (plan 18.4 GiB) · allocator reserve 1.0 GiB"),
        "{screen}"
    );
    assert!(screen.contains("CUDA context+NCCL 1.0 GiB · other processes 1.0 GiB"));
    key(&mut a, 'x');
    key(&mut a, 'x');
}

/// Issue 19: a GPU layout with no NVML says so and lists the ranks with the plan's figures;
/// Home and End go to the first and last row.
#[test]
fn without_nvml_the_panel_lists_ranks_and_home_end_jump() {
    let mut a = app("gpt2", "h100-sxm-8x-nvlink", 40 * GIB);
    a.apply_gpu(GpuEvent::Unavailable("no NVIDIA driver found".into()));
    let screen = render_text(&a, 120, 40);
    for want in [
        "live memory not available:",
        "no NVIDIA driver found",
        // What each rank's plan figure leaves out, above the ranks, in view with all eight.
        "no step yet · ▒ runtime ≈",
        "budget 40.0 GiB",
    ] {
        assert!(screen.contains(want), "{want}:\n{screen}");
    }
    use crossterm::event::KeyCode;
    press(&mut a, KeyCode::End);
    assert_eq!(a.selected_row, a.rows().len() - 1);
    press(&mut a, KeyCode::Home);
    assert_eq!(a.selected_row, 0);
    a.update(Action::FocusNext);
    press(&mut a, KeyCode::End);
    assert_eq!(a.selected_gpu, 7);
    let screen = render_text(&a, 120, 40);
    assert!(
        // The GPU panel has the keys: its border is doubled.
        screen.lines().any(|l| l.contains("║7 ")),
        "rank 7 in view:\n{screen}"
    );
}

/// Issue 19: a run started elsewhere (`train --metrics` into the run directory) has no
/// prediction beside it: its figures say so with a dash, never a predicted 0; one that ended
/// at its last step says finished.
#[test]
fn a_run_without_a_prediction_shows_no_predicted_figures() {
    use crate::stand_in::*;
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let stopped = r#"{"event":"stopped","step":1,"reason":"completed"}"#;
    let metrics = [started(2, Some(1)), step(1, &[600 * MIB; 2], None)].join("\n");
    std::fs::write(run.join("metrics.jsonl"), format!("{metrics}\n{stopped}\n")).unwrap();
    let launch = osdp_tui::supervisor::LaunchSpec {
        exe: root().join("no-worker"),
        model: root().join("sample-models/tiny-gpt2.json"),
        checkpoint_every: 10,
        hang_after: std::time::Duration::from_secs(60),
        data: Default::default(),
    };
    let a = app("tiny-gpt2", "cpu", GIB, None)
        .with_run_control(osdp_tui::tui::app::RunControl::new(launch, run));
    let screen = render_text(&a, 120, 40);
    for want in [
        "samples/s 40.0 measured · — predicted",
        "step time 200.0 ms measured · — predicted",
        "memory/rank 600.0 MiB measured · — predicted",
    ] {
        assert!(screen.contains(want), "{want}:\n{screen}");
    }
    assert!(!screen.contains(" 0.0 predicted"), "{screen}");
    // It ended by reaching its last step: finished, not stopped (which `x` or a signal does).
    assert!(screen.contains("run: finished step 1"), "{screen}");
    assert!(screen.contains("training: finished"), "{screen}");
}

fn type_keys(a: &mut App, keys: &str) {
    use crossterm::event::{KeyCode, KeyModifiers};
    for c in keys.chars() {
        let code = match c {
            '\n' => KeyCode::Enter,
            '\x1b' => KeyCode::Esc,
            '\x08' => KeyCode::Backspace,
            c => KeyCode::Char(c),
        };
        a.key(code, KeyModifiers::NONE);
    }
}

/// Issue 19: `:` opens a command line that takes typed values; a mistake is said in the footer
/// and changes nothing; `u` takes each change back, newest first.
#[test]
fn the_command_line_sets_typed_values_and_u_undoes_them() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let start = a.settings();
    type_keys(&mut a, ":budget 12GiB");
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains(":budget 12GiB█"), "{screen}");
    // Keys go to the line while it is open: the typed `b` and `u` cycled nothing.
    assert_eq!(a.settings(), start);
    type_keys(&mut a, "\n");
    assert!(a.command.is_none());
    assert_eq!(a.request.budgets, vec![12 * GIB; 8]);
    assert!(render_text(&a, 120, 40).contains("budget 12.0 GiB per GPU"));
    type_keys(&mut a, ":gpu 3 budget 10GiB\n");
    assert_eq!(a.budget(), 10 * GIB);
    assert_eq!(a.request.budgets[3], 10 * GIB);
    assert_eq!(a.request.budgets[2], 12 * GIB);
    type_keys(&mut a, ":batch 512\n:micro 16\n:split 2\n");
    assert_eq!(
        (a.request.global_batch, a.request.batch, a.request.max_split),
        (Some(512), Some(16), 2)
    );
    let p = a.planned().expect("fits").prediction.clone();
    assert_eq!((p.global_batch, p.batch_size), (512, 16));

    // Mistakes: said, and nothing changes (nor is there anything new to undo).
    let before = (a.settings(), a.undo.len());
    for (typed, says) in [
        (":batch 100\n", "multiple of the 8 ranks"),
        (":gpu 9 budget 1GiB\n", "GPUs are 0 to 7"),
        (":budget lots\n", "expected a size"),
        (":split 3\n", "power of two"),
        (":frobnicate\n", "unknown command"),
    ] {
        type_keys(&mut a, typed);
        let msg = a.message.clone().unwrap_or_default();
        assert!(msg.contains(says), "{typed:?}: {msg}");
        assert!(
            render_text(&a, 120, 40).contains(says),
            "{typed:?} not on screen"
        );
        assert_eq!(
            (a.settings(), a.undo.len()),
            before,
            "{typed:?} changed something"
        );
    }
    // Esc closes the line without running it; Backspace past the start closes it too.
    type_keys(&mut a, ":budget 1GiB\x1b:\x08");
    assert!(a.command.is_none());
    assert_eq!(a.settings(), before.0);

    // u takes back split, micro, batch, the one GPU's budget and the budget, in that order;
    // then there is nothing left to undo.
    a.update(Action::LowerBudget);
    for _ in 0..6 {
        a.update(Action::Undo);
    }
    assert_eq!(a.settings(), start);
    a.update(Action::Undo);
    assert_eq!(a.message.as_deref(), Some("nothing to undo"));
    assert_eq!(a.settings(), start);
    let p = a.planned().expect("fits");
    assert!(p.prediction.peak_memory_bytes <= 8 * GIB);
}

/// Issue 19: `w` writes the plan on screen to a file that `evaluate` reads back to the same
/// figures; `:write PATH` puts it elsewhere; an unwritable path says why.
#[test]
fn w_writes_the_plan_on_screen_for_evaluate() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 4 * GIB);
    let path = dir.path().join("mine.plan.json");
    type_keys(&mut a, &format!(":write {}\n", path.display()));
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("wrote the plan on screen")),
        "{:?}",
        a.message
    );
    let e = crate::json_ok(osdp().args([
        "evaluate",
        "sample-models/gpt2.json",
        "--layout",
        "layouts/a100-80gb-8x-nvlink.json",
        "--budget",
        "4GiB",
        "--plan",
        path.to_str().unwrap(),
        "--json",
    ]));
    let p = &a.planned().unwrap().prediction;
    assert_eq!(e["step_time_s"].as_f64().unwrap(), p.step_time_s);
    assert_eq!(
        e["peak_memory_bytes"].as_u64().unwrap(),
        p.peak_memory_bytes
    );
    assert_eq!(
        a.default_plan_path(),
        std::path::PathBuf::from("gpt2.plan.json")
    );
    type_keys(&mut a, ":write /nonexistent-dir/x.json\n");
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.starts_with("cannot write /nonexistent-dir/x.json")),
        "{:?}",
        a.message
    );
}

/// Issue 35: `:target fsdp2` plans what FSDP2 can run, and `e` (or `:export PATH`) writes the
/// plan on screen as `osdp-tui export --to fsdp2` writes it from `w`'s file: the same export. A
/// plan FSDP2 cannot run (zero1 pinned under the default target) is refused with what to do.
#[test]
fn target_fsdp2_and_e_write_what_apply_plan_reads() {
    use osdp_core::cost::{Choice, Strategy};
    use osdp_core::plan::Target;
    let dir = tempfile::tempdir().unwrap();
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 4 * GIB);
    // Under the default target, an op pinned to zero1 makes a plan FSDP2 cannot run.
    a.request.pins = vec![(4, Choice::plain(Strategy::Zero1))];
    a.replan();
    let refused = dir.path().join("refused.json");
    type_keys(&mut a, &format!(":export {}\n", refused.display()));
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.starts_with("FSDP2 cannot run the plan on screen")
                && m.contains("zero1")
                && m.contains(":target fsdp2")),
        "{:?}",
        a.message
    );
    assert!(!refused.exists());
    a.request.pins.clear();
    type_keys(&mut a, ":target fsdp2\n");
    assert_eq!(a.request.target, Target::Fsdp2);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.starts_with("target fsdp2")),
        "{:?}",
        a.message
    );
    // gpt2's figures are osdp-tui's kernels': the footer says what to import instead, whole,
    // at 80 columns.
    let screen: String = render_text(&a, 80, 24)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        screen.contains("FSDP2 runs PyTorch's: import-hf --kernels pytorch prices what they keep"),
        "{screen}"
    );
    // The strategy legend lists what FSDP2 runs: no zero1, no split.
    let wide = render_text(&a, 200, 60);
    let legend = wide
        .lines()
        .find(|l| l.contains("═ dp ") || l.contains("╚ dp "))
        .unwrap_or_else(|| panic!("no legend:\n{wide}"));
    assert!(
        legend.contains("zero2") && !legend.contains("zero1") && !legend.contains("K:M"),
        "{legend}"
    );
    let p = a.planned().expect("fits").clone();
    assert!(p
        .plan
        .choices
        .iter()
        .all(|c| Target::Fsdp2.allows(*c).is_ok()));
    // An op's explain pane lists only what FSDP2 can run (no zero1, no split, no +offload-opt).
    let wte = a
        .rows()
        .iter()
        .position(|r| matches!(r, Row::Op(op) if a.model.ops[*op].id == "wte"))
        .expect("wte has a row");
    while a.selected_row > wte {
        a.update(Action::Up);
    }
    while a.selected_row < wte {
        a.update(Action::Down);
    }
    a.update(Action::Toggle);
    let detail = a.detail.as_ref().expect("Enter opens the op's choices");
    assert!(detail.alternatives.len() > 1);
    for alt in &detail.alternatives {
        assert!(
            Target::Fsdp2.allows(alt.choice).is_ok(),
            "{}",
            alt.choice.label()
        );
    }
    // The header says whose prices the figures are, at the smallest size too.
    for (w, h) in [(80, 24), (120, 40)] {
        let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(w, h)).unwrap();
        t.draw(|f| osdp_tui::tui::view::draw(&a, f)).unwrap();
        let screen: String = t
            .backend()
            .buffer()
            .content
            .iter()
            .map(|c| c.symbol())
            .collect();
        assert!(screen.contains("for FSDP2"), "{w}×{h}: {screen}");
    }
    let plan = dir.path().join("gpt2.plan.json");
    let mine = dir.path().join("gpt2.fsdp2.json");
    type_keys(
        &mut a,
        &format!(":write {}\n:export {}\n", plan.display(), mine.display()),
    );
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("for FSDP2 to")),
        "{:?}",
        a.message
    );
    let cli = dir.path().join("cli.fsdp2.json");
    osdp()
        .args([
            "export",
            "sample-models/gpt2.json",
            "--layout",
            "layouts/a100-80gb-8x-nvlink.json",
            "--plan",
        ])
        .arg(&plan)
        .args(["--to", "fsdp2", "-o"])
        .arg(&cli)
        .assert()
        .success();
    let read = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(read(&mine), read(&cli));
    // e over a file that exists asks first; n keeps it.
    assert_eq!(
        a.default_export_path(),
        std::path::PathBuf::from("gpt2.fsdp2.json")
    );
    type_keys(&mut a, &format!(":export {}\nn", mine.display()));
    assert_eq!(a.message.as_deref(), Some("not written"));
    type_keys(&mut a, ":target nope\n");
    assert!(a
        .message
        .as_deref()
        .is_some_and(|m| m.contains("osdp") && m.contains("fsdp2")));
    assert_eq!(a.request.target, Target::Fsdp2);
}

/// Issue 19: `c` compares the plan on screen with the running one: both runs' figures and
/// each operator whose choice differs; with no run it says so.
#[test]
fn c_compares_the_plan_on_screen_with_the_running_one() {
    use crate::stand_in;
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    a.update(Action::Compare);
    assert!(a.compare.is_none());
    assert!(a
        .message
        .as_deref()
        .unwrap_or_default()
        .contains("no run to compare with"));

    let dir = tempfile::tempdir().unwrap();
    let exe = stand_in::worker(dir.path(), &[stand_in::started(2, None)], 0, "");
    let a = stand_in::app("tiny-gpt2", "cpu", GIB, None);
    let mut a = stand_in::start(a, exe, "target/snapshot-runs/compare");
    a.update(Action::Compare);
    let lines = a.compare.clone().expect("the comparison");
    assert!(
        lines
            .iter()
            .any(|l| l == "the same choices for every operator"),
        "{lines:?}"
    );
    // A lower budget changes the plan on screen; the run keeps its own.
    let mut presses = 0;
    while !a.plan_differs_from_run() {
        a.update(Action::LowerBudget);
        presses += 1;
        assert!(presses < 20, "the plan never changed");
    }
    a.update(Action::Compare);
    assert!(a.compare.is_none(), "c again closes it");
    a.update(Action::Compare);
    let lines = a.compare.clone().expect("the comparison");
    let screen = render_text(&a, 120, 40);
    assert!(
        screen.contains("the plan on screen vs the running one"),
        "{screen}"
    );
    assert!(lines[0].starts_with("running "), "{lines:?}");
    assert!(lines[1].starts_with("on screen "), "{lines:?}");
    // What changed, each as `was → is`: the micro-batch, operators' choices, recomputation.
    let changed = lines.iter().filter(|l| l.contains(" → ")).count();
    assert!(changed > 0, "{lines:?}");
    assert_ne!(
        lines[0]["running".len()..],
        lines[1]["on screen".len()..],
        "{lines:?}"
    );
    a.update(Action::Quit);
    assert!(a.compare.is_none(), "Esc closes it, and does not quit");
    assert!(!a.quit);
    a.update(Action::StopRun);
    a.update(Action::StopRun);
}

/// Issue 19: with `NO_COLOR` the dashboard draws no colour at all; bold and reverse stay.
#[test]
fn no_color_leaves_no_colour_on_screen() {
    use ratatui::style::{Color, Modifier};
    let a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
    let coloured = |t: &ratatui::Terminal<ratatui::backend::TestBackend>| {
        t.backend()
            .buffer()
            .content
            .iter()
            .filter(|c| c.fg != Color::Reset || c.bg != Color::Reset)
            .count()
    };
    t.draw(|f| osdp_tui::tui::view::draw(&a, f)).unwrap();
    assert!(coloured(&t) > 100, "the plain screen has colour");
    t.draw(|f| {
        osdp_tui::tui::view::draw(&a, f);
        osdp_tui::tui::strip_colors(f.buffer_mut());
    })
    .unwrap();
    assert_eq!(coloured(&t), 0);
    let bold = t
        .backend()
        .buffer()
        .content
        .iter()
        .filter(|c| c.modifier.contains(Modifier::BOLD))
        .count();
    assert!(bold > 0, "emphasis stays");
}

/// Issue 19: `p` on a block row pins every operator of the block that has parameters, the
/// same strategy for each, and steps them together; after the last, they are all unpinned.
#[test]
fn pins_work_on_block_rows() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    select_block(&mut a, 0);
    let owners: Vec<usize> = (0..a.model.ops.len())
        .filter(|&i| a.blocks.of_op[i] == Some(0) && osdp_core::cost::owns_params(&a.model.ops[i]))
        .collect();
    assert!(owners.len() >= 4);
    let mut seen = Vec::new();
    for _ in 0..8 {
        a.update(Action::CyclePin);
        let pins: Vec<_> = owners.iter().map(|&i| a.pin_of(i)).collect();
        assert!(pins.iter().all(|p| *p == pins[0]), "{pins:?}");
        if pins[0].is_none() {
            break;
        }
        seen.push(pins[0].unwrap().strategy);
        let plan = &a.planned().expect("fits").plan;
        for &i in &owners {
            assert_eq!(plan.choices[i], pins[0].unwrap(), "{}", a.model.ops[i].id);
        }
    }
    use osdp_core::cost::Strategy;
    assert_eq!(
        seen,
        [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3
        ]
    );
    assert!(a.request.pins.is_empty());
    // `u` takes a block's pin back at once.
    a.update(Action::CyclePin);
    a.update(Action::Undo);
    assert!(a.request.pins.is_empty());
}

/// Issue 19: `R` on a block row fixes that block's recomputation against the plan's choice
/// (the plan on screen follows, at a price), `R` again hands it back, `u` undoes it.
#[test]
fn r_toggles_a_blocks_recomputation() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 40 * GIB);
    select_block(&mut a, 3);
    let before = a.planned().expect("fits").plan.recompute.clone();
    let free = throughput(&a);
    assert!(!before[3], "40 GiB holds gpt2-medium's activations");
    a.update(Action::ToggleRecompute);
    let forced = a.planned().expect("fits").plan.recompute.clone();
    assert!(forced[3], "R forces block 3 to recompute");
    assert_eq!(
        forced.iter().filter(|&&r| r).count(),
        1,
        "and no other block"
    );
    assert!(throughput(&a) < free, "recomputing costs time");
    let screen = render_text(&a, 160, 48);
    assert!(
        screen.contains("rc📌"),
        "the block row says it is fixed:\n{screen}"
    );
    assert!(screen.contains("1 rc fixed"), "{screen}");
    // Again: the planner decides, and takes back its own plan.
    a.update(Action::ToggleRecompute);
    assert_eq!(a.planned().unwrap().plan.recompute, before);
    assert!((throughput(&a) - free).abs() < 1e-9 * free);
    a.update(Action::Undo);
    assert!(
        a.planned().unwrap().plan.recompute[3],
        "u puts the fix back"
    );

    // Where the budget makes the planner recompute, R forbids it: the plan keeps the block's
    // activations and spends memory elsewhere, or says nothing fits.
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 6 * GIB);
    a.request.batch = Some(8);
    a.replan();
    let b = a
        .planned()
        .expect("fits")
        .plan
        .recompute
        .iter()
        .position(|&r| r)
        .expect("micro-batch 8 in 6 GiB recomputes some block");
    select_block(&mut a, b);
    a.update(Action::ToggleRecompute);
    let p = a
        .planned()
        .expect("another plan keeps the block's activations");
    assert!(!p.plan.recompute[b]);
    assert!(p.prediction.peak_memory_bytes <= 6 * GIB);
    let screen = render_text(&a, 160, 48);
    assert!(
        screen.contains("no rc📌") && screen.contains("1 rc fixed"),
        "{screen}"
    );
}

/// Issue 19: clicking an operator row selects it and focuses the table; clicking the GPU
/// panel focuses it.
#[test]
fn clicks_select_rows_and_focus_panels() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let screen = render_text(&a, 120, 40);
    let lines: Vec<&str> = screen.lines().collect();
    let y = lines
        .iter()
        .position(|l| l.contains("h0.attn.c_proj"))
        .expect("the row on screen");
    let byte = lines[y].find("h0.attn.c_proj").unwrap();
    let x = lines[y][..byte].chars().count();
    a.click(x as u16, y as u16);
    assert_eq!(
        a.selected(),
        Some(Row::Op(
            a.model
                .ops
                .iter()
                .position(|o| o.id == "h0.attn.c_proj")
                .unwrap()
        ))
    );
    assert_eq!(a.focus, Focus::Ops);
    // The GPU panel: its title's line, at the title.
    let gy = lines.iter().position(|l| l.contains("┌ GPUs")).unwrap();
    let gx = lines[gy].chars().position(|c| c == 'G').unwrap();
    a.click(gx as u16, gy as u16 + 1);
    assert_eq!(a.focus, Focus::Gpus);
    // The header is not a panel: nothing changes.
    let before = (a.selected_row, a.focus);
    a.click(0, 0);
    assert_eq!((a.selected_row, a.focus), before);
}

/// The help overlay shows every key and its legends at 120×40; where no width makes it fit
/// (80×24) it scrolls (issue 34): j/k and PgUp/PgDn move it, its bottom edge says where it is,
/// and `/` keeps only the lines that mention what is typed.
#[test]
fn help_fits_120x40_and_scrolls_and_filters_at_80x24() {
    use crossterm::event::KeyCode;
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    a.update(Action::ToggleHelp);
    let big = render_text(&a, 120, 40);
    for want in [
        "q Ctrl-C :q",
        "close what is on top",
        "recompute the selected block",
        "+offload-opt",
    ] {
        assert!(big.contains(want), "{want} missing:\n{big}");
    }
    assert!(!big.contains("lines 1–"), "{big}");
    a.screen = (80, 24);
    let small = render_text(&a, 80, 24);
    assert!(small.contains("lines 1–21 of"), "{small}");
    assert!(
        !small.contains("q Ctrl-C :q"),
        "the last key is below:\n{small}"
    );
    press(&mut a, KeyCode::PageDown);
    press(&mut a, KeyCode::PageDown);
    for _ in 0..5 {
        key(&mut a, 'j');
    }
    let end = render_text(&a, 80, 24);
    assert!(end.contains("q Ctrl-C :q"), "{end}");
    assert!(!end.contains("lines 1–"), "{end}");
    key(&mut a, 'k');
    press(&mut a, KeyCode::Home);
    assert!(render_text(&a, 80, 24).contains("lines 1–21 of"));
    // `/` filters the help as it is typed; keys typed there move nothing behind it.
    let row = a.selected_row;
    type_keys(&mut a, "/budget");
    let filtered = render_text(&a, 80, 24);
    assert!(
        filtered.contains("+ / -") && filtered.contains("help · /budget"),
        "{filtered}"
    );
    assert!(!filtered.contains("first / last row"), "{filtered}");
    assert!(!filtered.contains("lines 1–"), "it fits now:\n{filtered}");
    type_keys(&mut a, "\n");
    assert!(a.show_help && a.command.is_none());
    assert_eq!(a.selected_row, row);
    // Esc closes the help and drops the filter; `?` opens it whole.
    key(&mut a, '\u{1b}');
    assert!(!a.show_help && !a.quit);
    key(&mut a, '?');
    assert!(render_text(&a, 120, 40).contains("first / last row"));
    // While help is open the footer names help's keys, and `?` always.
    let footer = render_text(&a, 80, 24);
    assert!(
        footer.lines().last().unwrap().contains("/ filter"),
        "{footer}"
    );
}

/// Issue 34: the footer names the focused panel's keys: the operators' (Enter, /, n/N, p, R)
/// while they have the keys, not once Tab gives them to the GPUs; `? help` always.
#[test]
fn the_footer_follows_the_focused_panel() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let last = |a: &App| render_text(a, 80, 24).lines().last().unwrap().to_string();
    let ops = last(&a);
    for want in ["Enter open", "/ find", "p pin", "? help", "q quit"] {
        assert!(ops.contains(want), "{want}: {ops}");
    }
    a.update(Action::FocusNext);
    let gpus = last(&a);
    assert!(
        !gpus.contains("p pin") && !gpus.contains("/ find"),
        "{gpus}"
    );
    assert!(
        gpus.contains("+/- budget") && gpus.ends_with("? help  q quit"),
        "{gpus}"
    );
}

/// Every op kind shows whole in the operator table (`positional_embedding` as
/// `pos_embedding`, not `positional_e`).
#[test]
fn op_kinds_show_whole() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    a.update(Action::End);
    let screen = render_text(&a, 160, 48);
    assert!(screen.contains("cross_entropy"), "{screen}");
    a.update(Action::Home);
    let screen = render_text(&a, 160, 48);
    assert!(screen.contains("pos_embedding "), "{screen}");
    assert!(!screen.contains("positional_e"), "{screen}");
}

/// Issue 34: Esc closes what is on top and never quits; while help is open no key reaches the
/// panels beneath it; only `q` (and `:q`) quits.
#[test]
fn esc_backs_out_and_never_quits() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let row = a.selected_row;
    let settings = a.settings();
    key(&mut a, '?');
    assert!(a.show_help);
    for c in "jjjjjjjj+b".chars() {
        key(&mut a, c);
    }
    assert_eq!(a.selected_row, row, "j under the help moved the selection");
    assert_eq!(
        a.settings(),
        settings,
        "keys under the help changed the plan"
    );
    key(&mut a, '\u{1b}');
    assert!(!a.show_help && !a.quit, "Esc closes the help and only that");
    key(&mut a, '\u{1b}');
    assert!(!a.quit, "Esc at the top level quits nothing");
    assert!(render_text(&a, 120, 40).contains("nothing to close: q quits"));
    // The operator's choices and the command line close the same way.
    a.update(Action::Toggle);
    key(&mut a, '\u{1b}');
    assert!(!a.quit);
    type_keys(&mut a, ":budg\x1b");
    assert!(a.command.is_none() && !a.quit);
    type_keys(&mut a, ":q\n");
    assert!(a.quit, ":q quits");
}

/// Issue 34: a budget without a unit is GiB (`:budget 20`, `--budget 20`), a unit may follow a
/// space, a bare `:budget` says the current one, and GPUs with different budgets show as a range.
#[test]
fn a_budget_without_a_unit_is_gib_and_differing_budgets_show_as_a_range() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    type_keys(&mut a, ":budget 20\n");
    assert_eq!(a.request.budgets, vec![20 * GIB; 8]);
    type_keys(&mut a, ":budget 12 GiB\n");
    assert_eq!(a.request.budgets, vec![12 * GIB; 8]);
    type_keys(&mut a, ":gpu 3 budget 40\n");
    assert_eq!(a.request.budgets[3], 40 * GIB);
    let screen = render_text(&a, 200, 60);
    assert!(
        screen.contains("budget 12.0 GiB–40.0 GiB per GPU"),
        "{screen}"
    );
    type_keys(&mut a, ":budget\n");
    assert_eq!(
        a.message.as_deref(),
        Some("budget 12.0 GiB–40.0 GiB per GPU")
    );
    let plan: serde_json::Value = serde_json::from_str(&stdout_ok(osdp().args([
        "plan",
        "sample-models/gpt2-medium.json",
        "--layout",
        "layouts/a100-80gb-8x-nvlink.json",
        "--budget",
        "20",
        "--json",
    ])))
    .unwrap();
    assert_eq!(plan["budget_bytes"], 20 * GIB, "{plan}");
}

/// Issue 34: with `NO_COLOR` the selected row and the focused panel still show: the row in
/// reverse video, the panel's border doubled. Two `j` presses must change the colourless screen.
#[test]
fn without_colour_the_selection_and_the_focus_still_show() {
    use ratatui::style::Modifier;
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
    let mut plain = |a: &App| {
        t.draw(|f| {
            osdp_tui::tui::view::draw(a, f);
            osdp_tui::tui::strip_colors(f.buffer_mut());
        })
        .unwrap();
        let b = t.backend().buffer().clone();
        // The rows that carry reverse video, and the screen's text.
        let width = b.area.width as usize;
        let reversed: std::collections::BTreeSet<usize> = b
            .content
            .iter()
            .enumerate()
            .filter(|(_, c)| c.modifier.contains(Modifier::REVERSED))
            .map(|(i, _)| i / width)
            .collect();
        let text: String = b.content.iter().map(|c| c.symbol()).collect();
        (reversed, text)
    };
    let (before, text) = plain(&a);
    assert!(!before.is_empty(), "no row is marked without colour");
    assert!(
        text.contains('═'),
        "the focused panel's border is not doubled"
    );
    key(&mut a, 'j');
    key(&mut a, 'j');
    let (after, _) = plain(&a);
    assert_ne!(before, after, "j j left the colourless screen as it was");
    // Tab gives the keys to the GPU panel: its border doubles, the operators' goes plain.
    a.update(Action::FocusNext);
    let (_, tabbed) = plain(&a);
    assert_ne!(text, tabbed);
}

fn ctrl_key(a: &mut App, c: char) {
    a.key(
        crossterm::event::KeyCode::Char(c),
        crossterm::event::KeyModifiers::CONTROL,
    );
}

/// Issue 34, item 7: the command line edits as a shell's does (Left/Right, Home/End, Ctrl-U,
/// Ctrl-W, Ctrl-C), keeps a history on Up/Down, completes command and operator names on Tab,
/// and `:w` takes `~` and quoted paths with spaces, asking before it overwrites a file.
#[test]
fn the_command_line_edits_recalls_completes_and_asks_before_overwriting() {
    use crossterm::event::{KeyCode, KeyModifiers};
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let text = |a: &App| a.command.as_ref().map(|l| l.text()).unwrap_or_default();
    // Typed wrong, mended in the middle: `budget 2GiB` → `budget 12GiB`.
    type_keys(&mut a, ":budget 2GiB");
    for _ in 0..4 {
        press_in_line(&mut a, KeyCode::Left);
    }
    type_keys(&mut a, "1");
    assert_eq!(text(&a), "budget 12GiB");
    assert!(render_text(&a, 120, 40).contains(":budget 12GiB"));
    type_keys(&mut a, "\n");
    assert_eq!(a.request.budgets, vec![12 * GIB; 8]);
    // Ctrl-W drops the last word, Ctrl-U all before the cursor, Ctrl-C closes the line without
    // quitting.
    type_keys(&mut a, ":split 2");
    ctrl_key(&mut a, 'w');
    assert_eq!(text(&a), "split ");
    press_in_line(&mut a, KeyCode::Home);
    type_keys(&mut a, "x");
    press_in_line(&mut a, KeyCode::End);
    type_keys(&mut a, "4");
    assert_eq!(text(&a), "xsplit 4");
    ctrl_key(&mut a, 'u');
    assert_eq!(text(&a), "");
    ctrl_key(&mut a, 'c');
    assert!(a.command.is_none() && !a.quit);
    assert_eq!(a.request.max_split, 8);
    // History: Up brings back the last command; Enter runs it again.
    type_keys(&mut a, ":split 2\n:budget 20\n");
    type_keys(&mut a, ":");
    press_in_line(&mut a, KeyCode::Up);
    assert_eq!(text(&a), "budget 20");
    press_in_line(&mut a, KeyCode::Up);
    assert_eq!(text(&a), "split 2");
    press_in_line(&mut a, KeyCode::Down);
    press_in_line(&mut a, KeyCode::Down);
    assert_eq!(text(&a), "");
    press_in_line(&mut a, KeyCode::Up);
    press_in_line(&mut a, KeyCode::Up);
    a.key(KeyCode::Backspace, KeyModifiers::NONE);
    type_keys(&mut a, "4\n");
    assert_eq!(a.request.max_split, 4);
    // Tab: a command's name, then an operator's.
    type_keys(&mut a, ":mi");
    press_in_line(&mut a, KeyCode::Tab);
    assert_eq!(text(&a), "micro ");
    ctrl_key(&mut a, 'u');
    type_keys(&mut a, "op h11.attn.c_p");
    press_in_line(&mut a, KeyCode::Tab);
    assert_eq!(text(&a), "op h11.attn.c_proj ");
    type_keys(&mut a, "\n");
    let op = a
        .model
        .ops
        .iter()
        .position(|o| o.id == "h11.attn.c_proj")
        .unwrap();
    assert_eq!(a.selected(), Some(Row::Op(op)), ":op selects the operator");
    // Several names: Tab lists them beside the line.
    type_keys(&mut a, ":op h11.attn.c_");
    press_in_line(&mut a, KeyCode::Tab);
    let screen = render_text(&a, 200, 60);
    assert!(
        screen.contains("h11.attn.c_attn  h11.attn.c_proj"),
        "{screen}"
    );
    ctrl_key(&mut a, 'c');
    type_keys(&mut a, ":q\n");
    assert!(a.quit);

    // :w with a quoted path with a space, and with ~.
    let dir = tempfile::tempdir().unwrap();
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 4 * GIB);
    let spaced = dir.path().join("my plans");
    std::fs::create_dir(&spaced).unwrap();
    let path = spaced.join("a b.json");
    type_keys(&mut a, &format!(":w \"{}\"\n", path.display()));
    assert!(path.is_file(), "{:?}", a.message);
    // At 80 columns the long message wraps onto the rows it needs, whole, broken between
    // words (it was cut after 79 columns).
    let screen = render_text(&a, 80, 24);
    let rows: Vec<&str> = screen.lines().collect();
    let message = a.message.clone().unwrap();
    assert!(message.chars().count() > 79, "{message}");
    let footer = rows[rows.len() - 3..].join(" ");
    let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words(&footer).ends_with(&words(&message)), "{screen}");
    assert!(rows.iter().all(|r| r.chars().count() <= 80));
    // Again onto the same file: a question first; n leaves it as it was, y writes.
    std::fs::write(&path, "mine").unwrap();
    type_keys(&mut a, &format!(":w '{}'\n", path.display()));
    let screen = render_text(&a, 120, 40);
    assert!(screen.contains("exists: overwrite it"), "{screen}");
    key(&mut a, 'n');
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "mine");
    type_keys(&mut a, &format!(":w '{}'\n", path.display()));
    key(&mut a, 'y');
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains("model_fingerprint"));
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    // SAFETY: no other thread of this test reads HOME while it is set.
    let old = std::env::var_os("HOME");
    unsafe { std::env::set_var("HOME", &home) };
    type_keys(&mut a, ":write ~/p.json\n");
    match old {
        Some(h) => unsafe { std::env::set_var("HOME", h) },
        None => unsafe { std::env::remove_var("HOME") },
    }
    assert!(home.join("p.json").is_file(), "{:?}", a.message);
}

fn press_in_line(a: &mut App, code: crossterm::event::KeyCode) {
    a.key(code, crossterm::event::KeyModifiers::NONE);
}

/// Issue 34, item 10: `/` filters the operator list by name or strategy as it is typed, the
/// title says where the cursor is (`4/246`, `2/24 matches`), Esc gives the whole list back
/// with the cursor kept, and `n`/`N` go to the next and previous match in it.
#[test]
fn slash_filters_the_operators_and_n_jumps_between_matches() {
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    let ops = a.model.ops.len();
    let title = |a: &App| {
        let screen = render_text(a, 120, 40);
        screen
            .lines()
            .find(|l| l.contains(" operators "))
            .unwrap_or_else(|| panic!("{screen}"))
            .to_string()
    };
    assert!(title(&a).contains(&format!("/{ops} ")), "{}", title(&a));
    type_keys(&mut a, "/c_proj");
    let shown = a.rows();
    assert_eq!(shown.len(), 48, "24 blocks × attn and mlp c_proj");
    assert!(shown
        .iter()
        .all(|r| matches!(r, Row::Op(i) if a.model.ops[*i].id.contains("c_proj"))));
    type_keys(&mut a, "\n");
    assert!(
        title(&a).contains("/c_proj · 1/48 matches"),
        "{}",
        title(&a)
    );
    key(&mut a, 'j');
    key(&mut a, 'j');
    assert!(title(&a).contains("3/48 matches"), "{}", title(&a));
    let at = a.selected();
    // Esc: the whole list, the same operator selected; n and N walk the matches in it.
    key(&mut a, '\u{1b}');
    assert!(a.op_filter.is_none());
    assert_eq!(a.selected(), at);
    assert!(a.rows().len() > 48);
    key(&mut a, 'n');
    let Some(Row::Op(next)) = a.selected() else {
        panic!()
    };
    assert_eq!(a.model.ops[next].id, "h1.mlp.c_proj");
    key(&mut a, 'N');
    key(&mut a, 'N');
    let Some(Row::Op(prev)) = a.selected() else {
        panic!()
    };
    assert_eq!(a.model.ops[prev].id, "h0.mlp.c_proj");
    assert!(render_text(&a, 120, 40).contains("match 2/48"));
    // By strategy: every op the plan shards with zero3.
    type_keys(&mut a, "/zero3\n");
    let plan = a.planned().unwrap().plan.clone();
    assert!(!a.rows().is_empty());
    for r in a.rows() {
        let Row::Op(i) = r else { panic!("{r:?}") };
        assert!(plan.choices[i].label().contains("zero3"));
    }
    // Nothing matches: said, and the whole list stays.
    key(&mut a, '\u{1b}');
    type_keys(&mut a, "/no-such-op\n");
    assert!(a.op_filter.is_none());
    assert!(render_text(&a, 120, 40).contains("no operator's name or strategy contains"));
}

/// Issue 34, item 10: a comparison longer than the screen scrolls (↑↓, PgUp/PgDn, Home/End),
/// its bottom edge saying which lines show; the keys do not move the operators beneath.
#[test]
fn a_long_comparison_scrolls() {
    use crossterm::event::KeyCode;
    let mut a = app("gpt2-medium", "a100-80gb-8x-nvlink", 8 * GIB);
    a.screen = (80, 24);
    a.compare = Some((0..60).map(|i| format!("compared line {i}")).collect());
    let row = a.selected_row;
    let screen = render_text(&a, 80, 24);
    assert!(screen.contains("lines 1–16 of 60"), "{screen}");
    assert!(!screen.contains("compared line 16"), "{screen}");
    key(&mut a, 'j');
    press(&mut a, KeyCode::PageDown);
    let screen = render_text(&a, 80, 24);
    assert!(
        screen.contains("lines 18–33 of 60") && screen.contains("compared line 32"),
        "{screen}"
    );
    press(&mut a, KeyCode::End);
    assert!(render_text(&a, 80, 24).contains("compared line 59"));
    press(&mut a, KeyCode::Home);
    assert!(render_text(&a, 80, 24).contains("lines 1–16 of 60"));
    assert_eq!(a.selected_row, row);
    key(&mut a, '\u{1b}');
    assert!(a.compare.is_none() && !a.quit);
}

/// Issue 34, item 9: `:steps N` makes runs started here end after step N (the worker gets
/// `--steps=N`, so the training panel has an ETA); the header says what `s` will run. And
/// (the "Also" line) `:batch any` says what it is: one micro-batch a step, no accumulation,
/// which is why a fixed global batch can beat it.
#[test]
fn steps_n_ends_runs_started_here_and_any_says_what_it_means() {
    let dir = tempfile::tempdir().unwrap();
    let args = dir.path().join("args");
    let exe = dir.path().join("worker.sh");
    std::fs::write(
        &exe,
        format!("#!/bin/sh\necho \"$@\" > {}\n", args.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut a = dashboard_with(&exe, &dir.path().join("run"), 60);
    // The next run's length is in the title at every size.
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        let screen = render_text(&a, w, h);
        assert!(
            screen
                .lines()
                .next()
                .unwrap()
                .ends_with("run: idle · next: until stopped"),
            "{screen}"
        );
    }
    type_keys(&mut a, ":steps 40\n");
    for (w, h) in [(80, 24), (120, 40), (200, 60)] {
        let screen = render_text(&a, w, h);
        assert!(
            screen
                .lines()
                .next()
                .unwrap()
                .ends_with("run: idle · next: 40 steps"),
            "{screen}"
        );
    }
    type_keys(&mut a, ":steps\n");
    assert_eq!(a.message.as_deref(), Some("next run: 40 steps"));
    type_keys(&mut a, ":steps many\n");
    assert!(a.message.as_deref().unwrap().contains("a number of steps"));
    key(&mut a, 's');
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !args.exists() {
        a.poll_background();
        assert!(
            std::time::Instant::now() < deadline,
            "the worker never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    let given = std::fs::read_to_string(&args).unwrap();
    assert!(given.contains("--steps=40"), "{given}");

    type_keys(&mut a, ":batch any\n");
    assert!(
        a.message.as_deref().unwrap().contains("no accumulation"),
        "{:?}",
        a.message
    );
    assert_eq!(a.planned().unwrap().prediction.accumulation, 1);
}

/// Issue 34: `any` global batch means one thing everywhere: `plan --help`, `plan`'s report
/// (chosen, or offered beside the default), the dashboard's `--help`, its help and
/// `:batch any` all say "no accumulation, the fastest micro-batch that fits";
/// and the plan `plan --global-batch any` prints has no accumulation.
#[test]
fn any_global_batch_is_worded_alike_by_plan_and_the_dashboard() {
    let means = "no accumulation, the fastest micro-batch that fits";
    let one_line = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let plan_help = stdout_ok(osdp().args(["plan", "--help"]));
    assert!(
        one_line(&plan_help).contains(&format!("`any`: {means}")),
        "{plan_help}"
    );
    let dash_help = stdout_ok(osdp().args(["--help"]));
    assert!(
        one_line(&dash_help).contains(&format!("`any`: {means}")),
        "{dash_help}"
    );
    let model = "sample-models/gpt2.json";
    let layout = "layouts/a100-80gb-8x-nvlink.json";
    let any = stdout_ok(osdp().args(["plan", model, "--layout", layout, "--global-batch", "any"]));
    assert!(
        any.contains(&format!("global batch: any ({means})")),
        "{any}"
    );
    let plan_line = any
        .lines()
        .find(|l| l.contains("plan: global batch"))
        .unwrap();
    assert!(!plan_line.contains("accumulated"), "{plan_line}");
    let default = stdout_ok(osdp().args(["plan", model, "--layout", layout]));
    assert!(default.contains(&format!("(`any`: {means})")), "{default}");
    let help = osdp_tui::tui::keymap::help_lines(200, "").join(" ");
    assert!(
        one_line(&help).contains(&format!("any ({means})")),
        "{help}"
    );
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 80 * GIB);
    type_keys(&mut a, ":batch any\n");
    assert!(
        a.message.as_deref().unwrap_or_default().contains(means),
        "{:?}",
        a.message
    );
}

/// Issue 34: `:steps 20` and Enter typed while the dashboard starts reach it with the Enter as
/// a newline (the terminal was not raw yet), which the terminal library reads as Ctrl-J: the
/// line stayed open and the next key (`s`) was typed into it. Ctrl-J and Ctrl-M end a line.
#[test]
fn a_command_ended_by_a_newline_runs() {
    let mut a = app("gpt2", "a100-80gb-8x-nvlink", 80 * GIB);
    type_keys(&mut a, ":budget 20");
    ctrl_key(&mut a, 'j');
    assert!(a.command.is_none(), "the line is closed");
    assert_eq!(a.budget(), 20 * GIB);
    type_keys(&mut a, ":budget 21");
    ctrl_key(&mut a, 'm');
    assert_eq!(a.budget(), 21 * GIB);
}

/// GPT-2's 50,257-wide head on an H200: its choices popup says the GEMMs are priced at the
/// unaligned rate and what padding avoids it; a block's linear (1,024 × 3,072) says nothing.
#[test]
fn the_lm_heads_choices_say_its_gemms_are_unaligned() {
    let mut a = app("gpt2-medium", "h200-1x", 56 << 30);
    let screen_of = |a: &App| {
        let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
        t.draw(|f| osdp_tui::tui::view::draw(a, f)).unwrap();
        t.backend()
            .buffer()
            .content
            .iter()
            .map(|c| c.symbol())
            .collect::<String>()
    };
    let open = |a: &mut App, id: &str| {
        a.detail = None;
        let row = a
            .rows()
            .iter()
            .position(|r| matches!(r, Row::Op(op) if a.model.ops[*op].id == id))
            .unwrap_or_else(|| panic!("{id} has a row"));
        a.selected_row = row;
        a.update(Action::Toggle);
        assert!(a.detail.is_some(), "Enter opens {id}'s choices");
    };
    open(&mut a, "lm_head");
    let screen = screen_of(&a);
    assert!(
        screen.contains("50,257 × 1,024 is not a multiple of 8: GEMMs at 12 % of peak"),
        "{screen}"
    );
    assert!(screen.contains("50,304 × 1,024 would not be"), "{screen}");
    open(&mut a, "ln_f");
    assert!(!screen_of(&a).contains("not a multiple of 8"));
}
