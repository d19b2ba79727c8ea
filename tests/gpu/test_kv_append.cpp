// The KV-cache append on the GPU (qattn_kv_append, src/cuda/kv_cache/append.cu) against
// its written contract, the host emulation emulate::append (docs/kv-cache.md, "Append").
//
// Tolerance: none. The append is specified bit for bit, so every comparison here is
// byte equality of the whole device pool (codes, scales, the padding of each slice and
// the rows never written, all pre-filled with 0xAB on both sides), of k_mean (the FP32
// smoothing vectors, also pre-filled) and of the lengths.
//
// Covered: every format × smoothing (prefill mean, none, a preset c) × dtype on random
// shapes (heads 1..8, head_dim 16..256, page sizes 1, 7, 16, 64, shuffled pages, several
// sequences at different lengths, single-token and page-spanning appends, prefills above
// and below the 256-token sample, HND and NHD inputs with poisoned row padding); n
// tokens at once against one by one; NaN, ±Inf, ±0, subnormal, saturating and huge
// inputs; the pool outside the written rows untouched; device-side bad block-table
// entries and lengths (no host mirrors) leaving that sequence as it was; bad calls
// rejected with the parameter named and nothing written. (Its speed is measured by
// bench/kv_decode_roofline.cpp's append line, not here.) The first tests check the kernel's host-testable arithmetic
// (append_math.h) on the CPU and run without a GPU; the others skip without an sm_90
// device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "api_outcome.h"
#include "cuda/kv_cache/append_math.h"
#include "emulate/kv_cache.h"
#include "gpu_util.h"
#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/nvfp4_code.h"
#include "qattn/qattn.h"

namespace {

using namespace qattn;
using emulate::KvFormat;
using emulate::KvSmoothing;
using test::DeviceBuffer;

constexpr uint8_t kPoolPoison = 0xAB;
constexpr uint16_t kInputPoison = 0x7FFF;  // NaN in fp16 and bf16: a read of padding shows
constexpr KvFormat kFormats[] = {KvFormat::NvFp4, KvFormat::Fp8E4M3, KvFormat::Int8,
                                 KvFormat::Bf16};

// ---- the kernel's arithmetic on the host (no GPU needed) ------------------------------

uint32_t bits(float x) { return numerics::detail::bits_of(x); }
float from_bits(uint32_t b) { return numerics::detail::float_of(b); }

// nvfp4_code (comparisons with exact products) equals fp4_element_code (E2M1 of the
// FP32 quotient) for every positive E4M3 scale: on every float within 256 ulps of each
// step t·s, of both signs, and on random values up to 8·s and beyond.
TEST(KvAppendMath, Nvfp4CodeEqualsTheQuantizerAtEveryScale) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  constexpr float kSteps[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f, 6.f};
  int64_t checked = 0;
  for (uint32_t sc = 1; sc < numerics::kE4M3NaN; ++sc) {
    const float s = numerics::e4m3_decode(static_cast<uint8_t>(sc));
    const numerics::Nvfp4Steps steps = numerics::nvfp4_steps(s);
    auto check = [&](float a) {
      for (float x : {a, -a}) {
        const uint32_t want = numerics::fp4_element_code(x, s);
        const uint32_t got = numerics::nvfp4_code(x, steps);
        if (want != got) {
          ADD_FAILURE() << "scale code " << sc << " (s = " << s << "), x = " << x << " (bits 0x"
                        << std::hex << bits(x) << std::dec << "): quantizer " << want << ", kernel "
                        << got;
          return false;
        }
        ++checked;
      }
      return true;
    };
    for (float t : kSteps) {
      const uint32_t center = bits(t * s);
      for (int k = -256; k <= 256; ++k)
        if (!check(from_bits(center + k))) return;
    }
    std::uniform_real_distribution<float> wide(0.f, 8.f * s);
    for (int i = 0; i < 2000; ++i)
      if (!check(wide(rng))) return;
    for (float a : {0.f, 1e-30f, 1e30f, 448.f * 6.f * 2.f, 3.4e38f})
      if (!check(a)) return;
  }
  EXPECT_EQ(checked, 126 * (8 * 513 + 2000 + 5) * 2);
}

