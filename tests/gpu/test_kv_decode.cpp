// The KV-cache decode on the GPU through the C ABI (qattn_kv_decode), on caches the CPU
// emulation filled (emulate::append: the decode is tested on its own, whatever the GPU
// append does), against
//   (1) the CPU emulation of the decode (emulate::decode_emulated, its written
//       contract) with the same split count, to FP32 rounding plus the output's 16-bit
//       rounding; and
//   (2) exact FP64 attention over the unquantized K and V, at least as close as the
//       emulation on the same inputs.
// Over formats, dtypes, head dims (16..256, padded and native), GQA ratios up to 32:1
// (several row groups per KV head), 1..16 query tokens, causal on and off, page sizes 1,
// 7, 16 and 64 with pages in shuffled order, lengths with tails (and 0), and split
// counts 1, 3 and the automatic choice. Also: a bad block-table entry on the device makes
// that sequence NaN and leaves the others exact; o has guard bands that stay untouched;
// bad inputs are named and launch nothing. Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emulate/kv_cache.h"
#include "gpu_util.h"
#include "numerics/formats.h"
#include "qattn/qattn.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

using namespace qattn;
using emulate::KvFormat;
using test::DeviceBuffer;

// ---- bounds ------------------------------------------------------------------------
// GPU against the emulation. Both compute the same quantized attention in FP32; they
// differ in the order of the sums (tensor-core dot products over d, per-warp online
// softmax merged at the end, exp2f), a relative 1e-6 per quantity, and in P·V, where
// the kernel rounds P to a 16-bit pair (high part plus remainder: 2^-22 relative in
// FP16, 2^-16 in BF16). Then the output is rounded to bf16 (8 significant bits: at most
// 2^-8 relative) or fp16 (11 bits: 2^-11). Per element:
//   |gpu − emu| ≤ 2^-8·|emu| (bf16; fp16 2^-11) + 1e-4·max|emu row|,
// the second term a factor of ~10 over the order differences of a row of ≤ 4K keys.
constexpr double kOrderSlack = 1e-4;
// The LSE is FP32 in both: m + log2 l (l a sum of up to L terms: 1e-6 relative) plus
// sm_scale·q·c (a dot product over d in a different order: 1e-6 of Σ|q_c·c_c|).
constexpr double kLseRel = 2e-5;
// GPU against FP64, bounded by the emulator. For unit vectors |x − y| = sqrt(2(1 − cos)),
// so the triangle inequality |gpu − ref| ≤ |emu − ref| + |gpu − emu| reads
//   sqrt(1 − cos(gpu, ref)) ≤ sqrt(1 − cos(emu, ref)) + sqrt(1 − cos(gpu, emu)),
// whatever the correlation of the two errors. The last term is the output rounding
// (≤ 2^-8 relative per element: 1 − cos ≤ ½·2^-16 = 7.6e-6) plus the order
// differences: bounded by 1e-5.
constexpr double kGpuEmuOneMinusCos = 1e-5;

struct Case {
  KvFormat format = KvFormat::NvFp4;
  bool bf16 = true;
  bool smoothing = true;
  int heads_kv = 2, group = 4, nq = 1, d = 128, page_size = 16;
  std::vector<int> lengths{300, 1};
  bool causal = true;
  int splits = 1;      // 0: the library chooses
  float k_bias = 4.f;  // a per-channel bias of K (what smoothing removes)
};

std::string describe(const Case& c) {
  std::string s = std::string(emulate::kv_format_name(c.format)) + (c.bf16 ? " bf16" : " fp16") +
                  " hkv " + std::to_string(c.heads_kv) + " g " + std::to_string(c.group) + " nq " +
                  std::to_string(c.nq) + " d " + std::to_string(c.d) + " page " +
                  std::to_string(c.page_size) + (c.causal ? " causal" : "") + " splits " +
                  std::to_string(c.splits) + (c.smoothing ? "" : " no-smooth") + " L";
  for (int l : c.lengths) s += " " + std::to_string(l);
  return s;
}

int32_t c_format(KvFormat f) { return static_cast<int32_t>(f); }

