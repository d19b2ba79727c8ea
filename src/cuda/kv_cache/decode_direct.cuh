// The register-direct decode of NVFP4 caches at head dim 64 and 128 (bench/NOTES.md
// v24): no shared memory in the key loop and no barriers. Each warp owns 16 query rows
// and every fourth 16-key block of its chunk, loads its keys' rows from the pages
// straight into registers in the mma.sync fragment layout, and runs its own online
// softmax; the CTA's four warps merge once at the end.
//
// The layouts that make the loads contiguous (g = lane / 4, t = lane % 4, D the head dim):
//   Q·Kᵀ: the head dimension is permuted for Q and K alike (a dot product does not
//     change): k-step kd, slots 2t, 2t+1, 8+2t, 9+2t hold elements t·D/4 + 4kd + 0..3.
//     So thread (g, t) needs elements [t·D/4, (t+1)·D/4) of key g: D/8 code bytes (one
//     16-byte load at D = 128) and their D/64 scale bytes.
//   P·V: the output columns are permuted (undone at the store): column c of n-block nb
//     is element c·D/8 + nb. So thread (g, t) needs elements [g·D/8, (g+1)·D/8) of keys
//     2t, 2t+1, 8+2t, 9+2t: D/16 code bytes each and one scale block (D = 128) or half
//     of one (D = 64).
// Both products are exact in 16 bits as in decode.cu (K̂ in BF16, V̂ in FP16, P split
// into a high part and its remainder), so the result is the emulation's to FP32
// rounding, as the tiled kernel's is.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma_sync.cuh"
#include "cuda/kv_cache/dequant.cuh"

