// SageBwd backward on the GPU through the C ABI: the training forward (qattn_fwd with
// the LSE and per-block Q/K groups) followed by qattn_bwd, against
//   (1) the CPU emulation of the same scheme (emulate::sagebwd_backward, the kernel's
//       written contract) fed with the GPU forward's o and LSE, to rounding; and
//   (2) the FP64 reference backward, at least as close as the emulation on the same
//       inputs (the bound comes from the emulator, not from a table).
// Also: a random-shape sweep (tails, Nq != Nkv both ways, GQA 4:1, MQA, causal, layouts,
// dtypes, d 64/96/128, dO·Vᵀ 16-bit and quantized, both dQ modes), the deterministic
// mode bitwise-stable over repeated runs, poisoned outputs with guards before, between
// and after the rows, bad inputs named with nothing written, and the paper's ablation
// directions on dQ (SageAttention3 Table 1c: 16-bit dO·Vᵀ above INT8; Table 7: INT8
// above FP8). Skips without an sm_90 GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "emulate/sagebwd.h"
#include "emulate/synthetic.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "sage2_case.h"  // Layout, make_view, random_tensor, the poison values

namespace {

using namespace qattn;
using test::DeviceBuffer;
using test::Layout;

int round8(int d) { return (d + 7) / 8 * 8; }

// The K smoothing of the kernel: the backward smooths K with the mean of the training
// forward's 256-token sample (emulate/options.h, SampledMean), summed in FP64 row by row
// as the emulator's token_mean, so c is the emulator's bit for bit. The saved LSE is the
// unsmoothed scores' (the forward adds sm_scale·q·c back), so the backward converts it
// to its own smoothed domain with that c.
constexpr emulate::KSmoothing kKernelKSmoothing = emulate::KSmoothing::SampledMean;
// P and dS get one scale per warpgroup's 64 KV rows of a tile (tile.cuh, TileFrags):
// SageBwdOptions::pds_block_keys = 64 (bench/NOTES.md v58).
constexpr int kKernelPdsBlockKeys = 64;
// The name the backward's kernel family carries in messages (registry: "considered N;
// <family>: <why>").
constexpr const char* kBwdFamily = "sagebwd";

// ---- the GPU against the emulation: "to rounding" --------------------------------------
// The kernel and the emulator run the same quantized arithmetic; they differ in the FP32
// summation order (dP = dO·Vᵀ over d, D = rowsum(dO ∘ O), the dQ atomics, the GQA sums)
// and in exp2 (ex2.approx, 2 ulp, against std::exp2), i.e. in P and dS by a few 1e-7
// relative. An 8-bit code of P̂ or dŜ flips where a value lies that close to a rounding
// boundary: a fraction of ~127·1e-6 ≈ 1e-4 of the codes, each moving its product term by
// one step (1/127 of the tile's amax). Summed over a row of ≥ 77 terms that is far below
// the 16-bit rounding of the outputs, which bounds what the comparison sees:
//   bf16 stores 8 significant bits, a relative rounding error of at most 2^-9 = 2e-3 and
//   ~7e-4 on average, so 1 − CosSim ≈ ½·E[rel²] ≈ 1e-6 and rel L1 ≈ 1e-3.
// The bounds leave a factor of ~10 on rel L1 over bf16 rounding (fp16 rounds 8x finer)
// and ~100 on 1 − CosSim: a flipped code next to a row's largest value, in a short row,
// can still cost more than the average.
// E4M3 adds one difference: the tensor core sums e4m3 products in FP32 with fewer kept
// bits (~14 on Hopper, not exact as INT32 is), so a score moves by up to ~2^-14 of its
// partial sums: ≲ 1e-3 in the log2 logit (|x| ≲ 20), 7e-4 relative in P. An E4M3 step is
// 1/16 to 1/8 of its value, so ≲ 2·7e-4·16 ≈ 2% of the codes flip, each by one step
// (≤ 1/8 of its term): over a row of ≥ 77 terms ≲ sqrt(0.02)·(1/8)/sqrt(77) ≈ 2e-3
// relative, 1 − CosSim ≈ 2e-6 and rel L1 ≈ 2e-3: inside the same bounds (measured on an
// H100: dQ's CosSim against FP64 within 3e-6 of the emulation's, bench/NOTES.md v83).
constexpr double kEmuMinCos = 0.9999;
constexpr double kEmuMaxRelL1 = 1e-2;

// ---- the GPU against FP64, bounded by the emulator -------------------------------------
// The GPU's output is the emulation plus the rounding differences above, which do not
// depend on the quantization error (a code flip is as likely either way). Independent
// errors add in squared norm, and 1 − CosSim ≈ ½·|err|²/|x|², so
//   1 − cos(gpu, ref) ≈ (1 − cos(emu, ref)) + (1 − cos(gpu, emu)) ≤ (1 − cos(emu, ref)) + 1e-4
// by kEmuMinCos; the slack is twice that. (Fully correlated errors would allow
// 2·sqrt((1 − cos_emu)·1e-4) ≈ 1e-3 at the emulator's 0.997: a GPU that loses that much
// has an error aligned with the scheme's own, which is a bug, not rounding.)
constexpr double kCosSlack = 2e-4;
// rel L1 obeys the triangle inequality: |gpu − ref|₁ ≤ |emu − ref|₁ + |gpu − emu|₁. The
// last term is the outputs' 16-bit rounding (at most 2^-9 = 1.95e-3 of each value, bf16)
// plus the code flips (≪ that, see above): 2.5e-3.
constexpr double kL1Slack = 2.5e-3;

// A case: the shape, the formats, and how many times the backward runs (on the same
// workspace, outputs re-poisoned before each run).
struct BwdCase {
  int batch = 1, heads_q = 2, heads_kv = 2, seqlen_q = 256, seqlen_kv = 256, head_dim = 128;
  bool causal = false, bf16 = true;
  Layout layout = Layout::HND;
  int row_pad = 0;  // extra elements (a multiple of 8) after each input row, poisoned
  int32_t format = QATTN_BWD_INT8;
  int32_t dov = QATTN_BWD_DOV_16BIT;
  int32_t deterministic = 0;
  int32_t scales = QATTN_BWD_SCALES_PER_BLOCK;  // merge-free: format E4M3, dov 16-bit
  int runs = 1;
  uint64_t seed = 1;

