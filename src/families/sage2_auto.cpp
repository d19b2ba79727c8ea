// Declaration of precision "auto" on Hopper: the SA2-8b forward on every head (its K
// quantizer gathers the precision guard's K maxima), the guard's pass over Q, then the
// 16-bit forward on the heads the guard flags (it overwrites their O and LSE). Three
// families' kernels in one stream, nothing read back to the host. Host C++ in every build;
// the launch exists only where the CUDA kernels are built.
#include "families/sage2_auto.h"

#include <array>
#include <cstdint>

#include "cuda/precision_guard/stats.h"
#include "cuda/sage2_fwd/workspace.h"
#include "families/sage2_fwd.h"

#if QATTN_HAVE_CUDA
#include "cuda/precise_fwd/launch.h"
#include "cuda/precision_guard/launch.h"
#include "cuda/sage2_fwd/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

// The guard's stats after the SA2-8b workspace (256-aligned both).
std::size_t guard_offset(const qattn_fwd_params& p) {
  return guard::align256(sage2::workspace_layout(p).total);
}

std::string check_limits(const qattn_fwd_params& p) {
  // The guard's rule is derived for the per-thread Q groups (the fast path's default).
  if (p.sage2.granularity != QATTN_QK_PER_THREAD)
    return "its precision guard is derived for sage2.granularity = QATTN_QK_PER_THREAD";
  // The SA2-8b family's limits apply to its part; the guard's and the 16-bit kernel's
  // grids take heads and batch as y and z (<= 65535 by the ABI).
  return sage2_fwd_sm90().check_limits(p);
}

std::size_t workspace_bytes(const qattn_fwd_params& p) { return guard_offset(p) + guard::stats_bytes(p); }

#if QATTN_HAVE_CUDA
int launch(const qattn_fwd_params& p, void* workspace, void* stream, api::ForwardPart part) {
  const guard::Stats stats = guard::stats_at(p, static_cast<uint8_t*>(workspace) + guard_offset(p));
  // The K maxima are gathered by the K quantizer; an attention-only launch reads those of
  // the forward that filled the workspace.
  const int e = part == api::ForwardPart::kAll
                    ? sage2::launch_forward(p, workspace, stream, false, sage2::RegisterSplit::kAuto,
                                            stats.k)
                    : sage2::launch_attention_only(p, workspace, stream);
  if (e != 0) return e;
  if (auto g = guard::launch_q_maxima(p, stats.q, static_cast<cudaStream_t>(stream)); g != 0) return g;
  return precise::launch_forward(p, stream, &stats);
}
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::ForwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::ForwardFamily kFamily{
    .name = "sage2_auto_sm90",
    .scheme = QATTN_SCHEME_SAGE2_8B_AUTO,
    .archs = kArchs,
    .min_head_dim = 1,
    .max_head_dim = 128,
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    // The masks both of its forwards run (the 16-bit one has no packed batch).
    .masks = api::kMaskNone | api::kMaskCausal | api::kMaskWindow | api::kMaskKeyPadding |
             api::kMaskTopLeft | api::kMaskBool,
    .narrower_v = false,
    .writes_p_max = false,
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::ForwardFamily& sage2_auto_sm90() { return kFamily; }

}  // namespace qattn::families
