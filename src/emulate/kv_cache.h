// The quantized KV cache (docs/kv-cache.md) on the host: its byte layout, the append
// that quantizes new tokens into their page slots, and the decode that reads it.
// This is the written contract of the GPU append and decode kernels: they must equal
// it bit for bit (append: every byte of a page) and to FP32 rounding (decode).
//
// Storage. A pool of `num_pages` pages; page p holds `page_size` token slots of every
// KV head, for K and V. A sequence's token t lives in page block_table[seq][t / page_size],
// slot t % page_size. Inside a page (byte offsets from KvPageLayout, each section and
// each head's slice 16-byte aligned):
//   [K codes: heads × page_size rows] [V codes] [K scales: heads × page_size rows] [V scales]
// One row = one (token, KV head): codes along d, then (in the scale section) that row's
// scales. A contiguous cache is the same format with one page per sequence
// (page_size = capacity, block table [seq] = {seq}).
//
// Append, per new token t and KV head h (row x of d floats), in this order:
//  1. K only: x ← x − c_h (FP32 subtraction; c is the sequence's smoothing vector,
//     fixed by its first append, see KvSmoothing).
//  2. Quantize the row along d exactly as src/numerics does:
//       NVFP4: numerics::quantize_fp4(NvFp4): per 16 elements s = E4M3(amax/6), codes
//              E2M1(x/s); packed 2 per byte, element 2i in the low nibble;
//              scales: d/16 E4M3 bytes.
//       FP8:   numerics::quantize_fp8(E4M3, PerToken): s = amax/448 (FP32), codes
//              E4M3(x·(448/amax)); scale: one FP32 (little-endian).
//       INT8:  numerics::quantize_int(Int8, PerToken): s = amax/127, codes
//              clamp(rne(x·(127/amax)), ±127) as int8; scale: one FP32.
//       BF16:  the row rounded to bfloat16 (RNE), 2 bytes per element; no scale.
//  3. Write the codes and scales to the row's slot. Nothing else in the pool changes.
//
// Decode, per sequence b, query head hq (KV head hk = hq / (Hq/Hkv)) and query row i
// of nq (1..16), with L = lengths[b] cached keys (the nq new tokens already appended):
//  1. q ← bf16_round(q). qc = Σ_c q[c]·c_hk[c] (FP32, c in order).
//  2. Key j is visible iff j < L and, with a causal mask, j ≤ i + L − nq (bottom right).
//  3. Split the keys into S = num_splits chunks of C = ceil(L/S) rounded up to a
//     multiple of 16 tokens (kvcache::decode_chunk_keys; chunk s covers [s·C, min(L,
//     (s+1)·C)); trailing chunks may be empty).
//  4. Per chunk, tiles of kv_tile tokens, online softmax in the log2 domain:
//       x_j = (Σ_c q[c]·k̂_j[c]) · scale_log2, FP32, c in order; k̂ = dequantized K − c;
//       scale_log2 = FP32(sm_scale·log2 e);
//       m' = max(m, max_j x_j); α = exp2(m − m'); p_j = exp2(x_j − m');
//       l ← l·α + Σ_j p_j; o_tile = Σ_j p_j·v̂_j (a fresh FP32 accumulator, j in order);
//       o ← o·α + o_tile.
//     The chunk's partial: O_s = o/l, lse_s = m + log2 l (−inf and O_s = 0 if it saw
//     no visible key).
//  5. Merge in the fixed order s = 0..S−1: M = max_s lse_s; w_s = exp2(lse_s − M);
//     W = Σ_s w_s; O = (Σ_s w_s·O_s)/W; LSE = (M + log2 W)·ln 2 + sm_scale·qc.
//     A row that sees no key gives O = 0 and LSE = −inf. With S = 1 the merge is the
//     identity (w_0 = 1, W = 1).
//
// Every function validates its arguments first and throws std::invalid_argument whose
// message names the function and the parameter; a throwing append changes nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "emulate/sage2.h"
#include "kvcache/layout.h"
#include "reference/tensor.h"

