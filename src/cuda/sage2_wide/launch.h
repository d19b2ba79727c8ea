// Host entry points of the head-dim-256 SA2-8b forward (sage2_wide_sm90): head dims
// 129..256, zero-padded to 256. The api layer validates and resolves defaults first.
#pragma once

#include <cstddef>

#include "qattn/qattn.h"

namespace qattn::sage2_wide {

// The workspace: the SA2-8b forward's layout (sage2_fwd/launch.h) at D = 256, with the
// quantized Q, its scales and q·c (the Q pass writes them; the kernel loads them).
std::size_t workspace_bytes(const qattn_fwd_params& p);

// Enqueues the K/V passes, the Q pass and the attention kernel on `stream`; returns a
// cudaError_t and never synchronizes.
int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream);

// Only the attention kernel, on a workspace an earlier launch_forward with the same
// parameters filled (kernel-only benchmarks).
int launch_attention_only(const qattn_fwd_params& p, void* workspace, void* stream);

}  // namespace qattn::sage2_wide
