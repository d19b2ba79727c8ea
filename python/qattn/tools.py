"""Does qattn change a model's output? compare() runs a model with PyTorch's SDPA (the
reference), with a second 16-bit attention (the noise floor: how far two exact-in-intent
BF16/FP16 implementations already differ) and with each candidate attention, and reports
how far each output moves from the reference's, the floor beside it, and where in the
model the attention moves most.

    import qattn, qattn.tools

    def run():                                   # the model on your inputs, one output tensor
        return model(**batch).last_hidden_state

    report = qattn.tools.compare(run)            # candidates: {"qattn": qattn's SDPA drop-in}
    print(report.table())
    report.to_dict()                             # for JSON

How: each run replaces torch.nn.functional.scaled_dot_product_attention for its
duration (the function that transformers' "sdpa" attention, diffusers' processors and
most hand-written models call), so the model needs no change; it must run its
attention through that function (transformers: attn_implementation="sdpa") and do the
same calls in the same order each run (eval mode, no dropout).

What it reports, per candidate (and for the floor):
  * the output against the reference's: CosSim of the whole output, the lowest CosSim of
    one row (the last dimension), relative L1, and — with logits=True, the output being
    next-token logits (..., vocab) — the mean KL divergence KL(reference ‖ candidate) of
    the next-token distributions and the top-1 agreement; `loss` is 1 − CosSim (or the
    KL with logits=True) and `x_floor` that loss over the floor's;
  * per attention call (layers=True), the call's own error: the candidate and the
    reference on the very inputs the reference run gives that call, so an error does not
    accumulate from the calls before it (CosSim and relative L1 of the call's output);
  * per layer (guard=True), the share of heads the precision guard flags
    (precision_guard: where INT8 Q·Kᵀ's score error exceeds FP8 P·V's) and its largest
    σ: whether the layers that move are the ones the rule expects;
  * per layer (ablate=True), the SageAttention3 sensitivity ablation: the whole
    output's loss when only that layer's calls run the candidate and every other call
    the reference (one model run per layer).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

_torch_sdpa = torch._C._nn.scaled_dot_product_attention  # PyTorch's own, never a patch

SdpaFn = Callable[..., torch.Tensor]


@contextlib.contextmanager
def sdpa_replaced(fn: SdpaFn):
    """torch.nn.functional.scaled_dot_product_attention is `fn` inside the block."""
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def eager_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                    scale=None, enable_gqa=False) -> torch.Tensor:
    """SDPA's semantics in plain PyTorch operations in the inputs' dtype, as Hugging Face
    transformers' "eager" attention computes: scores by a 16-bit matmul (FP32
    accumulation, rounded to the dtype), softmax in FP32 (FP64 for FP64 inputs) rounded
    to the dtype, P·V by a 16-bit matmul. The default noise floor of compare()."""
    if dropout_p != 0.0:
        raise ValueError("eager_attention: dropout_p must be 0 (compare runs a model in eval mode)")
    nq, nkv = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:  # top-left, as SDPA: query i sees keys j <= i
        visible = torch.ones(nq, nkv, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    p = torch.nan_to_num(p, nan=0.0).to(query.dtype)  # a row that sees no key: 0
    return p @ value


def hadamard_matrix(d: int, for_q: bool, dtype=torch.float32, device=None) -> torch.Tensor:
    """R = diag(s)·H·2^-e of numerics/hadamard.h (d = 2^m; e = ceil(m/2) for Q, floor(m/2)
    for K): x·R is the rotation the SA2 emulator's QkRotation::Hadamard applies to a row,
    and (q·R_q)·(k·R_k) = q·k exactly in real arithmetic."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard_matrix: d = {d} is not a power of two")
    m = d.bit_length() - 1
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    pattern = 0x9E3779B97F4A7C15
    signs = torch.tensor([-1.0 if ((pattern >> (c & 63)) ^ (c >> 6)) & 1 else 1.0 for c in range(d)],
                         dtype=torch.float64)
    e = (m + 1) // 2 if for_q else m // 2
    return (signs[:, None] * h * 2.0 ** -e).to(dtype=dtype, device=device)


