// The C ABI's parameter validation, without a GPU: every bad input returns the
// right status and a message naming the parameter, and nothing is read or written.
//
// The tensors are fake device addresses (far apart, never mapped in this process):
// had validation dereferenced one, the test would crash instead of failing.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "api/bench_hooks.h"
#include "api/validate.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"
#include "api_outcome.h"
#include "cuda/sage3_fwd/workspace.h"

namespace {

using qattn::test::fake;
using qattn::test::Outcome;
using qattn::test::outcome;

struct Shape {
  int batch = 2, heads_q = 8, heads_kv = 2, seqlen_q = 300, seqlen_kv = 500, head_dim = 64;
};

qattn_fwd_params valid_params(const Shape& s = {}, qattn::Layout layout = qattn::Layout::kHND) {
  qattn::ForwardParams fp(qattn::DType::kBF16, s.batch, s.heads_q, s.heads_kv, s.seqlen_q,
                          s.seqlen_kv, s.head_dim);
  const int64_t row = (s.head_dim + 7) / 8 * 8;
  fp.q(fake(1), layout, row)
      .k(fake(2), layout, row)
      .v(fake(3), layout, row)
      .o(fake(4), layout, row);
  fp.lse(static_cast<float*>(fake(5)));
  return fp.raw();
}


Outcome size_of(const qattn_fwd_params& p) {
  std::size_t bytes = 0;
  const qattn_status s = qattn_fwd_workspace_size(&p, &bytes);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

std::size_t need(const qattn_fwd_params& p) {
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  return bytes;
}

Outcome fwd(const qattn_fwd_params& p, void* ws, std::size_t bytes) {
  const qattn_status s = qattn_fwd(&p, ws, bytes, nullptr);
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}


// ---- the valid baseline ------------------------------------------------------------

TEST(ApiValidation, ValidParamsGiveAWorkspaceSize) {
  for (auto layout : {qattn::Layout::kHND, qattn::Layout::kNHD}) {
    const qattn_fwd_params p = valid_params({}, layout);
    const Outcome o = size_of(p);
    ASSERT_EQ(o.status, QATTN_OK) << o.message;
    EXPECT_GT(need(p), 0u);
    EXPECT_EQ(need(p) % qattn::api::kWorkspaceAlign, 0u);
  }
  // The size depends on the shape, not on the layout.
  EXPECT_EQ(need(valid_params({}, qattn::Layout::kHND)),
            need(valid_params({}, qattn::Layout::kNHD)));
}

// V and O with head_dim_v channels (MLA's 192 / 128): their rows are checked with that
// width, and a V whose rows are too short for it is refused by name.
TEST(ApiValidation, NarrowerVChecksVAndOWithItsOwnWidth) {
  qattn::ForwardParams fp(qattn::DType::kBF16, 2, 8, 2, 300, 500, 192);
  fp.head_dim_v(128)
      .q(fake(1), qattn::Layout::kHND)
      .k(fake(2), qattn::Layout::kHND)
      .v(fake(3), qattn::Layout::kHND)
      .o(fake(4), qattn::Layout::kHND);
  EXPECT_EQ(fp.raw().v.stride_n, 128);
  EXPECT_EQ(fp.raw().o.stride_n, 128);
  const Outcome ok = size_of(fp.raw());
  EXPECT_EQ(ok.status, QATTN_OK) << ok.message;
  // o's rows closer than head_dim_v: its elements would overlap.
  qattn_fwd_params p = fp.raw();
  p.o.stride_n = 120;
  std::vector<uint8_t> ws(need(fp.raw()));
  const Outcome bad = fwd(p, ws.data(), ws.size());
  EXPECT_NE(bad.status, QATTN_OK);
  EXPECT_NE(bad.message.find("o.stride_n = 120"), std::string::npos) << bad.message;
  EXPECT_NE(bad.message.find("less than its rows' 128 elements"), std::string::npos) << bad.message;
}

TEST(ApiValidation, ParamsInitGivesDefaults) {
  qattn_fwd_params p;
  std::memset(&p, 0x5A, sizeof(p));
  qattn_fwd_params_init(&p);
  EXPECT_EQ(p.q.data, nullptr);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.struct_size, sizeof(qattn_fwd_params));
  EXPECT_EQ(p.dtype, QATTN_DTYPE_BF16);
  EXPECT_EQ(p.scheme, QATTN_SCHEME_SAGE2_8B);
  EXPECT_EQ(p.sage2.granularity, QATTN_QK_PER_THREAD);
  EXPECT_EQ(p.causal, 0);
  EXPECT_EQ(p.sm_scale, 0.f);
  // No mask beyond causal: every key, no window, bottom-right.
  EXPECT_EQ(p.kv_lengths, nullptr);
  EXPECT_EQ(p.window, 0);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.alignment, QATTN_ALIGN_BOTTOM_RIGHT);
  qattn_fwd_params_init(nullptr);  // no crash
  // Defaults alone are not a valid call: the first missing thing is named.
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "batch");
}

TEST(ApiValidation, NullArguments) {
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_fwd_workspace_size(nullptr, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qattn_last_error_message()).find("params"), std::string::npos);
  const qattn_fwd_params p = valid_params();
  EXPECT_EQ(qattn_fwd_workspace_size(&p, nullptr), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qattn_last_error_message()).find("bytes"), std::string::npos);
  EXPECT_EQ(qattn_fwd(nullptr, fake(6), 1 << 20, nullptr), QATTN_ERROR_INVALID_ARGUMENT);
}

TEST(ApiValidation, NullTensorPointers) {
  for (auto [field, name] :
       {std::pair{&qattn_fwd_params::q, "q.data"}, std::pair{&qattn_fwd_params::k, "k.data"},
        std::pair{&qattn_fwd_params::v, "v.data"}, std::pair{&qattn_fwd_params::o, "o.data"}}) {
    qattn_fwd_params p = valid_params();
    (p.*field).data = nullptr;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name, "NULL");
  }
  qattn_fwd_params p = valid_params();
  p.lse = nullptr;  // optional
  EXPECT_EQ(size_of(p).status, QATTN_OK);
}

// ---- scalars -----------------------------------------------------------------------

TEST(ApiValidation, ShapesMustBePositive) {
  for (int bad : {0, -1, std::numeric_limits<int>::min()}) {
    for (auto [field, name] : {std::pair{&qattn_fwd_params::batch, "batch"},
                               std::pair{&qattn_fwd_params::heads_q, "heads_q"},
                               std::pair{&qattn_fwd_params::heads_kv, "heads_kv"},
                               std::pair{&qattn_fwd_params::seqlen_q, "seqlen_q"},
                               std::pair{&qattn_fwd_params::seqlen_kv, "seqlen_kv"},
                               std::pair{&qattn_fwd_params::head_dim, "head_dim"}}) {
      qattn_fwd_params p = valid_params();
      p.*field = bad;
      SCOPED_TRACE(std::string(name) + " = " + std::to_string(bad));
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name, "allowed");
    }
  }
}

TEST(ApiValidation, GridAndLengthLimits) {
  qattn_fwd_params p = valid_params();
  p.batch = qattn::api::kMaxGridDim + 1;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "batch", "65535");
  p = valid_params();
  p.heads_q = p.heads_kv = qattn::api::kMaxGridDim + 1;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "heads_q");
  p = valid_params();
  p.seqlen_kv = std::numeric_limits<int>::max();  // its padded length would overflow an int
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "seqlen_kv");
}