// The host-NaN helpers give, on this host, the bits of the plain operations they stand
// for (they are what the kernel computes on the GPU, whose own NaN differs).
TEST(KvAppendMath, HostNaNRulesAreThisHostsRules) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "the kernel follows the x86-64 host's NaN rules; this host is not x86-64";
#else
  const float f[] = {1.5f,
                     -0.f,
                     INFINITY,
                     -INFINITY,
                     from_bits(0x7FC00000u),
                     from_bits(0xFFC00000u),
                     from_bits(0x7F812345u),  // signaling, with a payload
                     from_bits(0xFFA00001u),
                     from_bits(0x7FC0ABCDu)};
  for (float a : f)
    for (float b : f) {
      volatile float va = a, vb = b;  // the plain SSE operation, not folded
      const float want = va - vb;
      EXPECT_EQ(bits(kv_cache::host_sub(a, b)), bits(want))
          << std::hex << bits(a) << " - " << bits(b);
      volatile double da = va, db = vb;
      const double dw = da + db;
      const double got = kv_cache::host_add(kv_cache::host_widen(a), kv_cache::host_widen(b));
      uint64_t gw, gg;
      const double dwc = dw;
      std::memcpy(&gw, &dwc, 8);
      std::memcpy(&gg, &got, 8);
      EXPECT_EQ(gg, gw) << std::hex << bits(a) << " + " << bits(b) << " in double";
      volatile double q = dw / 7.0;
      const double qc = q;
      const volatile float back = static_cast<float>(qc);
      EXPECT_EQ(bits(kv_cache::host_to_float(kv_cache::host_div(dw, 7.0))), bits(back));
    }
#endif
}

TEST(KvAppendMath, FastDivDividesEveryPositionBelow2To31) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> divisors{1, 2, 3, 7, 16, 17, 64, 1000, 65535, (1u << 30), (1u << 31) - 1};
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % (1u << 30)));
  for (uint32_t d : divisors) {
    const kv_cache::FastDiv f = kv_cache::make_fast_div(d);
    std::vector<uint32_t> ns{0, 1, d - 1, d, d + 1, (1u << 31) - 1, (1u << 30)};
    for (int i = 0; i < 2000; ++i) ns.push_back(static_cast<uint32_t>(rng() % (1u << 31)));
    for (uint32_t n : ns) {
      if (n >= (1u << 31)) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}

// ---- a cache on the device and its emulation ----------------------------------------

enum class Smooth { PrefillMean, None, Preset };
const char* smooth_name(Smooth s) {
  return s == Smooth::PrefillMean ? "prefill-mean" : s == Smooth::None ? "none" : "preset";
}
enum class Layout { HND, NHD };

struct Spec {
  KvFormat format = KvFormat::NvFp4;
  Smooth smooth = Smooth::PrefillMean;
  bool bf16 = true;
  int heads = 2, head_dim = 128, page_size = 16, max_pages_per_seq = 8, seqs = 3;
  int spare_pages = 3;  // pages no sequence owns: they must stay poisoned
  Layout layout = Layout::HND;
  int row_pad = 0;  // elements (a multiple of 8) after each input row, poisoned

  std::string describe() const {
    return std::string(emulate::kv_format_name(format)) + " " + smooth_name(smooth) +
           (bf16 ? " bf16" : " fp16") + " heads=" + std::to_string(heads) +
           " d=" + std::to_string(head_dim) + " page=" + std::to_string(page_size) +
           " pages/seq=" + std::to_string(max_pages_per_seq) + " seqs=" + std::to_string(seqs) +
           (layout == Layout::NHD ? " NHD" : " HND") + " pad=" + std::to_string(row_pad);
  }
  int num_pages() const { return seqs * max_pages_per_seq + spare_pages; }
  int capacity() const { return max_pages_per_seq * page_size; }
};

// Random 16-bit values with a per-channel bias (what smoothing takes out), as floats.
Tensor4 random_kv(int heads, int n, int d, bool bf16, std::mt19937_64& rng, float bias) {
  Tensor4 t(1, heads, n, d);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int h = 0; h < heads; ++h) {
    std::vector<float> channel(d);
    for (float& c : channel) c = bias * normal(rng);
    for (int r = 0; r < n; ++r)
      for (int e = 0; e < d; ++e)
        t.at(0, h, r, e) = test::from_bits16(test::to_bits16(normal(rng) + channel[e], bf16), bf16);
  }
  return t;
}

// The 16-bit bits of a value that came from them: bf16 by its top half, so a signaling
// NaN reaches the device as it is (bf16_bits would quiet it); fp16 through fp16_bits
// (its NaN is the canonical one either way).
uint16_t bits16(float x, bool bf16) {
  return bf16 ? static_cast<uint16_t>(bits(x) >> 16) : numerics::fp16_bits(x);
}

// One call's K or V: `count` sequences' (1, H, n, d) tensors as one (count, H, n, d)
// device tensor in the spec's layout, row padding poisoned.
struct DeviceInput {
  std::unique_ptr<DeviceBuffer<uint16_t>> buf;
  qattn_tensor view{};
  DeviceInput(const Spec& sp, const std::vector<Tensor4>& per_seq, int s0, int count, int n) {
    const int d = sp.head_dim, row = d + sp.row_pad, h = sp.heads;
    qattn_tensor v{nullptr, 0, 0, 0};
    if (sp.layout == Layout::HND) {
      v.stride_n = row;
      v.stride_h = int64_t{n} * row;
      v.stride_b = v.stride_h * h;
    } else {
      v.stride_h = row;
      v.stride_n = int64_t{h} * row;
      v.stride_b = v.stride_n * n;
    }
    const std::size_t total = static_cast<std::size_t>(count) * h * n * row;
    std::vector<uint16_t> host(total, kInputPoison);
    for (int b = 0; b < count; ++b)
      for (int ih = 0; ih < h; ++ih)
        for (int r = 0; r < n; ++r)
          for (int e = 0; e < d; ++e)
            host[b * v.stride_b + ih * v.stride_h + r * v.stride_n + e] =
                bits16(per_seq[s0 + b].at(0, ih, r, e), sp.bf16);
    buf = std::make_unique<DeviceBuffer<uint16_t>>(total);
    buf->upload(host);
    v.data = buf->ptr;
    view = v;
  }
};

