// The 16-bit ("precise") forward on sm_90a and its launch: Q·Kᵀ and P·V on BF16/FP16
// wgmma in the inputs' own type, FP32 accumulation, nothing quantized. It is the
// arithmetic of src/emulate/precision.cpp's precise_options() (its contract: FP32
// scores of the exact 16-bit products, P = exp2(x − m) rounded to the input type, the
// row sum of the rounded P, O / l rounded once), in the SA2 kernel's 128-key tiles.
//
// One CTA per (128-row query block, query head, batch entry), 3 warpgroups. Warpgroup
// 0's first thread loads: the Q block once, then K and V tiles into a ring of kStages
// stages, straight from the caller's tensors by TMA (rows past N and channels past d
// read as zero). Warpgroups 1 and 2 each own 64 query rows; per tile they issue the
// next tile's Q·Kᵀ together with this tile's P·V, so the next softmax runs while P·V
// computes. The O accumulator is rescaled in place (single-level accumulation: a 16-bit
// MMA accumulates in full FP32, unlike the FP8 one, so no second level is needed).
// Epilogue: O / l into shared memory, then TMA stores (sage2_fwd/epilogue.cuh). A
// boolean attn_mask is read element by element on every tile (no tile lists: this
// kernel is for accuracy, and the SA2-8b kernel's skipping is for speed).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/exp2.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/mask.cuh"
#include "cuda/hopper/per_device.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tensor_map.h"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "cuda/precise_fwd/launch.h"
#include "cuda/sage2_fwd/epilogue.cuh"
#include "numerics/key_range.h"
#include "numerics/precision_guard.h"
#include "numerics/sm_scale.h"

namespace qattn::precise {
namespace {

constexpr int kBlockM = 128;  // query rows per CTA, 64 per consumer warpgroup
constexpr int kBlockN = 128;  // keys per tile (the emulator's tile)
constexpr int kThreads = 384;
// Registers after setmaxnreg: 40 × 128 + 232 × 256 fits the 168 × 384 the CTA has.
constexpr int kConsumerRegs = 232, kProducerRegs = 40;
constexpr int kBoxBytes = 128 * 128;  // one TMA box: 128 rows × 64 16-bit channels
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  float scale_log2;  // sm_scale · log2(e)
  void* o;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int o_tma_cols;  // O is stored by TMA up to here, the partial chunk after it directly
  float* lse;      // (B, Hq, Nq) natural log, or null
  int heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim;
  int head_dim_v;  // O's columns, for the shared epilogue: head_dim (its family takes no other)
  numerics::KeyRule keys;  // the call's rule, kv_len = seqlen_kv
  const int* kv_lengths;   // (B) or null: each batch entry's key-padding length
  int num_m_blocks;
  // Precision "auto": the guard's per-head maxima (cuda/precision_guard); a CTA whose head
  // the rule does not flag returns at once, leaving the SA2-8b output in place. Null:
  // every head runs.
  const float* guard_q;  // (B, Hq, 2)
  const float* guard_k;  // (B, Hkv, 2)
  // A boolean attn_mask (the C ABI's: byte strides, 0 broadcasts), tested element by
  // element on every tile; null without one. With it the key rule is every key.
  const uint8_t* mask;
  int64_t mask_sb, mask_sh, mask_sq, mask_sk;
};

template <int D>
struct Storage {
  static constexpr int kBoxes = D / 64;
  static constexpr int kTileBytes = kBoxes * kBoxBytes;  // Q block, K tile or V tile
  // d=128: two stages fill 192 KB with Q and the O staging; d=64 has room for four.
  static constexpr int kStages = D == 128 ? 2 : 4;
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kTileBytes];
  alignas(1024) uint8_t o[2][kBoxes * sage2::kOBoxBytes];  // each consumer warpgroup's O
  alignas(16) float ones[D];  // the per-channel factor stage_output applies: 1
};

struct Barriers {
  uint64_t q_full;
  uint64_t k_full[4], k_empty[4], v_full[4], v_empty[4];
};
constexpr uint32_t kConsumerWarps = 8;  // each arrives once on an empty barrier

