// Host entry point of the 16-bit ("precise") forward for Hopper (sm_90a): Q·Kᵀ and P·V
// on BF16/FP16 wgmma in the inputs' own type, FP32 accumulation, no quantization and no
// pass before the attention kernel. src/emulate/precision.cpp's precise_options() is
// its contract. The api layer validates and resolves defaults first.
#pragma once

#include "qattn/qattn.h"

namespace qattn::precise {

// Enqueues the attention kernel on `stream`; returns cudaSuccess or the first CUDA
// error; never synchronizes. Needs no workspace.
int launch_forward(const qattn_fwd_params& p, void* stream);

}  // namespace qattn::precise
