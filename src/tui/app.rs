//! Dashboard state: plain data changed only by [`App::update`]; drawing reads it.

use std::collections::{HashSet, VecDeque};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use crate::monitor::{GpuEvent, GpuSample};
use osdp_core::cluster::Layout;
use osdp_core::cost::{self, Choice, Machine, Strategy};
use osdp_core::model::ModelSpec;
use osdp_core::plan::{Blocks, Planned, Request};
use osdp_core::units;

use super::cmdline::{CommandLine, Edit, Prompt};
use super::planner_thread::{Job, PlanReady, PlannerThread};

const GIB: u64 = 1 << 30;
/// Samples of GPU memory kept for the sparklines.
const HISTORY: usize = 120;

/// Where the last frame drew the panels a click can land on (drawing sets it; a click reads it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitMap {
    /// The operator table, and the first row it showed.
    pub ops: ratatui::layout::Rect,
    pub ops_offset: usize,
    pub gpus: ratatui::layout::Rect,
}

/// What fills the screen under the header: the plan (operators, GPUs and a chart side by side),
/// or one panel on its own, as k9s switches views (`1`–`4`, `v` the next).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum View {
    #[default]
    Plan,
    Graph,
    Gpus,
    Training,
}

impl View {
    pub const ALL: [View; 4] = [View::Plan, View::Graph, View::Gpus, View::Training];

    pub fn name(self) -> &'static str {
        match self {
            View::Plan => "plan",
            View::Graph => "graph",
            View::Gpus => "GPUs",
            View::Training => "training",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Ops,
    Gpus,
}

/// What the user (or a background job) asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    RaiseBudget,
    LowerBudget,
    SplitUp,
    SplitDown,
    CycleBatch,
    /// The global batch: highest throughput (none fixed), then GPUs × 1, 2, 4, … 1024.
    CycleGlobalBatch,
    CyclePin,
    /// Fix the selected block's recomputation against the plan's choice (again: the planner
    /// decides).
    ToggleRecompute,
    FocusNext,
    Up,
    Down,
    PageUp,
    PageDown,
    /// To the first row (the top of the log).
    Home,
    /// To the last row (the log's tail, which the view then follows).
    End,
    Toggle,
    ToggleHelp,
    ToggleGraph,
    /// Open or close the worker's log.
    ToggleLog,
    /// Start a training run with the plan on screen.
    StartRun,
    /// Stop the run gracefully (checkpoint, exit); again: kill it.
    StopRun,
    /// Stop, checkpoint, start again from the checkpoint under the plan on screen.
    RestartRun,
    /// Answer a question the screen asked (any other key says no).
    Yes,
    /// Quit leaving the run going (the answer `d` to quitting with a run going).
    Detach,
    /// Close what is on top (help, a question, an operator's choices, the comparison, the
    /// log); at the top level nothing: only `q` quits (Esc).
    Back,
    /// Open the command line (`:budget 40GiB`, `:gpu 3 budget 20GiB`, `:batch 512`, …).
    OpenCommand,
    /// Show one view under the header (`1`–`4`).
    ShowView(View),
    /// The next view (`v`).
    NextView,
    /// Put back the settings before the last change (budget, split, batch, pins, recompute).
    Undo,
    /// Write the plan on screen to a file.
    WritePlan,
    /// Write the plan on screen for PyTorch FSDP2 (`osdp_torch.apply_plan`).
    ExportPlan,
    /// Compare the plan on screen with the running one (again: close).
    Compare,
    /// `/`: find operators (the list shows only those); in help, filter it.
    Find,
    /// `n` / `N`: the next / previous operator the last find matches.
    NextMatch,
    PrevMatch,
    Quit,
}

/// Changes `u` can take back.
const UNDO_DEPTH: usize = 100;

/// The commands of the command line, for its help and its errors.
pub const COMMANDS: &str = "budget [SIZE] · gpu N budget SIZE · batch N|any · micro N|auto · \
                            split K · steps N · target osdp|fsdp2 · op NAME · write [PATH] · \
                            export [PATH] · q (SIZE: 20GiB, 20 GiB, 1.5TiB; a bare number is GiB)";

/// The command names Tab completes.
pub const COMMAND_NAMES: &[&str] = &[
    "batch", "budget", "export", "gpu", "micro", "op", "q", "quit", "split", "steps", "target",
    "write",
];

/// What `any` global batch means, said when it is chosen: the planner takes one micro-batch a
/// step, so a fixed global batch (with accumulation, which spreads the optimizer step and the
/// gradient sync over more samples) can be a little faster.
pub const ANY_BATCH: &str = "global batch any: no accumulation, the fastest micro-batch that \
                             fits; a fixed global batch with accumulation can be a little faster \
                             (B or :batch N)";

/// The length of the next run in words.
pub fn steps_words(steps: u64) -> String {
    match steps {
        0 => "next run: until stopped (:steps N ends it after step N)".into(),
        n => format!("next run: {n} steps"),
    }
}

/// The operator pane: every choice of one op, priced in the plan on screen.
#[derive(Debug, Clone)]
pub struct OpDetail {
    pub op: usize,
    pub alternatives: Vec<osdp_core::plan::explain::Alternative>,
}

/// A question waiting for y/n.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirm {
    /// `w` or `:write PATH` onto a file that exists.
    Overwrite(std::path::PathBuf),
    /// `e` or `:export PATH` onto a file that exists.
    OverwriteExport(std::path::PathBuf),
    /// The plan on screen is still being priced.
    StartUnpriced,
    /// A run is going: detach (it keeps going), stop it and quit, or stay.
    QuitWhileRunning,
    /// Restarting under the plan on screen would change the run's global batch (samples per
    /// optimizer step), which changes how it converges.
    RestartNewBatch { from: u64, to: u64 },
}

/// Launching training from the dashboard: where runs go and how workers start.
pub struct RunControl {
    /// Worker binary, model file, checkpoint period, hang limit.
    pub spec: crate::supervisor::LaunchSpec,
    pub dir: crate::run::RunDir,
    pub supervisor: Option<crate::supervisor::Supervisor>,
    /// The plan the run uses and its prediction (the screen's may have moved on).
    pub run_plan: Option<Planned>,
    /// The plan in the run directory, for a run this dashboard found there (not started).
    found_plan: Option<osdp_core::plan::Plan>,
    restart_pending: bool,
    quit_when_stopped: bool,
    /// The footer says what `x` is waiting for; the run's end replaces it.
    stop_notice: bool,
}

impl RunControl {
    /// RunControl into run directory `dir`; a run already there is shown, and followed
    /// read-only while its worker lives.
    pub fn new(spec: crate::supervisor::LaunchSpec, dir: std::path::PathBuf) -> RunControl {
        let dir = crate::run::RunDir(dir);
        RunControl {
            supervisor: crate::supervisor::Supervisor::open(dir.clone(), spec.hang_after),
            spec,
            dir,
            run_plan: None,
            found_plan: None,
            restart_pending: false,
            quit_when_stopped: false,
            stop_notice: false,
        }
    }

    pub fn is_live(&self) -> bool {
        self.supervisor.as_ref().is_some_and(|r| r.is_live())
    }

    pub fn state(&self) -> crate::run::RunState {
        match &self.supervisor {
            Some(r) => r.state.clone(),
            None => crate::run::RunState::Idle,
        }
    }

    /// The run's state in a word: `finished` for a run that ended by reaching its last step,
    /// which [`crate::run::RunState`] calls stopped like one stopped by `x` or a signal.
    pub fn state_label(&self) -> &'static str {
        let state = self.state();
        let completed = self
            .supervisor
            .as_ref()
            .is_some_and(|r| r.status.ended.as_deref() == Some("completed"));
        if state == crate::run::RunState::Stopped && completed {
            "finished"
        } else {
            state.label()
        }
    }

    /// Who holds the run, when another process does (this dashboard only follows it).
    pub fn owner(&self) -> Option<&crate::run::lock::LockOwner> {
        self.supervisor.as_ref().and_then(|r| r.owner())
    }
}

/// Why this dashboard cannot start or restart a run another process holds.
pub fn owned_by(owner: &crate::run::lock::LockOwner) -> String {
    if owner.local {
        format!("run owned by {owner}; stop it there or x here to ask it to stop")
    } else {
        format!("run owned by {owner}; stop it there")
    }
}

