//! `calibrate` and `validate`: time the trainer's kernels.

use osdp_tui::cli::measure::*;
use osdp_tui::cli::train::DeviceArg;
use osdp_tui::cli::Failure;

/// A one-line progress bar on a terminal, a line per phase otherwise.
struct Bar {
    tty: bool,
    last: String,
}

impl Bar {
    fn new() -> Bar {
        use std::io::IsTerminal;
        Bar {
            tty: std::io::stderr().is_terminal(),
            last: String::new(),
        }
    }

    fn show(&mut self, fraction: f64, what: &str) {
        let f = fraction.clamp(0.0, 1.0);
        if self.tty {
            let width = 24;
            let filled = (f * width as f64).round() as usize;
            eprint!(
                "\r\x1b[2K[{}{}] {:>3.0}%  {what}",
                "#".repeat(filled),
                "-".repeat(width - filled),
                f * 100.0
            );
        } else if what != self.last {
            eprintln!("{:>3.0}%  {what}", f * 100.0);
        }
        self.last = what.to_string();
    }

    fn finish(&self) {
        if self.tty {
            eprintln!();
        }
    }
}

pub fn calibrate(args: CalibrateArgs) -> Result<(), Failure> {
    use osdp_train::calibrate::{self, CalibrateConfig};

    if args.device == DeviceArg::Cuda && !osdp_train::tch::Cuda::is_available() {
        return Err(no_cuda());
    }
    // Say so before a minute of measuring, not after.
    check_output(&args.output)?;
    if args.device == DeviceArg::Cuda {
        return calibrate_cuda(&args);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ranks = args.ranks.map_or(cores.min(8), |r| r as usize);
    osdp_train::measure::check_rank_threads(ranks).map_err(|e| {
        Failure::input(format!(
            "--ranks {ranks}: {e}; calibrate fewer ranks (the default is one per core)"
        ))
    })?;
    let base = cpu_base_layout(&args)?;
    let models = cpu_models(&args)?;
    let name = args
        .output
        .file_stem()
        .map_or("local".into(), |s| s.to_string_lossy().into_owned());
    let mut base = base;
    base.name = name;
    let command = command_line();
    let cfg = CalibrateConfig {
        ranks,
        models,
        max_batch: if args.quick { 4 } else { args.max_batch },
        max_step_s: if args.quick { 0.5 } else { 2.0 },
        steps: if args.quick { 1 } else { 3 },
        base,
        command,
    };
    let mut bar = Bar::new();
    let ticks_before = osdp_train::measure::cpu_ticks();
    let result = calibrate::calibrate(&cfg, &mut |f, what| bar.show(f, what));
    bar.finish();
    let steal = warn_of_steal(ticks_before);
    let mut layout = result.map_err(|e| Failure {
        code: 1,
        message: format!("calibration failed: {e}"),
    })?;
    if let Some(c) = layout.calibration.as_mut() {
        c.cpu_steal_fraction = steal;
    }
    let when = layout
        .calibration
        .as_ref()
        .map_or(String::new(), |c| c.measured_at.clone());
    layout.description =
        format!("This machine's CPU ({ranks} ranks) as measured by `osdp-tui calibrate` on {when}");
    osdp_core::input::write_json_atomically(&args.output, &layout)
        .map_err(|e| Failure::output(&args.output, e))?;
    if args.json {
        osdp_tui::report::print_json(&layout);
        return Ok(());
    }
    print_cpu_calibration(&layout);
    print_host(&layout);
    print_wrote(&args.output);
    Ok(())
}

/// `-o` can be written: its directory exists, and it is a file (or nothing) that a file can
/// be written beside, or a character device.
fn check_output(output: &std::path::Path) -> Result<(), Failure> {
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(Failure::input(format!(
                "-o {}: the directory {} does not exist",
                output.display(),
                dir.display()
            )));
        }
    }
    osdp_core::input::check_writable(output)
        .map_err(|e| Failure::input(format!("-o {}: cannot write: {e}", output.display())))
}

