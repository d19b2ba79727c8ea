"""PyTorch integration: qattn.attention as the torch.library custom op "qattn::attention".

The op calls the C ABI through qattn._C with raw pointers, strides and the current
CUDA stream; its workspace is a uint8 tensor from PyTorch's caching allocator on that
stream, so a call never synchronizes and can be captured in a CUDA graph. A fake
(meta) implementation lets torch.compile(fullgraph=True) trace through it.
"""

# No `from __future__ import annotations`: torch.library reads the real annotations.
import contextlib
import math
import struct
import warnings
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _C
from .errors import QattnBackwardNotImplemented, check, invalid

_LAYOUTS = ("HND", "NHD")
_DTYPES = {torch.float16: _C.DTYPE_FP16, torch.bfloat16: _C.DTYPE_BF16}
_GRANULARITIES = {"per_thread": 0, "per_warp": 1, "per_block": 2}
_ROW_MULTIPLE = 8  # elements: the C ABI wants 16-byte strides and pointers
_ALIGN_BYTES = 16
_LOG2E = 1.4426950408889634
_ALIGNMENTS = ("top_left", "bottom_right")


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


def _check_inputs(q, k, v, layout: str, scale: Optional[float], granularity: str) -> None:
    if layout not in _LAYOUTS:
        raise invalid(f"layout = {layout!r}; allowed: 'HND' (B, H, N, d) or 'NHD' (B, N, H, d)")
    if granularity not in _GRANULARITIES:
        raise invalid(f"granularity = {granularity!r}; allowed: {', '.join(_GRANULARITIES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise invalid(f"{name} is a {type(t).__name__}; allowed: a torch.Tensor")
        if t.dim() != 4:
            raise invalid(
                f"{name} has {t.dim()} dimensions (shape {tuple(t.shape)}); allowed: 4, "
                f"{'(B, H, N, d)' if layout == 'HND' else '(B, N, H, d)'} for layout {layout!r}"
            )
        if t.dtype not in _DTYPES:
            raise invalid(f"{name}.dtype = {t.dtype}; allowed: torch.float16 or torch.bfloat16")
        if t.dtype != q.dtype:
            raise invalid(f"{name}.dtype = {t.dtype} differs from q.dtype = {q.dtype}; allowed: one dtype")
        if t.device != q.device:
            raise invalid(f"{name} is on {t.device} but q is on {q.device}; allowed: one CUDA device")
    bq, hq, nq, d = _bhnd(q, layout)
    bk, hk, nk, dk = _bhnd(k, layout)
    bv, hv, nv, dv = _bhnd(v, layout)
    if (bk, hk, nk, dk) != (bv, hv, nv, dv):
        raise invalid(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ; allowed: the same shape")
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

    def __init__(self, q, k, v, is_causal, scale, layout, return_lse, granularity):
        _check_inputs(q, k, v, layout, scale, granularity)
        b, hq, nq, d = _bhnd(q, layout)
        _, hkv, nkv, _ = _bhnd(k, layout)
        d_pad = -(-d // _ROW_MULTIPLE) * _ROW_MULTIPLE
        self.d, self.d_pad = d, d_pad
        self.q, self.k, self.v = (_usable(t, layout, d_pad) for t in (q, k, v))
        self.o = q.new_empty(self.q.shape)  # contiguous, in the layout
        self.lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
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
        status, self.ws_bytes = _C.workspace_size(*self.args)
        check(status)
        self.device = q.device
        self.workspace = torch.empty(self.ws_bytes, dtype=torch.uint8, device=q.device)

    def launch(self, attention_only: bool = False) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        status = _C.forward(
            *self.args, self.workspace.data_ptr(), self.ws_bytes, stream, attention_only
        )
        check(status)

    def outputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        o = self.o if self.d == self.d_pad else self.o[..., : self.d].contiguous()
        return o, self.lse


def _run(q, k, v, is_causal, scale, layout, return_lse, granularity):
    if q.device.type != "cuda":
        raise invalid(f"q is on {q.device}; allowed: a CUDA device")
    # The C library runs on the current device; switching costs host time, so only when
    # q lives elsewhere.
    same = q.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(q.device):
        call = _Call(q, k, v, is_causal, scale, layout, return_lse, granularity)
        call.launch()
        return call.outputs()


# Private PyTorch hooks that say whether a dispatch or function mode is active; where a
# PyTorch version lacks one, every call takes the dispatcher.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _direct_call_ok(q, k, v) -> bool:
    """True for a plain eager call that needs nothing of the dispatcher: the op's
    dispatch (torch.library) costs tens of microseconds of host time per call, about
    the GPU time of a short sequence. Traced calls (torch.compile), tensor subclasses,
    active dispatch or function modes, and calls that record autograd (so that backward
    raises) go through the op."""
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
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _run(q, k, v, is_causal, scale, layout, return_lse, granularity)


@_attention_op.register_fake
def _attention_fake(q, k, v, is_causal, scale, layout, return_lse, granularity):
    _check_inputs(q, k, v, layout, scale, granularity)
    b, hq, nq, _ = _bhnd(q, layout)
    o = q.new_empty(q.shape)
    lse = q.new_empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32)
    return o, lse


def _backward(ctx, grad_o, grad_lse):
    raise QattnBackwardNotImplemented(
        "qattn.attention has no backward pass yet: training support arrives with the SageBwd "
        "INT8 backward. For training, use torch.nn.functional.scaled_dot_product_attention, "
        "or run qattn under torch.no_grad() / torch.inference_mode()."
    )


_attention_op.register_autograd(_backward, setup_context=lambda ctx, inputs, output: None)


# ---- public functions --------------------------------------------------------------


def _forward(q, k, v, is_causal, scale, layout, return_lse, granularity):
    """One forward with the C ABI's own causal rule (bottom-right aligned)."""
    if _direct_call_ok(q, k, v):
        return _run(q, k, v, is_causal, scale, layout, return_lse, granularity)
    return torch.ops.qattn.attention(q, k, v, is_causal, scale, layout, return_lse, granularity)


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
    """Causal attention with SDPA's rule, query i sees keys j <= i, from the kernel's
    bottom-right rule (query i sees keys j <= i + Nkv - Nq). Both agree when Nq == Nkv.
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
):
    """SageAttention2-8b attention (INT8 Q·Kᵀ, FP8 P·V) on a Hopper GPU.

    q is (B, Hq, Nq, d) and k, v are (B, Hkv, Nkv, d) for layout "HND", or (B, N, H, d)
    for "NHD"; fp16 or bf16 on one CUDA device; Hq a multiple of Hkv (GQA/MQA: query
    head h reads key/value head h // (Hq / Hkv)); scale defaults to 1/sqrt(d); d <= 128.
    For a drop-in with SDPA's exact signature and a fallback for what qattn does not
    run, see qattn.scaled_dot_product_attention.

    causal_alignment says where the causal mask sits when Nq != Nkv (it makes no
    difference when Nq == Nkv):
      "top_left" (default, SDPA's rule): query i sees keys j <= i. With Nq > Nkv this
        takes two kernel calls and one copy of the output.
      "bottom_right" (FlashAttention >= 2.1, a KV cache: the queries are the last Nq
        positions): query i sees keys j <= i + Nkv - Nq. With Nq > Nkv the first
        Nq - Nkv rows see no key: their output is 0 and their LSE -inf.

    Returns o (q's shape and dtype, contiguous), and with return_lse also the
    natural-log log-sum-exp of the scaled scores, (B, Hq, Nq) float32.
    granularity: quantization groups of Q and K, "per_thread" (default), "per_warp" or
    "per_block". Raises QattnError with a message naming the bad parameter.
    """
    if causal_alignment not in _ALIGNMENTS:
        raise invalid(f"causal_alignment = {causal_alignment!r}; allowed: 'top_left' or 'bottom_right'")
    lengths = _seq_lengths(q, k, layout) if is_causal and causal_alignment == "top_left" else None
    if lengths is not None and lengths[0] != lengths[1] and min(lengths) > 0:
        o, lse = _top_left(q, k, v, scale, layout, return_lse, granularity)
    else:
        o, lse = _forward(q, k, v, is_causal, scale, layout, return_lse, granularity)
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
