// The row order of the transposed Q-side operands (qt_i8, dot_i8 in workspace.h).
//
// dV = P̂ᵀ·dÔ and dK = dŜᵀ·Q̂ take P̂ᵀ / dŜᵀ from registers: the wgmma accumulator of
// Sᵀ (KV rows × Q columns) becomes the A operand of the next product, whose reduction
// runs over the Q columns. (A warp's m64nN accumulator and 8-bit k32 A fragment have
// mma.sync m16n8k32's layouts; the dQ kernel's dŜ staging reads the same slots.) A
// thread holds accumulator columns 8n + 2t + {0,1} but A's k slots 4t + {0..3}; rather
// than exchange values between lanes, each 16-wide k group is read in a permuted order:
// A slot s holds Q column π(s), and the B operand (Qᵀ or dOᵀ, one row per head-dim
// channel) stores Q row π(s) at position s, so the products pair up as before.
// π(4t + u) = 8·(u / 2) + 2t + u % 2 within each group of 16.
#pragma once

#include "cuda/sagebwd/workspace.h"

namespace qattn::sagebwd {

inline constexpr int kQBlockRows = kQBlock;   // 64 query rows per block
inline constexpr int kKvTileRows = kKvTile;   // 128 tokens per KV tile

__host__ __device__ constexpr int k_slot_row(int s) {
  return (s & ~15) + 8 * ((s & 3) >> 1) + 2 * ((s & 15) >> 2) + (s & 1);
}

// The token order σ of dQ = dŜ·K̂'s reduction (the columns of K̂ᵀ, kt_i8 in workspace.h,
// and of the staged dŜ rows): within each group of 16 tokens, tokens m and m + 8 side by
// side. A thread's dŜᵀ fragment holds tokens g and g + 8 of each of its Q columns, so a
// pair is one 16-bit element and stmatrix's transposing store writes the Q-row-major dŜ
// a 16-byte row at a time. The INT32 sums do not depend on the order of their terms.
__host__ __device__ constexpr int kv_pos_of_token(int tok) {
  return (tok & ~15) | ((tok & 7) << 1) | ((tok >> 3) & 1);
}
__host__ __device__ constexpr int kv_token_at(int pos) {
  return (pos & ~15) | ((pos & 1) << 3) | ((pos & 15) >> 1);
}
static_assert(kv_token_at(kv_pos_of_token(13)) == 13 && kv_pos_of_token(9) == 3 &&
                  kv_token_at(2) == 1,
              "σ and its inverse");

}  // namespace qattn::sagebwd
