"""What the plug-in GPU tests (test_integrations_transformers.py, test_integrations_diffusers.py)
share: the per-call check of the calls that reach qattn's kernel, and the error budget a
model gives (an attention with the largest error the per-call bound allows).

A plug-in test compares a model run with qattn against the same model with PyTorch's
SDPA with a bound the model itself gives: the output's CosSim when every attention output
carries the largest error that bound allows one call, a random error of relative L2 size
DELTA = sqrt(2 (1 - MIN_COSSIM)) (CosSim 1 - DELTA^2 / 2 = MIN_COSSIM)."""

import contextlib
import math

import torch

import qattn
from tolerances import MAX_REL_L1, MIN_COSSIM

DELTA = math.sqrt(2 * (1 - MIN_COSSIM))
F = torch.nn.functional


def cossim(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def rel_l1(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).abs().sum() / b.abs().sum()).item()


def kernel_calls_recorder(monkeypatch):
    """The calls that reach qattn's kernel (ops.attention, which the drop-in calls for the
    calls it runs): (query shape, CosSim, relative L1) against FP32 SDPA on the call's
    inputs; None, None for a call with options this check does not model (a mask). The
    test modules' `kernel_calls` fixture."""
    from qattn import ops

    seen = []
    real = ops.attention

    def spy(q, k, v, is_causal=False, scale=None, layout="HND", return_lse=False, **kw):
        out = real(q, k, v, is_causal, scale, layout, return_lse, **kw)
        if layout == "HND" and not return_lse and set(kw) <= {"causal_alignment"} \
                and kw.get("causal_alignment", "top_left") == "top_left":
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            seen.append((tuple(q.shape), cossim(out, ref), rel_l1(out, ref)))
        else:
            seen.append((tuple(q.shape), None, None))
        return out

    monkeypatch.setattr(ops, "attention", spy)
    return seen


def assert_calls_within_bounds(kernel_calls):
    """Every recorded call within the SA2-8b scheme's per-call bounds (tolerances.py)."""
    for shape, cs, l1 in kernel_calls:
        if cs is not None:
            assert cs >= MIN_COSSIM, f"call {shape}: CosSim {cs:.6f} < {MIN_COSSIM}"
            assert l1 <= MAX_REL_L1, f"call {shape}: relative L1 {l1:.4f} > {MAX_REL_L1}"


@contextlib.contextmanager
def largest_allowed_error(monkeypatch, seed):
    """qattn.scaled_dot_product_attention (what the plug-ins call) replaced by SDPA with a
    random error of relative L2 size DELTA on each output (generator seeded with `seed`)."""
    g = torch.Generator().manual_seed(seed)

    def noisy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        o = F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
        e = torch.randn(o.shape, generator=g).to(o.device)
        return (o.float() + e * (DELTA * o.float().norm() / e.norm())).to(o.dtype)

    with monkeypatch.context() as m:
        m.setattr(qattn, "scaled_dot_product_attention", noisy)
        yield
