// The KV-cache C ABI (qattn_kv_*) without a GPU: the page size equals the cache
// emulation's layout; every bad field of the cache, the sequences, an append or a
// decode is refused with its name; the host mirrors are checked exactly where the call
// reads or writes; the decode's split count and workspace follow the family's rule;
// the registry declines a KV family naming it and the reason.
//
// The buffers are fake device addresses (far apart, never mapped in this process):
// had validation dereferenced one, the test would crash instead of failing. The host
// mirrors are real host arrays, which validation does read.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "api/family.h"
#include "api/registry.h"
#include "api/validate_kv.h"
#include "api_outcome.h"
#include "cuda/kv_cache/workspace.h"
#include "emulate/kv_cache.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"
#include "test_seed.h"

namespace {

using qattn::api::Arch;
using qattn::api::KvCacheFamily;
using qattn::api::KvCall;
using qattn::test::fake;
using qattn::test::Outcome;
using qattn::test::outcome;

bool contains(const std::string& s, const std::string& word) {
  return s.find(word) != std::string::npos;
}

// A call that passed validation stops at the device: a CPU-only build has no kernels;
// a CUDA build without a GPU has no device; one with a GPU refuses the fake addresses
// as not device memory (unmapped, or host memory: the driver may say either), or, not
// a Hopper, declines the family by the compute capability.
#define EXPECT_REACHES_THE_DEVICE(outcome_expr)                                     \
  do {                                                                              \
    const ::qattn::test::Outcome r_ = (outcome_expr);                               \
    if (!QATTN_HAVE_CUDA) {                                                         \
      EXPECT_REJECTS(r_, QATTN_ERROR_NO_DEVICE, "no CUDA kernels");                 \
    } else if (r_.status == QATTN_ERROR_UNSUPPORTED) {                              \
      EXPECT_TRUE(contains(r_.message, "compute capability")) << r_.message;        \
    } else if (r_.status != QATTN_ERROR_NO_DEVICE) {                                \
      EXPECT_REJECTS(r_, QATTN_ERROR_INVALID_ARGUMENT, "allowed: device memory");   \
    }                                                                               \
  } while (0)

// ---- the baseline call ---------------------------------------------------------------

struct Config {
  int32_t format = QATTN_KV_NVFP4, heads_kv = 2, head_dim = 128, page_size = 16, num_pages = 64,
          max_pages_per_seq = 8, k_smoothing = QATTN_KV_SMOOTH_PREFILL_MEAN;
};
constexpr int kCapacity = 8 * 16;  // the default max_pages_per_seq * page_size

// Slots: 1 the page pool, 2 block tables, 3 lengths, 4 k_mean, 5 k, 6 v, 7 q, 8 o,
// 9 lse, 10 the workspace.
qattn_kv_cache make_cache(const Config& c = {}) {
  qattn_kv_cache cache;
  qattn_kv_cache_init(&cache);
  cache.format = c.format;
  cache.heads_kv = c.heads_kv;
  cache.head_dim = c.head_dim;
  cache.page_size = c.page_size;
  cache.num_pages = c.num_pages;
  cache.max_pages_per_seq = c.max_pages_per_seq;
  cache.k_smoothing = c.k_smoothing;
  cache.pages = fake(1);
  return cache;
}

qattn_kv_seqs device_seqs(const qattn_kv_cache& c) {
  qattn_kv_seqs s{};
  s.block_tables = static_cast<int32_t*>(fake(2));
  s.lengths = static_cast<int32_t*>(fake(3));
  if (c.k_smoothing == QATTN_KV_SMOOTH_PREFILL_MEAN) s.k_mean = static_cast<float*>(fake(4));
  return s;
}

// (batch, heads, tokens, head_dim) BF16, contiguous HND.
qattn_tensor tensor(int slot, int heads, int tokens, int head_dim) {
  return qattn::make_tensor(fake(slot), qattn::Layout::kHND, heads, tokens, head_dim);
}

qattn_kv_append_params append_params(const qattn_kv_cache& c, int batch = 2, int n_new = 3) {
  qattn_kv_append_params p;
  qattn_kv_append_params_init(&p);
  p.cache = &c;
  p.seqs = device_seqs(c);
  p.batch = batch;
  p.n_new = n_new;
  p.k = tensor(5, c.heads_kv, n_new, c.head_dim);
  p.v = tensor(6, c.heads_kv, n_new, c.head_dim);
  return p;
}

qattn_kv_decode_params decode_params(const qattn_kv_cache& c, int batch = 2, int heads_q = 8,
                                     int nq = 2) {
  qattn_kv_decode_params p;
  qattn_kv_decode_params_init(&p);
  p.cache = &c;
  p.seqs = device_seqs(c);
  p.batch = batch;
  p.heads_q = heads_q;
  p.nq = nq;
  p.q = tensor(7, heads_q, nq, c.head_dim);
  p.o = tensor(8, heads_q, nq, c.head_dim);
  p.lse = static_cast<float*>(fake(9));
  return p;
}

Outcome page_bytes_of(const qattn_kv_cache& c, std::size_t* bytes = nullptr) {
  std::size_t b = 0;
  const qattn_status s = qattn_kv_cache_page_bytes(&c, &b);
  if (bytes != nullptr) *bytes = b;
  return outcome(s);
}

Outcome append(const qattn_kv_append_params& p) { return outcome(qattn_kv_append(&p, nullptr)); }

Outcome size_of(const qattn_kv_decode_params& p) {
  std::size_t bytes = 0;
  return outcome(qattn_kv_decode_workspace_size(&p, &bytes));
}

std::size_t need(const qattn_kv_decode_params& p) {
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_kv_decode_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  return bytes;
}

Outcome decode(const qattn_kv_decode_params& p, void* ws, std::size_t bytes) {
  return outcome(qattn_kv_decode(&p, ws, bytes, nullptr));
}

// The split count the library resolves for a decode (read_decode is what both the
// workspace query and the decode itself call).
int32_t splits_of(const qattn_kv_decode_params& p) {
  qattn_kv_decode_params full;
  qattn_kv_cache cache;
  int32_t splits = -1;
  EXPECT_EQ(qattn::api::read_decode("t", &p, &full, &cache, &splits), QATTN_OK)
      << qattn_last_error_message();
  return splits;
}

// Host mirrors of `batch` sequences: every block-table entry a distinct valid page.
struct Mirrors {
  std::vector<int32_t> tables, lengths;
  Mirrors(const qattn_kv_cache& c, int batch, std::vector<int32_t> lens)
      : tables(static_cast<std::size_t>(batch) * c.max_pages_per_seq), lengths(std::move(lens)) {
    for (std::size_t i = 0; i < tables.size(); ++i)
      tables[i] = static_cast<int32_t>(i % static_cast<std::size_t>(c.num_pages));
  }
  int32_t& entry(const qattn_kv_cache& c, int b, int i) {
    return tables[static_cast<std::size_t>(b) * c.max_pages_per_seq + i];
  }
  void attach(qattn_kv_seqs& s) {
    s.host_block_tables = tables.data();
    s.host_lengths = lengths.data();
  }
};

// ---- the cache descriptor ---------------------------------------------------------------

TEST(KvCacheAbi, InitGivesTheDocumentedDefaults) {
  qattn_kv_cache c;
  std::memset(&c, 0x5A, sizeof(c));
  qattn_kv_cache_init(&c);
  EXPECT_EQ(c.struct_size, sizeof(qattn_kv_cache));
  EXPECT_EQ(c.format, QATTN_KV_NVFP4);
  EXPECT_EQ(c.k_smoothing, QATTN_KV_SMOOTH_PREFILL_MEAN);
  EXPECT_EQ(c.page_size, 16);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.heads_kv, 1);
  EXPECT_EQ(c.num_pages, 0);
  EXPECT_EQ(c.max_pages_per_seq, 0);
  EXPECT_EQ(c.reserved0, 0);
  EXPECT_EQ(c.pages, nullptr);
  qattn_kv_cache_init(nullptr);  // no crash
  // The sizes are the caller's to set: the first one missing is named.
  EXPECT_REJECTS(page_bytes_of(c), QATTN_ERROR_INVALID_ARGUMENT, "cache->num_pages = 0");
  // No tail padding: a field appended later cannot land inside an older struct_size.
  EXPECT_EQ(QATTN_KV_CACHE_MIN_SIZE, sizeof(qattn_kv_cache));
  EXPECT_EQ(QATTN_KV_APPEND_PARAMS_MIN_SIZE, sizeof(qattn_kv_append_params));
  EXPECT_EQ(QATTN_KV_DECODE_PARAMS_MIN_SIZE, sizeof(qattn_kv_decode_params));
}

