// Host tensors shared by the reference, the emulators, the CLI and the CPU tests.
//
// A Tensor4 is a dense (B, H, N, d) array, row-major with d fastest ("HND"), the
// layout the C ABI calls contiguous. Inputs and outputs are stored as float (the
// GPU reads fp16/bf16, both exact in float); the FP64 reference keeps double.
#pragma once

#include <cmath>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "numerics/key_range.h"

namespace qattn {

template <class T>
struct BasicTensor4 {
  int b = 0, h = 0, n = 0, d = 0;
  std::vector<T> data;

  BasicTensor4() = default;
  BasicTensor4(int batch, int heads, int tokens, int dim) : b(batch), h(heads), n(tokens), d(dim) {
    if (batch < 0 || heads < 0 || tokens < 0 || dim < 0) {
      throw std::invalid_argument("Tensor4: dimensions must be non-negative");
    }
    data.assign(static_cast<std::size_t>(batch) * heads * tokens * dim, T(0));
  }

  std::size_t size() const { return data.size(); }
  std::size_t index(int ib, int ih, int in, int id) const {
    return ((static_cast<std::size_t>(ib) * h + ih) * n + in) * d + id;
  }
  T& at(int ib, int ih, int in, int id) { return data[index(ib, ih, in, id)]; }
  const T& at(int ib, int ih, int in, int id) const { return data[index(ib, ih, in, id)]; }
  // Pointer to the d-long row of token `in` of head (ib, ih).
  T* row(int ib, int ih, int in) { return data.data() + index(ib, ih, in, 0); }
  const T* row(int ib, int ih, int in) const { return data.data() + index(ib, ih, in, 0); }
  bool same_shape(int batch, int heads, int tokens, int dim) const {
    return b == batch && h == heads && n == tokens && d == dim;
  }
};

using Tensor4 = BasicTensor4<float>;
using Tensor4d = BasicTensor4<double>;

// Causal masks are aligned to the bottom-right corner (FlashAttention >= 2.1, SDPA):
// query i sees key j iff j <= i + Nkv - Nq.
enum class Mask { None, Causal };

// Where the diagonal of the causal mask and of a sliding window sits when Nq != Nkv:
// row i's diagonal key is i + Nkv - Nq (BottomRight) or i (TopLeft, SDPA's is_causal).
enum class Diagonal { BottomRight, TopLeft };

// Parameters every scheme shares (docs/design.md, API semantics).
struct AttentionParams {
  Mask mask = Mask::None;
  std::optional<double> sm_scale;  // empty: 1/sqrt(d)
  // Masks beyond causal (numerics/key_range.h; the SA2 forward and the FP64 reference
  // take them, the other schemes reject them): the diagonal's alignment, a sliding
  // window (-1 = no bound on that side) and per-batch key-padding lengths (empty: none;
  // clamped to [0, Nkv] as the kernel does).
  Diagonal alignment = Diagonal::BottomRight;
  int window_left = -1, window_right = -1;
  std::vector<int> kv_lengths;
  // An additive mask, SDPA's attn_mask (a boolean one as 0 / -inf): (mb, mh, Nq, Nkv)
  // stored as a Tensor4 whose d is Nkv, mb in {1, B} and mh in {1, Hq} broadcast as SDPA
  // does; added to the scaled scores (natural-log units), -inf hides the key. Empty
  // (size 0): none. The SA2 emulator and the FP64 reference take it; no kernel yet. The
  // emulator adds it in FP32 log2 units, so values below -FLT_MAX / log2(e) (~-2.4e38,
  // e.g. float32's lowest, which some libraries use for padding) act as -inf there.
  Tensor4 attn_mask;

  // The mask's value for (b, h, i, j); 0 without one.
  float mask_at(int b, int h, int i, int j) const {
    if (attn_mask.size() == 0) return 0.0f;
    return attn_mask.at(attn_mask.b == 1 ? 0 : b, attn_mask.h == 1 ? 0 : h, i, j);
  }

