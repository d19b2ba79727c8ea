// The SA2-8b workspace layout (src/cuda/sage2_fwd/workspace.h): the regions the kernels
// write are aligned, in order and disjoint, and keep_q (the tests' debug copy of the
// in-kernel Q quantization) only adds the three Q regions without moving what the
// production path needs more than alignment does.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_test_util.h"
#include "cuda/sage2_fwd/workspace.h"
#include "qattn/qattn.hpp"

namespace {

using qattn::sage2::kWorkspaceAlign;
using qattn::sage2::workspace_layout;
using qattn::sage2::WorkspaceLayout;

qattn_fwd_params params(int b, int hq, int hkv, int nq, int nkv, int d) {
  return qattn::ForwardParams(qattn::DType::kBF16, b, hq, hkv, nq, nkv, d).raw();
}

// (offset, bytes) of every region, in layout order.
std::vector<std::pair<std::size_t, std::size_t>> regions(const qattn_fwd_params& p,
                                                         const WorkspaceLayout& w, bool keep_q) {
  const std::size_t D = w.head_dim_padded;
  const std::size_t bq = std::size_t(p.batch) * p.heads_q, bkv = std::size_t(p.batch) * p.heads_kv;
  const std::size_t q_rows = keep_q ? bq * w.nq_pad : 0;
  return {{w.q_i8, q_rows * D},
          {w.q_scale, keep_q ? bq * w.q_scales_per_head() * 4 : 0},
          {w.q_dot_c, q_rows * 4},
          {w.k_i8, bkv * w.nkv_pad * D},
          {w.k_scale, bkv * w.k_scales_per_head() * 4},
          {w.k_mean, bkv * D * 4},
          {w.vt_f8, bkv * D * w.nkv_pad},
          {w.v_amax, bkv * D * 4},
          {w.v_over, bkv * D * 4},
          {w.item_counter, 2 * sizeof(int)}};
}

void check(const qattn_fwd_params& p) {
  SCOPED_TRACE("B=" + std::to_string(p.batch) + " Hq=" + std::to_string(p.heads_q) +
               " Hkv=" + std::to_string(p.heads_kv) + " Nq=" + std::to_string(p.seqlen_q) +
               " Nkv=" + std::to_string(p.seqlen_kv) + " d=" + std::to_string(p.head_dim));
  const WorkspaceLayout lean = workspace_layout(p), full = workspace_layout(p, true);
  EXPECT_EQ(lean.head_dim_padded, p.head_dim <= 64 ? 64 : 128);
  EXPECT_EQ(lean.nq_pad % 128, 0);
  EXPECT_GE(lean.nq_pad, p.seqlen_q);
  EXPECT_LT(lean.nq_pad - p.seqlen_q, 128);
  EXPECT_EQ(lean.nkv_pad % 128, 0);
  EXPECT_GE(lean.nkv_pad, p.seqlen_kv);
  for (bool keep_q : {false, true}) {
    const WorkspaceLayout& w = keep_q ? full : lean;
    const auto r = regions(p, w, keep_q);
    std::size_t end = 0;
    for (std::size_t i = 0; i < r.size(); ++i) {
      EXPECT_EQ(r[i].first % kWorkspaceAlign, 0u) << "region " << i;
      EXPECT_GE(r[i].first, end) << "region " << i << " overlaps the one before";
      end = r[i].first + r[i].second;
    }
    EXPECT_LE(end, w.total);
    EXPECT_LT(w.total - end, kWorkspaceAlign);  // no slack beyond the last alignment
  }
  // Production keeps Q on chip: no Q regions, and the K/V regions shift down by exactly
  // the (aligned) size of the Q regions.
  const auto rl = regions(p, lean, false), rf = regions(p, full, true);
  std::size_t q_bytes = 0;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rl[i].second, 0u);
    q_bytes += (rf[i].second + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  }
  for (std::size_t i = 3; i < rl.size(); ++i) {
    EXPECT_EQ(rl[i].second, rf[i].second);
    EXPECT_EQ(rf[i].first - rl[i].first, q_bytes) << "region " << i;
  }
  EXPECT_EQ(full.total - lean.total, q_bytes);
}

