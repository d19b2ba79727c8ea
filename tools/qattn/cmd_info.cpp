// `qattn info`: the library build, the CUDA runtime and driver, the current device,
// and which kernels it can run. Without a GPU it says so and succeeds.
#include <fmt/core.h>

#include "commands.h"
#include "device_info.h"

namespace qattn::cli {

Runner add_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Library build, CUDA, device and supported kernels");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "Print the same as one JSON object");
  return [json] {
    const DeviceInfo d = query_device();
    if (*json) {
      fmt::print("{}\n", to_json(d).dump(2));
      return 0;
    }
    fmt::print("qattn {}\n", qattn_version_string());
    if (!d.built_with_cuda) {
      fmt::print(
          "CUDA:    not built in (CPU-only build: numerics, reference and emulation only)\n");
      return 0;
    }
    fmt::print("CUDA:    built in, runtime {} (linked statically)\n",
               cuda_version_string(d.runtime_version));
    fmt::print("driver:  {}\n", d.driver_version
                                    ? "supports CUDA " + cuda_version_string(d.driver_version)
                                    : std::string("not found"));
    if (d.device_count == 0) {
      fmt::print("device:  none ({})\n", d.no_device_reason);
      fmt::print("kernels: none can run here\n");
      return 0;
    }
    fmt::print("device:  {} of {}: {}\n", d.device, d.device_count, d.name);
    fmt::print("         compute capability {}.{}, {} SMs, SM clock up to {} MHz\n", d.cc_major,
               d.cc_minor, d.sm_count, d.sm_clock_mhz);
    fmt::print("         {:.1f} GiB memory (clock {} MHz), {:.0f} MiB L2\n",
               static_cast<double>(d.memory_bytes) / (1 << 30), d.mem_clock_mhz,
               static_cast<double>(d.l2_bytes) / (1 << 20));
    fmt::print("kernels: SageAttention2-8b forward (INT8 Q·Kᵀ, FP8 P·V, sm_90a): {}\n",
               d.sage2_supported ? "yes" : "no (needs compute capability 9.0)");
    return 0;
  };
}

}  // namespace qattn::cli