// The tokens [t0, t0 + n) of a (1, H, N, d) tensor.
Tensor4 slice(const Tensor4& x, int t0, int n) {
  Tensor4 out(1, x.h, n, x.d);
  for (int h = 0; h < x.h; ++h)
    std::copy(x.row(0, h, t0), x.row(0, h, t0) + static_cast<std::size_t>(n) * x.d,
              out.row(0, h, 0));
  return out;
}

class Harness {
 public:
  Harness(const Spec& sp, uint64_t seed) : sp_(sp) {
    emulate::KvCacheConfig cfg;
    cfg.format = sp.format;
    cfg.heads_kv = sp.heads;
    cfg.head_dim = sp.head_dim;
    cfg.page_size = sp.page_size;
    cfg.num_pages = sp.num_pages();
    cfg.max_seqs = sp.seqs;
    cfg.max_pages_per_seq = sp.max_pages_per_seq;
    cfg.k_smoothing = sp.smooth == Smooth::None ? KvSmoothing::None : KvSmoothing::PrefillMean;
    emu_ = emulate::make_paged_cache(cfg);
    std::fill(emu_.pages.begin(), emu_.pages.end(), kPoolPoison);
    // k_mean starts poisoned on both sides: a sequence whose c is never computed keeps it.
    std::memset(emu_.k_mean.data(), kPoolPoison, emu_.k_mean.size() * sizeof(float));

    // Every sequence gets its own pages, in a shuffled order; the spare ones stay unowned.
    std::mt19937_64 rng(seed);
    std::vector<int32_t> all(cfg.num_pages);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int s = 0; s < sp.seqs; ++s)
      emulate::assign_pages(
          emu_, s,
          std::span<const int32_t>(all.data() + s * sp.max_pages_per_seq, sp.max_pages_per_seq));
    if (sp.smooth == Smooth::Preset) {
      std::normal_distribution<float> normal(0.f, 2.f);
      std::vector<float> c(static_cast<std::size_t>(sp.heads) * sp.head_dim);
      for (int s = 0; s < sp.seqs; ++s) {
        for (float& x : c) x = normal(rng);
        emulate::set_k_smoothing(emu_, s, c);
      }
    }

