// qattn_fwd never waits for the device: a CUPTI callback subscribed to the driver-API
// and runtime-API domains records every CUDA call made while a qattn call runs, and the
// synchronizing ones (stream/event/context/device synchronize, synchronous memcpy and
// memset, frees, allocations) must number zero, on valid calls and on refused ones.
// libqattn links the CUDA runtime statically; whatever the runtime does reaches the
// driver API, whose callbacks CUPTI delivers either way. A self-check first shows the
// counter sees a deliberate cudaStreamSynchronize and a cudaMemcpy, and not a
// cudaMemcpyAsync, so the test can fail.
//
// libcupti is loaded at run time (dlopen): the binary is built on one machine and run on
// another, and without libcupti there the test skips, saying where it looked.
#include <cuda_runtime.h>
#include <cupti_callbacks.h>
#include <cupti_result.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gpu_util.h"
#include "qattn/qattn.h"

namespace {

// A call that makes the host wait for the device, or may (allocation and free).
bool is_synchronizing(std::string_view name) {
  auto starts = [&](std::string_view p) { return name.substr(0, p.size()) == p; };
  const bool async = name.find("Async") != std::string_view::npos;
  if (name.find("Synchronize") != std::string_view::npos) return true;  // Ctx/Stream/Event/Device
  if (starts("cuMemcpy") || starts("cudaMemcpy") || starts("cuMemset") || starts("cudaMemset"))
    return !async;
  if (starts("cuMemFree") || starts("cudaFree") || starts("cuArrayDestroy") ||
      starts("cuMipmappedArrayDestroy"))
    return !async;
  if (starts("cuMemAlloc") || starts("cudaMalloc") || starts("cuMemHostAlloc") ||
      starts("cudaHostAlloc") || starts("cuMemHostRegister") || starts("cudaHostRegister"))
    return !async;
  return false;
}

struct Recorder {
  std::atomic<bool> armed{false};
  std::mutex mutex;
  std::vector<std::string> calls, syncs;  // while armed: every call, and the synchronizing
  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    calls.clear();
    syncs.clear();
  }
};
Recorder recorder;

void CUPTIAPI on_api_call(void*, CUpti_CallbackDomain domain, CUpti_CallbackId,
                          const void* data) {
  if (!recorder.armed.load()) return;
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API && domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  const auto* d = static_cast<const CUpti_CallbackData*>(data);
  if (d->callbackSite != CUPTI_API_ENTER || d->functionName == nullptr) return;
  std::lock_guard<std::mutex> lock(recorder.mutex);
  recorder.calls.emplace_back(d->functionName);
  if (is_synchronizing(d->functionName)) recorder.syncs.emplace_back(d->functionName);
}

// CUPTI's callback API, loaded at run time.
struct Cupti {
  using Subscribe = CUptiResult (*)(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*);
  using EnableDomain = CUptiResult (*)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain);
  using Unsubscribe = CUptiResult (*)(CUpti_SubscriberHandle);
  using ResultString = CUptiResult (*)(CUptiResult, const char**);
  Subscribe subscribe = nullptr;
  EnableDomain enable_domain = nullptr;
  Unsubscribe unsubscribe = nullptr;
  ResultString result_string = nullptr;
  CUpti_SubscriberHandle subscriber = nullptr;
  std::string unavailable;  // empty once subscribed to both domains
  std::string library;

  std::string error(CUptiResult r) const {
    const char* s = nullptr;
    if (result_string != nullptr) result_string(r, &s);
    return s != nullptr ? s : "CUPTI error " + std::to_string(static_cast<int>(r));
  }

  Cupti() {
    std::vector<std::string> tried;
    if (const char* env = std::getenv("QATTN_CUPTI_LIBRARY"); env != nullptr && *env != '\0')
      tried.emplace_back(env);
#ifdef QATTN_CUPTI_LIBRARY
    tried.emplace_back(QATTN_CUPTI_LIBRARY);  // where the build found it
#endif
    for (const char* p : {"libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so",
                          "/usr/local/cuda/lib/libcupti.so",
                          "/usr/local/cuda/lib64/libcupti.so",
                          "/usr/local/cuda/targets/x86_64-linux/lib/libcupti.so",
                          "/usr/local/cuda/targets/sbsa-linux/lib/libcupti.so"})
      tried.emplace_back(p);
    void* handle = nullptr;
    std::string list;
    for (const std::string& p : tried) {
      for (const std::string& name : {p, p + ".13", p + ".12"}) {
        handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle != nullptr) {
          library = name;
          break;
        }
      }
      if (handle != nullptr) break;
      list += " " + p;
    }
    if (handle == nullptr) {
      unavailable = "libcupti not found (tried" + list + "; QATTN_CUPTI_LIBRARY=<path> names it)";
      return;
    }
    subscribe = reinterpret_cast<Subscribe>(dlsym(handle, "cuptiSubscribe"));
    enable_domain = reinterpret_cast<EnableDomain>(dlsym(handle, "cuptiEnableDomain"));
    unsubscribe = reinterpret_cast<Unsubscribe>(dlsym(handle, "cuptiUnsubscribe"));
    result_string = reinterpret_cast<ResultString>(dlsym(handle, "cuptiGetResultString"));
    if (subscribe == nullptr || enable_domain == nullptr || unsubscribe == nullptr) {
      unavailable = library + " lacks the callback API";
      return;
    }
    if (CUptiResult r = subscribe(&subscriber, on_api_call, nullptr); r != CUPTI_SUCCESS) {
      unavailable = "cuptiSubscribe: " + error(r);
      return;
    }
    for (CUpti_CallbackDomain d : {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_CB_DOMAIN_RUNTIME_API}) {
      if (CUptiResult r = enable_domain(1, subscriber, d); r != CUPTI_SUCCESS) {
        unavailable = "cuptiEnableDomain(" + std::to_string(static_cast<int>(d)) + "): " + error(r);
        return;
      }
    }
  }
};