  std::string describe() const {
    return "B=" + std::to_string(batch) + " Hq=" + std::to_string(heads_q) +
           " Hkv=" + std::to_string(heads_kv) + " Nq=" + std::to_string(seqlen_q) +
           " Nkv=" + std::to_string(seqlen_kv) + " d=" + std::to_string(head_dim) +
           (causal ? " causal" : "") + (bf16 ? " bf16" : " fp16") +
           (layout == Layout::NHD ? " NHD" : " HND") + " row_pad=" + std::to_string(row_pad) +
           (format == QATTN_BWD_E4M3 ? " E4M3" : " INT8") +
           (dov == QATTN_BWD_DOV_QUANTIZED ? " dov=8bit" : " dov=16bit") +
           (deterministic ? " deterministic" : "") +
           (scales == QATTN_BWD_SCALES_MERGE_FREE ? " merge-free" : "") + " seed=" + std::to_string(seed);
  }
};

struct Inputs {
  Tensor4 q, k, v, dout;  // 16-bit values
};

Inputs random_inputs(const BwdCase& c) {
  std::mt19937_64 rng(c.seed);
  Inputs in;
  // K carries a per-channel bias (what smoothing removes), Q a smaller one.
  in.q = test::random_tensor(c.batch, c.heads_q, c.seqlen_q, c.head_dim, rng, 0.2f, c.bf16);
  in.k = test::random_tensor(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim, rng, 1.0f, c.bf16);
  in.v = test::random_tensor(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim, rng, 0.f, c.bf16);
  in.dout = test::random_tensor(c.batch, c.heads_q, c.seqlen_q, c.head_dim, rng, 0.f, c.bf16);
  return in;
}

// Elements of guard before and after every output (256 bytes: the data pointer stays
// 256-byte aligned), and the gap after each output row (16 bytes, keeping rows aligned).
constexpr std::size_t kGuard = 128;
constexpr int kOutGap = 8;

// A (B, H, N, d) tensor in device memory: `guard` elements, the rows (`row` elements
// apart, in the layout), `guard` elements. Everything but the values is `fill`.
struct DeviceTensor {
  int b = 0, h = 0, n = 0, d = 0, row = 0;
  std::size_t guard = 0, body = 0;
  std::unique_ptr<DeviceBuffer<uint16_t>> buf;
  qattn_tensor view{};  // relative to the start of the rows

  DeviceTensor(int b_, int h_, int n_, int d_, int row_, std::size_t guard_, Layout layout)
      : b(b_), h(h_), n(n_), d(d_), row(row_), guard(guard_) {
    body = std::size_t(b) * h * n * row;
    buf = std::make_unique<DeviceBuffer<uint16_t>>(guard + body + guard);
    view = test::make_view(nullptr, layout, b, h, n, row);
    view.data = buf->ptr == nullptr ? nullptr : buf->ptr + guard;
  }
  std::size_t total() const { return guard + body + guard; }
  std::size_t offset(int ib, int ih, int in, int id) const {
    return guard + ib * view.stride_b + ih * view.stride_h + in * view.stride_n + id;
  }
  void upload(const Tensor4& t, bool bf16, uint16_t fill) {
    std::vector<uint16_t> host(total(), fill);
    for (int ib = 0; ib < b; ++ib)
      for (int ih = 0; ih < h; ++ih)
        for (int in = 0; in < n; ++in)
          for (int id = 0; id < d; ++id)
            host[offset(ib, ih, in, id)] = test::to_bits16(t.at(ib, ih, in, id), bf16);
    buf->upload(host);
  }
  void poison() { cudaMemset(buf->ptr, 0xFF, total() * sizeof(uint16_t)); }
  Tensor4 values(const std::vector<uint16_t>& host, bool bf16) const {
    Tensor4 t(b, h, n, d);
    for (int ib = 0; ib < b; ++ib)
      for (int ih = 0; ih < h; ++ih)
        for (int in = 0; in < n; ++in)
          for (int id = 0; id < d; ++id)
            t.at(ib, ih, in, id) = test::from_bits16(host[offset(ib, ih, in, id)], bf16);
    return t;
  }
  // "" when every value was written and is finite and nothing else was touched, else
  // what went wrong first.
  std::string check_written(const std::vector<uint16_t>& host, bool bf16) const {
    std::vector<bool> is_value(host.size(), false);
    for (int ib = 0; ib < b; ++ib)
      for (int ih = 0; ih < h; ++ih)
        for (int in = 0; in < n; ++in)
          for (int id = 0; id < d; ++id) {
            const std::size_t i = offset(ib, ih, in, id);
            is_value[i] = true;
            const auto where = [&] {
              return " at (" + std::to_string(ib) + ", " + std::to_string(ih) + ", " +
                     std::to_string(in) + ", " + std::to_string(id) + ")";
            };
            if (host[i] == test::kOutputPoison) return "an element was left unwritten" + where();
            if (!std::isfinite(test::from_bits16(host[i], bf16)))
              return "a non-finite value" + where();
          }
    for (std::size_t i = 0; i < host.size(); ++i)
      if (!is_value[i] && host[i] != test::kOutputPoison)
        return std::string(i < guard ? "the guard before the rows"
                           : i >= guard + body ? "the guard after the rows"
                                               : "a gap between rows") +
               " was written (element " + std::to_string(i) + ")";
    return {};
  }
};

// One training forward and its backward(s) on the device, through the C ABI.
class BwdSetup {
 public:
  BwdSetup(const BwdCase& c, Inputs in) : c_(c), in_(std::move(in)) {
    const Layout l = c.layout;
    const int row = round8(c.head_dim);
    // q, k and v get different row paddings, so a stride mixed up between tensors reads
    // the wrong rows; dO gets q's.
    q_ = std::make_unique<DeviceTensor>(c.batch, c.heads_q, c.seqlen_q, c.head_dim,
                                        row + c.row_pad, 0, l);
    k_ = std::make_unique<DeviceTensor>(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim,
                                        row + 2 * c.row_pad, 0, l);
    v_ = std::make_unique<DeviceTensor>(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim,
                                        row + 3 * c.row_pad, 0, l);
    do_ = std::make_unique<DeviceTensor>(c.batch, c.heads_q, c.seqlen_q, c.head_dim,
                                         row + c.row_pad, 0, l);
    o_ = std::make_unique<DeviceTensor>(c.batch, c.heads_q, c.seqlen_q, c.head_dim, row, 0, l);
    dq_ = std::make_unique<DeviceTensor>(c.batch, c.heads_q, c.seqlen_q, c.head_dim,
                                         row + kOutGap, kGuard, l);
    dk_ = std::make_unique<DeviceTensor>(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim,
                                         row + kOutGap, kGuard, l);
    dv_ = std::make_unique<DeviceTensor>(c.batch, c.heads_kv, c.seqlen_kv, c.head_dim,
                                         row + kOutGap, kGuard, l);
    lse_count_ = std::size_t(c.batch) * c.heads_q * c.seqlen_q;
    lse_ = std::make_unique<DeviceBuffer<float>>(lse_count_);
    p_max_ = std::make_unique<DeviceBuffer<float>>(lse_count_);
    q_->upload(in_.q, c.bf16, test::kInputPoison);
    k_->upload(in_.k, c.bf16, test::kInputPoison);
    v_->upload(in_.v, c.bf16, test::kInputPoison);
    do_->upload(in_.dout, c.bf16, test::kInputPoison);
    for (DeviceTensor* t : {o_.get(), dq_.get(), dk_.get(), dv_.get()}) t->poison();
    cudaMemset(lse_->ptr, 0xFF, lse_count_ * sizeof(float));
    cudaMemset(p_max_->ptr, 0xFF, lse_count_ * sizeof(float));
  }

