"""qattn.attention on the GPU against an FP64 reference and torch SDPA.

Runs on a Hopper GPU (sm_90); skipped elsewhere with the reason. Tolerances follow
the scheme and come from the table shared with the C++ suite
(tests/tolerances/sage2_8b.json, read by tolerances.py; each bound's derivation is
there and in docs/design.md "Numerics"): SageAttention2-8b (INT8 Q·Kᵀ, E4M3 P·V) keeps
a cosine similarity of at least MIN_COSSIM to the exact result on Gaussian inputs
(SageAttention2 reports ~0.9999 on real models), so every output check asserts
CosSim >= MIN_COSSIM and a relative L1 error <= MAX_REL_L1; the LSE, whose error is
that of the INT8 scores, within LSE_ATOL (natural log) per row.
"""

import math
import warnings

import pytest

from gpu import require_sm90

torch, qattn = require_sm90()

from qattn import QattnError  # noqa: E402

from tolerances import LSE_ATOL, MAX_REL_L1, MIN_COSSIM  # noqa: E402

DEV = "cuda"


# ---- reference and metrics ---------------------------------------------------------


def to_hnd(t, layout):
    return t if layout == "HND" else t.transpose(1, 2)


def reference(q, k, v, causal, scale=None, layout="HND", alignment="top_left"):
    """FP64 attention with a causal mask aligned top-left (query i sees keys j <= i,
    SDPA's rule) or bottom-right (j <= i + Nkv - Nq), and GQA; returns (o, lse) in HND.
    Rows that see no key give o = 0 and lse = -inf (qattn's convention)."""
    q, k, v = (to_hnd(t, layout).double() for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    nq, nkv, d = q.shape[2], k.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(d))
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nkv, device=q.device)[None, :]
        offset = nkv - nq if alignment == "bottom_right" else 0
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v, lse


