// The decode: attention of a few new query tokens per sequence against its cached
// tokens, read from the paged cache (docs/kv-cache.md, "Decode"; src/emulate/kv_cache
// is the contract, to FP32 rounding). Head dims 64 and 128 run the direct kernel
// (decode_direct.cuh); the tiled kernel below runs the other head dims.
//
// One CTA per (chunk of keys, group of up to 64 query rows, KV head, sequence). The
// query rows of a CTA are the GQA group's heads × the nq new tokens, so the group shares
// one read of its K and V. Keys go in tiles of 64: cp.async stages a tile's raw rows
// (codes and scales) into shared memory a few tiles ahead, the CTA turns them into
// 16-bit operands (exactly, dequant.cuh), and each warp runs mma.sync m16n8k16 on its
// 16 rows × its slice of the tile's keys with its own online softmax; the warps that
// split one row tile's keys merge at the end. Scores: BF16 Q · BF16 K̂ with FP32
// accumulation. P·V: P is split into a 16-bit high part and the 16-bit remainder
// (two products) so P keeps ~22 bits (FP16) or ~16 bits (BF16) instead of 11 or 8.
// FP8/INT8 rows keep their per-row FP32 scales out of the products: K's multiplies
// the score, V's is folded into P relative to a running maximum σ of the V scales.
// With several chunks, each writes its normalized partial and its LSE and a second
// kernel merges them in chunk order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/hopper/per_device.h"
#include "cuda/kv_cache/dequant.cuh"
#include "cuda/kv_cache/launch.h"
#include "cuda/kv_cache/workspace.h"
#include "kvcache/layout.h"

