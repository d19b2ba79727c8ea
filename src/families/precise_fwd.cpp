// Declaration of the 16-bit ("precise") Hopper forward: what it runs and its launch.
// Host C++ in every build; the launch exists only where the CUDA kernels are built.
#include "families/precise_fwd.h"

#include <array>
#include <cstdint>

#if QATTN_HAVE_CUDA
#include "cuda/precise_fwd/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

// One CTA per 128-row query block, query head and batch entry: the grid's y and z take
// heads_q and batch (<= 65535 by the ABI), x the blocks (<= 2^30 / 128).
std::string check_limits(const qattn_fwd_params& p) {
  return api::attn_mask_alone(p);  // as the SA2-8b family's (one API for both)
}

std::size_t workspace_bytes(const qattn_fwd_params&) { return 0; }  // reads the inputs as given

#if QATTN_HAVE_CUDA
int launch(const qattn_fwd_params& p, void*, void* stream, api::ForwardPart) {
  return precise::launch_forward(p, stream);  // one kernel: either part is all of it
}
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::ForwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::ForwardFamily kFamily{
    .name = "precise16_fwd_sm90",
    .scheme = QATTN_SCHEME_PRECISE16,
    .archs = kArchs,
    .min_head_dim = 1,
    .max_head_dim = 128,  // zero-padded to 64 or 128 inside
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    .masks = api::kMaskNone | api::kMaskCausal | api::kMaskWindow | api::kMaskKeyPadding |
             api::kMaskTopLeft | api::kMaskBool,
    .narrower_v = false,
    .writes_p_max = false,
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::ForwardFamily& precise_fwd_sm90() { return kFamily; }

}  // namespace qattn::families
