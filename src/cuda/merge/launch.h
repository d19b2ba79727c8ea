// Host entry of the merge of partial attention outputs (qattn_merge). The api layer
// validates the parameters before it calls this.
#pragma once

#include "qattn/qattn.h"

namespace qattn::merge {

// Enqueues the merge on `stream`; returns cudaSuccess or the launch's CUDA error.
int launch_merge(const qattn_merge_params& p, void* stream);

}  // namespace qattn::merge
