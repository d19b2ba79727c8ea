// Packed variable-length batches (reference/varlen.h) in the FP64 reference and the SA2
// emulator. The definition under test: a packed call equals one call per sequence (a
// batch of one with Nq = len_q(b), Nkv = len_k(b)), the mask rule aligned per sequence.
// The FP64 reference computes the pack directly (its own loops), so "equal to the
// per-sequence reference" checks it; the emulator is checked against per-sequence
// emulation built from inputs drawn per sequence, against a padded batch with
// kv_lengths (an independent path through the quantizer), for the independence of the
// sequences (NaN in one reaches no other), and against FP64 with the scheme's bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "emulate/sage2.h"
#include "numerics/quantize.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "reference/varlen.h"
#include "tolerances.h"

namespace qattn {
namespace {

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

// Per-sequence inputs, drawn as batches of one, and the same values packed.
struct VarlenCase {
  std::vector<int> len_q, len_k;
  int hq, hkv, d;
};

struct Sequences {
  std::vector<Tensor4> q, k, v;  // (1, H, len, d) each
  PackedTensor pq, pk, pv;       // (total, H, d)
  VarlenLayout layout;
};

// Packs by index arithmetic of its own (not reference/varlen.h's helpers).
PackedTensor pack(const std::vector<Tensor4>& seqs, int h, int d) {
  int total = 0;
  for (const Tensor4& t : seqs) total += t.n;
  PackedTensor p(total, h, d);
  int t0 = 0;
  for (const Tensor4& t : seqs) {
    for (int i = 0; i < t.n; ++i)
      for (int ih = 0; ih < h; ++ih)
        for (int c = 0; c < d; ++c)
          p.data[(static_cast<std::size_t>(t0 + i) * h + ih) * d + c] = t.at(0, ih, i, c);
    t0 += t.n;
  }
  return p;
}

Sequences make_sequences(const VarlenCase& c, std::uint64_t seed, float k_bias = 1.0f) {
  Sequences s;
  for (std::size_t b = 0; b < c.len_q.size(); ++b) {
    const std::uint64_t sb = seed + 10 * b;
    s.q.push_back(testutil::gaussian(1, c.hq, c.len_q[b], c.d, sb));
    // A per-sequence channel bias: the K mean differs between sequences, so a mean taken
    // over the pack would be wrong for each of them.
    s.k.push_back(testutil::gaussian(1, c.hkv, c.len_k[b], c.d, sb + 1, 1.0f,
                                     k_bias * static_cast<float>(b + 1)));
    s.v.push_back(testutil::gaussian(1, c.hkv, c.len_k[b], c.d, sb + 2));
  }
  s.pq = pack(s.q, c.hq, c.d);
  s.pk = pack(s.k, c.hkv, c.d);
  s.pv = pack(s.v, c.hkv, c.d);
  s.layout = VarlenLayout::from_lengths(c.len_q, c.len_k);
  return s;
}

// Bitwise equality of floats (NaN equal to NaN of the same bits; -inf to -inf).
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Lengths: 1, tails that are no multiple of 64 or 128, more than 256 keys (the sampled
// K mean), an empty query side and an empty key side; GQA and MQA; d padded (48, 80).
const VarlenCase kCases[] = {
    {{1, 65, 129, 200}, {1, 65, 129, 200}, 4, 2, 64},   // self-attention packing, GQA
    {{3, 100, 0, 130}, {70, 300, 5, 0}, 4, 1, 48},       // len_q != len_k, empty sides, MQA
    {{257, 1, 64}, {300, 128, 1}, 2, 2, 80},             // > 256 keys, one query
};

struct MaskCase {
  const char* name;
  Mask mask;
  Diagonal alignment;
  int left, right;
};

const MaskCase kMasks[] = {
    {"none", Mask::None, Diagonal::BottomRight, -1, -1},
    {"causal", Mask::Causal, Diagonal::BottomRight, -1, -1},
    {"causal top-left", Mask::Causal, Diagonal::TopLeft, -1, -1},
    {"window (20, 5)", Mask::None, Diagonal::BottomRight, 20, 5},
    {"causal + left 40", Mask::Causal, Diagonal::BottomRight, 40, -1},
};

AttentionParams params_of(const MaskCase& m) {
  AttentionParams p;
  p.mask = m.mask;
  p.alignment = m.alignment;
  p.window_left = m.left;
  p.window_right = m.right;
  return p;
}

// ---- the FP64 reference --------------------------------------------------------------

// The packed reference runs the per-sequence reference's arithmetic in the same order
// (scores over the visible keys in key order, P normalized, then P·V in key order), so
// O and the LSE are equal exactly, not just to FP64 rounding.
TEST(VarlenReference, EqualsOneCallPerSequence) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (const VarlenCase& c : kCases)
    for (const MaskCase& m : kMasks) {
      SCOPED_TRACE(m.name);
      const Sequences s = make_sequences(c, seed);
      const AttentionParams p = params_of(m);
      const reference::VarlenForwardResult r =
          reference::attention_forward_varlen(s.pq, s.pk, s.pv, s.layout, p);
      ASSERT_EQ(r.o.total, s.pq.total);
      ASSERT_EQ(r.lse.size(), static_cast<std::size_t>(c.hq) * s.pq.total);
      for (int b = 0; b < s.layout.batch(); ++b) {
        const int nq = c.len_q[b], nkv = c.len_k[b], q0 = s.layout.q_start(b);
        for (int h = 0; h < c.hq; ++h)
          for (int i = 0; i < nq; ++i) {
            const double lse = r.lse[static_cast<std::size_t>(h) * s.pq.total + q0 + i];
            if (nkv == 0) {  // no key: O = 0, LSE = -inf
              ASSERT_EQ(lse, -std::numeric_limits<double>::infinity());
              for (int ch = 0; ch < c.d; ++ch) ASSERT_EQ(r.o.row(q0 + i, h)[ch], 0.0);
            }
          }
        if (nq == 0 || nkv == 0) continue;
        const reference::ForwardResult one = reference::attention_forward(s.q[b], s.k[b], s.v[b], p);
        for (int h = 0; h < c.hq; ++h)
          for (int i = 0; i < nq; ++i) {
            ASSERT_EQ(r.lse[static_cast<std::size_t>(h) * s.pq.total + q0 + i],
                      one.lse[static_cast<std::size_t>(h) * nq + i])
                << "b " << b << " h " << h << " i " << i;
            for (int ch = 0; ch < c.d; ++ch)
              ASSERT_EQ(r.o.row(q0 + i, h)[ch], one.o.at(0, h, i, ch));
          }
      }
    }
}

// The causal rule is per sequence, bottom-right: query i of sequence b sees its own keys
// j <= i + len_k(b) - len_q(b) and nothing of another sequence. Checked on one-hot V:
// with V = e_j (channel j per key, d >= keys), O's channel j is P(i, j), so P's support
// is read off O directly.
TEST(VarlenReference, CausalIsPerSequenceBottomRight) {
  const std::vector<int> lq{3, 5, 2}, lk{6, 5, 1};
  const VarlenLayout layout = VarlenLayout::from_lengths(lq, lk);
  const int total_k = layout.cu_seqlens_k.back(), d = 16;
  PackedTensor q(layout.cu_seqlens_q.back(), 1, d), k(total_k, 1, d), v(total_k, 1, d);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (float& x : q.data) x = nd(rng);
  for (float& x : k.data) x = nd(rng);
  for (int t = 0; t < total_k; ++t) v.row(t, 0)[t] = 1.0f;  // key t carries channel t
  AttentionParams p;
  p.mask = Mask::Causal;
  const auto r = reference::attention_forward_varlen(q, k, v, layout, p);
  for (int b = 0; b < layout.batch(); ++b)
    for (int i = 0; i < lq[b]; ++i)
      for (int t = 0; t < total_k; ++t) {
        const int j = t - layout.k_start(b);
        const bool visible = j >= 0 && j < lk[b] && j <= i + lk[b] - lq[b];
        const double prob = r.o.row(layout.q_start(b) + i, 0)[t];
        if (visible)
          EXPECT_GT(prob, 0.0) << "b " << b << " i " << i << " key " << t;
        else
          EXPECT_EQ(prob, 0.0) << "b " << b << " i " << i << " key " << t;
      }
}

TEST(VarlenReference, RejectsBadLayoutsNamingTheParameter) {
  const Sequences s = make_sequences({{4, 3}, {5, 2}, 2, 1, 16}, 3);
  auto rejects = [&](VarlenLayout l, AttentionParams p, const std::string& word) {
    try {
      reference::attention_forward_varlen(s.pq, s.pk, s.pv, l, p);
      ADD_FAILURE() << "accepted; expected an error naming " << word;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  const VarlenLayout ok = s.layout;
  VarlenLayout l = ok;
  l.cu_seqlens_q[0] = 1;
  rejects(l, {}, "cu_seqlens_q[0]");
  l = ok;
  l.cu_seqlens_k = {0, 6, 5};
  rejects(l, {}, "cu_seqlens_k decreases");
  l = ok;
  l.cu_seqlens_q.back() = 6;
  rejects(l, {}, "cu_seqlens_q ends at 6");
  l = ok;
  l.cu_seqlens_k.pop_back();
  rejects(l, {}, "cu_seqlens_k: must have as many entries");
  l = ok;
  l.cu_seqlens_q = {0};
  l.cu_seqlens_k = {0};
  rejects(l, {}, "cu_seqlens_q: needs batch + 1 >= 2");
  l = ok;
  l.max_seqlen_q = 3;  // the longest query sequence has 4
  rejects(l, {}, "max_seqlen_q = 3");
  l = ok;
  l.max_seqlen_k = 0;
  rejects(l, {}, "max_seqlen_k = 0");
  AttentionParams p;
  p.kv_lengths = {1, 1};
  rejects(ok, p, "kv_lengths");
  p = {};
  p.attn_mask = Tensor4(1, 1, 7, 7);
  rejects(ok, p, "attn_mask");
  // A larger max length is an upper bound, as in FlashAttention: accepted.
  l = ok;
  l.max_seqlen_q = 100;
  EXPECT_NO_THROW(reference::attention_forward_varlen(s.pq, s.pk, s.pv, l, {}));
}

// ---- the SA2 emulator ----------------------------------------------------------------

void expect_equals_per_sequence(const Sequences& s, const VarlenCase& c,
                                const emulate::EmulatedVarlenForward& e, const AttentionParams& p,
                                const emulate::Sage2Options& o = {}) {
  ASSERT_EQ(e.o.total, s.pq.total);
  for (int b = 0; b < s.layout.batch(); ++b) {
    const int nq = c.len_q[b], nkv = c.len_k[b], q0 = s.layout.q_start(b);
    if (nq == 0) continue;
    if (nkv == 0) {
      for (int h = 0; h < c.hq; ++h)
        for (int i = 0; i < nq; ++i) {
          ASSERT_EQ(e.lse[static_cast<std::size_t>(h) * s.pq.total + q0 + i], kNegInfF);
          for (int ch = 0; ch < c.d; ++ch) ASSERT_EQ(e.o.row(q0 + i, h)[ch], 0.0f);
        }
      continue;
    }
    emulate::Sage2Options ob = o;
    if (o.k_smoothing == emulate::KSmoothing::Given) {
      const std::size_t n = static_cast<std::size_t>(c.hkv) * c.d;
      ob.k_mean.assign(o.k_mean.begin() + b * n, o.k_mean.begin() + (b + 1) * n);
    }
    const emulate::EmulatedForward one = emulate::sage2_attention(s.q[b], s.k[b], s.v[b], p, ob);
    for (int h = 0; h < c.hq; ++h)
      for (int i = 0; i < nq; ++i) {
        ASSERT_TRUE(same_bits(e.lse[static_cast<std::size_t>(h) * s.pq.total + q0 + i],
                              one.lse[static_cast<std::size_t>(h) * nq + i]))
            << "lse b " << b << " h " << h << " i " << i;
        for (int ch = 0; ch < c.d; ++ch)
          ASSERT_TRUE(same_bits(e.o.row(q0 + i, h)[ch], one.o.at(0, h, i, ch)))
              << "o b " << b << " h " << h << " i " << i << " ch " << ch;
      }
  }
}

// The contract, bit for bit: the same arithmetic on the same per-sequence tensors.
TEST(VarlenSage2, EqualsOneEmulationPerSequenceBitForBit) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (const VarlenCase& c : kCases)
    for (const MaskCase& m : kMasks) {
      SCOPED_TRACE(m.name);
      const Sequences s = make_sequences(c, seed);
      const AttentionParams p = params_of(m);
      expect_equals_per_sequence(s, c, emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, p),
                                 p);
    }
}

// Options that change the per-sequence statistics: the exact K mean, a given K mean
// (one per sequence), per-block groups, the exact V amax.
TEST(VarlenSage2, OptionsApplyPerSequence) {
  const VarlenCase c = kCases[2];
  const Sequences s = make_sequences(c, 11);
  emulate::Sage2Options mean, given, block, exact_v;
  mean.k_smoothing = emulate::KSmoothing::Mean;
  given.k_smoothing = emulate::KSmoothing::Given;
  given.k_mean.resize(c.len_q.size() * c.hkv * c.d);
  for (std::size_t i = 0; i < given.k_mean.size(); ++i) given.k_mean[i] = 0.25f * (i % 7);
  block.granularity = emulate::Granularity::PerBlock;
  exact_v.v_amax = emulate::VAmax::AllTokens;
  AttentionParams p;
  p.mask = Mask::Causal;
  for (const emulate::Sage2Options* o : {&mean, &given, &block, &exact_v})
    expect_equals_per_sequence(s, c, emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, p, *o),
                               p, *o);
  given.k_mean.pop_back();
  EXPECT_THROW(emulate::quantize_sage2_varlen(s.pq, s.pk, s.pv, s.layout, p, given),
               std::invalid_argument);
}

// The K smoothing vector of each sequence is the mean of its own keys' 256-token sample
// (numerics/token_sample.h): sequence 0 has 300 keys (sampled), sequence 1 128 (all).
// The emulator's c is the float mean of double sums, so it equals token_mean exactly.
TEST(VarlenSage2, KMeanIsEachSequencesOwn) {
  const VarlenCase c = kCases[2];
  const Sequences s = make_sequences(c, 5, /*k_bias=*/4.0f);
  const auto z = emulate::quantize_sage2_varlen(s.pq, s.pk, s.pv, s.layout, {});
  ASSERT_EQ(z.size(), c.len_q.size());
  for (int b = 0; b < s.layout.batch(); ++b)
    for (int h = 0; h < c.hkv; ++h) {
      const int n = c.len_k[b];
      const std::vector<float> want = numerics::token_mean(
          std::span<const float>(s.k[b].row(0, h, 0), static_cast<std::size_t>(n) * c.d), n, c.d,
          numerics::MeanEstimate::Sampled);
      const float* got = z[b].k_mean.data() + static_cast<std::size_t>(h) * z[b].head_dim_padded;
      for (int ch = 0; ch < c.d; ++ch) ASSERT_EQ(got[ch], want[ch]) << "b " << b << " ch " << ch;
    }
}

// No sequence reads another: NaN everywhere in sequence 1 (its queries, keys and values)
// leaves every bit of sequences 0 and 2 as it was, and makes sequence 1's rows NaN (NaN
// in, NaN out).
TEST(VarlenSage2, SequencesAreIndependentNaNIncluded) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const VarlenCase c = kCases[0];
  Sequences s = make_sequences(c, seed);
  AttentionParams p;
  p.mask = Mask::Causal;
  const auto clean = emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, p);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int b = 1;
  for (int t = s.layout.q_start(b); t < s.layout.q_start(b) + c.len_q[b]; ++t)
    for (int h = 0; h < c.hq; ++h) std::fill_n(s.pq.row(t, h), c.d, nan);
  for (int t = s.layout.k_start(b); t < s.layout.k_start(b) + c.len_k[b]; ++t)
    for (int h = 0; h < c.hkv; ++h) {
      std::fill_n(s.pk.row(t, h), c.d, nan);
      std::fill_n(s.pv.row(t, h), c.d, nan);
    }
  const auto dirty = emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, p);
  for (int t = 0; t < s.pq.total; ++t) {
    const bool in_b = t >= s.layout.q_start(b) && t < s.layout.q_start(b) + c.len_q[b];
    for (int h = 0; h < c.hq; ++h) {
      const float lc = clean.lse[static_cast<std::size_t>(h) * s.pq.total + t];
      const float ld = dirty.lse[static_cast<std::size_t>(h) * s.pq.total + t];
      if (in_b) {
        ASSERT_TRUE(std::isnan(ld)) << "token " << t;
        ASSERT_TRUE(std::isnan(dirty.o.row(t, h)[0])) << "token " << t;
        continue;
      }
      ASSERT_TRUE(same_bits(lc, ld)) << "token " << t;
      for (int ch = 0; ch < c.d; ++ch)
        ASSERT_TRUE(same_bits(clean.o.row(t, h)[ch], dirty.o.row(t, h)[ch])) << "token " << t;
    }
  }
}

