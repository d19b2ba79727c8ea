// The kernel-family registry and the growable ABI, without a GPU: which family runs a
// call on a given architecture (a fake compute capability stands in for the device),
// the message of an unsupported call naming every family and its reason, the
// workspace size over families, qattn_fwd_params' struct_size rule, the C++ builder's
// overflow report, and validation from many threads at once.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <thread>
#include <vector>

#include "api/family.h"
#include "api/registry.h"
#include "api/validate.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"
#include "api_outcome.h"

namespace {

using qattn::api::Arch;
using qattn::api::ForwardFamily;

using qattn::test::fake;

qattn_fwd_params valid_params(int head_dim = 64) {
  qattn::ForwardParams fp(qattn::DType::kBF16, 2, 8, 2, 300, 500, head_dim);
  const int64_t row = (head_dim + 7) / 8 * 8;
  fp.q(fake(1), qattn::Layout::kHND, row)
      .k(fake(2), qattn::Layout::kHND, row)
      .v(fake(3), qattn::Layout::kHND, row)
      .o(fake(4), qattn::Layout::kHND, row);
  return fp.raw();
}

bool contains(const std::string& s, const std::string& word) {
  return s.find(word) != std::string::npos;
}

// Made-up families for the p_max tests below (the registry's logic section has more).
constexpr std::array<Arch, 1> kSm80Only{{{8, 0}}};
std::size_t ws_2k(const qattn_fwd_params&) { return 2048; }
std::size_t ws_4k_no_p_max(const qattn_fwd_params&) { return 4096; }
constexpr ForwardFamily kNoPMax{"fake_no_p_max", QATTN_SCHEME_SAGE2_8B, kSm80Only, 1, 256, ~0u,
                                ~0u, false, false, nullptr, &ws_4k_no_p_max, nullptr};

// ---- the registry with this build's families, on fake devices ----------------------

TEST(Registry, HopperRunsTheSage2Family) {
  qattn_status s = QATTN_ERROR_INTERNAL;
  const Arch hopper{9, 0};
  const ForwardFamily* f = qattn::api::select_family("t", valid_params(), &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_EQ(s, QATTN_OK);
  EXPECT_STREQ(f->name, "sage2_fwd_sm90");
  // The launch exists exactly when the kernels are built.
  EXPECT_EQ(f->launch != nullptr, QATTN_HAVE_CUDA != 0);
}

// The non-Hopper path: an Ampere (8.0), an Ada (8.9), a Blackwell (10.0, 12.0) device.
TEST(Registry, NonHopperDeviceIsUnsupportedNamingEveryFamily) {
  for (Arch arch : {Arch{8, 0}, Arch{8, 9}, Arch{9, 1}, Arch{10, 0}, Arch{12, 0}}) {
    SCOPED_TRACE(std::to_string(arch.major) + "." + std::to_string(arch.minor));
    qattn_status s = QATTN_OK;
    EXPECT_EQ(qattn::api::select_family("qattn_fwd", valid_params(), &arch, &s), nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    const std::string m = qattn_last_error_message();
    const std::string cc = std::to_string(arch.major) + "." + std::to_string(arch.minor);
    for (const char* w : {"qattn_fwd: no kernel family runs this call", "considered 5",
                          "sage2_fwd_sm90", "sage2_wide_sm90", "sage3_nvfp4_fwd_sm90",
                          "precise16_fwd_sm90",
                          "sage2_auto_sm90",
                          "its kernels run on sm_90"})
      EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
    EXPECT_TRUE(contains(m, "compute capability " + cc)) << m;
    EXPECT_TRUE(contains(m, "device sm_" + std::to_string(arch.major) + std::to_string(arch.minor)))
        << m;
    // No family's internals (the old message named SageAttention2 and sm_90 as a demand).
    EXPECT_FALSE(contains(m, "SageAttention2")) << m;
  }
}

// V narrower than Q·K (head_dim_v < head_dim, MLA's 192 / 128): both SageAttention2-8b
// families take it, the others and a packed batch decline it by name, and a wider V is
// refused everywhere.
TEST(Registry, NarrowerVRunsOnTheSage2FamiliesOnly) {
  const Arch hopper{9, 0};
  for (auto [d, dv, family] : {std::tuple{192, 128, "sage2_wide_sm90"}, std::tuple{128, 64, "sage2_fwd_sm90"},
                               std::tuple{96, 1, "sage2_fwd_sm90"}, std::tuple{256, 255, "sage2_wide_sm90"}}) {
    SCOPED_TRACE(std::to_string(d) + "/" + std::to_string(dv));
    qattn_fwd_params p = valid_params(d);
    p.head_dim_v = dv;
    qattn_status s = QATTN_ERROR_INTERNAL;
    const ForwardFamily* f = qattn::api::select_family("t", p, &hopper, &s);
    ASSERT_NE(f, nullptr) << qattn_last_error_message();
    EXPECT_STREQ(f->name, family);
  }
  {
    qattn_fwd_params p = valid_params(128);
    p.head_dim_v = 64;
    p.scheme = QATTN_SCHEME_PRECISE16;
    qattn_status s = QATTN_OK;
    EXPECT_EQ(qattn::api::select_family("t", p, &hopper, &s), nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    const std::string m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, "head_dim_v = 64, head_dim = 128")) << m;
    EXPECT_TRUE(contains(m, "head_dim_v 64")) << m;  // the call's description
  }
  {
    qattn_fwd_params p = valid_params(64);
    p.head_dim_v = 128;  // wider than Q·K
    qattn_status s = QATTN_OK;
    EXPECT_EQ(qattn::api::select_family("t", p, &hopper, &s), nullptr);
    EXPECT_TRUE(contains(qattn_last_error_message(), "head_dim's channels or fewer only"))
        << qattn_last_error_message();
  }
}

// P's row maxima (p_max): the SageAttention2-8b family writes them outside a packed
// batch; every other family, and a packed batch, declines the call by name, on any
// device and through qattn_fwd_workspace_size alike.
TEST(Registry, PMaxIsWrittenBySage2OutsideAPackedBatchOnly) {
  const Arch hopper{9, 0};
  for (bool causal : {false, true}) {
    qattn_fwd_params p = valid_params(128);
    p.causal = causal ? 1 : 0;
    p.p_max = static_cast<float*>(fake(9));
    qattn_status s = QATTN_ERROR_INTERNAL;
    const ForwardFamily* f = qattn::api::select_family("t", p, &hopper, &s);
    ASSERT_NE(f, nullptr) << qattn_last_error_message();
    EXPECT_STREQ(f->name, "sage2_fwd_sm90");
    EXPECT_TRUE(f->writes_p_max);
    // p_max needs no workspace of its own: the size is the one without it.
    qattn_fwd_params without = p;
    without.p_max = nullptr;
    std::size_t with_bytes = 1, without_bytes = 0;
    ASSERT_EQ(qattn_fwd_workspace_size(&p, &with_bytes), QATTN_OK) << qattn_last_error_message();
    ASSERT_EQ(qattn_fwd_workspace_size(&without, &without_bytes), QATTN_OK);
    EXPECT_EQ(with_bytes, without_bytes);
  }
  // Only sage2_fwd_sm90 declares it.
  for (const ForwardFamily* f : qattn::api::forward_families())
    EXPECT_EQ(f->writes_p_max, std::string(f->name) == "sage2_fwd_sm90") << f->name;

  struct Case {
    const char* what;
    void (*change)(qattn_fwd_params&);
    std::vector<std::string> words;  // in the message, besides the entry point
  };
  const Case cases[] = {
      {"precise", [](qattn_fwd_params& p) { p.scheme = QATTN_SCHEME_PRECISE16; },
       {"precise16_fwd_sm90: does not write P's row maxima (p_max)", "scheme 2", "p_max written"}},
      {"auto", [](qattn_fwd_params& p) { p.scheme = QATTN_SCHEME_SAGE2_8B_AUTO; },
       {"sage2_auto_sm90: does not write P's row maxima (p_max)", "scheme 3"}},
      {"sa3", [](qattn_fwd_params& p) { p.scheme = QATTN_SCHEME_SAGE3_NVFP4; },
       {"sage3_nvfp4_fwd_sm90: does not write P's row maxima (p_max)", "scheme 1"}},
      {"head dim 192", [](qattn_fwd_params&) {},
       {"sage2_wide_sm90: does not write P's row maxima (p_max)",
        "sage2_fwd_sm90: head_dim = 192"}},
      {"packed batch",
       [](qattn_fwd_params& p) {
         p.cu_seqlens_q = static_cast<const int32_t*>(fake(10));
         p.cu_seqlens_k = static_cast<const int32_t*>(fake(11));
         p.max_seqlen_q = p.seqlen_q;
         p.max_seqlen_k = p.seqlen_kv;
       },
       {"sage2_fwd_sm90: writes P's row maxima (p_max) outside a packed batch only",
        "packed variable-length batch"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    qattn_fwd_params p = valid_params(std::string_view(c.what) == "head dim 192" ? 192 : 128);
    c.change(p);
    p.p_max = static_cast<float*>(fake(9));
    qattn_status s = QATTN_OK;
    EXPECT_EQ(qattn::api::select_family("f", p, &hopper, &s), nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    std::string m = qattn_last_error_message();
    for (const std::string& w : c.words) EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
    std::size_t bytes = 0;
    EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_UNSUPPORTED);
    m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, "qattn_fwd_workspace_size: no kernel family runs this call")) << m;
    for (const std::string& w : c.words) EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;
    EXPECT_EQ(qattn_fwd(&p, fake(12), 1 << 30, nullptr), QATTN_ERROR_UNSUPPORTED);
    EXPECT_TRUE(contains(qattn_last_error_message(), c.words.front())) << qattn_last_error_message();
    // The same call without p_max runs (the packed one on the packed-batch family).
    p.p_max = nullptr;
    EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  }
}

// A made-up family that writes p_max is chosen over one that does not only for a call
// that asks for it.
TEST(Registry, PMaxPicksAFamilyThatWritesIt) {
  constexpr ForwardFamily kWrites{"fake_writes_p_max", QATTN_SCHEME_SAGE2_8B, kSm80Only, 1, 256,
                                  ~0u, ~0u, false, true, nullptr, &ws_2k, nullptr};
  const std::array<const ForwardFamily*, 2> families{&kNoPMax, &kWrites};
  qattn_fwd_params p = valid_params();
  const Arch sm80{8, 0};
  qattn_status s = QATTN_ERROR_INTERNAL;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), &kNoPMax);
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 4096u);  // both accept
  p.p_max = static_cast<float*>(fake(9));
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), &kWrites);
  EXPECT_EQ(s, QATTN_OK);
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 2048u);  // only the writer's
  const std::array<const ForwardFamily*, 1> none{&kNoPMax};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, none), nullptr);
  EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
  EXPECT_TRUE(contains(qattn_last_error_message(),
                       "fake_no_p_max: does not write P's row maxima (p_max)"))
      << qattn_last_error_message();
}

