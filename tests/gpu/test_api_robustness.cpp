// The C ABI under conditions a single well-behaved call never meets: tensors on another
// device, forwards from several threads on separate streams at once, a bad pointer
// during stream capture in each capture mode, the largest accepted sm_scale, and a soak
// of 10^4 random valid calls (no error, no device memory leaked, every output equal
// bit for bit to a single call with the same parameters). Skips without an sm_90 GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.h"
#include "qattn/qattn.h"
#include "qattn/qattn.hpp"

namespace {

using namespace qattn;

int round8(int d) { return (d + 7) / 8 * 8; }

// One forward's parameters and buffers on the current device: random inputs, an output
// and LSE it writes, and its own workspace.
struct Call {
  struct Shape {
    bool bf16 = true, causal = false, nhd = false, lse = true;
    int batch = 1, heads_q = 4, heads_kv = 2, seqlen_q = 200, seqlen_kv = 200, head_dim = 64;
    int granularity = QATTN_QK_PER_THREAD;
    float sm_scale = 0.f;
  } s;
  std::size_t q_elems = 0, kv_elems = 0, lse_elems = 0, ws_bytes = 0;
  std::unique_ptr<test::DeviceBuffer<uint16_t>> q, k, v, o;
  std::unique_ptr<test::DeviceBuffer<float>> lse;
  std::unique_ptr<test::DeviceBuffer<uint8_t>> ws;

  Call(const Shape& shape, std::mt19937_64& rng, float magnitude = 1.f) : s(shape) {
    const std::size_t row = static_cast<std::size_t>(round8(s.head_dim));
    q_elems = std::size_t(s.batch) * s.heads_q * s.seqlen_q * row;
    kv_elems = std::size_t(s.batch) * s.heads_kv * s.seqlen_kv * row;
    lse_elems = std::size_t(s.batch) * s.heads_q * s.seqlen_q;
    q = std::make_unique<test::DeviceBuffer<uint16_t>>(q_elems);
    k = std::make_unique<test::DeviceBuffer<uint16_t>>(kv_elems);
    v = std::make_unique<test::DeviceBuffer<uint16_t>>(kv_elems);
    o = std::make_unique<test::DeviceBuffer<uint16_t>>(q_elems);
    lse = std::make_unique<test::DeviceBuffer<float>>(lse_elems);
    std::normal_distribution<float> normal;
    for (auto* t : {q.get(), k.get(), v.get()}) {
      std::vector<uint16_t> bits(t->count);
      const float m = t == v.get() ? 1.f : magnitude;
      for (auto& b : bits) b = test::to_bits16(std::clamp(m * normal(rng), -65504.f, 65504.f), s.bf16);
      t->upload(bits);
    }
    std::size_t bytes = 0;
    if (qattn_fwd_workspace_size(&params(), &bytes) == QATTN_OK) {
      ws_bytes = bytes;
      ws = std::make_unique<test::DeviceBuffer<uint8_t>>(bytes);
    }
  }

  const qattn_fwd_params& params() {
    ForwardParams fp(s.bf16 ? DType::kBF16 : DType::kFP16, s.batch, s.heads_q, s.heads_kv,
                     s.seqlen_q, s.seqlen_kv, s.head_dim);
    const Layout l = s.nhd ? Layout::kNHD : Layout::kHND;
    const int64_t row = round8(s.head_dim);
    fp.q(q->ptr, l, row).k(k->ptr, l, row).v(v->ptr, l, row).o(o->ptr, l, row);
    if (s.lse) fp.lse(lse->ptr);
    fp.causal(s.causal).sm_scale(s.sm_scale).granularity(static_cast<Granularity>(s.granularity));
    p_ = fp.raw();
    return p_;
  }

  // Poisons the outputs, then enqueues the forward on `stream`.
  qattn_status run(cudaStream_t stream) {
    cudaMemsetAsync(o->ptr, 0xFF, q_elems * 2, stream);
    cudaMemsetAsync(lse->ptr, 0xFF, lse_elems * 4, stream);
    return qattn_fwd(&params(), ws->ptr, ws_bytes, stream);
  }

  // The output bits (o's elements inside head_dim, and the LSE when asked for).
  std::vector<uint16_t> o_bits() const { return o->download(); }
  std::vector<float> lse_values() const { return s.lse ? lse->download() : std::vector<float>{}; }

