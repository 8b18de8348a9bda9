//! Memory as PyTorch's CUDA caching allocator reserves it, beyond the tensors live at the
//! peak: FSDP2 allocates its all-gather buffers on its all-gather copy-in stream and the
//! reduce-scatter's output (the sharded gradients are views of it) on its reduce-scatter
//! stream, and the allocator caches freed memory per stream: what those streams once held
//! stays reserved, beside the compute stream's peak, for the rest of the run.
//!
//! [`CachingPool`] replays one stream's allocations under the allocator's rules (read from
//! PyTorch's `CUDACachingAllocator.cpp`, default settings: no `max_split_size_mb`, no
//! expandable segments, under which each stream grows one segment instead; the side streams'
//! patterns here come out alike either way); [`fsdp2_side_pools`] replays FSDP2's two side
//! streams over two training steps, in the order `torch.distributed.fsdp` allocates (read from
//! `_fsdp_collectives.py` and `_fsdp_param_group.py` of late 2024: in the forward a unit's
//! all-gather output is freed after the next unit's all-gather is issued, in the backward
//! after its own copy-out; the reduce-scatter's output is kept as the sharded gradients until
//! `zero_grad`, its input is the compute stream's).

use std::collections::BTreeSet;

use crate::model::ModelSpec;

use crate::model::OpSpec;

use super::graph::in_last_block;
use super::{owns_params, Machine, Target};

/// Requests round up to this (`kMinBlockSize`).
const MIN_BLOCK: u64 = 512;
/// Requests up to this come from the small pool (`kSmallSize`).
const SMALL_SIZE: u64 = 1 << 20;
/// A small pool's segment (`kSmallBuffer`).
const SMALL_SEGMENT: u64 = 2 << 20;
/// Requests under this (and over [`SMALL_SIZE`]) get a segment of [`MID_SEGMENT`]
/// (`kMinLargeAlloc`).
const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// `kLargeBuffer`.
const MID_SEGMENT: u64 = 20 << 20;
/// Larger requests get a segment of their own size rounded up to this (`kRoundLarge`).
const ROUND_LARGE: u64 = 2 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    offset: u64,
    size: u64,
    free: bool,
}

#[derive(Debug, Clone)]
struct Segment {
    small: bool,
    blocks: Vec<Block>,
}

/// Handle to a live allocation: its segment and its offset there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    segment: usize,
    offset: u64,
}

/// One stream's share of the caching allocator: segments never returned (no `empty_cache`, no
/// out-of-memory retry), blocks split and merged as the allocator does.
#[derive(Debug, Clone, Default)]
pub struct CachingPool {
    segments: Vec<Segment>,
    /// Every free block, as the best fit searches them: (small pool, size, segment, offset).
    free: BTreeSet<(bool, u64, usize, u64)>,
    reserved: u64,
    peak_reserved: u64,
    allocated: u64,
}

impl CachingPool {
    /// Bytes the pool holds from the device now.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The most it ever held.
    pub fn peak_reserved(&self) -> u64 {
        self.peak_reserved
    }

    /// Bytes in live blocks now (requests rounded as the allocator rounds them).
    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    /// Allocate `bytes` (none for 0): the smallest cached free block that fits, split where
    /// the rest is worth keeping, or a new segment.
    pub fn alloc(&mut self, bytes: u64) -> Option<Allocation> {
        if bytes == 0 {
            return None;
        }
        let size = bytes.div_ceil(MIN_BLOCK) * MIN_BLOCK;
        let small = size <= SMALL_SIZE;
        // Best fit: the smallest free block of the right pool, the lowest address on ties.
        let fit = self
            .free
            .range((small, size, 0, 0)..)
            .next()
            .copied()
            .filter(|&(pool, ..)| pool == small);
        let (si, offset) = match fit {
            Some(key @ (_, _, si, offset)) => {
                self.free.remove(&key);
                (si, offset)
            }
            None => {
                let segment = if small {
                    SMALL_SEGMENT
                } else if size < MIN_LARGE_ALLOC {
                    MID_SEGMENT
                } else {
                    size.div_ceil(ROUND_LARGE) * ROUND_LARGE
                };
                self.segments.push(Segment {
                    small,
                    blocks: vec![Block {
                        offset: 0,
                        size: segment,
                        free: true,
                    }],
                });
                self.reserved += segment;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                (self.segments.len() - 1, 0)
            }
        };
        let blocks = &mut self.segments[si].blocks;
        let bi = blocks.partition_point(|b| b.offset < offset);
        let block = blocks[bi];
        let rest = block.size - size;
        // The allocator splits a small block when a minimal block remains, a large one only
        // when more than a small request's worth does.
        let split = if small {
            rest >= MIN_BLOCK
        } else {
            rest > SMALL_SIZE
        };
        if split {
            blocks[bi].size = size;
            blocks.insert(
                bi + 1,
                Block {
                    offset: offset + size,
                    size: rest,
                    free: true,
                },
            );
            self.free.insert((small, rest, si, offset + size));
        }
        blocks[bi].free = false;
        self.allocated += blocks[bi].size;
        Some(Allocation {
            segment: si,
            offset,
        })
    }

