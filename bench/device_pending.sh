#!/usr/bin/env bash
# One call on the GPU machine for the forward's and the backward's recent work (bench/NOTES.md
# v54-v60: V narrower than Q·K, the additive pass, SageBwd's scales per warpgroup) and the
# d = 256 bound:
#   1. gpu_test_sage2_forward (all: the NarrowerV and additive-mask suites among them),
#      gpu_test_sage2_wide (its NarrowerV test) and gpu_test_sagebwd_backward, each under a
#      timeout;
#   2. compute-sanitizer memcheck of the NarrowerV and additive cases, racecheck of the
#      backward's small cases;
#   3. pytest: the Python layer, attn_mask, masks, SDPA on the GPU, attention, call plans,
#      backward;
#   4. bench/mask_pass.py with this build's binding, and with main's (base_C.so in the
#      prebuilt archive, built off the device) when it is there: v54's A/B;
#   5. bench/forward.py --quick --mla-only (v55), bench/short_n_bound.py --head-dim-256
#      (v56) and bench/backward.py --quick (v59).
# Logs go to $OUT/logs.tgz (the device returns a handful of files); a short table last.
#
# Binaries: prebuilt ones from .devrun/pending-bins.tar.xz (gpu_test_sage2_forward,
# gpu_test_sage2_wide, gpu_test_sagebwd_backward and qattn._C for the device's Python,
# built off the device), else
# python/build_on_device.sh builds them here (carry .deps: see its header).
# Carry: .devrun .deps
#   run: bench/device_pending.sh <commit>
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
source bench/device_bins.sh
device_setup

# The binding must know head_dim_v (the queued C ABI field).
device_bins pending-bins.tar.xz 'qattn.device_supported() and "head_dim_v" in (_C.forward.__doc__ or "")' \
    gpu_test_sage2_forward gpu_test_sage2_wide gpu_test_sagebwd_backward || exit 1

step sage2_forward 300 "$bins/gpu_test_sage2_forward"
step sage2_wide 150 "$bins/gpu_test_sage2_wide"
step sagebwd 200 "$bins/gpu_test_sagebwd_backward"
step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$bins/gpu_test_sage2_forward" \
    --gtest_filter='*NarrowerV*:Sage2AdditiveMask.*'
step memcheck_wide 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$bins/gpu_test_sage2_wide" \
    --gtest_filter='*NarrowerV*'
# The backward's warpgroups meet once a step (double-buffered dŜ and maxima): racecheck
# on a small case of each mode.
step racecheck_bwd 200 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$bins/gpu_test_sagebwd_backward" --gtest_filter='*SmallBf16Hnd*:*DeterministicModeIsBitwiseStable*'
(cd python/tests && PYTHONPATH=$OLDPWD/python timeout 300 python3 -m pytest -q -p no:cacheprovider \
    test_python_layer.py test_attn_mask.py test_masks.py test_sdpa_gpu.py test_attention.py \
    test_call_plans.py test_backward.py >"$logs/pytest.log" 2>&1) && status+=("pytest: PASS") ||
  status+=("pytest: FAIL (see logs/pytest.log)")
tail -2 "$logs/pytest.log"

PYTHONPATH=python timeout 120 python3 bench/mask_pass.py --out "$out" --name mask-pass \
    --commit "$commit" >"$logs/mask_pass.log" 2>&1 || status+=("mask_pass: FAIL or timeout")
base_so=/tmp/qattn-bins/base_C.so  # main's binding (device_bins unpacked the archive there)
if [[ -f $base_so ]]; then
  mkdir -p /tmp/qattn-base && cp -r python/qattn /tmp/qattn-base/ && rm -f /tmp/qattn-base/qattn/_C*.so &&
    cp "$base_so" "/tmp/qattn-base/qattn/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  PYTHONPATH=/tmp/qattn-base timeout 120 python3 bench/mask_pass.py --out "$out" --name mask-pass-base \
      --commit "$commit-base" >"$logs/mask_pass_base.log" 2>&1 || status+=("mask_pass base: FAIL or timeout")
fi
PYTHONPATH=python timeout 200 python3 bench/forward.py --quick --mla-only \
    --methods qattn sdpa_cudnn sdpa_flash --out "$out" --name forward-mla \
    --commit "$commit" --time-limit-s 180 >"$logs/mla.log" 2>&1 || status+=("forward --mla-only: FAIL or timeout")
PYTHONPATH=python timeout 200 python3 bench/short_n_bound.py --head-dim-256 --out "$out" \
    --name d256-bound --commit "$commit" >"$logs/d256.log" 2>&1 || status+=("d256 bound: FAIL or timeout")
PYTHONPATH=python timeout 150 python3 bench/backward.py --quick --out "$out" --name backward-quick \
    --commit "$commit" >"$logs/backward.log" 2>&1 || status+=("backward.py: FAIL or timeout")

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
echo "==== mask pass (this build, then main's) ===="
grep -E "^[a-z_]+ +B|classify" "$logs/mask_pass.log" | head -24
[[ -f $logs/mask_pass_base.log ]] && grep -E "^[a-z_]+ +B|classify" "$logs/mask_pass_base.log" | head -24
echo "==== MLA rows ===="
grep -A8 "^shape" "$logs/mla.log" | head -10
echo "==== d = 256 bound ===="
tail -5 "$logs/d256.log"
echo "==== backward (quick) ===="
tail -12 "$logs/backward.log"
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
