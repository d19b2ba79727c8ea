// The backward C ABI (qattn_bwd_*) without a GPU: every bad input returns the right
// status and a message naming the parameter and the allowed values; a valid call sizes
// the workspace as the SageBwd layout does; the registry picks or declines the
// backward family on fake architectures with the forward's message format.
//
// The tensors are fake device addresses (far apart, never mapped in this process):
// had validation dereferenced one, the test would crash instead of failing.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "api/family.h"
#include "api/registry.h"
#include "api/validate.h"
#include "cuda/sagebwd/workspace.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"
#include "api_outcome.h"
#include "test_seed.h"

namespace {

using qattn::api::Arch;
using qattn::api::BackwardFamily;

using qattn::test::fake;
using qattn::test::Outcome;
using qattn::test::outcome;

struct Shape {
  int batch = 2, heads_q = 8, heads_kv = 2, seqlen_q = 300, seqlen_kv = 500, head_dim = 64;
};

// Slots 1..9 hold q, k, v, o, dout, lse, dq, dk, dv; slot 10 the workspace.
qattn_bwd_params valid_params(const Shape& s = {}, qattn::Layout layout = qattn::Layout::kHND) {
  qattn_bwd_params p;
  qattn_bwd_params_init(&p);
  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.seqlen_q = s.seqlen_q;
  p.seqlen_kv = s.seqlen_kv;
  p.head_dim = s.head_dim;
  const int64_t row = (s.head_dim + 7) / 8 * 8;
  auto q_like = [&](int slot) {
    return qattn::make_tensor(fake(slot), layout, s.heads_q, s.seqlen_q, row);
  };
  auto k_like = [&](int slot) {
    return qattn::make_tensor(fake(slot), layout, s.heads_kv, s.seqlen_kv, row);
  };
  p.q = q_like(1);
  p.k = k_like(2);
  p.v = k_like(3);
  p.o = q_like(4);
  p.dout = q_like(5);
  p.lse = static_cast<const float*>(fake(6));
  p.dq = q_like(7);
  p.dk = k_like(8);
  p.dv = k_like(9);
  return p;
}

void* workspace() { return fake(10); }


Outcome size_of(const qattn_bwd_params& p) {
  std::size_t bytes = 0;
  const qattn_status s = qattn_bwd_workspace_size(&p, &bytes);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

std::size_t need(const qattn_bwd_params& p) {
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_bwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  return bytes;
}


Outcome bwd(const qattn_bwd_params& p, void* ws, std::size_t bytes) {
  const qattn_status s = qattn_bwd(&p, ws, bytes, nullptr);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

// A valid call stops at the device: a CPU-only build has no kernels; a CUDA build
// without a GPU has no device, and one with a GPU refuses the fake addresses.
void expect_stops_at_the_device(const qattn_bwd_params& p) {
  const Outcome o = bwd(p, workspace(), need(p));
  ASSERT_NE(o.status, QATTN_OK);
  if (!QATTN_HAVE_CUDA) {
    EXPECT_REJECTS(o, QATTN_ERROR_NO_DEVICE, "qattn_bwd", "no CUDA kernels");
  } else if (o.status != QATTN_ERROR_NO_DEVICE) {
    EXPECT_REJECTS(o, QATTN_ERROR_INVALID_ARGUMENT, "is not memory CUDA knows");
  }
}

bool contains(const std::string& s, const std::string& word) {
  return s.find(word) != std::string::npos;
}


// The eight tensor views: name, member, whether the call writes it, and whether it has
// q's shape (else k's).
struct TensorField {
  const char* name;
  qattn_tensor qattn_bwd_params::*member;
  bool output;
  bool q_side;
};
constexpr std::array<TensorField, 8> kTensors{{{"q", &qattn_bwd_params::q, false, true},
                                               {"k", &qattn_bwd_params::k, false, false},
                                               {"v", &qattn_bwd_params::v, false, false},
                                               {"o", &qattn_bwd_params::o, false, true},
                                               {"dout", &qattn_bwd_params::dout, false, true},
                                               {"dq", &qattn_bwd_params::dq, true, true},
                                               {"dk", &qattn_bwd_params::dk, true, false},
                                               {"dv", &qattn_bwd_params::dv, true, false}}};

std::size_t span_bytes(const qattn_bwd_params& p, const TensorField& f) {
  return f.q_side
             ? qattn::api::view_span_bytes(p.*f.member, p.batch, p.heads_q, p.seqlen_q, p.head_dim)
             : qattn::api::view_span_bytes(p.*f.member, p.batch, p.heads_kv, p.seqlen_kv,
                                           p.head_dim);
}

// ---- the valid baseline ------------------------------------------------------------

// The size is the SageBwd layout's total (cuda/sagebwd/workspace.h) and depends on the
// shape and dov only, never on the layout, the mask or the determinism flag.
TEST(BwdValidation, ValidParamsGiveTheLayoutsWorkspaceSize) {
  for (auto layout : {qattn::Layout::kHND, qattn::Layout::kNHD}) {
    for (int dov : {QATTN_BWD_DOV_16BIT, QATTN_BWD_DOV_QUANTIZED}) {
      for (int det : {0, 1}) {
        for (int causal : {0, 1}) {
          qattn_bwd_params p = valid_params({}, layout);
          p.dov = dov;
          p.deterministic = det;
          p.causal = causal;
          p.dtype = causal ? QATTN_DTYPE_FP16 : QATTN_DTYPE_BF16;
          const Outcome o = size_of(p);
          ASSERT_EQ(o.status, QATTN_OK) << o.message;
          EXPECT_EQ(need(p), qattn::sagebwd::workspace_layout(p).total);
          EXPECT_EQ(need(p) % 256, 0u);
        }
      }
    }
  }
  qattn_bwd_params p16 = valid_params(), p8 = valid_params();
  p8.dov = QATTN_BWD_DOV_QUANTIZED;
  EXPECT_GT(need(p8), need(p16));  // dO and V in 8 bits too
}

TEST(BwdValidation, ParamsInitGivesDefaults) {
  qattn_bwd_params p;
  std::memset(&p, 0x5A, sizeof(p));
  qattn_bwd_params_init(&p);
  EXPECT_EQ(p.struct_size, sizeof(qattn_bwd_params));
  for (const TensorField& f : kTensors) {
    EXPECT_EQ((p.*f.member).data, nullptr) << f.name;
    EXPECT_EQ((p.*f.member).stride_n, 0) << f.name;
  }
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.dtype, QATTN_DTYPE_BF16);
  EXPECT_EQ(p.format, QATTN_BWD_INT8);
  EXPECT_EQ(p.dov, QATTN_BWD_DOV_16BIT);
  EXPECT_EQ(p.deterministic, 0);
  EXPECT_EQ(p.causal, 0);
  EXPECT_EQ(p.sm_scale, 0.f);
  EXPECT_EQ(p.reserved0, 0);
  EXPECT_EQ(p.reserved1, 0);
  EXPECT_EQ(p.p_max, nullptr);
  EXPECT_EQ(p.scales, QATTN_BWD_SCALES_PER_BLOCK);
  EXPECT_EQ(p.reserved2, 0);
  qattn_bwd_params_init(nullptr);  // no crash
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "qattn_bwd_workspace_size", "batch");
}

TEST(BwdValidation, NullArguments) {
  std::size_t bytes = 0;
  EXPECT_REJECTS(outcome(qattn_bwd_workspace_size(nullptr, &bytes)), QATTN_ERROR_INVALID_ARGUMENT,
                 "params is NULL");
  const qattn_bwd_params p = valid_params();
  EXPECT_REJECTS(outcome(qattn_bwd_workspace_size(&p, nullptr)), QATTN_ERROR_INVALID_ARGUMENT,
                 "bytes is NULL");
  EXPECT_REJECTS(outcome(qattn_bwd(nullptr, workspace(), 1 << 30, nullptr)),
                 QATTN_ERROR_INVALID_ARGUMENT, "qattn_bwd: params is NULL");
}

// ---- struct_size: qattn.h's growth rule --------------------------------------------

TEST(BwdValidation, StructSizeIsChecked) {
  const qattn_bwd_params base = valid_params();
  const std::size_t want = need(base);
  qattn_bwd_params p = base;
  p.struct_size = 0;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "struct_size = 0",
                 "qattn_bwd_params_init", "sizeof(qattn_bwd_params)");
  p.struct_size = QATTN_BWD_PARAMS_MIN_SIZE - 1;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "struct_size");
  EXPECT_REJECTS(bwd(p, workspace(), want), QATTN_ERROR_INVALID_ARGUMENT,
                 "qattn_bwd:", "struct_size");
  // A size between two layouts ends inside a field (half of p_max, or of the scales'
  // pair): refused, so no pointer is ever read in part.
  for (std::size_t size : {QATTN_BWD_PARAMS_MIN_SIZE + 4, sizeof(qattn_bwd_params) - 4,
                           sizeof(qattn_bwd_params) - 8}) {
    SCOPED_TRACE(size);
    p.struct_size = size;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "struct_size = " + std::to_string(size), "ends inside a field",
                   std::to_string(QATTN_BWD_PARAMS_MIN_SIZE) + " or " +
                       std::to_string(sizeof(qattn_bwd_params)));
    EXPECT_REJECTS(bwd(p, workspace(), want), QATTN_ERROR_INVALID_ARGUMENT, "qattn_bwd:",
                   "ends inside a field");
  }

  struct Newer {
    qattn_bwd_params base;
    int64_t field_from_the_future;
  } newer{};
  newer.base = base;
  newer.base.struct_size = sizeof(Newer);
  newer.field_from_the_future = 1;
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_bwd_workspace_size(&newer.base, &bytes), QATTN_ERROR_UNSUPPORTED);
  EXPECT_TRUE(contains(qattn_last_error_message(), "newer qattn.h")) << qattn_last_error_message();
  EXPECT_TRUE(contains(qattn_last_error_message(), "qattn_bwd_params"));
  EXPECT_EQ(qattn_bwd(&newer.base, workspace(), want, nullptr), QATTN_ERROR_UNSUPPORTED);

  // read_params copies the caller's prefix and keeps the defaults after it.
  qattn_bwd_params full;
  std::memset(&full, 0x5A, sizeof(full));
  ASSERT_EQ(qattn::api::read_params("t", &base, &full), QATTN_OK);
  EXPECT_EQ(std::memcmp(&full, &base, sizeof(base)), 0);
  EXPECT_EQ(need(base), want);
}

