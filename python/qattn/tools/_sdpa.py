"""PyTorch's own SDPA, the type of an SDPA-signature function, and a way to put another
one in its place for a while (what compare() runs a model under)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from ..sdpa import _torch_sdpa  # noqa: F401  (PyTorch's own SDPA, never a patch)

SdpaFn = Callable[..., torch.Tensor]


@contextlib.contextmanager
def sdpa_replaced(fn: SdpaFn):
    """torch.nn.functional.scaled_dot_product_attention is `fn` inside the block."""
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved
