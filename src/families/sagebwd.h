// The SageBwd backward on Hopper (src/cuda/sagebwd/) as a kernel family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::BackwardFamily& sagebwd_sm90();

}  // namespace qattn::families
