// The extern "C" functions of qattn.h (and bench_hooks.h): read the caller's struct,
// validate everything, pick the kernel family for the device, then launch — the same
// sequence for the forward and the backward. Nothing here throws across the ABI: the
// only allocation that can throw is the error message itself, and a failure there
// becomes QATTN_ERROR_INTERNAL.
#include <cstring>
#include <exception>

#include "api/bench_hooks.h"
#include "api/device.h"
#include "api/error.h"
#include "api/registry.h"
#include "api/validate.h"
#include "api/validate_kv.h"
#include "api/validate_merge.h"
#include "qattn/qattn.h"

namespace {

using qattn::api::ForwardPart;

#define QATTN_STRINGIFY_(x) #x
#define QATTN_STRINGIFY(x) QATTN_STRINGIFY_(x)
constexpr const char* kVersion = QATTN_STRINGIFY(QATTN_VERSION_MAJOR) "." QATTN_STRINGIFY(
    QATTN_VERSION_MINOR) "." QATTN_STRINGIFY(QATTN_VERSION_PATCH);

template <typename F>
qattn_status guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    try {
      qattn::api::set_last_error(e.what());
    } catch (...) {
    }
    return QATTN_ERROR_INTERNAL;
  } catch (...) {
    return QATTN_ERROR_INTERNAL;
  }
}

qattn_status validate(const char* fn, const qattn_fwd_params& p) {
  return qattn::api::validate_forward(fn, p);
}
qattn_status validate(const char* fn, const qattn_bwd_params& p) {
  return qattn::api::validate_backward(fn, p);
}

// Whether a call checks its pointers' allocations (every public entry point does; a
// bench hook times a call without them).
enum class PointerChecks { kCheck, kSkip };

// One call of either direction: read the caller's struct, validate it and the
// workspace, find the device and the family that runs the call there, check the
// pointers, launch. `launch(family, params, workspace)` enqueues and returns a
// cudaError_t; nothing is launched before every check has passed.
template <typename Params, typename Launch>
qattn_status run(const char* fn, const Params* caller, void* workspace, size_t workspace_bytes,
                 Launch&& launch, PointerChecks pointers = PointerChecks::kCheck) {
  return guarded([&] {
    namespace api = qattn::api;
    Params p;
    if (auto s = api::read_params(fn, caller, &p); s != QATTN_OK) return s;
    if (auto s = validate(fn, p); s != QATTN_OK) return s;
    if (auto s = api::validate_workspace(fn, p, workspace, workspace_bytes); s != QATTN_OK)
      return s;
    int device = 0;
    api::Arch arch;
    if (auto s = api::current_device(fn, &device, &arch); s != QATTN_OK) return s;
    qattn_status s = QATTN_OK;
    const auto* family = api::select_family(fn, p, &arch, &s);
    if (family == nullptr) return s;
    if (family->launch == nullptr)  // a family declared without its kernels in this build
      return api::fail(QATTN_ERROR_NO_DEVICE, fn, ": ", family->name,
                       " has no kernels in this build of qattn");
    if (pointers == PointerChecks::kCheck)
      if (s = api::check_pointers(fn, api::buffer_spans(p, workspace), device); s != QATTN_OK)
        return s;
    return api::launch_status(fn, family->name,
                              launch(*family, api::resolve_defaults(p), workspace));
  });
}

qattn_status forward(const char* fn, const qattn_fwd_params* caller, void* workspace,
                     size_t workspace_bytes, void* stream, ForwardPart part,
                     PointerChecks pointers = PointerChecks::kCheck) {
  return run(
      fn, caller, workspace, workspace_bytes,
      [&](const qattn::api::ForwardFamily& f, const qattn_fwd_params& p, void* ws) {
        return f.launch(p, ws, stream, part);
      },
      pointers);
}

// The workspace size of either direction: validates the parameters, no device.
template <typename Params>
qattn_status workspace_size(const char* fn, const Params* caller, size_t* bytes) {
  return guarded([&] {
    if (bytes == nullptr)
      return qattn::api::fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": bytes is NULL");
    Params full;
    if (auto s = qattn::api::read_params(fn, caller, &full); s != QATTN_OK) return s;
    if (auto s = validate(fn, full); s != QATTN_OK) return s;
    *bytes = qattn::api::workspace_bytes_for(full);
    return QATTN_OK;
  });
}