TEST(BwdValidation, LayoutKeepsItsPromises) {
  EXPECT_EQ(offsetof(qattn_bwd_params, struct_size), 0u);
  // No tail padding in either layout: a field appended later cannot land inside an older
  // struct_size. The merge-free scales' fields start where the first layout (0.1.0's,
  // QATTN_BWD_PARAMS_MIN_SIZE, which keeps its value) ends.
  EXPECT_EQ(offsetof(qattn_bwd_params, reserved1) + sizeof(int32_t), QATTN_BWD_PARAMS_MIN_SIZE);
  EXPECT_EQ(offsetof(qattn_bwd_params, p_max), QATTN_BWD_PARAMS_MIN_SIZE);
  EXPECT_EQ(offsetof(qattn_bwd_params, p_max) + sizeof(const float*),
            offsetof(qattn_bwd_params, scales));
  EXPECT_EQ(offsetof(qattn_bwd_params, reserved2) + sizeof(int32_t), sizeof(qattn_bwd_params));
  if constexpr (sizeof(void*) == 8) {  // the sizes qattn.h states for LP64
    EXPECT_EQ(QATTN_BWD_PARAMS_MIN_SIZE, 328u);
    EXPECT_EQ(sizeof(qattn_bwd_params), 344u);
  }
  for (std::size_t f : {sizeof(qattn_bwd_params{}.format), sizeof(qattn_bwd_params{}.dov),
                        sizeof(qattn_bwd_params{}.deterministic),
                        sizeof(qattn_bwd_params{}.scales), sizeof(qattn_bwd_params{}.reserved2)})
    EXPECT_EQ(f, 4u);
}