// docs/kv-cache.md, "Bytes per token": a page of 16 tokens x 8 heads at d = 128.
TEST(KvCacheAbi, PageBytesOfTheDocumentedExample) {
  Config cfg;
  cfg.heads_kv = 8;
  for (auto [format, bytes] :
       {std::pair{QATTN_KV_NVFP4, 18432u}, std::pair{QATTN_KV_FP8_E4M3, 33792u},
        std::pair{QATTN_KV_INT8, 33792u}, std::pair{QATTN_KV_BF16, 65536u}}) {
    cfg.format = format;
    qattn_kv_cache c = make_cache(cfg);
    c.pages = nullptr;  // the size query needs no pool yet
    std::size_t got = 0;
    ASSERT_EQ(page_bytes_of(c, &got).status, QATTN_OK) << qattn_last_error_message();
    EXPECT_EQ(got, bytes) << format;
  }
}

// The C ABI's size is the layout the emulation (and the kernels) address, for fresh
// random configs of every format.
TEST(KvCacheAbi, PageBytesEqualTheEmulationsLayout) {
  const std::uint32_t seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 2000; ++i) {
    Config cfg;
    cfg.format = i % 4;  // every format equally often
    cfg.heads_kv = pick(1, 64);
    cfg.head_dim = 16 * pick(1, 16);
    cfg.page_size = pick(0, 3) == 0 ? pick(1, 8) : pick(1, 1024);
    cfg.num_pages = pick(1, 1 << 16);
    cfg.max_pages_per_seq = pick(1, 4096);
    cfg.k_smoothing = pick(0, 1);
    qattn_kv_cache c = make_cache(cfg);
    if (pick(0, 1) != 0) c.pages = nullptr;

    qattn::emulate::KvCacheConfig e;
    e.format = static_cast<qattn::emulate::KvFormat>(cfg.format);
    e.heads_kv = cfg.heads_kv;
    e.head_dim = cfg.head_dim;
    e.page_size = cfg.page_size;
    e.num_pages = cfg.num_pages;
    e.max_pages_per_seq = cfg.max_pages_per_seq;
    e.k_smoothing = cfg.k_smoothing == QATTN_KV_SMOOTH_NONE
                        ? qattn::emulate::KvSmoothing::None
                        : qattn::emulate::KvSmoothing::PrefillMean;
    SCOPED_TRACE("iteration " + std::to_string(i) + ": format " + std::to_string(cfg.format) +
                 ", heads_kv " + std::to_string(cfg.heads_kv) + ", d " +
                 std::to_string(cfg.head_dim) + ", page_size " + std::to_string(cfg.page_size));
    std::size_t got = 0;
    const Outcome o = page_bytes_of(c, &got);
    ASSERT_EQ(o.status, QATTN_OK) << o.message;
    EXPECT_EQ(got, static_cast<std::size_t>(qattn::emulate::kv_page_layout(e).page_bytes));
    EXPECT_EQ(got % 16, 0u);  // every page of the pool starts 16-byte aligned
  }
}

