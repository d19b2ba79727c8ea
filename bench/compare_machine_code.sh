#!/usr/bin/env bash
# Is a source change a pure refactoring for the GPU? Compiles one CUDA file for sm_90a
# at a git revision and in the working tree, without line info, and compares every
# kernel's machine code (each ELF .text section of the two cubins) byte for byte. No
# GPU and no CUDA binary tools beyond nvcc are needed (readelf reads the cubins).
#   bench/compare_machine_code.sh REV FILE.cu [FILE.cu ...]
#     e.g. bench/compare_machine_code.sh HEAD src/cuda/sage2_fwd/launch.cu
# Prints one line per kernel that differs and a summary; exits 1 when any differs or a
# kernel exists in one build only.
set -euo pipefail
rev=${1:?"a git revision to compare with, e.g. HEAD"}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
flags=(-O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++20
       -DQATTN_HAVE_CUDA=1)
tmp=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$root" worktree add --detach --quiet "$tmp/base" "$rev"

sections() { readelf -W -S "$1" 2>/dev/null | grep -o '\.text\.[^ ]*' | sort -u; }
# A kernel in an anonymous namespace carries a hash of its translation unit's contents in
# its name (_GLOBAL__N__<hash>_<file>_<path hash>), which changes with any edit of the
# file or its includes: kernels are paired by their names with that hash left out.
normalize() { sed -E 's/_GLOBAL__N__[0-9a-f]+_/_GLOBAL__N__/'; }
section_of() {  # the section of cubin $1 whose normalized name is $2
  sections "$1" | while read -r s; do if [ "$(echo "$s" | normalize)" = "$2" ]; then echo "$s"; fi; done
}
status=0
pids=()
for file in "$@"; do
  for side in base new; do
    src_root=$([ $side = base ] && echo "$tmp/base" || echo "$root")
    (cd "$src_root" && "$nvcc" "${flags[@]}" -I include -I src -cubin -o "$tmp/$side.cubin" "$file") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || { echo "$file: does not compile at one of the two revisions"; exit 2; }
  done
  pids=()
  if ! diff <(sections "$tmp/base.cubin" | normalize | sort) <(sections "$tmp/new.cubin" | normalize | sort) >/dev/null; then
    echo "$file: the two builds have different kernels:"
    diff <(sections "$tmp/base.cubin" | normalize | sort) <(sections "$tmp/new.cubin" | normalize | sort) || true
    status=1
    continue
  fi
  total=0 differ=0
  while read -r s; do
    total=$((total + 1))
    n=$(section_of "$tmp/new.cubin" "$(echo "$s" | normalize)")
    # readelf -x prints the section's name first: compare the bytes only.
    if ! cmp -s <(readelf -x "$s" "$tmp/base.cubin" 2>/dev/null | tail -n +3) \
                <(readelf -x "$n" "$tmp/new.cubin" 2>/dev/null | tail -n +3); then
      differ=$((differ + 1))
      echo "differs: $(echo "${s#.text.}" | normalize)"
    fi
  done < <(sections "$tmp/base.cubin")
  echo "$file: $total kernels, $differ differ from $rev"
  [ "$differ" -eq 0 ] || status=1
done
exit $status
