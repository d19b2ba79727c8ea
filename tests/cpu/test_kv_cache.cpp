// The quantized KV cache emulation (src/emulate/kv_cache.h, docs/kv-cache.md): the page
// layout, append bit-exact against the numerics quantizers, the paging invariants,
// dequantization, decode against the FP64 reference on the dequantized cache, the
// split-KV merge, GQA and the bottom-right causal mask, and named errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "emulate/kv_cache.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace qattn {
namespace {

using emulate::KvCacheConfig;
using emulate::KvFormat;
using emulate::KvSmoothing;
using emulate::PagedCache;

constexpr double kU = 5.9604644775390625e-08;  // 2^-24, FP32 unit roundoff
constexpr KvFormat kAllFormats[] = {KvFormat::NvFp4, KvFormat::Fp8E4M3, KvFormat::Int8,
                                    KvFormat::Bf16};

const char* name(KvFormat f) { return emulate::kv_format_name(f); }

KvCacheConfig config(KvFormat f, int heads_kv, int d, int page_size, int num_pages, int max_seqs,
                     int max_pages_per_seq, KvSmoothing sm = KvSmoothing::PrefillMean) {
  KvCacheConfig c;
  c.format = f;
  c.heads_kv = heads_kv;
  c.head_dim = d;
  c.page_size = page_size;
  c.num_pages = num_pages;
  c.max_seqs = max_seqs;
  c.max_pages_per_seq = max_pages_per_seq;
  c.k_smoothing = sm;
  return c;
}

// Tokens [t0, t0 + n) of a (1, H, N, d) tensor.
Tensor4 tokens(const Tensor4& x, int t0, int n) {
  Tensor4 out(1, x.h, n, x.d);
  for (int h = 0; h < x.h; ++h)
    std::copy(x.row(0, h, t0), x.row(0, h, t0) + static_cast<std::size_t>(n) * x.d,
              out.row(0, h, 0));
  return out;
}

// Gives every sequence a shuffled set of pages (no page shared), so a layout bug that
// assumes identity block tables shows.
void assign_shuffled(PagedCache& cache, std::uint64_t seed) {
  std::vector<int32_t> all(cache.config.num_pages);
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  const int per = cache.config.max_pages_per_seq;
  ASSERT_GE(cache.config.num_pages, per * cache.config.max_seqs);
  for (int s = 0; s < cache.config.max_seqs; ++s) {
    emulate::assign_pages(cache, s, std::span<const int32_t>(all.data() + s * per, per));
  }
}

// ---- layout -----------------------------------------------------------------------------

// The documented sizes at d = 128 (docs/kv-cache.md, "Bytes per token"): NVFP4 64 code
// bytes + 8 E4M3 scales = 72 bytes = 4.5 bits per element; FP8/INT8 128 + 4; BF16 256.
TEST(KvCache, BytesPerTokenHeadAndPageLayoutAtD128) {
  EXPECT_EQ(emulate::kv_bytes_per_token_head(KvFormat::NvFp4, 128), 72);
  EXPECT_EQ(emulate::kv_bytes_per_token_head(KvFormat::Fp8E4M3, 128), 132);
  EXPECT_EQ(emulate::kv_bytes_per_token_head(KvFormat::Int8, 128), 132);
  EXPECT_EQ(emulate::kv_bytes_per_token_head(KvFormat::Bf16, 128), 256);
  EXPECT_DOUBLE_EQ(72.0 * 8 / 128, 4.5);

  // Page of 16 tokens × 8 KV heads, NVFP4: each head's code slice 16·64 = 1024 bytes, its
  // scale slice 16·8 = 128 bytes; sections K codes | V codes | K scales | V scales.
  const auto l = emulate::kv_page_layout(config(KvFormat::NvFp4, 8, 128, 16, 1, 1, 1));
  EXPECT_EQ(l.code_row_bytes, 64);
  EXPECT_EQ(l.scale_row_bytes, 8);
  EXPECT_EQ(l.head_code_bytes, 1024);
  EXPECT_EQ(l.head_scale_bytes, 128);
  EXPECT_EQ(l.k_codes, 0);
  EXPECT_EQ(l.v_codes, 8 * 1024);
  EXPECT_EQ(l.k_scales, 16 * 1024);
  EXPECT_EQ(l.v_scales, 16 * 1024 + 8 * 128);
  EXPECT_EQ(l.page_bytes, 16 * 1024 + 16 * 128);

  // Odd page sizes pad each head's slice to 16 bytes: every section and slice aligned.
  for (KvFormat f : kAllFormats) {
    for (int page : {1, 3, 16, 17}) {
      for (int d : {16, 48, 128}) {
        const auto m = emulate::kv_page_layout(config(f, 3, d, page, 1, 1, 1));
        SCOPED_TRACE(std::string(name(f)) + " page " + std::to_string(page) + " d " +
                     std::to_string(d));
        for (int64_t off : {m.k_codes, m.v_codes, m.k_scales, m.v_scales, m.page_bytes,
                            m.head_code_bytes, m.head_scale_bytes}) {
          EXPECT_EQ(off % emulate::kKvAlignment, 0);
        }
        EXPECT_GE(m.head_code_bytes, page * m.code_row_bytes);
        EXPECT_GE(m.head_scale_bytes, page * m.scale_row_bytes);
      }
    }
  }
}

// ---- append -----------------------------------------------------------------------------

// Every cached byte equals the numerics quantizer applied to that (token, head) row
// alone — K after subtracting c, the mean over the first append's token sample — at the
// byte offset the documentation gives (computed here from the formula, not the layout
// helpers). A prefill of 37 tokens (a page tail) and 5 single-token appends.
TEST(KvCache, AppendIsBitExactWithNumericsPerRow) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  constexpr int kHeads = 2, kD = 128, kPage = 16, kPrefill = 37, kSteps = 5;
  const int total = kPrefill + kSteps;
  const Tensor4 k = testutil::gaussian(1, kHeads, total, kD, seed, 1.0f, 3.0f);
  const Tensor4 v = testutil::gaussian(1, kHeads, total, kD, seed + 1);
  for (KvFormat f : kAllFormats) {
    SCOPED_TRACE(name(f));
    PagedCache cache = emulate::make_paged_cache(config(f, kHeads, kD, kPage, 8, 2, 4));
    assign_shuffled(cache, seed);
    emulate::append(cache, 1, tokens(k, 0, kPrefill), tokens(v, 0, kPrefill));
    for (int t = kPrefill; t < total; ++t)
      emulate::append(cache, 1, tokens(k, t, 1), tokens(v, t, 1));
    ASSERT_EQ(cache.lengths[1], total);
    ASSERT_EQ(cache.lengths[0], 0);

    const auto& L = cache.layout;
    const int code_row = f == KvFormat::NvFp4 ? kD / 2 : (f == KvFormat::Bf16 ? 2 * kD : kD);
    const int scale_row = f == KvFormat::NvFp4 ? kD / 16 : (f == KvFormat::Bf16 ? 0 : 4);
    for (int h = 0; h < kHeads; ++h) {
      const std::span<const float> prefill(k.row(0, h, 0), std::size_t{kPrefill} * kD);
      const auto c = numerics::token_mean(prefill, kPrefill, kD, numerics::MeanEstimate::Sampled);
      for (int e = 0; e < kD; ++e) ASSERT_EQ(cache.k_mean[(1 * kHeads + h) * kD + e], c[e]);
      for (int t = 0; t < total; ++t) {
        const int page = cache.block(1, t / kPage), slot = t % kPage;
        for (bool is_v : {false, true}) {
          std::vector<float> row(kD);
          for (int e = 0; e < kD; ++e) row[e] = is_v ? v.at(0, h, t, e) : k.at(0, h, t, e) - c[e];
          const int64_t section_codes = is_v ? int64_t{kHeads} * L.head_code_bytes : 0;
          const int64_t section_scales =
              2 * int64_t{kHeads} * L.head_code_bytes + (is_v ? kHeads * L.head_scale_bytes : 0);
          const uint8_t* codes = cache.pages.data() + int64_t{page} * L.page_bytes + section_codes +
                                 h * L.head_code_bytes + slot * code_row;
          const uint8_t* scales = cache.pages.data() + int64_t{page} * L.page_bytes +
                                  section_scales + h * L.head_scale_bytes + slot * scale_row;
          if (f == KvFormat::NvFp4) {
            const auto qz = numerics::quantize_fp4(row, 1, kD, numerics::Fp4Format::NvFp4);
            for (int e = 0; e < kD; ++e) {
              const uint8_t nib = e % 2 ? codes[e / 2] >> 4 : codes[e / 2] & 0xF;
              ASSERT_EQ(nib, qz.codes[e]) << "t " << t << " h " << h << " e " << e;
            }
            for (int b = 0; b < kD / 16; ++b) ASSERT_EQ(scales[b], qz.scale_codes[b]);
          } else if (f == KvFormat::Fp8E4M3 || f == KvFormat::Int8) {
            float s;
            std::memcpy(&s, scales, 4);
            if (f == KvFormat::Fp8E4M3) {
              const auto qz =
                  numerics::quantize_fp8(row, 1, kD, numerics::Fp8Format::E4M3,
                                         numerics::Granularity::PerToken, numerics::Operand::K);
              ASSERT_EQ(0, std::memcmp(codes, qz.codes.data(), kD)) << "t " << t;
              ASSERT_EQ(s, qz.scales[0]);
            } else {
              const auto qz =
                  numerics::quantize_int(row, 1, kD, numerics::IntFormat::Int8,
                                         numerics::Granularity::PerToken, numerics::Operand::K);
              ASSERT_EQ(0, std::memcmp(codes, qz.values.data(), kD)) << "t " << t;
              ASSERT_EQ(s, qz.scales[0]);
            }
          } else {
            for (int e = 0; e < kD; ++e) {
              const uint16_t bits = static_cast<uint16_t>(codes[2 * e] | codes[2 * e + 1] << 8);
              ASSERT_EQ(bits, numerics::bf16_bits(row[e])) << "t " << t;
            }
          }
        }
      }
    }
  }
}

