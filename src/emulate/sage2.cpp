#include "emulate/sage2.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

#include "emulate/pv_tile.h"
#include "numerics/additive_mask.h"
#include "numerics/formats.h"
#include "numerics/hadamard.h"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"
#include "numerics/quantize.h"

// NOTE: the contract promises FP32 results without FMA contraction; x86-64 without
// -mfma has no FMA instruction, and this keeps it so on targets that do.
#pragma GCC optimize("fp-contract=off")

namespace qattn::emulate {
namespace {

using detail::kNegInf;
constexpr int kPadMultiple = 128;  // Nq_pad, Nkv_pad: one KV tile / two Q blocks
constexpr int kKvTile = groups::kKvTile;
constexpr int kQBlock = groups::kQBlock;

int round_up(int x, int m) { return (x + m - 1) / m * m; }

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("sage2: " + what); }

bool is_qk_granularity(Granularity g) {
  return g == Granularity::PerTensor || g == Granularity::PerBlock || g == Granularity::PerWarp ||
         g == Granularity::PerThread || g == Granularity::PerToken;
}

void validate_options(const Sage2Options& o, const Tensor4& k) {
  switch (o.qk_format) {
    case QkFormat::Int8:
    case QkFormat::Int4:
    case QkFormat::Fp32:
    case QkFormat::Fp16:
    case QkFormat::Bf16:
      break;
    default:
      fail("options.qk_format: expected Int8, Int4, Fp32, Fp16 or Bf16");
  }
  if (!is_qk_granularity(o.granularity)) {
    fail("options.granularity: expected PerTensor, PerBlock, PerWarp, PerThread or PerToken");
  }
  if (static_cast<int>(o.k_smoothing) < 0 ||
      static_cast<int>(o.k_smoothing) > static_cast<int>(KSmoothing::Given)) {
    fail("options.k_smoothing: expected None, Mean, SampledMean or Given");
  }
  if (o.k_smoothing == KSmoothing::Given &&
      o.k_mean.size() != static_cast<std::size_t>(k.b) * k.h * k.d) {
    fail("options.k_mean: KSmoothing::Given needs B*Hkv*d = " +
         std::to_string(static_cast<std::size_t>(k.b) * k.h * k.d) + " values, got " +
         std::to_string(o.k_mean.size()));
  }
  if (o.qk_rotation != QkRotation::None && o.qk_rotation != QkRotation::Hadamard) {
    fail("options.qk_rotation: expected None or Hadamard");
  }
  if (o.qk_rotation == QkRotation::Hadamard &&
      !numerics::is_power_of_two(sage2_padded_head_dim(k.d))) {
    fail("options.qk_rotation: Hadamard needs the padded head dim a power of two, got " +
         std::to_string(sage2_padded_head_dim(k.d)));
  }
  if (o.q_smoothing != QSmoothing::None && o.q_smoothing != QSmoothing::BlockMean) {
    fail("options.q_smoothing: expected None or BlockMean");
  }
  if (static_cast<int>(o.pv_format) < 0 ||
      static_cast<int>(o.pv_format) > static_cast<int>(PvFormat::Fp32)) {
    fail("options.pv_format: expected E4M3, E5M2, Int8, Fp16, Bf16 or Fp32");
  }
  if (o.v_format && (static_cast<int>(*o.v_format) < 0 ||
                     static_cast<int>(*o.v_format) > static_cast<int>(PvFormat::Fp32))) {
    fail("options.v_format: expected empty, E4M3, E5M2, Int8, Fp16, Bf16 or Fp32");
  }
  if (o.v_scale != Granularity::PerTileChannel && o.v_scale != Granularity::PerChannel &&
      o.v_scale != Granularity::PerBlock && o.v_scale != Granularity::PerTensor) {
    fail("options.v_scale: expected PerChannel, PerTileChannel, PerBlock or PerTensor");
  }
  if (o.v_amax != VAmax::AllTokens && o.v_amax != VAmax::SampleBound) {
    fail("options.v_amax: expected AllTokens or SampleBound");
  }
  if (o.accumulator != Fp8Accumulator::Fp32 && o.accumulator != Fp8Accumulator::Fp22) {
    fail("options.accumulator: expected Fp32 or Fp22");
  }
  if (o.softmax_keys <= 0 || groups::kKvTile % o.softmax_keys != 0)
    fail("options.softmax_keys: expected a divisor of 128, got " + std::to_string(o.softmax_keys));
  if (o.fp22_keys <= 0 || 32 % o.fp22_keys != 0 || o.softmax_keys % o.fp22_keys != 0)
    fail("options.fp22_keys: expected a divisor of 32 and of softmax_keys, got " +
         std::to_string(o.fp22_keys));
  if (o.head_dim_padded != 0 &&
      (o.head_dim_padded < k.d || o.head_dim_padded % 64 != 0 || o.head_dim_padded > 256))
    fail("options.head_dim_padded: expected 0, or a multiple of 64 in [d, 256], got " +
         std::to_string(o.head_dim_padded));
  if (o.levels != AccumulationLevels::TwoLevel && o.levels != AccumulationLevels::Single) {
    fail("options.levels: expected TwoLevel or Single");
  }
  // Single accumulation sums the tiles' raw V codes in O, scaled once at the end: V's
  // scale must be the same in every tile.
  if (o.levels == AccumulationLevels::Single && o.v_scale != Granularity::PerChannel &&
      o.v_scale != Granularity::PerTensor) {
    fail("options.levels: Single needs v_scale PerChannel or PerTensor (one scale for every tile)");
  }
}

// Step 1: the smoothing vector c of every (batch, KV head), FP32 (numerics::token_mean
// sums in double).
void smoothing_vector(const Tensor4& k, const Sage2Quantized& z, const Sage2Options& o, int D,
                      std::vector<float>& c_out) {
  const int d = k.d;
  c_out.assign(static_cast<std::size_t>(k.b) * k.h * D, 0.0f);
  if (o.k_smoothing == KSmoothing::None) return;
  const auto estimate = o.k_smoothing == KSmoothing::SampledMean
                            ? numerics::MeanEstimate::Sampled
                            : numerics::MeanEstimate::AllTokens;
  for (int b = 0; b < k.b; ++b)
    for (int h = 0; h < k.h; ++h) {
      float* c = c_out.data() + (static_cast<std::size_t>(b) * k.h + h) * D;
      if (o.k_smoothing == KSmoothing::Given) {
        std::copy_n(o.k_mean.data() + (static_cast<std::size_t>(b) * k.h + h) * d, d, c);
        continue;
      }
      const int nkv = z.keys_of(b);  // key padding: the mean of the valid keys
      if (nkv == 0) continue;         // no key: c = 0
      const std::vector<float> mean = numerics::token_mean(
          std::span<const float>(k.row(b, h, 0), static_cast<std::size_t>(nkv) * d), nkv, d,
          estimate);
      std::copy(mean.begin(), mean.end(), c);
    }
}

}  // namespace