namespace qattn::emulate {

// Element format of the cached K and V (docs/kv-cache.md, "Element formats"); the
// layout of a page is kvcache/layout.h's, shared with the kernels.
using KvFormat = kvcache::KvFormat;
using KvPageLayout = kvcache::KvPageLayout;

// "NvFp4", "Fp8E4M3", "Int8" or "Bf16" (for messages).
const char* kv_format_name(KvFormat f);

// How the K smoothing vector c of a (sequence, KV head) is chosen. Appending must not
// rewrite old tokens, so c is fixed once per sequence and never changes after.
enum class KvSmoothing {
  None,         // c = 0 (the BF16 baseline's natural choice)
  PrefillMean,  // c = the per-channel mean of the sequence's first append (the prefill),
                // over numerics' token sample (MeanEstimate::Sampled), unless the engine
                // set c with set_k_smoothing before the first append
};

inline constexpr int kKvMaxQueryTokens = kvcache::kMaxQueryTokens;  // decode: 1..16 per sequence
inline constexpr int kKvAlignment = kvcache::kAlignment;  // bytes; sections and head slices
inline constexpr int kKvMaxHeadDim = kvcache::kMaxHeadDim;

struct KvCacheConfig {
  KvFormat format = KvFormat::NvFp4;
  int heads_kv = 1;
  int head_dim = 128;  // a multiple of 16 (the NVFP4 block), at most 256
  int page_size = 16;  // tokens per page
  int num_pages = 0;
  int max_seqs = 1;
  int max_pages_per_seq = 0;  // block-table width: capacity = max_pages_per_seq × page_size
  KvSmoothing k_smoothing = KvSmoothing::PrefillMean;
};

// Throws std::invalid_argument naming the field of a bad config.
KvPageLayout kv_page_layout(const KvCacheConfig& config);

// Bytes of one (token, KV head) row of K (or of V): codes plus scales. d = 128:
// NVFP4 72, FP8 132, INT8 132, BF16 256.
int64_t kv_bytes_per_token_head(KvFormat format, int head_dim);

// The host emulation of a paged cache. Fields are public so a test (or an engine
// model) can inspect bytes and set block tables; the functions below check them.
struct PagedCache {
  KvCacheConfig config;
  KvPageLayout layout;
  std::vector<uint8_t> pages;         // num_pages × page_bytes
  std::vector<int32_t> block_tables;  // max_seqs × max_pages_per_seq; −1 = no page
  std::vector<int32_t> lengths;       // max_seqs: tokens cached per sequence
  std::vector<float> k_mean;          // max_seqs × heads_kv × d: the vectors c
  std::vector<uint8_t> k_mean_fixed;  // max_seqs: 1 once c is fixed

  int64_t capacity() const {
    return static_cast<int64_t>(config.max_pages_per_seq) * config.page_size;
  }
  int32_t& block(int seq, int i) {
    return block_tables[static_cast<std::size_t>(seq) * config.max_pages_per_seq + i];
  }
  int32_t block(int seq, int i) const {
    return block_tables[static_cast<std::size_t>(seq) * config.max_pages_per_seq + i];
  }
};

// A zeroed pool, block tables all −1, lengths 0.
PagedCache make_paged_cache(const KvCacheConfig& config);

// The contiguous layout: one page of `capacity` tokens per sequence, block table
// [seq] = {seq}.
PagedCache make_contiguous_cache(KvFormat format, int heads_kv, int head_dim, int max_seqs,
                                 int capacity, KvSmoothing k_smoothing = KvSmoothing::PrefillMean);

// Sets the first pages.size() block-table entries of seq (each in [0, num_pages)).
void assign_pages(PagedCache& cache, int seq, std::span<const int32_t> pages);

// Fixes c (heads_kv × d) for a sequence that holds no token yet (a calibrated vector).
void set_k_smoothing(PagedCache& cache, int seq, std::span<const float> c);

// Empties a sequence: length 0, c no longer fixed. Its pages are the engine's to reuse.
void reset_sequence(PagedCache& cache, int seq);

// Appends n tokens: k_new and v_new are (1, heads_kv, n, d). The first append of a
// sequence fixes c (KvSmoothing::PrefillMean) from its K.
void append(PagedCache& cache, int seq, const Tensor4& k_new, const Tensor4& v_new);

// What a decode reads: k = dequantized K − c and v = dequantized V, both
// (1, heads_kv, L, d), element = code value × scale in FP32; k_mean = c (heads_kv × d).
struct DequantizedKv {
  Tensor4 k;
  Tensor4 v;
  std::vector<float> k_mean;
};
DequantizedKv dequantize_kv(const PagedCache& cache, int seq);

struct DecodeParams {
  Mask mask = Mask::Causal;        // bottom-right aligned among the new tokens
  std::optional<double> sm_scale;  // empty: 1/sqrt(d)
  int num_splits = 1;              // S chunks of the keys, merged by their LSE
  int kv_tile = 64;                // tokens per online-softmax step within a chunk
  std::vector<int> seqs;           // cache sequence of each batch entry; empty: 0..B−1
  std::optional<KvFormat> format;  // when set, must equal the cache's format
};

// Attention of q (B, Hq, nq, d), nq in 1..16, against each sequence's cached tokens.
// Returns O (B, Hq, nq, d) and the natural-log LSE (B, Hq, nq) with q·c folded back.
EmulatedForward decode_emulated(const Tensor4& q, const PagedCache& cache,
                                const DecodeParams& params = {});

}  // namespace qattn::emulate
