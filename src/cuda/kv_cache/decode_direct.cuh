// The direct decode of NVFP4, FP8 E4M3, INT8 and BF16 caches at head dim 64 and 128
// (bench/NOTES.md v24b, v25, v30, v41, v85): no barriers in the key loop. Each warp owns 8 or
// 16 query rows and every fourth 16-key block of its chunk; each thread copies the bytes
// of its own fragments from the pages into its slots of the warp's stages (cp.async, a
// few blocks ahead), reads them back once they have landed, and the warp runs its own
// online softmax; the CTA's four warps merge once at the end. The stages hold what a
// register ring held before, so the kernel fits 128 registers and four CTAs per SM.
//
// The products are transposed so the keys fill the 16 rows of mma.sync m16n8k16 and the
// few query rows (GQA group × new tokens) its 8 columns: Sᵀ = K̂·Qᵀ and Oᵀ += V̂ᵀ·Pᵀ.
// With g = lane / 4, t = lane % 4 and D the head dim:
//   Sᵀ: A = K̂ (keys g and 8 + g of the block), B = Qᵀ (query row g of the n-block). The
//     head dimension is permuted for K and Q alike (a dot product does not change):
//     thread (g, t) holds D/4 elements of its keys (Bytes::k_elem): NVFP4 elements
//     [t·D/4, (t+1)·D/4), one 16-byte load of codes at D = 128; FP8/INT8 at D = 128 the
//     16-element pieces at 16t and 64 + 16t (two 16-byte loads that fill whole sectors).
//     Word w of that range (elements 8w .. 8w+7 of it) feeds k-steps 2w and 2w+1: slots
//     (2t, 2t+1) get elements (0, 2) then (4, 6), slots (2t+8, 2t+9) get (1, 3) then
//     (5, 7).
//   Pᵀ: the Sᵀ accumulator holds (keys g, 8 + g) × (queries 2t, 2t+1); movmatrix
//     transposes each 8×8 half into the B layout (keys 2t, 2t+1 | 8+2t, 9+2t × query g).
//   Oᵀ: A = V̂ᵀ. Row g of m-tile mt is element g·D/8 + 2mt and row 8 + g is the next
//     element, so thread (g, t) needs elements [g·D/8, (g+1)·D/8) of keys 2t, 2t+1,
//     8+2t, 9+2t (one scale block, or half of one at D = 64) and ends up owning those
//     D/8 contiguous output elements of its two query columns.
// All operands are FP16 (BF16 for a BF16 cache: its rows and Q as they are, P as a high
// part and a remainder) and exact. FP8 E4M3 and INT8 codes are FP16 values as they are
// (a hardware conversion; INT8 by the 1024 + 128 + x bias trick) and keep their FP32
// per-row scales outside the products, as the tiled kernel does: K's multiplies the
// score row, V's is folded into P relative to a per-warp running maximum σ of the V
// scales (so P·s_v/σ ≤ 1 keeps FP16's precision), and the output is multiplied by σ
// before the warps merge. For NVFP4, an E2M1 code read as FP16 bits is 2^-14 of its
// value, and that times the E4M3 scale (a multiple of 2^-24 with at most 6 significant bits,
// at most 0.17) is exactly K̂·2^-14 or V̂·2^-14; Q is scaled per row by a power of two
// 2^e into [2^14, 2^15) (exact for every element within 2^31 of the row's largest); P
// is split into a 16-bit high part and its remainder. The powers of two come off in
// FP32 (scores: in the softmax scale; output: with 1/l), so the result is the
// emulation's to FP32 rounding, as the tiled kernel's is.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/exp2.cuh"
#include "cuda/common/mma_sync.cuh"
#include "cuda/kv_cache/dequant.cuh"
#include "cuda/kv_cache/workspace.h"

