#include "api/validate_kv.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "api/checks.h"
#include "api/error.h"
#include "api/registry.h"
#include "kvcache/layout.h"
#include "numerics/sm_scale.h"

namespace qattn::api {
namespace {

using checks::check_dtype;
using checks::check_flag;
using checks::check_int;
using checks::check_reserved;
using checks::check_tensor;
using checks::Named;
using checks::Span;

using checks::mul;

kvcache::KvPageLayout layout_of(const qattn_kv_cache& c) {
  return kvcache::page_layout(static_cast<kvcache::KvFormat>(c.format), c.heads_kv, c.head_dim,
                              c.page_size);
}

int64_t capacity_of(const qattn_kv_cache& c) { return int64_t{c.max_pages_per_seq} * c.page_size; }

Span span(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return {a, a + bytes};
}

std::size_t pool_bytes(const qattn_kv_cache& c) {
  return static_cast<std::size_t>(c.num_pages) * kv_page_bytes(c);
}

// A device array of `count` elements of `elem` bytes: present and aligned to its type.
qattn_status check_array(const char* fn, const char* name, const void* p, std::size_t elem) {
  if (p == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " is NULL");
  if (reinterpret_cast<uintptr_t>(p) % elem != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", name, " = ", p, " is not ", elem,
                "-byte aligned");
  return QATTN_OK;
}

std::size_t table_bytes(const qattn_kv_cache& c, int32_t batch) {
  return static_cast<std::size_t>(batch) * c.max_pages_per_seq * sizeof(int32_t);
}
std::size_t k_mean_bytes(const qattn_kv_cache& c, int32_t batch) {
  return static_cast<std::size_t>(batch) * c.heads_kv * c.head_dim * sizeof(float);
}
bool smoothed(const qattn_kv_cache& c) { return c.k_smoothing == QATTN_KV_SMOOTH_PREFILL_MEAN; }

// The sequences of a call: device arrays present and aligned; the host mirrors, when
// given, within range for the tokens [0, lengths[b] + extra) the call touches (extra =
// the appended tokens).
qattn_status check_seqs(const char* fn, const qattn_kv_seqs& s, const qattn_kv_cache& c,
                        int32_t batch, int32_t extra) {
  if (auto st = check_array(fn, "seqs.block_tables", s.block_tables, sizeof(int32_t)); st)
    return st;
  if (auto st = check_array(fn, "seqs.lengths", s.lengths, sizeof(int32_t)); st) return st;
  if (smoothed(c)) {
    if (auto st = check_array(fn, "seqs.k_mean", s.k_mean, sizeof(float)); st) return st;
  } else if (s.k_mean != nullptr) {
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": seqs.k_mean is set but the cache has k_smoothing = QATTN_KV_SMOOTH_NONE; "
                "allowed: NULL (c = 0)");
  }
  const int64_t cap = capacity_of(c);
  if (s.host_lengths != nullptr) {
    for (int32_t b = 0; b < batch; ++b) {
      const int64_t len = s.host_lengths[b];
      if (len < 0 || len + extra > cap)
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": seqs.host_lengths[", b, "] = ", len,
                    len < 0
                        ? std::string(" is negative")
                        : cat(extra > 0 ? cat(" plus n_new = ", extra) : std::string(),
                              " exceeds the capacity ", cap, " (max_pages_per_seq * page_size)"),
                    "; allowed: 0..", cap - extra);
    }
  }
  if (s.host_block_tables != nullptr) {
    for (int32_t b = 0; b < batch; ++b) {
      const int32_t* row = s.host_block_tables + static_cast<std::size_t>(b) * c.max_pages_per_seq;
      // With the lengths known, exactly the pages the call reads or writes; else every
      // entry must be a page or -1 (unset).
      int64_t first = 0, last = c.max_pages_per_seq;  // entries [first, last)
      bool used_only = s.host_lengths != nullptr;
      if (used_only) {
        const int64_t len = s.host_lengths[b];
        first = extra > 0 ? len / c.page_size : 0;
        last = (len + extra + c.page_size - 1) / c.page_size;
      }
      for (int64_t i = first; i < last; ++i) {
        const int32_t pg = row[i];
        if (pg >= 0 && pg < c.num_pages) continue;
        if (!used_only && pg == -1) continue;
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": seqs.host_block_tables[", b, "][", i,
                    "] = ", pg, "; allowed: a page index 0..", c.num_pages - 1,
                    used_only ? " (the call uses this entry)" : " or -1 (unset)");
      }
    }
  }
  return QATTN_OK;
}

