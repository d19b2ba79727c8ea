#include "api/validate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "api/checks.h"
#include "api/error.h"
#include "api/registry.h"
#include "numerics/sm_scale.h"

namespace qattn::api {
// The shared checks (checks.h) are defined here with this file's own helpers.
namespace checks {

constexpr int64_t kElemBytes = 2;  // fp16 and bf16

// Overflow-checked int64 arithmetic; false when the result does not fit.

// Byte range of a view whose strides passed check_tensor (no overflow then).
Span span_of(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen, int64_t d) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  return {addr, addr + view_span_bytes(t, batch, heads, seqlen, d)};
}

template <typename Params>
std::size_t lse_bytes(const Params& p) {
  return static_cast<std::size_t>(int64_t{p.batch} * p.heads_q * p.seqlen_q) * sizeof(float);
}

// A packed variable-length batch (qattn.h): cu_seqlens set. Its tensors are (1, H, total,
// d) views, so the batch extent of every view (and of the LSE) is 1.
bool packed(const qattn_fwd_params& p) { return p.cu_seqlens_q != nullptr; }
int64_t view_batch(const qattn_fwd_params& p) { return packed(p) ? 1 : p.batch; }

std::size_t lse_bytes(const qattn_fwd_params& p) {
  return static_cast<std::size_t>(view_batch(p) * p.heads_q * p.seqlen_q) * sizeof(float);
}

// Each cu_seqlens array: batch + 1 int32 offsets.
std::size_t cu_seqlens_bytes(const qattn_fwd_params& p) {
  return static_cast<std::size_t>(int64_t{p.batch} + 1) * sizeof(int32_t);
}

// The forward's key-padding lengths: one int32 per batch entry.
std::size_t kv_lengths_bytes(const qattn_fwd_params& p) {
  return static_cast<std::size_t>(p.batch) * sizeof(int32_t);
}

Span array_span(const void* data, std::size_t bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(data);
  return {addr, addr + bytes};
}

// Bytes from the attn_mask pointer to one past its last element read: every stride is
// >= 0 (checked), so the last element is the one at the largest indices. 0 without a mask.
std::size_t attn_mask_bytes(const qattn_fwd_params& p) {
  if (p.attn_mask_type == QATTN_MASK_NONE) return 0;
  const int64_t element = p.attn_mask_type == QATTN_MASK_ADDITIVE ? 2 : 1;
  const int64_t last = (p.batch - 1) * p.attn_mask_stride_b + (p.heads_q - 1) * p.attn_mask_stride_h +
                       (p.seqlen_q - 1) * p.attn_mask_stride_q +
                       (p.seqlen_kv - 1) * p.attn_mask_stride_k;
  return static_cast<std::size_t>(last + element);
}

// The forward's buffers, in the order the checks name them.
struct ForwardBuffers {
  std::array<Named, 7> inputs;   // q, k, v, kv_lengths, attn_mask, cu_seqlens_q, cu_seqlens_k
  std::array<Named, 3> outputs;  // o, lse, p_max
};

ForwardBuffers buffers_of(const qattn_fwd_params& p) {
  const int64_t vb = view_batch(p);
  ForwardBuffers b{
      {{{"q", span_of(p.q, vb, p.heads_q, p.seqlen_q, p.head_dim)},
        {"k", span_of(p.k, vb, p.heads_kv, p.seqlen_kv, p.head_dim)},
        {"v", span_of(p.v, vb, p.heads_kv, p.seqlen_kv, head_dim_v(p))},
        {"kv_lengths", {}, false},
        {"attn_mask", {}, false},
        {"cu_seqlens_q", {}, false},
        {"cu_seqlens_k", {}, false}}},
      {{{"o", span_of(p.o, vb, p.heads_q, p.seqlen_q, head_dim_v(p))},
        {"lse", {}, false},
        {"p_max", {}, false}}}};
  if (p.kv_lengths != nullptr)
    b.inputs[3] = {"kv_lengths", array_span(p.kv_lengths, kv_lengths_bytes(p))};
  if (p.attn_mask_type != QATTN_MASK_NONE)
    b.inputs[4] = {"attn_mask", array_span(p.attn_mask, attn_mask_bytes(p))};
  if (p.cu_seqlens_q != nullptr)
    b.inputs[5] = {"cu_seqlens_q", array_span(p.cu_seqlens_q, cu_seqlens_bytes(p))};
  if (p.cu_seqlens_k != nullptr)
    b.inputs[6] = {"cu_seqlens_k", array_span(p.cu_seqlens_k, cu_seqlens_bytes(p))};
  if (p.lse != nullptr) b.outputs[1] = {"lse", array_span(p.lse, lse_bytes(p))};
  if (p.p_max != nullptr) b.outputs[2] = {"p_max", array_span(p.p_max, lse_bytes(p))};
  return b;
}

// The backward's buffers: everything it reads (which may overlap each other), then
// what it writes.
struct BackwardBuffers {
  std::array<Named, 7> inputs;   // q, k, v, o, dout, lse, p_max
  std::array<Named, 3> outputs;  // dq, dk, dv
};

BackwardBuffers buffers_of(const qattn_bwd_params& p) {
  const int64_t b = p.batch, hq = p.heads_q, hkv = p.heads_kv, nq = p.seqlen_q, nkv = p.seqlen_kv,
                d = p.head_dim;
  return {{{{"q", span_of(p.q, b, hq, nq, d)},
            {"k", span_of(p.k, b, hkv, nkv, d)},
            {"v", span_of(p.v, b, hkv, nkv, d)},
            {"o", span_of(p.o, b, hq, nq, d)},
            {"dout", span_of(p.dout, b, hq, nq, d)},
            {"lse", array_span(p.lse, lse_bytes(p))},
            {"p_max", array_span(p.p_max, lse_bytes(p)), p.p_max != nullptr}}},
          {{{"dq", span_of(p.dq, b, hq, nq, d)},
            {"dk", span_of(p.dk, b, hkv, nkv, d)},
            {"dv", span_of(p.dv, b, hkv, nkv, d)}}}};
}

// Every element of an output has its own address. Rows are head_dim contiguous
// elements, so that holds exactly when no two row starts b*sb + h*sh + n*sn lie closer
// than head_dim. `dims` are (b, h, n) with the strides of extent-1 dimensions zeroed.
qattn_status check_no_self_alias(const char* fn, const char* name, const qattn_tensor& t,
                                 const std::array<Dim, 3>& dims, int64_t head_dim) {
  // Sufficient and cheap: sorted by stride, each dimension steps past everything the
  // smaller ones span (HND, NHD and their padded forms all pass here).
  std::array<Dim, 3> sorted = dims;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t spanned = head_dim;  // elements covered by the dimensions seen so far
  bool nested = true;
  for (const Dim& d : sorted) {
    if (d.extent == 1) continue;
    if (d.stride < spanned) {
      nested = false;
      break;
    }
    spanned = d.stride * (d.extent - 1) + spanned;  // no overflow: bounded by the span check
  }
  if (nested) return QATTN_OK;

  // The strides interleave rows (a dimension starts inside another's span): decide it
  // exactly by sorting every row's start and looking at neighbours.
  const int64_t rows = dims[0].extent * dims[1].extent * dims[2].extent;
  if (rows > kMaxInterleavedRows)
    return fail(QATTN_ERROR_UNSUPPORTED, fn, ": ", name,
                " has interleaved strides (stride_b = ", t.stride_b, ", stride_h = ", t.stride_h,
                ", stride_n = ", t.stride_n, ") and ", rows,
                " rows; an output whose strides interleave is supported up to ",
                kMaxInterleavedRows,
                " rows (each row's start is checked against the others); allowed beyond that: "
                "strides that, sorted, each step past the rows and heads they contain");
  std::vector<std::pair<int64_t, int64_t>> starts;  // (element offset, row index)
  starts.reserve(static_cast<std::size_t>(rows));
  for (int64_t b = 0; b < dims[0].extent; ++b)
    for (int64_t h = 0; h < dims[1].extent; ++h)
      for (int64_t n = 0; n < dims[2].extent; ++n)
        starts.emplace_back(b * dims[0].stride + h * dims[1].stride + n * dims[2].stride,
                            (b * dims[1].extent + h) * dims[2].extent + n);
  std::sort(starts.begin(), starts.end());
  for (std::size_t i = 1; i < starts.size(); ++i) {
    if (starts[i].first - starts[i - 1].first >= head_dim) continue;
    auto index = [&](int64_t row) {
      return cat("[", row / (dims[1].extent * dims[2].extent), ", ",
                 row / dims[2].extent % dims[1].extent, ", ", row % dims[2].extent, "]");
    };
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".stride_b = ", t.stride_b, ", ",
                name, ".stride_h = ", t.stride_h, ", ", name, ".stride_n = ", t.stride_n,
                " make elements of ", name, " share addresses: the rows ", name,
                "[b, h, n] = ", index(starts[i - 1].second), " and ", index(starts[i].second),
                " start ", starts[i].first - starts[i - 1].first,
                " elements apart, less than its rows' ", head_dim, " elements",
                "; allowed: strides under which no two rows meet (an output may not "
                "alias itself)");
  }
  return QATTN_OK;
}

