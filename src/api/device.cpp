#include "api/device.h"

#include <atomic>

#include "api/error.h"
#include "api/registry.h"
#include "api/validate.h"

#if QATTN_HAVE_CUDA
#include <cuda.h>  // driver types only: the calls are reached through the runtime
#include <cuda_runtime.h>
#endif

namespace qattn::api {

#if QATTN_HAVE_CUDA
namespace {

qattn_status cuda_fail(const char* fn, const char* what, cudaError_t e) {
  return fail(QATTN_ERROR_CUDA, fn, ": ", what, " failed: ", cudaGetErrorName(e), ": ",
              cudaGetErrorString(e));
}

// A missing driver or device is "no device", any other runtime failure a CUDA error.
qattn_status device_fail(const char* fn, cudaError_t e) {
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
      e == cudaErrorCallRequiresNewerDriver || e == cudaErrorInitializationError) {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0)
      return fail(QATTN_ERROR_NO_DEVICE, fn, ": no CUDA driver (libcuda) on this machine");
    return fail(QATTN_ERROR_NO_DEVICE, fn, ": no usable CUDA device: ", cudaGetErrorName(e), ": ",
                cudaGetErrorString(e));
  }
  return cuda_fail(fn, "cudaGetDevice", e);
}

cudaError_t query_capability(int device, Arch* cc) {
  if (auto e = cudaDeviceGetAttribute(&cc->major, cudaDevAttrComputeCapabilityMajor, device); e)
    return e;
  return cudaDeviceGetAttribute(&cc->minor, cudaDevAttrComputeCapabilityMinor, device);
}

// A device's compute capability is a fact of the hardware (a context reset keeps it):
// queried once per device ordinal, then read from `known` (0: not queried yet, else
// major * 256 + minor + 1). Threads that race both query and store the same value.
cudaError_t capability(int device, Arch* cc) {
  constexpr int kDevices = 64;  // ordinals past this are queried every time
  static std::atomic<int> known[kDevices] = {};
  const bool cached = device >= 0 && device < kDevices;
  if (cached)
    if (const int v = known[device].load(std::memory_order_relaxed); v != 0) {
      cc->major = (v - 1) / 256;
      cc->minor = (v - 1) % 256;
      return cudaSuccess;
    }
  if (auto e = query_capability(device, cc); e != cudaSuccess) return e;
  if (cached && cc->major > 0 && cc->minor >= 0 && cc->minor < 256)
    known[device].store(cc->major * 256 + cc->minor + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

// `ptr` must be memory the device can address: device or managed memory of `device`,
// or mapped host memory. Reads only the allocation's attributes, never the memory.
qattn_status check_pointer(const char* fn, const char* name, const void* ptr, int device) {
  cudaPointerAttributes a{};
  if (auto e = cudaPointerGetAttributes(&a, ptr); e != cudaSuccess) {
    (void)cudaGetLastError();  // an invalid pointer is reported here, not by a later call
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", ptr,
                " is not memory CUDA knows (", cudaGetErrorString(e),
                "); allowed: device memory (cudaMalloc, a CUDA tensor)");
  }
  if (a.type == cudaMemoryTypeUnregistered)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", ptr,
                " is host memory; allowed: device memory (cudaMalloc, a CUDA tensor)");
  if (a.type == cudaMemoryTypeDevice && a.device != device)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", ptr, " is on device ",
                a.device, " but the current device is ", device,
                "; make the tensors' device current (cudaSetDevice)");
  return QATTN_OK;
}

// A driver entry point through the runtime (12.0 ABI), as hopper/tensor_map.cu does:
// no link-time dependency on libcuda. NULL when the driver lacks it.
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The span check is made only where the allocation holding `ptr` is known: plain
// cudaMalloc memory (legacy-IPC capable). A VMM range (e.g. PyTorch's expandable
// segments) maps several allocations back to back and cuMemGetAddressRange reports
// only one of them, so a valid tensor could cross its end; managed, pooled and host
// memory are skipped alike, as is any driver that lacks the calls or fails them.
qattn_status check_span(const char* fn, const BufferSpan& b) {
  static const auto get_attribute = driver_entry<PointerGetAttributeFn>("cuPointerGetAttribute");
  static const auto address_range = driver_entry<MemGetAddressRangeFn>("cuMemGetAddressRange");
  if (get_attribute == nullptr || address_range == nullptr) return QATTN_OK;
  const auto ptr = reinterpret_cast<CUdeviceptr>(b.data);
  int plain = 0;
  if (get_attribute(&plain, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr) != CUDA_SUCCESS ||
      plain == 0)
    return QATTN_OK;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (address_range(&base, &size, ptr) != CUDA_SUCCESS) return QATTN_OK;
  const CUdeviceptr room = base + size - ptr;  // bytes from ptr to the allocation's end
  if (b.bytes > room)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", b.name, " = ", b.data, " needs ", b.bytes,
                " bytes (its shape and strides) but its allocation ends ", room,
                " bytes after it; allowed: a buffer that holds every element the view reaches");
  return QATTN_OK;
}

// Switches the calling thread to the relaxed capture mode for its lifetime: the
// pointer queries enqueue nothing, but in the global and thread-local modes a capture
// in progress forbids any "potentially unsafe" call, and the CUDA documentation does
// not list which queries are safe. Relaxed mode allows them by definition.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureMode() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

}  // namespace

qattn_status current_device(const char* fn, int* device, Arch* arch) {
  if (auto e = cudaGetDevice(device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return device_fail(fn, e);
  }
  if (auto e = capability(*device, arch); e != cudaSuccess)
    return cuda_fail(fn, "cudaDeviceGetAttribute", e);
  return QATTN_OK;
}

qattn_status check_pointers(const char* fn, std::span<const BufferSpan> buffers, int device) {
  RelaxedCaptureMode relaxed;
  for (const BufferSpan& b : buffers) {
    if (b.data == nullptr) continue;  // no lse
    if (auto s = check_pointer(fn, b.name, b.data, device); s != QATTN_OK) return s;
    if (auto s = check_span(fn, b); s != QATTN_OK) return s;
  }
  return QATTN_OK;
}

qattn_status launch_status(const char* fn, const char* family, int e) {
  if (e != cudaSuccess)
    return fail(QATTN_ERROR_CUDA, fn, ": enqueueing the ", family, " kernels failed: ",
                cudaGetErrorName(static_cast<cudaError_t>(e)), ": ",
                cudaGetErrorString(static_cast<cudaError_t>(e)));
  return QATTN_OK;
}

bool device_supported(int device) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  Arch cc;
  if (capability(device, &cc) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return arch_supported(cc);
}

#else  // CPU-only build

qattn_status current_device(const char* fn, int*, Arch*) {
  return fail(QATTN_ERROR_NO_DEVICE, fn,
              ": this build of qattn has no CUDA kernels (configured with QATTN_CUDA=OFF or "
              "without nvcc); rebuild with CUDA to run on a GPU");
}

qattn_status check_pointers(const char* fn, std::span<const BufferSpan>, int) {
  return current_device(fn, nullptr, nullptr);
}

qattn_status launch_status(const char* fn, const char*, int) {
  return current_device(fn, nullptr, nullptr);
}

bool device_supported(int) { return false; }

#endif

}  // namespace qattn::api
