#!/usr/bin/env bash
# One run on a GPU machine for the SageBwd merge-free scales (bench/NOTES.md v94): the
# backward's GPU tests for each built variant, compute-sanitizer racecheck and memcheck of
# the small merge-free case, the forward's tests (it writes P's row maxima now), the
# Python backward tests, then bench/backward.py --quick side by side: main's binding with
# main's Python package, and this tree's with each --backward mode. Logs go to
# $OUT/logs.tgz; a short table last.
#   Archive .devrun/$ARCHIVE (built off the device, files at its top level):
#     base_C.so                      main's qattn._C (for main's package, .devrun/pymain)
#     <v>_C.so, gpu_test_sagebwd_backward_<v>   each variant v of VARIANTS (first: the tree's)
#     gpu_test_sage2_forward
#   SIDES: the benchmark's processes, each "<binding>:<--backward mode>" (binding base runs
#   with main's package; SIDES=" " runs none); TESTS=0 leaves the C++ tests out, PYTEST=0
#   the Python ones (PYTEST_ARGS: its files and options). The first variant runs the whole
#   backward suite and the sanitizers, the others the merge-free tests.
#   run: bench/device_merge_free.sh <commit>   (carry .devrun/$ARCHIVE, .devrun/pymain, .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
VARIANTS=${VARIANTS:-mfc mfa mfb}
SIDES=${SIDES:-base:int8 mfc:merge_free mfa:merge_free mfb:merge_free mfc:int8 mfc:e4m3 mfb:merge_free mfa:merge_free mfc:merge_free base:int8}
source bench/device_bins.sh
device_setup
device_deps
ab_bins "${ARCHIVE:-merge-free.tar.xz}" /tmp/qattn-mf || exit 1
first=${VARIANTS%% *}

if [[ ${TESTS:-1} != 0 ]]; then
  for v in $VARIANTS; do
    filter='*'
    [[ $v != "$first" ]] && filter='SageBwdMergeFree.*'
    step "sagebwd_$v" 200 "$bins/gpu_test_sagebwd_backward_$v" --gtest_filter="$filter"
  done
  step sage2_forward 150 "$bins/gpu_test_sage2_forward"
  for tool in racecheck memcheck; do
    step "$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$bins/gpu_test_sagebwd_backward_$first" --gtest_filter='SageBwdMergeFree.SmallBf16Hnd'
  done
fi
if [[ ${PYTEST:-1} != 0 ]]; then
  use "$first"
  step pytest 200 bash -c "cd python/tests && PYTHONPATH=$PWD/python python3 -m pytest -q -x \
      -p no:cacheprovider ${PYTEST_ARGS:-test_backward.py test_training_route.py}"
fi
for side in $SIDES; do
  v=${side%%:*} mode=${side##*:}
  use "$v"
  pkg=python
  [[ $v == base ]] && pkg=.devrun/pymain/python && cp python/qattn/_C*.so "$pkg/qattn/"
  step "backward_${v}_$mode" 90 env PYTHONPATH="$pkg" python3 bench/backward.py --quick --no-models \
      --no-plot --backward "$mode" --out "$out" --name "mf-$v-$mode-$RANDOM" --commit "$commit-$v"
done

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
rm -rf "$logs"
echo "==== backward ms (qattn, then cuDNN) ===="
python3 - "$out" <<'EOF'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "mf-*.json")), key=os.path.getmtime):
    d = json.load(open(f))
    rows = {(r["causal"], r["n"]): r["ms"] for r in d["rows"] if r["method"] == "qattn" and r["pass"] == "bwd" and r.get("ms")}
    cud = {(r["causal"], r["n"]): r["ms"] for r in d["rows"] if r["method"] == "sdpa_cudnn" and r["pass"] == "bwd" and r.get("ms")}
    cos = [{k: round(x, 5) for k, x in r["cossim_vs_cudnn"].items()} for r in d["rows"]
           if r["method"] == "qattn" and r["pass"] == "bwd" and r.get("cossim_vs_cudnn")]
    print(os.path.basename(f)[:24].ljust(24), " ".join(f"{k[0]}/{k[1]}:{v:.3f}({cud.get(k, 0) / v:.2f}x)" for k, v in sorted(rows.items())), "cos", cos[:2])
EOF
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
