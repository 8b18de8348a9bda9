//! The parameters read back out of the executor: this rank's regions for a checkpoint, and
//! every parameter's full value (gathered and reassembled) for tests and equivalence checks.

use tch::{Device, Kind, Tensor};

use super::{Executor, Result};
use crate::checkpoint::{RegionKey, Saved};
use osdp_core::cost::Holding;

impl Executor {
    /// This rank's part of a checkpoint: `(key, tensor)` pairs whose keys say which region of
    /// which parameter they hold (see `checkpoint`).
    pub fn checkpoint_tensors(&self) -> Vec<(String, Tensor)> {
        let rank = self.comm.rank();
        let first_node = self.first_node();
        let mut out = Vec::new();
        for unit in &self.units {
            // The fp32 values this rank updates: the master in mixed precision. Replicated
            // units are written by rank 0, hsdp's shards by the first node.
            let (flat_start, len, data, m, v) = match (unit.class, &unit.master) {
                (Holding::Replicated, _) if rank != 0 => continue,
                (Holding::Hybrid, _) if !first_node => continue,
                (Holding::Replicated, master) => (
                    0,
                    unit.numel,
                    master.as_ref().unwrap_or(&unit.data).reshape([-1]),
                    unit.m.reshape([-1]),
                    unit.v.reshape([-1]),
                ),
                (Holding::Zero1 | Holding::Zero2, None) => {
                    let (s, l) = unit.region;
                    (
                        s,
                        l,
                        unit.data.reshape([-1]).narrow(0, s, l),
                        unit.m.narrow(0, 0, l),
                        unit.v.narrow(0, 0, l),
                    )
                }
                (_, master) => {
                    let (s, l) = unit.region;
                    (
                        s,
                        l,
                        master.as_ref().unwrap_or(&unit.data).narrow(0, 0, l),
                        unit.m.narrow(0, 0, l),
                        unit.v.narrow(0, 0, l),
                    )
                }
            };
            if len == 0 {
                continue;
            }
            for (saved, t) in Saved::ALL.into_iter().zip([data, m, v]) {
                let key = RegionKey {
                    param: unit.key.clone(),
                    saved,
                    cols: unit.cols,
                    flat: (flat_start, len),
                };
                out.push((key.to_string(), t.to_device(Device::Cpu).contiguous()));
            }
        }
        out
    }

    /// The full value of every parameter by `op.param` (gathered and reassembled from column
    /// slices; for tests and equivalence checks). Every rank must call it.
    pub fn full_params(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Vec<Tensor>)> = Vec::new();
        for u in 0..self.units.len() {
            let w = self.weight(u)?;
            let copy = w.to_device(Device::Cpu).to_kind(Kind::Float).copy();
            self.release(u, w);
            let key = &self.units[u].key;
            match out.last_mut() {
                Some((k, parts)) if k == key => parts.push(copy),
                _ => out.push((key.clone(), vec![copy])),
            }
        }
        Ok(out
            .into_iter()
            .map(|(k, parts)| {
                let full = if parts.len() == 1 {
                    parts
                        .into_iter()
                        .next()
                        .unwrap_or_else(|| Tensor::zeros([0], (Kind::Float, Device::Cpu)))
                } else {
                    Tensor::cat(&parts, 1)
                };
                (k, full)
            })
            .collect())
    }
}
