#!/usr/bin/env python3
"""Draws examples/train/train.py's results: for pretraining and for fine-tuning, the
training loss (a moving average over --smooth steps, the raw values faint behind it)
and the held-out loss (markers, evaluated with torch SDPA) of every run against tokens
seen, and beside them each qattn run's held-out loss minus the BF16 run's. Writes the
PNG next to the JSON unless --png is given.

    python3 examples/train/plot_training.py bench/results/training-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

PHASES = ("pretrain", "finetune")
COLORS = {"bf16_sdpa": "C0", "qattn_sagebwd": "C3", "qattn_dov_int8": "C1", "bf16_sdpa_seed1": "C7"}


def moving_average(xs: List[float], k: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot(json_path: Path, png_path: Optional[Path] = None, smooth: int = 25) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    env = data["env"]
    per_step = env.get("training", {}).get("tokens_per_step", 1)
    phases = [p for p in PHASES if any(r["phase"] == p and r.get("loss") for r in data["runs"])]
    fig, axes = plt.subplots(max(1, len(phases)), 2, figsize=(12, 4 * max(1, len(phases))), squeeze=False)
    for row, phase in enumerate(phases):
        runs = [r for r in data["runs"] if r["phase"] == phase and r.get("loss")]
        ax, dax = axes[row]
        base = next((r for r in runs if r["name"] == "bf16_sdpa"), None)
        for r in runs:
            color = COLORS.get(r["name"], None)
            mtok = [s * per_step / 1e6 for s in r["steps"]]
            ax.plot(mtok, r["loss"], color=color, alpha=0.15, linewidth=0.6)
            ax.plot(mtok, moving_average(r["loss"], smooth), color=color, linewidth=1.2,
                    label=f"{r['name']} train ({r.get('tokens_per_s') or 0:,} tok/s)")
            vtok = [s * per_step / 1e6 for s in r.get("val_steps", [])]
            ax.plot(vtok, r.get("val_loss", []), color=color, marker="o", markersize=3, linestyle="--",
                    label=f"{r['name']} held-out")
            if base is not None and r is not base and r.get("val_steps") == base.get("val_steps"):
                diff = [a - b for a, b in zip(r["val_loss"], base["val_loss"])]
                dax.plot(vtok, diff, color=color, marker="o", markersize=3, label=f"{r['name']} - bf16_sdpa")
        corpus = env.get("corpora", {}).get(phase, {}).get("what", "")
        ax.set_title(f"{phase}: {corpus}", fontsize=9)
        ax.set_xlabel("tokens seen (M bytes)")
        ax.set_ylabel("loss (nats/byte)")
        values = [v for r in runs for v in r.get("val_loss", [])[1:]] + [v for r in runs for v in r["loss"][len(r["loss"]) // 10:]]
        if values:
            ax.set_ylim(min(values) - 0.05, max(values) + 0.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        dax.axhline(0.0, color="C0", linewidth=0.8)
        dax.set_title(f"{phase}: held-out loss minus BF16's (same steps)", fontsize=9)
        dax.set_xlabel("tokens seen (M bytes)")
        dax.set_ylabel("Δ loss (nats/byte)")
        dax.grid(alpha=0.3)
        if dax.lines[1:]:
            dax.legend(fontsize=7)
    failed = [f"{r['phase']}:{r['name']} ({r['error'][:60]})" for r in data["runs"] if r.get("error")]
    model = env.get("model", {})
    title = (f"{model.get('parameters', 0) / 1e6:.1f}M-parameter decoder, context {model.get('ctx')}, "
             f"{env.get('gpu') or env.get('device')}, commit {env.get('commit')}")
    if failed:
        title += "\nnot run: " + "; ".join(failed)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png_path = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?",
                    default=str(Path(__file__).resolve().parents[2] / "bench" / "results" / "training-h200.json"))
    ap.add_argument("--png", help="output file (default: the JSON's name with .png)")
    ap.add_argument("--smooth", type=int, default=25, help="steps in the training loss's moving average")
    args = ap.parse_args()
    print(plot(Path(args.json), Path(args.png) if args.png else None, args.smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
