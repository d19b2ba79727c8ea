#!/usr/bin/env python3
"""The precision report on the GPU: each input family of `qattn accuracy` (the very same
tensors: qattn._C.synthetic_inputs runs the CLI's generator, docs/accuracy-report.md has
the recipes), run by qattn's kernel and by PyTorch SDPA in 16 bits, each against FP64
attention on the same inputs, with the time of each on a larger problem of the same
family.

    PYTHONPATH=python python3 bench/accuracy.py --out bench/results --name precision-h200

Writes OUT/NAME.json:
    {"env": {...}, "rows": [{"family", "precision", "cos", "l1", "rmse", "ms", "ms_fast",
                             "emulated_cos", ...}]}
one row per (family, precision): "fast" is qattn's SA2-8b kernel (what a call runs
today); "fast_hadamard" the same kernel on Q and K rotated by a signed Hadamard matrix
first (qattn.tools.hadamard_rotated, in FP32 rounded back to FP16: the `qk_rotation`
study's arithmetic, its time including the two rotations); "sdpa_fp16" is PyTorch SDPA
(cuDNN or FlashAttention) on the same FP16 inputs, the 16-bit arithmetic of "precise";
"auto" and "precise" are qattn.attention's precision modes (the GPU only). cos, l1
(relative L1) and rmse are
the output's against the FP64 reference, as `qattn accuracy` defines them
(src/reference/metrics.h), at the accuracy shape (--batch, --heads, --seq-len,
--head-dim; the defaults are `qattn accuracy`'s, so its report is the emulation of the
same tensors); ms is the call's median time on the GPU at the timing shape (--time-batch,
--time-heads, --time-seq-len: the same family's recipe, large enough that the kernels'
time is not the launches') and ms_fast the "fast" row's of the same family, measured in
the same run. emulated_cos, when --emulated names a `qattn accuracy --json`
report of the same configuration, is that report's CosSim of the same family and
precision (the CPU emulation, the kernels' contract; for sdpa_fp16 the emulated
"precise", the same 16-bit arithmetic; for fast_hadamard the study `qk_rotation`,
whose rotation is not rounded to FP16).

--device cpu runs the script on the CPU with FP32 SDPA standing in for qattn's kernel:
a check of the script, not of any kernel; its rows are not a result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward as fwdbench  # noqa: E402  (environment, timing)

import qattn  # noqa: E402
import qattn.tools  # noqa: E402
from qattn import _C  # noqa: E402

# The emulated mode whose arithmetic a row's is, where the names differ: SDPA's is
# "precise" (Q·Kᵀ and P·V in the inputs' 16-bit type with FP32 accumulation,
# accumulation order aside).
EMULATED_AS = {"sdpa_fp16": "precise"}

FAMILIES = ("gaussian", "large_logits", "heavy_tail", "outlier_channels", "attention_sink")


def family_inputs(family: str, batch: int, heads: int, seq_len: int, args, device: torch.device):
    """(q, k, v) of the family in FP16 on `device`, HND, from the CLI's generator."""
    shape = (batch, heads, seq_len, args.head_dim)
    raw = _C.synthetic_inputs(family, batch, heads, heads, seq_len, seq_len, args.head_dim,
                              seed=args.seed)
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.float32).view(shape)
                 .to(device=device, dtype=torch.float16) for b in raw)


def reference_fp64(q, k, v, scale: float) -> torch.Tensor:
    """Exact attention in FP64, one head at a time (the (N, N) scores of one head)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = (q[b, h].double() @ k[b, h].double().T) * scale
            out[b, h] = torch.softmax(s, dim=-1) @ v[b, h].double()
    return out


def metrics(o: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    """CosSim, relative L1 (qattn.tools.output_metrics) and RMSE in FP64, as
    src/reference/metrics.h defines them."""
    m = qattn.tools.output_metrics(o, ref)
    return {"cos": m["cos"], "l1": m["rel_l1"],
            "rmse": (o.double() - ref).pow(2).mean().sqrt().item()}


def time_ms(fn: Callable[[], object], args, device: torch.device) -> float:
    if device.type == "cuda":
        medians, _ = fwdbench.time_fn(lambda i: fn(), warmup=args.warmup, min_iters=args.min_iters,
                                      max_iters=args.max_iters, budget_s=args.budget_s)
        return min(medians)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def emulated_table(path: Optional[Path], args) -> Dict[tuple, float]:
    """(family, precision) -> CosSim from a `qattn accuracy --json` report whose
    configuration matches this run's (else an error: other inputs, other numbers)."""
    if path is None:
        return {}
    report = json.loads(path.read_text())
    c = report["config"]
    want = {"batch": args.batch, "heads": args.heads, "seq_len": args.seq_len,
            "head_dim": args.head_dim, "seed": args.seed}
    got = {key: c.get(key) for key in want}
    if got != want or c.get("study_temperature", 1.0) != 1.0:
        raise SystemExit(f"--emulated {path}: configuration {got} is not this run's {want}")
    table = {}
    for row in report.get("ablations", []):
        if row.get("tensor") != "o" or row.get("study") not in ("precision_guard", "qk_rotation"):
            continue
        family, variant = row["variant"].split("/")
        if row.get("study") == "precision_guard":
            table[(family, variant)] = row["cos"]
        elif row.get("study") == "qk_rotation" and variant == "fast_hadamard":
            table[(family, variant)] = row["cos"]
    return table


