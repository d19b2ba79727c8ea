#!/usr/bin/env python3
"""Strong scaling of sequence-parallel attention (qattn.distributed) on several GPUs of
one host: ring, Ulysses and the hybrid, each with qattn's kernel as the local attention
and with BF16 SDPA as the local attention of the same decomposition, against one GPU
running the whole sequence.

    PYTHONPATH=python python3 bench/distributed.py --gpus 8 --out bench/results

Writes OUT/distributed-h200x<G>.json (G = --gpus): {"env": {...}, "rows": [...]}, a row
per (shape, method, local attention):
    shape, batch, heads_q, heads_kv, n, d, causal, method ("ring", "ulysses", "hybrid"),
    ulysses_size, ordering, local ("qattn" | "sdpa_bf16"), gpus, ms (the forward's time:
    each rank's median over CUDA events, the slowest rank), ms_single_gpu (the same local
    attention over the whole sequence on one GPU, measured in the same run),
    efficiency = ms_single_gpu / (gpus · ms), speedup_vs_sdpa (the sdpa_bf16 row's ms
    over this row's, same shape and method), cos_vs_single (the gathered output against
    the one-GPU output of the same local attention).
The shapes: a video DiT (B 1, H 24, non-causal) and an LLM prefill (B 1, Hq 32, Hkv 8,
causal, zigzag shards for the ring), d 128, N in --tokens (default 64K, 128K, 256K).
SDPA's local attention is FlashAttention-2 through aten (it returns the LSE the ring
merge needs; K and V repeated over GQA groups, which FlashAttention's aten op does not
take).

Every process runs with NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

--device cpu runs the same script over gloo on CPU processes with exact FP32 attention
as both local attentions and tiny shapes: a check of the script, not a result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val  # inherited by the spawned processes

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (batch, heads_q, heads_kv, d, causal)
    "video_dit": (1, 24, 24, 128, False),
    "llm_prefill": (1, 32, 8, 128, True),
}


def sdpa_local(q, k, v, is_causal, scale):
    """BF16 FlashAttention-2 (aten) with its natural-log LSE, GQA by repeating K and V."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False,
                                                             scale=scale)
    return out[0], out[1]


def exact_local(q, k, v, is_causal, scale):
    import qattn.distributed as qd

    return qd.exact_attention(q, k, v, is_causal, scale)


def qattn_local(q, k, v, is_causal, scale):
    import qattn

    return qattn.attention(q, k, v, is_causal=is_causal, scale=scale, return_lse=True,
                           causal_alignment="bottom_right")