// The KV family that runs the call (on any device: the device is checked at launch).
qattn_status check_family(const char* fn, const qattn_kv_cache& c, int32_t dtype, bool decode,
                          int32_t nq, int32_t causal) {
  qattn_status st = QATTN_OK;
  const KvCall call{c.format, dtype, c.head_dim, nq, causal, decode};
  if (select_family(fn, call, nullptr, &st) == nullptr) return st;
  return QATTN_OK;
}

}  // namespace

std::size_t kv_page_bytes(const qattn_kv_cache& c) {
  return static_cast<std::size_t>(layout_of(c).page_bytes);
}

qattn_status read_cache(const char* fn, const qattn_kv_cache* caller, qattn_kv_cache* out,
                        bool need_pages) {
  if (caller == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache is NULL");
  const std::size_t size = caller->struct_size;
  if (size < QATTN_KV_CACHE_MIN_SIZE)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->struct_size = ", size,
                "; allowed: sizeof(qattn_kv_cache), at least ", QATTN_KV_CACHE_MIN_SIZE,
                " (set by qattn_kv_cache_init)");
  if (size > sizeof(qattn_kv_cache))
    return fail(QATTN_ERROR_UNSUPPORTED, fn, ": cache->struct_size = ", size,
                " is larger than this library's qattn_kv_cache (", sizeof(qattn_kv_cache),
                " bytes): the program was compiled against a newer qattn.h");
  qattn_kv_cache_init(out);
  std::memcpy(out, caller, size);
  out->struct_size = sizeof(qattn_kv_cache);
  const qattn_kv_cache& c = *out;
  if (c.format < QATTN_KV_NVFP4 || c.format > QATTN_KV_BF16)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->format = ", c.format,
                "; allowed: QATTN_KV_NVFP4 (0), QATTN_KV_FP8_E4M3 (1), QATTN_KV_INT8 (2), "
                "QATTN_KV_BF16 (3)");
  if (auto s = check_int(fn, "cache->heads_kv", c.heads_kv, 1, kMaxGridDim); s) return s;
  if (c.head_dim < 16 || c.head_dim > kvcache::kMaxHeadDim || c.head_dim % 16 != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->head_dim = ", c.head_dim,
                "; allowed: a multiple of 16 (the NVFP4 scale block) from 16 to 256");
  if (auto s = check_int(fn, "cache->page_size", c.page_size, 1, kMaxSeqlen); s) return s;
  if (auto s =
          check_int(fn, "cache->num_pages", c.num_pages, 1, std::numeric_limits<int32_t>::max());
      s)
    return s;
  if (auto s = check_int(fn, "cache->max_pages_per_seq", c.max_pages_per_seq, 1,
                         std::numeric_limits<int32_t>::max());
      s)
    return s;
  if (capacity_of(c) > kMaxSeqlen)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": cache->max_pages_per_seq * page_size = ", capacity_of(c),
                "; allowed: at most 2^30 tokens per sequence");
  if (c.k_smoothing != QATTN_KV_SMOOTH_PREFILL_MEAN && c.k_smoothing != QATTN_KV_SMOOTH_NONE)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->k_smoothing = ", c.k_smoothing,
                "; allowed: QATTN_KV_SMOOTH_PREFILL_MEAN (0) or QATTN_KV_SMOOTH_NONE (1)");
  if (auto s = check_reserved(fn, "cache->reserved0", c.reserved0, "qattn_kv_cache_init"); s)
    return s;
  int64_t pool = 0;
  if (!mul(layout_of(c).page_bytes, c.num_pages, &pool) || pool > (int64_t{1} << 47))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->num_pages * page bytes overflows");
  if (need_pages) {
    if (c.pages == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->pages is NULL");
    if (reinterpret_cast<uintptr_t>(c.pages) % kvcache::kAlignment != 0)
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": cache->pages = ", c.pages,
                  " is not 16-byte aligned (pages are read 16 bytes at a time)");
  }
  return QATTN_OK;
}