/// The layout a CPU calibration completes: `--base`, else the built-in `cpu` layout.
fn cpu_base_layout(args: &CalibrateArgs) -> Result<osdp_core::cluster::Layout, Failure> {
    Ok(match &args.base {
        Some(p) => osdp_core::cluster::read_layout(p).map_err(Failure::input)?,
        None => osdp_core::input::parse_strict(
            std::path::Path::new("layouts/cpu.json"),
            include_str!("../../../layouts/cpu.json"),
            osdp_core::cluster::LAYOUT_FORMAT_VERSION,
        )
        .map_err(Failure::input)?,
    })
}

/// The models whose operators a CPU calibration times: `--model`'s, each checked runnable,
/// else the built-in ones.
fn cpu_models(args: &CalibrateArgs) -> Result<Vec<osdp_core::model::ModelSpec>, Failure> {
    if args.model.is_empty() {
        return Ok(osdp_train::calibrate::generic_models());
    }
    let mut v = Vec::new();
    for p in &args.model {
        let m = osdp_core::model::read_model(p).map_err(Failure::input)?;
        let plan = osdp_core::plan::uniform_plan(&m, osdp_core::cost::Strategy::Dp, 1);
        osdp_train::exec::check_runnable(&m, &plan)
            .map_err(|e| Failure::input(format!("{}: {e}", p.display())))?;
        v.push(m);
    }
    Ok(v)
}

/// The CPU time the hypervisor stole since `ticks_before`, with a warning on stderr when it
/// is too much to trust the timings.
fn warn_of_steal(ticks_before: Option<(u64, u64)>) -> Option<f64> {
    let steal = osdp_train::measure::steal_fraction(ticks_before, osdp_train::measure::cpu_ticks());
    if let Some(w) = osdp_train::measure::steal_warning(steal) {
        eprintln!("{w}");
    }
    steal
}

/// What a CPU calibration measured: the rates, the collectives, the kernel curves and the
/// optimizer.
fn print_cpu_calibration(layout: &osdp_core::cluster::Layout) {
    let cal = layout.calibration.as_ref();
    println!("{} ({} ranks)", layout.device.model, layout.world_size());
    println!(
        "  matmul: up to {:.1} GFLOP/s per rank; memory {:.1} GB/s per rank",
        layout
            .device
            .dense_tflops
            .fp32
            .as_ref()
            .map_or(0.0, |f| f.value)
            * 1e3,
        layout.device.memory_bandwidth_gb_per_s.value
    );
    if layout.world_size() > 1 {
        println!(
            "  collectives: {:.1} GB/s bus bandwidth, {:.0} µs per step",
            layout.intra_node.bus_bandwidth_gb_per_s.value, layout.intra_node.latency_us.value
        );
    }
    if let Some(c) = cal {
        let kinds: Vec<String> = c
            .kernels
            .iter()
            .map(|(k, pts)| format!("{k} ({})", pts.len()))
            .collect();
        println!("  kernel curves (points): {}", kinds.join(", "));
        let opt = |n: u64| c.optimizer_s(n) * 1e6;
        println!(
            "  optimizer per tensor: {:.0} µs at 1k elements, {:.0} µs at 1M; {:.2} ms other per step",
            opt(1 << 10),
            opt(1 << 20),
            c.step_overhead_s * 1e3
        );
    }
}

/// Where a calibration's layout went, and how to plan with it.
fn print_wrote(output: &std::path::Path) {
    println!(
        "wrote {}; plan with it: osdp-tui plan MODEL.json --layout {} --budget SIZE",
        output.display(),
        output.display()
    );
}

/// The host figures offloading prices with, one line.
fn print_host(layout: &osdp_core::cluster::Layout) {
    if let Some(h) = &layout.host {
        println!(
            "  host: CPU AdamW {:.0} M parameters/s per core ({} cores), link {:.1} GB/s, {:.1} GiB",
            h.adam_mparams_per_s_per_core.value,
            h.cpu_cores_per_node.value,
            h.link_gb_per_s.value,
            h.memory_gib_per_node.value
        );
    }
}

