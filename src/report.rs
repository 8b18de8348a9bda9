//! The headless `plan` and `evaluate` commands: run the planner, print a table or JSON, write
//! plan files.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::cli::request::{
    choose_global_batch, parse_block_recompute, parse_pin, per_gpu_budgets, set_host_budget,
    GlobalBatchArg,
};
use crate::failure::Failure;
use osdp_core::cluster::{read_layout, Layout};
use osdp_core::cost::{Choice, Machine, Strategy};
use osdp_core::model::{self, ModelSpec};
use osdp_core::plan::baseline::{Baseline, Outcome};
use osdp_core::plan::{
    self, plan_with_baselines, Blocks, NoFit, PlanFile, PlanOptions, Planned, Prediction,
};
use osdp_core::text::printable;
use osdp_core::units;

/// A `plan` command line, its flags as given: [`plan_report`] reads the files and turns the
/// words into a [`plan::Request`].
#[derive(Debug, Clone)]
pub struct PlanCommand {
    pub model: PathBuf,
    pub layout: PathBuf,
    pub budget: Option<u64>,
    pub budget_per_gpu: Vec<u64>,
    pub batch: Option<u64>,
    pub global_batch: Option<GlobalBatchArg>,
    pub tokens_per_step: Option<u64>,
    pub max_split: u32,
    pub recompute: bool,
    pub pins: Vec<String>,
    /// `--recompute-block` as given.
    pub recompute_blocks: Vec<String>,
    /// `--resolution`; absent: [`plan::request::search_resolution`]'s default.
    pub resolution_bytes: Option<u64>,
    /// `--headroom`: share of the budget plans leave free (0.05 = 5 %).
    pub headroom: f64,
    /// Host memory per GPU that offloaded state may take (0: no offload) [default: the
    /// layout's].
    pub host_budget: Option<u64>,
    /// Op ids whose every choice to list, priced in the plan.
    pub explain: Vec<String>,
    /// `--target`: what will run the plan (the choices it can express).
    pub target: plan::Target,
    pub json: bool,
    pub output: Option<PathBuf>,
}

/// Print a value as pretty JSON on stdout (`--json`).
pub fn print_json<T: Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("report types serialise")
    );
}

/// Exit code when no plan fits the budget.
pub const EXIT_NO_FIT: u8 = 3;

/// One baseline in `plan --json`: its best plan's figures, or the budget it would need.
#[derive(Serialize)]
struct BaselineOut {
    strategy: &'static str,
    checkpointing: bool,
    fits: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    accumulation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    throughput_samples_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    step_time_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_memory_bytes: Option<u64>,
    /// When it does not fit: the smallest per-GPU budget any of its plans needs.
    #[serde(skip_serializing_if = "Option::is_none")]
    needs_bytes: Option<u64>,
    /// Where osdp-tui's trainer would run this baseline's plan slower than its users do (it
    /// gathers a recomputed op's parameters again; FSDP keeps them): the trainer's figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    trainer_throughput_samples_per_s: Option<f64>,
}

impl BaselineOut {
    fn of(b: Baseline, o: &Outcome) -> BaselineOut {
        let p = o.planned().map(|p| &p.prediction);
        BaselineOut {
            strategy: b.strategy.as_str(),
            checkpointing: b.checkpointing,
            fits: p.is_some(),
            batch_size: p.map(|p| p.batch_size),
            accumulation: p.map(|p| p.accumulation),
            throughput_samples_per_s: p.map(|p| p.throughput_samples_per_s),
            step_time_s: p.map(|p| p.step_time_s),
            peak_memory_bytes: p.map(|p| p.peak_memory_bytes),
            needs_bytes: match o {
                Outcome::Needs(n) => *n,
                Outcome::Fits(_) => None,
            },
            trainer_throughput_samples_per_s: o
                .planned()
                .and_then(|p| p.trainer_prediction.as_ref())
                .map(|p| p.throughput_samples_per_s),
        }
    }
}

#[derive(Serialize)]
struct OpOut<'a> {
    id: &'a str,
    strategy: &'static str,
    split: u32,
    sharded_slices: u32,
    /// `offload-opt` or `offload-param`; absent when nothing is offloaded.
    #[serde(skip_serializing_if = "osdp_core::cost::Offload::is_none")]
    offload: osdp_core::cost::Offload,
    recompute: bool,
    /// The op's recomputed block keeps the weights its recomputation fetches for the backward
    /// (`Plan::keep_weights`); absent when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    keep_weights: bool,
    memory_bytes: u64,
    time_s: f64,
}

