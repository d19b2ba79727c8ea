// The SageAttention2-8b forward on Hopper (src/cuda/sage2_fwd/) as a kernel family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::ForwardFamily& sage2_fwd_sm90();

}  // namespace qattn::families