/// The worker's log on screen, and where the user scrolled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogView {
    /// The first line shown, as a position in the log (see [`crate::run::LogTail::dropped`]);
    /// `None`: the view follows the tail.
    pub top: Option<u64>,
}

/// Rows of the screen the log view does not use: header, title and bottom borders, footer.
pub const LOG_VIEW_CHROME_ROWS: u16 = 4;

/// One line of the operator list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    Block(usize),
    Op(usize),
}

#[derive(Debug, Clone, PartialEq)]
pub enum GpuView {
    /// Why there are no live samples (no driver, ...).
    Unavailable(String),
    Live(Vec<GpuSample>),
}

pub struct App {
    pub model: Arc<ModelSpec>,
    pub layout: Layout,
    pub machine: Machine,
    pub blocks: Blocks,
    /// What to plan, as the user set it (budgets per GPU, split, batch, pins, recomputation).
    pub request: Request,
    pub plan: Option<PlanReady>,
    pub pending: bool,
    pub focus: Focus,
    pub selected_row: usize,
    pub selected_gpu: usize,
    pub expanded: HashSet<usize>,
    pub gpus: GpuView,
    pub history: Vec<VecDeque<u64>>,
    pub show_help: bool,
    /// The first line of help on screen (j/k, PgUp/PgDn scroll it).
    pub help_scroll: usize,
    /// Help shows only the lines that mention this (`/` in help); empty: all.
    pub help_filter: String,
    /// The operator list shows only the operators whose name or strategy contains this (`/`).
    pub op_filter: Option<String>,
    /// What the last `/` looked for: `n` and `N` go to its next and previous match.
    pub last_find: Option<String>,
    /// The first line of the comparison on screen.
    pub compare_scroll: usize,
    /// The worker's log, when open (`l`).
    pub log_view: Option<LogView>,
    /// The clock the screen reads (elapsed time, ETA): set as the loop polls, so that drawing
    /// is a function of the app alone.
    pub now: std::time::Instant,
    /// The terminal's size (columns, rows) as last drawn: how far a page scrolls.
    pub screen: (u16, u16),
    /// The operator whose choices are on screen (Enter on an operator; Enter or Esc closes),
    /// priced once per plan, not per frame.
    pub detail: Option<OpDetail>,
    /// Show the selected block's graph instead of the frontier chart (short screens).
    pub show_graph: bool,
    pub quit: bool,
    /// What to print once the terminal is given back (after `q` → `d`: where the run goes on
    /// and how to follow it).
    pub farewell: Option<String>,
    /// The layout as the user named it (`--layout`), for the command that reattaches.
    pub layout_arg: Option<String>,
    /// The step runs started here end after (`:steps N`, `--steps`); 0: until stopped.
    pub run_steps: u64,
    /// A line about where the layout came from (e.g. "no NVIDIA driver found; planning for …").
    pub notice: Option<String>,
    /// RunControl from the dashboard, when the dashboard knows the model file.
    pub run_control: Option<RunControl>,
    /// A y/n question on screen.
    pub confirm: Option<Confirm>,
    /// The answer to the last action that could not be done as asked.
    pub message: Option<String>,
    /// The command line (`:`) or a search prompt (`/`) while it is open.
    pub command: Option<CommandLine>,
    /// The commands run, oldest first (Up and Down on the command line).
    pub command_history: Vec<String>,
    /// Settings before each change, newest last (`u`).
    pub undo: Vec<Request>,
    /// The comparison of the plan on screen with the running one, while it is open (`c`).
    pub compare: Option<Vec<String>>,
    /// What fills the screen under the header.
    pub view: View,
    /// The panels as last drawn, for mouse clicks.
    pub hit: std::cell::Cell<HitMap>,
    next_request: u64,
    planner: Option<PlannerThread>,
    gpu_rx: Option<Receiver<GpuEvent>>,
}

impl App {
    pub fn new(model: ModelSpec, layout: Layout, budgets: Vec<u64>, max_split: u32) -> App {
        let machine = Machine::new(&layout, &model);
        let blocks = Blocks::of(&model);
        let expanded = HashSet::from([0]);
        let mut app = App {
            model: Arc::new(model),
            layout,
            machine,
            blocks,
            request: Request::new(budgets, max_split),
            plan: None,
            pending: false,
            focus: Focus::Ops,
            selected_row: 0,
            selected_gpu: 0,
            expanded,
            gpus: GpuView::Unavailable("not polled yet".into()),
            history: Vec::new(),
            show_help: false,
            help_scroll: 0,
            help_filter: String::new(),
            op_filter: None,
            last_find: None,
            compare_scroll: 0,
            log_view: None,
            now: std::time::Instant::now(),
            screen: (120, 40),
            detail: None,
            show_graph: false,
            quit: false,
            farewell: None,
            layout_arg: None,
            run_steps: 0,
            notice: None,
            run_control: None,
            confirm: None,
            message: None,
            command: None,
            command_history: Vec::new(),
            undo: Vec::new(),
            compare: None,
            view: View::Plan,
            hit: std::cell::Cell::new(HitMap::default()),
            next_request: 0,
            planner: None,
            gpu_rx: None,
        };
        // The cursor starts on the first block, so the graph panel has a block to draw.
        app.selected_row = app
            .rows()
            .iter()
            .position(|r| matches!(r, Row::Block(_)))
            .unwrap_or(0);
        app
    }

    /// Plan on a background thread from now on (the interactive dashboard).
    pub fn with_planner_thread(mut self) -> App {
        self.planner = Some(PlannerThread::spawn(
            self.model.clone(),
            self.machine.clone(),
            self.layout.memory_bytes(),
        ));
        self.replan();
        self
    }

    pub fn with_gpu_events(mut self, rx: Receiver<GpuEvent>) -> App {
        self.gpu_rx = Some(rx);
        self
    }

    /// Launch training runs from this dashboard.
    pub fn with_run_control(mut self, t: RunControl) -> App {
        self.run_control = Some(t);
        self.read_found_plan();
        self
    }

    /// The plan of a run found in the run directory, to compare with the screen's.
    fn read_found_plan(&mut self) {
        if let Some(t) = self.run_control.as_mut() {
            t.found_plan = t
                .supervisor
                .as_ref()
                .and_then(|_| osdp_core::plan::read_plan(&t.dir.plan(), &self.model).ok());
        }
    }

    /// The current plan, when one fits.
    pub fn planned(&self) -> Option<&osdp_core::plan::Planned> {
        self.plan.as_ref().and_then(|r| r.result.as_ref().ok())
    }

    /// The budget the plan must fit: the tightest GPU's.
    /// The per-GPU budget in words: one size, or the range when GPUs differ
    /// (`12.0 GiB–1.0 TiB per GPU`).
    pub fn budget_summary(&self) -> String {
        let lo = self.request.budgets.iter().copied().min().unwrap_or(0);
        let hi = self.request.budgets.iter().copied().max().unwrap_or(0);
        let each = format!("per {}", self.layout.device.kind.rank_noun());
        if lo == hi {
            format!("{} {each}", osdp_core::units::bytes(lo))
        } else {
            format!(
                "{}–{} {each}",
                osdp_core::units::bytes(lo),
                osdp_core::units::bytes(hi)
            )
        }
    }

    pub fn budget(&self) -> u64 {
        self.request.budget()
    }

    /// Data-parallel ranks of the layout.
    pub fn ranks(&self) -> u32 {
        self.layout.world_size().max(1)
    }

    /// The current request, numbered for the planner thread.
    fn next_job(&mut self) -> Job {
        self.next_request += 1;
        Job {
            id: self.next_request,
            request: self.request.clone(),
        }
    }

    /// Ask for a plan of the current request (synchronously without a planner thread).
    pub fn replan(&mut self) {
        let job = self.next_job();
        match &self.planner {
            Some(p) => {
                p.send(job);
                self.pending = true;
            }
            None => {
                let ready = super::planner_thread::plan_now(
                    &self.model,
                    &self.machine,
                    self.layout.memory_bytes(),
                    &job,
                );
                self.plan = Some(ready);
                self.refresh_detail();
            }
        }
    }

