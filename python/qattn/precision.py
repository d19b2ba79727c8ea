"""The precision mode of qattn.scaled_dot_product_attention (and of the plug-ins built on
it): "fast", "auto" or "precise" (qattn.attention's precision= argument says what each
computes). One setting for the process, so that a model patched through SDPA needs no
change of its own code."""
import contextlib
import contextvars
import os
import threading

import torch

_MODES = ("fast", "auto", "precise")
_ENV = "QATTN_PRECISION"


def _check_mode(mode, what: str) -> str:
    if mode not in _MODES:
        raise ValueError(f"{what} = {mode!r}; allowed: 'fast' (the default), 'auto' or 'precise'")
    return mode


_mode = _check_mode(os.environ.get(_ENV) or "fast", _ENV)
_lock = threading.Lock()
# using_precision's mode for the code it wraps (this thread or task only); None: _mode.
_scoped = contextvars.ContextVar("qattn_precision", default=None)


def set_precision(mode: str) -> str:
    """The precision qattn.scaled_dot_product_attention runs inference calls in: "fast"
    (the default; SageAttention2-8b), "auto" (fast, with the heads the precision guard
    flags recomputed in 16 bits) or "precise" (both products in 16 bits). Training calls
    run "fast" whatever the mode (the other two have no backward). The environment
    variable QATTN_PRECISION sets the
    mode at import. Returns the previous mode, so that a caller can restore it."""
    global _mode
    _check_mode(mode, "mode")
    with _lock:
        previous, _mode = _mode, mode
    return previous


def get_precision() -> str:
    """The current precision mode of the SDPA drop-in: using_precision's where one is
    active in this thread (or asyncio task), else set_precision's. Inside a graph that
    torch.compile traces, set_precision's: the compiler guards on it (a new mode compiles
    the graph again), while a context variable is not traceable (torch 2.11 stops
    fullgraph there), so using_precision applies to eager calls only."""
    if torch.compiler.is_compiling():
        return _mode
    scoped = _scoped.get()
    return _mode if scoped is None else scoped


@contextlib.contextmanager
def using_precision(mode: str):
    """The SDPA drop-in (and the plug-ins) in `mode` for the code inside, in this thread
    or task only; other threads keep theirs. Nests. Eager calls only: a graph compiled
    by torch.compile runs set_precision's mode. E.g.

        with qattn.using_precision("auto"):
            image = pipe(prompt).images[0]
    """
    token = _scoped.set(_check_mode(mode, "mode"))
    try:
        yield
    finally:
        _scoped.reset(token)
