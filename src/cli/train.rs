//! `osdp-tui train`: run a plan with the libtorch trainer, headless. Progress on the terminal,
//! one JSON line per event in the metrics file, SIGINT/SIGTERM/SIGHUP finish the step, checkpoint and
//! exit 0.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::Failure;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// Everything in fp32.
    Fp32,
    /// bf16 compute, fp32 master weights and Adam moments (the planner's GPU accounting).
    Bf16,
}

#[derive(Debug, Clone, PartialEq, Args)]
pub struct TrainArgs {
    /// Model description (model.json): GPT-2, OPT or LLaMA family.
    pub model: PathBuf,
    /// Plan file written by `plan -o` (or by hand) for this model.
    #[arg(long)]
    pub plan: PathBuf,
    /// Data-parallel ranks, as threads of this process (at most 8 per core) [default: 1].
    /// Under torchrun or Slurm (`WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT` set) this
    /// process is one rank and the world size is `WORLD_SIZE` (a different --world-size is
    /// refused).
    #[arg(long, value_name = "N", value_parser = parse_world_size)]
    pub world_size: Option<usize>,
    /// Arrange the ranks as nodes of N consecutive ranks: what an hsdp plan shards over
    /// (inside a node) and replicates across (the nodes). N divides the world size [default:
    /// under torchrun or Slurm `LOCAL_WORLD_SIZE` or `SLURM_NTASKS_PER_NODE`; else all ranks
    /// one node].
    #[arg(long, value_name = "N", value_parser = parse_world_size)]
    pub ranks_per_node: Option<usize>,
    /// Samples per optimizer step over all ranks, run as the plan's micro-batches with
    /// gradient accumulation [default: micro-batch × accumulation × world size, the global
    /// batch the plan was made for; when resuming, the checkpoint's].
    #[arg(long, value_name = "N", value_parser = parse_global_batch)]
    pub global_batch: Option<u64>,
    /// Where the ranks compute. `cuda`: one process per GPU (launched by torchrun, srun or the
    /// dashboard), collectives over NCCL; needs a build with `--features cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Number format [default: fp32 on cpu, bf16 on cuda].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Optimizer steps to run (after the resumed step, when resuming); 0 runs until stopped.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub steps: u64,
    /// Seed of the initial weights and of the data order [default: 0, or the checkpoint's
    /// when resuming].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Training text: `shakespeare` (built in), `random` (random tokens, for speed runs) or a
    /// path to a text file (tokenised byte by byte) [default: shakespeare, or the checkpoint's
    /// when resuming].
    #[arg(long, value_name = "SOURCE")]
    pub data: Option<String>,
    /// Tokenise text data with this Hugging Face tokenizer.json (the model's own) instead of
    /// byte by byte; a .jsonl --data (`{"text": …}` per line) needs one, and its documents
    /// are joined by the tokenizer's end-of-text token. A .bin --data is already tokens:
    /// llm.c's (256 × int32 header, magic 20240520) or nanoGPT's raw uint16.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// Held-out data (as --data, with the same --tokenizer): its loss is reported every
    /// --eval-every steps and after the last (an `eval` event, shown by `status` and the
    /// dashboard).
    #[arg(long, value_name = "SOURCE")]
    pub eval_data: Option<String>,
    /// Steps between held-out losses.
    #[arg(long, value_name = "K", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_every: u64,
    /// Held-out samples evaluated, from the first, in order (rounded down to a multiple of the
    /// world size).
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub eval_samples: u64,
    /// Peak learning rate (AdamW, linear warm-up over the first 10 steps).
    #[arg(long, default_value_t = 1e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    pub lr: f64,
    /// Write one JSON line per event (started, step, checkpoint, stopped, failed) here.
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// Directory for checkpoints (written when the run ends or stops, and every K steps).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every K steps.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub checkpoint_every: u64,
    /// Continue from the latest checkpoint in --checkpoint-dir (under this plan and world size).
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Continue from this checkpoint (a `step-…` directory).
    #[arg(long, value_name = "CHECKPOINT", conflicts_with = "resume")]
    pub resume_from: Option<PathBuf>,
    /// Start from a Hugging Face checkpoint's weights: a `save_pretrained` directory with
    /// config.json and model.safetensors (or sharded model-…-of-….safetensors with
    /// model.safetensors.index.json), fp32, bf16 or fp16. Its config must describe this model
    /// (`import-hf` it). Each rank reads only its own shares. Ignored when resuming: the
    /// checkpoint holds the trained weights.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Print the run's summary as JSON at the end.
    #[arg(long)]
    pub json: bool,
    /// The read end of the lifeline from the dashboard that started this worker: when it
    /// closes without the dashboard detaching first, the run stops as on SIGTERM
    /// (`osdp_tui::lifeline`).
    #[arg(long, value_name = "FD", hide = true)]
    pub supervisor_fd: Option<i32>,
}

