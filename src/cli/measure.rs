//! `osdp-tui calibrate` (measure this machine into a layout) and `osdp-tui validate` (predicted
//! against measured step time and memory for a plan). Both need the trainer's kernels.

use std::path::PathBuf;

use clap::Args;

use super::train::DeviceArg;
use super::Failure;

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Where to compute: `cpu` times the CPU trainer's kernels into curves; `cuda` times GPU 0
    /// with the trainer's bf16 kernels (linears narrow and wide, causal attention per sequence
    /// length, HBM streaming, the pinned host link) into a GPU layout's efficiencies: `--base`,
    /// else the shipped layout of that GPU (h100-1x, h200-1x, …), else one built from the
    /// known-GPU table's datasheet figures for it (a GPU the table does not name needs --base:
    /// `osdp-tui layout local --json` prints one to edit).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Layout file to write (e.g. layouts/local-cpu.json); its name is the file's stem.
    #[arg(short, long, value_name = "LAYOUT.json")]
    pub output: PathBuf,
    /// Time this model's own operators (repeatable) [default: two small built-in GPT-2 and
    /// LLaMA shapes that cover every operator kind].
    #[arg(long, value_name = "MODEL.json")]
    pub model: Vec<PathBuf>,
    /// Ranks of the layout, all timed at once as they train (they share cores, caches and
    /// memory bandwidth) [default: one per core, at most 8].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub ranks: Option<u32>,
    /// Largest micro-batch timed per model (powers of two from 1).
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_batch: u64,
    /// Fewest points: on the CPU micro-batches up to 4, one timed step each (a smoke test,
    /// not for use); on a GPU fewer shapes, three repetitions each (under a minute).
    #[arg(long)]
    pub quick: bool,
    /// Start from this layout (keeps its memory per rank and description) [default: the
    /// built-in `cpu` layout; with `--device cuda` the shipped layout of the GPU found].
    #[arg(long, value_name = "LAYOUT.json", value_parser = crate::cli::layout_arg)]
    pub base: Option<PathBuf>,
    /// Print what was measured as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Model description the plan was made for (GPT-2, OPT or LLaMA family).
    pub model: PathBuf,
    /// Layout the prediction is for; its rank count is the run's world size. Use a calibrated
    /// one (`osdp-tui calibrate`) for predictions of this machine.
    #[arg(long, value_parser = crate::cli::layout_arg)]
    pub layout: PathBuf,
    /// Plan file (from `plan -o`, or by hand).
    #[arg(long)]
    pub plan: PathBuf,
    /// Untimed steps first (allocator and caches warm up).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub warmup: usize,
    /// Timed steps; the step time is their median.
    #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=10000))]
    pub steps: u64,
    /// Run with these Hugging Face weights (as `train --init-from`; they change no timing, but
    /// prove the checkpoint loads under the plan) [default: seeded weights].
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Run the whole measurement this many times and report the spread.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100))]
    pub repeat: u64,
    /// Print JSON (predicted, measured, ratio).
    #[arg(long)]
    pub json: bool,
}

pub fn no_cuda() -> Failure {
    Failure::input(
        "calibrate --device cuda: no CUDA device is usable here (no NVIDIA driver or GPU was \
         found, or this build lacks the NCCL backend); calibrate the CPU with --device cpu, or \
         run on a machine with a GPU",
    )
}

/// A trainer command in a build without the trainer: how to get it.
pub(crate) fn needs_trainer(what: &str) -> Failure {
    Failure::input(format!(
        "{what} runs the trainer's kernels, and this osdp-tui was built without them; build it \
         with `. scripts/libtorch-env.sh && cargo build --release --features train`"
    ))
}

/// `calibrate` in a build without the trainer.
pub(crate) fn calibrate_without_trainer(args: CalibrateArgs) -> Result<(), Failure> {
    if args.device == DeviceArg::Cuda {
        return Err(no_cuda());
    }
    Err(needs_trainer("calibrate"))
}