TEST(ApiValidation, HeadsMustGroup) {
  qattn_fwd_params p = valid_params();
  p.heads_q = 12;
  p.heads_kv = 8;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "heads_q = 12", "heads_kv = 8");
  // MQA and plain MHA are fine.
  for (int hkv : {1, 12}) {
    Shape s;
    s.heads_q = 12;
    s.heads_kv = hkv;
    EXPECT_EQ(size_of(valid_params(s)).status, QATTN_OK) << size_of(valid_params(s)).message;
  }
}

TEST(ApiValidation, HeadDim) {
  for (int d : {257, 320, 100000}) {
    qattn_fwd_params p = valid_params();
    p.head_dim = d;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "head_dim", "1..128", "129..256");
  }
  // 129..256: the head-dim-256 family (sage2_wide_sm90), rows padded to a multiple of 8.
  for (int d : {129, 192, 200, 256}) {
    Shape s;
    s.head_dim = d;
    EXPECT_EQ(size_of(valid_params(s)).status, QATTN_OK) << size_of(valid_params(s)).message;
  }
  // Any d <= 128 is accepted once its rows are padded to a multiple of 8 elements.
  for (int d : {1, 8, 36, 64, 72, 96, 100, 128}) {
    Shape s;
    s.head_dim = d;
    const Outcome o = size_of(valid_params(s));
    EXPECT_EQ(o.status, QATTN_OK) << "d = " << d << ": " << o.message;
  }
  // Contiguous rows of 36 elements are not 16-byte strided: the message says to pad.
  Shape s;
  s.head_dim = 36;
  qattn_fwd_params p = valid_params(s);
  p.q = qattn::make_tensor(fake(1), qattn::Layout::kHND, s.heads_q, s.seqlen_q, 36);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "q.stride_n = 36", "multiple of 8",
                 "pad");
}

TEST(ApiValidation, EnumsAndFlags) {
  for (int bad : {2, -1, 255}) {
    qattn_fwd_params p = valid_params();
    p.dtype = bad;  // an int field: any value is defined to read
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "dtype", "QATTN_DTYPE_BF16");
  }
  for (int bad : {2, -1}) {
    qattn_fwd_params p = valid_params();
    p.causal = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "causal", "0 or 1");
  }
  for (int bad : {3, -1, std::numeric_limits<int>::min()}) {
    qattn_fwd_params p = valid_params();
    p.sage2.granularity = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sage2.granularity",
                   "QATTN_QK_PER_WARP");
  }
  for (int bad : {4, -1, 1000}) {
    qattn_fwd_params p = valid_params();
    p.scheme = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "scheme", "QATTN_SCHEME_SAGE2_8B",
                   "QATTN_SCHEME_SAGE3_NVFP4", "QATTN_SCHEME_PRECISE16", "QATTN_SCHEME_SAGE2_8B_AUTO");
  }
  for (int g : {0, 1, 2}) {
    qattn_fwd_params p = valid_params();
    p.sage2.granularity = g;
    p.dtype = QATTN_DTYPE_FP16;
    p.causal = 1;
    EXPECT_EQ(size_of(p).status, QATTN_OK);
  }
}

TEST(ApiValidation, SmScale) {
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    qattn_fwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "not finite");
  }
  // A negative scale is an error, not the default (the reference would honour it).
  for (float bad : {-1.f, -2.f, -1e-30f, -std::numeric_limits<float>::denorm_min()}) {
    qattn_fwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "negative", "0 (selects");
  }
  // Above QATTN_MAX_SM_SCALE the FP32 scores overflow (qattn.h derives the bound).
  for (float bad : {1e37f, 3e38f, std::nextafter(QATTN_MAX_SM_SCALE, 1e38f)}) {
    qattn_fwd_params p = valid_params();
    p.sm_scale = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "sm_scale", "overflow",
                   "QATTN_MAX_SM_SCALE");
  }
  for (float ok : {0.f, -0.f, 0.125f, 1e-30f, std::numeric_limits<float>::denorm_min(), 1e20f,
                   QATTN_MAX_SM_SCALE}) {
    qattn_fwd_params p = valid_params();
    p.sm_scale = ok;
    EXPECT_EQ(size_of(p).status, QATTN_OK) << ok << ": " << size_of(p).message;
  }
  // The bound beside the check: twice the largest |score| of FP16-range inputs with K
  // smoothed, 2 * 128 * 65504 * (2 * 65504) * log2(e) * QATTN_MAX_SM_SCALE, is below
  // FLT_MAX with a factor of 10 to spare.
  EXPECT_LT(2 * 128.0 * 65504.0 * (2 * 65504.0) * 1.4426950408889634 *
                double{QATTN_MAX_SM_SCALE},
            double{std::numeric_limits<float>::max()} / 10);
  // 0 resolves to 1/sqrt(d) (the launch gets the explicit value).
  qattn_fwd_params p = valid_params();
  p.sm_scale = 0.f;
  EXPECT_FLOAT_EQ(qattn::api::resolve_defaults(p).sm_scale, 1.f / std::sqrt(64.f));
  p.sm_scale = 0.3f;
  EXPECT_EQ(qattn::api::resolve_defaults(p).sm_scale, 0.3f);
}

// The default scale is the FP64 reference's 1/sqrt(d) rounded once to float, the value
// the emulators quantize Q with, at every head dim. Computed in float (1.f / sqrtf(d):
// two roundings) it is one ulp off at 31 head dims of 1..128 (96 and 112 among them),
// where a kernel would quantize Q with another scale than its emulation.
TEST(ApiValidation, DefaultScaleIsTheReferenceScaleRoundedOnce) {
  int float_formula_differs = 0;
  for (int d = 1; d <= 128; ++d) {
    qattn_fwd_params p = valid_params();
    p.head_dim = d;
    p.sm_scale = 0.f;
    const float reference = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    EXPECT_EQ(qattn::api::resolve_defaults(p).sm_scale, reference) << "head_dim " << d;
    float_formula_differs += 1.f / std::sqrt(static_cast<float>(d)) != reference;
  }
  EXPECT_EQ(float_formula_differs, 31);  // what the test guards against exists
}

// ---- masks beyond causal: window, alignment, key-padding lengths --------------------

TEST(ApiValidation, WindowFlag) {
  for (int bad : {2, -1, std::numeric_limits<int>::max()}) {
    qattn_fwd_params p = valid_params();
    p.window = bad;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "window = " + std::to_string(bad),
                   "0 or 1");
  }
  for (int ok : {0, 1}) {
    qattn_fwd_params p = valid_params();
    p.window = ok;
    EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  }
}

