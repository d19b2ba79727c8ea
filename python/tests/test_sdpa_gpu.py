"""qattn.scaled_dot_product_attention on the GPU against torch SDPA on the same inputs.

Runs on a Hopper GPU (sm_90); skipped elsewhere with the reason. The reference is SDPA
in FP32 on the inputs upcast (exact up to FP32 rounding, far below the scheme's error);
the bounds are the SageAttention2-8b ones shared with the C++ suite
(tests/tolerances/sage2_8b.json, read by tolerances.py). Calls meant for qattn run under
set_fallback("raise"), so a silent fallback to SDPA would fail them rather than pass.
"""

import warnings

import pytest

from gpu import require_sm90

torch, qattn = require_sm90()

from qattn import QattnFallbackWarning, QattnUnsupportedError, sdpa  # noqa: E402
from tolerances import MAX_REL_L1, MIN_COSSIM  # noqa: E402

F = torch.nn.functional
DEV = "cuda"


@pytest.fixture(autouse=True)
def strict():
    """qattn or an error, unless a test asks for the fallback."""
    previous = qattn.set_fallback("raise")
    sdpa._warned.clear()
    yield
    qattn.set_fallback(previous)
    sdpa._warned.clear()


def randn(shape, dtype=torch.bfloat16, seed=0):
    print(f"randn {tuple(shape)} seed {seed}")  # shown by pytest when a test fails
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


def qkv(b, hq, hkv, nq, nkv, d, dtype=torch.bfloat16, seed=0):
    return randn((b, hq, nq, d), dtype, seed), randn((b, hkv, nkv, d), dtype, seed + 1), randn(
        (b, hkv, nkv, d), dtype, seed + 2
    )


