// The 16-bit ("precise") forward on the GPU (scheme QATTN_SCHEME_PRECISE16) against its
// contract, the CPU emulation in precise mode (emulate::attention_with_precision,
// Precision::Precise: 16-bit Q·Kᵀ and P·V, FP32 sums), and against FP64:
//   - O and the LSE equal the emulation to rounding (bounds below, with their reasons);
//   - every output element is written, nothing past the output is;
//   - on the large-logit inputs where 8-bit Q·Kᵀ loses accuracy, it keeps the 16-bit
//     accuracy (the reason the mode exists);
// over fixed and fresh random shapes: tails, GQA, head dims 64 and 128 and padded ones
// (40, 96, and 100 with rows padded to 104: the O tail written without TMA), causal
// either alignment with Nq != Nkv, sliding windows, key-padding lengths, fp16 and bf16,
// HND and NHD. What the family declares (masks, no workspace) is checked on the CPU in
// tests/cpu/test_api_registry.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "emulate/precision.h"
#include "gpu_util.h"
#include "qattn/qattn.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

using namespace qattn;

// ---- bounds ------------------------------------------------------------------------
// GPU against the emulation. Both form the exact products of the same 16-bit Q and K
// and sum them in FP32 (in different orders: a relative ~1e-6 of the largest term), scale
// them (the GPU with one FMA that also subtracts the max, the emulator with two roundings)
// and take exp2 (the GPU's ex2.approx is within 2 ulp of the C library's). So P agrees to
// a relative δ ≈ 1e-6 before both round it to the input type (an ulp of 2^-7 relative in
// bf16, 2^-10 in fp16). Where the two P straddle a rounding boundary, one P element
// differs by one ulp: about 2δ/ulp of the elements (bf16 ~3e-4, fp16 ~2e-3), each moving
// its row's O by at most ulp·(p_j/l)·(|v_j| + |o|). Since Σ p_j/l = 1, all of a row's
// flips together move it by at most ulp·2·max|V|: the hard bound. Then O is rounded to
// the output type (2^-8 relative in bf16, 2^-11 in fp16). Per element the tight bound is
//   |gpu − emu| ≤ out_round·|emu| + 1e-4·max|emu row|
// (the second term ~100× the order differences), and at most kFlipFraction of the
// elements may exceed it (rows with a flipped P element whose weight is not small).
constexpr double kOrderSlack = 1e-4;
constexpr double kFlipFraction = 1e-2;
// The LSE: m + log2 l in FP32 on both sides, l the sum of the rounded P; a flip moves
// ln l by at most ulp·p_j/l. Tight: 2e-5·(1 + |lse|) (FP32 order and log2); at most
// kFlipFraction of the rows beyond it, none beyond the hard bound of one ulp.
constexpr double kLseRel = 2e-5;
// Over the tensor, 1 − CosSim(gpu, emu) ≤ 2e-5: the bf16 output rounding (≤ ½·2^-16 =
// 7.6e-6) plus the flips (weights p_j/l of a few percent at most on these inputs: each
// moves a row by a relative ≲ 2^-7·0.05, squared ≲ 2e-7).
constexpr double kGpuEmuOneMinusCos = 2e-5;

struct Case {
  int batch = 1, heads_q = 4, heads_kv = 2, nq = 200, nkv = 200, d = 128;
  int row_pitch = 0;  // elements between rows (0: d, which must then be a multiple of 8)
  bool causal = false, top_left = false, bf16 = true, nhd = false;
  int window_left = -1, window_right = -1;  // >= 0: a sliding window side
  std::vector<int> kv_lengths;              // per batch entry, or none
  float q_gain = 1.0f;                      // 8: the large-logit family
  bool attn_mask = false;  // a random boolean (B, 1, Nq, Nkv) mask, every 7th row hidden
  std::uint64_t seed = 1;
  int pitch() const { return row_pitch > 0 ? row_pitch : d; }
  std::string describe() const {
    std::string s = "B" + std::to_string(batch) + " Hq" + std::to_string(heads_q) + " Hkv" +
                    std::to_string(heads_kv) + " Nq" + std::to_string(nq) + " Nkv" +
                    std::to_string(nkv) + " d" + std::to_string(d) +
                    (row_pitch > 0 ? "/" + std::to_string(row_pitch) : "") +
                    (causal ? (top_left ? " causal-TL" : " causal-BR") : "") +
                    (window_left >= 0 || window_right >= 0
                         ? " win" + std::to_string(window_left) + "," + std::to_string(window_right)
                         : "") +
                    (kv_lengths.empty() ? "" : " kvlen") + (attn_mask ? " attn_mask" : "") +
                    (q_gain != 1.f ? " q×8" : "") +
                    (bf16 ? " bf16" : " fp16") + (nhd ? " NHD" : " HND");
    return s + " seed " + std::to_string(seed);
  }
};

