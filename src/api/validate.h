// Parameter validation of the forward and backward calls: host arithmetic on the parameter values
// and pointer addresses only — nothing here reads device memory or calls CUDA, so it
// runs (and is tested) on a machine without a GPU. The rules every call obeys live
// here (the kernels assume them, e.g. 16-byte vector loads of q, k, v); what one
// kernel family runs (head dims, architectures, its own limits) is that family's
// declaration (family.h), asked through the registry.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include <span>

#include "api/registry.h"
#include "qattn/qattn.h"

namespace qattn::api {

// ---- the support rules --------------------------------------------------------------
inline constexpr int kMaxGridDim = 65535;   // batch and heads are grid y/z dimensions
inline constexpr int kMaxSeqlen = 1 << 30;  // padded lengths must stay an int
inline constexpr std::size_t kTensorAlign = 16;  // bytes: one 16-byte vector load/store
inline constexpr int64_t kStrideMultiple = 8;    // elements: 16 bytes of a 16-bit type
inline constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;  // cuTensorMapEncode limit
inline constexpr std::size_t kLseAlign = alignof(float);
inline constexpr std::size_t kKvLengthsAlign = alignof(int32_t);
inline constexpr std::size_t kCuSeqlensAlign = alignof(int32_t);
inline constexpr std::size_t kWorkspaceAlign = 256;
inline constexpr float kMaxSmScale = QATTN_MAX_SM_SCALE;  // qattn.h derives it
// Above this many rows, an output whose strides interleave rows is reported as not
// supported rather than proved alias-free (the proof sorts every row's offset).
inline constexpr int64_t kMaxInterleavedRows = int64_t{1} << 20;

// Reads the caller's struct up to its struct_size into *out (the fields it lacks keep
// qattn_fwd_params_init's defaults), after checking the size (qattn.h's stability
// rule). On failure records a message that starts with `fn`.
qattn_status read_params(const char* fn, const qattn_fwd_params* p, qattn_fwd_params* out);

// Checks every field of p, a struct read_params filled (see qattn.h for the rules):
// the scalars, then that some kernel family runs the call on some device (registry.h;
// QATTN_ERROR_UNSUPPORTED otherwise), then the tensors. On failure records a message
// that starts with `fn` and names the parameter and its allowed values. `families`: the
// registry's list (tests pass declarations of their own, e.g. one that runs a call no
// family of this build runs, to reach the checks after the family's).
qattn_status validate_forward(const char* fn, const qattn_fwd_params& p,
                              std::span<const ForwardFamily* const> families =
                                  forward_families());

// Workspace bytes for validated parameters: the largest need of the families that run
// them (registry.h).
std::size_t forward_workspace_bytes(const qattn_fwd_params& p,
                                   std::span<const ForwardFamily* const> families =
                                       forward_families());

// Checks the workspace pointer, size and alignment, and that it overlaps none of the
// tensors, for validated parameters.
qattn_status validate_workspace(const char* fn, const qattn_fwd_params& p, const void* workspace,
                                std::size_t workspace_bytes,
                                std::span<const ForwardFamily* const> families =
                                    forward_families());

// A copy of validated parameters with the defaults made explicit (sm_scale 0 becomes
// 1/sqrt(head_dim)).
qattn_fwd_params resolve_defaults(const qattn_fwd_params& p);

// ---- the backward: the same rules, on qattn_bwd_params ------------------------------
// q, k, v, o, dout and lse are inputs (they may overlap each other); dq, dk and dv are
// outputs: each alias-free, overlapping no input, no other output and not the
// workspace. lse is required.
qattn_status read_params(const char* fn, const qattn_bwd_params* p, qattn_bwd_params* out);
qattn_status validate_backward(const char* fn, const qattn_bwd_params& p);
std::size_t backward_workspace_bytes(const qattn_bwd_params& p);
qattn_status validate_workspace(const char* fn, const qattn_bwd_params& p, const void* workspace,
                                std::size_t workspace_bytes);
qattn_bwd_params resolve_defaults(const qattn_bwd_params& p);

// ---- the memory a call touches --------------------------------------------------------
// Bytes from t.data to one past the last element of a (B, H, N, d) view of a 16-bit
// type: (largest element offset + 1) * 2, where the stride of an extent-1 dimension is
// ignored. Exact for views that passed validate_forward (no overflow then).
std::size_t view_span_bytes(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen,
                            int64_t head_dim);

// One buffer a call reads or writes: the parameter's name, its start and its length.
struct BufferSpan {
  const char* name;
  const void* data;  // NULL for an absent optional buffer (lse, p_max, kv_lengths)
  std::size_t bytes;
};

// The buffers of a call with validated parameters: q, k, v, kv_lengths, attn_mask,
// cu_seqlens_q, cu_seqlens_k (the inputs), o, lse, p_max, workspace (the bytes the call
// uses, forward_workspace_bytes, not the size the caller passed).
std::array<BufferSpan, 11> buffer_spans(const qattn_fwd_params& p, const void* workspace);
// The backward's: q, k, v, o, dout, lse, p_max (inputs), dq, dk, dv, workspace.
std::array<BufferSpan, 11> buffer_spans(const qattn_bwd_params& p, const void* workspace);

}  // namespace qattn::api
