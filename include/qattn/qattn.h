/* qattn — low-bit attention (SageAttention family), C ABI.
 *
 * Every call validates all of its parameters before it launches anything; a bad
 * call returns a non-zero qattn_status and leaves a message naming the parameter
 * and the allowed values (qattn_last_error_message, per thread). No call aborts
 * the process, synchronizes the device, or writes outside the buffers it is given.
 * All device work is ordered on the caller's stream.
 *
 * Order of use (as in cuDNN): fill qattn_fwd_params -> qattn_fwd_workspace_size
 * (checks the parameters, sizes the workspace) -> allocate -> qattn_fwd.
 */
#ifndef QATTN_QATTN_H
#define QATTN_QATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QATTN_VERSION_MAJOR 0
#define QATTN_VERSION_MINOR 1
#define QATTN_VERSION_PATCH 0

typedef enum qattn_status {
  QATTN_OK = 0,
  QATTN_ERROR_INVALID_ARGUMENT = 1, /* a parameter is out of its allowed range */
  QATTN_ERROR_UNSUPPORTED = 2,      /* valid, but no kernel for it (device, head dim...) */
  QATTN_ERROR_NO_DEVICE = 3,        /* no CUDA device, the CUDA driver is missing, or a
                                       CPU-only build of the library */
  QATTN_ERROR_WORKSPACE_TOO_SMALL = 4,
  QATTN_ERROR_CUDA = 5, /* a CUDA runtime call failed; the message says which */
  QATTN_ERROR_INTERNAL = 6
} qattn_status;

/* The enums name the values of the int32_t fields below. The fields are plain integers,
 * not enum types, so any value a caller stores is well defined to read: one outside
 * the list is rejected with QATTN_ERROR_INVALID_ARGUMENT naming the field. */
typedef enum qattn_dtype { QATTN_DTYPE_FP16 = 0, QATTN_DTYPE_BF16 = 1 } qattn_dtype;

/* The quantization scheme, which selects the kernel families that may run the call. */
typedef enum qattn_scheme {
  QATTN_SCHEME_SAGE2_8B = 0,    /* default: SageAttention2-8b (INT8 Q·Kᵀ, E4M3 P·V) */
  QATTN_SCHEME_SAGE3_NVFP4 = 1, /* SageAttention3: NVFP4 Q, K (smoothed), two-level NVFP4 P,
                                   NVFP4 V, the products formed on BF16 tensor cores from
                                   the dequantized operands (exactly a block-scaled FP4
                                   MMA's products); for fidelity, not speed. Head dim 64 or
                                   128; no mask or causal aligned bottom-right; sage2
                                   options are ignored */
  QATTN_SCHEME_PRECISE16 = 2,   /* no quantization: Q·Kᵀ and P·V in the inputs' 16-bit type
                                   (FP16 or BF16) with FP32 accumulation, P rounded to that
                                   type (FlashAttention's arithmetic): the "precise" mode,
                                   for heads or layers where 8-bit products lose visible
                                   accuracy. One kernel, no workspace. Head dim 1..128;
                                   causal, sliding windows, kv_lengths, either alignment
                                   and a boolean attn_mask (read element by element); no
                                   packed batch; sage2 options are ignored */
  QATTN_SCHEME_SAGE2_8B_AUTO = 3 /* the "auto" precision: SageAttention2-8b on every head,
                                   then the precision guard (per head, from the INT8
                                   steps and norms of Q and the smoothed K: docs/design.md,
                                   "Precision modes") and QATTN_SCHEME_PRECISE16 on the
                                   heads it flags, overwriting their output; nothing is
                                   read back to the host. The masks of
                                   QATTN_SCHEME_PRECISE16; sage2.granularity per-thread */
} qattn_scheme;

/* Quantization granularity of Q and K for the INT8 Q·Kᵀ (SageAttention2 §3.2). */
typedef enum qattn_qk_granularity {
  QATTN_QK_PER_THREAD = 0, /* default: groups follow the wgmma fragment layout */
  QATTN_QK_PER_WARP = 1,   /* 16 query rows / one KV tile */
  QATTN_QK_PER_BLOCK = 2   /* 64 query rows / one KV tile */
} qattn_qk_granularity;

/* A 4-D tensor view (B, H, N, d) of device memory; strides are in elements. HND
 * ("B, H, N, d" contiguous) and NHD ("B, N, H, d" contiguous) are both strides. The
 * last dimension must be contiguous (stride_d == 1 implied).
 *
 * Memory rules, checked by every call (the kernels load and store 16 bytes at a time):
 *   - data is 16-byte aligned;
 *   - every stride of a dimension with more than one element is positive, a multiple
 *     of 8 elements (16 bytes), and below 2^40 bytes (the TMA limit); the stride of a
 *     dimension of extent 1 is ignored;
 *   - for a contiguous tensor this means head_dim % 8 == 0; pad the rows otherwise
 *     (any head_dim <= 128 works once the row stride is a multiple of 8);
 *   - o: no two of its elements share an address (strides may interleave heads, rows
 *     and batches in any order as long as no two rows meet; a layout whose rows
 *     interleave and that has more than 2^20 rows is reported as not supported, since
 *     proving it alias-free would cost more than the call), and o overlaps none of
 *     q, k, v, lse or the workspace (q, k and v may overlap each other: they are only
 *     read). */