// A caller compiled against the first layout (0.1.0's, QATTN_BWD_PARAMS_MIN_SIZE bytes)
// passes a shorter struct: whatever lies in memory after it is never read, and the
// fields it lacks take qattn_bwd_params_init's defaults (per-block scales, no p_max).
TEST(BwdValidation, FirstLayoutGetsThePerBlockScales) {
  const qattn_bwd_params current = valid_params();
  const std::size_t want = need(current);
  qattn_bwd_params old = valid_params();
  old.struct_size = QATTN_BWD_PARAMS_MIN_SIZE;
  // Bytes past the old struct_size: not the caller's (a misaligned p_max, scales and
  // reserved2 out of range, were they read).
  std::memset(reinterpret_cast<char*>(&old) + QATTN_BWD_PARAMS_MIN_SIZE, 0xA5,
              sizeof(old) - QATTN_BWD_PARAMS_MIN_SIZE);
  qattn_bwd_params got;
  std::memset(&got, 0x5A, sizeof(got));
  ASSERT_EQ(qattn::api::read_params("t", &old, &got), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(got.struct_size, sizeof(qattn_bwd_params));
  EXPECT_EQ(got.p_max, nullptr);
  EXPECT_EQ(got.scales, QATTN_BWD_SCALES_PER_BLOCK);
  EXPECT_EQ(got.reserved2, 0);
  // The caller's prefix is kept as it was (past struct_size, which is the library's own).
  EXPECT_EQ(std::memcmp(reinterpret_cast<const char*>(&got) + sizeof(std::size_t),
                        reinterpret_cast<const char*>(&current) + sizeof(std::size_t),
                        QATTN_BWD_PARAMS_MIN_SIZE - sizeof(std::size_t)),
            0);
  ASSERT_EQ(size_of(old).status, QATTN_OK) << size_of(old).message;
  std::size_t bytes = 0;
  ASSERT_EQ(qattn_bwd_workspace_size(&old, &bytes), QATTN_OK);
  EXPECT_EQ(bytes, want);
  expect_stops_at_the_device(old);
  // An old E4M3 caller keeps its meaning too: per-block scales, no p_max needed.
  old.format = QATTN_BWD_E4M3;
  EXPECT_EQ(size_of(old).status, QATTN_OK) << size_of(old).message;
  // The same bytes in a current struct are read, and refused by name.
  old.struct_size = sizeof(qattn_bwd_params);
  EXPECT_REJECTS(size_of(old), QATTN_ERROR_INVALID_ARGUMENT, "reserved2");
}

// ---- scalars -----------------------------------------------------------------------

TEST(BwdValidation, EnumsAndFlags) {
  for (int bad : {2, -1, 255}) {
    qattn_bwd_params p = valid_params();
    p.dtype = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "dtype = " + std::to_string(bad),
                   "QATTN_DTYPE_FP16 (0)", "QATTN_DTYPE_BF16 (1)");
    p = valid_params();
    p.format = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "format = " + std::to_string(bad),
                   "QATTN_BWD_INT8 (0)", "QATTN_BWD_E4M3 (1)");
    p = valid_params();
    p.dov = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "dov = " + std::to_string(bad),
                   "QATTN_BWD_DOV_16BIT (0)", "QATTN_BWD_DOV_QUANTIZED (1)");
    p = valid_params();
    p.deterministic = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "deterministic = " + std::to_string(bad), "0 or 1");
    p = valid_params();
    p.causal = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "causal = " + std::to_string(bad),
                   "0 or 1");
    p = valid_params();
    p.reserved0 = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "reserved0 = ", "allowed: 0",
                   "qattn_bwd_params_init");
    p = valid_params();
    p.reserved1 = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "reserved1 = ", "allowed: 0",
                   "qattn_bwd_params_init");
    p = valid_params();
    p.reserved2 = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "reserved2 = " + std::to_string(bad), "allowed: 0", "qattn_bwd_params_init");
    EXPECT_REJECTS(bwd(p, workspace(), 1 << 30), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_bwd: reserved2 = ");
    p = valid_params();
    p.scales = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_bwd_workspace_size: scales = " + std::to_string(bad),
                   "QATTN_BWD_SCALES_PER_BLOCK (0)", "QATTN_BWD_SCALES_MERGE_FREE (1)");
    EXPECT_REJECTS(bwd(p, workspace(), 1 << 30), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_bwd: scales = " + std::to_string(bad));
  }
}

TEST(BwdValidation, Shapes) {
  for (int bad : {0, -1, std::numeric_limits<int>::min()}) {
    for (auto [field, name] : {std::pair{&qattn_bwd_params::batch, "batch"},
                               std::pair{&qattn_bwd_params::heads_q, "heads_q"},
                               std::pair{&qattn_bwd_params::heads_kv, "heads_kv"},
                               std::pair{&qattn_bwd_params::seqlen_q, "seqlen_q"},
                               std::pair{&qattn_bwd_params::seqlen_kv, "seqlen_kv"},
                               std::pair{&qattn_bwd_params::head_dim, "head_dim"}}) {
      qattn_bwd_params p = valid_params();
      p.*field = bad;
      SCOPED_TRACE(std::string(name) + " = " + std::to_string(bad));
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, std::string(name) + " = ",
                     "allowed");
    }
  }
  qattn_bwd_params p = valid_params();
  p.batch = 65536;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "batch", "65535");
  p = valid_params();
  p.seqlen_kv = std::numeric_limits<int>::max();
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqlen_kv", "1073741824");
  p = valid_params();
  p.heads_q = 12;
  p.heads_kv = 8;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "heads_q = 12", "heads_kv = 8", "GQA");
  // Head dims beyond the family: unsupported, named by the family.
  for (int d : {129, 256}) {
    p = valid_params();
    p.head_dim = d;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "no kernel family runs this call",
                   "sagebwd_sm90: head_dim = " + std::to_string(d), "1..128", "(any device)");
  }
  // Any d <= 128 once its rows are padded to 8 elements; MQA and MHA alike.
  for (int d : {1, 8, 36, 64, 72, 100, 128}) {
    Shape s;
    s.head_dim = d;
    EXPECT_EQ(size_of(valid_params(s)).status, QATTN_OK)
        << d << ": " << size_of(valid_params(s)).message;
  }
  for (int hkv : {1, 8}) {
    Shape s;
    s.heads_kv = hkv;
    EXPECT_EQ(size_of(valid_params(s)).status, QATTN_OK) << size_of(valid_params(s)).message;
  }
}

TEST(BwdValidation, SmScaleFollowsTheForwardsRules) {
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    qattn_bwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "not finite");
  }
  for (float bad : {-1.f, -std::numeric_limits<float>::denorm_min()}) {
    qattn_bwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "negative", "0 (selects");
  }
  for (float bad : {1e37f, std::nextafter(QATTN_MAX_SM_SCALE, 1e38f)}) {
    qattn_bwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "overflow",
                   "QATTN_MAX_SM_SCALE");
  }
  for (float ok : {0.f, -0.f, 0.125f, 1e-30f, QATTN_MAX_SM_SCALE}) {
    qattn_bwd_params p = valid_params();
    p.sm_scale = ok;
    EXPECT_EQ(size_of(p).status, QATTN_OK) << ok << ": " << size_of(p).message;
  }
  qattn_bwd_params p = valid_params();
  EXPECT_FLOAT_EQ(qattn::api::resolve_defaults(p).sm_scale, 1.f / std::sqrt(64.f));
  p.sm_scale = 0.3f;
  EXPECT_EQ(qattn::api::resolve_defaults(p).sm_scale, 0.3f);
}

// E4M3 (the paper's FP8 comparison) is run by the family: it sizes the same workspace as
// INT8 (the 8-bit buffers hold E4M3 codes instead) and a valid call gets as far as the
// device, as INT8's does (ValidCallStopsAtTheDevice).
TEST(BwdValidation, E4M3IsRunByTheFamily) {
  qattn_bwd_params p = valid_params();
  const std::size_t int8_bytes = need(p);
  p.format = QATTN_BWD_E4M3;
  const Outcome sized = size_of(p);
  ASSERT_EQ(sized.status, QATTN_OK) << sized.message;
  EXPECT_EQ(need(p), int8_bytes);
  expect_stops_at_the_device(p);
}

// ---- merge-free scales ---------------------------------------------------------------

