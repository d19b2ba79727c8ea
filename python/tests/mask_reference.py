"""What the mask tests (test_masks.py: causal, windows, key padding; test_attn_mask.py:
the boolean attn_mask) share: the fallback policy restored around each test, meta
tensors, layouts, the error metrics and the FP64 autograd reference of the gradients
under an explicit boolean mask."""

import math

import pytest
import torch

import qattn
from qattn import fallback


@pytest.fixture(autouse=True)
def restore_fallback():
    mode = qattn.get_fallback()
    fallback._warned.clear()
    yield
    qattn.set_fallback(mode)
    fallback._warned.clear()


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)


def shape_of(b, h, n, d, layout):
    return (b, h, n, d) if layout == "HND" else (b, n, h, d)


def to_hnd(t, layout):
    return t if layout == "HND" else t.transpose(1, 2)


def metrics(a, r):
    a, r = a.double().flatten(), r.double().flatten()
    cos = (a @ r / (a.norm() * r.norm())).item()
    rel_l1 = ((a - r).abs().sum() / r.abs().sum()).item()
    return cos, rel_l1


def reference_grads(q, k, v, grad_o, seen, scale=None, layout="HND", grad_lse=None):
    """dq, dk, dv of sum(o ∘ grad_o) (+ sum(lse ∘ grad_lse)) by FP64 autograd under the
    boolean mask `seen` (broadcast to (B, Hq, Nq, Nkv)); rows that see no key contribute
    nothing."""
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    qh, kh, vh = (to_hnd(t, layout) for t in (qq, kk, vv))
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    sm = scale if scale is not None else 1.0 / math.sqrt(qh.shape[-1])
    seen = seen.to(qh.device)
    any_key = seen.any(-1, keepdim=True)
    # Empty rows get scores 0 (no -inf row, so no NaN in the softmax's gradient) and
    # weight 0.
    s = torch.where(any_key, (qh @ kh.transpose(-1, -2) * sm).masked_fill(~seen, -math.inf), 0.0)
    o = torch.softmax(s, -1) * any_key @ vh
    loss = (o * to_hnd(grad_o.double(), layout)).sum()
    if grad_lse is not None:
        loss = loss + (torch.logsumexp(s, -1) * any_key[..., 0] * grad_lse.double()).sum()
    loss.backward()
    return qq.grad, kk.grad, vv.grad
