#!/usr/bin/env bash
# Builds, on the GPU machine, what bench/device_run.sh and bench/compare_builds.sh run:
# the Python binding (python/build_on_device.sh, into build-py/), the GPU test programs,
# and the "new" side of compare_builds.sh (output_digest and kernel_timing against this
# tree's libqattn.a) into DIR (default .devbin), where the "base" side, built from the
# commit compared against, is carried.
#   run: bench/device_build.sh [DIR]   (carry .deps and DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.devbin}
mkdir -p "$dir"
export PATH=/usr/local/cuda/bin:$PATH
tests=$(ls tests/gpu/*.cpp tests/gpu/*.cu | xargs -n1 basename | sed -E 's/\.(cpp|cu)$//; s/^/gpu_/' | tr '\n' ' ')
QATTN_BUILD_TESTS=ON QATTN_TARGETS="qattn_C $tests" JOBS=${JOBS:-$(nproc)} python/build_on_device.sh
cuda=/usr/local/cuda
g++ -std=c++20 -O2 -DQATTN_DIGEST_SAGE2_OPTIONS -Iinclude bench/output_digest.cpp build-py/libqattn.a \
  -I$cuda/include -L$cuda/lib64 -lcudart_static -ldl -lrt -lpthread -o "$dir/output_digest_new"
nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude bench/kernel_timing.cu \
  build-py/libqattn.a -o "$dir/kernel_timing_new"
echo "device_build.sh: built the binding, $tests and $dir/{output_digest,kernel_timing}_new"
