#include "api/device.h"

#include "api/error.h"
#include "api/validate.h"

#if QATTN_HAVE_CUDA
#include <cuda.h>  // driver types only: the calls are reached through the runtime
#include <cuda_runtime.h>

#include "cuda/sage2_fwd/launch.h"
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

struct Capability {
  int major = 0, minor = 0;
};

cudaError_t capability(int device, Capability* cc) {
  if (auto e = cudaDeviceGetAttribute(&cc->major, cudaDevAttrComputeCapabilityMajor, device); e)
    return e;
  return cudaDeviceGetAttribute(&cc->minor, cudaDevAttrComputeCapabilityMinor, device);
}

// `ptr` must be memory the device can address: device or managed memory of `device`,
// or mapped host memory. Reads only the allocation's attributes, never the memory.
qattn_status check_pointer(const char* fn, const char* name, const void* ptr, int device) {
  cudaPointerAttributes a{};
  if (auto e = cudaPointerGetAttributes(&a, ptr); e != cudaSuccess) {
    (void)cudaGetLastError();  // an invalid pointer is reported here, not by a later call
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", ptr,
                " is not memory CUDA knows: ", cudaGetErrorString(e));
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

bool capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // e.g. the legacy stream while another stream captures: check nothing more
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

qattn_status check_device(const char* fn, const qattn_fwd_params& p, const void* workspace,
                          void* stream) {
  int device = 0;
  if (auto e = cudaGetDevice(&device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return device_fail(fn, e);
  }
  Capability cc;
  if (auto e = capability(device, &cc); e != cudaSuccess)
    return cuda_fail(fn, "cudaDeviceGetAttribute", e);
  if (cc.major != kHopperMajor || cc.minor != kHopperMinor)
    return fail(QATTN_ERROR_UNSUPPORTED, fn, ": the current device ", device,
                " has compute capability ", cc.major, ".", cc.minor,
                "; the SageAttention2 kernels need sm_90 (Hopper: H100, H200, H20)");
  // Pointer attributes are host-side queries; skip them while capturing to keep the
  // capture free of anything but the launches.
  if (capturing(stream)) return QATTN_OK;
  for (const BufferSpan& b : buffer_spans(p, workspace)) {
    if (b.data == nullptr) continue;  // no lse
    if (auto s = check_pointer(fn, b.name, b.data, device); s != QATTN_OK) return s;
    if (auto s = check_span(fn, b); s != QATTN_OK) return s;
  }
  return QATTN_OK;
}

qattn_status launch(const char* fn, const qattn_fwd_params& p, void* workspace, void* stream,
                    ForwardPart part) {
  const int e = part == ForwardPart::kAll ? sage2::launch_forward(p, workspace, stream)
                                          : sage2::launch_attention_only(p, workspace, stream);
  if (e != cudaSuccess)
    return cuda_fail(fn, "enqueueing the SageAttention2 kernels", static_cast<cudaError_t>(e));
  return QATTN_OK;
}

bool device_supported(int device) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  Capability cc;
  if (capability(device, &cc) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return cc.major == kHopperMajor && cc.minor == kHopperMinor;
}

#else  // CPU-only build

qattn_status check_device(const char* fn, const qattn_fwd_params&, const void*, void*) {
  return fail(QATTN_ERROR_NO_DEVICE, fn,
              ": this build of qattn has no CUDA kernels (configured with QATTN_CUDA=OFF or "
              "without nvcc); rebuild with CUDA to run on a GPU");
}

qattn_status launch(const char* fn, const qattn_fwd_params& p, void* workspace, void* stream,
                    ForwardPart) {
  return check_device(fn, p, workspace, stream);
}

bool device_supported(int) { return false; }

#endif

}  // namespace qattn::api
