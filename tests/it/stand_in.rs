//! A dashboard with a run going, its worker a shell script that writes the metrics it is given
//! and prints log lines: what the run's panels show, without libtorch and the same on every
//! machine.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use osdp_core::cluster::read_layout;
use osdp_core::model::read_model;
use osdp_core::protocol::{DeviceMemory, MemoryBreakdown, WorkerEvent};
use osdp_tui::monitor::{GpuEvent, GpuSample};
use osdp_tui::supervisor::LaunchSpec;
use osdp_tui::tui::app::{Action, App, RunControl};

use crate::root;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// A `started` line of a run of `world_size` ranks that stops by itself at `last_step`.
pub fn started(world_size: usize, last_step: Option<u64>) -> String {
    serde_json::to_string(&WorkerEvent::Started {
        model: "stand-in".into(),
        world_size,
        global_batch: 8,
        first_step: 0,
        last_step,
        resumed_from: None,
        data: "text".into(),
        device: "cpu".into(),
    })
    .unwrap()
}

/// A `step` line: 0.2 s a step, each rank's executor peak `memory`, and on GPUs what the
/// allocator and NVML saw.
pub fn step(step: u64, memory: &[u64], device: Option<Vec<DeviceMemory>>) -> String {
    serde_json::to_string(&WorkerEvent::Step {
        step,
        loss: 5.0 - 0.25 * step as f64,
        grad_norm: 1.0,
        lr: 1e-3,
        step_time_s: 0.2,
        samples_per_s: 40.0,
        tokens_per_s: 5120.0,
        memory_bytes: memory.to_vec(),
        memory_breakdown: MemoryBreakdown::default(),
        device_memory: device,
    })
    .unwrap()
}

/// A worker script: rank 0 (or the only process) writes `metrics`, then prints `log_lines`
/// lines of log (`log line 1`, …), then whatever `more` prints, and waits to be stopped.
pub fn worker(dir: &Path, metrics: &[String], log_lines: usize, more: &str) -> PathBuf {
    let script = dir.join("worker.sh");
    let mut body = String::from(
        "#!/bin/sh\nwhile [ $# -gt 0 ]; do case \"$1\" in --metrics=*) metrics=${1#--metrics=};; esac; shift; done\n\
         if [ \"${RANK:-0}\" = 0 ]; then\n",
    );
    for l in metrics {
        body.push_str(&format!("echo '{l}' >> \"$metrics\"\n"));
    }
    body.push_str(&format!(
        "i=1; while [ $i -le {log_lines} ]; do echo \"log line $i\"; i=$((i+1)); done\n{more}\nfi\nexec sleep 600\n"
    ));
    std::fs::write(&script, body).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// `model` on `layout` at `budget` per GPU, with `gpus` fake NVML samples when given.
pub fn app(model: &str, layout: &str, budget: u64, gpus: Option<Vec<GpuSample>>) -> App {
    let m = read_model(&root().join(format!("sample-models/{model}.json"))).unwrap();
    let l = read_layout(&root().join(format!("layouts/{layout}.json"))).unwrap();
    let n = l.world_size() as usize;
    let mut a = App::new(m, l, vec![budget; n], 8);
    a.replan();
    if let Some(s) = gpus {
        a.apply_gpu(GpuEvent::Samples(s));
    }
    if let Some(p) = a.plan.as_mut() {
        p.elapsed_ms = 0.0;
    }
    a
}

/// Start a run of `exe` from `a` (as `s` does) in `run_dir`, which is emptied first: a path
/// relative to the crate, so that the screen shows the same name on every machine.
pub fn start(mut a: App, exe: PathBuf, run_dir: &str) -> App {
    let dir = root().join(run_dir);
    let _ = std::fs::remove_dir_all(&dir);
    let model = root().join(format!("sample-models/{}.json", a.model.name));
    let launch = LaunchSpec {
        exe,
        model,
        checkpoint_every: 1000,
        hang_after: Duration::from_secs(60),
        data: Default::default(),
    };
    a = a.with_run_control(RunControl::new(launch, PathBuf::from(run_dir)));
    a.update(Action::StartRun);
    assert!(a.message.is_none(), "{:?}", a.message);
    a
}

/// Poll `a` as the event loop does until `done`.
pub fn poll_until(a: &mut App, what: &str, done: impl Fn(&App) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        a.poll_background();
        if done(a) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The run's last step on screen.
pub fn last_step(a: &App) -> u64 {
    a.run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .and_then(|r| r.status.last())
        .map_or(0, |p| p.step)
}

/// Lines of the worker's log the dashboard has read.
pub fn log_len(a: &App) -> usize {
    a.log_tail().map_or(0, |t| t.len())
}

/// Set the screen's clock `secs` after the worker began, so that the elapsed time reads the
/// same on every run.
pub fn at(a: &mut App, secs: u64) {
    let began = a
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .and_then(|r| r.began_at())
        .expect("a run that began");
    a.now = began + Duration::from_secs(secs);
}

/// `screen` with the text between each `from` and the next `to` on its line replaced by `#`:
/// a line with a figure measured by the clock (how long the first step took), up to the
/// panel's border, so that what is masked has the same width every time.
pub fn mask(screen: &str, from: &str, to: &str) -> String {
    let mut out = String::new();
    let mut rest = screen;
    while let Some(i) = rest.find(from) {
        let start = i + from.len();
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if let Some(j) = rest.find(to).filter(|&j| !rest[..j].contains('\n')) {
            out.extend(std::iter::repeat_n('#', rest[..j].chars().count()));
            rest = &rest[j..];
        }
    }
    out.push_str(rest);
    out
}

/// Fake NVML readings of `n` GPUs: `used` each, of 24 GiB, the rank's process on it.
pub fn gpus(n: usize, used: u64) -> Vec<GpuSample> {
    (0..n)
        .map(|i| GpuSample {
            index: i,
            name: "NVIDIA GeForce RTX 4090".into(),
            used_bytes: Some(used),
            total_bytes: Some(24 * GIB),
            utilization_pct: Some(97),
            processes: vec![(4000 + i as u32, Some(used - GIB / 2))],
            compute_capability: None,
        })
        .collect()
}