namespace qattn::kv_cache::direct {

constexpr int kWarps = 4;
constexpr int kBlock = 16;  // keys per step of a warp
// A chunk starts on a block boundary (kvcache::decode_chunk_keys), so a block lies in one
// page wherever pages hold a multiple of kBlock keys (stage_block's single lookup).
static_assert(kvcache::kDecodeChunkAlign % kBlock == 0, "decode chunks start on block boundaries");

// What a format puts in one thread's registers per 16-key block (bytes per key).
template <KvFormat F, int D>
struct Bytes {
  static_assert(D == 64 || D == 128, "the direct decode runs head dims 64 and 128");
  static constexpr bool kBf16 = F == KvFormat::Bf16;  // the values as stored, no scales
  static constexpr bool kRowScales = F == KvFormat::Fp8E4M3 || F == KvFormat::Int8;  // one FP32 scale a row
  static constexpr int kElemBits = F == KvFormat::NvFp4 ? 4 : kBf16 ? 16 : 8;
  static constexpr int kK = D / 4 * kElemBits / 8;  // D/4 elements of each of keys g, 8+g
  static constexpr int kV = D / 8 * kElemBits / 8;  // elements [g·D/8, (g+1)·D/8)
  // A thread's K bytes are 16-byte pieces p = 0, 1, ... at bytes 16·(4p + t) of the key's
  // row (pieces of 8 bytes: at kK·t), so the four threads of a key read 64 contiguous
  // bytes in each copy instruction, whole 32-byte sectors (one 32-byte piece at 32·t
  // would take half of each of twice the sectors per instruction).
  static constexpr int kKPiece = kK >= 16 ? 16 : kK;
  static constexpr int kKPieceElems = kKPiece * 8 / kElemBits;
  // Byte offset in the key's row of piece p of thread t's K bytes.
  static __device__ __forceinline__ int k_piece_byte(int p, int t) {
    return kK >= 16 ? 16 * (4 * p + t) : kK * t;
  }
  // The head-dim index of element e of thread t's K range (Q and the mean c alike).
  static __device__ __forceinline__ int k_elem(int e, int t) {
    return k_piece_byte(e / kKPieceElems, t) * 8 / kElemBits + e % kKPieceElems;
  }
  // The FP16 operands are 2^-kOperandExp of the values they stand for (E2M1 bits).
  static constexpr int kOperandExp = F == KvFormat::NvFp4 ? 14 : 0;
  // A (token, head) row's code and scale bytes (kvcache::page_layout; run_direct checks).
  static constexpr int kCodeRow = D * kElemBits / 8;
  static constexpr int kScaleRow = kRowScales ? 4 : kBf16 ? 0 : D / 16;
  // The products' 16-bit type: BF16 rows are BF16 operands; every other format's codes
  // (times their NVFP4 scales) are exact in FP16.
  using Operand = std::conditional_t<kBf16, __nv_bfloat16, __half>;
};

// The raw bytes one thread holds for one 16-key block, read back from its stage.
template <KvFormat F, int D>
struct Raw {
  using B = Bytes<F, D>;
  uint32_t k[2][B::kK / 4];  // keys g and 8 + g
  uint32_t k_scales[2];      // NVFP4: their D/64 scale bytes (low bytes); else FP32 bits
  uint32_t v[4][B::kV / 4];  // keys 2t, 2t+1, 8+2t, 9+2t
  // NVFP4: the scale byte of each V key's element range; else the FP32 V scales of keys
  // g and 8 + g (entries 0 and 1), which fold into those keys' P.
  uint32_t v_scales[B::kRowScales ? 2 : 4];
};

// INT8 codes are held as unsigned bytes x + 128 (the sign bit flipped), which the FP16
// conversion below reads as 1024 + 128 + x.
constexpr uint32_t kInt8Bias = 0x80808080u;

// A warp's stage: the bytes of one 16-key block, copied by cp.async into shared memory
// by the thread that will read them (no barrier: each thread waits for its own copies).
// A thread's record is kCodeSlots 16-byte slots of codes (K keys g, 8+g, then V keys 2t,
// 2t+1, 8+2t, 9+2t, each key's bytes contiguous) and kScaleSlots of scale words (per key
// the aligned 4-byte word holding its scale bytes). Slot s of lane l sits at 16·(32s + l),
// so a warp's 16-byte accesses to one slot are conflict-free.
template <KvFormat F, int D>
struct Stage {
  using B = Bytes<F, D>;
  static constexpr int kCodeBytes = 2 * B::kK + 4 * B::kV;
  static constexpr int kCodeSlots = kCodeBytes / 16;
  static constexpr int kScaleWords = B::kBf16 ? 0 : B::kRowScales ? 4 : 6;  // K keys', then V keys'
  static constexpr int kScaleSlots = (kScaleWords + 3) / 4;
  static constexpr int kSlots = kCodeSlots + kScaleSlots;
  static constexpr int kBytes = kSlots * 32 * 16;  // one stage of one warp
  static_assert(kCodeBytes % 16 == 0 && B::kV % 4 == 0 && (2 * B::kK) % B::kV == 0,
                "every key's bytes are one aligned piece inside a slot or whole slots");
  // Where lane (g, t)'s record sits in a V slot. V pieces of 16 bytes (FP8 and INT8 at
  // D = 128) come from bytes 16g of key 2t + r's row, so lanes g = 2k and 2k + 1 of one t
  // share a 32-byte sector: side by side in shared memory (8·(g/2) + 2t + g%2) each
  // sector lands in one write, where at lane order (4g + t) every 16-byte piece was its
  // own sector request, twice the L2 sectors of the bytes (bench/NOTES.md v73). A
  // quarter-warp's eight positions still fall in distinct 16-byte bank groups.
  static constexpr __host__ __device__ int v_position(int lane) {
    if constexpr (B::kV != 16) {
      return lane;
    } else {
      const int g = lane / 4, t = lane % 4;
      return 8 * (g / 2) + 2 * t + g % 2;
    }
  }
  // The positions are a permutation of the lanes, each quarter-warp's eight fall in
  // distinct 16-byte bank groups (conflict-free 16-byte accesses), and the two lanes of a
  // sector (g = 2k, 2k + 1) are side by side in that order.
  static constexpr bool v_positions_ok() {
    bool seen[32] = {};
    for (int lane = 0; lane < 32; ++lane) {
      const int p = v_position(lane);
      if (p < 0 || p >= 32 || seen[p]) return false;
      seen[p] = true;
    }
    for (int q = 0; q < 4; ++q) {
      bool group[8] = {};
      for (int lane = 8 * q; lane < 8 * q + 8; ++lane) {
        if (group[v_position(lane) % 8]) return false;
        group[v_position(lane) % 8] = true;
      }
    }
    if constexpr (B::kV == 16)
      for (int lane = 0; lane < 32; lane += 8)
        for (int t = 0; t < 4; ++t)
          if (v_position(lane + 4 + t) != v_position(lane + t) + 1) return false;
    return true;
  }
  static_assert(v_positions_ok(), "V record positions: a conflict-free permutation, sectors whole");
};

// The shared-memory address of byte `o` of the record at position `pos` (the lane, or
// Stage::v_position in V slots) in the stage at `stage`.
__device__ __forceinline__ uint32_t record_byte(uint32_t stage, int o, int pos) {
  return stage + 16 * (32 * (o / 16) + pos) + o % 16;
}

// `N` bytes (4, 8 or a multiple of 16) at p into the record at position `pos`, byte o, or
// zeros.
template <int N>
__device__ __forceinline__ void stage_piece(uint32_t stage, int o, int pos, const uint8_t* p,
                                            bool ok) {
  if constexpr (N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i)
      common::cp_async_or_zeros<16>(record_byte(stage, o + 16 * i, pos), p + 16 * i, ok);
  } else {
    static_assert(N == 8 || N == 4, "4, 8 or a multiple of 16 bytes");
    common::cp_async_or_zeros<N>(record_byte(stage, o, pos), p, ok);
  }
}

// Where a key's bytes are: its page's byte offset in the pool, its slot in the page, and
// whether it is read (false past the chunk's end or for a page outside the pool).
struct KeyPlace {
  int64_t page_off;
  int slot;
  bool ok;
};

// The block-table index of key j (a shift where the page size is a power of two).
__device__ __forceinline__ int page_of(const DecodeArgs& a, int j) {
  return a.page_shift >= 0 ? j >> a.page_shift : j / a.page_size;
}
// Whether block-table entry p names a page of the pool.
__device__ __forceinline__ bool in_pool(const DecodeArgs& a, int32_t p) {
  return p >= 0 && p < a.num_pages;
}

// This thread's addresses in one KV head's sections of page 0, for a block whose first
// key is in slot 0: key g's first K piece and scale word, key 2t's V bytes (its element
// range) and its V scale word (NVFP4; the row-scale formats' V scale is key g's). A block
// at slot s0 of page p adds p·page_bytes + s0·row to each; the thread's other keys are a
// fixed number of rows further (8 + g: 8 rows; 2t + 1, 8 + 2t, 9 + 2t: 1, 8, 9 rows), so
// every copy of a block is one of four pointers plus an immediate offset.
struct ThreadBytes {
  const uint8_t* k;
  const uint8_t* v;
  const uint8_t* ks;
  const uint8_t* vs;
};