impl TrainArgs {
    /// The command line (after `train`) that parses back to these arguments: how the dashboard
    /// starts its workers, so a worker runs exactly what the launcher meant and a new option
    /// cannot be forgotten on one side (the destructuring below names every field).
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let TrainArgs {
            model,
            plan,
            world_size,
            ranks_per_node,
            global_batch,
            device,
            precision,
            steps,
            seed,
            data,
            tokenizer,
            eval_data,
            eval_every,
            eval_samples,
            lr,
            metrics,
            checkpoint_dir,
            checkpoint_every,
            resume,
            resume_from,
            init_from,
            json,
            supervisor_fd,
        } = self;
        fn name(v: impl ValueEnum) -> String {
            v.to_possible_value()
                .map(|p| p.get_name().to_owned())
                .unwrap_or_default()
        }
        let mut out: Vec<std::ffi::OsString> = Vec::new();
        // `--flag=value`, one word: a value that starts with `-` stays a value.
        let mut opt = |flag: &str, value: Option<std::ffi::OsString>| {
            if let Some(v) = value {
                let mut word = std::ffi::OsString::from(format!("{flag}="));
                word.push(v);
                out.push(word);
            }
        };
        opt("--plan", Some(plan.into()));
        opt("--world-size", world_size.map(|n| n.to_string().into()));
        opt(
            "--ranks-per-node",
            ranks_per_node.map(|n| n.to_string().into()),
        );
        opt("--global-batch", global_batch.map(|n| n.to_string().into()));
        opt("--device", Some(name(*device).into()));
        opt("--precision", precision.map(|p| name(p).into()));
        opt("--steps", Some(steps.to_string().into()));
        opt("--seed", seed.map(|n| n.to_string().into()));
        opt("--data", data.as_ref().map(Into::into));
        opt("--tokenizer", tokenizer.as_ref().map(Into::into));
        opt("--eval-data", eval_data.as_ref().map(Into::into));
        opt("--eval-every", Some(eval_every.to_string().into()));
        opt("--eval-samples", Some(eval_samples.to_string().into()));
        // `{}` of an f64 is the shortest text that reads back to the same value.
        opt("--lr", Some(lr.to_string().into()));
        opt("--metrics", metrics.as_ref().map(Into::into));
        opt("--checkpoint-dir", checkpoint_dir.as_ref().map(Into::into));
        opt(
            "--checkpoint-every",
            Some(checkpoint_every.to_string().into()),
        );
        opt("--resume-from", resume_from.as_ref().map(Into::into));
        opt("--init-from", init_from.as_ref().map(Into::into));
        opt(
            "--supervisor-fd",
            supervisor_fd.map(|n| n.to_string().into()),
        );
        if *resume {
            out.push("--resume".into());
        }
        if *json {
            out.push("--json".into());
        }
        // After `--`, a model path that starts with `-` is still the model.
        out.push("--".into());
        out.push(model.into());
        out
    }

    /// The arguments `train MODEL --plan PLAN` parses to: every other field at the default the
    /// CLI itself declares.
    pub fn new(model: PathBuf, plan: PathBuf) -> TrainArgs {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            args: TrainArgs,
        }
        let mut plan_arg = std::ffi::OsString::from("--plan=");
        plan_arg.push(plan);
        let argv: [std::ffi::OsString; 4] = ["train".into(), plan_arg, "--".into(), model.into()];
        <Only as clap::Parser>::try_parse_from(argv)
            .expect("a model and a plan are all `train` requires")
            .args
    }
}

/// Most ranks a run may have: more GPUs than the largest clusters hold, few enough that
/// per-rank tables stay small.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

