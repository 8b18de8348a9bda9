//! What the executor measures about itself: where a step's time went ([`Profile`], read with
//! a clock that waits for the GPU while profiling) and what a rank holds when a forward pass
//! ends ([`ForwardMemory`]).

use std::time::Instant;

use tch::Device;

use super::{nbytes, Executor};
use crate::memory::Category;
use osdp_core::cost::Offload;

/// What one rank holds when a forward pass ends, by category and op by op: the moment every
/// kept activation and every byte of state is held, which the cost model's per-op figures
/// (`cost::price(..).persistent_bytes`, `OpBase::saved_bytes`) are checked against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardMemory {
    /// The ledger's categories then.
    pub ledger: crate::memory::Breakdown,
    /// Per op: bytes of the parameters it owns on the device (compute copy, fp32 master,
    /// moments, gradient).
    pub state_bytes: Vec<u64>,
    /// Per op: bytes of its parameters' state in host memory (offloaded).
    pub host_state_bytes: Vec<u64>,
    /// Per op: bytes of its output held for backward (or as a recomputed block's restart).
    pub kept_output_bytes: Vec<u64>,
    /// Per op: bytes its kernels keep beside the graph's tensors (norm statistics,
    /// log-sum-exp, log-probabilities).
    pub kept_extra_bytes: Vec<u64>,
}

/// Where one rank's last step spent its time (when profiling is on): what `calibrate` fits
/// the cost model's curves to, and what `validate` compares with the prediction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// Per op: forward and backward seconds, collectives of the op included.
    pub fwd_s: Vec<f64>,
    pub bwd_s: Vec<f64>,
    /// Per op: seconds of `fwd_s` and `bwd_s` spent in the op's collectives (gathering its
    /// sharded weights, reduce-scattering its gradients), so compute can be told apart.
    pub fwd_coll_s: Vec<f64>,
    pub bwd_coll_s: Vec<f64>,
    /// Recomputed forwards.
    pub recompute_s: f64,
    /// Gradient buffers, norm and AdamW.
    pub optimizer_s: f64,
    /// Gradient synchronisation and the re-gather of zero1/zero2 parameters.
    pub sync_s: f64,
    pub step_s: f64,
    /// Every all-gather and reduce-scatter of a sharded weight or gradient inside the ops:
    /// (bytes of the full tensor, seconds), waiting for the other ranks included.
    pub collectives: Vec<(f64, f64)>,
}

impl Profile {
    /// Seconds of the collectives recorded after the first `from`.
    pub(super) fn collective_s_since(&self, from: usize) -> f64 {
        self.collectives
            .get(from..)
            .map_or(0.0, |c| c.iter().map(|x| x.1).sum())
    }
}

impl Executor {
    /// Time every op of the following steps (see [`Profile`]).
    pub fn enable_profiling(&mut self) {
        self.profile = Some(Profile::default());
    }

    /// Record what is held at the end of every forward pass (see [`ForwardMemory`]).
    pub fn enable_memory_trace(&mut self) {
        self.forward_memory = Some(ForwardMemory::default());
    }

    pub(super) fn trace_forward_memory(&mut self) {
        if self.forward_memory.is_none() {
            return;
        }
        let n = self.model.ops.len();
        let mut state_bytes = vec![0; n];
        let mut host_state_bytes = vec![0; n];
        for unit in &self.units {
            let master = unit.master.as_ref().map_or(0, nbytes);
            let grads = unit.grad.as_ref().map_or(0, nbytes);
            let moments = nbytes(&unit.m) + nbytes(&unit.v);
            let host_grad = unit.host_grad.as_ref().map_or(0, nbytes);
            let (device, host) = match unit.offload {
                Offload::None => (nbytes(&unit.data) + master + grads + moments, 0),
                Offload::Opt => (nbytes(&unit.data) + grads, master + moments + host_grad),
                Offload::Param => (grads, nbytes(&unit.data) + master + moments + host_grad),
            };
            state_bytes[unit.op] += device;
            host_state_bytes[unit.op] += host;
        }
        let kept_output_bytes = self
            .outs
            .iter()
            .map(|h| match h {
                Some(h) if h.cat == Category::Activations => nbytes(&h.t),
                _ => 0,
            })
            .collect();
        let kept_extra_bytes = self
            .extras
            .iter()
            .map(|e| e.iter().map(nbytes).sum())
            .collect();
        self.forward_memory = Some(ForwardMemory {
            ledger: self.ledger.now(),
            state_bytes,
            host_state_bytes,
            kept_output_bytes,
            kept_extra_bytes,
        });
    }

    /// A profiler clock reading. On a GPU kernels run after the host queues them, so while
    /// profiling it first waits for the device: the times are then the kernels', at the cost
    /// of a synchronisation per reading (a few µs).
    pub(super) fn clock(&self) -> Instant {
        if self.profile.is_some() {
            if let Device::Cuda(i) = self.device {
                tch::Cuda::synchronize(i as i64);
            }
        }
        Instant::now()
    }

    /// Seconds since `t0`, read as [`Executor::clock`] reads.
    pub(super) fn since(&self, t0: Instant) -> f64 {
        (self.clock() - t0).as_secs_f64()
    }

    /// How many collectives the profile holds (0 when not profiling).
    pub(super) fn collectives_so_far(&self) -> usize {
        self.profile.as_ref().map_or(0, |p| p.collectives.len())
    }

    pub(super) fn record_collective(&mut self, bytes: u64, t0: Instant) {
        if let Some(p) = self.profile.as_mut() {
            p.collectives
                .push((bytes as f64, t0.elapsed().as_secs_f64()));
        }
    }
}