// ---- append ------------------------------------------------------------------------

qattn_status read_append(const char* fn, const qattn_kv_append_params* caller,
                         qattn_kv_append_params* out, qattn_kv_cache* cache) {
  if (auto s = checks::read_struct(fn, caller, out, "qattn_kv_append_params",
                                   QATTN_KV_APPEND_PARAMS_MIN_SIZE, "qattn_kv_append_params_init",
                                   &qattn_kv_append_params_init);
      s)
    return s;
  const qattn_kv_append_params& p = *out;
  if (auto s = read_cache(fn, p.cache, cache, /*need_pages=*/true); s) return s;
  const qattn_kv_cache& c = *cache;
  out->cache = cache;
  if (auto s = check_dtype(fn, p.dtype); s) return s;
  if (auto s = check_int(fn, "batch", p.batch, 1, kMaxGridDim, " (a grid dimension)"); s) return s;
  if (auto s = check_int(fn, "n_new", p.n_new, 1, static_cast<int>(capacity_of(c)),
                         " (at most the capacity, max_pages_per_seq * page_size)");
      s)
    return s;
  if (auto s = check_flag(fn, "k_mean_preset", p.k_mean_preset); s) return s;
  if (p.k_mean_preset != 0 && !smoothed(c))
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": k_mean_preset = 1 but the cache has k_smoothing = QATTN_KV_SMOOTH_NONE");
  if (auto s = check_family(fn, c, p.dtype, false, 0, 0); s) return s;
  if (auto s = check_seqs(fn, p.seqs, c, p.batch, p.n_new); s) return s;
  const int64_t b = p.batch, h = c.heads_kv, n = p.n_new, d = c.head_dim;
  if (auto s = check_tensor(fn, "k", p.k, b, h, n, d, false); s) return s;
  if (auto s = check_tensor(fn, "v", p.v, b, h, n, d, false); s) return s;
  // What it writes (pages, lengths, k_mean) overlaps nothing it reads (k, v, block tables).
  const std::array<Named, 3> inputs{
      {{"k", checks::span_of(p.k, b, h, n, d)},
       {"v", checks::span_of(p.v, b, h, n, d)},
       {"seqs.block_tables", span(p.seqs.block_tables, table_bytes(c, p.batch))}}};
  const std::array<Named, 3> outputs{
      {{"cache->pages", span(c.pages, pool_bytes(c))},
       {"seqs.lengths", span(p.seqs.lengths, sizeof(int32_t) * p.batch)},
       {"seqs.k_mean", span(p.seqs.k_mean, k_mean_bytes(c, p.batch)), p.seqs.k_mean != nullptr}}};
  return checks::check_overlaps(fn, inputs, outputs,
                                [](const char*) { return "a buffer of its own"; });
}

