// The public API on the GPU: a valid call through qattn.hpp gives the SageAttention2
// result; every bad call returns a named error, launches nothing and writes nothing
// (the poisoned output stays poisoned, the stream stays clean).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "gpu_util.h"
#include "qattn/qattn.hpp"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

using namespace qattn;

constexpr int kB = 1, kHq = 4, kHkv = 2, kN = 200, kD = 128;

struct Buffers {
  test::DeviceBuffer<uint16_t> q{std::size_t(kB) * kHq * kN * kD},
      k{std::size_t(kB) * kHkv * kN * kD}, v{std::size_t(kB) * kHkv * kN * kD},
      o{std::size_t(kB) * kHq * kN * kD};
  test::DeviceBuffer<uint8_t> ws{64 << 20};
  Tensor4 hq{kB, kHq, kN, kD}, hk{kB, kHkv, kN, kD}, hv{kB, kHkv, kN, kD};

  Buffers() {
    std::mt19937_64 rng(test::fresh_seed());
    std::normal_distribution<float> normal;
    auto fill = [&](Tensor4& t, test::DeviceBuffer<uint16_t>& d) {
      std::vector<uint16_t> bits(t.size());
      for (std::size_t i = 0; i < t.size(); ++i) {
        bits[i] = test::to_bits16(normal(rng), true);
        t.data[i] = test::from_bits16(bits[i], true);
      }
      d.upload(bits);
    };
    fill(hq, q);
    fill(hk, k);
    fill(hv, v);
    poison();
  }
  void poison() { cudaMemset(o.ptr, 0xFF, o.count * sizeof(uint16_t)); }
  bool output_untouched() const {
    for (uint16_t x : o.download())
      if (x != 0xFFFF) return false;
    return true;
  }
  ForwardParams params() const {
    ForwardParams fp(DType::kBF16, kB, kHq, kHkv, kN, kN, kD);
    fp.q(q.ptr, Layout::kHND).k(k.ptr, Layout::kHND).v(v.ptr, Layout::kHND).o(o.ptr, Layout::kHND);
    return fp;
  }
};

TEST(ApiOnDevice, ValidCallMatchesReference) {
  QATTN_SKIP_WITHOUT_GPU();
  Buffers b;
  const ForwardParams fp = b.params();
  std::size_t bytes = 0;
  ASSERT_TRUE(workspace_size(fp, &bytes).ok());
  ASSERT_LE(bytes, b.ws.count);
  const Status s = forward(fp, b.ws.ptr, bytes, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto bits = b.o.download();
  std::vector<float> o(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) o[i] = test::from_bits16(bits[i], true);
  const auto ref = reference::attention_forward(b.hq, b.hk, b.hv);
  const auto m = metrics::compare(std::span<const float>(o), std::span<const double>(ref.o.data));
  EXPECT_GE(m.cos_sim, 0.999);
}

TEST(ApiOnDevice, BadCallsFailNamedAndWriteNothing) {
  QATTN_SKIP_WITHOUT_GPU();
  Buffers b;
  std::size_t bytes = 0;
  ASSERT_TRUE(workspace_size(b.params(), &bytes).ok());
  struct Bad {
    const char* name;
    std::function<void(qattn_fwd_params&)> edit;
    std::size_t ws_bytes;
    StatusCode code;
    const char* word;  // the parameter the message must name
  };
  const std::vector<Bad> cases = {
      {"heads", [](qattn_fwd_params& p) { p.heads_kv = 3; }, bytes, StatusCode::kInvalidArgument,
       "heads_kv"},
      {"head_dim", [](qattn_fwd_params& p) { p.head_dim = 256; }, bytes, StatusCode::kUnsupported,
       "head_dim"},
      {"o misaligned", [](qattn_fwd_params& p) { p.o.data = static_cast<char*>(p.o.data) + 2; },
       bytes, StatusCode::kInvalidArgument, "o"},
      {"o overlaps q", [](qattn_fwd_params& p) { p.o.data = p.q.data; }, bytes,
       StatusCode::kInvalidArgument, "o"},
      {"workspace", [](qattn_fwd_params&) {}, bytes - 256, StatusCode::kWorkspaceTooSmall,
       "workspace"},
      {"sm_scale", [](qattn_fwd_params& p) { p.sm_scale = std::numeric_limits<float>::infinity(); },
       bytes, StatusCode::kInvalidArgument, "sm_scale"},
      {"causal", [](qattn_fwd_params& p) { p.causal = 2; }, bytes, StatusCode::kInvalidArgument,
       "causal"},
  };
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.name);
    qattn_fwd_params p = b.params().raw();
    c.edit(p);
    const Status s = Status::from_c(qattn_fwd(&p, b.ws.ptr, c.ws_bytes, nullptr));
    EXPECT_EQ(s.code(), c.code) << s.message();
    EXPECT_NE(s.message().find(c.word), std::string::npos) << s.message();
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_TRUE(b.output_untouched()) << "a failed call wrote the output";
  }
}

}  // namespace
