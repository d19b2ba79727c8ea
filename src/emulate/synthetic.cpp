#include "emulate/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <stdexcept>
#include <string>

#include "numerics/formats.h"

namespace qattn::emulate {
namespace {

// Standard normal values from the raw 64-bit output of mt19937_64 (whose sequence the
// C++ standard fixes), so a seed means the same tensors everywhere; the standard's
// normal_distribution is implementation-defined.
class Normal {
 public:
  explicit Normal(std::uint64_t seed) : engine_(seed) {}

  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Uniforms in (0, 1] and [0, 1) from the top 53 bits.
    constexpr double kInv53 = 1.0 / 9007199254740992.0;
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * kInv53;
    const double u2 = static_cast<double>(engine_() >> 11) * kInv53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double t = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(t);
    has_spare_ = true;
    return r * std::cos(t);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("make_synthetic: " + what);
}

float fp16(double x) { return numerics::fp16_round(static_cast<float>(x)); }

}  // namespace

const char* family_name(InputFamily f) {
  switch (f) {
    case InputFamily::Gaussian:
      return "gaussian";
    case InputFamily::LargeLogits:
      return "large_logits";
    case InputFamily::HeavyTail:
      return "heavy_tail";
    case InputFamily::OutlierChannels:
      return "outlier_channels";
    case InputFamily::AttentionSink:
      return "attention_sink";
  }
  return "?";
}

namespace {

void check_spec(const SyntheticSpec& s) {
  check(s.batch >= 1, "batch must be >= 1");
  check(s.heads_q >= 1 && s.heads_kv >= 1, "heads must be >= 1");
  check(s.heads_q % s.heads_kv == 0, "heads_kv must divide heads_q");
  check(s.seq_q >= 1 && s.seq_kv >= 1, "sequence lengths must be >= 1");
  check(s.head_dim >= 1, "head_dim must be >= 1");
  check(std::isfinite(s.k_bias_std) && s.k_bias_std >= 0, "k_bias_std must be finite, >= 0");
  check(std::isfinite(s.q_bias_std) && s.q_bias_std >= 0, "q_bias_std must be finite, >= 0");
  check(std::isfinite(s.temperature) && s.temperature > 0, "temperature must be finite, > 0");
  switch (s.family) {
    case InputFamily::Gaussian:
      break;
    case InputFamily::LargeLogits:
      check(std::isfinite(s.large_logit_scale) && s.large_logit_scale > 0,
            "large_logit_scale must be finite, > 0");
      break;
    case InputFamily::HeavyTail:
      check(s.student_t_dof >= 3 && s.student_t_dof <= 1000,
            "student_t_dof must be in [3, 1000] (3: the fewest with a finite variance)");
      break;
    case InputFamily::OutlierChannels:
      check(s.outlier_channels >= 0, "outlier_channels must be >= 0 (0: max(1, d/32))");
      check(2 * std::max(1, s.outlier_channels) <= s.head_dim,
            "outlier_channels: the two sets of outlier channels need 2*n_o <= head_dim");
      check(std::isfinite(s.outlier_gain) && s.outlier_gain >= 1,
            "outlier_gain must be finite, >= 1");
      break;
    case InputFamily::AttentionSink:
      check(s.q_bias_std > 0, "AttentionSink: q_bias_std must be > 0 (the sink aligns with it)");
      break;
    default:
      check(false,
            "family: expected Gaussian, LargeLogits, HeavyTail, OutlierChannels or "
            "AttentionSink");
  }
}

// The noise z of one element: N(0, 1), or for HeavyTail a Student-t of `dof` degrees of
// freedom at unit variance, N / sqrt(χ²_ν / ν) · sqrt((ν − 2)/ν), its χ² from ν more
// normals of the same stream.
double noise(Normal& g, int dof) {
  const double n = g.next();
  if (dof == 0) return n;
  double chi2 = 0.0;
  for (int i = 0; i < dof; ++i) {
    const double x = g.next();
    chi2 += x * x;
  }
  return n / std::sqrt(chi2 / dof) * std::sqrt((dof - 2.0) / dof);
}

}  // namespace

OutlierChannelSets outlier_channel_sets(const SyntheticSpec& s, int b, int h) {
  const int d = s.head_dim;
  const int n_o = s.outlier_channels > 0 ? s.outlier_channels : std::max(1, d / 32);
  check(2 * n_o <= d, "outlier_channels: the two sets of outlier channels need 2*n_o <= head_dim");
  // One engine per (seed, batch, KV head); std::seed_seq and mt19937_64 are both fixed
  // by the standard, so the channels are the same everywhere.
  constexpr std::uint32_t kOutlierStream = 7;
  std::seed_seq seq{static_cast<std::uint32_t>(s.seed), static_cast<std::uint32_t>(s.seed >> 32),
                    kOutlierStream, static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(h)};
  std::mt19937_64 engine(seq);
  std::vector<int> perm(d);
  for (int c = 0; c < d; ++c) perm[c] = c;
  constexpr double kInv53 = 1.0 / 9007199254740992.0;
  for (int i = 0; i < 2 * n_o; ++i) {  // a partial Fisher–Yates shuffle
    const double u = static_cast<double>(engine() >> 11) * kInv53;
    const int j = i + static_cast<int>(u * (d - i));
    std::swap(perm[i], perm[j]);
  }
  OutlierChannelSets sets;
  sets.k_large.assign(perm.begin(), perm.begin() + n_o);
  sets.q_large.assign(perm.begin() + n_o, perm.begin() + 2 * n_o);
  return sets;
}

SyntheticInputs make_synthetic(const SyntheticSpec& s) {
  check_spec(s);

  // One stream per tensor, so changing e.g. the temperature leaves K, V and dO as
  // they were and the entropy sweep compares like with like.
  enum Stream : std::uint64_t { kQ = 1, kK, kV, kDout, kQBias, kKBias };
  auto stream = [&](Stream which) { return Normal(s.seed * 16 + which); };

  SyntheticInputs in{Tensor4(s.batch, s.heads_q, s.seq_q, s.head_dim),
                     Tensor4(s.batch, s.heads_kv, s.seq_kv, s.head_dim),
                     Tensor4(s.batch, s.heads_kv, s.seq_kv, s.head_dim),
                     Tensor4(s.batch, s.heads_q, s.seq_q, s.head_dim)};
  const int d = s.head_dim;
  const int rep = s.heads_q / s.heads_kv;
  const int dof = s.family == InputFamily::HeavyTail ? s.student_t_dof : 0;
  const double logit_scale = s.family == InputFamily::LargeLogits ? s.large_logit_scale : 1.0;

  Normal qbias = stream(kQBias), kbias = stream(kKBias);
  Normal qz = stream(kQ), kz = stream(kK), vz = stream(kV), dz = stream(kDout);
  std::vector<double> bias(d), qbiases(static_cast<std::size_t>(s.heads_q) * d);
  // Per-channel factors of q and k (OutlierChannels; 1 elsewhere), per KV head.
  std::vector<double> qf(static_cast<std::size_t>(s.heads_kv) * d, 1.0), kf(qf);
  for (int b = 0; b < s.batch; ++b) {
    // The Q biases of the batch entry first (the same draws, in the same order, as
    // when they were drawn head by head): the sink's direction needs its group's.
    for (double& x : qbiases) x = s.q_bias_std * qbias.next();
    if (s.family == InputFamily::OutlierChannels) {
      for (int h = 0; h < s.heads_kv; ++h) {
        const OutlierChannelSets sets = outlier_channel_sets(s, b, h);
        for (int c : sets.k_large) {
          kf[static_cast<std::size_t>(h) * d + c] = s.outlier_gain;
          qf[static_cast<std::size_t>(h) * d + c] = 1.0 / s.outlier_gain;
        }
        for (int c : sets.q_large) {
          qf[static_cast<std::size_t>(h) * d + c] = s.outlier_gain;
          kf[static_cast<std::size_t>(h) * d + c] = 1.0 / s.outlier_gain;
        }
      }
    }
    for (int h = 0; h < s.heads_q; ++h) {
      const double* qb = qbiases.data() + static_cast<std::size_t>(h) * d;
      const double* f = qf.data() + static_cast<std::size_t>(h / rep) * d;
      for (int i = 0; i < s.seq_q; ++i) {
        float* q = in.q.row(b, h, i);
        float* g = in.dout.row(b, h, i);
        for (int c = 0; c < d; ++c) {
          q[c] = fp16((noise(qz, dof) + qb[c]) * f[c] * logit_scale / s.temperature);
          g[c] = fp16(noise(dz, dof));
        }
      }
    }
    for (int h = 0; h < s.heads_kv; ++h) {
      for (int c = 0; c < d; ++c) bias[c] = s.k_bias_std * kbias.next();
      const double* f = kf.data() + static_cast<std::size_t>(h) * d;
      // AttentionSink: k_0 += s·u, u the unit mean Q bias of the group's heads.
      std::vector<double> sink(d, 0.0);
      if (s.family == InputFamily::AttentionSink) {
        double norm2 = 0.0;
        for (int c = 0; c < d; ++c) {
          for (int r = 0; r < rep; ++r)
            sink[c] += qbiases[static_cast<std::size_t>(h * rep + r) * d + c];
          sink[c] /= rep;
          norm2 += sink[c] * sink[c];
        }
        const double norm = std::sqrt(norm2);
        check(norm > 0.0, "AttentionSink: the group's mean Q bias is zero");
        const double magnitude = std::log(static_cast<double>(s.seq_kv)) * s.temperature *
                                 std::sqrt(static_cast<double>(d)) / norm;
        for (double& x : sink) x *= magnitude / norm;
      }
      for (int j = 0; j < s.seq_kv; ++j) {
        float* k = in.k.row(b, h, j);
        float* v = in.v.row(b, h, j);
        for (int c = 0; c < d; ++c) {
          k[c] = fp16((noise(kz, dof) + bias[c]) * f[c] + (j == 0 ? sink[c] : 0.0));
          v[c] = fp16(noise(vz, dof));
        }
      }
    }
  }
  return in;
}

double mean_normalized_entropy(const Tensor4& q, const Tensor4& k, double sm_scale) {
  if (q.b != k.b || q.d != k.d || k.h <= 0 || q.h % k.h != 0) {
    throw std::invalid_argument("mean_normalized_entropy: q and k shapes do not match");
  }
  if (k.n < 2) return 0.0;
  const int group = q.h / k.h;
  std::vector<double> s(k.n);
  double total = 0.0;
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      for (int i = 0; i < q.n; ++i) {
        const float* qi = q.row(b, h, i);
        double mx = -INFINITY;
        for (int j = 0; j < k.n; ++j) {
          const float* kj = k.row(b, h / group, j);
          double acc = 0.0;
          for (int c = 0; c < q.d; ++c) acc += static_cast<double>(qi[c]) * kj[c];
          s[j] = acc * sm_scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0.0;
        for (int j = 0; j < k.n; ++j) z += std::exp(s[j] - mx);
        double ent = 0.0;
        for (int j = 0; j < k.n; ++j) {
          const double p = std::exp(s[j] - mx) / z;
          if (p > 0.0) ent -= p * std::log(p);
        }
        total += ent / std::log(static_cast<double>(k.n));
      }
    }
  }
  return total / (static_cast<double>(q.b) * q.h * q.n);
}

}  // namespace qattn::emulate
