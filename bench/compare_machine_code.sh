#!/usr/bin/env bash
# Is a source change a pure refactoring for the GPU? Compiles one CUDA file for sm_90a
# at a git revision and in the working tree, without line info, and compares every
# kernel's machine code (each ELF .text section of the two cubins) byte for byte. No
# GPU and no CUDA binary tools beyond nvcc are needed (readelf reads the cubins).
#   bench/compare_machine_code.sh REV FILE.cu [FILE.cu ...]
#     e.g. bench/compare_machine_code.sh HEAD src/cuda/sage2_fwd/launch.cu
# BY_CONTENT=1 pairs kernels by their bytes instead: every kernel of REV must have a
# byte-identical kernel in the working tree (for a change that renames kernels, e.g. a
# template parameter added with the old code as one of its values).
# Prints one line per kernel that differs and a summary; kernels that exist in one build
# only are listed (a change that adds kernels still has the others compared); exits 1
# when a kernel of both builds differs or one of the base build's is gone.
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
# A kernel in an anonymous namespace carries hashes of its translation unit in its name
# (_GLOBAL__N__<hash>_<len>_<file>_<hash>_<n>, nvcc 13), which change with any edit of
# the file or its includes: kernels are paired by their names with those left out.
normalize() {
  sed -E -e 's/_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+_[0-9]+/_GLOBAL__N__/' \
         -e 's/_GLOBAL__N__[0-9a-f]+_/_GLOBAL__N__/'
}
# The digests of every kernel's bytes in cubin $1 (BY_CONTENT).
digests() { for s in $(sections "$1"); do readelf -x "$s" "$1" 2>/dev/null | tail -n +3 | md5sum | cut -c1-32; done | sort -u; }
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
  if [ -n "${BY_CONTENT:-}" ]; then
    missing=$(comm -23 <(digests "$tmp/base.cubin") <(digests "$tmp/new.cubin") | wc -l)
    echo "$file: $(sections "$tmp/base.cubin" | wc -l) kernels at $rev, $(sections "$tmp/new.cubin" | wc -l) now;" \
         "$missing of $rev's machine codes have no byte-identical kernel now"
    [ "$missing" -eq 0 ] || status=1
    continue
  fi
  gone=$(comm -23 <(sections "$tmp/base.cubin" | normalize | sort) <(sections "$tmp/new.cubin" | normalize | sort))
  added=$(comm -13 <(sections "$tmp/base.cubin" | normalize | sort) <(sections "$tmp/new.cubin" | normalize | sort))
  for k in $gone; do echo "only in $rev: ${k#.text.}"; status=1; done
  for k in $added; do echo "new: ${k#.text.}"; done
  total=0 differ=0
  while read -r s; do
    n=$(section_of "$tmp/new.cubin" "$(echo "$s" | normalize)")
    [ -n "$n" ] || continue
    total=$((total + 1))
    # readelf -x prints the section's name first: compare the bytes only.
    if ! cmp -s <(readelf -x "$s" "$tmp/base.cubin" 2>/dev/null | tail -n +3) \
                <(readelf -x "$n" "$tmp/new.cubin" 2>/dev/null | tail -n +3); then
      differ=$((differ + 1))
      echo "differs: $(echo "${s#.text.}" | normalize)"
    fi
  done < <(sections "$tmp/base.cubin")
  echo "$file: $total kernels in both, $differ differ from $rev; $(echo $added | wc -w) new"
  [ "$differ" -eq 0 ] || status=1
done
exit $status
