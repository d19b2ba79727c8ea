#!/usr/bin/env python3
"""Draws bench/decode.py's results: each qattn cache format's speed-up over torch SDPA's
cuDNN backend on a BF16 cache (graph-replay time, same run) against the cached tokens B·L, one panel
per query count, one line per (format, batch). Writes the PNG next to the JSON unless
--png is given.

    python3 bench/plot_decode.py bench/results/decode-h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

FORMATS = ("qattn_nvfp4", "qattn_fp8", "qattn_int8", "qattn_bf16")
COLORS = {"qattn_nvfp4": "C3", "qattn_fp8": "C0", "qattn_int8": "C2", "qattn_bf16": "C7"}
MARKERS = "osD^v<>"


def plot(json_path: Path, png_path: Optional[Path] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    # speedup_vs_sdpa: files before the cuDNN and FlashAttention rows (SDPA's default backend)
    key = "speedup_vs_cudnn" if any(r.get("speedup_vs_cudnn") for r in data["rows"]) else "speedup_vs_sdpa"
    # A sweep of num_splits (bench/decode.py --num-splits 0 1 2 ...) has a row per count:
    # the library's own choice (0) is the one drawn.
    env, rows = data["env"], [r for r in data["rows"] if r.get(key) and not r.get("num_splits")]
    nqs = sorted({r["nq"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(nqs), figsize=(6.5 * len(nqs), 4.8), squeeze=False)
    for ax, nq in zip(axes[0], nqs):
        for method in FORMATS:
            for bi, b in enumerate(batches):
                pts = sorted((r["batch"] * r["context"], r[key]) for r in rows
                             if r["method"] == method and r["nq"] == nq and r["batch"] == b)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=COLORS[method],
                        marker=MARKERS[bi % len(MARKERS)], lw=1,
                        label=f"{method[6:]} B={b}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("cached tokens B·L")
        ax.set_ylabel("speed-up over SDPA BF16 " + ("(cuDNN)" if key == "speedup_vs_cudnn" else "(default backend)"))
        ax.set_title(f"nq = {nq}, Hq {rows[0]['heads_q']}, Hkv {rows[0]['heads_kv']}, d {rows[0]['d']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"KV-cache decode, {env['gpu']}, commit {env['commit']}, {env['date'][:10]}",
                 fontsize=10)
    fig.tight_layout()
    out = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    print(plot(args.json, args.png))


if __name__ == "__main__":
    main()
