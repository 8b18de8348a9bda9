//! What a GPU rank's memory looks like from outside the executor's ledger: the CUDA caching
//! allocator's peaks (allocated and reserved) and NVML's figure for this process (the
//! allocator's reserve plus the CUDA context, NCCL's buffers and cuBLAS workspaces). The ledger
//! counts only the tensors the executor holds; these show what it cannot see.
//!
//! On the CPU, and in a build without the allocator shim (see `build.rs`), every figure is
//! `None`: "not available", never a guess.

use tch::Device;

/// One rank's device memory over one step. `None`: not available here.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceMemory {
    /// Peak bytes the allocator handed out during the step.
    pub allocated_peak: Option<u64>,
    /// Peak bytes the allocator held from the driver (allocated plus its cache).
    pub reserved_peak: Option<u64>,
    /// NVML's used memory of this process after the step.
    pub process: Option<u64>,
}

impl DeviceMemory {
    /// Three numbers for a collective (`-1`: not available), in a fixed order.
    pub fn to_wire(self) -> [f64; 3] {
        let f = |v: Option<u64>| v.map_or(-1.0, |b| b as f64);
        [
            f(self.allocated_peak),
            f(self.reserved_peak),
            f(self.process),
        ]
    }

    pub fn from_wire(w: &[f64]) -> DeviceMemory {
        let g = |i: usize| w.get(i).copied().filter(|v| *v >= 0.0).map(|v| v as u64);
        DeviceMemory {
            allocated_peak: g(0),
            reserved_peak: g(1),
            process: g(2),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.allocated_peak.is_none() && self.reserved_peak.is_none() && self.process.is_none()
    }
}

impl From<DeviceMemory> for osdp_core::protocol::DeviceMemory {
    fn from(d: DeviceMemory) -> Self {
        osdp_core::protocol::DeviceMemory {
            allocated_peak_bytes: d.allocated_peak,
            reserved_peak_bytes: d.reserved_peak,
            process_bytes: d.process,
        }
    }
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
    let (allocated_peak, reserved_peak) = allocator_peaks(ordinal);
    DeviceMemory {
        allocated_peak,
        reserved_peak,
        process: process_bytes(ordinal),
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
            allocated_peak: Some(3 << 30),
            reserved_peak: None,
            process: Some(5 << 30),
        };
        assert_eq!(DeviceMemory::from_wire(&m.to_wire()), m);
        assert!(
            read(Device::Cpu).is_empty(),
            "the CPU has no device figures"
        );
    }
}
