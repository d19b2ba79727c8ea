// The one dispatch point: which kernel family runs a call. A family is chosen by
// (scheme, architecture, head dim, input format, mask) and its further limits; the
// first family in forward_families() that accepts the call runs it. When none does,
// the message names every family considered and why each declined.
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

// The family that runs validated parameters `p` on `arch` (nullptr: any architecture).
// On failure returns nullptr and records QATTN_ERROR_UNSUPPORTED with a message that
// starts with `fn` and lists each of `families` with its reason.
const ForwardFamily* select_family(const char* fn, const qattn_fwd_params& p, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const ForwardFamily* const> families =
                                       forward_families());

// Workspace bytes for validated parameters: the largest need among the families that
// accept the call on some architecture (so the size holds on any supported device);
// 0 when none does.
std::size_t workspace_bytes_for(const qattn_fwd_params& p,
                                std::span<const ForwardFamily* const> families =
                                    forward_families());

// True when some family runs on `arch` (for qattn_device_supported).
bool arch_supported(const Arch& arch,
                    std::span<const ForwardFamily* const> families = forward_families());

}  // namespace qattn::api