def sdpa_fp32(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def assert_close(o, ref, what):
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    a, b = o.double().flatten(), ref.double().flatten()
    cs = (a @ b / (a.norm() * b.norm())).item()
    l1 = ((a - b).abs().sum() / b.abs().sum()).item()
    assert cs >= MIN_COSSIM, f"{what}: CosSim {cs:.6f} < {MIN_COSSIM}"
    assert l1 <= MAX_REL_L1, f"{what}: relative L1 {l1:.4f} > {MAX_REL_L1}"


# ---- the qattn path against SDPA ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nq,nkv", [(512, 512), (333, 777), (777, 333), (1, 300), (300, 1), (129, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_sdpa_top_left(dtype, nq, nkv, causal):
    q, k, v = qkv(2, 4, 4, nq, nkv, 128, dtype, seed=nq + 3 * nkv)
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert o.shape == q.shape and o.dtype == dtype
    assert_close(o, sdpa_fp32(q, k, v, is_causal=causal), f"Nq={nq} Nkv={nkv} causal={causal}")


@pytest.mark.parametrize("hq,hkv,gqa", [(8, 2, True), (8, 1, True), (8, 1, False), (6, 3, True)])
@pytest.mark.parametrize("nq,nkv", [(400, 400), (200, 600), (600, 200)])
def test_enable_gqa(hq, hkv, gqa, nq, nkv):
    q, k, v = qkv(1, hq, hkv, nq, nkv, 64, seed=hq * 10 + hkv)
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # SDPA's own GQA rule, by repeat_interleave: query head h reads kv head h // (Hq / Hkv).
    g = hq // hkv
    ref = sdpa_fp32(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    assert_close(o, ref, f"Hq={hq} Hkv={hkv} enable_gqa={gqa}")


def test_heads_without_enable_gqa_raise_like_sdpa():
    q, k, v = qkv(1, 8, 2, 128, 128, 64)
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as ours:
        qattn.scaled_dot_product_attention(q, k, v)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("scale", [0.02, 0.125, 0.4])
def test_scale(scale):
    q, k, v = qkv(1, 4, 4, 300, 500, 128, seed=31)
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    assert_close(o, sdpa_fp32(q, k, v, is_causal=True, scale=scale), f"scale={scale}")


@pytest.mark.parametrize("d", [40, 64, 96, 128])
def test_layouts_and_head_dims(d):
    # SDPA callers often pass (B, N, H, d) memory as a transposed view: no copy needed.
    qn, kn, vn = (randn((2, n, 4, d), seed=s) for n, s in ((256, 41), (384, 42), (384, 43)))
    q, k, v = (t.transpose(1, 2) for t in (qn, kn, vn))
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert o.shape == q.shape
    assert_close(o, sdpa_fp32(q, k, v, is_causal=True), f"view d={d}")


def test_compile_fullgraph_matches_eager():
    q, k, v = qkv(2, 8, 2, 700, 300, 128, seed=51)

    def f(q, k, v):
        return qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)  # the same kernel calls


def test_top_left_split_makes_no_host_synchronization():
    q, k, v = qkv(1, 4, 4, 700, 300, 64, seed=55)
    qattn.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        qattn.scaled_dot_product_attention(q, k[:, :, :100], v[:, :, :100], is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- the fallback --------------------------------------------------------------------------


def test_additive_attn_mask_runs_on_qattn_and_dropout_falls_back():
    # A float mask of the query's dtype runs in qattn's kernel; dropout goes to SDPA.
    qattn.set_fallback("warn")
    q, k, v = qkv(1, 4, 4, 256, 256, 64, seed=61)
    keep = torch.rand(256, 256, device=DEV, generator=torch.Generator(device=DEV).manual_seed(62)) > 0.3
    mask = torch.zeros(256, 256, device=DEV, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = qattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.manual_seed(63)
        od = qattn.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    reasons = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(reasons) == 1 and "dropout_p" in reasons[0], reasons
    # The additive 0 / -inf mask is the boolean one: the same tiles, the same visible keys.
    ob = qattn.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    cos = F.cosine_similarity(o.float().flatten(), ob.float().flatten(), dim=0).item()
    assert cos >= 0.9999, cos  # E4M3 roundings of P may flip where the exps differ by an ulp
    torch.manual_seed(63)
    torch.testing.assert_close(od, F.scaled_dot_product_attention(q, k, v, dropout_p=0.2), rtol=0, atol=0)


def test_negative_scale_and_float32_fall_back():
    qattn.set_fallback("warn")
    q, k, v = qkv(1, 4, 4, 128, 128, 64, seed=71)
    with pytest.warns(QattnFallbackWarning, match="scale"):
        o = qattn.scaled_dot_product_attention(q, k, v, scale=-0.125)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, scale=-0.125), rtol=0, atol=0)
    with pytest.warns(QattnFallbackWarning, match="float32"):
        o = qattn.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q.float(), k.float(), v.float()), rtol=0, atol=0)


def test_training_runs_on_qattn_and_backward_works():
    # Gradients against FP64 are tested in test_backward.py; here: no fallback.
    qattn.set_fallback("raise")
    q, k, v = qkv(1, 4, 4, 128, 128, 64, seed=81)
    q.requires_grad_(True)
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---- qattn.attention's bottom-right option --------------------------------------------------


@pytest.mark.parametrize("nq,nkv", [(1, 700), (300, 700), (700, 300)])
def test_bottom_right_matches_masked_sdpa(nq, nkv):
    q, k, v = qkv(2, 8, 2, nq, nkv, 128, seed=91)
    o = qattn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    i = torch.arange(nq, device=DEV)[:, None]
    j = torch.arange(nkv, device=DEV)[None, :]
    mask = j <= i + (nkv - nq)  # a KV cache: the queries are the last Nq positions
    g = 8 // 2
    ref = sdpa_fp32(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)
    live = mask.any(dim=1)  # with Nq > Nkv the first Nq - Nkv rows see no key
    assert (o[:, :, ~live].float() == 0).all()
    assert_close(o[:, :, live], ref[:, :, live], f"bottom-right Nq={nq} Nkv={nkv}")
