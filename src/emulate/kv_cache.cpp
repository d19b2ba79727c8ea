#include "emulate/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "emulate/common.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"

namespace qattn::emulate {
namespace {

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

bool valid_format(KvFormat f) {
  return f == KvFormat::NvFp4 || f == KvFormat::Fp8E4M3 || f == KvFormat::Int8 ||
         f == KvFormat::Bf16;
}

void check_seq(const char* fn, const PagedCache& cache, int seq) {
  if (seq < 0 || seq >= cache.config.max_seqs) {
    fail(fn, "seq must be in [0, max_seqs = " + std::to_string(cache.config.max_seqs) + "), got " +
                 std::to_string(seq));
  }
}

// The cache's vectors have the sizes its config implies (a hand-edited struct is caught
// here instead of read out of bounds).
void check_cache(const char* fn, const PagedCache& cache) {
  const KvCacheConfig& c = cache.config;
  const std::size_t seqs = static_cast<std::size_t>(c.max_seqs);
  if (cache.pages.size() != static_cast<std::size_t>(c.num_pages) * cache.layout.page_bytes ||
      cache.block_tables.size() != seqs * c.max_pages_per_seq || cache.lengths.size() != seqs ||
      cache.k_mean.size() != seqs * c.heads_kv * c.head_dim || cache.k_mean_fixed.size() != seqs) {
    fail(fn, "cache: its vectors do not match its config (build it with make_paged_cache)");
  }
}

// The page of token t of seq, validated against the pool.
int page_of(const char* fn, const PagedCache& cache, int seq, int64_t t) {
  const int i = static_cast<int>(t / cache.config.page_size);
  const int32_t p = cache.block(seq, i);
  if (p < 0 || p >= cache.config.num_pages) {
    fail(fn, "block_tables[" + std::to_string(seq) + "][" + std::to_string(i) +
                 "] must be in [0, num_pages = " + std::to_string(cache.config.num_pages) +
                 "), got " + std::to_string(p));
  }
  return p;
}

void put_f32(uint8_t* dst, float x) { std::memcpy(dst, &x, sizeof x); }
float get_f32(const uint8_t* src) {
  float x;
  std::memcpy(&x, src, sizeof x);
  return x;
}

// Quantizes `rows` rows of d floats (one head's new tokens, row-major) and writes row r
// to the slot of token t0 + r. Uses the numerics quantizers on the whole block: their
// scale groups (PerToken; NVFP4 blocks along a row) never span two rows, so this equals
// quantizing each row alone.
void write_rows(PagedCache& cache, int seq, int64_t t0, int head, bool is_v,
                std::span<const float> x, int rows) {
  const KvCacheConfig& cfg = cache.config;
  const KvPageLayout& lay = cache.layout;
  const int d = cfg.head_dim;
  auto row_ptrs = [&](int r, uint8_t*& codes, uint8_t*& scales) {
    const int64_t t = t0 + r;
    const int64_t base = static_cast<int64_t>(page_of("append", cache, seq, t)) * lay.page_bytes;
    const int slot = static_cast<int>(t % cfg.page_size);
    codes = cache.pages.data() + base + lay.code_offset(is_v, slot, head);
    scales = cache.pages.data() + base + lay.scale_offset(is_v, slot, head);
  };
  uint8_t *codes = nullptr, *scales = nullptr;
  switch (cfg.format) {
    case KvFormat::NvFp4: {
      const auto qz = numerics::quantize_fp4(x, rows, d, numerics::Fp4Format::NvFp4);
      const int nblk = d / numerics::kNvFp4Block;
      for (int r = 0; r < rows; ++r) {
        row_ptrs(r, codes, scales);
        const uint8_t* c = qz.codes.data() + static_cast<std::size_t>(r) * d;
        for (int i = 0; i < d / 2; ++i) {
          codes[i] = static_cast<uint8_t>((c[2 * i] & 0xF) | ((c[2 * i + 1] & 0xF) << 4));
        }
        std::memcpy(scales, qz.scale_codes.data() + static_cast<std::size_t>(r) * nblk, nblk);
      }
      break;
    }
    case KvFormat::Fp8E4M3: {
      const auto qz = numerics::quantize_fp8(x, rows, d, numerics::Fp8Format::E4M3,
                                             numerics::Granularity::PerToken, numerics::Operand::K);
      for (int r = 0; r < rows; ++r) {
        row_ptrs(r, codes, scales);
        std::memcpy(codes, qz.codes.data() + static_cast<std::size_t>(r) * d, d);
        put_f32(scales, qz.scales[r]);
      }
      break;
    }
    case KvFormat::Int8: {
      const auto qz = numerics::quantize_int(x, rows, d, numerics::IntFormat::Int8,
                                             numerics::Granularity::PerToken, numerics::Operand::K);
      for (int r = 0; r < rows; ++r) {
        row_ptrs(r, codes, scales);
        std::memcpy(codes, qz.values.data() + static_cast<std::size_t>(r) * d, d);
        put_f32(scales, qz.scales[r]);
      }
      break;
    }
    case KvFormat::Bf16: {
      for (int r = 0; r < rows; ++r) {
        row_ptrs(r, codes, scales);
        for (int i = 0; i < d; ++i) {
          const uint16_t b = numerics::bf16_bits(x[static_cast<std::size_t>(r) * d + i]);
          codes[2 * i] = static_cast<uint8_t>(b & 0xFF);  // little endian, as the GPU reads it
          codes[2 * i + 1] = static_cast<uint8_t>(b >> 8);
        }
      }
      break;
    }
  }
}

// Decodes the (token t, head) row of K or V into out (d floats): code value × scale,
// one FP32 product per element (exact for NVFP4 and BF16).
void read_row(const PagedCache& cache, const char* fn, int seq, int64_t t, int head, bool is_v,
              float* out) {
  const KvCacheConfig& cfg = cache.config;
  const KvPageLayout& lay = cache.layout;
  const int d = cfg.head_dim;
  const int64_t base = static_cast<int64_t>(page_of(fn, cache, seq, t)) * lay.page_bytes;
  const int slot = static_cast<int>(t % cfg.page_size);
  const uint8_t* codes = cache.pages.data() + base + lay.code_offset(is_v, slot, head);
  const uint8_t* scales = cache.pages.data() + base + lay.scale_offset(is_v, slot, head);
  switch (cfg.format) {
    case KvFormat::NvFp4:
      for (int i = 0; i < d; ++i) {
        const uint8_t nib = (i % 2 == 0) ? (codes[i / 2] & 0xF) : (codes[i / 2] >> 4);
        out[i] =
            numerics::e2m1_decode(nib) * numerics::e4m3_decode(scales[i / numerics::kNvFp4Block]);
      }
      break;
    case KvFormat::Fp8E4M3: {
      const float s = get_f32(scales);
      for (int i = 0; i < d; ++i) out[i] = numerics::e4m3_decode(codes[i]) * s;
      break;
    }
    case KvFormat::Int8: {
      const float s = get_f32(scales);
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(static_cast<int8_t>(codes[i])) * s;
      break;
    }
    case KvFormat::Bf16:
      for (int i = 0; i < d; ++i) {
        out[i] = numerics::bf16_from_bits(
            static_cast<uint16_t>(codes[2 * i] | (static_cast<uint16_t>(codes[2 * i + 1]) << 8)));
      }
      break;
  }
}

// Validates the pages covering tokens [0, len) of seq.
void check_pages(const char* fn, const PagedCache& cache, int seq, int64_t len) {
  for (int64_t t = 0; t < len; t += cache.config.page_size) page_of(fn, cache, seq, t);
}

}  // namespace

// ---- layout -------------------------------------------------------------------------------

KvPageLayout kv_page_layout(const KvCacheConfig& c) {
  constexpr const char* kFn = "kv_page_layout";
  if (!valid_format(c.format)) {
    fail(kFn,
         "format must be a KvFormat enumerator, got " + std::to_string(static_cast<int>(c.format)));
  }
  if (c.heads_kv <= 0) fail(kFn, "heads_kv must be positive, got " + std::to_string(c.heads_kv));
  if (c.head_dim <= 0 || c.head_dim % numerics::kNvFp4Block != 0 || c.head_dim > kKvMaxHeadDim) {
    fail(kFn,
         "head_dim must be a positive multiple of 16 up to 256, got " + std::to_string(c.head_dim));
  }
  if (c.page_size <= 0) fail(kFn, "page_size must be positive, got " + std::to_string(c.page_size));
  if (c.num_pages <= 0) fail(kFn, "num_pages must be positive, got " + std::to_string(c.num_pages));
  if (c.max_seqs <= 0) fail(kFn, "max_seqs must be positive, got " + std::to_string(c.max_seqs));
  if (c.max_pages_per_seq <= 0) {
    fail(kFn, "max_pages_per_seq must be positive, got " + std::to_string(c.max_pages_per_seq));
  }
  if (static_cast<int64_t>(c.max_pages_per_seq) * c.page_size >
      std::numeric_limits<int32_t>::max()) {
    fail(kFn, "max_pages_per_seq*page_size (the capacity) must fit in int32");
  }
  if (c.k_smoothing != KvSmoothing::None && c.k_smoothing != KvSmoothing::PrefillMean) {
    fail(kFn, "k_smoothing must be KvSmoothing::None or KvSmoothing::PrefillMean");
  }
  const KvPageLayout l = kvcache::page_layout(c.format, c.heads_kv, c.head_dim, c.page_size);
  if (l.page_bytes > 0 && c.num_pages > std::numeric_limits<int64_t>::max() / l.page_bytes) {
    fail(kFn, "num_pages*page_bytes overflows");
  }
  return l;
}

int64_t kv_bytes_per_token_head(KvFormat format, int head_dim) {
  KvCacheConfig c;
  c.format = format;
  c.head_dim = head_dim;
  c.page_size = 1;
  c.num_pages = 1;
  c.max_pages_per_seq = 1;
  const KvPageLayout l = kv_page_layout(c);
  return l.code_row_bytes + l.scale_row_bytes;
}

// ---- cache management ---------------------------------------------------------------------

PagedCache make_paged_cache(const KvCacheConfig& config) {
  PagedCache c;
  c.layout = kv_page_layout(config);
  c.config = config;
  const std::size_t seqs = static_cast<std::size_t>(config.max_seqs);
  c.pages.assign(static_cast<std::size_t>(config.num_pages) * c.layout.page_bytes, 0);
  c.block_tables.assign(seqs * config.max_pages_per_seq, -1);
  c.lengths.assign(seqs, 0);
  c.k_mean.assign(seqs * config.heads_kv * config.head_dim, 0.0f);
  c.k_mean_fixed.assign(seqs, 0);
  return c;
}

PagedCache make_contiguous_cache(KvFormat format, int heads_kv, int head_dim, int max_seqs,
                                 int capacity, KvSmoothing k_smoothing) {
  KvCacheConfig cfg;
  cfg.format = format;
  cfg.heads_kv = heads_kv;
  cfg.head_dim = head_dim;
  cfg.page_size = capacity;
  cfg.num_pages = max_seqs;
  cfg.max_seqs = max_seqs;
  cfg.max_pages_per_seq = 1;
  cfg.k_smoothing = k_smoothing;
  PagedCache c = make_paged_cache(cfg);
  for (int s = 0; s < max_seqs; ++s) c.block(s, 0) = s;
  return c;
}

void assign_pages(PagedCache& cache, int seq, std::span<const int32_t> pages) {
  constexpr const char* kFn = "assign_pages";
  check_cache(kFn, cache);
  check_seq(kFn, cache, seq);
  if (static_cast<int64_t>(pages.size()) > cache.config.max_pages_per_seq) {
    fail(kFn, "pages.size() must be at most max_pages_per_seq = " +
                  std::to_string(cache.config.max_pages_per_seq) + ", got " +
                  std::to_string(pages.size()));
  }
  for (std::size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] < 0 || pages[i] >= cache.config.num_pages) {
      fail(kFn, "pages[" + std::to_string(i) + "] must be in [0, num_pages = " +
                    std::to_string(cache.config.num_pages) + "), got " + std::to_string(pages[i]));
    }
  }
  for (std::size_t i = 0; i < pages.size(); ++i) cache.block(seq, static_cast<int>(i)) = pages[i];
}

