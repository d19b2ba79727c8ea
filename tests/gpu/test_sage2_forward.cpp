// SageAttention2-8b forward on the GPU against the FP64 reference: accuracy on
// Gaussian inputs, a random-shape sweep (tails, GQA, causal, Nq != Nkv, layouts,
// dtypes, head dims), poisoned outputs, guard columns and the LSE.
#include <gtest/gtest.h>

#include "sage2_case.h"

namespace {

using namespace qattn;
using test::Layout;
using test::Sage2Case;

// INT8 Q·Kᵀ with smoothing and E4M3 P·V keep CosSim above 0.999 on Gaussian inputs
// (SageAttention2 Table 1 reports ~0.9999 for the 8-bit scheme; 0.999 leaves margin).
constexpr double kMinCos = 0.999;
// LSE error: INT8 scores carry ~0.5% relative error of |S|; on these inputs that is a
// few 1e-3 in the log-sum-exp.
constexpr double kLseTol = 3e-2;

void check_case(const Sage2Case& c) {
  SCOPED_TRACE(c.describe());
  const auto r = test::run_sage2(c);
  ASSERT_EQ(r.status, 0) << cudaGetErrorString(static_cast<cudaError_t>(r.status));
  EXPECT_TRUE(r.all_written) << "some output element was left poisoned";
  EXPECT_TRUE(r.guard_intact) << "a write landed outside the output rows";
  AttentionParams ap;
  ap.mask = c.causal ? Mask::Causal : Mask::None;
  const auto ref = reference::attention_forward(r.q, r.k, r.v, ap);
  const auto m = metrics::compare(std::span<const float>(r.o.data), std::span<const double>(ref.o.data));
  EXPECT_GE(m.cos_sim, kMinCos) << "rel_l1=" << m.rel_l1 << " rmse=" << m.rmse;
  double lse_err = 0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(r.lse[i]) && r.lse[i] < 0) << "row " << i << " sees no key: LSE must be -inf";
      continue;
    }
    lse_err = std::max(lse_err, std::abs(r.lse[i] - ref.lse[i]));
  }
  EXPECT_LE(lse_err, kLseTol);
}

TEST(Sage2Forward, SmallHndBf16) {
  QATTN_SKIP_WITHOUT_GPU();
  check_case(Sage2Case{});
}

TEST(Sage2Forward, HeadDim64AndCausal) {
  QATTN_SKIP_WITHOUT_GPU();
  Sage2Case c;
  c.head_dim = 64;
  c.causal = true;
  c.seqlen_q = c.seqlen_kv = 384;
  check_case(c);
}

TEST(Sage2Forward, RandomShapeSweep) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int> xs) { return *(xs.begin() + rng() % xs.size()); };
  for (int i = 0; i < 24; ++i) {
    Sage2Case c;
    c.seed = rng();
    c.batch = pick({1, 2});
    c.heads_kv = pick({1, 2});
    c.heads_q = c.heads_kv * pick({1, 2, 4});
    c.seqlen_q = pick({1, 17, 64, 127, 128, 200, 333, 512});
    c.seqlen_kv = pick({1, 31, 128, 129, 300, 640});
    c.head_dim = pick({32, 64, 72, 128});
    c.causal = rng() % 2;
    c.bf16 = rng() % 2;
    c.layout = rng() % 2 ? Layout::HND : Layout::NHD;
    c.granularity = static_cast<qattn_qk_granularity>(pick({0, 0, 1, 2}));
    check_case(c);
    if (HasFailure()) {
      ADD_FAILURE() << "sweep seed " << seed;
      return;
    }
  }
}

}  // namespace