namespace qattn::kv_cache {
namespace {

using common::ldmatrix_x4;
using common::ldsm_a_addr;
using common::ldsm_b_addr;
using common::mma_16bit;
using common::shared_addr;

constexpr int kTile = 64;      // keys per step
constexpr int kThreads = 128;  // 4 warps
// Query rows per CTA: up to 4 m16 row tiles (2 at head dim 256, where the output
// accumulator alone takes 128 registers).
template <int DP>
constexpr int kRowsPerCta = DP == 256 ? 32 : 64;
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kNegInf = -INFINITY;

struct DecodeArgs {
  const uint8_t* pages;
  int64_t page_bytes;
  int64_t k_codes, v_codes, k_scales, v_scales;  // section offsets in a page
  int64_t head_code_bytes, head_scale_bytes;
  int32_t code_row_bytes, scale_row_bytes;
  int32_t page_size, num_pages, max_pages_per_seq, capacity;
  int32_t page_shift;  // log2(page_size) for a power of two, else -1
  const int32_t* block_tables;
  const int32_t* lengths;
  const float* k_mean;  // nullptr: no smoothing
  const void* q;
  int64_t q_sb, q_sh, q_sn;
  void* o;
  int64_t o_sb, o_sh, o_sn;
  float* lse;  // nullptr: not wanted
  int32_t heads_q, heads_kv, group, nq, d, rows, splits;
  int32_t causal;
  float sm_scale, scale_log2;
  float* o_part;  // splits > 1: the workspace's partials
  float* lse_part;
  float* qc_part;
};

// Shared memory of one CTA, in bytes. A 16-bit operand row is padded by 16 bytes so
// ldmatrix's eight row addresses fall in distinct banks.
template <int DP, KvFormat F>
struct Smem {
  static constexpr bool kRawOperands = F == KvFormat::Bf16;  // BF16 rows are the operands
  static constexpr int kCodeRow = F == KvFormat::NvFp4 ? DP / 2 : F == KvFormat::Bf16 ? 2 * DP : DP;
  static constexpr int kOpRow = 2 * DP + 16;
  static constexpr int kRawRow = kRawOperands ? kOpRow : kCodeRow;
  static constexpr int kScaleRow = 16;  // up to 16 E4M3 scales (NVFP4, d 256) or one FP32
  static constexpr int kStageBytes =
      2 * kTile * kRawRow + (kRawOperands ? 0 : 2 * kTile * kScaleRow);
  static constexpr int kStages = (kRawOperands && DP == 256) ? 2 : F == KvFormat::NvFp4 ? 4 : 3;
  // Block-table entries are fetched kStages tiles before their tile is staged (so the
  // table's latency never sits on the loop's path), into a ring of kRing tiles.
  static constexpr int kRing = 8;
  static_assert(kRing >= 2 * kStages, "the ring holds every entry from fetch to use");
  static constexpr int kQ = 0;
  static constexpr int kStage0 = kQ + kRowsPerCta<DP> * kOpRow;
  static constexpr int kDeq = kStage0 + kStages * kStageBytes;  // K̂ then V̂ (not for BF16)
  static constexpr int kMisc = kDeq + (kRawOperands ? 0 : 2 * kTile * kOpRow);
  // misc: q·c per row, K and V row scales, two partial maxima, the page and slot of each
  // key of each stage, the bad-index flag.
  static constexpr int kQc = kMisc;
  static constexpr int kKs = kQc + kRowsPerCta<DP> * 4;
  static constexpr int kVs = kKs + kTile * 4;
  static constexpr int kRed = kVs + kTile * 4;
  static constexpr int kPage = kRed + 16;
  static constexpr int kSlot = kPage + kStages * kTile * 4;
  static constexpr int kRingAt = kSlot + kStages * kTile * 4;
  static constexpr int kBad = kRingAt + kRing * kTile * 4;
  static constexpr int kLoopBytes = kBad + 16;
  // After the key loop the warps that split a row tile merge through this region
  // (from kStage0): o (16 × DP floats), m and l (16 each) per warp.
  static constexpr int kMergeWarp = 16 * DP * 4 + 2 * 16 * 4;
  static constexpr int kMergeEnd = kStage0 + 4 * kMergeWarp;
  static_assert(kMergeEnd <= kMisc, "the merge scratch must not overlap q·c");
  static constexpr int kBytes = kLoopBytes;
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Two floats as a 16-bit pair (the first in the low half) and the pair of remainders.
template <typename VT>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  if constexpr (std::is_same_v<VT, __half>) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 back = __half22float2(h);
    hi = bits_of(h);
    lo = bits_of(__floats2half2_rn(x0 - back.x, x1 - back.y));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 back = __bfloat1622float2(h);
    hi = bits_of(h);
    lo = bits_of(__floats2bfloat162_rn(x0 - back.x, x1 - back.y));
  }
}

// Issues the cp.async of one tile's raw rows (keys whose page is −1 are zero-filled).
// `kCh`: the chunk of the code rows (16, or 8 for NVFP4 rows of 8·odd bytes).
template <int DP, KvFormat F, int kCh>
__device__ __forceinline__ void stage_codes(const DecodeArgs& a, int hk, uint8_t* stage,
                                            const int32_t* pg, const int32_t* slot, int tid) {
  using S = Smem<DP, F>;
  const int per_row = a.code_row_bytes / kCh;
  const int items = kTile * per_row;
  for (int it = tid; it < 2 * items; it += kThreads) {
    const bool v = it >= items;
    const int i = v ? it - items : it;
    const int key = i / per_row, part = i % per_row;
    const int page = pg[key];
    const uint8_t* src = a.pages;
    if (page >= 0)
      src += page * a.page_bytes + (v ? a.v_codes : a.k_codes) + hk * a.head_code_bytes +
             int64_t{slot[key]} * a.code_row_bytes + part * kCh;
    const uint32_t dst =
        shared_addr(stage + (v ? kTile * S::kRawRow : 0) + key * S::kRawRow + part * kCh);
    cp_async_zfill<kCh>(dst, src, page >= 0);
  }
}

template <int DP, KvFormat F>
__device__ __forceinline__ void stage_scales(const DecodeArgs& a, int hk, uint8_t* stage,
                                             const int32_t* pg, const int32_t* slot, int tid) {
  using S = Smem<DP, F>;
  if constexpr (!S::kRawOperands) {
    uint8_t* scales = stage + 2 * kTile * S::kRawRow;
    const int g = a.scale_row_bytes;
    auto src_of = [&](bool v, int key) {
      return a.pages + pg[key] * a.page_bytes + (v ? a.v_scales : a.k_scales) +
             hk * a.head_scale_bytes + int64_t{slot[key]} * g;
    };
    if (g % 4 == 0) {
      // 4 bytes at a time (FP8/INT8: the FP32; NVFP4 with d % 64 == 0: d/16 bytes).
      const int per_row = g / 4;
      for (int it = tid; it < 2 * kTile * per_row; it += kThreads) {
        const bool v = it >= kTile * per_row;
        const int i = v ? it - kTile * per_row : it;
        const int key = i / per_row, part = i % per_row;
        const bool ok = pg[key] >= 0;
        const uint8_t* src = ok ? src_of(v, key) + 4 * part : a.pages;
        cp_async_zfill<4>(
            shared_addr(scales + (v ? kTile : 0) * S::kScaleRow + key * S::kScaleRow + 4 * part),
            src, ok);
      }
    } else {
      // NVFP4 rows whose d/16 scale bytes are not a multiple of 4: plain byte copies.
      for (int it = tid; it < 2 * kTile * g; it += kThreads) {
        const bool v = it >= kTile * g;
        const int i = v ? it - kTile * g : it;
        const int key = i / g, part = i % g;
        scales[(v ? kTile : 0) * S::kScaleRow + key * S::kScaleRow + part] =
            pg[key] >= 0 ? src_of(v, key)[part] : uint8_t{0};
      }
    }
  }
}

// The block-table entry of this thread's key `key` of tile `t` into its ring slot, by
// cp.async (part of the current group). Keys outside the chunk get −1 (staged as zeros).
__device__ __forceinline__ void fetch_entry(const DecodeArgs& a, const int32_t* table, int jb,
                                            int je, int t, int key, int32_t* slot) {
  const int j = jb + t * kTile + key;
  if (j >= je)
    *slot = -1;
  else
    cp_async_zfill<4>(shared_addr(slot), table + j / a.page_size, true);
}

// The key loop and the epilogue of one CTA; NB = 8-key blocks per warp per tile (2, 4 or
// 8 when 4, 2 or 1 warps split a row tile's keys).
template <typename T, int DP, KvFormat F, int NB>
__device__ __forceinline__ void decode_cta(const DecodeArgs& a, uint8_t* smem, int rtiles,
                                           int nrows, int row0, int hk, int b, int split, int L,
                                           bool bad_length) {
  using S = Smem<DP, F>;
  using VT = std::conditional_t<F == KvFormat::Bf16, __nv_bfloat16, __half>;
  constexpr bool kRowScales = F == KvFormat::Fp8E4M3 || F == KvFormat::Int8;
  constexpr int kSlices = kTile / (8 * NB);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int my_rt = warp / kSlices, my_slice = warp % kSlices;
  const bool computes = my_rt < rtiles;
  const int key0 = my_slice * 8 * NB;
  const int d16 = a.d / 16;

  int32_t* s_page = reinterpret_cast<int32_t*>(smem + S::kPage);
  int32_t* s_slot = reinterpret_cast<int32_t*>(smem + S::kSlot);
  float* s_ks = reinterpret_cast<float*>(smem + S::kKs);
  float* s_vs = reinterpret_cast<float*>(smem + S::kVs);
  float* s_red = reinterpret_cast<float*>(smem + S::kRed);
  int* s_bad = reinterpret_cast<int*>(smem + S::kBad);
  const float* s_qc = reinterpret_cast<const float*>(smem + S::kQc);

  const int chunk = kvcache::decode_chunk_keys(L, a.splits);
  const int jb = min(L, split * chunk), je = min(L, (split + 1) * chunk);
  const int ntiles = (je - jb + kTile - 1) / kTile;
  const int32_t* table = a.block_tables + int64_t{b} * a.max_pages_per_seq;

  // Causal limits of this thread's two rows (g and g + 8 of its row tile).
  int lim[2];
  for (int h = 0; h < 2; ++h) {
    const int r = min(row0 + my_rt * 16 + lane / 4 + 8 * h, a.rows - 1);
    lim[h] = a.causal ? (r % a.nq) + L - a.nq : INT32_MAX;
  }

  float o[DP / 8][4];
#pragma unroll
  for (auto& x : o) x[0] = x[1] = x[2] = x[3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float sigma = 0.f;  // running maximum of the V row scales seen (FP8/INT8)

  auto stage_of = [&](int t) { return smem + S::kStage0 + (t % S::kStages) * S::kStageBytes; };
  auto stage_tile = [&](int t) {
    if (t >= ntiles) return;
    const int st = t % S::kStages;
    uint8_t* stage = stage_of(t);
    if (a.code_row_bytes % 16 == 0)
      stage_codes<DP, F, 16>(a, hk, stage, s_page + st * kTile, s_slot + st * kTile, tid);
    else
      stage_codes<DP, F, 8>(a, hk, stage, s_page + st * kTile, s_slot + st * kTile, tid);
    stage_scales<DP, F>(a, hk, stage, s_page + st * kTile, s_slot + st * kTile, tid);
  };
  int32_t* s_ring = reinterpret_cast<int32_t*>(smem + S::kRingAt);
  auto ring = [&](int t) { return s_ring + (t % S::kRing) * kTile + tid; };
  // The page and slot of this thread's key of tile t, from the ring (filled by this same
  // thread, so its own cp.async wait orders it); an entry out of range marks the
  // sequence bad and stages zeros.
  auto record_page = [&](int t) {
    const int st = t % S::kStages;
    const int j = jb + t * kTile + tid;
    int32_t p = *ring(t);
    if (j < je && (p < 0 || p >= a.num_pages)) {
      *s_bad = 1;
      p = -1;
    }
    s_page[st * kTile + tid] = j < je ? p : -1;
    s_slot[st * kTile + tid] = j < je ? j % a.page_size : 0;
  };

  // Prologue: the entries of the first 2·kStages − 1 tiles (plain loads, one latency),
  // the pages of the first kStages − 1 tiles, then their rows.
  if (tid < kTile) {
    int32_t first[2 * S::kStages - 1];  // all loads in flight at once, then stored
#pragma unroll
    for (int t = 0; t < 2 * S::kStages - 1; ++t) {
      const int j = jb + t * kTile + tid;
      first[t] = j < je ? __ldg(table + j / a.page_size) : -1;
    }
#pragma unroll
    for (int t = 0; t < 2 * S::kStages - 1; ++t) *ring(t) = first[t];
    for (int t = 0; t < S::kStages - 1; ++t) record_page(t);
  }
  __syncthreads();
  for (int t = 0; t < S::kStages - 1; ++t) {
    stage_tile(t);
    common::cp_async_commit();
  }

  for (int t = 0; t < ntiles; ++t) {
    const int t_stage = t + S::kStages - 1;
    // The entry of t_stage was loaded in the prologue or, kStages iterations ago, by a
    // cp.async whose group the waits since have completed.
    if (tid < kTile) {
      record_page(t_stage);
      fetch_entry(a, table, jb, je, t_stage + S::kStages, tid, ring(t_stage + S::kStages));
    }
    __syncthreads();  // pages visible; every warp is done with tile t − 1's buffers
    stage_tile(t_stage);
    common::cp_async_commit();
    common::cp_async_wait<S::kStages - 1>();
    __syncthreads();  // tile t has landed

    const uint8_t* raw = stage_of(t);
    const uint8_t* k_op = raw;
    const uint8_t* v_op = raw + kTile * S::kRawRow;
    if constexpr (!S::kRawOperands) {
      uint8_t* deq = smem + S::kDeq;
      const uint8_t* raw_scales = raw + 2 * kTile * S::kRawRow;
      // Items (K or V, key, 8-element group): compile-time counts, so the indexing is
      // shifts; groups past a padded head dim are skipped (their operands stay zero).
      constexpr int kPerRow = DP / 8;
      const int d8 = a.d / 8;
      constexpr int kUnroll = DP == 256 ? 1 : 4;  // d 256 has no registers to spare
#pragma unroll kUnroll
      for (int it = tid; it < 2 * kTile * kPerRow; it += kThreads) {
        const bool v = it >= kTile * kPerRow;
        const int i = v ? it - kTile * kPerRow : it;
        const int key = i / kPerRow, c8 = i % kPerRow;
        if (c8 >= d8) continue;
        const uint8_t* codes = raw + (v ? kTile * S::kRawRow : 0) + key * S::kRawRow;
        const uint8_t* scales = raw_scales + (v ? kTile : 0) * S::kScaleRow + key * S::kScaleRow;
        const uint4 x =
            v ? dequant8<F, false>(codes, scales, c8) : dequant8<F, true>(codes, scales, c8);
        *reinterpret_cast<uint4*>(deq + (v ? kTile * S::kOpRow : 0) + key * S::kOpRow + 16 * c8) =
            x;
      }
      if constexpr (kRowScales) {
        if (tid < kTile) {
          s_ks[tid] = row_scale(raw_scales + tid * S::kScaleRow);
          const float vs = row_scale(raw_scales + (kTile + tid) * S::kScaleRow);
          s_vs[tid] = vs;
          const float wm = warp_max(vs);
          if (lane == 0) s_red[warp] = wm;
        }
      }
      k_op = deq;
      v_op = deq + kTile * S::kOpRow;
      __syncthreads();
    }
    float sigma_ratio = 1.f;  // σ_old / σ_new, applied to o with α
    if constexpr (kRowScales) {
      const float s_new = fmaxf(sigma, fmaxf(s_red[0], s_red[1]));
      if (s_new > 0.f) sigma_ratio = sigma / s_new;
      sigma = s_new;
    }
    if (!computes) continue;

    // ---- S = Q·K̂ᵀ for this warp's 16 rows and 8·NB keys ----
    float s[NB][4];
    for (auto& x : s) x[0] = x[1] = x[2] = x[3] = 0.f;
    const uint32_t q_base = shared_addr(smem + S::kQ) + my_rt * 16 * S::kOpRow;
    const uint32_t k_base = shared_addr(k_op) + key0 * S::kOpRow;
#pragma unroll
    for (int kd = 0; kd < DP / 16; ++kd) {
      if (kd >= d16) continue;  // uniform; continue keeps the loop unrolled
      uint32_t af[4];
      ldmatrix_x4(af, ldsm_a_addr(q_base + kd * 32, S::kOpRow, lane));
#pragma unroll
      for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, ldsm_b_addr(k_base + nb2 * 16 * S::kOpRow + kd * 32, S::kOpRow, lane));
        mma_16bit<__nv_bfloat16>(s[2 * nb2], af, bf[0], bf[1]);
        mma_16bit<__nv_bfloat16>(s[2 * nb2 + 1], af, bf[2], bf[3]);
      }
    }

    // ---- online softmax (log2 domain) ----
    const int tile_base = jb + t * kTile;
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nb * 8 + 2 * (lane % 4) + (e & 1);
        const int j = tile_base + key;
        const bool vis = j < je && j <= lim[e >> 1];
        float x = s[nb][e];
        if constexpr (kRowScales) x *= s_ks[key];
        x = vis ? x * a.scale_log2 : kNegInf;
        s[nb][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float alpha[2];
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));
      alpha[h] = m_new == kNegInf ? 1.f : exp2f(m[h] - m_new);
      m[h] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = s[nb][e];
        const float p = x == kNegInf ? 0.f : exp2f(x - m[e >> 1]);
        rowsum[e >> 1] += p;
        float pv = p;
        if constexpr (kRowScales) {
          const int key = key0 + nb * 8 + 2 * (lane % 4) + (e & 1);
          pv = sigma > 0.f ? p * (s_vs[key] / sigma) : 0.f;
        }
        s[nb][e] = pv;
      }
    }
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
    const float ra[2] = {alpha[0] * sigma_ratio, alpha[1] * sigma_ratio};