def cossim(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def rel_l1(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().sum() / b.abs().sum()).item()


def assert_close_to_reference(o, ref, what=""):
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    cs, l1 = cossim(o, ref), rel_l1(o, ref)
    assert cs >= MIN_COSSIM, f"{what}: CosSim {cs:.6f} < {MIN_COSSIM}"
    assert l1 <= MAX_REL_L1, f"{what}: relative L1 {l1:.4f} > {MAX_REL_L1}"


def randn(shape, dtype, seed):
    print(f"randn {tuple(shape)} seed {seed}")  # shown by pytest when a test fails
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


def make_qkv(b, hq, hkv, nq, nkv, d, dtype=torch.bfloat16, layout="HND", seed=0):
    def shape(h, n):
        return (b, h, n, d) if layout == "HND" else (b, n, h, d)

    return (
        randn(shape(hq, nq), dtype, seed),
        randn(shape(hkv, nkv), dtype, seed + 1),
        randn(shape(hkv, nkv), dtype, seed + 2),
    )


# ---- accuracy ------------------------------------------------------------------------

SHAPES = [  # (B, Hq, Hkv, Nq, Nkv)
    (2, 4, 4, 512, 512),
    (1, 8, 2, 1000, 1000),  # GQA, tails of a 128 tile
    (2, 4, 1, 333, 777),  # MQA, Nq < Nkv
    (1, 4, 4, 700, 300),  # Nq > Nkv: bottom-right causal rows before the diagonal see no key
]
ALIGNMENTS = ["top_left", "bottom_right"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["full", "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_reference(dtype, layout, d, causal, shape):
    b, hq, hkv, nq, nkv = shape
    if causal == "bottom_right" and nq == nkv:
        pytest.skip("the alignments agree when Nq == Nkv")
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, layout, seed=(d * 7919 + nq) % 1000)
    is_causal, alignment = causal != "full", "top_left" if causal == "full" else causal
    o = qattn.attention(q, k, v, is_causal=is_causal, layout=layout, causal_alignment=alignment)
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    ref, _ = reference(q, k, v, is_causal, layout=layout, alignment=alignment)
    assert_close_to_reference(to_hnd(o, layout), ref, f"{shape} d={d} causal={causal}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(d, causal):
    # Nq == Nkv, so SDPA's top-left causal mask equals qattn's bottom-right one.
    q, k, v = make_qkv(2, 8, 8, 1024, 1024, d)
    o = qattn.attention(q, k, v, is_causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=causal
    )
    assert_close_to_reference(o, ref, "vs SDPA fp32")


@pytest.mark.parametrize("d", [8, 36, 72, 100, 120])
def test_other_head_dims_are_padded(d):
    q, k, v = make_qkv(1, 4, 2, 300, 300, d)
    o = qattn.attention(q, k, v, is_causal=True)
    assert o.shape == q.shape and o.is_contiguous()
    assert_close_to_reference(o, reference(q, k, v, True)[0], f"d={d}")


@pytest.mark.parametrize("d", [136, 192, 256])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_head_dims_up_to_256(d, layout):
    """Head dims 129..256 run on the head-dim-256 kernel (sage2_wide_sm90), GQA, causal
    either alignment, with the LSE; the SDPA drop-in takes them on qattn (no fallback)."""
    q, k, v = make_qkv(1, 4, 2, 300, 700, d, seed=d)
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for causal, alignment in ((False, "top_left"), (True, "top_left"), (True, "bottom_right")):
        o, lse = qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=True,
                                 causal_alignment=alignment)
        ref_o, ref_lse = reference(q, k, v, causal, layout=layout, alignment=alignment)
        assert_close_to_reference(to_hnd(o, layout), ref_o, f"d={d} {layout} {causal} {alignment}")
        err = (lse.double() - ref_lse).abs()
        assert err.max().item() <= LSE_ATOL, f"LSE max error {err.max().item():.4f}"
    if layout == "HND":
        previous = qattn.get_fallback()
        qattn.set_fallback("raise")
        try:
            o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        finally:
            qattn.set_fallback(previous)
        assert_close_to_reference(o, reference(q, k, v, True)[0], f"sdpa d={d}")


def test_explicit_scale():
    q, k, v = make_qkv(1, 4, 4, 256, 256, 64)
    for scale in (0.05, 0.3):
        o = qattn.attention(q, k, v, scale=scale)
        assert_close_to_reference(o, reference(q, k, v, False, scale=scale)[0], f"scale={scale}")


@pytest.mark.parametrize("causal", ["full", "top_left", "bottom_right"])
@pytest.mark.parametrize("nq,nkv", [(512, 512), (300, 700), (700, 300)])
def test_lse(causal, nq, nkv):
    q, k, v = make_qkv(2, 4, 2, nq, nkv, 128, seed=7)
    is_causal, alignment = causal != "full", "top_left" if causal == "full" else causal
    o, lse = qattn.attention(q, k, v, is_causal=is_causal, return_lse=True, causal_alignment=alignment)
    ref_o, ref_lse = reference(q, k, v, is_causal, alignment=alignment)
    assert lse.shape == (2, 4, nq) and lse.dtype == torch.float32
    assert_close_to_reference(o, ref_o, "o with lse")
    dead = torch.isinf(ref_lse)  # bottom-right causal rows that see no key (Nq > Nkv)
    assert torch.equal(torch.isneginf(lse), dead)
    assert (o.float()[dead] == 0).all()
    err = (lse.double() - ref_lse)[~dead].abs()
    assert err.max().item() <= LSE_ATOL, f"LSE max error {err.max().item():.4f}"


def test_non_contiguous_and_offset_inputs():
    base_q, k, v = make_qkv(1, 4, 4, 256, 256, 64, layout="NHD")
    q = base_q.transpose(1, 2)  # a HND view of NHD memory: strides (., d, H*d, 1)
    o = qattn.attention(q, k.transpose(1, 2), v.transpose(1, 2))
    assert_close_to_reference(o, reference(q, k.transpose(1, 2), v.transpose(1, 2), False)[0], "view")
    # A view that starts 2 bytes into its storage is copied, not rejected.
    flat = randn((1 + 4 * 256 * 64,), torch.bfloat16, 3)
    q2 = flat[1:].view(1, 4, 256, 64)
    o2 = qattn.attention(q2, k.transpose(1, 2), v.transpose(1, 2))
    assert_close_to_reference(o2, reference(q2, k.transpose(1, 2), v.transpose(1, 2), False)[0], "offset")


# ---- PyTorch integration -------------------------------------------------------------


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(2, 8, 2, 512, 512, 128)

    def f(q, k, v):
        return qattn.attention(q * 1.0, k, v, is_causal=True).float().sum(dim=-1)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)

    # The fake implementation gives the real shapes (lse too) without a GPU call.
    def g(q, k, v):
        o, lse = qattn.attention(q, k, v, return_lse=True, layout="HND")
        return o, lse

    o, lse = torch.compile(g, fullgraph=True)(q, k, v)
    assert o.shape == q.shape and lse.shape == (2, 8, 512)


def test_opcheck():
    q, k, v = make_qkv(1, 4, 2, 256, 256, 64)
    torch.library.opcheck(
        torch.ops.qattn.attention.default,
        (q, k, v, True, None, "HND", True, "per_thread"),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_cuda_graph_capture_and_replay():
    q, k, v = make_qkv(1, 8, 8, 1024, 1024, 128, seed=11)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        for _ in range(2):
            qattn.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qattn.attention(q, k, v, is_causal=True)
    for seed in (21, 31):
        nq, nk, nv = make_qkv(1, 8, 8, 1024, 1024, 128, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, reference(q, k, v, True)[0], f"graph replay {seed}")


def test_no_host_synchronization():
    q, k, v = make_qkv(1, 4, 4, 512, 512, 64)
    qattn.attention(q, k, v)  # first call: library load, allocator warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # the first call of a shape, then its planned call
            qattn.attention(q, k, v, is_causal=True, return_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_runs_on_the_current_stream():
    q, k, v = make_qkv(2, 4, 4, 2048, 2048, 128, seed=5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o = qattn.attention(q, k, v)
        o2 = o * 2  # ordered after qattn on s
    s.synchronize()
    assert_close_to_reference(o2 / 2, reference(q, k, v, False)[0], "side stream")


def test_backward_runs():
    # Gradients against FP64 are tested in test_backward.py.
    q, k, v = make_qkv(1, 4, 4, 128, 128, 64)
    q.requires_grad_(True)
    o = qattn.attention(q, k, v)
    assert o.requires_grad
    o.float().sum().backward()
    assert q.grad.shape == q.shape and bool(torch.isfinite(q.grad).all())


def test_eager_calls_skip_the_dispatcher_and_agree_with_the_op():
    q, k, v = make_qkv(1, 8, 2, 700, 900, 128, seed=13)
    with torch.no_grad():
        assert qattn.ops._direct_call_ok(q, k, v)
        o, lse = qattn.attention(q, k, v, is_causal=True, return_lse=True, causal_alignment="bottom_right")
        o_op, lse_op = torch.ops.qattn.attention(q, k, v, True, None, "HND", True, "per_thread")
        torch.testing.assert_close(o, o_op, rtol=0, atol=0)
        torch.testing.assert_close(lse, lse_op, rtol=0, atol=0)
        # Top-left with Nq != Nkv: the kernel's own top-left alignment, in one call.
        o = qattn.attention(q, k, v, is_causal=True)
        o_op, _ = torch.ops.qattn.attention(q, k, v, True, None, "HND", False, "per_thread",
                                            alignment="top_left")
        torch.testing.assert_close(o, o_op, rtol=0, atol=0)
    # Calls that record autograd take the training op (test_backward.py).
    assert not qattn.ops._direct_call_ok(q.requires_grad_(True), k, v)


@pytest.mark.parametrize("layout,causal,nq,nkv,lse", [
    ("HND", False, 700, 900, True), ("NHD", True, 700, 900, False), ("HND", True, 512, 512, True),
])
def test_planned_calls_give_the_first_calls_bits(layout, causal, nq, nkv, lse):
    # The first call of a shape makes its plan (ops._plans); the next ones use it.
    q, k, v = make_qkv(1, 8, 2, nq, nkv, 128, layout=layout, seed=17)
    qattn.ops._plans.clear()
    with torch.no_grad():
        first = qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=lse)
        assert len(qattn.ops._plans) == 1
        planned = [qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=lse)
                   for _ in range(2)]
        s = torch.cuda.Stream()  # a plan holds no stream: each call reads the current one
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            planned.append(qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=lse))
        torch.cuda.current_stream().wait_stream(s)
        assert len(qattn.ops._plans) == 1
        for out in planned:
            for got, want in zip(out if lse else (out,), first if lse else (first,)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        # The op's path (torch.ops) uses the same plans.
        o_op, _ = torch.ops.qattn.attention(q, k, v, causal, None, layout, lse, "per_thread",
                                            **({"alignment": "top_left"} if causal and nq != nkv else {}))
        torch.testing.assert_close(o_op, first[0] if lse else first, rtol=0, atol=0)


def test_planned_shape_with_a_misaligned_input_is_copied():
    q, k, v = make_qkv(1, 4, 4, 256, 256, 64, seed=19)
    qattn.ops._plans.clear()
    want = qattn.attention(q, k, v)
    flat = torch.empty(1 + q.numel(), dtype=q.dtype, device=DEV)
    q2 = flat[1:].view(q.shape)
    q2.copy_(q)
    assert q2.stride() == q.stride() and q2.data_ptr() % 16 != 0
    torch.testing.assert_close(qattn.attention(q2, k, v), want, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_plans_are_per_device():
    q, k, v = make_qkv(1, 4, 4, 512, 512, 128, seed=23)
    qattn.ops._plans.clear()
    want = qattn.attention(q, k, v, is_causal=True)
    q1, k1, v1 = (t.to("cuda:1") for t in (q, k, v))
    for _ in range(2):  # q's device not current: the call switches to it
        got = qattn.attention(q1, k1, v1, is_causal=True)
        assert got.device == q1.device
    with torch.cuda.device(1):  # current: the planned call of device 1
        for _ in range(2):
            got = qattn.attention(q1, k1, v1, is_causal=True)
    torch.cuda.synchronize(1)
    assert len(qattn.ops._plans) == 2
    torch.testing.assert_close(got.to(DEV), want, rtol=0, atol=0)


def test_dispatch_modes_see_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv(1, 4, 4, 256, 256, 64, seed=17)
    with Record() as mode:
        o = qattn.attention(q, k, v)
    assert any(name.startswith("qattn.attention") for name in mode.ops), mode.ops
    torch.testing.assert_close(o, qattn.attention(q, k, v), rtol=0, atol=0)


def test_sageattn_alias():
    q, k, v = make_qkv(1, 8, 2, 300, 300, 128, layout="NHD", seed=9)
    o = qattn.sageattn(q, k, v, tensor_layout="NHD", is_causal=True)
    torch.testing.assert_close(o, qattn.attention(q, k, v, is_causal=True, layout="NHD"), rtol=0, atol=0)
    o, lse = qattn.sageattn(q, k, v, tensor_layout="NHD", return_lse=True, qk_quant_gran="per_warp")
    assert lse.shape == (1, 8, 300)
    with pytest.warns(UserWarning, match="pv_accum_dtype"):
        qattn.sageattn(q, k, v, tensor_layout="NHD", pv_accum_dtype="fp32+fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qattn.sageattn(q, k, v, tensor_layout="NHD", smooth_k=True)


@pytest.mark.parametrize("granularity", ["per_thread", "per_warp", "per_block"])
def test_granularities(granularity):
    q, k, v = make_qkv(1, 4, 4, 512, 512, 128, seed=13)
    o = qattn.attention(q, k, v, granularity=granularity)
    assert_close_to_reference(o, reference(q, k, v, False)[0], granularity)


def test_kernel_only_helper_matches():
    q, k, v = make_qkv(1, 4, 4, 512, 512, 128, seed=17)
    run = qattn.attention_kernel_only(q, k, v, is_causal=True)
    o = run().clone()
    torch.testing.assert_close(o, qattn.attention(q, k, v, is_causal=True), rtol=0, atol=0)


# ---- errors ----------------------------------------------------------------------------


def expect_error(match, fn, status=None):
    with pytest.raises(QattnError, match=match) as info:
        fn()
    if status is not None:
        assert info.value.status_name == status, info.value.status_name
    return info.value


def test_errors_name_the_parameter():
    q, k, v = make_qkv(1, 4, 2, 128, 128, 64)
    expect_error("dtype", lambda: qattn.attention(q.float(), k.float(), v.float()))
    expect_error("k.dtype", lambda: qattn.attention(q, k.half(), v))
    expect_error("layout", lambda: qattn.attention(q, k, v, layout="BHSD"))
    expect_error("heads_q = 4 is not a multiple of heads_kv = 3",
                 lambda: qattn.attention(q, *make_qkv(1, 3, 3, 128, 128, 64)[1:]))
    expect_error("4 dimensions|dimensions", lambda: qattn.attention(q[0], k[0], v[0]))
    expect_error("CUDA", lambda: qattn.attention(q.cpu(), k.cpu(), v.cpu()))
    expect_error("scale", lambda: qattn.attention(q, k, v, scale=float("nan")))
    expect_error("scale", lambda: qattn.attention(q, k, v, scale=-1.0))
    expect_error("granularity", lambda: qattn.attention(q, k, v, granularity="per_tensor"))
    expect_error("causal_alignment", lambda: qattn.attention(q, k, v, causal_alignment="center"))
    expect_error("k .* and v .* differ", lambda: qattn.attention(q, k, v[:, :, :64]))
    big = make_qkv(1, 2, 2, 64, 64, 264)
    err = expect_error("head_dim = 264", lambda: qattn.attention(*big), "QATTN_ERROR_UNSUPPORTED")
    assert "1..128" in str(err) and "129..256" in str(err)


def test_device_queries():
    assert qattn.device_supported()
    assert qattn.__version__.count(".") == 2