/// The figures `plan --json` and `evaluate --json` both lead with.
#[derive(Serialize)]
struct Headline {
    batch_size: u64,
    accumulation: u64,
    global_batch: u64,
    step_time_s: f64,
    throughput_samples_per_s: f64,
    tokens_per_s: f64,
    peak_memory_bytes: u64,
    budget_bytes: u64,
}

/// The headroom `plan --json` reports beside the budget.
#[derive(Serialize)]
struct HeadroomOut {
    /// `--headroom`, in percent of the budget.
    headroom_percent: f64,
    /// What plans may peak at: the budget less the headroom.
    usable_budget_bytes: u64,
}

impl Headline {
    fn of(p: &Prediction, budget_bytes: u64) -> Headline {
        Headline {
            batch_size: p.batch_size,
            accumulation: p.accumulation,
            global_batch: p.global_batch,
            step_time_s: p.step_time_s,
            throughput_samples_per_s: p.throughput_samples_per_s,
            tokens_per_s: p.tokens_per_s,
            peak_memory_bytes: p.peak_memory_bytes,
            budget_bytes,
        }
    }
}

#[derive(Serialize)]
struct PlanOut<'a> {
    model: &'a str,
    layout: &'a str,
    ranks: u32,
    #[serde(flatten)]
    headline: Headline,
    #[serde(flatten)]
    headroom: HeadroomOut,
    binding_gpu: Option<usize>,
    /// Host memory per GPU offloaded state may take; absent where offload is not offered.
    #[serde(skip_serializing_if = "Option::is_none")]
    host_budget_bytes: Option<u64>,
    /// When the host budget bound on a model too large to search host memory exactly: how
    /// much shorter (s) the best step could at most be ([`Planned::host_gap_s`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    host_gap_s: Option<f64>,
    /// Memory resolution the search ran at (0: exact).
    resolution_bytes: u64,
    search_time_ms: f64,
    /// CPU time the search thread spent in it (ms): the wall time less what other processes
    /// took, for timing on a shared machine.
    search_cpu_ms: f64,
    /// Calibrated curves (with when and where they were measured) or datasheet rates.
    timing_source: String,
    /// The linears priced at the GPU's unaligned GEMM rate, and what avoids it.
    #[serde(skip_serializing_if = "Option::is_none")]
    unaligned_note: Option<String>,
    prediction: &'a Prediction,
    ops: Vec<OpOut<'a>>,
    /// `given` (--global-batch, --tokens-per-step), `default` (chosen for the model and
    /// layout) or `any` (no accumulation, the fastest micro-batch that fits).
    global_batch_source: &'static str,
    /// By name: ddp, ddp+ckpt, zero2, zero2+ckpt, fsdp, fsdp+ckpt.
    baselines: std::collections::BTreeMap<&'static str, BaselineOut>,
    /// `--explain OP`: per op id, every choice priced in the plan, fastest first.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    explain: std::collections::BTreeMap<String, Vec<plan::explain::Alternative>>,
}

fn load(model: &Path, layout: &Path) -> Result<(ModelSpec, Layout), Failure> {
    let spec = model::read_model(model).map_err(Failure::input)?;
    let layout = read_layout(layout).map_err(Failure::input)?;
    Ok((spec, layout))
}

/// Everything `plan` found, before anything is printed: the text and JSON renderers below
/// read this and compute nothing.
pub struct PlanReport {
    pub spec: ModelSpec,
    pub layout: Layout,
    pub budget: u64,
    /// Share of `budget` plans leave free ([`PlanCommand::headroom`]).
    pub headroom: f64,
    /// What plans may peak at: `budget` less the headroom.
    pub usable: u64,
    /// Host memory per GPU offloaded state may take (0: offload not offered).
    pub host_budget: u64,
    /// The GPU whose budget binds, when budgets differ per GPU.
    pub binding_gpu: Option<usize>,
    pub chosen: plan::GlobalBatch,
    /// Why the global batch is what it is, where it is the default
    /// ([`plan::GlobalBatch::explain_default`], for the machine it was chosen on).
    pub default_why: Option<String>,
    pub timing_source: String,
    /// The linears priced at the GPU's unaligned GEMM rate, named, with what avoids it.
    pub unaligned_note: Option<String>,
    pub search_ms: f64,
    /// CPU time of the search on its thread, ms.
    pub search_cpu_ms: f64,
    /// Memory resolution the search ran at (0: exact).
    pub resolution_bytes: u64,
    pub planned: Planned,
    pub baselines: Vec<(Baseline, Outcome)>,
    /// `--explain`: per op, every choice priced in the plan.
    pub explained: Vec<(usize, Vec<plan::explain::Alternative>)>,
    pub blocks: Blocks,
    /// What will run the plan.
    pub target: plan::Target,
}

