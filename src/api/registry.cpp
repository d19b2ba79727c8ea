#include "api/registry.h"

#include <algorithm>

#include "api/error.h"

namespace qattn::api {
namespace {

const char* dtype_name(int32_t d) {
  return d == QATTN_DTYPE_FP16 ? "fp16" : d == QATTN_DTYPE_BF16 ? "bf16" : "?";
}

std::string arch_list(std::span<const Arch> archs) {
  std::string s;
  for (const Arch& a : archs) s += cat(s.empty() ? "" : ", ", "sm_", a.major, a.minor);
  return s.empty() ? "none" : s;
}

}  // namespace

std::string decline_reason(const ForwardFamily& f, const qattn_fwd_params& p, const Arch* arch) {
  if (p.scheme != f.scheme) return cat("implements scheme ", f.scheme, ", not ", p.scheme);
  if (p.dtype < 0 || p.dtype >= 32 || (f.dtypes & (1u << p.dtype)) == 0)
    return cat("does not read ", dtype_name(p.dtype), " inputs");
  const uint32_t mask = p.causal != 0 ? kMaskCausal : kMaskNone;
  if ((f.masks & mask) == 0) return cat("has no ", p.causal != 0 ? "causal" : "unmasked", " kernel");
  if (p.head_dim < f.min_head_dim || p.head_dim > f.max_head_dim)
    return cat("head_dim = ", p.head_dim, " is not supported yet; allowed: ", f.min_head_dim, "..",
               f.max_head_dim);
  if (arch != nullptr && std::find(f.archs.begin(), f.archs.end(), *arch) == f.archs.end())
    return cat("the device has compute capability ", arch->major, ".", arch->minor,
               "; its kernels run on ", arch_list(f.archs));
  if (f.check_limits != nullptr) return f.check_limits(p);
  return {};
}

const ForwardFamily* select_family(const char* fn, const qattn_fwd_params& p, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const ForwardFamily* const> families) {
  std::string reasons;
  for (const ForwardFamily* f : families) {
    std::string why = decline_reason(*f, p, arch);
    if (why.empty()) {
      *status = QATTN_OK;
      return f;
    }
    reasons += cat("; ", f->name, ": ", why);
  }
  const std::string device =
      arch != nullptr ? cat("; device sm_", arch->major, arch->minor) : std::string(" (any device)");
  *status = fail(QATTN_ERROR_UNSUPPORTED, fn, ": no kernel family runs this call (scheme ",
                 p.scheme, ", ", dtype_name(p.dtype), ", head_dim ", p.head_dim,
                 p.causal != 0 ? ", causal" : ", no mask", device, "); considered ",
                 families.size(), families.empty() ? "" : reasons.c_str());
  return nullptr;
}

std::size_t workspace_bytes_for(const qattn_fwd_params& p,
                                std::span<const ForwardFamily* const> families) {
  std::size_t bytes = 0;
  for (const ForwardFamily* f : families)
    if (decline_reason(*f, p, nullptr).empty()) bytes = std::max(bytes, f->workspace_bytes(p));
  return bytes;
}

bool arch_supported(const Arch& arch, std::span<const ForwardFamily* const> families) {
  for (const ForwardFamily* f : families)
    if (f->launch != nullptr && std::find(f->archs.begin(), f->archs.end(), arch) != f->archs.end())
      return true;
  return false;
}

}  // namespace qattn::api
