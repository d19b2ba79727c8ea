"""The Hadamard rotation of Q and K (the `qk_rotation` study of `qattn accuracy`,
numerics/hadamard.h) on today's kernel: Q and K rotated before the call."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ._sdpa import SdpaFn


def hadamard_matrix(d: int, for_q: bool, dtype=torch.float32, device=None) -> torch.Tensor:
    """R = diag(s)·H·2^-e of numerics/hadamard.h (d = 2^m; e = ceil(m/2) for Q, floor(m/2)
    for K): x·R is the rotation the SA2 emulator's QkRotation::Hadamard applies to a row,
    and (q·R_q)·(k·R_k) = q·k exactly in real arithmetic."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard_matrix: d = {d} is not a power of two")
    m = d.bit_length() - 1
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    pattern = 0x9E3779B97F4A7C15
    signs = torch.tensor([-1.0 if ((pattern >> (c & 63)) ^ (c >> 6)) & 1 else 1.0 for c in range(d)],
                         dtype=torch.float64)
    e = (m + 1) // 2 if for_q else m // 2
    return (signs[:, None] * h * 2.0 ** -e).to(dtype=dtype, device=device)


def hadamard_rotated(sdpa: Optional[SdpaFn] = None) -> SdpaFn:
    """An SDPA-signature function that rotates query and key by hadamard_matrix (in FP32,
    FP64 for FP64 inputs, rounded back to their dtype) and calls `sdpa` (default: qattn's
    drop-in) with the caller's scale (1/sqrt(d) by default): attention is unchanged in exact arithmetic,
    while INT8 quantization sees rows whose energy is spread over every channel (the
    `qk_rotation` study of `qattn accuracy`). Head dims that are not a power of two pass
    through unrotated. An experiment for compare() and the benchmarks, not a mode of
    the library: the rotation costs two more passes over Q and K."""
    if sdpa is None:
        import qattn

        sdpa = qattn.scaled_dot_product_attention

    # Built once per (d, operand, dtype, device), not in every call (whose time
    # bench/accuracy.py measures).
    matrix = functools.lru_cache(maxsize=None)(hadamard_matrix)

    def rotated(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                enable_gqa=False):
        d = query.shape[-1]
        if d & (d - 1) == 0 and key.shape[-1] == d:
            scale = 1.0 / math.sqrt(d) if scale is None else scale
            work = torch.promote_types(query.dtype, torch.float32)  # FP32, or FP64 for FP64
            rq = matrix(d, True, work, query.device)
            rk = matrix(d, False, work, key.device)
            query = (query.to(work) @ rq).to(query.dtype)
            key = (key.to(work) @ rk).to(key.dtype)
        kwargs = {"scale": scale}
        if enable_gqa:
            kwargs["enable_gqa"] = True
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    return rotated
