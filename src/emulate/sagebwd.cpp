#include "emulate/sagebwd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

#include "emulate/common.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"
#include "numerics/quantize.h"

namespace qattn::emulate {
namespace {

using numerics::Granularity;
using numerics::Operand;

constexpr int kQBlock = groups::kQBlock;
constexpr int kKvTile = groups::kKvTile;

// An 8-bit quantized row-major matrix whose scale groups are whole rows or unions of
// rows (per-block, per-token, per-tile): decoded code values and each row's scale.
struct Rows8 {
  int rows = 0, cols = 0;
  std::vector<float> val;        // rows × cols: INT8 integers or decoded E4M3 values
  std::vector<float> row_scale;  // rows
  const float* row(int r) const { return val.data() + static_cast<std::size_t>(r) * cols; }
};

Rows8 quant8(std::span<const float> x, int rows, int cols, Bwd8Format f, Granularity g,
             Operand op) {
  Rows8 m;
  m.rows = rows;
  m.cols = cols;
  m.val.resize(x.size());
  m.row_scale.resize(rows);
  if (f == Bwd8Format::Int8) {
    const auto qz = numerics::quantize_int(x, rows, cols, numerics::IntFormat::Int8, g, op);
    for (std::size_t i = 0; i < x.size(); ++i) m.val[i] = qz.values[i];
    for (int r = 0; r < rows; ++r) m.row_scale[r] = qz.scale_at(r, 0);
  } else {
    const auto qz = numerics::quantize_fp8(x, rows, cols, numerics::Fp8Format::E4M3, g, op);
    for (std::size_t i = 0; i < x.size(); ++i) m.val[i] = numerics::e4m3_decode(qz.codes[i]);
    for (int r = 0; r < rows; ++r) m.row_scale[r] = qz.scale_at(r, 0);
  }
  return m;
}

// ψ of a (rows × kKvTile) tile of P or dS with one scale per `keys` keys (128: the
// tile; 64: each half): decoded values in the tile's layout and the blocks' scales.
struct Tile8 {
  std::vector<float> val;
  float scale[2] = {0.0f, 0.0f};
  int keys = kKvTile;
  float scale_of(int key) const { return scale[key / keys]; }
};

Tile8 quant8_tile(std::span<const float> t, int rows, int keys, Bwd8Format f) {
  Tile8 out;
  out.keys = keys;
  out.val.resize(t.size());
  std::vector<float> part(static_cast<std::size_t>(rows) * keys);
  for (int b = 0; b < kKvTile / keys; ++b) {
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < keys; ++k)
        part[static_cast<std::size_t>(r) * keys + k] = t[static_cast<std::size_t>(r) * kKvTile + b * keys + k];
    const Rows8 q = quant8(part, rows, keys, f, Granularity::PerTensor, Operand::K);
    out.scale[b] = q.row_scale[0];
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < keys; ++k)
        out.val[static_cast<std::size_t>(r) * kKvTile + b * keys + k] = q.val[static_cast<std::size_t>(r) * keys + k];
  }
  return out;
}

// Per-token P of the forward: s_P = rowmax/qmax with rowmax from the softmax (§4.1).
Rows8 quant8_p_per_token(std::span<const float> p, int rows, int cols,
                         std::span<const float> rowmax, Bwd8Format f) {
  if (f == Bwd8Format::E4M3) {
    // rowmax(P̃) = exp2(rowmax(x) − m) is the largest p itself (exp2 is monotone), so the
    // data-driven per-token E4M3 scale is the same number.
    return quant8(p, rows, cols, f, Granularity::PerToken, Operand::Q);
  }
  const auto qz = numerics::quantize_p_per_token_int8(p, rows, cols, rowmax);
  Rows8 m;
  m.rows = rows;
  m.cols = cols;
  m.val.assign(qz.values.begin(), qz.values.end());
  m.row_scale = qz.scales;
  return m;
}

// Exact sum of products of two 8-bit value rows (INT32 or the exact FP8 products).
double dot8(const float* a, const float* b, int len) {
  double acc = 0.0;
  for (int k = 0; k < len; ++k) acc += static_cast<double>(a[k]) * b[k];
  return acc;
}

