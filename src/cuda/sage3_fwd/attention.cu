// The SageAttention3 NVFP4 forward's attention kernel and the launch of the whole call
// (src/emulate/sage3.cpp, steps 4-8, is the contract).
//
// One CTA of four warps per (64-row Q block, query head, batch entry); each warp owns
// 16 rows. Per 128-key tile (the emulator's tile, which fixes the two-level P scale):
//   S = Q̂·K̂ᵀ on BF16 tensor cores from the dequantized NVFP4 operands (exact in BF16:
//     the products are the block-scaled MMA's), plus q̄·(K − c)ᵀ, the smoothing GEMV,
//     computed in FP64 and rounded to FP32 once, as the emulator does;
//   online softmax in the log2 domain; s_p1 = exp2(rowmax − m)/(448·6) from the tile's
//     row maximum; P2 = P̃/s_p1 quantized to NVFP4 in blocks of 16 keys (a quad holds a
//     row's 16 keys of a block: two shuffles give the block's amax);
//   O_ij = P̂·V̂ in a fresh FP32 accumulator (V̂ quantized along the tokens by
//     quantize.cu), then O ← O·α + O_ij·s_p1, as the emulator rounds it (no fused
//     multiply-add).
// The operands are staged by cp.async into padded shared-memory rows, one tile at a
// time: this kernel is for fidelity (what SageAttention3's arithmetic does to a model),
// not speed; README states its speed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/nvfp4_scale.cuh"
#include "cuda/hopper/per_device.h"
#include "cuda/sage3_fwd/launch.h"
#include "cuda/sage3_fwd/quantize.cuh"
#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/nvfp4_code.h"

