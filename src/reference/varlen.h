// Packed variable-length batches (FlashAttention's flash_attn_varlen_func convention),
// shared by the FP64 reference, the emulators and the CPU tests.
//
// A batch of `batch` sequences is packed token after token: q is (total_q, Hq, d) and k,
// v are (total_k, Hkv, d), row-major with d fastest ("THD"). Sequence b owns the query
// tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 and the keys cu_seqlens_k[b] ..
// cu_seqlens_k[b+1] - 1; each array has batch + 1 entries, starts at 0, never decreases
// and ends at the total. max_seqlen_q and max_seqlen_k bound every length (a kernel
// sizes its grid with them); they may exceed the longest sequence, never fall below it.
//
// Every rule of a call applies per sequence, as if each were a call of its own with
// Nq = len_q(b) and Nkv = len_k(b): causal and the window are aligned bottom-right by
// default (row i's diagonal key is i + len_k(b) - len_q(b), FlashAttention's varlen
// rule) or top-left, and a quantized scheme quantizes each sequence alone (its K mean,
// scale groups, Q blocks and KV tiles never reach into another sequence). A sequence may
// be empty: len_q(b) = 0 has no output rows; len_k(b) = 0 with len_q(b) > 0 gives rows
// that see no key (O = 0, LSE = -inf), as every fully masked row does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/tensor.h"

namespace qattn {

// A dense (total, H, d) array of packed tokens, d fastest.
template <class T>
struct BasicPackedTensor {
  int total = 0, h = 0, d = 0;
  std::vector<T> data;

  BasicPackedTensor() = default;
  BasicPackedTensor(int tokens, int heads, int dim) : total(tokens), h(heads), d(dim) {
    if (tokens < 0 || heads < 0 || dim < 0)
      throw std::invalid_argument("PackedTensor: dimensions must be non-negative");
    data.assign(static_cast<std::size_t>(tokens) * heads * dim, T(0));
  }
  std::size_t size() const { return data.size(); }
  std::size_t index(int t, int ih, int id) const {
    return (static_cast<std::size_t>(t) * h + ih) * d + id;
  }
  T* row(int t, int ih) { return data.data() + index(t, ih, 0); }
  const T* row(int t, int ih) const { return data.data() + index(t, ih, 0); }
};

using PackedTensor = BasicPackedTensor<float>;
using PackedTensord = BasicPackedTensor<double>;

// The sequences of a packed batch (see the top of this file).
struct VarlenLayout {
  std::vector<int> cu_seqlens_q, cu_seqlens_k;  // batch + 1 entries each
  int max_seqlen_q = 0, max_seqlen_k = 0;

  int batch() const { return static_cast<int>(cu_seqlens_q.size()) - 1; }
  int q_start(int b) const { return cu_seqlens_q[b]; }
  int k_start(int b) const { return cu_seqlens_k[b]; }
  int len_q(int b) const { return cu_seqlens_q[b + 1] - cu_seqlens_q[b]; }
  int len_k(int b) const { return cu_seqlens_k[b + 1] - cu_seqlens_k[b]; }

