#include "accuracy_suite.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unistd.h>

#include "emulate/fp8_per_tensor.h"
#include "emulate/precision.h"
#include "emulate/sage2.h"
#include "emulate/sage3.h"
#include "emulate/sagebwd.h"
#include "emulate/synthetic.h"
#include "numerics/formats.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace qattn::cli {
namespace {

using emulate::KSmoothing;
using emulate::PvFormat;
using emulate::QkFormat;
using emulate::QSmoothing;
using numerics::Fp4Format;
using numerics::Granularity;

// Query rows of each head whose P values the P studies and facts look at (all when the
// sequence is shorter): bounds their memory at long sequence lengths.
constexpr int kPRows = 256;

// One (batch, head) slice of the inputs: every scheme runs per head, so heads are the
// unit of parallel work and Hq = Hkv here.
struct HeadIn {
  Tensor4 q, k, v, dout;
};

struct HeadOut {
  std::vector<float> o, dq, dk, dv;
  std::vector<float> p;        // dequantized softmax rows (p_quant_softmax)
  std::vector<float> p_trace;  // distinct dequantized P values (sorted) when traced
  // The precision runs: the guard's σ of the head (nats) and whether it is flagged.
  double guard_sigma = 0.0;
  int flagged = -1;  // -1: not a precision run
};

enum class Which { O, DQ, DK, DV, P };

const char* which_name(Which w) {
  switch (w) {
    case Which::O:
      return "o";
    case Which::DQ:
      return "dq";
    case Which::DK:
      return "dk";
    case Which::DV:
      return "dv";
    case Which::P:
      return "p";
  }
  return "?";
}

using RunFn = std::function<HeadOut(const HeadIn&)>;

struct Run {
  int input = 0;  // index into the suite's input sets (InputSets)
  RunFn fn;
  std::vector<HeadOut> heads;
};

struct RowSpec {
  std::string study, variant;
  Which which;
  int run;
  int flag_run = -1;  // a precision run whose heads' flags the row reports; -1: none
};

struct RefHead {
  std::vector<double> o, dq, dk, dv, p;
  double entropy = 0.0;
};

std::string temp_label(double t) { return fmt::format("{:g}", t); }

int p_rows(int n) { return std::min(n, kPRows); }

// The exact normalized softmax rows P of the first p_rows(n) queries (double).
std::vector<double> exact_softmax_rows(const HeadIn& in) {
  const int n = in.q.n, d = in.q.d, rows = p_rows(n);
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> p(static_cast<std::size_t>(rows) * n);
  for (int i = 0; i < rows; ++i) {
    double* pr = p.data() + static_cast<std::size_t>(i) * n;
    double mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int c = 0; c < d; ++c)
        acc += static_cast<double>(in.q.data[i * d + c]) * in.k.data[j * d + c];
      pr[j] = acc * sm_scale;
      mx = std::max(mx, pr[j]);
    }
    double z = 0.0;
    for (int j = 0; j < n; ++j) z += (pr[j] = std::exp(pr[j] - mx));
    for (int j = 0; j < n; ++j) pr[j] /= z;
  }
  return p;
}

void sort_unique(std::vector<float>& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

// ---- the emulated variants -------------------------------------------------------------

// Whether a run records the P values it feeds to P·V (for the facts).
enum class PTrace { Off, On };

RunFn sa3(Fp4Format f, emulate::PScaling p, KSmoothing k, QSmoothing q,
          PTrace trace = PTrace::Off) {
  return [=](const HeadIn& in) {
    emulate::Sage3Options o;
    o.format = f;
    o.p_scaling = p;
    o.k_smoothing = k;
    o.q_smoothing = q;
    emulate::Sage3PTrace tr;
    tr.row_limit = kPRows;
    HeadOut out;
    out.o = emulate::sage3_attention(in.q, in.k, in.v, {}, o, trace == PTrace::On ? &tr : nullptr)
                .o.data;
    if (trace == PTrace::On) {
      out.p_trace = std::move(tr.p_dequantized);
      sort_unique(out.p_trace);
    }
    return out;
  };
}

RunFn sa2(emulate::Sage2Options o) {
  return [o](const HeadIn& in) {
    HeadOut out;
    out.o = emulate::sage2_attention(in.q, in.k, in.v, {}, o).o.data;
    return out;
  };
}

// paper_dq: the paper's dQ with the K-smoothing term sm_scale·rowsum(dS)·c (the
// SageAttention3 reproduction rows); false: qattn's kernel, which leaves it out.
RunFn sagebwd(emulate::Bwd8Format f, emulate::DoVFormat dov, bool paper_dq = true,
              emulate::Bwd8Scales scales = emulate::Bwd8Scales::PerBlock) {
  return [=](const HeadIn& in) {
    emulate::SageBwdOptions o;
    o.format = f;
    o.dov = dov;
    o.dq_mean_term = paper_dq;
    o.scales = scales;
    const auto fwd = emulate::sagebwd_forward(in.q, in.k, in.v, {}, o);
    auto g = emulate::sagebwd_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.dout, {}, o);
    HeadOut out;
    out.o = fwd.o.data;
    out.dq = std::move(g.dq.data);
    out.dk = std::move(g.dk.data);
    out.dv = std::move(g.dv.data);
    return out;
  };
}