/// Run the planner for a checked request.
pub fn plan_report(req: &PlanCommand) -> Result<PlanReport, Failure> {
    let (spec, layout) = load(&req.model, &req.layout)?;
    let mut machine = Machine::new(&layout, &spec);
    machine.set_target(req.target, &spec);
    set_host_budget(&mut machine, &layout, req.host_budget).map_err(Failure::input)?;
    let budgets =
        per_gpu_budgets(&layout, req.budget, &req.budget_per_gpu, None).map_err(Failure::input)?;
    let (binding_gpu, budget) = plan::request::binding(&budgets);
    let binding_gpu = (!req.budget_per_gpu.is_empty()).then_some(binding_gpu);
    let pins = pins_of(req, &spec, &machine)?;
    let block_recompute = block_recompute_of(req, &spec)?;
    let explain = explained_ops(req, &spec)?;
    let cpu = layout.device.kind == osdp_core::cluster::DeviceKind::Cpu;
    let chosen = choose_global_batch(
        &spec,
        &machine,
        cpu,
        req.global_batch,
        req.tokens_per_step,
        req.batch,
    )
    .map_err(Failure::input)?;
    let request = plan::Request {
        budgets,
        max_split: req.max_split,
        batch: req.batch,
        global_batch: chosen.samples(),
        recompute: req.recompute,
        pins,
        block_recompute,
        resolution_bytes: req.resolution_bytes,
        target: req.target,
        headroom: req.headroom,
    };
    let options = request.options(&spec, &machine, layout.memory_bytes());
    let resolution_bytes = options.resolution_bytes;
    let (headroom, usable) = (request.headroom, request.usable_budget());
    let started = Instant::now();
    let cpu_started = thread_cpu_s();
    let result = plan_with_baselines(&spec, &machine, options.clone(), usable);
    let search_ms = started.elapsed().as_secs_f64() * 1e3;
    let search_cpu_ms = (thread_cpu_s() - cpu_started) * 1e3;
    let result = result.map_err(|nf| least_that_fits(&spec, &machine, &options, nf));
    let (planned, mut baselines) =
        result.map_err(|nf| no_fit_failure(&spec, &layout, budget, headroom, &nf))?;
    // What a baseline needs, as a budget: its least peak plus the headroom.
    for (_, o) in &mut baselines {
        if let Outcome::Needs(Some(n)) = o {
            *n = plan::request::budget_for(*n, headroom);
        }
    }
    let explained: Vec<(usize, Vec<plan::explain::Alternative>)> = explain
        .iter()
        .map(|&op| {
            let alts = plan::explain::alternatives(
                &spec,
                &machine,
                &planned.plan,
                op,
                req.max_split,
                usable,
            );
            (op, alts)
        })
        .collect();
    let default_why = chosen.explain_default(&spec, &machine, cpu);
    Ok(PlanReport {
        target: req.target,
        blocks: Blocks::of(&spec),
        timing_source: machine.timing_source(),
        unaligned_note: unaligned_note(&machine, &spec),
        spec,
        layout,
        budget,
        headroom,
        usable,
        host_budget: if machine.offers_offload() {
            machine.host_budget_bytes
        } else {
            0
        },
        binding_gpu,
        chosen,
        default_why,
        search_ms,
        search_cpu_ms,
        resolution_bytes,
        planned,
        baselines,
        explained,
    })
}

