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

}  // namespace qattn::sagebwd
