// Host entry point of the 16-bit ("precise") forward for Hopper (sm_90a): Q·Kᵀ and P·V
// on BF16/FP16 wgmma in the inputs' own type, FP32 accumulation, no quantization and no
// pass before the attention kernel. src/emulate/precision.cpp's precise_options() is
// its contract. The api layer validates and resolves defaults first.
#pragma once

#include "cuda/precision_guard/launch.h"
#include "qattn/qattn.h"

namespace qattn::precise {

// Enqueues the attention kernel on `stream`; returns cudaSuccess or the first CUDA
// error; never synchronizes. Needs no workspace. With `guard` (precision "auto"), only
// the heads whose guard maxima the rule flags run; the others keep what o and lse hold.
int launch_forward(const qattn_fwd_params& p, void* stream, const guard::Stats* guard = nullptr);

}  // namespace qattn::precise