  // The fields the forward's and the backward's parameters share.
  template <typename Params>
  void set_shape(Params& p) const {
    p.dtype = c_.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
    p.batch = c_.batch;
    p.heads_q = c_.heads_q;
    p.heads_kv = c_.heads_kv;
    p.seqlen_q = c_.seqlen_q;
    p.seqlen_kv = c_.seqlen_kv;
    p.head_dim = c_.head_dim;
    p.causal = c_.causal ? 1 : 0;
  }

  // The training forward: o, the LSE and P's row maxima, per-block Q/K groups.
  qattn_status forward() {
    qattn_fwd_params p;
    qattn_fwd_params_init(&p);
    p.q = q_->view;
    p.k = k_->view;
    p.v = v_->view;
    p.o = o_->view;
    p.lse = lse_->ptr;
    p.p_max = p_max_->ptr;
    set_shape(p);
    p.sage2.granularity = QATTN_QK_PER_BLOCK;
    std::size_t bytes = 0;
    if (qattn_status s = qattn_fwd_workspace_size(&p, &bytes); s != QATTN_OK) return s;
    DeviceBuffer<uint8_t> ws(bytes);
    if (qattn_status s = qattn_fwd(&p, ws.ptr, bytes, nullptr); s != QATTN_OK) return s;
    if (cudaDeviceSynchronize() != cudaSuccess) return QATTN_ERROR_CUDA;
    o = o_->values(o_->buf->download(), c_.bf16);
    lse = lse_->download();
    lse.resize(lse_count_);
    p_max = p_max_->download();
    p_max.resize(lse_count_);
    return QATTN_OK;
  }

  // The backward's parameters for this case (valid once forward() has run).
  qattn_bwd_params params() const {
    qattn_bwd_params p;
    qattn_bwd_params_init(&p);
    p.q = q_->view;
    p.k = k_->view;
    p.v = v_->view;
    p.o = o_->view;
    p.dout = do_->view;
    p.lse = lse_->ptr;
    p.dq = dq_->view;
    p.dk = dk_->view;
    p.dv = dv_->view;
    set_shape(p);
    p.format = c_.format;
    p.dov = c_.dov;
    p.deterministic = c_.deterministic;
    p.scales = c_.scales;
    if (c_.scales == QATTN_BWD_SCALES_MERGE_FREE) p.p_max = p_max_->ptr;
    return p;
  }

  // Sizes and allocates the workspace for `p` once (filled with 0xFF: a caller's
  // workspace holds anything, so the backward must clear what it accumulates into).
  qattn_status allocate_workspace(const qattn_bwd_params& p) {
    std::size_t bytes = 0;
    if (qattn_status s = qattn_bwd_workspace_size(&p, &bytes); s != QATTN_OK) return s;
    ws_bytes_ = bytes;
    ws_ = std::make_unique<DeviceBuffer<uint8_t>>(std::max<std::size_t>(bytes, 1));
    cudaMemset(ws_->ptr, 0xFF, std::max<std::size_t>(bytes, 1));
    return QATTN_OK;
  }
  void* workspace() const { return ws_ ? ws_->ptr : nullptr; }
  std::size_t workspace_bytes() const { return ws_bytes_; }

  // Poisons the outputs and their guards, then runs qattn_bwd(p) and waits for it.
  qattn_status backward(const qattn_bwd_params& p) {
    for (DeviceTensor* t : {dq_.get(), dk_.get(), dv_.get()}) t->poison();
    const qattn_status s = qattn_bwd(&p, workspace(), ws_bytes_, nullptr);
    message = s == QATTN_OK ? "" : qattn_last_error_message();
    if (cudaDeviceSynchronize() != cudaSuccess) {
      message = cudaGetErrorString(cudaGetLastError());
      return QATTN_ERROR_CUDA;
    }
    return s;
  }

  struct Outputs {
    std::vector<uint16_t> dq_bits, dk_bits, dv_bits;  // whole buffers, guards included
    Tensor4 dq, dk, dv;
    std::string problem;  // "" when all written, finite, and guards and gaps untouched
  };
  Outputs outputs() const {
    Outputs r;
    r.dq_bits = dq_->buf->download();
    r.dk_bits = dk_->buf->download();
    r.dv_bits = dv_->buf->download();
    r.dq = dq_->values(r.dq_bits, c_.bf16);
    r.dk = dk_->values(r.dk_bits, c_.bf16);
    r.dv = dv_->values(r.dv_bits, c_.bf16);
    for (auto [name, t, bits] : {std::tuple{"dq", dq_.get(), &r.dq_bits},
                                 std::tuple{"dk", dk_.get(), &r.dk_bits},
                                 std::tuple{"dv", dv_.get(), &r.dv_bits}})
      if (std::string why = t->check_written(*bits, c_.bf16); !why.empty() && r.problem.empty())
        r.problem = std::string(name) + ": " + why;
    return r;
  }
  // True when no byte of dq, dk, dv (guards included) changed since the poisoning.
  bool outputs_untouched() const {
    for (const DeviceTensor* t : {dq_.get(), dk_.get(), dv_.get()})
      for (uint16_t x : t->buf->download())
        if (x != test::kOutputPoison) return false;
    return true;
  }
  bool workspace_untouched() const {
    if (!ws_) return true;
    for (uint8_t x : ws_->download())
      if (x != 0xFF) return false;
    return true;
  }