void check_options(const char* who, const SageBwdOptions& o) {
  if (o.k_smoothing == KSmoothing::Given) {
    throw std::invalid_argument(std::string(who) +
                                ": k_smoothing must be None, Mean or SampledMean");
  }
  if (o.scales == Bwd8Scales::MergeFree && o.format != Bwd8Format::E4M3) {
    throw std::invalid_argument(std::string(who) +
                                ": scales = MergeFree needs format = E4M3 (INT8 codes are linear: a "
                                "scale fixed from a bound leaves them too few)");
  }
  if (o.scales == Bwd8Scales::MergeFree && o.dov != DoVFormat::Fp16) {
    throw std::invalid_argument(std::string(who) +
                                ": scales = MergeFree needs dov = Fp16 (its dS bound is built on "
                                "the 16-bit dO·Vᵀ)");
  }
  if (o.pds_block_keys != kKvTile && o.pds_block_keys != kKvTile / 2) {
    throw std::invalid_argument(std::string(who) + ": pds_block_keys = " +
                                std::to_string(o.pds_block_keys) + "; allowed: 128 or 64");
  }
}

// What forward and backward share for one (batch, query head): the smoothed K's mean
// and the per-block 8-bit Q and K.
struct HeadQuant {
  std::vector<float> k_s;      // nkv × d, smoothed K (FP32)
  std::vector<float> c;        // d, the smoothing vector (zeros when off)
  std::vector<float> q_dot_c;  // nq, q·c
  Rows8 q8, k8;
};

HeadQuant quantize_head(const float* q, const float* k, int nq, int nkv, int d,
                        const SageBwdOptions& opt) {
  HeadQuant h;
  const std::span<const float> q_in(q, static_cast<std::size_t>(nq) * d);
  const std::span<const float> k_in(k, static_cast<std::size_t>(nkv) * d);
  h.k_s.assign(k_in.begin(), k_in.end());
  h.c.assign(d, 0.0f);
  h.q_dot_c.assign(nq, 0.0f);
  if (opt.k_smoothing != KSmoothing::None) {
    const auto est = opt.k_smoothing == KSmoothing::SampledMean ? numerics::MeanEstimate::Sampled
                                                                : numerics::MeanEstimate::AllTokens;
    numerics::Smoothed ks = numerics::smooth_k(k_in, nkv, d, est);
    h.k_s = std::move(ks.values);
    h.c = ks.means;
    h.q_dot_c = numerics::dot_rows(q_in, nq, d, h.c);
  }
  h.q8 = quant8(q_in, nq, d, opt.format, Granularity::PerBlock, Operand::Q);
  h.k8 = quant8(h.k_s, nkv, d, opt.format, Granularity::PerBlock, Operand::K);
  return h;
}

// Scores of one Q block × KV tile in log2 units, −inf where masked or past Nkv.
void tile_scores(const HeadQuant& h, int r0, int rows, int j0, int nq, int nkv, int d, Mask mask,
                 float scale_log2, std::vector<float>& x) {
  for (int r = 0; r < rows; ++r) {
    const int i = r0 + r;
    for (int jj = 0; jj < kKvTile; ++jj) {
      const int j = j0 + jj;
      float xv = kNegInf;
      if (j < nkv && key_visible(mask, i, j, nq, nkv)) {
        const float s = static_cast<float>(dot8(h.q8.row(i), h.k8.row(j), d)) *
                        (h.q8.row_scale[i] * h.k8.row_scale[j]);
        xv = s * scale_log2;
      }
      x[static_cast<std::size_t>(r) * kKvTile + jj] = xv;
    }
  }
}