// The normalized softmax rows quantized as a standalone matrix, rows along keys in
// NVFP4 blocks of 16 (zero-padded to a multiple of 16): the setting where direct
// scaling meets the [0, 1/6] scale range head-on (SageAttention3 §3.2, Figure 3).
RunFn softmax_p(emulate::PScaling scaling) {
  return [scaling](const HeadIn& in) {
    const int n = in.q.n, rows = p_rows(n);
    const int cols =
        (n + numerics::kNvFp4Block - 1) / numerics::kNvFp4Block * numerics::kNvFp4Block;
    const std::vector<double> exact = exact_softmax_rows(in);
    std::vector<float> p(static_cast<std::size_t>(rows) * cols, 0.0f);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < n; ++j)
        p[static_cast<std::size_t>(i) * cols + j] =
            static_cast<float>(exact[static_cast<std::size_t>(i) * n + j]);
    const std::vector<float> deq = scaling == emulate::PScaling::TwoLevel
                                       ? numerics::quantize_p_two_level(p, rows, cols).dequantized
                                       : numerics::quantize_p_direct(p, rows, cols).dequantized;
    HeadOut out;
    out.p.resize(static_cast<std::size_t>(rows) * n);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < n; ++j)
        out.p[static_cast<std::size_t>(i) * n + j] = deq[static_cast<std::size_t>(i) * cols + j];
    out.p_trace = out.p;
    sort_unique(out.p_trace);
    return out;
  };
}

// One precision mode of the guard (emulate/precision.h) on the head's FP16 inputs.
RunFn precision_run(emulate::Precision p) {
  return [p](const HeadIn& in) {
    emulate::PrecisionForward f = emulate::attention_with_precision(in.q, in.k, in.v, {}, p);
    HeadOut out;
    out.o = std::move(f.fwd.o.data);
    out.guard_sigma = f.guard.sigma_nats.at(0);
    out.flagged = f.guard.flagged.at(0);
    return out;
  };
}

RunFn fp8_per_tensor() {
  return [](const HeadIn& in) {
    HeadOut out;
    out.o = emulate::fp8_per_tensor_attention(in.q, in.k, in.v, {}).o.data;
    return out;
  };
}

// ---- the study table ---------------------------------------------------------------------

class Plan {
 public:
  // A run shared by every row that names the same key (e.g. SA3's default appears in
  // four studies) is computed once.
  int run(const std::string& key, int input, RunFn fn) {
    const std::string full = key + "@" + std::to_string(input);
    auto it = index_.find(full);
    if (it != index_.end()) return it->second;
    runs.push_back(Run{input, std::move(fn), {}});
    index_[full] = static_cast<int>(runs.size()) - 1;
    return index_[full];
  }
  void row(const std::string& study, const std::string& variant, Which w, int run_index,
           int flag_run = -1) {
    rows.push_back({study, variant, w, run_index, flag_run});
  }

  std::vector<Run> runs;
  std::vector<RowSpec> rows;

 private:
  std::map<std::string, int> index_;
};

// ---- the input sets ----------------------------------------------------------------------

// One set of synthetic inputs (emulate/synthetic.h): a temperature of the Gaussian
// recipe, or one of the precision studies' families.
struct InputDef {
  double temperature = 1.0;
  emulate::InputFamily family = emulate::InputFamily::Gaussian;
  double logit_scale = 1.0;  // LargeLogits' λ (1 for the other families)
  bool operator==(const InputDef&) const = default;
};

// The inputs to generate, each once: the study temperature first (index 0), then the
// sweeps' temperatures, then the precision studies' families as build_plan asks for
// them. sweep_t[i] is config.temperatures[i]'s index.
struct InputSets {
  std::vector<InputDef> defs;
  std::vector<int> sweep_t;

  int add(InputDef d) {
    using emulate::InputFamily;
    // LargeLogits at λ = 1 is the Gaussian recipe (q × 1): the very same tensors.
    if (d.family == InputFamily::LargeLogits && d.logit_scale == 1.0)
      d.family = InputFamily::Gaussian;
    if (d.family != InputFamily::LargeLogits) d.logit_scale = 1.0;
    auto it = std::find(defs.begin(), defs.end(), d);
    if (it != defs.end()) return static_cast<int>(it - defs.begin());
    defs.push_back(d);
    return static_cast<int>(defs.size()) - 1;
  }
};

InputSets input_sets_of(const SuiteConfig& config) {
  InputSets s;
  s.add({config.study_temperature});
  for (double t : config.temperatures) s.sweep_t.push_back(s.add({t}));
  return s;
}

// What the precision studies need after the runs: per input set of theirs, the auto
// run whose heads carry the guard's statistic.
struct GuardSet {
  std::string label;
  double logit_scale = 1.0;
  int input = 0, auto_run = 0;
};

struct TargetSpec {
  std::string claim, study, variant, metric;
  double bound;
  bool at_least;
};

struct PrecisionPlan {
  std::vector<GuardSet> sets;
  std::vector<TargetSpec> targets;
};

// Runs whose P values the facts count.
struct Traced {
  int kernel_direct = -1, kernel_two_level = -1, softmax_direct = -1, softmax_two_level = -1;
};

