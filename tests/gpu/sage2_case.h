// One SageAttention2-8b forward case on the GPU: inputs in a chosen memory layout with
// poisoned row padding, a poisoned output with guard columns, a poisoned LSE with guard
// regions, and the FP64 reference to compare with.
#pragma once

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "cuda/sage2_fwd/launch.h"
#include "cuda/sage2_fwd/workspace.h"
#include "cuda/sage2_wide/launch.h"
#include "emulate/sage2.h"
#include "gpu_util.h"
#include "qattn/qattn.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "tolerances.h"

namespace qattn::test {

enum class Layout { HND, NHD };

// The reference's and the emulator's form of a call's key rule: causal (either
// alignment) and a sliding window.
inline AttentionParams key_rule_params(bool causal, bool top_left, int window_left,
                                       int window_right) {
  AttentionParams ap;
  ap.mask = causal ? Mask::Causal : Mask::None;
  ap.alignment = top_left ? Diagonal::TopLeft : Diagonal::BottomRight;
  ap.window_left = window_left;
  ap.window_right = window_right;
  return ap;
}

struct Sage2Case {
  int batch = 1, heads_q = 2, heads_kv = 2, seqlen_q = 256, seqlen_kv = 256, head_dim = 128;
  int head_dim_v = 0;  // V's and O's head dim (qattn_fwd_params.head_dim_v); 0: head_dim
  int dv() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  bool causal = false, bf16 = true;
  Layout layout = Layout::HND;
  qattn_qk_granularity granularity = QATTN_QK_PER_THREAD;
  uint64_t seed = 1;
  float k_bias = 1.0f;  // per-channel bias on K (what smoothing removes)
  // Extra elements (a multiple of 8) after each row of q; k and v get 2x and 3x, so a
  // kernel that uses one tensor's stride for another reads the wrong rows.
  int row_pad = 0;
  // Also write the kernel's shared-memory Q quantization (INT8 Q, scales, q·c) to the
  // workspace, to compare with the emulation (production calls keep it on chip).
  bool keep_q = false;
  // Launches on one workspace: after the forward, each further one poisons O and the LSE
  // again and runs the attention kernel alone (its work counters must be back at zero,
  // or items are skipped and their rows stay poisoned). The result is the last one.
  int launches = 1;
  bool lse = true;  // ask for the LSE (without it the LSE buffer stays poisoned)
  // The attention kernel's register split (launch.h): the launch's choice, or forced.
  sage2::RegisterSplit split = sage2::RegisterSplit::kAuto;
  // Run the head-dim-256 family's launch (cuda/sage2_wide/launch.h; head dims 129..256,
  // its workspace always holds the quantized Q) instead of the SA2-8b forward's.
  bool wide = false;
  // Masks beyond causal (qattn.h): a sliding window (-1: no bound), the diagonal's
  // alignment, and per-batch key-padding lengths (empty: none; uploaded to the device).
  int window_left = -1, window_right = -1;
  bool top_left = false;
  std::vector<int> kv_lengths;
  // A boolean attn_mask (qattn.h), bytes of shape (mask_b, mask_h, mask_q, Nkv), each of
  // the three 1 (broadcast: stride 0) or the full extent; empty: none.
  std::vector<uint8_t> bool_mask;
  // An additive attn_mask (QATTN_MASK_ADDITIVE): values in the call's dtype (bits), of the
  // same shape rules; empty: none. (At most one of the two is set.)
  std::vector<uint16_t> add_mask;
  int mask_b = 1, mask_h = 1, mask_q = 1;
  std::size_t mask_index(int b, int h, int i, int j) const {
    return ((static_cast<std::size_t>(mask_b == 1 ? 0 : b) * mask_h + (mask_h == 1 ? 0 : h)) *
                mask_q + (mask_q == 1 ? 0 : i)) * seqlen_kv + j;
  }
  uint8_t mask_at(int b, int h, int i, int j) const {
    const std::size_t at = ((static_cast<std::size_t>(mask_b == 1 ? 0 : b) * mask_h +
                             (mask_h == 1 ? 0 : h)) * mask_q + (mask_q == 1 ? 0 : i)) * seqlen_kv + j;
    return bool_mask[at];
  }

