//! The optimizer's half of a step: gradients synchronised as each strategy does (all-reduce,
//! reduce-scatter, or already sharded), the global norm and clipping, AdamW on what this rank
//! owns, and zero1/zero2's updated shards gathered back into every replica.

use tch::{Kind, Tensor};

use super::{nbytes, pad_flat, Executor, OptimConfig, Result, HOST};
use crate::memory::Category;
use osdp_core::cost::Holding;

impl Executor {
    /// The optimizer once the step's gradients are accumulated: synchronise them, clip to
    /// the global norm, update with AdamW, hand zero1/zero2 replicas their parameters back.
    /// Returns the norm before clipping.
    pub(super) fn optimizer_step(&mut self) -> Result<f64> {
        let t_sync = self.clock();
        // 1. Synchronise: dp all-reduces, zero1 reduce-scatters; zero2/3 already hold shards;
        // hsdp's node shards are summed across the nodes.
        let (shards, held_bytes) = self.sync_grads()?;
        let mut sync_s = self.since(t_sync);
        let t_update = self.clock();
        // 2. Global norm: replicated gradients counted once (by rank 0), shards by their owner
        // (hsdp's by their owner in the first node).
        let norm = self.global_norm(&shards)?;
        let clip = clip_factor(&self.optim, norm);
        // 3. AdamW on what this rank owns.
        self.apply_adamw(shards, clip);
        let update_s = self.since(t_update);
        let t_gather = self.clock();
        self.ledger.sub(Category::Grads, held_bytes);
        // 4. zero1/zero2 replicas get the updated parameters back.
        self.regather_replicas()?;
        sync_s += self.since(t_gather);
        if let Some(p) = self.profile.as_mut() {
            p.optimizer_s += update_s;
            p.sync_s += sync_s;
        }
        Ok(norm)
    }

    /// Step 1: every unit's synchronised gradient of what this rank updates (`None` for units
    /// with none), and the bytes of those now counted as held gradients on the device.
    fn sync_grads(&mut self) -> Result<(Vec<Option<Tensor>>, u64)> {
        let world = self.comm.world() as i64;
        let mut shards: Vec<Option<Tensor>> = Vec::with_capacity(self.units.len());
        let mut held_bytes = 0;
        for u in 0..self.units.len() {
            let class = self.units[u].class;
            let offloaded = !self.units[u].offload.is_none();
            let Some(grad) = self.units[u].grad.take() else {
                // An offloaded unit whose shards streamed to the host: summed there (hsdp's
                // node shards still across the nodes).
                let streamed = match (offloaded, &self.units[u].host_grad) {
                    (true, Some(h)) => Some(match (class, self.comm.nodes()) {
                        (Holding::Hybrid, Some(n)) => n.replica.all_reduce(h)?,
                        _ => h.shallow_clone(),
                    }),
                    _ => None,
                };
                shards.push(streamed);
                continue;
            };
            let held = nbytes(&grad);
            let synced = match class {
                Holding::Replicated => self.comm.all_reduce(&grad)?,
                Holding::Zero1 => {
                    let padded = pad_flat(&grad, self.units[u].shard_len * world);
                    self.comm.reduce_scatter(&padded)?
                }
                Holding::Zero2 | Holding::Zero3 => grad,
                Holding::Hybrid => match self.comm.nodes() {
                    Some(n) => n.replica.all_reduce(&grad)?,
                    None => grad,
                },
            };
            self.ledger.sub(Category::Grads, held);
            if offloaded {
                // dp / zero1 offloaded: the synchronised gradient moves to the host buffer.
                if let Some(h) = &mut self.units[u].host_grad {
                    h.copy_(&synced.to_kind(Kind::Float).to_device(HOST).reshape([-1]));
                    shards.push(Some(h.shallow_clone()));
                    continue;
                }
            }
            held_bytes += nbytes(&synced);
            self.ledger.add(Category::Grads, nbytes(&synced));
            shards.push(Some(synced));
        }
        Ok((shards, held_bytes))
    }

