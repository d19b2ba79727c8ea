"""qattn under Hugging Face diffusers' attention (tested with diffusers 0.42; the dispatcher
backend needs the attention dispatcher, diffusers 0.35 on).

    import qattn.integrations.diffusers as qattn_df
    report = qattn_df.apply(pipe)        # a pipeline, or a model / module of one
    image = pipe(prompt).images[0]
    qattn_df.restore(pipe)               # back to the processors apply() replaced

diffusers computes attention in one of two ways, and apply() covers both:

  * Attention processors that call torch.nn.functional.scaled_dot_product_attention
    themselves. apply() replaces the two general ones with qattn's copies, which are
    the same code with qattn.scaled_dot_product_attention in the call:
      AttnProcessor2_0      -> QattnAttnProcessor       (UNet2DConditionModel and the
                               other UNets, AutoencoderKL's attention, PixArt, DiT, ...)
      JointAttnProcessor2_0 -> QattnJointAttnProcessor  (SD3Transformer2DModel,
                               SD3ControlNetModel: SD3's joint attention)
    through set_attn_processor on each model (set_processor on a bare Attention module).
  * Processors that go through diffusers' attention dispatcher
    (diffusers.models.attention_dispatch.dispatch_attention_fn: Flux, Flux 2, Wan,
    Qwen-Image, HunyuanVideo, LTX-Video, Cosmos, ...; every processor with an
    `_attention_backend` attribute). register_backend() adds a "qattn" backend to the
    dispatcher, and apply() sets it on each such processor. After register_backend()
    the dispatcher's own switches take the name too:
      diffusers.models.attention_dispatch.attention_backend("qattn")   # context manager
      model.set_attention_backend("qattn")                             # every layer

The dispatcher names its backends by the enum AttentionBackendName and has no public
call to add one, so register_backend() adds the member "qattn" to that enum and
registers the function with the dispatcher's registry (_AttentionBackendRegistry):
the one step that relies on diffusers' internals. Where they differ from what this
module expects, register_backend() returns False with a warning and apply() leaves the
dispatcher's processors as they are. The backend runs no context parallelism (a
processor with a parallel config keeps its backend) and no return_lse.

Processors of neither kind (the model-specific ones that call PyTorch's SDPA
themselves: CogVideoX, AuraFlow, Hunyuan-DiT, Lumina, Allegro, Stable Audio; the
IP-Adapter, PAG, custom-diffusion and fused-QKV variants; AttnProcessor for layers
without scaled QK) are left alone; apply()'s report counts them by class name.

Every call goes through qattn.scaled_dot_product_attention, so what qattn does not run
(see qattn.sdpa: e.g. a head dim above 128 such as AutoencoderKL's 512-channel
attention, fp32 tensors, a CPU device) runs on PyTorch's SDPA with a
QattnFallbackWarning once per reason, or raises under qattn.set_fallback("raise").
diffusers is imported when a function here is called, not when this module is.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Optional

import torch

import qattn

BACKEND = "qattn"

_SDPA_HAS_GQA = "enable_gqa" in [a.name for a in torch.ops.aten.scaled_dot_product_attention.default._schema.arguments]

_backend_member = None  # the AttentionBackendName member once register_backend() succeeded
_backend_failed = None  # why it did not, once it did not


# ---- processors for the processors that call PyTorch's SDPA themselves -------------------


class QattnAttnProcessor:
    """diffusers' AttnProcessor2_0 (the default processor of diffusers' Attention), with
    qattn.scaled_dot_product_attention in place of PyTorch's. Same arguments, masks and
    outputs; like AttnProcessor2_0 it scales the scores by 1/sqrt(head dim)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        temb: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            from diffusers.utils import deprecate

            deprecate("scale", "1.0.0", "The `scale` argument is deprecated and will be ignored. Please "
                      "remove it; pass it to the pipeline through `cross_attention_kwargs` instead.")

        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # SDPA's (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = qattn.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)  # linear projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        return hidden_states / attn.rescale_output_factor


