"""Masks beyond causal in qattn.attention: sliding windows (window_size), key-padding
lengths (kv_lengths) and the top-left alignment with Nq != Nkv.

CPU parts (torch on the CPU, meta tensors): the arguments' validation with named errors,
the ops' schemas, fake shapes and torch.compile(fullgraph=True) tracing, which op and
which mask arguments a call dispatches (inference: one kernel call, the alignment passed
on; training without a window or lengths: SageBwd's bottom-right rule from views), the
exact FP32 backward with masks against FP64 autograd, and the fallback of the backward of
a masked training call.

GPU parts (an sm_90 GPU; each skips with the reason elsewhere): qattn.attention with
masks against an FP64 reference built with an explicit boolean mask, within the bounds of
the scheme's table (tests/tolerances/sage2_8b.json, read by tolerances.py): CosSim >=
MIN_COSSIM and relative L1 <= MAX_REL_L1 on the output, the LSE within LSE_ATOL per row;
rows that see no key exactly 0 with LSE -inf. The backward of a masked training call
is the fallback's exact FP32 math, rounded to the inputs' 16-bit type: relative error
per element at most half an ulp (2^-9 in bf16), so CosSim >= 0.99999 and relative L1 <=
2^-8 (twice that half ulp, for the FP32 sums).

Seeds: fixed ones, plus a fresh one per run (printed; QATTN_TEST_SEED repeats it).
"""

import math
import os
import random
import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")


from qattn import QattnError, QattnFallbackWarning, QattnUnsupportedError, ops  # noqa: E402

from mask_reference import meta, metrics, reference_grads, restore_fallback, shape_of, to_hnd  # noqa: E402,F401
from op_log import OpLog  # noqa: E402
from tolerances import (FALLBACK_GRAD_COS_MIN, FALLBACK_GRAD_REL_L1_MAX, LSE_ATOL,  # noqa: E402
                        MAX_REL_L1, MIN_COSSIM)