    /// Step 2: the global gradient norm over every rank, each gradient counted once.
    fn global_norm(&self, shards: &[Option<Tensor>]) -> Result<f64> {
        let rank = self.comm.rank();
        // Summed on the device and read once: a read per tensor would wait for the device
        // hundreds of times a step.
        let first_node = self.first_node();
        let counted: Vec<&Tensor> = shards
            .iter()
            .enumerate()
            .filter_map(|(u, g)| {
                let counted = match self.units[u].class {
                    Holding::Replicated => rank == 0,
                    Holding::Hybrid => first_node,
                    _ => true,
                };
                g.as_ref().filter(|_| counted)
            })
            .collect();
        let mut local_sq = Tensor::zeros([], (Kind::Double, self.device));
        // On a GPU one multi-tensor kernel (fp32 sums, as PyTorch's clip_grad_norm_) for the
        // gradients there; host-side and CPU gradients one by one, in fp64.
        let (gpu, rest): (Vec<&Tensor>, Vec<&Tensor>) =
            counted.into_iter().partition(|g| g.device().is_cuda());
        let mut one_by_one = rest;
        if !gpu.is_empty() {
            match crate::aten::sum_of_squares(&gpu) {
                Ok(sq) => local_sq += sq.to_kind(Kind::Double).to_device(self.device),
                Err(err) => {
                    crate::aten::warn_fallback(&FUSED_NORM_FAILED, &err);
                    one_by_one.extend(gpu);
                }
            }
        }
        for g in one_by_one {
            local_sq += g.square().sum(Kind::Double).to_device(self.device);
        }
        let total_sq = self.comm.all_reduce(&local_sq)?.double_value(&[]);
        Ok(total_sq.sqrt())
    }

    /// Step 3: one AdamW update of every unit this rank updates, its gradient scaled by
    /// `clip`; compute copies follow their masters, host gradient buffers are zeroed. On a GPU
    /// the units' fp32 tensors go through PyTorch's fused multi-tensor kernel, two calls (with
    /// and without weight decay) instead of a dozen kernels per unit.
    fn apply_adamw(&mut self, shards: Vec<Option<Tensor>>, clip: f64) {
        let o = self.optim;
        self.step += 1;
        let t = self.step as f64;
        let lr = o.lr_at(self.step);
        let bc1 = 1.0 - o.beta1.powf(t);
        let bc2 = 1.0 - o.beta2.powf(t);
        // (unit, p, g, m, v) of the updates the fused kernel takes, by weight decay or not,
        // sent in buckets: each bucket's fp32 gradients (copies of bf16 ones) live until its
        // kernel runs, so a bucket is bounded the way the written-out path's one is.
        let mut fused: [Vec<(usize, [Tensor; 4])>; 2] = [Vec::new(), Vec::new()];
        let mut bucket_bytes = [0u64; 2];
        let step = Step {
            t,
            lr,
            clip,
            bias_correction: (bc1, bc2),
        };
        for (u, g) in shards.into_iter().enumerate() {
            let Some(g) = g else { continue };
            let unit = &mut self.units[u];
            let (start, len) = unit.region;
            let g = g.to_kind(Kind::Float);
            let (mut p, g, mut m, mut v) = match unit.class {
                Holding::Replicated | Holding::Zero3 | Holding::Hybrid => (
                    unit.master.as_ref().unwrap_or(&unit.data).reshape([-1]),
                    g.reshape([-1]),
                    unit.m.reshape([-1]),
                    unit.v.reshape([-1]),
                ),
                Holding::Zero1 | Holding::Zero2 => (
                    match &unit.master {
                        Some(master) => master.narrow(0, 0, len),
                        None => unit.data.reshape([-1]).narrow(0, start, len),
                    },
                    g.narrow(0, 0, len),
                    unit.m.narrow(0, 0, len),
                    unit.v.narrow(0, 0, len),
                ),
            };
            if fusable(&[&p, &g, &m, &v]) {
                let d = usize::from(unit.decay);
                bucket_bytes[d] += nbytes(&g);
                fused[d].push((u, [p, g, m, v]));
                if bucket_bytes[d] >= FUSED_BUCKET_BYTES {
                    self.fused_adamw(std::mem::take(&mut fused[d]), d == 1, step);
                    bucket_bytes[d] = 0;
                }
                continue;
            }
            let decay = if unit.decay { o.weight_decay } else { 0.0 };
            adamw_update(&mut p, &g, &mut m, &mut v, &o, lr, decay, clip, (bc1, bc2));
            self.after_update(u);
        }
        for (d, group) in fused.into_iter().enumerate() {
            self.fused_adamw(group, d == 1, step);
        }
    }