int Sage2Quantized::keys_of(int b) const { return key_rule(b).kv_len; }

numerics::KeyRule Sage2Quantized::key_rule(int b) const {
  return numerics::make_key_rule(seqlen_q, seqlen_kv, mask == Mask::Causal,
                                 alignment == Diagonal::TopLeft, window_left, window_right,
                                 kv_lengths.empty() ? seqlen_kv : kv_lengths[b]);
}

int sage2_padded_head_dim(int d) {
  if (d <= 64) return 64;
  if (d <= 128) return 128;
  return round_up(d, 64);
}

Sage2Quantized quantize_sage2(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                              const AttentionParams& params, const Sage2Options& options) {
  const double sm = validate_attention_args("quantize_sage2", q, k, v, params);
  validate_options(options, k);
  Sage2Quantized z;
  const int B = q.b, Hq = q.h, Hkv = k.h, Nq = q.n, Nkv = k.n, d = q.d;
  const int D = options.head_dim_padded > 0 ? options.head_dim_padded : sage2_padded_head_dim(d);
  const int nq_pad = round_up(Nq, kPadMultiple), nkv_pad = round_up(Nkv, kPadMultiple);
  z.batch = B, z.heads_q = Hq, z.heads_kv = Hkv, z.seqlen_q = Nq, z.seqlen_kv = Nkv;
  z.head_dim = d, z.head_dim_padded = D, z.nq_pad = nq_pad, z.nkv_pad = nkv_pad;
  const int dv = v.d;
  const int Dv = options.head_dim_padded > 0 && dv == d ? D : sage2_padded_head_dim(dv);
  z.head_dim_v = dv, z.head_dim_v_padded = Dv;
  z.sm_scale = static_cast<float>(sm);
  z.scale_log2 = z.sm_scale * detail::kLog2e;
  z.mask = params.mask;
  z.alignment = params.alignment;
  z.window_left = params.window_left;
  z.window_right = params.window_right;
  z.kv_lengths = params.kv_lengths;
  z.attn_mask = params.attn_mask;
  z.options = options;
  const Granularity gran = options.granularity;
  const bool int_qk = options.qk_format == QkFormat::Int8 || options.qk_format == QkFormat::Int4;
  // The float Q·Kᵀ formats: the operands' rounding (none for Fp32).
  float (*round_qk)(float) = options.qk_format == QkFormat::Fp16   ? numerics::fp16_round
                             : options.qk_format == QkFormat::Bf16 ? numerics::bf16_round
                                                                   : detail::identity;
  const numerics::IntFormat fmt =
      options.qk_format == QkFormat::Int4 ? numerics::IntFormat::Int4 : numerics::IntFormat::Int8;
  const std::size_t bhq = static_cast<std::size_t>(B) * Hq, bhk = static_cast<std::size_t>(B) * Hkv;
  const std::size_t tiles = static_cast<std::size_t>(nkv_pad) / kKvTile;
  const std::size_t qblocks = static_cast<std::size_t>(nq_pad) / kQBlock;
  const int rep = Hq / Hkv;

  // ---- 1. smoothing vector c ----
  smoothing_vector(k, z, options, D, z.k_mean);

  // ---- 2. K: ks = k - c, per-group INT8/INT4 ----
  // The whole padded tensor is one (B·Hkv·Nkv_pad) x D matrix: Nkv_pad is a multiple
  // of the KV tile, so every group of numerics::GroupMap stays inside one head, and
  // PerTensor spans every head. Zero tails enter no amax; all-zero groups get scale 0.
  std::vector<float> ks(bhk * nkv_pad * D, 0.0f);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      const std::size_t bh = static_cast<std::size_t>(b) * Hkv + h;
      const float* c = z.k_mean.data() + bh * D;
      for (int j = 0; j < z.keys_of(b); ++j)  // padding keys stay 0, as tails do
        for (int ch = 0; ch < d; ++ch) ks[(bh * nkv_pad + j) * D + ch] = k.at(b, h, j, ch) - c[ch];
    }
  // What K's quantization sees: ks, or ks rotated (ks itself stays unrotated for Q
  // smoothing's q̄·(k_j - c) below, q̄ being unrotated).
  std::vector<float> ks_rotated;
  if (options.qk_rotation == QkRotation::Hadamard) {
    ks_rotated = ks;
    for (std::size_t r = 0; r < bhk * nkv_pad; ++r)
      numerics::hadamard_rotate(ks_rotated.data() + r * D, D, false);  // zero rows stay zero
  }
  const std::vector<float>& ks_quantized = ks_rotated.empty() ? ks : ks_rotated;
  if (int_qk) {
    numerics::IntQuantized kq = numerics::quantize_int(
        ks_quantized, static_cast<int64_t>(bhk) * nkv_pad, D, fmt, gran, numerics::Operand::K);
    z.k_i8 = std::move(kq.values);
    z.k_token_scale.resize(bhk * nkv_pad);
    for (std::size_t t = 0; t < z.k_token_scale.size(); ++t) {
      z.k_token_scale[t] = kq.scale_at(static_cast<int64_t>(t), 0);
    }
    if (gran != Granularity::PerToken) {
      const std::size_t per_head = tiles * groups::kKThreadGroupsPerTile;
      z.k_scale.assign(bhk * per_head, 0.0f);
      for (std::size_t bh = 0; bh < bhk; ++bh)
        for (int j = 0; j < nkv_pad; ++j) {
          const std::size_t slot =
              (j / kKvTile) * groups::kKThreadGroupsPerTile + groups::k_thread_group_in_tile(j);
          z.k_scale[bh * per_head + slot] = z.k_token_scale[bh * nkv_pad + j];
        }
    }
  } else {
    z.k_f32 = ks_quantized;
    for (float& x : z.k_f32) x = round_qk(x);
    z.k_token_scale.assign(bhk * nkv_pad, 1.0f);
  }

  // ---- 3. Q (optionally minus its block mean), per-group INT8/INT4, and q·c ----
  std::vector<float> qs(bhq * nq_pad * D, 0.0f);
  z.q_dot_c.assign(bhq * nq_pad, 0.0f);
  const bool q_smooth = options.q_smoothing == QSmoothing::BlockMean;
  if (q_smooth) z.q_mean.assign(bhq * qblocks * D, 0.0f);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const std::size_t bh = static_cast<std::size_t>(b) * Hq + h;
      const float* c = z.k_mean.data() + (static_cast<std::size_t>(b) * Hkv + h / rep) * D;
      for (int i = 0; i < Nq; ++i) {
        float dot = 0.0f;  // sequential FP32 sum: the kernel sums in another order
        for (int ch = 0; ch < d; ++ch) dot += q.at(b, h, i, ch) * c[ch];
        z.q_dot_c[bh * nq_pad + i] = z.sm_scale * dot;
      }
      for (std::size_t blk = 0; blk < qblocks; ++blk) {
        const int r0 = static_cast<int>(blk) * kQBlock, r1 = std::min(Nq, r0 + kQBlock);
        float* qbar = q_smooth ? z.q_mean.data() + (bh * qblocks + blk) * D : nullptr;
        if (qbar != nullptr && r1 > r0) {
          const std::vector<float> mean = numerics::token_mean(
              std::span<const float>(q.row(b, h, r0), static_cast<std::size_t>(r1 - r0) * d),
              r1 - r0, d, numerics::MeanEstimate::AllTokens);
          std::copy(mean.begin(), mean.end(), qbar);
        }
        for (int i = r0; i < r1; ++i) {
          float* row = qs.data() + (bh * nq_pad + i) * D;
          for (int ch = 0; ch < d; ++ch) row[ch] = q.at(b, h, i, ch) - (qbar ? qbar[ch] : 0.0f);
          if (options.qk_rotation == QkRotation::Hadamard) numerics::hadamard_rotate(row, D, true);
        }
      }
    }
  if (int_qk) {
    // As for K: Nq_pad is a multiple of the Q block, so groups stay inside one head.
    numerics::IntQuantized qq = numerics::quantize_int(qs, static_cast<int64_t>(bhq) * nq_pad, D,
                                                       fmt, gran, numerics::Operand::Q);
    z.q_i8 = std::move(qq.values);
    z.q_row_scale.resize(bhq * nq_pad);
    for (std::size_t r = 0; r < z.q_row_scale.size(); ++r) {
      z.q_row_scale[r] = qq.scale_at(static_cast<int64_t>(r), 0) * z.scale_log2;
    }
    if (gran != Granularity::PerToken) {
      const std::size_t per_head = qblocks * groups::kQThreadGroupsPerBlock;
      z.q_scale.assign(bhq * per_head, 0.0f);
      for (std::size_t bh = 0; bh < bhq; ++bh)
        for (int r = 0; r < nq_pad; ++r) {
          const std::size_t slot =
              (r / kQBlock) * groups::kQThreadGroupsPerBlock + groups::q_thread_group_in_block(r);
          z.q_scale[bh * per_head + slot] = z.q_row_scale[bh * nq_pad + r];
        }
    }
  } else {
    z.q_f32 = qs;
    for (float& x : z.q_f32) x = round_qk(x);
    z.q_row_scale.assign(bhq * nq_pad, z.scale_log2);
  }
  // The high-precision half of Q smoothing: scale_log2 · q̄·(k_j - c), in double, from
  // the unrotated ks.
  if (q_smooth) {
    z.q_mean_k.assign(bhq * qblocks * nkv_pad, 0.0f);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hq; ++h) {
        const std::size_t bh = static_cast<std::size_t>(b) * Hq + h;
        const std::size_t bk = static_cast<std::size_t>(b) * Hkv + h / rep;
        for (std::size_t blk = 0; blk < qblocks; ++blk) {
          const float* qbar = z.q_mean.data() + (bh * qblocks + blk) * D;
          for (int j = 0; j < Nkv; ++j) {
            const float* kj = ks.data() + (bk * nkv_pad + j) * D;
            double s = 0.0;
            for (int ch = 0; ch < d; ++ch) s += static_cast<double>(qbar[ch]) * kj[ch];
            z.q_mean_k[(bh * qblocks + blk) * nkv_pad + j] =
                static_cast<float>(static_cast<double>(z.scale_log2) * s);
          }
        }
      }
  }

  // ---- 4. V: per (tile, channel) or per channel scale; Vᵀ with permuted tokens ----
  const PvFormat pv = options.v_format.value_or(options.pv_format);
  const bool v8 = pv == PvFormat::E4M3 || pv == PvFormat::E5M2 || pv == PvFormat::Int8;
  z.v_value.assign(bhk * nkv_pad * Dv, 0.0f);
  z.v_scale.assign(bhk * tiles * Dv, 1.0f);
  if (v8) z.vt_f8.assign(bhk * Dv * nkv_pad, 0);
  std::vector<float> vh(static_cast<std::size_t>(nkv_pad) * Dv);
  std::vector<std::uint8_t> codes;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      const std::size_t bh = static_cast<std::size_t>(b) * Hkv + h;
      float* vv = z.v_value.data() + bh * nkv_pad * Dv;
      if (!v8) {
        float (*round16)(float) = pv == PvFormat::Fp16   ? numerics::fp16_round
                                  : pv == PvFormat::Bf16 ? numerics::bf16_round
                                                         : detail::identity;
        for (int j = 0; j < z.keys_of(b); ++j)
          for (int ch = 0; ch < dv; ++ch) vv[j * Dv + ch] = round16(v.at(b, h, j, ch));
        continue;
      }
      // One head at a time: PerChannel must not span heads. Padding keys are zeros, as
      // tails are: they enter no amax.
      const int nkv_b = z.keys_of(b);
      std::fill(vh.begin(), vh.end(), 0.0f);
      for (int j = 0; j < nkv_b; ++j)
        for (int ch = 0; ch < dv; ++ch) vh[static_cast<std::size_t>(j) * Dv + ch] = v.at(b, h, j, ch);
      std::vector<float> scales;
      numerics::GroupMap map;
      // The kernel's per-channel amax: a bound from the token sample (padding rows and
      // channels are zeros, outside the sample and every amax). Floating-point formats
      // only: a scale up to 4x the amax costs INT8 (fixed point) two bits, E4M3 nothing.
      std::vector<float> amax;
      if (options.v_scale == Granularity::PerChannel && options.v_amax == VAmax::SampleBound &&
          pv != PvFormat::Int8 && nkv_b > 0)  // no key: the exact amax over zeros, 0
        amax = numerics::sampled_amax_bound(
            std::span<const float>(vh.data(), static_cast<std::size_t>(nkv_b) * Dv), nkv_b, Dv);
      if (pv == PvFormat::Int8) {
        numerics::IntQuantized vq = numerics::quantize_int(
            vh, nkv_pad, Dv, numerics::IntFormat::Int8, options.v_scale, numerics::Operand::K, amax);
        codes.assign(vq.values.begin(), vq.values.end());  // two's complement bytes
        for (std::size_t i = 0; i < codes.size(); ++i) vv[i] = vq.values[i];
        scales = std::move(vq.scales);
        map = vq.groups;
      } else {
        const auto f8 =
            pv == PvFormat::E4M3 ? numerics::Fp8Format::E4M3 : numerics::Fp8Format::E5M2;
        numerics::Fp8Quantized vq =
            numerics::quantize_fp8(vh, nkv_pad, Dv, f8, options.v_scale, numerics::Operand::K, amax);
        codes = std::move(vq.codes);
        for (std::size_t i = 0; i < codes.size(); ++i) {
          vv[i] = f8 == numerics::Fp8Format::E4M3 ? numerics::e4m3_decode(codes[i])
                                                  : numerics::e5m2_decode(codes[i]);
        }
        scales = std::move(vq.scales);
        map = vq.groups;
      }
      for (std::size_t t = 0; t < tiles; ++t)
        for (int ch = 0; ch < Dv; ++ch) {
          z.v_scale[(bh * tiles + t) * Dv + ch] =
              scales[map.group_of(static_cast<int64_t>(t) * kKvTile, ch)];
        }
      for (int ch = 0; ch < Dv; ++ch)
        for (int pos = 0; pos < nkv_pad; ++pos)
          z.vt_f8[(bh * Dv + ch) * nkv_pad + pos] =
              codes[static_cast<std::size_t>(groups::v_token_at_position(pos)) * Dv + ch];
    }
  return z;
}