void forward_head(const float* q, const float* k, const float* v, float* o_out, float* lse_out,
                  const HeadShape& sh, const SageBwdOptions& opt) {
  const int nq = sh.nq, nkv = sh.nkv, d = sh.d;
  const HeadQuant h = quantize_head(q, k, nq, nkv, d, opt);
  // V per KV tile (per-block), padded with zero tokens to whole tiles.
  const int ntiles = (nkv + kKvTile - 1) / kKvTile;
  std::vector<float> v_pad(static_cast<std::size_t>(ntiles) * kKvTile * d, 0.0f);
  std::copy(v, v + static_cast<std::size_t>(nkv) * d, v_pad.begin());
  const Rows8 v8 =
      quant8(v_pad, ntiles * kKvTile, d, opt.format, Granularity::PerBlock, Operand::K);

  const float scale_log2 = static_cast<float>(sh.sm_scale * kLog2eDouble);
  std::vector<float> x(static_cast<std::size_t>(kQBlock) * kKvTile), p(x.size());
  std::vector<float> rowmax(kQBlock), alpha(kQBlock);
  std::vector<double> acc(d);

  for (int r0 = 0; r0 < nq; r0 += kQBlock) {
    const int rows = std::min(kQBlock, nq - r0);
    std::vector<float> m(rows, kNegInf), l(rows, 0.0f);
    std::vector<float> o(static_cast<std::size_t>(rows) * d, 0.0f);
    for (int t = 0; t < ntiles; ++t) {
      const int j0 = t * kKvTile;
      tile_scores(h, r0, rows, j0, nq, nkv, d, sh.mask, scale_log2, x);
      for (int r = 0; r < rows; ++r) {
        const float* xr = x.data() + static_cast<std::size_t>(r) * kKvTile;
        float* pr = p.data() + static_cast<std::size_t>(r) * kKvTile;
        float mx = kNegInf;
        for (int jj = 0; jj < kKvTile; ++jj) mx = nan_max(mx, xr[jj]);
        const float m_new = nan_max(m[r], mx);
        if (m_new == kNegInf) {  // no visible key yet
          std::fill(pr, pr + kKvTile, 0.0f);
          alpha[r] = 1.0f;
          rowmax[r] = 0.0f;
          continue;
        }
        alpha[r] = std::exp2(m[r] - m_new);
        float sum = 0.0f;
        for (int jj = 0; jj < kKvTile; ++jj) {
          pr[jj] = std::exp2(xr[jj] - m_new);
          sum += pr[jj];
        }
        rowmax[r] = std::exp2(mx - m_new);  // rowmax(P̃) from the softmax statistics
        m[r] = m_new;
        l[r] = l[r] * alpha[r] + sum;
      }
      const Rows8 p8 =
          quant8_p_per_token(std::span<const float>(p.data(), rows * kKvTile), rows, kKvTile,
                             std::span<const float>(rowmax.data(), rows), opt.format);
      const float s_v = v8.row_scale[j0];
      for (int r = 0; r < rows; ++r) {
        if (m[r] == kNegInf) continue;
        std::fill(acc.begin(), acc.end(), 0.0);
        const float* pr = p8.row(r);
        for (int jj = 0; jj < kKvTile; ++jj) {
          if (pr[jj] == 0.0f) continue;
          const float* vj = v8.row(j0 + jj);
          for (int c = 0; c < d; ++c) acc[c] += static_cast<double>(pr[jj]) * vj[c];
        }
        const float sc = p8.row_scale[r] * s_v;
        float* orow = o.data() + static_cast<std::size_t>(r) * d;
        for (int c = 0; c < d; ++c) orow[c] = orow[c] * alpha[r] + static_cast<float>(acc[c]) * sc;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int i = r0 + r;
      float* out = o_out + static_cast<std::size_t>(i) * d;
      if (m[r] == kNegInf) {
        std::fill(out, out + d, 0.0f);
        lse_out[i] = kNegInf;
        continue;
      }
      for (int c = 0; c < d; ++c) out[c] = o[static_cast<std::size_t>(r) * d + c] / l[r];
      lse_out[i] = (m[r] + std::log2(l[r])) * kLn2 + sh.sm_scale * h.q_dot_c[i];
    }
  }
}

// E4M3 codes of x / scale, decoded (scale 0: zeros).
float e4m3_of(float x, float scale) {
  return scale > 0.0f ? numerics::e4m3_round(x / scale) : 0.0f;
}

// Step 0 and the saved LSE back in the smoothed log2 domain of the scores, per query row.
void rows_d_lse2(const float* o, const float* lse, const float* dout, const HeadQuant& h,
                 const HeadShape& sh, std::vector<float>& D, std::vector<float>& lse2) {
  const int nq = sh.nq, d = sh.d;
  D.assign(nq, 0.0f);
  lse2.assign(nq, 0.0f);
  for (int i = 0; i < nq; ++i) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc += dout[i * d + c] * o[i * d + c];
    D[i] = acc;
    lse2[i] = (lse[i] - sh.sm_scale * h.q_dot_c[i]) * static_cast<float>(kLog2eDouble);
  }
}

