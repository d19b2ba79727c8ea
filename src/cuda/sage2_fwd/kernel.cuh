// SageAttention2-8b forward on sm_90a: INT8 Q·Kᵀ and E4M3 P·V on wgmma, TMA loads
// into a ring of shared-memory stages, two-level accumulation.
//
// CTA = 3 warpgroups and 128 query rows (one work item at a time; scheduler.cuh).
// Warpgroup 0 is the producer: the K/V loader thread fills the ring of kStages K and Vᵀ
// stages, the Q loader thread claims the work items and loads each one's 16-bit Q tile
// (producer.cuh), and two warps quantize it to INT8 in shared memory (q_quantizer.cuh,
// q_tile.cuh). Warpgroups 1 and 2 are consumers, 64 query rows each: the main loop
// below (`turn`: one P·V and the next Q·Kᵀ with its softmax; mma.cuh, softmax.cuh) and the
// epilogue (epilogue.cuh); registers move to them with setmaxnreg. The four-warp shape
// (kQuantWarps = 4) adds a fourth warpgroup for the two loaders, and all of warpgroup 0
// quantizes. Every barrier and its arrival count: pipeline.cuh (Barriers, NamedBarrier);
// ring positions: PipelineState. docs/sage2-kernel-pipeline.md draws the protocol.
//
// The consumers' loop is written in the kernel's body, not in a function of its own:
// moved into an (inlined) function, it compiled to another consumer loop (other machine
// code for the same source), and this kernel's machine code is the measured one.
#pragma once

#include <cuda.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/common/fragment.cuh"
#include "cuda/common/mask.cuh"
#include "cuda/common/work_order.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "cuda/sage2_fwd/epilogue.cuh"
#include "cuda/sage2_fwd/mma.cuh"
#include "cuda/sage2_fwd/pipeline.cuh"
#include "cuda/sage2_fwd/producer.cuh"
#include "cuda/sage2_fwd/q_quantizer.cuh"
#include "cuda/sage2_fwd/scheduler.cuh"
#include "cuda/sage2_fwd/softmax.cuh"
#include "cuda/sage2_fwd/traits.cuh"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {

// kPolyChunks (d=128 only): the softmax's exps of that many column chunks in each 8 on the
// FMA pipe (numerics::exp2_poly) instead of MUFU; 0 or 1 (launch.cu chooses).
// kAttnMask: the kernel of an attn_mask (attn_mask.cuh), its own instantiation so
// that the others' machine code is the measured one; kAdditive (with kAttnMask) makes
// the mask additive: cut tiles add the caller's values (OnlineSoftmax::step_additive).
// kVarlen: the kernel of a packed batch (varlen.cuh), likewise.
template <int D, typename T, int kConsumerRegs, int kQuantWarps = 2, int kPolyChunks = 0,
          bool kAttnMask = false, bool kVarlen = false, bool kAdditive = false>
