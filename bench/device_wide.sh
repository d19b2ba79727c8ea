#!/usr/bin/env bash
# One call on the GPU machine for the head-dim-256 forward (sage2_wide_sm90, issue 21;
# bench/NOTES.md v46, v48b): its GPU tests, O's scale at long rows (bench/long_n_accuracy.py),
# compute-sanitizer memcheck on a small case, the
# Python tests whose routing changed, and bench/forward.py's d = 256 rows beside cuDNN.
# Logs and results go to $OUT; a short table is printed last.
#
# Binaries: prebuilt ones from .devrun/wide-bins.tar.xz when it is there (built off the
# device: gpu_test_sage2_wide, gpu_test_sage2_forward, the CLI and qattn._C for Python
# 3.12), else python/build_on_device.sh builds them here (carry .deps: see its header).
# Carry: .devrun .deps
#   run: bench/device_wide.sh <commit>
# PHASE=tests (tests, sanitizer, pytest), bench (bench/forward.py only) or all (default).
# Within one 10-minute device call, run PHASE=tests and PHASE=bench as two calls.
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
phase=${PHASE:-all}
source bench/device_bins.sh
device_setup

device_bins wide-bins.tar.xz 'qattn.device_supported()' \
    gpu_test_sage2_wide gpu_test_sage2_forward || exit 1

if [[ $phase != bench ]]; then
  # The new kernel's tests first, each under its own timeout (a protocol hang costs its
  # timeout, not the call).
  for f in FixedShapes HeadDimNotAMultipleOf8 Masks ManyItemsAndRepeatedLaunches RandomShapes \
           RefusedCallsWriteNothing LongRowsKeepOsScale; do
    if timeout 240 "$bins/gpu_test_sage2_wide" --gtest_filter="Sage2Wide.$f" \
        >"$logs/wide-$f.log" 2>&1; then
      status+=("Sage2Wide.$f: PASS")
    else
      status+=("Sage2Wide.$f: FAIL (rc $?)")
    fi
    grep -E "Failure|Expected|Which is|actual|\[  FAILED" "$logs/wide-$f.log" | head -8
  done
  # The settling measurement: GPU - emulation of the LSE at truncation intervals 32/4/2/1.
  cat "$logs"/wide-*.log | grep "^\[wide LSE\]" >"$out/wide-lse-gaps.txt"
  grep -h "^\[wide long rows\]" "$logs"/wide-*.log >>"$out/wide-lse-gaps.txt"
  # O's scale and the LSE against FP64 from 1K to 16K keys, d 128 beside d 256.
  PYTHONPATH=python timeout 200 python3 bench/long_n_accuracy.py >"$out/long-n-accuracy.txt" 2>&1 ||
    status+=("long_n_accuracy.py: FAIL or timeout")
  cat "$out/long-n-accuracy.txt"
  if timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$bins/gpu_test_sage2_wide" \
      --gtest_filter='Sage2Wide.HeadDimNotAMultipleOf8' >"$logs/memcheck.log" 2>&1; then
    status+=("compute-sanitizer memcheck (d 203 causal): clean")
  else
    status+=("compute-sanitizer memcheck: ERRORS or timeout (see logs/memcheck.log)")
  fi
  grep -E "ERROR SUMMARY|Invalid" "$logs/memcheck.log" | head -5
  # The d <= 128 forward: its passes share quantize.cu with the D = 256 ones.
  if timeout 240 "$bins/gpu_test_sage2_forward" --gtest_filter='Sage2Forward.MatchesEmulation*:Sage2Masks.MatchEmulationAndReference' \
      >"$logs/sage2-forward.log" 2>&1; then
    status+=("Sage2Forward (emulation cases): PASS")
  else
    status+=("Sage2Forward (emulation cases): FAIL")
  fi
  (cd python/tests && PYTHONPATH=$OLDPWD/python timeout 300 python3 -m pytest -q -p no:cacheprovider \
      test_attention.py::test_head_dims_up_to_256 \
      test_sdpa.py test_binding.py "test_varlen.py::test_gpu_head_dims_above_128_run_one_call_per_sequence" \
      >"$logs/pytest.log" 2>&1) && status+=("pytest (attention d 136..256, sdpa, binding): PASS") ||
    status+=("pytest: FAIL (see logs/pytest.log)")
  tail -3 "$logs/pytest.log"
fi

if [[ $phase != tests ]]; then
  PYTHONPATH=python timeout 420 python3 bench/forward.py --quick --head-dim-256-only \
      --methods qattn qattn_kernel sdpa_cudnn --out "$out" --name forward-d256 --commit "$commit" \
      >"$logs/bench.log" 2>&1 || status+=("bench: FAIL or timeout")
  tail -25 "$logs/bench.log"
fi

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
echo "==== wide LSE: GPU - emulation by truncation interval ===="
head -24 "$out/wide-lse-gaps.txt" 2>/dev/null | sed 's/^\[wide LSE\] //'
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