    qattn_kv_cache_init(&desc_);
    desc_.format = static_cast<int32_t>(sp.format);
    desc_.heads_kv = sp.heads;
    desc_.head_dim = sp.head_dim;
    desc_.page_size = sp.page_size;
    desc_.num_pages = cfg.num_pages;
    desc_.max_pages_per_seq = sp.max_pages_per_seq;
    desc_.k_smoothing =
        sp.smooth == Smooth::None ? QATTN_KV_SMOOTH_NONE : QATTN_KV_SMOOTH_PREFILL_MEAN;
    size_t page_bytes = 0;
    EXPECT_EQ(qattn_kv_cache_page_bytes(&desc_, &page_bytes), QATTN_OK)
        << qattn_last_error_message();
    EXPECT_EQ(static_cast<int64_t>(page_bytes), emu_.layout.page_bytes);
    pool_ = std::make_unique<DeviceBuffer<uint8_t>>(emu_.pages.size());
    pool_->upload(emu_.pages);
    desc_.pages = pool_->ptr;
    tables_ = std::make_unique<DeviceBuffer<int32_t>>(emu_.block_tables.size());
    tables_->upload(emu_.block_tables);
    lengths_ = std::make_unique<DeviceBuffer<int32_t>>(emu_.lengths.size());
    lengths_->upload(emu_.lengths);
    host_lengths_ = emu_.lengths;
    if (sp.smooth != Smooth::None) {
      k_mean_ = std::make_unique<DeviceBuffer<float>>(emu_.k_mean.size());
      k_mean_->upload(emu_.k_mean);
    }
  }

  const Spec& spec() const { return sp_; }
  emulate::PagedCache& emu() { return emu_; }
  qattn_kv_cache& desc() { return desc_; }
  int32_t* device_tables() { return tables_->ptr; }
  int32_t* device_lengths() { return lengths_->ptr; }
  float* device_k_mean() { return k_mean_ ? k_mean_->ptr : nullptr; }

  // The parameters of an append of n tokens to sequences [s0, s0 + count) (the call's
  // batch entry b is sequence s0 + b), with or without the host mirrors.
  qattn_kv_append_params params(const DeviceInput& k, const DeviceInput& v, int s0, int count,
                                int n, bool mirrors) {
    qattn_kv_append_params p;
    qattn_kv_append_params_init(&p);
    p.cache = &desc_;
    const int mp = sp_.max_pages_per_seq;
    p.seqs.block_tables = tables_->ptr + s0 * mp;
    p.seqs.lengths = lengths_->ptr + s0;
    p.seqs.k_mean =
        k_mean_ ? k_mean_->ptr + static_cast<std::size_t>(s0) * sp_.heads * sp_.head_dim : nullptr;
    if (mirrors) {
      p.seqs.host_block_tables = emu_.block_tables.data() + s0 * mp;
      p.seqs.host_lengths = host_lengths_.data() + s0;
    }
    p.k = k.view;
    p.v = v.view;
    p.dtype = sp_.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
    p.batch = count;
    p.n_new = n;
    p.k_mean_preset = sp_.smooth == Smooth::Preset ? 1 : 0;
    return p;
  }

  // Appends tokens [t0, t0 + n) of each sequence's k and v to sequences [s0, s0 + count)
  // on the device and in the emulation.
  qattn_status append(const std::vector<Tensor4>& k, const std::vector<Tensor4>& v, int s0,
                      int count, int t0, int n, bool mirrors) {
    std::vector<Tensor4> ks(k.size()), vs(v.size());
    for (int s = s0; s < s0 + count; ++s) {
      ks[s] = slice(k[s], t0, n);
      vs[s] = slice(v[s], t0, n);
    }
    const DeviceInput dk(sp_, ks, s0, count, n), dv(sp_, vs, s0, count, n);
    const qattn_kv_append_params p = params(dk, dv, s0, count, n, mirrors);
    const qattn_status st = qattn_kv_append(&p, nullptr);
    if (st == QATTN_OK)
      for (int s = s0; s < s0 + count; ++s) {
        emulate::append(emu_, s, ks[s], vs[s]);
        if (!mirrors) host_lengths_[s] += n;  // the library advances only mirrors it is given
      }
    // The inputs are freed on return: wait until the kernels have read them.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return st;
  }

  std::vector<uint8_t> pool() const { return pool_->download(); }
  std::vector<int32_t> lengths() const { return lengths_->download(); }
  std::vector<float> k_mean() const { return k_mean_ ? k_mean_->download() : std::vector<float>{}; }

  // "" when the device pool, lengths and k_mean equal the emulation's bytes, else where
  // they first differ.
  std::string compare() const {
    if (cudaDeviceSynchronize() != cudaSuccess) return "the device failed";
    const std::vector<uint8_t> got = pool();
    const auto& want = emu_.pages;
    std::size_t diffs = 0, first = 0;
    for (std::size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i] && diffs++ == 0) first = i;
    if (diffs > 0)
      return describe_byte(first, got[first], want[first]) + " (" + std::to_string(diffs) +
             " bytes differ)";
    const std::vector<int32_t> len = lengths();
    for (int s = 0; s < sp_.seqs; ++s)
      if (len[s] != emu_.lengths[s])
        return "lengths[" + std::to_string(s) + "] = " + std::to_string(len[s]) + ", emulation " +
               std::to_string(emu_.lengths[s]);
    if (k_mean_) {
      const std::vector<float> c = k_mean();
      for (std::size_t i = 0; i < c.size(); ++i)
        if (bits(c[i]) != bits(emu_.k_mean[i])) {
          char buf[160];
          std::snprintf(buf, sizeof buf, "k_mean[%zu] (seq %zu) = 0x%08x, emulation 0x%08x", i,
                        i / (static_cast<std::size_t>(sp_.heads) * sp_.head_dim), bits(c[i]),
                        bits(emu_.k_mean[i]));
          return buf;
        }
    }
    return {};
  }

  // Which part of which page a pool byte is.
  std::string describe_byte(std::size_t i, uint8_t got, uint8_t want) const {
    const auto& l = emu_.layout;
    const int64_t page = static_cast<int64_t>(i) / l.page_bytes,
                  off = static_cast<int64_t>(i) % l.page_bytes;
    std::string where;
    auto in = [&](int64_t base, int64_t head_bytes, int64_t row_bytes, const char* what) {
      if (off < base || off >= base + sp_.heads * head_bytes) return false;
      const int64_t h = (off - base) / head_bytes, within = (off - base) % head_bytes;
      where = std::string(what) + " head " + std::to_string(h) +
              (row_bytes > 0 && within < sp_.page_size * row_bytes
                   ? " slot " + std::to_string(within / row_bytes) + " byte " +
                         std::to_string(within % row_bytes)
                   : " padding");
      return true;
    };
    in(l.k_codes, l.head_code_bytes, l.code_row_bytes, "K codes") ||
        in(l.v_codes, l.head_code_bytes, l.code_row_bytes, "V codes") ||
        in(l.k_scales, l.head_scale_bytes, l.scale_row_bytes, "K scales") ||
        in(l.v_scales, l.head_scale_bytes, l.scale_row_bytes, "V scales");
    char buf[96];
    std::snprintf(buf, sizeof buf, ": device 0x%02x, emulation 0x%02x", got, want);
    return "pool byte " + std::to_string(i) + " (page " + std::to_string(page) + ", " + where +
           ")" + buf;
  }

 private:
  Spec sp_;
  emulate::PagedCache emu_;
  qattn_kv_cache desc_{};
  std::unique_ptr<DeviceBuffer<uint8_t>> pool_;
  std::unique_ptr<DeviceBuffer<int32_t>> tables_, lengths_;
  std::unique_ptr<DeviceBuffer<float>> k_mean_;
  std::vector<int32_t> host_lengths_;  // the mirror the library advances
};

