// The SA2-8b forward over a packed variable-length batch (qattn.h, cu_seqlens) on the
// GPU, through the C ABI: bit-equal to one dense call per sequence on the same inputs
// (the same kernel arithmetic, so each sequence is quantized and attended exactly as a
// call of its own), and against the CPU emulation and the FP64 reference of the pack.
// Outputs are poisoned with guard rows after them; offsets that lie (decreasing, past
// the totals) must give no write outside the buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/sage2_fwd/launch.h"
#include "cuda/sage2_fwd/workspace.h"
#include "emulate/sage2.h"
#include "numerics/sm_scale.h"
#include "gpu_util.h"
#include "qattn/qattn.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "sage2_case.h"
#include "tolerances.h"

namespace {

using namespace qattn;
using test::DeviceBuffer;

struct VarlenCase {
  std::vector<int> len_q, len_k;
  int heads_q = 4, heads_kv = 2, head_dim = 128;
  bool causal = false, bf16 = true, top_left = false;
  int window_left = -1, window_right = -1;
  uint64_t seed = 1;

  std::string describe() const {
    std::string s = "Hq=" + std::to_string(heads_q) + " Hkv=" + std::to_string(heads_kv) +
                    " d=" + std::to_string(head_dim) + (causal ? " causal" : "") +
                    (bf16 ? " bf16" : " fp16") + (top_left ? " top_left" : "") +
                    " window=(" + std::to_string(window_left) + "," +
                    std::to_string(window_right) + ") seed=" + std::to_string(seed) + " lengths=";
    for (std::size_t b = 0; b < len_q.size(); ++b)
      s += std::to_string(len_q[b]) + "/" + std::to_string(len_k[b]) + ",";
    return s;
  }
  VarlenLayout layout() const { return VarlenLayout::from_lengths(len_q, len_k); }
  AttentionParams attention_params() const {
    return test::key_rule_params(causal, top_left, window_left, window_right);
  }
};

constexpr int kGuardRows = 3;  // poisoned rows after the packed O

struct VarlenRun {
  PackedTensor q, k, v;      // the inputs as the GPU saw them
  std::vector<uint16_t> o;   // (total_q + kGuardRows, Hq, row) bits
  std::vector<float> lse;    // kLseGuard + Hq·total_q + kLseGuard
  std::vector<uint16_t> o_dense;  // one dense call per sequence, same layout
  std::vector<float> lse_dense;
  std::vector<uint8_t> workspace;
  int status = 0;
};

int padded_row(int d) { return (d + 7) / 8 * 8; }

PackedTensor random_packed(int total, int heads, int d, float bias, bool bf16,
                           std::mt19937_64& rng) {
  PackedTensor t(total, heads, d);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> channel(d);
  for (auto& c : channel) c = bias * normal(rng);
  for (int i = 0; i < total; ++i)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c)
        t.row(i, h)[c] = test::from_bits16(test::to_bits16(normal(rng) + channel[c], bf16), bf16);
  return t;
}

std::vector<uint16_t> to_device_layout(const PackedTensor& t, bool bf16) {
  const int row = padded_row(t.d);
  std::vector<uint16_t> h(static_cast<std::size_t>(t.total) * t.h * row, test::kInputPoison);
  for (int i = 0; i < t.total; ++i)
    for (int ih = 0; ih < t.h; ++ih)
      for (int c = 0; c < t.d; ++c)
        h[(static_cast<std::size_t>(i) * t.h + ih) * row + c] = test::to_bits16(t.row(i, ih)[c], bf16);
  return h;
}

qattn_tensor packed_view(void* data, int heads, int d) {
  const int row = padded_row(d);
  return qattn_tensor{data, 0, row, static_cast<int64_t>(heads) * row};
}

