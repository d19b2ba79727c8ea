"""SDPA's attn_mask, boolean (True = the query sees the key) or additive (a float mask of
the query's dtype), from Python to the kernel: qattn.attention(..., attn_mask=m), the ops'
attn_mask argument, and qattn.scaled_dot_product_attention routing either to qattn.

CPU parts (torch on the CPU, meta tensors): the validation with named errors (dtype,
shape by PyTorch's broadcasting rules, device, and the combination with is_causal,
window_size or kv_lengths, which this version of the library refuses); the fake
implementation's shapes and torch.compile(fullgraph=True) tracing with a mask; which op
a call dispatches and with which mask (a call without one dispatches just the
arguments of a plain call); what _Call hands the C ABI (the mask's pointer and byte
strides of a (B, Hq, Nq, Nkv) broadcast view, no copy; an additive mask's layout rule and
its copy); the drop-in sending a boolean mask, or an additive one of the query's dtype, to
qattn's op and a float mask of another dtype to SDPA with one warning; and the backward of a
masked training call: declined by SageBwd with a named reason, the exact FP32
gradients from the fallback against FP64 autograd.

GPU parts (an sm_90 GPU; each skips with the reason elsewhere), every call for qattn
under set_fallback("raise"), so that a silent fallback fails: the output against
PyTorch's SDPA in FP32 (math backend) on the same inputs with the same mask, on the rows
that see a key, within the SageAttention2-8b bounds of tests/tolerances/sage2_8b.json
(read by tolerances.py): CosSim >= MIN_COSSIM and relative L1 <= MAX_REL_L1; the LSE
within LSE_ATOL per row against FP64; rows that see no key exactly 0 with LSE -inf, the
others finite. Masks: key padding (B, 1, 1, Nkv) with an entry of length 0, documents
(Nq, Nkv), random (B, H, Nq, Nkv) with fully masked rows, (B, 1, Nq, Nkv) with Nq != Nkv
under GQA, strided masks (transposed, sliced at an odd byte, a stride-0 batch); fp16 and
bf16, both layouts, tails (N not a multiple of 128); additive masks (ALiBi under the
causal rule per head, random values with -inf among them and odd Nkv, 0 / -inf key padding
with an empty entry, the dtype's lowest value as transformers writes it, a per-head bias
under GQA) against SDPA given the same float mask. torch.compile(fullgraph=True) of
the drop-in with a mask equals eager bitwise (the same kernel calls). A masked training
call's gradients are the fallback's exact FP32 math: CosSim >= 0.99999 and relative
L1 <= 2^-8 against FP64 (the FP32 result rounded to 16 bits: half an ulp, 2^-9 in bf16,
per element; twice that for the FP32 sums).

Seeds: fixed ones, plus a fresh one per run (printed; QATTN_TEST_SEED repeats it).
"""

import math
import os
import random
import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from qattn import QattnError, QattnFallbackWarning, QattnUnsupportedError, _C, fallback, ops, sdpa  # noqa: E402

from mask_reference import meta, metrics, reference_grads, restore_fallback, shape_of, to_hnd  # noqa: E402,F401
from op_log import OpLog  # noqa: E402
from tolerances import LSE_ATOL, MAX_REL_L1, MIN_COSSIM  # noqa: E402

