// The ablation suite behind `qattn accuracy`: every scheme's CPU emulation against the
// FP64 reference on synthetic inputs (emulate/synthetic.h). docs/accuracy-report.md
// describes the studies and how to read them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qattn::cli {

// Limits of a run, checked by validate() and named by the CLI's option checks.
// seq_len: keeps a run on a CPU in minutes rather than hours. head_dim: a multiple of 32
// (MXFP4 blocks) up to 256. batch and heads: every head's inputs, FP64 references and
// outputs are held at once, so run_suite also refuses a run whose estimate exceeds the
// machine's memory; the per-option cap keeps batch·heads·seq_len·head_dim (at most
// 2^16·2^14·2^8 = 2^38) far from any overflow before that estimate is made.
inline constexpr int kMaxSeqLen = 16384;
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 32;
inline constexpr int kMaxHeadsTotal = 65536;  // batch, heads, and batch·heads
// Worker threads: the tasks are CPU-bound, so past one per hardware thread more only
// contend; up to 4x that is accepted (a container may report fewer than it runs on).
int max_threads();

struct SuiteConfig {
  int batch = 1;
  int heads = 2;
  int seq_len = 1024;
  int head_dim = 128;
  std::uint64_t seed = 0;
  // The temperature of every study but the sweeps (1: the generator's natural scale).
  double study_temperature = 1.0;
  std::vector<double> temperatures = {1.0, 0.5, 0.25, 0.125, 0.0625};  // the sweeps
  // The precision guard's sweep: the LargeLogits family at each logit scale λ (q × λ;
  // λ = 1 is the Gaussian family, 8 the large_logits family of the other studies).
  std::vector<double> logit_scales = {1.0, 2.0, 4.0, 8.0, 16.0, 32.0};
  int threads = 0;  // 0: one per hardware thread
};

// One row of the report: a scheme variant's output (or gradient) against the reference.
struct AblationRow {
  std::string study, variant, tensor;
  double cos = 0.0, l1 = 0.0, rmse = 0.0;
  // The precision studies: the fraction of the inputs' heads that the guard flags.
  std::optional<double> flagged;
};

// The precision guard's statistic on one input set (emulate/precision.h).
struct GuardSummary {
  std::string inputs;        // the family, or "large_logits@λ" in the sweep
  double logit_scale = 1.0;  // λ of the LargeLogits recipe (1 for the other families)
  double entropy = 0.0;      // mean normalized attention entropy of the exact softmax
  double sigma_min = 0.0;    // the guard's σ (nats) over the set's heads: min, max
  double sigma_max = 0.0;
  double flagged = 0.0;  // fraction of the heads flagged (σ > threshold)
};

// A target of issue 22 on this run: `metric` of `study`/`variant` at least (or at
// most) `bound`.
struct TargetCheck {
  std::string claim, study, variant, metric;
  double value = 0.0, bound = 0.0;
  bool at_least = true;
  bool holds = false;
};

// A paper direction checked on this run: `better` should beat `worse` on CosSim.
struct DirectionCheck {
  std::string claim;  // e.g. "NVFP4 above MXFP4 (SageAttention3 Table 1a)"
  std::string study, better, worse, tensor;
  double better_cos = 0.0, worse_cos = 0.0;
  bool holds = false;
};

struct SuiteFacts {
  int e4m3_nonneg_values = 0;        // distinct non-negative finite E4M3 values
  int e4m3_values_le_one_sixth = 0;  // ... of them in [0, 1/6]
  int e2m1_magnitudes = 0;           // distinct non-negative E2M1 values
  // Distinct dequantized values of the suite's normalized softmax rows (study
  // temperature, the first 256 query rows of every head) quantized to NVFP4 with direct
  // and two-level scaling (SageAttention3 Appendix A.10: at most 35·8 = 280 direct).
  long long p_distinct_direct = 0;
  long long p_distinct_two_level = 0;
  // The same count for what the emulated SA3 kernel feeds to P·V: the unnormalized
  // P̃ = exp(S − m) of each KV tile (NVFP4, Q+K smoothing), same rows.
  long long kernel_p_distinct_direct = 0;
  long long kernel_p_distinct_two_level = 0;
  long long p_values_counted = 0;  // how many P values each count is taken over
};

struct SuiteResult {
  SuiteConfig config;
  SuiteFacts facts;
  std::vector<AblationRow> ablations;
  std::vector<DirectionCheck> directions;
  double guard_threshold_nats = 0.0;
  std::vector<GuardSummary> guard;  // one per input set of the precision studies
  std::vector<TargetCheck> targets;
  std::vector<double> normalized_entropy;  // per config.temperatures entry
  double study_entropy = 0.0;              // at config.study_temperature
  double seconds = 0.0;                    // wall time of run_suite
  int threads_used = 0;
};

// Throws std::invalid_argument naming the option on a bad configuration.
void validate(const SuiteConfig& config);

// Bytes run_suite holds at its peak for this configuration (an estimate from the sizes
// of what it keeps: inputs, references and every run's outputs; 2 heads x 1024 tokens x
// d 256: 198 MiB estimated, 201 MiB peak resident measured). Validates first.
double estimate_peak_bytes(const SuiteConfig& config);

// Runs every study; throws std::invalid_argument on a bad configuration.
SuiteResult run_suite(const SuiteConfig& config);

// One line per study: what it varies and what it holds fixed.
std::string study_description(const std::string& study);
// Study names in report order.
const std::vector<std::string>& study_order();

}  // namespace qattn::cli
