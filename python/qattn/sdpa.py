"""qattn.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's
signature and semantics, run on qattn's SageAttention2-8b kernel where qattn supports the
call and on PyTorch's SDPA where it does not.

What runs on qattn: query (B, Hq, Nq, d), key (B, Hkv, Nkv, d) and value (B, Hkv, Nkv,
d_v), d_v = d, or 1 <= d_v < d in inference calls (MLA-style: O then has d_v channels);
float16 or bfloat16 on a CUDA GPU of compute capability 9.0; d <= 256 (d of 129..256 on
the head-dim-256 kernel, which takes no attn_mask and has no backward: such calls, and
training calls at those head dims, go to SDPA); attn_mask None, boolean (True = the
query sees the key, SDPA's meaning) or additive (a float mask of the query's dtype, in
inference calls) on query's device with 2 to 4 dimensions that broadcast to (B, Hq, Nq,
Nkv), without is_causal; dropout_p 0; scale None or positive; Hq == Hkv, Hkv == 1 (SDPA
broadcasts it), or enable_gqa with Hq a multiple of Hkv. A mask runs in qattn's kernel as
it is given (broadcast dimensions are never copied; an additive mask whose rows are not
4-byte aligned, e.g. odd Nkv, is copied once); a row it leaves with no key gives 0, as
SDPA's math backend does for a boolean mask. Everything else goes to PyTorch's SDPA: with a
QattnFallbackWarning once per reason (the default, "warn"), or as a
QattnUnsupportedError ("raise"); see set_fallback. Meta tensors take qattn's op, whose
fake implementation gives the shapes.

Training: where an input requires grad (and grad mode is on), the forward is qattn's
training forward and the gradients come from SageBwd, qattn's INT8 backward (four of
the five backward products in INT8 with per-block scales, dO·Vᵀ in 16-bit):

    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.float().square().sum().backward()          # q.grad, k.grad, v.grad
    qattn.set_backward_options(deterministic=True)  # bitwise-repeatable gradients

qattn.attention trains the same way (both layouts, GQA, either causal alignment, and
the LSE with its gradient when return_lse=True). torch.compile(fullgraph=True) traces
forward and backward. qattn.set_backward_options also picks the 8-bit format ("int8",
"e4m3"), dO·Vᵀ's precision ("16bit", "quantized") and the scales ("per_block", or
"merge_free" with "e4m3" and "16bit": scales fixed before the kernel from P's row
maxima, which the training forward writes); QATTN_BWD_DETERMINISTIC=1 in the
environment turns on the deterministic mode until set_backward_options sets it. A
backward the library declines (e.g. an option or head dim its GPU kernel does not
run) follows the fallback mode: "warn" computes the exact gradients in FP32 from the
same inputs (PyTorch's SDPA math) with a QattnFallbackWarning once per reason, "raise"
raises QattnUnsupportedError. With no grad (torch.no_grad(), inference_mode, or no
input that requires grad) the call is the inference kernel, unchanged, and no LSE is
computed. qattn.set_training("sdpa") (or QATTN_TRAINING=sdpa) runs training calls on
PyTorch's SDPA instead, forward and backward, without a warning, and keeps inference
calls on qattn: SageBwd is slower than cuDNN's backward today (README, Training).

The results are SageAttention2-8b's, not SDPA's bits: the bounds of the scheme are in
docs/design.md ("Numerics") and tests/tolerances/sage2_8b.json.
"""

# No `from __future__ import annotations`: the public signature is compared with
# PyTorch's at test time.
from typing import Optional, Tuple

import torch

from . import _C, fallback, ops, precision, training
from .errors import QattnError
from .fallback import _warned, get_fallback, set_fallback  # noqa: F401 (the package's API; tests clear _warned)

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
# Above this the call runs on the head-dim-256 kernel (sage2_wide_sm90), which has no
# attn_mask, no precision modes and no backward (SageBwd runs d <= 128).
_MAX_FULL_HEAD_DIM = 128

# PyTorch's own SDPA (the built-in that torch.nn.functional exports), for the fallback.
# Not the attribute of torch.nn.functional, which callers replace with this module's
# function ("F.scaled_dot_product_attention = qattn.scaled_dot_product_attention"): the
# fallback would then call itself.
_torch_sdpa = torch._C._nn.scaled_dot_product_attention

_cuda_ok = {}  # device index -> bool