  // A layout from per-sequence lengths, with the max lengths equal to the longest ones.
  static VarlenLayout from_lengths(const std::vector<int>& len_q, const std::vector<int>& len_k) {
    if (len_q.size() != len_k.size())
      throw std::invalid_argument("VarlenLayout::from_lengths: one length of each per sequence");
    VarlenLayout l;
    l.cu_seqlens_q.assign(1, 0);
    l.cu_seqlens_k.assign(1, 0);
    for (std::size_t b = 0; b < len_q.size(); ++b) {
      l.cu_seqlens_q.push_back(l.cu_seqlens_q.back() + len_q[b]);
      l.cu_seqlens_k.push_back(l.cu_seqlens_k.back() + len_k[b]);
      l.max_seqlen_q = std::max(l.max_seqlen_q, len_q[b]);
      l.max_seqlen_k = std::max(l.max_seqlen_k, len_k[b]);
    }
    return l;
  }
};

// Validates a packed call: the shapes (GQA: Hq a multiple of Hkv; d >= 1), the layout
// (each cu_seqlens array batch + 1 >= 2 entries, first 0, non-decreasing, last = the
// total; max lengths >= every length and >= 1) and the params (varlen takes causal, the
// alignment, the window and sm_scale; no kv_lengths, whose role cu_seqlens_k has, and
// no attn_mask). Throws std::invalid_argument naming the parameter; returns the resolved
// sm_scale (1/sqrt(d) by default).
inline double validate_varlen_args(const char* who, const PackedTensor& q, const PackedTensor& k,
                                   const PackedTensor& v, const VarlenLayout& layout,
                                   const AttentionParams& params) {
  auto fail = [who](const std::string& what) {
    throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (q.h <= 0 || q.d <= 0) fail("q: heads and head dim must be >= 1");
  if (k.h <= 0) fail("k: heads must be >= 1");
  if (k.d != q.d) fail("k: head dim must equal q's head dim");
  if (q.h % k.h != 0) fail("k: heads_kv must divide heads_q (GQA/MQA)");
  if (v.total != k.total || v.h != k.h || v.d <= 0)
    fail("v: shape must be (total_k, Hkv, d_v) with k's total_k and Hkv, d_v >= 1");
  for (const PackedTensor* t : {&q, &k, &v})
    if (t->data.size() != static_cast<std::size_t>(t->total) * t->h * t->d)
      fail("q/k/v: data size does not match the shape");
  const std::vector<int>* cus[2] = {&layout.cu_seqlens_q, &layout.cu_seqlens_k};
  const char* names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  const int totals[2] = {q.total, k.total};
  const int maxes[2] = {layout.max_seqlen_q, layout.max_seqlen_k};
  if (layout.cu_seqlens_q.size() < 2)
    fail("cu_seqlens_q: needs batch + 1 >= 2 entries (one sequence at least)");
  if (layout.cu_seqlens_k.size() != layout.cu_seqlens_q.size())
    fail("cu_seqlens_k: must have as many entries as cu_seqlens_q (batch + 1)");
  for (int a = 0; a < 2; ++a) {
    const std::vector<int>& cu = *cus[a];
    const std::string name = names[a];
    if (cu.front() != 0) fail(name + "[0] = " + std::to_string(cu.front()) + "; allowed: 0");
    int longest = 0;
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      if (cu[b + 1] < cu[b])
        fail(name + " decreases at entry " + std::to_string(b + 1) + " (" +
             std::to_string(cu[b]) + " then " + std::to_string(cu[b + 1]) +
             "); allowed: non-decreasing offsets");
      longest = std::max(longest, cu[b + 1] - cu[b]);
    }
    if (cu.back() != totals[a])
      fail(name + " ends at " + std::to_string(cu.back()) + " but the packed tensor has " +
           std::to_string(totals[a]) + " tokens; allowed: the last entry equals the total");
    const std::string max_name = a == 0 ? "max_seqlen_q" : "max_seqlen_k";
    if (maxes[a] < 1 || maxes[a] < longest)
      fail(max_name + " = " + std::to_string(maxes[a]) + " is below the longest sequence (" +
           std::to_string(longest) + ") or below 1; allowed: >= every length and >= 1");
  }
  if (params.window_left < -1 || params.window_right < -1)
    fail("window_left/window_right: must be >= -1 (-1: no bound)");
  if (!params.kv_lengths.empty())
    fail("kv_lengths: not taken with a packed batch (cu_seqlens_k gives each sequence's keys)");
  if (params.attn_mask.size() != 0) fail("attn_mask: not taken with a packed batch");
  if (params.sm_scale) {
    const double s = *params.sm_scale;
    if (!std::isfinite(s) || s == 0.0)
      fail("sm_scale: must be finite and non-zero (or empty for 1/sqrt(d))");
    return s;
  }
  return 1.0 / std::sqrt(static_cast<double>(q.d));
}

// The rows [start, start + len) of a packed tensor as a (1, H, len, d) Tensor4: one
// sequence as a batch of its own.
inline Tensor4 unpack_sequence(const PackedTensor& p, int start, int len) {
  Tensor4 t(1, p.h, len, p.d);
  for (int h = 0; h < p.h; ++h)
    for (int i = 0; i < len; ++i) std::copy_n(p.row(start + i, h), p.d, t.row(0, h, i));
  return t;
}

// Writes batch entry 0 of a (1, H, len, d) tensor into rows [start, start + len).
template <class T, class U>
void pack_sequence(const BasicTensor4<T>& t, int start, BasicPackedTensor<U>& p) {
  for (int h = 0; h < t.h; ++h)
    for (int i = 0; i < t.n; ++i)
      for (int c = 0; c < t.d; ++c) p.row(start + i, h)[c] = static_cast<U>(t.at(0, h, i, c));
}

}  // namespace qattn
