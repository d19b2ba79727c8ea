// qattn — C++ layer over the C ABI (qattn.h): a Status object instead of bare codes,
// an exception type for callers that prefer them, and builders for the forward and
// backward parameters with HND/NHD helpers. Header-only; adds nothing to the ABI.
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

// The precision modes of the SageAttention2-8b scheme (qattn.h's schemes): fast (INT8
// Q·Kᵀ, FP8 P·V), auto (fast with the heads the precision guard flags recomputed in 16
// bits), precise (both products in the inputs' 16-bit type).
enum class Precision {
  kFast = QATTN_SCHEME_SAGE2_8B,
  kAuto = QATTN_SCHEME_SAGE2_8B_AUTO,
  kPrecise = QATTN_SCHEME_PRECISE16,
};

// Memory order of a contiguous (B, H, N, d) tensor: HND = [B][H][N][d] (PyTorch SDPA),
// NHD = [B][N][H][d] (FlashAttention's varlen-friendly order).
enum class Layout { kHND, kNHD };
enum class Alignment { kBottomRight = QATTN_ALIGN_BOTTOM_RIGHT, kTopLeft = QATTN_ALIGN_TOP_LEFT };

// A view of a contiguous tensor in `layout`; `row_stride` (elements between two rows
// of d, >= d) lets a caller pad rows to a multiple of 8 elements. Fails (kInvalidArgument)
// when a stride does not fit in int64, instead of wrapping to a stride the caller never
// asked for.
inline Status make_tensor(const void* data, Layout layout, int heads, int seqlen,
                          int64_t row_stride, qattn_tensor* out) {
  // a * b, or false when it does not fit in int64 (no wrap: checked before multiplying).
  auto mul = [](int64_t a, int64_t b, int64_t* r) {
    if (a == INT64_MIN || b == INT64_MIN) return false;
    const int64_t ua = a < 0 ? -a : a, ub = b < 0 ? -b : b;
    if (ua != 0 && ub > INT64_MAX / ua) return false;
    *r = a * b;
    return true;
  };
  qattn_tensor t{const_cast<void*>(data), 0, 0, 0};
  const int64_t inner = layout == Layout::kHND ? seqlen : heads;
  const int64_t outer = layout == Layout::kHND ? heads : seqlen;
  int64_t mid = 0, big = 0;
  if (!mul(inner, row_stride, &mid) || !mul(outer, mid, &big))
    return {StatusCode::kInvalidArgument,
            "qattn::make_tensor: row_stride = " + std::to_string(row_stride) + " with heads = " +
                std::to_string(heads) + ", seqlen = " + std::to_string(seqlen) +
                " gives a stride beyond int64; allowed: strides of at most 2^63 - 1 elements"};
  if (layout == Layout::kHND) {
    t.stride_n = row_stride;
    t.stride_h = mid;
    t.stride_b = big;
  } else {
    t.stride_h = row_stride;
    t.stride_n = mid;
    t.stride_b = big;
  }
  *out = t;
  return {};
}

// The same, for strides known to fit; throws qattn::Error when they do not.
inline qattn_tensor make_tensor(const void* data, Layout layout, int heads, int seqlen,
                                int64_t row_stride) {
  qattn_tensor t{};
  make_tensor(data, layout, heads, seqlen, row_stride, &t).throw_if_error();
  return t;
}

namespace detail {
// The fields qattn_fwd_params and qattn_bwd_params share, by the same names.
template <typename Params>
void set_shape(Params& p, DType dtype, int batch, int heads_q, int heads_kv, int seqlen_q,
               int seqlen_kv, int head_dim) {
  p.dtype = static_cast<int32_t>(dtype);
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.seqlen_q = seqlen_q;
  p.seqlen_kv = seqlen_kv;
  p.head_dim = head_dim;
}
}  // namespace detail

