//! Training from the dashboard, headless: the app's update/poll/draw loop on a `TestBackend`,
//! keys as a user presses them, and a real CPU worker process.

use std::time::{Duration, Instant};

use crossterm::event::{KeyCode, KeyModifiers};
use osdp_tui::cluster::read_layout;
use osdp_tui::model::read_model;
use osdp_tui::run::RunState;
use osdp_tui::supervisor::LaunchSpec;
use osdp_tui::tui::app::{App, Training};
use osdp_tui::tui::{action_for, render_text};

use super::root;

const MIB: u64 = 1 << 20;

fn dashboard(run_dir: &std::path::Path) -> App {
    let model_path = root().join("sample-models/tiny-gpt2.json");
    let model = read_model(&model_path).unwrap();
    let layout = read_layout(&root().join("layouts/cpu.json")).unwrap();
    let mut app = App::new(model, layout, vec![360 * MIB; 2], 8);
    app.batch = Some(4);
    let launch = LaunchSpec {
        exe: assert_cmd::cargo::cargo_bin("osdp-tui"),
        model: model_path,
        checkpoint_every: 3,
        hang_after: Duration::from_secs(120),
    };
    let mut app = app.with_training(Training::new(launch, run_dir.to_path_buf()));
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
    app.training.as_ref().unwrap().run.as_ref().expect("a run")
}

fn state(app: &App) -> RunState {
    app.training.as_ref().unwrap().state()
}

fn last_step(app: &App) -> u64 {
    let t = app.training.as_ref().unwrap();
    t.run
        .as_ref()
        .and_then(|r| r.status.last())
        .map_or(0, |p| p.step)
}

fn segments(app: &App) -> Vec<u64> {
    let t = app.training.as_ref().unwrap();
    t.run
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
    assert_eq!(state(&app), RunState::Running);

    press(&mut app, 'x');
    let screen = run_until(&mut app, "the stop", |a| state(a) == RunState::Idle);
    assert!(screen.contains("run: idle"), "{screen}");
    let latest = osdp_tui::train::checkpoint::latest(&run_dir.join("checkpoints"))
        .unwrap()
        .expect("a checkpoint");
    osdp_tui::train::checkpoint::load(&latest).expect("which loads");
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
    let predicted = app.training.as_ref().unwrap().run_plan.as_ref().unwrap();
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
    osdp_tui::train::checkpoint::load(std::path::Path::new(&checkpoint.1)).expect("not corrupted");
    press(&mut app, 'q');
    assert!(!app.quit, "quitting a running dashboard asks first");
    press(&mut app, 'y');
    run_until(&mut app, "the quit", |a| a.quit);
    assert_eq!(
        state(&app),
        RunState::Idle,
        "the run was stopped gracefully"
    );
}