// The precision guard (issue 22, emulate/precision.h): which error dominates on each
// input family (precision_schemes), fast / auto / precise per family (precision_guard),
// and the three across logit scales (precision_logit_sweep).
void build_precision_plan(Plan& plan, InputSets& sets, const SuiteConfig& config,
                          PrecisionPlan* pp) {
  using emulate::InputFamily;
  using emulate::Precision;
  const double t = config.study_temperature;
  const double lambda = emulate::SyntheticSpec{}.large_logit_scale;
  const InputFamily families[] = {InputFamily::Gaussian, InputFamily::LargeLogits,
                                  InputFamily::HeavyTail, InputFamily::OutlierChannels,
                                  InputFamily::AttentionSink};
  auto fast = [&](int in) { return plan.run("prec/fast", in, precision_run(Precision::Fast)); };
  auto automatic = [&](int in) {
    return plan.run("prec/auto", in, precision_run(Precision::Auto));
  };
  auto precise = [&](int in) {
    return plan.run("prec/precise", in, precision_run(Precision::Precise));
  };

  // Each quantization alone, with the other products in FP16 (exact on FP16 inputs).
  emulate::Sage2Options qk8 = emulate::fast_options();
  qk8.pv_format = PvFormat::Fp16;
  emulate::Sage2Options pv8;
  pv8.qk_format = QkFormat::Fp16;
  pv8.k_smoothing = KSmoothing::None;
  emulate::Sage2Options p8 = pv8, v8 = pv8;
  p8.v_format = PvFormat::Fp16;
  v8.pv_format = PvFormat::Fp16;
  v8.v_format = PvFormat::E4M3;
  const std::pair<const char*, emulate::Sage2Options> alone[] = {{"int8qk_fp16pv", qk8},
                                                                 {"fp16qk_e4m3pv", pv8},
                                                                 {"fp16qk_e4m3p_fp16v", p8},
                                                                 {"fp16qk_fp16p_e4m3v", v8}};
  for (InputFamily f : families) {
    const int in = sets.add({t, f, f == InputFamily::LargeLogits ? lambda : 1.0});
    const std::string fam = emulate::family_name(f);
    plan.row("precision_schemes", fam + "/fast", Which::O, fast(in));
    for (const auto& [name, o] : alone) {
      plan.row("precision_schemes", fam + "/" + name, Which::O,
               plan.run(fmt::format("prec/{}", name), in, sa2(o)));
    }
    plan.row("precision_schemes", fam + "/precise", Which::O, precise(in));
    plan.row("precision_schemes", fam + "/bf16qk_bf16pv", Which::O,
             plan.run("prec/bf16", in, sa2(emulate::precise_options(emulate::InputDtype::Bf16))));
  }
  for (InputFamily f : families) {
    const int in = sets.add({t, f, f == InputFamily::LargeLogits ? lambda : 1.0});
    const std::string fam = emulate::family_name(f);
    const int a = automatic(in);
    plan.row("precision_guard", fam + "/fast", Which::O, fast(in), a);
    plan.row("precision_guard", fam + "/auto", Which::O, a, a);
    plan.row("precision_guard", fam + "/precise", Which::O, precise(in), a);
    pp->sets.push_back({fam, f == InputFamily::LargeLogits ? lambda : 1.0, in, a});
    pp->targets.push_back({"precise CosSim >= 0.9999 on " + fam, "precision_guard",
                           fam + "/precise", "cos", 0.9999, true});
  }
  // The Hadamard rotation of Q and K − c before their quantization (QkRotation), on
  // the fast scheme and on its INT8 Q·Kᵀ alone.
  emulate::Sage2Options fast_rot = emulate::fast_options(), qk8_rot = qk8;
  fast_rot.qk_rotation = qk8_rot.qk_rotation = emulate::QkRotation::Hadamard;
  for (InputFamily f : families) {
    const int in = sets.add({t, f, f == InputFamily::LargeLogits ? lambda : 1.0});
    const std::string fam = emulate::family_name(f);
    plan.row("qk_rotation", fam + "/fast", Which::O, fast(in));
    plan.row("qk_rotation", fam + "/fast_hadamard", Which::O,
             plan.run("prec/fast_hadamard", in, sa2(fast_rot)));
    plan.row("qk_rotation", fam + "/int8qk_fp16pv", Which::O,
             plan.run("prec/int8qk_fp16pv", in, sa2(qk8)));
    plan.row("qk_rotation", fam + "/int8qk_hadamard_fp16pv", Which::O,
             plan.run("prec/int8qk_hadamard_fp16pv", in, sa2(qk8_rot)));
  }
  pp->targets.push_back({"auto CosSim >= 0.999 on large_logits", "precision_guard",
                         "large_logits/auto", "cos", 0.999, true});
  pp->targets.push_back({"auto flags every large_logits head", "precision_guard",
                         "large_logits/auto", "flagged", 1.0, true});
  pp->targets.push_back(
      {"auto flags no gaussian head", "precision_guard", "gaussian/auto", "flagged", 0.0, false});
  for (double l : config.logit_scales) {
    const int in = sets.add({t, InputFamily::LargeLogits, l});
    const std::string at = fmt::format("@{:g}", l);
    const int a = automatic(in);
    plan.row("precision_logit_sweep", "fast" + at, Which::O, fast(in), a);
    plan.row("precision_logit_sweep", "auto" + at, Which::O, a, a);
    plan.row("precision_logit_sweep", "precise" + at, Which::O, precise(in), a);
    pp->sets.push_back({"large_logits" + at, l, in, a});
  }
}

