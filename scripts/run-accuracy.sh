#!/usr/bin/env bash
# The main job without a GPU: builds the qattn CLI and runs the accuracy report (every
# quantized scheme's CPU emulation against the FP64 reference; docs/accuracy-report.md).
# Arguments go to `qattn accuracy` (e.g. --seq-len 2048 --json report.json).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/build.sh qattn_cli
preset=${QATTN_PRESET:-release}
bin=build/qattn  # the presets' build folders: build/ (release), build-<preset>/ (others)
[ "$preset" = release ] || bin=build-$preset/qattn
"$bin" info
exec "$bin" accuracy "$@"
