// The decode's workspace: with S > 1 chunks per sequence, each chunk's partial output
// (normalized O_s, FP32), its log2-domain LSE and each row's q·c, merged by a second
// kernel. Host and device code share this layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcache/layout.h"

namespace qattn::kv_cache {

// CTAs of the decode kernel that run at once on one SM, by format, head dim and query
// rows per (sequence, KV head) (GQA group × new tokens). The direct kernels (every
// format at head dims 64 and 128, decode_direct.cuh) stage their keys in shared memory,
// and with two n-blocks of 8 rows also what they read of Q, which keeps them within 128
// registers (four CTAs), except FP8 and INT8 with two n-blocks at head dim 128, within
// 168 (three), and BF16 at head dim 128, whose two 8 KB stages a warp fit three CTAs'
// shared memory; the tiled kernel (other head dims) runs two. The kernels' launch
// bounds and the split rule both read it.
constexpr bool decode_is_direct(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128;
}
constexpr int decode_ctas_per_sm(kvcache::KvFormat format, int64_t head_dim, int64_t rows) {
  if (!decode_is_direct(head_dim)) return 2;
  if (format == kvcache::KvFormat::Bf16) return head_dim == 64 ? 4 : 3;
  if (rows <= 8 || format == kvcache::KvFormat::NvFp4 || head_dim == 64) return 4;
  return 3;
}

struct DecodeWorkspace {
  std::size_t o_partial = 0;    // float [batch][heads_q][nq][splits][head_dim]
  std::size_t lse_partial = 0;  // float [batch][heads_q][nq][splits]
  std::size_t qc = 0;           // float [batch][heads_q][nq]: sm_scale-free q·c of each row
  std::size_t total = 0;        // 0 when splits == 1 (the kernel writes o directly)
};

constexpr std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

constexpr DecodeWorkspace decode_workspace(int64_t batch, int64_t heads_q, int64_t nq,
                                           int64_t head_dim, int64_t splits) {
  DecodeWorkspace w;
  if (splits <= 1) return w;
  const auto rows = static_cast<std::size_t>(batch * heads_q * nq * splits);
  w.o_partial = 0;
  w.lse_partial = align256(rows * static_cast<std::size_t>(head_dim) * sizeof(float));
  w.qc = w.lse_partial + align256(rows * sizeof(float));
  w.total = w.qc + align256(static_cast<std::size_t>(batch * heads_q * nq) * sizeof(float));
  return w;
}

}  // namespace qattn::kv_cache
