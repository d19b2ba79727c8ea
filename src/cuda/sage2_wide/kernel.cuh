// The head-dim-256 SA2-8b forward on sm_90a (sage2_wide_sm90): INT8 Q·Kᵀ and E4M3 P·V on
// wgmma, one-level accumulation, TMA loads into a two-stage K/V ring.
//
// CTA = 3 warpgroups, 128 query rows per work item (scheduler.cuh). Warpgroup 0: one
// loader thread (producer.cuh). Warpgroups 1 and 2: consumers of 64 rows each. A
// consumer's turn on 64-key tile `it`: O rescaled by the tile's alpha, then Q·Kᵀ of the
// next tile (8 × m64n64k32 INT8) and P·V of this one (2 × 2 × m64n128k32 E4M3,
// straight into O) issued together; the next tile's softmax runs under the P·V, and adds
// its 448·P to the FP32 row sums. docs/sage2-wide-kernel.md draws it. Two variants
// (traits.cuh, Widths): the full one, and the MLA one (Q·K over 192 channels: 6 k32
// steps; P·V over V's first 128 channels: the lo product only).
#pragma once

#include <cuda.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/common/fragment.cuh"
#include "cuda/common/mask.cuh"
#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "cuda/sage2_fwd/softmax.cuh"
#include "cuda/sage2_wide/epilogue.cuh"
#include "cuda/sage2_wide/pipeline.cuh"
#include "cuda/sage2_wide/producer.cuh"
#include "cuda/sage2_wide/scheduler.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {

// S (64 x 64, s32) = the warpgroup's 64 INT8 Q rows · the K tile, kQK / 32 k32 steps over
// the two 128-byte column halves of both (8 at kQK = 256, 6 at 192).
template <int kQK>
__device__ __forceinline__ void qk_mma(int32_t (&acc_s)[32], const uint8_t* q_rows,
                                       const uint8_t* k_tile) {
#pragma unroll
  for (int kk = 0; kk < kQK / 32; ++kk) {
    const int half = kk / 4, at = (kk % 4) * 32;
    const uint64_t dq = hopper::desc_advance(
        hopper::make_smem_desc<kQKSwizzle>(q_rows + half * kQHalfBytes), at);
    const uint64_t dk = hopper::desc_advance(
        hopper::make_smem_desc<kQKSwizzle>(k_tile + half * kKHalfBytes), at);
    if (kk == 0)
      hopper::wgmma_m64n64k32_s8_ss<false>(acc_s, dq, dk);
    else
      hopper::wgmma_m64n64k32_s8_ss<true>(acc_s, dq, dk);
  }
  hopper::wgmma_commit();
}

// O += 448·P (E4M3 A fragments) · the V stage: channels 0..127 into lo and, at kV = 256,
// 128..255 into hi.
template <int kV>
__device__ __forceinline__ void pv_mma(float (&lo)[OAcc<kV>::kLo], float (&hi)[OAcc<kV>::kHiRegs],
                                       const uint32_t (&a_p)[kBlockN / 32][4],
                                       const uint8_t* v_stage) {
  const uint64_t d_lo = hopper::make_smem_desc<kVSwizzle>(v_stage);
  const uint64_t d_hi = hopper::make_smem_desc<kVSwizzle>(v_stage + 128 * kVRowBytes);
#pragma unroll
  for (int kk = 0; kk < kBlockN / 32; ++kk) {
    hopper::wgmma_m64n128k32_e4m3_rs(lo, a_p[kk], hopper::desc_advance(d_lo, kk * 32));
    if constexpr (kV > 128)
      hopper::wgmma_m64n128k32_e4m3_rs(hi, a_p[kk], hopper::desc_advance(d_hi, kk * 32));
  }
  hopper::wgmma_commit();
}

