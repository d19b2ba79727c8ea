"""qattn.attention(precision="precise" | "auto") and qattn.set_precision on the GPU.

Runs on a Hopper GPU (sm_90); skipped elsewhere with the reason. The kernels equal their
CPU emulation head by head in the C++ suite (tests/gpu/test_precise_forward.cpp,
test_precision_auto.cpp); here the Python layer: layouts, dtypes, masks, the op paths,
and what each mode promises.
  - "precise": 16-bit products of 16-bit inputs with FP32 sums, so its error to FP64 is
    its own roundings: half an ulp of the output and of P per element (2^-9 relative in
    bf16, 2^-12 in fp16), 1 − CosSim ≤ 2·rel² — 2^-17 in bf16, 2^-23 in fp16 — bounded
    here at 4× that, whatever the logits' scale.
  - "auto": each head's output is, bit for bit, "fast"'s or "precise"'s; no Gaussian
    head of the accuracy report's recipe is flagged, every outlier-channel head is.
"""

import math

import pytest

from gpu import require_sm90

torch, qattn = require_sm90()

from qattn import _C  # noqa: E402
from tolerances import MIN_COSSIM  # noqa: E402  (the SA2-8b scheme's bound)

DEV = "cuda"
PRECISE_BOUND = {torch.bfloat16: 2.0 ** -15, torch.float16: 2.0 ** -21}


def reference(q, k, v, causal, layout, window=(-1, -1)):
    """FP64 attention, top-left causal (SDPA's rule) and window, GQA; in the layout."""
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    nq, nkv, d = q.shape[2], k.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nkv, device=q.device)[None, :]
    hidden = torch.zeros(nq, nkv, dtype=torch.bool, device=q.device)
    if causal:
        hidden |= j > i
    if window[0] >= 0:
        hidden |= j < i - window[0]
    if window[1] >= 0 and not causal:
        hidden |= j > i + window[1]
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0)
    o = p @ v
    return o if layout == "HND" else o.transpose(1, 2)


def cossim(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def make(b, hq, hkv, nq, nkv, d, dtype, layout, seed, q_gain=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def t(h, n, gain=1.0):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        return (gain * torch.randn(shape, generator=g, device=DEV)).to(dtype)

    return t(hq, nq, q_gain), t(hkv, nkv), t(hkv, nkv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_gain", [1.0, 8.0], ids=["gaussian", "large_logits"])
def test_precise_is_sixteen_bit_attention(dtype, layout, d, causal, q_gain):
    q, k, v = make(2, 8, 2, 333, 517, d, dtype, layout, seed=d + int(causal), q_gain=q_gain)
    o, lse = qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=True,
                             precision="precise")
    assert o.shape == q.shape and o.dtype == dtype
    assert 1 - cossim(o, reference(q, k, v, causal, layout)) <= PRECISE_BOUND[dtype]
    assert torch.isfinite(lse).all()


def test_precise_masks_and_padded_head_dim():
    q, k, v = make(3, 4, 4, 300, 300, 100, torch.bfloat16, "HND", seed=7)
    o = qattn.attention(q, k, v, is_causal=True, window_size=(64, 0), precision="precise")
    assert 1 - cossim(o, reference(q, k, v, True, "HND", (64, 0))) <= PRECISE_BOUND[torch.bfloat16]
    lengths = torch.tensor([300, 1, 0], dtype=torch.int32, device=DEV)
    o, lse = qattn.attention(q, k, v, kv_lengths=lengths, return_lse=True, precision="precise")
    assert (o[2] == 0).all() and torch.isneginf(lse[2]).all()  # no key: O = 0, LSE = -inf
    assert torch.allclose(o[1].float(), v[1, :, :1].float().expand_as(o[1]))  # one key: its V
    full = qattn.attention(q[:1], k[:1], v[:1], precision="precise")
    assert torch.equal(o[:1], full)


def family(name, heads=4, n=512, d=128, seed=0):
    shape = (1, heads, n, d)
    raw = _C.synthetic_inputs(name, 1, heads, heads, n, n, d, seed=seed)
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.float32).view(shape)
                 .to(device=DEV, dtype=torch.float16) for b in raw[:3])


@pytest.mark.parametrize("name", ["gaussian", "large_logits", "heavy_tail", "outlier_channels",
                                  "attention_sink"])
def test_auto_is_fast_or_precise_per_head(name):
    q, k, v = family(name)
    fast = qattn.attention(q, k, v, is_causal=True)
    precise = qattn.attention(q, k, v, is_causal=True, precision="precise")
    auto = qattn.attention(q, k, v, is_causal=True, precision="auto")
    took = ["precise" if torch.equal(auto[0, h], precise[0, h]) else
            "fast" if torch.equal(auto[0, h], fast[0, h]) else "neither" for h in range(q.shape[1])]
    assert "neither" not in took, took
    if name == "gaussian":
        assert took == ["fast"] * 4  # σ 0.019 nats against the threshold 0.0265
    if name == "outlier_channels":
        assert took == ["precise"] * 4  # σ 5.3-6.5 nats
        ref = reference(q, k, v, True, "HND")
        assert 1 - cossim(auto, ref) <= PRECISE_BOUND[torch.float16]
        assert cossim(fast, ref) < 0.99  # what auto is for: fast reads 0.919 here


def test_set_precision_runs_the_drop_in_in_that_mode():
    q, k, v = family("outlier_channels", heads=2, n=256)
    previous = qattn.set_precision("auto")
    try:
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        qattn.set_precision(previous)
    want = qattn.attention(q, k, v, is_causal=True, precision="auto")
    assert torch.equal(o, want)
    assert not torch.equal(o, qattn.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("mode", ["precise", "auto"])
def test_boolean_attn_mask(mode):
    """A padding-style boolean mask, as transformers passes it (B, 1, Nq, Nkv), with one
    entry whose rows see no key (O = 0, the drop-in's convention)."""
    q, k, v = make(3, 4, 4, 200, 200, 64, torch.bfloat16, "HND", seed=11)
    lengths = torch.tensor([200, 37, 0], device=DEV)
    mask = (torch.arange(200, device=DEV)[None, :] < lengths[:, None])[:, None, None, :]
    mask = mask.expand(3, 1, 200, 200)
    o = qattn.attention(q, k, v, attn_mask=mask, precision=mode)
    assert (o[2] == 0).all()
    for b in range(2):
        n = int(lengths[b])
        ref = reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], False, "HND")
        bound = PRECISE_BOUND[torch.bfloat16] if mode == "precise" else 1 - MIN_COSSIM
        assert 1 - cossim(o[b:b + 1], ref) <= bound


@pytest.mark.parametrize("mode", ["precise", "auto"])
def test_cuda_graph_replays_decide_on_the_new_inputs(mode):
    """Both modes capture into a CUDA graph (nothing is read back to the host), and a
    replay on new inputs equals an eager call on them bit for bit: for "auto" the guard
    decides again on the GPU, so a replay after Gaussian inputs that gets outlier-channel
    inputs runs those heads in 16 bits."""
    q, k, v = family("gaussian", heads=2, n=256)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        for _ in range(2):
            qattn.attention(q, k, v, is_causal=True, precision=mode)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qattn.attention(q, k, v, is_causal=True, precision=mode)
    for name in ("outlier_channels", "gaussian"):
        nq, nk, nv = family(name, heads=2, n=256, seed=5)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qattn.attention(nq, nk, nv, is_causal=True, precision=mode)), name
        if mode == "auto" and name == "outlier_channels":
            ref = reference(nq, nk, nv, True, "HND")
            assert 1 - cossim(out, ref) <= PRECISE_BOUND[torch.float16]
