// The consumers' two MMAs of a turn, each a chain of k32 wgmma steps committed as one
// group: S = Q·Kᵀ (INT8, both operands in shared memory) and O_tile = P·[V | ones]
// (E4M3, P from registers).
#pragma once

#include <cstdint>

#include "cuda/hopper/wgmma.cuh"

namespace qattn::sage2 {

// S (64 x 128, s32) = the warpgroup's 64 rows of the INT8 Q tile · the K tile.
template <int D, hopper::Swizzle kSwizzle>
__device__ __forceinline__ void qk_mma(int32_t (&acc_s)[64], const uint8_t* q_rows,
                                       const uint8_t* k_tile) {
  const uint64_t desc_q = hopper::make_smem_desc<kSwizzle>(q_rows);
  const uint64_t desc_k = hopper::make_smem_desc<kSwizzle>(k_tile);
  hopper::wgmma_m64n128k32_s8_ss_init(acc_s, desc_q, desc_k);
#pragma unroll
  for (int kk = 1; kk < D / 32; ++kk)
    hopper::wgmma_m64n128k32_s8_ss(acc_s, hopper::desc_advance(desc_q, kk * 32),
                                   hopper::desc_advance(desc_k, kk * 32));
  hopper::wgmma_commit();
}

// O_tile (64 x (D + 8), f32) = 448·P (E4M3 A fragments) · the V stage (Vᵀ and the ones rows).
template <int D, hopper::Swizzle kSwizzle, int kBlockN, int kOAcc>
__device__ __forceinline__ void pv_mma(float (&acc_o)[kOAcc],
                                       const uint32_t (&a_p)[kBlockN / 32][4],
                                       const uint8_t* v_stage) {
  const uint64_t desc_v = hopper::make_smem_desc<kSwizzle>(v_stage);
  if constexpr (D == 128) {
    hopper::wgmma_m64n136k32_e4m3_rs_init(acc_o, a_p[0], desc_v);
#pragma unroll
    for (int kk = 1; kk < kBlockN / 32; ++kk)
      hopper::wgmma_m64n136k32_e4m3_rs(acc_o, a_p[kk], hopper::desc_advance(desc_v, kk * 32));
  } else {
    hopper::wgmma_m64n72k32_e4m3_rs_init(acc_o, a_p[0], desc_v);
#pragma unroll
    for (int kk = 1; kk < kBlockN / 32; ++kk)
      hopper::wgmma_m64n72k32_e4m3_rs(acc_o, a_p[kk], hopper::desc_advance(desc_v, kk * 32));
  }
  hopper::wgmma_commit();
}

}  // namespace qattn::sage2
