// Device unit tests of the hopper/ PTX layer on its own: TMA loads with 128B swizzle
// into shared memory, mbarrier completion, one wgmma of each kind the attention kernel
// uses (checked against an exact CPU product), bulk copies, a barrier phase that needs
// both bytes and an arrival, and a TMA store clipped to its tensor.
#include <cuda.h>

#include <random>
#include <vector>

#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tensor_map.h"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "gpu_util.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"

namespace {

using namespace qattn;
constexpr int kM = 64, kN = 128, kK = 128;  // one warpgroup, 4 k32 steps

struct alignas(1024) Smem {
  uint8_t a[kM * kK];
  uint8_t b[kN * kK];
  uint64_t bar;
};

// One mbarrier expecting one arrival (thread 0's arrive.expect_tx), visible to the block.
__device__ void init_barrier(uint64_t* bar) {
  if (threadIdx.x == 0) {
    hopper::mbarrier_init(bar, 1);
    hopper::fence_barrier_init();
  }
  __syncthreads();
}

// D = A(64 x 128 s8) * B(128 x 128 s8)ᵀ with both operands TMA-loaded (SW128).
__global__ void s8_gemm_kernel(const __grid_constant__ CUtensorMap ta,
                               const __grid_constant__ CUtensorMap tb, int32_t* out) {
  __shared__ Smem s;
  init_barrier(&s.bar);
  if (threadIdx.x == 0) {
    hopper::mbarrier_arrive_expect_tx(&s.bar, sizeof(s.a) + sizeof(s.b));
    hopper::tma_load_3d(s.a, &ta, &s.bar, 0, 0, 0, hopper::policy_evict_first());
    hopper::tma_load_3d(s.b, &tb, &s.bar, 0, 0, 0, hopper::policy_evict_first());
  }
  hopper::mbarrier_wait(&s.bar, 0);
  int32_t d[64];
  hopper::wgmma_fence();
  const auto da = hopper::make_smem_desc<hopper::Swizzle::k128B>(s.a);
  const auto db = hopper::make_smem_desc<hopper::Swizzle::k128B>(s.b);
  hopper::wgmma_m64n128k32_s8_ss_init(d, da, db);
#pragma unroll
  for (int kk = 1; kk < kK / 32; ++kk)
    hopper::wgmma_m64n128k32_s8_ss(d, hopper::desc_advance(da, kk * 32),
                                   hopper::desc_advance(db, kk * 32));
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(d);
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = warp * 16 + g + ((i % 4) >= 2 ? 8 : 0), col = 8 * (i / 4) + 2 * t + (i % 2);
    out[row * kN + col] = d[i];
  }
}

// D = P(64 x 128 e4m3, registers, packed as the attention kernel packs it) * [Vᵀ; ones],
// Vᵀ stored (128 channels x 128 tokens) with tokens permuted in groups of 16 and followed
// by 8 rows of E4M3 ones, as in the attention kernel's V stages: N = 136, and the last 8
// columns of D are P's row sums.
constexpr int kNOnes = kN + 8;
struct alignas(1024) SmemPv {
  uint8_t b[kNOnes * kK];
  uint64_t bar;
};
__global__ void e4m3_gemm_kernel(const __grid_constant__ CUtensorMap tv, const uint8_t* p_rowmajor,
                                 float* out) {
  __shared__ SmemPv s;
  for (int i = threadIdx.x; i < 8 * kK / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(s.b + kN * kK)[i] = 0x38383838u;  // E4M3 1.0
  hopper::fence_proxy_async();
  init_barrier(&s.bar);
  if (threadIdx.x == 0) {
    hopper::mbarrier_arrive_expect_tx(&s.bar, kN * kK);
    hopper::tma_load_3d(s.b, &tv, &s.bar, 0, 0, 0, hopper::policy_evict_first());
  }
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  // The thread's own accumulator-layout columns of P, as in sage2_fwd/softmax.cuh.
  uint32_t a[4][4];
  for (int kk = 0; kk < 4; ++kk)
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
        uint32_t w = 0;
        const int cols[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
        for (int j = 0; j < 4; ++j)
          w |= static_cast<uint32_t>(p_rowmajor[row * kK + kk * 32 + half * 16 + cols[j]])
               << (8 * j);
        a[kk][half * 2 + r] = w;
      }
  hopper::mbarrier_wait(&s.bar, 0);
  float d[68];
  hopper::wgmma_fence();
  const auto db = hopper::make_smem_desc<hopper::Swizzle::k128B>(s.b);
  hopper::wgmma_m64n136k32_e4m3_rs_init(d, a[0], db);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk)
    hopper::wgmma_m64n136k32_e4m3_rs(d, a[kk], hopper::desc_advance(db, kk * 32));
  hopper::wgmma_commit();
  hopper::wgmma_wait<0>();
  hopper::fence_operands(d);
#pragma unroll
  for (int i = 0; i < 68; ++i) {
    const int row = warp * 16 + g + ((i % 4) >= 2 ? 8 : 0), col = 8 * (i / 4) + 2 * t + (i % 2);
    out[row * kNOnes + col] = d[i];
  }
}

