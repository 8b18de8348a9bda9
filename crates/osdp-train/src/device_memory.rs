//! What a GPU rank's memory looks like from outside the executor's ledger: the CUDA caching
//! allocator's peaks (allocated and reserved) and NVML's figure for this process (the
//! allocator's reserve plus the CUDA context, NCCL's buffers and cuBLAS workspaces). The ledger
//! counts only the tensors the executor holds; these show what it cannot see.
//!
//! On the CPU, and in a build without the allocator shim (see `build.rs`), every figure is
//! `None`: "not available", never a guess.

use tch::Device;

/// One rank's device memory over one step, as the metrics stream carries it. `None`: not
/// available here.
pub use osdp_core::protocol::DeviceMemory;

/// Three numbers for a collective (`-1`: not available), in a fixed order.
pub fn to_wire(d: DeviceMemory) -> [f64; 3] {
    let f = |v: Option<u64>| v.map_or(-1.0, |b| b as f64);
    [
        f(d.allocated_peak_bytes),
        f(d.reserved_peak_bytes),
        f(d.process_bytes),
    ]
}

/// The figures [`to_wire`] sent.
pub fn from_wire(w: &[f64]) -> DeviceMemory {
    let g = |i: usize| w.get(i).copied().filter(|v| *v >= 0.0).map(|v| v as u64);
    DeviceMemory {
        allocated_peak_bytes: g(0),
        reserved_peak_bytes: g(1),
        process_bytes: g(2),
    }
}

/// Whether no figure is available.
pub fn is_empty(d: &DeviceMemory) -> bool {
    d.allocated_peak_bytes.is_none() && d.reserved_peak_bytes.is_none() && d.process_bytes.is_none()
}

/// Start a new peak window on `device` (the start of a step).
pub fn reset_peak(device: Device) {
    #[cfg(osdp_cuda_stats)]
    if let Device::Cuda(i) = device {
        // SAFETY: the shim catches every C++ exception; `i` is a device this rank uses.
        unsafe {
            shim::osdp_cuda_allocator_reset_peak(i as i32);
        }
    }
    let _ = device;
}

/// The figures of `device` since the last [`reset_peak`].
pub fn read(device: Device) -> DeviceMemory {
    let Device::Cuda(ordinal) = device else {
        return DeviceMemory::default();
    };
    let (allocated_peak_bytes, reserved_peak_bytes) = allocator_peaks(ordinal);
    DeviceMemory {
        allocated_peak_bytes,
        reserved_peak_bytes,
        process_bytes: process_bytes(ordinal),
    }
}

#[cfg(osdp_cuda_stats)]
mod shim {
    extern "C" {
        pub fn osdp_cuda_allocator_stats(device: i32, out: *mut i64) -> i32;
        pub fn osdp_cuda_allocator_reset_peak(device: i32) -> i32;
    }
}

#[cfg(osdp_cuda_stats)]
fn allocator_peaks(ordinal: usize) -> (Option<u64>, Option<u64>) {
    let mut out = [0i64; 4];
    // SAFETY: the shim writes four counters and catches every C++ exception.
    let rc = unsafe { shim::osdp_cuda_allocator_stats(ordinal as i32, out.as_mut_ptr()) };
    if rc != 0 {
        return (None, None);
    }
    (Some(out[1].max(0) as u64), Some(out[3].max(0) as u64))
}

#[cfg(not(osdp_cuda_stats))]
fn allocator_peaks(_ordinal: usize) -> (Option<u64>, Option<u64>) {
    (None, None)
}

/// NVML's memory of this process on the GPU the CUDA ordinal names (matched by PCI bus id, so
/// `CUDA_VISIBLE_DEVICES` renumbering does not matter).
#[cfg(feature = "cuda")]
fn process_bytes(ordinal: usize) -> Option<u64> {
    use std::sync::OnceLock;
    static NVML: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();
    // Looked up once: a rank process uses one GPU, and this runs after every step.
    static BUS_ID: OnceLock<Option<String>> = OnceLock::new();
    let nvml = NVML
        .get_or_init(|| nvml_wrapper::Nvml::init().ok())
        .as_ref()?;
    let bus_id = BUS_ID
        .get_or_init(|| super::cuda::pci_bus_id(ordinal))
        .as_deref()?;
    let device = nvml.device_by_pci_bus_id(bus_id).ok()?;
    let pid = std::process::id();
    device
        .running_compute_processes()
        .ok()?
        .into_iter()
        .find(|p| p.pid == pid)
        .and_then(|p| match p.used_gpu_memory {
            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
        })
}

#[cfg(not(feature = "cuda"))]
fn process_bytes(_ordinal: usize) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_survive_the_wire_and_missing_ones_stay_missing() {
        let m = DeviceMemory {
            allocated_peak_bytes: Some(3 << 30),
            reserved_peak_bytes: None,
            process_bytes: Some(5 << 30),
        };
        assert_eq!(from_wire(&to_wire(m)), m);
        assert!(
            is_empty(&read(Device::Cpu)),
            "the CPU has no device figures"
        );
    }
}
