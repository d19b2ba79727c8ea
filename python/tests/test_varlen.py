"""qattn.varlen_attention: packed variable-length batches (flash_attn_varlen_func's
arguments).

CPU parts (torch on the CPU and qattn._C): the signature against FlashAttention's, every
named error of a bad call (tensors, offsets, max lengths, the options qattn has not), the
FP32 math of the CPU path against an FP64 reference computed per sequence with a mask
written here from the rule (causal and windows bottom-right or top-left per
sequence, GQA, lengths 1, tails, empty sequences), its gradients against FP64 autograd,
the fallback mode on the CPU, and the LSE's shape and layout.

Tolerances. The CPU path computes in FP32 from 16-bit inputs and rounds O to their type:
per element |o - r| <= 2^-8·|r| + 2^-12 (twice bf16's half-ulp relative error for the
final rounding, plus an absolute floor for values near 0 where FP32 sums of up to ~200
terms of size ~1 leave ~1e-6); the LSE, not rounded, within 1e-4 of FP64 (FP32 rounding of
scores of size ~10 and of the row sums). Gradients are rounded to the inputs' type too:
CosSim >= 0.99999 and relative L1 <= 2^-8, as test_masks.py states for the exact backward.

GPU parts (an sm_90 GPU; each skips with the reason elsewhere): the packed call (the
varlen kernel, one C call) equals qattn.attention on each sequence bit for bit (each
sequence is quantized and attended as a call of its own; these sequences are short
enough that no per-sequence call takes the FMA-pipe exp shape), with and without the
host check of the offsets (check_offsets) and under torch.compile; stays within the SA2-8b bounds of
tests/tolerances/sage2_8b.json against FP64; and trains (gradients equal to
per-sequence training with the deterministic backward).

Seeds: fixed ones, plus a fresh one per run (printed; QATTN_TEST_SEED repeats it).
"""

import inspect
import math
import os
import random
import re
import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")

from qattn import QattnError, QattnFallbackWarning, QattnUnsupportedError, fallback  # noqa: E402

from tolerances import (FALLBACK_GRAD_COS_MIN, FALLBACK_GRAD_REL_L1_MAX, LSE_ATOL,  # noqa: E402
                        MAX_REL_L1, MIN_COSSIM)

FRESH_SEED = int(os.environ.get("QATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
print(f"test_varlen.py: fresh seed {FRESH_SEED} (QATTN_TEST_SEED={FRESH_SEED} repeats it)")

# The CPU path is exact FP32 math rounded to bf16: 2^-9 relative at most (2^-8 leaves a
# factor 2), plus 2^-12 absolute for outputs near zero; its FP32 LSE is within FP32
# rounding (~1e-7 relative) of FP64's, so 1e-4 absolute is loose for these small LSEs.
O_REL, O_ABS = 2.0**-8, 2.0**-12
LSE_ABS_CPU = 1e-4
GRAD_COS_MIN, GRAD_REL_L1_MAX = FALLBACK_GRAD_COS_MIN, FALLBACK_GRAD_REL_L1_MAX  # tolerances.py


@pytest.fixture(autouse=True)
def restore_fallback():
    mode = qattn.get_fallback()
    fallback._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QattnFallbackWarning)
        yield
    qattn.set_fallback(mode)


def offsets(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def pack(lengths_q, lengths_k, hq, hkv, d, seed, dtype=torch.bfloat16, device="cpu", grad=False):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).to(device)
               for shape in ((tq, hq, d), (tk, hkv, d), (tk, hkv, d)))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, offsets(lengths_q, device), offsets(lengths_k, device)


