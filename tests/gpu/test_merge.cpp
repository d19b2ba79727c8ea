// qattn_merge on the GPU: a chain of merges (first part, then the others, the last with
// `out`) against an FP64 merge of all parts at once, rows that no part or only some
// parts see, strided 16-bit parts, guards around the accumulator and `out`.
//
// Tolerances: the kernel computes in FP32 with IEEE expf/logf; each merge rounds the two
// weights and the weighted sum, a relative error of a few 2^-24 per step, so over three
// steps |acc − ref| <= 1e-5 · (1 + |ref|) (values of size ~4) and the LSE within 1e-5 ·
// (1 + |lse|) of FP64. `out` is acc rounded to the 16-bit type, exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_util.h"
#include "qattn/qattn.h"

namespace {

using qattn::test::DeviceBuffer;

struct MergeCase {
  int batch = 2, heads = 3, seqlen = 77, head_dim = 100, parts = 3;
  bool bf16 = true, nhd = false;
  uint64_t seed = 1;
};

void check_merge(const MergeCase& c) {
  SCOPED_TRACE("B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) +
               " N=" + std::to_string(c.seqlen) + " d=" + std::to_string(c.head_dim) +
               " parts=" + std::to_string(c.parts) + (c.bf16 ? " bf16" : " fp16") +
               (c.nhd ? " NHD" : " HND") + " seed=" + std::to_string(c.seed));
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(-6.f, 25.f);
  const int B = c.batch, H = c.heads, N = c.seqlen, d = c.head_dim;
  const int row = (d + 7) / 8 * 8;
  const std::size_t rows = std::size_t(B) * H * N, elems = rows * row;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  // Strides of a (B, H, N, row) buffer in the chosen layout.
  const int64_t sn = c.nhd ? int64_t{H} * row : row, sh = c.nhd ? row : int64_t{N} * row,
                sb = int64_t{H} * N * row;
  auto at = [&](int b, int h, int n) { return b * sb + h * sh + n * sn; };
  std::vector<std::vector<uint16_t>> parts(c.parts, std::vector<uint16_t>(elems, 0x7FFF));
  std::vector<std::vector<float>> lses(c.parts, std::vector<float>(rows));
  for (int p = 0; p < c.parts; ++p)
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int n = 0; n < N; ++n) {
          const std::size_t r = (std::size_t(b) * H + h) * N + n;
          for (int x = 0; x < d; ++x) parts[p][at(b, h, n) + x] = qattn::test::to_bits16(normal(rng), c.bf16);
          // Row n % 7 == 0: no part sees a key; n % 5 == 0: part 0 sees none; n % 3 == 0:
          // the last sees none.
          const bool none = n % 7 == 0 || (p == 0 && n % 5 == 0) || (p == c.parts - 1 && n % 3 == 0);
          lses[p][r] = none ? kNegInf : uni(rng);
          if (none && p == 0)  // such a part's O is 0 in qattn_fwd; any values must be ignored
            for (int x = 0; x < d; ++x) parts[p][at(b, h, n) + x] = qattn::test::to_bits16(3.f, c.bf16);
        }
  // FP64 merge of all parts at once.
  std::vector<double> ref_o(rows * d, 0.0), ref_lse(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    double m = -INFINITY;
    for (int p = 0; p < c.parts; ++p) m = std::max(m, double(lses[p][r]));
    if (m == -INFINITY) {
      ref_lse[r] = -INFINITY;
      continue;
    }
    double total = 0;
    std::vector<double> w(c.parts);
    for (int p = 0; p < c.parts; ++p) total += w[p] = std::exp(double(lses[p][r]) - m);
    const int n = int(r % N), h = int((r / N) % H), b = int(r / N / H);
    for (int x = 0; x < d; ++x) {
      double o = 0;
      for (int p = 0; p < c.parts; ++p)
        if (w[p] > 0) o += w[p] * qattn::test::from_bits16(parts[p][at(b, h, n) + x], c.bf16);
      ref_o[r * d + x] = o / total;
    }
    ref_lse[r] = m + std::log(total);
  }

