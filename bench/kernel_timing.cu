// Quick timing of the SA2-8b forward (end-to-end and kernel-only) with CUDA events,
// for the performance notes (bench/NOTES.md). Usage: kernel_timing [B H N d causal]...
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda/sage2_fwd/launch.h"

namespace {

__global__ void fill_normal(uint16_t* x, size_t n, uint64_t seed) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float u1 = ((h & 0xFFFFFF) + 1) / 16777217.f, u2 = ((h >> 24) & 0xFFFFFF) / 16777216.f;
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    const uint32_t bits = __float_as_uint(z);
    x[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // bf16 RNE
  }
}

// x32 on the rows (tokens) with n % 64 == 5 of a (rows x d) bf16 tensor: never in the
// 256-token sample of V's amax bound for N a multiple of 512 (the sample takes every
// N/256-th token), so every channel of every head goes through the fix-up kernel.
__global__ void scale_unsampled_rows(uint16_t* x, size_t n, int d) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i < n; i += size_t(gridDim.x) * blockDim.x) {
    if ((i / d) % 64 != 5) continue;
    const float f = __uint_as_float(uint32_t(x[i]) << 16) * 32.f;
    x[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);  // exact: a power of two
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  struct Cfg {
    int b, h, n, d, causal;
  };
  std::vector<Cfg> cfgs;
  for (int i = 1; i + 4 < argc + 0 && i + 4 <= argc - 1 + 1; i += 5)
    cfgs.push_back({atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3]),
                    atoi(argv[i + 4])});
  if (cfgs.empty())
    for (int d : {128, 64})
      for (int causal : {0, 1})
        for (int n : {1024, 2048, 4096, 8192, 16384}) cfgs.push_back({4, 32, n, d, causal});
  std::printf("%6s %4s %6s %4s %6s | %9s %9s | %9s %9s\n", "B", "H", "N", "d", "causal", "e2e_ms",
              "e2e_TOPS", "kern_ms", "kern_TOPS");
  // KT_HEADS_KV: K/V heads for every shape (GQA; default: as many as query heads).
  const char* hkv_env = std::getenv("KT_HEADS_KV");
  // KT_V_OUTLIERS=1: V rows outside the amax sample x32 (the fix-up kernel's worst case).
  const bool v_outliers = std::getenv("KT_V_OUTLIERS") != nullptr;
  // KT_WINDOW=left,right: a sliding window on every shape (qattn.h; -1 = no bound).
  // KT_KV_LEN=n: key padding, every batch entry's keys from n on hidden.
  int window_left = -1, window_right = -1;
  const char* window_env = std::getenv("KT_WINDOW");
  if (window_env != nullptr) std::sscanf(window_env, "%d,%d", &window_left, &window_right);
  const char* kv_len_env = std::getenv("KT_KV_LEN");
  // KT_BOOL_MASK=causal|half|docs: a boolean attn_mask of (N, N) bytes broadcast over
  // batch and heads: the causal triangle, the first N/2 keys, or documents of 1024 tokens
  // (causal within each).
  const char* bool_mask_env = std::getenv("KT_BOOL_MASK");
  for (const Cfg& c : cfgs) {
    const int hkv = hkv_env != nullptr ? std::atoi(hkv_env) : c.h;
    const size_t elems = size_t(c.b) * c.h * c.n * c.d, kv_elems = size_t(c.b) * hkv * c.n * c.d;
    uint16_t *q, *k, *v, *o;
    cudaMalloc(&q, elems * 2);
    cudaMalloc(&k, kv_elems * 2);
    cudaMalloc(&v, kv_elems * 2);
    cudaMalloc(&o, elems * 2);
    fill_normal<<<1024, 256>>>(q, elems, 1);
    fill_normal<<<1024, 256>>>(k, kv_elems, 2);
    fill_normal<<<1024, 256>>>(v, kv_elems, 3);
    if (v_outliers) scale_unsampled_rows<<<1024, 256>>>(v, kv_elems, c.d);
    qattn_fwd_params p{};
    p.dtype = QATTN_DTYPE_BF16;
    p.batch = c.b;
    p.heads_q = c.h;
    p.heads_kv = hkv;
    p.seqlen_q = c.n;
    p.seqlen_kv = c.n;
    p.head_dim = c.d;
    p.causal = c.causal;
    p.sage2.granularity = QATTN_QK_PER_THREAD;
    p.window = window_env != nullptr ? 1 : 0;
    p.window_left = window_left;
    p.window_right = window_right;
    int* kv_lens = nullptr;
    if (kv_len_env != nullptr) {
      const std::vector<int> lens(c.b, std::atoi(kv_len_env));
      cudaMalloc(&kv_lens, c.b * sizeof(int));
      cudaMemcpy(kv_lens, lens.data(), c.b * sizeof(int), cudaMemcpyHostToDevice);
      p.kv_lengths = kv_lens;
    }
    uint8_t* bool_mask = nullptr;
    if (bool_mask_env != nullptr) {
      const std::string kind = bool_mask_env;
      std::vector<uint8_t> m(size_t(c.n) * c.n);
      for (int i = 0; i < c.n; ++i)
        for (int j = 0; j < c.n; ++j)
          m[size_t(i) * c.n + j] = kind == "causal" ? j <= i
                                   : kind == "half" ? j < c.n / 2
                                                    : (i / 1024 == j / 1024 && j <= i);
      cudaMalloc(&bool_mask, m.size());
      cudaMemcpy(bool_mask, m.data(), m.size(), cudaMemcpyHostToDevice);
      p.attn_mask_type = QATTN_MASK_BOOL;
      p.attn_mask = bool_mask;
      p.attn_mask_stride_q = c.n;
      p.attn_mask_stride_k = 1;
    }
    const int64_t sn = c.d, sh = int64_t(c.n) * c.d, sb = sh * c.h, sb_kv = sh * hkv;
    p.q = {q, sb, sh, sn};
    p.k = {k, sb_kv, sh, sn};
    p.v = {v, sb_kv, sh, sn};
    p.o = {o, sb, sh, sn};
    void* ws;
    cudaMalloc(&ws, qattn::sage2::workspace_bytes(p));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    auto time = [&](bool e2e) {
      std::vector<float> ms;
      for (int it = 0; it < 5; ++it)
        e2e ? qattn::sage2::launch_forward(p, ws, nullptr)
            : qattn::sage2::launch_attention_only(p, ws, nullptr);
      for (int it = 0; it < 30; ++it) {
        cudaEventRecord(e0);
        int rc = e2e ? qattn::sage2::launch_forward(p, ws, nullptr)
                     : qattn::sage2::launch_attention_only(p, ws, nullptr);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        if (rc != 0) {
          std::printf("launch error %d %s\n", rc, cudaGetErrorString(cudaError_t(rc)));
          std::exit(1);
        }
        float t;
        cudaEventElapsedTime(&t, e0, e1);
        ms.push_back(t);
      }
      return median(ms);
    };
    const float t_e2e = time(true), t_k = time(false);
    const double ops = 4.0 * c.b * c.h * double(c.n) * c.n * c.d * (c.causal ? 0.5 : 1.0);
    std::printf("%6d %4d %6d %4d %6d | %9.3f %9.1f | %9.3f %9.1f\n", c.b, c.h, c.n, c.d, c.causal,
                t_e2e, ops / t_e2e / 1e9, t_k, ops / t_k / 1e9);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      std::printf("CUDA error %s\n", cudaGetErrorString(e));
      return 1;
    }
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(ws);
    cudaFree(kv_lens);
    cudaFree(bool_mask);
  }
  return 0;
}
