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

// A decode runs one CTA per (sequence, KV head, chunk), and a CTA's time is set by its
// own key count (the kernels are latency-bound, bench/NOTES.md v30): a wave that fills a
// fraction f of the SMs' CTA slots (kv_cache::decode_ctas_per_sm on 132 SMs) wastes
// 1 − f of them. So where the pairs need more than one wave, the rule picks the chunk
// count S whose waves are fullest: w = pairs·S / slots waves, efficiency w / ⌈w⌉, minus
// 0.02 per wave so that fewer, longer chunks win a near tie, S at most 4 waves' worth.
// Where the pairs fit one wave, filling every slot does not pay for short chunks: each
// chunk has a fixed cost and adds a row to the merge, and the measured best (a sweep of S
// on the H100, bench/results/decode-splits-h100.json, bench/NOTES.md v89) is about two
// CTAs an SM; chunks of kLongChunk keys or more may fill the wave. So S is capped there at
// max(2·132 / pairs, min(slots / pairs, keys / kLongChunk)). Each chunk keeps at least
// kMinChunk keys, and S is at most QATTN_KV_MAX_SPLITS. The sizes alone decide, so the
// workspace size needs no device.
constexpr int64_t kSms = 132;
constexpr int64_t kMinChunk = 128;
constexpr int64_t kLongChunk = 4096;
constexpr int64_t kMaxWaves = 4;
constexpr int64_t kOneWaveCtasPerSm = 2;
constexpr double kPerWave = 0.02;

int32_t choose_splits(const qattn_kv_decode_params& p, const qattn_kv_cache& c) {
  const int64_t capacity = int64_t{c.max_pages_per_seq} * c.page_size;
  const int64_t len = p.max_length > 0 ? std::min<int64_t>(p.max_length, capacity) : capacity;
  const int64_t pairs = int64_t{p.batch} * c.heads_kv;
  const int64_t rows = int64_t{p.heads_q} / c.heads_kv * p.nq;
  const int64_t slots =
      kSms * kv_cache::decode_ctas_per_sm(static_cast<kvcache::KvFormat>(c.format),
                                          c.head_dim, rows);
  const int64_t by_len = std::clamp<int64_t>(len / kMinChunk, 1, QATTN_KV_MAX_SPLITS);
  const int64_t by_waves =
      pairs <= slots ? std::max({int64_t{1}, kOneWaveCtasPerSm * kSms / pairs,
                                 std::min(slots / pairs, len / kLongChunk)})
                     : std::max<int64_t>(1, kMaxWaves * slots / pairs);
  int64_t best = 1;
  double best_score = -1.0;
  for (int64_t s = 1; s <= std::min(by_len, by_waves); ++s) {
    const int64_t ctas = pairs * s;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double score = static_cast<double>(ctas) / static_cast<double>(waves * slots) -
                         kPerWave * static_cast<double>(waves);
    if (score > best_score) best = s, best_score = score;
  }
  return static_cast<int32_t>(best);
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