namespace qattn::sage3 {
namespace {

using common::ldmatrix_x4;
using common::ldmatrix_x4_trans;
using common::ldsm_a_addr;
using common::ldsm_b_addr;
using common::mma_16bit;
using common::shared_addr;

constexpr int kThreads = 128;
constexpr float kNegInf = -INFINITY;
constexpr float kLn2 = 0.69314718055994530942f;

// Shared memory, bytes. BF16 rows are padded by 16 bytes so ldmatrix's eight row
// addresses fall in distinct banks.
template <int D>
struct Smem {
  static constexpr int kRow = 2 * D + 16;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBlock * kRow;
  static constexpr int kV = kK + kKvTile * kRow;
  static constexpr int kGemv = kV + kKvTile * kRow;  // kKvTile floats
  static constexpr int kQbar = kGemv + kKvTile * 4;  // D floats
  static constexpr int kMean = kQbar + D * 4;        // D floats
  static constexpr int kBytes = kMean + D * 4;
};

// The emulator's nan_max: NaN in either gives NaN.
__device__ __forceinline__ float nan_max(float a, float b) {
  if (isnan(a) || isnan(b)) return __int_as_float(0x7fc00000);
  return a > b ? a : b;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

// `rows` rows of D BF16 values from global (rows `D` apart) into padded shared rows.
template <int D>
__device__ __forceinline__ void stage_rows(uint8_t* dst, const __nv_bfloat16* src, int rows) {
  constexpr int kChunks = D * 2 / 16;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    common::cp_async_zfill<16>(shared_addr(dst + r * Smem<D>::kRow + 16 * c),
                               src + int64_t{r} * D + 8 * c, true);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) attention_kernel(const Args a) {
  using S = Smem<D>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int mb = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const int hk = hq / a.group;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t bh_q = int64_t{b} * a.heads_q + hq, bh_kv = int64_t{b} * a.heads_kv + hk;
  const int r0 = mb * kQBlock;
  float* s_gemv = reinterpret_cast<float*>(smem + S::kGemv);
  float* s_qbar = reinterpret_cast<float*>(smem + S::kQbar);
  float* s_mean = reinterpret_cast<float*>(smem + S::kMean);

  stage_rows<D>(smem + S::kQ, a.ws.q_hat + (bh_q * a.nq_pad + r0) * D, kQBlock);
  common::cp_async_commit();
  for (int e = threadIdx.x; e < D; e += kThreads) {
    s_qbar[e] = a.ws.q_bar[(bh_q * a.q_blocks + mb) * D + e];
    s_mean[e] = a.ws.k_mean[bh_kv * D + e];
  }

  // Keys this block can see: all, or with the causal mask up to its last row's diagonal.
  const int last_row = min(r0 + kQBlock, a.nq) - 1;
  int key_end = a.nkv;
  if (a.causal) key_end = max(0, min(a.nkv, last_row + a.nkv - a.nq + 1));
  const int ntiles = (key_end + kKvTile - 1) / kKvTile;

  const int row[2] = {r0 + warp * 16 + g, r0 + warp * 16 + g + 8};
  float o[D / 8][4] = {};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const T* k_in = static_cast<const T*>(a.k.data) + b * a.k.stride_b + hk * a.k.stride_h;

  for (int tile = 0; tile < ntiles; ++tile) {
    const int j0 = tile * kKvTile;
    __syncthreads();  // the previous tile's K̂, V̂ and GEMV are no longer read
    stage_rows<D>(smem + S::kK, a.ws.k_hat + (bh_kv * a.nkv_pad + j0) * D, kKvTile);
    stage_rows<D>(smem + S::kV, a.ws.v_hat + (bh_kv * a.nkv_pad + j0) * D, kKvTile);
    common::cp_async_commit();
    // q̄·(k_j − c) of the tile's keys in FP64, rounded to FP32 once as the emulator does:
    // a warp per 32 keys, its lanes across d (coalesced rows); the FP64 sum in another
    // order than the emulator's rounds to the same FP32 value but in rare ties.
#pragma unroll 4
    for (int kk = 0; kk < kKvTile / 4; ++kk) {
      const int jj = warp * (kKvTile / 4) + kk, j = j0 + jj;
      double dot = 0.0;
      if (j < a.nkv) {
        const T* kr = k_in + int64_t{j} * a.k.stride_n;
#pragma unroll
        for (int e = lane; e < D; e += 32)
          dot = __dadd_rn(dot, __dmul_rn(s_qbar[e], __fsub_rn(to_float(kr[e]), s_mean[e])));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        dot = __dadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, off));
      if (lane == 0) s_gemv[jj] = static_cast<float>(dot);
    }
    common::cp_async_wait<0>();
    __syncthreads();

    // ---- S = Q̂·K̂ᵀ: this warp's 16 rows × 128 keys (16 n-blocks of 8) ----
    float s[kKvTile / 8][4] = {};
    const uint32_t q_base = shared_addr(smem + S::kQ) + warp * 16 * S::kRow;
    const uint32_t k_base = shared_addr(smem + S::kK);
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {
      uint32_t af[4];
      ldmatrix_x4(af, ldsm_a_addr(q_base + kd * 32, S::kRow, lane));
#pragma unroll
      for (int nb2 = 0; nb2 < kKvTile / 16; ++nb2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, ldsm_b_addr(k_base + nb2 * 16 * S::kRow + kd * 32, S::kRow, lane));
        mma_16bit<__nv_bfloat16>(s[2 * nb2], af, bf[0], bf[1]);
        mma_16bit<__nv_bfloat16>(s[2 * nb2 + 1], af, bf[2], bf[3]);
      }
    }

    // ---- scores (log2 units), masked keys −inf; the tile's row maxima ----
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nb = 0; nb < kKvTile / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, jj = nb * 8 + 2 * t + (e & 1), j = j0 + jj;
        const bool vis = j < a.nkv && (!a.causal || j <= row[h] + a.nkv - a.nq);
        const float x = vis ? __fmul_rn(__fadd_rn(s[nb][e], s_gemv[jj]), a.scale_log2) : kNegInf;
        s[nb][e] = x;
        mx[h] = nan_max(mx[h], x);
      }
    float alpha[2] = {1.f, 1.f}, sp1[2] = {0.f, 0.f};
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = nan_max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = nan_max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = nan_max(m[h], mx[h]);
      live[h] = m_new != kNegInf;  // no visible key yet: nothing to add, no inf − inf
      if (live[h]) {
        alpha[h] = exp2f(m[h] - m_new);
        m[h] = m_new;
        sp1[h] = numerics::two_level_p_scale(exp2f(mx[h] - m_new));
      }
    }
    // ---- P̃, the row sums, and P2 = P̃ / s_p1 ----
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int nb = 0; nb < kKvTile / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const float p = live[h] ? exp2f(s[nb][e] - m[h]) : 0.f;  // exp2(−inf) = 0
        sum[h] += p;
        s[nb][e] = sp1[h] == 0.f ? 0.f : __fdiv_rn(p, sp1[h]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
      if (live[h]) l[h] = __fadd_rn(__fmul_rn(l[h], alpha[h]), sum[h]);
    }