// Per-sequence K and V of `tokens` tokens.
struct Tokens {
  std::vector<Tensor4> k, v;
};
Tokens random_tokens(const Spec& sp, int tokens, std::mt19937_64& rng) {
  Tokens t;
  for (int s = 0; s < sp.seqs; ++s) {
    t.k.push_back(random_kv(sp.heads, tokens, sp.head_dim, sp.bf16, rng, 3.f));
    t.v.push_back(random_kv(sp.heads, tokens, sp.head_dim, sp.bf16, rng, 0.5f));
  }
  return t;
}

#define EXPECT_MATCHES(h)                   \
  do {                                      \
    const std::string why_ = (h).compare(); \
    EXPECT_TRUE(why_.empty()) << why_;      \
  } while (0)

// ---- against the emulation ----------------------------------------------------------

// A random spec for one case of the sweep; `i` cycles the head dims and page sizes so
// 64, 128 and 256 and each page size all appear.
Spec sweep_spec(KvFormat f, Smooth sm, bool bf16, int i, std::mt19937_64& rng) {
  Spec sp;
  sp.format = f;
  sp.smooth = sm;
  sp.bf16 = bf16;
  sp.heads = 1 + static_cast<int>(rng() % 8);
  constexpr int kDims[] = {64, 128, 256, 0};
  sp.head_dim = kDims[i % 4] != 0 ? kDims[i % 4] : 16 * (1 + static_cast<int>(rng() % 16));
  constexpr int kPages[] = {1, 16, 7, 64};
  sp.page_size = kPages[(i / 4 + i) % 4];
  sp.seqs = 3;
  sp.layout = rng() % 2 ? Layout::HND : Layout::NHD;
  sp.row_pad = 8 * static_cast<int>(rng() % 2);
  return sp;
}

// Runs the sequence of calls of the sweep: a prefill of all sequences (n0 tokens, some
// above the 256-token sample), one token to sequences 1.., a page-spanning chunk to
// sequences 0..1, one token to all; the pool compared after each.
void run_sweep_case(const Spec& base, uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr int kPrefills[] = {1, 37, 300, 523};
  const int n0 = kPrefills[rng() % 4];
  const int chunk = 2 * base.page_size + 3;
  Spec sp = base;
  const int total = n0 + 1 + chunk + 1;
  sp.max_pages_per_seq = (total + sp.page_size - 1) / sp.page_size + static_cast<int>(rng() % 2);
  SCOPED_TRACE(sp.describe() + " prefill=" + std::to_string(n0) + " seed=" + std::to_string(seed));
  Harness h(sp, seed);
  const Tokens in = random_tokens(sp, total, rng);
  struct Call {
    int s0, count, n;
  };
  // The sequences of one call are at different positions of their inputs: each call gets
  // every sequence's next n tokens.
  std::vector<int> used(sp.seqs, 0);
  const Call calls[] = {{0, 3, n0}, {1, 2, 1}, {0, 2, chunk}, {0, 3, 1}};
  for (const Call& c : calls) {
    std::vector<Tensor4> k(sp.seqs), v(sp.seqs);
    for (int s = c.s0; s < c.s0 + c.count; ++s) {
      k[s] = slice(in.k[s], used[s], c.n);
      v[s] = slice(in.v[s], used[s], c.n);
      used[s] += c.n;
    }
    const bool mirrors = rng() % 2 == 0;
    ASSERT_EQ(h.append(k, v, c.s0, c.count, 0, c.n, mirrors), QATTN_OK)
        << qattn_last_error_message();
    EXPECT_MATCHES(h);
  }
}

TEST(KvAppend, MatchesEmulationEveryFormatSmoothingDtype) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t fresh = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(fresh));
  int i = 0;
  for (KvFormat f : kFormats)
    for (Smooth sm : {Smooth::PrefillMean, Smooth::None, Smooth::Preset})
      for (bool bf16 : {true, false}) {
        for (uint64_t seed : {uint64_t{1000} + i, fresh + i}) {
          std::mt19937_64 rng(seed);
          run_sweep_case(sweep_spec(f, sm, bf16, i, rng), seed);
          if (HasFailure()) return;
        }
        ++i;
      }
}