// Checks one (B, H, N, d) view: pointer, alignment, strides, size arithmetic. `writes`
// adds the check that no two elements share an address.
qattn_status check_tensor(const char* fn, const char* name, const qattn_tensor& t, int64_t batch,
                          int64_t heads, int64_t seqlen, int64_t head_dim, bool writes) {
  if (t.data == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".data is NULL");
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  if (addr % kTensorAlign != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".data = ", t.data,
                " is not 16-byte aligned (the kernels move 16 bytes at a time)");
  std::array<Dim, 3> dims{{{"stride_b", batch, t.stride_b},
                           {"stride_h", heads, t.stride_h},
                           {"stride_n", seqlen, t.stride_n}}};
  int64_t last = head_dim - 1;  // offset of the last element, in elements
  for (Dim& d : dims) {
    if (d.extent == 1) {
      d.stride = 0;  // never multiplied by a non-zero index
      continue;
    }
    if (d.stride <= 0 || d.stride % kStrideMultiple != 0)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".", d.name, " = ", d.stride,
                  "; allowed: a positive multiple of ", kStrideMultiple,
                  " elements (16 bytes). A contiguous tensor needs head_dim % 8 == 0: pad each "
                  "row to a multiple of 8 elements");
    int64_t bytes = 0;
    if (!mul(d.stride, kElemBytes, &bytes) || bytes >= kMaxStrideBytes)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".", d.name, " = ", d.stride,
                  " elements; allowed: below 2^40 bytes");
    int64_t part = 0;
    if (!mul(d.extent - 1, d.stride, &part) || !add(last, part, &last))
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name,
                  " spans more than 2^63 elements (strides too large)");
  }
  int64_t end_bytes = 0;
  if (!add(last, 1, &end_bytes) || !mul(end_bytes, kElemBytes, &end_bytes) ||
      addr > UINTPTR_MAX - static_cast<uintptr_t>(end_bytes))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name,
                " runs past the end of the address space (data + strides)");

  if (writes) return check_no_self_alias(fn, name, t, dims, head_dim);
  return QATTN_OK;
}