// Appending token t writes only the bytes of its own rows (K and V codes and scales of
// each head, in page block_table[t / page], slot t % page); no earlier byte ever changes
// (tokens never move); padding is never written. And appending a span of tokens at once
// gives the same pool bytes as appending them one by one (rows are independent once c
// is fixed by the prefill).
TEST(KvCache, AppendWritesOnlyItsSlotAndTokensNeverMove) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  constexpr int kHeads = 3, kD = 64, kPage = 5, kPrefill = 7, kMore = 24;
  const int total = kPrefill + kMore;
  const Tensor4 k = testutil::gaussian(1, kHeads, total, kD, seed, 1.0f, 2.0f);
  const Tensor4 v = testutil::gaussian(1, kHeads, total, kD, seed + 7);
  constexpr uint8_t kPoison = 0xA5;
  for (KvFormat f : kAllFormats) {
    SCOPED_TRACE(name(f));
    PagedCache one = emulate::make_paged_cache(config(f, kHeads, kD, kPage, 16, 2, 7));
    assign_shuffled(one, seed + 3);
    std::fill(one.pages.begin(), one.pages.end(), kPoison);
    PagedCache bulk = one;

    // Which bytes belong to token t's rows.
    auto owned = [&](int t) {
      std::vector<bool> mask(one.pages.size(), false);
      const auto& L = one.layout;
      const int64_t base = int64_t{one.block(0, t / kPage)} * L.page_bytes;
      for (int h = 0; h < kHeads; ++h) {
        for (bool is_v : {false, true}) {
          const int64_t c = base + L.code_offset(is_v, t % kPage, h);
          const int64_t s = base + L.scale_offset(is_v, t % kPage, h);
          for (int64_t b = 0; b < L.code_row_bytes; ++b) mask[c + b] = true;
          for (int64_t b = 0; b < L.scale_row_bytes; ++b) mask[s + b] = true;
        }
      }
      return mask;
    };

    emulate::append(one, 0, tokens(k, 0, kPrefill), tokens(v, 0, kPrefill));
    emulate::append(bulk, 0, tokens(k, 0, kPrefill), tokens(v, 0, kPrefill));
    std::vector<bool> written(one.pages.size(), false);
    for (int t = 0; t < kPrefill; ++t) {
      const auto m = owned(t);
      for (std::size_t i = 0; i < m.size(); ++i) written[i] = written[i] || m[i];
    }
    for (std::size_t i = 0; i < one.pages.size(); ++i) {
      if (!written[i]) ASSERT_EQ(one.pages[i], kPoison) << "prefill wrote byte " << i;
    }
    for (int t = kPrefill; t < total; ++t) {
      const std::vector<uint8_t> before = one.pages;
      emulate::append(one, 0, tokens(k, t, 1), tokens(v, t, 1));
      const auto m = owned(t);
      for (std::size_t i = 0; i < m.size(); ++i) {
        if (!m[i]) ASSERT_EQ(one.pages[i], before[i]) << "token " << t << " changed byte " << i;
        written[i] = written[i] || m[i];
      }
    }
    for (std::size_t i = 0; i < one.pages.size(); ++i) {
      if (!written[i]) ASSERT_EQ(one.pages[i], kPoison) << "padding byte " << i << " written";
    }
    emulate::append(bulk, 0, tokens(k, kPrefill, kMore), tokens(v, kPrefill, kMore));
    EXPECT_EQ(one.pages, bulk.pages);
    EXPECT_EQ(one.lengths, bulk.lengths);
    EXPECT_EQ(one.lengths[0], total);
  }
}

