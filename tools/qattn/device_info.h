// What the CLI reports about the machine: library build, CUDA runtime and driver,
// and the current device. Shared by `qattn info` and the env block of `qattn bench`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "qattn/qattn.h"

#if QATTN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace qattn::cli {

struct DeviceInfo {
  bool built_with_cuda = QATTN_HAVE_CUDA != 0;
  int runtime_version = 0, driver_version = 0;  // CUDA's 1000*major + 10*minor
  int device_count = 0;
  std::string no_device_reason;  // set when device_count == 0
  // The current device, when there is one.
  int device = -1;
  std::string name;
  int cc_major = 0, cc_minor = 0, sm_count = 0, sm_clock_mhz = 0, mem_clock_mhz = 0;
  std::size_t memory_bytes = 0, l2_bytes = 0;
  bool sage2_supported = false;
};

inline std::string cuda_version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

inline DeviceInfo query_device() {
  DeviceInfo info;
#if QATTN_HAVE_CUDA
  cudaRuntimeGetVersion(&info.runtime_version);
  cudaDriverGetVersion(&info.driver_version);
  if (cudaError_t e = cudaGetDeviceCount(&info.device_count); e != cudaSuccess) {
    (void)cudaGetLastError();
    info.device_count = 0;
    info.no_device_reason = info.driver_version == 0
                                ? std::string("no CUDA driver (libcuda) on this machine")
                                : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    return info;
  }
  if (info.device_count == 0) {
    info.no_device_reason = "the CUDA driver reports no device";
    return info;
  }
  cudaGetDevice(&info.device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, info.device);
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.memory_bytes = prop.totalGlobalMem;
  info.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, info.device) == cudaSuccess)
    info.sm_clock_mhz = khz / 1000;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, info.device) == cudaSuccess)
    info.mem_clock_mhz = khz / 1000;
  (void)cudaGetLastError();
  info.sage2_supported = qattn_device_supported(info.device) != 0;
#else
  info.no_device_reason = "this build of qattn has no CUDA (configured with QATTN_CUDA=OFF)";
#endif
  return info;
}

inline nlohmann::json to_json(const DeviceInfo& d) {
  nlohmann::json j = {
      {"qattn", qattn_version_string()},
      {"built_with_cuda", d.built_with_cuda},
      {"cuda_runtime", d.built_with_cuda ? cuda_version_string(d.runtime_version) : ""},
      {"driver", d.driver_version ? cuda_version_string(d.driver_version) : ""},
      {"device_count", d.device_count}};
  if (d.device_count == 0) {
    j["no_device_reason"] = d.no_device_reason;
    return j;
  }
  j["device"] = d.device;
  j["gpu"] = d.name;
  j["compute_capability"] = std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor);
  j["sm_count"] = d.sm_count;
  j["sm_clock_mhz"] = d.sm_clock_mhz;
  j["memory_clock_mhz"] = d.mem_clock_mhz;
  j["memory_bytes"] = d.memory_bytes;
  j["l2_bytes"] = d.l2_bytes;
  j["kernels"] = {{"sage2_fwd_int8_fp8_sm90a", d.sage2_supported}};
  return j;
}

}  // namespace qattn::cli