// Runs the pack through qattn_fwd; with `dense`, also each sequence alone through the
// dense kernel in the varlen kernel's shape (240 registers, no FMA-pipe exps), into
// o_dense / lse_dense. `cu_q`/`cu_k`, when given, replace the layout's offsets on the
// device (a caller's bad arrays).
VarlenRun run_varlen(const VarlenCase& c, bool dense, const std::vector<int>* cu_q = nullptr,
                     const std::vector<int>* cu_k = nullptr) {
  VarlenRun r;
  const VarlenLayout lay = c.layout();
  const int B = lay.batch(), total_q = lay.cu_seqlens_q.back(), total_k = lay.cu_seqlens_k.back();
  std::mt19937_64 rng(c.seed);
  r.q = random_packed(total_q, c.heads_q, c.head_dim, 0.2f, c.bf16, rng);
  r.k = random_packed(total_k, c.heads_kv, c.head_dim, 1.0f, c.bf16, rng);
  r.v = random_packed(total_k, c.heads_kv, c.head_dim, 0.f, c.bf16, rng);
  const int row = padded_row(c.head_dim);
  DeviceBuffer<uint16_t> dq(static_cast<std::size_t>(total_q) * c.heads_q * row),
      dk(static_cast<std::size_t>(total_k) * c.heads_kv * row),
      dv(static_cast<std::size_t>(total_k) * c.heads_kv * row);
  dq.upload(to_device_layout(r.q, c.bf16));
  dk.upload(to_device_layout(r.k, c.bf16));
  dv.upload(to_device_layout(r.v, c.bf16));
  const std::size_t o_elems = static_cast<std::size_t>(total_q + kGuardRows) * c.heads_q * row;
  const std::size_t lse_elems = 2 * test::kLseGuard + static_cast<std::size_t>(c.heads_q) * total_q;
  DeviceBuffer<uint16_t> dout(o_elems);
  DeviceBuffer<float> dlse(lse_elems);
  const std::vector<uint16_t> o_poison(o_elems, test::kOutputPoison);
  std::vector<float> lse_poison(lse_elems);
  for (auto& x : lse_poison) std::memcpy(&x, &test::kLsePoison, sizeof(x));
  dout.upload(o_poison);
  dlse.upload(lse_poison);
  DeviceBuffer<int> dcu_q(B + 1), dcu_k(B + 1);
  dcu_q.upload(cu_q != nullptr ? *cu_q : lay.cu_seqlens_q);
  dcu_k.upload(cu_k != nullptr ? *cu_k : lay.cu_seqlens_k);

  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
  p.batch = B;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.seqlen_q = total_q;
  p.seqlen_kv = total_k;
  p.head_dim = c.head_dim;
  p.causal = c.causal ? 1 : 0;
  p.window = c.window_left >= 0 || c.window_right >= 0 ? 1 : 0;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.alignment = c.top_left ? QATTN_ALIGN_TOP_LEFT : QATTN_ALIGN_BOTTOM_RIGHT;
  p.q = packed_view(dq.ptr, c.heads_q, c.head_dim);
  p.k = packed_view(dk.ptr, c.heads_kv, c.head_dim);
  p.v = packed_view(dv.ptr, c.heads_kv, c.head_dim);
  p.o = packed_view(dout.ptr, c.heads_q, c.head_dim);
  p.lse = dlse.ptr + test::kLseGuard;
  p.cu_seqlens_q = dcu_q.ptr;
  p.cu_seqlens_k = dcu_k.ptr;
  p.max_seqlen_q = std::max(1, lay.max_seqlen_q);
  p.max_seqlen_k = std::max(1, lay.max_seqlen_k);
  std::size_t bytes = 0;
  if (qattn_status s = qattn_fwd_workspace_size(&p, &bytes); s != QATTN_OK) {
    r.status = s;
    ADD_FAILURE() << "workspace size: " << qattn_last_error_message();
    return r;
  }
  DeviceBuffer<uint8_t> ws(bytes);
  r.status = qattn_fwd(&p, ws.ptr, bytes, nullptr);
  if (r.status != QATTN_OK) {
    ADD_FAILURE() << qattn_last_error_message();
    return r;
  }
  if (cudaDeviceSynchronize() != cudaSuccess) {
    r.status = -1;
    return r;
  }
  r.o = dout.download();
  r.lse = dlse.download();
  r.workspace = ws.download();
  if (!dense) return r;

  // One dense call per sequence (batch 1) on views of the same buffers.
  dout.upload(o_poison);
  dlse.upload(lse_poison);
  for (int b = 0; b < B; ++b) {
    const int lq = lay.len_q(b), lk = lay.len_k(b);
    if (lq == 0 || lk == 0) continue;
    qattn_fwd_params d = p;
    d.batch = 1;
    d.seqlen_q = lq;
    d.seqlen_kv = lk;
    d.cu_seqlens_q = d.cu_seqlens_k = nullptr;
    d.max_seqlen_q = d.max_seqlen_k = 0;
    d.q.data = dq.ptr + static_cast<std::size_t>(lay.q_start(b)) * c.heads_q * row;
    d.k.data = dk.ptr + static_cast<std::size_t>(lay.k_start(b)) * c.heads_kv * row;
    d.v.data = dv.ptr + static_cast<std::size_t>(lay.k_start(b)) * c.heads_kv * row;
    d.o.data = dout.ptr + static_cast<std::size_t>(lay.q_start(b)) * c.heads_q * row;
    DeviceBuffer<float> lse_b(static_cast<std::size_t>(c.heads_q) * lq);
    d.lse = lse_b.ptr;
    d.sm_scale = numerics::default_sm_scale(c.head_dim);  // the varlen call's default
    DeviceBuffer<uint8_t> ws_b(sage2::workspace_bytes(d));
    r.status = sage2::launch_forward(d, ws_b.ptr, nullptr, false, sage2::RegisterSplit::kConsumers240);
    if (r.status != 0 || cudaDeviceSynchronize() != cudaSuccess) {
      r.status = r.status != 0 ? r.status : -1;
      return r;
    }
    const auto part = lse_b.download();
    std::vector<float> all = r.lse_dense.empty() ? lse_poison : r.lse_dense;
    for (int h = 0; h < c.heads_q; ++h)
      for (int i = 0; i < lq; ++i)
        all[test::kLseGuard + static_cast<std::size_t>(h) * total_q + lay.q_start(b) + i] =
            part[static_cast<std::size_t>(h) * lq + i];
    r.lse_dense = std::move(all);
  }
  r.o_dense = dout.download();
  if (r.lse_dense.empty()) r.lse_dense = lse_poison;
  return r;
}