// A non-NULL array of `bytes` bytes: aligned to `align` and inside the address space.
// `allowed` is the text after "allowed: " in the alignment message.
qattn_status check_array(const char* fn, const char* name, const void* data, std::size_t bytes,
                         std::size_t align, const char* allowed) {
  const auto addr = reinterpret_cast<uintptr_t>(data);
  if (addr % align != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", data, " is not ", align,
                "-byte aligned; allowed: ", allowed);
  if (addr > UINTPTR_MAX - bytes)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name,
                " runs past the end of the address space");
  return QATTN_OK;
}

// The LSE: 4-byte aligned floats, (B, Hq, Nq) of them inside the address space.
// `required`: the backward reads it; the forward's is optional.
template <typename Params>
qattn_status check_lse(const char* fn, const Params& p, const float* lse, bool required) {
  if (lse == nullptr) {
    if (!required) return QATTN_OK;
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": lse is NULL; allowed: the forward's (B, Hq, Nq) FP32 LSE (qattn_fwd with lse "
                "set), required by the backward");
  }
  return check_array(fn, "lse", lse, lse_bytes(p), kLseAlign,
                     required ? "a float array" : "NULL or a float array");
}

// The forward's optional key-padding lengths: `batch` 4-byte aligned int32 (an input:
// the overlap checks keep every output and the workspace off it).
qattn_status check_kv_lengths(const char* fn, const qattn_fwd_params& p) {
  if (p.kv_lengths == nullptr) return QATTN_OK;
  return check_array(fn, "kv_lengths", p.kv_lengths, kv_lengths_bytes(p), kKvLengthsAlign,
                     "NULL or a (batch,) int32 array");
}

// The forward's window and alignment (qattn.h): window a 0/1 flag, each window side -1
// (no bound) or a number of keys (checked whatever the flag says, so that a side is never
// out of range when the flag is turned on), the alignment one of the two qattn_alignment
// values.
qattn_status check_window_alignment(const char* fn, const qattn_fwd_params& p) {
  if (auto s = check_flag(fn, "window", p.window); s) return s;
  for (auto [name, value] :
       {std::pair{"window_left", p.window_left}, std::pair{"window_right", p.window_right}})
    if (value < -1)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value,
                  "; allowed: -1 (no bound, the default) or a number of keys >= 0");
  if (p.alignment != QATTN_ALIGN_BOTTOM_RIGHT && p.alignment != QATTN_ALIGN_TOP_LEFT)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": alignment = ", p.alignment,
                "; allowed: QATTN_ALIGN_BOTTOM_RIGHT (0) or QATTN_ALIGN_TOP_LEFT (1)");
  return QATTN_OK;
}

