//! Command line: parse, run the headless subcommands, report errors with an exit code.
//!
//! Exit codes: 0 success, 1 failure while writing output, 2 bad input (unreadable or invalid
//! files, bad arguments — clap uses 2 for usage errors too).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::cluster::{read_layout, Layout};
use crate::model::{self, hf, AttentionImpl, ModelSummary};
use crate::units;

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
    /// Model description to open (model.json).
    model: Option<PathBuf>,
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
    },
    /// Show a cluster layout: devices, memory, rates, links, with the source of each figure.
    Layout {
        /// Layout file (layouts/*.json).
        layout: PathBuf,
        /// Print the checked layout as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AttentionArg {
    /// Fused kernel (PyTorch SDPA / FlashAttention): keeps no seq² probabilities.
    Flash,
    /// Materialised softmax, as in Korthikanti et al.'s activation formula.
    Eager,
}

/// A failure with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn input(e: impl std::fmt::Display) -> Self {
        Failure {
            code: 2,
            message: e.to_string(),
        }
    }

    fn output(path: &Path, e: std::io::Error) -> Self {
        Failure {
            code: 1,
            message: format!("{}: cannot write: {e}", path.display()),
        }
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match (cli.command, cli.model) {
        (Some(Command::Inspect { model, json }), _) => inspect(&model, json),
        (
            Some(Command::ImportHf {
                config,
                output,
                seq_len,
                layers,
                name,
                attention,
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
            };
            let spec = hf::import_file(&config, &opts).map_err(Failure::input)?;
            model::write_model(&output, &spec).map_err(|e| Failure::output(&output, e))?;
            println!(
                "wrote {}: {} ({} parameters, {} ops)",
                output.display(),
                spec.name,
                units::thousands(spec.param_count()),
                spec.ops.len()
            );
            Ok(())
        }
        (Some(Command::Layout { layout, json }), _) => show_layout(&layout, json),
        (None, Some(model)) => {
            inspect(&model, false)?;
            println!(
                "\nThe interactive dashboard is not built yet; the headless commands above are \
                 (see `osdp-tui --help`)."
            );
            Ok(())
        }
        (None, None) => Err(Failure {
            code: 2,
            message: "no model given; try `osdp-tui sample-models/gpt2.json` or `osdp-tui --help`"
                .into(),
        }),
    }
}

fn inspect(path: &Path, json: bool) -> Result<(), Failure> {
    let spec = model::read_model(path).map_err(Failure::input)?;
    let s = ModelSummary::of(&spec);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&s).expect("summary serialises")
        );
        return Ok(());
    }
    let c = &spec.config;
    println!(
        "{} ({} family): {} parameters",
        s.name,
        s.family,
        units::count(s.params)
    );
    println!(
        "  shape       {} layers, hidden {}, {} heads ({} kv, {} dims each), ffn {}, vocab {}",
        c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn_hidden, c.vocab_size
    );
    println!("  sequence    {} tokens per sample", c.seq_len);
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
        "  activations {} kept for backward per sample ({} attention)",
        units::bytes(s.saved_activation_bytes_per_sample),
        format!("{:?}", c.attention).to_lowercase()
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

fn show_layout(path: &Path, json: bool) -> Result<(), Failure> {
    let l: Layout = read_layout(path).map_err(Failure::input)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&l).expect("layout serialises")
        );
        return Ok(());
    }
    let d = &l.device;
    println!("{}: {}", l.name, l.description);
    println!(
        "  {} node(s) × {} {} = {} ranks",
        l.nodes,
        l.gpus_per_node,
        d.model,
        l.world_size()
    );
    let row = |what: &str, value: String, source: &str| {
        println!("  {what:<24}{value:<16}{source}");
    };
    row(
        "memory",
        format!("{} GiB", d.memory_gib.value),
        &d.memory_gib.source,
    );
    row(
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
            row(
                &format!("dense {name}"),
                format!("{} TFLOP/s", f.value),
                &f.source,
            );
        }
    }
    row(
        "runtime overhead",
        format!("{} GiB", l.runtime_overhead_gib.value),
        &l.runtime_overhead_gib.source,
    );
    for (name, link) in [
        ("intra-node", Some(&l.intra_node)),
        ("inter-node", l.inter_node.as_ref()),
    ] {
        if let Some(link) = link {
            row(
                &format!("{name} ({:?})", link.kind).to_lowercase(),
                format!("{} GB/s", link.bus_bandwidth_gb_per_s.value),
                &link.bus_bandwidth_gb_per_s.source,
            );
            row(
                &format!("{name} latency"),
                format!("{} µs", link.latency_us.value),
                &link.latency_us.source,
            );
        }
    }
    Ok(())
}
