#!/usr/bin/env bash
# Builds of the library on one GPU, in one run: (1) bit for bit — output_digest built
# against each prints a digest of O and the LSE per case of its grid, on the same inputs
# (a fixed grid plus random cases from one fresh seed), and each build's digests must
# equal the base build's; the base build runs twice to show the digests are stable run
# to run; (2) speed — kernel_timing built against each, interleaved (bench/ab_timing.sh).
#   run: bench/compare_builds.sh DIR   (DIR holds output_digest_<build> and
#        kernel_timing_<build> for build = base and one or more others, e.g. new)
#   env: SEED (default: from the clock, printed), SHAPES and ROUNDS for ab_timing.sh,
#        SKIP_TIMING=1 for the bit-for-bit part alone
set -uo pipefail
dir=${1:?"folder with the output_digest_<build> and kernel_timing_<build> binaries"}
seed=${SEED:-$(date +%s)}
out=${OUT:-/tmp/qattn-out}
mkdir -p "$out"
echo "seed $seed"
"$dir/output_digest_base" --seed "$seed" >"$out/digest-base.txt"
"$dir/output_digest_base" --seed "$seed" >"$out/digest-base-again.txt"
cases=$(wc -l <"$out/digest-base.txt")
failed=$(grep -vc "status=0 " "$out/digest-base.txt")
if cmp -s "$out/digest-base.txt" "$out/digest-base-again.txt"; then
  echo "base twice: identical ($cases cases, $failed not run: status != 0)"
else
  echo "base twice: DIFFERENT"
fi
timing=("$dir/kernel_timing_base")
for bin in "$dir"/output_digest_*; do
  build=${bin##*/output_digest_}
  [[ $build == base ]] && continue
  "$bin" --seed "$seed" >"$out/digest-$build.txt"
  if cmp -s "$out/digest-base.txt" "$out/digest-$build.txt"; then
    echo "base vs $build: bit-identical O and LSE in all $cases cases"
  else
    echo "base vs $build: DIFFERENT"
    diff "$out/digest-base.txt" "$out/digest-$build.txt" | head -20
  fi
  [[ -x "$dir/kernel_timing_$build" ]] && timing+=("$dir/kernel_timing_$build")
done
[[ -n "${SKIP_TIMING:-}" ]] || "$(dirname "$0")/ab_timing.sh" "${timing[@]}" | tee "$out/ab-timing.txt"
