// The two main kernels of the SageBwd backward (tile.cuh holds their shared step).
//
// dkdv_kernel: one CTA per (KV tile j, KV head, batch) accumulates dK_j and dV_j in
// registers over every query head of its group and every Q block that sees the tile,
// then writes them once: no atomics on dK/dV, GQA sums included. With kAtomicDq it also
// adds each tile's dQ_i part into the FP32 accumulator with atomics.
// dq_kernel (the deterministic mode): one CTA per (Q block i, query head, batch) walks
// the KV tiles in order and keeps dQ_i in registers; it recomputes the tile step, so
// the deterministic backward costs two more products per tile.
// Both stream their operands through two shared-memory stages with cp.async.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sagebwd/tile.cuh"

namespace qattn::sagebwd {

template <int D, bool kQuantDov>
struct Smem {
  using S = Strides<D>;
  static constexpr int kV = kQuantDov ? S::kI8 : S::k16;  // row stride of V and dO
  static constexpr int kKSide = kKvTileRows * S::kI8 + D * S::kKvT + kKvTileRows * kV;
  static constexpr int kQSideFull =
      kQBlockRows * S::kI8 + D * S::kQT + kQBlockRows * kV + D * S::kQT + 2 * kQBlockRows * 4;
  static constexpr int kQSideDq = kQBlockRows * S::kI8 + kQBlockRows * kV + 2 * kQBlockRows * 4;
  static constexpr int kDs = kQBlockRows * S::kKvT;
  static constexpr int kRed = 2 * kWarps * 4;
  static constexpr int kDkdvBytes = kKSide + 2 * kQSideFull + kDs + kRed;
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

template <typename T>
__device__ __forceinline__ void store_out(T* p, float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *p = __float2bfloat16_rn(x);
  else
    *p = __float2half_rn(x);
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

// The Q side of block `blk` of (b, h): Q̂, dO, lse2, delta, and with `transposed` Q̂ᵀ, dÔᵀ.
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
  at += 2 * kQBlockRows * 4;
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
  static constexpr int kQt = kDelta + kQBlockRows * 4;
  static constexpr int kDot = kQt + D * S::kQT;
};

template <typename T, int D, bool kQuantDov, bool kAtomicDq>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const Args a) {
  using S = Strides<D>;
  using L = Smem<D, kQuantDov>;
  using Q = QSide<D, kQuantDov>;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = common::shared_addr(smem);
  const uint32_t s_k8 = s_base, s_kt = s_k8 + kKvTileRows * S::kI8, s_vrows = s_kt + D * S::kKvT;
  const uint32_t s_q0 = s_base + L::kKSide;
  const uint32_t s_ds = s_q0 + 2 * L::kQSideFull;
  uint8_t* ds_bytes = smem + L::kKSide + 2 * L::kQSideFull;
  float* red = reinterpret_cast<float*>(ds_bytes + L::kDs);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int j0 = tile * kKvTileRows, tiles = a.nkv_pad / kKvTileRows;
  const int blocks = a.nq_pad / kQBlockRows;
  const int64_t bhk = static_cast<int64_t>(b) * a.heads_kv + hk;
  // Causal (bottom-right): block blk sees the tile when its last row's horizon
  // q0 + 63 + nkv - nq reaches j0.
  int first = 0;
  if (a.causal) {
    const int x = j0 - (kQBlockRows - 1) - a.nkv + a.nq;
    first = x <= 0 ? 0 : (x + kQBlockRows - 1) / kQBlockRows;
  }
  const int active = blocks - first, work = a.group * active;
  const float s_k = a.k_scale[bhk * tiles + tile];
  const float s_v = kQuantDov ? a.v_scale[bhk * tiles + tile] : 0.0f;

  load_k_side<D, kQuantDov>(a, s_base, bhk, tile);
  auto q_stage = [&](int w) { return s_q0 + (w & 1) * L::kQSideFull; };
  auto bhq_of = [&](int w) { return static_cast<int64_t>(b) * a.heads_q + hk * a.group + w / active; };
  if (work > 0) load_q_side<D, kQuantDov>(a, q_stage(0), bhq_of(0), first, true);
  common::cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int w = 0; w < work; ++w) {
    common::cp_async_wait<0>();
    __syncthreads();
    if (w + 1 < work) load_q_side<D, kQuantDov>(a, q_stage(w + 1), bhq_of(w + 1), first + (w + 1) % active, true);
    common::cp_async_commit();

    const int blk = first + w % active;
    const int64_t bhq = bhq_of(w);
    const uint32_t st = q_stage(w);
    const float* st_f = reinterpret_cast<const float*>(smem + (st - s_base));
    const float s_q = a.q_scale[bhq * blocks + blk], s_do = a.do_scale[bhq * blocks + blk];
    TileOperands op;
    op.k8 = s_k8;
    op.v = s_vrows;
    op.q8 = st + Q::kQ8;
    op.dov = st + Q::kDo;
    op.lse2 = st_f + Q::kLse2 / 4;
    op.delta = st_f + Q::kDelta / 4;
    op.s_qk = s_q * s_k;
    op.s_dov = s_do * s_v;
    op.q0 = blk * kQBlockRows;
    op.j0 = j0;
    TileFrags f;
    tile_step<T, D, kQuantDov>(a, op, warp, lane, red, f);

    accumulate_kv_rows<D>(dv, f.p, st + Q::kDot, f.s_p * s_do, lane);
    accumulate_kv_rows<D>(dk, f.ds, st + Q::kQt, a.sm_scale * (f.s_ds * s_q), lane);

    if constexpr (kAtomicDq) {
      store_ds_rows<D>(ds_bytes, f.ds, warp, lane);
      __syncthreads();
      float* dq = a.dq_acc + (bhq * a.nq_pad + op.q0 + 16 * (warp % 4)) * D + (warp / 4) * (D / 2);
      // Column pairs (c0, c1) are adjacent: one vector reduction per pair.
      float pend = 0.0f;
      dq_product<D>(s_ds, s_kt, a.sm_scale * (f.s_ds * s_k), warp, lane, [&](int n, int e, float x) {
        if ((e & 1) == 0) {
          pend = x;
        } else {
          common::red_add_v2(dq + (g + (e >> 1) * 8) * D + 8 * n + 2 * t, pend, x);
        }
      });
    }
  }