/// `calibrate --device cuda`: GPU 0 timed with the trainer's own kernels (bf16 linears narrow
/// and wide, fused causal attention per sequence length, element-wise streaming through HBM, the
/// pinned host link, the CPU AdamW step), written as the efficiencies and host figures of a GPU
/// layout: `--base`, else the shipped one-GPU layout of the GPU found, else one GPU of the
/// known-GPU table's figures for it ([`osdp_core::cluster::known::local_layout`]).
fn calibrate_cuda(args: &CalibrateArgs) -> Result<(), Failure> {
    use osdp_train::calibrate::{self, gpu};

    let gpu = gpu_sample();
    let name = gpu
        .as_ref()
        .map_or_else(|| "CUDA GPU 0".to_string(), |g| g.name.clone());
    // The layout to complete: --base, else the GPU's shipped one-GPU layout, else one GPU of
    // the known-GPU table's figures for its name (or its architecture's stand-in, said so).
    let (mut layout, base) = match args.base.clone().or_else(|| shipped_layout_for(&name)) {
        Some(p) => (
            osdp_core::cluster::read_layout(&p).map_err(Failure::input)?,
            p.display().to_string(),
        ),
        None => {
            // GPU 0 alone, as the dashboard would lay it out (checked: NVML may leave a figure
            // out). Efficiencies are fractions of the peaks: measured against a stand-in's, a
            // faster GPU would be capped at the stand-in's rate, so a guess is refused.
            let refuse = |why: &str| {
                Failure::input(format!(
                    "calibrate --device cuda: no layout ships for {name} and {why}; write a \
                     one-GPU layout with its datasheet rates (efficiencies are measured as \
                     fractions of them: `osdp-tui layout local --json` prints one to edit) and \
                     pass it with --base LAYOUT.json"
                ))
            };
            let l = osdp_tui::cli::local_gpus_layout(gpu.as_slice()).map_err(|e| refuse(&e))?;
            if osdp_core::cluster::known::rates_guessed(&l.device) {
                return Err(refuse(
                    "the known-GPU table does not name it, so its peak rates are not known",
                ));
            }
            (l, format!("the known-GPU table's figures for {name}"))
        }
    };
    // The architecture goes with the GPU measured, whatever layout it completes.
    if let Some((major, minor)) = gpu.as_ref().and_then(|g| g.compute_capability) {
        layout.device.compute_capability = Some(format!("{major}.{minor}"));
    }
    if layout.device.kind != osdp_core::cluster::DeviceKind::Gpu {
        return Err(Failure::input(format!(
            "calibrate --device cuda: {base} is not a GPU layout"
        )));
    }
    let mut models = Vec::new();
    for p in &args.model {
        models.push(osdp_core::model::read_model(p).map_err(Failure::input)?);
    }
    if let Some(stem) = args.output.file_stem() {
        layout.name = stem.to_string_lossy().into_owned();
    }
    let bench = gpu::GpuBench::for_models(0, &models, args.quick);
    let started = std::time::Instant::now();
    let mut bar = Bar::new();
    let measured = gpu::measure(&bench, &mut |f, w| bar.show(f, w));
    bar.finish();
    let measured = measured.map_err(|e| Failure {
        code: 1,
        message: format!("calibration failed: {e}"),
    })?;
    let when = calibrate::now_utc();
    let command = command_line();
    gpu::apply(
        &mut layout,
        &measured,
        &gpu::Provenance {
            gpu: &name,
            measured_at: &when,
            command: &command,
        },
    )
    .map_err(|e| Failure {
        code: 1,
        message: e.to_string(),
    })?;
    layout.description =
        format!("{name} as measured by `osdp-tui calibrate --device cuda` on {when} (from {base})");
    osdp_core::input::write_json_atomically(&args.output, &layout)
        .map_err(|e| Failure::output(&args.output, e))?;
    if args.json {
        osdp_tui::report::print_json(&layout);
        return Ok(());
    }
    let e = &layout.device.efficiency;
    let pct = |f: &Option<osdp_core::cluster::Figure>| f.as_ref().map_or(0.0, |f| 100.0 * f.value);
    println!(
        "{name}, measured in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    println!(
        "  bf16 linears: {:.1} % of the peak, half of that at {:.0} features ({} shapes)",
        pct(&e.matmul),
        e.matmul_half_width.as_ref().map_or(0.0, |f| f.value),
        measured.gemm.len()
    );
    println!(
        "  attention (causal): forward {:.1} %, backward {:.1} % of the peak",
        pct(&e.attention_forward),
        pct(&e.attention_backward)
    );
    println!(
        "  element-wise: {:.1} % of the datasheet's {:.0} GB/s",
        pct(&e.memory),
        layout.device.memory_bandwidth_gb_per_s.value
    );
    if layout.world_size() > 1 || osdp_train::tch::Cuda::device_count() > 1 {
        println!(
            "  collectives: not measured (NCCL bus bandwidth over several GPUs is not built yet)"
        );
    }
    print_host(&layout);
    print_wrote(&args.output);
    Ok(())
}

