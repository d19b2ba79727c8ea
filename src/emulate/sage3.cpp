#include "emulate/sage3.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

#include "emulate/common.h"
#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"

namespace qattn::emulate {
namespace {

using numerics::Fp4Format;

constexpr int kQBlock = groups::kQBlock;
constexpr int kKvTile = groups::kKvTile;

// An FP4-quantized row-major matrix kept as decoded E2M1 values plus one scale per
// block of `block` elements along a row: exactly what the block-scaled MMA reads.
struct Fp4Matrix {
  int rows = 0, cols = 0, block = 0;
  std::vector<float> e;      // rows × cols, E2M1 values
  std::vector<float> scale;  // rows × cols/block, decoded E4M3 / E8M0
  const float* row(int r) const { return e.data() + static_cast<std::size_t>(r) * cols; }
  const float* row_scales(int r) const {
    return scale.data() + static_cast<std::size_t>(r) * (cols / block);
  }
};

Fp4Matrix to_fp4(std::span<const float> x, int rows, int cols, Fp4Format format) {
  const numerics::Fp4Quantized qz = numerics::quantize_fp4(x, rows, cols, format);
  Fp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.block = qz.block;
  m.e.resize(qz.codes.size());
  for (std::size_t i = 0; i < qz.codes.size(); ++i) m.e[i] = numerics::e2m1_decode(qz.codes[i]);
  m.scale = qz.scales;
  return m;
}

// Σ over scale blocks of (s_a·s_b)·Σ_k a_k·b_k. Each block sum of E2M1 products is a
// multiple of 1/4 below 2^10 and s_a·s_b has at most 8 significant bits (E4M3·E4M3)
// or is a power of two (E8M0), so every block term is exact in FP32; only the
// accumulation over blocks rounds.
float block_scaled_dot(const float* a, const float* sa, const float* b, const float* sb, int len,
                       int block) {
  float acc = 0.0f;
  for (int blk = 0; blk < len / block; ++blk) {
    const float* ab = a + blk * block;
    const float* bb = b + blk * block;
    float part = 0.0f;
    for (int k = 0; k < block; ++k) part += ab[k] * bb[k];
    acc += (sa[blk] * sb[blk]) * part;
  }
  return acc;
}

struct HeadIo {
  const float* q;  // nq × d
  const float* k;  // nkv × d
  const float* v;  // nkv × d
  float* o;        // nq × d
  float* lse;      // nq
};

void sage3_head(const HeadIo& io, const HeadShape& sh, const Sage3Options& opt,
                Sage3PTrace* trace) {
  const int nq = sh.nq, nkv = sh.nkv, d = sh.d;
  const std::size_t qsz = static_cast<std::size_t>(nq) * d;
  const std::size_t ksz = static_cast<std::size_t>(nkv) * d;
  const std::span<const float> q_in(io.q, qsz), k_in(io.k, ksz);

  // Step 1: K smoothing (any c keeps softmax exact; the LSE gets sm_scale·q·c back).
  std::vector<float> k_s(k_in.begin(), k_in.end());
  std::vector<float> q_dot_c(nq, 0.0f);
  if (opt.k_smoothing != KSmoothing::None) {
    const auto est = opt.k_smoothing == KSmoothing::SampledMean ? numerics::MeanEstimate::Sampled
                                                                : numerics::MeanEstimate::AllTokens;
    numerics::Smoothed ks = numerics::smooth_k(k_in, nkv, d, est);
    k_s = std::move(ks.values);
    q_dot_c = numerics::dot_rows(q_in, nq, d, ks.means);
  }

  // Step 2: Q smoothing per 64-row block, and the high-precision q̄_i·K_jᵀ term.
  std::vector<float> q_s(q_in.begin(), q_in.end());
  std::vector<float> qbar_k;  // (nq blocks) × nkv
  if (opt.q_smoothing == QSmoothing::BlockMean) {
    numerics::Smoothed qs = numerics::smooth_q(q_in, nq, d, kQBlock);
    qbar_k = numerics::q_mean_scores(qs, k_s, nkv, d);
    q_s = std::move(qs.values);
  }

  // Steps 2-3: FP4 Q and K along d; V along tokens (stored transposed, d × nkv_pad,
  // tail tokens zero so they enter no scale).
  const Fp4Matrix qf = to_fp4(q_s, nq, d, opt.format);
  const Fp4Matrix kf = to_fp4(k_s, nkv, d, opt.format);
  const int ntiles = (nkv + kKvTile - 1) / kKvTile;
  const int nkv_pad = ntiles * kKvTile;
  std::vector<float> vt(static_cast<std::size_t>(d) * nkv_pad, 0.0f);
  for (int j = 0; j < nkv; ++j) {
    for (int c = 0; c < d; ++c) vt[static_cast<std::size_t>(c) * nkv_pad + j] = io.v[j * d + c];
  }
  const Fp4Matrix vf = to_fp4(vt, d, nkv_pad, opt.format);
  const int pblock = vf.block;

  const float scale_log2 = static_cast<float>(sh.sm_scale * kLog2eDouble);
  std::vector<float> x(static_cast<std::size_t>(kQBlock) * kKvTile);
  std::vector<float> p2(x.size());
  std::vector<float> tile_rowmax(kQBlock), s_p1(kQBlock), pv(d);

  for (int r0 = 0; r0 < nq; r0 += kQBlock) {
    const int rows = std::min(kQBlock, nq - r0);
    std::vector<float> m(rows, kNegInf), l(rows, 0.0f);
    std::vector<float> o(static_cast<std::size_t>(rows) * d, 0.0f);
    const float* gemv = qbar_k.empty() ? nullptr : qbar_k.data() + (r0 / kQBlock) * nkv;

    for (int t = 0; t < ntiles; ++t) {
      const int j0 = t * kKvTile;
      // Step 4: scores of the tile (log2 units), −inf where masked or past Nkv.
      for (int r = 0; r < rows; ++r) {
        const int i = r0 + r;
        float mx = kNegInf;
        for (int jj = 0; jj < kKvTile; ++jj) {
          const int j = j0 + jj;
          float xv = kNegInf;
          if (j < nkv && key_visible(sh.mask, i, j, nq, nkv)) {
            float s = block_scaled_dot(qf.row(i), qf.row_scales(i), kf.row(j), kf.row_scales(j), d,
                                       qf.block);
            if (gemv != nullptr) s += gemv[j];
            xv = s * scale_log2;
          }
          x[static_cast<std::size_t>(r) * kKvTile + jj] = xv;
          mx = nan_max(mx, xv);
        }
        tile_rowmax[r] = mx;
      }

      // Step 5: online softmax; step 6: P̃ (or P2 = P̃/s_p1) for the quantizer.
      std::vector<float> alpha(rows, 1.0f);
      for (int r = 0; r < rows; ++r) {
        const float m_new = nan_max(m[r], tile_rowmax[r]);
        float* xr = x.data() + static_cast<std::size_t>(r) * kKvTile;
        float* pr = p2.data() + static_cast<std::size_t>(r) * kKvTile;
        if (m_new == kNegInf) {  // no visible key yet: nothing to add, no inf − inf
          std::fill(pr, pr + kKvTile, 0.0f);
          s_p1[r] = 0.0f;
          continue;
        }
        alpha[r] = std::exp2(m[r] - m_new);
        float sum = 0.0f;
        for (int jj = 0; jj < kKvTile; ++jj) {
          const float p = std::exp2(xr[jj] - m_new);  // exp2(−inf) = 0 for masked keys
          sum += p;
          pr[jj] = p;
        }
        m[r] = m_new;
        l[r] = l[r] * alpha[r] + sum;
        if (opt.p_scaling == PScaling::TwoLevel) {
          // rowmax(P̃) = exp2(rowmax(x) − m_new), from the softmax statistics.
          s_p1[r] = numerics::two_level_p_scale(std::exp2(tile_rowmax[r] - m_new));
          for (int jj = 0; jj < kKvTile; ++jj) pr[jj] = s_p1[r] == 0.0f ? 0.0f : pr[jj] / s_p1[r];
        } else {
          s_p1[r] = 1.0f;
        }
      }
      const Fp4Matrix pf =
          to_fp4(std::span<const float>(p2.data(), rows * kKvTile), rows, kKvTile, opt.format);

      // Step 7: the tile's P̂·V̂ in a fresh FP32 accumulator, × s_p1, then into O.
      for (int r = 0; r < rows; ++r) {
        float* orow = o.data() + static_cast<std::size_t>(r) * d;
        if (m[r] == kNegInf) continue;
        const float* pe = pf.row(r);
        const float* ps = pf.row_scales(r);
        for (int c = 0; c < d; ++c) {
          const float* ve = vf.row(c) + j0;
          const float* vs = vf.row_scales(c) + j0 / pblock;
          pv[c] = block_scaled_dot(pe, ps, ve, vs, kKvTile, pblock);
        }
        const float sp1 = opt.p_scaling == PScaling::TwoLevel ? s_p1[r] : 1.0f;
        for (int c = 0; c < d; ++c) orow[c] = orow[c] * alpha[r] + pv[c] * sp1;
        if (trace != nullptr && r0 + r < trace->row_limit) {
          const int i = r0 + r;
          for (int jj = 0; jj < kKvTile; ++jj) {
            const int j = j0 + jj;
            if (j >= nkv || !key_visible(sh.mask, i, j, nq, nkv)) continue;
            trace->p_dequantized.push_back(pe[jj] * ps[jj / pblock] * sp1);
          }
        }
      }
    }

    // Step 8: normalize; natural-log LSE with the K-smoothing correction.
    for (int r = 0; r < rows; ++r) {
      const int i = r0 + r;
      float* out = io.o + static_cast<std::size_t>(i) * d;
      if (m[r] == kNegInf) {
        std::fill(out, out + d, 0.0f);
        io.lse[i] = kNegInf;
        continue;
      }
      for (int c = 0; c < d; ++c) out[c] = o[static_cast<std::size_t>(r) * d + c] / l[r];
      io.lse[i] = (m[r] + std::log2(l[r])) * kLn2 + sh.sm_scale * q_dot_c[i];
    }
  }
}

}  // namespace

EmulatedForward sage3_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const Sage3Options& options,
                                Sage3PTrace* trace) {
  const double sm_scale = validate_attention_args("sage3_attention", q, k, v, params);
  require_equal_head_dims("sage3_attention", q, v);
  require_plain_mask("sage3_attention", params);
  const int block = numerics::block_size(options.format);
  if (q.d % block != 0) {
    throw std::invalid_argument("sage3_attention: head dim must be a multiple of the FP4 block (" +
                                std::to_string(block) + "), got " + std::to_string(q.d));
  }
  if (options.k_smoothing == KSmoothing::Given) {
    throw std::invalid_argument(
        "sage3_attention: k_smoothing must be None, Mean or SampledMean (Given is SA2-only)");
  }
  EmulatedForward out{Tensor4(q.b, q.h, q.n, q.d),
                      std::vector<float>(static_cast<std::size_t>(q.b) * q.h * q.n)};
  const HeadShape sh{q.n, k.n, q.d, static_cast<float>(sm_scale), params.mask};
  const int group = q.h / k.h;
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      const HeadIo io{q.row(b, h, 0), k.row(b, h / group, 0), v.row(b, h / group, 0),
                      out.o.row(b, h, 0),
                      out.lse.data() + (static_cast<std::size_t>(b) * q.h + h) * q.n};
      sage3_head(io, sh, options, trace);
    }
  }
  return out;
}

}  // namespace qattn::emulate