// Builder of qattn_fwd_params. Shapes first, then the buffers; nothing is checked
// until workspace_size or forward, which check everything (a stride the builder could
// not represent is reported there, as the first error).
class ForwardParams {
 public:
  ForwardParams(DType dtype, int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_kv,
                int head_dim) {
    qattn_fwd_params_init(&p_);
    detail::set_shape(p_, dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim);
  }

  // Contiguous tensors in a layout (rows of head_dim elements; V's and O's of head_dim_v
  // where it is set: call head_dim_v first).
  ForwardParams& q(const void* data, Layout layout) { return q(data, layout, p_.head_dim); }
  ForwardParams& k(const void* data, Layout layout) { return k(data, layout, p_.head_dim); }
  ForwardParams& v(const void* data, Layout layout) { return v(data, layout, v_dim()); }
  ForwardParams& o(void* data, Layout layout) { return o(data, layout, v_dim()); }
  // The same with padded rows.
  ForwardParams& q(const void* data, Layout layout, int64_t row_stride) {
    return layout_tensor(p_.q, data, layout, p_.heads_q, p_.seqlen_q, row_stride);
  }
  ForwardParams& k(const void* data, Layout layout, int64_t row_stride) {
    return layout_tensor(p_.k, data, layout, p_.heads_kv, p_.seqlen_kv, row_stride);
  }
  ForwardParams& v(const void* data, Layout layout, int64_t row_stride) {
    return layout_tensor(p_.v, data, layout, p_.heads_kv, p_.seqlen_kv, row_stride);
  }
  ForwardParams& o(void* data, Layout layout, int64_t row_stride) {
    return layout_tensor(p_.o, data, layout, p_.heads_q, p_.seqlen_q, row_stride);
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
  // 0 restores the default 1/sqrt(head_dim); negative values are rejected.
  ForwardParams& sm_scale(float scale) {
    p_.sm_scale = scale;
    return *this;
  }
  ForwardParams& granularity(Granularity g) {
    p_.sage2.granularity = static_cast<int32_t>(g);
    return *this;
  }
  // The precision mode (the scheme it runs).
  ForwardParams& precision(Precision m) {
    p_.scheme = static_cast<int32_t>(m);
    return *this;
  }
  // A sliding window around the diagonal (qattn.h): keys more than `left` before or
  // `right` after it are hidden; -1 leaves that side unbounded.
  ForwardParams& window(int32_t left, int32_t right) {
    p_.window = 1;
    p_.window_left = left;
    p_.window_right = right;
    return *this;
  }
  // Key padding: a device array of `batch` int32 lengths (NULL: every key).
  ForwardParams& kv_lengths(const int32_t* lengths) {
    p_.kv_lengths = lengths;
    return *this;
  }
  // Where the diagonal of causal and of the window sits when seqlen_q != seqlen_kv.
  ForwardParams& alignment(Alignment a) {
    p_.alignment = static_cast<int32_t>(a);
    return *this;
  }
  // A boolean attn_mask (qattn.h): device bytes, nonzero = the query sees the key, with
  // strides in bytes for (b, h, query, key); 0 broadcasts a dimension. NULL: none.
  ForwardParams& bool_mask(const void* mask, int64_t stride_b, int64_t stride_h,
                           int64_t stride_q, int64_t stride_k) {
    p_.attn_mask_type = mask != nullptr ? QATTN_MASK_BOOL : QATTN_MASK_NONE;
    p_.attn_mask = mask;
    p_.attn_mask_stride_b = stride_b;
    p_.attn_mask_stride_h = stride_h;
    p_.attn_mask_stride_q = stride_q;
    p_.attn_mask_stride_k = stride_k;
    return *this;
  }

  // A packed variable-length batch (qattn.h): (batch + 1) int32 device offsets of the
  // queries and the keys, and bounds of the longest sequences. The builder's batch is
  // then the number of sequences and seqlen_q, seqlen_kv the packed totals; give the
  // tensors as (total, H, d) NHD views (Layout::kNHD, whose stride_b is ignored here).
  // NULL offsets (both) and 0 lengths clear it.
  ForwardParams& varlen(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                        int32_t max_seqlen_q, int32_t max_seqlen_k) {
    p_.cu_seqlens_q = cu_seqlens_q;
    p_.cu_seqlens_k = cu_seqlens_k;
    p_.max_seqlen_q = max_seqlen_q;
    p_.max_seqlen_k = max_seqlen_k;
    return *this;
  }

  // V and O with fewer channels than Q and K (MLA-style attention; qattn.h): 0 is
  // head_dim.
  ForwardParams& head_dim_v(int32_t d) {
    p_.head_dim_v = d;
    return *this;
  }

  // Optional (B, Hq, Nq) FP32 output: P's row maxima exp(m_i - lse_i), what the backward's
  // merge-free scales read (qattn.h; the SageAttention2-8b family writes it outside a
  // packed batch). nullptr: not written.
  ForwardParams& p_max(float* data) {
    p_.p_max = data;
    return *this;
  }

  const qattn_fwd_params& raw() const { return p_; }
  qattn_fwd_params& raw() { return p_; }
  // The first error the builder met (ok when none); workspace_size and forward return it.
  const Status& status() const { return status_; }

 private:
  ForwardParams& layout_tensor(qattn_tensor& dst, const void* data, Layout layout, int heads,
                               int seqlen, int64_t row_stride) {
    Status s = make_tensor(data, layout, heads, seqlen, row_stride, &dst);
    if (!s.ok() && status_.ok()) status_ = std::move(s);
    return *this;
  }
  ForwardParams& set(qattn_tensor& dst, const qattn_tensor& src) {
    dst = src;
    return *this;
  }
  int32_t v_dim() const { return p_.head_dim_v > 0 ? p_.head_dim_v : p_.head_dim; }
  qattn_fwd_params p_{};
  Status status_;
};

// The 8-bit format, the dO·Vᵀ precision and the scales of the backward (qattn_bwd_format,
// qattn_bwd_dov, qattn_bwd_scales).
enum class BackwardFormat { kInt8 = QATTN_BWD_INT8, kE4M3 = QATTN_BWD_E4M3 };
enum class DoV { k16Bit = QATTN_BWD_DOV_16BIT, kQuantized = QATTN_BWD_DOV_QUANTIZED };
enum class BackwardScales {
  kPerBlock = QATTN_BWD_SCALES_PER_BLOCK,
  kMergeFree = QATTN_BWD_SCALES_MERGE_FREE
};

// Builder of qattn_bwd_params, as ForwardParams: shapes first, then the buffers (the
// forward's q, k, v, o and lse, the gradient dout, the outputs dq, dk, dv); nothing is
// checked until workspace_size or backward.
class BackwardParams {
 public:
  BackwardParams(DType dtype, int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_kv,
                 int head_dim) {
    qattn_bwd_params_init(&p_);
    detail::set_shape(p_, dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim);
  }

