// Host-side setup that is fixed per device: a kernel's function attributes and the SM
// count. Each forward call used to redo them (four cudaFuncSetAttribute and an attribute
// query per call); done once per device, they leave the call's host time to the launches
// (NOTES v17d).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace qattn::hopper {

// Runs `set` (returning cudaError_t) unless it already succeeded on `device`; `done` is
// the caller's bitmask of devices (one per kernel). Devices past 63 run it every time.
// Two threads may both run it the first time: setting an attribute twice is harmless.
template <typename Set>
cudaError_t once_per_device(std::atomic<std::uint64_t>& done, int device, Set set) {
  const std::uint64_t bit = device >= 0 && device < 64 ? std::uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  if (cudaError_t e = set(); e != cudaSuccess) return e;
  done.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

// The current device and its SM count (queried once per device).
inline cudaError_t current_device_sms(int* device, int* sms) {
  static std::atomic<int> cached[64] = {};  // 0: not queried yet
  if (cudaError_t e = cudaGetDevice(device); e != cudaSuccess) return e;
  if (*device >= 0 && *device < 64) {
    if (const int n = cached[*device].load(std::memory_order_relaxed); n > 0) {
      *sms = n;
      return cudaSuccess;
    }
  }
  if (cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, *device);
      e != cudaSuccess)
    return e;
  if (*device >= 0 && *device < 64) cached[*device].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace qattn::hopper
