// A kernel family: one set of kernels (e.g. the SageAttention2-8b forward for Hopper,
// the SageBwd backward for Hopper) and the declaration of what it runs. src/api
// dispatches every call through the registry (registry.h) of these declarations and
// names no family's internals; a family's own file (src/families/) fills one in. The
// declaration is host C++ that every build compiles, so a CPU-only build validates and
// sizes the workspace with the same rules; only `launch` needs the CUDA kernels
// (nullptr without them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "numerics/head_dim_v.h"
#include "qattn/qattn.h"

namespace qattn::api {

// The rule of the families whose boolean attn_mask is the call's whole key rule (the
// SA2-8b forward's tile lists and the 16-bit forward know no other): "" or the reason the
// call is refused.
inline std::string attn_mask_alone(const qattn_fwd_params& p) {
  const bool other_rule = p.causal != 0 || p.window != 0 || p.kv_lengths != nullptr;
  if (p.attn_mask_type != QATTN_MASK_NONE && other_rule)
    return "takes an attn_mask alone (causal, window and kv_lengths must be off: write "
           "them into the mask)";
  return {};
}

// V's head dim of a forward call (qattn_fwd_params.head_dim_v; 0 means head_dim).
inline int32_t head_dim_v(const qattn_fwd_params& p) {
  return numerics::value_head_dim(p.head_dim, p.head_dim_v);
}

// A device's compute capability, e.g. {9, 0} for sm_90.
struct Arch {
  int major = 0, minor = 0;
  bool operator==(const Arch&) const = default;
};

// The masks a call may ask for, as bits of a family's masks. A call is either unmasked
// or causal (the params' causal: kMaskNone or kMaskCausal), and may use any of the
// features beyond causal on top (qattn_fwd_params' window, kv_lengths, alignment,
// attn_mask, cu_seqlens); a
// family runs the call only when it declares every bit the call uses.
enum MaskBit : uint32_t {
  kMaskNone = 1u << 0,
  kMaskCausal = 1u << 1,
  // A sliding window: window = 1 with window_left >= 0, or with window_right >= 0
  // without causal (with causal set, window_right acts as 0, which is causal itself).
  kMaskWindow = 1u << 2,
  kMaskKeyPadding = 1u << 3,  // kv_lengths: per batch entry, the keys past a length are hidden
  // Top-left alignment where it changes the mask: seqlen_q != seqlen_kv with causal or a
  // window.
  kMaskTopLeft = 1u << 4,
  kMaskBool = 1u << 5,  // attn_mask_type = QATTN_MASK_BOOL: an arbitrary boolean mask
  // cu_seqlens_q/cu_seqlens_k: a packed variable-length batch, every rule per sequence.
  // A family declares it only with a kernel that walks the sequences itself (one launch,
  // per-sequence quantization), never by looping over launches.
  kMaskVarlen = 1u << 6,
  // attn_mask_type = QATTN_MASK_ADDITIVE: SDPA's float mask, added to the scaled scores.
  kMaskAdditive = 1u << 7,
};

// Which kernels of a forward to run: all, or (bench hooks) the attention kernel alone
// on a workspace an earlier full forward filled.
enum class ForwardPart { kAll, kAttentionOnly };

struct ForwardFamily {
  const char* name;  // in messages: "sage2_fwd_sm90"
  int32_t scheme;    // the qattn_scheme it implements
  // The compute capabilities its binaries run on, exactly (an sm_90a cubin runs on 9.0
  // only).
  std::span<const Arch> archs;
  int32_t min_head_dim, max_head_dim;
  uint32_t dtypes;  // bit (1 << QATTN_DTYPE_*) per input format it reads
  uint32_t masks;   // MaskBit
  // Whether it takes V (and O) with fewer channels than Q and K (head_dim_v <
  // head_dim), outside a packed batch.
  bool narrower_v;
  // Whether it writes P's row maxima (qattn_fwd_params' p_max), outside a packed batch.
  bool writes_p_max;
  // Further limits of its kernels (grid sizes, index widths, ...), checked after the
  // table above matched: "" when the call fits, else why not, in a few words.
  std::string (*check_limits)(const qattn_fwd_params& p);
  // Workspace bytes for a call it supports (a multiple of 256).
  std::size_t (*workspace_bytes)(const qattn_fwd_params& p);
  // Enqueues the call on `stream` with defaults resolved (sm_scale > 0); returns a
  // cudaError_t (0 = success) and never synchronizes. nullptr in a CPU-only build.
  int (*launch)(const qattn_fwd_params& p, void* workspace, void* stream, ForwardPart part);
};

// A backward family (qattn_bwd). Its table has the forward's fields (name, archs, head
// dims, dtypes, masks, same meaning) plus the backward's own choices, each a bit set
// indexed by the field's value: formats (1 << QATTN_BWD_*), dovs (1 << QATTN_BWD_DOV_*),
// determinism (bit 0: atomics allowed, bit 1: deterministic), scales (1 <<
// QATTN_BWD_SCALES_*).
struct BackwardFamily {
  const char* name;  // in messages: "sagebwd_sm90"
  std::span<const Arch> archs;
  int32_t min_head_dim, max_head_dim;
  uint32_t dtypes;       // bit (1 << QATTN_DTYPE_*)
  uint32_t masks;        // MaskBit
  uint32_t formats;      // bit (1 << QATTN_BWD_INT8 / QATTN_BWD_E4M3)
  uint32_t dovs;         // bit (1 << QATTN_BWD_DOV_16BIT / QATTN_BWD_DOV_QUANTIZED)
  uint32_t determinism;  // bit (1 << deterministic), deterministic in {0, 1}
  uint32_t scales;       // bit (1 << QATTN_BWD_SCALES_PER_BLOCK / _MERGE_FREE)
  std::string (*check_limits)(const qattn_bwd_params& p);
  std::size_t (*workspace_bytes)(const qattn_bwd_params& p);  // a multiple of 256
  // Enqueues the call with defaults resolved (sm_scale > 0); returns a cudaError_t and
  // never synchronizes. nullptr in a CPU-only build.
  int (*launch)(const qattn_bwd_params& p, void* workspace, void* stream);
};

// A KV-cache family (qattn_kv_append, qattn_kv_decode): the kernels that write a cache
// format and decode from it. Its table: archs, head dims and dtypes as above; formats
// (1 << QATTN_KV_*), the most query tokens a decode takes, and whether it has a causal
// decode (masks). check_*_limits, workspace and launches take the library's validated
// copies of the call and of its cache.
struct KvCacheFamily {
  const char* name;  // in messages: "kv_cache_sm90"
  std::span<const Arch> archs;
  int32_t min_head_dim, max_head_dim;
  uint32_t dtypes;   // bit (1 << QATTN_DTYPE_*)
  uint32_t formats;  // bit (1 << QATTN_KV_*)
  uint32_t masks;    // MaskBit, of the decode
  int32_t max_query_tokens;
  // The split count of a decode whose num_splits is 0 (from the sizes only, no device).
  int32_t (*choose_splits)(const qattn_kv_decode_params& p, const qattn_kv_cache& c);
  // Workspace bytes of a decode with `splits` chunks (a multiple of 256; 0 for 1).
  std::size_t (*decode_workspace_bytes)(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                        int32_t splits);
  // Enqueue; return a cudaError_t; never synchronize. nullptr in a CPU-only build.
  int (*launch_append)(const qattn_kv_append_params& p, const qattn_kv_cache& c, void* stream);
  int (*launch_decode)(const qattn_kv_decode_params& p, const qattn_kv_cache& c, int32_t splits,
                       void* workspace, void* stream);
};

// The merge of partial outputs (qattn_merge): element-wise, any shape the C ABI takes;
// a family is its architectures and its launch.
struct MergeFamily {
  const char* name;  // in messages: "merge_sm90"
  std::span<const Arch> archs;
  // Enqueue; return a cudaError_t; never synchronize. nullptr in a CPU-only build.
  int (*launch)(const qattn_merge_params& p, void* stream);
};

// Every family of this build, in the order the registry tries them (src/families/).
std::span<const ForwardFamily* const> forward_families();
std::span<const BackwardFamily* const> backward_families();
std::span<const KvCacheFamily* const> kv_cache_families();
std::span<const MergeFamily* const> merge_families();

}  // namespace qattn::api
