// Host-side setup that a forward call would otherwise redo every time: a kernel's
// function attributes (once per CUDA context: a context reset clears them) and the SM
// count (once per device). Four cudaFuncSetAttribute and an attribute query per call
// cost ~2 µs of host time (measured: bench/NOTES.md).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace qattn::hopper {

// The current context's unique ID (cuCtxGetId, CUDA 12.0+, through the runtime's driver
// entry points), or 0 where there is none yet or the driver lacks the call: then the
// caller sets its attributes every time.
inline unsigned long long current_context_id() {
  using GetCurrentFn = CUresult (*)(CUcontext*);
  using GetIdFn = CUresult (*)(CUcontext, unsigned long long*);
  struct Fns {
    GetCurrentFn get_current = nullptr;
    GetIdFn get_id = nullptr;
  };
  static const Fns fns = [] {
    Fns f;
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      f.get_current = reinterpret_cast<GetCurrentFn>(p);
    if (cudaGetDriverEntryPointByVersion("cuCtxGetId", &p, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      f.get_id = reinterpret_cast<GetIdFn>(p);
    return f;
  }();
  if (fns.get_current == nullptr || fns.get_id == nullptr) return 0;
  CUcontext ctx = nullptr;
  if (fns.get_current(&ctx) != CUDA_SUCCESS || ctx == nullptr) return 0;
  unsigned long long id = 0;
  return fns.get_id(ctx, &id) == CUDA_SUCCESS ? id : 0;
}

// Runs `set` (returning cudaError_t) unless it already succeeded in the current context;
// `done` is the caller's record (one per kernel) of the last context it succeeded in.
// Alternating contexts just set the attributes each time; two threads may both set
// them the first time, which is harmless.
template <typename Set>
cudaError_t once_per_context(std::atomic<unsigned long long>& done, Set set) {
  const unsigned long long ctx = current_context_id();
  if (ctx != 0 && done.load(std::memory_order_acquire) == ctx) return cudaSuccess;
  if (cudaError_t e = set(); e != cudaSuccess) return e;
  // The attribute calls create the context if there was none: record the one they used.
  if (const unsigned long long now = current_context_id(); now != 0)
    done.store(now, std::memory_order_release);
  return cudaSuccess;
}

// The current device's SM count (queried once per device: it survives resets).
inline cudaError_t current_device_sms(int* sms) {
  static std::atomic<int> cached[64] = {};  // 0: not queried yet
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device >= 0 && device < 64) {
    if (const int n = cached[device].load(std::memory_order_relaxed); n > 0) {
      *sms = n;
      return cudaSuccess;
    }
  }
  if (cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return e;
  if (device >= 0 && device < 64) cached[device].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace qattn::hopper
