"""PyTorch integration: qattn.attention as the torch.library custom op "qattn::attention".

The op calls the C ABI through qattn._C with raw pointers, strides and the current
CUDA stream; its workspace comes from PyTorch's caching allocator on that stream (a
uint8 tensor, or a raw block freed after the enqueue where the call's plan is kept), so a
call never synchronizes and can be captured in a CUDA graph. A fake (meta)
implementation lets torch.compile(fullgraph=True) trace through it. Plans: the first
eager call of a shape runs every check and asks the C library for the workspace size;
the later ones reuse what it found (see "plans" below).

Training: where autograd records the call (grad mode on and an input that requires
grad), qattn.attention runs "qattn::attention_train", the training forward (the same
kernel with the LSE and P's row maxima written and per-block Q/K quantization groups,
SageBwd's), whose autograd formula is the custom op "qattn::attention_backward" (the
SageBwd backward through the C ABI; with the merge-free scales of
set_backward_options it reads those row maxima). Both have fake implementations, so
torch.compile traces forward and backward. Inference keeps the direct call of
"qattn::attention".

Masks beyond causal (a sliding window, key-padding lengths, top-left alignment, and a
boolean attn_mask, SDPA's, True = attend) are the last arguments of every op, with
defaults that mean "none", so that a call using none of them dispatches just the
arguments of a plain causal or unmasked call. The forward runs all of them in the
kernel (the attn_mask alone: the library takes it with none of causal, the window and
kv_lengths; it is passed as a stride-0 broadcast view, never copied); SageBwd runs none
of them, so the backward of a call that uses one follows the fallback mode
(fallback.py).
"""

# No `from __future__ import annotations`: torch.library reads the real annotations.
import contextlib
import math
import os
import struct
import threading
import warnings
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _C, fallback
from .errors import QattnError, QattnUnsupportedError, check, invalid

_LAYOUTS = ("HND", "NHD")
_SCHEMES = ("sa2_8b", "sa3_nvfp4")
# precision= of the SageAttention2-8b scheme: the C ABI's scheme for each mode.
_PRECISIONS = {"fast": _C.SCHEME_SAGE2_8B, "auto": _C.SCHEME_SAGE2_8B_AUTO,
               "precise": _C.SCHEME_PRECISE16}
_DTYPES = {torch.float16: _C.DTYPE_FP16, torch.bfloat16: _C.DTYPE_BF16}
_GRANULARITIES = {"per_thread": 0, "per_warp": 1, "per_block": 2}
_ROW_MULTIPLE = 8  # elements: the C ABI wants 16-byte strides and pointers
_ALIGN_BYTES = 16
_LOG2E = 1.4426950408889634
_ALIGNMENTS = ("top_left", "bottom_right")
_ALIGNMENT_CODES = {"bottom_right": _C.ALIGN_BOTTOM_RIGHT, "top_left": _C.ALIGN_TOP_LEFT}
_INT32_MAX = 2**31 - 1
_LENGTH_DTYPES = (torch.int32, torch.int64)
# The ops' mask arguments, in the ops' order, and their defaults: every key, no window,
# bottom-right, no attn_mask (the C ABI's qattn_fwd_params_init).
_NO_MASK = {"kv_lengths": None, "window_left": -1, "window_right": -1, "alignment": "bottom_right",
            "attn_mask": None}
# attention()'s default window_size: a call that passes it (by leaving it out) has no window.
_NO_WINDOW = (-1, -1)


# ---- shape checks (run on real and on fake tensors) ----------------------------------


def _bhnd(t: torch.Tensor, layout: str) -> Tuple[int, int, int, int]:
    """(B, H, N, d) of a tensor in `layout`."""
    if layout == "HND":
        b, h, n, d = t.shape
    else:
        b, n, h, d = t.shape
    return b, h, n, d


def scale_ok(scale) -> bool:
    """True for a scale the C ABI honours as given: positive, non-zero in FP32, and with
    scale·log2(e) finite in FP32. The ABI reads sm_scale 0 as "the default" and rejects
    a negative one, so a positive scale that rounds to 0 in FP32 must not turn into
    1/sqrt(d) silently."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return False
    if not (math.isfinite(scale) and scale > 0):
        return False
    # The kernel works with sm_scale·log2(e) in FP32 (exp2 softmax): that must be finite too.
    return 0.0 < _fp32(scale) and _fp32(scale * _LOG2E) < math.inf


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def check_operands(q, k, v, ndim: int, shape_text: str, device_text: str) -> None:
    """q, k, v: tensors of ndim dimensions (shape_text says which), one 16-bit float dtype,
    one device (device_text says which is allowed)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise invalid(f"{name} is a {type(t).__name__}; allowed: a torch.Tensor")
        if t.dim() != ndim:
            raise invalid(f"{name} has {t.dim()} dimensions (shape {tuple(t.shape)}); allowed: "
                          f"{ndim}, {shape_text}")
        if t.dtype not in _DTYPES:
            raise invalid(f"{name}.dtype = {t.dtype}; allowed: torch.float16 or torch.bfloat16")
        if t.dtype != q.dtype:
            raise invalid(f"{name}.dtype = {t.dtype} differs from q.dtype = {q.dtype}; allowed: one dtype")
        if t.device != q.device:
            raise invalid(f"{name} is on {t.device} but q is on {q.device}; allowed: {device_text}")


def _check_inputs(q, k, v, layout: str, scale: Optional[float], granularity: str) -> None:
    if layout not in _LAYOUTS:
        raise invalid(f"layout = {layout!r}; allowed: 'HND' (B, H, N, d) or 'NHD' (B, N, H, d)")
    if granularity not in _GRANULARITIES:
        raise invalid(f"granularity = {granularity!r}; allowed: {', '.join(_GRANULARITIES)}")
    check_operands(q, k, v, 4,
                   f"{'(B, H, N, d)' if layout == 'HND' else '(B, N, H, d)'} for layout {layout!r}",
                   "one CUDA device")
    bq, hq, nq, d = _bhnd(q, layout)
    bk, hk, nk, dk = _bhnd(k, layout)
    bv, hv, nv, dv = _bhnd(v, layout)
    if (bk, hk, nk) != (bv, hv, nv) or dv > dk:
        raise invalid(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ; allowed: the same "
                      "shape, or v with fewer channels than k (its head dim, e.g. 128 beside 192)")
    if bk != bq or dk != d:
        raise invalid(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim ({layout}); "
            "allowed: the same batch and head_dim"
        )
    if hk == 0 or hq % hk != 0:
        raise invalid(
            f"heads_q = {hq} is not a multiple of heads_kv = {hk}; allowed: heads_q = g * heads_kv (GQA/MQA)"
        )
    if scale is not None and not scale_ok(scale):
        raise invalid(
            f"scale = {scale}; allowed: None (1/sqrt(head_dim)) or a positive number that is "
            "non-zero in FP32 and whose product with log2(e) is finite in FP32"
        )


def _is_int(x) -> bool:
    """A Python int, or a symbolic one (torch.compile may trace an int argument as such)."""
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _window_sides(window_size) -> Tuple[int, int]:
    """(left, right) of a window_size argument, checked: each side -1 (no bound) or a
    number of keys that fits the C ABI's int32."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(_is_int(x) for x in window_size)):
        raise invalid(f"window_size = {window_size!r}; allowed: a pair of ints (left, right), "
                      "-1 for no bound on that side")
    for name, side in zip(("left", "right"), window_size):
        if not -1 <= side <= _INT32_MAX:
            raise invalid(f"window_size = {tuple(window_size)!r}: {name} = {side}; allowed: -1 "
                          f"(no bound) or a number of keys in 0..{_INT32_MAX}")
    return int(window_size[0]), int(window_size[1])


def _check_kv_lengths(kv_lengths, q, layout: str) -> None:
    """kv_lengths: None, or one length per batch entry, an int32 (or int64) tensor of
    shape (B,) on q's device. q has passed _check_inputs."""
    if kv_lengths is None:
        return
    if not isinstance(kv_lengths, torch.Tensor):
        raise invalid(f"kv_lengths is a {type(kv_lengths).__name__}; allowed: None or a (B,) "
                      "torch.int32 tensor on q's device")
    if kv_lengths.dtype not in _LENGTH_DTYPES:
        raise invalid(f"kv_lengths.dtype = {kv_lengths.dtype}; allowed: torch.int32 (or "
                      "torch.int64, converted)")
    b = _bhnd(q, layout)[0]
    if tuple(kv_lengths.shape) != (b,):
        raise invalid(f"kv_lengths has shape {tuple(kv_lengths.shape)}; allowed: ({b},), one "
                      "length per batch entry")
    if kv_lengths.device != q.device:
        raise invalid(f"kv_lengths is on {kv_lengths.device} but q is on {q.device}; allowed: "
                      "q's device")


def _additive_layout(mask, b: int, hq: int, nq: int, nkv: int):
    """An additive mask as the SA2-8b kernel reads it (4-byte pairs of keys): keys
    contiguous, and the pointer and the strides of the dimensions the call indexes even in
    elements. Another layout (a key-broadcast mask, odd Nkv rows, a sliced view) is copied
    into rows padded to an even length, keeping the mask's own broadcast dimensions (a
    (Nq, Nkv) mask stays one slice)."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    keys_ok = nkv == 1 or (m.shape[3] == nkv and m.stride(3) == 1)
    rows_ok = all(st % 2 == 0 for st, size, full in zip(m.stride()[:3], m.shape[:3], (b, hq, nq))
                  if full > 1 and size > 1)
    if keys_ok and rows_ok and m.data_ptr() % 4 == 0:
        return m
    lead = tuple(m.shape[:3])
    out = torch.empty(lead + (nkv + nkv % 2,), dtype=m.dtype, device=m.device)[..., :nkv]
    out.copy_(m.expand(lead + (nkv,)))
    return out


def _check_attn_mask(attn_mask, q, k, layout: str) -> None:
    """attn_mask: None, or SDPA's boolean mask (True = the query sees the key) or its float
    (additive) mask of q's dtype (added to the scaled scores; -inf hides the key), a
    tensor on q's device whose shape broadcasts to (B, Hq, Nq, Nkv) by PyTorch's rules
    ((Nkv,), (Nq, Nkv), (B, 1, 1, Nkv), ...), in either layout (the mask is never in NHD
    order). q, k and v have passed _check_inputs."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise invalid(f"attn_mask is a {type(attn_mask).__name__}; allowed: None or a torch.bool "
                      "or q-dtype tensor broadcastable to (B, Hq, Nq, Nkv) on q's device")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise invalid(f"attn_mask.dtype = {attn_mask.dtype}; allowed: torch.bool (True = the "
                      f"query sees the key) or q's dtype {q.dtype} (an additive mask)")
    b, hq, nq, _ = _bhnd(q, layout)
    target = (b, hq, nq, _bhnd(k, layout)[2])
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(s != 1 and s != t for s, t in zip(reversed(shape), reversed(target))):
        raise invalid(f"attn_mask has shape {shape}; allowed: a shape broadcastable to (B, Hq, "
                      f"Nq, Nkv) = {target}, e.g. (Nq, Nkv), (B, 1, 1, Nkv) or (B, Hq, Nq, Nkv)")
    if attn_mask.device != q.device:
        raise invalid(f"attn_mask is on {attn_mask.device} but q is on {q.device}; allowed: "
                      "q's device")


