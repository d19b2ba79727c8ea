"""The kernel's contract inside a model, on the CPU: qattn's CPU emulation (src/emulate)
as an SDPA-signature function."""

from __future__ import annotations

import torch

from ._sdpa import SdpaFn


def emulated_attention(precision: str = "fast") -> SdpaFn:
    """An SDPA-signature function that computes attention with the CPU emulation of
    qattn's SA2-8b kernel (src/emulate, the kernel's written contract: the GPU equals it
    to rounding) in a precision mode: "fast" (the kernel), "precise" (Q·Kᵀ and P·V in
    the inputs' 16-bit type) or "auto" (precise on the heads the precision guard flags),
    "int8qk_fp16pv" (SageAttention1's arithmetic: the kernel's INT8 Q·Kᵀ, P̃ and V in
    the 16-bit type) or "int8qk_int8pv" (the kernel's INT8 Q·Kᵀ, P̃·127 and V per channel
    in INT8); no kernel runs the last two.
    So compare() can show on a machine without a GPU what qattn will do to a model.
    Takes what the emulator takes: fp16/bf16 (other dtypes run as bf16), a boolean or
    additive attn_mask broadcast over batch and heads, top-left is_causal, GQA; no
    dropout. Slow (a scalar emulation of every rounding): small models and inputs."""
    if precision not in ("fast", "auto", "precise", "int8qk_fp16pv", "int8qk_int8pv"):
        raise ValueError(f"emulated_attention: precision = {precision!r}; allowed: fast, auto, "
                         "precise, int8qk_fp16pv, int8qk_int8pv")
    from .. import _C

    def emulated(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                 enable_gqa=False):
        if dropout_p != 0.0:
            raise ValueError("emulated_attention: dropout_p must be 0")
        b, hq, nq, d = query.shape
        hkv, nkv = key.shape[-3], key.shape[-2]
        key, value = key.expand(b, hkv, nkv, d), value.expand(b, hkv, nkv, value.shape[-1])

        def raw(t):
            return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()

        mask, mb, mh = b"", 1, 1
        if attn_mask is not None:
            m = attn_mask
            while m.dim() < 4:
                m = m.unsqueeze(0)
            mb, mh = m.shape[0], m.shape[1]
            m = m.expand(mb, mh, nq, nkv)
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=torch.float32).masked_fill(~m.cpu(), float("-inf"))
            mask = raw(m)
        dtype = "fp16" if query.dtype == torch.float16 else "bf16"
        o, _ = _C.emulated_attention(raw(query), raw(key), raw(value), b, hq, hkv, nq, nkv, d,
                                     0.0 if scale is None else float(scale), bool(is_causal), mask,
                                     mb, mh, precision, dtype)
        out = torch.frombuffer(bytearray(o), dtype=torch.float32).view(b, hq, nq, value.shape[-1])
        return out.to(device=query.device, dtype=query.dtype)

    return emulated
