#!/usr/bin/env python3
"""Forward attention speed on the GPU, side by side in one process (docs/design.md, Measuring):

  qattn         qattn.attention end-to-end (quantization + attention, Python call included)
  qattn_kernel  the attention kernel alone, on the workspace a full call filled
  sdpa_cudnn    torch SDPA, cuDNN backend (BF16)
  sdpa_flash    torch SDPA, FlashAttention-2 backend (BF16)

on the standard grid (B=4, H=32, N = 1K..32K, d = 64/128, causal off/on), model
shapes (video DiT, image DiT, LLM prefill with GQA) and mask shapes (key padding, a
sliding window; --masks-only for these alone). Writes OUT/forward-h200.json
({"env": {...}, "rows": [{method, d, d_v, causal, mask, n, batch, heads, tops, ms, ...}]})
and OUT/forward-h200.png (TOPS against N per (d, causal)), and prints a table last.

Mask shapes: the baselines get the same mask as a boolean attn_mask (SDPA's cuDNN
backend, or its memory-efficient one where cuDNN refuses the mask: the row's note says
which; SDPA's FlashAttention takes no mask), and one more method runs beside them:
  qattn_same_work  qattn without a mask on the work the mask leaves (key padding to L:
                   the first L keys), so that the mask's own cost shows; for a boolean
                   padding mask, the same mask given as kv_lengths
The boolean-mask shapes (mask "bool") run qattn through its SDPA drop-in with the mask.
TOPS of a masked shape count only the visible (query, key) pairs: 4·B·Hq·pairs·d / s.

Varlen shapes (mask "varlen"; --varlen adds them to a run, --varlen-only runs them
alone, ~30 s): one pack of sequences of very different lengths, VARLEN_LENGTHS
(4096 .. 37 tokens) VARLEN_REPEATS times in an order shuffled by random.Random(VARLEN_SEED)
(16 sequences, 16,330 tokens; the order is in the JSON's env), causal per sequence; the
row's n is the longest sequence, batch = seqs the sequence count, tokens the real tokens.
TOPS count the real work only, 4·Hq·d·Σ L(L+1)/2 (the exact visible pairs of each causal
sequence, not a halved L²), for every method, the padded ones included. Methods:
  qattn           qattn.varlen_attention on the pack (flash_attn_varlen_func's convention):
                  one call of the varlen kernel (nothing read on the host)
  qattn_checked   the same with check_offsets=True (the offsets read and checked on the
                  host first: a device-to-host copy that waits for the stream)
  qattn_padded    qattn.attention over the right-padded batch (B = seqs, N = the longest)
                  with kv_lengths; its padding query rows are computed too
  sdpa_cudnn      SDPA over the right-padded batch with a boolean attn_mask (key padding
                  and causal), cuDNN backend; where cuDNN refuses the mask that row is
                  empty with the reason, and the next one is timed instead:
  sdpa_efficient  the same call with SDPA's memory-efficient backend
  flash_varlen    FlashAttention varlen on the pack: torch.ops.aten._flash_attention_forward
                  with cum_seq_q/k (what torch.nn.attention.varlen.varlen_attn runs on its
                  flash backend); a note where this torch has no such op
  cudnn_varlen    cuDNN varlen on the pack: torch.ops.aten._cudnn_attention_forward with
                  cum_seq_q/k, where torch itself would route varlen there (cuDNN >= 9.18,
                  SM90/SM100); a note otherwise
Every baseline's note names the CUDA kernels one call ran (from torch.profiler), so a
row says which backend really ran. A varlen row's cossim_vs_cudnn is against cuDNN's
output only (padded SDPA or cuDNN varlen, whichever ran); the note adds the CosSim to
flash_varlen.

Short sequences (--graph, up to --graph-max-n): where a call's GPU time nears its CPU
time, per-call events measure the host too. --graph adds
  qattn_graph       qattn.attention, 20 calls captured in one CUDA graph, per call
  sdpa_cudnn_graph  the same for cuDNN
(GPU time without the Python and launch-API part) and records host_us on the qattn and
sdpa_cudnn rows: the median CPU time of one call, timed around the call alone.

Timing: CUDA events around every call, after warm-up; the median of each of two
passes over the same configuration (both kept, to show the noise; `ms` is the lower
one); random normal bf16 inputs; several input sets rotated when one set would fit in
L2. TOPS = 4·B·Hq·Nq·Nkv·d / s, halved for causal (Nq = Nkv everywhere here).

Run on the device from the repo root (after python/build_on_device.sh):
  PYTHONPATH=python python3 bench/forward.py --out $OUT            # full, ~3-5 min
  PYTHONPATH=python python3 bench/forward.py --quick --out $OUT    # ~1 min
  PYTHONPATH=python python3 bench/forward.py --varlen-only --name forward-varlen --out $OUT  # ~30 s
  PYTHONPATH=python python3 bench/forward.py --quick --graph --no-masks --name forward-graph --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # This tree's package, unless PYTHONPATH names a folder holding another qattn (an A/B
    # run timing a second build with its own package).
    if not any((Path(p) / "qattn").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import qattn  # noqa: E402
except ImportError as e:  # --replot needs only matplotlib
    torch = None
    _import_error = e

METHODS = ("qattn", "qattn_kernel", "sdpa_cudnn", "sdpa_flash", "qattn_same_work",
           "qattn_padded", "sdpa_efficient", "flash_varlen", "cudnn_varlen", "qattn_checked",
           "qattn_graph", "sdpa_cudnn_graph")
TABLE_METHODS = METHODS[:5]  # always in the table; the varlen methods only where they ran
L2_FALLBACK_BYTES = 60 << 20  # H200

# The varlen pack: these lengths VARLEN_REPEATS times (16 sequences, 16,330 tokens), from
# a whole 4K sequence down to one of 37 tokens (below every tile), seeded order.
VARLEN_LENGTHS = (4096, 2048, 1024, 512, 256, 128, 64, 37)
VARLEN_REPEATS = 2
VARLEN_SEED = 0
# The uniform pack: 4 sequences of 4096 tokens (a dense B = 4 call does the same work).
VARLEN_UNIFORM_N, VARLEN_UNIFORM_SEQS = 4096, 4
# cuDNN's varlen forward as torch's own varlen_attn gates it (cuDNN >= 9.18, SM90/SM100).
CUDNN_VARLEN_MIN_VERSION = 91800


@dataclass
class Shape:
    name: str  # "grid" or a model label
    batch: int
    heads: int
    heads_kv: int
    n: int
    d: int
    causal: bool
    window: Tuple[int, int] = (-1, -1)  # sliding window (left, right); -1: no bound
    kv_len: int = 0  # key padding: every batch entry's keys from kv_len on hidden; 0: none
    # An attn_mask given to every method: "padding" (B, 1, 1, N), the first N/2 keys of
    # each batch entry; "documents" (N, N), causal packed documents of 1024 tokens (both
    # boolean); "alibi" (1, H, N, N), ALiBi's bias under the causal rule as an additive mask
    # in the inputs' dtype (-inf above the diagonal); "alibi_shared" head 0's of it as
    # (1, 1, N, N); "bias" (1, H, N, N) a finite per-head bias on every score (a relative
    # position bias: qattn's costliest additive case, every tile read); "lowest" (B, 1, N, N)
    # transformers' causal mask of a batch, 0 where a query sees a key and bf16's lowest
    # elsewhere.
    bool_mask: str = ""
    # A varlen pack: the sequence lengths (Lq = Lk each); batch = len(lengths), n = the longest.
    lengths: Tuple[int, ...] = ()
    # V's head dim where it is below d (MLA-style 192 / 128); 0: d.
    dv: int = 0

    @property
    def d_v(self) -> int:
        return self.dv or self.d

    @property
    def mask(self) -> str:
        if self.lengths:
            return "varlen"
        if self.bool_mask in ADDITIVE_MASKS:
            return "additive"
        if self.bool_mask:
            return "bool"
        if self.kv_len:
            return "key_padding"
        if self.window != (-1, -1):
            return "sliding_window"
        return "causal" if self.causal else "none"

    @property
    def tokens(self) -> int:
        """Real query tokens: the pack's for varlen, B·N otherwise."""
        return sum(self.lengths) if self.lengths else self.batch * self.n


