// The SageAttention3 NVFP4 forward on Hopper (src/cuda/sage3_fwd/) as a kernel family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::ForwardFamily& sage3_fwd_sm90();

}  // namespace qattn::families
