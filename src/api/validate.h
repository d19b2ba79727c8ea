// Parameter validation of the forward call: host arithmetic on the parameter values
// and pointer addresses only — nothing here reads device memory or calls CUDA, so it
// runs (and is tested) on a machine without a GPU. The support rules live here, in
// one place; the kernels assume them (e.g. 16-byte vector loads of q, k, v).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qattn/qattn.h"

namespace qattn::api {

// ---- the support rules --------------------------------------------------------------
inline constexpr int kMaxHeadDim = 128;     // larger d: a later kernel (QATTN_ERROR_UNSUPPORTED)
inline constexpr int kMaxGridDim = 65535;   // batch and heads are grid y/z dimensions
inline constexpr int kMaxSeqlen = 1 << 30;  // padded lengths must stay an int
inline constexpr std::size_t kTensorAlign = 16;  // bytes: one 16-byte vector load/store
inline constexpr int64_t kStrideMultiple = 8;    // elements: 16 bytes of a 16-bit type
inline constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;  // cuTensorMapEncode limit
inline constexpr std::size_t kLseAlign = alignof(float);
inline constexpr std::size_t kWorkspaceAlign = 256;

// Checks every field of *p (see qattn.h for the rules). On failure records a message
// that starts with `fn` and names the parameter and its allowed values.
qattn_status validate_forward(const char* fn, const qattn_fwd_params* p);

// Workspace bytes for validated parameters (the kernel side's layout).
std::size_t forward_workspace_bytes(const qattn_fwd_params& p);

// Checks the workspace pointer, size and alignment, and that it overlaps none of the
// tensors, for validated parameters.
qattn_status validate_workspace(const char* fn, const qattn_fwd_params& p, const void* workspace,
                                std::size_t workspace_bytes);

// A copy of validated parameters with the defaults made explicit (sm_scale).
qattn_fwd_params resolve_defaults(const qattn_fwd_params& p);

}  // namespace qattn::api
