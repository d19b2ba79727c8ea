// qattn._C: the C ABI for Python, with raw integers for pointers, strides and the
// stream. It knows nothing of PyTorch (the torch integration is pure Python in
// qattn/ops.py), so one build works with any PyTorch version.
//
// A tensor is passed as (data_ptr, stride_b, stride_h, stride_n) in elements, the
// shape as (batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim), the forward's
// masks beyond causal as (kv_lengths, window_left, window_right, alignment, attn_mask,
// attn_mask_stride_b, attn_mask_stride_h, attn_mask_stride_q, attn_mask_stride_k,
// attn_mask_type) with
// kv_lengths a device int32 pointer (0 = NULL), a window side -1 for no bound (both -1:
// no window), alignment a qattn_alignment, and attn_mask a device pointer to SDPA's
// mask with byte strides >= 0 (0 broadcasts) and its qattn_mask_type (QATTN_MASK_NONE:
// no attn_mask; QATTN_MASK_BOOL: a byte per (query, key); QATTN_MASK_ADDITIVE: a value of
// the call's dtype); the backward
// (bwd_workspace_size, bwd) takes the same forms for its tensors; a packed batch (forward
// only) is (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k). P's row maxima are
// an FP32 (B, Hq, Nq) device pointer p_max (0 = NULL): the forward's optional output,
// the backward's input with the merge-free scales (scales, a qattn_bwd_scales). The KV-cache calls
// take the cache as (format, heads_kv, head_dim, page_size, num_pages,
// max_pages_per_seq, k_smoothing, pages) and the sequences as (block_tables, lengths,
// k_mean, host_block_tables, host_lengths), every pointer an integer (0 = NULL; the
// host_* ones are host memory). Calls return the qattn_status as an int; qattn/ops.py
// and qattn/kv_cache.py turn a failure into an exception with last_error_message(),
// read on the same thread right after the call. Two functions are not the C ABI but the
// CPU emulation: synthetic_inputs, the accuracy report's input generator
// (src/emulate/synthetic.h), so bench/accuracy.py runs the GPU on the very tensors
// `qattn accuracy` emulates; emulated_precision_guard, the guard of
// src/emulate/precision.h that qattn.tools.precision_guard is tested against; and
// emulated_attention, the SA2-8b kernel's CPU emulation (its contract) in a precision
// mode, which qattn.tools.emulated_attention runs inside a model on the CPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "../../src/api/bench_hooks.h"  // qattn_fwd_attention_only, for the bench tools
#include "emulate/precision.h"  // the precision guard, the contract of qattn.tools.precision_guard
#include "emulate/synthetic.h"  // the accuracy report's inputs, for bench/accuracy.py
#include "qattn/qattn.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using TensorArg = std::tuple<std::uintptr_t, int64_t, int64_t, int64_t>;
using ShapeArg = std::tuple<int, int, int, int, int, int>;
using MaskArg = std::tuple<std::uintptr_t, int, int, int, std::uintptr_t, int64_t, int64_t,
                           int64_t, int64_t, int>;
using CacheArg = std::tuple<int, int, int, int, int, int, int, std::uintptr_t>;
// A packed batch: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), the arrays
// device int32 pointers; (0, 0, 0, 0): not packed.
using VarlenArg = std::tuple<std::uintptr_t, std::uintptr_t, int, int>;
using SeqsArg =
    std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t>;

