#include "cuda/hopper/early_launch.h"
#include "cuda/hopper/per_device.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/common/amax.cuh"
#include "cuda/precision_guard/maxima.cuh"
#include "cuda/common/e4m3.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/sage2_fwd/quantize.cuh"
#include "numerics/mma_groups.h"
#include "numerics/token_sample.h"

#include <type_traits>

namespace qattn::sage2 {
namespace {

constexpr int kThreads = 256;
// The token sample of the K mean and of V's amax bound, shared with the emulator.
constexpr int kSmoothingSample = static_cast<int>(numerics::kSmoothSampleTokens);

// Asynchronous 16-byte global -> shared copy; bytes past `src_bytes` (0..16) are zero-filled.
__device__ __forceinline__ void cp_async_16(uint4* dst, const void* src, int src_bytes) {
  const auto d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes)
               : "memory");
}

// Waits until this thread's cp.async copies have landed (and are visible to it).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Elements of the 8-channel chunk at `ch` that lie inside head_dim (the rest read as 0).
template <bool kFullDim>
__device__ __forceinline__ int chunk_elems(int ch, int head_dim) {
  return kFullDim ? 8 : max(0, min(8, head_dim - ch));
}

// Starts the copy of channels [ch, ch + 8) of row `row` of a (rows x head_dim) matrix
// (inputs are 16-byte aligned with row strides a multiple of 8 elements: the api
// checks); rows past the end and channels past head_dim read as 0 (+0.0).
// The row is clamped, and a chunk wholly past head_dim points at the row start, so the
// address stays inside the tensor even where nothing is read.
template <bool kFullDim, typename T>
__device__ __forceinline__ void copy_chunk(uint4* dst, const T* base, int64_t stride, int row,
                                           int rows, int ch, int head_dim) {
  const int elems = chunk_elems<kFullDim>(ch, head_dim);
  const T* src = base + static_cast<int64_t>(max(min(row, rows - 1), 0)) * stride + (elems > 0 ? ch : 0);
  cp_async_16(dst, src, row < rows ? elems * static_cast<int>(sizeof(T)) : 0);
}

// Element j of a chunk as a float (j is a constant after unrolling: one instruction).
template <typename T>
__device__ __forceinline__ float element(const uint4& chunk, int j) {
  const float2 f = common::widen_pair<T>(reinterpret_cast<const uint32_t*>(&chunk)[j / 2]);
  return j % 2 == 0 ? f.x : f.y;
}

// Row j (the j-th of a chunk's 8 channels) of a permuted 16-token group of Vᵀ: byte k is
// the E4M3 code of channel j of chunk(v_token_at_position(k)), times inv. The K/V kernel
// and the fix-up kernel both write Vᵀ with it, so a channel's codes depend only on its
// amax, whichever kernel wrote them.
template <typename T, typename Chunk>
__device__ __forceinline__ uint4 vt_group_row(Chunk chunk, int j, float inv) {
  uint32_t row[4] = {};
#pragma unroll
  for (int m = 0; m < 8; ++m)
    row[m / 2] |=
        common::quantize_e4m3x2(element<T>(chunk(groups::v_token_at_position(2 * m)), j) * inv,
                        element<T>(chunk(groups::v_token_at_position(2 * m + 1)), j) * inv)
        << (16 * (m % 2));
  return make_uint4(row[0], row[1], row[2], row[3]);
}

// The keys of batch entry b that enter the quantization: its key-padding length,
// clamped to [0, seqlen_kv] (qattn.h), or all of them; a packed sequence's own keys.
template <bool kVarlen>
__device__ __forceinline__ int keys_of(const QuantizeParams& p, int b) {
  if constexpr (kVarlen) return p.seqs[b].k_len;
  if (p.kv_lengths == nullptr) return p.seqlen_kv;
  const int n = __ldg(p.kv_lengths + b);
  return n < 0 ? 0 : min(n, p.seqlen_kv);
}

// Where head h of batch entry b is read and written. Dense: input b·stride_b +
// h·stride_h, workspace slice b·Hkv + h from row 0. A packed sequence (kVarlen): input
// rows k_start.., workspace slice h from row kv_row0 (its K scales from tile kv_row0 /
// 128), and tiles up to its own length (one, of zeros, without keys: its masked rows
// read it).
template <bool kVarlen, typename T>
__device__ __forceinline__ const T* head_input(const InputView<T>& x, const QuantizeParams& p,
                                               int b, int h) {
  if constexpr (kVarlen) return x.data + p.seqs[b].k_start * x.stride_n + h * x.stride_h;
  return x.data + b * x.stride_b + h * x.stride_h;
}
template <bool kVarlen>
__device__ __forceinline__ int64_t workspace_slice(const QuantizeParams& p, int b, int h) {
  if constexpr (kVarlen) return h;
  return static_cast<int64_t>(b) * p.heads_kv + h;
}
template <bool kVarlen>
__device__ __forceinline__ int workspace_row0(const QuantizeParams& p, int b) {
  if constexpr (kVarlen) return p.seqs[b].kv_row0;
  return 0;
}
template <bool kVarlen>
__device__ __forceinline__ int own_kv_tiles(const QuantizeParams& p, int b) {
  if constexpr (kVarlen) return max(1, (p.seqs[b].k_len + groups::kKvTile - 1) / groups::kKvTile);
  return p.nkv_pad / groups::kKvTile;
}

