//! Command line: parse, run the headless subcommands, report errors with an exit code.
//!
//! Exit codes: 0 success, 1 failure while writing output, 2 bad input (unreadable or invalid
//! files, bad arguments — clap uses 2 for usage errors too); `plan` 3 when nothing fits;
//! `status --follow` 4 when the run failed or ended without a word (its worker died, or its
//! lock names no one and no process holds it).

pub use crate::failure::Failure;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use osdp_core::cluster::{read_layout, Layout};
use osdp_core::model::{self, hf, AttentionImpl, Kernels, ModelSummary};
use osdp_core::text::printable;
use osdp_core::units;

pub mod measure;
pub mod request;
mod status;
pub mod train;
pub mod weights;

#[derive(Debug, Parser)]
#[command(
    name = "osdp-tui",
    version,
    about = "Plan and run Optimal Sharded Data Parallel (OSDP) training from the terminal",
    long_about = "Plan and run Optimal Sharded Data Parallel (OSDP) training from the terminal.\n\n\
        osdp-tui reads a model description (model.json: the operator graph with parameter \
        shapes, FLOPs and activation sizes) and a cluster layout (layouts/*.json), and chooses \
        per operator whether to replicate or shard it (DDP, ZeRO-1/2/3), how finely to split \
        it, and the micro-batch size that maximise throughput under a per-GPU memory budget.\n\n\
        Start from a sample: `osdp-tui inspect sample-models/gpt2.json`, or import any GPT-2, \
        OPT, LLaMA/Mistral/Qwen2 or BERT config: `osdp-tui import-hf config.json -o model.json`.",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Model description to open in the dashboard (model.json).
    model: Option<PathBuf>,
    /// Cluster layout to plan for: a file, or a shipped layout's name (`h100-sxm-8x-nvlink`)
    /// [default: the local GPUs' if NVML finds any, else h100-sxm-8x-nvlink].
    #[arg(long, value_parser = layout_arg)]
    layout: Option<PathBuf>,
    /// Memory budget per GPU: 24GiB, 8000MiB, 80GB; a bare number is GiB [default: the
    /// layout's memory].
    #[arg(long, value_parser = parse_budget, allow_hyphen_values = true)]
    budget: Option<u64>,
    /// One budget per GPU, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_budget, allow_hyphen_values = true, conflicts_with = "budget")]
    budget_per_gpu: Vec<u64>,
    /// Largest operator split to start with.
    #[arg(long, default_value_t = osdp_core::plan::DEFAULT_MAX_SPLIT, value_parser = parse_split)]
    max_split: u32,
    /// Print one text rendering of the dashboard and exit (also when stdout is not a terminal).
    #[arg(long)]
    once: bool,
    /// Fix the micro-batch per GPU instead of searching it (b cycles it in the dashboard).
    #[arg(long, value_name = "N", value_parser = parse_fixed_batch)]
    batch: Option<u64>,
    /// Samples per optimizer step over all GPUs: plan micro-batch × accumulation for it
    /// (B cycles it). `any`: no accumulation, the fastest micro-batch that fits. [default:
    /// as `plan`]
    #[arg(long, value_name = "N|any")]
    global_batch: Option<request::GlobalBatchArg>,
    /// The global batch in tokens (a multiple of the model's sequence length).
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "global_batch")]
    tokens_per_step: Option<u64>,
    /// Where training runs started with `s` keep their plan, metrics, checkpoints and log
    /// [default: runs/MODEL-NAME].
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Checkpoint period of runs started from the dashboard, in steps.
    #[arg(long, default_value_t = 50, value_name = "K")]
    checkpoint_every: u64,
    /// Declare a run failed (hung) after this many seconds without a step.
    #[arg(long, default_value_t = 120, value_name = "SECS")]
    hang_after: u64,
    /// Runs started with `s` begin from this Hugging Face checkpoint's weights (as `train
    /// --init-from`; restarts resume from the run's own checkpoints).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// Training data of runs started with `s` (as `train --data`).
    #[arg(long, value_name = "SOURCE")]
    data: Option<String>,
    /// Tokenizer of runs started with `s` (as `train --tokenizer`).
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: Option<PathBuf>,
    /// Held-out data of runs started with `s` (as `train --eval-data`).
    #[arg(long, value_name = "SOURCE")]
    eval_data: Option<String>,
    /// Steps between held-out losses of runs started with `s` (as `train --eval-every`).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    eval_every: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Summarise a model description: size, structure, FLOPs, activation memory.
    Inspect {
        /// Model description (model.json).
        model: PathBuf,
        /// Print JSON (keys: name, family, ops, blocks, layers, params, by_kind, ...).
        #[arg(long)]
        json: bool,
    },
    /// Turn a Hugging Face config.json into a model description.
    ///
    /// Supported architectures: GPT2LMHeadModel, OPTForCausalLM, LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM, BertForMaskedLM. The parameter count matches
    /// transformers' num_parameters().
    #[command(name = "import-hf")]
    ImportHf {
        /// Hugging Face config.json.
        config: PathBuf,
        /// Where to write the model description.
        #[arg(short, long, value_name = "MODEL.json")]
        output: PathBuf,
        /// Tokens per sample [default: the config's max positions, at most 8192].
        #[arg(long, value_name = "N")]
        seq_len: Option<u64>,
        /// Keep only the first N layers (study a shallower model of the same shape).
        #[arg(long, value_name = "N")]
        layers: Option<u64>,
        /// Model name [default: the config file's name without extension].
        #[arg(long)]
        name: Option<String>,
        /// Attention kernel the activation figures assume.
        #[arg(long, value_enum, default_value_t = AttentionArg::Flash)]
        attention: AttentionArg,
        /// Whose kernels run the model, which decides what norms, out-projections and gated
        /// MLPs keep for backward and what they cost: osdp-tui's trainer, or transformers'
        /// modules in eager PyTorch (what FSDP2 and your own training loop run: pick it for
        /// `plan --target fsdp2`), whose RMSNorm, rotary embedding and `gelu_new` are one
        /// PyTorch op per step, each a pass through memory, some keeping more for backward.
        #[arg(long, value_enum, default_value_t = KernelsArg::Osdp)]
        kernels: KernelsArg,
    },
    /// Find the plan of highest throughput under a per-GPU memory budget.
    ///
    /// Per operator: replicate (dp) or shard (zero1/zero2/zero3), how finely to split a linear
    /// (zero3/K:M = K slices, the first M sharded), whether each block recomputes its
    /// activations (`recompute`) and, if so, keeps the weights its recomputation fetches for the
    /// backward as FSDP does (`recompute+keep-weights`: faster where gathers show, at the price
    /// of the block's weights held through its backward); plus the micro-batch size. Exact over
    /// the cost model. Compared with DDP,
    /// ZeRO-2 and ZeRO-3 (FSDP) everywhere, each at its own best micro-batch.
    /// Exit codes: 0 planned, 2 bad input, 3 nothing fits (the message names the smallest
    /// budget that would).
    Plan(PlanArgs),
    /// Price a plan file (from `plan -o`, possibly hand-edited) on a layout.
    Evaluate {
        /// Model description the plan was made for.
        model: PathBuf,
        /// Cluster layout: a file, or a shipped layout's name (`layouts/NAME.json`).
        #[arg(long, value_parser = layout_arg)]
        layout: PathBuf,
        /// Plan file written by `plan -o`.
        #[arg(long)]
        plan: PathBuf,
        /// Print JSON (batch_size, step_time_s, throughput_samples_per_s, peak_memory_bytes, fits, ...).
        #[arg(long)]
        json: bool,
        /// Budget to check the plan against [default: the device's memory].
        #[arg(long, value_parser = parse_budget, allow_hyphen_values = true)]
        budget: Option<u64>,
        /// Price the plan's micro-batch at this global batch (samples per step over all
        /// GPUs), with the accumulation that makes it [default: the plan's].
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        global_batch: Option<u64>,
    },
    /// Write a plan out for another runtime: `--to fsdp2`, the input of
    /// `osdp_torch.apply_plan` (per module path its sharding, reshard-after-forward, mesh and
    /// offload; the recomputed blocks; precision, micro-batch, accumulation, global batch;
    /// the prediction; the model's fingerprint). Refuses a plan FSDP2 cannot run (a split op,
    /// zero1, +offload-opt), naming the op: plan with --target fsdp2.
    Export {
        /// Model description the plan was made for.
        model: PathBuf,
        /// Plan file written by `plan -o`.
        #[arg(long)]
        plan: PathBuf,
        /// Cluster layout the plan runs on: a file, or a shipped layout's name.
        #[arg(long, value_parser = layout_arg)]
        layout: PathBuf,
        /// The runtime to export for.
        #[arg(long, value_parser = ["fsdp2"])]
        to: String,
        /// Where to write the export.
        #[arg(short, long, value_name = "EXPORT.json")]
        output: PathBuf,
    },
    /// Train with a plan: libtorch executor, local ranks, checkpoints that survive a change
    /// of plan (needs the `train` build feature).
    ///
    /// Every strategy the planner emits runs as planned: dp, zero1/2/3, split linears with
    /// partial sharding, block recomputation. SIGINT/SIGTERM finish the step, checkpoint and
    /// exit 0. Example: `osdp-tui train sample-models/tiny-gpt2.json --plan plan.json
    /// --world-size 2 --steps 200 --metrics run.jsonl --checkpoint-dir ckpt`.
    Train(train::TrainArgs),
    /// Measure this machine into a layout the planner prices with (needs the `train` build
    /// feature).
    ///
    /// Times the trainer's own kernels inside real training steps at growing micro-batches,
    /// all ranks at once: a forward/backward time curve per operator kind, the optimizer's
    /// cost per tensor and per parameter, memory bandwidth, collective latency and bandwidth,
    /// and the runtime's fixed memory. About a minute on a small machine. Example:
    /// `osdp-tui calibrate -o layouts/local-cpu.json`, then `osdp-tui plan MODEL.json --layout
    /// layouts/local-cpu.json --budget 4GiB`.
    Calibrate(measure::CalibrateArgs),
    /// Run a plan briefly and compare measured step time and peak memory with the prediction
    /// (needs the `train` build feature).
    ///
    /// Warm-up steps are not timed; the step time is the median of the timed steps (the
    /// slowest rank's); memory is the trainer's own ledger, per category. Example:
    /// `osdp-tui validate sample-models/tiny-gpt2.json --layout layouts/local-cpu.json --plan
    /// plan.json --repeat 3`.
    Validate(measure::ValidateArgs),
    /// The mean next-token loss of a model's weights on data taken in order (needs the
    /// `train` build feature).
    ///
    /// The weights are a Hugging Face checkpoint (`save_pretrained`'s directory) or one of
    /// `train`'s checkpoints; sample i is tokens [i·S, i·S + S] of the data, no shuffling.
    /// Example: `osdp-tui eval model.json --init-from ./my-llama --data valid.txt --samples
    /// 64 --json`.
    Eval(weights::EvalArgs),
    /// Write a training checkpoint as a Hugging Face directory that transformers loads
    /// (needs the `train` build feature).
    ///
    /// config.json (the config the model description was imported from) and
    /// model.safetensors in fp32, sharded with an index above --max-shard-size. Example:
    /// `osdp-tui export-hf model.json ckpt -o ./my-llama-tuned`, then
    /// `AutoModelForCausalLM.from_pretrained("./my-llama-tuned")`.
    ExportHf(weights::ExportHfArgs),
    /// Follow a training run from another terminal: step, loss, speed, memory, checkpoints,
    /// and whether its worker is alive (the run directory's lock names it).
    ///
    /// RUN_DIR is a run directory (the dashboard's --run-dir, or any directory whose
    /// metrics.jsonl a `train --metrics` wrote). A metrics.jsonl truncated, rewritten or
    /// replaced while followed is read again from its start. Messages are cut to their first
    /// 300 characters (--json keeps them whole).
    ///
    /// Exit codes: 0 the status was shown (with --follow: the run stopped), 2 no run there or
    /// its metrics.jsonl cannot be read (not a file), 4 with --follow: the run failed or ended
    /// without a word (its worker died, or its lock file names no one and no process holds
    /// it).
    Status {
        run_dir: PathBuf,
        /// Print JSON (model, world_size, global_batch, steps, last_checkpoint, ended, state,
        /// ...); with --follow, one object per line: the status, then each event.
        #[arg(long)]
        json: bool,
        /// Print each new step and event until the run ends.
        #[arg(long)]
        follow: bool,
    },
    /// Print a shell completion script: `osdp-tui completions bash > ~/.local/share/bash-completion/completions/osdp-tui`
    /// (zsh: into a directory on `$fpath` as `_osdp-tui`; fish: `~/.config/fish/completions/osdp-tui.fish`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Show a cluster layout: devices, memory, rates, links, with the source of each figure.
    Layout {
        /// Layout file, a shipped layout's name (`layouts/NAME.json`), or `local`: the GPUs
        /// NVML finds here, as the dashboard plans for them (datasheet rates, or guessed ones
        /// for a GPU the known-GPU table does not name); `local --json > mine.json` writes a
        /// layout to edit (calibrate's --base for such a GPU).
        #[arg(value_parser = layout_source_arg)]
        layout: LayoutSource,
        /// Print the checked layout as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// Model description (model.json).
    model: PathBuf,
    /// Cluster layout: a file, or a shipped layout's name (`layouts/NAME.json`).
    #[arg(long, value_parser = layout_arg)]
    layout: PathBuf,
    /// Memory budget per GPU: 24GiB, 8000MiB, 80GB; a bare number is GiB [default: the
    /// device's memory].
    #[arg(long, value_parser = parse_budget, allow_hyphen_values = true)]
    budget: Option<u64>,
    /// One budget per GPU, comma-separated; the plan must fit the tightest.
    #[arg(long, value_delimiter = ',', value_parser = parse_budget, allow_hyphen_values = true, conflicts_with = "budget")]
    budget_per_gpu: Vec<u64>,
    /// Micro-batch size per GPU, or `auto` to search it.
    #[arg(long, default_value = "auto", value_parser = parse_batch)]
    batch: BatchArg,
    /// Samples per optimizer step over all GPUs, as the training recipe fixes it: the planner
    /// picks the micro-batch and gradient accumulation (micro-batch × accumulation × GPUs =
    /// N) that run it fastest. `any`: no accumulation, the fastest micro-batch that fits; a
    /// fixed N with accumulation can be a little faster. [default: GPU
    /// layouts, the tokens per step published runs use for the model's
    /// size (GPT-3, Llama 2); the cpu layout, a step of about 2 s, at least one sample per
    /// rank; with --batch alone, any]
    #[arg(long, value_name = "N|any")]
    global_batch: Option<request::GlobalBatchArg>,
    /// The global batch in tokens (a multiple of the model's sequence length).
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "global_batch")]
    tokens_per_step: Option<u64>,
    /// Largest operator split (1, 2, 4, 8, ...; 1 disables splitting).
    #[arg(long, default_value_t = osdp_core::plan::DEFAULT_MAX_SPLIT, value_parser = parse_split)]
    max_split: u32,
    /// Never recompute activations (blocks fixed on with --recompute-block still do).
    #[arg(long)]
    no_recompute: bool,
    /// Fix a block's recomputation: BLOCK=on|off or FIRST-LAST=on|off (repeatable); the
    /// planner stays exact over the plans that honour it (the dashboard's R). A fix wins over
    /// --no-recompute: blocks fixed on recompute, the others do not.
    #[arg(long, value_name = "BLOCK=on|off")]
    recompute_block: Vec<String>,
    /// Fix an op's strategy: OP=dp|zero1|zero2|zero3|zero3/K:M|hsdp, optionally with
    /// +offload-opt or +offload-param (repeatable).
    #[arg(long, value_name = "OP=STRATEGY")]
    pin: Vec<String>,
    /// Host memory per GPU that offloaded optimizer state and parameters may take; 0 never
    /// offloads (no plan fits an op pinned +offload-…) [default: 80 % of the layout's host
    /// memory over its GPUs; layouts without `host` figures never offload].
    #[arg(long, value_parser = parse_budget, allow_hyphen_values = true, value_name = "SIZE")]
    host_budget: Option<u64>,
    /// Memory resolution of the search: plans within this much of the budget may be missed
    /// (per merged group); 0 is exact but slow on large models [default: 1 MiB; where offload
    /// is offered, 1/512 of the budget or of the model's training state, whichever is less, as
    /// offloading every op at about one rate makes the exact frontiers huge].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    resolution: Option<u64>,
    /// Share of the budget plans leave free, in percent (0 to 50): plans peak within the
    /// budget less this, for what the memory model does not see (allocator fragmentation,
    /// the stack's own buffers). 0 packs plans to the budget.
    #[arg(long, value_parser = osdp_core::plan::request::parse_headroom, default_value = "5",
          value_name = "PERCENT", allow_hyphen_values = true)]
    headroom: f64,
    /// Also list every choice this op could have (op ids as `inspect` lists them), each priced
    /// as the whole plan with only that op changed, and what stops the faster ones
    /// (repeatable).
    #[arg(long, value_name = "OP")]
    explain: Vec<String>,
    /// What will run the plan: `osdp` (osdp-tui's trainer: every choice) or `fsdp2` (PyTorch
    /// FSDP2 through `osdp_torch.apply_plan`: dp, zero2, zero3, hsdp per module, no operator
    /// splitting, offload only as +offload-param; its peak counts what FSDP2's all-gather and
    /// reduce-scatter streams keep cached; `export --to fsdp2` writes it out).
    #[arg(long, default_value = "osdp", value_parser = parse_target, value_name = "osdp|fsdp2")]
    target: osdp_core::plan::Target,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Write the plan file that `evaluate` and the trainer read.
    #[arg(short, long, value_name = "PLAN.json")]
    output: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy)]
