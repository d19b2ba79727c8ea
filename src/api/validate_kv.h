// Validation of the KV-cache calls (qattn.h, "KV cache and decode"): the cache
// descriptor, the sequences of a call, the append and the decode. Host arithmetic on
// values and addresses, plus the host mirrors of the block tables and lengths when the
// caller passes them; nothing here reads device memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "api/validate.h"
#include "qattn/qattn.h"

namespace qattn::api {

// Reads the caller's cache descriptor (qattn.h's struct-size rule) and checks its
// format and sizes; `need_pages`: the pool pointer must be set (append, decode).
qattn_status read_cache(const char* fn, const qattn_kv_cache* caller, qattn_kv_cache* out,
                        bool need_pages);
// Bytes of one page of a validated cache.
std::size_t kv_page_bytes(const qattn_kv_cache& c);

// Reads and checks an append; *cache receives the validated copy of p->cache.
qattn_status read_append(const char* fn, const qattn_kv_append_params* caller,
                         qattn_kv_append_params* out, qattn_kv_cache* cache);
// Reads and checks a decode (without its workspace) and resolves its split count.
qattn_status read_decode(const char* fn, const qattn_kv_decode_params* caller,
                         qattn_kv_decode_params* out, qattn_kv_cache* cache, int32_t* splits);
std::size_t decode_workspace_bytes(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                   int32_t splits);
qattn_status validate_decode_workspace(const char* fn, const qattn_kv_decode_params& p,
                                       const qattn_kv_cache& c, int32_t splits,
                                       const void* workspace, std::size_t workspace_bytes);

// The device buffers of a validated call, for check_pointers.
std::array<BufferSpan, 6> buffer_spans(const qattn_kv_append_params& p, const qattn_kv_cache& c);
std::array<BufferSpan, 8> buffer_spans(const qattn_kv_decode_params& p, const qattn_kv_cache& c,
                                       int32_t splits, const void* workspace);

// The decode with its defaults made explicit (sm_scale 0 becomes 1/sqrt(head_dim)).
qattn_kv_decode_params resolve_defaults(const qattn_kv_decode_params& p, const qattn_kv_cache& c);

}  // namespace qattn::api