    // ---- NVFP4(P2) in blocks of 16 keys (n-blocks 2kb, 2kb+1), as A fragments ----
    uint32_t pa[kKvTile / 16][4];
#pragma unroll
    for (int kb = 0; kb < kKvTile / 16; ++kb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* v0 = &s[2 * kb][2 * h];
        float* v1 = &s[2 * kb + 1][2 * h];
        float amax = 0.f;
        amax = numerics::amax_accumulate(amax, v0[0]);
        amax = numerics::amax_accumulate(amax, v0[1]);
        amax = numerics::amax_accumulate(amax, v1[0]);
        amax = numerics::amax_accumulate(amax, v1[1]);
        amax = numerics::amax_accumulate(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = numerics::amax_accumulate(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        // The block's scale by the conversion instruction and its elements' codes by
        // comparisons with exact products (numerics/nvfp4_code.h): the quantizer's
        // E4M3(amax / 6) and e2m1(fl(x / s)) without the generic encoders or a division
        // per element. A scale of 0 or NaN codes every element 0, which decodes to 0·s.
        float sc;
        (void)common::nvfp4_scale(amax, sc);
        const bool coded = sc > 0.f;
        const numerics::Nvfp4Steps steps = numerics::nvfp4_steps(coded ? sc : 1.f);
        auto deq = [&](float x) {
          return coded ? numerics::e2m1_decode(numerics::nvfp4_code(x, steps)) * sc : 0.f * sc;
        };
        pa[kb][h] = pack_bf16(deq(v0[0]), deq(v0[1]));      // keys 16kb + 2t, +1
        pa[kb][2 + h] = pack_bf16(deq(v1[0]), deq(v1[1]));  // keys 16kb + 8 + 2t, +1
      }
    }

    // ---- O_ij = P̂·V̂ in a fresh accumulator; O ← O·α + O_ij·s_p1 ----
    const uint32_t v_base = shared_addr(smem + S::kV);
#pragma unroll
    for (int nd2 = 0; nd2 < D / 16; ++nd2) {
      float oij[2][4] = {};
#pragma unroll
      for (int kb = 0; kb < kKvTile / 16; ++kb) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, ldsm_a_addr(v_base + kb * 16 * S::kRow + nd2 * 32, S::kRow, lane));
        mma_16bit<__nv_bfloat16>(oij[0], pa[kb], bf[0], bf[1]);
        mma_16bit<__nv_bfloat16>(oij[1], pa[kb], bf[2], bf[3]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          if (!live[h]) continue;
          float& acc = o[2 * nd2 + i][e];
          acc = __fadd_rn(__fmul_rn(acc, alpha[h]), __fmul_rn(oij[i][e], sp1[h]));
        }
    }
  }

  // ---- O / l and the natural-log LSE with the smoothing correction ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = row[h];
    if (i >= a.nq) continue;
    const bool empty = m[h] == kNegInf;
    T* out = static_cast<T*>(a.o.data) + b * a.o.stride_b + hq * a.o.stride_h + i * a.o.stride_n;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      const float x0 = empty ? 0.f : __fdiv_rn(o[nd][2 * h], l[h]);
      const float x1 = empty ? 0.f : __fdiv_rn(o[nd][2 * h + 1], l[h]);
      if constexpr (std::is_same_v<T, __half>)
        *reinterpret_cast<__half2*>(out + nd * 8 + 2 * t) = __floats2half2_rn(x0, x1);
      else
        *reinterpret_cast<__nv_bfloat162*>(out + nd * 8 + 2 * t) = __floats2bfloat162_rn(x0, x1);
    }
    if (a.lse != nullptr && t == 0)
      a.lse[bh_q * a.nq + i] =
          empty ? kNegInf
                : __fadd_rn(__fmul_rn(__fadd_rn(m[h], log2f(l[h])), kLn2),
                            __fmul_rn(a.sm_scale, a.ws.q_dot_c[bh_q * a.nq_pad + i]));
  }
}