FRESH_SEED = int(os.environ.get("QATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
print(f"test_attn_mask.py: fresh seed {FRESH_SEED} (QATTN_TEST_SEED={FRESH_SEED} repeats it)")

GRAD_COS_MIN = 0.99999
GRAD_REL_L1_MAX = 2.0**-8
FLOAT_REASON = "a float attn_mask; qattn's kernel takes boolean masks (True = attend)"


def meta_mask(*shape):
    return torch.empty(shape, dtype=torch.bool, device="meta")


# ---- validation: named errors -----------------------------------------------------------


Q_SHAPE, K_SHAPE = (2, 4, 64, 32), (2, 2, 80, 32)  # B 2, Hq 4, Hkv 2, Nq 64, Nkv 80


@pytest.mark.parametrize("mask,match", [
    (torch.zeros(64, 80, device="meta"), r"attn_mask.dtype = torch.float32; allowed: torch.bool"),
    # A float mask of another dtype than q's bf16 (one of q's dtype is an additive mask).
    (torch.zeros(64, 80, dtype=torch.float16, device="meta"),
     r"attn_mask.dtype = torch.float16; allowed: torch.bool .* or q's dtype torch.bfloat16"),
    (torch.zeros(64, 80, dtype=torch.uint8, device="meta"), r"attn_mask.dtype = torch.uint8"),
    (meta_mask(64, 81), r"attn_mask has shape \(64, 81\); allowed: a shape broadcastable to "
                        r"\(B, Hq, Nq, Nkv\) = \(2, 4, 64, 80\)"),
    (meta_mask(80, 64), r"attn_mask has shape \(80, 64\)"),  # (Nkv, Nq): not broadcastable
    (meta_mask(2, 2, 64, 80), r"attn_mask has shape \(2, 2, 64, 80\)"),  # Hkv heads, not Hq
    (meta_mask(3, 1, 1, 80), r"attn_mask has shape \(3, 1, 1, 80\)"),  # another batch
    (meta_mask(1, 2, 4, 64, 80), r"attn_mask has shape \(1, 2, 4, 64, 80\)"),  # 5-D
    (meta_mask(2, 64, 80), r"attn_mask has shape \(2, 64, 80\)"),  # 3-D: (H, Nq, Nkv), H 2 != 4
    (torch.ones(64, 80, dtype=torch.bool), r"attn_mask is on cpu but q is on meta"),
    ([[True]], r"attn_mask is a list"),
])
def test_bad_attn_mask_is_named(mask, match):
    q, k = meta(*Q_SHAPE), meta(*K_SHAPE)
    with pytest.raises(QattnError, match=match) as info:
        qattn.attention(q, k, k, attn_mask=mask)
    assert info.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"
    with pytest.raises(QattnError, match=match):  # with autograd too
        qattn.attention(meta(*Q_SHAPE, grad=True), k, k, attn_mask=mask)


@pytest.mark.parametrize("kwargs,match", [
    (dict(is_causal=True), r"attn_mask with is_causal=True; allowed: an attn_mask alone"),
    (dict(window_size=(64, 0)), r"attn_mask with window_size = \(64, 0\)"),
    (dict(window_size=(-1, 3)), r"attn_mask with window_size = \(-1, 3\)"),
    (dict(kv_lengths=True), r"attn_mask with kv_lengths"),
    (dict(is_causal=True, kv_lengths=True), r"attn_mask with is_causal=True and kv_lengths"),
])
def test_attn_mask_with_another_mask_is_refused_before_the_call(kwargs, match, monkeypatch):
    def no_call(*args, **kw):
        raise AssertionError("the call went on")

    monkeypatch.setattr(ops, "_forward", no_call)
    if kwargs.get("kv_lengths"):
        kwargs = dict(kwargs, kv_lengths=torch.zeros(2, dtype=torch.int32, device="meta"))
    q, k = meta(*Q_SHAPE), meta(*K_SHAPE)
    with pytest.raises(QattnError, match=match) as info:
        qattn.attention(q, k, k, attn_mask=meta_mask(64, 80), **kwargs)
    assert info.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"
    assert "write the causal rule, the window or the key padding into the mask" in str(info.value)


def test_a_window_of_no_bounds_is_no_window():
    q, k = meta(*Q_SHAPE), meta(*K_SHAPE)
    o = qattn.attention(q, k, k, attn_mask=meta_mask(64, 80), window_size=(-1, -1))
    assert o.shape == q.shape


def test_ops_name_a_bad_attn_mask():
    q, k = meta(*Q_SHAPE), meta(*K_SHAPE)
    op = torch.ops.qattn.attention
    plain = (q, k, k, False, None, "HND", False, "per_thread")
    with pytest.raises(QattnError, match="attn_mask.dtype = torch.float32"):
        op(*plain, attn_mask=torch.zeros(64, 80, device="meta"))
    with pytest.raises(QattnError, match=r"attn_mask has shape \(64, 79\)"):
        op(*plain, attn_mask=meta_mask(64, 79))
    with pytest.raises(QattnError, match="attn_mask with is_causal=True"):
        op(q, k, k, True, None, "HND", False, "per_thread", attn_mask=meta_mask(64, 80))
    with pytest.raises(QattnError, match=r"attn_mask with a window \(window_left = 8"):
        op(*plain, window_left=8, attn_mask=meta_mask(64, 80))
    with pytest.raises(QattnError, match="attn_mask with kv_lengths"):
        op(*plain, torch.zeros(2, dtype=torch.int32, device="meta"), attn_mask=meta_mask(64, 80))
    with pytest.raises(QattnError, match="attn_mask with is_causal=True"):
        torch.ops.qattn.attention_train(q, k, k, True, None, "HND", False, attn_mask=meta_mask(64, 80))
    lse = torch.empty(2, 4, 64, device="meta")
    with pytest.raises(QattnError, match=r"attn_mask has shape \(5, 80\)"):
        torch.ops.qattn.attention_backward(q, q, k, k, q, lse, None, False, None, "HND", "int8",
                                           "16bit", False, attn_mask=meta_mask(5, 80))


# ---- the fake implementation: shapes, tracing -----------------------------------------------


MASK_SHAPES = [(), (80,), (64, 80), (1, 80), (64, 1), (4, 64, 80), (1, 64, 80), (2, 1, 1, 80),
               (2, 4, 64, 80), (1, 4, 1, 80), (2, 1, 64, 80)]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_fake_shapes_with_an_attn_mask(layout, mask_shape):
    # The mask is (B, H, Nq, Nkv) in either layout.
    q, k = meta(*shape_of(2, 4, 64, 72, layout)), meta(*shape_of(2, 2, 80, 72, layout))
    o, lse = qattn.attention(q, k, k, layout=layout, return_lse=True, attn_mask=meta_mask(*mask_shape))
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32
    qg = meta(*q.shape, grad=True)
    o = qattn.attention(qg, k, k, layout=layout, attn_mask=meta_mask(*mask_shape))
    o.float().sum().backward()
    assert qg.grad.shape == q.shape


def test_compile_fullgraph_traces_a_masked_call_forward_and_backward():
    def f(q, k, v, m):
        o = qattn.scaled_dot_product_attention(q * 2, k, v, attn_mask=m, enable_gqa=True)
        o2 = qattn.attention(q, k, v, attn_mask=m[:, :, :1], layout="HND")
        return o.float().sum() + o2.float().sum()

    qattn.set_fallback("raise")  # meta tensors take qattn's op; a fallback would raise
    m = meta_mask(2, 1, 300, 500)
    q, k = meta(2, 8, 300, 128), meta(2, 2, 500, 128)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, k, m)
    assert out.shape == ()
    torch._dynamo.reset()
    qg, kg, vg = meta(2, 8, 300, 128, grad=True), meta(2, 2, 500, 128, grad=True), meta(2, 2, 500, 128, grad=True)
    torch.compile(f, fullgraph=True, backend="aot_eager")(qg, kg, vg, m).backward()
    assert qg.grad.shape == qg.shape and kg.grad.shape == kg.shape and vg.grad.shape == vg.shape


# ---- which op a call takes, with which mask ---------------------------------------------------


def other_masks(bound):
    return (bound["kv_lengths"], bound["window_left"], bound["window_right"], bound["alignment"],
            bound["is_causal"])


@pytest.mark.parametrize("nq,nkv", [(64, 64), (64, 80), (90, 40)])
def test_inference_dispatches_the_mask_as_given(nq, nkv):
    q, k = meta(2, 4, nq, 32), meta(2, 2, nkv, 32)
    m = meta_mask(2, 1, 1, nkv)
    with OpLog() as log:
        qattn.attention(q, k, k, attn_mask=m)
    assert [name for name, _ in log.calls] == ["attention"]
    bound = log.calls[0][1]
    assert bound["attn_mask"] is m  # as given: the broadcast happens in _Call, as a view
    assert other_masks(bound) == (None, -1, -1, "bottom_right", False)


def test_a_call_without_a_mask_passes_no_mask_argument(monkeypatch):
    seen = []
    monkeypatch.setattr(ops, "_forward", lambda *args, **mask: seen.append(mask) or (args[0], None))
    q, k = meta(*Q_SHAPE), meta(*K_SHAPE)
    qattn.attention(q, k, k)
    qattn.attention(q, k, k, attn_mask=None, is_causal=True, causal_alignment="bottom_right")
    m = meta_mask(64, 80)
    qattn.attention(q, k, k, attn_mask=m)
    assert seen == [{}, {}, {"attn_mask": m}]
    assert ops._mask_options() == {} and ops._mask_options(attn_mask=None) == {}


def test_masked_training_dispatches_the_mask_to_forward_and_backward():
    q, k = meta(1, 4, 100, 64, grad=True), meta(1, 2, 300, 64, grad=True)
    m = meta_mask(100, 300)
    with OpLog() as log:
        o, lse = qattn.attention(q, k, k, return_lse=True, attn_mask=m)
    assert [name for name, _ in log.calls] == ["attention_train"]
    assert log.calls[0][1]["attn_mask"] is m
    with OpLog() as log:
        (o.float().sum() + lse.sum()).backward()
    assert [name for name, _ in log.calls] == ["attention_backward"]
    bound = log.calls[0][1]
    assert bound["attn_mask"] is m and bound["grad_lse"] is not None
    assert other_masks(bound) == (None, -1, -1, "bottom_right", False)


def test_backward_of_the_inference_op_called_directly_keeps_the_attn_mask():
    q = meta(1, 4, 128, 64, grad=True)
    m = meta_mask(1, 4, 128, 128)
    o, _ = torch.ops.qattn.attention(q, q, q, False, None, "HND", False, "per_thread", attn_mask=m)
    with OpLog() as log:
        o.float().sum().backward()
    assert [name for name, _ in log.calls] == ["attention", "attention_backward"]
    assert all(b["attn_mask"] is m for _, b in log.calls)
    assert q.grad.shape == q.shape


# ---- what _Call hands the C ABI (CPU tensors; nothing is launched) ----------------------------


def call_for(q, k, v, **kw):
    opts = dict(is_causal=False, scale=None, layout="HND", return_lse=False, granularity="per_thread")
    opts.update(kw)
    return ops._Call(q, k, v, **opts)


def test_call_passes_the_mask_as_a_broadcast_view():
    b, hq, hkv, nq, nkv = 3, 4, 2, 100, 300
    q = torch.zeros(b, hq, nq, 64, dtype=torch.bfloat16)
    k = torch.zeros(b, hkv, nkv, 64, dtype=torch.bfloat16)
    plain = call_for(q, k, k)
    full = torch.zeros(b, hq, nq, nkv, dtype=torch.bool)
    big = torch.zeros(nkv + 1, nq + 5, dtype=torch.bool)
    cases = [  # (mask, its (B, Hq, Nq, Nkv) byte strides, its first byte)
        (torch.zeros(nq, nkv, dtype=torch.bool), (0, 0, nkv, 1), 0),
        (torch.zeros(b, 1, 1, nkv, dtype=torch.bool), (nkv, 0, 0, 1), 0),
        (torch.zeros(nkv, dtype=torch.bool), (0, 0, 0, 1), 0),
        (torch.zeros(hq, 1, nkv, dtype=torch.bool), (0, nkv, 0, 1), 0),
        (full, (hq * nq * nkv, nq * nkv, nkv, 1), 0),
        (big[1:, 3:3 + nq].t(), (0, 0, 1, nq + 5), (nq + 5) + 3),  # transposed, an odd offset
        (torch.zeros(1, 1, nq, nkv, dtype=torch.bool).expand(b, 1, nq, nkv), (0, 0, nkv, 1), 0),
    ]
    for mask, strides, offset in cases:
        c = call_for(q, k, k, attn_mask=mask)
        assert c.mask[:4] == (0, -1, -1, _C.ALIGN_BOTTOM_RIGHT)
        assert c.mask[4] == mask.data_ptr() == mask.untyped_storage().data_ptr() + offset
        assert c.mask[5:] == strides + (_C.MASK_BOOL,), (tuple(mask.shape), c.mask)
        # Kept alive on the call, a view of the caller's mask (no copy).
        assert c.attn_mask.shape == (b, hq, nq, nkv) and c.attn_mask.data_ptr() == mask.data_ptr()
        assert c.ws_bytes >= plain.ws_bytes


def test_call_refuses_a_bad_attn_mask():
    q = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)
    ok = torch.ones(64, 64, dtype=torch.bool)
    for kw, match in ((dict(attn_mask=ok.float()), "attn_mask.dtype = torch.float32"),
                      (dict(attn_mask=ok[:5]), r"attn_mask has shape \(5, 64\)"),
                      (dict(attn_mask=ok, is_causal=True), "attn_mask with is_causal=True"),
                      (dict(attn_mask=ok, window_right=0), "attn_mask with a window"),
                      (dict(attn_mask=ok, kv_lengths=torch.ones(2, dtype=torch.int32)),
                       "attn_mask with kv_lengths")):
        with pytest.raises(QattnError, match=match):
            call_for(q, q, q, **kw)


