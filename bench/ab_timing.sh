#!/usr/bin/env bash
# Side-by-side timing of kernel variants in one run (the method of bench/NOTES.md:
# machines differ by ~5%, so only numbers from the same run are compared). Each
# argument is a kernel_timing binary built from one variant (nvcc bench/kernel_timing.cu
# with that variant's libqattn.a, which holds its CUDA objects); the rounds interleave the
# variants, and the table gives, per shape, the best of the rounds for each.
#   run: bench/ab_timing.sh .devbin/kernel_timing_base .devbin/kernel_timing_new
#   env: SHAPES="B H N d causal ..." (default below), ROUNDS (default 2)
set -euo pipefail
(($# >= 1)) || { echo "usage: $0 kernel_timing_binary..." >&2; exit 2; }
shapes=${SHAPES:-"4 32 1024 128 0 4 32 2048 128 0 4 32 8192 128 0 4 32 2048 128 1 4 32 8192 128 1 4 32 8192 64 0"}
rounds=${ROUNDS:-2}
raw=$(mktemp)
for ((r = 0; r < rounds; ++r)); do
  for bin in "$@"; do
    # shellcheck disable=SC2086  # the shape list is meant to split into arguments
    timeout 120 "$bin" $shapes | awk -v v="$(basename "$bin")" '$6 == "|" && $1 ~ /^[0-9]+$/ {print v, $0}' >>"$raw"
  done
done
python3 - "$raw" "$@" <<'EOF'
import sys, os
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    v, shape = f[0], tuple(f[1:6])
    e2e, kern = float(f[8]), float(f[11])  # TOPS columns
    best = rows.setdefault(shape, {}).get(v, (0.0, 0.0))
    rows[shape][v] = (max(best[0], e2e), max(best[1], kern))
names = [os.path.basename(b) for b in sys.argv[2:]]
print("end-to-end / kernel-only TOPS, best of the rounds")
print("%-22s" % "B H N d causal" + "".join("%22s" % n for n in names))
for shape, vs in rows.items():
    cells = "".join("%22s" % ("%.0f / %.0f" % vs[n] if n in vs else "-") for n in names)
    print("%-22s" % " ".join(shape) + cells)
EOF
rm -f "$raw"
