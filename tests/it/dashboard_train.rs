//! RunControl from the dashboard, headless: the app's update/poll/draw loop on a `TestBackend`,
//! keys as a user presses them, and a real CPU worker process.

use std::time::{Duration, Instant};

use crossterm::event::{KeyCode, KeyModifiers};
use osdp_core::cluster::read_layout;
use osdp_core::model::read_model;
use osdp_tui::run::RunState;
use osdp_tui::supervisor::LaunchSpec;
use osdp_tui::tui::app::{App, RunControl};
use osdp_tui::tui::{action_for, render_text};

use super::root;

const MIB: u64 = 1 << 20;

fn dashboard(run_dir: &std::path::Path) -> App {
    let model_path = root().join("sample-models/tiny-gpt2.json");
    let model = read_model(&model_path).unwrap();
    let layout = read_layout(&root().join("layouts/cpu.json")).unwrap();
    let mut app = App::new(model, layout, vec![360 * MIB; 2], 8);
    app.request.batch = Some(4);
    let launch = LaunchSpec {
        exe: assert_cmd::cargo::cargo_bin("osdp-tui"),
        model: model_path,
        checkpoint_every: 3,
        hang_after: Duration::from_secs(120),
        data: Default::default(),
    };
    let mut app = app.with_run_control(RunControl::new(launch, run_dir.to_path_buf()));
    app.replan();
    app
}

fn press(app: &mut App, c: char) {
    let action = action_for(KeyCode::Char(c), KeyModifiers::NONE).expect("a mapped key");
    app.update(action);
}

/// Poll and draw (as the event loop does) until `done` holds; the screen when it does.
fn run_until(app: &mut App, what: &str, done: impl Fn(&App) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        app.poll_background();
        let screen = render_text(app, 140, 44);
        if done(app) {
            return screen;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{screen}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run(app: &App) -> &osdp_tui::supervisor::Supervisor {
    app.run_control
        .as_ref()
        .unwrap()
        .supervisor
        .as_ref()
        .expect("a run")
}

fn state(app: &App) -> RunState {
    app.run_control.as_ref().unwrap().state()
}

fn last_step(app: &App) -> u64 {
    let t = app.run_control.as_ref().unwrap();
    t.supervisor
        .as_ref()
        .and_then(|r| r.status.last())
        .map_or(0, |p| p.step)
}

fn segments(app: &App) -> Vec<u64> {
    let t = app.run_control.as_ref().unwrap();
    t.supervisor
        .as_ref()
        .map(|r| r.status.segments.clone())
        .unwrap_or_default()
}

#[test]
fn start_replan_restart_and_stop_keep_the_step_count_and_the_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut app = dashboard(&run_dir);
    assert_eq!(state(&app), RunState::Idle);

    press(&mut app, 's');
    let screen = run_until(&mut app, "steps", |a| last_step(a) >= 4);
    assert!(
        screen.contains("run: running") || screen.contains("run: checkpointing"),
        "{screen}"
    );
    assert!(screen.contains("loss by step"), "{screen}");
    assert!(
        screen.contains("the run uses the plan on screen"),
        "{screen}"
    );

    // Lower the budget until the planner changes the plan; the panel says the run differs.
    let mut presses = 0;
    while !app.plan_differs_from_run() {
        press(&mut app, '-');
        presses += 1;
        assert!(presses < 5, "the plan never changed");
    }
    let screen = run_until(&mut app, "a redraw", |_| true);
    assert!(screen.contains("differs from the run's"), "{screen}");

    press(&mut app, 'r');
    run_until(&mut app, "the restart", |a| {
        segments(a).len() == 2
            && state(a) == RunState::Running
            && last_step(a) > run(a).status.segments[1]
    });
    let resumed_at = segments(&app)[1];
    assert!(
        resumed_at >= 4,
        "restarted from the checkpoint, not from 0: {resumed_at}"
    );
    assert!(
        !app.plan_differs_from_run(),
        "the run now uses the plan on screen"
    );
    let status = &run(&app).status;
    let steps: Vec<u64> = status.steps.iter().map(|p| p.step).collect();
    assert_eq!(
        steps,
        (1..=steps.len() as u64).collect::<Vec<_>>(),
        "no gap, no reset"
    );
    let before = status.steps[resumed_at as usize - 1].loss;
    let after = status.steps[resumed_at as usize].loss;
    assert!(
        (before - after).abs() < 0.5,
        "the loss continues: {before} then {after}"
    );

    // A restart that would change the global batch asks first; n keeps the run as it is.
    press(&mut app, 'B');
    run_until(&mut app, "the new plan", |a| !a.pending);
    press(&mut app, 'r');
    let screen = run_until(&mut app, "the question", |_| true);
    assert!(
        screen.contains("restarting changes the global batch from 8 to 2"),
        "{screen}"
    );
    press(&mut app, 'n');
    std::thread::sleep(Duration::from_millis(300));
    let screen = run_until(&mut app, "a redraw", |_| true);
    assert_eq!(segments(&app).len(), 2, "no restart after n:\n{screen}");
    // Still the same run: stepping, or writing one of its periodic checkpoints.
    assert!(
        matches!(state(&app), RunState::Running | RunState::Checkpointing),
        "the run goes on after n:\n{screen}"
    );

    press(&mut app, 'x');
    let screen = run_until(&mut app, "the stop", |a| state(a) == RunState::Stopped);
    assert!(screen.contains("run: stopped"), "{screen}");
    let latest = osdp_train::checkpoint::latest(&run_dir.join("checkpoints"))
        .unwrap()
        .expect("a checkpoint");
    osdp_train::checkpoint::load(&latest).expect("which loads");
    let stream = osdp_tui::run::read_status(&run_dir).unwrap();
    assert_eq!(
        stream.last().unwrap().step,
        last_step(&app),
        "the full metrics stream"
    );
    assert_eq!(stream.ended.as_deref(), Some("signal"));
    // The same figures from another terminal.
    let out = super::osdp().arg("status").arg(&run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("step {} · loss", last_step(&app))),
        "{text}"
    );
    let predicted = app.run_control.as_ref().unwrap().run_plan.as_ref().unwrap();
    let expected = format!(
        "predicted by the plan: {:.1} samples/s",
        predicted.prediction.throughput_samples_per_s
    );
    assert!(text.contains(&expected), "{text}");
    assert!(text.contains("state: stopped (signal)"), "{text}");
}