template <KvFormat F, int D>
__device__ __forceinline__ ThreadBytes thread_bytes(const uint8_t* k_codes,
                                                    const uint8_t* v_codes,
                                                    const uint8_t* k_scales,
                                                    const uint8_t* v_scales) {
  using B = Bytes<F, D>;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  ThreadBytes tb;
  tb.k = k_codes + g * B::kCodeRow + B::k_piece_byte(0, t);
  tb.v = v_codes + 2 * t * B::kCodeRow + B::kV * g;
  if constexpr (B::kBf16) {
    tb.ks = tb.vs = nullptr;  // no scales
  } else if constexpr (B::kRowScales) {
    tb.ks = k_scales + g * B::kScaleRow;
    tb.vs = v_scales + g * B::kScaleRow;
  } else {
    const int kb = D == 128 ? 2 * t : t, vb = g * D / 128;  // read_block's scale bytes
    tb.ks = k_scales + g * B::kScaleRow + (kb & ~3);
    tb.vs = v_scales + 2 * t * B::kScaleRow + (vb & ~3);
  }
  return tb;
}

// Copies one 16-key block that lies in one page (page entry `p`, its first key at slot
// `slot0`; keys k ≥ kend are past the chunk) into `stage`, not committed; returns whether
// `p` lies outside the pool (the block's keys read as zeros).
template <KvFormat F, int D>
__device__ __forceinline__ bool stage_block_in_page(const DecodeArgs& a, const ThreadBytes& tb,
                                                    int32_t p, int slot0, int kend,
                                                    uint32_t stage) {
  using B = Bytes<F, D>;
  using S = Stage<F, D>;
  constexpr int kCr = B::kCodeRow, kSr = B::kScaleRow;
  constexpr int kScale0 = S::kCodeSlots * 16;  // the record's first scale word
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bool ok = in_pool(a, p);
  const int64_t page = ok ? p * a.page_bytes : 0;
  const uint8_t* k = tb.k + page + slot0 * kCr;
  const uint8_t* v = tb.v + page + slot0 * kCr;
  const uint8_t* ks = tb.ks + page + slot0 * kSr;
  const uint8_t* vs = tb.vs + page + slot0 * kSr;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool read = ok && 8 * i + g < kend;
#pragma unroll
    for (int q = 0; q < B::kK / B::kKPiece; ++q)
      stage_piece<B::kKPiece>(stage, B::kK * i + B::kKPiece * q, lane,
                              k + 8 * i * kCr + (B::k_piece_byte(q, 0) - B::k_piece_byte(0, 0)),
                              read);
    if constexpr (!B::kBf16) stage_piece<4>(stage, kScale0 + 4 * i, lane, ks + 8 * i * kSr, read);
    if constexpr (B::kRowScales) stage_piece<4>(stage, kScale0 + 4 * (2 + i), lane, vs + 8 * i * kSr, read);
  }
  constexpr int kRows[4] = {0, 1, 8, 9};  // keys 2t, 2t + 1, 8 + 2t, 9 + 2t
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool read = ok && 2 * t + kRows[i] < kend;
    stage_piece<B::kV>(stage, 2 * B::kK + B::kV * i, S::v_position(lane), v + kRows[i] * kCr,
                       read);
    if constexpr (F == KvFormat::NvFp4)
      stage_piece<4>(stage, kScale0 + 4 * (2 + i), lane, vs + kRows[i] * kSr, read);
  }
  return !ok;
}

// Copies one 16-key block's bytes for this thread into `stage` (not committed), looking
// up each key's page (page sizes that are not a multiple of 16 keys, where a block may
// span pages; the others take stage_block_in_page); returns whether a page index of the
// block lies outside the pool (its keys read as zeros).
template <KvFormat F, int D>
__device__ __forceinline__ bool stage_block_by_key(const DecodeArgs& a, const int32_t* table,
                                            const uint8_t* k_codes, const uint8_t* v_codes,
                                            const uint8_t* k_scales, const uint8_t* v_scales,
                                            int j0, int je, uint32_t stage) {
  using B = Bytes<F, D>;
  using S = Stage<F, D>;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  constexpr int kScale0 = S::kCodeSlots * 16;  // the record's first scale word
  // A slot's byte offset in its page section (slots and row sizes are non-negative).
  auto in_page = [](int slot, int row_bytes) {
    return static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint32_t>(slot)) *
                                static_cast<uint32_t>(row_bytes));
  };
  // `place(k)`: the KeyPlace of key j0 + k.
  auto copy = [&](auto&& place) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const KeyPlace kp = place(8 * i + g);
      const int64_t row = kp.page_off + in_page(kp.slot, B::kCodeRow);
#pragma unroll
      for (int p = 0; p < B::kK / B::kKPiece; ++p)
        stage_piece<B::kKPiece>(stage, B::kK * i + B::kKPiece * p, lane,
                                k_codes + row + B::k_piece_byte(p, t), kp.ok);
      const int64_t srow = kp.page_off + in_page(kp.slot, B::kScaleRow);
      if constexpr (B::kRowScales) {
        stage_piece<4>(stage, kScale0 + 4 * i, lane, k_scales + srow, kp.ok);
        stage_piece<4>(stage, kScale0 + 4 * (2 + i), lane, v_scales + srow, kp.ok);
      } else if constexpr (F == KvFormat::NvFp4) {
        // Scale bytes 2t, 2t+1 (D = 128) or byte t (D = 64) of the row: the word holding them.
        const int sb = D == 128 ? 2 * t : t;
        stage_piece<4>(stage, kScale0 + 4 * i, lane, k_scales + srow + (sb & ~3), kp.ok);
      }
    }
    const int vkeys[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const KeyPlace kp = place(vkeys[i]);
      const int64_t row = kp.page_off + in_page(kp.slot, B::kCodeRow);
      stage_piece<B::kV>(stage, 2 * B::kK + B::kV * i, S::v_position(lane),
                         v_codes + row + B::kV * g, kp.ok);
      if constexpr (F == KvFormat::NvFp4) {
        const int sb = g * D / 128;  // this thread's element range's scale byte
        const int64_t srow = kp.page_off + in_page(kp.slot, B::kScaleRow);
        stage_piece<4>(stage, kScale0 + 4 * (2 + i), lane, v_scales + srow + (sb & ~3), kp.ok);
      }
    }
  };
  const int kend = je - j0;  // keys k < kend are the chunk's
  bool bad = false;
  copy([&](int k) {
    if (k >= kend) return KeyPlace{0, 0, false};
    const int pi = page_of(a, j0 + k);
    const int32_t p = __ldg(table + pi);
    const bool ok = in_pool(a, p);
    bad |= !ok;
    return KeyPlace{p * a.page_bytes, j0 + k - pi * a.page_size, ok};
  });
  return bad;
}