// A valid merge-free call: E4M3, 16-bit dO·Vᵀ, the forward's p_max (slot 11).
qattn_bwd_params merge_free_params(const Shape& s = {},
                                   qattn::Layout layout = qattn::Layout::kHND) {
  qattn_bwd_params p = valid_params(s, layout);
  p.format = QATTN_BWD_E4M3;
  p.dov = QATTN_BWD_DOV_16BIT;
  p.scales = QATTN_BWD_SCALES_MERGE_FREE;
  p.p_max = static_cast<const float*>(fake(11));
  return p;
}

// The family runs it: a valid call sizes a workspace and gets as far as the device, in
// either layout, causal or not, deterministic or not, with GQA and Nq != Nkv.
TEST(BwdMergeFree, ValidCallsAreRunByTheFamily) {
  for (auto layout : {qattn::Layout::kHND, qattn::Layout::kNHD}) {
    for (int det : {0, 1}) {
      for (int causal : {0, 1}) {
        qattn_bwd_params p = merge_free_params({}, layout);
        p.deterministic = det;
        p.causal = causal;
        const Outcome o = size_of(p);
        ASSERT_EQ(o.status, QATTN_OK) << o.message;
        EXPECT_EQ(need(p) % 256, 0u);
        expect_stops_at_the_device(p);
      }
    }
  }
  const Arch hopper{9, 0};
  qattn_status s = QATTN_ERROR_INTERNAL;
  const BackwardFamily* f = qattn::api::select_family("t", merge_free_params(), &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_STREQ(f->name, "sagebwd_sm90");
  EXPECT_NE(f->scales & (1u << QATTN_BWD_SCALES_MERGE_FREE), 0u);
  EXPECT_NE(f->scales & (1u << QATTN_BWD_SCALES_PER_BLOCK), 0u);
}

// Each rule of the merge-free scales refused by name, by the workspace query and by the
// call alike (the call's checks come before any device work).
TEST(BwdMergeFree, RulesAreNamed) {
  struct Case {
    const char* what;
    void (*change)(qattn_bwd_params&);
    std::vector<std::string> words;
  };
  const Case cases[] = {
      {"INT8 format", [](qattn_bwd_params& p) { p.format = QATTN_BWD_INT8; },
       {"scales = QATTN_BWD_SCALES_MERGE_FREE with format = 0",
        "allowed: format QATTN_BWD_E4M3 (1) only"}},
      {"quantized dO·Vᵀ", [](qattn_bwd_params& p) { p.dov = QATTN_BWD_DOV_QUANTIZED; },
       {"scales = QATTN_BWD_SCALES_MERGE_FREE with dov = 1",
        "allowed: dov QATTN_BWD_DOV_16BIT (0) only"}},
      {"INT8 and quantized: the format is named first",
       [](qattn_bwd_params& p) {
         p.format = QATTN_BWD_INT8;
         p.dov = QATTN_BWD_DOV_QUANTIZED;
       },
       {"with format = 0"}},
      {"no p_max", [](qattn_bwd_params& p) { p.p_max = nullptr; },
       {"p_max is NULL", "QATTN_BWD_SCALES_MERGE_FREE", "the forward's (B, Hq, Nq) FP32 p_max"}},
      {"p_max with per-block scales",
       [](qattn_bwd_params& p) { p.scales = QATTN_BWD_SCALES_PER_BLOCK; },
       {"p_max is set with scales = QATTN_BWD_SCALES_PER_BLOCK", "allowed: NULL"}},
      {"p_max with per-block INT8 scales",
       [](qattn_bwd_params& p) {
         p.scales = QATTN_BWD_SCALES_PER_BLOCK;
         p.format = QATTN_BWD_INT8;
       },
       {"p_max is set with scales = QATTN_BWD_SCALES_PER_BLOCK"}},
      {"scales out of range", [](qattn_bwd_params& p) { p.scales = 2; },
       {"scales = 2", "QATTN_BWD_SCALES_PER_BLOCK (0) or QATTN_BWD_SCALES_MERGE_FREE (1)"}},
      {"reserved2", [](qattn_bwd_params& p) { p.reserved2 = 7; },
       {"reserved2 = 7", "qattn_bwd_params_init"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    qattn_bwd_params p = merge_free_params();
    c.change(p);
    const Outcome sized = size_of(p);
    EXPECT_EQ(sized.status, QATTN_ERROR_INVALID_ARGUMENT) << sized.message;
    EXPECT_TRUE(contains(sized.message, "qattn_bwd_workspace_size: ")) << sized.message;
    for (const std::string& w : c.words)
      EXPECT_TRUE(contains(sized.message, w)) << "no '" << w << "' in: " << sized.message;
    const Outcome called = bwd(p, workspace(), 1 << 30);
    EXPECT_EQ(called.status, QATTN_ERROR_INVALID_ARGUMENT) << called.message;
    EXPECT_TRUE(contains(called.message, "qattn_bwd: ")) << called.message;
    for (const std::string& w : c.words)
      EXPECT_TRUE(contains(called.message, w)) << "no '" << w << "' in: " << called.message;
  }
}

TEST(BwdMergeFree, PMaxIsAlignedAndInTheAddressSpace) {
  qattn_bwd_params p = merge_free_params();
  p.p_max = reinterpret_cast<const float*>(static_cast<char*>(fake(11)) + 4);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  for (std::uintptr_t off : {1u, 2u, 3u, 5u}) {
    SCOPED_TRACE(off);
    p.p_max = reinterpret_cast<const float*>(static_cast<char*>(fake(11)) + off);
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max = ", "is not 4-byte aligned",
                   "the forward's (B, Hq, Nq) float array");
    EXPECT_REJECTS(bwd(p, workspace(), 1 << 30), QATTN_ERROR_INVALID_ARGUMENT, "qattn_bwd: p_max",
                   "4-byte aligned");
  }
  p.p_max = reinterpret_cast<const float*>(~std::uintptr_t{0} & ~std::uintptr_t{3});
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max runs past the end");
  // p_max is checked with the inputs: a bad p_max is named before a bad output.
  p = merge_free_params();
  p.p_max = reinterpret_cast<const float*>(static_cast<char*>(fake(11)) + 2);
  p.dq.data = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max");
}

// p_max is an input: no gradient may overlap it (it is read while they are written),
// while the other inputs may share its memory; nor may the workspace.
TEST(BwdMergeFree, OutputsMayNotOverlapPMax) {
  const Shape sh;
  const std::size_t p_max_bytes = std::size_t{4} * sh.batch * sh.heads_q * sh.seqlen_q;
  for (const TensorField& out : kTensors) {
    if (!out.output) continue;
    SCOPED_TRACE(out.name);
    qattn_bwd_params p = merge_free_params();
    // p_max starts inside the output's last 16 bytes.
    (p.*out.member).data = static_cast<char*>(fake(11)) - span_bytes(p, out) + 16;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   std::string(out.name) + " overlaps p_max",
                   "apart from every input (q, k, v, o, dout, lse, p_max)");
    EXPECT_REJECTS(bwd(p, workspace(), 1 << 30), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_bwd: " + std::string(out.name) + " overlaps p_max");
    // The output's start inside p_max's last float.
    p = merge_free_params();
    (p.*out.member).data = static_cast<char*>(fake(11)) + (p_max_bytes - 4) / 16 * 16;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                   std::string(out.name) + " overlaps p_max");
    // Touching (the output ends where p_max starts) is fine.
    p = merge_free_params();
    (p.*out.member).data = static_cast<char*>(fake(11)) - span_bytes(p, out);
    EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  }
  // Inputs may share memory with it: p_max inside q's buffer, or right on the LSE.
  qattn_bwd_params p = merge_free_params();
  p.p_max = static_cast<const float*>(p.q.data);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  p.p_max = p.lse;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // The workspace may not cover it.
  p = merge_free_params();
  const std::size_t n = need(p);
  EXPECT_REJECTS(bwd(p, fake(11), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps p_max",
                 "a buffer of its own");
  // Ending inside it (the workspace's last 256 bytes over p_max's first).
  void* ws = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(fake(11)) - n + 256) / 256 * 256);
  EXPECT_REJECTS(bwd(p, ws, n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps p_max");
}

TEST(BwdMergeFree, BufferSpansNameIt) {
  const Shape sh;
  const qattn_bwd_params p = merge_free_params();
  const auto spans = qattn::api::buffer_spans(p, workspace());
  EXPECT_STREQ(spans[5].name, "lse");
  EXPECT_STREQ(spans[6].name, "p_max");
  EXPECT_EQ(spans[6].data, fake(11));
  EXPECT_EQ(spans[6].bytes, std::size_t{4} * sh.batch * sh.heads_q * sh.seqlen_q);
  EXPECT_STREQ(spans[7].name, "dq.data");
  EXPECT_STREQ(spans[10].name, "workspace");
  const auto per_block = qattn::api::buffer_spans(valid_params(), workspace());
  EXPECT_STREQ(per_block[6].name, "p_max");
  EXPECT_EQ(per_block[6].data, nullptr);
  EXPECT_EQ(per_block[6].bytes, 0u);
}

// ---- tensors -----------------------------------------------------------------------

TEST(BwdValidation, TensorPointersAndStrides) {
  for (const TensorField& f : kTensors) {
    SCOPED_TRACE(f.name);
    const std::string n = f.name;
    qattn_bwd_params p = valid_params();
    (p.*f.member).data = nullptr;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, n + ".data is NULL");
    for (std::uintptr_t off : {2u, 8u}) {
      p = valid_params();
      (p.*f.member).data = static_cast<char*>((p.*f.member).data) + off;
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, n + ".data", "16-byte aligned");
    }
    for (int64_t bad : {0, -64, 4, 36}) {
      for (auto [stride, sname] : {std::pair{&qattn_tensor::stride_b, "stride_b"},
                                   std::pair{&qattn_tensor::stride_h, "stride_h"},
                                   std::pair{&qattn_tensor::stride_n, "stride_n"}}) {
        p = valid_params();
        (p.*f.member).*stride = bad;
        EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, n + "." + sname, "multiple of 8");
      }
    }
    p = valid_params();
    (p.*f.member).stride_b = int64_t{1} << 40;  // 2^41 bytes: past the TMA limit
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, n + ".stride_b", "2^40");
    p = valid_params();
    (p.*f.member).data = reinterpret_cast<void*>(~std::uintptr_t{0} & ~std::uintptr_t{15});
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, n, "address space");
  }
}

