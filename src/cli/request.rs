//! From command-line words to what to plan: `--budget`/`--budget-per-gpu`, `--pin`,
//! `--recompute-block`, `--host-budget`, `--global-batch`/`--tokens-per-step`. What the words
//! mean to the planner is `osdp_core::plan`'s; how they are spelled, and the messages that
//! name the flags, are the command line's.

use osdp_core::cluster::Layout;
use osdp_core::cost::{Choice, Machine, Strategy};
use osdp_core::model::ModelSpec;
use osdp_core::plan::{
    batch_options, check_batch, check_choice, default_global_batch, max_global_batch, GlobalBatch,
    PlanOptions, MAX_BUDGET_BYTES,
};
use osdp_core::units;

/// One budget per GPU of `layout`: `--budget-per-gpu` if given (one per GPU), else `--budget`
/// for all, else `fallback` (e.g. each local GPU's free memory), else the device's memory.
pub fn per_gpu_budgets(
    layout: &Layout,
    budget: Option<u64>,
    per_gpu: &[u64],
    fallback: Option<Vec<u64>>,
) -> Result<Vec<u64>, String> {
    let ranks = layout.world_size() as usize;
    if !per_gpu.is_empty() {
        if per_gpu.len() != ranks {
            return Err(format!(
                "--budget-per-gpu lists {} budgets but layout {:?} has {ranks} GPUs",
                per_gpu.len(),
                layout.name
            ));
        }
        return Ok(per_gpu.to_vec());
    }
    let memory = layout.memory_bytes();
    Ok(match (budget, fallback) {
        (Some(b), _) => vec![b; ranks],
        (None, Some(f)) if f.len() == ranks => f,
        _ if memory > MAX_BUDGET_BYTES => {
            return Err(format!(
                "layout {:?}: device.memory_gib {} is more than the {} per GPU the planner \
                 takes; give --budget",
                osdp_core::text::printable(&layout.name),
                layout.device.memory_gib.value,
                units::bytes(MAX_BUDGET_BYTES)
            ))
        }
        _ => vec![memory; ranks],
    })
}

/// Parse `OP=STRATEGY` into (op index, choice), checking that the op can take it.
pub fn parse_pin(model: &ModelSpec, m: &Machine, pin: &str) -> Result<(usize, Choice), String> {
    let (op, strategy) = pin.split_once('=').ok_or_else(|| {
        format!("--pin {pin:?}: expected OP=STRATEGY, e.g. h0.mlp.c_fc=zero3/4:2")
    })?;
    let i = model
        .ops
        .iter()
        .position(|o| o.id == op)
        .ok_or_else(|| format!("--pin {pin:?}: model {:?} has no op {op:?}", model.name))?;
    let choice = Choice::parse(strategy).ok_or_else(|| {
        let names: Vec<&str> = Strategy::ALL.iter().map(|i| i.name).collect();
        format!(
            "--pin {pin:?}: unknown strategy {strategy:?} ({}, zero3/K:M, each but none and \
             zero3/K:M optionally +offload-opt or +offload-param)",
            names.join(", ")
        )
    })?;
    check_choice(model, i, choice).map_err(|e| format!("--pin {pin:?}: {e}"))?;
    if let Some(why) = m.refuses_choice(choice) {
        return Err(format!("--pin {pin:?}: {why}"));
    }
    Ok((i, choice))
}

/// Parse `--recompute-block B=on|off` (B a block index or a range `A-B`) into (block,
/// recompute) pairs, checked against the model's blocks.
pub fn parse_block_recompute(model: &ModelSpec, arg: &str) -> Result<Vec<(usize, bool)>, String> {
    let flag = "--recompute-block";
    let (range, way) = arg
        .split_once('=')
        .ok_or_else(|| format!("{flag} {arg:?}: expected BLOCK=on|off or FIRST-LAST=on|off"))?;
    let on = match way {
        "on" => true,
        "off" => false,
        _ => {
            return Err(format!(
                "{flag} {arg:?}: expected on or off after =, got {way:?}"
            ))
        }
    };
    let blocks = model.config.layers as usize;
    let index = |s: &str| -> Result<usize, String> {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("{flag} {arg:?}: {s:?} is not a block index"))
    };
    let (first, last) = match range.split_once('-') {
        Some((a, b)) => (index(a)?, index(b)?),
        None => (index(range)?, index(range)?),
    };
    if first > last {
        return Err(format!(
            "{flag} {arg:?}: a range runs low to high ({last}-{first})"
        ));
    }
    if last >= blocks {
        return Err(format!(
            "{flag} {arg:?}: the model {:?} has blocks 0-{}",
            model.name,
            blocks.saturating_sub(1)
        ));
    }
    Ok((first..=last).map(|b| (b, on)).collect())
}

