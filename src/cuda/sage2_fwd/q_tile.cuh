// In-kernel Q quantization (SA2-8b step 3, docs/sage2-kernel-arithmetic.md): two warps
// of the producer warpgroup turn a work item's 16-bit Q tile (128 rows, TMA-loaded in
// 64-channel boxes with 128-byte swizzle) into the INT8 tile the Q·Kᵀ wgmma reads (in
// its swizzled layout), the Q scales and q·c, all in shared memory. This removes a
// separate Q pass over global memory.
//
// One thread per scale group of the per-thread granularity: rows r and r + 8 with
// r = 64·(tid / 32) + 16·w + g, lane = 8·w + g — the rows a wgmma A-fragment thread
// holds (numerics/mma_groups.h), so group index = tid. Coarser granularities are
// shuffles inside the warp: 16 rows = 8 lanes, 64 rows = the warp.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/hopper/sync.cuh"
#include "cuda/common/amax.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/common/work_order.h"
#include "qattn/qattn.h"

namespace qattn::sage2 {

inline constexpr int kQTileThreads = 64;

// Global copies of what the tile quantizer produced (null in production; the GPU tests
// set them to compare with the CPU emulation bit for bit).
struct QDebugOut {
  int8_t* q_i8;    // (B, Hq, nq_pad, D)
  float* q_scale;  // (B, Hq, nq_pad / 64 * 32)
  float* q_dot_c;  // (B, Hq, nq_pad)
};

template <int D>
struct QTileLayout {
  static constexpr int kRows = common::kItemRows;
  static constexpr int kInBytes = kRows * D * 2;
  // Byte offset of 16-bit chunk c (8 channels) of row r in the TMA tile: one 128-row box
  // per 64 channels, 128-byte rows, 16-byte chunks XOR-ed with r % 8.
  __device__ __forceinline__ static int in_offset(int r, int c) {
    return (c / 8) * (kRows * 128) + r * 128 + (((c % 8) ^ (r % 8)) << 4);
  }
  // Byte offset of INT8 chunk c (16 channels) of row r in the wgmma operand tile:
  // D-byte rows, 128-byte swizzle for D = 128 and 64-byte swizzle for D = 64 (the
  // tile base is 1024-byte aligned, so the pattern on the offset is the hardware's).
  __device__ __forceinline__ static int out_offset(int r, int c) {
    const int a = r * D + c * 16;
    return D == 128 ? a ^ (((a >> 7) & 7) << 4) : a ^ (((a >> 7) & 3) << 4);
  }
};

// x, hidden from the optimizer: derived again where it is used instead of kept live (the
// producer warpgroup's 40 or 24 registers spill what the compiler hoists).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// First of the two rows (r, r + 8) of thread tid. Opaque on purpose: otherwise the
// compiler hoists every swizzled offset derived from it out of the caller's item loop
// and spills them.
__device__ __forceinline__ int q_tile_row_pair(int tid) {
  return opaque((tid / 32) * 64 + ((tid % 32) / 8) * 16 + tid % 8);
}

// Zeroes thread tid's rows (r, r + 8) of the 16-bit tile from row `rows` on (the varlen
// kernel's rows past the sequence).
template <int D>
__device__ __forceinline__ void zero_q_rows(uint8_t* in, int tid, int rows) {
  using L = QTileLayout<D>;
  const int r0 = q_tile_row_pair(tid);
#pragma unroll 1
  for (int h = 0; h < 2; ++h)
    if (r0 + 8 * h >= rows)
#pragma unroll 1
      for (int chunk = 0; chunk < D / 8; ++chunk)
        *reinterpret_cast<uint4*>(in + L::in_offset(r0 + 8 * h, chunk)) = make_uint4(0, 0, 0, 0);
}

// One 16-bit chunk (8 channels) of a Q row times c's 8 channels: an 8-term partial sum,
// which keeps q·c accurate when the row's partial sums are then added in order.
template <typename T>
__device__ __forceinline__ float chunk_dot_c(const uint4& raw, const float* c8) {
  const T* e = reinterpret_cast<const T*>(&raw);
  const float2* c2 = reinterpret_cast<const float2*>(c8);
  float2 cc = c2[0];
  float part = common::to_float(e[0]) * cc.x;
  part = fmaf(common::to_float(e[1]), cc.y, part);
  cc = c2[1];
  part = fmaf(common::to_float(e[2]), cc.x, part);
  part = fmaf(common::to_float(e[3]), cc.y, part);
  cc = c2[2];
  part = fmaf(common::to_float(e[4]), cc.x, part);
  part = fmaf(common::to_float(e[5]), cc.y, part);
  cc = c2[3];
  part = fmaf(common::to_float(e[6]), cc.x, part);
  return fmaf(common::to_float(e[7]), cc.y, part);
}

// sm_scale · q·c of thread tid's two rows (r, r + 8) of the 16-bit tile, for the LSE:
// part of quantize_q_tile, and on its own for a tile quantized before c was there.
template <int D, typename T>
__device__ __forceinline__ void q_tile_dot_c(const uint8_t* in, float* q_dot_c, const float* c,
                                             int tid, float sm_scale) {
  using L = QTileLayout<D>;
  const int r0 = q_tile_row_pair(tid);
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
    float dot = 0.f;
#pragma unroll 1
    for (int chunk = 0; chunk < D / 8; ++chunk) {
      const uint4 raw = *reinterpret_cast<const uint4*>(in + L::in_offset(r0 + 8 * h, chunk));
      dot += chunk_dot_c<T>(raw, c + chunk * 8);
    }
    q_dot_c[r0 + 8 * h] = sm_scale * dot;
  }
}

