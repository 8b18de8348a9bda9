//! This rank's parameter units, built from a plan: each parameter (or column slice of a split
//! linear's weight) held whole or as this rank's shard, with its master copy, AdamW moments and
//! host buffers where the plan offloads, from fresh or restored values. What they hold is
//! counted in a [`Ledger`].

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use super::{nbytes, to_host, ExecError, Numerics, Result, Target, HOST};
use crate::collective::Collective;
use crate::data::SplitMix;
use crate::memory::{Category, Ledger};
use osdp_core::cost::{self, Holding, Offload};
use osdp_core::model::{ModelSpec, OpSpec, ParamSpec};
use osdp_core::plan::Plan;

/// A parameter, or one column slice of a split linear's weight: the granularity of sharding.
pub(super) struct Unit {
    /// `op.param` of the full parameter.
    pub(super) key: String,
    /// The op that owns the parameter.
    pub(super) op: usize,
    /// Column range `(start, len)` of a split weight.
    pub(super) cols: Option<(i64, i64)>,
    pub(super) shape: Vec<i64>,
    pub(super) numel: i64,
    pub(super) class: Holding,
    /// `ceil(numel / ranks)`: each rank's share of the padded flat unit, over the ranks it is
    /// sharded among (all of them; a node's for hsdp).
    pub(super) shard_len: i64,
    /// This rank's real (unpadded) share: `(start, len)` in the flat unit.
    pub(super) region: (i64, i64),
    /// Full unit (dp, zero1, zero2) or this rank's padded shard (zero3, hsdp), in the compute
    /// kind.
    pub(super) data: Tensor,
    /// Mixed precision only: the fp32 master of what this rank updates — the full unit (dp)
    /// or its padded share (zero1, zero2, zero3). In fp32 `data` is its own master.
    pub(super) master: Option<Tensor>,
    /// Full gradient (dp, zero1) or this rank's padded shard (zero2, zero3), while held.
    pub(super) grad: Option<Tensor>,
    /// AdamW moments: full (dp) or this rank's padded share.
    pub(super) m: Tensor,
    pub(super) v: Tensor,
    pub(super) decay: bool,
    /// What of the unit lives in host memory (`cost::Offload`): under offload-opt the master
    /// (fp32, always), the moments and `host_grad`; under offload-param `data` too.
    pub(super) offload: Offload,
    /// Offloaded units: the fp32 gradient of what this rank updates, in host memory. Where
    /// gradients are sharded every micro-batch (`Holding::streams_grads`) each micro-batch's
    /// shard is summed here and the device holds none; otherwise the synchronised gradient
    /// is copied here at the step.
    pub(super) host_grad: Option<Tensor>,
}

/// Full (unsharded) values of one parameter in host memory: weights and AdamW moments (empty
/// when zero). What checkpoints hold; plain data, so rank threads can share it.
pub struct FullState {
    pub shape: Vec<i64>,
    pub param: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl FullState {
    fn tensors(&self) -> (Tensor, Tensor, Tensor) {
        let t = |v: &[f32]| {
            if v.is_empty() {
                Tensor::zeros(self.shape.as_slice(), (Kind::Float, Device::Cpu))
            } else {
                Tensor::from_slice(v).reshape(self.shape.as_slice())
            }
        };
        (t(&self.param), t(&self.m), t(&self.v))
    }
}

/// Where initial values come from.
pub enum Init<'a> {
    /// Deterministic from the seed and the parameter's name, whatever the plan or world size.
    Fresh { seed: u64 },
    /// Values from a checkpoint, keyed by `op.param`, with the optimizer's step count.
    Restored {
        params: &'a HashMap<String, FullState>,
        step: u64,
    },
    /// Weights from a Hugging Face checkpoint (read one parameter at a time), moments zero.
    Pretrained {
        weights: &'a crate::hf_weights::HfWeights,
    },
}

