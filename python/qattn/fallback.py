"""The fallback policy of the PyTorch layer: what a call qattn cannot run does, for the
SDPA drop-in (qattn/sdpa.py) and for the backward (qattn/ops.py). One module, imported
by both, so the mode and the warn-once record are shared."""
import threading
import warnings
from typing import Optional

import torch

from ._setting import Setting
from .errors import QattnFallbackWarning, QattnUnsupportedError

_setting = Setting("QATTN_FALLBACK", ("warn", "raise"))
_warned = set()  # reason keys already warned about in this process
_lock = threading.Lock()  # guards _warned


def set_fallback(mode: str) -> str:
    """What qattn.scaled_dot_product_attention does with a call qattn cannot run:
    "warn" (the default) runs torch.nn.functional.scaled_dot_product_attention and
    issues a QattnFallbackWarning once per reason; "raise" raises QattnUnsupportedError
    instead. The environment variable QATTN_FALLBACK sets the mode at import. Returns
    the previous mode, so that a caller can restore it. A call that SDPA itself rejects
    raises SDPA's own error (TypeError, RuntimeError, ...) in either mode."""
    return _setting.set(mode)


def get_fallback() -> str:
    """The current fallback mode, "warn" or "raise" (see set_fallback)."""
    return _setting.value


# Called, not traced, by torch.compile (a "constant" function): the error is raised
# while tracing, as it would be in eager mode.
@torch.compiler.assume_constant_result
def refuse_sdpa(key: str, why: str) -> None:
    raise QattnUnsupportedError(
        key,
        f"qattn.scaled_dot_product_attention cannot run this call: {why} "
        "(qattn.set_fallback('warn') runs torch.nn.functional.scaled_dot_product_attention "
        "instead)",
    )


def warn_once(key: str, why: str, message: Optional[str] = None, stacklevel: int = 4) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        message or (
            f"qattn.scaled_dot_product_attention: {why}; running "
            "torch.nn.functional.scaled_dot_product_attention instead (warned once per reason; "
            "qattn.set_fallback('raise') makes this an error)"
        ),
        QattnFallbackWarning,
        stacklevel=stacklevel,
    )


def backward_declined(key: str, why: str) -> None:
    """The fallback mode for a backward the library declines (qattn/ops.py): "raise"
    raises QattnUnsupportedError; "warn" warns once per reason and returns, and the
    caller computes the exact gradients in FP32 (PyTorch's SDPA math)."""
    key = f"backward {key}"
    if _setting.value == "raise":
        raise QattnUnsupportedError(
            key,
            f"qattn's backward cannot run this call: {why} (qattn.set_fallback('warn') "
            "computes the exact gradients with PyTorch's SDPA math instead)",
        )
    warn_once(key, why, (
        f"qattn backward: {why}; computing the exact gradients in FP32 with PyTorch's SDPA "
        "math from the same inputs instead (warned once per reason; "
        "qattn.set_fallback('raise') makes this an error)"
    ), stacklevel=2)