// The cache, its inputs and its device copies for one case.
struct Built {
  emulate::PagedCache cache;
  std::vector<Tensor4> k, v;    // per sequence (1, heads_kv, L, d): the unquantized inputs
  Tensor4 q;                    // (B, Hq, nq, d), values of the dtype
  std::vector<int32_t> tables;  // B × max_pages_per_seq
};

Built build(const Case& c, std::mt19937& rng) {
  const int B = static_cast<int>(c.lengths.size());
  const int max_len = std::max(1, *std::max_element(c.lengths.begin(), c.lengths.end()));
  emulate::KvCacheConfig cfg;
  cfg.format = c.format;
  cfg.heads_kv = c.heads_kv;
  cfg.head_dim = c.d;
  cfg.page_size = c.page_size;
  cfg.max_seqs = B;
  cfg.max_pages_per_seq = (max_len + c.page_size - 1) / c.page_size;
  cfg.num_pages = B * cfg.max_pages_per_seq + 3;  // spare pages stay unassigned
  cfg.k_smoothing = c.smoothing ? emulate::KvSmoothing::PrefillMean : emulate::KvSmoothing::None;
  Built bt{emulate::make_paged_cache(cfg), {}, {}, Tensor4(B, c.heads_kv * c.group, c.nq, c.d), {}};
  std::vector<int32_t> pool(cfg.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  bt.tables.assign(static_cast<std::size_t>(B) * cfg.max_pages_per_seq, -1);
  std::normal_distribution<float> n01(0.f, 1.f);
  auto r16 = [&](float x) { return c.bf16 ? numerics::bf16_round(x) : numerics::fp16_round(x); };
  std::vector<float> bias(c.d);
  for (float& b : bias) b = c.k_bias * n01(rng);
  for (int s = 0; s < B; ++s) {
    std::vector<int32_t> pages(cfg.max_pages_per_seq);
    for (int i = 0; i < cfg.max_pages_per_seq; ++i) pages[i] = pool[s * cfg.max_pages_per_seq + i];
    emulate::assign_pages(bt.cache, s, pages);
    std::copy(pages.begin(), pages.end(), bt.tables.begin() + s * cfg.max_pages_per_seq);
    const int L = c.lengths[s];
    Tensor4 k(1, c.heads_kv, L, c.d), v(1, c.heads_kv, L, c.d);
    for (int h = 0; h < c.heads_kv; ++h)
      for (int t = 0; t < L; ++t)
        for (int e = 0; e < c.d; ++e) {
          k.at(0, h, t, e) = r16(n01(rng) + bias[e]);
          v.at(0, h, t, e) = r16(n01(rng));
        }
    // A prefill and then the decode tokens one by one (c is fixed by the prefill).
    const int prefill = std::max(0, L - c.nq);
    auto slice = [&](const Tensor4& x, int t0, int n) {
      Tensor4 out(1, c.heads_kv, n, c.d);
      for (int h = 0; h < c.heads_kv; ++h)
        std::copy(x.row(0, h, t0), x.row(0, h, t0) + static_cast<std::size_t>(n) * c.d,
                  out.row(0, h, 0));
      return out;
    };
    if (prefill > 0) emulate::append(bt.cache, s, slice(k, 0, prefill), slice(v, 0, prefill));
    for (int t = prefill; t < L; ++t) emulate::append(bt.cache, s, slice(k, t, 1), slice(v, t, 1));
    bt.k.push_back(std::move(k));
    bt.v.push_back(std::move(v));
  }
  for (float& x : bt.q.data) x = r16(n01(rng));
  return bt;
}

// The device side of a cache and a decode call.
struct DeviceCase {
  DeviceBuffer<uint8_t> pool;
  DeviceBuffer<int32_t> tables, lengths;
  DeviceBuffer<float> k_mean;
  DeviceBuffer<uint16_t> q, o;  // o: kGuard elements before and after the outputs
  DeviceBuffer<float> lse;
  qattn_kv_cache cache{};
  qattn_kv_decode_params p{};
  static constexpr std::size_t kGuard = 64;

  DeviceCase(const Case& c, const Built& bt)
      : pool(bt.cache.pages.size()),
        tables(bt.tables.size()),
        lengths(bt.cache.lengths.size()),
        k_mean(bt.cache.k_mean.size()),
        q(bt.q.size()),
        o(bt.q.size() + 2 * kGuard),
        lse(static_cast<std::size_t>(bt.q.b) * bt.q.h * bt.q.n) {
    pool.upload(bt.cache.pages);
    tables.upload(bt.tables);
    lengths.upload(bt.cache.lengths);
    k_mean.upload(bt.cache.k_mean);
    std::vector<uint16_t> qb(bt.q.size());
    for (std::size_t i = 0; i < qb.size(); ++i) qb[i] = test::to_bits16(bt.q.data[i], c.bf16);
    q.upload(qb);
    cudaMemset(o.ptr, 0xFF, o.count * 2);      // NaN in both 16-bit formats
    cudaMemset(lse.ptr, 0xFF, lse.count * 4);  // NaN
    qattn_kv_cache_init(&cache);
    const emulate::KvCacheConfig& cfg = bt.cache.config;
    cache.format = c_format(cfg.format);
    cache.heads_kv = cfg.heads_kv;
    cache.head_dim = cfg.head_dim;
    cache.page_size = cfg.page_size;
    cache.num_pages = cfg.num_pages;
    cache.max_pages_per_seq = cfg.max_pages_per_seq;
    cache.k_smoothing = c.smoothing ? QATTN_KV_SMOOTH_PREFILL_MEAN : QATTN_KV_SMOOTH_NONE;
    cache.pages = pool.ptr;
    qattn_kv_decode_params_init(&p);
    p.cache = &cache;
    p.seqs.block_tables = tables.ptr;
    p.seqs.lengths = lengths.ptr;
    p.seqs.k_mean = c.smoothing ? k_mean.ptr : nullptr;
    p.seqs.host_block_tables = bt.tables.data();
    p.seqs.host_lengths = const_cast<int32_t*>(bt.cache.lengths.data());
    const int64_t d = c.d, n = c.nq, hq = bt.q.h;
    p.q = {q.ptr, hq * n * d, n * d, d};
    p.o = {o.ptr + kGuard, hq * n * d, n * d, d};
    p.lse = lse.ptr;
    p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
    p.batch = bt.q.b;
    p.heads_q = static_cast<int32_t>(hq);
    p.nq = c.nq;
    p.causal = c.causal ? 1 : 0;
    p.num_splits = c.splits;
  }

  // Runs the decode; returns the status (the workspace is sized by the library).
  qattn_status run() {
    size_t ws_bytes = 0;
    if (qattn_status s = qattn_kv_decode_workspace_size(&p, &ws_bytes); s != QATTN_OK) return s;
    void* ws = nullptr;
    if (ws_bytes > 0 && cudaMalloc(&ws, ws_bytes) != cudaSuccess) return QATTN_ERROR_CUDA;
    const qattn_status s = qattn_kv_decode(&p, ws, ws_bytes, nullptr);
    cudaDeviceSynchronize();
    cudaFree(ws);
    return s;
  }
};

struct Outputs {
  std::vector<float> o, lse;
  bool guards_intact = true;
};

Outputs fetch(const Case& c, const DeviceCase& dc) {
  Outputs out;
  const std::vector<uint16_t> ob = dc.o.download();
  for (std::size_t i = 0; i < ob.size(); ++i) {
    const bool guard = i < DeviceCase::kGuard || i >= ob.size() - DeviceCase::kGuard;
    if (guard) {
      out.guards_intact = out.guards_intact && ob[i] == 0xFFFF;
    } else {
      out.o.push_back(test::from_bits16(ob[i], c.bf16));
    }
  }
  out.lse = dc.lse.download();
  return out;
}

// Checks the GPU outputs against the emulation and FP64 for the sequences in `check`.
void expect_matches(const Case& c, const Built& bt, const Outputs& gpu, std::vector<bool> check) {
  emulate::DecodeParams dp;
  dp.mask = c.causal ? Mask::Causal : Mask::None;
  int splits = c.splits;
  if (splits == 0) splits = 1;  // the library's choice is not known here: compare with S = 1
  dp.num_splits = splits;
  const emulate::EmulatedForward emu = emulate::decode_emulated(bt.q, bt.cache, dp);
  const int B = bt.q.b, Hq = bt.q.h, nq = c.nq, d = c.d;
  const double out_round = c.bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int b = 0; b < B; ++b) {
    if (!check[b]) continue;
    SCOPED_TRACE("batch entry " + std::to_string(b));
    const int L = c.lengths[b];
    std::vector<float> g_o, e_o;
    std::vector<double> r_o;
    // FP64 over the unquantized K and V (bottom-right causal, as the cache's decode).
    Tensor4 qb(1, Hq, nq, d);
    std::copy(bt.q.row(b, 0, 0), bt.q.row(b, 0, 0) + qb.size(), qb.data.begin());
    reference::ForwardResult ref;
    if (L > 0) {
      AttentionParams ap;
      ap.mask = c.causal ? Mask::Causal : Mask::None;
      ref = reference::attention_forward(qb, bt.k[b], bt.v[b], ap);
    }
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / c.group;
      const float* cvec =
          bt.cache.k_mean.data() + (static_cast<std::size_t>(b) * c.heads_kv + hk) * d;
      for (int i = 0; i < nq; ++i) {
        const std::size_t row = (static_cast<std::size_t>(b) * Hq + h) * nq + i;
        const float* er = emu.o.row(b, h, i);
        double row_max = 0.0, qc_abs = 0.0;
        for (int e = 0; e < d; ++e) {
          row_max = std::max(row_max, std::fabs(double{er[e]}));
          qc_abs += std::fabs(double{bt.q.at(b, h, i, e)} * cvec[e]);
        }
        for (int e = 0; e < d; ++e) {
          const double want = er[e], got = gpu.o[row * d + e];
          const double tol = out_round * std::fabs(want) + kOrderSlack * row_max;
          ASSERT_LE(std::fabs(got - want), tol) << "o[" << b << "," << h << "," << i << "," << e
                                                << "]: gpu " << got << " emu " << want;
          g_o.push_back(static_cast<float>(got));
          e_o.push_back(er[e]);
          r_o.push_back(L > 0 ? ref.o.at(0, h, i, e) : 0.0);
        }
        const double el = emu.lse[row], gl = gpu.lse[row];
        if (std::isinf(el)) {
          EXPECT_EQ(gl, el) << "lse[" << row << "]";
        } else {
          EXPECT_LE(std::fabs(gl - el), kLseRel * (1.0 + std::fabs(el) + sm_scale * qc_abs))
              << "lse[" << row << "]: gpu " << gl << " emu " << el;
        }
      }
    }
    if (L == 0) {
      for (float x : g_o) ASSERT_EQ(x, 0.f) << "a sequence with no key gives O = 0";
      continue;
    }
    const metrics::ErrorMetrics me = metrics::compare(e_o, r_o);
    const metrics::ErrorMetrics mg = metrics::compare(g_o, r_o);
    EXPECT_LE(std::sqrt(std::max(0.0, 1.0 - mg.cos_sim)),
              std::sqrt(std::max(0.0, 1.0 - me.cos_sim)) + std::sqrt(kGpuEmuOneMinusCos))
        << "CosSim to FP64: gpu " << mg.cos_sim << ", emulator " << me.cos_sim;
  }
}