// dequantize_kv gives code value × scale: the numerics quantizers' own dequantized copy,
// bit for bit, and c as fixed at the first append (or as set beforehand).
TEST(KvCache, DequantizeEqualsCodesTimesScales) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  constexpr int kHeads = 2, kD = 96, kN = 45;
  const Tensor4 k = testutil::gaussian(1, kHeads, kN, kD, seed, 1.5f, 2.0f);
  const Tensor4 v = testutil::gaussian(1, kHeads, kN, kD, seed + 1);
  std::vector<float> given(kHeads * kD);
  for (int i = 0; i < kHeads * kD; ++i) given[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  for (KvFormat f : kAllFormats) {
    for (bool set_c : {false, true}) {
      SCOPED_TRACE(std::string(name(f)) + (set_c ? " given c" : " prefill mean"));
      PagedCache cache = emulate::make_contiguous_cache(f, kHeads, kD, 2, 64);
      if (set_c) emulate::set_k_smoothing(cache, 1, given);
      emulate::append(cache, 1, tokens(k, 0, 30), tokens(v, 0, 30));
      emulate::append(cache, 1, tokens(k, 30, kN - 30), tokens(v, 30, kN - 30));
      const auto dq = emulate::dequantize_kv(cache, 1);
      ASSERT_TRUE(dq.k.same_shape(1, kHeads, kN, kD));
      for (int h = 0; h < kHeads; ++h) {
        std::vector<float> c(given.begin() + h * kD, given.begin() + (h + 1) * kD);
        if (!set_c) {
          c = numerics::token_mean(std::span<const float>(k.row(0, h, 0), std::size_t{30} * kD), 30,
                                   kD, numerics::MeanEstimate::Sampled);
        }
        for (int e = 0; e < kD; ++e) ASSERT_EQ(dq.k_mean[h * kD + e], c[e]);
        const std::span<const float> kh(k.row(0, h, 0), std::size_t{kN} * kD);
        const std::span<const float> vh(v.row(0, h, 0), std::size_t{kN} * kD);
        const auto ks = numerics::subtract_row_vector(kh, kN, kD, c);
        for (int which = 0; which < 2; ++which) {
          const std::vector<float>& x = which == 0 ? ks : std::vector<float>(vh.begin(), vh.end());
          std::vector<float> want;
          if (f == KvFormat::NvFp4) {
            want = numerics::quantize_fp4(x, kN, kD, numerics::Fp4Format::NvFp4).dequantized;
          } else if (f == KvFormat::Fp8E4M3) {
            want = numerics::quantize_fp8(x, kN, kD, numerics::Fp8Format::E4M3,
                                          numerics::Granularity::PerToken, numerics::Operand::K)
                       .dequantized;
          } else if (f == KvFormat::Int8) {
            want = numerics::quantize_int(x, kN, kD, numerics::IntFormat::Int8,
                                          numerics::Granularity::PerToken, numerics::Operand::K)
                       .dequantized;
          } else {
            for (float e : x) want.push_back(numerics::bf16_round(e));
          }
          const Tensor4& got = which == 0 ? dq.k : dq.v;
          for (int t = 0; t < kN; ++t)
            for (int e = 0; e < kD; ++e)
              ASSERT_EQ(got.at(0, h, t, e), want[t * kD + e]) << (which ? "V" : "K") << " t " << t;
        }
      }
    }
  }
}

