//! GPU ranks (cargo feature `cuda`): one process per GPU, collectives over NCCL on the tensors
//! libtorch allocates.
//!
//! - NCCL is opened by path at run time (pip's `libnccl.so.2` beside libtorch, or
//!   `OSDP_NCCL_LIB`), so the crate builds on machines without CUDA and a missing library is a
//!   message, not a panic. The driver comes through `cudarc`, checked with
//!   `is_culib_present()` before first use. A world of one never opens NCCL.
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
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nccl::sys as nccl;
use tch::{Device, Kind, Tensor};

use super::collective::{Aborted, Collective};
use super::tcp::{Membership, TcpGroup, Terms};

/// The library pip's `nvidia-nccl` wheels and the distributions ship.
const NCCL_SONAME: &str = "libnccl.so.2";

/// Checks that this process can compute on a GPU with NCCL, and returns its device: GPU
/// `local_rank`, or the one GPU visible when a launcher gives each process its own
/// (`CUDA_VISIBLE_DEVICES` per rank, where `LOCAL_RANK` counts GPUs this process cannot see).
/// Fails with a message saying what is missing and what to do.
pub fn preflight(local_rank: usize) -> Result<Device, String> {
    if !tch::Cuda::is_available() {
        return Err(no_cuda_reason());
    }
    let count = tch::Cuda::device_count() as usize;
    let ordinal = super::device_ordinal(local_rank, count).ok_or_else(|| {
        format!(
            "--device cuda: LOCAL_RANK {local_rank} but this process sees {count} GPU(s); start \
             at most one rank per GPU"
        )
    })?;
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "--device cuda: libtorch sees a GPU but libcuda.so (the driver API) cannot \
                    be opened"
                .into(),
        );
    }
    Ok(Device::Cuda(ordinal))
}

/// Why libtorch sees no GPU: a binary built without libtorch's CUDA library can never see
/// one, whatever the machine has; one built with it lacks a driver or a visible device.
fn no_cuda_reason() -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    if !maps.contains("libtorch_cuda.so") {
        return "--device cuda: this osdp-tui is not linked against libtorch_cuda.so (it was \
                built against a CPU-only libtorch); rebuild it against PyTorch's CUDA wheel with \
                `. scripts/libtorch-env.sh && cargo build --release --features cuda`"
            .into();
    }
    // SAFETY: only tries to open the shared library.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return "--device cuda: libtorch's CUDA library is loaded but the NVIDIA driver \
                (libcuda.so.1) is not: install the driver, or train on the CPU with --device cpu"
            .into();
    }
    let visible = crate::env::cuda_visible_devices()
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
        .unwrap_or_default();
    format!(
        "--device cuda: the NVIDIA driver is loaded but no GPU is visible{visible}; check \
         `nvidia-smi`, or train on the CPU with --device cpu"
    )
}

/// `ncclReduceScatter` and `ncclAllReduce`: (send, receive, count, type, op, comm, stream).
type Reduce = unsafe extern "C" fn(
    *const std::ffi::c_void,
    *mut std::ffi::c_void,
    usize,
    nccl::ncclDataType_t,
    nccl::ncclRedOp_t,
    nccl::ncclComm_t,
    nccl::cudaStream_t,
) -> nccl::ncclResult_t;

/// The NCCL entry points this backend calls, from a library opened by path. cudarc's own
/// loader asks only for `libnccl.so` and numbered names that are not NCCL's, so the library
/// is opened here (no symlinks, nothing written, nothing shared between local ranks).
struct NcclLib {
    get_unique_id: unsafe extern "C" fn(*mut nccl::ncclUniqueId) -> nccl::ncclResult_t,
    comm_init_rank: unsafe extern "C" fn(
        *mut nccl::ncclComm_t,
        i32,
        nccl::ncclUniqueId,
        i32,
    ) -> nccl::ncclResult_t,
    comm_abort: unsafe extern "C" fn(nccl::ncclComm_t) -> nccl::ncclResult_t,
    comm_destroy: unsafe extern "C" fn(nccl::ncclComm_t) -> nccl::ncclResult_t,
    get_error_string: unsafe extern "C" fn(nccl::ncclResult_t) -> *const std::ffi::c_char,
    all_gather: unsafe extern "C" fn(
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        usize,
        nccl::ncclDataType_t,
        nccl::ncclComm_t,
        nccl::cudaStream_t,
    ) -> nccl::ncclResult_t,
    reduce_scatter: Reduce,
    all_reduce: Reduce,
    broadcast: unsafe extern "C" fn(
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        usize,
        nccl::ncclDataType_t,
        i32,
        nccl::ncclComm_t,
        nccl::cudaStream_t,
    ) -> nccl::ncclResult_t,
    /// Keeps the functions above valid.
    _lib: libloading::Library,
}