 private:
  qattn_fwd_params p_{};
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- another device --------------------------------------------------------------

TEST(ApiRobustness, TensorsOnAnotherDeviceAreNamed) {
  QATTN_SKIP_WITHOUT_GPU();
  int n = 0;
  QATTN_CUDA_OK(cudaGetDeviceCount(&n));
  if (n < 2) GTEST_SKIP() << "one CUDA device: no other device to put a tensor on";
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  QATTN_CUDA_OK(cudaSetDevice(0));
  Call c({}, rng);
  ASSERT_NE(c.ws, nullptr);
  QATTN_CUDA_OK(cudaSetDevice(1));
  void* other = nullptr;
  QATTN_CUDA_OK(cudaMalloc(&other, c.q_elems * 2));
  QATTN_CUDA_OK(cudaSetDevice(0));
  for (const char* which : {"q.data", "k.data", "o.data", "workspace"}) {
    SCOPED_TRACE(which);
    QATTN_CUDA_OK(cudaMemset(c.o->ptr, 0xFF, c.q_elems * 2));
    qattn_fwd_params p = c.params();
    void* ws = c.ws->ptr;
    if (std::string(which) == "q.data") p.q.data = other;
    if (std::string(which) == "k.data") p.k.data = other;
    if (std::string(which) == "o.data") p.o.data = other;
    if (std::string(which) == "workspace") ws = other;
    const Status s = Status::from_c(qattn_fwd(&p, ws, c.ws_bytes, nullptr));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(std::string(which) + " = "), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("is on device 1"), std::string::npos) << s.message();
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    for (uint16_t x : c.o_bits()) ASSERT_EQ(x, 0xFFFF) << "a rejected call wrote o";
  }
  QATTN_CUDA_OK(cudaSetDevice(1));
  cudaFree(other);
  QATTN_CUDA_OK(cudaSetDevice(0));
}

// ---- several threads at once -----------------------------------------------------

// Each thread owns a stream and its own buffers with the same inputs; their forwards
// overlap on the device, and every output equals the single call's bit for bit.
TEST(ApiRobustness, ConcurrentForwardsOnSeparateStreamsMatchASingleCall) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Call::Shape shape;
  shape.seqlen_q = 300;
  shape.seqlen_kv = 700;
  shape.causal = true;
  std::mt19937_64 rng0(seed);
  Call single(shape, rng0);
  ASSERT_EQ(single.run(nullptr), QATTN_OK) << qattn_last_error_message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto want_o = single.o_bits();
  const auto want_lse = single.lse_values();

  constexpr int kThreads = 4, kRounds = 25;
  std::vector<std::unique_ptr<Call>> calls;
  for (int t = 0; t < kThreads; ++t) {
    std::mt19937_64 rng(seed);  // the same inputs
    calls.push_back(std::make_unique<Call>(shape, rng));
  }
  std::atomic<int> failures{0};
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      cudaSetDevice(0);
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        ++failures;
        return;
      }
      for (int r = 0; r < kRounds; ++r) {
        if (calls[t]->run(stream) != QATTN_OK) {
          errors[t] = qattn_last_error_message();
          ++failures;
          break;
        }
        if (cudaStreamSynchronize(stream) != cudaSuccess || calls[t]->o_bits() != want_o ||
            !same_bits(calls[t]->lse_values(), want_lse)) {
          errors[t] = "round " + std::to_string(r) + ": output differs from the single call";
          ++failures;
          break;
        }
      }
      cudaStreamDestroy(stream);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  EXPECT_EQ(failures.load(), 0);
}

// ---- stream capture --------------------------------------------------------------

// The pointer checks run during capture in every mode: a host pointer is refused by
// name, the capture stays valid, and a valid call captured next replays to the same
// bits as a direct call.
TEST(ApiRobustness, PointerChecksRunDuringCaptureInEveryMode) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Call c({}, rng);
  ASSERT_EQ(c.run(nullptr), QATTN_OK) << qattn_last_error_message();
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto want = c.o_bits();
  std::vector<uint16_t> host_q(c.q_elems + 8);
  void* host_ptr = reinterpret_cast<void*>(
      (reinterpret_cast<std::uintptr_t>(host_q.data()) + 15) / 16 * 16);

  for (auto mode : {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                    cudaStreamCaptureModeRelaxed}) {
    SCOPED_TRACE("capture mode " + std::to_string(static_cast<int>(mode)));
    cudaStream_t stream = nullptr;
    QATTN_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    QATTN_CUDA_OK(cudaMemset(c.o->ptr, 0xFF, c.q_elems * 2));
    QATTN_CUDA_OK(cudaStreamBeginCapture(stream, mode));
    qattn_fwd_params bad = c.params();
    bad.q.data = host_ptr;
    const Status s = Status::from_c(qattn_fwd(&bad, c.ws->ptr, c.ws_bytes, stream));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find("q.data"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("host memory"), std::string::npos) << s.message();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    EXPECT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "the checks invalidated the capture";
    const qattn_fwd_params good = c.params();
    const Status ok = Status::from_c(qattn_fwd(&good, c.ws->ptr, c.ws_bytes, stream));
    EXPECT_TRUE(ok.ok()) << ok.message();
    cudaGraph_t graph = nullptr;
    QATTN_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    QATTN_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    QATTN_CUDA_OK(cudaGraphLaunch(exec, stream));
    QATTN_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(c.o_bits(), want) << "the captured forward's output differs from a direct call";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// ---- the largest sm_scale ----------------------------------------------------------

// QATTN_MAX_SM_SCALE keeps the FP32 scale path finite (qattn.h): the Q scale with
// sm_scale·log2(e) folded in, the scores, q·c and the LSE. Inputs of magnitude 1e-11
// (BF16 holds them) keep one INT8 score step qk = sm_scale·log2(e)·amax_q/127·amax_k/127
// near 1e25·1.44·(4e-11/127)² ≈ 1.4, below the regime where the kernel's exponent
// rounding (0.75·qk) can zero a row (qattn.h): so a non-finite value here is a range
// failure of the scale path, which the bound exists to prevent.
TEST(ApiRobustness, LargestSmScaleGivesFiniteOutput) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int d : {64, 128}) {
    Call::Shape shape;
    shape.bf16 = true;
    shape.head_dim = d;
    shape.sm_scale = QATTN_MAX_SM_SCALE;
    Call c(shape, rng, /*magnitude=*/1e-11f);
    ASSERT_EQ(c.run(nullptr), QATTN_OK) << qattn_last_error_message();
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    for (uint16_t b : c.o_bits()) ASSERT_TRUE(std::isfinite(test::from_bits16(b, true))) << d;
    for (float x : c.lse_values()) ASSERT_TRUE(std::isfinite(x)) << d;
  }
}

