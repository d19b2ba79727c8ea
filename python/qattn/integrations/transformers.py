"""qattn as an attention implementation of Hugging Face transformers 5.x (tested with
5.24; register() needs AttentionInterface and masking_utils, transformers 4.53 on), for
the models whose attention goes through transformers' AttentionInterface (nearly every
model in 5.x).

    import qattn.integrations.transformers as qattn_tf
    qattn_tf.register()                  # once per process: the name "qattn"
    qattn_tf.register("qattn_last_sdpa", sdpa_layers=(-1,))  # the last layer on SDPA
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="qattn",
                                                 dtype=torch.bfloat16, device_map="cuda")
    model.set_attn_implementation("qattn")          # or switch a loaded model

register() adds two entries under one name: the attention function (attention_forward
below, transformers.AttentionInterface) and the mask builder (transformers'
masking_utils.AttentionMaskInterface). The mask builder is transformers' own for
"sdpa", so a model run with "qattn" gets the masks it gets with "sdpa": None where the
mask is purely causal (then is_causal says it) or absent, otherwise a boolean
(B, 1, Nq, Nkv) mask, True = attend. Without that entry transformers builds no mask at
all for a name it does not know, and padding would be ignored.

attention_forward is transformers' "sdpa" function (integrations/sdpa_attention.py)
with torch.nn.functional.scaled_dot_product_attention replaced by
qattn.scaled_dot_product_attention, so the decisions are the same:
  * is_causal: the module's (or the caller's) flag, and only when the call has more
    than one query and no mask. One query (a decode step) attends to every key it is
    given; a query block after a KV cache (Nq > 1, Nkv > Nq) arrives with the mask
    transformers built, aligned bottom-right (query i sees keys j <= i + Nkv - Nq).
    The one unmasked causal call with Nkv > Nq, the prefill of an empty static cache,
    is cropped to the first Nq keys (SDPA's top-left rule would give the same result).
  * GQA: enable_gqa=True (no copies of K and V); PyTorch < 2.5 gets repeated K and V.
  * dropout (training) and scaling pass through; qattn has no dropout, so a training
    call with attention dropout runs on SDPA (a QattnFallbackWarning, once).
  * a position bias (T5-like models) becomes an additive float mask, as in "sdpa".
  * softcap is refused and output_attentions returns no weights, as in "sdpa".
What qattn does not run goes to PyTorch's SDPA with a QattnFallbackWarning once per
reason (qattn.set_fallback("raise") makes it an error); docs/integrations.md lists it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import qattn
from qattn.sdpa import sdpa_in_mode

NAME = "qattn"

_SDPA_HAS_GQA = "enable_gqa" in [a.name for a in torch.ops.aten.scaled_dot_product_attention.default._schema.arguments]

_logged = set()


def _warn_once(key: str, message: str) -> None:
    if key in _logged:
        return
    _logged.add(key)
    from transformers.utils import logging

    logging.get_logger(__name__).warning(message)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, N, d) -> (B, Hkv * n_rep, N, d), head h reading KV head h // n_rep."""
    if n_rep == 1:
        return x
    b, hkv, n, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, n, d).reshape(b, hkv * n_rep, n, d)


