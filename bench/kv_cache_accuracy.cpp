// How accurate is decode attention over a quantized KV cache, per cache format? A CPU
// study (issue 20's accuracy targets): each number is the prediction of the cache's
// written contract, src/emulate/kv_cache.h (docs/kv-cache.md), that the GPU append and
// decode kernels must equal, measured against the FP64 reference.
//
// Per KV head (GQA: its Hq/Hkv query heads share one read of K/V; heads are independent
// in the cache, so each head is its own one-head cache and runs on its own thread):
//   cache   emulate::PagedCache, page_size 16, pages in order, format
//             bf16    the value rounded to BF16 (the baseline cache)
//             fp8     E4M3 codes, one FP32 scale per (token, head): amax/448
//             int8    INT8 codes, one FP32 scale per (token, head): amax/127
//             nvfp4   E2M1 codes, 1×16 blocks along d, scale E4M3(amax/6)
//           (MXFP4 is not a cache format, so it is no longer in the table.)
//   smooth  "k-c": KvSmoothing::PrefillMean, c = the per-channel mean of the sequence's
//           FIRST append over numerics' token sample (all tokens up to 256, else 256
//           evenly spaced ones), fixed afterwards; "none": KvSmoothing::None (c = 0).
//   append  the prefill: tokens [0, P), P = min(--prefix, N − nq), in one append (it
//           fixes c); then [P, N − nq) in --chunks appends of near-equal size; then the
//           nq decoded tokens in a last append (a decode step appends its tokens first).
//   decode  emulate::decode_emulated: Q in BF16, FP32 online softmax in the log2 domain
//           over kv_tile = 64-token tiles, --splits chunks of the keys merged by their
//           LSE (1: unsplit), causal mask bottom-right aligned (query i of nq sees key
//           j ≤ i + N − nq), LSE natural-log with sm_scale·q·c folded back.
// Each is compared against reference::attention_forward (FP64) on the unquantized
// inputs. The inputs are BF16 values (what a model hands the cache), so the bf16 row
// without smoothing is the FP32 arithmetic floor, and Q in BF16 adds no error.
// The cache holds K and V in one format, so K-only and V-only runs (the other kept in
// BF16) are not possible through it and are no longer made.
//
// Inputs (per KV head; q, k, v standard normal before the changes below):
//   gauss+bias     k += b, b = 2·randn(d) fixed over tokens (a K channel bias).
//   outlier+sink   as gauss+bias, then 4 channels of k and v (distinct per head) ×20, and
//                  an attention sink: every query of the head gets a shared direction u
//                  (q += 8·u, |u| = 1) and token 0's key is b + t·ū (ū the unit mean of
//                  the head's queries), t set so that the sink's mean score equals the
//                  mean log-sum-exp of the other keys' scores: on average it takes about
//                  half the attention (the measured mean share is printed). Token 0 is
//                  in the prefill's token sample, so the sink key enters c.
// nq = 1 is the last query row of the nq = 4 decode (it sees all N keys, as a single
// decoded token does), so both come from one decode call.
// Metrics: CosSim and relative L1 of O (all query heads and rows), and |LSE − LSE_ref|
// (natural log; max and mean over rows); for outlier+sink also the CosSim of O over the
// ordinary (non-outlier) channels, which the outlier channels would otherwise dominate.
// Means over the seeds, with the min CosSim beside them.
//
// Build and run (after QATTN_PRESET=cpu ./scripts/build.sh qattn):
//   g++ -std=c++20 -O2 -Iinclude -Isrc bench/kv_cache_accuracy.cpp build-cpu/libqattn.a
//       -lpthread -o build-cpu/kv_cache_accuracy
//   build-cpu/kv_cache_accuracy [--ns 2048,16384,65536] [--d 128] [--heads-q 32]
//       [--heads-kv 8] [--nq 4] [--seeds 2] [--seed 0] [--prefix 1024] [--chunks 3]
//       [--splits 1] [--threads 2] [--large-n 65536] [--large-heads-kv 2]
//       [--large-seeds 2]
// At N ≥ --large-n only the first --large-heads-kv KV heads (and their query heads) and
// --large-seeds seeds are run, to keep the run a few minutes on 2 cores.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "emulate/kv_cache.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "reference/tensor.h"

