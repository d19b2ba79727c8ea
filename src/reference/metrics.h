// Error metrics of an output against a reference (docs/design.md, Numerics), all in double:
//   CosSim      = sum(o*r) / sqrt(sum(o^2) * sum(r^2))
//   relative L1 = sum|o - r| / sum|r|
//   RMSE        = sqrt(mean((o - r)^2))
//   max abs     = max|o - r|
// Pairs where both values are the same infinity (e.g. LSE = -inf on a fully masked
// row) count as exact and are left out of every sum; any other non-finite value makes
// the metrics NaN. Degenerate denominators follow the formulas (0/0 gives NaN).
#pragma once

#include <cstddef>
#include <span>

namespace qattn::metrics {

struct ErrorMetrics {
  double cos_sim = 0.0;
  double rel_l1 = 0.0;
  double rmse = 0.0;
  double max_abs = 0.0;
  std::size_t count = 0;  // number of compared pairs
};

// Throws std::invalid_argument when the two spans differ in length or are empty.
ErrorMetrics compare(std::span<const float> out, std::span<const double> ref);
ErrorMetrics compare(std::span<const double> out, std::span<const double> ref);
ErrorMetrics compare(std::span<const float> out, std::span<const float> ref);

}  // namespace qattn::metrics