TEST(BwdValidation, LseIsRequiredAndAligned) {
  qattn_bwd_params p = valid_params();
  p.lse = nullptr;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse is NULL", "required");
  p.lse = reinterpret_cast<const float*>(static_cast<char*>(fake(6)) + 2);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse", "4-byte aligned");
  p.lse = reinterpret_cast<const float*>(static_cast<char*>(fake(6)) + 4);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  p.lse = reinterpret_cast<const float*>(~std::uintptr_t{0} & ~std::uintptr_t{3});
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse runs past the end");
}

// An output whose rows meet is refused; an input may do it (it is only read).
TEST(BwdValidation, OutputsMayNotAliasThemselves) {
  for (const TensorField& f : kTensors) {
    SCOPED_TRACE(f.name);
    qattn_bwd_params p = valid_params();
    (p.*f.member).stride_n = 8;  // rows 8 elements apart, 64 long
    if (f.output)
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, std::string(f.name) + ".stride_n",
                     "share addresses", "alias itself");
    else
      EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  }
}

TEST(BwdValidation, OutputsOverlapNothing) {
  const std::array<const char*, 6> inputs{"q", "k", "v", "o", "dout", "lse"};
  for (const TensorField& out : kTensors) {
    if (!out.output) continue;
    for (const char* in : inputs) {
      SCOPED_TRACE(std::string(out.name) + " vs " + in);
      qattn_bwd_params p = valid_params();
      const void* at = std::string_view(in) == "lse" ? static_cast<const void*>(p.lse) : nullptr;
      for (const TensorField& f : kTensors)
        if (std::string_view(f.name) == in) at = (p.*f.member).data;
      // The input starts inside the output's last 16 bytes.
      (p.*out.member).data = static_cast<char*>(const_cast<void*>(at)) - span_bytes(p, out) + 16;
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                     std::string(out.name) + " overlaps " + in, "allowed: an output buffer");
      // Touching (the output ends where the input starts) is fine.
      (p.*out.member).data = static_cast<char*>(const_cast<void*>(at)) - span_bytes(p, out);
      EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
    }
  }
  // The gradients overlap each other: named later one first.
  for (auto [a, b, msg] :
       {std::tuple{&qattn_bwd_params::dq, &qattn_bwd_params::dk, "dk overlaps dq"},
        std::tuple{&qattn_bwd_params::dq, &qattn_bwd_params::dv, "dv overlaps dq"},
        std::tuple{&qattn_bwd_params::dk, &qattn_bwd_params::dv, "dv overlaps dk"}}) {
    qattn_bwd_params p = valid_params();
    (p.*b).data = (p.*a).data;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, msg);
  }
  // Inputs may share memory: k == v, dout == o, lse inside q's buffer.
  qattn_bwd_params p = valid_params();
  p.v.data = p.k.data;
  p.dout.data = p.o.data;
  p.lse = static_cast<const float*>(p.q.data);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

// ---- workspace and the call --------------------------------------------------------

