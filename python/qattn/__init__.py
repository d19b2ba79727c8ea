"""qattn: low-bit attention (SageAttention family) with a C ABI core.

    import qattn
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)  # F.scaled_dot_product_attention's signature
    o = qattn.attention(q, k, v, is_causal=True, layout="NHD")       # qattn's own options (layout, LSE, alignment,
                                                                     # window_size, kv_lengths, attn_mask)
    o = qattn.sageattn(q, k, v, tensor_layout="NHD")                 # drop-in for SageAttention's sageattn
    o = qattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k,    # flash_attn_varlen_func's arguments:
                               causal=True)                          # packed (total, H, d) sequences

Inference with a quantized paged KV cache (docs/kv-cache.md; qattn.kv_cache's docstring
has a generation loop):

    cache = qattn.KVCache(num_pages=4096, heads_kv=8, head_dim=128, max_seqs=64, format="nvfp4")
    cache.allocate(0, n); cache.append(k, v, seqs=[0])               # k, v: (1, 8, n, 128)
    o = qattn.decode(q, cache, seqs=[0])                             # q: (1, 32, nq, 128)

Training: with inputs that require grad, both functions run qattn's training forward
and SageBwd, its INT8 backward, through autograd (torch.compile included); see
qattn.sdpa's docstring for an example, and qattn.set_backward_options for the
backward's format, dO·Vᵀ precision and deterministic mode. qattn.set_training("sdpa")
sends the SDPA drop-in's training calls to PyTorch's SDPA (forward and backward) and
keeps its inference calls on qattn.

qattn.scaled_dot_product_attention runs what qattn does not support on PyTorch's SDPA,
with a warning once per reason; qattn.set_fallback("raise") (or QATTN_FALLBACK=raise in
the environment) makes that an error.

The compiled module qattn._C links no PyTorch library; the PyTorch integration
(qattn/ops.py, a torch.library custom op) is pure Python, so one build works with any
PyTorch version. Without PyTorch, only the _C-level helpers below are available.
"""

from __future__ import annotations

from . import _C
from .errors import QattnBackwardNotImplemented, QattnError, QattnFallbackWarning, QattnUnsupportedError

__version__ = _C.version()


def built_with_cuda() -> bool:
    """True when the library was built with its CUDA kernels."""
    return _C.built_with_cuda()


def device_supported(device: int = -1) -> bool:
    """True when the CUDA device (-1: the current one) can run qattn's kernels (sm_90)."""
    return _C.device_supported(device)


__all__ = [
    "QattnBackwardNotImplemented",
    "QattnError",
    "QattnFallbackWarning",
    "QattnUnsupportedError",
    "__version__",
    "built_with_cuda",
    "device_supported",
]

try:
    import torch  # noqa: F401
except ImportError:  # pragma: no cover - the torch layer needs torch
    pass
else:
    from .ops import (  # noqa: F401
        attention,
        attention_kernel_only,
        get_backward_options,
        sageattn,
        set_backward_options,
    )
    from .kv_cache import KVCache, decode  # noqa: F401
    from .precision import get_precision, set_precision, using_precision  # noqa: F401
    from .sdpa import get_fallback, scaled_dot_product_attention, set_fallback  # noqa: F401
    from .training import get_training, set_training  # noqa: F401
    from .varlen import varlen_attention  # noqa: F401

    __all__ += [
        "KVCache",
        "attention",
        "attention_kernel_only",
        "decode",
        "get_backward_options",
        "get_fallback",
        "get_precision",
        "get_training",
        "sageattn",
        "scaled_dot_product_attention",
        "set_backward_options",
        "set_fallback",
        "set_precision",
        "set_training",
        "using_precision",
        "varlen_attention",
    ]
