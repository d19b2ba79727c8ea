// The SageAttention2 and FP8-per-tensor emulators: against the FP64 reference at
// high-precision settings, the paper's accuracy and direction claims on fixed seeds,
// and the kernel workspace layout of the quantized tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <tuple>
#include <utility>

#include "attention_test_util.h"
#include "emulate/fp8_per_tensor.h"
#include "emulate/pv_tile.h"
#include "emulate/sage2.h"
#include "emulate/synthetic.h"
#include "numerics/additive_mask.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "tolerances.h"

namespace qattn {
namespace {

using emulate::Granularity;
using emulate::PvFormat;
using emulate::QkFormat;
using emulate::RowSum;
using emulate::Sage2Options;
using emulate::VAmax;
using testutil::gaussian;

struct Case {
  int b, hq, hkv, nq, nkv, d;
  Mask mask;
};

struct Inputs {
  Tensor4 q, k, v;
};

Inputs make_inputs(const Case& c, std::uint64_t seed, float k_bias = 0.0f) {
  return {gaussian(c.b, c.hq, c.nq, c.d, seed),
          gaussian(c.b, c.hkv, c.nkv, c.d, seed + 1, 1.0f, k_bias),
          gaussian(c.b, c.hkv, c.nkv, c.d, seed + 2)};
}

// Compares an emulated forward with the reference: per-element |o - r| <= o_tol and
// |lse - lse_ref| <= lse_tol (fully masked rows must match exactly: O = 0, -inf).
void expect_close(const emulate::EmulatedForward& e, const reference::ForwardResult& r,
                  double o_tol, double lse_tol) {
  ASSERT_EQ(e.o.size(), r.o.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < e.o.size(); ++i)
    worst = std::max(worst, std::fabs(e.o.data[i] - r.o.data[i]));
  EXPECT_LE(worst, o_tol);
  for (std::size_t i = 0; i < e.lse.size(); ++i) {
    if (std::isinf(r.lse[i])) {
      ASSERT_EQ(e.lse[i], -std::numeric_limits<float>::infinity()) << "row " << i;
    } else {
      ASSERT_NEAR(e.lse[i], r.lse[i], lse_tol) << "row " << i;
    }
  }
}

const Case kCases[] = {
    {1, 2, 2, 130, 130, 64, Mask::None},    // tails in both Q and KV
    {2, 4, 2, 100, 300, 48, Mask::Causal},  // GQA, Nq < Nkv, d padded to 64, sampled mean
    {1, 2, 1, 200, 70, 80, Mask::Causal},   // MQA, Nq > Nkv: fully masked rows
};

// With no quantization anywhere (QK FP32, PV FP32) the emulator is the reference in
// FP32 with the FlashAttention tiling: every step is an FP32 op on O(1) values, so
// O agrees to a few ulps of FP32 accumulated over <= 300 keys (1e-5 abs for |O| < 1)
// and LSE to ~1e-6 relative of |x| (1e-4 abs) — whatever the smoothing, which is exact
// in exact arithmetic.
TEST(Sage2Emulator, UnquantizedMatchesReferenceThroughTilingAndSmoothing) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  for (const Case& c : kCases) {
    const Inputs in = make_inputs(c, seed, 3.0f);
    const AttentionParams p{c.mask, std::nullopt};
    const auto ref = reference::attention_forward(in.q, in.k, in.v, p);
    for (auto ks :
         {emulate::KSmoothing::None, emulate::KSmoothing::Mean, emulate::KSmoothing::SampledMean})
      for (auto qsm : {emulate::QSmoothing::None, emulate::QSmoothing::BlockMean}) {
        Sage2Options o;
        o.qk_format = QkFormat::Fp32;
        o.pv_format = PvFormat::Fp32;
        o.k_smoothing = ks;
        o.q_smoothing = qsm;
        expect_close(emulate::sage2_attention(in.q, in.k, in.v, p, o), ref, 1e-5, 1e-4);
      }
  }
}

// A caller-given c is as exact as the mean: any vector keeps softmax, and the LSE
// correction sm_scale·q·c restores the true LSE.
TEST(Sage2Emulator, GivenSmoothingVectorKeepsLseExact) {
  const Case c{1, 2, 1, 64, 150, 32, Mask::None};
  const Inputs in = make_inputs(c, 5, 2.0f);
  const auto ref = reference::attention_forward(in.q, in.k, in.v);
  Sage2Options o;
  o.qk_format = QkFormat::Fp32;
  o.pv_format = PvFormat::Fp32;
  o.k_smoothing = emulate::KSmoothing::Given;
  o.k_mean.resize(32);
  for (int i = 0; i < 32; ++i) o.k_mean[i] = 0.37f * static_cast<float>(i % 7) - 1.0f;
  expect_close(emulate::sage2_attention(in.q, in.k, in.v, {}, o), ref, 1e-5, 1e-4);
}

// 16-bit P and V with unquantized Q·Kᵀ: the only errors are the two 16-bit roundings
// (relative 2^-11 for FP16, 2^-8 for BF16) of P̃ and V; the output of a weighted
// mean of Gaussian V has |error| <= ~2·2^-p·max|V| ~ 4·2^-p, checked with a 2x margin.
TEST(Sage2Emulator, SixteenBitPvIsCloseToReference) {
  const Case c{1, 2, 2, 96, 200, 64, Mask::Causal};
  const Inputs in = make_inputs(c, 11);
  const auto ref = reference::attention_forward(in.q, in.k, in.v, {c.mask, std::nullopt});
  for (auto [fmt, ulp] :
       {std::pair{PvFormat::Fp16, 1.0 / 2048}, std::pair{PvFormat::Bf16, 1.0 / 256}}) {
    Sage2Options o;
    o.qk_format = QkFormat::Fp32;
    o.pv_format = fmt;
    o.row_sum = emulate::RowSum::FloatP;  // the true denominator: the LSE is compared at 1e-4
    expect_close(emulate::sage2_attention(in.q, in.k, in.v, {c.mask, std::nullopt}, o), ref,
                 8.0 * ulp, 1e-4);
  }
}

// SageAttention2-8b (defaults: INT8 per-thread, sampled-mean K smoothing, E4M3 P·V,
// FP22 accumulator) on Gaussian inputs with a strong K channel bias. The paper reports
// CosSim ~0.999+ on real models; here the bias is removed by smoothing, so INT8 scores
// (relative error ~1/254 per element) and E4M3 P (2^-4) give CosSim >= 0.999.
TEST(Sage2Emulator, Sage2EightBitAccuracyWithKBias) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  for (int d : {64, 128}) {
    const Case c{1, 2, 2, 200, 333, d, Mask::None};
    const Inputs in = make_inputs(c, seed + d, 4.0f);
    const auto ref = reference::attention_forward(in.q, in.k, in.v);
    const auto e = emulate::sage2_attention(in.q, in.k, in.v, {});
    const auto m = metrics::compare(e.o.data, ref.o.data);
    EXPECT_GE(m.cos_sim, 0.999) << "d=" << d;
    EXPECT_LE(m.rel_l1, 0.05) << "d=" << d;
    // LSE with smoothing corrected: INT8 score errors are ~|x|/254 ~ 0.01-0.05 nats.
    const auto ml = metrics::compare(e.lse, ref.lse);
    EXPECT_LE(ml.max_abs, 0.05) << "d=" << d;
  }
}

// Smoothing K leaves the LSE consistent with the reference under INT8 (the q·c
// correction), and it is what makes INT8 accurate with a K channel bias.
TEST(Sage2Emulator, KSmoothingHelpsAndKeepsLse) {
  const Case c{1, 2, 2, 128, 256, 64, Mask::None};
  const Inputs in = make_inputs(c, 21, 8.0f);
  const auto ref = reference::attention_forward(in.q, in.k, in.v);
  Sage2Options smooth, none;
  none.k_smoothing = emulate::KSmoothing::None;
  smooth.k_smoothing = emulate::KSmoothing::Mean;
  const auto es = emulate::sage2_attention(in.q, in.k, in.v, {}, smooth);
  const auto en = emulate::sage2_attention(in.q, in.k, in.v, {}, none);
  const auto ms = metrics::compare(es.o.data, ref.o.data);
  const auto mn = metrics::compare(en.o.data, ref.o.data);
  EXPECT_GT(ms.cos_sim, mn.cos_sim);
  EXPECT_LE(metrics::compare(es.lse, ref.lse).max_abs, 0.05);
}

// SageAttention2 §3.2: finer Q/K groups give smaller amax per group, hence smaller
// INT4 errors. Fixed seed (a direction test, not a margin test).
TEST(Sage2Emulator, Int4PerThreadBeatsPerBlock) {
  const Case c{1, 4, 4, 256, 256, 64, Mask::None};
  const Inputs in = make_inputs(c, 1234, 2.0f);
  const auto ref = reference::attention_forward(in.q, in.k, in.v);
  auto err = [&](Granularity g) {
    Sage2Options o;
    o.qk_format = QkFormat::Int4;
    o.granularity = g;
    return metrics::compare(emulate::sage2_attention(in.q, in.k, in.v, {}, o).o.data, ref.o.data);
  };
  const auto thread = err(Granularity::PerThread), block = err(Granularity::PerBlock),
             tensor = err(Granularity::PerTensor);
  EXPECT_GT(thread.cos_sim, block.cos_sim);
  EXPECT_LT(thread.rel_l1, block.rel_l1);
  EXPECT_LT(block.rel_l1, tensor.rel_l1);
}

// SageAttention2 §3.3 (Table 3): E4M3 is the best 8-bit format for P̃. Held with V
// fixed (FP16) so that only P's format differs, on peaked rows (logits of std ~3) over
// 1024 keys, where most P̃ are small: E4M3 keeps their relative precision, INT8 with
// the static scale 1/127 does not, and E5M2 has one mantissa bit fewer. On diffuse rows
// (logit std <= 1, P̃ mostly near 1) INT8's uniform step 1/127 beats E4M3's 1/16
// relative step — and with V in the same format as P, INT8 V beats E4M3 V on Gaussian
// V — so the paper's direction depends on the attention's shape; see the report.
TEST(Sage2Emulator, E4M3PBeatsE5M2AndInt8OnPeakedRows) {
  const Case c{1, 2, 2, 128, 1024, 64, Mask::None};
  const Tensor4 q = gaussian(1, 2, 128, 64, 77, 3.0f), k = gaussian(1, 2, 1024, 64, 78, 1.0f, 2.0f),
                v = gaussian(1, 2, 1024, 64, 79);
  const auto ref = reference::attention_forward(q, k, v);
  auto l1 = [&](PvFormat f) {
    Sage2Options o;
    o.qk_format = QkFormat::Fp32;  // isolate P·V
    o.pv_format = f;
    o.v_format = PvFormat::Fp16;
    return metrics::compare(emulate::sage2_attention(q, k, v, {}, o).o.data, ref.o.data).rel_l1;
  };
  const double e4m3 = l1(PvFormat::E4M3), e5m2 = l1(PvFormat::E5M2), int8 = l1(PvFormat::Int8),
               fp16 = l1(PvFormat::Fp16);
  EXPECT_LT(fp16, e4m3);
  EXPECT_LT(e4m3, e5m2);
  EXPECT_LT(e4m3, int8);
}

// The arithmetic of steps 5-8 on one query row and one key, computed by hand:
// x = s·(q_scale·k_scale), p = exp2(x - x + log2 448), P8 = E4M3(p) = 448,
// t_c = 448·v8_c, O_c = t_c·v_scale_c / l, LSE = (x + log2(l/448))·ln2 + q·c·sm_scale.
TEST(Sage2Emulator, SingleKeyArithmeticByHand) {
  const Inputs in = make_inputs({1, 1, 1, 1, 1, 16, Mask::None}, 3);
  const auto z = emulate::quantize_sage2_8b(in.q, in.k, in.v, {});
  const auto e = emulate::sage2_attend(z);
  const float p = std::exp2(emulate::kLog2E4M3Max);
  ASSERT_EQ(numerics::e4m3_round(p), 448.0f);
  for (int c = 0; c < 16; ++c) {
    const float v8 = numerics::e4m3_decode(z.vt_f8[c * z.nkv_pad + 0]);
    const float t = 448.0f * v8;
    EXPECT_EQ(e.o.at(0, 0, 0, c), (0.0f * 1.0f + t * z.v_scale[c]) / p) << c;
  }
  std::int32_t s = 0;
  for (int c = 0; c < z.head_dim_padded; ++c) s += z.q_i8[c] * z.k_i8[c];
  const float x = static_cast<float>(s) * (z.q_scale[0] * z.k_scale[0]);
  EXPECT_EQ(e.lse[0], (x + std::log2(p / 448.0f)) * emulate::detail::kLn2 + z.q_dot_c[0]);
}

// ---- workspace layout ----------------------------------------------------------

TEST(Sage2Layout, ShapesTailsAndScalesFollowTheKernelWorkspace) {
  const int B = 1, Hq = 2, Hkv = 1, Nq = 70, Nkv = 300, d = 40;
  Inputs in = make_inputs({B, Hq, Hkv, Nq, Nkv, d, Mask::None}, 9, 1.0f);
  // Rows 16..23 of Q head 0 are zero: per-thread groups (16+g, 24+g)? No: rows r and
  // r+8 of warp 1 are 16+g and 24+g; zero both halves of group g = 0..7.
  for (int r = 16; r < 32; ++r)
    for (int c = 0; c < d; ++c) in.q.at(0, 0, r, c) = 0.0f;
  const auto z = emulate::quantize_sage2_8b(in.q, in.k, in.v, {});
  const int D = 64, nq_pad = 128, nkv_pad = 384, tiles = 3;
  ASSERT_EQ(z.head_dim_padded, D);
  ASSERT_EQ(z.nq_pad, nq_pad);
  ASSERT_EQ(z.nkv_pad, nkv_pad);
  ASSERT_EQ(z.q_i8.size(), std::size_t(B * Hq * nq_pad * D));
  ASSERT_EQ(z.q_scale.size(), std::size_t(B * Hq * nq_pad / 64 * 32));
  ASSERT_EQ(z.q_dot_c.size(), std::size_t(B * Hq * nq_pad));
  ASSERT_EQ(z.k_i8.size(), std::size_t(B * Hkv * nkv_pad * D));
  ASSERT_EQ(z.k_scale.size(), std::size_t(B * Hkv * nkv_pad / 128 * 4));
  ASSERT_EQ(z.k_mean.size(), std::size_t(B * Hkv * D));
  ASSERT_EQ(z.vt_f8.size(), std::size_t(B * Hkv * D * nkv_pad));
  ASSERT_EQ(z.v_scale.size(), std::size_t(B * Hkv * tiles * D));

  // Tails (rows >= Nq, tokens >= Nkv, channels >= d) are zero.
  for (int h = 0; h < Hq; ++h)
    for (int r = 0; r < nq_pad; ++r)
      for (int c = 0; c < D; ++c)
        if (r >= Nq || c >= d) ASSERT_EQ(z.q_i8[(h * nq_pad + r) * D + c], 0);
  for (int j = 0; j < nkv_pad; ++j)
    for (int c = 0; c < D; ++c) {
      if (j >= Nkv || c >= d) ASSERT_EQ(z.k_i8[j * D + c], 0);
      // Vᵀ is indexed by position: the token there is v_token_at_position(j).
      if (groups::v_token_at_position(j) >= Nkv || c >= d) ASSERT_EQ(z.vt_f8[c * nkv_pad + j], 0);
    }
  for (int c = d; c < D; ++c) {
    ASSERT_EQ(z.k_mean[c], 0.0f);
    for (int t = 0; t < tiles; ++t) ASSERT_EQ(z.v_scale[t * D + c], 0.0f);
  }
  // Q block 1 of each head (rows 64..127) holds rows 64..69 only; its per-thread groups
  // of rows >= 70 (g = 6, 7 of warp 0, and warps 1..3) have no valid row: scale 0.
  for (int h = 0; h < Hq; ++h) {
    for (int gi = 0; gi < 32; ++gi) {
      const bool has_rows = gi < 8 && (64 + gi < Nq);  // warp 0 rows 64+g (and 72+g: tail)
      const float s = z.q_scale[h * 64 + 32 + gi];
      if (has_rows) {
        EXPECT_GT(s, 0.0f) << gi;
      } else {
        EXPECT_EQ(s, 0.0f) << gi;
      }
    }
  }
  // The zeroed rows 16..31 of head 0 are warp 1 of block 0: groups 8..15 have scale 0.
  for (int gi = 8; gi < 16; ++gi) EXPECT_EQ(z.q_scale[gi], 0.0f);

  // Per-thread Q scale, recomputed: (amax/127)·scale_log2 over rows r, r+8; values RNE.
  const float scale_log2 = z.sm_scale * 1.4426950408889634f;
  EXPECT_EQ(z.scale_log2, scale_log2);
  for (int r : {0, 5, 40, 66}) {
    float amax = 0.0f;
    for (int rr : {r, r + 8})
      if (rr < Nq)
        for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(in.q.at(0, 1, rr, c)));
    const int slot = (r / 64) * 32 + groups::q_thread_group_in_block(r);
    EXPECT_EQ(z.q_scale[64 + slot], (amax / 127.0f) * scale_log2) << r;
    for (int c = 0; c < d; ++c)
      EXPECT_EQ(z.q_i8[(nq_pad + r) * D + c],
                numerics::int8_quantize(in.q.at(0, 1, r, c), 127.0f / amax));
  }
  // Sampled smoothing vector (Nkv = 300 > 256): tokens floor(i·300/256).
  for (int c = 0; c < d; ++c) {
    double s = 0.0;
    for (int i = 0; i < 256; ++i) s += in.k.at(0, 0, i * 300 / 256, c);
    EXPECT_NEAR(z.k_mean[c], s / 256.0, 1e-6) << c;
  }
  // Per-thread K scale: tokens c with (c % 8) / 2 == g of a tile, over k - c_mean.
  for (int t = 0; t < tiles; ++t)
    for (int g = 0; g < 4; ++g) {
      float amax = 0.0f;
      for (int j = t * 128; j < std::min(Nkv, t * 128 + 128); ++j)
        if ((j % 8) / 2 == g)
          for (int c = 0; c < d; ++c)
            amax = std::max(amax, std::fabs(in.k.at(0, 0, j, c) - z.k_mean[c]));
      EXPECT_EQ(z.k_scale[t * 4 + g], amax / 127.0f);
    }
  // q_dot_c = sm_scale·q·c on valid rows, 0 on tails.
  for (int r = 0; r < nq_pad; ++r) {
    double s = 0;
    if (r < Nq)
      for (int c = 0; c < d; ++c) s += double(in.q.at(0, 1, r, c)) * z.k_mean[c];
    EXPECT_NEAR(z.q_dot_c[nq_pad + r], z.sm_scale * s, 1e-5) << r;
  }
  // Vᵀ: position k of each 16 holds token v_token_at_position(k); per-channel scale
  // amax/448 (the same in every tile's slot) and codes E4M3(v·448/amax), where amax is
  // 4x the amax of the 256 sampled tokens floor(i·300/256), or the amax over all tokens
  // where that is larger.
  for (int c = 0; c < d; ++c) {
    float all = 0.0f, sampled = 0.0f;
    for (int j = 0; j < Nkv; ++j) all = std::max(all, std::fabs(in.v.at(0, 0, j, c)));
    for (int i = 0; i < 256; ++i)
      sampled = std::max(sampled, std::fabs(in.v.at(0, 0, i * Nkv / 256, c)));
    const float amax = std::max(all, numerics::kAmaxSampleMargin * sampled);
    for (int t = 0; t < tiles; ++t) {
      ASSERT_EQ(z.v_scale[t * D + c], amax / 448.0f);
      for (int pos = t * 128; pos < t * 128 + 128; ++pos) {
        const int j = groups::v_token_at_position(pos);
        const std::uint8_t want =
            j < Nkv ? numerics::e4m3_encode(in.v.at(0, 0, j, c) * (448.0f / amax)) : 0;
        ASSERT_EQ(z.vt_f8[c * nkv_pad + pos], want) << "c=" << c << " pos=" << pos;
      }
    }
  }
}

// A GPU test copies the kernel's workspace into a Sage2Quantized and rebuilds the
// emulator's views from it: from our own workspace that must give the same output bit
// for bit.
TEST(Sage2Layout, ViewsRebuiltFromWorkspaceGiveTheSameOutput) {
  const Inputs in = make_inputs({1, 2, 1, 100, 300, 64, Mask::Causal}, 6, 2.0f);
  const AttentionParams p{Mask::Causal, std::nullopt};
  auto z = emulate::quantize_sage2_8b(in.q, in.k, in.v, p);
  const auto want = emulate::sage2_attend(z);
  std::fill(z.q_row_scale.begin(), z.q_row_scale.end(), 0.0f);
  std::fill(z.k_token_scale.begin(), z.k_token_scale.end(), 0.0f);
  std::fill(z.v_value.begin(), z.v_value.end(), 0.0f);
  emulate::sage2_views_from_workspace(z);
  const auto got = emulate::sage2_attend(z);
  EXPECT_EQ(got.o.data, want.o.data);
  EXPECT_EQ(got.lse.size(), want.lse.size());
  for (std::size_t i = 0; i < got.lse.size(); ++i) EXPECT_EQ(got.lse[i], want.lse[i]) << i;
}

TEST(Sage2Layout, CoarserGranularitiesReplicateOverThreadSlots) {
  const Inputs in = make_inputs({1, 1, 1, 128, 256, 64, Mask::None}, 4);
  for (auto g : {Granularity::PerWarp, Granularity::PerBlock, Granularity::PerTensor}) {
    Sage2Options o;
    o.granularity = g;
    const auto z = emulate::quantize_sage2(in.q, in.k, in.v, {}, o);
    const int q_rows = g == Granularity::PerWarp ? 16 : g == Granularity::PerBlock ? 64 : 128;
    for (int r = 0; r < 128; ++r) {
      const int slot = (r / 64) * 32 + groups::q_thread_group_in_block(r);
      const int r0 = r / q_rows * q_rows;
      const int slot0 = (r0 / 64) * 32 + groups::q_thread_group_in_block(r0);
      ASSERT_EQ(z.q_scale[slot], z.q_scale[slot0]) << r;
    }
    for (int j = 0; j < 256; ++j) {
      const int slot = (j / 128) * 4 + (j % 8) / 2;
      const int slot0 = g == Granularity::PerTensor ? 0 : (j / 128) * 4;
      ASSERT_EQ(z.k_scale[slot], z.k_scale[slot0]) << j;
    }
  }
  Sage2Options tok;
  tok.granularity = Granularity::PerToken;
  const auto zt = emulate::quantize_sage2(in.q, in.k, in.v, {}, tok);
  EXPECT_TRUE(zt.q_scale.empty());  // no per-row slot in the kernel layout
  EXPECT_TRUE(zt.k_scale.empty());
  EXPECT_EQ(zt.q_row_scale.size(), 128u);
}

TEST(Sage2Layout, GivenMeanAndGlobalVScale) {
  const Inputs in = make_inputs({1, 2, 2, 64, 200, 64, Mask::None}, 8);
  std::vector<float> c(2 * 64);
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = 0.01f * static_cast<float>(i);
  const auto z = emulate::quantize_sage2_8b(in.q, in.k, in.v, {}, c.data());
  for (int h = 0; h < 2; ++h)
    for (int ch = 0; ch < 64; ++ch) EXPECT_EQ(z.k_mean[h * 64 + ch], c[h * 64 + ch]);
  Sage2Options o;
  o.v_scale = Granularity::PerChannel;
  const auto zg = emulate::quantize_sage2(in.q, in.k, in.v, {}, o);
  for (int ch = 0; ch < 64; ++ch) {
    float amax = 0.0f;
    for (int j = 0; j < 200; ++j) amax = std::max(amax, std::fabs(in.v.at(0, 0, j, ch)));
    EXPECT_EQ(zg.v_scale[0 * 64 + ch], amax / 448.0f);
    EXPECT_EQ(zg.v_scale[1 * 64 + ch], amax / 448.0f);
  }
}

// V scales without a pass over all of V: one per 128-token tile (PerBlock) or per
// (tile, channel). The tile scale is the amax of the tile over every channel, so no
// code saturates; and because E4M3 is a floating-point format, one scale per tile is
// as accurate as one per channel on these inputs (bench/NOTES.md v13f measures channel spreads).
TEST(Sage2Layout, TileVScalesAndTheirAccuracy) {
  const Inputs in = make_inputs({1, 2, 2, 64, 300, 64, Mask::None}, 9);
  Sage2Options o;
  o.v_scale = Granularity::PerBlock;
  const auto z = emulate::quantize_sage2(in.q, in.k, in.v, {}, o);
  const int tiles = 3;  // 300 tokens padded to 384
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < tiles; ++t) {
      float amax = 0.0f;
      for (int j = t * 128; j < std::min(300, (t + 1) * 128); ++j)
        for (int ch = 0; ch < 64; ++ch) amax = std::max(amax, std::fabs(in.v.at(0, h, j, ch)));
      for (int ch = 0; ch < 64; ++ch)
        ASSERT_EQ(z.v_scale[(h * tiles + t) * 64 + ch], amax / 448.0f) << h << " " << t;
    }
  const auto ref = reference::attention_forward(in.q, in.k, in.v, {});
  for (Granularity g :
       {Granularity::PerBlock, Granularity::PerTileChannel, Granularity::PerTensor}) {
    Sage2Options og;
    og.v_scale = g;
    const auto e = emulate::sage2_attend(emulate::quantize_sage2(in.q, in.k, in.v, {}, og));
    const auto m =
        metrics::compare(std::span<const float>(e.o.data), std::span<const double>(ref.o.data));
    EXPECT_GE(m.cos_sim, 0.999) << static_cast<int>(g);
  }
}

// For dropping the V amax pass (bench/NOTES.md, v14i): V scaled per channel by exp(sigma·z_c)
// (channels up to ~400x apart at sigma = 3), some tokens x30 (in the 256-token sample
// or not). One scale per channel (the kernel's), one per 128-token tile, and a two-level
// scale (per channel from the sample of the K smoothing vector, times one per tile;
// emulated as V / s_c quantized per tile, O times s_c) give the same accuracy: E4M3 is a
// floating-point format, so the scale only has to keep the values in its range.
// The inputs of the V-scale tests: synthetic Q, K and V (one batch, H heads, N tokens),
// and V's channels scaled by exp(sigma·z_c) with z Gaussian (up to ~400x apart at
// sigma = 3), x30 on the tokens j % period == at.
struct VScaleInputs {
  emulate::SyntheticInputs syn;
  std::vector<double> z;

  VScaleInputs(int heads, int n, int d, std::uint64_t seed, std::uint64_t z_seed) {
    emulate::SyntheticSpec spec;
    spec.heads_q = spec.heads_kv = heads;
    spec.seq_q = spec.seq_kv = n;
    spec.head_dim = d;
    spec.seed = seed;
    syn = emulate::make_synthetic(spec);
    std::mt19937_64 rng(z_seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    z.resize(d);
    for (double& x : z) x = normal(rng);
  }
  // at < 0: no x30 tokens.
  Tensor4 v(double sigma, int period, int at) const {
    Tensor4 out = syn.v;
    for (int h = 0; h < out.h; ++h)
      for (int j = 0; j < out.n; ++j)
        for (int c = 0; c < out.d; ++c) {
          const bool is_big = at >= 0 && j % period == at;
          out.at(0, h, j, c) *= static_cast<float>(std::exp(sigma * z[c])) * (is_big ? 30.f : 1.f);
        }
    return out;
  }
};

TEST(Sage2Layout, VScaleGranularityBarelyMattersForE4M3) {
  constexpr int N = 512, D = 128, H = 2;
  const VScaleInputs in(H, N, D, 7, 11);
  const auto& syn = in.syn;
  auto cos_of = [&](const Tensor4& v, Granularity g, const std::vector<float>* sc) {
    Sage2Options o;
    o.v_scale = g;
    Tensor4 vq = v;
    if (sc != nullptr)
      for (int h = 0; h < H; ++h)
        for (int j = 0; j < N; ++j)
          for (int c = 0; c < D; ++c) vq.at(0, h, j, c) = v.at(0, h, j, c) / (*sc)[h * D + c];
    auto e = emulate::sage2_attend(emulate::quantize_sage2(syn.q, syn.k, vq, {}, o));
    if (sc != nullptr)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < N; ++i)
          for (int c = 0; c < D; ++c) e.o.at(0, h, i, c) *= (*sc)[h * D + c];
    const auto ref = reference::attention_forward(syn.q, syn.k, v, {});
    return metrics::compare(std::span<const float>(e.o.data), std::span<const double>(ref.o.data))
        .cos_sim;
  };
  for (double sigma : {0.0, 3.0})
    for (int big : {0, 1, 2}) {  // no big tokens; every 128th (in the sample); 128k + 1 (not)
      SCOPED_TRACE("sigma=" + std::to_string(sigma) + " big=" + std::to_string(big));
      const Tensor4 v = in.v(sigma, 128, big - 1);
      // Sampled channel amax (tokens floor(i·N/256)), floored so no scale is 0.
      std::vector<float> sc(H * D);
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < D; ++c) {
          float m = 0.f;
          for (int i = 0; i < 256; ++i) m = std::max(m, std::fabs(v.at(0, h, i * N / 256, c)));
          sc[h * D + c] = std::max(m, 1e-30f);
        }
      const double channel = cos_of(v, Granularity::PerChannel, nullptr);
      const double tile = cos_of(v, Granularity::PerBlock, nullptr);
      const double two_level = cos_of(v, Granularity::PerBlock, &sc);
      // Four seeds of z gave differences within 3·10⁻⁴ either way (bench/NOTES.md, v14i).
      EXPECT_GE(std::min({channel, tile, two_level}), 0.999);
      EXPECT_NEAR(tile, channel, 4e-4);
      EXPECT_NEAR(two_level, channel, 4e-4);
    }
}

// The kernel's V amax is a bound from the token sample (4 × its amax, or the amax over
// all tokens where that is larger; bench/NOTES.md v17a): the scale is at most 4x the exact one,
// so the largest code is >= 112 of 448 and E4M3's relative step is unchanged above its
// subnormals.
// Same inputs as above (channels up to ~400x apart, x30 tokens in or out of the sample).
TEST(Sage2Layout, SampledVAmaxBoundIsAsAccurateAsTheExactAmax) {
  constexpr int N = 1000, D = 128, H = 2;
  const VScaleInputs in(H, N, D, 21, 5);
  const auto& syn = in.syn;
  for (double sigma : {0.0, 3.0})
    for (int big : {0, 1, 2}) {  // no big tokens; every 125th (sampled); 125k + 1 (not)
      SCOPED_TRACE("sigma=" + std::to_string(sigma) + " big=" + std::to_string(big));
      const Tensor4 v = in.v(sigma, 125, big - 1);
      const auto ref = reference::attention_forward(syn.q, syn.k, v, {});
      double cos[2];
      for (VAmax rule : {VAmax::AllTokens, VAmax::SampleBound}) {
        Sage2Options o;
        o.v_amax = rule;
        const auto zq = emulate::quantize_sage2(syn.q, syn.k, v, {}, o);
        // Every scale is the exact one or up to 4x it; never below (no saturation).
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < D; ++c) {
            float all = 0.f;
            for (int j = 0; j < N; ++j) all = std::max(all, std::fabs(v.at(0, h, j, c)));
            const float s = zq.v_scale[h * zq.kv_tiles() * D + c];
            ASSERT_GE(s, all / 448.f);
            ASSERT_LE(s, 4.f * all / 448.f);
          }
        cos[static_cast<int>(rule)] =
            metrics::compare(std::span<const float>(emulate::sage2_attend(zq).o.data),
                             std::span<const double>(ref.o.data))
                .cos_sim;
      }
      EXPECT_GE(cos[1], 0.999);
      EXPECT_NEAR(cos[1], cos[0], 2e-4);
    }
}

// Row sums of the cast P (a ones column in the P·V MMA, the kernel's since bench/NOTES.md v15c)
// against sums of the FP32 P: numerator and denominator then use the same weights. Over
// head dims, masks, lengths and seeds, neither is measurably less accurate.
TEST(Sage2Emulator, RowSumsOfCastPAreAsAccurateAsFloatSums) {
  for (int d : {64, 128})
    for (Mask mask : {Mask::None, Mask::Causal})
      for (uint64_t seed : {3u, 4u}) {
        emulate::SyntheticSpec spec;
        spec.heads_q = spec.heads_kv = 2;
        spec.seq_q = spec.seq_kv = 384;
        spec.head_dim = d;
        spec.seed = seed;
        const auto syn = emulate::make_synthetic(spec);
        AttentionParams ap;
        ap.mask = mask;
        const auto ref = reference::attention_forward(syn.q, syn.k, syn.v, ap);
        auto metrics_of = [&](RowSum rs) {
          Sage2Options o;
          o.row_sum = rs;
          const auto e = emulate::sage2_attend(emulate::quantize_sage2(syn.q, syn.k, syn.v, ap, o));
          return metrics::compare(std::span<const float>(e.o.data),
                                  std::span<const double>(ref.o.data));
        };
        const auto f = metrics_of(RowSum::FloatP), q = metrics_of(RowSum::QuantizedP);
        SCOPED_TRACE("d=" + std::to_string(d) + " causal=" + std::to_string(mask == Mask::Causal) +
                     " seed=" + std::to_string(seed));
        std::printf("d=%d causal=%d seed=%d  float: cos %.6f l1 %.5f  cast: cos %.6f l1 %.5f\n", d,
                    int(mask == Mask::Causal), int(seed), f.cos_sim, f.rel_l1, q.cos_sim, q.rel_l1);
        EXPECT_GE(q.cos_sim, f.cos_sim - 1e-4);
        EXPECT_LE(q.rel_l1, f.rel_l1 * 1.1);
      }
}

// Single-level accumulation (every tile's P·V straight into O through the FP22
// accumulator, FlashAttention-3's FP8 style) against SageAttention2's two levels: the
// row sums ride in the same MMA (RowSum::QuantizedP), so the truncation's bias cancels
// in O / l and the output stays as accurate, here over head dims 128 and 256 and a long
// row (4096 keys: 128 FP22 steps per row). With an ideal FP32 accumulator the two differ
// by FP32 rounding only. bench/NOTES.md v38: why a d = 256 kernel would want it.
TEST(Sage2Emulator, SingleLevelAccumulationIsAsAccurateWithQuantizedRowSums) {
  for (int d : {128, 256}) {
    emulate::SyntheticSpec spec;
    spec.heads_q = spec.heads_kv = 1;
    spec.seq_q = 128;
    spec.seq_kv = 4096;
    spec.head_dim = d;
    spec.seed = 11;
    const auto syn = emulate::make_synthetic(spec);
    const auto ref = reference::attention_forward(syn.q, syn.k, syn.v, {});
    auto run = [&](emulate::AccumulationLevels levels, emulate::Fp8Accumulator acc) {
      Sage2Options o;
      o.levels = levels;
      o.accumulator = acc;
      return emulate::sage2_attention(syn.q, syn.k, syn.v, {}, o);
    };
    using L = emulate::AccumulationLevels;
    using A = emulate::Fp8Accumulator;
    const auto two = run(L::TwoLevel, A::Fp22), one = run(L::Single, A::Fp22);
    const auto m2 = metrics::compare(std::span<const float>(two.o.data), std::span<const double>(ref.o.data));
    const auto m1 = metrics::compare(std::span<const float>(one.o.data), std::span<const double>(ref.o.data));
    std::printf("d=%d two-level: cos %.6f l1 %.5f  single: cos %.6f l1 %.5f\n", d, m2.cos_sim,
                m2.rel_l1, m1.cos_sim, m1.rel_l1);
    EXPECT_NE(two.o.data, one.o.data);  // the switch changes the arithmetic
    EXPECT_GE(m1.cos_sim, m2.cos_sim - 1e-4);
    EXPECT_LE(m1.rel_l1, m2.rel_l1 * 1.05);
    const auto two32 = run(L::TwoLevel, A::Fp32), one32 = run(L::Single, A::Fp32);
    const auto m = metrics::compare(std::span<const float>(one32.o.data), std::span<const float>(two32.o.data));
    EXPECT_GE(m.cos_sim, 1.0 - 1e-10);
    EXPECT_LE(m.rel_l1, 1e-5);
    // The one-level row sum runs through the FP22 truncations like a channel of O (the
    // hardware's ones columns): biased low by at most a 2^-14 relative step per
    // truncation (Nkv / 32 of them), on average half of that.
    const double steps = spec.seq_kv / 32.0, bound = steps * std::ldexp(1.0, -14);
    double mean = 0.0;
    for (std::size_t i = 0; i < two.lse.size(); ++i) {
      EXPECT_LE(one.lse[i], two.lse[i] + 1e-4);
      EXPECT_GE(one.lse[i], two.lse[i] - bound);
      mean += one.lse[i] - two.lse[i];
    }
    mean /= static_cast<double>(two.lse.size());
    EXPECT_LT(mean, 0.0);
    EXPECT_GT(mean, -0.75 * bound);
    // Without the truncation the two agree to FP32 rounding.
    for (std::size_t i = 0; i < two32.lse.size(); ++i) EXPECT_NEAR(one32.lse[i], two32.lse[i], 1e-4);
  }
}

