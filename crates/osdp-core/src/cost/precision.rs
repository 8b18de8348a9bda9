//! How training stores numbers: [`Precision`]'s bytes per parameter, gradient, optimizer state
//! and activation, and the per-parameter byte counts of state, the optimizer step and
//! offloaded state in host memory.

/// Parameter + gradient + optimizer bytes per parameter, in either precision: what the model
/// reader bounds sizes by and what an unsharded parameter costs.
pub const STATE_BYTES_PER_PARAM: u64 = Precision::FP32.state_bytes_per_param();
const _: () = assert!(Precision::MIXED_BF16.state_bytes_per_param() == STATE_BYTES_PER_PARAM);

/// How training stores numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    pub name: &'static str,
    /// The compute copy of a parameter.
    pub param_bytes: u64,
    pub grad_bytes: u64,
    /// fp32 master copy (mixed precision only) and Adam's two moments.
    pub optimizer_bytes: u64,
    /// One activation element.
    pub activation_bytes: u64,
}

impl Precision {
    /// bf16 compute, fp32 master weights and moments (GPUs).
    pub const MIXED_BF16: Precision = Precision {
        name: "bf16 mixed",
        param_bytes: 2,
        grad_bytes: 2,
        optimizer_bytes: 12,
        activation_bytes: 2,
    };
    /// Everything in fp32 (the trainer's default on CPUs).
    pub const FP32: Precision = Precision {
        name: "fp32",
        param_bytes: 4,
        grad_bytes: 4,
        optimizer_bytes: 8,
        activation_bytes: 4,
    };

    /// Compute copy, gradient and optimizer state of one parameter.
    pub const fn state_bytes_per_param(&self) -> u64 {
        self.param_bytes + self.grad_bytes + self.optimizer_bytes
    }
}
/// AdamW step traffic per updated parameter: read master, m, v (fp32) and the bf16 grad; write
/// master, m, v and the bf16 copy.
pub const OPTIMIZER_BYTES_PER_PARAM: u64 = 28;

/// What the Hugging Face Trainer without DeepSpeed (transformers 4.x, `--fp16`) runs once a
/// step per fp32 parameter, each a PyTorch op of its own: the AMP grad scaler's unscale and
/// overflow check, gradient clipping (a norm, then a scale), transformers' `AdamW` (a Python
/// loop: the two moments, the denominator, the update) and zeroing the gradients. Counted by
/// `scripts/eager-passes.py`.
pub const HF_TRAINER_STEP_BYTES_PER_PARAM: u64 = 100;

/// Host bytes per parameter an offloaded optimizer keeps for every parameter it updates: an
/// fp32 master copy, Adam's two fp32 moments and the fp32 gradient the device's is copied into
/// (ZeRO-Offload's accounting; on the fp32 CPU trainer the master copy is the host's own
/// copy of the weights).
pub const HOST_STATE_BYTES_PER_PARAM: u64 = 16;
