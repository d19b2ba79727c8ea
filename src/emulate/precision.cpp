#include "emulate/precision.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

#include "numerics/formats.h"

namespace qattn::emulate {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("precision: " + what);
}

// E4M3's fraction bits: the half-step of a cast is 2^-(m+1) of the binade's base.
constexpr int kE4M3FractionBits = 3;

}  // namespace

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::Fast:
      return "fast";
    case Precision::Auto:
      return "auto";
    case Precision::Precise:
      return "precise";
  }
  return "?";
}

Sage2Options fast_options() { return Sage2Options{}; }

Sage2Options precise_options(InputDtype dtype) {
  Sage2Options o;
  const bool bf16 = dtype == InputDtype::Bf16;
  o.qk_format = bf16 ? QkFormat::Bf16 : QkFormat::Fp16;
  o.k_smoothing = KSmoothing::None;  // no quantization, so nothing for c to help
  o.pv_format = bf16 ? PvFormat::Bf16 : PvFormat::Fp16;
  return o;
}

// The RMS of (x̂ − x)/x for x log-uniform within a binade [2^e, 2^(e+1)) and a cast
// with m fraction bits: the error is uniform in ±h, h = 2^(e−m−1), so E[err²] = h²/3,
// and E[1/x²] = 2^(−2e)·3/(8 ln 2); together 2^(−2(m+1))/(8 ln 2).
double guard_threshold_nats() {
  return std::ldexp(1.0, -(kE4M3FractionBits + 1)) / std::sqrt(8.0 * std::numbers::ln2);
}

double PrecisionGuard::flagged_fraction() const {
  if (flagged.empty()) return 0.0;
  return static_cast<double>(std::count(flagged.begin(), flagged.end(), 1)) /
         static_cast<double>(flagged.size());
}

PrecisionGuard precision_guard(const Sage2Quantized& z) {
  if (z.options.qk_format != QkFormat::Int8 && z.options.qk_format != QkFormat::Int4) {
    fail("precision_guard: needs the fast path's quantized tensors (INT8/INT4 Q·Kᵀ)");
  }
  const int B = z.batch, Hq = z.heads_q, Hkv = z.heads_kv, D = z.head_dim_padded;
  const std::size_t bhq = static_cast<std::size_t>(B) * Hq, bhk = static_cast<std::size_t>(B) * Hkv;
  if (Hkv <= 0 || Hq % Hkv != 0 || z.q_i8.size() != bhq * z.nq_pad * D ||
      z.k_i8.size() != bhk * z.nkv_pad * D || z.q_row_scale.size() != bhq * z.nq_pad ||
      z.k_token_scale.size() != bhk * z.nkv_pad) {
    fail("precision_guard: qz: inconsistent sizes");
  }
  auto norm2 = [D](const std::int8_t* codes) {
    double s = 0.0;
    for (int c = 0; c < D; ++c) s += static_cast<double>(codes[c]) * codes[c];
    return s;
  };
  // Per KV head: max b_j² (value per K code, squared) and max |k_j − c|² over the
  // tokens that enter the quantization (padding is zeros and raises no max).
  std::vector<double> k_step2(bhk, 0.0), k_norm2(bhk, 0.0);
  for (std::size_t bh = 0; bh < bhk; ++bh)
    for (int j = 0; j < z.nkv_pad; ++j) {
      const std::size_t r = bh * z.nkv_pad + j;
      const double b2 = static_cast<double>(z.k_token_scale[r]) * z.k_token_scale[r];
      k_step2[bh] = std::max(k_step2[bh], b2);
      k_norm2[bh] = std::max(k_norm2[bh], b2 * norm2(z.k_i8.data() + r * D));
    }
  PrecisionGuard g;
  g.threshold_nats = guard_threshold_nats();
  g.sigma_nats.assign(bhq, 0.0);
  g.flagged.assign(bhq, 0);
  const int rep = Hq / Hkv;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const std::size_t bh = static_cast<std::size_t>(b) * Hq + h;
      const std::size_t bk = static_cast<std::size_t>(b) * Hkv + h / rep;
      // a_i² (log2 units per Q code, squared) and a_i²·|q̂_i|² = scale_log2²·|q_i|².
      double a2 = 0.0, q_norm2 = 0.0;
      for (int i = 0; i < z.nq_pad; ++i) {
        const std::size_t r = bh * z.nq_pad + i;
        const double ai2 = static_cast<double>(z.q_row_scale[r]) * z.q_row_scale[r];
        a2 = std::max(a2, ai2);
        q_norm2 = std::max(q_norm2, ai2 * norm2(z.q_i8.data() + r * D));
      }
      const double var_log2 = (a2 * k_norm2[bk] + k_step2[bk] * q_norm2) / 12.0;
      g.sigma_nats[bh] = std::sqrt(var_log2) * std::numbers::ln2;
      // NaN (a NaN input) flags the head: the precise path carries the NaN as the
      // fast one would, and no NaN statistic passes as small.
      g.flagged[bh] = !(g.sigma_nats[bh] <= g.threshold_nats);
    }
  return g;
}

PrecisionForward attention_with_precision(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                          const AttentionParams& params, Precision precision,
                                          InputDtype dtype) {
  if (precision != Precision::Fast && precision != Precision::Auto &&
      precision != Precision::Precise) {
    fail("precision: expected Fast, Auto or Precise");
  }
  if (dtype != InputDtype::Fp16 && dtype != InputDtype::Bf16) {
    fail("dtype: expected Fp16 or Bf16");
  }
  PrecisionForward out;
  const Sage2Quantized fast = quantize_sage2(q, k, v, params, fast_options());
  out.guard = precision_guard(fast);
  const std::size_t heads = out.guard.flagged.size();
  switch (precision) {
    case Precision::Fast:
      out.precise.assign(heads, 0);
      break;
    case Precision::Precise:
      out.precise.assign(heads, 1);
      break;
    case Precision::Auto:
      out.precise = out.guard.flagged;
      break;
  }
  const auto n_precise = std::count(out.precise.begin(), out.precise.end(), 1);
  if (n_precise == 0) {
    out.fwd = sage2_attend(fast);
    return out;
  }
  const Sage2Options precise = precise_options(dtype);
  if (static_cast<std::size_t>(n_precise) == heads) {
    out.fwd = sage2_attention(q, k, v, params, precise);
    return out;
  }
  // Mixed: both schemes on the whole call, then each head's rows from its own. (A GPU
  // kernel runs one scheme per head; every head's result depends on its inputs alone.)
  out.fwd = sage2_attend(fast);
  const EmulatedForward p = sage2_attention(q, k, v, params, precise);
  const std::size_t rows = static_cast<std::size_t>(q.n), row_elems = rows * q.d;
  for (std::size_t bh = 0; bh < heads; ++bh) {
    if (!out.precise[bh]) continue;
    std::copy_n(p.o.data.begin() + bh * row_elems, row_elems,
                out.fwd.o.data.begin() + bh * row_elems);
    std::copy_n(p.lse.begin() + bh * rows, rows, out.fwd.lse.begin() + bh * rows);
  }
  return out;
}

}  // namespace qattn::emulate