Sage2Quantized quantize_sage2_8b(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                 const AttentionParams& params, const float* given_k_mean) {
  Sage2Options o;
  if (given_k_mean != nullptr) {
    o.k_smoothing = KSmoothing::Given;
    o.k_mean.assign(given_k_mean, given_k_mean + static_cast<std::size_t>(k.b) * k.h * k.d);
  }
  return quantize_sage2(q, k, v, params, o);
}

void sage2_views_from_workspace(Sage2Quantized& z) {
  const PvFormat vf = z.options.v_format.value_or(z.options.pv_format);
  const bool int_qk =
      z.options.qk_format == QkFormat::Int8 || z.options.qk_format == QkFormat::Int4;
  if (!int_qk || z.options.granularity == Granularity::PerToken) {
    fail("sage2_views_from_workspace: qz.options: needs INT8/INT4 Q·Kᵀ and a kernel granularity");
  }
  if (vf != PvFormat::E4M3 && vf != PvFormat::E5M2 && vf != PvFormat::Int8) {
    fail("sage2_views_from_workspace: qz.options: needs an 8-bit V format");
  }
  const std::size_t bhq = static_cast<std::size_t>(z.batch) * z.heads_q;
  const std::size_t bhk = static_cast<std::size_t>(z.batch) * z.heads_kv;
  if (z.head_dim_v_padded == 0) z.head_dim_v = z.head_dim, z.head_dim_v_padded = z.head_dim_padded;
  const std::size_t Dv = static_cast<std::size_t>(z.head_dim_v_padded);
  const std::size_t q_per_head = z.q_blocks() * groups::kQThreadGroupsPerBlock;
  const std::size_t k_per_head = z.kv_tiles() * groups::kKThreadGroupsPerTile;
  if (z.q_scale.size() != bhq * q_per_head)
    fail("sage2_views_from_workspace: qz.q_scale: wrong size");
  if (z.k_scale.size() != bhk * k_per_head)
    fail("sage2_views_from_workspace: qz.k_scale: wrong size");
  if (z.vt_f8.size() != bhk * Dv * z.nkv_pad)
    fail("sage2_views_from_workspace: qz.vt_f8: wrong size");
  z.q_row_scale.resize(bhq * z.nq_pad);
  for (std::size_t bh = 0; bh < bhq; ++bh)
    for (int r = 0; r < z.nq_pad; ++r) {
      const std::size_t slot =
          (r / kQBlock) * groups::kQThreadGroupsPerBlock + groups::q_thread_group_in_block(r);
      z.q_row_scale[bh * z.nq_pad + r] = z.q_scale[bh * q_per_head + slot];
    }
  z.k_token_scale.resize(bhk * z.nkv_pad);
  for (std::size_t bh = 0; bh < bhk; ++bh)
    for (int j = 0; j < z.nkv_pad; ++j) {
      const std::size_t slot =
          (j / kKvTile) * groups::kKThreadGroupsPerTile + groups::k_thread_group_in_tile(j);
      z.k_token_scale[bh * z.nkv_pad + j] = z.k_scale[bh * k_per_head + slot];
    }
  z.v_value.assign(bhk * z.nkv_pad * Dv, 0.0f);
  for (std::size_t bh = 0; bh < bhk; ++bh)
    for (std::size_t c = 0; c < Dv; ++c)
      for (int pos = 0; pos < z.nkv_pad; ++pos) {
        const std::uint8_t code = z.vt_f8[(bh * Dv + c) * z.nkv_pad + pos];
        const float val = vf == PvFormat::E4M3 ? numerics::e4m3_decode(code)
                          : vf == PvFormat::E5M2
                              ? numerics::e5m2_decode(code)
                              : static_cast<float>(static_cast<std::int8_t>(code));
        z.v_value[(bh * z.nkv_pad + groups::v_token_at_position(pos)) * Dv + c] = val;
      }
}

