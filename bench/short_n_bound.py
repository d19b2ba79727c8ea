#!/usr/bin/env python3
"""Where a short forward call's GPU time goes, and the least time a call can take while it
quantizes K and V in a pass of its own (issue 21's N <= 2K targets; bench/NOTES.md v51).

Side by side in one process, every method inside a CUDA graph (GPU time, no host part),
random normal bf16 inputs rotated over enough sets that they do not stay in L2:

  sdpa_cudnn    cuDNN BF16, the baseline
  qattn         the whole call: K statistics, the K/V pass, V's fix-up, the attention
                kernel (which quantizes Q itself)
  qattn_kernel  the attention kernel alone, on the workspace a full call filled
  kv_copy       a device-to-device copy that moves the K/V pass's least traffic (each
                element of K and V read as 2 bytes and written as 1: a copy of 1.5 bytes
                per element reads and writes as many), the fastest way to move those bytes
                (with --head-dim-256 also Q's: that family quantizes Q in a pass too)
  bound         qattn_kernel + kv_copy: the least time of a call whose K/V quantization
                runs as a pass before the attention kernel (that kernel reads what the
                pass wrote, so it cannot start before the pass ends)

    python bench/short_n_bound.py --out bench/results --name short-n-bound-h200
    python bench/short_n_bound.py --head-dim-256 --name d256-bound-h200   # issue 21's d = 256 at 4K
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward  # noqa: E402  (the timing helpers and the environment record)

import qattn  # noqa: E402
from qattn import ops  # noqa: E402

# (batch, heads, n, d, causal): issue 21's short shapes.
SHAPES = [(4, 32, 1024, 128, False), (4, 32, 1024, 128, True), (4, 32, 1024, 64, False),
          (4, 32, 1024, 64, True), (4, 32, 2048, 64, False), (4, 32, 2048, 128, False)]
# Head dim 256 (the sage2_wide_sm90 family, whose Q is quantized by a pass as well):
# issue 21's >= 1.3x cuDNN at N >= 4K, which 4K missed (bench/NOTES.md v48, v49).
SHAPES_D256 = [(4, 32, 4096, 256, False), (4, 32, 4096, 256, True), (4, 32, 8192, 256, False),
               (4, 32, 8192, 256, True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="short-n-bound")
    ap.add_argument("--commit", default="")
    ap.add_argument("--calls", type=int, default=12, help="calls captured in one graph")
    ap.add_argument("--head-dim-256", action="store_true",
                    help="the d = 256 shapes (the pass bytes then include Q's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for b, h, n, d, causal in SHAPES_D256 if args.head_dim_256 else SHAPES:
        per_set = 3 * b * h * n * d * 2
        n_sets = max(1, -(-3 * l2 // per_set))  # the sets together hold 3x the L2
        notes: list = []
        sets = [tuple(torch.randn(b, h, n, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                for _ in range(n_sets)]

        def graph_us(fn) -> float:
            try:
                medians, _ = forward.time_graph(fn, calls=args.calls, warmup=3)
            except RuntimeError:  # not capturable: CUDA events around eager calls
                medians, _ = forward.time_fn(fn, warmup=3, min_iters=50, max_iters=200, budget_s=0.1)
                notes.append("eager")
            return 1e3 * min(medians)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = graph_us(lambda i: F.scaled_dot_product_attention(*sets[i % n_sets], is_causal=causal))
        call = graph_us(lambda i: qattn.attention(*sets[i % n_sets], is_causal=causal))
        kernel_fn = ops.attention_kernel_only(*sets[0], is_causal=causal)
        kernel = graph_us(lambda i: kernel_fn())

        copy_bytes = 3 * b * h * n * d  # K and V: 1.5 bytes per element each
        if d > 128:
            copy_bytes += 3 * b * h * n * d // 2  # and Q, quantized by a pass of its own
        n_bufs = max(2, -(-3 * l2 // copy_bytes))
        bufs = [torch.empty(copy_bytes, dtype=torch.uint8, device="cuda") for _ in range(n_bufs)]
        cast = graph_us(lambda i: bufs[(i + 1) % n_bufs].copy_(bufs[i % n_bufs]))
        del bufs
        bound = kernel + cast
        rows.append({"batch": b, "heads": h, "n": n, "d": d, "causal": causal,
                     "us_sdpa_cudnn": cudnn, "us_qattn": call, "us_qattn_kernel": kernel,
                     "us_kv_copy": cast, "us_bound": bound,
                     "speedup_qattn": cudnn / call, "speedup_bound": cudnn / bound,
                     "speedup_kernel": cudnn / kernel, "input_sets": n_sets, "note": "; ".join(notes)})
        del sets, kernel_fn
        torch.cuda.empty_cache()

    ns = argparse.Namespace(commit=args.commit, warmup=3, min_iters=args.calls, max_iters=args.calls,
                            budget_s=0)
    env = forward.environment(ns)
    env["timing"] = (f"CUDA graph of {args.calls} calls replayed 10 times, per call, lower of "
                     "2 passes' medians; inputs rotated over sets holding 3x the L2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print(f"{'shape':28} {'cuDNN':>7} {'qattn':>7} {'kernel':>7} {'kv_copy':>7} {'bound':>7}"
          f"  qattn/cuDNN  bound/cuDNN  kernel/cuDNN  (us; speed = cuDNN time / time)")
    for r in rows:
        shape = f"{r['batch']}x{r['heads']}x{r['n']} d{r['d']}{' causal' if r['causal'] else ''}"
        print(f"{shape:28} {r['us_sdpa_cudnn']:7.1f} {r['us_qattn']:7.1f} {r['us_qattn_kernel']:7.1f} "
              f"{r['us_kv_copy']:7.1f} {r['us_bound']:7.1f}  {r['speedup_qattn']:11.2f}  "
              f"{r['speedup_bound']:11.2f}  {r['speedup_kernel']:12.2f}")
    print(f"{env['gpu']} {env.get('sm_clock_mhz')} MHz, torch {env['torch']}, commit {env['commit']}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