void set_k_smoothing(PagedCache& cache, int seq, std::span<const float> c) {
  constexpr const char* kFn = "set_k_smoothing";
  check_cache(kFn, cache);
  check_seq(kFn, cache, seq);
  const std::size_t n = static_cast<std::size_t>(cache.config.heads_kv) * cache.config.head_dim;
  if (cache.config.k_smoothing != KvSmoothing::PrefillMean) {
    fail(kFn, "cache.config.k_smoothing must be PrefillMean to take a vector c");
  }
  if (c.size() != n) {
    fail(kFn, "c.size() must be heads_kv*head_dim = " + std::to_string(n) + ", got " +
                  std::to_string(c.size()));
  }
  if (cache.lengths[seq] != 0) {
    fail(kFn, "seq " + std::to_string(seq) +
                  " already holds tokens: c is fixed once, before the first append");
  }
  std::copy(c.begin(), c.end(), cache.k_mean.begin() + seq * n);
  cache.k_mean_fixed[seq] = 1;
}

void reset_sequence(PagedCache& cache, int seq) {
  check_cache("reset_sequence", cache);
  check_seq("reset_sequence", cache, seq);
  const std::size_t n = static_cast<std::size_t>(cache.config.heads_kv) * cache.config.head_dim;
  cache.lengths[seq] = 0;
  cache.k_mean_fixed[seq] = 0;
  std::fill(cache.k_mean.begin() + seq * n, cache.k_mean.begin() + (seq + 1) * n, 0.0f);
}

