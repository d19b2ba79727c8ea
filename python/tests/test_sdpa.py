"""qattn.scaled_dot_product_attention without a GPU: its signature against PyTorch's,
the fallback policy (warning once per reason, the "raise" mode, the environment
variable), PyTorch's own errors for invalid calls, and the top-left causal mapping,
with the kernel replaced by an FP64 emulation of the C ABI's mask rules on CPU tensors.
Needs torch (a CPU build is enough) and qattn._C."""

import inspect
import math
import os
import subprocess
import sys
import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")
F = torch.nn.functional

from qattn import QattnFallbackWarning, QattnUnsupportedError, ops, sdpa  # noqa: E402

SEED = 1234


@pytest.fixture(autouse=True)
def fresh_policy():
    """Each test starts in "warn" mode with no reason warned yet, and leaves it so."""
    previous = qattn.set_fallback("warn")
    sdpa._warned.clear()
    yield
    qattn.set_fallback(previous)
    sdpa._warned.clear()


def randn(*shape, dtype=torch.float32, seed=SEED):
    print(f"randn {shape} seed {seed}")  # shown by pytest when a test fails
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, QattnFallbackWarning)]


# ---- the signature ----------------------------------------------------------------------


def test_signature_matches_torch_sdpa():
    # F.scaled_dot_product_attention is a builtin without an inspectable signature; its
    # ATen schema is the definition (scale and enable_gqa are keyword-only there).
    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    theirs = [(a.name, a.default_value, a.kwarg_only) for a in schema.arguments]
    if "enable_gqa" not in [name for name, _, _ in theirs]:
        pytest.skip(f"PyTorch {torch.__version__} predates SDPA's enable_gqa (2.5)")
    params = inspect.signature(qattn.scaled_dot_product_attention).parameters.values()
    ours = [
        (p.name, None if p.default is inspect.Parameter.empty else p.default,
         p.kind is inspect.Parameter.KEYWORD_ONLY)
        for p in params
    ]
    assert ours == theirs
    # The documented order is the same as the schema's.
    doc = F.scaled_dot_product_attention.__doc__.split("->")[0]
    names = [n.split("=")[0].strip() for n in doc[doc.index("(") + 1 : doc.rindex(")")].split(",")]
    assert names == [name for name, _, _ in theirs]


def test_positional_scale_is_refused_like_torch():
    q = randn(1, 2, 8, 16)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)
    with pytest.raises(TypeError):
        qattn.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)


# ---- the fallback policy ------------------------------------------------------------------