FRESH_SEED = int(os.environ.get("QATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
print(f"test_masks.py: fresh seed {FRESH_SEED} (QATTN_TEST_SEED={FRESH_SEED} repeats it)")

GRAD_COS_MIN, GRAD_REL_L1_MAX = FALLBACK_GRAD_COS_MIN, FALLBACK_GRAD_REL_L1_MAX  # tolerances.py


# ---- the reference: an explicit boolean mask -------------------------------------------


def visible(b, nq, nkv, is_causal, window=(-1, -1), alignment="top_left", kv_lengths=None,
            device="cpu"):
    """(B, 1, Nq, Nkv) bool: whether query i of batch entry b sees key j, written out from
    qattn.h's rule. Diagonal D(i) = i (top-left) or i + Nkv - Nq (bottom-right); key j is
    seen iff j <= D(i) + right (right = 0 with causal), j >= D(i) - left, and j <
    kv_lengths[b] (clamped to [0, Nkv]), each where set."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nkv, device=device)[None, :]
    diag = i + (nkv - nq if alignment == "bottom_right" else 0)
    left, right = window
    if is_causal:
        right = 0
    seen = torch.ones(nq, nkv, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= j <= diag + right
    if left >= 0:
        seen &= j >= diag - left
    seen = seen.expand(b, 1, nq, nkv).clone()
    if kv_lengths is not None:
        for entry, n in enumerate(kv_lengths.tolist()):
            seen[entry, :, :, max(0, min(n, nkv)):] = False
    return seen


def reference(q, k, v, seen, scale=None, layout="HND"):
    """FP64 attention under the boolean mask `seen`, GQA; (o, lse) in HND. Rows that see
    no key: o = 0, lse = -inf."""
    q, k, v = (to_hnd(t, layout).double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sm = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2) * sm).masked_fill(~seen.to(q.device), -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


# ---- validation (meta tensors) -----------------------------------------------------------


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), (1, 2, 3), "ab", (1.5, 2), (True, 0),
                                    (2**31, 0), (0, -(2**40)), None, 5])
def test_bad_window_size_is_named(window):
    q = meta(2, 4, 64, 64)
    with pytest.raises(QattnError, match="window_size") as info:
        qattn.attention(q, q, q, window_size=window)
    assert info.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"


def test_window_sides_that_fit_are_taken():
    q = meta(2, 4, 64, 64)
    for window in ((-1, -1), (0, 0), (5, -1), [-1, 7], (2**31 - 1, 2**31 - 1)):
        assert qattn.attention(q, q, q, window_size=window).shape == q.shape


@pytest.mark.parametrize("lengths,match", [
    (torch.zeros(2, dtype=torch.float32, device="meta"), r"kv_lengths.dtype = torch.float32"),
    (torch.zeros(2, dtype=torch.int16, device="meta"), r"kv_lengths.dtype = torch.int16"),
    (torch.zeros(3, dtype=torch.int32, device="meta"), r"kv_lengths has shape \(3,\); allowed: \(2,\)"),
    (torch.zeros(2, 1, dtype=torch.int32, device="meta"), r"kv_lengths has shape \(2, 1\)"),
    (torch.zeros((), dtype=torch.int32, device="meta"), r"kv_lengths has shape \(\)"),
    (torch.zeros(2, dtype=torch.int32), r"kv_lengths is on cpu but q is on meta"),
    ([3, 4], r"kv_lengths is a list"),
])
def test_bad_kv_lengths_are_named(lengths, match):
    q = meta(2, 4, 64, 64)
    with pytest.raises(QattnError, match=match) as info:
        qattn.attention(q, q, q, kv_lengths=lengths)
    assert info.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"
    with pytest.raises(QattnError, match=match):  # with autograd too
        qattn.attention(meta(2, 4, 64, 64, grad=True), q, q, kv_lengths=lengths)


def test_kv_lengths_in_nhd_take_the_batch_of_q():
    q, k = meta(3, 100, 8, 64), meta(3, 200, 2, 64)  # NHD: B = 3
    for dtype in (torch.int32, torch.int64):
        lengths = torch.zeros(3, dtype=dtype, device="meta")
        o = qattn.attention(q, k, k, layout="NHD", kv_lengths=lengths)
        assert o.shape == q.shape
    with pytest.raises(QattnError, match=r"allowed: \(3,\)"):
        qattn.attention(q, k, k, layout="NHD", kv_lengths=torch.zeros(100, dtype=torch.int32, device="meta"))


def test_ops_name_bad_mask_arguments():
    q = meta(1, 4, 64, 64)
    op = torch.ops.qattn.attention
    with pytest.raises(QattnError, match="window_left = -3"):
        op(q, q, q, False, None, "HND", False, "per_thread", window_left=-3)
    with pytest.raises(QattnError, match="window_right = -2"):
        op(q, q, q, False, None, "HND", False, "per_thread", window_right=-2)
    with pytest.raises(QattnError, match="alignment = 'center'"):
        op(q, q, q, True, None, "HND", False, "per_thread", alignment="center")
    with pytest.raises(QattnError, match="kv_lengths.dtype"):
        op(q, q, q, True, None, "HND", False, "per_thread", torch.zeros(1, device="meta"))
    lse = torch.empty(1, 4, 64, device="meta")
    with pytest.raises(QattnError, match="window_left = -9"):
        torch.ops.qattn.attention_backward(q, q, q, q, q, lse, None, False, None, "HND", "int8",
                                           "16bit", False, window_left=-9)


# ---- the ops: schemas, shapes, tracing ------------------------------------------------------


MASK_SCHEMA = ('Tensor? kv_lengths=None', 'window_left=-1', 'window_right=-1',
               'str alignment="bottom_right"', 'Tensor? attn_mask=None')


@pytest.mark.parametrize("op", ["attention", "attention_train", "attention_backward"])
def test_schemas_carry_the_mask_arguments_last_with_defaults(op):
    schema = str(getattr(torch.ops.qattn, op).default._schema)
    args = schema[schema.index("(") + 1 : schema.index(") ->")].split(", ")
    n = len(MASK_SCHEMA)
    assert [a.split(" ")[-1] for a in args[-n:]] == [m.split(" ")[-1] for m in MASK_SCHEMA], schema
    assert all(a.split(" ")[0] in ("int", "SymInt") for a in args[-n + 1:-n + 3]), schema
    assert args[-1].split(" ")[0] == "Tensor?" and args[-n].split(" ")[0] == "Tensor?", schema


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fake_shapes_with_masks(layout):
    q, k = meta(*shape_of(2, 8, 300, 72, layout)), meta(*shape_of(2, 2, 500, 72, layout))
    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    o, lse = qattn.attention(q, k, k, is_causal=True, layout=layout, return_lse=True,
                             window_size=(64, 0), kv_lengths=lengths)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32


def test_compile_fullgraph_traces_masked_inference_and_training():
    def f(q, k, v, lengths):
        o, lse = qattn.attention(q * 2, k, v, is_causal=True, return_lse=True, window_size=(128, 0),
                                 kv_lengths=lengths)
        o2 = qattn.attention(q, k, v, is_causal=True, layout="HND")  # top-left, Nq != Nkv
        return o.float().sum() + lse.sum() + o2.float().sum()

    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    q, k = meta(2, 8, 300, 128), meta(2, 2, 500, 128)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, k, lengths)
    assert out.shape == ()
    torch._dynamo.reset()
    qg, kg, vg = meta(2, 8, 300, 128, grad=True), meta(2, 2, 500, 128, grad=True), meta(2, 2, 500, 128, grad=True)
    torch.compile(f, fullgraph=True, backend="aot_eager")(qg, kg, vg, lengths).backward()
    assert qg.grad.shape == qg.shape and kg.grad.shape == kg.shape and vg.grad.shape == vg.shape


# ---- which op a call takes, with which mask arguments ----------------------------------


def mask_of(bound):
    return (bound["kv_lengths"] is not None, bound["window_left"], bound["window_right"],
            bound["alignment"])


NO_MASK = (False, -1, -1, "bottom_right")


@pytest.mark.parametrize("kwargs,nq,nkv,want", [
    (dict(is_causal=True), 300, 500, (False, -1, -1, "top_left")),  # SDPA's rule: one call
    (dict(is_causal=True), 500, 300, (False, -1, -1, "top_left")),  # not two any more
    (dict(is_causal=True), 400, 400, NO_MASK),  # the alignments agree
    (dict(is_causal=True, causal_alignment="bottom_right"), 500, 300, NO_MASK),
    (dict(), 300, 500, NO_MASK),  # no causal, no window: the alignment changes nothing
    (dict(window_size=(64, 16)), 300, 500, (False, 64, 16, "top_left")),
    (dict(window_size=(64, 16), causal_alignment="bottom_right"), 300, 500, (False, 64, 16, "bottom_right")),
    (dict(window_size=(-1, -1)), 300, 500, NO_MASK),
    (dict(is_causal=True, window_size=(-1, 5)), 400, 400, (False, -1, 5, "bottom_right")),
    (dict(kv_lengths=True), 300, 500, (True, -1, -1, "bottom_right")),
])
def test_inference_is_one_call_with_the_mask(kwargs, nq, nkv, want):
    if kwargs.get("kv_lengths"):
        kwargs = dict(kwargs, kv_lengths=torch.zeros(2, dtype=torch.int64, device="meta"))
    q, k = meta(2, 4, nq, 64), meta(2, 2, nkv, 64)
    with OpLog() as log:
        qattn.attention(q, k, k, **kwargs)
    assert [name for name, _ in log.calls] == ["attention"]
    bound = log.calls[0][1]
    assert mask_of(bound) == want and bound["k"].shape == k.shape  # the caller's whole key
    if want[0]:
        assert bound["kv_lengths"] is kwargs["kv_lengths"]  # int64 reaches the op as given


def test_training_without_a_mask_keeps_sagebwd_and_its_views():
    # Top-left causal with Nq > Nkv: two training forwards on views, bottom-right each,
    # so that SageBwd (bottom-right causal only) runs the backward.
    q, k = meta(1, 4, 500, 64, grad=True), meta(1, 2, 300, 64, grad=True)
    with OpLog() as log:
        o = qattn.attention(q, k, k, is_causal=True)
    assert [name for name, _ in log.calls] == ["attention_train"] * 2
    assert all(mask_of(b) == NO_MASK for _, b in log.calls)
    assert [b["q"].shape[2] for _, b in log.calls] == [300, 200]
    with OpLog() as log:
        o.float().sum().backward()
    assert [name for name, _ in log.calls] == ["attention_backward"] * 2
    assert all(mask_of(b) == NO_MASK for _, b in log.calls)


@pytest.mark.parametrize("kwargs,want", [
    (dict(is_causal=True, window_size=(100, 0)), (False, 100, 0, "top_left")),
    (dict(window_size=(32, 32), causal_alignment="bottom_right"), (False, 32, 32, "bottom_right")),
    (dict(is_causal=True, kv_lengths=True), (True, -1, -1, "top_left")),
])
def test_masked_training_is_one_forward_and_its_backward_gets_the_mask(kwargs, want):
    if kwargs.get("kv_lengths"):
        kwargs = dict(kwargs, kv_lengths=torch.zeros(1, dtype=torch.int32, device="meta"))
    q, k = meta(1, 4, 500, 64, grad=True), meta(1, 2, 300, 64, grad=True)
    with OpLog() as log:
        o, lse = qattn.attention(q, k, k, return_lse=True, **kwargs)
    assert [name for name, _ in log.calls] == ["attention_train"]
    assert mask_of(log.calls[0][1]) == want
    with OpLog() as log:
        (o.float().sum() + lse.sum()).backward()
    assert [name for name, _ in log.calls] == ["attention_backward"]
    assert mask_of(log.calls[0][1]) == want and log.calls[0][1]["grad_lse"] is not None


def test_backward_of_the_inference_op_called_directly_keeps_the_mask():
    q = meta(1, 4, 128, 64, grad=True)
    o, _ = torch.ops.qattn.attention(q, q, q, False, None, "HND", False, "per_thread",
                                     window_left=32)
    with OpLog() as log:
        o.float().sum().backward()
    assert [name for name, _ in log.calls] == ["attention", "attention_backward"]
    assert all(mask_of(b) == (False, 32, -1, "bottom_right") for _, b in log.calls)
    assert q.grad.shape == q.shape


# ---- the exact FP32 backward with masks (CPU), and the fallback of a masked backward -----


MATH_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, window, alignment, lengths, layout)
    (2, 4, 2, 37, 53, 24, True, (5, 0), "top_left", None, "HND"),
    (2, 4, 4, 53, 37, 32, False, (7, 3), "bottom_right", None, "NHD"),
    (3, 2, 1, 40, 60, 16, False, (-1, -1), "bottom_right", [60, 0, 17], "HND"),  # an empty entry
    (2, 4, 2, 60, 20, 40, True, (-1, -1), "top_left", [13, 100], "NHD"),  # Nq > Nkv
    (1, 2, 2, 64, 64, 32, False, (1, 1), "top_left", None, "HND"),  # two or three keys per row
]


@pytest.mark.parametrize("case", MATH_CASES, ids=[str(c[3:10]) for c in MATH_CASES])
@pytest.mark.parametrize("seed", [1, FRESH_SEED])
@pytest.mark.parametrize("with_lse", [False, True])
def test_exact_backward_with_masks_matches_fp64_autograd(case, seed, with_lse, monkeypatch):
    b, hq, hkv, nq, nkv, d, causal, window, alignment, lengths, layout = case
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    q, k, v = rnd(*shape_of(b, hq, nq, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout))
    grad_o = rnd(*q.shape)
    grad_lse = torch.randn(b, hq, nq, generator=gen) if with_lse else None
    kv_lengths = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    monkeypatch.setattr(ops, "_MATH_CHUNK", 7 * b * hq * nkv)  # blocks of rows too
    got = torch.ops.qattn.attention_backward(
        grad_o, q, k, v, q, torch.zeros(b, hq, nq), grad_lse, causal, 0.2, layout, "int8", "16bit",
        False, kv_lengths=kv_lengths, window_left=window[0], window_right=window[1],
        alignment=alignment)
    seen = visible(b, nq, nkv, causal, window, alignment, kv_lengths)
    want = reference_grads(q, k, v, grad_o, seen, 0.2, layout, grad_lse)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == r.shape and a.dtype == torch.bfloat16 and a.is_contiguous(), name
        # The FP32 result rounded to BF16: half an ulp (2^-9 of the value) plus the FP32
        # sums' rounding.
        err = (a.double() - r).abs()
        assert bool((err <= r.abs() * 2.0**-8 + 1e-4 * r.abs().max()).all()), (name, seed, err.max())
    if lengths is not None and 0 in lengths:  # an entry that sees no key: no gradient
        empty = lengths.index(0)
        assert (got[0][empty] == 0).all() and (got[1][empty] == 0).all() and (got[2][empty] == 0).all()


def no_sagebwd(*args, **kwargs):
    raise AssertionError("SageBwd was called for a mask it does not run")


def small_problem(seed=5, nq=40, nkv=56):
    gen = torch.Generator().manual_seed(seed)
    q, go = (torch.randn(1, 2, nq, 16, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, nkv, 16, generator=gen).bfloat16() for _ in range(2))
    return go, q, k, v


@pytest.mark.parametrize("causal,mask,key", [
    (True, dict(window_left=8), "mask window"),
    (False, dict(window_right=3), "mask window"),
    (True, dict(kv_lengths=torch.tensor([20], dtype=torch.int32)), "mask kv_lengths"),
    (True, dict(alignment="top_left"), "mask top_left"),
    (False, dict(window_left=4, alignment="top_left", kv_lengths=torch.tensor([9], dtype=torch.int32)),
     "mask window+kv_lengths+top_left"),
])
def test_masked_backward_warns_once_and_gives_the_exact_gradients(monkeypatch, causal, mask, key):
    monkeypatch.setattr(ops, "_bwd_run", no_sagebwd)
    qattn.set_fallback("warn")
    go, q, k, v = small_problem()
    lse = torch.zeros(1, 2, 40)
    args = (go, q, k, v, q, lse, None, causal, None, "HND", "int8", "16bit", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = ops._backward_cuda(*args, **mask)
        ops._backward_cuda(*args, **mask)
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "SageBwd runs no mask but causal aligned bottom-right" in msgs[0], msgs
    want = ops._backward_math(go, q, k, v, None, causal, None, "HND", **mask)
    for a, r in zip(got, want):
        assert torch.equal(a, r)
    qattn.set_fallback("raise")
    with pytest.raises(QattnUnsupportedError, match="SageBwd runs no mask") as info:
        ops._backward_cuda(*args, **mask)
    assert info.value.reason == f"backward {key}"


def test_masks_sagebwd_runs_are_not_declined(monkeypatch):
    # Where a mask argument changes nothing (top-left with Nq == Nkv, a right side with
    # causal, a window without bounds), the call is SageBwd's.
    calls = []
    monkeypatch.setattr(ops, "_bwd_run", lambda *a, **k: calls.append(a) or (a[1], a[2], a[3]))
    qattn.set_fallback("raise")
    go, q, k, v = small_problem(nkv=40)
    lse = torch.zeros(1, 2, 40)
    for mask in (dict(alignment="top_left"), dict(window_right=9), dict()):
        ops._backward_cuda(go, q, k, v, q, lse, None, True, None, "HND", "int8", "16bit", False, **mask)
    assert len(calls) == 3


# ---- GPU: masks against FP64, and a masked training call ------------------------------------


@pytest.fixture
def gpu():
    from gpu import require_sm90

    require_sm90()


def cuda_randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def check_masked_forward(case, seed):
    b, hq, hkv, nq, nkv, d, causal, window, alignment, lengths, layout, dtype = case
    what = f"{case} seed {seed}"
    print(what)  # shown by pytest when the test fails
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = cuda_randn(shape_of(b, hq, nq, d, layout), dtype, gen)
    k = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen)
    v = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen)
    kv_lengths = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    o, lse = qattn.attention(q, k, v, is_causal=causal, layout=layout, return_lse=True,
                             causal_alignment=alignment, window_size=window, kv_lengths=kv_lengths)
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous(), what
    seen = visible(b, nq, nkv, causal, window, alignment, kv_lengths, device="cuda")
    ref_o, ref_lse = reference(q, k, v, seen, layout=layout)
    o = to_hnd(o, layout)
    assert bool(torch.isfinite(o).all()), f"{what}: non-finite output"
    dead = ~seen.any(-1).expand(b, hq, nq)  # rows that see no key
    assert torch.equal(torch.isneginf(lse), dead), f"{what}: LSE -inf rows"
    assert bool((o[dead] == 0).all()), f"{what}: rows with no key are not 0"
    if bool(dead.all()):
        return
    cos, rel = metrics(o, ref_o)
    assert cos >= MIN_COSSIM and rel <= MAX_REL_L1, f"{what}: CosSim {cos:.6f}, rel-L1 {rel:.4f}"
    err = (lse.double() - ref_lse)[~dead].abs().max().item()
    assert err <= LSE_ATOL, f"{what}: LSE error {err:.4f}"


BF16, FP16 = torch.bfloat16, torch.float16
GPU_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, window, alignment, kv_lengths, layout, dtype)
    (2, 4, 4, 700, 700, 128, False, (200, 50), "top_left", None, "HND", BF16),  # both sides, tails
    (1, 8, 2, 1000, 1000, 64, True, (300, -1), "top_left", None, "NHD", FP16),  # local causal, GQA
    (4, 4, 2, 300, 900, 128, False, (-1, -1), "top_left", [650, 900, 0, 1], "HND", BF16),  # padding, an empty entry
    (4, 4, 2, 300, 900, 64, True, (-1, -1), "top_left", [650, 900, 0, 1], "NHD", FP16),  # SDPA's is_causal, Nq < Nkv
    (1, 4, 4, 500, 200, 128, True, (-1, -1), "top_left", None, "HND", BF16),  # Nq > Nkv in one call
    (1, 4, 1, 500, 200, 96, True, (-1, -1), "bottom_right", None, "NHD", FP16),  # 300 rows see no key
    (2, 4, 2, 333, 777, 64, False, (16, 16), "bottom_right", [777, 500], "HND", BF16),
    (1, 4, 4, 640, 640, 128, False, (0, 0), "top_left", None, "NHD", BF16),  # one key per row
    (2, 2, 1, 129, 1100, 72, True, (40, 0), "top_left", [-5, 2000], "HND", FP16),  # clamped lengths
    # More query blocks than SMs over one partial KV tile, most blocks seeing no key.
    (2, 16, 4, 854, 43, 128, True, (-1, -1), "bottom_right", None, "HND", FP16),
    (2, 16, 4, 854, 43, 128, False, (1, 49), "top_left", None, "HND", FP16),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[str(c[:10]) + str(c[11])[6:] for c in GPU_CASES])
def test_gpu_masks_match_fp64(gpu, case):
    check_masked_forward(case, 11)


def random_case(rng):
    """A random mask case: tails (N not a multiple of 128), GQA/MQA, either layout and
    dtype; window sides unbounded, narrow (0..8) or wide (up to 2 Nkv); lengths with 0,
    tails and full ones."""
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4])
    b, nq, nkv = rng.randint(1, 3), rng.randint(1, 1100), rng.randint(1, 1100)
    side = lambda: rng.choice([-1, rng.randint(0, 8), rng.randint(0, 2 * nkv)])  # noqa: E731
    lengths = None
    if rng.random() < 0.5:
        lengths = [rng.choice([nkv, 0, rng.randint(1, nkv)]) for _ in range(b)]
    return (b, hq, hkv, nq, nkv, rng.choice([64, 128, 96]), rng.random() < 0.5, (side(), side()),
            rng.choice(["top_left", "bottom_right"]), lengths, rng.choice(["HND", "NHD"]),
            rng.choice([BF16, FP16]))


@pytest.mark.parametrize("seed", [3, 4, FRESH_SEED])
def test_gpu_random_masks_match_fp64(gpu, seed):
    rng = random.Random(seed)
    for i in range(6):
        case = random_case(rng)
        try:
            check_masked_forward(case, seed + i)
        except AssertionError as error:
            raise AssertionError(f"{error} (case {i} of seed {seed}; QATTN_TEST_SEED={seed} "
                                 "repeats a fresh seed)") from None


def test_gpu_top_left_inference_is_one_kernel_call(gpu, monkeypatch):
    seen = []
    run = ops._run

    def recording_run(*args, lse_tensor=True, **mask):  # the mask arguments alone
        seen.append(mask)
        return run(*args, lse_tensor=lse_tensor, **mask)

    monkeypatch.setattr(ops, "_run", recording_run)
    gen = torch.Generator(device="cuda").manual_seed(21)
    q = cuda_randn((1, 8, 700, 128), BF16, gen)
    k, v = cuda_randn((1, 2, 300, 128), BF16, gen), cuda_randn((1, 2, 300, 128), BF16, gen)
    with torch.no_grad():
        o = qattn.attention(q, k, v, is_causal=True)
    assert seen == [{"alignment": "top_left"}]
    ref, _ = reference(q, k, v, visible(1, 700, 300, True, device="cuda"))
    cos, rel = metrics(o, ref)
    assert cos >= MIN_COSSIM and rel <= MAX_REL_L1, (cos, rel)


TRAIN_CASES = [  # (is_causal, kwargs, nq, nkv, layout, dtype)
    (True, dict(window_size=(64, 0)), 500, 500, "HND", BF16),
    (False, dict(window_size=(100, 30), causal_alignment="top_left"), 300, 700, "NHD", FP16),
    (True, dict(kv_lengths=[400, 0]), 300, 700, "HND", BF16),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[str(c[:4]) for c in TRAIN_CASES])
@pytest.mark.parametrize("seed", [12, FRESH_SEED])
def test_gpu_masked_training_falls_back_to_exact_gradients(gpu, case, seed):
    causal, kwargs, nq, nkv, layout, dtype = case
    print(f"{case} seed {seed}")
    b, hq, hkv, d = 2, 4, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = cuda_randn(shape_of(b, hq, nq, d, layout), dtype, gen).requires_grad_(True)
    k = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen).requires_grad_(True)
    v = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen).requires_grad_(True)
    go = cuda_randn(q.shape, dtype, gen)
    if "kv_lengths" in kwargs:
        kwargs = dict(kwargs, kv_lengths=torch.tensor(kwargs["kv_lengths"], dtype=torch.int32, device="cuda"))
    qattn.set_fallback("warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = qattn.attention(q, k, v, is_causal=causal, layout=layout, **kwargs)
        o.backward(go)
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "SageBwd runs no mask" in msgs[0], msgs
    window = kwargs.get("window_size", (-1, -1))
    alignment = kwargs.get("causal_alignment", "top_left")
    seen = visible(b, nq, nkv, causal, window, alignment, kwargs.get("kv_lengths"), device="cuda")
    # The forward is qattn's kernel, within the scheme's bounds.
    ref_o, _ = reference(q.detach(), k.detach(), v.detach(), seen, layout=layout)
    cos, rel = metrics(to_hnd(o.detach(), layout), ref_o)
    assert cos >= MIN_COSSIM and rel <= MAX_REL_L1, ("forward", cos, rel)
    # The gradients are the exact FP32 ones, rounded to the inputs' type.
    want = reference_grads(q, k, v, go, seen, layout=layout)
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), want):
        cos, rel = metrics(t.grad, r)
        print(f"{name}: cos {cos:.7f} rel-L1 {rel:.5f}")
        assert cos >= GRAD_COS_MIN and rel <= GRAD_REL_L1_MAX, (name, cos, rel)
    # "raise": the same call's backward is refused, naming the mask.
    qattn.set_fallback("raise")
    o = qattn.attention(q, k, v, is_causal=causal, layout=layout, **kwargs)
    with pytest.raises(QattnUnsupportedError, match="SageBwd runs no mask") as info:
        o.backward(go)
    assert info.value.reason.startswith("backward mask")