/// This command line, as a figure's source quotes it.
fn command_line() -> String {
    std::iter::once("osdp-tui".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ")
}

/// GPU 0 as the driver describes it (NVML): name, memory, compute capability.
fn gpu_sample() -> Option<osdp_tui::monitor::GpuSample> {
    use osdp_tui::monitor::GpuSource;
    osdp_tui::monitor::NvmlSource::open()
        .and_then(|mut s| s.sample())
        .ok()
        .and_then(|v| v.into_iter().next())
}

/// The shipped one-GPU layout for a GPU of this name (its datasheet peaks): the known-GPU
/// table's.
fn shipped_layout_for(gpu: &str) -> Option<std::path::PathBuf> {
    let stem = osdp_core::cluster::known::lookup(gpu)?.single_gpu_layout?;
    osdp_tui::cli::layout_arg(stem).ok()
}

/// Where `validate` runs a layout's plan: a CPU layout on this CPU's rank threads (fp32); a
/// one-GPU layout on GPU 0 in bf16 mixed precision, as `train --device cuda` runs it. Several
/// GPUs are several processes, which validation does not launch.
fn validate_target(
    layout: &osdp_core::cluster::Layout,
    path: &std::path::Path,
) -> Result<osdp_train::exec::Target, Failure> {
    use osdp_train::exec::{Numerics, Target};
    if layout.device.kind == osdp_core::cluster::DeviceKind::Cpu {
        return Ok(Target::CPU);
    }
    if layout.world_size() != 1 {
        return Err(Failure::input(format!(
            "{} has {} GPUs; validate times one GPU (a one-GPU layout such as h100-1x, or one \
             written by `osdp-tui calibrate --device cuda`); time several with `train --device \
             cuda --metrics`",
            path.display(),
            layout.world_size()
        )));
    }
    if !osdp_train::tch::Cuda::is_available() {
        return Err(Failure::input(format!(
            "{} is a GPU layout and no CUDA GPU is usable here: validate it on its GPU, or use a \
             CPU layout such as one written by `osdp-tui calibrate`",
            path.display()
        )));
    }
    Ok(Target {
        device: osdp_train::tch::Device::Cuda(0),
        numerics: Numerics::Bf16Mixed,
    })
}

/// `validate`: measure the plan, then print what was measured beside the prediction.
pub fn validate(args: ValidateArgs) -> Result<(), Failure> {
    let r = validate_report(&args)?;
    if args.json {
        osdp_tui::report::print_json(&r);
    } else {
        r.print_text();
    }
    Ok(())
}

/// The plan's prediction beside what `validate` measured; `--json` prints it as it is.
#[derive(serde::Serialize)]
struct ValidateReport {
    model: String,
    layout: String,
    timing_source: String,
    ranks: usize,
    batch_size: u64,
    /// Micro-batches per timed step (the plan's gradient accumulation).
    accumulation: u64,
    warmup_steps: usize,
    timed_steps: usize,
    repeats: u64,
    cpu_steal_fraction: Option<f64>,
    predicted: Figures,
    measured: Measured,
    ratio: Ratios,
    collectives: PredictedMeasured,
    compute_by_kind: std::collections::BTreeMap<String, PredictedMeasured>,
}

/// A step's time and a rank's peak memory, split as the cost model splits them.
#[derive(serde::Serialize)]
struct Figures {
    step_time_s: f64,
    operators_s: f64,
    optimizer_s: f64,
    other_s: f64,
    peak_memory_bytes: u64,
    states_bytes: u64,
    activation_bytes: u64,
    transient_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    runtime_overhead_bytes: Option<u64>,
}

#[derive(serde::Serialize)]
struct Measured {
    #[serde(flatten)]
    figures: Figures,
    step_time_s_per_repeat: Vec<f64>,
    per_rank: Vec<RankFigures>,
}

/// One rank's own accounts (medians over the timed steps).
#[derive(serde::Serialize)]
struct RankFigures {
    compute_s: f64,
    collectives_in_ops_s: f64,
    collective_calls: f64,
    sync_s: f64,
    optimizer_s: f64,
    step_s: f64,
}

#[derive(serde::Serialize)]
struct Ratios {
    step_time: f64,
    peak_memory: f64,
}

#[derive(serde::Serialize)]
struct PredictedMeasured {
    predicted_s: f64,
    measured_s: f64,
}

fn validate_report(args: &ValidateArgs) -> Result<ValidateReport, Failure> {
    let model = osdp_core::model::read_model(&args.model).map_err(Failure::input)?;
    let layout = osdp_core::cluster::read_layout(&args.layout).map_err(Failure::input)?;
    let plan = osdp_core::plan::read_plan(&args.plan, &model).map_err(Failure::input)?;
    osdp_train::exec::check_runnable(&model, &plan)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    let target = validate_target(&layout, &args.layout)?;
    let ranks = layout.world_size() as usize;
    osdp_train::measure::check_rank_threads(ranks).map_err(|e| {
        Failure::input(format!(
            "{}: {e}; validate runs every rank of the layout as a thread: validate a layout of \
             fewer ranks (such as one `osdp-tui calibrate` writes)",
            args.layout.display()
        ))
    })?;
    let machine = osdp_core::cost::Machine::new(&layout, &model);
    osdp_core::plan::check_machine(&model, &plan, &machine)
        .map_err(|e| Failure::input(format!("{}: {e}", args.plan.display())))?;
    let predicted = osdp_core::plan::evaluate(&model, &machine, &plan);
    if target.device == osdp_train::tch::Device::Cpu {
        check_host_memory(&model.name, &predicted, ranks)?;
    }
    let weights = match &args.init_from {
        Some(dir) => {
            Some(osdp_train::hf_weights::HfWeights::open(dir, &model).map_err(Failure::input)?)
        }
        None => None,
    };
    let timed = time_plan(args, &model, &plan, target, ranks, weights.as_ref())?;
    let last = &timed.last;
    let measured = measured_figures(
        last,
        osdp_train::measure::median(&mut timed.medians.clone()),
    );
    let predicted_figures = predicted_figures(&predicted);
    Ok(ValidateReport {
        model: model.name.clone(),
        layout: layout.name.clone(),
        timing_source: machine.timing_source(),
        ranks,
        batch_size: plan.batch,
        accumulation: plan.accumulation.max(1),
        warmup_steps: args.warmup,
        timed_steps: args.steps as usize,
        repeats: args.repeat,
        cpu_steal_fraction: timed.steal,
        ratio: Ratios {
            step_time: measured.step_time_s / predicted.step_time_s,
            peak_memory: measured.peak_memory_bytes as f64
                / predicted_figures.peak_memory_bytes as f64,
        },
        predicted: predicted_figures,
        collectives: PredictedMeasured {
            predicted_s: predicted.exposed_comm_s,
            measured_s: rank_median(last, 0, &|p| {
                p.fwd_coll_s.iter().chain(&p.bwd_coll_s).sum::<f64>() + p.sync_s
            }),
        },
        compute_by_kind: compute_by_kind(&model, &machine, &plan, last),
        measured: Measured {
            figures: measured,
            per_rank: per_rank_figures(last, ranks),
            step_time_s_per_repeat: timed.medians,
        },
    })
}

/// Refuse a CPU validation whose ranks, all in this process, would not fit this machine's
/// available memory: each rank's predicted peak less the runtime's overhead, plus the runtime
/// once. Where the kernel does not say what is available, the run goes ahead.
fn check_host_memory(
    model: &str,
    predicted: &osdp_core::plan::Prediction,
    ranks: usize,
) -> Result<(), Failure> {
    use osdp_core::units::bytes;
    let Some(available) = osdp_train::measure::available_memory_bytes() else {
        return Ok(());
    };
    let per_rank = predicted
        .peak_memory_bytes
        .saturating_sub(predicted.overhead_bytes);
    let need = per_rank
        .saturating_mul(ranks as u64)
        .saturating_add(predicted.overhead_bytes);
    if need <= available {
        return Ok(());
    }
    Err(Failure::input(format!(
        "{model} on {ranks} rank(s) needs about {} of memory ({} per rank, as predicted), and \
         this machine has {} available: validate a smaller model, or a plan made with --budget \
         {} or less",
        bytes(need),
        bytes(per_rank),
        bytes(available),
        bytes(available / ranks.max(1) as u64)
    )))
}

/// What `validate` timed: each repetition's median step, the last repetition's steps, and
/// the CPU time stolen meanwhile.
struct Timed {
    medians: Vec<f64>,
    last: Vec<osdp_train::measure::StepSample>,
    steal: Option<f64>,
}

/// Run the plan `--repeat` times (warm-up, then timed steps), with a progress bar.
fn time_plan(
    args: &ValidateArgs,
    model: &osdp_core::model::ModelSpec,
    plan: &osdp_core::plan::Plan,
    target: osdp_train::exec::Target,
    ranks: usize,
    weights: Option<&osdp_train::hf_weights::HfWeights>,
) -> Result<Timed, Failure> {
    use osdp_train::measure::{measure_plan, median, Timing};

    let mut bar = Bar::new();
    let ticks_before = osdp_train::measure::cpu_ticks();
    let steps = args.steps as usize;
    let total = (args.repeat as usize * (args.warmup + steps)) as f64;
    let mut medians = Vec::new();
    let mut last = Vec::new();
    for r in 0..args.repeat as usize {
        let done_before = (r * (args.warmup + steps)) as f64;
        let label = format!("repetition {}/{}", r + 1, args.repeat);
        bar.show(done_before / total, &label);
        let run = Timing {
            ranks,
            warmup: args.warmup,
            steps,
            weights,
        };
        let samples = measure_plan(model, plan, target, run, |s| {
            bar.show((done_before + s as f64) / total, &label)
        })
        .map_err(|e| Failure {
            code: 1,
            message: format!("validation run failed: {e}"),
        })?;
        let mut t: Vec<f64> = samples.iter().map(|s| s.step_s).collect();
        medians.push(median(&mut t));
        last = samples;
    }
    bar.finish();
    let steal = warn_of_steal(ticks_before);
    Ok(Timed {
        medians,
        last,
        steal,
    })
}

/// Rank `r`'s figure `f` of its profile, the median over the timed steps.
fn rank_median(
    samples: &[osdp_train::measure::StepSample],
    r: usize,
    f: &dyn Fn(&osdp_train::exec::Profile) -> f64,
) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(|s| f(&s.profiles[r])).collect();
    osdp_train::measure::median(&mut v)
}

