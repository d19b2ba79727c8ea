"""Sequence-parallel attention over torch.distributed: ring attention and Ulysses
(all-to-all over heads), each rank holding a shard of the sequence.

    import qattn.distributed as qd
    o = qd.ring_attention(q, k, v, group=None, is_causal=True, ordering="zigzag")
    o = qd.ulysses_attention(q, k, v, group=None, is_causal=True)

Shapes are per rank, (B, H, N_local, d) in layout "HND" or (B, N_local, H, d) in "NHD";
every rank holds the same N_local. The shards tile the global sequence:

  ordering="contiguous": rank r holds tokens [r·N_local, (r+1)·N_local);
  ordering="zigzag" (ring attention, for causal load balance): the sequence is cut
    into 2P chunks of N_local/2 tokens and rank r holds chunks r and 2P − 1 − r, so
    every rank has the same number of visible (query, key) pairs under a causal mask.
    N_local must be even. `zigzag_shard` / `zigzag_unshard` convert a global tensor.

Ulysses takes contiguous shards (its all-to-all gathers the whole sequence per head
group) and needs Hq and Hkv divisible by P. Causal masks are aligned as in a single
call over the global sequence (Nq = Nkv: top-left and bottom-right agree).

The local attention of one (query chunk, key chunk) pair is `local_attention(q, k, v,
is_causal, scale) -> (o, lse)` with lse the natural-log (B, H, Nq) FP32 log-sum-exp; by
default qattn.attention (SageAttention2-8b) on CUDA tensors and exact FP32 attention on
CPU tensors (for tests and the gloo backend). Partial outputs merge in FP32 by their
LSE: with m = max_i lse_i, O = Σ_i exp(lse_i − m)·O_i / Σ_i exp(lse_i − m) and
lse = m + log Σ_i exp(lse_i − m) (`merge_partials`); a partial whose rows see no key
(lse −∞) adds nothing, and a row no partial sees gives O = 0, lse = −∞, as a single call.

Ring attention passes K and V around the ring with torch.distributed's point-to-point
ops, the next block's transfer issued before the current block's attention so the two
overlap. This version is forward only (inference and evaluation); the distributed
backward is not built.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, Optional[float]],
                          Tuple[torch.Tensor, torch.Tensor]]

_ORDERINGS = ("contiguous", "zigzag")


# ---- the merge rule ------------------------------------------------------------------


def merge_partials(outputs: List[torch.Tensor], lses: List[torch.Tensor]
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges partial attention outputs over disjoint key sets by their natural-log
    LSEs, in FP32: outputs (B, H, N, d), lses (B, H, N). Returns (o FP32, lse FP32)."""
    if len(outputs) != len(lses) or not outputs:
        raise ValueError("merge_partials: need one LSE per output, at least one")
    lse = torch.stack([x.float() for x in lses])  # (P, B, H, N)
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # exp(−inf) = 0: a partial that saw no key adds nothing
    total = w.sum(dim=0)
    o = sum(wi.unsqueeze(-1) * oi.float() for wi, oi in zip(w, outputs))
    seen = total > 0
    o = torch.where(seen.unsqueeze(-1), o / torch.where(seen, total, torch.ones_like(total)).unsqueeze(-1),
                    torch.zeros_like(o))
    lse_out = torch.where(seen, m_safe + torch.log(torch.where(seen, total, torch.ones_like(total))),
                          torch.full_like(m, float("-inf")))
    return o, lse_out


# ---- local attention ---------------------------------------------------------------