def _position_bias_mask(position_bias, attention_mask, is_causal, query, key):
    """An additive float mask of the position bias and the mask or the causal rule
    (transformers' create_position_bias_mask)."""
    min_value = torch.finfo(key.dtype).min
    if attention_mask is None:
        if not is_causal:
            return position_bias.contiguous()
        nq, nkv = query.shape[2], key.shape[2]
        causal = torch.arange(nq, device=key.device)[:, None] >= torch.arange(nkv, device=key.device)[None, :]
        return torch.where(causal.view(1, 1, nq, nkv), position_bias, min_value).contiguous()
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, min_value).contiguous()
    return (position_bias + attention_mask).contiguous()


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[torch.Tensor] = None,
    precision: Optional[str] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Nq, d), key and value
    (B, Hkv, Nkv, d), attention_mask None or SDPA's (boolean: True = attend, or
    additive float) broadcastable to (B, Hq, Nq, Nkv). Returns (attn_output of shape
    (B, Nq, Hq, d), contiguous; None: no attention weights). precision: this call's mode
    ("fast", "auto", "precise"; register(..., precision=) passes it), None: the
    process's (qattn.set_precision)."""
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "attn_implementation='qattn' does not support softcap (as 'sdpa' does not); use "
            "'eager' or a kernel that has it"
        )
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "attn_implementation='qattn' returns no attention weights "
                   "(output_attentions=True); use 'eager' for them")

    q_length = query.shape[2]
    sdpa_kwargs = {}
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_q != heads_kv:
        if _SDPA_HAS_GQA:
            sdpa_kwargs["enable_gqa"] = True
        elif heads_kv > 0 and heads_q % heads_kv == 0:
            key = _repeat_kv(key, heads_q // heads_kv)
            value = _repeat_kv(value, heads_q // heads_kv)

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # The shape test first: under torch.compile with dynamic shapes it keeps is_causal a bool.
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if torch.jit.is_tracing() and isinstance(is_causal, torch.Tensor):
        is_causal = bool(is_causal.item())

    kv_length = key.shape[2]
    if is_causal and kv_length > q_length:
        # Prefill of an empty static cache: the keys past the queries are unused slots.
        key = key[:, :, :q_length]
        value = value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]

    if position_bias is not None:
        attention_mask = _position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False

    if precision is None:  # the process's mode (qattn.set_precision)
        out = qattn.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout,
            is_causal=bool(is_causal), scale=scaling, **sdpa_kwargs,
        )
    else:  # a registration's own mode, passed as an argument (torch.compile traces it)
        out = sdpa_in_mode(query, key, value, attention_mask, dropout, bool(is_causal), scaling,
                           sdpa_kwargs.get("enable_gqa", False), precision)
    # The batch from the output: SDPA broadcasts it (e.g. learned queries of batch 1).
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def _sdpa_in_layers(layers: Tuple[int, ...]):
    """attention_forward, except in the given layers (module.layer_idx; a negative index
    counts from the last, through module.config.num_hidden_layers), which run
    transformers' own "sdpa" attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, precision=None, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if idx is not None:
            n = getattr(getattr(module, "config", None), "num_hidden_layers", None)
            wanted = {i if i >= 0 or n is None else n + i for i in layers}
            if idx in wanted:
                return sdpa_attention_forward(module, query, key, value, attention_mask,
                                              dropout=dropout, scaling=scaling,
                                              is_causal=is_causal, **kwargs)
        return attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, is_causal=is_causal, precision=precision,
                                 **kwargs)

    forward.qattn_sdpa_layers = layers
    return forward


def _in_precision(fn, mode: str):
    """fn with qattn's attention in precision `mode` for each of its calls (passed as an
    argument, which torch.compile traces)."""

    def forward(*args, **kwargs):
        return fn(*args, precision=mode, **kwargs)

    forward.qattn_precision = mode
    forward.qattn_sdpa_layers = getattr(fn, "qattn_sdpa_layers", ())
    return forward


def register(name: str = NAME, sdpa_layers: Tuple[int, ...] = (), precision: Optional[str] = None) -> str:
    """Registers qattn with transformers under `name` (default "qattn"): the attention
    function (AttentionInterface) and SDPA's mask builder (AttentionMaskInterface), so
    that from_pretrained(..., attn_implementation=name) and
    model.set_attn_implementation(name) select it. Idempotent; returns the name.
    Imports transformers (ImportError if it is missing).

    sdpa_layers: layer indices (the attention module's layer_idx; -1 is the last layer)
    whose attention stays on transformers' "sdpa", in the model's own 16-bit type — the
    layers where the model is most sensitive to the attention's error, e.g. the last one
    of an encoder whose output is pooled (SageAttention3 keeps such layers in 16 bits;
    `qattn.tools.compare(..., ablate=True)` ranks a model's layers).
    precision: None (the process's, qattn.set_precision) or "fast", "auto", "precise"
    for this registration's layers (e.g. register("qattn_auto", precision="auto"))."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not all(isinstance(i, int) and not isinstance(i, bool) for i in sdpa_layers):
        raise ValueError(f"sdpa_layers = {sdpa_layers!r}; allowed: a tuple of layer indices (ints)")
    if precision is not None and precision not in ("fast", "auto", "precise"):
        raise ValueError(f"precision = {precision!r}; allowed: None, 'fast', 'auto' or 'precise'")
    fn = _sdpa_in_layers(tuple(sdpa_layers)) if sdpa_layers else attention_forward
    if precision is not None:
        fn = _in_precision(fn, precision)
    transformers.AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def is_registered(name: str = NAME) -> bool:
    """True when `name` selects qattn's attention function in transformers (False when
    transformers is not installed)."""
    try:
        import transformers
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    fn = transformers.AttentionInterface._global_mapping.get(name)
    ours = fn is attention_forward or hasattr(fn, "qattn_sdpa_layers")
    return ours and AttentionMaskInterface._global_mapping.get(name) is sdpa_mask


__all__ = ["NAME", "attention_forward", "is_registered", "register"]
