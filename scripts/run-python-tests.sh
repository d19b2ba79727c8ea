#!/usr/bin/env bash
# The Python package's test suite (python/tests) against the library the preset built:
# builds the binding qattn._C in the preset's build folder, stages the package with it
# under <build>/python-stage (the source tree stays clean), and runs pytest there. The
# GPU cases skip themselves without a Hopper GPU, as the C++ ones do.
# Needs PyTorch, pytest and nanobind for python3; without them it says what is missing
# and skips (exit 0), so a machine without a Python stack still runs the C++ suite.
#   QATTN_PRESET  release (default), cpu or debug: which build folder to use
set -euo pipefail
cd "$(dirname "$0")/.."

preset=${QATTN_PRESET:-release}
py=${PYTHON:-python3}
missing=$("$py" - <<'PY'
import importlib.util
print(" ".join(m for m in ("torch", "pytest", "nanobind") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "run-python-tests.sh: skipped, $py lacks: $missing (pip install torch pytest nanobind)"
  exit 0
fi
case "$preset" in  # the presets' binaryDir (CMakePresets.json)
  release) build=build ;;
  *) build=build-$preset ;;
esac
# The interpreter's own path (a pyenv shim or a venv link would hide its headers from
# CMake's FindPython), and any Python found by an earlier configure forgotten.
exe=$("$py" -c 'import sys; print(sys.executable)')
cmake --preset "$preset" -U 'Python_*' -U '_Python*' -DQATTN_BUILD_PYTHON=ON -DPython_EXECUTABLE="$exe" >/dev/null
cmake --build --preset "$preset" -j "${JOBS:-2}" --target qattn_C
stage="$build/python-stage"
rm -rf "$stage" && mkdir -p "$stage"
cp -r python/qattn "$stage/qattn"
rm -f "$stage"/qattn/_C*.so
cp "$build"/python/_C*.so "$stage/qattn/"
cd python/tests
PYTHONPATH="$(cd ../.. && pwd)/$stage" "$py" -m pytest -q -p no:cacheprovider