  const Inputs& inputs() const { return in_; }
  const BwdCase& spec() const { return c_; }
  Tensor4 o;               // the GPU forward's output (16-bit values)
  std::vector<float> lse;  // and its LSE
  std::vector<float> p_max;  // and P's row maxima
  std::string message;     // qattn_last_error_message of the last failed backward

 private:
  BwdCase c_;
  Inputs in_;
  std::unique_ptr<DeviceTensor> q_, k_, v_, do_, o_, dq_, dk_, dv_;
  std::unique_ptr<DeviceBuffer<float>> lse_, p_max_;
  std::size_t lse_count_ = 0;
  std::unique_ptr<DeviceBuffer<uint8_t>> ws_;
  std::size_t ws_bytes_ = 0;
};

AttentionParams attention_params(const BwdCase& c) {
  AttentionParams ap;
  ap.mask = c.causal ? Mask::Causal : Mask::None;
  return ap;
}

emulate::SageBwdOptions emulation_options(const BwdCase& c) {
  emulate::SageBwdOptions o;
  o.format = c.format == QATTN_BWD_E4M3 ? emulate::Bwd8Format::E4M3 : emulate::Bwd8Format::Int8;
  o.dov = c.dov == QATTN_BWD_DOV_QUANTIZED ? emulate::DoVFormat::Quantized : emulate::DoVFormat::Fp16;
  o.k_smoothing = kKernelKSmoothing;
  o.pds_block_keys = kKernelPdsBlockKeys;
  if (c.scales == QATTN_BWD_SCALES_MERGE_FREE) o.scales = emulate::Bwd8Scales::MergeFree;
  return o;
}

metrics::ErrorMetrics against(const Tensor4& a, const Tensor4& b) {
  return metrics::compare(std::span<const float>(a.data), std::span<const float>(b.data));
}
metrics::ErrorMetrics against(const Tensor4& a, const Tensor4d& ref) {
  return metrics::compare(std::span<const float>(a.data), std::span<const double>(ref.data));
}

// What one checked case measured, for the tests that look further (ablations).
struct Checked {
  metrics::ErrorMetrics gpu_ref[3], emu_ref[3];  // dq, dk, dv against FP64
  BwdSetup::Outputs out;
};

// The backward of `s` (forward already run), checked against the emulation and FP64.
// `ref`: the FP64 gradients of the case (computed here when null).
Checked check_backward(BwdSetup& s, const reference::BackwardResult* ref = nullptr) {
  Checked result;
  const BwdCase& c = s.spec();
  const qattn_bwd_params p = s.params();
  EXPECT_EQ(s.allocate_workspace(p), QATTN_OK) << qattn_last_error_message();
  const qattn_status st = s.backward(p);
  EXPECT_EQ(st, QATTN_OK) << qattn_status_string(st) << ": " << s.message;
  if (st != QATTN_OK) return result;
  result.out = s.outputs();
  EXPECT_EQ(result.out.problem, "");
  const Inputs& in = s.inputs();
  const AttentionParams ap = attention_params(c);
  emulate::SageBwdOptions opt = emulation_options(c);
  opt.p_max = s.p_max;  // the merge-free contract takes P's row maxima from the forward
  const auto emu = emulate::sagebwd_backward(in.q, in.k, in.v, s.o, s.lse, in.dout, ap, opt);
  reference::BackwardResult own_ref;
  if (ref == nullptr) {
    own_ref = reference::attention_backward(in.q, in.k, in.v, in.dout, ap);
    ref = &own_ref;
  }
  const Tensor4* gpu[3] = {&result.out.dq, &result.out.dk, &result.out.dv};
  const Tensor4* em[3] = {&emu.dq, &emu.dk, &emu.dv};
  const Tensor4d* rf[3] = {&ref->dq, &ref->dk, &ref->dv};
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(names[i]);
    const auto ge = against(*gpu[i], *em[i]);
    EXPECT_GE(ge.cos_sim, kEmuMinCos) << "GPU against its emulation, rel_l1=" << ge.rel_l1;
    EXPECT_LE(ge.rel_l1, kEmuMaxRelL1) << "GPU against its emulation, cos=" << ge.cos_sim;
    result.gpu_ref[i] = against(*gpu[i], *rf[i]);
    result.emu_ref[i] = against(*em[i], *rf[i]);
    const auto& g = result.gpu_ref[i];
    const auto& e = result.emu_ref[i];
    EXPECT_GE(g.cos_sim, e.cos_sim - kCosSlack)
        << "against FP64: GPU cos " << g.cos_sim << ", emulation " << e.cos_sim;
    EXPECT_LE(g.rel_l1, e.rel_l1 + kL1Slack)
        << "against FP64: GPU rel_l1 " << g.rel_l1 << ", emulation " << e.rel_l1;
  }
  return result;
}

// Forward, then the backward `c.runs` times on one workspace; every run is checked for
// written, finite outputs and intact guards, the first against emulation and FP64.
// Returns the output bits of each run.
std::vector<std::vector<uint16_t>> check_case(const BwdCase& c) {
  SCOPED_TRACE(c.describe());
  std::vector<std::vector<uint16_t>> runs;
  BwdSetup s(c, random_inputs(c));
  const qattn_status fs = s.forward();
  EXPECT_EQ(fs, QATTN_OK) << qattn_status_string(fs) << ": " << qattn_last_error_message();
  if (fs != QATTN_OK) return runs;
  const Checked first = check_backward(s);
  if (::testing::Test::HasFatalFailure() || first.out.dq_bits.empty()) return runs;
  auto bits = [](const BwdSetup::Outputs& o) {
    std::vector<uint16_t> all(o.dq_bits);
    all.insert(all.end(), o.dk_bits.begin(), o.dk_bits.end());
    all.insert(all.end(), o.dv_bits.begin(), o.dv_bits.end());
    return all;
  };
  runs.push_back(bits(first.out));
  const qattn_bwd_params p = s.params();
  for (int r = 1; r < c.runs; ++r) {
    SCOPED_TRACE("run " + std::to_string(r + 1));
    const qattn_status st = s.backward(p);
    EXPECT_EQ(st, QATTN_OK) << s.message;
    if (st != QATTN_OK) break;
    const auto out = s.outputs();
    EXPECT_EQ(out.problem, "");
    runs.push_back(bits(out));
  }
  return runs;
}

