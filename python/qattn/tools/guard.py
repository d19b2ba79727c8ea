"""The precision guard (src/emulate/precision.h) with torch operations on the tensors'
device: per head, the worst (query, key) pair's score error that INT8 Q·Kᵀ makes, and
whether it exceeds FP8 P·V's own."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

GUARD_THRESHOLD_NATS = 2.0 ** -4 / math.sqrt(8.0 * math.log(2.0))  # ε_E4M3 (emulate/precision.h)
_SMOOTH_SAMPLE = 256  # numerics/token_sample.h: the K mean's token sample


def _int8_codes(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The INT8 codes of x (FP32) in groups of amax (broadcast to x): clamp(rne(x·127/amax)),
    0 where amax is 0 (numerics/block_scale.h, formats.h)."""
    # A tensor divisor: PyTorch computes scalar / tensor as a product with a reciprocal,
    # which is not the correctly rounded quotient the emulator (and the kernel) use.
    mult = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / amax)
    return torch.round(x * mult).clamp(-127, 127)


def precision_guard(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None):
    """The precision guard of qattn's fast arithmetic on q (B, Hq, Nq, d) and k (B, Hkv,
    Nkv, d): per (batch, query head) σ, the worst (query, key) pair's RMS score error in
    nats that INT8 Q·Kᵀ makes under the rounding model, and whether it exceeds
    GUARD_THRESHOLD_NATS (the RMS relative error of an E4M3 cast: above it, Q·Kᵀ costs
    more than the FP8 P·V that follows). The rule and its derivation are
    src/emulate/precision.h's and docs/accuracy-report.md's; this is that rule computed
    with torch operations on the tensors' device (no host synchronization: it returns
    tensors), on the same quantization groups as the kernel (per-thread Q groups of two
    rows, per-thread K groups of 32 tokens per 128-token tile, K smoothed by its sampled
    mean). Equal to the CPU emulation's σ up to FP32 rounding. Returns (sigma float64
    (B, Hq), flagged bool (B, Hq))."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    sm = 1.0 / math.sqrt(d) if scale is None else scale
    f32 = torch.float32
    scale_log2 = float(torch.tensor(sm, dtype=f32) * torch.tensor(math.log2(math.e), dtype=f32))
    qf, kf = q.to(f32), k.to(f32)
    # K smoothed by the mean of its token sample (all tokens up to 256, else 256 spread).
    n_s = min(nkv, _SMOOTH_SAMPLE)
    rows = torch.arange(n_s, device=k.device)
    if nkv > _SMOOTH_SAMPLE:
        rows = rows * nkv // _SMOOTH_SAMPLE
    # Summed in FP64 in token order (a cumulative sum's last entry, sequential on the
    # CPU) as numerics::token_mean sums, so c is the emulator's to the last bit.
    c = (kf.index_select(2, rows).double().cumsum(dim=2)[:, :, -1:] / n_s).to(f32)
    ks = kf - c
    # K groups: token j of a 128-token tile is in group (j % 8) // 2 of that tile.
    nkv_pad = -(-nkv // 128) * 128
    ks = F.pad(ks, (0, 0, 0, nkv_pad - nkv)).view(b, hkv, nkv_pad // 128, 16, 4, 2, d)
    k_amax = ks.abs().amax(dim=(3, 5, 6), keepdim=True)
    k_step2 = (k_amax / 127.0).double().square()  # b_j² of each group
    k_norm2 = (_int8_codes(ks, k_amax).double().square().sum(-1, keepdim=True) * k_step2)
    k_step2 = k_step2.flatten(2).amax(-1)  # (B, Hkv): max b_j²
    k_norm2 = k_norm2.flatten(2).amax(-1)  # max b_j²·|k̂_j|²
    # Q groups: in each 64-row block, rows r and r + 8 of each 16-row warp slice.
    nq_pad = -(-nq // 128) * 128
    qs = F.pad(qf, (0, 0, 0, nq_pad - nq)).view(b, hq, nq_pad // 64, 4, 2, 8, d)
    q_amax = qs.abs().amax(dim=(4, 6), keepdim=True)
    a = (q_amax / 127.0) * scale_log2  # FP32, as the emulator folds scale_log2 in
    a2 = a.double().square()
    q_norm2 = (_int8_codes(qs, q_amax).double().square().sum(-1, keepdim=True) * a2)
    a2 = a2.flatten(2).amax(-1)
    q_norm2 = q_norm2.flatten(2).amax(-1)
    rep = hq // hkv
    var = (a2 * k_norm2.repeat_interleave(rep, dim=1) + k_step2.repeat_interleave(rep, dim=1) * q_norm2) / 12
    sigma = var.sqrt() * math.log(2.0)
    return sigma, ~(sigma <= GUARD_THRESHOLD_NATS)  # NaN flags, as in the emulator