void build_plan(Plan& plan, InputSets& sets, const SuiteConfig& config, Traced* traced,
                PrecisionPlan* precision) {
  const int study_t = 0;
  const std::vector<int> sweep_t = sets.sweep_t;
  auto temp_of = [&](int t) { return sets.defs[t].temperature; };
  using emulate::PScaling;
  const auto nv = Fp4Format::NvFp4, mx = Fp4Format::MxFp4;
  const auto two = PScaling::TwoLevel, direct = PScaling::Direct;
  const auto kmean = KSmoothing::Mean, knone = KSmoothing::None;
  const auto qmean = QSmoothing::BlockMean, qnone = QSmoothing::None;

  // SageAttention3 (NVFP4, two-level P, Q+K smoothing) and its ablations.
  const int sa3_default =
      plan.run("sa3/nv/two/kq", study_t, sa3(nv, two, kmean, qmean, PTrace::On));
  const int sa3_direct =
      plan.run("sa3/nv/direct/kq", study_t, sa3(nv, direct, kmean, qmean, PTrace::On));
  traced->kernel_two_level = sa3_default;
  traced->kernel_direct = sa3_direct;
  plan.row("fp4_format", "nvfp4", Which::O, sa3_default);
  plan.row("fp4_format", "mxfp4", Which::O,
           plan.run("sa3/mx/two/kq", study_t, sa3(mx, two, kmean, qmean)));
  plan.row("p_scaling", "two_level", Which::O, sa3_default);
  plan.row("p_scaling", "direct", Which::O, sa3_direct);
  traced->softmax_two_level = plan.run("p/two", study_t, softmax_p(two));
  traced->softmax_direct = plan.run("p/direct", study_t, softmax_p(direct));
  plan.row("p_quant_softmax", "two_level", Which::P, traced->softmax_two_level);
  plan.row("p_quant_softmax", "direct", Which::P, traced->softmax_direct);
  plan.row("smoothing_fp4", "none", Which::O,
           plan.run("sa3/nv/two/-", study_t, sa3(nv, two, knone, qnone)));
  plan.row("smoothing_fp4", "k", Which::O,
           plan.run("sa3/nv/two/k", study_t, sa3(nv, two, kmean, qnone)));
  plan.row("smoothing_fp4", "q", Which::O,
           plan.run("sa3/nv/two/q", study_t, sa3(nv, two, knone, qmean)));
  plan.row("smoothing_fp4", "qk", Which::O, sa3_default);

  // SageAttention2 §3.3: the 8-bit format of P̃ in P·V, Q·Kᵀ unquantized so that only
  // P·V's formats differ. pv_format holds V in FP16 and varies P̃ alone (the claim is
  // about P̃'s distribution); pv_format_joint puts V in the same format too, as the
  // paper's Table 7 does. The row sums are of the FP32 P̃ in both, as in the paper: with
  // sums of the cast P̃ (the kernel's), INT8's rounding of small P̃ would bias the
  // denominator as well.
  const std::pair<const char*, PvFormat> pv[] = {{"e4m3", PvFormat::E4M3},
                                                 {"e5m2", PvFormat::E5M2},
                                                 {"int8", PvFormat::Int8},
                                                 {"fp16", PvFormat::Fp16}};
  auto pv_run = [&](PvFormat p_format, std::optional<PvFormat> v_format, int t) {
    emulate::Sage2Options o;
    o.qk_format = QkFormat::Fp32;
    o.pv_format = p_format;
    o.v_format = v_format;
    o.row_sum = emulate::RowSum::FloatP;
    const int v_key = v_format ? static_cast<int>(*v_format) : -1;
    return plan.run(fmt::format("sa2/p{}/v{}", static_cast<int>(p_format), v_key), t, sa2(o));
  };
  for (const auto& [name, f] : pv) {
    plan.row("pv_format", name, Which::O, pv_run(f, PvFormat::Fp16, study_t));
  }
  for (const auto& [name, f] : pv) {
    plan.row("pv_format_joint", name, Which::O, pv_run(f, std::nullopt, study_t));
  }

  // SageAttention2 §3.2 (Table 6): INT4 Q·Kᵀ granularity, Q and K smoothed, P·V in FP16.
  const std::pair<const char*, Granularity> gran[] = {{"per_tensor", Granularity::PerTensor},
                                                      {"per_block", Granularity::PerBlock},
                                                      {"per_thread", Granularity::PerThread},
                                                      {"per_token", Granularity::PerToken}};
  for (const auto& [name, g] : gran) {
    emulate::Sage2Options o;
    o.qk_format = QkFormat::Int4;
    o.granularity = g;
    o.q_smoothing = qmean;
    o.pv_format = PvFormat::Fp16;
    plan.row("qk_granularity_int4", name, Which::O,
             plan.run(fmt::format("sa2/int4/g{}", static_cast<int>(g)), study_t, sa2(o)));
  }

  // SageBwd (SageAttention3 §4): dO·Vᵀ precision and the 8-bit format.
  using emulate::Bwd8Format;
  using emulate::DoVFormat;
  const int bwd = plan.run("bwd/int8/fp16", study_t, sagebwd(Bwd8Format::Int8, DoVFormat::Fp16));
  const int bwd_dov8 =
      plan.run("bwd/int8/int8", study_t, sagebwd(Bwd8Format::Int8, DoVFormat::Quantized));
  const int bwd_fp8 = plan.run("bwd/fp8/fp16", study_t, sagebwd(Bwd8Format::E4M3, DoVFormat::Fp16));
  for (Which w : {Which::DQ, Which::DK, Which::DV}) {
    plan.row("sagebwd_dov", "fp16", w, bwd);
    plan.row("sagebwd_dov", "int8", w, bwd_dov8);
  }
  for (Which w : {Which::DQ, Which::DK, Which::DV, Which::O}) {
    plan.row("sagebwd_format", "int8", w, bwd);
    plan.row("sagebwd_format", "fp8", w, bwd_fp8);
  }
  // qattn's dQ (no rowsum(dS)·c term, emulate/sagebwd.h step 5) against the paper's.
  const int bwd_qattn = plan.run("bwd/int8/fp16/qattn", study_t,
                                 sagebwd(Bwd8Format::Int8, DoVFormat::Fp16, false));
  const int bwd_qattn_fp8 = plan.run("bwd/fp8/fp16/qattn", study_t,
                                     sagebwd(Bwd8Format::E4M3, DoVFormat::Fp16, false));
  plan.row("sagebwd_dq_term", "paper", Which::DQ, bwd);
  plan.row("sagebwd_dq_term", "qattn", Which::DQ, bwd_qattn);
  plan.row("sagebwd_dq_term", "qattn_fp8", Which::DQ, bwd_qattn_fp8);
  // Scales fixed before the kernel (no merges) against per-block, both E4M3, qattn's dQ.
  const int bwd_merge_free =
      plan.run("bwd/fp8/fp16/qattn/merge_free", study_t,
               sagebwd(Bwd8Format::E4M3, DoVFormat::Fp16, false, emulate::Bwd8Scales::MergeFree));
  for (Which w : {Which::DQ, Which::DK, Which::DV}) {
    plan.row("sagebwd_scales", "fp8_per_block", w, bwd_qattn_fp8);
    plan.row("sagebwd_scales", "fp8_merge_free", w, bwd_merge_free);
  }

  // From diffuse to peaked attention.
  for (int t : sweep_t) {
    const std::string at = "@" + temp_label(temp_of(t));
    plan.row("entropy_sweep", "two_level" + at, Which::O,
             plan.run("sa3/nv/two/kq", t,
                      sa3(nv, two, kmean, qmean, t == study_t ? PTrace::On : PTrace::Off)));
    plan.row("entropy_sweep", "direct" + at, Which::O,
             plan.run("sa3/nv/direct/kq", t,
                      sa3(nv, direct, kmean, qmean, t == study_t ? PTrace::On : PTrace::Off)));
  }
  for (int t : sweep_t) {
    const std::string at = "@" + temp_label(temp_of(t));
    plan.row("p_format_sweep", "e4m3" + at, Which::O, pv_run(PvFormat::E4M3, PvFormat::Fp16, t));
    plan.row("p_format_sweep", "int8" + at, Which::O, pv_run(PvFormat::Int8, PvFormat::Fp16, t));
  }

  // The schemes side by side, each with its own defaults.
  plan.row("schemes", "sa2_8b", Which::O, plan.run("sa2/8b", study_t, sa2({})));
  emulate::Sage2Options four;
  four.qk_format = QkFormat::Int4;
  four.q_smoothing = qmean;
  plan.row("schemes", "sa2_4b", Which::O, plan.run("sa2/4b", study_t, sa2(four)));
  plan.row("schemes", "sa3_nvfp4", Which::O, sa3_default);
  plan.row("schemes", "fp8_per_tensor", Which::O, plan.run("fp8pt", study_t, fp8_per_tensor()));
  for (Which w : {Which::O, Which::DQ, Which::DK, Which::DV})
    plan.row("schemes", "sagebwd", w, bwd);

  build_precision_plan(plan, sets, config, precision);
}