std::array<BufferSpan, 6> buffer_spans(const qattn_kv_append_params& p, const qattn_kv_cache& c) {
  const int64_t b = p.batch, h = c.heads_kv, n = p.n_new, d = c.head_dim;
  return {{{"cache->pages", c.pages, pool_bytes(c)},
           {"seqs.block_tables", p.seqs.block_tables, table_bytes(c, p.batch)},
           {"seqs.lengths", p.seqs.lengths, sizeof(int32_t) * p.batch},
           {"seqs.k_mean", p.seqs.k_mean, p.seqs.k_mean ? k_mean_bytes(c, p.batch) : 0},
           {"k.data", p.k.data, view_span_bytes(p.k, b, h, n, d)},
           {"v.data", p.v.data, view_span_bytes(p.v, b, h, n, d)}}};
}

// ---- decode ------------------------------------------------------------------------

qattn_status read_decode(const char* fn, const qattn_kv_decode_params* caller,
                         qattn_kv_decode_params* out, qattn_kv_cache* cache, int32_t* splits) {
  if (auto s = checks::read_struct(fn, caller, out, "qattn_kv_decode_params",
                                   QATTN_KV_DECODE_PARAMS_MIN_SIZE, "qattn_kv_decode_params_init",
                                   &qattn_kv_decode_params_init);
      s)
    return s;
  const qattn_kv_decode_params& p = *out;
  if (auto s = read_cache(fn, p.cache, cache, /*need_pages=*/true); s) return s;
  const qattn_kv_cache& c = *cache;
  out->cache = cache;
  if (auto s = check_dtype(fn, p.dtype); s) return s;
  if (auto s = check_int(fn, "batch", p.batch, 1, kMaxGridDim, " (a grid dimension)"); s) return s;
  if (auto s = check_int(fn, "heads_q", p.heads_q, 1, kMaxGridDim); s) return s;
  if (p.heads_q % c.heads_kv != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": heads_q = ", p.heads_q,
                " is not a multiple of cache->heads_kv = ", c.heads_kv,
                "; allowed: heads_q = g * heads_kv (GQA/MQA)");
  if (auto s =
          check_int(fn, "nq", p.nq, 1, QATTN_KV_MAX_QUERY_TOKENS, " (query tokens per sequence)");
      s)
    return s;
  if (auto s = check_flag(fn, "causal", p.causal); s) return s;
  if (auto s = checks::check_sm_scale(fn, p.sm_scale); s) return s;
  if (p.max_length < 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": max_length = ", p.max_length,
                "; allowed: 0 (the capacity) or an upper bound of the lengths");
  if (auto s = check_int(fn, "num_splits", p.num_splits, 0, QATTN_KV_MAX_SPLITS,
                         " (0 = chosen from the sizes)");
      s)
    return s;
  if (auto s = check_family(fn, c, p.dtype, true, p.nq, p.causal); s) return s;
  if (auto s = check_seqs(fn, p.seqs, c, p.batch, 0); s) return s;
  const int64_t b = p.batch, hq = p.heads_q, n = p.nq, d = c.head_dim;
  if (auto s = check_tensor(fn, "q", p.q, b, hq, n, d, false); s) return s;
  if (auto s = check_tensor(fn, "o", p.o, b, hq, n, d, true); s) return s;
  const std::size_t lse_bytes = static_cast<std::size_t>(b * hq * n) * sizeof(float);
  if (p.lse != nullptr && reinterpret_cast<uintptr_t>(p.lse) % sizeof(float) != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": lse = ", static_cast<const void*>(p.lse),
                " is not 4-byte aligned; allowed: NULL or a float array");
  const std::array<Named, 5> inputs{
      {{"q", checks::span_of(p.q, b, hq, n, d)},
       {"cache->pages", span(c.pages, pool_bytes(c))},
       {"seqs.block_tables", span(p.seqs.block_tables, table_bytes(c, p.batch))},
       {"seqs.lengths", span(p.seqs.lengths, sizeof(int32_t) * p.batch)},
       {"seqs.k_mean", span(p.seqs.k_mean, k_mean_bytes(c, p.batch)), p.seqs.k_mean != nullptr}}};
  const std::array<Named, 2> outputs{{{"o", checks::span_of(p.o, b, hq, n, d)},
                                      {"lse", span(p.lse, lse_bytes), p.lse != nullptr}}};
  if (auto s = checks::check_overlaps(fn, inputs, outputs,
                                      [](const char*) { return "a buffer of its own"; });
      s)
    return s;
  const KvCall call{c.format, p.dtype, c.head_dim, p.nq, p.causal, true};
  qattn_status st = QATTN_OK;
  const KvCacheFamily* f = select_family(fn, call, nullptr, &st);
  *splits = p.num_splits > 0 ? p.num_splits : f->choose_splits(p, c);
  return QATTN_OK;
}