  // Tensors in a layout; rs: elements between two rows (0: head_dim, contiguous).
  BackwardParams& q(const void* d, Layout l, int64_t rs = 0) { return qside(p_.q, d, l, rs); }
  BackwardParams& o(const void* d, Layout l, int64_t rs = 0) { return qside(p_.o, d, l, rs); }
  BackwardParams& dout(const void* d, Layout l, int64_t rs = 0) { return qside(p_.dout, d, l, rs); }
  BackwardParams& dq(void* d, Layout l, int64_t rs = 0) { return qside(p_.dq, d, l, rs); }
  BackwardParams& k(const void* d, Layout l, int64_t rs = 0) { return kvside(p_.k, d, l, rs); }
  BackwardParams& v(const void* d, Layout l, int64_t rs = 0) { return kvside(p_.v, d, l, rs); }
  BackwardParams& dk(void* d, Layout l, int64_t rs = 0) { return kvside(p_.dk, d, l, rs); }
  BackwardParams& dv(void* d, Layout l, int64_t rs = 0) { return kvside(p_.dv, d, l, rs); }
  // Arbitrary strides go through raw().

  // The forward's (B, Hq, Nq) FP32 natural-log LSE (required).
  BackwardParams& lse(const float* data) {
    p_.lse = data;
    return *this;
  }
  BackwardParams& causal(bool on) {
    p_.causal = on ? 1 : 0;
    return *this;
  }
  BackwardParams& sm_scale(float scale) {
    p_.sm_scale = scale;
    return *this;
  }
  BackwardParams& format(BackwardFormat f) {
    p_.format = static_cast<int32_t>(f);
    return *this;
  }
  BackwardParams& dov(DoV d) {
    p_.dov = static_cast<int32_t>(d);
    return *this;
  }
  // Bitwise-equal results run to run (no atomics; slower).
  BackwardParams& deterministic(bool on) {
    p_.deterministic = on ? 1 : 0;
    return *this;
  }
  // kMergeFree: format kE4M3 and dov k16Bit only, with the forward's p_max (qattn.h).
  BackwardParams& scales(BackwardScales s) {
    p_.scales = static_cast<int32_t>(s);
    return *this;
  }
  // The forward's (B, Hq, Nq) FP32 row maxima (ForwardParams::p_max), read with the
  // merge-free scales; nullptr otherwise.
  BackwardParams& p_max(const float* data) {
    p_.p_max = data;
    return *this;
  }

