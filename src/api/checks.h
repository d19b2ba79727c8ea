// The checks every call's validation is made of (validate.cpp, validate_kv.cpp): tensor
// views, flags, ranges, the struct-size rule, overlaps and the workspace. Host
// arithmetic on values and addresses only.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "api/error.h"
#include "api/validate.h"
#include "qattn/qattn.h"

namespace qattn::api::checks {

// Overflow-checked int64 arithmetic; false when the result does not fit.
inline bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
inline bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

// The byte range [begin, end) a tensor view spans.
struct Span {
  uintptr_t begin = 0, end = 0;
  bool overlaps(const Span& o) const { return begin < o.end && o.begin < end; }
};

struct Dim {
  const char* name;
  int64_t extent, stride;
};

// A buffer of a call for the overlap checks: its name and byte range; `present` is
// false for an absent optional buffer (the forward's lse).
struct Named {
  const char* name;
  Span span;
  bool present = true;
};

// Checks one (B, H, N, d) view of a 16-bit type: pointer, alignment, strides, size
// arithmetic. `writes` adds the check that no two elements share an address.
qattn_status check_tensor(const char* fn, const char* name, const qattn_tensor& t, int64_t batch,
                          int64_t heads, int64_t seqlen, int64_t head_dim, bool writes);
qattn_status check_int(const char* fn, const char* name, int value, int lo, int hi,
                       const char* why = "");
// A 0/1 flag.
qattn_status check_flag(const char* fn, const char* name, int32_t value);
qattn_status check_dtype(const char* fn, int32_t dtype);
// 0 (the default) or a positive finite scale up to kMaxSmScale.
qattn_status check_sm_scale(const char* fn, float sm_scale);
qattn_status check_reserved(const char* fn, const char* name, int32_t value, const char* init_name);
// The range a (B, H, N, d) view spans (strides already checked).
Span span_of(const qattn_tensor& t, int64_t batch, int64_t heads, int64_t seqlen, int64_t d);

// Every output stands alone: it overlaps no input and no other output (inputs may
// overlap each other: they are only read). `allowed(name)` is the text after
// "allowed: " for that output.
template <std::size_t I, std::size_t O, typename Allowed>
qattn_status check_overlaps(const char* fn, const std::array<Named, I>& inputs,
                            const std::array<Named, O>& outputs, Allowed allowed) {
  for (const Named& in : inputs) {
    if (!in.present) continue;
    for (const Named& out : outputs)
      if (out.present && out.span.overlaps(in.span))
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", out.name, " overlaps ", in.name,
                    " in memory; allowed: ", allowed(out.name));
  }
  for (std::size_t i = 0; i < O; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (outputs[i].present && outputs[j].present && outputs[i].span.overlaps(outputs[j].span))
        return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": ", outputs[i].name, " overlaps ",
                    outputs[j].name, " in memory; allowed: ", allowed(outputs[i].name));
  return QATTN_OK;
}

// The workspace: present, 256-byte aligned, at least `need` bytes, and (those bytes)
// apart from every buffer of the call. `sizer` names the function that sizes it. A call
// that needs none (need == 0) reads and writes none, so any pointer and size are taken,
// NULL and 0 included.
template <std::size_t N>
qattn_status check_workspace(const char* fn, const char* sizer, std::size_t need,
                             const void* workspace, std::size_t workspace_bytes,
                             const std::array<Named, N>& buffers) {
  if (need == 0) return QATTN_OK;
  if (workspace == nullptr)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace is NULL; allowed: device memory of ",
                need, " bytes (", sizer, ")");
  const auto addr = reinterpret_cast<uintptr_t>(workspace);
  if (addr % kWorkspaceAlign != 0)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace = ", workspace,
                " is not 256-byte aligned");
  if (workspace_bytes < need)
    return fail(QATTN_ERROR_WORKSPACE_TOO_SMALL, fn, ": workspace_bytes = ", workspace_bytes,
                "; these parameters need at least ", need, " bytes (", sizer, ")");
  if (addr > UINTPTR_MAX - need)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn,
                ": workspace runs past the end of the address space");
  const Span ws{addr, addr + need};
  for (const Named& b : buffers)
    if (b.present && ws.overlaps(b.span))
      return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": workspace overlaps ", b.name,
                  " in memory; allowed: a buffer of its own");
  return QATTN_OK;
}

template <std::size_t A, std::size_t B>
std::array<Named, A + B> join(const std::array<Named, A>& a, const std::array<Named, B>& b) {
  std::array<Named, A + B> r{};
  std::copy(a.begin(), a.end(), r.begin());
  std::copy(b.begin(), b.end(), r.begin() + A);
  return r;
}

// qattn.h's stability rule for a struct that starts with its size: the caller's prefix
// is copied over the defaults `init` gives.
template <typename Params>
qattn_status read_struct(const char* fn, const Params* p, Params* out, const char* type,
                         std::size_t min_size, const char* init_name, void (*init)(Params*)) {
  if (p == nullptr) return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": params is NULL");
  const std::size_t size = p->struct_size;
  if (size < min_size)
    return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": params->struct_size = ", size,
                "; allowed: sizeof(", type, ") of the caller's qattn.h, at least ", min_size,
                " (set by ", init_name, ")");
  if (size > sizeof(Params))
    return fail(QATTN_ERROR_UNSUPPORTED, fn, ": params->struct_size = ", size,
                " is larger than this library's ", type, " (", sizeof(Params), " bytes, qattn ",
                QATTN_VERSION_MAJOR, ".", QATTN_VERSION_MINOR, ".", QATTN_VERSION_PATCH,
                "): the program was compiled against a newer qattn.h; link a library at least "
                "as new as its header");
  init(out);
  std::memcpy(out, p, size);  // fields only ever appended: the caller's prefix is ours
  out->struct_size = sizeof(Params);
  return QATTN_OK;
}

// read_struct for a struct that has had several layouts: the size must also be one of
// them (`layouts`, in bytes), so that no field is read in part (half of a pointer).
template <typename Params>
qattn_status read_struct(const char* fn, const Params* p, Params* out, const char* type,
                         std::span<const std::size_t> layouts, const char* init_name,
                         void (*init)(Params*)) {
  if (auto s = read_struct(fn, p, out, type, layouts.front(), init_name, init); s) return s;
  const std::size_t size = p->struct_size;
  for (std::size_t layout : layouts)
    if (size == layout) return QATTN_OK;
  std::string sizes;
  for (std::size_t layout : layouts) sizes += (sizes.empty() ? "" : " or ") + std::to_string(layout);
  return fail(QATTN_ERROR_INVALID_ARGUMENT, fn, ": params->struct_size = ", size,
              " ends inside a field; allowed: the size of one of ", type, "'s layouts (", sizes,
              " bytes here; set by ", init_name, ")");
}

}  // namespace qattn::api::checks
