#!/usr/bin/env python3
"""Draws bench/backward.py's results: TOPS against N on the standard grid, one panel per
(d, mask) and pass (fwd, bwd, fwdbwd), one line per method; rows without a time (an
unavailable method) are left out. Writes the PNG next to the JSON unless --png is given.

    python3 bench/plot_backward.py bench/results/backward-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

METHODS = ("qattn", "sdpa_cudnn", "sdpa_flash")
PASSES = ("fwd", "bwd", "fwdbwd")
STYLE = {"qattn": dict(color="C3", marker="o"), "sdpa_cudnn": dict(color="C0", marker="s"),
         "sdpa_flash": dict(color="C2", marker="^")}


def plot(json_path: Path, png_path: Optional[Path] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    env = data["env"]
    grid = [r for r in data["rows"] if r.get("shape", "grid") == "grid" and r.get("tops")]
    keys = sorted({(r["d"], r["causal"]) for r in grid}, key=lambda k: (-k[0], k[1]))
    png_path = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    fig, axes = plt.subplots(max(1, len(keys)), len(PASSES), figsize=(12, 3.2 * max(1, len(keys))),
                             squeeze=False)
    ns = sorted({r["n"] for r in grid})
    for row, (d, causal) in enumerate(keys):
        for col, p in enumerate(PASSES):
            ax = axes[row][col]
            for m in METHODS:
                pts = sorted((r["n"], r["tops"]) for r in grid
                             if r["method"] == m and r["pass"] == p and r["d"] == d and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), label=m, **STYLE[m])
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in ns])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{p}, d={d}, {'causal' if causal else 'no mask'}", fontsize=9)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("TOPS")
            if row == len(keys) - 1:
                ax.set_xlabel("sequence length N")
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    missing = sorted({r["method"] for r in data["rows"] if r["method"] not in {g["method"] for g in grid}})
    title = (f"Attention training passes, bf16, {env.get('grid', '')}; {env.get('gpu', '?')}, "
             f"commit {env.get('commit', '?')}")
    if missing:
        title += f"\n(no times for {', '.join(missing)}: see the rows' notes)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default=str(Path(__file__).resolve().parent / "results" / "backward-h200.json"))
    ap.add_argument("--png", help="output file (default: the JSON's name with .png)")
    args = ap.parse_args()
    print(plot(Path(args.json), Path(args.png) if args.png else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