TEST(BwdValidation, Workspace) {
  const qattn_bwd_params p = valid_params();
  const std::size_t n = need(p);
  EXPECT_REJECTS(bwd(p, nullptr, n), QATTN_ERROR_INVALID_ARGUMENT, "qattn_bwd: workspace is NULL",
                 std::to_string(n), "qattn_bwd_workspace_size");
  EXPECT_REJECTS(bwd(p, fake(10, 128), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace",
                 "256-byte aligned");
  EXPECT_REJECTS(bwd(p, workspace(), n - 1), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes",
                 std::to_string(n));
  EXPECT_REJECTS(bwd(p, workspace(), 0), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes");
  for (const TensorField& f : kTensors) {
    SCOPED_TRACE(f.name);
    // The workspace ends 256 bytes into the tensor.
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>((p.*f.member).data);
    void* ws = reinterpret_cast<void*>((at - n + 256) / 256 * 256);
    EXPECT_REJECTS(bwd(p, ws, n), QATTN_ERROR_INVALID_ARGUMENT,
                   std::string("workspace overlaps ") + f.name, "a buffer of its own");
  }
  EXPECT_REJECTS(bwd(p, const_cast<float*>(p.lse), n), QATTN_ERROR_INVALID_ARGUMENT,
                 "workspace overlaps lse");
  // Parameter errors come before workspace errors.
  qattn_bwd_params bad = p;
  bad.deterministic = 3;
  EXPECT_REJECTS(bwd(bad, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT, "deterministic");
}

TEST(BwdValidation, ValidCallStopsAtTheDevice) { expect_stops_at_the_device(valid_params()); }

// Fresh random shapes, layouts and options: every valid one sizes as the layout says,
// and one randomly chosen output placed over a randomly chosen buffer is refused by
// name.
TEST(BwdValidation, RandomCallsSizeAsTheLayoutAndRefuseOverlaps) {
  const std::uint32_t seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 300; ++i) {
    Shape s;
    s.batch = pick(1, 4);
    s.heads_kv = pick(1, 4);
    s.heads_q = s.heads_kv * pick(1, 4);
    s.seqlen_q = pick(1, 3000);
    s.seqlen_kv = pick(1, 3000);
    s.head_dim = pick(1, 128);
    qattn_bwd_params p =
        valid_params(s, pick(0, 1) != 0 ? qattn::Layout::kHND : qattn::Layout::kNHD);
    p.causal = pick(0, 1);
    p.dov = pick(0, 1);
    p.deterministic = pick(0, 1);
    p.dtype = pick(0, 1);
    if (pick(0, 3) == 0) {  // the merge-free scales, with the p_max they read (slot 11)
      p.format = QATTN_BWD_E4M3;
      p.dov = QATTN_BWD_DOV_16BIT;
      p.scales = QATTN_BWD_SCALES_MERGE_FREE;
      p.p_max = static_cast<const float*>(fake(11));
    }
    SCOPED_TRACE("iteration " + std::to_string(i));
    ASSERT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
    const std::size_t n = need(p);
    EXPECT_EQ(n, qattn::sagebwd::workspace_layout(p).total);
    EXPECT_EQ(bwd(p, workspace(), n - pick(1, 256)).status, QATTN_ERROR_WORKSPACE_TOO_SMALL);

    const TensorField& out = kTensors[static_cast<std::size_t>(pick(5, 7))];
    const TensorField& other = kTensors[static_cast<std::size_t>(pick(0, 7))];
    if (&out == &other) continue;
    // Place the output (16-byte aligned) so it ends 1 to 16 bytes into the other buffer.
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>((p.*other.member).data);
    (p.*out.member).data = reinterpret_cast<void*>((at + 16 - span_bytes(p, out)) / 16 * 16);
    const std::string want = other.output && &other < &out
                                 ? std::string(out.name) + " overlaps " + other.name
                             : other.output ? std::string(other.name) + " overlaps " + out.name
                                            : std::string(out.name) + " overlaps " + other.name;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, want);
  }
}

// ---- the registry with this build's backward family, on fake devices ---------------

TEST(BwdRegistry, HopperRunsSageBwd) {
  qattn_status s = QATTN_ERROR_INTERNAL;
  const Arch hopper{9, 0};
  const BackwardFamily* f = qattn::api::select_family("t", valid_params(), &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_EQ(s, QATTN_OK);
  EXPECT_STREQ(f->name, "sagebwd_sm90");
  EXPECT_EQ(f->launch != nullptr, QATTN_HAVE_CUDA != 0);
  EXPECT_EQ(qattn::api::backward_arch_supported(hopper), QATTN_HAVE_CUDA != 0);
  EXPECT_FALSE(qattn::api::backward_arch_supported({8, 0}));
}

TEST(BwdRegistry, NonHopperIsDeclinedNamingTheFamily) {
  for (Arch arch : {Arch{8, 0}, Arch{8, 9}, Arch{9, 1}, Arch{10, 0}, Arch{12, 0}}) {
    const std::string cc = std::to_string(arch.major) + "." + std::to_string(arch.minor);
    SCOPED_TRACE(cc);
    qattn_status s = QATTN_OK;
    qattn_bwd_params p = valid_params();
    p.causal = 1;
    p.deterministic = 1;
    EXPECT_EQ(qattn::api::select_family("qattn_bwd", p, &arch, &s), nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    const std::string m = qattn_last_error_message();
    for (const std::string& w :
         {std::string("qattn_bwd: no kernel family runs this call (backward, format "
                      "QATTN_BWD_INT8, dov QATTN_BWD_DOV_16BIT, bf16, head_dim 64, causal, "
                      "deterministic; device sm_") +
              std::to_string(arch.major) + std::to_string(arch.minor) + ")",
          std::string("; considered 1; sagebwd_sm90: the device has compute capability ") + cc +
              "; its kernels run on sm_90"})
      EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
  }
}

TEST(BwdRegistry, LimitsBoundTheWorkspaceAndTheGrids) {
  const BackwardFamily& f = *qattn::api::backward_families()[0];
  qattn_bwd_params p = valid_params();
  EXPECT_EQ(qattn::api::decline_reason(f, p, nullptr), "");
  // Every extent at its largest: the workspace sum does not fit.
  p.batch = p.heads_q = p.heads_kv = 65535;
  p.seqlen_q = p.seqlen_kv = 1 << 30;
  EXPECT_TRUE(contains(qattn::api::decline_reason(f, p, nullptr), "workspace size"))
      << qattn::api::decline_reason(f, p, nullptr);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "sagebwd_sm90: batch * heads * seqlen");
  // 65535 * 256 * ceil(32768 / 128) = 2^32 - 2^16 dK/dV CTAs: beyond an int.
  p = valid_params();
  p.batch = 65535;
  p.heads_q = p.heads_kv = 256;
  p.seqlen_q = 1;
  p.seqlen_kv = 32768;
  EXPECT_TRUE(contains(qattn::api::decline_reason(f, p, nullptr),
                       "batch * heads_kv * ceil(seqlen_kv / 128) = 4294901760"))
      << qattn::api::decline_reason(f, p, nullptr);
  p.seqlen_kv = 16384;  // half of it fits: 2^31 - 2^15
  EXPECT_EQ(qattn::api::decline_reason(f, p, nullptr), "");
  // The same for the dQ side: ceil(16384 / 64) Q blocks per head.
  p.seqlen_kv = 1;
  p.seqlen_q = 16384;
  EXPECT_TRUE(contains(qattn::api::decline_reason(f, p, nullptr),
                       "batch * heads_q * ceil(seqlen_q / 64) = 4294901760"))
      << qattn::api::decline_reason(f, p, nullptr);
  p.seqlen_q = 8192;
  EXPECT_EQ(qattn::api::decline_reason(f, p, nullptr), "");
}

// ---- the registry's logic, on backward families made up here -----------------------

constexpr std::array<Arch, 1> kSm80{{{8, 0}}};
constexpr std::array<Arch, 2> kSm90And100{{{9, 0}, {10, 0}}};

std::string short_kv(const qattn_bwd_params& p) {
  return p.seqlen_kv > 256 ? "seqlen_kv above 256" : "";
}
std::size_t ws_1k(const qattn_bwd_params&) { return 1024; }
std::size_t ws_4k(const qattn_bwd_params&) { return 4096; }

constexpr uint32_t kBoth = 3u;
constexpr BackwardFamily kE4m3Only{"fake_e4m3",          kSm80, 1,     256,     kBoth,  kBoth,
                                   1u << QATTN_BWD_E4M3, kBoth, kBoth, 1u, nullptr, &ws_1k, nullptr};
constexpr BackwardFamily kAtomicOnly{"fake_atomic", kSm80,   1,      256,
                                     kBoth,         kBoth,   kBoth,  1u << QATTN_BWD_DOV_16BIT,
                                     1u << 0,       1u,      nullptr, &ws_1k, nullptr};
constexpr BackwardFamily kFp16Unmasked{"fake_fp16",
                                       kSm80,
                                       1,
                                       256,
                                       1u << QATTN_DTYPE_FP16,
                                       qattn::api::kMaskNone,
                                       kBoth,
                                       kBoth,
                                       kBoth,
                                       1u,
                                       nullptr,
                                       &ws_1k,
                                       nullptr};
constexpr BackwardFamily kShortKv{"fake_short_kv", kSm90And100, 64,    64,        kBoth,  kBoth,
                                  kBoth,           kBoth,       kBoth, 1u, &short_kv, &ws_4k, nullptr};
// Per-block scales only (as kE4m3Only, kAtomicOnly, ...), and one with both.
constexpr BackwardFamily kPerBlockOnly{"fake_per_block", kSm80, 1,     256,    kBoth,  kBoth,
                                       kBoth,            kBoth, kBoth, 1u << QATTN_BWD_SCALES_PER_BLOCK,
                                       nullptr,          &ws_1k, nullptr};
constexpr BackwardFamily kMergeFreeToo{"fake_merge_free", kSm80, 1,     256,    kBoth,  kBoth,
                                       kBoth,             kBoth, kBoth, kBoth,  nullptr, &ws_4k,
                                       nullptr};

TEST(BwdRegistry, EveryDeclineReasonIsNamed) {
  const std::array<const BackwardFamily*, 4> families{&kE4m3Only, &kAtomicOnly, &kFp16Unmasked,
                                                      &kShortKv};
  qattn_bwd_params p = valid_params();  // bf16, d = 64, seqlen_kv = 500, INT8
  p.causal = 1;
  p.deterministic = 1;
  const Arch sm80{8, 0};
  qattn_status s = QATTN_OK;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), nullptr);
  EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
  std::string m = qattn_last_error_message();
  for (const char* w :
       {"f: no kernel family runs this call (backward", "considered 4",
        "fake_e4m3: format QATTN_BWD_INT8 is not implemented by this family",
        "fake_atomic: has no deterministic kernel (deterministic = 1)",
        "fake_fp16: does not read bf16 inputs",
        "fake_short_kv: the device has compute capability 8.0; its kernels run on sm_90, sm_100"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;

  p.dov = QATTN_BWD_DOV_QUANTIZED;
  p.dtype = QATTN_DTYPE_FP16;
  const Arch sm90{9, 0};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, families), nullptr);
  m = qattn_last_error_message();
  for (const char* w : {"fake_atomic: dov QATTN_BWD_DOV_QUANTIZED",
                        "fake_fp16: has no causal kernel", "fake_short_kv: seqlen_kv above 256"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;

  // The first family that accepts wins.
  p.causal = 0;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), &kFp16Unmasked);
  EXPECT_EQ(s, QATTN_OK);
  p.seqlen_kv = 128;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, families), &kShortKv);
  p.deterministic = 0;
  p.dov = QATTN_BWD_DOV_16BIT;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), &kAtomicOnly);
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, {}), nullptr);
  EXPECT_TRUE(contains(qattn_last_error_message(), "considered 0")) << qattn_last_error_message();
}