// Head dims 129..256 run on the head-dim-256 family (sage2_wide_sm90); above 256 no
// family runs the call, and the message names each family's range.
TEST(Registry, HeadDimsUpTo256RunOnTheWideFamily) {
  for (int d : {129, 136, 192, 256}) {
    SCOPED_TRACE(d);
    qattn_status s = QATTN_ERROR_INTERNAL;
    const Arch hopper{9, 0};
    const ForwardFamily* f = qattn::api::select_family("t", valid_params(d), &hopper, &s);
    ASSERT_NE(f, nullptr) << qattn_last_error_message();
    EXPECT_EQ(s, QATTN_OK);
    EXPECT_STREQ(f->name, "sage2_wide_sm90");
    EXPECT_EQ(f->launch != nullptr, QATTN_HAVE_CUDA != 0);
    // Its workspace: INT8 Q, K and Vᵀ rows of 256 bytes.
    std::size_t bytes = 0;
    qattn_fwd_params p = valid_params(d);
    ASSERT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
    EXPECT_GE(bytes, std::size_t{2} * 8 * 384 * 256 + 2 * std::size_t{2} * 2 * 512 * 256);
  }
  // What it does not run is refused by name: a boolean attn_mask, a packed batch.
  {
    qattn_fwd_params p = valid_params(256);
    p.attn_mask_type = QATTN_MASK_BOOL;
    p.attn_mask = fake(5);
    p.attn_mask_stride_q = 512;
    p.attn_mask_stride_k = 1;
    const Arch hopper{9, 0};
    qattn_status s = QATTN_OK;
    EXPECT_EQ(qattn::api::select_family("f", p, &hopper, &s), nullptr);
    const std::string m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, "sage2_wide_sm90: has no attn_mask kernel")) << m;
  }
}