struct CheckSpec {
  const char* claim;
  const char* study;
  const char* better;
  const char* worse;
  Which which;
};

constexpr CheckSpec kChecks[] = {
    {"NVFP4 above MXFP4 (SageAttention3 Table 1a)", "fp4_format", "nvfp4", "mxfp4", Which::O},
    {"two-level above direct P scaling (SageAttention3 Table 1b)", "p_scaling", "two_level",
     "direct", Which::O},
    {"two-level above direct on the softmax rows P (SA3 Figure 3e)", "p_quant_softmax", "two_level",
     "direct", Which::P},
    {"Q+K smoothing above none (SageAttention3 Table 16)", "smoothing_fp4", "qk", "none", Which::O},
    {"K smoothing above none (SageAttention3 Table 16)", "smoothing_fp4", "k", "none", Which::O},
    {"Q smoothing above none (SageAttention3 Table 16)", "smoothing_fp4", "q", "none", Which::O},
    {"E4M3 above INT8 for P (V in FP16; SageAttention2 §3.3)", "pv_format", "e4m3", "int8",
     Which::O},
    {"E4M3 above E5M2 for P (V in FP16; SageAttention2 §3.3)", "pv_format", "e4m3", "e5m2",
     Which::O},
    {"E4M3 above INT8 for P and V (SageAttention2 Table 7)", "pv_format_joint", "e4m3", "int8",
     Which::O},
    {"per-thread above per-block for INT4 (SageAttention2 Table 6)", "qk_granularity_int4",
     "per_thread", "per_block", Which::O},
    {"16-bit dO·Vᵀ above INT8 on dQ (SageAttention3 Table 1c)", "sagebwd_dov", "fp16", "int8",
     Which::DQ},
    {"INT8 above FP8 SageBwd on dQ (SageAttention3 Table 7)", "sagebwd_format", "int8", "fp8",
     Which::DQ},
    {"dQ without the rowsum(dS)·c term above the paper's (qattn)", "sagebwd_dq_term", "qattn",
     "paper", Which::DQ},
    {"INT8 above FP8 SageBwd on dQ without the rowsum(dS)·c term", "sagebwd_dq_term",
     "qattn", "qattn_fp8", Which::DQ},
};

// ---- facts ----------------------------------------------------------------------------------

void count_format_facts(SuiteFacts& f) {
  std::set<float> e4m3, e2m1;
  for (int c = 0; c < 256; ++c) {
    const float v = numerics::e4m3_decode(static_cast<std::uint8_t>(c));
    if (std::isfinite(v) && v >= 0.0f) e4m3.insert(v);  // −0 and +0 are one value
  }
  for (int c = 0; c < 16; ++c) {
    const float v = numerics::e2m1_decode(static_cast<std::uint8_t>(c));
    if (v >= 0.0f) e2m1.insert(v);
  }
  f.e4m3_nonneg_values = static_cast<int>(e4m3.size());
  f.e4m3_values_le_one_sixth = static_cast<int>(
      std::count_if(e4m3.begin(), e4m3.end(), [](float v) { return v <= 1.0f / 6.0f; }));
  f.e2m1_magnitudes = static_cast<int>(e2m1.size());
}

long long distinct_over_heads(const Run& run) {
  std::vector<float> all;
  for (const HeadOut& h : run.heads) all.insert(all.end(), h.p_trace.begin(), h.p_trace.end());
  std::sort(all.begin(), all.end());
  return std::unique(all.begin(), all.end()) - all.begin();
}