#pragma unroll
    for (int nd = 0; nd < DP / 8; ++nd) {
      o[nd][0] *= ra[0];
      o[nd][1] *= ra[0];
      o[nd][2] *= ra[1];
      o[nd][3] *= ra[1];
    }

    // ---- o += P·V̂ (P as high part plus remainder) ----
    const uint32_t v_base = shared_addr(v_op) + key0 * S::kOpRow;
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
      uint32_t hi[4], lo[4];
      split_pair<VT>(s[2 * kk][0], s[2 * kk][1], hi[0], lo[0]);
      split_pair<VT>(s[2 * kk][2], s[2 * kk][3], hi[1], lo[1]);
      split_pair<VT>(s[2 * kk + 1][0], s[2 * kk + 1][1], hi[2], lo[2]);
      split_pair<VT>(s[2 * kk + 1][2], s[2 * kk + 1][3], hi[3], lo[3]);
#pragma unroll
      for (int nd2 = 0; nd2 < DP / 16; ++nd2) {
        if (nd2 >= d16) continue;
        uint32_t bf[4];
        ldmatrix_x4_trans(bf,
                          ldsm_a_addr(v_base + kk * 16 * S::kOpRow + nd2 * 32, S::kOpRow, lane));
        mma_16bit<VT>(o[2 * nd2], hi, bf[0], bf[1]);
        mma_16bit<VT>(o[2 * nd2 + 1], hi, bf[2], bf[3]);
        mma_16bit<VT>(o[2 * nd2], lo, bf[0], bf[1]);
        mma_16bit<VT>(o[2 * nd2 + 1], lo, bf[2], bf[3]);
      }
    }
  }
  common::cp_async_wait<0>();

  // ---- epilogue: row sums, V scale, merge of the key slices ----
  for (int h = 0; h < 2; ++h) l[h] = quad_sum(l[h]);
  if constexpr (kRowScales) {
#pragma unroll
    for (auto& x : o) {
      x[0] *= sigma;
      x[1] *= sigma;
      x[2] *= sigma;
      x[3] *= sigma;
    }
  }
  const int g = lane / 4, t4 = lane % 4;
  if constexpr (kSlices > 1) {
    __syncthreads();  // every warp is done with the tiles: reuse their memory
    float* mine = reinterpret_cast<float*>(smem + S::kStage0 + warp * S::kMergeWarp);
    if (computes) {
#pragma unroll
      for (int nd = 0; nd < DP / 8; ++nd) {
        if (nd >= 2 * d16) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          mine[(g + 8 * (e >> 1)) * DP + nd * 8 + 2 * t4 + (e & 1)] = o[nd][e];
      }
      if (t4 == 0)
        for (int h = 0; h < 2; ++h) {
          mine[16 * DP + g + 8 * h] = m[h];
          mine[16 * DP + 16 + g + 8 * h] = l[h];
        }
    }
    __syncthreads();
    if (!computes || my_slice != 0) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      float M = kNegInf;
      for (int sl = 0; sl < kSlices; ++sl) {
        const float* other =
            reinterpret_cast<const float*>(smem + S::kStage0 + (warp + sl) * S::kMergeWarp);
        M = fmaxf(M, other[16 * DP + r]);
      }
      float lsum = 0.f;
      float w[kSlices];
#pragma unroll
      for (int sl = 0; sl < kSlices; ++sl) {
        const float* other =
            reinterpret_cast<const float*>(smem + S::kStage0 + (warp + sl) * S::kMergeWarp);
        const float ms = other[16 * DP + r];
        w[sl] = ms == kNegInf ? 0.f : exp2f(ms - M);
        lsum += w[sl] * other[16 * DP + 16 + r];
      }
#pragma unroll
      for (int nd = 0; nd < DP / 8; ++nd) {
        if (nd >= 2 * d16) continue;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float acc = 0.f;
#pragma unroll
          for (int sl = 0; sl < kSlices; ++sl) {
            const float* other =
                reinterpret_cast<const float*>(smem + S::kStage0 + (warp + sl) * S::kMergeWarp);
            acc += w[sl] * other[r * DP + nd * 8 + 2 * t4 + c];
          }
          o[nd][2 * h + c] = acc;
        }
      }
      m[h] = M;
      l[h] = lsum;
    }
  } else if (!computes) {
    return;
  }

  // ---- outputs ----
  const bool bad = bad_length || *s_bad != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = my_rt * 16 + g + 8 * h;
    if (r >= nrows) continue;
    const int gr = row0 + r, i = gr % a.nq, hq = hk * a.group + gr / a.nq;
    const bool empty = m[h] == kNegInf;
    const float inv = empty ? 0.f : 1.f / l[h];
    const float nan = __int_as_float(0x7fc00000);
    if (a.splits == 1) {
      T* orow = static_cast<T*>(a.o) + b * a.o_sb + hq * a.o_sh + i * a.o_sn;
#pragma unroll
      for (int nd = 0; nd < DP / 8; ++nd) {
        const int col = nd * 8 + 2 * t4;
        if (col >= a.d) continue;
        const float x0 = bad ? nan : o[nd][2 * h] * inv, x1 = bad ? nan : o[nd][2 * h + 1] * inv;
        if constexpr (std::is_same_v<T, __half>)
          *reinterpret_cast<__half2*>(orow + col) = __floats2half2_rn(x0, x1);
        else
          *reinterpret_cast<__nv_bfloat162*>(orow + col) = __floats2bfloat162_rn(x0, x1);
      }
      if (a.lse != nullptr && t4 == 0) {
        const float lse = bad     ? nan
                          : empty ? kNegInf
                                  : (m[h] + log2f(l[h])) * kLn2 + a.sm_scale * s_qc[r];
        a.lse[(int64_t{b} * a.heads_q + hq) * a.nq + i] = lse;
      }
    } else {
      const int64_t row = (int64_t{b} * a.heads_q + hq) * a.nq + i;
      float* op = a.o_part + (row * a.splits + split) * a.d;
#pragma unroll
      for (int nd = 0; nd < DP / 8; ++nd) {
        const int col = nd * 8 + 2 * t4;
        if (col >= a.d) continue;
        op[col] = bad ? nan : o[nd][2 * h] * inv;
        op[col + 1] = bad ? nan : o[nd][2 * h + 1] * inv;
      }
      if (t4 == 0) {
        a.lse_part[row * a.splits + split] = bad ? nan : empty ? kNegInf : m[h] + log2f(l[h]);
        if (split == 0) a.qc_part[row] = s_qc[r];
      }
    }
  }
}