// ---- decode -----------------------------------------------------------------------------

// The FP32 rounding budget of a decode row against exact arithmetic on the same inputs.
// Scores: a d-term recursive FP32 sum errs by about √d·u·max|partial sum| (the
// probabilistic rounding-error bound, Higham & Mary 2019, with a margin λ = 8; P = the
// largest partial sum over keys, times sm_scale: natural-log units); the scale product,
// the subtraction of the max and exp2 add a few u of |x| ≤ A·log2 e (A = max |score|).
// A relative error ε on every p moves a convex combination of V by at most 2ε·2max|v|.
// The L-term FP32 sums of p·v and of p, the tile rescales and the division add
// λ·√(L + 16)·u each.
struct RowBound {
  double o = 0, lse = 0;
};
RowBound fp32_bound(std::span<const float> q, const Tensor4& k, int h, int visible, int d,
                    double sm_scale, double vmax) {
  constexpr double kLambda = 8;
  double partial = 0, a = 0;
  for (int j = 0; j < visible; ++j) {
    double s = 0;
    for (int e = 0; e < d; ++e) {
      s += double(q[e]) * k.at(0, h, j, e);
      partial = std::max(partial, std::fabs(s) * sm_scale);
    }
    a = std::max(a, std::fabs(s) * sm_scale);
  }
  const double eps = kLambda * kU * (std::sqrt(double(d)) * partial + 4 * (a + 1));
  const double sums = kLambda * std::sqrt(double(visible + 16)) * kU;
  return {vmax * (4 * eps + 4 * sums), eps + 2 * sums};
}

struct DecodeCase {
  KvFormat format;
  int hq, hk, nq, d, page;
  std::vector<int> lengths;  // per sequence (a tail, a page multiple, shorter than nq...)
  KvSmoothing smoothing = KvSmoothing::PrefillMean;
};

struct Built {
  PagedCache cache;
  Tensor4 q;
  std::vector<Tensor4> k, v;  // raw inputs per sequence
};

Built build(const DecodeCase& c, std::uint64_t seed) {
  const int B = static_cast<int>(c.lengths.size());
  const int maxlen = *std::max_element(c.lengths.begin(), c.lengths.end());
  const int pages_per = (maxlen + c.page - 1) / c.page;
  Built b{emulate::make_paged_cache(
              config(c.format, c.hk, c.d, c.page, B * pages_per + 3, B, pages_per, c.smoothing)),
          testutil::gaussian(B, c.hq, c.nq, c.d, seed),
          {},
          {}};
  assign_shuffled(b.cache, seed);
  for (int s = 0; s < B; ++s) {
    const int n = c.lengths[s];
    b.k.push_back(testutil::gaussian(1, c.hk, n, c.d, seed + 10 + s, 1.0f, 2.0f));
    b.v.push_back(testutil::gaussian(1, c.hk, n, c.d, seed + 50 + s));
    const int prefill = std::max(1, n - c.nq);  // a prefill, then the new tokens one by one
    emulate::append(b.cache, s, tokens(b.k[s], 0, prefill), tokens(b.v[s], 0, prefill));
    for (int t = prefill; t < n; ++t)
      emulate::append(b.cache, s, tokens(b.k[s], t, 1), tokens(b.v[s], t, 1));
  }
  return b;
}