typedef struct qattn_tensor {
  void* data;
  int64_t stride_b, stride_h, stride_n;
} qattn_tensor;

/* Options of the SageAttention2 scheme (used when scheme == QATTN_SCHEME_SAGE2_8B). */
typedef struct qattn_sage2_options {
  int32_t granularity; /* a qattn_qk_granularity; default QATTN_QK_PER_THREAD */
} qattn_sage2_options;

/* Where the diagonal of the causal mask and of a sliding window sits when seqlen_q !=
 * seqlen_kv (the same either way when they are equal). */
typedef enum qattn_alignment {
  QATTN_ALIGN_BOTTOM_RIGHT = 0, /* default: query i's diagonal key is i + seqlen_kv -
                                   seqlen_q (FlashAttention >= 2.1; a KV cache, whose
                                   queries are the last positions) */
  QATTN_ALIGN_TOP_LEFT = 1      /* query i's diagonal key is i (PyTorch SDPA's is_causal) */
} qattn_alignment;

/* The parameters of a forward call.
 *
 * Stability rule (the ABI can grow without breaking compiled callers):
 *   - struct_size is the first field and holds sizeof(qattn_fwd_params) as the
 *     caller's qattn.h defines it; qattn_fwd_params_init sets it. A caller that fills
 *     the struct by hand sets it too (0 is rejected: the library cannot tell which
 *     version of the struct it was given).
 *   - Fields are only ever appended at the end; none is removed, reordered or
 *     retyped, and a published sub-struct (qattn_sage2_options, ...) never changes: a
 *     new option is a new field at the end. Every version ends the struct without
 *     tail padding (a reserved field fills it), so each layout has its own size.
 *   - The library reads a caller's struct up to struct_size; fields past it take the
 *     defaults qattn_fwd_params_init gives. So a program compiled against an older
 *     qattn.h keeps working with a newer library.
 *   - A struct_size larger than this library's sizeof (a program compiled against a
 *     newer qattn.h than the library it runs with) is rejected with
 *     QATTN_ERROR_UNSUPPORTED: its newer fields would otherwise be ignored silently.
 *     A size smaller than QATTN_FWD_PARAMS_MIN_SIZE (the first struct that carried
 *     its size) is rejected with QATTN_ERROR_INVALID_ARGUMENT, and so is a size that
 *     is not one of the struct's layouts (192, 216, 264, 288 or 296 bytes on LP64): it would
 *     end inside a field. */