// A (B, H, N, d) tensor of 16-bit values on the device in HND or NHD with rows `pitch`
// elements apart (the padding holds NaN: never read), and its float copy.
struct Input {
  Tensor4 host;
  test::DeviceBuffer<uint16_t> dev;
  qattn_tensor view{};
  Input(int b, int h, int n, int d, int pitch, bool nhd, bool bf16, float gain, std::mt19937_64& rng)
      : host(b, h, n, d), dev(std::size_t(b) * h * n * pitch) {
    std::normal_distribution<float> normal;
    std::vector<uint16_t> bits(dev.count, 0xFFFF);
    for (int ib = 0; ib < b; ++ib)
      for (int ih = 0; ih < h; ++ih)
        for (int in = 0; in < n; ++in)
          for (int e = 0; e < d; ++e) {
            const uint16_t x = test::to_bits16(gain * normal(rng), bf16);
            host.at(ib, ih, in, e) = test::from_bits16(x, bf16);
            const std::size_t row = nhd ? (std::size_t(ib) * n + in) * h + ih
                                        : (std::size_t(ib) * h + ih) * n + in;
            bits[row * pitch + e] = x;
          }
    dev.upload(bits);
    view = nhd ? qattn_tensor{dev.ptr, int64_t{n} * h * pitch, pitch, int64_t{h} * pitch}
               : qattn_tensor{dev.ptr, int64_t{h} * n * pitch, int64_t{n} * pitch, pitch};
  }
};

qattn_fwd_params params_for(const Case& c, const Input& q, const Input& k, const Input& v,
                            void* o, float* lse, const int* kv_lengths, const uint8_t* mask) {
  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.scheme = QATTN_SCHEME_PRECISE16;
  p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
  p.batch = c.batch;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.seqlen_q = c.nq;
  p.seqlen_kv = c.nkv;
  p.head_dim = c.d;
  p.causal = c.causal ? 1 : 0;
  p.alignment = c.top_left ? QATTN_ALIGN_TOP_LEFT : QATTN_ALIGN_BOTTOM_RIGHT;
  if (c.window_left >= 0 || c.window_right >= 0) {
    p.window = 1;
    p.window_left = c.window_left;
    p.window_right = c.window_right;
  }
  p.kv_lengths = kv_lengths;
  if (mask != nullptr) {  // (B, 1, Nq, Nkv) bytes: the head dimension broadcast
    p.attn_mask_type = QATTN_MASK_BOOL;
    p.attn_mask = mask;
    p.attn_mask_stride_b = int64_t{c.nq} * c.nkv;
    p.attn_mask_stride_h = 0;
    p.attn_mask_stride_q = c.nkv;
    p.attn_mask_stride_k = 1;
  }
  p.q = q.view;
  p.k = k.view;
  p.v = v.view;
  const int64_t pitch = c.pitch();
  p.o = {o, int64_t{c.heads_q} * c.nq * pitch, int64_t{c.nq} * pitch, pitch};
  p.lse = lse;
  return p;
}