/// The `--pin` flags as (op, choice), each op pinned once.
fn pins_of(
    req: &PlanCommand,
    spec: &ModelSpec,
    machine: &Machine,
) -> Result<Vec<(usize, Choice)>, Failure> {
    let pins = req
        .pins
        .iter()
        .map(|p| {
            let (i, c) = parse_pin(spec, machine, p)?;
            req.target.allows(c).map_err(|why| {
                format!(
                    "--pin {:?}: --target {} cannot run it: {why}",
                    printable(p),
                    req.target.as_str()
                )
            })?;
            Ok((i, c))
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(Failure::input)?;
    // Two pins of one op: which should win is the user's call, not the order of flags.
    for (k, (i, _)) in pins.iter().enumerate() {
        if let Some(first) = pins[..k].iter().position(|(j, _)| j == i) {
            return Err(Failure::input(format!(
                "--pin {:?} and --pin {:?} pin the same op {:?}: give one",
                osdp_core::text::printable(&req.pins[first]),
                osdp_core::text::printable(&req.pins[k]),
                osdp_core::text::printable(&spec.ops[*i].id)
            )));
        }
    }
    Ok(pins)
}

/// The `--recompute-block` flags as (block, recomputed), each block fixed once.
fn block_recompute_of(req: &PlanCommand, spec: &ModelSpec) -> Result<Vec<(usize, bool)>, Failure> {
    let mut block_recompute: Vec<(usize, bool)> = Vec::new();
    for arg in &req.recompute_blocks {
        for (b, on) in parse_block_recompute(spec, arg).map_err(Failure::input)? {
            if block_recompute.iter().any(|&(x, _)| x == b) {
                return Err(Failure::input(format!(
                    "--recompute-block {:?}: block {b} is fixed twice: give it once",
                    osdp_core::text::printable(arg)
                )));
            }
            block_recompute.push((b, on));
        }
    }
    Ok(block_recompute)
}

/// The ops `--explain` names, by index.
fn explained_ops(req: &PlanCommand, spec: &ModelSpec) -> Result<Vec<usize>, Failure> {
    req.explain
        .iter()
        .map(|id| {
            spec.ops.iter().position(|o| o.id == *id).ok_or_else(|| {
                Failure::input(format!(
                    "--explain {:?}: {} has no op of that id (`osdp-tui inspect` lists them)",
                    printable(id),
                    printable(&spec.name)
                ))
            })
        })
        .collect()
}

/// The failure of a search that found no plan within `budget`: what binds, and the least
/// budget that fits when there is one.
fn no_fit_failure(
    spec: &ModelSpec,
    layout: &Layout,
    budget: u64,
    headroom: f64,
    nf: &NoFit,
) -> Failure {
    // The searches ran within the budget less the headroom: the least budget keeps it too.
    let usable = plan::request::usable(budget, headroom);
    Failure {
        code: EXIT_NO_FIT,
        message: match nf
            .min_budget_bytes
            .map(|n| plan::request::budget_for(n, headroom))
        {
            Some(least) => format!(
                "no plan of {} fits {} per {} on {}; the smallest budget that fits is {} \
                 (--budget {least}B)",
                spec.name,
                units::bytes(budget),
                layout.device.kind.rank_noun(),
                layout.name,
                units::bytes(least),
            ),
            None => format!(
                "no plan of {} on {}: {}",
                spec.name,
                layout.name,
                nf.describe(usable, layout.device.kind.rank_noun())
            ),
        },
    }
}

/// The smallest budget that fits, checked: with a memory resolution the least peak a search
/// reaches depends a little (under a resolution step) on the budget its frontiers were built
/// for, so the budget a failed search names is searched again until it fits.
fn least_that_fits(
    spec: &ModelSpec,
    machine: &Machine,
    options: &PlanOptions,
    mut nf: NoFit,
) -> NoFit {
    for _ in 0..8 {
        let Some(least) = nf.min_budget_bytes else {
            break;
        };
        match plan_with_baselines(spec, machine, options.clone(), least) {
            Ok(_) => break,
            Err(again) if again.min_budget_bytes > Some(least) => nf = again,
            // Not closer: name the next byte's worth of budget up, which is searched next.
            Err(_) => {
                nf.min_budget_bytes = least.checked_add(options.resolution_bytes.max(1));
            }
        }
    }
    nf
}

/// `plan`: plan, write the plan file if asked, print the report.
/// CPU time this thread has run, in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

pub fn plan(req: PlanCommand) -> Result<(), Failure> {
    let r = plan_report(&req)?;
    if let Some(path) = &req.output {
        let file = PlanFile {
            target: req.target,
            ..PlanFile::new(
                &r.spec,
                &r.layout.name,
                &r.planned.plan,
                Some(&r.planned.prediction),
            )
        };
        osdp_core::input::write_json_atomically(path, &file)
            .map_err(|e| Failure::output(path, e))?;
    }
    if req.json {
        print_json(&r.json());
        return Ok(());
    }
    r.print_text();
    if let Some(path) = &req.output {
        println!("\nwrote {}", printable(&path.display().to_string()));
    }
    Ok(())
}

impl PlanReport {
    /// The `--json` form.
    fn json(&self) -> PlanOut<'_> {
        let (spec, layout, plan, prediction, blocks) = (
            &self.spec,
            &self.layout,
            &self.planned.plan,
            &self.planned.prediction,
            &self.blocks,
        );
        let (budget, binding_gpu, chosen) = (self.budget, self.binding_gpu, self.chosen);
        PlanOut {
            model: &spec.name,
            layout: &layout.name,
            ranks: layout.world_size(),
            headline: Headline::of(prediction, budget),
            headroom: HeadroomOut {
                headroom_percent: self.headroom * 100.0,
                usable_budget_bytes: self.usable,
            },
            binding_gpu,
            host_budget_bytes: (self.host_budget > 0).then_some(self.host_budget),
            host_gap_s: self.planned.host_gap_s,
            resolution_bytes: self.resolution_bytes,
            search_time_ms: self.search_ms,
            search_cpu_ms: self.search_cpu_ms,
            timing_source: self.timing_source.clone(),
            unaligned_note: self.unaligned_note.clone(),
            prediction,
            ops: spec
                .ops
                .iter()
                .enumerate()
                .map(|(i, op)| OpOut {
                    id: &op.id,
                    strategy: plan.choices[i].strategy.as_str(),
                    split: plan.choices[i].split,
                    sharded_slices: plan.choices[i].sharded,
                    offload: plan.choices[i].offload,
                    recompute: blocks.of_op[i].is_some_and(|b| plan.recompute[b]),
                    keep_weights: blocks.of_op[i].is_some_and(|b| plan.keeps(b)),
                    memory_bytes: prediction.ops[i].memory_bytes,
                    time_s: prediction.ops[i].time_s,
                })
                .collect(),
            global_batch_source: match chosen {
                plan::GlobalBatch::Given(_) => "given",
                plan::GlobalBatch::Default(_) => "default",
                plan::GlobalBatch::Any => "any",
            },
            baselines: self
                .baselines
                .iter()
                .map(|(b, o)| (b.name(), BaselineOut::of(*b, o)))
                .collect(),
            explain: self
                .explained
                .iter()
                .map(|(op, alts)| (spec.ops[*op].id.clone(), alts.clone()))
                .collect(),
        }
    }

    /// The text form.
    fn print_text(&self) {
        let (spec, layout, prediction, blocks) = (
            &self.spec,
            &self.layout,
            &self.planned.prediction,
            &self.blocks,
        );
        let (budget, binding_gpu, chosen) = (self.budget, self.binding_gpu, self.chosen);
        let rank = layout.device.kind.rank_noun();
        println!(
            "{} on {} ({}), budget {} per {rank}{}{}",
            printable(&spec.name),
            printable(&layout.name),
            units::counted(u64::from(layout.world_size()), "rank"),
            units::bytes(budget),
            headroom_words(self.headroom, self.usable),
            binding_gpu
                .map(|g| format!(" (GPU {g} binds)"))
                .unwrap_or_default()
        );
        print_prediction("plan", prediction);
        match chosen {
            plan::GlobalBatch::Default(_) => println!(
                "  {} is the default; --global-batch N sets it (`any`: {})",
                self.default_why.as_deref().unwrap_or_default(),
                crate::cli::request::ANY_MEANS
            ),
            plan::GlobalBatch::Any => println!(
                "  global batch: any ({}); a fixed --global-batch N with accumulation can be a little faster",
                crate::cli::request::ANY_MEANS
            ),
            plan::GlobalBatch::Given(_) => {}
        }
        println!("  prices: {}", printable(&self.timing_source));
        if let Some(note) = &self.unaligned_note {
            println!("  note: {}", printable(note));
        }
        if let Some(note) = plan::export::kernels_note(spec, self.target) {
            println!("  note: {note}");
        }
        println!(
            "  searched in {:.2} ms (baselines included){}",
            self.search_ms,
            if self.resolution_bytes > 1 << 20 {
                format!(
                    ", memory resolved to {} (--resolution sets it)",
                    units::bytes(self.resolution_bytes)
                )
            } else {
                String::new()
            }
        );
        if self.host_budget > 0 {
            println!(
                "  host: {} of offloaded state per {rank}, budget {} (--host-budget sets it; 0 \
                 never offloads)",
                units::bytes(prediction.host_bytes),
                units::bytes(self.host_budget)
            );
        }
        if let Some(gap) = self.planned.host_gap_s {
            println!("  note: {}", Planned::host_priced_note(Some(gap)));
        }
        if self.planned.coarsened_bytes > 0 {
            println!(
            "  note: the model has too many distinct transient sizes to search exactly; memory was resolved to {} (the peak may be that much above the best plan's)",
            units::bytes(self.planned.coarsened_bytes)
        );
        }
        println!();
        print_plan_by_block(spec, &self.planned.plan, blocks);
        println!();
        println!(
            "  {:<12}{:>14}{:>14}{:>12}{:>10}",
            "baseline", "batch", "samples/s", "peak", "plan is"
        );
        for (b, o) in &self.baselines {
            match o {
                Outcome::Fits(p) => println!(
                    "  {:<12}{:>14}{:>14.2}{:>12}{:>9.2}×",
                    b.name(),
                    p.prediction.batch_label(),
                    p.prediction.throughput_samples_per_s,
                    units::bytes(p.prediction.peak_memory_bytes),
                    prediction.throughput_samples_per_s / p.prediction.throughput_samples_per_s
                ),
                Outcome::Needs(Some(n)) => println!(
                    "  {:<12}{:>14}  needs ≥ {} per {rank}",
                    b.name(),
                    "does not fit",
                    units::bytes(*n)
                ),
                Outcome::Needs(None) => println!("  {:<12}{:>14}", b.name(), "does not fit"),
            }
        }
        let faster: Vec<&str> = self
            .baselines
            .iter()
            .filter(|(_, o)| {
                o.planned().is_some_and(|p| {
                    p.ahead_only_as_users_run_it(prediction.throughput_samples_per_s)
                })
            })
            .map(|(b, _)| b.name())
            .collect();
        if !faster.is_empty() {
            println!(
                "  note: {} as FSDP runs it beats the plan: FSDP keeps a recomputed unit's parameters gathered into its backward, where osdp-tui's trainer gathers them again (run by the trainer, it would not beat it)",
                faster.join(", ")
            );
        }
        for (op, alts) in &self.explained {
            print_alternatives(spec, *op, alts);
        }
    }
}

fn print_prediction(what: &str, p: &Prediction) {
    let accumulation = if p.accumulation > 1 {
        format!(" × {} accumulated", p.accumulation)
    } else {
        String::new()
    };
    println!(
        "  {what}: global batch {} (micro-batch {}{accumulation} × {})",
        p.global_batch,
        p.batch_size,
        units::counted(p.ranks(), "rank"),
    );
    println!(
        "  {} samples/s ({:.0} tokens/s), step {}, peak {}",
        units::figure(p.throughput_samples_per_s, 2),
        p.tokens_per_s,
        units::seconds(p.step_time_s),
        units::bytes(p.peak_memory_bytes)
    );
    let side = if p.side_pool_bytes > 0 {
        format!(
            " + {} cached by the collectives' streams",
            units::bytes(p.side_pool_bytes)
        )
    } else {
        String::new()
    };
    println!(
        "  memory: {} states + {} activations + {} transient + {} runtime{side}",
        units::bytes(p.persistent_bytes),
        units::bytes(p.activation_bytes),
        units::bytes(p.max_transient_bytes),
        units::bytes(p.overhead_bytes)
    );
    let other = if p.step_overhead_s > 0.0 {
        format!(" + {} other", units::seconds(p.step_overhead_s))
    } else {
        String::new()
    };
    println!(
        "  time: {} compute + {} recompute + {} exposed comm + {} optimizer{other}",
        units::seconds(p.compute_s),
        units::seconds(p.recompute_s),
        units::seconds(p.exposed_comm_s),
        units::seconds(p.optimizer_s)
    );
}

/// One line per run of blocks with the same choices, then the ops outside blocks.
fn print_plan_by_block(spec: &ModelSpec, plan: &plan::Plan, blocks: &Blocks) {
    for run in blocks.runs(spec, plan) {
        println!("  {:<14}{}", run.range(), run.description);
    }
    let outside: Vec<String> = spec
        .ops
        .iter()
        .enumerate()
        .filter(|(i, _)| blocks.of_op[*i].is_none() && plan.choices[*i].strategy != Strategy::None)
        .map(|(i, o)| format!("{}={}", printable(&o.id), plan.choices[i].label()))
        .collect();
    println!("  {:<14}{}", "other", outside.join(" "));
}

#[derive(Serialize)]
struct EvaluateOut<'a> {
    #[serde(flatten)]
    headline: Headline,
    fits: bool,
    timing_source: String,
    prediction: &'a Prediction,
}