// Part of this thread's record in the stage at `stage` (its copies complete) as a
// block's registers: kKeys, the K codes and every scale (what Sᵀ and the softmax read),
// or else the V codes (read after the softmax, so they are not live across it). The
// loads are volatile: they stay between the wait for the stage and its next refill.
template <bool kKeys, KvFormat F, int D>
__device__ __forceinline__ void read_block(uint32_t stage, Raw<F, D>& r) {
  using B = Bytes<F, D>;
  using S = Stage<F, D>;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  constexpr int kFirst = kKeys ? 0 : (2 * B::kK) / 16;
  constexpr int kEnd = kKeys ? (2 * B::kK + 15) / 16 : S::kCodeSlots;
  constexpr int kScaleEnd = kKeys ? S::kSlots : 0;
  uint32_t w[S::kSlots * 4];
  const int pos = kKeys ? lane : S::v_position(lane);  // the V slots' own order
  auto load = [&](int s) {
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(record_byte(stage, 16 * s, pos))
                 : "memory");
    w[4 * s] = x.x, w[4 * s + 1] = x.y, w[4 * s + 2] = x.z, w[4 * s + 3] = x.w;
  };
#pragma unroll
  for (int s = kFirst; s < kEnd; ++s) load(s);
#pragma unroll
  for (int s = S::kCodeSlots; s < kScaleEnd; ++s) load(s);
  constexpr uint32_t kBias = F == KvFormat::Int8 ? kInt8Bias : 0u;
  if constexpr (kKeys) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < B::kK / 4; ++e) r.k[i][e] = w[(B::kK * i) / 4 + e] ^ kBias;
    constexpr int kW0 = S::kCodeSlots * 4;
    if constexpr (B::kBf16) {
      // no scales
    } else if constexpr (B::kRowScales) {
      r.k_scales[0] = w[kW0], r.k_scales[1] = w[kW0 + 1];
      r.v_scales[0] = w[kW0 + 2], r.v_scales[1] = w[kW0 + 3];
    } else {
      // The scale bytes at their offsets inside the staged words (stage_block).
      const int kb = D == 128 ? 2 * t : t, vb = g * D / 128;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        r.k_scales[i] = D == 128 ? __byte_perm(w[kW0 + i], 0u, (kb & 3) == 0 ? 0x4410u : 0x4432u)
                                 : __byte_perm(w[kW0 + i], 0u, 0x4440u | (kb & 3));
#pragma unroll
      for (int i = 0; i < 4; ++i)
        r.v_scales[i] = __byte_perm(w[kW0 + 2 + i], 0u, 0x4440u | (vb & 3));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < B::kV / 4; ++e) r.v[i][e] = w[(2 * B::kK + B::kV * i) / 4 + e] ^ kBias;
  }
}

// Two FP8/INT8 codes, bytes `kSel` & 0xF and `kSel` >> 4 of x, as an FP16 pair (the
// first in the low half), exactly. INT8 codes arrive biased (x + 128: kInt8Bias).
template <KvFormat F, uint32_t kSel>
__device__ __forceinline__ uint32_t code_pair(uint32_t x) {
  if constexpr (F == KvFormat::Fp8E4M3) {
    return e4m3x2_to_f16x2_bits(static_cast<uint16_t>(__byte_perm(x, 0u, kSel)));
  } else {
    // 0x64 over a byte u is the FP16 value 1024 + u; u = x + 128 (read_block flipped the
    // sign bits).
    constexpr uint32_t kBiasSel = 0x4040u | ((kSel & 0xFu) | ((kSel >> 4) << 8));
    const uint32_t h = __byte_perm(x, 0x64646464u, kBiasSel);
    return bits_of(__hsub2(as_half2(h), __float2half2_rn(1152.f)));
  }
}

// An FP16 pair from two high bytes of x: selector 0x1404 takes bytes 0 and 1, 0x3424
// bytes 2 and 3, 0x2404 bytes 0 and 2, 0x3414 bytes 1 and 3.
template <uint32_t kSel>
__device__ __forceinline__ uint32_t f16_pair(uint32_t x) {
  return __byte_perm(x, 0u, kSel);
}

__device__ __forceinline__ uint32_t scaled(uint32_t pair, __half2 s2) {
  return bits_of(__hmul2(as_half2(pair), s2));
}

// Sᵀ's A fragments of k-steps 2w and 2w + 1 (elements 8w .. 8w+7 of the thread's range
// of keys g and 8 + g; the mapping in the header comment).
template <KvFormat F, int D>
__device__ __forceinline__ void k_fragments(const Raw<F, D>& r, int w, uint32_t (&a0)[4],
                                            uint32_t (&a1)[4]) {
  if constexpr (F == KvFormat::NvFp4) {
    // The E4M3 scales of keys g, 8+g for this group's 16-element block (2t + w/2 at D = 128).
    __half2 ks[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __half2 pair = as_half2(e4m3x2_to_f16x2_bits(static_cast<uint16_t>(r.k_scales[i])));
      ks[i] = (w / 2) % 2 == 0 ? __low2half2(pair) : __high2half2(pair);
    }
    uint32_t ev[2], od[2];
    e2m1_high_bytes(r.k[0][w], ev[0], od[0]);
    e2m1_high_bytes(r.k[1][w], ev[1], od[1]);
    a0[0] = scaled(f16_pair<0x1404>(ev[0]), ks[0]);
    a0[1] = scaled(f16_pair<0x1404>(ev[1]), ks[1]);
    a0[2] = scaled(f16_pair<0x1404>(od[0]), ks[0]);
    a0[3] = scaled(f16_pair<0x1404>(od[1]), ks[1]);
    a1[0] = scaled(f16_pair<0x3424>(ev[0]), ks[0]);
    a1[1] = scaled(f16_pair<0x3424>(ev[1]), ks[1]);
    a1[2] = scaled(f16_pair<0x3424>(od[0]), ks[0]);
    a1[3] = scaled(f16_pair<0x3424>(od[1]), ks[1]);
  } else if constexpr (F == KvFormat::Bf16) {
    // Elements 2j, 2j + 1 are the halves of word 4w + j.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      a0[i] = __byte_perm(r.k[i][4 * w], r.k[i][4 * w + 1], 0x5410);  // elements 0, 2
      a0[2 + i] = __byte_perm(r.k[i][4 * w], r.k[i][4 * w + 1], 0x7632);  // 1, 3
      a1[i] = __byte_perm(r.k[i][4 * w + 2], r.k[i][4 * w + 3], 0x5410);  // 4, 6
      a1[2 + i] = __byte_perm(r.k[i][4 * w + 2], r.k[i][4 * w + 3], 0x7632);  // 5, 7
    }
  } else {
    // Elements 0..3 are the bytes of word 2w, 4..7 those of word 2w + 1.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      a0[i] = code_pair<F, 0x20>(r.k[i][2 * w]);
      a0[2 + i] = code_pair<F, 0x31>(r.k[i][2 * w]);
      a1[i] = code_pair<F, 0x20>(r.k[i][2 * w + 1]);
      a1[2 + i] = code_pair<F, 0x31>(r.k[i][2 * w + 1]);
    }
  }
}