// A thread's two rows' running max (log2 units) and row sum; l is this thread's share
// of the row until the epilogue adds the quad's four.
struct RowStats {
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
};

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    precise_fwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v,
                       const __grid_constant__ CUtensorMap tm_o, const Params p) {
  using St = Storage<D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kStages = St::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t align_pad = (1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u;
  auto& s = *reinterpret_cast<St*>(smem_raw + align_pad);
  __shared__ Barriers bar;

  // The item; the longest query blocks (causal: the last) start first.
  const int m_block = p.num_m_blocks - 1 - static_cast<int>(blockIdx.x);
  const int hq = blockIdx.y, b = blockIdx.z;
  const int hkv = hq / (p.heads_q / p.heads_kv);
  if (p.guard_q != nullptr) {
    const float* gq = p.guard_q + 2 * (static_cast<int64_t>(b) * p.heads_q + hq);
    const float* gk = p.guard_k + 2 * (static_cast<int64_t>(b) * p.heads_kv + hkv);
    if (!numerics::guard_flags(numerics::guard_sigma_nats(gq[0], gq[1], gk[0], gk[1]))) return;
  }
  numerics::KeyRule rule = p.keys;
  if (p.kv_lengths != nullptr) {
    const int len = p.kv_lengths[b];
    rule.kv_len = len < 0 ? 0 : (len > p.seqlen_kv ? p.seqlen_kv : len);
  }
  const int row0 = m_block * kBlockM;
  const int last_row = min(row0 + kBlockM, p.seqlen_q) - 1;
  // Every row's visible keys lie in [first_key(row0), last_key(last_row)] (both ends
  // grow with the row); tiles outside are never loaded.
  const int key_lo = rule.first_key(row0), key_hi = rule.last_key(last_row);
  const int tile0 = key_lo / kBlockN;
  const int n_tiles = key_hi < key_lo ? 0 : key_hi / kBlockN - tile0 + 1;

  if (threadIdx.x == 0) {
    hopper::mbarrier_init(&bar.q_full, 1);
    for (int i = 0; i < kStages; ++i) {
      hopper::mbarrier_init(&bar.k_full[i], 1);
      hopper::mbarrier_init(&bar.v_full[i], 1);
      hopper::mbarrier_init(&bar.k_empty[i], kConsumerWarps);
      hopper::mbarrier_init(&bar.v_empty[i], kConsumerWarps);
    }
    hopper::fence_barrier_init();
  }
  for (int i = threadIdx.x; i < D; i += kThreads) s.ones[i] = 1.f;
  __syncthreads();

  if (threadIdx.x < 128) {
    // ---- producer -------------------------------------------------------------------
    hopper::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x != 0 || n_tiles == 0) return;
    const uint64_t keep = hopper::policy_evict_last();  // K/V: read by every query block
    const uint64_t once = hopper::policy_evict_first();
    hopper::mbarrier_arrive_expect_tx(&bar.q_full, St::kTileBytes);
#pragma unroll
    for (int box = 0; box < St::kBoxes; ++box)
      hopper::tma_load_4d(s.q + box * kBoxBytes, &tm_q, &bar.q_full, box * 64, row0, hq, b, once);
    for (int it = 0; it < n_tiles; ++it) {
      const int st = it % kStages;
      const uint32_t round = static_cast<uint32_t>(it / kStages);
      const int kv0 = (tile0 + it) * kBlockN;
      if (it >= kStages) hopper::mbarrier_wait(&bar.k_empty[st], (round - 1) & 1);
      hopper::mbarrier_arrive_expect_tx(&bar.k_full[st], St::kTileBytes);
#pragma unroll
      for (int box = 0; box < St::kBoxes; ++box)
        hopper::tma_load_4d(s.k[st] + box * kBoxBytes, &tm_k, &bar.k_full[st], box * 64, kv0, hkv,
                            b, keep);
      if (it >= kStages) hopper::mbarrier_wait(&bar.v_empty[st], (round - 1) & 1);
      hopper::mbarrier_arrive_expect_tx(&bar.v_full[st], St::kTileBytes);
#pragma unroll
      for (int box = 0; box < St::kBoxes; ++box)
        hopper::tma_load_4d(s.v[st] + box * kBoxBytes, &tm_v, &bar.v_full[st], box * 64, kv0, hkv,
                            b, keep);
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------
  hopper::setmaxnreg_inc<kConsumerRegs>();
  const int cw = threadIdx.x / 128 - 1;  // which 64 rows of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const common::FragCoord fc{lane / 4, lane % 4};
  const int wg_row0 = row0 + cw * 64;
  const int thread_row0 = wg_row0 + warp * 16 + fc.g;  // the thread's rows: this and + 8
  const common::KeyMask mask{rule};
  // Tiles that start after unmasked_until or before unmasked_from cut some row's keys.
  const int unmasked_until = mask.unmasked_until(wg_row0);
  const int unmasked_from = mask.unmasked_from(wg_row0);

  constexpr int kS = kBlockN / 2;  // score elements per thread
  constexpr int kO = D / 2;        // output elements per thread
  float o[kO];
#pragma unroll
  for (int i = 0; i < kO; ++i) o[i] = 0.f;
  float acc_s[kS];
  uint32_t a_p[kBlockN / 16][4];  // P of the tile whose P·V is next, as 16-bit A fragments
  RowStats rs;

  // S = the warpgroup's 64 rows of Q · the K tile: D/16 k-steps, 4 per 64-channel box.
  auto issue_qk = [&](int st) {
    const uint64_t dq = hopper::make_smem_desc<hopper::Swizzle::k128B>(s.q + cw * 64 * 128);
    const uint64_t dk = hopper::make_smem_desc<hopper::Swizzle::k128B>(s.k[st]);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk / 4) * kBoxBytes + (kk % 4) * 32;
      if (kk == 0)
        hopper::wgmma_m64n128k16_f32_ss<kBf16, false>(acc_s, dq, dk);
      else
        hopper::wgmma_m64n128k16_f32_ss<kBf16, true>(acc_s, hopper::desc_advance(dq, off),
                                                     hopper::desc_advance(dk, off));
    }
    hopper::wgmma_commit();
  };
  // O += P · the V tile: 16 keys (2 KB of the MN-major tile) per k-step; the second
  // 64-channel box is the descriptor's next N group.
  auto issue_pv = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t dv = hopper::make_smem_desc_mn128(s.v[st] + kk * 16 * 128, kBoxBytes);
      if constexpr (D == 128)
        hopper::wgmma_m64n128k16_f32_rs_tb<kBf16>(o, a_p[kk], dv);
      else
        hopper::wgmma_m64n64k16_f32_rs_tb<kBf16>(o, a_p[kk], dv);
    }
    hopper::wgmma_commit();
  };
  // A boolean attn_mask on the thread's elements of the tile at key kv0: hidden ones
  // become -inf. Rows past Nq (never stored) and keys past Nkv (hidden by the key rule)
  // are not read.
  const uint8_t* mask_head =
      p.mask == nullptr ? nullptr : p.mask + b * p.mask_sb + hq * p.mask_sh;
  auto apply_attn_mask = [&](float(&sc)[kS], int kv0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = thread_row0 + 8 * r;
      if (row >= p.seqlen_q) continue;
      const uint8_t* mrow = mask_head + row * p.mask_sq;
#pragma unroll
      for (int i = 0; i < kS; ++i) {
        if ((i % 4) / 2 != r) continue;
        const int key = kv0 + fc.col(i);
        if (key < p.seqlen_kv && mrow[key * p.mask_sk] == 0) sc[i] = -INFINITY;
      }
    }
  };
  // The online softmax of tile `it` on acc_s (complete): masks, updates the max, leaves
  // P = exp2(x − m) in acc_s and the factor of the old O and l in alpha.
  auto softmax = [&](int it, float (&alpha)[2]) {
    const int kv0 = (tile0 + it) * kBlockN;
    if (kv0 > unmasked_until || kv0 < unmasked_from) mask.apply(acc_s, fc, kv0, thread_row0);
    if (p.mask != nullptr) apply_attn_mask(acc_s, kv0);
    // max(s)·scale = max(s·scale) (rounding is monotonic); two chains per row.
    float mp[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
    for (int i = 0; i < kS; ++i) mp[(i % 4) / 2][(i / 4) % 2] = fmaxf(mp[(i % 4) / 2][(i / 4) % 2], acc_s[i]);
    float neg_m[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(rs.m[r], fmaxf(mp[r][0], mp[r][1]) * p.scale_log2);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // A row that has seen only masked keys keeps m = -inf: no inf − inf.
      const bool empty = mx == -INFINITY;
      alpha[r] = empty ? 1.f : common::exp2_approx(rs.m[r] - mx);
      neg_m[r] = empty ? 0.f : -mx;
      rs.m[r] = mx;
    }
#pragma unroll
    for (int i = 0; i < kS; ++i)
      acc_s[i] = common::exp2_approx(fmaf(acc_s[i], p.scale_log2, neg_m[(i % 4) / 2]));
  };
  // P to the A fragments of the next P·V (the accumulator's layout is the 16-bit A
  // layout: k-step kk holds columns 16kk..16kk+15), and the row sums of the rounded P.
  auto pack_p = [&](const float (&alpha)[2]) {
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // rows g, g + 8, g, g + 8
        const uint32_t v = sage2::pack2<T>(acc_s[8 * kk + 2 * q], acc_s[8 * kk + 2 * q + 1]);
        a_p[kk][q] = v;
        const float2 f = unpack2<T>(v);
        sum[q % 2] += f.x + f.y;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) rs.l[r] = fmaf(rs.l[r], alpha[r], sum[r]);
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] *= alpha[(i % 4) / 2];
  };
  auto release = [&](uint64_t* empty_bar) {
    __syncwarp();
    if (lane == 0) hopper::mbarrier_arrive(empty_bar);
  };

  // One round: P·V of tile `it` and, with a next tile, its Q·Kᵀ and softmax while P·V
  // runs. The MMAs sit on straight-line paths (has_next is a compile-time choice), which
  // ptxas needs to keep them asynchronous.
  auto turn = [&](int it, auto has_next) {
    const int st = it % kStages;
    const uint32_t ph = static_cast<uint32_t>(it / kStages) & 1;
    const int nst = (it + 1) % kStages;
    const uint32_t nph = static_cast<uint32_t>((it + 1) / kStages) & 1;
    hopper::mbarrier_wait(&bar.v_full[st], ph);
    if constexpr (has_next) hopper::mbarrier_wait(&bar.k_full[nst], nph);
    hopper::wgmma_fence();
    if constexpr (has_next) issue_qk(nst);
    issue_pv(st);
    float alpha[2];
    if constexpr (has_next) {
      hopper::wgmma_wait<1>();
      hopper::fence_operands_f32(acc_s);
      release(&bar.k_empty[nst]);
      softmax(it + 1, alpha);
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operands_f32(o);
    hopper::fence_operands(a_p);
    release(&bar.v_empty[st]);
    if constexpr (has_next) {
      rescale_o(alpha);
      pack_p(alpha);
    }
  };

  if (n_tiles > 0) {
    hopper::mbarrier_wait(&bar.q_full, 0);
    hopper::mbarrier_wait(&bar.k_full[0], 0);
    hopper::wgmma_fence();
    issue_qk(0);
    hopper::wgmma_wait<0>();
    hopper::fence_operands_f32(acc_s);
    release(&bar.k_empty[0]);
    float alpha[2];
    softmax(0, alpha);
    pack_p(alpha);  // O and l are still zero: alpha changes nothing
    for (int it = 0; it + 1 < n_tiles; ++it) turn(it, std::true_type{});
    turn(n_tiles - 1, std::false_type{});
  }

  // ---- epilogue: O / l (the quad's row sums added) staged, then stored by TMA ----------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rs.l[r] += __shfl_xor_sync(0xffffffff, rs.l[r], 1);
    rs.l[r] += __shfl_xor_sync(0xffffffff, rs.l[r], 2);
  }
  uint8_t* stage = s.o[cw];
  sage2::stage_output<T, kO>(o, rs, fc, warp * 16 + fc.g, s.ones, stage);
  if (p.lse != nullptr && fc.t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = thread_row0 + 8 * r;
      const float l = rs.l[r];
      // A row that saw no key: -inf (O = 0). NaN stays NaN.
      if (row < p.seqlen_q)
        p.lse[(static_cast<int64_t>(b) * p.heads_q + hq) * p.seqlen_q + row] =
            l == 0.f ? -INFINITY : (rs.m[r] + log2f(l)) * kLn2;
    }
  }
  hopper::fence_proxy_async();  // the TMA store reads what this thread wrote
  hopper::named_barrier_sync(1 + cw, 128);
  if (p.o_tma_cols < p.head_dim)  // after the barrier: reads other threads' staged rows
    sage2::store_output_tail(p, b * p.heads_q + hq, wg_row0, stage);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int box = 0; box < St::kBoxes; ++box)
      if (box * 64 < p.o_tma_cols)
        hopper::tma_store_4d(&tm_o, stage + box * sage2::kOBoxBytes, box * 64, wg_row0, hq, b);
    hopper::bulk_commit_group();
    hopper::bulk_wait_group_read<0>();  // shared memory stays until the stores read it
  }
}

