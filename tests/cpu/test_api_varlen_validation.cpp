// The C ABI's packed variable-length batch (qattn_fwd_params' cu_seqlens_q, cu_seqlens_k,
// max_seqlen_q, max_seqlen_k), without a GPU: the fields' rules with named errors, the
// refusal of kv_lengths and attn_mask with them, the sage2 family's varlen workspace,
// and, through a family declared here that takes varlen, the
// checks after the family's: the arrays' alignment and overlaps, the (1, H, total, d)
// views and the (Hq, total_q) LSE. Old struct layouts read as "not packed".
//
// Addresses are fake (qattn::test::fake): nothing is dereferenced.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "api/family.h"
#include "api/registry.h"
#include "api/validate.h"
#include "api_outcome.h"
#include "cuda/sage2_fwd/workspace.h"
#include "families/sage2_fwd.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"

namespace {

using qattn::api::ForwardFamily;
using qattn::test::fake;
using qattn::test::Outcome;

constexpr int kBatch = 3, kHq = 8, kHkv = 2, kTotalQ = 300, kTotalK = 500, kD = 64;

// A pack of 3 sequences: (total, H, d) tensors (NHD of the builder: stride_n = H*d,
// stride_h = d; its stride_b is ignored in a pack), offsets at fake(7) and fake(8), the
// (Hq, total_q) LSE at fake(5).
qattn_fwd_params varlen_params() {
  qattn::ForwardParams fp(qattn::DType::kBF16, kBatch, kHq, kHkv, kTotalQ, kTotalK, kD);
  fp.q(fake(1), qattn::Layout::kNHD)
      .k(fake(2), qattn::Layout::kNHD)
      .v(fake(3), qattn::Layout::kNHD)
      .o(fake(4), qattn::Layout::kNHD)
      .lse(static_cast<float*>(fake(5)))
      .varlen(static_cast<const int32_t*>(fake(7)), static_cast<const int32_t*>(fake(8)), 200,
              300);
  return fp.raw();
}

Outcome size_of(const qattn_fwd_params& p) {
  std::size_t bytes = 0;
  const qattn_status s = qattn_fwd_workspace_size(&p, &bytes);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

// A family that runs packed batches (and everything sage2 runs), so the checks after the
// family's are reached; its workspace is 4 KiB.
std::size_t ws_4k(const qattn_fwd_params&) { return 4096; }
ForwardFamily varlen_family() {
  ForwardFamily f = qattn::families::sage2_fwd_sm90();
  f.name = "fake_varlen";
  f.masks |= qattn::api::kMaskVarlen;
  f.check_limits = nullptr;
  f.workspace_bytes = &ws_4k;
  f.launch = nullptr;
  return f;
}

Outcome validate_with_varlen_family(const qattn_fwd_params& p) {
  static const ForwardFamily family = varlen_family();
  const std::array<const ForwardFamily*, 1> families{&family};
  const qattn_status s = qattn::api::validate_forward("qattn_fwd", p, families);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

Outcome workspace_with_varlen_family(const qattn_fwd_params& p, const void* ws) {
  static const ForwardFamily family = varlen_family();
  const std::array<const ForwardFamily*, 1> families{&family};
  const qattn_status s = qattn::api::validate_workspace("qattn_fwd", p, ws, 4096, families);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

// ---- the fields' own rules (checked before any family is asked) --------------------

// The sage2 family runs a pack (its varlen kernel): the call validates, and its
// workspace is the layout's: K/V in Hkv slices of at most total_k + 128 rows per
// sequence, room for every query block, the plan's places and list.
TEST(ApiVarlen, Sage2RunsAPack) {
  const qattn_fwd_params p = varlen_params();
  std::size_t bytes = 0;
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  const auto w = qattn::sage2::workspace_layout(p);
  EXPECT_EQ(bytes, w.total);
  EXPECT_TRUE(w.varlen);
  EXPECT_EQ(w.kv_slices, kHkv);
  EXPECT_EQ(w.nkv_pad, (kTotalK + 128 * kBatch + 127) / 128 * 128);
  EXPECT_EQ(w.nq_pad, 256);  // max_seqlen_q = 200, padded
  EXPECT_EQ(w.max_entries, (kTotalQ + 127 * kBatch) / 128);
  EXPECT_GT(w.varlen_entries, w.varlen_seqs);
  EXPECT_GT(w.varlen_count, w.varlen_entries);
  EXPECT_LE(w.varlen_count + sizeof(int), w.total);
  const qattn::api::Arch hopper{9, 0};
  EXPECT_EQ(qattn::api::decline_reason(qattn::families::sage2_fwd_sm90(), p, &hopper), "");
  EXPECT_NE(qattn::families::sage2_fwd_sm90().masks & qattn::api::kMaskVarlen, 0u);
  // A dense call of the same shape has none of the pack's regions.
  qattn_fwd_params dense = p;
  dense.cu_seqlens_q = dense.cu_seqlens_k = nullptr;
  dense.max_seqlen_q = dense.max_seqlen_k = 0;
  const auto wd = qattn::sage2::workspace_layout(dense);
  EXPECT_FALSE(wd.varlen);
  EXPECT_EQ(wd.kv_slices, kBatch * kHkv);
}

// The K/V rows of a pack stay bounded by its totals whatever the sequence count (every
// sequence takes at least one tile), and the sizes grow with the totals, not with
// batch x the longest sequence.
TEST(ApiVarlen, Sage2WorkspaceScalesWithTheTotals) {
  qattn_fwd_params p = varlen_params();
  p.batch = 1000;
  p.seqlen_q = p.seqlen_kv = 8192;
  p.max_seqlen_q = p.max_seqlen_k = 8192;
  const auto w = qattn::sage2::workspace_layout(p);
  EXPECT_EQ(w.nkv_pad, 8192 + 128 * 1000);
  EXPECT_EQ(w.max_entries, (8192 + 127 * 1000) / 128);
  EXPECT_LT(w.total, std::size_t{64} << 20);  // B x max would be ~1 GB of K/V
}

TEST(ApiVarlen, BothArraysOrNeither) {
  qattn_fwd_params p = varlen_params();
  p.cu_seqlens_k = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                 "cu_seqlens_q is set but cu_seqlens_k is NULL", "both", "or neither");
  p = varlen_params();
  p.cu_seqlens_q = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                 "cu_seqlens_k is set but cu_seqlens_q is NULL");
}

TEST(ApiVarlen, MaxLengths) {
  for (auto [field, name, total] :
       {std::tuple{&qattn_fwd_params::max_seqlen_q, "max_seqlen_q", kTotalQ},
        std::tuple{&qattn_fwd_params::max_seqlen_k, "max_seqlen_k", kTotalK}}) {
    qattn_fwd_params p = varlen_params();
    for (int bad : {0, -1, total + 1}) {
      p.*field = bad;
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                     std::string(name) + " = " + std::to_string(bad),
                     "1.." + std::to_string(total), "at least the longest");
    }
    for (int ok : {1, total}) {  // the fields are bounds, not the longest length itself
      p.*field = ok;
      EXPECT_EQ(validate_with_varlen_family(p).status, QATTN_OK)
          << validate_with_varlen_family(p).message;
    }
    // Without the arrays the max lengths must stay 0: a value there is a mistake.
    qattn_fwd_params plain = varlen_params();
    plain.cu_seqlens_q = plain.cu_seqlens_k = nullptr;
    plain.max_seqlen_q = plain.max_seqlen_k = 0;
    plain.*field = 7;
    EXPECT_REJECTS(size_of(plain), QATTN_ERROR_INVALID_ARGUMENT,
                   std::string(name) + " = 7 without cu_seqlens", "allowed: 0");
  }
}

// kv_lengths would say twice what cu_seqlens_k says; attn_mask's (B, H, Nq, Nkv) indexing
// has no meaning in a pack. Both are refused by name, before any family is asked.
TEST(ApiVarlen, RefusedWithKvLengthsAndAttnMask) {
  qattn_fwd_params p = varlen_params();
  p.kv_lengths = static_cast<const int32_t*>(fake(9));
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "kv_lengths is set with cu_seqlens",
                 "kv_lengths NULL in a packed batch");
  EXPECT_REJECTS(validate_with_varlen_family(p), QATTN_ERROR_INVALID_ARGUMENT, "kv_lengths");
  p = varlen_params();
  p.attn_mask_type = QATTN_MASK_BOOL;
  p.attn_mask = fake(9);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "attn_mask_type = QATTN_MASK_BOOL with "
                 "cu_seqlens", "not combinable in this version");
}