Args make_args(const qattn_fwd_params& p, void* workspace) {
  Args a{};
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.o = p.o;
  a.lse = p.lse;
  a.dtype = p.dtype;
  a.batch = p.batch;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.group = p.heads_q / p.heads_kv;
  a.nq = p.seqlen_q;
  a.nkv = p.seqlen_kv;
  a.d = p.head_dim;
  a.nq_pad = static_cast<int>(padded(p.seqlen_q));
  a.nkv_pad = static_cast<int>(padded(p.seqlen_kv));
  a.q_blocks = a.nq_pad / kQBlock;
  a.causal = p.causal;
  a.sm_scale = p.sm_scale;
  a.scale_log2 = static_cast<float>(static_cast<double>(p.sm_scale) * 1.4426950408889634);
  const WorkspaceLayout w = workspace_layout(p);
  auto* base = static_cast<uint8_t*>(workspace);
  a.ws.k_mean = reinterpret_cast<float*>(base + w.k_mean);
  a.ws.k_hat = reinterpret_cast<__nv_bfloat16*>(base + w.k_hat);
  a.ws.v_hat = reinterpret_cast<__nv_bfloat16*>(base + w.v_hat);
  a.ws.q_hat = reinterpret_cast<__nv_bfloat16*>(base + w.q_hat);
  a.ws.q_bar = reinterpret_cast<float*>(base + w.q_bar);
  a.ws.q_dot_c = reinterpret_cast<float*>(base + w.q_dot_c);
  return a;
}

template <typename T, int D>
cudaError_t launch_attention(const Args& a, cudaStream_t stream) {
  static std::atomic<unsigned long long> done{0};
  auto kernel = attention_kernel<T, D>;
  if (auto e = hopper::once_per_context(done,
                                        [&] {
                                          return cudaFuncSetAttribute(
                                              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              Smem<D>::kBytes);
                                        });
      e != cudaSuccess)
    return e;
  const dim3 grid((a.nq + kQBlock - 1) / kQBlock, a.heads_q, a.batch);
  kernel<<<grid, kThreads, Smem<D>::kBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t by_dim(const Args& a, cudaStream_t stream) {
  return a.d == 64 ? launch_attention<T, 64>(a, stream) : launch_attention<T, 128>(a, stream);
}

}  // namespace

int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream) {
  const Args a = make_args(p, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  if (const cudaError_t e = launch_quantize(a, s); e != cudaSuccess) return static_cast<int>(e);
  const cudaError_t e =
      a.dtype == QATTN_DTYPE_FP16 ? by_dim<__half>(a, s) : by_dim<__nv_bfloat16>(a, s);
  return static_cast<int>(e);
}

}  // namespace qattn::sage3
