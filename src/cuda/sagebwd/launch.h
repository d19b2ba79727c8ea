// Host entry point of the SageBwd backward on Hopper (sm_90a). The api layer validates
// the parameters and resolves defaults (sm_scale) before it calls this.
#pragma once

#include "qattn/qattn.h"

namespace qattn::sagebwd {

// Enqueues preprocessing, the dK/dV kernel and the dQ pass on `stream`. Returns
// cudaSuccess or the first CUDA error; never synchronizes.
int launch_backward(const qattn_bwd_params& p, void* workspace, void* stream);

}  // namespace qattn::sagebwd
