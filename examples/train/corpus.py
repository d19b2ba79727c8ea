"""The text corpora of the training experiment, read straight from Debian package files
(fetch_corpus.sh puts them in .deps/corpus/), as byte tokens.

A .deb is an ar archive whose member data.tar.{xz,gz,zst} holds the files; Python's
tarfile reads xz and gz (Debian 12's packages use xz), so nothing is installed and the
GPU machine needs no dpkg. Documents are the text files whose paths match a corpus's
pattern, sorted by path; each ends with the byte 0 (absent from the texts), the
end-of-document token. A document goes to validation when crc32(path) % 20 == 0 (about
5%, the same split on every machine and run), otherwise to training.
"""

from __future__ import annotations

import fnmatch
import io
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

EOD = 0  # end-of-document byte
VAL_MODULUS = 20


@dataclass(frozen=True)
class CorpusSpec:
    package: str
    patterns: Tuple[str, ...]
    what: str


CORPORA: Dict[str, CorpusSpec] = {
    "python-docs": CorpusSpec(
        "python3.11-doc", ("./usr/share/doc/python3.11/html/_sources/*.rst.txt",),
        "Python 3.11 documentation, reStructuredText sources (Debian python3.11-doc)"),
    "perl-docs": CorpusSpec(
        "perl-doc", ("./usr/share/perl/5.*/pod/*.pod",),
        "Perl 5.36 core documentation, POD sources (Debian perl-doc)"),
}


@dataclass
class Corpus:
    name: str
    what: str
    package_file: str
    train: bytes
    val: bytes
    documents: int
    val_documents: int


def _ar_members(data: bytes):
    if data[:8] != b"!<arch>\n":
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned


def read_deb_texts(deb: Path, patterns) -> List[Tuple[str, bytes]]:
    """(path, content) of the regular files in the .deb whose path matches a pattern."""
    for name, member in _ar_members(deb.read_bytes()):
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ValueError(f"{deb.name}: {name} is zstd-compressed; Python's tarfile reads xz/gz only")
            with tarfile.open(fileobj=io.BytesIO(member), mode="r:*") as tar:
                out = []
                for info in tar:
                    path = info.name if info.name.startswith("./") else "./" + info.name
                    if info.isfile() and any(fnmatch.fnmatch(path, p) for p in patterns):
                        out.append((path, tar.extractfile(info).read()))
                return sorted(out)
    raise ValueError(f"{deb.name}: no data.tar member")


def find_package_file(corpus_dir: Path, package: str) -> Path:
    found = sorted(Path(corpus_dir).glob(f"{package}_*.deb"))
    if not found:
        raise FileNotFoundError(
            f"no {package}_*.deb in {corpus_dir}: run examples/train/fetch_corpus.sh (and carry .deps)")
    return found[-1]


def load(name: str, corpus_dir: Path) -> Corpus:
    spec = CORPORA[name]
    deb = find_package_file(corpus_dir, spec.package)
    docs = read_deb_texts(deb, spec.patterns)
    if not docs:
        raise ValueError(f"{deb.name}: no file matches {spec.patterns}")
    train, val, n_val = bytearray(), bytearray(), 0
    for path, text in docs:
        text = text.replace(bytes([EOD]), b"") + bytes([EOD])
        if zlib.crc32(path.encode()) % VAL_MODULUS == 0:
            val += text
            n_val += 1
        else:
            train += text
    return Corpus(name, spec.what, deb.name, bytes(train), bytes(val), len(docs), n_val)