namespace qattn::kv_cache::direct {

constexpr int kWarps = 4;
constexpr int kBlock = 16;  // keys per step of a warp

// The raw bytes one thread holds for one 16-key block.
template <int D>
struct Raw {
  static constexpr int kKWords = D / 32;  // D/8 code bytes of each of its 2 keys
  static constexpr int kVWords = D / 64;  // D/16 code bytes of each of its 4 keys
  uint32_t k[2][kKWords];                 // keys g and 8 + g
  uint32_t k_scales[2];                   // D/64 scale bytes of each (low bytes)
  uint32_t v[4][kVWords];                 // keys 2t, 2t+1, 8+2t, 9+2t
  uint32_t v_scales[4];                   // the scale byte of its element range
  bool bad;                               // a page index outside the pool
};

template <int D>
__device__ __forceinline__ void load_block(const DecodeArgs& a, const int32_t* table, int hk,
                                           int j0, int je, Raw<D>& r) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  r.bad = false;
  // The codes and scales rows of key j (nullptr outside [jb, je) or for a bad entry,
  // which zero-fills the registers).
  auto rows = [&](int j, bool v, const uint8_t*& codes, const uint8_t*& scales) {
    codes = scales = nullptr;
    if (j >= je) return;
    const int32_t p = __ldg(table + j / a.page_size);
    if (p < 0 || p >= a.num_pages) {
      r.bad = true;
      return;
    }
    const int64_t slot = j % a.page_size;
    const uint8_t* page = a.pages + p * a.page_bytes;
    codes = page + (v ? a.v_codes : a.k_codes) + hk * a.head_code_bytes + slot * a.code_row_bytes;
    scales =
        page + (v ? a.v_scales : a.k_scales) + hk * a.head_scale_bytes + slot * a.scale_row_bytes;
  };
  const uint8_t *codes, *scales;
  for (int i = 0; i < 2; ++i) {
    rows(j0 + 8 * i + g, false, codes, scales);
    if constexpr (D == 128) {
      const uint4 w =
          codes ? __ldg(reinterpret_cast<const uint4*>(codes + 16 * t)) : make_uint4(0, 0, 0, 0);
      r.k[i][0] = w.x, r.k[i][1] = w.y, r.k[i][2] = w.z, r.k[i][3] = w.w;
      r.k_scales[i] = scales ? __ldg(reinterpret_cast<const uint16_t*>(scales + 2 * t)) : 0u;
    } else {
      const uint2 w =
          codes ? __ldg(reinterpret_cast<const uint2*>(codes + 8 * t)) : make_uint2(0, 0);
      r.k[i][0] = w.x, r.k[i][1] = w.y;
      r.k_scales[i] = scales ? __ldg(scales + t) : 0u;
    }
  }
  const int vkeys[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
  for (int i = 0; i < 4; ++i) {
    rows(j0 + vkeys[i], true, codes, scales);
    if constexpr (D == 128) {
      const uint2 w =
          codes ? __ldg(reinterpret_cast<const uint2*>(codes + 8 * g)) : make_uint2(0, 0);
      r.v[i][0] = w.x, r.v[i][1] = w.y;
      r.v_scales[i] = scales ? __ldg(scales + g) : 0u;
    } else {
      r.v[i][0] = codes ? __ldg(reinterpret_cast<const uint32_t*>(codes + 4 * g)) : 0u;
      r.v_scales[i] = scales ? __ldg(scales + g / 2) : 0u;
    }
  }
}

// (code·2^-14)·2^14·s for the two nibbles of `pair_bits` (e2m1x2_as_f16x2_bits) and the
// two FP16 scales of s2: exact in FP16 (dequant.cuh).
__device__ __forceinline__ __half2 fp4_pair(uint32_t pair_bits, __half2 s2) {
  return __hmul2(__hmul2(as_half2(pair_bits), __float2half2_rn(16384.f)), s2);
}

// The nibble `e` of a row's words as the FP16 bit pattern (2^-14 of its E2M1 value) in
// the low (hi = false) or high half.
__device__ __forceinline__ uint32_t nibble_bits(uint32_t word, int shift, bool hi) {
  const uint32_t n = (word >> shift) & 0xFu;
  const uint32_t b = ((n & 0x7u) << 9) | ((n & 0x8u) << 12);
  return hi ? b << 16 : b;
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) decode_direct_kernel(const DecodeArgs a) {
  constexpr int kKd = D / 16;  // k-steps of Q·Kᵀ
  constexpr int kNb = D / 8;   // n-blocks of P·V
  constexpr int kQ4 = D / 4;   // elements of Q (and K) per thread
  __shared__ float s_o[kWarps - 1][kNb * 4][32];
  __shared__ float s_ml[kWarps - 1][4][32];
  __shared__ int s_bad;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int split = blockIdx.x % a.splits, row0 = (blockIdx.x / a.splits) * 16;
  const int hk = blockIdx.y, b = blockIdx.z;
  if (threadIdx.x == 0) s_bad = 0;

  int L = __ldg(a.lengths + b);
  const bool bad_length = L < 0 || L > a.capacity;
  if (bad_length) L = 0;
  const int chunk = (L + a.splits - 1) / a.splits;
  const int jb = min(L, split * chunk), je = min(L, (split + 1) * chunk);
  const int32_t* table = a.block_tables + int64_t{b} * a.max_pages_per_seq;

  // Q fragments (BF16, permuted head dimension) and q·c of the thread's two rows.
  uint32_t qa[kKd][4];
  float qc[2] = {0.f, 0.f};
  int lim[2];
  const float* c = a.k_mean != nullptr ? a.k_mean + (int64_t{b} * a.heads_kv + hk) * D : nullptr;
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    const bool real = r < a.rows;
    const int rr = real ? r : a.rows - 1;
    const int i = rr % a.nq, hq = hk * a.group + rr / a.nq;
    lim[h] = a.causal ? i + L - a.nq : INT32_MAX;
    const T* q = static_cast<const T*>(a.q) + b * a.q_sb + hq * a.q_sh + i * a.q_sn + t * kQ4;
    for (int kd = 0; kd < kKd; ++kd) {
      float x[4];
      for (int e = 0; e < 4; ++e) {
        const float v = real ? to_float(q[4 * kd + e]) : 0.f;
        x[e] = __bfloat162float(__float2bfloat16_rn(v));
        if (c != nullptr) qc[h] += x[e] * __ldg(c + t * kQ4 + 4 * kd + e);
      }
      qa[kd][h] = bits_of(__floats2bfloat162_rn(x[0], x[1]));      // a0 / a1
      qa[kd][2 + h] = bits_of(__floats2bfloat162_rn(x[2], x[3]));  // a2 / a3
    }
    qc[h] += __shfl_xor_sync(0xffffffffu, qc[h], 1);
    qc[h] += __shfl_xor_sync(0xffffffffu, qc[h], 2);
  }