template <int D, typename T>
cudaError_t launch_d(const qattn_fwd_params& p, const guard::Stats* guard, cudaStream_t stream) {
  // Q, K and V in 128-row boxes; O written in 64-row boxes up to its last full 16-byte
  // chunk (a TMA store writes whole chunks; the kernel writes the rest itself).
  const int o_tma_cols = p.head_dim / 8 * 8;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  if (auto e = hopper::make_bhnd_map(&tm_q, p.q, p.batch, p.head_dim, p.head_dim, p.heads_q,
                                     p.seqlen_q, kBlockM);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_bhnd_map(&tm_k, p.k, p.batch, p.head_dim, p.head_dim, p.heads_kv,
                                     p.seqlen_kv, kBlockN);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_bhnd_map(&tm_v, p.v, p.batch, p.head_dim, p.head_dim, p.heads_kv,
                                     p.seqlen_kv, kBlockN);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_bhnd_map(&tm_o, p.o, p.batch, p.head_dim, std::max(o_tma_cols, 8),
                                     p.heads_q, p.seqlen_q, 64);
      e != cudaSuccess)
    return e;

  Params a{};
  const float sm_scale = p.sm_scale > 0.f ? p.sm_scale : numerics::default_sm_scale(p.head_dim);
  a.scale_log2 = sm_scale * kLog2e;
  a.o = p.o.data;
  a.o_stride_b = p.o.stride_b;
  a.o_stride_h = p.o.stride_h;
  a.o_stride_n = p.o.stride_n;
  a.o_tma_cols = o_tma_cols;
  a.lse = p.lse;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_kv = p.seqlen_kv;
  a.head_dim = p.head_dim;
  a.head_dim_v = p.head_dim;
  a.keys = numerics::make_key_rule(p.seqlen_q, p.seqlen_kv, p.causal != 0,
                                   p.alignment == QATTN_ALIGN_TOP_LEFT,
                                   p.window != 0 ? p.window_left : -1,
                                   p.window != 0 ? p.window_right : -1, p.seqlen_kv);
  a.kv_lengths = p.kv_lengths;
  a.num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  if (p.attn_mask_type != QATTN_MASK_NONE) {
    // Strides of dimensions of one are never multiplied by a non-zero index.
    a.mask = static_cast<const uint8_t*>(p.attn_mask);
    a.mask_sb = p.batch > 1 ? p.attn_mask_stride_b : 0;
    a.mask_sh = p.heads_q > 1 ? p.attn_mask_stride_h : 0;
    a.mask_sq = p.seqlen_q > 1 ? p.attn_mask_stride_q : 0;
    a.mask_sk = p.seqlen_kv > 1 ? p.attn_mask_stride_k : 0;
  }
  a.guard_q = guard != nullptr ? guard->q : nullptr;
  a.guard_k = guard != nullptr ? guard->k : nullptr;

  auto kernel = precise_fwd_kernel<D, T>;
  constexpr int smem = static_cast<int>(sizeof(Storage<D>)) + 1024;
  static std::atomic<unsigned long long> configured{0};
  if (auto e = hopper::once_per_context(configured, [&] {
        return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      });
      e != cudaSuccess)
    return e;
  const dim3 grid(static_cast<unsigned>(a.num_m_blocks), static_cast<unsigned>(p.heads_q),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, kThreads, smem, stream>>>(tm_q, tm_k, tm_v, tm_o, a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t run(const qattn_fwd_params& p, const guard::Stats* guard, cudaStream_t stream) {
  return p.head_dim <= 64 ? launch_d<64, T>(p, guard, stream) : launch_d<128, T>(p, guard, stream);
}

}  // namespace

int launch_forward(const qattn_fwd_params& p, void* stream, const guard::Stats* guard) {
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16 ? run<__nv_bfloat16>(p, guard, s) : run<__half>(p, guard, s);
}

}  // namespace qattn::precise
