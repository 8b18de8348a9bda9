//! Dashboard state: plain data changed only by [`App::update`]; drawing reads it.

use std::collections::{HashSet, VecDeque};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use crate::cluster::Layout;
use crate::cost::{self, Choice, Machine, Strategy};
use crate::model::ModelSpec;
use crate::monitor::{GpuEvent, GpuSample};
use crate::plan::Blocks;

use super::worker::{PlanReady, PlanRequest, Worker};

const GIB: u64 = 1 << 30;
/// Samples of GPU memory kept for the sparklines.
const HISTORY: usize = 120;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Ops,
    Gpus,
}

/// What the user (or a background job) asks for.
#[derive(Debug, Clone)]
pub enum Action {
    RaiseBudget,
    LowerBudget,
    SplitUp,
    SplitDown,
    CycleBatch,
    CyclePin,
    FocusNext,
    Up,
    Down,
    PageUp,
    PageDown,
    Toggle,
    ToggleHelp,
    ToggleGraph,
    Quit,
}

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
    /// Per-GPU budgets; the plan must fit the smallest.
    pub budgets: Vec<u64>,
    pub max_split: u32,
    /// `None`: search the micro-batch.
    pub batch: Option<u64>,
    pub pins: Vec<(usize, Choice)>,
    pub plan: Option<PlanReady>,
    pub pending: bool,
    pub focus: Focus,
    pub selected_row: usize,
    pub selected_gpu: usize,
    pub expanded: HashSet<usize>,
    pub gpus: GpuView,
    pub history: Vec<VecDeque<u64>>,
    pub show_help: bool,
    /// Show the selected block's graph instead of the frontier chart (short screens).
    pub show_graph: bool,
    pub quit: bool,
    /// A line about where the layout came from (e.g. "no NVIDIA driver found; planning for …").
    pub notice: Option<String>,
    next_request: u64,
    worker: Option<Worker>,
    gpu_rx: Option<Receiver<GpuEvent>>,
}

impl App {
    pub fn new(model: ModelSpec, layout: Layout, budgets: Vec<u64>, max_split: u32) -> App {
        let machine = Machine::new(&layout, &model);
        let blocks = Blocks::of(&model);
        let expanded = HashSet::from([0]);
        App {
            model: Arc::new(model),
            layout,
            machine,
            blocks,
            budgets,
            max_split,
            batch: None,
            pins: Vec::new(),
            plan: None,
            pending: false,
            focus: Focus::Ops,
            selected_row: 0,
            selected_gpu: 0,
            expanded,
            gpus: GpuView::Unavailable("not polled yet".into()),
            history: Vec::new(),
            show_help: false,
            show_graph: false,
            quit: false,
            notice: None,
            next_request: 0,
            worker: None,
            gpu_rx: None,
        }
    }

