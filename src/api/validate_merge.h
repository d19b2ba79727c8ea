// Validation of qattn_merge (qattn_merge_params): the struct-size rule, the shape, the
// tensors and arrays, and that nothing it writes overlaps what it reads. Host
// arithmetic on values and addresses only, as validate.h and validate_kv.h.
#pragma once

#include <array>

#include "api/validate.h"
#include "qattn/qattn.h"

namespace qattn::api {

// Reads the caller's struct into `out` (the struct-size rule) and validates it.
qattn_status read_merge(const char* fn, const qattn_merge_params* caller, qattn_merge_params* out);

// The buffers of validated parameters, for the device checks: part, part_lse, acc,
// acc_lse, out (absent: data NULL).
std::array<BufferSpan, 5> buffer_spans(const qattn_merge_params& p);

}  // namespace qattn::api
