"""qattn.varlen_attention: packed variable-length batches, FlashAttention's
flash_attn_varlen_func convention (the same arguments in the same order).

    cu = torch.tensor([0, 5, 12, 12, 20], dtype=torch.int32, device="cuda")  # 4 sequences
    o = qattn.varlen_attention(q, k, v, cu, cu, max_seqlen_q=8, max_seqlen_k=8, causal=True)

q is (total_q, Hq, d) and k, v are (total_k, Hkv, d): the tokens of every sequence one
after another. Sequence b owns the query tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1
and the keys cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1. Every rule applies per sequence,
as if each were a call of its own: causal and the window are aligned bottom-right
(FlashAttention's varlen rule: query i of a sequence sees its keys j <= i + len_k -
len_q) unless causal_alignment="top_left", and the quantization is per sequence (K's
smoothing mean over the sequence's own keys; no scale group, Q block or KV tile reaches
into another sequence): docs/design.md, "API semantics".

How it runs: on CUDA tensors without autograd, one call of the C library's varlen
kernel (the SageAttention2-8b forward walks every sequence itself: a plan pass reads
the offsets on the device, K/V are quantized per sequence, one attention launch takes
every sequence's query blocks), through the custom op "qattn::varlen_attention"
(torch.compile traces it). Nothing is read on the host, so nothing waits: a bad offsets
array gives wrong rows but never an access outside the buffers (the kernel clamps every
offset); check_offsets=True reads and checks them first (one small device-to-host copy,
which waits for the stream). When autograd records the call (an input
requires grad), each sequence is one qattn.attention call instead, with its training
forward and SageBwd backward (or, for what SageBwd does not run, e.g. a window, the
fallback mode's exact gradients): the same forward arithmetic per sequence. On CPU
tensors the call is the exact attention in FP32 (with a QattnFallbackWarning once, or
QattnUnsupportedError under qattn.set_fallback("raise")), since qattn's kernels run on
GPUs only.
"""

# No `from __future__ import annotations`: the public signature is compared with
# FlashAttention's at test time.
import math
from typing import List, Optional, Tuple

import torch

from . import _C, fallback, ops
from .errors import QattnError, QattnUnsupportedError, check, invalid


def _check_tensors(q, k, v) -> None:
    ops.check_operands(q, k, v, 3, "(total tokens, heads, head_dim), the sequences packed one "
                       "after another", "one device")
    if tuple(k.shape) != tuple(v.shape):
        raise invalid(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ; allowed: the same shape")
    if k.shape[2] != q.shape[2]:
        raise invalid(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in head_dim; allowed: one head_dim")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise invalid(f"heads_q = {hq} is not a multiple of heads_kv = {hkv}; allowed: heads_q = "
                      "g * heads_kv (GQA/MQA)")


def _check_offsets_tensor(name: str, cu, q) -> None:
    if not isinstance(cu, torch.Tensor):
        raise invalid(f"{name} is a {type(cu).__name__}; allowed: a (batch + 1,) torch.int32 tensor "
                      "on q's device")
    if cu.dtype != torch.int32:
        raise invalid(f"{name}.dtype = {cu.dtype}; allowed: torch.int32 (FlashAttention's)")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise invalid(f"{name} has shape {tuple(cu.shape)}; allowed: (batch + 1,) with batch >= 1")
    if cu.device != q.device:
        raise invalid(f"{name} is on {cu.device} but q is on {q.device}; allowed: q's device")


def _check_max(name: str, value) -> int:
    if not ops._is_int(value) or value < 1:
        raise invalid(f"{name} = {value!r}; allowed: an int >= 1, at least the longest sequence")
    return int(value)


def _check_offsets(name: str, offsets: List[int], total: int, max_name: str, max_len: int) -> None:
    """The values of one cu_seqlens array (on the host): 0 first, never decreasing (a
    sequence may be empty), the total last, and no sequence longer than the max."""
    if offsets[0] != 0:
        raise invalid(f"{name}[0] = {offsets[0]}; allowed: 0 (the offsets start at the first token)")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise invalid(f"{name} decreases at entry {b + 1} ({offsets[b]} then {offsets[b + 1]}); "
                          "allowed: non-decreasing offsets (equal ones make an empty sequence)")
    if offsets[-1] != total:
        raise invalid(f"{name}[-1] = {offsets[-1]} but the packed tensor has {total} tokens; "
                      "allowed: the last offset equals the total")
    longest = max(offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1))
    if longest > max_len:
        raise invalid(f"{max_name} = {max_len} is below the longest sequence ({longest} tokens); "
                      "allowed: at least every sequence's length")