TEST(Registry, HeadDimBeyondEveryFamilyIsUnsupportedOnAnyDevice) {
  for (int d : {257, 320}) {
    qattn_status s = QATTN_OK;
    const Arch hopper{9, 0};
    EXPECT_EQ(qattn::api::select_family("f", valid_params(d), &hopper, &s), nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    std::string m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, "sage2_fwd_sm90: head_dim = " + std::to_string(d))) << m;
    EXPECT_TRUE(contains(m, "1..128")) << m;
    EXPECT_TRUE(contains(m, "sage2_wide_sm90: head_dim = " + std::to_string(d))) << m;
    EXPECT_TRUE(contains(m, "129..256")) << m;
    // Through the C ABI without a device (workspace size): the same reason.
    std::size_t bytes = 0;
    qattn_fwd_params p = valid_params(d);
    EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_UNSUPPORTED);
    m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, "qattn_fwd_workspace_size: no kernel family")) << m;
    EXPECT_TRUE(contains(m, "(any device)")) << m;
    EXPECT_TRUE(contains(m, "sage2_wide_sm90: head_dim")) << m;
  }
}

TEST(Registry, DeviceSupportFollowsTheFamilies) {
  EXPECT_EQ(qattn::api::arch_supported({9, 0}), QATTN_HAVE_CUDA != 0);
  EXPECT_FALSE(qattn::api::arch_supported({8, 0}));
  EXPECT_FALSE(qattn::api::arch_supported({10, 0}));
}

// ---- the registry's logic, on families made up here --------------------------------

constexpr std::array<Arch, 1> kSm80{{{8, 0}}};
constexpr std::array<Arch, 2> kSm90And100{{{9, 0}, {10, 0}}};

std::string too_long(const qattn_fwd_params& p) {
  return p.seqlen_kv > 256 ? "seqlen_kv above 256" : "";
}
std::size_t ws_1k(const qattn_fwd_params&) { return 1024; }
std::size_t ws_4k(const qattn_fwd_params&) { return 4096; }

constexpr ForwardFamily kFp16Only{"fake_fp16_sm80", QATTN_SCHEME_SAGE2_8B, kSm80, 1, 256,
                                  1u << QATTN_DTYPE_FP16, qattn::api::kMaskNone, false, false,
                                  nullptr, &ws_1k, nullptr};