void run_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(describe(c) + ", " + test::seed_trace(seed));
  std::mt19937 rng(seed);
  const Built bt = build(c, rng);
  DeviceCase dc(c, bt);
  ASSERT_EQ(dc.run(), QATTN_OK) << qattn_last_error_message();
  const Outputs gpu = fetch(c, dc);
  EXPECT_TRUE(gpu.guards_intact) << "the decode wrote outside o";
  expect_matches(c, bt, gpu, std::vector<bool>(c.lengths.size(), true));
}

constexpr KvFormat kFormats[] = {KvFormat::NvFp4, KvFormat::Fp8E4M3, KvFormat::Int8,
                                 KvFormat::Bf16};

TEST(KvDecode, EveryFormatAndDtypeMatchesTheEmulation) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (KvFormat f : kFormats)
    for (bool bf16 : {true, false}) {
      Case c;
      c.format = f;
      c.bf16 = bf16;
      c.lengths = {517, 64, 1};
      run_case(c, seed);
    }
}

TEST(KvDecode, HeadDimsNativeAndPadded) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (int d : {16, 48, 64, 80, 128, 192, 256})
    for (KvFormat f : kFormats) {
      Case c;
      c.format = f;
      c.d = d;
      c.group = 2;
      c.nq = 3;
      c.lengths = {200, 37};
      run_case(c, seed + d);
    }
}