const test::Tolerances& bounds() { return test::tolerances("sage2_8b"); }

bool is_poison(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b == test::kLsePoison;
}

void check_pack(const VarlenCase& c) {
  SCOPED_TRACE(c.describe());
  const VarlenRun r = run_varlen(c, /*dense=*/true);
  ASSERT_EQ(r.status, 0);
  const VarlenLayout lay = c.layout();
  const int total_q = lay.cu_seqlens_q.back(), row = padded_row(c.head_dim);
  const bool bf16 = c.bf16;

  // 1. Every element of O inside the rows and columns written, nothing after them; the
  // padding columns and guard rows untouched; the LSE between its guards.
  PackedTensor o(total_q, c.heads_q, c.head_dim);
  for (std::size_t i = 0; i < r.o.size(); ++i) {
    const std::size_t t = i / (static_cast<std::size_t>(c.heads_q) * row);
    const int col = static_cast<int>(i % row);
    const bool inside = t < static_cast<std::size_t>(total_q) && col < c.head_dim;
    if (inside) {
      ASSERT_NE(r.o[i], test::kOutputPoison) << "O element left unwritten at " << i;
      o.data[(i / row) * c.head_dim + col] = test::from_bits16(r.o[i], bf16);
    } else {
      ASSERT_EQ(r.o[i], test::kOutputPoison) << "a write outside O's rows or columns at " << i;
    }
  }
  for (std::size_t i = 0; i < r.lse.size(); ++i) {
    const bool inside = i >= test::kLseGuard && i < r.lse.size() - test::kLseGuard;
    ASSERT_EQ(is_poison(r.lse[i]), !inside) << "LSE element " << i;
  }

  // 2. Bit-equal to one dense call per sequence (a sequence without keys: O = 0, LSE
  // = -inf).
  for (int b = 0; b < lay.batch(); ++b) {
    const int lq = lay.len_q(b), lk = lay.len_k(b);
    for (int i = 0; i < lq; ++i)
      for (int h = 0; h < c.heads_q; ++h) {
        const std::size_t at = (static_cast<std::size_t>(lay.q_start(b) + i) * c.heads_q + h) * row;
        const float lse = r.lse[test::kLseGuard + static_cast<std::size_t>(h) * total_q + lay.q_start(b) + i];
        if (lk == 0) {
          for (int col = 0; col < c.head_dim; ++col)
            ASSERT_EQ(test::from_bits16(r.o[at + col], bf16), 0.f) << "sequence " << b << " has no key";
          ASSERT_TRUE(std::isinf(lse) && lse < 0) << "sequence " << b;
          continue;
        }
        ASSERT_EQ(0, std::memcmp(&r.o[at], &r.o_dense[at], c.head_dim * sizeof(uint16_t)))
            << "O differs from the sequence's own call: sequence " << b << " row " << i << " head " << h;
        const float ld = r.lse_dense[test::kLseGuard + static_cast<std::size_t>(h) * total_q + lay.q_start(b) + i];
        ASSERT_EQ(0, std::memcmp(&lse, &ld, sizeof(float)))
            << "LSE differs: sequence " << b << " row " << i << " head " << h << ": " << lse << " vs " << ld;
      }
  }

  // 3. The emulation of the pack (given the kernel's K means, whose FP32 sum runs in
  // another order), to rounding as in test_sage2_forward's check_against_emulation.
  qattn_fwd_params pp{};
  pp.batch = lay.batch();
  pp.heads_q = c.heads_q;
  pp.heads_kv = c.heads_kv;
  pp.seqlen_q = total_q;
  pp.seqlen_kv = lay.cu_seqlens_k.back();
  pp.head_dim = c.head_dim;
  pp.cu_seqlens_q = pp.cu_seqlens_k = reinterpret_cast<const int32_t*>(16);
  pp.max_seqlen_q = std::max(1, lay.max_seqlen_q);
  pp.max_seqlen_k = std::max(1, lay.max_seqlen_k);
  const auto w = sage2::workspace_layout(pp);
  const int D = w.head_dim_padded;
  emulate::Sage2Options opt;
  opt.k_smoothing = emulate::KSmoothing::Given;
  opt.k_mean.resize(static_cast<std::size_t>(lay.batch()) * c.heads_kv * c.head_dim);
  for (int bh = 0; bh < lay.batch() * c.heads_kv; ++bh)
    for (int d = 0; d < c.head_dim; ++d)
      std::memcpy(&opt.k_mean[static_cast<std::size_t>(bh) * c.head_dim + d],
                  r.workspace.data() + w.k_mean + (static_cast<std::size_t>(bh) * D + d) * sizeof(float),
                  sizeof(float));
  const AttentionParams ap = c.attention_params();
  const auto emu = emulate::sage2_varlen_attention(r.q, r.k, r.v, lay, ap, opt);
  const auto m = metrics::compare(std::span<const float>(o.data), std::span<const float>(emu.o.data));
  const bool any_key = std::any_of(emu.o.data.begin(), emu.o.data.end(), [](float x) { return x != 0.f; });
  if (any_key) {
    EXPECT_GE(m.cos_sim, 0.99999) << "against the emulation, rel_l1=" << m.rel_l1;
    EXPECT_LE(m.rel_l1, 5e-3);
  }
  double lse_err = 0;
  for (std::size_t i = 0; i < emu.lse.size(); ++i) {
    const float g = r.lse[test::kLseGuard + i];
    if (std::isinf(emu.lse[i])) {
      EXPECT_TRUE(std::isinf(g) && g < 0) << "LSE row " << i << " sees no key";
      continue;
    }
    lse_err = std::max(lse_err, static_cast<double>(std::abs(g - emu.lse[i])));
  }
  EXPECT_LE(lse_err, 0.0445);  // one E4M3 step of a row sum (test_sage2_forward)

  // 4. The FP64 reference, within the scheme's bounds (outputs large enough for them).
  const auto ref = reference::attention_forward_varlen(r.q, r.k, r.v, lay, ap);
  if (any_key && o.data.size() > 4096) {
    const auto mr = metrics::compare(std::span<const float>(o.data), std::span<const double>(ref.o.data));
    EXPECT_GE(mr.cos_sim, bounds()["cos_min"]) << "rel_l1=" << mr.rel_l1;
    EXPECT_LE(mr.rel_l1, bounds()["rel_l1_max"]);
  }
}

