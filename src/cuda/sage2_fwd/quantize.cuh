// Quantization kernels of the SageAttention2-8b forward: K and V (Q is quantized inside
// the attention kernel, q_tile.cuh). The arithmetic is the contract in
// docs/sage2-kernel-arithmetic.md (steps 1-4), which the CPU emulator follows too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "qattn/qattn.h"

namespace qattn::sage2 {

// A read-only (B, H, N, d) view of 16-bit input, strides in elements.
template <typename T>
struct InputView {
  const T* data;
  int64_t stride_b, stride_h, stride_n;
};

struct QuantizeParams {
  int batch, heads_kv, seqlen_kv, head_dim;
  int nkv_pad;
  qattn_qk_granularity granularity;
};

struct QuantizeOutputs {
  int8_t* k_i8;
  float* k_scale;
  float* k_mean;
  uint8_t* vt_f8;
  float* v_amax;             // (B, Hkv, D): per-channel amax of V; scale = amax / 448, followed by
                             // the attention kernel's two work counters (zeroed with it)
  std::size_t zeroed_bytes;  // from v_amax: V amax and the counters (workspace.h)
};

// Enqueues the quantization passes on the stream: K mean and V amax (reads a sample
// of K and all of V), then K and V.
template <typename T, int D>
cudaError_t launch_quantize(const InputView<T>& k, const InputView<T>& v, const QuantizeParams& p,
                            const QuantizeOutputs& out, cudaStream_t stream);

}  // namespace qattn::sage2
