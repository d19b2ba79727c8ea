// Exact attention in FP64: the ground truth every scheme is measured against.
//
// Semantics follow torch.nn.functional.scaled_dot_product_attention (docs/design.md, API semantics):
// q (B, Hq, Nq, d), k (B, Hkv, Nkv, d) and v (B, Hkv, Nkv, d_v) with Hq a multiple of Hkv
// (query head h reads KV head h / (Hq / Hkv)); V's head dim d_v may differ from Q·K's d
// (MLA-style 192/128), O then being (B, Hq, Nq, d_v); sm_scale defaults to 1/sqrt(d); a causal mask is
// bottom-right aligned (query i sees key j iff j <= i + Nkv - Nq). A query row that
// sees no key gives O = 0, LSE = -inf and zero gradients. The inputs are float
// (every value is converted exactly); all arithmetic is double.
#pragma once

#include <vector>

#include "reference/tensor.h"
#include "reference/varlen.h"

namespace qattn::reference {

struct ForwardResult {
  Tensor4d o;               // (B, Hq, Nq, d_v)
  std::vector<double> lse;  // (B, Hq, Nq), natural log of sum_j exp(sm_scale * q.k_j)
};

struct BackwardResult {
  Tensor4d dq;  // (B, Hq, Nq, d)
  Tensor4d dk;  // (B, Hkv, Nkv, d), summed over the query heads of each KV group
  Tensor4d dv;  // (B, Hkv, Nkv, d_v), summed over the query heads of each KV group
};

// A packed variable-length forward (reference/varlen.h): O is (total_q, Hq, d_v) and the
// LSE (Hq, total_q), FlashAttention's varlen layout of it.
struct VarlenForwardResult {
  PackedTensord o;
  std::vector<double> lse;
};

// Throws std::invalid_argument (naming the parameter) on a bad shape or sm_scale.
ForwardResult attention_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params = {});

// The forward of a packed batch: each sequence b alone, with its own rule
// (params.key_rule of a call with Nq = len_q(b), Nkv = len_k(b); causal and the window
// bottom-right aligned unless params.alignment says top-left). Equals attention_forward
// on each sequence as a batch of one; a sequence without keys gives O = 0, LSE = -inf.
// Throws std::invalid_argument as validate_varlen_args does.
VarlenForwardResult attention_forward_varlen(const PackedTensor& q, const PackedTensor& k,
                                             const PackedTensor& v, const VarlenLayout& layout,
                                             const AttentionParams& params = {});

// Gradients of sum(O * dO) with respect to q, k, v. `dout` has O's shape, (B, Hq, Nq, d_v).
BackwardResult attention_backward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                  const Tensor4& dout, const AttentionParams& params = {});

}  // namespace qattn::reference
