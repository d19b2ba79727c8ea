#!/usr/bin/env python3
"""What the tensor cores give a plain GEMM on this GPU: the practical ceiling that the
attention kernel's TOPS are read against (bench/NOTES.md, issue 4's bound).

  bf16   torch.matmul (cuBLAS)
  fp8    torch._scaled_mm, E4M3 × E4M3 → bf16, per-tensor scales (cuBLASLt)
  int8   torch._int_mm, INT8 × INT8 → INT32

Square M = N = K problems, CUDA-event timing after warm-up, median of 20 runs, random
inputs (never zeros). Prints one line per (dtype, size) and writes OUT/gemm-ceiling.json
when --out is given. Run on the device: python3 bench/gemm_ceiling.py --out $OUT --commit ID
(the device's copy of the tree may not know its commit: pass it, as for forward.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from forward import clock_env, commit_id  # bench/forward.py, next to this file


def time_ms(fn, runs: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_fns(dtype: str, n: int):
    dev = "cuda"
    if dtype == "bf16":
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        return lambda: a @ b
    if dtype == "fp8":
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major B
        one = torch.ones((), device=dev)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    a = torch.randint(-127, 128, (n, n), device=dev, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), device=dev, dtype=torch.int8).t()  # column-major B
    return lambda: torch._int_mm(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--commit", default="", help="commit id to record (else $QATTN_COMMIT or git)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8", "int8"],
                    choices=["bf16", "fp8", "int8"])
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes:
        for n in args.sizes:
            ms = time_ms(gemm_fns(dtype, n))
            tops = 2.0 * n**3 / (ms * 1e-3) / 1e12
            rows.append({"dtype": dtype, "n": n, "ms": ms, "tops": tops})
            print(f"{dtype:5s} {n:6d}  {ms:8.3f} ms  {tops:7.1f} TOPS", flush=True)
    if args.out:
        env = {"gpu": torch.cuda.get_device_name(), **clock_env(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "commit": commit_id(args.commit),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        (args.out / "gemm-ceiling.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
