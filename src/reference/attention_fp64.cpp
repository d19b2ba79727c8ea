#include "reference/attention_fp64.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace qattn::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Softmax probabilities of one query row, with its log-sum-exp. Masked keys get
// P = 0; a row with no visible key gets all zeros and lse = -inf.
struct RowSoftmax {
  std::vector<double> p;
  std::vector<bool> seen;  // the row's visible keys (kept across rows: no allocation per row)
  double lse = kNegInf;
};

void row_softmax(const float* qrow, const Tensor4& k, int b, int h, int hkv, int i,
                 const AttentionParams& params, const numerics::KeyRule& rule, double sm_scale,
                 RowSoftmax& out) {
  const int nkv = k.n, d = k.d;
  out.p.assign(nkv, 0.0);
  std::vector<bool>& seen = out.seen;
  seen.assign(nkv, false);
  double m = kNegInf;
  bool any_visible = false, any_nan = false;
  for (int j = 0; j < nkv; ++j) {
    const double add = params.mask_at(b, h, i, j);
    if (!rule.visible(i, j) || add == kNegInf) continue;
    const float* krow = k.row(b, hkv, j);
    double s = 0.0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(qrow[c]) * krow[c];
    s = s * sm_scale + add;
    seen[j] = true;
    out.p[j] = s;
    any_visible = true;
    if (std::isnan(s)) any_nan = true;
    if (s > m) m = s;
  }
  if (!any_visible) {
    out.lse = kNegInf;
    return;
  }
  if (any_nan) m = std::numeric_limits<double>::quiet_NaN();  // NaN in, NaN out
  double l = 0.0;
  for (int j = 0; j < nkv; ++j) {
    if (!seen[j]) continue;
    out.p[j] = std::exp(out.p[j] - m);
    l += out.p[j];
  }
  for (int j = 0; j < nkv; ++j) out.p[j] /= l;
  out.lse = m + std::log(l);
}

}  // namespace

ForwardResult attention_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params) {
  const double sm_scale = validate_attention_args("attention_forward", q, k, v, params);
  const int group = q.h / k.h;
  ForwardResult r{Tensor4d(q.b, q.h, q.n, v.d),
                  std::vector<double>(static_cast<std::size_t>(q.b) * q.h * q.n)};
  RowSoftmax sm;
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      const int hkv = h / group;
      for (int i = 0; i < q.n; ++i) {
        row_softmax(q.row(b, h, i), k, b, h, hkv, i, params, params.key_rule(b, q.n, k.n), sm_scale,
                    sm);
        r.lse[(static_cast<std::size_t>(b) * q.h + h) * q.n + i] = sm.lse;
        double* orow = r.o.row(b, h, i);
        for (int j = 0; j < k.n; ++j) {
          if (sm.p[j] == 0.0) continue;
          const float* vrow = v.row(b, hkv, j);
          for (int c = 0; c < v.d; ++c) orow[c] += sm.p[j] * vrow[c];
        }
      }
    }
  }
  return r;
}

