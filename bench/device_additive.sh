#!/usr/bin/env bash
# One call on the GPU machine for the additive attn_mask (issue 21; bench/NOTES.md v50):
# the SA2-8b forward's GPU tests (Sage2AdditiveMask.* prints the LSE gap per truncation
# interval), compute-sanitizer memcheck of the additive cases, the Python tests whose
# routing changed, and bench/forward.py's mask rows (the ALiBi row beside causal).
# Logs and results go to $OUT; a short table is printed last.
#
# Binaries: prebuilt ones from .devrun/additive-bins.tar.xz when it is there (built off
# the device: gpu_test_sage2_forward and qattn._C for the device's Python 3.12, each
# Python version in its own build tree), else python/build_on_device.sh builds them here.
# Carry: .devrun .deps
#   run: bench/device_additive.sh <commit>
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
source bench/device_bins.sh
device_setup

# The binding must take the mask tuple of this tree (ten fields).
device_bins additive-bins.tar.xz 'hasattr(_C, "MASK_ADDITIVE") and qattn.device_supported()' \
    gpu_test_sage2_forward || exit 1

if timeout 240 "$bins/gpu_test_sage2_forward" >"$logs/sage2-forward.log" 2>&1; then
  status+=("gpu_test_sage2_forward: PASS")
else
  status+=("gpu_test_sage2_forward: FAIL (rc $?)")
fi
grep -E "^\[  FAILED|Failure|Expected|actual" "$logs/sage2-forward.log" | head -12
grep "^\[additive LSE\]" "$logs/sage2-forward.log" >"$out/additive-lse-gaps.txt"
(cd python/tests && PYTHONPATH=$OLDPWD/python timeout 300 python3 -m pytest -q -p no:cacheprovider \
    test_attn_mask.py test_sdpa_gpu.py test_sdpa.py test_binding.py test_python_layer.py \
    >"$logs/pytest.log" 2>&1) && status+=("pytest (attn_mask, sdpa, binding): PASS") ||
  status+=("pytest: FAIL (see logs/pytest.log)")
tail -3 "$logs/pytest.log"
PYTHONPATH=python timeout 150 python3 bench/forward.py --quick --masks-only \
    --methods qattn sdpa_cudnn sdpa_efficient sdpa_flash --out "$out" --name forward-masks \
    --commit "$commit" >"$logs/bench.log" 2>&1 || status+=("bench: FAIL or timeout")
tail -12 "$logs/bench.log"
if timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$bins/gpu_test_sage2_forward" \
    --gtest_filter='Sage2AdditiveMask.*' >"$logs/memcheck.log" 2>&1; then
  status+=("compute-sanitizer memcheck (Sage2AdditiveMask.*): clean")
else
  status+=("compute-sanitizer memcheck: ERRORS or timeout (see logs/memcheck.log)")
fi

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
echo "==== additive LSE: GPU - emulation by truncation interval ===="
sed 's/^\[additive LSE\] //' "$out/additive-lse-gaps.txt" | head -32
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