// Once c is fixed, n tokens appended at once write the bytes of n single-token appends.
TEST(KvAppend, ManyTokensAtOnceEqualOneByOne) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  int i = 0;
  for (KvFormat f : kFormats)
    for (Smooth sm : {Smooth::PrefillMean, Smooth::None, Smooth::Preset}) {
      Spec sp;
      sp.format = f;
      sp.smooth = sm;
      sp.bf16 = i++ % 2 == 0;
      sp.heads = 1 + static_cast<int>(rng() % 4);
      sp.head_dim = 16 * (1 + static_cast<int>(rng() % 16));
      sp.page_size = 7;
      sp.seqs = 2;
      sp.max_pages_per_seq = 8;
      SCOPED_TRACE(sp.describe());
      const int n0 = 5, n = 29;  // 29 tokens from slot 5 span four pages of 7
      const Tokens in = random_tokens(sp, n0 + n, rng);
      Harness at_once(sp, seed), one_by_one(sp, seed);
      ASSERT_EQ(at_once.append(in.k, in.v, 0, 2, 0, n0, true), QATTN_OK);
      ASSERT_EQ(one_by_one.append(in.k, in.v, 0, 2, 0, n0, false), QATTN_OK);
      ASSERT_EQ(at_once.append(in.k, in.v, 0, 2, n0, n, true), QATTN_OK);
      for (int t = 0; t < n; ++t)
        ASSERT_EQ(one_by_one.append(in.k, in.v, 0, 2, n0 + t, 1, t % 2 == 0), QATTN_OK);
      EXPECT_TRUE(at_once.pool() == one_by_one.pool());
      EXPECT_EQ(at_once.lengths(), one_by_one.lengths());
      EXPECT_MATCHES(at_once);
      EXPECT_MATCHES(one_by_one);
    }
}

// NaN, ±Inf, ±0, subnormals, the dtype's largest values (saturation) and single huge
// elements, in the prefill (so in c) and in later tokens. A column of the prefill holds
// at most one kind of NaN source (the canonical NaN, or +Inf and −Inf together, or one
// signaling bf16 NaN), so k_mean's NaN bits are the host's on every code path
// (append_math.h).
TEST(KvAppend, SpecialValuesMatchTheCpu) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (KvFormat f : kFormats)
    for (Smooth sm : {Smooth::PrefillMean, Smooth::None})
      for (bool bf16 : {true, false}) {
        Spec sp;
        sp.format = f;
        sp.smooth = sm;
        sp.bf16 = bf16;
        sp.heads = 2;
        sp.head_dim = 64;
        sp.page_size = 16;
        sp.seqs = 2;
        sp.max_pages_per_seq = 3;
        SCOPED_TRACE(sp.describe());
        const int n = 40;
        Tokens in = random_tokens(sp, n, rng);
        const float big = bf16 ? numerics::bf16_from_bits(0x7F7F) : 65504.f;
        const float tiny =
            bf16 ? numerics::bf16_from_bits(0x0001) : numerics::fp16_from_bits(0x0001);
        const float nan = test::from_bits16(bf16 ? 0x7FC0 : 0x7E00, bf16);
        const float snan = bf16 ? numerics::bf16_from_bits(0x7F81) : nan;
        for (Tensor4* t : {&in.k[0], &in.v[0], &in.k[1], &in.v[1]})
          for (int h = 0; h < sp.heads; ++h) {
            auto row = [&](int i) { return t->row(0, h, i); };
            std::fill(row(0), row(0) + sp.head_dim, 0.f);                          // zero row
            std::fill(row(1), row(1) + sp.head_dim, -0.f);                         // negative zeros
            for (int e = 0; e < sp.head_dim; ++e) row(2)[e] = e % 2 ? big : -big;  // saturation
            for (int e = 0; e < sp.head_dim; ++e) row(3)[e] = e % 3 ? tiny : -tiny;
            row(4)[0] = nan;
            row(5)[1] = INFINITY;
            row(6)[2] = -INFINITY;
            row(7)[3] = INFINITY;
            row(8)[3] = -INFINITY;
            row(9)[20] = big;  // one huge element: the rest of its block rounds to zero
            row(10)[4] = snan;
            for (int e = 32; e < 48; ++e) row(11)[e] = 0.f;  // one all-zero NVFP4 block
            row(12)[40] = nan;  // decode-step tokens below: NaN, Inf, zero rows
            row(30)[5] = nan;
            row(31)[6] = -INFINITY;
            std::fill(row(32), row(32) + sp.head_dim, 0.f);
            for (int e = 0; e < sp.head_dim; ++e) row(33)[e] = e % 2 ? -big : tiny;
          }
        Harness h(sp, seed);
        ASSERT_EQ(h.append(in.k, in.v, 0, 2, 0, 30, true), QATTN_OK) << qattn_last_error_message();
        EXPECT_MATCHES(h);
        for (int t = 30; t < n; ++t) {
          ASSERT_EQ(h.append(in.k, in.v, 0, 2, t, 1, false), QATTN_OK);
          EXPECT_MATCHES(h);
        }
      }
}

