// The SageAttention3 NVFP4 forward's workspace (host and device share this layout):
// what the quantization kernels (quantize.cu) write and the attention kernel
// (attention.cu) reads. Every section starts 256-byte aligned.
//   k_mean  float (B, Hkv, d)          c, the mean of K over its tokens
//   k_hat   bf16  (B, Hkv, Nkv_pad, d) NVFP4(K − c) along d, dequantized (exact in BF16)
//   v_hat   bf16  (B, Hkv, Nkv_pad, d) NVFP4(V) along the tokens (blocks of 16 tokens
//                                      per channel), dequantized; tokens ≥ Nkv are 0
//   q_hat   bf16  (B, Hq, Nq_pad, d)   NVFP4(Q − q̄) along d, dequantized
//   q_bar   float (B, Hq, Nq_pad / 64, d)  q̄, the mean of each 64-row Q block
//   q_dot_c float (B, Hq, Nq_pad)      q·c of every row (the LSE's correction)
// Nq_pad and Nkv_pad are multiples of 128 (the emulator's KV tile; two Q blocks).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qattn/qattn.h"

namespace qattn::sage3 {

inline constexpr int kQBlock = 64;    // rows of a Q block: one mean q̄, one CTA
inline constexpr int kKvTile = 128;   // keys per tile: one two-level P scale per row
inline constexpr int kFp4Block = 16;  // NVFP4 elements per E4M3 scale
inline constexpr int kPad = 128;

struct WorkspaceLayout {
  std::size_t k_mean = 0, k_hat = 0, v_hat = 0, q_hat = 0, q_bar = 0, q_dot_c = 0;
  std::size_t total = 0;
};

constexpr int64_t padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

constexpr WorkspaceLayout workspace_layout(const qattn_fwd_params& p) {
  const auto al = [](std::size_t x) { return (x + 255) / 256 * 256; };
  const auto b = static_cast<std::size_t>(p.batch), hq = static_cast<std::size_t>(p.heads_q),
             hkv = static_cast<std::size_t>(p.heads_kv), d = static_cast<std::size_t>(p.head_dim);
  const auto nq = static_cast<std::size_t>(padded(p.seqlen_q)),
             nkv = static_cast<std::size_t>(padded(p.seqlen_kv));
  WorkspaceLayout w;
  w.k_mean = 0;
  w.k_hat = w.k_mean + al(b * hkv * d * 4);
  w.v_hat = w.k_hat + al(b * hkv * nkv * d * 2);
  w.q_hat = w.v_hat + al(b * hkv * nkv * d * 2);
  w.q_bar = w.q_hat + al(b * hq * nq * d * 2);
  w.q_dot_c = w.q_bar + al(b * hq * (nq / kQBlock) * d * 4);
  w.total = w.q_dot_c + al(b * hq * nq * 4);
  return w;
}

}  // namespace qattn::sage3