def test_nhd_call_takes_the_mask_in_bhnk_order():
    q = torch.zeros(2, 100, 4, 64, dtype=torch.float16)  # NHD: B 2, Nq 100, Hq 4
    k = torch.zeros(2, 300, 2, 64, dtype=torch.float16)
    mask = torch.zeros(2, 4, 100, 300, dtype=torch.bool)
    c = call_for(q, k, k, layout="NHD", attn_mask=mask)
    assert c.mask[4:] == (mask.data_ptr(), 4 * 100 * 300, 100 * 300, 300, 1, _C.MASK_BOOL)
    # An additive mask of q's dtype: its element strides in bytes, read in place.
    add = torch.zeros(2, 1, 100, 300, dtype=torch.float16)
    c = call_for(q, k, k, layout="NHD", attn_mask=add)
    assert c.mask[4:] == (add.data_ptr(), 2 * 100 * 300, 0, 2 * 300, 2, _C.MASK_ADDITIVE)
    with pytest.raises(QattnError, match=r"attn_mask has shape \(2, 100, 4, 300\)"):
        call_for(q, k, k, layout="NHD", attn_mask=torch.zeros(2, 100, 4, 300, dtype=torch.bool))


# ---- the drop-in: a boolean mask to qattn's op, a float mask to SDPA --------------------------