// W: the variant's Widths (traits.cuh).
template <typename T, typename W>
__global__ void __launch_bounds__(kThreads, 1)
    sage2_wide_kernel(const __grid_constant__ CUtensorMap tm_q,
                      const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_vt,
                      const __grid_constant__ CUtensorMap tm_o, const WideParams p) {
  extern __shared__ uint8_t smem_raw[];
  // The storage starts at the first 1024-byte boundary (the TMA swizzles).
  const uint32_t align_pad = (1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u;
  auto& s = *reinterpret_cast<SharedStorage*>(smem_raw + align_pad);
  __shared__ Barriers bar;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) bar.init();
  __syncthreads();

  if (warpgroup == 0) {
    hopper::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) loader<W::kV>(p, s, bar, &tm_q, &tm_k, &tm_vt);
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------
  hopper::setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;  // which 64 rows of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const common::FragCoord fc{lane / 4, lane % 4};
  constexpr int kS = kBlockN / 2;  // score elements per thread
  using Softmax = sage2::OnlineSoftmax<kS, 4, 0>;

  struct Item {
    int m_block, bh_q, n_tiles;
    int local;       // ordinal on this CTA: its Q slot and phase
    int first_iter;  // tiles consumed before it: the ring's stage and phase
    int kv_first;    // its first 64-key tile
    __device__ int slot() const { return Ring<kQSlots>{local}.index(); }
    // Tile `it` of the item in the K and V rings.
    __device__ Ring<kKStages> ktile(int it) const { return {first_iter + it}; }
    __device__ Ring<kVStages> vtile(int it) const { return {first_iter + it}; }
    __device__ int stage(int it) const { return ktile(it).index(); }
    __device__ uint32_t phase(int it) const { return ktile(it).phase(); }
    __device__ int vstage(int it) const { return vtile(it).index(); }
    __device__ uint32_t vphase(int it) const { return vtile(it).phase(); }
  };
  auto row_in_block = [&](int r) { return cw * 64 + warp * 16 + fc.g + 8 * r; };
  auto row_first = [&](const Item& w) { return w.m_block * kBlockM + cw * 64; };
  const bool store_thread = threadIdx.x % 128 == 0;

  int next_local = 0, next_iter = 0;
  auto open_item = [&](Item& w) -> bool {
    const Ring<kQSlots> q{next_local};
    hopper::mbarrier_wait(&bar.q_full[q.index()], q.phase());
    const SlotItem si = bar.item[q.index()];
    const TileSpan span = si.m_block >= 0 ? item_tiles(p, si) : TileSpan{0, 1};
    w = Item{si.m_block, si.bh_q, span.count, next_local, next_iter, span.first};
    ++next_local;
    next_iter += w.n_tiles;
    return w.m_block >= 0;
  };

  int32_t acc_s[kS];
  uint32_t a_p[kS / 16][4];  // 448·P of the tile whose P·V is next, as E4M3 A fragments
  float alpha[2] = {1.f, 1.f};  // the O rescale that goes with a_p

  auto issue_qk = [&](const Item& w, int it) {
    qk_mma<W::kQK>(acc_s, s.q[w.slot()] + cw * 64 * kHalfBytes, s.k[w.stage(it)]);
  };
  // q_scale · k_scale of this thread's score groups (log2 units), read right after the
  // tile's Q·Kᵀ is issued. Lanes 0-3 read the K scales (and free the stage later).
  auto tile_scale = [&](const Item& w, int it) {
    const float ks = lane < 4 ? s.k_scale[w.stage(it)][lane] : 0.f;
    const float qs = s.side[w.slot()].q_scale[row_in_block(0) / 16 * 8 + fc.g];
    const float qk = qs * __shfl_sync(0xffffffff, ks, fc.t);
    return qk < FLT_MIN ? FLT_MIN : qk;
  };
  auto softmax_tile = [&](const Item& w, int it, float qk, Softmax& sm, float(&x)[kS],
                          float(&alpha_out)[2]) {
    hopper::fence_operands(acc_s);
    if (lane < 4) hopper::mbarrier_arrive(&bar.k_empty[w.stage(it)]);
    const int kv0 = (w.kv_first + it) * kBlockN;
    numerics::KeyRule rule = p.keys;
    rule.kv_len = bar.item[w.slot()].kv_len;
    const common::KeyMask mask{rule};
    // Only tiles that cut some row's interval test their elements.
    if (kv0 + kBlockN - 1 > rule.last_key(row_first(w)) ||
        kv0 < rule.first_key(row_first(w) + 63))
      mask.apply(acc_s, fc, kv0, w.m_block * kBlockM + row_in_block(0));
    sm.step(acc_s, qk, x, alpha_out);
    // The row sums in FP32 from the same 448·P, per thread (its 16 keys of each row; the
    // quad's partials are added in the epilogue). Not the MMA's ones columns: one-level
    // accumulation adds every product to a running l, and the hardware's truncation of
    // those all-positive products lowered l by 0.28 (log) at 16K keys (bench/NOTES.md v48).
    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int i = 0; i < kS; ++i) sum[(i % 4) / 2][(i / 4) % 2] += x[i];
    sm.add_row_sums(sum[0][0] + sum[0][1], sum[1][0] + sum[1][1], alpha_out);
  };
  auto wait_ahead = [&](const Item& w, int it) {
    hopper::mbarrier_wait(&bar.v_full[w.vstage(it)], w.vphase(it));
    if (it + 1 < w.n_tiles) hopper::mbarrier_wait(&bar.k_full[w.stage(it + 1)], w.phase(it + 1));
  };

  using Acc = OAcc<W::kV>;
  float o_lo[Acc::kLo], o_hi[Acc::kHiRegs];
  auto zero_o = [&] {
#pragma unroll
    for (int i = 0; i < Acc::kLo; ++i) o_lo[i] = 0.f;
#pragma unroll
    for (int i = 0; i < Acc::kHiRegs; ++i) o_hi[i] = 0.f;
  };
  // O and the row sums times alpha before a tile's P·V (one level). A warp whose rows all
  // keep their max (alpha = 1 exactly: the same bits) skips it.
  auto rescale_o = [&] {
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < Acc::kLo; ++i) o_lo[i] *= alpha[(i % 4) / 2];
#pragma unroll
      for (int i = 0; i < Acc::kHi; ++i) o_hi[i] *= alpha[(i % 4) / 2];
    }
    // All multiplies before the P·V issue: without this fence the compiler moved some
    // after the first wgmma, and ptxas then serialized the P·V wgmmas (C7519).
    hopper::fence_operands_f32(o_lo);
    hopper::fence_operands_f32(o_hi);
  };

  auto write_output = [&](const Item& w, const Softmax& sm) {
    const ItemSide& side = s.side[w.slot()];
    uint8_t* stage = s.o[cw];
    // The staging is free once the previous item's TMA store has read it.
    if (store_thread) hopper::bulk_wait_group_read<0>();
    hopper::named_barrier_sync(NamedBarrier::kOStaged + cw, NamedBarrier::kOStagedThreads);
    float l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the quad's four partial row sums
      l[r] = sm.l[r] + __shfl_xor_sync(0xffffffff, sm.l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    }
    stage_output<T, W::kV>(o_lo, o_hi, l, fc, warp * 16 + fc.g, side.v_amax, stage);
    store_lse(p, sm.m, l, fc, w.bh_q, w.m_block * kBlockM, row_in_block(0), side.q_dot_c);
    hopper::fence_proxy_async();  // the TMA store reads what this thread wrote
    hopper::named_barrier_sync(NamedBarrier::kOStaged + cw, NamedBarrier::kOStagedThreads);
    if (p.o_tma_cols < p.head_dim_v) store_output_tail(p, w.bh_q, row_first(w), stage);
    if (store_thread) {
      const int b = w.bh_q / p.heads_q, hq = w.bh_q % p.heads_q;
#pragma unroll
      for (int box = 0; box < W::kV / 64; ++box)
        if (box * 64 < p.o_tma_cols)
          hopper::tma_store_4d(&tm_o, stage + box * kOBoxBytes, box * 64, row_first(w), hq, b);
      hopper::bulk_commit_group();
    }
    // The slot (Q tile and side data) is free once every thread is done with it.
    hopper::mbarrier_arrive(&bar.q_empty[w.slot()]);
  };

  Item cur;
  if (!open_item(cur)) return;
  Softmax sm_cur;
  zero_o();
  {  // the pipeline's first tile: nothing to overlap it with yet
    hopper::mbarrier_wait(&bar.k_full[cur.stage(0)], cur.phase(0));
    hopper::wgmma_fence();
    issue_qk(cur, 0);
    const float qk = tile_scale(cur, 0);
    wait_ahead(cur, 0);
    hopper::wgmma_wait<0>();
    float x[kS];
    softmax_tile(cur, 0, qk, sm_cur, x, alpha);
    sage2::pack_p_fragments(x, a_p);
  }

  // One round on the tensor cores: P·V of tile `it` of cur and, when there is one, Q·Kᵀ
  // of the next tile (tile it + 1 of cur, or the first of the next item). No branch
  // around a wgmma (ptxas keeps them asynchronous only on straight-line paths: C7520).
  auto turn = [&](int it, const Item& nw, int nit, Softmax& sm_next, auto has_next,
                  auto new_item) {
    const int st = cur.vstage(it);
    float qk_next = 0.f;
    if constexpr (new_item) hopper::mbarrier_wait(&bar.k_full[nw.stage(nit)], nw.phase(nit));
    rescale_o();
    hopper::wgmma_fence();
    if constexpr (has_next) issue_qk(nw, nit);
    pv_mma<W::kV>(o_lo, o_hi, a_p, s.v[st]);
    if constexpr (has_next) {
      qk_next = tile_scale(nw, nit);
      wait_ahead(nw, nit);
    }
    float x[kS], alpha_next[2];
    if constexpr (has_next) {
      // The next tile's softmax while P·V(it) computes; its P waits in x until P·V(it)
      // has read a_p.
      hopper::wgmma_wait<1>();
      softmax_tile(nw, nit, qk_next, sm_next, x, alpha_next);
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operands_f32(o_lo);
    hopper::fence_operands_f32(o_hi);
    hopper::fence_operands(a_p);
    __syncwarp();
    if (lane == 0) hopper::mbarrier_arrive(&bar.v_empty[st]);
    if constexpr (has_next) {
      sage2::pack_p_fragments(x, a_p);
      alpha[0] = alpha_next[0];
      alpha[1] = alpha_next[1];
    }
  };

  while (true) {
    for (int it = 0; it + 1 < cur.n_tiles; ++it)
      turn(it, cur, it + 1, sm_cur, std::true_type{}, std::false_type{});
    Item nxt;
    Softmax sm_next;
    const bool more = open_item(nxt);
    if (more)
      turn(cur.n_tiles - 1, nxt, 0, sm_next, std::true_type{}, std::true_type{});
    else
      turn(cur.n_tiles - 1, cur, 0, sm_next, std::false_type{}, std::false_type{});
    write_output(cur, sm_cur);
    if (!more) break;
    cur = nxt;
    sm_cur = sm_next;
    zero_o();
  }
  // The last stores must have read shared memory before the CTA exits.
  if (store_thread) hopper::bulk_wait_group_read<0>();
}

}  // namespace qattn::sage2_wide
