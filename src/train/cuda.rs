//! GPU ranks (cargo feature `cuda`): one process per GPU, collectives over NCCL on the tensors
//! libtorch allocates.
//!
//! - NCCL comes through `cudarc` with dynamic loading, so the crate builds on machines without
//!   CUDA and a missing library is a message, not a panic: every entry point checks
//!   `is_culib_present()` first.
//! - Collectives run on the device's legacy default stream, the stream libtorch's kernels use:
//!   they are ordered after the kernels that produced their inputs and before the kernels that
//!   read their outputs without any extra synchronisation.
//! - Rank 0 creates the NCCL unique id and shares it over the TCP group of [`super::tcp`]
//!   (`MASTER_ADDR:MASTER_PORT`), which also gives the join timeout with a message naming the
//!   missing ranks. The TCP connections stay open as a watchdog: when another rank's process
//!   dies its connection closes, and this rank aborts the NCCL communicator instead of waiting
//!   in a collective forever.

use std::ffi::CStr;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use cudarc::nccl::sys as nccl;
use tch::{Device, Kind, Tensor};

use super::collective::{Aborted, Collective};
use super::tcp::{Membership, TcpGroup};

/// The library name cudarc's loader asks for; pip's `nvidia-nccl` wheels ship only the
/// versioned `libnccl.so.2`.
const NCCL_SONAME: &str = "libnccl.so.2";
const REEXEC_GUARD: &str = "OSDP_NCCL_REEXEC";

/// Checks that this process can compute on GPU `local_rank` with NCCL, and returns its device.
/// Fails with a message saying what is missing and what to do.
pub fn preflight(local_rank: usize) -> Result<Device, String> {
    if !tch::Cuda::is_available() {
        return Err(
            "--device cuda: no CUDA device is usable here (libtorch sees none: no NVIDIA \
                    driver, no GPU, or a CPU-only libtorch); train on the CPU with --device cpu"
                .into(),
        );
    }
    let count = tch::Cuda::device_count() as usize;
    if local_rank >= count {
        return Err(format!(
            "--device cuda: LOCAL_RANK {local_rank} but this machine has {count} GPU(s); start \
             at most one rank per GPU"
        ));
    }
    // SAFETY: only tries to open the shared libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "--device cuda: libtorch sees a GPU but libcuda.so (the driver API) cannot \
                    be opened"
                .into(),
        );
    }
    ensure_nccl_loadable()?;
    Ok(Device::Cuda(local_rank))
}

/// cudarc opens `libnccl.so`; where only `libnccl.so.2` exists (pip's NCCL, next to libtorch),
/// link it under the name cudarc asks for in a private directory and run this program again
/// with that directory on `LD_LIBRARY_PATH` (the loader reads the variable only at start-up).
fn ensure_nccl_loadable() -> Result<(), String> {
    // SAFETY: only tries to open the shared library.
    if unsafe { nccl::is_culib_present() } {
        return Ok(());
    }
    let hint = "install NCCL (pip install nvidia-nccl-cu13, or the distribution's libnccl2) or \
                name the library with OSDP_NCCL_LIB=/path/to/libnccl.so.2";
    if std::env::var_os(REEXEC_GUARD).is_some() {
        return Err(format!(
            "--device cuda: NCCL still cannot be loaded after linking libnccl.so; {hint}"
        ));
    }
    let found = find_nccl().ok_or_else(|| {
        format!("--device cuda: NCCL not found (looked for libnccl.so and {NCCL_SONAME}); {hint}")
    })?;
    let dir = std::env::temp_dir().join(format!("osdp-tui-nccl-{}", unsafe { libc::getuid() }));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&found, &link)
        .map_err(|e| format!("cannot link {}: {e}", link.display()))?;
    let mut path = std::ffi::OsString::from(&dir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let err = std::os::unix::process::CommandExt::exec(
        std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", path)
            .env(REEXEC_GUARD, "1"),
    );
    Err(format!(
        "cannot restart with NCCL on the library path: {err}"
    ))
}

