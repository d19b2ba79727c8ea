#include "api/validate_merge.h"

#include <cstddef>
#include <cstdint>

#include "api/checks.h"
#include "api/error.h"

namespace qattn::api {
namespace {

using checks::check_dtype;
using checks::check_flag;
using checks::check_int;
using checks::check_tensor;
using checks::Named;
using checks::Span;

// The largest head dim: one row per warp, 32 lanes × 32 channels.
constexpr int kMaxMergeHeadDim = 1024;

Span span(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return {a, a + bytes};
}

// A present FP32 array, 4-byte aligned, inside the address space.
qattn_status check_floats(const char* fn, const char* name, const void* p, std::size_t bytes) {
  if (p == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " is NULL");
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(float) != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", p,
                " is not 4-byte aligned (FP32)");
  if (a > UINTPTR_MAX - bytes)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name,
                " runs past the end of the address space");
  return QATTN_OK;
}

int64_t rows_of(const qattn_merge_params& p) {
  return int64_t{p.batch} * p.heads * p.seqlen;
}

}  // namespace

qattn_status read_merge(const char* fn, const qattn_merge_params* caller, qattn_merge_params* out) {
  if (auto s = checks::read_struct(fn, caller, out, "qattn_merge_params",
                                   QATTN_MERGE_PARAMS_MIN_SIZE, "qattn_merge_params_init",
                                   &qattn_merge_params_init);
      s)
    return s;
  const qattn_merge_params& p = *out;
  if (auto s = check_dtype(fn, p.dtype); s) return s;
  if (auto s = check_int(fn, "batch", p.batch, 1, INT32_MAX); s) return s;
  if (auto s = check_int(fn, "heads", p.heads, 1, INT32_MAX); s) return s;
  if (auto s = check_int(fn, "seqlen", p.seqlen, 1, INT32_MAX); s) return s;
  if (auto s = check_int(fn, "head_dim", p.head_dim, 1, kMaxMergeHeadDim); s) return s;
  if (auto s = check_flag(fn, "first", p.first); s) return s;
  int64_t rows = 0, elems = 0;
  if (!checks::mul(rows_of(p), 1, &rows) || !checks::mul(rows, p.head_dim, &elems) ||
      elems > (int64_t{1} << 40))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": batch * heads * seqlen * head_dim = ",
                rows_of(p), " * ", p.head_dim, "; allowed: at most 2^40 elements");
  const int64_t b = p.batch, h = p.heads, n = p.seqlen, d = p.head_dim;
  if (auto s = check_tensor(fn, "part", p.part, b, h, n, d, false); s) return s;
  const std::size_t lse_bytes = static_cast<std::size_t>(rows) * sizeof(float);
  const std::size_t acc_bytes = static_cast<std::size_t>(elems) * sizeof(float);
  if (auto s = check_floats(fn, "part_lse", p.part_lse, lse_bytes); s) return s;
  if (auto s = check_floats(fn, "acc", p.acc, acc_bytes); s) return s;
  if (auto s = check_floats(fn, "acc_lse", p.acc_lse, lse_bytes); s) return s;
  if (p.out.data != nullptr)
    if (auto s = check_tensor(fn, "out", p.out, b, h, n, d, true); s) return s;
  const std::array<Named, 2> inputs{{{"part", checks::span_of(p.part, b, h, n, d)},
                                     {"part_lse", span(p.part_lse, lse_bytes)}}};
  const std::array<Named, 3> outputs{{{"acc", span(p.acc, acc_bytes)},
                                      {"acc_lse", span(p.acc_lse, lse_bytes)},
                                      {"out", p.out.data != nullptr ? checks::span_of(p.out, b, h, n, d)
                                                                    : Span{},
                                       p.out.data != nullptr}}};
  return checks::check_overlaps(fn, inputs, outputs,
                                [](const char*) { return "a buffer of its own"; });
}

std::array<BufferSpan, 5> buffer_spans(const qattn_merge_params& p) {
  const int64_t b = p.batch, h = p.heads, n = p.seqlen, d = p.head_dim;
  const std::size_t lse_bytes = static_cast<std::size_t>(rows_of(p)) * sizeof(float);
  auto bytes_of = [&](const qattn_tensor& t) {
    const Span s = checks::span_of(t, b, h, n, d);
    return static_cast<std::size_t>(s.end - s.begin);
  };
  return {{{"part", p.part.data, bytes_of(p.part)},
           {"part_lse", p.part_lse, lse_bytes},
           {"acc", p.acc, lse_bytes * static_cast<std::size_t>(d)},
           {"acc_lse", p.acc_lse, lse_bytes},
           {"out", p.out.data, p.out.data != nullptr ? bytes_of(p.out) : 0}}};
}

}  // namespace qattn::api