  float o[kNb][4];
  for (auto& x : o) x[0] = x[1] = x[2] = x[3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  bool bad = false;

  const int nblocks = (je - jb + kBlock - 1) / kBlock;
  auto compute = [&](const Raw<D>& r, int blk) {
    const int j0 = jb + blk * kBlock;
    // ---- S = Q·K̂ᵀ: two n-blocks (keys j0 + g and j0 + 8 + g as loaded) ----
    float s[2][4] = {};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int kd = 0; kd < kKd; ++kd) {
        // Elements 4kd .. 4kd+3 of the thread's range: bytes 2kd and 2kd+1.
        const uint32_t word = r.k[i][kd / 2];
        const int sh = 16 * (kd % 2);
        const uint8_t sc = static_cast<uint8_t>(r.k_scales[i] >> (8 * (kd / 4)));
        const __half2 s2 = __half2half2(e4m3_to_half(sc));
        const uint32_t b0 = e2m1x2_as_f16x2_bits((word >> sh) & 0xFFu);
        const uint32_t b1 = e2m1x2_as_f16x2_bits((word >> (sh + 8)) & 0xFFu);
        const uint32_t k0 = f16x2_to_bf16x2(bits_of(fp4_pair(b0, s2)));
        const uint32_t k1 = f16x2_to_bf16x2(bits_of(fp4_pair(b1, s2)));
        common::mma_16bit<__nv_bfloat16>(s[i], qa[kd], k0, k1);
      }
    }
    // ---- online softmax: columns 2t, 2t+1 of n-block i are keys j0 + 8i + 2t (+1) ----
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + 8 * i + 2 * t + (e & 1);
        const bool vis = j < je && j <= lim[e >> 1];
        const float x = vis ? s[i][e] * a.scale_log2 : kNegInf;
        s[i][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2];
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));
      alpha[h] = m_new == kNegInf ? 1.f : exp2f(m[h] - m_new);
      m[h] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = s[i][e];
        const float p = x == kNegInf ? 0.f : exp2f(x - m[e >> 1]);
        rowsum[e >> 1] += p;
        s[i][e] = p;
      }
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb) {
      o[nb][0] *= alpha[0];
      o[nb][1] *= alpha[0];
      o[nb][2] *= alpha[1];
      o[nb][3] *= alpha[1];
    }
    // ---- o += P·V̂: P's slots are the keys' positions in the block ----
    uint32_t hi[4], lo[4];
    split_pair<__half>(s[0][0], s[0][1], hi[0], lo[0]);
    split_pair<__half>(s[0][2], s[0][3], hi[1], lo[1]);
    split_pair<__half>(s[1][0], s[1][1], hi[2], lo[2]);
    split_pair<__half>(s[1][2], s[1][3], hi[3], lo[3]);
    // Scales of the keys (2t, 2t+1) and (8+2t, 9+2t), as FP16 pairs.
    const __half2 sv01 = __halves2half2(e4m3_to_half(static_cast<uint8_t>(r.v_scales[0])),
                                        e4m3_to_half(static_cast<uint8_t>(r.v_scales[1])));
    const __half2 sv23 = __halves2half2(e4m3_to_half(static_cast<uint8_t>(r.v_scales[2])),
                                        e4m3_to_half(static_cast<uint8_t>(r.v_scales[3])));
    // Element nb of the thread's V range: nibble nb of its words (D = 64: the range is
    // the upper or lower half of a scale block's 16 elements, 4 bytes from 4·g).
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb) {
      const int word = nb / 8, sh = 4 * (nb % 8);
      const uint32_t p01 =
          nibble_bits(r.v[0][word], sh, false) | nibble_bits(r.v[1][word], sh, true);
      const uint32_t p23 =
          nibble_bits(r.v[2][word], sh, false) | nibble_bits(r.v[3][word], sh, true);
      const uint32_t b0 = bits_of(fp4_pair(p01, sv01));
      const uint32_t b1 = bits_of(fp4_pair(p23, sv23));
      common::mma_16bit<__half>(o[nb], hi, b0, b1);
      common::mma_16bit<__half>(o[nb], lo, b0, b1);
    }
  };

  // Two blocks in flight per warp: one computed while the other loads.
  Raw<D> r0, r1;
  int blk = warp;
  if (blk < nblocks) load_block<D>(a, table, hk, jb + blk * kBlock, je, r0);
  if (blk + kWarps < nblocks) load_block<D>(a, table, hk, jb + (blk + kWarps) * kBlock, je, r1);
  for (; blk < nblocks; blk += 2 * kWarps) {
    compute(r0, blk);
    bad |= r0.bad;
    if (blk + 2 * kWarps < nblocks)
      load_block<D>(a, table, hk, jb + (blk + 2 * kWarps) * kBlock, je, r0);
    if (blk + kWarps >= nblocks) break;
    compute(r1, blk + kWarps);
    bad |= r1.bad;
    if (blk + 3 * kWarps < nblocks)
      load_block<D>(a, table, hk, jb + (blk + 3 * kWarps) * kBlock, je, r1);
  }

  // ---- merge the four warps (same fragment layout: lane by lane) ----
  for (int h = 0; h < 2; ++h) l[h] = quad_sum(l[h]);
  __syncthreads();  // s_bad initialized
  if (bad) s_bad = 1;
  if (warp > 0) {
    for (int nb = 0; nb < kNb; ++nb)
      for (int e = 0; e < 4; ++e) s_o[warp - 1][nb * 4 + e][lane] = o[nb][e];
    s_ml[warp - 1][0][lane] = m[0];
    s_ml[warp - 1][1][lane] = m[1];
    s_ml[warp - 1][2][lane] = l[0];
    s_ml[warp - 1][3][lane] = l[1];
  }
  __syncthreads();
  if (warp > 0) return;
  float w[kWarps][2];
  for (int h = 0; h < 2; ++h) {
    float M = m[h];
    for (int k = 0; k < kWarps - 1; ++k) M = fmaxf(M, s_ml[k][h][lane]);
    w[0][h] = m[h] == kNegInf ? 0.f : exp2f(m[h] - M);
    float lsum = w[0][h] * l[h];
    for (int k = 0; k < kWarps - 1; ++k) {
      const float mk = s_ml[k][h][lane];
      w[k + 1][h] = mk == kNegInf ? 0.f : exp2f(mk - M);
      lsum += w[k + 1][h] * s_ml[k][2 + h][lane];
    }
    m[h] = M;
    l[h] = lsum;
  }
