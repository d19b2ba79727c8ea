// Declaration of the SageAttention3 NVFP4 Hopper forward: what it runs, its workspace
// and its launch. Host C++ in every build; the launch exists only where the CUDA
// kernels are built.
#include "families/sage3_fwd.h"

#include <array>
#include <cstdint>

#include "api/error.h"
#include "cuda/sage3_fwd/workspace.h"

#if QATTN_HAVE_CUDA
#include "cuda/sage3_fwd/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

std::string check_limits(const qattn_fwd_params& p) {
  if (p.head_dim != 64 && p.head_dim != 128)
    return api::cat("head_dim = ", p.head_dim, "; allowed: 64 or 128 (the kernel's tiles)");
  // Workspace rows and the kernels' element indices stay within int64 with a wide margin
  // below 2^40 elements per tensor; the padded lengths are ints.
  const int64_t rows_q = int64_t{p.batch} * p.heads_q * sage3::padded(p.seqlen_q);
  const int64_t rows_kv = int64_t{p.batch} * p.heads_kv * sage3::padded(p.seqlen_kv);
  if (rows_q > (int64_t{1} << 32) || rows_kv > (int64_t{1} << 32))
    return "batch * heads * seqlen is above 2^32 rows, the most its workspace is laid out for";
  return {};
}

std::size_t workspace_bytes(const qattn_fwd_params& p) { return sage3::workspace_layout(p).total; }

#if QATTN_HAVE_CUDA
int launch(const qattn_fwd_params& p, void* workspace, void* stream, api::ForwardPart part) {
  // Either part runs the whole forward: this family is for fidelity, so it has no
  // kernel-only figure (its quantization is part of what it is measured for).
  (void)part;
  return sage3::launch_forward(p, workspace, stream);
}
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::ForwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::ForwardFamily kFamily{
    .name = "sage3_nvfp4_fwd_sm90",
    .scheme = QATTN_SCHEME_SAGE3_NVFP4,
    .archs = kArchs,
    .min_head_dim = 64,
    .max_head_dim = 128,  // 64 and 128 (check_limits)
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    .masks = api::kMaskNone | api::kMaskCausal,
    .narrower_v = false,
    .writes_p_max = false,
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::ForwardFamily& sage3_fwd_sm90() { return kFamily; }

}  // namespace qattn::families
