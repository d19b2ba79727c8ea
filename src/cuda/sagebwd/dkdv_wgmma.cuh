// The dK/dV kernel of the SageBwd backward on wgmma (sm_90a): the emulator's steps in its
// order and codes (src/emulate/sagebwd.h), the five products as warpgroup MMAs. It
// replaced an mma.sync kernel of the same data flow (bench/NOTES.md v23, v28).
//
// One CTA of two warpgroups per (KV tile j, KV head, batch); warpgroup c owns KV rows
// 64c..64c+63 of the tile, so warp w (0..7) owns rows 16w..16w+15 exactly as in the
// mma.sync kernel, and the m64nN accumulator puts every (row, column) in the register
// the m16n8 accumulator did: tile.cuh's element-wise steps serve both kernels unchanged.
// Per Q block of every query head of the group:
//   Sᵀ  = K̂_c·Q̂ᵀ      m64n64k32 8-bit, both from shared memory
//   dPᵀ = V_c·dOᵀ     m64n64k16 bf16/f16 (or 8-bit with the quantized dO·Vᵀ)
//   P, dS, each warpgroup's maxima (its 64 KV rows: one scale per half of the tile),
//   P̂ᵀ/dŜᵀ as register A fragments
//   dV_c += P̂ᵀ·dÔ     m64n64k32 8-bit, A from registers; B = dÔᵀ rows (π order, permute.cuh)
//   dK_c += dŜᵀ·Q̂     likewise with Q̂ᵀ
//   dQ[:, half c] = dŜ·K̂   m64n(D/2)k32 8-bit: dŜ staged Q-row-major in shared memory (stmatrix,
//                          tokens in σ order as K̂ᵀ's), one product per 64-token half, each
//                          with that half's dS scale
// "8-bit" is the format F (format8.cuh): s8 products summed in INT32, or e4m3 in FP32.
// Each product carries its own per-tile scale, so it lands in a fresh temporary and
// is folded into the FP32 accumulator (dK, dV: registers for the whole item; dQ: global
// FP32 reductions, as the mma.sync kernel does).
//
// Operands reach shared memory in the wgmma swizzled layouts (rows of one swizzle span;
// 16-bit rows of 128 channels as two boxes of 64): the K side once by cp.async from every
// thread, the Q side's three stages in flight by TMA and bulk copies that thread 0 issues
// (QSideMaps), so the other warps spend no instructions on copies. The warpgroups meet
// through mbarriers only (Barriers): a stage is refilled once both are done with it, and
// step w's dQ is formed at step w + 1, so neither waits for the other's dŜ in the usual
// case and one may run ahead of the other by up to a step. wgmma reads 8-bit operands K-major only: every
// product above reads rows whose reduction dimension is contiguous, which the workspace
// already stores (workspace.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "cuda/sagebwd/kernels.cuh"
#include "cuda/sagebwd/tile.cuh"

namespace qattn::sagebwd {

using hopper::Swizzle;

// The byte offset inside a swizzled tile at which logical offset o (row · span + byte)
// lives: the 16-byte chunk index XOR the row index within the swizzle atom (CUTLASS's
// Swizzle<B, 4, 3>). Tiles start on 1024-byte boundaries.
template <Swizzle S>
__device__ __forceinline__ uint32_t swizzled(uint32_t o) {
  constexpr uint32_t mask = S == Swizzle::k128B ? 7 : S == Swizzle::k64B ? 3 : 1;
  return o ^ (((o >> 7) & mask) << 4);
}

// The swizzle of rows of `bytes` bytes (64 or 128).
template <int kBytes>
inline constexpr Swizzle kSwizzleOf = kBytes == 128 ? Swizzle::k128B : Swizzle::k64B;

// Copies kRows rows of kRowBytes into a swizzled tile; rows longer than the span go to
// consecutive boxes of kRows × span bytes (16-bit rows of 128 channels). Every thread
// copies the same 16-byte column of rows r0, r0 + kRowsPerPass, ...: the passes step by
// whole swizzle atoms, so the swizzled offset is the thread's own plus a constant.
template <Swizzle S, int kRows, int kRowBytes>
__device__ __forceinline__ void copy_tile(uint32_t dst, const void* src, int64_t src_stride) {
  constexpr int kSpan = static_cast<int>(hopper::swizzle_bytes(S));
  constexpr int kPerRow = kRowBytes / 16;
  constexpr int kRowsPerPass = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0 && kRows % kRowsPerPass == 0 && kRowsPerPass % 8 == 0,
                "whole passes of whole swizzle atoms");
  const int r0 = threadIdx.x / kPerRow, k = 16 * (threadIdx.x % kPerRow);
  const uint32_t to = dst + (k / kSpan) * kRows * kSpan + swizzled<S>(r0 * kSpan + k % kSpan);
  const uint8_t* from = static_cast<const uint8_t*>(src) + r0 * src_stride + k;
  const int64_t step = kRowsPerPass * src_stride;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i)
    common::cp_async_16(to + i * kRowsPerPass * kSpan, from + i * step);
}

// Q-side stages in flight: three; two at D = 128 with dQ's staging tile (below), which
// takes the third's shared memory.
inline constexpr int kMaxQStages = 3;
template <int D, bool kDqTile>
inline constexpr int kQStagesOf = kDqTile && D == 128 ? 2 : kMaxQStages;
// With the merge-free scales dQ leaves the kernel as TMA reductions of boxes of 32 FP32
// columns × 64 rows (128-byte rows, 128-byte swizzle) from a staging tile in shared
// memory (bench/NOTES.md v91, v93: with the per-block merges' registers in use the tile
// costs more than it saves; without them it gains 15%).
inline constexpr int kDqBoxCols = 32;
inline constexpr int kDqBoxBytes = kDqBoxCols * 4 * kQBlockRows;