fn init_values(seed: u64, key: &str, shape: &[i64]) -> Vec<f32> {
    let numel: i64 = shape.iter().product();
    let name = osdp_core::model::split_param_key(key).map_or("", |(_, name)| name);
    if name == "bias" {
        return vec![0.0; numel as usize];
    }
    if shape.len() == 1 {
        return vec![1.0; numel as usize];
    }
    normals(
        &SplitMix::for_name(seed, key),
        numel as usize,
        PARALLEL_INIT_ELEMENTS,
    )
}

/// From this many values a weight's initial values are drawn on every core: each costs a
/// logarithm, a square root and a cosine, 26 ns on one core of the 2-vCPU development VM
/// (15.8 on both), so gpt2-xl's 1.5 G would take ~40 s on one before a GPU's first step.
const PARALLEL_INIT_ELEMENTS: usize = 1 << 20;

/// `n` values `0.02 · N(0, 1)` of `rng`'s stream, in order: the same values whether drawn on
/// one thread or, from `parallel_from` values on, on every core.
fn normals(rng: &SplitMix, n: usize, parallel_from: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    let fill = |chunk: &mut [f32], first: usize| {
        for (i, x) in chunk.iter_mut().enumerate() {
            *x = (rng.normal_at((first + i) as u64) * 0.02) as f32;
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    if n < parallel_from || threads < 2 {
        fill(&mut out, 0);
        return out;
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for (c, chunk) in out.chunks_mut(per).enumerate() {
            s.spawn(move || fill(chunk, c * per));
        }
    });
    out
}

/// The parameter units this rank holds (its shares, gathered on use).
pub(super) struct Units {
    pub(super) units: Vec<Unit>,
    /// Per op, per parameter: the units it reads.
    pub(super) uses: Vec<Vec<Vec<usize>>>,
    /// Per parameter key: its units (several when split by columns).
    pub(super) by_key: HashMap<String, Vec<usize>>,
    /// What the units hold, by category.
    pub(super) ledger: Ledger,
}

/// Build this rank's [`Units`] under `plan`, from fresh or restored values.
pub(super) fn build_units(
    model: &ModelSpec,
    plan: &Plan,
    comm: &dyn Collective,
    target: Target,
    init: &Init<'_>,
) -> Result<Units> {
    let placer = Placer {
        comm,
        device: target.device,
        kind: target.numerics.compute_kind(),
        mixed: target.numerics == Numerics::Bf16Mixed,
    };
    let mut units = Vec::new();
    let mut uses: Vec<Vec<Vec<usize>>> = model
        .ops
        .iter()
        .map(|o| vec![Vec::new(); o.params.len()])
        .collect();
    let mut by_key: HashMap<String, Vec<usize>> = HashMap::new();
    let mut ledger = Ledger::default();
    for (i, op) in model.ops.iter().enumerate() {
        let choice = plan.choices[i];
        for (p, param) in op.params.iter().enumerate() {
            if param.tied_to.is_some() {
                continue;
            }
            let key = osdp_core::model::param_key(&op.id, &param.name);
            if key.contains('|') {
                return Err(ExecError::Unsupported(format!(
                    "parameter name {key:?} contains '|'"
                )));
            }
            let (full_p, full_m, full_v) = initial_values(init, &key, param)?;
            // The cost model prices the same units (`cost::Choice::units`).
            let cut = cost::cut_by_split(op.kind, &param.name);
            for unit in choice.units(param.numel(), cut) {
                let cols = slice_columns(op, param, unit.slice)?;
                let take = |t: &Tensor| match cols {
                    Some((start, len)) => t.narrow(1, start, len).contiguous(),
                    None => t.shallow_clone(),
                };
                let unit = placer.place(UnitSource {
                    key: key.clone(),
                    op: i,
                    cols,
                    class: unit.holding,
                    offload: choice.offload,
                    decay: param.shape.len() >= 2,
                    values: (take(&full_p), take(&full_m), take(&full_v)),
                });
                count(&mut ledger, &unit);
                by_key.entry(key.clone()).or_default().push(units.len());
                uses[i][p].push(units.len());
                units.push(unit);
            }
        }
    }
    Ok(Units {
        units,
        uses,
        by_key,
        ledger,
    })
}

/// The full values of parameter `key` (weights and moments, in host memory): fresh from the
/// seed, or the checkpoint's, whose shape must be the model's.
fn initial_values(
    init: &Init<'_>,
    key: &str,
    param: &ParamSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    Ok(match init {
        Init::Fresh { seed } => FullState {
            shape: param.shape.clone(),
            param: init_values(*seed, key, &param.shape),
            m: Vec::new(),
            v: Vec::new(),
        }
        .tensors(),
        Init::Restored { params, .. } => {
            let s = params.get(key).ok_or_else(|| {
                ExecError::Unsupported(format!("the checkpoint has no parameter {key:?}"))
            })?;
            if s.shape != param.shape {
                return Err(ExecError::Unsupported(format!(
                    "the checkpoint's {key:?} has shape {:?}, the model says {:?}",
                    s.shape, param.shape
                )));
            }
            s.tensors()
        }
        Init::Pretrained { weights } => {
            let zeros = || Tensor::zeros(param.shape.as_slice(), (Kind::Float, Device::Cpu));
            let p = weights.read(key).map_err(ExecError::Unsupported)?;
            (p, zeros(), zeros())
        }
    })
}

/// The column range `(start, len)` of slice `(j, k)` (slice `j` of `k` equal ones) of `op`'s
/// weight `param`; `None` for a whole tensor.
fn slice_columns(
    op: &OpSpec,
    param: &ParamSpec,
    slice: Option<(u32, u32)>,
) -> Result<Option<(i64, i64)>> {
    Ok(match slice {
        Some((j, k)) => {
            let (j, k, in_features) = (i64::from(j), i64::from(k), param.shape[1]);
            if in_features % k != 0 {
                return Err(ExecError::Unsupported(format!(
                    "op {:?} has {in_features} input features, which {k} slices do not divide",
                    op.id
                )));
            }
            Some((j * in_features / k, in_features / k))
        }
        None => None,
    })
}

/// One unit's full values (its column slice of the parameter, weights and moments) and how the
/// plan holds it: what [`Placer::place`] makes this rank's copy from.
struct UnitSource {
    key: String,
    op: usize,
    cols: Option<(i64, i64)>,
    class: Holding,
    offload: Offload,
    decay: bool,
    values: (Tensor, Tensor, Tensor),
}

/// Where and in what kind this rank keeps its units, and the ranks they are sharded among.
struct Placer<'a> {
    comm: &'a dyn Collective,
    device: Device,
    kind: Kind,
    mixed: bool,
}

