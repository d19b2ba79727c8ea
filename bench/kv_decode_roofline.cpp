// The KV-cache decode against the memory roofline, over the C ABI: the time of
// qattn_kv_decode per format and the bytes of cache it must read, as achieved GB/s next
// to a device-to-device copy of the same bytes measured in the same run (what HBM gives
// here). bench/decode.py is the side-by-side comparison with PyTorch SDPA; this isolates
// the kernel. Build after the library (cmake --build --preset release):
//   nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     bench/kv_decode_roofline.cpp build/libqattn.a -o kv_decode_roofline
//   ./kv_decode_roofline            # the grid below, one line per case, and the
//                                   # append of a 32K-token prefill per format
//   ./kv_decode_roofline --splits N # the decodes with N key chunks instead of the
//                                   # library's choice (0), no appends
//   ./kv_decode_roofline --only fp8 32 65536 1   # one case (format, B, L, nq)
// The pool holds the byte 0x11 everywhere (a finite value in every format); the speed
// does not depend on the values.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "qattn/qattn.h"

namespace {

const char* kNames[] = {"nvfp4", "fp8", "int8", "bf16"};

float time_ms(cudaStream_t s, int iters, auto&& body) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  body();  // warm-up
  cudaEventRecord(a, s);
  for (int i = 0; i < iters; ++i) body();
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}

