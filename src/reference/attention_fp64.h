// Exact attention in FP64: the ground truth every scheme is measured against.
//
// Semantics follow torch.nn.functional.scaled_dot_product_attention (docs/design.md, API semantics):
// q (B, Hq, Nq, d), k and v (B, Hkv, Nkv, d) with Hq a multiple of Hkv (query head h
// reads KV head h / (Hq / Hkv)); sm_scale defaults to 1/sqrt(d); a causal mask is
// bottom-right aligned (query i sees key j iff j <= i + Nkv - Nq). A query row that
// sees no key gives O = 0, LSE = -inf and zero gradients. The inputs are float
// (every value is converted exactly); all arithmetic is double.
#pragma once

#include <vector>

#include "reference/tensor.h"

namespace qattn::reference {

struct ForwardResult {
  Tensor4d o;               // (B, Hq, Nq, d)
  std::vector<double> lse;  // (B, Hq, Nq), natural log of sum_j exp(sm_scale * q.k_j)
};

struct BackwardResult {
  Tensor4d dq;  // (B, Hq, Nq, d)
  Tensor4d dk;  // (B, Hkv, Nkv, d), summed over the query heads of each KV group
  Tensor4d dv;  // (B, Hkv, Nkv, d), summed over the query heads of each KV group
};

// Throws std::invalid_argument (naming the parameter) on a bad shape or sm_scale.
ForwardResult attention_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params = {});

// Gradients of sum(O * dO) with respect to q, k, v. `dout` has q's shape.
BackwardResult attention_backward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                  const Tensor4& dout, const AttentionParams& params = {});

}  // namespace qattn::reference