__global__ void __launch_bounds__(kCtaThreads<kQuantWarps>, 1)
    sage2_fwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_vt,
                     const __grid_constant__ CUtensorMap tm_o, const AttentionParams p) {
  using Tr = KernelTraits<D>;
  constexpr int kThreads = kCtaThreads<kQuantWarps>;
  constexpr int kProducerRegs = kProducerRegsFor<kConsumerRegs, kQuantWarps>;
  using Roles = ProducerRoles<kQuantWarps>;
  constexpr int kQuantThreads = Roles::kQuantThreads, kQuantFirst = Roles::kQuantFirst;
  constexpr int kKvLoader = Roles::kKvLoader, kQLoader = Roles::kQLoader;
  extern __shared__ uint8_t smem_raw[];
  // The storage starts at the first 1024-byte boundary (the TMA 128B swizzle). The
  // __shared__ array itself is offset, not an integer address: the compiler then knows
  // every access is to shared memory (LDS/STS, 32-bit addresses) instead of issuing
  // generic loads and stores with 64-bit address arithmetic (the Q quantizer took ~11K
  // cycles per tile with generic ones). The consumers: consumer_storage.
  const uint32_t align_pad = (1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u;
  auto& s = *reinterpret_cast<SharedStorage<D>*>(smem_raw + align_pad);
  const int warpgroup = threadIdx.x / 128;
  const int num_items = p.num_m_blocks * p.heads_q * p.batch;
  __shared__ std::conditional_t<kVarlen, VarlenBarriers<D, kQuantWarps>, Barriers<D, kQuantWarps>>
      bar;

  if (threadIdx.x == 0) bar.init();
  {
    // The ones rows of every V stage (0x38 = E4M3 1.0; equal bytes need no swizzle),
    // written once: the TMA fills only the D rows before them.
    constexpr int kWords = Tr::kVOnesRows * Tr::kBlockN / 4;
    for (int i = threadIdx.x; i < Tr::kStages * kWords; i += kThreads)
      reinterpret_cast<uint32_t*>(s.v[i / kWords] + D * Tr::kBlockN)[i % kWords] = 0x38383838u;
    hopper::fence_proxy_async();  // read by wgmma
  }
  __syncthreads();
  const bool want_q_dot_c = p.lse != nullptr || p.q_debug.q_dot_c != nullptr;
  const uint32_t q_slot_bytes = q_buffer_bytes<D>(want_q_dot_c);

  // The first item's Q is the caller's input, final before this grid could launch (the
  // chain starts with the statistics kernel, launched in stream order), so it is loaded
  // (on q0_tile) and quantized before the grid-dependency wait; the side data of its
  // slot are outputs of the quantization kernels and complete q_full[0] after the wait.
  // Launched early (programmatic dependent launch) while those kernels end, the CTA
  // waits for them only in the roles that read their outputs (the two loaders and the
  // quantizer, before its side data); the consumers read none.
  // (The varlen kernel's items come from the plan, an output: it loads none before.)
  if (!kVarlen && threadIdx.x == kQLoader) {
    hopper::tma_prefetch_descriptor(&tm_q);
    hopper::mbarrier_arrive_expect_tx(&bar.q0_tile, QTileLayout<D>::kInBytes);
    load_q_tile<D>(s, &tm_q, 0, decode_item(p, static_cast<int>(blockIdx.x)), &bar.q0_tile);
  }

  if (warpgroup == 0 || (kQuantWarps == 4 && warpgroup == 3)) {
    // ---- producer ------------------------------------------------------------------------
    hopper::setmaxnreg_dec<kProducerRegs>();
    // The quantizer's threads; with kQuantFirst = 0 the first test is always true (186).
#pragma nv_diag_suppress 186
    if (threadIdx.x >= kQuantFirst && threadIdx.x < kQuantFirst + kQuantThreads)
#pragma nv_diag_default 186
      q_quantizer<D, T, kQuantWarps, kProducerRegs, kVarlen>(p, smem_raw, align_pad, s, bar,
                                                             want_q_dot_c);
    // Two loader threads with separate loops, so each fits the warpgroup's registers.
    if (threadIdx.x == kQLoader)
      q_loader<D, kVarlen>(p, s, s.side_in, bar, &tm_q, num_items, want_q_dot_c, q_slot_bytes);
    if (threadIdx.x == kKvLoader)
      kv_loader<D, kAttnMask, kVarlen>(p, s.k, s.k_scale, s.v, bar, &tm_k, &tm_vt);
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------
  // The consumers run one flat pipeline over (item, tile) pairs: the Q·Kᵀ of the next
  // item's first tile is issued with the P·V of this item's last tile, so the next
  // item's first softmax overlaps that P·V and no item starts or ends with the tensor
  // cores idle.
  hopper::setmaxnreg_inc<kConsumerRegs>();
  SharedStorage<D>& cs = consumer_storage<D>(smem_raw, s);
  const int cw = warpgroup - 1;  // which 64 rows of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const common::FragCoord fc{lane / 4, lane % 4};
  // The mask of an item: the call's rule with its batch entry's key-padding length (in
  // the varlen kernel, its sequence's rule, from the item's Q slot).
  auto item_mask = [&](int kv_len, int slot) {
    numerics::KeyRule rule = p.keys;
    rule.kv_len = kv_len;
    if constexpr (kVarlen) rule.offset = bar.seq[slot].offset;
    return common::KeyMask{rule};
  };
  constexpr int kS = Tr::kBlockN / 2;  // score elements per thread
  constexpr int kO = D / 2;            // output elements per thread
  constexpr int kOAcc = kO + 4;        // and the ones columns: row sums
  // An additive mask at d=128: the next tile's softmax after P·V(it) has landed, not under
  // it (its mask values and float scores beside P·V's accumulator spilled; bench/NOTES.md
  // v37, v50).
  constexpr bool kSoftmaxAfterPv = kAdditive && D == 128;
  // Independent max chains per row: 4 at d=128, 2 at d=64  (measured: bench/NOTES.md).
  static_assert(D == 128 || kPolyChunks == 0, "d=64 loses 10-16% with poly exps");
  using Softmax = OnlineSoftmax<kS, D == 64 ? 2 : 4, kPolyChunks>;

  // A work item as a consumer thread sees it.
  struct Item {
    int m_block, bh_q, n_tiles;  // bh_q = b · Hq + hq
    int local;                   // ordinal on this CTA: Q slot and its phase
    int first_iter;              // KV tiles consumed before it: the ring's stage and phase
    int kv_first;                // its first KV tile (the loaders skip the ones before)
    int unmasked_until;          // tiles starting after this key need the mask
    __device__ int slot() const { return PipelineState<kQSlots<D>>{local}.index(); }
    // Where its O is staged: the 16-bit Q buffer of the item after it (quantized by the
    // time the consumers opened that item, which they do before this one's epilogue).
    __device__ int stage_buf() const { return PipelineState<kQinBuffers>{local + 1}.index(); }
    // Tile `it` of the item in the K/V ring.
    __device__ PipelineState<Tr::kStages> tile(int it) const { return {first_iter + it}; }
    __device__ int stage(int it) const { return tile(it).index(); }
    __device__ uint32_t phase(int it) const { return tile(it).phase(); }
  };
  auto row_in_block = [&](int r) { return cw * 64 + warp * 16 + fc.g + 8 * r; };
  auto row_first = [&](const Item& w) { return w.m_block * Tr::kBlockM + cw * 64; };
  // The epilogue stages the warpgroup's 64 rows of O in its half of a 16-bit Q buffer
  // (stage_buf) and one thread stores them with TMA. The buffer may be refilled only
  // once that store has read it: that thread arrives on qin_free later, in
  // resolve_store() after the next MMA issue, when the read is long done.
  int store_buf = -1;  // the buffer whose qin_free arrival waits for a TMA store (one thread)
  const bool store_thread = threadIdx.x % 128 == 0;
  auto resolve_store = [&] {
    if (store_buf >= 0) {
      hopper::bulk_wait_group_read<0>();
      hopper::mbarrier_arrive(&bar.qin_free[store_buf]);
      store_buf = -1;
    }
  };
  // Buffer 0's first phase has no O before it (qin_free): the store threads arrive for it.
  if (store_thread) hopper::mbarrier_arrive(&bar.qin_free[0]);
  // The varlen kernel's epilogue: the LSE and O rows of the item's sequence. A box with
  // rows past the sequence (its last) is written from registers instead of by TMA
  // (store_output_direct). (Generic in `vb`, the varlen kernel's barriers, so the other
  // kernels never compile it.)
  auto write_varlen_output = [&](const Item& w, const auto& o, const Softmax& sm,
                                 const ItemSide<D>& side, uint8_t* stage, auto& vb) {
    const bool whole = vb.seq[w.slot()].rows - cw * 64 >= 64;
    if (whole)
      stage_output<T, kO>(o, sm, fc, warp * 16 + fc.g, side.v_scale, stage);
    else
      store_output_direct<T, kO>(o, sm, fc, warp * 16 + fc.g, side.v_scale, p, w.bh_q % p.heads_q,
                                 vb.seq[w.slot()].q_row + cw * 64,
                                 vb.seq[w.slot()].rows - cw * 64);
    store_lse_varlen(p, sm, fc, w.bh_q % p.heads_q, vb.seq[w.slot()].q_row, vb.seq[w.slot()].rows,
                     row_in_block(0), side.q_dot_c);
    hopper::fence_proxy_async();  // the TMA store reads what this thread wrote
    hopper::named_barrier_sync(NamedBarrier::kOStaged + cw, NamedBarrier::kOStagedThreads);
    if (whole && p.o_tma_cols < p.head_dim_v)  // after the barrier: reads other threads' rows
      store_output_tail_varlen(p, w.bh_q % p.heads_q, vb.seq[w.slot()].q_row + cw * 64, stage);
    if (store_thread) {
      if (whole) {
#pragma unroll
        for (int box = 0; box < D / 64; ++box)
          if (box * 64 < p.o_tma_cols)
            hopper::tma_store_4d(&tm_o, stage + box * kOBoxBytes, box * 64,
                                 vb.seq[w.slot()].q_row + cw * 64, w.bh_q % p.heads_q, 0);
      }
      hopper::bulk_commit_group();
      store_buf = w.stage_buf();
    }
    hopper::mbarrier_arrive(&bar.q_empty[w.slot()]);
  };
  auto write_output = [&](const Item& w, const float(&o)[kO], const Softmax& sm) {
    const ItemSide<D>& side = cs.side[w.slot()];
    resolve_store();
    uint8_t* stage = cs.q_in[w.stage_buf()] + cw * (D / 64) * kOBoxBytes;
    if constexpr (kVarlen) {
      write_varlen_output(w, o, sm, side, stage, bar);
      return;
    }
    stage_output<T, kO>(o, sm, fc, warp * 16 + fc.g, side.v_scale, stage);
    store_lse(p, sm, fc, w.bh_q, w.m_block * Tr::kBlockM, row_in_block(0), side.q_dot_c);
    hopper::fence_proxy_async();  // the TMA store reads what this thread wrote
    hopper::named_barrier_sync(NamedBarrier::kOStaged + cw, NamedBarrier::kOStagedThreads);
    if (p.o_tma_cols < p.head_dim_v)  // after the barrier: reads other threads' staged rows
      store_output_tail(p, w.bh_q, row_first(w), stage);
    if (store_thread) {
      const int b = w.bh_q / p.heads_q, hq = w.bh_q % p.heads_q;
#pragma unroll
      for (int box = 0; box < D / 64; ++box)
        if (box * 64 < p.o_tma_cols)
          hopper::tma_store_4d(&tm_o, stage + box * kOBoxBytes, box * 64, row_first(w), hq, b);
      hopper::bulk_commit_group();
      store_buf = w.stage_buf();
    }
    // The slot (INT8 Q tile and side data) is free once every thread is done with it.
    hopper::mbarrier_arrive(&bar.q_empty[w.slot()]);
  };

  int next_local = 0, next_iter = 0;
  // d=64: the next item's Q and first K tile were seen ready by the last turn of this one
  // (wait_ahead): open_item and the item's first turn then skip their checks (d=64
  // +1-3%, d=128 0-3% slower; measured: bench/NOTES.md).
  bool next_item_ready = false;
  // Opens this CTA's next item: waits for its Q and side data. Every item has a KV tile
  // (item_tiles: the rows of an item that see no key are masked out of one).
  auto open_item = [&](Item& w) -> bool {
    const PipelineState<kQSlots<D>> q{next_local};
    const int slot = q.index();
    // The Q of this item may need the slot of a store still pending (a 1-tile item
    // has no turn in between to release it): release it before waiting.
    resolve_store();
    if (!next_item_ready) hopper::mbarrier_wait(&bar.q_ready[slot], q.phase());
    const SlotItem si = bar.item[slot];
    const common::KeyMask mask = item_mask(si.kv_len, slot);
    const int first_row = si.m_block * Tr::kBlockM + cw * 64;
    common::TileSpan span;
    if constexpr (kVarlen)
      span = varlen_item_tiles(p, si, bar.seq[slot].rows + si.m_block * Tr::kBlockM);
    else
      span = item_tiles<kAttnMask>(p, si);
    w = Item{si.m_block, si.bh_q,    span.count,
             next_local, next_iter,  span.first, mask.unmasked_until(first_row)};
    ++next_local;
    next_iter += w.n_tiles;
    return w.m_block >= 0;
  };

  int32_t acc_s[kS];
  uint32_t a_p[kS / 16][4];  // 448·P of the tile whose P·V is next, as E4M3 A fragments
  float alpha[2];            // the O rescale that goes with a_p

  // Callers wait on the stage's "full" barrier first.
  auto issue_qk = [&](const Item& w, int it) {
    qk_mma<D, Tr::kQKSwizzle>(acc_s, cs.q[w.slot()] + cw * 64 * D, cs.k[w.stage(it)]);
  };
  auto issue_pv = [&](int st, float(&acc_o)[kOAcc]) {
    pv_mma<D, Tr::kVSwizzle, Tr::kBlockN>(acc_o, a_p, cs.v[st]);
  };
  // kAttnMask: the attn_mask's list entry of tile `it` of item w (the K/V loader's copy
  // with the stage), read by the whole warp before its lanes 0-3 free the stage (which
  // the loader then refills with the next entry). 0 in the other kernels.
  auto tile_entry = [&](const Item& w, int it) {
    int entry = 0;
    if constexpr (kAttnMask) {
      entry = bar.tile_entry[w.stage(it)];
      __syncwarp();
    }
    return entry;
  };
  // Scores and online softmax of tile `it` of item w from acc_s (its Q·Kᵀ must be
  // complete); frees its K stage and leaves 448·P in x. qk (tile_scale) is computed by
  // the caller while the MMAs it waits on run; entry: tile_entry(w, it).
  auto softmax_tile = [&](const Item& w, int it, float qk, Softmax& sm, float(&x)[kS],
                          float(&alpha_out)[2], int entry) {
    hopper::fence_operands(acc_s);
    if (lane < 4) hopper::mbarrier_arrive(&bar.k_empty[w.stage(it)]);
    const int kv0 = (kAttnMask ? entry & kMaskTileBits : w.kv_first + it) * Tr::kBlockN;
    // The raw products go to the softmax (OnlineSoftmax::step); masked ones become
    // kMaskedScore in place.
    // The item's key-padding length from its slot (not kept in registers: the d=128
    // consumers have none to spare).
    const common::KeyMask mask = item_mask(bar.item[w.slot()].kv_len, w.slot());
    // Tiles before the window's start: a test on kernel constants and the item's row,
    // not one more value live per item.
    // (The additive kernel at d=128 takes the d=64 test: with the other, a register of
    // its new-item turn spilled.)
    const bool masked = D == 128 && !kAdditive ? kv0 > w.unmasked_until || kv0 < mask.unmasked_from(row_first(w))
                                 : mask.needed(kv0, row_first(w));  // a measured choice
    if (masked) mask.apply(acc_s, fc, kv0, w.m_block * Tr::kBlockM + row_in_block(0));
    // kAttnMask: the element test on the tiles the mask cuts (or hides). d=64 branches
    // around it; at d=128 a branch spilled 88-132 bytes, so every tile runs it, with all
    // bits set where the tile is fully visible.
    const int attn_row0 = w.m_block * Tr::kBlockM + row_in_block(0);
    if constexpr (kAdditive) {
      // A hidden entry (a block that sees no key) hides its whole tile; a cut tile adds
      // the mask's values; an unchanged one adds zeros without reading them.
      if (entry & kMaskTileHidden) apply_attn_mask(acc_s, p.mask, entry, w.bh_q, fc, kv0, attn_row0);
      sm.step_additive(acc_s, qk,
                       additive_pairs<T>(p.mask, (entry & kMaskTileCut) != 0, w.bh_q, attn_row0,
                                         kv0, p.seqlen_q, p.seqlen_kv, fc.t),
                       x, alpha_out);
      return;
    }
    if constexpr (kAttnMask && D == 64) {
      if (entry & (kMaskTileCut | kMaskTileHidden)) {
        apply_attn_mask(acc_s, p.mask, entry, w.bh_q, fc, kv0, attn_row0);
        sm.step(acc_s, qk, x, alpha_out);
      } else {
        sm.step(acc_s, qk, x, alpha_out);
      }
      return;
    }
    if constexpr (kAttnMask) apply_attn_mask(acc_s, p.mask, entry, w.bh_q, fc, kv0, attn_row0);
    sm.step(acc_s, qk, x, alpha_out);
  };

  // q_scale · k_scale of this thread's score groups for tile `it` of item w (in log2
  // units). The K scale group (t = lane % 4) is read by lanes 0-3, which are the ones
  // that arrive on k_empty, and shuffled to the rest. Called right after the tile's
  // Q·Kᵀ is issued: the loads and the shuffle then hide behind the MMAs instead of
  // sitting between the wait and the softmax (3% at N=8K; measured: bench/NOTES.md).
  // qk > 0 keeps masked (-inf) scores at -inf; an all-zero scale group has all-zero
  // products, so the floor changes nothing. A NaN scale (NaN in Q or K) stays NaN and
  // reaches O through P.
  auto tile_scale = [&](const Item& w, int it) {
    const float ks = lane < 4 ? cs.k_scale[w.stage(it)][lane] : 0.f;
    const float qs = cs.side[w.slot()].q_scale[row_in_block(0) / 16 * 8 + fc.g];
    const float qk = qs * __shfl_sync(0xffffffff, ks, fc.t);
    return qk < FLT_MIN ? FLT_MIN : qk;
  };

  Item cur;
  if (!open_item(cur)) {
    resolve_store();
    return;
  }
  Softmax sm_cur;
  float o[kO];
  // (kSoftmaxAfterPv: O's zeros are set after the first tile's softmax, where 64 registers
  // of zeros beside its mask values spilled.)
  if constexpr (!kSoftmaxAfterPv) {
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = 0.f;
  }
  // The next turn's V tile, and its K tile when it is of the same item, checked while this
  // turn's MMAs run: a completed barrier still takes a try_wait round trip (~70 cycles
  // each), which at a turn's start delays its MMA issue. The stages stay
  // full until the consumers release them, so the phase checked here holds.
  // d=64, after an item's last K tile: whether the next item's Q and first K tile are
  // there, tested without waiting (w must be the last item opened: next_local, next_iter).
  auto wait_ahead = [&](const Item& w, int it) {
    hopper::mbarrier_wait(&bar.v_full[w.stage(it)], w.phase(it));
    if (it + 1 < w.n_tiles)
      hopper::mbarrier_wait(&bar.k_full[w.stage(it + 1)], w.phase(it + 1));
    else if constexpr (D == 64)
      next_item_ready =
          hopper::mbarrier_test(&bar.q_ready[PipelineState<kQSlots<D>>{next_local}.index()],
                                PipelineState<kQSlots<D>>{next_local}.phase()) &&
          hopper::mbarrier_test(&bar.k_full[PipelineState<Tr::kStages>{next_iter}.index()],
                                PipelineState<Tr::kStages>{next_iter}.phase());
  };
  {  // the pipeline's first tile: nothing to overlap it with yet
    hopper::mbarrier_wait(&bar.k_full[cur.stage(0)], cur.phase(0));
    hopper::wgmma_fence();
    issue_qk(cur, 0);
    const float qk = tile_scale(cur, 0);
    wait_ahead(cur, 0);
    hopper::wgmma_wait<0>();
    float x[kS];
    softmax_tile(cur, 0, qk, sm_cur, x, alpha, tile_entry(cur, 0));
    pack_p_fragments(x, a_p);
  }
  if constexpr (kSoftmaxAfterPv) {
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = 0.f;
  }

  // One round on the tensor cores: P·V of tile `it` of cur and, when there is one, Q·Kᵀ
  // of the next tile (tile it + 1 of cur, or the first tile of the next item). The MMAs
  // are issued on straight-line paths (no branch around a wgmma), which ptxas needs to
  // keep them asynchronous (C7520).
  // V(it) and, within an item, K(nit) were checked by the turn before (wait_ahead); the
  // first K tile of the next item is checked here (new_item).
  auto turn = [&](int it, const Item& nw, int nit, Softmax& sm_next, auto has_next,
                  auto new_item) {
    const int st = cur.stage(it);
    float qk_next = 0.f;
    float acc_o[kOAcc];
    if constexpr (new_item)
      if (!next_item_ready) hopper::mbarrier_wait(&bar.k_full[nw.stage(nit)], nw.phase(nit));
    hopper::wgmma_fence();
    if constexpr (has_next) issue_qk(nw, nit);
    issue_pv(st, acc_o);
    // After the MMAs are issued: the load and shuffle latency hides behind them instead
    // of delaying the issue (3% at N=8K).
    if constexpr (has_next) qk_next = tile_scale(nw, nit);
    resolve_store();
    if constexpr (has_next) wait_ahead(nw, nit);
    float x[kS], alpha_next[2];
    if constexpr (has_next && !kSoftmaxAfterPv) {
      // The softmax of the next tile runs while P·V(it) still computes; its P waits in x
      // until P·V(it) has finished reading a_p.
      const int entry = tile_entry(nw, nit);
      hopper::wgmma_wait<1>();
      softmax_tile(nw, nit, qk_next, sm_next, x, alpha_next, entry);
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operands(acc_o);
    hopper::fence_operands(a_p);
    __syncwarp();
    if (lane == 0) hopper::mbarrier_arrive(&bar.v_empty[st]);

      // Two-level accumulation: the tile's product landed in fresh registers; one FMA.
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = fmaf(o[i], alpha[(i % 4) / 2], acc_o[i]);
    sm_cur.add_row_sums(acc_o[kO], acc_o[kO + 2], alpha);  // the ones columns (rows g, g + 8)

    if constexpr (has_next && kSoftmaxAfterPv)  // P·V's registers are free now
      softmax_tile(nw, nit, qk_next, sm_next, x, alpha_next, tile_entry(nw, nit));
    if constexpr (has_next) {
      pack_p_fragments(x, a_p);
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
    write_output(cur, o, sm_cur);
    if (!more) {
      // The last stores must have read shared memory before the CTA exits.
      resolve_store();
      break;
    }
    cur = nxt;
    sm_cur = sm_next;
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = 0.f;
  }
}

}  // namespace qattn::sage2