EmulatedForward sage2_attend(const Sage2Quantized& z) {
  const int B = z.batch, Hq = z.heads_q, Hkv = z.heads_kv, Nq = z.seqlen_q, Nkv = z.seqlen_kv;
  const int d = z.head_dim, D = z.head_dim_padded, nq_pad = z.nq_pad, nkv_pad = z.nkv_pad;
  // V's head dim (a Sage2Quantized filled by hand may leave it 0: Q·K's).
  const int dv = z.head_dim_v_padded > 0 ? z.head_dim_v : d;
  const int Dv = z.head_dim_v_padded > 0 ? z.head_dim_v_padded : D;
  const bool int_qk =
      z.options.qk_format == QkFormat::Int8 || z.options.qk_format == QkFormat::Int4;
  const bool q_smooth = z.options.q_smoothing == QSmoothing::BlockMean;
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || Nq <= 0 || Nkv <= 0 || d <= 0 || D < d ||
      dv <= 0 || Dv < dv ||
      nq_pad < Nq || nkv_pad < Nkv || nq_pad % kPadMultiple != 0 || nkv_pad % kPadMultiple != 0) {
    fail("sage2_attend: qz: inconsistent dimensions");
  }
  if (!z.kv_lengths.empty() && z.kv_lengths.size() != static_cast<std::size_t>(B))
    fail("sage2_attend: qz.kv_lengths: one length per batch entry, or none");
  if (z.window_left < -1 || z.window_right < -1)
    fail("sage2_attend: qz.window_left/window_right: must be >= -1");
  const bool has_mask = z.attn_mask.size() != 0;
  if (has_mask && ((z.attn_mask.b != 1 && z.attn_mask.b != B) ||
                   (z.attn_mask.h != 1 && z.attn_mask.h != Hq) || z.attn_mask.n != Nq ||
                   z.attn_mask.d != Nkv))
    fail("sage2_attend: qz.attn_mask: shape must be (1 or B, 1 or Hq, Nq, Nkv)");
  const std::size_t bhq = static_cast<std::size_t>(B) * Hq, bhk = static_cast<std::size_t>(B) * Hkv;
  const std::size_t tiles = z.kv_tiles(), qblocks = z.q_blocks();
  auto need = [](const auto& vec, std::size_t n, const char* name) {
    if (vec.size() != n) fail(std::string("sage2_attend: qz.") + name + ": wrong size");
  };
  if (int_qk) {
    need(z.q_i8, bhq * nq_pad * D, "q_i8");
    need(z.k_i8, bhk * nkv_pad * D, "k_i8");
  } else {
    need(z.q_f32, bhq * nq_pad * D, "q_f32");
    need(z.k_f32, bhk * nkv_pad * D, "k_f32");
  }
  need(z.q_row_scale, bhq * nq_pad, "q_row_scale");
  need(z.k_token_scale, bhk * nkv_pad, "k_token_scale");
  need(z.q_dot_c, bhq * nq_pad, "q_dot_c");
  need(z.v_value, bhk * nkv_pad * Dv, "v_value");
  need(z.v_scale, bhk * tiles * Dv, "v_scale");
  if (q_smooth) need(z.q_mean_k, bhq * qblocks * nkv_pad, "q_mean_k");

  const detail::PvSpec spec = detail::pv_spec(z.options.pv_format);
  EmulatedForward out{Tensor4(B, Hq, Nq, dv), std::vector<float>(bhq * Nq)};
  const int rep = Hq / Hkv;
  std::vector<float> x(kKvTile);
  detail::RowState st(Dv);
  const int tile_keys = z.options.softmax_keys;  // keys per online-softmax step
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const std::size_t bq = static_cast<std::size_t>(b) * Hq + h;
      const std::size_t bk = static_cast<std::size_t>(b) * Hkv + h / rep;
      const numerics::KeyRule rule = z.key_rule(b);
      for (int i = 0; i < Nq; ++i) {
        st.m = kNegInf;
        st.l = 0.0f;
        std::fill(st.o.begin(), st.o.end(), 0.0f);
        const std::size_t qr = bq * nq_pad + i;
        const float q_scale = z.q_row_scale[qr];
        const float* corr =
            q_smooth ? z.q_mean_k.data() + (bq * qblocks + i / kQBlock) * nkv_pad : nullptr;
        // The visible keys [first, last]; tiles outside them are skipped, as the kernel
        // does (a fully masked tile would leave m, l and O unchanged anyway).
        const numerics::KeyRange keys = rule.keys(i);
        const int first = keys.first, last = keys.last;
        for (int t = first / tile_keys; !keys.empty() && t * tile_keys <= last; ++t) {
          for (int jj = 0; jj < tile_keys; ++jj) {
            const int j = t * tile_keys + jj;
            if (j > last || j < first) {
              x[jj] = kNegInf;
              continue;
            }
            const std::size_t kr = bk * nkv_pad + j;
            float s;
            if (int_qk) {
              const std::int8_t* qa = z.q_i8.data() + qr * D;
              const std::int8_t* ka = z.k_i8.data() + kr * D;
              std::int32_t acc = 0;  // exact, as the INT8 MMA
              for (int c = 0; c < D; ++c) acc += static_cast<std::int32_t>(qa[c]) * ka[c];
              s = static_cast<float>(acc);
            } else {
              const float* qa = z.q_f32.data() + qr * D;
              const float* ka = z.k_f32.data() + kr * D;
              double acc = 0.0;
              for (int c = 0; c < D; ++c) acc += static_cast<double>(qa[c]) * ka[c];
              s = static_cast<float>(acc);
            }
            const float scale = q_scale * z.k_token_scale[kr];
            x[jj] = s * scale;
            if (corr != nullptr) x[jj] = x[jj] + corr[j];
            if (has_mask) {  // after the scale, in log2 units: a -inf hides the key
              const float add = z.attn_mask.at(z.attn_mask.b == 1 ? 0 : b,
                                               z.attn_mask.h == 1 ? 0 : h, i, j);
              x[jj] = add == kNegInf ? kNegInf : x[jj] + numerics::additive_log2(add);
            }
          }
          // V's scale is per 128-key tile (a 64-key step takes its tile's).
          const std::size_t v_tile = static_cast<std::size_t>(t * tile_keys / kKvTile);
          detail::online_softmax_tile(st, x, z.v_value.data() + (bk * nkv_pad + t * tile_keys) * Dv,
                                      tile_keys, Dv, z.v_scale.data() + (bk * tiles + v_tile) * Dv,
                                      spec, z.options.accumulator, z.options.levels,
                                      z.options.row_sum, z.options.fp22_keys);
        }
        float* orow = out.o.row(b, h, i);
        float& lse = out.lse[bq * Nq + i];
        if (st.m == kNegInf) {  // no visible key
          lse = kNegInf;
          continue;
        }
        // Single accumulation: O holds the tiles' sums over V's codes; V's scale (equal in
        // every tile, validated) applies once.
        const float* vs = z.options.levels == AccumulationLevels::Single
                              ? z.v_scale.data() + bk * tiles * Dv
                              : nullptr;
        for (int c = 0; c < dv; ++c) orow[c] = (vs != nullptr ? st.o[c] * vs[c] : st.o[c]) / st.l;
        lse = (st.m + std::log2(st.l / spec.p_mult)) * detail::kLn2 + z.q_dot_c[qr];
      }
    }
  return out;
}