def _sequence_math(q, k, v, causal, scale, window_left, window_right, alignment):
    """One sequence in FP32, exactly: q (n, Hq, d), k, v (m, Hkv, d) -> o (n, Hq, d) in q's
    dtype and the LSE (Hq, n) in float32, by qattn's rule for the visible keys
    (ops._visible_keys). Rows that see no key give 0 and -inf, with zero gradients (the
    row maximum and the empty rows' sums are kept out of autograd's NaNs)."""
    n, hq, d = q.shape
    m, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    sm = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    qf = q.float().transpose(0, 1)  # (Hq, n, d)
    kf = k.float().transpose(0, 1).repeat_interleave(g, 0)  # (Hq, m, d)
    vf = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * sm
    seen = ops._visible_keys(0, n, n, m, q.device, causal, window_left=window_left,
                             window_right=window_right, alignment=alignment)
    if seen is not None:
        s = s.masked_fill(~seen, -math.inf)
    mx = s.amax(-1, keepdim=True).detach()  # softmax does not depend on it: no gradient
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    l = p.sum(-1, keepdim=True)
    some = l > 0
    safe_l = torch.where(some, l, torch.ones_like(l))
    o = torch.matmul(p, vf) / safe_l
    lse = torch.where(some, mx + torch.log(safe_l), torch.full_like(l, -math.inf))[..., 0]
    return o.transpose(0, 1).to(q.dtype), lse