// The head-dim-256 kernel's contract (sage2_wide_options): 64-key softmax steps, one
// level, the row sums in FP32 from P before its cast, a truncation of O every fp22_keys
// products, the head dim padded to 256. The truncation interval then moves O slightly
// and the LSE not at all (l never passes through the FP22 accumulator).
TEST(Sage2Emulator, WideOptionsKeepTheRowSumsOutOfTheTruncation) {
  emulate::SyntheticSpec spec;
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.seq_q = 64;
  spec.seq_kv = 700;
  spec.head_dim = 200;
  spec.seed = 1;
  const auto syn = emulate::make_synthetic(spec);
  EXPECT_EQ(emulate::sage2_wide_options().row_sum, emulate::RowSum::FloatP);
  EXPECT_EQ(emulate::sage2_wide_options().fp22_keys, emulate::kWideFp22Keys);
  Sage2Options ideal = emulate::sage2_wide_options();
  ideal.accumulator = emulate::Fp8Accumulator::Fp32;
  const auto base = emulate::sage2_attention(syn.q, syn.k, syn.v, {}, ideal);
  for (int keys : {32, 16, 4, 2, 1}) {
    const auto e =
        emulate::sage2_attention(syn.q, syn.k, syn.v, {}, emulate::sage2_wide_options(keys));
    EXPECT_EQ(e.lse, base.lse) << keys;  // the same FP32 sums, the same bits
    EXPECT_NE(e.o.data, base.o.data) << keys;  // O does pass through the truncation
    const auto m = metrics::compare(std::span<const float>(e.o.data), std::span<const float>(base.o.data));
    EXPECT_GE(m.cos_sim, 1.0 - 2e-5) << keys;
  }
}

// Why the row sums left the accumulator: with them in its ones columns and a truncation
// per product (what those all-positive columns followed on the GPU, v44b), l falls with
// the row's length and O / l rises: at 4096 keys O's scale <o, r>/<r, r> against FP64 is
// off by ~1.8% (16K keys: ~30%, bench/NOTES.md v48). Under the contract it is 0.45% low
// here (the FP22 model's truncation of O's own running sums), and the LSE, summed in FP32
// from P before its cast, is within 1e-4 of FP64 (measured 6e-5).
TEST(Sage2Emulator, WideContractKeepsOsScaleOnLongRows) {
  emulate::SyntheticSpec spec;
  spec.seq_q = 64;
  spec.seq_kv = 4096;
  spec.head_dim = 256;
  spec.k_bias_std = 0.0;
  spec.q_bias_std = 0.0;
  spec.seed = 3;
  const auto syn = emulate::make_synthetic(spec);
  const auto ref = reference::attention_forward(syn.q, syn.k, syn.v, {});
  auto scale_and_lse = [&](const Sage2Options& o) {
    const auto e = emulate::sage2_attention(syn.q, syn.k, syn.v, {}, o);
    double num = 0, den = 0, gap = 0;
    for (std::size_t i = 0; i < e.o.data.size(); ++i) {
      num += e.o.data[i] * ref.o.data[i];
      den += ref.o.data[i] * ref.o.data[i];
    }
    for (std::size_t i = 0; i < e.lse.size(); ++i) gap += e.lse[i] - ref.lse[i];
    return std::pair{num / den, gap / static_cast<double>(e.lse.size())};
  };
  const auto [scale, gap] = scale_and_lse(emulate::sage2_wide_options());
  std::printf("contract: O scale %.5f, mean LSE - FP64 %.3e\n", scale, gap);
  EXPECT_NEAR(scale, 1.0, 1e-2);
  EXPECT_NEAR(gap, 0.0, 1e-3);
  Sage2Options ones = emulate::sage2_wide_options(1);
  ones.row_sum = emulate::RowSum::QuantizedP;
  const auto [scale1, gap1] = scale_and_lse(ones);
  std::printf("row sums in the accumulator, a truncation per product: O scale %.5f, LSE %.3e\n",
              scale1, gap1);
  EXPECT_GT(std::abs(scale1 - 1.0), 1.5e-2);  // what the contract avoids
  EXPECT_LT(gap1, -3e-2);
}

// Padding to 256 instead of 192 (d = 136) adds zero channels only: the same O and LSE bits.
TEST(Sage2Emulator, WidePaddingChangesNoBits) {
  const Inputs in = make_inputs({1, 2, 1, 100, 300, 136, Mask::Causal}, 5);
  Sage2Options wide = emulate::sage2_wide_options();
  const auto z = emulate::quantize_sage2(in.q, in.k, in.v, {Mask::Causal}, wide);
  EXPECT_EQ(z.head_dim_padded, 256);
  EXPECT_EQ(z.q_i8.size(), std::size_t{2} * 128 * 256);
  for (int r = 0; r < 100; ++r)
    for (int c = 136; c < 256; ++c) ASSERT_EQ(z.q_i8[r * 256 + c], 0);
  Sage2Options narrow = wide;
  narrow.head_dim_padded = 0;  // 192
  const auto a = emulate::sage2_attend(z);
  const auto b = emulate::sage2_attention(in.q, in.k, in.v, {Mask::Causal}, narrow);
  EXPECT_EQ(a.o.data, b.o.data);
  EXPECT_EQ(a.lse, b.lse);
  // The defaults are untouched by the new options' defaults.
  const Sage2Options d;
  EXPECT_EQ(d.softmax_keys, 128);
  EXPECT_EQ(d.fp22_keys, 32);
  EXPECT_EQ(d.head_dim_padded, 0);
}

TEST(Sage2Emulator, AllZeroInputsGiveZerosNotNaN) {
  const Tensor4 q(1, 1, 10, 32), k(1, 1, 20, 32), v(1, 1, 20, 32);
  const auto e = emulate::sage2_attention(q, k, v, {});
  for (float x : e.o.data) EXPECT_EQ(x, 0.0f);
  for (float l : e.lse) EXPECT_NEAR(l, std::log(20.0f), 1e-5);  // uniform over 20 keys
}

// A NaN in Q reaches the outputs of its quantization group (its scale is NaN) and
// no other row; it never turns into a silent number.
TEST(Sage2Emulator, NanInQGivesNanInItsGroupOnly) {
  Inputs in = make_inputs({1, 1, 1, 64, 130, 32, Mask::None}, 2);
  in.q.at(0, 0, 3, 5) = std::numeric_limits<float>::quiet_NaN();
  const auto e = emulate::sage2_attention(in.q, in.k, in.v, {});
  for (int r = 0; r < 64; ++r) {
    const bool in_group = r == 3 || r == 11;  // per-thread group of row 3: rows 3, 11
    EXPECT_EQ(std::isnan(e.o.at(0, 0, r, 0)), in_group) << r;
    EXPECT_EQ(std::isnan(e.lse[r]), in_group) << r;
  }
}

TEST(Sage2Emulator, RejectsBadOptionsNamingTheParameter) {
  const Inputs in = make_inputs({1, 2, 1, 8, 8, 16, Mask::None}, 1);
  auto expect_throw_naming = [](auto&& f, const char* name) {
    try {
      f();
      ADD_FAILURE() << "no exception for " << name;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  Sage2Options given;
  given.k_smoothing = emulate::KSmoothing::Given;
  given.k_mean.resize(3);
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, given); }, "k_mean");
  Sage2Options chan;
  chan.granularity = Granularity::PerChannel;
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, chan); }, "granularity");
  Sage2Options vs;
  vs.v_scale = Granularity::PerThread;
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, vs); }, "v_scale");
  Sage2Options single;  // one accumulation of raw codes needs one V scale for every tile
  single.levels = emulate::AccumulationLevels::Single;
  single.v_scale = Granularity::PerTileChannel;
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, single); }, "levels");
  expect_throw_naming(
      [&] {
        emulate::sage2_attention(in.q, in.k, in.v, {Mask::None, 0.0});
      },
      "sm_scale");
  Sage2Options keys3 = emulate::sage2_wide_options(3);
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, keys3); }, "fp22_keys");
  Sage2Options soft;
  soft.softmax_keys = 48;
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, soft); }, "softmax_keys");
  Sage2Options pad;
  pad.head_dim_padded = 100;
  expect_throw_naming([&] { emulate::quantize_sage2(in.q, in.k, in.v, {}, pad); },
                      "head_dim_padded");
  auto z = emulate::quantize_sage2_8b(in.q, in.k, in.v, {});
  z.k_i8.pop_back();
  expect_throw_naming([&] { emulate::sage2_attend(z); }, "k_i8");
}

