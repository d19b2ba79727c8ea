#!/usr/bin/env bash
# One call on the GPU machine for the KV cache: builds the Python binding and the two
# KV test programs (python/build_on_device.sh, carry .deps), runs them, compute-sanitizer
# memcheck and racecheck on small decode cases, the roofline probe (bench/
# kv_decode_roofline.cpp: the library's split count, then a fixed one) and, unless
# SKIP_BENCH=1, bench/decode.py side by side with SDPA into $OUT (BENCH_ARGS passed on).
# SKIP_TESTS=1 leaves out the tests, sanitizers and roofline (a second call on a warm
# machine, whose build-py/ is still there, then only benchmarks). A short table last.
#   run: bench/device_kv_decode.sh <commit> [roofline splits]
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
fixed_splits=${2:-4}
out=${OUT:-/tmp/qattn-out}
logs=/tmp/qattn-logs
mkdir -p "$out" "$logs"
export PATH=/usr/local/cuda/bin:$PATH
status=()

start=$(date +%s)
QATTN_BUILD_TESTS=ON QATTN_TARGETS="qattn_C gpu_test_kv_decode gpu_test_kv_append" QATTN_BUILD_LOG="$logs/build.log" \
    python/build_on_device.sh || exit 1
status+=("build: $(($(date +%s) - start)) s")

if [[ -z "${SKIP_TESTS:-}" ]]; then
for t in gpu_test_kv_decode gpu_test_kv_append; do
  if timeout 300 "build-py/tests/$t" >"$logs/$t.log" 2>&1; then status+=("$t: PASS"); else status+=("$t: FAIL"); fi
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$logs/$t.log" | head -12
done

small='KvDecode.ShortSequencesAndEmptyOnes:KvDecode.GqaGroupsQueryCountsAndRowGroups'
for tool in memcheck racecheck; do
  if timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 build-py/tests/gpu_test_kv_decode \
      --gtest_filter="$small" >"$logs/sanitizer-$tool.log" 2>&1; then
    status+=("compute-sanitizer $tool (decode): clean")
  else
    status+=("compute-sanitizer $tool (decode): ERRORS (see log)")
  fi
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$logs/sanitizer-$tool.log" | head -5
done

nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude bench/kv_decode_roofline.cpp \
  build-py/libqattn.a -o /tmp/kv_decode_roofline && {
  /tmp/kv_decode_roofline >"$out/roofline.txt" 2>&1
  /tmp/kv_decode_roofline --splits "$fixed_splits" >"$out/roofline-splits$fixed_splits.txt" 2>&1
  status+=("roofline: done")
}
fi

if [[ -z "${SKIP_BENCH:-}" ]]; then
  PYTHONPATH=python timeout 480 python3 bench/decode.py ${BENCH_ARGS:-} --out "$out" --commit "$commit" \
    >"$logs/bench.log" 2>&1 || status+=("bench: FAIL")
  tail -40 "$logs/bench.log"
fi

tar -czf "$out/logs.tgz" -C "$logs" .
if [[ -f "$out/roofline.txt" ]]; then
  echo "==== roofline (library's split count) ===="
  grep -E "B +(8|32) L +65536" "$out/roofline.txt"
  echo "==== roofline (splits $fixed_splits) ===="
  grep -E "B +8 L +65536" "$out/roofline-splits$fixed_splits.txt"
fi
echo "==== summary ($commit) ===="
printf '%s\n' "${status[@]}"
