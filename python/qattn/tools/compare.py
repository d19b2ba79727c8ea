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

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

from ._sdpa import SdpaFn, _torch_sdpa, sdpa_replaced
from .floor import eager_attention
from .guard import precision_guard


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