def time_ms(fn, device, iters: int, warmup: int) -> float:
    """The lower median of `iters` calls (bench/forward.py's CUDA-event timing on a GPU),
    after `warmup` calls."""
    if device.type == "cuda":
        import forward as fwdbench

        medians, _ = fwdbench.time_fn(lambda i: fn(), warmup=warmup, min_iters=iters, max_iters=iters,
                                      budget_s=0)
        return min(medians)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return sorted(samples)[len(samples) // 2]


def methods(world: int, causal: bool):
    """(method, ulysses_size, ordering) of each decomposition at this world size."""
    ordering = "zigzag" if causal else "contiguous"
    out = [("ring", 1, ordering), ("ulysses", world, "contiguous")]
    if world >= 4:
        out.append(("hybrid", world // 2, ordering))
    return out


def run_rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    cpu = args.device == "cpu"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)
    import qattn.distributed as qd

    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dtype = torch.float32 if cpu else torch.bfloat16
    locals_ = {"qattn": exact_local if cpu else qattn_local,
               "sdpa_bf16": exact_local if cpu else sdpa_local}
    groups = {}
    rows = []
    try:
        for shape_name in args.shapes:
            b, hq, hkv, d, causal = SHAPES[shape_name]
            if cpu:
                hq, hkv = min(hq, 8), min(hkv, 4)
            for n in args.tokens:
                g = torch.Generator(device=device).manual_seed(1234)
                q = torch.randn(b, hq, n, d, device=device, dtype=dtype, generator=g)
                k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
                v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
                single = {}
                for local_name, local in locals_.items():
                    # One GPU (rank 0's) over the whole sequence: the strong-scaling base.
                    if rank == 0:
                        fn = lambda: local(q, k, v, causal, None)  # noqa: E731
                        single[local_name] = (time_ms(fn, device, args.iters, args.warmup), fn()[0])
                    dist.barrier()
                for method, u, ordering in methods(world, causal):
                    if hq % u or hkv % u:  # Ulysses splits the heads U ways
                        continue
                    if method == "hybrid" and u not in groups:
                        groups[u] = qd.hybrid_groups(u)
                    if method == "ring":
                        shard = (lambda t: qd.zigzag_shard(t, rank, world)) if ordering == "zigzag" \
                            else (lambda t: t.chunk(world, dim=2)[rank])
                    elif method == "ulysses":
                        shard = lambda t: t.chunk(world, dim=2)[rank]  # noqa: E731
                    else:
                        shard = lambda t, u=u, o=ordering: qd.hybrid_shard(t, rank, world, u, o)  # noqa: E731
                    qs, ks, vs = (shard(t).contiguous() for t in (q, k, v))
                    ms = {}
                    for local_name, local in locals_.items():
                        if method == "ring":
                            fn = lambda: qd.ring_attention(qs, ks, vs, is_causal=causal, ordering=ordering,  # noqa: E731
                                                           local_attention=local)
                        elif method == "ulysses":
                            fn = lambda: qd.ulysses_attention(qs, ks, vs, is_causal=causal,  # noqa: E731
                                                              local_attention=local)
                        else:
                            ug, rg = groups[u]
                            fn = lambda: qd.hybrid_attention(qs, ks, vs, ug, rg, is_causal=causal,  # noqa: E731
                                                             ordering=ordering, local_attention=local)
                        dist.barrier()
                        t = torch.tensor([time_ms(fn, device, args.iters, args.warmup)], dtype=torch.float64,
                                         device=device)
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        out = fn()
                        gathered = [torch.empty_like(out) for _ in range(world)] if rank == 0 else None
                        dist.gather(out.contiguous(), gathered, dst=0)
                        ms[local_name] = t.item()
                        if rank == 0:
                            if method == "hybrid":
                                full = torch.empty_like(single[local_name][1])
                                idx = torch.arange(n, device=device).view(1, 1, n, 1).float()
                                for r, part in enumerate(gathered):
                                    ids = qd.hybrid_shard(idx, r, world, u, ordering).flatten().long()
                                    full[:, :, ids] = part
                            elif ordering == "zigzag":
                                full = qd.zigzag_unshard(gathered)
                            else:
                                full = torch.cat(gathered, dim=2)
                            ref = single[local_name][1]
                            a, r_ = full.double().flatten(), ref.double().flatten()
                            cos = (a @ r_ / (a.norm() * r_.norm())).item()
                            base = single[local_name][0]
                            rows.append({
                                "shape": shape_name, "batch": b, "heads_q": hq, "heads_kv": hkv, "n": n,
                                "d": d, "causal": causal, "method": method, "ulysses_size": u,
                                "ordering": ordering, "local": local_name, "gpus": world,
                                "ms": ms[local_name], "ms_single_gpu": base,
                                "efficiency": base / (world * ms[local_name]), "cos_vs_single": cos,
                            })
                    if rank == 0:
                        for row in rows[-len(locals_):]:
                            row["speedup_vs_sdpa"] = ms["sdpa_bf16"] / row["ms"]
                if not cpu:
                    torch.cuda.empty_cache()
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(args) -> dict:
    import qattn

    if args.device == "cpu":
        return {"device": "cpu (gloo)", "torch": torch.__version__, "qattn": qattn.__version__,
                "note": "script check with exact FP32 local attention, not a result"}
    import forward as fwdbench

    env = fwdbench.environment(argparse.Namespace(commit=args.commit, warmup=args.warmup, min_iters=args.iters,
                                                  max_iters=args.iters, budget_s=0))
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    env["gpus"] = args.gpus
    env["timing"] = (f"per rank: the lower of two medians of {args.iters} CUDA-event-timed forwards "
                     f"after {args.warmup} warm-up; the slowest rank's")
    env["nvlink_multicast"] = "off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1)"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="processes (default: every visible GPU)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default=None, help="default distributed-h200x<gpus>")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; --device cpu checks the script over gloo")
        args.gpus = args.gpus or torch.cuda.device_count()
        if args.gpus > torch.cuda.device_count():
            raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} visible")
    args.gpus = args.gpus or 2
    for n in args.tokens:
        if n % (2 * args.gpus):
            raise SystemExit(f"--tokens {n}: must be a multiple of 2 x gpus (zigzag shards)")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(run_rank, args=(args.gpus, free_port(), args, queue), nprocs=args.gpus,
                       start_method="spawn")
    rows = queue.get()
    env = environment(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.name or f'distributed-h200x{args.gpus}'}.json"
        path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"\n{'shape':<12}{'N':>8}{'method':>9}{'U':>3}{'local':>11}{'ms':>10}{'1 GPU ms':>10}"
          f"{'eff':>7}{'x sdpa':>8}{'cos':>10}")
    for r in rows:
        print(f"{r['shape']:<12}{r['n']:>8}{r['method']:>9}{r['ulysses_size']:>3}{r['local']:>11}"
              f"{r['ms']:>10.3f}{r['ms_single_gpu']:>10.3f}{r['efficiency']:>7.2f}"
              f"{r.get('speedup_vs_sdpa', math.nan):>8.2f}{r['cos_vs_single']:>10.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
