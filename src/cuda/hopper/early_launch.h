// Host side of programmatic dependent launch: a kernel launched with early_launch may
// start before the previous kernel in the stream ends (once all that kernel's CTAs have
// called launch_dependents, sync.cuh); it calls grid_dependency_wait before it reads
// that kernel's outputs.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace qattn::hopper {

template <typename... Params, typename... Args>
cudaError_t early_launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &early;
  cfg.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
      e != cudaSuccess)
    return e;
  return cudaGetLastError();
}

}  // namespace qattn::hopper
