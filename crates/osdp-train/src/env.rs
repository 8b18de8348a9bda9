//! Every environment variable the trainer reads, in one place: a constant per variable (its
//! name, documented with its meaning) and the function that reads it. Nothing else in the
//! crate calls `std::env::var`.
//!
//! The launcher's variables (torchrun's, Slurm's, the join's own) are read by
//! [`Membership::from_env`](crate::tcp::Membership::from_env) through [`launcher_var`], by
//! their constants here; `Membership::from_vars` documents their defaults and precedence.

// The launcher: who this process is and where rank 0 listens. torchrun's names come first,
// Slurm's are the fallback (`srun osdp-tui train …`).

/// torchrun: the number of ranks in the run. Its presence makes this process one rank of a
/// multi-process run.
pub(crate) const WORLD_SIZE: &str = "WORLD_SIZE";
/// Slurm: the number of tasks, read when `WORLD_SIZE` is not set.
pub(crate) const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// torchrun: this process's rank, `0..WORLD_SIZE`.
pub(crate) const RANK: &str = "RANK";
/// Slurm: this task's rank, read when `RANK` is not set.
pub(crate) const SLURM_PROCID: &str = "SLURM_PROCID";
/// The address rank 0 listens on (and binds: nowhere else); default 127.0.0.1.
pub(crate) const MASTER_ADDR: &str = "MASTER_ADDR";
/// The port rank 0 listens on; default 29500 (the next one under torchrun).
pub(crate) const MASTER_PORT: &str = "MASTER_PORT";
/// Set by torchrun, whose own store already listens on `MASTER_PORT`: the group then uses the
/// next port.
pub(crate) const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// The port of the join, overriding `MASTER_PORT` (and torchrun's next port).
pub(crate) const OSDP_PORT: &str = "OSDP_PORT";
/// Seconds every rank waits for the others to join; default 120, at most a day.
pub(crate) const OSDP_JOIN_TIMEOUT_S: &str = "OSDP_JOIN_TIMEOUT_S";
/// Seconds any collective waits for a peer that sends nothing, not even the heartbeat every
/// live rank sends; default 300, at most a day.
pub(crate) const OSDP_COLLECTIVE_TIMEOUT_S: &str = "OSDP_COLLECTIVE_TIMEOUT_S";
/// The secret every rank of a run holds, the key of the join's seals; required for ranks as
/// processes. The name is the core's, which the app sets for the workers it starts.
pub(crate) const OSDP_RUN_TOKEN: &str = osdp_core::protocol::RUN_TOKEN_VAR;

/// The value of launcher variable `name` (one of the above); `None` when it is not set or not
/// valid Unicode.
pub(crate) fn launcher_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// torchrun: the number of ranks on this machine.
pub(crate) const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Slurm: the number of tasks on this node, read when `LOCAL_WORLD_SIZE` is not set.
pub(crate) const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
/// torchrun: this process's rank among those on its machine (its GPU, one per rank).
pub(crate) const LOCAL_RANK: &str = "LOCAL_RANK";
/// Slurm: this task's rank on its node, read when `LOCAL_RANK` is not set.
pub(crate) const SLURM_LOCALID: &str = "SLURM_LOCALID";

/// How many ranks run on this machine (and share its cores; a node for hsdp):
/// `LOCAL_WORLD_SIZE`, else `SLURM_NTASKS_PER_NODE`; `None` when neither is set or the one set
/// is not a number.
pub fn local_ranks() -> Option<usize> {
    std::env::var(LOCAL_WORLD_SIZE)
        .or_else(|_| std::env::var(SLURM_NTASKS_PER_NODE))
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
}

/// This process's rank on its machine: `LOCAL_RANK`, else `SLURM_LOCALID`; 0 when neither is
/// set or the one set is not a number.
pub fn local_rank() -> usize {
    std::env::var(LOCAL_RANK)
        .or_else(|_| std::env::var(SLURM_LOCALID))
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0)
}

// glibc's own allocator tunables: one the user set is left alone (see `keep_freed_memory`).

/// glibc: the size from which allocations are `mmap`ed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const MALLOC_MMAP_THRESHOLD: &str = "MALLOC_MMAP_THRESHOLD_";
/// glibc: how much freed memory at the heap's top is kept rather than handed back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const MALLOC_TRIM_THRESHOLD: &str = "MALLOC_TRIM_THRESHOLD_";
/// glibc: how much the heap grows ahead of need.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) const MALLOC_TOP_PAD: &str = "MALLOC_TOP_PAD_";

/// Whether glibc tunable `name` (one of the above) is set, to any value.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn malloc_tunable_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

// The GPU trainer (feature `cuda`).