// Oᵀ's A fragment of m-tile mt: elements 2mt and 2mt + 1 of the thread's range of keys
// (2t, 2t+1) and (8+2t, 9+2t).
template <KvFormat F, int D>
__device__ __forceinline__ void v_fragment(const Raw<F, D>& r, int mt, uint32_t (&av)[4]) {
  if constexpr (F == KvFormat::NvFp4) {
    // Byte 2·half + sub of word w of each key holds elements 2mt, 2mt + 1 (two nibbles).
    const int w = mt / 4, half = (mt / 2) % 2, sub = mt % 2;
    const __half2 vs01 =
        as_half2(e4m3x2_to_f16x2_bits(static_cast<uint16_t>(r.v_scales[0] | (r.v_scales[1] << 8))));
    const __half2 vs23 =
        as_half2(e4m3x2_to_f16x2_bits(static_cast<uint16_t>(r.v_scales[2] | (r.v_scales[3] << 8))));
    uint32_t ev[2], od[2];
    const uint32_t sel = half == 0 ? 0x5410u : 0x7632u;
    e2m1_high_bytes(__byte_perm(r.v[0][w], r.v[1][w], sel), ev[0], od[0]);
    e2m1_high_bytes(__byte_perm(r.v[2][w], r.v[3][w], sel), ev[1], od[1]);
    if (sub == 0) {
      av[0] = scaled(f16_pair<0x2404>(ev[0]), vs01);
      av[1] = scaled(f16_pair<0x2404>(od[0]), vs01);
      av[2] = scaled(f16_pair<0x2404>(ev[1]), vs23);
      av[3] = scaled(f16_pair<0x2404>(od[1]), vs23);
    } else {
      av[0] = scaled(f16_pair<0x3414>(ev[0]), vs01);
      av[1] = scaled(f16_pair<0x3414>(od[0]), vs01);
      av[2] = scaled(f16_pair<0x3414>(ev[1]), vs23);
      av[3] = scaled(f16_pair<0x3414>(od[1]), vs23);
    }
  } else if constexpr (F == KvFormat::Bf16) {
    // Word mt of each key holds elements 2mt, 2mt + 1; pair the keys per element.
    av[0] = __byte_perm(r.v[0][mt], r.v[1][mt], 0x5410);  // element 2mt of keys 2t, 2t+1
    av[1] = __byte_perm(r.v[0][mt], r.v[1][mt], 0x7632);  // element 2mt + 1
    av[2] = __byte_perm(r.v[2][mt], r.v[3][mt], 0x5410);
    av[3] = __byte_perm(r.v[2][mt], r.v[3][mt], 0x7632);
  } else {
    // Word mt / 2 of each key holds elements 2mt, 2mt + 1 at bytes 2(mt % 2), +1; the
    // byte-permute interleaves the two keys of a pair: (key 2t, key 2t+1) per element.
    const int w = mt / 2;
    const uint32_t sel = mt % 2 == 0 ? 0x5140u : 0x7362u;
    const uint32_t x01 = __byte_perm(r.v[0][w], r.v[1][w], sel);
    const uint32_t x23 = __byte_perm(r.v[2][w], r.v[3][w], sel);
    av[0] = code_pair<F, 0x10>(x01);  // element 2mt of keys 2t, 2t+1
    av[1] = code_pair<F, 0x32>(x01);  // element 2mt + 1
    av[2] = code_pair<F, 0x10>(x23);
    av[3] = code_pair<F, 0x32>(x23);
  }
}

// CTAs per SM (workspace.h): 8 query rows per n-block.
template <KvFormat F, int D>
constexpr int ctas_per_sm(int nqb) {
  return decode_ctas_per_sm(F, D, 8 * nqb);
}

// The merge's buffers of one warp (its output fragments, then its m and l), which reuse
// that warp's stages once its loop is done.
template <int D, int NQB>
constexpr int merge_bytes() {
  return (NQB * (D / 16) * 4 + NQB * 4) * 32 * 4;
}

// With two n-blocks, what the loop reads of the query rows lives in shared memory (one
// copy per CTA, written by warp 0) instead of registers: Q's B fragments (each lane's
// words of a k-step pair as one 16-byte load; 16 registers a thread per n-block at
// D = 128) and each lane's column scales and causal limits (a 16-byte record each), and
// q·c for the end. That is what stands between two n-blocks and one more CTA per SM
// (bench/NOTES.md v84). One n-block keeps them in registers.
template <int NQB>
inline constexpr bool kQInSmem = NQB > 1;
template <int D, int NQB>
constexpr int q_frag_bytes() {
  return NQB * (D / 32) * 32 * 16;
}
template <int D, int NQB>
constexpr int q_smem_bytes() {
  return kQInSmem<NQB> ? q_frag_bytes<D, NQB>() + 3 * 32 * 16 : 16;
}

// Stages per warp (blocks in flight: one computed, the rest loading), the most that fit
// the CTAs per SM in the 227 KB of shared memory an SM gives (1 KB of it per CTA kept by
// the system), at most four.
template <KvFormat F, int D, int NQB>
constexpr int stages_per_warp() {
  constexpr int kPerCta =
      227 * 1024 / ctas_per_sm<F, D>(NQB) - 1024 - 256 - q_smem_bytes<D, NQB>();  // - static
  static_assert(kWarps * 2 * Stage<F, D>::kBytes <= kPerCta,
                "two stages a warp fit the CTAs per SM that decode_ctas_per_sm promises");
  int n = 4;
  while (n > 2 && kWarps * n * Stage<F, D>::kBytes > kPerCta) --n;
  return n;
}

template <KvFormat F, int D, int NQB>
constexpr int warp_region_bytes() {
  constexpr int kStages = stages_per_warp<F, D, NQB>() * Stage<F, D>::kBytes;
  return kStages > merge_bytes<D, NQB>() ? kStages : merge_bytes<D, NQB>();
}

// The dynamic shared memory of a CTA.
template <KvFormat F, int D, int NQB>
constexpr int direct_smem_bytes() {
  return kWarps * warp_region_bytes<F, D, NQB>();
}

// 2^e as a float for e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

