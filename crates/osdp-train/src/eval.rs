//! `eval`: the mean next-token loss of a model's weights over samples taken in order.
//!
//! Sample `i` is tokens `[i·S, i·S + S]` of the data (S = the model's sequence length): S
//! inputs and their S next-token targets. No shuffling, no dropout, one rank, every op
//! replicated: the figure depends only on the weights and the data.

use std::collections::HashMap;
use std::path::Path;

use tch::Tensor;

use crate::checkpoint;
use crate::collective::{Collective, LocalGroup};
use crate::data::Batch;
use crate::exec::{Executor, FullState, Init, OptimConfig, Target};
use crate::hf_weights::HfWeights;
use crate::TrainError;
use osdp_core::cost::Strategy;
use osdp_core::model::ModelSpec;
use osdp_core::plan::uniform_plan;

/// Weights to evaluate: a Hugging Face checkpoint, or one of ours.
pub enum Weights {
    Hf(HfWeights),
    Checkpoint(HashMap<String, FullState>),
}

impl Weights {
    /// `path`: a Hugging Face directory (it has a config.json), a `--checkpoint-dir` (its
    /// latest checkpoint) or one `step-…` directory; checked against `model`.
    pub fn open(path: &Path, model: &ModelSpec) -> Result<Weights, TrainError> {
        if path.join("config.json").is_file() {
            return HfWeights::open(path, model)
                .map(Weights::Hf)
                .map_err(TrainError::Invalid);
        }
        let step = match checkpoint::latest(path) {
            Ok(Some(latest)) => latest,
            _ => path.to_path_buf(),
        };
        let (_, params) = checkpoint::load_for(&step, model)?;
        Ok(Weights::Checkpoint(params))
    }

    fn init(&self) -> Init<'_> {
        match self {
            Weights::Hf(weights) => Init::Pretrained { weights },
            Weights::Checkpoint(params) => Init::Restored { params, step: 0 },
        }
    }
}

/// What `eval` reports.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean loss per token (natural log).
    pub loss: f64,
    pub samples: u64,
    pub tokens: u64,
}

/// Samples `first .. first + rows` of `tokens` taken in order, `seq` tokens each.
pub fn windows(tokens: &[i64], seq: usize, first: usize, rows: usize) -> Batch {
    let mut inputs = Vec::with_capacity(rows * seq);
    let mut labels = Vec::with_capacity(rows * seq);
    for i in first..first + rows {
        let w = &tokens[i * seq..i * seq + seq + 1];
        inputs.extend_from_slice(&w[..seq]);
        labels.extend_from_slice(&w[1..]);
    }
    Batch {
        rows,
        seq,
        inputs,
        labels,
    }
}

/// How many whole samples `tokens` holds for sequence length `seq`.
pub fn samples_in(tokens: usize, seq: usize) -> usize {
    tokens.saturating_sub(1) / seq.max(1)
}

/// An executor of `model` on one CPU or GPU rank with every op replicated and micro-batch
/// `batch`, its weights from `weights`.
pub fn executor(
    model: &ModelSpec,
    weights: &Weights,
    batch: u64,
    target: Target,
) -> Result<Executor, TrainError> {
    let plan = uniform_plan(model, Strategy::Dp, batch);
    let group = LocalGroup::new(1).pop().expect("a group of one");
    Executor::new(
        model,
        &plan,
        Box::new(group) as Box<dyn Collective>,
        target,
        weights.init(),
        OptimConfig::default(),
    )
    .map_err(|e| TrainError::Invalid(e.to_string()))
}

/// The mean loss over the first `samples` samples of `tokens`, `batch` at a time;
/// `progress(done)` after each batch.
pub fn evaluate(
    exec: &mut Executor,
    tokens: &[i64],
    samples: usize,
    batch: usize,
    mut progress: impl FnMut(usize),
) -> Result<EvalReport, TrainError> {
    let seq = exec_seq(exec);
    let mut sum = 0.0;
    let mut done = 0;
    while done < samples {
        let rows = batch.min(samples - done);
        let (loss, _) = exec
            .forward_only(&windows(tokens, seq, done, rows))
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        sum += loss * rows as f64;
        done += rows;
        progress(done);
    }
    Ok(EvalReport {
        loss: sum / samples.max(1) as f64,
        samples: samples as u64,
        tokens: (samples * seq) as u64,
    })
}

/// The logits of sample `i` (`[seq, vocab]`, fp32): what tests compare with transformers.
pub fn logits(exec: &mut Executor, tokens: &[i64], i: usize) -> Result<Tensor, TrainError> {
    let seq = exec_seq(exec);
    exec.forward_only(&windows(tokens, seq, i, 1))
        .map(|(_, l)| l.squeeze_dim(0))
        .map_err(|e| TrainError::Invalid(e.to_string()))
}

fn exec_seq(exec: &Executor) -> usize {
    exec.model().config.seq_len as usize
}