TEST(KvCacheAbi, EveryBadFieldIsNamed) {
  struct Bad {
    const char* field;
    int32_t qattn_kv_cache::*member;
    int32_t value;
    const char* allowed;
  };
  const std::array<Bad, 22> bad{{
      {"cache->format", &qattn_kv_cache::format, 4, "QATTN_KV_BF16 (3)"},
      {"cache->format", &qattn_kv_cache::format, -1, "QATTN_KV_NVFP4 (0)"},
      {"cache->heads_kv", &qattn_kv_cache::heads_kv, 0, "1..65535"},
      {"cache->heads_kv", &qattn_kv_cache::heads_kv, 65536, "1..65535"},  // a grid dimension
      // Not a multiple of the 16-element NVFP4 block, or beyond 256.
      {"cache->head_dim", &qattn_kv_cache::head_dim, 0, "multiple of 16"},
      {"cache->head_dim", &qattn_kv_cache::head_dim, 8, "multiple of 16"},
      {"cache->head_dim", &qattn_kv_cache::head_dim, 24, "multiple of 16"},
      {"cache->head_dim", &qattn_kv_cache::head_dim, 272, "from 16 to 256"},
      {"cache->head_dim", &qattn_kv_cache::head_dim, -16, "multiple of 16"},
      {"cache->page_size", &qattn_kv_cache::page_size, 0, "1..1073741824"},
      {"cache->page_size", &qattn_kv_cache::page_size, -16, "1..1073741824"},
      {"cache->num_pages", &qattn_kv_cache::num_pages, 0, "1.."},
      {"cache->num_pages", &qattn_kv_cache::num_pages, -1, "1.."},
      {"cache->max_pages_per_seq", &qattn_kv_cache::max_pages_per_seq, 0, "1.."},
      {"cache->max_pages_per_seq", &qattn_kv_cache::max_pages_per_seq, -3, "1.."},
      // 2^26 + 1 pages of 16 tokens: one page past the 2^30-token capacity.
      {"cache->max_pages_per_seq * page_size", &qattn_kv_cache::max_pages_per_seq, (1 << 26) + 1,
       "at most 2^30"},
      {"cache->max_pages_per_seq * page_size", &qattn_kv_cache::max_pages_per_seq,
       std::numeric_limits<int32_t>::max(), "at most 2^30"},
      {"cache->k_smoothing", &qattn_kv_cache::k_smoothing, 2, "QATTN_KV_SMOOTH_NONE (1)"},
      {"cache->k_smoothing", &qattn_kv_cache::k_smoothing, -1, "QATTN_KV_SMOOTH_PREFILL_MEAN (0)"},
      {"cache->reserved0", &qattn_kv_cache::reserved0, 1, "allowed: 0"},
      {"cache->reserved0", &qattn_kv_cache::reserved0, -1, "qattn_kv_cache_init"},
      {"cache->reserved0", &qattn_kv_cache::reserved0, 1 << 30, "allowed: 0"},
  }};
  for (const Bad& b : bad) {
    SCOPED_TRACE(std::string(b.field) + " = " + std::to_string(b.value));
    qattn_kv_cache c = make_cache();
    c.*b.member = b.value;
    EXPECT_REJECTS(page_bytes_of(c), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_kv_cache_page_bytes: " + std::string(b.field) + " = ", b.allowed);
    // The append and the decode read the cache with the same rules, under their names.
    const qattn_kv_append_params a = append_params(c);
    EXPECT_REJECTS(append(a), QATTN_ERROR_INVALID_ARGUMENT, "qattn_kv_append: ", b.field);
    const qattn_kv_decode_params d = decode_params(c);
    EXPECT_REJECTS(size_of(d), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_kv_decode_workspace_size: ", b.field);
    EXPECT_REJECTS(decode(d, fake(10), 1 << 20), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_kv_decode: ", b.field);
  }
  // The largest capacity allowed is exactly 2^30 tokens.
  qattn_kv_cache c = make_cache();
  c.max_pages_per_seq = 1 << 26;
  EXPECT_EQ(page_bytes_of(c).status, QATTN_OK) << qattn_last_error_message();
  // A pool whose byte size does not fit is refused, not wrapped: 2^30-token pages of
  // 8 BF16 heads are 2^43 bytes each.
  c = make_cache({.format = QATTN_KV_BF16,
                  .heads_kv = 8,
                  .head_dim = 256,
                  .page_size = 1 << 30,
                  .num_pages = 1 << 20,
                  .max_pages_per_seq = 1});
  EXPECT_REJECTS(page_bytes_of(c), QATTN_ERROR_INVALID_ARGUMENT, "cache->num_pages * page bytes");
}

TEST(KvCacheAbi, NullsAndStructSize) {
  std::size_t bytes = 0;
  EXPECT_REJECTS(outcome(qattn_kv_cache_page_bytes(nullptr, &bytes)), QATTN_ERROR_INVALID_ARGUMENT,
                 "qattn_kv_cache_page_bytes: cache is NULL");
  const qattn_kv_cache good = make_cache();
  EXPECT_REJECTS(outcome(qattn_kv_cache_page_bytes(&good, nullptr)), QATTN_ERROR_INVALID_ARGUMENT,
                 "page_bytes is NULL");

  qattn_kv_cache c = good;
  c.struct_size = 0;  // never initialized
  EXPECT_REJECTS(page_bytes_of(c), QATTN_ERROR_INVALID_ARGUMENT, "cache->struct_size = 0",
                 "qattn_kv_cache_init");
  c.struct_size = QATTN_KV_CACHE_MIN_SIZE - 1;
  EXPECT_REJECTS(page_bytes_of(c), QATTN_ERROR_INVALID_ARGUMENT, "cache->struct_size");
  // A program built against a newer header: unsupported, not invalid.
  struct Newer {
    qattn_kv_cache base;
    int64_t field_from_the_future;
  } newer{};
  newer.base = good;
  newer.base.struct_size = sizeof(Newer);
  EXPECT_REJECTS(page_bytes_of(newer.base), QATTN_ERROR_UNSUPPORTED, "cache->struct_size",
                 "newer qattn.h");
  const qattn_kv_append_params a = append_params(newer.base);
  EXPECT_REJECTS(append(a), QATTN_ERROR_UNSUPPORTED, "qattn_kv_append", "newer qattn.h");
  const qattn_kv_decode_params d = decode_params(newer.base);
  EXPECT_REJECTS(size_of(d), QATTN_ERROR_UNSUPPORTED, "newer qattn.h");
}

// ---- append ---------------------------------------------------------------------------

TEST(KvAppendAbi, InitGivesDefaults) {
  qattn_kv_append_params p;
  std::memset(&p, 0x5A, sizeof(p));
  qattn_kv_append_params_init(&p);
  EXPECT_EQ(p.struct_size, sizeof(qattn_kv_append_params));
  EXPECT_EQ(p.cache, nullptr);
  EXPECT_EQ(p.seqs.block_tables, nullptr);
  EXPECT_EQ(p.seqs.host_lengths, nullptr);
  EXPECT_EQ(p.k.data, nullptr);
  EXPECT_EQ(p.dtype, QATTN_DTYPE_BF16);
  EXPECT_EQ(p.k_mean_preset, 0);
  qattn_kv_append_params_init(nullptr);  // no crash
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "qattn_kv_append: cache is NULL");
  EXPECT_REJECTS(outcome(qattn_kv_append(nullptr, nullptr)), QATTN_ERROR_INVALID_ARGUMENT,
                 "qattn_kv_append: params is NULL");
}

TEST(KvAppendAbi, ValidCallsReachTheDeviceAndLeaveTheMirrorAlone) {
  for (int format = 0; format < 4; ++format) {
    for (int smoothing : {QATTN_KV_SMOOTH_PREFILL_MEAN, QATTN_KV_SMOOTH_NONE}) {
      SCOPED_TRACE("format " + std::to_string(format) + ", smoothing " + std::to_string(smoothing));
      const qattn_kv_cache c = make_cache({.format = format, .k_smoothing = smoothing});
      qattn_kv_append_params p = append_params(c);
      p.dtype = format % 2 == 0 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
      EXPECT_REACHES_THE_DEVICE(append(p));
      // With the mirrors: validation passes, nothing is launched, so host_lengths keeps
      // its values (it only advances with a launched append).
      Mirrors m(c, 2, {20, 0});
      m.attach(p.seqs);
      if (smoothing == QATTN_KV_SMOOTH_PREFILL_MEAN) p.k_mean_preset = 1;
      EXPECT_REACHES_THE_DEVICE(append(p));
      EXPECT_EQ(m.lengths, (std::vector<int32_t>{20, 0}));
    }
  }
  // A full sequence in one append, and one token into the last slot.
  const qattn_kv_cache c = make_cache();
  qattn_kv_append_params p = append_params(c, 1, kCapacity);
  Mirrors m(c, 1, {0});
  m.attach(p.seqs);
  EXPECT_REACHES_THE_DEVICE(append(p));
  p = append_params(c, 1, 1);
  m.lengths[0] = kCapacity - 1;
  m.attach(p.seqs);
  EXPECT_REACHES_THE_DEVICE(append(p));
}

TEST(KvAppendAbi, ScalarsAreNamed) {
  const qattn_kv_cache c = make_cache();
  for (int bad : {0, -1, 65536}) {
    qattn_kv_append_params p = append_params(c);
    p.batch = bad;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "batch = " + std::to_string(bad),
                   "1..65535");
  }
  // n_new: at least one token, at most the capacity (128 here).
  for (int bad : {0, -3, kCapacity + 1}) {
    qattn_kv_append_params p = append_params(c, 2, 1);
    p.n_new = bad;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "n_new = " + std::to_string(bad),
                   "1..128", "capacity");
  }
  for (int bad : {2, -1, 255}) {
    qattn_kv_append_params p = append_params(c);
    p.dtype = bad;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "dtype = " + std::to_string(bad),
                   "QATTN_DTYPE_FP16 (0)", "QATTN_DTYPE_BF16 (1)");
    p = append_params(c);
    p.k_mean_preset = bad;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "k_mean_preset = " + std::to_string(bad), "0 or 1");
  }
  // A preset vector means nothing when the cache keeps c = 0.
  const qattn_kv_cache none = make_cache({.k_smoothing = QATTN_KV_SMOOTH_NONE});
  qattn_kv_append_params p = append_params(none);
  p.k_mean_preset = 1;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "k_mean_preset = 1",
                 "QATTN_KV_SMOOTH_NONE");
}

TEST(KvAppendAbi, StructSize) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_append_params p = append_params(c);
  p.struct_size = 0;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "params->struct_size = 0",
                 "qattn_kv_append_params_init");
  p.struct_size = QATTN_KV_APPEND_PARAMS_MIN_SIZE - 1;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "params->struct_size");
  struct Newer {
    qattn_kv_append_params base;
    int64_t field_from_the_future;
  } newer{};
  newer.base = append_params(c);
  newer.base.struct_size = sizeof(Newer);
  EXPECT_REJECTS(outcome(qattn_kv_append(&newer.base, nullptr)), QATTN_ERROR_UNSUPPORTED,
                 "params->struct_size", "qattn_kv_append_params", "newer qattn.h");
}

TEST(KvAppendAbi, TensorsAreNamed) {
  const qattn_kv_cache c = make_cache();
  for (auto [member, name] : {std::pair{&qattn_kv_append_params::k, std::string("k")},
                              std::pair{&qattn_kv_append_params::v, std::string("v")}}) {
    SCOPED_TRACE(name);
    qattn_kv_append_params p = append_params(c);
    (p.*member).data = nullptr;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, name + ".data is NULL");
    for (std::uintptr_t off : {2u, 8u}) {  // 16-bit elements, but not 16-byte aligned
      p = append_params(c);
      (p.*member).data = static_cast<char*>((p.*member).data) + off;
      EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, name + ".data", "16-byte aligned");
    }
    // Strides: positive multiples of 8 elements (16 bytes).
    for (int64_t bad : {0, -128, 4, 36}) {
      for (auto [stride, sname] : {std::pair{&qattn_tensor::stride_b, "stride_b"},
                                   std::pair{&qattn_tensor::stride_h, "stride_h"},
                                   std::pair{&qattn_tensor::stride_n, "stride_n"}}) {
        p = append_params(c);
        (p.*member).*stride = bad;
        EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT,
                       name + "." + sname + " = " + std::to_string(bad), "multiple of 8");
      }
    }
  }
  // NHD (tokens outer, heads inner) is a valid view of the same shape.
  qattn_kv_append_params p = append_params(c);
  p.k = qattn::make_tensor(fake(5), qattn::Layout::kNHD, c.heads_kv, p.n_new, c.head_dim);
  p.v = qattn::make_tensor(fake(6), qattn::Layout::kNHD, c.heads_kv, p.n_new, c.head_dim);
  EXPECT_REACHES_THE_DEVICE(append(p));
}