VarlenForwardResult attention_forward_varlen(const PackedTensor& q, const PackedTensor& k,
                                             const PackedTensor& v, const VarlenLayout& layout,
                                             const AttentionParams& params) {
  const double sm_scale =
      validate_varlen_args("attention_forward_varlen", q, k, v, layout, params);
  const int group = q.h / k.h, d = q.d, dv = v.d;
  VarlenForwardResult r{PackedTensord(q.total, q.h, dv),
                        std::vector<double>(static_cast<std::size_t>(q.h) * q.total, kNegInf)};
  std::vector<double> s;
  for (int b = 0; b < layout.batch(); ++b) {
    const int nq = layout.len_q(b), nkv = layout.len_k(b), q0 = layout.q_start(b),
              k0 = layout.k_start(b);
    // The rule of the sequence as a call of its own (no key padding: kv_len = nkv).
    const numerics::KeyRule rule =
        numerics::make_key_rule(nq, nkv, params.mask == Mask::Causal,
                                params.alignment == Diagonal::TopLeft, params.window_left,
                                params.window_right, nkv);
    for (int h = 0; h < q.h; ++h) {
      const int hkv = h / group;
      for (int i = 0; i < nq; ++i) {
        const numerics::KeyRange keys = rule.keys(i);
        if (keys.empty()) continue;  // O = 0, LSE = -inf
        const float* qrow = q.row(q0 + i, h);
        s.assign(static_cast<std::size_t>(keys.last - keys.first + 1), 0.0);
        double m = kNegInf;
        bool any_nan = false;
        for (int j = keys.first; j <= keys.last; ++j) {
          const float* krow = k.row(k0 + j, hkv);
          double acc = 0.0;
          for (int c = 0; c < d; ++c) acc += static_cast<double>(qrow[c]) * krow[c];
          const double x = acc * sm_scale;
          s[j - keys.first] = x;
          if (std::isnan(x)) any_nan = true;
          if (x > m) m = x;
        }
        if (any_nan) m = std::numeric_limits<double>::quiet_NaN();
        double l = 0.0;
        for (double& x : s) {
          x = std::exp(x - m);
          l += x;
        }
        double* orow = r.o.row(q0 + i, h);
        for (int j = keys.first; j <= keys.last; ++j) {
          const double p = s[j - keys.first] / l;
          if (p == 0.0) continue;  // as attention_forward: an underflowed P adds nothing
          const float* vrow = v.row(k0 + j, hkv);
          for (int c = 0; c < dv; ++c) orow[c] += p * vrow[c];
        }
        r.lse[static_cast<std::size_t>(h) * q.total + q0 + i] = m + std::log(l);
      }
    }
  }
  return r;
}

BackwardResult attention_backward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                  const Tensor4& dout, const AttentionParams& params) {
  const double sm_scale = validate_attention_args("attention_backward", q, k, v, params);
  if (!dout.same_shape(q.b, q.h, q.n, v.d) ||
      dout.data.size() != static_cast<std::size_t>(q.b) * q.h * q.n * v.d) {
    throw std::invalid_argument("attention_backward: dout: shape must be O's, (B, Hq, Nq, d_v)");
  }
  const int group = q.h / k.h, d = q.d, dv = v.d;
  BackwardResult r{Tensor4d(q.b, q.h, q.n, d), Tensor4d(k.b, k.h, k.n, d),
                   Tensor4d(k.b, k.h, k.n, dv)};
  RowSoftmax sm;
  std::vector<double> dp(k.n);
  for (int b = 0; b < q.b; ++b) {
    for (int h = 0; h < q.h; ++h) {
      const int hkv = h / group;
      for (int i = 0; i < q.n; ++i) {
        const float* qrow = q.row(b, h, i);
        const float* dorow = dout.row(b, h, i);
        row_softmax(qrow, k, b, h, hkv, i, params, params.key_rule(b, q.n, k.n), sm_scale, sm);
        if (std::isinf(sm.lse) && sm.lse < 0) continue;  // sees nothing: zero gradients
        // dP_ij = dO_i . V_j;  D_i = sum_j P_ij dP_ij;  dS_ij = P_ij (dP_ij - D_i).
        double delta = 0.0;
        for (int j = 0; j < k.n; ++j) {
          if (sm.p[j] == 0.0) {
            dp[j] = 0.0;
            continue;
          }
          const float* vrow = v.row(b, hkv, j);
          double s = 0.0;
          for (int c = 0; c < dv; ++c) s += static_cast<double>(dorow[c]) * vrow[c];
          dp[j] = s;
          delta += sm.p[j] * s;
        }
        double* dqrow = r.dq.row(b, h, i);
        for (int j = 0; j < k.n; ++j) {
          const double pj = sm.p[j];
          if (pj == 0.0) continue;
          const double ds = pj * (dp[j] - delta) * sm_scale;
          const float* krow = k.row(b, hkv, j);
          double* dkrow = r.dk.row(b, hkv, j);
          double* dvrow = r.dv.row(b, hkv, j);
          for (int c = 0; c < d; ++c) {
            dqrow[c] += ds * krow[c];
            dkrow[c] += ds * qrow[c];
          }
          for (int c = 0; c < dv; ++c) dvrow[c] += pj * dorow[c];
        }
      }
    }
  }
  return r;
}

}  // namespace qattn::reference