// The forward's attn_mask (qattn.h): a known type, and with a mask a pointer and strides
// >= 0 whose last element's offset fits in 2^62 bytes (so the span arithmetic cannot
// overflow); without one the pointer and the strides are not read. Its combination
// with causal, window and kv_lengths is the families' to accept (registry.cpp).
qattn_status check_attn_mask(const char* fn, const qattn_fwd_params& p) {
  if (auto s = check_reserved(fn, "reserved1", p.reserved1, "qattn_fwd_params_init"); s) return s;
  if (p.attn_mask_type != QATTN_MASK_NONE && p.attn_mask_type != QATTN_MASK_BOOL &&
      p.attn_mask_type != QATTN_MASK_ADDITIVE)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": attn_mask_type = ", p.attn_mask_type,
                "; allowed: QATTN_MASK_NONE (0), QATTN_MASK_BOOL (1) or QATTN_MASK_ADDITIVE (2)");
  if (p.attn_mask_type == QATTN_MASK_NONE) return QATTN_OK;
  const char* type = p.attn_mask_type == QATTN_MASK_BOOL ? "QATTN_MASK_BOOL" : "QATTN_MASK_ADDITIVE";
  if (p.attn_mask == nullptr)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": attn_mask is NULL with attn_mask_type = ",
                type, "; allowed: a device pointer to the mask's elements");
  constexpr int64_t kMaxMaskBytes = int64_t{1} << 62;
  int64_t last = 0;
  for (auto [name, stride, extent] :
       {std::tuple{"attn_mask_stride_b", p.attn_mask_stride_b, int64_t{p.batch}},
        std::tuple{"attn_mask_stride_h", p.attn_mask_stride_h, int64_t{p.heads_q}},
        std::tuple{"attn_mask_stride_q", p.attn_mask_stride_q, int64_t{p.seqlen_q}},
        std::tuple{"attn_mask_stride_k", p.attn_mask_stride_k, int64_t{p.seqlen_kv}}}) {
    int64_t part = 0;
    if (stride < 0 || !mul(extent - 1, stride, &part) || !add(last, part, &last) ||
        last >= kMaxMaskBytes)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", stride,
                  stride < 0 ? " is negative" : " makes the mask span 2^62 bytes or more",
                  "; allowed: a stride in bytes >= 0 (0 broadcasts the dimension)");
  }
  const auto addr = reinterpret_cast<uintptr_t>(p.attn_mask);
  const int64_t element = p.attn_mask_type == QATTN_MASK_ADDITIVE ? 2 : 1;
  if (addr > UINTPTR_MAX - static_cast<uintptr_t>(last + element))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": attn_mask runs past the end of the address space (data + strides)");
  return QATTN_OK;
}

// A packed variable-length batch (qattn.h): both offset arrays or neither; the max
// lengths 0 without them and within 1..the totals with them; neither kv_lengths (whose
// role cu_seqlens_k has) nor attn_mask (whose (Nq, Nkv) indexing a pack does not define)
// with them; each array 4-byte aligned and inside the address space. Host arithmetic on
// the fields and the addresses only: the offsets themselves are device memory, never read
// here (a varlen kernel clamps them).
qattn_status check_varlen(const char* fn, const qattn_fwd_params& p) {
  const bool has_q = p.cu_seqlens_q != nullptr, has_k = p.cu_seqlens_k != nullptr;
  if (has_q != has_k)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", has_q ? "cu_seqlens_q" : "cu_seqlens_k",
                " is set but ", has_q ? "cu_seqlens_k" : "cu_seqlens_q",
                " is NULL; allowed: both (a packed variable-length batch) or neither");
  if (!has_q) {
    for (auto [name, value] :
         {std::pair{"max_seqlen_q", p.max_seqlen_q}, std::pair{"max_seqlen_k", p.max_seqlen_k}})
      if (value != 0)
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value,
                    " without cu_seqlens_q and cu_seqlens_k; allowed: 0 (the max lengths "
                    "belong to a packed batch)");
    return QATTN_OK;
  }
  if (auto s = check_int(fn, "max_seqlen_q", p.max_seqlen_q, 1, p.seqlen_q,
                         " (1..seqlen_q, the packed query tokens: at least the longest query "
                         "sequence, at most their total)");
      s)
    return s;
  if (auto s = check_int(fn, "max_seqlen_k", p.max_seqlen_k, 1, p.seqlen_kv,
                         " (1..seqlen_kv, the packed keys: at least the longest key sequence, "
                         "at most their total)");
      s)
    return s;
  if (p.kv_lengths != nullptr)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": kv_lengths is set with cu_seqlens_q/cu_seqlens_k; allowed: kv_lengths NULL "
                "in a packed batch (cu_seqlens_k gives each sequence its keys)");
  if (p.attn_mask_type != QATTN_MASK_NONE)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": attn_mask_type = ",
                p.attn_mask_type == QATTN_MASK_BOOL ? "QATTN_MASK_BOOL" : "QATTN_MASK_ADDITIVE",
                " with cu_seqlens_q/cu_seqlens_k; allowed: "
                "no attn_mask in a packed batch (not combinable in this version)");
  for (auto [name, data] : {std::pair{"cu_seqlens_q", p.cu_seqlens_q},
                            std::pair{"cu_seqlens_k", p.cu_seqlens_k}})
    if (auto s = check_array(fn, name, data, cu_seqlens_bytes(p), kCuSeqlensAlign,
                             "NULL or a (batch + 1,) int32 device array");
        s)
      return s;
  return QATTN_OK;
}