void run_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  std::mt19937_64 rng(c.seed);
  const int pitch = c.pitch();
  Input q(c.batch, c.heads_q, c.nq, c.d, pitch, c.nhd, c.bf16, c.q_gain, rng);
  Input k(c.batch, c.heads_kv, c.nkv, c.d, pitch, c.nhd, c.bf16, 1.f, rng);
  Input v(c.batch, c.heads_kv, c.nkv, c.d, pitch, c.nhd, c.bf16, 1.f, rng);
  test::DeviceBuffer<int> lens(std::max<std::size_t>(1, c.kv_lengths.size()));
  if (!c.kv_lengths.empty()) lens.upload(c.kv_lengths);
  // The mask: each key visible with probability 0.7, every 7th row hidden entirely (SDPA
  // drop-in's convention for such rows: O = 0, LSE = -inf).
  std::vector<uint8_t> mask_bytes;
  Tensor4 additive;
  if (c.attn_mask) {
    mask_bytes.resize(std::size_t(c.batch) * c.nq * c.nkv);
    additive = Tensor4(c.batch, 1, c.nq, c.nkv);
    std::bernoulli_distribution visible(0.7);
    for (int b = 0; b < c.batch; ++b)
      for (int i = 0; i < c.nq; ++i)
        for (int j = 0; j < c.nkv; ++j) {
          const bool on = i % 7 != 3 && visible(rng);
          mask_bytes[(std::size_t(b) * c.nq + i) * c.nkv + j] = on ? 1 : 0;
          additive.at(b, 0, i, j) = on ? 0.f : -INFINITY;
        }
  }
  test::DeviceBuffer<uint8_t> mask_dev(std::max<std::size_t>(1, mask_bytes.size()));
  if (c.attn_mask) mask_dev.upload(mask_bytes);

  // Output (HND with the row pitch) and a guard of 4096 elements after it, all NaN; the
  // row padding must stay NaN too.
  const std::size_t rows = std::size_t(c.batch) * c.heads_q * c.nq;
  const std::size_t o_count = rows * pitch, guard = 4096;
  test::DeviceBuffer<uint16_t> o(o_count + guard);
  test::DeviceBuffer<float> lse(rows);
  QATTN_CUDA_OK(cudaMemset(o.ptr, 0xFF, (o_count + guard) * 2));  // NaN in both formats
  QATTN_CUDA_OK(cudaMemset(lse.ptr, 0xFF, lse.count * 4));

  const qattn_fwd_params p =
      params_for(c, q, k, v, o.ptr, lse.ptr, c.kv_lengths.empty() ? nullptr : lens.ptr,
                 c.attn_mask ? mask_dev.ptr : nullptr);
  std::size_t ws_bytes = 1;
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &ws_bytes), QATTN_OK) << qattn_last_error_message();
  ASSERT_EQ(ws_bytes, 0u) << "the 16-bit forward reads its inputs as given";
  ASSERT_EQ(qattn_fwd(&p, nullptr, 0, nullptr), QATTN_OK) << qattn_last_error_message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());

  // ---- the emulation, the reference ----
  AttentionParams ap;
  ap.mask = c.causal ? Mask::Causal : Mask::None;
  ap.alignment = c.top_left ? Diagonal::TopLeft : Diagonal::BottomRight;
  ap.window_left = c.window_left;
  ap.window_right = c.window_right;
  ap.kv_lengths = c.kv_lengths;
  if (c.attn_mask) ap.attn_mask = additive;
  const emulate::PrecisionForward emu = emulate::attention_with_precision(
      q.host, k.host, v.host, ap, emulate::Precision::Precise,
      c.bf16 ? emulate::InputDtype::Bf16 : emulate::InputDtype::Fp16);
  const reference::ForwardResult ref = reference::attention_forward(q.host, k.host, v.host, ap);

  // ---- O and the LSE ----
  const std::vector<uint16_t> ob = o.download();
  for (std::size_t i = o_count; i < o_count + guard; ++i)
    ASSERT_EQ(ob[i], 0xFFFF) << "the forward wrote past o (element " << i - o_count << ")";
  const std::vector<float> lg = lse.download();
  const double out_round = c.bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double p_ulp = c.bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
  float v_max = 0.f;
  for (std::size_t i = 0; i < v.host.size(); ++i) v_max = std::max(v_max, std::fabs(v.host.data[i]));
  std::vector<float> g_o, e_o;
  std::vector<double> r_o;
  std::size_t beyond = 0, lse_beyond = 0, elements = 0;
  double worst_beyond = 0.0;
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads_q; ++h)
      for (int i = 0; i < c.nq; ++i) {
        const float* er = emu.fwd.o.row(b, h, i);
        double row_max = 0.0;
        for (int e = 0; e < c.d; ++e) row_max = std::max(row_max, std::fabs(double(er[e])));
        const std::size_t row = (std::size_t(b) * c.heads_q + h) * c.nq + i;
        for (int e = 0; e < pitch; ++e) {
          const uint16_t bits = ob[row * pitch + e];
          if (e >= c.d) {
            ASSERT_EQ(bits, 0xFFFF) << "row padding written: o[" << row << "][" << e << "]";
            continue;
          }
          const float got = test::from_bits16(bits, c.bf16);
          ASSERT_FALSE(std::isnan(got)) << "o[" << b << "," << h << "," << i << "," << e
                                        << "] unwritten";
          const double diff = std::fabs(double(got) - er[e]);
          const double tight = out_round * std::fabs(er[e]) + kOrderSlack * row_max;
          if (diff > tight) {
            ++beyond;
            worst_beyond = std::max(worst_beyond, diff);
          }
          ASSERT_LE(diff, tight + 2.0 * p_ulp * v_max)
              << "o[" << b << "," << h << "," << i << "," << e << "]: gpu " << got << " emu " << er[e];
          g_o.push_back(got);
          e_o.push_back(er[e]);
          r_o.push_back(ref.o.at(b, h, i, e));
          ++elements;
        }
        const double el = emu.fwd.lse[row], gl = lg[row];
        if (std::isinf(el)) {
          EXPECT_EQ(gl, el) << "lse[" << row << "] of a row that sees no key";
        } else {
          const double diff = std::fabs(gl - el), tight = kLseRel * (1.0 + std::fabs(el));
          lse_beyond += diff > tight;
          EXPECT_LE(diff, tight + p_ulp) << "lse[" << row << "]: gpu " << gl << " emu " << el;
        }
      }
  EXPECT_LE(double(beyond), kFlipFraction * double(elements) + 1.0)
      << beyond << " elements beyond the tight bound (worst " << worst_beyond << ")";
  EXPECT_LE(double(lse_beyond), kFlipFraction * double(rows) + 1.0)
      << lse_beyond << " LSE rows beyond the tight bound";
  const metrics::ErrorMetrics mge = metrics::compare(g_o, e_o);
  const metrics::ErrorMetrics mg = metrics::compare(g_o, r_o);
  const metrics::ErrorMetrics me = metrics::compare(e_o, r_o);
  if (mge.cos_sim == mge.cos_sim)  // rows that see no key are all zeros: no CosSim then
    EXPECT_LE(1.0 - mge.cos_sim, kGpuEmuOneMinusCos) << "CosSim(gpu, emulation) " << mge.cos_sim;
  // |gpu − ref| ≤ |emu − ref| + |gpu − emu| for unit vectors (|x − y| = sqrt(2(1 − cos))).
  EXPECT_LE(std::sqrt(std::max(0.0, 1.0 - mg.cos_sim)),
            std::sqrt(std::max(0.0, 1.0 - me.cos_sim)) + std::sqrt(kGpuEmuOneMinusCos))
      << "CosSim to FP64: gpu " << mg.cos_sim << ", emulator " << me.cos_sim;
  // 16-bit products of 16-bit-exact inputs with FP32 sums: the output's own rounding
  // (half an ulp, 2^-9 relative per element in bf16, 2^-12 in fp16: 1 − CosSim ≤ ½·rel²)
  // plus P's (no larger): 1 − CosSim ≤ 2·rel², 2^-17 in bf16 and 2^-23 in fp16, with a
  // factor 4 of margin here, whatever the logits' scale.
  EXPECT_GE(mg.cos_sim, 1.0 - std::ldexp(1.0, c.bf16 ? -15 : -21)) << "CosSim(gpu, fp64)";
  std::printf("  %-72s cos(gpu,emu) 1-%.2e  cos(gpu,fp64) 1-%.2e  beyond %zu\n",
              c.describe().c_str(), 1.0 - mge.cos_sim, 1.0 - mg.cos_sim, beyond);
}