TEST(KvAppendAbi, DeviceArraysAreNamed) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_cache moved = c;
  moved.pages = nullptr;
  EXPECT_REJECTS(append(append_params(moved)), QATTN_ERROR_INVALID_ARGUMENT,
                 "cache->pages is NULL");
  moved.pages = fake(1, 8);  // rows are read and written 16 bytes at a time
  EXPECT_REJECTS(append(append_params(moved)), QATTN_ERROR_INVALID_ARGUMENT, "cache->pages",
                 "16-byte aligned");

  qattn_kv_append_params p = append_params(c);
  p.seqs.block_tables = nullptr;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.block_tables is NULL");
  p = append_params(c);
  p.seqs.lengths = nullptr;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.lengths is NULL");
  p = append_params(c);
  p.seqs.lengths = static_cast<int32_t*>(fake(3, 2));  // an int32 array
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.lengths", "4-byte aligned");
  p = append_params(c);
  p.seqs.block_tables = static_cast<int32_t*>(fake(2, 1));
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.block_tables", "4-byte aligned");
  // Smoothing needs the vectors; without it they must be absent (c = 0 is implied).
  p = append_params(c);
  p.seqs.k_mean = nullptr;
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean is NULL");
  const qattn_kv_cache none = make_cache({.k_smoothing = QATTN_KV_SMOOTH_NONE});
  p = append_params(none);
  p.seqs.k_mean = static_cast<float*>(fake(4));
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean is set",
                 "QATTN_KV_SMOOTH_NONE");
}

// What an append writes (the pool, the lengths, the smoothing vectors) stands apart
// from what it reads (k, v, the block tables) and from each other.
TEST(KvAppendAbi, OutputsOverlapNothing) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_append_params p = append_params(c);
  p.k.data = fake(1, 4096);  // inside the 64-page pool (4608 bytes a page)
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "cache->pages overlaps k",
                 "a buffer of its own");
  p = append_params(c);
  p.v.data = fake(1, 64 * 4608 - 16);  // its first row ends past the pool's last byte
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "cache->pages overlaps v");
  p = append_params(c);
  p.v.data = fake(1, 64 * 4608);  // right after the pool: fine
  EXPECT_REACHES_THE_DEVICE(append(p));
  p = append_params(c);
  p.seqs.block_tables = p.seqs.lengths + 1;  // the tables start inside the lengths
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT,
                 "seqs.lengths overlaps seqs.block_tables");
  p = append_params(c);
  p.seqs.k_mean = static_cast<float*>(fake(5));  // c over k
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean overlaps k");
  p = append_params(c);
  p.seqs.lengths = static_cast<int32_t*>(fake(1, 256));  // the lengths inside the pool
  EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.lengths overlaps cache->pages");
  // Inputs may share memory: they are only read.
  p = append_params(c);
  p.v = p.k;
  EXPECT_REACHES_THE_DEVICE(append(p));
}

// With the lengths known, exactly the block-table entries the new tokens land in are
// checked: [length / page_size, ceil((length + n_new) / page_size)).
TEST(KvAppendAbi, HostMirrorsAreCheckedWhereTheAppendWrites) {
  const qattn_kv_cache c = make_cache();  // 64 pages of 16 tokens, 8 per sequence
  // Sequence 0 has 20 tokens: 3 more land in slots 4..6 of its entry 1. Sequence 1 is
  // empty: its 3 land in entry 0.
  {
    qattn_kv_append_params p = append_params(c);
    Mirrors m(c, 2, {20, 0});
    m.entry(c, 0, 0) = 999;  // holds old tokens only: the append does not touch it
    m.entry(c, 0, 2) = -7;   // past the new tokens
    m.entry(c, 1, 7) = 64;
    m.attach(p.seqs);
    EXPECT_REACHES_THE_DEVICE(append(p));
    m.entry(c, 0, 1) = 64;  // one past the last page, and used
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[0][1] = 64",
                   "0..63", "the call uses this entry");
    m.entry(c, 0, 1) = -1;  // unset, but the new tokens need it
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[0][1] = -1");
    m.entry(c, 0, 1) = 5;
    m.entry(c, 1, 0) = -1;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[1][0] = -1");
  }
  // Crossing a page boundary: 15 tokens + 2 new use entries 0 and 1; 16 + 16 use entry 1
  // only (entry 2 starts at token 32).
  {
    qattn_kv_append_params p = append_params(c, 1, 2);
    Mirrors m(c, 1, {15});
    m.entry(c, 0, 1) = 64;
    m.attach(p.seqs);
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[0][1] = 64");
    p = append_params(c, 1, 16);
    m.lengths[0] = 16;
    m.entry(c, 0, 0) = 64;
    m.entry(c, 0, 1) = 3;
    m.entry(c, 0, 2) = 64;
    m.attach(p.seqs);
    EXPECT_REACHES_THE_DEVICE(append(p));
  }
  // The lengths: non-negative, and the new tokens fit in the capacity.
  {
    qattn_kv_append_params p = append_params(c);
    Mirrors m(c, 2, {0, kCapacity - 2});
    m.attach(p.seqs);
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[1] = 126",
                   "plus n_new = 3", "capacity 128", "allowed: 0..125");
    m.lengths[0] = -1;  // checked before sequence 1's overflow
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[0] = -1", "negative",
                   "allowed: 0..125");
    m.lengths[0] = kCapacity - 3;  // exactly fills sequence 0
    m.lengths[1] = 0;
    EXPECT_REACHES_THE_DEVICE(append(p));
    // The lengths alone, without the tables, are checked too.
    p.seqs.host_block_tables = nullptr;
    m.lengths[0] = kCapacity;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[0] = 128");
  }
  // Without the lengths every entry is checked: a page or -1 (unset; the kernel's own
  // check then covers an unset entry the tokens need).
  {
    qattn_kv_append_params p = append_params(c);
    Mirrors m(c, 2, {});
    std::fill(m.tables.begin(), m.tables.end(), -1);
    m.entry(c, 0, 0) = 63;
    p.seqs.host_block_tables = m.tables.data();
    EXPECT_REACHES_THE_DEVICE(append(p));
    m.entry(c, 1, 7) = -2;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[1][7] = -2",
                   "or -1 (unset)");
    m.entry(c, 1, 7) = 64;
    EXPECT_REJECTS(append(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[1][7] = 64");
  }
}

// ---- decode ---------------------------------------------------------------------------

TEST(KvDecodeAbi, InitGivesDefaults) {
  qattn_kv_decode_params p;
  std::memset(&p, 0x5A, sizeof(p));
  qattn_kv_decode_params_init(&p);
  EXPECT_EQ(p.struct_size, sizeof(qattn_kv_decode_params));
  EXPECT_EQ(p.cache, nullptr);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.dtype, QATTN_DTYPE_BF16);
  EXPECT_EQ(p.nq, 1);
  EXPECT_EQ(p.causal, 1);
  EXPECT_EQ(p.sm_scale, 0.f);
  EXPECT_EQ(p.max_length, 0);
  EXPECT_EQ(p.num_splits, 0);
  qattn_kv_decode_params_init(nullptr);  // no crash
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "cache is NULL");
  std::size_t bytes = 0;
  EXPECT_REJECTS(outcome(qattn_kv_decode_workspace_size(nullptr, &bytes)),
                 QATTN_ERROR_INVALID_ARGUMENT, "params is NULL");
  const qattn_kv_cache c = make_cache();
  const qattn_kv_decode_params good = decode_params(c);
  EXPECT_REJECTS(outcome(qattn_kv_decode_workspace_size(&good, nullptr)),
                 QATTN_ERROR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT_REJECTS(outcome(qattn_kv_decode(nullptr, fake(10), 1 << 20, nullptr)),
                 QATTN_ERROR_INVALID_ARGUMENT, "qattn_kv_decode: params is NULL");
}

