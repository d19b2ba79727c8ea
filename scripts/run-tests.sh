#!/usr/bin/env bash
# Builds everything (library, CLI, tests) and runs the whole CTest suite: labels cpu
# (numerics, reference, emulation, API validation, CLI) and gpu (the sm_90a kernels;
# without a usable GPU each reports itself skipped with the reason); then the Python
# package's suite (scripts/run-python-tests.sh; skipped, with the reason, where python3
# lacks PyTorch, pytest or nanobind).
#   QATTN_PRESET  release (default), cpu, or asan (the CPU suite under Address- and
#                 UndefinedBehaviorSanitizer, build-asan/; .ci/run runs it after release)
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/build.sh
ctest --preset "${QATTN_PRESET:-release}"
# The Python package's suite, against the same build (not under the sanitizers: the
# interpreter is not built with them).
if [ "${QATTN_PRESET:-release}" != asan ]; then ./scripts/run-python-tests.sh; fi
