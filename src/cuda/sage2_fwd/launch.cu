#include <algorithm>
#include <cmath>

#include "cuda/hopper/early_launch.h"
#include "cuda/hopper/per_device.h"
#include "cuda/hopper/tensor_map.h"
#include "cuda/sage2_fwd/kernel.cuh"
#include "cuda/sage2_fwd/launch.h"
#include "cuda/sage2_fwd/quantize.cuh"
#include "numerics/head_dim_v.h"
#include "cuda/common/work_order.h"
#include "cuda/sage2_fwd/varlen.cuh"
#include "cuda/sage2_fwd/workspace.h"
#include "numerics/sm_scale.h"

namespace qattn::sage2 {
namespace {

static_assert(sizeof(SeqPlace) == kSeqPlaceBytes);

constexpr float kLog2e = 1.4426950408889634f;

float resolved_sm_scale(const qattn_fwd_params& p) {
  return p.sm_scale > 0.f ? p.sm_scale : numerics::default_sm_scale(p.head_dim);
}

// Which keys each row sees (numerics/key_range.h), key padding aside (the lengths are
// read on the device). A packed batch: the window sides and causal, with the longest
// sequences as Nq and Nkv (each item takes its own sequence's offset and length).
numerics::KeyRule key_rule(const qattn_fwd_params& p) {
  if (p.cu_seqlens_q != nullptr)
    return numerics::make_key_rule(p.max_seqlen_q, p.max_seqlen_k, p.causal != 0,
                                   p.alignment == QATTN_ALIGN_TOP_LEFT,
                                   p.window != 0 ? p.window_left : -1,
                                   p.window != 0 ? p.window_right : -1, p.max_seqlen_k);
  return numerics::make_key_rule(p.seqlen_q, p.seqlen_kv, p.causal != 0,
                                 p.alignment == QATTN_ALIGN_TOP_LEFT,
                                 p.window != 0 ? p.window_left : -1,
                                 p.window != 0 ? p.window_right : -1, p.seqlen_kv);
}

// An attn_mask as the kernel and its pass read it (tiles null without one).
AttnMaskView mask_view(const qattn_fwd_params& p, const WorkspaceLayout& w, void* ws) {
  AttnMaskView m{};
  if (p.attn_mask_type == QATTN_MASK_NONE) return m;
  m.data = static_cast<const uint8_t*>(p.attn_mask);
  // Strides of dimensions of one are never multiplied by a non-zero index.
  m.stride_b = p.batch > 1 ? p.attn_mask_stride_b : 0;
  m.stride_h = p.heads_q > 1 ? p.attn_mask_stride_h : 0;
  m.stride_q = p.seqlen_q > 1 ? p.attn_mask_stride_q : 0;
  m.stride_k = p.seqlen_kv > 1 ? p.attn_mask_stride_k : 0;
  m.tiles = reinterpret_cast<const int*>(static_cast<uint8_t*>(ws) + w.mask_tiles);
  m.bits = reinterpret_cast<unsigned*>(static_cast<uint8_t*>(ws) + w.mask_bits);
  m.list_len = static_cast<int>(w.kv_tiles()) + 1;
  m.per_batch = mask_per_batch(p);
  m.per_head = mask_per_head(p);
  m.heads_q = p.heads_q;
  m.num_m_blocks = w.nq_pad / kQTile;
  m.additive = p.attn_mask_type == QATTN_MASK_ADDITIVE;
  m.bf16 = p.dtype == QATTN_DTYPE_BF16;
  return m;
}

template <typename T>
InputView<T> view(const qattn_tensor& t) {
  return {static_cast<const T*>(t.data), t.stride_b, t.stride_h, t.stride_n};
}

// The plan of a packed batch as the kernels read it (all null in a dense call).
VarlenView varlen_view(const qattn_fwd_params& p, const WorkspaceLayout& w, void* ws) {
  if (!w.varlen) return VarlenView{};
  auto* base = static_cast<uint8_t*>(ws);
  return {reinterpret_cast<const SeqPlace*>(base + w.varlen_seqs),
          reinterpret_cast<const int2*>(base + w.varlen_entries),
          reinterpret_cast<const int*>(base + w.varlen_count), p.alignment == QATTN_ALIGN_TOP_LEFT,
          p.seqlen_q};
}

QuantizeOutputs outputs(const WorkspaceLayout& w, void* ws) {
  auto* base = static_cast<uint8_t*>(ws);
  return {
      reinterpret_cast<int8_t*>(base + w.k_i8),     reinterpret_cast<float*>(base + w.k_scale),
      reinterpret_cast<float*>(base + w.k_mean),    reinterpret_cast<uint8_t*>(base + w.vt_f8),
      reinterpret_cast<float*>(base + w.v_amax),    reinterpret_cast<uint32_t*>(base + w.v_over),
      reinterpret_cast<int*>(base + w.item_counter)};
}

// Where the attention kernel copies its INT8 Q, Q scales and q·c (keep_q only: the
// tests' debug copy; the workspace has these regions only then).
QDebugOut q_debug_out(const WorkspaceLayout& w, void* ws) {
  auto* base = static_cast<uint8_t*>(ws);
  return {reinterpret_cast<int8_t*>(base + w.q_i8), reinterpret_cast<float*>(base + w.q_scale),
          reinterpret_cast<float*>(base + w.q_dot_c)};
}

// The consumers' register split (kernel.cuh): at d=128, 240 registers per consumer thread
// pay off on items of at least this many KV tiles on average, 232 are faster below it
// (2K non-causal +1.5-2%, 1K and causal 2K -2-5% at 240). d=64 takes 240 at every
// length (causal 2K +1-5%). Measured: bench/NOTES.md.
constexpr double kWideSplitMinTiles = 16.0;
// Below that at d=128: the Q quantizer on four warps (a 512-thread CTA), whose ends of
// causal grids are quantizer-bound (measured: bench/NOTES.md).
// d=128 without the causal mask, from kWideSplitMinTiles up to this many KV tiles per
// item: one exp in eight on the FMA pipe (kConsumers240PolyExp). Timed side by side it
// gained 3-4% kernel-only at N = 2K, 4K and the image DiT (36 tiles), was even at 8K
// and lost 1-2% at 32K and causal 8K (measured: bench/NOTES.md).
constexpr double kPolyExpMaxTiles = 48.0;

template <int D, typename T>
cudaError_t launch_attention_d(const qattn_fwd_params& p, const WorkspaceLayout& w, void* ws,
                               cudaStream_t stream, bool keep_q, RegisterSplit split) {
  using Tr = KernelTraits<D>;
  const QuantizeOutputs q = outputs(w, ws);
  const uint64_t kv_slices = static_cast<uint64_t>(w.kv_slices);
  // A packed batch's q and o are one (total, H, d) tensor: batch 1 in the maps.
  qattn_fwd_params pm = p;
  if (w.varlen) pm.batch = 1;
  CUtensorMap tm_q, tm_k, tm_vt, tm_o;
  // Q is read in 128-row boxes (one per item); O is written in 64-row boxes (one per
  // consumer warpgroup). A TMA store writes whole 16-byte chunks at the end of a row
  // (measured: a guard column after head_dim = 100 was overwritten), so the O map stops
  // at the last full chunk and the kernel writes the other columns itself
  // (AttentionParams::o_tma_cols).
  // O has V's channels (head_dim_v).
  const int dv = numerics::value_head_dim(p.head_dim, p.head_dim_v);
  const int o_tma_cols = dv / 8 * 8;
  if (auto e = hopper::make_bhnd_map(&tm_q, p.q, pm.batch, p.head_dim, p.head_dim, p.heads_q, p.seqlen_q,
                                     Tr::kBlockM);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_bhnd_map(&tm_o, p.o, pm.batch, dv, std::max(o_tma_cols, 8),
                                     p.heads_q, p.seqlen_q, groups::kQBlock);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_tensor_map_u8_3d(&tm_k, q.k_i8, D, w.nkv_pad, kv_slices, D,
                                             Tr::kBlockN, Tr::kQKSwizzle);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_tensor_map_u8_3d(&tm_vt, q.vt_f8, w.nkv_pad, D, kv_slices,
                                             Tr::kBlockN, D, Tr::kVSwizzle);
      e != cudaSuccess)
    return e;

  AttentionParams ap{};
  ap.k_scale = q.k_scale;
  ap.k_mean = q.k_mean;
  ap.v_amax = q.v_amax;
  ap.item_counter = reinterpret_cast<int*>(static_cast<uint8_t*>(ws) + w.item_counter);
  if (keep_q) ap.q_debug = q_debug_out(w, ws);
  ap.sm_scale = resolved_sm_scale(p);
  ap.scale_log2 = ap.sm_scale * kLog2e;
  ap.granularity = static_cast<qattn_qk_granularity>(p.sage2.granularity);
  ap.o = p.o.data;
  ap.o_stride_b = p.o.stride_b;
  ap.o_stride_h = p.o.stride_h;
  ap.o_stride_n = p.o.stride_n;
  ap.o_tma_cols = o_tma_cols;
  ap.lse = p.lse;
  ap.p_max = p.p_max;
  ap.heads_q = p.heads_q;
  ap.heads_kv = p.heads_kv;
  ap.seqlen_q = p.seqlen_q;
  ap.seqlen_kv = p.seqlen_kv;
  ap.head_dim_v = dv;
  ap.nq_pad = w.nq_pad;
  ap.nkv_pad = w.nkv_pad;
  ap.causal = p.causal;
  ap.keys = key_rule(p);
  ap.kv_lengths = p.kv_lengths;
  ap.mask = mask_view(p, w, ws);
  ap.varlen = varlen_view(p, w, ws);

  ap.num_m_blocks = w.nq_pad / Tr::kBlockM;
  if (D == 64 && split == RegisterSplit::kConsumers240PolyExp)
    split = RegisterSplit::kConsumers240;  // d=64 has no poly shape (kernel.cuh)
  if (split == RegisterSplit::kAuto && !w.varlen) {
    const double tiles = common::mean_kv_tiles_per_item(ap.keys, p.seqlen_q, ap.num_m_blocks);
    const bool long_items = D == 64 || tiles >= kWideSplitMinTiles;
    const bool poly = D == 128 && p.causal == 0 && tiles < kPolyExpMaxTiles;
    split = long_items && poly ? RegisterSplit::kConsumers240PolyExp
            : long_items       ? RegisterSplit::kConsumers240
                               : RegisterSplit::kQuantizer4Warps;
  }
  const bool four_warps = split == RegisterSplit::kQuantizer4Warps;
  auto kernel = sage2_fwd_kernel<D, T, 232>;
  if (split == RegisterSplit::kConsumers240) kernel = sage2_fwd_kernel<D, T, 240>;
  if (split == RegisterSplit::kConsumers240PolyExp)
    kernel = sage2_fwd_kernel<D, T, 240, 2, D == 128 ? 1 : 0>;
  if (four_warps) kernel = sage2_fwd_kernel<D, T, 232, 4>;
  // A boolean attn_mask: its own kernel, in the 232-register shape whose loader has the
  // registers for the list lookups (attn_mask.cuh).
  const bool attn_mask = p.attn_mask_type != QATTN_MASK_NONE;
  const bool additive = p.attn_mask_type == QATTN_MASK_ADDITIVE;
  if (attn_mask) kernel = sage2_fwd_kernel<D, T, 232, 2, 0, true>;
  // An additive mask: the same shape, its own kernel (kernel.cuh, kAdditive).
  if (additive) kernel = sage2_fwd_kernel<D, T, 232, 2, 0, true, false, true>;
  // A packed batch: its own kernel, in the 240-register shape (at 232 its d = 128
  // consumers, with the per-sequence epilogue, spilled).
  if (w.varlen) kernel = sage2_fwd_kernel<D, T, 240, 2, 0, false, true>;
  const bool own_shape = attn_mask || w.varlen;
  const int threads = four_warps && !own_shape ? kCtaThreads<4> : kCtaThreads<2>;
  constexpr int smem = static_cast<int>(sizeof(SharedStorage<D>)) + 1024;
  int num_sms = 0;
  if (auto e = hopper::current_device_sms(&num_sms); e != cudaSuccess) return e;
  // Per kernel shape (kAuto was resolved above; the others are 1-4).
  static_assert(static_cast<int>(RegisterSplit::kConsumers240PolyExp) == 4);
  static std::atomic<unsigned long long> configured[7] = {0, 0, 0, 0, 0, 0, 0};
  if (auto e = hopper::once_per_context(
          configured[w.varlen ? 5 : additive ? 6 : attn_mask ? 4 : static_cast<int>(split) - 1],
          [&] {
            return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          });
      e != cudaSuccess)
    return e;
  ap.batch = p.batch;
  // (A packed batch: the heads of its item order's groups, over all its K/V rows.)
  ap.causal_group = w.varlen ? common::causal_group_heads(w.nkv_pad, D, p.heads_q, p.heads_kv, 1)
                             : common::causal_group_heads(w.nkv_pad, D, p.heads_q, p.heads_kv,
                                                          p.batch);
  // Persistent grid: one CTA per SM (384 threads at 168 registers, or 512 at 128, fill
  // an SM).
  // A packed batch: the plan's list is on the device; the grid takes its bound.
  const int64_t items = w.varlen ? static_cast<int64_t>(w.max_entries) * p.heads_q
                                 : static_cast<int64_t>(ap.num_m_blocks) * p.heads_q * p.batch;
  const int grid = static_cast<int>(std::min<int64_t>(items, num_sms));
  ap.causal_tail = common::causal_tail_blocks(ap.num_m_blocks, p.heads_q * p.batch, grid);
  // May start while the K/V quantization kernel ends (kernel.cuh: the wait).
  return hopper::early_launch(kernel, dim3(grid), dim3(threads), smem, stream, tm_q, tm_k,
                              tm_vt, tm_o, ap);
}

template <typename T, int D>
cudaError_t quantize_d(const qattn_fwd_params& p, const WorkspaceLayout& w, void* ws,
                       cudaStream_t stream, float* guard_k) {
  QuantizeParams qp{};
  qp.batch = p.batch;
  qp.heads_kv = p.heads_kv;
  qp.seqlen_kv = p.seqlen_kv;
  qp.head_dim = p.head_dim;
  qp.head_dim_v = numerics::value_head_dim(p.head_dim, p.head_dim_v);
  qp.nkv_pad = w.nkv_pad;
  qp.kv_lengths = p.kv_lengths;
  qp.seqs = varlen_view(p, w, ws).seqs;
  // A packed batch: the grid's tiles per sequence are the longest one's (at least one:
  // a sequence without keys keeps a tile of zeros).
  qp.kv_tiles = w.varlen ? std::max(1, (p.max_seqlen_k + groups::kKvTile - 1) / groups::kKvTile)
                         : w.nkv_pad / groups::kKvTile;
  qp.granularity = static_cast<qattn_qk_granularity>(p.sage2.granularity);
  QuantizeOutputs out = outputs(w, ws);
  out.guard_k = guard_k;
  return launch_quantize<T, D>(view<T>(p.k), view<T>(p.v), qp, out, stream);
}

template <typename T>
cudaError_t run(const qattn_fwd_params& p, void* ws, cudaStream_t stream, bool quantize,
                bool keep_q, RegisterSplit split, float* guard_k) {
  const WorkspaceLayout w = workspace_layout(p, keep_q);
  // A packed batch's plan first: the quantization and the attention kernel read it.
  if (quantize && w.varlen) {
    auto* base = static_cast<uint8_t*>(ws);
    if (auto e = launch_varlen_plan(
            p.cu_seqlens_q, p.cu_seqlens_k, p.batch, p.seqlen_q, p.seqlen_kv, p.max_seqlen_q,
            p.max_seqlen_k, key_rule(p), p.alignment == QATTN_ALIGN_TOP_LEFT, w.max_entries,
            reinterpret_cast<SeqPlace*>(base + w.varlen_seqs),
            reinterpret_cast<int2*>(base + w.varlen_entries),
            reinterpret_cast<int*>(base + w.varlen_count), stream);
        e != cudaSuccess)
      return e;
  }
  // The mask's tile lists first: the kernels after it in the stream start once it ended.
  if (quantize && p.attn_mask_type != QATTN_MASK_NONE)
    if (auto e = launch_attn_mask_tiles(mask_view(p, w, ws), p.seqlen_q, p.seqlen_kv,
                                        w.mask_slices,
                                        static_cast<uint8_t*>(ws) + w.mask_classes, stream);
        e != cudaSuccess)
      return e;
  if (w.head_dim_padded == 64) {
    if (quantize)
      if (auto e = quantize_d<T, 64>(p, w, ws, stream, guard_k); e != cudaSuccess) return e;
    return launch_attention_d<64, T>(p, w, ws, stream, keep_q, split);
  }
  if (quantize)
    if (auto e = quantize_d<T, 128>(p, w, ws, stream, guard_k); e != cudaSuccess) return e;
  return launch_attention_d<128, T>(p, w, ws, stream, keep_q, split);
}

}  // namespace

std::size_t workspace_bytes(const qattn_fwd_params& p, bool keep_q) {
  return workspace_layout(p, keep_q).total;
}

int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream, bool keep_q,
                   RegisterSplit split, float* guard_k) {
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16
             ? run<__nv_bfloat16>(p, workspace, s, true, keep_q, split, guard_k)
             : run<__half>(p, workspace, s, true, keep_q, split, guard_k);
}

int launch_attention_only(const qattn_fwd_params& p, void* workspace, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16
             ? run<__nv_bfloat16>(p, workspace, s, false, false, RegisterSplit::kAuto, nullptr)
             : run<__half>(p, workspace, s, false, false, RegisterSplit::kAuto, nullptr);
}

}  // namespace qattn::sage2