Sage2Options sage2_wide_options(int fp22_keys) {
  Sage2Options o;
  o.softmax_keys = 64;
  o.levels = AccumulationLevels::Single;
  o.row_sum = RowSum::FloatP;
  o.fp22_keys = fp22_keys;
  o.head_dim_padded = 256;
  return o;
}

EmulatedForward sage2_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const Sage2Options& options) {
  return sage2_attend(quantize_sage2(q, k, v, params, options));
}

namespace {

// Sequence b's options: a given K mean is the (Hkv, d) slice of sequence b.
Sage2Options sequence_options(const Sage2Options& o, int b, int hkv, int d) {
  Sage2Options r = o;
  if (o.k_smoothing == KSmoothing::Given) {
    const std::size_t n = static_cast<std::size_t>(hkv) * d;
    r.k_mean.assign(o.k_mean.begin() + static_cast<std::ptrdiff_t>(b * n),
                    o.k_mean.begin() + static_cast<std::ptrdiff_t>((b + 1) * n));
  }
  return r;
}

}  // namespace

std::vector<Sage2Quantized> quantize_sage2_varlen(const PackedTensor& q, const PackedTensor& k,
                                                  const PackedTensor& v,
                                                  const VarlenLayout& layout,
                                                  const AttentionParams& params,
                                                  const Sage2Options& options) {
  validate_varlen_args("quantize_sage2_varlen", q, k, v, layout, params);
  const int batch = layout.batch();
  if (options.k_smoothing == KSmoothing::Given &&
      options.k_mean.size() != static_cast<std::size_t>(batch) * k.h * k.d)
    fail("quantize_sage2_varlen: options.k_mean: KSmoothing::Given needs batch*Hkv*d = " +
         std::to_string(static_cast<std::size_t>(batch) * k.h * k.d) + " values, got " +
         std::to_string(options.k_mean.size()));
  std::vector<Sage2Quantized> out(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    const int nq = layout.len_q(b), nkv = layout.len_k(b);
    if (nq == 0 || nkv == 0) continue;
    out[b] = quantize_sage2(unpack_sequence(q, layout.q_start(b), nq),
                            unpack_sequence(k, layout.k_start(b), nkv),
                            unpack_sequence(v, layout.k_start(b), nkv), params,
                            sequence_options(options, b, k.h, k.d));
  }
  return out;
}

EmulatedVarlenForward sage2_varlen_attention(const PackedTensor& q, const PackedTensor& k,
                                             const PackedTensor& v, const VarlenLayout& layout,
                                             const AttentionParams& params,
                                             const Sage2Options& options) {
  const std::vector<Sage2Quantized> z = quantize_sage2_varlen(q, k, v, layout, params, options);
  EmulatedVarlenForward out{PackedTensor(q.total, q.h, v.d),
                            std::vector<float>(static_cast<std::size_t>(q.h) * q.total, kNegInf)};
  for (int b = 0; b < layout.batch(); ++b) {
    if (z[b].batch == 0) continue;  // no rows, or rows that see no key: O = 0, LSE = -inf
    const EmulatedForward e = sage2_attend(z[b]);
    const int q0 = layout.q_start(b), nq = layout.len_q(b);
    pack_sequence(e.o, q0, out.o);
    for (int h = 0; h < q.h; ++h)
      std::copy_n(e.lse.data() + static_cast<std::size_t>(h) * nq, nq,
                  out.lse.data() + static_cast<std::size_t>(h) * q.total + q0);
  }
  return out;
}

}  // namespace qattn::emulate