class QattnJointAttnProcessor:
    """diffusers' JointAttnProcessor2_0 (SD3's joint attention over the image and the
    text tokens, concatenated), with qattn.scaled_dot_product_attention in place of
    PyTorch's."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ):
        residual = hidden_states
        batch_size = hidden_states.shape[0]

        # the image tokens' projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # the text tokens' projections
        if encoder_hidden_states is not None:
            context_q = attn.add_q_proj(encoder_hidden_states)
            context_k = attn.add_k_proj(encoder_hidden_states)
            context_v = attn.add_v_proj(encoder_hidden_states)

            context_q = context_q.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            context_k = context_k.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            context_v = context_v.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

            if attn.norm_added_q is not None:
                context_q = attn.norm_added_q(context_q)
            if attn.norm_added_k is not None:
                context_k = attn.norm_added_k(context_k)

            query = torch.cat([query, context_q], dim=2)
            key = torch.cat([key, context_k], dim=2)
            value = torch.cat([value, context_v], dim=2)

        hidden_states = qattn.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        hidden_states = attn.to_out[0](hidden_states)  # linear projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def _replacements():
    """diffusers' processor class -> qattn's, by exact class (a subclass may compute
    something else)."""
    from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0

    return {AttnProcessor2_0: QattnAttnProcessor, JointAttnProcessor2_0: QattnJointAttnProcessor}


# ---- the dispatcher backend -----------------------------------------------------------


def dispatch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """The "qattn" backend of diffusers' dispatcher: its "native" backend (query (B, Nq,
    Hq, d), key and value (B, Nkv, Hkv, d), the output (B, Nq, Hq, d)) on
    qattn.scaled_dot_product_attention. A (B, Nkv) mask is read as (B, 1, 1, Nkv), as the
    native backend does."""
    if return_lse:
        raise ValueError("the qattn attention backend does not return the LSE (return_lse=True)")
    if _parallel_config is not None:
        raise ValueError("the qattn attention backend runs no context parallelism; use a backend "
                         "that does (e.g. 'native') for a model with a parallel config")
    if (attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    kwargs = {"enable_gqa": True} if enable_gqa and _SDPA_HAS_GQA else {}
    out = qattn.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, **kwargs)
    return out.permute(0, 2, 1, 3)


def _add_enum_member(enum_cls, name: str, value: str):
    """Adds the member `name` = `value` to a str-valued Enum class (what aenum's
    extend_enum does; the same steps hold from Python 3.9 to 3.13)."""
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def register_backend() -> bool:
    """Registers "qattn" with diffusers' attention dispatcher (see the module docstring).
    True on success (also when already registered); False, with a warning, when this
    diffusers' dispatcher is not one it can extend. Imports diffusers (ImportError if
    it is missing)."""
    global _backend_member, _backend_failed
    if _backend_member is not None:
        return True
    import diffusers  # noqa: F401 (ImportError here when it is missing)

    try:
        from diffusers.models import attention_dispatch as dispatch

        names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
        try:
            member = names(BACKEND)
        except ValueError:
            member = _add_enum_member(names, BACKEND.upper(), BACKEND)
        checks = [getattr(dispatch, c) for c in ("_check_device", "_check_shape") if hasattr(dispatch, c)]
        options = {}
        if "supports_context_parallel" in inspect.signature(registry.register).parameters:
            options["supports_context_parallel"] = False  # the argument is newer than the registry
        registry.register(member, constraints=checks, **options)(dispatch_attention)
        if registry._backends.get(member) is not dispatch_attention or names(BACKEND) is not member:
            raise RuntimeError("the registry did not keep the backend")
    except Exception as error:  # noqa: BLE001 (any mismatch with the internals counts)
        _backend_failed = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"qattn.integrations.diffusers: cannot add a 'qattn' backend to this diffusers' "
            f"attention dispatcher ({_backend_failed}); models that use the dispatcher keep "
            "their backend, the processors that call SDPA themselves are still replaced",
            RuntimeWarning, stacklevel=2,
        )
        return False
    _backend_member = member
    return True


# ---- apply / restore -----------------------------------------------------------------------


def _roots(obj):
    if isinstance(obj, torch.nn.Module):
        return [obj]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [c for c in components.values() if isinstance(c, torch.nn.Module)]
    raise TypeError(f"apply/restore take a diffusers pipeline or a torch.nn.Module, not a {type(obj).__name__}")


def _owners(obj):
    """The modules whose processors apply() sets: each model with set_attn_processor
    (its attention layers through it), and each attention module (one with set_processor
    and a processor) outside such a model."""
    stack = list(reversed(_roots(obj)))
    seen = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if hasattr(m, "set_attn_processor") and hasattr(m, "attn_processors"):
            yield "model", m
            continue
        if hasattr(m, "set_processor") and hasattr(m, "processor"):
            yield "layer", m
            continue
        stack.extend(reversed(list(m.children())))


def _set_processors(kind, owner, fn) -> None:
    """Replaces each processor p of owner by fn(p) (a function that returns p itself
    when it changes nothing)."""
    if kind == "layer":
        new = fn(owner.processor)
        if new is not owner.processor:
            owner.set_processor(new)
        return
    current = owner.attn_processors
    updated = {name: fn(p) for name, p in current.items()}
    if any(updated[name] is not p for name, p in current.items()):
        owner.set_attn_processor(updated)


def apply(pipe_or_module, *, dispatcher: bool = True) -> dict:
    """Puts qattn under every attention layer of a diffusers pipeline (its components)
    or a model or module: AttnProcessor2_0 and JointAttnProcessor2_0 become
    QattnAttnProcessor and QattnJointAttnProcessor, and (with dispatcher=True) each
    processor that goes through diffusers' dispatcher gets the "qattn" backend. Returns
    a report: {"processors": layers given qattn's processors, "dispatcher": processors
    given the qattn backend, "unchanged": {processor class: count} left as they were}.
    restore() undoes it."""
    replacements = _replacements()
    use_dispatcher = dispatcher and register_backend()
    report = {"processors": 0, "dispatcher": 0, "unchanged": {}}
    swapped = {}  # id(original) -> qattn's processor, so shared processors stay shared

    def swap(p):
        cls = replacements.get(type(p))
        if cls is not None:
            report["processors"] += 1
            if id(p) not in swapped:
                new = cls()
                new._qattn_original = p
                swapped[id(p)] = new
            return swapped[id(p)]
        if isinstance(p, (QattnAttnProcessor, QattnJointAttnProcessor)):
            report["processors"] += 1
            return p
        if (use_dispatcher and hasattr(type(p), "_attention_backend")
                and getattr(p, "_parallel_config", None) is None):
            if p._attention_backend is not _backend_member:
                p._qattn_previous_backend = p._attention_backend
                p._attention_backend = _backend_member
            report["dispatcher"] += 1
            return p
        name = type(p).__name__
        report["unchanged"][name] = report["unchanged"].get(name, 0) + 1
        return p

    for kind, owner in _owners(pipe_or_module):
        _set_processors(kind, owner, swap)
    return report


def restore(pipe_or_module) -> int:
    """Undoes apply(): the processors it replaced come back (the same objects) and the
    dispatcher's processors get their previous backend. Returns the number of layers
    changed back."""
    restored = [0]

    def back(p):
        original = getattr(p, "_qattn_original", None)
        if isinstance(p, (QattnAttnProcessor, QattnJointAttnProcessor)) and original is not None:
            restored[0] += 1
            return original
        if _backend_member is not None and getattr(p, "_attention_backend", None) is _backend_member:
            previous = p.__dict__.pop("_qattn_previous_backend", None)
            if previous is None and "_attention_backend" in p.__dict__:
                del p._attention_backend  # the class's default again
            else:
                p._attention_backend = previous
            restored[0] += 1
        return p

    for kind, owner in _owners(pipe_or_module):
        _set_processors(kind, owner, back)
    return restored[0]


__all__ = [
    "BACKEND",
    "QattnAttnProcessor",
    "QattnJointAttnProcessor",
    "apply",
    "dispatch_attention",
    "register_backend",
    "restore",
]