    /// Price the choices of `op` in the plan on screen (closes the pane when there is none).
    fn show_detail(&mut self, op: usize) {
        // Priced as the plan's target runs it, with what its collectives' streams reserve.
        let mut machine = self.machine.clone();
        machine.set_target(self.request.target, &self.model);
        self.detail = self.planned().map(|p| OpDetail {
            op,
            alternatives: osdp_core::plan::explain::alternatives(
                &self.model,
                &machine,
                &p.plan,
                op,
                self.request.max_split,
                // What the planner planned within: the budget less its headroom (with the
                // whole budget a faster choice that eats the headroom read "faster, but
                // pinned" for an op nobody pinned).
                self.request.usable_budget(),
            ),
        });
    }

    /// A new plan arrived: the open pane follows it.
    fn refresh_detail(&mut self) {
        if let Some(op) = self.detail.as_ref().map(|d| d.op) {
            self.show_detail(op);
        }
    }

    /// Take what background threads produced.
    pub fn poll_background(&mut self) {
        self.now = std::time::Instant::now();
        let mut arrived = false;
        if let Some(p) = &self.planner {
            while let Ok(ready) = p.rx.try_recv() {
                self.pending = ready.id != self.next_request;
                self.plan = Some(ready);
                arrived = true;
            }
        }
        if arrived {
            self.refresh_detail();
        }
        if let Some(rx) = &self.gpu_rx {
            let events: Vec<GpuEvent> = rx.try_iter().collect();
            for e in events {
                self.apply_gpu(e);
            }
        }
        self.poll_training();
    }

    /// Follow the run: new events, exits; finish a restart or a quit waiting on the stop.
    pub fn poll_training(&mut self) {
        let Some(t) = self.run_control.as_mut() else {
            return;
        };
        if let Some(run) = t.supervisor.as_mut() {
            run.poll();
        }
        if t.stop_notice && !t.is_live() {
            t.stop_notice = false;
            self.message = t.supervisor.as_ref().and_then(|r| r.note.clone());
        }
        if !t.is_live() {
            if t.quit_when_stopped {
                self.quit = true;
            } else if t.restart_pending {
                t.restart_pending = false;
                self.start_run(true);
            }
        }
    }

    /// Whether the plan on screen differs from the one the run uses.
    pub fn plan_differs_from_run(&self) -> bool {
        let run = self.run_control.as_ref().and_then(|t| {
            t.run_plan
                .as_ref()
                .map(|p| &p.plan)
                .or(t.found_plan.as_ref())
        });
        match (run, self.planned()) {
            (Some(run), Some(screen)) => *run != screen.plan,
            _ => false,
        }
    }

    fn start_run(&mut self, confirmed: bool) {
        let Some(t) = self.run_control.as_ref() else {
            self.message = Some("training needs the dashboard to be opened on a model file".into());
            return;
        };
        if let Some(owner) = t.owner() {
            self.message = Some(owned_by(owner));
            return;
        }
        if t.is_live() {
            self.message =
                Some("a run is going: r restarts it with the plan on screen, x stops it".into());
            return;
        }
        let ranks = match self.gpu_launch() {
            Ok(r) => r,
            Err(why) => {
                self.message = Some(why);
                return;
            }
        };
        let Some(planned) = self.planned().cloned() else {
            self.message = Some(match &self.plan {
                Some(PlanReady {
                    result: Err(nf), ..
                }) if nf.host_budget_bytes.is_some() => {
                    "no plan fits the host budget: nothing to start".into()
                }
                Some(PlanReady {
                    result: Err(nf), ..
                }) => match nf.min_budget_bytes {
                    Some(least) => format!(
                        "no plan fits the budget (it takes {}): nothing to start",
                        units::bytes(least)
                    ),
                    None => "no plan fits any budget: nothing to start".into(),
                },
                _ => "no plan yet: wait for the planner".into(),
            });
            return;
        };
        if self.pending && !confirmed {
            self.confirm = Some(Confirm::StartUnpriced);
            return;
        }
        let file = osdp_core::plan::PlanFile::new(
            &self.model,
            &self.layout.name,
            &planned.plan,
            Some(&planned.prediction),
        );
        let json = match serde_json::to_string_pretty(&file) {
            Ok(j) => j,
            Err(e) => {
                self.message = Some(format!("cannot write the plan: {e}"));
                return;
            }
        };
        let world = self.layout.world_size() as usize;
        let Some(t) = self.run_control.as_mut() else {
            return;
        };
        // Drop the previous (exited) supervisor before starting the next.
        t.supervisor = None;
        let predicted = osdp_core::protocol::RunPrediction::from(&planned.prediction);
        let launch = crate::supervisor::Launch {
            plan_json: &json,
            ranks,
            world_size: world,
            ranks_per_node: (self.layout.nodes > 1).then_some(self.layout.gpus_per_node as usize),
            global_batch: planned.plan.batch * planned.plan.accumulation * world as u64,
            steps: self.run_steps,
            predicted: Some(predicted),
        };
        match crate::supervisor::Supervisor::start(&t.spec, t.dir.clone(), &launch) {
            Ok(run) => {
                t.supervisor = Some(run);
                t.run_plan = Some(planned);
                self.message = None;
            }
            Err(e) => {
                // Another dashboard may have started a run here since this one looked: follow
                // it instead.
                t.supervisor =
                    crate::supervisor::Supervisor::open(t.dir.clone(), t.spec.hang_after);
                self.message = Some(match t.owner() {
                    Some(owner) => owned_by(owner),
                    None => format!("cannot start the worker {}: {e}", t.spec.exe.display()),
                });
                self.read_found_plan();
            }
        }
    }

    /// How a run of this layout is launched from here: CPU layouts as threads of one worker;
    /// a one-node GPU layout as one process per GPU, when this machine shows that many GPUs.
    fn gpu_launch(&self) -> Result<crate::supervisor::Ranks, String> {
        if self.layout.device.kind != osdp_core::cluster::DeviceKind::Gpu {
            return Ok(crate::supervisor::Ranks::CpuThreads);
        }
        let l = &self.layout;
        if l.nodes > 1 {
            return Err(format!(
                "layout {} spans {} nodes: launch `osdp-tui train --device cuda` with torchrun or srun on each node (README: several nodes)",
                l.name, l.nodes
            ));
        }
        let here = match &self.gpus {
            GpuView::Live(g) => g.len(),
            GpuView::Unavailable(_) => 0,
        };
        if here < l.gpus_per_node as usize {
            let shows = match &self.gpus {
                GpuView::Unavailable(why) => format!("shows no GPU ({why})"),
                GpuView::Live(_) => format!("has {here}"),
            };
            return Err(format!(
                "layout {} trains on {} GPUs and this machine {shows}: open the dashboard with this machine's layout, or --layout layouts/cpu.json to train on the CPU",
                l.name, l.gpus_per_node
            ));
        }
        Ok(crate::supervisor::Ranks::GpuProcesses)
    }

    /// `x`: ask the run to finish its step, checkpoint and exit; again: kill it.
    fn stop_run(&mut self) {
        let Some(run) = self
            .run_control
            .as_mut()
            .and_then(|t| t.supervisor.as_mut())
            .filter(|r| r.is_live())
        else {
            self.message = Some("no run is going".into());
            return;
        };
        let killing = run.state == crate::run::RunState::Stopping;
        if let Err(why) = run.stop() {
            self.message = Some(why);
            return;
        }
        self.message = Some(match run.finishing() {
            _ if killing => "killing the worker".into(),
            Some((step, secs)) => {
                format!("finishing step {step} (~{secs:.0} s); x again to kill")
            }
            None => "stopping before the first step; x again to kill".into(),
        });
        if let Some(t) = self.run_control.as_mut() {
            t.stop_notice = true;
        }
    }

    fn restart_run(&mut self) {
        if let Some(owner) = self.run_control.as_ref().and_then(RunControl::owner) {
            self.message = Some(owned_by(owner));
            return;
        }
        let running = self
            .run_control
            .as_ref()
            .and_then(|t| t.run_plan.as_ref())
            .map(|p| p.prediction.global_batch);
        let next = self
            .plan
            .as_ref()
            .and_then(|r| r.result.as_ref().ok())
            .map(|p| p.prediction.global_batch);
        if let (Some(from), Some(to)) = (running, next) {
            if from != to {
                self.confirm = Some(Confirm::RestartNewBatch { from, to });
                return;
            }
        }
        self.restart_confirmed();
    }

