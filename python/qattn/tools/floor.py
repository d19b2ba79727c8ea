"""The noise floor of compare(): attention in plain 16-bit PyTorch operations, as
Hugging Face transformers' "eager" attention computes it."""

from __future__ import annotations

import math

import torch

def eager_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                    scale=None, enable_gqa=False) -> torch.Tensor:
    """SDPA's semantics in plain PyTorch operations in the inputs' dtype, as Hugging Face
    transformers' "eager" attention computes: scores by a 16-bit matmul (FP32
    accumulation, rounded to the dtype), softmax in FP32 (FP64 for FP64 inputs) rounded
    to the dtype, P·V by a 16-bit matmul. The default noise floor of compare()."""
    if dropout_p != 0.0:
        raise ValueError("eager_attention: dropout_p must be 0 (compare runs a model in eval mode)")
    nq, nkv = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:  # top-left, as SDPA: query i sees keys j <= i
        visible = torch.ones(nq, nkv, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    p = torch.nan_to_num(p, nan=0.0).to(query.dtype)  # a row that sees no key: 0
    return p @ value