// kDqTile: the layout with dQ's staging tile (the merge-free kernel's).
template <int D, bool kQuantDov, bool kDqTile = false>
struct WgSmem {
  static constexpr int kRowI8 = D;                       // bytes of an 8-bit row of D
  static constexpr int kRowV = kQuantDov ? D : 2 * D;    // bytes of a V or dO row
  static constexpr Swizzle kSwI8 = kSwizzleOf<D>;
  static constexpr Swizzle kSwV = kQuantDov ? kSwizzleOf<D> : Swizzle::k128B;
  // K side (once per CTA).
  static constexpr int kK8 = 0;                                  // 128 × D
  static constexpr int kKt = kK8 + kKvTileRows * D;              // D × 128 tokens (σ order)
  static constexpr int kV = kKt + D * kKvTileRows;               // 128 × kRowV
  static constexpr int kKSide = kV + kKvTileRows * kRowV;
  // One Q-side stage.
  static constexpr int kQ8 = 0;                                  // 64 × D
  static constexpr int kDo = kQ8 + kQBlockRows * D;              // 64 × kRowV
  static constexpr int kQt = kDo + kQBlockRows * kRowV;          // D × 64 (π order)
  static constexpr int kDot = kQt + D * kQBlockRows;             // D × 64 (π order)
  static constexpr int kLse2 = kDot + D * kQBlockRows;           // 64 floats
  static constexpr int kDelta = kLse2 + kQBlockRows * 4;         // 64 floats
  // The 16-byte words of q_scale and do_scale holding the block's s_q and s_dO (bulk
  // copies move 16-byte multiples; workspace arrays are padded to 256 bytes).
  static constexpr int kScales = kDelta + kQBlockRows * 4;
  static constexpr int kInvS = kScales + 32;                     // 64 floats (merge-free)
  static constexpr int kStage = (kInvS + kQBlockRows * 4 + 1023) / 1024 * 1024;
  // What one stage's copies deliver (its `full` barrier's transaction bytes); the
  // merge-free scales add 1/s_i.
  static constexpr uint32_t kStageTx = kQBlockRows * D + kQBlockRows * kRowV + 2 * D * kQBlockRows +
                                       2 * kQBlockRows * 4 + 32;
  static constexpr uint32_t kStageTxMergeFree = kStageTx + kQBlockRows * 4;
  static constexpr int kStages = kQStagesOf<D, kDqTile>;
  static constexpr int kQSide = kKSide;                          // first stage
  // dŜ, two by step parity: step w's is read by both warpgroups' dQ at step w + 1, while
  // step w + 1's is written into the other.
  static constexpr int kDsBytes = kQBlockRows * kKvTileRows;    // 64 Q rows × 128 tokens
  static constexpr int kDs = kQSide + kStages * kStage;          // 2 × kDsBytes
  static constexpr int kRed = kDs + 2 * kDsBytes;                // each warp's maxima, 2 × 2·kWarps floats
  static constexpr int kBars = kRed + 4 * kWarps * 4;            // mbarriers (Barriers below)
  static constexpr int kDsScale = kBars + 8 * (2 * kMaxQStages + 4);  // dS scales [parity][half]
  static_assert(kBars % 8 == 0, "mbarriers on 8-byte bounds");
  // dQ's staging tile: 64 rows × D FP32 as D / 32 swizzled boxes (kDqBoxBytes each), the
  // image of one step's dQ for the TMA reductions; each warpgroup owns its half.
  static constexpr int kDqStage = (kDsScale + 4 * 4 + 1023) / 1024 * 1024;
  static constexpr int kBytes =
      (kDqTile ? kDqStage + D / kDqBoxCols * kDqBoxBytes : kDsScale + 4 * 4) + 1024;  // + slack
  static_assert(kBytes <= 227 * 1024, "one CTA an SM");
  static_assert(kKSide % 1024 == 0 && kStage % 1024 == 0, "wgmma tiles on 1024-byte bounds");
};

template <int D, bool kQuantDov>
__device__ __forceinline__ void wg_load_k_side(const Args& a, uint32_t base, int64_t bhk,
                                               int tile) {
  using L = WgSmem<D, kQuantDov>;
  const int j0 = tile * kKvTileRows;
  copy_tile<L::kSwI8, kKvTileRows, D>(base + L::kK8, a.k_i8 + (bhk * a.nkv_pad + j0) * D, D);
  copy_tile<Swizzle::k128B, D, kKvTileRows>(base + L::kKt, a.kt_i8 + bhk * D * a.nkv_pad + j0,
                                            a.nkv_pad);
  const void* v = kQuantDov ? static_cast<const void*>(a.v_i8) : a.v_16;
  copy_tile<L::kSwV, kKvTileRows, L::kRowV>(
      base + L::kV, static_cast<const uint8_t*>(v) + (bhk * a.nkv_pad + j0) * L::kRowV, L::kRowV);
}

// The Q side's tensor maps (launch.cu), over the workspace's arrays as bytes: a stage is
// one box of each, which TMA writes in the swizzled layout wgmma reads.
//   q8   q_i8  (D, Nq_pad, B·Hq), box (D, 64), the 8-bit rows' swizzle
//   dov  do_16 as bytes (2D, Nq_pad, B·Hq), box (128, 64), 128-byte swizzle (two boxes at
//        D = 128); do_i8 (quantized dO·Vᵀ) as q8
//   qt   qt_i8 (Nq_pad, D, B·Hq), box (64, D), 64-byte swizzle; dot likewise for dot_i8
//   dq   dq_acc as FP32 (D, Nq_pad, B·Hq), box (32, 64), 128-byte swizzle: the merge-free
//        kernel's dQ reductions (unused otherwise)
struct QSideMaps {
  CUtensorMap q8, dov, qt, dot, dq;
};

