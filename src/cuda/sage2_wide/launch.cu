#include "cuda/sage2_wide/launch.h"

#include <algorithm>
#include <atomic>

#include "cuda/common/work_order.h"
#include "cuda/hopper/early_launch.h"
#include "cuda/hopper/per_device.h"
#include "cuda/hopper/tensor_map.h"
#include "cuda/sage2_fwd/quantize.cuh"
#include "numerics/head_dim_v.h"
#include "cuda/sage2_fwd/workspace.h"
#include "cuda/sage2_wide/kernel.cuh"
#include "cuda/sage2_wide/q_pass.cuh"
#include "numerics/key_range.h"
#include "numerics/sm_scale.h"

namespace qattn::sage2_wide {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

sage2::WorkspaceLayout layout(const qattn_fwd_params& p) {
  return sage2::workspace_layout(p, /*keep_q=*/true, kD);
}

float resolved_sm_scale(const qattn_fwd_params& p) {
  return p.sm_scale > 0.f ? p.sm_scale : numerics::default_sm_scale(p.head_dim);
}

numerics::KeyRule key_rule(const qattn_fwd_params& p) {
  return numerics::make_key_rule(p.seqlen_q, p.seqlen_kv, p.causal != 0,
                                 p.alignment == QATTN_ALIGN_TOP_LEFT,
                                 p.window != 0 ? p.window_left : -1,
                                 p.window != 0 ? p.window_right : -1, p.seqlen_kv);
}

template <typename T>
sage2::InputView<T> view(const qattn_tensor& t) {
  return {static_cast<const T*>(t.data), t.stride_b, t.stride_h, t.stride_n};
}

sage2::QuantizeOutputs kv_outputs(const sage2::WorkspaceLayout& w, void* ws) {
  auto* base = static_cast<uint8_t*>(ws);
  return {reinterpret_cast<int8_t*>(base + w.k_i8),    reinterpret_cast<float*>(base + w.k_scale),
          reinterpret_cast<float*>(base + w.k_mean),   reinterpret_cast<uint8_t*>(base + w.vt_f8),
          reinterpret_cast<float*>(base + w.v_amax),   reinterpret_cast<uint32_t*>(base + w.v_over),
          reinterpret_cast<int*>(base + w.item_counter)};
}

sage2::QDebugOut q_outputs(const sage2::WorkspaceLayout& w, void* ws) {
  auto* base = static_cast<uint8_t*>(ws);
  return {reinterpret_cast<int8_t*>(base + w.q_i8), reinterpret_cast<float*>(base + w.q_scale),
          reinterpret_cast<float*>(base + w.q_dot_c)};
}

template <typename T>
cudaError_t quantize(const qattn_fwd_params& p, const sage2::WorkspaceLayout& w, void* ws,
                     cudaStream_t stream) {
  sage2::QuantizeParams qp{};
  qp.batch = p.batch;
  qp.heads_kv = p.heads_kv;
  qp.seqlen_kv = p.seqlen_kv;
  qp.head_dim = p.head_dim;
  qp.head_dim_v = numerics::value_head_dim(p.head_dim, p.head_dim_v);
  qp.nkv_pad = w.nkv_pad;
  qp.kv_lengths = p.kv_lengths;
  qp.seqs = nullptr;
  qp.kv_tiles = w.nkv_pad / groups::kKvTile;
  qp.granularity = static_cast<qattn_qk_granularity>(p.sage2.granularity);
  const sage2::QuantizeOutputs out = kv_outputs(w, ws);
  if (auto e = sage2::launch_quantize<T, kD>(view<T>(p.k), view<T>(p.v), qp, out, stream);
      e != cudaSuccess)
    return e;
  QPassParams pp{};
  pp.heads_q = p.heads_q;
  pp.heads_kv = p.heads_kv;
  pp.seqlen_q = p.seqlen_q;
  pp.head_dim = p.head_dim;
  pp.nq_pad = w.nq_pad;
  pp.granularity = qp.granularity;
  pp.sm_scale = resolved_sm_scale(p);
  pp.scale_log2 = pp.sm_scale * kLog2e;
  pp.k_mean = p.lse != nullptr ? out.k_mean : nullptr;
  return launch_q_pass<T>(view<T>(p.q), pp, p.batch, q_outputs(w, ws), stream);
}

template <typename T, typename W>
cudaError_t attention(const qattn_fwd_params& p, const sage2::WorkspaceLayout& w, void* ws,
                      cudaStream_t stream) {
  const sage2::QuantizeOutputs kv = kv_outputs(w, ws);
  const sage2::QDebugOut q = q_outputs(w, ws);
  const uint64_t kv_slices = static_cast<uint64_t>(w.kv_slices);
  const uint64_t q_slices = static_cast<uint64_t>(p.batch) * p.heads_q;
  CUtensorMap tm_q, tm_k, tm_vt, tm_o;
  // A TMA store writes whole 16-byte chunks at a row's end: the O map stops at the last
  // full chunk and the kernel writes the other columns itself.
  const int dv = numerics::value_head_dim(p.head_dim, p.head_dim_v);  // O has V's channels
  const int o_tma_cols = dv / 8 * 8;
  if (auto e = hopper::make_tensor_map_u8_3d(&tm_q, q.q_i8, kD, w.nq_pad, q_slices, kHalfBytes,
                                             kBlockM, kQKSwizzle);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_tensor_map_u8_3d(&tm_k, kv.k_i8, kD, w.nkv_pad, kv_slices, kHalfBytes,
                                             kBlockN, kQKSwizzle);
      e != cudaSuccess)
    return e;
  // Vᵀ boxes of the rows (V channels) the variant multiplies.
  if (auto e = hopper::make_tensor_map_u8_3d(&tm_vt, kv.vt_f8, w.nkv_pad, kD, kv_slices, kBlockN,
                                             W::kV, kVSwizzle);
      e != cudaSuccess)
    return e;
  if (auto e = hopper::make_bhnd_map(&tm_o, p.o, p.batch, dv, std::max(o_tma_cols, 8),
                                     p.heads_q, p.seqlen_q, 64);
      e != cudaSuccess)
    return e;

  WideParams ap{};
  ap.q_scale = q.q_scale;
  ap.q_dot_c = q.q_dot_c;
  ap.k_scale = kv.k_scale;
  ap.v_amax = kv.v_amax;
  ap.o = p.o.data;
  ap.o_stride_b = p.o.stride_b;
  ap.o_stride_h = p.o.stride_h;
  ap.o_stride_n = p.o.stride_n;
  ap.o_tma_cols = o_tma_cols;
  ap.lse = p.lse;
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
  ap.num_m_blocks = w.nq_pad / kBlockM;
  ap.batch = p.batch;
  ap.causal_group = common::causal_group_heads(w.nkv_pad, kD, p.heads_q, p.heads_kv, p.batch);
  ap.item_counter = kv.item_counter;

  auto kernel = sage2_wide_kernel<T, W>;
  static std::atomic<unsigned long long> configured{0};
  if (auto e = hopper::once_per_context(
          configured,
          [&] {
            return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kSmemBytes);
          });
      e != cudaSuccess)
    return e;
  int num_sms = 0;
  if (auto e = hopper::current_device_sms(&num_sms); e != cudaSuccess) return e;
  const int64_t items = static_cast<int64_t>(ap.num_m_blocks) * p.heads_q * p.batch;
  const int grid = static_cast<int>(std::min<int64_t>(items, num_sms));
  ap.causal_tail = common::causal_tail_blocks(ap.num_m_blocks, p.heads_q * p.batch, grid);
  // May start while the Q pass ends (the loader waits for it before any load).
  return hopper::early_launch(kernel, dim3(grid), dim3(kThreads), kSmemBytes, stream, tm_q, tm_k,
                              tm_vt, tm_o, ap);
}

// The MLA variant where Q·K and V fit its widths (traits.cuh, Widths), else the full one.
bool mla_widths(const qattn_fwd_params& p) {
  return p.head_dim <= MlaWidths::kQK &&
         numerics::value_head_dim(p.head_dim, p.head_dim_v) <= MlaWidths::kV;
}

template <typename T>
cudaError_t run(const qattn_fwd_params& p, void* ws, cudaStream_t stream, bool quantize_first) {
  const sage2::WorkspaceLayout w = layout(p);
  if (quantize_first)
    if (auto e = quantize<T>(p, w, ws, stream); e != cudaSuccess) return e;
  return mla_widths(p) ? attention<T, MlaWidths>(p, w, ws, stream)
                       : attention<T, FullWidths>(p, w, ws, stream);
}

}  // namespace

std::size_t workspace_bytes(const qattn_fwd_params& p) { return layout(p).total; }

int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16 ? run<__nv_bfloat16>(p, workspace, s, true)
                                     : run<__half>(p, workspace, s, true);
}

int launch_attention_only(const qattn_fwd_params& p, void* workspace, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16 ? run<__nv_bfloat16>(p, workspace, s, false)
                                     : run<__half>(p, workspace, s, false);
}

}  // namespace qattn::sage2_wide
