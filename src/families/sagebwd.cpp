// Declaration of the SageBwd backward for Hopper: what it runs, its workspace and its
// launch. Host C++ in every build; the launch exists only where the CUDA kernels are
// built.
#include "families/sagebwd.h"

#include <array>
#include <cstdint>

#include "api/error.h"
#include "cuda/sagebwd/workspace.h"

#if QATTN_HAVE_CUDA
#include "cuda/sagebwd/launch.h"
#endif

namespace qattn::families {
namespace {

// The sm_90a cubins run on compute capability 9.0 only (H100, H200, H20).
constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};

bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

// Bounds on the bytes workspace_layout (cuda/sagebwd/workspace.h) gives each padded row,
// with D <= 128: a Q-side row holds q_i8, qt_i8, do_i8, dot_i8 (D each), do_16 (2D),
// dq_acc (4D), lse2, delta (4 each) and 8/64 bytes of scales: at most 10·128 + 9 =
// 1289, and 8 more with the merge-free scales (s_row, inv_s); a KV-side row holds k_i8,
// kt_i8, v_i8 (D each), v_16 (2D), 8/128 bytes of scales and k_mean's 4D bytes per 128
// rows (at most; 16D with the merge-free channel maxima): at most 5·128 + 9 + 16 = 665.
// Each of the 22 buffers rounds up to 256 bytes. The bounds below are looser, so a sum that
// fits them fits the layout's size_t arithmetic (int64 is narrower than size_t here).
constexpr int64_t kQRowBound = 2048, kKvRowBound = 1024, kAlignSlack = 23 * 256;

std::string check_limits(const qattn_bwd_params& p) {
  const int64_t q_block = sagebwd::kQBlock, kv_tile = sagebwd::kKvTile;
  const int64_t q_blocks = (int64_t{p.seqlen_q} + q_block - 1) / q_block;
  const int64_t kv_tiles = (int64_t{p.seqlen_kv} + kv_tile - 1) / kv_tile;
  int64_t rows_q = 0, rows_kv = 0, bytes_q = 0, bytes_kv = 0, bound = 0;
  if (!mul(int64_t{p.batch} * p.heads_q, q_blocks * q_block, &rows_q) ||
      !mul(int64_t{p.batch} * p.heads_kv, kv_tiles * kv_tile, &rows_kv) ||
      !mul(rows_q, kQRowBound, &bytes_q) || !mul(rows_kv, kKvRowBound, &bytes_kv) ||
      !add(bytes_q, bytes_kv, &bound) || !add(bound, kAlignSlack, &bound))
    return "batch * heads * seqlen is too large for its workspace size to be represented";
  // The dK/dV kernel runs one CTA per KV tile of every KV head, the dQ pass and the
  // preprocessing one per Q block of every query head; both number their CTAs in an
  // int.
  const int64_t kv_ctas = int64_t{p.batch} * p.heads_kv * kv_tiles;
  if (kv_ctas > int64_t{INT32_MAX})
    return api::cat("batch * heads_kv * ceil(seqlen_kv / ", kv_tile, ") = ", kv_ctas,
                    "; allowed: at most 2^31 - 1 (its dK/dV CTAs are numbered in an int)");
  const int64_t q_ctas = int64_t{p.batch} * p.heads_q * q_blocks;
  if (q_ctas > int64_t{INT32_MAX})
    return api::cat("batch * heads_q * ceil(seqlen_q / ", q_block, ") = ", q_ctas,
                    "; allowed: at most 2^31 - 1 (its dQ CTAs are numbered in an int)");
  return {};
}

std::size_t workspace_bytes(const qattn_bwd_params& p) {
  return sagebwd::workspace_layout(p).total;
}

#if QATTN_HAVE_CUDA
constexpr auto kLaunch = &sagebwd::launch_backward;
#else
constexpr decltype(api::BackwardFamily::launch) kLaunch = nullptr;
#endif

constexpr api::BackwardFamily kFamily{
    .name = "sagebwd_sm90",
    .archs = kArchs,
    .min_head_dim = 1,
    .max_head_dim = 128,  // padded to 64 or 128 inside (workspace.h)
    .dtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
    .masks = api::kMaskNone | api::kMaskCausal,
    .formats = (1u << QATTN_BWD_INT8) | (1u << QATTN_BWD_E4M3),
    .dovs = (1u << QATTN_BWD_DOV_16BIT) | (1u << QATTN_BWD_DOV_QUANTIZED),
    .determinism = (1u << 0) | (1u << 1),
    .scales = (1u << QATTN_BWD_SCALES_PER_BLOCK) | (1u << QATTN_BWD_SCALES_MERGE_FREE),
    .check_limits = &check_limits,
    .workspace_bytes = &workspace_bytes,
    .launch = kLaunch,
};

}  // namespace

const api::BackwardFamily& sagebwd_sm90() { return kFamily; }

}  // namespace qattn::families
