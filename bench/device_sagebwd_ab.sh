#!/usr/bin/env bash
# One run on a GPU machine for a change to the SageBwd kernels (the first was v80's
# series, bench/NOTES.md): its GPU test, compute-sanitizer racecheck and memcheck of the
# small cases, the Python backward tests, bench/backward.py --quick against main's binding
# in four processes (base, new, new, base), and ncu's instruction count of the dK/dV
# kernel at 4K. BENCH_ARGS replaces the benchmark's grid (default --quick: d 128, N 1K and
# 4K); NCU=0 leaves out the ncu count, NCU_D picks its head dim (default 128). TESTS=0
# leaves out the test binary, the sanitizers and pytest (a build made for timing only,
# whose gradients are not the contract's); ARCHIVE names another archive in .devrun;
# NEW names the side whose binding the tests and ncu use (default new: new_C.so), SIDES
# the benchmark's processes (default "base NEW NEW base"; an archive may hold more
# bindings, <side>_C.so each), TEST_BIN the test binary (default gpu_test_sagebwd_backward).
# Logs go to $OUT/logs.tgz; a short table last.
#   Archive, built off the device (.devrun/queue-bwd.tar.xz, files at its top level):
#     base_C.so   main's qattn._C for the device's Python (cmake -DQATTN_BUILD_PYTHON=ON
#                 -DPython_EXECUTABLE=<python3.12>, target qattn_C)
#     new_C.so, gpu_test_sagebwd_backward   the same targets with the change applied
#   run: bench/device_sagebwd_ab.sh <commit>   (carry .devrun .deps; .deps: libfmt9's .deb)
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
NEW=${NEW:-new}
source bench/device_bins.sh
device_setup
device_deps
ab_bins "${ARCHIVE:-queue-bwd.tar.xz}" /tmp/qattn-queue || exit 1

if [[ ${TESTS:-1} != 0 ]]; then
small='SageBwdBackward.SmallBf16Hnd:SageBwdBackward.OneAndTwoStepsPerCta'
test_bin=$bins/${TEST_BIN:-gpu_test_sagebwd_backward}
step sagebwd 150 "$test_bin"
for tool in racecheck memcheck; do
  step "$tool" 150 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$test_bin" --gtest_filter="$small"
done
use "$NEW"
step pytest 200 bash -c "cd python/tests && PYTHONPATH=$PWD/python python3 -m pytest -q \
    -p no:cacheprovider test_backward.py test_training_route.py"
fi
for v in ${SIDES:-base $NEW $NEW base}; do
  use "$v"
  # shellcheck disable=SC2086
  step "backward_$v" 90 env PYTHONPATH=python python3 bench/backward.py ${BENCH_ARGS:---quick} --no-plot \
      --out "$out" --name "backward-$v-$RANDOM" --commit "$commit-$v"
done
ncu_k='regex:k_mean_kernel|k_prepare_kernel|q_prepare_kernel|dq_finalize_kernel|dkdv_wgmma_kernel'
for v in base "$NEW"; do
  [[ ${NCU:-1} == 0 ]] && break
  use "$v"
  step "ncu_$v" 120 ncu -k "$ncu_k" --launch-skip 5 --launch-count 5 \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
      python3 -c "
import sys; sys.path.insert(0, 'python')
import torch, qattn
q, k, v = (torch.randn(4, 16, 4096, ${NCU_D:-128}, device='cuda', dtype=torch.bfloat16).requires_grad_() for _ in range(3))
for _ in range(2):
    o = qattn.scaled_dot_product_attention(q, k, v)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
torch.cuda.synchronize()"
done

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
echo "==== backward (${SIDES:-base $NEW $NEW base}) ===="
grep -hE "^grid +[0-9]" "$logs"/backward_*.log | head -24
echo "==== dK/dV kernel at 4K (base, then $NEW) ===="
grep -hE "dkdv_wgmma|gpu__time_duration|smsp__inst_executed.sum|issue_active" "$logs"/ncu_base.log "$logs/ncu_$NEW.log" | cut -c1-110
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
