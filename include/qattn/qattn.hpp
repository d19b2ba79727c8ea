// qattn — C++ layer over the C ABI (qattn.h): a Status object instead of bare codes,
// an exception type for callers that prefer them, and a builder for the forward
// parameters with HND/NHD helpers. Header-only; adds nothing to the ABI.
//
//   qattn::ForwardParams fp(qattn::DType::kBF16, B, Hq, Hkv, Nq, Nkv, d);
//   fp.q(q_ptr, qattn::Layout::kHND).k(k_ptr, qattn::Layout::kHND)
//     .v(v_ptr, qattn::Layout::kHND).o(o_ptr, qattn::Layout::kHND).causal(true);
//   std::size_t bytes = 0;
//   qattn::workspace_size(fp, &bytes).throw_if_error();
//   qattn::forward(fp, workspace, bytes, stream).throw_if_error();
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "qattn/qattn.h"

namespace qattn {

enum class StatusCode : int {
  kOk = QATTN_OK,
  kInvalidArgument = QATTN_ERROR_INVALID_ARGUMENT,
  kUnsupported = QATTN_ERROR_UNSUPPORTED,
  kNoDevice = QATTN_ERROR_NO_DEVICE,
  kWorkspaceTooSmall = QATTN_ERROR_WORKSPACE_TOO_SMALL,
  kCuda = QATTN_ERROR_CUDA,
  kInternal = QATTN_ERROR_INTERNAL,
};

class Error;

// The outcome of a call: a code and, on failure, the message naming the parameter.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  // Wraps a C status, reading this thread's last error message when it failed.
  static Status from_c(qattn_status s) {
    if (s == QATTN_OK) return {};
    return {static_cast<StatusCode>(s), qattn_last_error_message()};
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  const char* code_name() const { return qattn_status_string(static_cast<qattn_status>(code_)); }

  inline void throw_if_error() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

class Error : public std::runtime_error {
 public:
  explicit Error(Status status)
      : std::runtime_error(std::string(status.code_name()) + ": " + status.message()),
        status_(std::move(status)) {}
  const Status& status() const { return status_; }
  StatusCode code() const { return status_.code(); }

 private:
  Status status_;
};

inline void Status::throw_if_error() const {
  if (!ok()) throw Error(*this);
}

enum class DType { kFP16 = QATTN_DTYPE_FP16, kBF16 = QATTN_DTYPE_BF16 };

enum class Granularity {
  kPerThread = QATTN_QK_PER_THREAD,
  kPerWarp = QATTN_QK_PER_WARP,
  kPerBlock = QATTN_QK_PER_BLOCK,
};

// Memory order of a contiguous (B, H, N, d) tensor: HND = [B][H][N][d] (PyTorch SDPA),
// NHD = [B][N][H][d] (FlashAttention's varlen-friendly order).
enum class Layout { kHND, kNHD };

// A view of a contiguous tensor in `layout`; `row_stride` (elements between two rows
// of d, >= d) lets a caller pad rows to a multiple of 8 elements.
inline qattn_tensor make_tensor(const void* data, Layout layout, int heads, int seqlen,
                                int64_t row_stride) {
  qattn_tensor t{const_cast<void*>(data), 0, 0, 0};
  if (layout == Layout::kHND) {
    t.stride_n = row_stride;
    t.stride_h = static_cast<int64_t>(seqlen) * row_stride;
    t.stride_b = static_cast<int64_t>(heads) * t.stride_h;
  } else {
    t.stride_h = row_stride;
    t.stride_n = static_cast<int64_t>(heads) * row_stride;
    t.stride_b = static_cast<int64_t>(seqlen) * t.stride_n;
  }
  return t;
}

// Builder of qattn_fwd_params. Shapes first, then the buffers; nothing is checked
// until workspace_size or forward, which check everything.
class ForwardParams {
 public:
  ForwardParams(DType dtype, int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_kv,
                int head_dim) {
    qattn_fwd_params_init(&p_);
    p_.dtype = static_cast<qattn_dtype>(dtype);
    p_.batch = batch;
    p_.heads_q = heads_q;
    p_.heads_kv = heads_kv;
    p_.seqlen_q = seqlen_q;
    p_.seqlen_kv = seqlen_kv;
    p_.head_dim = head_dim;
  }

  // Contiguous tensors in a layout (rows of head_dim elements).
  ForwardParams& q(const void* data, Layout layout) { return q(data, layout, p_.head_dim); }
  ForwardParams& k(const void* data, Layout layout) { return k(data, layout, p_.head_dim); }
  ForwardParams& v(const void* data, Layout layout) { return v(data, layout, p_.head_dim); }
  ForwardParams& o(void* data, Layout layout) { return o(data, layout, p_.head_dim); }
  // The same with padded rows.
  ForwardParams& q(const void* data, Layout layout, int64_t row_stride) {
    p_.q = make_tensor(data, layout, p_.heads_q, p_.seqlen_q, row_stride);
    return *this;
  }
  ForwardParams& k(const void* data, Layout layout, int64_t row_stride) {
    p_.k = make_tensor(data, layout, p_.heads_kv, p_.seqlen_kv, row_stride);
    return *this;
  }
  ForwardParams& v(const void* data, Layout layout, int64_t row_stride) {
    p_.v = make_tensor(data, layout, p_.heads_kv, p_.seqlen_kv, row_stride);
    return *this;
  }
  ForwardParams& o(void* data, Layout layout, int64_t row_stride) {
    p_.o = make_tensor(data, layout, p_.heads_q, p_.seqlen_q, row_stride);
    return *this;
  }
  // Arbitrary strides (in elements).
  ForwardParams& q(const qattn_tensor& t) { return set(p_.q, t); }
  ForwardParams& k(const qattn_tensor& t) { return set(p_.k, t); }
  ForwardParams& v(const qattn_tensor& t) { return set(p_.v, t); }
  ForwardParams& o(const qattn_tensor& t) { return set(p_.o, t); }

  // Optional (B, Hq, Nq) FP32 natural-log LSE.
  ForwardParams& lse(float* data) {
    p_.lse = data;
    return *this;
  }
  ForwardParams& causal(bool on) {
    p_.causal = on ? 1 : 0;
    return *this;
  }
  // <= 0 restores the default 1/sqrt(head_dim).
  ForwardParams& sm_scale(float scale) {
    p_.sm_scale = scale;
    return *this;
  }
  ForwardParams& granularity(Granularity g) {
    p_.granularity = static_cast<qattn_qk_granularity>(g);
    return *this;
  }

  const qattn_fwd_params& raw() const { return p_; }
  qattn_fwd_params& raw() { return p_; }

 private:
  ForwardParams& set(qattn_tensor& dst, const qattn_tensor& src) {
    dst = src;
    return *this;
  }
  qattn_fwd_params p_{};
};

// Checks the parameters and returns the workspace bytes qattn::forward needs.
inline Status workspace_size(const ForwardParams& p, std::size_t* bytes) {
  return Status::from_c(qattn_fwd_workspace_size(&p.raw(), bytes));
}

// The SageAttention2-8b forward on `stream` (a cudaStream_t; nullptr = legacy default).
inline Status forward(const ForwardParams& p, void* workspace, std::size_t workspace_bytes,
                      void* stream) {
  return Status::from_c(qattn_fwd(&p.raw(), workspace, workspace_bytes, stream));
}

// Benchmarks only: the attention kernel alone, on a workspace a forward filled.
inline Status forward_attention_only(const ForwardParams& p, void* workspace,
                                     std::size_t workspace_bytes, void* stream) {
  return Status::from_c(qattn_fwd_attention_only(&p.raw(), workspace, workspace_bytes, stream));
}

inline bool device_supported(int device = -1) { return qattn_device_supported(device) != 0; }
inline bool built_with_cuda() { return qattn_built_with_cuda() != 0; }
inline std::string version() { return qattn_version_string(); }

}  // namespace qattn
