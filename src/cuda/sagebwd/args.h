// What every SageBwd kernel reads: the caller's tensors and the workspace buffers
// (workspace.h), resolved to pointers once by the launch.
#pragma once

#include <cstdint>

namespace qattn::sagebwd {

struct Strided {  // a (B, H, N, d) view; strides in elements
  const void* data;
  int64_t sb, sh, sn;
};
struct StridedOut {
  void* data;
  int64_t sb, sh, sn;
};

struct Args {
  Strided q, k, v, o, dout;
  const float* lse;
  StridedOut dq, dk, dv;
  int batch, heads_q, heads_kv, group, nq, nkv, d;
  int nq_pad, nkv_pad;  // multiples of 64 and 128
  int causal;
  float sm_scale, scale_log2;  // sm_scale·log2 e
  // Workspace (workspace.h).
  int8_t *q_i8, *qt_i8, *do_i8, *dot_i8, *k_i8, *kt_i8, *v_i8;
  void *do_16, *v_16;
  float *q_scale, *do_scale, *lse2, *delta, *dq_acc, *k_scale, *v_scale, *k_mean;
  // The merge-free scales only (null otherwise): the forward's P row maxima, each row's
  // s_i and 1/s_i (0 for a row without keys), and the per-channel maxima of |V|, |dO|
  // and |s_i·Q| of each (batch, KV head).
  const float* p_max;
  float *s_row, *inv_s, *v_max, *do_max, *sq_max;
};

}  // namespace qattn::sagebwd