// One query head of a KV head's group under the MergeFree scales: its inputs, the
// shared quantization, and steps 0, a and b.
struct MergeFreeHead {
  const float* q;
  const float* dout;
  float* dq;
  HeadQuant h;
  std::vector<float> D, lse2, s_row;
};

// The MergeFree scales (the header's steps a-d) for one (batch, KV head): every query
// head of its group; adds into dk/dv of the KV head. p_max: the group's first head's
// row maxima from the forward, or null (recomputed from the scores).
void backward_group_merge_free(std::vector<MergeFreeHead>& heads, const float* v, const float* p_max,
                               float* dk, float* dv, const HeadShape& sh, const SageBwdOptions& opt) {
  const int nq = sh.nq, nkv = sh.nkv, d = sh.d;
  const int ntiles = (nkv + kKvTile - 1) / kKvTile;
  const float scale_log2 = static_cast<float>(sh.sm_scale * kLog2eDouble);
  constexpr float kMax = numerics::kE4M3Max;
  std::vector<float> x(static_cast<std::size_t>(kQBlock) * kKvTile);

  // a. V's per-channel maximum (FP16); b. each row's P maximum and s_i.
  std::vector<float> v_max(d, 0.0f);
  for (int j = 0; j < nkv; ++j)
    for (int c = 0; c < d; ++c) v_max[c] = std::max(v_max[c], std::fabs(numerics::fp16_round(v[j * d + c])));
  std::vector<float> s_do(d, 0.0f), s_q(d, 0.0f);
  for (std::size_t hh = 0; hh < heads.size(); ++hh) {
    MergeFreeHead& g = heads[hh];
    std::vector<float> pmax(nq, 0.0f);
    if (p_max != nullptr) {
      std::copy(p_max + hh * nq, p_max + (hh + 1) * nq, pmax.begin());
    } else {
      std::vector<float> m2(nq, kNegInf);
      for (int r0 = 0; r0 < nq; r0 += kQBlock) {
        const int rows = std::min(kQBlock, nq - r0);
        for (int t = 0; t < ntiles; ++t) {
          tile_scores(g.h, r0, rows, t * kKvTile, nq, nkv, d, sh.mask, scale_log2, x);
          for (int r = 0; r < rows; ++r)
            for (int jj = 0; jj < kKvTile; ++jj)
              m2[r0 + r] = nan_max(m2[r0 + r], x[static_cast<std::size_t>(r) * kKvTile + jj]);
        }
      }
      for (int i = 0; i < nq; ++i) pmax[i] = m2[i] == kNegInf ? 0.0f : std::exp2(m2[i] - g.lse2[i]);
    }
    g.s_row.assign(nq, 0.0f);
    for (int i = 0; i < nq; ++i) {
      if (!(pmax[i] > 0.0f)) continue;  // a row that sees no key: P = 0, dS = 0
      double bound = std::fabs(g.D[i]);
      for (int c = 0; c < d; ++c)
        bound += std::fabs(numerics::fp16_round(g.dout[i * d + c])) * static_cast<double>(v_max[c]);
      g.s_row[i] = static_cast<float>(bound) * pmax[i] / kMax;
    }
    // c, d. the per-channel maxima of dO and s·Q over every row of the group.
    for (int i = 0; i < nq; ++i)
      for (int c = 0; c < d; ++c) {
        s_do[c] = std::max(s_do[c], std::fabs(g.dout[i * d + c]));
        s_q[c] = std::max(s_q[c], std::fabs(g.s_row[i] * g.q[i * d + c]));
      }
  }
  for (int c = 0; c < d; ++c) {
    s_do[c] /= kMax;
    s_q[c] /= kMax;
  }

  std::vector<float> p(x.size()), ds(x.size()), v_tile(static_cast<std::size_t>(kKvTile) * d);
  std::vector<float> do16(static_cast<std::size_t>(nq) * d), do8(do16.size()), q8(do16.size());
  std::vector<float> dq_acc(do16.size());
  std::vector<double> dk_sum(v_tile.size()), dv_sum(v_tile.size()), acc(d);
  for (MergeFreeHead& g : heads) {
    for (int i = 0; i < nq; ++i)
      for (int c = 0; c < d; ++c) {
        const int e = i * d + c;
        do16[e] = numerics::fp16_round(g.dout[e]);
        do8[e] = e4m3_of(g.dout[e], s_do[c]);
        q8[e] = e4m3_of(g.s_row[i] * g.q[e], s_q[c]);
      }
    std::fill(dq_acc.begin(), dq_acc.end(), 0.0f);
    for (int t = 0; t < ntiles; ++t) {
      const int j0 = t * kKvTile;
      const int cols = std::min(kKvTile, nkv - j0);
      std::fill(v_tile.begin(), v_tile.end(), 0.0f);
      for (int jj = 0; jj < cols; ++jj)
        for (int c = 0; c < d; ++c) v_tile[jj * d + c] = numerics::fp16_round(v[(j0 + jj) * d + c]);
      std::fill(dk_sum.begin(), dk_sum.end(), 0.0);
      std::fill(dv_sum.begin(), dv_sum.end(), 0.0);
      for (int r0 = 0; r0 < nq; r0 += kQBlock) {
        const int rows = std::min(kQBlock, nq - r0);
        tile_scores(g.h, r0, rows, j0, nq, nkv, d, sh.mask, scale_log2, x);
        for (int r = 0; r < rows; ++r) {
          const int i = r0 + r;
          for (int jj = 0; jj < kKvTile; ++jj) {
            const std::size_t e = static_cast<std::size_t>(r) * kKvTile + jj;
            p[e] = x[e] == kNegInf ? 0.0f : std::exp2(x[e] - g.lse2[i]);
            if (p[e] == 0.0f) {
              ds[e] = 0.0f;
              continue;
            }
            float dp = 0.0f;  // FP16 × FP16 products are exact in FP32
            for (int c = 0; c < d; ++c) dp += do16[i * d + c] * v_tile[jj * d + c];
            ds[e] = p[e] * (dp - g.D[i]);
          }
        }
        for (int r = 0; r < rows; ++r) {
          const int i = r0 + r;
          float rowsum = 0.0f;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int jj = 0; jj < cols; ++jj) {
            const std::size_t e = static_cast<std::size_t>(r) * kKvTile + jj;
            rowsum += ds[e];
            const float pv = numerics::e4m3_round(p[e] * kMax);  // c. P·448, no scale
            const float dsv = e4m3_of(ds[e], g.s_row[i]);       // d. dS / s_i
            for (int c = 0; c < d; ++c) {
              dv_sum[jj * d + c] += static_cast<double>(pv) * do8[i * d + c];
              dk_sum[jj * d + c] += static_cast<double>(dsv) * q8[i * d + c];
              acc[c] += static_cast<double>(dsv) * g.h.k8.row(j0 + jj)[c];
            }
          }
          const float sc = g.s_row[i] * g.h.k8.row_scale[j0];
          for (int c = 0; c < d; ++c) {
            const float term = opt.dq_mean_term ? rowsum * g.h.c[c] : 0.0f;
            dq_acc[i * d + c] += sh.sm_scale * (static_cast<float>(acc[c]) * sc + term);
          }
        }
      }
      for (int jj = 0; jj < cols; ++jj)
        for (int c = 0; c < d; ++c) {
          dv[(j0 + jj) * d + c] += static_cast<float>(dv_sum[jj * d + c]) * (s_do[c] / kMax);
          dk[(j0 + jj) * d + c] += sh.sm_scale * static_cast<float>(dk_sum[jj * d + c]) * s_q[c];
        }
    }
    std::copy(dq_acc.begin(), dq_acc.end(), g.dq);
  }
}

