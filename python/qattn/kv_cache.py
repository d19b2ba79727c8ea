"""qattn.KVCache and qattn.decode: the quantized paged KV cache (docs/kv-cache.md) for
an inference engine, over the C ABI's qattn_kv_append and qattn_kv_decode.

    cache = qattn.KVCache(num_pages=4096, page_size=16, heads_kv=8, head_dim=128,
                          max_seqs=64, max_pages_per_seq=512, format="nvfp4")
    cache.allocate(0, prompt_len)        # hands out free pages, lowest first
    cache.append(k, v, seqs=[0])         # k, v: (1, 8, prompt_len, 128) fp16/bf16
    o = qattn.decode(q, cache, seqs=[0]) # q: (1, 32, nq, 128) -> o of q's shape and dtype

KVCache owns every buffer the C ABI asks the engine for: the page pool (uint8,
num_pages x page_bytes), and per sequence slot (max_seqs of them) a block-table row
(int32, -1 = no page), a length and the K smoothing vectors c (FP32, heads_kv x
head_dim), each on the device with a host mirror of the tables and the lengths. A
call passes the mirrors to the library, which checks every page and length the call
uses before it launches anything; the device work is ordered on the current CUDA
stream and nothing here synchronizes the device. The mirrors are updated when the
work is enqueued, so they describe the cache as it will be once the stream reaches
that point.

A generation loop (one layer; an engine keeps one KVCache per layer with the same
page assignments, or calls allocate on each):

    cache = qattn.KVCache(num_pages=N, heads_kv=Hkv, head_dim=d, max_seqs=B,
                          max_pages_per_seq=N // B)
    for s in range(B):                                  # prefill
        cache.allocate(s, prompt_len[s])
        cache.append(k_prompt[s], v_prompt[s], seqs=[s])  # fixes c from the prompt's keys
    while generating:                                   # decode steps
        for s in running:
            cache.allocate(s, 1)                        # a new page every page_size tokens
        cache.append(k_new, v_new, seqs=running)        # (len(running), Hkv, 1, d)
        o = qattn.decode(q_new, cache, seqs=running)    # (len(running), Hq, 1, d)
        for s in finished:
            cache.reset(s)                              # length 0, its pages free again

The prompt's attention itself is the forward (qattn.attention, causal); the cache
serves the tokens after it. Speculative decoding appends the nq draft tokens, decodes
with nq query rows (causal, aligned bottom-right), and rolls back rejected tokens by
lowering the length with truncate(seq, length).
"""

# No `from __future__ import annotations`: the signatures are read as written.
import contextlib
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .errors import check, invalid
from .ops import _DTYPES, _usable, scale_ok

_FORMATS = {
    "nvfp4": _C.KV_NVFP4,
    "fp8": _C.KV_FP8_E4M3,
    "fp8_e4m3": _C.KV_FP8_E4M3,
    "int8": _C.KV_INT8,
    "bf16": _C.KV_BF16,
}
_FORMAT_NAMES = {_C.KV_NVFP4: "nvfp4", _C.KV_FP8_E4M3: "fp8", _C.KV_INT8: "int8", _C.KV_BF16: "bf16"}

SeqsLike = Union[None, int, Sequence[int], range, torch.Tensor]


def row_bytes(format: str, head_dim: int) -> Tuple[int, int]:
    """(code bytes, scale bytes) of one (token, KV head) row of K (or of V), as
    docs/kv-cache.md's table gives them: NVFP4 (d/2, d/16), FP8 and INT8 (d, 4), BF16
    (2d, 0)."""
    f = _FORMATS[format]
    if f == _C.KV_NVFP4:
        return head_dim // 2, head_dim // 16
    if f in (_C.KV_FP8_E4M3, _C.KV_INT8):
        return head_dim, 4
    return 2 * head_dim, 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        allowed = f"an int >= {lo}" if hi is None else f"an int in {lo}..{hi}"
        raise invalid(f"{name} = {value!r}; allowed: {allowed}")
    return value


def _default_device(device) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise invalid("device = None selects the current CUDA device, but CUDA is not "
                          "available; allowed: a CUDA device (or 'cpu' for a host-only cache)")
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise invalid(f"device = {device}; allowed: a CUDA device (or 'cpu' for a host-only cache)")
    return device