// decode_emulated equals FP64 attention of bf16(q) over the dequantized (smoothed) cache
// to FP32 rounding: O elementwise, and LSE = LSE_ref + sm_scale·q·c (the smoothing folded
// back). Every format, GQA 4:1, nq = 4 bottom-right causal, page tails, a sequence
// shorter than nq (its first rows see no key), non-identity block tables.
TEST(KvCacheDecode, MatchesFp64OnDequantizedCache) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (KvFormat f : kAllFormats) {
    for (int nq : {1, 4}) {
      SCOPED_TRACE(std::string(name(f)) + " nq " + std::to_string(nq));
      const DecodeCase dc{f, 8, 2, nq, 128, 16, {37, 64, 2, 150}};
      const Built in = build(dc, seed);
      emulate::DecodeParams p;
      p.sm_scale = 0.1;
      const auto out = emulate::decode_emulated(in.q, in.cache, p);
      double worst = 0;
      for (int s = 0; s < 4; ++s) {
        const int L = dc.lengths[s];
        const auto dq = emulate::dequantize_kv(in.cache, s);
        Tensor4 qb(1, dc.hq, nq, dc.d);
        for (int h = 0; h < dc.hq; ++h)
          for (int i = 0; i < nq; ++i)
            for (int e = 0; e < dc.d; ++e)
              qb.at(0, h, i, e) = numerics::bf16_round(in.q.at(s, h, i, e));
        const auto ref = reference::attention_forward(qb, dq.k, dq.v, {Mask::Causal, 0.1});
        double vmax = 0;
        for (float x : dq.v.data) vmax = std::max(vmax, double(std::fabs(x)));
        for (int h = 0; h < dc.hq; ++h) {
          const int hk = h / (dc.hq / dc.hk);
          for (int i = 0; i < nq; ++i) {
            const int visible = std::max(0, std::min(L, i + L - nq + 1));
            const std::span<const float> qrow(qb.row(0, h, i), dc.d);
            const RowBound bound = fp32_bound(qrow, dq.k, hk, visible, dc.d, 0.1, vmax);
            const float got_lse = out.lse[(s * dc.hq + h) * nq + i];
            const double want_lse = ref.lse[h * nq + i];
            if (visible == 0) {
              EXPECT_EQ(got_lse, -INFINITY);
              for (int e = 0; e < dc.d; ++e) EXPECT_EQ(out.o.at(s, h, i, e), 0.0f);
              continue;
            }
            double qc = 0;
            for (int e = 0; e < dc.d; ++e) qc += double(qrow[e]) * dq.k_mean[hk * dc.d + e];
            EXPECT_NEAR(got_lse, want_lse + 0.1 * qc, bound.lse + 4 * kU * std::fabs(want_lse))
                << "seq " << s << " head " << h << " row " << i;
            for (int e = 0; e < dc.d; ++e) {
              const double err = std::fabs(out.o.at(s, h, i, e) - ref.o.at(0, h, i, e));
              worst = std::max(worst, err / bound.o);
              ASSERT_LE(err, bound.o) << "seq " << s << " head " << h << " row " << i << " e " << e;
            }
          }
        }
      }
      std::printf("  %s nq %d: worst O error %.3g of the FP32 bound\n", name(f), nq, worst);
    }
  }
}

// A BF16 cache with no smoothing is FP64 attention on bf16-rounded q, k, v (computed
// here from the raw inputs, not through dequantize_kv), to FP32 rounding.
TEST(KvCacheDecode, Bf16CacheMatchesFp64OnBf16RoundedInputs) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const DecodeCase dc{KvFormat::Bf16, 4, 4, 3, 64, 8, {1, 19, 100}, KvSmoothing::None};
  const Built in = build(dc, seed);
  const auto out = emulate::decode_emulated(in.q, in.cache);
  const double sm = 1.0 / 8.0;  // the default 1/sqrt(64)
  for (int s = 0; s < 3; ++s) {
    const int L = dc.lengths[s];
    Tensor4 qb(1, dc.hq, dc.nq, dc.d), kb = in.k[s], vb = in.v[s];
    for (int h = 0; h < dc.hq; ++h)
      for (int i = 0; i < dc.nq; ++i)
        for (int e = 0; e < dc.d; ++e)
          qb.at(0, h, i, e) = numerics::bf16_round(in.q.at(s, h, i, e));
    for (float& x : kb.data) x = numerics::bf16_round(x);
    for (float& x : vb.data) x = numerics::bf16_round(x);
    const auto ref = reference::attention_forward(qb, kb, vb, {Mask::Causal, {}});
    double vmax = 0;
    for (float x : vb.data) vmax = std::max(vmax, double(std::fabs(x)));
    for (int h = 0; h < dc.hq; ++h) {
      for (int i = 0; i < dc.nq; ++i) {
        const int visible = std::max(0, std::min(L, i + L - dc.nq + 1));
        if (visible == 0) {
          EXPECT_EQ(out.lse[(s * dc.hq + h) * dc.nq + i], -INFINITY);
          continue;
        }
        const RowBound bound =
            fp32_bound({qb.row(0, h, i), std::size_t(dc.d)}, kb, h, visible, dc.d, sm, vmax);
        EXPECT_NEAR(out.lse[(s * dc.hq + h) * dc.nq + i], ref.lse[h * dc.nq + i],
                    bound.lse + 4 * kU * std::fabs(ref.lse[h * dc.nq + i]));
        for (int e = 0; e < dc.d; ++e)
          ASSERT_NEAR(out.o.at(s, h, i, e), ref.o.at(0, h, i, e), bound.o)
              << "seq " << s << " head " << h << " row " << i;
      }
    }
  }
}