TEST(KvDecodeAbi, ValidCallsReachTheDevice) {
  for (int format = 0; format < 4; ++format) {
    for (int smoothing : {QATTN_KV_SMOOTH_PREFILL_MEAN, QATTN_KV_SMOOTH_NONE}) {
      for (int causal : {0, 1}) {
        SCOPED_TRACE("format " + std::to_string(format) + ", smoothing " +
                     std::to_string(smoothing) + ", causal " + std::to_string(causal));
        const qattn_kv_cache c = make_cache({.format = format, .k_smoothing = smoothing});
        qattn_kv_decode_params p = decode_params(c);
        p.causal = causal;
        p.dtype = causal != 0 ? QATTN_DTYPE_FP16 : QATTN_DTYPE_BF16;
        // 2 sequences x 2 KV heads and a capacity of 128: one chunk, no workspace.
        ASSERT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
        EXPECT_EQ(need(p), 0u);
        EXPECT_REACHES_THE_DEVICE(decode(p, nullptr, 0));
        p.lse = nullptr;  // optional
        EXPECT_REACHES_THE_DEVICE(decode(p, nullptr, 0));
        p.num_splits = 4;
        const std::size_t n = need(p);
        EXPECT_GT(n, 0u);
        EXPECT_REACHES_THE_DEVICE(decode(p, fake(10), n));
      }
    }
  }
  // Every query-token count up to 16, MQA and MHA, head dims 16..256.
  for (int nq : {1, 7, 16}) {
    for (auto [heads_kv, heads_q] : {std::pair{1, 32}, std::pair{4, 4}}) {
      for (int d : {16, 64, 256}) {
        const qattn_kv_cache c = make_cache({.heads_kv = heads_kv, .head_dim = d});
        const qattn_kv_decode_params p = decode_params(c, 3, heads_q, nq);
        EXPECT_EQ(size_of(p).status, QATTN_OK) << nq << " " << d << ": " << size_of(p).message;
      }
    }
  }
}

TEST(KvDecodeAbi, StructSize) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_decode_params p = decode_params(c);
  p.struct_size = 0;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "params->struct_size = 0",
                 "qattn_kv_decode_params_init");
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT,
                 "qattn_kv_decode:", "struct_size");
  struct Newer {
    qattn_kv_decode_params base;
    int64_t field_from_the_future;
  } newer{};
  newer.base = decode_params(c);
  newer.base.struct_size = sizeof(Newer);
  EXPECT_REJECTS(size_of(newer.base), QATTN_ERROR_UNSUPPORTED, "qattn_kv_decode_params",
                 "newer qattn.h");
  EXPECT_REJECTS(decode(newer.base, nullptr, 0), QATTN_ERROR_UNSUPPORTED, "newer qattn.h");
}

TEST(KvDecodeAbi, ScalarsAreNamed) {
  const qattn_kv_cache c = make_cache();  // heads_kv 2
  for (int bad : {0, -1, QATTN_KV_MAX_QUERY_TOKENS + 1}) {
    qattn_kv_decode_params p = decode_params(c);
    p.nq = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "nq = " + std::to_string(bad),
                   "1..16");
  }
  for (int bad : {0, -2, 65536}) {
    qattn_kv_decode_params p = decode_params(c);
    p.batch = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "batch = " + std::to_string(bad));
    p = decode_params(c);
    p.heads_q = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "heads_q = " + std::to_string(bad));
  }
  {
    const qattn_kv_cache c8 = make_cache({.heads_kv = 8});
    qattn_kv_decode_params p = decode_params(c8, 2, 12);
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "heads_q = 12", "cache->heads_kv = 8",
                   "GQA");
  }
  for (int bad : {2, -1}) {
    qattn_kv_decode_params p = decode_params(c);
    p.causal = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "causal = " + std::to_string(bad),
                   "0 or 1");
    p = decode_params(c);
    p.dtype = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "dtype = " + std::to_string(bad),
                   "QATTN_DTYPE_BF16 (1)");
  }
  // sm_scale: 0 (the default) or a positive finite number up to QATTN_MAX_SM_SCALE,
  // beyond which the FP32 scores could overflow.
  for (float bad : {-1.f, -std::numeric_limits<float>::denorm_min(), std::nanf(""),
                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    1e37f, std::nextafter(QATTN_MAX_SM_SCALE, 1e38f)}) {
    qattn_kv_decode_params p = decode_params(c);
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale = ", "QATTN_MAX_SM_SCALE");
  }
  for (float ok : {0.f, -0.f, 0.125f, 1e-30f, QATTN_MAX_SM_SCALE}) {
    qattn_kv_decode_params p = decode_params(c);
    p.sm_scale = ok;
    EXPECT_EQ(size_of(p).status, QATTN_OK) << ok << ": " << size_of(p).message;
  }
  // The default scale is 1/sqrt(head_dim) of the cache.
  qattn_kv_decode_params p = decode_params(c);
  EXPECT_FLOAT_EQ(qattn::api::resolve_defaults(p, c).sm_scale, 1.f / std::sqrt(128.f));
  p.sm_scale = 0.3f;
  EXPECT_EQ(qattn::api::resolve_defaults(p, c).sm_scale, 0.3f);

  for (int bad : {-1, QATTN_KV_MAX_SPLITS + 1, std::numeric_limits<int>::min()}) {
    p = decode_params(c);
    p.num_splits = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "num_splits = " + std::to_string(bad),
                   "0..128");
  }
  for (int bad : {-1, std::numeric_limits<int>::min()}) {
    p = decode_params(c);
    p.max_length = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "max_length = " + std::to_string(bad),
                   "upper bound");
  }
}

TEST(KvDecodeAbi, TensorsAreNamed) {
  const qattn_kv_cache c = make_cache();
  for (auto [member, name] : {std::pair{&qattn_kv_decode_params::q, std::string("q")},
                              std::pair{&qattn_kv_decode_params::o, std::string("o")}}) {
    SCOPED_TRACE(name);
    qattn_kv_decode_params p = decode_params(c);
    (p.*member).data = nullptr;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name + ".data is NULL");
    p = decode_params(c);
    (p.*member).data = static_cast<char*>((p.*member).data) + 8;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name + ".data", "16-byte aligned");
    for (int64_t bad : {0, -128, 4, 36}) {
      p = decode_params(c);
      (p.*member).stride_n = bad;
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                     name + ".stride_n = " + std::to_string(bad), "multiple of 8");
    }
  }
  // o is written: two of its rows may not share memory (heads one row apart, but each
  // head holds nq = 2 rows).
  qattn_kv_decode_params p = decode_params(c);
  p.o.stride_h = p.o.stride_n;
  EXPECT_NE(size_of(p).status, QATTN_OK);
  EXPECT_TRUE(contains(size_of(p).message, "o")) << size_of(p).message;
  // q only read: the same strides are a valid (if odd) view.
  p = decode_params(c);
  p.q.stride_h = p.q.stride_n;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;

  // lse: optional, FP32-aligned.
  p = decode_params(c);
  p.lse = reinterpret_cast<float*>(static_cast<char*>(fake(9)) + 2);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse = ", "4-byte aligned");
  p.lse = reinterpret_cast<float*>(static_cast<char*>(fake(9)) + 4);  // aligned to its type
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

