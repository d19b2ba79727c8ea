#include "numerics/quantize.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"

namespace qattn::numerics {

namespace {

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

// rows > 0, cols > 0, rows within the int range of mma_groups.h, x.size() == rows·cols.
void check_matrix(const char* fn, std::span<const float> x, int64_t rows, int64_t cols,
                  const char* x_name = "x") {
  if (rows <= 0) fail(fn, "rows must be positive, got " + std::to_string(rows));
  if (cols <= 0) fail(fn, "cols must be positive, got " + std::to_string(cols));
  if (rows > std::numeric_limits<int>::max()) {
    fail(fn, "rows must fit in an int, got " + std::to_string(rows));
  }
  if (cols > std::numeric_limits<int64_t>::max() / rows) {
    fail(fn, "rows*cols overflows (rows " + std::to_string(rows) + ", cols " +
                 std::to_string(cols) + ")");
  }
  if (static_cast<int64_t>(x.size()) != rows * cols) {
    fail(fn, std::string(x_name) + ".size() must be rows*cols = " + std::to_string(rows * cols) +
                 ", got " + std::to_string(x.size()));
  }
}

void check_vector(const char* fn, std::span<const float> v, int64_t n, const char* name,
                  const char* n_name) {
  if (static_cast<int64_t>(v.size()) != n) {
    fail(fn, std::string(name) + ".size() must be " + n_name + " = " + std::to_string(n) +
                 ", got " + std::to_string(v.size()));
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-group amax with NaN sticky.
std::vector<float> group_amax(std::span<const float> x, const GroupMap& map) {
  std::vector<float> amax(map.count(), 0.0f);
  for (int64_t r = 0; r < map.rows; ++r) {
    for (int64_t c = 0; c < map.cols; ++c) {
      float& a = amax[map.group_of(r, c)];
      a = amax_accumulate(a, x[r * map.cols + c]);
    }
  }
  return amax;
}

std::vector<float> row_amax(std::span<const float> x, int64_t rows, int64_t cols) {
  std::vector<float> amax(rows, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) amax[r] = amax_accumulate(amax[r], x[r * cols + c]);
  }
  return amax;
}

// Shared body of the INT and FP8 linear-scale quantizers: Encode(x, multiplier) gives
// a code, Decode(code) its unscaled value.
template <typename Code, typename Encode, typename Decode>
void quantize_linear(std::span<const float> x, const GroupMap& map, float qmax,
                     std::vector<Code>& codes, std::vector<float>& scales, std::vector<float>& deq,
                     Encode encode, Decode decode, std::span<const float> given_amax = {}) {
  const std::vector<float> amax = given_amax.empty()
                                      ? group_amax(x, map)
                                      : std::vector<float>(given_amax.begin(), given_amax.end());
  std::vector<float> mult(amax.size());
  scales.resize(amax.size());
  for (size_t g = 0; g < amax.size(); ++g) {
    scales[g] = linear_scale(amax[g], qmax);
    mult[g] = linear_multiplier(amax[g], qmax);
  }
  codes.resize(x.size());
  deq.resize(x.size());
  for (int64_t r = 0; r < map.rows; ++r) {
    for (int64_t c = 0; c < map.cols; ++c) {
      const int64_t i = r * map.cols + c;
      const int64_t g = map.group_of(r, c);
      codes[i] = encode(x[i], mult[g]);
      deq[i] = decode(codes[i]) * scales[g];
    }
  }
}

}  // namespace

// ---- formats and groups --------------------------------------------------------------

float format_max(IntFormat f) {
  return static_cast<float>(f == IntFormat::Int8 ? kInt8Max : kInt4Max);
}

float format_max(Fp8Format f) { return f == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max; }

int block_size(Fp4Format f) { return f == Fp4Format::NvFp4 ? kNvFp4Block : kMxFp4Block; }

int64_t GroupMap::block_rows() const {
  return operand == Operand::Q ? groups::kQBlock : groups::kKvTile;
}

int64_t GroupMap::count() const {
  const bool q = operand == Operand::Q;
  switch (granularity) {
    case Granularity::PerTensor:
      return 1;
    case Granularity::PerBlock:
      return ceil_div(rows, block_rows());
    case Granularity::PerWarp:
      return ceil_div(rows, q ? groups::kQWarpRows : groups::kKvTile);
    case Granularity::PerThread:
      return q ? ceil_div(rows, groups::kQBlock) * groups::kQThreadGroupsPerBlock
               : ceil_div(rows, groups::kKvTile) * groups::kKThreadGroupsPerTile;
    case Granularity::PerToken:
      return rows;
    case Granularity::PerChannel:
      return cols;
    case Granularity::PerTileChannel:
      return ceil_div(rows, block_rows()) * cols;
  }
  return 1;
}

int64_t GroupMap::group_of(int64_t row, int64_t col) const {
  const bool q = operand == Operand::Q;
  switch (granularity) {
    case Granularity::PerTensor:
      return 0;
    case Granularity::PerBlock:
      return row / block_rows();
    case Granularity::PerWarp:
      return row / (q ? groups::kQWarpRows : groups::kKvTile);
    case Granularity::PerThread:
      return q ? groups::q_thread_group(static_cast<int>(row))
               : groups::k_thread_group(static_cast<int>(row));
    case Granularity::PerToken:
      return row;
    case Granularity::PerChannel:
      return col;
    case Granularity::PerTileChannel:
      return (row / block_rows()) * cols + col;
  }
  return 0;
}

GroupMap make_group_map(Granularity g, Operand op, int64_t rows, int64_t cols) {
  constexpr const char* kFn = "make_group_map";
  if (rows <= 0) fail(kFn, "rows must be positive, got " + std::to_string(rows));
  if (cols <= 0) fail(kFn, "cols must be positive, got " + std::to_string(cols));
  if (rows > std::numeric_limits<int>::max()) {
    fail(kFn, "rows must fit in an int, got " + std::to_string(rows));
  }
  switch (g) {
    case Granularity::PerTensor:
    case Granularity::PerBlock:
    case Granularity::PerWarp:
    case Granularity::PerThread:
    case Granularity::PerToken:
    case Granularity::PerChannel:
    case Granularity::PerTileChannel:
      break;
    default:
      fail(kFn, "granularity must be a Granularity enumerator, got " +
                    std::to_string(static_cast<int>(g)));
  }
  if (op != Operand::Q && op != Operand::K) {
    fail(kFn,
         "operand must be Operand::Q or Operand::K, got " + std::to_string(static_cast<int>(op)));
  }
  return GroupMap{g, op, rows, cols};
}

// ---- linear-scale quantizers -----------------------------------------------------------

IntQuantized quantize_int(std::span<const float> x, int64_t rows, int64_t cols, IntFormat format,
                          Granularity g, Operand op) {
  return quantize_int(x, rows, cols, format, g, op, {});
}

Fp8Quantized quantize_fp8(std::span<const float> x, int64_t rows, int64_t cols, Fp8Format format,
                          Granularity g, Operand op) {
  return quantize_fp8(x, rows, cols, format, g, op, {});
}

// An empty group_amax: each group's amax from x (the two overloads above).
IntQuantized quantize_int(std::span<const float> x, int64_t rows, int64_t cols, IntFormat format,
                          Granularity g, Operand op, std::span<const float> group_amax) {
  check_matrix("quantize_int", x, rows, cols);
  if (format != IntFormat::Int8 && format != IntFormat::Int4) {
    fail("quantize_int", "format must be IntFormat::Int8 or IntFormat::Int4");
  }
  IntQuantized out;
  out.format = format;
  out.groups = make_group_map(g, op, rows, cols);
  check_vector("quantize_int", group_amax, group_amax.empty() ? 0 : out.groups.count(),
               "group_amax", "the group count");
  const int qmax = format == IntFormat::Int8 ? kInt8Max : kInt4Max;
  quantize_linear(
      x, out.groups, static_cast<float>(qmax), out.values, out.scales, out.dequantized,
      [qmax](float v, float m) { return detail::clamp_rne(v * m, qmax); },
      [](int8_t c) { return static_cast<float>(c); }, group_amax);
  return out;
}

Fp8Quantized quantize_fp8(std::span<const float> x, int64_t rows, int64_t cols, Fp8Format format,
                          Granularity g, Operand op, std::span<const float> group_amax) {
  check_matrix("quantize_fp8", x, rows, cols);
  if (format != Fp8Format::E4M3 && format != Fp8Format::E5M2) {
    fail("quantize_fp8", "format must be Fp8Format::E4M3 or Fp8Format::E5M2");
  }
  Fp8Quantized out;
  out.format = format;
  out.groups = make_group_map(g, op, rows, cols);
  check_vector("quantize_fp8", group_amax, group_amax.empty() ? 0 : out.groups.count(),
               "group_amax", "the group count");
  const bool e4m3 = format == Fp8Format::E4M3;
  quantize_linear(
      x, out.groups, format_max(format), out.codes, out.scales, out.dequantized,
      [e4m3](float v, float m) { return e4m3 ? e4m3_encode(v * m) : e5m2_encode(v * m); },
      [e4m3](uint8_t c) { return e4m3 ? e4m3_decode(c) : e5m2_decode(c); }, group_amax);
  return out;
}

// ---- microscaling FP4 -------------------------------------------------------------------

Fp4Quantized quantize_fp4(std::span<const float> x, int64_t rows, int64_t cols, Fp4Format format) {
  constexpr const char* kFn = "quantize_fp4";
  check_matrix(kFn, x, rows, cols);
  if (format != Fp4Format::NvFp4 && format != Fp4Format::MxFp4) {
    fail(kFn, "format must be Fp4Format::NvFp4 or Fp4Format::MxFp4");
  }
  const int block = block_size(format);
  if (cols % block != 0) {
    fail(kFn, "cols must be a multiple of the block (" + std::to_string(block) + "), got " +
                  std::to_string(cols));
  }
  Fp4Quantized out;
  out.format = format;
  out.rows = rows;
  out.cols = cols;
  out.block = block;
  const int64_t nblocks = rows * (cols / block);
  out.scale_codes.resize(nblocks);
  out.scales.resize(nblocks);
  out.codes.resize(x.size());
  out.dequantized.resize(x.size());
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t begin = b * block;  // blocks tile each row, rows are contiguous
    float amax = 0.0f;
    for (int i = 0; i < block; ++i) amax = amax_accumulate(amax, x[begin + i]);
    const bool nv = format == Fp4Format::NvFp4;
    const uint8_t sc = nv ? nvfp4_scale_code(amax) : mxfp4_scale_code(amax);
    const float s = nv ? e4m3_decode(sc) : e8m0_decode(sc);
    out.scale_codes[b] = sc;
    out.scales[b] = s;
    for (int i = 0; i < block; ++i) {
      const uint8_t code = fp4_element_code(x[begin + i], s);
      out.codes[begin + i] = code;
      out.dequantized[begin + i] = e2m1_decode(code) * s;
    }
  }
  return out;
}

// ---- dequantize -----------------------------------------------------------------------------

std::vector<float> dequantize(const IntQuantized& q) {
  std::vector<float> out(q.values.size());
  for (int64_t r = 0; r < q.groups.rows; ++r) {
    for (int64_t c = 0; c < q.groups.cols; ++c) {
      const int64_t i = r * q.groups.cols + c;
      out[i] = static_cast<float>(q.values[i]) * q.scale_at(r, c);
    }
  }
  return out;
}

std::vector<float> dequantize(const Fp8Quantized& q) {
  const bool e4m3 = q.format == Fp8Format::E4M3;
  std::vector<float> out(q.codes.size());
  for (int64_t r = 0; r < q.groups.rows; ++r) {
    for (int64_t c = 0; c < q.groups.cols; ++c) {
      const int64_t i = r * q.groups.cols + c;
      out[i] = (e4m3 ? e4m3_decode(q.codes[i]) : e5m2_decode(q.codes[i])) * q.scale_at(r, c);
    }
  }
  return out;
}

std::vector<float> dequantize(const Fp4Quantized& q) {
  std::vector<float> out(q.codes.size());
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const int64_t i = r * q.cols + c;
      out[i] = e2m1_decode(q.codes[i]) * q.scale_at(r, c);
    }
  }
  return out;
}