constexpr ForwardFamily kShortKv{"fake_short_kv",
                                 QATTN_SCHEME_SAGE2_8B,
                                 kSm90And100,
                                 64,
                                 64,
                                 (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
                                 qattn::api::kMaskNone | qattn::api::kMaskCausal,
                                 false,
                                 false,
                                 &too_long,
                                 &ws_4k,
                                 nullptr};
constexpr ForwardFamily kOtherScheme{"fake_other_scheme", 7, kSm80, 1, 512, ~0u, ~0u, false,
                                     false, nullptr, &ws_1k, nullptr};

TEST(Registry, EveryDeclineReasonIsNamed) {
  const std::array<const ForwardFamily*, 3> families{&kFp16Only, &kShortKv, &kOtherScheme};
  qattn_fwd_params p = valid_params();  // bf16, d = 64, seqlen_kv = 500, no mask
  p.causal = 1;
  const Arch sm80{8, 0};
  qattn_status s = QATTN_OK;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), nullptr);
  EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
  const std::string m = qattn_last_error_message();
  for (const char* w : {"considered 3", "fake_fp16_sm80: does not read bf16 inputs",
                        "fake_short_kv: the device has compute capability 8.0; its kernels run "
                        "on sm_90, sm_100",
                        "fake_other_scheme: implements scheme 7, not 0", "causal"})
    EXPECT_TRUE(contains(m, w)) << "no '" << w << "' in: " << m;

  // On sm_90 the short-KV family gets past the table and declines by its own limit.
  const Arch sm90{9, 0};
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, families), nullptr);
  EXPECT_TRUE(contains(qattn_last_error_message(), "fake_short_kv: seqlen_kv above 256"))
      << qattn_last_error_message();
  // Masks: the fp16 family has no causal kernel.
  p.dtype = QATTN_DTYPE_FP16;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), nullptr);
  EXPECT_TRUE(contains(qattn_last_error_message(), "fake_fp16_sm80: has no causal kernel"))
      << qattn_last_error_message();
  // And it runs the unmasked call on its architecture: the first that accepts wins.
  p.causal = 0;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm80, &s, families), &kFp16Only);
  EXPECT_EQ(s, QATTN_OK);
  p.seqlen_kv = 128;
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, families), &kShortKv);
  // No families at all.
  EXPECT_EQ(qattn::api::select_family("f", p, &sm90, &s, {}), nullptr);
  EXPECT_TRUE(contains(qattn_last_error_message(), "considered 0")) << qattn_last_error_message();
}

// The masks beyond causal: the sage2 family declares all of them; a family that lacks
// one declines a call that uses it, naming the feature.
TEST(Registry, Sage2RunsEveryMask) {
  const Arch hopper{9, 0};
  qattn_fwd_params p = valid_params();  // seqlen_q 300 != seqlen_kv 500
  p.causal = 1;
  p.window = 1;
  p.window_left = 100;
  p.kv_lengths = static_cast<const int32_t*>(fake(7));
  p.alignment = QATTN_ALIGN_TOP_LEFT;
  qattn_status s = QATTN_ERROR_INTERNAL;
  const ForwardFamily* f = qattn::api::select_family("t", p, &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_STREQ(f->name, "sage2_fwd_sm90");
  for (uint32_t bit : {qattn::api::kMaskNone, qattn::api::kMaskCausal, qattn::api::kMaskWindow,
                       qattn::api::kMaskKeyPadding, qattn::api::kMaskTopLeft})
    EXPECT_NE(f->masks & bit, 0u) << bit;
}

// The 16-bit forward: chosen by its scheme alone, with the masks it declares, no
// workspace; an attn_mask with causal it declines by name.
TEST(Registry, PreciseSchemeRunsItsMasksWithoutWorkspace) {
  const Arch hopper{9, 0};
  qattn_fwd_params p = valid_params(100);  // padded inside to 128
  p.scheme = QATTN_SCHEME_PRECISE16;
  p.causal = 1;
  p.window = 1;
  p.window_left = 100;
  p.kv_lengths = static_cast<const int32_t*>(fake(7));
  p.alignment = QATTN_ALIGN_TOP_LEFT;
  qattn_status s = QATTN_ERROR_INTERNAL;
  const ForwardFamily* f = qattn::api::select_family("t", p, &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_STREQ(f->name, "precise16_fwd_sm90");
  EXPECT_EQ(f->launch != nullptr, QATTN_HAVE_CUDA != 0);
  std::size_t bytes = 1;
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(bytes, 0u);
  // A boolean attn_mask alone it runs; with causal it declines by name, as SA2-8b does.
  p.attn_mask_type = QATTN_MASK_BOOL;
  p.attn_mask = fake(8);
  p.causal = 0;
  p.window = 0;
  p.kv_lengths = nullptr;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(bytes, 0u);
  p.causal = 1;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_UNSUPPORTED);
  const std::string m = qattn_last_error_message();
  EXPECT_TRUE(contains(m, "precise16_fwd_sm90: takes an attn_mask alone")) << m;
  EXPECT_TRUE(contains(m, "scheme 2")) << m;
  // The other schemes' families decline it for its scheme, not run it.
  EXPECT_TRUE(contains(m, "implements scheme 0, not 2")) << m;
}

// Precision "auto": its family, with the SA2-8b workspace and the guard's maxima after
// it; the guard's rule is derived for per-thread groups, so other granularities are
// declined by name.
TEST(Registry, AutoSchemeRunsSage2ThenTheGuard) {
  const Arch hopper{9, 0};
  qattn_fwd_params p = valid_params();
  p.scheme = QATTN_SCHEME_SAGE2_8B_AUTO;
  p.causal = 1;
  qattn_status s = QATTN_ERROR_INTERNAL;
  const ForwardFamily* f = qattn::api::select_family("t", p, &hopper, &s);
  ASSERT_NE(f, nullptr) << qattn_last_error_message();
  EXPECT_STREQ(f->name, "sage2_auto_sm90");
  qattn_fwd_params fast = p;
  fast.scheme = QATTN_SCHEME_SAGE2_8B;
  std::size_t auto_bytes = 0, fast_bytes = 0;
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &auto_bytes), QATTN_OK) << qattn_last_error_message();
  ASSERT_EQ(qattn_fwd_workspace_size(&fast, &fast_bytes), QATTN_OK);
  // (B·Hq + B·Hkv) FP32 pairs, each array 256-aligned: 2·8·2·4 = 128 -> 256, 2·2·2·4 -> 256.
  EXPECT_EQ(auto_bytes, (fast_bytes + 255) / 256 * 256 + 512);
  p.sage2.granularity = QATTN_QK_PER_WARP;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &auto_bytes), QATTN_ERROR_UNSUPPORTED);
  EXPECT_TRUE(contains(qattn_last_error_message(), "QATTN_QK_PER_THREAD")) << qattn_last_error_message();
}