qattn_status check_int(const char* fn, const char* name, int value, int lo, int hi,
                       const char* why) {
  if (value < lo || value > hi)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value, "; allowed: ", lo, "..",
                hi, why);
  return QATTN_OK;
}

// A 0/1 flag.
qattn_status check_flag(const char* fn, const char* name, int32_t value) {
  if (value != 0 && value != 1)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value, "; allowed: 0 or 1");
  return QATTN_OK;
}

qattn_status check_dtype(const char* fn, int32_t dtype) {
  if (dtype != QATTN_DTYPE_FP16 && dtype != QATTN_DTYPE_BF16)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": dtype = ", dtype,
                "; allowed: QATTN_DTYPE_FP16 (0) or QATTN_DTYPE_BF16 (1)");
  return QATTN_OK;
}

// The fields both directions share, with the same rules: shape, mask, scale.
template <typename Params>
qattn_status check_shape_mask_scale(const char* fn, const Params& p) {
  if (auto s = check_int(fn, "batch", p.batch, 1, kMaxGridDim, " (a grid dimension)"); s) return s;
  if (auto s = check_int(fn, "heads_q", p.heads_q, 1, kMaxGridDim, " (a grid dimension)"); s)
    return s;
  if (auto s = check_int(fn, "heads_kv", p.heads_kv, 1, kMaxGridDim); s) return s;
  if (p.heads_q % p.heads_kv != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": heads_q = ", p.heads_q,
                " is not a multiple of heads_kv = ", p.heads_kv,
                "; allowed: heads_q = g * heads_kv (GQA/MQA)");
  if (auto s = check_int(fn, "seqlen_q", p.seqlen_q, 1, kMaxSeqlen); s) return s;
  if (auto s = check_int(fn, "seqlen_kv", p.seqlen_kv, 1, kMaxSeqlen); s) return s;
  if (p.head_dim < 1)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": head_dim = ", p.head_dim,
                "; allowed: 1.. (the kernel families say which sizes they run)");
  if (auto s = check_flag(fn, "causal", p.causal); s) return s;
  return check_sm_scale(fn, p.sm_scale);
}

// 0 selects the default; a negative scale is not "the default" (the reference would
// honour its sign), and above kMaxSmScale the FP32 scores overflow (qattn.h derives the
// bound from the largest |q·k| of FP16-range inputs).
qattn_status check_sm_scale(const char* fn, float sm_scale) {
  if (!std::isfinite(sm_scale) || sm_scale < 0.f || sm_scale > kMaxSmScale)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": sm_scale = ", sm_scale,
                !std::isfinite(sm_scale) ? " is not finite"
                : sm_scale < 0.f         ? " is negative"
                                         : " would overflow the FP32 scores",
                "; allowed: 0 (selects 1/sqrt(head_dim)) or a positive number up to ", kMaxSmScale,
                " (QATTN_MAX_SM_SCALE)");
  return QATTN_OK;
}

qattn_status check_reserved(const char* fn, const char* name, int32_t value,
                            const char* init_name) {
  if (value != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value, "; allowed: 0 (",
                init_name, " sets it)");
  return QATTN_OK;
}

template <typename Params>
Params with_default_scale(const Params& p) {
  Params r = p;
  if (r.sm_scale == 0.f) r.sm_scale = numerics::default_sm_scale(r.head_dim);
  return r;
}

}  // namespace checks

using namespace checks;

// ---- the forward -----------------------------------------------------------------------

// The layouts qattn_fwd_params has had: 0.1.0's, then with the masks beyond causal,
// with attn_mask, with the packed batch, with V's head dim, and with P's row maxima.
constexpr std::array<std::size_t, 6> kFwdParamsLayouts{
    QATTN_FWD_PARAMS_MIN_SIZE, offsetof(qattn_fwd_params, attn_mask_type),
    offsetof(qattn_fwd_params, cu_seqlens_q), offsetof(qattn_fwd_params, head_dim_v),
    offsetof(qattn_fwd_params, p_max), sizeof(qattn_fwd_params)};
static_assert(offsetof(qattn_fwd_params, cu_seqlens_q) ==
                  offsetof(qattn_fwd_params, attn_mask_stride_k) + sizeof(int64_t),
              "the packed batch's fields start where the third layout ends");
static_assert(offsetof(qattn_fwd_params, head_dim_v) ==
                  offsetof(qattn_fwd_params, max_seqlen_k) + sizeof(int32_t),
              "V's head dim starts where the fourth layout ends");
static_assert(offsetof(qattn_fwd_params, p_max) ==
                  offsetof(qattn_fwd_params, reserved2) + sizeof(int32_t),
              "P's row maxima start where the fifth layout ends");
static_assert(sizeof(qattn_fwd_params) ==
                  offsetof(qattn_fwd_params, reserved4) + sizeof(int32_t),
              "the sixth layout ends without tail padding");
static_assert(offsetof(qattn_fwd_params, attn_mask_type) ==
                  offsetof(qattn_fwd_params, alignment) + sizeof(int32_t),
              "attn_mask's fields start where the second layout ends");
