#!/usr/bin/env bash
# One run on the GPU machine for the committed results files: the forward, backward and
# decode grids of bench/forward.py, bench/backward.py and bench/decode.py (each side by
# side with PyTorch SDPA's backends in its own process), then ncu of the direct decode
# with one and four query tokens (bench/device_decode_ncu.sh). Files named <stem>-<gpu>
# go to $OUT; a short table last.
#
# Binaries: .devrun/q-bins.tar.xz (qattn._C for the device's Python as new_C.so, built
# off the device, and a COMMIT file), else python/build_on_device.sh builds the binding
# here (carry .deps: see its header). BINDING=<path of a _C.so> uses that binding instead.
#   run: bench/device_grids.sh <commit> [grids: forward backward decode ncu]  (carry .devrun .deps)
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:?commit to record}
shift
grids=${*:-forward backward decode ncu}
source bench/device_bins.sh
device_setup
if [[ -n ${BINDING:-} ]]; then
  use_binding "$BINDING"
elif [[ -f .devrun/q-bins.tar.xz ]]; then
  mkdir -p /tmp/qattn-bins && tar -xJf .devrun/q-bins.tar.xz -C /tmp/qattn-bins
  use_binding /tmp/qattn-bins/new_C.so
fi
device_deps
PYTHONPATH=python python3 -c "import qattn; assert qattn.device_supported()" 2>/dev/null ||
  python/build_on_device.sh >"$logs/build.log" 2>&1 || { echo "binding: build failed"; tail -20 "$logs/build.log"; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $gpu in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
export PYTHONPATH=python
for g in $grids; do
  case $g in
    forward) step forward 300 python3 bench/forward.py --out "$out" --name "forward-$tag" --commit "$commit" --time-limit-s 280 ;;
    backward) step backward 200 python3 bench/backward.py --out "$out" --name "backward-$tag" --commit "$commit" --max-seconds 180 ;;
    decode) step decode 200 python3 bench/decode.py --out "$out" --name "decode-$tag" --commit "$commit" --time-limit-s 180 ;;
    ncu) step decode_ncu 330 bench/device_decode_ncu.sh nvfp4 64 32768 ;;
  esac
  tail -n "$([[ $g == ncu ]] && echo 60 || echo 14)" "$logs/${g/ncu/decode_ncu}.log" | cut -c1-140
done
tar -czf "$out/logs.tgz" -C "$logs" .
echo "==== $gpu, $commit: $(($(date +%s) - start)) s ===="
printf '%s\n' "${status[@]}"
