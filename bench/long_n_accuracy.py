#!/usr/bin/env python3
"""The forward's error against FP64 attention on the GPU as the sequence grows, d = 128
(the two-level SA2-8b kernel) beside d = 256 (the one-level sage2_wide_sm90 kernel), on
randn bf16 inputs (bench/forward.py's), B 1 × H 2, N 1K/4K/16K, causal off and on.

Per case: CosSim, relative L1, O's scale <o, r>/<r, r> (the error CosSim cannot see: a
one-level FP22 accumulator biases O and the row sums), the mean LSE gap, cuDNN's CosSim
to the same FP64 result, and the last and first 1K rows alone (the rows that see the most
and the fewest keys when causal). bench/NOTES.md v48 says why.

    PYTHONPATH=python python3 bench/long_n_accuracy.py
"""
import torch

import qattn

torch.manual_seed(0)
print(f"{'d':>4} {'N':>6} {'causal':>6} {'cos64':>9} {'relL1':>7} {'scale':>7} {'lsegap':>9} {'cos_cudnn64':>11} | last-1K rows: cos relL1 scale | first-1K rows: cos scale")
for d in (128, 256):
    for n in (1024, 4096, 16384):
        for c in (False, True):
            H = 2
            q, k, v = (torch.randn(1, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            o, lse = qattn.attention(q, k, v, is_causal=c, return_lse=True)
            oc = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
            st = {k_: [] for k_ in ("dot", "rr", "oo", "l1", "l1r", "lg", "cdot", "coo")}
            rows = {"last": [0, 0, 0, 0, 0], "first": [0, 0, 0, 0, 0]}
            for h in range(H):
                qd, kd, vd = q[0, h].double(), k[0, h].double(), v[0, h].double()
                s = (qd @ kd.T) / d ** 0.5
                if c:
                    s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
                l = torch.logsumexp(s, -1)
                r = torch.softmax(s, -1) @ vd
                del s
                oh, och = o[0, h].double(), oc[0, h].double()
                st["dot"].append((oh * r).sum()); st["rr"].append((r * r).sum()); st["oo"].append((oh * oh).sum())
                st["l1"].append((oh - r).abs().sum()); st["l1r"].append(r.abs().sum())
                st["lg"].append((lse[0, h].double() - l).mean())
                st["cdot"].append((och * r).sum()); st["coo"].append((och * och).sum())
                for name, sl in (("last", slice(n - 1024, n)), ("first", slice(0, 1024))):
                    a, b = oh[sl], r[sl]
                    rows[name][0] += (a * b).sum(); rows[name][1] += (b * b).sum(); rows[name][2] += (a * a).sum()
                    rows[name][3] += (a - b).abs().sum(); rows[name][4] += b.abs().sum()
            S = {k_: sum(x.item() for x in v_) for k_, v_ in st.items()}
            cos = S["dot"] / (S["rr"] * S["oo"]) ** 0.5
            ccos = S["cdot"] / (S["rr"] * S["coo"]) ** 0.5
            f = lambda R: f"{R[0] / (R[1] * R[2]) ** 0.5:.6f} {R[3] / R[4]:.4f} {R[0] / R[1]:.4f}"
            fr = rows["first"]
            print(f"{d:>4} {n:>6} {int(c):>6} {cos:9.6f} {S['l1'] / S['l1r']:7.4f} {S['dot'] / S['rr']:7.4f} {S['lg'] / H:9.2e} {ccos:11.6f} | {f(rows['last'])} | {fr[0] / (fr[1] * fr[2]) ** 0.5:.6f} {fr[0] / fr[1]:.4f}", flush=True)