template <typename T, int DP, KvFormat F>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(const DecodeArgs a) {
  using S = Smem<DP, F>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int split = blockIdx.x % a.splits, row0 = (blockIdx.x / a.splits) * kRowsPerCta<DP>;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int nrows = min(kRowsPerCta<DP>, a.rows - row0);
  const int rtiles = (nrows + 15) / 16;

  int L = __ldg(a.lengths + b);
  const bool bad_length = L < 0 || L > a.capacity;
  if (bad_length) L = 0;  // read nothing; the outputs become NaN

  // Zero everything the loop uses: the operand rows' padding and unused columns, and the
  // Q rows past nrows, must hold finite values.
  for (int i = tid; i < S::kLoopBytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // Q rows in BF16 (as the emulation rounds them) and q·c.
  const float* c = a.k_mean != nullptr ? a.k_mean + (int64_t{b} * a.heads_kv + hk) * a.d : nullptr;
  float* s_qc = reinterpret_cast<float*>(smem + S::kQc);
  for (int r = warp; r < nrows; r += kThreads / 32) {
    const int gr = row0 + r, i = gr % a.nq, hq = hk * a.group + gr / a.nq;
    const T* qrow = static_cast<const T*>(a.q) + b * a.q_sb + hq * a.q_sh + i * a.q_sn;
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(smem + S::kQ + r * S::kOpRow);
    float qc = 0.f;
    for (int e = lane; e < a.d; e += 32) {
      const __nv_bfloat16 x = __float2bfloat16_rn(common::to_float(qrow[e]));
      dst[e] = x;
      if (c != nullptr) qc += __bfloat162float(x) * __ldg(c + e);
    }
    qc = warp_sum(qc);
    if (lane == 0) s_qc[r] = qc;
  }
  __syncthreads();

  if (rtiles == 1) {
    decode_cta<T, DP, F, 2>(a, smem, rtiles, nrows, row0, hk, b, split, L, bad_length);
  } else if (rtiles == 2) {
    decode_cta<T, DP, F, 4>(a, smem, rtiles, nrows, row0, hk, b, split, L, bad_length);
  } else if constexpr (kRowsPerCta<DP> > 32) {
    decode_cta<T, DP, F, 8>(a, smem, rtiles, nrows, row0, hk, b, split, L, bad_length);
  }
}

// The merge of the chunks' partials, one CTA per query row, chunks in order (the
// emulation's step 5).
template <typename T>
__device__ void merge_row(const DecodeArgs& a, int64_t row) {
  const int i = static_cast<int>(row % a.nq);
  const int hq = static_cast<int>(row / a.nq % a.heads_q);
  const int64_t b = row / (int64_t{a.nq} * a.heads_q);
  const float* lse = a.lse_part + row * a.splits;
  float M = kNegInf;
  bool nan = false;
  for (int s = 0; s < a.splits; ++s) {
    const float x = lse[s];
    nan |= x != x;
    M = fmaxf(M, x);
  }
  T* orow = static_cast<T*>(a.o) + b * a.o_sb + hq * a.o_sh + i * a.o_sn;
  const float qnan = __int_as_float(0x7fc00000);
  if (nan || M == kNegInf) {  // a bad index (NaN) or a row that sees no key
    for (int col = threadIdx.x; col < a.d; col += kThreads) orow[col] = T(nan ? qnan : 0.f);
    if (a.lse != nullptr && threadIdx.x == 0) a.lse[row] = nan ? qnan : kNegInf;
    return;
  }
  float W = 0.f;
  for (int s = 0; s < a.splits; ++s) W += lse[s] == kNegInf ? 0.f : exp2f(lse[s] - M);
  const float* op = a.o_part + row * a.splits * a.d;
  for (int col = threadIdx.x; col < a.d; col += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < a.splits; ++s)
      if (lse[s] != kNegInf) acc += exp2f(lse[s] - M) * op[int64_t{s} * a.d + col];
    orow[col] = T(acc / W);
  }
  if (a.lse != nullptr && threadIdx.x == 0)
    a.lse[row] = (M + log2f(W)) * kLn2 + a.sm_scale * a.qc_part[row];
}