/// The prediction as the cost model splits it; its peak less the runtime overhead (which
/// the trainer's ledger cannot see).
fn predicted_figures(predicted: &osdp_core::plan::Prediction) -> Figures {
    let p_ops = predicted.compute_s + predicted.recompute_s + predicted.exposed_comm_s;
    let p_peak = predicted.peak_memory_bytes - predicted.overhead_bytes;
    Figures {
        step_time_s: predicted.step_time_s,
        operators_s: p_ops,
        optimizer_s: predicted.optimizer_s,
        other_s: predicted.step_overhead_s,
        peak_memory_bytes: p_peak,
        states_bytes: predicted.persistent_bytes,
        activation_bytes: predicted.activation_bytes,
        transient_bytes: predicted.max_transient_bytes,
        runtime_overhead_bytes: Some(predicted.overhead_bytes),
    }
}

/// What was measured, split as the cost model splits it: where the time went, per category
/// (rank 0's profile, median over timed steps; `m_step`: the median step), and the ledger's
/// peak per rank.
fn measured_figures(last: &[osdp_train::measure::StepSample], m_step: f64) -> Figures {
    let cat = |f: &dyn Fn(&osdp_train::exec::Profile) -> f64| rank_median(last, 0, f);
    let m_ops = cat(&|p| p.fwd_s.iter().chain(&p.bwd_s).sum::<f64>() + p.recompute_s + p.sync_s);
    let m_opt = cat(&|p| p.optimizer_s);
    let m_other = (m_step - m_ops - m_opt).max(0.0);
    let peak = last
        .iter()
        .flat_map(|s| s.peaks.iter())
        .max_by_key(|b| b.total())
        .copied()
        .unwrap_or_default();
    Figures {
        step_time_s: m_step,
        operators_s: m_ops,
        optimizer_s: m_opt,
        other_s: m_other,
        peak_memory_bytes: peak.total(),
        states_bytes: peak.params + peak.grads + peak.optimizer,
        activation_bytes: peak.activations,
        transient_bytes: peak.gathered + peak.grad_buffers + peak.working,
        runtime_overhead_bytes: None,
    }
}

