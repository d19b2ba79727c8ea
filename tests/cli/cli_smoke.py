#!/usr/bin/env python3
"""Smoke tests of the qattn command-line tool (CTest label cpu; no GPU needed).

    cli_smoke.py QATTN_BINARY CASE     CASE: accuracy_json | bad_options | info

accuracy_json checks the JSON schema of `qattn accuracy --json -` on a small run
(the studies and variants that issue 2 item 8 requires, the pinned E4M3 counts);
bad_options checks that bad arguments exit non-zero with a message; info checks that
`qattn info` succeeds with or without a GPU.
"""

import json
import math
import subprocess
import sys

# study -> variants every report must contain (issue 2, item 8).
REQUIRED = {
    "fp4_format": {"nvfp4", "mxfp4"},
    "p_scaling": {"two_level", "direct"},
    "smoothing_fp4": {"none", "k", "q", "qk"},
    "pv_format": {"e4m3", "e5m2", "int8", "fp16"},
    "qk_granularity_int4": {"per_tensor", "per_block", "per_thread", "per_token"},
    "sagebwd_dov": {"fp16", "int8"},
    "sagebwd_format": {"int8", "fp8"},
    "schemes": {"sa2_8b", "sa2_4b", "sa3_nvfp4", "fp8_per_tensor", "sagebwd"},
}
TEMPERATURES = [1.0, 0.5]


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=300)


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def accuracy_json(binary):
    temps = ",".join(f"{t:g}" for t in TEMPERATURES)
    r = run(binary, "accuracy", "--seq-len", "256", "--heads", "1", "--temperatures", temps,
            "--json", "-")
    check(r.returncode == 0, f"exit {r.returncode}\n{r.stderr}")
    try:
        report = json.loads(r.stdout)  # the tables go to stderr, stdout is the JSON alone
    except json.JSONDecodeError as e:
        fail(f"stdout is not JSON ({e}):\n{r.stdout[:2000]}")
    for key in ("config", "facts", "ablations"):
        check(key in report, f"missing top-level key {key!r}")
    facts = report["facts"]
    check(facts.get("e4m3_nonneg_values") == 127, f"facts.e4m3_nonneg_values = {facts.get('e4m3_nonneg_values')}")
    check(facts.get("e4m3_values_le_one_sixth") == 35,
          f"facts.e4m3_values_le_one_sixth = {facts.get('e4m3_values_le_one_sixth')}")
    for key in ("p_distinct_values_direct", "p_distinct_values_two_level"):
        check(isinstance(facts.get(key), int) and facts[key] > 0, f"facts.{key} = {facts.get(key)}")

    rows = report["ablations"]
    check(isinstance(rows, list) and rows, "ablations is empty")
    seen = {}
    for row in rows:
        for key in ("study", "variant", "tensor", "cos", "l1", "rmse"):
            check(key in row, f"ablation row without {key!r}: {row}")
        for key in ("cos", "l1", "rmse"):
            check(isinstance(row[key], (int, float)) and math.isfinite(row[key]),
                  f"{row['study']}/{row['variant']}: {key} = {row[key]}")
        check(-1.0 <= row["cos"] <= 1.0 + 1e-9, f"{row['study']}/{row['variant']}: cos = {row['cos']}")
        seen.setdefault(row["study"], set()).add(row["variant"])
    for study, variants in REQUIRED.items():
        check(study in seen, f"study {study!r} missing (have {sorted(seen)})")
        check(variants <= seen[study], f"{study}: variants {sorted(variants - seen[study])} missing")
    sweep = {f"{s}@{t:g}" for s in ("two_level", "direct") for t in TEMPERATURES}
    check(sweep <= seen.get("entropy_sweep", set()),
          f"entropy_sweep: variants {sorted(sweep - seen.get('entropy_sweep', set()))} missing")
    dq = {(r["study"], r["variant"]) for r in rows if r["tensor"] == "dq"}
    for study in ("sagebwd_dov", "sagebwd_format"):
        check(all((study, v) in dq for v in REQUIRED[study]), f"{study}: no dq rows for every variant")
    print(f"ok: {len(rows)} ablation rows, {len(seen)} studies")


def bad_options(binary):
    cases = [
        ["accuracy", "--head-dim", "0"],
        ["accuracy", "--head-dim", "48"],
        ["accuracy", "--seq-len", "0"],
        ["accuracy", "--heads", "abc"],
        ["accuracy", "--no-such-option"],
        ["accuracy", "--json", "/nonexistent-dir/report.json"],
        ["no-such-command"],
    ]
    for args in cases:
        r = run(binary, *args)
        check(r.returncode != 0, f"qattn {' '.join(args)}: exit 0, expected an error")
        msg = (r.stderr + r.stdout).strip()
        check(msg, f"qattn {' '.join(args)}: exit {r.returncode} without a message")
        print(f"ok: qattn {' '.join(args)} -> exit {r.returncode}: {msg.splitlines()[0]}")


def info(binary):
    r = run(binary, "info")
    check(r.returncode == 0, f"qattn info: exit {r.returncode}\n{r.stderr}")
    check(r.stdout.startswith("qattn "), f"qattn info: unexpected output\n{r.stdout}")
    r = run(binary, "info", "--json")
    check(r.returncode == 0, f"qattn info --json: exit {r.returncode}\n{r.stderr}")
    try:
        json.loads(r.stdout)
    except json.JSONDecodeError as e:
        fail(f"qattn info --json: not JSON ({e}):\n{r.stdout}")
    print("ok: qattn info and qattn info --json")


CASES = {"accuracy_json": accuracy_json, "bad_options": bad_options, "info": info}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in CASES:
        sys.exit(f"usage: {sys.argv[0]} QATTN_BINARY {{{'|'.join(CASES)}}}")
    CASES[sys.argv[2]](sys.argv[1])
