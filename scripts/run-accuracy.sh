#!/usr/bin/env bash
# The main job without a GPU: builds the qattn CLI and runs the accuracy report (every
# quantized scheme's CPU emulation against the FP64 reference; docs/accuracy-report.md).
# Arguments go to `qattn accuracy` (e.g. --seq-len 2048 --json report.json). The build
# log and `qattn info` go to stderr, so with `--json -` standard output is the JSON alone.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/build.sh qattn_cli >&2
preset=${QATTN_PRESET:-release}
bin=build/qattn  # the presets' build folders: build/ (release), build-<preset>/ (others)
[ "$preset" = release ] || bin=build-$preset/qattn
"$bin" info >&2
exec "$bin" accuracy "$@"