// ---- P -------------------------------------------------------------------------------------

TwoLevelP quantize_p_two_level(std::span<const float> p, int64_t rows, int64_t cols,
                               std::span<const float> rowmax) {
  constexpr const char* kFn = "quantize_p_two_level";
  check_matrix(kFn, p, rows, cols, "p");
  if (!rowmax.empty()) check_vector(kFn, rowmax, rows, "rowmax", "rows");
  const std::vector<float> own_max =
      rowmax.empty() ? row_amax(p, rows, cols) : std::vector<float>{};
  const std::span<const float> m = rowmax.empty() ? std::span<const float>(own_max) : rowmax;

  TwoLevelP out;
  out.row_scales.resize(rows);
  std::vector<float> p2(p.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float s = two_level_p_scale(m[r]);
    out.row_scales[r] = s;
    // A row with rowmax 0 (all masked) stays 0; a NaN rowmax gives NaN through s.
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      p2[i] = s == 0.0f ? 0.0f : p[i] / s;
    }
  }
  out.p2 = quantize_fp4(p2, rows, cols, Fp4Format::NvFp4);
  out.dequantized.resize(p.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      out.dequantized[i] = out.p2.dequantized[i] * out.row_scales[r];
    }
  }
  return out;
}

Fp4Quantized quantize_p_direct(std::span<const float> p, int64_t rows, int64_t cols) {
  check_matrix("quantize_p_direct", p, rows, cols, "p");
  return quantize_fp4(p, rows, cols, Fp4Format::NvFp4);
}