static_assert(offsetof(qattn_fwd_params, kv_lengths) == QATTN_FWD_PARAMS_MIN_SIZE,
              "the masks' fields start where the first layout ends");

qattn_status read_params(const char* fn, const qattn_fwd_params* p, qattn_fwd_params* out) {
  return read_struct(fn, p, out, "qattn_fwd_params", std::span<const std::size_t>(kFwdParamsLayouts),
                     "qattn_fwd_params_init", &qattn_fwd_params_init);
}

qattn_status validate_forward(const char* fn, const qattn_fwd_params& p,
                              std::span<const ForwardFamily* const> families) {
  // ---- scalars ----
  if (auto s = check_dtype(fn, p.dtype); s) return s;
  if (p.scheme != QATTN_SCHEME_SAGE2_8B && p.scheme != QATTN_SCHEME_SAGE3_NVFP4 &&
      p.scheme != QATTN_SCHEME_PRECISE16 && p.scheme != QATTN_SCHEME_SAGE2_8B_AUTO)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": scheme = ", p.scheme,
                "; allowed: QATTN_SCHEME_SAGE2_8B (0), QATTN_SCHEME_SAGE3_NVFP4 (1), "
                "QATTN_SCHEME_PRECISE16 (2), QATTN_SCHEME_SAGE2_8B_AUTO (3)");
  if (auto s = check_shape_mask_scale(fn, p); s) return s;
  if (auto s = check_window_alignment(fn, p); s) return s;
  if (auto s = check_attn_mask(fn, p); s) return s;
  if (auto s = check_varlen(fn, p); s) return s;
  if (auto s = check_reserved(fn, "reserved0", p.reserved0, "qattn_fwd_params_init"); s) return s;
  if (auto s = check_reserved(fn, "reserved2", p.reserved2, "qattn_fwd_params_init"); s) return s;
  if (auto s = check_reserved(fn, "reserved3", p.reserved3, "qattn_fwd_params_init"); s) return s;
  if (auto s = check_reserved(fn, "reserved4", p.reserved4, "qattn_fwd_params_init"); s) return s;
  if (p.head_dim_v < 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": head_dim_v = ", p.head_dim_v,
                "; allowed: 0 (V has head_dim's channels) or 1.. (V's and O's own head dim)");
  if (p.scheme == QATTN_SCHEME_SAGE2_8B || p.scheme == QATTN_SCHEME_SAGE2_8B_AUTO) {
    const int32_t gran = p.sage2.granularity;
    if (gran != QATTN_QK_PER_THREAD && gran != QATTN_QK_PER_WARP && gran != QATTN_QK_PER_BLOCK)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": sage2.granularity = ", gran,
                  "; allowed: QATTN_QK_PER_THREAD (0), QATTN_QK_PER_WARP (1), "
                  "QATTN_QK_PER_BLOCK (2)");
  }

  // ---- a kernel family for it (on some device: the device is checked at launch) ----
  qattn_status support = QATTN_OK;
  if (select_family(fn, p, nullptr, &support, families) == nullptr) return support;

  // ---- tensors (a packed batch's are (1, H, total, d) views) ----
  const int64_t d = p.head_dim, dv = head_dim_v(p), vb = view_batch(p);
  if (auto st = check_tensor(fn, "q", p.q, vb, p.heads_q, p.seqlen_q, d, false); st) return st;
  if (auto st = check_tensor(fn, "k", p.k, vb, p.heads_kv, p.seqlen_kv, d, false); st) return st;
  if (auto st = check_tensor(fn, "v", p.v, vb, p.heads_kv, p.seqlen_kv, dv, false); st) return st;
  if (auto st = check_tensor(fn, "o", p.o, vb, p.heads_q, p.seqlen_q, dv, true); st) return st;
  if (auto st = check_lse(fn, p, p.lse, /*required=*/false); st) return st;
  if (p.p_max != nullptr)
    if (auto st = check_array(fn, "p_max", p.p_max, lse_bytes(p), kLseAlign,
                              "NULL or a (B, Hq, Nq) float array");
        st)
      return st;
  if (auto st = check_kv_lengths(fn, p); st) return st;
  const ForwardBuffers b = buffers_of(p);
  return check_overlaps(fn, b.inputs, b.outputs, [](const char* out) {
    const std::string_view name(out);
    return name == "lse" || name == "p_max" ? "a separate (B, Hq, Nq) float buffer"
                                            : "an output buffer separate from the inputs";
  });
}

std::size_t forward_workspace_bytes(const qattn_fwd_params& p,
                                   std::span<const ForwardFamily* const> families) {
  return workspace_bytes_for(p, families);
}

qattn_status validate_workspace(const char* fn, const qattn_fwd_params& p, const void* workspace,
                                std::size_t workspace_bytes,
                                std::span<const ForwardFamily* const> families) {
  const ForwardBuffers b = buffers_of(p);
  return check_workspace(fn, "qattn_fwd_workspace_size", forward_workspace_bytes(p, families),
                         workspace, workspace_bytes, join(b.inputs, b.outputs));
}