def flagged_share(q, k) -> float:
    """The share of (batch, head) pairs that precision "auto" runs in 16 bits: the
    precision guard's rule, computed as the kernel computes it."""
    return qattn.tools.precision_guard(q, k)[1].double().mean().item()


def _fp32_sdpa(q, k, v, scale=None):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).to(q.dtype)


def measure(args, device: torch.device) -> List[dict]:
    scale = 1.0 / math.sqrt(args.head_dim)
    emulated = emulated_table(args.emulated, args)
    rows = []
    # The CPU has no qattn kernel: there "fast" is FP32 SDPA, a stand-in for the script
    # check.
    fast = qattn.attention if device.type == "cuda" else _fp32_sdpa
    rotated = qattn.tools.hadamard_rotated(
        lambda q, k, v, attn_mask, dropout_p, is_causal, scale: fast(q, k, v, scale=scale))
    runs = {"fast": fast, "fast_hadamard": rotated, "sdpa_fp16": F.scaled_dot_product_attention}
    if device.type == "cuda":  # qattn's other two modes (no CPU stand-in: they are kernels)
        runs["auto"] = lambda q, k, v: qattn.attention(q, k, v, precision="auto")
        runs["precise"] = lambda q, k, v: qattn.attention(q, k, v, precision="precise")
    for family in args.families:
        q, k, v = family_inputs(family, args.batch, args.heads, args.seq_len, args, device)
        ref = reference_fp64(q, k, v, scale)
        tq, tk, tv = family_inputs(family, args.time_batch, args.time_heads, args.time_seq_len,
                                   args, device)
        family_rows = []
        for precision, fn in runs.items():
            row = {"family": family, "precision": precision, **metrics(fn(q, k, v), ref),
                   "ms": time_ms(lambda: fn(tq, tk, tv), args, device)}
            if precision == "auto":  # which heads ran in 16 bits, at each shape
                row["flagged"] = flagged_share(q, k)
                row["flagged_timing"] = flagged_share(tq, tk)
            if (family, EMULATED_AS.get(precision, precision)) in emulated:
                row["emulated_cos"] = emulated[(family, EMULATED_AS.get(precision, precision))]
            family_rows.append(row)
        for row in family_rows:
            row["ms_fast"] = family_rows[0]["ms"]
        rows += family_rows
    return rows


def print_table(rows: List[dict]) -> None:
    print(f"\n{'family':<18}{'precision':<15}{'CosSim':>10}{'rel L1':>9}{'RMSE':>9}"
          f"{'ms':>8}{'/ fast':>8}{'emulated':>10}{'flagged':>14}")
    for r in rows:
        emu = f"{r['emulated_cos']:.5f}" if "emulated_cos" in r else "-"
        flagged = f"{r['flagged']:.2f} / {r['flagged_timing']:.2f}" if "flagged" in r else "-"
        print(f"{r['family']:<18}{r['precision']:<15}{r['cos']:>10.5f}{r['l1']:>9.4f}"
              f"{r['rmse']:>9.4f}{r['ms']:>8.3f}{r['ms'] / r['ms_fast']:>8.2f}{emu:>10}"
              f"{flagged:>14}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--time-batch", type=int, default=1)
    ap.add_argument("--time-heads", type=int, default=32)
    ap.add_argument("--time-seq-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulated", type=Path, default=None,
                    help="a `qattn accuracy --json` report of the same configuration")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-iters", type=int, default=20)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=0.5)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", type=Path, default=None, help="folder for NAME.json")
    ap.add_argument("--name", default="precision-h200")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; --device cpu checks the script on the CPU")
    rows = measure(args, device)
    if device.type == "cuda":
        env = fwdbench.environment(argparse.Namespace(commit=args.commit, warmup=args.warmup,
                                                      min_iters=args.min_iters,
                                                      max_iters=args.max_iters,
                                                      budget_s=args.budget_s))
        env["dtype"] = "fp16"
    else:
        env = {"device": "cpu", "torch": torch.__version__, "qattn": qattn.__version__,
               "commit": fwdbench.commit_id(args.commit), "note": "script check, not a result"}
    env["shape"] = {"batch": args.batch, "heads": args.heads, "seq_len": args.seq_len,
                    "head_dim": args.head_dim, "seed": args.seed}
    env["timing_shape"] = {"batch": args.time_batch, "heads": args.time_heads,
                           "seq_len": args.time_seq_len, "head_dim": args.head_dim}
    env["inputs"] = "qattn._C.synthetic_inputs (the generator of `qattn accuracy`), FP16"
    env["reference"] = "FP64 softmax(q·kᵀ/√d)·v on the same FP16 inputs"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.name}.json"
        path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
