"""qattn.attention(scheme="sa3_nvfp4"), SageAttention3's NVFP4 arithmetic, on the GPU.

Runs on a Hopper GPU (sm_90); skipped elsewhere with the reason. The kernel equals its
CPU emulation (src/emulate/sage3) to rounding, element by element, in the C++ suite
(tests/gpu/test_sage3_forward.cpp); here the Python layer is checked: shapes, layouts,
dtypes and the op paths, against FP64 within the scheme's own accuracy. That accuracy is
the emulator's: on the accuracy report's Gaussian inputs NVFP4 SageAttention3 reaches
CosSim 0.9816 and relative L1 0.191 (docs/accuracy-report.md, "schemes"): E2M1 keeps one
mantissa bit, so Q, K, P and V each carry a relative rounding error of several percent.
The bounds below leave 1 − CosSim at ~1.6× and the L1 at ~1.3× the emulator's figure,
for other seeds and shapes; a kernel off by more than rounding (a wrong scale, a lost
smoothing term, a mis-indexed block) lands far below them (0.9 and less).
"""

import math

import pytest

from gpu import require_sm90

torch, qattn = require_sm90()

from qattn import QattnError  # noqa: E402
from qattn.errors import QattnUnsupportedError  # noqa: E402

MIN_COSSIM = 0.97
MAX_REL_L1 = 0.25
DEV = "cuda"


def reference(q, k, v, causal, layout):
    """FP64 attention, causal aligned bottom-right, GQA; (B, H, N, d)."""
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    nq, nkv, d = q.shape[2], k.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nkv, device=q.device)[None, :]
        s = s.masked_fill(j > i + nkv - nq, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = p @ v
    return o if layout == "HND" else o.transpose(1, 2)


def make(b, hq, hkv, nq, nkv, d, dtype, layout, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def t(h, n, bias=0.0):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        x = torch.randn(shape, generator=g, device=DEV)
        return (x + bias).to(dtype)

    k_bias = torch.randn(d, generator=g, device=DEV)  # what K smoothing removes
    return t(hq, nq), t(hkv, nkv, k_bias), t(hkv, nkv)


def cossim(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 4, 512, 512), (1, 8, 2, 333, 777), (1, 4, 1, 300, 129)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_within_the_scheme(dtype, layout, d, causal, shape):
    b, hq, hkv, nq, nkv = shape
    q, k, v = make(b, hq, hkv, nq, nkv, d, dtype, layout, seed=nq + d)
    o, lse = qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=True,
                             causal_alignment="bottom_right", scheme="sa3_nvfp4")
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    ref = reference(q, k, v, causal, layout)
    if causal and nq > nkv:  # bottom-right: the first nq - nkv rows see no key
        seq = 2 if layout == "HND" else 1
        assert (o.narrow(seq, 0, nq - nkv) == 0).all()
        assert torch.isneginf(lse[:, :, : nq - nkv]).all()
    assert torch.isfinite(o).all()
    cs, l1 = cossim(o, ref), rel_l1(o, ref)
    assert cs >= MIN_COSSIM, f"CosSim {cs:.5f} < {MIN_COSSIM}"
    assert l1 <= MAX_REL_L1, f"relative L1 {l1:.4f} > {MAX_REL_L1}"


def test_layouts_and_op_paths_give_the_same_bits():
    q, k, v = make(1, 8, 2, 400, 400, 128, torch.bfloat16, "HND", seed=3)
    o = qattn.attention(q, k, v, is_causal=True, scheme="sa3_nvfp4")
    o_nhd = qattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            is_causal=True, layout="NHD", scheme="sa3_nvfp4")
    assert torch.equal(o, o_nhd.transpose(1, 2))
    o_op, _ = torch.ops.qattn.attention_sa3_nvfp4(q, k, v, True, None, "HND", False)
    assert torch.equal(o, o_op)

    def f(q, k, v):
        return qattn.attention(q, k, v, is_causal=True, scheme="sa3_nvfp4")

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), o)


def test_differs_from_sa2():
    """The scheme switch reaches the kernel: SA3's error is far above SA2-8b's."""
    q, k, v = make(1, 4, 4, 512, 512, 128, torch.bfloat16, "HND", seed=5)
    ref = reference(q, k, v, False, "HND")
    sa2 = cossim(qattn.attention(q, k, v), ref)
    sa3 = cossim(qattn.attention(q, k, v, scheme="sa3_nvfp4"), ref)
    assert sa2 > 0.999 and sa3 < 0.995, (sa2, sa3)


def test_opcheck():
    q, k, v = make(1, 4, 2, 256, 256, 64, torch.bfloat16, "HND", seed=7)
    torch.library.opcheck(torch.ops.qattn.attention_sa3_nvfp4.default,
                          (q, k, v, True, None, "HND", True),
                          test_utils=("test_schema", "test_faketensor"))


def test_what_the_scheme_declines_is_named():
    q, k, v = make(1, 4, 4, 256, 128, 128, torch.bfloat16, "HND", seed=9)
    with pytest.raises(QattnError, match="scheme"):
        qattn.attention(q, k, v, scheme="sa4")
    with pytest.raises(QattnError, match="window_size, kv_lengths or attn_mask"):
        qattn.attention(q, k, v, window_size=(64, 0), scheme="sa3_nvfp4")
    with pytest.raises(QattnError, match="bottom_right"):
        qattn.attention(q, k, v, is_causal=True, scheme="sa3_nvfp4")  # top-left, Nq != Nkv
    q96, k96, v96 = (t[..., :96].contiguous() for t in (q, k, v))
    with pytest.raises(QattnError, match="head_dim"):
        qattn.attention(q96, k96, v96, scheme="sa3_nvfp4")
    qg = q.clone().requires_grad_()
    with pytest.raises(QattnUnsupportedError, match="no backward"):
        qattn.attention(qg, k, v, scheme="sa3_nvfp4")
    with torch.no_grad():
        qattn.attention(qg, k, v, scheme="sa3_nvfp4")  # inference on the same tensors runs
