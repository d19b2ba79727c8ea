#!/usr/bin/env bash
# Builds everything (library, CLI, tests) and runs the whole CTest suite: labels cpu
# (numerics, reference, emulation, API validation, CLI) and gpu (the sm_90a kernels;
# without a usable GPU each reports itself skipped with the reason).
#   QATTN_PRESET  release (default), cpu, or asan (the CPU suite under Address- and
#                 UndefinedBehaviorSanitizer, build-asan/; .ci/run runs it after release)
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/build.sh
ctest --preset "${QATTN_PRESET:-release}"