// ---- the FP22 accumulator model -----------------------------------------------

TEST(Fp22Accumulator, TruncatesTheLowTenFractionBits) {
  EXPECT_EQ(emulate::detail::truncate_to_fp22(1.0f + std::ldexp(1.0f, -13)),
            1.0f + std::ldexp(1.0f, -13));
  EXPECT_EQ(emulate::detail::truncate_to_fp22(1.0f + std::ldexp(1.0f, -14)), 1.0f);
  EXPECT_EQ(emulate::detail::truncate_to_fp22(-1.9999999f), -(2.0f - std::ldexp(1.0f, -13)));
  EXPECT_TRUE(
      std::isnan(emulate::detail::truncate_to_fp22(std::numeric_limits<float>::quiet_NaN())));
}

// SageAttention2 §3.4: a V with a large channel bias (values ~ 8 +- 1) loses accuracy
// to the FP22 accumulator; both stay close to the reference (two-level accumulation
// bounds the loss to one tile), and FP22 is the worse of the two.
TEST(Fp22Accumulator, CostsAccuracyWithBiasedV) {
  const Case c{1, 2, 2, 64, 512, 64, Mask::None};
  Inputs in = make_inputs(c, 99, 1.0f);
  for (float& x : in.v.data) x += 8.0f;
  const auto ref = reference::attention_forward(in.q, in.k, in.v);
  Sage2Options exact, trunc;
  exact.accumulator = emulate::Fp8Accumulator::Fp32;
  trunc.accumulator = emulate::Fp8Accumulator::Fp22;
  const auto me =
      metrics::compare(emulate::sage2_attention(in.q, in.k, in.v, {}, exact).o.data, ref.o.data);
  const auto mt =
      metrics::compare(emulate::sage2_attention(in.q, in.k, in.v, {}, trunc).o.data, ref.o.data);
  EXPECT_LT(me.rmse, mt.rmse);
  EXPECT_GE(mt.cos_sim, 0.999);
}

// ---- the FP8-per-tensor baseline ---------------------------------------------

TEST(Fp8PerTensor, CloseToReferenceWithoutBiasAndWorseThanSage2WithIt) {
  const Case c{1, 2, 2, 128, 300, 64, Mask::Causal};
  const AttentionParams p{c.mask, std::nullopt};
  const Inputs plain = make_inputs(c, 31);
  const auto ref = reference::attention_forward(plain.q, plain.k, plain.v, p);
  const auto m = metrics::compare(
      emulate::fp8_per_tensor_attention(plain.q, plain.k, plain.v, p).o.data, ref.o.data);
  // E4M3 Q and K (2^-4 relative) on O(1) logits: CosSim ~0.99+.
  EXPECT_GE(m.cos_sim, 0.99);
  // Bounds from the format. E4M3 keeps 3 mantissa bits: a rounding's relative error is
  // at most 2^-4, RMS at most 2^-4/sqrt(3) = 0.036 (uniform within half an ulp).
  // O, RMS: each element is a softmax-weighted mean over 173..300 visible keys; with
  // N(0,1) inputs and sm_scale = 1/8 the scores have unit variance, so
  // sqrt(sum w^2) = sqrt(e/n) ~ 0.12. V's rounding adds 0.036 * 0.12 = 0.0043 RMS and
  // P~'s the same; Q's and K's move each score by sm_scale * 0.036 * sqrt(2 sum q^2 k^2)
  // = 0.036 * sqrt(2) = 0.051 RMS, which reweights the mean by 0.051 * 0.12 = 0.006.
  // Together sqrt(2 * 0.0043^2 + 0.006^2) = 0.0085 (measured 0.0056 over seeds
  // 31..90); the bound is 1.5x the estimate. (A per-element bound from the format alone,
  // 2 * 2^-4 * max|v| for a row that one key dominates, would be ~0.5 and test nothing.)
  EXPECT_LE(m.rmse, 0.0125) << "rel_l1=" << m.rel_l1;
  // LSE: log-sum-exp is 1-Lipschitz in the max norm, so its error is at most the largest
  // score error: 0.051 RMS (above), whose largest over these 76,800 scores is ~4.3
  // sigma = 0.22 (measured worst LSE error 0.06). Fully masked rows stay exact.
  expect_close(emulate::fp8_per_tensor_attention(plain.q, plain.k, plain.v, p), ref,
               std::numeric_limits<double>::infinity(), 0.25);

  const Inputs biased = make_inputs(c, 32, 8.0f);
  const auto refb = reference::attention_forward(biased.q, biased.k, biased.v, p);
  const auto fp8 = metrics::compare(
      emulate::fp8_per_tensor_attention(biased.q, biased.k, biased.v, p).o.data, refb.o.data);
  const auto sa2 = metrics::compare(
      emulate::sage2_attention(biased.q, biased.k, biased.v, p).o.data, refb.o.data);
  EXPECT_LT(sa2.rel_l1, fp8.rel_l1);
}

TEST(Fp8PerTensor, TwoLevelFp32EqualsSingleLevelFp32Closely) {
  const Case c{1, 1, 1, 64, 400, 32, Mask::None};
  const Inputs in = make_inputs(c, 41);
  emulate::Fp8PerTensorOptions a, b;
  a.accumulator = b.accumulator = emulate::Fp8Accumulator::Fp32;
  a.levels = emulate::AccumulationLevels::Single;
  b.levels = emulate::AccumulationLevels::TwoLevel;
  const auto ea = emulate::fp8_per_tensor_attention(in.q, in.k, in.v, {}, a);
  const auto eb = emulate::fp8_per_tensor_attention(in.q, in.k, in.v, {}, b);
  // Same products, other FP32 rounding order: agreement to ~1e-6 relative.
  for (std::size_t i = 0; i < ea.o.size(); ++i) EXPECT_NEAR(ea.o.data[i], eb.o.data[i], 1e-5);
}


// ---- masks beyond causal: sliding windows, key padding, top-left alignment -------------

// Random extended masks (window sides, key-padding lengths with 0 and tails, either
// alignment, causal or not) on shapes with tails, GQA and fully masked rows. Unquantized
// (FP32 Q·Kᵀ and P·V), the emulation is the reference up to FP32 rounding, as in
// UnquantizedMatchesReferenceThroughTilingAndSmoothing (1e-5 on O, 1e-4 on the LSE); rows
// that see no key give O = 0 and LSE = -inf exactly.
TEST(Sage2Masks, UnquantizedMatchesReferenceWithWindowsPaddingAndAlignment) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int round = 0; round < 12; ++round) {
    const Case c{2, 4, pick(0, 1) ? 2 : 4, pick(1, 300), pick(1, 300), 32,
                 pick(0, 1) ? Mask::Causal : Mask::None};
    AttentionParams p{c.mask, std::nullopt};
    p.alignment = pick(0, 1) ? Diagonal::TopLeft : Diagonal::BottomRight;
    p.window_left = pick(0, 2) == 0 ? -1 : pick(0, 200);
    p.window_right = pick(0, 2) == 0 ? -1 : pick(0, 200);
    if (pick(0, 1)) p.kv_lengths = {pick(0, c.nkv), pick(0, 3) == 0 ? 0 : pick(1, c.nkv)};
    SCOPED_TRACE(::testing::Message()
                 << "nq " << c.nq << " nkv " << c.nkv << " causal " << (c.mask == Mask::Causal)
                 << " top_left " << (p.alignment == Diagonal::TopLeft) << " window ("
                 << p.window_left << ", " << p.window_right << ") lengths "
                 << (p.kv_lengths.empty() ? -1 : p.kv_lengths[0]) << ","
                 << (p.kv_lengths.empty() ? -1 : p.kv_lengths[1]));
    const Inputs in = make_inputs(c, seed + round, 2.0f);
    const auto ref = reference::attention_forward(in.q, in.k, in.v, p);
    Sage2Options o;
    o.qk_format = QkFormat::Fp32;
    o.pv_format = PvFormat::Fp32;
    expect_close(emulate::sage2_attention(in.q, in.k, in.v, p, o), ref, 1e-5, 1e-4);
  }
}

