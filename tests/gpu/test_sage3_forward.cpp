// The SageAttention3 NVFP4 forward on the GPU (scheme QATTN_SCHEME_SAGE3_NVFP4) against
// its contract, the CPU emulation (src/emulate/sage3), and against FP64:
//   - the quantized operands in the workspace (Q̂, K̂, V̂) equal the numerics layer's
//     NVFP4 of the emulator's smoothed inputs, bit for bit;
//   - O and the LSE equal the emulation to rounding (bounds below, with their reasons);
//   - every output element is written, nothing past the output is;
// over fixed and fresh random shapes: tails, GQA, causal (bottom-right) with Nq != Nkv,
// head dims 64 and 128, fp16 and bf16, HND and NHD.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/sage3_fwd/workspace.h"
#include "emulate/sage3.h"
#include "gpu_util.h"
#include "numerics/quantize.h"
#include "qattn/qattn.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

using namespace qattn;

// ---- bounds ------------------------------------------------------------------------
// GPU against the emulation. Both compute the same quantized attention in FP32 from the
// same quantized Q̂, K̂, V̂ (checked bit for bit). They differ in the order of the FP32
// sums (tensor-core dot products; a quad's row sums), a relative 1e-6 per quantity,
// and in exp2/log2 (CUDA's against the C library's: 2 ulp). P2 = P̃/s_p1 is then
// rounded to E2M1 on both sides, so where the two P̃ straddle a rounding boundary one
// P̂ element differs by one E2M1 step (at most a third of its block's largest value):
// rare (a relative 1e-6 perturbation against steps of a relative 1/4 to 1/2), but
// unbounded in count on random inputs. Then O is rounded to bf16 (2^-8) or fp16 (2^-11).
// Per element the tight bound is
//   |gpu − emu| ≤ out_round·|emu| + 1e-4·max|emu row|
// (the second term ~10× the order differences). A flip moves its whole row (nearly every
// one of its d elements goes past the tight bound), so the count that is bounded is rows:
// at most kFlipRowFraction of them, plus one, may hold elements beyond it. A flip needs
// the two P̃ within ~1e-6 of an E2M1 boundary (steps of 1/4 to 1/2 relative): a few in a
// million elements, ~2e-3 of rows at Nkv ≈ 500; the bound is five times that. Over the
// tensor,
// 1 − CosSim(gpu, emu) ≤ 2e-5: the bf16 output rounding (≤ ½·2^-16 = 7.6e-6) plus the
// flips (about one row in a hundred carries one, each moving that row's output by a
// relative ~(½·p_j/‖p‖)² ≲ 4e-4 on diffuse rows: ≲ 4e-6 over the tensor).
constexpr double kOrderSlack = 1e-4;
constexpr double kFlipRowFraction = 1e-2;
constexpr double kGpuEmuOneMinusCos = 2e-5;
// The LSE is FP32 in both: m + log2 l (l sums P̃ before any FP4 rounding: no flips) plus
// sm_scale·q·c (the same FP32 value on both sides).
constexpr double kLseRel = 2e-5;

struct Case {
  int batch = 1, heads_q = 4, heads_kv = 2, nq = 200, nkv = 200, d = 128;
  bool causal = false, bf16 = true, nhd = false;
  float k_bias = 2.0f;  // a per-channel bias on K: what smoothing removes
  std::uint64_t seed = 1;
  std::string describe() const {
    return "B" + std::to_string(batch) + " Hq" + std::to_string(heads_q) + " Hkv" +
           std::to_string(heads_kv) + " Nq" + std::to_string(nq) + " Nkv" + std::to_string(nkv) +
           " d" + std::to_string(d) + (causal ? " causal" : "") + (bf16 ? " bf16" : " fp16") +
           (nhd ? " NHD" : " HND") + " seed " + std::to_string(seed);
  }
};

