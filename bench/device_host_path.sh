#!/usr/bin/env bash
# One call on the GPU machine for the host path of a Python call (issue 21, bench/NOTES.md
# v45): builds the Python binding and the C++ API device test (python/build_on_device.sh;
# carry .deps), runs that test and bench/call_overhead.py --pieces into $OUT (JSON, and
# its log with the cProfile of a call), then the Python tests of the paths v45 changed
# (the direct call and its plans, the ops, the SDPA drop-in, the masks, varlen, the
# precision modes, SA3, training) in what is left of the call's 10 minutes (pytest's log
# in $OUT/logs.tgz). A short table last: host µs per call of qattn (planned), qattn with
# its plan cache off (the pre-v45 path), the SDPA drop-in, the op, and PyTorch SDPA;
# then the pieces of a call.
#   run: bench/device_host_path.sh <commit>          (carry .deps)
# Pass the commit as a literal hash (git in the device's copy of the tree may be absent
# or older). SKIP_BUILD=1 reuses build-py/ and python/qattn/_C*.so of a warm machine;
# SKIP_TESTS=1 leaves out the tests; SKIP_BENCH=1 leaves out the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
out=${OUT:-/tmp/qattn-out}
logs=/tmp/qattn-logs
mkdir -p "$out" "$logs"
export PATH=/usr/local/cuda/bin:$PATH
py=${PYTHON:-python3}
status=()
t0=$(date +%s)

if [[ -z "${SKIP_BUILD:-}" ]]; then
  start=$(date +%s)
  # The binding, and the C++ test of the API on the device (a forward after a context
  # reset: the compute capability kept per device, the attributes set again).
  QATTN_BUILD_TESTS=ON QATTN_TARGETS="qattn_C gpu_test_api_on_device" QATTN_BUILD_LOG="$logs/build.log" \
      python/build_on_device.sh || exit 1
  status+=("build: $(($(date +%s) - start)) s")
  tail -1 "$logs/build.log"
fi

if [[ -z "${SKIP_TESTS:-}" && -x build-py/tests/gpu_test_api_on_device ]]; then
  if timeout 120 build-py/tests/gpu_test_api_on_device >"$logs/gpu_test_api_on_device.log" 2>&1; then
    status+=("gpu_test_api_on_device: PASS")
  else
    status+=("gpu_test_api_on_device: FAIL")
    grep -E "FAILED|Failure" "$logs/gpu_test_api_on_device.log" | head -10
  fi
fi

if [[ -z "${SKIP_BENCH:-}" ]]; then
  if PYTHONPATH=python timeout 300 "$py" bench/call_overhead.py --pieces \
      --json "$out/call-overhead.json" --commit "$commit" >"$out/call-overhead.log" 2>&1; then
    status+=("call_overhead.py: done")
  else
    status+=("call_overhead.py: FAIL (see call-overhead.log)")
    tail -20 "$out/call-overhead.log"
  fi
fi

if [[ -z "${SKIP_TESTS:-}" ]]; then
  tests=(test_call_plans.py test_attention.py test_python_layer.py test_sdpa_gpu.py test_sdpa.py
         test_masks.py test_attn_mask.py test_varlen.py test_precision_gpu.py test_sa3.py
         test_backward.py)
  present=()
  for t in "${tests[@]}"; do [[ -f "python/tests/$t" ]] && present+=("$t"); done
  start=$(date +%s)
  left=$((575 - ($(date +%s) - t0)))  # of the call's 600 s
  (cd python/tests && PYTHONPATH=../ timeout "$((left > 60 ? left : 60))" "$py" -m pytest -q \
      -p no:cacheprovider "${present[@]}") >"$logs/pytest.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR) " "$logs/pytest.log" | head -20
  summary=$(tail -1 "$logs/pytest.log")
  status+=("pytest (${#present[@]} files, $(($(date +%s) - start)) s, rc $rc): $summary")
fi

tar -czf "$out/logs.tgz" -C "$logs" .
if [[ -f "$out/call-overhead.json" ]]; then
  "$py" - "$out/call-overhead.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
env = data["env"]
print(f"==== host µs per call, idle / queued ({env['gpu']}, torch {env['torch']}, {env['commit']}) ====")
methods = ["qattn", "qattn_unplanned", "sdpa_dropin", "qattn_op", "sdpa_cudnn", "sdpa_flash"]
shapes = []
for r in data["rows"]:
    s = (r["batch"], r["heads"], r["n"], r["d"], r.get("causal"))
    if r["method"] != "piece" and s not in shapes:
        shapes.append(s)
print(f"{'B H N d causal':<18}" + "".join(f"{m:>18}" for m in methods))
for s in shapes:
    cells = []
    for m in methods:
        row = next((r for r in data["rows"] if r["method"] == m and
                    (r["batch"], r["heads"], r["n"], r["d"], r.get("causal")) == s), None)
        cells.append(f"{row['host_us']:8.1f} /{row['queued_us']:6.1f}" if row else f"{'-':>17}")
    print(f"{' '.join(str(int(x)) for x in s):<18}" + "".join(f"{c:>18}" for c in cells))
print("==== pieces, host µs (B 1 H 8 N 128 d 128 | B 4 H 32 N 1K d 128) ====")
names = [r["piece"] for r in data["rows"] if r["method"] == "piece" and r["n"] == 128]
for name in names:
    vals = [next((r["host_us"] for r in data["rows"] if r["method"] == "piece" and r["piece"] == name
                  and r["n"] == n and r["d"] == 128), float("nan")) for n in (128, 1024)]
    print(f"  {name:<30} {vals[0]:7.1f} {vals[1]:7.1f}")
PY
fi
echo "==== summary ($commit) ===="
printf '%s\n' "${status[@]}"
