// Precision "auto" on Hopper (SA2-8b, the precision guard and the 16-bit forward on the
// heads it flags) as a kernel family.
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::ForwardFamily& sage2_auto_sm90();

}  // namespace qattn::families