    fn restart_confirmed(&mut self) {
        let Some(t) = self.run_control.as_mut() else {
            return self.start_run(false);
        };
        match t.supervisor.as_mut() {
            Some(run) if run.is_live() => {
                // This dashboard's own run (restart_run turned away another's): stopping it
                // cannot be refused.
                let _ = run.stop();
                t.restart_pending = true;
            }
            _ => self.start_run(false),
        }
    }

    pub fn apply_gpu(&mut self, event: GpuEvent) {
        match event {
            GpuEvent::Unavailable(why) => self.gpus = GpuView::Unavailable(why),
            GpuEvent::Samples(s) => {
                self.history.resize_with(s.len(), VecDeque::new);
                for (h, g) in self.history.iter_mut().zip(&s) {
                    if h.len() == HISTORY {
                        h.pop_front();
                    }
                    h.push_back(g.used_bytes.unwrap_or(0));
                }
                self.gpus = GpuView::Live(s);
            }
        }
    }

    /// Lines of the operator list: a header per block, its ops when expanded, other ops.
    pub fn rows(&self) -> Vec<Row> {
        if let Some(q) = &self.op_filter {
            return (0..self.model.ops.len())
                .filter(|&i| self.op_matches(i, q))
                .map(Row::Op)
                .collect();
        }
        let mut rows = Vec::new();
        let mut seen = HashSet::new();
        for (i, b) in self.blocks.of_op.iter().enumerate() {
            match b {
                Some(b) => {
                    if seen.insert(*b) {
                        rows.push(Row::Block(*b));
                    }
                    if self.expanded.contains(b) {
                        rows.push(Row::Op(i));
                    }
                }
                None => rows.push(Row::Op(i)),
            }
        }
        rows
    }

    pub fn selected(&self) -> Option<Row> {
        self.rows().get(self.selected_row).copied()
    }

    /// The selected block, or the block of the selected operator.
    pub fn selected_block(&self) -> Option<usize> {
        match self.selected()? {
            Row::Block(b) => Some(b),
            Row::Op(i) => self.blocks.of_op[i],
        }
    }

    /// Apply an action; re-plan when it changes what the plan depends on.
    pub fn update(&mut self, action: Action) {
        if self.overlay_takes(action) {
            return;
        }
        let before = self.settings();
        let replan = match action {
            Action::OpenCommand => {
                self.command = Some(CommandLine::new(Prompt::Command));
                false
            }
            Action::ShowView(v) => {
                self.view = v;
                false
            }
            Action::NextView => {
                let i = View::ALL.iter().position(|&v| v == self.view).unwrap_or(0);
                self.view = View::ALL[(i + 1) % View::ALL.len()];
                false
            }
            Action::Undo => {
                self.undo_last();
                false
            }
            Action::WritePlan => {
                self.write_plan(None);
                false
            }
            Action::ExportPlan => {
                self.export_plan(None);
                false
            }
            Action::Compare => {
                self.open_compare();
                false
            }
            Action::Quit if self.run_control.as_ref().is_some_and(RunControl::is_live) => {
                self.confirm = Some(Confirm::QuitWhileRunning);
                false
            }
            Action::Quit => {
                self.quit = true;
                false
            }
            Action::StartRun => {
                self.start_run(false);
                false
            }
            Action::StopRun => {
                self.stop_run();
                false
            }
            Action::RestartRun => {
                self.restart_run();
                false
            }
            Action::Yes | Action::Detach => false,
            Action::Back if self.op_filter.is_some() => {
                self.drop_op_filter();
                false
            }
            Action::Back => {
                self.message = Some("nothing to close: q quits".into());
                false
            }
            Action::Find => {
                let mut line = CommandLine::new(Prompt::FindOps);
                line.set(self.op_filter.as_deref().unwrap_or_default());
                self.command = Some(line);
                self.focus = Focus::Ops;
                false
            }
            Action::NextMatch | Action::PrevMatch => {
                self.jump_to_match(action == Action::NextMatch);
                false
            }
            Action::ToggleHelp => {
                self.show_help = !self.show_help;
                false
            }
            Action::ToggleLog => {
                self.log_view = Some(LogView::default());
                false
            }
            Action::ToggleGraph => {
                self.show_graph = !self.show_graph;
                false
            }
            Action::RaiseBudget
            | Action::LowerBudget
            | Action::SplitUp
            | Action::SplitDown
            | Action::CycleBatch
            | Action::CycleGlobalBatch => self.change_request(action),
            Action::CyclePin => match self.selected() {
                Some(Row::Op(i)) => self.cycle_pin(i),
                Some(Row::Block(b)) => self.cycle_block_pin(b),
                None => false,
            },
            Action::ToggleRecompute => match self.selected_block() {
                Some(b) => self.toggle_recompute(b),
                None => {
                    self.message = Some("R acts on a block: select one of its rows".into());
                    false
                }
            },
            Action::FocusNext => {
                self.focus = match self.focus {
                    Focus::Ops => Focus::Gpus,
                    Focus::Gpus => Focus::Ops,
                };
                false
            }
            Action::Up
            | Action::Down
            | Action::PageUp
            | Action::PageDown
            | Action::Home
            | Action::End => {
                self.move_cursor(action);
                false
            }
            Action::Toggle => {
                match self.selected() {
                    Some(Row::Block(b)) if !self.expanded.remove(&b) => {
                        self.expanded.insert(b);
                    }
                    Some(Row::Op(i)) => self.show_detail(i),
                    _ => {}
                }
                false
            }
        };
        if replan {
            self.remember(before);
            self.replan();
        }
    }

    /// Whatever is on top takes the action first: help, a question, the log, the operator pane
    /// or the comparison. True when it did (the panels behind see nothing).
    fn overlay_takes(&mut self, action: Action) -> bool {
        // Help covers the panels: while it is open no key reaches them.
        if self.show_help {
            self.help_key(action);
            return true;
        }
        if let Some(question) = self.confirm.take() {
            self.answer(question, action);
            return true;
        }
        self.message = None;
        if self.log_view.is_some() && self.scroll_log(action) {
            return true;
        }
        if self.detail.is_some() && matches!(action, Action::Toggle | Action::Quit | Action::Back) {
            self.detail = None;
            return true;
        }
        if let Some(lines) = &self.compare {
            let len = lines.len();
            match action {
                Action::Compare | Action::Quit | Action::Toggle | Action::Back => {
                    self.compare = None;
                    self.compare_scroll = 0;
                }
                Action::Up | Action::Down | Action::PageUp | Action::PageDown => {
                    let page = super::view::compare_rows(self.screen);
                    let last = len.saturating_sub(page);
                    self.compare_scroll = scrolled(self.compare_scroll, action, page, last);
                }
                Action::Home => self.compare_scroll = 0,
                Action::End => {
                    self.compare_scroll = len.saturating_sub(super::view::compare_rows(self.screen))
                }
                _ => return false,
            }
            return true;
        }
        false
    }

    /// A key while help is open: scroll it, filter it, close it; nothing else.
    fn help_key(&mut self, action: Action) {
        let (total, page) = super::view::help_rows(self);
        let last = total.saturating_sub(page);
        match action {
            Action::Back | Action::ToggleHelp | Action::Quit => {
                self.show_help = false;
                self.help_scroll = 0;
                self.help_filter.clear();
            }
            Action::Up | Action::Down | Action::PageUp | Action::PageDown => {
                self.help_scroll = scrolled(self.help_scroll, action, page, last);
            }
            Action::Home => self.help_scroll = 0,
            Action::End => self.help_scroll = last,
            Action::Find => {
                let mut line = CommandLine::new(Prompt::FilterHelp);
                line.set(&self.help_filter);
                self.command = Some(line);
            }
            _ => {}
        }
    }

    /// A question on screen takes the next key: its answers act, anything else cancels.
    fn answer(&mut self, question: Confirm, action: Action) {
        match (question, action) {
            (Confirm::Overwrite(path), Action::Yes) => self.write_plan_to(&path),
            (Confirm::Overwrite(_), _) => self.message = Some("not written".into()),
            (Confirm::OverwriteExport(path), Action::Yes) => self.export_plan_to(&path),
            (Confirm::OverwriteExport(_), _) => self.message = Some("not written".into()),
            (Confirm::StartUnpriced, Action::Yes) => self.start_run(true),
            (Confirm::RestartNewBatch { .. }, Action::Yes) => self.restart_confirmed(),
            (Confirm::QuitWhileRunning, Action::Detach) => {
                self.farewell = self.detach_notice();
                if let Some(run) = self
                    .run_control
                    .as_mut()
                    .and_then(|t| t.supervisor.as_mut())
                {
                    run.detach();
                }
                self.quit = true;
            }
            (Confirm::QuitWhileRunning, Action::StartRun | Action::StopRun) => {
                self.stop_run();
                if let Some(t) = self.run_control.as_mut() {
                    // Unless the run cannot be stopped from here (another machine's).
                    t.quit_when_stopped = t
                        .supervisor
                        .as_ref()
                        .is_some_and(|r| r.state == crate::run::RunState::Stopping);
                }
            }
            _ => {}
        }
    }

