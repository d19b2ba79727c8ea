// qattn_merge's validation without a GPU: every field's rule with its named error, the
// struct-size rule, overlaps between what it writes and what it reads, and a valid call
// reaching the device step (QATTN_ERROR_NO_DEVICE here). Addresses are fake
// (qattn::test::fake): nothing is dereferenced.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "api/validate_merge.h"
#include "api_outcome.h"
#include "qattn/qattn.h"

namespace {

using qattn::test::fake;
using qattn::test::Outcome;

constexpr int kB = 2, kH = 4, kN = 100, kD = 64;

qattn_tensor bhnd(void* data) {  // contiguous (B, H, N, d)
  return {data, int64_t{kH} * kN * kD, int64_t{kN} * kD, kD};
}

qattn_merge_params valid() {
  qattn_merge_params p;
  qattn_merge_params_init(&p);
  p.batch = kB;
  p.heads = kH;
  p.seqlen = kN;
  p.head_dim = kD;
  p.part = bhnd(fake(1));
  p.part_lse = static_cast<const float*>(fake(2));
  p.acc = static_cast<float*>(fake(3));
  p.acc_lse = static_cast<float*>(fake(4));
  return p;
}

Outcome validate(const qattn_merge_params& p) {
  qattn_merge_params out;
  const qattn_status s = qattn::api::read_merge("qattn_merge", &p, &out);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

TEST(ApiMerge, InitGivesDefaultsAndAValidCallPassesValidation) {
  qattn_merge_params p;
  qattn_merge_params_init(&p);
  EXPECT_EQ(p.struct_size, sizeof(qattn_merge_params));
  EXPECT_EQ(p.dtype, QATTN_DTYPE_BF16);
  EXPECT_EQ(p.first, 0);
  EXPECT_EQ(p.out.data, nullptr);
  EXPECT_EQ(validate(valid()).status, QATTN_OK) << validate(valid()).message;
  qattn_merge_params with_out = valid();
  with_out.out = bhnd(fake(5));
  EXPECT_EQ(validate(with_out).status, QATTN_OK) << validate(with_out).message;
}

TEST(ApiMerge, StructSizeRule) {
  qattn_merge_params p = valid();
  p.struct_size = 8;
  EXPECT_REJECTS(validate(p), QATTN_ERROR_INVALID_ARGUMENT, "struct_size = 8",
                 "qattn_merge_params_init");
  p.struct_size = sizeof(qattn_merge_params) + 8;
  EXPECT_REJECTS(validate(p), QATTN_ERROR_UNSUPPORTED, "newer qattn.h");
  EXPECT_REJECTS(Outcome({qattn_merge(nullptr, nullptr), qattn_last_error_message()}),
                 QATTN_ERROR_INVALID_ARGUMENT, "qattn_merge: params is NULL");
}

TEST(ApiMerge, FieldsAreNamed) {
  struct Case {
    void (*edit)(qattn_merge_params&);
    const char* words;
  };
  const Case cases[] = {
      {[](qattn_merge_params& p) { p.dtype = 7; }, "dtype"},
      {[](qattn_merge_params& p) { p.batch = 0; }, "batch = 0"},
      {[](qattn_merge_params& p) { p.heads = -1; }, "heads = -1"},
      {[](qattn_merge_params& p) { p.seqlen = 0; }, "seqlen = 0"},
      {[](qattn_merge_params& p) { p.head_dim = 1025; }, "head_dim = 1025"},
      {[](qattn_merge_params& p) { p.first = 2; }, "first = 2"},
      {[](qattn_merge_params& p) { p.part.data = nullptr; }, "part.data is NULL"},
      {[](qattn_merge_params& p) { p.part.data = fake(1, 8); }, "16-byte aligned"},
      {[](qattn_merge_params& p) { p.part.stride_n = 60; }, "part.stride_n = 60"},
      {[](qattn_merge_params& p) { p.part_lse = nullptr; }, "part_lse is NULL"},
      {[](qattn_merge_params& p) { p.acc = nullptr; }, "acc is NULL"},
      {[](qattn_merge_params& p) { p.acc = static_cast<float*>(fake(3, 2)); }, "acc = "},
      {[](qattn_merge_params& p) { p.acc_lse = static_cast<float*>(fake(4, 1)); },
       "4-byte aligned"},
      {[](qattn_merge_params& p) { p.out = bhnd(fake(5)); p.out.stride_h = 0; },
       "out.stride_h = 0"},
  };
  for (const Case& c : cases) {
    qattn_merge_params p = valid();
    c.edit(p);
    EXPECT_REJECTS(validate(p), QATTN_ERROR_INVALID_ARGUMENT, c.words);
  }
}

TEST(ApiMerge, WhatItWritesOverlapsNothingItReads) {
  qattn_merge_params p = valid();
  p.acc = static_cast<float*>(fake(1, 64));  // inside part
  EXPECT_REJECTS(validate(p), QATTN_ERROR_INVALID_ARGUMENT, "acc overlaps part");
  p = valid();
  p.acc_lse = static_cast<float*>(fake(3, 256));  // inside acc
  EXPECT_REJECTS(validate(p), QATTN_ERROR_INVALID_ARGUMENT, "acc_lse overlaps acc");
  p = valid();
  p.out = bhnd(fake(2));  // over part_lse
  EXPECT_REJECTS(validate(p), QATTN_ERROR_INVALID_ARGUMENT, "out overlaps part_lse");
  // Inputs may overlap each other (they are only read).
  p = valid();
  p.part_lse = static_cast<const float*>(fake(1, 64));
  EXPECT_EQ(validate(p).status, QATTN_OK) << validate(p).message;
}

TEST(ApiMerge, AValidCallReachesTheDevice) {
  const qattn_merge_params p = valid();
  const qattn_status s = qattn_merge(&p, nullptr);
  if (qattn_built_with_cuda() == 0) {
    EXPECT_EQ(s, QATTN_ERROR_NO_DEVICE) << qattn_last_error_message();
    return;
  }
  // With a device the fake pointers are refused as not being device memory; without
  // one the call stops at the device step. Either way nothing ran.
  EXPECT_TRUE(s == QATTN_ERROR_NO_DEVICE || s == QATTN_ERROR_INVALID_ARGUMENT)
      << qattn_last_error_message();
}

}  // namespace