TEST(Sage2Varlen, FixedPacks) {
  QATTN_SKIP_WITHOUT_GPU();
  // Tails on both sides of a 128-row block, a sequence of one token, one without keys,
  // one without queries, len_q != len_k both ways, GQA.
  const std::vector<int> lq = {300, 1, 128, 129, 0, 77, 513, 40};
  const std::vector<int> lk = {300, 17, 128, 256, 50, 0, 400, 700};
  for (int d : {128, 64})
    for (bool causal : {false, true}) {
      VarlenCase c;
      c.len_q = lq;
      c.len_k = lk;
      c.head_dim = d;
      c.causal = causal;
      c.bf16 = d == 128;
      c.seed = 11 + d + causal;
      check_pack(c);
    }
}

TEST(Sage2Varlen, WindowsAlignmentAndOddHeadDims) {
  QATTN_SKIP_WITHOUT_GPU();
  VarlenCase c;
  c.len_q = {200, 64, 333};
  c.len_k = {250, 300, 333};
  c.heads_q = 6;
  c.heads_kv = 3;
  for (int d : {96, 100}) {
    c.head_dim = d;
    c.window_left = 37;
    c.window_right = 5;
    c.seed = 31 + d;
    check_pack(c);
    c.causal = true;
    c.top_left = true;
    c.window_right = -1;
    check_pack(c);
    c.causal = false;
    c.top_left = false;
  }
}