std::size_t view_span_bytes(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen,
                            int64_t head_dim) {
  auto step = [](int64_t extent, int64_t stride) { return extent > 1 ? (extent - 1) * stride : 0; };
  const int64_t last =
      step(batch, t.stride_b) + step(heads, t.stride_h) + step(seqlen, t.stride_n) + head_dim - 1;
  return static_cast<std::size_t>((last + 1) * kElemBytes);
}

std::array<BufferSpan, 11> buffer_spans(const qattn_fwd_params& p, const void* workspace) {
  const int64_t vb = view_batch(p);
  return {{{"q.data", p.q.data, view_span_bytes(p.q, vb, p.heads_q, p.seqlen_q, p.head_dim)},
           {"k.data", p.k.data, view_span_bytes(p.k, vb, p.heads_kv, p.seqlen_kv, p.head_dim)},
           {"v.data", p.v.data, view_span_bytes(p.v, vb, p.heads_kv, p.seqlen_kv, head_dim_v(p))},
           {"kv_lengths", p.kv_lengths, p.kv_lengths != nullptr ? kv_lengths_bytes(p) : 0},
           {"attn_mask", p.attn_mask, attn_mask_bytes(p)},
           {"cu_seqlens_q", p.cu_seqlens_q, p.cu_seqlens_q != nullptr ? cu_seqlens_bytes(p) : 0},
           {"cu_seqlens_k", p.cu_seqlens_k, p.cu_seqlens_k != nullptr ? cu_seqlens_bytes(p) : 0},
           {"o.data", p.o.data, view_span_bytes(p.o, vb, p.heads_q, p.seqlen_q, head_dim_v(p))},
           {"lse", p.lse, p.lse != nullptr ? lse_bytes(p) : 0},
           {"p_max", p.p_max, p.p_max != nullptr ? lse_bytes(p) : 0},
           {"workspace", workspace, forward_workspace_bytes(p)}}};
}

qattn_fwd_params resolve_defaults(const qattn_fwd_params& p) { return with_default_scale(p); }

// ---- the backward ----------------------------------------------------------------------

// The layouts qattn_bwd_params has had: 0.1.0's, then with the merge-free scales.
constexpr std::array<std::size_t, 2> kBwdParamsLayouts{QATTN_BWD_PARAMS_MIN_SIZE,
                                                       sizeof(qattn_bwd_params)};
static_assert(offsetof(qattn_bwd_params, p_max) == QATTN_BWD_PARAMS_MIN_SIZE,
              "the merge-free scales' fields start where the first layout ends");
static_assert(sizeof(qattn_bwd_params) == offsetof(qattn_bwd_params, reserved2) + sizeof(int32_t),
              "the second layout ends without tail padding");

qattn_status read_params(const char* fn, const qattn_bwd_params* p, qattn_bwd_params* out) {
  return read_struct(fn, p, out, "qattn_bwd_params", std::span<const std::size_t>(kBwdParamsLayouts),
                     "qattn_bwd_params_init", &qattn_bwd_params_init);
}