def _on_device(device: torch.device):
    """The library runs on the current device; switch only when the cache lives
    elsewhere (a switch costs host time)."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class KVCache:
    """A quantized paged KV cache of one attention layer (docs/kv-cache.md).

    num_pages pages of page_size token slots, each for all heads_kv KV heads, K and V;
    max_seqs sequence slots, each with a block table of max_pages_per_seq pages (its
    capacity is max_pages_per_seq * page_size tokens; default: the whole pool).
    format: "nvfp4" (4.5 bits per element), "fp8" (E4M3, 8.25), "int8" (8.25) or
    "bf16" (16). smoothing: K is stored as K - c with c per (sequence, KV head) fixed
    by the sequence's first append (the mean of its keys, a 256-token sample) or by
    set_k_smoothing; decode folds q.c back into the LSE, so O is unchanged by c. False
    stores K as it is (c = 0). device: a CUDA device (default: the current one), or
    "cpu" for a cache that can only be inspected (append and decode need CUDA).

    Attributes (device tensors the C ABI reads and writes; change them only through
    the methods, which keep the host mirrors in step): pages, block_tables,
    device_lengths, k_mean.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        *,
        heads_kv: int,
        head_dim: int,
        max_seqs: int = 1,
        max_pages_per_seq: Optional[int] = None,
        format: str = "nvfp4",
        smoothing: bool = True,
        device=None,
    ):
        if format not in _FORMATS:
            raise invalid(f"format = {format!r}; allowed: 'nvfp4', 'fp8', 'int8' or 'bf16'")
        if not isinstance(smoothing, bool):
            raise invalid(f"smoothing = {smoothing!r}; allowed: True or False")
        _check_int("num_pages", num_pages, 1)
        _check_int("page_size", page_size, 1)
        _check_int("heads_kv", heads_kv, 1)
        _check_int("head_dim", head_dim, 1)
        _check_int("max_seqs", max_seqs, 1)
        if max_pages_per_seq is None:
            max_pages_per_seq = num_pages
        _check_int("max_pages_per_seq", max_pages_per_seq, 1)
        self._format = _FORMATS[format]
        self.heads_kv, self.head_dim = heads_kv, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.max_seqs, self.max_pages_per_seq = max_seqs, max_pages_per_seq
        self.smoothing = smoothing
        self.device = _default_device(device)
        status, page_bytes = _C.kv_cache_page_bytes(self._cache_arg(0))
        check(status)  # the library's own check of the format and sizes, with its message
        self.page_bytes = page_bytes
        self.contiguous_layout = False

        dev = self.device
        # Zeroed, as the emulation's pool: padding is never read, but bytes compare equal.
        self.pages = torch.zeros(num_pages * page_bytes, dtype=torch.uint8, device=dev)
        self.block_tables = torch.full((max_seqs, max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self.device_lengths = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.k_mean = torch.zeros(max_seqs, heads_kv, head_dim, dtype=torch.float32, device=dev)
        self._host_tables = torch.full((max_seqs, max_pages_per_seq), -1, dtype=torch.int32)
        self._host_lengths = torch.zeros(max_seqs, dtype=torch.int32)
        self._k_preset = [False] * max_seqs  # c set by set_k_smoothing, not yet used
        self._page_refs = torch.zeros(num_pages, dtype=torch.int32)  # block-table entries per page

    @classmethod
    def contiguous(
        cls,
        max_seqs: int,
        capacity: int,
        *,
        heads_kv: int,
        head_dim: int,
        format: str = "nvfp4",
        smoothing: bool = True,
        device=None,
    ) -> "KVCache":
        """The contiguous layout: one page of `capacity` tokens per sequence slot, block
        table [s] = {s} (docs/kv-cache.md, Layouts). reset keeps the pages."""
        c = cls(max_seqs, capacity, heads_kv=heads_kv, head_dim=head_dim, max_seqs=max_seqs,
                max_pages_per_seq=1, format=format, smoothing=smoothing, device=device)
        rows = torch.arange(max_seqs, dtype=torch.int32)[:, None]
        c._host_tables.copy_(rows)
        c._page_refs.fill_(1)
        c._upload(c.block_tables, rows)
        c.contiguous_layout = True
        return c

    # ---- what it is ------------------------------------------------------------------

    @property
    def format(self) -> str:
        """"nvfp4", "fp8", "int8" or "bf16"."""
        return _FORMAT_NAMES[self._format]

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: max_pages_per_seq * page_size."""
        return self.max_pages_per_seq * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of a sequence takes in the pages, K and V of every KV head
        (codes and scales, without the page's alignment padding): 2 * heads_kv * 72 for
        NVFP4 at d = 128, 2 * heads_kv * 132 for FP8 and INT8, 2 * heads_kv * 256 for BF16."""
        codes, scales = row_bytes(self.format, self.head_dim)
        return 2 * self.heads_kv * (codes + scales)

    @property
    def lengths(self) -> torch.Tensor:
        """The tokens cached per sequence slot (a host int32 copy of the mirror)."""
        return self._host_lengths.clone()

    @property
    def host_block_tables(self) -> torch.Tensor:
        """The block tables (a host int32 copy of the mirror; -1 = no page)."""
        return self._host_tables.clone()

    @property
    def num_free_pages(self) -> int:
        """Pages no block table refers to."""
        return int((self._page_refs == 0).sum())

    def __repr__(self) -> str:
        return (f"KVCache(format={self.format!r}, num_pages={self.num_pages}, page_size={self.page_size}, "
                f"heads_kv={self.heads_kv}, head_dim={self.head_dim}, max_seqs={self.max_seqs}, "
                f"max_pages_per_seq={self.max_pages_per_seq}, smoothing={self.smoothing}, "
                f"device={self.device}, page_bytes={self.page_bytes})")

    # ---- pages and sequences -----------------------------------------------------------

    def _check_seq(self, fn: str, seq) -> int:
        if not _is_int(seq) or not 0 <= seq < self.max_seqs:
            raise invalid(f"{fn}: seq = {seq!r}; allowed: an int in 0..{self.max_seqs - 1} "
                          f"(max_seqs = {self.max_seqs})")
        return seq

    def _on_device(self):
        return _on_device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) ordered on the current stream without a host wait: from a
        pinned copy of src, kept alive by PyTorch until the copy has run, so later
        changes of the mirror cannot reach it."""
        if self.device.type == "cuda":
            src = src.pin_memory()
            with self._on_device():
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def assign_pages(self, seq: int, pages: Sequence[int], start: int = 0) -> None:
        """Sets block-table entries start .. start + len(pages) - 1 of seq to these page
        indices (host mirror and device table). The engine's own allocation; pages may be
        shared between sequences (prefix caching: give them the same c, see
        set_k_smoothing). Assign the pages before appending the tokens that land in them."""
        self._check_seq("assign_pages", seq)
        if self.contiguous_layout:
            raise invalid("assign_pages: the contiguous layout has the fixed block table [s] = {s}")
        pages = [int(p) for p in (pages.tolist() if isinstance(pages, torch.Tensor) else pages)]
        _check_int("assign_pages: start", start, 0, self.max_pages_per_seq)
        if start + len(pages) > self.max_pages_per_seq:
            raise invalid(f"assign_pages: start + len(pages) = {start + len(pages)}; allowed: at most "
                          f"max_pages_per_seq = {self.max_pages_per_seq}")
        for i, p in enumerate(pages):
            if not 0 <= p < self.num_pages:
                raise invalid(f"assign_pages: pages[{i}] = {p}; allowed: a page index 0..{self.num_pages - 1}")
        if not pages:
            return
        row = self._host_tables[seq, start:start + len(pages)]
        old = row[row >= 0].long()
        self._page_refs.index_add_(0, old, torch.full_like(old, -1, dtype=torch.int32))
        new = torch.tensor(pages, dtype=torch.int32)
        row.copy_(new)
        self._page_refs.index_add_(0, new.long(), torch.ones_like(new))
        self._upload(self.block_tables[seq, start:start + len(pages)], new)

    def allocate(self, seq: int, n_tokens: int) -> List[int]:
        """Makes room for n_tokens more tokens of seq: every block-table entry its
        tokens [0, length + n_tokens) need and lacks gets a free page, lowest index first.
        Returns the pages it assigned (often none: the last page has room)."""
        self._check_seq("allocate", seq)
        _check_int("allocate: n_tokens", n_tokens, 0)
        total = int(self._host_lengths[seq]) + n_tokens
        if total > self.capacity:
            raise invalid(f"allocate: sequence {seq} holds {int(self._host_lengths[seq])} tokens; "
                          f"{n_tokens} more exceed its capacity {self.capacity} "
                          "(max_pages_per_seq * page_size)")
        need = -(-total // self.page_size)
        missing = (self._host_tables[seq, :need] < 0).nonzero().flatten().tolist()
        if not missing:
            return []
        free = (self._page_refs == 0).nonzero().flatten()[: len(missing)].tolist()
        if len(free) < len(missing):
            raise invalid(f"allocate: sequence {seq} needs {len(missing)} more pages but the pool has "
                          f"{len(free)} free (num_pages = {self.num_pages}); reset finished sequences")
        # Consecutive entries get one assign_pages call each (one upload per run).
        i = 0
        while i < len(missing):
            j = i
            while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1:
                j += 1
            self.assign_pages(seq, free[i:j + 1], start=missing[i])
            i = j + 1
        return free

    def reset(self, seq: int, free_pages: Optional[bool] = None) -> None:
        """Empties seq: length 0, c zero and no longer fixed. free_pages (default: True,
        except for the contiguous layout) also clears its block-table row, so its pages
        return to the pool (a page another row still refers to stays in use)."""
        self._check_seq("reset", seq)
        if free_pages is None:
            free_pages = not self.contiguous_layout
        if free_pages and self.contiguous_layout:
            raise invalid("reset: free_pages = True; the contiguous layout keeps its pages")
        self._host_lengths[seq] = 0
        self._k_preset[seq] = False
        with self._on_device():
            self.device_lengths[seq].zero_()
            self.k_mean[seq].zero_()
            if free_pages:
                row = self._host_tables[seq]
                used = row[row >= 0].long()
                self._page_refs.index_add_(0, used, torch.full_like(used, -1, dtype=torch.int32))
                row.fill_(-1)
                self.block_tables[seq].fill_(-1)

    def truncate(self, seq: int, length: int) -> None:
        """Forgets the tokens of seq from `length` on (speculative decoding's rejected
        draft tokens); c stays. The pages stay assigned."""
        self._check_seq("truncate", seq)
        _check_int("truncate: length", length, 0, int(self._host_lengths[seq]))
        self._host_lengths[seq] = length
        with self._on_device():
            self.device_lengths[seq].fill_(length)

    def set_k_smoothing(self, seq: int, c: torch.Tensor) -> None:
        """Fixes seq's smoothing vectors c, (heads_kv, head_dim), before its first append
        (a calibrated per-layer vector, or a parent's c for a fork that shares its
        pages); the first append then keeps it instead of the prompt's mean."""
        self._check_seq("set_k_smoothing", seq)
        if not self.smoothing:
            raise invalid("set_k_smoothing: the cache was built with smoothing=False (c = 0)")
        if int(self._host_lengths[seq]) != 0:
            raise invalid(f"set_k_smoothing: sequence {seq} already holds {int(self._host_lengths[seq])} "
                          "tokens; c is fixed once, before the first append (reset it first)")
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != (self.heads_kv, self.head_dim):
            shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise invalid(f"set_k_smoothing: c is {shape}; allowed: a tensor of shape "
                          f"({self.heads_kv}, {self.head_dim}) (heads_kv, head_dim)")
        with self._on_device():
            self.k_mean[seq].copy_(c.to(torch.float32), non_blocking=True)
        self._k_preset[seq] = True

    # ---- the per-call view of a set of sequences -------------------------------------------

    def _resolve_seqs(self, fn: str, seqs: SeqsLike, batch: int, distinct: bool) -> List[int]:
        if seqs is None:
            if batch > self.max_seqs:
                raise invalid(f"{fn}: batch {batch} > max_seqs = {self.max_seqs} with seqs = None (0..B-1)")
            return list(range(batch))
        if isinstance(seqs, torch.Tensor):
            if seqs.device.type != "cpu":
                raise invalid(f"{fn}: seqs is on {seqs.device}; allowed: a list of ints or a CPU tensor "
                              "(reading a device tensor would synchronize)")
            if seqs.dim() > 1 or seqs.is_floating_point() or seqs.is_complex() or seqs.dtype == torch.bool:
                raise invalid(f"{fn}: seqs is a {seqs.dim()}-D {seqs.dtype} tensor; allowed: 1-D integers")
            seqs = seqs.reshape(-1).tolist()
        elif _is_int(seqs):
            seqs = [seqs]
        seqs = list(seqs)
        if len(seqs) != batch:
            raise invalid(f"{fn}: {len(seqs)} seqs for a batch of {batch}; allowed: one per batch entry")
        for s in seqs:
            self._check_seq(fn, s)
        if distinct and len(set(seqs)) != len(seqs):
            raise invalid(f"{fn}: seqs = {seqs} names a sequence twice; allowed: distinct sequences "
                          "(two appends to one sequence in one call would write the same slots)")
        return seqs

    def _cache_arg(self, pages_ptr: int):
        smooth = _C.KV_SMOOTH_PREFILL_MEAN if self.smoothing else _C.KV_SMOOTH_NONE
        return (self._format, self.heads_kv, self.head_dim, self.page_size, self.num_pages,
                self.max_pages_per_seq, smooth, pages_ptr)

    def _view(self, seqs: List[int]) -> "_SeqView":
        return _SeqView(self, seqs)

    # ---- append ----------------------------------------------------------------------------

    def append(self, k: torch.Tensor, v: torch.Tensor, seqs: SeqsLike = None) -> None:
        """Appends n tokens to each of B sequences: k and v are (B, heads_kv, n, head_dim)
        fp16 or bf16 on the cache's device, for sequences `seqs` (distinct; default
        0..B-1). Their pages must be assigned first (assign_pages or allocate). The
        first append of a sequence fixes its c (smoothing); each cached row equals
        qattn's quantizer of that row bit for bit, and n tokens appended at once equal
        n appends of one. Enqueued on the current stream; raises QattnError (nothing
        written) for a bad call."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise invalid(f"append: {name} is a {type(t).__name__}; allowed: a torch.Tensor")
            if t.dim() != 4:
                raise invalid(f"append: {name} has shape {tuple(t.shape)}; allowed: (B, heads_kv, n, head_dim)")
            if t.dtype not in _DTYPES:
                raise invalid(f"append: {name}.dtype = {t.dtype}; allowed: torch.float16 or torch.bfloat16")
        if k.dtype != v.dtype:
            raise invalid(f"append: k.dtype = {k.dtype} and v.dtype = {v.dtype} differ; allowed: one dtype")
        if tuple(k.shape) != tuple(v.shape):
            raise invalid(f"append: k {tuple(k.shape)} and v {tuple(v.shape)} differ; allowed: the same shape")
        b, h, n, d = k.shape
        if h != self.heads_kv or d != self.head_dim or n < 1 or b < 1:
            raise invalid(f"append: k is {tuple(k.shape)}; allowed: (B >= 1, heads_kv = {self.heads_kv}, "
                          f"n >= 1, head_dim = {self.head_dim})")
        seqs = self._resolve_seqs("append", seqs, b, distinct=True)
        # Checked here to name the cache's sequence (the library names the call's entry),
        # and for every group below before any is launched; on the host mirrors, in a
        # few vectorized ops (a decode step appends one token to many sequences).
        idx = torch.tensor(seqs, dtype=torch.int64)
        lens = self._host_lengths.index_select(0, idx).long()
        over = (lens + n > self.capacity).nonzero().flatten()
        if over.numel():
            r = int(over[0])
            raise invalid(f"append: sequence {seqs[r]} holds {int(lens[r])} tokens; appending {n} exceeds its "
                          f"capacity {self.capacity} (max_pages_per_seq * page_size)")
        cols = torch.arange(self.max_pages_per_seq)
        first, last = lens // self.page_size, (lens + n - 1) // self.page_size
        missing = ((cols >= first[:, None]) & (cols <= last[:, None])
                   & (self._host_tables.index_select(0, idx) < 0)).nonzero()
        if missing.numel():
            r, i = int(missing[0, 0]), int(missing[0, 1])
            raise invalid(f"append: sequence {seqs[r]} has no page for its tokens {i * self.page_size}.."
                          f"{(i + 1) * self.page_size - 1} (block table entry {i} = -1); "
                          "assign_pages or allocate first")
        self._require_cuda("append", k, v)
        # A first append keeps a preset c only with k_mean_preset = 1, a flag of the whole
        # call: sequences whose preset c is still unused go in a call of their own.
        preset = [False] * b
        if any(self._k_preset[s] for s in seqs):
            preset = [self._k_preset[s] and length == 0 for s, length in zip(seqs, lens.tolist())]
        groups = [([i for i in range(b) if preset[i] == flag], int(flag)) for flag in (True, False)]
        groups = [(entries, flag) for entries, flag in groups if entries]
        with _on_device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            for entries, flag in groups:
                kk, vv = (k, v) if len(entries) == b else (k[entries], v[entries])
                kk, vv = _usable(kk, "HND", d), _usable(vv, "HND", d)
                group = [seqs[i] for i in entries]
                view = self._view(group)
                status = _C.kv_append(self._cache_arg(self.pages.data_ptr()), view.arg(),
                                      _arg(kk), _arg(vv), _DTYPES[k.dtype], len(group), n, flag, stream)
                check(status)
                view.write_back()  # the library advanced the host lengths of the view
                for s in group:
                    self._k_preset[s] = False

    def _require_cuda(self, fn: str, *tensors: torch.Tensor) -> None:
        if self.device.type != "cuda":
            raise invalid(f"{fn}: the cache is on {self.device}; allowed: a CUDA device")
        for t in tensors:
            if t.device != self.device:
                raise invalid(f"{fn}: a tensor is on {t.device} but the cache on {self.device}; "
                              "allowed: the cache's device")


def _arg(t: torch.Tensor) -> Tuple[int, int, int, int]:
    return (t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


class _SeqView:
    """The per-call arrays of the sequences `seqs` (qattn_kv_seqs): the cache's own rows
    when seqs is a run s0, s0 + 1, ... (views, no copy), else gathered copies, whose
    lengths and c write_back scatters into the cache (device: on the stream; host: the
    mirror)."""

    def __init__(self, cache: KVCache, seqs: List[int]):
        self.cache = cache
        s0 = seqs[0]
        self.run = seqs == list(range(s0, s0 + len(seqs)))
        if self.run:
            sl = slice(s0, s0 + len(seqs))
            self.tables, self.lengths, self.k_mean = (cache.block_tables[sl], cache.device_lengths[sl],
                                                      cache.k_mean[sl])
            self.host_tables, self.host_lengths = cache._host_tables[sl], cache._host_lengths[sl]
        else:
            if cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # The gather's index goes up through a host buffer that a replay would read
                # after it is gone.
                raise invalid(f"seqs = {seqs} during CUDA graph capture; allowed: None or a run "
                              "s0, s0 + 1, ... (the cache's own rows, no gather)")
            self.idx_host = torch.tensor(seqs, dtype=torch.int64)
            idx = self.idx_host.pin_memory().to(cache.device, non_blocking=True)
            self.idx = idx
            self.tables = cache.block_tables.index_select(0, idx)
            self.lengths = cache.device_lengths.index_select(0, idx)
            self.k_mean = cache.k_mean.index_select(0, idx)
            self.host_tables = cache._host_tables.index_select(0, self.idx_host)
            self.host_lengths = cache._host_lengths.index_select(0, self.idx_host)

    def arg(self):
        k_mean = self.k_mean.data_ptr() if self.cache.smoothing else 0
        return (self.tables.data_ptr(), self.lengths.data_ptr(), k_mean, self.host_tables.data_ptr(),
                self.host_lengths.data_ptr())

    def max_length(self) -> int:
        return int(self.host_lengths.max())

    def write_back(self) -> None:
        if self.run:
            return
        c = self.cache
        c.device_lengths.index_copy_(0, self.idx, self.lengths)
        c.k_mean.index_copy_(0, self.idx, self.k_mean)
        c._host_lengths.index_copy_(0, self.idx_host, self.host_lengths)


# ---- decode ----------------------------------------------------------------------------------

_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}  # (device, stream) -> the largest so far
_workspace_lock = threading.Lock()


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """A decode workspace of at least nbytes on the current stream of device. Kept per
    (device, stream) and reused, since calls on one stream run in order; a fresh one
    while a CUDA graph is captured, so that the graph owns its memory."""
    if nbytes == 0:
        return None
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    with _workspace_lock:
        ws = _workspaces.get(key)
        if ws is None or ws.numel() < nbytes:
            ws = torch.empty(nbytes, dtype=torch.uint8, device=device)
            _workspaces[key] = ws
        return ws


def decode(
    q: torch.Tensor,
    cache: KVCache,
    seqs: SeqsLike = None,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    num_splits: int = 0,
    return_lse: bool = False,
):
    """Attention of nq new query tokens per sequence against its cached tokens (the new
    tokens' K and V already appended): q is (B, Hq, nq, head_dim) fp16 or bf16 with nq
    in 1..16 and Hq a multiple of heads_kv (query head h reads KV head
    h // (Hq / heads_kv)); batch entry b reads sequence seqs[b] (default b; repeats
    allowed). causal aligns the mask bottom-right: query i sees key j iff
    j <= i + L - nq. sm_scale defaults to 1/sqrt(head_dim). num_splits: chunks of each
    sequence's keys merged by their LSE (0 = chosen from the sizes; 1 = unsplit).

    Returns o (q's shape and dtype, contiguous), and with return_lse also the
    natural-log LSE (B, Hq, nq) float32 (smoothing folded back). A sequence of length 0
    gives o = 0 and LSE = -inf. The result equals qattn's CPU emulation of the decode
    (src/emulate/kv_cache.h) to FP32 rounding. Enqueued on the current stream (never
    synchronizes; capturable in a CUDA graph with seqs None or a run s0, s0 + 1, ...,
    which read the cache's own rows); raises QattnError with the parameter named for a
    bad call."""
    if not isinstance(cache, KVCache):
        raise invalid(f"decode: cache is a {type(cache).__name__}; allowed: a qattn.KVCache")
    if not isinstance(q, torch.Tensor):
        raise invalid(f"decode: q is a {type(q).__name__}; allowed: a torch.Tensor")
    if q.dim() != 4:
        raise invalid(f"decode: q has shape {tuple(q.shape)}; allowed: (B, Hq, nq, head_dim)")
    if q.dtype not in _DTYPES:
        raise invalid(f"decode: q.dtype = {q.dtype}; allowed: torch.float16 or torch.bfloat16")
    b, hq, nq, d = q.shape
    if d != cache.head_dim:
        raise invalid(f"decode: q's head dim {d} differs from the cache's head_dim = {cache.head_dim}")
    if b < 1 or hq < 1 or hq % cache.heads_kv != 0:
        raise invalid(f"decode: q is {tuple(q.shape)}; allowed: B >= 1 and Hq a multiple of "
                      f"heads_kv = {cache.heads_kv} (GQA/MQA)")
    if not 1 <= nq <= _C.KV_MAX_QUERY_TOKENS:
        raise invalid(f"decode: nq = {nq} query tokens; allowed: 1..{_C.KV_MAX_QUERY_TOKENS}")
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise invalid("decode: causal and return_lse must be bools")
    if sm_scale is not None and not scale_ok(sm_scale):
        raise invalid(f"decode: sm_scale = {sm_scale!r}; allowed: None (1/sqrt(head_dim)) or a positive "
                      "number that is non-zero in FP32 and whose product with log2(e) is finite in FP32")
    _check_int("decode: num_splits", num_splits, 0, _C.KV_MAX_SPLITS)
    seqs = cache._resolve_seqs("decode", seqs, b, distinct=False)
    cache._require_cuda("decode", q)
    with _on_device(cache.device):
        qq = _usable(q, "HND", d)
        o = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, nq) if return_lse else (0,), dtype=torch.float32, device=q.device)
        view = cache._view(seqs)
        args = (cache._cache_arg(cache.pages.data_ptr()), view.arg(), _arg(qq), _arg(o),
                lse.data_ptr() if return_lse else 0, _DTYPES[q.dtype], b, hq, nq, int(causal),
                float(sm_scale) if sm_scale is not None else 0.0,
                # The longest sequence sizes the split (0 would mean the capacity).
                max(1, view.max_length()), num_splits)
        status, nbytes = _C.kv_decode_workspace_size(*args)
        check(status)
        ws = _workspace(cache.device, nbytes)
        stream = torch.cuda.current_stream(cache.device).cuda_stream
        check(_C.kv_decode(*args, ws.data_ptr() if ws is not None else 0, nbytes, stream))
    return (o, lse) if return_lse else o