def randn(*shape, dtype=torch.bfloat16, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.fixture
def op_calls(monkeypatch):
    """The CPU stands in for a supported GPU; ops.attention (what the drop-in calls for a
    call it runs) is replaced by SDPA in FP64 with the mask it receives, recording the
    call."""
    calls = []
    monkeypatch.setattr(sdpa, "_device_runs_qattn", lambda device_type, index: True)

    def attention(q, k, v, is_causal=False, scale=None, layout="HND", return_lse=False, **kw):
        calls.append(dict(q=q, k=k, is_causal=is_causal, **kw))
        g = q.shape[1] // k.shape[1]
        kk, vv = (t.double().repeat_interleave(g, 1) for t in (k, v))
        m = kw.get("attn_mask")
        m = m.double() if m is not None and m.dtype != torch.bool else m  # additive: in FP64 too
        o = F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=m, is_causal=is_causal,
                                           scale=scale)
        return o.to(q.dtype)

    monkeypatch.setattr(ops, "attention", attention)
    return calls


@pytest.mark.parametrize("hq,hkv,gqa", [(4, 4, False), (8, 2, True), (4, 1, False)])
@pytest.mark.parametrize("mask_shape", [(64, 80), (1, 80), (2, 1, 1, 80), (2, 1, 64, 80), (1, 64, 80), (64, 1)],
                         ids=str)
def test_drop_in_routes_a_bool_mask_to_qattn(op_calls, hq, hkv, gqa, mask_shape):
    q, k, v = randn(2, hq, 64, 32), randn(2, hkv, 80, 32, seed=8), randn(2, hkv, 80, 32, seed=9)
    g = torch.Generator().manual_seed(10)
    mask = torch.rand(mask_shape, generator=g) > 0.4
    qattn.set_fallback("raise")  # qattn's path, or an error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = qattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert len(op_calls) == 1
    call = op_calls[0]
    assert call["attn_mask"] is mask and call["is_causal"] is False and call["k"] is k
    assert call["causal_alignment"] == "top_left"  # as for every drop-in call; no causal here
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                         enable_gqa=gqa)
    torch.testing.assert_close(o.double(), ref, rtol=2.0**-7, atol=2.0**-12)  # bf16 rounding


def test_drop_in_without_a_mask_passes_none(op_calls):
    q = randn(2, 4, 64, 32)
    qattn.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert len(op_calls) == 1 and "attn_mask" not in op_calls[0]


def test_drop_in_sends_the_bool_mask_to_the_custom_op():
    # Meta tensors take qattn's op (no monkeypatching): the custom op gets the mask.
    qattn.set_fallback("raise")
    q, k = meta(2, 8, 64, 32), meta(2, 2, 80, 32)
    m = meta_mask(2, 1, 64, 80)
    with OpLog() as log:
        o = qattn.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=True)
    assert o.shape == q.shape
    assert [name for name, _ in log.calls] == ["attention"] and log.calls[0][1]["attn_mask"] is m
    assert other_masks(log.calls[0][1]) == (None, -1, -1, "bottom_right", False)