TEST(KvDecode, GqaGroupsQueryCountsAndRowGroups) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  // rows = group × nq: 1, 16, 20 (two row tiles), 48, 64, 128 and 512 (several CTAs).
  const int shapes[][2] = {{1, 1}, {1, 16}, {4, 5}, {8, 6}, {4, 16}, {32, 4}, {32, 16}};
  for (auto [group, nq] : shapes)
    for (KvFormat f : {KvFormat::NvFp4, KvFormat::Int8, KvFormat::Bf16}) {
      Case c;
      c.format = f;
      c.group = group;
      c.nq = nq;
      c.heads_kv = 1;
      c.lengths = {200, 16};
      c.d = 128;
      run_case(c, seed + group * 17 + nq);
      c.d = 256;
      run_case(c, seed + group * 17 + nq + 1);
    }
}

TEST(KvDecode, CausalOffPageSizesAndSplits) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (int page : {1, 7, 16, 64})
    for (int splits : {1, 3, 0})
      for (bool causal : {true, false}) {
        Case c;
        c.format = (page + splits) % 2 ? KvFormat::NvFp4 : KvFormat::Fp8E4M3;
        c.page_size = page;
        c.splits = splits;
        c.causal = causal;
        c.nq = 4;
        c.lengths = {1000, 129, 3};
        run_case(c, seed + page * 7 + splits);
      }
}