typedef struct qattn_fwd_params {
  size_t struct_size;   /* sizeof(qattn_fwd_params); set by qattn_fwd_params_init */
  qattn_tensor q, k, v; /* inputs: q (B, Hq, Nq, d), k and v (B, Hkv, Nkv, d); v's d is
                           head_dim_v where that is set (below) */
  qattn_tensor o;       /* output (B, Hq, Nq, d), same dtype as the inputs (d = head_dim_v
                           where set) */
  float* lse;           /* optional (B, Hq, Nq) FP32 natural-log LSE, contiguous, 4-byte
                           aligned; NULL = none */
  int32_t dtype;        /* a qattn_dtype */
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv; /* all >= 1; heads_q % heads_kv
                                                            == 0; batch, heads_q <= 65535
                                                            (grid); seqlens <= 2^30 */
  int32_t head_dim; /* >= 1; the sage2 family runs 1..128 (64 and 128 natively, others
                       zero-padded inside); larger is QATTN_ERROR_UNSUPPORTED */
  int32_t causal;   /* 0 or 1; bottom-right aligned when seqlen_q != seqlen_kv unless
                       alignment (below) says top-left */
  float sm_scale;   /* 0 means 1/sqrt(head_dim); otherwise positive and at most
                       QATTN_MAX_SM_SCALE. Negative values, NaN and infinity are
                       rejected (QATTN_ERROR_INVALID_ARGUMENT). */
  int32_t scheme;   /* a qattn_scheme; default QATTN_SCHEME_SAGE2_8B */
  qattn_sage2_options sage2;
  int32_t reserved0; /* must be 0: it ends the struct without tail padding, so a field
                        appended later starts past every older struct_size */
  /* ---- masks beyond causal (appended after 0.1.0; 216 bytes on LP64) ----
   * Query i sees key j iff every rule below that is set allows it (and causal does).
   * Row i's diagonal key is i + seqlen_kv - seqlen_q (alignment bottom-right, the
   * default) or i (top-left); written D(i) below. */
  const int32_t* kv_lengths; /* optional (batch,) int32 device array, 4-byte aligned: keys
                                j >= kv_lengths[b] of batch entry b are hidden (key padding
                                of a right-padded batch; they are also left out of K's and
                                V's quantization statistics, so their values never matter).
                                Read on the device: a value below 0 counts as 0 and one above
                                seqlen_kv as seqlen_kv. Rows that see no key get O = 0 and
                                LSE = -inf. NULL (default) = every key */
  int32_t window;            /* 0 (default): no sliding window; 1: window_left and
                                window_right apply. (Zero stays the default everywhere in
                                this struct, so a zero-filled tail means "none".) */
  int32_t window_left;       /* with window = 1: keys j < D(i) - window_left are hidden;
                                -1 = no bound on this side; >= -1 */
  int32_t window_right;      /* with window = 1: keys j > D(i) + window_right are hidden;
                                -1 = no bound; >= -1. causal = 1 is window_right = 0 (with
                                causal set, any window_right acts as 0) */
  int32_t alignment;         /* a qattn_alignment: where D(i), the diagonal of causal and of
                                the window, sits when seqlen_q != seqlen_kv */
  /* ---- an arbitrary mask (appended after the masks above; 264 bytes on LP64) ----
   * PyTorch SDPA's boolean attn_mask: query i of (batch b, query head h) sees key j iff
   * the byte at attn_mask + b*stride_b + h*stride_h + i*stride_q + j*stride_k is
   * nonzero. Strides are in bytes and may be 0, which broadcasts that dimension (a
   * (B, 1, 1, Nkv) padding mask has stride_h = stride_q = 0), as SDPA broadcasts. The
   * kernel reads the mask once to find the 128 x 128 tiles it hides entirely (skipped,
   * never loaded) and those it shows entirely (run without a test), and tests elements
   * only in the others. Rows that see no key get O = 0 and LSE = -inf. In this version
   * it combines with none of causal, window and kv_lengths (write them into the mask,
   * or use those fields alone: they need no mask read).
   * SDPA's float (additive) attn_mask, attn_mask_type = QATTN_MASK_ADDITIVE: the element
   * at the same address (an fp16 or bf16 value of the call's dtype; strides still in
   * bytes) is added to query i's score of key j after the scale, before the softmax;
   * -inf hides the key. Tiles all of whose values are -inf are skipped, tiles of zeros
   * run as unmasked, and the others add their values. The SageAttention2-8b family takes
   * it with keys contiguous (attn_mask_stride_k = 2) and the pointer and the other
   * strides multiples of 4 bytes; other layouts, and the other families, are declined
   * (QATTN_ERROR_UNSUPPORTED, the reason named). Rows that see no key (every value -inf)
   * get O = 0 and LSE = -inf, as with a boolean mask. */
  int32_t attn_mask_type; /* a qattn_mask_type; QATTN_MASK_NONE (default): no attn_mask */
  int32_t reserved1;      /* must be 0 */
  const void* attn_mask;  /* device memory, any alignment; read only */
  int64_t attn_mask_stride_b, attn_mask_stride_h, attn_mask_stride_q, attn_mask_stride_k;
  /* ---- packed variable-length batches (appended after attn_mask; 288 bytes on LP64) ----
   * FlashAttention's flash_attn_varlen_func convention. With cu_seqlens_q and
   * cu_seqlens_k set, the call is a pack of `batch` sequences whose tokens lie one after
   * another along N:
   *   - q, k, v and o are (1, H, total, d) views: seqlen_q is total_q, the number of
   *     packed query tokens, seqlen_kv is total_k, and stride_b is ignored (a
   *     (total, H, d) tensor is stride_n = H*d, stride_h = d); lse, when set, is
   *     (Hq, total_q) FP32, contiguous (FlashAttention's varlen LSE);
   *   - sequence b owns the query tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 and the
   *     keys cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1; each array holds batch + 1 int32
   *     offsets, the first 0, never decreasing, the last the total; a sequence may be
   *     empty (no keys: its rows get O = 0 and LSE = -inf);
   *   - every rule applies per sequence as if it were a call of its own with seqlen_q =
   *     len_q(b) and seqlen_kv = len_k(b): causal and the window are aligned per sequence
   *     (bottom-right by default, FlashAttention's varlen rule; top-left with alignment),
   *     and the quantization is per sequence (the K smoothing mean is over the
   *     sequence's own keys; no scale group, Q block or KV tile reaches into another
   *     sequence).
   * The offsets live in device memory and the library never reads device memory on the
   * host (it does not synchronize), so their values are not checked by the call: a
   * varlen kernel clamps every offset to [0, total] and every sequence's end to at least
   * its start, so a bad array gives wrong rows, never an access outside the buffers.
   * The same holds for a max length below a real length (a caller error the call cannot
   * see): that sequence's output is unspecified, nothing outside the buffers is
   * touched. The Python layer (qattn.varlen_attention) checks the values. kv_lengths and
   * attn_mask are not taken with a packed batch (QATTN_ERROR_INVALID_ARGUMENT).
   * The SageAttention2-8b scheme runs a packed batch in one call on Hopper (a plan pass
   * reads the offsets on the device, the K/V passes quantize each sequence, one
   * attention launch walks every sequence's query blocks); other schemes decline it
   * (QATTN_ERROR_UNSUPPORTED, the reason named). */
  const int32_t* cu_seqlens_q; /* (batch + 1,) int32 device array, 4-byte aligned; NULL
                                  (default): not a packed batch */
  const int32_t* cu_seqlens_k; /* the keys' offsets, as cu_seqlens_q; set both or neither */
  int32_t max_seqlen_q;        /* with cu_seqlens: 1..seqlen_q, at least the longest query
                                  sequence (a kernel sizes its grid with it); 0 without */
  int32_t max_seqlen_k;        /* with cu_seqlens: 1..seqlen_kv, at least the longest key
                                  sequence; 0 without */
  /* ---- V's own head dim (appended after the packed batch; 296 bytes on LP64) ----
   * Models whose values are narrower than their queries and keys (MLA-style attention:
   * Q·K over 192 channels, V and O over 128). v is then (B, Hkv, Nkv, head_dim_v) and o
   * (B, Hq, Nq, head_dim_v); q and k keep head_dim, which alone sets sm_scale's default
   * and the kernel family. The SageAttention2-8b family takes 1 <= head_dim_v <=
   * head_dim without a packed batch (V's channels past head_dim_v are zeros to its
   * kernels: the products cost head_dim's); the other families decline head_dim_v !=
   * head_dim (QATTN_ERROR_UNSUPPORTED, the reason named). */
  int32_t head_dim_v;          /* 0 (default): head_dim */
  int32_t reserved2;           /* must be 0 */
  /* ---- P's row maxima (appended after the head dim of V; 312 bytes on LP64) ----
   * What the backward's merge-free scales need from the forward (qattn_bwd_params'
   * scales): each row's largest softmax probability, exp(m_i - lse_i), m_i the row's
   * largest scaled score as the forward computed it (with its quantization); 0 for a row
   * that sees no key. The SageAttention2-8b family writes it outside a packed batch; the
   * other families decline a call that asks for it (QATTN_ERROR_UNSUPPORTED). */
  float* p_max;                /* optional (B, Hq, Nq) FP32, contiguous, 4-byte aligned;
                                  NULL (default) = not written */
  int32_t reserved3;           /* must be 0 */
  int32_t reserved4;           /* must be 0: the struct ends without tail padding */
} qattn_fwd_params;