    /// Free an allocation: its block rejoins its free neighbours; the segment stays cached.
    pub fn free(&mut self, a: Option<Allocation>) {
        let Some(a) = a else { return };
        let segment = &mut self.segments[a.segment];
        let (small, blocks) = (segment.small, &mut segment.blocks);
        let i = blocks.partition_point(|b| b.offset < a.offset);
        if blocks.get(i).is_none_or(|b| b.offset != a.offset || b.free) {
            return;
        }
        blocks[i].free = true;
        self.allocated -= blocks[i].size;
        let key = |b: &Block| (small, b.size, a.segment, b.offset);
        if i + 1 < blocks.len() && blocks[i + 1].free {
            self.free.remove(&key(&blocks[i + 1]));
            blocks[i].size += blocks[i + 1].size;
            blocks.remove(i + 1);
        }
        let i = if i > 0 && blocks[i - 1].free {
            self.free.remove(&key(&blocks[i - 1]));
            blocks[i - 1].size += blocks[i].size;
            blocks.remove(i);
            i - 1
        } else {
            i
        };
        self.free.insert(key(&blocks[i]));
    }
}

/// One FSDP2 unit (a `fully_shard`ed module) as its side streams see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideUnit {
    /// Parameters it gathers and reduces.
    pub numel: u64,
    /// Whether its backward gathers it again (not a root FSDP2 kept unsharded).
    pub regathers: bool,
}

/// What FSDP2's side streams reserve at most, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SidePools {
    /// The all-gather copy-in stream: each unit's gathered buffer, in the parameter dtype.
    pub all_gather: u64,
    /// The reduce-scatter stream: each unit's sharded gradients, kept until `zero_grad`.
    pub reduce_scatter: u64,
    /// Of the reduce-scatter stream's bytes, the sharded gradients (fp32, one rank's share),
    /// which the cost model prices as held state already.
    pub sharded_grads: u64,
}

impl SidePools {
    /// What the side streams add to the compute stream's peak: all they reserve but the
    /// sharded gradients.
    pub fn extra(&self) -> u64 {
        (self.all_gather + self.reduce_scatter).saturating_sub(self.sharded_grads)
    }
}

