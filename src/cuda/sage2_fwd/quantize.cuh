// Quantization kernels of the SageAttention2-8b forward: K and V (Q is quantized inside
// the attention kernel, q_tile.cuh). The arithmetic is the contract in
// docs/sage2-kernel-arithmetic.md (steps 1-4), which the CPU emulator follows too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "cuda/sage2_fwd/varlen.cuh"
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
  int head_dim_v;  // V's channels (<= head_dim); V's channels past it are quantized as zeros
  int nkv_pad;
  qattn_qk_granularity granularity;
  // Key padding (B ints, null: none): keys from kv_lengths[b] on are hidden, so they are
  // left out of the statistics and quantized as zeros, like the tail of the last tile.
  const int* kv_lengths;
  // A packed batch (varlen.cuh; null: dense): sequence b's keys are input rows
  // k_start.. of every head, quantized into rows kv_row0.. of workspace slice h (of
  // nkv_pad rows); kv_tiles is the grid's tiles per sequence (the longest one's).
  const SeqPlace* seqs;
  int kv_tiles;
};

struct QuantizeOutputs {
  int8_t* k_i8;
  float* k_scale;
  float* k_mean;
  uint8_t* vt_f8;
  float* v_amax;      // (B, Hkv, D): V's per-channel amax bound; scale = amax / 448
  uint32_t* v_over;   // (B, Hkv, D): 0, or the exact amax bits where values exceed it
  int* item_counter;  // the attention kernel's two work counters, zeroed here
  // Precision "auto" (null otherwise, and in a packed batch): per (batch, KV head) the
  // precision guard's {max b², max b²·|k̂|²} of the smoothed INT8 K
  // (numerics/precision_guard.h), zeroed and gathered here.
  float* guard_k = nullptr;
};

// Enqueues the quantization passes on the stream: the statistics (K mean and V's amax
// bound from a token sample), K and V (reading each once), and the fix-up of the rare V
// channels whose values exceed the bound (docs/sage2-kernel-arithmetic.md steps 1-4).
template <typename T, int D>
cudaError_t launch_quantize(const InputView<T>& k, const InputView<T>& v, const QuantizeParams& p,
                            const QuantizeOutputs& out, cudaStream_t stream);

}  // namespace qattn::sage2