@torch.library.custom_op("qattn::varlen_attention", mutates_args=())
def _varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: Optional[float],
    window_left: int,
    window_right: int,
    alignment: str,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The packed forward in one C call (arguments checked by varlen_attention): o
    (total_q, Hq, d), lse (Hq, total_q) or an empty tensor."""
    total_q, hq, d = q.shape
    total_k, hkv, _ = k.shape
    d_pad = -(-d // ops._ROW_MULTIPLE) * ops._ROW_MULTIPLE
    # (1, total, H, d) views in the NHD layout: the C ABI's (1, H, total, d) pack.
    qv, kv, vv = (ops._usable(t[None], "NHD", d_pad) for t in (q, k, v))
    o = q.new_empty((1, total_q, hq, d_pad))
    lse = q.new_empty((hq, total_q) if return_lse else (0,), dtype=torch.float32)
    cu_q = cu_seqlens_q.contiguous()
    cu_k = cu_seqlens_k.contiguous()
    args = (ops._tensor_arg(qv, "NHD"), ops._tensor_arg(kv, "NHD"), ops._tensor_arg(vv, "NHD"),
            ops._tensor_arg(o, "NHD"), lse.data_ptr() if return_lse else 0, ops._DTYPES[q.dtype],
            (len(cu_q) - 1, hq, hkv, total_q, total_k, d_pad), 1 if causal else 0,
            float(scale) if scale is not None else 1.0 / math.sqrt(d), 0)
    mask = (0, window_left, window_right, ops._ALIGNMENT_CODES[alignment], 0, 0, 0, 0, 0, _C.MASK_NONE)
    packed = (cu_q.data_ptr(), cu_k.data_ptr(), max_seqlen_q, max_seqlen_k)
    with torch.cuda.device(q.device):
        status, ws_bytes = _C.workspace_size(*args, mask, _C.SCHEME_SAGE2_8B, packed)
        check(status)
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
        stream = ops._current_stream(q.device.index)
        check(_C.forward(*args, workspace.data_ptr(), ws_bytes, stream, False, mask,
                         _C.SCHEME_SAGE2_8B, packed))
    o = o[0] if d == d_pad else o[0, ..., :d].contiguous()
    return o, lse


@_varlen_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                 window_left, window_right, alignment, return_lse):
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse


def _records_autograd(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    causal_alignment: str = "bottom_right",
    check_offsets: bool = False,
):
    """Attention over a packed batch of variable-length sequences, with FlashAttention's
    flash_attn_varlen_func arguments (see the module docstring for the layout and for how
    it runs in this version).

    q (total_q, Hq, d), k and v (total_k, Hkv, d), fp16 or bf16 on one device, Hq a
    multiple of Hkv (GQA/MQA); cu_seqlens_q and cu_seqlens_k (batch + 1,) torch.int32 on
    q's device: offsets starting at 0, non-decreasing (an empty sequence is allowed),
    ending at total_q and total_k; max_seqlen_q, max_seqlen_k: ints at least the longest
    query and key sequence (larger is allowed, as in FlashAttention). Each is checked and
    named in the QattnError of a bad call.

    causal: per sequence, aligned bottom-right (query i of a sequence of len_q queries
    and len_k keys sees its keys j <= i + len_k - len_q; with len_q > len_k its first
    len_q - len_k rows see no key) or, with causal_alignment="top_left", j <= i.
    window_size = (left, right): per sequence, keys j with D(i) - left <= j <= D(i) +
    right, D(i) being that diagonal key; -1 leaves a side unbounded; with causal, right
    acts as 0. softmax_scale defaults to 1/sqrt(d). A row that sees no key (causal rows
    before the diagonal, a sequence with no keys) gives 0 and LSE -inf.

    dropout_p must be 0, softcap 0 and alibi_slopes None (qattn has none of them:
    QattnUnsupportedError otherwise). deterministic is about the backward, as in
    FlashAttention: True asks for qattn's deterministic backward, which must then be on
    (qattn.set_backward_options(deterministic=True) or QATTN_BWD_DETERMINISTIC=1), else
    QattnError; qattn's forward is deterministic either way.

    check_offsets (keyword only, qattn's): False (default) reads nothing on the host, as
    FlashAttention does: no synchronization, CUDA-graph capturable; a bad array then gives
    unspecified rows, never an access outside the buffers (the kernel clamps every
    offset). True reads the offsets on the host and checks every one (a named QattnError
    for a bad array), which waits for the stream. Calls that run per sequence (CPU
    tensors, autograd) always read and check them.

    Returns o (total_q, Hq, d) in q's dtype; with return_attn_probs=True, (o, lse, None):
    lse (Hq, total_q) float32 natural log, FlashAttention's varlen layout, and None where
    FlashAttention returns its dropout pattern (qattn forms no probability matrix)."""
    _check_tensors(q, k, v)
    _check_offsets_tensor("cu_seqlens_q", cu_seqlens_q, q)
    _check_offsets_tensor("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise invalid(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries and cu_seqlens_k "
                      f"{cu_seqlens_k.shape[0]}; allowed: batch + 1 each, one batch")
    max_q = _check_max("max_seqlen_q", max_seqlen_q)
    max_k = _check_max("max_seqlen_k", max_seqlen_k)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise QattnUnsupportedError("dropout_p", f"dropout_p = {dropout_p!r}; qattn has no dropout "
                                    "(allowed: 0)")
    if softcap != 0:
        raise QattnUnsupportedError("softcap", f"softcap = {softcap!r}; qattn has no logit "
                                    "soft-capping (allowed: 0)")
    if alibi_slopes is not None:
        raise QattnUnsupportedError("alibi_slopes", "alibi_slopes is set; qattn has no ALiBi bias "
                                    "(allowed: None)")
    if deterministic and not ops.get_backward_options()["deterministic"]:
        raise invalid("deterministic = True but qattn's backward is not in its deterministic mode; "
                      "allowed: qattn.set_backward_options(deterministic=True) (or "
                      "QATTN_BWD_DETERMINISTIC=1) first, or deterministic = False")
    if causal_alignment not in ops._ALIGNMENTS:
        raise invalid(f"causal_alignment = {causal_alignment!r}; allowed: 'bottom_right' "
                      "(FlashAttention's varlen rule) or 'top_left'")
    window_left, window_right = ops._window_sides(window_size)
    if softmax_scale is not None and not ops.scale_ok(softmax_scale):
        raise invalid(f"softmax_scale = {softmax_scale}; allowed: None (1/sqrt(head_dim)) or a "
                      "positive number that is non-zero in FP32 and whose product with log2(e) "
                      "is finite in FP32")
    if q.device.type not in ("cuda", "cpu"):
        raise invalid(f"the tensors are on {q.device}; allowed: CUDA or CPU tensors (the offsets "
                      "are read on the host in this version)")

    if not isinstance(check_offsets, bool):
        raise invalid(f"check_offsets = {check_offsets!r}; allowed: True or False")
    offsets = None

    def read_offsets():
        # The one device-to-host copy (it waits for the stream).
        both = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
        _check_offsets("cu_seqlens_q", both[0], q.shape[0], "max_seqlen_q", max_q)
        _check_offsets("cu_seqlens_k", both[1], k.shape[0], "max_seqlen_k", max_k)
        return both

    # The kernel: CUDA tensors, no autograd, keys and queries in the pack.
    kernel = (q.device.type == "cuda" and not _records_autograd(q, k, v) and q.shape[0] > 0
              and k.shape[0] > 0)
    if check_offsets or not kernel:
        offsets = read_offsets()
    if kernel:
        try:
            o, lse = _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal),
                                softmax_scale, window_left, window_right, causal_alignment,
                                bool(return_attn_probs))
            return (o, lse, None) if return_attn_probs else o
        except QattnError as e:
            # What the kernel does not run (e.g. head_dim > 128; the C library refuses it
            # with QATTN_ERROR_UNSUPPORTED): one qattn.attention call per sequence below,
            # with its fallback rules. Any other error is the caller's to see.
            if e.status != _C.ERROR_UNSUPPORTED:
                raise
            if offsets is None:
                offsets = read_offsets()

    if q.device.type == "cpu":
        if fallback.get_fallback() == "raise":
            raise QattnUnsupportedError(
                "varlen device cpu",
                "qattn.varlen_attention: the tensors are on the CPU, where qattn has no kernel "
                "(qattn.set_fallback('warn') computes the exact attention in FP32 instead)")
        fallback.warn_once("varlen device cpu", "", (
            "qattn.varlen_attention: the tensors are on the CPU, where qattn has no kernel; "
            "computing the exact attention in FP32 instead (warned once; qattn.set_fallback("
            "'raise') makes this an error)"), stacklevel=3)

    hq, d = q.shape[1], q.shape[2]
    outs, lses = [], []
    for b in range(len(offsets[0]) - 1):
        q0, q1 = offsets[0][b], offsets[0][b + 1]
        k0, k1 = offsets[1][b], offsets[1][b + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: every row sees none
            outs.append(q.new_zeros((q1 - q0, hq, d)))
            lses.append(torch.full((hq, q1 - q0), -math.inf, dtype=torch.float32, device=q.device))
            continue
        qs, ks, vs = q[q0:q1], k[k0:k1], v[k0:k1]
        if q.device.type == "cpu":
            o_b, lse_b = _sequence_math(qs, ks, vs, causal, softmax_scale, window_left,
                                        window_right, causal_alignment)
        else:
            res = ops.attention(qs[None], ks[None], vs[None], is_causal=causal, scale=softmax_scale,
                                layout="NHD", return_lse=return_attn_probs,
                                causal_alignment=causal_alignment, window_size=window_size)
            o_b, lse_b = (res[0][0], res[1][0]) if return_attn_probs else (res[0], None)
        outs.append(o_b)
        lses.append(lse_b)
    o = torch.cat(outs, 0) if outs else q.new_empty((0, hq, d))
    if not return_attn_probs:
        return o
    lse = (torch.cat(lses, 1) if lses
           else torch.empty((hq, 0), dtype=torch.float32, device=q.device))
    return o, lse, None