pub fn evaluate(
    model: &Path,
    layout: &Path,
    plan_path: &Path,
    budget: Option<u64>,
    global_batch: Option<u64>,
    json: bool,
) -> Result<(), Failure> {
    let (spec, layout) = load(model, layout)?;
    let (mut plan, target) = plan::read_plan_for(plan_path, &spec).map_err(Failure::input)?;
    if let Some(g) = global_batch {
        let options = PlanOptions {
            batch: Some(plan.batch),
            global_batch: Some(g),
            ..Default::default()
        };
        let pairs = plan::batch_options(&options, layout.world_size())
            .map_err(|e| Failure::input(format!("--global-batch: {e}")))?;
        plan.accumulation = pairs.first().map_or(1, |&(_, a)| a);
    }
    let mut machine = machine_for(&spec, &layout, &plan, plan_path)?;
    // Priced as what the plan was made for runs it.
    machine.set_target(target, &spec);
    let p = plan::evaluate(&spec, &machine, &plan);
    let budget = budget.unwrap_or_else(|| layout.memory_bytes());
    let fits = p.peak_memory_bytes <= budget;
    if json {
        let out = EvaluateOut {
            headline: Headline::of(&p, budget),
            fits,
            timing_source: machine.timing_source(),
            prediction: &p,
        };
        print_json(&out);
        return Ok(());
    }
    println!(
        "{} on {} ({})",
        printable(&spec.name),
        printable(&layout.name),
        units::counted(u64::from(layout.world_size()), "rank")
    );
    print_prediction("plan", &p);
    println!("  prices: {}", printable(&machine.timing_source()));
    println!(
        "  {} the budget of {}",
        if fits { "fits" } else { "does NOT fit" },
        units::bytes(budget)
    );
    Ok(())
}