// 8 consecutive floats (32-byte aligned) in two vector loads.
__device__ __forceinline__ void load_floats8(const float* src, float (&out)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0];
  const float4 hi = reinterpret_cast<const float4*>(src)[1];
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

// ---- 1. statistics, one launch: the K smoothing vector and V's amax bound ----------------
// 1-D grid of 2·B·Hkv blocks of 256: one block per head averages K over the token sample,
// one takes V's per-channel amax over the same sample (both latency-bound, ~2 loads deep).
// V is then read once, by the K/V kernel (a full V amax pass took ~20 µs at
// N = 2K, a sixth of the quantization's time).

// Shared memory that stages a block's loads (either role): the sample's 256 rows of
// 16-bit input, all in flight at once (64 KB at D = 128: dynamic shared memory).
template <int D>
constexpr int stats_stage_bytes() {
  return 2 * D * kSmoothingSample;
}

// The token sample's rows (numerics/token_sample.h): thread = (channel, part) reduces every
// kParts-th row of its channel with `take(x)`, in order. All rows are staged in shared memory at
// once by 16-byte cp.async copies (one load latency: the block is latency-bound; 2-byte loads in
// batches of 32 per thread took four rounds at D = 128); rows past the sample and channels
// past head_dim are zero-filled (+0.0), which adds nothing to a sum or an amax.
template <typename T, int D, bool kFullDim, typename Take>
__device__ void reduce_sample(const T* base, int64_t stride_n, int head_dim, int keys,
                              uint4* stage, Take take) {
  constexpr int kParts = kThreads / D;
  constexpr int kChunks = D / 8;
  constexpr int kCopies = kSmoothingSample * kChunks / kThreads;  // per thread
  static_assert(kSmoothingSample % kParts == 0 && kSmoothingSample * kChunks % kThreads == 0);
  static_assert(kSmoothingSample * D * sizeof(T) <= stats_stage_bytes<D>());
  auto rows = reinterpret_cast<T(*)[D]>(stage);
  const int ch = threadIdx.x % D, part = threadIdx.x / D;
  const int n = min(keys, kSmoothingSample);
#pragma unroll
  for (int r = 0; r < kCopies; ++r) {
    const int c = threadIdx.x + r * kThreads;
    const int i = c / kChunks, c0 = (c % kChunks) * 8;
    const int64_t tok = numerics::sampled_row(i, keys);
    const int elems = i < n ? chunk_elems<kFullDim>(c0, head_dim) : 0;
    cp_async_16(reinterpret_cast<uint4*>(&rows[c / kChunks][c0]),
                base + (i < n ? tok : 0) * stride_n + (elems > 0 ? c0 : 0),
                elems * static_cast<int>(sizeof(T)));
  }
  cp_async_wait_all();
  __syncthreads();
#pragma unroll 8
  for (int i = part; i < kSmoothingSample; i += kParts) take(rows[i][ch]);
}

// The K smoothing vector c: the mean of the token sample (docs/sage2-kernel-arithmetic.md
// step 1). Each part sums its rows in order, then the parts add in a fixed order.
template <typename T, int D, bool kFullDim, bool kVarlen>
__device__ void k_mean_block(const InputView<T>& k, const QuantizeParams& p, uint4* stage, int h,
                             int b, float* k_mean) {
  constexpr int kParts = kThreads / D;
  __shared__ float partial[kParts][D];
  const int ch = threadIdx.x % D, part = threadIdx.x / D;
  float sum = 0.f;
  const int keys = keys_of<kVarlen>(p, b);
  reduce_sample<T, D, kFullDim>(head_input<kVarlen>(k, p, b, h), k.stride_n, p.head_dim, keys,
                                stage, [&](T x) { sum += common::to_float(x); });
  partial[part][ch] = sum;
  __syncthreads();
  if (part == 0) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kParts; ++i) total += partial[i][ch];
    k_mean[(static_cast<int64_t>(b) * p.heads_kv + h) * D + ch] =
        ch < p.head_dim && keys > 0 ? total / static_cast<float>(min(keys, kSmoothingSample))
                                    : 0.f;  // no key: c = 0
  }
}