constexpr ForwardFamily kCausalOnly{"fake_causal_only",
                                    QATTN_SCHEME_SAGE2_8B,
                                    kSm90And100,
                                    1,
                                    128,
                                    (1u << QATTN_DTYPE_FP16) | (1u << QATTN_DTYPE_BF16),
                                    qattn::api::kMaskNone | qattn::api::kMaskCausal,
                                    false,
                                    false,
                                    nullptr,
                                    &ws_1k,
                                    nullptr};

TEST(Registry, MasksBeyondCausalAreDeclinedByName) {
  const std::array<const ForwardFamily*, 1> families{&kCausalOnly};
  const Arch sm90{9, 0};
  struct Case {
    const char* what;
    void (*change)(qattn_fwd_params&);
    const char* reason;  // "" = accepted
    const char* described;
  };
  const Case cases[] = {
      {"a left window",
       [](qattn_fwd_params& p) {
         p.window = 1;
         p.window_left = 64;
       },
       "fake_causal_only: has no sliding-window kernel (window_left = 64, window_right = -1)",
       "window (64, -1)"},
      {"a right window without causal",
       [](qattn_fwd_params& p) {
         p.window = 1;
         p.window_right = 0;
       },
       "fake_causal_only: has no sliding-window kernel (window_left = -1, window_right = 0)",
       "no mask, window (-1, 0)"},
      {"key padding",
       [](qattn_fwd_params& p) { p.kv_lengths = static_cast<const int32_t*>(fake(7)); },
       "fake_causal_only: has no key-padding kernel (kv_lengths is set)", "key padding"},
      {"top-left causal with seqlen_q != seqlen_kv",
       [](qattn_fwd_params& p) {
         p.causal = 1;
         p.alignment = QATTN_ALIGN_TOP_LEFT;
       },
       "fake_causal_only: has no top-left aligned mask (alignment = QATTN_ALIGN_TOP_LEFT with "
       "seqlen_q = 300 != seqlen_kv = 500)",
       "causal, top-left"},
      // Where a field changes nothing, the call needs no feature beyond causal.
      {"a right window with causal (acts as 0)",
       [](qattn_fwd_params& p) {
         p.causal = 1;
         p.window = 1;
         p.window_right = 17;
       },
       "", ""},
      {"a window without bounds",
       [](qattn_fwd_params& p) {
         p.window = 1;
         p.window_left = p.window_right = -1;
       },
       "", ""},
      {"sides without the flag",
       [](qattn_fwd_params& p) {
         p.window = 0;
         p.window_left = p.window_right = 3;
       },
       "", ""},
      {"top-left without causal or window",
       [](qattn_fwd_params& p) { p.alignment = QATTN_ALIGN_TOP_LEFT; }, "", ""},
      {"top-left causal with seqlen_q == seqlen_kv",
       [](qattn_fwd_params& p) {
         p.causal = 1;
         p.alignment = QATTN_ALIGN_TOP_LEFT;
         p.seqlen_q = p.seqlen_kv;  // the registry reads no tensor: strides may stay
       },
       "", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    qattn_fwd_params p = valid_params();
    c.change(p);
    qattn_status s = QATTN_OK;
    const ForwardFamily* f = qattn::api::select_family("f", p, &sm90, &s, families);
    if (*c.reason == '\0') {
      EXPECT_EQ(f, &kCausalOnly) << qattn_last_error_message();
      EXPECT_EQ(s, QATTN_OK);
      continue;
    }
    EXPECT_EQ(f, nullptr);
    EXPECT_EQ(s, QATTN_ERROR_UNSUPPORTED);
    const std::string m = qattn_last_error_message();
    EXPECT_TRUE(contains(m, c.reason)) << m;
    EXPECT_TRUE(contains(m, c.described)) << m;  // the call, as the message describes it
    // No accepting family: the workspace size is 0, as for any declined call.
    EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 0u);
  }
}

