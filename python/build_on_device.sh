#!/usr/bin/env bash
# Builds the Python binding qattn._C on the GPU machine and drops it into
# python/qattn/, so that `PYTHONPATH=python python3 ...` imports the package from the
# working tree (python/tests, bench/forward.py).
#
# Why a direct CMake build and not `pip install -e .`: both compile the same sources
# (the CUDA kernels dominate), but the direct build (1) reuses a build folder that is
# still there on a warm machine, or an existing build folder named by QATTN_BUILD_DIR, so
# a second call compiles only what changed; (2) builds just the library and the
# module, no tests or CLI; (3) skips pip's wheel packing and metadata steps. Carrying a
# library built here instead was rejected: compiling the kernels on this 2-core
# machine is slower than on the device's 16 cores, and a host-compiler mismatch would
# only show up there.
#
# The top-level CMake finds fmt and nlohmann_json even when tests and tools are off;
# the GPU machine has neither and no package registry. Carry them as Debian packages
# (once, here, in the repo root; CLI11 and GoogleTest too, for the CLI and the tests):
#   mkdir -p .deps && (cd .deps && apt-get download libfmt-dev libfmt9 \
#       nlohmann-json3-dev libcli11-dev libgtest-dev)
#   grep -qx '/.deps/' .git/info/exclude || echo /.deps/ >> .git/info/exclude
# and name ".deps" in the run's carry list. They are unpacked under /tmp, never into /.
#
# Environment: QATTN_BUILD_LOG (see below), QATTN_BUILD_DIR (default build-py), JOBS (default nproc), PYTHON
# (default python3), QATTN_BUILD_TESTS / QATTN_BUILD_TOOLS (default OFF), and
# QATTN_TARGETS (default qattn_C; e.g. "qattn_C qattn_cli" with QATTN_BUILD_TOOLS=ON
# also builds $QATTN_BUILD_DIR/qattn for `qattn info` and `qattn bench`).
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/.."

# QATTN_BUILD_LOG=FILE: the whole output goes to FILE; on a failure its last 30 lines are
# printed (the device scripts' build step).
if [[ -n "${QATTN_BUILD_LOG:-}" ]]; then
  log=$QATTN_BUILD_LOG
  if QATTN_BUILD_LOG= "$self" >"$log" 2>&1; then exit 0; fi
  tail -30 "$log"
  echo "build_on_device.sh: FAIL (log: $log)"
  exit 1
fi

build_dir=${QATTN_BUILD_DIR:-build-py}
jobs=${JOBS:-$(nproc)}
py=$(command -v "${PYTHON:-python3}")
extra=()

if compgen -G ".deps/*.deb" >/dev/null; then
  deps=/tmp/qattn-deps
  mkdir -p "$deps"
  for deb in .deps/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$deb" "$deps"
    else  # a .deb is an ar archive with a data.tar.* inside
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$OLDPWD/$deb" && tar -xf data.tar.* -C "$deps")
      rm -rf "$tmp"
    fi
  done
  extra+=("-DCMAKE_PREFIX_PATH=$deps/usr")
fi

start=$(date +%s)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DQATTN_CUDA=ON \
  -DQATTN_BUILD_PYTHON=ON -DQATTN_BUILD_TESTS="${QATTN_BUILD_TESTS:-OFF}" \
  -DQATTN_BUILD_TOOLS="${QATTN_BUILD_TOOLS:-OFF}" -DPython_EXECUTABLE="$py" "${extra[@]}" >/dev/null ||
  { echo "build_on_device.sh: CMake configure failed (fmt/nlohmann_json missing? see the header)" >&2; exit 1; }
# shellcheck disable=SC2086  # a list of targets
cmake --build "$build_dir" -j "$jobs" --target ${QATTN_TARGETS:-qattn_C}
cp "$build_dir"/python/_C*.so python/qattn/
echo "build_on_device.sh: built qattn._C in $(($(date +%s) - start)) s"
PYTHONPATH=python "$py" -c 'import qattn; print("qattn", qattn.__version__, "cuda:", qattn.built_with_cuda(), "sm90:", qattn.device_supported())'