// Each array: 4-byte aligned, batch + 1 int32 inside the address space. Reported by name
// whatever family would run the call (these are address checks, no family's limit).
TEST(ApiVarlen, ArrayAlignmentAndAddressSpace) {
  for (auto [field, name] :
       {std::pair{&qattn_fwd_params::cu_seqlens_q, "cu_seqlens_q"},
        std::pair{&qattn_fwd_params::cu_seqlens_k, "cu_seqlens_k"}}) {
    qattn_fwd_params p = varlen_params();
    for (std::uintptr_t off : {1u, 2u, 3u}) {
      p.*field = static_cast<const int32_t*>(fake(9, off));
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name, "4-byte aligned",
                     "(batch + 1,) int32 device array");
    }
    // 4 offsets (16 bytes) must end inside the address space.
    p.*field = reinterpret_cast<const int32_t*>(UINTPTR_MAX - 11);
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name, "past the end of the address space");
    p.*field = reinterpret_cast<const int32_t*>(UINTPTR_MAX - 19);  // ends 4 bytes before it
    EXPECT_EQ(validate_with_varlen_family(p).status, QATTN_OK)
        << validate_with_varlen_family(p).message;
  }
}

// ---- the checks after the family's (through a family that runs packs) -----------------

// The offsets are inputs: they may share memory with q, k, v (only read), never with o,
// the LSE or the workspace.
TEST(ApiVarlen, ArraysMustNotOverlapOutputs) {
  const qattn_fwd_params base = varlen_params();
  for (auto [field, name] :
       {std::pair{&qattn_fwd_params::cu_seqlens_q, std::string("cu_seqlens_q")},
        std::pair{&qattn_fwd_params::cu_seqlens_k, std::string("cu_seqlens_k")}}) {
    qattn_fwd_params p = base;
    p.*field = reinterpret_cast<const int32_t*>(static_cast<char*>(p.o.data) + 4096);
    EXPECT_REJECTS(validate_with_varlen_family(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "o overlaps " + name);
    // The LSE is (Hq, total_q) floats: its last float, then right past its end.
    p.*field = reinterpret_cast<const int32_t*>(p.lse + kHq * kTotalQ - 1);
    EXPECT_REJECTS(validate_with_varlen_family(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "lse overlaps " + name);
    p.*field = reinterpret_cast<const int32_t*>(p.lse + kHq * kTotalQ);
    EXPECT_EQ(validate_with_varlen_family(p).status, QATTN_OK)
        << validate_with_varlen_family(p).message;
    p.*field = static_cast<const int32_t*>(p.k.data);  // inside an input: fine
    EXPECT_EQ(validate_with_varlen_family(p).status, QATTN_OK)
        << validate_with_varlen_family(p).message;
    // The workspace (4 KiB of the family declared here).
    p.*field = static_cast<const int32_t*>(fake(6, 4096 - 4));
    EXPECT_REJECTS(workspace_with_varlen_family(p, fake(6)), QATTN_ERROR_INVALID_ARGUMENT,
                   "workspace overlaps " + name);
    p.*field = static_cast<const int32_t*>(fake(6, 4096));
    EXPECT_EQ(workspace_with_varlen_family(p, fake(6)).status, QATTN_OK)
        << workspace_with_varlen_family(p, fake(6)).message;
  }
}

// In a pack every tensor is a (1, H, total, d) view: stride_b is never read (even a bad
// one), and o and the LSE span total tokens, not batch x total.
TEST(ApiVarlen, TensorsArePackedViews) {
  qattn_fwd_params p = varlen_params();
  for (qattn_tensor* t : {&p.q, &p.k, &p.v, &p.o}) t->stride_b = -3;
  EXPECT_EQ(validate_with_varlen_family(p).status, QATTN_OK) << validate_with_varlen_family(p).message;
  const auto spans = qattn::api::buffer_spans(p, fake(6));
  const std::size_t row = std::size_t{2} * kD;  // bf16 bytes of one (token, head) row
  EXPECT_STREQ(spans[0].name, "q.data");
  EXPECT_EQ(spans[0].bytes, std::size_t{kTotalQ} * kHq * row);
  EXPECT_EQ(spans[1].bytes, std::size_t{kTotalK} * kHkv * row);
  EXPECT_STREQ(spans[5].name, "cu_seqlens_q");
  EXPECT_EQ(spans[5].data, p.cu_seqlens_q);
  EXPECT_EQ(spans[5].bytes, (kBatch + 1) * sizeof(int32_t));
  EXPECT_STREQ(spans[6].name, "cu_seqlens_k");
  EXPECT_EQ(spans[6].bytes, (kBatch + 1) * sizeof(int32_t));
  EXPECT_STREQ(spans[7].name, "o.data");
  EXPECT_STREQ(spans[8].name, "lse");
  EXPECT_EQ(spans[8].bytes, std::size_t{kHq} * kTotalQ * sizeof(float));
  // o still may not alias itself: heads interleaving tokens is caught as before.
  p.o.stride_n = kD / 2;
  EXPECT_REJECTS(validate_with_varlen_family(p), QATTN_ERROR_INVALID_ARGUMENT, "o.stride_n");
  // Without cu_seqlens the same spans count the batch: nothing changed for other calls.
  qattn_fwd_params plain = varlen_params();
  plain.cu_seqlens_q = plain.cu_seqlens_k = nullptr;
  plain.max_seqlen_q = plain.max_seqlen_k = 0;
  const auto unpacked = qattn::api::buffer_spans(plain, fake(6));
  EXPECT_EQ(unpacked[8].bytes, std::size_t{kBatch} * kHq * kTotalQ * sizeof(float));
  EXPECT_EQ(unpacked[5].data, nullptr);
  EXPECT_EQ(unpacked[5].bytes, 0u);
}

// A caller compiled against the layout before varlen (264 bytes on LP64) is never read
// past its struct: whatever follows in memory, the call is not packed.
TEST(ApiVarlen, OlderLayoutsAreNotPacked) {
  qattn_fwd_params old = varlen_params();
  old.cu_seqlens_q = old.cu_seqlens_k = nullptr;
  old.max_seqlen_q = old.max_seqlen_k = 0;
  std::size_t want = 0;
  ASSERT_EQ(qattn_fwd_workspace_size(&old, &want), QATTN_OK) << qattn_last_error_message();
  old.struct_size = offsetof(qattn_fwd_params, cu_seqlens_q);
  std::memset(reinterpret_cast<char*>(&old) + old.struct_size, 0xA5,
              sizeof(old) - old.struct_size);  // a misaligned pointer and bad lengths, if read
  qattn_fwd_params got;
  ASSERT_EQ(qattn::api::read_params("t", &old, &got), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(got.cu_seqlens_q, nullptr);
  EXPECT_EQ(got.cu_seqlens_k, nullptr);
  EXPECT_EQ(got.max_seqlen_q, 0);
  EXPECT_EQ(got.max_seqlen_k, 0);
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_fwd_workspace_size(&old, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(bytes, want);
  // A size inside the new fields is no layout.
  old.struct_size = offsetof(qattn_fwd_params, cu_seqlens_k);
  EXPECT_REJECTS(size_of(old), QATTN_ERROR_INVALID_ARGUMENT, "struct_size");
}

// In a pack, top-left alignment matters wherever causal is set (any sequence may have
// len_q != len_k), even when the totals are equal: a family without top-left declines.
TEST(ApiVarlen, TopLeftIsPerSequence) {
  ForwardFamily f = varlen_family();
  f.masks &= ~qattn::api::kMaskTopLeft;
  qattn_fwd_params p = varlen_params();
  p.seqlen_kv = p.seqlen_q;  // equal totals
  p.max_seqlen_k = 200;
  p.causal = 1;
  p.alignment = QATTN_ALIGN_TOP_LEFT;
  EXPECT_NE(qattn::api::decline_reason(f, p, nullptr).find("top-left"), std::string::npos)
      << qattn::api::decline_reason(f, p, nullptr);
  p.alignment = QATTN_ALIGN_BOTTOM_RIGHT;
  EXPECT_EQ(qattn::api::decline_reason(f, p, nullptr), "");
}

TEST(ApiVarlen, BuilderSetsAndClearsTheFields) {
  qattn::ForwardParams fp(qattn::DType::kFP16, 2, 4, 4, 10, 12, 64);
  fp.varlen(static_cast<const int32_t*>(fake(7)), static_cast<const int32_t*>(fake(8)), 6, 9);
  EXPECT_EQ(fp.raw().cu_seqlens_q, fake(7));
  EXPECT_EQ(fp.raw().cu_seqlens_k, fake(8));
  EXPECT_EQ(fp.raw().max_seqlen_q, 6);
  EXPECT_EQ(fp.raw().max_seqlen_k, 9);
  fp.varlen(nullptr, nullptr, 0, 0);
  EXPECT_EQ(fp.raw().cu_seqlens_q, nullptr);
  EXPECT_EQ(fp.raw().max_seqlen_k, 0);
  qattn_fwd_params defaults;
  qattn_fwd_params_init(&defaults);
  EXPECT_EQ(defaults.cu_seqlens_q, nullptr);
  EXPECT_EQ(defaults.cu_seqlens_k, nullptr);
  EXPECT_EQ(defaults.max_seqlen_q, 0);
  EXPECT_EQ(defaults.max_seqlen_k, 0);
}

}  // namespace
