"""qattn.tools: the noise-floor attention against PyTorch's SDPA, and compare() on a small
model whose attention calls differ in head dim, with candidates whose errors are known:
exact, perturbed in one call only, and the floor. CPU only."""

import random
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from qattn import _C, tools  # noqa: E402

SEEDS = [0, random.randrange(1, 2**31)]


def randn(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", ["plain", "causal_tall", "causal_wide", "bool", "float", "gqa"])
def test_eager_attention_is_sdpa_in_fp64(seed, case):
    nq, nkv, hq, hkv = {"causal_tall": (37, 20), "causal_wide": (20, 37)}.get(case, (25, 31)) + (4, 4)
    if case == "gqa":
        hkv = 2
    q, k, v = randn(2, hq, nq, 16, seed=seed), randn(2, hkv, nkv, 16, seed=seed + 1), randn(2, hkv, nkv, 16, seed=seed + 2)
    kw = {"scale": 0.3}
    if case.startswith("causal"):
        kw["is_causal"] = True
    if case == "bool":
        kw["attn_mask"] = randn(1, hq, nq, nkv, seed=seed + 3) > -0.5
    if case == "float":
        kw["attn_mask"] = randn(2, 1, nq, nkv, seed=seed + 3)
    if case == "gqa":
        kw["enable_gqa"] = True
    got, want = tools.eager_attention(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw)
    # FP64 both: only the order of the sums differs (~1e-15 relative).
    rows = torch.isfinite(want).all(-1)
    assert torch.allclose(got[rows], want[rows], rtol=0, atol=1e-12)


class Toy(torch.nn.Module):
    """Three attention calls with head dims 16, 32, 16 and a linear read-out; `gains`
    (per call, per head) multiplies the queries of each call's heads."""

    def __init__(self, seed, gains=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.dims = (16, 32, 16)
        self.proj = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(64, 3 * 2 * d, generator=g) / 8) for d in self.dims])
        self.out = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(2 * d, 64, generator=g) / 8) for d in self.dims])
        self.head = torch.nn.Parameter(torch.randn(64, 50, generator=g) / 8)
        self.gains = gains

    def forward(self, x):  # x (B, N, 64)
        b, n, _ = x.shape
        for i, (w, wo, d) in enumerate(zip(self.proj, self.out, self.dims)):
            q, k, v = (x @ w).view(b, n, 3, 2, d).permute(2, 0, 3, 1, 4)
            if self.gains is not None:
                q = q * torch.tensor(self.gains[i], dtype=q.dtype).view(1, 2, 1, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up per call
            x = x + o.transpose(1, 2).reshape(b, n, 2 * d) @ wo
        return x @ self.head


def perturbed_at_d32(query, key, value, *args, **kwargs):
    out = torch._C._nn.scaled_dot_product_attention(query, key, value, *args, **kwargs)
    return out * 1.01 if query.shape[-1] == 32 else out


@pytest.mark.parametrize("seed", SEEDS)
def test_compare_finds_the_call_that_errs(seed):
    model = Toy(seed).eval()
    x = randn(2, 24, 64, seed=seed + 7, dtype=torch.float32)
    exact = torch._C._nn.scaled_dot_product_attention
    report = tools.compare(lambda: model(x), {"exact": exact, "d32": perturbed_at_d32},
                           logits=True, ablate=True, keep_outputs=True)
    m = report.metrics
    assert m["exact"]["kl"] == 0.0 and m["exact"]["top1"] == 1.0 and m["exact"]["cos"] == pytest.approx(1.0, abs=1e-12)
    assert m["d32"]["kl"] > 0 and m["d32"]["cos"] < 1 - 1e-9
    # The floor (FP32 eager vs FP32 SDPA) differs by rounding only: far below the 1% error.
    assert 0 <= m["eager"]["loss"] < 1e-3 * m["d32"]["loss"]
    assert m["d32"]["x_floor"] > 1e3 or m["eager"]["loss"] == 0
    # Per call: the candidate on the reference's own inputs, so only call 1 errs...
    calls = report.layers["d32"]
    assert [c.shape[-1] for c in calls] == [16, 32, 16]
    assert calls[0].cos == pytest.approx(1.0, abs=1e-12) and calls[2].cos == pytest.approx(1.0, abs=1e-12)
    assert calls[1].rel_l1 == pytest.approx(0.01, rel=1e-3)  # out·1.01: relative L1 exactly 1%
    # ... and in the ablation only call 1 (layer 1) moves the output.
    losses = report.ablation["d32"]
    assert losses[0] == 0.0 and losses[2] == 0.0 and losses[1] == pytest.approx(m["d32"]["kl"], rel=1e-6)
    assert torch.equal(report.outputs["sdpa"], model(x))
    assert "layer 1" in report.table()
    assert [r["calls"] for r in report.layer_summary("d32")] == [1, 1, 1]
    assert set(report.to_dict()) == {"reference", "floor", "logits", "metrics", "layers", "ablation",
                                     "guard"}


def test_the_patch_is_undone_on_error():
    before = F.scaled_dot_product_attention

    def failing():
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError, match="model failed"):
        tools.compare(failing, {"exact": torch._C._nn.scaled_dot_product_attention})
    assert F.scaled_dot_product_attention is before


