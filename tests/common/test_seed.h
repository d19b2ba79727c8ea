// The seed of a random test: a fresh one per run, or QATTN_TEST_SEED's value to run a
// failure again with the seed it printed. Every random test prints its seed through
// seed_trace (a SCOPED_TRACE line on any failure), CPU and GPU tests alike.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace qattn::test {

inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("QATTN_TEST_SEED"); s != nullptr && *s != '\0')
    return std::strtoull(s, nullptr, 10);
  return std::random_device{}() * 0x9E3779B97F4A7C15ull + std::random_device{}();
}

// For std::mt19937 (32-bit seeds): the low 32 bits, so QATTN_TEST_SEED=<printed value>
// gives the same generator.
inline std::uint32_t fresh_seed32() { return static_cast<std::uint32_t>(fresh_seed()); }

// "seed N (QATTN_TEST_SEED=N reruns it)", for SCOPED_TRACE.
inline std::string seed_trace(std::uint64_t seed) {
  return "seed " + std::to_string(seed) + " (QATTN_TEST_SEED=" + std::to_string(seed) +
         " reruns it)";
}

}  // namespace qattn::test
