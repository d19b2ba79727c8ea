"""A decoder-only transformer for the training experiment: pre-norm blocks (RMSNorm,
causal self-attention with rotary position embeddings, a GELU MLP of 4x width), byte
tokens, tied input and output embeddings. The attention call is a parameter, so the
same model runs on torch SDPA or on qattn's SDPA drop-in."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Attention = Callable[..., torch.Tensor]  # F.scaled_dot_product_attention's signature


@dataclass
class ModelConfig:
    vocab: int = 256
    layers: int = 8
    dim: int = 1024
    heads: int = 8  # head dim = dim / heads (128 by default)
    ctx: int = 2048


def rope_tables(n: int, head_dim: int, device) -> tuple:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]  # (N, 1, d/2): broadcast over heads


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, N, H, d): rotates the pairs (x[i], x[i + d/2]) by position-dependent angles,
    in FP32, and returns x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x, rope, attention: Attention):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # (B, H, N, d) views of (B, N, H, d) storage: both qattn and SDPA take strides.
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, c))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.rope = None
        # GPT-2's initialization: N(0, 0.02), the residual projections scaled by 1/sqrt(2L).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def parameters_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, attention: Attention) -> torch.Tensor:
        n = tokens.shape[1]
        if self.rope is None or self.rope[0].shape[0] < n or self.rope[0].device != tokens.device:
            self.rope = rope_tables(max(n, self.cfg.ctx), self.cfg.dim // self.cfg.heads, tokens.device)
        rope = (self.rope[0][:n], self.rope[1][:n])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rope, attention)
        return F.linear(self.norm(x), self.embed.weight)  # tied output embedding


def loss_fn(model: Transformer, batch: torch.Tensor, attention: Attention) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte) of a (B, ctx + 1) batch."""
    logits = model(batch[:, :-1], attention)
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