// The INT8 codes of a scale group with amax a: `rows(codes)` runs the caller's loop over
// its rows, `codes(w0, w1)` turning two packed 16-bit pairs into four codes, low byte
// first. One loop per case, so the common one has no branch per quad.
template <typename T, typename Rows>
__device__ __forceinline__ void quantize_group_codes(float a, Rows&& rows) {
  const float inv = common::kInt8Max / a;
  // All zeros for amax 0 or NaN (quantize_int8x4's rule) and for amax inf, where every
  // x·inv is 0 or NaN and __float2int_rn gives 0.
  const bool zero = !(a > 0.f) || a == INFINITY;
  // amax below 127 / FLT_MAX (only subnormal 16-bit values) makes inv infinite: take
  // quantize_int8x4's path, where F2I saturates, so the codes stay identical.
  const bool tiny = !zero && inv == INFINITY;
  auto quad = [&](uint32_t w0, uint32_t w1) {
    const float2 f0 = common::widen_pair<T>(w0), f1 = common::widen_pair<T>(w1);
    return common::quantize_int8x4_rn(f0.x, f0.y, f1.x, f1.y, inv);
  };
  auto tiny_quad = [&](uint32_t w0, uint32_t w1) {
    const float2 f0 = common::widen_pair<T>(w0), f1 = common::widen_pair<T>(w1);
    const float x[4] = {f0.x, f0.y, f1.x, f1.y};
    return common::quantize_int8x4(x, inv, false);
  };
  if (zero)
    rows([](uint32_t, uint32_t) { return 0u; });
  else if (tiny)
    rows(tiny_quad);
  else
    rows(quad);
}

