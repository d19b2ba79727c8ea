#!/usr/bin/env python3
"""dV = Pᵀ·dO in INT8: SageBwd's per-block scales (one merge per 64-row Q block) against
a merge-free scheme (P per query row by its row max, known from the forward's LSE; dO
times that row max, then one scale per channel over all rows, so the INT32 sum runs over
every Q block and is scaled once), and a merge-free E4M3 scheme (P·448 as E4M3 with no
per-block scale, as SageAttention2's forward quantizes P, dO per channel over all rows,
the FP32 sum over every Q block scaled once). CosSim and relative L1 against FP64,
numpy; the inputs follow emulate/synthetic.h's Gaussian and AttentionSink recipes (FP64,
no FP16 rounding). bench/NOTES.md v82, v86.

    python3 bench/sagebwd_dv_scales.py > bench/results/sagebwd-dv-scales.txt   # ~30 s"""
import argparse
import numpy as np

def q8(x, scale):
    s = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(x / s), -127, 127)

def e4m3(x):
    """x rounded to E4M3 (to nearest even, subnormals from 2^-9, saturating at 448)."""
    a = np.abs(x)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = 2.0 ** (np.maximum(e, -6) - 3)
    return np.sign(x) * np.minimum(np.rint(a / step) * step, 448.0)

def f8(x, scale):
    """The E4M3 codes of x / scale (scale 0: the zeros stay zeros), as q8 for INT8."""
    return e4m3(x / np.where(scale > 0, scale, 1.0))

def cos(a, b):
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))

def rel_l1(a, ref):
    return float(np.abs(a - ref).sum() / np.abs(ref).sum())

def inputs(n, d, temp, seed, family, with_v=False):
    """q, k, (v,) dO: Gaussian with channel biases, temperature T on q; with the sink, key 0
    exceeds a typical key's logit by ~ln(N) for every query (emulate/synthetic.h's
    AttentionSink, along the shared Q bias direction). v is drawn before dO when asked."""
    rng = np.random.default_rng(seed)
    bq = rng.normal(0, 0.5, d); bk = rng.normal(0, 1.0, d)
    q = (rng.normal(size=(n, d)) + bq) / temp
    k = rng.normal(size=(n, d)) + bk
    if family == "sink":
        u = bq / np.linalg.norm(bq)
        k[0] += np.log(n) * temp * np.sqrt(d) / np.linalg.norm(bq) * u
    v = rng.normal(size=(n, d)) if with_v else None
    do = rng.normal(size=(n, d))
    return (q, k, v, do) if with_v else (q, k, do)

def run(n, d, temp, seed, family):
    q, k, do = inputs(n, d, temp, seed, family)
    s = q @ k.T / np.sqrt(d)
    m = s.max(1, keepdims=True)
    p = np.exp(s - m); p /= p.sum(1, keepdims=True)
    ref = p.T @ do
    # A: per (64 Q rows x 64 keys) P scale, per 64-row dO scale, merged per block.
    dv_a = np.zeros((n, d))
    for i0 in range(0, n, 64):
        pb, gb = p[i0:i0 + 64], do[i0:i0 + 64]
        sg = np.abs(gb).max() / 127; gq = q8(gb, sg)
        for j0 in range(0, n, 64):
            blk = pb[:, j0:j0 + 64]; sp = blk.max() / 127
            dv_a[j0:j0 + 64] += sp * sg * (q8(blk, sp).T @ gq)
    # B: P per row by its row max (exp(m - lse) of the forward), dO·rowmax per channel.
    r = p.max(1, keepdims=True)
    pq = q8(p, r / 127)
    g = do * r
    bc = np.abs(g).max(0, keepdims=True) / 127
    acc = pq.T @ q8(g, bc)              # the INT32 sum over all rows
    assert np.abs(acc).max() < 2**31
    dv_b = acc * (bc / 127)
    # C: B with dO per 64-row block (a merge per block again): what B's per-channel scale costs.
    dv_c = np.zeros((n, d))
    for i0 in range(0, n, 64):
        gb = g[i0:i0 + 64]; sg = np.abs(gb).max() / 127
        dv_c += (pq[i0:i0 + 64].T @ q8(gb, sg)) * (sg / 127)
    # D: P·448 in E4M3 (no P scale to merge), dO per channel over all rows in E4M3: the FP32
    # sum runs over every Q block and is scaled once.
    sc = np.abs(do).max(0, keepdims=True) / 448
    dv_d = (e4m3(p * 448).T @ f8(do, sc)) * (sc / 448)
    # E: D's P with dO per 64-row block in E4M3 (a merge per block): what D's dO scale costs.
    dv_e = np.zeros((n, d))
    for i0 in range(0, n, 64):
        gb = do[i0:i0 + 64]; sg = np.abs(gb).max() / 448
        dv_e += (e4m3(p[i0:i0 + 64] * 448).T @ f8(gb, sg)) * (sg / 448)
    return [(name, cos(x, ref), rel_l1(x, ref)) for name, x in
            (("per-block (SageBwd)", dv_a), ("row-max P, per-channel dO (merge-free)", dv_b),
             ("row-max P, per-block dO", dv_c), ("E4M3 P·448, per-channel dO (merge-free)", dv_d),
             ("E4M3 P·448, per-block dO", dv_e))]

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    for family in ("gaussian", "sink"):
        for n in (1024, 4096):
            for temp in (1.0, 0.25):
                rows = {}
                for seed in range(a.seeds):
                    for name, c, l1 in run(n, 128, temp, 1000 + seed, family):
                        rows.setdefault(name, []).append((c, l1))
                for name, v in rows.items():
                    print(f"{family:8s} N={n:5d} T={temp:4.2f} {name:40s} cos {np.mean([x[0] for x in v]):.6f}"
                          f"  relL1 {np.mean([x[1] for x in v]):.5f}")
