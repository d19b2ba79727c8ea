/* Benchmark hooks of libqattn: entry points the bench tools and tests use that are not
 * part of the public API (no stability promise; they may change with any version).
 * libqattn.so exports them for the bench tools; include this header from the source
 * tree (src/ on the include path). */
#ifndef QATTN_API_BENCH_HOOKS_H
#define QATTN_API_BENCH_HOOKS_H

#include "qattn/qattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the attention kernel alone on a workspace that an earlier qattn_fwd with the
 * same parameters (same pointers) filled; k and v are not read (q is: the attention
 * kernel quantizes Q itself). "Kernel-only" time in docs/design.md's "Measuring"
 * terms. Same checks as qattn_fwd. */
qattn_status qattn_fwd_attention_only(const qattn_fwd_params* p, void* workspace,
                                      size_t workspace_bytes, void* stream);

/* Everything qattn_fwd does before it enqueues (the parameters, the workspace, the
 * device, the family, the pointers' allocations) and nothing after: the host cost of a
 * call's checks, apart from its launches. */
qattn_status qattn_fwd_checks_only(const qattn_fwd_params* p, void* workspace,
                                   size_t workspace_bytes);

/* qattn_fwd without its pointer checks (the allocation queries of each buffer; every
 * other check stays): the host cost of those checks, timed against qattn_fwd. */
qattn_status qattn_fwd_pointers_unchecked(const qattn_fwd_params* p, void* workspace,
                                          size_t workspace_bytes, void* stream);

#ifdef __cplusplus
}  // extern "C"

#include "qattn/qattn.hpp"

namespace qattn {

// The C++ form of qattn_fwd_attention_only, beside qattn::forward.
inline Status forward_attention_only(const ForwardParams& p, void* workspace,
                                     std::size_t workspace_bytes, void* stream) {
  if (!p.status().ok()) return p.status();
  return Status::from_c(qattn_fwd_attention_only(&p.raw(), workspace, workspace_bytes, stream));
}

}  // namespace qattn
#endif
#endif /* QATTN_API_BENCH_HOOKS_H */