/// `plan --explain OP`: the op's every choice, priced as the whole plan with only it changed.
fn print_alternatives(spec: &ModelSpec, op: usize, alts: &[plan::explain::Alternative]) {
    println!();
    println!(
        "  {} ({}): each choice, the rest of the plan kept",
        printable(&spec.ops[op].id),
        spec.ops[op].kind.as_str()
    );
    println!(
        "  {:<12}{:>12}{:>12}{:>12}{:>12}  why not",
        "choice", "Δ step", "Δ peak", "held", "transient"
    );
    for a in alts {
        let peak = match a.delta_peak_bytes {
            0 => "±0".to_string(),
            b if b > 0 => format!("+{}", units::bytes(b as u64)),
            b => format!("-{}", units::bytes(b.unsigned_abs())),
        };
        println!(
            "  {:<12}{:>12}{:>12}{:>12}{:>12}  {}",
            a.choice.label(),
            if a.delta_step_s == 0.0 {
                "±0".to_string()
            } else {
                format!("{:+.2} ms", a.delta_step_s * 1e3)
            },
            peak,
            units::bytes(a.persistent_bytes),
            units::bytes(a.transient_bytes),
            a.verdict.text()
        );
    }
}

/// The machine `layout` makes for `spec`, checked to run `plan` (read from `plan_path`).
fn machine_for(
    spec: &ModelSpec,
    layout: &Layout,
    plan: &plan::Plan,
    plan_path: &Path,
) -> Result<Machine, Failure> {
    let machine = Machine::new(layout, spec);
    plan::check_machine(spec, plan, &machine).map_err(|e| {
        Failure::input(format!(
            "{} on layout {:?}: {e}",
            plan_path.display(),
            printable(&layout.name)
        ))
    })?;
    Ok(machine)
}