// Block `blk` of query head `bhq` in q_scale and do_scale (one float a Q block). A stage
// holds the 16-byte word containing it (bulk copies move 16-byte multiples), at float
// index & 3 of that word.
__device__ __forceinline__ int64_t q_scale_index(const Args& a, int64_t bhq, int blk) {
  return bhq * (a.nq_pad / kQBlockRows) + blk;
}

// Issues the copies of block `blk` of query head `bhq` into the stage at `st`, completing
// on `full`: one thread, after the stage's previous readers have released it. Q-side
// rows are re-read by every KV tile of the head: kept in L2 (evict_last).
template <int D, bool kQuantDov, bool kMergeFree>
__device__ __forceinline__ void wg_issue_q_side(const Args& a, const QSideMaps& m, uint8_t* st,
                                                uint64_t* full, int64_t bhq, int blk) {
  using L = WgSmem<D, kQuantDov>;
  const int q0 = blk * kQBlockRows, h = static_cast<int>(bhq);
  const uint64_t keep = hopper::policy_evict_last();
  hopper::mbarrier_arrive_expect_tx(full, kMergeFree ? L::kStageTxMergeFree : L::kStageTx);
  hopper::tma_load_3d(st + L::kQ8, &m.q8, full, 0, q0, h, keep);
#pragma unroll
  for (int box = 0; box < (kQuantDov ? 1 : L::kRowV / 128); ++box)
    hopper::tma_load_3d(st + L::kDo + box * kQBlockRows * 128, &m.dov, full, 128 * box, q0, h, keep);
  hopper::tma_load_3d(st + L::kQt, &m.qt, full, q0, 0, h, keep);
  hopper::tma_load_3d(st + L::kDot, &m.dot, full, q0, 0, h, keep);
  const int64_t row = bhq * a.nq_pad + q0, sidx = q_scale_index(a, bhq, blk);
  hopper::bulk_load(st + L::kLse2, a.lse2 + row, kQBlockRows * 4, full);
  hopper::bulk_load(st + L::kDelta, a.delta + row, kQBlockRows * 4, full);
  hopper::bulk_load(st + L::kScales, a.q_scale + (sidx & ~int64_t{3}), 16, full);
  hopper::bulk_load(st + L::kScales + 16, a.do_scale + (sidx & ~int64_t{3}), 16, full);
  if constexpr (kMergeFree) hopper::bulk_load(st + L::kInvS, a.inv_s + row, kQBlockRows * 4, full);
}

// wgmma shared-memory descriptors of K-major swizzled tiles (hopper::make_smem_desc's
// fields), built by integer adds: `lo` holds the 1024-aligned base's start-address field
// (bits 0-13, address / 16) and LBO = 1; a tile `offset` bytes in adds offset / 16, which
// never carries out of the field (shared memory is below 2^18 bytes).
struct SmemDescs {
  uint32_t lo;
  template <Swizzle S>
  __device__ __forceinline__ uint64_t at(uint32_t offset) const {
    return of<S>(lo + (offset >> 4));
  }
  // From a start-address field already in 16-byte units: a stage's base shifted once a
  // step, then one add per descriptor.
  template <Swizzle S>
  static __device__ __forceinline__ uint64_t of(uint32_t lo16) {
    constexpr uint32_t hi = ((8 * hopper::swizzle_bytes(S)) >> 4) |
                            (static_cast<uint32_t>(S) << 30);  // SBO, layout type
    return (static_cast<uint64_t>(hi) << 32) | lo16;
  }
  __device__ __forceinline__ uint32_t units(uint32_t offset) const { return lo + (offset >> 4); }
};

// The (query head, Q block) of the CTA's work items in order: every query head of the
// KV head's group, each over the Q blocks first..blocks-1 that see the tile.
struct WorkCursor {
  int h, blk;
  __device__ __forceinline__ void advance(int first, int blocks) {
    if (++blk == blocks) {
      blk = first;
      ++h;
    }
  }
};

// out[8h + j][e] += scale · tmp[4j + e]: a 64-column product into the FP32 rows. INT32
// sums split their conversions between one I2FP (one issue slot, on a slower pipe whose
// variable latency makes ptxas hold more registers) and format8.cuh's IADD + FADD (two
// slots, in place): all I2FP at D = 64, one in four at D = 128, where more spill. Both
// are exact here, so the sums are the same bits.
template <int kCols, typename F>
__device__ __forceinline__ void merge_cols(float (&out)[kCols / 8][4],
                                           const typename F::Acc (&tmp)[32], int h, float scale) {
  constexpr int kI2fpEvery = kCols <= 64 ? 1 : 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const typename F::Acc v = tmp[4 * j + e];
      float x;
      if constexpr (F::kIntegerSums)
        x = e % kI2fpEvery == kI2fpEvery - 1 ? __int2float_rn(v) : i2f_exact(v);
      else
        x = v;
      out[8 * h + j][e] = fmaf(x, scale, out[8 * h + j][e]);
    }
}