    /// One fused AdamW call over a bucket of units' `[p, g, m, v]` (with weight decay or
    /// without), then each unit's [`Executor::after_update`]; should the kernel fail, the
    /// written-out update of each.
    fn fused_adamw(&mut self, group: Vec<(usize, [Tensor; 4])>, decays: bool, s: Step) {
        if group.is_empty() {
            return;
        }
        let o = self.optim;
        let device = group[0].1[0].device();
        // Filled on the device: a host tensor copied there would wait for the kernels queued
        // before it, once a bucket.
        let step = Tensor::full([], s.t, (Kind::Float, device));
        let scale = (s.clip != 1.0).then(|| Tensor::full([], 1.0 / s.clip, (Kind::Float, device)));
        let h = crate::aten::AdamW {
            lr: s.lr,
            beta1: o.beta1,
            beta2: o.beta2,
            weight_decay: if decays { o.weight_decay } else { 0.0 },
            eps: o.eps,
        };
        let col = |k: usize| group.iter().map(|(_, t)| &t[k]).collect::<Vec<_>>();
        let done =
            crate::aten::fused_adamw(&col(0), &col(1), &col(2), &col(3), &step, h, scale.as_ref());
        if let Err(err) = done {
            crate::aten::warn_fallback(&FUSED_ADAMW_FAILED, &err);
            for (_, [p, g, m, v]) in &group {
                let (mut p, mut m, mut v) =
                    (p.shallow_clone(), m.shallow_clone(), v.shallow_clone());
                adamw_update(
                    &mut p,
                    g,
                    &mut m,
                    &mut v,
                    &o,
                    s.lr,
                    h.weight_decay,
                    s.clip,
                    s.bias_correction,
                );
            }
        }
        for (u, _) in &group {
            self.after_update(*u);
        }
    }

    /// After unit `u`'s update: its compute copy follows the master (zero1/zero2 after the
    /// gather of step 4), its host gradient buffer is zeroed.
    fn after_update(&mut self, u: usize) {
        let unit = &mut self.units[u];
        if let (Some(master), Holding::Replicated | Holding::Zero3 | Holding::Hybrid) =
            (&unit.master, unit.class)
        {
            unit.data.reshape([-1]).copy_(&master.reshape([-1]));
        }
        if let Some(h) = &mut unit.host_grad {
            let _ = h.zero_();
        }
    }

    /// Step 4: each zero1/zero2 unit's updated shards all-gathered into every rank's replica.
    fn regather_replicas(&mut self) -> Result<()> {
        for u in 0..self.units.len() {
            let unit = &self.units[u];
            if !matches!(unit.class, Holding::Zero1 | Holding::Zero2) {
                continue;
            }
            let (start, len) = unit.region;
            let share = match &unit.master {
                Some(master) => master.to_kind(self.kind).to_device(self.device),
                None => {
                    let share = Tensor::zeros([unit.shard_len], (self.kind, self.device));
                    if len > 0 {
                        share
                            .narrow(0, 0, len)
                            .copy_(&unit.data.reshape([-1]).narrow(0, start, len));
                    }
                    share
                }
            };
            let full = self.comm.all_gather(&share)?;
            let bytes = nbytes(&full);
            self.ledger.add(Category::GradBuffers, bytes);
            let unit = &mut self.units[u];
            let mut flat = unit.data.reshape([-1]);
            flat.copy_(&full.narrow(0, 0, unit.numel));
            self.ledger.sub(Category::GradBuffers, bytes);
        }
        Ok(())
    }
}

/// The fp32 gradients one fused AdamW call takes at most (the last unit may pass it).
const FUSED_BUCKET_BYTES: u64 = 256 << 20;

/// What one AdamW step applies, whichever path runs it.
#[derive(Clone, Copy)]
struct Step {
    /// The step number, counted.
    t: f64,
    lr: f64,
    clip: f64,
    /// The two moments' `1 − βᵗ`.
    bias_correction: (f64, f64),
}

