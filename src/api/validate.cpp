#include "api/validate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "api/error.h"
#include "cuda/sage2_fwd/workspace.h"

namespace qattn::api {
namespace {

constexpr int64_t kElemBytes = 2;  // fp16 and bf16

// Overflow-checked int64 arithmetic; false when the result does not fit.
bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

// The byte range [begin, end) a tensor view spans.
struct Span {
  uintptr_t begin = 0, end = 0;
  bool overlaps(const Span& o) const { return begin < o.end && o.begin < end; }
};

struct Dim {
  const char* name;
  int64_t extent, stride;
};

// Byte range of a view whose strides passed check_tensor (no overflow then).
Span span_of(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen, int64_t d) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  return {addr, addr + view_span_bytes(t, batch, heads, seqlen, d)};
}

std::size_t lse_bytes(const qattn_fwd_params& p) {
  return static_cast<std::size_t>(int64_t{p.batch} * p.heads_q * p.seqlen_q) * sizeof(float);
}

struct Spans {
  Span q, k, v, o, lse;
  bool has_lse = false;
};

Spans spans_of(const qattn_fwd_params& p) {
  Spans s;
  s.q = span_of(p.q, p.batch, p.heads_q, p.seqlen_q, p.head_dim);
  s.k = span_of(p.k, p.batch, p.heads_kv, p.seqlen_kv, p.head_dim);
  s.v = span_of(p.v, p.batch, p.heads_kv, p.seqlen_kv, p.head_dim);
  s.o = span_of(p.o, p.batch, p.heads_q, p.seqlen_q, p.head_dim);
  if (p.lse != nullptr) {
    const auto addr = reinterpret_cast<uintptr_t>(p.lse);
    s.lse = {addr, addr + lse_bytes(p)};
    s.has_lse = true;
  }
  return s;
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

  if (writes) {
    // Sorted by stride, each dimension must step past everything the smaller ones
    // span; then every element has its own address (the rows are contiguous).
    // Ties keep the natural order innermost first (n, h, b), so the message names the
    // dimension whose stride does not step far enough.
    std::reverse(dims.begin(), dims.end());
    std::stable_sort(dims.begin(), dims.end(),
                     [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
    int64_t spanned = head_dim;  // elements covered by the dimensions seen so far
    for (const Dim& d : dims) {
      if (d.extent == 1) continue;
      if (d.stride < spanned)
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, ".", d.name, " = ", d.stride,
                    " makes elements of ", name,
                    " share addresses; allowed: strides that step past the rows and heads "
                    "they contain (an output may not alias itself)");
      spanned = d.stride * (d.extent - 1) + spanned;  // no overflow: bounded by `last` above
    }
  }
  return QATTN_OK;
}

qattn_status check_overlaps(const char* fn, const Spans& s) {
  const std::array<std::pair<const char*, const Span*>, 3> inputs{
      {{"q", &s.q}, {"k", &s.k}, {"v", &s.v}}};
  for (const auto& [name, span] : inputs) {
    if (s.o.overlaps(*span))
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": o overlaps ", name,
                  " in memory; allowed: an output buffer separate from the inputs");
    if (s.has_lse && s.lse.overlaps(*span))
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": lse overlaps ", name,
                  " in memory; allowed: a separate (B, Hq, Nq) float buffer");
  }
  if (s.has_lse && s.lse.overlaps(s.o))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": lse overlaps o in memory; allowed: a separate (B, Hq, Nq) float buffer");
  return QATTN_OK;
}

qattn_status check_int(const char* fn, const char* name, int value, int lo, int hi,
                       const char* why = "") {
  if (value < lo || value > hi)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", value, "; allowed: ", lo, "..",
                hi, why);
  return QATTN_OK;
}

}  // namespace