qattn_status validate_backward(const char* fn, const qattn_bwd_params& p) {
  // ---- scalars ----
  if (auto s = check_dtype(fn, p.dtype); s) return s;
  if (auto s = check_shape_mask_scale(fn, p); s) return s;
  if (p.format != QATTN_BWD_INT8 && p.format != QATTN_BWD_E4M3)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": format = ", p.format,
                "; allowed: QATTN_BWD_INT8 (0) or QATTN_BWD_E4M3 (1)");
  if (p.dov != QATTN_BWD_DOV_16BIT && p.dov != QATTN_BWD_DOV_QUANTIZED)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": dov = ", p.dov,
                "; allowed: QATTN_BWD_DOV_16BIT (0) or QATTN_BWD_DOV_QUANTIZED (1)");
  if (auto s = check_flag(fn, "deterministic", p.deterministic); s) return s;
  if (auto s = check_reserved(fn, "reserved0", p.reserved0, "qattn_bwd_params_init"); s) return s;
  if (auto s = check_reserved(fn, "reserved1", p.reserved1, "qattn_bwd_params_init"); s) return s;
  if (auto s = check_reserved(fn, "reserved2", p.reserved2, "qattn_bwd_params_init"); s) return s;
  if (p.scales != QATTN_BWD_SCALES_PER_BLOCK && p.scales != QATTN_BWD_SCALES_MERGE_FREE)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": scales = ", p.scales,
                "; allowed: QATTN_BWD_SCALES_PER_BLOCK (0) or QATTN_BWD_SCALES_MERGE_FREE (1)");
  if (p.scales == QATTN_BWD_SCALES_MERGE_FREE) {
    if (p.format != QATTN_BWD_E4M3)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": scales = QATTN_BWD_SCALES_MERGE_FREE with format = ",
                  p.format, "; allowed: format QATTN_BWD_E4M3 (1) only (INT8 codes are linear: a "
                  "scale fixed from a bound leaves them too few)");
    if (p.dov != QATTN_BWD_DOV_16BIT)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                  ": scales = QATTN_BWD_SCALES_MERGE_FREE with dov = ", p.dov,
                  "; allowed: dov QATTN_BWD_DOV_16BIT (0) only (dS's bound is built on the 16-bit "
                  "dO·Vᵀ)");
    if (p.p_max == nullptr)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                  ": p_max is NULL; allowed with scales = QATTN_BWD_SCALES_MERGE_FREE: the "
                  "forward's (B, Hq, Nq) FP32 p_max (qattn_fwd with p_max set)");
  } else if (p.p_max != nullptr) {
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": p_max is set with scales = QATTN_BWD_SCALES_PER_BLOCK; allowed: NULL (only the "
                "merge-free scales read it)");
  }

  // ---- a kernel family for it (on some device: the device is checked at launch) ----
  qattn_status support = QATTN_OK;
  if (select_family(fn, p, nullptr, &support) == nullptr) return support;

  // ---- tensors: the inputs, the LSE, then the outputs (each alias-free) ----
  const int64_t b = p.batch, hq = p.heads_q, hkv = p.heads_kv, nq = p.seqlen_q, nkv = p.seqlen_kv,
                d = p.head_dim;
  struct View {
    const char* name;
    const qattn_tensor* t;
    int64_t heads, seqlen;
    bool writes;
  };
  const std::array<View, 8> views{{{"q", &p.q, hq, nq, false},
                                   {"k", &p.k, hkv, nkv, false},
                                   {"v", &p.v, hkv, nkv, false},
                                   {"o", &p.o, hq, nq, false},
                                   {"dout", &p.dout, hq, nq, false},
                                   {"dq", &p.dq, hq, nq, true},
                                   {"dk", &p.dk, hkv, nkv, true},
                                   {"dv", &p.dv, hkv, nkv, true}}};
  for (const View& v : views) {
    if (v.writes && v.t == &p.dq) {  // the LSE and p_max are inputs: before the outputs
      if (auto st = check_lse(fn, p, p.lse, /*required=*/true); st) return st;
      if (p.p_max != nullptr)
        if (auto st = check_array(fn, "p_max", p.p_max, lse_bytes(p), kLseAlign,
                                  "the forward's (B, Hq, Nq) float array");
            st)
          return st;
    }
    if (auto st = check_tensor(fn, v.name, *v.t, b, v.heads, v.seqlen, d, v.writes); st) return st;
  }
  const BackwardBuffers buf = buffers_of(p);
  return check_overlaps(fn, buf.inputs, buf.outputs, [](const char*) {
    return "an output buffer of its own, apart from every input (q, k, v, o, dout, lse, p_max) "
           "and the other gradients";
  });
}

std::size_t backward_workspace_bytes(const qattn_bwd_params& p) { return workspace_bytes_for(p); }

qattn_status validate_workspace(const char* fn, const qattn_bwd_params& p, const void* workspace,
                                std::size_t workspace_bytes) {
  const BackwardBuffers b = buffers_of(p);
  return check_workspace(fn, "qattn_bwd_workspace_size", backward_workspace_bytes(p), workspace,
                         workspace_bytes, join(b.inputs, b.outputs));
}

std::array<BufferSpan, 11> buffer_spans(const qattn_bwd_params& p, const void* workspace) {
  const int64_t b = p.batch, hq = p.heads_q, hkv = p.heads_kv, nq = p.seqlen_q, nkv = p.seqlen_kv,
                d = p.head_dim;
  return {{{"q.data", p.q.data, view_span_bytes(p.q, b, hq, nq, d)},
           {"k.data", p.k.data, view_span_bytes(p.k, b, hkv, nkv, d)},
           {"v.data", p.v.data, view_span_bytes(p.v, b, hkv, nkv, d)},
           {"o.data", p.o.data, view_span_bytes(p.o, b, hq, nq, d)},
           {"dout.data", p.dout.data, view_span_bytes(p.dout, b, hq, nq, d)},
           {"lse", p.lse, lse_bytes(p)},
           {"p_max", p.p_max, p.p_max != nullptr ? lse_bytes(p) : 0},
           {"dq.data", p.dq.data, view_span_bytes(p.dq, b, hq, nq, d)},
           {"dk.data", p.dk.data, view_span_bytes(p.dk, b, hkv, nkv, d)},
           {"dv.data", p.dv.data, view_span_bytes(p.dv, b, hkv, nkv, d)},
           {"workspace", workspace, backward_workspace_bytes(p)}}};
}

qattn_bwd_params resolve_defaults(const qattn_bwd_params& p) { return with_default_scale(p); }

}  // namespace qattn::api