qattn_tensor tensor(const TensorArg& t) {
  return {reinterpret_cast<void*>(std::get<0>(t)), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
}

// qattn_fwd_params_init's: every key, no window, bottom-right, no attn_mask; not packed.
const MaskArg kNoMask{0, -1, -1, QATTN_ALIGN_BOTTOM_RIGHT, 0, 0, 0, 0, 0, QATTN_MASK_NONE};
const VarlenArg kNotPacked{0, 0, 0, 0};

qattn_fwd_params make_params(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                             const TensorArg& o, std::uintptr_t lse, int dtype,
                             const ShapeArg& shape, int causal, float sm_scale, int granularity,
                             const MaskArg& mask, int scheme, const VarlenArg& varlen,
                             int head_dim_v, std::uintptr_t p_max) {
  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.head_dim_v = head_dim_v;
  p.p_max = reinterpret_cast<float*>(p_max);
  p.q = tensor(q);
  p.k = tensor(k);
  p.v = tensor(v);
  p.o = tensor(o);
  p.lse = reinterpret_cast<float*>(lse);
  p.dtype = dtype;
  std::tie(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim) = shape;
  p.causal = causal;
  p.sm_scale = sm_scale;
  p.scheme = scheme;
  p.sage2.granularity = granularity;
  p.kv_lengths = reinterpret_cast<const int32_t*>(std::get<0>(mask));
  std::uintptr_t attn_mask = 0;
  std::tie(std::ignore, p.window_left, p.window_right, p.alignment, attn_mask,
           p.attn_mask_stride_b, p.attn_mask_stride_h, p.attn_mask_stride_q,
           p.attn_mask_stride_k, p.attn_mask_type) = mask;
  p.window = p.window_left != -1 || p.window_right != -1 ? 1 : 0;  // (-1, -1): none
  p.attn_mask = reinterpret_cast<const void*>(attn_mask);
  p.cu_seqlens_q = reinterpret_cast<const int32_t*>(std::get<0>(varlen));
  p.cu_seqlens_k = reinterpret_cast<const int32_t*>(std::get<1>(varlen));
  p.max_seqlen_q = std::get<2>(varlen);
  p.max_seqlen_k = std::get<3>(varlen);
  return p;
}

// The backward's parameters; lse is the forward's (B, Hq, Nq) FP32 natural-log LSE,
// p_max its (B, Hq, Nq) FP32 row maxima (0 = NULL; read with scales = merge-free).
qattn_bwd_params make_bwd_params(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                 const TensorArg& o, const TensorArg& dout, std::uintptr_t lse,
                                 const TensorArg& dq, const TensorArg& dk, const TensorArg& dv,
                                 int dtype, const ShapeArg& shape, int causal, float sm_scale,
                                 int format, int dov, bool deterministic, int scales,
                                 std::uintptr_t p_max) {
  qattn_bwd_params p;
  qattn_bwd_params_init(&p);
  p.q = tensor(q);
  p.k = tensor(k);
  p.v = tensor(v);
  p.o = tensor(o);
  p.dout = tensor(dout);
  p.lse = reinterpret_cast<const float*>(lse);
  p.dq = tensor(dq);
  p.dk = tensor(dk);
  p.dv = tensor(dv);
  p.dtype = dtype;
  std::tie(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim) = shape;
  p.causal = causal;
  p.sm_scale = sm_scale;
  p.format = format;
  p.dov = dov;
  p.deterministic = deterministic ? 1 : 0;
  p.scales = scales;
  p.p_max = reinterpret_cast<const float*>(p_max);
  return p;
}

qattn_kv_cache make_cache(const CacheArg& c) {
  qattn_kv_cache k;
  qattn_kv_cache_init(&k);
  std::uintptr_t pages = 0;
  std::tie(k.format, k.heads_kv, k.head_dim, k.page_size, k.num_pages, k.max_pages_per_seq,
           k.k_smoothing, pages) = c;
  k.pages = reinterpret_cast<void*>(pages);
  return k;
}

qattn_kv_seqs make_seqs(const SeqsArg& s) {
  return {reinterpret_cast<int32_t*>(std::get<0>(s)), reinterpret_cast<int32_t*>(std::get<1>(s)),
          reinterpret_cast<float*>(std::get<2>(s)),
          reinterpret_cast<const int32_t*>(std::get<3>(s)),
          reinterpret_cast<int32_t*>(std::get<4>(s))};
}

// The decode's parameters; p.cache points at `cache`, which must outlive the call.
qattn_kv_decode_params make_decode_params(const qattn_kv_cache& cache, const SeqsArg& seqs,
                                          const TensorArg& q, const TensorArg& o,
                                          std::uintptr_t lse, int dtype, int batch, int heads_q,
                                          int nq, int causal, float sm_scale, int max_length,
                                          int num_splits) {
  qattn_kv_decode_params p;
  qattn_kv_decode_params_init(&p);
  p.cache = &cache;
  p.seqs = make_seqs(seqs);
  p.q = tensor(q);
  p.o = tensor(o);
  p.lse = reinterpret_cast<float*>(lse);
  p.dtype = dtype;
  p.batch = batch;
  p.heads_q = heads_q;
  p.nq = nq;
  p.causal = causal;
  p.sm_scale = sm_scale;
  p.max_length = max_length;
  p.num_splits = num_splits;
  return p;
}

qattn::Tensor4 tensor_of(const nb::bytes& data, int b, int h, int n, int d, const char* name) {
  qattn::Tensor4 t(b, h, n, d);
  if (data.size() != t.data.size() * sizeof(float)) {
    throw std::invalid_argument(std::string("emulated_precision_guard: ") + name + " holds " +
                                std::to_string(data.size()) + " bytes; expected " +
                                std::to_string(t.data.size() * sizeof(float)));
  }
  std::memcpy(t.data.data(), data.c_str(), data.size());
  return t;
}

nb::bytes float_bytes(const qattn::Tensor4& t) {
  return nb::bytes(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
}

// The accuracy report's input family of that name (emulate/synthetic.h).
qattn::emulate::InputFamily input_family(const std::string& name) {
  using qattn::emulate::InputFamily;
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits, InputFamily::HeavyTail,
                        InputFamily::OutlierChannels, InputFamily::AttentionSink}) {
    if (name == qattn::emulate::family_name(f)) return f;
  }
  throw std::invalid_argument("synthetic_inputs: unknown family '" + name +
                              "'; allowed: gaussian, large_logits, heavy_tail, "
                              "outlier_channels, attention_sink");
}