def exact_attention(q, k, v, is_causal: bool, scale: Optional[float]):
    """FP32 attention with its LSE, (B, H, N, d) tensors, GQA by head groups; causal
    aligned bottom-right (a diagonal block of one sequence: Nq = Nkv). Rows that see no
    key give O = 0, LSE = −inf."""
    qf, kf, vf = q.float(), k.float(), v.float()
    g = qf.shape[1] // kf.shape[1]
    if g > 1:
        kf, vf = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        nq, nkv = s.shape[-2], s.shape[-1]
        i = torch.arange(nq, device=s.device)[:, None]
        j = torch.arange(nkv, device=s.device)[None, :]
        s = s.masked_fill(j > i + nkv - nq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return (p @ vf).to(q.dtype), lse


def _default_local(q, k, v, is_causal, scale):
    if q.is_cuda:
        import qattn  # the CUDA path: qattn's kernel

        return qattn.attention(q, k, v, is_causal=is_causal, scale=scale, return_lse=True,
                               causal_alignment="bottom_right")
    return exact_attention(q, k, v, is_causal, scale)


# ---- shards ------------------------------------------------------------------------


def _to_hnd(t, layout):
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout = {layout!r}; allowed: 'HND' or 'NHD'")
    return t if layout == "HND" else t.transpose(1, 2)


def zigzag_shard(x: torch.Tensor, rank: int, world: int, seq_dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of a global tensor: chunks rank and 2P − 1 − rank."""
    chunks = x.chunk(2 * world, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=seq_dim)


def zigzag_unshard(shards: List[torch.Tensor], seq_dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's zigzag shard (rank order)."""
    world = len(shards)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * world)
    for r, s in enumerate(shards):
        a, b = s.chunk(2, dim=seq_dim)
        chunks[r], chunks[2 * world - 1 - r] = a, b
    return torch.cat(chunks, dim=seq_dim)


def _chunk_ids(rank: int, world: int, ordering: str) -> List[int]:
    """Global chunk numbers a rank holds, in its local order (chunks of equal length)."""
    return [rank] if ordering == "contiguous" else [rank, 2 * world - 1 - rank]


# ---- ring attention ------------------------------------------------------------------


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: Optional[dist.ProcessGroup] = None, is_causal: bool = False,
                   scale: Optional[float] = None, layout: str = "HND",
                   ordering: str = "contiguous", return_lse: bool = False,
                   local_attention: Optional[LocalAttention] = None):
    """Ring attention over `group` (default: the world). q, k, v: this rank's shard.
    Returns o (q's shape and dtype) and, with return_lse, the (B, H, N_local) FP32 LSE."""
    if ordering not in _ORDERINGS:
        raise ValueError(f"ordering = {ordering!r}; allowed: {', '.join(_ORDERINGS)}")
    local = local_attention or _default_local
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    n = qh.shape[2]
    if kh.shape[2] != n:
        raise ValueError("ring_attention: q, k and v shards must have the same length")
    per = 2 if ordering == "zigzag" else 1
    if n % per:
        raise ValueError(f"ring_attention: zigzag needs an even shard length, got {n}")
    q_ids = _chunk_ids(rank, world, ordering)
    q_chunks = qh.chunk(per, dim=2)
    partial_o: List[List[torch.Tensor]] = [[] for _ in q_ids]
    partial_l: List[List[torch.Tensor]] = [[] for _ in q_ids]
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    kv = torch.stack([kh, vh]).contiguous()
    for step in range(world):
        src = (rank - step) % world  # whose K/V this rank holds now
        pending = None
        if step + 1 < world:  # the next block's transfer runs under this block's attention
            recv = torch.empty_like(kv)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                              dist.P2POp(dist.irecv, recv, prv, group)])
        k_chunks, v_chunks = kv[0].chunk(per, dim=2), kv[1].chunk(per, dim=2)
        for a, qa in enumerate(q_chunks):
            for b, kb_id in enumerate(_chunk_ids(src, world, ordering)):
                if is_causal and kb_id > q_ids[a]:
                    continue  # every key of that chunk is in the future
                o, lse = local(qa, k_chunks[b], v_chunks[b], is_causal and kb_id == q_ids[a], scale)
                partial_o[a].append(o)
                partial_l[a].append(lse)
        if pending is not None:
            for req in pending:
                req.wait()
            kv = recv
    outs, lses = [], []
    for a, qa in enumerate(q_chunks):
        if partial_o[a]:
            o, lse = merge_partials(partial_o[a], partial_l[a])
        else:  # not reachable: a causal query chunk always sees its own chunk
            o = torch.zeros(qa.shape, dtype=torch.float32, device=qa.device)
            lse = torch.full(qa.shape[:3], float("-inf"), device=qa.device)
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs, dim=2).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    o = o if layout == "HND" else o.transpose(1, 2).contiguous()
    return (o, lse) if return_lse else o


# ---- Ulysses -------------------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H, N_local, d) sequence shards → (B, H/P, N, d) head groups (all-to-all)."""
    b, h, n, d = x.shape
    send = x.reshape(b, world, h // world, n, d).transpose(0, 1).contiguous()  # (P, B, H/P, n, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's shard of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)


def _heads_to_seq(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H/P, N, ...) head groups → (B, H, N_local, ...) sequence shards."""
    b, hp = x.shape[:2]
    n = x.shape[2] // world
    rest = x.shape[3:]
    send = x.reshape(b, hp, world, n, *rest).permute(2, 0, 1, 3, *range(4, 4 + len(rest)))
    send = send.contiguous()  # (P, B, H/P, n, ...): part r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my tokens of rank r's heads
    return recv.transpose(0, 1).reshape(b, world * hp, n, *rest)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: Optional[dist.ProcessGroup] = None, is_causal: bool = False,
                      scale: Optional[float] = None, layout: str = "HND",
                      return_lse: bool = False,
                      local_attention: Optional[LocalAttention] = None):
    """DeepSpeed-Ulysses attention over `group`: contiguous sequence shards in, an
    all-to-all to head groups over the whole sequence, one local attention call, and the
    all-to-all back. Hq and Hkv must be divisible by the group size."""
    local = local_attention or _default_local
    world = dist.get_world_size(group)
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    for name, t in (("q", qh), ("k", kh)):
        if t.shape[1] % world:
            raise ValueError(f"ulysses_attention: {name} has {t.shape[1]} heads, not divisible "
                             f"by the group size {world}")
    qg, kg, vg = (_seq_to_heads(t.contiguous(), world, group) for t in (qh, kh, vh))
    o, lse = local(qg, kg, vg, is_causal, scale)
    o = _heads_to_seq(o.contiguous(), world, group)
    lse = _heads_to_seq(lse.float().contiguous(), world, group)
    o = o if layout == "HND" else o.transpose(1, 2).contiguous()
    return (o, lse) if return_lse else o