enum BatchArg {
    Auto,
    Fixed(u64),
}

fn parse_batch(s: &str) -> Result<BatchArg, String> {
    if s == "auto" {
        return Ok(BatchArg::Auto);
    }
    parse_fixed_batch(s)
        .map(BatchArg::Fixed)
        .map_err(|e| format!("{e}, or `auto`"))
}

/// A micro-batch from 1 to [`osdp_core::plan::MAX_BATCH`].
fn parse_fixed_batch(s: &str) -> Result<u64, String> {
    use osdp_core::plan::MAX_BATCH;
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=MAX_BATCH).contains(&n) => Ok(n),
        Ok(n) if n > MAX_BATCH => Err(format!("{n} is too large: at most {MAX_BATCH}")),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// A per-GPU budget: a size (see [`parse_size`]) of at most [`osdp_core::plan::MAX_BUDGET_BYTES`];
/// a bare number is GiB (`20` is 20 GiB: no GPU budget is counted in bytes).
pub(crate) fn parse_budget(s: &str) -> Result<u64, String> {
    use osdp_core::plan::MAX_BUDGET_BYTES;
    let t = s.trim();
    let bytes = match t.parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib >= 0.0 && !t.starts_with('-') => {
            parse_size(&format!("{t} GiB"))?
        }
        _ => parse_size(s)?,
    };
    if bytes > MAX_BUDGET_BYTES {
        return Err(format!(
            "{s} is more memory than a GPU has: at most {} per GPU",
            units::bytes(MAX_BUDGET_BYTES)
        ));
    }
    Ok(bytes)
}