// ---- soak ------------------------------------------------------------------------

// 10^4 random valid calls over a pool of small random shapes, on four streams: no call
// fails, device memory is the same before and after (the library allocates nothing),
// and every output equals the first call of its parameters bit for bit (outputs are
// poisoned before each call, so a call that wrote nothing fails too).
TEST(ApiRobustness, SoakOfRandomValidCalls) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("soak seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int> v) { return *(v.begin() + rng() % v.size()); };
  auto range = [&](int lo, int hi) { return lo + static_cast<int>(rng() % (hi - lo + 1)); };

  constexpr int kPool = 32, kCalls = 10000, kStreams = 4;
  std::vector<std::unique_ptr<Call>> pool;
  std::vector<std::vector<uint16_t>> want_o(kPool);
  std::vector<std::vector<float>> want_lse(kPool);
  for (int i = 0; i < kPool; ++i) {
    Call::Shape s;
    s.bf16 = rng() % 2;
    s.causal = rng() % 2;
    s.nhd = rng() % 2;
    s.lse = rng() % 4 != 0;
    s.batch = range(1, 2);
    s.heads_kv = range(1, 2);
    s.heads_q = s.heads_kv * pick({1, 2, 3});
    s.seqlen_q = range(1, 320);
    s.seqlen_kv = range(1, 320);
    s.head_dim = pick({8, 32, 40, 64, 72, 96, 128});
    s.granularity = pick({0, 1, 2});
    s.sm_scale = rng() % 2 ? 0.f : 0.02f + 0.5f * static_cast<float>(rng() % 1000) / 1000.f;
    pool.push_back(std::make_unique<Call>(s, rng));
    ASSERT_NE(pool.back()->ws, nullptr) << "pool entry " << i << ": " << qattn_last_error_message();
    ASSERT_EQ(pool.back()->run(nullptr), QATTN_OK) << i << ": " << qattn_last_error_message();
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    want_o[i] = pool.back()->o_bits();
    want_lse[i] = pool.back()->lse_values();
  }
  std::array<cudaStream_t, kStreams> streams{};
  for (auto& st : streams) QATTN_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  std::size_t free_before = 0, free_after = 0, total = 0;
  QATTN_CUDA_OK(cudaMemGetInfo(&free_before, &total));

  int failed = 0, differed = 0;
  for (int done = 0; done < kCalls;) {
    // A batch of distinct pool entries, one per stream, running at the same time.
    std::array<int, kStreams> batch{};
    for (int j = 0; j < kStreams; ++j) {
      int e;
      do e = static_cast<int>(rng() % kPool);
      while (std::find(batch.begin(), batch.begin() + j, e) != batch.begin() + j);
      batch[j] = e;
      if (pool[e]->run(streams[j]) != QATTN_OK && failed++ < 5)
        ADD_FAILURE() << "call " << done + j << " (pool " << e << "): " << qattn_last_error_message();
    }
    QATTN_CUDA_OK(cudaDeviceSynchronize());
    for (int j = 0; j < kStreams; ++j) {
      const int e = batch[j];
      if ((pool[e]->o_bits() != want_o[e] || !same_bits(pool[e]->lse_values(), want_lse[e])) &&
          differed++ < 5)
        ADD_FAILURE() << "call " << done + j << " (pool " << e
                      << "): output differs from the first call of the same parameters";
    }
    done += kStreams;
  }
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  QATTN_CUDA_OK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(differed, 0);
  EXPECT_EQ(free_before, free_after) << "device memory leaked across " << kCalls << " calls";
  for (auto& st : streams) cudaStreamDestroy(st);
}

}  // namespace