// A family without the merge-free bit declines a merge-free call by name; one with it
// runs it; a per-block call runs on either.
TEST(BwdRegistry, MergeFreeScalesAreDeclinedByAFamilyWithoutThem) {
  const Arch sm80{8, 0};
  qattn_bwd_params p = merge_free_params();
  qattn_status s = QATTN_OK;
  const std::array<const BackwardFamily*, 1> per_block_only{&kPerBlockOnly};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, per_block_only), nullptr);
  EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
  std::string m = qattn_last_error_message();
  for (const char* w : {"f: no kernel family runs this call (backward, format QATTN_BWD_E4M3",
                        "merge-free scales; device sm_80)",
                        "fake_per_block: scales QATTN_BWD_SCALES_MERGE_FREE are not implemented "
                        "by this family"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, per_block_only), 0u);  // none accepts
  // The families made up above declare per-block scales only: each declines it by name.
  const std::array<const BackwardFamily*, 4> others{&kE4m3Only, &kAtomicOnly, &kFp16Unmasked,
                                                    &kPerBlockOnly};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, others), nullptr);
  m = qattn_last_error_message();
  for (const char* w : {"fake_e4m3: scales QATTN_BWD_SCALES_MERGE_FREE",
                        "fake_atomic: scales QATTN_BWD_SCALES_MERGE_FREE"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
  // One that has them wins, and sizes the workspace alone.
  const std::array<const BackwardFamily*, 2> both{&kPerBlockOnly, &kMergeFreeToo};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, both), &kMergeFreeToo);
  EXPECT_EQ(s, QATTN_OK);
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, both), 4096u);
  // A per-block call: the first family takes it, the largest workspace counts.
  qattn_bwd_params per_block = valid_params();
  EXPECT_EQ(qattn::api::select_family("f", per_block, &sm80, &s, both), &kPerBlockOnly);
  EXPECT_EQ(qattn::api::workspace_bytes_for(per_block, both), 4096u);
  // Off Hopper, this build's family declines the merge-free call for the device, and the
  // call's description names the scales.
  EXPECT_EQ(qattn::api::select_family("qattn_bwd", p, &sm80, &s), nullptr);
  m = qattn_last_error_message();
  EXPECT_TRUE(contains(m, "merge-free scales; device sm_80); considered 1; sagebwd_sm90: the "
                          "device has compute capability 8.0"))
      << m;
}