// tid in [0, 64). `c` (the K smoothing vector, D floats) and q_dot_c may be null when
// the caller wants no LSE. The producer warpgroup runs at 40 registers (setmaxnreg), so
// the loops stay short and hold one or two 16-byte chunks at a time; kLowRegs: at 24
// (kernel.cuh, the 240-register split), the scale is written before the codes and q·c
// computed after them, so fewer values are live at once.
template <int D, typename T, bool kLowRegs = false>
__device__ __forceinline__ void quantize_q_tile(const uint8_t* in, uint8_t* out, float* q_scale,
                                                float* q_dot_c, const float* c, int tid,
                                                qattn_qk_granularity granularity, float scale_log2,
                                                float sm_scale) {
  using L = QTileLayout<D>;
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  const int r0 = q_tile_row_pair(tid);
  auto load = [&](int r, int chunk) {
    return *reinterpret_cast<const uint4*>(in + L::in_offset(r, chunk));
  };

  // amax over both rows.
  T2 m[2];
  m[0] = m[1] = common::absmax_zero<T2>();
#pragma unroll 1
  for (int chunk = 0; chunk < D / 8; ++chunk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) common::absmax_chunk(m, load(r0 + 8 * h, chunk));
  }
  float a = common::absmax_float(m);

  if (!kLowRegs && c != nullptr) q_tile_dot_c<D, T>(in, q_dot_c, c, tid, sm_scale);
  // Scale group: both rows (per thread), 16 rows (per warp: the 8 lanes of w), 64 rows.
  if (granularity != QATTN_QK_PER_THREAD) {
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, off));
    if (granularity == QATTN_QK_PER_BLOCK) {
      a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, 8));
      a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, 16));
    }
  }
  if constexpr (kLowRegs) q_scale[tid] = (a / common::kInt8Max) * scale_log2;  // a dies with inv
  quantize_group_codes<T>(a, [&](auto codes) {
#pragma unroll 1
    for (int i = 0; i < 2 * (D / 16); ++i) {
      const int r = r0 + 8 * (i / (D / 16)), chunk = i % (D / 16);
      const uint4 raw0 = load(r, 2 * chunk), raw1 = load(r, 2 * chunk + 1);
      const uint4 q{codes(raw0.x, raw0.y), codes(raw0.z, raw0.w), codes(raw1.x, raw1.y),
                    codes(raw1.z, raw1.w)};
      *reinterpret_cast<uint4*>(out + L::out_offset(r, chunk)) = q;
    }
  });
  if constexpr (kLowRegs) {
    if (c != nullptr) q_tile_dot_c<D, T>(in, q_dot_c, c, tid, sm_scale);
  } else {
    q_scale[tid] = (a / common::kInt8Max) * scale_log2;
  }
}

// The same quantization by 128 threads, one row each (the four-warp quantizer of the
// 512-thread CTA, kernel.cuh): thread tid takes row r + 8·(tid % 2) of scale group
// tid / 2, so the group's two rows are lanes tid and tid ^ 1 (one shuffle), a 16-row
// group is 16 lanes, and a 64-row block is two warps, which meet in `block_amax` (two
// floats per warp, by item parity: the partner may still read the previous item's)
// at named barrier `amax_barrier` + block (`amax_threads`: the two warps). Writes the
// codes and scales that quantize_q_tile writes,
// bit for bit, the scale before the codes (kLowRegs' order); q·c is q_row_dot_c's, which
// the caller runs after it with its pointers derived again (kept live across this
// function they spilled at 24 registers).
template <int D, typename T>
__device__ __forceinline__ void quantize_q_row(const uint8_t* in, uint8_t* out, float* q_scale,
                                               int tid, qattn_qk_granularity granularity,
                                               float scale_log2, float* block_amax, int parity,
                                               uint32_t amax_barrier, uint32_t amax_threads) {
  using L = QTileLayout<D>;
  using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
  const int r = opaque(q_tile_row_pair(tid >> 1) + 8 * (tid & 1));
  auto load = [&](int chunk) {
    return *reinterpret_cast<const uint4*>(in + L::in_offset(r, chunk));
  };
  T2 m[2];
  m[0] = m[1] = common::absmax_zero<T2>();
#pragma unroll 1
  for (int chunk = 0; chunk < D / 8; ++chunk) common::absmax_chunk(m, load(chunk));
  float a = common::absmax_float(m);
  a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, 1));  // the group's other row
  if (granularity != QATTN_QK_PER_THREAD) {
#pragma unroll
    for (int off = 2; off < 16; off <<= 1) a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, off));
    if (granularity == QATTN_QK_PER_BLOCK) {
      a = common::amax_nan(a, __shfl_xor_sync(0xffffffff, a, 16));
      const int warp = opaque(tid) / 32;
      if (tid % 32 == 0) block_amax[parity * 4 + warp] = a;
      hopper::named_barrier_sync(amax_barrier + warp / 2, amax_threads);
      a = common::amax_nan(a, block_amax[parity * 4 + (warp ^ 1)]);
    }
  }
  if ((tid & 1) == 0) q_scale[tid >> 1] = (a / common::kInt8Max) * scale_log2;
  quantize_group_codes<T>(a, [&](auto codes) {
#pragma unroll 1
    for (int chunk = 0; chunk < D / 16; ++chunk) {
      const uint4 raw0 = load(2 * chunk), raw1 = load(2 * chunk + 1);
      const uint4 q{codes(raw0.x, raw0.y), codes(raw0.z, raw0.w), codes(raw1.x, raw1.y),
                    codes(raw1.z, raw1.w)};
      *reinterpret_cast<uint4*>(out + L::out_offset(r, chunk)) = q;
    }
  });
}

