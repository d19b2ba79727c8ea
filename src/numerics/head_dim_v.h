// V's head dim of a forward call: qattn_fwd_params.head_dim_v, where 0 (the default)
// means Q's and K's head_dim. The API's checks and the launches use this one rule.
#pragma once

namespace qattn::numerics {

constexpr int value_head_dim(int head_dim, int head_dim_v) {
  return head_dim_v > 0 ? head_dim_v : head_dim;
}

}  // namespace qattn::numerics