TEST(PreciseForward, FixedShapesMatchTheEmulation) {
  QATTN_SKIP_WITHOUT_GPU();
  for (const int d : {128, 64})
    for (const bool causal : {false, true}) {
      Case c;
      c.d = d;
      c.causal = causal;
      c.nq = 300;
      c.nkv = 437;  // tails in both, Nq != Nkv (bottom-right causal)
      run_case(c);
      if (HasFailure()) return;
    }
}

TEST(PreciseForward, PaddedHeadDimsAndTheOutputTail) {
  QATTN_SKIP_WITHOUT_GPU();
  for (const int d : {40, 96}) {
    Case c;
    c.d = d;
    c.nq = 150;
    c.nkv = 260;
    run_case(c);
    if (HasFailure()) return;
  }
  Case c;  // d % 8 != 0: rows padded to 104 elements; the last 4 columns bypass TMA
  c.d = 100;
  c.row_pitch = 104;
  c.nq = 130;
  c.nkv = 129;
  c.causal = true;
  c.bf16 = false;
  run_case(c);
}

TEST(PreciseForward, MasksWindowsAndKeyPadding) {
  QATTN_SKIP_WITHOUT_GPU();
  Case tl;  // SDPA's is_causal: top-left with Nq > Nkv (the last rows see every key)
  tl.causal = true;
  tl.top_left = true;
  tl.nq = 390;
  tl.nkv = 260;
  run_case(tl);
  Case win;  // a sliding window on both sides, crossing tiles
  win.window_left = 150;
  win.window_right = 20;
  win.nq = 520;
  win.nkv = 520;
  run_case(win);
  Case pad;  // key padding: one entry sees 1 key, one none (O = 0, LSE = -inf), one all
  pad.batch = 3;
  pad.nkv = 333;
  pad.kv_lengths = {1, 0, 333};
  pad.causal = true;
  pad.top_left = true;
  run_case(pad);
}