TEST(BwdRegistry, WorkspaceIsTheLargestOverAcceptingFamilies) {
  const std::array<const BackwardFamily*, 2> families{&kFp16Unmasked, &kShortKv};
  qattn_bwd_params p = valid_params();
  p.dtype = QATTN_DTYPE_FP16;
  p.seqlen_kv = 128;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 4096u);  // both accept
  p.seqlen_kv = 500;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 1024u);  // only the fp16 one
  p.causal = 1;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 0u);  // none
}

}  // namespace

// ---- the C++ builder (qattn.hpp) ------------------------------------------------------

namespace {

// The builder's struct equals the hand-filled one field by field (the tensors, the
// flags and the options), so the C ABI sees the same call either way.
TEST(BwdBuilder, FillsTheSameStructAsTheCalls) {
  const Shape s;
  for (qattn::Layout layout : {qattn::Layout::kHND, qattn::Layout::kNHD}) {
    SCOPED_TRACE(layout == qattn::Layout::kHND ? "HND" : "NHD");
    const qattn_bwd_params want = valid_params(s, layout);
    const int64_t row = (s.head_dim + 7) / 8 * 8;
    qattn::BackwardParams bp(qattn::DType::kBF16, s.batch, s.heads_q, s.heads_kv, s.seqlen_q,
                             s.seqlen_kv, s.head_dim);
    bp.q(fake(1), layout, row).k(fake(2), layout, row).v(fake(3), layout, row)
        .o(fake(4), layout, row).dout(fake(5), layout, row)
        .lse(static_cast<const float*>(fake(6)))
        .dq(fake(7), layout, row).dk(fake(8), layout, row).dv(fake(9), layout, row);
    const qattn_bwd_params& got = bp.raw();
    auto same = [](const qattn_tensor& a, const qattn_tensor& b) {
      return a.data == b.data && a.stride_b == b.stride_b && a.stride_h == b.stride_h &&
             a.stride_n == b.stride_n;
    };
    EXPECT_TRUE(same(got.q, want.q) && same(got.k, want.k) && same(got.v, want.v));
    EXPECT_TRUE(same(got.o, want.o) && same(got.dout, want.dout));
    EXPECT_TRUE(same(got.dq, want.dq) && same(got.dk, want.dk) && same(got.dv, want.dv));
    EXPECT_EQ(got.lse, want.lse);
    EXPECT_EQ(got.struct_size, sizeof(qattn_bwd_params));
    std::size_t a = 0, b = 0;
    ASSERT_TRUE(qattn::workspace_size(bp, &a).ok());
    ASSERT_EQ(qattn_bwd_workspace_size(&want, &b), QATTN_OK);
    EXPECT_EQ(a, b);
  }
  qattn::BackwardParams bp(qattn::DType::kFP16, 1, 2, 1, 64, 64, 64);
  bp.causal(true).sm_scale(0.25f).format(qattn::BackwardFormat::kE4M3)
      .dov(qattn::DoV::kQuantized).deterministic(true);
  EXPECT_EQ(bp.raw().causal, 1);
  EXPECT_EQ(bp.raw().sm_scale, 0.25f);
  EXPECT_EQ(bp.raw().format, QATTN_BWD_E4M3);
  EXPECT_EQ(bp.raw().dov, QATTN_BWD_DOV_QUANTIZED);
  EXPECT_EQ(bp.raw().deterministic, 1);
  EXPECT_EQ(bp.raw().dtype, QATTN_DTYPE_FP16);
  EXPECT_EQ(bp.raw().scales, QATTN_BWD_SCALES_PER_BLOCK);
  EXPECT_EQ(bp.raw().p_max, nullptr);
  bp.dov(qattn::DoV::k16Bit).scales(qattn::BackwardScales::kMergeFree)
      .p_max(static_cast<const float*>(fake(11)));
  EXPECT_EQ(bp.raw().scales, QATTN_BWD_SCALES_MERGE_FREE);
  EXPECT_EQ(bp.raw().p_max, fake(11));
  // The builder's merge-free call is the hand-filled one.
  const int64_t row = (s.head_dim + 7) / 8 * 8;
  qattn::BackwardParams mf(qattn::DType::kBF16, s.batch, s.heads_q, s.heads_kv, s.seqlen_q,
                           s.seqlen_kv, s.head_dim);
  mf.q(fake(1), qattn::Layout::kHND, row).k(fake(2), qattn::Layout::kHND, row)
      .v(fake(3), qattn::Layout::kHND, row).o(fake(4), qattn::Layout::kHND, row)
      .dout(fake(5), qattn::Layout::kHND, row).lse(static_cast<const float*>(fake(6)))
      .dq(fake(7), qattn::Layout::kHND, row).dk(fake(8), qattn::Layout::kHND, row)
      .dv(fake(9), qattn::Layout::kHND, row).format(qattn::BackwardFormat::kE4M3)
      .scales(qattn::BackwardScales::kMergeFree).p_max(static_cast<const float*>(fake(11)));
  std::size_t a = 0, b = 0;
  ASSERT_TRUE(qattn::workspace_size(mf, &a).ok());
  const qattn_bwd_params want = merge_free_params(s);
  ASSERT_EQ(qattn_bwd_workspace_size(&want, &b), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(a, b);
  EXPECT_EQ(std::memcmp(&mf.raw(), &want, sizeof(want)), 0);
  // Without p_max the C ABI's named error comes back through the builder.
  mf.p_max(nullptr);
  const qattn::Status e = qattn::workspace_size(mf, &a);
  EXPECT_EQ(e.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_NE(e.message().find("p_max is NULL"), std::string::npos) << e.message();
}

// A stride the builder cannot represent is the first error reported, by name, before
// the C ABI sees the struct; a missing LSE is the C ABI's named error.
TEST(BwdBuilder, ReportsItsOwnAndTheAbisErrors) {
  qattn::BackwardParams bp(qattn::DType::kBF16, 1, 65535, 1, 1 << 30, 64, 64);
  bp.q(fake(1), qattn::Layout::kHND, int64_t{1} << 40);
  std::size_t bytes = 0;
  const qattn::Status s = qattn::workspace_size(bp, &bytes);
  EXPECT_EQ(s.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("make_tensor"), std::string::npos) << s.message();
  EXPECT_EQ(qattn::backward(bp, workspace(), 1 << 20, nullptr).code(),
            qattn::StatusCode::kInvalidArgument);

  const Shape sh;
  qattn::BackwardParams nolse(qattn::DType::kBF16, sh.batch, sh.heads_q, sh.heads_kv,
                              sh.seqlen_q, sh.seqlen_kv, sh.head_dim);
  nolse.raw() = valid_params(sh);
  nolse.lse(nullptr);
  const qattn::Status e = qattn::workspace_size(nolse, &bytes);
  EXPECT_EQ(e.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_NE(e.message().find("lse"), std::string::npos) << e.message();
}

}  // namespace