// Runs the tasks on `threads` workers; rethrows the first exception. A thread that
// cannot be started ends the run with an error naming --threads, after the started ones
// have finished (a std::thread left unjoined would abort the process).
void run_parallel(std::vector<std::function<void()>>& tasks, int threads) {
  std::atomic<std::size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (std::size_t i = next++; i < tasks.size(); i = next++) {
      try {
        tasks[i]();
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  std::string start_error;
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error& e) {
      start_error = fmt::format("--threads {}: could not start thread {} ({})", threads, t + 1,
                                e.what());
      next = tasks.size();  // the started workers stop after their current task
      break;
    }
  }
  if (start_error.empty()) worker();
  for (std::thread& t : pool) t.join();
  if (!start_error.empty()) throw std::runtime_error(start_error);
  if (error) std::rethrow_exception(error);
}

}  // namespace

const std::vector<std::string>& study_order() {
  static const std::vector<std::string> order = {
      "fp4_format",     "p_scaling",         "p_quant_softmax",     "smoothing_fp4",
      "pv_format",      "pv_format_joint",   "qk_granularity_int4", "sagebwd_dov",
      "sagebwd_format", "sagebwd_dq_term",   "sagebwd_scales",      "entropy_sweep",       "p_format_sweep",
      "schemes",        "precision_schemes", "precision_guard",     "precision_logit_sweep",
      "qk_rotation"};
  return order;
}

std::string study_description(const std::string& s) {
  if (s == "fp4_format") return "FP4 format of Q, K, P, V (SA3: two-level P, Q+K smoothing)";
  if (s == "p_scaling") return "P scaling for the FP4 P·V (SA3: NVFP4, Q+K smoothing)";
  if (s == "smoothing_fp4") return "Q/K smoothing before FP4 (SA3: NVFP4, two-level P)";
  if (s == "pv_format") return "format of P̃ in P·V (SA2; V in FP16, Q·Kᵀ unquantized)";
  if (s == "pv_format_joint") {
    return "format of P̃ and V together (SA2 Table 7 setup; Q·Kᵀ unquantized)";
  }
  if (s == "qk_granularity_int4") {
    return "INT4 Q·Kᵀ scale groups (SA2: Q and K smoothed, P·V in FP16)";
  }
  if (s == "sagebwd_dov") return "precision of dO·Vᵀ in the SageBwd backward (INT8 elsewhere)";
  if (s == "sagebwd_format") return "8-bit format of SageBwd's quantized matmuls (dO·Vᵀ FP16)";
  if (s == "sagebwd_dq_term")
    return "SageBwd dQ: the paper's (with sm_scale·rowsum(dS)·c) vs qattn's kernel (without)";
  if (s == "sagebwd_scales")
    return "SageBwd E4M3 scales: per block (merged per Q block) vs fixed before the kernel (merge-free)";
  if (s == "entropy_sweep")
    return "SA3 two-level vs direct P as attention sharpens (T: temperature)";
  if (s == "p_format_sweep") {
    return "P̃'s format alone (V in FP16, Q·Kᵀ unquantized), E4M3 vs INT8, as attention sharpens";
  }
  if (s == "p_quant_softmax") {
    return "the normalized softmax rows P quantized to NVFP4 on their own (error of P itself)";
  }
  if (s == "schemes") return "every scheme with its own defaults";
  if (s == "precision_schemes") {
    return "per input family: SA2-8b (fast), each of its quantizations alone (the other "
           "products FP16), the precise scheme (FP16 Q·Kᵀ and P·V) and BF16";
  }
  if (s == "precision_guard") {
    return "per input family: fast, auto (precise on the heads the guard flags) and precise";
  }
  if (s == "qk_rotation") {
    return "per input family: Q and K - c rotated by a signed Hadamard matrix before INT8 "
           "(fast, and INT8 Q·Kᵀ alone with FP16 P·V), against the same without";
  }
  if (s == "precision_logit_sweep") {
    return "fast / auto / precise on the large-logit recipe at each logit scale (q × λ)";
  }
  return s;
}

int max_threads() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

void validate(const SuiteConfig& c) {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  if (c.batch < 1 || c.batch > kMaxHeadsTotal) {
    fail(fmt::format("--batch must be in [1, {}], got {}", kMaxHeadsTotal, c.batch));
  }
  if (c.heads < 1 || c.heads > kMaxHeadsTotal) {
    fail(fmt::format("--heads must be in [1, {}], got {}", kMaxHeadsTotal, c.heads));
  }
  if (static_cast<long long>(c.batch) * c.heads > kMaxHeadsTotal) {
    fail(fmt::format("--batch x --heads must be at most {}, got {} x {}", kMaxHeadsTotal, c.batch,
                     c.heads));
  }
  if (c.seq_len < 1 || c.seq_len > kMaxSeqLen) {
    fail(fmt::format("--seq-len must be in [1, {}], got {}", kMaxSeqLen, c.seq_len));
  }
  if (c.head_dim < kHeadDimMultiple || c.head_dim > kMaxHeadDim ||
      c.head_dim % kHeadDimMultiple != 0) {
    fail(fmt::format("--head-dim must be a multiple of {} in [{}, {}] (MXFP4 blocks of 32), got {}",
                     kHeadDimMultiple, kHeadDimMultiple, kMaxHeadDim, c.head_dim));
  }
  if (c.temperatures.empty()) fail("--temperatures must list at least one temperature");
  for (double t : c.temperatures) {
    if (!std::isfinite(t) || t <= 0.0) fail(fmt::format("--temperatures: {} is not > 0", t));
  }
  if (c.logit_scales.empty()) fail("--logit-scales must list at least one scale");
  for (double l : c.logit_scales) {
    if (!std::isfinite(l) || l <= 0.0) fail(fmt::format("--logit-scales: {} is not > 0", l));
  }
  if (!std::isfinite(c.study_temperature) || c.study_temperature <= 0.0) {
    fail(fmt::format("--study-temperature must be > 0, got {}", c.study_temperature));
  }
  if (c.threads < 0 || c.threads > max_threads()) {
    fail(fmt::format("--threads must be in [0, {}] (0: one per hardware thread; at most 4 per "
                     "hardware thread), got {}",
                     max_threads(), c.threads));
  }
}