/// `export --to fsdp2`: the plan at `plan_path` written for `osdp_torch.apply_plan`.
pub fn export_fsdp2(
    model: &Path,
    layout: &Path,
    plan_path: &Path,
    output: &Path,
) -> Result<(), Failure> {
    let (spec, layout) = load(model, layout)?;
    let plan = plan::read_plan(plan_path, &spec).map_err(Failure::input)?;
    let machine = machine_for(&spec, &layout, &plan, plan_path)?;
    let export = plan::export::fsdp2_export(&spec, &layout.name, &machine, &plan)
        .map_err(|e| Failure::input(format!("{}: {e}", plan_path.display())))?;
    osdp_core::input::write_json_atomically(output, &export)
        .map_err(|e| Failure::output(output, e))?;
    println!(
        "wrote {}: {} modules for FSDP2 on {}, micro-batch {} × {} accumulated, {} \
         parameter bytes per rank",
        printable(&output.display().to_string()),
        export.modules.len(),
        units::counted(u64::from(export.world_size), "rank"),
        export.micro_batch,
        export.accumulation,
        export.predicted.param_bytes_per_rank
    );
    if let Some(note) = plan::export::kernels_note(&spec, plan::Target::Fsdp2) {
        println!("note: {note}");
    }
    Ok(())
}

