// Block quantizers and smoothing over host matrices.
//
// Every input is a row-major (rows × cols) float matrix given as a span: rows are
// tokens, cols are channels (the head dimension, or KV tokens for P). Every
// quantizer returns, in one struct, the codes, one scale per scale group, and a
// dequantized float copy (code value × its group's scale), so an emulator can ask
// for "this matrix as INT8 per-thread" in one call:
//
//   auto kq = quantize_int(k, n, d, IntFormat::Int8, Granularity::PerThread, Operand::K);
//   kq.values[i], kq.scale_at(r, c), kq.dequantized[i]
//
// Scale groups (Granularity × Operand) follow the Hopper wgmma layout of
// numerics/mma_groups.h:
//   PerTensor       one group.
//   PerBlock        Q: 64 rows (kQBlock);  K: one KV tile of 128 tokens (kKvTile).
//   PerWarp         Q: 16 rows (kQWarpRows); K: one KV tile (as PerBlock).
//   PerThread       Q: q_thread_group(row), 32 groups of 2 rows per 64-row block;
//                   K: k_thread_group(row), 4 groups of 32 tokens per KV tile.
//   PerToken        one row.
//   PerChannel      one column over all rows.
//   PerTileChannel  one column within one block (Q: 64 rows; K/V: one KV tile), the
//                   V scales of the SA2 kernel (docs/sage2-kernel-arithmetic.md §4).
// Groups are numbered as in mma_groups.h; a block cut short by the end of the
// matrix keeps its group numbers, and a group with no rows has scale 0.
//
// Scales (block_scale.h): INT8 amax/127, INT4 amax/7, E4M3 amax/448, E5M2
// amax/57344; values = round(x · (qmax / amax)). An all-zero group has scale 0 and
// zero codes. NVFP4: blocks of 16 along a row, s = E4M3(amax/6), codes E2M1(x/s).
// MXFP4: blocks of 32 along a row, s = 2^(floor(log2 amax) − 2) as E8M0.
//
// NaN/Inf (docs/design.md, Numerics): a NaN anywhere in a group makes its scale NaN and every
// dequantized value of the group NaN (the integer and E2M1 codes have no NaN and
// hold 0). An Inf makes the group's dequantized values NaN as well.
//
// Sizes are validated: a bad size throws std::invalid_argument naming the
// parameter.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "numerics/mma_groups.h"
#include "numerics/token_sample.h"

namespace qattn::numerics {

enum class Granularity {
  PerTensor,
  PerBlock,
  PerWarp,
  PerThread,
  PerToken,
  PerChannel,
  PerTileChannel
};

// Which token grouping applies: Q rows (64-row blocks) or K/V tokens (128-token tiles).
enum class Operand { Q, K };

enum class IntFormat { Int8, Int4 };
enum class Fp8Format { E4M3, E5M2 };
enum class Fp4Format { NvFp4, MxFp4 };

inline constexpr int kNvFp4Block = 16;
inline constexpr int kMxFp4Block = 32;

// Largest code magnitude of a format (127, 7, 448, 57344).
float format_max(IntFormat f);
float format_max(Fp8Format f);
// Elements per block along a row (16, 32).
int block_size(Fp4Format f);

// The scale groups of a (rows × cols) matrix.
struct GroupMap {
  Granularity granularity = Granularity::PerTensor;
  Operand operand = Operand::K;
  int64_t rows = 0;
  int64_t cols = 0;

  // Number of groups (scales).
  int64_t count() const;
  // Group of element (row, col).
  int64_t group_of(int64_t row, int64_t col) const;
  // Rows per block for PerBlock / PerTileChannel (64 for Q, 128 for K).
  int64_t block_rows() const;
};

// Validates rows, cols and the granularity; throws std::invalid_argument.
GroupMap make_group_map(Granularity g, Operand op, int64_t rows, int64_t cols);

struct IntQuantized {
  IntFormat format = IntFormat::Int8;
  GroupMap groups;
  std::vector<int8_t> values;      // rows × cols, in [-127, 127] or [-7, 7]
  std::vector<float> scales;       // groups.count(): amax / qmax
  std::vector<float> dequantized;  // values × scale of the group