// Each side is in range whatever the flag says: turning the window on never makes a
// side valid or invalid.
TEST(ApiValidation, WindowSides) {
  for (auto field : {&qattn_fwd_params::window_left, &qattn_fwd_params::window_right}) {
    const char* name = field == &qattn_fwd_params::window_left ? "window_left" : "window_right";
    for (int window : {0, 1}) {
      for (int bad : {-2, -100, std::numeric_limits<int>::min()}) {
        qattn_fwd_params p = valid_params();
        p.window = window;
        p.*field = bad;
        EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT,
                       std::string(name) + " = " + std::to_string(bad), "-1 (no bound",
                       "number of keys >= 0");
      }
      for (int ok : {-1, 0, 1, 127, 128, 100000, std::numeric_limits<int>::max()}) {
        for (int causal : {0, 1}) {
          qattn_fwd_params p = valid_params();
          p.window = window;
          p.*field = ok;
          p.causal = causal;
          EXPECT_EQ(size_of(p).status, QATTN_OK)
              << name << " = " << ok << ": " << size_of(p).message;
        }
      }
    }
  }
}

TEST(ApiValidation, Alignment) {
  for (int bad : {2, -1, 255, std::numeric_limits<int>::min()}) {
    qattn_fwd_params p = valid_params();
    p.alignment = bad;  // an int field: any value is defined to read
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "alignment = " + std::to_string(bad),
                   "QATTN_ALIGN_BOTTOM_RIGHT (0)", "QATTN_ALIGN_TOP_LEFT (1)");
  }
  for (int ok : {QATTN_ALIGN_BOTTOM_RIGHT, QATTN_ALIGN_TOP_LEFT}) {
    for (int causal : {0, 1}) {
      qattn_fwd_params p = valid_params();  // seqlen_q 300 != seqlen_kv 500
      p.alignment = ok;
      p.causal = causal;
      p.window = 1;
      p.window_left = 64;
      EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
    }
  }
}

const int32_t* lengths_at(int slot, std::uintptr_t offset = 0) {
  return static_cast<const int32_t*>(fake(slot, offset));
}

TEST(ApiValidation, KvLengthsPointer) {
  qattn_fwd_params p = valid_params();
  p.kv_lengths = nullptr;  // optional: every key
  EXPECT_EQ(size_of(p).status, QATTN_OK);
  for (std::uintptr_t off : {1u, 2u, 3u, 6u}) {
    p.kv_lengths = lengths_at(7, off);
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "kv_lengths", "4-byte aligned",
                   "NULL or a (batch,) int32 array");
  }
  for (std::uintptr_t off : {0u, 4u, 12u}) {
    p.kv_lengths = lengths_at(7, off);
    EXPECT_EQ(size_of(p).status, QATTN_OK) << off << ": " << size_of(p).message;
  }
  // batch (2) int32 must fit below the end of the address space.
  p.kv_lengths = reinterpret_cast<const int32_t*>(UINTPTR_MAX - 3);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "kv_lengths",
                 "past the end of the address space");
  p.kv_lengths = reinterpret_cast<const int32_t*>(UINTPTR_MAX - 11);  // ends 4 bytes before it
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

// kv_lengths is an input: it may share memory with q, k, v, never with o, lse or the
// workspace.
TEST(ApiValidation, KvLengthsMustNotOverlapOutputs) {
  qattn_fwd_params p = valid_params();
  p.kv_lengths = static_cast<const int32_t*>(p.o.data);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps kv_lengths");
  p.kv_lengths = reinterpret_cast<const int32_t*>(static_cast<char*>(p.o.data) + 1024);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps kv_lengths");
  p.kv_lengths = reinterpret_cast<const int32_t*>(p.lse + 6);  // inside the (2, 8, 300) LSE
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps kv_lengths",
                 "a separate (B, Hq, Nq) float buffer");
  // Touching the LSE's end, not overlapping it: fine.
  p.kv_lengths = reinterpret_cast<const int32_t*>(p.lse + 2 * 8 * 300);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // Just before the LSE: its second int32 is the LSE's first float.
  p.kv_lengths = reinterpret_cast<const int32_t*>(p.lse) - 1;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps kv_lengths");
  // Inputs may overlap each other: lengths inside k are only read.
  p.kv_lengths = static_cast<const int32_t*>(p.k.data);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // The workspace: apart from it too.
  p.kv_lengths = lengths_at(7);
  const std::size_t n = need(p);
  EXPECT_REJECTS(fwd(p, fake(7), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps kv_lengths");
  p.kv_lengths = lengths_at(6, n - 4);  // the workspace's last 4 bytes
  EXPECT_REJECTS(fwd(p, fake(6), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps kv_lengths");
  p.kv_lengths = lengths_at(6, n);  // right after it
  const Outcome o = fwd(p, fake(6), n);
  EXPECT_EQ(o.message.find("overlaps"), std::string::npos) << o.message;
}

// ---- attn_mask ----------------------------------------------------------------------

// A (B, Hq, Nq, Nkv) boolean mask of the valid_params shape, contiguous bytes, at fake(8).
qattn_fwd_params with_bool_mask(qattn_fwd_params p) {
  p.attn_mask_type = QATTN_MASK_BOOL;
  p.attn_mask = fake(8);
  p.attn_mask_stride_k = 1;
  p.attn_mask_stride_q = p.seqlen_kv;
  p.attn_mask_stride_h = int64_t{p.seqlen_q} * p.seqlen_kv;
  p.attn_mask_stride_b = int64_t{p.heads_q} * p.seqlen_q * p.seqlen_kv;
  return p;
}

TEST(ApiValidation, AttnMaskFields) {
  qattn_fwd_params p = with_bool_mask(valid_params());
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  qattn_fwd_params bad = p;
  bad.attn_mask_type = 3;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "attn_mask_type = 3",
                 "QATTN_MASK_NONE (0), QATTN_MASK_BOOL (1) or QATTN_MASK_ADDITIVE (2)");
  bad = p;
  bad.attn_mask = nullptr;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "attn_mask is NULL");
  bad = p;
  bad.reserved1 = 3;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "reserved1 = 3");
  for (int64_t qattn_fwd_params::*stride :
       {&qattn_fwd_params::attn_mask_stride_b, &qattn_fwd_params::attn_mask_stride_h,
        &qattn_fwd_params::attn_mask_stride_q, &qattn_fwd_params::attn_mask_stride_k}) {
    bad = p;
    bad.*stride = -1;
    EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "is negative", "0 broadcasts");
    bad.*stride = int64_t{1} << 62;  // the span reaches 2^62 bytes
    EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "2^62 bytes");
  }
  // Every stride 0: one byte broadcast to every (b, h, i, j); no alignment is asked for.
  bad = p;
  bad.attn_mask_stride_b = bad.attn_mask_stride_h = bad.attn_mask_stride_q =
      bad.attn_mask_stride_k = 0;
  bad.attn_mask = static_cast<char*>(fake(8)) + 3;
  EXPECT_EQ(size_of(bad).status, QATTN_OK) << size_of(bad).message;
  // Without a mask the pointer and the strides are not read.
  bad.attn_mask_type = QATTN_MASK_NONE;
  bad.attn_mask = nullptr;
  bad.attn_mask_stride_q = -5;
  EXPECT_EQ(size_of(bad).status, QATTN_OK) << size_of(bad).message;
  // The mask is an input: apart from o (and the LSE and the workspace).
  bad = p;
  bad.attn_mask = static_cast<char*>(p.o.data) + 100;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps attn_mask");
  bad.attn_mask = p.k.data;  // inside an input: only read
  EXPECT_EQ(size_of(bad).status, QATTN_OK) << size_of(bad).message;
}

