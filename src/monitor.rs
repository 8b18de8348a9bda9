//! GPU samples for the dashboard: a source trait, the NVML source, and a poller thread.
//!
//! NVML is initialised once. A machine without the driver, a GPU that stops answering or a
//! metric a GPU does not support degrades to "not available", never a crash.

use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::Duration;

/// One reading of one GPU; `None` where the metric is not available.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuSample {
    pub index: usize,
    pub name: String,
    pub used_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub utilization_pct: Option<u32>,
    /// (pid, bytes used) of the processes on the GPU.
    pub processes: Vec<(u32, Option<u64>)>,
    /// CUDA compute capability (major, minor): what a GPU the known-GPU table does not name
    /// is priced by.
    pub compute_capability: Option<(u32, u32)>,
}

/// Where GPU samples come from (NVML, a test, a training run's reports).
pub trait GpuSource: Send {
    /// Current samples of every GPU, or why none can be had.
    fn sample(&mut self) -> Result<Vec<GpuSample>, String>;
}

/// NVIDIA's management library, through `nvml-wrapper`.
pub struct NvmlSource {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlSource {
    /// Load NVML, or say why it cannot be loaded (no driver, no GPU).
    pub fn open() -> Result<NvmlSource, String> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| NvmlSource { nvml })
            .map_err(|e| match e {
                nvml_wrapper::error::NvmlError::LibloadingError(_) => {
                    "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded)".to_string()
                }
                e => format!("NVML is not available: {e}"),
            })
    }
}

impl GpuSource for NvmlSource {
    fn sample(&mut self) -> Result<Vec<GpuSample>, String> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| format!("NVML device count: {e}"))?;
        Ok((0..count)
            .map(|i| {
                let mut s = GpuSample {
                    index: i as usize,
                    name: format!("GPU {i}"),
                    ..Default::default()
                };
                if let Ok(d) = self.nvml.device_by_index(i) {
                    if let Ok(name) = d.name() {
                        s.name = name;
                    }
                    if let Ok(m) = d.memory_info() {
                        s.used_bytes = Some(m.used);
                        s.total_bytes = Some(m.total);
                    }
                    s.utilization_pct = d.utilization_rates().ok().map(|u| u.gpu);
                    s.compute_capability = d.cuda_compute_capability().ok().and_then(|c| {
                        Some((u32::try_from(c.major).ok()?, u32::try_from(c.minor).ok()?))
                    });
                    if let Ok(ps) = d.running_compute_processes() {
                        s.processes = ps
                            .iter()
                            .map(|p| {
                                let used = match p.used_gpu_memory {
                                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                                };
                                (p.pid, used)
                            })
                            .collect();
                    }
                }
                s
            })
            .collect())
    }
}

/// What the poller reports.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuEvent {
    Samples(Vec<GpuSample>),
    Unavailable(String),
}

/// Poll `source` every `period` on its own thread until the receiver is dropped.
pub fn spawn_poller(mut source: Box<dyn GpuSource>, period: Duration) -> Receiver<GpuEvent> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || loop {
        let event = match source.sample() {
            Ok(s) => GpuEvent::Samples(s),
            Err(e) => GpuEvent::Unavailable(e),
        };
        if tx.send(event).is_err() {
            return;
        }
        thread::sleep(period);
    });
    rx
}