namespace {

// Peak bytes of run_suite: the sizes of what it holds at once, per head (float inputs
// q, k, v, dO per temperature; the FP64 reference O per temperature, and at the study
// temperature P's rows and dQ, dK, dV; every run's outputs that a row reads, plus the
// traced P values), and the generator's full tensors and one row's concatenated
// metrics on top.
double peak_bytes(const SuiteConfig& c, const Plan& plan, std::size_t ntemps) {
  const double nd = static_cast<double>(c.seq_len) * c.head_dim;
  const double pn = static_cast<double>(p_rows(c.seq_len)) * c.seq_len;
  double per_head = ntemps * (4 * 4 * nd + 8 * nd) + 8 * pn + 3 * 8 * nd;
  std::vector<std::set<Which>> reads(plan.runs.size());
  for (const RowSpec& r : plan.rows) reads[r.run].insert(r.which);
  for (const auto& w : reads)
    for (Which x : w) per_head += 4 * (x == Which::P ? pn : nd);
  per_head += 4 * 4 * pn;  // the four traced runs' P values (at most one per P element)
  const double heads = static_cast<double>(c.batch) * c.heads;
  return heads * (per_head + 4 * 4 * nd + 12 * std::max(nd, pn));
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * page : 0.0;
}

}  // namespace

double estimate_peak_bytes(const SuiteConfig& config) {
  validate(config);
  InputSets sets = input_sets_of(config);
  Plan plan;
  Traced traced;
  PrecisionPlan precision;
  build_plan(plan, sets, config, &traced, &precision);
  return peak_bytes(config, plan, sets.defs.size());
}

