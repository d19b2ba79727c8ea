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
status=0
for file in "$@"; do
  for side in base new; do
    src_root=$([ $side = base ] && echo "$tmp/base" || echo "$root")
    (cd "$src_root" && "$nvcc" "${flags[@]}" -I include -I src -cubin -o "$tmp/$side.cubin" "$file") &
  done
  wait
  if ! diff <(sections "$tmp/base.cubin") <(sections "$tmp/new.cubin") >/dev/null; then
    echo "$file: the two builds have different kernels:"
    diff <(sections "$tmp/base.cubin") <(sections "$tmp/new.cubin") || true
    status=1
    continue
  fi
  total=0 differ=0
  while read -r s; do
    total=$((total + 1))
    if ! cmp -s <(readelf -x "$s" "$tmp/base.cubin" 2>/dev/null) <(readelf -x "$s" "$tmp/new.cubin" 2>/dev/null); then
      differ=$((differ + 1))
      echo "differs: ${s#.text.}"
    fi
  done < <(sections "$tmp/base.cubin")
  echo "$file: $total kernels, $differ differ from $rev"
  [ "$differ" -eq 0 ] || status=1
done
exit $status