def test_cpu_call_falls_back_with_one_warning():
    q, k, v = randn(2, 4, 40, 16), randn(2, 4, 50, 16, seed=SEED + 1), randn(2, 4, 50, 16, seed=SEED + 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        o2 = qattn.scaled_dot_product_attention(q, k, v)
    got = fallback_warnings(record)
    assert len(got) == 1, [str(w.message) for w in got]
    message = str(got[0].message)
    assert "cpu" in message and "torch.nn.functional.scaled_dot_product_attention" in message
    assert got[0].filename == __file__  # points at the caller
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    assert torch.equal(o2, F.scaled_dot_product_attention(q, k, v))


def test_fallback_works_when_it_replaces_torchs_sdpa(monkeypatch):
    # The usual way to patch a model: F.scaled_dot_product_attention = qattn's. A call
    # that falls back must still reach PyTorch's SDPA (not itself, without end).
    q, k, v = randn(2, 4, 40, 16), randn(2, 4, 50, 16, seed=SEED + 1), randn(2, 4, 50, 16, seed=SEED + 2)
    expect = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", qattn.scaled_dot_product_attention)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(fallback_warnings(record)) == 1
    assert torch.equal(o, expect)


def test_raise_mode_refuses_and_set_fallback_returns_the_previous_mode():
    q = randn(1, 2, 8, 16)
    assert qattn.set_fallback("raise") == "warn"
    assert qattn.get_fallback() == "raise"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(QattnUnsupportedError, match="cpu") as info:
            qattn.scaled_dot_product_attention(q, q, q)
    err = info.value
    assert isinstance(err, NotImplementedError) and isinstance(err, qattn.QattnError)
    assert err.reason == "device cpu" and err.status_name == "QATTN_ERROR_UNSUPPORTED"
    assert qattn.set_fallback("warn") == "raise"
    with pytest.raises(ValueError, match="'warn'.*'raise'"):
        qattn.set_fallback("ignore")
    assert qattn.get_fallback() == "warn"


@pytest.mark.parametrize("value,expect", [("raise", "raise"), ("warn", "warn"), ("", "warn")])
def test_environment_variable_sets_the_mode(value, expect):
    env = dict(os.environ, QATTN_FALLBACK=value, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", "import qattn; print(qattn.get_fallback())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expect


def test_environment_variable_with_a_bad_value_fails_the_import():
    env = dict(os.environ, QATTN_FALLBACK="strict", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", "import qattn"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and "QATTN_FALLBACK = 'strict'" in out.stderr


# Calls qattn would run on a supported device, each changed in one way that qattn does not
# support but SDPA does; (change, reason key).
BF16 = dict(dtype=torch.bfloat16)
DECLINED = [
    # An additive mask of another dtype than the query's (one of its dtype runs on qattn:
    # test_attn_mask.py).
    (dict(attn_mask=torch.zeros(64, 80, dtype=torch.float32).masked_fill(
        ~torch.ones(64, 80, dtype=torch.bool).tril(), float("-inf"))), "attn_mask dtype"),
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(scale=-0.25), "scale"),
    (dict(scale=0.0), "scale"),
    (dict(scale=3e38), "scale"),  # finite in FP32, but sm_scale·log2(e) is not
    (dict(q=randn(2, 4, 64, 32), k=randn(2, 2, 80, 32), v=randn(2, 2, 80, 32)), "dtype torch.float32"),
    (dict(q=randn(4, 64, 32, **BF16), k=randn(4, 80, 32, **BF16), v=randn(4, 80, 32, **BF16)), "rank"),
    (dict(v=randn(2, 2, 80, 48, **BF16)), "shape"),  # Ev != E
    (dict(q=randn(1, 4, 64, 32, **BF16)), "shape"),  # batch broadcast
    (dict(q=randn(2, 4, 64, 264, **BF16), k=randn(2, 2, 80, 264, **BF16), v=randn(2, 2, 80, 264, **BF16)),
     "head_dim"),
    # Head dims 129..256 run on the head-dim-256 kernel, which takes no attn_mask.
    (dict(q=randn(2, 4, 64, 256, **BF16), k=randn(2, 2, 80, 256, **BF16), v=randn(2, 2, 80, 256, **BF16),
          attn_mask=torch.ones(64, 80, dtype=torch.bool)), "attn_mask head_dim"),
    (dict(k=randn(2, 2, 0, 32, **BF16), v=randn(2, 2, 0, 32, **BF16)), "empty"),
]


def supported_call(**change):
    call = dict(q=randn(2, 4, 64, 32, **BF16), k=randn(2, 2, 80, 32, **BF16, seed=SEED + 1),
                v=randn(2, 2, 80, 32, **BF16, seed=SEED + 2), attn_mask=None, dropout_p=0.0,
                is_causal=False, scale=None, enable_gqa=True)
    call.update(change)
    return call


@pytest.fixture
def cpu_counts_as_supported(monkeypatch):
    """The CPU stands in for a supported GPU: the decision goes past the device check,
    and a call that reaches the kernel fails the test."""
    monkeypatch.setattr(sdpa, "_device_runs_qattn", lambda device_type, index: True)

    def no_kernel(*args):
        raise AssertionError("the call reached the kernel")

    monkeypatch.setattr(ops, "_forward", no_kernel)


@pytest.mark.parametrize("change,reason", DECLINED, ids=[r for _, r in DECLINED])
def test_each_unsupported_call_falls_back_with_its_reason(cpu_counts_as_supported, change, reason):
    c = supported_call(**change)
    args = (c["q"], c["k"], c["v"], c["attn_mask"], c["dropout_p"], c["is_causal"], c["scale"], c["enable_gqa"])
    assert sdpa._decline(*args)[0] == reason
    torch.manual_seed(SEED)  # dropout draws the same mask in both calls
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = qattn.scaled_dot_product_attention(*args[:6], scale=c["scale"], enable_gqa=c["enable_gqa"])
    assert [sdpa._decline(*args)[1] in str(w.message) for w in fallback_warnings(record)] == [True]
    torch.manual_seed(SEED)
    ref = F.scaled_dot_product_attention(*args[:6], scale=c["scale"], enable_gqa=c["enable_gqa"])
    assert torch.equal(o, ref)
    qattn.set_fallback("raise")
    with pytest.raises(QattnUnsupportedError) as info:
        qattn.scaled_dot_product_attention(*args[:6], scale=c["scale"], enable_gqa=c["enable_gqa"])
    assert info.value.reason == reason


WIDE = dict(q=randn(2, 4, 64, 256, **BF16), k=randn(2, 2, 80, 256, **BF16), v=randn(2, 2, 80, 256, **BF16))


def test_supported_calls_are_not_declined(cpu_counts_as_supported):
    for change in ({}, dict(is_causal=True), dict(scale=0.125), dict(enable_gqa=False, k=randn(2, 1, 80, 32, **BF16),
                                                                         v=randn(2, 1, 80, 32, **BF16)),
                   WIDE, dict(WIDE, is_causal=True),
                   dict(q=randn(2, 4, 64, 136, **BF16), k=randn(2, 2, 80, 136, **BF16),
                        v=randn(2, 2, 80, 136, **BF16))):
        c = supported_call(**change)
        assert sdpa._decline(c["q"], c["k"], c["v"], None, 0.0, c["is_causal"], c["scale"], c["enable_gqa"]) is None


def test_training_calls_above_head_dim_128_go_to_sdpa(cpu_counts_as_supported):
    """qattn's backward (SageBwd) runs head dims up to 128: a training call at 129..256 is
    declined with its own reason, and the same call without autograd is not."""
    q = randn(1, 2, 16, 192, **BF16).requires_grad_()
    k, v = randn(1, 2, 16, 192, **BF16), randn(1, 2, 16, 192, **BF16)
    assert sdpa._decline(q, k, v, None, 0.0, False, None, False)[0] == "backward head_dim"
    with torch.no_grad():
        assert sdpa._decline(q, k, v, None, 0.0, False, None, False) is None


def bad_calls():
    q, k2, k3 = randn(1, 4, 8, 16, **BF16), randn(1, 2, 8, 16, **BF16), randn(1, 3, 8, 16, **BF16)
    return {
        "query is a list": ([[1.0]], q, q, {}),
        "attn_mask is a list": (q, q, q, dict(attn_mask=[1])),
        "attn_mask with is_causal": (q, q, q, dict(attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                                   is_causal=True)),
        "1-D bool attn_mask": (q, q, q, dict(attn_mask=torch.ones(8, dtype=torch.bool))),
        "bool attn_mask of a shape that does not broadcast": (
            q, q, q, dict(attn_mask=torch.ones(3, 8, dtype=torch.bool))),
        "dropout_p is a str": (q, q, q, dict(dropout_p="0")),
        "is_causal is an int": (q, q, q, dict(is_causal=1)),
        "enable_gqa is an int": (q, q, q, dict(enable_gqa=1)),
        "scale is a str": (q, q, q, dict(scale="0.1")),
        "dtypes differ": (q, q.half(), q, {}),
        "1-D": (q[0, 0, 0], q[0, 0, 0], q[0, 0, 0], {}),
        "heads 4/2 without enable_gqa": (q, k2, k2, {}),
        "heads 4/3 with enable_gqa": (q, k3, k3, dict(enable_gqa=True)),
        "head dims differ": (q, q[..., :8], q, {}),
    }


@pytest.mark.parametrize("mode", ["warn", "raise"])
@pytest.mark.parametrize("device", ["cpu", "supported"])
@pytest.mark.parametrize("case", list(bad_calls()))
def test_invalid_calls_raise_torchs_own_error(request, mode, device, case):
    if device == "supported":
        request.getfixturevalue("cpu_counts_as_supported")
    q, k, v, kw = bad_calls()[case]
    try:
        F.scaled_dot_product_attention(q, k, v, **kw)
    except Exception as error:  # noqa: BLE001 - whatever SDPA raises, the drop-in must too
        theirs = error
    else:  # e.g. a mask with is_causal: PyTorch 2.11's SDPA computes it, later ones raise
        pytest.skip("this PyTorch's SDPA accepts the call (test_attn_mask checks the drop-in matches)")
    qattn.set_fallback(mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(type(theirs)) as ours:
            qattn.scaled_dot_product_attention(q, k, v, **kw)
    assert type(ours.value) is type(theirs) and str(ours.value) == str(theirs)
    assert not fallback_warnings(record)


# ---- the top-left causal mapping, with an emulated kernel ---------------------------------


def emulated_kernel(calls):
    """An FP64 stand-in for the C ABI forward (ops._forward): the causal rule aligned as
    `alignment` says (bottom-right by default), a window (left, right) around the same
    diagonal, GQA by h // (Hq / Hkv), o in q's dtype and layout, natural-log LSE, empty
    rows 0."""

    def forward(q, k, v, is_causal, scale, layout, return_lse, granularity, window_left=-1,
                window_right=-1, alignment="bottom_right", kv_lengths=None):
        calls.append(dict(q=q, k=k, causal=is_causal, alignment=alignment,
                          window=(window_left, window_right), kv_lengths=kv_lengths))
        qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
        qh, kh, vh = qh.double(), kh.double(), vh.double()
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
        nq, nkv = qh.shape[2], kh.shape[2]
        s = qh @ kh.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(qh.shape[-1]))
        i, j = torch.arange(nq)[:, None], torch.arange(nkv)[None, :]
        diag = i + (nkv - nq if alignment == "bottom_right" else 0)
        right = 0 if is_causal else window_right
        if right >= 0:
            s = s.masked_fill(j > diag + right, float("-inf"))
        if window_left >= 0:
            s = s.masked_fill(j < diag - window_left, float("-inf"))
        if kv_lengths is not None:
            s = s.masked_fill(j >= kv_lengths.reshape(-1, 1, 1, 1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = (torch.softmax(s, -1).nan_to_num(0.0) @ vh).to(q.dtype)
        o = o if layout == "HND" else o.transpose(1, 2).contiguous()
        return o, (lse.float() if return_lse else q.new_empty((0,), dtype=torch.float32))

    return forward


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(sdpa, "_device_runs_qattn", lambda device_type, index: True)
    monkeypatch.setattr(ops, "_forward", emulated_kernel(calls))
    return calls


# fp16 rounding of the emulated output: half an ulp is 2^-11 relative; 2^-10 leaves room
# for the FP64 sums' order. A wrong mask moves outputs by O(0.1).
RTOL, ATOL = 2.0**-10, 2.0**-14


@pytest.mark.parametrize("nq,nkv,training_calls", [(40, 40, 1), (17, 60, 1), (60, 17, 2), (1, 30, 1), (30, 1, 2)])
@pytest.mark.parametrize("hq,hkv,gqa", [(4, 4, False), (8, 2, True), (4, 1, False)])
def test_drop_in_matches_sdpa_top_left(kernel_calls, nq, nkv, training_calls, hq, hkv, gqa):
    q = randn(2, hq, nq, 24, dtype=torch.float16, seed=SEED + nq)
    k = randn(2, hkv, nkv, 24, dtype=torch.float16, seed=SEED + nkv + 1)
    v = randn(2, hkv, nkv, 24, dtype=torch.float16, seed=SEED + nkv + 2)
    qattn.set_fallback("raise")  # the qattn path, or an error
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                         enable_gqa=gqa, scale=0.3)
    # Inference: one kernel call with the top-left alignment (the kernel's own), on the
    # caller's key.
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=0.3)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.double(), ref, rtol=RTOL, atol=ATOL)
    assert len(kernel_calls) == 1 and kernel_calls[0]["k"] is k
    assert kernel_calls[0]["alignment"] == ("bottom_right" if nq == nkv else "top_left")
    # Training: SageBwd knows the bottom-right rule only, so the forward maps top-left
    # onto it with views (two calls when Nq > Nkv).
    kernel_calls.clear()
    o = qattn.scaled_dot_product_attention(q.requires_grad_(True), k, v, is_causal=True,
                                           enable_gqa=gqa, scale=0.3)
    torch.testing.assert_close(o.double(), ref, rtol=RTOL, atol=ATOL)
    assert len(kernel_calls) == training_calls
    assert all(c["alignment"] == "bottom_right" for c in kernel_calls)
    if nq < nkv:  # the first Nq keys, as a view of the caller's key
        seen = kernel_calls[0]["k"]
        assert seen.shape[2] == nq and seen.data_ptr() == k.data_ptr()
    assert all(c["k"].shape[2] <= nkv for c in kernel_calls)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("nq,nkv", [(17, 60), (60, 17), (33, 33)])
def test_attention_alignments(kernel_calls, layout, nq, nkv):
    def shape(n):
        return (1, 4, n, 16) if layout == "HND" else (1, n, 4, 16)

    q = randn(*shape(nq), dtype=torch.float16, seed=SEED + 3)
    k, v = randn(*shape(nkv), dtype=torch.float16, seed=SEED + 4), randn(*shape(nkv), dtype=torch.float16, seed=SEED + 5)
    hnd = [t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v)]
    i, j = torch.arange(nq)[:, None], torch.arange(nkv)[None, :]
    for alignment, mask in (("top_left", j <= i), ("bottom_right", j <= i + nkv - nq)):
        o, lse = qattn.attention(q, k, v, is_causal=True, layout=layout, return_lse=True,
                                 causal_alignment=alignment)
        s = hnd[0].double() @ hnd[1].double().transpose(-1, -2) / 4.0
        ref_lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
        ref_o = (torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ hnd[2].double())
        o_hnd = o if layout == "HND" else o.transpose(1, 2)
        torch.testing.assert_close(o_hnd.double(), ref_o, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    kernel_calls.clear()
    qattn.attention(q, k, v, is_causal=True, layout=layout, causal_alignment="bottom_right")
    assert len(kernel_calls) == 1 and kernel_calls[0]["k"] is k and kernel_calls[0]["causal"]


def test_attention_refuses_an_unknown_alignment():
    q = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(qattn.QattnError, match="causal_alignment = 'center'"):
        qattn.attention(q, q, q, is_causal=True, causal_alignment="center")


# ---- torch.compile ----------------------------------------------------------------------


def meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("nq,nkv", [(300, 100), (100, 300), (128, 128)])
def test_compile_fullgraph_traces_the_qattn_path(nq, nkv):
    def f(q, k, v):
        return qattn.scaled_dot_product_attention(q * 2, k, v, is_causal=True, enable_gqa=True)

    q, k = meta(2, 8, nq, 64), meta(2, 2, nkv, 64)
    qattn.set_fallback("raise")  # meta tensors take qattn's op; a fallback would raise
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, k)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_compile_fullgraph_follows_set_precision():
    # Inside a traced graph the mode is set_precision's: the op of that mode is in the
    # graph, and a new mode compiles the graph again (the compiler guards on it).
    def f(q, k, v):
        return qattn.scaled_dot_product_attention(q, k, v, is_causal=True)

    seen = []

    def backend(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    q = meta(1, 2, 128, 64)
    qattn.set_fallback("raise")
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    previous = qattn.set_precision("auto")
    try:
        compiled(q, q, q)
        qattn.set_precision("fast")
        compiled(q, q, q)
    finally:
        qattn.set_precision(previous)
    assert len(seen) == 2, seen
    assert any("attention_precision" in t for t in seen[0]), seen[0]
    assert not any("attention_precision" in t for t in seen[1]), seen[1]


def test_compile_fullgraph_fallback_is_sdpa_without_a_warning():
    def f(q, k, v):
        return qattn.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = randn(1, 2, 16, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, q, q)
    assert not fallback_warnings(record)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    qattn.set_fallback("raise")
    torch._dynamo.reset()
    # The error is raised while tracing; torch.compile may wrap it in its own type.
    with pytest.raises(Exception) as info:
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, q, q)
    err = info.value
    assert isinstance(err, QattnUnsupportedError) or "QattnUnsupportedError: " in str(err), err