/// Replay FSDP2's side streams over two steps: `units` in forward order, gathered in parameter
/// bytes `param_bytes`, reduced in `reduce_bytes` and sharded over `shards` ranks; the backward
/// visits them in reverse. Accumulated micro-batches repeat the same gathers and reduce once a
/// step, so they change nothing here: one micro-batch a step stands for any number.
pub fn fsdp2_side_pools(
    units: &[SideUnit],
    param_bytes: u64,
    reduce_bytes: u64,
    shards: u64,
) -> SidePools {
    let shards = shards.max(1);
    let (mut gather, mut reduce) = (CachingPool::default(), CachingPool::default());
    let sharded_grads = units
        .iter()
        .map(|u| u.numel.div_ceil(shards) * SHARDED_GRAD_BYTES)
        .sum();
    let mut kept: Vec<Option<Allocation>> = Vec::new();
    // One unit's all-gather on the copy-in stream: the parameter-dtype copy of this rank's
    // shards (the mixed-precision fast path's flat input), then the gathered output; the
    // input is freed once copied in.
    let gather_unit = |pool: &mut CachingPool, u: &SideUnit| {
        // Only where the gathered dtype is not the sharded parameter's fp32: otherwise the
        // shards are copied in as they are.
        let input = (param_bytes != SHARDED_GRAD_BYTES)
            .then(|| pool.alloc(u.numel.div_ceil(shards) * param_bytes))
            .flatten();
        let output = pool.alloc(u.numel * param_bytes);
        pool.free(input);
        output
    };
    for _step in 0..2 {
        // `zero_grad(set_to_none=True)` frees last step's sharded gradients.
        for g in kept.drain(..) {
            reduce.free(g);
        }
        // Forward: a unit's output is freed only after the next unit's all-gather is
        // issued (`AllGatherState`, "defer free to allow for overlap of this copy-out with
        // next all-gather"), so two are live at once.
        let mut held = None;
        for u in units {
            let next = gather_unit(&mut gather, u);
            gather.free(held);
            held = next;
        }
        gather.free(held);
        // Backward: each output is freed after its copy-out, before the next prefetch.
        for u in units.iter().rev().filter(|u| u.regathers) {
            let output = gather_unit(&mut gather, u);
            gather.free(output);
        }
        // The reduce-scatter's input (the unsharded gradient in the reduce dtype) is
        // allocated on the compute stream since PyTorch #129721 (June 2024), where the
        // cost model prices it as the op's transient; only the output, the sharded
        // gradients' storage, is the reduce-scatter stream's.
        for u in units.iter().rev() {
            let sharded = u.numel.div_ceil(shards);
            let output = reduce.alloc(sharded * reduce_bytes);
            // A reduce dtype other than the sharded parameter's fp32 is cast back.
            if reduce_bytes != SHARDED_GRAD_BYTES {
                kept.push(reduce.alloc(sharded * SHARDED_GRAD_BYTES));
                reduce.free(output);
            } else {
                kept.push(output);
            }
        }
    }
    SidePools {
        all_gather: gather.peak_reserved(),
        reduce_scatter: reduce.peak_reserved(),
        sharded_grads,
    }
}

/// What the caching allocator holds free beside the loss's peak where the executor upcasts the
/// logits and frees them before the backward (torchtitan: `cross_entropy(pred.float(), ...)`,
/// then `del pred`): replayed over two steps, the bf16 logits (`logits` bytes), their fp32
/// copy and the fp32 log-probabilities are allocated in the forward and the first two freed;
/// the backward's `copies` fp32 gradients then need segments of their own, while the logits'
/// segment stays cached and empty, too small for any of them. Under expandable segments (which
/// torchtitan's launchers set) the hole is the same or larger: the freed logits and upcast
/// merge into one block, with whatever was freed just below them, that a gradient splits. In a
/// steady state under fixed segments, other tensors of the step (AdamW's moments, created at
/// the first step, push activations into free blocks) may occupy part of the logits' segment,
/// and the hole may be smaller or, past the logits' size, larger: a review's simulation, not
/// measured.
pub fn loss_hole_bytes(logits: u64, fp32_logits: u64, copies: u32) -> u64 {
    let mut pool = CachingPool::default();
    // At the loss's live peak (the latest, on ties), what the pool holds free.
    let (mut peak, mut hole) = (0, 0);
    let mut note = |pool: &CachingPool| {
        if pool.allocated() >= peak {
            peak = pool.allocated();
            hole = pool.reserved() - pool.allocated();
        }
    };
    for _step in 0..2 {
        let pred = pool.alloc(logits);
        let upcast = pool.alloc(fp32_logits);
        let log_probs = pool.alloc(fp32_logits);
        note(&pool);
        pool.free(upcast);
        pool.free(pred);
        let grads: Vec<_> = (0..copies).map(|_| pool.alloc(fp32_logits)).collect();
        note(&pool);
        pool.free(log_probs);
        let grad = pool.alloc(logits);
        for g in grads {
            pool.free(g);
        }
        pool.free(grad);
    }
    hole
}

