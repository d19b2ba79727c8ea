// The SA2-8b workspace layout (src/cuda/sage2_fwd/workspace.h): the regions the kernels
// write are aligned, in order and disjoint, and keep_q (the tests' debug copy of the
// in-kernel Q quantization) only adds the three Q regions without moving what the
// production path needs more than alignment does.
#include <gtest/gtest.h>

#include <random>
#include <string>
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

TEST(WorkspaceLayout, FixedShapes) {
  check(params(4, 32, 32, 8192, 8192, 128));
  check(params(1, 32, 8, 4097, 4097, 128));  // GQA, tails
  check(params(2, 3, 1, 1, 700, 64));        // one query row
  check(params(1, 4, 2, 200, 333, 100));     // d padded to 128
  check(params(3, 2, 2, 129, 1, 32));        // one key
}

TEST(WorkspaceLayout, RandomShapes) {
  const std::uint64_t seed = qattn::testutil::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200; ++i) {
    const int hkv = 1 + int(rng() % 8);
    check(params(1 + int(rng() % 4), hkv * (1 + int(rng() % 4)), hkv, 1 + int(rng() % 20000),
                 1 + int(rng() % 20000), 8 * (1 + int(rng() % 16))));
  }
}

}  // namespace
