// `qattn accuracy`: the ablation suite of accuracy_suite.h as readable tables and JSON.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "accuracy_suite.h"
#include "cli_checks.h"
#include "commands.h"
#include "emulate/synthetic.h"

namespace qattn::cli {
namespace {

// The generator in one line, from its own defaults (emulate/synthetic.h).
std::string generator_line() {
  const emulate::SyntheticSpec g;
  return fmt::format(
      "q=(z+b_q)/T, k=z+b_k, v=z, dO=z; z~N(0,1); per (batch, head, channel) b_k~N(0,{:g}^2), "
      "b_q~N(0,{:g}^2); FP16-rounded",
      g.k_bias_std, g.q_bias_std);
}

// The precision studies' input families in one line (emulate/synthetic.h has the recipes).
std::string families_line() {
  const emulate::SyntheticSpec g;
  return fmt::format(
      "gaussian; large_logits q x {:g}; heavy_tail z ~ Student-t({}) at unit variance; "
      "outlier_channels max(1, d/32) channels k x {:g} / q x 1/{:g} and as many q x {:g} / "
      "k x 1/{:g}; attention_sink k_0 += ln(N)·T·sqrt(d)·b_q/|b_q|^2",
      g.large_logit_scale, g.student_t_dof, g.outlier_gain, g.outlier_gain, g.outlier_gain,
      g.outlier_gain);
}

struct AccuracyArgs {
  SuiteConfig config;
  std::string json_path;  // empty: no JSON; "-": standard output
};

nlohmann::json to_json(const SuiteResult& r) {
  using nlohmann::json;
  json j;
  const SuiteConfig& c = r.config;
  j["config"] = {{"batch", c.batch},
                 {"heads", c.heads},
                 {"seq_len", c.seq_len},
                 {"head_dim", c.head_dim},
                 {"seed", c.seed},
                 {"study_temperature", c.study_temperature},
                 {"temperatures", c.temperatures},
                 {"logit_scales", c.logit_scales},
                 {"threads", r.threads_used},
                 {"generator", generator_line()}};
  const SuiteFacts& f = r.facts;
  j["facts"] = {{"e4m3_nonneg_values", f.e4m3_nonneg_values},
                {"e4m3_values_le_one_sixth", f.e4m3_values_le_one_sixth},
                {"e2m1_magnitudes", f.e2m1_magnitudes},
                {"p_distinct_values_direct", f.p_distinct_direct},
                {"p_distinct_values_two_level", f.p_distinct_two_level},
                {"kernel_p_distinct_values_direct", f.kernel_p_distinct_direct},
                {"kernel_p_distinct_values_two_level", f.kernel_p_distinct_two_level},
                {"p_values_counted", f.p_values_counted},
                {"study_normalized_entropy", r.study_entropy}};
  json sweep = json::array();
  for (std::size_t i = 0; i < c.temperatures.size(); ++i) {
    sweep.push_back(
        {{"temperature", c.temperatures[i]}, {"normalized_entropy", r.normalized_entropy[i]}});
  }
  j["facts"]["entropy_by_temperature"] = sweep;
  json ab = json::array();
  for (const AblationRow& a : r.ablations) {
    json row = {{"study", a.study}, {"variant", a.variant}, {"tensor", a.tensor},
                {"cos", a.cos},     {"l1", a.l1},           {"rmse", a.rmse}};
    if (a.flagged) row["flagged"] = *a.flagged;
    ab.push_back(row);
  }
  j["ablations"] = ab;
  json dirs = json::array();
  for (const DirectionCheck& d : r.directions) {
    dirs.push_back({{"claim", d.claim},
                    {"study", d.study},
                    {"better", d.better},
                    {"worse", d.worse},
                    {"tensor", d.tensor},
                    {"better_cos", d.better_cos},
                    {"worse_cos", d.worse_cos},
                    {"holds", d.holds}});
  }
  j["directions"] = dirs;
  json guard = json::array();
  for (const GuardSummary& g : r.guard) {
    guard.push_back({{"inputs", g.inputs},
                     {"logit_scale", g.logit_scale},
                     {"normalized_entropy", g.entropy},
                     {"sigma_min_nats", g.sigma_min},
                     {"sigma_max_nats", g.sigma_max},
                     {"flagged", g.flagged}});
  }
  j["precision_guard"] = {{"threshold_nats", r.guard_threshold_nats}, {"inputs", guard}};
  json targets = json::array();
  for (const TargetCheck& t : r.targets) {
    targets.push_back({{"claim", t.claim},
                       {"study", t.study},
                       {"variant", t.variant},
                       {"metric", t.metric},
                       {"value", t.value},
                       {"bound", t.bound},
                       {"at_least", t.at_least},
                       {"holds", t.holds}});
  }
  j["targets"] = targets;
  j["seconds"] = r.seconds;
  return j;
}

void print_tables(std::FILE* out, const SuiteResult& r) {
  const SuiteConfig& c = r.config;
  fmt::print(out, "qattn accuracy: every scheme's CPU emulation against the FP64 reference\n");
  fmt::print(out,
             "inputs: batch {} x heads {} x seq {} x head_dim {}, seed {}, study temperature {:g} "
             "(normalized attention entropy {:.3f})\n",
             c.batch, c.heads, c.seq_len, c.head_dim, c.seed, c.study_temperature, r.study_entropy);
  fmt::print(out, "generator: {}\n", generator_line());
  fmt::print(out, "families (precision studies): {}\n\n", families_line());

  const SuiteFacts& f = r.facts;
  fmt::print(out, "facts\n");
  fmt::print(out, "  E4M3 distinct non-negative finite values   {:>8}\n", f.e4m3_nonneg_values);
  fmt::print(out, "  ... of them in [0, 1/6]                    {:>8}\n",
             f.e4m3_values_le_one_sixth);
  fmt::print(out, "  E2M1 magnitudes                            {:>8}\n", f.e2m1_magnitudes);
  fmt::print(out, "  distinct dequantized P over {} softmax values (normalized rows | kernel P̃):\n",
             f.p_values_counted);
  fmt::print(out,
             "    direct NVFP4                             {:>8} | {:>8}  (bound 35 x 8 = 280)\n",
             f.p_distinct_direct, f.kernel_p_distinct_direct);
  fmt::print(out, "    two-level NVFP4                          {:>8} | {:>8}\n\n",
             f.p_distinct_two_level, f.kernel_p_distinct_two_level);

  for (const std::string& study : study_order()) {
    fmt::print(out, "{}: {}\n", study, study_description(study));
    std::size_t width = 18;  // the variant column: wider for the precision studies' names
    bool flagged = false;
    for (const AblationRow& a : r.ablations) {
      if (a.study != study) continue;
      width = std::max(width, a.variant.size());
      flagged = flagged || a.flagged.has_value();
    }
    fmt::print(out, "  {:<{}} {:<6} {:>10} {:>10} {:>10}{}\n", "variant", width, "tensor", "CosSim",
               "rel L1", "RMSE", flagged ? "    flagged" : "");
    for (const AblationRow& a : r.ablations) {
      if (a.study != study) continue;
      fmt::print(out, "  {:<{}} {:<6} {:>10.6f} {:>10.5f} {:>10.3e}", a.variant, width, a.tensor,
                 a.cos, a.l1, a.rmse);
      if (a.flagged) fmt::print(out, " {:>10.2f}", *a.flagged);
      fmt::print(out, "\n");
    }
    if (study == "precision_logit_sweep") {
      fmt::print(out, "  guard σ (nats; threshold {:.4f}), min-max over heads, and entropy:\n",
                 r.guard_threshold_nats);
      for (const GuardSummary& g : r.guard) {
        fmt::print(out, "    {:<20} σ {:>9.4f} - {:<9.4f} flagged {:.2f}  entropy {:.3f}\n",
                   g.inputs, g.sigma_min, g.sigma_max, g.flagged, g.entropy);
      }
    }
    if (study == "entropy_sweep" || study == "p_format_sweep") {
      fmt::print(out, "  temperature -> normalized entropy:");
      for (std::size_t i = 0; i < c.temperatures.size(); ++i) {
        fmt::print(out, "  {:g} -> {:.3f}", c.temperatures[i], r.normalized_entropy[i]);
      }
      fmt::print(out, "\n");
    }
    fmt::print(out, "\n");
  }

  fmt::print(out, "paper directions on this run (CosSim)\n");
  for (const DirectionCheck& d : r.directions) {
    fmt::print(out, "  [{}] {:<62} {:.6f} vs {:.6f}\n", d.holds ? "holds" : "FAILS", d.claim,
               d.better_cos, d.worse_cos);
  }
  fmt::print(out, "\nprecision targets (issue 22)\n");
  for (const TargetCheck& t : r.targets) {
    fmt::print(out, "  [{}] {:<62} {} {:.6f} ({} {:g})\n", t.holds ? "holds" : "FAILS", t.claim,
               t.metric, t.value, t.at_least ? ">=" : "<=", t.bound);
  }
  fmt::print(out, "\n{:.1f} s on {} threads\n", r.seconds, r.threads_used);
}

// The JSON goes to FILE.tmp, renamed onto FILE once it is complete: a run that fails
// (bad options, an error mid-run, an interrupt) leaves an existing FILE as it was.
class JsonFile {
 public:
  explicit JsonFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    file_.open(tmp_, std::ios::out | std::ios::trunc);
    if (!file_) throw std::runtime_error("--json: cannot open '" + tmp_ + "' for writing");
  }
  ~JsonFile() {
    if (!committed_) {
      file_.close();
      std::error_code ignored;
      std::filesystem::remove(tmp_, ignored);
    }
  }
  JsonFile(const JsonFile&) = delete;
  JsonFile& operator=(const JsonFile&) = delete;
  void commit(const std::string& text) {
    file_ << text;
    file_.close();
    if (!file_) throw std::runtime_error("--json: failed writing '" + tmp_ + "'");
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) throw std::runtime_error("--json: cannot rename '" + tmp_ + "' to '" + path_ + "': " +
                                     ec.message());
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  std::ofstream file_;
  bool committed_ = false;
};

int run_accuracy(const AccuracyArgs& args) {
  const bool json_to_stdout = args.json_path == "-";
  // Options first (and whether the run fits in memory), so nothing is written for a bad
  // call; then the JSON's temporary file, so a bad path fails in a second, not a minute.
  estimate_peak_bytes(args.config);
  std::unique_ptr<JsonFile> file;
  if (!args.json_path.empty() && !json_to_stdout) file = std::make_unique<JsonFile>(args.json_path);
  const SuiteResult result = run_suite(args.config);
  // With JSON on stdout the tables go to stderr, so stdout stays valid JSON.
  print_tables(json_to_stdout ? stderr : stdout, result);
  if (args.json_path.empty()) return 0;
  const std::string text = to_json(result).dump(2) + "\n";
  if (json_to_stdout) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  file->commit(text);
  return 0;
}

}  // namespace