// V's per-channel amax bound (numerics::sampled_amax_bound, docs step 4): 4x the amax
// over the token sample (the amax itself when the sample is every token; FLT_MAX where
// the product overflows a finite amax). Values above it are reported by the K/V kernel
// (v_over) and their channels redone by the fix-up kernel. Also zeroes the head's v_over.
template <typename T, int D, bool kFullDim, bool kVarlen>
__device__ void v_bound_block(const InputView<T>& v, const QuantizeParams& p,
                              const QuantizeOutputs& out, uint4* stage, int h, int b) {
  constexpr int kParts = kThreads / D;
  __shared__ uint32_t partial[kParts][D];
  const int ch = threadIdx.x % D, part = threadIdx.x / D;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_kv + h;
  if (threadIdx.x < D) out.v_over[bh * D + threadIdx.x] = 0u;
  uint32_t m = 0;  // |x| bits: an integer max orders them like amax_nan (NaN highest)
  const int keys = keys_of<kVarlen>(p, b);
  reduce_sample<T, D, kFullDim>(
      head_input<kVarlen>(v, p, b, h), v.stride_n, p.head_dim_v, keys, stage,
      [&](T x) { m = max(m, common::abs_bits(common::to_float(x))); });
  partial[part][ch] = m;
  __syncthreads();
  if (part == 0) {
#pragma unroll
    for (int i = 1; i < kParts; ++i) m = max(m, partial[i][ch]);
    const float bound = numerics::sampled_amax_bound_of(common::nan_canonical(m), keys);
    out.v_amax[bh * D + ch] = ch < p.head_dim_v ? bound : 0.f;
  }
}

// 64 KB (D = 128) of loads in flight per CTA, staged in shared memory, and few registers
// (the register-loaded version took 127): the grid's 2·B·Hkv CTAs all fit at once for
// B·Hkv up to ~200 (3 per SM at D = 128).
constexpr int kStatsMinBlocksPerSm = 5;

template <typename T, int D, bool kFullDim, bool kVarlen>
__global__ void __launch_bounds__(kThreads, kStatsMinBlocksPerSm)
    statistics_kernel(InputView<T> k, InputView<T> v, QuantizeParams p, QuantizeOutputs out) {
  extern __shared__ uint4 stage[];  // stats_stage_bytes<D>()
  hopper::launch_dependents();      // the K/V kernel may launch once all these CTAs run
  const int heads = p.batch * p.heads_kv;
  const int id = static_cast<int>(blockIdx.x);
  // The attention kernel's work counters start from zero (its last CTA also puts them
  // back, for attention-only launches on this workspace).
  if (id == 0 && threadIdx.x < 2) out.item_counter[threadIdx.x] = 0;
  // The guard's K maxima start from zero too (the K/V kernel merges into them after its
  // wait for this grid).
  if (out.guard_k != nullptr && id < heads && threadIdx.x < 2) out.guard_k[2 * id + threadIdx.x] = 0.f;
  if (id < heads)
    k_mean_block<T, D, kFullDim, kVarlen>(k, p, stage, id % p.heads_kv, id / p.heads_kv, out.k_mean);
  else
    v_bound_block<T, D, kFullDim, kVarlen>(v, p, out, stage, (id - heads) % p.heads_kv,
                                  (id - heads) / p.heads_kv);
}

// ---- 3. K (smoothed INT8) and V (E4M3, transposed, permuted) of one 128-token tile ---------
// grid (tiles + V CTAs, Hkv, B), block 128: blocks x < tiles quantize K tile x, the others
// hold D / 32 warps per V tile. Every lane copies its 16-byte chunks of the input into
// its own slots of shared memory with cp.async, so all of a lane's loads are in flight at
// once without holding registers (with loads into registers ptxas interleaves each load
// with arithmetic on the earlier ones, and only a few are in flight). A lane reads back
// only the slots it filled, so no barrier is needed; the warps of a CTA do not wait on
// each other except for the tile-wide K amax of the coarse granularities.
constexpr int kKvThreads = 128;
constexpr int kKvWarps = kKvThreads / 32;
constexpr int kKvChunksPerLane = 16;  // 16-byte chunks in flight per lane: 8 KB per warp
// 32 KB of shared memory per CTA; 5 CTAs per SM (<= 102 registers: the V part needs ~96)
// keep 160 KB of loads in flight per SM, ~3x what 4.3 TB/s needs at ~1.5 us latency.
constexpr int kKvMinBlocksPerSm = 5;
// The varlen kernels hold each sequence's place too (<= 128 registers; at 102 they spilled).
constexpr int kKvMinBlocksPerSmVarlen = 4;

