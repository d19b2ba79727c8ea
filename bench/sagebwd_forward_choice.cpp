// Which forward should feed the SageBwd backward in training? The backward
// (emulate::sagebwd_backward, the GPU kernel's contract) takes the forward's O and LSE;
// this measures, on the accuracy report's generator (emulate/synthetic.h, FP16 inputs),
// the gradients' and the output's error against the FP64 reference for three forwards:
//   sagebwd   emulate::sagebwd_forward: the paper's forward (Algorithm 2), per-block INT8
//             Q/K/V, P̃ per token in INT8 (SageAttention3 §4.1)
//   sa2_blk   emulate::sage2_attention with per-block Q/K groups: the SA2-8b kernel as
//             the training forward runs it (qattn_fwd, QATTN_QK_PER_BLOCK): INT8 Q·Kᵀ,
//             E4M3 P̃·V with per-channel V scales, FP22 accumulator, row sums of the cast P
// and, to tell apart where a gap comes from:
//   sa2_fp    sa2_blk with row sums of the FP32 P̃ (RowSum::FloatP, the SA2 kernel before
//             bench/NOTES.md v15c) instead of the cast P: the LSE of the unrounded P̃
//   mix       sa2_blk's O with sagebwd's LSE
//   fp64      the FP64 reference's O and LSE. Not a floor: the backward recomputes P from
//             its quantized S, and an LSE that is not that S's normalizes it wrongly.
// O is rounded to FP16 before the backward reads it (what a GPU forward stores); the LSE
// stays FP32. Every forward smooths K with the kernel's sampled mean (256 tokens), and so
// does the backward unless --bwd-k-mean full: the mean over all tokens, as the GPU
// backward computes it (its k_colsum and k_mean passes).
// The backward's dQ leaves out the paper's sm_scale·rowsum(dS)·c term (the emulator's
// default and the GPU kernel's contract); --dq-mean-term 1 adds it back
// (SageBwdOptions::dq_mean_term, the emulator's default before that term was dropped).
// --pds-block-keys 64 quantizes the backward's P and dS with one scale per 64 keys of a
// tile instead of 128 (SageBwdOptions::pds_block_keys; bench/NOTES.md v57's
// per-warpgroup scales).
// CPU only; all numbers are means over the seeds (min CosSim beside them).
//
// Build and run (after QATTN_PRESET=cpu ./scripts/build.sh qattn):
//   g++ -std=c++20 -O2 -Iinclude -Isrc bench/sagebwd_forward_choice.cpp build-cpu/libqattn.a
//       -lpthread -o build-cpu/sagebwd_forward_choice
//   build-cpu/sagebwd_forward_choice [--n 1024] [--d 128] [--heads 2] [--seeds 3] [--seed 0]
//                                    [--threads 2] [--dq-mean-term 0]
//                                    [--bwd-k-mean sampled|full] [--pds-block-keys 128|64]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "emulate/sage2.h"
#include "emulate/sagebwd.h"
#include "emulate/synthetic.h"
#include "numerics/formats.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

using namespace qattn;

struct Config {
  const char* name;
  Mask mask;
  double temperature;
  double k_bias_std = emulate::SyntheticSpec{}.k_bias_std;
};

constexpr const char* kVariants[] = {"sagebwd", "sa2_blk", "sa2_fp", "mix", "fp64"};
constexpr int kNumVariants = 5;
constexpr const char* kTensors[] = {"o", "dq", "dk", "dv"};
constexpr int kNumTensors = 4;

struct Measured {
  double cos[kNumVariants][kNumTensors] = {};
  double l1[kNumVariants][kNumTensors] = {};
  double lse_max_err[kNumVariants] = {};  // max |LSE − LSE_ref| over rows that see a key
};