  float scale_at(int64_t row, int64_t col) const { return scales[groups.group_of(row, col)]; }
};

struct Fp8Quantized {
  Fp8Format format = Fp8Format::E4M3;
  GroupMap groups;
  std::vector<uint8_t> codes;      // rows × cols, E4M3 or E5M2 bytes
  std::vector<float> scales;       // groups.count(): amax / 448 (E4M3), amax / 57344 (E5M2)
  std::vector<float> dequantized;  // decode(code) × scale of the group

  float scale_at(int64_t row, int64_t col) const { return scales[groups.group_of(row, col)]; }
};

struct Fp4Quantized {
  Fp4Format format = Fp4Format::NvFp4;
  int64_t rows = 0;
  int64_t cols = 0;
  int block = kNvFp4Block;           // elements per scale, along a row
  std::vector<uint8_t> codes;        // rows × cols, one E2M1 code per byte (low nibble)
  std::vector<uint8_t> scale_codes;  // rows × cols/block: E4M3 (NVFP4) or E8M0 (MXFP4)
  std::vector<float> scales;         // the decoded scale_codes
  std::vector<float> dequantized;    // E2M1 value × block scale

  int64_t blocks_per_row() const { return cols / block; }
  float scale_at(int64_t row, int64_t col) const {
    return scales[row * blocks_per_row() + col / block];
  }
};

// INT8 or INT4 with the given scale groups.
IntQuantized quantize_int(std::span<const float> x, int64_t rows, int64_t cols, IntFormat format,
                          Granularity g, Operand op);

// E4M3 or E5M2 with the given scale groups (per-tensor and per-channel are the usual).
Fp8Quantized quantize_fp8(std::span<const float> x, int64_t rows, int64_t cols, Fp8Format format,
                          Granularity g, Operand op);

// The same two quantizers with each group's amax given (group_amax: one value per group
// of g, in GroupMap order) instead of taken from x; values above it saturate.
IntQuantized quantize_int(std::span<const float> x, int64_t rows, int64_t cols, IntFormat format,
                          Granularity g, Operand op, std::span<const float> group_amax);
Fp8Quantized quantize_fp8(std::span<const float> x, int64_t rows, int64_t cols, Fp8Format format,
                          Granularity g, Operand op, std::span<const float> group_amax);

// NVFP4 (1×16, E4M3 scale) or MXFP4 (1×32, E8M0 scale) along each row; cols must be a
// multiple of the block.
Fp4Quantized quantize_fp4(std::span<const float> x, int64_t rows, int64_t cols, Fp4Format format);

// Recompute the dequantized copy from codes and scales (what a consumer of the
// packed data sees).
std::vector<float> dequantize(const IntQuantized& q);
std::vector<float> dequantize(const Fp8Quantized& q);
std::vector<float> dequantize(const Fp4Quantized& q);

// ---- attention probabilities P (rows = queries, cols = keys of one tile) ------------

// SageAttention3 two-level P: per row s_p1 = rowmax / (448·6) (FP32), P2 = P / s_p1,
// then NVFP4(P2). Dequantized P = NVFP4-dequantized P2 × s_p1. A row with rowmax 0
// has s_p1 = 0 and P2 = 0.
struct TwoLevelP {
  std::vector<float> row_scales;   // s_p1, one per row
  Fp4Quantized p2;                 // NVFP4 of P / s_p1
  std::vector<float> dequantized;  // p2.dequantized × s_p1 of the row
};

// rowmax: one value per row, as the online softmax gives exp(rowmax(S) − m); empty
// means the row maxima of p.
TwoLevelP quantize_p_two_level(std::span<const float> p, int64_t rows, int64_t cols,
                               std::span<const float> rowmax = {});

// The "direct" variant: NVFP4 of P itself (block scales E4M3(amax/6) of values ≤ 1/6).
Fp4Quantized quantize_p_direct(std::span<const float> p, int64_t rows, int64_t cols);

// SageBwd P: per-token INT8 with s_P = rowmax / 127 (rowmax as above; empty means the
// row maxima of p). Returns PerToken groups.
IntQuantized quantize_p_per_token_int8(std::span<const float> p, int64_t rows, int64_t cols,
                                       std::span<const float> rowmax = {});

// ---- smoothing (docs/design.md, Numerics) ---------------------------------------------------------

enum class MeanEstimate {
  AllTokens,  // mean over every row
  Sampled,    // rows floor(i·rows/256), i = 0..255, when rows > 256; else all rows
};

// Per-channel mean over tokens (accumulated in double, returned as float): cols values.
std::vector<float> token_mean(std::span<const float> x, int64_t rows, int64_t cols,
                              MeanEstimate estimate);

// The per-channel amax the V quantizer of the SageAttention2-8b kernel uses
// (docs/sage2-kernel-arithmetic.md step 4), cols values. From the token sample of
// MeanEstimate::Sampled: b = kAmaxSampleMargin · (amax over the sample), or the amax
// itself when the sample is every row; FLT_MAX where the product overflows a finite amax.
// Where the amax over all rows is larger than b (a NaN counts as the largest), that
// amax instead. So the kernel reads all of V once: the sample gives the scale before
// the quantization pass, which flags the rare channels the bound does not cover. The
// sample and the bound's rule: numerics/token_sample.h.
std::vector<float> sampled_amax_bound(std::span<const float> x, int64_t rows, int64_t cols);

// x with the vector c (cols values) subtracted from / added to every row.
std::vector<float> subtract_row_vector(std::span<const float> x, int64_t rows, int64_t cols,
                                       std::span<const float> c);
std::vector<float> add_row_vector(std::span<const float> x, int64_t rows, int64_t cols,
                                  std::span<const float> c);

// Per row Σ_c x[r][c]·v[c], accumulated in double: for K smoothing the LSE correction
// is sm_scale · dot_rows(q, c).
std::vector<float> dot_rows(std::span<const float> x, int64_t rows, int64_t cols,
                            std::span<const float> v);

// A smoothed matrix and the means taken out. means holds mean_rows × cols values:
// row b is the mean subtracted from rows [b·rows_per_mean, (b+1)·rows_per_mean).
struct Smoothed {
  std::vector<float> values;  // rows × cols
  std::vector<float> means;   // mean_rows × cols
  int64_t mean_rows = 1;
  int64_t rows_per_mean = 0;
};

// K − c with c the mean over tokens (softmax unchanged; the LSE gains sm_scale·q·c).
Smoothed smooth_k(std::span<const float> k, int64_t rows, int64_t cols,
                  MeanEstimate estimate = MeanEstimate::AllTokens);
// K − c for a given vector c (any c keeps softmax exact).
Smoothed smooth_k_with(std::span<const float> k, int64_t rows, int64_t cols,
                       std::span<const float> c);
// Q − q̄_b per block of block_rows rows (default one 64-row Q block). The caller adds
// q̄_b·Kᵀ (q_mean_scores) to the scores of the block's rows before the softmax.
Smoothed smooth_q(std::span<const float> q, int64_t rows, int64_t cols,
                  int64_t block_rows = groups::kQBlock);
// V − v̄; O = P(V − v̄) + v̄ since each row of the normalized P sums to 1.
Smoothed smooth_v(std::span<const float> v, int64_t rows, int64_t cols);

// q̄_b · k_j for every Q block b and key j, in double, returned as float:
// q.mean_rows × nkv values. k is (nkv × cols).
std::vector<float> q_mean_scores(const Smoothed& q, std::span<const float> k, int64_t nkv,
                                 int64_t cols);

}  // namespace qattn::numerics