TEST(SageBwdBackward, SmallBf16Hnd) {
  QATTN_SKIP_WITHOUT_GPU();
  check_case(BwdCase{});
}

TEST(SageBwdBackward, FixedCasesEachSwitch) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.head_dim = 64;
  c.causal = true;
  c.seqlen_q = 200;
  c.seqlen_kv = 333;
  c.heads_q = 4;
  c.heads_kv = 1;
  check_case(c);
  c.dov = QATTN_BWD_DOV_QUANTIZED;
  c.bf16 = false;
  c.layout = Layout::NHD;
  check_case(c);
  c.deterministic = 1;
  c.head_dim = 128;
  c.row_pad = 16;  // poisoned (NaN) padding after each input row must never be read
  check_case(c);
  // The E4M3 format with each dO·Vᵀ precision, both dQ modes and both head dims.
  c.format = QATTN_BWD_E4M3;
  check_case(c);
  c.dov = QATTN_BWD_DOV_16BIT;
  c.deterministic = 0;
  c.head_dim = 64;
  c.bf16 = true;
  c.row_pad = 0;
  check_case(c);
}

// The merge-free scales on the default case (the compute-sanitizer run's).
TEST(SageBwdMergeFree, SmallBf16Hnd) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.format = QATTN_BWD_E4M3;
  c.scales = QATTN_BWD_SCALES_MERGE_FREE;
  check_case(c);
}

// The merge-free scales (QATTN_BWD_SCALES_MERGE_FREE; the emulator's Bwd8Scales::MergeFree
// fed with the GPU forward's p_max): fixed cases over head dims, dtypes, layouts, causal
// GQA with Nq != Nkv, both dQ modes; tolerances as above (E4M3 codes).
TEST(SageBwdMergeFree, FixedCasesEachSwitch) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.format = QATTN_BWD_E4M3;
  c.scales = QATTN_BWD_SCALES_MERGE_FREE;
  check_case(c);
  c.head_dim = 64;
  c.causal = true;
  c.seqlen_q = 200;
  c.seqlen_kv = 333;
  c.heads_q = 4;
  c.heads_kv = 1;
  check_case(c);
  c.bf16 = false;
  c.layout = Layout::NHD;
  c.head_dim = 128;
  c.row_pad = 16;
  check_case(c);
  c.deterministic = 1;
  c.runs = 2;
  const auto runs = check_case(c);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], runs[1]) << "deterministic merge-free runs differ";
}

// P's row maxima the forward writes: exp(m_i − lse_i) of its own scores, so within the
// quantized scores' error of the FP64 value: the LSE's bound per row (|log ratio| ≤ 0.08,
// the per-block INT8 scores' error at these scales; measured up to 0.037 on an H100) and
// 2% on average; never 0 for a row that sees a key.
TEST(SageBwdMergeFree, ForwardWritesRowMaxima) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.causal = true;
  c.seqlen_q = 190;
  c.seqlen_kv = 300;
  BwdSetup s(c, random_inputs(c));
  ASSERT_EQ(s.forward(), QATTN_OK) << qattn_last_error_message();
  const Inputs& in = s.inputs();
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  int checked = 0;
  double mean_err = 0.0;
  for (int h = 0; h < c.heads_q; ++h)
    for (int i = 0; i < c.seqlen_q; ++i) {
      double mx = -1e300, sum = 0.0;
      std::vector<double> x(c.seqlen_kv, -1e300);
      for (int j = 0; j < c.seqlen_kv; ++j) {
        if (j > i + c.seqlen_kv - c.seqlen_q) continue;  // causal, bottom-right
        double dot = 0.0;
        for (int e = 0; e < c.head_dim; ++e)
          dot += double(in.q.row(0, h, i)[e]) * in.k.row(0, h, j)[e];
        x[j] = dot * scale;
        mx = std::max(mx, x[j]);
      }
      for (int j = 0; j < c.seqlen_kv; ++j)
        if (x[j] > -1e299) sum += std::exp(x[j] - mx);
      const double want = 1.0 / sum;
      const float got = s.p_max[(std::size_t(h)) * c.seqlen_q + i];
      ASSERT_TRUE(std::isfinite(got) && got > 0.0f) << "row " << i << " head " << h;
      EXPECT_LE(std::fabs(std::log(got / want)), 0.08) << "row " << i << " head " << h;
      mean_err += std::fabs(got / want - 1.0);
      ++checked;
    }
  EXPECT_EQ(checked, c.heads_q * c.seqlen_q);
  EXPECT_LE(mean_err / checked, 0.02);
}

// A long sequence: the kernel sums dV and dK over 32 Q blocks in its accumulators (the
// merge-free point); the E4M3 tensor core keeps fewer bits in its sums than FP32, so
// this checks the accumulation against the emulation's exact sums over a whole head.
TEST(SageBwdMergeFree, LongSequence) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.format = QATTN_BWD_E4M3;
  c.scales = QATTN_BWD_SCALES_MERGE_FREE;
  c.heads_q = 1;
  c.heads_kv = 1;
  c.seqlen_q = 2048;
  c.seqlen_kv = 2048;
  check_case(c);
}

// The dK/dV kernel forms each step's dQ one step late (its first step issues a product it
// never reduces, the last step's dQ follows the loop): CTAs of one and of two steps, where
// those two paths are all there is. Nq = 50 is one Q block, so a CTA walks one step per
// query head of its group: one with MHA, two with GQA 2:1.
TEST(SageBwdBackward, OneAndTwoStepsPerCta) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.seqlen_q = 50;
  c.seqlen_kv = 300;
  check_case(c);
  c.heads_q = 4;
  c.head_dim = 64;
  c.causal = true;
  c.bf16 = false;
  c.layout = Layout::NHD;
  check_case(c);
}