template <typename T, KvFormat F, int D, int NQB>
__global__ void __launch_bounds__(kWarps * 32, ctas_per_sm<F, D>(NQB))
    decode_direct_kernel(const DecodeArgs a) {
  constexpr bool kRowScales = Bytes<F, D>::kRowScales;
  constexpr int kOperandExp = Bytes<F, D>::kOperandExp;
  constexpr bool kBf16Rows = Bytes<F, D>::kBf16;
  using Op = typename Bytes<F, D>::Operand;
  constexpr int kKd = D / 16;    // k-steps of Sᵀ
  constexpr int kMt = D / 16;    // m-tiles of Oᵀ
  constexpr int kRange = D / 8;  // output elements per thread and column
  constexpr int kRows = 8 * NQB;
  constexpr int kRegion = warp_region_bytes<F, D, NQB>();
  extern __shared__ __align__(16) uint8_t smem[];  // kWarps regions: stages, then the merge
  __shared__ int s_bad;
  __shared__ __align__(16) uint8_t s_q[q_smem_bytes<D, NQB>()];  // kQInSmem: Q's fragments
  // Lane `lane`'s 16 bytes of k-steps 2w, 2w + 1 of n-block qb in s_q.
  const uint32_t s_q_lane = static_cast<uint32_t>(__cvta_generic_to_shared(s_q)) + 16 * (threadIdx.x % 32);
  auto q_at = [&](int qb, int w) { return s_q_lane + 16 * 32 * (qb * (D / 32) + w); };
  // The lane's records after the fragments: column scales, causal limits, q·c.
  auto q_rec = [&](int i) { return s_q_lane + q_frag_bytes<D, NQB>() + 16 * 32 * i; };
  static_assert(NQB <= 2, "one 16-byte record holds a lane's two columns of two n-blocks");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  // Warp w's merge buffers (w ≥ 1) in its own region: s_o(w, i) and s_ml(w, i) are rows
  // of 32 floats.
  auto s_o = [&](int w, int i) { return reinterpret_cast<float*>(smem + w * kRegion) + 32 * i; };
  auto s_ml = [&](int w, int i) {
    return reinterpret_cast<float*>(smem + w * kRegion) + 32 * (NQB * kMt * 4 + i);
  };
  const int split = blockIdx.x % a.splits, row0 = (blockIdx.x / a.splits) * kRows;
  const int hk = blockIdx.y, b = blockIdx.z;
  if (threadIdx.x == 0) s_bad = 0;

  int L = __ldg(a.lengths + b);
  const bool bad_length = L < 0 || L > a.capacity;
  if (bad_length) L = 0;
  const int chunk = kvcache::decode_chunk_keys(L, a.splits);  // a multiple of 16
  const int jb = min(L, split * chunk), je = min(L, (split + 1) * chunk);
  const int32_t* table = a.block_tables + int64_t{b} * a.max_pages_per_seq;
  const uint8_t* k_codes = a.pages + a.k_codes + hk * a.head_code_bytes;
  const uint8_t* v_codes = a.pages + a.v_codes + hk * a.head_code_bytes;
  const uint8_t* k_scales = a.pages + a.k_scales + hk * a.head_scale_bytes;
  const uint8_t* v_scales = a.pages + a.v_scales + hk * a.head_scale_bytes;

  // Q as the B operand: query row row0 + 8qb + g, the permuted head dimension (above),
  // BF16-rounded as the emulation's, then times 2^e in FP16 (a BF16 cache: in BF16 as it
  // is, e = 0). q·c of that row.
  uint32_t qf[NQB][kKd][2];  // with kQInSmem, only until warp 0 has stored them
  float qc[NQB];
  float col_scale[NQB][2];  // score → log2-domain logit of columns 2t, 2t+1
  int lim[NQB][2];          // last visible key of those columns
  const float* c = a.k_mean != nullptr ? a.k_mean + (int64_t{b} * a.heads_kv + hk) * D : nullptr;
#pragma unroll
  for (int qb = 0; qb < NQB; ++qb) {
    const int r = row0 + 8 * qb + g;
    const bool real = r < a.rows;
    const int rr = real ? r : a.rows - 1;
    const int i = rr % a.nq, hq = hk * a.group + rr / a.nq;
    const T* q = static_cast<const T*>(a.q) + b * a.q_sb + hq * a.q_sh + i * a.q_sn;
    float x[D / 4];
    float amax = 0.f, dot = 0.f;
#pragma unroll
    for (int e = 0; e < D / 4; ++e) {
      const int dim = Bytes<F, D>::k_elem(e, t);  // the K range's permuted head dimension
      x[e] = real ? __bfloat162float(__float2bfloat16_rn(common::to_float(q[dim]))) : 0.f;
      amax = fmaxf(amax, fabsf(x[e]));
      if (c != nullptr) dot += x[e] * __ldg(c + dim);
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    dot += __shfl_xor_sync(0xffffffffu, dot, 2);
    qc[qb] = dot;
    // e with amax·2^e in [2^14, 2^15): 14 minus amax's exponent, kept a normal float.
    const int ex = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu) - 127;
    const int e = kBf16Rows ? 0 : max(-112, min(127, 14 - ex));
    const float up = pow2(e);
    auto pair = [](float lo, float hi) {
      return kBf16Rows ? bits_of(__floats2bfloat162_rn(lo, hi)) : bits_of(__floats2half2_rn(lo, hi));
    };
#pragma unroll
    for (int w = 0; w < D / 32; ++w) {
      const float* y = x + 8 * w;
      qf[qb][2 * w][0] = pair(y[0] * up, y[2] * up);
      qf[qb][2 * w][1] = pair(y[1] * up, y[3] * up);
      qf[qb][2 * w + 1][0] = pair(y[4] * up, y[6] * up);
      qf[qb][2 * w + 1][1] = pair(y[5] * up, y[7] * up);
      if (kQInSmem<NQB> && warp == 0)
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_at(qb, w)),
                     "r"(qf[qb][2 * w][0]), "r"(qf[qb][2 * w][1]), "r"(qf[qb][2 * w + 1][0]),
                     "r"(qf[qb][2 * w + 1][1])
                     : "memory");
    }
    for (int cc = 0; cc < 2; ++cc) {
      const int ec = __shfl_sync(0xffffffffu, e, 4 * (2 * t + cc));
      col_scale[qb][cc] = a.scale_log2 * pow2(kOperandExp - ec);
      const int rc = row0 + 8 * qb + 2 * t + cc;
      lim[qb][cc] = a.causal ? (rc < a.rows ? rc % a.nq : 0) + L - a.nq : INT32_MAX;
    }
  }
  if (kQInSmem<NQB> && warp == 0) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_rec(0)), "f"(col_scale[0][0]),
                 "f"(col_scale[0][1]), "f"(col_scale[NQB - 1][0]), "f"(col_scale[NQB - 1][1])
                 : "memory");
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_rec(1)), "r"(lim[0][0]),
                 "r"(lim[0][1]), "r"(lim[NQB - 1][0]), "r"(lim[NQB - 1][1])
                 : "memory");
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(q_rec(2)), "f"(qc[0]), "f"(qc[NQB - 1])
                 : "memory");
  }

  float o[NQB][kMt][4];
  for (auto& ob : o)
    for (auto& x : ob) x[0] = x[1] = x[2] = x[3] = 0.f;
  float m[NQB][2], l[NQB][2];  // l: this thread's keys only (summed over g at the end)
  for (int qb = 0; qb < NQB; ++qb) m[qb][0] = m[qb][1] = kNegInf, l[qb][0] = l[qb][1] = 0.f;
  bool bad = false;

  float sigma = 0.f;  // row-scale formats: the running maximum of this warp's V scales

  const int nblocks = (je - jb + kBlock - 1) / kBlock;
  auto compute = [&](uint32_t stage, int blk) {
    const int j0 = jb + blk * kBlock;
    Raw<F, D> r;
    read_block<true>(stage, r);
    // ---- Sᵀ = K̂·Qᵀ ----
    float s[NQB][4] = {};
#pragma unroll
    for (int w = 0; w < D / 32; ++w) {
      uint32_t a0[4], a1[4];  // k-steps 2w and 2w + 1
      k_fragments<F, D>(r, w, a0, a1);
#pragma unroll
      for (int qb = 0; qb < NQB; ++qb) {
        uint32_t b[4];
        if constexpr (kQInSmem<NQB>) {
          // Volatile: read here each block, not hoisted into registers for the loop.
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                       : "r"(q_at(qb, w))
                       : "memory");
        } else {
          b[0] = qf[qb][2 * w][0], b[1] = qf[qb][2 * w][1];
          b[2] = qf[qb][2 * w + 1][0], b[3] = qf[qb][2 * w + 1][1];
        }
        common::mma_16bit<Op>(s[qb], a0, b[0], b[1]);
        common::mma_16bit<Op>(s[qb], a1, b[2], b[3]);
      }
    }
    // Row-scale formats: the K scale of each score row (keys g, 8 + g); V's scales
    // relative to σ, which grows to the block's largest V scale.
    float k_row[2] = {1.f, 1.f}, v_rel[2] = {1.f, 1.f}, sigma_ratio = 1.f;
    if constexpr (kRowScales) {
      const float vs[2] = {__uint_as_float(r.v_scales[0]), __uint_as_float(r.v_scales[1])};
      float bmax = fmaxf(vs[0], vs[1]);
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 4));
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 8));
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 16));
      const float s_new = fmaxf(sigma, bmax);
      if (s_new > 0.f) sigma_ratio = sigma / s_new;
      sigma = s_new;
      for (int h = 0; h < 2; ++h) {
        k_row[h] = __uint_as_float(r.k_scales[h]);
        v_rel[h] = sigma > 0.f ? vs[h] / sigma : 0.f;
      }
    }
    // ---- online softmax per query column (keys are rows: j0 + g and j0 + 8 + g) ----
    float cs[NQB][2];  // col_scale, lim: read back each block with kQInSmem
    int lm[NQB][2];
    if constexpr (kQInSmem<NQB>) {
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(cs[0][0]), "=f"(cs[0][1]), "=f"(cs[NQB - 1][0]), "=f"(cs[NQB - 1][1])
                   : "r"(q_rec(0))
                   : "memory");
      asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(lm[0][0]), "=r"(lm[0][1]), "=r"(lm[NQB - 1][0]), "=r"(lm[NQB - 1][1])
                   : "r"(q_rec(1))
                   : "memory");
    } else {
#pragma unroll
      for (int qb = 0; qb < NQB; ++qb)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) cs[qb][cc] = col_scale[qb][cc], lm[qb][cc] = lim[qb][cc];
    }
    uint32_t ph[NQB][2], pl[NQB][2];  // Pᵀ high and low parts in the B layout