/// `OSDP_NCCL_LIB`, else `libnccl.so.2` in a directory of `LD_LIBRARY_PATH` or of the libtorch
/// this program was built against, or in the `nvidia/nccl/lib` beside such a libtorch.
fn find_nccl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("OSDP_NCCL_LIB") {
        return Some(PathBuf::from(p)).filter(|p| p.exists());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    if let Some(built) = option_env!("OSDP_TORCH_LIB_DIR") {
        dirs.push(PathBuf::from(built));
    }
    dirs.iter()
        .flat_map(|d| {
            [
                d.join(NCCL_SONAME),
                d.join("../../nvidia/nccl/lib").join(NCCL_SONAME),
            ]
        })
        .find(|p| p.exists())
}

fn dtype(kind: Kind) -> Result<nccl::ncclDataType_t, Aborted> {
    Ok(match kind {
        Kind::Float => nccl::ncclDataType_t::ncclFloat32,
        Kind::BFloat16 => nccl::ncclDataType_t::ncclBfloat16,
        Kind::Half => nccl::ncclDataType_t::ncclFloat16,
        Kind::Double => nccl::ncclDataType_t::ncclFloat64,
        Kind::Int64 => nccl::ncclDataType_t::ncclInt64,
        other => {
            return Err(Aborted(format!(
                "NCCL: no collective for {other:?} tensors"
            )))
        }
    })
}

fn check(what: &str, r: nccl::ncclResult_t) -> Result<(), Aborted> {
    if r == nccl::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe {
        let p = nccl::ncclGetErrorString(r);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(Aborted(format!("NCCL {what} failed: {text} ({r:?})")))
}

/// A communicator handle that may be aborted from the watchdog thread.
struct Comm {
    raw: nccl::ncclComm_t,
    aborted: AtomicBool,
    why: Mutex<String>,
}

// SAFETY: an NCCL communicator may be used from any thread; calls are serialised by the rank
// (one thread per process issues collectives) and abort is the documented cross-thread call.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    fn abort(&self, why: &str) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(mut w) = self.why.lock() {
            *w = why.to_string();
        }
        // SAFETY: ncclCommAbort unblocks collectives in flight on another thread.
        unsafe {
            nccl::ncclCommAbort(self.raw());
        }
    }

    fn raw(&self) -> nccl::ncclComm_t {
        self.raw
    }

    fn aborted(&self) -> Option<Aborted> {
        self.aborted.load(Ordering::SeqCst).then(|| {
            Aborted(format!(
                "collective aborted: {}",
                self.why.lock().map(|w| w.clone()).unwrap_or_default()
            ))
        })
    }
}

/// One GPU rank's handle on the NCCL group.
pub struct NcclGroup {
    rank: usize,
    world: usize,
    device: Device,
    ctx: Arc<CudaContext>,
    comm: Arc<Comm>,
    /// Streams to the other processes, kept for the watchdog and the orderly goodbye.
    links: Vec<TcpStream>,
}

/// Sent on a clean exit so the watchdog on the other end does not abort a finished run.
const GOODBYE: u8 = 0xB7;

