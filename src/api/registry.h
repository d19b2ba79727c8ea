// The one dispatch point: which kernel family runs a call. A family is chosen by its
// declaration's table (forward: scheme; backward: format, dP precision, determinism;
// both: architecture, head dim, input format, mask) and its further limits; the first
// family of the list (forward_families(), backward_families()) that accepts the call
// runs it. When none does, the message names every family considered and why each
// declined. The forward and the backward share this logic (registry.cpp); only the
// table fields of their own differ.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "api/family.h"
#include "qattn/qattn.h"

namespace qattn::api {

// Why `f` does not run `p` on `arch` ("" when it does). arch == nullptr: the device is
// not known (sizing the workspace, or a CPU-only build), so the architecture is not
// checked.
std::string decline_reason(const ForwardFamily& f, const qattn_fwd_params& p, const Arch* arch);
std::string decline_reason(const BackwardFamily& f, const qattn_bwd_params& p, const Arch* arch);

// The family that runs validated parameters `p` on `arch` (nullptr: any architecture).
// On failure returns nullptr and records QATTN_ERROR_UNSUPPORTED with a message that
// starts with `fn` and lists each of `families` with its reason:
//   "<fn>: no kernel family runs this call (<the call>; device sm_90); considered N;
//    <family>: <reason>; ..."
const ForwardFamily* select_family(const char* fn, const qattn_fwd_params& p, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const ForwardFamily* const> families =
                                       forward_families());
const BackwardFamily* select_family(const char* fn, const qattn_bwd_params& p, const Arch* arch,
                                    qattn_status* status,
                                    std::span<const BackwardFamily* const> families =
                                        backward_families());

// The KV-cache family that runs an append (nq = 0, causal = 0) or a decode of a cache
// with this format, dtype and head dim; the same rules and message as above.
struct KvCall {
  int32_t format, dtype, head_dim, nq, causal;
  bool decode;
};
std::string decline_reason(const KvCacheFamily& f, const KvCall& call, const Arch* arch);
const KvCacheFamily* select_family(const char* fn, const KvCall& call, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const KvCacheFamily* const> families =
                                       kv_cache_families());

// The merge family for `arch`; on failure nullptr and QATTN_ERROR_UNSUPPORTED naming
// each family considered.
const MergeFamily* select_family(const char* fn, const Arch& arch, qattn_status* status,
                                 std::span<const MergeFamily* const> families = merge_families());

// Workspace bytes for validated parameters: the largest need among the families that
// accept the call on some architecture (so the size holds on any supported device);
// 0 when none does.
std::size_t workspace_bytes_for(const qattn_fwd_params& p,
                                std::span<const ForwardFamily* const> families =
                                    forward_families());
std::size_t workspace_bytes_for(const qattn_bwd_params& p,
                                std::span<const BackwardFamily* const> families =
                                    backward_families());

// True when some family with kernels in this build runs on `arch` (for
// qattn_device_supported, which speaks of the forward).
bool arch_supported(const Arch& arch,
                    std::span<const ForwardFamily* const> families = forward_families());
bool backward_arch_supported(const Arch& arch,
                             std::span<const BackwardFamily* const> families =
                                 backward_families());

}  // namespace qattn::api
