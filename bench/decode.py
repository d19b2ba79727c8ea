#!/usr/bin/env python3
"""Decode attention speed on the GPU over a KV cache, side by side in one process
(docs/kv-cache.md; timing as docs/design.md, Measuring):

  sdpa_cudnn    torch SDPA on a BF16 contiguous cache (B, Hkv, L, d), cuDNN backend
  sdpa_flash    the same, FlashAttention-2 backend: what a user has. GQA folded into the
                query rows (q (B, Hkv, g*nq, d)), so K and V are read once per KV head as
                a decode kernel reads them. With nq > 1 the folded rows are no causal
                pattern either backend takes, so they run unmasked (the bottom-right mask
                hides at most nq - 1 of L keys: the same bytes, a little more arithmetic);
                the CosSim reference is SDPA with the boolean mask (query i sees key j iff
                j <= i + L - nq), untimed
  qattn_nvfp4   qattn.decode on a qattn.KVCache of that format, paged (page size 16),
  qattn_fp8     filled from the same BF16 K and V by one qattn append
  qattn_int8
  qattn_bf16    (qattn's own BF16 format: the same bytes as SDPA's cache, paged)

Grid: batch {1, 8, 64, 128} x context {2K, 8K, 32K, 128K} x nq {1, 4}, Hq = 32, Hkv = 8,
d = 128, bf16 queries; a (batch, context) whose BF16 cache would exceed --max-gb is
skipped (a row with a note). Every sequence of a batch has the full context.

Per row: ms (CUDA graph of one call, replayed: the device's time, no Python; also as us),
ms_call (the eager call, Python included), bytes_read (cache_bytes: B * L * bytes per
token, K and V codes and scales of every KV head; q and o are ignored) and its rate at
ms (gbps, tbps), the speedup over sdpa_cudnn's and sdpa_flash's ms at the same (batch,
context, nq), and the CosSim of the output to masked SDPA's on the same inputs.

Timing (bench/forward.py's time_fn): CUDA events per call after warm-up, the median of
each of two passes (both kept; ms is the lower one); several caches (sequence ranges of
one qattn.KVCache, batch slices of one SDPA tensor) rotated where one would fit in L2.

Run on the device from the repo root (after python/build_on_device.sh):
  PYTHONPATH=python python3 bench/decode.py --out bench/results            # ~1-2 min
  PYTHONPATH=python python3 bench/decode.py --quick                        # ~1 min, prints only
  python3 bench/decode.py --dry-run                                         # no GPU: the plan
Writes OUT/decode-h200.json ({"env": {...}, "rows": [...]}) with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

BATCHES = (1, 8, 64, 128)
CONTEXTS = (2048, 8192, 32768, 131072)
NQS = (1, 4)
FORMATS = ("nvfp4", "fp8", "int8", "bf16")
SDPA_METHODS = ("sdpa_cudnn", "sdpa_flash")
METHODS = SDPA_METHODS + tuple(f"qattn_{f}" for f in FORMATS)
# Bytes of one token's K or V row per KV head (docs/kv-cache.md, Bytes per token), so
# the plan needs no GPU; checked against KVCache.bytes_per_token when measuring.
ROW_BYTES = {"nvfp4": lambda d: d // 2 + d // 16, "fp8": lambda d: d + 4, "int8": lambda d: d + 4,
             "bf16": lambda d: 2 * d}
SEED = 0


@dataclass
class Config:
    batch: int
    context: int
    heads_q: int
    heads_kv: int
    d: int

    def bf16_bytes(self, copies: int = 1) -> int:
        return copies * self.batch * self.context * 2 * self.heads_kv * self.d * 2


@dataclass
class Row:
    method: str
    batch: int
    context: int
    nq: int
    heads_q: int
    heads_kv: int
    d: int
    ms: Optional[float]
    ms_call: Optional[float] = None
    gbps: Optional[float] = None
    speedup_vs_cudnn: Optional[float] = None
    speedup_vs_flash: Optional[float] = None
    cossim_vs_sdpa: Optional[float] = None
    cache_bytes: int = 0
    page_size: int = 0
    ms_passes: List[float] = field(default_factory=list)
    ms_call_passes: List[float] = field(default_factory=list)
    iters: int = 0
    rotation: int = 1
    note: str = ""
    num_splits: int = 0  # qattn rows: the num_splits passed (0: the library's choice)
    # The same measurement in the units of issue 20's results format (n, us, bytes_read,
    # tbps), derived from the fields above.
    n: int = 0
    us: Optional[float] = None
    bytes_read: int = 0
    tbps: Optional[float] = None

    def __post_init__(self):
        self.n = self.context
        self.bytes_read = self.cache_bytes
        if self.ms is not None:
            self.us = self.ms * 1e3
            self.tbps = self.gbps / 1e3 if self.gbps is not None else None


def grid(args) -> List[Config]:
    batches = (1, 64) if args.quick else args.batch
    contexts = (2048, 32768) if args.quick else args.context
    return [Config(b, n, args.heads_q, args.heads_kv, args.d) for b in batches for n in contexts]


def rotation(c: Config, l2_bytes: int) -> int:
    """Copies of the inputs rotated so that consecutive calls do not read from L2."""
    one = c.bf16_bytes()
    return 1 if one >= 2 * l2_bytes else min(8, math.ceil(3 * l2_bytes / one))


def dry_run(args) -> int:
    l2 = 60 << 20  # bench/forward.py's H200 fallback
    print(f"plan: methods {', '.join(args.methods)}; nq {args.nq}; Hq {args.heads_q}, Hkv {args.heads_kv}, "
          f"d {args.d}; page size {args.page_size}; skip above {args.max_gb} GB")
    for c in grid(args):
        gb = c.bf16_bytes() / 1e9
        if gb > args.max_gb:
            what = f"skip (BF16 cache {gb:.1f} GB > {args.max_gb})"
        else:
            what = f"BF16 cache {gb * 1e3:.0f} MB"
        per = {f: c.batch * c.context * 2 * c.heads_kv * ROW_BYTES[f](c.d) for f in FORMATS}
        print(f"  B={c.batch:<3} L={c.context:<6} {what}, rotation {rotation(c, l2)}; qattn cache "
              + ", ".join(f"{f} {b / 1e6:.0f} MB" for f, b in per.items()))
    return 0


# ---- measuring (imports torch and qattn) -------------------------------------------------


def measure_config(c: Config, args, l2_bytes: int) -> List[Row]:
    torch, F, qattn, fwd = _torch, _F, _qattn, _fwd
    rows: List[Row] = []
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters,
                  budget_s=args.budget_s)
    if c.bf16_bytes() / 1e9 > args.max_gb:
        for nq in args.nq:
            for m in args.methods:
                rows.append(Row(m, c.batch, c.context, nq, c.heads_q, c.heads_kv, c.d, None,
                                note=f"skipped: BF16 cache {c.bf16_bytes() / 1e9:.1f} GB > --max-gb {args.max_gb}"))
        return rows
    r_count = rotation(c, l2_bytes)
    b, n, hq, hkv, d = c.batch, c.context, c.heads_q, c.heads_kv, c.d
    g = torch.Generator(device="cuda").manual_seed(SEED)
    k = torch.randn(r_count * b, hkv, n, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(r_count * b, hkv, n, d, generator=g, device="cuda", dtype=torch.bfloat16)
    qs = {nq: torch.randn(r_count, b, hq, nq, d, generator=g, device="cuda", dtype=torch.bfloat16)
          for nq in args.nq}
    group = hq // hkv

    def timed(fns):
        """(graph medians, eager medians, iters) of the calls fns[r](), rotated."""
        for f in fns:
            f()
        torch.cuda.synchronize()
        graphs = []
        for f in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                f()
            graphs.append(graph)
        med_g, iters = fwd.time_fn(lambda i: graphs[i % len(graphs)].replay(), **timing)
        med_e, _ = fwd.time_fn(lambda i: fns[i % len(fns)](), **timing)
        graphs.clear()
        return med_g, med_e, iters

    def row(method, nq, med_g, med_e, iters, cache_bytes, out=None, ref=None, page_size=0, note=""):
        ms = min(med_g)
        r = Row(method, b, n, nq, hq, hkv, d, ms, min(med_e), cache_bytes / (ms * 1e-3) / 1e9, None, None,
                fwd.cossim(out, ref) if out is not None and ref is not None else None, cache_bytes,
                page_size, med_g, med_e, iters, r_count, note)
        rows.append(r)
        return r

    # The reference output of every row: SDPA with the bottom-right mask (untimed).
    # Query head h reads KV head h // group: the group is folded into the query rows.
    def sdpa(r, nq, mask=None):
        q = qs[nq][r].reshape(b, hkv, group * nq, d)
        o = F.scaled_dot_product_attention(q, k[r * b:(r + 1) * b], v[r * b:(r + 1) * b], attn_mask=mask)
        return o.reshape(b, hq, nq, d)

    ref_out = {}
    for nq in args.nq:
        j = torch.arange(n, device="cuda")[None, :]
        i = torch.arange(nq, device="cuda").repeat(group)[:, None]
        ref_out[nq] = sdpa(0, nq, (j <= i + n - nq) if nq > 1 else None)
    sdpa_ms = {}  # (method, nq) -> ms
    for method in SDPA_METHODS:
        if method not in args.methods:
            continue
        backend = _SDPBackend.CUDNN_ATTENTION if method == "sdpa_cudnn" else _SDPBackend.FLASH_ATTENTION
        for nq in args.nq:
            def call(r, nq=nq, backend=backend):
                with _sdpa_kernel(backend):  # this backend alone: SDPA raises where it refuses
                    return sdpa(r, nq)

            try:
                out = call(0)
                med_g, med_e, iters = timed([lambda r=r: call(r) for r in range(r_count)])
            except RuntimeError as e:
                rows.append(Row(method, b, n, nq, hq, hkv, d, None,
                                note=f"unavailable: {str(e).splitlines()[0][:160]}"))
                continue
            note = "GQA folded into query rows" + ("; unmasked (see the header)" if nq > 1 else "")
            sdpa_ms[method, nq] = row(method, nq, med_g, med_e, iters, b * n * 2 * hkv * 2 * d, out,
                                      ref_out[nq], note=note).ms
    for fmt in FORMATS:
        method = f"qattn_{fmt}"
        if method not in args.methods:
            continue
        ps = args.page_size
        pages_per_seq = -(-n // ps)
        try:
            cache = qattn.KVCache(num_pages=r_count * b * pages_per_seq, page_size=ps, heads_kv=hkv, head_dim=d,
                                  max_seqs=r_count * b, max_pages_per_seq=pages_per_seq, format=fmt)
            for s in range(r_count * b):
                cache.allocate(s, n)
            cache.append(k, v)  # every sequence's n tokens in one call (fixes c from them)
        except (RuntimeError, qattn.QattnError) as e:  # out of memory, or refused
            for nq in args.nq:
                rows.append(Row(method, b, n, nq, hq, hkv, d, None,
                                note=f"unavailable: {str(e).splitlines()[0][:160]}"))
            continue
        assert cache.bytes_per_token == 2 * hkv * ROW_BYTES[fmt](d)
        for nq in args.nq:
            for splits in args.num_splits:
                def dec(r, nq=nq, splits=splits):
                    return qattn.decode(qs[nq][r], cache, seqs=range(r * b, (r + 1) * b), num_splits=splits)

                out = dec(0)
                med_g, med_e, iters = timed([lambda r=r: dec(r) for r in range(r_count)])
                rr = row(method, nq, med_g, med_e, iters, b * n * cache.bytes_per_token, out, ref_out[nq], ps,
                         f"num_splits {splits or 'chosen'}")
                rr.num_splits = splits
                if ("sdpa_cudnn", nq) in sdpa_ms:
                    rr.speedup_vs_cudnn = sdpa_ms["sdpa_cudnn", nq] / rr.ms
                if ("sdpa_flash", nq) in sdpa_ms:
                    rr.speedup_vs_flash = sdpa_ms["sdpa_flash", nq] / rr.ms
        cache = None  # before the next format's cache is allocated
        torch.cuda.empty_cache()
    return rows


def print_table(rows: List[Row]) -> None:
    keys = []
    for r in rows:
        if (r.batch, r.context, r.nq) not in keys:
            keys.append((r.batch, r.context, r.nq))
    print(f"\n{'B':>3}{'L':>7}{'nq':>4}" + "".join(f"{m:>22}" for m in METHODS))
    for key in keys:
        cells = []
        for m in METHODS:
            r = next((r for r in rows if (r.batch, r.context, r.nq) == key and r.method == m), None)
            if r is None or r.ms is None:
                cells.append(f"{'-':>22}")
                continue
            sp = f" {r.speedup_vs_cudnn:4.2f}x" if r.speedup_vs_cudnn else ""
            cells.append(f"{r.ms * 1e3:8.1f}us {r.gbps:5.0f}GB/s{sp}".rjust(22))
        print(f"{key[0]:>3}{key[1]:>7}{key[2]:>4}" + "".join(cells))
    print("(graph-replay time per call, GB/s of cache bytes read, speedup over sdpa_cudnn)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder for NAME.json (default: print only)")
    ap.add_argument("--name", default="decode-h200", help="file name stem of the JSON")
    ap.add_argument("--quick", action="store_true", help="B {1, 64} x L {2K, 32K} (~1 minute)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (no GPU, no torch needed)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--nq", type=int, nargs="+", default=list(NQS), choices=range(1, 17), metavar="NQ")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-splits", type=int, nargs="+", default=[0],
                    help="qattn.decode's num_splits, a row each (0: the library's choice; several: a sweep "
                         "of the split-KV rule's choices)")
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip a (batch, context) whose BF16 cache is larger")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-iters", type=int, default=10)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=0.1, help="target timed seconds per pass")
    ap.add_argument("--time-limit-s", type=float, default=540,
                    help="stop measuring (and still write the results) after this long")
    ap.add_argument("--commit", default="", help="commit id to record (else $QATTN_COMMIT or git)")
    args = ap.parse_args(argv)
    if args.heads_q % args.heads_kv != 0:
        ap.error(f"--heads-q {args.heads_q} is not a multiple of --heads-kv {args.heads_kv}")
    if min(args.batch + args.context) < 1 or args.page_size < 1 or not all(0 <= s <= 128 for s in args.num_splits):
        ap.error("--batch, --context and --page-size must be positive, --num-splits in 0..128")
    if args.dry_run:
        return dry_run(args)
    if args.quick:
        args.min_iters, args.max_iters, args.budget_s = 5, 50, 0.05

    global _torch, _F, _qattn, _fwd, _SDPBackend, _sdpa_kernel
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import forward as fwd  # timing and environment helpers (imports torch and qattn)

    if fwd.torch is None:
        print(f"bench/decode.py: {fwd._import_error}", file=sys.stderr)
        return 2
    _torch, _F, _qattn, _fwd = fwd.torch, fwd.F, fwd.qattn, fwd
    from torch.nn.attention import SDPBackend as _SDPBackend, sdpa_kernel as _sdpa_kernel
    torch = _torch
    if not torch.cuda.is_available() or not _qattn.device_supported():
        print("bench/decode.py: needs a CUDA device qattn runs on (sm_90)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or fwd.L2_FALLBACK_BYTES
    env = {
        "gpu": props.name,
        **fwd.clock_env(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "qattn": _qattn.__version__,
        "commit": fwd.commit_id(args.commit),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sm_count": props.multi_processor_count,
        "dtype": "bf16",
        "page_size": args.page_size,
        "timing": f"CUDA events per call, {args.warmup} warm-up, median of each of 2 passes of "
                  f"{args.min_iters}..{args.max_iters} calls (~{args.budget_s}s); ms = lower median of "
                  "a CUDA graph of one call replayed, ms_call = the eager call",
    }
    configs = grid(args)
    t0 = time.time()
    rows: List[Row] = []
    truncated = False
    for i, c in enumerate(configs):
        if time.time() - t0 > args.time_limit_s:
            truncated = True
            print(f"time limit reached: {len(configs) - i} configurations not measured", file=sys.stderr)
            break
        new = measure_config(c, args, l2)
        rows += new
        summary = ", ".join(f"{r.method}/{r.nq} {r.ms * 1e3:.0f}us" for r in new if r.ms)
        print(f"[{i + 1}/{len(configs)} {time.time() - t0:5.0f}s] B={c.batch} L={c.context}: {summary}",
              file=sys.stderr, flush=True)
    env["wall_s"] = round(time.time() - t0, 1)
    env["truncated"] = truncated
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.name}.json"
        path.write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"{env['gpu']}, SM clock max {env['sm_clock_mhz']} MHz, driver {env['driver']}, CUDA {env['cuda']}, "
          f"torch {env['torch']}, commit {env['commit']}")
    print_table(rows)
    return 0


_torch = _F = _qattn = _fwd = _SDPBackend = _sdpa_kernel = None

if __name__ == "__main__":
    sys.exit(main())