TEST(PreciseForward, BooleanAttnMask) {
  QATTN_SKIP_WITHOUT_GPU();
  for (const int d : {128, 64}) {
    Case c;
    c.batch = 2;
    c.d = d;
    c.nq = 333;
    c.nkv = 290;
    c.attn_mask = true;
    c.bf16 = d == 64;
    run_case(c);
    if (HasFailure()) return;
  }
}

TEST(PreciseForward, LargeLogitsKeepSixteenBitAccuracy) {
  QATTN_SKIP_WITHOUT_GPU();
  // The family where INT8 Q·Kᵀ falls to ~0.999 (docs/design.md, "Precision modes"):
  // Q scaled by 8. The 16-bit forward's bound to FP64 does not depend on the scale.
  Case c;
  c.q_gain = 8.f;
  c.nq = 512;
  c.nkv = 512;
  run_case(c);
}

TEST(PreciseForward, Fp16NhdAndMqa) {
  QATTN_SKIP_WITHOUT_GPU();
  Case c;
  c.bf16 = false;
  c.nhd = true;
  c.heads_q = 6;
  c.heads_kv = 1;
  c.nq = 129;
  c.nkv = 64;
  c.causal = true;
  run_case(c);
}

TEST(PreciseForward, RandomShapesMatchTheEmulation) {
  QATTN_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 10; ++i) {
    Case c;
    c.batch = pick(1, 2);
    c.heads_kv = pick(1, 3);
    c.heads_q = c.heads_kv * pick(1, 3);
    c.nq = pick(1, 600);
    c.nkv = pick(1, 600);
    c.d = 8 * pick(1, 16);
    c.causal = pick(0, 1) == 1;
    c.top_left = pick(0, 1) == 1;
    if (pick(0, 3) == 0) {
      c.window_left = pick(-1, 300);
      c.window_right = pick(-1, 300);
    }
    if (pick(0, 3) == 0)
      for (int b = 0; b < c.batch; ++b) c.kv_lengths.push_back(pick(0, c.nkv));
    c.bf16 = pick(0, 1) == 1;
    c.nhd = pick(0, 1) == 1;
    c.seed = rng();
    run_case(c);
    if (HasFailure()) return;
  }
}

}  // namespace