// ---- append -------------------------------------------------------------------------------

void append(PagedCache& cache, int seq, const Tensor4& k_new, const Tensor4& v_new) {
  constexpr const char* kFn = "append";
  check_cache(kFn, cache);
  check_seq(kFn, cache, seq);
  const KvCacheConfig& cfg = cache.config;
  const int hk = cfg.heads_kv, d = cfg.head_dim;
  if (k_new.b != 1 || k_new.h != hk || k_new.d != d || k_new.n <= 0 ||
      k_new.data.size() != static_cast<std::size_t>(hk) * k_new.n * d) {
    fail(kFn, "k_new must be (1, heads_kv = " + std::to_string(hk) +
                  ", n >= 1, head_dim = " + std::to_string(d) + "), got (" +
                  std::to_string(k_new.b) + ", " + std::to_string(k_new.h) + ", " +
                  std::to_string(k_new.n) + ", " + std::to_string(k_new.d) + ")");
  }
  if (!v_new.same_shape(1, hk, k_new.n, d) || v_new.data.size() != k_new.data.size()) {
    fail(kFn, "v_new must have k_new's shape (1, heads_kv, n, head_dim)");
  }
  const int64_t len = cache.lengths[seq];
  const int n = k_new.n;
  if (len < 0 || len + n > cache.capacity()) {
    fail(kFn, "length: seq " + std::to_string(seq) + " holds " + std::to_string(len) +
                  " tokens; appending " + std::to_string(n) + " exceeds its capacity " +
                  std::to_string(cache.capacity()) + " (max_pages_per_seq*page_size)");
  }
  // Every page the new tokens land in, checked before any byte is written.
  for (int64_t t = len; t < len + n; ++t) {
    if (t == len || t % cfg.page_size == 0) page_of(kFn, cache, seq, t);
  }

  const std::size_t cn = static_cast<std::size_t>(hk) * d;
  float* c = cache.k_mean.data() + seq * cn;
  if (cfg.k_smoothing == KvSmoothing::PrefillMean && !cache.k_mean_fixed[seq]) {
    for (int h = 0; h < hk; ++h) {
      const std::span<const float> kh(k_new.row(0, h, 0), static_cast<std::size_t>(n) * d);
      const std::vector<float> mean =
          numerics::token_mean(kh, n, d, numerics::MeanEstimate::Sampled);
      std::copy(mean.begin(), mean.end(), c + static_cast<std::size_t>(h) * d);
    }
    cache.k_mean_fixed[seq] = 1;
  }

  for (int h = 0; h < hk; ++h) {
    const std::span<const float> kh(k_new.row(0, h, 0), static_cast<std::size_t>(n) * d);
    const std::span<const float> vh(v_new.row(0, h, 0), static_cast<std::size_t>(n) * d);
    if (cfg.k_smoothing == KvSmoothing::None) {
      write_rows(cache, seq, len, h, /*is_v=*/false, kh, n);
    } else {
      const std::vector<float> ks = numerics::subtract_row_vector(
          kh, n, d, std::span<const float>(c + static_cast<std::size_t>(h) * d, d));
      write_rows(cache, seq, len, h, /*is_v=*/false, ks, n);
    }
    write_rows(cache, seq, len, h, /*is_v=*/true, vh, n);
  }
  cache.lengths[seq] = static_cast<int32_t>(len + n);
}