namespace {

using namespace qattn;
namespace nx = qattn::numerics;

namespace em = qattn::emulate;

constexpr em::KvFormat kCaches[] = {em::KvFormat::Bf16, em::KvFormat::Fp8E4M3, em::KvFormat::Int8,
                                    em::KvFormat::NvFp4};
constexpr int kNumCaches = 4;
constexpr const char* kCacheNames[] = {"bf16", "fp8", "int8", "nvfp4"};
constexpr int kNumVariants = 2 * kNumCaches;  // variant = cache · 2 + smoothed

enum class Input { GaussBias, OutlierSink };
constexpr const char* kInputNames[] = {"gauss+bias", "outlier+sink"};

constexpr float kKBiasStd = 2.0f;
constexpr int kOutlierChannels = 4;
constexpr float kOutlierScale = 20.0f;
constexpr float kSinkQueryAlign = 8.0f;  // |shared query direction|: the sink's score spread
constexpr int kPageSize = 16;            // tokens per page, the usual engine choice

struct Options {
  std::vector<int> ns{2048, 16384, 65536};
  int d = 128, heads_q = 32, heads_kv = 8, nq = 4, seeds = 2, seed = 0, prefix = 1024;
  int chunks = 3, splits = 1, threads = 2, large_n = 65536, large_heads_kv = 2, large_seeds = 2;
};

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One KV head's inputs: q (G·nq rows × d, query head g's rows at g·nq), k and v (n × d).
struct HeadInputs {
  std::vector<float> q, k, v;
  std::vector<int> outliers;  // channels scaled ×kOutlierScale (outlier+sink only)
  double sink_share = 0.0;    // mean over rows of the sink's attention share (FP64)
};

double dot_d(const float* a, const float* b, int d) {
  double s = 0.0;
  for (int c = 0; c < d; ++c) s += double(a[c]) * double(b[c]);
  return s;
}

HeadInputs make_inputs(Input input, int n, int d, int rows, double sm_scale, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> z;
  HeadInputs in;
  in.q.resize(std::size_t(rows) * d);
  in.k.resize(std::size_t(n) * d);
  in.v.resize(std::size_t(n) * d);
  std::vector<float> bias(d), u(d);
  for (float& x : bias) x = kKBiasStd * z(rng);
  for (float& x : in.q) x = z(rng);
  for (int j = 0; j < n; ++j)
    for (int c = 0; c < d; ++c) in.k[std::size_t(j) * d + c] = z(rng) + bias[c];
  for (float& x : in.v) x = z(rng);
  if (input == Input::OutlierSink) {
    std::vector<int> ch(d);
    for (int c = 0; c < d; ++c) ch[c] = c;
    std::shuffle(ch.begin(), ch.end(), rng);
    in.outliers.assign(ch.begin(), ch.begin() + kOutlierChannels);
    std::sort(in.outliers.begin(), in.outliers.end());
    for (int c : in.outliers) {
      bias[c] *= kOutlierScale;
      for (int j = 0; j < n; ++j) {
        in.k[std::size_t(j) * d + c] *= kOutlierScale;
        in.v[std::size_t(j) * d + c] *= kOutlierScale;
      }
    }
    double norm = 0.0;
    for (float& x : u) {
      x = z(rng);
      norm += double(x) * x;
    }
    for (float& x : u) x = float(x / std::sqrt(norm));
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < d; ++c) in.q[std::size_t(r) * d + c] += kSinkQueryAlign * u[c];
  }
  auto to_bf16 = [](std::vector<float>& x) {
    for (float& e : x) e = nx::bf16_round(e);
  };
  to_bf16(in.q);
  if (input == Input::OutlierSink) {
    // The sink key b + t·ū: its score t·A_r + B_r per row r; t makes their mean the mean
    // log-sum-exp L_r of the other keys (in FP64 over the BF16 values).
    std::vector<float> ubar(d, 0.0f);
    double norm = 0.0;
    for (int c = 0; c < d; ++c) {
      double s = 0.0;
      for (int r = 0; r < rows; ++r) s += in.q[std::size_t(r) * d + c];
      ubar[c] = float(s);
      norm += s * s;
    }
    for (float& x : ubar) x = float(x / std::sqrt(norm));
    to_bf16(in.k);
    double mean_l = 0.0, mean_a = 0.0, mean_b = 0.0;
    std::vector<double> s(n);
    for (int r = 0; r < rows; ++r) {
      const float* qr = in.q.data() + std::size_t(r) * d;
      double m = -std::numeric_limits<double>::infinity();
      for (int j = 1; j < n; ++j)
        m = std::max(m, s[j] = sm_scale * dot_d(qr, &in.k[std::size_t(j) * d], d));
      double l = 0.0;
      for (int j = 1; j < n; ++j) l += std::exp(s[j] - m);
      mean_l += m + std::log(l);
      mean_a += sm_scale * dot_d(qr, ubar.data(), d);
      mean_b += sm_scale * dot_d(qr, bias.data(), d);
    }
    const double t = (mean_l - mean_b) / mean_a;
    for (int c = 0; c < d; ++c) in.k[c] = float(bias[c] + t * ubar[c]);
  }
  to_bf16(in.k);
  to_bf16(in.v);
  return in;
}

