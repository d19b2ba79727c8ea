// Which keys a query row sees: the causal mask, a sliding window around the diagonal and
// key padding, combined. Per row the visible keys are one interval [first, last], so a
// kernel skips the tiles outside it and tests elements only in the tiles that cut it.
// Host and device: the SA2 forward kernel, its CPU emulator and the FP64 reference all
// take the rule from here (tests/cpu/test_key_range.cpp checks it against the
// element-wise definition).
//
// Row i's diagonal key is i + offset: offset = Nkv - Nq when the diagonal is aligned
// bottom-right (qattn's default, a KV cache's), 0 when top-left (SDPA's is_causal).
// Query i sees key j iff
//   j < kv_len                        (key padding; kv_len = Nkv without it)
//   j <= i + offset + right           (right >= 0; causal is right = 0)
//   j >= i + offset - left            (left >= 0)
// where a negative left or right means no bound on that side.
#pragma once

#include <cstdint>

#include "numerics/hd.h"

namespace qattn::numerics {

struct KeyRange {
  int first, last;  // visible keys of a row: [first, last]; none when last < first
  QATTN_HD bool empty() const { return last < first; }
};

struct KeyRule {
  int offset;  // row i's diagonal key is i + offset
  int kv_len;  // keys from kv_len on are hidden (0 <= kv_len <= Nkv)
  int left;    // keys more than `left` before the diagonal are hidden; < 0: none are
  int right;   // keys more than `right` after the diagonal are hidden; < 0: none are

  QATTN_HD int first_key(int row) const {
    if (left < 0) return 0;
    const int f = row + offset - left;
    return f > 0 ? f : 0;
  }
  QATTN_HD int last_key(int row) const {
    const int l = kv_len - 1;
    if (right < 0) return l;
    const int r = row + offset + right;
    return r < l ? r : l;
  }
  QATTN_HD KeyRange keys(int row) const { return {first_key(row), last_key(row)}; }
  QATTN_HD bool visible(int row, int key) const {
    return key >= first_key(row) && key <= last_key(row);
  }
  // Whether the rule hides any key of a call whose rows are [0, seqlen_q) and keys
  // [0, seqlen_kv): the kernel then tests elements of the tiles that need it.
  QATTN_HD bool bounded() const { return left >= 0 || right >= 0; }
};

// The rule of a call: Nq and Nkv, causal, the diagonal's alignment, the window (negative
// = unbounded) and the key-padding length of the batch entry (clamped to [0, Nkv], as
// the kernel reads a caller's length). A window side at least max(Nq, Nkv) hides
// nothing and becomes unbounded, which keeps every sum of the rule inside int
// (seqlens <= 2^30).
QATTN_HD KeyRule make_key_rule(int seqlen_q, int seqlen_kv, bool causal, bool top_left,
                               int window_left, int window_right, int kv_len) {
  const int wide = seqlen_q > seqlen_kv ? seqlen_q : seqlen_kv;
  int right = window_right >= wide ? -1 : window_right;
  if (causal) right = 0;  // causal hides every key after the diagonal
  const int left = window_left >= wide ? -1 : window_left;
  const int len = kv_len < 0 ? 0 : (kv_len > seqlen_kv ? seqlen_kv : kv_len);
  return {top_left ? 0 : seqlen_kv - seqlen_q, len, left, right};
}

}  // namespace qattn::numerics