Measured measure(const Config& cfg, int n, int d, int heads, uint64_t seed, bool dq_mean_term,
                 bool bwd_full_mean, int pds_block_keys) {
  emulate::SyntheticSpec spec;
  spec.heads_q = spec.heads_kv = heads;
  spec.seq_q = spec.seq_kv = n;
  spec.head_dim = d;
  spec.temperature = cfg.temperature;
  spec.k_bias_std = cfg.k_bias_std;
  spec.seed = seed;
  const auto in = emulate::make_synthetic(spec);
  AttentionParams ap;
  ap.mask = cfg.mask;

  const auto ref_f = reference::attention_forward(in.q, in.k, in.v, ap);
  const auto ref_b = reference::attention_backward(in.q, in.k, in.v, in.dout, ap);

  emulate::SageBwdOptions bwd_opt;  // INT8, 16-bit dO·Vᵀ
  bwd_opt.k_smoothing = emulate::KSmoothing::SampledMean;
  bwd_opt.dq_mean_term = dq_mean_term;
  emulate::SageBwdOptions bwd_only = bwd_opt;  // the backward's own smoothing
  if (bwd_full_mean) bwd_only.k_smoothing = emulate::KSmoothing::Mean;
  bwd_only.pds_block_keys = pds_block_keys;
  emulate::Sage2Options sa2_opt;  // the SA2-8b kernel's defaults ...
  sa2_opt.granularity = numerics::Granularity::PerBlock;  // ... with the training groups

  emulate::EmulatedForward fwd[kNumVariants];
  fwd[0] = emulate::sagebwd_forward(in.q, in.k, in.v, ap, bwd_opt);
  fwd[1] = emulate::sage2_attention(in.q, in.k, in.v, ap, sa2_opt);
  emulate::Sage2Options sa2_fp_opt = sa2_opt;
  sa2_fp_opt.row_sum = emulate::RowSum::FloatP;
  fwd[2] = emulate::sage2_attention(in.q, in.k, in.v, ap, sa2_fp_opt);
  fwd[3].o = fwd[1].o;
  fwd[3].lse = fwd[0].lse;
  fwd[4].o = Tensor4(in.q.b, in.q.h, in.q.n, in.q.d);
  for (std::size_t i = 0; i < ref_f.o.data.size(); ++i)
    fwd[4].o.data[i] = static_cast<float>(ref_f.o.data[i]);
  fwd[4].lse.assign(ref_f.lse.begin(), ref_f.lse.end());

  Measured m;
  for (int v = 0; v < kNumVariants; ++v) {
    Tensor4& o = fwd[v].o;
    const auto mo = metrics::compare(std::span<const float>(o.data),
                                     std::span<const double>(ref_f.o.data));
    m.cos[v][0] = mo.cos_sim;
    m.l1[v][0] = mo.rel_l1;
    for (std::size_t i = 0; i < ref_f.lse.size(); ++i)
      if (std::isfinite(ref_f.lse[i]))
        m.lse_max_err[v] = std::max(m.lse_max_err[v], std::abs(fwd[v].lse[i] - ref_f.lse[i]));
    for (float& x : o.data) x = numerics::fp16_round(x);  // what the backward reads
    const auto g = emulate::sagebwd_backward(in.q, in.k, in.v, o, fwd[v].lse, in.dout, ap, bwd_only);
    const Tensor4* got[3] = {&g.dq, &g.dk, &g.dv};
    const Tensor4d* want[3] = {&ref_b.dq, &ref_b.dk, &ref_b.dv};
    for (int t = 0; t < 3; ++t) {
      const auto mt = metrics::compare(std::span<const float>(got[t]->data),
                                       std::span<const double>(want[t]->data));
      m.cos[v][t + 1] = mt.cos_sim;
      m.l1[v][t + 1] = mt.rel_l1;
    }
  }
  return m;
}