    /// What detaching leaves behind, said when the terminal is back: the worker's pid, the run
    /// directory, and the commands that follow the run and reattach a dashboard to it.
    fn detach_notice(&self) -> Option<String> {
        let t = self.run_control.as_ref()?;
        let pid = t.supervisor.as_ref()?.pid()?;
        let dir = shell_word(&t.dir.0.display().to_string());
        let model = shell_word(&t.spec.model.display().to_string());
        let layout = shell_word(self.layout_arg.as_deref().unwrap_or(&self.layout.name));
        let flags = self.request_flags();
        Some(format!(
            "detached: the run goes on without this dashboard\n\
             \x20 worker pid {pid} · run directory {dir}\n\
             \x20 follow it:  osdp-tui status {dir} --follow\n\
             \x20 reattach:   osdp-tui {model} --layout {layout}{flags} --run-dir {dir}\n\
             \x20 stop it:    kill {pid}   (it finishes its step and checkpoints first)\n"
        ))
    }

    /// The dashboard flags that open it on the request on screen (budgets other than the
    /// layout's, the split, the micro- and global batch), each with a leading space: what
    /// the reattach command needs to show the plan the run was started with.
    fn request_flags(&self) -> String {
        let r = &self.request;
        let size = |b: u64| {
            let (gib, mib) = (1u64 << 30, 1u64 << 20);
            if b % gib == 0 {
                format!("{}GiB", b / gib)
            } else if b % mib == 0 {
                format!("{}MiB", b / mib)
            } else {
                format!("{b}B")
            }
        };
        let mut flags = String::new();
        let default = self.layout.memory_bytes();
        match r.budgets.first() {
            Some(&b) if r.budgets.iter().all(|&x| x == b) => {
                if b != default {
                    flags += &format!(" --budget {}", size(b));
                }
            }
            _ => {
                let each: Vec<String> = r.budgets.iter().map(|&b| size(b)).collect();
                flags += &format!(" --budget-per-gpu {}", each.join(","));
            }
        }
        if r.max_split != osdp_core::plan::DEFAULT_MAX_SPLIT {
            flags += &format!(" --max-split {}", r.max_split);
        }
        if let Some(b) = r.batch {
            flags += &format!(" --batch {b}");
        }
        match r.global_batch {
            Some(g) => flags += &format!(" --global-batch {g}"),
            None => flags += " --global-batch any",
        }
        flags
    }