/* The kinds of attn_mask. */
typedef enum qattn_mask_type {
  QATTN_MASK_NONE = 0,
  QATTN_MASK_BOOL = 1,    /* one byte per (query, key): nonzero = visible (SDPA's bool mask) */
  QATTN_MASK_ADDITIVE = 2 /* one fp16/bf16 value (the call's dtype) per (query, key), added
                             to the scaled score; -inf hides (SDPA's float mask) */
} qattn_mask_type;

/* The smallest struct_size accepted: the size of the first layout that carried its
 * size (this one, 192 bytes on LP64). It stays this value as fields are appended. */
#define QATTN_FWD_PARAMS_MIN_SIZE (offsetof(qattn_fwd_params, reserved0) + sizeof(int32_t))

/* The largest sm_scale accepted: it keeps every FP32 quantity of the scale path finite.
 * Scores are formed in FP32 as sm_scale·log2(e)·q·(k − mean k) (K is smoothed), and the
 * softmax subtracts the row maximum, so twice the largest |score| must stay below FP32's
 * 3.4e38. With |q|, |k| <= 65504 (the FP16 range) and d <= 128,
 * |q·(k − mean k)| <= 128·65504·(2·65504) ≈ 1.1e12, so 2·1.4427·1.1e12·sm_scale < 3.4e38
 * needs sm_scale < 1.07e26; 1e25 leaves a factor of 10 for the rounding of the
 * quantization scales. This bounds the range, not the accuracy: when one INT8 step of a
 * score is worth more than about one unit of log2 (qk = sm_scale·log2(e)·amax_q/127·
 * amax_k/127 above ~1, a one-hot softmax), the SA2 kernel's exponent rounding (up to
 * 0.75·qk, docs/sage2-kernel-arithmetic.md) dominates, and above qk ≈ 25 a row's P
 * can round to zero and its output to NaN. */