// The decode's chunks (kvcache::decode_chunk_keys): S chunks of C keys cover [0, L) in
// order, every chunk starts on a multiple of 16 (the direct kernel reads one block-table
// entry per 16-key block on that), no chunk is longer than needed by more than 15 keys,
// and the last non-empty one ends at L. Every L up to 2000 and a few large ones, S 1..64.
TEST(KvCacheDecode, ChunksStartOnSixteenKeyBoundariesAndCoverTheKeys) {
  std::vector<int> lengths(2001);
  std::iota(lengths.begin(), lengths.end(), 0);
  for (int big : {65535, 65536, 65537, 1 << 20, (1 << 30) - 1, 1 << 30}) lengths.push_back(big);
  for (int L : lengths)
    for (int S = 1; S <= 64; ++S) {
      const int C = kvcache::decode_chunk_keys(L, S);
      const int even = (L + S - 1) / S;
      ASSERT_EQ(C % 16, 0) << "L " << L << " S " << S;
      ASSERT_GE(C, even) << "L " << L << " S " << S;
      ASSERT_LT(C - even, 16) << "L " << L << " S " << S;
      // Chunk s is [min(L, s·C), min(L, (s+1)·C)): the last one reaches L.
      ASSERT_GE(static_cast<int64_t>(S) * C, L) << "L " << L << " S " << S;
    }
}

// Split-KV: S chunks merged by their LSE equal the unsplit decode to FP32 rounding (the
// chunk maxima differ from the global one, so p and the merge weights round
// differently: a few u of |x| per p plus L·u from the sums). S = 1 is the unsplit decode
// bit for bit. S = 7 over 2 tokens leaves chunks empty.
TEST(KvCacheDecode, SplitMergeEqualsUnsplit) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (KvFormat f : {KvFormat::NvFp4, KvFormat::Int8}) {
    SCOPED_TRACE(name(f));
    const DecodeCase dc{f, 4, 2, 2, 64, 16, {2, 37, 300}};
    const Built in = build(dc, seed);
    emulate::DecodeParams p;
    p.kv_tile = 32;
    const auto base = emulate::decode_emulated(in.q, in.cache, p);
    for (int S : {1, 2, 7}) {
      SCOPED_TRACE("S " + std::to_string(S));
      p.num_splits = S;
      const auto out = emulate::decode_emulated(in.q, in.cache, p);
      if (S == 1) {
        EXPECT_EQ(out.o.data, base.o.data);
        EXPECT_EQ(out.lse, base.lse);
        continue;
      }
      bool differs = false;
      for (int s = 0; s < 3; ++s) {
        const int L = dc.lengths[s];
        const auto dq = emulate::dequantize_kv(in.cache, s);
        double vmax = 0;
        for (float x : dq.v.data) vmax = std::max(vmax, double(std::fabs(x)));
        for (int h = 0; h < dc.hq; ++h) {
          for (int i = 0; i < dc.nq; ++i) {
            const std::size_t li = (s * dc.hq + h) * dc.nq + i;
            const double x_max = std::fabs(base.lse[li]) * 1.4426950408889634 + 16;
            const double tol_o = vmax * kU * (16 * x_max + 4 * (L + 4 * S));
            EXPECT_NEAR(out.lse[li], base.lse[li], kU * (8 * x_max + 4 * (L + 4 * S)));
            for (int e = 0; e < dc.d; ++e) {
              ASSERT_NEAR(out.o.at(s, h, i, e), base.o.at(s, h, i, e), tol_o)
                  << "seq " << s << " head " << h << " row " << i;
              differs = differs || out.o.at(s, h, i, e) != base.o.at(s, h, i, e);
            }
          }
        }
      }
      // The split path really ran: merging chunks rounds differently somewhere.
      EXPECT_TRUE(differs);
    }
  }
}

// Bottom-right causal among the new tokens: with nq = 4 and L = 50, row i sees keys
// j <= i + 46, so changing the last token changes row 3 only (rows 0-2 bit-identical).
// GQA: query heads of one group read one KV head (equal q gives equal O bit for bit);
// the same q on the next group's KV head gives a different O.
TEST(KvCacheDecode, CausalAmongNewTokensAndGqa) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const DecodeCase dc{KvFormat::NvFp4, 8, 2, 4, 64, 16, {50}};
  Built a = build(dc, seed);
  for (int h = 1; h < dc.hq; ++h)
    for (int i = 0; i < dc.nq; ++i)
      for (int e = 0; e < dc.d; ++e) a.q.at(0, h, i, e) = a.q.at(0, 0, i, e);
  Built b = a;
  // A different last token (rewrite it by replaying the appends with a new row 49).
  b.cache = emulate::make_paged_cache(a.cache.config);
  b.cache.block_tables = a.cache.block_tables;
  Tensor4 k2 = a.k[0], v2 = a.v[0];
  for (int h = 0; h < dc.hk; ++h)
    for (int e = 0; e < dc.d; ++e) {
      k2.at(0, h, 49, e) += 3.0f;
      v2.at(0, h, 49, e) -= 2.0f;
    }
  emulate::append(b.cache, 0, tokens(k2, 0, 46), tokens(v2, 0, 46));
  for (int t = 46; t < 50; ++t) emulate::append(b.cache, 0, tokens(k2, t, 1), tokens(v2, t, 1));

  const auto oa = emulate::decode_emulated(a.q, a.cache);
  const auto ob = emulate::decode_emulated(a.q, b.cache);
  for (int h = 0; h < dc.hq; ++h) {
    for (int i = 0; i < dc.nq; ++i) {
      bool same = true;
      for (int e = 0; e < dc.d; ++e) same = same && oa.o.at(0, h, i, e) == ob.o.at(0, h, i, e);
      EXPECT_EQ(same, i < 3) << "head " << h << " row " << i;
      EXPECT_EQ(oa.lse[h * dc.nq + i] == ob.lse[h * dc.nq + i], i < 3);
    }
  }
  for (int h = 1; h < dc.hq; ++h) {
    bool same = true;
    for (int i = 0; i < dc.nq; ++i)
      for (int e = 0; e < dc.d; ++e) same = same && oa.o.at(0, h, i, e) == oa.o.at(0, 0, i, e);
    EXPECT_EQ(same, h < 4) << "head " << h;  // heads 0-3 read KV head 0, 4-7 KV head 1
  }

  // Without the mask every row sees the changed token.
  emulate::DecodeParams none;
  none.mask = Mask::None;
  const auto na = emulate::decode_emulated(a.q, a.cache, none);
  const auto nb = emulate::decode_emulated(a.q, b.cache, none);
  for (int i = 0; i < dc.nq; ++i) EXPECT_NE(na.lse[i], nb.lse[i]) << "row " << i;
}