// One (n × d) matrix as the (1, 1, rows, d) tensor of its rows [first, first + rows).
Tensor4 rows_of(const std::vector<float>& x, int first, int rows, int d) {
  Tensor4 t(1, 1, rows, d);
  std::copy(x.begin() + std::size_t(first) * d, x.begin() + std::size_t(first + rows) * d,
            t.data.begin());
  return t;
}

// Fills a one-head cache of `format` with the head's n tokens as the header's append
// schedule does, and decodes q (1, group, nq, d) from it.
em::EmulatedForward cache_decode(em::KvFormat format, em::KvSmoothing smoothing,
                                 const HeadInputs& in, const Tensor4& q, int n, int d, int prefix,
                                 int chunks, int splits) {
  const int nq = q.n;
  em::KvCacheConfig cfg;
  cfg.format = format;
  cfg.heads_kv = 1;
  cfg.head_dim = d;
  cfg.page_size = kPageSize;
  cfg.max_pages_per_seq = (n + kPageSize - 1) / kPageSize;
  cfg.num_pages = cfg.max_pages_per_seq;
  cfg.max_seqs = 1;
  cfg.k_smoothing = smoothing;
  em::PagedCache cache = em::make_paged_cache(cfg);
  std::vector<int32_t> pages(cfg.num_pages);
  for (int i = 0; i < cfg.num_pages; ++i) pages[i] = i;
  em::assign_pages(cache, 0, pages);

  auto append = [&](int first, int count) {
    if (count > 0)
      em::append(cache, 0, rows_of(in.k, first, count, d), rows_of(in.v, first, count, d));
  };
  const int body = n - nq;                 // tokens before the decoded ones
  const int pre = std::min(prefix, body);  // the prefill: the first append, it fixes c
  append(0, pre);
  const int rest = body - pre;
  for (int i = 0; i < chunks; ++i) {
    const int lo = pre + int(std::int64_t(rest) * i / chunks);
    const int hi = pre + int(std::int64_t(rest) * (i + 1) / chunks);
    append(lo, hi - lo);
  }
  append(body, nq);  // the decode step's own tokens (the first append when N = nq)

  em::DecodeParams dp;
  dp.mask = Mask::Causal;
  dp.num_splits = splits;
  dp.format = format;
  return em::decode_emulated(q, cache, dp);
}

struct HeadResult {
  std::vector<double> ref_o, ref_lse;
  std::vector<float> o[kNumVariants], lse[kNumVariants];
  std::vector<int> outliers;
  double sink_share = 0.0;
};

HeadResult run_head(Input input, int n, int nq, int group, int d, int prefix, int chunks,
                    int splits, std::uint64_t seed) {
  const int rows = group * nq;
  const double sm_scale = 1.0 / std::sqrt(double(d));
  HeadInputs in = make_inputs(input, n, d, rows, sm_scale, seed);
  HeadResult hr;
  hr.outliers = in.outliers;

  Tensor4 q(1, group, nq, d), k(1, 1, n, d), v(1, 1, n, d);
  q.data = in.q;
  k.data = in.k;
  v.data = in.v;
  AttentionParams ap;
  ap.mask = Mask::Causal;
  auto ref = reference::attention_forward(q, k, v, ap);
  hr.ref_o = std::move(ref.o.data);
  hr.ref_lse = std::move(ref.lse);
  if (input == Input::OutlierSink) {
    for (int r = 0; r < rows; ++r)
      hr.sink_share +=
          std::exp(sm_scale * dot_d(&in.q[std::size_t(r) * d], in.k.data(), d) - hr.ref_lse[r]);
    hr.sink_share /= rows;
  }

  for (int ci = 0; ci < kNumCaches; ++ci)
    for (int sm = 0; sm < 2; ++sm) {
      em::EmulatedForward dec =
          cache_decode(kCaches[ci], sm ? em::KvSmoothing::PrefillMean : em::KvSmoothing::None, in,
                       q, n, d, prefix, chunks, splits);
      hr.o[ci * 2 + sm] = std::move(dec.o.data);
      hr.lse[ci * 2 + sm] = std::move(dec.lse);
    }
  return hr;
}

