// One (Q block × KV tile) step of the SageBwd backward: the element-wise steps both
// kernels share (scores_to_p, finish_tile) and the deterministic dQ kernel's mma.sync
// products (tile_step). Eight warps; warp w owns KV rows 16w..16w+15 of the tile and the
// transposed products, KV rows × 64 Q columns:
//   Sᵀ  = K̂_j·Q̂_iᵀ (8-bit)     -> P = exp2(Sᵀ·s_q·s_k·sm_scale·log2 e − lse2)
//   dPᵀ = V_j·dO_iᵀ (16-bit, or 8-bit with the quantized dO·Vᵀ)
//   dS  = P ∘ (dP − delta)
// then the tile's P and dS maxima (one barrier), and P̂ᵀ, dŜᵀ as 8-bit A fragments
// (permute.cuh). The emulator's steps 1-4 (src/emulate/sagebwd.h) in the same order.
// "8-bit" is the backward's format (format8.cuh): INT8 or E4M3.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/exp2.cuh"
#include "cuda/common/mma_sync.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/hopper/sync.cuh"
#include "cuda/sagebwd/args.h"
#include "cuda/sagebwd/format8.cuh"
#include "cuda/sagebwd/permute.cuh"
#include "numerics/block_scale.h"
#include "numerics/formats.h"

namespace qattn::sagebwd {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kNBlocksQ = kQBlockRows / 8;  // 8 n-blocks of Q columns

// Shared-memory row strides in bytes: 16 bytes of padding keep ldmatrix's eight row
// addresses in distinct banks.
template <int D>
struct Strides {
  static constexpr int kI8 = D + 16;                 // 8-bit rows of D
  static constexpr int k16 = 2 * D + 16;             // 16-bit rows of D
  static constexpr int kKvT = kKvTileRows + 16;      // rows of 128 tokens (Kᵀ, dŜ)
  static constexpr int kQT = kQBlockRows + 16;       // rows of 64 query rows (Qᵀ, dOᵀ)
};

// Per-thread results of a tile step. P and dS have one scale per half of the tile's 128
// KV rows (the emulator's SageBwdOptions::pds_block_keys = 64): warps 0-3 hold half 0,
// warps 4-7 half 1, so a warpgroup of the wgmma kernel quantizes with its own half's,
// found by its own four warps (a named barrier per half, not the CTA's).
struct TileFrags {
  uint32_t p[2][4];   // P̂ᵀ as A fragments of the two 32-wide k steps over Q
  uint32_t ds[2][4];  // dŜᵀ likewise
  float s_p, s_ds;    // this warp's half's scales (amax / the format's maximum)
};

// dS's scales of both halves (dQ sums over all 128 KV rows), from the maxima finish_tile
// left in `red`: read after a CTA barrier that follows every warp's finish_tile, and
// before any warp can write `red` again.
template <typename F>
__device__ __forceinline__ void ds_half_scales(const float* red, float (&s)[2]) {
  float m[2] = {0.0f, 0.0f};
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m[w / 4] = fmaxf(m[w / 4], red[2 * w + 1]);
  s[0] = numerics::linear_scale(m[0], F::kMax);
  s[1] = numerics::linear_scale(m[1], F::kMax);
}

// The accumulator of eight n-blocks (KV rows × 64 Q columns) as two k steps of A.
template <typename F>
__device__ __forceinline__ void to_a_frags(const float (&x)[kNBlocksQ][4], float inv,
                                           uint32_t (&a)[2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const int n = 4 * kk;
    a[kk][0] = F::pack4(x[n][0], x[n][1], x[n + 1][0], x[n + 1][1], inv);
    a[kk][1] = F::pack4(x[n][2], x[n][3], x[n + 1][2], x[n + 1][3], inv);
    a[kk][2] = F::pack4(x[n + 2][0], x[n + 2][1], x[n + 3][0], x[n + 3][1], inv);
    a[kk][3] = F::pack4(x[n + 2][2], x[n + 2][3], x[n + 3][2], x[n + 3][3], inv);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// C[16 × 64] += A(rows at a_base, stride a_stride) · B(64 [n] rows at b_base)ᵀ over
// kSteps·32 bytes of k; 8-bit.
template <typename F, int kSteps>
__device__ __forceinline__ void mma_rows_x64_8(typename F::Acc (&c)[kNBlocksQ][4], uint32_t a_base,
                                                int a_stride, uint32_t b_base, int b_stride,
                                                int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[4];
    common::ldmatrix_x4(a, common::ldsm_a_addr(a_base + 32 * kk, a_stride, lane));
#pragma unroll
    for (int np = 0; np < kNBlocksQ / 2; ++np) {
      uint32_t b[4];
      common::ldmatrix_x4(b, common::ldsm_b_addr(b_base + 16 * np * b_stride + 32 * kk, b_stride, lane));
      F::mma(c[2 * np], a, b[0], b[1]);
      F::mma(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// C[16 × 8·kNb] += A · B(8·kNb [n] rows)ᵀ over kSteps·16 elements of k; 16-bit.
template <typename T, int kSteps, int kNb>
__device__ __forceinline__ void mma_rows_16(float (&c)[kNb][4], uint32_t a_base, int a_stride,
                                            uint32_t b_base, int b_stride, int lane) {
#pragma unroll 2  // a full unroll hoists more B fragments than the registers hold
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[4];
    common::ldmatrix_x4(a, common::ldsm_a_addr(a_base + 32 * kk, a_stride, lane));
#pragma unroll
    for (int np = 0; np < kNb / 2; ++np) {
      uint32_t b[4];
      common::ldmatrix_x4(b, common::ldsm_b_addr(b_base + 16 * np * b_stride + 32 * kk, b_stride, lane));
      common::mma_16bit<T>(c[2 * np], a, b[0], b[1]);
      common::mma_16bit<T>(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Where a tile's operands are in shared memory (byte addresses) and its scalars.
struct TileOperands {
  uint32_t k8, v, q8, dov;   // K̂_j, V_j (16-bit or 8-bit), Q̂_i, dO_i (16-bit or 8-bit) rows
  const float* lse2;         // 64 values of block i
  const float* delta;
  const float* inv_s;        // 64 values of 1/s_i (the merge-free scales only)
  float s_qk;                // s_q(i)·s_k(j)
  float s_dov;               // s_dO(i)·s_V(j) (quantized dO·Vᵀ only)
  int q0, j0;                // first query row / token of the tile
};

// Step 1's element-wise part: P = exp2(Sᵀ·s_q·s_k·sm_scale·log2 e − lse2) from the
// unscaled scores of the warp's 16 KV rows (rows 16·warp + g (+8), Q columns 8n + 2t
// (+1)); 0 where the token is past Nkv or above the causal horizon.
template <typename F>
__device__ __forceinline__ void scores_to_p(const Args& a, const TileOperands& op,
                                            const typename F::Acc (&acc)[kNBlocksQ][4], int warp,
                                            int lane, float (&p)[kNBlocksQ][4]) {
  const int g = lane >> 2, t = lane & 3;
  // x = S·log2 e in one FMA with the LSE: sc folds the two scales and sm_scale·log2 e.
  const float sc = op.s_qk * a.scale_log2;
  // A tile inside the sequence and wholly under the causal horizon needs no mask.
  const bool full = op.j0 + kKvTileRows <= a.nkv &&
                    (!a.causal || op.j0 + kKvTileRows - 1 <= op.q0 + a.nkv - a.nq);
#pragma unroll
  for (int n = 0; n < kNBlocksQ; ++n) {
    const float2 l2 = *reinterpret_cast<const float2*>(op.lse2 + 8 * n + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = fmaf(F::to_float(acc[n][e]), sc, -((e & 1) ? l2.y : l2.x));
      p[n][e] = common::exp2_approx(x);
    }
  }
  if (!full) {
#pragma unroll
    for (int n = 0; n < kNBlocksQ; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = op.j0 + 16 * warp + g + (e >> 1) * 8;  // token
        const int i = op.q0 + 8 * n + 2 * t + (e & 1);      // query row
        const bool vis = j < a.nkv && (!a.causal || j <= i + a.nkv - a.nq);
        if (!vis) p[n][e] = 0.0f;
      }
    }
  }
}

// Steps 2-4's element-wise part: dS = P ∘ (dP − delta), the P and |dS| maxima of the
// warp's half of the tile (warps 0-3, 4-7; `red`: 2·kWarps floats, one named barrier of
// the half's 128 threads), their scales and P̂ᵀ, dŜᵀ as 8-bit A fragments. With the
// merge-free scales (F::kMergeFree) no maxima: P̂ = E4M3(P·448), dŜ = E4M3(dS/s_i)
// (saturating), both scales fixed (the emulator's steps c, d).
template <typename F>
__device__ __forceinline__ void finish_tile(const TileOperands& op, const float (&p)[kNBlocksQ][4],
                                            const float (&dp)[kNBlocksQ][4], int warp, int lane,
                                            float* red, TileFrags& f) {
  const int t = lane & 3;
  float ds[kNBlocksQ][4];
  float amax_p = 0.0f, amax_ds = 0.0f;
#pragma unroll
  for (int n = 0; n < kNBlocksQ; ++n) {
    const float2 dl = *reinterpret_cast<const float2*>(op.delta + 8 * n + 2 * t);
    float2 iv = make_float2(1.0f, 1.0f);  // 1/s_i of the thread's two query rows
    if constexpr (F::kMergeFree) iv = *reinterpret_cast<const float2*>(op.inv_s + 8 * n + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ds[n][e] = p[n][e] * (dp[n][e] - ((e & 1) ? dl.y : dl.x));
      if constexpr (F::kMergeFree) {
        ds[n][e] *= (e & 1) ? iv.y : iv.x;
      } else {
        amax_p = fmaxf(amax_p, p[n][e]);
        amax_ds = fmaxf(amax_ds, fabsf(ds[n][e]));
      }
    }
  }
  if constexpr (F::kMergeFree) {
    f.s_p = 1.0f / F::kMax;
    f.s_ds = 1.0f;
    to_a_frags<F>(p, F::kMax, f.p);
    to_a_frags<F>(ds, 1.0f, f.ds);
    return;
  }
  amax_p = warp_max(amax_p);
  amax_ds = warp_max(amax_ds);
  if (lane == 0) {
    red[2 * warp] = amax_p;
    red[2 * warp + 1] = amax_ds;
  }
  hopper::named_barrier_sync(1 + warp / 4, 4 * 32);  // barrier 0 is __syncthreads
  const int w0 = 4 * (warp / 4);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    amax_p = fmaxf(amax_p, red[2 * (w0 + w)]);
    amax_ds = fmaxf(amax_ds, red[2 * (w0 + w) + 1]);
  }
  f.s_p = numerics::linear_scale(amax_p, F::kMax);
  f.s_ds = numerics::linear_scale(amax_ds, F::kMax);
  to_a_frags<F>(p, code_multiplier(amax_p, F::kMax), f.p);
  to_a_frags<F>(ds, code_multiplier(amax_ds, F::kMax), f.ds);
}

// Steps 1-4 for warp `warp` with mma.sync; `red` holds 2·kWarps floats. Ends after its
// half's named barrier.
template <typename T, int D, bool kQuantDov, typename F>
__device__ __forceinline__ void tile_step(const Args& a, const TileOperands& op, int warp,
                                          int lane, float* red, TileFrags& f) {
  using S = Strides<D>;
  // Sᵀ = K̂ Q̂ᵀ -> P.
  float p[kNBlocksQ][4];
  {
    typename F::Acc acc[kNBlocksQ][4] = {};
    mma_rows_x64_8<F, D / 32>(acc, op.k8 + 16 * warp * S::kI8, S::kI8, op.q8, S::kI8, lane);
    scores_to_p<F>(a, op, acc, warp, lane, p);
  }
  // dPᵀ = V dOᵀ.
  float dp[kNBlocksQ][4] = {};
  if constexpr (kQuantDov) {
    typename F::Acc acc[kNBlocksQ][4] = {};
    mma_rows_x64_8<F, D / 32>(acc, op.v + 16 * warp * S::kI8, S::kI8, op.dov, S::kI8, lane);
#pragma unroll
    for (int n = 0; n < kNBlocksQ; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = F::to_float(acc[n][e]) * op.s_dov;
  } else {
    mma_rows_16<T, D / 16, kNBlocksQ>(dp, op.v + 16 * warp * S::k16, S::k16, op.dov, S::k16, lane);
  }
  finish_tile<F>(op, p, dp, warp, lane, red, f);
}

// dŜ (64 Q rows × 128 tokens, bytes) from the warps' dŜᵀ fragments; byte (Q row qc,
// token tok) goes to sds[at(qc, tok)] (the deterministic dQ kernel's padded rows; the
// wgmma kernel stages with stmatrix, dkdv_wgmma.cuh's stage_ds).
template <typename At>
__device__ __forceinline__ void store_ds_rows(uint8_t* sds, const uint32_t (&af)[2][4], int warp,
                                              int lane, At&& at) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // a[r]: row g (+8 for r odd), slots 16·(r/2) + 4t + u <-> Q column 32kk + π(·).
      const int tok = 16 * warp + g + (r & 1) * 8;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int qc = 32 * kk + k_slot_row(16 * (r >> 1) + 4 * t + u);
        sds[at(qc, tok)] = static_cast<uint8_t>(af[kk][r] >> (8 * u));
      }
    }
  }
}

// The warp's part of dQ_i (64 × D): rows 16·(warp % 4).., columns (warp / 4)·D/2..;
// dŜ·K̂ over each 64-token half of the tile (unscaled sums; scale[h] the half's), 16
// columns at a time, handed to emit(n, e, value·scale[h]) for n-block n (of D/16) and
// accumulator element e, half 0 first.
template <int D, typename F, typename Emit>
__device__ __forceinline__ void dq_product(uint32_t sds, uint32_t skt, const float (&scale)[2],
                                           int warp, int lane, Emit&& emit) {
  using S = Strides<D>;
  constexpr int kNb = D / 16;  // n-blocks of 8 columns in half of D
  const uint32_t a_base = sds + 16 * (warp % 4) * S::kKvT;
  const uint32_t b_base = skt + (warp / 4) * (D / 2) * S::kKvT;
  constexpr int kStepsPerHalf = kKvTileRows / 64;  // 32-token k steps in 64 tokens
#pragma unroll
  for (int nc = 0; nc < kNb / 2; ++nc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      typename F::Acc tmp[2][4] = {};
#pragma unroll
      for (int k2 = 0; k2 < kStepsPerHalf; ++k2) {
        const int kk = h * kStepsPerHalf + k2;
        uint32_t af[4], b[4];
        common::ldmatrix_x4(af, common::ldsm_a_addr(a_base + 32 * kk, S::kKvT, lane));
        common::ldmatrix_x4(b, common::ldsm_b_addr(b_base + 16 * nc * S::kKvT + 32 * kk, S::kKvT, lane));
        F::mma(tmp[0], af, b[0], b[1]);
        F::mma(tmp[1], af, b[2], b[3]);
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) emit(2 * nc + m, e, F::to_float(tmp[m][e]) * scale[h]);
    }
  }
}

}  // namespace qattn::sagebwd
