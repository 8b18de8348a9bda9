//! The collectives inside the ops: a unit's full weight gathered for compute (ZeRO-3, hsdp;
//! fetched from host memory first when offloaded) and released after, and each use's gradient
//! added to the unit's buffer, reduce-scattered to this rank's shard where gradients are
//! sharded.

use std::time::Instant;

use tch::{Kind, Tensor};

use super::{nbytes, pad_flat, Executor, Result, HOST};
use crate::collective::Collective;
use crate::memory::Category;
use osdp_core::cost::{Holding, Offload};

impl Executor {
    /// The ranks a unit held as `class` is sharded among: hsdp's node, else all of them.
    pub(super) fn sharding(&self, class: Holding) -> &dyn Collective {
        match (class, self.comm.nodes()) {
            (Holding::Hybrid, Some(n)) => n.shard.as_ref(),
            _ => self.comm.as_ref(),
        }
    }

    /// Whether this rank writes and counts the shards of hsdp units: those of the first node
    /// (the other nodes hold copies).
    pub(super) fn first_node(&self) -> bool {
        self.comm.nodes().is_none_or(|n| n.node() == 0)
    }

    /// The full weight of a unit for compute: gathered (and counted) for ZeRO-3 and hsdp.
    pub(super) fn weight(&mut self, u: usize) -> Result<Tensor> {
        // What a recomputation gathered and kept for this backward: no fetch, no new bytes.
        if let Some(w) = self.kept.remove(&u) {
            return Ok(w);
        }
        let class = self.units[u].class;
        // An offloaded compute copy is fetched from host memory first (this rank's part).
        let fetched = (self.units[u].offload == Offload::Param).then(|| {
            let data = &self.units[u].data;
            match self.device {
                HOST => data.copy(),
                d => data.to_device(d),
            }
        });
        if let Some(f) = &fetched {
            self.ledger.add(Category::Gathered, nbytes(f));
        }
        let unit = &self.units[u];
        if !matches!(class, Holding::Zero3 | Holding::Hybrid) {
            return Ok(fetched.unwrap_or_else(|| unit.data.shallow_clone()));
        }
        let t0 = Instant::now();
        let full = self
            .sharding(class)
            .all_gather(fetched.as_ref().unwrap_or(&unit.data))?;
        let w = full.narrow(0, 0, unit.numel).reshape(unit.shape.as_slice());
        self.record_collective(nbytes(&full), t0);
        self.ledger.add(Category::Gathered, nbytes(&full));
        if let Some(f) = fetched {
            self.ledger.sub(Category::Gathered, nbytes(&f));
        }
        Ok(w)
    }

    /// Op `i`'s forward is done with unit `u`'s weight: released, or kept for its backward
    /// while its block is recomputed and it is an op that keeps its weight (its first
    /// parameter; a bias, which the backward does not read, is released).
    pub(super) fn done_with(&mut self, i: usize, u: usize, w: Tensor) {
        if self.keeping && self.flow.keeps_gathered[i] && self.uses[i][0].contains(&u) {
            self.kept.insert(u, w);
        } else {
            self.release(u, w);
        }
    }

    /// Release what a recomputation kept and no backward took.
    pub(super) fn release_kept(&mut self) {
        for (u, w) in std::mem::take(&mut self.kept) {
            self.release(u, w);
        }
    }

    pub(super) fn release(&mut self, u: usize, w: Tensor) {
        let class = self.units[u].class;
        let fetched = self.units[u].offload == Offload::Param;
        if fetched && !matches!(class, Holding::Zero3 | Holding::Hybrid) {
            self.ledger.sub(Category::Gathered, nbytes(&w));
        }
        if matches!(class, Holding::Zero3 | Holding::Hybrid) {
            let padded = self.units[u].shard_len * self.sharding(class).world() as i64;
            self.ledger.sub(
                Category::Gathered,
                padded as u64 * w.kind().elt_size_in_bytes() as u64,
            );
        }
        drop(w);
    }

    /// Add one use's gradient to a unit: kept whole (dp, zero1) or reduce-scattered now (over
    /// the node for hsdp).
    pub(super) fn add_param_grad(&mut self, u: usize, g: Tensor) -> Result<()> {
        let (class, shard_len) = (self.units[u].class, self.units[u].shard_len);
        let g = g.to_kind(self.kind);
        let contribution = match class {
            Holding::Replicated | Holding::Zero1 => g,
            Holding::Zero2 | Holding::Zero3 | Holding::Hybrid => {
                let padded = pad_flat(&g, shard_len * self.sharding(class).world() as i64);
                let bytes = nbytes(&padded);
                self.ledger.add(Category::GradBuffers, bytes);
                let t0 = Instant::now();
                let shard = self.sharding(class).reduce_scatter(&padded)?;
                self.record_collective(bytes, t0);
                drop(padded);
                self.ledger.sub(Category::GradBuffers, bytes);
                shard
            }
        };
        let unit = &mut self.units[u];
        if !unit.offload.is_none() && class.streams_grads() {
            // Offloaded: the shard leaves for the host buffer now.
            if let Some(h) = &mut unit.host_grad {
                *h += contribution
                    .to_kind(Kind::Float)
                    .to_device(HOST)
                    .reshape([-1]);
            }
        } else if let Some(acc) = &mut unit.grad {
            *acc += contribution;
        }
        Ok(())
    }

    /// Zeroed gradient buffers for the step, held from its start as DDP's buckets and ZeRO's
    /// gradient partitions are: full for dp and zero1, this rank's padded shard otherwise.
    pub(super) fn allocate_grads(&mut self) {
        for unit in &mut self.units {
            if !unit.offload.is_none() && unit.class.streams_grads() {
                continue;
            }
            let shape = match unit.class {
                Holding::Replicated | Holding::Zero1 => unit.shape.clone(),
                Holding::Zero2 | Holding::Zero3 | Holding::Hybrid => vec![unit.shard_len],
            };
            let g = Tensor::zeros(shape.as_slice(), (self.kind, self.device));
            self.ledger.add(Category::Grads, nbytes(&g));
            unit.grad = Some(g);
        }
    }
}