TEST(KvDecodeAbi, OutputsOverlapNothing) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_decode_params p = decode_params(c);
  p.o.data = p.q.data;  // in place is not supported: o is written while q is read
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps q", "a buffer of its own");
  p = decode_params(c);
  p.o.data = fake(1, 1024);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps cache->pages");
  p = decode_params(c);
  p.lse = static_cast<float*>(fake(8, 64));
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps o");
  p = decode_params(c);
  p.lse = reinterpret_cast<float*>(p.seqs.lengths);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps seqs.lengths");
  p = decode_params(c);
  p.o.data = p.seqs.k_mean;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps seqs.k_mean");
  p = decode_params(c);
  p.o.data = p.seqs.block_tables;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps seqs.block_tables");
  // The decode only reads the sequences: they may share memory.
  p = decode_params(c);
  p.seqs.lengths = p.seqs.block_tables;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

// The workspace holds the split partials: none with one chunk, decode_workspace's
// layout with more.
TEST(KvDecodeAbi, WorkspaceSizeIsTheSplitLayout) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_decode_params p = decode_params(c);
  p.num_splits = 1;
  EXPECT_EQ(need(p), 0u);
  for (int s : {2, 3, 17, QATTN_KV_MAX_SPLITS}) {
    p.num_splits = s;
    EXPECT_EQ(need(p), qattn::kv_cache::decode_workspace(2, 8, 2, 128, s).total) << s;
    EXPECT_EQ(need(p) % 256, 0u);  // sized for a 256-byte aligned workspace
  }
  // Fresh random shapes: the size is the layout's, for the split count the call resolves.
  const std::uint32_t seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 500; ++i) {
    Config cfg;
    cfg.format = pick(0, 3);
    cfg.heads_kv = pick(1, 8);
    cfg.head_dim = 16 * pick(1, 16);
    cfg.page_size = pick(1, 64);
    cfg.max_pages_per_seq = pick(1, 512);
    const qattn_kv_cache ci = make_cache(cfg);
    qattn_kv_decode_params q =
        decode_params(ci, pick(1, 16), cfg.heads_kv * pick(1, 8), pick(1, 16));
    q.num_splits = pick(0, 2) == 0 ? 0 : pick(1, QATTN_KV_MAX_SPLITS);
    q.max_length = pick(0, 1) == 0 ? 0 : pick(1, 1 << 16);
    SCOPED_TRACE("iteration " + std::to_string(i));
    ASSERT_EQ(size_of(q).status, QATTN_OK) << size_of(q).message;
    const int32_t s = splits_of(q);
    if (q.num_splits > 0) {
      EXPECT_EQ(s, q.num_splits);  // an explicit count is kept
    } else {
      // A chosen count: within 1..128; more than one chunk only when each chunk keeps
      // 128 keys, and then at most one wave of at most 528 slots where the pairs fit one
      // (more than two CTAs an SM only with chunks of 4096 keys), else at most 4 waves.
      const int64_t capacity = int64_t{cfg.max_pages_per_seq} * cfg.page_size;
      const int64_t keys = q.max_length > 0 ? std::min<int64_t>(q.max_length, capacity) : capacity;
      const int64_t ctas = int64_t{q.batch} * cfg.heads_kv;
      EXPECT_GE(s, 1);
      EXPECT_LE(s, QATTN_KV_MAX_SPLITS);
      if (s > 1) {
        EXPECT_LE(s * int64_t{128}, keys);
        if (s * ctas > 264 && ctas <= 396) {
          EXPECT_LE(s * ctas, 528);
          EXPECT_LE(s * int64_t{4096}, keys);
        }
        EXPECT_LE(s * ctas, 4 * 528);
      }
    }
    EXPECT_EQ(need(q),
              qattn::kv_cache::decode_workspace(q.batch, q.heads_q, q.nq, cfg.head_dim, s).total);
  }
}

// num_splits = 0: slots = 132 SMs × CTAs per SM (kv_cache::decode_ctas_per_sm: at head
// dim 128 NVFP4, FP8 and INT8 with ≤ 8 query rows per KV head 4, NVFP4 with 16 rows 4,
// FP8 and INT8 with 16 rows 3, BF16 3). S ranges over 1 ≤ S ≤ min(keys / 128, cap,
// QATTN_KV_MAX_SPLITS); when the pairs (batch·heads_kv) fit one wave cap = max(264 /
// pairs (two CTAs an SM), min(slots / pairs, keys / 4096) (a full wave of long chunks)),
// else 4 waves' worth; with w = pairs·S / slots, S maximizes w/⌈w⌉ − 0.02·⌈w⌉ (the
// smallest S on a tie). The keys are max_length when set (capped by the capacity), else
// the capacity.
TEST(KvDecodeAbi, AutomaticSplitCountFollowsTheFamilysRule) {
  struct Case {
    int batch, heads_kv, max_pages_per_seq, max_length, splits;
    const char* why;
    int32_t format = QATTN_KV_NVFP4;
    int heads_q = 0, nq = 1;  // heads_q 0: heads_kv
  };
  // At head dim 128, NVFP4, FP8 and INT8 with up to 8 query rows: four CTAs per SM, 528
  // slots; BF16 three (396); with 16 rows NVFP4 four (528), FP8 and INT8 three (396).
  const std::array<Case, 23> cases{{
      {1, 1, 4096, 0, 128, "one pair, 65536 / 128 = 512 chunks, cap 264: capped at 128"},
      {1, 8, 256, 0, 32, "8 pairs, 4096 / 128 = 32 chunks: the length decides (cap 33)"},
      {4, 8, 2048, 0, 8, "32 pairs in one wave: two CTAs an SM, 264 / 32 = 8 chunks"},
      {32, 8, 2048, 0, 2, "256 pairs, 32768 keys: chunks of 16384 may fill the wave, 2 fill 0.97"},
      {33, 8, 2048, 0, 2, "264 pairs: 2 chunks are exactly one wave"},
      {64, 8, 2048, 0, 1, "512 pairs: 1 chunk fills 0.97 of a wave"},
      {128, 8, 2048, 0, 1, "1024 pairs: 1.94 waves already"},
      {1, 1, 8, 0, 1, "128 keys: one 128-key chunk"},
      {1, 1, 4096, 1000, 7, "max_length 1000: 7 chunks of at least 128"},
      {1, 1, 4096, 127, 1, "max_length 127: one chunk"},
      {1, 1, 4096, 512, 4, "max_length 512: four chunks of 128"},
      {1, 8, 256, 1000000, 32, "max_length beyond the capacity: the capacity (4096) decides"},
      {2, 2, 4096, 40000, 66, "4 pairs: 264 / 4 = 66 chunks of 606 keys"},
      {8, 8, 512, 0, 4, "64 pairs, 8192 keys: two CTAs an SM, 4 chunks of 2048"},
      {8, 8, 4096, 0, 8, "64 pairs, 65536 keys: 8 long chunks fill 0.97 of the wave"},
      {4, 8, 2048, 0, 8, "FP8: 32 pairs, 8 chunks, two CTAs an SM", QATTN_KV_FP8_E4M3},
      {8, 8, 4096, 0, 8, "INT8: 64 pairs, 8 long chunks", QATTN_KV_INT8},
      {1, 1, 4096, 0, 128, "BF16: one pair, capped at 128", QATTN_KV_BF16},
      {16, 8, 4096, 0, 3, "BF16: 128 pairs, 3 long chunks fill 0.97 of 396 slots", QATTN_KV_BF16},
      {8, 8, 4096, 0, 8, "NVFP4 with 16 query rows: 64 pairs, 8 long chunks", QATTN_KV_NVFP4, 32, 4},
      {8, 8, 512, 0, 4, "FP8 with 16 query rows: 64 pairs, 8192 keys: 4 chunks", QATTN_KV_FP8_E4M3, 32, 4},
      {64, 8, 512, 0, 3, "FP8 with 16 query rows: 512 pairs, more than 396 slots: 3 chunks fill "
                         "0.97 of 4 waves", QATTN_KV_FP8_E4M3, 32, 4},
      {64, 8, 512, 0, 1, "NVFP4 with 16 query rows: 512 pairs fit 528 slots: one chunk",
       QATTN_KV_NVFP4, 32, 4},
  }};
  const KvCacheFamily& family = *qattn::api::kv_cache_families()[0];
  for (const Case& k : cases) {
    SCOPED_TRACE(k.why);
    const qattn_kv_cache c =
        make_cache({.format = k.format, .heads_kv = k.heads_kv,
                    .max_pages_per_seq = k.max_pages_per_seq});
    const int heads_q = k.heads_q > 0 ? k.heads_q : k.heads_kv;
    qattn_kv_decode_params p = decode_params(c, k.batch, heads_q, k.nq);
    p.max_length = k.max_length;
    EXPECT_EQ(splits_of(p), k.splits);
    EXPECT_EQ(family.choose_splits(p, c), k.splits);
    // The workspace query and the decode size the same split count.
    EXPECT_EQ(need(p),
              qattn::kv_cache::decode_workspace(k.batch, heads_q, k.nq, 128, k.splits).total);
    if (k.splits > 1) {
      EXPECT_REJECTS(decode(p, fake(10), need(p) - 1), QATTN_ERROR_WORKSPACE_TOO_SMALL,
                     std::to_string(need(p)));
      EXPECT_REACHES_THE_DEVICE(decode(p, fake(10), need(p)));
    }
  }
  // The query heads and tokens enter only through the CTAs per SM: 128 rows per KV head
  // still leave the length (4096 / 128 = 32) to decide.
  const qattn_kv_cache c = make_cache({.heads_kv = 8, .max_pages_per_seq = 256});
  EXPECT_EQ(splits_of(decode_params(c, 1, 64, 16)), 32);
}