TEST(HopperPrimitives, TmaSwizzledS8WgmmaMatchesCpu) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-127, 127);
  std::vector<int8_t> a(kM * kK), b(kN * kK);
  for (auto& x : a) x = static_cast<int8_t>(dist(rng));
  for (auto& x : b) x = static_cast<int8_t>(dist(rng));
  test::DeviceBuffer<int8_t> da(a.size()), db(b.size());
  test::DeviceBuffer<int32_t> dout(kM * kN);
  da.upload(a);
  db.upload(b);
  CUtensorMap ta, tb;
  QATTN_CUDA_OK(
      hopper::make_tensor_map_u8_3d(&ta, da.ptr, kK, kM, 1, kK, kM, hopper::Swizzle::k128B));
  QATTN_CUDA_OK(
      hopper::make_tensor_map_u8_3d(&tb, db.ptr, kK, kN, 1, kK, kN, hopper::Swizzle::k128B));
  s8_gemm_kernel<<<1, 128>>>(ta, tb, dout.ptr);
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto out = dout.download();
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < kN; ++n) {
      int32_t ref = 0;
      for (int k = 0; k < kK; ++k) ref += int32_t{a[m * kK + k]} * int32_t{b[n * kK + k]};
      ASSERT_EQ(out[m * kN + n], ref) << "m=" << m << " n=" << n << " seed=" << seed;
    }
}

TEST(HopperPrimitives, RegisterE4m3WgmmaWithPermutedVtMatchesCpu) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(0.f, 448.f);
  std::normal_distribution<float> normal(0.f, 100.f);
  std::vector<uint8_t> p(kM * kK), vt(kN * kK);  // P row-major (token order), Vᵀ permuted
  std::vector<float> pf(kM * kK), vf(kK * kN);   // decoded, token order
  for (int i = 0; i < kM * kK; ++i) {
    p[i] = numerics::e4m3_encode(unit(rng));
    pf[i] = numerics::e4m3_decode(p[i]);
  }
  for (int c = 0; c < kN; ++c)
    for (int pos = 0; pos < kK; ++pos) {
      const uint8_t code = numerics::e4m3_encode(normal(rng));
      vt[c * kK + pos] = code;
      vf[groups::v_token_at_position(pos) * kN + c] = numerics::e4m3_decode(code);
    }
  test::DeviceBuffer<uint8_t> dp(p.size()), dv(vt.size());
  test::DeviceBuffer<float> dout(kM * kNOnes);
  dp.upload(p);
  dv.upload(vt);
  CUtensorMap tv;
  QATTN_CUDA_OK(
      hopper::make_tensor_map_u8_3d(&tv, dv.ptr, kK, kN, 1, kK, kN, hopper::Swizzle::k128B));
  e4m3_gemm_kernel<<<1, 128>>>(tv, dp.ptr, dout.ptr);
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto out = dout.download();
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < kN; ++n) {
      double ref = 0, mag = 0;
      for (int k = 0; k < kK; ++k) {
        ref += double{pf[m * kK + k]} * vf[k * kN + n];
        mag += std::abs(double{pf[m * kK + k]} * vf[k * kN + n]);
      }
      // The FP8 MMA accumulates with ~13 mantissa bits (SageAttention2 §3.4).
      ASSERT_NEAR(out[m * kNOnes + n], ref, mag * 1e-3 + 1e-3)
          << "m=" << m << " n=" << n << " seed=" << seed;
    }
  for (int m = 0; m < kM; ++m) {  // the ones columns: row sums of P
    double sum = 0;
    for (int k = 0; k < kK; ++k) sum += pf[m * kK + k];
    for (int n = kN; n < kNOnes; ++n)
      ASSERT_NEAR(out[m * kNOnes + n], sum, sum * 1e-3)
          << "m=" << m << " n=" << n << " seed=" << seed;
  }
}

// Two bulk copies (16 bytes and 1 KiB, at 16-byte offsets) completing on one mbarrier,
// read back from shared memory; as the attention kernel loads its scales.
__global__ void bulk_load_kernel(const float* src, float* out) {
  __shared__ alignas(16) float buf[4 + 256];
  __shared__ uint64_t bar;
  init_barrier(&bar);
  if (threadIdx.x == 0) {
    hopper::mbarrier_arrive_expect_tx(&bar, sizeof(buf));
    hopper::bulk_load(buf, src + 4, 16, &bar);
    hopper::bulk_load(buf + 4, src + 12, 1024, &bar);
  }
  hopper::mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < 4 + 256; i += blockDim.x) out[i] = buf[i];
}

TEST(HopperPrimitives, BulkLoadsCompleteOnOneBarrier) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> src(12 + 256);
  for (auto& x : src) x = normal(rng);
  test::DeviceBuffer<float> dsrc(src.size()), dout(4 + 256);
  dsrc.upload(src);
  bulk_load_kernel<<<1, 128>>>(dsrc.ptr, dout.ptr);
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto out = dout.download();
  for (int i = 0; i < 4; ++i) ASSERT_EQ(out[i], src[4 + i]) << "i=" << i << " seed=" << seed;
  for (int i = 0; i < 256; ++i) ASSERT_EQ(out[4 + i], src[12 + i]) << "i=" << i << " seed=" << seed;
}

