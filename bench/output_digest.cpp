// Prints a 64-bit digest of O and of the LSE for each case of a fixed grid of forward
// calls, so two builds of the library can be compared bit for bit on one GPU: run the
// same binary built against each (bench/compare_builds.sh) and diff the outputs.
// The grid covers what the GPU tests vary: tails, GQA/MQA, causal, Nq != Nkv, HND and
// NHD, bf16 and fp16, head dims 32..128 (padded ones too), the three Q·K granularities,
// row strides with gaps, and lengths that select each of the attention kernel's shapes
// (short items, the poly-exp range, long items, d = 64). Inputs come from a seeded
// generator on the host; `--seed S` adds 24 random cases drawn from seed S, so both
// builds see the same fresh inputs.
//
// Uses the public C ABI only. Build (see bench/compare_builds.sh):
//   g++ -std=c++20 -O2 -Iinclude bench/output_digest.cpp build/libqattn.a
//       -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "qattn/qattn.h"

namespace {

struct Case {
  int b, hq, hkv, nq, nkv, d;
  int causal;
  bool bf16, nhd;
  int granularity;
  int row_pad;  // extra elements after each row (a multiple of 8)
  bool lse;
  uint64_t seed;
};

uint16_t to_16bit(float x, bool bf16) {
  if (bf16) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);  // RNE
  }
  const __half_raw h = __half(x);
  return h.x;
}

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                     \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

// Strides of a (B, H, N, d) tensor with rows `row` elements apart.
qattn_tensor view(void* data, bool nhd, int h, int n, int row) {
  qattn_tensor t{data, 0, 0, 0};
  if (!nhd) {
    t.stride_n = row;
    t.stride_h = int64_t{n} * row;
    t.stride_b = t.stride_h * h;
  } else {
    t.stride_h = row;
    t.stride_n = int64_t{h} * row;
    t.stride_b = t.stride_n * n;
  }
  return t;
}