// Bytes outside the rows of the cached tokens (other slots, slice padding, pages no
// sequence owns) keep the pool's poison.
TEST(KvAppend, PoolOutsideWrittenRowsIsUnchanged) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (KvFormat f : kFormats) {
    Spec sp;
    sp.format = f;
    sp.heads = 3;
    sp.head_dim = 48;  // 24-byte NVFP4 rows, 3-byte scale rows: every slice is padded
    sp.page_size = 7;
    sp.seqs = 3;
    sp.max_pages_per_seq = 4;
    SCOPED_TRACE(sp.describe());
    Harness h(sp, seed);
    const Tokens in = random_tokens(sp, 20, rng);
    ASSERT_EQ(h.append(in.k, in.v, 0, 3, 0, 9, true), QATTN_OK);
    ASSERT_EQ(h.append(in.k, in.v, 1, 1, 9, 11, true), QATTN_OK);
    EXPECT_MATCHES(h);
    const std::vector<uint8_t> pool = h.pool();
    std::vector<bool> written(pool.size(), false);
    const auto& l = h.emu().layout;
    const std::vector<int32_t> len = h.lengths();
    for (int s = 0; s < sp.seqs; ++s)
      for (int t = 0; t < len[s]; ++t)
        for (int hh = 0; hh < sp.heads; ++hh)
          for (bool v : {false, true}) {
            const int64_t base = int64_t{h.emu().block(s, t / sp.page_size)} * l.page_bytes;
            const int slot = t % sp.page_size;
            for (int64_t i = 0; i < l.code_row_bytes; ++i)
              written[base + l.code_offset(v, slot, hh) + i] = true;
            for (int64_t i = 0; i < l.scale_row_bytes; ++i)
              written[base + l.scale_offset(v, slot, hh) + i] = true;
          }
    std::size_t changed = 0;
    for (std::size_t i = 0; i < pool.size(); ++i)
      if (!written[i] && pool[i] != kPoolPoison) ++changed;
    EXPECT_EQ(changed, 0u) << "bytes outside the cached rows were written";
  }
}

// Without host mirrors the call cannot see the device's block tables and lengths; the
// kernels check them and leave an entry with a bad one as it was (pool, k_mean, length),
// while the other entries of the batch are appended.
TEST(KvAppend, BadDeviceEntriesWriteNothing) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (KvFormat f : kFormats) {
    Spec sp;
    sp.format = f;
    sp.heads = 2;
    sp.head_dim = 32;
    sp.page_size = 4;
    sp.seqs = 5;
    sp.max_pages_per_seq = 6;
    SCOPED_TRACE(sp.describe());
    Harness h(sp, seed);
    const int n = 10;  // pages 0..2 of each sequence
    const Tokens in = random_tokens(sp, n, rng);
    // Device-only corruption: seq 1's third page entry unset, seq 2's first past the pool,
    // seq 3's length beyond the capacity, seq 4's negative.
    const int32_t unset = -1, past = sp.num_pages(), too_long = sp.capacity() - n + 1, neg = -3;
    const int mp = sp.max_pages_per_seq;
    ASSERT_EQ(cudaMemcpy(h.device_tables() + 1 * mp + 2, &unset, 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h.device_tables() + 2 * mp + 0, &past, 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h.device_lengths() + 3, &too_long, 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h.device_lengths() + 4, &neg, 4, cudaMemcpyHostToDevice), cudaSuccess);
    const std::vector<float> k_mean_before = h.k_mean();
    // The call on all five; the emulation appends only sequence 0.
    std::vector<Tensor4> k(sp.seqs), v(sp.seqs);
    for (int s = 0; s < sp.seqs; ++s) {
      k[s] = slice(in.k[s], 0, n);
      v[s] = slice(in.v[s], 0, n);
    }
    const DeviceInput dk(sp, k, 0, sp.seqs, n), dv(sp, v, 0, sp.seqs, n);
    const qattn_kv_append_params p = h.params(dk, dv, 0, sp.seqs, n, /*mirrors=*/false);
    ASSERT_EQ(qattn_kv_append(&p, nullptr), QATTN_OK) << qattn_last_error_message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    emulate::append(h.emu(), 0, k[0], v[0]);
    const std::vector<uint8_t> pool = h.pool();
    EXPECT_TRUE(pool == h.emu().pages) << "only sequence 0's rows may be written";
    const std::vector<int32_t> len = h.lengths();
    EXPECT_EQ(len[0], n);
    EXPECT_EQ(len[1], 0);
    EXPECT_EQ(len[2], 0);
    EXPECT_EQ(len[3], too_long);
    EXPECT_EQ(len[4], neg);
    const std::vector<float> c = h.k_mean();
    const std::size_t per = static_cast<std::size_t>(sp.heads) * sp.head_dim;
    for (std::size_t i = 0; i < c.size(); ++i) {
      const uint32_t want = i < per ? bits(h.emu().k_mean[i]) : bits(k_mean_before[i]);
      ASSERT_EQ(bits(c[i]), want) << "k_mean[" << i << "] of sequence " << i / per;
    }
  }
}

