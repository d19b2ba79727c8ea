#!/usr/bin/env python3
"""Side-by-side table of bench/forward.py results of two builds measured in one run.

  compare_forward.py --base A1.json A2.json --new B1.json B2.json [--out table.json]

Each build's files are repeated forward.py runs interleaved with the other build's
(base, new, base, new, ...). Per row (shape, d, causal, N, batch, heads) and method
(qattn end-to-end, qattn_kernel), the table gives the best TOPS of each build over its
runs, the ratio new / base, and the spread of the base build between its own runs
(max / min - 1): a ratio inside 1 ± spread is no change.
"""

import argparse
import json
from collections import defaultdict

METHODS = ("qattn", "qattn_kernel")


def load(paths):
    best = defaultdict(list)  # (key, method) -> [tops per run]
    env = None
    for p in paths:
        d = json.load(open(p))
        env = env or d["env"]
        for r in d["rows"]:
            if r["method"] in METHODS and r.get("tops"):
                key = (r["shape"], r["d"], r["causal"], r["n"], r["batch"], r["heads"], r["heads_kv"])
                best[(key, r["method"])].append(r["tops"])
    return best, env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--out", help="write the table as JSON")
    a = ap.parse_args()
    base, env_b = load(a.base)
    new, env_n = load(a.new)
    rows = []
    for (key, method), tb in sorted(base.items()):
        tn = new.get((key, method))
        if not tn:
            continue
        rows.append({"shape": key[0], "d": key[1], "causal": key[2], "n": key[3], "batch": key[4],
                     "heads": key[5], "heads_kv": key[6], "method": method,
                     "base_tops": max(tb), "new_tops": max(tn), "ratio": max(tn) / max(tb),
                     "base_spread": max(tb) / min(tb) - 1.0, "new_spread": max(tn) / min(tn) - 1.0})
    print(f"base commit {env_b.get('commit')}, new commit {env_n.get('commit')}, "
          f"{env_n.get('gpu')}, driver {env_n.get('driver')}, {env_n.get('date')}")
    print(f"{'shape':16} {'d':>4} {'causal':>6} {'N':>6} {'method':>13} {'base':>7} {'new':>7}"
          f" {'new/base':>8} {'spread':>7}")
    for r in rows:
        print(f"{r['shape']:16} {r['d']:4} {int(r['causal']):6} {r['n']:6} {r['method']:>13} "
              f"{r['base_tops']:7.1f} {r['new_tops']:7.1f} {r['ratio']:8.3f} "
              f"{max(r['base_spread'], r['new_spread']):7.3f}")
    worst = min(rows, key=lambda r: r["ratio"] - 1.0 + max(r["base_spread"], r["new_spread"]))
    print(f"lowest new/base: {min(r['ratio'] for r in rows):.3f}; rows below 1 - spread: "
          f"{sum(r['ratio'] < 1.0 - max(r['base_spread'], r['new_spread']) for r in rows)}"
          f" (tightest: {worst['shape']} d={worst['d']} N={worst['n']} {worst['method']})")
    if a.out:
        json.dump({"env_base": env_b, "env_new": env_n, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