TEST(Sage2Varlen, RandomPacks) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int n = 0; n < 6; ++n) {
    VarlenCase c;
    const int B = 1 + static_cast<int>(rng() % 12);
    for (int b = 0; b < B; ++b) {
      const int lq = static_cast<int>(rng() % 5 == 0 ? rng() % 3 : rng() % 700);
      c.len_q.push_back(lq);
      c.len_k.push_back(rng() % 4 == 0 ? lq : static_cast<int>(rng() % 700));
    }
    if (c.layout().cu_seqlens_q.back() == 0) c.len_q[0] = 1;
    if (c.layout().cu_seqlens_k.back() == 0) c.len_k[0] = 1;
    const int group = 1 + static_cast<int>(rng() % 4);
    c.heads_kv = 1 + static_cast<int>(rng() % 3);
    c.heads_q = c.heads_kv * group;
    const int dims[] = {64, 128, 32, 80, 120};
    c.head_dim = dims[rng() % 5];
    c.causal = rng() % 2;
    c.bf16 = rng() % 2;
    c.top_left = rng() % 3 == 0;
    if (rng() % 3 == 0) c.window_left = static_cast<int>(rng() % 300);
    c.seed = rng();
    check_pack(c);
  }
}

// More sequences than the plan pass has threads (its offsets are scanned in chunks of
// 1024, with carries between them), most of them shorter than a tile, some empty.
TEST(Sage2Varlen, ThousandsOfShortSequences) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  VarlenCase c;
  for (int b = 0; b < 2500; ++b) {
    c.len_q.push_back(static_cast<int>(rng() % 41));
    c.len_k.push_back(static_cast<int>(rng() % 41));
  }
  c.len_q[0] = c.len_k[0] = 200;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.head_dim = 64;
  c.causal = true;
  c.seed = seed;
  check_pack(c);
}

TEST(Sage2Varlen, RepeatedCallsOnOneWorkspaceAgree) {
  QATTN_SKIP_WITHOUT_GPU();
  VarlenCase c;
  c.len_q = {900, 5, 260};
  c.len_k = {900, 700, 1};
  c.causal = true;
  const VarlenRun a = run_varlen(c, false), b = run_varlen(c, false);
  ASSERT_EQ(a.status, 0);
  ASSERT_EQ(b.status, 0);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
}

// Offsets the call cannot check (they live on the device): decreasing, negative, past
// the totals. The output is unspecified; nothing outside O and the LSE is written.
TEST(Sage2Varlen, LyingOffsetsStayInsideTheBuffers) {
  QATTN_SKIP_WITHOUT_GPU();
  VarlenCase c;
  c.len_q = {200, 100, 300, 50};
  c.len_k = {200, 150, 250, 80};
  const std::vector<int> bad_q = {0, 400, -5, 650, 9999};
  const std::vector<int> bad_k = {7, -100, 680, 100, 480};
  const VarlenRun r = run_varlen(c, false, &bad_q, &bad_k);
  ASSERT_EQ(r.status, 0);
  const int total_q = c.layout().cu_seqlens_q.back(), row = padded_row(c.head_dim);
  for (std::size_t i = static_cast<std::size_t>(total_q) * c.heads_q * row; i < r.o.size(); ++i)
    ASSERT_EQ(r.o[i], test::kOutputPoison) << "a write past O at " << i;
  for (std::size_t i = 0; i < test::kLseGuard; ++i) {
    ASSERT_TRUE(is_poison(r.lse[i])) << "a write before the LSE";
    ASSERT_TRUE(is_poison(r.lse[r.lse.size() - 1 - i])) << "a write after the LSE";
  }
  // The device is fine afterwards: a good call on it gives the checked result.
  check_pack(c);
}

}  // namespace
