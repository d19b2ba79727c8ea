#!/usr/bin/env python3
"""SM clock and board power while each of several commands runs (bench/NOTES.md v21d).

  python3 bench/clock_power.py --out $OUT/clock-power.json \\
      "kernel=.devbin/kernel_timing 4 32 32768 128 0" "gemm=python3 bench/gemm_ceiling.py"

Samples `nvidia-smi --query-gpu=clocks.sm,power.draw` every 50 ms while the commands run
one after the other, and reports per command the median and minimum SM clock and the
median and maximum power over its busy samples (power above --busy-watts, so set-up and
idle gaps do not count). A kernel that is power-capped shows a median power near the
board's limit and a clock below its maximum. Pass --commit on the device (its copy of the
tree may not know its commit), as for forward.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import threading
import time
from pathlib import Path

from forward import clock_env, commit_id  # bench/forward.py, next to this file


def sample(stop: threading.Event, rows: list) -> None:
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        out = subprocess.run(query, capture_output=True, text=True).stdout.split(",")
        if len(out) == 2:
            rows.append((time.time(), float(out[0]), float(out[1])))
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phases", nargs="+", help="label=command")
    ap.add_argument("--busy-watts", type=float, default=250.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--commit", default="", help="commit id to record (else $QATTN_COMMIT or git)")
    args = ap.parse_args()
    rows: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop, rows), daemon=True)
    sampler.start()
    time.sleep(0.5)
    spans = []
    for phase in args.phases:
        label, cmd = phase.split("=", 1)
        t0 = time.time()
        subprocess.run(shlex.split(cmd), stdout=subprocess.DEVNULL, check=False)
        spans.append((label, cmd, t0, time.time()))
    stop.set()
    sampler.join()
    results = []
    for label, cmd, t0, t1 in spans:
        busy = [r for r in rows if t0 <= r[0] < t1 and r[2] > args.busy_watts]
        res = {"label": label, "command": cmd, "seconds": t1 - t0, "busy_samples": len(busy)}
        if busy:
            clocks, watts = [r[1] for r in busy], [r[2] for r in busy]
            res.update(clock_mhz_median=statistics.median(clocks), clock_mhz_min=min(clocks),
                       power_w_median=statistics.median(watts), power_w_max=max(watts))
            print(f"{label:10s} {len(busy):5d} busy samples  SM clock median "
                  f"{res['clock_mhz_median']:5.0f} MHz (min {res['clock_mhz_min']:.0f})  "
                  f"power median {res['power_w_median']:4.0f} W (max {res['power_w_max']:.0f})")
        else:
            print(f"{label:10s} no busy samples")
        results.append(res)
    if args.out:
        env = {**clock_env(), "commit": commit_id(args.commit),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        args.out.write_text(json.dumps({"env": env, "phases": results}, indent=1))


if __name__ == "__main__":
    main()