def _attn_mask_alone(attn_mask, others) -> None:
    """The library takes an attn_mask with no other mask; `others` are (name, set) pairs
    of the other masks, named as the caller gave them."""
    if attn_mask is None:
        return
    given = [name for name, on in others if on]
    if given:
        raise invalid(f"attn_mask with {' and '.join(given)}; allowed: an attn_mask alone (write "
                      "the causal rule, the window or the key padding into the mask, or leave "
                      "attn_mask out: those masks run without one)")


def _check_mask(q, k, layout: str, is_causal, kv_lengths, window_left, window_right, alignment,
                attn_mask=None) -> None:
    """The ops' mask arguments (qattn.h's rules): each window side -1 or a number of keys,
    an alignment by name, kv_lengths as _check_kv_lengths says, attn_mask as
    _check_attn_mask says and alone (no causal, window or kv_lengths with it)."""
    for name, side in (("window_left", window_left), ("window_right", window_right)):
        if not (_is_int(side) and -1 <= side <= _INT32_MAX):
            raise invalid(f"{name} = {side!r}; allowed: -1 (no bound) or a number of keys in "
                          f"0..{_INT32_MAX}")
    if alignment not in _ALIGNMENTS:
        raise invalid(f"alignment = {alignment!r}; allowed: 'top_left' or 'bottom_right'")
    _check_kv_lengths(kv_lengths, q, layout)
    _check_attn_mask(attn_mask, q, k, layout)
    _attn_mask_alone(attn_mask, (
        ("is_causal=True", bool(is_causal)),
        (f"a window (window_left = {window_left}, window_right = {window_right})",
         window_left != -1 or window_right != -1),
        ("kv_lengths", kv_lengths is not None),
    ))


def _mask_options(kv_lengths=None, window_left=-1, window_right=-1, alignment="bottom_right",
                  attn_mask=None) -> dict:
    """The mask arguments that differ from their defaults, as keywords for the ops and
    _run: an empty dict for a call with no mask beyond causal, which then passes just
    the arguments of a plain call."""
    options = {} if kv_lengths is None else {"kv_lengths": kv_lengths}
    for name, value in (("window_left", window_left), ("window_right", window_right),
                        ("alignment", alignment)):
        if value != _NO_MASK[name]:
            options[name] = value
    if attn_mask is not None:
        options["attn_mask"] = attn_mask
    return options


def _mask_inputs(values) -> dict:
    """_mask_options of an op's trailing mask inputs as setup_context sees them (a
    PyTorch version may leave out the trailing ones that are at their defaults)."""
    names = tuple(_NO_MASK)
    return _mask_options(**{**_NO_MASK, **dict(zip(names, values))})


# ---- the real call -----------------------------------------------------------------


def _usable(t: torch.Tensor, layout: str, d_pad: int) -> torch.Tensor:
    """A view the C ABI accepts: last dim contiguous and d_pad long, 16-byte aligned
    pointer, strides of multiples of 8 elements. Copies only when `t` is not one."""
    d = t.shape[-1]
    if d != d_pad:
        return F.pad(t, (0, d_pad - d))  # a fresh contiguous tensor
    # Stride 0 (an expanded tensor, e.g. K/V broadcast over heads) is copied too: the C ABI
    # takes positive strides only.
    if t.stride(-1) != 1 or t.data_ptr() % _ALIGN_BYTES != 0 or any(
        s <= 0 or s % _ROW_MULTIPLE != 0 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1
    ):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _tensor_arg(t: torch.Tensor, layout: str) -> Tuple[int, int, int, int]:
    if layout == "HND":
        return (t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))
    return (t.data_ptr(), t.stride(0), t.stride(2), t.stride(1))


