// The KV-cache append and decode kernels for Hopper (src/cuda/kv_cache/) as a family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::KvCacheFamily& kv_cache_sm90();

}  // namespace qattn::families