@dataclass
class Row:
    method: str
    shape: str
    d: int
    causal: bool
    n: int
    batch: int
    heads: int
    heads_kv: int
    tops: Optional[float]
    ms: Optional[float]
    ms_passes: List[float] = field(default_factory=list)
    iters: int = 0
    cossim_vs_cudnn: Optional[float] = None
    note: str = ""
    mask: str = "none"
    d_v: int = 0
    tokens: int = 0  # real query tokens (varlen: the pack's, no padding; else B·N)
    seqs: int = 0  # sequences (varlen: in the pack; else B)
    host_us: Optional[float] = None  # --graph: the CPU time of one call (enqueueing only)


def standard_grid(quick: bool) -> List[Shape]:
    ns = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    ds = [128] if quick else [64, 128]
    return [Shape("grid", 4, 32, 32, n, d, c) for d in ds for c in (False, True) for n in ns]


def head_dim_256_shapes(quick: bool) -> List[Shape]:
    """d = 256 (issue 21; the head-dim-256 kernel, sage2_wide_sm90) beside the baselines:
    the target is >= 1.3x cuDNN BF16 end-to-end at N >= 4K."""
    ns = (4096, 8192, 16384) if quick else (1024, 4096, 8192, 16384)
    return [Shape("grid", 4, 32, 32, n, 256, c) for c in (False, True) for n in ns]


def mla_shapes(quick: bool) -> List[Shape]:
    """MLA-style prefill (Q·K over 192 channels, V over 128, as DeepSeek-V3's 128 heads)
    beside the baselines that take V's own head dim."""
    ns = (4096, 8192) if quick else (1024, 4096, 8192, 16384)
    return [Shape("mla_prefill", 1, 128, 128, n, 192, True, dv=128) for n in ns]


def model_shapes(quick: bool) -> List[Shape]:
    shapes = [Shape("image_dit", 1, 24, 24, 4608, 128, False)]  # 72x64 latent patches
    if quick:
        return shapes + [Shape("llm_prefill_gqa", 1, 32, 8, 8192, 128, True)]
    return shapes + [
        Shape("video_dit_17k", 1, 24, 24, 17776, 128, False),  # ~CogVideoX 5B, 49 frames
        Shape("video_dit_75k", 1, 24, 24, 75600, 128, False),  # ~HunyuanVideo 720p
        Shape("llm_prefill_gqa", 1, 32, 8, 8192, 128, True),
        Shape("llm_prefill_gqa", 1, 32, 8, 32768, 128, True),
    ]


ADDITIVE_MASKS = ("alibi", "alibi_shared", "bias", "lowest")


def mask_shapes(quick: bool) -> List[Shape]:
    shapes = [Shape("key_padding", 4, 32, 32, 8192, 128, False, kv_len=4096),
              Shape("sliding_window", 1, 32, 8, 16384, 128, True, window=(4096, 0)),
              Shape("bool_padding", 4, 32, 32, 8192, 128, False, bool_mask="padding"),
              Shape("bool_documents", 1, 32, 8, 8192, 128, False, bool_mask="documents"),
              # An additive mask beside the causal call doing the same work.
              Shape("alibi_causal", 1, 32, 32, 4096, 128, False, bool_mask="alibi"),
              Shape("alibi_shared", 1, 32, 32, 4096, 128, False, bool_mask="alibi_shared"),
              Shape("bias_per_head", 1, 32, 32, 4096, 128, False, bool_mask="bias"),
              Shape("lowest_causal", 2, 32, 32, 4096, 128, False, bool_mask="lowest"),
              Shape("causal", 1, 32, 32, 4096, 128, True)]
    if quick:
        return shapes
    return shapes + [
        Shape("key_padding", 4, 32, 32, 4096, 64, False, kv_len=3000),
        Shape("sliding_window", 4, 32, 32, 8192, 128, False, window=(512, 512)),
        Shape("bool_padding", 4, 32, 32, 4096, 64, False, bool_mask="padding"),
        Shape("bool_documents", 1, 32, 8, 16384, 128, False, bool_mask="documents"),
    ]


