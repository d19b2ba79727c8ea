// Synthetic attention inputs for the accuracy report and the emulator tests.
//
// The generator (docs/accuracy-report.md) is deliberately plain, so a result on it
// says something about the formats rather than about a tuned distribution:
//
//   z ~ N(0, 1) i.i.d. for every element (a portable Box–Muller over mt19937_64, so
//   a seed gives the same tensors with every standard library);
//   per (batch, head) and channel c: a K bias b_k[c] ~ N(0, k_bias_std²) and a
//   smaller Q bias b_q[c] ~ N(0, q_bias_std²) — the channel-wise offsets that the
//   SageAttention papers observe in real Q and K (SageAttention2, Figure 2);
//   q = (z + b_q) / temperature,  k = z + b_k,  v = z,  dout = z.
//
// A temperature T divides the logits (through Q): T = 1 gives logits of standard
// deviation about 1 (diffuse attention over long rows), small T gives peaked rows.
// Every value is rounded to FP16, the precision the GPU reads, so the reference and
// every scheme see the very same inputs.
//
// The input families (InputFamily) change one property of that recipe each, with
// parameters fixed from the literature or from a stated property of the exact
// attention before any quantized result was looked at (docs/accuracy-report.md,
// "The input families"):
//
//   Gaussian         the recipe above.
//   LargeLogits      q multiplied by large_logit_scale λ = 8 (on top of 1/T): the
//                    logits' spread across a row's keys is ≈ 1.1·λ ≈ 9 nats, so a row
//                    spans tens of nats (±3σ ≈ ±27) and attention is nearly one-hot.
//   HeavyTail        every z (of q, k, v, dout) is Student-t with ν = student_t_dof = 3
//                    degrees of freedom (the fewest with a finite variance), scaled
//                    by √((ν−2)/ν) to unit variance, so only the tails differ.
//   OutlierChannels  per (batch, KV head), 2·n_o distinct channels drawn at random,
//                    n_o = outlier_channels (0: max(1, d/32)): in the first n_o, k is
//                    multiplied by g = outlier_gain = 32 and q by 1/g; in the other
//                    n_o, q by g and k by 1/g. Every logit q·k is the Gaussian
//                    family's (exactly, before the FP16 rounding); only where the
//                    magnitude sits differs — channels of 10–100× the others, as LLMs'
//                    Q and K have (g = 32 ≈ √(10·100), a power of two).
//   AttentionSink    key 0 of each (batch, KV head) gets k_0 += s·u, u the unit
//                    direction of the group's mean Q bias (the direction every query
//                    shares), s = ln(Nkv)·T·√d / |mean b_q|: the sink's logit exceeds
//                    a typical key's by ≈ ln(Nkv) for every query (sm_scale = 1/√d), so
//                    it weighs about as much as all other keys of the row together.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "reference/tensor.h"

namespace qattn::emulate {

enum class InputFamily { Gaussian, LargeLogits, HeavyTail, OutlierChannels, AttentionSink };

// The family's name in the report ("gaussian", "large_logits", "heavy_tail",
// "outlier_channels", "attention_sink").
const char* family_name(InputFamily f);

struct SyntheticSpec {
  int batch = 1;
  int heads_q = 1;
  int heads_kv = 1;  // must divide heads_q (GQA)
  int seq_q = 256;
  int seq_kv = 256;
  int head_dim = 64;
  double k_bias_std = 2.0;
  double q_bias_std = 0.5;
  double temperature = 1.0;
  std::uint64_t seed = 0;
  InputFamily family = InputFamily::Gaussian;
  // The family parameters (each used by its family only; see the recipes above).
  double large_logit_scale = 8.0;  // LargeLogits: q × λ
  int student_t_dof = 3;           // HeavyTail: ν, an integer >= 3 (finite variance)
  int outlier_channels = 0;        // OutlierChannels: n_o per set; 0: max(1, d/32)
  double outlier_gain = 32.0;      // OutlierChannels: g
};

// OutlierChannels: the channels of (batch b, KV head h) whose k is multiplied by g
// (first) and those whose q is (second), as make_synthetic draws them.
struct OutlierChannelSets {
  std::vector<int> k_large, q_large;
};
OutlierChannelSets outlier_channel_sets(const SyntheticSpec& spec, int b, int h);

struct SyntheticInputs {
  Tensor4 q, k, v, dout;
};

// Throws std::invalid_argument naming the field on a bad spec.
SyntheticInputs make_synthetic(const SyntheticSpec& spec);

// Mean over rows of the normalized entropy H(p)/log(n_visible) of the exact softmax
// rows of (q, k) (no mask, double precision): 1 = uniform attention, 0 = one-hot.
double mean_normalized_entropy(const Tensor4& q, const Tensor4& k, double sm_scale);

}  // namespace qattn::emulate
