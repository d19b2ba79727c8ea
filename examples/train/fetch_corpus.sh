#!/usr/bin/env bash
# Downloads the two text corpora of the training experiment as Debian package files into
# .deps/corpus/ (git-ignored; carry .deps to the GPU machine, which has no network):
#   python3.11-doc  the Python 3.11 documentation; train.py reads its reStructuredText
#                   sources (usr/share/doc/python3.11/html/_sources/**/*.rst.txt, about
#                   11.0 MB = 11.0 M byte tokens): the pretraining corpus
#   perl-doc        the Perl 5.36 core documentation; train.py reads its POD files
#                   (usr/share/perl/5.36.0/pod/*.pod, about 8.9 MB): the fine-tuning corpus
# Both are English technical prose of the same register but a different language and
# house style, so fine-tuning on one after the other is a real distribution shift.
# The package files are read as they are (ar + tar, in Python): nothing is installed.
#   examples/train/fetch_corpus.sh [DIR]      (default DIR: .deps/corpus in the repo root)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.deps/corpus}
mkdir -p "$dir"
cd "$dir"
if ! apt-cache show python3.11-doc >/dev/null 2>&1; then
  echo "fetch_corpus.sh: apt knows no python3.11-doc (Debian 12 has it; run apt-get update first)" >&2
  exit 1
fi
# apt-get download writes as the _apt user where it can; a folder that user cannot write
# to still works (apt falls back to root and warns).
apt-get download python3.11-doc perl-doc 2>&1 | grep -v "^W: Download is performed unsandboxed" || true
ls -l "$dir"/python3.11-doc_*.deb "$dir"/perl-doc_*.deb