fn parse_target(s: &str) -> Result<osdp_core::plan::Target, String> {
    osdp_core::plan::Target::parse(s).ok_or_else(|| {
        let names: Vec<&str> = osdp_core::plan::Target::ALL
            .iter()
            .map(|t| t.as_str())
            .collect();
        format!("expected {}, got {s:?}", names.join(" or "))
    })
}

fn parse_split(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(k) if k.is_power_of_two() && k <= 64 => Ok(k),
        _ => Err(format!("expected a power of two from 1 to 64, got {s:?}")),
    }
}

/// A `--layout` value: a file, or the name of a shipped layout (`h100-sxm-8x-nvlink` for
/// `layouts/h100-sxm-8x-nvlink.json`, looked up here and then beside this build's sources).
/// What `osdp-tui layout` shows: a layout file, or the GPUs NVML finds here.
#[derive(Debug, Clone)]
pub enum LayoutSource {
    File(PathBuf),
    Local,
}

fn layout_source_arg(s: &str) -> Result<LayoutSource, String> {
    if s == "local" && !Path::new(s).exists() {
        return Ok(LayoutSource::Local);
    }
    layout_arg(s).map(LayoutSource::File)
}

/// A one-node layout of the GPUs NVML reported (the first one's name, memory and compute
/// capability: [`osdp_core::cluster::known::local_layout`]), checked: NVML may leave a figure
/// out (a GPU's memory), and such a layout would not read back.
pub fn local_gpus_layout(gpus: &[crate::monitor::GpuSample]) -> Result<Layout, String> {
    let g = gpus.first().ok_or("NVML found no GPU")?;
    let l = osdp_core::cluster::known::local_layout(
        &g.name,
        gpus.len() as u32,
        g.total_bytes.unwrap_or(0),
        g.compute_capability,
    );
    osdp_core::cluster::validate_layout(&l).map_err(|p| p.to_string())?;
    Ok(l)
}

