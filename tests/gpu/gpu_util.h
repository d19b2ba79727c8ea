// Helpers shared by the GPU tests: skipping without a device, device buffers, and
// random 16-bit inputs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "numerics/formats.h"
#include "test_seed.h"  // fresh_seed, seed_trace

namespace qattn::test {

// Empty when an sm_90 device is present, else the reason to skip.
inline std::string gpu_skip_reason() {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(e) + ")";
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major != 9)
    return std::string("device is sm_") + std::to_string(prop.major * 10 + prop.minor) +
           ", kernels need sm_90";
  return {};
}

#define QATTN_SKIP_WITHOUT_GPU()                                                \
  do {                                                                          \
    if (const std::string why = ::qattn::test::gpu_skip_reason(); !why.empty()) \
      GTEST_SKIP() << why;                                                      \
  } while (0)

#define QATTN_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t count = 0;
  explicit DeviceBuffer(std::size_t n) : count(n) {
    if (cudaMalloc(&ptr, n * sizeof(T) + 16) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& h) {
    cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

// 16-bit bits of x in the given format (bf16 when `bf16`, else fp16).
inline uint16_t to_bits16(float x, bool bf16) {
  return bf16 ? numerics::bf16_bits(x) : numerics::fp16_bits(x);
}
inline float from_bits16(uint16_t b, bool bf16) {
  return bf16 ? numerics::bf16_from_bits(b) : numerics::fp16_from_bits(b);
}

}  // namespace qattn::test