#[test]
fn a_worker_killed_from_outside_shows_as_failed_and_r_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut app = dashboard(&run_dir);
    press(&mut app, 's');
    run_until(&mut app, "a checkpoint", |a| {
        run(a).status.last_checkpoint.is_some() && last_step(a) >= 4
    });
    let pid = run(&app).pid().unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t0 = Instant::now();
    let screen = run_until(&mut app, "the failure", |a| {
        matches!(state(a), RunState::Failed { .. })
    });
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "noticed within seconds"
    );
    assert!(screen.contains("run: failed"), "{screen}");
    assert!(screen.contains("killed"), "{screen}");
    assert!(
        screen.contains("  training tiny-gpt2 from step 0"),
        "the log tail: {screen}"
    );
    let checkpoint = run(&app).status.last_checkpoint.clone().unwrap();

    press(&mut app, 'r');
    run_until(&mut app, "the resumed run", |a| {
        state(a) == RunState::Running && segments(a).len() == 2 && last_step(a) > checkpoint.0
    });
    assert_eq!(
        segments(&app)[1],
        checkpoint.0,
        "resumed from the last good checkpoint"
    );
    osdp_train::checkpoint::load(std::path::Path::new(&checkpoint.1)).expect("not corrupted");
    press(&mut app, 'q');
    assert!(!app.quit, "quitting a running dashboard asks first");
    press(&mut app, 's');
    run_until(&mut app, "the quit", |a| a.quit);
    assert_eq!(
        state(&app),
        RunState::Stopped,
        "the run was stopped gracefully"
    );
    assert_eq!(
        osdp_tui::run::read_status(&run_dir)
            .unwrap()
            .ended
            .as_deref(),
        Some("signal")
    );
}