  // Whether anything beyond the plain bottom-right causal mask (or none) is asked for.
  bool has_extended_mask() const {
    return alignment != Diagonal::BottomRight || window_left >= 0 || window_right >= 0 ||
           !kv_lengths.empty() || attn_mask.size() != 0;
  }
  // The rule of batch entry b (nq, nkv: the call's lengths).
  numerics::KeyRule key_rule(int b, int nq, int nkv) const {
    return numerics::make_key_rule(nq, nkv, mask == Mask::Causal,
                                   alignment == Diagonal::TopLeft, window_left, window_right,
                                   kv_lengths.empty() ? nkv : kv_lengths[b]);
  }
};

// True when query row i (of nq) may attend to key j (of nkv) under `mask`.
inline bool key_visible(Mask mask, int i, int j, int nq, int nkv) {
  return mask == Mask::None || static_cast<long long>(j) <= static_cast<long long>(i) + nkv - nq;
}

// For the schemes whose code takes one head dim for Q·K and V: throws unless d_v = d.
inline void require_equal_head_dims(const char* who, const Tensor4& q, const Tensor4& v) {
  if (v.d != q.d)
    throw std::invalid_argument(std::string(who) + ": v: head dim d_v = " + std::to_string(v.d) +
                                " must equal q's d = " + std::to_string(q.d) +
                                " in this scheme (only the SA2 emulator and the FP64 reference "
                                "take d_v != d)");
}

// Validates the q, k, v shapes (GQA: Hq a multiple of Hkv) and the params; throws
// std::invalid_argument naming the offending parameter. Returns the resolved sm_scale.
inline double validate_attention_args(const char* who, const Tensor4& q, const Tensor4& k,
                                      const Tensor4& v, const AttentionParams& params) {
  auto fail = [who](const std::string& what) {
    throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (q.b <= 0 || q.h <= 0 || q.n <= 0 || q.d <= 0) fail("q: every dimension must be >= 1");
  if (k.h <= 0 || k.n <= 0) fail("k: heads and tokens must be >= 1");
  if (k.b != q.b) fail("k: batch must equal q's batch");
  if (k.d != q.d) fail("k: head dim must equal q's head dim");
  if (q.h % k.h != 0) fail("k: heads_kv must divide heads_q (GQA/MQA)");
  // V may have its own head dim d_v (O is then (B, Hq, Nq, d_v); MLA-style 192/128).
  if (v.b != k.b || v.h != k.h || v.n != k.n || v.d <= 0)
    fail("v: shape must be (B, Hkv, Nkv, d_v) with k's B, Hkv, Nkv and d_v >= 1");
  for (const Tensor4* t : {&q, &k, &v}) {
    if (t->data.size() != static_cast<std::size_t>(t->b) * t->h * t->n * t->d) {
      fail("q/k/v: data size does not match the shape");
    }
  }
  if (params.window_left < -1 || params.window_right < -1)
    fail("window_left/window_right: must be >= -1 (-1: no bound)");
  if (!params.kv_lengths.empty() && params.kv_lengths.size() != static_cast<std::size_t>(q.b))
    fail("kv_lengths: must hold one length per batch entry (or none)");
  if (const Tensor4& m = params.attn_mask; m.size() != 0) {
    if ((m.b != 1 && m.b != q.b) || (m.h != 1 && m.h != q.h) || m.n != q.n || m.d != k.n)
      fail("attn_mask: shape must be (1 or B, 1 or Hq, Nq, Nkv)");
    if (m.data.size() != static_cast<std::size_t>(m.b) * m.h * m.n * m.d)
      fail("attn_mask: data size does not match the shape");
  }
  if (params.sm_scale) {
    const double s = *params.sm_scale;
    if (!std::isfinite(s) || s == 0.0) {
      fail("sm_scale: must be finite and non-zero (or empty for 1/sqrt(d))");
    }
    return s;
  }
  return 1.0 / std::sqrt(static_cast<double>(q.d));
}

// For the schemes that take only Mask::None / Mask::Causal bottom-right: throws
// std::invalid_argument when params ask for more.
inline void require_plain_mask(const char* who, const AttentionParams& params) {
  if (params.has_extended_mask())
    throw std::invalid_argument(std::string(who) +
                                ": alignment, window and kv_lengths: this scheme takes only "
                                "Mask::None or Mask::Causal aligned bottom-right");
}

}  // namespace qattn