// One (batch, query head) of the backward; adds into dk/dv of its KV head.
void backward_head(const float* q, const float* k, const float* v, const float* o, const float* lse,
                   const float* dout, float* dq, float* dk, float* dv, const HeadShape& sh,
                   const SageBwdOptions& opt) {
  const int nq = sh.nq, nkv = sh.nkv, d = sh.d;
  const HeadQuant h = quantize_head(q, k, nq, nkv, d, opt);
  const int ntiles = (nkv + kKvTile - 1) / kKvTile;
  const float scale_log2 = static_cast<float>(sh.sm_scale * kLog2eDouble);

  std::vector<float> D, lse2;
  rows_d_lse2(o, lse, dout, h, sh, D, lse2);
  const std::span<const float> dout_in(dout, static_cast<std::size_t>(nq) * d);
  const Rows8 do8 = quant8(dout_in, nq, d, opt.format, Granularity::PerBlock, Operand::Q);
  std::vector<float> do16(dout_in.begin(), dout_in.end());
  for (float& x : do16) x = numerics::fp16_round(x);

  std::vector<float> dq_acc(static_cast<std::size_t>(nq) * d, 0.0f);
  std::vector<float> x(static_cast<std::size_t>(kQBlock) * kKvTile), p(x.size()), ds(x.size());
  std::vector<float> v_tile(static_cast<std::size_t>(kKvTile) * d);
  std::vector<float> dk_t(v_tile.size()), dv_t(v_tile.size());
  std::vector<double> acc(std::max(d, kKvTile));

  for (int t = 0; t < ntiles; ++t) {
    const int j0 = t * kKvTile;
    const int cols = std::min(kKvTile, nkv - j0);
    // V_j for dP: FP16, or 8-bit per tile (tail tokens zero, outside every scale).
    std::fill(v_tile.begin(), v_tile.end(), 0.0f);
    for (int jj = 0; jj < cols; ++jj)
      for (int c = 0; c < d; ++c) v_tile[jj * d + c] = v[(j0 + jj) * d + c];
    Rows8 v8;
    if (opt.dov == DoVFormat::Quantized) {
      v8 = quant8(v_tile, kKvTile, d, opt.format, Granularity::PerTensor, Operand::K);
    } else {
      for (float& xv : v_tile) xv = numerics::fp16_round(xv);
    }
    std::fill(dk_t.begin(), dk_t.end(), 0.0f);
    std::fill(dv_t.begin(), dv_t.end(), 0.0f);

    for (int r0 = 0; r0 < nq; r0 += kQBlock) {
      const int rows = std::min(kQBlock, nq - r0);
      const std::size_t tsz = static_cast<std::size_t>(rows) * kKvTile;
      // Step 1: P from the recomputed scores and the saved LSE.
      tile_scores(h, r0, rows, j0, nq, nkv, d, sh.mask, scale_log2, x);
      bool any = false;
      for (int r = 0; r < rows; ++r) {
        for (int jj = 0; jj < kKvTile; ++jj) {
          const std::size_t e = static_cast<std::size_t>(r) * kKvTile + jj;
          p[e] = x[e] == kNegInf ? 0.0f : std::exp2(x[e] - lse2[r0 + r]);
          any = any || p[e] != 0.0f;
        }
      }
      if (!any) continue;  // a fully masked tile adds nothing

      // Step 2: dV_j += ψ(P)ᵀ ψ(dO_i).
      const Tile8 p8 = quant8_tile(std::span<const float>(p.data(), tsz), rows, opt.pds_block_keys,
                                   opt.format);
      for (int jj = 0; jj < cols; ++jj) {
        const float s_pdo = p8.scale_of(jj) * do8.row_scale[r0];
        std::fill(acc.begin(), acc.begin() + d, 0.0);
        for (int r = 0; r < rows; ++r) {
          const float pv = p8.val[static_cast<std::size_t>(r) * kKvTile + jj];
          if (pv == 0.0f) continue;
          const float* g = do8.row(r0 + r);
          for (int c = 0; c < d; ++c) acc[c] += static_cast<double>(pv) * g[c];
        }
        for (int c = 0; c < d; ++c) dv_t[jj * d + c] += static_cast<float>(acc[c]) * s_pdo;
      }

      // Steps 3-4: dP = dO Vᵀ, dS = P ∘ (dP − D).
      for (int r = 0; r < rows; ++r) {
        const int i = r0 + r;
        for (int jj = 0; jj < kKvTile; ++jj) {
          const std::size_t e = static_cast<std::size_t>(r) * kKvTile + jj;
          if (p[e] == 0.0f) {
            ds[e] = 0.0f;
            continue;
          }
          float dp;
          if (opt.dov == DoVFormat::Fp16) {
            float a = 0.0f;  // FP16 × FP16 products are exact in FP32
            for (int c = 0; c < d; ++c) a += do16[i * d + c] * v_tile[jj * d + c];
            dp = a;
          } else {
            dp = static_cast<float>(dot8(do8.row(i), v8.row(jj), d)) *
                 (do8.row_scale[i] * v8.row_scale[jj]);
          }
          ds[e] = p[e] * (dp - D[i]);
        }
      }
      const Tile8 ds8 = quant8_tile(std::span<const float>(ds.data(), tsz), rows,
                                    opt.pds_block_keys, opt.format);

      // Step 5: dQ_i += sm_scale·ψ(dS) ψ(K_j) (smoothed K), plus sm_scale·rowsum(dS)·c
      // with dq_mean_term (the header says why it is off by default).
      // Each block of pds_block_keys keys is one exact product, scaled once.
      for (int r = 0; r < rows; ++r) {
        const int i = r0 + r;
        float rowsum = 0.0f;
        for (int b0 = 0; b0 < kKvTile; b0 += opt.pds_block_keys) {
          std::fill(acc.begin(), acc.begin() + d, 0.0);
          for (int jj = b0; jj < std::min(cols, b0 + opt.pds_block_keys); ++jj) {
            const float sv = ds8.val[static_cast<std::size_t>(r) * kKvTile + jj];
            rowsum += ds[static_cast<std::size_t>(r) * kKvTile + jj];
            if (sv == 0.0f) continue;
            const float* kj = h.k8.row(j0 + jj);
            for (int c = 0; c < d; ++c) acc[c] += static_cast<double>(sv) * kj[c];
          }
          const float sc = ds8.scale_of(b0) * h.k8.row_scale[j0];
          const bool last = b0 + opt.pds_block_keys >= kKvTile;
          for (int c = 0; c < d; ++c) {
            const float term = last && opt.dq_mean_term ? rowsum * h.c[c] : 0.0f;
            dq_acc[i * d + c] += sh.sm_scale * (static_cast<float>(acc[c]) * sc + term);
          }
        }
      }
      // Step 6: dK_j += sm_scale·ψ(dS)ᵀ ψ(Q_i).
      for (int jj = 0; jj < cols; ++jj) {
        const float sq = ds8.scale_of(jj) * h.q8.row_scale[r0];
        std::fill(acc.begin(), acc.begin() + d, 0.0);
        for (int r = 0; r < rows; ++r) {
          const float sv = ds8.val[static_cast<std::size_t>(r) * kKvTile + jj];
          if (sv == 0.0f) continue;
          const float* qi = h.q8.row(r0 + r);
          for (int c = 0; c < d; ++c) acc[c] += static_cast<double>(sv) * qi[c];
        }
        for (int c = 0; c < d; ++c)
          dk_t[jj * d + c] += sh.sm_scale * static_cast<float>(acc[c]) * sq;
      }
    }
    for (int jj = 0; jj < cols; ++jj) {
      for (int c = 0; c < d; ++c) {
        dk[(j0 + jj) * d + c] += dk_t[jj * d + c];
        dv[(j0 + jj) * d + c] += dv_t[jj * d + c];
      }
    }
  }
  std::copy(dq_acc.begin(), dq_acc.end(), dq);
}

}  // namespace

