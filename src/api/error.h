// The thread-local "last error" of the C ABI, and a helper that records a message
// and returns its status in one expression: `return fail(QATTN_ERROR_..., "...", x);`.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "qattn/qattn.h"

namespace qattn::api {

// Stores `message` as this thread's last error message.
void set_last_error(std::string message);
const char* last_error();

// Concatenates the pieces with operator<<.
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream s;
  (s << ... << std::forward<Args>(args));
  return s.str();
}

template <typename... Args>
qattn_status fail(qattn_status status, Args&&... message_pieces) {
  set_last_error(cat(std::forward<Args>(message_pieces)...));
  return status;
}

}  // namespace qattn::api