// Subscribed before the first CUDA call of the process (the GPU check below is one).
Cupti& cupti() {
  static Cupti c;
  return c;
}

// CUPTI first: it must be subscribed before the GPU check's first CUDA call.
#define SKIP_WITHOUT_CUPTI_OR_GPU()                                             \
  do {                                                                          \
    if (const std::string cupti_why = cupti().unavailable; !cupti_why.empty()) { \
      const std::string gpu_why = ::qattn::test::gpu_skip_reason();             \
      GTEST_SKIP() << (gpu_why.empty() ? "" : gpu_why + "; ") << cupti_why;     \
    }                                                                           \
    QATTN_SKIP_WITHOUT_GPU();                                                   \
  } while (0)

// Runs f with the recorder armed; returns the synchronizing calls it made.
template <typename F>
std::vector<std::string> syncs_during(F&& f, std::vector<std::string>* calls = nullptr) {
  recorder.clear();
  recorder.armed = true;
  f();
  recorder.armed = false;
  std::lock_guard<std::mutex> lock(recorder.mutex);
  if (calls != nullptr) *calls = recorder.calls;
  return recorder.syncs;
}

std::string join(const std::vector<std::string>& xs) {
  std::string s;
  for (const std::string& x : xs) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "(none)" : s;
}

// A valid forward: bf16, GQA, tails, contiguous HND, with the LSE.
struct Forward {
  static constexpr int kB = 1, kHq = 4, kHkv = 2, kNq = 300, kNkv = 333, kD = 128;
  qattn::test::DeviceBuffer<uint16_t> q{std::size_t(kB) * kHq * kNq * kD},
      k{std::size_t(kB) * kHkv * kNkv * kD}, v{std::size_t(kB) * kHkv * kNkv * kD},
      o{std::size_t(kB) * kHq * kNq * kD};
  qattn::test::DeviceBuffer<float> lse{std::size_t(kB) * kHq * kNq};
  qattn_fwd_params p{};
  std::size_t ws_bytes = 0;
  void* ws = nullptr;
  cudaStream_t stream = nullptr;

  static qattn_tensor hnd(void* data, int h, int n) {
    qattn_tensor t{};
    t.data = data;
    t.stride_n = kD;
    t.stride_h = static_cast<int64_t>(n) * kD;
    t.stride_b = t.stride_h * h;
    return t;
  }

