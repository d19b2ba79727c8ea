// How accurate is decode attention over a quantized KV cache, per cache format? A CPU
// study (issue 20's accuracy targets), self-contained over src/numerics quantizers and
// the FP64 reference, so that the GPU decode kernel has predicted numbers to meet.
//
// The decode it models, per KV head (GQA: its Hq/Hkv query heads share one read of K/V):
//   cache   K and V rows, one per (token, head), d long, stored as
//             bf16    the value rounded to BF16 (the baseline cache)
//             fp8     E4M3 codes, one FP32 scale per (token, head): amax/448
//             int8    INT8 codes, one FP32 scale per (token, head): amax/127
//             nvfp4   E2M1 codes, 1×16 blocks along d, scale E4M3(amax/6)
//             mxfp4   E2M1 codes, 1×32 blocks along d, scale E8M0 (for comparison)
//           (numerics::quantize_fp8/quantize_int PerToken, quantize_fp4 over each head's
//           (N × d) matrix: rows are tokens, so a row's groups are that (token, head)'s).
//   smooth  optional: K − c before quantization, c the per-head channel mean of the
//           first --prefix tokens (the prefill; kept fixed as decode appends), stored in
//           FP32 beside the cache. The softmax is unchanged by any c; decode adds
//           sm_scale·q·c (FP32) to the LSE. O changes only through K's quantization.
//   decode  Q in BF16; scores s = sm_scale·(q · k̂) in FP32 from the dequantized k̂
//           (8 interleaved partial sums along d, as lanes split d, then summed); the
//           causal mask bottom-right aligned (query i of nq sees key j ≤ i + N − nq);
//           a two-pass softmax in FP32 (the GPU's online softmax differs by rounding);
//           P·V from the dequantized V in FP32, summed per 128-key tile and the tiles
//           added in order (a split-KV merge differs by rounding); O = acc / l,
//           LSE = m + log l (+ sm_scale·q·c when smoothed).
// Each is compared against reference::attention_forward (FP64) on the unquantized
// inputs. The inputs are BF16 values (what a model hands the cache), so the bf16 row
// without smoothing is the FP32 arithmetic floor, and Q in BF16 adds no error.
//
// Inputs (per KV head; q, k, v standard normal before the changes below):
//   gauss+bias     k += b, b = 2·randn(d) fixed over tokens (a K channel bias).
//   outlier+sink   as gauss+bias, then 4 channels of k and v (distinct per head) ×20, and
//                  an attention sink: every query of the head gets a shared direction u
//                  (q += 8·u, |u| = 1) and token 0's key is b + t·ū (ū the unit mean of
//                  the head's queries), t set so that the sink's mean score equals the
//                  mean log-sum-exp of the other keys' scores: on average it takes about
//                  half the attention (the measured mean share is printed).
// nq = 1 is the last query row of the nq = 4 decode (it sees all N keys, as a single
// decoded token does), so both come from one pass over the cache.
// Metrics: CosSim and relative L1 of O (all query heads and rows), and |LSE − LSE_ref|
// (natural log; max and mean over rows); for outlier+sink also the CosSim of O over the
// ordinary (non-outlier) channels, which the outlier channels would otherwise dominate.
// Means over the seeds, with the min CosSim beside them.
//
// Build and run (after QATTN_PRESET=cpu ./scripts/build.sh qattn):
//   g++ -std=c++20 -O2 -Iinclude -Isrc bench/kv_cache_accuracy.cpp build-cpu/libqattn.a
//       -lpthread -o build-cpu/kv_cache_accuracy
//   build-cpu/kv_cache_accuracy [--ns 2048,16384,65536] [--d 128] [--heads-q 32]
//       [--heads-kv 8] [--nq 4] [--seeds 3] [--seed 0] [--prefix 1024] [--threads 2]
//       [--large-n 65536] [--large-heads-kv 4] [--large-seeds 2] [--quantize kv|k|v]
// --quantize k (or v): only K (or V) goes through the cache, the other stays BF16.
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