#define QATTN_MAX_SM_SCALE 1e25f

/* Fills p with defaults: struct_size = sizeof(qattn_fwd_params), everything else
 * zero/NULL, dtype bf16, scheme sage2-8b, sage2.granularity per-thread, sm_scale 0
 * (= 1/sqrt(d)), causal 0. */
void qattn_fwd_params_init(qattn_fwd_params* p);

/* Bytes of device workspace qattn_fwd needs for these parameters (validates them:
 * returns the same error qattn_fwd would for a bad parameter, without a device). When
 * several kernel families could run the call on different GPUs, this is the largest of
 * their sizes, so the value holds on any supported device. */
qattn_status qattn_fwd_workspace_size(const qattn_fwd_params* p, size_t* bytes);

/* The forward of the selected scheme (SageAttention2-8b: smoothed INT8 Q·Kᵀ, E4M3 P·V,
 * two-level accumulation), run by the first kernel family that supports the call on
 * the current device. When none does, QATTN_ERROR_UNSUPPORTED with a message that
 * names every family considered and why it declined.
 * workspace: device memory of at least qattn_fwd_workspace_size bytes, 256-byte
 * aligned, not used by anything else until the work on `stream` is done.
 * stream: a cudaStream_t (NULL = the legacy default stream); the call is
 * asynchronous and may be captured into a CUDA graph (in any capture mode; the
 * pointer checks are host queries and run during capture too).
 * The sage2 family needs a device of compute capability 9.0 (Hopper), current on the
 * calling thread. */
qattn_status qattn_fwd(const qattn_fwd_params* p, void* workspace, size_t workspace_bytes,
                       void* stream);

/* ---- Backward (training): SageBwd ------------------------------------------------
 *
 * The gradients of sum(O ∘ dO) for O = attention(q, k, v), as SageAttention3's SageBwd
 * computes them: S = Q·Kᵀ (K smoothed), dV = Pᵀ·dO, dQ = dS·K and dK = dSᵀ·Q in 8-bit
 * with per-block scales (Q and dO per 64 rows, K per 128 tokens, P and dS per 64 × 128
 * tile), dP = dO·Vᵀ in the inputs' 16-bit format. o and lse are the forward's output
 * and natural-log LSE for the same q, k, v (qattn_fwd with lse set). Order of use as for
 * the forward: qattn_bwd_params_init -> fill -> qattn_bwd_workspace_size -> qattn_bwd.
 * The memory rules of qattn_tensor hold for every tensor; dq, dk and dv are outputs
 * (no two elements share an address; they overlap no input, no other output and not
 * the workspace). */

/* The 8-bit format of the backward's quantized products. */
typedef enum qattn_bwd_format {
  QATTN_BWD_INT8 = 0, /* default: scale amax/127 (SageBwd) */
  QATTN_BWD_E4M3 = 1  /* scale amax/448, E4M3 values (the paper's FP8 comparison) */
} qattn_bwd_format;
/* How the backward's 8-bit products are scaled. */
typedef enum qattn_bwd_scales {
  QATTN_BWD_SCALES_PER_BLOCK = 0, /* default: per 64-row Q block, per 128-token KV tile and
                                     per (Q block × 64 keys) tile of P and dS (SageBwd) */
  QATTN_BWD_SCALES_MERGE_FREE = 1 /* format E4M3 with dov 16-bit only: scales fixed before the
                                     kernel, so no partial sum is rescaled (faster): P·448
                                     unscaled; dO and each row's s_i·Q per channel over the
                                     query heads of a KV head; dS per query row by a bound,
                                     s_i = p_max_i·(Σ_c |dO_ic|·max|V_c| + |D_i|)/448. Needs
                                     the forward's p_max (qattn_fwd_params) */
} qattn_bwd_scales;
/* Precision of dP = dO·Vᵀ. */
typedef enum qattn_bwd_dov {
  QATTN_BWD_DOV_16BIT = 0,    /* default: the inputs' FP16/BF16, FP32 accumulation */
  QATTN_BWD_DOV_QUANTIZED = 1 /* the 8-bit format above, per block (the paper's ablation) */
} qattn_bwd_dov;

/* The parameters of a backward call. The stability rule of qattn_fwd_params holds
 * here too (struct_size first, fields only appended, a reserved field ends it). */
