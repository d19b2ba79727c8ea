// The deterministic mode's dQ kernel of the SageBwd backward, on mma.sync (tile.cuh holds
// its tile step; dkdv_wgmma.cuh the dK/dV kernel both modes run).
//
// dq_kernel: one CTA per (Q block i, query head, batch) walks the KV tiles in order and
// keeps dQ_i in registers, so its sum has one order run to run; it recomputes the tile
// step (two more products per tile than the dK/dV kernel's atomic dQ). It streams its
// operands through two shared-memory stages with cp.async.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sagebwd/out_stores.cuh"
#include "cuda/sagebwd/tile.cuh"

namespace qattn::sagebwd {

template <int D, bool kQuantDov>
struct Smem {
  using S = Strides<D>;
  static constexpr int kV = kQuantDov ? S::kI8 : S::k16;  // row stride of V and dO
  static constexpr int kKSide = kKvTileRows * S::kI8 + D * S::kKvT + kKvTileRows * kV;
  static constexpr int kQSideDq = kQBlockRows * S::kI8 + kQBlockRows * kV + 3 * kQBlockRows * 4;
  static constexpr int kDs = kQBlockRows * S::kKvT;
  static constexpr int kRed = 2 * kWarps * 4;
  static constexpr int kDqBytes = 2 * kKSide + kQSideDq + kDs + kRed;
};

// Copies `rows` rows of `row_bytes` (a multiple of 16) into shared memory, cooperatively.
__device__ __forceinline__ void copy_rows(uint32_t dst, int dst_stride, const void* src,
                                          int64_t src_stride, int rows, int row_bytes) {
  const int per_row = row_bytes / 16;
  for (int c = threadIdx.x; c < rows * per_row; c += kThreads) {
    const int r = c / per_row, k = c % per_row;
    common::cp_async_16(dst + r * dst_stride + 16 * k,
                        static_cast<const uint8_t*>(src) + r * src_stride + 16 * k);
  }
}

// The K side of tile `tile` of (b, hk): K̂, K̂ᵀ, V.
template <int D, bool kQuantDov>
__device__ __forceinline__ void load_k_side(const Args& a, uint32_t base, int64_t bhk, int tile) {
  using S = Strides<D>;
  using L = Smem<D, kQuantDov>;
  const int j0 = tile * kKvTileRows;
  copy_rows(base, S::kI8, a.k_i8 + (bhk * a.nkv_pad + j0) * D, D, kKvTileRows, D);
  copy_rows(base + kKvTileRows * S::kI8, S::kKvT, a.kt_i8 + bhk * D * a.nkv_pad + j0, a.nkv_pad, D,
            kKvTileRows);
  const int es = kQuantDov ? 1 : 2;
  const void* v = kQuantDov ? static_cast<const void*>(a.v_i8) : a.v_16;
  copy_rows(base + kKvTileRows * S::kI8 + D * S::kKvT, L::kV,
            static_cast<const uint8_t*>(v) + (bhk * a.nkv_pad + j0) * D * es, D * es, kKvTileRows,
            D * es);
}

// The Q side of block `blk` of (b, h): Q̂, dO, lse2, delta, 1/s_i (merge-free scales), and
// with `transposed` Q̂ᵀ, dÔᵀ.
template <int D, bool kQuantDov>
__device__ __forceinline__ void load_q_side(const Args& a, uint32_t base, int64_t bhq, int blk,
                                            bool transposed) {
  using S = Strides<D>;
  using L = Smem<D, kQuantDov>;
  const int q0 = blk * kQBlockRows;
  const int es = kQuantDov ? 1 : 2;
  const void* dov = kQuantDov ? static_cast<const void*>(a.do_i8) : a.do_16;
  uint32_t at = base;
  copy_rows(at, S::kI8, a.q_i8 + (bhq * a.nq_pad + q0) * D, D, kQBlockRows, D);
  at += kQBlockRows * S::kI8;
  copy_rows(at, L::kV, static_cast<const uint8_t*>(dov) + (bhq * a.nq_pad + q0) * D * es, D * es,
            kQBlockRows, D * es);
  at += kQBlockRows * L::kV;
  copy_rows(at, 0, a.lse2 + bhq * a.nq_pad + q0, 0, 1, kQBlockRows * 4);
  copy_rows(at + kQBlockRows * 4, 0, a.delta + bhq * a.nq_pad + q0, 0, 1, kQBlockRows * 4);
  if (a.inv_s != nullptr)
    copy_rows(at + 2 * kQBlockRows * 4, 0, a.inv_s + bhq * a.nq_pad + q0, 0, 1, kQBlockRows * 4);
  at += 3 * kQBlockRows * 4;
  if (transposed) {
    copy_rows(at, S::kQT, a.qt_i8 + bhq * D * a.nq_pad + q0, a.nq_pad, D, kQBlockRows);
    copy_rows(at + D * S::kQT, S::kQT, a.dot_i8 + bhq * D * a.nq_pad + q0, a.nq_pad, D, kQBlockRows);
  }
}

// Offsets inside a Q-side stage (load_q_side's order).
template <int D, bool kQuantDov>
struct QSide {
  using S = Strides<D>;
  using L = Smem<D, kQuantDov>;
  static constexpr int kQ8 = 0;
  static constexpr int kDo = kQBlockRows * S::kI8;
  static constexpr int kLse2 = kDo + kQBlockRows * L::kV;
  static constexpr int kDelta = kLse2 + kQBlockRows * 4;
  static constexpr int kInvS = kDelta + kQBlockRows * 4;
  static constexpr int kQt = kInvS + kQBlockRows * 4;
  static constexpr int kDot = kQt + D * S::kQT;
};

template <typename T, int D, bool kQuantDov, typename F>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const Args a) {
  using S = Strides<D>;
  using L = Smem<D, kQuantDov>;
  using Q = QSide<D, kQuantDov>;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = common::shared_addr(smem);
  const uint32_t s_q = s_base + 2 * L::kKSide;
  const uint32_t s_ds = s_q + L::kQSideDq;
  uint8_t* ds_bytes = smem + 2 * L::kKSide + L::kQSideDq;
  float* red = reinterpret_cast<float*>(ds_bytes + L::kDs);
  const float* q_f = reinterpret_cast<const float*>(smem + 2 * L::kKSide);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.group;
  const int q0 = blk * kQBlockRows, tiles = a.nkv_pad / kKvTileRows, blocks = a.nq_pad / kQBlockRows;
  const int64_t bhq = static_cast<int64_t>(b) * a.heads_q + h;
  const int64_t bhk = static_cast<int64_t>(b) * a.heads_kv + hk;
  int active = tiles;
  if (a.causal) {
    const int horizon = q0 + kQBlockRows - 1 + a.nkv - a.nq;  // last visible token of the block
    active = horizon < 0 ? 0 : min(tiles, horizon / kKvTileRows + 1);
  }
  const float s_qv = a.q_scale[bhq * blocks + blk], s_do = a.do_scale[bhq * blocks + blk];

  load_q_side<D, kQuantDov>(a, s_q, bhq, blk, false);
  auto k_stage = [&](int j) { return s_base + (j & 1) * L::kKSide; };
  if (active > 0) load_k_side<D, kQuantDov>(a, k_stage(0), bhk, 0);
  common::cp_async_commit();

  float dq[D / 16][4] = {};
  for (int j = 0; j < active; ++j) {
    common::cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < active) load_k_side<D, kQuantDov>(a, k_stage(j + 1), bhk, j + 1);
    common::cp_async_commit();
    const uint32_t st = k_stage(j);
    TileOperands op;
    op.k8 = st;
    op.v = st + kKvTileRows * S::kI8 + D * S::kKvT;
    op.q8 = s_q + Q::kQ8;
    op.dov = s_q + Q::kDo;
    op.lse2 = q_f + Q::kLse2 / 4;
    op.delta = q_f + Q::kDelta / 4;
    op.inv_s = q_f + Q::kInvS / 4;
    const float s_k = a.k_scale[bhk * tiles + j];
    op.s_qk = s_qv * s_k;
    op.s_dov = kQuantDov ? s_do * a.v_scale[bhk * tiles + j] : 0.0f;
    op.q0 = q0;
    op.j0 = j * kKvTileRows;
    TileFrags f;
    tile_step<T, D, kQuantDov, F>(a, op, warp, lane, red, f);
    store_ds_rows(ds_bytes, f.ds, warp, lane,
                  [](int qc, int tok) { return qc * Strides<D>::kKvT + kv_pos_of_token(tok); });
    __syncthreads();  // dŜ and both halves' maxima (red is written again after the loop's
                      // next __syncthreads)
    float s_ds_half[2] = {1.0f, 1.0f};  // merge-free: dŜ unscaled (s_i applied by dq_finalize)
    if constexpr (!F::kMergeFree) ds_half_scales<F>(red, s_ds_half);
    const float sc_dq[2] = {a.sm_scale * (s_ds_half[0] * s_k), a.sm_scale * (s_ds_half[1] * s_k)};
    dq_product<D, F>(s_ds, st + kKvTileRows * S::kI8, sc_dq, warp, lane,
                  [&](int n, int e, float x) { dq[n][e] += x; });
  }
  float* out = a.dq_acc + (bhq * a.nq_pad + q0 + 16 * (warp % 4)) * D + (warp / 4) * (D / 2);
#pragma unroll
  for (int n = 0; n < D / 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(g + (e >> 1) * 8) * D + 8 * n + 2 * t + (e & 1)] = dq[n][e];
}

}  // namespace qattn::sagebwd