// Chunk slots of a warp, slot-major so that a warp's 16-byte accesses to one slot are
// 512 contiguous bytes (conflict-free).
template <int kChunksPerLane>
struct KvStagingOf {
  uint4 chunk[kKvWarps][kChunksPerLane][32];
};
using KvStaging = KvStagingOf<kKvChunksPerLane>;
// D = 256: a K group's 32 tokens of 32 chunks each are 32 slots per lane, 64 KB per CTA
// (dynamic shared memory; the D <= 128 kernels keep their static 32 KB).
using KvStagingWide = KvStagingOf<2 * kKvChunksPerLane>;
template <int D>
using KvStagingFor = std::conditional_t<D == 256, KvStagingWide, KvStaging>;

// K: warp g quantizes per-thread group g of the tile (the 32 tokens with (c % 8) / 2 == g),
// so the group amax is a warp reduction. A warp instruction covers whole token rows (2 at
// D = 128, 4 at D = 64), for the loads and for the 8-byte stores.
template <typename T, int D, bool kFullDim, bool kVarlen>
__device__ void quantize_k_tile(const InputView<T>& k, const QuantizeParams& p,
                                const QuantizeOutputs& out, KvStagingFor<D>& stage, int tile,
                                int h, int b) {
  constexpr int kChunks = D / 8;              // 16-byte chunks per token row
  constexpr int kRowsPerLoad = 32 / kChunks;  // token rows per warp instruction
  constexpr int kGroupTokens = groups::kKvTile / groups::kKThreadGroupsPerTile;
  constexpr int kItems = kGroupTokens / kRowsPerLoad;
  static_assert(kKvWarps == groups::kKThreadGroupsPerTile, "one warp per K group");
  constexpr int kLaneSlots = sizeof(stage.chunk[0]) / sizeof(stage.chunk[0][0]);
  static_assert(kItems <= kLaneSlots);
  __shared__ float warp_amax[kKvWarps];
  const int g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ch0 = (lane % kChunks) * 8, sub = lane / kChunks;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_kv + h;
  uint4(&slot)[kLaneSlots][32] = stage.chunk[g];
  const int keys = keys_of<kVarlen>(p, b);
  // The i-th token of this lane; the group's tokens in order are 2g, 2g+1, 2g+8, 2g+9, ...
  auto token = [&](int i) {
    const int idx = sub + kRowsPerLoad * i;
    return tile * groups::kKvTile + 2 * g + (idx & 1) + 8 * (idx >> 1);
  };
#pragma unroll
  for (int i = 0; i < kItems; ++i)
    copy_chunk<kFullDim>(&slot[i][lane], head_input<kVarlen>(k, p, b, h), k.stride_n, token(i),
                         keys, ch0, p.head_dim);
  float c[8];
  load_floats8(out.k_mean + bh * D + ch0, c);
  cp_async_wait_all();

  // Tail and padding tokens stay zero (outside every amax); padded channels have c = 0. Evaluated
  // in both passes from shared memory: the same FADD gives the same bits. A tile with no
  // tail (all but the last) takes a copy of the passes without the token test.
  const bool full_tile = (tile + 1) * groups::kKvTile <= keys;
  auto smoothed = [&](const uint4& x, int i, int j, auto full) {
    return full || token(i) < keys ? element<T>(x, j) - c[j] : 0.f;
  };
  // A max (NaN sorting highest) is exact in any order, so the group amax is the same
  // whatever the reduction tree: here 8 independent chains of integer maxima of |x|,
  // then the warp.
  auto lane_amax = [&](auto full) {
    uint32_t a8[8] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const uint4 x = slot[i][lane];
#pragma unroll
      for (int j = 0; j < 8; ++j) a8[j] = max(a8[j], common::abs_bits(smoothed(x, i, j, full)));
    }
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, a8[j]);
    return m;
  };
  uint32_t abits = full_tile ? lane_amax(std::true_type{}) : lane_amax(std::false_type{});
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    abits = max(abits, __shfl_xor_sync(0xffffffff, abits, off));
  float a = common::nan_canonical(abits);
  if (p.granularity != QATTN_QK_PER_THREAD) {  // per-warp and per-block: one scale per tile
    if (lane == 0) warp_amax[g] = a;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) a = common::amax_nan(a, warp_amax[w]);
  }
  const float inv = common::kInt8Max / a;
  // All zeros for amax 0, NaN or inf (where every ks·inv is 0 or NaN, and F2I gave 0).
  const bool zero = !(a > 0.f) || a == INFINITY;
  // amax below 127 / FLT_MAX makes inv infinite: quantize_int8x4's saturating path.
  const bool tiny = !zero && inv == INFINITY;
  // Writes the codes; with the guard (precision "auto") also returns the largest |k̂|² of
  // the group's tokens (a token's row spans kChunks lanes: summed across them), else 0.
  auto store_codes = [&](auto full, auto rn, auto guard) {
    int norm2_max = 0;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const uint4 x = slot[i][lane];
      float ks[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) ks[j] = smoothed(x, i, j, full);
      uint2 codes;
      if constexpr (rn) {
        codes = make_uint2(common::quantize_int8x4_rn(ks[0], ks[1], ks[2], ks[3], inv),
                           common::quantize_int8x4_rn(ks[4], ks[5], ks[6], ks[7], inv));
      } else {
        codes = make_uint2(common::quantize_int8x4(ks, inv, zero), common::quantize_int8x4(ks + 4, inv, zero));
      }
      if constexpr (guard) {
        int n2 = __dp4a(static_cast<int>(codes.x), static_cast<int>(codes.x),
                        __dp4a(static_cast<int>(codes.y), static_cast<int>(codes.y), 0));
#pragma unroll
        for (int off = 1; off < kChunks; off <<= 1) n2 += __shfl_xor_sync(0xffffffff, n2, off);
        norm2_max = max(norm2_max, n2);
      }
      *reinterpret_cast<uint2*>(out.k_i8 + (workspace_slice<kVarlen>(p, b, h) * p.nkv_pad +
                                            workspace_row0<kVarlen>(p, b) + token(i)) * D + ch0) =
          codes;
    }
    return norm2_max;
  };
  auto store = [&](auto guard) {
    if (zero || tiny)  // rare: the clamping path, which also writes the zeros
      return store_codes(std::false_type{}, std::false_type{}, guard);
    if (full_tile) return store_codes(std::true_type{}, std::true_type{}, guard);
    return store_codes(std::false_type{}, std::true_type{}, guard);
  };
  if (out.guard_k == nullptr) {
    store(std::false_type{});
  } else {  // the group's {b², b²·max |k̂|²} into its KV head's maxima (one warp = one group)
    int norm2_max = store(std::true_type{});
#pragma unroll
    for (int off = 16; off >= kChunks; off >>= 1)
      norm2_max = max(norm2_max, __shfl_xor_sync(0xffffffff, norm2_max, off));
    if (lane == 0) guard::merge_k_group(out.guard_k + 2 * bh, a / common::kInt8Max, norm2_max);
  }
  if (lane == 0)
    out.k_scale[workspace_slice<kVarlen>(p, b, h) * (p.nkv_pad / groups::kKvTile * groups::kKThreadGroupsPerTile) +
                (workspace_row0<kVarlen>(p, b) / groups::kKvTile + tile) * groups::kKThreadGroupsPerTile + g] =
        a / common::kInt8Max;
}

