// Where the precision guard's per-head maxima live in a workspace (host code, in every
// build: the "auto" family sizes its workspace with it without CUDA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qattn/qattn.h"

namespace qattn::guard {

// Per (batch, query head) {max a², max a²|q̂|²} and per (batch, KV head) {max b²,
// max b²|k̂|²}, FP32 pairs (numerics/precision_guard.h).
struct Stats {
  float* q;  // (B, Hq, 2)
  float* k;  // (B, Hkv, 2)
};

// Workspace regions start at 256-byte boundaries.
inline std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

inline std::size_t stats_q_bytes(const qattn_fwd_params& p) {
  return align256(std::size_t(p.batch) * p.heads_q * 2 * sizeof(float));
}
inline std::size_t stats_k_bytes(const qattn_fwd_params& p) {
  return align256(std::size_t(p.batch) * p.heads_kv * 2 * sizeof(float));
}
// Bytes of both arrays (each 256-aligned), and their places from `base`.
inline std::size_t stats_bytes(const qattn_fwd_params& p) { return stats_q_bytes(p) + stats_k_bytes(p); }
inline Stats stats_at(const qattn_fwd_params& p, void* base) {
  auto* bytes = static_cast<uint8_t*>(base);
  return {reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + stats_q_bytes(p))};
}

}  // namespace qattn::guard