IntQuantized quantize_p_per_token_int8(std::span<const float> p, int64_t rows, int64_t cols,
                                       std::span<const float> rowmax) {
  constexpr const char* kFn = "quantize_p_per_token_int8";
  check_matrix(kFn, p, rows, cols, "p");
  if (rowmax.empty()) {
    return quantize_int(p, rows, cols, IntFormat::Int8, Granularity::PerToken, Operand::Q);
  }
  check_vector(kFn, rowmax, rows, "rowmax", "rows");
  IntQuantized out;
  out.format = IntFormat::Int8;
  out.groups = make_group_map(Granularity::PerToken, Operand::Q, rows, cols);
  out.scales.resize(rows);
  out.values.resize(p.size());
  out.dequantized.resize(p.size());
  constexpr float kQmax = static_cast<float>(kInt8Max);
  for (int64_t r = 0; r < rows; ++r) {
    // Keep a NaN in the row visible even though the given rowmax does not see it.
    float amax = rowmax[r];
    for (int64_t c = 0; c < cols; ++c) {
      if (detail::is_nan_bits(detail::bits_of(p[r * cols + c]))) amax = p[r * cols + c];
    }
    out.scales[r] = linear_scale(amax, kQmax);
    const float mult = linear_multiplier(amax, kQmax);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      out.values[i] = int8_quantize(p[i], mult);
      out.dequantized[i] = static_cast<float>(out.values[i]) * out.scales[r];
    }
  }
  return out;
}

