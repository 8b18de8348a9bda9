// The CUDA caching allocator's byte counters for one device, for the trainer's memory report.
// libtorch keeps them behind inline C++ functions; this file gives them a C name.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>

extern "C" {

// out[0..4]: allocated bytes now, allocated peak, reserved bytes now, reserved peak.
// Returns 0, or 1 when the allocator cannot answer (not initialised, bad device).
int osdp_cuda_allocator_stats(int device, int64_t* out) {
  try {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
    return 0;
  } catch (...) {
    return 1;
  }
}

// Start a new peak window (the trainer measures each step's peak).
int osdp_cuda_allocator_reset_peak(int device) {
  try {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (...) {
    return 1;
  }
}
}