// The layout written out from its documentation (workspace.h, numerics/mma_groups.h),
// with the numbers as literals rather than through workspace_layout's constants and
// helpers: head dim padded to 64 or 128; Q rows padded to the 128-row CTA tile; KV
// tokens to the 128-token KV tile; regions in this order, each starting at a multiple of
// 256 bytes, and the total rounded up to 256:
//   q_i8     int8  B*Hq  * Nq_pad * D      (keep_q only; else empty)
//   q_scale  float B*Hq  * Nq_pad/64 * 32  (keep_q only: 32 per-thread groups per 64 rows)
//   q_dot_c  float B*Hq  * Nq_pad          (keep_q only)
//   k_i8     int8  B*Hkv * Nkv_pad * D
//   k_scale  float B*Hkv * Nkv_pad/128 * 4 (4 per-thread groups per 128-token tile)
//   k_mean   float B*Hkv * D
//   vt_f8    fp8   B*Hkv * D * Nkv_pad
//   v_amax   float B*Hkv * D
//   v_over   u32   B*Hkv * D
//   counters int   2
struct Expected {
  std::size_t offset[10];
  std::size_t total;
};

Expected expected_layout(const qattn_fwd_params& p, bool keep_q) {
  const std::uint64_t D = p.head_dim <= 64 ? 64 : 128;
  const std::uint64_t nq = (std::uint64_t(p.seqlen_q) + 127) / 128 * 128;
  const std::uint64_t nkv = (std::uint64_t(p.seqlen_kv) + 127) / 128 * 128;
  const std::uint64_t bq = std::uint64_t(p.batch) * p.heads_q, bkv = std::uint64_t(p.batch) * p.heads_kv;
  const std::uint64_t q = keep_q ? 1 : 0;
  const std::uint64_t bytes[10] = {q * bq * nq * D,          q * bq * (nq / 64) * 32 * 4,
                                   q * bq * nq * 4,          bkv * nkv * D,
                                   bkv * (nkv / 128) * 4 * 4, bkv * D * 4,
                                   bkv * D * nkv,            bkv * D * 4,
                                   bkv * D * 4,              2 * 4};
  Expected e{};
  std::uint64_t at = 0;
  for (int i = 0; i < 10; ++i) {
    e.offset[i] = at;
    at += bytes[i];
    at = (at + 255) / 256 * 256;
  }
  e.total = at;
  return e;
}

void check_against_documented(const qattn_fwd_params& p) {
  for (bool keep_q : {false, true}) {
    SCOPED_TRACE(std::string(keep_q ? "keep_q " : "") + "B=" + std::to_string(p.batch) +
                 " Hq=" + std::to_string(p.heads_q) + " Hkv=" + std::to_string(p.heads_kv) +
                 " Nq=" + std::to_string(p.seqlen_q) + " Nkv=" + std::to_string(p.seqlen_kv) +
                 " d=" + std::to_string(p.head_dim));
    const WorkspaceLayout w = workspace_layout(p, keep_q);
    const Expected e = expected_layout(p, keep_q);
    const std::size_t got[10] = {w.q_i8,   w.q_scale, w.q_dot_c, w.k_i8,   w.k_scale,
                                 w.k_mean, w.vt_f8,   w.v_amax,  w.v_over, w.item_counter};
    const char* names[10] = {"q_i8",   "q_scale", "q_dot_c", "k_i8",   "k_scale",
                             "k_mean", "vt_f8",   "v_amax",  "v_over", "item_counter"};
    for (int i = 0; i < 10; ++i) EXPECT_EQ(got[i], e.offset[i]) << names[i];
    EXPECT_EQ(w.total, e.total);
  }
}