// V, with its per-channel scale (from the amax bound): warp `part` (0..D/32-1) of a tile
// quantizes 64 channels x 64 tokens, and flags each channel holding a value above the
// bound: it merges its amax into v_over (rare; the fix-up kernel redoes those channels with
// their exact amax, which only values above the bound can reach). A lane copies 16 consecutive
// tokens of 8 channels, i.e. one permuted 16-token group of 8 Vᵀ rows: the transpose and the
// permutation happen in registers, and each row leaves as one 16-byte store. Per instruction a warp
// loads 4 rows x 128 contiguous bytes and stores 8 rows x 64.
template <typename T, int D, bool kFullDim, bool kVarlen>
__device__ void quantize_v_part(const InputView<T>& v, const QuantizeParams& p,
                                const QuantizeOutputs& out, KvStagingFor<D>& stage, int tile,
                                int part, int h, int b) {
  constexpr int kSlices = D / 64;  // 64-channel slices of a token row
  constexpr int kGroup = 16;       // tokens of one permuted group
  static_assert(kGroup <= kKvChunksPerLane);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ch0 = (part % kSlices) * 64 + (lane % 8) * 8;
  const int tok0 = tile * groups::kKvTile + ((part / kSlices) * 4 + lane / 8) * kGroup;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_kv + h;
  constexpr int kLaneSlots = sizeof(stage.chunk[0]) / sizeof(stage.chunk[0][0]);
  uint4(&slot)[kLaneSlots][32] = stage.chunk[warp];
#pragma unroll
  for (int t = 0; t < kGroup; ++t)
    copy_chunk<kFullDim>(&slot[t][lane], head_input<kVarlen>(v, p, b, h), v.stride_n, tok0 + t,
                         keys_of<kVarlen>(p, b), ch0, p.head_dim_v);
  float amax[8], inv[8];
  load_floats8(out.v_amax + bh * D + ch0, amax);
#pragma unroll
  for (int j = 0; j < 8; ++j) inv[j] = common::kE4M3Max / amax[j];
  cp_async_wait_all();

  // |x| of 16-bit values as unsigned 16-bit integers orders them like |x| (NaN highest),
  // two channels per word; the 4 lanes with the same channels (lane % 8) combine theirs.
  uint32_t m2[4] = {};
#pragma unroll
  for (int t = 0; t < kGroup; ++t) {
    const uint4 x = slot[t][lane];
    m2[0] = __vmaxu2(m2[0], x.x & 0x7fff7fffu);
    m2[1] = __vmaxu2(m2[1], x.y & 0x7fff7fffu);
    m2[2] = __vmaxu2(m2[2], x.z & 0x7fff7fffu);
    m2[3] = __vmaxu2(m2[3], x.w & 0x7fff7fffu);
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    m2[w] = __vmaxu2(m2[w], __shfl_xor_sync(0xffffffff, m2[w], 8));
    m2[w] = __vmaxu2(m2[w], __shfl_xor_sync(0xffffffff, m2[w], 16));
  }
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 f = common::widen_pair<T>(m2[j / 2]);
      const uint32_t x = __float_as_uint(common::nan_canonical(common::abs_bits(j % 2 == 0 ? f.x : f.y)));
      if (x > __float_as_uint(common::nan_canonical(common::abs_bits(amax[j]))))
        atomicMax(&out.v_over[bh * D + ch0 + j], x);
    }
  }

  // Row j of the output: channel ch0 + j.
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint4 row = vt_group_row<T>([&](int t) { return slot[t][lane]; }, j, inv[j]);
    *reinterpret_cast<uint4*>(out.vt_f8 + (workspace_slice<kVarlen>(p, b, h) * D + ch0 + j) * p.nkv_pad +
                              workspace_row0<kVarlen>(p, b) + tok0) =
        amax[j] > 0.f ? row : make_uint4(0, 0, 0, 0);
  }
}