// A (B, H, N, d) tensor of 16-bit values on the device in HND or NHD, its float copy.
struct Input {
  Tensor4 host;
  test::DeviceBuffer<uint16_t> dev;
  qattn_tensor view{};
  Input(int b, int h, int n, int d, bool nhd, bool bf16, std::mt19937_64& rng,
        const std::vector<float>& bias)
      : host(b, h, n, d), dev(std::size_t(b) * h * n * d) {
    std::normal_distribution<float> normal;
    std::vector<uint16_t> bits(host.size());
    for (int ib = 0; ib < b; ++ib)
      for (int ih = 0; ih < h; ++ih)
        for (int in = 0; in < n; ++in)
          for (int e = 0; e < d; ++e) {
            const uint16_t x = test::to_bits16(normal(rng) + (bias.empty() ? 0.f : bias[e]), bf16);
            host.at(ib, ih, in, e) = test::from_bits16(x, bf16);
            const std::size_t at = nhd ? ((std::size_t(ib) * n + in) * h + ih) * d + e
                                       : ((std::size_t(ib) * h + ih) * n + in) * d + e;
            bits[at] = x;
          }
    dev.upload(bits);
    view = nhd ? qattn_tensor{dev.ptr, int64_t{n} * h * d, d, int64_t{h} * d}
               : qattn_tensor{dev.ptr, int64_t{h} * n * d, int64_t{n} * d, d};
  }
};

std::vector<float> bf16_to_float(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) f[i] = test::from_bits16(b[i], true);
  return f;
}