// An independent path: a right-padded batch (B = sequences, N = the longest) with
// kv_lengths = len_k and zero query padding quantizes each entry from its valid keys only
// and gives the same groups, tiles and sums, so it equals the packed emulation bit for
// bit where the rules agree: without a mask, and causal when every sequence has len_q =
// len_k (the diagonal then sits at i in both; the padded batch is aligned top-left).
TEST(VarlenSage2, EqualsAPaddedBatchWithKeyLengths) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  struct Padded {
    VarlenCase c;
    Mask mask;
  };
  const Padded cases[] = {{kCases[0], Mask::Causal}, {kCases[0], Mask::None},
                          {{{5, 140, 64}, {300, 7, 129}, 4, 2, 64}, Mask::None}};
  for (const Padded& pc : cases) {
    const VarlenCase& c = pc.c;
    const Sequences s = make_sequences(c, seed);
    const int B = static_cast<int>(c.len_q.size());
    const int nq = s.layout.max_seqlen_q, nkv = s.layout.max_seqlen_k;
    Tensor4 q(B, c.hq, nq, c.d), k(B, c.hkv, nkv, c.d), v(B, c.hkv, nkv, c.d);
    std::fill(k.data.begin(), k.data.end(), 1e4f);  // padding keys: values that never matter
    std::fill(v.data.begin(), v.data.end(), -1e4f);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < c.hq; ++h)
        for (int i = 0; i < c.len_q[b]; ++i) std::copy_n(s.q[b].row(0, h, i), c.d, q.row(b, h, i));
      for (int h = 0; h < c.hkv; ++h)
        for (int j = 0; j < c.len_k[b]; ++j) {
          std::copy_n(s.k[b].row(0, h, j), c.d, k.row(b, h, j));
          std::copy_n(s.v[b].row(0, h, j), c.d, v.row(b, h, j));
        }
    }
    AttentionParams padded;
    padded.mask = pc.mask;
    padded.alignment = Diagonal::TopLeft;
    padded.kv_lengths = c.len_k;
    AttentionParams packed;
    packed.mask = pc.mask;
    const auto ep = emulate::sage2_attention(q, k, v, padded);
    const auto ev = emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, packed);
    const auto rp = reference::attention_forward(q, k, v, padded);
    const auto rv = reference::attention_forward_varlen(s.pq, s.pk, s.pv, s.layout, packed);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < c.hq; ++h)
        for (int i = 0; i < c.len_q[b]; ++i) {
          const int t = s.layout.q_start(b) + i;
          const std::size_t lv = static_cast<std::size_t>(h) * s.pq.total + t;
          const std::size_t lp = (static_cast<std::size_t>(b) * c.hq + h) * nq + i;
          ASSERT_TRUE(same_bits(ev.lse[lv], ep.lse[lp])) << "b " << b << " h " << h << " i " << i;
          // The reference sums the same terms in the same order: equal exactly.
          ASSERT_EQ(rv.lse[lv], rp.lse[lp]);
          for (int ch = 0; ch < c.d; ++ch) {
            ASSERT_TRUE(same_bits(ev.o.row(t, h)[ch], ep.o.at(b, h, i, ch)))
                << "b " << b << " h " << h << " i " << i << " ch " << ch;
            ASSERT_EQ(rv.o.row(t, h)[ch], rp.o.at(b, h, i, ch));
          }
        }
  }
}