// SDPA's float mask: two bytes per element in the span (its last element may not reach
// past o's start), and the SA2-8b family's layout rule (keys contiguous, 4-byte rows and
// pointer) declines other layouts by name, before anything is launched.
TEST(ApiValidation, AdditiveAttnMask) {
  qattn_fwd_params p = with_bool_mask(valid_params());
  p.attn_mask_type = QATTN_MASK_ADDITIVE;
  p.attn_mask_stride_k = 2;
  p.attn_mask_stride_q = 2 * int64_t{p.seqlen_kv};
  p.attn_mask_stride_h = p.attn_mask_stride_q * p.seqlen_q;
  p.attn_mask_stride_b = p.attn_mask_stride_h * p.heads_q;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  qattn_fwd_params bad = p;
  bad.attn_mask = nullptr;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "attn_mask is NULL",
                 "QATTN_MASK_ADDITIVE");
  // The last element's second byte: a mask ending one byte into o overlaps it.
  const int64_t span = p.attn_mask_stride_b * (p.batch - 1) + p.attn_mask_stride_h * (p.heads_q - 1) +
                       p.attn_mask_stride_q * (p.seqlen_q - 1) + p.attn_mask_stride_k * (p.seqlen_kv - 1);
  bad = p;
  bad.attn_mask = static_cast<char*>(p.o.data) - span / 4 * 4;  // ends 2 or 4 bytes into o
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps attn_mask");
  bad.attn_mask = static_cast<char*>(p.o.data) - (span + 2 + 3) / 4 * 4;  // ends at or before o
  EXPECT_EQ(size_of(bad).status, QATTN_OK) << size_of(bad).message;
  // Keys not contiguous, a row of an odd number of bytes, a pointer off 4 bytes.
  bad = p;
  bad.attn_mask_stride_k = 4;
  bad.attn_mask_stride_q = 4 * int64_t{p.seqlen_kv};
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_UNSUPPORTED, "attn_mask_stride_k = 4");
  bad = p;
  bad.attn_mask_stride_q += 2;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_UNSUPPORTED, "multiples of 4 bytes");
  bad = p;
  bad.attn_mask = static_cast<char*>(fake(8)) + 2;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_UNSUPPORTED, "multiples of 4 bytes");
  // A broadcast dimension's stride is never read: 0 passes, so does an odd one at size 1.
  bad = p;
  bad.attn_mask_stride_b = bad.attn_mask_stride_h = 0;
  EXPECT_EQ(size_of(bad).status, QATTN_OK) << size_of(bad).message;
  // With causal: the family takes an attn_mask alone.
  bad = p;
  bad.causal = 1;
  EXPECT_REJECTS(size_of(bad), QATTN_ERROR_UNSUPPORTED, "attn_mask alone");
}

// In this version the mask is the whole rule: with causal, a window or key padding the
// family declines (UNSUPPORTED, with the reason), and the mask's own workspace grows with
// its slices.
TEST(ApiValidation, AttnMaskAloneAndItsWorkspace) {
  const qattn_fwd_params p = with_bool_mask(valid_params());
  for (int variant = 0; variant < 3; ++variant) {
    qattn_fwd_params c = p;
    if (variant == 0) c.causal = 1;
    if (variant == 1) {
      c.window = 1;
      c.window_left = 10;
    }
    if (variant == 2) c.kv_lengths = lengths_at(7);
    EXPECT_REJECTS(size_of(c), QATTN_ERROR_UNSUPPORTED, "attn_mask alone",
                   "write them into the mask");
  }
  qattn_fwd_params broadcast = p;
  broadcast.attn_mask_stride_b = broadcast.attn_mask_stride_h = 0;
  const std::size_t plain = need(valid_params()), one = need(broadcast), per_head = need(p);
  EXPECT_GT(one, plain);
  EXPECT_GT(per_head, one);  // 2 x 8 slices against 1
}

// ---- strides, alignment, overlap ---------------------------------------------------

TEST(ApiValidation, StridesMustBePositiveMultiplesOf8) {
  for (int64_t bad : {0, -64, 4, 65, 36}) {
    for (auto [field, tname] :
         {std::pair{&qattn_fwd_params::q, "q"}, std::pair{&qattn_fwd_params::k, "k"},
          std::pair{&qattn_fwd_params::v, "v"}, std::pair{&qattn_fwd_params::o, "o"}}) {
      for (auto [stride, sname] : {std::pair{&qattn_tensor::stride_b, "stride_b"},
                                   std::pair{&qattn_tensor::stride_h, "stride_h"},
                                   std::pair{&qattn_tensor::stride_n, "stride_n"}}) {
        qattn_fwd_params p = valid_params();
        (p.*field).*stride = bad;
        const std::string name = std::string(tname) + "." + sname;
        SCOPED_TRACE(name + " = " + std::to_string(bad));
        EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name.c_str(), "multiple of 8");
      }
    }
  }
}

TEST(ApiValidation, StrideOfExtentOneIsIgnored) {
  Shape s;
  s.batch = 1;
  qattn_fwd_params p = valid_params(s);
  p.q.stride_b = 0;
  p.k.stride_b = -3;
  p.o.stride_b = 7;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

TEST(ApiValidation, HugeStridesAreRejectedNotWrapped) {
  qattn_fwd_params p = valid_params();
  p.k.stride_b = int64_t{1} << 40;  // 2^41 bytes: past the TMA limit
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "k.stride_b", "2^40");
  p = valid_params();
  p.v.stride_b = (std::numeric_limits<int64_t>::max() / 8) * 8;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "v.stride_b");
  // Largest legal strides, but the tensor would run past the address space.
  p = valid_params();
  p.q.data = reinterpret_cast<void*>(~std::uintptr_t{0} & ~std::uintptr_t{15});
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "q", "address space");
}

TEST(ApiValidation, PointersMustBe16ByteAligned) {
  for (std::uintptr_t off : {2u, 4u, 8u}) {
    for (auto [field, name] :
         {std::pair{&qattn_fwd_params::q, "q.data"}, std::pair{&qattn_fwd_params::k, "k.data"},
          std::pair{&qattn_fwd_params::v, "v.data"}, std::pair{&qattn_fwd_params::o, "o.data"}}) {
      qattn_fwd_params p = valid_params();
      (p.*field).data = static_cast<char*>((p.*field).data) + off;
      EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name, "16-byte aligned");
    }
  }
  qattn_fwd_params p = valid_params();
  p.lse = reinterpret_cast<float*>(static_cast<char*>(fake(5)) + 2);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse", "4-byte aligned");
  p.lse = reinterpret_cast<float*>(static_cast<char*>(fake(5)) + 4);
  EXPECT_EQ(size_of(p).status, QATTN_OK);
}

TEST(ApiValidation, OutputMustNotOverlapInputs) {
  const qattn_fwd_params base = valid_params();
  for (auto [field, name] : {std::pair{&qattn_fwd_params::q, "o overlaps q"},
                             std::pair{&qattn_fwd_params::k, "o overlaps k"},
                             std::pair{&qattn_fwd_params::v, "o overlaps v"}}) {
    qattn_fwd_params p = base;
    (p.*field).data = p.o.data;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name);
    // A partial overlap: the input starts inside the output's last row.
    p = base;
    (p.*field).data = static_cast<char*>(p.o.data) + 16 * 1024;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, name);
  }
  // o right after q (touching, not overlapping) is fine.
  qattn_fwd_params p = base;
  const std::size_t q_bytes = std::size_t{2} * 8 * 300 * 64 * 2;
  p.o.data = static_cast<char*>(p.q.data) + q_bytes;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  p.o.data = static_cast<char*>(p.q.data) + q_bytes - 16;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o overlaps q");
}