/// Bytes an element of FSDP2's sharded gradient takes: the sharded parameter's dtype, fp32 (a
/// mixed-precision policy casts only the gathered copy). Of the state the cost model prices at
/// 16 bytes a parameter, 4 are this gradient under FSDP2 (the rest: the fp32 parameter and
/// Adam's two moments), which [`SidePools::extra`] takes out of the reduce-scatter stream's
/// bytes.
pub const SHARDED_GRAD_BYTES: u64 = 4;
const _: () = assert!(
    super::Precision::MIXED_BF16.state_bytes_per_param() == 16
        && super::Precision::FP32.state_bytes_per_param() == 16
);

/// FSDP2's units for `model` on `m`, in forward order: one per block and a root of the rest
/// where a stack wraps so ([`Machine::fsdp2_block_units`]; the root first, gathered before the
/// first block, reduced after the last), else one per op that owns parameters (tied ones with
/// their owner), as `osdp_torch.apply_plan` wraps.
pub fn fsdp2_units(model: &ModelSpec, m: &Machine) -> Vec<SideUnit> {
    let layers = model.config.layers;
    let kept = |op: &OpSpec| m.fsdp2_keeps_gathered(op.block.is_none(), in_last_block(op, layers));
    let owned = |op: &OpSpec| {
        if owns_params(op) {
            ModelSpec::op_param_count(op)
        } else {
            0
        }
    };
    if !m.fsdp2_block_units {
        return model
            .ops
            .iter()
            .filter(|op| owned(op) > 0)
            .map(|op| SideUnit {
                numel: owned(op),
                regathers: !kept(op),
            })
            .collect();
    }
    // The root (the ops outside the blocks) leads the forward, so the backward's reverse order
    // reduces it last, as FSDP2's final callback does; a unit regathers unless its ops are
    // kept gathered.
    let mut units = vec![
        SideUnit {
            numel: 0,
            regathers: true
        };
        layers as usize + 1
    ];
    for op in &model.ops {
        let u = &mut units[op.block.map_or(0, |b| b as usize + 1).min(layers as usize)];
        u.numel += owned(op);
        u.regathers &= !kept(op) || owned(op) == 0;
    }
    units.retain(|u| u.numel > 0);
    units
}