/// The acceptance path: start a run, quit detaching it, reopen (the run is followed, not
/// restarted), `x` there stops it with a checkpoint.
#[test]
fn a_detached_run_keeps_training_and_a_later_dashboard_attaches_and_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut app = dashboard(&run_dir);
    press(&mut app, 's');
    run_until(&mut app, "steps", |a| last_step(a) >= 2);
    let pid = run(&app).pid().unwrap();
    press(&mut app, 'q');
    press(&mut app, 'd');
    assert!(app.quit);
    drop(app);

    let mut later = dashboard(&run_dir);
    let seen = last_step(&later);
    let screen = run_until(&mut later, "steps trained while detached", |a| {
        last_step(a) > seen + 1
    });
    assert!(
        screen.contains(&format!("attached, read-only: run owned by pid {pid} on ")),
        "{screen}"
    );
    assert_eq!(
        run(&later).pid(),
        Some(pid),
        "the same worker, not a new one"
    );
    press(&mut later, 'x');
    let screen = run_until(&mut later, "the stop", |a| state(a) == RunState::Stopped);
    assert!(screen.contains("run: stopped"), "{screen}");
    let status = osdp_tui::run::read_status(&run_dir).unwrap();
    assert_eq!(status.ended.as_deref(), Some("signal"));
    assert_eq!(status.segments, vec![0], "one run, never restarted");
    let (step, path) = status
        .last_checkpoint
        .clone()
        .expect("a checkpoint at the stop");
    assert_eq!(step, status.last().unwrap().step);
    osdp_train::checkpoint::load(std::path::Path::new(&path)).expect("which loads");
    // SAFETY: waitpid on this test's own (exited) child; no memory is shared.
    unsafe {
        libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
    }
}

/// A worker started by hand with a lifeline: when the line closes without a word (its
/// dashboard crashed, was killed), it finishes its step, checkpoints and exits 0; after
/// `detach`, it trains on.
#[test]
fn a_worker_stops_when_its_dashboard_dies_and_runs_on_when_it_detaches() {
    use osdp_tui::lifeline::Lifeline;
    use std::os::unix::io::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    super::stdout_ok(
        super::osdp()
            .args([
                "plan",
                "sample-models/tiny-gpt2.json",
                "--layout",
                "layouts/cpu.json",
                "--budget",
                "360MiB",
                "--batch",
                "4",
                "-o",
            ])
            .arg(&plan),
    );
    for detach in [false, true] {
        let run_dir = dir.path().join(format!("run-{detach}"));
        std::fs::create_dir_all(&run_dir).unwrap();
        let (line, line_end) = Lifeline::new().unwrap();
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("osdp-tui"));
        cmd.arg("train")
            .arg(root().join("sample-models/tiny-gpt2.json"))
            .arg(format!("--plan={}", plan.display()))
            .args(["--world-size=2", "--steps=0"])
            .arg(format!(
                "--metrics={}",
                run_dir.join("metrics.jsonl").display()
            ))
            .arg(format!(
                "--checkpoint-dir={}",
                run_dir.join("checkpoints").display()
            ))
            .arg(format!("--supervisor-fd={}", line_end.as_raw_fd()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        osdp_tui::lifeline::inherit(&mut cmd, line_end.as_raw_fd());
        let mut child = cmd.spawn().unwrap();
        drop(line_end);
        let steps = || {
            osdp_tui::run::read_status(&run_dir)
                .ok()
                .and_then(|s| s.last().map(|p| p.step))
                .unwrap_or(0)
        };
        let wait_for = |what: &str, done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(90);
            while !done() {
                assert!(Instant::now() < deadline, "timed out waiting for {what}");
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        wait_for("a step", &|| steps() >= 1);
        if detach {
            line.detach();
            let now = steps();
            wait_for("more steps", &|| steps() >= now + 2);
            assert!(child.try_wait().unwrap().is_none(), "it trains on");
            // SAFETY: kill(2) on this test's child.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        } else {
            drop(line);
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            stderr.contains("the dashboard that started this run is gone"),
            !detach,
            "{stderr}"
        );
        let status = osdp_tui::run::read_status(&run_dir).unwrap();
        assert_eq!(status.ended.as_deref(), Some("signal"));
        assert!(status.last_checkpoint.is_some(), "a checkpoint at the stop");
    }
}