// ---- dequantize ---------------------------------------------------------------------------

DequantizedKv dequantize_kv(const PagedCache& cache, int seq) {
  constexpr const char* kFn = "dequantize_kv";
  check_cache(kFn, cache);
  check_seq(kFn, cache, seq);
  const int len = cache.lengths[seq];
  if (len < 0 || len > cache.capacity()) {
    fail(kFn, "lengths[" + std::to_string(seq) + "] must be in [0, capacity = " +
                  std::to_string(cache.capacity()) + "], got " + std::to_string(len));
  }
  check_pages(kFn, cache, seq, len);
  const int hk = cache.config.heads_kv, d = cache.config.head_dim;
  DequantizedKv out{Tensor4(1, hk, len, d), Tensor4(1, hk, len, d), {}};
  for (int h = 0; h < hk; ++h) {
    for (int t = 0; t < len; ++t) {
      read_row(cache, kFn, seq, t, h, false, out.k.row(0, h, t));
      read_row(cache, kFn, seq, t, h, true, out.v.row(0, h, t));
    }
  }
  const std::size_t cn = static_cast<std::size_t>(hk) * d;
  out.k_mean.assign(cache.k_mean.begin() + seq * cn, cache.k_mean.begin() + (seq + 1) * cn);
  return out;
}