@torch.compiler.assume_constant_result
def _device_runs_qattn(device_type: str, index: int) -> bool:
    """Whether qattn's kernels run on this device. A constant under torch.compile: it is
    called at trace time, so the binding is never traced."""
    if device_type == "meta":
        return True
    if device_type != "cuda":
        return False
    if index < 0:
        index = torch.cuda.current_device()
    if index not in _cuda_ok:
        _cuda_ok[index] = bool(_C.built_with_cuda() and _C.device_supported(index))
    return _cuda_ok[index]


def _decline(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[Tuple[str, str]]:
    """None when qattn runs the call; otherwise (reason key, why). The key is coarse (one
    warning per key), the text says what was seen."""
    # Tests written out rather than as generators over (q, k, v): this runs on every call.
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return "arguments", "query, key and value are not all tensors"
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return "arguments", "is_causal or enable_gqa is not a bool"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "attn_mask", "attn_mask is not a tensor"
        if attn_mask.dtype != torch.bool:
            if not isinstance(q, torch.Tensor) or attn_mask.dtype != q.dtype:
                return "attn_mask dtype", (
                    f"a {attn_mask.dtype} attn_mask; qattn takes boolean masks and additive "
                    "ones of the query's dtype"
                )
            if ops._records_autograd(q, k, v):
                return "attn_mask float grad", (
                    "an additive attn_mask in a training call; qattn's backward takes boolean masks"
                )
        if attn_mask.requires_grad:
            return "attn_mask grad", "attn_mask requires grad; qattn gives no mask gradient"
        if is_causal:  # SDPA refuses the pair; its error is the answer
            return "attn_mask", "attn_mask with is_causal"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        return "dropout_p", f"dropout_p = {dropout_p!r}; qattn has no dropout"
    if scale is not None and not ops.scale_ok(scale):
        return "scale", (
            f"scale = {scale!r}; qattn takes a positive scale whose product with log2(e) is "
            "finite in FP32"
        )
    if (q.is_nested or q.layout != torch.strided or k.is_nested or k.layout != torch.strided
            or v.is_nested or v.layout != torch.strided):
        return "layout", "an input is nested or not strided; qattn takes strided tensors"
    dev = q.device
    if k.device != dev or v.device != dev:
        return "device", f"query, key and value are on {dev}, {k.device}, {v.device}"
    if not _device_runs_qattn(dev.type, -1 if dev.index is None else dev.index):
        return f"device {dev.type}", (
            f"the tensors are on {dev}; qattn runs on CUDA GPUs of compute capability 9.0 "
            "(built with CUDA)"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}", (
            f"dtypes {q.dtype}, {k.dtype}, {v.dtype}; qattn takes torch.float16 or "
            "torch.bfloat16, one for all three"
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "rank", (
            f"query, key and value have {q.dim()}, {k.dim()}, {v.dim()} dimensions; qattn "
            "takes 4-D (B, H, N, d) tensors"
        )
    b, hq, nq, d = q.shape
    bk, hkv, nkv, dk = k.shape
    dv = v.shape[-1]
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]) or bk != b or dk != d or dv > dk:
        return "shape", (
            f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}; qattn "
            "takes key and value of one (B, H, N), with query's batch and head dim (no "
            "broadcasting), and value's head dim at most key's"
        )
    # SDPA broadcasts Hkv == 1 over the query heads without enable_gqa; that is MQA.
    if hq != hkv and hkv != 1 and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return "heads", f"heads of query {hq}, of key and value {hkv}, enable_gqa = {enable_gqa}"
    if min(b, hq, hkv, nq, nkv, d) == 0:
        return "empty", f"an empty dimension: query {tuple(q.shape)}, key {tuple(k.shape)}"
    if d > _MAX_HEAD_DIM:
        return "head_dim", f"head dim {d}; qattn takes 1..{_MAX_HEAD_DIM}"
    if d > _MAX_FULL_HEAD_DIM and attn_mask is not None:
        return "attn_mask head_dim", (
            f"an attn_mask at head dim {d}; qattn's kernel for head dims "
            f"{_MAX_FULL_HEAD_DIM + 1}..{_MAX_HEAD_DIM} takes none"
        )
    if dv != d and ops._records_autograd(q, k, v):
        return "backward value head_dim", (
            f"a training call with value's head dim {dv} below query's {d}; qattn's backward "
            "(SageBwd) takes one head dim"
        )
    if d > _MAX_FULL_HEAD_DIM and ops._records_autograd(q, k, v):
        return "backward head_dim", (
            f"a training call at head dim {d}; qattn's backward (SageBwd) runs head dims "
            f"1..{_MAX_FULL_HEAD_DIM}"
        )
    if attn_mask is not None:
        if attn_mask.is_nested or attn_mask.layout != torch.strided:
            return "attn_mask layout", "attn_mask is nested or not strided"
        target = (b, hq, nq, nkv)
        shape = tuple(attn_mask.shape)
        # SDPA takes masks of 2 to 4 dimensions (a 0-D or 1-D one raises its error).
        if not 2 <= len(shape) <= 4 or any(
            s != 1 and s != t for s, t in zip(reversed(shape), reversed(target))
        ):
            return "attn_mask shape", (
                f"attn_mask {shape} does not broadcast to (B, Hq, Nq, Nkv) = {target}"
            )
        if attn_mask.device != dev:
            return "attn_mask device", f"attn_mask is on {attn_mask.device}, query on {dev}"
    return None