// ---- smoothing -----------------------------------------------------------------------------

std::vector<float> token_mean(std::span<const float> x, int64_t rows, int64_t cols,
                              MeanEstimate estimate) {
  constexpr const char* kFn = "token_mean";
  check_matrix(kFn, x, rows, cols);
  if (estimate != MeanEstimate::AllTokens && estimate != MeanEstimate::Sampled) {
    fail(kFn, "estimate must be MeanEstimate::AllTokens or MeanEstimate::Sampled");
  }
  const bool sample = estimate == MeanEstimate::Sampled;
  const int64_t n = sample ? std::min(rows, kSmoothSampleTokens) : rows;
  std::vector<double> sum(cols, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = sample ? sampled_row(i, rows) : i;
    for (int64_t c = 0; c < cols; ++c) sum[c] += x[r * cols + c];
  }
  std::vector<float> mean(cols);
  for (int64_t c = 0; c < cols; ++c) mean[c] = static_cast<float>(sum[c] / n);
  return mean;
}

std::vector<float> sampled_amax_bound(std::span<const float> x, int64_t rows, int64_t cols) {
  check_matrix("sampled_amax_bound", x, rows, cols);
  std::vector<float> in_sample(cols, 0.0f);
  for (int64_t i = 0; i < std::min(rows, kSmoothSampleTokens); ++i) {
    const int64_t r = sampled_row(i, rows);
    for (int64_t c = 0; c < cols; ++c)
      in_sample[c] = amax_accumulate(in_sample[c], x[r * cols + c]);
  }
  const std::vector<float> all =
      group_amax(x, make_group_map(Granularity::PerChannel, Operand::K, rows, cols));
  std::vector<float> out(cols);
  for (int64_t c = 0; c < cols; ++c) {
    const float b = sampled_amax_bound_of(in_sample[c], rows);
    out[c] = (all[c] != all[c] || all[c] > b) ? all[c] : b;  // NaN (sticky in all) wins
  }
  return out;
}