// Q's block means and codes depend on Q alone: key padding (a batch entry with no key
// at all, or a short one) leaves them as the unpadded call quantizes them.
TEST(Sage2Masks, KeyPaddingLeavesTheQSmoothingAlone) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  const Case c{2, 2, 1, 150, 200, 64, Mask::None};
  const Inputs in = make_inputs(c, seed, 3.0f);
  emulate::Sage2Options o;
  o.q_smoothing = emulate::QSmoothing::BlockMean;
  AttentionParams plain{c.mask, std::nullopt}, padded = plain;
  padded.kv_lengths = {0, 77};
  const auto a = emulate::quantize_sage2(in.q, in.k, in.v, plain, o);
  const auto b = emulate::quantize_sage2(in.q, in.k, in.v, padded, o);
  ASSERT_FALSE(a.q_mean.empty());
  EXPECT_EQ(a.q_mean, b.q_mean);
  EXPECT_EQ(a.q_i8, b.q_i8);
  EXPECT_EQ(a.q_row_scale, b.q_row_scale);
}

// Key padding is a shorter call: with the kernel's 8-bit defaults, batch entry b with
// kv_lengths[b] = L gives bit for bit what the same entry alone with its first L keys
// gives (the smoothing mean, V's amax bound and every scale group see only those keys),
// whatever the padding keys hold: here NaN and 1e30. A length of 0 gives O = 0 and
// LSE = -inf.
TEST(Sage2Masks, KeyPaddingEqualsTheTruncatedCallAndIgnoresPaddingValues) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  for (auto [nq, nkv, len0, len1, causal] :
       {std::tuple{130, 300, 257, 1, false}, std::tuple{64, 200, 0, 200, false},
        std::tuple{100, 180, 129, 60, true}}) {
    const Case c{2, 2, 1, nq, nkv, 64, causal ? Mask::Causal : Mask::None};
    Inputs in = make_inputs(c, seed + nkv, 3.0f);
    AttentionParams p{c.mask, std::nullopt};
    p.kv_lengths = {len0, len1};
    for (int b = 0; b < 2; ++b)
      for (int j = p.kv_lengths[b]; j < nkv; ++j)
        for (int ch = 0; ch < c.d; ++ch) {
          in.k.at(b, 0, j, ch) = j % 2 ? std::numeric_limits<float>::quiet_NaN() : 1e30f;
          in.v.at(b, 0, j, ch) = j % 3 ? 1e30f : std::numeric_limits<float>::quiet_NaN();
        }
    const auto e = emulate::sage2_attention(in.q, in.k, in.v, p);
    for (int b = 0; b < 2; ++b) {
      const int len = p.kv_lengths[b];
      SCOPED_TRACE(::testing::Message() << "nkv " << nkv << " b " << b << " len " << len);
      if (len == 0) {
        for (int h = 0; h < c.hq; ++h)
          for (int i = 0; i < nq; ++i) {
            EXPECT_EQ(e.lse[(b * c.hq + h) * nq + i], -std::numeric_limits<float>::infinity());
            for (int ch = 0; ch < c.d; ++ch) ASSERT_EQ(e.o.at(b, h, i, ch), 0.0f);
          }
        continue;
      }
      // The entry alone, cut to its first `len` keys; its causal diagonal stays where the
      // full call puts it (i + Nkv - Nq), which a cut call aligns top-left with offset
      // Nkv - Nq only when Nkv == len, so the causal case keeps the full length's rule
      // through a window of right side Nkv - Nq.
      Tensor4 q1(1, c.hq, nq, c.d), k1(1, 1, len, c.d), v1(1, 1, len, c.d);
      for (int h = 0; h < c.hq; ++h)
        for (int i = 0; i < nq; ++i)
          for (int ch = 0; ch < c.d; ++ch) q1.at(0, h, i, ch) = in.q.at(b, h, i, ch);
      for (int j = 0; j < len; ++j)
        for (int ch = 0; ch < c.d; ++ch) {
          k1.at(0, 0, j, ch) = in.k.at(b, 0, j, ch);
          v1.at(0, 0, j, ch) = in.v.at(b, 0, j, ch);
        }
      AttentionParams p1{Mask::None, std::nullopt};
      if (causal) {
        p1.alignment = Diagonal::TopLeft;
        p1.window_right = nkv - nq;  // >= 0 in this case
      }
      const auto e1 = emulate::sage2_attention(q1, k1, v1, p1);
      for (int h = 0; h < c.hq; ++h)
        for (int i = 0; i < nq; ++i) {
          const float l = e.lse[(b * c.hq + h) * nq + i], l1 = e1.lse[h * nq + i];
          ASSERT_TRUE(l == l1 || (std::isnan(l) && std::isnan(l1))) << "h " << h << " row " << i;
          for (int ch = 0; ch < c.d; ++ch)
            ASSERT_EQ(e.o.at(b, h, i, ch), e1.o.at(0, h, i, ch)) << "h " << h << " row " << i;
        }
    }
  }
}

// The 8-bit emulation under a sliding window stays as close to FP64 as without one:
// CosSim >= 0.999 (the bound of Sage2EightBitAccuracyWithKBias), per case.
TEST(Sage2Masks, EightBitWindowAccuracy) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  for (auto [left, right, causal] :
       {std::tuple{64, 64, false}, std::tuple{200, -1, true}, std::tuple{0, 300, false}}) {
    const Case c{1, 2, 2, 333, 333, 128, causal ? Mask::Causal : Mask::None};
    const Inputs in = make_inputs(c, seed + left, 4.0f);
    AttentionParams p{c.mask, std::nullopt};
    p.window_left = left;
    p.window_right = right;
    const auto ref = reference::attention_forward(in.q, in.k, in.v, p);
    const auto e = emulate::sage2_attention(in.q, in.k, in.v, p);
    EXPECT_GE(metrics::compare(e.o.data, ref.o.data).cos_sim, 0.999)
        << "window (" << left << ", " << right << ")";
  }
}

TEST(Sage2Masks, OtherSchemesRejectExtendedMasks) {
  const Case c{1, 1, 1, 16, 16, 32, Mask::None};
  const Inputs in = make_inputs(c, 3);
  AttentionParams p;
  p.window_left = 4;
  EXPECT_THROW(emulate::fp8_per_tensor_attention(in.q, in.k, in.v, p), std::invalid_argument);
  p = {};
  p.kv_lengths = {1, 2};  // two lengths for one batch entry
  EXPECT_THROW(emulate::sage2_attention(in.q, in.k, in.v, p), std::invalid_argument);
  p = {};
  p.window_right = -2;
  EXPECT_THROW(emulate::sage2_attention(in.q, in.k, in.v, p), std::invalid_argument);
}


// An additive or boolean attn_mask with SDPA's broadcasting ((1 or B) x (1 or Hq)),
// -inf entries, finite biases and rows with every key hidden: unquantized, the emulation
// is the reference up to FP32 rounding (as above: 1e-5 on O, 1e-4 on the LSE).
TEST(Sage2Masks, AdditiveMaskUnquantizedMatchesReference) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (auto [mb, mh] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 4}, std::pair{2, 4}}) {
    const Case c{2, 4, 2, 150, 270, 32, Mask::None};
    const Inputs in = make_inputs(c, seed + mb * 10 + mh, 2.0f);
    AttentionParams p{c.mask, std::nullopt};
    p.attn_mask = Tensor4(mb, mh, c.nq, c.nkv);
    for (float& x : p.attn_mask.data)
      x = rng() % 4 == 0 ? -std::numeric_limits<float>::infinity() : normal(rng);
    for (int j = 0; j < c.nkv; ++j) p.attn_mask.at(0, 0, 7, j) = -std::numeric_limits<float>::infinity();
    const auto ref = reference::attention_forward(in.q, in.k, in.v, p);
    ASSERT_TRUE(std::isinf(ref.lse[7])) << "row 7 of head 0 sees no key";
    Sage2Options o;
    o.qk_format = QkFormat::Fp32;
    o.pv_format = PvFormat::Fp32;
    SCOPED_TRACE(::testing::Message() << "mask (" << mb << ", " << mh << ")");
    expect_close(emulate::sage2_attention(in.q, in.k, in.v, p, o), ref, 1e-5, 1e-4);
  }
}

// A row whose every value is bf16's lowest (transformers' "masked"): the values saturate
// at numerics::kLowestAdditive instead of overflowing to -inf in log2 units, so the row
// averages its keys as the FP64 reference does (the scores vanish beside 3.4e38 in both),
// and its LSE stays finite. -inf still hides a key.
TEST(Sage2Masks, LowestValuesAverageTheirKeysAsSdpaDoes) {
  const float lowest = -3.3895314e38f;  // bf16's lowest, exactly representable in FP32
  EXPECT_TRUE(std::isfinite(numerics::additive_log2(lowest)));
  EXPECT_EQ(numerics::additive_log2(-std::numeric_limits<float>::infinity()),
            -std::numeric_limits<float>::infinity());
  EXPECT_EQ(numerics::additive_log2(0.f), 0.f);
  const Case c{1, 2, 2, 40, 300, 32, Mask::None};
  const Inputs in = make_inputs(c, testutil::fresh_seed(), 1.0f);
  AttentionParams p{c.mask, std::nullopt};
  p.attn_mask = Tensor4(1, 1, c.nq, c.nkv);
  for (int j = 0; j < c.nkv; ++j) p.attn_mask.at(0, 0, 5, j) = lowest;
  const auto ref = reference::attention_forward(in.q, in.k, in.v, p);
  Sage2Options o;
  o.qk_format = QkFormat::Fp32;
  o.pv_format = PvFormat::Fp32;
  const auto emu = emulate::sage2_attention(in.q, in.k, in.v, p, o);
  for (int h = 0; h < c.hq; ++h) {
    EXPECT_TRUE(std::isfinite(emu.lse[h * c.nq + 5])) << "head " << h;
    for (int d = 0; d < c.d; ++d) {
      double mean = 0;  // the reference's row: the plain mean of V over the keys
      for (int j = 0; j < c.nkv; ++j) mean += in.v.at(0, h / (c.hq / c.hkv), j, d);
      mean /= c.nkv;
      EXPECT_NEAR(ref.o.at(0, h, 5, d), mean, 1e-5) << "reference, head " << h << " channel " << d;
      EXPECT_NEAR(emu.o.at(0, h, 5, d), mean, 1e-5) << "emulation, head " << h << " channel " << d;
    }
  }
}