  Forward() {
    const uint64_t seed = qattn::test::fresh_seed();
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal;
    for (auto* b : {&q, &k, &v}) {
      std::vector<uint16_t> h(b->count);
      for (auto& x : h) x = qattn::test::to_bits16(normal(rng), true);
      b->upload(h);
    }
    qattn_fwd_params_init(&p);
    p.dtype = QATTN_DTYPE_BF16;
    p.batch = kB;
    p.heads_q = kHq;
    p.heads_kv = kHkv;
    p.seqlen_q = kNq;
    p.seqlen_kv = kNkv;
    p.head_dim = kD;
    p.q = hnd(q.ptr, kHq, kNq);
    p.k = hnd(k.ptr, kHkv, kNkv);
    p.v = hnd(v.ptr, kHkv, kNkv);
    p.o = hnd(o.ptr, kHq, kNq);
    p.lse = lse.ptr;
    if (qattn_fwd_workspace_size(&p, &ws_bytes) == QATTN_OK) cudaMalloc(&ws, ws_bytes);
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  ~Forward() {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    cudaFree(ws);
  }
};

TEST(NoHostSync, TheCounterSeesADeliberateSync) {
  SKIP_WITHOUT_CUPTI_OR_GPU();
  cudaStream_t s = nullptr;
  QATTN_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  qattn::test::DeviceBuffer<uint8_t> d(4096);
  std::vector<uint8_t> h(4096, 1);
  auto sync = syncs_during([&] { cudaStreamSynchronize(s); });
  EXPECT_FALSE(sync.empty()) << "cudaStreamSynchronize went unseen: the test would see nothing";
  auto copy = syncs_during([&] { cudaMemcpy(d.ptr, h.data(), h.size(), cudaMemcpyHostToDevice); });
  EXPECT_FALSE(copy.empty()) << "a synchronous cudaMemcpy went unseen";
  std::vector<std::string> calls;
  auto async = syncs_during(
      [&] { cudaMemcpyAsync(d.ptr, h.data(), h.size(), cudaMemcpyHostToDevice, s); }, &calls);
  EXPECT_TRUE(async.empty()) << "cudaMemcpyAsync counted as a sync: " << join(async);
  EXPECT_FALSE(calls.empty()) << "cudaMemcpyAsync went unseen";
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  RecordProperty("cupti", cupti().library);
}

TEST(NoHostSync, ForwardCallsNeverWait) {
  SKIP_WITHOUT_CUPTI_OR_GPU();
  Forward f;
  ASSERT_NE(f.ws, nullptr);
  for (int causal : {0, 1}) {
    f.p.causal = causal;
    for (int call = 0; call < 3; ++call) {  // the first call of a process included
      SCOPED_TRACE("causal=" + std::to_string(causal) + " call " + std::to_string(call));
      qattn_status st = QATTN_OK;
      std::vector<std::string> calls;
      const auto syncs = syncs_during([&] { st = qattn_fwd(&f.p, f.ws, f.ws_bytes, f.stream); },
                                      &calls);
      ASSERT_EQ(st, QATTN_OK) << qattn_last_error_message();
      EXPECT_TRUE(syncs.empty()) << "qattn_fwd synchronized: " << join(syncs)
                                 << "\nall CUDA calls it made: " << join(calls);
      EXPECT_FALSE(calls.empty()) << "qattn_fwd made no CUDA call the recorder saw";
    }
  }
  QATTN_CUDA_OK(cudaStreamSynchronize(f.stream));
  // The size query and a refused call (workspace too small) do not wait either.
  std::size_t bytes = 0;
  auto size_syncs = syncs_during([&] { qattn_fwd_workspace_size(&f.p, &bytes); });
  EXPECT_TRUE(size_syncs.empty()) << join(size_syncs);
  qattn_status st = QATTN_OK;
  auto refused = syncs_during([&] { st = qattn_fwd(&f.p, f.ws, f.ws_bytes / 2, f.stream); });
  EXPECT_NE(st, QATTN_OK);
  EXPECT_TRUE(refused.empty()) << "a refused qattn_fwd synchronized: " << join(refused);
}

// The precision modes: "precise" (one kernel, no workspace) and "auto" (SA2-8b, the
// guard's memsets and kernels, the 16-bit forward reading the guard's maxima) decide
// everything on the device.
TEST(NoHostSync, PrecisionModesNeverWait) {
  SKIP_WITHOUT_CUPTI_OR_GPU();
  Forward f;
  ASSERT_NE(f.ws, nullptr);
  for (int32_t scheme : {QATTN_SCHEME_PRECISE16, QATTN_SCHEME_SAGE2_8B_AUTO}) {
    f.p.scheme = scheme;
    std::size_t bytes = 0;
    ASSERT_EQ(qattn_fwd_workspace_size(&f.p, &bytes), QATTN_OK) << qattn_last_error_message();
    qattn::test::DeviceBuffer<uint8_t> ws(std::max<std::size_t>(bytes, 1));
    for (int causal : {0, 1}) {
      f.p.causal = causal;
      for (int call = 0; call < 2; ++call) {
        SCOPED_TRACE("scheme " + std::to_string(scheme) + " causal=" + std::to_string(causal) +
                     " call " + std::to_string(call));
        qattn_status st = QATTN_OK;
        std::vector<std::string> calls;
        const auto syncs =
            syncs_during([&] { st = qattn_fwd(&f.p, ws.ptr, bytes, f.stream); }, &calls);
        ASSERT_EQ(st, QATTN_OK) << qattn_last_error_message();
        EXPECT_TRUE(syncs.empty()) << "qattn_fwd synchronized: " << join(syncs)
                                   << "\nall CUDA calls it made: " << join(calls);
      }
    }
    QATTN_CUDA_OK(cudaStreamSynchronize(f.stream));
  }
}

}  // namespace
