// The head-dim-256 SageAttention2-8b forward on Hopper (src/cuda/sage2_wide/) as a
// kernel family: head dims 129..256.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::ForwardFamily& sage2_wide_sm90();

}  // namespace qattn::families