TEST(WorkspaceLayout, RegionSizesFromTheDocumentedLayout) {
  // A hand-checked case: B=1, Hq=Hkv=1, Nq=Nkv=1, d=32 (D=64, 128-padded rows):
  // k_i8 128*64 = 8192 at 0; k_scale 4 floats = 16 B at 8192; k_mean 64 floats = 256 B at
  // 8448; vt_f8 8192 B at 8704; v_amax at 16896; v_over at 17152; counters at 17408;
  // total 17664.
  const Expected one = expected_layout(params(1, 1, 1, 1, 1, 32), false);
  EXPECT_EQ(one.offset[3], 0u);
  EXPECT_EQ(one.offset[4], 8192u);
  EXPECT_EQ(one.offset[5], 8448u);
  EXPECT_EQ(one.offset[6], 8704u);
  EXPECT_EQ(one.offset[9], 17408u);
  EXPECT_EQ(one.total, 17664u);
  check_against_documented(params(1, 1, 1, 1, 1, 32));
  check_against_documented(params(4, 32, 32, 8192, 8192, 128));
  check_against_documented(params(1, 32, 8, 4097, 4097, 128));
  check_against_documented(params(2, 3, 1, 1, 700, 64));
  check_against_documented(params(1, 4, 2, 200, 333, 100));
  check_against_documented(params(3, 2, 2, 129, 1, 65));
  const std::uint64_t seed = qattn::testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200; ++i) {
    const int hkv = 1 + int(rng() % 8);
    check_against_documented(params(1 + int(rng() % 4), hkv * (1 + int(rng() % 4)), hkv,
                                    1 + int(rng() % 20000), 1 + int(rng() % 20000),
                                    1 + int(rng() % 128)));
  }
}

TEST(WorkspaceLayout, FixedShapes) {
  check(params(4, 32, 32, 8192, 8192, 128));
  check(params(1, 32, 8, 4097, 4097, 128));  // GQA, tails
  check(params(2, 3, 1, 1, 700, 64));        // one query row
  check(params(1, 4, 2, 200, 333, 100));     // d padded to 128
  check(params(3, 2, 2, 129, 1, 32));        // one key
}

TEST(WorkspaceLayout, RandomShapes) {
  const std::uint64_t seed = qattn::testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200; ++i) {
    const int hkv = 1 + int(rng() % 8);
    check(params(1 + int(rng() % 4), hkv * (1 + int(rng() % 4)), hkv, 1 + int(rng() % 20000),
                 1 + int(rng() % 20000), 8 * (1 + int(rng() % 16))));
  }
}

}  // namespace

namespace {

// A boolean attn_mask adds three regions after the counters, per (mask slice, query
// block): its tile list (1 + Nkv_pad/128 ints), its bits (128 rows x Nkv_pad bits) and
// the pass's classes (a byte per KV tile); the regions before them do not move. Slices:
// B when the mask has a batch stride, times Hq when it has a head stride.
TEST(WorkspaceLayout, AttnMaskRegionsAfterTheCounters) {
  for (auto [b, hq, nq, nkv, sb, sh] : {std::tuple{1, 1, 1, 1, 0, 0}, std::tuple{3, 4, 700, 900, 1, 0},
                                        std::tuple{2, 8, 129, 4097, 0, 1},
                                        std::tuple{2, 2, 300, 300, 1, 1}, std::tuple{1, 4, 50, 60, 1, 1}}) {
    qattn_fwd_params p = params(b, hq, hq, nq, nkv, 128);
    const WorkspaceLayout plain = workspace_layout(p);
    p.attn_mask_type = QATTN_MASK_BOOL;
    p.attn_mask_stride_b = sb;
    p.attn_mask_stride_h = sh;
    const WorkspaceLayout w = workspace_layout(p);
    SCOPED_TRACE("B=" + std::to_string(b) + " Hq=" + std::to_string(hq) + " sb=" +
                 std::to_string(sb) + " sh=" + std::to_string(sh));
    EXPECT_EQ(w.item_counter, plain.item_counter);
    EXPECT_EQ(w.mask_tiles, plain.total);
    const std::size_t slices = (sb != 0 && b > 1 ? b : 1) * (sh != 0 && hq > 1 ? hq : 1);
    EXPECT_EQ(std::size_t(w.mask_slices), slices);
    const std::size_t blocks = slices * ((nq + 127) / 128), tiles = (nkv + 127) / 128;
    auto up = [](std::size_t x) { return (x + 255) / 256 * 256; };
    EXPECT_EQ(w.mask_bits, w.mask_tiles + up(blocks * (tiles + 1) * 4));
    EXPECT_EQ(w.mask_classes, w.mask_bits + up(blocks * 128 * tiles * 16));
    EXPECT_EQ(w.total, w.mask_classes + up(blocks * tiles));
  }
}

}  // namespace