TEST(KvDecodeAbi, WorkspaceIsCheckedOnlyWhenSplit) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_decode_params p = decode_params(c);
  // One chunk: no workspace is read or written, so none is needed, whatever is passed.
  p.num_splits = 1;
  EXPECT_REACHES_THE_DEVICE(decode(p, nullptr, 0));
  EXPECT_REACHES_THE_DEVICE(decode(p, fake(10, 8), 3));
  EXPECT_REACHES_THE_DEVICE(decode(p, p.o.data, 1 << 20));  // not even over o
  p.num_splits = 8;
  const std::size_t n = need(p);
  ASSERT_GT(n, 0u);
  EXPECT_REJECTS(decode(p, nullptr, n), QATTN_ERROR_INVALID_ARGUMENT, "workspace is NULL",
                 std::to_string(n), "qattn_kv_decode_workspace_size");
  EXPECT_REJECTS(decode(p, fake(10, 128), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace",
                 "256-byte aligned");
  EXPECT_REJECTS(decode(p, fake(10), n - 1), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes",
                 std::to_string(n));
  EXPECT_REJECTS(decode(p, fake(10), 0), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes");
  EXPECT_REACHES_THE_DEVICE(decode(p, fake(10), n + 1000));  // more is fine
  // The partials are written: the workspace overlaps no buffer of the call (it ends
  // 256 bytes into the buffer).
  auto ending_in = [&](const void* buffer) {
    const auto at = reinterpret_cast<std::uintptr_t>(buffer);
    return reinterpret_cast<void*>((at - n + 256) / 256 * 256);
  };
  for (auto [buffer, name] :
       {std::pair{static_cast<const void*>(p.q.data), "q"},
        std::pair{static_cast<const void*>(p.o.data), "o"},
        std::pair{static_cast<const void*>(p.lse), "lse"},
        std::pair{static_cast<const void*>(c.pages), "cache->pages"},
        std::pair{static_cast<const void*>(p.seqs.block_tables), "seqs.block_tables"},
        std::pair{static_cast<const void*>(p.seqs.lengths), "seqs.lengths"},
        std::pair{static_cast<const void*>(p.seqs.k_mean), "seqs.k_mean"}}) {
    SCOPED_TRACE(name);
    EXPECT_REJECTS(decode(p, ending_in(buffer), n), QATTN_ERROR_INVALID_ARGUMENT,
                   std::string("workspace overlaps ") + name, "a buffer of its own");
  }
  // Parameter errors come before workspace errors.
  p.causal = 3;
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT, "causal = 3");
}

// A decode reads entries [0, ceil(length / page_size)) of each row: those are checked
// when the lengths are known; without them every entry must be a page or -1.
TEST(KvDecodeAbi, HostMirrorsAreCheckedWhereTheDecodeReads) {
  const qattn_kv_cache c = make_cache();
  qattn_kv_decode_params p = decode_params(c);
  Mirrors m(c, 2, {17, 0});  // sequence 0 reads entries 0 and 1; sequence 1 none
  m.entry(c, 0, 2) = 64;
  m.entry(c, 1, 0) = -1;
  m.attach(p.seqs);
  EXPECT_REACHES_THE_DEVICE(decode(p, nullptr, 0));
  m.entry(c, 0, 1) = 64;
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT,
                 "qattn_kv_decode: seqs.host_block_tables[0][1] = 64", "0..63",
                 "the call uses this entry");
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_block_tables[0][1]");
  m.entry(c, 0, 1) = 1;
  m.entry(c, 0, 0) = -1;  // the old tokens an append would skip are read here
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT,
                 "seqs.host_block_tables[0][0] = -1");
  m.entry(c, 0, 0) = 0;
  m.lengths[0] = kCapacity;  // a full sequence, and one past it
  m.lengths[1] = kCapacity + 1;
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[1] = 129",
                 "capacity 128", "allowed: 0..128");
  m.lengths[0] = 0;
  m.lengths[1] = -5;
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT, "seqs.host_lengths[1] = -5",
                 "negative");
  // Without the lengths: -1 is unset and accepted, anything else outside the pool is not.
  p.seqs.host_lengths = nullptr;
  std::fill(m.tables.begin(), m.tables.end(), -1);
  EXPECT_REACHES_THE_DEVICE(decode(p, nullptr, 0));
  m.entry(c, 1, 3) = -100;
  EXPECT_REJECTS(decode(p, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT,
                 "seqs.host_block_tables[1][3] = -100", "or -1 (unset)");
  // The device arrays as for the append.
  p = decode_params(c);
  p.seqs.k_mean = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean is NULL");
  p = decode_params(c);
  p.seqs.lengths = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.lengths is NULL");
  p = decode_params(c);
  p.seqs.block_tables = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.block_tables is NULL");
  qattn_kv_cache nopool = c;
  nopool.pages = nullptr;
  EXPECT_REJECTS(size_of(decode_params(nopool)), QATTN_ERROR_INVALID_ARGUMENT,
                 "cache->pages is NULL");
  const qattn_kv_cache none = make_cache({.k_smoothing = QATTN_KV_SMOOTH_NONE});
  p = decode_params(none);
  p.seqs.k_mean = static_cast<float*>(fake(4));
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqs.k_mean is set");
}

// ---- the registry ---------------------------------------------------------------------

KvCall decode_call(int32_t format = QATTN_KV_NVFP4, int32_t dtype = QATTN_DTYPE_BF16,
                   int32_t head_dim = 128, int32_t nq = 1, int32_t causal = 1) {
  return {format, dtype, head_dim, nq, causal, true};
}
KvCall append_call(int32_t format = QATTN_KV_NVFP4, int32_t dtype = QATTN_DTYPE_BF16,
                   int32_t head_dim = 128) {
  return {format, dtype, head_dim, 0, 0, false};
}

TEST(KvRegistry, HopperRunsEveryFormat) {
  const Arch hopper{9, 0};
  ASSERT_EQ(qattn::api::kv_cache_families().size(), 1u);
  for (int32_t format = 0; format < 4; ++format) {
    for (const KvCall& call : {decode_call(format), append_call(format),
                               decode_call(format, QATTN_DTYPE_FP16, 16, 16, 0)}) {
      qattn_status s = QATTN_ERROR_INTERNAL;
      const KvCacheFamily* f = qattn::api::select_family("t", call, &hopper, &s);
      ASSERT_NE(f, nullptr) << qattn_last_error_message();
      EXPECT_EQ(s, QATTN_OK);
      EXPECT_STREQ(f->name, "kv_cache_sm90");
      // The kernels exist exactly in a CUDA build.
      EXPECT_EQ(f->launch_append != nullptr, QATTN_HAVE_CUDA != 0);
      EXPECT_EQ(f->launch_decode != nullptr, QATTN_HAVE_CUDA != 0);
    }
  }
}