/// Names the linears whose weights have a dimension not a multiple of 8, which `machine`
/// prices at its generation's measured unaligned GEMM rate, and what avoids it.
fn unaligned_note(machine: &osdp_core::cost::Machine, spec: &ModelSpec) -> Option<String> {
    let slow = machine.unaligned_linears(spec);
    let (first, shape) = slow.first()?;
    let (dims, padded) = unaligned_shapes(shape);
    let others = match slow.len() {
        1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    // The trainer pads only the output rows, and only where that adds under 1 %.
    let trainer_pads = machine.target == osdp_core::cost::Target::Osdp
        && osdp_core::cost::padded_weight_rows(shape).is_some()
        && osdp_core::cost::gemm_aligned(shape[1]);
    let pads = if trainer_pads {
        ". osdp-tui's trainer pads this weight on a GPU (OSDP_GEMM_PADDING=0 turns it off); \
         what that saves is not measured yet, so the price is the unpadded one"
    } else {
        ""
    };
    Some(format!(
        "{first}{others}: its weight is {dims}, a dimension not a multiple of 8, so its bf16 GEMMs \
         are priced at {:.0} % of peak (measured on this GPU generation); padded to {padded} it \
         would run at the aligned rate{pads}",
        100.0 * machine.efficiency.unaligned_matmul,
    ))
}

/// The dashboard's words for one linear priced at the unaligned GEMM rate (the operator's
/// choices popup), `None` for any other op.
pub fn unaligned_op_words(
    machine: &osdp_core::cost::Machine,
    op: &osdp_core::model::OpSpec,
) -> Option<String> {
    let (dims, padded) = unaligned_shapes(machine.unaligned_weight(op)?);
    Some(format!(
        "{dims} is not a multiple of 8: GEMMs at {:.0} % of peak ({padded} would not be)",
        100.0 * machine.efficiency.unaligned_matmul
    ))
}

/// A weight's shape in words, and the same padded to a multiple of 64 where a dimension is
/// not a multiple of 8: ("50,257 × 1,024", "50,304 × 1,024").
fn unaligned_shapes(shape: &[i64]) -> (String, String) {
    let words = |f: &dyn Fn(u64) -> u64| {
        shape
            .iter()
            .map(|&d| units::thousands(f(d.max(1) as u64)))
            .collect::<Vec<_>>()
            .join(" × ")
    };
    (
        words(&|d| d),
        words(&|d| {
            if osdp_core::cost::gemm_aligned(d as i64) {
                d
            } else {
                d.div_ceil(64) * 64
            }
        }),
    )
}

/// ", 5 % headroom (plans within 75.7 GiB)" beside the budget; ", no headroom" at 0.
pub fn headroom_words(headroom: f64, usable: u64) -> String {
    if headroom <= 0.0 {
        ", no headroom (--headroom sets it)".to_string()
    } else {
        format!(
            ", {} % headroom (plans within {})",
            format!("{:.2}", headroom * 100.0)
                .trim_end_matches('0')
                .trim_end_matches('.'),
            units::bytes(usable)
        )
    }
}
