// The device half of a call: is there a device that can run the Hopper kernels, are
// the pointers device memory on it (each with room for its span), and the launch
// itself with its CUDA errors mapped to qattn_status. In a CPU-only build
// (QATTN_HAVE_CUDA=0) every entry reports QATTN_ERROR_NO_DEVICE.
#pragma once

#include <string>

#include "qattn/qattn.h"

namespace qattn::api {

inline constexpr int kHopperMajor = 9, kHopperMinor = 0;  // the sm_90a cubins run only on 9.0

enum class ForwardPart { kAll, kAttentionOnly };

// Checks the current device (compute capability 9.0) and, unless `stream` is being
// captured into a graph, that the buffers are device memory of that device and, where
// the driver can tell, that each buffer's span (buffer_spans) fits in its allocation.
qattn_status check_device(const char* fn, const qattn_fwd_params& p, const void* workspace,
                          void* stream);

// Enqueues the forward on `stream` (parameters validated and resolved).
qattn_status launch(const char* fn, const qattn_fwd_params& p, void* workspace, void* stream,
                    ForwardPart part);

// 1 when `device` (< 0: the current one) has compute capability 9.0.
bool device_supported(int device);

}  // namespace qattn::api