TEST(ApiValidation, InputsMayAlias) {
  qattn_fwd_params p = valid_params();
  p.v = p.k;  // the same buffer for K and V: only read
  p.heads_q = p.heads_kv;
  p.seqlen_q = p.seqlen_kv;
  p.q = p.k;
  p.o = qattn::make_tensor(fake(4), qattn::Layout::kHND, p.heads_q, p.seqlen_q, 64);
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

TEST(ApiValidation, OutputMustNotAliasItself) {
  qattn_fwd_params p = valid_params();
  p.o.stride_n = 8;  // rows of 64 elements, 8 apart
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o.stride_n", "share addresses");
  p = valid_params();
  p.o.stride_h = 64;  // two heads share all but one row
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o.stride_h", "share addresses");
  // Inputs may (e.g. a broadcast view): they are only read.
  p = valid_params();
  p.k.stride_h = 64;
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
}

// Strides may interleave rows of different heads (or batches) without any two rows
// meeting: such an output is valid and must be accepted. Row starts are b*sb + h*sh +
// n*sn and each row is d = 64 elements long. With sn = 128 and sh = 192 over 3 rows,
// head 1 starts inside head 0's span (so "each stride steps past the smaller ones"
// fails) but its rows 192, 320, 448 fall in the gaps of head 0's 0, 128, 256.
TEST(ApiValidation, InterleavedOutputWithoutAliasingIsAccepted) {
  Shape s;
  s.batch = 1;
  s.heads_q = s.heads_kv = 2;
  s.seqlen_q = s.seqlen_kv = 3;
  qattn_fwd_params p = valid_params(s);
  p.lse = nullptr;
  p.o = {fake(4), 0, /*stride_h=*/192, /*stride_n=*/128};  // rows at 0,128,256 and 192,320,448
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // Heads interleaved with rows across batches: b*sb + h*sh + n*sn with sb = 64.
  Shape t;
  t.batch = 2;
  t.heads_q = t.heads_kv = 4;
  t.seqlen_q = t.seqlen_kv = 5;
  p = valid_params(t);
  p.lse = nullptr;
  p.o = {fake(4), /*stride_b=*/64, /*stride_h=*/128 * 5, /*stride_n=*/128};
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // One element of overlap in the same pattern is refused, naming two rows that meet.
  p.o.stride_b = 56;  // row (1, 0, 0) starts 56 elements after (0, 0, 0), less than d = 64
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "o.stride_b = 56", "share addresses",
                 "[0, 0, 0]", "[1, 0, 0]");
}

// Past kMaxInterleavedRows rows, an interleaved output is "not supported", never
// "share addresses" (which would be a false reason).
TEST(ApiValidation, LargeInterleavedOutputIsUnsupportedNotFalselyAliased) {
  // Head 1's rows (384 + 256 n) fall between head 0's (256 n): valid, interleaved.
  Shape s;
  s.batch = 1;
  s.heads_q = s.heads_kv = 2;
  s.seqlen_q = s.seqlen_kv = 3;
  qattn_fwd_params p = valid_params(s);
  p.lse = nullptr;
  p.o = {fake(4), 0, /*stride_h=*/384, /*stride_n=*/256};
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  s.seqlen_q = s.seqlen_kv = (1 << 19) + 1;  // 2^20 + 2 rows: over the limit
  p = valid_params(s);
  p.lse = nullptr;
  p.o = {fake(4), 0, /*stride_h=*/384, /*stride_n=*/256};
  const Outcome o = size_of(p);
  EXPECT_REJECTS(o, QATTN_ERROR_UNSUPPORTED, "o has interleaved strides", "supported up to");
  EXPECT_EQ(o.message.find("share addresses"), std::string::npos) << o.message;
}

TEST(ApiValidation, LseMustNotOverlap) {
  qattn_fwd_params p = valid_params();
  p.lse = static_cast<float*>(p.o.data);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps o");
  p = valid_params();
  p.lse = static_cast<float*>(p.k.data);
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "lse overlaps k");
}

// P's row maxima (p_max, written by the SageAttention2-8b family): optional, 4-byte
// aligned (B, Hq, Nq) floats inside the address space, an output apart from every input
// and from o and lse; the forward's checks name it, through the workspace query and the
// call alike.
TEST(ApiValidation, PMaxPointer) {
  qattn_fwd_params p = valid_params();
  p.p_max = static_cast<float*>(fake(9));
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  p.p_max = static_cast<float*>(fake(9, 4));  // 4-byte aligned is enough
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  for (std::uintptr_t off : {1u, 2u, 3u, 6u}) {
    SCOPED_TRACE(off);
    p.p_max = static_cast<float*>(fake(9, off));
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "qattn_fwd_workspace_size: p_max = ",
                   "is not 4-byte aligned", "NULL or a (B, Hq, Nq) float array");
    EXPECT_REJECTS(fwd(p, fake(6), need(valid_params())), QATTN_ERROR_INVALID_ARGUMENT,
                   "qattn_fwd: p_max = ", "4-byte aligned");
  }
  p.p_max = reinterpret_cast<float*>(~std::uintptr_t{0} & ~std::uintptr_t{3});
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max runs past the end");
}

TEST(ApiValidation, PMaxMustNotOverlap) {
  const Shape sh;
  const std::size_t rows = std::size_t{4} * sh.batch * sh.heads_q * sh.seqlen_q;  // bytes
  // An output of the call (o, lse) or an input under it: refused, naming both.
  for (auto [what, at, msg] :
       {std::tuple{"o", fake(4, 64), "p_max overlaps o"},
        std::tuple{"lse", fake(5, rows - 4), "p_max overlaps lse"},
        std::tuple{"q", fake(1, 256), "p_max overlaps q"},
        std::tuple{"k", static_cast<void*>(static_cast<char*>(fake(2)) - rows + 4),
                   "p_max overlaps k"}}) {
    SCOPED_TRACE(what);
    qattn_fwd_params p = valid_params();
    p.p_max = static_cast<float*>(at);
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, msg,
                   "allowed: a separate (B, Hq, Nq) float buffer");
    EXPECT_REJECTS(fwd(p, fake(6), 1 << 30), QATTN_ERROR_INVALID_ARGUMENT, "qattn_fwd: ", msg);
  }
  // The same address as lse: one of them would be overwritten.
  qattn_fwd_params p = valid_params();
  p.p_max = p.lse;
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max overlaps lse");
  // Right after the LSE (touching) is fine, and so is any place of its own.
  p.p_max = static_cast<float*>(fake(5, rows));
  EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
  // Key-padding lengths are an input too.
  p = valid_params();
  p.kv_lengths = static_cast<const int32_t*>(fake(7));
  p.p_max = static_cast<float*>(fake(7, 4));
  EXPECT_REJECTS(size_of(p), QATTN_ERROR_INVALID_ARGUMENT, "p_max overlaps kv_lengths");
  // The workspace may not cover it either.
  p = valid_params();
  p.p_max = static_cast<float*>(fake(9));
  EXPECT_REJECTS(fwd(p, fake(9), need(p)), QATTN_ERROR_INVALID_ARGUMENT,
                 "workspace overlaps p_max", "a buffer of its own");
}

