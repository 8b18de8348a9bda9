//! `osdp-tui eval` (a model's loss on data, in order) and `osdp-tui export-hf` (a checkpoint
//! back to a Hugging Face directory): the arguments, which the trainer binary runs.

use std::path::PathBuf;

use clap::Args;

use super::train::DeviceArg;

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Model description (model.json) the weights are of.
    pub model: PathBuf,
    /// The weights: a Hugging Face checkpoint directory (config.json and model.safetensors),
    /// a `--checkpoint-dir` (its latest checkpoint) or one `step-…` directory.
    #[arg(long, value_name = "DIR|CHECKPOINT")]
    pub init_from: PathBuf,
    /// Data: `shakespeare` (built in), a text file (byte by byte, or with --tokenizer), a
    /// .jsonl of `{"text": …}` documents (with --tokenizer) or a pre-tokenized .bin (llm.c's
    /// or nanoGPT's). Sample i is tokens [i·S, i·S + S] (S = the model's sequence length), in
    /// order.
    #[arg(long, value_name = "SOURCE", default_value = "shakespeare")]
    pub data: String,
    /// The model's Hugging Face tokenizer.json, for text data.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// Samples to evaluate, from the first [default: every whole sample in the data].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub samples: Option<u64>,
    /// Samples per forward pass.
    #[arg(long, value_name = "B", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub batch: u64,
    /// Where to compute (`cuda` needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Print `{"loss": …, "samples": N, "tokens": N·S}`.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ExportHfArgs {
    /// Model description (model.json) the checkpoint was trained from; made by `import-hf`,
    /// whose Hugging Face config it keeps and export writes back.
    pub model: PathBuf,
    /// A `--checkpoint-dir` (its latest checkpoint) or one `step-…` directory.
    pub checkpoint: PathBuf,
    /// Directory to write: config.json and model.safetensors (fp32), which
    /// `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads. It must not already
    /// hold a checkpoint.
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// Largest weight file; a larger model is written as shards with an index, as
    /// transformers does (e.g. 5GB, 500MiB).
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = super::parse_size)]
    pub max_shard_size: u64,
    /// Print what was written as JSON.
    #[arg(long)]
    pub json: bool,
}