class _Call:
    """Everything one C call needs, with the buffers kept alive."""

    def __init__(self, q, k, v, is_causal, scale, layout, return_lse, granularity,
                 kv_lengths=None, window_left=-1, window_right=-1, alignment="bottom_right",
                 attn_mask=None, scheme=_C.SCHEME_SAGE2_8B, p_max=False):
        _check_inputs(q, k, v, layout, scale, granularity)
        _check_mask(q, k, layout, is_causal, kv_lengths, window_left, window_right, alignment,
                    attn_mask)
        b, hq, nq, d = _bhnd(q, layout)
        _, hkv, nkv, _ = _bhnd(k, layout)
        dv = v.shape[-1]  # V's and O's head dim (at most d)
        d_pad = -(-d // _ROW_MULTIPLE) * _ROW_MULTIPLE
        dv_pad = -(-dv // _ROW_MULTIPLE) * _ROW_MULTIPLE
        self.d, self.d_pad, self.dv, self.dv_pad = d, d_pad, dv, dv_pad
        self.q, self.k = (_usable(t, layout, d_pad) for t in (q, k))
        self.v = _usable(v, layout, dv_pad)
        self.o = q.new_empty((*self.q.shape[:-1], dv_pad))  # contiguous, in the layout
        # The C ABI's head_dim_v: 0 where V has Q's (padded) channels.
        self.head_dim_v = 0 if dv_pad == d_pad else dv_pad
        self.lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
        # P's row maxima (the merge-free backward's input), where asked for.
        self.p_max = q.new_empty((b, hq, nq) if p_max else (0,), dtype=torch.float32)
        self.p_max_ptr = self.p_max.data_ptr() if p_max else 0
        self.args = (
            _tensor_arg(self.q, layout),
            _tensor_arg(self.k, layout),
            _tensor_arg(self.v, layout),
            _tensor_arg(self.o, layout),
            self.lse.data_ptr() if return_lse else 0,
            _DTYPES[q.dtype],
            (b, hq, hkv, nq, nkv, d_pad),
            1 if is_causal else 0,
            # Padded rows keep the caller's d in the default scale.
            float(scale) if scale is not None else 1.0 / math.sqrt(d),
            _GRANULARITIES[granularity],
        )
        if kv_lengths is not None and kv_lengths.dtype == torch.int64:
            # Clamped before the conversion, so a length past int32 cannot wrap (the
            # kernel clamps to [0, Nkv] too).
            kv_lengths = kv_lengths.clamp(0, nkv).to(torch.int32)
        self.kv_lengths = None if kv_lengths is None else kv_lengths.contiguous()
        # The mask as a (B, Hq, Nq, Nkv) view: broadcast dimensions get stride 0, nothing
        # is copied. A bool is one byte, so its element strides are the C ABI's byte
        # strides; any stride >= 0 is taken (a transposed or sliced mask as well). An
        # additive mask is read in 4-byte pairs of keys: _additive_layout copies one whose
        # keys are not contiguous or whose rows are not 4-byte aligned.
        additive = attn_mask is not None and attn_mask.dtype != torch.bool
        if additive:
            attn_mask = _additive_layout(attn_mask, b, hq, nq, nkv)
        self.attn_mask = None if attn_mask is None else attn_mask.expand(b, hq, nq, nkv)
        m = self.attn_mask
        item = 2 if additive else 1
        self.mask = (
            0 if self.kv_lengths is None else self.kv_lengths.data_ptr(),
            window_left,
            window_right,
            _ALIGNMENT_CODES[alignment],
            0 if m is None else m.data_ptr(),
            *((0, 0, 0, 0) if m is None else (st * item for st in m.stride())),
            _C.MASK_ADDITIVE if additive else (_C.MASK_NONE if m is None else _C.MASK_BOOL),
        )
        self.scheme = scheme
        status, self.ws_bytes = _C.workspace_size(*self.args, self.mask, scheme,
                                                  head_dim_v=self.head_dim_v,
                                                  p_max=self.p_max_ptr)
        check(status)
        self.device = q.device
        self.workspace = torch.empty(self.ws_bytes, dtype=torch.uint8, device=q.device)

    def launch(self, attention_only: bool = False) -> None:
        stream = _current_stream(self.device.index)
        # p_max only where written: a call without it passes what it always did.
        extra = {"p_max": self.p_max_ptr} if self.p_max_ptr else {}
        status = _C.forward(
            *self.args, self.workspace.data_ptr(), self.ws_bytes, stream, attention_only, self.mask,
            self.scheme, head_dim_v=self.head_dim_v, **extra,
        )
        check(status)

    def outputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        o = self.o if self.dv == self.dv_pad else self.o[..., : self.dv].contiguous()
        return o, self.lse


def _run(q, k, v, is_causal, scale, layout, return_lse, granularity, scheme=_C.SCHEME_SAGE2_8B,
         lse_tensor=True, p_max=False, **mask):
    """One forward through the C ABI; `mask` holds the mask arguments that are not at
    their defaults (_mask_options); `scheme` a qattn_scheme. Returns (o, lse); without
    return_lse, lse is an empty tensor (lse_tensor, what an op returns) or None. With
    p_max=True it returns (o, lse, p_max), p_max P's (B, Hq, Nq) float32 row maxima
    exp(m_i - lse_i) as the kernel computed them (the SageAttention2-8b family writes
    them: head dims up to 128, not in a packed batch; _writes_p_max).
    A call whose plan is cached (_plan_key) skips the checks, the workspace query and
    the argument building that its first call made."""
    if q.device.type != "cuda":
        raise invalid(f"q is on {q.device}; allowed: a CUDA device")
    key = None
    if "kv_lengths" not in mask and "attn_mask" not in mask:
        key = _plan_key(q, k, v, 1 if is_causal else 0, scale, layout, bool(return_lse),
                        granularity, scheme, mask.get("window_left", -1),
                        mask.get("window_right", -1), mask.get("alignment", "bottom_right"),
                        bool(p_max))
    # The C library runs on the current device; switching costs host time, so only when
    # q lives elsewhere.
    index = q.get_device()
    if index == _current_device():
        if key is not None:
            plan = _plans.get(key)
            if plan is not None:
                out = _launch_plan(plan, q, k, v, return_lse, lse_tensor, index)
                if out is not None:
                    return out
        return _run_call(key, q, k, v, is_causal, scale, layout, return_lse, granularity,
                         scheme, lse_tensor, mask, p_max)
    with torch.cuda.device(q.device):
        return _run_call(key, q, k, v, is_causal, scale, layout, return_lse, granularity, scheme,
                         lse_tensor, mask, p_max)


def _run_call(key, q, k, v, is_causal, scale, layout, return_lse, granularity, scheme, lse_tensor,
              mask, p_max=False):
    """_run through _Call (every check, the C workspace query); keeps the call's plan
    under `key` where it can serve the next call of that key."""
    call = _Call(q, k, v, is_causal, scale, layout, return_lse, granularity, scheme=scheme,
                 p_max=p_max, **mask)
    call.launch()
    if (key is not None and call.q is q and call.k is k and call.v is v and call.d == call.d_pad
            and call.dv == call.dv_pad):
        _keep_plan(key, _Plan(call))
    o, lse = call.outputs()
    lse = lse if return_lse or lse_tensor else None
    return (o, lse, call.p_max) if p_max else (o, lse)


# ---- plans: what the first call of a shape computes, for the next ones ----------------
#
# A call's checks (_check_inputs, _check_mask, the C workspace query's validation), its
# workspace size and the C ABI's arguments other than the pointers depend only on the
# inputs' shapes, strides, dtypes and devices and on the options: _plan_key. A call that
# finds its key skips all of that (the C forward validates everything again, pointers
# included, before it launches anything). A plan is kept only for inputs the C ABI takes
# as they are (no copy, no padded head_dim) and with no mask tensor; a pointer that is
# not 16-byte aligned (the one fact of the inputs a key does not hold) sends that call
# through _Call, which copies it.

_plans = {}  # _plan_key -> _Plan
_PLANS_MAX = 512  # a process with more shapes than this starts the cache again


def _plan_key(q, k, v, causal, scale, layout, return_lse, granularity, scheme, window_left,
              window_right, alignment, p_max=False):
    """The plan key of a call, or None where the call takes no plan (an option of a type
    a key cannot hold the way the checks read it: a bool or tensor scale, a non-str
    layout, ...). causal is 0 or 1, return_lse and p_max bools."""
    if not (scale is None or type(scale) is float or type(scale) is int) or not (
            type(layout) is str and type(granularity) is str and type(alignment) is str
            and type(window_left) is int and type(window_right) is int):
        return None
    # Devices by type and index (an index alone would not tell cuda:0 from another
    # backend's device 0).
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, causal, scale, layout, return_lse,
            granularity, scheme, window_left, window_right, alignment, p_max)


def _keep_plan(key, plan) -> None:
    if len(_plans) >= _PLANS_MAX:
        _plans.clear()
    _plans[key] = plan


class _Plan:
    """The C ABI's arguments of a _Call but its pointers, and its workspace size."""

    __slots__ = ("q_strides", "k_strides", "v_strides", "o_strides", "o_shape", "o_like_q",
                 "lse_shape", "fixed", "mask", "scheme", "ws_bytes", "keywords", "p_max_shape")

    def __init__(self, call: "_Call"):
        q, k, v, o, _, *fixed = call.args
        self.q_strides, self.k_strides, self.v_strides, self.o_strides = (
            q[1:], k[1:], v[1:], o[1:])
        self.o_shape, self.lse_shape = tuple(call.o.shape), tuple(call.lse.shape)
        # Where q itself has O's strides (q contiguous, every stride the contiguous one),
        # torch.empty_like(q) is O's allocation: the same tensor, cheaper to ask for.
        self.o_like_q = call.q.stride() == call.o.stride() and call.q.is_contiguous()
        self.fixed = tuple(fixed)  # dtype, shape, causal, sm_scale, granularity
        self.mask, self.scheme, self.ws_bytes = call.mask, call.scheme, call.ws_bytes
        self.keywords = {"head_dim_v": call.head_dim_v}  # the forward's keyword arguments
        # P's row maxima: their (B, Hq, Nq) shape where the call writes them, else None.
        self.p_max_shape = tuple(call.p_max.shape) if call.p_max_ptr else None


def _launch_plan(plan: _Plan, q, k, v, return_lse, lse_tensor, index):
    """The call of `plan` on these inputs (q's device current): (o, lse), (o, lse, p_max)
    for a plan that writes P's row maxima, or None where a pointer is not 16-byte aligned
    (then _Call copies that input)."""
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) % _ALIGN_BYTES != 0:
        return None
    o = torch.empty_like(q) if plan.o_like_q else q.new_empty(plan.o_shape)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32) if return_lse or lse_tensor else None
    stream = _current_stream(index)
    ws_bytes = plan.ws_bytes
    args = ((qp,) + plan.q_strides, (kp,) + plan.k_strides, (vp,) + plan.v_strides,
            (o.data_ptr(),) + plan.o_strides, lse.data_ptr() if return_lse else 0, *plan.fixed)
    p_max = None
    extra = plan.keywords  # the keywords _Call.launch passes
    if plan.p_max_shape is not None:
        p_max = q.new_empty(plan.p_max_shape, dtype=torch.float32)
        extra = {**extra, "p_max": p_max.data_ptr()}
    if ws_bytes == 0:
        status = _C.forward(*args, 0, 0, stream, False, plan.mask, plan.scheme, **extra)
    elif _raw_alloc is not None:
        # The caching allocator's block, freed when the call is enqueued: stream-ordered
        # like a tensor's (the next allocation on this stream runs after this call).
        workspace = _raw_alloc(ws_bytes, stream)
        try:
            status = _C.forward(*args, workspace, ws_bytes, stream, False, plan.mask, plan.scheme,
                                **extra)
        finally:
            _raw_delete(workspace)
    else:
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
        status = _C.forward(*args, workspace.data_ptr(), ws_bytes, stream, False, plan.mask,
                            plan.scheme, **extra)
    check(status)
    return (o, lse) if p_max is None else (o, lse, p_max)


# PyTorch's cheap forms of the current device, the current stream and a stream-ordered
# allocation (private hooks, looked up defensively; a PyTorch version without one takes
# the public call).
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
if _raw_alloc is None or _raw_delete is None:
    _raw_alloc = _raw_delete = None


def _current_device() -> int:
    """The current CUDA device's index (the calling thread's)."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def _current_stream(index: int) -> int:
    """The current stream of CUDA device `index`, as the cudaStream_t's integer."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


# Private PyTorch hooks that say whether a dispatch or function mode is active; where a
# PyTorch version lacks one, every call takes the dispatcher.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _direct_call_ok(q, k, v) -> bool:
    """True for a plain eager call that needs nothing of the dispatcher: the op's
    dispatch (torch.library) costs tens of microseconds of host time per call, about
    the GPU time of a short sequence. Traced calls (torch.compile), tensor subclasses,
    active dispatch or function modes go through the op; calls that record autograd
    take the training op (see _forward)."""
    if _dispatch_modes is None or _function_modes is None:
        return False
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    if not (q.is_cuda and k.is_cuda and v.is_cuda):  # meta tensors take the fake implementation
        return False
    if torch.compiler.is_compiling() or _dispatch_modes() or _function_modes():
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


# ---- the custom op -----------------------------------------------------------------