void run_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  std::mt19937_64 rng(c.seed);
  std::vector<float> kb(c.d);
  std::normal_distribution<float> normal;
  for (float& x : kb) x = c.k_bias * normal(rng);
  Input q(c.batch, c.heads_q, c.nq, c.d, c.nhd, c.bf16, rng, {});
  Input k(c.batch, c.heads_kv, c.nkv, c.d, c.nhd, c.bf16, rng, kb);
  Input v(c.batch, c.heads_kv, c.nkv, c.d, c.nhd, c.bf16, rng, {});

  // Output (HND, contiguous) with a guard of 4096 elements after it, and the LSE.
  const std::size_t o_count = std::size_t(c.batch) * c.heads_q * c.nq * c.d, guard = 4096;
  test::DeviceBuffer<uint16_t> o(o_count + guard);
  test::DeviceBuffer<float> lse(std::size_t(c.batch) * c.heads_q * c.nq);
  cudaMemset(o.ptr, 0xFF, (o_count + guard) * 2);  // NaN in both 16-bit formats
  cudaMemset(lse.ptr, 0xFF, lse.count * 4);

  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.scheme = QATTN_SCHEME_SAGE3_NVFP4;
  p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
  p.batch = c.batch;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.seqlen_q = c.nq;
  p.seqlen_kv = c.nkv;
  p.head_dim = c.d;
  p.causal = c.causal ? 1 : 0;
  p.q = q.view;
  p.k = k.view;
  p.v = v.view;
  p.o = {o.ptr, int64_t{c.heads_q} * c.nq * c.d, int64_t{c.nq} * c.d, c.d};
  p.lse = lse.ptr;
  std::size_t ws_bytes = 0;
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &ws_bytes), QATTN_OK) << qattn_last_error_message();
  ASSERT_EQ(ws_bytes, sage3::workspace_layout(p).total);
  test::DeviceBuffer<uint8_t> ws(ws_bytes);
  ASSERT_EQ(qattn_fwd(&p, ws.ptr, ws_bytes, nullptr), QATTN_OK) << qattn_last_error_message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());

  // ---- the emulation, the reference ----
  AttentionParams ap;
  ap.mask = c.causal ? Mask::Causal : Mask::None;
  const emulate::EmulatedForward emu = emulate::sage3_attention(q.host, k.host, v.host, ap);
  const reference::ForwardResult ref = reference::attention_forward(q.host, k.host, v.host, ap);

  // ---- the quantized operands, bit for bit (numerics on the emulator's inputs) ----
  const sage3::WorkspaceLayout w = sage3::workspace_layout(p);
  const std::vector<uint8_t> wsb = ws.download();
  auto ws_bf16 = [&](std::size_t off, std::size_t count) {
    std::vector<uint16_t> b(count);
    std::memcpy(b.data(), wsb.data() + off, count * 2);
    return bf16_to_float(b);
  };
  const int nkv_pad = static_cast<int>(sage3::padded(c.nkv)),
            nq_pad = static_cast<int>(sage3::padded(c.nq));
  const std::vector<float> k_hat =
      ws_bf16(w.k_hat, std::size_t(c.batch) * c.heads_kv * nkv_pad * c.d);
  const std::vector<float> v_hat =
      ws_bf16(w.v_hat, std::size_t(c.batch) * c.heads_kv * nkv_pad * c.d);
  const std::vector<float> q_hat =
      ws_bf16(w.q_hat, std::size_t(c.batch) * c.heads_q * nq_pad * c.d);
  std::size_t k_bad = 0, v_bad = 0, q_bad = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_kv; ++h) {
      const std::span<const float> kin(k.host.row(b, h, 0), std::size_t(c.nkv) * c.d);
      const numerics::Smoothed ks =
          numerics::smooth_k(kin, c.nkv, c.d, numerics::MeanEstimate::AllTokens);
      const numerics::Fp4Quantized kq =
          numerics::quantize_fp4(ks.values, c.nkv, c.d, numerics::Fp4Format::NvFp4);
      const std::size_t kbase = (std::size_t(b) * c.heads_kv + h) * nkv_pad * c.d;
      for (std::size_t i = 0; i < kq.dequantized.size(); ++i)
        k_bad += k_hat[kbase + i] != kq.dequantized[i];
      std::vector<float> vt(std::size_t(c.d) * nkv_pad, 0.f);
      for (int j = 0; j < c.nkv; ++j)
        for (int e = 0; e < c.d; ++e) vt[std::size_t(e) * nkv_pad + j] = v.host.at(b, h, j, e);
      const numerics::Fp4Quantized vq =
          numerics::quantize_fp4(vt, c.d, nkv_pad, numerics::Fp4Format::NvFp4);
      for (int j = 0; j < nkv_pad; ++j)
        for (int e = 0; e < c.d; ++e)
          v_bad += v_hat[kbase + std::size_t(j) * c.d + e] !=
                   vq.dequantized[std::size_t(e) * nkv_pad + j];
    }
    for (int h = 0; h < c.heads_q; ++h) {
      const std::span<const float> qin(q.host.row(b, h, 0), std::size_t(c.nq) * c.d);
      const numerics::Smoothed qs = numerics::smooth_q(qin, c.nq, c.d, sage3::kQBlock);
      const numerics::Fp4Quantized qq =
          numerics::quantize_fp4(qs.values, c.nq, c.d, numerics::Fp4Format::NvFp4);
      const std::size_t qbase = (std::size_t(b) * c.heads_q + h) * nq_pad * c.d;
      for (std::size_t i = 0; i < qq.dequantized.size(); ++i)
        q_bad += q_hat[qbase + i] != qq.dequantized[i];
    }
  }
  EXPECT_EQ(k_bad, 0u) << "K̂ values that differ from NVFP4(K − c)";
  EXPECT_EQ(v_bad, 0u) << "V̂ values that differ from NVFP4(V) along the tokens";
  EXPECT_EQ(q_bad, 0u) << "Q̂ values that differ from NVFP4(Q − q̄)";

  // ---- O and the LSE ----
  const std::vector<uint16_t> ob = o.download();
  for (std::size_t i = o_count; i < o_count + guard; ++i)
    ASSERT_EQ(ob[i], 0xFFFF) << "the forward wrote past o (element " << i - o_count << ")";
  const std::vector<float> lg = lse.download();
  const double out_round = c.bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  std::vector<float> g_o(o_count), e_o(o_count);
  std::vector<double> r_o(o_count);
  std::size_t beyond = 0, rows_beyond = 0;
  double worst_beyond = 0.0;
  float v_max = 0.f;
  for (float x : v_hat) v_max = std::max(v_max, std::fabs(x));
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads_q; ++h)
      for (int i = 0; i < c.nq; ++i) {
        const float* er = emu.o.row(b, h, i);
        double row_max = 0.0;
        for (int e = 0; e < c.d; ++e) row_max = std::max(row_max, std::fabs(double(er[e])));
        const std::size_t beyond_before = beyond;
        for (int e = 0; e < c.d; ++e) {
          const std::size_t at = ((std::size_t(b) * c.heads_q + h) * c.nq + i) * c.d + e;
          const float got = test::from_bits16(ob[at], c.bf16);
          ASSERT_FALSE(std::isnan(got))
              << "o[" << b << "," << h << "," << i << "," << e << "] unwritten";
          const double diff = std::fabs(double(got) - er[e]);
          if (diff > out_round * std::fabs(er[e]) + kOrderSlack * row_max) {
            ++beyond;
            worst_beyond = std::max(worst_beyond, diff);
          }
          // One flipped P̂ element moves O by at most a third of the largest |V̂|.
          ASSERT_LE(diff, out_round * std::fabs(er[e]) + kOrderSlack * row_max + v_max / 3.0)
              << "o[" << b << "," << h << "," << i << "," << e << "]: gpu " << got << " emu "
              << er[e];
          g_o[at] = got;
          e_o[at] = er[e];
          r_o[at] = ref.o.at(b, h, i, e);
        }
        rows_beyond += beyond > beyond_before;
        const std::size_t row = (std::size_t(b) * c.heads_q + h) * c.nq + i;
        const double el = emu.lse[row], gl = lg[row];
        if (std::isinf(el)) {
          EXPECT_EQ(gl, el) << "lse[" << row << "]";
        } else {
          EXPECT_LE(std::fabs(gl - el), kLseRel * (1.0 + std::fabs(el)))
              << "lse[" << row << "]: gpu " << gl << " emu " << el;
        }
      }
  const std::size_t rows = std::size_t(c.batch) * c.heads_q * c.nq;
  EXPECT_LE(double(rows_beyond), kFlipRowFraction * double(rows) + 1.0)
      << rows_beyond << " of " << rows << " rows hold elements beyond the tight bound ("
      << beyond << " elements, worst " << worst_beyond << ")";
  const metrics::ErrorMetrics mge = metrics::compare(g_o, e_o);
  const metrics::ErrorMetrics mg = metrics::compare(g_o, r_o);
  const metrics::ErrorMetrics me = metrics::compare(e_o, r_o);
  EXPECT_LE(1.0 - mge.cos_sim, kGpuEmuOneMinusCos) << "CosSim(gpu, emulation) " << mge.cos_sim;
  // |gpu − ref| ≤ |emu − ref| + |gpu − emu| for unit vectors (|x − y| = sqrt(2(1 − cos))).
  EXPECT_LE(std::sqrt(std::max(0.0, 1.0 - mg.cos_sim)),
            std::sqrt(std::max(0.0, 1.0 - me.cos_sim)) + std::sqrt(kGpuEmuOneMinusCos))
      << "CosSim to FP64: gpu " << mg.cos_sim << ", emulator " << me.cos_sim;
  std::printf("  %-60s cos(gpu,emu) 1-%.2e  cos(gpu,fp64) %.6f  emu %.6f  beyond %zu (%zu rows)\n",
              c.describe().c_str(), 1.0 - mge.cos_sim, mg.cos_sim, me.cos_sim, beyond, rows_beyond);
}

TEST(Sage3Forward, FixedShapesMatchTheEmulation) {
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

TEST(Sage3Forward, Fp16NhdAndMqa) {
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

TEST(Sage3Forward, RandomShapesMatchTheEmulation) {
  QATTN_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 8; ++i) {
    Case c;
    c.batch = pick(1, 2);
    c.heads_kv = pick(1, 3);
    c.heads_q = c.heads_kv * pick(1, 3);
    c.nq = pick(1, 520);
    c.nkv = pick(1, 520);
    c.d = pick(0, 1) ? 128 : 64;
    c.causal = pick(0, 1) == 1;
    c.bf16 = pick(0, 1) == 1;
    c.nhd = pick(0, 1) == 1;
    c.seed = rng();
    run_case(c);
    if (HasFailure()) return;
  }
}

}  // namespace
