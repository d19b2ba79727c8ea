"""qattn.tools: measuring what qattn does to a model.

    compare(run, ...)             a model under SDPA, a 16-bit noise floor and candidate
                                  attentions: output error, per-layer error, ablation
                                  (compare.py's docstring has the details)
    eager_attention               the noise floor: attention in plain 16-bit operations
    precision_guard(q, k)         the precision guard's per-head σ and flags, on the device
    emulated_attention(mode)      qattn's CPU emulation (the kernel's contract) as an SDPA
    hadamard_rotated(fn)          fn on Q and K rotated by a signed Hadamard matrix
    sdpa_replaced(fn)             torch.nn.functional.scaled_dot_product_attention = fn, for a block
"""

from ._sdpa import SdpaFn, sdpa_replaced
from .compare import CallError, Comparison, compare, output_metrics
from .emulated import emulated_attention
from .floor import eager_attention
from .guard import GUARD_THRESHOLD_NATS, precision_guard
from .rotation import hadamard_matrix, hadamard_rotated

__all__ = [
    "CallError", "Comparison", "GUARD_THRESHOLD_NATS", "SdpaFn", "compare", "eager_attention",
    "emulated_attention", "hadamard_matrix", "hadamard_rotated", "output_metrics",
    "precision_guard", "sdpa_replaced",
]