// This warp's dŜᵀ fragments into the Q-row-major dŜ tile at `tile` (64 Q rows × 128
// tokens in σ order, 128-byte swizzle), two transposing stores. PRMT pairs each Q
// column's bytes of tokens g and g + 8 (fragment registers 2h and 2h + 1) into one 16-bit
// element; 8×8 matrix m (Q columns 8m..8m+7, k_slot_row's π undone by the byte choice)
// holds them at row g, columns 2t and 2t + 1, so its transposed row c is Q row 8m + c with
// the warp's 16 tokens in σ order: chunk `warp` of that row, stored at chunk
// warp ⊕ (row mod 8). `lane_row` is ds_lane_row_off: the offset of the row this lane
// addresses (Q row = lane in the first store, 32 + lane in the second).
__device__ __forceinline__ uint32_t ds_lane_row_off(int warp, int lane) {
  return lane * kKvTileRows + ((warp ^ (lane & 7)) << 4);
}
__device__ __forceinline__ void stage_ds(uint32_t tile, const uint32_t (&af)[2][4],
                                         uint32_t lane_row) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {  // Q columns 32kk..32kk+31: matrices 4kk..4kk+3
    const uint32_t* a = af[kk];
    common::stmatrix_x4_trans(tile + lane_row + kk * 32 * kKvTileRows,
                              __byte_perm(a[0], a[1], 0x5140), __byte_perm(a[0], a[1], 0x7362),
                              __byte_perm(a[2], a[3], 0x5140), __byte_perm(a[2], a[3], 0x7362));
  }
}

__device__ __forceinline__ void fence_frags(uint32_t (&af)[2][4]) {
  hopper::fence_operands(af[0]);
  hopper::fence_operands(af[1]);
}

// The kernel's mbarriers. A Q-side stage is `full` when thread 0's copies into it have
// landed, `empty` when both warpgroups' 8 warps are done with it; a dŜ buffer is
// `ds_full` when both warpgroups' 8 warps have written their halves (and its scales),
// `ds_empty` when both have read it for dQ. The warpgroups meet only through these, so
// one may run up to a step ahead of the other.
struct Barriers {
  uint64_t full[kMaxQStages], empty[kMaxQStages];
  uint64_t ds_full[2], ds_empty[2];
};