/// The GPUs the CUDA runtime lets this process see; only quoted when it sees none.
#[cfg(feature = "cuda")]
pub(crate) const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// PyTorch's CUDA caching allocator settings, read by libtorch when it first allocates on a GPU.
pub(crate) const PYTORCH_CUDA_ALLOC_CONF: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// What the trainer sets `PYTORCH_CUDA_ALLOC_CONF` to when the user has not: segments that
/// grow instead of new fixed-size blocks. On the H200 of 2026-11-28 tinyllama-1.1b's reserved
/// peak fell from 55.1 to 52.1 GiB (allocated 50.9) at the same step time (docs/fidelity.md).
pub(crate) const CUDA_ALLOC_DEFAULT: &str = "expandable_segments:True";

/// PyTorch 2.x's device-generic name for the allocator settings, which the CUDA allocator
/// also reads.
pub(crate) const PYTORCH_ALLOC_CONF: &str = "PYTORCH_ALLOC_CONF";

/// Whether the user set the allocator's settings under either name, to any value.
pub(crate) fn cuda_alloc_conf_set() -> bool {
    std::env::var_os(PYTORCH_CUDA_ALLOC_CONF).is_some()
        || std::env::var_os(PYTORCH_ALLOC_CONF).is_some()
}

/// `0` turns off the zero rows the trainer pads an unaligned 16-bit linear's weight with on a
/// GPU ([`crate::ops::gemm_rows`]): for measuring what the padding saves. Any other value, or
/// none, leaves it on. With feature `fault-injection`, `everywhere` pads on every device and in
/// every precision, so tests run the padded path on a CPU.
pub(crate) const OSDP_GEMM_PADDING: &str = "OSDP_GEMM_PADDING";

/// Where the trainer pads unaligned weights, as `OSDP_GEMM_PADDING` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmPadding {
    Off,
    /// 16-bit weights on a GPU: the default.
    Gpu,
    /// Every weight on every device (test hook, feature `fault-injection`).
    Everywhere,
}

/// `OSDP_GEMM_PADDING`, read once (every linear asks).
pub(crate) fn gemm_padding() -> GemmPadding {
    static ON: std::sync::OnceLock<GemmPadding> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match std::env::var(OSDP_GEMM_PADDING).as_deref().map(str::trim) {
            Ok("0") => GemmPadding::Off,
            Ok("everywhere") if cfg!(feature = "fault-injection") => GemmPadding::Everywhere,
            Ok("" | "1") | Err(_) => GemmPadding::Gpu,
            Ok(other) => {
                let why = if other == "everywhere" {
                    "is a test hook of builds with feature fault-injection"
                } else {
                    "is not 0"
                };
                eprintln!(
                    "warning: {OSDP_GEMM_PADDING}={} {why}: unaligned 16-bit weights stay \
                     padded on GPUs only (0 turns it off)",
                    osdp_core::text::printable(other)
                );
                GemmPadding::Gpu
            }
        },
    )
}

/// `CUDA_VISIBLE_DEVICES`, when set (and valid Unicode).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_visible_devices() -> Option<String> {
    std::env::var(CUDA_VISIBLE_DEVICES).ok()
}

/// The NCCL library to open, by path, instead of searching for `libnccl.so.2`.
#[cfg(feature = "cuda")]
pub(crate) const OSDP_NCCL_LIB: &str = "OSDP_NCCL_LIB";

/// `OSDP_NCCL_LIB`, when set.
#[cfg(feature = "cuda")]
pub(crate) fn nccl_lib() -> Option<std::ffi::OsString> {
    std::env::var_os(OSDP_NCCL_LIB)
}

/// The dynamic loader's search path, searched for NCCL.
#[cfg(feature = "cuda")]
pub(crate) const LD_LIBRARY_PATH: &str = "LD_LIBRARY_PATH";

/// The directories of `LD_LIBRARY_PATH`, in order (none when it is not set).
#[cfg(feature = "cuda")]
pub(crate) fn library_path() -> Vec<std::path::PathBuf> {
    std::env::var_os(LD_LIBRARY_PATH)
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// Read when the crate is compiled, not when it runs: `OSDP_TORCH_LIB_DIR`, the directory of
/// the libtorch this program was built against (build.rs sets it), searched for NCCL.
#[cfg(feature = "cuda")]
pub(crate) const BUILT_TORCH_LIB_DIR: Option<&str> = option_env!("OSDP_TORCH_LIB_DIR");

// Test hooks (feature `fault-injection`, never in a release build).

/// A fault to inject, for tests: `kill-mid-checkpoint` ends the process after the rank files
/// of a checkpoint are written and before it is committed, as a crash or `kill -9` would.
#[cfg(feature = "fault-injection")]
pub(crate) const OSDP_FAULT: &str = "OSDP_FAULT";

/// `OSDP_FAULT`, when set (and valid Unicode).
#[cfg(feature = "fault-injection")]
pub(crate) fn fault() -> Option<String> {
    std::env::var(OSDP_FAULT).ok()
}