// Against FP64 with the SA2-8b bounds of tests/tolerances/sage2_8b.json (CosSim, relative
// L1 and the LSE's absolute error): per-sequence quantization keeps the scheme's accuracy
// on every sequence, the one-token ones included. Rows without keys are compared exactly
// (O = 0 and LSE = -inf on both sides).
TEST(VarlenSage2, WithinTheSchemesBoundsOfFp64) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const auto& tol = test::tolerances("sage2_8b");
  for (const VarlenCase& c : kCases)
    for (const MaskCase& m : kMasks) {
      SCOPED_TRACE(m.name);
      const Sequences s = make_sequences(c, seed);
      const AttentionParams p = params_of(m);
      const auto e = emulate::sage2_varlen_attention(s.pq, s.pk, s.pv, s.layout, p);
      const auto r = reference::attention_forward_varlen(s.pq, s.pk, s.pv, s.layout, p);
      const auto mo = metrics::compare(e.o.data, r.o.data);
      EXPECT_GE(mo.cos_sim, tol["cos_min"]);
      EXPECT_LE(mo.rel_l1, tol["rel_l1_max"]);
      for (std::size_t i = 0; i < e.lse.size(); ++i) {
        if (std::isinf(r.lse[i])) {
          ASSERT_EQ(e.lse[i], kNegInfF) << "row " << i;
        } else {
          ASSERT_NEAR(e.lse[i], r.lse[i], tol["lse_abs_max"]) << "row " << i;
        }
      }
    }
}

}  // namespace
}  // namespace qattn