// One KV-cache call: read and validate it (kernels checked in `read`), find the device
// and the family, check the pointers, launch. `read(params, cache)` validates;
// `launch(family, params, cache)` enqueues and returns a cudaError_t.
template <typename Params, typename Read, typename Spans, typename Launch>
qattn_status run_kv(const char* fn, const Params* caller, bool decode, Read&& read, Spans&& spans,
                    Launch&& launch) {
  return guarded([&] {
    namespace api = qattn::api;
    Params p;
    qattn_kv_cache cache;
    if (auto s = read(caller, &p, &cache); s != QATTN_OK) return s;
    int device = 0;
    api::Arch arch;
    if (auto s = api::current_device(fn, &device, &arch); s != QATTN_OK) return s;
    int32_t nq = 0, causal = 0;
    if constexpr (requires { p.nq; }) {
      nq = p.nq;
      causal = p.causal;
    }
    const api::KvCall call{cache.format, p.dtype, cache.head_dim, nq, causal, decode};
    qattn_status s = QATTN_OK;
    const auto* family = api::select_family(fn, call, &arch, &s);
    if (family == nullptr) return s;
    if ((decode ? (void*)family->launch_decode : (void*)family->launch_append) == nullptr)
      return api::fail(QATTN_ERROR_NO_DEVICE, fn, ": ", family->name,
                       " has no kernels in this build of qattn");
    const auto buffers = spans(p, cache);
    if (s = api::check_pointers(fn, buffers, device); s != QATTN_OK) return s;
    return api::launch_status(fn, family->name, launch(*family, p, cache));
  });
}

}  // namespace