impl Placer<'_> {
    /// The ranks a unit is sharded among, as `(rank, world)`: all of them, or for hsdp this
    /// rank's node.
    fn sharding(&self, class: Holding) -> (i64, i64) {
        match (class, self.comm.nodes()) {
            (Holding::Hybrid, Some(n)) => (n.shard.rank() as i64, n.shard.world() as i64),
            _ => (self.comm.rank() as i64, self.comm.world() as i64),
        }
    }

    /// This rank's copy of a unit: whole or its padded shard on the device, with an fp32 master
    /// in mixed precision, and where offloaded the master, the moments and a gradient buffer in
    /// host memory.
    fn place(&self, src: UnitSource) -> Unit {
        let UnitSource {
            key,
            op,
            cols,
            class,
            offload,
            decay,
            values: (pv, mv, vv),
        } = src;
        let (device, kind, mixed) = (self.device, self.kind, self.mixed);
        let shape = pv.size();
        let numel: i64 = shape.iter().product();
        let (rank, world) = self.sharding(class);
        let shard_len = (numel + world - 1) / world;
        let start = (rank * shard_len).min(numel);
        let len = (numel - start).clamp(0, shard_len);
        let padded_share = |t: &Tensor| {
            let flat = t.reshape([-1]);
            let share = Tensor::zeros([shard_len], (Kind::Float, Device::Cpu));
            if len > 0 {
                share.narrow(0, 0, len).copy_(&flat.narrow(0, start, len));
            }
            share.to_device(device)
        };
        let owned = match class {
            Holding::Replicated => pv.to_kind(Kind::Float).to_device(device),
            _ => padded_share(&pv),
        };
        let data = match class {
            Holding::Zero3 | Holding::Hybrid => owned.to_kind(kind),
            _ => pv.to_kind(kind).to_device(device),
        };
        let (m, v) = match class {
            Holding::Replicated => (mv.to_device(device), vv.to_device(device)),
            _ => (padded_share(&mv), padded_share(&vv)),
        };
        // Offloaded: the fp32 master, the moments and a gradient buffer of what this
        // rank updates in host memory (the cost model's `Holding::placed_bytes`), and
        // under offload-param the compute copy too.
        let (data, master, m, v, host_grad) = if offload.is_none() {
            (data, mixed.then_some(owned), m, v, None)
        } else {
            let updated = match class {
                Holding::Replicated => numel,
                _ => shard_len,
            };
            let data = match offload {
                Offload::Param => to_host(&data),
                _ => data,
            };
            (
                data,
                Some(to_host(&owned.to_kind(Kind::Float))),
                to_host(&m),
                to_host(&v),
                Some(Tensor::zeros([updated], (Kind::Float, HOST))),
            )
        };
        Unit {
            key,
            op,
            cols,
            numel,
            shape,
            class,
            shard_len,
            region: (start, len),
            data,
            master,
            grad: None,
            m,
            v,
            decay,
            offload,
            host_grad,
        }
    }
}

