// What the C ABI tests share: fake device pointers (never dereferenced: validation only
// looks at addresses), a call's status with its message, and EXPECT_REJECTS.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "qattn/qattn.h"

namespace qattn::test {

// A distinct, 16-byte aligned address per slot (slot << 40), plus `offset` bytes.
inline void* fake(int slot, std::uintptr_t offset = 0) {
  return reinterpret_cast<void*>((static_cast<std::uintptr_t>(slot) << 40) + offset);
}

struct Outcome {
  qattn_status status;
  std::string message;
};

// The outcome of a call already made (its status is computed before the message is read).
inline Outcome outcome(qattn_status s) {
  return {s, s == QATTN_OK ? "" : qattn_last_error_message()};
}

}  // namespace qattn::test

// Asserts the status and that the message names every one of `words` (strings or
// string literals). The words are copied into std::strings inside the range's own
// initializer list: a `const char*` list would keep only pointers into temporaries
// (e.g. std::to_string(n).c_str()) that die before the loop runs.
#define EXPECT_REJECTS(outcome_expr, code, ...)                                   \
  do {                                                                            \
    const ::qattn::test::Outcome o_ = (outcome_expr);                             \
    EXPECT_EQ(o_.status, code) << o_.message;                                     \
    for (const std::string& w_ : std::initializer_list<std::string>{__VA_ARGS__}) \
      EXPECT_NE(o_.message.find(w_), std::string::npos)                           \
          << "message does not name '" << w_ << "': " << o_.message;              \
  } while (0)