    /// Budgets, split and batches from their keys. True when the request changed.
    fn change_request(&mut self, action: Action) -> bool {
        match action {
            Action::RaiseBudget | Action::LowerBudget => {
                let up = matches!(action, Action::RaiseBudget);
                let step = |b: u64| budget_step(b, up);
                if self.focus == Focus::Gpus {
                    if let Some(b) = self.request.budgets.get_mut(self.selected_gpu) {
                        *b = step(*b);
                    }
                } else {
                    for b in &mut self.request.budgets {
                        *b = step(*b);
                    }
                }
                true
            }
            Action::SplitUp if self.request.max_split < 64 => {
                self.request.max_split *= 2;
                true
            }
            Action::SplitDown if self.request.max_split > 1 => {
                self.request.max_split /= 2;
                true
            }
            Action::CycleBatch => {
                const FIXED: [u64; 6] = [1, 2, 4, 8, 16, 32];
                // At a fixed global batch, only micro-batches that divide each rank's share.
                let per_rank = self
                    .request
                    .global_batch
                    .map(|g| g / u64::from(self.ranks()));
                let fits = |f: &u64| per_rank.is_none_or(|p| p % f == 0);
                self.request.batch = match self.request.batch {
                    None => FIXED.iter().copied().find(fits),
                    Some(b) => FIXED.iter().copied().filter(fits).find(|&f| f > b),
                };
                true
            }
            Action::CycleGlobalBatch => {
                let ranks = u64::from(self.ranks());
                let next = match self.request.global_batch {
                    None => Some(ranks),
                    Some(g) if g < ranks * 1024 => {
                        Some((g / ranks + 1).next_power_of_two() * ranks)
                    }
                    Some(_) => None,
                };
                self.request.global_batch = next;
                if next.is_none() {
                    self.message = Some(ANY_BATCH.into());
                }
                // A fixed micro-batch that no longer divides a rank's share goes back to auto.
                if let (Some(g), Some(b)) = (self.request.global_batch, self.request.batch) {
                    if (g / ranks) % b != 0 {
                        self.request.batch = None;
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// The cursor of the focused panel: a row of the operators, or a GPU.
    fn move_cursor(&mut self, action: Action) {
        let rows = self.rows().len();
        let gpus = self.request.budgets.len();
        let (cursor, len) = match self.focus {
            Focus::Gpus => (&mut self.selected_gpu, gpus),
            Focus::Ops => (&mut self.selected_row, rows),
        };
        let last = len.saturating_sub(1) as isize;
        let to = match action {
            Action::Home => 0,
            Action::End => last,
            Action::Up => *cursor as isize - 1,
            Action::Down => *cursor as isize + 1,
            Action::PageUp => *cursor as isize - 10,
            _ => *cursor as isize + 10,
        };
        *cursor = to.clamp(0, last) as usize;
    }

    /// A key from the terminal: to the command line while it is open, else its action.
    pub fn key(
        &mut self,
        code: crossterm::event::KeyCode,
        modifiers: crossterm::event::KeyModifiers,
    ) {
        let Some(line) = self.command.as_mut() else {
            if let Some(a) = super::keymap::action_for(code, modifiers) {
                self.update(a);
            }
            return;
        };
        let prompt = line.prompt;
        match line.key(code, modifiers, &self.command_history) {
            Edit::Cancel => {
                self.command = None;
                self.prompt_cancelled(prompt);
            }
            Edit::Submit => {
                let text = self.command.take().map(|l| l.text()).unwrap_or_default();
                self.prompt_submitted(prompt, &text);
            }
            Edit::Complete => {
                let candidates = self.completions();
                if let Some(line) = self.command.as_mut() {
                    line.complete(&candidates);
                }
            }
            Edit::Changed => {
                let text = line.text();
                self.prompt_changed(prompt, &text);
            }
            Edit::Ignored => {}
        }
    }

    /// Enter on a prompt: run the command (and keep it in the history).
    fn prompt_submitted(&mut self, prompt: Prompt, text: &str) {
        match prompt {
            Prompt::Command => {
                if !text.trim().is_empty()
                    && self.command_history.last().map(String::as_str) != Some(text)
                {
                    if self.command_history.len() == super::cmdline::HISTORY {
                        self.command_history.remove(0);
                    }
                    self.command_history.push(text.to_owned());
                }
                self.run_command(text);
            }
            Prompt::FindOps => {
                self.prompt_changed(prompt, text);
                if text.trim().is_empty() {
                    self.drop_op_filter();
                } else {
                    self.last_find = Some(text.trim().to_owned());
                    let n = self.rows().len();
                    if n == 0 {
                        self.message = Some(format!(
                            "no operator's name or strategy contains {:?}",
                            osdp_core::text::printable(text.trim())
                        ));
                        self.drop_op_filter();
                    }
                }
            }
            Prompt::FilterHelp => self.prompt_changed(prompt, text),
        }
    }

    /// Esc (or Ctrl-C) on a prompt: it closes unrun; a search prompt drops its filter.
    fn prompt_cancelled(&mut self, prompt: Prompt) {
        match prompt {
            Prompt::Command => {}
            Prompt::FindOps => self.drop_op_filter(),
            Prompt::FilterHelp => {
                self.help_filter.clear();
                self.help_scroll = 0;
            }
        }
    }

    /// A search prompt's text changed: what it filters follows as it is typed.
    fn prompt_changed(&mut self, prompt: Prompt, text: &str) {
        match prompt {
            Prompt::Command => {}
            Prompt::FindOps => {
                let keep = self.selected_op();
                self.op_filter = Some(text.trim().to_owned()).filter(|t| !t.is_empty());
                let rows = self.rows();
                self.selected_row = keep
                    .and_then(|op| rows.iter().position(|r| *r == Row::Op(op)))
                    .unwrap_or(0);
            }
            Prompt::FilterHelp => {
                self.help_filter = text.to_owned();
                self.help_scroll = 0;
            }
        }
    }

    /// The whole operator list again, the cursor on the operator it was on.
    fn drop_op_filter(&mut self) {
        let keep = self.selected_op();
        self.op_filter = None;
        match keep {
            Some(op) => self.select_op(op),
            None => self.selected_row = self.selected_row.min(self.rows().len().saturating_sub(1)),
        }
    }

    /// The selected operator (a block row: its first operator).
    pub fn selected_op(&self) -> Option<usize> {
        match self.selected()? {
            Row::Op(i) => Some(i),
            Row::Block(b) => self.blocks.ops[b].first().copied(),
        }
    }

    /// Whether operator `op` matches `query`: its name, or its strategy in the plan on screen.
    pub fn op_matches(&self, op: usize, query: &str) -> bool {
        let q = query.to_lowercase();
        let name = self.model.ops[op].id.to_lowercase();
        let strategy = self
            .planned()
            .map(|p| p.plan.choices[op])
            .filter(|c| c.strategy != Strategy::None)
            .map(|c| c.label())
            .unwrap_or_default();
        name.contains(&q) || strategy.contains(&q)
    }

    /// `n` / `N`: the next (`forward`) or previous operator the last find matches, round the
    /// end of the list.
    fn jump_to_match(&mut self, forward: bool) {
        let Some(query) = self.last_find.clone().or_else(|| self.op_filter.clone()) else {
            self.message = Some("nothing found yet: / finds operators by name or strategy".into());
            return;
        };
        let matches: Vec<usize> = (0..self.model.ops.len())
            .filter(|&i| self.op_matches(i, &query))
            .collect();
        if matches.is_empty() {
            self.message = Some(format!(
                "no operator matches {:?}",
                osdp_core::text::printable(&query)
            ));
            return;
        }
        let at = self.selected_op();
        let next = match (forward, at) {
            (true, Some(op)) => matches.iter().find(|&&m| m > op).or(matches.first()),
            (false, Some(op)) => matches.iter().rev().find(|&&m| m < op).or(matches.last()),
            (true, None) => matches.first(),
            (false, None) => matches.last(),
        };
        if let Some(&op) = next {
            let k = matches.iter().position(|&m| m == op).unwrap_or(0);
            self.select_op(op);
            self.message = Some(format!(
                "match {}/{} for {:?}",
                k + 1,
                matches.len(),
                osdp_core::text::printable(&query)
            ));
        }
    }

    /// What Tab may put in the word before the cursor: a command's name, an operator's (after
    /// `op`), or the word a command takes there.
    fn completions(&self) -> Vec<String> {
        let Some(line) = self.command.as_ref() else {
            return Vec::new();
        };
        if line.prompt != Prompt::Command {
            return Vec::new();
        }
        let (before, _) = line.word_at_cursor();
        let words: Vec<&str> = before.iter().map(String::as_str).collect();
        let list: &[&str] = match words.as_slice() {
            [] => COMMAND_NAMES,
            ["op"] => return self.model.ops.iter().map(|o| o.id.clone()).collect(),
            ["batch"] => &["any"],
            ["micro"] => &["auto"],
            ["gpu", _] => &["budget"],
            _ => &[],
        };
        list.iter().map(|w| (*w).to_owned()).collect()
    }

    /// A left click at (`column`, `row`): on an operator row, select it (and focus the table);
    /// on the GPU panel, focus it.
    pub fn click(&mut self, column: u16, row: u16) {
        let hit = self.hit.get();
        let at = ratatui::layout::Position::new(column, row);
        if hit.ops.contains(at) {
            self.focus = Focus::Ops;
            // Under the top border and the header row.
            if let Some(line) = row.checked_sub(hit.ops.y + 2) {
                let i = hit.ops_offset + usize::from(line);
                if i < self.rows().len() && row + 1 < hit.ops.bottom() {
                    self.selected_row = i;
                }
            }
        } else if hit.gpus.contains(at) {
            self.focus = Focus::Gpus;
        }
    }

    /// What the plan on screen was asked for: what `u` puts back.
    pub fn settings(&self) -> Request {
        self.request.clone()
    }

    /// Keep `before` for `u` when the settings changed from it.
    fn remember(&mut self, before: Request) {
        if before != self.settings() && self.undo.last() != Some(&before) {
            if self.undo.len() == UNDO_DEPTH {
                self.undo.remove(0);
            }
            self.undo.push(before);
        }
    }

    fn undo_last(&mut self) {
        let Some(s) = self.undo.pop() else {
            self.message = Some("nothing to undo".into());
            return;
        };
        self.request = s;
        self.replan();
    }

    /// Run a typed command (`budget 40GiB`, `gpu 3 budget 20GiB`, `batch 512`, …); a mistake
    /// is said in the footer and changes nothing.
    pub fn run_command(&mut self, line: &str) {
        let words = match super::cmdline::split_words(line) {
            Ok(w) => w,
            Err(why) => {
                self.message = Some(why);
                return;
            }
        };
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let before = self.settings();
        let ranks = u64::from(self.ranks());
        let result: Result<bool, String> = match words.as_slice() {
            [] => Ok(false),
            ["budget"] => {
                self.message = Some(format!("budget {}", self.budget_summary()));
                return;
            }
            ["budget", size @ ..] => crate::cli::parse_budget(&size.join(" ")).map(|b| {
                self.request.budgets.iter_mut().for_each(|x| *x = b);
                true
            }),
            ["q" | "quit"] => {
                self.update(Action::Quit);
                return;
            }
            ["gpu", n, "budget", size @ ..] => match n.parse::<usize>() {
                Ok(g) if g < self.request.budgets.len() => {
                    crate::cli::parse_budget(&size.join(" ")).map(|b| {
                        self.request.budgets[g] = b;
                        true
                    })
                }
                _ => Err(format!(
                    "gpu {n:?}: this layout's GPUs are 0 to {}",
                    self.request.budgets.len().saturating_sub(1)
                )),
            },
            ["batch", "any"] => {
                self.request.global_batch = None;
                self.message = Some(ANY_BATCH.into());
                Ok(true)
            }
            ["steps"] => {
                self.message = Some(steps_words(self.run_steps));
                return;
            }
            ["steps", n] => match n.parse::<u64>() {
                Ok(k) => {
                    self.run_steps = k;
                    self.message = Some(format!(
                        "{} (s starts it; a run going keeps its own until r)",
                        steps_words(k)
                    ));
                    Ok(false)
                }
                Err(_) => Err(format!("steps {n:?}: a number of steps (0: until stopped)")),
            },
            ["batch", n] => match n.parse::<u64>() {
                Ok(g) if g > 0 && g % ranks == 0 && g / ranks <= osdp_core::plan::MAX_BATCH => {
                    self.request.global_batch = Some(g);
                    if self.request.batch.is_some_and(|b| (g / ranks) % b != 0) {
                        self.request.batch = None;
                    }
                    Ok(true)
                }
                _ => Err(format!(
                    "batch {n:?}: a global batch is a multiple of the {ranks} ranks (or `any`)"
                )),
            },
            ["micro", "auto"] => {
                self.request.batch = None;
                Ok(true)
            }
            ["micro", n] => match n.parse::<u64>() {
                Ok(b)
                    if (1..=osdp_core::plan::MAX_BATCH).contains(&b)
                        && self
                            .request
                            .global_batch
                            .is_none_or(|g| (g / ranks) % b == 0) =>
                {
                    self.request.batch = Some(b);
                    Ok(true)
                }
                _ => Err(format!(
                    "micro {n:?}: a micro-batch divides each rank's share of the global batch"
                )),
            },
            ["split", k] => match k.parse::<u32>() {
                Ok(k) if k.is_power_of_two() && k <= 64 => {
                    self.request.max_split = k;
                    Ok(true)
                }
                _ => Err(format!("split {k:?}: a power of two from 1 to 64")),
            },
            ["write" | "w"] => {
                self.write_plan(None);
                Ok(false)
            }
            ["export" | "e"] => {
                self.export_plan(None);
                Ok(false)
            }
            ["export" | "e", path] => {
                self.export_plan(Some(super::cmdline::expand_home(path)));
                Ok(false)
            }
            ["target"] => {
                let note = osdp_core::plan::export::kernels_note(&self.model, self.request.target);
                self.message = Some(target_words(self.request.target, note));
                return;
            }
            ["target", name] => match osdp_core::plan::Target::parse(name) {
                Some(t) => {
                    self.request.target = t;
                    let note = osdp_core::plan::export::kernels_note(&self.model, t);
                    self.message = Some(target_words(t, note));
                    Ok(true)
                }
                None => Err(format!(
                    "target {:?}: osdp (osdp-tui's trainer, every choice) or fsdp2 (PyTorch \
                     FSDP2's fully_shard: what it can express)",
                    osdp_core::text::printable(name)
                )),
            },
            ["write" | "w", path] => {
                self.write_plan(Some(super::cmdline::expand_home(path)));
                Ok(false)
            }
            ["op", name] => self.go_to_op(name).map(|()| false),
            _ => Err(format!(
                "unknown command {:?}; commands: {COMMANDS}",
                osdp_core::text::printable(line.trim())
            )),
        };
        match result {
            Ok(true) => {
                self.remember(before);
                self.replan();
            }
            Ok(false) => {}
            Err(why) => self.message = Some(why),
        }
    }

    /// Where `w` writes when no path is given: `MODEL.plan.json` here (the model's name made
    /// safe for a file name).
    pub fn default_plan_path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!(
            "{}.plan.json",
            osdp_core::text::file_component(&self.model.name)
        ))
    }

    /// Where `:command` (`write` or `export`) writes the plan on screen: `path`, or `default`;
    /// `None` when there is no plan, the path is a directory (said), or a file is there (then
    /// `ask` is the question put before it is overwritten).
    fn destination(
        &mut self,
        command: &str,
        path: Option<std::path::PathBuf>,
        default: std::path::PathBuf,
        ask: fn(std::path::PathBuf) -> Confirm,
    ) -> Option<std::path::PathBuf> {
        if self.planned().is_none() {
            self.message = Some(format!("no plan on screen to {command}"));
            return None;
        }
        let path = path.unwrap_or(default);
        if path.is_dir() {
            let shown = path.display().to_string();
            self.message = Some(format!(
                "{} is a directory: :{command} DIR/NAME.json",
                osdp_core::text::printable(&shown)
            ));
            None
        } else if path.exists() {
            self.confirm = Some(ask(path));
            None
        } else {
            Some(path)
        }
    }

    /// Write the plan on screen (with its prediction) to `path`, or the default one; over a
    /// file that exists only once the user says yes.
    fn write_plan(&mut self, path: Option<std::path::PathBuf>) {
        let default = self.default_plan_path();
        if let Some(path) = self.destination("write", path, default, Confirm::Overwrite) {
            self.write_plan_to(&path);
        }
    }

    fn write_plan_to(&mut self, path: &std::path::Path) {
        let Some(planned) = self.planned() else {
            self.message = Some("no plan on screen to write".into());
            return;
        };
        let file = osdp_core::plan::PlanFile {
            target: self.request.target,
            ..osdp_core::plan::PlanFile::new(
                &self.model,
                &self.layout.name,
                &planned.plan,
                Some(&planned.prediction),
            )
        };
        let shown = path.display().to_string();
        let shown = osdp_core::text::printable(&shown);
        self.message = Some(match osdp_core::input::write_json_atomically(path, &file) {
            Ok(()) => {
                format!("wrote the plan on screen to {shown} (osdp-tui evaluate … --plan reads it)")
            }
            Err(e) => format!("cannot write {shown}: {e}"),
        });
    }

    /// Where `e` writes when no path is given: `MODEL.fsdp2.json` here, beside `w`'s plan.
    pub fn default_export_path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!(
            "{}.fsdp2.json",
            osdp_core::text::file_component(&self.model.name)
        ))
    }

    /// Write the plan on screen as `osdp_torch.apply_plan` reads it (`osdp-tui export --to
    /// fsdp2`), to `path` or the default one; over a file that exists only once the user says
    /// yes. A plan FSDP2 cannot run is refused with what to do.
    fn export_plan(&mut self, path: Option<std::path::PathBuf>) {
        let default = self.default_export_path();
        if let Some(path) = self.destination("export", path, default, Confirm::OverwriteExport) {
            self.export_plan_to(&path);
        }
    }

    fn export_plan_to(&mut self, path: &std::path::Path) {
        let Some(planned) = self.planned() else {
            self.message = Some("no plan on screen to export".into());
            return;
        };
        let export = osdp_core::plan::export::fsdp2_export(
            &self.model,
            &self.layout.name,
            &self.machine,
            &planned.plan,
        );
        let shown = path.display().to_string();
        let shown = osdp_core::text::printable(&shown);
        self.message = Some(match export {
            Err(why) => format!("FSDP2 cannot run the plan on screen: {why} (:target fsdp2 plans what it can)"),
            Ok(export) => match osdp_core::input::write_json_atomically(path, &export) {
                Ok(()) => format!(
                    "wrote the plan on screen for FSDP2 to {shown} (osdp_torch.apply_plan(model, \"{shown}\"))"
                ),
                Err(e) => format!("cannot write {shown}: {e}"),
            },
        });
    }

    /// `:op NAME`: select the operator (its block opened), in the operators panel.
    fn go_to_op(&mut self, name: &str) -> Result<(), String> {
        let Some(op) = self.model.ops.iter().position(|o| o.id == name) else {
            return Err(format!(
                "no operator named {:?} (Tab completes names)",
                osdp_core::text::printable(name)
            ));
        };
        self.select_op(op);
        Ok(())
    }

    /// Put the cursor on operator `op`, opening its block, with the operators panel focused.
    pub fn select_op(&mut self, op: usize) {
        if let Some(b) = self.blocks.of_op[op] {
            self.expanded.insert(b);
        }
        if self
            .op_filter
            .as_ref()
            .is_some_and(|q| !self.op_matches(op, q))
        {
            self.op_filter = None;
        }
        self.focus = Focus::Ops;
        if let Some(row) = self.rows().iter().position(|r| *r == Row::Op(op)) {
            self.selected_row = row;
        }
    }

    /// The plan on screen against the running one: their figures, then each op whose choice
    /// differs.
    fn open_compare(&mut self) {
        let run = self.run_control.as_ref().and_then(|t| {
            t.run_plan
                .as_ref()
                .map(|p| (p.plan.clone(), Some(p.prediction.clone())))
                .or_else(|| t.found_plan.clone().map(|p| (p, None)))
        });
        let (Some((run, run_pred)), Some(screen)) = (run, self.planned()) else {
            self.message =
                Some("no run to compare with: s starts one with the plan on screen".into());
            return;
        };
        let figures = |p: &osdp_core::plan::Prediction| {
            format!(
                "{:.2} samples/s · step {} · peak {} · batch {}",
                p.throughput_samples_per_s,
                units::seconds(p.step_time_s),
                units::bytes(p.peak_memory_bytes),
                p.batch_label()
            )
        };
        let run_pred =
            run_pred.unwrap_or_else(|| osdp_core::plan::evaluate(&self.model, &self.machine, &run));
        let mut lines = vec![
            format!("running    {}", figures(&run_pred)),
            format!("on screen  {}", figures(&screen.prediction)),
        ];
        let changed: Vec<String> = self
            .model
            .ops
            .iter()
            .enumerate()
            .filter(|&(i, _)| run.choices.get(i) != screen.plan.choices.get(i))
            .map(|(i, op)| {
                format!(
                    "{}  {} → {}",
                    osdp_core::text::printable(&op.id),
                    run.choices.get(i).map_or("-".into(), |c| c.label()),
                    screen.plan.choices[i].label()
                )
            })
            .collect();
        // A block keeps its activations, recomputes them, or recomputes them keeping the
        // weights its recomputation fetches.
        let way = |p: &osdp_core::plan::Plan, b: usize| match (p.recompute.get(b), p.keeps(b)) {
            (_, true) => "recompute+keep-weights",
            (Some(&true), false) => "recompute",
            _ => "keep",
        };
        let recompute: Vec<String> = (0..screen.plan.recompute.len())
            .filter(|&b| way(&run, b) != way(&screen.plan, b))
            .map(|b| format!("block {b}  {} → {}", way(&run, b), way(&screen.plan, b)))
            .collect();
        lines.push(String::new());
        let batch =
            |p: &osdp_core::plan::Plan| format!("{} × {} accumulated", p.batch, p.accumulation);
        if (run.batch, run.accumulation) != (screen.plan.batch, screen.plan.accumulation) {
            lines.push(format!(
                "micro-batch  {} → {}",
                batch(&run),
                batch(&screen.plan)
            ));
        }
        if changed.is_empty() && recompute.is_empty() {
            lines.push("the same choices for every operator".into());
        } else {
            lines.push(format!(
                "{} operators and {} blocks differ:",
                changed.len(),
                recompute.len()
            ));
            lines.extend(changed);
            lines.extend(recompute);
        }
        self.compare = Some(lines);
        self.compare_scroll = 0;
    }

    /// The worker's output, when there is a run.
    pub fn log_tail(&self) -> Option<&crate::run::LogTail> {
        Some(&self.run_control.as_ref()?.supervisor.as_ref()?.log)
    }

    /// Lines of the log the log view shows at once.
    pub fn log_rows(&self) -> u16 {
        self.screen.1.saturating_sub(LOG_VIEW_CHROME_ROWS).max(1)
    }

    /// Where the log view can be: the first line kept, the end, and the top of a view at the
    /// tail (positions as [`LogView::top`]).
    fn log_bounds(&self) -> (u64, u64, u64) {
        let (first, end) = self
            .log_tail()
            .map_or((0, 0), |t| (t.dropped(), t.dropped() + t.len() as u64));
        let tail_top = end.saturating_sub(u64::from(self.log_rows())).max(first);
        (first, end, tail_top)
    }

    /// The log's lines on screen: the first one's position (as [`LogView::top`]) and how many,
    /// the view held between the top of what is kept and the tail.
    pub fn log_window(&self) -> (u64, usize) {
        let (first, end, tail_top) = self.log_bounds();
        let top = self
            .log_view
            .and_then(|v| v.top)
            .unwrap_or(tail_top)
            .clamp(first, tail_top);
        let shown = (end - top).min(u64::from(self.log_rows()));
        (top, shown as usize)
    }

    /// A key while the log is open: scroll it, close it, or (`false`) leave the key to the
    /// dashboard (start, stop, help, the budget).
    fn scroll_log(&mut self, action: Action) -> bool {
        let rows = u64::from(self.log_rows());
        let (first, _, tail_top) = self.log_bounds();
        let (top, _) = self.log_window();
        let to = match action {
            Action::Up => top.saturating_sub(1),
            Action::Down => top + 1,
            Action::PageUp => top.saturating_sub(rows),
            Action::PageDown => top + rows,
            Action::Home => first,
            Action::End => tail_top,
            Action::Quit | Action::ToggleLog | Action::Back => {
                self.log_view = None;
                return true;
            }
            // Nothing under the log to act on.
            Action::Toggle
            | Action::FocusNext
            | Action::CyclePin
            | Action::ToggleRecompute
            | Action::ToggleGraph => return true,
            _ => return false,
        }
        .clamp(first, tail_top);
        // Back at the tail, the view follows it again.
        self.log_view = Some(LogView {
            top: (to < tail_top).then_some(to),
        });
        true
    }

    /// Pin every parameter-owning op of block `b` to the strategy after its first op's (as
    /// [`App::cycle_pin`] steps one op), or unpin them all after the last.
    fn cycle_block_pin(&mut self, b: usize) -> bool {
        let ops: Vec<usize> = (0..self.model.ops.len())
            .filter(|&i| self.blocks.of_op[i] == Some(b) && cost::owns_params(&self.model.ops[i]))
            .collect();
        let Some(&first) = ops.first() else {
            return false;
        };
        self.cycle_pin(first);
        let pin = self.pin_of(first);
        self.request.pins.retain(|(i, _)| !ops.contains(i));
        if let Some(c) = pin {
            self.request.pins.extend(ops.iter().map(|&i| (i, c)));
        }
        true
    }

    /// Fix block `b`'s recomputation to the opposite of the plan's choice, or, when fixed
    /// already, hand it back to the planner.
    fn toggle_recompute(&mut self, b: usize) -> bool {
        if let Some(k) = self
            .request
            .block_recompute
            .iter()
            .position(|&(x, _)| x == b)
        {
            self.request.block_recompute.remove(k);
            self.message = Some(format!(
                "block {b}: recomputation back to the planner's choice"
            ));
        } else {
            let now = self.planned().is_some_and(|p| p.plan.recompute[b]);
            self.request.block_recompute.push((b, !now));
            self.message = Some(format!(
                "block {b}: recompute {}, fixed (R again: the planner decides)",
                if now { "off" } else { "on" }
            ));
        }
        true
    }

    /// The recomputation the user fixed for block `b`, if any.
    pub fn recompute_fixed(&self, b: usize) -> Option<bool> {
        self.request
            .block_recompute
            .iter()
            .find(|&&(x, _)| x == b)
            .map(|&(_, r)| r)
    }

    /// Pin the op to the next strategy the layout allows, in [`Strategy::ALL`]'s order (dp →
    /// zero1 → zero2 → zero3 → hsdp on several nodes → unpinned).
    fn cycle_pin(&mut self, op: usize) -> bool {
        if !cost::owns_params(&self.model.ops[op]) {
            return false;
        }
        let order: Vec<Strategy> = Strategy::for_params()
            .filter(|&s| self.machine.refuses(s).is_none())
            .collect();
        let current = self.request.pins.iter().position(|(i, _)| *i == op);
        let next = match current.map(|k| self.request.pins[k].1.strategy) {
            None => Some(order[0]),
            Some(s) => order
                .iter()
                .position(|&o| o == s)
                .and_then(|k| order.get(k + 1))
                .copied(),
        };
        if let Some(k) = current {
            self.request.pins.remove(k);
        }
        if let Some(s) = next {
            self.request.pins.push((op, Choice::plain(s)));
        }
        true
    }

    pub fn pin_of(&self, op: usize) -> Option<Choice> {
        self.request
            .pins
            .iter()
            .find(|(i, _)| *i == op)
            .map(|(_, c)| *c)
    }
}

/// `word` as a shell reads it back: as it is when it is plain, else in single quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:+@%,".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A scroll position after one key: a line or a page of `page` up or down, within 0..=`last`.
fn scrolled(top: usize, action: Action, page: usize, last: usize) -> usize {
    let page = page.max(1);
    match action {
        Action::Up => top.saturating_sub(1),
        Action::Down => top + 1,
        Action::PageUp => top.saturating_sub(page),
        _ => top + page,
    }
    .min(last)
}

/// The budget one press of + (`up`) or - moves to from `b`: 1 GiB steps down to 1 GiB, then
/// 16 MiB steps (CPU runs and small models).
pub fn budget_step(b: u64, up: bool) -> u64 {
    const FINE: u64 = 16 << 20;
    match (up, b < GIB) {
        (true, true) => (b + FINE).min(GIB),
        (true, false) => b.saturating_add(GIB).min(osdp_core::plan::MAX_BUDGET_BYTES),
        (false, true) => b.saturating_sub(FINE).max(FINE),
        (false, false) if b == GIB => GIB - FINE,
        (false, false) => b.saturating_sub(GIB).max(GIB),
    }
}

/// What `:target` says: what will run the plans the dashboard makes, and `note`
/// ([`osdp_core::plan::export::kernels_note`]) in the place of `e`'s hint, so that the
/// message fits the footer at 80 columns.
fn target_words(t: osdp_core::plan::Target, note: Option<&str>) -> String {
    match t {
        osdp_core::plan::Target::Osdp => {
            "target osdp: plans for osdp-tui's own trainer (every choice; s runs them)".into()
        }
        osdp_core::plan::Target::Fsdp2 => format!(
            "target fsdp2: plans what PyTorch FSDP2 runs (no zero1, no split, offload as \
             +offload-param); {}",
            note.unwrap_or("e writes one for osdp_torch.apply_plan")
        ),
    }
}