// ---- workspace ---------------------------------------------------------------------

TEST(ApiValidation, Workspace) {
  const qattn_fwd_params p = valid_params();
  const std::size_t n = need(p);
  EXPECT_REJECTS(fwd(p, nullptr, n), QATTN_ERROR_INVALID_ARGUMENT, "workspace", "NULL");
  EXPECT_REJECTS(fwd(p, fake(6, 128), n), QATTN_ERROR_INVALID_ARGUMENT, "workspace", "256-byte");
  EXPECT_REJECTS(fwd(p, fake(6), n - 1), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes",
                 std::to_string(n));
  EXPECT_REJECTS(fwd(p, fake(6), 0), QATTN_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes");
  EXPECT_REJECTS(fwd(p, p.v.data, n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps v");
  EXPECT_REJECTS(fwd(p, static_cast<char*>(p.o.data) + 256, n), QATTN_ERROR_INVALID_ARGUMENT,
                 "workspace overlaps o");
  EXPECT_REJECTS(fwd(p, p.lse, n), QATTN_ERROR_INVALID_ARGUMENT, "workspace overlaps lse");
  // Parameter errors come before workspace errors.
  qattn_fwd_params bad = p;
  bad.causal = 7;
  EXPECT_REJECTS(fwd(bad, nullptr, 0), QATTN_ERROR_INVALID_ARGUMENT, "causal");
}

// A call no family runs (a head dim past every family's) refused by the entry point `fn`
// with QATTN_ERROR_UNSUPPORTED and its name in the message: `call` makes the call.
template <typename Call>
void expect_refused_as_unsupported(const char* fn, Call call) {
  qattn_fwd_params p = valid_params();
  p.head_dim = 264;
  EXPECT_EQ(call(p), QATTN_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(qattn_last_error_message()).find(fn), std::string::npos);
}

TEST(ApiValidation, AttentionOnlyValidatesToo) {
  expect_refused_as_unsupported("qattn_fwd_attention_only", [](const qattn_fwd_params& p) {
    return qattn_fwd_attention_only(&p, fake(6), 1 << 30, nullptr);
  });
}

// The bench hook that stops before the enqueue makes qattn_fwd's checks, in order: a bad
// parameter first, then (valid parameters, no usable device here, or host memory on a
// GPU machine) the device or the pointers; never QATTN_OK off a GPU.
TEST(ApiValidation, ChecksOnlyMakesTheForwardsChecks) {
  expect_refused_as_unsupported("qattn_fwd_checks_only", [](const qattn_fwd_params& p) {
    return qattn_fwd_checks_only(&p, fake(6), 1 << 30);
  });
  qattn_fwd_params p = valid_params();
  EXPECT_EQ(qattn_fwd_checks_only(&p, fake(6), 0), QATTN_ERROR_WORKSPACE_TOO_SMALL);
  const qattn_status s = qattn_fwd_checks_only(&p, fake(6), 1 << 30);
  EXPECT_TRUE(s == QATTN_ERROR_NO_DEVICE || s == QATTN_ERROR_INVALID_ARGUMENT)
      << s << ": " << qattn_last_error_message();
}

// The hook without the pointer checks keeps every other check: a bad parameter and a
// short workspace are refused by name. (No valid call here: with fake pointers on a GPU
// machine, nothing would stop its launch.)
TEST(ApiValidation, PointersUncheckedKeepsTheOtherChecks) {
  expect_refused_as_unsupported("qattn_fwd_pointers_unchecked", [](const qattn_fwd_params& p) {
    return qattn_fwd_pointers_unchecked(&p, fake(6), 1 << 30, nullptr);
  });
  qattn_fwd_params p = valid_params();
  EXPECT_EQ(qattn_fwd_pointers_unchecked(&p, fake(6), 0, nullptr), QATTN_ERROR_WORKSPACE_TOO_SMALL);
}

// ---- a valid call with no usable device launches nothing ---------------------------

// Host buffers stand in for device memory: a valid call must stop at the device
// check (no GPU, a CPU-only build, or "host memory" on a GPU machine) and leave the
// poisoned output and workspace as they were.
TEST(ApiValidation, ValidCallWithoutDeviceWritesNothing) {
  Shape s;
  s.batch = 1;
  s.seqlen_q = 64;
  s.seqlen_kv = 64;
  const std::size_t n = std::size_t{1} * s.heads_q * 64 * 64;
  struct alignas(256) Block {
    unsigned char b[256];
  };
  auto blocks = [](std::size_t bytes) { return std::vector<Block>((bytes + 255) / 256); };
  auto q = blocks(n * 2), k = blocks(n * 2), v = blocks(n * 2), o = blocks(n * 2),
       lse = blocks(std::size_t{8} * 64 * 4);
  qattn::ForwardParams fp(qattn::DType::kFP16, 1, s.heads_q, s.heads_kv, 64, 64, 64);
  fp.q(q.data(), qattn::Layout::kNHD).k(k.data(), qattn::Layout::kNHD);
  fp.v(v.data(), qattn::Layout::kNHD).o(o.data(), qattn::Layout::kNHD);
  fp.lse(reinterpret_cast<float*>(lse.data()));
  std::size_t ws_bytes = 0;
  ASSERT_TRUE(qattn::workspace_size(fp, &ws_bytes).ok());
  auto ws = blocks(ws_bytes);
  for (auto* buf : {&o, &lse, &ws}) std::memset(buf->data(), 0xAB, buf->size() * sizeof(Block));

  const qattn::Status st = qattn::forward(fp, ws.data(), ws_bytes, nullptr);
  ASSERT_FALSE(st.ok());
  if (st.code() == qattn::StatusCode::kInvalidArgument)
    EXPECT_NE(st.message().find("host memory"), std::string::npos) << st.message();
  else if (st.code() != qattn::StatusCode::kUnsupported)
    EXPECT_EQ(st.code(), qattn::StatusCode::kNoDevice) << st.message();
  if (!qattn::built_with_cuda()) {
    EXPECT_EQ(st.code(), qattn::StatusCode::kNoDevice);
    EXPECT_NE(st.message().find("no CUDA kernels"), std::string::npos) << st.message();
  }
  for (auto* buf : {&o, &lse, &ws})
    for (const Block& blk : *buf)
      for (unsigned char c : blk.b) ASSERT_EQ(c, 0xAB);
}

TEST(ApiValidation, DeviceQueriesNeverFail) {
  EXPECT_EQ(qattn_built_with_cuda(), QATTN_HAVE_CUDA);
  const int supported = qattn_device_supported(-1);
  EXPECT_TRUE(supported == 0 || supported == 1);
  EXPECT_EQ(qattn_device_supported(1 << 20), 0);
  if (!QATTN_HAVE_CUDA) EXPECT_EQ(supported, 0);
}

// ---- messages ----------------------------------------------------------------------

TEST(ApiValidation, LastErrorIsPerThreadAndKeptUntilTheNextFailure) {
  qattn_fwd_params p = valid_params();
  p.causal = 9;
  ASSERT_NE(size_of(p).status, QATTN_OK);
  const std::string mine = qattn_last_error_message();
  EXPECT_NE(mine.find("qattn_fwd_workspace_size: causal = 9"), std::string::npos) << mine;

  std::string other;
  std::thread([&] { other = qattn_last_error_message(); }).join();
  EXPECT_EQ(other, "");

  EXPECT_EQ(size_of(valid_params()).status, QATTN_OK);  // success keeps the last failure
  EXPECT_EQ(mine, qattn_last_error_message());
}

TEST(ApiValidation, StatusStringsAndVersion) {
  EXPECT_STREQ(qattn_status_string(QATTN_OK), "QATTN_OK");
  EXPECT_STREQ(qattn_status_string(QATTN_ERROR_UNSUPPORTED), "QATTN_ERROR_UNSUPPORTED");
  EXPECT_STREQ(qattn_status_string(static_cast<qattn_status>(99)), "QATTN_ERROR_UNKNOWN");
  EXPECT_EQ(std::string(qattn_version_string()), std::to_string(QATTN_VERSION_MAJOR) + "." +
                                                     std::to_string(QATTN_VERSION_MINOR) + "." +
                                                     std::to_string(QATTN_VERSION_PATCH));
}

// ---- the bytes a call touches (what the device side checks against allocations) -----

TEST(ApiSpans, ContiguousViewsSpanTheWholeTensor) {
  for (auto layout : {qattn::Layout::kHND, qattn::Layout::kNHD}) {
    const qattn_tensor t = qattn::make_tensor(fake(1), layout, 3, 5, 64);
    EXPECT_EQ(qattn::api::view_span_bytes(t, 2, 3, 5, 64), std::size_t{2} * 3 * 5 * 64 * 2);
  }
}

// A padded row stride counts only up to head_dim in the last row: the padding after it
// need not be allocated.
TEST(ApiSpans, PaddedRowsEndAtTheLastElement) {
  const qattn_tensor hnd = qattn::make_tensor(fake(1), qattn::Layout::kHND, 3, 5, 72);
  EXPECT_EQ(qattn::api::view_span_bytes(hnd, 2, 3, 5, 64), ((2 * 3 * 5 - 1) * 72 + 64) * 2u);
  const qattn_tensor nhd = qattn::make_tensor(fake(1), qattn::Layout::kNHD, 3, 5, 104);
  EXPECT_EQ(qattn::api::view_span_bytes(nhd, 2, 3, 5, 100), ((2 * 3 * 5 - 1) * 104 + 100) * 2u);
}

TEST(ApiSpans, StrideOfExtentOneDoesNotCount) {
  const qattn_tensor t{fake(1), /*stride_b=*/-3, /*stride_h=*/1 << 30, /*stride_n=*/64};
  EXPECT_EQ(qattn::api::view_span_bytes(t, 1, 1, 10, 64), 10 * 64 * 2u);
  EXPECT_EQ(qattn::api::view_span_bytes(t, 1, 1, 1, 7), 7 * 2u);
}

// Strides need not be ordered: the span ends at the element with the largest offset.
TEST(ApiSpans, UnorderedStrides) {
  const qattn_tensor t{fake(1), /*stride_b=*/64, /*stride_h=*/128, /*stride_n=*/1024};
  EXPECT_EQ(qattn::api::view_span_bytes(t, 2, 8, 4, 64), (64 + 7 * 128 + 3 * 1024 + 64) * 2u);
}

TEST(ApiSpans, EveryBufferOfACall) {
  const Shape s;
  const qattn_fwd_params p = valid_params(s);
  const auto spans = qattn::api::buffer_spans(p, fake(6));
  const std::size_t q_bytes = std::size_t{2} * s.batch * s.heads_q * s.seqlen_q * s.head_dim;
  const std::size_t kv_bytes = std::size_t{2} * s.batch * s.heads_kv * s.seqlen_kv * s.head_dim;
  const std::size_t lse_bytes = std::size_t{4} * s.batch * s.heads_q * s.seqlen_q;
  const std::array<std::tuple<const char*, const void*, std::size_t>, 11> want{{
      {"q.data", fake(1), q_bytes},
      {"k.data", fake(2), kv_bytes},
      {"v.data", fake(3), kv_bytes},
      {"kv_lengths", nullptr, 0},  // absent here
      {"attn_mask", nullptr, 0},   // and here
      {"cu_seqlens_q", nullptr, 0},  // not a packed batch (test_api_varlen_validation.cpp)
      {"cu_seqlens_k", nullptr, 0},
      {"o.data", fake(4), q_bytes},
      {"lse", fake(5), lse_bytes},
      {"p_max", nullptr, 0},  // not asked for
      {"workspace", fake(6), need(p)},  // what the call uses, not what the caller passed
  }};
  for (std::size_t i = 0; i < spans.size(); ++i) {
    SCOPED_TRACE(std::get<0>(want[i]));
    EXPECT_STREQ(spans[i].name, std::get<0>(want[i]));
    EXPECT_EQ(spans[i].data, std::get<1>(want[i]));
    EXPECT_EQ(spans[i].bytes, std::get<2>(want[i]));
  }
  ASSERT_EQ(spans.size(), want.size());
  qattn_fwd_params no_lse = p;
  no_lse.lse = nullptr;
  const auto without = qattn::api::buffer_spans(no_lse, fake(6));
  EXPECT_STREQ(without[8].name, "lse");
  EXPECT_EQ(without[8].data, nullptr);
  EXPECT_EQ(without[8].bytes, 0u);
  // P's row maxima: (B, Hq, Nq) floats, as the LSE.
  qattn_fwd_params with_p_max = p;
  with_p_max.p_max = static_cast<float*>(fake(9));
  const auto p_max_spans = qattn::api::buffer_spans(with_p_max, fake(6));
  EXPECT_STREQ(p_max_spans[9].name, "p_max");
  EXPECT_EQ(p_max_spans[9].data, fake(9));
  EXPECT_EQ(p_max_spans[9].bytes, lse_bytes);
  // Key-padding lengths: batch int32, checked on the device like every other buffer.
  qattn_fwd_params padded = p;
  padded.kv_lengths = static_cast<const int32_t*>(fake(7));
  const auto with = qattn::api::buffer_spans(padded, fake(6));
  EXPECT_STREQ(with[3].name, "kv_lengths");
  EXPECT_EQ(with[3].data, fake(7));
  EXPECT_EQ(with[3].bytes, std::size_t{4} * s.batch);
  // A boolean attn_mask: from its pointer to its last byte, broadcast dimensions (stride
  // 0) adding nothing; here (B, 1, Nq, Nkv) with rows of Nkv + 12 bytes.
  qattn_fwd_params masked = p;
  masked.attn_mask_type = QATTN_MASK_BOOL;
  masked.attn_mask = fake(8);
  masked.attn_mask_stride_k = 1;
  masked.attn_mask_stride_q = s.seqlen_kv + 12;
  masked.attn_mask_stride_b = int64_t{s.seqlen_q} * (s.seqlen_kv + 12);
  const auto with_mask = qattn::api::buffer_spans(masked, fake(6));
  EXPECT_STREQ(with_mask[4].name, "attn_mask");
  EXPECT_EQ(with_mask[4].data, fake(8));
  EXPECT_EQ(with_mask[4].bytes,
            std::size_t(s.batch * s.seqlen_q - 1) * (s.seqlen_kv + 12) + s.seqlen_kv);
}

// ---- the C++ layer -----------------------------------------------------------------

TEST(ApiCpp, LayoutsGiveTheRightStrides) {
  const qattn_tensor hnd = qattn::make_tensor(fake(1), qattn::Layout::kHND, 8, 300, 64);
  EXPECT_EQ(hnd.stride_n, 64);
  EXPECT_EQ(hnd.stride_h, 300 * 64);
  EXPECT_EQ(hnd.stride_b, 8 * 300 * 64);
  const qattn_tensor nhd = qattn::make_tensor(fake(1), qattn::Layout::kNHD, 8, 300, 64);
  EXPECT_EQ(nhd.stride_h, 64);
  EXPECT_EQ(nhd.stride_n, 8 * 64);
  EXPECT_EQ(nhd.stride_b, 300 * 8 * 64);
}

TEST(ApiCpp, StatusAndError) {
  qattn::ForwardParams fp(qattn::DType::kBF16, 1, 4, 3, 16, 16, 64);
  std::size_t bytes = 0;
  const qattn::Status st = qattn::workspace_size(fp, &bytes);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(static_cast<bool>(st));
  EXPECT_EQ(st.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("heads_q"), std::string::npos);
  EXPECT_STREQ(st.code_name(), "QATTN_ERROR_INVALID_ARGUMENT");
  try {
    st.throw_if_error();
    FAIL() << "no exception";
  } catch (const qattn::Error& e) {
    EXPECT_EQ(e.code(), qattn::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("heads_kv"), std::string::npos);
  }
  EXPECT_NO_THROW(qattn::Status().throw_if_error());
}

TEST(ApiCpp, BuilderSetsEveryField) {
  qattn::ForwardParams fp(qattn::DType::kFP16, 2, 8, 4, 100, 200, 128);
  fp.causal(true).sm_scale(0.5f).granularity(qattn::Granularity::kPerBlock);
  fp.lse(static_cast<float*>(fake(5)));
  const qattn_fwd_params& p = fp.raw();
  EXPECT_EQ(p.dtype, QATTN_DTYPE_FP16);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.heads_q, 8);
  EXPECT_EQ(p.heads_kv, 4);
  EXPECT_EQ(p.seqlen_q, 100);
  EXPECT_EQ(p.seqlen_kv, 200);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_EQ(p.causal, 1);
  EXPECT_EQ(p.sm_scale, 0.5f);
  EXPECT_EQ(p.sage2.granularity, QATTN_QK_PER_BLOCK);
  EXPECT_EQ(p.lse, fake(5));
  EXPECT_EQ(p.scheme, QATTN_SCHEME_SAGE2_8B);  // precision "fast" by default
  fp.precision(qattn::Precision::kAuto);
  EXPECT_EQ(p.scheme, QATTN_SCHEME_SAGE2_8B_AUTO);
  fp.precision(qattn::Precision::kPrecise);
  EXPECT_EQ(p.scheme, QATTN_SCHEME_PRECISE16);
  fp.precision(qattn::Precision::kFast);
  EXPECT_EQ(p.scheme, QATTN_SCHEME_SAGE2_8B);
  // Masks beyond causal: unset by default, each setter fills its fields.
  EXPECT_EQ(p.window, 0);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.kv_lengths, nullptr);
  EXPECT_EQ(p.alignment, QATTN_ALIGN_BOTTOM_RIGHT);
  fp.window(64, -1).kv_lengths(static_cast<const int32_t*>(fake(6))).alignment(
      qattn::Alignment::kTopLeft);
  EXPECT_EQ(p.window, 1);
  EXPECT_EQ(p.window_left, 64);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.kv_lengths, fake(6));
  EXPECT_EQ(p.alignment, QATTN_ALIGN_TOP_LEFT);
  EXPECT_EQ(p.attn_mask_type, QATTN_MASK_NONE);
  fp.bool_mask(fake(7), 0, 0, 512, 1);
  EXPECT_EQ(p.attn_mask_type, QATTN_MASK_BOOL);
  EXPECT_EQ(p.attn_mask, fake(7));
  EXPECT_EQ(p.attn_mask_stride_b, 0);
  EXPECT_EQ(p.attn_mask_stride_h, 0);
  EXPECT_EQ(p.attn_mask_stride_q, 512);
  EXPECT_EQ(p.attn_mask_stride_k, 1);
  fp.bool_mask(nullptr, 0, 0, 0, 0);
  EXPECT_EQ(p.attn_mask_type, QATTN_MASK_NONE);
  // P's row maxima: not written by default.
  EXPECT_EQ(p.p_max, nullptr);
  fp.p_max(static_cast<float*>(fake(9)));
  EXPECT_EQ(p.p_max, fake(9));
  EXPECT_EQ(p.reserved3, 0);
  EXPECT_EQ(p.reserved4, 0);
}

}  // namespace