def test_drop_in_routes_an_additive_mask_of_the_query_dtype_to_qattn(op_calls):
    q, k, v = randn(2, 4, 64, 32), randn(2, 4, 80, 32, seed=8), randn(2, 4, 80, 32, seed=9)
    keep = torch.rand(64, 80, generator=torch.Generator().manual_seed(11)) > 0.3
    additive = torch.randn(64, 80, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    additive = additive.masked_fill(~keep, float("-inf"))
    qattn.set_fallback("raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = qattn.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    assert len(op_calls) == 1 and op_calls[0]["attn_mask"] is additive
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=additive.double())
    torch.testing.assert_close(o.double(), ref, rtol=2.0**-7, atol=2.0**-12)  # bf16 rounding
    # Another float dtype (SDPA takes FP32 masks with 16-bit inputs), or a training call:
    # SDPA, each with its reason.
    declined = sdpa._decline(q, k, v, additive.float(), 0.0, False, None, False)
    assert declined[0] == "attn_mask dtype" and "torch.float32 attn_mask" in declined[1]
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    assert sdpa._decline(*grad, additive, 0.0, False, None, False)[0] == "attn_mask float grad"
    qattn.set_fallback("warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o32 = qattn.scaled_dot_product_attention(q, k, v, attn_mask=additive.float())
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "torch.float32 attn_mask" in msgs[0], msgs
    assert len(op_calls) == 1
    assert torch.equal(o32, F.scaled_dot_product_attention(q, k, v, attn_mask=additive.float()))


def test_attention_takes_an_additive_mask_and_names_a_bad_one():
    q, k, v = (t.to("meta") for t in (randn(2, 4, 64, 32), randn(2, 4, 80, 32), randn(2, 4, 80, 32)))
    additive = torch.zeros(64, 80, dtype=torch.bfloat16, device="meta")
    o = torch.ops.qattn.attention(q, k, v, False, None, "HND", False, "per_thread", attn_mask=additive)[0]
    assert o.shape == q.shape
    with pytest.raises(QattnError, match=r"attn_mask.dtype = torch.float16; allowed: torch.bool .* or "
                                         r"q's dtype torch.bfloat16"):
        torch.ops.qattn.attention(q, k, v, False, None, "HND", False, "per_thread",
                                  attn_mask=additive.half())


def test_additive_layout_copies_only_what_the_kernel_cannot_read():
    even = torch.zeros(2, 1, 64, 80, dtype=torch.bfloat16)
    assert ops._additive_layout(even, 2, 4, 64, 80) is not None
    assert ops._additive_layout(even, 2, 4, 64, 80).data_ptr() == even.data_ptr()  # read in place
    odd = torch.randn(64, 81).to(torch.bfloat16)
    m = ops._additive_layout(odd, 2, 4, 64, 81)  # rows of 162 bytes: copied into 164-byte rows
    assert m.shape == (1, 1, 64, 81) and m.stride() == (64 * 82, 64 * 82, 82, 1)
    assert torch.equal(m[0, 0], odd)
    keys = torch.randn(64, 1).to(torch.bfloat16)  # broadcast over keys: materialized
    m = ops._additive_layout(keys, 1, 1, 64, 80)
    assert m.stride(3) == 1 and torch.equal(m[0, 0], keys.expand(64, 80))
    sliced = torch.randn(64, 82).to(torch.bfloat16)[:, 1:81]  # a pointer 2 bytes off
    m = ops._additive_layout(sliced, 1, 1, 64, 80)
    assert m.data_ptr() % 4 == 0 and torch.equal(m[0, 0], sliced)


def test_drop_in_declines_what_its_kernel_does_not_take(op_calls):
    q, k = randn(2, 4, 64, 32), randn(2, 4, 80, 32, seed=8)
    ok = torch.ones(64, 80, dtype=torch.bool)
    assert sdpa._decline(q, k, k, ok, 0.0, True, None, False)[0] == "attn_mask"  # SDPA raises
    assert sdpa._decline(q, k, k, ok[:, :79], 0.0, False, None, False)[0] == "attn_mask shape"
    # SDPA takes 2-D to 4-D masks only; qattn.attention takes any broadcastable one.
    assert sdpa._decline(q, k, k, ok[0], 0.0, False, None, False)[0] == "attn_mask shape"
    assert sdpa._decline(q, k, k, ok[None, None, None], 0.0, False, None, False)[0] == "attn_mask shape"
    assert sdpa._decline(q, k, k, ok.to("meta"), 0.0, False, None, False)[0] == "attn_mask device"
    assert sdpa._decline(q, k, k, [[True]], 0.0, False, None, False)[0] == "attn_mask"
    grad = torch.zeros(64, 80, requires_grad=True)  # a float mask that requires grad
    assert sdpa._decline(q, k, k, grad, 0.0, False, None, False)[0] == "attn_mask dtype"
    assert sdpa._decline(q, k, k, grad.bfloat16(), 0.0, False, None, False)[0] == "attn_mask grad"
    assert sdpa._decline(q, k, k, ok, 0.0, False, None, False) is None
    # A mask with is_causal is SDPA's to answer, in either mode: its error where it raises
    # one (PyTorch >= 2.12 on every device), else its result (2.11's CPU path).
    try:
        expect = F.scaled_dot_product_attention(q, k, k, attn_mask=ok, is_causal=True)
    except RuntimeError as error:
        expect = error
    for mode in ("warn", "raise"):
        qattn.set_fallback(mode)
        fallback._warned.clear()
        if isinstance(expect, RuntimeError):
            with pytest.raises(RuntimeError, match="attn_mask"):
                qattn.scaled_dot_product_attention(q, k, k, attn_mask=ok, is_causal=True)
        elif mode == "warn":
            with pytest.warns(QattnFallbackWarning):
                got = qattn.scaled_dot_product_attention(q, k, k, attn_mask=ok, is_causal=True)
            torch.testing.assert_close(got, expect, rtol=0, atol=0)
        else:
            with pytest.raises(QattnUnsupportedError):
                qattn.scaled_dot_product_attention(q, k, k, attn_mask=ok, is_causal=True)
    assert not op_calls


# ---- the backward of a masked training call ---------------------------------------------------


MATH_CASES = [  # (b, hq, hkv, nq, nkv, d, mask shape, layout); random masks, some rows empty
    (2, 4, 2, 37, 53, 24, (37, 53), "HND"),
    (2, 4, 4, 53, 37, 32, (2, 4, 53, 37), "NHD"),
    (3, 2, 1, 40, 60, 16, (3, 1, 1, 60), "HND"),
    (2, 4, 2, 60, 20, 40, (2, 1, 60, 20), "NHD"),
]


@pytest.mark.parametrize("case", MATH_CASES, ids=[str(c[3:8]) for c in MATH_CASES])
@pytest.mark.parametrize("seed", [1, FRESH_SEED])
@pytest.mark.parametrize("with_lse", [False, True])
def test_exact_backward_with_an_attn_mask_matches_fp64_autograd(case, seed, with_lse, monkeypatch):
    b, hq, hkv, nq, nkv, d, mask_shape, layout = case
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    q, k, v = rnd(*shape_of(b, hq, nq, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout))
    grad_o = rnd(*q.shape)
    grad_lse = torch.randn(b, hq, nq, generator=gen) if with_lse else None
    mask = torch.rand(mask_shape, generator=gen) > 0.5
    if len(mask_shape) == 4 and mask_shape[2] > 1:
        mask[..., 3, :] = False  # a row that sees no key
    elif len(mask_shape) == 4:
        mask[-1] = False  # a batch entry that sees no key
    else:
        mask[3] = False
    monkeypatch.setattr(ops, "_MATH_CHUNK", 7 * b * hq * nkv)  # blocks of rows too
    got = torch.ops.qattn.attention_backward(
        grad_o, q, k, v, q, torch.zeros(b, hq, nq), grad_lse, False, 0.2, layout, "int8", "16bit",
        False, attn_mask=mask)
    want = reference_grads(q, k, v, grad_o, mask, 0.2, layout, grad_lse)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == r.shape and a.dtype == torch.bfloat16 and a.is_contiguous(), name
        # The FP32 result rounded to BF16: half an ulp (2^-9 of the value) plus the FP32
        # sums' rounding.
        err = (a.double() - r).abs()
        assert bool((err <= r.abs() * 2.0**-8 + 1e-4 * r.abs().max()).all()), (name, seed, err.max())
    dead = ~mask.expand(b, hq, nq, nkv).any(-1)  # (B, Hq, Nq)
    assert bool(dead.any())
    dq = to_hnd(got[0], layout)
    assert bool((dq[dead] == 0).all())  # a row that sees no key has no gradient


def test_masked_backward_is_declined_by_sagebwd_and_gives_the_exact_gradients(monkeypatch):
    def no_sagebwd(*args, **kwargs):
        raise AssertionError("SageBwd was called for a mask it does not run")

    monkeypatch.setattr(ops, "_bwd_run", no_sagebwd)
    gen = torch.Generator().manual_seed(5)
    q, go = (torch.randn(1, 2, 40, 16, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, 56, 16, generator=gen).bfloat16() for _ in range(2))
    mask = torch.rand(1, 1, 40, 56, generator=gen) > 0.5
    assert ops._sagebwd_declines(q, k, "HND", False, attn_mask=mask) == (
        "mask attn_mask", "SageBwd runs no mask but causal aligned bottom-right, and this call has "
                          "a boolean attn_mask")
    qattn.set_fallback("warn")
    args = (go, q, k, v, q, torch.zeros(1, 2, 40), None, False, None, "HND", "int8", "16bit", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = ops._backward_cuda(*args, attn_mask=mask)
        ops._backward_cuda(*args, attn_mask=mask)
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "a boolean attn_mask" in msgs[0], msgs
    want = ops._backward_math(go, q, k, v, None, False, None, "HND", attn_mask=mask)
    unmasked = ops._backward_math(go, q, k, v, None, False, None, "HND")
    for a, r, u in zip(got, want, unmasked):
        assert torch.equal(a, r) and not torch.equal(a, u)  # the mask changes the gradients
    qattn.set_fallback("raise")
    with pytest.raises(QattnUnsupportedError, match="a boolean attn_mask") as info:
        ops._backward_cuda(*args, attn_mask=mask)
    assert info.value.reason == "backward mask attn_mask"


# ---- GPU: against PyTorch's SDPA in FP32 on the same inputs --------------------------------


@pytest.fixture
def gpu():
    from gpu import require_sm90

    require_sm90()
    previous = qattn.set_fallback("raise")  # qattn's kernel, or an error
    yield
    qattn.set_fallback(previous)


BF16, FP16 = torch.bfloat16, torch.float16


def cuda_randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def sdpa_fp32(q, k, v, mask, gqa):
    """PyTorch's SDPA, math backend, in FP32 on the inputs upcast (HND)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(g, 1) for t in (k, v)) if gqa else (k.float(), v.float())
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


def run_qattn(q, k, v, mask, layout, gqa):
    """qattn's output (in `layout`) and LSE with `mask`: the SDPA drop-in for HND inputs,
    qattn.attention for NHD ones (the drop-in takes HND only)."""
    if layout == "HND":
        o = qattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        o = qattn.attention(q, k, v, layout="NHD", attn_mask=mask)
    _, lse = qattn.attention(q, k, v, layout=layout, attn_mask=mask, return_lse=True)
    return o, lse


def check_against_sdpa(q, k, v, mask, what, gqa=False, layout="HND"):
    """qattn with `mask` against FP32 SDPA: the rows that see a key within the scheme's
    bounds, the others exactly 0 with LSE -inf (q, k, v in `layout`, the mask (B, H, Nq,
    Nkv) in either)."""
    print(what)  # shown by pytest when the test fails
    qh, kh, vh = (to_hnd(t, layout) for t in (q, k, v))
    b, hq, nq, _ = qh.shape
    nkv = kh.shape[2]
    o, lse = run_qattn(q, k, v, mask, layout, gqa)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous(), what
    o = to_hnd(o, layout)
    seen = mask.expand(b, hq, nq, nkv)
    dead = ~seen.any(-1)  # (B, Hq, Nq): rows that see no key
    assert bool(torch.isfinite(o).all()), f"{what}: non-finite output"
    assert bool((o[dead] == 0).all()), f"{what}: a row that sees no key is not exactly 0"
    assert torch.equal(torch.isneginf(lse), dead), f"{what}: LSE -inf rows"
    assert bool(torch.isfinite(lse[~dead]).all()), f"{what}: non-finite LSE"
    if bool(dead.all()):
        return
    ref = sdpa_fp32(qh, kh, vh, mask, gqa or hq != kh.shape[1])
    live = ~dead
    cos, rel = metrics(o[live], ref[live])
    # SageAttention2-8b's bounds against the exact result (tests/tolerances/sage2_8b.json).
    assert cos >= MIN_COSSIM, f"{what}: CosSim {cos:.6f} < {MIN_COSSIM}"
    assert rel <= MAX_REL_L1, f"{what}: relative L1 {rel:.4f} > {MAX_REL_L1}"
    # The LSE against FP64 (natural log), within the scheme's per-row bound.
    g = hq // kh.shape[1]
    s = (qh.double() @ kh.double().repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(qh.shape[-1])
    ref_lse = torch.logsumexp(s.masked_fill(~seen, -math.inf), -1)
    err = (lse.double() - ref_lse)[live].abs().max().item()
    assert err <= LSE_ATOL, f"{what}: LSE error {err:.4f} > {LSE_ATOL}"


def padding_mask(lengths, nkv):
    """(B, 1, 1, Nkv): batch entry b sees keys j < lengths[b]."""
    j = torch.arange(nkv, device="cuda")
    return (j[None, :] < torch.tensor(lengths, device="cuda")[:, None])[:, None, None, :]


def document_mask(bounds, n):
    """(N, N) block diagonal: query i sees key j iff both lie in one document [bounds[t],
    bounds[t + 1])."""
    doc = torch.bucketize(torch.arange(n, device="cuda"), torch.tensor(bounds[1:-1], device="cuda"),
                          right=True)
    return doc[:, None] == doc[None, :]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_padding_mask_with_an_empty_entry(gpu, dtype):
    gen = torch.Generator(device="cuda").manual_seed(31)
    q, k, v = (cuda_randn((3, 4, 777, 128), dtype, gen) for _ in range(3))
    mask = padding_mask([777, 301, 0], 777)  # entry 2 sees no key: all its rows are 0
    check_against_sdpa(q, k, v, mask, f"padding (3, 1, 1, 777) {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_document_mask(gpu, dtype):
    gen = torch.Generator(device="cuda").manual_seed(32)
    q, k, v = (cuda_randn((2, 4, 1000, 64), dtype, gen) for _ in range(3))
    mask = document_mask([0, 200, 513, 900, 1000], 1000)  # 2-D (Nq, Nkv)
    check_against_sdpa(q, k, v, mask, f"documents (1000, 1000) {dtype}")
    # The causal rule inside each document, written into the mask.
    causal = mask & torch.ones(1000, 1000, dtype=torch.bool, device="cuda").tril()
    check_against_sdpa(q, k, v, causal, f"causal documents (1000, 1000) {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [33, FRESH_SEED])
def test_gpu_random_mask_with_fully_masked_rows(gpu, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = cuda_randn((2, 4, 333, 128), dtype, gen)
    k, v = cuda_randn((2, 4, 517, 128), dtype, gen), cuda_randn((2, 4, 517, 128), dtype, gen)
    mask = torch.rand((2, 4, 333, 517), generator=gen, device="cuda") > 0.5  # every tile cut
    mask[:, :, ::11] = False  # fully masked rows, in many query blocks
    mask[1, 2] = False  # a whole head
    check_against_sdpa(q, k, v, mask, f"random (2, 4, 333, 517) {dtype} seed {seed}")
    # Sparse: most 128 x 128 tiles hidden entirely, a few visible entirely.
    sparse = torch.zeros_like(mask)
    sparse[:, :, :100, 400:] = True
    sparse[:, :, 200:, :130] = torch.rand((2, 4, 133, 130), generator=gen, device="cuda") > 0.9
    check_against_sdpa(q, k, v, sparse, f"sparse (2, 4, 333, 517) {dtype} seed {seed}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nq,nkv", [(300, 900), (700, 250)])
def test_gpu_gqa_mask_with_nq_not_nkv(gpu, dtype, nq, nkv):
    # (B, 1, Nq, Nkv): a query block at the end of a KV cache (bottom-right causal) with
    # key padding per entry; with Nq > Nkv the first Nq - Nkv rows see no key.
    gen = torch.Generator(device="cuda").manual_seed(34 + nq)
    q = cuda_randn((2, 8, nq, 64), dtype, gen)
    k, v = cuda_randn((2, 2, nkv, 64), dtype, gen), cuda_randn((2, 2, nkv, 64), dtype, gen)
    i = torch.arange(nq, device="cuda")[:, None]
    j = torch.arange(nkv, device="cuda")[None, :]
    mask = (j <= i + nkv - nq)[None, None] & padding_mask([nkv, nkv - 77], nkv)
    check_against_sdpa(q, k, v, mask, f"GQA 8/2 (2, 1, {nq}, {nkv}) {dtype}", gqa=True)
    # MQA: one KV head, which SDPA broadcasts without enable_gqa.
    check_against_sdpa(q, k[:, :1], v[:, :1], mask, f"MQA (2, 1, {nq}, {nkv}) {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_nhd_layout(gpu, dtype):
    gen = torch.Generator(device="cuda").manual_seed(35)
    q = cuda_randn((2, 450, 8, 96), dtype, gen)  # NHD, head dim 96 (padded inside)
    k, v = cuda_randn((2, 650, 2, 96), dtype, gen), cuda_randn((2, 650, 2, 96), dtype, gen)
    mask = torch.rand((2, 8, 450, 650), generator=gen, device="cuda") > 0.3  # (B, H, Nq, Nkv)
    mask[0, :, 17] = False
    check_against_sdpa(q, k, v, mask, f"NHD (2, 8, 450, 650) {dtype}", layout="NHD")
    check_against_sdpa(q, k, v, padding_mask([650, 129], 650), f"NHD padding {dtype}", layout="NHD")


def test_gpu_strided_masks(gpu):
    # The mask is read in place with any byte strides: a transposed view, a slice at an
    # odd byte, a batch broadcast by expand (stride 0), a one-row mask.
    gen = torch.Generator(device="cuda").manual_seed(36)
    q = cuda_randn((2, 4, 300, 64), BF16, gen)
    k, v = cuda_randn((2, 4, 400, 64), BF16, gen), cuda_randn((2, 4, 400, 64), BF16, gen)
    big = torch.rand((401, 303), generator=gen, device="cuda") > 0.5
    transposed = big[1:, 3:].t()  # (300, 400), strides (1, 303), offset 306 bytes
    assert transposed.stride() == (1, 303) and not transposed.is_contiguous()
    check_against_sdpa(q, k, v, transposed, "transposed (300, 400) at an odd byte")
    batch = (torch.rand((1, 4, 300, 400), generator=gen, device="cuda") > 0.5).expand(2, 4, 300, 400)
    check_against_sdpa(q, k, v, batch, "batch broadcast (stride 0)")
    row = torch.rand((1, 400), generator=gen, device="cuda") > 0.5
    check_against_sdpa(q, k, v, row, "one row (1, 400) for every query")


def test_gpu_compile_fullgraph_matches_eager(gpu):
    gen = torch.Generator(device="cuda").manual_seed(37)
    q = cuda_randn((2, 8, 700, 128), BF16, gen)
    k, v = cuda_randn((2, 2, 300, 128), BF16, gen), cuda_randn((2, 2, 300, 128), BF16, gen)
    mask = torch.rand((2, 1, 700, 300), generator=gen, device="cuda") > 0.5
    lengths = torch.tensor([300, 123], device="cuda")

    def f(q, k, v, mask):
        return qattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def g(q, k, v, lengths):  # the mask built inside the graph
        keep = torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None]
        return qattn.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :],
                                                  enable_gqa=True)

    eager = f(q, k, v, mask)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, mask)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)  # the same kernel call
    ref = sdpa_fp32(q, k, v, mask, True)
    cos, rel = metrics(compiled, ref)  # no empty row at p = 0.5 over 300 keys
    assert cos >= MIN_COSSIM and rel <= MAX_REL_L1, (cos, rel)
    eager = g(q, k, v, lengths)
    compiled = torch.compile(g, fullgraph=True)(q, k, v, lengths)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert not torch.equal(compiled[1], f(q, k, v, torch.ones_like(mask))[1])  # the mask acts


def test_gpu_opcheck_with_an_attn_mask(gpu):
    gen = torch.Generator(device="cuda").manual_seed(38)
    q = cuda_randn((1, 4, 256, 64), BF16, gen)
    k, v = cuda_randn((1, 2, 300, 64), BF16, gen), cuda_randn((1, 2, 300, 64), BF16, gen)
    mask = torch.rand((1, 1, 256, 300), generator=gen, device="cuda") > 0.5
    torch.library.opcheck(
        torch.ops.qattn.attention.default,
        (q, k, v, False, None, "HND", True, "per_thread"),
        {"attn_mask": mask},
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("layout,dtype", [("HND", BF16), ("NHD", FP16)])
def test_gpu_masked_training_falls_back_to_exact_gradients(gpu, layout, dtype):
    b, hq, hkv, nq, nkv, d = 2, 4, 2, 300, 500, 64
    gen = torch.Generator(device="cuda").manual_seed(39)
    q = cuda_randn(shape_of(b, hq, nq, d, layout), dtype, gen).requires_grad_(True)
    k = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen).requires_grad_(True)
    v = cuda_randn(shape_of(b, hkv, nkv, d, layout), dtype, gen).requires_grad_(True)
    go = cuda_randn(q.shape, dtype, gen)
    mask = torch.rand((b, 1, nq, nkv), generator=gen, device="cuda") > 0.5
    mask[:, :, 5] = False  # rows that see no key: no gradient
    qattn.set_fallback("warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o = qattn.attention(q, k, v, layout=layout, attn_mask=mask)
        o.backward(go)
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "a boolean attn_mask" in msgs[0], msgs
    # The forward is qattn's kernel, within the scheme's bounds (rows with a key).
    seen = mask.expand(b, hq, nq, nkv)
    live = seen.any(-1)
    ref = sdpa_fp32(*(to_hnd(t.detach(), layout) for t in (q, k, v)), mask, True)
    cos, rel = metrics(to_hnd(o.detach(), layout)[live], ref[live])
    assert cos >= MIN_COSSIM and rel <= MAX_REL_L1, ("forward", cos, rel)
    assert bool((to_hnd(o.detach(), layout)[~live] == 0).all())
    # The gradients are the exact FP32 ones, rounded to the inputs' type.
    want = reference_grads(q, k, v, go, seen, layout=layout)
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), want):
        cos, rel = metrics(t.grad, r)
        print(f"{name}: cos {cos:.7f} rel-L1 {rel:.5f}")
        assert cos >= GRAD_COS_MIN and rel <= GRAD_REL_L1_MAX, (name, cos, rel)
    assert bool((to_hnd(q.grad, layout)[~live] == 0).all())
    # "raise": the same call's backward is refused, naming the mask.
    qattn.set_fallback("raise")
    o = qattn.attention(q, k, v, layout=layout, attn_mask=mask)
    with pytest.raises(QattnUnsupportedError, match="a boolean attn_mask") as info:
        o.backward(go)
    assert info.value.reason == "backward mask attn_mask"


# ---- additive masks on the GPU ----------------------------------------------------------


def check_additive_against_sdpa(q, k, v, mask, what, gqa=False, layout="HND"):
    """qattn with the additive `mask` (q's dtype) against FP32 SDPA with the same mask: the
    rows that see a key (a value above -inf) within the scheme's bounds, the LSE against
    FP64 within LSE_ATOL, rows whose every value is -inf exactly 0 with LSE -inf (where
    SDPA gives NaN)."""
    print(what)
    qh, kh, vh = (to_hnd(t, layout) for t in (q, k, v))
    b, hq, nq, _ = qh.shape
    nkv = kh.shape[2]
    o, lse = run_qattn(q, k, v, mask, layout, gqa)
    o = to_hnd(o, layout)
    full = mask.expand(b, hq, nq, nkv)
    dead = torch.isneginf(full).all(-1)
    assert bool(torch.isfinite(o).all()), f"{what}: non-finite output"
    assert bool((o[dead] == 0).all()), f"{what}: a row that sees no key is not exactly 0"
    assert torch.equal(torch.isneginf(lse), dead), f"{what}: LSE -inf rows"
    ref = sdpa_fp32(qh, kh, vh, mask.float(), gqa or hq != kh.shape[1])
    live = ~dead
    cos, rel = metrics(o[live], ref[live])
    assert cos >= MIN_COSSIM, f"{what}: CosSim {cos:.6f} < {MIN_COSSIM}"
    assert rel <= MAX_REL_L1, f"{what}: relative L1 {rel:.4f} > {MAX_REL_L1}"
    g = hq // kh.shape[1]
    s = (qh.double() @ kh.double().repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(qh.shape[-1])
    ref_lse = torch.logsumexp(s + full.double(), -1)
    # Rows whose every value is below -2.3e38 (bf16's lowest) average their keys as SDPA
    # does, with the values saturated there (numerics/additive_mask.h): their LSE is not
    # SDPA's and is not compared.
    rows = live & (full.float().amax(-1) > -2.3e38)
    err = (lse.double() - ref_lse)[rows].abs().max().item()
    assert err <= LSE_ATOL, f"{what}: LSE error {err:.4f} > {LSE_ATOL}"


def alibi_causal(heads, n, dtype):
    """(1, H, N, N): -slope_h * (i - j) on and below the diagonal, -inf above (ALiBi)."""
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    slopes = torch.tensor([2.0 ** -(1 + h % 8) for h in range(heads)], device="cuda")[:, None, None]
    bias = -slopes * (i - j).float()
    return bias.masked_fill(j > i, float("-inf"))[None].to(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_additive_alibi_causal(gpu, dtype, d):
    gen = torch.Generator(device="cuda").manual_seed(41)
    q, k, v = (cuda_randn((2, 4, 1000, d), dtype, gen) for _ in range(3))
    check_additive_against_sdpa(q, k, v, alibi_causal(4, 1000, dtype), f"ALiBi causal d {d} {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [42, FRESH_SEED])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_additive_random_values_odd_keys(gpu, dtype, seed, layout):
    # Nkv = 517: rows of an odd number of values, copied into padded rows; every tile cut;
    # -inf among the values, a whole row of them.
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = cuda_randn((2, 4, 333, 128), dtype, gen)
    k, v = cuda_randn((2, 4, 517, 128), dtype, gen), cuda_randn((2, 4, 517, 128), dtype, gen)
    mask = (2 * torch.randn((2, 1, 333, 517), generator=gen, device="cuda")).to(dtype)
    mask[torch.rand((2, 1, 333, 517), generator=gen, device="cuda") < 0.25] = float("-inf")
    mask[:, :, ::17] = float("-inf")
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    check_additive_against_sdpa(q, k, v, mask, f"random values (2, 1, 333, 517) {dtype} seed {seed}",
                                layout=layout)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_additive_padding_and_finfo_min(gpu, dtype):
    gen = torch.Generator(device="cuda").manual_seed(43)
    q, k, v = (cuda_randn((3, 8, 600, 64), dtype, gen) for _ in range(3))
    keep = padding_mask([600, 250, 0], 600)
    inf = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, float("-inf"))
    check_additive_against_sdpa(q, k, v, inf, f"padding -inf {dtype}")
    # transformers' form: the dtype's lowest value instead of -inf. Every row then sees
    # keys (entry 2 at its lowest value everywhere), as in SDPA.
    low = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, torch.finfo(dtype).min)
    check_additive_against_sdpa(q, k, v, low, f"padding finfo.min {dtype}")
    # GQA with a per-head (1, Hq, 1, Nkv) bias.
    bias = torch.randn((1, 8, 1, 600), generator=gen, device="cuda").to(dtype)
    check_additive_against_sdpa(q, k[:, :2], v[:, :2], bias, f"per-head bias, GQA 8:2 {dtype}", gqa=True)
