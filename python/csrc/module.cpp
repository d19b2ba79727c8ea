// qattn._C: the C ABI for Python, with raw integers for pointers, strides and the
// stream. It knows nothing of PyTorch (the torch integration is pure Python in
// qattn/ops.py), so one build works with any PyTorch version.
//
// A tensor is passed as (data_ptr, stride_b, stride_h, stride_n) in elements, the
// shape as (batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim); the backward
// (bwd_workspace_size, bwd) takes the same forms for its tensors. Calls return
// the qattn_status as an int; qattn/ops.py turns a failure into an exception with
// last_error_message(), read on the same thread right after the call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <tuple>

#include "../../src/api/bench_hooks.h"  // qattn_fwd_attention_only, for the bench tools
#include "qattn/qattn.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using TensorArg = std::tuple<std::uintptr_t, int64_t, int64_t, int64_t>;
using ShapeArg = std::tuple<int, int, int, int, int, int>;

qattn_tensor tensor(const TensorArg& t) {
  return {reinterpret_cast<void*>(std::get<0>(t)), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
}

qattn_fwd_params make_params(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                             const TensorArg& o, std::uintptr_t lse, int dtype,
                             const ShapeArg& shape, int causal, float sm_scale, int granularity) {
  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.q = tensor(q);
  p.k = tensor(k);
  p.v = tensor(v);
  p.o = tensor(o);
  p.lse = reinterpret_cast<float*>(lse);
  p.dtype = dtype;
  std::tie(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim) = shape;
  p.causal = causal;
  p.sm_scale = sm_scale;
  p.sage2.granularity = granularity;
  return p;
}

// The backward's parameters; lse is the forward's (B, Hq, Nq) FP32 natural-log LSE.
qattn_bwd_params make_bwd_params(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                 const TensorArg& o, const TensorArg& dout, std::uintptr_t lse,
                                 const TensorArg& dq, const TensorArg& dk, const TensorArg& dv,
                                 int dtype, const ShapeArg& shape, int causal, float sm_scale,
                                 int format, int dov, bool deterministic) {
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
  return p;
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
         int granularity) {
        const qattn_fwd_params p =
            make_params(q, k, v, o, lse, dtype, shape, causal, sm_scale, granularity);
        std::size_t bytes = 0;
        const int status = qattn_fwd_workspace_size(&p, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dtype"_a, "shape"_a, "causal"_a, "sm_scale"_a,
      "granularity"_a, "Validates the parameters; returns (status, workspace bytes).");

  m.def(
      "forward",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         std::uintptr_t lse, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int granularity, std::uintptr_t workspace, std::uint64_t workspace_bytes,
         std::uintptr_t stream, bool attention_only) {
        const qattn_fwd_params p =
            make_params(q, k, v, o, lse, dtype, shape, causal, sm_scale, granularity);
        auto* ws = reinterpret_cast<void*>(workspace);
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        return static_cast<int>(attention_only
                                    ? qattn_fwd_attention_only(&p, ws, workspace_bytes, st)
                                    : qattn_fwd(&p, ws, workspace_bytes, st));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "dtype"_a, "shape"_a, "causal"_a, "sm_scale"_a,
      "granularity"_a, "workspace"_a, "workspace_bytes"_a, "stream"_a, "attention_only"_a = false,
      "Enqueues the forward on the stream (a cudaStream_t as an int); returns the status.");

  m.def(
      "bwd_workspace_size",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         const TensorArg& dout, std::uintptr_t lse, const TensorArg& dq, const TensorArg& dk,
         const TensorArg& dv, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int format, int dov, bool deterministic) {
        const qattn_bwd_params p = make_bwd_params(q, k, v, o, dout, lse, dq, dk, dv, dtype, shape,
                                                   causal, sm_scale, format, dov, deterministic);
        std::size_t bytes = 0;
        const int status = qattn_bwd_workspace_size(&p, &bytes);
        return std::make_tuple(status, static_cast<std::uint64_t>(bytes));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "dtype"_a, "shape"_a,
      "causal"_a, "sm_scale"_a, "format"_a, "dov"_a, "deterministic"_a,
      "Validates the backward's parameters; returns (status, workspace bytes).");

  m.def(
      "bwd",
      [](const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg& o,
         const TensorArg& dout, std::uintptr_t lse, const TensorArg& dq, const TensorArg& dk,
         const TensorArg& dv, int dtype, const ShapeArg& shape, int causal, float sm_scale,
         int format, int dov, bool deterministic, std::uintptr_t workspace,
         std::uint64_t workspace_bytes, std::uintptr_t stream) {
        const qattn_bwd_params p = make_bwd_params(q, k, v, o, dout, lse, dq, dk, dv, dtype, shape,
                                                   causal, sm_scale, format, dov, deterministic);
        auto* ws = reinterpret_cast<void*>(workspace);
        auto* st = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;  // an enqueue; other Python threads may run
        return static_cast<int>(qattn_bwd(&p, ws, workspace_bytes, st));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "dtype"_a, "shape"_a,
      "causal"_a, "sm_scale"_a, "format"_a, "dov"_a, "deterministic"_a, "workspace"_a,
      "workspace_bytes"_a, "stream"_a,
      "Enqueues the SageBwd backward on the stream (a cudaStream_t as an int); returns the "
      "status.");

  m.attr("OK") = static_cast<int>(QATTN_OK);
  m.attr("ERROR_INVALID_ARGUMENT") = static_cast<int>(QATTN_ERROR_INVALID_ARGUMENT);
  m.attr("ERROR_UNSUPPORTED") = static_cast<int>(QATTN_ERROR_UNSUPPORTED);
  m.attr("ERROR_NO_DEVICE") = static_cast<int>(QATTN_ERROR_NO_DEVICE);
  m.attr("ERROR_WORKSPACE_TOO_SMALL") = static_cast<int>(QATTN_ERROR_WORKSPACE_TOO_SMALL);
  m.attr("ERROR_CUDA") = static_cast<int>(QATTN_ERROR_CUDA);
  m.attr("ERROR_INTERNAL") = static_cast<int>(QATTN_ERROR_INTERNAL);
  m.attr("DTYPE_FP16") = static_cast<int>(QATTN_DTYPE_FP16);
  m.attr("DTYPE_BF16") = static_cast<int>(QATTN_DTYPE_BF16);
  m.attr("BWD_INT8") = static_cast<int>(QATTN_BWD_INT8);
  m.attr("BWD_E4M3") = static_cast<int>(QATTN_BWD_E4M3);
  m.attr("BWD_DOV_16BIT") = static_cast<int>(QATTN_BWD_DOV_16BIT);
  m.attr("BWD_DOV_QUANTIZED") = static_cast<int>(QATTN_BWD_DOV_QUANTIZED);
}
