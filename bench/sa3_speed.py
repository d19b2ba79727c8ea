#!/usr/bin/env python3
"""The SageAttention3 NVFP4 forward's speed (qattn.attention(scheme="sa3_nvfp4"), a
fidelity kernel), side by side in one process with torch SDPA on cuDNN and with qattn's
SageAttention2-8b forward: B = 4, H = 32, bf16, HND, d = 64 and 128, causal off and on,
N = 1K, 4K, 16K; end-to-end (every quantization pass included). TOPS = 4·B·H·N²·d/s,
half when causal. Timing, inputs and environment as bench/forward.py (time_fn,
input_sets, environment). Writes OUT/sa3-h200.json with --out.

    PYTHONPATH=python python3 bench/sa3_speed.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward as fw  # noqa: E402  (bench/forward.py: timing, inputs, environment)

import qattn  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder for sa3-h200.json")
    ap.add_argument("--commit", default="")
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args()
    args.warmup, args.min_iters, args.max_iters, args.budget_s = 3, 10, 100, 0.1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    methods = {
        "qattn_sa3_nvfp4": lambda q, k, v, c: qattn.attention(q, k, v, is_causal=c, scheme="sa3_nvfp4"),
        "qattn_sa2_8b": lambda q, k, v, c: qattn.attention(q, k, v, is_causal=c),
        "sdpa_cudnn": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    rows = []
    for d in (128, 64):
        for causal in (False, True):
            for n in args.n:
                s = fw.Shape(name="grid", batch=4, heads=32, heads_kv=32, n=n, d=d, causal=causal)
                sets = fw.input_sets(s, l2)
                ops = 4.0 * s.batch * s.heads * n * n * d / (2 if causal else 1)
                ref = None
                for name, f in methods.items():
                    def call(i, f=f):
                        q, k, v = sets[i % len(sets)]
                        if name == "sdpa_cudnn":
                            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                return f(q, k, v, causal)
                        return f(q, k, v, causal)
                    with torch.no_grad():
                        medians, iters = fw.time_fn(call, warmup=args.warmup, min_iters=args.min_iters,
                                                    max_iters=args.max_iters, budget_s=args.budget_s)
                        o = call(0)
                    if name == "sdpa_cudnn":
                        ref = o
                    ms = min(medians)
                    rows.append({"method": name, "d": d, "causal": causal, "n": n, "batch": s.batch,
                                 "heads": s.heads, "ms": ms, "ms_passes": medians, "iters": iters,
                                 "tops": ops / (ms * 1e-3) / 1e12, "out": o})
                for r in rows[-3:]:
                    r["cossim_vs_sdpa"] = fw.cossim(r.pop("out"), ref)
                print(f"d {d} causal {int(causal)} N {n:6d}: " + "  ".join(
                    f"{r['method']} {r['ms']:.3f} ms {r['tops']:.0f} TOPS cos {r['cossim_vs_sdpa']:.4f}"
                    for r in rows[-3:]), flush=True)
    env = fw.environment(args)
    env["timing"] += "; no_grad, end-to-end"
    if args.out:
        path = Path(args.out) / "sa3-h200.json"
        path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
