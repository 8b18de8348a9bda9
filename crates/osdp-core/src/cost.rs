//! The cost model: memory and time of one operator under one sharding strategy, at micro-batch
//! `b` on a layout of `N` ranks. Pure arithmetic: no GPU, no I/O.
//!
//! Accounting: on GPUs mixed precision — bf16 parameters and gradients (2 + 2 bytes), fp32
//! master weights and Adam moments (12 bytes), the ZeRO paper's 16 bytes per parameter; on
//! CPUs, where the trainer runs in fp32, parameters and gradients take 4 + 4 and Adam's moments
//! 8 (no separate master copy): the same 16 bytes, split differently, and activations twice the
//! bf16 size. [`Precision`] holds the split.
//! Collectives follow the ring α–β model; communication overlaps the op's own compute on a
//! separate stream and only the excess is exposed.
//!
//! By concern: `precision` (bytes per parameter and activation), `strategy` (what a way of
//! running an op is: [`Strategy`], [`Offload`], [`Choice`], the [`Unit`]s it holds parameters
//! as, the [`choices`] offered), `machine` (a layout's rates: [`Machine`], [`Efficiencies`],
//! kernel and collective times), `graph` (what the model says of each op: [`OpBase`],
//! [`OpGraph`]), `pools` (what the caching allocator reserves beside the compute stream's
//! peak: FSDP2's side streams, [`side_pool_bytes`]), `price` (what an op costs under a choice: [`price()`], [`OpCost`]) and `target` (what
//! runs the plan, [`Target`]: the choices it can express and how it runs them).

mod graph;
mod machine;
mod pools;
mod precision;
mod price;
mod strategy;
mod target;

#[cfg(test)]
mod fixtures;

pub use graph::{
    ends_block_params, input_bytes_per_sample, kernel_key, op_bases, op_work, owns_params,
    parameter_uses, set_accumulation, EagerRotary, OpBase, OpGraph, Owned, ParamTensor,
    EAGER_ATTENTION_AUTOCAST_PASSES, EAGER_ATTENTION_PASSES, EAGER_COMPLEX_ROTARY_PASSES,
    EAGER_GELU_FAST_PASSES, EAGER_GELU_NEW_AUTOCAST_PASSES, EAGER_GELU_NEW_PASSES,
    EAGER_HALVES_ROTARY_PASSES, EAGER_PAIR_MATRIX_ROTARY_PASSES, EAGER_RMS_NORM_PASSES,
    EAGER_ROTARY_PASSES,
};
pub use machine::{
    gemm_aligned, padded_gemm_rows, padded_weight_rows, param_pass_bytes, Efficiencies, Machine,
    Zero1Groups, ATTENTION_BWD_FACTOR, DS_2021_GATHER_HOST_RANKS, DS_2021_GATHER_HOST_S,
    ELEMENTWISE_BWD_FACTOR, FLASH_ATTENTION_1_EXTRA_RATE, HOPPER_SDPA_CUDNN_RATES,
    HOPPER_SDPA_FLASH_RATES, LINEAR_BWD_FACTOR, MATMUL_EFFICIENCY, MEMORY_EFFICIENCY,
    NCCL_BASE_LATENCY_S, PARAM_PASS_BYTES,
};
pub use pools::{
    fsdp2_side_pools, fsdp2_units, side_pool_bytes, CachingPool, SidePools, SideUnit,
    SHARDED_GRAD_BYTES,
};
pub use precision::{
    Precision, HF_TRAINER_STEP_BYTES_PER_PARAM, HOST_STATE_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM,
};
pub use price::{price, OpCost};
pub use strategy::{
    choices, cut_by_split, offload_applies, Choice, Colour, Holding, Needs, Offload, Placed,
    Strategy, StrategyInfo, Unit,
};
pub use target::Target;
