// The device half of a call: which device is current and its architecture, whether
// the pointers are device memory on it (each with room for its span), and the mapping
// of a launch's CUDA error to qattn_status. Names no kernel family: which family runs
// on the architecture is the registry's question (registry.h). In a CPU-only build
// (QATTN_HAVE_CUDA=0) every entry reports QATTN_ERROR_NO_DEVICE.
#pragma once

#include <span>

#include "api/family.h"
#include "api/validate.h"
#include "qattn/qattn.h"

namespace qattn::api {

// The current device and its compute capability.
qattn_status current_device(const char* fn, int* device, Arch* arch);

// Checks that the buffers (buffer_spans of the call; an absent one has data NULL and is
// skipped) are device memory of `device` and, where the driver can tell, that each
// buffer's span fits in its allocation. The queries are
// host-side reads of allocation attributes; they run during stream capture too (in any
// capture mode: the calling thread is switched to the relaxed mode around them).
qattn_status check_pointers(const char* fn, std::span<const BufferSpan> buffers, int device);

// The status of a family's launch (a cudaError_t; 0 = success); `family` is its name.
qattn_status launch_status(const char* fn, const char* family, int cuda_error);

// 1 when `device` (< 0: the current one) has an architecture some family runs on.
bool device_supported(int device);

}  // namespace qattn::api