  std::string describe() const {
    return "B=" + std::to_string(batch) + " Hq=" + std::to_string(heads_q) +
           " Hkv=" + std::to_string(heads_kv) + " Nq=" + std::to_string(seqlen_q) +
           " Nkv=" + std::to_string(seqlen_kv) + " d=" + std::to_string(head_dim) +
           (head_dim_v > 0 ? " d_v=" + std::to_string(head_dim_v) : std::string()) +
           (causal ? " causal" : "") + (bf16 ? " bf16" : " fp16") +
           (layout == Layout::NHD ? " NHD" : " HND") + " row_pad=" + std::to_string(row_pad) +
           " seed=" + std::to_string(seed) + masks() + (wide ? " wide" : "");
  }
  std::string masks() const {
    std::string m;
    if (window_left >= 0 || window_right >= 0)
      m += " window=(" + std::to_string(window_left) + "," + std::to_string(window_right) + ")";
    if (top_left) m += " top_left";
    if (!kv_lengths.empty()) {
      m += " kv_lengths=";
      for (int l : kv_lengths) m += std::to_string(l) + ",";
    }
    if (!bool_mask.empty())
      m += " bool_mask=(" + std::to_string(mask_b) + "," + std::to_string(mask_h) + "," +
           std::to_string(mask_q) + "," + std::to_string(seqlen_kv) + ")";
    if (!add_mask.empty())
      m += " add_mask=(" + std::to_string(mask_b) + "," + std::to_string(mask_h) + "," +
           std::to_string(mask_q) + "," + std::to_string(seqlen_kv) + ")";
    return m;
  }
  // The same masks for the reference and the emulator.
  AttentionParams attention_params() const {
    AttentionParams ap = key_rule_params(causal, top_left, window_left, window_right);
    ap.kv_lengths = kv_lengths;
    if (!bool_mask.empty()) {  // the reference's form: additive 0 / -inf, rows expanded
      ap.attn_mask = Tensor4(mask_b, mask_h, seqlen_q, seqlen_kv);
      for (int b = 0; b < mask_b; ++b)
        for (int h = 0; h < mask_h; ++h)
          for (int i = 0; i < seqlen_q; ++i)
            for (int j = 0; j < seqlen_kv; ++j)
              ap.attn_mask.at(b, h, i, j) = mask_at(b, h, i, j) ? 0.f : -INFINITY;
    }
    if (!add_mask.empty()) {  // the values as the kernel reads them
      ap.attn_mask = Tensor4(mask_b, mask_h, seqlen_q, seqlen_kv);
      for (int b = 0; b < mask_b; ++b)
        for (int h = 0; h < mask_h; ++h)
          for (int i = 0; i < seqlen_q; ++i)
            for (int j = 0; j < seqlen_kv; ++j)
              ap.attn_mask.at(b, h, i, j) = from_bits16(add_mask[mask_index(b, h, i, j)], bf16);
    }
    return ap;
  }
};

struct Sage2Result {
  Tensor4 q, k, v;         // the inputs as the GPU saw them (16-bit values)
  Tensor4 o;               // GPU output
  std::vector<float> lse;  // GPU LSE
  std::vector<uint8_t> workspace;
  bool guard_intact = true;      // nothing written outside the output's rows
  bool lse_guard_intact = true;  // nothing written before or after the LSE
  bool all_written = true;       // no poisoned element left
  int status = 0;
};

// Strides (in elements) of a (B, H, N, d) tensor whose rows are `row` elements apart
// in the given layout.
inline qattn_tensor make_view(void* data, Layout layout, int b, int h, int n, int row) {
  (void)b;
  qattn_tensor t{data, 0, 0, 0};
  if (layout == Layout::HND) {
    t.stride_n = row;
    t.stride_h = static_cast<int64_t>(n) * row;
    t.stride_b = t.stride_h * h;
  } else {
    t.stride_h = row;
    t.stride_n = static_cast<int64_t>(h) * row;
    t.stride_b = t.stride_n * n;
  }
  return t;
}

inline Tensor4 random_tensor(int b, int h, int n, int d, std::mt19937_64& rng, float bias,
                             bool bf16) {
  Tensor4 t(b, h, n, d);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> channel_bias(d);
  for (auto& c : channel_bias) c = bias * normal(rng);
  for (int ib = 0; ib < b; ++ib)
    for (int ih = 0; ih < h; ++ih)
      for (int in = 0; in < n; ++in)
        for (int id = 0; id < d; ++id) {
          const float x = normal(rng) + channel_bias[id];
          t.at(ib, ih, in, id) = from_bits16(to_bits16(x, bf16), bf16);
        }
  return t;
}

// The case's parameters, from qattn_fwd_params_init's defaults (so a public qattn_fwd
// call takes them as they are: struct size and scheme set).
inline qattn_fwd_params make_params(const Sage2Case& c) {
  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
  p.batch = c.batch;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_kv = c.seqlen_kv;
  p.head_dim = c.head_dim;
  p.head_dim_v = c.head_dim_v;
  p.causal = c.causal ? 1 : 0;
  p.sm_scale = 0.f;
  p.sage2.granularity = c.granularity;
  p.window = c.window_left >= 0 || c.window_right >= 0 ? 1 : 0;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.alignment = c.top_left ? QATTN_ALIGN_TOP_LEFT : QATTN_ALIGN_BOTTOM_RIGHT;
  if (!c.bool_mask.empty()) {  // the data pointer is the device copy's (run_sage2)
    p.attn_mask_type = QATTN_MASK_BOOL;
    p.attn_mask_stride_k = 1;
    p.attn_mask_stride_q = c.mask_q == 1 ? 0 : c.seqlen_kv;
    p.attn_mask_stride_h = c.mask_h == 1 ? 0 : int64_t{c.mask_q} * c.seqlen_kv;
    p.attn_mask_stride_b = c.mask_b == 1 ? 0 : int64_t{c.mask_h} * c.mask_q * c.seqlen_kv;
  }
  if (!c.add_mask.empty()) {  // bytes: two per value, keys contiguous
    p.attn_mask_type = QATTN_MASK_ADDITIVE;
    p.attn_mask_stride_k = 2;
    p.attn_mask_stride_q = c.mask_q == 1 ? 0 : 2 * int64_t{c.seqlen_kv};
    p.attn_mask_stride_h = c.mask_h == 1 ? 0 : 2 * int64_t{c.mask_q} * c.seqlen_kv;
    p.attn_mask_stride_b = c.mask_b == 1 ? 0 : 2 * int64_t{c.mask_h} * c.mask_q * c.seqlen_kv;
  }
  return p;
}

// Bits the library must never use: the input columns past head_dim and the memory
// around the outputs. All are NaN in fp16 and bf16, so a use shows up as NaN in O; the
// input poison differs from the output's so an unwritten element tells itself apart.
inline constexpr uint16_t kInputPoison = 0x7FFF;
inline constexpr uint16_t kOutputPoison = 0xFFFF;
inline constexpr uint32_t kLsePoison = 0xFFFFFFFFu;
inline constexpr std::size_t kLseGuard = 64;  // floats before and after the LSE

// Lets a test edit the generated inputs (e.g. plant a NaN) before they are uploaded.
using InputHook = std::function<void(Tensor4& q, Tensor4& k, Tensor4& v)>;

// Runs the case through sage2::launch_forward (the kernel entry the C ABI calls).
inline Sage2Result run_sage2(const Sage2Case& c, const InputHook& hook = {}) {
  Sage2Result r;
  std::mt19937_64 rng(c.seed);
  r.q = random_tensor(c.batch, c.heads_q, c.seqlen_q, c.head_dim, rng, 0.2f * c.k_bias, c.bf16);
  r.k = random_tensor(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim, rng, c.k_bias, c.bf16);
  r.v = random_tensor(c.batch, c.heads_kv, c.seqlen_kv, c.dv(), rng, 0.f, c.bf16);
  if (hook) hook(r.q, r.k, r.v);

  const int row = (c.head_dim + 7) / 8 * 8;  // 16-byte rows
  const int row_v = (c.dv() + 7) / 8 * 8;    // V's and O's
  const int q_row = row + c.row_pad, k_row = row + 2 * c.row_pad, v_row = row_v + 3 * c.row_pad;
  const int o_row = row_v + 8;  // guard columns after every output row
  auto upload = [&](const Tensor4& t, int rowlen) {
    std::vector<uint16_t> h(static_cast<std::size_t>(t.b) * t.h * t.n * rowlen, kInputPoison);
    const qattn_tensor v = make_view(nullptr, c.layout, t.b, t.h, t.n, rowlen);
    for (int ib = 0; ib < t.b; ++ib)
      for (int ih = 0; ih < t.h; ++ih)
        for (int in = 0; in < t.n; ++in)
          for (int id = 0; id < t.d; ++id)
            h[ib * v.stride_b + ih * v.stride_h + in * v.stride_n + id] =
                to_bits16(t.at(ib, ih, in, id), c.bf16);
    return h;
  };
  const auto hq = upload(r.q, q_row), hk = upload(r.k, k_row), hv = upload(r.v, v_row);
  DeviceBuffer<uint16_t> dq(hq.size()), dk(hk.size()), dv(hv.size());
  dq.upload(hq);
  dk.upload(hk);
  dv.upload(hv);
  const std::size_t o_count = static_cast<std::size_t>(c.batch) * c.heads_q * c.seqlen_q * o_row;
  DeviceBuffer<uint16_t> dout(o_count);
  static_assert(kOutputPoison == 0xFFFF && kLsePoison == 0xFFFFFFFFu, "memset with 0xFF below");
  cudaMemset(dout.ptr, 0xFF, o_count * sizeof(uint16_t));
  const std::size_t lse_count = static_cast<std::size_t>(c.batch) * c.heads_q * c.seqlen_q;
  DeviceBuffer<float> dlse(kLseGuard + lse_count + kLseGuard);
  cudaMemset(dlse.ptr, 0xFF, dlse.count * sizeof(float));

  qattn_fwd_params p = make_params(c);
  p.q = make_view(dq.ptr, c.layout, c.batch, c.heads_q, c.seqlen_q, q_row);
  p.k = make_view(dk.ptr, c.layout, c.batch, c.heads_kv, c.seqlen_kv, k_row);
  p.v = make_view(dv.ptr, c.layout, c.batch, c.heads_kv, c.seqlen_kv, v_row);
  p.o = make_view(dout.ptr, c.layout, c.batch, c.heads_q, c.seqlen_q, o_row);
  p.lse = c.lse ? dlse.ptr + kLseGuard : nullptr;
  DeviceBuffer<int32_t> dlens(std::max<std::size_t>(c.kv_lengths.size(), 1));
  if (!c.kv_lengths.empty()) {
    dlens.upload(std::vector<int32_t>(c.kv_lengths.begin(), c.kv_lengths.end()));
    p.kv_lengths = dlens.ptr;
  }
  DeviceBuffer<uint8_t> dmask(std::max<std::size_t>(c.bool_mask.size(), 1));
  if (!c.bool_mask.empty()) {
    dmask.upload(c.bool_mask);
    p.attn_mask = dmask.ptr;
  }
  DeviceBuffer<uint16_t> dadd(std::max<std::size_t>(c.add_mask.size(), 1));
  if (!c.add_mask.empty()) {
    dadd.upload(c.add_mask);
    p.attn_mask = dadd.ptr;
  }
  const std::size_t ws_bytes =
      c.wide ? sage2_wide::workspace_bytes(p) : sage2::workspace_bytes(p, c.keep_q);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  // A caller's workspace holds anything: the forward must zero what it counts on (V's
  // overflow report, the work counters) itself; there is no memset (bench/NOTES.md, v17a).
  cudaMemset(ws.ptr, 0xFF, ws_bytes);
  for (int launch = 0; launch < c.launches; ++launch) {
    if (launch > 0) {
      cudaMemset(dout.ptr, 0xFF, o_count * sizeof(uint16_t));
      cudaMemset(dlse.ptr, 0xFF, dlse.count * sizeof(float));
    }
    if (c.wide)
      r.status = launch == 0 ? sage2_wide::launch_forward(p, ws.ptr, nullptr)
                             : sage2_wide::launch_attention_only(p, ws.ptr, nullptr);
    else
      r.status = launch == 0 ? sage2::launch_forward(p, ws.ptr, nullptr, c.keep_q, c.split)
                             : sage2::launch_attention_only(p, ws.ptr, nullptr);
    if (r.status != 0) return r;
    if (cudaDeviceSynchronize() != cudaSuccess) {
      r.status = static_cast<int>(cudaGetLastError());
      return r;
    }
  }
  r.workspace = ws.download();
  r.workspace.resize(ws_bytes);
  const auto ho = dout.download();
  const auto lse_all = dlse.download();
  for (std::size_t i = 0; i < lse_all.size(); ++i)
    if ((i < kLseGuard || i >= kLseGuard + lse_count) &&
        std::bit_cast<uint32_t>(lse_all[i]) != kLsePoison)
      r.lse_guard_intact = false;
  r.lse.assign(lse_all.begin() + kLseGuard, lse_all.begin() + kLseGuard + lse_count);
  r.o = Tensor4(c.batch, c.heads_q, c.seqlen_q, c.dv());
  for (int ib = 0; ib < c.batch; ++ib)
    for (int ih = 0; ih < c.heads_q; ++ih)
      for (int in = 0; in < c.seqlen_q; ++in)
        for (int id = 0; id < o_row; ++id) {
          const uint16_t bits = ho[ib * p.o.stride_b + ih * p.o.stride_h + in * p.o.stride_n + id];
          if (id < c.dv()) {
            const float x = from_bits16(bits, c.bf16);
            if (bits == kOutputPoison) r.all_written = false;
            r.o.at(ib, ih, in, id) = x;
          } else if (bits != kOutputPoison) {
            r.guard_intact = false;
          }
        }
  for (float x : c.lse ? r.lse : std::vector<float>{})
    if (std::bit_cast<uint32_t>(x) == kLsePoison) r.all_written = false;
  return r;
}

// V's part of a forward's workspace against the emulation: the kernels keep D rows of Vᵀ
// codes and D amax values per KV head (channels past d_v hold zeros), the emulator Dv of
// each (its own padding of d_v). "" when equal, else the first difference.
inline std::string v_workspace_differences(const std::vector<uint8_t>& ws, std::size_t vt_at,
                                           std::size_t amax_at, std::size_t bkv, int D,
                                           const emulate::Sage2Quantized& qz) {
  const int Dv = qz.head_dim_v_padded;
  const std::size_t nkv = static_cast<std::size_t>(qz.nkv_pad);
  for (std::size_t h = 0; h < bkv; ++h)
    for (int d = 0; d < D; ++d) {
      float amax;
      std::memcpy(&amax, ws.data() + amax_at + (h * D + d) * sizeof(float), sizeof(float));
      const float want = d < Dv ? qz.v_scale[(h * qz.kv_tiles()) * Dv + d] : 0.f;
      if (amax / 448.f != want)
        return "v scale h=" + std::to_string(h) + " d=" + std::to_string(d) + ": " +
               std::to_string(amax / 448.f) + " != " + std::to_string(want);
      const uint8_t* row = ws.data() + vt_at + (h * D + d) * nkv;
      for (std::size_t t = 0; t < nkv; ++t) {
        const uint8_t e = d < Dv ? qz.vt_f8[(h * Dv + d) * nkv + t] : 0;
        if (row[t] != e)
          return "vt_f8 h=" + std::to_string(h) + " d=" + std::to_string(d) + " token " +
                 std::to_string(t) + ": " + std::to_string(row[t]) + " != " + std::to_string(e);
      }
    }
  return "";
}

}  // namespace qattn::test