// q·c of thread tid's row (the four-warp quantizer's rows), for a tile quantized
// before c was there.
template <int D, typename T>
__device__ __forceinline__ void q_row_dot_c(const uint8_t* in, float* q_dot_c, const float* c,
                                            int tid, float sm_scale) {
  using L = QTileLayout<D>;
  const int r = opaque(q_tile_row_pair(tid >> 1) + 8 * (tid & 1));
  float dot = 0.f;
#pragma unroll 1
  for (int chunk = 0; chunk < D / 8; ++chunk) {
    const uint4 raw = *reinterpret_cast<const uint4*>(in + L::in_offset(r, chunk));
    dot += chunk_dot_c<T>(raw, c + chunk * 8);
  }
  q_dot_c[r] = sm_scale * dot;
}

// copy_q_tile_debug for the four-warp quantizer: thread tid's row, and its group's scale
// from the even thread.
template <int D>
__device__ __forceinline__ void copy_q_row_debug(const uint8_t* out, const float* q_scale,
                                                 const float* q_dot_c, int tid,
                                                 const QDebugOut& dbg, int64_t row_base,
                                                 int64_t scale_base) {
  using L = QTileLayout<D>;
  if ((tid & 1) == 0) dbg.q_scale[scale_base + (tid >> 1)] = q_scale[tid >> 1];
  const int r = q_tile_row_pair(tid >> 1) + 8 * (tid & 1);
  for (int chunk = 0; chunk < D / 16; ++chunk)
    *reinterpret_cast<uint4*>(dbg.q_i8 + (row_base + r) * D + chunk * 16) =
        *reinterpret_cast<const uint4*>(out + L::out_offset(r, chunk));
  if (q_dot_c != nullptr) dbg.q_dot_c[row_base + r] = q_dot_c[r];
}

// Copies what quantize_q_tile left in shared memory to the debug outputs (after
// __syncwarp; each thread copies the rows and scale it wrote). `row_base` and
// `scale_base` are the item's first row and first scale group in them.
template <int D>
__device__ __forceinline__ void copy_q_tile_debug(const uint8_t* out, const float* q_scale,
                                                  const float* q_dot_c, int tid,
                                                  const QDebugOut& dbg, int64_t row_base,
                                                  int64_t scale_base) {
  using L = QTileLayout<D>;
  dbg.q_scale[scale_base + tid] = q_scale[tid];  // first: scale_base is dead after
  const int r0 = q_tile_row_pair(tid);
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    for (int chunk = 0; chunk < D / 16; ++chunk)
      *reinterpret_cast<uint4*>(dbg.q_i8 + (row_base + r) * D + chunk * 16) =
          *reinterpret_cast<const uint4*>(out + L::out_offset(r, chunk));
    if (q_dot_c != nullptr) dbg.q_dot_c[row_base + r] = q_dot_c[r];
  }
}

}  // namespace qattn::sage2
