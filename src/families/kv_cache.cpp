// Declaration of the KV-cache kernels for Hopper: the formats and shapes they run, the
// split-KV choice of a decode, its workspace, and the launches. Host C++ in every
// build; the launches exist only where the CUDA kernels are built.
#include "families/kv_cache.h"

#include <algorithm>
#include <array>
#include <cstdint>

#include "cuda/kv_cache/workspace.h"
#include "kvcache/layout.h"

#if QATTN_HAVE_CUDA
#include "cuda/kv_cache/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

// A decode runs one CTA per (sequence, KV head, chunk). Splitting the keys pays when
// batch × heads_kv leaves SMs idle: aim for one wave of the format's decode kernel
// (kv_cache::decode_ctas_per_sm CTAs per SM of a 132-SM H100/H200 at once: 396 for
// NVFP4, 264 for the others; rounding down, so no second wave of a few CTAs; the sizes
// alone decide, so the workspace size needs no device), and keep each chunk at least
// kMinChunk keys so the merge stays a small part of the work.
constexpr int64_t kSms = 132;
constexpr int64_t kMinChunk = 256;

int32_t choose_splits(const qattn_kv_decode_params& p, const qattn_kv_cache& c) {
  const int64_t capacity = int64_t{c.max_pages_per_seq} * c.page_size;
  const int64_t len = p.max_length > 0 ? std::min<int64_t>(p.max_length, capacity) : capacity;
  const int64_t ctas = int64_t{p.batch} * c.heads_kv;
  const int64_t target =
      kSms * kv_cache::decode_ctas_per_sm(static_cast<kvcache::KvFormat>(c.format));
  const int64_t by_sms = std::max<int64_t>(1, target / ctas);
  const int64_t by_len = std::max<int64_t>(1, len / kMinChunk);
  return static_cast<int32_t>(
      std::clamp<int64_t>(std::min(by_sms, by_len), 1, QATTN_KV_MAX_SPLITS));
}

std::size_t decode_workspace_bytes(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                   int32_t splits) {
  return kv_cache::decode_workspace(p.batch, p.heads_q, p.nq, c.head_dim, splits).total;
}

#if QATTN_HAVE_CUDA
constexpr auto kAppend = &kv_cache::launch_append;
constexpr auto kDecode = &kv_cache::launch_decode;
#else
constexpr decltype(api::KvCacheFamily::launch_append) kAppend = nullptr;
constexpr decltype(api::KvCacheFamily::launch_decode) kDecode = nullptr;
#endif

constexpr api::KvCacheFamily kFamily{
    .name = "kv_cache_sm90",
    .archs = kArchs,
    .min_head_dim = 16,
    .max_head_dim = kvcache::kMaxHeadDim,
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    .formats = (1u << QATTN_KV_NVFP4) | (1u << QATTN_KV_FP8_E4M3) | (1u << QATTN_KV_INT8) |
               (1u << QATTN_KV_BF16),
    .masks = api::kMaskNone | api::kMaskCausal,
    .max_query_tokens = kvcache::kMaxQueryTokens,
    .choose_splits = &choose_splits,
    .decode_workspace_bytes = &decode_workspace_bytes,
    .launch_append = kAppend,
    .launch_decode = kDecode,
};

}  // namespace

const api::KvCacheFamily& kv_cache_sm90() { return kFamily; }

}  // namespace qattn::families