// mbarrier_expect_tx adds bytes to the phase without arriving: the copy's bytes alone do
// not complete it, the pending arrival does (as the attention kernel's first Q load,
// whose slot must not open before the Q loader has written the item). Reports whether
// the phase was still open after the bytes had landed, then waits for it normally.
__global__ void expect_tx_kernel(const float* src, float* out, int* open_after_bytes) {
  __shared__ alignas(16) float buf[256];
  __shared__ uint64_t bar;
  init_barrier(&bar);
  if (threadIdx.x == 0) {
    hopper::mbarrier_expect_tx(&bar, sizeof(buf));
    hopper::bulk_load(buf, src, sizeof(buf), &bar);
    // ~50 µs at 2 GHz: the 1 KiB copy has long landed.
    const long long t0 = clock64();
    while (clock64() - t0 < 100000) {
    }
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], 0;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(hopper::smem_addr(&bar))
        : "memory");
    *open_after_bytes = done == 0;
    hopper::mbarrier_arrive(&bar);  // the one expected arrival
  }
  hopper::mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) out[i] = buf[i];
}

TEST(HopperPrimitives, ExpectTxWithoutArrivalWaitsForTheArrival) {
  QATTN_SKIP_WITHOUT_GPU();
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> src(256);
  for (auto& x : src) x = normal(rng);
  test::DeviceBuffer<float> dsrc(src.size()), dout(256);
  test::DeviceBuffer<int> dopen(1);
  dsrc.upload(src);
  dopen.upload(std::vector<int>{-1});
  expect_tx_kernel<<<1, 128>>>(dsrc.ptr, dout.ptr, dopen.ptr);
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dopen.download()[0], 1) << "the bytes alone completed the phase";
  const auto out = dout.download();
  for (int i = 0; i < 256; ++i) ASSERT_EQ(out[i], src[i]) << "i=" << i << " seed=" << seed;
}

// A 64 × 64 box of 16-bit values staged with the 128B swizzle (16-byte chunk c of row r at
// chunk c ^ (r % 8)), stored by TMA at row 64 of head 1 of a (1, 2, 100, 40) tensor
// whose rows are 48 elements apart: rows 64..99 and columns 0..39 are written, the rest
// of the box is clipped, and nothing else (head 0, rows < 64, the guard columns 40..47)
// is touched. As the attention kernel writes O.
constexpr int kStoreCols = 40, kStoreRowStride = 48, kStoreRows = 100, kStoreHeads = 2;
constexpr int kStoreRow0 = 64;

__device__ __host__ inline uint16_t store_pattern(int r, int c) {
  return static_cast<uint16_t>(r * 64 + c + 1);
}

__global__ void tma_store_kernel(const __grid_constant__ CUtensorMap map) {
  __shared__ alignas(1024) uint8_t box[64 * 128];
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    const int r = i / 64, c = i % 64;
    *reinterpret_cast<uint16_t*>(box + r * 128 + ((c / 8) ^ (r % 8)) * 16 + (c % 8) * 2) =
        store_pattern(r, c);
  }
  hopper::fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    hopper::tma_store_4d(&map, box, 0, kStoreRow0, 1, 0);
    hopper::bulk_commit_group();
    hopper::bulk_wait_group_read<0>();
  }
}

TEST(HopperPrimitives, TmaStoreWritesOnlyInsideTheTensor) {
  QATTN_SKIP_WITHOUT_GPU();
  constexpr uint16_t kPoison = 0xFFFF;
  const std::size_t n = static_cast<std::size_t>(kStoreHeads) * kStoreRows * kStoreRowStride;
  test::DeviceBuffer<uint16_t> d(n);
  d.upload(std::vector<uint16_t>(n, kPoison));
  CUtensorMap map;
  const uint64_t dims[4] = {kStoreCols, kStoreRows, kStoreHeads, 1};
  const uint64_t strides[3] = {kStoreRowStride, uint64_t{kStoreRows} * kStoreRowStride,
                               uint64_t{kStoreHeads} * kStoreRows * kStoreRowStride};
  QATTN_CUDA_OK(hopper::make_tensor_map_16bit_4d(&map, d.ptr, dims, strides, 64, 64));
  tma_store_kernel<<<1, 128>>>(map);
  QATTN_CUDA_OK(cudaDeviceSynchronize());
  const auto out = d.download();
  for (int h = 0; h < kStoreHeads; ++h)
    for (int r = 0; r < kStoreRows; ++r)
      for (int c = 0; c < kStoreRowStride; ++c) {
        const bool inside = h == 1 && r >= kStoreRow0 && c < kStoreCols;
        const uint16_t want = inside ? store_pattern(r - kStoreRow0, c) : kPoison;
        ASSERT_EQ(out[(static_cast<std::size_t>(h) * kStoreRows + r) * kStoreRowStride + c], want)
            << "head " << h << " row " << r << " col " << c;
      }
}

}  // namespace