// Random shapes. The seed picks lengths, batch, dtype, layout and the input rows'
// padding; the case index makes sure the sweep covers each of: Nq < Nkv, Nq > Nkv and
// Nq = Nkv; MHA, GQA 4:1 and MQA; causal and not; dO·Vᵀ 16-bit and quantized; both dQ
// modes; d 64 and 128, and one d = 96; and four cases in E4M3 (cases 2, 4, 7, 9: d 128
// and 64, each dO·Vᵀ precision, both dQ modes).
TEST(SageBwdBackward, RandomShapeSweep) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::printf("RandomShapeSweep: %s\n", test::seed_trace(seed).c_str());
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int> xs) { return *(xs.begin() + rng() % xs.size()); };
  constexpr int kCases = 12;
  for (int i = 0; i < kCases; ++i) {
    BwdCase c;
    c.seed = rng();
    const int a = pick({77, 200, 1000, 1024, 129, 333});
    int b = pick({77, 200, 1000, 1024, 129, 640});
    switch (i % 3) {  // Nq < Nkv, Nq > Nkv, Nq = Nkv
      case 0:
        if (b == a) b = a + 51;
        c.seqlen_q = std::min(a, b);
        c.seqlen_kv = std::max(a, b);
        break;
      case 1:
        if (b == a) b = a + 51;
        c.seqlen_q = std::max(a, b);
        c.seqlen_kv = std::min(a, b);
        break;
      default:
        c.seqlen_q = c.seqlen_kv = a;
    }
    switch (i % 4) {  // MHA, GQA 4:1, MQA, GQA 2:1
      case 0:
        c.heads_q = c.heads_kv = pick({1, 2});
        break;
      case 1:
        c.heads_kv = 1;
        c.heads_q = 4;
        break;
      case 2:
        c.heads_kv = 1;
        c.heads_q = pick({2, 3});
        break;
      default:
        c.heads_kv = 2;
        c.heads_q = 4;
    }
    // Two batches only where the case is small: the CPU emulation and the FP64
    // reference of the largest case take seconds.
    const double work = double(c.heads_q) * c.seqlen_q * c.seqlen_kv;
    c.batch = work <= 4e5 ? pick({1, 2}) : 1;
    c.causal = (i / 2) % 2 == 1;
    c.head_dim = i == 5 ? 96 : (i % 2 ? 64 : 128);
    c.dov = (i / 3) % 2 ? QATTN_BWD_DOV_QUANTIZED : QATTN_BWD_DOV_16BIT;
    c.deterministic = (i / 4) % 2;
    c.format = i % 5 == 2 || i % 5 == 4 ? QATTN_BWD_E4M3 : QATTN_BWD_INT8;
    c.bf16 = rng() % 2;
    c.layout = rng() % 2 ? Layout::NHD : Layout::HND;
    c.row_pad = rng() % 3 == 0 ? pick({8, 16, 40}) : 0;
    std::printf("  case %d: %s\n", i, c.describe().c_str());
    check_case(c);
    if (HasFailure()) return;
  }
}

// The deterministic mode: three runs on one workspace give the same bits, for a shape
// with many Q blocks per KV tile, GQA (dK and dV summed over 4 query heads) and causal
// Nq != Nkv. The default mode (dQ by FP32 atomics) may differ in the last bits only:
// each run meets the emulation bound (checked in check_case for the first) and the runs
// agree to FP32 summation order, far inside bf16 rounding.
TEST(SageBwdBackward, DeterministicModeIsBitwiseStable) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.batch = 2;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.seqlen_q = 1000;
  c.seqlen_kv = 777;
  c.causal = true;
  c.runs = 3;
  c.deterministic = 1;
  auto expect_bitwise_stable = [](const BwdCase& d) {
    const auto runs = check_case(d);
    ASSERT_EQ(runs.size(), 3u);
    for (int r = 1; r < 3; ++r) {
      std::size_t differ = 0;
      for (std::size_t i = 0; i < runs[0].size(); ++i) differ += runs[0][i] != runs[r][i];
      EXPECT_EQ(differ, 0u) << "run " << r + 1 << " differs from run 1 in " << differ << " of "
                            << runs[0].size() << " 16-bit values";
    }
  };
  expect_bitwise_stable(c);
  {
    BwdCase e = c;  // E4M3's products sum in FP32 inside the tensor core: the same order too
    e.format = QATTN_BWD_E4M3;
    e.seqlen_q = 300;
    e.heads_q = 4;
    expect_bitwise_stable(e);
  }
  c.deterministic = 0;
  c.seqlen_kv = 1024;
  c.causal = false;
  const auto runs = check_case(c);
  ASSERT_EQ(runs.size(), 3u);
  for (int r = 1; r < 3; ++r) {
    double dot = 0, n0 = 0, n1 = 0;
    for (std::size_t i = 0; i < runs[0].size(); ++i) {
      const double x = test::from_bits16(runs[0][i], true), y = test::from_bits16(runs[r][i], true);
      if (!std::isfinite(x) || !std::isfinite(y)) continue;  // the poisoned guards and gaps
      dot += x * y;
      n0 += x * x;
      n1 += y * y;
    }
    // FP32 reordering moves a value by ~1e-7 relative: it changes a bf16 value by one
    // ulp only where it sits that close to a rounding boundary.
    EXPECT_GE(dot / std::sqrt(n0 * n1), 0.999999) << "run " << r + 1 << " against run 1";
  }
}

