"""Host time per call of qattn.attention, against PyTorch SDPA, and what it costs at
short N (run on the GPU machine).

At N = 1K a call's GPU work is ~0.1 ms, so the host work of a call (the Python layer,
the C checks, four enqueues) decides whether the GPU waits between calls. Printed:
- host us: the median CPU time of one call, timed around the call alone with the GPU
  idle before it (a synchronization before each call, outside the timing), so that no
  call waits for room in the launch queue;
- queued us: the same over 50 calls issued back to back without synchronizing (the GPU
  runs behind; 50 calls stay well inside the launch queue): a cost that appears only
  while the GPU is busy shows as queued > host;
- e2e ms: CUDA events around each call, the median (as bench/forward.py times): a call
  whose host work is longer than the GPU's shows it here;
- stream ms: the wall time of `--iters` calls issued back to back, over the count, with
  one synchronization at the end: what a model that issues nothing else would see.
qattn_unplanned is qattn.attention with its plan cache off (every call checks its inputs and
asks the C library for the workspace size, as before v45); sdpa_dropin is
qattn.scaled_dot_product_attention.
--pieces adds, per shape, the host time of each part of qattn's direct path (the planned
call's key, buffers, stream and C call; the general path's checks, allocations, C
workspace query; the C call's checks alone and the whole C call with its launches), idle
and queued, and a cProfile of 100 calls (tottime order).

    PYTHONPATH=python python3 bench/call_overhead.py [--pieces] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qattn
from forward import clock_env  # bench/forward.py, next to this file


def host_us(fn, iters, idle=True):
    """Median CPU microseconds of one call: with the GPU idle before each (idle), or over
    min(iters, 50) calls issued back to back (queued)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters if idle else min(iters, 50)):
        if idle:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def pieces(q, k, v):
    """The parts of qattn.attention's direct path (python/qattn/ops.py), each callable
    alone with the same arguments as the call: the planned call's (key, lookup, the
    buffers, the stream, the C forward) and the general path's that it skips."""
    from qattn import ops

    scheme = ops._C.SCHEME_SAGE2_8B
    call = ops._Call(q, k, v, False, None, "HND", False, "per_thread")
    key = ops._plan_key(q, k, v, 0, None, "HND", False, "per_thread", scheme, -1, -1, "bottom_right")
    plan = ops._Plan(call)
    index = q.get_device()
    stream = ops._current_stream(index)

    def workspace():
        if ops._raw_alloc is None:  # a PyTorch without the hook: the tensor the call takes
            return torch.empty(call.ws_bytes, dtype=torch.uint8, device=q.device)
        ops._raw_delete(ops._raw_alloc(call.ws_bytes, stream))

    return {
        "_direct_call_ok": lambda: ops._direct_call_ok(q, k, v),
        "_plan_key": lambda: ops._plan_key(q, k, v, 0, None, "HND", False, "per_thread", scheme,
                                           -1, -1, "bottom_right"),
        "_launch_plan (buffers + C)": lambda: ops._launch_plan(plan, q, k, v, False, False, index),
        "O allocation": lambda: q.new_empty(q.shape),
        "workspace, raw alloc+free": workspace,
        "workspace allocation": lambda: torch.empty(call.ws_bytes, dtype=torch.uint8, device=q.device),
        "current stream, raw": lambda: ops._current_stream(index),
        "current_stream": lambda: torch.cuda.current_stream(q.device).cuda_stream,
        "current device, raw": ops._current_device,
        "_check_inputs": lambda: ops._check_inputs(q, k, v, "HND", None, "per_thread"),
        "_Call (all before launch)": lambda: ops._Call(q, k, v, False, None, "HND", False, "per_thread"),
        "C workspace_size": lambda: ops._C.workspace_size(*call.args, call.mask, call.scheme),
        "C checks, no launch": lambda: ops._C.forward(
            *call.args, call.workspace.data_ptr(), call.ws_bytes, 0, mask=call.mask,
            scheme=call.scheme, checks_only=True),
        "launch (C forward)": call.launch,
        "launch, pointers unchecked": lambda: ops._C.forward(
            *call.args, call.workspace.data_ptr(), call.ws_bytes, ops._current_stream(index),
            mask=call.mask, scheme=call.scheme, check_pointers=False),
        "_plans lookup": lambda: ops._plans.get(key),
    }


def unplanned(fn):
    """fn with qattn's plan cache off (every call takes the general path: the checks, the
    C workspace query, _Call), for the side-by-side row."""
    from qattn import ops

    def run():
        keep = ops._keep_plan
        ops._keep_plan = lambda key, plan: None
        ops._plans.clear()
        try:
            return fn()
        finally:
            ops._keep_plan = keep

    return run


def profile_calls(fn, calls=100):
    import cProfile
    import io
    import pstats

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 10 == 9:
            torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def event_ms(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def stream_ms(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def methods(q, k, v, causal):
    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run

    return {
        "qattn": lambda: qattn.attention(q, k, v, is_causal=causal),
        "qattn_unplanned": unplanned(lambda: qattn.attention(q, k, v, is_causal=causal)),
        "sdpa_dropin": lambda: qattn.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "qattn_op": lambda: torch.ops.qattn.attention(q, k, v, causal, None, "HND", False, "per_thread"),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--pieces", action="store_true",
                    help="also time the parts of qattn's call and profile it")
    ap.add_argument("--json")
    ap.add_argument("--commit", default="unknown", help="commit id to record in the JSON")
    args = ap.parse_args()
    rows = []
    with torch.inference_mode():
        for b, h, n, d, causal in [(1, 8, 128, 128, False), (4, 32, 1024, 128, False),
                                   (4, 32, 1024, 128, True), (4, 32, 1024, 64, False)]:
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(3))
            for name, fn in methods(q, k, v, causal).items():
                row = {"method": name, "batch": b, "heads": h, "n": n, "d": d, "causal": causal,
                       "host_us": host_us(fn, args.iters),
                       "queued_us": host_us(fn, args.iters, idle=False),
                       "e2e_ms": event_ms(fn, 50), "stream_ms": stream_ms(fn, 200)}
                rows.append(row)
                print(f"{name:<11} B={b} H={h:<3} N={n:<5} d={d:<4} causal={int(causal)}  "
                      f"host {row['host_us']:7.1f} us  queued {row['queued_us']:7.1f} us   "
                      f"e2e {row['e2e_ms']:.4f} ms   stream {row['stream_ms']:.4f} ms", flush=True)
            if args.pieces and not causal:
                for part, fn in pieces(q, k, v).items():
                    row = {"method": "piece", "piece": part, "batch": b, "heads": h, "n": n, "d": d,
                           "host_us": host_us(fn, 200), "queued_us": host_us(fn, 200, idle=False)}
                    rows.append(row)
                    print(f"  {part:<26} host {row['host_us']:7.1f} us  queued {row['queued_us']:7.1f} us")
                print(profile_calls(methods(q, k, v, causal)["qattn"]))
    if args.json:
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "qattn": qattn.__version__, "commit": args.commit, **clock_env(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