TEST(KvRegistry, NonHopperIsDeclinedNamingTheFamily) {
  for (Arch arch : {Arch{8, 0}, Arch{8, 9}, Arch{9, 1}, Arch{10, 0}, Arch{12, 0}}) {
    const std::string cc = std::to_string(arch.major) + "." + std::to_string(arch.minor);
    const std::string sm = std::to_string(arch.major) + std::to_string(arch.minor);
    SCOPED_TRACE(cc);
    qattn_status s = QATTN_OK;
    EXPECT_EQ(
        qattn::api::select_family("qattn_kv_decode", decode_call(QATTN_KV_FP8_E4M3), &arch, &s),
        nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    std::string m = qattn_last_error_message();
    for (const std::string& w :
         {"qattn_kv_decode: no kernel family runs this call (KV decode, QATTN_KV_FP8_E4M3, bf16, "
          "head_dim 128, causal; device sm_" +
              sm + ")",
          "considered 1; kv_cache_sm90: the device has compute capability " + cc +
              "; its kernels run on sm_90"})
      EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
    EXPECT_EQ(qattn::api::select_family("qattn_kv_append", append_call(), &arch, &s), nullptr);
    m = qattn_last_error_message();
    EXPECT_TRUE(contains(m,
                         "qattn_kv_append: no kernel family runs this call (KV append, "
                         "QATTN_KV_NVFP4, bf16, head_dim 128; device sm_" +
                             sm + ")"))
        << m;
    EXPECT_TRUE(contains(m, "kv_cache_sm90: the device has compute capability " + cc)) << m;
  }
}

// Families made up here: the real one runs every format, head dim and query count the
// validation lets through, so its own reasons cannot show. The functions stay NULL: the
// registry only reads the table.
constexpr std::array<Arch, 1> kSm90{{{9, 0}}};
constexpr std::array<Arch, 2> kSm80And100{{{8, 0}, {10, 0}}};
constexpr uint32_t kBothDtypes = (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16);
constexpr uint32_t kBothMasks = qattn::api::kMaskNone | qattn::api::kMaskCausal;
constexpr uint32_t kAllFormats = 0xFu;  // the four QATTN_KV_* bits

// Every format, head dim 16..256, both dtypes and masks, 16 query tokens, on sm_90; each
// family below differs from it in one field.
constexpr KvCacheFamily kBase{.name = "",
                              .archs = kSm90,
                              .min_head_dim = 16,
                              .max_head_dim = 256,
                              .dtypes = kBothDtypes,
                              .formats = kAllFormats,
                              .masks = kBothMasks,
                              .max_query_tokens = 16,
                              .choose_splits = nullptr,
                              .decode_workspace_bytes = nullptr,
                              .launch_append = nullptr,
                              .launch_decode = nullptr};

template <typename Edit>
constexpr KvCacheFamily variant(const char* name, Edit edit) {
  KvCacheFamily f = kBase;
  f.name = name;
  edit(f);
  return f;
}

constexpr KvCacheFamily kFp8Only =
    variant("fake_fp8", [](KvCacheFamily& f) { f.formats = 1u << QATTN_KV_FP8_E4M3; });
constexpr KvCacheFamily kFourTokens =
    variant("fake_nq4", [](KvCacheFamily& f) { f.max_query_tokens = 4; });
constexpr KvCacheFamily kSmallHeads = variant("fake_d64_128", [](KvCacheFamily& f) {
  f.min_head_dim = 64;
  f.max_head_dim = 128;
});
constexpr KvCacheFamily kCausalFp16 = variant("fake_causal_fp16", [](KvCacheFamily& f) {
  f.dtypes = 1u << QATTN_DTYPE_FP16;
  f.masks = qattn::api::kMaskCausal;
});
constexpr KvCacheFamily kOtherArchs =
    variant("fake_sm80_sm100", [](KvCacheFamily& f) { f.archs = kSm80And100; });

TEST(KvRegistry, EveryDeclineReasonIsNamed) {
  const std::array<const KvCacheFamily*, 5> families{&kFp8Only, &kFourTokens, &kSmallHeads,
                                                     &kCausalFp16, &kOtherArchs};
  const Arch sm90{9, 0};
  qattn_status s = QATTN_OK;
  // NVFP4, bf16, d = 256, 8 query tokens, unmasked: every family has a reason.
  EXPECT_EQ(qattn::api::select_family("f", decode_call(QATTN_KV_NVFP4, QATTN_DTYPE_BF16, 256, 8, 0),
                                      &sm90, &s, families),
            nullptr);
  EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
  std::string m = qattn_last_error_message();
  for (const char* w :
       {"f: no kernel family runs this call (KV decode, QATTN_KV_NVFP4, bf16, head_dim 256, "
        "no mask; device sm_90)",
        "considered 5", "fake_fp8: does not store format QATTN_KV_NVFP4",
        "fake_nq4: nq = 8 query tokens; its decode takes at most 4",
        "fake_d64_128: head_dim = 256 is not supported yet; allowed: 64..128",
        "fake_causal_fp16: does not read bf16 inputs",
        "fake_sm80_sm100: the device has compute capability 9.0; its kernels run on sm_80, sm_100"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
  EXPECT_EQ(qattn::api::decline_reason(
                kCausalFp16, decode_call(QATTN_KV_INT8, QATTN_DTYPE_FP16, 128, 1, 0), &sm90),
            "has no unmasked kernel");
  EXPECT_EQ(qattn::api::decline_reason(
                kFourTokens, decode_call(QATTN_KV_INT8, QATTN_DTYPE_BF16, 128, 4, 0), &sm90),
            "");  // exactly its limit

  // An append has no mask and no query tokens: a causal-only decode family, or one
  // with a small nq limit, still appends.
  EXPECT_EQ(
      qattn::api::decline_reason(kCausalFp16, append_call(QATTN_KV_BF16, QATTN_DTYPE_FP16), &sm90),
      "");
  EXPECT_EQ(qattn::api::decline_reason(kFourTokens, append_call(), &sm90), "");
  // The format and head dim bind the append as they bind the decode.
  EXPECT_EQ(qattn::api::decline_reason(kFp8Only, append_call(QATTN_KV_INT8), &sm90),
            "does not store format QATTN_KV_INT8");
  EXPECT_TRUE(contains(qattn::api::decline_reason(
                           kSmallHeads, append_call(QATTN_KV_INT8, QATTN_DTYPE_BF16, 32), &sm90),
                       "head_dim = 32"));

  // The first family that accepts wins; no device (nullptr) skips the architecture.
  EXPECT_EQ(qattn::api::select_family("f", decode_call(QATTN_KV_FP8_E4M3), &sm90, &s, families),
            &kFp8Only);
  EXPECT_EQ(s, QATTN_OK);
  EXPECT_EQ(qattn::api::select_family("f", decode_call(QATTN_KV_INT8, QATTN_DTYPE_BF16, 128, 3),
                                      &sm90, &s, families),
            &kFourTokens);
  EXPECT_EQ(qattn::api::select_family("f", decode_call(QATTN_KV_INT8, QATTN_DTYPE_BF16, 256, 8),
                                      nullptr, &s, families),
            &kOtherArchs);
  const Arch sm100{10, 0};
  EXPECT_EQ(qattn::api::select_family("f", decode_call(QATTN_KV_INT8, QATTN_DTYPE_BF16, 256, 8),
                                      &sm100, &s, families),
            &kOtherArchs);
  EXPECT_EQ(qattn::api::select_family("f", append_call(), &sm90, &s, {}), nullptr);
  EXPECT_TRUE(contains(qattn_last_error_message(), "considered 0")) << qattn_last_error_message();
}

}  // namespace
