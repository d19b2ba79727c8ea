// Online softmax in the exp2 domain on a thread's two score rows (g and g + 8).
//
// Scores arrive as x = s_int32 * q_scale * k_scale, already in log2 units (sm_scale·log2e
// is folded into q_scale). P is produced pre-multiplied by 448 for the E4M3 cast by
// shifting the exponent bias by log2(448); the row sum carries the same factor, so the
// final O / l needs no extra division (docs/sage2-kernel-arithmetic.md, step 6).
#pragma once

#include <cstdint>

#include "cuda/common/e4m3.cuh"
#include "cuda/common/exp2.cuh"
#include "numerics/additive_mask.h"
#include "numerics/exp2_poly.h"
#include "numerics/int32_scores.h"

namespace qattn::sage2 {

using scores::kMaskedScore;
using scores::score_to_float;

// kPolyChunks: the exps of that many column chunks in each 8 by numerics::exp2_poly
// instead of MUFU. The kernel uses 0, and 1 in one d=128 shape (launch.h). 2 gained 4%
// at d=128 N=2K at first and lost 10-16% at d=64; with today's consumer loop it loses
// 1-6% at d=128 too, and 1 pays only for mid-length non-causal items (measured:
// bench/NOTES.md).
template <int kCols, int kChains, int kPolyChunks>
struct OnlineSoftmax {
  static constexpr int kPartials = kChains;
  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g, g + 8 (log2 units)
  float l[2] = {0.f, 0.f};              // row sums of the cast P (x448), full rows

  // Updates the max with this tile's raw INT32 products s (masked ones kMaskedScore)
  // times qk = q_scale·k_scale (> 0, uniform over the thread's elements); writes 448·P
  // to p and, per row, the factor by which the old O must be scaled. float(s) is
  // monotonic, so the max runs on the integers (IMNMX) and is converted once; the
  // per-element conversions then sit in the exp loop, where the FMA and ALU pipes idle
  // behind MUFU, instead of on the max's dependency chain. Each element
  // costs an IADD, an FFMA and an exp2.
  __device__ __forceinline__ void step(const int32_t (&s)[kCols], float qk, float (&p)[kCols],
                                       float (&alpha)[2]) {
    // The max runs as kPartials independent chains per row: only two consumer warps
    // share a scheduler, so latency, not throughput, bounds a serial chain.
    int32_t mp[2][kPartials];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int k = 0; k < kPartials; ++k) mp[r][k] = kMaskedScore;
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      mp[(i % 4) / 2][(i / 4) % kPartials] = max(mp[(i % 4) / 2][(i / 4) % kPartials], s[i]);
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int32_t mr = mp[r][0];
#pragma unroll
      for (int k = 1; k < kPartials; ++k) mr = max(mr, mp[r][k]);
      mx[r] = fmaxf(m[r], score_to_float(mr) * qk);
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
    }
    float neg_bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // A row that has seen only masked keys keeps m = -inf; use 0 so no inf - inf.
      const bool empty = mx[r] == -INFINITY;
      alpha[r] = empty ? 1.f : common::exp2_approx(m[r] - mx[r]);
      neg_bias[r] = empty ? 0.f : common::kLog2E4M3Max - mx[r];
      m[r] = mx[r];
    }
    // The conversion's offset goes into the bias: (1.5·2²³ + s)·qk + (bias − 1.5·2²³·qk)
    // is one FFMA per element where float(s)·qk + bias took an FADD too (+1-3%;
    // measured: bench/NOTES.md). Rounding b moves the exponent by < 0.75·qk: under one unit of s.