  // dK_j, dV_j: rows 16·warp + g (+8), columns 8n + 2t (+1).
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int tok = j0 + 16 * warp + g + 8 * h2;
    if (tok >= a.nkv) continue;
    T* dkr = static_cast<T*>(a.dk.data) + b * a.dk.sb + hk * a.dk.sh + static_cast<int64_t>(tok) * a.dk.sn;
    T* dvr = static_cast<T*>(a.dv.data) + b * a.dv.sb + hk * a.dv.sh + static_cast<int64_t>(tok) * a.dv.sn;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * n + 2 * t + e;
        if (col < a.d) {
          store_out(dkr + col, dk[n][2 * h2 + e]);
          store_out(dvr + col, dv[n][2 * h2 + e]);
        }
      }
    }
  }
}

template <typename T, int D, bool kQuantDov>
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
    const float s_k = a.k_scale[bhk * tiles + j];
    op.s_qk = s_qv * s_k;
    op.s_dov = kQuantDov ? s_do * a.v_scale[bhk * tiles + j] : 0.0f;
    op.q0 = q0;
    op.j0 = j * kKvTileRows;
    TileFrags f;
    tile_step<T, D, kQuantDov>(a, op, warp, lane, red, f);
    store_ds_rows<D>(ds_bytes, f.ds, warp, lane);
    __syncthreads();
    dq_product<D>(s_ds, st + kKvTileRows * S::kI8, a.sm_scale * (f.s_ds * s_k), warp, lane,
                  [&](int n, int e, float x) { dq[n][e] += x; });
  }
  float* out = a.dq_acc + (bhq * a.nq_pad + q0 + 16 * (warp % 4)) * D + (warp / 4) * (D / 2);
#pragma unroll
  for (int n = 0; n < D / 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(g + (e >> 1) * 8) * D + 8 * n + 2 * t + (e & 1)] = dq[n][e];
}

}  // namespace qattn::sagebwd