template <int D>
constexpr int kv_quantize_grid_x(int tiles) {
  constexpr int kVWarpsPerTile = D / 32;
  return tiles + (tiles * kVWarpsPerTile + kKvWarps - 1) / kKvWarps;
}

template <typename T, int D, bool kFullDim, bool kVarlen>
__global__ void __launch_bounds__(kKvThreads, kVarlen ? kKvMinBlocksPerSmVarlen : kKvMinBlocksPerSm)
    kv_quantize_kernel(InputView<T> k, InputView<T> v, QuantizeParams p, QuantizeOutputs out) {
  __shared__ KvStaging stage;
  // Launched early (programmatic dependent launch): the attention kernel may launch once
  // all these CTAs run; the statistics (k_mean, v_amax) are complete after the wait.
  hopper::launch_dependents();
  hopper::grid_dependency_wait();
  const int tiles = kVarlen ? p.kv_tiles : p.nkv_pad / groups::kKvTile;
  // Heads in reverse order: chosen when the statistics kernel read all of V, so that the
  // V it read last was still in L2 here; now it reads only the sample. The
  // attention kernel starts with the first heads, whose codes this order writes last.
  // Not re-measured.
  const int h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
  // A packed sequence has tiles up to its own length (the grid's are the longest one's).
  int own_tiles = tiles;
  if constexpr (kVarlen) own_tiles = own_kv_tiles<kVarlen>(p, b);
  if (blockIdx.x < tiles) {
    if (blockIdx.x < own_tiles) quantize_k_tile<T, D, kFullDim, kVarlen>(k, p, out, stage, blockIdx.x, h, b);
  } else {
    constexpr int kVWarpsPerTile = D / 32;
    const int vwarp = (blockIdx.x - tiles) * kKvWarps + threadIdx.x / 32;
    if (vwarp < own_tiles * kVWarpsPerTile)
      quantize_v_part<T, D, kFullDim, kVarlen>(v, p, out, stage, vwarp / kVWarpsPerTile,
                                      vwarp % kVWarpsPerTile, h, b);
  }
}

// D = 256 (the head-dim-256 forward): the same steps with a K group's 32 tokens of 32
// chunks staged per lane (KvStagingWide: 64 KB of dynamic shared memory). Its own kernel,
// so the D <= 128 kernels' machine code stays as it was. At most three CTAs of 64 KB fit
// an SM; the bound is two (at three and five the K part spilled), which keeps 128 KB of
// loads in flight per SM.
constexpr int kKvMinBlocksPerSmWide = 2;

