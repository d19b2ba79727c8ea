// Host entry points of the SageAttention2-8b Hopper forward (sm_90a).
// The api layer validates parameters and resolves defaults (sm_scale) before it
// calls these; they only size the workspace and enqueue kernels on the stream.
#pragma once

#include <cstddef>

#include "qattn/qattn.h"

namespace qattn::sage2 {

// Workspace layout (all offsets 256-byte aligned), padded lengths are multiples of
// 128 (one KV tile / two Q blocks):
//   q_i8    int8  (B, Hq, Nq_pad, D)        quantized Q (sm_scale·log2e folded in scale)
//   q_scale float (B, Hq, Nq_pad / 64 * 32) per-thread (or coarser, replicated) Q scales
//   q_dot_c float (B, Hq, Nq_pad)           sm_scale · q·c, the LSE correction for K smoothing
//           (these three are empty unless keep_q: the attention kernel quantizes Q in
//           shared memory; with keep_q it also writes them here, for the tests)
//   k_i8    int8  (B, Hkv, Nkv_pad, D)      smoothed, quantized K
//   k_scale float (B, Hkv, Nkv_pad / 128 * 4)
//   k_mean  float (B, Hkv, D)               the smoothing vector c
//   vt_f8   e4m3  (B, Hkv, D, Nkv_pad)      Vᵀ, tokens permuted in groups of 16
//   v_amax  float (B, Hkv, D)               V's per-channel amax bound (scale = amax / 448)
//   v_over  u32   (B, Hkv, D)               0, or the amax bits of a channel with values
//                                           above the bound (the fix-up kernel's work)
//   item_counter int [2]                    the attention kernel's work counters (next
//           item, CTAs done), zero between launches: the statistics kernel zeroes them
//           (with v_over) and the attention kernel's last CTA puts them back to zero
// D is the head dim padded to 64 or 128.
// A packed batch (varlen.cuh) keeps K/V in Hkv slices instead of B·Hkv: k_i8 (Hkv,
// Nkv_cap, D), k_scale, vt_f8 likewise, Nkv_cap = total_k + 128·B rounded to 128, each
// sequence from its own 128-aligned row; k_mean, v_amax, v_over stay (B, Hkv, D); Nq_pad
// is the longest sequence's; and the plan follows: varlen_seqs (B SeqPlace),
// varlen_entries (int2 per query block, at most (total_q + 127·B) / 128),
// varlen_count (one int).
std::size_t workspace_bytes(const qattn_fwd_params& p, bool keep_q = false);

// The attention kernel's shape (kernel.cuh): its register split between producer and
// consumer warpgroups, chosen by the launch from the items' length (kAuto), or forced,
// for the GPU tests that check every shape gives the same bits.
// kQuantizer4Warps: 512 threads, consumers at 232 and the Q quantizer on four warps.
// kConsumers240PolyExp (d=128; d=64 runs kConsumers240): the 240 split with one exp in
// eight on the FMA pipe, which rounds a few P codes differently from MUFU, so its bits
// differ slightly from the other shapes' (each still matches the emulation).
enum class RegisterSplit {
  kAuto,
  kConsumers232,
  kConsumers240,
  kQuantizer4Warps,
  kConsumers240PolyExp
};

// Enqueues quantization and attention on `stream`. Returns cudaSuccess or the first
// CUDA error; never synchronizes. guard_k (precision "auto"; dense calls with per-thread
// groups only): (B, Hkv, 2) floats that the K quantizer zeroes and fills with the
// precision guard's K maxima (cuda/precision_guard/stats.h).
int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream, bool keep_q = false,
                   RegisterSplit split = RegisterSplit::kAuto, float* guard_k = nullptr);

// Only the attention kernel (which quantizes Q itself), on a workspace that an earlier
// launch_forward with the same parameters filled (for kernel-only benchmarks; k and v
// are not read).
int launch_attention_only(const qattn_fwd_params& p, void* workspace, void* stream);

}  // namespace qattn::sage2