#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "reference/tensor.h"

namespace {

using namespace qattn;
namespace nx = qattn::numerics;

enum class Cache { Bf16, Fp8, Int8, NvFp4, MxFp4 };
constexpr Cache kCaches[] = {Cache::Bf16, Cache::Fp8, Cache::Int8, Cache::NvFp4, Cache::MxFp4};
constexpr int kNumCaches = 5;
constexpr const char* kCacheNames[] = {"bf16", "fp8", "int8", "nvfp4", "mxfp4"};
constexpr int kNumVariants = 2 * kNumCaches;  // variant = cache · 2 + smoothed

enum class Input { GaussBias, OutlierSink };

// Which of K and V go through the cache (--quantize): both, or one with the other kept
// in BF16, to tell apart where a format's error comes from.
enum class Quantized { KV, K, V };
constexpr const char* kInputNames[] = {"gauss+bias", "outlier+sink"};

constexpr float kKBiasStd = 2.0f;
constexpr int kOutlierChannels = 4;
constexpr float kOutlierScale = 20.0f;
constexpr float kSinkQueryAlign = 8.0f;  // |shared query direction|: the sink's score spread
constexpr int kLanes = 8;                // partial sums of q·k along d
constexpr int kKvTile = 128;             // keys per P·V partial sum

struct Options {
  std::vector<int> ns{2048, 16384, 65536};
  int d = 128, heads_q = 32, heads_kv = 8, nq = 4, seeds = 3, seed = 0, prefix = 1024;
  int threads = 2, large_n = 65536, large_heads_kv = 4, large_seeds = 2;
  Quantized quantized = Quantized::KV;
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

// The cache's dequantized copy of an (n × d) matrix of one head.
std::vector<float> through_cache(Cache cache, const std::vector<float>& x, int n, int d) {
  switch (cache) {
    case Cache::Bf16: {
      std::vector<float> y(x);
      for (float& e : y) e = nx::bf16_round(e);
      return y;
    }
    case Cache::Fp8:
      return nx::quantize_fp8(x, n, d, nx::Fp8Format::E4M3, nx::Granularity::PerToken,
                              nx::Operand::K)
          .dequantized;
    case Cache::Int8:
      return nx::quantize_int(x, n, d, nx::IntFormat::Int8, nx::Granularity::PerToken,
                              nx::Operand::K)
          .dequantized;
    case Cache::NvFp4:
      return nx::quantize_fp4(x, n, d, nx::Fp4Format::NvFp4).dequantized;
    case Cache::MxFp4:
      return nx::quantize_fp4(x, n, d, nx::Fp4Format::MxFp4).dequantized;
  }
  return {};
}

struct Decoded {
  std::vector<float> o;    // rows × d
  std::vector<float> lse;  // rows
};

// The decode of the header over one KV head: rows = G·nq query rows, row r is query
// token r % nq of its head. c: the smoothing mean (empty when K is not smoothed).
Decoded decode(const std::vector<float>& q, int rows, int nq, const std::vector<float>& k,
               const std::vector<float>& v, int n, int d, float sm_scale,
               const std::vector<float>& c) {
  Decoded out;
  out.o.assign(std::size_t(rows) * d, 0.0f);
  out.lse.resize(rows);
  std::vector<float> s(n), acc(d), tile(d);
  for (int r = 0; r < rows; ++r) {
    const float* qr = q.data() + std::size_t(r) * d;
    const int visible = std::min(n, r % nq + n - nq + 1);
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < visible; ++j) {
      const float* kj = k.data() + std::size_t(j) * d;
      float lane[kLanes] = {};
      for (int e = 0; e < d; e += kLanes)
        for (int i = 0; i < kLanes; ++i) lane[i] += qr[e + i] * kj[e + i];
      float dot = 0.0f;
      for (float x : lane) dot += x;
      s[j] = sm_scale * dot;
      m = std::max(m, s[j]);
    }
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j0 = 0; j0 < visible; j0 += kKvTile) {
      float lt = 0.0f;
      std::fill(tile.begin(), tile.end(), 0.0f);
      for (int j = j0; j < std::min(visible, j0 + kKvTile); ++j) {
        const float p = std::exp(s[j] - m);
        lt += p;
        const float* vj = v.data() + std::size_t(j) * d;
        for (int e = 0; e < d; ++e) tile[e] += p * vj[e];
      }
      l += lt;
      for (int e = 0; e < d; ++e) acc[e] += tile[e];
    }
    for (int e = 0; e < d; ++e) out.o[std::size_t(r) * d + e] = acc[e] / l;
    float qc = 0.0f;
    for (int e = 0; e < static_cast<int>(c.size()); ++e) qc += qr[e] * c[e];
    out.lse[r] = m + std::log(l) + sm_scale * qc;
  }
  return out;
}