struct Metrics {
  double cos = 0, l1 = 0, lse_max = 0, lse_mean = 0, cos_ordinary = 0;
};

// Metrics of one variant over the heads, on the rows of each head's query tokens
// [first_token, nq).
Metrics measure(const std::vector<HeadResult>& heads, int variant, int group, int nq, int d,
                int first_token) {
  std::vector<float> o, o_ord;
  std::vector<double> r, r_ord;
  Metrics m;
  std::size_t lse_count = 0;
  for (const HeadResult& h : heads) {
    std::vector<char> outlier(d, 0);
    for (int ch : h.outliers) outlier[ch] = 1;
    for (int g = 0; g < group; ++g)
      for (int t = first_token; t < nq; ++t) {
        const int row = g * nq + t;
        for (int e = 0; e < d; ++e) {
          const std::size_t i = std::size_t(row) * d + e;
          o.push_back(h.o[variant][i]);
          r.push_back(h.ref_o[i]);
          if (!outlier[e]) {
            o_ord.push_back(h.o[variant][i]);
            r_ord.push_back(h.ref_o[i]);
          }
        }
        const double err = std::abs(double(h.lse[variant][row]) - h.ref_lse[row]);
        m.lse_max = std::max(m.lse_max, err);
        m.lse_mean += err;
        ++lse_count;
      }
  }
  const auto mo = metrics::compare(std::span<const float>(o), std::span<const double>(r));
  m.cos = mo.cos_sim;
  m.l1 = mo.rel_l1;
  m.cos_ordinary =
      metrics::compare(std::span<const float>(o_ord), std::span<const double>(r_ord)).cos_sim;
  m.lse_mean /= double(lse_count);
  return m;
}

bool parse_int(const char* s, int& out, int min = 1) {
  char* end = nullptr;
  const long x = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || x < min || x > (1 << 30)) return false;
  out = int(x);
  return true;
}