typedef struct qattn_bwd_params {
  size_t struct_size;         /* sizeof(qattn_bwd_params); set by qattn_bwd_params_init */
  qattn_tensor q, k, v;       /* the forward's inputs */
  qattn_tensor o, dout;       /* the forward's output and its gradient (B, Hq, Nq, d) */
  const float* lse;           /* (B, Hq, Nq) FP32 natural-log LSE of the forward,
                                 contiguous, 4-byte aligned; required */
  qattn_tensor dq, dk, dv;    /* outputs: dq like q, dk and dv like k (summed over the
                                 query heads of each KV head) */
  int32_t dtype;              /* a qattn_dtype, of every tensor above */
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim; /* as for the forward */
  int32_t causal;             /* 0 or 1; bottom-right aligned, as in the forward */
  float sm_scale;             /* as for the forward: 0 means 1/sqrt(head_dim) */
  int32_t format;             /* a qattn_bwd_format; default QATTN_BWD_INT8 */
  int32_t dov;                /* a qattn_bwd_dov; default QATTN_BWD_DOV_16BIT */
  int32_t deterministic;      /* 0 (default): dQ is accumulated with FP32 atomics, so its
                                 low bits may differ run to run; 1: no atomics, every
                                 output bitwise equal run to run (slower) */
  int32_t reserved0;          /* must be 0 */
  int32_t reserved1;          /* must be 0: with it the struct (8-byte aligned) ends without
                                 tail padding, as the stability rule asks */
  /* ---- merge-free scales (appended after 0.1.0; 344 bytes on LP64) ---- */
  const float* p_max;         /* with QATTN_BWD_SCALES_MERGE_FREE: (B, Hq, Nq) FP32,
                                 contiguous, the p_max the forward wrote for the same call
                                 (read); NULL otherwise */
  int32_t scales;             /* a qattn_bwd_scales; default QATTN_BWD_SCALES_PER_BLOCK */
  int32_t reserved2;          /* must be 0 */
} qattn_bwd_params;

/* The smallest struct_size accepted (328 bytes on LP64); it stays this value as fields
 * are appended. */
#define QATTN_BWD_PARAMS_MIN_SIZE (offsetof(qattn_bwd_params, reserved1) + sizeof(int32_t))

/* Fills p with defaults: struct_size = sizeof(qattn_bwd_params), everything else
 * zero/NULL, dtype bf16, format INT8, dov 16-bit, not deterministic, sm_scale 0. */
void qattn_bwd_params_init(qattn_bwd_params* p);
/* Bytes of device workspace qattn_bwd needs (validates the parameters, no device). */
qattn_status qattn_bwd_workspace_size(const qattn_bwd_params* p, size_t* bytes);
/* Enqueues the backward on `stream` (asynchronous, capturable, never synchronizes);
 * workspace as for qattn_fwd. Needs a device of compute capability 9.0. */
qattn_status qattn_bwd(const qattn_bwd_params* p, void* workspace, size_t workspace_bytes,
                       void* stream);

/* ---- KV cache and decode ----------------------------------------------------------
 *
 * A quantized, paged key/value cache (docs/kv-cache.md is its normative format) and
 * the decode attention that reads it. The engine owns every byte: it allocates the
 * page pool (qattn_kv_cache_page_bytes tells the size of a page), the block tables,
 * the lengths and the smoothing vectors, and passes them to each call, as vLLM and
 * FlashInfer do. Order of use: qattn_kv_cache_init -> fill the format and sizes ->
 * qattn_kv_cache_page_bytes -> allocate num_pages pages -> for each step
 * qattn_kv_append (the new tokens' K and V) then qattn_kv_decode (their queries).
 *
 * Device-side indices. Block tables and lengths live in device memory, where the host
 * cannot read them without synchronizing. A call checks what it can see: everything
 * in the structs, and, when the engine passes the host mirrors host_block_tables and
 * host_lengths (recommended; the Python KVCache always does), every block-table entry
 * the call will use and every length, before anything is launched. The kernels check
 * the device values again and never read or write outside the pool for a bad one: an
 * append then writes nothing for that sequence and leaves its length, a decode writes
 * NaN to that sequence's outputs. */

typedef enum qattn_kv_format {
  QATTN_KV_NVFP4 = 0,    /* E2M1 codes, 2 per byte, one E4M3 scale per 16 along d (4.5 bits) */
  QATTN_KV_FP8_E4M3 = 1, /* E4M3 codes, one FP32 scale per (token, head) */
  QATTN_KV_INT8 = 2,     /* int8 codes, one FP32 scale per (token, head) */
  QATTN_KV_BF16 = 3      /* bfloat16 values (the baseline) */
} qattn_kv_format;

/* How a sequence's K smoothing vector c (per KV head, d floats) is chosen. The cached
 * keys are K − c; the decode folds q·c back into the LSE, so O never changes with c. */
typedef enum qattn_kv_smoothing {
  QATTN_KV_SMOOTH_PREFILL_MEAN = 0, /* default: the mean of the first append's keys
                                       (a 256-token sample), fixed for the sequence */
  QATTN_KV_SMOOTH_NONE = 1          /* c = 0 */
} qattn_kv_smoothing;

