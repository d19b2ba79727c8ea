#!/usr/bin/env bash
# One run on the GPU machine for a change's GPU tests: every gpu_test_* program, compute-
# sanitizer memcheck and racecheck on small cases of the forward and of the backward (both
# 8-bit formats), and the Python suite. Logs go to $OUT/logs.tgz; a short table last.
#
# Binaries: .devrun/q-bins.tar.xz (the gpu_test_* programs and qattn._C for the device's
# Python, built off the device, and a COMMIT file; bench/device_bins.sh), else
# python/build_on_device.sh builds them here (carry .deps: see its header).
# PYTEST_FILES names the Python test files (default: all of python/tests); every step's
# limit is cut to what is left of LEFT_S seconds (default 560), and a step with under 30 s
# left is skipped, so the table still comes back inside one run's limit.
#   run: bench/device_tests.sh   (carry .devrun .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_bins.sh
device_setup
device_bins q-bins.tar.xz 'qattn.device_supported()' gpu_test_sagebwd_backward || exit 1
left_s=${LEFT_S:-560}
timed() {  # timed <name> <limit> <command...>: step with the limit cut to the time left
  local name=$1 limit=$2 rem=$((left_s - ($(date +%s) - start)))
  shift 2
  if ((rem < 30)); then status+=("$name: SKIPPED (time)"); return; fi
  ((limit > rem - 10)) && limit=$((rem - 10))
  step "$name" "$limit" "$@"
}
# PROGRAMS names the test programs to run, in order (default: gpu_test_sagebwd_backward,
# then every other gpu_test_*).
programs=${PROGRAMS:-gpu_test_sagebwd_backward $(cd "$bins" && ls gpu_test_* | grep -v -e '\.cmake$' -e '^gpu_test_sagebwd_backward$')}
for name in $programs; do
  timed "$name" 300 "$bins/$name"
done
small_fwd='Sage2Forward.SmallHndBf16:Sage2Forward.HeadDim64AndCausal:Sage2Forward.BlocksThatSeeNoKey'
small_bwd='SageBwdBackward.SmallBf16Hnd:SageBwdBackward.OneAndTwoStepsPerCta:SageBwdBackward.FixedCasesEachSwitch'
for tool in memcheck racecheck; do
  timed "${tool}_forward" 200 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$bins/gpu_test_sage2_forward" --gtest_filter="$small_fwd"
  timed "${tool}_backward" 200 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$bins/gpu_test_sagebwd_backward" --gtest_filter="$small_bwd"
done
rem=$((left_s - ($(date +%s) - start) - 10))
if ((rem >= 30)); then
  (cd python/tests && PYTHONPATH=$OLDPWD/python timeout "$rem" python3 -m pytest -q -p no:cacheprovider \
      ${PYTEST_FILES:-} >"$logs/pytest.log" 2>&1) && status+=("pytest: $(tail -1 "$logs/pytest.log")") ||
    status+=("pytest: FAIL $(tail -1 "$logs/pytest.log")")
else
  status+=("pytest: SKIPPED (time)")
fi
grep -E "^FAILED|^ERROR" "$logs/pytest.log" | head -10
grep -hE "ablation|dQ cos GPU|RandomShapeSweep|case [0-9]+:" "$logs"/gpu_test_sagebwd_backward.log | head -30
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$logs"/memcheck_*.log "$logs"/racecheck_*.log
tar -czf "$out/logs.tgz" -C "$logs" .
echo "==== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(cat /tmp/qattn-bins/COMMIT 2>/dev/null): $(($(date +%s) - start)) s ===="
printf '%s\n' "${status[@]}"