template <typename T, int D, bool kFullDim, bool kVarlen>
__global__ void __launch_bounds__(kKvThreads, kKvMinBlocksPerSmWide)
    kv_quantize_wide_kernel(InputView<T> k, InputView<T> v, QuantizeParams p, QuantizeOutputs out) {
  static_assert(D == 256 && !kVarlen, "the wide staging is for the dense D = 256 passes");
  extern __shared__ uint4 kv_stage_dynamic[];  // sizeof(KvStagingWide)
  KvStagingWide& stage = *reinterpret_cast<KvStagingWide*>(kv_stage_dynamic);
  // Launched early (programmatic dependent launch): the attention kernel may launch once
  // all these CTAs run; the statistics (k_mean, v_amax) are complete after the wait.
  hopper::launch_dependents();
  hopper::grid_dependency_wait();
  const int tiles = kVarlen ? p.kv_tiles : p.nkv_pad / groups::kKvTile;
  // Heads in reverse order: chosen when the statistics kernel read all of V, so that the
  // V it read last was still in L2 here; now it reads only the sample. The
  // attention kernel starts with the first heads, whose codes this order writes last.
  // Not re-measured.
  const int h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
  // A packed sequence has tiles up to its own length (the grid's are the longest one's).
  int own_tiles = tiles;
  if constexpr (kVarlen) own_tiles = own_kv_tiles<kVarlen>(p, b);
  if (blockIdx.x < tiles) {
    if (blockIdx.x < own_tiles) quantize_k_tile<T, D, kFullDim, kVarlen>(k, p, out, stage, blockIdx.x, h, b);
  } else {
    constexpr int kVWarpsPerTile = D / 32;
    const int vwarp = (blockIdx.x - tiles) * kKvWarps + threadIdx.x / 32;
    if (vwarp < own_tiles * kVWarpsPerTile)
      quantize_v_part<T, D, kFullDim, kVarlen>(v, p, out, stage, vwarp / kVWarpsPerTile,
                                      vwarp % kVWarpsPerTile, h, b);
  }
}

template <typename T, int D, bool kFullDim, bool kVarlen>
constexpr auto kv_quantize_kernel_for() {
  if constexpr (D == 256)
    return kv_quantize_wide_kernel<T, D, kFullDim, kVarlen>;
  else
    return kv_quantize_kernel<T, D, kFullDim, kVarlen>;
}

// ---- 4. fix-up: the V channels whose values exceed the sampled bound -----------------------
// One block of 256 threads per (batch, KV head): a grid small enough that its CTAs,
// resident early (PDL) while they wait for the K/V kernel, take few of its slots (a
// block per 1,024 tokens cost 2% end-to-end at N = 2K). Nothing to do for
// almost every head: one load of v_over per thread and the block leaves. Otherwise each set channel
// takes its exact amax (the K/V kernel merged it into v_over: only values above the bound can be
// the largest) and its row of Vᵀ is rewritten with it: the codes the K/V kernel writes for that
// amax. A thread takes a 16-token group and an 8-channel chunk at a time, so the loads stay 16-byte
// rows as in the K/V kernel, whatever the number of flagged channels (a warp per channel with
// strided loads took ~15 µs for a few channels). With every channel flagged (the worst
// case) a call at N = 2K takes ~60 µs more (measured: bench/NOTES.md).
constexpr int kFixupThreads = 256;

template <typename T, int D, bool kFullDim, bool kVarlen>
__global__ void __launch_bounds__(kFixupThreads)
    v_fixup_kernel(InputView<T> v, QuantizeParams p, QuantizeOutputs out) {
  static_assert(D <= kFixupThreads);
  constexpr int kGroup = 16, kChunks = D / 8;
  __shared__ float amax[D];     // the exact amax of a flagged channel, 0 elsewhere
  hopper::launch_dependents();  // the attention kernel may launch now; it waits for us
  hopper::grid_dependency_wait();
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh) / p.heads_kv, h = static_cast<int>(bh) % p.heads_kv;
  const uint32_t o = threadIdx.x < D ? out.v_over[bh * D + threadIdx.x] : 0u;
  if (threadIdx.x < D) amax[threadIdx.x] = __uint_as_float(o);
  if (!__syncthreads_or(o != 0u)) return;
  if (o != 0u) out.v_amax[bh * D + threadIdx.x] = __uint_as_float(o);
  const T* head = head_input<kVarlen>(v, p, b, h);
  const int keys = keys_of<kVarlen>(p, b);
  const int rows = kVarlen ? own_kv_tiles<kVarlen>(p, b) * groups::kKvTile : p.nkv_pad;
  const int units = rows / kGroup * kChunks;
  for (int u = threadIdx.x; u < units; u += kFixupThreads) {
    const int c0 = (u % kChunks) * 8, g0 = (u / kChunks) * kGroup;
    bool any = false;
#pragma unroll
    for (int j = 0; j < 8; ++j) any |= amax[c0 + j] != 0.f;
    if (!any) continue;
    uint4 x[kGroup];  // tokens g0.., channels c0..c0+7 (0 past the end and past head_dim_v)
#pragma unroll
    for (int t = 0; t < kGroup; ++t) {
      x[t] = make_uint4(0, 0, 0, 0);
      if (g0 + t >= keys) continue;
      const T* src = head + static_cast<int64_t>(g0 + t) * v.stride_n + c0;
      if (kFullDim || c0 + 8 <= p.head_dim_v) {
        x[t] = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int e = 0; e < 8 && c0 + e < p.head_dim_v; ++e) reinterpret_cast<T*>(&x[t])[e] = src[e];
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = amax[c0 + j];
      if (a == 0.f) continue;
      const uint4 row = vt_group_row<T>([&](int t) { return x[t]; }, j, common::kE4M3Max / a);
      *reinterpret_cast<uint4*>(out.vt_f8 + ((kVarlen ? h : bh) * D + c0 + j) * p.nkv_pad +
                                workspace_row0<kVarlen>(p, b) + g0) =
          a > 0.f ? row : make_uint4(0, 0, 0, 0);
    }
  }
}