int arg_int(int argc, char** argv, const char* name, int def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] == '-' && std::strcmp(argv[i], "--n") && std::strcmp(argv[i], "--d") &&
        std::strcmp(argv[i], "--heads") && std::strcmp(argv[i], "--seeds") &&
        std::strcmp(argv[i], "--seed") && std::strcmp(argv[i], "--threads") &&
        std::strcmp(argv[i], "--dq-mean-term") && std::strcmp(argv[i], "--bwd-k-mean") &&
        std::strcmp(argv[i], "--pds-block-keys")) {
      std::fprintf(stderr,
                   "usage: %s [--n N] [--d D] [--heads H] [--seeds S] [--seed S0] [--threads T]"
                   " [--dq-mean-term 0|1] [--bwd-k-mean sampled|full] [--pds-block-keys 128|64]\n",
                   argv[0]);
      return 2;
    }
  const int n = arg_int(argc, argv, "--n", 1024), d = arg_int(argc, argv, "--d", 128);
  const int heads = arg_int(argc, argv, "--heads", 2), seeds = arg_int(argc, argv, "--seeds", 3);
  const int seed0 = arg_int(argc, argv, "--seed", 0);
  const int threads = std::max(1, arg_int(argc, argv, "--threads", 2));
  const int dq_term = arg_int(argc, argv, "--dq-mean-term", 0);
  const int pds_keys = arg_int(argc, argv, "--pds-block-keys", 128);
  if (pds_keys != 128 && pds_keys != 64) {
    std::fprintf(stderr, "sagebwd_forward_choice: --pds-block-keys must be 128 or 64\n");
    return 2;
  }
  if (n < 1 || d < 1 || d > 256 || heads < 1 || seeds < 1) {
    std::fprintf(stderr, "sagebwd_forward_choice: --n, --d (<= 256), --heads, --seeds must be >= 1\n");
    return 2;
  }
  const char* k_mean = "sampled";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--bwd-k-mean") == 0) k_mean = argv[i + 1];
  const bool full_mean = std::strcmp(k_mean, "full") == 0;
  if (!full_mean && std::strcmp(k_mean, "sampled") != 0) {
    std::fprintf(stderr, "sagebwd_forward_choice: --bwd-k-mean must be sampled or full\n");
    return 2;
  }
  if (dq_term != 0 && dq_term != 1) {
    std::fprintf(stderr, "sagebwd_forward_choice: --dq-mean-term must be 0 or 1\n");
    return 2;
  }
  const Config configs[] = {{"no mask, T=1", Mask::None, 1.0},
                            {"causal, T=1", Mask::Causal, 1.0},
                            {"no mask, T=0.25", Mask::None, 0.25},
                            // Diagnostic: without K's channel bias the smoothing vector c
                            // is near zero, so an error in D = rowsum(dO ∘ O) no longer
                            // reaches dQ through the sm_scale·rowsum(dS)·c term (with
                            // --dq-mean-term 1; without it, a control).
                            {"no mask, T=1, no K bias (b_k = 0)", Mask::None, 1.0, 0.0}};
  const emulate::SyntheticSpec g;
  std::printf(
      "SageBwd backward fed by each forward; against FP64. N=%d, d=%d, heads=%d, seeds %d..%d\n"
      "generator: q=(z+b_q)/T, k=z+b_k, v=z, dO=z; b_k~N(0,%g^2), b_q~N(0,%g^2) per channel; FP16\n"
      "backward: INT8, dO·Vᵀ 16-bit, K smoothed with the %s; O rounded to FP16 before it\n"
      "backward dQ: %s; P and dS: one scale per %d keys of a tile\n\n",
      n, d, heads, seed0, seed0 + seeds - 1, g.k_bias_std, g.q_bias_std,
      full_mean ? "mean over all tokens (--bwd-k-mean full)" : "sampled mean",
      dq_term ? "with the paper's sm_scale·rowsum(dS)·c term (--dq-mean-term 1)"
              : "without the rowsum(dS)·c term (the default)",
      pds_keys);

  for (const Config& cfg : configs) {
    std::vector<std::future<Measured>> jobs;
    std::vector<Measured> ms;
    for (int s = 0; s < seeds; ++s) {
      jobs.push_back(std::async(std::launch::async, measure, cfg, n, d, heads, uint64_t(seed0 + s),
                                dq_term != 0, full_mean, pds_keys));
      if (int(jobs.size()) == threads || s == seeds - 1) {
        for (auto& j : jobs) ms.push_back(j.get());
        jobs.clear();
      }
    }
    std::printf("%s\n  %-8s %-3s %10s %10s %10s   %s\n", cfg.name, "forward", "", "CosSim",
                "min cos", "rel L1", "cos − sagebwd's (mean ± sd over seeds)");
    for (int v = 0; v < kNumVariants; ++v) {
      for (int t = 0; t < kNumTensors; ++t) {
        double cos = 0, l1 = 0, mn = 1, dm = 0, d2 = 0;
        for (const Measured& m : ms) {
          cos += m.cos[v][t] / seeds;
          l1 += m.l1[v][t] / seeds;
          mn = std::min(mn, m.cos[v][t]);
          const double delta = m.cos[v][t] - m.cos[0][t];
          dm += delta / seeds;
          d2 += delta * delta / seeds;
        }
        const double sd = std::sqrt(std::max(0.0, d2 - dm * dm) * seeds / std::max(1, seeds - 1));
        std::printf("  %-8s %-3s %10.6f %10.6f %10.5f", kVariants[v], kTensors[t], cos, mn, l1);
        if (v > 0) std::printf("   %+.2e ± %.1e", dm, sd);
        std::printf("\n");
      }
      double lse = 0;
      for (const Measured& m : ms) lse = std::max(lse, m.lse_max_err[v]);
      std::printf("  %-8s lse max |err| %.3e\n", kVariants[v], lse);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}