def test_layers_group_the_calls_of_several_batches():
    model = Toy(3).eval()
    xs = [randn(2, 24, 64, seed=s, dtype=torch.float32) for s in (10, 11)]
    run = lambda: torch.cat([model(x) for x in xs])  # noqa: E731
    report = tools.compare(run, {"d32": perturbed_at_d32}, floor=None, ablate=True,
                           layer_of=lambda i: i % 3)
    summary = report.layer_summary("d32")
    assert [(r["layer"], r["calls"]) for r in summary] == [(0, 2), (1, 2), (2, 2)]
    # out·1.01 keeps the direction (CosSim 1) and moves relative L1 by 1%.
    assert summary[0]["mean_rel_l1"] < 1e-12 and summary[1]["mean_rel_l1"] == pytest.approx(0.01, rel=1e-3)
    losses = report.ablation["d32"]
    assert len(losses) == 3 and abs(losses[0]) < 1e-12 and abs(losses[2]) < 1e-12 and losses[1] > 1e-9
    assert "x_floor" not in report.metrics["d32"]


HADAMARD_H = Path(__file__).resolve().parents[2] / "src" / "numerics" / "hadamard.h"


def hadamard_rotate(x, for_q):
    """numerics::hadamard_rotate on each row of x (FP32), step for step (the CPU binding
    does not expose it): x_c · s_c with the header's kPattern, the butterflies (stage
    h = 1, 2, ..., D/2; pairs (j, j + h), j + h gets a - b), then 2^-e, e = ceil(m/2) for
    Q and floor(m/2) for K."""
    d = x.shape[-1]
    m = d.bit_length() - 1
    pattern = int(re.search(r"kPattern = (0x[0-9A-Fa-f]+)ull;", HADAMARD_H.read_text()).group(1), 16)
    s = torch.tensor([-1.0 if ((pattern >> (c & 63)) ^ (c >> 6)) & 1 else 1.0 for c in range(d)])
    x = x * s
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h *= 2
    return x * 2.0 ** -((m + 1) // 2 if for_q else m // 2)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_hadamard_matrices_keep_every_dot_product(d):
    rq, rk = tools.hadamard_matrix(d, True, torch.float64), tools.hadamard_matrix(d, False, torch.float64)
    assert torch.equal(rq @ rk.T, torch.eye(d, dtype=torch.float64))  # exact: ±1 sums, powers of two
    m = d.bit_length() - 1
    assert set(rq.abs().unique().tolist()) == {2.0 ** -((m + 1) // 2)}
    assert set(rk.abs().unique().tolist()) == {2.0 ** -(m // 2)}
    # R = diag(s)·H·2^-e with H Sylvester's, H_ij = (-1)^popcount(i & j), and the signs of
    # numerics/hadamard.h: s_c = -1 where bit c mod 64 of kPattern is set, flipped for
    # each further 64 channels. Every entry exact (±2^-e).
    pattern = 0x9E3779B97F4A7C15
    assert f"kPattern = 0x{pattern:X}ull;" in HADAMARD_H.read_text()
    bits = format(pattern, "064b")[::-1]  # bits[c]: bit c
    s = torch.tensor([-1.0 if int(bits[c % 64]) ^ (c // 64 % 2) else 1.0 for c in range(d)],
                     dtype=torch.float64)
    h = torch.tensor([[(-1.0) ** bin(a & b).count("1") for b in range(d)] for a in range(d)],
                     dtype=torch.float64)
    assert torch.equal(rq, s[:, None] * h * 2.0 ** -((m + 1) // 2))
    assert torch.equal(rk, s[:, None] * h * 2.0 ** -(m // 2))
    # Every channel's sign: column 0 of H is ones, so R[c, 0] carries s_c.
    assert [int(x) for x in rq[:, 0] < 0] == [int(bits[c % 64]) ^ (c // 64 % 2) for c in range(d)]
    if d == 128:  # the second 64 channels: the first 64's signs flipped
        assert torch.equal(rq[64:, 0], -rq[:64, 0])
    # The matrices are the emulator's rotation: its algorithm (hadamard_rotate above) on
    # the unit rows gives them exactly (each butterfly adds ±1s and 0s)...
    for for_q, r in ((True, rq), (False, rk)):
        assert torch.equal(hadamard_rotate(torch.eye(d), for_q), r.float())
    # ... and on FP32 rows x·R up to its rounding: m FP32 additions per element, so each
    # element within γ_m·2^-e·|x|₁ (γ_n = n·u/(1 - n·u), u = 2^-24; signs and 2^-e
    # exact), plus the FP64 product's γ_d (u = 2^-53) of the same sum.
    x = randn(64, d, seed=d, dtype=torch.float32)

    def gamma(n, u):
        return n * u / (1 - n * u)

    for for_q, r in ((True, rq), (False, rk)):
        err = (hadamard_rotate(x, for_q).double() - x.double() @ r).abs()
        l1 = x.double().abs().sum(-1, keepdim=True)
        assert (err <= (gamma(m, 2.0**-24) + gamma(d, 2.0**-53)) * r[0, 0].abs() * l1).all()
    with pytest.raises(ValueError, match="not a power of two"):
        tools.hadamard_matrix(96, True)


@pytest.mark.parametrize("seed", SEEDS)
def test_hadamard_rotated_attention_is_attention(seed):
    q, k, v = (randn(2, 4, 33, 64, seed=seed + i) for i in range(3))
    exact = torch._C._nn.scaled_dot_product_attention
    got = tools.hadamard_rotated(exact)(q, k, v, is_causal=True)
    want = exact(q, k, v, is_causal=True)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)  # FP64 throughout: summation order only


FAMILIES = ["gaussian", "large_logits", "heavy_tail", "outlier_channels", "attention_sink"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hq,hkv,n,d", [(2, 2, 512, 128), (4, 2, 300, 64), (2, 1, 333, 96)])
def test_precision_guard_equals_the_emulation(seed, family, hq, hkv, n, d):
    q, k, _ = _C.synthetic_inputs(family, 1, hq, hkv, n, n, d, seed=seed)
    want, threshold = _C.emulated_precision_guard(q, k, 1, hq, hkv, n, n, d)
    assert threshold == tools.GUARD_THRESHOLD_NATS
    tq = torch.frombuffer(bytearray(q), dtype=torch.float32).view(1, hq, n, d).half()
    tk = torch.frombuffer(bytearray(k), dtype=torch.float32).view(1, hkv, n, d).half()
    sigma, flagged = tools.precision_guard(tq, tk)
    want = torch.tensor(want, dtype=torch.float64).view(1, hq)
    # The same codes and steps; only the FP64 sums' order differs (measured <= 5e-8).
    assert torch.allclose(sigma, want, rtol=1e-6, atol=0)
    near = (want - tools.GUARD_THRESHOLD_NATS).abs() < 1e-6 * want
    assert torch.equal(flagged[~near], (want > tools.GUARD_THRESHOLD_NATS)[~near])


def test_precision_guard_flags_what_the_report_says():
    # The report's shape (2 heads x 1024 x d 128, seed 0): large_logits, heavy_tail and
    # outlier_channels flagged, gaussian and attention_sink not (docs/accuracy-report.md).
    for family, expect in [("gaussian", False), ("large_logits", True), ("heavy_tail", True),
                           ("outlier_channels", True), ("attention_sink", False)]:
        q, k, _ = _C.synthetic_inputs(family, 1, 2, 2, 1024, 1024, 128, seed=0)
        tq = torch.frombuffer(bytearray(q), dtype=torch.float32).view(1, 2, 1024, 128)
        tk = torch.frombuffer(bytearray(k), dtype=torch.float32).view(1, 2, 1024, 128)
        assert tools.precision_guard(tq, tk)[1].all().item() is expect, family


# Per Toy call and head, powers of two: a query gain g leaves the guard's INT8 codes as
# they were and multiplies both steps' terms of σ² by g², so σ(g·q) = g·σ(q) exactly.
GUARD_GAINS = ((1.0, 1.0), (8.0, 8.0), (0.25, 8.0))


def test_compare_records_the_guard_per_layer():
    model = Toy(5, gains=GUARD_GAINS).eval()
    seen = []

    def recording(query, key, value, *args, **kwargs):  # the exact SDPA, keeping its inputs
        seen.append((query, key))
        return torch._C._nn.scaled_dot_product_attention(query, key, value, *args, **kwargs)

    def guard_of(calls):  # per call, the guard on its very q and k, computed here
        return [(flagged.double().mean().item(), sigma.max().item())
                for sigma, flagged in (tools.precision_guard(q, k) for q, k in calls)]

    # The guard's calls are the probe's, the last three that `recording` saw: before them
    # it ran the model on its own, on the same inputs (it is the exact SDPA).
    x = randn(2, 24, 64, seed=9, dtype=torch.float32)
    report = tools.compare(lambda: model(x), {"exact": recording}, floor=None, guard=True)
    assert len(seen) == 6
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(seen[:3], seen[3:]))
    thr = tools.GUARD_THRESHOLD_NATS
    for i, (q, k) in enumerate(seen[3:]):
        gain = torch.tensor(GUARD_GAINS[i]).view(1, 2)
        sigma, _ = tools.precision_guard(q, k)
        base, _ = tools.precision_guard(q / gain[..., None, None], k)  # exact: g = 2^j
        assert torch.equal(sigma, base * gain)  # σ(g·q) = g·σ(q), bit for bit
        # Toy's Gaussian projections at gain 1 give σ between thr/8 and 4·thr in every
        # call (0.48-1.26·thr here), below thr in the first: so gain 8 must flag, and
        # gain 1 in the first call and gain 1/4 must not.
        assert ((base > thr / 8) & (base < 4 * thr)).all()
        assert i > 0 or (base < thr).all()
    want = guard_of(seen[3:])
    # Not flagged (Gaussian), all heads flagged (gain 8), one head of two (1/4 and 8).
    assert [f for f, _ in want] == [0.0, 1.0, 0.5]
    summary = report.guard_summary()
    # The report's values are the guard's on those inputs: the same function of the same
    # tensors, so equal exactly.
    assert summary == [{"layer": i, "calls": 1, "flagged": f, "sigma_max": s}
                       for i, (f, s) in enumerate(want)]
    assert report.to_dict()["guard"] == summary
    assert "precision guard, heads flagged per layer: 0: 0.00, 1: 1.00, 2: 0.50" in report.table()

    # Two batches as three layers (the second batch scaled by 4: its first call's q and k
    # 4x, σ 16x): per layer the mean of its two calls' flagged shares and the larger σ.
    seen.clear()
    xs = [x, 4 * randn(2, 24, 64, seed=10, dtype=torch.float32)]
    run = lambda: torch.cat([model(xb) for xb in xs])  # noqa: E731
    report = tools.compare(run, {"exact": recording}, floor=None, guard=True, layer_of=lambda i: i % 3)
    assert len(seen) == 12
    want = guard_of(seen[6:])
    assert want[0][0] != want[3][0]  # the first layer's calls differ in their share
    assert report.guard_summary() == [
        {"layer": i, "calls": 2, "flagged": (want[i][0] + want[i + 3][0]) / 2,
         "sigma_max": max(want[i][1], want[i + 3][1])} for i in range(3)]


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("seed", SEEDS)
def test_emulated_attention_modes(seed):
    from tolerances import MIN_COSSIM

    q = randn(2, 4, 70, 64, seed=seed, dtype=torch.bfloat16)
    k = (randn(2, 2, 90, 64, seed=seed + 1) + 0.3).bfloat16()
    v = randn(2, 2, 90, 64, seed=seed + 2, dtype=torch.bfloat16)
    mask = randn(2, 1, 70, 90, seed=seed + 3) > -0.5
    exact = torch._C._nn.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                      enable_gqa=True)
    out = {m: tools.emulated_attention(m)(q, k, v, attn_mask=mask, enable_gqa=True)
           for m in ("fast", "auto", "precise", "int8qk_fp16pv", "int8qk_int8pv")}
    assert _cos(out["fast"], exact) >= MIN_COSSIM  # the SA2-8b scheme's bound
    assert _cos(out["int8qk_int8pv"], exact) >= MIN_COSSIM
    # precise: 16-bit products of BF16-exact inputs, FP32 sums, O rounded to BF16
    # (relative 2^-9 per element: 1 - CosSim <= 2^-19).
    assert _cos(out["precise"], exact) >= 1 - 2.0**-17
    assert _cos(out["int8qk_fp16pv"], exact) > _cos(out["fast"], exact)
    # auto is fast or precise per head, bit for bit.
    for b in range(2):
        for h in range(4):
            a = out["auto"][b, h]
            assert torch.equal(a, out["fast"][b, h]) or torch.equal(a, out["precise"][b, h])
    # A boolean mask is the additive one with -inf.
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(tools.emulated_attention("fast")(q, k, v, attn_mask=additive, enable_gqa=True),
                       out["fast"])
    # is_causal is SDPA's top-left rule (Nq < Nkv here).
    causal = torch._C._nn.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                       enable_gqa=True)
    assert _cos(tools.emulated_attention("precise")(q, k, v, is_causal=True, enable_gqa=True),
                causal) >= 1 - 2.0**-17
    with pytest.raises(ValueError, match="allowed: fast, auto"):
        tools.emulated_attention("slow")