fn parse_world_size(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_WORLD_SIZE).contains(&n) => Ok(n),
        Ok(n) if n > MAX_WORLD_SIZE => {
            Err(format!("{n} ranks are too many (at most {MAX_WORLD_SIZE})"))
        }
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// Samples per step: at most a full micro-batch on every rank of the largest world.
fn parse_global_batch(s: &str) -> Result<u64, String> {
    let most = osdp_core::plan::MAX_BATCH * MAX_WORLD_SIZE as u64;
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=most).contains(&n) => Ok(n),
        Ok(n) if n > most => Err(format!(
            "{n} samples per step are too many (at most {most})"
        )),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// A learning rate: a finite number above zero (NaN, inf and negative rates train nothing).
fn parse_lr(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr > 0.0 => Ok(lr),
        Ok(lr) => Err(format!(
            "{lr} is not a learning rate: expected a finite number above 0"
        )),
        Err(_) => Err(format!("expected a number, got {s:?}")),
    }
}

impl TrainArgs {
    /// What the parsers cannot check alone: each rank's share of the global batch is a
    /// micro-batch the planner would accept.
    pub fn check(&self) -> Result<(), Failure> {
        let (Some(global), world) = (self.global_batch, self.world_size.unwrap_or(1)) else {
            return Ok(());
        };
        let per_rank = global.div_ceil(world as u64);
        if per_rank > osdp_core::plan::MAX_BATCH {
            return Err(Failure::input(format!(
                "--global-batch {global} over {world} rank(s) is {per_rank} samples per rank \
                 (at most {})",
                osdp_core::plan::MAX_BATCH
            )));
        }
        Ok(())
    }
}

/// What a finished run did: `train`'s report, computed once and rendered as text or JSON.
/// The fields are in the JSON's (alphabetical) key order. Only a build with the trainer makes
/// one; its renderers are tested without.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TrainReport {
    /// The last checkpoint written, if any.
    pub checkpoint: Option<String>,
    pub elapsed_s: f64,
    pub first_loss: Option<f64>,
    pub first_step: u64,
    pub last_loss: Option<f64>,
    pub last_step: u64,
    /// The linears whose GEMMs ran with zero rows added (rank 0's executor; on a GPU, a 16-bit
    /// weight with rows not a multiple of 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub padded_linears: Vec<osdp_core::protocol::PaddedLinear>,
    /// The highest of every rank's peak.
    pub peak_memory_bytes: u64,
    pub stopped_by_signal: bool,
}

impl TrainReport {
    /// The text form: one line.
    pub fn text(&self) -> String {
        let how = if self.stopped_by_signal {
            "stopped"
        } else {
            "done"
        };
        let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
        format!(
            "{how}: steps {}→{} in {:.1} s, loss {} → {}, peak {} per rank{}",
            self.first_step,
            self.last_step,
            self.elapsed_s,
            loss(self.first_loss),
            loss(self.last_loss),
            osdp_core::units::bytes(self.peak_memory_bytes),
            self.checkpoint
                .as_ref()
                .map(|p| format!(", checkpoint {p}"))
                .unwrap_or_default()
        )
    }
}

#[cfg(test)]
mod report_tests {
    use super::TrainReport;

    fn report() -> TrainReport {
        TrainReport {
            checkpoint: Some("runs/x/step-000040".into()),
            elapsed_s: 12.34,
            first_loss: Some(4.17259),
            first_step: 0,
            last_loss: Some(2.5),
            last_step: 40,
            padded_linears: Vec::new(),
            peak_memory_bytes: 3 << 29,
            stopped_by_signal: true,
        }
    }

    #[test]
    fn the_text_report_is_one_line_with_what_the_run_did() {
        assert_eq!(
            report().text(),
            "stopped: steps 0→40 in 12.3 s, loss 4.1726 → 2.5000, peak 1.5 GiB per rank, \
             checkpoint runs/x/step-000040"
        );
        let none = TrainReport {
            checkpoint: None,
            first_loss: None,
            last_loss: None,
            stopped_by_signal: false,
            ..report()
        };
        assert_eq!(
            none.text(),
            "done: steps 0→40 in 12.3 s, loss - → -, peak 1.5 GiB per rank"
        );
    }

