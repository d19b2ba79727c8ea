"""The precision mode of qattn.scaled_dot_product_attention (and of the plug-ins built on
it): "fast", "auto" or "precise" (qattn.attention's precision= argument says what each
computes). One setting for the process, so that a model patched through SDPA needs no
change of its own code."""
import contextlib
import contextvars

import torch

from ._setting import Setting

_setting = Setting("QATTN_PRECISION", ("fast", "auto", "precise"))
# using_precision's mode for the code it wraps (this thread or task only); None: set_precision's.
_scoped = contextvars.ContextVar("qattn_precision", default=None)


def set_precision(mode: str) -> str:
    """The precision qattn.scaled_dot_product_attention runs inference calls in: "fast"
    (the default; SageAttention2-8b), "auto" (fast, with the heads the precision guard
    flags recomputed in 16 bits) or "precise" (both products in 16 bits). Training calls
    run "fast" whatever the mode (the other two have no backward). The environment
    variable QATTN_PRECISION sets the
    mode at import. Returns the previous mode, so that a caller can restore it."""
    return _setting.set(mode)


def get_precision() -> str:
    """The current precision mode of the SDPA drop-in: using_precision's where one is
    active in this thread (or asyncio task), else set_precision's. Inside a graph that
    torch.compile traces, set_precision's: the compiler guards on it (a new mode compiles
    the graph again), while a context variable is not traceable (torch 2.11 stops
    fullgraph there), so using_precision applies to eager calls only."""
    if torch.compiler.is_compiling():
        return _setting.value
    scoped = _scoped.get()
    return _setting.value if scoped is None else scoped


@contextlib.contextmanager
def using_precision(mode: str):
    """The SDPA drop-in (and the plug-ins) in `mode` for the code inside, in this thread
    or task only; other threads keep theirs. Nests. Eager calls only: a graph compiled
    by torch.compile runs set_precision's mode. E.g.

        with qattn.using_precision("auto"):
            image = pipe(prompt).images[0]
    """
    token = _scoped.set(_setting.check(mode, "mode"))
    try:
        yield
    finally:
        _scoped.reset(token)
