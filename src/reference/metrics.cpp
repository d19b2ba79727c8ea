#include "reference/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace qattn::metrics {
namespace {

template <class A, class B>
ErrorMetrics compare_impl(std::span<const A> out, std::span<const B> ref) {
  if (out.size() != ref.size()) {
    throw std::invalid_argument("metrics::compare: out and ref must have the same length");
  }
  if (out.empty()) throw std::invalid_argument("metrics::compare: out: empty");
  double dot = 0, oo = 0, rr = 0, l1 = 0, r1 = 0, sq = 0, mx = 0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = static_cast<double>(out[i]), r = static_cast<double>(ref[i]);
    if (std::isinf(o) && o == r) continue;
    const double e = o - r;
    dot += o * r;
    oo += o * o;
    rr += r * r;
    l1 += std::fabs(e);
    r1 += std::fabs(r);
    sq += e * e;
    // NaN must not vanish in std::max.
    mx = (std::isnan(e) || std::isnan(mx)) ? std::numeric_limits<double>::quiet_NaN()
                                           : std::max(mx, std::fabs(e));
    ++n;
  }
  ErrorMetrics m;
  m.count = n;
  if (n == 0) return ErrorMetrics{1.0, 0.0, 0.0, 0.0, 0};  // everything matched as infinities
  m.cos_sim = dot / std::sqrt(oo * rr);
  m.rel_l1 = l1 / r1;
  m.rmse = std::sqrt(sq / static_cast<double>(n));
  m.max_abs = mx;
  return m;
}

}  // namespace

ErrorMetrics compare(std::span<const float> out, std::span<const double> ref) {
  return compare_impl(out, ref);
}
ErrorMetrics compare(std::span<const double> out, std::span<const double> ref) {
  return compare_impl(out, ref);
}
ErrorMetrics compare(std::span<const float> out, std::span<const float> ref) {
  return compare_impl(out, ref);
}

}  // namespace qattn::metrics