void run(const Case& c) {
  const int row = (c.d + 7) / 8 * 8 + c.row_pad;
  const size_t nq_el = size_t(c.b) * c.hq * c.nq * row, nkv_el = size_t(c.b) * c.hkv * c.nkv * row;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](size_t n, float bias_scale) {
    std::vector<uint16_t> h(n);
    std::vector<float> bias(row);
    for (auto& x : bias) x = bias_scale * normal(rng);
    for (size_t i = 0; i < n; ++i) h[i] = to_16bit(normal(rng) + bias[i % row], c.bf16);
    return h;
  };
  const auto hq = fill(nq_el, 0.2f), hk = fill(nkv_el, 1.0f), hv = fill(nkv_el, 0.f);
  void *q, *k, *v, *o;
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&q, nq_el * 2));
  CHECK_CUDA(cudaMalloc(&k, nkv_el * 2));
  CHECK_CUDA(cudaMalloc(&v, nkv_el * 2));
  CHECK_CUDA(cudaMalloc(&o, nq_el * 2));
  CHECK_CUDA(cudaMemcpy(q, hq.data(), nq_el * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(k, hk.data(), nkv_el * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(v, hv.data(), nkv_el * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(o, 0, nq_el * 2));  // row gaps: the same bytes in both builds
  const size_t lse_n = size_t(c.b) * c.hq * c.nq;
  if (c.lse) CHECK_CUDA(cudaMalloc(&lse, lse_n * 4));

  qattn_fwd_params p;
  qattn_fwd_params_init(&p);
  p.q = view(q, c.nhd, c.hq, c.nq, row);
  p.k = view(k, c.nhd, c.hkv, c.nkv, row);
  p.v = view(v, c.nhd, c.hkv, c.nkv, row);
  p.o = view(o, c.nhd, c.hq, c.nq, row);
  p.lse = lse;
  p.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
  p.batch = c.b;
  p.heads_q = c.hq;
  p.heads_kv = c.hkv;
  p.seqlen_q = c.nq;
  p.seqlen_kv = c.nkv;
  p.head_dim = c.d;
  p.causal = c.causal;
#ifdef QATTN_DIGEST_SAGE2_OPTIONS
  p.sage2.granularity = c.granularity;
#else
  p.granularity = static_cast<qattn_qk_granularity>(c.granularity);
#endif
  size_t ws_bytes = 0;
  void* ws = nullptr;
  qattn_status s = qattn_fwd_workspace_size(&p, &ws_bytes);
  if (s == QATTN_OK) {
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    s = qattn_fwd(&p, ws, ws_bytes, nullptr);
  }
  uint64_t ho = 0, hl = 0;
  if (s == QATTN_OK) {
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> out(nq_el);
    CHECK_CUDA(cudaMemcpy(out.data(), o, nq_el * 2, cudaMemcpyDeviceToHost));
    ho = fnv1a(out.data(), out.size() * 2);
    if (c.lse) {
      std::vector<float> l(lse_n);
      CHECK_CUDA(cudaMemcpy(l.data(), lse, lse_n * 4, cudaMemcpyDeviceToHost));
      hl = fnv1a(l.data(), l.size() * 4);
    }
  }
  std::printf("B=%d Hq=%d Hkv=%d Nq=%d Nkv=%d d=%d causal=%d %s %s gran=%d pad=%d lse=%d "
              "seed=%llu | status=%d O=%016llx LSE=%016llx\n",
              c.b, c.hq, c.hkv, c.nq, c.nkv, c.d, c.causal, c.bf16 ? "bf16" : "fp16",
              c.nhd ? "NHD" : "HND", c.granularity, c.row_pad, c.lse ? 1 : 0,
              static_cast<unsigned long long>(c.seed), static_cast<int>(s),
              static_cast<unsigned long long>(ho), static_cast<unsigned long long>(hl));
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(o);
  if (lse) cudaFree(lse);
  if (ws) cudaFree(ws);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Case> cases;
  uint64_t seed = 1;
  // Fixed grid.
  for (int d : {32, 64, 72, 100, 128})
    for (int causal : {0, 1})
      for (bool bf16 : {true, false})
        cases.push_back({2, 4, 2, 333, 333, d, causal, bf16, d == 72, 0, d == 100 ? 8 : 0, true,
                         seed++});
  for (int g : {0, 1, 2})
    for (bool nhd : {false, true}) cases.push_back({1, 8, 1, 200, 640, 128, 1, true, nhd, g, 0, true, seed++});
  cases.push_back({1, 4, 4, 640, 300, 64, 1, true, false, 0, 0, true, seed++});  // Nq > Nkv: empty rows
  cases.push_back({1, 2, 2, 1, 129, 128, 0, false, false, 0, 0, false, seed++});
  cases.push_back({1, 2, 2, 17, 1, 64, 1, true, true, 0, 16, true, seed++});
  // Lengths that select each kernel shape (launch.cu): short items (four-warp quantizer),
  // 16-48 KV tiles non-causal (poly exp), long items (240 split), d = 64.
  for (int n : {1024, 2048, 4096, 8192})
    for (int causal : {0, 1})
      for (int d : {64, 128}) cases.push_back({1, 4, 2, n, n, d, causal, true, false, 0, 0, true, seed++});
  cases.push_back({2, 16, 16, 1536, 1536, 128, 0, true, true, 0, 0, true, seed++});  // many items
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--seed") == 0) {
      std::mt19937_64 rng(std::strtoull(argv[i + 1], nullptr, 10));
      auto pick = [&](std::initializer_list<int> xs) {
        return *(xs.begin() + rng() % xs.size());
      };
      for (int r = 0; r < 24; ++r) {
        Case c{};
        c.b = pick({1, 2});
        c.hkv = pick({1, 2, 3});
        c.hq = c.hkv * pick({1, 2, 4});
        c.nq = pick({1, 17, 64, 127, 128, 200, 333, 512, 1000});
        c.nkv = pick({1, 31, 128, 129, 300, 640, 2000});
        c.d = pick({32, 64, 72, 96, 128});
        c.causal = pick({0, 1});
        c.bf16 = pick({0, 1});
        c.nhd = pick({0, 1});
        c.granularity = pick({0, 0, 1, 2});
        c.row_pad = pick({0, 0, 8});
        c.lse = pick({0, 1, 1});
        c.seed = rng();
        cases.push_back(c);
      }
    }
  for (const Case& c : cases) run(c);
  return 0;
}
