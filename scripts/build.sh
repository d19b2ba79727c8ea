#!/usr/bin/env bash
# Configures and builds qattn with a CMake preset (CMakePresets.json), after making
# sure the Debian packages are there. Arguments: build targets (default: all).
#   QATTN_PRESET  release (default: CUDA kernels when nvcc is found, else CPU only)
#                 or cpu (never CUDA); the build folder is the preset's (build/, build-cpu/)
#   JOBS          parallel compile jobs (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup-deps.sh
preset=${QATTN_PRESET:-release}
cmake --preset "$preset"
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build --preset "$preset" -j "${JOBS:-2}" "${targets[@]}"
