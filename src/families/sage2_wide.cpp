// Declaration of the head-dim-256 SageAttention2-8b Hopper forward: what it runs, its
// workspace and its launch. Host C++ in every build; the launch exists only where the
// CUDA kernels are built.
#include "families/sage2_wide.h"

#include <array>
#include <cstdint>

#include "api/error.h"
#include "cuda/sage2_fwd/workspace.h"
#include "numerics/mma_groups.h"

#if QATTN_HAVE_CUDA
#include "cuda/sage2_wide/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};
constexpr int kPaddedHeadDim = 256;

bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

std::string check_limits(const qattn_fwd_params& p) {
  // The workspace holds (B·H·N_pad) rows of 256 bytes plus a few floats each: a bound of
  // 1 KiB per row keeps every size_t sum of its layout in range.
  const int64_t q_tile = sage2::kQTile, kv_tile = groups::kKvTile;
  const int64_t nq_pad = (int64_t{p.seqlen_q} + q_tile - 1) / q_tile * q_tile;
  const int64_t nkv_pad = (int64_t{p.seqlen_kv} + kv_tile - 1) / kv_tile * kv_tile;
  int64_t rows_q = 0, rows_kv = 0, bound = 0;
  if (!mul(int64_t{p.batch} * p.heads_q, nq_pad, &rows_q) ||
      !mul(int64_t{p.batch} * p.heads_kv, nkv_pad, &rows_kv) || !add(rows_q, rows_kv, &bound) ||
      !mul(bound, 1024, &bound))
    return "batch * heads * seqlen is too large for its workspace size to be represented";
  const int64_t items = int64_t{p.batch} * p.heads_q * (nq_pad / q_tile);
  if (items > int64_t{INT32_MAX})
    return api::cat("batch * heads_q * ceil(seqlen_q / ", q_tile, ") = ", items,
                    "; allowed: at most 2^31 - 1 (its work items are numbered in an int)");
  // The Q pass's grid: (query blocks, heads_q, batch).
  if (p.heads_q > 65535 || p.batch > 65535)
    return api::cat("heads_q = ", p.heads_q, ", batch = ", p.batch,
                    "; allowed: at most 65535 each (grid dimensions of its Q pass)");
  // The TMA maps of its INT8 Q, K and Vᵀ number rows and slices in 32 bits.
  if (int64_t{p.batch} * p.heads_q > INT32_MAX || nkv_pad * kPaddedHeadDim > INT32_MAX)
    return "a tensor map dimension is over 2^31 - 1";
  return {};
}

std::size_t workspace_bytes(const qattn_fwd_params& p) {
  return sage2::workspace_layout(p, /*keep_q=*/true, kPaddedHeadDim).total;
}

#if QATTN_HAVE_CUDA
int launch(const qattn_fwd_params& p, void* workspace, void* stream, api::ForwardPart part) {
  return part == api::ForwardPart::kAll ? sage2_wide::launch_forward(p, workspace, stream)
                                        : sage2_wide::launch_attention_only(p, workspace, stream);
}
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::ForwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::ForwardFamily kFamily{
    .name = "sage2_wide_sm90",
    .scheme = QATTN_SCHEME_SAGE2_8B,
    .archs = kArchs,
    .min_head_dim = 129,
    .max_head_dim = 256,  // zero-padded to 256 inside
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    // No boolean attn_mask and no packed (varlen) kernel: the registry refuses those
    // calls by name (Python runs a packed batch as one call per sequence).
    .masks = api::kMaskNone | api::kMaskCausal | api::kMaskWindow | api::kMaskKeyPadding |
             api::kMaskTopLeft,
    // V narrower than Q·K: its passes zero V's channels past head_dim_v, O takes those.
    .narrower_v = true,
    .writes_p_max = false,
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::ForwardFamily& sage2_wide_sm90() { return kFamily; }

}  // namespace qattn::families
