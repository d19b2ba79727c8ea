"""qattn._C.synthetic_inputs, the accuracy report's generator that bench/accuracy.py runs
the GPU on: the families' stated properties (src/emulate/synthetic.h), on a fixed seed
and on a fresh one. CPU only; needs torch and qattn._C."""

import random

import pytest

torch = pytest.importorskip("torch")
_C = pytest.importorskip("qattn._C")

SHAPE = (1, 2, 192, 64)  # (B, H, N, d)
U = 2.0**-11  # FP16's unit roundoff: a normal value rounds with relative error <= U


def family(name, seed, **kw):
    b, h, n, d = SHAPE
    raw = _C.synthetic_inputs(name, b, h, h, n, n, d, seed=seed, **kw)
    return [torch.frombuffer(bytearray(t), dtype=torch.float32).view(SHAPE).double() for t in raw]


SEEDS = [0, random.randrange(1, 2**32)]


@pytest.mark.parametrize("seed", SEEDS)
def test_values_are_fp16_and_repeat(seed):
    q, k, v = family("gaussian", seed)
    for t in (q, k, v):
        assert torch.equal(t.float().half().double(), t)  # FP16-exact
        assert t.std() > 0.5  # not a constant
    again = family("gaussian", seed)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = family("gaussian", seed + 1)
    assert not torch.equal(q, other[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_large_logits_scale_q_only(seed):
    g, l = family("gaussian", seed), family("large_logits", seed, large_logit_scale=8.0)
    # λ = 8 is a power of two: FP16(8x) = 8·FP16(x) wherever x is normal in FP16.
    normal = g[0].abs() >= 2.0**-14
    assert torch.equal(l[0][normal], 8.0 * g[0][normal])
    assert torch.equal(l[1], g[1]) and torch.equal(l[2], g[2])


@pytest.mark.parametrize("seed", SEEDS)
def test_outlier_channels_keep_every_logit(seed):
    g, o = family("gaussian", seed), family("outlier_channels", seed)
    s_g = g[0][0, 0] @ g[1][0, 0].T
    s_o = o[0][0, 0] @ o[1][0, 0].T
    # Each product q_c·k_c is the Gaussian one before rounding; the two families round
    # each factor once (relative U each), so a term moves by at most ~4U of |q_c·k_c|.
    bound = 4.01 * U * (g[0][0, 0].abs() @ g[1][0, 0].abs().T) + 1e-9
    assert ((s_o - s_g).abs() <= bound).all()
    # ... while some channels are 32x larger than the Gaussian family's in q or k.
    assert o[0].abs().amax() > 8 * g[0].abs().amax() and o[1].abs().amax() > 8 * g[1].abs().amax()
    assert torch.equal(o[2], g[2])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown family 'peaked'.*gaussian"):
        _C.synthetic_inputs("peaked", 1, 1, 1, 8, 8, 16)
    with pytest.raises(ValueError, match="heads_kv must divide heads_q"):
        _C.synthetic_inputs("gaussian", 1, 3, 2, 8, 8, 16)
