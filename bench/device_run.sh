#!/usr/bin/env bash
# One call on the GPU machine: GPU tests (prebuilt here, carried in $1), compute-sanitizer
# memcheck and racecheck on small cases, the Python package and its tests, and the
# forward benchmark side by side with PyTorch SDPA. Logs go to $OUT; a short table last.
#   run: bench/device_run.sh .devbin <commit>   (carry .devbin and .deps)
# Pass the commit as a literal hash: git in the device machine's copy of the tree may
# report an older commit (bench/forward.py --replot --commit fixes a file written that way).
# SKIP_BENCH=1 stops after the tests (no bench/forward.py).
set -uo pipefail
bin=${1:?folder with the prebuilt GPU test binaries}
commit=${2:-unknown}
out=${OUT:-/tmp/qattn-out}
logs=/tmp/qattn-logs  # packed into $out/logs.tgz at the end (the tool returns few files)
mkdir -p "$out" "$logs"
status=()

for t in "$bin"/gpu_test_*; do
  [[ -x "$t" && "$t" != *.cmake ]] || continue  # CTest's files copied along with the binaries
  name=$(basename "$t")
  if timeout 300 "$t" >"$logs/$name.log" 2>&1; then status+=("$name: PASS"); else status+=("$name: FAIL"); fi
  tail -3 "$logs/$name.log"
done

small='Sage2Forward.SmallHndBf16:Sage2Forward.HeadDim64AndCausal:Sage2Forward.BlocksThatSeeNoKey'
for tool in memcheck racecheck; do
  if timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/gpu_test_sage2_forward" \
      --gtest_filter="$small" >"$logs/sanitizer-$tool.log" 2>&1; then
    status+=("compute-sanitizer $tool: clean")
  else
    status+=("compute-sanitizer $tool: ERRORS (see log)")
  fi
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$logs/sanitizer-$tool.log" | head -5
  if [[ -x "$bin/gpu_test_sagebwd_backward" ]]; then
    if timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/gpu_test_sagebwd_backward" \
        --gtest_filter='SageBwdBackward.SmallBf16Hnd' >"$logs/sanitizer-bwd-$tool.log" 2>&1; then
      status+=("compute-sanitizer $tool (backward): clean")
    else
      status+=("compute-sanitizer $tool (backward): ERRORS (see log)")
    fi
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$logs/sanitizer-bwd-$tool.log" | head -5
  fi
done

if python/build_on_device.sh >"$logs/python-build.log" 2>&1; then
  if PYTHONPATH=python timeout 400 python3 -m pytest -q -p no:cacheprovider python/tests >"$logs/pytest.log" 2>&1; then
    status+=("pytest: $(tail -1 "$logs/pytest.log")")
  else
    status+=("pytest: FAIL $(tail -1 "$logs/pytest.log")")
    grep -E "FAILED|Error" "$logs/pytest.log" | head -10
  fi
  [[ -n "${SKIP_BENCH:-}" ]] || PYTHONPATH=python timeout 420 python3 bench/forward.py ${BENCH_ARGS:-} --out "$out" --commit "$commit" \
    >"$logs/bench.log" 2>&1 || status+=("bench: FAIL")
else
  status+=("python build: FAIL")
  tail -20 "$logs/python-build.log"
fi

tar -czf "$out/logs.tgz" -C "$logs" .
echo "==== summary ($commit) ===="
printf '%s\n' "${status[@]}"
tail -45 "$logs/bench.log" 2>/dev/null