  constexpr std::size_t kGuard = 64;  // floats after acc and acc_lse
  std::vector<DeviceBuffer<uint16_t>*> dparts;
  std::vector<DeviceBuffer<float>*> dlses;
  for (int p = 0; p < c.parts; ++p) {
    dparts.push_back(new DeviceBuffer<uint16_t>(elems));
    dparts.back()->upload(parts[p]);
    dlses.push_back(new DeviceBuffer<float>(rows));
    dlses.back()->upload(lses[p]);
  }
  DeviceBuffer<float> acc(rows * d + kGuard), acc_lse(rows + kGuard);
  const std::vector<float> nan_fill(rows * d + kGuard, std::numeric_limits<float>::quiet_NaN());
  acc.upload(nan_fill);
  acc_lse.upload(std::vector<float>(rows + kGuard, std::numeric_limits<float>::quiet_NaN()));
  DeviceBuffer<uint16_t> out(elems);
  out.upload(std::vector<uint16_t>(elems, 0xFFFF));
  for (int p = 0; p < c.parts; ++p) {
    qattn_merge_params mp;
    qattn_merge_params_init(&mp);
    mp.dtype = c.bf16 ? QATTN_DTYPE_BF16 : QATTN_DTYPE_FP16;
    mp.batch = B;
    mp.heads = H;
    mp.seqlen = N;
    mp.head_dim = d;
    mp.first = p == 0;
    mp.part = {dparts[p]->ptr, sb, sh, sn};
    mp.part_lse = dlses[p]->ptr;
    mp.acc = acc.ptr;
    mp.acc_lse = acc_lse.ptr;
    if (p == c.parts - 1) mp.out = {out.ptr, sb, sh, sn};
    ASSERT_EQ(qattn_merge(&mp, nullptr), QATTN_OK) << qattn_last_error_message();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = acc.download();
  const auto got_lse = acc_lse.download();
  const auto got_out = out.download();
  for (std::size_t i = rows * d; i < rows * d + kGuard; ++i) ASSERT_TRUE(std::isnan(got[i])) << "write past acc";
  for (std::size_t i = rows; i < rows + kGuard; ++i) ASSERT_TRUE(std::isnan(got_lse[i])) << "write past acc_lse";
  for (std::size_t r = 0; r < rows; ++r) {
    const int n = int(r % N), h = int((r / N) % H), b = int(r / N / H);
    if (std::isinf(ref_lse[r])) {
      ASSERT_TRUE(std::isinf(got_lse[r]) && got_lse[r] < 0) << "row " << r;
    } else {
      ASSERT_LE(std::abs(got_lse[r] - ref_lse[r]), 1e-5 * (1 + std::abs(ref_lse[r]))) << "row " << r;
    }
    for (int x = 0; x < d; ++x) {
      const double want = ref_o[r * d + x];
      ASSERT_LE(std::abs(got[r * d + x] - want), 1e-5 * (1 + std::abs(want))) << "row " << r << " ch " << x;
      ASSERT_EQ(got_out[at(b, h, n) + x], qattn::test::to_bits16(got[r * d + x], c.bf16))
          << "out is acc rounded: row " << r << " ch " << x;
    }
    for (int x = d; x < row; ++x) ASSERT_EQ(got_out[at(b, h, n) + x], 0xFFFF) << "write past head_dim";
  }
  for (auto* p : dparts) delete p;
  for (auto* l : dlses) delete l;
}

TEST(Merge, ChainEqualsMergeOfAllParts) {
  QATTN_SKIP_WITHOUT_GPU();
  check_merge(MergeCase{});
  MergeCase c;
  c.bf16 = false;
  c.nhd = true;
  c.head_dim = 128;
  c.parts = 4;
  c.seed = 2;
  check_merge(c);
}

TEST(Merge, RandomShapes) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = qattn::test::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 6; ++i) {
    MergeCase c;
    c.batch = 1 + int(rng() % 3);
    c.heads = 1 + int(rng() % 5);
    c.seqlen = 1 + int(rng() % 300);
    c.head_dim = 1 + int(rng() % 256);
    c.parts = 1 + int(rng() % 5);
    c.bf16 = rng() % 2;
    c.nhd = rng() % 2;
    c.seed = rng();
    check_merge(c);
  }
}

}  // namespace