qattn_status validate_forward(const char* fn, const qattn_fwd_params* pp) {
  if (pp == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": params is NULL");
  const qattn_fwd_params& p = *pp;

  // ---- scalars ----
  const int dtype = static_cast<int>(p.dtype);
  if (dtype != QATTN_DTYPE_FP16 && dtype != QATTN_DTYPE_BF16)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": dtype = ", dtype,
                "; allowed: QATTN_DTYPE_FP16 (0) or QATTN_DTYPE_BF16 (1)");
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
  if (p.head_dim > kMaxHeadDim)
    return fail(QATTN_ERROR_UNSUPPORTED, fn, ": head_dim = ", p.head_dim,
                " is not supported yet; allowed: 1..128 (64 and 128 natively, others padded)");
  if (auto s = check_int(fn, "head_dim", p.head_dim, 1, kMaxHeadDim); s) return s;
  if (p.causal != 0 && p.causal != 1)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": causal = ", p.causal, "; allowed: 0 or 1");
  if (!std::isfinite(p.sm_scale))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": sm_scale = ", p.sm_scale,
                "; allowed: a finite number (<= 0 selects 1/sqrt(head_dim))");
  const int gran = static_cast<int>(p.granularity);
  if (gran != QATTN_QK_PER_THREAD && gran != QATTN_QK_PER_WARP && gran != QATTN_QK_PER_BLOCK)
    return fail(
        QATTN_ERROR_INVALID_ARGUMENT, fn, ": granularity = ", gran,
        "; allowed: QATTN_QK_PER_THREAD (0), QATTN_QK_PER_WARP (1), QATTN_QK_PER_BLOCK (2)");

  // The workspace arrays hold (B*H*N_pad) rows of at most 128 bytes plus a few floats
  // each; a bound of 1 KiB per row keeps every size_t sum below in range.
  const int64_t nq_pad = (int64_t{p.seqlen_q} + 127) / 128 * 128;
  const int64_t nkv_pad = (int64_t{p.seqlen_kv} + 127) / 128 * 128;
  int64_t rows_q = 0, rows_kv = 0, bound = 0;
  if (!mul(int64_t{p.batch} * p.heads_q, nq_pad, &rows_q) ||
      !mul(int64_t{p.batch} * p.heads_kv, nkv_pad, &rows_kv) || !add(rows_q, rows_kv, &bound) ||
      !mul(bound, 1024, &bound))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": batch * heads * seqlen is too large for the workspace size to be represented");
  // The kernel numbers its work items (128-row query blocks of every head) in an int.
  if (int64_t{p.batch} * p.heads_q * (nq_pad / 128) > int64_t{INT32_MAX})
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": batch * heads_q * ceil(seqlen_q / 128) = ",
                int64_t{p.batch} * p.heads_q * (nq_pad / 128), "; allowed: at most 2^31 - 1");

  // ---- tensors ----
  const int64_t d = p.head_dim;
  if (auto st = check_tensor(fn, "q", p.q, p.batch, p.heads_q, p.seqlen_q, d, false); st) return st;
  if (auto st = check_tensor(fn, "k", p.k, p.batch, p.heads_kv, p.seqlen_kv, d, false); st)
    return st;
  if (auto st = check_tensor(fn, "v", p.v, p.batch, p.heads_kv, p.seqlen_kv, d, false); st)
    return st;
  if (auto st = check_tensor(fn, "o", p.o, p.batch, p.heads_q, p.seqlen_q, d, true); st) return st;
  if (p.lse != nullptr) {
    const auto addr = reinterpret_cast<uintptr_t>(p.lse);
    if (addr % kLseAlign != 0)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": lse = ", static_cast<const void*>(p.lse),
                  " is not 4-byte aligned; allowed: NULL or a float array");
    const uintptr_t bytes = lse_bytes(p);
    if (addr > UINTPTR_MAX - bytes)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": lse runs past the end of the address space");
  }
  return check_overlaps(fn, spans_of(p));
}

std::size_t forward_workspace_bytes(const qattn_fwd_params& p) {
  return sage2::workspace_layout(p).total;
}

qattn_status validate_workspace(const char* fn, const qattn_fwd_params& p, const void* workspace,
                                std::size_t workspace_bytes) {
  const std::size_t need = forward_workspace_bytes(p);
  if (workspace == nullptr)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace is NULL; allowed: device memory of ",
                need, " bytes (qattn_fwd_workspace_size)");
  const auto addr = reinterpret_cast<uintptr_t>(workspace);
  if (addr % kWorkspaceAlign != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace = ", workspace,
                " is not 256-byte aligned");
  if (workspace_bytes < need)
    return fail(QATTN_ERROR_WORKSPACE_TOO_SMALL, fn, ": workspace_bytes = ", workspace_bytes,
                "; these parameters need at least ", need, " bytes (qattn_fwd_workspace_size)");
  if (addr > UINTPTR_MAX - need)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": workspace runs past the end of the address space");
  const Span ws{addr, addr + need};
  const Spans s = spans_of(p);
  const std::array<std::pair<const char*, const Span*>, 4> tensors{
      {{"q", &s.q}, {"k", &s.k}, {"v", &s.v}, {"o", &s.o}}};
  for (const auto& [name, span] : tensors)
    if (ws.overlaps(*span))
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace overlaps ", name,
                  " in memory; allowed: a buffer of its own");
  if (s.has_lse && ws.overlaps(s.lse))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": workspace overlaps lse in memory; allowed: a buffer of its own");
  return QATTN_OK;
}

std::size_t view_span_bytes(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen,
                            int64_t head_dim) {
  auto step = [](int64_t extent, int64_t stride) { return extent > 1 ? (extent - 1) * stride : 0; };
  const int64_t last =
      step(batch, t.stride_b) + step(heads, t.stride_h) + step(seqlen, t.stride_n) + head_dim - 1;
  return static_cast<std::size_t>((last + 1) * kElemBytes);
}

std::array<BufferSpan, 6> buffer_spans(const qattn_fwd_params& p, const void* workspace) {
  return {{{"q.data", p.q.data, view_span_bytes(p.q, p.batch, p.heads_q, p.seqlen_q, p.head_dim)},
           {"k.data", p.k.data, view_span_bytes(p.k, p.batch, p.heads_kv, p.seqlen_kv, p.head_dim)},
           {"v.data", p.v.data, view_span_bytes(p.v, p.batch, p.heads_kv, p.seqlen_kv, p.head_dim)},
           {"o.data", p.o.data, view_span_bytes(p.o, p.batch, p.heads_q, p.seqlen_q, p.head_dim)},
           {"lse", p.lse, p.lse != nullptr ? lse_bytes(p) : 0},
           {"workspace", workspace, forward_workspace_bytes(p)}}};
}

qattn_fwd_params resolve_defaults(const qattn_fwd_params& p) {
  qattn_fwd_params r = p;
  if (!(r.sm_scale > 0.f)) r.sm_scale = 1.f / std::sqrt(static_cast<float>(r.head_dim));
  return r;
}

}  // namespace qattn::api