/* The cache's format and its page pool. Stability rule as for qattn_fwd_params. */
typedef struct qattn_kv_cache {
  size_t struct_size;        /* sizeof(qattn_kv_cache); set by qattn_kv_cache_init */
  int32_t format;            /* a qattn_kv_format; default QATTN_KV_NVFP4 */
  int32_t heads_kv;          /* >= 1 */
  int32_t head_dim;          /* a multiple of 16, at most 256 */
  int32_t page_size;         /* tokens per page, >= 1 (16 is the usual choice) */
  int32_t num_pages;         /* pages in the pool, >= 1 */
  int32_t max_pages_per_seq; /* the width of a block-table row, >= 1 */
  int32_t k_smoothing;       /* a qattn_kv_smoothing */
  int32_t reserved0;         /* must be 0 */
  void* pages;               /* device: num_pages * page_bytes, 16-byte aligned */
} qattn_kv_cache;

#define QATTN_KV_CACHE_MIN_SIZE (offsetof(qattn_kv_cache, pages) + sizeof(void*))
#define QATTN_KV_MAX_QUERY_TOKENS 16

/* Defaults: struct_size set, NVFP4, prefill-mean smoothing, page_size 16, head_dim 128,
 * heads_kv 1, num_pages and max_pages_per_seq 0 (the caller sets them), pages NULL. */
void qattn_kv_cache_init(qattn_kv_cache* c);

/* Bytes of one page of this cache (a multiple of 16); validates the format and sizes
 * (pages may still be NULL). The pool is num_pages times this. */
qattn_status qattn_kv_cache_page_bytes(const qattn_kv_cache* c, size_t* page_bytes);

/* The sequences a call works on, one per batch entry b (the engine's view of them,
 * gathered per call as for vLLM's block tables):
 *   block_tables  device int32 [batch][max_pages_per_seq]: token t of entry b lives in
 *                 page block_tables[b][t / page_size], slot t % page_size;
 *   lengths       device int32 [batch]: tokens cached;
 *   k_mean        device FP32 [batch][heads_kv][head_dim]: the smoothing vectors c
 *                 (NULL with QATTN_KV_SMOOTH_NONE);
 *   host_block_tables, host_lengths: optional host copies of the two above; when given
 *                 the call checks them before it launches (and qattn_kv_append advances
 *                 host_lengths as it advances lengths). */
typedef struct qattn_kv_seqs {
  int32_t* block_tables;
  int32_t* lengths;
  float* k_mean;
  const int32_t* host_block_tables;
  int32_t* host_lengths;
} qattn_kv_seqs;

/* Append n_new tokens to each of `batch` sequences. k and v are (batch, heads_kv,
 * n_new, head_dim) in dtype. For entry b the tokens land at positions lengths[b] ..
 * lengths[b] + n_new − 1, whose pages must be in its block-table row; K is stored as
 * K − c, with c computed from these keys when lengths[b] is 0 (the sequence's first
 * append) unless k_mean_preset is 1 (the engine wrote its own c to k_mean[b]); then
 * lengths[b] += n_new. Each cached row equals qattn's CPU quantizer of that row, bit
 * for bit. */
typedef struct qattn_kv_append_params {
  size_t struct_size; /* sizeof(qattn_kv_append_params) */
  const qattn_kv_cache* cache;
  qattn_kv_seqs seqs;
  qattn_tensor k, v; /* (batch, heads_kv, n_new, head_dim); memory rules of qattn_tensor */
  int32_t dtype;     /* a qattn_dtype */
  int32_t batch;     /* >= 1 */
  int32_t n_new;     /* >= 1 */
  int32_t k_mean_preset; /* 0 (default) or 1 */
} qattn_kv_append_params;

#define QATTN_KV_APPEND_PARAMS_MIN_SIZE \
  (offsetof(qattn_kv_append_params, k_mean_preset) + sizeof(int32_t))

void qattn_kv_append_params_init(qattn_kv_append_params* p);
/* Enqueues the append on `stream` (asynchronous, capturable; no workspace). */
qattn_status qattn_kv_append(const qattn_kv_append_params* p, void* stream);

/* Decode: attention of nq (1..16) new query tokens per sequence against its cached
 * tokens (the new tokens' K and V already appended). q and o are (batch, heads_q, nq,
 * head_dim); query head h reads KV head h / (heads_q / heads_kv). Causal is aligned
 * bottom-right: query i sees key j iff j <= i + lengths[b] − nq. Q is read in dtype
 * and kept in BF16; scores and P·V run on tensor cores from the dequantized cache, so
 * the result equals qattn's CPU emulation of the decode to FP32 rounding. When batch ×
 * heads_kv cannot fill the GPU, the keys are split into chunks on several SMs and
 * merged by their LSE (num_splits; 0 = chosen from the sizes). A sequence with length 0
 * gives O = 0 and LSE = −inf. */