namespace {

// The sage2 kernel numbers its work items (128-row query blocks of every head) in an
// int: a family limit, so the call is unsupported (another family could run it).
TEST(ApiValidation, TooManyQueryBlocksIsRejected) {
  Shape s;
  s.batch = 1024;
  s.heads_q = s.heads_kv = 1024;
  s.seqlen_q = 1 << 20;
  EXPECT_REJECTS(size_of(valid_params(s)), QATTN_ERROR_UNSUPPORTED, "sage2_fwd_sm90",
                 "ceil(seqlen_q / 128)", "2^31");
}

}  // namespace

// The SageAttention3 NVFP4 family: head dims 64 and 128, no mask or causal aligned
// bottom-right; everything else is declined by name before anything runs, and its
// workspace is its own layout's size.
TEST(ApiValidation, Sage3Nvfp4Scheme) {
  for (int d : {64, 128}) {
    qattn_fwd_params p = valid_params({.head_dim = d});
    p.scheme = QATTN_SCHEME_SAGE3_NVFP4;
    EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
    p.causal = 1;  // bottom-right (the default alignment)
    EXPECT_EQ(size_of(p).status, QATTN_OK) << size_of(p).message;
    EXPECT_EQ(need(p), qattn::sage3::workspace_layout(p).total);
  }
  for (int d : {16, 96, 80}) {
    qattn_fwd_params p = valid_params({.head_dim = d});
    p.scheme = QATTN_SCHEME_SAGE3_NVFP4;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "sage3_nvfp4_fwd_sm90", "head_dim");
  }
  {
    qattn_fwd_params p = valid_params({.head_dim = 128});
    p.scheme = QATTN_SCHEME_SAGE3_NVFP4;
    p.causal = 1;
    p.alignment = QATTN_ALIGN_TOP_LEFT;  // seqlen_q 300 != seqlen_kv 500: it matters
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "sage3_nvfp4_fwd_sm90");
  }
  {
    qattn_fwd_params p = valid_params({.head_dim = 128});
    p.scheme = QATTN_SCHEME_SAGE3_NVFP4;
    p.window = 1;
    p.window_left = 64;
    p.window_right = 0;
    EXPECT_REJECTS(size_of(p), QATTN_ERROR_UNSUPPORTED, "sage3_nvfp4_fwd_sm90");
  }
}