// The workspace size holds on any device: the largest need of the families that accept
// the shape, whatever their architecture.
TEST(Registry, WorkspaceIsTheLargestOverAcceptingFamilies) {
  const std::array<const ForwardFamily*, 2> families{&kFp16Only, &kShortKv};
  qattn_fwd_params p = valid_params();
  p.dtype = QATTN_DTYPE_FP16;
  p.seqlen_kv = 128;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 4096u);  // both accept
  p.seqlen_kv = 500;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 1024u);  // only the fp16 one
  p.dtype = QATTN_DTYPE_BF16;
  EXPECT_EQ(qattn::api::workspace_bytes_for(p, families), 0u);  // none
}

// ---- struct_size: the ABI's growth rule --------------------------------------------

TEST(Abi, StructSizeIsChecked) {
  std::size_t bytes = 0;
  qattn_fwd_params p = valid_params();
  ASSERT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  const std::size_t want = bytes;

  p.struct_size = 0;  // a struct filled by hand without init
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(qattn_last_error_message(), "struct_size = 0")) << qattn_last_error_message();
  EXPECT_TRUE(contains(qattn_last_error_message(), "qattn_fwd_params_init"));
  p.struct_size = QATTN_FWD_PARAMS_MIN_SIZE - 1;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  // A size between two layouts ends inside a field (here half of kv_lengths): refused,
  // so no pointer is ever read in part.
  for (std::size_t size : {QATTN_FWD_PARAMS_MIN_SIZE + 4, offsetof(qattn_fwd_params, attn_mask) + 4,
                           offsetof(qattn_fwd_params, p_max) + 4, sizeof(qattn_fwd_params) - 4}) {
    p.struct_size = size;
    EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT) << size;
    EXPECT_TRUE(contains(qattn_last_error_message(), "ends inside a field"))
        << qattn_last_error_message();
  }

  // A caller compiled against a newer header (a larger struct) is refused, not misread.
  struct Newer {
    qattn_fwd_params base;
    int64_t field_from_the_future;
  } newer{};
  newer.base = valid_params();
  newer.base.struct_size = sizeof(Newer);
  newer.field_from_the_future = 1;
  EXPECT_EQ(qattn_fwd_workspace_size(&newer.base, &bytes), QATTN_ERROR_UNSUPPORTED);
  EXPECT_TRUE(contains(qattn_last_error_message(), "newer qattn.h")) << qattn_last_error_message();
  EXPECT_EQ(qattn_fwd(&newer.base, fake(6), 1 << 30, nullptr), QATTN_ERROR_UNSUPPORTED);

  // read_params copies the caller's prefix and keeps the defaults after it.
  p = valid_params();
  qattn_fwd_params full;
  std::memset(&full, 0x5A, sizeof(full));
  ASSERT_EQ(qattn::api::read_params("t", &p, &full), QATTN_OK);
  EXPECT_EQ(std::memcmp(&full, &p, sizeof(p)), 0);
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK);
  EXPECT_EQ(bytes, want);
}

