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

typedef enum qattn_dtype { QATTN_DTYPE_FP16 = 0, QATTN_DTYPE_BF16 = 1 } qattn_dtype;

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
 *   - o: no two of its elements share an address, and o overlaps none of q, k, v, lse
 *     or the workspace (q, k and v may overlap each other: they are only read). */
typedef struct qattn_tensor {
  void* data;
  int64_t stride_b, stride_h, stride_n;
} qattn_tensor;

typedef struct qattn_fwd_params {
  qattn_tensor q, k, v; /* inputs: q (B, Hq, Nq, d), k and v (B, Hkv, Nkv, d) */
  qattn_tensor o;       /* output (B, Hq, Nq, d), same dtype as the inputs */
  float* lse;           /* optional (B, Hq, Nq) FP32 natural-log LSE, contiguous, 4-byte
                           aligned; NULL = none */
  qattn_dtype dtype;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_kv; /* all >= 1; heads_q % heads_kv == 0;
                                                        batch, heads_q <= 65535 (grid) */
  int head_dim;   /* 1..128; 64 and 128 run natively, others are zero-padded inside */
  int causal;     /* 0 or 1; bottom-right aligned when seqlen_q != seqlen_kv */
  float sm_scale; /* <= 0 means 1/sqrt(head_dim); NaN and infinity are rejected */
  qattn_qk_granularity granularity;
} qattn_fwd_params;

/* Fills p with defaults: everything zero/NULL, dtype bf16, granularity per-thread,
 * sm_scale 0 (= 1/sqrt(d)), causal 0. */
void qattn_fwd_params_init(qattn_fwd_params* p);

/* Bytes of device workspace qattn_fwd needs for these parameters (validates them:
 * returns the same error qattn_fwd would for a bad parameter, without a device). */
qattn_status qattn_fwd_workspace_size(const qattn_fwd_params* p, size_t* bytes);

/* SageAttention2-8b forward: smoothed INT8 Q·Kᵀ, E4M3 P·V, two-level accumulation.
 * workspace: device memory of at least qattn_fwd_workspace_size bytes, 256-byte
 * aligned, not used by anything else until the work on `stream` is done.
 * stream: a cudaStream_t (NULL = the legacy default stream); the call is
 * asynchronous and may be captured into a CUDA graph.
 * Needs a device of compute capability 9.0 (Hopper), current on the calling thread. */
qattn_status qattn_fwd(const qattn_fwd_params* p, void* workspace, size_t workspace_bytes,
                       void* stream);

/* Benchmarks only: runs the attention kernel alone on a workspace that an earlier
 * qattn_fwd with the same parameters (same pointers) filled; k and v are not read
 * (q is: the attention kernel quantizes Q itself).
 * "Kernel-only" time in DESIGN §4 terms. Same checks as qattn_fwd. */
qattn_status qattn_fwd_attention_only(const qattn_fwd_params* p, void* workspace,
                                      size_t workspace_bytes, void* stream);

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
