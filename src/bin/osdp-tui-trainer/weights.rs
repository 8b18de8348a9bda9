//! `eval` and `export-hf`: a model's loss on data in order, and a checkpoint written back as a
//! Hugging Face directory.

use std::io::IsTerminal;
use std::path::Path;

use osdp_core::model::{read_model, ModelSpec};
use osdp_train::eval::{self, Weights};
use osdp_train::exec::{Numerics, Target};
use osdp_train::{checkpoint, hf_weights};
use osdp_tui::cli::train::DeviceArg;
use osdp_tui::cli::weights::{EvalArgs, ExportHfArgs};
use osdp_tui::cli::Failure;

pub fn eval(args: EvalArgs) -> Result<(), Failure> {
    let model = read_model(&args.model).map_err(Failure::input)?;
    let tokens = tokens(&args.data, args.tokenizer.as_deref(), &model)?;
    let seq = model.config.seq_len as usize;
    let available = eval::samples_in(tokens.len(), seq);
    let samples = match args.samples {
        Some(n) if n as usize > available => {
            return Err(Failure::input(format!(
                "--samples {n}: --data {} holds {available} samples of {seq} tokens",
                args.data
            )))
        }
        Some(n) => n as usize,
        None if available == 0 => {
            return Err(Failure::input(format!(
                "--data {}: {} tokens are fewer than one sample of {} tokens",
                args.data,
                tokens.len(),
                seq + 1
            )))
        }
        None => available,
    };
    let target = target(args.device)?;
    let weights = Weights::open(&args.init_from, &model)
        .map_err(|e| Failure::input(format!("--init-from {}: {e}", args.init_from.display())))?;
    let mut exec = eval::executor(&model, &weights, args.batch, target)
        .map_err(|e| Failure::input(e.to_string()))?;
    drop(weights);
    let tty = std::io::stderr().is_terminal();
    let report = eval::evaluate(&mut exec, &tokens, samples, args.batch as usize, |done| {
        if tty {
            eprint!("\r\x1b[2Keval: {done}/{samples} samples");
        }
    })
    .map_err(|e| Failure::input(e.to_string()))?;
    if tty {
        eprintln!();
    }
    if args.json {
        osdp_tui::report::print_json(&report);
    } else {
        println!(
            "loss {:.4} (perplexity {:.2}) over {} samples, {} tokens of {}",
            report.loss,
            report.loss.exp(),
            report.samples,
            report.tokens,
            args.data
        );
    }
    Ok(())
}

/// The data's tokens in order, each inside the model's vocabulary.
fn tokens(data: &str, tokenizer: Option<&Path>, model: &ModelSpec) -> Result<Vec<i64>, Failure> {
    use osdp_train::data::{load, SHAKESPEARE};
    let (vocab, seq) = (model.config.vocab_size, model.config.seq_len as usize);
    match (data, tokenizer) {
        // The built-in text byte by byte, checked as files are (training wraps it instead).
        ("shakespeare", None) => {
            let bytes: Vec<u32> = SHAKESPEARE.iter().map(|&b| u32::from(b)).collect();
            load::check("--data shakespeare", &bytes, vocab, seq).map_err(Failure::input)?;
            Ok(bytes.into_iter().map(i64::from).collect())
        }
        _ => load::open("--data", data, tokenizer, vocab, seq)
            .map_err(Failure::input)?
            .tokens()
            .ok_or_else(|| Failure::input("--data random: eval needs real data")),
    }
}

fn target(device: DeviceArg) -> Result<Target, Failure> {
    match device {
        DeviceArg::Cpu => Ok(Target::CPU),
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => Ok(Target {
            device: osdp_train::cuda::preflight(0).map_err(Failure::input)?,
            numerics: Numerics::Fp32,
        }),
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => {
            let _ = Numerics::Fp32;
            Err(Failure::input(
                "--device cuda: this osdp-tui was built without GPU support; build it with \
                 `. scripts/libtorch-env.sh && cargo build --release --features cuda`",
            ))
        }
    }
}

pub fn export_hf(args: ExportHfArgs) -> Result<(), Failure> {
    let model = read_model(&args.model).map_err(Failure::input)?;
    let out = &args.output;
    if holds_checkpoint(out) {
        return Err(Failure::input(format!(
            "-o {}: already holds a Hugging Face checkpoint; choose another directory (nothing \
             there is overwritten)",
            out.display()
        )));
    }
    let step_dir = match checkpoint::latest(&args.checkpoint) {
        Ok(Some(latest)) => latest,
        _ => args.checkpoint.clone(),
    };
    let (manifest, params) = checkpoint::load_for(&step_dir, &model)
        .map_err(|e| Failure::input(format!("{}: {e}", args.checkpoint.display())))?;
    let value = |key: &str| params.get(key).map(|s| (s.shape.clone(), s.param.clone()));
    let written =
        hf_weights::export(&model, &value, out, args.max_shard_size).map_err(Failure::input)?;
    if args.json {
        osdp_tui::report::print_json(&serde_json::json!({
            "dir": out.display().to_string(),
            "step": manifest.step,
            "files": written.files,
            "tensors": written.tensors,
            "bytes": written.bytes,
        }));
    } else {
        println!(
            "wrote {}: config.json and {} ({} tensors, {}) from step {} of {}",
            out.display(),
            written.files.join(", "),
            written.tensors,
            osdp_core::units::bytes(written.bytes),
            manifest.step,
            step_dir.display()
        );
    }
    Ok(())
}

/// Whether `dir` already holds a config or weights that an export would replace.
fn holds_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name == "config.json" || name.ends_with(".safetensors")
        })
    })
}