// K smoothing earns its place: with a strong per-channel K bias the NVFP4 cache with
// c fixed at prefill is closer to FP64 attention on the raw inputs than without, and its
// LSE (q·c folded back) stays close to the true one. Thresholds: NVFP4's elements carry
// 1 mantissa bit, so per-element errors of ~1/8 of the block amax leave O at CosSim
// ~0.99 on Gaussian inputs; the bias (8σ) without smoothing inflates every K block's
// amax, and the scores' error with it.
TEST(KvCacheDecode, KSmoothingImprovesNvFp4AndKeepsTheLse) {
  const std::uint64_t seed = 20261201;  // fixed: the ordering is a statement about typical inputs
  SCOPED_TRACE(test::seed_trace(seed));
  constexpr int kHk = 2, kHq = 4, kD = 128, kN = 512, kNq = 1;
  const Tensor4 k = testutil::gaussian(1, kHk, kN, kD, seed, 1.0f, 8.0f);
  const Tensor4 v = testutil::gaussian(1, kHk, kN, kD, seed + 1);
  const Tensor4 q = testutil::gaussian(1, kHq, kNq, kD, seed + 2, 1.0f);
  const auto ref = reference::attention_forward(q, k, v, {Mask::Causal, {}});
  double cos[2], lse_err[2];
  for (int smooth = 0; smooth < 2; ++smooth) {
    PagedCache cache = emulate::make_contiguous_cache(
        KvFormat::NvFp4, kHk, kD, 1, kN, smooth ? KvSmoothing::PrefillMean : KvSmoothing::None);
    emulate::append(cache, 0, tokens(k, 0, kN - 1), tokens(v, 0, kN - 1));
    emulate::append(cache, 0, tokens(k, kN - 1, 1), tokens(v, kN - 1, 1));
    const auto out = emulate::decode_emulated(q, cache);
    cos[smooth] = metrics::compare(out.o.data, ref.o.data).cos_sim;
    lse_err[smooth] = 0;
    for (int h = 0; h < kHq; ++h)
      lse_err[smooth] = std::max(lse_err[smooth], std::fabs(out.lse[h] - ref.lse[h]));
  }
  std::printf("  NVFP4 CosSim: smoothed %.6f, unsmoothed %.6f; max LSE error %.3g / %.3g\n", cos[1],
              cos[0], lse_err[1], lse_err[0]);
  EXPECT_GT(cos[1], cos[0]);
  EXPECT_GT(cos[1], 0.98);
  EXPECT_LT(lse_err[1], 0.1);  // the LSE would be off by sm_scale·q·c ≈ O(10) without the fold
}

// NaN policy (docs/design.md, Numerics): a NaN in an appended token's K makes its row's
// scale NaN, so every decode row that sees that key is NaN (O and LSE) and the rows the
// causal mask hides it from stay finite. Per format (BF16 keeps the NaN itself).
TEST(KvCacheDecode, NanInAnAppendedKeyReachesExactlyTheRowsThatSeeIt) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (KvFormat f : kAllFormats) {
    SCOPED_TRACE(name(f));
    const DecodeCase dc{f, 2, 1, 4, 32, 8, {20}};
    Built in = build(dc, seed);
    PagedCache cache = emulate::make_paged_cache(in.cache.config);
    cache.block_tables = in.cache.block_tables;
    Tensor4 k = in.k[0];
    k.at(0, 0, 19, 5) = std::nanf("");
    emulate::append(cache, 0, tokens(k, 0, 16), tokens(in.v[0], 0, 16));
    for (int t = 16; t < 20; ++t) emulate::append(cache, 0, tokens(k, t, 1), tokens(in.v[0], t, 1));
    const auto out = emulate::decode_emulated(in.q, cache);
    for (int h = 0; h < dc.hq; ++h) {
      for (int i = 0; i < dc.nq; ++i) {
        const bool sees = i == 3;  // key 19 is visible to row i iff 19 <= i + 16
        EXPECT_EQ(std::isnan(out.lse[h * dc.nq + i]), sees) << "head " << h << " row " << i;
        for (int e = 0; e < dc.d; ++e) ASSERT_EQ(std::isnan(out.o.at(0, h, i, e)), sees);
      }
    }
  }
}