def varlen_lengths(seed: int = VARLEN_SEED) -> Tuple[int, ...]:
    """The pack's sequence lengths: VARLEN_LENGTHS VARLEN_REPEATS times, seeded order."""
    lengths = list(VARLEN_LENGTHS) * VARLEN_REPEATS
    random.Random(seed).shuffle(lengths)
    return tuple(lengths)


def varlen_shapes(quick: bool) -> List[Shape]:
    lengths = varlen_lengths()

    def pack(name: str, heads_kv: int, d: int) -> Shape:
        return Shape(name, len(lengths), 32, heads_kv, max(lengths), d, True, lengths=lengths)

    shapes = [pack("varlen", 32, 128)]
    if quick:
        return shapes
    # And a pack of equal sequences, whose work a dense call does too (qattn_same_work:
    # the varlen kernel's own cost, issue target <= 5%).
    uniform = (VARLEN_UNIFORM_N,) * VARLEN_UNIFORM_SEQS
    same = [Shape("varlen_uniform", len(uniform), 32, 32, VARLEN_UNIFORM_N, d, True,
                  lengths=uniform) for d in (128, 64)]
    return shapes + [pack("varlen", 32, 64), pack("varlen_gqa", 8, 128)] + same


def visible_pairs(s: Shape) -> float:
    """(query, key) pairs the shape's mask leaves visible, per head (Nq = Nkv = n); for a
    varlen pack, per head summed over its sequences."""
    if s.lengths:
        return float(sum(n * (n + 1) // 2 if s.causal else n * n for n in s.lengths))
    if s.mask == "none":
        return float(s.n) * s.n
    if s.mask == "causal":
        return s.n * (s.n + 1) / 2.0
    if s.kv_len:
        return float(s.n) * s.kv_len
    if s.bool_mask:
        m = sdpa_mask(s)
        if m.dtype != torch.bool:  # additive: the keys neither -inf nor saturated (bf16's lowest)
            return float((m[:1, :1].float() > -2.3e38).sum())
        return float(m.expand(s.batch, 1, s.n, s.n).sum()) / s.batch
    i = torch.arange(s.n, dtype=torch.float64)
    left, right = s.window
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = i if s.causal else ((i + right).clamp(max=s.n - 1) if right >= 0 else torch.full_like(i, s.n - 1))
    return float((hi - lo + 1).sum())


def tera_ops(s: Shape) -> float:
    """2·(d + d_v) operations per visible (query, key) pair: 4·d where V has Q's head dim."""
    per_pair = 2.0 * (s.d + s.d_v)
    if s.mask == "none" or s.mask == "causal":  # the grid's convention: causal halves
        ops = per_pair * s.batch * s.heads * s.n * s.n
        return (ops / 2 if s.causal else ops) / 1e12
    if s.lengths:  # the pack's real work, whoever pads it
        return per_pair * s.heads * visible_pairs(s) / 1e12
    return per_pair * s.batch * s.heads * visible_pairs(s) / 1e12


def sdpa_mask(s: Shape):
    """The shape's mask as SDPA's boolean attn_mask (True = attend), or None; for a varlen
    pack, the right-padded batch's (B, 1, N, N): key padding, and causal per sequence."""
    if s.lengths:
        i = torch.arange(s.n, device="cuda")[:, None]
        j = torch.arange(s.n, device="cuda")[None, :]
        lengths = torch.tensor(s.lengths, device="cuda").view(-1, 1, 1, 1)
        m = j < lengths
        return (m & (j <= i) if s.causal else m.expand(-1, 1, s.n, -1)).contiguous()
    if s.bool_mask == "padding":
        return (torch.arange(s.n, device="cuda") < s.n // 2).view(1, 1, 1, s.n).expand(s.batch, 1, 1, s.n)
    if s.bool_mask in ADDITIVE_MASKS:
        i = torch.arange(s.n, device="cuda")[:, None]
        j = torch.arange(s.n, device="cuda")[None, :]
        slopes = torch.tensor([2.0 ** -(8 * (h + 1) / s.heads) for h in range(s.heads)],
                              device="cuda").view(s.heads, 1, 1)
        if s.bool_mask == "lowest":  # transformers' 0 / lowest causal mask, one per batch entry
            low = torch.finfo(torch.bfloat16).min
            m = torch.zeros(s.n, s.n, device="cuda").masked_fill(j > i, low).to(torch.bfloat16)
            return m.view(1, 1, s.n, s.n).expand(s.batch, 1, s.n, s.n).contiguous()
        if s.bool_mask == "bias":  # finite everywhere, distinct per head
            return (-slopes * (i - j).abs().float() / 64).view(1, s.heads, s.n, s.n).to(torch.bfloat16)
        bias = (-slopes * (i - j).float()).masked_fill(j > i, float("-inf"))
        if s.bool_mask == "alibi_shared":
            bias = bias[:1]
        return bias.view(1, -1, s.n, s.n).to(torch.bfloat16)
    if s.bool_mask == "documents":
        i = torch.arange(s.n, device="cuda")[:, None]
        j = torch.arange(s.n, device="cuda")[None, :]
        return ((i // 1024 == j // 1024) & (j <= i)).view(1, 1, s.n, s.n)
    if s.kv_len:
        return (torch.arange(s.n, device="cuda") < s.kv_len).view(1, 1, 1, s.n).expand(s.batch, 1, 1, s.n)
    if s.window == (-1, -1):
        return None
    i = torch.arange(s.n, device="cuda")[:, None]
    j = torch.arange(s.n, device="cuda")[None, :]
    left, right = s.window
    m = torch.ones(s.n, s.n, dtype=torch.bool, device="cuda")
    if left >= 0:
        m &= j >= i - left
    if s.causal:
        m &= j <= i
    elif right >= 0:
        m &= j <= i + right
    return m.view(1, 1, s.n, s.n)


# ---- timing ----------------------------------------------------------------------------


def time_fn(fn: Callable[[int], object], *, warmup: int, min_iters: int, max_iters: int,
            budget_s: float, passes: int = 2):
    """Median milliseconds of each pass of `fn(i)` (i = call index, for rotation)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    stop.record()
    stop.synchronize()
    est_ms = max(start.elapsed_time(stop), 1e-3)
    iters = int(min(max_iters, max(min_iters, budget_s * 1e3 / est_ms)))
    medians = []
    for _ in range(passes):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record()
            fn(i)
            stops[i].record()
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in zip(starts, stops))
        medians.append(ms[len(ms) // 2] if len(ms) % 2 else 0.5 * (ms[len(ms) // 2 - 1] + ms[len(ms) // 2]))
    return medians, iters


def time_graph(fn: Callable[[int], object], *, calls: int, warmup: int, replays: int = 10,
               passes: int = 2):
    """Median milliseconds per call of `calls` calls of fn captured in one CUDA graph, for
    each pass of `replays` replays: the GPU time without the host's part (launch
    overheads between kernels remain, as in any graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as capture requires
        for i in range(warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    medians = []
    for _ in range(passes):
        ms = []
        for _ in range(replays):
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            ms.append(start.elapsed_time(stop) / calls)
        ms.sort()
        medians.append(ms[len(ms) // 2] if len(ms) % 2 else 0.5 * (ms[len(ms) // 2 - 1] + ms[len(ms) // 2]))
    del graph
    return medians, calls * replays


def graphed(s: Shape, args) -> bool:
    """Whether --graph times this shape: up to --graph-max-n (the lengths where the host's
    part matters; a graph keeps every captured call's output and workspace alive)."""
    return args.graph and s.n <= args.graph_max_n


def host_us(fn: Callable[[int], object], iters: int = 50) -> float:
    """Median CPU microseconds of one call of fn, timed around the call alone (the GPU
    runs behind; 50 calls stay well inside the launch queue)."""
    torch.cuda.synchronize()
    us = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        us.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    us.sort()
    return us[len(us) // 2]


def input_sets(s: Shape, l2_bytes: int, seed: int = 0):
    """Random normal bf16 (q, k, v) sets in HND; several when one set fits in L2."""
    set_bytes = 2 * (s.batch * s.heads * s.n * s.d * 2 + s.batch * s.heads_kv * s.n * (s.d + s.d_v))
    count = 1 if set_bytes >= 2 * l2_bytes else min(8, math.ceil(3 * l2_bytes / set_bytes))
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        q = torch.randn(s.batch, s.heads, s.n, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(s.batch, s.heads_kv, s.n, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(s.batch, s.heads_kv, s.n, s.d_v, device="cuda", dtype=torch.bfloat16, generator=g)
        sets.append((q, k, v))
    return sets


def cossim(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def measure_shape(s: Shape, args, l2_bytes: int) -> List[Row]:
    if s.lengths:
        return measure_varlen(s, args, l2_bytes)
    sets = input_sets(s, l2_bytes)
    n_sets = len(sets)
    gqa = s.heads != s.heads_kv
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters,
                  budget_s=args.budget_s)
    rows = []

    def row(method, medians=None, iters=0, note=""):
        ms = min(medians) if medians else None
        r = Row(method, s.name, s.d, s.causal, s.n, s.batch, s.heads, s.heads_kv,
                tera_ops(s) / (ms * 1e-3) if ms else None, ms, medians or [], iters, note=note,
                mask=s.mask, d_v=s.d_v, tokens=s.tokens, seqs=s.batch)
        rows.append(r)
        return r

    # Baselines see K/V expanded to Hq heads for GQA (expanded before timing).
    def sdpa_inputs(i):
        q, k, v = sets[i % n_sets]
        if gqa:
            k, v = (t.repeat_interleave(s.heads // s.heads_kv, dim=1) for t in (k, v))
        return q, k, v

    base_sets = [sdpa_inputs(i) for i in range(n_sets)]
    masked = s.mask not in ("none", "causal")
    attn_mask = sdpa_mask(s) if masked else None
    # SDPA takes a mask or is_causal, not both: the mask holds the causal part.
    sdpa_args = dict(attn_mask=attn_mask) if masked else dict(is_causal=s.causal)
    ref = None
    for method, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        if method not in args.methods:
            continue
        if args.skip_baseline_above and s.n > args.skip_baseline_above:
            row(method, note=f"skipped: N > {args.skip_baseline_above} (--skip-baseline-above)")
            continue
        # With a mask or V's own head dim, cuDNN first and SDPA's memory-efficient backend
        # where cuDNN refuses it.
        own_dv = s.d_v != s.d
        backends = [backend] + ([SDPBackend.EFFICIENT_ATTENTION]
                                if (masked or own_dv) and method == "sdpa_cudnn" else [])
        errors = []
        for be in backends:
            try:
                with sdpa_kernel(be):
                    fn = lambda i: F.scaled_dot_product_attention(*base_sets[i % n_sets], **sdpa_args)  # noqa: E731
                    out = fn(0)
                    if method == "sdpa_cudnn":
                        ref = out
                    medians, iters = time_fn(fn, **timing)
                notes = ["K/V expanded to Hq heads"] if gqa else []
                if masked or own_dv:
                    notes.append(("boolean attn_mask, " if masked else f"d_v = {s.d_v}, ")
                                 + f"{be.name} backend" + (f" (cuDNN: {errors[0]})" if errors else ""))
                # A row is named after the backend that ran: cuDNN's refusal makes it
                # SDPA's memory-efficient row, never a cuDNN one.
                ran = "sdpa_efficient" if be == SDPBackend.EFFICIENT_ATTENTION else method
                r = row(ran, medians, iters, "; ".join(notes))
                if graphed(s, args) and ran == "sdpa_cudnn" and not masked:
                    r.host_us = host_us(fn)
                    medians, iters = time_graph(fn, calls=args.graph_calls, warmup=args.warmup)
                    row("sdpa_cudnn_graph", medians, iters,
                        f"CUDA graph of {args.graph_calls} calls, per call")
                break
            except RuntimeError as e:  # backend refuses the shape
                errors.append(str(e).splitlines()[0][:120])
        else:
            row(method, note=f"unavailable: {'; '.join(errors)[:240]}")
        torch.cuda.empty_cache()

    if s.d > 256:  # no qattn kernel: the baselines alone
        for method in ("qattn", "qattn_kernel"):
            if method in args.methods:
                row(method, note="not run: qattn runs head dims up to 256")
        del sets, base_sets, ref
        torch.cuda.empty_cache()
        return rows
    mask_kwargs = {}
    if s.window != (-1, -1):
        mask_kwargs["window_size"] = s.window
    if s.kv_len:
        mask_kwargs["kv_lengths"] = torch.full((s.batch,), s.kv_len, dtype=torch.int32, device="cuda")
    if "qattn" in args.methods and s.bool_mask:  # the SDPA drop-in with the same boolean mask
        fn = lambda i: qattn.scaled_dot_product_attention(  # noqa: E731
            *sets[i % n_sets], attn_mask=attn_mask, enable_gqa=gqa)
        out = fn(0)
        medians, iters = time_fn(fn, **timing)
        r = row("qattn", medians, iters, f"{s.mask} attn_mask through the SDPA drop-in")
        if ref is not None:
            r.cossim_vs_cudnn = cossim(out, ref)
    elif "qattn" in args.methods:
        fn = lambda i: qattn.attention(*sets[i % n_sets], is_causal=s.causal, **mask_kwargs)  # noqa: E731
        out = fn(0)
        medians, iters = time_fn(fn, **timing)
        r = row("qattn", medians, iters, f"{n_sets} rotating input sets" if n_sets > 1 else "")
        if ref is not None:
            r.cossim_vs_cudnn = cossim(out, ref)
        if graphed(s, args) and not mask_kwargs:
            r.host_us = host_us(fn)
            medians, iters = time_graph(fn, calls=args.graph_calls, warmup=args.warmup)
            row("qattn_graph", medians, iters, f"CUDA graph of {args.graph_calls} calls, per call")
    if "qattn_same_work" in args.methods and s.bool_mask == "padding":
        lengths = torch.full((s.batch,), s.n // 2, dtype=torch.int32, device="cuda")
        fn = lambda i: qattn.attention(*sets[i % n_sets], kv_lengths=lengths)  # noqa: E731
        fn(0)
        medians, iters = time_fn(fn, **timing)
        row("qattn_same_work", medians, iters, "the same mask as kv_lengths (no mask read)")
    if "qattn_same_work" in args.methods and s.kv_len:
        cut = [(q, k[:, :, :s.kv_len], v[:, :, :s.kv_len]) for q, k, v in sets]
        fn = lambda i: qattn.attention(*cut[i % n_sets], is_causal=s.causal)  # noqa: E731
        fn(0)
        medians, iters = time_fn(fn, **timing)
        row("qattn_same_work", medians, iters, f"no mask, the first {s.kv_len} keys")
    if masked:  # the kernel-only hook runs no mask
        del sets, base_sets, ref
        torch.cuda.empty_cache()
        return rows
    if "qattn_kernel" in args.methods:
        run = qattn.attention_kernel_only(*sets[0], is_causal=s.causal)
        medians, iters = time_fn(lambda i: run(), **timing)
        row("qattn_kernel", medians, iters, "one workspace (inputs quantized once)")
    del sets, base_sets, ref
    torch.cuda.empty_cache()
    return rows


# ---- varlen ---------------------------------------------------------------------------


def varlen_input_sets(s: Shape, l2_bytes: int, seed: int = 0):
    """Random normal bf16 packed (q, k, v) sets, (tokens, H, d); several when one fits in L2."""
    set_bytes = 2 * s.tokens * s.d * (s.heads + 2 * s.heads_kv)
    count = 1 if set_bytes >= 2 * l2_bytes else min(8, math.ceil(3 * l2_bytes / set_bytes))
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [tuple(torch.randn(s.tokens, h, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
                  for h in (s.heads, s.heads_kv, s.heads_kv)) for _ in range(count)]


def pad_pack(t: torch.Tensor, lengths: Tuple[int, ...], n: int, g) -> torch.Tensor:
    """A packed (tokens, H, d) tensor as the right-padded (B, H, n, d) batch; the padding is
    random normal too (no method may read it as zeros)."""
    out = torch.randn(len(lengths), t.shape[1], n, t.shape[2], device=t.device, dtype=t.dtype, generator=g)
    start = 0
    for b, length in enumerate(lengths):
        out[b, :, :length] = t[start:start + length].transpose(0, 1)
        start += length
    return out


def unpad(o: torch.Tensor, lengths: Tuple[int, ...]) -> torch.Tensor:
    """The real rows of a right-padded (B, H, n, d) output, packed as (tokens, H, d)."""
    return torch.cat([o[b, :, :length].transpose(0, 1) for b, length in enumerate(lengths)])


def kernel_names(fn: Callable[[int], object], top: int = 2) -> str:
    """The CUDA kernels one call of fn runs, longest first (which backend really ran);
    "" where the profiler gives none."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(0)
            torch.cuda.synchronize()
        times = {}
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            t = getattr(e, "self_cuda_time_total", 0) if t is None else t
            if t > 0:
                times[e.key] = times.get(e.key, 0) + t
        names = sorted(times, key=times.get, reverse=True)[:top]
        return ", ".join(n if len(n) <= 90 else n[:87] + "..." for n in names)
    except Exception as e:  # a diagnostic only: the row stays
        return f"(kernel names unavailable: {type(e).__name__})"


def aten_varlen_op(name: str):
    """torch.ops.aten.<name> where its schema takes cum_seq_q/cum_seq_k, else None."""
    try:
        op = getattr(torch.ops.aten, name)
        return op if "cum_seq_q" in str(op.default._schema) else None
    except (AttributeError, RuntimeError):
        return None


def cudnn_varlen_refusal() -> str:
    """Why cuDNN varlen is not run here ("" where it is): torch's own gate."""
    if aten_varlen_op("_cudnn_attention_forward") is None:
        return f"torch {torch.__version__} has no aten._cudnn_attention_forward with cum_seq_q/k"
    version = torch.backends.cudnn.version() or 0
    major = torch.cuda.get_device_capability()[0]
    if version < CUDNN_VARLEN_MIN_VERSION or major not in (9, 10):
        return (f"cuDNN {version} on SM{major}x: torch routes varlen to cuDNN from cuDNN "
                f"{CUDNN_VARLEN_MIN_VERSION} on SM90/SM100 only")
    return ""


def measure_varlen(s: Shape, args, l2_bytes: int) -> List[Row]:
    """One varlen pack: packed methods on the pack, padded ones on the right-padded batch;
    every TOPS from the pack's real work (tera_ops)."""
    sets = varlen_input_sets(s, l2_bytes)
    n_sets = len(sets)
    gqa = s.heads != s.heads_kv
    group = s.heads // s.heads_kv
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters,
                  budget_s=args.budget_s)
    cu = torch.tensor([0] + [sum(s.lengths[:b + 1]) for b in range(s.batch)], dtype=torch.int32,
                      device="cuda")
    pack = f"{s.batch} sequences, {s.tokens} tokens, longest {s.n}"
    padded = f"right-padded batch B={s.batch} N={s.n} ({s.batch * s.n} tokens)"
    rows, outs = [], {}

    def row(method, medians=None, iters=0, note=""):
        ms = min(medians) if medians else None
        r = Row(method, s.name, s.d, s.causal, s.n, s.batch, s.heads, s.heads_kv,
                tera_ops(s) / (ms * 1e-3) if ms else None, ms, medians or [], iters, note=note,
                mask=s.mask, d_v=s.d, tokens=s.tokens, seqs=s.batch)
        rows.append(r)
        return r

    def timed(method, fn, note, kernels=False, unpadded=False):
        """Times fn(i) and keeps its output, packed (unpadded: an untimed unpad first); a
        RuntimeError (a backend refusing the call) leaves the row empty with the reason."""
        try:
            out = fn(0)
            outs[method] = unpad(out, s.lengths) if unpadded else out
            del out
            medians, iters = time_fn(fn, **timing)
        except RuntimeError as e:
            outs.pop(method, None)
            row(method, note=f"unavailable: {str(e).splitlines()[0][:200]}")
            return False
        if kernels:
            note += f"; kernels: {kernel_names(fn)}"
        row(method, medians, iters, note)
        return True

    # FlashAttention varlen and cuDNN varlen on the pack (K/V heads as given: both take GQA).
    flash_op = aten_varlen_op("_flash_attention_forward")
    if "flash_varlen" in args.methods:
        flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        if flash_op is None or not flash_built:
            row("flash_varlen", note=f"unavailable: torch {torch.__version__} has no FlashAttention "
                                     "aten._flash_attention_forward with cum_seq_q/k")
        else:
            timed("flash_varlen",
                  lambda i: flash_op(*sets[i % n_sets], cu, cu, s.n, s.n, 0.0, s.causal, False)[0],
                  f"aten._flash_attention_forward with cum_seq_q/k on the pack ({pack})", kernels=True)
    if "cudnn_varlen" in args.methods:
        refusal = cudnn_varlen_refusal()
        if refusal:
            row("cudnn_varlen", note=f"not run: {refusal}")
        else:
            cudnn_op = aten_varlen_op("_cudnn_attention_forward")
            timed("cudnn_varlen",
                  lambda i: cudnn_op(*sets[i % n_sets], None, cu, cu, s.n, s.n, True, 0.0, s.causal)[0],
                  f"aten._cudnn_attention_forward with cum_seq_q/k on the pack ({pack}), LSE on "
                  "(as varlen_attn asks)", kernels=True)
    torch.cuda.empty_cache()

    if "qattn" in args.methods:
        fn = lambda i: qattn.varlen_attention(*sets[i % n_sets], cu, cu, s.n, s.n, causal=s.causal)  # noqa: E731
        timed("qattn", fn, f"qattn.varlen_attention on the pack ({pack}), one varlen-kernel call; "
              "host time included"
              + (f"; {n_sets} rotating input sets" if n_sets > 1 else ""))
    if "qattn_same_work" in args.methods and len(set(s.lengths)) == 1:
        # Equal sequences: the pack is a dense (B, N, H, d) NHD batch in the same memory.
        def dense(t):
            return t.view(s.batch, s.n, t.shape[1], t.shape[2])

        timed("qattn_same_work",
              lambda i: qattn.attention(*(dense(t) for t in sets[i % n_sets]), is_causal=s.causal,
                                        layout="NHD"),
              f"qattn.attention on the pack as a dense B={s.batch} N={s.n} NHD batch (the same "
              "work without the varlen plan)")
    if "qattn_checked" in args.methods:
        fn = lambda i: qattn.varlen_attention(*sets[i % n_sets], cu, cu, s.n, s.n, causal=s.causal,  # noqa: E731
                                              check_offsets=True)
        timed("qattn_checked", fn, f"qattn.varlen_attention(check_offsets=True) on the pack "
              f"({pack}): the offsets read and checked on the host first; host time included"
              + (f"; {n_sets} rotating input sets" if n_sets > 1 else ""))

    # The right-padded batch (HND, random padding), for SDPA with a mask and qattn with kv_lengths.
    g = torch.Generator(device="cuda").manual_seed(1)
    padded_sets = [tuple(pad_pack(t, s.lengths, s.n, g) for t in qkv) for qkv in sets]
    if "sdpa_cudnn" in args.methods or "sdpa_efficient" in args.methods:
        attn_mask = sdpa_mask(s)
        base_sets = [(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) if gqa
                     else (q, k, v) for q, k, v in padded_sets]
        note = (f"SDPA over the {padded}, boolean attn_mask (B, 1, N, N): key padding"
                + (" and causal" if s.causal else "") + ("; K/V expanded to Hq heads" if gqa else ""))
        refused = ""
        for method, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                                ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            if method not in args.methods:
                continue
            if method == "sdpa_efficient" and "sdpa_cudnn" in args.methods and not refused:
                break  # cuDNN ran: the memory-efficient backend is not timed too
            def fn(i, backend=backend):
                with sdpa_kernel(backend):  # this backend alone: SDPA raises where it refuses
                    return F.scaled_dot_product_attention(*base_sets[i % n_sets], attn_mask=attn_mask)

            ok = timed(method, fn, f"{note}; {backend.name} backend"
                       + (f" (cuDNN refused the mask: {refused})" if refused else ""),
                       kernels=True, unpadded=True)
            if method == "sdpa_cudnn" and not ok:
                refused = rows[-1].note[len("unavailable: "):][:120]
        del base_sets, attn_mask
        torch.cuda.empty_cache()
    if "qattn_padded" in args.methods:
        lengths = torch.tensor(s.lengths, dtype=torch.int32, device="cuda")
        timed("qattn_padded",
              lambda i: qattn.attention(*padded_sets[i % n_sets], is_causal=s.causal, kv_lengths=lengths),
              f"qattn.attention over the {padded}, kv_lengths; the padding query rows are computed too",
              unpadded=True)

    # Every output against cuDNN's (the row's cossim_vs_cudnn) and FlashAttention's (in the note).
    cudnn_ref = outs.get("sdpa_cudnn", outs.get("cudnn_varlen"))
    for r in rows:
        out = outs.get(r.method)
        if out is None:
            continue
        if cudnn_ref is not None and r.method.startswith("qattn"):
            r.cossim_vs_cudnn = cossim(out, cudnn_ref)
        if "flash_varlen" in outs and r.method != "flash_varlen":
            r.note += f"; CosSim to flash_varlen {cossim(out, outs['flash_varlen']):.5f}"
    del sets, padded_sets, outs, cudnn_ref
    torch.cuda.empty_cache()
    return rows


# ---- environment, output -----------------------------------------------------------


def nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i",
                              str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_id(explicit: str) -> str:
    if explicit:
        return explicit
    if os.environ.get("QATTN_COMMIT"):
        return os.environ["QATTN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def clock_env() -> dict:
    """The SM clock (max and now) and the driver, from nvidia-smi (None / "" if absent)."""
    smi = nvidia_smi("clocks.max.sm,clocks.sm,driver_version").split(", ")
    return {
        "sm_clock_mhz": int(smi[0]) if smi and smi[0].isdigit() else None,
        "sm_clock_now_mhz": int(smi[1]) if len(smi) > 1 and smi[1].isdigit() else None,
        "driver": smi[2] if len(smi) > 2 else "",
    }


def environment(args) -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        **clock_env(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "qattn": qattn.__version__,
        "commit": commit_id(args.commit),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "sm_count": props.multi_processor_count,
        "dtype": "bf16",
        "layout": "HND",
        "timing": f"CUDA events per call, {args.warmup} warm-up, median of each of 2 passes of "
                  f"{args.min_iters}..{args.max_iters} calls (~{args.budget_s}s), ms = lower median",
    }


def plot(rows: List[Row], path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r.shape == "grid" and r.tops]
    keys = sorted({(r.d, r.causal) for r in grid})
    if not keys:
        return
    ds = sorted({d for d, _ in keys})
    fig, axes = plt.subplots(len(ds), 2, figsize=(9, 3.6 * len(ds)), squeeze=False)
    for (d, causal) in keys:
        ax = axes[ds.index(d)][int(causal)]
        for method in METHODS:
            pts = sorted((r.n, r.tops) for r in grid if r.method == method and r.d == d and r.causal == causal)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ns = sorted({r.n for r in grid})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in ns])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TOPS")
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Forward attention, B=4 H=32 bf16, {env['gpu']} (commit {env['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: List[Row]) -> None:
    methods = list(TABLE_METHODS) + [m for m in METHODS[len(TABLE_METHODS):] if any(r.method == m for r in rows)]
    width = {m: 14 if m in TABLE_METHODS else max(14, len(m) + 1) for m in methods}
    configs = []
    for r in rows:
        key = (r.shape, r.batch, r.heads, r.heads_kv, r.d, r.causal, r.n)
        if key not in configs:
            configs.append(key)
    print(f"\n{'shape':<16}{'B':>3}{'Hq':>4}{'Hkv':>4}{'d':>5}{'causal':>7}{'N':>7}"
          + "".join(f"{m:>{width[m]}}" for m in methods) + f"{'cos':>9}")
    for key in configs:
        cells, cos = [], ""
        for m in methods:
            r = next((r for r in rows if (r.shape, r.batch, r.heads, r.heads_kv, r.d, r.causal, r.n) == key
                      and r.method == m), None)
            cells.append(f"{r.tops:{width[m]}.1f}" if r and r.tops else f"{'-':>{width[m]}}")
            if r and r.cossim_vs_cudnn is not None and not cos:  # qattn's first (varlen: not qattn_padded's)
                cos = f"{r.cossim_vs_cudnn:9.5f}"
        shape, b, h, hkv, d, causal, n = key
        print(f"{shape:<16}{b:>3}{h:>4}{hkv:>4}{d:>5}{int(causal):>7}{n:>7}" + "".join(cells) + cos)
    print("(TOPS; cos = CosSim of qattn's output to cuDNN's)")
    host = [r for r in rows if r.host_us is not None]
    if host:
        print("CPU time of one call (--graph): "
              + "; ".join(f"{r.method} d={r.d} causal={int(r.causal)} N={r.n}: {r.host_us:.1f} us"
                          for r in host))


def replot(json_path: Path, commit: str) -> int:
    """Redraws the PNG of a results file; with a commit, records it in the file first (for
    a run whose machine could not read the commit itself)."""
    data = json.loads(json_path.read_text())
    if commit:
        data["env"]["commit"] = commit
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    rows = [Row(**r) for r in data["rows"]]
    plot(rows, json_path.with_suffix(".png"), data["env"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (~1 minute)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--name", default="forward-h200", help="file name stem of the JSON and PNG")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--no-models", action="store_true", help="no model shapes")
    ap.add_argument("--no-masks", action="store_true", help="no mask shapes")
    ap.add_argument("--masks-only", action="store_true", help="the mask shapes alone")
    ap.add_argument("--varlen", action="store_true", help="add the varlen shapes (packed sequences)")
    ap.add_argument("--varlen-only", action="store_true", help="the varlen shapes alone (~30 s)")
    ap.add_argument("--head-dim-256", action="store_true",
                    help="add d = 256 grid shapes (qattn's head-dim-256 kernel beside the baselines)")
    ap.add_argument("--head-dim-256-only", action="store_true",
                    help="the d = 256 grid shapes alone")
    ap.add_argument("--mla", action="store_true",
                    help="add MLA-style shapes (Q·K 192, V 128, 128 heads, causal)")
    ap.add_argument("--mla-only", action="store_true", help="the MLA-style shapes alone")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-iters", type=int, default=10)
    ap.add_argument("--max-iters", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=0.25, help="target timed seconds per pass")
    ap.add_argument("--skip-baseline-above", type=int, default=0,
                    help="skip the SDPA baselines above this N (0: never)")
    ap.add_argument("--time-limit-s", type=float, default=540,
                    help="stop measuring (and still write the results) after this long")
    ap.add_argument("--graph", action="store_true",
                    help="also time qattn and cuDNN inside a CUDA graph (GPU time without the "
                         "host's part; rows qattn_graph, sdpa_cudnn_graph) and record each "
                         "call's CPU time (host_us) on their plain rows")
    ap.add_argument("--graph-calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--graph-max-n", type=int, default=4096, help="--graph only up to this N")
    ap.add_argument("--commit", default="", help="commit id to record (else $QATTN_COMMIT or git)")
    ap.add_argument("--replot", metavar="JSON",
                    help="only redraw the PNG next to a results file (with --commit: record that commit)")
    args = ap.parse_args()
    if args.replot:
        return replot(Path(args.replot), args.commit)
    if torch is None:
        print(f"bench/forward.py: {_import_error}", file=sys.stderr)
        return 2
    if args.quick:
        args.min_iters, args.max_iters, args.budget_s = 5, 30, 0.1

    if not torch.cuda.is_available():
        print("bench/forward.py: no CUDA device", file=sys.stderr)
        return 2
    if not qattn.device_supported():
        print(f"bench/forward.py: qattn cannot run on {torch.cuda.get_device_name()}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment(args)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    shapes = standard_grid(args.quick) + ([] if args.no_models else model_shapes(args.quick))
    shapes += [] if args.no_masks else mask_shapes(args.quick)
    if args.masks_only:
        shapes = mask_shapes(args.quick)
    if args.head_dim_256:
        shapes += head_dim_256_shapes(args.quick)
    if args.head_dim_256_only:
        shapes = head_dim_256_shapes(args.quick)
    if args.mla:
        shapes += mla_shapes(args.quick)
    if args.mla_only:
        shapes = mla_shapes(args.quick)
    if args.varlen_only:
        shapes = []
    if args.varlen or args.varlen_only:
        shapes += varlen_shapes(args.quick)
        env["varlen"] = {"lengths": list(varlen_lengths()), "recipe": f"{list(VARLEN_LENGTHS)} x {VARLEN_REPEATS}, "
                         f"order shuffled by random.Random({VARLEN_SEED})", "causal": "per sequence",
                         "tops": "4*Hq*d*sum L(L+1)/2 (exact visible pairs), the same for every method",
                         "torch_varlen_attn": importlib.util.find_spec("torch.nn.attention.varlen") is not None}

    t0 = time.time()
    rows: List[Row] = []
    truncated = False
    for i, s in enumerate(shapes):
        if time.time() - t0 > args.time_limit_s:
            truncated = True
            print(f"time limit reached: {len(shapes) - i} shapes not measured", file=sys.stderr)
            break
        new = measure_shape(s, args, l2)
        rows += new
        summary = ", ".join(f"{r.method} {r.tops:.0f}" for r in new if r.tops)
        pack = f" tokens={s.tokens}" if s.lengths else ""
        print(f"[{i + 1}/{len(shapes)} {time.time() - t0:5.0f}s] {s.name} B={s.batch} H={s.heads}/{s.heads_kv} "
              f"N={s.n}{pack} d={s.d} causal={int(s.causal)}: {summary}", file=sys.stderr, flush=True)

    env["wall_s"] = round(time.time() - t0, 1)
    env["truncated"] = truncated
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{args.name}.json", out / f"{args.name}.png"
    json_path.write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    plot(rows, png_path, env)
    print(f"{env['gpu']}, SM clock max {env['sm_clock_mhz']} MHz, driver {env['driver']}, CUDA {env['cuda']}, "
          f"torch {env['torch']}, cuDNN {env['cudnn']}, commit {env['commit']}; wrote {json_path} and {png_path}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
