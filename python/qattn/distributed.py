"""Sequence-parallel attention over torch.distributed: ring attention, Ulysses
(all-to-all over heads) and the hybrid of the two, each rank holding a shard of the
sequence.

    import qattn.distributed as qd
    o = qd.ring_attention(q, k, v, group=None, is_causal=True, ordering="zigzag")
    o = qd.ulysses_attention(q, k, v, group=None, is_causal=True)
    ug, rg = qd.hybrid_groups(ulysses_size=8)         # Ulysses in a node, ring across
    o = qd.hybrid_attention(q, k, v, ug, rg, is_causal=True, ordering="zigzag")

Shapes are per rank, (B, H, N_local, d) in layout "HND" or (B, N_local, H, d) in "NHD";
every rank holds the same N_local. The shards tile the global sequence:

  ordering="contiguous": rank r holds tokens [r·N_local, (r+1)·N_local);
  ordering="zigzag" (ring attention, for causal load balance): the sequence is cut
    into 2P chunks of N_local/2 tokens and rank r holds chunks r and 2P − 1 − r, so
    every rank has the same number of visible (query, key) pairs under a causal mask.
    N_local must be even. `zigzag_shard` / `zigzag_unshard` convert a global tensor.

Ulysses takes contiguous shards (its all-to-all gathers the whole sequence per head
group) and needs Hq and Hkv divisible by P. The hybrid runs Ulysses inside groups of U
ranks and a ring across the P/U groups: each Ulysses group holds one ring shard
(contiguous or zigzag), cut into U contiguous pieces (`hybrid_shard`). Causal masks are aligned as in a single
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
overlap.

Both have a backward. Ulysses' all-to-alls are permutations, so their gradient is the
inverse all-to-all and the local attention's own autograd does the rest (qattn's
SageBwd on CUDA). Ring attention's backward runs the ring again: each block's dQ, dK,
dV come from `local_backward(q, k, v, o, lse, do, is_causal, scale)` given the *merged*
O and LSE (P = exp(S − lse) is then the block's share of the global softmax, and
D = rowsum(dO∘O) the global one), dQ stays, and dK, dV travel with their K, V block and
arrive at its owner after the last step. The default local backward is qattn's backward
on CUDA tensors and the exact FP32 one (`exact_attention_backward`) on CPU tensors. The
LSE output carries no gradient. qattn's merge-free backward scales
(qattn.set_backward_options(scales="merge_free")) need P's row maxima from one training
forward, which a merged O and LSE do not come with: that backward runs per-block E4M3
scales here, with a QattnFallbackWarning once.
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


def exact_attention_backward(q, k, v, o, lse, do, is_causal: bool, scale: Optional[float]):
    """The FP32 gradients (dq, dk, dv) of one block given the merged o and lse of the
    rows (their global softmax): P = exp(S − lse), dV = Pᵀ·dO, dS = P∘(dO·Vᵀ − D) with
    D = rowsum(dO∘O), dQ = dS·K·scale, dK = dSᵀ·Q·scale; dK, dV summed over each KV
    head's query heads (GQA)."""
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    g = qf.shape[1] // kf.shape[1]
    if g > 1:
        kf, vf = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (qf @ kf.transpose(-1, -2)) * sc
    if is_causal:
        nq, nkv = s.shape[-2], s.shape[-1]
        i = torch.arange(nq, device=s.device)[:, None]
        j = torch.arange(nkv, device=s.device)[None, :]
        s = s.masked_fill(j > i + nkv - nq, float("-inf"))
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse.float())
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dof
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * of).sum(dim=-1, keepdim=True))
    dq = (ds @ kf) * sc
    dk = (ds.transpose(-1, -2) @ qf) * sc
    if g > 1:
        b, h, n, d = dk.shape
        dk = dk.reshape(b, h // g, g, n, d).sum(dim=2)
        dv = dv.reshape(b, h // g, g, n, d).sum(dim=2)
    return dq, dk, dv


def _default_local_backward(q, k, v, o, lse, do, is_causal, scale):
    if q.is_cuda:
        from . import ops  # qattn's backward (SageBwd) with the merged O and LSE

        return ops._call_backward(do, q, k, v, o, lse, None, is_causal, scale, "HND")
    return exact_attention_backward(q, k, v, o, lse, do, is_causal, scale)


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


def _ring_peers(group, world: int, rank: int) -> Tuple[int, int]:
    """The global ranks of the next and the previous rank of the ring."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return nxt, prv


def _exchange(send: torch.Tensor, nxt: int, prv: int, group):
    """Starts sending `send` to the next rank and receiving its like from the previous
    one; returns (the receive buffer, the requests)."""
    recv = torch.empty_like(send)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                   dist.P2POp(dist.irecv, recv, prv, group)])
    return recv, reqs


def _blocks(q_ids: List[int], src: int, world: int, ordering: str, causal: bool):
    """The (query chunk, key chunk, causal) triples a rank computes against the K/V of
    rank `src`: a key chunk entirely in a query chunk's future is skipped, the diagonal
    one is causal."""
    for a, qa in enumerate(q_ids):
        for b, kb in enumerate(_chunk_ids(src, world, ordering)):
            if causal and kb > qa:
                continue
            yield a, b, causal and kb == qa


def _ring_forward(q, k, v, group, causal, scale, ordering, local):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = 2 if ordering == "zigzag" else 1
    q_ids = _chunk_ids(rank, world, ordering)
    q_chunks = q.chunk(per, dim=2)
    parts: List[List[Tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in q_ids]
    nxt, prv = _ring_peers(group, world, rank)
    kv = torch.stack([k, v]).contiguous()
    for step in range(world):
        src = (rank - step) % world  # whose K/V this rank holds now
        pending = None
        if step + 1 < world:  # the next block's transfer runs under this block's attention
            pending = _exchange(kv, nxt, prv, group)
        k_chunks, v_chunks = kv[0].chunk(per, dim=2), kv[1].chunk(per, dim=2)
        for a, b, blk_causal in _blocks(q_ids, src, world, ordering, causal):
            parts[a].append(local(q_chunks[a], k_chunks[b], v_chunks[b], blk_causal, scale))
        if pending is not None:
            for req in pending[1]:
                req.wait()
            kv = pending[0]
    # Every query chunk sees at least its own chunk (the diagonal), so no list is empty.
    merged = [merge_partials([p[0] for p in ps], [p[1] for p in ps]) for ps in parts]
    o = torch.cat([m[0] for m in merged], dim=2).to(q.dtype)
    return o, torch.cat([m[1] for m in merged], dim=2)


def _ring_backward(q, k, v, o, lse, do, group, causal, scale, ordering, local_backward):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = 2 if ordering == "zigzag" else 1
    q_ids = _chunk_ids(rank, world, ordering)
    q_c, o_c, l_c, do_c = (t.chunk(per, dim=2) for t in (q, o, lse, do))
    dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_c]
    nxt, prv = _ring_peers(group, world, rank)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with kv
    for step in range(world):
        src = (rank - step) % world
        pending = _exchange(kv, nxt, prv, group) if step + 1 < world else None
        k_chunks, v_chunks = kv[0].chunk(per, dim=2), kv[1].chunk(per, dim=2)
        dk_chunks, dv_chunks = dkv[0].chunk(per, dim=2), dkv[1].chunk(per, dim=2)
        for a, b, blk_causal in _blocks(q_ids, src, world, ordering, causal):
            dqa, dkb, dvb = local_backward(q_c[a], k_chunks[b], v_chunks[b], o_c[a], l_c[a],
                                           do_c[a], blk_causal, scale)
            dq[a] += dqa.float()
            dk_chunks[b].add_(dkb.float())
            dv_chunks[b].add_(dvb.float())
        # dK, dV travel with their block: after the last step's transfer each rank holds
        # its own block's gradient.
        if world > 1:
            received, reqs = _exchange(dkv, nxt, prv, group)
            for req in reqs + (pending[1] if pending is not None else []):
                req.wait()
            dkv = received
            if pending is not None:
                kv = pending[0]
    return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, ordering, local, local_backward):
        o, lse = _ring_forward(q, k, v, group, causal, scale, ordering, local)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (group, causal, scale, ordering, local_backward)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, o, lse, do.contiguous(), *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: Optional[dist.ProcessGroup] = None, is_causal: bool = False,
                   scale: Optional[float] = None, layout: str = "HND",
                   ordering: str = "contiguous", return_lse: bool = False,
                   local_attention: Optional[LocalAttention] = None,
                   local_backward: Optional[Callable] = None):
    """Ring attention over `group` (default: the world). q, k, v: this rank's shard.
    Returns o (q's shape and dtype) and, with return_lse, the (B, H, N_local) FP32 LSE.
    Differentiable in q, k and v (the module docstring says how)."""
    if ordering not in _ORDERINGS:
        raise ValueError(f"ordering = {ordering!r}; allowed: {', '.join(_ORDERINGS)}")
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    n = qh.shape[2]
    if kh.shape[2] != n or vh.shape[2] != n:
        raise ValueError("ring_attention: q, k and v shards must have the same length")
    if ordering == "zigzag" and n % 2:
        raise ValueError(f"ring_attention: zigzag needs an even shard length, got {n}")
    o, lse = _RingAttention.apply(qh, kh, vh, group, bool(is_causal), scale, ordering,
                                  local_attention or _default_local,
                                  local_backward or _default_local_backward)
    o = o if layout == "HND" else o.transpose(1, 2)
    return (o, lse) if return_lse else o


# ---- Ulysses -------------------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H, N_local, ...) sequence shards → (B, H/P, N, ...) head groups (all-to-all)."""
    b, h, n = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, world, h // world, n, *rest).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # (P, B, H/P, n, ...): part r goes to rank r
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's tokens of my heads
    recv = recv.permute(1, 2, 0, 3, *range(4, 4 + len(rest)))
    return recv.reshape(b, h // world, world * n, *rest)


def _heads_to_seq(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H/P, N, ...) head groups → (B, H, N_local, ...) sequence shards: the inverse."""
    b, hp = x.shape[:2]
    n = x.shape[2] // world
    rest = x.shape[3:]
    send = x.reshape(b, hp, world, n, *rest).permute(2, 0, 1, 3, *range(4, 4 + len(rest)))
    send = send.contiguous()  # (P, B, H/P, n, ...): part r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my tokens of rank r's heads
    return recv.transpose(0, 1).reshape(b, world * hp, n, *rest)


def _check_heads_split(qh: torch.Tensor, kh: torch.Tensor, parts: int, who: str, what: str) -> None:
    """The all-to-all splits the heads of q and k (HND) into `parts` equal groups."""
    for name, t in (("q", qh), ("k", kh)):
        if t.shape[1] % parts:
            raise ValueError(f"{who}: {name} has {t.shape[1]} heads, not divisible by {what} {parts}")


class _AllToAll(torch.autograd.Function):
    """One of the two all-to-alls as an autograd op (to_heads: _seq_to_heads, else
    _heads_to_seq): a permutation, whose gradient is the other one."""

    @staticmethod
    def forward(ctx, x, world, group, to_heads: bool):
        ctx.world, ctx.group, ctx.to_heads = world, group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x.contiguous(), world, group)

    @staticmethod
    def backward(ctx, g):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(g.contiguous(), ctx.world, ctx.group), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: Optional[dist.ProcessGroup] = None, is_causal: bool = False,
                      scale: Optional[float] = None, layout: str = "HND",
                      return_lse: bool = False,
                      local_attention: Optional[LocalAttention] = None):
    """DeepSpeed-Ulysses attention over `group`: contiguous sequence shards in, an
    all-to-all to head groups over the whole sequence, one local attention call, and the
    all-to-all back. Hq and Hkv must be divisible by the group size. Differentiable
    through the local attention's own autograd; the LSE carries no gradient."""
    local = local_attention or _default_local
    world = dist.get_world_size(group)
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    _check_heads_split(qh, kh, world, "ulysses_attention", "the group size")
    qg, kg, vg = (_AllToAll.apply(t, world, group, True) for t in (qh, kh, vh))
    o, lse = local(qg, kg, vg, is_causal, scale)
    o = _AllToAll.apply(o, world, group, False)
    lse = _heads_to_seq(lse.detach().float().contiguous(), world, group)
    o = o if layout == "HND" else o.transpose(1, 2)
    return (o, lse) if return_lse else o


# ---- the hybrid: Ulysses inside a group, ring across the groups ------------------------


def hybrid_groups(ulysses_size: int, group: Optional[dist.ProcessGroup] = None
                  ) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses_group, ring_group) of this rank for hybrid_attention, from `group`
    (default: the world) of P ranks, P a multiple of ulysses_size U: the Ulysses groups
    are runs of U consecutive ranks (put them on one node: their all-to-alls are the
    heaviest traffic), the ring groups the ranks with the same index in their run.
    Every rank of `group` must call it (it creates every subgroup, in the same order
    everywhere, as torch.distributed requires)."""
    world = dist.get_world_size(group)
    if ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"hybrid_groups: ulysses_size = {ulysses_size} must divide the group "
                         f"size {world}")
    rank = dist.get_rank(group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    ring_size = world // ulysses_size
    mine = {}
    for i in range(ring_size):  # Ulysses groups
        members = ranks[i * ulysses_size:(i + 1) * ulysses_size]
        g = dist.new_group(members)
        if i == rank // ulysses_size:
            mine["ulysses"] = g
    for j in range(ulysses_size):  # ring groups
        members = ranks[j::ulysses_size]
        g = dist.new_group(members)
        if j == rank % ulysses_size:
            mine["ring"] = g
    return mine["ulysses"], mine["ring"]


def hybrid_shard(x: torch.Tensor, rank: int, world: int, ulysses_size: int,
                 ordering: str = "contiguous", seq_dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of a global tensor for hybrid_attention over `world` ranks
    grouped as hybrid_groups(ulysses_size) groups them: the ring shard of its Ulysses
    group (ring rank rank // U of world // U, contiguous or zigzag), cut into U
    contiguous pieces, of which it holds piece rank % U."""
    ring_rank, ring_size = rank // ulysses_size, world // ulysses_size
    if ordering == "zigzag":
        ring_shard = zigzag_shard(x, ring_rank, ring_size, seq_dim)
    else:
        ring_shard = x.chunk(ring_size, dim=seq_dim)[ring_rank]
    return ring_shard.chunk(ulysses_size, dim=seq_dim)[rank % ulysses_size]


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup,
                     is_causal: bool = False, scale: Optional[float] = None,
                     layout: str = "HND", ordering: str = "contiguous",
                     return_lse: bool = False,
                     local_attention: Optional[LocalAttention] = None,
                     local_backward: Optional[Callable] = None):
    """Ulysses inside `ulysses_group` and ring attention across `ring_group` (both from
    hybrid_groups): an all-to-all gathers the Ulysses group's shards into its ring
    shard for Hq/U and Hkv/U of the heads, ring attention runs over the ring shards,
    and the all-to-all goes back. q, k, v: this rank's shard as hybrid_shard cuts it
    (every rank the same length; with zigzag the ring shard, U times it, must be
    even); Hq and Hkv divisible by U. Returns o and, with return_lse, the (B, Hq,
    N_local) FP32 LSE (no gradient). Differentiable in q, k and v."""
    if ordering not in _ORDERINGS:
        raise ValueError(f"ordering = {ordering!r}; allowed: {', '.join(_ORDERINGS)}")
    u = dist.get_world_size(ulysses_group)
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    _check_heads_split(qh, kh, u, "hybrid_attention", "the Ulysses group size")
    if kh.shape[2] != qh.shape[2] or vh.shape[2] != qh.shape[2]:
        raise ValueError("hybrid_attention: q, k and v shards must have the same length")
    if ordering == "zigzag" and (qh.shape[2] * u) % 2:
        raise ValueError(f"hybrid_attention: zigzag needs an even ring shard, got "
                         f"{qh.shape[2]} x {u} tokens")
    qg, kg, vg = (_AllToAll.apply(t, u, ulysses_group, True) for t in (qh, kh, vh))
    o, lse = _RingAttention.apply(qg, kg, vg, ring_group, bool(is_causal), scale, ordering,
                                  local_attention or _default_local,
                                  local_backward or _default_local_backward)
    o = _AllToAll.apply(o, u, ulysses_group, False)
    lse = _heads_to_seq(lse.detach().float().contiguous(), u, ulysses_group)
    o = o if layout == "HND" else o.transpose(1, 2)
    return (o, lse) if return_lse else o
