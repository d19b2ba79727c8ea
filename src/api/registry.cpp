#include "api/registry.h"

#include <algorithm>

#include "api/error.h"

namespace qattn::api {
namespace {

const char* dtype_name(int32_t d) {
  return d == QATTN_DTYPE_FP16 ? "fp16" : d == QATTN_DTYPE_BF16 ? "bf16" : "?";
}

const char* format_name(int32_t f) {
  return f == QATTN_BWD_INT8 ? "QATTN_BWD_INT8" : f == QATTN_BWD_E4M3 ? "QATTN_BWD_E4M3" : "?";
}

const char* kv_format_name(int32_t f) {
  return f == QATTN_KV_NVFP4      ? "QATTN_KV_NVFP4"
         : f == QATTN_KV_FP8_E4M3 ? "QATTN_KV_FP8_E4M3"
         : f == QATTN_KV_INT8     ? "QATTN_KV_INT8"
         : f == QATTN_KV_BF16     ? "QATTN_KV_BF16"
                                  : "?";
}

const char* dov_name(int32_t d) {
  return d == QATTN_BWD_DOV_16BIT       ? "QATTN_BWD_DOV_16BIT"
         : d == QATTN_BWD_DOV_QUANTIZED ? "QATTN_BWD_DOV_QUANTIZED"
                                        : "?";
}

const char* scales_name(int32_t s) {
  return s == QATTN_BWD_SCALES_PER_BLOCK     ? "QATTN_BWD_SCALES_PER_BLOCK"
         : s == QATTN_BWD_SCALES_MERGE_FREE ? "QATTN_BWD_SCALES_MERGE_FREE"
                                            : "?";
}

std::string arch_list(std::span<const Arch> archs) {
  std::string s;
  for (const Arch& a : archs) s += cat(s.empty() ? "" : ", ", "sm_", a.major, a.minor);
  return s.empty() ? "none" : s;
}

// A value's bit in one of a family's bit sets (values outside 0..31 match nothing).
bool has_bit(uint32_t set, int32_t value) {
  return value >= 0 && value < 32 && (set & (1u << value)) != 0;
}

// ---- what differs between the forward and the backward -----------------------------

// The reasons of the fields only one direction has; checked before the common table.
std::string own_reason(const ForwardFamily& f, const qattn_fwd_params& p) {
  if (p.scheme != f.scheme) return cat("implements scheme ", f.scheme, ", not ", p.scheme);
  if (head_dim_v(p) != p.head_dim) {
    if (head_dim_v(p) > p.head_dim || !f.narrower_v)
      return cat("takes V with head_dim's channels", f.narrower_v ? " or fewer" : "",
                 " only (head_dim_v = ", head_dim_v(p), ", head_dim = ", p.head_dim, ")");
    if (p.cu_seqlens_q != nullptr)
      return cat("takes head_dim_v = ", head_dim_v(p), " != head_dim = ", p.head_dim,
                 " outside a packed batch only");
  }
  if (p.p_max != nullptr && (!f.writes_p_max || p.cu_seqlens_q != nullptr))
    return f.writes_p_max ? "writes P's row maxima (p_max) outside a packed batch only"
                          : "does not write P's row maxima (p_max)";
  return {};
}

std::string own_reason(const BackwardFamily& f, const qattn_bwd_params& p) {
  if (!has_bit(f.formats, p.format))
    return cat("format ", format_name(p.format), " is not implemented by this family");
  if (!has_bit(f.dovs, p.dov))
    return cat("dov ", dov_name(p.dov),
               " (the precision of dO·Vᵀ) is not implemented by this "
               "family");
  if (!has_bit(f.scales, p.scales))
    return cat("scales ", scales_name(p.scales), " are not implemented by this family");
  if (!has_bit(f.determinism, p.deterministic))
    return p.deterministic != 0 ? "has no deterministic kernel (deterministic = 1)"
                                : "has no atomic kernel (deterministic = 0)";
  return {};
}

std::string own_reason(const KvCacheFamily& f, const KvCall& c) {
  if (!has_bit(f.formats, c.format)) return cat("does not store format ", kv_format_name(c.format));
  if (c.decode && c.nq > f.max_query_tokens)
    return cat("nq = ", c.nq, " query tokens; its decode takes at most ", f.max_query_tokens);
  return {};
}

// Whether the call has a mask to match against the family's masks: an append has none
// (a KV family's masks are those of its decode).
bool has_mask(const qattn_fwd_params&) { return true; }
bool has_mask(const qattn_bwd_params&) { return true; }
bool has_mask(const KvCall& c) { return c.decode; }

// The mask features beyond causal a forward call uses (MaskBit); the backward and the
// KV-cache calls have none of the fields.
uint32_t mask_features(const qattn_fwd_params& p) {
  uint32_t bits = 0;
  const bool window =
      p.window != 0 && (p.window_left >= 0 || (p.causal == 0 && p.window_right >= 0));
  if (window) bits |= kMaskWindow;
  if (p.kv_lengths != nullptr) bits |= kMaskKeyPadding;
  const bool varlen = p.cu_seqlens_q != nullptr;
  // In a packed batch the lengths are per sequence, on the device: any sequence may have
  // len_q != len_k, so top-left alignment matters wherever causal or a window is set.
  if (p.alignment == QATTN_ALIGN_TOP_LEFT && (varlen || p.seqlen_q != p.seqlen_kv) &&
      (p.causal != 0 || window))
    bits |= kMaskTopLeft;
  if (p.attn_mask_type == QATTN_MASK_BOOL) bits |= kMaskBool;
  if (p.attn_mask_type == QATTN_MASK_ADDITIVE) bits |= kMaskAdditive;
  if (varlen) bits |= kMaskVarlen;
  return bits;
}

// Why a family whose masks lack `missing` (bits of mask_features(p)) declines the call.
std::string features_reason(uint32_t missing, const qattn_fwd_params& p) {
  if ((missing & kMaskVarlen) != 0)
    return cat("has no packed variable-length kernel (cu_seqlens_q/cu_seqlens_k are set, ",
               p.batch, " sequences)");
  if ((missing & kMaskWindow) != 0)
    return cat("has no sliding-window kernel (window_left = ", p.window_left,
               ", window_right = ", p.window_right, ")");
  if ((missing & kMaskKeyPadding) != 0) return "has no key-padding kernel (kv_lengths is set)";
  if ((missing & kMaskBool) != 0) return "has no attn_mask kernel (attn_mask_type = QATTN_MASK_BOOL)";
  if ((missing & kMaskAdditive) != 0)
    return "has no additive attn_mask kernel (attn_mask_type = QATTN_MASK_ADDITIVE)";
  return cat("has no top-left aligned mask (alignment = QATTN_ALIGN_TOP_LEFT with seqlen_q = ",
             p.seqlen_q, " != seqlen_kv = ", p.seqlen_kv, ")");
}

// The call, in the unsupported message.
std::string describe(const qattn_fwd_params& p) {
  const uint32_t features = mask_features(p);
  return cat("scheme ", p.scheme, ", ", dtype_name(p.dtype), ", head_dim ", p.head_dim,
             head_dim_v(p) != p.head_dim ? cat(", head_dim_v ", head_dim_v(p)) : std::string(),
             p.causal != 0 ? ", causal" : ", no mask",
             (features & kMaskWindow) != 0
                 ? cat(", window (", p.window_left, ", ", p.window_right, ")")
                 : std::string(),
             (features & kMaskKeyPadding) != 0 ? ", key padding" : "",
             (features & kMaskTopLeft) != 0 ? ", top-left" : "",
             (features & kMaskBool) != 0 ? ", boolean attn_mask" : "",
             (features & kMaskAdditive) != 0 ? ", additive attn_mask" : "",
             (features & kMaskVarlen) != 0 ? ", packed variable-length batch" : "",
             p.p_max != nullptr ? ", p_max written" : "");
}

std::string describe(const qattn_bwd_params& p) {
  return cat("backward, format ", format_name(p.format), ", dov ", dov_name(p.dov), ", ",
             dtype_name(p.dtype), ", head_dim ", p.head_dim,
             p.causal != 0 ? ", causal" : ", no mask",
             p.deterministic != 0 ? ", deterministic" : "",
             p.scales == QATTN_BWD_SCALES_MERGE_FREE ? ", merge-free scales" : "");
}

std::string describe(const KvCall& c) {
  return cat(c.decode ? "KV decode, " : "KV append, ", kv_format_name(c.format), ", ",
             dtype_name(c.dtype), ", head_dim ", c.head_dim,
             c.decode ? (c.causal != 0 ? ", causal" : ", no mask") : "");
}

// ---- the shared logic --------------------------------------------------------------

template <typename Family, typename Params>
std::string reason(const Family& f, const Params& p, const Arch* arch) {
  if (std::string why = own_reason(f, p); !why.empty()) return why;
  if (!has_bit(f.dtypes, p.dtype)) return cat("does not read ", dtype_name(p.dtype), " inputs");
  const uint32_t mask = p.causal != 0 ? kMaskCausal : kMaskNone;
  if (has_mask(p) && (f.masks & mask) == 0)
    return cat("has no ", p.causal != 0 ? "causal" : "unmasked", " kernel");
  if constexpr (std::is_same_v<Params, qattn_fwd_params>)
    if (const uint32_t missing = mask_features(p) & ~f.masks; missing != 0)
      return features_reason(missing, p);
  if (p.head_dim < f.min_head_dim || p.head_dim > f.max_head_dim)
    return cat("head_dim = ", p.head_dim, " is not supported yet; allowed: ", f.min_head_dim, "..",
               f.max_head_dim);
  if (arch != nullptr && std::find(f.archs.begin(), f.archs.end(), *arch) == f.archs.end())
    return cat("the device has compute capability ", arch->major, ".", arch->minor,
               "; its kernels run on ", arch_list(f.archs));
  if constexpr (requires { f.check_limits; })
    if (f.check_limits != nullptr) return f.check_limits(p);
  return {};
}

template <typename Family, typename Params>
const Family* select(const char* fn, const Params& p, const Arch* arch, qattn_status* status,
                     std::span<const Family* const> families) {
  std::string reasons;
  for (const Family* f : families) {
    std::string why = reason(*f, p, arch);
    if (why.empty()) {
      *status = QATTN_OK;
      return f;
    }
    reasons += cat("; ", f->name, ": ", why);
  }
  const std::string device = arch != nullptr ? cat("; device sm_", arch->major, arch->minor)
                                             : std::string(" (any device)");
  *status = fail(QATTN_ERROR_UNSUPPORTED, fn, ": no kernel family runs this call (", describe(p),
                 device, "); considered ", families.size(), reasons);
  return nullptr;
}

template <typename Family, typename Params>
std::size_t largest_workspace(const Params& p, std::span<const Family* const> families) {
  std::size_t bytes = 0;
  for (const Family* f : families)
    if (reason(*f, p, nullptr).empty()) bytes = std::max(bytes, f->workspace_bytes(p));
  return bytes;
}

template <typename Family>
bool runs_on(const Arch& arch, std::span<const Family* const> families) {
  for (const Family* f : families)
    if (f->launch != nullptr && std::find(f->archs.begin(), f->archs.end(), arch) != f->archs.end())
      return true;
  return false;
}

}  // namespace

std::string decline_reason(const ForwardFamily& f, const qattn_fwd_params& p, const Arch* arch) {
  return reason(f, p, arch);
}
std::string decline_reason(const BackwardFamily& f, const qattn_bwd_params& p, const Arch* arch) {
  return reason(f, p, arch);
}

const ForwardFamily* select_family(const char* fn, const qattn_fwd_params& p, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const ForwardFamily* const> families) {
  return select(fn, p, arch, status, families);
}
const BackwardFamily* select_family(const char* fn, const qattn_bwd_params& p, const Arch* arch,
                                    qattn_status* status,
                                    std::span<const BackwardFamily* const> families) {
  return select(fn, p, arch, status, families);
}

std::string decline_reason(const KvCacheFamily& f, const KvCall& c, const Arch* arch) {
  return reason(f, c, arch);
}
const KvCacheFamily* select_family(const char* fn, const KvCall& c, const Arch* arch,
                                   qattn_status* status,
                                   std::span<const KvCacheFamily* const> families) {
  return select(fn, c, arch, status, families);
}

const MergeFamily* select_family(const char* fn, const Arch& arch, qattn_status* status,
                                 std::span<const MergeFamily* const> families) {
  std::string reasons;
  for (const MergeFamily* f : families) {
    if (std::find(f->archs.begin(), f->archs.end(), arch) != f->archs.end()) return f;
    reasons += cat("; ", f->name, ": runs on ", arch_list(f->archs));
  }
  *status = fail(QATTN_ERROR_UNSUPPORTED, fn, ": no kernel family runs this call (merge; device sm_",
                 arch.major, arch.minor, "); considered ", families.size(), reasons);
  return nullptr;
}

std::size_t workspace_bytes_for(const qattn_fwd_params& p,
                                std::span<const ForwardFamily* const> families) {
  return largest_workspace(p, families);
}
std::size_t workspace_bytes_for(const qattn_bwd_params& p,
                                std::span<const BackwardFamily* const> families) {
  return largest_workspace(p, families);
}

bool arch_supported(const Arch& arch, std::span<const ForwardFamily* const> families) {
  return runs_on(arch, families);
}
bool backward_arch_supported(const Arch& arch, std::span<const BackwardFamily* const> families) {
  return runs_on(arch, families);
}

}  // namespace qattn::api