int usage(const char* argv0, const char* what) {
  std::fprintf(stderr,
               "kv_cache_accuracy: %s\nusage: %s [--ns 2048,16384,65536] [--d 128] [--heads-q 32]"
               " [--heads-kv 8] [--nq 4] [--seeds 2] [--seed 0] [--prefix 1024] [--chunks 3]"
               " [--splits 1] [--threads 2] [--large-n 65536] [--large-heads-kv 2]"
               " [--large-seeds 2]\n",
               what, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  struct Flag {
    const char* name;
    int* value;
  } flags[] = {{"--d", &opt.d},
               {"--heads-q", &opt.heads_q},
               {"--heads-kv", &opt.heads_kv},
               {"--nq", &opt.nq},
               {"--seeds", &opt.seeds},
               {"--seed", &opt.seed},
               {"--prefix", &opt.prefix},
               {"--chunks", &opt.chunks},
               {"--splits", &opt.splits},
               {"--threads", &opt.threads},
               {"--large-n", &opt.large_n},
               {"--large-heads-kv", &opt.large_heads_kv},
               {"--large-seeds", &opt.large_seeds}};
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) return usage(argv[0], (std::string(argv[i]) + " needs a value").c_str());
    if (std::strcmp(argv[i], "--ns") == 0) {
      opt.ns.clear();
      std::string list = argv[i + 1];
      for (std::size_t p = 0; p <= list.size();) {
        const std::size_t q = std::min(list.find(',', p), list.size());
        int n = 0;
        if (!parse_int(list.substr(p, q - p).c_str(), n)) return usage(argv[0], "--ns: bad list");
        opt.ns.push_back(n);
        p = q + 1;
      }
      continue;
    }
    bool known = false;
    for (const Flag& f : flags)
      if (std::strcmp(argv[i], f.name) == 0) {
        known = true;
        const int min = f.value == &opt.seed ? 0 : 1;
        if (!parse_int(argv[i + 1], *f.value, min))
          return usage(
              argv[0],
              (std::string(f.name) + " must be an integer >= " + std::to_string(min)).c_str());
      }
    if (!known) return usage(argv[0], (std::string("unknown flag ") + argv[i]).c_str());
  }
  if (opt.heads_q % opt.heads_kv != 0) return usage(argv[0], "--heads-kv must divide --heads-q");
  if (opt.d % nx::kNvFp4Block != 0 || opt.d > em::kKvMaxHeadDim)
    return usage(argv[0], "--d must be a multiple of 16, at most 256 (the cache's head_dim)");
  if (opt.nq > em::kKvMaxQueryTokens) return usage(argv[0], "--nq must be at most 16");
  for (int n : opt.ns)
    if (n < opt.nq) return usage(argv[0], "--ns: every N must be >= --nq");
  const int group = opt.heads_q / opt.heads_kv;

  std::printf(
      "Decode over a quantized KV cache, against FP64 on the unquantized (BF16) inputs\n"
      "d=%d, Hq=%d, Hkv=%d (group %d), nq=%d (nq=1: its last row), seeds %d..\n"
      "emulate::PagedCache (page 16) + decode_emulated (kv_tile 64, %d split(s)); appends: "
      "prefill of the first min(%d, N-nq) tokens (it fixes c: its sampled K mean), the rest "
      "in %d chunks, then the nq decoded tokens\n"
      "at N >= %d: %d KV heads, %d seeds\n\n",
      opt.d, opt.heads_q, opt.heads_kv, group, opt.nq, opt.seed, opt.splits, opt.prefix, opt.chunks,
      opt.large_n, opt.large_heads_kv, opt.large_seeds);
  std::printf("%-12s %6s %2s %-6s %-6s %5s %10s %10s %9s %9s %9s %10s\n", "input", "N", "nq",
              "cache", "smooth", "hkv·s", "cos", "min cos", "rel L1", "LSE max", "LSE mean",
              "cos ord.ch");

  for (Input input : {Input::GaussBias, Input::OutlierSink}) {
    for (int n : opt.ns) {
      const bool large = n >= opt.large_n;
      const int hkv = large ? std::min(opt.large_heads_kv, opt.heads_kv) : opt.heads_kv;
      const int seeds = large ? std::min(opt.large_seeds, opt.seeds) : opt.seeds;
      // per seed, per nq choice (nq, 1), per variant
      std::vector<Metrics> per[2][kNumVariants];
      double sink = 0.0;
      for (int s = 0; s < seeds; ++s) {
        std::vector<HeadResult> heads;
        std::vector<std::future<HeadResult>> jobs;
        for (int h = 0; h < hkv; ++h) {
          const std::uint64_t hs =
              splitmix(splitmix(splitmix(std::uint64_t(opt.seed + s)) ^ std::uint64_t(input)) ^
                       (std::uint64_t(n) << 8 | std::uint64_t(h)));
          jobs.push_back(std::async(std::launch::async, run_head, input, n, opt.nq, group, opt.d,
                                    opt.prefix, opt.chunks, opt.splits, hs));
          if (int(jobs.size()) == opt.threads || h == hkv - 1) {
            for (auto& j : jobs) heads.push_back(j.get());
            jobs.clear();
          }
        }
        for (const HeadResult& h : heads) sink += h.sink_share / (double(hkv) * seeds);
        for (int v = 0; v < kNumVariants; ++v) {
          per[0][v].push_back(measure(heads, v, group, opt.nq, opt.d, 0));
          if (opt.nq > 1) per[1][v].push_back(measure(heads, v, group, opt.nq, opt.d, opt.nq - 1));
        }
      }
      if (input == Input::OutlierSink)
        std::printf("# outlier+sink N=%d: the sink's mean attention share %.3f (FP64)\n", n, sink);
      for (int which = 0; which < (opt.nq > 1 ? 2 : 1); ++which)
        for (int v = 0; v < kNumVariants; ++v) {
          const auto& ms = per[which][v];
          Metrics mean;
          double min_cos = 1.0;
          for (const Metrics& m : ms) {
            mean.cos += m.cos / ms.size();
            mean.l1 += m.l1 / ms.size();
            mean.lse_mean += m.lse_mean / ms.size();
            mean.cos_ordinary += m.cos_ordinary / ms.size();
            mean.lse_max = std::max(mean.lse_max, m.lse_max);
            min_cos = std::min(min_cos, m.cos);
          }
          char ord[16] = "-";
          if (input == Input::OutlierSink)
            std::snprintf(ord, sizeof ord, "%.6f", mean.cos_ordinary);
          std::printf("%-12s %6d %2d %-6s %-6s %2d·%-2d %10.6f %10.6f %9.2e %9.2e %9.2e %10s\n",
                      kInputNames[int(input)], n, which ? 1 : opt.nq, kCacheNames[v / 2],
                      v % 2 ? "k-c" : "none", hkv, seeds, mean.cos, min_cos, mean.l1, mean.lse_max,
                      mean.lse_mean, ord);
        }
      std::fflush(stdout);
    }
  }
  return 0;
}