// kAtomicDq: also dQ, added into the FP32 accumulator with reductions; without it (the
// deterministic mode) dq_kernel computes dQ and this kernel skips dŜ's staging and dQ.
// Step w's dQ is formed at step w + 1 (after its dK and dV), when the other warpgroup's
// half of dŜ is there without a wait in the usual case.
template <typename T, int D, bool kQuantDov, bool kAtomicDq, typename F>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_wgmma_kernel(const Args a, const __grid_constant__ QSideMaps maps) {
  using L = WgSmem<D, kQuantDov, F::kMergeFree && kAtomicDq>;
  using Acc = typename F::Acc;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kHalves = D / 64;   // 64-column halves of dK, dV
  constexpr int kDqCols = D / 2;    // dQ columns per warpgroup
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u);
  const uint32_t s_base = hopper::smem_addr(smem);
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  Barriers& bar = *reinterpret_cast<Barriers*>(smem + L::kBars);
  float* ds_scale = reinterpret_cast<float*>(smem + L::kDsScale);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  // The warpgroup index from lane 0: the compiler then knows it is warp-uniform and keeps
  // the wgmma descriptors built from it in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), w4 = warp % 4;
  const int tile = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int j0 = tile * kKvTileRows, tiles = a.nkv_pad / kKvTileRows;
  const int blocks = a.nq_pad / kQBlockRows;
  const int64_t bhk = static_cast<int64_t>(b) * a.heads_kv + hk;
  // Causal (bottom-right): block blk sees the tile when its last row's horizon
  // q0 + 63 + nkv - nq reaches j0.
  int first = 0;
  if (a.causal) {
    const int x = j0 - (kQBlockRows - 1) - a.nkv + a.nq;
    first = x <= 0 ? 0 : (x + kQBlockRows - 1) / kQBlockRows;
  }
  const int active = blocks - first, work = a.group * active;
  const float s_k = a.k_scale[bhk * tiles + tile];
  const float s_v = kQuantDov ? a.v_scale[bhk * tiles + tile] : 0.0f;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      hopper::mbarrier_init(&bar.full[s], 1);  // the issuing thread's, plus the bytes
      // Merge-free: every thread's arrival (no per-half barrier orders its warp's reads of
      // the stage before lane 0's, as racecheck requires).
      hopper::mbarrier_init(&bar.empty[s], F::kMergeFree ? kThreads : kWarps);
    }
    for (int p = 0; p < 2; ++p) {
      hopper::mbarrier_init(&bar.ds_full[p], kWarps);
      hopper::mbarrier_init(&bar.ds_empty[p], kWarps);
    }
    hopper::fence_barrier_init();  // visible to the copy engine too
  }
  __syncthreads();  // the barriers, before any arrival

  const int64_t bh0 = static_cast<int64_t>(b) * a.heads_q + hk * a.group;
  auto stage_off = [&](int st) { return static_cast<uint32_t>(L::kQSide + st * L::kStage); };
  // Thread 0 issues a stage's copies (TMA and bulk copies); its `full` barrier completes
  // when their bytes have landed.
  auto load_q = [&](int st, const WorkCursor& c) {
    wg_issue_q_side<D, kQuantDov, F::kMergeFree>(a, maps, smem + stage_off(st), &bar.full[st],
                                                 bh0 + c.h, c.blk);
  };
  // The K side and stages 0..S-2 before the loop (S = L::kStages); step w loads step
  // w + S - 1's stage (step w - 1's) once both warpgroups have released it.
  WorkCursor cur{0, first}, ld = cur;
  for (int s = 0; s < L::kStages - 1; ++s) {
    if (threadIdx.x == 0 && work > s) load_q(s, ld);
    ld.advance(first, blocks);
  }
  wg_load_k_side<D, kQuantDov>(a, s_base, bhk, tile);
  common::cp_async_commit();
  common::cp_async_wait<0>();
  hopper::fence_proxy_async();  // this thread's cp.async bytes, before wgmma reads them
  __syncthreads();

  const SmemDescs desc{(1u << 16) | ((s_base & 0x3FFFFu) >> 4)};
  // The K side's descriptors: this warpgroup's 64 KV rows of K̂ and V; its D/2 rows of K̂ᵀ.
  const uint64_t d_k8 = desc.at<L::kSwI8>(L::kK8 + 64 * wg * L::kRowI8);
  const uint64_t d_kt = desc.at<Swizzle::k128B>(L::kKt + kDqCols * wg * kKvTileRows);
  const uint64_t d_ds0 = desc.at<Swizzle::k128B>(L::kDs);  // step parity 0's dŜ
  // 16-bit V: boxes of 128 rows × 64 channels; this warpgroup's rows start 64 rows in.
  const uint64_t d_v = desc.at<L::kSwV>(L::kV + 64 * wg * (kQuantDov ? L::kRowV : 128));

  // dQ of step u = dŜ·K̂ over the two 64-token halves of its dŜ (buffer u & 1), each half
  // with its own scale: product_dq issues one half into tq; dq_scales reads both scales
  // (by lane 0, the lane that releases the buffer, then shuffled: racecheck does not order
  // other lanes' reads through __syncwarp before its arrival); dq_reduce adds the FP32
  // values into rows q0.. of query head bhq.
  // With the merge-free scales dŜ has one scale, so half 0's product runs over all 128 tokens.
  auto product_dq = [&](Acc(&tq)[kDqCols / 2], int pu, int h) {
    const uint64_t d_ds = hopper::desc_advance(d_ds0, pu * L::kDsBytes);
    hopper::wgmma_fence();
    constexpr int kSteps = F::kMergeFree ? kKvTileRows / 32 : kKvTileRows / 64;
#pragma unroll
    for (int k2 = 0; k2 < kSteps; ++k2) {
      const int kk = h * (kKvTileRows / 64) + k2;
      const uint64_t da = hopper::desc_advance(d_ds, 32 * kk);
      const uint64_t db = hopper::desc_advance(d_kt, 32 * kk);
      if constexpr (kDqCols == 64) {
        if (k2 == 0)
          F::template wgmma_n64_ss<false>(reinterpret_cast<Acc(&)[32]>(tq), da, db);
        else
          F::template wgmma_n64_ss<true>(reinterpret_cast<Acc(&)[32]>(tq), da, db);
      } else {
        if (k2 == 0)
          F::template wgmma_n32_ss<false>(reinterpret_cast<Acc(&)[16]>(tq), da, db);
        else
          F::template wgmma_n32_ss<true>(reinterpret_cast<Acc(&)[16]>(tq), da, db);
      }
    }
    hopper::wgmma_commit();
  };
  auto dq_scales = [&](int pu, float (&sc)[2]) {
    if constexpr (F::kMergeFree) {  // s_i is dq_finalize's
      sc[0] = sc[1] = a.sm_scale * s_k;
      return;
    }
    float s0 = 0.0f, s1 = 0.0f;
    if (lane == 0) {
      s0 = ds_scale[2 * pu];
      s1 = ds_scale[2 * pu + 1];
    }
    sc[0] = a.sm_scale * (__shfl_sync(0xffffffffu, s0, 0) * s_k);
    sc[1] = a.sm_scale * (__shfl_sync(0xffffffffu, s1, 0) * s_k);
  };
  // dQ rows 16·w4 + g (+8) of the block, columns kDqCols·wg + 8j + 2t (+1).
  // Merge-free: into this warpgroup's boxes of the staging tile (128-byte swizzle: chunk c
  // of row r at c ^ (r mod 8)), then one thread adds them to rows q0.. of query head bhq
  // with TMA reductions, off the warps' path. The tile is rewritten only after the
  // previous step's reductions have read it (that thread waits, a named barrier tells the
  // rest).
  const bool wg_leader = threadIdx.x % 128 == 0;
  auto dq_stage_free = [&] {  // before the values are formed: fewer registers live
    if constexpr (F::kMergeFree) {
      if (wg_leader) hopper::bulk_wait_group_read<0>();
      hopper::named_barrier_sync(3 + wg, 128);  // 1 and 2: tile.cuh's maxima
    }
  };
  // Otherwise every value first, then the reductions, all values live until the last: a
  // reduction reads its registers late, and a register rewritten after it waits for that
  // read.
  auto dq_reduce = [&](float(&x)[kDqCols / 2], int64_t bhq, int q0) {
    hopper::fence_operands(x);
    if constexpr (F::kMergeFree) {
      // Column 8j + 2t of the half is box j / 4, chunk 2(j mod 4) + t / 2, word 2(t mod 2);
      // rows 16·w4 + g (+8) are g mod 8, so the chunk's swizzle is ^ g.
      uint8_t* stage = smem + L::kDqStage;
      const uint32_t base = (kDqCols * wg / kDqBoxCols) * kDqBoxBytes + (16 * w4 + g) * 128 +
                            ((((t >> 1) ^ (g & 1)) << 4) | ((t & 1) * 8));
#pragma unroll
      for (int j = 0; j < kDqCols / 8; ++j)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const uint32_t off =
              base + (j / 4) * kDqBoxBytes + h2 * 8 * 128 + (((2 * (j % 4)) ^ (g & 6)) << 4);
          *reinterpret_cast<float2*>(stage + off) = make_float2(x[4 * j + 2 * h2], x[4 * j + 2 * h2 + 1]);
        }
      hopper::fence_proxy_async();  // the tile, before the reductions read it
      hopper::named_barrier_sync(3 + wg, 128);
      if (wg_leader) {
#pragma unroll
        for (int bx = 0; bx < kDqCols / kDqBoxCols; ++bx) {
          const int b0 = kDqCols * wg / kDqBoxCols + bx;
          hopper::tma_reduce_add_3d(&maps.dq, stage + b0 * kDqBoxBytes, b0 * kDqBoxCols, q0,
                                    static_cast<int>(bhq));
        }
        hopper::bulk_commit_group();
      }
      return;
    }
    float* dq = a.dq_acc + (bhq * a.nq_pad + q0 + 16 * w4 + g) * D + kDqCols * wg + 2 * t;