def hadamard_rotated(sdpa: Optional[SdpaFn] = None) -> SdpaFn:
    """An SDPA-signature function that rotates query and key by hadamard_matrix (in FP32,
    FP64 for FP64 inputs, rounded back to their dtype) and calls `sdpa` (default: qattn's drop-in) with the
    caller's scale (1/sqrt(d) by default): attention is unchanged in exact arithmetic,
    while INT8 quantization sees rows whose energy is spread over every channel (the
    `qk_rotation` study of `qattn accuracy`). Head dims that are not a power of two pass
    through unrotated. An experiment for compare() and the benchmarks, not a mode of
    the library: the rotation costs two more passes over Q and K."""
    if sdpa is None:
        import qattn

        sdpa = qattn.scaled_dot_product_attention

    def rotated(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                enable_gqa=False):
        d = query.shape[-1]
        if d & (d - 1) == 0 and key.shape[-1] == d:
            scale = 1.0 / math.sqrt(d) if scale is None else scale
            work = torch.promote_types(query.dtype, torch.float32)  # FP32, or FP64 for FP64
            rq = hadamard_matrix(d, True, work, query.device)
            rk = hadamard_matrix(d, False, work, key.device)
            query = (query.to(work) @ rq).to(query.dtype)
            key = (key.to(work) @ rk).to(key.dtype)
        kwargs = {"scale": scale}
        if enable_gqa:
            kwargs["enable_gqa"] = True
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    return rotated


# ---- the precision guard ---------------------------------------------------------------

GUARD_THRESHOLD_NATS = 2.0 ** -4 / math.sqrt(8.0 * math.log(2.0))  # ε_E4M3 (emulate/precision.h)
_SMOOTH_SAMPLE = 256  # numerics/token_sample.h: the K mean's token sample