// Causal with Nq > Nkv: the first Nq − Nkv query rows see no key, so their dQ rows are
// zero and must be written as zeros (not left poisoned); NHD rows with gaps, d = 72
// (zero-padded to 128 inside the kernel: the padding columns must not reach the outputs),
// a KV length that ends one token into a tile. A second run on the same workspace must
// start from zero, not from the first run's sums.
TEST(SageBwdBackward, PoisonedOutputsAreAllWrittenAndGuardsStay) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seed = test::fresh_seed();
  c.seqlen_q = 700;
  c.seqlen_kv = 129;
  c.head_dim = 72;
  c.causal = true;
  c.layout = Layout::NHD;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.row_pad = 8;
  for (const bool bf16 : {true, false}) {
    c.bf16 = bf16;
    SCOPED_TRACE(c.describe());
    BwdSetup s(c, random_inputs(c));
    ASSERT_EQ(s.forward(), QATTN_OK) << qattn_last_error_message();
    const Checked first = check_backward(s);
    ASSERT_FALSE(first.out.dq_bits.empty());
    // A second run on the same workspace: it must clear what the first accumulated.
    ASSERT_EQ(s.backward(s.params()), QATTN_OK) << s.message;
    const auto second = s.outputs();
    EXPECT_EQ(second.problem, "");
    for (const auto* out : {&first.out, &second}) {
      for (int h = 0; h < c.heads_q; ++h)
        for (int i = 0; i < c.seqlen_q - c.seqlen_kv; ++i)
          for (int d = 0; d < c.head_dim; ++d)
            ASSERT_EQ(out->dq.at(0, h, i, d), 0.f) << "row " << i << " sees no key";
      const auto m = against(out->dq, first.out.dq);
      EXPECT_GE(m.cos_sim, 0.999999) << "the second run strays from the first";
    }
  }
}