std::vector<float> subtract_row_vector(std::span<const float> x, int64_t rows, int64_t cols,
                                       std::span<const float> c) {
  check_matrix("subtract_row_vector", x, rows, cols);
  check_vector("subtract_row_vector", c, cols, "c", "cols");
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = x[r * cols + j] - c[j];
  }
  return out;
}

std::vector<float> add_row_vector(std::span<const float> x, int64_t rows, int64_t cols,
                                  std::span<const float> c) {
  check_matrix("add_row_vector", x, rows, cols);
  check_vector("add_row_vector", c, cols, "c", "cols");
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = x[r * cols + j] + c[j];
  }
  return out;
}

std::vector<float> dot_rows(std::span<const float> x, int64_t rows, int64_t cols,
                            std::span<const float> v) {
  check_matrix("dot_rows", x, rows, cols);
  check_vector("dot_rows", v, cols, "v", "cols");
  std::vector<float> out(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (int64_t j = 0; j < cols; ++j) s += static_cast<double>(x[r * cols + j]) * v[j];
    out[r] = static_cast<float>(s);
  }
  return out;
}

Smoothed smooth_k_with(std::span<const float> k, int64_t rows, int64_t cols,
                       std::span<const float> c) {
  check_matrix("smooth_k_with", k, rows, cols, "k");
  check_vector("smooth_k_with", c, cols, "c", "cols");
  Smoothed out;
  out.values = subtract_row_vector(k, rows, cols, c);
  out.means.assign(c.begin(), c.end());
  out.mean_rows = 1;
  out.rows_per_mean = rows;
  return out;
}

Smoothed smooth_k(std::span<const float> k, int64_t rows, int64_t cols, MeanEstimate estimate) {
  check_matrix("smooth_k", k, rows, cols, "k");
  const std::vector<float> c = token_mean(k, rows, cols, estimate);
  return smooth_k_with(k, rows, cols, c);
}

Smoothed smooth_v(std::span<const float> v, int64_t rows, int64_t cols) {
  check_matrix("smooth_v", v, rows, cols, "v");
  return smooth_k(v, rows, cols, MeanEstimate::AllTokens);
}

Smoothed smooth_q(std::span<const float> q, int64_t rows, int64_t cols, int64_t block_rows) {
  constexpr const char* kFn = "smooth_q";
  check_matrix(kFn, q, rows, cols, "q");
  if (block_rows <= 0) fail(kFn, "block_rows must be positive, got " + std::to_string(block_rows));
  Smoothed out;
  out.rows_per_mean = block_rows;
  out.mean_rows = ceil_div(rows, block_rows);
  out.means.resize(out.mean_rows * cols);
  out.values.resize(q.size());
  for (int64_t b = 0; b < out.mean_rows; ++b) {
    const int64_t r0 = b * block_rows;
    const int64_t n = std::min(block_rows, rows - r0);
    const std::span<const float> blk = q.subspan(r0 * cols, n * cols);
    const std::vector<float> mean = token_mean(blk, n, cols, MeanEstimate::AllTokens);
    const std::vector<float> sm = subtract_row_vector(blk, n, cols, mean);
    std::copy(mean.begin(), mean.end(), out.means.begin() + b * cols);
    std::copy(sm.begin(), sm.end(), out.values.begin() + r0 * cols);
  }
  return out;
}

std::vector<float> q_mean_scores(const Smoothed& q, std::span<const float> k, int64_t nkv,
                                 int64_t cols) {
  constexpr const char* kFn = "q_mean_scores";
  check_matrix(kFn, k, nkv, cols, "k");
  if (q.mean_rows <= 0 || static_cast<int64_t>(q.means.size()) != q.mean_rows * cols) {
    fail(kFn, "q.means.size() must be q.mean_rows*cols = " + std::to_string(q.mean_rows * cols) +
                  ", got " + std::to_string(q.means.size()));
  }
  std::vector<float> out(q.mean_rows * nkv);
  for (int64_t b = 0; b < q.mean_rows; ++b) {
    for (int64_t j = 0; j < nkv; ++j) {
      double s = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        s += static_cast<double>(q.means[b * cols + c]) * k[j * cols + c];
      }
      out[b * nkv + j] = static_cast<float>(s);
    }
  }
  return out;
}

}  // namespace qattn::numerics