// The merge of the chunks' partials (the emulation's step 5, chunks in order): one CTA
// per query row, grid-strided.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(const DecodeArgs a, int64_t rows) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) merge_row<T>(a, row);
}

}  // namespace
}  // namespace qattn::kv_cache

#include "cuda/kv_cache/decode_direct.cuh"

namespace qattn::kv_cache {
namespace {

DecodeArgs make_args(const qattn_kv_decode_params& p, const qattn_kv_cache& c, int32_t splits,
                     void* workspace) {
  const kvcache::KvPageLayout lay =
      kvcache::page_layout(static_cast<KvFormat>(c.format), c.heads_kv, c.head_dim, c.page_size);
  DecodeArgs a{};
  a.pages = static_cast<const uint8_t*>(c.pages);
  a.page_bytes = lay.page_bytes;
  a.k_codes = lay.k_codes;
  a.v_codes = lay.v_codes;
  a.k_scales = lay.k_scales;
  a.v_scales = lay.v_scales;
  a.head_code_bytes = lay.head_code_bytes;
  a.head_scale_bytes = lay.head_scale_bytes;
  a.code_row_bytes = static_cast<int32_t>(lay.code_row_bytes);
  a.scale_row_bytes = static_cast<int32_t>(lay.scale_row_bytes);
  a.page_size = c.page_size;
  const auto page_size = static_cast<uint32_t>(c.page_size);
  a.page_shift = std::has_single_bit(page_size) ? std::countr_zero(page_size) : -1;
  a.num_pages = c.num_pages;
  a.max_pages_per_seq = c.max_pages_per_seq;
  a.capacity = c.max_pages_per_seq * c.page_size;
  a.block_tables = p.seqs.block_tables;
  a.lengths = p.seqs.lengths;
  a.k_mean = c.k_smoothing == QATTN_KV_SMOOTH_PREFILL_MEAN ? p.seqs.k_mean : nullptr;
  a.q = p.q.data;
  a.q_sb = p.q.stride_b;
  a.q_sh = p.q.stride_h;
  a.q_sn = p.q.stride_n;
  a.o = p.o.data;
  a.o_sb = p.o.stride_b;
  a.o_sh = p.o.stride_h;
  a.o_sn = p.o.stride_n;
  a.lse = p.lse;
  a.heads_q = p.heads_q;
  a.heads_kv = c.heads_kv;
  a.group = p.heads_q / c.heads_kv;
  a.nq = p.nq;
  a.d = c.head_dim;
  a.rows = a.group * p.nq;
  a.splits = splits;
  a.causal = p.causal;
  a.sm_scale = p.sm_scale;
  a.scale_log2 = static_cast<float>(static_cast<double>(p.sm_scale) * 1.4426950408889634);
  if (splits > 1) {
    const DecodeWorkspace w = decode_workspace(p.batch, p.heads_q, p.nq, c.head_dim, splits);
    auto* base = static_cast<uint8_t*>(workspace);
    a.o_part = reinterpret_cast<float*>(base + w.o_partial);
    a.lse_part = reinterpret_cast<float*>(base + w.lse_partial);
    a.qc_part = reinterpret_cast<float*>(base + w.qc);
  }
  return a;
}

// The direct kernel's dynamic shared memory is above the default 48 KB and its CTAs per
// SM need the largest shared-memory carveout: both set once per context.
template <typename T, KvFormat F, int DP, int NQB>
cudaError_t run_direct(const DecodeArgs& a, int batch, cudaStream_t stream) {
  static std::atomic<unsigned long long> done{0};
  auto kernel = direct::decode_direct_kernel<T, F, DP, NQB>;
  constexpr int kBytes = direct::direct_smem_bytes<F, DP, NQB>();
  // The kernel's row sizes are compile-time (the page layout of its format and head dim).
  using B = direct::Bytes<F, DP>;
  if (a.code_row_bytes != B::kCodeRow || a.scale_row_bytes != B::kScaleRow)
    return cudaErrorInvalidValue;
  if (auto e = hopper::once_per_context(done,
                                        [&] {
                                          cudaError_t r = cudaFuncSetAttribute(
                                              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              kBytes);
                                          if (r != cudaSuccess) return r;
                                          return cudaFuncSetAttribute(
                                              kernel,
                                              cudaFuncAttributePreferredSharedMemoryCarveout,
                                              int{cudaSharedmemCarveoutMaxShared});
                                        });
      e != cudaSuccess)
    return e;
  const int row_groups = NQB == 1 ? 1 : (a.rows + 15) / 16;
  const dim3 grid(a.splits * row_groups, a.heads_kv, batch);
  kernel<<<grid, direct::kWarps * 32, kBytes, stream>>>(a);
  return cudaSuccess;
}

template <typename T, int DP, KvFormat F>
cudaError_t run(const DecodeArgs& a, int batch, cudaStream_t stream) {
  using S = Smem<DP, F>;
  if constexpr (DP == 64 || DP == 128) {
    if (decode_is_direct(a.d)) {  // the direct kernel (decode_direct.cuh)
      // 8 query rows per CTA when the group × new tokens fit (one n-block), else 16.
      cudaError_t e = a.rows <= 8 ? run_direct<T, F, DP, 1>(a, batch, stream)
                                  : run_direct<T, F, DP, 2>(a, batch, stream);
      if (e != cudaSuccess) return e;
      if (a.splits > 1) {
        const int64_t rows = int64_t{batch} * a.heads_q * a.nq;
        const auto blocks =
            static_cast<unsigned>(rows < (int64_t{1} << 20) ? rows : int64_t{1} << 20);
        merge_kernel<T><<<blocks, kThreads, 0, stream>>>(a, rows);
      }
      return cudaGetLastError();
    }
  }
  static std::atomic<unsigned long long> done{0};
  auto kernel = decode_kernel<T, DP, F>;
  if (auto e = hopper::once_per_context(done,
                                        [&] {
                                          return cudaFuncSetAttribute(
                                              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              S::kBytes);
                                        });
      e != cudaSuccess)
    return e;
  const int row_groups = (a.rows + kRowsPerCta<DP> - 1) / kRowsPerCta<DP>;
  const dim3 grid(a.splits * row_groups, a.heads_kv, batch);
  kernel<<<grid, kThreads, S::kBytes, stream>>>(a);
  if (a.splits > 1) {
    const int64_t rows = int64_t{batch} * a.heads_q * a.nq;
    const auto blocks = static_cast<unsigned>(rows < (int64_t{1} << 20) ? rows : int64_t{1} << 20);
    merge_kernel<T><<<blocks, kThreads, 0, stream>>>(a, rows);
  }
  return cudaGetLastError();
}

template <typename T, int DP>
cudaError_t by_format(const DecodeArgs& a, int32_t format, int batch, cudaStream_t stream) {
  switch (format) {
    case QATTN_KV_NVFP4:
      return run<T, DP, KvFormat::NvFp4>(a, batch, stream);
    case QATTN_KV_FP8_E4M3:
      return run<T, DP, KvFormat::Fp8E4M3>(a, batch, stream);
    case QATTN_KV_INT8:
      return run<T, DP, KvFormat::Int8>(a, batch, stream);
    default:
      return run<T, DP, KvFormat::Bf16>(a, batch, stream);
  }
}

template <typename T>
cudaError_t by_dim(const DecodeArgs& a, int32_t format, int batch, cudaStream_t stream) {
  if (a.d <= 64) return by_format<T, 64>(a, format, batch, stream);
  if (a.d <= 128) return by_format<T, 128>(a, format, batch, stream);
  return by_format<T, 256>(a, format, batch, stream);
}

}  // namespace

int launch_decode(const qattn_kv_decode_params& p, const qattn_kv_cache& c, int32_t splits,
                  void* workspace, void* stream) {
  const DecodeArgs a = make_args(p, c, splits, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = p.dtype == QATTN_DTYPE_FP16
                            ? by_dim<__half>(a, c.format, p.batch, s)
                            : by_dim<__nv_bfloat16>(a, c.format, p.batch, s);
  return static_cast<int>(e);
}

}  // namespace qattn::kv_cache