/// Apply `--host-budget` to `m`: the host memory per GPU offloaded state may take (0: no
/// offload). A layout without host figures cannot price offload: a budget other than 0 is
/// refused there.
pub fn set_host_budget(
    m: &mut Machine,
    layout: &Layout,
    host_budget: Option<u64>,
) -> Result<(), String> {
    match host_budget {
        None => Ok(()),
        Some(0) => {
            m.host_budget_bytes = 0;
            Ok(())
        }
        Some(_) if layout.host.is_none() => Err(format!(
            "--host-budget: layout {:?} has no `host` figures (host memory, the link to it, CPU \
             cores and their AdamW rate), so offload cannot be priced there",
            osdp_core::text::printable(&layout.name)
        )),
        Some(h) => {
            m.host_budget_bytes = h;
            Ok(())
        }
    }
}

/// What a global batch of `any` means, in the words `plan`, its `--help` and the dashboard use.
pub const ANY_MEANS: &str = "no accumulation, the fastest micro-batch that fits";

/// `--global-batch`: a number of samples, or `any`: [`ANY_MEANS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalBatchArg {
    Samples(u64),
    Any,
}

impl std::str::FromStr for GlobalBatchArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "any" {
            return Ok(GlobalBatchArg::Any);
        }
        match s.parse::<u64>() {
            Ok(n) if n >= 1 => Ok(GlobalBatchArg::Samples(n)),
            _ => Err(format!(
                "expected a number of samples per step or `any`, got {s:?}"
            )),
        }
    }
}

/// The global batch a command plans for: `--global-batch N|any`, `--tokens-per-step T`, a
/// fixed `--batch` alone (one micro-batch a step, as before global batches existed), or the
/// default for the model and layout ([`default_global_batch`]); checked, with the fixed
/// micro-batch, against the layout's ranks (one message for `plan` and the dashboard).
pub fn choose_global_batch(
    model: &ModelSpec,
    m: &Machine,
    cpu: bool,
    arg: Option<GlobalBatchArg>,
    tokens: Option<u64>,
    fixed_micro_batch: Option<u64>,
) -> Result<GlobalBatch, String> {
    if let Some(b) = fixed_micro_batch {
        check_batch(model, b).map_err(|e| format!("--batch: {e}"))?;
    }
    let from_tokens = tokens
        .map(|t| global_batch_of(model, t, m.ranks))
        .transpose()?;
    let chosen = match (from_tokens, arg, fixed_micro_batch) {
        (Some(n), _, _) | (None, Some(GlobalBatchArg::Samples(n)), _) => GlobalBatch::Given(n),
        (None, Some(GlobalBatchArg::Any), _) | (None, None, Some(_)) => GlobalBatch::Any,
        (None, None, None) => GlobalBatch::Default(default_global_batch(model, m, cpu)),
    };
    let options = PlanOptions {
        batch: fixed_micro_batch,
        global_batch: chosen.samples(),
        ..PlanOptions::default()
    };
    batch_options(&options, m.ranks).map_err(|e| e.to_string())?;
    Ok(chosen)
}

/// The global batch in samples from `--tokens-per-step T`: a whole number of the model's
/// sequences, at most what `ranks` ranks run ([`max_global_batch`]).
pub fn global_batch_of(model: &ModelSpec, tokens: u64, ranks: u32) -> Result<u64, String> {
    let seq = model.config.seq_len.max(1);
    let most = max_global_batch(ranks).saturating_mul(seq);
    if tokens > most {
        return Err(format!(
            "--tokens-per-step {tokens} is too large: at most {most} tokens on {ranks} rank(s) \
             ({} sequences of {seq})",
            most / seq
        ));
    }
    if tokens % seq != 0 {
        // Both within the range: `most` is a multiple of `seq` (unless saturated) above `tokens`.
        let below = tokens / seq * seq;
        return Err(format!(
            "--tokens-per-step {tokens} is not a whole number of {seq}-token sequences; \
             the nearest that are: {} and {}",
            below.max(seq),
            below.saturating_add(seq).min(most)
        ));
    }
    Ok(tokens / seq)
}