impl NcclLib {
    /// The process's NCCL, opened on first use.
    fn get() -> Result<&'static NcclLib, String> {
        static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
        LIB.get_or_init(NcclLib::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open() -> Result<NcclLib, String> {
        let hint = "install NCCL (pip install nvidia-nccl-cu13, or the distribution's libnccl2) \
                    or name the library with OSDP_NCCL_LIB=/path/to/libnccl.so.2";
        let candidates = nccl_candidates();
        let mut last = String::new();
        for path in &candidates {
            // SAFETY: NCCL's initialisers have no preconditions.
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => {
                    return NcclLib::bind(lib).map_err(|e| format!("{}: {e}", path.display()))
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(format!(
            "--device cuda: NCCL cannot be opened (tried {}: {last}); {hint}",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    fn bind(lib: libloading::Library) -> Result<NcclLib, libloading::Error> {
        // SAFETY: each symbol is NCCL's C function of the signature given (nccl.h, 2.x).
        unsafe {
            Ok(NcclLib {
                get_unique_id: *lib.get(b"ncclGetUniqueId\0")?,
                comm_init_rank: *lib.get(b"ncclCommInitRank\0")?,
                comm_abort: *lib.get(b"ncclCommAbort\0")?,
                comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
                get_error_string: *lib.get(b"ncclGetErrorString\0")?,
                all_gather: *lib.get(b"ncclAllGather\0")?,
                reduce_scatter: *lib.get(b"ncclReduceScatter\0")?,
                all_reduce: *lib.get(b"ncclAllReduce\0")?,
                broadcast: *lib.get(b"ncclBroadcast\0")?,
                _lib: lib,
            })
        }
    }
}

/// Where NCCL may be: `OSDP_NCCL_LIB`; else `libnccl.so.2` in each directory of
/// `LD_LIBRARY_PATH` and beside the libtorch this program was built against (pip puts it in
/// `nvidia/nccl/lib` next to `torch/lib`); last the bare name, for the loader's own search.
fn nccl_candidates() -> Vec<PathBuf> {
    if let Some(p) = crate::env::nccl_lib() {
        return vec![PathBuf::from(p)];
    }
    let mut dirs: Vec<PathBuf> = crate::env::library_path();
    if let Some(built) = crate::env::BUILT_TORCH_LIB_DIR {
        dirs.push(PathBuf::from(built));
    }
    let mut out: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| {
            [
                d.join(NCCL_SONAME),
                d.join("../../nvidia/nccl/lib").join(NCCL_SONAME),
            ]
        })
        .filter(|p| p.exists())
        .collect();
    out.push(PathBuf::from(NCCL_SONAME));
    out
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

fn check(lib: &NcclLib, what: &str, r: nccl::ncclResult_t) -> Result<(), Aborted> {
    if r == nccl::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe {
        let p = (lib.get_error_string)(r);
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
    lib: &'static NcclLib,
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
            (self.lib.comm_abort)(self.raw());
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
    pub fn join(m: &Membership, device: Device, terms: &Terms) -> Result<NcclGroup, String> {
        let Device::Cuda(ordinal) = device else {
            return Err("the NCCL group needs a CUDA device".into());
        };
        let lib = NcclLib::get()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e:?}"))?;
        let tcp = TcpGroup::join(m, terms)?;
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        if m.rank == 0 {
            // SAFETY: writes the 128-byte id.
            check(lib, "ncclGetUniqueId", unsafe {
                (lib.get_unique_id)(&mut id)
            })
            .map_err(|e| e.0)?;
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
        check(lib, "ncclCommInitRank", unsafe {
            (lib.comm_init_rank)(&mut raw, m.world as i32, id, m.rank as i32)
        })
        .map_err(|e| e.0)?;
        let comm = Arc::new(Comm {
            lib,
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
            &NcclLib,
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
            self.comm.lib,
            what,
            f(
                self.comm.lib,
                input.data_ptr(),
                out.data_ptr(),
                dt,
                self.comm.raw(),
            ),
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
            |l, s, r, d, c| unsafe { (l.all_gather)(s, r, n, d, c, stream()) },
        )
    }

    fn reduce_scatter(&self, full: &Tensor) -> Result<Tensor, Aborted> {
        let n = full.numel() / self.world;
        self.call("reduce-scatter", full, n as i64, |l, s, r, d, c| unsafe {
            (l.reduce_scatter)(s, r, n, d, nccl::ncclRedOp_t::ncclSum, c, stream())
        })
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor, Aborted> {
        let n = t.numel();
        let out = self.call("all-reduce", t, n as i64, |l, s, r, d, c| unsafe {
            (l.all_reduce)(s, r, n, d, nccl::ncclRedOp_t::ncclSum, c, stream())
        })?;
        Ok(out.reshape(t.size()))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Aborted> {
        let n = t.numel();
        let out = self.call("broadcast", t, n as i64, |l, s, r, d, c| unsafe {
            (l.broadcast)(s, r, n, d, root as i32, c, stream())
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
                (self.comm.lib.comm_destroy)(self.comm.raw());
            }
        }
    }
}

/// The PCI bus id (`0000:18:00.0`) of CUDA device `ordinal`, the key NVML finds it by.
pub fn pci_bus_id(ordinal: usize) -> Option<String> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return None;
    }
    result::init().ok()?;
    let dev = result::device::get(ordinal as i32).ok()?;
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer holds the 13 characters and the terminator the driver writes.
    let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: the driver wrote a terminated string into `buf`.
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) };
    id.to_str().ok().map(str::to_string)
}