// ---- decode -------------------------------------------------------------------------------

namespace {

// One chunk's partial result: O_s normalized, lse_s in the log2 domain of x.
struct Partial {
  std::vector<float> o;
  float lse = kNegInf;
};

}  // namespace

EmulatedForward decode_emulated(const Tensor4& q, const PagedCache& cache,
                                const DecodeParams& params) {
  constexpr const char* kFn = "decode_emulated";
  check_cache(kFn, cache);
  const KvCacheConfig& cfg = cache.config;
  const int hk = cfg.heads_kv, d = cfg.head_dim;
  if (params.format && *params.format != cfg.format) {
    fail(kFn, std::string("format: the call expects ") + kv_format_name(*params.format) +
                  " but the cache holds " + kv_format_name(cfg.format));
  }
  if (q.b <= 0 || q.h <= 0 || q.n <= 0 || q.d <= 0 ||
      q.data.size() != static_cast<std::size_t>(q.b) * q.h * q.n * q.d) {
    fail(kFn, "q must be (B, Hq, nq, d) with every dimension >= 1 and matching data");
  }
  if (q.n > kKvMaxQueryTokens) {
    fail(kFn, "nq (q's token count) must be in [1, 16], got " + std::to_string(q.n));
  }
  if (q.d != d) {
    fail(kFn, "q's head dim must equal the cache's head_dim " + std::to_string(d) + ", got " +
                  std::to_string(q.d));
  }
  if (q.h % hk != 0) {
    fail(kFn, "heads_kv " + std::to_string(hk) + " must divide q's heads " + std::to_string(q.h));
  }
  if (params.num_splits < 1) {
    fail(kFn, "num_splits must be >= 1, got " + std::to_string(params.num_splits));
  }
  if (params.kv_tile < 1) fail(kFn, "kv_tile must be >= 1, got " + std::to_string(params.kv_tile));
  if (params.mask != Mask::None && params.mask != Mask::Causal) {
    fail(kFn, "mask must be Mask::None or Mask::Causal");
  }
  std::vector<int> seqs = params.seqs;
  if (seqs.empty()) {
    for (int b = 0; b < q.b; ++b) seqs.push_back(b);
  }
  if (static_cast<int>(seqs.size()) != q.b) {
    fail(kFn, "seqs.size() must equal q's batch " + std::to_string(q.b) + ", got " +
                  std::to_string(seqs.size()));
  }
  for (int s : seqs) {
    check_seq(kFn, cache, s);
    if (cache.lengths[s] < 0 || cache.lengths[s] > cache.capacity()) {
      fail(kFn, "lengths[" + std::to_string(s) +
                    "] must be in [0, capacity = " + std::to_string(cache.capacity()) + "], got " +
                    std::to_string(cache.lengths[s]));
    }
    check_pages(kFn, cache, s, cache.lengths[s]);
  }
  double sm_scale_d = 1.0 / std::sqrt(static_cast<double>(d));
  if (params.sm_scale) {
    sm_scale_d = *params.sm_scale;
    if (!std::isfinite(sm_scale_d) || sm_scale_d == 0.0 ||
        !std::isfinite(static_cast<float>(sm_scale_d * kLog2eDouble))) {
      fail(kFn, "sm_scale must be finite and non-zero, with sm_scale*log2(e) a finite FP32");
    }
  }
  const float sm_scale = static_cast<float>(sm_scale_d);
  const float scale_log2 = static_cast<float>(sm_scale_d * kLog2eDouble);

  const int nq = q.n, group = q.h / hk, S = params.num_splits, tile = params.kv_tile;
  EmulatedForward out{Tensor4(q.b, q.h, nq, d),
                      std::vector<float>(static_cast<std::size_t>(q.b) * q.h * nq)};
  std::vector<float> qb(d), krow(d), vrow(d), x(tile), o_tile(d);
  std::vector<Partial> parts(S);

  for (int b = 0; b < q.b; ++b) {
    const int seq = seqs[b];
    const int L = cache.lengths[seq];
    const int chunk = kvcache::decode_chunk_keys(L, S);  // 0 when L = 0: every chunk empty
    for (int hq = 0; hq < q.h; ++hq) {
      const int h = hq / group;
      const float* c = cache.k_mean.data() + (static_cast<std::size_t>(seq) * hk + h) * d;
      for (int i = 0; i < nq; ++i) {
        // Step 1: Q in BF16; q·c for the LSE.
        const float* qrow = q.row(b, hq, i);
        float qc = 0.0f;
        for (int e = 0; e < d; ++e) {
          qb[e] = numerics::bf16_round(qrow[e]);
          qc += qb[e] * c[e];
        }
        // Steps 2-4: per chunk, online softmax over tiles.
        for (int s = 0; s < S; ++s) {
          Partial& part = parts[s];
          part.o.assign(d, 0.0f);
          part.lse = kNegInf;
          const int j_begin = std::min(L, s * chunk), j_end = std::min(L, (s + 1) * chunk);
          float m = kNegInf, l = 0.0f;
          for (int j0 = j_begin; j0 < j_end; j0 += tile) {
            const int jn = std::min(tile, j_end - j0);
            float mx = kNegInf;
            for (int jj = 0; jj < jn; ++jj) {
              const int j = j0 + jj;
              float xv = kNegInf;
              if (key_visible(params.mask, i, j, nq, L)) {
                read_row(cache, kFn, seq, j, h, false, krow.data());
                float acc = 0.0f;
                for (int e = 0; e < d; ++e) acc += qb[e] * krow[e];
                xv = acc * scale_log2;
              }
              x[jj] = xv;
              mx = nan_max(mx, xv);
            }
            const float m_new = nan_max(m, mx);
            if (m_new == kNegInf) continue;  // nothing visible yet: no inf − inf
            const float alpha = std::exp2(m - m_new);
            std::fill(o_tile.begin(), o_tile.end(), 0.0f);
            float sum = 0.0f;
            for (int jj = 0; jj < jn; ++jj) {
              if (x[jj] == kNegInf) continue;  // masked: p = 0, and its V is never read
              const float p = std::exp2(x[jj] - m_new);
              sum += p;
              read_row(cache, kFn, seq, j0 + jj, h, true, vrow.data());
              for (int e = 0; e < d; ++e) o_tile[e] += p * vrow[e];
            }
            l = l * alpha + sum;
            for (int e = 0; e < d; ++e) part.o[e] = part.o[e] * alpha + o_tile[e];
            m = m_new;
          }
          if (m != kNegInf) {
            for (int e = 0; e < d; ++e) part.o[e] /= l;
            part.lse = m + std::log2(l);
          }
        }
        // Step 5: merge the partials by their LSE, s in order.
        float M = kNegInf;
        for (const Partial& p : parts) M = nan_max(M, p.lse);
        float* orow = out.o.row(b, hq, i);
        float& lse = out.lse[(static_cast<std::size_t>(b) * q.h + hq) * nq + i];
        if (M == kNegInf) {
          std::fill(orow, orow + d, 0.0f);
          lse = kNegInf;
          continue;
        }
        float W = 0.0f;
        std::fill(orow, orow + d, 0.0f);
        for (const Partial& p : parts) {
          if (p.lse == kNegInf) continue;  // an empty chunk weighs 0
          const float w = std::exp2(p.lse - M);
          W += w;
          for (int e = 0; e < d; ++e) orow[e] += w * p.o[e];
        }
        for (int e = 0; e < d; ++e) orow[e] /= W;
        lse = (M + std::log2(W)) * kLn2 + sm_scale * qc;
      }
    }
  }
  return out;
}

const char* kv_format_name(KvFormat f) {
  switch (f) {
    case KvFormat::NvFp4:
      return "NvFp4";
    case KvFormat::Fp8E4M3:
      return "Fp8E4M3";
    case KvFormat::Int8:
      return "Int8";
    case KvFormat::Bf16:
      return "Bf16";
  }
  return "?";
}

}  // namespace qattn::emulate