EmulatedForward sagebwd_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const SageBwdOptions& options) {
  const double sm_scale = validate_attention_args("sagebwd_forward", q, k, v, params);
  require_equal_head_dims("sagebwd_forward", q, v);
  require_plain_mask("sagebwd_forward", params);
  check_options("sagebwd_forward", options);
  EmulatedForward out{Tensor4(q.b, q.h, q.n, q.d),
                      std::vector<float>(static_cast<std::size_t>(q.b) * q.h * q.n)};
  const HeadShape sh{q.n, k.n, q.d, static_cast<float>(sm_scale), params.mask};
  const int group = q.h / k.h;
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      forward_head(q.row(b, h, 0), k.row(b, h / group, 0), v.row(b, h / group, 0),
                   out.o.row(b, h, 0),
                   out.lse.data() + (static_cast<std::size_t>(b) * q.h + h) * q.n, sh, options);
    }
  }
  return out;
}

EmulatedGrads sagebwd_backward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                               const Tensor4& o, const std::vector<float>& lse, const Tensor4& dout,
                               const AttentionParams& params, const SageBwdOptions& options) {
  constexpr const char* kWho = "sagebwd_backward";
  const double sm_scale = validate_attention_args(kWho, q, k, v, params);
  require_equal_head_dims(kWho, q, v);
  require_plain_mask(kWho, params);
  check_options(kWho, options);
  if (!o.same_shape(q.b, q.h, q.n, q.d) || o.data.size() != q.data.size()) {
    throw std::invalid_argument(std::string(kWho) + ": o must have q's shape (B, Hq, Nq, d)");
  }
  if (!dout.same_shape(q.b, q.h, q.n, q.d) || dout.data.size() != q.data.size()) {
    throw std::invalid_argument(std::string(kWho) + ": dout must have q's shape (B, Hq, Nq, d)");
  }
  if (lse.size() != static_cast<std::size_t>(q.b) * q.h * q.n) {
    throw std::invalid_argument(std::string(kWho) + ": lse must hold B·Hq·Nq values");
  }
  EmulatedGrads g{Tensor4(q.b, q.h, q.n, q.d), Tensor4(k.b, k.h, k.n, k.d),
                  Tensor4(k.b, k.h, k.n, k.d)};
  if (!options.p_max.empty() && options.p_max.size() != lse.size()) {
    throw std::invalid_argument(std::string(kWho) + ": options.p_max must hold B·Hq·Nq values");
  }
  const HeadShape sh{q.n, k.n, q.d, static_cast<float>(sm_scale), params.mask};
  const int group = q.h / k.h;
  if (options.scales == Bwd8Scales::MergeFree) {
    for (int b = 0; b < q.b; ++b) {
      for (int hk = 0; hk < k.h; ++hk) {
        std::vector<MergeFreeHead> heads;
        for (int h = hk * group; h < (hk + 1) * group; ++h) {
          const std::size_t row0 = (static_cast<std::size_t>(b) * q.h + h) * q.n;
          MergeFreeHead mh{q.row(b, h, 0), dout.row(b, h, 0), g.dq.row(b, h, 0),
                          quantize_head(q.row(b, h, 0), k.row(b, hk, 0), q.n, k.n, q.d, options),
                          {}, {}, {}};
          rows_d_lse2(o.row(b, h, 0), lse.data() + row0, dout.row(b, h, 0), mh.h, sh, mh.D, mh.lse2);
          heads.push_back(std::move(mh));
        }
        const float* pm = options.p_max.empty()
                              ? nullptr
                              : options.p_max.data() + (static_cast<std::size_t>(b) * q.h + hk * group) * q.n;
        backward_group_merge_free(heads, v.row(b, hk, 0), pm, g.dk.row(b, hk, 0), g.dv.row(b, hk, 0),
                                  sh, options);
      }
    }
    return g;
  }
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      const int hk = h / group;
      backward_head(q.row(b, h, 0), k.row(b, hk, 0), v.row(b, hk, 0), o.row(b, h, 0),
                    lse.data() + (static_cast<std::size_t>(b) * q.h + h) * q.n, dout.row(b, h, 0),
                    g.dq.row(b, h, 0), g.dk.row(b, hk, 0), g.dv.row(b, hk, 0), sh, options);
    }
  }
  return g;
}

}  // namespace qattn::emulate