// ---- errors -----------------------------------------------------------------------------

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no std::invalid_argument; expected one naming '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not name '" << needle << "'";
  }
}

TEST(KvCache, BadInputsGetNamedErrors) {
  auto cfg = config(KvFormat::NvFp4, 2, 64, 4, 4, 2, 2);
  expect_invalid(
      [&] {
        auto c = cfg;
        c.head_dim = 72;
        emulate::make_paged_cache(c);
      },
      "head_dim");
  expect_invalid(
      [&] {
        auto c = cfg;
        c.page_size = 0;
        emulate::make_paged_cache(c);
      },
      "page_size");
  expect_invalid(
      [&] {
        auto c = cfg;
        c.num_pages = 0;
        emulate::make_paged_cache(c);
      },
      "num_pages");
  expect_invalid(
      [&] {
        auto c = cfg;
        c.format = KvFormat(9);
        emulate::make_paged_cache(c);
      },
      "format");

  PagedCache cache = emulate::make_paged_cache(cfg);
  const Tensor4 k = testutil::gaussian(1, 2, 9, 64, 1), v = testutil::gaussian(1, 2, 9, 64, 2);
  const std::vector<int32_t> bad_page{0, 4};
  expect_invalid([&] { emulate::assign_pages(cache, 0, bad_page); }, "pages[1]");
  expect_invalid([&] { emulate::assign_pages(cache, 2, std::vector<int32_t>{0}); }, "seq");
  // No page assigned yet: the block-table entry −1 is out of range.
  expect_invalid([&] { emulate::append(cache, 0, tokens(k, 0, 1), tokens(v, 0, 1)); },
                 "block_tables[0][0]");
  emulate::assign_pages(cache, 0, std::vector<int32_t>{2, 0});
  // Capacity 2 pages × 4 tokens = 8: nine tokens do not fit, and nothing is written.
  const std::vector<uint8_t> before = cache.pages;
  expect_invalid([&] { emulate::append(cache, 0, k, v); }, "capacity");
  EXPECT_EQ(cache.pages, before);
  EXPECT_EQ(cache.lengths[0], 0);
  expect_invalid([&] { emulate::append(cache, 0, tokens(k, 0, 2), tokens(v, 0, 3)); }, "v_new");
  expect_invalid(
      [&] { emulate::append(cache, 0, testutil::gaussian(1, 3, 1, 64, 3), tokens(v, 0, 1)); },
      "k_new");
  emulate::append(cache, 0, tokens(k, 0, 6), tokens(v, 0, 6));
  expect_invalid([&] { emulate::set_k_smoothing(cache, 0, std::vector<float>(128)); },
                 "already holds tokens");
  expect_invalid([&] { emulate::set_k_smoothing(cache, 1, std::vector<float>(5)); }, "c.size()");

  const Tensor4 q = testutil::gaussian(1, 4, 1, 64, 4);
  emulate::DecodeParams p;
  p.format = KvFormat::Fp8E4M3;
  expect_invalid([&] { emulate::decode_emulated(q, cache, p); }, "format");
  p = {};
  expect_invalid([&] { emulate::decode_emulated(testutil::gaussian(1, 4, 17, 64, 5), cache, p); },
                 "nq");
  expect_invalid([&] { emulate::decode_emulated(testutil::gaussian(1, 3, 1, 64, 5), cache, p); },
                 "heads_kv");
  expect_invalid([&] { emulate::decode_emulated(testutil::gaussian(1, 4, 1, 32, 5), cache, p); },
                 "head dim");
  p.num_splits = 0;
  expect_invalid([&] { emulate::decode_emulated(q, cache, p); }, "num_splits");
  p = {};
  p.seqs = {5};
  expect_invalid([&] { emulate::decode_emulated(q, cache, p); }, "seq");
  p.seqs = {0, 1};
  expect_invalid([&] { emulate::decode_emulated(q, cache, p); }, "seqs.size()");
  p = {};
  p.sm_scale = std::nan("");
  expect_invalid([&] { emulate::decode_emulated(q, cache, p); }, "sm_scale");
  // A block table the engine corrupted after the append, and a length beyond capacity.
  PagedCache broken = cache;
  broken.block(0, 1) = 4;
  expect_invalid([&] { emulate::decode_emulated(q, broken); }, "block_tables[0][1]");
  expect_invalid([&] { emulate::dequantize_kv(broken, 0); }, "block_tables[0][1]");
  broken = cache;
  broken.lengths[0] = 9;
  expect_invalid([&] { emulate::decode_emulated(q, broken); }, "capacity");
  broken = cache;
  broken.k_mean.pop_back();
  expect_invalid([&] { emulate::decode_emulated(q, broken); }, "config");
  // The valid call works.
  EXPECT_NO_THROW(emulate::decode_emulated(q, cache));
}

}  // namespace
}  // namespace qattn
