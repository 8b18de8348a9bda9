//! What a planning request means before any search: whose budget binds, and what a pin names.
//! The CLI and the dashboard both ask these questions; the answers live here, beside the
//! planner, and print nowhere.

use crate::cluster::Layout;
use crate::cost::{Choice, Machine};
use crate::model::ModelSpec;
use crate::units;

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
        _ if memory > super::MAX_BUDGET_BYTES => {
            return Err(format!(
                "layout {:?}: device.memory_gib {} is more than the {} per GPU the planner \
                 takes; give --budget",
                crate::text::printable(&layout.name),
                layout.device.memory_gib.value,
                units::bytes(super::MAX_BUDGET_BYTES)
            ))
        }
        _ => vec![memory; ranks],
    })
}

/// The GPU whose budget binds (the smallest) and that budget.
pub fn binding(budgets: &[u64]) -> (usize, u64) {
    budgets
        .iter()
        .copied()
        .enumerate()
        .min_by_key(|&(_, b)| b)
        .unwrap_or((0, 0))
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
        format!(
            "--pin {pin:?}: unknown strategy {strategy:?} (none, dp, zero1, zero2, zero3, \
             zero3/K:M, hsdp, each but none and zero3/K:M optionally +offload-opt or \
             +offload-param)"
        )
    })?;
    super::check_choice(model, i, choice).map_err(|e| format!("--pin {pin:?}: {e}"))?;
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
    layout: &crate::cluster::Layout,
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
            crate::text::printable(&layout.name)
        )),
        Some(h) => {
            m.host_budget_bytes = h;
            Ok(())
        }
    }
}

/// The memory resolution a search runs at: `requested` if given (0 is exact), else 1 MiB, or
/// where offload is offered 1/512 of the GPU's memory or of the model's training state,
/// whichever is less (at least 1 MiB). It does not depend on the budget asked for, so that the
/// least budget one search reports is one the next search at that budget finds.
///
/// Offloading an op trades its state bytes for host-link and CPU time at nearly one rate for
/// every op, so no subset of offloaded ops dominates another: at 1 MiB the frontiers hold every
/// subset sum of the ops' states (~20,000 points on a 7B model) and a full search of llama-2-7b
/// on one H100 takes 1.5 s. At 1/512 of its 80 GiB (159 MiB) it takes ~20 ms and the plan found
/// is within 0.01 % of the 1 MiB one's step time (docs/offload.md). A small model keeps 1 MiB:
/// what it can offload is small, and so is its search.
pub fn search_resolution(
    requested: Option<u64>,
    model: &ModelSpec,
    m: &Machine,
    device_bytes: u64,
) -> u64 {
    const MIB: u64 = 1 << 20;
    let state = model
        .param_count()
        .saturating_mul(crate::cost::HOST_STATE_BYTES_PER_PARAM);
    requested.unwrap_or(if m.offers_offload() {
        (device_bytes.min(state) / OFFLOAD_RESOLUTION_SHARE / MIB).max(1) * MIB
    } else {
        MIB
    })
}

/// Share of the GPU's memory (or the state) that one step of memory resolution is in an offloading search (see
/// [`search_resolution`]).
pub const OFFLOAD_RESOLUTION_SHARE: u64 = 512;