/// Set once a fused AdamW call has failed (and said so).
static FUSED_ADAMW_FAILED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Set once the multi-tensor norm has failed (and said so).
static FUSED_NORM_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether PyTorch's fused AdamW can take these tensors: fp32, contiguous, on a GPU. The CPU
/// keeps the written-out update, whose speed and results the CPU tests pin.
fn fusable(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cuda() && t.kind() == Kind::Float && t.is_contiguous())
}

/// What the gradients are scaled by so that their global norm `norm` is at most the clip
/// norm: 1 when it already is, or when clipping is off.
fn clip_factor(o: &OptimConfig, norm: f64) -> f64 {
    if o.clip_norm > 0.0 && norm > o.clip_norm {
        o.clip_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// One AdamW update of `p` from gradient `g` (scaled by `clip`), in place on `p`, `m`, `v`;
/// `decay` is the weight decay for this tensor (0 for biases and norms), `bias_correction` the
/// two moments' `1 − βᵗ`. The optimizer's one code path: `calibrate` times this function.
///
/// In place with one scratch tensor (two when clipping): an update of a large tensor written
/// as tensor arithmetic allocated ten of them, and past glibc's mmap threshold (32 MiB) every
/// one was fresh pages from the kernel — five times slower on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    o: &OptimConfig,
    lr: f64,
    decay: f64,
    clip: f64,
    bias_correction: (f64, f64),
) {
    let clipped = (clip != 1.0).then(|| g * clip);
    let g = clipped.as_ref().unwrap_or(g);
    if decay > 0.0 {
        let _ = p.g_mul_scalar_(1.0 - lr * decay);
    }
    // m ← β₁·m + (1 − β₁)·g; v ← β₂·v + (1 − β₂)·g².
    let _ = m.lerp_(g, 1.0 - o.beta1);
    if lr == 0.0 {
        let _ = v.g_mul_scalar_(o.beta2);
        let _ = v.addcmul_(g, &(g * (1.0 - o.beta2)));
        return;
    }
    let mut scratch = g.square();
    let _ = v.lerp_(&scratch, 1.0 - o.beta2);
    // p ← p − lr · (m / bc₁) / (√(v / bc₂) + ε), the step's sign and scale folded into the
    // divisor so that one fused `addcdiv_` applies it.
    let _ = v.sqrt_out(&scratch);
    let _ = scratch.g_div_scalar_(bias_correction.1.sqrt());
    let _ = scratch.g_add_scalar_(o.eps);
    let _ = scratch.g_mul_scalar_(-bias_correction.0 / lr);
    let _ = p.addcdiv_(m, &scratch);
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The in-place update is AdamW as written in the paper (Loshchilov & Hutter), to fp32
    /// rounding: with and without clipping and decay, over a few steps.
    #[test]
    fn adamw_in_place_matches_the_formula() {
        let o = OptimConfig::default();
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(7);
        for (clip, decay) in [(1.0, 0.0), (0.5, 0.1)] {
            let mut p = Tensor::randn([1000], opts);
            let (mut m, mut v) = (Tensor::zeros([1000], opts), Tensor::zeros([1000], opts));
            let (mut p2, mut m2, mut v2) = (p.copy(), m.copy(), v.copy());
            for step in 1..=3 {
                let g = Tensor::randn([1000], opts);
                let t = f64::from(step);
                let bc = (1.0 - o.beta1.powf(t), 1.0 - o.beta2.powf(t));
                let lr = 1e-3;
                adamw_update(&mut p, &g, &mut m, &mut v, &o, lr, decay, clip, bc);
                let g = &g * clip;
                p2 *= 1.0 - lr * decay;
                m2 = &m2 * o.beta1 + &g * (1.0 - o.beta1);
                v2 = &v2 * o.beta2 + g.square() * (1.0 - o.beta2);
                p2 -= (&m2 / bc.0) / ((&v2 / bc.1).sqrt() + o.eps) * lr;
            }
            for (a, b) in [(&p, &p2), (&m, &m2), (&v, &v2)] {
                let err = (a - b).abs().max().double_value(&[]);
                let scale = b.abs().max().double_value(&[]);
                assert!(err <= 1e-6 * scale, "{err} of {scale}");
            }
        }
    }
}