    /// Plan in the background from now on (the interactive dashboard).
    pub fn with_worker(mut self) -> App {
        self.worker = Some(Worker::spawn(
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

    /// The current plan, when one fits.
    pub fn planned(&self) -> Option<&crate::plan::Planned> {
        self.plan.as_ref().and_then(|r| r.result.as_ref().ok())
    }

    /// The budget the plan must fit: the tightest GPU's.
    pub fn budget(&self) -> u64 {
        self.budgets.iter().copied().min().unwrap_or(0)
    }

    pub fn request(&mut self) -> PlanRequest {
        self.next_request += 1;
        PlanRequest {
            id: self.next_request,
            budget_bytes: self.budget(),
            max_split: self.max_split,
            batch: self.batch,
            pins: self.pins.clone(),
        }
    }

    /// Ask for a plan of the current settings (synchronously when there is no worker).
    pub fn replan(&mut self) {
        let r = self.request();
        match &self.worker {
            Some(w) => {
                w.request(r);
                self.pending = true;
            }
            None => {
                let ready = super::worker::plan_now(
                    &self.model,
                    &self.machine,
                    self.layout.memory_bytes(),
                    &r,
                );
                self.plan = Some(ready);
            }
        }
    }

    /// Take what background threads produced.
    pub fn poll_background(&mut self) {
        if let Some(w) = &self.worker {
            while let Ok(ready) = w.rx.try_recv() {
                self.pending = ready.id != self.next_request;
                self.plan = Some(ready);
            }
        }
        if let Some(rx) = &self.gpu_rx {
            let events: Vec<GpuEvent> = rx.try_iter().collect();
            for e in events {
                self.apply_gpu(e);
            }
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

    /// Apply an action; re-plan when it changes what the plan depends on.
    pub fn update(&mut self, action: Action) {
        let rows = self.rows().len();
        let mut replan = false;
        match action {
            Action::Quit => self.quit = true,
            Action::ToggleHelp => self.show_help = !self.show_help,
            Action::ToggleGraph => self.show_graph = !self.show_graph,
            Action::RaiseBudget | Action::LowerBudget => {
                let up = matches!(action, Action::RaiseBudget);
                let step = |b: u64| {
                    if up {
                        b.saturating_add(GIB)
                    } else {
                        b.saturating_sub(GIB).max(GIB)
                    }
                };
                if self.focus == Focus::Gpus {
                    if let Some(b) = self.budgets.get_mut(self.selected_gpu) {
                        *b = step(*b);
                    }
                } else {
                    for b in &mut self.budgets {
                        *b = step(*b);
                    }
                }
                replan = true;
            }
            Action::SplitUp => {
                if self.max_split < 64 {
                    self.max_split *= 2;
                    replan = true;
                }
            }
            Action::SplitDown => {
                if self.max_split > 1 {
                    self.max_split /= 2;
                    replan = true;
                }
            }
            Action::CycleBatch => {
                const FIXED: [u64; 6] = [1, 2, 4, 8, 16, 32];
                self.batch = match self.batch {
                    None => Some(FIXED[0]),
                    Some(b) => FIXED.iter().copied().find(|&f| f > b),
                };
                replan = true;
            }
            Action::CyclePin => {
                if let Some(Row::Op(i)) = self.selected() {
                    replan = self.cycle_pin(i);
                }
            }
            Action::FocusNext => {
                self.focus = match self.focus {
                    Focus::Ops => Focus::Gpus,
                    Focus::Gpus => Focus::Ops,
                }
            }
            Action::Up | Action::Down | Action::PageUp | Action::PageDown => {
                let delta: isize = match action {
                    Action::Up => -1,
                    Action::Down => 1,
                    Action::PageUp => -10,
                    _ => 10,
                };
                if self.focus == Focus::Gpus {
                    let n = self.budgets.len().max(1) as isize;
                    self.selected_gpu =
                        (self.selected_gpu as isize + delta).clamp(0, n - 1) as usize;
                } else {
                    self.selected_row = (self.selected_row as isize + delta)
                        .clamp(0, rows.saturating_sub(1) as isize)
                        as usize;
                }
            }
            Action::Toggle => {
                if let Some(Row::Block(b)) = self.selected() {
                    if !self.expanded.remove(&b) {
                        self.expanded.insert(b);
                    }
                }
            }
        }
        if replan {
            self.replan();
        }
    }

    /// Pin the op to the next strategy it allows (dp → zero1 → zero2 → zero3 → unpinned).
    fn cycle_pin(&mut self, op: usize) -> bool {
        if !cost::owns_params(&self.model.ops[op]) {
            return false;
        }
        let order = [
            Strategy::Dp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ];
        let current = self.pins.iter().position(|(i, _)| *i == op);
        let next = match current.map(|k| self.pins[k].1.strategy) {
            None => Some(order[0]),
            Some(s) => order
                .iter()
                .position(|&o| o == s)
                .and_then(|k| order.get(k + 1))
                .copied(),
        };
        if let Some(k) = current {
            self.pins.remove(k);
        }
        if let Some(s) = next {
            self.pins.push((op, Choice::plain(s)));
        }
        true
    }

    pub fn pin_of(&self, op: usize) -> Option<Choice> {
        self.pins.iter().find(|(i, _)| *i == op).map(|(_, c)| *c)
    }
}