// Bad calls return a named error before anything is launched: the pool, the lengths
// (device and mirror) and k_mean stay as they were.
TEST(KvAppend, BadInputsAreNamedAndWriteNothing) {
  QATTN_SKIP_WITHOUT_GPU();
  Spec sp;
  sp.format = KvFormat::NvFp4;
  sp.heads = 2;
  sp.head_dim = 64;
  sp.page_size = 16;
  sp.seqs = 2;
  sp.max_pages_per_seq = 2;
  std::mt19937_64 rng(7);
  Harness h(sp, 7);
  const Tokens in = random_tokens(sp, 40, rng);
  ASSERT_EQ(h.append(in.k, in.v, 0, 2, 0, 3, true), QATTN_OK);
  std::vector<Tensor4> k{slice(in.k[0], 3, 4), slice(in.k[1], 3, 4)};
  std::vector<Tensor4> v{slice(in.v[0], 3, 4), slice(in.v[1], 3, 4)};
  const DeviceInput dk(sp, k, 0, 2, 4), dv(sp, v, 0, 2, 4);
  const std::vector<uint8_t> pool0 = h.pool();
  const std::vector<int32_t> len0 = h.lengths();
  const std::vector<float> c0 = h.k_mean();

  auto call = [&](qattn_kv_append_params p) { return test::outcome(qattn_kv_append(&p, nullptr)); };
  const qattn_kv_append_params good = h.params(dk, dv, 0, 2, 4, true);
  {
    // A mirror whose needed entry is out of the pool (the device copy is fine).
    std::vector<int32_t> table(h.emu().block_tables);
    table[1 * sp.max_pages_per_seq + 0] = sp.num_pages();
    qattn_kv_append_params p = good;
    p.seqs.host_block_tables = table.data();
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[1][0]");
  }
  {
    std::vector<int32_t> lens{3, sp.capacity() - 1};  // + 4 new tokens > capacity
    qattn_kv_append_params p = good;
    p.seqs.host_lengths = lens.data();
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[1]");
    EXPECT_EQ(lens[1], sp.capacity() - 1);
  }
  {
    qattn_kv_cache c = h.desc();
    c.pages = static_cast<uint8_t*>(c.pages) + 8;
    qattn_kv_append_params p = good;
    p.cache = &c;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "cache->pages", "16-byte");
  }
  {
    qattn_kv_cache c = h.desc();
    c.format = 4;
    qattn_kv_append_params p = good;
    p.cache = &c;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "cache->format");
  }
  {
    qattn_kv_append_params p = good;
    p.k.stride_n += 4;  // not a multiple of 8 elements
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "k.stride_n");
  }
  {
    qattn_kv_append_params p = good;
    p.k.data = static_cast<uint16_t*>(p.k.data) + 4;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "k.data");
  }
  {
    // k's shape and strides reach past its allocation (a k of the wrong shape). Where the
    // view then reaches into an output's memory the overlap is reported first; either way
    // k is named.
    qattn_kv_append_params p = good;
    p.k.stride_b *= 2;
    const test::Outcome o = call(p);
    EXPECT_EQ(o.status, QATTN_ERROR_INVALID_ARGUMENT) << o.message;
    EXPECT_TRUE(o.message.find("k.data") != std::string::npos ||
                o.message.find("overlaps k ") != std::string::npos)
        << o.message;
  }
  {
    qattn_kv_append_params p = good;
    p.v.stride_h = 0;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "v.stride_h");
  }
  {
    qattn_kv_append_params p = good;
    p.n_new = 0;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "n_new");
  }
  {
    qattn_kv_append_params p = good;
    p.seqs.k_mean = nullptr;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean");
  }
  {
    qattn_kv_append_params p = good;
    p.dtype = 2;
    EXPECT_REJECTS(call(p), QATTN_ERROR_INVALID_ARGUMENT, "dtype");
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(h.pool() == pool0);
  EXPECT_EQ(h.lengths(), len0);
  const std::vector<float> c1 = h.k_mean();
  EXPECT_EQ(std::memcmp(c1.data(), c0.data(), c0.size() * sizeof(float)), 0);
  // The good call still works after the rejected ones.
  EXPECT_EQ(call(good).status, QATTN_OK);
}

}  // namespace