@torch.library.custom_op("qattn::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    layout: str,
    return_lse: bool,
    granularity: str,
    kv_lengths: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    alignment: str = "bottom_right",
    attn_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """is_causal and the window are aligned as `alignment` says (the C ABI's default,
    "bottom_right", unless given); kv_lengths is a (B,) int32/int64 tensor or None;
    attn_mask a torch.bool tensor broadcastable to (B, Hq, Nq, Nkv) (True = attend) or
    None, alone (with none of is_causal, the window and kv_lengths)."""
    return _run(q, k, v, is_causal, scale, layout, return_lse, granularity,
                **_mask_options(kv_lengths, window_left, window_right, alignment, attn_mask))


@_attention_op.register_fake
def _attention_fake(q, k, v, is_causal, scale, layout, return_lse, granularity, kv_lengths=None,
                    window_left=-1, window_right=-1, alignment="bottom_right", attn_mask=None):
    _check_inputs(q, k, v, layout, scale, granularity)
    _check_mask(q, k, layout, is_causal, kv_lengths, window_left, window_right, alignment,
                attn_mask)
    b, hq, nq, _ = _bhnd(q, layout)
    o = q.new_empty((*q.shape[:-1], v.shape[-1]))  # V's head dim
    lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
    return o, lse


@torch.library.custom_op("qattn::attention_sa3_nvfp4", mutates_args=())
def _attention_sa3_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    layout: str,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """SageAttention3's NVFP4 forward (scheme QATTN_SCHEME_SAGE3_NVFP4); is_causal aligned
    bottom-right."""
    return _run(q, k, v, is_causal, scale, layout, return_lse, "per_thread",
                scheme=_C.SCHEME_SAGE3_NVFP4)


@_attention_sa3_op.register_fake
def _attention_sa3_fake(q, k, v, is_causal, scale, layout, return_lse):
    return _attention_fake(q, k, v, is_causal, scale, layout, return_lse, "per_thread")


@torch.library.custom_op("qattn::attention_precision", mutates_args=())
def _attention_precision_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    layout: str,
    return_lse: bool,
    precision: str,
    kv_lengths: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    alignment: str = "bottom_right",
    attn_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward in precision "auto" (QATTN_SCHEME_SAGE2_8B_AUTO) or "precise"
    (QATTN_SCHEME_PRECISE16), with the masks of qattn::attention."""
    return _run(q, k, v, is_causal, scale, layout, return_lse, "per_thread",
                scheme=_PRECISIONS[precision],
                **_mask_options(kv_lengths, window_left, window_right, alignment, attn_mask))


@_attention_precision_op.register_fake
def _attention_precision_fake(q, k, v, is_causal, scale, layout, return_lse, precision,
                              kv_lengths=None, window_left=-1, window_right=-1,
                              alignment="bottom_right", attn_mask=None):
    return _attention_fake(q, k, v, is_causal, scale, layout, return_lse, "per_thread",
                           kv_lengths, window_left, window_right, alignment, attn_mask)


def _keep_mask(ctx, mask_inputs):
    """Keeps an op's mask inputs for its backward: the options other than the tensors in
    ctx.mask_sides; returns (kv_lengths, attn_mask), each None or a tensor, for
    save_for_backward."""
    mask = _mask_inputs(mask_inputs)
    tensors = mask.pop("kv_lengths", None), mask.pop("attn_mask", None)
    ctx.mask_sides = mask
    return tensors


def _kept_mask(ctx, kv_lengths, attn_mask) -> dict:
    """The mask options _keep_mask kept, with the saved kv_lengths and attn_mask."""
    mask = dict(ctx.mask_sides)
    if kv_lengths is not None:
        mask["kv_lengths"] = kv_lengths
    if attn_mask is not None:
        mask["attn_mask"] = attn_mask
    return mask


def _input_grads(ctx, grads):
    """(dq, dk, dv) and None for every other input the op was given."""
    return (*grads, *([None] * (len(ctx.needs_input_grad) - len(grads))))


def _attention_setup(ctx, inputs, output):
    q, k, v, is_causal, scale, layout, return_lse, granularity, *mask = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *_keep_mask(ctx, mask))
    ctx.options = (is_causal, scale, layout, return_lse, granularity)


def _attention_backward(ctx, grad_o, grad_lse):
    """Autograd of the inference op, for callers of torch.ops.qattn.attention itself
    (qattn.attention takes qattn::attention_train when autograd records). The backward
    needs the per-block forward's O and LSE, and with the merge-free scales its P row
    maxima too (which the inference op never writes); a call that did not produce what
    the backward needs runs the training forward again first."""
    q, k, v, o, lse, kv_lengths, attn_mask = ctx.saved_tensors
    is_causal, scale, layout, return_lse, granularity = ctx.options
    mask = _kept_mask(ctx, kv_lengths, attn_mask)
    options = get_backward_options()
    p_max = None
    if options["scales"] == "merge_free":
        o, lse, p_max = torch.ops.qattn.attention_train(q, k, v, is_causal, scale, layout, False,
                                                        **mask)
    elif not (return_lse and granularity == "per_block"):
        o, lse = torch.ops.qattn.attention(q, k, v, is_causal, scale, layout, True, "per_block",
                                           **mask)
    grads = _call_backward(grad_o, q, k, v, o, lse, grad_lse if return_lse else None,
                           is_causal, scale, layout, p_max=p_max, options=options, **mask)
    return _input_grads(ctx, grads)


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("qattn::attention_train", mutates_args=())
def _attention_train_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    layout: str,
    lse_grad: bool,
    bwd_format: str = "int8",
    bwd_dov: str = "16bit",
    bwd_deterministic: bool = False,
    bwd_scales: str = "per_block",
    kv_lengths: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    alignment: str = "bottom_right",
    attn_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training forward: O, the (B, Hq, Nq) LSE with per-block Q/K groups, and P's
    (B, Hq, Nq) float32 row maxima p_max = exp(m_i - lse_i) (m_i the row's largest scaled
    score as the kernel computed it, 0 for a row that sees no key), which the merge-free
    backward reads; an empty float32 tensor where the forward does not write them (head
    dims above 128: _writes_p_max). One float a row, written whatever the backward options
    say, so that a backward of either scales finds what it needs. lse_grad says whether
    the caller sees the LSE (then its gradient is honoured). The mask arguments as for
    qattn::attention. bwd_*: the backward options this forward's backward runs with
    (set_backward_options' when it ran): arguments of the op, so that a graph
    torch.compile traces holds them and its caches key on them."""
    _check_backward_options(bwd_format, bwd_dov, bwd_scales)
    mask = _mask_options(kv_lengths, window_left, window_right, alignment, attn_mask)
    if _writes_p_max(q, layout):
        return _run(q, k, v, is_causal, scale, layout, True, "per_block", p_max=True, **mask)
    o, lse = _run(q, k, v, is_causal, scale, layout, True, "per_block", **mask)
    return o, lse, _no_p_max(q)


@_attention_train_op.register_fake
def _attention_train_fake(q, k, v, is_causal, scale, layout, lse_grad, bwd_format="int8",
                          bwd_dov="16bit", bwd_deterministic=False, bwd_scales="per_block",
                          kv_lengths=None, window_left=-1, window_right=-1,
                          alignment="bottom_right", attn_mask=None):
    _check_backward_options(bwd_format, bwd_dov, bwd_scales)
    o, lse = _attention_fake(q, k, v, is_causal, scale, layout, True, "per_block", kv_lengths,
                             window_left, window_right, alignment, attn_mask)
    return o, lse, (lse.new_empty(lse.shape) if _writes_p_max(q, layout) else _no_p_max(q))


# The head dims whose training forward writes P's row maxima: the SageAttention2-8b
# family that writes them (sage2_fwd_sm90, qattn_fwd_params' p_max) runs head dims up to
# 128 (padded to a multiple of 8); the head-dim-256 family writes none.
_P_MAX_HEAD_DIM = 128


def _writes_p_max(q, layout) -> bool:
    """Whether the training forward of q writes P's row maxima: a rule of q's head dim
    alone, so that the fake implementation gives the real one's shapes."""
    return -(-q.shape[-1] // _ROW_MULTIPLE) * _ROW_MULTIPLE <= _P_MAX_HEAD_DIM


def _no_p_max(q) -> torch.Tensor:
    """The p_max of a forward that wrote none: an empty float32 tensor on q's device."""
    return q.new_empty((0,), dtype=torch.float32)


def _train_setup(ctx, inputs, output):
    q, k, v, is_causal, scale, layout, lse_grad, *rest = inputs
    (bwd_format, bwd_dov, bwd_deterministic, bwd_scales), mask = rest[:4], rest[4:]
    o, lse, p_max = output
    ctx.mark_non_differentiable(p_max)  # an input of the backward, never differentiated
    ctx.save_for_backward(q, k, v, o, lse, p_max, *_keep_mask(ctx, mask))
    ctx.options = (is_causal, scale, layout, lse_grad)
    ctx.backward_options = {"format": bwd_format, "dov": bwd_dov,
                            "deterministic": bwd_deterministic, "scales": bwd_scales}


def _train_backward(ctx, grad_o, grad_lse, grad_p_max):
    q, k, v, o, lse, p_max, kv_lengths, attn_mask = ctx.saved_tensors
    is_causal, scale, layout, lse_grad = ctx.options
    # An LSE the caller never saw gets a gradient of zeros from autograd: skipping it
    # saves the two extra calls its term costs (see _backward_cuda).
    grads = _call_backward(grad_o, q, k, v, o, lse, grad_lse if lse_grad else None,
                           is_causal, scale, layout, p_max=p_max, options=ctx.backward_options,
                           **_kept_mask(ctx, kv_lengths, attn_mask))
    return _input_grads(ctx, grads)


_attention_train_op.register_autograd(_train_backward, setup_context=_train_setup)


# ---- backward options --------------------------------------------------------------

_BWD_FORMATS = {"int8": _C.BWD_INT8, "e4m3": _C.BWD_E4M3}
_BWD_DOVS = {"16bit": _C.BWD_DOV_16BIT, "quantized": _C.BWD_DOV_QUANTIZED}
_BWD_SCALES = {"per_block": _C.BWD_SCALES_PER_BLOCK, "merge_free": _C.BWD_SCALES_MERGE_FREE}
_DETERMINISTIC_ENV = "QATTN_BWD_DETERMINISTIC"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
# deterministic None: the environment variable decides, read with the options.
_bwd_options = {"format": "int8", "dov": "16bit", "deterministic": None, "scales": "per_block"}
_bwd_lock = threading.Lock()


def _env_deterministic() -> bool:
    value = os.environ.get(_DETERMINISTIC_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{_DETERMINISTIC_ENV} = {os.environ[_DETERMINISTIC_ENV]!r}; allowed: "
        f"{', '.join(repr(x) for x in _TRUE + _FALSE[1:])} or unset"
    )


_KEEP = object()  # an argument of set_backward_options that was not given


def set_backward_options(format: str = _KEEP, dov: str = _KEEP, deterministic=_KEEP,
                         scales: str = _KEEP) -> dict:
    """Options of qattn's SageBwd backward, for the backward of every later training
    forward in this process: qattn.attention and the SDPA drop-in read them when a
    forward that autograd records runs, and its backward runs with those (options set
    between a forward and its backward apply from the next forward on). Under
    torch.compile they are read when the forward is traced, become part of the graph
    (a change recompiles it; the compiled-graph caches never answer with a backward
    traced under other options). A direct caller of torch.ops.qattn.attention under
    autograd, and qattn.distributed, get the options in force when the backward runs.
    Arguments not given keep their current value. Returns the previous options, so that
    a caller can restore them with set_backward_options(**previous).

    format: "int8" (default; SageBwd) or "e4m3" (the paper's FP8 comparison) for the
      four 8-bit products S = Q·Kᵀ, dV = P̂ᵀ·dO, dQ = dS·K, dK = dSᵀ·Q.
    dov: "16bit" (default; dP = dO·Vᵀ in the inputs' FP16/BF16) or "quantized" (dP in
      the 8-bit format too, the paper's ablation).
    deterministic: False: dQ is accumulated with FP32 atomics (its low bits may differ
      run to run); True: bitwise-equal results run to run (slower); None (the
      default): the environment variable QATTN_BWD_DETERMINISTIC decides
      (1/true/yes/on or 0/false/no/off; unset is off), read when the options are.
    scales: how the 8-bit products are scaled. "per_block" (default; SageBwd's): per
      64-row Q block, per 128-key KV tile and per tile of P and dS, partial sums
      rescaled as the maxima grow. "merge_free": every scale fixed before the kernel
      runs, so no partial sum is ever rescaled (on an H200 at d 128: 25% faster than
      INT8 at 4K tokens, 11% causal; 2-13% slower at 1K): P·448 unscaled, dO and each
      row's s_i·Q per channel over a KV head's query heads, dS per query row by a bound
      s_i = p_max_i·(Σ_c |dO_ic|·max|V_c| + |D_i|)/448, where p_max_i = exp(m_i - lse_i)
      is P's row maximum, which the training forward writes beside the LSE. For format
      "e4m3" with dov "16bit" only (INT8's linear codes cannot take a scale fixed from a
      bound; the bound is built on the 16-bit dO·Vᵀ): a call whose resulting options
      combine "merge_free" with format "int8" or dov "quantized" raises ValueError
      naming both, and changes nothing; set them together, e.g.
      set_backward_options(format="e4m3", scales="merge_free"). Accuracy: about that of
      per-block E4M3 (gradient CosSim to FP64 within a few 1e-4 of it on Gaussian
      inputs). A backward whose forward wrote no row maxima (head dims above 128, or an
      O and LSE merged from several calls, as qattn.distributed's ring attention does)
      runs with per-block E4M3 scales instead, with a QattnFallbackWarning once.

    A backward the library declines with these options (e.g. a format its GPU kernel
    does not run) follows the fallback mode (qattn.set_fallback)."""
    if format is not _KEEP and format not in _BWD_FORMATS:
        raise ValueError(f"format = {format!r}; allowed: 'int8' (the default) or 'e4m3'")
    if dov is not _KEEP and dov not in _BWD_DOVS:
        raise ValueError(f"dov = {dov!r}; allowed: '16bit' (the default) or 'quantized'")
    if deterministic is not _KEEP and deterministic is not None and type(deterministic) is not bool:
        raise ValueError(
            f"deterministic = {deterministic!r}; allowed: True, False or None (from "
            f"{_DETERMINISTIC_ENV})"
        )
    if scales is not _KEEP and scales not in _BWD_SCALES:
        raise ValueError(f"scales = {scales!r}; allowed: 'per_block' (the default) or "
                         "'merge_free' (format 'e4m3' with dov '16bit' only)")
    given = {name: value for name, value in (("format", format), ("dov", dov),
                                             ("deterministic", deterministic), ("scales", scales))
             if value is not _KEEP}
    with _bwd_lock:
        previous = dict(_bwd_options)
        _check_scales_combination({**previous, **given}, given)
        _bwd_options.update(given)
    return previous


def _forward_backward_options() -> dict:
    """The options in force, as a training forward records them for its backward. Read
    without the lock (one dict copy, atomic in CPython) so that torch.compile traces the
    read: the values become constants of the traced graph, guarded, and part of the keys
    of its compiled-graph caches. A backward graph cached under other options is then
    never reused."""
    return _resolved(dict(_bwd_options))


def _resolved(options: dict) -> dict:
    """`options` (a copy of _bwd_options) with deterministic None read from the environment."""
    if options["deterministic"] is None:
        options["deterministic"] = _env_deterministic()
    return options


def _check_backward_options(format, dov, scales="per_block", prefix="bwd_") -> None:
    """Named errors for option values outside their sets; `prefix` names the arguments as
    the calling op spells them."""
    for name, value, allowed in (("format", format, _BWD_FORMATS), ("dov", dov, _BWD_DOVS),
                                 ("scales", scales, _BWD_SCALES)):
        if value not in allowed:
            raise invalid(f"{prefix}{name} = {value!r}; allowed: "
                          f"{', '.join(map(repr, allowed))}")


def _check_scales_combination(options: dict, given: dict) -> None:
    """ValueError where `options` (what set_backward_options would leave in force) combine
    the merge-free scales with a format or dov they do not run; `given` (the arguments of
    the call) says which of the named options come from the ones already in force."""
    if options["scales"] != "merge_free":
        return
    named = [name for name, ok in (("format", "e4m3"), ("dov", "16bit")) if options[name] != ok]
    if not named:
        return
    in_force = [name for name in ["scales", *named] if name not in given]
    raise ValueError(
        "scales = 'merge_free' with "
        + " and ".join(f"{name} = {options[name]!r}" for name in named)
        + (f" ({' and '.join(in_force)} already in force)" if in_force else "")
        + "; allowed: the merge-free scales with format 'e4m3' and dov '16bit' only (set "
        "them in one call: set_backward_options(format='e4m3', dov='16bit', "
        "scales='merge_free')), or scales 'per_block' with any format and dov")


def get_backward_options() -> dict:
    """The backward options in force now: {"format", "dov", "deterministic", "scales"},
    with deterministic read from QATTN_BWD_DETERMINISTIC where it is None (not set)."""
    with _bwd_lock:
        return _resolved(dict(_bwd_options))


def _call_backward(grad_o, q, k, v, o, lse, grad_lse, is_causal, scale, layout, p_max=None,
                   options=None, **mask):
    """The backward op with `options` (a training forward's recorded ones), or with the
    options in force now where None. p_max: the training forward's P row maxima, read
    with the merge-free scales; None or an empty tensor where the forward wrote none
    (then those scales give way to per-block ones for this call, _backward_scales)."""
    options = get_backward_options() if options is None else options
    return torch.ops.qattn.attention_backward(
        grad_o, q, k, v, o, lse, grad_lse, is_causal, scale, layout,
        options["format"], options["dov"], options["deterministic"], **mask,
        **_backward_scales(options, p_max),
    )


def _backward_scales(options: dict, p_max) -> dict:
    """The backward op's scales arguments for these options: none for per-block scales (a
    call then dispatches the arguments it always had); scales and p_max for the
    merge-free ones where the forward wrote p_max. Where it wrote none (an empty tensor:
    head dims above 128; None: an O and LSE that no single training forward produced),
    the call runs per-block scales in the same format, with a QattnFallbackWarning once:
    still qattn's backward at per-block E4M3 accuracy, in either fallback mode."""
    if options.get("scales", "per_block") != "merge_free":
        return {}
    if p_max is not None and p_max.numel() > 0:  # a shape fact: no sync, static when traced
        return {"scales": "merge_free", "p_max": p_max}
    fallback.warn_once(
        "backward scales merge_free without p_max", "",
        "qattn backward: the merge-free scales need P's row maxima (p_max) from the training "
        "forward, which this call's forward did not write (head dims above 128, or an O and "
        "LSE merged from several calls); running it with per-block E4M3 scales instead "
        "(warned once)", stacklevel=3)
    return {}


# ---- the backward op ---------------------------------------------------------------


@torch.library.custom_op("qattn::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    layout: str,
    format: str,
    dov: str,
    deterministic: bool,
    scales: str = "per_block",
    p_max: Optional[torch.Tensor] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    alignment: str = "bottom_right",
    attn_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of qattn::attention_train: dq like q, dk and dv like k (summed over
    each KV head's query heads), each contiguous in `layout`. is_causal and the mask
    arguments as in the forward (last, as in every op). scales: "per_block" (default) or
    "merge_free" (format "e4m3" and dov "16bit" only), with p_max the training forward's
    (B, Hq, Nq) float32 row maxima (None with "per_block"); see set_backward_options. On CUDA the SageBwd
    kernel; off CUDA (and where SageBwd or the library declines, under the fallback mode:
    any mask beyond bottom-right causal, an attn_mask included) the exact attention
    gradients in FP32, which need neither scales nor p_max."""
    _check_backward(grad_o, q, k, v, o, lse, grad_lse, layout, scale, format, dov, scales, p_max)
    _check_mask(q, k, layout, is_causal, kv_lengths, window_left, window_right, alignment,
                attn_mask)
    mask = _mask_options(kv_lengths, window_left, window_right, alignment, attn_mask)
    if q.device.type != "cuda":
        return _backward_math(grad_o, q, k, v, grad_lse, is_causal, scale, layout, **mask)
    same = q.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(q.device):
        return _backward_cuda(grad_o, q, k, v, o, lse, grad_lse, is_causal, scale, layout,
                              format, dov, deterministic, scales=scales, p_max=p_max, **mask)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_o, q, k, v, o, lse, grad_lse, is_causal, scale, layout,
                             format, dov, deterministic, scales="per_block", p_max=None,
                             kv_lengths=None, window_left=-1, window_right=-1,
                             alignment="bottom_right", attn_mask=None):
    _check_backward(grad_o, q, k, v, o, lse, grad_lse, layout, scale, format, dov, scales, p_max)
    _check_mask(q, k, layout, is_causal, kv_lengths, window_left, window_right, alignment,
                attn_mask)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check_backward(grad_o, q, k, v, o, lse, grad_lse, layout, scale, format, dov,
                    scales="per_block", p_max=None):
    _check_inputs(q, k, v, layout, scale, "per_block")
    if v.shape[-1] != k.shape[-1]:
        raise QattnUnsupportedError(
            "backward", f"v's head dim {v.shape[-1]} differs from k's {k.shape[-1]}: SageBwd "
            "takes one head dim for Q, K and V")
    b, hq, nq, _ = _bhnd(q, layout)
    for name, t in (("grad_o", grad_o), ("o", o)):
        if tuple(t.shape) != tuple(q.shape) or t.dtype != q.dtype or t.device != q.device:
            raise invalid(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; allowed: q's "
                          f"shape {tuple(q.shape)}, dtype and device")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and (tuple(t.shape) != (b, hq, nq) or t.dtype != torch.float32
                              or t.device != q.device):
            raise invalid(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; allowed: "
                          f"({b}, {hq}, {nq}) torch.float32 on q's device")
    _check_backward_options(format, dov, scales, prefix="")
    if scales != "merge_free":
        if p_max is not None:
            raise invalid(f"p_max is set with scales = {scales!r}; allowed: None (only the "
                          "merge-free scales read it)")
        return
    for name, value, ok in (("format", format, "e4m3"), ("dov", dov, "16bit")):
        if value != ok:
            raise invalid(f"scales = 'merge_free' with {name} = {value!r}; allowed: {name} "
                          f"{ok!r} only with the merge-free scales")
    if p_max is None:
        raise invalid("p_max is None with scales = 'merge_free'; allowed: the training "
                      f"forward's ({b}, {hq}, {nq}) torch.float32 row maxima on q's device")
    if (tuple(p_max.shape) != (b, hq, nq) or p_max.dtype != torch.float32
            or p_max.device != q.device):
        raise invalid(f"p_max is {tuple(p_max.shape)} {p_max.dtype} on {p_max.device}; allowed: "
                      f"({b}, {hq}, {nq}) torch.float32 on q's device")


def _sagebwd_declines(q, k, layout, is_causal, kv_lengths=None, window_left=-1, window_right=-1,
                      alignment="bottom_right", attn_mask=None) -> Optional[Tuple[str, str]]:
    """None where SageBwd runs the call's mask; otherwise (reason key, why). SageBwd, and
    qattn_bwd_params, know causal aligned bottom-right only: no window, no key padding, no
    top-left alignment where it changes the mask (Nq != Nkv), no attn_mask."""
    nq, nkv = _bhnd(q, layout)[2], _bhnd(k, layout)[2]
    window = window_left >= 0 or (not is_causal and window_right >= 0)
    seen = []
    if window:
        seen.append(("window", f"a sliding window (window_left = {window_left}, "
                               f"window_right = {window_right})"))
    if kv_lengths is not None:
        seen.append(("kv_lengths", "key-padding lengths (kv_lengths)"))
    if alignment == "top_left" and nq != nkv and (is_causal or window):
        seen.append(("top_left", f"a top-left aligned mask with Nq = {nq} != Nkv = {nkv}"))
    if attn_mask is not None:
        seen.append(("attn_mask", "a boolean attn_mask"))
    if not seen:
        return None
    return (f"mask {'+'.join(key for key, _ in seen)}",
            f"SageBwd runs no mask but causal aligned bottom-right, and this call has "
            f"{' and '.join(what for _, what in seen)}")


def _backward_cuda(grad_o, q, k, v, o, lse, grad_lse, is_causal, scale, layout, format, dov,
                   deterministic, scales="per_block", p_max=None, **mask):
    declined = _sagebwd_declines(q, k, layout, is_causal, **mask)
    if declined is not None:
        fallback.backward_declined(*declined)
        return _backward_math(grad_o, q, k, v, grad_lse, is_causal, scale, layout, **mask)
    try:
        dq, dk, dv = _bwd_run(grad_o, q, k, v, o, lse, is_causal, scale, layout, format, dov,
                              deterministic, scales=scales, p_max=p_max)
        if grad_lse is not None:
            # The LSE's own gradient g: d lse_i / d S_ij = P_ij, so dS gains g_i·P_ij,
            # dQ gains scale·g_i·Σ_j P_ij·k_j = scale·g ∘ attention(q, k, k), and dK gains
            # scale·Σ_i P_ij·g_i·q_i, the dV of a backward with dO = g ∘ q. The C ABI
            # takes no such term, so it costs one forward and one backward more.
            sm = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            g = grad_lse[..., None] if layout == "HND" else grad_lse.transpose(1, 2)[..., None]
            pk, _ = _run(q, k, k, is_causal, scale, layout, False, "per_block")
            dq = (dq.float() + sm * g * pk.float()).to(q.dtype)
            gq = (g * q.float()).to(q.dtype)
            # The same scales: the merge-free bound s_i is built from this call's dO.
            _, _, pq = _bwd_run(gq, q, k, v, o, lse, is_causal, scale, layout, format, dov,
                                deterministic, scales=scales, p_max=p_max)
            dk = (dk.float() + sm * pq.float()).to(k.dtype)
        return dq, dk, dv
    except QattnError as error:
        if error.status not in (_C.ERROR_INVALID_ARGUMENT, _C.ERROR_UNSUPPORTED):
            raise

        fallback.backward_declined(f"library {error.status_name}",
                               f"the qattn library declined the backward ({error})")
        return _backward_math(grad_o, q, k, v, grad_lse, is_causal, scale, layout)


def _bwd_run(grad_o, q, k, v, o, lse, is_causal, scale, layout, format, dov, deterministic,
             scales="per_block", p_max=None):
    """One SageBwd call through the C ABI; p_max (the forward's row maxima) is passed with
    the merge-free scales only."""
    b, hq, nq, d = _bhnd(q, layout)
    _, hkv, nkv, _ = _bhnd(k, layout)
    # As in the forward: zero columns up to a multiple of 8 change no score and no
    # output, and their gradients (dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO on zero columns)
    # are cut off below.
    d_pad = -(-d // _ROW_MULTIPLE) * _ROW_MULTIPLE
    qq, kk, vv, oo, gg = (_usable(t, layout, d_pad) for t in (q, k, v, o, grad_o))
    lse = lse.contiguous()
    merge_free = scales == "merge_free"
    p_max = p_max.contiguous() if merge_free else None
    extra = {"scales": _BWD_SCALES[scales], "p_max": p_max.data_ptr() if merge_free else 0}
    dq, dk, dv = qq.new_empty(qq.shape), kk.new_empty(kk.shape), vv.new_empty(vv.shape)
    args = (
        _tensor_arg(qq, layout), _tensor_arg(kk, layout), _tensor_arg(vv, layout),
        _tensor_arg(oo, layout), _tensor_arg(gg, layout), lse.data_ptr(),
        _tensor_arg(dq, layout), _tensor_arg(dk, layout), _tensor_arg(dv, layout),
        _DTYPES[q.dtype], (b, hq, hkv, nq, nkv, d_pad), 1 if is_causal else 0,
        float(scale) if scale is not None else 1.0 / math.sqrt(d),  # the caller's d
        _BWD_FORMATS[format], _BWD_DOVS[dov], bool(deterministic),
    )
    status, ws_bytes = _C.bwd_workspace_size(*args, **extra)
    check(status)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
    stream = _current_stream(q.device.index)
    check(_C.bwd(*args, workspace.data_ptr(), ws_bytes, stream, **extra))
    if d != d_pad:
        dq, dk, dv = (t[..., :d].contiguous() for t in (dq, dk, dv))
    return dq, dk, dv


_MATH_CHUNK = 1 << 25  # FP32 elements of one score block (128 MiB) in _backward_math


def _visible_keys(i0, i1, nq, nkv, device, is_causal, kv_lengths=None, window_left=-1,
                  window_right=-1, alignment="bottom_right", attn_mask=None, heads=None):
    """Which keys query rows i0..i1-1 see, by qattn.h's rule: a boolean tensor that
    broadcasts against scores (B, Hkv, g, rows, Nkv), or None for every key. Row i's
    diagonal key is D(i) = i + Nkv - Nq (bottom-right) or i (top-left); it sees key j iff
    j <= D(i) + right (right = 0 with causal), j >= D(i) - window_left, j <
    kv_lengths[b], and attn_mask[b, h, i, j] (broadcast to (B, Hq, Nq, Nkv); heads = (B,
    Hkv, g) splits Hq), each where set."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(nkv, device=device)[None, :]
    diag = i + (nkv - nq if alignment == "bottom_right" else 0)
    right = 0 if is_causal else window_right
    rules = []
    if right >= 0:
        rules.append(j <= diag + right)
    if window_left >= 0:
        rules.append(j >= diag - window_left)
    if kv_lengths is not None:
        lengths = kv_lengths.to(device=device, dtype=torch.int64).clamp(0, nkv)
        rules.append(j < lengths.reshape(-1, 1, 1, 1, 1))
    if attn_mask is not None:
        b, hkv, g = heads
        # A view: the broadcast dimensions keep stride 0 and the head split needs none.
        m = attn_mask.to(device).expand(b, hkv * g, nq, nkv)[:, :, i0:i1]
        rules.append(m.unflatten(1, (hkv, g)))
    seen = None
    for rule in rules:
        seen = rule if seen is None else seen & rule
    return seen


def _backward_math(grad_o, q, k, v, grad_lse, is_causal, scale, layout, **mask):
    """The exact gradients of softmax(scale·Q·Kᵀ)·V (and of the LSE), in FP32 from the
    same inputs: the fallback where the library declines, and the path off CUDA. An op
    implementation runs below autograd, so this is PyTorch's SDPA math written out
    (tests compare it with autograd through F.scaled_dot_product_attention), over
    blocks of query rows to bound the memory. Causal is bottom-right aligned unless
    `mask` (the mask arguments, _mask_options, a boolean attn_mask among them) says
    otherwise; a row that sees no key has output 0, hence gradient 0."""
    if layout == "NHD":
        q, k, v, grad_o = (t.transpose(1, 2) for t in (q, k, v, grad_o))
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    g = hq // hkv
    sm = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    qf = q.float().reshape(b, hkv, g, nq, d)
    dof = grad_o.float().reshape(b, hkv, g, nq, d)
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # broadcast over the group
    glse = None if grad_lse is None else grad_lse.float().reshape(b, hkv, g, nq)
    dq = torch.empty_like(qf)
    dk = torch.zeros(b, hkv, nkv, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    rows = max(1, _MATH_CHUNK // max(1, b * hq * nkv))
    for i0 in range(0, nq, rows):
        i1 = min(nq, i0 + rows)
        s = torch.matmul(qf[..., i0:i1, :], kf.transpose(-1, -2)) * sm
        seen = _visible_keys(i0, i1, nq, nkv, q.device, is_causal, heads=(b, hkv, g), **mask)
        if seen is not None:
            s = s.masked_fill(~seen, -math.inf)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        l = p.sum(-1, keepdim=True)
        p = p / torch.where(l > 0, l, torch.ones_like(l))
        do = dof[..., i0:i1, :]
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        delta = (do * torch.matmul(p, vf)).sum(-1, keepdim=True)
        if glse is not None:
            delta = delta - glse[..., i0:i1, None]
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
        dq[..., i0:i1, :] = torch.matmul(ds, kf) * sm
        dk += torch.matmul(ds.transpose(-1, -2), qf[..., i0:i1, :]).sum(2) * sm
    dq = dq.reshape(b, hq, nq, d).to(q.dtype)
    dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    if layout == "NHD":
        return tuple(t.transpose(1, 2).contiguous() for t in (dq, dk, dv))
    return dq, dk, dv


# ---- public functions --------------------------------------------------------------


def _narrower_v(q, v) -> bool:
    """Whether v has fewer channels than q (MLA-style head dims, e.g. 128 beside 192)."""
    return (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4
            and v.dim() == 4 and v.shape[-1] != q.shape[-1])


def _records_autograd(q, k, v) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
    )


def _forward(q, k, v, is_causal, scale, layout, return_lse, granularity, **mask):
    """One forward with the C ABI's rules: causal aligned bottom-right unless `mask` (the
    mask arguments not at their defaults, _mask_options) says otherwise. Where autograd
    records the call, the training forward (per-block groups, LSE written); granularity
    applies to inference only."""
    if _records_autograd(q, k, v):
        if granularity not in _GRANULARITIES:
            raise invalid(f"granularity = {granularity!r}; allowed: {', '.join(_GRANULARITIES)}")
        options = _forward_backward_options()
        o, lse, _ = torch.ops.qattn.attention_train(
            q, k, v, is_causal, scale, layout, return_lse, options["format"], options["dov"],
            options["deterministic"], options["scales"], **mask)
        return o, lse
    if _direct_call_ok(q, k, v):
        return _run(q, k, v, is_causal, scale, layout, return_lse, granularity, lse_tensor=False,
                    **mask)
    return torch.ops.qattn.attention(q, k, v, is_causal, scale, layout, return_lse, granularity,
                                     **mask)


def _seq_lengths(q, k, layout):
    """(Nq, Nkv), or None where the inputs are not 4-D tensors in a known layout (the
    call then goes on unchanged and _check_inputs names what is wrong)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or layout not in _LAYOUTS:
        return None
    if q.dim() != 4 or k.dim() != 4:
        return None
    seq = 2 if layout == "HND" else 1
    return q.shape[seq], k.shape[seq]


def _top_left(q, k, v, scale, layout, return_lse, granularity):
    """Causal attention with SDPA's rule, query i sees keys j <= i, from the bottom-right
    rule (query i sees keys j <= i + Nkv - Nq), for training: SageBwd runs bottom-right
    causal only, and each call here is one it runs (inference passes the alignment to
    the kernel instead, one call). Both rules agree when Nq == Nkv.
    Nq < Nkv: keys j >= Nq are never seen, so the kernel runs square on the first Nq keys
    (a view, no copy). Nq > Nkv: rows i < Nkv form a square causal problem with all the
    keys, and rows i >= Nkv see every key (no mask); two calls on views, and the two
    outputs are joined along the sequence (one copy of o). No row is empty."""
    nq, nkv = _seq_lengths(q, k, layout)
    seq = 2 if layout == "HND" else 1
    if nq <= nkv:
        k, v = k.narrow(seq, 0, nq), v.narrow(seq, 0, nq)
        return _forward(q, k, v, True, scale, layout, return_lse, granularity)
    o1, lse1 = _forward(q.narrow(seq, 0, nkv), k, v, True, scale, layout, return_lse, granularity)
    o2, lse2 = _forward(q.narrow(seq, nkv, nq - nkv), k, v, False, scale, layout, return_lse, granularity)
    o = torch.cat((o1, o2), dim=seq)
    lse = torch.cat((lse1, lse2), dim=2) if return_lse else lse1
    return o, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: Optional[float] = None,
    layout: str = "HND",
    return_lse: bool = False,
    *,
    granularity: str = "per_thread",
    causal_alignment: str = "top_left",
    window_size: Tuple[int, int] = _NO_WINDOW,
    kv_lengths: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    scheme: str = "sa2_8b",
    precision: str = "fast",
):
    """SageAttention2-8b attention (INT8 Q·Kᵀ, FP8 P·V) on a Hopper GPU.

    q is (B, Hq, Nq, d) and k, v are (B, Hkv, Nkv, d) for layout "HND", or (B, N, H, d)
    for "NHD"; fp16 or bf16 on one CUDA device; Hq a multiple of Hkv (GQA/MQA: query
    head h reads key/value head h // (Hq / Hkv)); scale defaults to 1/sqrt(d); d <= 256.
    v may have fewer channels than q and k (d_v < d, MLA-style 192 / 128; inference in
    precision "fast" only): o is then (B, Hq, Nq, d_v), at d's cost.
    Head dims 129..256 run on the head-dim-256 kernel (sage2_wide_sm90: one-level
    accumulation, Q quantized by a pass): it takes is_causal, window_size and kv_lengths,
    but no attn_mask, no precision other than "fast" and no backward (QattnError with
    status QATTN_ERROR_UNSUPPORTED names what it lacks; a training call's backward
    follows qattn.set_fallback).
    For a drop-in with SDPA's exact signature and a fallback for what qattn does not
    run, see qattn.scaled_dot_product_attention.

    causal_alignment says where the diagonal of the causal mask and of the window sits
    when Nq != Nkv (it makes no difference when Nq == Nkv): query i's diagonal key is
      "top_left" (default, SDPA's rule): D(i) = i, so with is_causal query i sees keys
        j <= i;
      "bottom_right" (FlashAttention >= 2.1, a KV cache: the queries are the last Nq
        positions): D(i) = i + Nkv - Nq. With is_causal and Nq > Nkv the first Nq - Nkv
        rows see no key.

    window_size = (left, right), FlashAttention's sliding window: query i sees keys j
    with D(i) - left <= j <= D(i) + right; -1 leaves that side unbounded (the default,
    (-1, -1), is no window). With is_causal, right acts as 0.
    kv_lengths: None (every key) or a (B,) int32 tensor (int64 is converted) on q's
    device: batch entry b sees keys j < kv_lengths[b] only (a right-padded batch; the
    padding keys' values never matter, they are left out of K's and V's quantization
    too). Values are read on the device, below 0 counting as 0 and above Nkv as Nkv.
    attn_mask: None or SDPA's boolean mask, a torch.bool tensor on q's device whose
    shape broadcasts to (B, Hq, Nq, Nkv) ((Nq, Nkv), (B, 1, 1, Nkv), ...; in either
    layout the mask is (B, H, Nq, Nkv)): query i of batch entry b and head h sees key j
    iff attn_mask[b, h, i, j] is True. It is read in place (broadcast dimensions stay
    stride 0, any strides). Or SDPA's float (additive) mask of q's dtype: attn_mask[b, h,
    i, j] is added to the scaled score, -inf hiding the key; it is read in place where its
    keys are contiguous and its rows 4-byte aligned, else copied once (e.g. odd Nkv), and
    runs in inference calls ("fast" precision; a training call raises
    QattnUnsupportedError). Either combines with none of is_causal, window_size and
    kv_lengths: write those rules into the mask (kv_lengths alone is cheaper for key
    padding: no mask read, and the padding keys are left out of the quantization, which
    the keys an attn_mask hides are not).
    Every mask runs in one kernel call. A row that sees no key gives output 0 and LSE
    -inf.

    Returns o (q's shape and dtype, contiguous), and with return_lse also the
    natural-log log-sum-exp of the scaled scores, (B, Hq, Nq) float32.
    granularity: quantization groups of Q and K, "per_thread" (default), "per_warp" or
    "per_block". Raises QattnError with a message naming the bad parameter.

    scheme: "sa2_8b" (default, the above) or "sa3_nvfp4", SageAttention3's arithmetic:
    NVFP4 Q and K (K smoothed, Q smoothed per 64-row block), two-level NVFP4 P, NVFP4 V,
    each product formed from the dequantized operands on BF16 tensor cores, which are
    exactly the products a Blackwell block-scaled FP4 MMA forms. It is for measuring on
    Hopper what SageAttention3 does to a model, not for speed (it is slower than SDPA).
    It takes head dims 64 and 128, no mask or is_causal (with Nq != Nkv only
    causal_alignment="bottom_right"), no window_size, kv_lengths or attn_mask, and has no
    backward (a call that records autograd raises QattnUnsupportedError).

    precision (scheme "sa2_8b"): "fast" (default) is the SageAttention2-8b arithmetic
    above. "precise" computes both products in the inputs' own 16-bit type with FP32
    accumulation and P rounded to that type (FlashAttention's arithmetic; no
    quantization): for heads or layers whose output the 8-bit products change visibly.
    "auto" runs "fast" on every head, then the precision guard, which estimates per
    head from Q's and the smoothed K's INT8 steps and norms the worst score error that
    INT8 Q·Kᵀ makes, and runs "precise" on the heads where it exceeds FP8 P·V's own
    error (docs/design.md, "Precision modes"); nothing is read back to the host. Both
    take the masks above (a boolean attn_mask "precise" tests element by element, with
    no tile skipping), granularity "per_thread", and have no backward (a call that
    records autograd raises QattnUnsupportedError).

    Training: where grad mode is on and q, k or v requires grad, the call runs the
    training forward (the same kernel with per-block Q/K groups, SageBwd's, whatever
    granularity says, and the LSE written) and backward gives dq, dk, dv from SageBwd,
    the INT8 backward (dk, dv summed over each KV head's query heads). With
    return_lse=True the LSE's gradient is honoured too, at the cost of one more forward
    and backward call. Top-left causal with Nq > Nkv is then two forward calls and one
    copy of the output. Options: qattn.set_backward_options (its merge-free scales read
    P's row maxima, which the training forward writes beside the LSE); a backward the
    library declines follows qattn.set_fallback's mode. SageBwd runs no window, no kv_lengths and
    no attn_mask: a training call with one has qattn's forward, and its backward follows
    that mode ("warn": the exact FP32 gradients with a QattnFallbackWarning once,
    "raise": QattnUnsupportedError).
    """
    # (_direct_call_ok first: it is False while torch.compile traces, which then sees
    # none of the other tests.)
    if (_direct_call_ok(q, k, v) and kv_lengths is None and attn_mask is None
            and window_size is _NO_WINDOW and scheme == "sa2_8b" and precision == "fast"):
        # A plain eager call (no mask beyond causal, no autograd): the direct call, with
        # the alignment passed only where it changes the mask, as _call_mask_options does.
        alignment = _plain_alignment(q, k, is_causal, layout, causal_alignment)
        if alignment is not None:
            mask = {} if alignment == "bottom_right" else {"alignment": alignment}
            o, lse = _run(q, k, v, is_causal, scale, layout, return_lse, granularity,
                          lse_tensor=False, **mask)
            return (o, lse) if return_lse else o
    if causal_alignment not in _ALIGNMENTS:
        raise invalid(f"causal_alignment = {causal_alignment!r}; allowed: 'top_left' or 'bottom_right'")
    if scheme not in _SCHEMES:
        raise invalid(f"scheme = {scheme!r}; allowed: {', '.join(map(repr, _SCHEMES))}")
    if precision not in _PRECISIONS:
        raise invalid(f"precision = {precision!r}; allowed: {', '.join(map(repr, _PRECISIONS))}")
    if scheme == "sa3_nvfp4":
        if precision != "fast":
            raise invalid(f"precision = {precision!r} is for scheme 'sa2_8b'; scheme 'sa3_nvfp4' "
                          "has one arithmetic")
        return _attention_sa3(q, k, v, is_causal, scale, layout, return_lse, causal_alignment,
                              window_size, kv_lengths, attn_mask)
    window_left, window_right = _window_sides(window_size)
    if precision != "fast":
        return _attention_precision(q, k, v, is_causal, scale, layout, return_lse, granularity,
                                    causal_alignment, window_left, window_right, kv_lengths,
                                    attn_mask, precision)
    mask, lengths = _call_mask_options(q, k, v, is_causal, scale, layout, granularity,
                                       causal_alignment, window_left, window_right, kv_lengths,
                                       attn_mask)
    if _narrower_v(q, v) and _records_autograd(q, k, v):
        raise QattnUnsupportedError(
            "backward", "v with fewer channels than q and k in a training call: SageBwd takes "
            "one head dim; qattn.scaled_dot_product_attention runs such calls on PyTorch's SDPA")
    if attn_mask is not None and attn_mask.dtype != torch.bool and _records_autograd(q, k, v):
        raise QattnUnsupportedError(
            "backward", "an additive attn_mask in a training call: qattn's backward takes "
            "boolean masks; qattn.scaled_dot_product_attention runs such calls on PyTorch's SDPA")
    if set(mask) == {"alignment"} and min(lengths) > 0 and _records_autograd(q, k, v):
        o, lse = _top_left(q, k, v, scale, layout, return_lse, granularity)  # causal, top-left
    else:
        o, lse = _forward(q, k, v, is_causal, scale, layout, return_lse, granularity, **mask)
    return (o, lse) if return_lse else o


def _plain_alignment(q, k, is_causal, layout, causal_alignment) -> Optional[str]:
    """The alignment a call with no window and no mask tensor passes to its op
    (_passed_alignment, as _call_mask_options gives it); None where causal_alignment is not one of the two names or the
    inputs are not 4-D in a known layout (the general path then names what is wrong)."""
    if causal_alignment != "bottom_right" and causal_alignment != "top_left":
        return None
    if not is_causal or causal_alignment == "bottom_right":
        return "bottom_right"
    lengths = _seq_lengths(q, k, layout)
    if lengths is None:
        return None
    return _passed_alignment(lengths, True, False, causal_alignment)


def _passed_alignment(lengths, is_causal, window: bool, causal_alignment: str) -> str:
    """The alignment a call passes to its op: causal_alignment only where it changes the
    mask (causal or a window, Nq != Nkv), else "bottom_right", so that a call it does not
    change keeps the arguments (and SageBwd) of a plain causal call."""
    aligned = lengths is not None and lengths[0] != lengths[1] and (is_causal or window)
    return causal_alignment if aligned else "bottom_right"


def _call_mask_options(q, k, v, is_causal, scale, layout, granularity, causal_alignment,
                       window_left, window_right, kv_lengths, attn_mask):
    """A call's mask arguments checked and turned into its op's options (the ones of the
    SA2-8b scheme in every precision mode); returns (options, (Nq, Nkv) or None)."""
    _attn_mask_alone(attn_mask, (
        ("is_causal=True", bool(is_causal)),
        (f"window_size = {(window_left, window_right)!r}", window_left != -1 or window_right != -1),
        ("kv_lengths", kv_lengths is not None),
    ))
    if kv_lengths is not None or attn_mask is not None:  # checked before the dispatcher sees a non-tensor
        _check_inputs(q, k, v, layout, scale, granularity)
        _check_kv_lengths(kv_lengths, q, layout)
        _check_attn_mask(attn_mask, q, k, layout)
    lengths = _seq_lengths(q, k, layout)
    window = window_left >= 0 or (not is_causal and window_right >= 0)
    mask = _mask_options(kv_lengths, window_left, window_right,
                         _passed_alignment(lengths, is_causal, window, causal_alignment), attn_mask)
    return mask, lengths


def _attention_precision(q, k, v, is_causal, scale, layout, return_lse, granularity,
                         causal_alignment, window_left, window_right, kv_lengths, attn_mask,
                         precision):
    """qattn.attention(precision="auto" or "precise"): the options those modes take, then
    their op."""
    mask, _ = _call_mask_options(q, k, v, is_causal, scale, layout, granularity, causal_alignment,
                                 window_left, window_right, kv_lengths, attn_mask)
    if granularity != "per_thread":
        raise invalid(f"precision = {precision!r} runs granularity 'per_thread' only (the "
                      f"guard is derived for it); got {granularity!r}")
    if _records_autograd(q, k, v):
        raise QattnUnsupportedError(
            "backward", f"precision = {precision!r} has no backward; call it under "
            "torch.no_grad() or on tensors that do not require grad")
    if _direct_call_ok(q, k, v):
        o, lse = _run(q, k, v, is_causal, scale, layout, return_lse, "per_thread",
                      scheme=_PRECISIONS[precision], lse_tensor=False, **mask)
    else:
        o, lse = torch.ops.qattn.attention_precision(q, k, v, is_causal, scale, layout, return_lse,
                                                     precision, **mask)
    return (o, lse) if return_lse else o


def _attention_sa3(q, k, v, is_causal, scale, layout, return_lse, causal_alignment, window_size,
                   kv_lengths, attn_mask):
    """qattn.attention(scheme="sa3_nvfp4"): the options that scheme takes, then its op."""
    if tuple(window_size) != (-1, -1) or kv_lengths is not None or attn_mask is not None:
        raise invalid("scheme = 'sa3_nvfp4' takes no window_size, kv_lengths or attn_mask")
    lengths = _seq_lengths(q, k, layout)
    if is_causal and causal_alignment == "top_left" and lengths is not None and lengths[0] != lengths[1]:
        raise invalid("scheme = 'sa3_nvfp4' aligns is_causal bottom-right; with Nq != Nkv pass "
                      "causal_alignment='bottom_right'")
    if _records_autograd(q, k, v):
        raise QattnUnsupportedError(
            "backward", "scheme = 'sa3_nvfp4' has no backward; call it under torch.no_grad() "
            "or on tensors that do not require grad")
    if _direct_call_ok(q, k, v):
        o, lse = _run(q, k, v, is_causal, scale, layout, return_lse, "per_thread",
                      scheme=_C.SCHEME_SAGE3_NVFP4, lse_tensor=False)
    else:
        o, lse = torch.ops.qattn.attention_sa3_nvfp4(q, k, v, is_causal, scale, layout, return_lse)
    return (o, lse) if return_lse else o


def sageattn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    **kwargs,
):
    """Drop-in for SageAttention's `sageattn` (same signature and return values). A
    causal mask with Nq != Nkv is aligned top-left, as in SDPA and SageAttention's own
    kernels (query i sees keys j <= i).

    Of the upstream keyword options, `qk_quant_gran` ("per_thread", "per_warp",
    "per_block") is honoured; `smooth_k` is always on (it is exact: softmax ignores a
    per-row constant); `pv_accum_dtype`, `smooth_v` and others are accepted and ignored
    with a warning, since qattn has one SageAttention2-8b kernel."""
    granularity = kwargs.pop("qk_quant_gran", "per_thread")
    kwargs.pop("smooth_k", None)
    if kwargs:
        warnings.warn(
            f"qattn.sageattn ignores {sorted(kwargs)}: qattn runs the SageAttention2-8b kernel "
            "(INT8 Q·Kᵀ with K smoothing, FP8 P·V, two-level FP32 accumulation)",
            stacklevel=2,
        )
    return attention(
        q, k, v, is_causal=is_causal, scale=sm_scale, layout=tensor_layout,
        return_lse=return_lse, granularity=granularity,
    )


def attention_kernel_only(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: Optional[float] = None,
    layout: str = "HND",
) -> Callable[[], torch.Tensor]:
    """Benchmarks only ("kernel-only" time, docs/design.md "Measuring"). Runs one full
    forward now and returns a function that enqueues only the attention kernel again,
    on the current stream, over the quantized workspace that forward filled (q, k, v
    are not read again). The function returns the output tensor it writes. is_causal
    uses the kernel's own bottom-right alignment (one kernel call, as timed)."""
    if q.device.type != "cuda":
        raise invalid(f"q is on {q.device}; allowed: a CUDA device")
    with torch.cuda.device(q.device):
        call = _Call(q, k, v, is_causal, scale, layout, False, "per_thread")
        call.launch()

    def run() -> torch.Tensor:
        with torch.cuda.device(call.device):
            call.launch(attention_only=True)
        return call.o

    return run
