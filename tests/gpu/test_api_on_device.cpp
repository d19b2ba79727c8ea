// The public API on the GPU: a valid call through qattn.hpp gives the SageAttention2
// result; every bad call returns a named error, launches nothing and writes nothing
// (the poisoned output stays poisoned, the stream stays clean), including a view that
// runs past the end of its allocation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "gpu_util.h"
#include "tolerances.h"
#include "qattn/qattn.hpp"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace {

// The SA2-8b CosSim bound of the shared table (tests/tolerances/sage2_8b.json, with its
// reason), as in the forward's own tests.
double min_cos() { return qattn::test::tolerances("sage2_8b")["cos_min"]; }

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

// CosSim of the output in b.o against the FP64 reference of b's inputs.
double cos_against_reference(const Buffers& b) {
  const auto bits = b.o.download();
  std::vector<float> o(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) o[i] = test::from_bits16(bits[i], true);
  const auto ref = reference::attention_forward(b.hq, b.hk, b.hv);
  return metrics::compare(std::span<const float>(o), std::span<const double>(ref.o.data)).cos_sim;
}

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
  EXPECT_GE(cos_against_reference(b), min_cos());
}

// A context reset (cudaDeviceReset) clears the kernels' function attributes; the library
// sets them once per context (hopper/per_device.h), so a forward after a reset must set
// them again and still run. Each forward gets fresh buffers: the reset frees them all.
TEST(ApiOnDevice, ForwardRunsAgainAfterADeviceReset) {
  QATTN_SKIP_WITHOUT_GPU();
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    {
      Buffers b;
      const ForwardParams fp = b.params();
      std::size_t bytes = 0;
      ASSERT_TRUE(workspace_size(fp, &bytes).ok());
      const Status s = forward(fp, b.ws.ptr, bytes, nullptr);
      ASSERT_TRUE(s.ok()) << s.message();
      QATTN_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_GE(cos_against_reference(b), min_cos());
    }
    QATTN_CUDA_OK(cudaDeviceReset());
  }
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
      {"head_dim", [](qattn_fwd_params& p) { p.head_dim = 264; }, bytes, StatusCode::kUnsupported,
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

// A q whose buffer holds one of its four heads: the shape and strides reach three heads
// (150 KiB) past the allocation's end, more than any rounding of the allocation size.
// The call fails by name before launching anything: o and the workspace keep their
// poison (the workspace would hold the quantized inputs had any kernel run).
TEST(ApiOnDevice, ViewPastItsAllocationFailsNamed) {
  QATTN_SKIP_WITHOUT_GPU();
  Buffers b;
  std::size_t bytes = 0;
  ASSERT_TRUE(workspace_size(b.params(), &bytes).ok());
  test::DeviceBuffer<uint16_t> short_q(std::size_t(kN) * kD);
  ASSERT_NE(short_q.ptr, nullptr);
  constexpr unsigned char kWsPoison = 0xA5;
  QATTN_CUDA_OK(cudaMemset(b.ws.ptr, kWsPoison, bytes));
  qattn_fwd_params p = b.params().raw();
  p.q.data = short_q.ptr;

  // The host-side checks come first and reject a q that overlaps o or the workspace;
  // the allocator must not have put them where q's view runs (k and v may be there).
  const auto q_begin = reinterpret_cast<std::uintptr_t>(short_q.ptr);
  const auto q_end = q_begin + std::size_t(kB) * kHq * kN * kD * sizeof(uint16_t);
  auto in_q_view = [&](const void* ptr, std::size_t n) {
    const auto a = reinterpret_cast<std::uintptr_t>(ptr);
    return a < q_end && q_begin < a + n;
  };
  ASSERT_FALSE(in_q_view(b.o.ptr, b.o.count * sizeof(uint16_t)) || in_q_view(b.ws.ptr, bytes))
      << "test setup: o or the workspace lies inside q's view, which validation rejects first";

  const Status s = Status::from_c(qattn_fwd(&p, b.ws.ptr, bytes, nullptr));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("q.data"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("allocation"), std::string::npos) << s.message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(b.output_untouched()) << "a failed call wrote the output";
  std::vector<unsigned char> ws(bytes);
  QATTN_CUDA_OK(cudaMemcpy(ws.data(), b.ws.ptr, bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(ws.begin(), ws.end(), kWsPoison), static_cast<std::ptrdiff_t>(bytes))
      << "a failed call wrote the workspace: a kernel ran";
}

// Managed memory is device-addressable and passes; the span check skips it (its
// allocation is not a plain cudaMalloc one) rather than rejecting a valid call.
TEST(ApiOnDevice, ManagedInputIsAccepted) {
  QATTN_SKIP_WITHOUT_GPU();
  Buffers b;
  std::size_t bytes = 0;
  ASSERT_TRUE(workspace_size(b.params(), &bytes).ok());
  void* managed_q = nullptr;
  QATTN_CUDA_OK(cudaMallocManaged(&managed_q, b.q.count * sizeof(uint16_t)));
  QATTN_CUDA_OK(
      cudaMemcpy(managed_q, b.q.ptr, b.q.count * sizeof(uint16_t), cudaMemcpyDeviceToDevice));
  qattn_fwd_params p = b.params().raw();
  p.q.data = managed_q;
  const Status s = Status::from_c(qattn_fwd(&p, b.ws.ptr, bytes, nullptr));
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (s.ok()) {
    EXPECT_GE(cos_against_reference(b), min_cos());
  }
  cudaFree(managed_q);
}

}  // namespace