#pragma unroll
  for (int nb = 0; nb < kNb; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float acc = w[0][e >> 1] * o[nb][e];
      for (int k = 0; k < kWarps - 1; ++k) acc += w[k + 1][e >> 1] * s_o[k][nb * 4 + e][lane];
      o[nb][e] = acc;
    }

  // ---- outputs: column c of n-block nb is element c·D/8 + nb; this thread's columns
  // 2t and 2t+1 are elements [2t·D/8, (2t+2)·D/8) ----
  const bool any_bad = bad_length || s_bad != 0;
  const float nan = __int_as_float(0x7fc00000);
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    if (r >= a.rows) continue;
    const int i = r % a.nq, hq = hk * a.group + r / a.nq;
    const bool empty = m[h] == kNegInf;
    const float inv = empty ? 0.f : 1.f / l[h];
    const int64_t out_row = (int64_t{b} * a.heads_q + hq) * a.nq + i;
    if (a.splits == 1) {
      T* orow = static_cast<T*>(a.o) + b * a.o_sb + hq * a.o_sh + i * a.o_sn;
      for (int half = 0; half < 2; ++half) {
        T* dst = orow + (2 * t + half) * kNb;
#pragma unroll
        for (int nb = 0; nb < kNb; nb += 2) {
          const float x0 = any_bad ? nan : o[nb][2 * h + half] * inv;
          const float x1 = any_bad ? nan : o[nb + 1][2 * h + half] * inv;
          if constexpr (std::is_same_v<T, __half>)
            *reinterpret_cast<__half2*>(dst + nb) = __floats2half2_rn(x0, x1);
          else
            *reinterpret_cast<__nv_bfloat162*>(dst + nb) = __floats2bfloat162_rn(x0, x1);
        }
      }
      if (a.lse != nullptr && t == 0)
        a.lse[out_row] = any_bad ? nan
                         : empty ? kNegInf
                                 : (m[h] + log2f(l[h])) * kLn2 + a.sm_scale * qc[h];
    } else {
      float* op = a.o_part + (out_row * a.splits + split) * D;
      for (int half = 0; half < 2; ++half)
        for (int nb = 0; nb < kNb; ++nb)
          op[(2 * t + half) * kNb + nb] = any_bad ? nan : o[nb][2 * h + half] * inv;
      if (t == 0) {
        a.lse_part[out_row * a.splits + split] = any_bad ? nan
                                                 : empty ? kNegInf
                                                         : m[h] + log2f(l[h]);
        if (split == 0) a.qc_part[out_row] = qc[h];
      }
    }
  }
}

}  // namespace qattn::kv_cache::direct
