#!/usr/bin/env python3
"""Where an attn_mask call's GPU time goes: the tile pass that classifies the mask and the
attention kernel, per kind of mask, beside SDPA given the same mask (bench/NOTES.md v51,
v53; bench/results/additive-mask-h100.txt and saturated-tiles-h100.txt were made this way).

One shape (B 1 x H 32 x N 4096, d 128, bf16 unless --n/--heads say otherwise), through
the SDPA drop-in, with these masks:

  relpos          (1, H, N, N) a finite per-head bias on every score (every tile read)
  alibi           (1, H, N, N) ALiBi's bias, -inf above the diagonal
  alibi_head0     (1, 1, N, N) the same for one head, shared by all
  zero_inf        (1, H, N, N) 0 on and below the diagonal, -inf above
  zero_inf_shared (N, N)       the same, shared
  lowest          (2, 1, N, N) transformers' causal mask of a batch of 2: 0 and bf16's
                  lowest value (saturated tiles; the call runs at batch 2)
  bool_causal     (1, H, N, N) the causal rule as a boolean mask
  is_causal       no mask, is_causal=True (the kernel alone, for scale)

Kernel times: torch.profiler over 5 calls after 3 warm-up calls, microseconds per call,
per kernel name. Call times: CUDA events around 20 calls after 3 warm-up calls, ms per
call; SDPA on cuDNN, or its efficient backend where cuDNN refuses the mask.

    python bench/mask_pass.py --out bench/results --name mask-pass-h100
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward  # noqa: E402  (the environment record)

import qattn  # noqa: E402


def masks(h: int, n: int):
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    slopes = torch.tensor([2.0 ** -(8 * (x + 1) / h) for x in range(h)], device="cuda").view(h, 1, 1)
    alibi = (-slopes * (i - j).float()).masked_fill(j > i, float("-inf")).view(1, h, n, n).to(torch.bfloat16)
    zero_inf = torch.zeros(n, n, device="cuda").masked_fill(j > i, float("-inf")).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    per_head = torch.randn(1, h, 1, 1, device="cuda", generator=g)
    lowest = torch.zeros(n, n, device="cuda").masked_fill(j > i, torch.finfo(torch.bfloat16).min)
    return {
        "relpos": (1, (per_head * -(i - j).abs().float() / n).to(torch.bfloat16).contiguous()),
        "alibi": (1, alibi),
        "alibi_head0": (1, alibi[:, :1].contiguous()),
        "zero_inf": (1, zero_inf.view(1, 1, n, n).expand(1, h, n, n).contiguous()),
        "zero_inf_shared": (1, zero_inf),
        "lowest": (2, lowest.to(torch.bfloat16).view(1, 1, n, n).expand(2, 1, n, n).contiguous()),
        "bool_causal": (1, (j <= i).view(1, 1, n, n).expand(1, h, n, n).contiguous()),
        "is_causal": (1, None),
    }


def call_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def kernel_us(fn, calls: int = 5) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")):
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            total[e.name[:80]] = total.get(e.name[:80], 0.0) + t / calls
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for NAME.json (default: print only)")
    ap.add_argument("--name", default="mask-pass")
    ap.add_argument("--commit", default="")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--only", nargs="+", help="mask names to run (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    h, n, d = args.heads, args.n, 128
    q, k, v = (torch.randn(2, h, n, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    rows = []
    for name, (batch, m) in masks(h, n).items():
        if args.only and name not in args.only:
            continue
        qb, kb, vb = q[:batch], k[:batch], v[:batch]

        def run(m=m, qb=qb, kb=kb, vb=vb):
            if m is None:
                return qattn.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            return qattn.scaled_dot_product_attention(qb, kb, vb, attn_mask=m)

        def sdpa(m=m, qb=qb, kb=kb, vb=vb):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, is_causal=m is None)

        kernels = kernel_us(run)
        try:
            sdpa_ms = call_ms(sdpa)
        except RuntimeError:
            sdpa_ms = None
        rows.append({"mask": name, "batch": batch, "heads": h, "n": n, "d": d,
                     "mask_shape": None if m is None else list(m.shape),
                     "qattn_ms": call_ms(run), "sdpa_ms": sdpa_ms, "kernels_us": kernels})
    ns = argparse.Namespace(commit=args.commit, warmup=3, min_iters=20, max_iters=20, budget_s=0)
    env = forward.environment(ns)
    env["timing"] = ("kernels: torch.profiler over 5 calls after 3 warm-up, us per call; calls: "
                     "CUDA events around 20 calls after 3 warm-up, ms per call")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    for r in rows:
        ratio = f"{r['sdpa_ms'] / r['qattn_ms']:5.2f}x" if r["sdpa_ms"] else "  -  "
        sdpa_txt = f"{r['sdpa_ms']:.3f}" if r["sdpa_ms"] else "-"
        print(f"{r['mask']:16} B{r['batch']}  qattn {r['qattn_ms']:.3f} ms | SDPA {sdpa_txt} ms  {ratio}")
        for kname, us in list(r["kernels_us"].items())[:3]:
            print(f"    {us:8.1f} us  {kname}")
    print(f"{env['gpu']}, torch {env['torch']}, commit {env['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
