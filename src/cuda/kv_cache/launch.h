// Host entry points of the KV-cache kernels (append.cu, decode.cu), called by the
// family declaration (families/kv_cache.cpp) with the library's validated copies of
// the call and its cache. Each enqueues on `stream`, returns a cudaError_t (0 =
// success) and never synchronizes.
#pragma once

#include <cstdint>

#include "qattn/qattn.h"

namespace qattn::kv_cache {

int launch_append(const qattn_kv_append_params& p, const qattn_kv_cache& c, void* stream);

// splits >= 1 chunks of each sequence's keys; with splits > 1 the partials go to
// `workspace` (decode_workspace_bytes) and a merge kernel writes o and lse.
int launch_decode(const qattn_kv_decode_params& p, const qattn_kv_cache& c, int32_t splits,
                  void* workspace, void* stream);

}  // namespace qattn::kv_cache
