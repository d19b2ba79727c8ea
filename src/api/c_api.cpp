// The extern "C" functions of qattn.h (and bench_hooks.h): read the caller's struct,
// validate everything, pick the kernel family for the device, then launch. Nothing here throws across the ABI: the only allocation that can throw is
// the error message itself, and a failure there becomes QATTN_ERROR_INTERNAL.
#include <cstring>
#include <exception>

#include "api/bench_hooks.h"
#include "api/device.h"
#include "api/error.h"
#include "api/registry.h"
#include "api/validate.h"
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

qattn_status forward(const char* fn, const qattn_fwd_params* caller, void* workspace,
                     size_t workspace_bytes, void* stream, ForwardPart part) {
  return guarded([&] {
    namespace api = qattn::api;
    qattn_fwd_params p;
    if (auto s = api::read_params(fn, caller, &p); s != QATTN_OK) return s;
    if (auto s = api::validate_forward(fn, p); s != QATTN_OK) return s;
    if (auto s = api::validate_workspace(fn, p, workspace, workspace_bytes); s != QATTN_OK)
      return s;
    int device = 0;
    api::Arch arch;
    if (auto s = api::current_device(fn, &device, &arch); s != QATTN_OK) return s;
    qattn_status s = QATTN_OK;
    const api::ForwardFamily* family = api::select_family(fn, p, &arch, &s);
    if (family == nullptr) return s;
    if (family->launch == nullptr)  // a family declared without its kernels in this build
      return api::fail(QATTN_ERROR_NO_DEVICE, fn, ": ", family->name,
                       " has no kernels in this build of qattn");
    if (s = api::check_pointers(fn, p, workspace, device); s != QATTN_OK) return s;
    return api::launch_status(
        fn, *family, family->launch(api::resolve_defaults(p), workspace, stream, part));
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
}

qattn_status qattn_fwd_workspace_size(const qattn_fwd_params* p, size_t* bytes) {
  return guarded([&] {
    constexpr const char* fn = "qattn_fwd_workspace_size";
    if (bytes == nullptr)
      return qattn::api::fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": bytes is NULL");
    qattn_fwd_params full;
    if (auto s = qattn::api::read_params(fn, p, &full); s != QATTN_OK) return s;
    if (auto s = qattn::api::validate_forward(fn, full); s != QATTN_OK) return s;
    *bytes = qattn::api::forward_workspace_bytes(full);
    return QATTN_OK;
  });
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