SuiteResult run_suite(const SuiteConfig& config) {
  validate(config);
  const auto start = std::chrono::steady_clock::now();
  SuiteResult result;
  result.config = config;
  count_format_facts(result.facts);

  InputSets sets = input_sets_of(config);
  Plan plan;
  Traced traced;
  PrecisionPlan precision;
  build_plan(plan, sets, config, &traced, &precision);
  const std::vector<InputDef>& defs = sets.defs;
  const std::vector<int>& sweep_t = sets.sweep_t;
  const int study_t = 0;
  // Refuse before allocating: a run past the machine's memory would end in bad_alloc
  // (or the OOM killer) after minutes, naming no option.
  const double need = peak_bytes(config, plan, defs.size()), have = physical_memory_bytes();
  if (have > 0 && need > have) {
    throw std::invalid_argument(fmt::format(
        "--batch {} x --heads {} at --seq-len {}, --head-dim {} needs about {:.1f} GiB (every "
        "head's inputs, FP64 references and outputs are held at once); this machine has {:.1f} "
        "GiB: lower --batch, --heads or --seq-len",
        config.batch, config.heads, config.seq_len, config.head_dim, need / (1 << 30),
        have / (1 << 30)));
  }

  const int nheads = config.batch * config.heads;
  const int n = config.seq_len, d = config.head_dim;
  const std::size_t head_elems = static_cast<std::size_t>(n) * d;
  std::vector<std::vector<HeadIn>> inputs(defs.size());
  for (std::size_t t = 0; t < defs.size(); ++t) {
    emulate::SyntheticSpec s;
    s.batch = config.batch;
    s.heads_q = s.heads_kv = config.heads;
    s.seq_q = s.seq_kv = n;
    s.head_dim = d;
    s.temperature = defs[t].temperature;
    s.family = defs[t].family;
    if (defs[t].family == emulate::InputFamily::LargeLogits) {
      s.large_logit_scale = defs[t].logit_scale;
    }
    s.seed = config.seed;
    const emulate::SyntheticInputs full = emulate::make_synthetic(s);
    for (int b = 0; b < config.batch; ++b) {
      for (int h = 0; h < config.heads; ++h) {
        HeadIn in{Tensor4(1, 1, n, d), Tensor4(1, 1, n, d), Tensor4(1, 1, n, d),
                  Tensor4(1, 1, n, d)};
        std::copy_n(full.q.row(b, h, 0), head_elems, in.q.data.begin());
        std::copy_n(full.k.row(b, h, 0), head_elems, in.k.data.begin());
        std::copy_n(full.v.row(b, h, 0), head_elems, in.v.data.begin());
        std::copy_n(full.dout.row(b, h, 0), head_elems, in.dout.data.begin());
        inputs[t].push_back(std::move(in));
      }
    }
  }

  // Tasks: the references (with the backward at the study temperature, the costliest
  // first), then every run on every head.
  std::vector<std::vector<RefHead>> refs(defs.size(), std::vector<RefHead>(nheads));
  std::vector<std::function<void()>> tasks;
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::size_t t = 0; t < defs.size(); ++t) {
    for (int h = 0; h < nheads; ++h) {
      tasks.push_back([&, t, h] {
        const HeadIn& in = inputs[t][h];
        RefHead& r = refs[t][h];
        r.o = reference::attention_forward(in.q, in.k, in.v).o.data;
        r.entropy = emulate::mean_normalized_entropy(in.q, in.k, sm_scale);
        if (t == study_t) {
          r.p = exact_softmax_rows(in);
          auto g = reference::attention_backward(in.q, in.k, in.v, in.dout);
          r.dq = std::move(g.dq.data);
          r.dk = std::move(g.dk.data);
          r.dv = std::move(g.dv.data);
        }
      });
    }
  }
  for (Run& run : plan.runs) run.heads.resize(nheads);
  for (std::size_t r = 0; r < plan.runs.size(); ++r) {
    for (int h = 0; h < nheads; ++h) {
      tasks.push_back([&, r, h] {
        Run& run = plan.runs[r];
        run.heads[h] = run.fn(inputs[run.input][h]);
      });
    }
  }
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  result.threads_used = config.threads > 0 ? config.threads : hw;
  run_parallel(tasks, result.threads_used);

  // Metrics over all heads at once.
  auto out_of = [](const HeadOut& h, Which w) -> const std::vector<float>& {
    return w == Which::O    ? h.o
           : w == Which::DQ ? h.dq
           : w == Which::DK ? h.dk
           : w == Which::DV ? h.dv
                            : h.p;
  };
  auto ref_of = [](const RefHead& h, Which w) -> const std::vector<double>& {
    return w == Which::O    ? h.o
           : w == Which::DQ ? h.dq
           : w == Which::DK ? h.dk
           : w == Which::DV ? h.dv
                            : h.p;
  };
  for (const RowSpec& row : plan.rows) {
    const Run& run = plan.runs[row.run];
    std::vector<float> out;
    std::vector<double> ref;
    for (int h = 0; h < nheads; ++h) {
      const auto& o = out_of(run.heads[h], row.which);
      const auto& r = ref_of(refs[run.input][h], row.which);
      out.insert(out.end(), o.begin(), o.end());
      ref.insert(ref.end(), r.begin(), r.end());
    }
    const metrics::ErrorMetrics m = metrics::compare(out, ref);
    AblationRow a{row.study, row.variant, which_name(row.which), m.cos_sim, m.rel_l1, m.rmse, {}};
    if (row.flag_run >= 0) {
      const std::vector<HeadOut>& heads = plan.runs[row.flag_run].heads;
      a.flagged =
          static_cast<double>(std::count_if(heads.begin(), heads.end(),
                                            [](const HeadOut& x) { return x.flagged == 1; })) /
          nheads;
    }
    result.ablations.push_back(std::move(a));
  }

  std::vector<CheckSpec> checks(std::begin(kChecks), std::end(kChecks));
  std::vector<std::string> names;  // storage for the generated checks' strings
  names.reserve(3 * sweep_t.size());
  for (int t : sweep_t) {
    const std::string at = "@" + temp_label(defs[t].temperature);
    names.push_back("E4M3 above INT8 for P (V in FP16), T = " + temp_label(defs[t].temperature));
    names.push_back("e4m3" + at);
    names.push_back("int8" + at);
    const std::size_t b = names.size() - 3;
    checks.push_back(
        {names[b].c_str(), "p_format_sweep", names[b + 1].c_str(), names[b + 2].c_str(), Which::O});
  }
  for (const CheckSpec& c : checks) {
    DirectionCheck dc{c.claim, c.study, c.better, c.worse, which_name(c.which)};
    for (const AblationRow& a : result.ablations) {
      if (a.study != c.study || a.tensor != dc.tensor) continue;
      if (a.variant == c.better) dc.better_cos = a.cos;
      if (a.variant == c.worse) dc.worse_cos = a.cos;
    }
    dc.holds = dc.better_cos > dc.worse_cos;
    result.directions.push_back(dc);
  }

  auto mean_entropy = [&](int t) {
    double s = 0.0;
    for (const RefHead& r : refs[t]) s += r.entropy;
    return s / nheads;
  };
  result.study_entropy = mean_entropy(study_t);
  for (int t : sweep_t) result.normalized_entropy.push_back(mean_entropy(t));

  // The precision guard's statistic per input set, and issue 22's targets.
  result.guard_threshold_nats = emulate::guard_threshold_nats();
  for (const GuardSet& g : precision.sets) {
    GuardSummary sum{g.label, g.logit_scale, mean_entropy(g.input), INFINITY, 0.0, 0.0};
    int flagged = 0;
    for (const HeadOut& h : plan.runs[g.auto_run].heads) {
      sum.sigma_min = std::min(sum.sigma_min, h.guard_sigma);
      sum.sigma_max = std::max(sum.sigma_max, h.guard_sigma);
      flagged += h.flagged == 1;
    }
    sum.flagged = static_cast<double>(flagged) / nheads;
    result.guard.push_back(sum);
  }
  for (const TargetSpec& t : precision.targets) {
    TargetCheck tc{t.claim, t.study, t.variant, t.metric, NAN, t.bound, t.at_least, false};
    for (const AblationRow& a : result.ablations) {
      if (a.study != t.study || a.variant != t.variant) continue;
      tc.value = t.metric == "cos" ? a.cos : a.flagged.value_or(NAN);
    }
    tc.holds = t.at_least ? tc.value >= t.bound : tc.value <= t.bound;
    result.targets.push_back(tc);
  }

  result.facts.p_distinct_direct = distinct_over_heads(plan.runs[traced.softmax_direct]);
  result.facts.p_distinct_two_level = distinct_over_heads(plan.runs[traced.softmax_two_level]);
  result.facts.kernel_p_distinct_direct = distinct_over_heads(plan.runs[traced.kernel_direct]);
  result.facts.kernel_p_distinct_two_level =
      distinct_over_heads(plan.runs[traced.kernel_two_level]);
  result.facts.p_values_counted = static_cast<long long>(nheads) * p_rows(n) * n;

  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace qattn::cli