def _run_torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if enable_gqa is not False:  # passed on only when set: PyTorch < 2.5 lacks the argument
        kwargs["enable_gqa"] = enable_gqa
    return _torch_sdpa(q, k, v, **kwargs)


def _fallback(declined, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    key, why = declined
    # SDPA runs first, so a call it rejects raises its own error in either mode.
    out = _run_torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if fallback.get_fallback() == "raise":
        fallback.refuse_sdpa(key, why)
    if not torch.compiler.is_compiling():
        # The frame that called scaled_dot_product_attention (or the plug-in's attention
        # function, which calls sdpa_in_mode): above warn_once, _fallback, sdpa_in_mode and it.
        fallback.warn_once(key, why, stacklevel=5)
    return out


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention: the same arguments
    (scale and enable_gqa keyword-only, as in PyTorch) and the same semantics, on qattn's
    SageAttention2-8b kernel where qattn supports the call (see the module docstring).

    is_causal aligns the mask top-left as SDPA does: query i sees keys j <= i, also when
    Nq != Nkv (for the bottom-right rule of a KV cache, call qattn.attention with
    causal_alignment="bottom_right"). attn_mask: a boolean mask (True = attend) or, in
    inference calls, a float (additive) one of query's dtype that broadcasts to (B, Hq,
    Nq, Nkv) runs in qattn's kernel; a float mask of another dtype goes to SDPA. scale
    None is 1/sqrt(d). enable_gqa: Hq must be a multiple of Hkv, and
    query head h reads key/value head h // (Hq / Hkv).

    A call qattn cannot run goes to PyTorch's SDPA with a QattnFallbackWarning once per
    reason, or raises QattnUnsupportedError under qattn.set_fallback("raise"); a call
    SDPA rejects raises SDPA's error. Under torch.compile the fallback issues no
    warning. Training calls run on SDPA under qattn.set_training("sdpa"). Returns (B, Hq,
    Nq, d_v) in query's dtype, contiguous on the qattn path.
    """
    return sdpa_in_mode(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        precision.get_precision())


def sdpa_in_mode(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 mode: str) -> torch.Tensor:
    """scaled_dot_product_attention in precision `mode` ("fast", "auto" or "precise") given
    by the caller instead of qattn.get_precision(): the plug-ins pass a registration's
    mode this way, which torch.compile traces (a context variable it does not)."""
    if training.get_training() == "sdpa" and ops._records_autograd(query, key, value):
        # The caller's choice, not a fallback: no warning, and set_fallback("raise") does
        # not apply.
        return _run_torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa)
    declined = _decline(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if declined is None:
        # A boolean attn_mask is passed on only when given: a call without one keeps the
        # arguments of a plain call. So is a precision other than "fast" (qattn.set_precision),
        # which covers inference calls.
        mask = {} if attn_mask is None else {"attn_mask": attn_mask}
        if mode != "fast" and not ops._records_autograd(query, key, value):
            mask["precision"] = mode
        if torch.compiler.is_compiling():
            return ops.attention(query, key, value, is_causal=is_causal, scale=scale,
                                 causal_alignment="top_left", **mask)
        try:
            return ops.attention(query, key, value, is_causal=is_causal, scale=scale,
                                 causal_alignment="top_left", **mask)
        except QattnError as error:
            # The library's own limits (e.g. sizes past its bounds): SDPA runs the call.
            if error.status not in (_C.ERROR_INVALID_ARGUMENT, _C.ERROR_UNSUPPORTED):
                raise
            declined = (f"library {error.status_name}", f"the qattn library declined the call ({error})")
    return _fallback(declined, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
