#include "cuda/sage2_wide/q_pass.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>

#include "cuda/hopper/per_device.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {
namespace {

using QTile = sage2::QTileLayout<kD>;
// 128 threads: all load the block, then each quantizes one row (the SA2-8b kernel's
// four-warp quantizer, quantize_q_row: the bits of quantize_q_tile, twice the threads).
constexpr int kPassThreads = 128;
// The per-block amax exchange of quantize_q_row: named barriers 1 and 2 (one per 64-row
// block, its two warps).
constexpr uint32_t kAmaxBarrier = 1, kAmaxThreads = 64;
constexpr int kOutBytes = kBlockM * kD;
constexpr int kSmem = QTile::kInBytes + kOutBytes + (2 * groups::kQThreadGroupsPerBlock +
                                                     kBlockM) * static_cast<int>(sizeof(float));

// grid (nq_pad / 128, Hq, B): block (m, hq, b) quantizes rows 128m.. of query head hq.
template <typename T>
__global__ void __launch_bounds__(kPassThreads) q_pass_kernel(sage2::InputView<T> q,
                                                              QPassParams p,
                                                              sage2::QDebugOut out) {
  extern __shared__ uint4 smem4[];
  uint8_t* in = reinterpret_cast<uint8_t*>(smem4);
  uint8_t* codes = in + QTile::kInBytes;
  float* scales = reinterpret_cast<float*>(codes + kOutBytes);
  float* dot_c = scales + 2 * groups::kQThreadGroupsPerBlock;
  __shared__ float block_amax[2 * 4];  // quantize_q_row's per-block amax exchange
  // The attention kernel may launch now; it waits for this grid before its loads.
  hopper::launch_dependents();
  const int m_block = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const T* src = q.data + b * q.stride_b + hq * q.stride_h;
  // The block's 16-bit rows in the in-kernel quantizer's layout; rows past Nq and
  // channels past head_dim are zeros.
#pragma unroll 8
  for (int i = threadIdx.x; i < kBlockM * (kD / 8); i += kPassThreads) {
    const int r = i / (kD / 8), chunk = i % (kD / 8), ch = chunk * 8;
    const int row = m_block * kBlockM + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < p.seqlen_q && ch < p.head_dim) {
      const T* at = src + static_cast<int64_t>(row) * q.stride_n + ch;
      if (ch + 8 <= p.head_dim) {
        v = *reinterpret_cast<const uint4*>(at);
      } else {  // the row's last, partial chunk (head_dim % 8 != 0)
        const uint16_t* e = reinterpret_cast<const uint16_t*>(at);
        uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (ch + j < p.head_dim) w[j / 2] |= static_cast<uint32_t>(e[j]) << (16 * (j % 2));
        v = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *reinterpret_cast<uint4*>(in + QTile::in_offset(r, chunk)) = v;
  }
  // c is the statistics pass's output (launched before this grid, in stream order).
  const float* c = p.k_mean == nullptr
                       ? nullptr
                       : p.k_mean + (static_cast<int64_t>(b) * p.heads_kv +
                                     hq / (p.heads_q / p.heads_kv)) * kD;
  __syncthreads();
  const int tid = threadIdx.x;
  sage2::quantize_q_row<kD, T>(in, codes, scales, tid, p.granularity, p.scale_log2, block_amax,
                               /*parity=*/0, kAmaxBarrier, kAmaxThreads);
  if (c != nullptr) sage2::q_row_dot_c<kD, T>(in, dot_c, c, tid, p.sm_scale);
  __syncwarp();  // each thread copies the row (and scale) it wrote
  const int64_t bh = static_cast<int64_t>(b) * p.heads_q + hq;
  sage2::copy_q_row_debug<kD>(codes, scales, c != nullptr ? dot_c : nullptr, tid, out,
                              bh * p.nq_pad + m_block * kBlockM,
                              bh * (p.nq_pad / groups::kQBlock) * groups::kQThreadGroupsPerBlock +
                                  m_block * 2 * groups::kQThreadGroupsPerBlock);
}

}  // namespace

template <typename T>
cudaError_t launch_q_pass(const sage2::InputView<T>& q, const QPassParams& p, int batch,
                          const sage2::QDebugOut& out, cudaStream_t stream) {
  static std::atomic<unsigned long long> configured{0};
  if (cudaError_t e = hopper::once_per_context(
          configured,
          [] {
            return cudaFuncSetAttribute(q_pass_kernel<T>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
          });
      e != cudaSuccess)
    return e;
  q_pass_kernel<T><<<dim3(p.nq_pad / kBlockM, p.heads_q, batch), kPassThreads, kSmem, stream>>>(
      q, p, out);
  return cudaGetLastError();
}

template cudaError_t launch_q_pass<__nv_bfloat16>(const sage2::InputView<__nv_bfloat16>&,
                                                  const QPassParams&, int,
                                                  const sage2::QDebugOut&, cudaStream_t);
template cudaError_t launch_q_pass<__half>(const sage2::InputView<__half>&, const QPassParams&,
                                           int, const sage2::QDebugOut&, cudaStream_t);

}  // namespace qattn::sage2_wide
