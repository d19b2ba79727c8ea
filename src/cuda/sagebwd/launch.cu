// Host side of the SageBwd backward: resolves the workspace into Args and enqueues
// prepare -> dkdv (-> dq) -> dq_finalize on the caller's stream.
#include "cuda/sagebwd/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>

#include "cuda/hopper/per_device.h"
#include "cuda/hopper/tensor_map.h"
#include "cuda/sagebwd/dkdv_wgmma.cuh"
#include "cuda/sagebwd/kernels.cuh"
#include "cuda/sagebwd/prepare.cuh"
#include "cuda/sagebwd/workspace.h"

namespace qattn::sagebwd {
namespace {

Strided view(const qattn_tensor& t) { return {t.data, t.stride_b, t.stride_h, t.stride_n}; }
StridedOut view_out(const qattn_tensor& t) { return {t.data, t.stride_b, t.stride_h, t.stride_n}; }

Args make_args(const qattn_bwd_params& p, void* workspace) {
  const WorkspaceLayout w = workspace_layout(p);
  auto* ws = static_cast<uint8_t*>(workspace);
  auto f = [ws](std::size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto i8 = [ws](std::size_t off) { return reinterpret_cast<int8_t*>(ws + off); };
  Args a{};
  a.q = view(p.q);
  a.k = view(p.k);
  a.v = view(p.v);
  a.o = view(p.o);
  a.dout = view(p.dout);
  a.lse = p.lse;
  a.dq = view_out(p.dq);
  a.dk = view_out(p.dk);
  a.dv = view_out(p.dv);
  a.batch = p.batch;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.group = p.heads_q / p.heads_kv;
  a.nq = p.seqlen_q;
  a.nkv = p.seqlen_kv;
  a.d = p.head_dim;
  a.nq_pad = w.nq_pad;
  a.nkv_pad = w.nkv_pad;
  a.causal = p.causal;
  a.sm_scale = p.sm_scale;
  a.scale_log2 = static_cast<float>(static_cast<double>(p.sm_scale) * M_LOG2E);
  a.q_i8 = i8(w.q_i8);
  a.qt_i8 = i8(w.qt_i8);
  a.do_i8 = i8(w.do_i8);
  a.dot_i8 = i8(w.dot_i8);
  a.k_i8 = i8(w.k_i8);
  a.kt_i8 = i8(w.kt_i8);
  a.v_i8 = i8(w.v_i8);
  a.do_16 = ws + w.do_16;
  a.v_16 = ws + w.v_16;
  a.q_scale = f(w.q_scale);
  a.do_scale = f(w.do_scale);
  a.lse2 = f(w.lse2);
  a.delta = f(w.delta);
  a.dq_acc = f(w.dq_acc);
  a.k_scale = f(w.k_scale);
  a.v_scale = f(w.v_scale);
  a.k_mean = f(w.k_mean);
  if (p.scales == QATTN_BWD_SCALES_MERGE_FREE) {
    a.p_max = p.p_max;
    a.s_row = f(w.s_row);
    a.inv_s = f(w.inv_s);
    a.v_max = f(w.v_max);
    a.do_max = f(w.do_max);
    a.sq_max = f(w.sq_max);
  }
  return a;
}

template <typename Kernel>
cudaError_t set_smem(Kernel kernel, int bytes, std::atomic<unsigned long long>& done) {
  return hopper::once_per_context(done, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
}

// The dK/dV kernel's Q-side tensor maps over the workspace (QSideMaps); dQ's with the
// merge-free scales.
template <int D, bool kQuantDov, bool kDqMap>
cudaError_t make_q_side_maps(const Args& a, QSideMaps& m) {
  using W = WgSmem<D, kQuantDov>;
  const uint64_t rows = static_cast<uint64_t>(a.nq_pad), heads = static_cast<uint64_t>(a.batch) * a.heads_q;
  const uint32_t blk = kQBlockRows;
  cudaError_t e = hopper::make_tensor_map_u8_3d(&m.q8, a.q_i8, D, rows, heads, D, blk, W::kSwI8);
  if (e == cudaSuccess)
    e = kQuantDov ? hopper::make_tensor_map_u8_3d(&m.dov, a.do_i8, D, rows, heads, D, blk, W::kSwV)
                  : hopper::make_tensor_map_u8_3d(&m.dov, a.do_16, 2 * D, rows, heads, 128, blk,
                                                  hopper::Swizzle::k128B);
  if (e == cudaSuccess)
    e = hopper::make_tensor_map_u8_3d(&m.qt, a.qt_i8, rows, D, heads, blk, D, hopper::Swizzle::k64B);
  if (e == cudaSuccess)
    e = hopper::make_tensor_map_u8_3d(&m.dot, a.dot_i8, rows, D, heads, blk, D, hopper::Swizzle::k64B);
  if (e == cudaSuccess && kDqMap)
    e = hopper::make_tensor_map_f32_3d(&m.dq, a.dq_acc, D, rows, heads, kDqBoxCols, blk);
  return e;
}

template <typename T, int D, bool kQuantDov, Code8 C>
cudaError_t run(const Args& a, bool deterministic, cudaStream_t stream) {
  using F = Format8<C>;
  using L = Smem<D, kQuantDov>;
  using W = WgSmem<D, kQuantDov, F::kMergeFree>;
  QSideMaps maps{};  // before anything is enqueued: a failed encode launches nothing
  if (auto e = make_q_side_maps<D, kQuantDov, F::kMergeFree>(a, maps); e != cudaSuccess) return e;
  if (auto e = launch_prepare<T, D>(a, kQuantDov, C, stream); e != cudaSuccess) return e;
  const dim3 kv_grid(a.nkv_pad / kKvTileRows, a.heads_kv, a.batch);
  if (deterministic) {
    static std::atomic<unsigned long long> done_kv{0}, done_q{0};
    using Wd = WgSmem<D, kQuantDov, false>;  // no dQ here: no staging tile
    auto kv = dkdv_wgmma_kernel<T, D, kQuantDov, false, F>;
    auto q = dq_kernel<T, D, kQuantDov, F>;
    if (auto e = set_smem(kv, Wd::kBytes, done_kv); e != cudaSuccess) return e;
    if (auto e = set_smem(q, L::kDqBytes, done_q); e != cudaSuccess) return e;
    kv<<<kv_grid, kThreads, Wd::kBytes, stream>>>(a, maps);
    q<<<dim3(a.nq_pad / kQBlockRows, a.heads_q, a.batch), kThreads, L::kDqBytes, stream>>>(a);
  } else {
    static std::atomic<unsigned long long> done{0};
    auto kv = dkdv_wgmma_kernel<T, D, kQuantDov, true, F>;
    if (auto e = set_smem(kv, W::kBytes, done); e != cudaSuccess) return e;
    kv<<<kv_grid, kThreads, W::kBytes, stream>>>(a, maps);
  }
  if (auto e = cudaGetLastError(); e != cudaSuccess) return e;
  return launch_dq_finalize<T, D>(a, stream);
}

template <typename T, Code8 C>
cudaError_t run_format(const Args& a, int D, bool quant_dov, bool deterministic, cudaStream_t s) {
  if (D == 64)
    return quant_dov ? run<T, 64, true, C>(a, deterministic, s) : run<T, 64, false, C>(a, deterministic, s);
  return quant_dov ? run<T, 128, true, C>(a, deterministic, s) : run<T, 128, false, C>(a, deterministic, s);
}

template <typename T>
cudaError_t run_dtype(const Args& a, int D, Code8 code, bool quant_dov, bool deterministic,
                      cudaStream_t s) {
  if (code == Code8::E4M3MergeFree)  // dov 16-bit only (validated)
    return D == 64 ? run<T, 64, false, Code8::E4M3MergeFree>(a, deterministic, s)
                   : run<T, 128, false, Code8::E4M3MergeFree>(a, deterministic, s);
  return code == Code8::E4M3 ? run_format<T, Code8::E4M3>(a, D, quant_dov, deterministic, s)
                             : run_format<T, Code8::Int8>(a, D, quant_dov, deterministic, s);
}

}  // namespace

int launch_backward(const qattn_bwd_params& p, void* workspace, void* stream) {
  const Args a = make_args(p, workspace);
  const int D = padded_head_dim(p.head_dim);
  const bool quant_dov = p.dov == QATTN_BWD_DOV_QUANTIZED;
  const Code8 code = p.scales == QATTN_BWD_SCALES_MERGE_FREE ? Code8::E4M3MergeFree
                     : p.format == QATTN_BWD_E4M3          ? Code8::E4M3
                                                           : Code8::Int8;
  auto s = static_cast<cudaStream_t>(stream);
  const bool det = p.deterministic != 0;
  const cudaError_t e = p.dtype == QATTN_DTYPE_BF16
                            ? run_dtype<__nv_bfloat16>(a, D, code, quant_dov, det, s)
                            : run_dtype<__half>(a, D, code, quant_dov, det, s);
  return static_cast<int>(e);
}

}  // namespace qattn::sagebwd