/// Forward + backward compute per kernel kind (a split linear's slices included): the cost
/// model's figures against rank 0's op timings less the collectives inside them. Those are
/// compared on their own, with the gradient synchronisation and zero1/zero2 re-gathers the
/// trainer runs between ops (`sync_s`): all of it is what the model calls exposed comm.
/// Over every micro-batch of the step, as the profile sums them.
fn compute_by_kind(
    model: &osdp_core::model::ModelSpec,
    machine: &osdp_core::cost::Machine,
    plan: &osdp_core::plan::Plan,
    last: &[osdp_train::measure::StepSample],
) -> std::collections::BTreeMap<String, PredictedMeasured> {
    let mut bases = osdp_core::cost::op_bases(model, machine, plan.batch);
    osdp_core::cost::set_accumulation(&mut bases, plan.accumulation);
    let mut by_kind: std::collections::BTreeMap<&str, (f64, f64)> = Default::default();
    for (i, op) in model.ops.iter().enumerate() {
        let e = by_kind
            .entry(osdp_core::cost::kernel_key(model, op))
            .or_default();
        e.0 += osdp_core::cost::price(&bases[i], plan.choices[i], machine).compute_s;
        e.1 += rank_median(last, 0, &|p| {
            p.fwd_s[i] + p.bwd_s[i] - p.fwd_coll_s[i] - p.bwd_coll_s[i]
        });
    }
    by_kind
        .into_iter()
        .map(|(k, (p, m))| {
            (
                k.to_string(),
                PredictedMeasured {
                    predicted_s: p,
                    measured_s: m,
                },
            )
        })
        .collect()
}