def _int8_codes(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The INT8 codes of x (FP32) in groups of amax (broadcast to x): clamp(rne(x·127/amax)),
    0 where amax is 0 (numerics/block_scale.h, formats.h)."""
    # A tensor divisor: PyTorch computes scalar / tensor as a product with a reciprocal,
    # which is not the correctly rounded quotient the emulator (and the kernel) use.
    mult = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / amax)
    return torch.round(x * mult).clamp(-127, 127)


def precision_guard(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None):
    """The precision guard of qattn's fast arithmetic on q (B, Hq, Nq, d) and k (B, Hkv,
    Nkv, d): per (batch, query head) σ, the worst (query, key) pair's RMS score error in
    nats that INT8 Q·Kᵀ makes under the rounding model, and whether it exceeds
    GUARD_THRESHOLD_NATS (the RMS relative error of an E4M3 cast: above it, Q·Kᵀ costs
    more than the FP8 P·V that follows). The rule and its derivation are
    src/emulate/precision.h's and docs/accuracy-report.md's; this is that rule computed
    with torch operations on the tensors' device (no host synchronization: it returns
    tensors), on the same quantization groups as the kernel (per-thread Q groups of two
    rows, per-thread K groups of 32 tokens per 128-token tile, K smoothed by its sampled
    mean). Equal to the CPU emulation's σ up to FP32 rounding. Returns (sigma float64
    (B, Hq), flagged bool (B, Hq))."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    sm = 1.0 / math.sqrt(d) if scale is None else scale
    f32 = torch.float32
    scale_log2 = float(torch.tensor(sm, dtype=f32) * torch.tensor(math.log2(math.e), dtype=f32))
    qf, kf = q.to(f32), k.to(f32)
    # K smoothed by the mean of its token sample (all tokens up to 256, else 256 spread).
    n_s = min(nkv, _SMOOTH_SAMPLE)
    rows = torch.arange(n_s, device=k.device)
    if nkv > _SMOOTH_SAMPLE:
        rows = rows * nkv // _SMOOTH_SAMPLE
    # Summed in FP64 in token order (a cumulative sum's last entry, sequential on the
    # CPU) as numerics::token_mean sums, so c is the emulator's to the last bit.
    c = (kf.index_select(2, rows).double().cumsum(dim=2)[:, :, -1:] / n_s).to(f32)
    ks = kf - c
    # K groups: token j of a 128-token tile is in group (j % 8) // 2 of that tile.
    nkv_pad = -(-nkv // 128) * 128
    ks = F.pad(ks, (0, 0, 0, nkv_pad - nkv)).view(b, hkv, nkv_pad // 128, 16, 4, 2, d)
    k_amax = ks.abs().amax(dim=(3, 5, 6), keepdim=True)
    k_step2 = (k_amax / 127.0).double().square()  # b_j² of each group
    k_norm2 = (_int8_codes(ks, k_amax).double().square().sum(-1, keepdim=True) * k_step2)
    k_step2 = k_step2.flatten(2).amax(-1)  # (B, Hkv): max b_j²
    k_norm2 = k_norm2.flatten(2).amax(-1)  # max b_j²·|k̂_j|²
    # Q groups: in each 64-row block, rows r and r + 8 of each 16-row warp slice.
    nq_pad = -(-nq // 128) * 128
    qs = F.pad(qf, (0, 0, 0, nq_pad - nq)).view(b, hq, nq_pad // 64, 4, 2, 8, d)
    q_amax = qs.abs().amax(dim=(4, 6), keepdim=True)
    a = (q_amax / 127.0) * scale_log2  # FP32, as the emulator folds scale_log2 in
    a2 = a.double().square()
    q_norm2 = (_int8_codes(qs, q_amax).double().square().sum(-1, keepdim=True) * a2)
    a2 = a2.flatten(2).amax(-1)
    q_norm2 = q_norm2.flatten(2).amax(-1)
    rep = hq // hkv
    var = (a2 * k_norm2.repeat_interleave(rep, dim=1) + k_step2.repeat_interleave(rep, dim=1) * q_norm2) / 12
    sigma = var.sqrt() * math.log(2.0)
    return sigma, ~(sigma <= GUARD_THRESHOLD_NATS)  # NaN flags, as in the emulator


# ---- the kernel's contract inside a model, on the CPU ------------------------------------


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
    from . import _C

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


def _default_candidates() -> Dict[str, SdpaFn]:
    import qattn

    return {"qattn": qattn.scaled_dot_product_attention}


# ---- metrics ---------------------------------------------------------------------------


def output_metrics(out: torch.Tensor, ref: torch.Tensor, logits: bool = False) -> Dict[str, float]:
    """cos, min_row_cos, rel_l1 (and with logits: kl, top1) of `out` against `ref`, in
    FP64; rows are the last dimension."""
    o, r = out.detach().double(), ref.detach().double()
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} differs from the reference's {tuple(r.shape)}")
    of, rf = o.flatten(), r.flatten()
    m = {
        "cos": (of @ rf / (of.norm() * rf.norm())).item(),
        "min_row_cos": F.cosine_similarity(o.reshape(-1, o.shape[-1]), r.reshape(-1, r.shape[-1]),
                                           dim=-1).min().item(),
        "rel_l1": ((of - rf).abs().sum() / rf.abs().sum()).item(),
    }
    if logits:
        lr = torch.log_softmax(r, dim=-1)
        lo = torch.log_softmax(o, dim=-1)
        m["kl"] = (lr.exp() * (lr - lo)).sum(-1).mean().item()
        m["top1"] = (o.argmax(-1) == r.argmax(-1)).double().mean().item()
    m["loss"] = m["kl"] if logits else 1.0 - m["cos"]
    return m


# ---- the report ------------------------------------------------------------------------


@dataclass
class CallError:
    """One attention call's own error (the candidate on the reference run's inputs)."""
    index: int
    layer: int
    shape: tuple  # query's shape
    cos: float
    rel_l1: float


@dataclass
class Comparison:
    reference: str
    floor: str
    logits: bool
    metrics: Dict[str, Dict[str, float]] = field(default_factory=dict)   # name -> output metrics
    layers: Dict[str, List[CallError]] = field(default_factory=dict)     # candidate -> per call
    ablation: Dict[str, List[float]] = field(default_factory=dict)       # candidate -> loss per layer
    outputs: Dict[str, torch.Tensor] = field(default_factory=dict)       # keep_outputs=True
    guard: List[Dict[str, float]] = field(default_factory=list)          # per call (guard=True)

    def layer_summary(self, name: str) -> List[Dict[str, float]]:
        """Per layer of candidate `name`: its calls' mean and lowest own CosSim and mean
        relative L1."""
        by_layer: Dict[int, List[CallError]] = {}
        for c in self.layers.get(name, []):
            by_layer.setdefault(c.layer, []).append(c)
        return [{"layer": layer, "calls": len(cs), "mean_cos": sum(c.cos for c in cs) / len(cs),
                 "min_cos": min(c.cos for c in cs), "mean_rel_l1": sum(c.rel_l1 for c in cs) / len(cs)}
                for layer, cs in sorted(by_layer.items())]

    def guard_summary(self) -> List[Dict[str, float]]:
        """Per layer (guard=True): the share of its calls' heads the precision guard
        flags and its largest σ (nats)."""
        by_layer: Dict[int, List[Dict[str, float]]] = {}
        for g in self.guard:
            by_layer.setdefault(g["layer"], []).append(g)
        return [{"layer": layer, "calls": len(gs),
                 "flagged": sum(g["flagged"] for g in gs) / len(gs),
                 "sigma_max": max(g["sigma_max"] for g in gs)}
                for layer, gs in sorted(by_layer.items())]

    def to_dict(self) -> dict:
        return {
            "reference": self.reference,
            "floor": self.floor,
            "logits": self.logits,
            "metrics": self.metrics,
            "layers": {name: self.layer_summary(name) for name in self.layers},
            "ablation": self.ablation,
            "guard": self.guard_summary(),
        }

    def table(self) -> str:
        loss = "KL" if self.logits else "1-CosSim"
        lines = [f"{'attention':<16}{'CosSim':>10}{'min row':>10}{'rel L1':>10}{loss:>11}{'x floor':>9}"]
        for name, m in self.metrics.items():
            x = f"{m['x_floor']:.2f}" if "x_floor" in m else "-"
            lines.append(f"{name:<16}{m['cos']:>10.6f}{m['min_row_cos']:>10.6f}{m['rel_l1']:>10.5f}"
                         f"{m['loss']:>11.3e}{x:>9}")
        for name in self.layers:
            worst = sorted(self.layer_summary(name), key=lambda r: r["mean_cos"])[:3]
            lines.append(f"{name}: {len(self.layers[name])} attention calls; lowest own CosSim: "
                         + ", ".join(f"layer {r['layer']} {r['mean_cos']:.6f}" for r in worst))
        if self.guard:
            lines.append("precision guard, heads flagged per layer: " + ", ".join(
                f"{r['layer']}: {r['flagged']:.2f}" for r in self.guard_summary()))
        for name, losses in self.ablation.items():
            top = sorted(range(len(losses)), key=lambda i: -losses[i])[:3]
            lines.append(f"{name} in one layer only, output {loss}: "
                         + ", ".join(f"layer {i} {losses[i]:.3e}" for i in top))
        return "\n".join(lines)


def _probe(candidates: Mapping[str, SdpaFn], calls: Dict[str, List[CallError]],
           layer_of: Callable[[int], int], guard: Optional[List[Dict[str, float]]]) -> SdpaFn:
    """An SDPA that returns the reference's output and records each candidate's error
    on the same inputs (and, given a list, the precision guard of each call)."""

    def probe(query, key, value, *args, **kwargs):
        ref = _torch_sdpa(query, key, value, *args, **kwargs)
        if guard is not None:
            sigma, flagged = precision_guard(query, key, kwargs.get("scale"))
            i = len(guard)
            guard.append({"index": i, "layer": layer_of(i), "flagged": flagged.double().mean().item(),
                          "sigma_max": sigma.max().item()})
        for name, fn in candidates.items():
            out = fn(query, key, value, *args, **kwargs)
            m = output_metrics(out, ref)
            i = len(calls[name])
            calls[name].append(CallError(i, layer_of(i), tuple(query.shape), m["cos"], m["rel_l1"]))
        return ref

    return probe


def _only_in(layer: int, layer_of: Callable[[int], int], candidate: SdpaFn) -> SdpaFn:
    """An SDPA that runs `candidate` in the calls of `layer` and the reference elsewhere."""
    count = [0]

    def fn(*args, **kwargs):
        i = count[0]
        count[0] += 1
        return (candidate if layer_of(i) == layer else _torch_sdpa)(*args, **kwargs)

    return fn


def compare(run: Callable[[], torch.Tensor], candidates: Optional[Mapping[str, SdpaFn]] = None, *,
            floor: Optional[SdpaFn] = eager_attention, floor_name: str = "eager",
            logits: bool = False, layers: bool = True, ablate: bool = False,
            layer_of: Optional[Callable[[int], int]] = None, guard: bool = False,
            keep_outputs: bool = False) -> Comparison:
    """Runs `run()` (the model on fixed inputs, returning one tensor) with PyTorch's SDPA,
    with `floor` (None: no floor) and with each candidate (name -> a function of SDPA's
    signature; default {"qattn": qattn.scaled_dot_product_attention}); see the module
    docstring for what is reported. layer_of maps an attention call's index in a run to
    its layer (default: each call its own), e.g. `lambda i: i % n_layers` when `run`
    runs the model on several batches; the ablation runs the candidate in one layer at a
    time. guard=True (with layers) also records the precision guard of every call
    (precision_guard: the share of heads it flags, the largest σ). Runs under
    torch.no_grad()."""
    layer_of = layer_of or (lambda i: i)
    candidates = dict(_default_candidates() if candidates is None else candidates)
    report = Comparison(reference="sdpa", floor=floor_name if floor is not None else "", logits=logits)
    with torch.no_grad():
        with sdpa_replaced(_torch_sdpa):
            ref = run()
        runs = dict(candidates)
        if floor is not None:
            runs = {floor_name: floor, **runs}
        for name, fn in runs.items():
            with sdpa_replaced(fn):
                out = run()
            report.metrics[name] = output_metrics(out, ref, logits)
            if keep_outputs:
                report.outputs[name] = out
        if keep_outputs:
            report.outputs["sdpa"] = ref
        if floor is not None:
            floor_loss = report.metrics[floor_name]["loss"]
            for name in candidates:
                if floor_loss > 0:
                    report.metrics[name]["x_floor"] = report.metrics[name]["loss"] / floor_loss
        if layers:
            report.layers = {name: [] for name in candidates}
            with sdpa_replaced(_probe(candidates, report.layers, layer_of,
                                      report.guard if guard else None)):
                run()
        if ablate:
            counter = _CallCounter()
            with sdpa_replaced(counter):
                run()
            n_layers = max(layer_of(i) for i in range(counter.count)) + 1 if counter.count else 0
            for name, fn in candidates.items():
                losses = []
                for layer in range(n_layers):
                    with sdpa_replaced(_only_in(layer, layer_of, fn)):
                        out = run()
                    losses.append(output_metrics(out, ref, logits)["loss"])
                report.ablation[name] = losses
    return report


class _CallCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return _torch_sdpa(*args, **kwargs)