typedef struct qattn_kv_decode_params {
  size_t struct_size; /* sizeof(qattn_kv_decode_params) */
  const qattn_kv_cache* cache;
  qattn_kv_seqs seqs;
  qattn_tensor q, o; /* (batch, heads_q, nq, head_dim) */
  float* lse;        /* optional (batch, heads_q, nq) FP32 natural-log LSE; NULL = none */
  int32_t dtype;     /* a qattn_dtype, of q and o */
  int32_t batch;     /* >= 1 */
  int32_t heads_q;   /* a multiple of heads_kv */
  int32_t nq;        /* 1..QATTN_KV_MAX_QUERY_TOKENS */
  int32_t causal;    /* 0 or 1 (default 1) */
  float sm_scale;    /* 0 means 1/sqrt(head_dim) */
  int32_t max_length;/* an upper bound of lengths (0 = the capacity), sizes the split */
  int32_t num_splits;/* 0 (default) = chosen; else 1..QATTN_KV_MAX_SPLITS */
} qattn_kv_decode_params;

#define QATTN_KV_DECODE_PARAMS_MIN_SIZE \
  (offsetof(qattn_kv_decode_params, num_splits) + sizeof(int32_t))
#define QATTN_KV_MAX_SPLITS 128

void qattn_kv_decode_params_init(qattn_kv_decode_params* p);
/* Workspace bytes of a decode (the split partials; 0 when it needs none). */
qattn_status qattn_kv_decode_workspace_size(const qattn_kv_decode_params* p, size_t* bytes);
/* Enqueues the decode on `stream` (asynchronous, capturable, never synchronizes);
 * workspace as for qattn_fwd. Needs a device of compute capability 9.0. */
qattn_status qattn_kv_decode(const qattn_kv_decode_params* p, void* workspace,
                             size_t workspace_bytes, void* stream);

/* ---- merging partial attention outputs (ring attention, split-KV) ----------------
 * Attention of a query row over a key set that is the disjoint union of parts equals
 * the merge of each part's output by its natural-log LSE (qattn_fwd's lse):
 *   m = max(lse_a, lse_b),  w_x = exp(lse_x − m),
 *   O = (w_a·O_a + w_b·O_b) / (w_a + w_b),  LSE = m + log(w_a + w_b),
 * in FP32; a row whose parts saw no key (both LSEs −inf) stays O = 0, LSE = −inf, and a
 * part that saw none (LSE −inf) adds nothing. qattn_merge folds one part into a
 * running FP32 accumulator in place, so a chain of calls (one per ring step) merges any
 * number of parts in any order, equal to a merge of all at once up to FP32 rounding;
 * the last call may also write the merged O in the parts' dtype (`out`). */
typedef struct qattn_merge_params {
  size_t struct_size; /* sizeof(qattn_merge_params) */
  int32_t dtype;      /* of part and out: a qattn_dtype */
  int32_t batch, heads, seqlen, head_dim; /* >= 1 each; head_dim <= 1024 */
  int32_t first;      /* 1: this is the first part: the accumulator is set to it (acc and
                         acc_lse are written, not read); 0 (default): merged into it */
  qattn_tensor part;  /* (batch, heads, seqlen, head_dim) in dtype, read: a part's O */
  const float* part_lse; /* (batch, heads, seqlen) FP32, contiguous, read: its LSE */
  float* acc;         /* (batch, heads, seqlen, head_dim) FP32, contiguous, read and written */
  float* acc_lse;     /* (batch, heads, seqlen) FP32, contiguous, read and written */
  qattn_tensor out;   /* optional (data NULL: none): the merged O in dtype, written */
} qattn_merge_params;

#define QATTN_MERGE_PARAMS_MIN_SIZE (offsetof(qattn_merge_params, out) + sizeof(qattn_tensor))

void qattn_merge_params_init(qattn_merge_params* p);
/* Enqueues the merge on `stream` (asynchronous, capturable; no workspace). part, the
 * LSEs and the accumulator follow qattn_tensor's memory rules (device memory, 16-byte
 * aligned tensors, the FP32 arrays 4-byte aligned); nothing it writes may overlap what
 * it reads. */
qattn_status qattn_merge(const qattn_merge_params* p, void* stream);

/* Message of the last failed call on this thread ("" if none has failed). */
const char* qattn_last_error_message(void);
const char* qattn_status_string(qattn_status s);

/* 1 if the device (a CUDA ordinal; < 0 = the current device) can run qattn_fwd,
 * else 0. Never fails and leaves the last error message alone. */
int qattn_device_supported(int device);

/* 1 if this build of the library has its CUDA kernels, 0 for a CPU-only build. */
int qattn_built_with_cuda(void);

/* "MAJOR.MINOR.PATCH" of the library that is linked (the macros above give the
 * headers'). */
const char* qattn_version_string(void);

#ifdef __cplusplus
}
#endif
#endif /* QATTN_QATTN_H */