#pragma unroll
    for (int j = 0; j < kDqCols / 8; ++j)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2)
        common::red_add_v2(dq + 8 * h2 * D + 8 * j, x[4 * j + 2 * h2], x[4 * j + 2 * h2 + 1]);
    hopper::fence_operands(x);  // each reduction keeps its own registers
  };
  // The second half of dQ(u) once the first is in tq: x = both halves, scaled; releases
  // the buffer.
  auto dq_second_half = [&](Acc(&tq)[kDqCols / 2], int pu, const float (&sc)[2],
                            float(&x)[kDqCols / 2]) {
    if constexpr (F::kMergeFree) {  // one product over every token: x is done
      hopper::wgmma_wait<0>();
      hopper::fence_operands(tq);
      __syncwarp();
      if (lane == 0) hopper::mbarrier_arrive(&bar.ds_empty[pu]);
#pragma unroll
      for (int i = 0; i < kDqCols / 2; ++i) x[i] = F::to_float(tq[i]) * sc[0];
      return;
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operands(tq);
#pragma unroll
    for (int i = 0; i < kDqCols / 2; ++i) x[i] = F::to_float(tq[i]) * sc[0];
    product_dq(tq, pu, 1);
    hopper::wgmma_wait<0>();
    hopper::fence_operands(tq);
    __syncwarp();
    if (lane == 0) hopper::mbarrier_arrive(&bar.ds_empty[pu]);
#pragma unroll
    for (int i = 0; i < kDqCols / 2; ++i) x[i] = fmaf(F::to_float(tq[i]), sc[1], x[i]);
  };

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  int sidx = 0, round = 0;  // step w's stage (w mod kStages) and w / kStages
  int64_t prev_bhq = 0;     // step w - 1's query head and first row, for its dQ
  int prev_q0 = 0;
  for (int w = 0; w < work; ++w) {
    const int blk = cur.blk;
    const int64_t bhq = bh0 + cur.h;
    const uint32_t st = stage_off(sidx);
    const uint32_t st16 = desc.units(st);  // the stage's descriptor base
    hopper::mbarrier_wait(&bar.full[sidx], round & 1);  // TMA's bytes: no proxy fence
    const float* st_f = reinterpret_cast<const float*>(smem + st);
    const int sw = static_cast<int>(q_scale_index(a, bhq, blk) & 3);  // in its word
    const float s_q = st_f[L::kScales / 4 + sw], s_do = st_f[L::kScales / 4 + 4 + sw];
    cur.advance(first, blocks);
    TileOperands op{};
    op.lse2 = st_f + L::kLse2 / 4;
    op.delta = st_f + L::kDelta / 4;
    op.inv_s = st_f + L::kInvS / 4;
    op.s_qk = s_q * s_k;
    op.s_dov = s_do * s_v;
    op.q0 = blk * kQBlockRows;
    op.j0 = j0;

    // Sᵀ, then dPᵀ: two groups, so P is computed while dPᵀ runs.
    Acc acc[kNBlocksQ][4];
    float dp[kNBlocksQ][4];
    auto& acc_flat = reinterpret_cast<Acc(&)[32]>(acc);
    auto& dp_flat = reinterpret_cast<float(&)[32]>(dp);
    hopper::wgmma_fence();
    {
      const uint64_t d_q8 = SmemDescs::of<L::kSwI8>(st16 + L::kQ8 / 16);
      F::template wgmma_n64_ss<false>(acc_flat, d_k8, d_q8);
#pragma unroll
      for (int kk = 1; kk < D / 32; ++kk)
        F::template wgmma_n64_ss<true>(acc_flat, hopper::desc_advance(d_k8, 32 * kk),
                                       hopper::desc_advance(d_q8, 32 * kk));
    }
    hopper::wgmma_commit();
    Acc dpi[kNBlocksQ][4];
    auto& dpi_flat = reinterpret_cast<Acc(&)[32]>(dpi);
    if constexpr (kQuantDov) {
      const uint64_t d_do = SmemDescs::of<L::kSwV>(st16 + L::kDo / 16);
      F::template wgmma_n64_ss<false>(dpi_flat, d_v, d_do);
#pragma unroll
      for (int kk = 1; kk < D / 32; ++kk)
        F::template wgmma_n64_ss<true>(dpi_flat, hopper::desc_advance(d_v, 32 * kk),
                                       hopper::desc_advance(d_do, 32 * kk));
    } else {
      // k-step kk: box kk / 4 (64 channels), 32 bytes per step inside it.
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t box = (kk / 4) * 128;
        const uint64_t dv_k = hopper::desc_advance(d_v, box * kKvTileRows + 32 * (kk % 4));
        const uint64_t do_k =
            SmemDescs::of<Swizzle::k128B>(st16 + (L::kDo + box * kQBlockRows + 32 * (kk % 4)) / 16);
        if (kk == 0)
          hopper::wgmma_m64n64k16_f32_ss<kBf16, false>(dp_flat, dv_k, do_k);
        else
          hopper::wgmma_m64n64k16_f32_ss<kBf16, true>(dp_flat, dv_k, do_k);
      }
    }
    hopper::wgmma_commit();
    // P while dPᵀ runs.
    hopper::wgmma_wait<1>();
    hopper::fence_operands(acc_flat);
    float p[kNBlocksQ][4];
    scores_to_p<F>(a, op, acc, warp, lane, p);
    hopper::wgmma_wait<0>();
    if constexpr (kQuantDov) {
      hopper::fence_operands(dpi_flat);
#pragma unroll
      for (int n = 0; n < kNBlocksQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = F::to_float(dpi[n][e]) * op.s_dov;
    } else {
      hopper::fence_operands(dp_flat);
    }
    TileFrags f;
    finish_tile<F>(op, p, dp, warp, lane, red + 2 * kWarps * (w & 1), f);  // the warpgroup's own maxima

    if constexpr (kAtomicDq) {
      // This warpgroup's half of dŜ (Q-row-major, for dQ = dŜ·K̂) and its scale, into
      // buffer w & 1 once both warpgroups' dQ of step w - 2 has read it. Buffer 1 is also
      // read once at step 0 (the unreduced product below): its consumptions are steps
      // -1, 1, 3, ..., buffer 0's 0, 2, 4, ..., so the one before step w's is phase
      // (w - 2 + (w & 1)) / 2.
      const int pw = w & 1;
      if (w >= 1) hopper::mbarrier_wait(&bar.ds_empty[pw], ((w - 2 + pw) >> 1) & 1);
      stage_ds(s_base + L::kDs + pw * L::kDsBytes, f.ds, ds_lane_row_off(warp, lane));
      if (threadIdx.x % 128 == 0) ds_scale[2 * pw + wg] = f.s_ds;
      hopper::fence_proxy_async();  // dŜ, before the wgmma that reads it
      __syncwarp();
      if (lane == 0) hopper::mbarrier_arrive(&bar.ds_full[pw]);
    }
    // Step w + S - 1's stage is step w - 1's: refill it once both warpgroups are done
    // with it.
    if (threadIdx.x == 0 && w + L::kStages - 1 < work) {
      const int ls = sidx == 0 ? L::kStages - 1 : sidx - 1;  // (w - 1) mod S
      if (w >= 1) hopper::mbarrier_wait(&bar.empty[ls], (sidx == 0 ? round - 1 : round) & 1);
      load_q(ls, ld);
    }
    ld.advance(first, blocks);

    // dV += P̂ᵀ·dÔ, dK += dŜᵀ·Q̂ by 64-column halves; two temporaries, each merged
    // as soon as its product is done while the next one runs.
    const float sc_dv = f.s_p * s_do, sc_dk = a.sm_scale * (f.s_ds * s_q);
    const uint64_t d_dot = SmemDescs::of<Swizzle::k64B>(st16 + L::kDot / 16);
    const uint64_t d_qt = SmemDescs::of<Swizzle::k64B>(st16 + L::kQt / 16);
    auto product_kv = [&](Acc(&tmp)[32], const uint32_t(&af)[2][4], uint64_t d_b, int h) {
      // Half h: rows 64h.. of the D × 64 tile (64 bytes each).
      const uint64_t d_h = hopper::desc_advance(d_b, 64 * 64 * h);
      hopper::wgmma_fence();
      F::template wgmma_n64_rs<false>(tmp, af[0], d_h);
      F::template wgmma_n64_rs<true>(tmp, af[1], hopper::desc_advance(d_h, 32));
      hopper::wgmma_commit();
    };
    Acc ta[32], tb[32];
    // Step w - 1's dQ, its first half issued under the last dK product. At step 0 there
    // is none: the product then reads buffer 1's unwritten bytes and is not reduced,
    // which keeps every wgmma issue out of a branch (ptxas serializes those).
    const int pu = (w - 1) & 1;
    Acc tq[kDqCols / 2];
    float sc_dq[2];
    auto dq_first_half = [&] {
      if constexpr (kAtomicDq) {
        if (w > 0) hopper::mbarrier_wait(&bar.ds_full[pu], ((w - 1) >> 1) & 1);
        dq_scales(pu, sc_dq);
        product_dq(tq, pu, 0);
      }
    };
    if constexpr (F::kMergeFree) {
      // Fixed scales: dV and dK accumulate in place, every product in one group.
      auto& dv_flat = reinterpret_cast<float(&)[D / 2]>(dv);
      auto& dk_flat = reinterpret_cast<float(&)[D / 2]>(dk);
      hopper::fence_operands_f32(dv_flat);
      hopper::fence_operands_f32(dk_flat);
      hopper::wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        auto& dvh = reinterpret_cast<float(&)[32]>(dv[8 * h]);
        const uint64_t d_h = hopper::desc_advance(d_dot, 64 * 64 * h);
        F::template wgmma_n64_rs<true>(dvh, f.p[0], d_h);
        F::template wgmma_n64_rs<true>(dvh, f.p[1], hopper::desc_advance(d_h, 32));
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        auto& dkh = reinterpret_cast<float(&)[32]>(dk[8 * h]);
        const uint64_t d_h = hopper::desc_advance(d_qt, 64 * 64 * h);
        F::template wgmma_n64_rs<true>(dkh, f.ds[0], d_h);
        F::template wgmma_n64_rs<true>(dkh, f.ds[1], hopper::desc_advance(d_h, 32));
      }
      hopper::wgmma_commit();
      hopper::fence_operands_f32(dv_flat);
      hopper::fence_operands_f32(dk_flat);
      dq_first_half();
      hopper::wgmma_wait<kAtomicDq ? 1 : 0>();
      fence_frags(f.p);
      fence_frags(f.ds);
      hopper::fence_operands_f32(dv_flat);
      hopper::fence_operands_f32(dk_flat);
      hopper::mbarrier_arrive(&bar.empty[sidx]);  // the stage's last reads, every thread's
    } else if constexpr (kHalves == 2) {
      product_kv(ta, f.p, d_dot, 0);
      product_kv(tb, f.p, d_dot, 1);
      hopper::wgmma_wait<1>();
      hopper::fence_operands(ta);
      merge_cols<D, F>(dv, ta, 0, sc_dv);
      product_kv(ta, f.ds, d_qt, 0);
      hopper::wgmma_wait<1>();
      fence_frags(f.p);  // the fragments stay allocated until their last reader is done
      hopper::fence_operands(tb);
      merge_cols<D, F>(dv, tb, 1, sc_dv);
      product_kv(tb, f.ds, d_qt, 1);
      hopper::wgmma_wait<1>();
      hopper::fence_operands(ta);
      merge_cols<D, F>(dk, ta, 0, sc_dk);
      dq_first_half();
      hopper::wgmma_wait<kAtomicDq ? 1 : 0>();
      fence_frags(f.ds);
      hopper::fence_operands(tb);
      __syncwarp();
      if (lane == 0) hopper::mbarrier_arrive(&bar.empty[sidx]);  // the stage's last reader
      merge_cols<D, F>(dk, tb, 1, sc_dk);
    } else {
      product_kv(ta, f.p, d_dot, 0);
      product_kv(tb, f.ds, d_qt, 0);
      hopper::wgmma_wait<1>();
      fence_frags(f.p);
      hopper::fence_operands(ta);
      merge_cols<D, F>(dv, ta, 0, sc_dv);
      dq_first_half();
      hopper::wgmma_wait<kAtomicDq ? 1 : 0>();
      fence_frags(f.ds);
      hopper::fence_operands(tb);
      __syncwarp();
      if (lane == 0) hopper::mbarrier_arrive(&bar.empty[sidx]);
      merge_cols<D, F>(dk, tb, 0, sc_dk);
    }
    if constexpr (kAtomicDq) {
      float x[kDqCols / 2];
      if (w > 0) dq_stage_free();
      dq_second_half(tq, pu, sc_dq, x);
      if (w > 0) dq_reduce(x, prev_bhq, prev_q0);
    }
    prev_bhq = bhq;
    prev_q0 = op.q0;
    if (++sidx == L::kStages) {
      sidx = 0;
      ++round;
    }
  }
  if constexpr (kAtomicDq) {  // the last step's dQ
    if (work > 0) {
      const int pu = (work - 1) & 1;
      hopper::mbarrier_wait(&bar.ds_full[pu], ((work - 1) >> 1) & 1);
      Acc tq[kDqCols / 2];
      float sc_dq[2], x[kDqCols / 2];
      dq_scales(pu, sc_dq);
      product_dq(tq, pu, 0);
      dq_stage_free();
      dq_second_half(tq, pu, sc_dq, x);
      dq_reduce(x, prev_bhq, prev_q0);
    }
    if constexpr (F::kMergeFree)
      if (wg_leader) hopper::bulk_wait_group<0>();  // the reductions, before the CTA exits
  }

  if constexpr (F::kMergeFree) {
    // The group's channel scales (the emulator's steps c, d): dV·s_dO,c/448 and
    // dK·sm_scale·s_Q',c, s = the channel's maximum / 448.
    const float* do_max = a.do_max + bhk * D;
    const float* sq_max = a.sq_max + bhk * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * n + 2 * t + e;
        const float sv = do_max[col] / F::kMax / F::kMax, sk = sq_max[col] / F::kMax;
        dv[n][e] *= sv;
        dv[n][e + 2] *= sv;
        dk[n][e] = a.sm_scale * dk[n][e] * sk;
        dk[n][e + 2] = a.sm_scale * dk[n][e + 2] * sk;
      }
  }
  // dK_j, dV_j: rows 16·warp + g (+8), columns 8n + 2t (+1), a column pair per store
  // where the rows are 4-byte aligned.
  const bool pairs = rows_aligned<T, 4>(a.dk) && rows_aligned<T, 4>(a.dv);
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int tok = j0 + 16 * warp + g + 8 * h2;
    if (tok >= a.nkv) continue;
    T* dkr = static_cast<T*>(a.dk.data) + b * a.dk.sb + hk * a.dk.sh + static_cast<int64_t>(tok) * a.dk.sn;
    T* dvr = static_cast<T*>(a.dv.data) + b * a.dv.sb + hk * a.dv.sh + static_cast<int64_t>(tok) * a.dv.sn;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = 8 * n + 2 * t;
      if (pairs && col + 1 < a.d) {
        *reinterpret_cast<uint32_t*>(dkr + col) = pack2<T>(dk[n][2 * h2], dk[n][2 * h2 + 1]);
        *reinterpret_cast<uint32_t*>(dvr + col) = pack2<T>(dv[n][2 * h2], dv[n][2 * h2 + 1]);
        continue;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (col + e < a.d) {
          store_out(dkr + col + e, dk[n][2 * h2 + e]);
          store_out(dvr + col + e, dv[n][2 * h2 + e]);
        }
      }
    }
  }
}

}  // namespace qattn::sagebwd