template <typename T, int D, bool kFullDim, bool kVarlen>
cudaError_t launch_quantize_passes(const InputView<T>& k, const InputView<T>& v,
                                   const QuantizeParams& p, const QuantizeOutputs& out,
                                   cudaStream_t stream) {
  const dim3 kv_grid(p.kv_tiles, p.heads_kv, p.batch);
  auto statistics = statistics_kernel<T, D, kFullDim, kVarlen>;
  auto kv_quantize = kv_quantize_kernel_for<T, D, kFullDim, kVarlen>();
  auto v_fixup = v_fixup_kernel<T, D, kFullDim, kVarlen>;
  // Both stage their loads in shared memory: ask for the largest carveout so that the
  // occupancy the launch bounds aim at (5 CTAs per SM) is not cut by the L1 share.
  // Function attributes stay set within a context (a reset clears them): once per context.
  static std::atomic<unsigned long long> configured{0};
  if (cudaError_t e = hopper::once_per_context(
          configured,
          [&] {
            for (const void* f : {reinterpret_cast<const void*>(statistics),
                                  reinterpret_cast<const void*>(kv_quantize)})
              if (cudaError_t e =
                      cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared);
                  e != cudaSuccess)
                return e;
            if constexpr (D == 256)
              if (cudaError_t e = cudaFuncSetAttribute(
                      kv_quantize, cudaFuncAttributeMaxDynamicSharedMemorySize,
                      static_cast<int>(sizeof(KvStagingWide)));
                  e != cudaSuccess)
                return e;
            return cudaFuncSetAttribute(statistics, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        stats_stage_bytes<D>());
          });
      e != cudaSuccess)
    return e;
  // Nothing needs zeroing first: the statistics kernel zeroes V's flags and the work
  // counters itself.
  statistics<<<2 * kv_grid.y * kv_grid.z, kThreads, stats_stage_bytes<D>(), stream>>>(k, v, p, out);
  // Checked on its own, so a failed launch enqueues nothing after it.
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = hopper::early_launch(
          kv_quantize, dim3(kv_quantize_grid_x<D>(kv_grid.x), kv_grid.y, kv_grid.z),
          dim3(kKvThreads), D == 256 ? sizeof(KvStagingWide) : 0, stream, k, v, p, out);
      e != cudaSuccess)
    return e;
  return hopper::early_launch(v_fixup, dim3(kv_grid.y * kv_grid.z), dim3(kFixupThreads), 0, stream,
                              v, p, out);
}

}  // namespace

template <typename T, int D>
cudaError_t launch_quantize(const InputView<T>& k, const InputView<T>& v, const QuantizeParams& p,
                            const QuantizeOutputs& out, cudaStream_t stream) {
  // A packed batch: its own kernels (varlen.cuh), so the dense ones' code is unchanged.
  // (No packed batch at D = 256: the head-dim-256 forward has no varlen kernel.)
  if constexpr (D == 256) {
    if (p.seqs != nullptr) return cudaErrorNotSupported;
  }
  // The copies of whole rows serve K and V alike: both must have D channels.
  const bool full = p.head_dim == D && p.head_dim_v == D;
  if constexpr (D != 256) {
    if (p.seqs != nullptr)
      return full ? launch_quantize_passes<T, D, true, true>(k, v, p, out, stream)
                  : launch_quantize_passes<T, D, false, true>(k, v, p, out, stream);
  }
  return full ? launch_quantize_passes<T, D, true, false>(k, v, p, out, stream)
              : launch_quantize_passes<T, D, false, false>(k, v, p, out, stream);
}

#define QATTN_INSTANTIATE(T, D)                                                             \
  template cudaError_t launch_quantize<T, D>(const InputView<T>&, const InputView<T>&,      \
                                             const QuantizeParams&, const QuantizeOutputs&, \
                                             cudaStream_t);
QATTN_INSTANTIATE(__nv_bfloat16, 64)
QATTN_INSTANTIATE(__nv_bfloat16, 128)
QATTN_INSTANTIATE(__half, 64)
QATTN_INSTANTIATE(__half, 128)
// The head-dim-256 forward's passes (cuda/sage2_wide/).
QATTN_INSTANTIATE(__nv_bfloat16, 256)
QATTN_INSTANTIATE(__half, 256)
#undef QATTN_INSTANTIATE

}  // namespace qattn::sage2