pub fn layout_arg(s: &str) -> Result<PathBuf, String> {
    let given = PathBuf::from(s);
    let bare = !s.contains('/') && !s.ends_with(".json");
    if given.exists() || !bare {
        return Ok(given);
    }
    let file = format!("{s}.json");
    let here = PathBuf::from("layouts").join(&file);
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("layouts")
        .join(&file);
    [here, shipped]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "no layout file {:?} and no shipped layout of that name (they are in layouts/: \
                 h100-sxm-8x-nvlink, a100-80gb-8x-nvlink, cpu, …)",
                printable(s)
            )
        })
}

/// `24GiB`, `8000MiB`, `80GB`, `1.5 TiB`; a plain number is bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("a memory size cannot be negative, got {s:?}"));
    }
    if !t.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return Err(format!(
            "expected a size such as 24GiB, 8000MiB or 80GB, got {s:?}"
        ));
    }
    t.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|_| format!("expected a size such as 24GiB, 8000MiB or 80GB, got {s:?}"))
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AttentionArg {
    /// Fused kernel (PyTorch SDPA / FlashAttention): keeps no seq² probabilities.
    Flash,
    /// Materialised softmax, as in Korthikanti et al.'s activation formula.
    Eager,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum KernelsArg {
    /// osdp-tui's own trainer (norm statistics recomputed, gated MLP fused).
    Osdp,
    /// PyTorch's eager modules, as transformers writes them (FSDP2, your own loop).
    Pytorch,
}

/// The commands that run the libtorch trainer, supplied by the `osdp-tui-trainer` binary.
///
/// The library never names the trainer crate, so `osdp-tui` itself (the planner, the
/// dashboard, `status`) loads no libtorch: ~460 MiB resident and ~2.7 GB of mapped CUDA
/// libraries saved on every command. `train`, `calibrate` and `validate` hand over to
/// `osdp-tui-trainer` beside it (same arguments, same exit codes), which calls
/// [`main_with`] with these.
pub struct Trainer {
    pub train: fn(train::TrainArgs) -> Result<(), Failure>,
    pub calibrate: fn(measure::CalibrateArgs) -> Result<(), Failure>,
    pub validate: fn(measure::ValidateArgs) -> Result<(), Failure>,
    pub eval: fn(weights::EvalArgs) -> Result<(), Failure>,
    pub export_hf: fn(weights::ExportHfArgs) -> Result<(), Failure>,
}

/// The trainer binary's file name; it sits beside `osdp-tui`.
pub const TRAINER_BIN: &str = "osdp-tui-trainer";

/// `osdp-tui`: every command; the trainer's by handing over to [`TRAINER_BIN`].
pub fn main() -> ExitCode {
    main_with(None)
}

/// The command line with the trainer's commands run here (`Some`) or handed over (`None`).
pub fn main_with(trainer: Option<&Trainer>) -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A value our own parsers refused: one line, as every other bad input (clap adds a
        // blank line and a --help hint).
        Err(e) if e.kind() == clap::error::ErrorKind::ValueValidation => {
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: invalid value"));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    match dispatch(cli, trainer) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn dispatch(cli: Cli, trainer: Option<&Trainer>) -> Result<(), Failure> {
    // Commands that print and end exit quietly when their reader goes (`plan … | head`), as
    // other Unix tools do; the trainer and the dashboard keep the signal ignored (a peer's
    // socket or a worker's pipe that closes is an error they report, not a reason to die).
    if matches!(
        cli.command,
        Some(
            Command::Inspect { .. }
                | Command::Plan(_)
                | Command::Evaluate { .. }
                | Command::Export { .. }
                | Command::Layout { .. }
                | Command::Status { .. }
                | Command::Completions { .. }
        )
    ) {
        // SAFETY: resetting a signal's disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match (cli.command, cli.model.clone()) {
        (Some(Command::Completions { shell }), _) => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "osdp-tui",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        (Some(Command::Inspect { model, json }), _) => inspect(&model, json),
        (
            Some(Command::ImportHf {
                config,
                output,
                seq_len,
                layers,
                name,
                attention,
                kernels,
            }),
            _,
        ) => {
            let opts = hf::ImportOptions {
                seq_len,
                name,
                layers,
                attention: Some(match attention {
                    AttentionArg::Flash => AttentionImpl::Flash,
                    AttentionArg::Eager => AttentionImpl::Eager,
                }),
                kernels: match kernels {
                    KernelsArg::Osdp => Kernels::Osdp,
                    KernelsArg::Pytorch => Kernels::Pytorch,
                },
            };
            let spec = hf::import_file(&config, &opts).map_err(Failure::input)?;
            model::write_model(&output, &spec).map_err(|e| Failure::output(&output, e))?;
            println!(
                "wrote {}: {} ({} parameters, {} ops), sequence length {}{}",
                printable(&output.display().to_string()),
                printable(&spec.name),
                units::thousands(spec.param_count()),
                spec.ops.len(),
                spec.config.seq_len,
                if seq_len.is_some() {
                    ""
                } else {
                    " (the config's positions, at most 8,192; --seq-len sets it)"
                }
            );
            Ok(())
        }
        (Some(Command::Layout { layout, json }), _) => show_layout(&layout, json),
        (Some(Command::Train(args)), _) => match trainer {
            _ if described_from_torch(&args.model) => Err(Failure::input(format!(
                "{}: a model described from PyTorch (family torch) cannot be trained by \
                 osdp-tui's own trainer; run its plan in your training loop: `osdp-tui export \
                 MODEL --plan PLAN --layout L --to fsdp2 -o EXPORT` and osdp_torch.apply_plan",
                printable(&args.model.display().to_string())
            ))),
            Some(t) => (t.train)(args),
            None if cfg!(feature = "train") => Err(hand_over()),
            None => train::without_trainer(args),
        },
        (Some(Command::Calibrate(args)), _) => match trainer {
            Some(t) => (t.calibrate)(args),
            None if cfg!(feature = "train") => Err(hand_over()),
            None => measure::calibrate_without_trainer(args),
        },
        (Some(Command::Validate(args)), _) => match trainer {
            Some(t) => (t.validate)(args),
            None if cfg!(feature = "train") => Err(hand_over()),
            None => Err(measure::needs_trainer("validate")),
        },
        (Some(Command::Eval(args)), _) => match trainer {
            Some(t) => (t.eval)(args),
            None if cfg!(feature = "train") => Err(hand_over()),
            None => Err(measure::needs_trainer("eval")),
        },
        (Some(Command::ExportHf(args)), _) => match trainer {
            Some(t) => (t.export_hf)(args),
            None if cfg!(feature = "train") => Err(hand_over()),
            None => Err(measure::needs_trainer("export-hf")),
        },
        (
            Some(Command::Status {
                run_dir,
                json,
                follow,
            }),
            _,
        ) => status::status(&run_dir, json, follow),
        (Some(Command::Plan(args)), _) => crate::report::plan(args.into_command()?),
        (
            Some(Command::Evaluate {
                model,
                layout,
                plan,
                json,
                budget,
                global_batch,
            }),
            _,
        ) => crate::report::evaluate(&model, &layout, &plan, budget, global_batch, json),
        (
            Some(Command::Export {
                model,
                plan,
                layout,
                to: _,
                output,
            }),
            _,
        ) => crate::report::export_fsdp2(&model, &layout, &plan, &output),
        (None, Some(model)) => dashboard(DashboardArgs {
            model,
            layout: cli.layout,
            budget: cli.budget,
            budget_per_gpu: cli.budget_per_gpu,
            max_split: cli.max_split,
            once: cli.once,
            batch: cli.batch,
            global_batch: cli.global_batch,
            tokens_per_step: cli.tokens_per_step,
            run_dir: cli.run_dir,
            checkpoint_every: cli.checkpoint_every,
            hang_after: cli.hang_after,
            data: crate::supervisor::RunData {
                init_from: cli.init_from,
                data: cli.data,
                tokenizer: cli.tokenizer,
                eval_data: cli.eval_data,
                eval_every: cli.eval_every,
            },
        }),
        (None, None) => Err(Failure {
            code: 2,
            message: "no model given; try `osdp-tui sample-models/gpt2.json` or `osdp-tui --help`"
                .into(),
        }),
    }
}

/// This process becomes [`TRAINER_BIN`] beside it, with the same arguments, environment and
/// open descriptors (a supervisor's lifeline stays open). Returns only why it could not.
fn hand_over() -> Failure {
    use std::os::unix::process::CommandExt;
    let exe = match trainer_exe() {
        Ok(exe) => exe,
        Err(f) => return f,
    };
    let err = std::process::Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .exec();
    Failure::input(format!("cannot start the trainer {}: {err}", exe.display()))
}

/// Whether `path` reads as a model described from a live `nn.Module` (family `torch`); a
/// file that does not read is left to the command's own reading to report.
fn described_from_torch(path: &Path) -> bool {
    model::read_model(path).is_ok_and(|m| m.family == model::Family::Torch)
}

/// The trainer binary beside this one, or why there is none.
pub fn trainer_exe() -> Result<PathBuf, Failure> {
    let me = std::env::current_exe().map_err(|e| {
        Failure::input(format!(
            "cannot find this program's own path, beside which the trainer lies: {e}"
        ))
    })?;
    let exe = me.with_file_name(TRAINER_BIN);
    if exe.is_file() {
        Ok(exe)
    } else {
        Err(Failure::input(format!(
            "the trainer is missing: {} should lie beside osdp-tui; build both with \
             `. scripts/libtorch-env.sh && cargo build --release --features train` and keep \
             them together",
            exe.display()
        )))
    }
}

fn inspect(path: &Path, json: bool) -> Result<(), Failure> {
    let spec = model::read_model(path).map_err(Failure::input)?;
    let s = ModelSummary::of(&spec);
    if json {
        crate::report::print_json(&s);
        return Ok(());
    }
    let c = &spec.config;
    println!(
        "{} ({} family): {} parameters",
        printable(&s.name),
        s.family,
        units::count(s.params)
    );
    let torch = spec.family == model::Family::Torch;
    if torch {
        // A described module has no transformer shape: its config holds neutral values.
        println!("  shape       described from PyTorch, {} blocks", s.blocks);
        println!("  sequence    {} items per sample", c.seq_len);
    } else {
        println!(
            "  shape       {} layers, hidden {}, {} heads ({} kv, {} dims each), ffn {}, vocab {}",
            c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn_hidden, c.vocab_size
        );
        println!("  sequence    {} tokens per sample", c.seq_len);
    }
    println!("  graph       {} ops in {} blocks", s.ops, s.blocks);
    println!(
        "  parameters  {}  (fp32 {}, bf16 {})",
        units::thousands(s.params),
        units::bytes(s.params_bytes_fp32),
        units::bytes(s.params_bytes_bf16)
    );
    println!(
        "  forward     {} per token, {} per sample",
        units::flops(s.fwd_flops_per_token),
        units::flops(s.fwd_flops_per_sample as f64)
    );
    println!(
        "  activations {} kept for backward per sample{}",
        units::bytes(s.saved_activation_bytes_per_sample),
        if torch {
            " (as measured)".to_string()
        } else {
            format!(
                " ({} attention, {} kernels{})",
                format!("{:?}", c.attention).to_lowercase(),
                match c.kernels {
                    Kernels::Osdp => "osdp-tui's",
                    Kernels::Pytorch => "PyTorch's eager",
                },
                if c.composed_gelu.is_some() {
                    ", GELU as separate PyTorch ops"
                } else {
                    ""
                }
            )
        }
    );
    println!();
    println!("  {:<22}{:>6}{:>18}", "kind", "ops", "parameters");
    for k in &s.by_kind {
        println!(
            "  {:<22}{:>6}{:>18}",
            k.kind,
            k.ops,
            units::thousands(k.params)
        );
    }
    Ok(())
}

fn show_layout(source: &LayoutSource, json: bool) -> Result<(), Failure> {
    let l: Layout = match source {
        LayoutSource::File(path) => read_layout(path).map_err(Failure::input)?,
        LayoutSource::Local => {
            use crate::monitor::GpuSource;
            crate::monitor::NvmlSource::open()
                .and_then(|mut n| n.sample())
                .and_then(|gpus| local_gpus_layout(&gpus))
                .map_err(|e| Failure::input(format!("layout local: {e}")))?
        }
    };
    if json {
        crate::report::print_json(&l);
        return Ok(());
    }
    let d = &l.device;
    println!("{}: {}", printable(&l.name), printable(&l.description));
    println!(
        "  {} × {} {} = {}",
        osdp_core::units::counted(u64::from(l.nodes), "node"),
        l.gpus_per_node,
        printable(&d.model),
        osdp_core::units::counted(u64::from(l.world_size()), "rank")
    );
    layout_device_rows(d);
    layout_efficiency_rows(&l);
    layout_overhead_rows(&l);
    layout_link_rows(&l);
    Ok(())
}

/// One figure of `osdp-tui layout`: what it is, its value, where it came from.
fn layout_row(what: &str, value: String, source: &str) {
    println!("  {what:<30}{value:<15} {}", printable(source));
}

/// The device's memory, memory bandwidth and dense rates.
fn layout_device_rows(d: &osdp_core::cluster::DeviceSpec) {
    layout_row(
        "memory",
        format!("{} GiB", d.memory_gib.value),
        &d.memory_gib.source,
    );
    layout_row(
        "memory bandwidth",
        format!("{} GB/s", d.memory_bandwidth_gb_per_s.value),
        &d.memory_bandwidth_gb_per_s.source,
    );
    let r = &d.dense_tflops;
    for (name, rate) in [
        ("bf16", &r.bf16),
        ("fp16", &r.fp16),
        ("tf32", &r.tf32),
        ("fp32", &r.fp32),
    ] {
        if let Some(f) = rate {
            layout_row(
                &format!("dense {name}"),
                format!("{} TFLOP/s", f.value),
                &f.source,
            );
        }
    }
}

/// The efficiencies the planner uses: the layout's own figure, else its GPU generation's,
/// else generic.
fn layout_efficiency_rows(l: &Layout) {
    let d = &l.device;
    let e = osdp_core::cost::Efficiencies::of(l);
    let generation = match d.kind {
        osdp_core::cluster::DeviceKind::Gpu => osdp_core::cluster::known::row_of(d),
        osdp_core::cluster::DeviceKind::Cpu => None,
    }
    .map(|g| g.efficiency);
    let own = &d.efficiency;
    let percent = |v: f64| format!("{:.0} %", v * 100.0);
    for (name, value, own, fallback) in [
        (
            "matmul",
            percent(e.matmul),
            &own.matmul,
            generation.map(|g| &g.matmul),
        ),
        (
            "matmul half width",
            format!("{} features", e.matmul_half_width),
            &own.matmul_half_width,
            generation.map(|g| &g.matmul_half_width),
        ),
        (
            "attention forward",
            percent(e.attention_forward),
            &own.attention_forward,
            generation.map(|g| &g.attention_forward),
        ),
        (
            "attention backward",
            percent(e.attention_backward),
            &own.attention_backward,
            generation.map(|g| &g.attention_backward),
        ),
        (
            "memory",
            percent(e.memory),
            &own.memory,
            generation.map(|g| &g.memory),
        ),
        (
            "unaligned matmul",
            if e.unaligned_matmul > 0.0 {
                percent(e.unaligned_matmul)
            } else {
                "as aligned".into()
            },
            &own.unaligned_matmul,
            generation.map(|g| &g.unaligned_matmul),
        ),
    ] {
        let source = match (own, fallback, generation) {
            (Some(f), _, _) => f.source.clone(),
            (None, Some(f), Some(g)) => format!("{} default: {}", g.name, f.source),
            _ => "generic default, not fitted to this device (calibrate measures it)".into(),
        };
        layout_row(&format!("efficiency {name}"), value, &source);
    }
    // Measured ones only; otherwise they are `memory`'s.
    for (name, value, own) in [("norm", e.norm(), &own.norm), ("loss", e.loss(), &own.loss)] {
        if let Some(f) = own {
            layout_row(&format!("efficiency {name}"), percent(value), &f.source);
        }
    }
}

/// The runtime's memory, the parameter passes priced around the kernels, and the dtype
/// gradients are reduced in.
fn layout_overhead_rows(l: &Layout) {
    layout_row(
        "runtime overhead",
        format!("{} GiB", l.runtime_overhead_gib.value),
        &l.runtime_overhead_gib.source,
    );
    let passes = osdp_core::cost::param_pass_bytes(l);
    layout_row(
        "parameter passes",
        format!("{passes} B per parameter per micro-batch"),
        if passes > 0.0 {
            "casts, gradient scaling and buffer copies around the kernels, at the memory rate: fitted \
             2026-11-25 to published FSDP runs (docs/published-runs.md)"
        } else {
            "none priced: one GPU gathers and reduces nothing; a CPU's are in its calibrated step overhead"
        },
    );
    let reduce = match l.gradient_reduce_dtype {
        Some(d) => format!("{d:?}").to_lowercase(),
        None => "compute dtype".into(),
    };
    layout_row(
        "gradient reduce dtype",
        reduce,
        "what reduce-scatters and all-reduces move (osdp-tui's trainer: the compute dtype)",
    );
}

/// Each link's bandwidth, latency and NICs.
fn layout_link_rows(l: &Layout) {
    for (name, link) in [
        ("intra-node", Some(&l.intra_node)),
        ("inter-node", l.inter_node.as_ref()),
    ] {
        if let Some(link) = link {
            layout_row(
                &format!("{name} ({:?})", link.kind).to_lowercase(),
                format!("{} GB/s", link.bus_bandwidth_gb_per_s.value),
                &link.bus_bandwidth_gb_per_s.source,
            );
            layout_row(
                &format!("{name} latency"),
                format!("{} µs", link.latency_us.value),
                &link.latency_us.source,
            );
            if let Some(n) = &link.nics_per_node {
                layout_row(
                    &format!("{name} NICs per node"),
                    format!("{}", n.value),
                    &n.source,
                );
            }
        }
    }
}

impl PlanArgs {
    fn into_command(self) -> Result<crate::report::PlanCommand, Failure> {
        Ok(crate::report::PlanCommand {
            model: self.model,
            layout: self.layout,
            budget: self.budget,
            budget_per_gpu: self.budget_per_gpu,
            batch: match self.batch {
                BatchArg::Auto => None,
                BatchArg::Fixed(b) => Some(b),
            },
            global_batch: self.global_batch,
            tokens_per_step: self.tokens_per_step,
            max_split: self.max_split,
            recompute: !self.no_recompute,
            pins: self.pin,
            recompute_blocks: self.recompute_block,
            resolution_bytes: self.resolution,
            headroom: self.headroom,
            host_budget: self.host_budget,
            explain: self.explain,
            target: self.target,
            json: self.json,
            output: self.output,
        })
    }
}

struct DashboardArgs {
    model: PathBuf,
    layout: Option<PathBuf>,
    budget: Option<u64>,
    budget_per_gpu: Vec<u64>,
    max_split: u32,
    once: bool,
    batch: Option<u64>,
    global_batch: Option<request::GlobalBatchArg>,
    tokens_per_step: Option<u64>,
    run_dir: Option<PathBuf>,
    checkpoint_every: u64,
    hang_after: u64,
    data: crate::supervisor::RunData,
}

/// The layout planned for when none is given.
const DEFAULT_LAYOUT: &str = include_str!("../layouts/h100-sxm-8x-nvlink.json");

fn dashboard(args: DashboardArgs) -> Result<(), Failure> {
    use crate::monitor::{spawn_poller, GpuEvent, GpuSource, NvmlSource};
    use crate::tui::{self, app::App};

    let spec = model::read_model(&args.model).map_err(Failure::input)?;
    let mut nvml = NvmlSource::open();
    // One reading up front: it can supply the layout and the default budgets.
    let first: Result<Vec<crate::monitor::GpuSample>, String> = match &mut nvml {
        Ok(n) => n.sample(),
        Err(e) => Err(e.clone()),
    };
    let local = first.as_ref().ok().filter(|s| !s.is_empty());
    // The local GPUs' layout where no --layout is given and NVML found some.
    let local_layout = local
        .filter(|_| args.layout.is_none())
        .map(|gpus| (gpus, local_gpus_layout(gpus)));
    let (layout, mut notice) = match (&args.layout, &local_layout) {
        (Some(p), _) => (read_layout(p).map_err(Failure::input)?, None),
        (None, Some((gpus, Ok(l)))) => {
            let rates = if osdp_core::cluster::known::rates_guessed(&l.device) {
                "not in the known-GPU table: guessed rates"
            } else {
                "datasheet rates"
            };
            let notice = format!(
                "planning for the {} local {} found through NVML ({rates}; --layout to choose)",
                gpus.len(),
                gpus[0].name
            );
            (l.clone(), Some(notice))
        }
        (None, other) => {
            let l: Layout =
                serde_json::from_str(DEFAULT_LAYOUT).expect("the built-in layout parses");
            let why = match (other, &first) {
                (Some((_, Err(e))), _) => format!("the local GPUs' layout: {e}"),
                (_, Err(e)) => e.clone(),
                _ => "NVML found no GPU".to_string(),
            };
            let notice = format!(
                "{why}; planning for layout {} (choose one with --layout)",
                l.name
            );
            (l, Some(notice))
        }
    };
    // Default budget: each local GPU's free memory when planning for the local GPUs.
    let free: Option<Vec<u64>> = match &local_layout {
        Some((gpus, Ok(_))) => Some(
            gpus.iter()
                .map(|g| {
                    g.total_bytes
                        .unwrap_or(0)
                        .saturating_sub(g.used_bytes.unwrap_or(0))
                })
                .collect(),
        ),
        _ => None,
    };
    let budgets = request::per_gpu_budgets(&layout, args.budget, &args.budget_per_gpu, free)
        .map_err(Failure::input)?;
    let run_dir = args
        .run_dir
        .clone()
        .unwrap_or_else(|| crate::run::RunDir::default_for(&spec.name).0);
    let cpu = layout.device.kind == osdp_core::cluster::DeviceKind::Cpu;
    let machine = osdp_core::cost::Machine::new(&layout, &spec);
    let chosen = request::choose_global_batch(
        &spec,
        &machine,
        cpu,
        args.global_batch,
        args.tokens_per_step,
        args.batch,
    )
    .map_err(Failure::input)?;
    let global_batch = chosen.samples();
    if let Some(why) = chosen.explain_default(&spec, &machine, cpu) {
        let note = format!(
            "{why}; B changes it, --global-batch sets it (`any`: {})",
            request::ANY_MEANS
        );
        notice = Some(match notice {
            Some(n) => format!("{n} · {note}"),
            None => note,
        });
    }
    let mut app = App::new(spec, layout, budgets, args.max_split);
    app.notice = notice;
    app.layout_arg = args.layout.as_ref().map(|p| p.display().to_string());
    app.request.batch = args.batch;
    app.request.global_batch = global_batch;
    if let Ok(exe) = std::env::current_exe() {
        let launch = crate::supervisor::LaunchSpec {
            exe,
            model: args.model.clone(),
            checkpoint_every: args.checkpoint_every,
            hang_after: std::time::Duration::from_secs(args.hang_after.max(1)),
            data: args.data.clone(),
        };
        app = app.with_run_control(crate::tui::app::RunControl::new(launch, run_dir));
    }
    if !tui::interactive(args.once) {
        // One synchronous plan, one frame as text.
        let mut app = app;
        app.replan();
        app.apply_gpu(match first {
            Ok(s) => GpuEvent::Samples(s),
            Err(e) => GpuEvent::Unavailable(e),
        });
        let (w, h) = ratatui::crossterm::terminal::size().unwrap_or((120, 40));
        print!("{}", tui::render_text(&app, w.max(120), h.max(40)));
        return Ok(());
    }
    let app = match nvml {
        Ok(n) => app.with_gpu_events(spawn_poller(
            Box::new(n),
            std::time::Duration::from_millis(500),
        )),
        Err(e) => {
            let mut app = app;
            app.apply_gpu(GpuEvent::Unavailable(e));
            app
        }
    };
    let farewell = tui::event_loop(app.with_planner_thread()).map_err(|e| Failure {
        code: 1,
        message: format!("terminal: {e}"),
    })?;
    if let Some(words) = farewell {
        print!("{words}");
    }
    Ok(())
}
