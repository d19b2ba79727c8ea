// The thread-local "last error" of the C ABI, and a helper that records a message
// and returns its status in one expression: `return fail(QATTN_ERROR_..., "...", x);`.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "qattn/qattn.h"

namespace qattn::api {

// Stores `message` as this thread's last error message.
void set_last_error(std::string message);
const char* last_error();

// Appends one piece of a message. std::to_chars, not iostreams: an ostream inside a
// module that carries its own copy of the C++ runtime crashed in its locale facets when
// loaded into a PyTorch process (seen on the device, 2026-11-29).
template <typename T>
void append_piece(std::string& out, const T& x) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    out += x ? "true" : "false";
  } else if constexpr (std::is_arithmetic_v<U>) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof(buf), x);
    out.append(buf, r.ptr);
  } else if constexpr (std::is_pointer_v<U> && !std::is_same_v<U, const char*> &&
                       !std::is_same_v<U, char*>) {
    char buf[32] = "0x";
    const auto r =
        std::to_chars(buf + 2, buf + sizeof(buf), reinterpret_cast<std::uintptr_t>(x), 16);
    out.append(buf, r.ptr);
  } else {
    out += std::string_view(x);
  }
}

// Concatenates the pieces (strings, numbers, pointers).
template <typename... Args>
std::string cat(Args&&... args) {
  std::string s;
  (append_piece(s, args), ...);
  return s;
}

template <typename... Args>
qattn_status fail(qattn_status status, Args&&... message_pieces) {
  set_last_error(cat(std::forward<Args>(message_pieces)...));
  return status;
}

}  // namespace qattn::api