Runner add_accuracy(CLI::App& app) {
  auto args = std::make_shared<AccuracyArgs>();
  CLI::App* sub = app.add_subcommand(
      "accuracy",
      "Ablation suite on synthetic inputs: every scheme's CPU emulation against FP64 "
      "(no GPU needed); see docs/accuracy-report.md");
  SuiteConfig& c = args->config;
  sub->add_option("--seq-len", c.seq_len, "tokens per sequence (queries = keys)")
      ->capture_default_str()
      ->check(integer_in(1, kMaxSeqLen));
  sub->add_option("--head-dim", c.head_dim, "head dimension, a multiple of 32 up to 256")
      ->capture_default_str()
      ->check(integer_in(kHeadDimMultiple, kMaxHeadDim));
  sub->add_option("--heads", c.heads, "attention heads")
      ->capture_default_str()
      ->check(integer_in(1, kMaxHeadsTotal));
  sub->add_option("--batch", c.batch, "batch size")
      ->capture_default_str()
      ->check(integer_in(1, kMaxHeadsTotal));
  sub->add_option("--seed", c.seed, "generator seed")->capture_default_str()->check(uint64_value());
  add_positive_list(sub, "--temperatures", c.temperatures,
                    "temperatures of the sweeps (comma-separated; logits are divided by T)");
  add_positive_list(sub, "--logit-scales", c.logit_scales,
                    "logit scales of the precision guard's sweep (comma-separated; q is "
                    "multiplied by each)");
  sub->add_option("--study-temperature", c.study_temperature,
                  "temperature of every study but the sweeps")
      ->capture_default_str();
  sub->add_option("--threads", c.threads, "worker threads (0: one per hardware thread)")
      ->capture_default_str()
      ->check(integer_in(0, max_threads()));
  sub->add_option("--json", args->json_path,
                  "also write the results as JSON to FILE ('-': stdout)");
  return [args] { return run_accuracy(*args); };
}

}  // namespace qattn::cli