// A boolean mask (0 / -inf) that states causal + a sliding window gives, with the
// kernel's 8-bit defaults, the very bits of the rules themselves: tiles the rules skip
// are tiles the mask hides entirely, which change nothing. (Both calls keep the same
// key-padding lengths, which also decide the quantization's statistics.)
TEST(Sage2Masks, BooleanMaskOfARuleEqualsTheRule) {
  const Case c{2, 2, 1, 300, 400, 64, Mask::Causal};
  const Inputs in = make_inputs(c, 17, 3.0f);
  AttentionParams rule{c.mask, std::nullopt};
  rule.window_left = 150;
  rule.kv_lengths = {400, 333};
  AttentionParams as_mask{Mask::None, std::nullopt};
  as_mask.kv_lengths = rule.kv_lengths;
  as_mask.attn_mask = Tensor4(c.b, 1, c.nq, c.nkv);
  for (int b = 0; b < c.b; ++b)
    for (int i = 0; i < c.nq; ++i)
      for (int j = 0; j < c.nkv; ++j)
        as_mask.attn_mask.at(b, 0, i, j) = rule.key_rule(b, c.nq, c.nkv).visible(i, j)
                                               ? 0.0f
                                               : -std::numeric_limits<float>::infinity();
  const auto a = emulate::sage2_attention(in.q, in.k, in.v, rule);
  const auto m = emulate::sage2_attention(in.q, in.k, in.v, as_mask);
  ASSERT_EQ(a.o.data.size(), m.o.data.size());
  for (std::size_t i = 0; i < a.o.data.size(); ++i) ASSERT_EQ(a.o.data[i], m.o.data[i]) << i;
  for (std::size_t i = 0; i < a.lse.size(); ++i) ASSERT_EQ(a.lse[i], m.lse[i]) << i;
}


// ---- V's head dim d_v different from Q·K's d (MLA-style 192/128) ----------------------

// V's per-channel scales and the P codes do not depend on V's other channels, so the
// emulation with V of d_v columns equals, bit for bit, the one with V zero-padded to d
// columns on those columns (and the LSE); its accuracy against FP64 is the scheme's.
TEST(Sage2EmulatorHeadDimV, EqualsVZeroPaddedAndMeetsTheBounds) {
  for (auto [d, dv] : {std::pair{192, 128}, std::pair{128, 64}, std::pair{64, 96}}) {
    SCOPED_TRACE("d=" + std::to_string(d) + " d_v=" + std::to_string(dv));
    const Tensor4 q = gaussian(1, 4, 200, d, 21), k = gaussian(1, 2, 300, d, 22, 1.0f);
    const Tensor4 v = gaussian(1, 2, 300, dv, 23);
    const int dmax = std::max(d, dv);
    Tensor4 vp(1, 2, 300, dmax);
    for (int h = 0; h < 2; ++h)
      for (int n = 0; n < 300; ++n)
        for (int c = 0; c < dv; ++c) vp.at(0, h, n, c) = v.at(0, h, n, c);
    AttentionParams p;
    p.mask = Mask::Causal;
    const auto a = emulate::sage2_attention(q, k, v, p);
    const auto w = emulate::sage2_attention(q, k, vp, p);
    ASSERT_EQ(a.o.d, dv);
    EXPECT_EQ(a.lse, w.lse);
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < 200; ++i)
        for (int c = 0; c < dv; ++c) ASSERT_EQ(a.o.at(0, h, i, c), w.o.at(0, h, i, c));
    const auto ref = reference::attention_forward(q, k, v, p);
    const auto m = metrics::compare(std::span<const float>(a.o.data),
                                    std::span<const double>(ref.o.data));
    // The scheme's bounds (tests/tolerances/sage2_8b.json states their reasons).
    EXPECT_GE(m.cos_sim, test::tolerances("sage2_8b")["cos_min"]);
    EXPECT_LE(m.rel_l1, test::tolerances("sage2_8b")["rel_l1_max"]);
  }
}

// transformers' mask of a left-padded causal batch (0 where a query sees a key, bf16's
// lowest elsewhere): in every 128-row block that has a 128 × 128 tile of zeros, the tiles
// of saturated values add exactly nothing, so the emulation gives the same bits with
// those tiles set to -inf (which the kernel's lists leave out, numerics/mask_tiles.h);
// rows that see no key (before the padding ends) still average their keys. The 8-bit
// defaults with the GPU tests' truncation interval, on a fresh seed.
TEST(Sage2Masks, SaturatedTilesBesideAZeroTileAddNothing) {
  const float lowest = -3.3895314e38f;
  const Case c{2, 2, 1, 600, 600, 64, Mask::None};
  const Inputs in = make_inputs(c, testutil::fresh_seed(), 1.0f);
  const int pads[2] = {40, 0};
  AttentionParams full{Mask::None, std::nullopt};
  full.attn_mask = Tensor4(c.b, 1, c.nq, c.nkv);
  for (int b = 0; b < c.b; ++b)
    for (int i = 0; i < c.nq; ++i)
      for (int j = 0; j < c.nkv; ++j)
        full.attn_mask.at(b, 0, i, j) = j <= i && j >= pads[b] ? 0.f : lowest;
  AttentionParams cut = full;  // saturated tiles of blocks with a zero tile: -inf
  int replaced = 0;
  for (int b = 0; b < c.b; ++b)
    for (int mb = 0; mb * 128 < c.nq; ++mb) {
      const int r0 = mb * 128, r1 = std::min(c.nq, r0 + 128);
      auto tile_all = [&](int t, auto pred) {
        for (int i = r0; i < r1; ++i)
          for (int j = t * 128; j < std::min(c.nkv, t * 128 + 128); ++j)
            if (!pred(full.attn_mask.at(b, 0, i, j))) return false;
        return true;
      };
      bool zero_tile = false;
      for (int t = 0; t * 128 < c.nkv; ++t) zero_tile |= tile_all(t, [](float x) { return x == 0.f; });
      if (!zero_tile) continue;
      for (int t = 0; t * 128 < c.nkv; ++t)
        if (tile_all(t, [&](float x) { return x == lowest; })) {
          for (int i = r0; i < r1; ++i)
            for (int j = t * 128; j < std::min(c.nkv, t * 128 + 128); ++j)
              cut.attn_mask.at(b, 0, i, j) = -std::numeric_limits<float>::infinity();
          ++replaced;
        }
    }
  ASSERT_GT(replaced, 0) << "the case has no tile the lists would leave out";
  Sage2Options o;
  o.fp22_keys = 1;
  const auto a = emulate::sage2_attention(in.q, in.k, in.v, full, o);
  const auto z = emulate::sage2_attention(in.q, in.k, in.v, cut, o);
  ASSERT_EQ(a.o.data.size(), z.o.data.size());
  for (std::size_t e = 0; e < a.o.data.size(); ++e)
    ASSERT_EQ(a.o.data[e], z.o.data[e]) << "O element " << e;
  for (std::size_t r = 0; r < a.lse.size(); ++r) ASSERT_EQ(a.lse[r], z.lse[r]) << "LSE row " << r;
  // The rule needs the zero tile: block 0 of batch entry 0 has none (rows 0..39 see no
  // key), and leaving out its saturated values changes those rows (with them they
  // average their keys, Sage2Masks.LowestValuesAverageTheirKeysAsSdpaDoes; without them
  // they see no key and give 0).
  AttentionParams wrong = cut;
  for (int i = 0; i < 128; ++i)
    for (int j = 0; j < c.nkv; ++j)
      if (wrong.attn_mask.at(0, 0, i, j) == lowest)
        wrong.attn_mask.at(0, 0, i, j) = -std::numeric_limits<float>::infinity();
  const auto w = emulate::sage2_attention(in.q, in.k, in.v, wrong, o);
  double a_norm = 0, w_norm = 0;
  for (int e = 0; e < c.d; ++e) {
    a_norm += std::fabs(a.o.at(0, 0, 3, e));
    w_norm += std::fabs(w.o.at(0, 0, 3, e));
  }
  EXPECT_GT(a_norm, 0.0) << "a row of lowest values averages its keys";
  EXPECT_EQ(w_norm, 0.0) << "the same row with its saturated tile left out sees no key";
}

}  // namespace
}  // namespace qattn