#pragma unroll
    for (int qb = 0; qb < NQB; ++qb) {
      float alpha[2];
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        float mx = kNegInf;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = j0 + 8 * h + g;
          const bool vis = j < je && j <= lm[qb][cc];
          const float x = vis ? s[qb][2 * h + cc] * k_row[h] * cs[qb][cc] : kNegInf;
          s[qb][2 * h + cc] = x;
          mx = fmaxf(mx, x);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[qb][cc], mx);
        // ex2.approx.ftz: 2^-∞ is +0, so a masked key needs no test once the column has
        // a finite maximum (a column without one subtracts 0); results below 2^-126 are
        // flushed, far under what P's FP16 parts or l keep.
        const float m_use = m_new == kNegInf ? 0.f : m_new;
        alpha[cc] = m_new == kNegInf ? 1.f : common::exp2_approx(m[qb][cc] - m_new);
        m[qb][cc] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float x = s[qb][2 * h + cc];
          const float p = common::exp2_approx(x - m_use);
          s[qb][2 * h + cc] = p * v_rel[h];
          sum += p;
        }
        l[qb][cc] = l[qb][cc] * alpha[cc] + sum;
        alpha[cc] *= sigma_ratio;
      }
      // Once the row maxima settle, every α of the warp is 1 for most blocks: the
      // rescale is skipped then (a multiply by 1 is exact, so nothing changes).
      if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          o[qb][mt][0] *= alpha[0];
          o[qb][mt][1] *= alpha[1];
          o[qb][mt][2] *= alpha[0];
          o[qb][mt][3] *= alpha[1];
        }
      }
      uint32_t hi, lo;
      split_pair<Op>(s[qb][0], s[qb][1], hi, lo);  // key g, queries 2t, 2t+1
      ph[qb][0] = common::movmatrix_trans(hi);
      pl[qb][0] = common::movmatrix_trans(lo);
      split_pair<Op>(s[qb][2], s[qb][3], hi, lo);  // key 8 + g
      ph[qb][1] = common::movmatrix_trans(hi);
      pl[qb][1] = common::movmatrix_trans(lo);
    }
    // ---- Oᵀ += V̂ᵀ·Pᵀ: pairs of keys (2t, 2t+1) and (8+2t, 9+2t) at one element ----
    read_block<false>(stage, r);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      uint32_t av[4];
      v_fragment<F, D>(r, mt, av);
