// Declaration of the merge of partial attention outputs (qattn_merge).
#pragma once

#include "api/family.h"

namespace qattn::families {

const api::MergeFamily& merge_sm90();

}  // namespace qattn::families