// A BF16 cache at head dims 64 and 128 runs the direct kernel with BF16 operands: both
// ways of finding a key's page (page sizes that are not a multiple of 16 look up each
// key), one and two n-blocks of query rows, both output dtypes.
TEST(KvDecode, Bf16CacheOnEveryPathOfTheDirectKernel) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (int d : {64, 128})
    for (int page : {1, 7, 16, 64})
      for (int nq : {1, 4}) {
        Case c;
        c.format = KvFormat::Bf16;
        c.bf16 = (page + nq) % 2 == 0;
        c.d = d;
        c.page_size = page;
        c.nq = nq;  // group 4: 4 or 16 query rows per KV head
        c.splits = page == 16 ? 0 : 1;
        c.lengths = {333, 48, 2};
        run_case(c, seed + d + 3 * page + nq);
      }
}

TEST(KvDecode, ShortSequencesAndEmptyOnes) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (KvFormat f : kFormats) {
    Case c;
    c.format = f;
    c.nq = 4;
    c.lengths = {0, 1, 2, 3, 4, 65};  // L < nq: the first queries see no key (causal)
    c.splits = 3;
    run_case(c, seed);
  }
}

TEST(KvDecode, WithoutSmoothingAndWithALargeBias) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  for (KvFormat f : kFormats)
    for (bool smoothing : {true, false}) {
      Case c;
      c.format = f;
      c.smoothing = smoothing;
      c.k_bias = 8.f;
      c.lengths = {700};
      run_case(c, seed);
    }
}

TEST(KvDecode, RandomSweep) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  std::mt19937 pick(seed);
  const int dims[] = {32, 64, 96, 128, 160, 256};
  for (int it = 0; it < 16; ++it) {
    Case c;
    c.format = kFormats[pick() % 4];
    c.bf16 = pick() % 2;
    c.smoothing = pick() % 3 != 0;
    c.heads_kv = 1 + pick() % 3;
    c.group = 1 << (pick() % 4);
    c.nq = 1 + pick() % 16;
    c.d = dims[pick() % 6];
    c.page_size = std::vector<int>{1, 5, 16, 32}[pick() % 4];
    c.causal = pick() % 2;
    c.splits = std::vector<int>{0, 1, 2, 5}[pick() % 4];
    c.lengths.clear();
    for (int b = 0, n = 1 + pick() % 3; b < n; ++b) c.lengths.push_back(pick() % 1000);
    run_case(c, seed + it);
  }
}

