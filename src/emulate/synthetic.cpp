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

SyntheticInputs make_synthetic(const SyntheticSpec& s) {
  check(s.batch >= 1, "batch must be >= 1");
  check(s.heads_q >= 1 && s.heads_kv >= 1, "heads must be >= 1");
  check(s.heads_q % s.heads_kv == 0, "heads_kv must divide heads_q");
  check(s.seq_q >= 1 && s.seq_kv >= 1, "sequence lengths must be >= 1");
  check(s.head_dim >= 1, "head_dim must be >= 1");
  check(std::isfinite(s.k_bias_std) && s.k_bias_std >= 0, "k_bias_std must be finite, >= 0");
  check(std::isfinite(s.q_bias_std) && s.q_bias_std >= 0, "q_bias_std must be finite, >= 0");
  check(std::isfinite(s.temperature) && s.temperature > 0, "temperature must be finite, > 0");

  // One stream per tensor, so changing e.g. the temperature leaves K, V and dO as
  // they were and the entropy sweep compares like with like.
  enum Stream : std::uint64_t { kQ = 1, kK, kV, kDout, kQBias, kKBias };
  auto stream = [&](Stream which) { return Normal(s.seed * 16 + which); };

  SyntheticInputs in{Tensor4(s.batch, s.heads_q, s.seq_q, s.head_dim),
                     Tensor4(s.batch, s.heads_kv, s.seq_kv, s.head_dim),
                     Tensor4(s.batch, s.heads_kv, s.seq_kv, s.head_dim),
                     Tensor4(s.batch, s.heads_q, s.seq_q, s.head_dim)};
  const int d = s.head_dim;

  Normal qbias = stream(kQBias), kbias = stream(kKBias);
  Normal qz = stream(kQ), kz = stream(kK), vz = stream(kV), dz = stream(kDout);
  std::vector<double> bias(d);
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads_q; ++h) {
      for (int c = 0; c < d; ++c) bias[c] = s.q_bias_std * qbias.next();
      for (int i = 0; i < s.seq_q; ++i) {
        float* q = in.q.row(b, h, i);
        float* g = in.dout.row(b, h, i);
        for (int c = 0; c < d; ++c) {
          q[c] = fp16((qz.next() + bias[c]) / s.temperature);
          g[c] = fp16(dz.next());
        }
      }
    }
    for (int h = 0; h < s.heads_kv; ++h) {
      for (int c = 0; c < d; ++c) bias[c] = s.k_bias_std * kbias.next();
      for (int j = 0; j < s.seq_kv; ++j) {
        float* k = in.k.row(b, h, j);
        float* v = in.v.row(b, h, j);
        for (int c = 0; c < d; ++c) {
          k[c] = fp16(kz.next() + bias[c]);
          v[c] = fp16(vz.next());
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