/// What FSDP2's side streams reserve beyond the compute stream's peak, for `model` on `m`; 0
/// unless FSDP2 runs the plan on devices whose collectives have streams of their own. Priced
/// whatever each op's choice: every unit gathers in the forward and reduces once a step,
/// whatever its strategy, and the sharded gradients are sized as zero3's (the finest shard);
/// the micro-batches repeat the same gathers, so their count changes nothing here.
pub fn side_pool_bytes(model: &ModelSpec, m: &Machine) -> u64 {
    if m.target != Target::Fsdp2 || !m.overlap {
        return 0;
    }
    let units = fsdp2_units(model, m);
    fsdp2_side_pools(
        &units,
        m.precision.param_bytes,
        m.reduce_bytes,
        u64::from(m.ranks),
    )
    .extra()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The allocator's size classes: a small request takes a 2 MiB segment, a mid-sized one a
    /// 20 MiB segment, a large one a segment of its own size rounded up to 2 MiB; a freed block
    /// is reused by the next request it fits (split where enough is left) and rejoins its free
    /// neighbours; nothing is ever given back.
    #[test]
    fn the_pool_caches_and_splits_as_pytorchs_allocator_does() {
        let mut pool = CachingPool::default();
        let small = pool.alloc(1000);
        assert_eq!(pool.reserved(), 2 * MIB);
        let mid = pool.alloc(3 * MIB);
        assert_eq!(pool.reserved(), 22 * MIB);
        // A second mid-sized request is carved from the same 20 MiB segment.
        let mid2 = pool.alloc(5 * MIB);
        assert_eq!(pool.reserved(), 22 * MIB);
        let large = pool.alloc(100 * MIB + 1);
        assert_eq!(pool.reserved(), 124 * MIB);
        pool.free(large);
        assert_eq!(pool.reserved(), 124 * MIB, "freed memory stays cached");
        // Two 40 MiB requests fit the freed 102 MiB block one after the other.
        let a = pool.alloc(40 * MIB);
        let b = pool.alloc(40 * MIB);
        assert_eq!(pool.reserved(), 124 * MIB);
        // With both freed the block is whole again and takes a 100 MiB request.
        pool.free(a);
        pool.free(b);
        let again = pool.alloc(100 * MIB);
        assert_eq!(pool.reserved(), 124 * MIB);
        // A request larger than any free block gets a segment of its own, however much is free.
        pool.free(again);
        pool.free(mid);
        pool.free(mid2);
        pool.free(small);
        pool.alloc(110 * MIB);
        assert_eq!(pool.reserved(), 234 * MIB);
        assert_eq!(pool.peak_reserved(), 234 * MIB);
        // Small requests never come from a large segment.
        let before = pool.reserved();
        pool.alloc(4096);
        assert_eq!(pool.reserved(), before);
        pool.alloc(MIB + 1);
        assert_eq!(
            pool.reserved(),
            before,
            "a 1 MiB request fits the cached mid segment"
        );
    }

    /// torchtitan's loss at 2 × 8,192 tokens of a 128,256-word vocabulary: with the backward's
    /// two fp32 gradients the peak leaves the bf16 logits' segment free; with one, the
    /// forward (logits, upcast and log-probabilities) is the peak and nothing is free.
    #[test]
    fn the_loss_leaves_the_logits_segment_free_at_its_peak() {
        let logits = 2 * 16_384 * 128_256;
        let round = |b: u64| b.div_ceil(2 * MIB) * 2 * MIB;
        assert_eq!(loss_hole_bytes(logits, 2 * logits, 2), round(logits));
        assert_eq!(loss_hole_bytes(logits, 2 * logits, 1), 0);
    }

    /// torchtitan's wrapping of Llama 3.1 8B on 8 GPUs: the root unit (embedding, final norm,
    /// head) is gathered first and reduced last. In the forward its gathered buffer is still
    /// live when block 0's is allocated, so the all-gather stream keeps both (and the root's
    /// flat copy-in buffer); the reduce-scatter stream keeps the sharded gradients and little
    /// else: about 2.7 GiB reserved beyond the sharded gradients.
    #[test]
    fn fsdp2s_side_streams_keep_the_root_units_buffers_reserved() {
        let root = SideUnit {
            numel: 2 * 128_256 * 4096 + 4096,
            regathers: false,
        };
        let block = SideUnit {
            numel: 218_112_000,
            regathers: true,
        };
        let units: Vec<SideUnit> = std::iter::once(root)
            .chain(std::iter::repeat_n(block, 32))
            .collect();
        let pools = fsdp2_side_pools(&units, 2, 4, 8);
        let round = |b: u64| b.div_ceil(2 * MIB) * 2 * MIB;
        assert_eq!(
            pools.all_gather,
            round(2 * root.numel.div_ceil(8)) + round(2 * root.numel) + round(2 * block.numel)
        );
        assert_eq!(
            pools.reduce_scatter,
            32 * round(4 * block.numel / 8) + round(4 * root.numel.div_ceil(8))
        );
        assert_eq!(
            pools.sharded_grads,
            4 * (32 * block.numel.div_ceil(8) + root.numel.div_ceil(8))
        );
        let gib = pools.extra() as f64 / (1u64 << 30) as f64;
        assert!((2.6..2.7).contains(&gib), "{gib}");
        // Gathered in fp32, the shards are copied in as they are: no flat copy-in buffer.
        assert_eq!(
            fsdp2_side_pools(&units, 4, 4, 8).all_gather,
            round(4 * root.numel) + round(4 * block.numel)
        );
        // One op a unit: the largest op's gathered buffer and its copy-in, the smaller op's
        // carved from what the copy-in's segment caches.
        let per_op = [
            SideUnit {
                numel: 128_256 * 4096,
                regathers: true,
            },
            SideUnit {
                numel: 4096 * 4096,
                regathers: true,
            },
        ];
        let pools = fsdp2_side_pools(&per_op, 2, 4, 8);
        assert_eq!(
            pools.all_gather,
            round(2 * per_op[0].numel.div_ceil(8)) + round(2 * per_op[0].numel)
        );
    }
}