/// Count what a freshly placed unit holds in `ledger`: on the device its compute copy, and its
/// master and moments unless offloaded; in host memory what is offloaded.
fn count(ledger: &mut Ledger, unit: &Unit) {
    let master_bytes = unit.master.as_ref().map_or(0, nbytes);
    let moments = nbytes(&unit.m) + nbytes(&unit.v);
    match unit.offload {
        Offload::None => {
            ledger.add(Category::Params, nbytes(&unit.data));
            ledger.add(Category::Optimizer, moments + master_bytes);
        }
        _ => {
            let host_data = match unit.offload {
                Offload::Param => nbytes(&unit.data),
                _ => {
                    ledger.add(Category::Params, nbytes(&unit.data));
                    0
                }
            };
            let grad_bytes = unit.host_grad.as_ref().map_or(0, nbytes);
            ledger.add_host(host_data + master_bytes + moments + grad_bytes);
        }
    }
}

/// Point every tied parameter at its owner's unit (a tie to a split or unknown parameter is
/// refused).
pub(super) fn resolve_ties(
    model: &ModelSpec,
    by_key: &HashMap<String, Vec<usize>>,
    uses: &mut [Vec<Vec<usize>>],
) -> Result<()> {
    for (i, op) in model.ops.iter().enumerate() {
        for (p, param) in op.params.iter().enumerate() {
            if let Some(target) = &param.tied_to {
                let owner = by_key.get(target).ok_or_else(|| {
                    ExecError::Unsupported(format!("op {:?} is tied to unknown {target:?}", op.id))
                })?;
                if owner.len() != 1 {
                    return Err(ExecError::Unsupported(format!(
                        "op {:?} is tied to {target:?}, which is split",
                        op.id
                    )));
                }
                uses[i][p] = owner.clone();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drawn on every core from any size, a weight's initial values are the single-threaded
    /// stream's, in order: the values never depend on the machine.
    #[test]
    fn parallel_initial_values_are_the_sequential_stream() {
        let rng = SplitMix::for_name(7, "h0.attn.c_attn.weight");
        let mut seq = rng.clone();
        let want: Vec<f32> = (0..1001)
            .map(|_| (seq.next_normal() * 0.02) as f32)
            .collect();
        assert_eq!(normals(&rng, 1001, 1), want);
        assert_eq!(normals(&rng, 1001, usize::MAX), want);
        // What init_values gives a matrix is that stream.
        assert_eq!(
            init_values(7, "h0.attn.c_attn.weight", &[13, 77]),
            want[..1001]
        );
    }
}
