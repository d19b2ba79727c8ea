#!/usr/bin/env bash
# One run on a GPU machine for a change to the KV decode kernels (the first was v84's):
# gpu_test_kv_decode and gpu_test_kv_append, compute-sanitizer memcheck and racecheck of
# the small decode cases, the Python KV-cache tests, then bench/decode.py against main's
# binding in four processes (base, new, new, base) on a grid that BENCH_ARGS may replace
# (default: B 8, 64 × 8K, 32K × nq 1, 4, the three quantized formats and SDPA's cuDNN).
# LEAN=1 leaves out the append test and the Python tests (a run with little device time);
# SANITIZERS (default "memcheck racecheck") and SIDES (default "base new new base") pick
# the sanitizers and the benchmark's processes; SANITIZE_FILTER the sanitized tests (default:
# the short sequences, every format with one and two n-blocks, and the BF16 paths).
# TESTS=0 leaves out the tests and the sanitizers (a host-side change whose kernels are
# main's); ARCHIVE names another archive in .devrun.
# Files go to $OUT (decode-<side>-<n>.json); logs to $OUT/logs.tgz; a short table last.
#   Archive, built off the device (.devrun/decode-ab.tar.xz, files at its top level):
#     base_C.so   main's qattn._C for the device's Python (target qattn_C)
#     new_C.so, gpu_test_kv_decode, gpu_test_kv_append   with the change applied
#   run: bench/device_decode_ab.sh <commit>   (carry .devrun .deps; .deps: libfmt9's .deb)
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:-unknown}
source bench/device_bins.sh
device_setup
device_deps
ab_bins "${ARCHIVE:-decode-ab.tar.xz}" /tmp/qattn-decode-ab || exit 1

if [[ ${TESTS:-1} != 0 ]]; then
step kv_decode 200 "$bins/gpu_test_kv_decode"
[[ -n ${LEAN:-} ]] || step kv_append 120 "$bins/gpu_test_kv_append"
small=${SANITIZE_FILTER:-'KvDecode.ShortSequencesAndEmptyOnes:KvDecode.Bf16CacheOnEveryPathOfTheDirectKernel'}
for tool in ${SANITIZERS-memcheck racecheck}; do
  step "$tool" 200 compute-sanitizer --tool "$tool" --error-exitcode 9 "$bins/gpu_test_kv_decode" \
      --gtest_filter="$small"
done
fi
use new
[[ -n ${LEAN:-} || ${TESTS:-1} == 0 ]] || step pytest 150 bash -c "cd python/tests && PYTHONPATH=$PWD/python python3 -m pytest -q \
    -p no:cacheprovider test_kv_cache.py"
grid=${BENCH_ARGS:---batch 8 64 --context 8192 32768 --nq 1 4 --methods qattn_nvfp4 qattn_fp8 qattn_int8 sdpa_cudnn}
n=0
for v in ${SIDES:-base new new base}; do
  use "$v"
  n=$((n + 1))
  # shellcheck disable=SC2086
  step "decode_${v}_$n" 120 env PYTHONPATH=python python3 bench/decode.py $grid --out "$out" \
      --name "decode-$v-$n" --commit "$commit-$v"
done

tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
echo "==== decode µs: best of each side's two processes (base, new) ===="
python3 - "$out" <<'PY'
import glob, json, sys
best = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/decode-*.json")):
    side = f.split("decode-")[1].split("-")[0]
    for r in json.load(open(f))["rows"]:
        if r.get("us") is None:
            continue
        key = (r["method"], r["batch"], r["n"], r["nq"])
        best.setdefault(key, {}).setdefault(side, r["us"])
        best[key][side] = min(best[key][side], r["us"])
for (m, b, n, nq), v in sorted(best.items()):
    if "base" in v and "new" in v:
        print(f"{m:12s} B {b:3d} n {n:6d} nq {nq}: {v['base']:9.1f} -> {v['new']:9.1f}  x{v['base'] / v['new']:.3f}")
PY
echo "==== summary ($commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(($(date +%s) - start)) s) ===="
printf '%s\n' "${status[@]}"