// Bad parameters: a named error, from qattn_bwd_workspace_size and qattn_bwd alike, and
// nothing written (neither the outputs nor their guards, nor the workspace).
TEST(SageBwdBackward, BadInputsAreNamedAndWriteNothing) {
  QATTN_SKIP_WITHOUT_GPU();
  BwdCase c;
  c.seqlen_q = 128;
  c.seqlen_kv = 200;
  c.head_dim = 64;
  BwdSetup s(c, random_inputs(c));
  ASSERT_EQ(s.forward(), QATTN_OK) << qattn_last_error_message();
  const qattn_bwd_params good = s.params();
  ASSERT_EQ(s.allocate_workspace(good), QATTN_OK) << qattn_last_error_message();
  struct Bad {
    const char* what;
    qattn_status want;
    const char* named;  // a word the message must contain
    void (*edit)(qattn_bwd_params&);
  };
  const Bad bad[] = {
      {"no lse", QATTN_ERROR_INVALID_ARGUMENT, "lse", [](qattn_bwd_params& p) { p.lse = nullptr; }},
      {"dq aliases q", QATTN_ERROR_INVALID_ARGUMENT, "dq",
       [](qattn_bwd_params& p) { p.dq = p.q; }},
      {"dk aliases dv", QATTN_ERROR_INVALID_ARGUMENT, "dk",
       [](qattn_bwd_params& p) { p.dk = p.dv; }},
      {"struct_size 0", QATTN_ERROR_INVALID_ARGUMENT, "struct_size",
       [](qattn_bwd_params& p) { p.struct_size = 0; }},
      {"struct_size below the first layout", QATTN_ERROR_INVALID_ARGUMENT, "struct_size",
       [](qattn_bwd_params& p) { p.struct_size = QATTN_BWD_PARAMS_MIN_SIZE - 4; }},
      {"struct_size of a newer header", QATTN_ERROR_UNSUPPORTED, "struct_size",
       [](qattn_bwd_params& p) { p.struct_size = sizeof(qattn_bwd_params) + 8; }},
      {"format out of range", QATTN_ERROR_INVALID_ARGUMENT, "format",
       [](qattn_bwd_params& p) { p.format = 7; }},
      {"dov out of range", QATTN_ERROR_INVALID_ARGUMENT, "dov",
       [](qattn_bwd_params& p) { p.dov = -1; }},
      {"deterministic not 0 or 1", QATTN_ERROR_INVALID_ARGUMENT, "deterministic",
       [](qattn_bwd_params& p) { p.deterministic = 2; }},
      {"reserved0 set", QATTN_ERROR_INVALID_ARGUMENT, "reserved0",
       [](qattn_bwd_params& p) { p.reserved0 = 1; }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    qattn_bwd_params p = good;
    b.edit(p);
    std::size_t bytes = 0;
    const qattn_status sized = qattn_bwd_workspace_size(&p, &bytes);
    EXPECT_EQ(sized, b.want) << qattn_last_error_message();
    const qattn_status st = s.backward(p);
    EXPECT_EQ(st, b.want) << s.message;
    EXPECT_NE(s.message.find(b.named), std::string::npos) << s.message;
    EXPECT_TRUE(s.outputs_untouched()) << "a rejected call wrote dq, dk or dv";
  }
  {
    SCOPED_TRACE("workspace one byte short");
    ASSERT_GT(s.workspace_bytes(), 0u);
    const qattn_status st = qattn_bwd(&good, s.workspace(), s.workspace_bytes() - 1, nullptr);
    const std::string msg = qattn_last_error_message();
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(st, QATTN_ERROR_WORKSPACE_TOO_SMALL) << msg;
    EXPECT_NE(msg.find("workspace"), std::string::npos) << msg;
    EXPECT_TRUE(s.outputs_untouched());
  }
  EXPECT_TRUE(s.workspace_untouched()) << "a rejected call wrote the workspace";
  {
    // The E4M3 format is valid; a kernel family that does not run it declines with a
    // reason that names the family (and so does every family of the build).
    SCOPED_TRACE("E4M3 format");
    qattn_bwd_params p = good;
    p.format = QATTN_BWD_E4M3;
    const qattn_status sized = s.allocate_workspace(p);
    ASSERT_TRUE(sized == QATTN_OK || sized == QATTN_ERROR_UNSUPPORTED) << qattn_last_error_message();
    const qattn_status st = s.backward(p);
    if (st == QATTN_ERROR_UNSUPPORTED) {
      EXPECT_NE(s.message.find(kBwdFamily), std::string::npos) << s.message;
      EXPECT_TRUE(s.outputs_untouched()) << "a declined call wrote dq, dk or dv";
    } else {
      EXPECT_EQ(st, QATTN_OK) << s.message;
    }
  }
}

// ---- the paper's ablation directions on dQ ----------------------------------------------
// On the accuracy report's generator (emulate/synthetic.h, FP16 inputs) at N = 1K, d = 128:
// dQ's CosSim against FP64, averaged over three seeds. The emulation fed by the SA2
// per-block forward (as the GPU is) gives, on generator seeds 1000..1003: 16-bit dO·Vᵀ
// above quantized by 3.9e-4 to 4.4e-4 (Table 1c), INT8 above E4M3 by 3.2e-3 to 4.5e-3
// (Table 7); the paper's forward gives 4e-5 and 1.1e-3 (docs/accuracy-report.md). The
// GPU's difference from the emulation (1 − cos ≲ 1e-5 on average, see kEmuMinCos) is far
// below both gaps, and strict ">" fails a kernel that ignores the switch.

struct AblationRun {
  double dq_cos_gpu = 0, dq_cos_emu = 0;
  qattn_status status = QATTN_OK;
  std::string message;
};

constexpr int kAblationSeeds = 3;

// dQ's CosSim against FP64 of the GPU and of the emulation for the given switches, on
// generator seed `seed`.
std::vector<AblationRun> ablation_runs(uint64_t seed,
                                       const std::vector<std::pair<int32_t, int32_t>>& modes) {
  emulate::SyntheticSpec spec;
  spec.heads_q = spec.heads_kv = 2;
  spec.seq_q = spec.seq_kv = 1024;
  spec.head_dim = 128;
  spec.seed = seed;
  const auto syn = emulate::make_synthetic(spec);
  BwdCase c;
  c.bf16 = false;  // the generator rounds to FP16
  c.heads_q = c.heads_kv = spec.heads_q;
  c.seqlen_q = c.seqlen_kv = spec.seq_q;
  c.head_dim = spec.head_dim;
  c.seed = seed;
  const Inputs in{syn.q, syn.k, syn.v, syn.dout};
  const auto ref = reference::attention_backward(in.q, in.k, in.v, in.dout, {});
  std::vector<AblationRun> out;
  for (auto [format, dov] : modes) {
    c.format = format;
    c.dov = dov;
    SCOPED_TRACE(c.describe());
    AblationRun r;
    BwdSetup s(c, in);
    if ((r.status = s.forward()) != QATTN_OK) {
      r.message = qattn_last_error_message();
      out.push_back(r);
      continue;
    }
    if (format != QATTN_BWD_INT8) {  // a format the build may not run: ask first
      const qattn_bwd_params p = s.params();
      qattn_status st = s.allocate_workspace(p);
      if (st == QATTN_OK) st = s.backward(p);
      else s.message = qattn_last_error_message();
      if (st == QATTN_ERROR_UNSUPPORTED) {
        r.status = st;
        r.message = s.message;
        out.push_back(r);
        continue;
      }
    }
    const Checked ch = check_backward(s, &ref);
    r.dq_cos_gpu = ch.gpu_ref[0].cos_sim;
    r.dq_cos_emu = ch.emu_ref[0].cos_sim;
    out.push_back(r);
  }
  return out;
}

// Mean dQ CosSim of each mode over kAblationSeeds seeds; skips (returns empty) when a
// mode is unsupported.
std::vector<AblationRun> ablation_means(const std::vector<std::pair<int32_t, int32_t>>& modes,
                                        std::string* unsupported) {
  const uint64_t seed = test::fresh_seed();
  std::printf("ablation: %s (generator seeds seed .. seed+%d)\n", test::seed_trace(seed).c_str(),
              kAblationSeeds - 1);
  std::vector<AblationRun> mean(modes.size());
  for (int i = 0; i < kAblationSeeds; ++i) {
    const auto runs = ablation_runs(seed + i, modes);
    for (std::size_t m = 0; m < modes.size(); ++m) {
      if (runs[m].status != QATTN_OK) {
        *unsupported = runs[m].message;
        if (runs[m].status != QATTN_ERROR_UNSUPPORTED)
          ADD_FAILURE() << qattn_status_string(runs[m].status) << ": " << runs[m].message;
        return {};
      }
      mean[m].dq_cos_gpu += runs[m].dq_cos_gpu / kAblationSeeds;
      mean[m].dq_cos_emu += runs[m].dq_cos_emu / kAblationSeeds;
      std::printf("  seed+%d format=%d dov=%d: dQ cos GPU %.6f, emulation %.6f\n", i,
                  modes[m].first, modes[m].second, runs[m].dq_cos_gpu, runs[m].dq_cos_emu);
    }
  }
  return mean;
}

TEST(SageBwdBackward, AblationSixteenBitDoVAboveQuantizedOnDq) {
  QATTN_SKIP_WITHOUT_GPU();
  std::string unsupported;
  const auto m = ablation_means(
      {{QATTN_BWD_INT8, QATTN_BWD_DOV_16BIT}, {QATTN_BWD_INT8, QATTN_BWD_DOV_QUANTIZED}},
      &unsupported);
  ASSERT_EQ(m.size(), 2u) << unsupported;
  // The scheme's direction on these inputs (if the emulation did not show it, the GPU's
  // would not mean anything), then the GPU's.
  EXPECT_GT(m[0].dq_cos_emu, m[1].dq_cos_emu) << "emulation: the direction fails on these seeds";
  EXPECT_GT(m[0].dq_cos_gpu, m[1].dq_cos_gpu)
      << "GPU dQ cos: 16-bit dO·Vᵀ " << m[0].dq_cos_gpu << ", quantized " << m[1].dq_cos_gpu
      << " (emulation " << m[0].dq_cos_emu << " vs " << m[1].dq_cos_emu << ")";
}

TEST(SageBwdBackward, AblationInt8AboveFp8OnDq) {
  QATTN_SKIP_WITHOUT_GPU();
  std::string unsupported;
  const auto m = ablation_means(
      {{QATTN_BWD_INT8, QATTN_BWD_DOV_16BIT}, {QATTN_BWD_E4M3, QATTN_BWD_DOV_16BIT}}, &unsupported);
  if (m.empty() && !HasFailure())
    GTEST_SKIP() << "the E4M3 backward is not run by this build: " << unsupported;
  ASSERT_EQ(m.size(), 2u);
  EXPECT_GT(m[0].dq_cos_emu, m[1].dq_cos_emu) << "emulation: the direction fails on these seeds";
  EXPECT_GT(m[0].dq_cos_gpu, m[1].dq_cos_gpu)
      << "GPU dQ cos: INT8 " << m[0].dq_cos_gpu << ", E4M3 " << m[1].dq_cos_gpu << " (emulation "
      << m[0].dq_cos_emu << " vs " << m[1].dq_cos_emu << ")";
}

}  // namespace
