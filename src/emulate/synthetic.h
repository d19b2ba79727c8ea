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
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "reference/tensor.h"

namespace qattn::emulate {

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
};

struct SyntheticInputs {
  Tensor4 q, k, v, dout;
};

// Throws std::invalid_argument naming the field on a bad spec.
SyntheticInputs make_synthetic(const SyntheticSpec& spec);

// Mean over rows of the normalized entropy H(p)/log(n_visible) of the exact softmax
// rows of (q, k) (no mask, double precision): 1 = uniform attention, 0 = one-hot.
double mean_normalized_entropy(const Tensor4& q, const Tensor4& k, double sm_scale);

}  // namespace qattn::emulate
