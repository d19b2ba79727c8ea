# Sourced by the bench/device_*.sh checks (from the repository root): their common start
# and where the GPU binaries come from on the device.
#   device_setup: $out and $logs (under $OUT), the CUDA tools on PATH, the tolerance
# tables, an empty status array and the start time.
device_setup() {
  out=${OUT:-/tmp/qattn-out}
  logs=$out/logs
  mkdir -p "$out" "$logs"
  export PATH=/usr/local/cuda/bin:$PATH
  export QATTN_TOLERANCES=$PWD/tests/tolerances
  status=()
  start=$(date +%s)
}

#   use_binding <path>: the qattn._C of <path> (a module built for the device's Python)
# as the package's binding in python/qattn/, in place of any other.
use_binding() {
  local ext
  ext=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  rm -f python/qattn/_C*.so && cp "$1" "python/qattn/_C$ext"
}

#   ab_bins <archive> <dir>: an A/B run's binaries, .devrun/<archive> unpacked into <dir>
# (base_C.so, new_C.so and test binaries), $bins set to it, and `use <side>` making that
# side's binding the package's.
ab_bins() {
  bins=$2
  mkdir -p "$bins" && tar -xJf ".devrun/$1" -C "$bins" || return 1
  use() { use_binding "$bins/$1_C.so"; }
}

#   device_deps: the Debian packages' libraries carried in .deps (libfmt of binaries built
# off the device) unpacked and put on LD_LIBRARY_PATH.
device_deps() {
  compgen -G ".deps/*.deb" >/dev/null || return 0
  local deps=/tmp/qattn-deps
  mkdir -p "$deps"
  for deb in .deps/*.deb; do dpkg -x "$deb" "$deps" 2>/dev/null; done
  export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

#   step <name> <timeout> <command...>: runs it, logs it to $logs/<name>.log, records
# PASS/FAIL with its rc in the status array (and shows a failure's first lines), and
# prints that line with the time so far (a run cut short still shows how far it got).
step() {
  local name=$1 limit=$2
  shift 2
  if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then
    status+=("$name: PASS")
  else
    status+=("$name: FAIL (rc $?)")
    grep -E "^\[  FAILED|Failure|Expected|actual|^FAILED" "$logs/$name.log" | head -6
  fi
  echo "${status[-1]} ($(($(date +%s) - start)) s)"
}

#   device_bins <archive> <import test> <targets...>
# Unpacks .devrun/<archive> (built off the device: gpu_test_* and qattn._C for the
# device's Python, and a COMMIT file) into /tmp/qattn-bins when it is there; when the
# binding fails <import test> (a Python expression that is true for a usable build) or the
# first target's binary is missing, builds the targets here with python/build_on_device.sh
# (carry .deps: see its header). Sets $bins (the folder of the test binaries) and appends
# a line to the caller's status array; the Debian packages' libraries in .deps (libfmt
# of binaries built off the device) go on LD_LIBRARY_PATH.
device_bins() {
  local archive=$1 check=$2
  shift 2
  device_deps
  bins=build-py/tests
  if [[ -f .devrun/$archive ]]; then
    mkdir -p /tmp/qattn-bins && tar -xJf ".devrun/$archive" -C /tmp/qattn-bins
    bins=/tmp/qattn-bins
    cp /tmp/qattn-bins/_C*.so python/qattn/ 2>/dev/null
    status+=("binaries: prebuilt ($(cat /tmp/qattn-bins/COMMIT 2>/dev/null || echo '?'))")
  fi
  if ! PYTHONPATH=python python3 -c "import sys, qattn; from qattn import _C; sys.exit(0 if ($check) else 1)" \
      2>/dev/null || [[ ! -x $bins/$1 ]]; then
    QATTN_BUILD_TESTS=ON QATTN_TARGETS="qattn_C $*" \
        QATTN_BUILD_LOG="$logs/build.log" python/build_on_device.sh || return 1
    bins=build-py/tests
    status+=("build on the device: $(($(date +%s) - start)) s")
  fi
}
