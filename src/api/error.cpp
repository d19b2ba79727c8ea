#include "api/error.h"

namespace qattn::api {
namespace {
thread_local std::string g_last_error;
}  // namespace

void set_last_error(std::string message) { g_last_error = std::move(message); }
const char* last_error() { return g_last_error.c_str(); }

}  // namespace qattn::api