  const qattn_bwd_params& raw() const { return p_; }
  qattn_bwd_params& raw() { return p_; }
  const Status& status() const { return status_; }

 private:
  BackwardParams& tensor(qattn_tensor& dst, const void* data, Layout layout, int heads,
                         int seqlen, int64_t row_stride) {
    Status s = make_tensor(data, layout, heads, seqlen, row_stride == 0 ? p_.head_dim : row_stride,
                           &dst);
    if (!s.ok() && status_.ok()) status_ = std::move(s);
    return *this;
  }
  BackwardParams& qside(qattn_tensor& dst, const void* d, Layout l, int64_t rs) {
    return tensor(dst, d, l, p_.heads_q, p_.seqlen_q, rs);
  }
  BackwardParams& kvside(qattn_tensor& dst, const void* d, Layout l, int64_t rs) {
    return tensor(dst, d, l, p_.heads_kv, p_.seqlen_kv, rs);
  }
  qattn_bwd_params p_{};
  Status status_;
};

inline Status workspace_size(const BackwardParams& p, std::size_t* bytes) {
  if (!p.status().ok()) return p.status();
  return Status::from_c(qattn_bwd_workspace_size(&p.raw(), bytes));
}

// The backward on `stream` (a cudaStream_t; nullptr = legacy default).
inline Status backward(const BackwardParams& p, void* workspace, std::size_t workspace_bytes,
                       void* stream) {
  if (!p.status().ok()) return p.status();
  return Status::from_c(qattn_bwd(&p.raw(), workspace, workspace_bytes, stream));
}

// Checks the parameters and returns the workspace bytes qattn::forward needs.
inline Status workspace_size(const ForwardParams& p, std::size_t* bytes) {
  if (!p.status().ok()) return p.status();
  return Status::from_c(qattn_fwd_workspace_size(&p.raw(), bytes));
}

// The forward on `stream` (a cudaStream_t; nullptr = legacy default).
inline Status forward(const ForwardParams& p, void* workspace, std::size_t workspace_bytes,
                      void* stream) {
  if (!p.status().ok()) return p.status();
  return Status::from_c(qattn_fwd(&p.raw(), workspace, workspace_bytes, stream));
}

inline bool device_supported(int device = -1) { return qattn_device_supported(device) != 0; }
inline bool built_with_cuda() { return qattn_built_with_cuda() != 0; }
inline std::string version() { return qattn_version_string(); }

}  // namespace qattn