    #[test]
    fn the_json_report_keeps_its_keys_and_their_order() {
        let text = serde_json::to_string(&report()).unwrap();
        assert_eq!(
            text,
            "{\"checkpoint\":\"runs/x/step-000040\",\"elapsed_s\":12.34,\"first_loss\":4.17259,\
             \"first_step\":0,\"last_loss\":2.5,\"last_step\":40,\"peak_memory_bytes\":1610612736,\
             \"stopped_by_signal\":true}"
        );
    }
}

#[cfg(test)]
mod command_line {
    use super::*;
    use clap::Parser;
    use proptest::prelude::*;

    fn parse(args: &TrainArgs) -> TrainArgs {
        let argv = std::iter::once("osdp-tui".into())
            .chain(std::iter::once("train".into()))
            .chain(args.to_args());
        match super::super::Cli::try_parse_from(argv) {
            Ok(super::super::Cli {
                command: Some(super::super::Command::Train(parsed)),
                ..
            }) => parsed,
            Ok(_) => panic!("{:?} did not parse as `train`", args.to_args()),
            Err(e) => panic!("{:?} did not parse: {e}", args.to_args()),
        }
    }

    fn path() -> impl Strategy<Value = PathBuf> {
        prop_oneof![
            Just("model.json"),
            Just("-starts-with-a-dash.json"),
            Just("runs/a b/plan.json"),
            Just("--resume"),
            Just("/abs/ünïcode.json"),
        ]
        .prop_map(PathBuf::from)
    }

    fn args() -> impl Strategy<Value = TrainArgs> {
        (
            (path(), path(), proptest::option::of(1..=MAX_WORLD_SIZE)),
            (
                proptest::option::of(1u64..1 << 20),
                any::<bool>(),
                any::<bool>(),
            ),
            (0u64..1 << 40, proptest::option::of(any::<u64>())),
            (proptest::option::of("[a-z./ -]{1,12}"), 1e-12f64..10.0),
            (
                proptest::option::of(path()),
                proptest::option::of(path()),
                proptest::option::of(path()),
            ),
            (0u64..1000, 0u8..3, any::<bool>()),
            proptest::option::of(3i32..1 << 20),
        )
            .prop_map(
                |(
                    (model, plan, world_size),
                    (global_batch, cuda, bf16),
                    (steps, seed),
                    (data, lr),
                    (metrics, dir, init_from),
                    (every, resume, json),
                    supervisor_fd,
                )| {
                    TrainArgs {
                        model,
                        plan,
                        world_size,
                        // Nodes of half the ranks where the world splits in two.
                        ranks_per_node: world_size.filter(|w| w % 2 == 0).map(|w| w / 2),
                        global_batch,
                        device: if cuda {
                            DeviceArg::Cuda
                        } else {
                            DeviceArg::Cpu
                        },
                        precision: bf16.then_some(PrecisionArg::Bf16),
                        steps,
                        seed,
                        eval_data: data.clone(),
                        data,
                        tokenizer: init_from.clone(),
                        eval_every: every + 1,
                        eval_samples: steps % 1000 + 1,
                        lr,
                        metrics,
                        // `--resume` needs a directory; `--resume-from` excludes `--resume`.
                        checkpoint_dir: dir.clone().or_else(|| (resume == 1).then(|| "ck".into())),
                        checkpoint_every: every,
                        resume: resume == 1,
                        resume_from: (resume == 2).then(|| PathBuf::from("ck/step-00000001")),
                        init_from,
                        json,
                        supervisor_fd,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn a_worker_command_line_parses_back_to_the_arguments_it_came_from(a in args()) {
            prop_assert_eq!(parse(&a), a);
        }
    }

    #[test]
    fn new_takes_every_default_from_the_cli() {
        let a = TrainArgs::new("m.json".into(), "p.json".into());
        assert_eq!(parse(&a), a);
        assert_eq!((a.steps, a.lr, a.device), (100, 1e-3, DeviceArg::Cpu));
        assert!(a.world_size.is_none() && !a.resume && a.metrics.is_none());
        assert!(a.supervisor_fd.is_none());
    }
}

/// `train` in a build without the trainer: it checks the arguments, then says how to get it.
pub(crate) fn without_trainer(args: TrainArgs) -> Result<(), Failure> {
    args.check()?;
    Err(Failure::input(
        "this osdp-tui was built without the trainer; build it with \
         `. scripts/libtorch-env.sh && cargo build --release --features train`",
    ))
}