impl NcclGroup {
    /// Join the group on `device`: TCP rendezvous (with its join timeout), rank 0 creates the
    /// NCCL id and sends it, every rank initialises its communicator.
    pub fn join(m: &Membership, device: Device) -> Result<NcclGroup, String> {
        let Device::Cuda(ordinal) = device else {
            return Err("the NCCL group needs a CUDA device".into());
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e:?}"))?;
        let tcp = TcpGroup::join(m)?;
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        if m.rank == 0 {
            // SAFETY: writes the 128-byte id.
            check("ncclGetUniqueId", unsafe { nccl::ncclGetUniqueId(&mut id) }).map_err(|e| e.0)?;
        }
        let words: Vec<i64> = id
            .internal
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(std::array::from_fn(|i| c[i] as u8)))
            .collect();
        let shared = tcp
            .broadcast(&Tensor::from_slice(&words), 0)
            .map_err(|e| format!("sharing the NCCL id: {}", e.0))?;
        let words = Vec::<i64>::try_from(&shared).map_err(|e| e.to_string())?;
        for (i, w) in words.iter().enumerate().take(16) {
            for (j, b) in w.to_le_bytes().iter().enumerate() {
                id.internal[i * 8 + j] = *b as _;
            }
        }
        let mut raw: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: every rank calls this once with the same id; it blocks until all have.
        check("ncclCommInitRank", unsafe {
            nccl::ncclCommInitRank(&mut raw, m.world as i32, id, m.rank as i32)
        })
        .map_err(|e| e.0)?;
        let comm = Arc::new(Comm {
            raw,
            aborted: AtomicBool::new(false),
            why: Mutex::new(String::new()),
        });
        let links = tcp.into_streams();
        for link in &links {
            let Ok(mut watch) = link.try_clone() else {
                continue;
            };
            let comm = Arc::clone(&comm);
            std::thread::spawn(move || {
                let mut b = [0u8; 1];
                let why = match watch.read(&mut b) {
                    Ok(1) if b[0] == GOODBYE => return,
                    _ => "another rank's process ended during the run",
                };
                comm.abort(why);
            });
        }
        Ok(NcclGroup {
            rank: m.rank,
            world: m.world,
            device,
            ctx,
            comm,
            links,
        })
    }

    /// Run one NCCL call on a contiguous copy of `t` on this rank's GPU into a new tensor of
    /// `out_numel` elements; the result goes back to `t`'s device.
    fn call(
        &self,
        what: &str,
        t: &Tensor,
        out_numel: i64,
        f: impl FnOnce(
            *const std::ffi::c_void,
            *mut std::ffi::c_void,
            nccl::ncclDataType_t,
            nccl::ncclComm_t,
        ) -> nccl::ncclResult_t,
    ) -> Result<Tensor, Aborted> {
        if let Some(a) = self.comm.aborted() {
            return Err(a);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| Aborted(format!("binding the CUDA context: {e:?}")))?;
        let input = t.to_device(self.device).contiguous();
        let out = Tensor::empty([out_numel], (t.kind(), self.device));
        let dt = dtype(t.kind())?;
        check(
            what,
            f(input.data_ptr(), out.data_ptr(), dt, self.comm.raw()),
        )?;
        if let Some(a) = self.comm.aborted() {
            return Err(a);
        }
        Ok(out.to_device(t.device()))
    }
}

fn stream() -> nccl::cudaStream_t {
    // The legacy default stream: the one libtorch's kernels run on.
    std::ptr::null_mut()
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor, Aborted> {
        let n = shard.numel();
        self.call(
            "all-gather",
            shard,
            (n * self.world) as i64,
            |s, r, d, c| unsafe { nccl::ncclAllGather(s, r, n, d, c, stream()) },
        )
    }

    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let n = full.numel() / self.world;
        self.call("reduce-scatter", full, n as i64, |s, r, d, c| unsafe {
            nccl::ncclReduceScatter(s, r, n, d, nccl::ncclRedOp_t::ncclSum, c, stream())
        })
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let n = t.numel();
        let out = self.call("all-reduce", t, n as i64, |s, r, d, c| unsafe {
            nccl::ncclAllReduce(s, r, n, d, nccl::ncclRedOp_t::ncclSum, c, stream())
        })?;
        Ok(out.reshape(t.size()))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let n = t.numel();
        let out = self.call("broadcast", t, n as i64, |s, r, d, c| unsafe {
            nccl::ncclBroadcast(s, r, n, d, root as i32, c, stream())
        })?;
        Ok(out.reshape(t.size()))
    }

    fn barrier(&self) -> Result<(), Aborted> {
        let t = Tensor::zeros([1], (Kind::Float, self.device));
        let _ = self.all_reduce(&t)?;
        tch::Cuda::synchronize(match self.device {
            Device::Cuda(i) => i as i64,
            _ => 0,
        });
        Ok(())
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // A rank unwinding from a failure says nothing: the others' watchdogs then abort.
        let clean = !std::thread::panicking() && self.comm.aborted().is_none();
        for link in &mut self.links {
            if clean {
                let _ = link.write_all(&[GOODBYE]);
            }
        }
        if !self.comm.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: no collective is in flight once the rank's group is dropped.
            unsafe {
                nccl::ncclCommDestroy(self.comm.raw());
            }
        }
    }
}