#pragma unroll
      for (int qb = 0; qb < NQB; ++qb) {
        common::mma_16bit<Op>(o[qb][mt], av, ph[qb][0], ph[qb][1]);
        common::mma_16bit<Op>(o[qb][mt], av, pl[qb][0], pl[qb][1]);
      }
    }
  };

  // kStages blocks in flight per warp: block i waits for its own copies (group i), is
  // computed, and its stage is refilled with block i + kStages. Every step commits a
  // group, empty ones included, so group i is always the i-th.
  constexpr int kStages = stages_per_warp<F, D, NQB>();
  const uint32_t region = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * kRegion;
  auto stage_at = [&](int s) { return region + s * Stage<F, D>::kBytes; };
  // Pages of a multiple of 16 keys (the sizes engines use, but 1 and 8): a block starts
  // on a multiple of 16 (decode_chunk_keys), so it lies in one page, one block-table
  // entry serves the thread's six keys, and that entry is loaded one refill ahead (its
  // latency under a block's compute, not in front of the copies). Other page sizes look
  // up each key.
  const bool in_page = a.page_size % kBlock == 0;
  const ThreadBytes tb = thread_bytes<F, D>(k_codes, v_codes, k_scales, v_scales);
  auto entry = [&](int blk) {
    return in_page && blk < nblocks ? __ldg(table + page_of(a, jb + blk * kBlock)) : int32_t{-1};
  };
  auto refill = [&](int blk, int s, int32_t p) {
    if (blk < nblocks) {
      const int j0 = jb + blk * kBlock;
      bad |= in_page ? stage_block_in_page<F, D>(a, tb, p, j0 - page_of(a, j0) * a.page_size,
                                                 je - j0, stage_at(s))
                     : stage_block_by_key<F, D>(a, table, k_codes, v_codes, k_scales,
                                                v_scales, j0, je, stage_at(s));
    }
    common::cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages; ++s) refill(warp + s * kWarps, s, entry(warp + s * kWarps));
  if constexpr (kQInSmem<NQB>) __syncthreads();  // warp 0's Q fragments
  int32_t next = entry(warp + kStages * kWarps);  // the first refill's page
  int s = 0;
  for (int blk = warp; blk < nblocks; blk += kWarps) {
    common::cp_async_wait<kStages - 1>();
    const int32_t p = next;
    next = entry(blk + (kStages + 1) * kWarps);
    compute(stage_at(s), blk);
    refill(blk + kStages * kWarps, s, p);
    s = s == kStages - 1 ? 0 : s + 1;
  }
  common::cp_async_wait<0>();  // no copy outlives the loop (the region is reused below)

  if constexpr (kQInSmem<NQB>)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                 : "=f"(qc[0]), "=f"(qc[NQB - 1])
                 : "r"(q_rec(2))
                 : "memory");
  // ---- merge the four warps (same fragment layout: lane by lane) ----
  for (int qb = 0; qb < NQB; ++qb)
    for (int cc = 0; cc < 2; ++cc) {
      float x = l[qb][cc];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      l[qb][cc] = x + __shfl_xor_sync(0xffffffffu, x, 16);
    }
  if constexpr (kRowScales)
    for (auto& ob : o)
      for (auto& x : ob) x[0] *= sigma, x[1] *= sigma, x[2] *= sigma, x[3] *= sigma;
  __syncthreads();  // s_bad initialized
  if (bad) s_bad = 1;
  if (warp > 0) {
    for (int qb = 0; qb < NQB; ++qb) {
      for (int mt = 0; mt < kMt; ++mt)
        for (int e = 0; e < 4; ++e) s_o(warp, (qb * kMt + mt) * 4 + e)[lane] = o[qb][mt][e];
      for (int cc = 0; cc < 2; ++cc) {
        s_ml(warp, qb * 4 + cc)[lane] = m[qb][cc];
        s_ml(warp, qb * 4 + 2 + cc)[lane] = l[qb][cc];
      }
    }
  }
  __syncthreads();
  if (warp > 0) return;
  const bool any_bad = bad_length || s_bad != 0;
  const float nan = __int_as_float(0x7fc00000);
#pragma unroll
  for (int qb = 0; qb < NQB; ++qb) {
    float wgt[kWarps][2];
    for (int cc = 0; cc < 2; ++cc) {
      float M = m[qb][cc];
      for (int k = 0; k < kWarps - 1; ++k) M = fmaxf(M, s_ml(k + 1, qb * 4 + cc)[lane]);
      wgt[0][cc] = m[qb][cc] == kNegInf ? 0.f : exp2f(m[qb][cc] - M);
      float lsum = wgt[0][cc] * l[qb][cc];
      for (int k = 0; k < kWarps - 1; ++k) {
        const float mk = s_ml(k + 1, qb * 4 + cc)[lane];
        wgt[k + 1][cc] = mk == kNegInf ? 0.f : exp2f(mk - M);
        lsum += wgt[k + 1][cc] * s_ml(k + 1, qb * 4 + 2 + cc)[lane];
      }
      m[qb][cc] = M;
      l[qb][cc] = lsum;
    }
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float acc = wgt[0][e & 1] * o[qb][mt][e];
        for (int k = 0; k < kWarps - 1; ++k)
          acc += wgt[k + 1][e & 1] * s_o(k + 1, (qb * kMt + mt) * 4 + e)[lane];
        o[qb][mt][e] = acc;
      }
    // ---- outputs: column cc is query row row0 + 8qb + 2t + cc; this thread owns its
    // elements [g·D/8, (g+1)·D/8): element g·D/8 + 2mt + h is o[qb][mt][2h + cc] ----
    const float qc_row[2] = {__shfl_sync(0xffffffffu, qc[qb], 4 * (2 * t)),
                             __shfl_sync(0xffffffffu, qc[qb], 4 * (2 * t + 1))};
    for (int cc = 0; cc < 2; ++cc) {
      const int r = row0 + 8 * qb + 2 * t + cc;
      if (r >= a.rows) continue;
      const int i = r % a.nq, hq = hk * a.group + r / a.nq;
      const bool empty = m[qb][cc] == kNegInf;
      // The operands' 2^-kOperandExp (NVFP4: V̂ was read as V̂·2^-14) comes off here.
      const float inv = empty ? 0.f : pow2(kOperandExp) / l[qb][cc];
      const int64_t out_row = (int64_t{b} * a.heads_q + hq) * a.nq + i;
      float y[kRange];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        y[2 * mt] = any_bad ? nan : o[qb][mt][cc] * inv;
        y[2 * mt + 1] = any_bad ? nan : o[qb][mt][2 + cc] * inv;
      }
      const float lse2 = any_bad ? nan : empty ? kNegInf : m[qb][cc] + log2f(l[qb][cc]);
      if (a.splits == 1) {
        T* dst = static_cast<T*>(a.o) + b * a.o_sb + hq * a.o_sh + i * a.o_sn + g * kRange;
#pragma unroll
        for (int e = 0; e < kRange; e += 2) {
          if constexpr (std::is_same_v<T, __half>)
            *reinterpret_cast<__half2*>(dst + e) = __floats2half2_rn(y[e], y[e + 1]);
          else
            *reinterpret_cast<__nv_bfloat162*>(dst + e) = __floats2bfloat162_rn(y[e], y[e + 1]);
        }
        if (a.lse != nullptr && g == 0)
          a.lse[out_row] = any_bad || empty ? lse2 : lse2 * kLn2 + a.sm_scale * qc_row[cc];
      } else {
        float* op = a.o_part + (out_row * a.splits + split) * D + g * kRange;
#pragma unroll
        for (int e = 0; e < kRange; e += 4)
          *reinterpret_cast<float4*>(op + e) = make_float4(y[e], y[e + 1], y[e + 2], y[e + 3]);
        if (g == 0) {
          a.lse_part[out_row * a.splits + split] = lse2;
          if (split == 0) a.qc_part[out_row] = qc_row[cc];
        }
      }
    }
  }
}

}  // namespace qattn::kv_cache::direct