// What emulated_attention computes for a mode name: a precision mode of
// src/emulate/precision.h, or one of the candidate bases for "auto" that bench/NOTES.md
// v33h measures, the kernel's INT8 Q·Kᵀ with another P·V: "int8qk_fp16pv"
// (SageAttention1's: P̃ and V in the 16-bit type) and "int8qk_int8pv" (P̃·127 and V per
// channel in INT8, an exact INT32 MMA).
struct EmulatedMode {
  qattn::emulate::Precision precision = qattn::emulate::Precision::Fast;
  std::optional<qattn::emulate::Sage2Options> options;  // set for a candidate base
};

EmulatedMode emulated_mode(const std::string& name, bool bf16) {
  using qattn::emulate::Precision;
  using qattn::emulate::PvFormat;
  if (name == "fast") return {Precision::Fast, {}};
  if (name == "auto") return {Precision::Auto, {}};
  if (name == "precise") return {Precision::Precise, {}};
  if (name == "int8qk_fp16pv" || name == "int8qk_int8pv") {
    qattn::emulate::Sage2Options o = qattn::emulate::fast_options();
    o.pv_format = name == "int8qk_int8pv" ? PvFormat::Int8 : bf16 ? PvFormat::Bf16 : PvFormat::Fp16;
    return {Precision::Fast, o};
  }
  throw std::invalid_argument("emulated_attention: precision '" + name +
                              "'; allowed: fast, auto, precise, int8qk_fp16pv, int8qk_int8pv");
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "qattn C ABI with raw pointers (no PyTorch inside)";

  m.def("version", [] { return std::string(qattn_version_string()); });
  m.def("built_with_cuda", [] { return qattn_built_with_cuda() != 0; });
  m.def(
      "device_supported", [](int device) { return qattn_device_supported(device) != 0; },
      "device"_a = -1, "True when the CUDA device (-1: current) can run the kernels.");
  m.def("last_error_message", [] { return std::string(qattn_last_error_message()); });
  m.def("status_string",
        [](int s) { return std::string(qattn_status_string(static_cast<qattn_status>(s))); });

  m.def(
      "workspace_size",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         std::uintptr_t lse, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int granularity, const MaskArg& mask, int scheme, const VarlenArg& varlen,
         int head_dim_v, std::uintptr_t p_max) {
        const qattn_fwd_params p = make_params(q, k, v, o, lse, dtype, shape, causal, sm_scale,
                                               granularity, mask, scheme, varlen, head_dim_v,
                                               p_max);
        std::size_t bytes = 0;
        const int status = qattn_fwd_workspace_size(&p, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dtype"_a, "shape"_a, "causal"_a, "sm_scale"_a,
      "granularity"_a, "mask"_a = kNoMask, "scheme"_a = int{QATTN_SCHEME_SAGE2_8B},
      "varlen"_a = kNotPacked, "head_dim_v"_a = 0, "p_max"_a = std::uintptr_t{0},
      "Validates the parameters; returns (status, workspace bytes). scheme: a qattn_scheme. "
      "p_max: a device pointer to (B, Hq, Nq) float32 for P's row maxima, written by the "
      "SageAttention2-8b family outside a packed batch (0: not written; another family "
      "declines a call that sets it). "
      "head_dim_v: V's and O's head dim when it is below shape's head_dim (0: the same). "
      "varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed batch, "
      "the arrays device int32 pointers; default not packed. "
      "mask: (kv_lengths, "
      "window_left, window_right, alignment, attn_mask, attn_mask_stride_b, "
      "attn_mask_stride_h, attn_mask_stride_q, attn_mask_stride_k), attn_mask a device "
      "pointer to one byte per (query, key), nonzero = visible, strides in bytes (0 "
      "broadcasts), 0 = none; default no mask beyond causal.");

  m.def(
      "forward",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         std::uintptr_t lse, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int granularity, std::uintptr_t workspace, std::uint64_t workspace_bytes,
         std::uintptr_t stream, bool attention_only, const MaskArg& mask, int scheme,
         const VarlenArg& varlen, bool check_pointers, bool checks_only, int head_dim_v,
         std::uintptr_t p_max) {
        const qattn_fwd_params p = make_params(q, k, v, o, lse, dtype, shape, causal, sm_scale,
                                               granularity, mask, scheme, varlen, head_dim_v,
                                               p_max);
        auto* ws = reinterpret_cast<void*>(workspace);
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        if (checks_only) return static_cast<int>(qattn_fwd_checks_only(&p, ws, workspace_bytes));
        if (attention_only) return static_cast<int>(qattn_fwd_attention_only(&p, ws, workspace_bytes, st));
        return static_cast<int>(check_pointers
                                    ? qattn_fwd(&p, ws, workspace_bytes, st)
                                    : qattn_fwd_pointers_unchecked(&p, ws, workspace_bytes, st));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dtype"_a, "shape"_a, "causal"_a, "sm_scale"_a,
      "granularity"_a, "workspace"_a, "workspace_bytes"_a, "stream"_a, "attention_only"_a = false,
      "mask"_a = kNoMask, "scheme"_a = int{QATTN_SCHEME_SAGE2_8B}, "varlen"_a = kNotPacked,
      "check_pointers"_a = true, "checks_only"_a = false, "head_dim_v"_a = 0,
      "p_max"_a = std::uintptr_t{0},
      "Enqueues the forward on the stream (a cudaStream_t as an int); returns the status. "
      "mask, varlen, head_dim_v and p_max as for workspace_size. Bench hooks (src/api/bench_hooks.h): "
      "check_pointers=False skips the buffers' allocation queries "
      "(qattn_fwd_pointers_unchecked); checks_only=True makes every check and enqueues "
      "nothing (qattn_fwd_checks_only).");

  m.def(
      "bwd_workspace_size",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         const TensorArg& dout, std::uintptr_t lse, const TensorArg& dq, const TensorArg& dk,
         const TensorArg& dv, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int format, int dov, bool deterministic, int scales, std::uintptr_t p_max) {
        const qattn_bwd_params p =
            make_bwd_params(q, k, v, o, dout, lse, dq, dk, dv, dtype, shape, causal, sm_scale,
                            format, dov, deterministic, scales, p_max);
        std::size_t bytes = 0;
        const int status = qattn_bwd_workspace_size(&p, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "dtype"_a, "shape"_a,
      "causal"_a, "sm_scale"_a, "format"_a, "dov"_a, "deterministic"_a,
      "scales"_a = int{QATTN_BWD_SCALES_PER_BLOCK}, "p_max"_a = std::uintptr_t{0},
      "Validates the backward's parameters; returns (status, workspace bytes). scales: a "
      "qattn_bwd_scales (BWD_SCALES_PER_BLOCK, the default, or BWD_SCALES_MERGE_FREE: format "
      "BWD_E4M3 and dov BWD_DOV_16BIT only, with p_max the forward's (B, Hq, Nq) float32 row "
      "maxima as a device pointer; 0 otherwise).");

  m.def(
      "bwd",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         const TensorArg& dout, std::uintptr_t lse, const TensorArg& dq, const TensorArg& dk,
         const TensorArg& dv, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int format, int dov, bool deterministic, std::uintptr_t workspace,
         std::uint64_t workspace_bytes, std::uintptr_t stream, int scales, std::uintptr_t p_max) {
        const qattn_bwd_params p =
            make_bwd_params(q, k, v, o, dout, lse, dq, dk, dv, dtype, shape, causal, sm_scale,
                            format, dov, deterministic, scales, p_max);
        auto* ws = reinterpret_cast<void*>(workspace);
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        return static_cast<int>(qattn_bwd(&p, ws, workspace_bytes, st));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "dtype"_a, "shape"_a,
      "causal"_a, "sm_scale"_a, "format"_a, "dov"_a, "deterministic"_a, "workspace"_a,
      "workspace_bytes"_a, "stream"_a, "scales"_a = int{QATTN_BWD_SCALES_PER_BLOCK},
      "p_max"_a = std::uintptr_t{0},
      "Enqueues the SageBwd backward on the stream (a cudaStream_t as an int); returns the "
      "status. scales and p_max as for bwd_workspace_size.");

  m.def(
      "kv_cache_page_bytes",
      [](const CacheArg& cache) {
        const qattn_kv_cache c = make_cache(cache);
        std::size_t bytes = 0;
        const int status = qattn_kv_cache_page_bytes(&c, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "cache"_a, "Validates the cache's format and sizes; returns (status, bytes of one page).");

  m.def(
      "kv_append",
      [](const CacheArg& cache, const SeqsArg& seqs, const TensorArg& k, const TensorArg& v,
         int dtype, int batch, int n_new, int k_mean_preset, std::uintptr_t stream) {
        const qattn_kv_cache c = make_cache(cache);
        qattn_kv_append_params p;
        qattn_kv_append_params_init(&p);
        p.cache = &c;
        p.seqs = make_seqs(seqs);
        p.k = tensor(k);
        p.v = tensor(v);
        p.dtype = dtype;
        p.batch = batch;
        p.n_new = n_new;
        p.k_mean_preset = k_mean_preset;
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        return static_cast<int>(qattn_kv_append(&p, st));
      },
      "cache"_a, "seqs"_a, "k"_a, "v"_a, "dtype"_a, "batch"_a, "n_new"_a, "k_mean_preset"_a,
      "stream"_a,
      "Enqueues the append of n_new tokens to each of `batch` sequences; returns the status "
      "(host_lengths, when given, is advanced on success).");

  m.def(
      "kv_decode_workspace_size",
      [](const CacheArg& cache, const SeqsArg& seqs, const TensorArg& q, const TensorArg& o,
         std::uintptr_t lse, int dtype, int batch, int heads_q, int nq, int causal, float sm_scale,
         int max_length, int num_splits) {
        const qattn_kv_cache c = make_cache(cache);
        const qattn_kv_decode_params p =
            make_decode_params(c, seqs, q, o, lse, dtype, batch, heads_q, nq, causal, sm_scale,
                               max_length, num_splits);
        std::size_t bytes = 0;
        const int status = qattn_kv_decode_workspace_size(&p, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "cache"_a, "seqs"_a, "q"_a, "o"_a, "lse"_a, "dtype"_a, "batch"_a, "heads_q"_a, "nq"_a,
      "causal"_a, "sm_scale"_a, "max_length"_a, "num_splits"_a,
      "Validates a decode; returns (status, workspace bytes).");

  m.def(
      "kv_decode",
      [](const CacheArg& cache, const SeqsArg& seqs, const TensorArg& q, const TensorArg& o,
         std::uintptr_t lse, int dtype, int batch, int heads_q, int nq, int causal, float sm_scale,
         int max_length, int num_splits, std::uintptr_t workspace, std::uint64_t workspace_bytes,
         std::uintptr_t stream) {
        const qattn_kv_cache c = make_cache(cache);
        const qattn_kv_decode_params p =
            make_decode_params(c, seqs, q, o, lse, dtype, batch, heads_q, nq, causal, sm_scale,
                               max_length, num_splits);
        auto* ws = reinterpret_cast<void*>(workspace);
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        return static_cast<int>(qattn_kv_decode(&p, ws, workspace_bytes, st));
      },
      "cache"_a, "seqs"_a, "q"_a, "o"_a, "lse"_a, "dtype"_a, "batch"_a, "heads_q"_a, "nq"_a,
      "causal"_a, "sm_scale"_a, "max_length"_a, "num_splits"_a, "workspace"_a, "workspace_bytes"_a,
      "stream"_a,
      "Enqueues the decode on the stream (a cudaStream_t as an int); returns the status.");

  m.def(
      "synthetic_inputs",
      [](const std::string& family, int batch, int heads_q, int heads_kv, int seq_q, int seq_kv,
         int head_dim, std::uint64_t seed, double temperature, double large_logit_scale) {
        qattn::emulate::SyntheticSpec spec;
        spec.family = input_family(family);
        spec.batch = batch;
        spec.heads_q = heads_q;
        spec.heads_kv = heads_kv;
        spec.seq_q = seq_q;
        spec.seq_kv = seq_kv;
        spec.head_dim = head_dim;
        spec.seed = seed;
        spec.temperature = temperature;
        spec.large_logit_scale = large_logit_scale;
        const qattn::emulate::SyntheticInputs in = [&] {
          nb::gil_scoped_release release;  // CPU work of seconds at large sizes
          return qattn::emulate::make_synthetic(spec);
        }();
        return std::make_tuple(float_bytes(in.q), float_bytes(in.k), float_bytes(in.v));
      },
      "family"_a, "batch"_a, "heads_q"_a, "heads_kv"_a, "seq_q"_a, "seq_kv"_a, "head_dim"_a,
      "seed"_a = 0, "temperature"_a = 1.0,
      "large_logit_scale"_a = qattn::emulate::SyntheticSpec{}.large_logit_scale,
      "The input family's (q, k, v) of `qattn accuracy` (docs/accuracy-report.md: gaussian, "
      "large_logits, heavy_tail, outlier_channels, attention_sink), each as the bytes of a "
      "float32 (B, H, N, d) array of FP16-exact values; the same seed gives the same tensors "
      "as the CLI. A bad family or shape raises ValueError.");

  m.def(
      "emulated_precision_guard",
      [](const nb::bytes& q, const nb::bytes& k, int batch, int heads_q, int heads_kv, int seq_q,
         int seq_kv, int head_dim, double sm_scale) {
        const qattn::Tensor4 tq = tensor_of(q, batch, heads_q, seq_q, head_dim, "q");
        const qattn::Tensor4 tk = tensor_of(k, batch, heads_kv, seq_kv, head_dim, "k");
        const qattn::Tensor4 tv(batch, heads_kv, seq_kv, head_dim);  // V plays no part
        qattn::AttentionParams params;
        if (sm_scale > 0.0) params.sm_scale = sm_scale;
        nb::gil_scoped_release release;
        const auto z = qattn::emulate::quantize_sage2(tq, tk, tv, params,
                                                      qattn::emulate::fast_options());
        const auto g = qattn::emulate::precision_guard(z);
        return std::make_tuple(g.sigma_nats, g.threshold_nats);
      },
      "q"_a, "k"_a, "batch"_a, "heads_q"_a, "heads_kv"_a, "seq_q"_a, "seq_kv"_a, "head_dim"_a,
      "sm_scale"_a = 0.0,
      "The precision guard of the CPU emulation (src/emulate/precision.h) on q and k, the "
      "bytes of float32 (B, H, N, d) arrays: (sigma in nats per (batch, query head), the "
      "threshold). sm_scale 0: 1/sqrt(d).");

  m.def(
      "emulated_attention",
      [](const nb::bytes& q, const nb::bytes& k, const nb::bytes& v, int batch, int heads_q,
         int heads_kv, int seq_q, int seq_kv, int head_dim, double sm_scale, bool causal,
         const nb::bytes& mask, int mask_batch, int mask_heads, const std::string& precision,
         const std::string& dtype) {
        qattn::AttentionParams params;
        params.mask = causal ? qattn::Mask::Causal : qattn::Mask::None;
        params.alignment = qattn::Diagonal::TopLeft;  // SDPA's is_causal
        if (sm_scale > 0.0) params.sm_scale = sm_scale;
        if (mask.size() != 0)
          params.attn_mask = tensor_of(mask, mask_batch, mask_heads, seq_q, seq_kv, "mask");
        if (dtype != "fp16" && dtype != "bf16")
          throw std::invalid_argument("emulated_attention: dtype '" + dtype +
                                      "'; allowed: fp16, bf16");
        const bool bf16 = dtype == "bf16";
        const EmulatedMode mode = emulated_mode(precision, bf16);
        const qattn::Tensor4 tq = tensor_of(q, batch, heads_q, seq_q, head_dim, "q");
        const qattn::Tensor4 tk = tensor_of(k, batch, heads_kv, seq_kv, head_dim, "k");
        const qattn::Tensor4 tv = tensor_of(v, batch, heads_kv, seq_kv, head_dim, "v");
        const auto r = [&] {
          nb::gil_scoped_release release;  // CPU work of seconds
          if (mode.options) {
            qattn::emulate::PrecisionForward out;
            out.fwd = qattn::emulate::sage2_attention(tq, tk, tv, params, *mode.options);
            return out;
          }
          return qattn::emulate::attention_with_precision(
              tq, tk, tv, params, mode.precision,
              bf16 ? qattn::emulate::InputDtype::Bf16 : qattn::emulate::InputDtype::Fp16);
        }();
        return std::make_tuple(float_bytes(r.fwd.o), r.precise);
      },
      "q"_a, "k"_a, "v"_a, "batch"_a, "heads_q"_a, "heads_kv"_a, "seq_q"_a, "seq_kv"_a,
      "head_dim"_a, "sm_scale"_a, "causal"_a, "mask"_a, "mask_batch"_a, "mask_heads"_a,
      "precision"_a = "fast", "dtype"_a = "bf16",
      "The SA2-8b kernel's CPU emulation in a precision mode (fast, auto, precise; "
      "src/emulate/precision.h) or a candidate base for auto (int8qk_fp16pv, int8qk_int8pv) on float32 (B, H, N, d) bytes; causal is top-left (SDPA's); "
      "mask: empty, or the float32 bytes of an additive (mask_batch, mask_heads, Nq, Nkv) "
      "mask (-inf hides a key), broadcast over batch and heads where 1. Returns (O as "
      "float32 bytes, per (batch, head) 1 where the head ran precise).");

  m.attr("OK") = static_cast<int>(QATTN_OK);
  m.attr("ERROR_INVALID_ARGUMENT") = static_cast<int>(QATTN_ERROR_INVALID_ARGUMENT);
  m.attr("ERROR_UNSUPPORTED") = static_cast<int>(QATTN_ERROR_UNSUPPORTED);
  m.attr("ERROR_NO_DEVICE") = static_cast<int>(QATTN_ERROR_NO_DEVICE);
  m.attr("ERROR_WORKSPACE_TOO_SMALL") = static_cast<int>(QATTN_ERROR_WORKSPACE_TOO_SMALL);
  m.attr("ERROR_CUDA") = static_cast<int>(QATTN_ERROR_CUDA);
  m.attr("ERROR_INTERNAL") = static_cast<int>(QATTN_ERROR_INTERNAL);
  m.attr("DTYPE_FP16") = static_cast<int>(QATTN_DTYPE_FP16);
  m.attr("DTYPE_BF16") = static_cast<int>(QATTN_DTYPE_BF16);
  m.attr("ALIGN_BOTTOM_RIGHT") = static_cast<int>(QATTN_ALIGN_BOTTOM_RIGHT);
  m.attr("ALIGN_TOP_LEFT") = static_cast<int>(QATTN_ALIGN_TOP_LEFT);
  m.attr("BWD_INT8") = static_cast<int>(QATTN_BWD_INT8);
  m.attr("BWD_E4M3") = static_cast<int>(QATTN_BWD_E4M3);
  m.attr("BWD_DOV_16BIT") = static_cast<int>(QATTN_BWD_DOV_16BIT);
  m.attr("BWD_DOV_QUANTIZED") = static_cast<int>(QATTN_BWD_DOV_QUANTIZED);
  m.attr("BWD_SCALES_PER_BLOCK") = static_cast<int>(QATTN_BWD_SCALES_PER_BLOCK);
  m.attr("BWD_SCALES_MERGE_FREE") = static_cast<int>(QATTN_BWD_SCALES_MERGE_FREE);
  m.attr("KV_NVFP4") = static_cast<int>(QATTN_KV_NVFP4);
  m.attr("KV_FP8_E4M3") = static_cast<int>(QATTN_KV_FP8_E4M3);
  m.attr("KV_INT8") = static_cast<int>(QATTN_KV_INT8);
  m.attr("KV_BF16") = static_cast<int>(QATTN_KV_BF16);
  m.attr("KV_SMOOTH_PREFILL_MEAN") = static_cast<int>(QATTN_KV_SMOOTH_PREFILL_MEAN);
  m.attr("KV_SMOOTH_NONE") = static_cast<int>(QATTN_KV_SMOOTH_NONE);
  m.attr("KV_MAX_QUERY_TOKENS") = QATTN_KV_MAX_QUERY_TOKENS;
  m.attr("KV_MAX_SPLITS") = QATTN_KV_MAX_SPLITS;
  m.attr("MASK_NONE") = int{QATTN_MASK_NONE};
  m.attr("MASK_BOOL") = int{QATTN_MASK_BOOL};
  m.attr("MASK_ADDITIVE") = int{QATTN_MASK_ADDITIVE};
  m.attr("SCHEME_SAGE2_8B") = int{QATTN_SCHEME_SAGE2_8B};
  m.attr("SCHEME_SAGE3_NVFP4") = int{QATTN_SCHEME_SAGE3_NVFP4};
  m.attr("SCHEME_PRECISE16") = int{QATTN_SCHEME_PRECISE16};
  m.attr("SCHEME_SAGE2_8B_AUTO") = int{QATTN_SCHEME_SAGE2_8B_AUTO};
}