// A caller compiled against the first layout (0.1.0: up to reserved0) passes a shorter
// struct; whatever lies in memory after it is never read, and the fields it lacks take
// qattn_fwd_params_init's defaults: no key padding, no window, bottom-right.
TEST(Abi, FirstLayoutGetsTheMaskDefaults) {
  std::size_t want = 0, bytes = 0;
  const qattn_fwd_params current = valid_params();
  ASSERT_EQ(qattn_fwd_workspace_size(&current, &want), QATTN_OK) << qattn_last_error_message();

  qattn_fwd_params old = valid_params();
  old.struct_size = QATTN_FWD_PARAMS_MIN_SIZE;
  // Bytes past the old struct_size: not the caller's (a bad window flag, sides and
  // alignment, a misaligned pointer, were they read).
  std::memset(reinterpret_cast<char*>(&old) + QATTN_FWD_PARAMS_MIN_SIZE, 0xA5,
              sizeof(old) - QATTN_FWD_PARAMS_MIN_SIZE);
  qattn_fwd_params got;
  std::memset(&got, 0x5A, sizeof(got));
  ASSERT_EQ(qattn::api::read_params("t", &old, &got), QATTN_OK) << qattn_last_error_message();
  qattn_fwd_params defaults;
  qattn_fwd_params_init(&defaults);
  EXPECT_EQ(got.struct_size, sizeof(qattn_fwd_params));
  EXPECT_EQ(got.kv_lengths, nullptr);
  EXPECT_EQ(got.window, 0);
  EXPECT_EQ(got.window_left, defaults.window_left);
  EXPECT_EQ(got.window_right, defaults.window_right);
  EXPECT_EQ(got.alignment, QATTN_ALIGN_BOTTOM_RIGHT);
  // The caller's prefix is kept as it was (past struct_size, which is the library's own).
  EXPECT_EQ(std::memcmp(reinterpret_cast<const char*>(&got) + sizeof(std::size_t),
                        reinterpret_cast<const char*>(&current) + sizeof(std::size_t),
                        QATTN_FWD_PARAMS_MIN_SIZE - sizeof(std::size_t)),
            0);
  ASSERT_EQ(qattn_fwd_workspace_size(&old, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(bytes, want);
  // The old caller's causal keeps its meaning: bottom-right, no window.
  old.causal = 1;
  ASSERT_EQ(qattn::api::read_params("t", &old, &got), QATTN_OK);
  EXPECT_EQ(got.causal, 1);
  EXPECT_EQ(got.alignment, QATTN_ALIGN_BOTTOM_RIGHT);
  EXPECT_EQ(qattn_fwd_workspace_size(&old, &bytes), QATTN_OK) << qattn_last_error_message();
}

// The first field is the size and the sub-struct of the scheme is last: the layout a
// compiled caller relies on.
TEST(Abi, LayoutKeepsItsPromises) {
  EXPECT_EQ(offsetof(qattn_fwd_params, struct_size), 0u);
  // No tail padding in either layout: a field appended later cannot land inside an
  // older struct_size. The masks beyond causal start right where the first layout ends.
  EXPECT_EQ(offsetof(qattn_fwd_params, kv_lengths), QATTN_FWD_PARAMS_MIN_SIZE);
  // attn_mask's fields start where the second layout (with the masks) ends.
  EXPECT_EQ(offsetof(qattn_fwd_params, alignment) + sizeof(int32_t),
            offsetof(qattn_fwd_params, attn_mask_type));
  // The packed batch's fields start where the third layout (with attn_mask) ends.
  EXPECT_EQ(offsetof(qattn_fwd_params, attn_mask_stride_k) + sizeof(int64_t),
            offsetof(qattn_fwd_params, cu_seqlens_q));
  // V's head dim starts where the fourth layout (with the packed batch) ends.
  EXPECT_EQ(offsetof(qattn_fwd_params, max_seqlen_k) + sizeof(int32_t),
            offsetof(qattn_fwd_params, head_dim_v));
  // P's row maxima start where the fifth layout (with V's head dim) ends, and the sixth
  // ends with reserved4, without tail padding.
  EXPECT_EQ(offsetof(qattn_fwd_params, reserved2) + sizeof(int32_t),
            offsetof(qattn_fwd_params, p_max));
  EXPECT_EQ(offsetof(qattn_fwd_params, p_max) + sizeof(float*),
            offsetof(qattn_fwd_params, reserved3));
  EXPECT_EQ(offsetof(qattn_fwd_params, reserved4) + sizeof(int32_t), sizeof(qattn_fwd_params));
  if constexpr (sizeof(void*) == 8) {  // the sizes qattn.h states for LP64
    EXPECT_EQ(QATTN_FWD_PARAMS_MIN_SIZE, 192u);
    EXPECT_EQ(offsetof(qattn_fwd_params, attn_mask_type), 216u);
    EXPECT_EQ(offsetof(qattn_fwd_params, cu_seqlens_q), 264u);
    EXPECT_EQ(offsetof(qattn_fwd_params, head_dim_v), 288u);
    EXPECT_EQ(offsetof(qattn_fwd_params, p_max), 296u);
    EXPECT_EQ(sizeof(qattn_fwd_params), 312u);
  }
  qattn_fwd_params p = valid_params();
  p.reserved0 = 1;
  std::size_t bytes = 0;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(qattn_last_error_message(), "reserved0")) << qattn_last_error_message();
  p = valid_params();
  p.reserved2 = 1;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(qattn_last_error_message(), "reserved2")) << qattn_last_error_message();
  for (int32_t qattn_fwd_params::*field : {&qattn_fwd_params::reserved3, &qattn_fwd_params::reserved4}) {
    const std::string name = field == &qattn_fwd_params::reserved3 ? "reserved3" : "reserved4";
    for (int32_t bad : {1, -1}) {
      p = valid_params();
      p.*field = bad;
      EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT) << name;
      const std::string m = qattn_last_error_message();
      EXPECT_TRUE(contains(m, name + " = " + std::to_string(bad) + "; allowed: 0")) << m;
      EXPECT_TRUE(contains(m, "qattn_fwd_params_init")) << m;
      EXPECT_EQ(qattn_fwd(&p, fake(6), 1 << 30, nullptr), QATTN_ERROR_INVALID_ARGUMENT);
      EXPECT_TRUE(contains(qattn_last_error_message(), "qattn_fwd: " + name))
          << qattn_last_error_message();
    }
  }
  p = valid_params();
  p.head_dim_v = -1;
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(qattn_last_error_message(), "head_dim_v = -1")) << qattn_last_error_message();
  // A struct that ends with the packed batch (288 bytes on LP64) is one of the layouts:
  // V takes head_dim.
  p = valid_params();
  p.struct_size = offsetof(qattn_fwd_params, head_dim_v);
  EXPECT_EQ(qattn_fwd_workspace_size(&p, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(sizeof(qattn_fwd_params{}.dtype), 4u);
  EXPECT_EQ(sizeof(qattn_fwd_params{}.sage2.granularity), 4u);
  for (std::size_t size :
       {sizeof(qattn_fwd_params{}.window), sizeof(qattn_fwd_params{}.window_left),
        sizeof(qattn_fwd_params{}.window_right), sizeof(qattn_fwd_params{}.alignment),
        sizeof(qattn_fwd_params{}.max_seqlen_q), sizeof(qattn_fwd_params{}.max_seqlen_k),
        sizeof(qattn_fwd_params{}.head_dim_v), sizeof(qattn_fwd_params{}.reserved3),
        sizeof(qattn_fwd_params{}.reserved4)})
    EXPECT_EQ(size, 4u);
}

// A caller compiled against the layout before P's row maxima (296 bytes on LP64, ending
// with reserved2) is never read past its struct: whatever lies after it (a misaligned
// pointer, nonzero reserved fields, were they read), the call writes no p_max.
TEST(Abi, LayoutBeforePMaxWritesNoPMax) {
  std::size_t want = 0, bytes = 0;
  const qattn_fwd_params current = valid_params();
  ASSERT_EQ(qattn_fwd_workspace_size(&current, &want), QATTN_OK) << qattn_last_error_message();
  qattn_fwd_params old = valid_params();
  constexpr std::size_t kOld = offsetof(qattn_fwd_params, p_max);
  old.struct_size = kOld;
  std::memset(reinterpret_cast<char*>(&old) + kOld, 0xA5, sizeof(old) - kOld);
  qattn_fwd_params got;
  std::memset(&got, 0x5A, sizeof(got));
  ASSERT_EQ(qattn::api::read_params("t", &old, &got), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(got.struct_size, sizeof(qattn_fwd_params));
  EXPECT_EQ(got.p_max, nullptr);
  EXPECT_EQ(got.reserved3, 0);
  EXPECT_EQ(got.reserved4, 0);
  EXPECT_EQ(std::memcmp(reinterpret_cast<const char*>(&got) + sizeof(std::size_t),
                        reinterpret_cast<const char*>(&current) + sizeof(std::size_t),
                        kOld - sizeof(std::size_t)),
            0);
  ASSERT_EQ(qattn_fwd_workspace_size(&old, &bytes), QATTN_OK) << qattn_last_error_message();
  EXPECT_EQ(bytes, want);
  // The same bytes in a current struct are read, and refused by name.
  old.struct_size = sizeof(qattn_fwd_params);
  EXPECT_EQ(qattn_fwd_workspace_size(&old, &bytes), QATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(qattn_last_error_message(), "reserved3")) << qattn_last_error_message();
}

// ---- the C++ builder: a stride that does not fit is named, not wrapped --------------

TEST(ApiCpp, MakeTensorReportsOverflowInsteadOfWrapping) {
  const int64_t huge = int64_t{1} << 40;  // elements per row
  qattn_tensor t{};
  // 2^40 * 2^30 rows overflows int64: before, this wrapped to a stride of 0.
  const qattn::Status s =
      qattn::make_tensor(fake(1), qattn::Layout::kHND, 8, 1 << 30, huge, &t);
  EXPECT_EQ(s.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "row_stride = " + std::to_string(huge))) << s.message();
  EXPECT_THROW(qattn::make_tensor(fake(1), qattn::Layout::kNHD, 1 << 30, 8, huge),
               qattn::Error);
  // The builder keeps the first such error and workspace_size returns it, naming what
  // the caller passed (never a wrapped stride).
  qattn::ForwardParams fp(qattn::DType::kBF16, 1, 8, 8, 1 << 30, 64, 64);
  fp.q(fake(1), qattn::Layout::kHND, huge).k(fake(2), qattn::Layout::kHND);
  std::size_t bytes = 0;
  const qattn::Status w = qattn::workspace_size(fp, &bytes);
  EXPECT_EQ(w.code(), qattn::StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(w.message(), "row_stride = 1099511627776")) << w.message();
  // Strides that fit are exact.
  ASSERT_TRUE(qattn::make_tensor(fake(1), qattn::Layout::kHND, 3, 1 << 20, 1 << 20, &t).ok());
  EXPECT_EQ(t.stride_h, int64_t{1} << 40);
  EXPECT_EQ(t.stride_b, int64_t{3} << 40);
}

// ---- many threads at once ----------------------------------------------------------

// Validation holds no shared state but the registry's constant tables: threads that
// validate at the same time get their own results and their own messages.
TEST(ApiThreads, ValidationFromManyThreadsAtOnce) {
  const qattn_fwd_params base = valid_params();
  std::size_t want = 0;
  ASSERT_EQ(qattn_fwd_workspace_size(&base, &want), QATTN_OK);
  constexpr int kThreads = 16, kCalls = 2000;
  std::atomic<int> wrong{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kCalls; ++i) {
        qattn_fwd_params p = base;
        std::size_t bytes = 0;
        if (i % 2 == 0) {
          if (qattn_fwd_workspace_size(&p, &bytes) != QATTN_OK || bytes != want) ++wrong;
        } else {
          p.causal = 100 + t;  // this thread's own bad value
          const std::string mine = "causal = " + std::to_string(100 + t) + ";";
          if (qattn_fwd_workspace_size(&p, &bytes) != QATTN_ERROR_INVALID_ARGUMENT ||
              !contains(qattn_last_error_message(), mine))
            ++wrong;
          p = base;
          p.head_dim = 257 + t;  // an unsupported one, through the registry
          if (qattn_fwd_workspace_size(&p, &bytes) != QATTN_ERROR_UNSUPPORTED ||
              !contains(qattn_last_error_message(), "head_dim = " + std::to_string(257 + t)))
            ++wrong;
        }
      }
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