struct HeadResult {
  std::vector<double> ref_o, ref_lse;
  std::vector<float> o[kNumVariants], lse[kNumVariants];
  std::vector<int> outliers;
  double sink_share = 0.0;
};

HeadResult run_head(Input input, int n, int nq, int group, int d, int prefix, Quantized which,
                    std::uint64_t seed) {
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

  const int pre = std::min(prefix, n);
  const std::vector<float> c =
      nx::token_mean(std::span<const float>(in.k).first(std::size_t(pre) * d), pre, d,
                     nx::MeanEstimate::AllTokens);
  const std::vector<float> k_smoothed = nx::smooth_k_with(in.k, n, d, c).values;
  const std::vector<float> none;
  for (int ci = 0; ci < kNumCaches; ++ci) {
    const Cache v_cache = which == Quantized::K ? Cache::Bf16 : kCaches[ci];
    const Cache k_cache = which == Quantized::V ? Cache::Bf16 : kCaches[ci];
    const std::vector<float> vq = through_cache(v_cache, in.v, n, d);
    for (int sm = 0; sm < 2; ++sm) {
      const std::vector<float> kq = through_cache(k_cache, sm ? k_smoothed : in.k, n, d);
      Decoded dec = decode(in.q, rows, nq, kq, vq, n, d, float(sm_scale), sm ? c : none);
      hr.o[ci * 2 + sm] = std::move(dec.o);
      hr.lse[ci * 2 + sm] = std::move(dec.lse);
    }
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
               " [--heads-kv 8] [--nq 4] [--seeds 3] [--seed 0] [--prefix 1024] [--threads 2]"
               " [--large-n 65536] [--large-heads-kv 4] [--large-seeds 2] [--quantize kv|k|v]\n",
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
    if (std::strcmp(argv[i], "--quantize") == 0) {
      const std::string w = argv[i + 1];
      if (w == "kv")
        opt.quantized = Quantized::KV;
      else if (w == "k")
        opt.quantized = Quantized::K;
      else if (w == "v")
        opt.quantized = Quantized::V;
      else
        return usage(argv[0], "--quantize must be kv, k or v");
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
  if (opt.d % nx::kMxFp4Block != 0) return usage(argv[0], "--d must be a multiple of 32");
  for (int n : opt.ns)
    if (n < opt.nq) return usage(argv[0], "--ns: every N must be >= --nq");
  const int group = opt.heads_q / opt.heads_kv;

  std::printf(
      "Decode over a quantized KV cache, against FP64 on the unquantized (BF16) inputs\n"
      "d=%d, Hq=%d, Hkv=%d (group %d), nq=%d (nq=1: its last row), seeds %d.., K mean from "
      "the first %d tokens\n"
      "at N >= %d: %d KV heads, %d seeds; quantized: %s\n\n",
      opt.d, opt.heads_q, opt.heads_kv, group, opt.nq, opt.seed, opt.prefix, opt.large_n,
      opt.large_heads_kv, opt.large_seeds,
      opt.quantized == Quantized::KV  ? "K and V"
      : opt.quantized == Quantized::K ? "K only (V in BF16)"
                                      : "V only (K in BF16)");
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
                                    opt.prefix, opt.quantized, hs));
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