/// Each rank's own accounts (medians over the timed steps): the ranks wait for the slowest
/// at every collective, so imbalance shows here.
fn per_rank_figures(last: &[osdp_train::measure::StepSample], ranks: usize) -> Vec<RankFigures> {
    (0..ranks)
        .map(|r| RankFigures {
            compute_s: rank_median(last, r, &|p| p.fwd_s.iter().chain(&p.bwd_s).sum::<f64>()),
            collectives_in_ops_s: rank_median(last, r, &|p| {
                p.collectives.iter().map(|c| c.1).sum::<f64>()
            }),
            collective_calls: rank_median(last, r, &|p| p.collectives.len() as f64),
            sync_s: rank_median(last, r, &|p| p.sync_s),
            optimizer_s: rank_median(last, r, &|p| p.optimizer_s),
            step_s: rank_median(last, r, &|p| p.step_s),
        })
        .collect()
}

impl ValidateReport {
    fn print_text(&self) {
        use osdp_core::units;
        let (p, m) = (&self.predicted, &self.measured.figures);
        let (lo, hi) = self
            .measured
            .step_time_s_per_repeat
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        println!(
        "{} on {} ({} ranks), micro-batch {}{}: {} timed steps after {} warm-up, {} repetition(s)",
        self.model,
        self.layout,
        self.ranks,
        self.batch_size,
        if self.accumulation > 1 {
            format!(" × {} accumulated", self.accumulation)
        } else {
            String::new()
        },
        self.timed_steps,
        self.warmup_steps,
        self.repeats
    );
        println!("  prices: {}", self.timing_source);
        if let Some(f) = self.cpu_steal_fraction {
            println!(
                "  CPU stolen by the hypervisor while measuring: {:.1} %",
                f * 100.0
            );
        }
        println!(
            "  {:<34}{:>12}{:>12}{:>10}",
            "", "predicted", "measured", "ratio"
        );
        let ms = |s: f64| format!("{:.1} ms", s * 1e3);
        let row = |name: &str, p: String, m: String, r: Option<f64>| {
            println!(
                "  {name:<34}{p:>12}{m:>12}{:>10}",
                r.map_or(String::new(), |r| format!("{r:.2}"))
            );
        };
        let ratio = |m: f64, p: f64| (p > 0.0).then(|| m / p);
        row(
            "step time",
            ms(p.step_time_s),
            ms(m.step_time_s),
            Some(self.ratio.step_time),
        );
        if self.repeats > 1 {
            row(
                "  spread over repetitions",
                String::new(),
                format!("{}–{}", ms(lo), ms(hi)),
                None,
            );
        }
        row(
            "  operators and collectives",
            ms(p.operators_s),
            ms(m.operators_s),
            ratio(m.operators_s, p.operators_s),
        );
        for (k, f) in &self.compute_by_kind {
            row(
                &format!("    {k}"),
                ms(f.predicted_s),
                ms(f.measured_s),
                ratio(f.measured_s, f.predicted_s),
            );
        }
        row(
            "    collectives",
            ms(self.collectives.predicted_s),
            ms(self.collectives.measured_s),
            ratio(self.collectives.measured_s, self.collectives.predicted_s),
        );
        row(
            "  optimizer",
            ms(p.optimizer_s),
            ms(m.optimizer_s),
            ratio(m.optimizer_s, p.optimizer_s),
        );
        row(
            "  other",
            ms(p.other_s),
            ms(m.other_s),
            ratio(m.other_s, p.other_s),
        );
        row(
            "peak memory per rank (no runtime)",
            units::bytes(p.peak_memory_bytes),
            units::bytes(m.peak_memory_bytes),
            Some(self.ratio.peak_memory),
        );
        row(
            "  parameters, gradients, optimizer",
            units::bytes(p.states_bytes),
            units::bytes(m.states_bytes),
            ratio(m.states_bytes as f64, p.states_bytes as f64),
        );
        row(
            "  activations",
            units::bytes(p.activation_bytes),
            units::bytes(m.activation_bytes),
            ratio(m.activation_bytes as f64, p.activation_bytes as f64),
        );
        row(
            "  transient",
            units::bytes(p.transient_bytes),
            units::bytes(m.transient_bytes),
            ratio(m.transient_bytes as f64, p.transient_bytes as f64),
        );
    }
}
