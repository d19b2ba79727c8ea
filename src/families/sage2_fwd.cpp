// Declaration of the SageAttention2-8b Hopper forward: what it runs, its workspace and
// its launch. Host C++ in every build; the launch exists only where the CUDA kernels
// are built.
#include "families/sage2_fwd.h"

#include <array>
#include <cstdint>

#include "api/error.h"
#include "cuda/sage2_fwd/workspace.h"
#include "numerics/mma_groups.h"

#if QATTN_HAVE_CUDA
#include "cuda/sage2_fwd/launch.h"
#endif

namespace qattn::families {
namespace {

// The sm_90a cubins run on compute capability 9.0 only (H100, H200, H20).
constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

std::string check_limits(const qattn_fwd_params& p) {
  // The workspace holds (B*H*N_pad) rows of at most 128 bytes plus a few floats each
  // (workspace.h); a bound of 1 KiB per row keeps every size_t sum of its layout in
  // range.
  const int64_t q_tile = sage2::kQTile, kv_tile = groups::kKvTile;
  const int64_t nq_pad = (int64_t{p.seqlen_q} + q_tile - 1) / q_tile * q_tile;
  const int64_t nkv_pad = (int64_t{p.seqlen_kv} + kv_tile - 1) / kv_tile * kv_tile;
  int64_t rows_q = 0, rows_kv = 0, bound = 0;
  if (!mul(int64_t{p.batch} * p.heads_q, nq_pad, &rows_q) ||
      !mul(int64_t{p.batch} * p.heads_kv, nkv_pad, &rows_kv) || !add(rows_q, rows_kv, &bound) ||
      !mul(bound, 1024, &bound))
    return "batch * heads * seqlen is too large for its workspace size to be represented";
  // The kernel numbers its work items (query tiles of every head) in an int.
  const int64_t items = int64_t{p.batch} * p.heads_q * (nq_pad / q_tile);
  if (items > int64_t{INT32_MAX})
    return api::cat("batch * heads_q * ceil(seqlen_q / ", q_tile, ") = ", items,
                    "; allowed: at most 2^31 - 1 (its work items are numbered in an int)");
  if (p.cu_seqlens_q != nullptr) {
    // A packed batch: its items are query heads x the plan's blocks (workspace.h bounds
    // them), numbered in an int; its K/V rows too.
    const sage2::WorkspaceLayout w = sage2::workspace_layout(p);
    const int64_t varlen_items = int64_t{w.max_entries} * p.heads_q;
    if (varlen_items > int64_t{INT32_MAX} || int64_t{w.nkv_pad} * p.heads_kv > int64_t{INT32_MAX})
      return api::cat("a packed batch of ", p.batch, " sequences, ", p.seqlen_q, " query and ",
                      p.seqlen_kv, " key tokens has ", varlen_items,
                      " work items; allowed: below 2^31 (heads_q x (total_q + 127 x batch) / 128)");
  }
  if (p.attn_mask_type != QATTN_MASK_NONE) {
    if (std::string why = api::attn_mask_alone(p); !why.empty()) return why;
    // An additive mask's values are read by the consumers as 4-byte pairs of keys
    // (attn_mask.cuh, AdditivePairs): keys contiguous, rows and the pointer 4-byte aligned
    // (the strides of dimensions of one are never used).
    if (p.attn_mask_type == QATTN_MASK_ADDITIVE) {
      if (p.seqlen_kv > 1 && p.attn_mask_stride_k != 2)
        return api::cat("an additive attn_mask with attn_mask_stride_k = ", p.attn_mask_stride_k,
                        "; allowed: 2 (contiguous keys)");
      const int64_t used = (p.batch > 1 ? p.attn_mask_stride_b : 0) |
                           (p.heads_q > 1 ? p.attn_mask_stride_h : 0) |
                           (p.seqlen_q > 1 ? p.attn_mask_stride_q : 0) |
                           static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.attn_mask));
      if ((used & 3) != 0)
        return "an additive attn_mask whose pointer or row strides are not multiples of 4 "
               "bytes; allowed: 4-byte aligned rows (copy the mask, e.g. with an even Nkv)";
    }
    // The mask pass's grid: query blocks and slices are grid dimensions.
    const int64_t slices = sage2::mask_slices(p);
    if (nq_pad / q_tile > 65535 || slices > 65535)
      return api::cat("an attn_mask with ", nq_pad / q_tile, " query blocks and ", slices,
                      " (batch, head) slices; allowed: at most 65535 of each");
    // The tile lists are indexed with an int (attn_mask.cuh, list_at).
    const int64_t list_ints = slices * (nq_pad / q_tile) * (nkv_pad / kv_tile + 1);
    if (list_ints > int64_t{INT32_MAX})
      return api::cat("an attn_mask whose tile lists take ", list_ints,
                      " ints; allowed: below 2^31 (slices x query blocks x (KV tiles + 1))");
  }
  return {};
}

std::size_t workspace_bytes(const qattn_fwd_params& p) { return sage2::workspace_layout(p).total; }

#if QATTN_HAVE_CUDA
int launch(const qattn_fwd_params& p, void* workspace, void* stream, api::ForwardPart part) {
  return part == api::ForwardPart::kAll ? sage2::launch_forward(p, workspace, stream)
                                        : sage2::launch_attention_only(p, workspace, stream);
}
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::ForwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::ForwardFamily kFamily{
    .name = "sage2_fwd_sm90",
    .scheme = QATTN_SCHEME_SAGE2_8B,
    .archs = kArchs,
    .min_head_dim = 1,
    .max_head_dim = 128,  // 64 and 128 natively, others zero-padded to the next of them
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    .masks = api::kMaskNone | api::kMaskCausal | api::kMaskWindow | api::kMaskKeyPadding |
             api::kMaskTopLeft | api::kMaskBool | api::kMaskAdditive | api::kMaskVarlen,
    // V narrower than Q·K: its passes zero V's channels past head_dim_v, O takes those.
    .narrower_v = true,
    .writes_p_max = true,
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::ForwardFamily& sage2_fwd_sm90() { return kFamily; }

}  // namespace qattn::families