std::size_t decode_workspace_bytes(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                   int32_t splits) {
  std::size_t bytes = 0;
  const KvCall call{c.format, p.dtype, c.head_dim, p.nq, p.causal, true};
  for (const KvCacheFamily* f : kv_cache_families())
    if (decline_reason(*f, call, nullptr).empty())
      bytes = std::max(bytes, f->decode_workspace_bytes(p, c, splits));
  return bytes;
}

qattn_status validate_decode_workspace(const char* fn, const qattn_kv_decode_params& p,
                                       const qattn_kv_cache& c, int32_t splits,
                                       const void* workspace, std::size_t workspace_bytes) {
  // No split needs no workspace (check_workspace then takes any pointer and size).
  const std::size_t need = decode_workspace_bytes(p, c, splits);
  // The partials are written: the workspace stands apart from everything the call
  // reads, the sequences' arrays included.
  const int64_t b = p.batch, hq = p.heads_q, n = p.nq, d = c.head_dim;
  const std::array<Named, 7> buffers{
      {{"q", checks::span_of(p.q, b, hq, n, d)},
       {"o", checks::span_of(p.o, b, hq, n, d)},
       {"lse", span(p.lse, static_cast<std::size_t>(b * hq * n) * sizeof(float)), p.lse != nullptr},
       {"cache->pages", span(c.pages, pool_bytes(c))},
       {"seqs.block_tables", span(p.seqs.block_tables, table_bytes(c, p.batch))},
       {"seqs.lengths", span(p.seqs.lengths, sizeof(int32_t) * p.batch)},
       {"seqs.k_mean", span(p.seqs.k_mean, k_mean_bytes(c, p.batch)), p.seqs.k_mean != nullptr}}};
  return checks::check_workspace(fn, "qattn_kv_decode_workspace_size", need, workspace,
                                 workspace_bytes, buffers);
}

std::array<BufferSpan, 8> buffer_spans(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                       int32_t splits, const void* workspace) {
  const int64_t b = p.batch, hq = p.heads_q, n = p.nq, d = c.head_dim;
  const std::size_t ws = decode_workspace_bytes(p, c, splits);
  return {{{"cache->pages", c.pages, pool_bytes(c)},
           {"seqs.block_tables", p.seqs.block_tables, table_bytes(c, p.batch)},
           {"seqs.lengths", p.seqs.lengths, sizeof(int32_t) * p.batch},
           {"seqs.k_mean", p.seqs.k_mean, p.seqs.k_mean ? k_mean_bytes(c, p.batch) : 0},
           {"q.data", p.q.data, view_span_bytes(p.q, b, hq, n, d)},
           {"o.data", p.o.data, view_span_bytes(p.o, b, hq, n, d)},
           {"lse", p.lse, p.lse ? static_cast<std::size_t>(b * hq * n) * sizeof(float) : 0},
           {"workspace", ws > 0 ? workspace : nullptr, ws}}};
}

qattn_kv_decode_params resolve_defaults(const qattn_kv_decode_params& p, const qattn_kv_cache& c) {
  qattn_kv_decode_params r = p;
  if (r.sm_scale == 0.f) r.sm_scale = numerics::default_sm_scale(c.head_dim);
  return r;
}

}  // namespace qattn::api