extern "C" {

void qattn_fwd_params_init(qattn_fwd_params* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->dtype = QATTN_DTYPE_BF16;
  p->scheme = QATTN_SCHEME_SAGE2_8B;
  p->sage2.granularity = QATTN_QK_PER_THREAD;
  p->causal = 0;
  p->sm_scale = 0.f;
  p->kv_lengths = nullptr;
  p->window_left = -1;
  p->window_right = -1;
}

qattn_status qattn_fwd_workspace_size(const qattn_fwd_params* p, size_t* bytes) {
  return workspace_size("qattn_fwd_workspace_size", p, bytes);
}

qattn_status qattn_fwd(const qattn_fwd_params* p, void* workspace, size_t workspace_bytes,
                       void* stream) {
  return forward("qattn_fwd", p, workspace, workspace_bytes, stream, ForwardPart::kAll);
}

qattn_status qattn_fwd_attention_only(const qattn_fwd_params* p, void* workspace,
                                      size_t workspace_bytes, void* stream) {
  return forward("qattn_fwd_attention_only", p, workspace, workspace_bytes, stream,
                 ForwardPart::kAttentionOnly);
}

qattn_status qattn_fwd_pointers_unchecked(const qattn_fwd_params* p, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  return forward("qattn_fwd_pointers_unchecked", p, workspace, workspace_bytes, stream,
                 ForwardPart::kAll, PointerChecks::kSkip);
}

qattn_status qattn_fwd_checks_only(const qattn_fwd_params* p, void* workspace,
                                   size_t workspace_bytes) {
  return run("qattn_fwd_checks_only", p, workspace, workspace_bytes,
             [](const qattn::api::ForwardFamily&, const qattn_fwd_params&, void*) {
               return 0;  // cudaSuccess: everything but the enqueue
             });
}

void qattn_bwd_params_init(qattn_bwd_params* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->dtype = QATTN_DTYPE_BF16;
  p->causal = 0;
  p->sm_scale = 0.f;
  p->format = QATTN_BWD_INT8;
  p->dov = QATTN_BWD_DOV_16BIT;
  p->deterministic = 0;
}

qattn_status qattn_bwd_workspace_size(const qattn_bwd_params* p, size_t* bytes) {
  return workspace_size("qattn_bwd_workspace_size", p, bytes);
}

qattn_status qattn_bwd(const qattn_bwd_params* p, void* workspace, size_t workspace_bytes,
                       void* stream) {
  return run("qattn_bwd", p, workspace, workspace_bytes,
             [&](const qattn::api::BackwardFamily& f, const qattn_bwd_params& rp, void* ws) {
               return f.launch(rp, ws, stream);
             });
}

void qattn_kv_cache_init(qattn_kv_cache* c) {
  if (c == nullptr) return;
  std::memset(c, 0, sizeof(*c));
  c->struct_size = sizeof(*c);
  c->format = QATTN_KV_NVFP4;
  c->heads_kv = 1;
  c->head_dim = 128;
  c->page_size = 16;
  c->k_smoothing = QATTN_KV_SMOOTH_PREFILL_MEAN;
}

qattn_status qattn_kv_cache_page_bytes(const qattn_kv_cache* c, size_t* page_bytes) {
  constexpr const char* kFn = "qattn_kv_cache_page_bytes";
  return guarded([&] {
    if (page_bytes == nullptr)
      return qattn::api::fail(QATTN_ERROR_INVALID_ARGUMENT, kFn, ": page_bytes is NULL");
    qattn_kv_cache full;
    if (auto s = qattn::api::read_cache(kFn, c, &full, /*need_pages=*/false); s != QATTN_OK)
      return s;
    *page_bytes = qattn::api::kv_page_bytes(full);
    return QATTN_OK;
  });
}

void qattn_kv_append_params_init(qattn_kv_append_params* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->dtype = QATTN_DTYPE_BF16;
}

qattn_status qattn_kv_append(const qattn_kv_append_params* p, void* stream) {
  constexpr const char* kFn = "qattn_kv_append";
  return run_kv(
      kFn, p, /*decode=*/false,
      [&](const qattn_kv_append_params* in, qattn_kv_append_params* out, qattn_kv_cache* c) {
        return qattn::api::read_append(kFn, in, out, c);
      },
      [](const qattn_kv_append_params& rp, const qattn_kv_cache& c) {
        return qattn::api::buffer_spans(rp, c);
      },
      [&](const qattn::api::KvCacheFamily& f, qattn_kv_append_params& rp, qattn_kv_cache& c) {
        rp.cache = &c;
        const int err = f.launch_append(rp, c, stream);
        // The host mirror follows the device lengths, in call order.
        if (err == 0 && rp.seqs.host_lengths != nullptr)
          for (int32_t b = 0; b < rp.batch; ++b) rp.seqs.host_lengths[b] += rp.n_new;
        return err;
      });
}

void qattn_merge_params_init(qattn_merge_params* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->dtype = QATTN_DTYPE_BF16;
}

qattn_status qattn_merge(const qattn_merge_params* caller, void* stream) {
  constexpr const char* kFn = "qattn_merge";
  return guarded([&] {
    namespace api = qattn::api;
    qattn_merge_params p;
    if (auto s = api::read_merge(kFn, caller, &p); s != QATTN_OK) return s;
    int device = 0;
    api::Arch arch;
    if (auto s = api::current_device(kFn, &device, &arch); s != QATTN_OK) return s;
    qattn_status s = QATTN_OK;
    const auto* family = api::select_family(kFn, arch, &s);
    if (family == nullptr) return s;
    if (family->launch == nullptr)
      return api::fail(QATTN_ERROR_NO_DEVICE, kFn, ": ", family->name,
                       " has no kernels in this build of qattn");
    if (s = api::check_pointers(kFn, api::buffer_spans(p), device); s != QATTN_OK) return s;
    return api::launch_status(kFn, family->name, family->launch(p, stream));
  });
}

void qattn_kv_decode_params_init(qattn_kv_decode_params* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->dtype = QATTN_DTYPE_BF16;
  p->nq = 1;
  p->causal = 1;
}

qattn_status qattn_kv_decode_workspace_size(const qattn_kv_decode_params* p, size_t* bytes) {
  constexpr const char* kFn = "qattn_kv_decode_workspace_size";
  return guarded([&] {
    if (bytes == nullptr)
      return qattn::api::fail(QATTN_ERROR_INVALID_ARGUMENT, kFn, ": bytes is NULL");
    qattn_kv_decode_params full;
    qattn_kv_cache cache;
    int32_t splits = 1;
    if (auto s = qattn::api::read_decode(kFn, p, &full, &cache, &splits); s != QATTN_OK) return s;
    *bytes = qattn::api::decode_workspace_bytes(full, cache, splits);
    return QATTN_OK;
  });
}

qattn_status qattn_kv_decode(const qattn_kv_decode_params* p, void* workspace,
                             size_t workspace_bytes, void* stream) {
  constexpr const char* kFn = "qattn_kv_decode";
  int32_t splits = 1;
  return run_kv(
      kFn, p, /*decode=*/true,
      [&](const qattn_kv_decode_params* in, qattn_kv_decode_params* out, qattn_kv_cache* c) {
        if (auto s = qattn::api::read_decode(kFn, in, out, c, &splits); s != QATTN_OK) return s;
        return qattn::api::validate_decode_workspace(kFn, *out, *c, splits, workspace,
                                                     workspace_bytes);
      },
      [&](const qattn_kv_decode_params& rp, const qattn_kv_cache& c) {
        return qattn::api::buffer_spans(rp, c, splits, workspace);
      },
      [&](const qattn::api::KvCacheFamily& f, qattn_kv_decode_params& rp, qattn_kv_cache& c) {
        rp.cache = &c;
        return f.launch_decode(qattn::api::resolve_defaults(rp, c), c, splits, workspace, stream);
      });
}

const char* qattn_last_error_message(void) { return qattn::api::last_error(); }

const char* qattn_status_string(qattn_status s) {
  switch (s) {
    case QATTN_OK:
      return "QATTN_OK";
    case QATTN_ERROR_INVALID_ARGUMENT:
      return "QATTN_ERROR_INVALID_ARGUMENT";
    case QATTN_ERROR_UNSUPPORTED:
      return "QATTN_ERROR_UNSUPPORTED";
    case QATTN_ERROR_NO_DEVICE:
      return "QATTN_ERROR_NO_DEVICE";
    case QATTN_ERROR_WORKSPACE_TOO_SMALL:
      return "QATTN_ERROR_WORKSPACE_TOO_SMALL";
    case QATTN_ERROR_CUDA:
      return "QATTN_ERROR_CUDA";
    case QATTN_ERROR_INTERNAL:
      return "QATTN_ERROR_INTERNAL";
  }
  return "QATTN_ERROR_UNKNOWN";
}

int qattn_device_supported(int device) {
  try {
    return qattn::api::device_supported(device) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int qattn_built_with_cuda(void) { return QATTN_HAVE_CUDA ? 1 : 0; }

const char* qattn_version_string(void) { return kVersion; }

}  // extern "C"
