#!/usr/bin/env python3
"""Training attention speed on the GPU: forward, backward and forward+backward, side by
side in one process (docs/design.md, Measuring):

  qattn       qattn.scaled_dot_product_attention on inputs that require grad (the
              training forward that saves the LSE, and the SageBwd INT8 backward)
  sdpa_cudnn  torch SDPA, cuDNN backend (BF16)
  sdpa_flash  torch SDPA, FlashAttention-2 backend (BF16)

Passes, each timed on its own:
  fwd     the training forward (inputs require grad, autograd records the graph)
  bwd     the backward alone: torch.autograd.grad(o, (q, k, v), do, retain_graph=True) on
          one fixed forward output, as FlashAttention's benchmarks time it
  fwdbwd  a fresh forward and its backward per call

Grid: d = 64 and 128, causal off and on, N = 1K..32K, with H = hidden / d heads
(hidden 2048: 32 heads at d=64, 16 at d=128) and B = max(1, tokens / N) sequences
(tokens 16K), so that every N processes about the same number of tokens per step (as
training does) and a short N is not timed on a tiny grid. Then model shapes (LLM
pretraining with GQA, an image DiT, this repository's training example).

Writes OUT/NAME.json: {"env": {gpu, sm_clock_mhz, driver, cuda, torch, cudnn, commit,
date, ...}, "rows": [{method, pass, d, causal, n, batch, heads, ms, tops, ...}]} with
TOPS = 4·B·H·N²·d / s (halved for causal) × 1 / 2.5 / 3.5 for fwd / bwd / fwdbwd. Extra
row keys: shape (grid or a model label), heads_kv, ms_passes, iters, note (why a row has
no time), and on qattn's rows the CosSim of its output (fwd) or its dq/dk/dv (bwd) to
cuDNN's on the same inputs. bench/plot_backward.py draws the PNG.

Timing (bench/forward.py's time_fn): CUDA events per call after warm-up, the median of
each of two passes over the same configuration (both kept; ms is the lower one);
random normal bf16 inputs and output gradient; several input sets rotated where one
set would fit in L2.

qattn.set_fallback("raise") is set, so a call that qattn would hand to PyTorch's SDPA
is an error row for qattn ("qattn: ..."), never an SDPA time under qattn's name; so is
a missing or failing qattn backward.

Run on the device from the repo root (after python/build_on_device.sh):
  PYTHONPATH=python python3 bench/backward.py --out $OUT --commit <hash>   # ~3-5 min
  PYTHONPATH=python python3 bench/backward.py --quick --out $OUT           # ~30 s
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import forward as fwdbench  # timing and environment helpers (imports torch and qattn)
except ImportError as e:  # pragma: no cover
    fwdbench = None
    _import_error = e

METHODS = ("qattn", "sdpa_cudnn", "sdpa_flash")
PASSES = ("fwd", "bwd", "fwdbwd")
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # docs/design.md: fwd+bwd = 3.5x fwd
SEED = 0
DEVICE = "cuda"  # a module constant so that the logic can be exercised on a CPU


@dataclass
class Shape:
    name: str  # "grid" or a model label
    batch: int
    heads: int
    heads_kv: int
    n: int
    d: int
    causal: bool


@dataclass
class Row:
    method: str
    # "pass" is a Python keyword: the dataclass field is pass_ and the JSON key "pass".
    pass_: str
    d: int
    causal: bool
    n: int
    batch: int
    heads: int
    ms: Optional[float]
    tops: Optional[float]
    shape: str = "grid"
    heads_kv: int = 0
    ms_passes: List[float] = field(default_factory=list)
    iters: int = 0
    cossim_vs_cudnn: Optional[dict] = None
    note: str = ""

    def to_json(self) -> dict:
        out = asdict(self)
        out["pass"] = out.pop("pass_")
        return {"method": out.pop("method"), "pass": out.pop("pass"), **out}

    @staticmethod
    def from_json(d: dict) -> "Row":
        d = dict(d)
        d["pass_"] = d.pop("pass")
        return Row(**d)


def standard_grid(quick: bool, tokens: int, hidden: int, head_dims: Optional[List[int]] = None) -> List[Shape]:
    ns = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    ds = head_dims or ([128] if quick else [128, 64])  # d=128 first: the targets, if the time limit cuts
    return [Shape("grid", max(1, tokens // n), hidden // d, hidden // d, n, d, c)
            for d in ds for c in (False, True) for n in ns]


def model_shapes(quick: bool) -> List[Shape]:
    train_example = Shape("train_example", 16, 8, 8, 2048, 128, True)  # bench/train defaults
    if quick:
        return [train_example]
    return [
        Shape("llm_pretrain_gqa", 2, 32, 8, 4096, 128, True),  # Llama-style 8B, 4K context
        Shape("llm_pretrain_gqa", 1, 32, 8, 8192, 128, True),
        Shape("image_dit", 4, 24, 24, 4608, 128, False),  # 72x64 latent patches
        train_example,
    ]


def tera_ops(s: Shape, pass_: str) -> float:
    ops = 4.0 * s.batch * s.heads * s.n * s.n * s.d * PASS_FACTOR[pass_]
    return (ops / 2 if s.causal else ops) / 1e12


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


# ---- one shape -----------------------------------------------------------------------


def grad_sets(s: Shape, l2_bytes: int, expand_kv: bool):
    """(q, k, v, do) sets, leaves that require grad, random normal bf16 in HND; several
    when one set fits in L2. expand_kv: K/V repeated to Hq heads before they become
    leaves (the SDPA baselines' GQA, as bench/forward.py times them)."""
    torch = fwdbench.torch
    hkv = s.heads if expand_kv else s.heads_kv
    set_bytes = 2 * s.d * s.batch * (2 * s.heads * s.n + 2 * hkv * s.n)
    count = 1 if set_bytes >= 2 * l2_bytes else min(8, -(-3 * l2_bytes // set_bytes))
    g = torch.Generator(device=DEVICE).manual_seed(SEED)
    sets = []
    for _ in range(count):
        def rnd(h):
            return torch.randn(s.batch, h, s.n, s.d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        q, k, v, do = rnd(s.heads), rnd(s.heads_kv), rnd(s.heads_kv), rnd(s.heads)
        if expand_kv and s.heads != s.heads_kv:
            k, v = (t.repeat_interleave(s.heads // s.heads_kv, dim=1) for t in (k, v))
        sets.append(tuple(t.requires_grad_(True) for t in (q, k, v)) + (do,))
    return sets


def cossim(a, b) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return round((a @ b / (a.norm() * b.norm())).item(), 6)


def measure_method(method: str, s: Shape, args, l2_bytes: int, ref: dict) -> List[Row]:
    """Rows for fwd, bwd, fwdbwd of one method on one shape. ref: cuDNN's outputs and
    gradients on set 0 (filled by sdpa_cudnn, read by qattn)."""
    torch, F, qattn = fwdbench.torch, fwdbench.F, fwdbench.qattn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters,
                  budget_s=args.budget_s)
    gqa = s.heads != s.heads_kv
    rows: List[Row] = []

    def row(pass_, medians=None, iters=0, note="", cos=None):
        ms = min(medians) if medians else None
        rows.append(Row(method, pass_, s.d, s.causal, s.n, s.batch, s.heads, ms,
                        tera_ops(s, pass_) / (ms * 1e-3) if ms else None, s.name, s.heads_kv,
                        medians or [], iters, cos, note))

    if method != "qattn" and args.skip_baseline_above and s.n > args.skip_baseline_above:
        for p in PASSES:
            row(p, note=f"skipped: N > {args.skip_baseline_above} (--skip-baseline-above)")
        return rows

    if method == "qattn":
        context = torch.enable_grad()

        def attend(q, k, v):
            return qattn.scaled_dot_product_attention(q, k, v, is_causal=s.causal, enable_gqa=gqa)
    else:
        backend = SDPBackend.CUDNN_ATTENTION if method == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION
        context = sdpa_kernel(backend)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=s.causal)

    sets = None
    try:
        with context, torch.enable_grad():
            sets = grad_sets(s, l2_bytes, expand_kv=method != "qattn")
            n_sets = len(sets)
            base_note = "; ".join(x for x in (
                f"{n_sets} rotating input sets" if n_sets > 1 else "",
                "K/V expanded to Hq heads (no group sum in dK/dV)" if gqa and method != "qattn" else "",
            ) if x)

            # fwd: the forward that records the graph; its output is dropped per call.
            try:
                o0 = attend(*sets[0][:3])
            except Exception as e:  # qattn declines (fallback "raise") or a backend refuses
                for p in PASSES:
                    row(p, note=f"unavailable: {first_line(e)}")
                return rows
            cos_o = None
            if method == "sdpa_cudnn":
                ref["o"] = o0.detach()
            elif method == "qattn" and "o" in ref:
                cos_o = {"o": cossim(o0, ref["o"])}
            medians, iters = fwdbench.time_fn(lambda i: attend(*sets[i % n_sets][:3]), **timing)
            row("fwd", medians, iters, base_note, cos_o)
            del o0

            # bwd: one retained graph per input set.
            try:
                outs = [attend(*t[:3]) for t in sets]
                grads = torch.autograd.grad(outs[0], sets[0][:3], sets[0][3], retain_graph=True)
            except Exception as e:  # e.g. qattn without its backward
                row("bwd", note=f"unavailable: {first_line(e)}")
                row("fwdbwd", note=f"unavailable: {first_line(e)}")
                return rows
            cos_g = None
            if method == "sdpa_cudnn":
                ref["grads"] = [g.detach() for g in grads]
            elif method == "qattn" and "grads" in ref:
                # The baselines' K/V leaves are expanded to Hq heads (repeat_interleave):
                # their dK/dV summed over each group of g query heads is qattn's.
                g = s.heads // s.heads_kv
                refs = [ref["grads"][0]] + [r.float().unflatten(1, (s.heads_kv, g)).sum(2) for r in ref["grads"][1:]]
                cos_g = {name: cossim(x, r) for name, x, r in zip(("dq", "dk", "dv"), grads, refs)}
            del grads

            def bwd(i):
                t = sets[i % n_sets]
                return torch.autograd.grad(outs[i % n_sets], t[:3], t[3], retain_graph=True)

            medians, iters = fwdbench.time_fn(bwd, **timing)
            row("bwd", medians, iters, base_note, cos_g)
            outs = None  # frees the retained graphs

            def fwdbwd(i):
                t = sets[i % n_sets]
                return torch.autograd.grad(attend(*t[:3]), t[:3], t[3])

            medians, iters = fwdbench.time_fn(fwdbwd, **timing)
            row("fwdbwd", medians, iters, base_note)
    except Exception as e:  # out of memory, or a failure after the first call: rows say so
        done = {r.pass_ for r in rows}
        for p in PASSES:
            if p not in done:
                row(p, note=f"unavailable: {first_line(e)}")
    finally:
        sets = None  # frees the inputs (and graphs) before the next method
        torch.cuda.empty_cache()
    return rows


def measure_shape(s: Shape, args, l2_bytes: int) -> List[Row]:
    ref: dict = {}
    rows: List[Row] = []
    # cuDNN first: qattn's rows compare against its outputs.
    for method in ("sdpa_cudnn", "sdpa_flash", "qattn"):
        if method in args.methods:
            rows += measure_method(method, s, args, l2_bytes, ref)
    ref.clear()
    fwdbench.torch.cuda.empty_cache()
    return rows


# ---- output -----------------------------------------------------------------------


def environment(args) -> dict:
    env = fwdbench.environment(args)
    env["timing"] = (f"CUDA events per call, {args.warmup} warm-up, median of each of 2 passes of "
                     f"{args.min_iters}..{args.max_iters} calls (~{args.budget_s}s), ms = lower median; "
                     "bwd = autograd.grad with retain_graph on one forward output")
    env["grid"] = f"B = max(1, {args.tokens} // N), H = {args.hidden} // d, Hq = Hkv"
    env["backward"] = args.backward
    return env


def print_table(rows: List[Row]) -> None:
    configs = []
    for r in rows:
        key = (r.shape, r.batch, r.heads, r.heads_kv, r.d, r.causal, r.n)
        if key not in configs:
            configs.append(key)

    def find(key, method, pass_):
        return next((r for r in rows if (r.shape, r.batch, r.heads, r.heads_kv, r.d, r.causal, r.n) == key
                     and r.method == method and r.pass_ == pass_), None)

    print(f"\n{'shape':<17}{'B':>3}{'Hq':>4}{'Hkv':>4}{'d':>5}{'c':>2}{'N':>7}  "
          + "".join(f"{p + ' cuDNN':>13}{'qattn':>7}{'flash':>7}" for p in PASSES))
    for key in configs:
        cells = []
        for p in PASSES:
            base = find(key, "sdpa_cudnn", p)
            cells.append(f"{base.tops:13.0f}" if base and base.tops else f"{'-':>13}")
            for m in ("qattn", "sdpa_flash"):
                r = find(key, m, p)
                ok = r and r.ms and base and base.ms
                cells.append(f"{base.ms / r.ms:6.2f}x" if ok else f"{'-':>7}")
        shape, b, h, hkv, d, causal, n = key
        print(f"{shape:<17}{b:>3}{h:>4}{hkv:>4}{d:>5}{int(causal):>2}{n:>7}  " + "".join(cells))
    print("(cuDNN: its TOPS; qattn, flash: speed ÷ cuDNN's, >1 is faster)")
    notes = sorted({r.note for r in rows if r.method == "qattn" and r.ms is None and r.note})
    for n in notes:
        print(f"qattn: {n}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="d=128, N 1K and 4K, one model shape (~30 s)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--name", default="backward-h200", help="file name stem of the JSON and PNG")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--no-models", action="store_true", help="standard grid only")
    ap.add_argument("--head-dims", type=int, nargs="+", choices=(64, 128),
                    help="the grid's head dims (default: 128 with --quick, else 128 64)")
    ap.add_argument("--tokens", type=int, default=16384, help="grid: B = max(1, tokens // N)")
    ap.add_argument("--hidden", type=int, default=2048, help="grid: H = hidden // d")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=0.1, help="target timed seconds per pass")
    ap.add_argument("--skip-baseline-above", type=int, default=0,
                    help="skip the SDPA baselines above this N (0: never)")
    ap.add_argument("--max-seconds", type=float, default=300,
                    help="start no new shape after this long (the results so far are written)")
    ap.add_argument("--commit", default="", help="commit id to record (else $QATTN_COMMIT or git)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG (bench/plot_backward.py draws it)")
    ap.add_argument("--backward", choices=("int8", "e4m3", "merge_free"), default="int8",
                    help="qattn's backward: SageBwd INT8 (default), E4M3 per-block, or E4M3 with "
                         "the merge-free scales (qattn.set_backward_options)")
    args = ap.parse_args()
    if fwdbench is None or fwdbench.torch is None:
        err = _import_error if fwdbench is None else fwdbench._import_error
        print(f"bench/backward.py: {err} (needs torch and qattn: PYTHONPATH=python)", file=sys.stderr)
        return 2
    torch, qattn = fwdbench.torch, fwdbench.qattn
    if args.quick:
        args.min_iters, args.max_iters, args.budget_s = 3, 20, 0.05
    if not torch.cuda.is_available():
        print("bench/backward.py: no CUDA device", file=sys.stderr)
        return 2
    if not qattn.device_supported():
        print(f"bench/backward.py: qattn cannot run on {torch.cuda.get_device_name()}; "
              "its rows will say so", file=sys.stderr)
    qattn.set_fallback("raise")  # a qattn row is qattn's kernel or an error, never SDPA's
    if args.backward != "int8":
        qattn.set_backward_options(format="e4m3",
                                   scales="merge_free" if args.backward == "merge_free" else "per_block")
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment(args)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or fwdbench.L2_FALLBACK_BYTES
    shapes = standard_grid(args.quick, args.tokens, args.hidden, args.head_dims) + ([] if args.no_models else model_shapes(args.quick))

    t0 = time.time()
    rows: List[Row] = []
    truncated = False
    for i, s in enumerate(shapes):
        if time.time() - t0 > args.max_seconds:
            truncated = True
            print(f"--max-seconds {args.max_seconds:.0f} reached: {len(shapes) - i} shapes not measured",
                  file=sys.stderr)
            break
        new = measure_shape(s, args, l2)
        rows += new
        summary = ", ".join(f"{r.method}/{r.pass_} {r.tops:.0f}" for r in new if r.tops)
        print(f"[{i + 1}/{len(shapes)} {time.time() - t0:5.0f}s] {s.name} B={s.batch} H={s.heads}/{s.heads_kv} "
              f"N={s.n} d={s.d} causal={int(s.causal)}: {summary}", file=sys.stderr, flush=True)

    env["wall_s"] = round(time.time() - t0, 1)
    env["truncated"] = truncated
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{args.name}.json"
    json_path.write_text(json.dumps({"env": env, "rows": [r.to_json() for r in rows]}, indent=1) + "\n")
    wrote = str(json_path)
    if not args.no_plot:
        try:
            import plot_backward

            wrote += " and " + str(plot_backward.plot(json_path))
        except ImportError as e:  # matplotlib missing: the JSON is what matters
            print(f"no plot ({e}); run bench/plot_backward.py {json_path} where matplotlib is", file=sys.stderr)
    print(f"{env['gpu']}, SM clock max {env['sm_clock_mhz']} MHz, driver {env['driver']}, CUDA {env['cuda']}, "
          f"torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']}; wrote {wrote}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