int run(int format, int batch, int context, int heads_q, int heads_kv, int d, int nq, int splits) {
  qattn_kv_cache c;
  qattn_kv_cache_init(&c);
  c.format = format;
  c.heads_kv = heads_kv;
  c.head_dim = d;
  c.page_size = 16;
  c.max_pages_per_seq = context / 16;
  c.num_pages = batch * c.max_pages_per_seq;
  size_t page_bytes = 0;
  if (qattn_kv_cache_page_bytes(&c, &page_bytes) != QATTN_OK) {
    std::printf("%s\n", qattn_last_error_message());
    return 1;
  }
  const size_t pool_bytes = page_bytes * c.num_pages;
  void *pool = nullptr, *copy = nullptr, *q = nullptr, *o = nullptr, *ws = nullptr;
  int32_t *tables = nullptr, *lengths = nullptr;
  float* k_mean = nullptr;
  if (cudaMalloc(&pool, pool_bytes) != cudaSuccess ||
      cudaMalloc(&copy, pool_bytes) != cudaSuccess) {
    std::printf("skip: %zu bytes do not fit\n", pool_bytes);
    cudaFree(pool);
    cudaGetLastError();
    return 0;
  }
  cudaMemset(pool, 0x11, pool_bytes);
  std::vector<int32_t> h_tables(static_cast<size_t>(batch) * c.max_pages_per_seq);
  for (size_t i = 0; i < h_tables.size(); ++i) h_tables[i] = static_cast<int32_t>(i);
  std::vector<int32_t> h_lengths(batch, context);
  cudaMalloc(&tables, h_tables.size() * 4);
  cudaMalloc(&lengths, batch * 4);
  cudaMalloc(&k_mean, static_cast<size_t>(batch) * heads_kv * d * 4);
  cudaMemcpy(tables, h_tables.data(), h_tables.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(lengths, h_lengths.data(), batch * 4, cudaMemcpyHostToDevice);
  cudaMemset(k_mean, 0, static_cast<size_t>(batch) * heads_kv * d * 4);
  const size_t qn = static_cast<size_t>(batch) * heads_q * nq * d;
  cudaMalloc(&q, qn * 2);
  cudaMalloc(&o, qn * 2);
  cudaMemset(q, 0x3c, qn * 2);
  qattn_kv_decode_params p;
  qattn_kv_decode_params_init(&p);
  p.cache = &c;
  c.pages = pool;
  p.seqs = {tables, lengths, k_mean, h_tables.data(), h_lengths.data()};
  p.q = {q, int64_t{heads_q} * nq * d, int64_t{nq} * d, d};
  p.o = {o, int64_t{heads_q} * nq * d, int64_t{nq} * d, d};
  p.batch = batch;
  p.heads_q = heads_q;
  p.nq = nq;
  p.max_length = context;
  p.num_splits = splits;
  size_t ws_bytes = 0;
  qattn_kv_decode_workspace_size(&p, &ws_bytes);
  if (ws_bytes) cudaMalloc(&ws, ws_bytes);
  cudaStream_t s;
  cudaStreamCreate(&s);
  qattn_status st = QATTN_OK;
  const float ms = time_ms(s, 20, [&] { st = qattn_kv_decode(&p, ws, ws_bytes, s); });
  if (st != QATTN_OK) std::printf("decode: %s\n", qattn_last_error_message());
  // What the decode must read: every cached row of K and V (codes and scales).
  const double bytes = static_cast<double>(pool_bytes);
  const float copy_ms =
      time_ms(s, 20, [&] { cudaMemcpyAsync(copy, pool, pool_bytes, cudaMemcpyDeviceToDevice, s); });
  // A copy reads and writes each byte: its read rate is 2x bytes / time.
  std::printf(
      "%-6s B %3d L %6d Hq %3d Hkv %2d d %3d nq %2d splits %3d | %8.1f us | %7.0f GB/s | copy "
      "%7.0f GB/s (r+w) | %.2f of copy\n",
      kNames[format], batch, context, heads_q, heads_kv, d, nq, splits, ms * 1e3, bytes / ms / 1e6,
      2 * bytes / copy_ms / 1e6, (bytes / ms) / (2 * bytes / copy_ms));
  cudaFree(pool);
  cudaFree(copy);
  cudaFree(q);
  cudaFree(o);
  cudaFree(ws);
  cudaFree(tables);
  cudaFree(lengths);
  cudaFree(k_mean);
  cudaStreamDestroy(s);
  return 0;
}

// A prefill append of `tokens` tokens × heads_kv heads (bf16, page size 16) per format,
// beside a device copy of k and v (the append reads them once and writes codes).
void append_line(int format, int tokens, int heads_kv, int d) {
  qattn_kv_cache c;
  qattn_kv_cache_init(&c);
  c.format = format;
  c.heads_kv = heads_kv;
  c.head_dim = d;
  c.page_size = 16;
  c.max_pages_per_seq = tokens / 16;
  c.num_pages = c.max_pages_per_seq;
  size_t page_bytes = 0;
  qattn_kv_cache_page_bytes(&c, &page_bytes);
  const size_t elems = static_cast<size_t>(tokens) * heads_kv * d;
  void *pool = nullptr, *k = nullptr, *v = nullptr, *copy = nullptr;
  int32_t *tables = nullptr, *lengths = nullptr;
  float* k_mean = nullptr;
  cudaMalloc(&pool, page_bytes * c.num_pages);
  cudaMalloc(&k, elems * 2);
  cudaMalloc(&v, elems * 2);
  cudaMalloc(&copy, elems * 4);
  cudaMalloc(&tables, c.max_pages_per_seq * 4);
  cudaMalloc(&lengths, 4);
  cudaMalloc(&k_mean, heads_kv * d * 4);
  cudaMemset(k, 0x3c, elems * 2);
  cudaMemset(v, 0x3c, elems * 2);
  std::vector<int32_t> h_tables(c.max_pages_per_seq);
  for (int i = 0; i < c.max_pages_per_seq; ++i) h_tables[i] = i;
  cudaMemcpy(tables, h_tables.data(), h_tables.size() * 4, cudaMemcpyHostToDevice);
  c.pages = pool;
  qattn_kv_append_params p;
  qattn_kv_append_params_init(&p);
  p.cache = &c;
  p.seqs = {tables, lengths, k_mean, nullptr, nullptr};
  p.k = {k, int64_t{heads_kv} * tokens * d, int64_t{tokens} * d, d};
  p.v = {v, int64_t{heads_kv} * tokens * d, int64_t{tokens} * d, d};
  p.batch = 1;
  p.n_new = tokens;
  cudaStream_t s;
  cudaStreamCreate(&s);
  qattn_status st = QATTN_OK;
  const float ms = time_ms(s, 10, [&] {
    cudaMemsetAsync(lengths, 0, 4, s);  // every call is the sequence's first append
    st = qattn_kv_append(&p, s);
  });
  const float zero_ms = time_ms(s, 10, [&] { cudaMemsetAsync(lengths, 0, 4, s); });
  if (st != QATTN_OK) std::printf("append: %s\n", qattn_last_error_message());
  const float copy_ms = time_ms(s, 10, [&] {
    cudaMemcpyAsync(copy, k, elems * 2, cudaMemcpyDeviceToDevice, s);
    cudaMemcpyAsync(static_cast<char*>(copy) + elems * 2, v, elems * 2, cudaMemcpyDeviceToDevice,
                    s);
  });
  std::printf("append %-6s %6d tokens x %d heads d %d | %8.1f us | copy of k, v %8.1f us | %.2fx\n",
              kNames[format], tokens, heads_kv, d, (ms - zero_ms) * 1e3, copy_ms * 1e3,
              (ms - zero_ms) / copy_ms);
  cudaFree(pool);
  cudaFree(k);
  cudaFree(v);
  cudaFree(copy);
  cudaFree(tables);
  cudaFree(lengths);
  cudaFree(k_mean);
  cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string_view(argv[1]) == "--only") {  // one case, e.g. under ncu
    const std::string_view f = argv[2];
    int format = 0;
    while (format < 4 && f != kNames[format]) ++format;
    if (format == 4) return 2;
    return run(format, std::atoi(argv[3]), std::atoi(argv[4]), 32, 8, 128, std::atoi(argv[5]), 0);
  }
  const bool fixed = argc == 3 && std::string_view(argv[1]) == "--splits";
  const int splits = fixed ? std::atoi(argv[2]) : 0;
  if (!fixed)
    for (int f = 0; f < 4; ++f) append_line(f, 32768, 8, 128);
  for (int nq : {1, 4})
    for (int batch : {1, 8, 32})
      for (int context : {4096, 16384, 65536})
        for (int f = 0; f < 4; ++f) run(f, batch, context, 32, 8, 128, nq, splits);
  return 0;
}