#pragma unroll
    for (int r = 0; r < 2; ++r) neg_bias[r] = fmaf(-scores::kMagic, qk, neg_bias[r]);
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int r = (i % 4) / 2;
      const float y = fmaf(__int_as_float(s[i] + scores::kMagicBits), qk, neg_bias[r]);
      // Column chunks 0 .. kPolyChunks-1 of each 8 on the FMA pipe (2: chunks 0, 1, 8, 9
      // of 16): measured per pattern (bench/NOTES.md).
      p[i] = (i / 4) % 8 < kPolyChunks ? numerics::exp2_poly(y) : common::exp2_approx(y);
    }
  }

  // step() for a tile of an additive attn_mask: x = float(s)·qk + add·log2(e) in FP32
  // (numerics::additive_log2; the roundings of the emulator's), then the max and the exps on floats (a float max
  // and an FADD per element where step() runs the max on the integers). `add_pair` reads
  // the mask values of element pairs (attn_mask.cuh, AdditivePairs); -inf hides the key.
  // x is formed in p, so no second array of kCols values is live.
  template <typename AddPair>
  __device__ __forceinline__ void step_additive(const int32_t (&s)[kCols], float qk,
                                                const AddPair& add_pair, float (&p)[kCols],
                                                float (&alpha)[2]) {
    // Every word of the tile in flight before the first is used: one memory round trip
    // a tile. A tile that is not cut reads nothing (the same on every thread); full()
    // differs between threads only on the last rows or keys of the call.
    uint32_t words[kCols / 2];
#pragma unroll
    for (int j = 0; j < kCols / 2; ++j) words[j] = 0;
    if (add_pair.full()) {
#pragma unroll
      for (int j = 0; j < kCols / 2; ++j) words[j] = add_pair.load_full(2 * j);
      add_pair.prefetch_next();
    } else if (add_pair.cut) {
#pragma unroll
      for (int j = 0; j < kCols / 2; ++j) words[j] = add_pair.load(2 * j);
      add_pair.prefetch_next();
    }
#pragma unroll
    for (int i = 0; i < kCols; i += 2) {
      const float2 a = AddPair::pair(words[i / 2]);  // elements i, i + 1: adjacent keys of one row
      p[i] = __fadd_rn(__fmul_rn(score_to_float(s[i]), qk), numerics::additive_log2(a.x));
      p[i + 1] = __fadd_rn(__fmul_rn(score_to_float(s[i + 1]), qk), numerics::additive_log2(a.y));
    }
    float mp[2][kPartials];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int k = 0; k < kPartials; ++k) mp[r][k] = -INFINITY;
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      mp[(i % 4) / 2][(i / 4) % kPartials] = fmaxf(mp[(i % 4) / 2][(i / 4) % kPartials], p[i]);
    float neg_bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int k = 0; k < kPartials; ++k) mx = fmaxf(mx, mp[r][k]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const bool empty = mx == -INFINITY;  // only hidden keys so far: no inf - inf
      alpha[r] = empty ? 1.f : common::exp2_approx(m[r] - mx);
      neg_bias[r] = empty ? 0.f : common::kLog2E4M3Max - mx;
      m[r] = mx;
    }
#pragma unroll
    for (int i = 0; i < kCols; ++i) p[i] = common::exp2_approx(p[i] + neg_bias[(i % 4) / 2]);
  }

  // Adds a tile's row sums (of the cast P: the ones columns of its P·V product, which
  // every thread of a row holds in full) with the O rescale alpha of that tile.
  __device__ __forceinline__ void add_row_sums(float sum0, float sum1, const float (&alpha)[2]) {
    l[0] = fmaf(l[0], alpha[0], sum0);
    l[1] = fmaf(l[1], alpha[1], sum1);
  }
};

// Packs 448·P (accumulator layout, kCols = 64 for a 128-token tile) into the E4M3 A
// fragments of the P·V wgmma: one k32 step per 4 column chunks. Vᵀ is stored with
// tokens permuted (groups::kVPermute16), so the thread's own columns are exactly what
// the fragment needs and no shuffles are required.
template <int kCols>
__device__ __forceinline__ void pack_p_fragments(const float (&p)[kCols],
                                                 uint32_t (&a)[kCols / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk) {
    const int c0 = kk * 16;  // chunk 4kk starts at element 16kk
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // chunks (4kk, 4kk+1) then (4kk+2, 4kk+3)
      const int e = c0 + half * 8;
      // row g: elements e+0, e+1 (chunk j), e+4, e+5 (chunk j+1); row g+8: e+2, e+3, e+6, e+7
      a[kk][half * 2 + 0] = static_cast<uint32_t>(common::pack_e4m3x2(p[e + 0], p[e + 1])) |
                            static_cast<uint32_t>(common::pack_e4m3x2(p[e + 4], p[e + 5])) << 16;
      a[kk][half * 2 + 1] = static_cast<uint32_t>(common::pack_e4m3x2(p[e + 2], p[e + 3])) |
                            static_cast<uint32_t>(common::pack_e4m3x2(p[e + 6], p[e + 7])) << 16;
    }
  }
}

}  // namespace qattn::sage2