TEST(KvDecode, SplitCountsAgreeToRounding) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937 rng(seed);
  Case c;
  c.lengths = {4000, 2500};
  const Built bt = build(c, rng);
  std::vector<float> first;
  for (int splits : {1, 2, 7, 16}) {
    c.splits = splits;
    DeviceCase dc(c, bt);
    ASSERT_EQ(dc.run(), QATTN_OK) << qattn_last_error_message();
    const Outputs out = fetch(c, dc);
    if (first.empty()) {
      first = out.o;
      continue;
    }
    const metrics::ErrorMetrics m = metrics::compare(out.o, first);
    // Two orders of the same FP32 sums, each rounded to bf16: 1 − cos ≤ (2^-9)² ≈ 4e-6.
    EXPECT_GE(m.cos_sim, 1.0 - 1e-5) << "splits " << splits;
  }
}

TEST(KvDecode, ABadDeviceBlockTableEntryPoisonsOnlyItsSequence) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed32();
  SCOPED_TRACE(test::seed_trace(seed));
  for (int splits : {1, 3}) {
    std::mt19937 rng(seed);
    Case c;
    c.splits = splits;
    c.lengths = {200, 300};
    const Built bt = build(c, rng);
    DeviceCase dc(c, bt);
    dc.p.seqs.host_block_tables = nullptr;  // only the device can see it
    dc.p.seqs.host_lengths = nullptr;
    std::vector<int32_t> bad = bt.tables;
    bad[bt.cache.config.max_pages_per_seq + 2] = 1 << 30;  // entry 1's third page
    dc.tables.upload(bad);
    ASSERT_EQ(dc.run(), QATTN_OK) << qattn_last_error_message();
    const Outputs out = fetch(c, dc);
    EXPECT_TRUE(out.guards_intact);
    const std::size_t per_seq = out.o.size() / 2;
    for (std::size_t i = per_seq; i < out.o.size(); ++i)
      ASSERT_TRUE(std::isnan(out.o[i])) << "o element " << i << " of the bad sequence";
    expect_matches(c, bt, out, {true, false});
  }
}

// A rejected call names the parameter and writes nothing (o keeps its poison).
void expect_rejected(DeviceCase& dc, const Case& c, const char* name) {
  const qattn_status s = dc.run();
  EXPECT_NE(s, QATTN_OK);
  EXPECT_NE(std::string(qattn_last_error_message()).find(name), std::string::npos)
      << qattn_last_error_message();
  const Outputs out = fetch(c, dc);
  for (float x : out.o) ASSERT_TRUE(std::isnan(x)) << "a rejected call wrote o";
}

TEST(KvDecode, BadInputsAreNamedAndLaunchNothing) {
  QATTN_SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  Case c;
  c.lengths = {100, 40};
  Built bt = build(c, rng);
  {
    std::vector<int32_t> tables = bt.tables;
    tables[1] = bt.cache.config.num_pages;  // out of range, used by sequence 0
    DeviceCase dc(c, bt);
    dc.p.seqs.host_block_tables = tables.data();
    expect_rejected(dc, c, "host_block_tables[0][1]");
  }
  {
    std::vector<int32_t> lengths = bt.cache.lengths;
    lengths[1] = bt.cache.config.max_pages_per_seq * c.page_size + 1;
    DeviceCase dc(c, bt);
    dc.p.seqs.host_lengths = lengths.data();
    expect_rejected(dc, c, "host_lengths[1]");
  }
  {
    DeviceCase dc(c, bt);
    dc.cache.pages = static_cast<uint8_t*>(dc.cache.pages) + 8;
    expect_rejected(dc, c, "cache->pages");
  }
  {
    DeviceCase dc(c, bt);
    dc.p.nq = 17;
    expect_rejected(dc, c, "nq");
  }
  {
    DeviceCase dc(c, bt);
    dc.cache.format = 9;
    expect_rejected(dc, c, "cache->format");
  }
  {
    DeviceCase dc(c, bt);
    dc.p.heads_q = 3;
    expect_rejected(dc, c, "heads_q");
  }
  {
    DeviceCase dc(c, bt);
    dc.p.o.stride_h = 12;  // (stride_n is ignored: nq = 1)
    expect_rejected(dc, c, "o.stride_h");
  }
  {
    DeviceCase dc(c, bt);
    dc.p.seqs.k_mean = nullptr;
    expect_rejected(dc, c, "seqs.k_mean");
  }
}

}  // namespace