def rule_mask(nq, nkv, causal, window, alignment):
    """The visible keys of one sequence, written from qattn.h's rule (not from
    ops._visible_keys, which the CPU path uses): row i's diagonal key D(i) = i + nkv - nq
    (bottom-right) or i; key j visible iff D(i) - left <= j <= D(i) + right where set."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(nq)[:, None]
    j = torch.arange(nkv)[None, :]
    diag = i + (nkv - nq if alignment == "bottom_right" else 0)
    seen = torch.ones(nq, nkv, dtype=torch.bool)
    if right >= 0:
        seen &= j <= diag + right
    if left >= 0:
        seen &= j >= diag - left
    return seen


def reference(q, k, v, cu_q, cu_k, causal=False, window=(-1, -1), alignment="bottom_right",
              scale=None):
    """FP64, one sequence at a time: o (total_q, Hq, d) and lse (Hq, total_q); rows that see
    no key give 0 and -inf. Differentiable (float64 autograd)."""
    hq, d = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    sm = scale if scale is not None else 1.0 / math.sqrt(d)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        nq, nkv = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if nq == 0:
            continue
        qs = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        if nkv == 0:
            outs.append(torch.zeros(nq, hq, d, dtype=torch.float64))
            lses.append(torch.full((hq, nq), -math.inf, dtype=torch.float64))
            continue
        ks = k[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(g, 0)
        vs = v[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(g, 0)
        s = (qs @ ks.transpose(-1, -2)) * sm
        seen = rule_mask(nq, nkv, causal, window, alignment)
        s = s.masked_fill(~seen, -math.inf)
        empty = ~seen.any(-1)
        s = s.masked_fill(empty[:, None], 0.0)  # keeps autograd finite on empty rows
        p = torch.softmax(s, -1).masked_fill(empty[:, None], 0.0)
        outs.append((p @ vs).transpose(0, 1))
        lse = torch.logsumexp(s, -1).masked_fill(empty, -math.inf)
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


MASKS = {
    "none": dict(causal=False),
    "causal": dict(causal=True),
    "causal top-left": dict(causal=True, causal_alignment="top_left"),
    "window (3, 2)": dict(window_size=(3, 2)),
    "causal + left 40": dict(causal=True, window_size=(40, -1)),
}

# Lengths 1, tails, len_q != len_k both ways, an empty query side and an empty key side.
LENGTHS = [
    ([1, 65, 0, 130, 7], [1, 65, 5, 40, 0]),
    ([33, 200], [200, 33]),
]


def ref_args(kwargs):
    return dict(causal=kwargs.get("causal", False), window=kwargs.get("window_size", (-1, -1)),
                alignment=kwargs.get("causal_alignment", "bottom_right"))


# ---- the signature and the errors -------------------------------------------------------


def test_signature_is_flash_attn_varlen_funcs():
    params = list(inspect.signature(qattn.varlen_attention).parameters.values())
    names = [p.name for p in params]
    # flash_attn_varlen_func's arguments in its order (FlashAttention 2.x), with its defaults.
    assert names[:15] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                          "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size",
                          "softcap", "alibi_slopes", "deterministic", "return_attn_probs"]
    defaults = {p.name: p.default for p in params}
    assert defaults["dropout_p"] == 0.0 and defaults["softmax_scale"] is None
    assert defaults["causal"] is False and defaults["window_size"] == (-1, -1)
    assert defaults["return_attn_probs"] is False
    # qattn's own options are keyword-only, after them.
    assert names[15:] == ["causal_alignment", "check_offsets"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[15:])


def call(q, k, v, cu_q, cu_k, max_q=1000, max_k=1000, **kwargs):
    return qattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


BAD_OFFSETS = [
    ("q", [1, 4, 7], "cu_seqlens_q[0] = 1"),
    ("k", [0, 6, 5], "cu_seqlens_k decreases at entry 2 (6 then 5)"),
    ("q", [0, 4, 6], "cu_seqlens_q[-1] = 6 but the packed tensor has 7 tokens"),
    ("k", [0, 5, 10], "cu_seqlens_k[-1] = 10 but the packed tensor has 9 tokens"),
]


@pytest.mark.parametrize("which,values,match", BAD_OFFSETS)
def test_bad_offsets_are_named(which, values, match):
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 2, 1, 16, seed=1)
    cu = torch.tensor(values, dtype=torch.int32)
    with pytest.raises(QattnError, match=re.escape(match)) as e:
        call(q, k, v, cu if which == "q" else cu_q, cu if which == "k" else cu_k)
    assert e.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"


def test_bad_offset_tensors_are_named():
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 2, 1, 16, seed=1)
    cases = [
        (dict(cu_q=cu_q.long()), "cu_seqlens_q.dtype = torch.int64; allowed: torch.int32"),
        (dict(cu_k=cu_k.float()), "cu_seqlens_k.dtype = torch.float32"),
        (dict(cu_q=[0, 4, 7]), "cu_seqlens_q is a list"),
        (dict(cu_q=cu_q[None]), r"cu_seqlens_q has shape \(1, 3\)"),
        (dict(cu_q=torch.zeros(1, dtype=torch.int32), cu_k=torch.zeros(1, dtype=torch.int32)),
         r"allowed: \(batch \+ 1,\) with batch >= 1"),
        (dict(cu_k=offsets([5, 4, 0])), "cu_seqlens_q has 3 entries and cu_seqlens_k 4"),
        (dict(cu_q=cu_q.to("meta")), "cu_seqlens_q is on meta but q is on cpu"),
        (dict(max_q=3), r"max_seqlen_q = 3 is below the longest sequence \(4 tokens\)"),
        (dict(max_k=4), r"max_seqlen_k = 4 is below the longest sequence \(5 tokens\)"),
        (dict(max_q=0), "max_seqlen_q = 0; allowed: an int >= 1"),
        (dict(max_k=4.5), "max_seqlen_k = 4.5"),
    ]
    for change, match in cases:
        args = dict(cu_q=cu_q, cu_k=cu_k, max_q=10, max_k=10)
        args.update(change)
        with pytest.raises(QattnError, match=match):
            call(q, k, v, args["cu_q"], args["cu_k"], args["max_q"], args["max_k"])


def test_bad_tensors_and_options_are_named():
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 4, 2, 16, seed=1)
    cases = [
        ((q[None], k, v), {}, QattnError, "q has 4 dimensions"),
        ((q.float(), k, v), {}, QattnError, "q.dtype = torch.float32"),
        ((q, k.half(), v), {}, QattnError, "k.dtype = torch.float16 differs"),
        ((q, k, v[:, :1]), {}, QattnError, "k .* and v .* differ"),
        ((q, k[..., :8], v[..., :8]), {}, QattnError, "differ in head_dim"),
        ((q[:, :3], k, v), {}, QattnError, "heads_q = 3 is not a multiple of heads_kv = 2"),
        ((q, k, v), dict(dropout_p=0.1), QattnUnsupportedError, "no dropout"),
        ((q, k, v), dict(softcap=30.0), QattnUnsupportedError, "soft-capping"),
        ((q, k, v), dict(alibi_slopes=torch.ones(4)), QattnUnsupportedError, "ALiBi"),
        ((q, k, v), dict(window_size=(-2, 0)), QattnError, "window_size"),
        ((q, k, v), dict(causal_alignment="center"), QattnError, "causal_alignment = 'center'"),
        ((q, k, v), dict(softmax_scale=-1.0), QattnError, "softmax_scale = -1.0"),
    ]
    for tensors, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            call(*tensors, cu_q, cu_k, **kwargs)


def test_deterministic_asks_for_the_deterministic_backward():
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 2, 1, 16, seed=1)
    previous = qattn.set_backward_options(deterministic=False)
    try:
        with pytest.raises(QattnError, match="set_backward_options\\(deterministic=True\\)"):
            call(q, k, v, cu_q, cu_k, deterministic=True)
        qattn.set_backward_options(deterministic=True)
        assert call(q, k, v, cu_q, cu_k, deterministic=True).shape == q.shape
    finally:
        qattn.set_backward_options(**previous)


def test_a_larger_max_length_is_an_upper_bound():
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 2, 1, 16, seed=2)
    tight = call(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    loose = call(q, k, v, cu_q, cu_k, 4000, 5000, causal=True)
    assert torch.equal(tight, loose)


# ---- the CPU path: exact FP32 math ---------------------------------------------------------


def check_close(o, lse, ro, rlse):
    assert o.shape == ro.shape and lse.shape == rlse.shape
    err = (o.double() - ro).abs()
    bound = O_REL * ro.abs() + O_ABS
    assert bool((err <= bound).all()), float((err - bound).max())
    inf = torch.isinf(rlse)
    assert torch.equal(torch.isinf(lse), inf)
    assert bool((lse[inf] == -math.inf).all())
    if bool((~inf).any()):
        assert float((lse[~inf].double() - rlse[~inf]).abs().max()) <= LSE_ABS_CPU


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("lengths", range(len(LENGTHS)))
@pytest.mark.parametrize("seed", [0, FRESH_SEED])
def test_cpu_path_matches_fp64_per_sequence(mask, lengths, seed):
    lq, lk = LENGTHS[lengths]
    kwargs = MASKS[mask]
    q, k, v, cu_q, cu_k = pack(lq, lk, 4, 2, 24, seed)  # GQA, d not a multiple of 16
    o, lse, none = call(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **kwargs)
    assert none is None
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (4, sum(lq))  # (Hq, total_q): FlashAttention's varlen layout
    ro, rlse = reference(q, k, v, cu_q, cu_k, **ref_args(kwargs))
    check_close(o, lse, ro, rlse)


def test_empty_sequences():
    q, k, v, cu_q, cu_k = pack([3, 0, 2, 4], [0, 6, 5, 0], 2, 2, 16, seed=3)
    o, lse, _ = call(q, k, v, cu_q, cu_k, 4, 6, return_attn_probs=True, causal=True)
    # Sequence 0 (3 queries, no keys) and 3 (4 queries, no keys): zeros and -inf. Sequence
    # 1 (no queries) adds no row. Sequence 2: 2 queries, 5 keys, bottom-right: both see keys.
    assert torch.equal(o[:3], torch.zeros_like(o[:3])) and torch.equal(o[5:], torch.zeros_like(o[5:]))
    assert bool((lse[:, :3] == -math.inf).all()) and bool((lse[:, 5:] == -math.inf).all())
    assert bool(torch.isfinite(lse[:, 3:5]).all())
    # A batch of empty query sequences: an empty output.
    q0 = q[:0]
    out = call(q0, k, v, offsets([0, 0, 0, 0]), cu_k, 1, 6)
    assert out.shape == (0, 2, 16)


def test_causal_with_more_queries_than_keys_hides_the_first_rows():
    # Bottom-right per sequence: 5 queries over 2 keys, the first 3 rows see no key.
    q, k, v, cu_q, cu_k = pack([5], [2], 1, 1, 16, seed=4)
    o, lse, _ = call(q, k, v, cu_q, cu_k, 5, 2, causal=True, return_attn_probs=True)
    assert bool((lse[0, :3] == -math.inf).all()) and bool(torch.isfinite(lse[0, 3:]).all())
    assert torch.equal(o[:3], torch.zeros_like(o[:3]))
    # Top-left: query i sees keys j <= i, so every row sees key 0.
    _, lse_tl, _ = call(q, k, v, cu_q, cu_k, 5, 2, causal=True, return_attn_probs=True,
                        causal_alignment="top_left")
    assert bool(torch.isfinite(lse_tl).all())


@pytest.mark.parametrize("mask", ["none", "causal", "causal + left 40"])
def test_cpu_gradients_match_fp64_autograd(mask):
    lq, lk = [1, 65, 0, 30, 7], [1, 65, 5, 40, 0]
    kwargs = MASKS[mask]
    q, k, v, cu_q, cu_k = pack(lq, lk, 4, 2, 16, seed=7, grad=True)
    o = call(q, k, v, cu_q, cu_k, 65, 65, **kwargs)
    gen = torch.Generator().manual_seed(8)
    grad_o = torch.randn(o.shape, generator=gen).to(o.dtype)
    gq, gk, gv = torch.autograd.grad(o, (q, k, v), grad_o)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, _ = reference(qd, kd, vd, cu_q, cu_k, **ref_args(kwargs))
    rq, rk, rv = torch.autograd.grad(ro, (qd, kd, vd), grad_o.double())
    for name, a, r in (("dq", gq, rq), ("dk", gk, rk), ("dv", gv, rv)):
        assert bool(torch.isfinite(a).all()), name
        a, r = a.double().flatten(), r.flatten()
        cos = float(a @ r / (a.norm() * r.norm()))
        rel = float((a - r).abs().sum() / r.abs().sum())
        assert cos >= GRAD_COS_MIN and rel <= GRAD_REL_L1_MAX, (name, cos, rel)
    # Rows that see no key (the last sequence: 7 queries, no keys) get zero gradients.
    assert torch.equal(gq[-7:], torch.zeros_like(gq[-7:]))


def test_cpu_follows_the_fallback_mode():
    q, k, v, cu_q, cu_k = pack([4, 3], [5, 4], 2, 1, 16, seed=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", QattnFallbackWarning)
        call(q, k, v, cu_q, cu_k)
        call(q, k, v, cu_q, cu_k)
    mine = [w for w in seen if issubclass(w.category, QattnFallbackWarning)]
    assert len(mine) == 1 and "exact attention in FP32" in str(mine[0].message)
    qattn.set_fallback("raise")
    with pytest.raises(QattnUnsupportedError, match="on the CPU, where qattn has no kernel") as e:
        call(q, k, v, cu_q, cu_k)
    assert e.value.reason == "varlen device cpu"
    # A bad call is named before the mode is consulted.
    with pytest.raises(QattnError, match="max_seqlen_q = 0"):
        call(q, k, v, cu_q, cu_k, 0, 5)


# ---- GPU: the varlen kernel equals qattn's kernel per sequence ---------------------------


@pytest.fixture
def gpu():
    from gpu import require_sm90

    require_sm90()


GPU_LENGTHS = ([1, 300, 0, 129, 64, 1000], [1, 300, 7, 200, 0, 1000])


@pytest.mark.parametrize("mask", list(MASKS))
def test_gpu_equals_one_attention_call_per_sequence(gpu, mask):
    lq, lk = GPU_LENGTHS
    kwargs = MASKS[mask]
    q, k, v, cu_q, cu_k = pack(lq, lk, 8, 2, 128, seed=11, device="cuda")
    with torch.no_grad():
        o, lse, _ = call(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **kwargs)
        t = 0
        tk = 0
        for nq, nk in zip(lq, lk):
            if nq and nk:
                one, one_lse = qattn.attention(
                    q[t:t + nq][None], k[tk:tk + nk][None], v[tk:tk + nk][None],
                    is_causal=kwargs.get("causal", False), layout="NHD", return_lse=True,
                    causal_alignment=kwargs.get("causal_alignment", "bottom_right"),
                    window_size=kwargs.get("window_size", (-1, -1)))
                assert torch.equal(o[t:t + nq], one[0])
                assert torch.equal(lse[:, t:t + nq], one_lse[0])
            t += nq
            tk += nk


@pytest.mark.parametrize("d", [192, 256])
def test_gpu_head_dims_above_128_run_one_call_per_sequence(gpu, d):
    """The varlen kernel runs head dims up to 128: above, the library refuses the packed
    call (QATTN_ERROR_UNSUPPORTED) and each sequence runs as one qattn.attention call on
    the head-dim-256 kernel, with no fallback warning."""
    lq, lk = [1, 300, 0, 129], [1, 300, 7, 200]
    q, k, v, cu_q, cu_k = pack(lq, lk, 4, 2, d, seed=13, device="cuda")
    previous = qattn.set_fallback("raise")
    try:
        with torch.no_grad():
            o, lse, _ = call(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                             return_attn_probs=True)
    finally:
        qattn.set_fallback(previous)
    t = tk = 0
    for nq, nk in zip(lq, lk):
        if nq and nk:
            one, one_lse = qattn.attention(q[t:t + nq][None], k[tk:tk + nk][None],
                                           v[tk:tk + nk][None], is_causal=True, layout="NHD",
                                           return_lse=True, causal_alignment="bottom_right")
            assert torch.equal(o[t:t + nq], one[0])
            assert torch.equal(lse[:, t:t + nq], one_lse[0])
        t += nq
        tk += nk


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("seed", [0, FRESH_SEED])
def test_gpu_within_the_schemes_bounds_of_fp64(gpu, mask, seed):
    lq, lk = GPU_LENGTHS
    kwargs = MASKS[mask]
    q, k, v, cu_q, cu_k = pack(lq, lk, 8, 2, 128, seed=seed, device="cuda")
    with torch.no_grad():
        o, lse, _ = call(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **kwargs)
    ro, rlse = reference(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), **ref_args(kwargs))
    a, r = o.cpu().double().flatten(), ro.flatten()
    assert float(a @ r / (a.norm() * r.norm())) >= MIN_COSSIM
    assert float((a - r).abs().sum() / r.abs().sum()) <= MAX_REL_L1
    inf = torch.isinf(rlse)
    assert torch.equal(torch.isinf(lse.cpu()), inf)
    assert float((lse.cpu()[~inf].double() - rlse[~inf]).abs().max()) <= LSE_ATOL


def test_gpu_training_equals_per_sequence_training(gpu):
    lq, lk = [300, 1, 129], [300, 1, 129]
    previous = qattn.set_backward_options(deterministic=True)
    try:
        q, k, v, cu_q, cu_k = pack(lq, lk, 8, 2, 128, seed=12, device="cuda", grad=True)
        o = call(q, k, v, cu_q, cu_k, 300, 300, causal=True, deterministic=True)
        grad_o = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), grad_o)
        t = 0
        for n in lq:
            qs, ks, vs = (x.detach()[t:t + n][None].requires_grad_() for x in (q, k, v))
            one = qattn.attention(qs, ks, vs, is_causal=True, layout="NHD",
                                  causal_alignment="bottom_right")
            want = torch.autograd.grad(one, (qs, ks, vs), grad_o[t:t + n][None])
            for got, w in zip(grads, want):
                assert torch.equal(got[t:t + n], w[0])
            t += n
    finally:
        qattn.set_backward_options(**previous)


def test_gpu_without_the_host_check_and_compiled_is_the_same(gpu):
    lq, lk = GPU_LENGTHS
    q, k, v, cu_q, cu_k = pack(lq, lk, 8, 2, 128, seed=13, device="cuda")
    with torch.no_grad():
        want, want_lse, _ = call(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                 return_attn_probs=True)
        o, lse, _ = call(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                         return_attn_probs=True, check_offsets=True)
        assert torch.equal(o, want) and torch.equal(lse, want_lse)

        def f(q, k, v, cu_q, cu_k):
            return qattn.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                          check_offsets=False)

        compiled = torch.compile(f, fullgraph=True)
        assert torch.equal(compiled(q, k, v, cu_q, cu_k), want)


def test_gpu_lying_offsets_without_the_check_stay_inside(gpu):
    """By default a bad array is not seen on the host; the kernel clamps it, so the call
    returns (rows unspecified) and the device stays usable; check_offsets=True names it."""
    lq, lk = [100, 200], [150, 50]
    q, k, v, _, _ = pack(lq, lk, 4, 2, 64, seed=14, device="cuda")
    bad_q = torch.tensor([0, 500, -3], dtype=torch.int32, device="cuda")
    bad_k = torch.tensor([9, 0, 1000], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        o = call(q, k, v, bad_q, bad_k, 200, 150)
        torch.cuda.synchronize()
    assert o.shape == q.shape
    with pytest.raises(QattnError, match="cu_seqlens_q"):
        call(q, k, v, bad_q, bad_k, 200, 150, check_offsets=True)


def test_check_offsets_must_be_a_bool():
    q, k, v, cu_q, cu_k = pack([3], [3], 2, 1, 16, seed=0)
    with pytest.raises(QattnError, match="check_offsets = 1"):
        call(q, k, v, cu_q, cu_k, 3, 3, check_offsets=1)
