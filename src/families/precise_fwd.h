// The 16-bit ("precise") forward on Hopper (src/cuda/precise_fwd/) as a kernel family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::ForwardFamily& precise_fwd_sm90();

}  // namespace qattn::families
