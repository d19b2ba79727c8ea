"""qattn.KVCache and qattn.decode (docs/kv-cache.md).

CPU (any build, torch on the CPU): the binding's validation of the KV-cache calls with
fake device addresses and real host mirrors, the Python layer's page allocator, host
mirrors and argument checks, and the pure-torch reference (kv_reference.py) itself:
its byte decoders against torch's own float8 dtype, its BF16 path against SDPA in
float64, and the q.c fold of the LSE.

GPU (sm_90, skipped elsewhere with the reason): qattn.decode against the reference on
the cache's own bytes (FP32-rounding bounds) and against SDPA in float64 on the
unquantized K and V (a CosSim bound per format), over formats, GQA ratios, nq 1..16,
causal on and off, page sizes, lengths with partial pages, num_splits 1 and > 1; the
append: one call of n tokens writes the bytes of n calls of one. The bounds and their
derivations are in kv_reference.py.

Seeds: fixed ones, plus a fresh one per run (printed; QATTN_TEST_SEED repeats it).
"""

import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
qattn = pytest.importorskip("qattn")

import kv_reference as ref  # noqa: E402
from gpu import sm90_missing  # noqa: E402
from qattn import _C  # noqa: E402

FRESH_SEED = int(os.environ.get("QATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
print(f"test_kv_cache.py: fresh seed {FRESH_SEED} (QATTN_TEST_SEED={FRESH_SEED} repeats it)")
SEEDS = [0, FRESH_SEED]

_NO_GPU = sm90_missing()
gpu = pytest.mark.skipif(_NO_GPU is not None, reason=_NO_GPU or "")

FMT_CODE = {"nvfp4": _C.KV_NVFP4, "fp8": _C.KV_FP8_E4M3, "int8": _C.KV_INT8, "bf16": _C.KV_BF16}


# ---- the binding, without a device ---------------------------------------------------------


def fake(slot):
    """A fake, never-mapped device address: validation must not read it."""
    return slot << 40


def cache_arg(fmt="nvfp4", hkv=2, d=64, ps=16, pages=8, mpps=4, smooth=_C.KV_SMOOTH_PREFILL_MEAN):
    return (FMT_CODE[fmt] if isinstance(fmt, str) else fmt, hkv, d, ps, pages, mpps, smooth, fake(1))


class Mirrors:
    """Real host block tables and lengths (the library reads them) for 2 sequences."""

    def __init__(self, tables=((0, 1, -1, -1), (2, 3, -1, -1)), lengths=(0, 20)):
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.lengths = torch.tensor(lengths, dtype=torch.int32)

    def seqs(self, k_mean=True):
        return (fake(2), fake(3), fake(4) if k_mean else 0, self.tables.data_ptr(), self.lengths.data_ptr())


def hnd(slot, b, h, n, d):
    return (fake(slot), h * n * d, n * d, d)


def append_call(m, cache=None, n=3, dtype=_C.DTYPE_BF16, preset=0, k_mean=True, hkv=2, d=64):
    cache = cache or cache_arg(hkv=hkv, d=d)
    return _C.kv_append(cache, m.seqs(k_mean), hnd(5, 2, hkv, n, d), hnd(6, 2, hkv, n, d), dtype, 2, n,
                        preset, 0)


def decode_args(m, cache=None, hq=4, nq=2, causal=1, scale=0.0, splits=1, d=64):
    cache = cache or cache_arg(d=d)
    return (cache, m.seqs(), hnd(7, 2, hq, nq, d), hnd(8, 2, hq, nq, d), fake(9), _C.DTYPE_BF16, 2, hq,
            nq, causal, scale, 0, splits)


NOT_LAUNCHED = (_C.ERROR_NO_DEVICE, _C.ERROR_INVALID_ARGUMENT, _C.ERROR_UNSUPPORTED)


def test_page_bytes_are_the_format_pages():
    # docs/kv-cache.md: a page of 16 tokens x 8 heads at d = 128.
    for fmt, want in (("nvfp4", 18432), ("fp8", 33792), ("int8", 33792), ("bf16", 65536)):
        status, nbytes = _C.kv_cache_page_bytes(cache_arg(fmt, hkv=8, d=128, ps=16))
        assert status == _C.OK, _C.last_error_message()
        assert nbytes == want
    rng = random.Random(FRESH_SEED)
    for _ in range(20):
        fmt, hkv, d, ps = rng.choice(ref.FORMATS), rng.randint(1, 9), 16 * rng.randint(1, 16), rng.randint(1, 70)
        status, nbytes = _C.kv_cache_page_bytes(cache_arg(fmt, hkv=hkv, d=d, ps=ps))
        assert status == _C.OK and nbytes == ref.page_layout(fmt, hkv, d, ps)["page_bytes"], (fmt, hkv, d, ps)


@pytest.mark.parametrize("change,words", [
    (dict(d=100), ["head_dim = 100", "multiple of 16"]),
    (dict(d=272), ["head_dim = 272"]),
    (dict(ps=0), ["page_size = 0"]),
    (dict(pages=0), ["num_pages = 0"]),
    (dict(mpps=0), ["max_pages_per_seq = 0"]),
    (dict(fmt=7), ["format = 7"]),
    (dict(smooth=5), ["k_smoothing = 5"]),
])
def test_page_bytes_names_the_bad_field(change, words):
    status, _ = _C.kv_cache_page_bytes(cache_arg(**change))
    message = _C.last_error_message()
    assert status == _C.ERROR_INVALID_ARGUMENT, message
    for w in words:
        assert w in message, message


def test_valid_append_stops_before_the_device():
    m = Mirrors()
    status = append_call(m)
    # No GPU / a CPU build: no device. A GPU: the fake addresses are not device memory.
    assert status in NOT_LAUNCHED, _C.last_error_message()
    assert m.lengths.tolist() == [0, 20], "the host lengths advanced without an append"


@pytest.mark.parametrize("setup,words", [
    (dict(lengths=(0, 62)), ["seqs.host_lengths[1] = 62", "n_new = 3", "capacity 64"]),
    (dict(tables=((0, 1, -1, -1), (2, -1, -1, -1))), ["seqs.host_block_tables[1][1] = -1"]),
    (dict(tables=((9, 1, -1, -1), (2, 3, -1, -1))), ["seqs.host_block_tables[0][0] = 9", "0..7"]),
])
def test_append_checks_the_host_mirrors(setup, words):
    m = Mirrors(**setup)
    status = append_call(m)
    message = _C.last_error_message()
    assert status == _C.ERROR_INVALID_ARGUMENT, message
    for w in words:
        assert w in message, message


def test_append_argument_errors():
    m = Mirrors()
    cases = [
        (dict(dtype=7), "dtype"),
        (dict(n=0), "n_new = 0"),
        (dict(preset=2), "k_mean_preset = 2"),
        (dict(cache=cache_arg(smooth=_C.KV_SMOOTH_NONE)), "seqs.k_mean is set"),
        (dict(cache=cache_arg(smooth=_C.KV_SMOOTH_NONE), k_mean=False, preset=1), "k_mean_preset = 1"),
        (dict(k_mean=False), "seqs.k_mean is NULL"),
    ]
    for kw, word in cases:
        status = append_call(m, **kw)
        message = _C.last_error_message()
        assert status == _C.ERROR_INVALID_ARGUMENT, (kw, message)
        assert word in message, (kw, message)


@pytest.mark.parametrize("change,words", [
    (dict(nq=17), ["nq = 17"]),
    (dict(nq=0), ["nq = 0"]),
    (dict(hq=3), ["heads_q = 3", "heads_kv = 2"]),
    (dict(splits=129), ["num_splits = 129"]),
    (dict(scale=float("nan")), ["sm_scale"]),
    (dict(causal=2), ["causal = 2"]),
])
def test_decode_names_the_bad_parameter(change, words):
    status, _ = _C.kv_decode_workspace_size(*decode_args(Mirrors(), **change))
    message = _C.last_error_message()
    assert status == _C.ERROR_INVALID_ARGUMENT, message
    for w in words:
        assert w in message, message


def test_decode_workspace_is_the_split_partials():
    m = Mirrors()
    status, nbytes = _C.kv_decode_workspace_size(*decode_args(m, splits=1))
    assert status == _C.OK and nbytes == 0, _C.last_error_message()

    def align256(x):
        return (x + 255) // 256 * 256

    b, hq, nq, d, s = 2, 4, 2, 64, 5
    status, nbytes = _C.kv_decode_workspace_size(*decode_args(m, splits=s))
    rows = b * hq * nq * s
    # Per chunk and row: the partial O (FP32) and its LSE; per row: q·c for the merge.
    expected = align256(rows * d * 4) + align256(rows * 4) + align256(b * hq * nq * 4)
    assert status == _C.OK and nbytes == expected
    # Too small a workspace is refused before any device is touched.
    status = _C.kv_decode(*decode_args(m, splits=s), fake(10), nbytes - 1, 0)
    assert status == _C.ERROR_WORKSPACE_TOO_SMALL, _C.last_error_message()
    assert str(nbytes) in _C.last_error_message()
    status = _C.kv_decode(*decode_args(m, splits=s), fake(10), nbytes, 0)
    assert status in NOT_LAUNCHED, _C.last_error_message()


# ---- the Python layer on a host cache --------------------------------------------------------


def host_cache(**kw):
    opts = dict(num_pages=16, page_size=16, heads_kv=2, head_dim=64, max_seqs=4, max_pages_per_seq=6,
                format="int8", device="cpu")
    opts.update(kw)
    return qattn.KVCache(**opts)


@pytest.mark.parametrize("fmt,per_head", [("nvfp4", 72), ("fp8", 132), ("int8", 132), ("bf16", 256)])
def test_bytes_per_token_and_page_bytes(fmt, per_head):
    c = host_cache(format=fmt, heads_kv=8, head_dim=128)
    assert c.bytes_per_token == 2 * 8 * per_head  # docs/kv-cache.md, Bytes per token
    assert c.page_bytes == ref.page_layout(fmt, 8, 128, 16)["page_bytes"]
    assert c.pages.numel() == 16 * c.page_bytes and c.pages.dtype == torch.uint8
    assert c.format == fmt and c.capacity == 6 * 16
    assert c.block_tables.shape == (4, 6) and (c.block_tables == -1).all()
    assert c.k_mean.shape == (4, 8, 128) and c.k_mean.dtype == torch.float32


def test_allocator_hands_out_free_pages_in_order():
    c = host_cache()
    assert c.allocate(1, 20) == [0, 1]  # 20 tokens: 2 pages of 16
    assert c.allocate(0, 16) == [2]
    assert c.allocate(1, 0) == []
    c._host_lengths[1] = 20  # as an append of 20 tokens leaves it
    assert c.allocate(1, 12) == []  # 32 tokens still fit in 2 pages
    assert c.allocate(1, 13) == [3]
    assert c.host_block_tables[1].tolist() == [0, 1, 3, -1, -1, -1]
    assert torch.equal(c.block_tables, c.host_block_tables)
    assert c.num_free_pages == 12
    c.reset(1)
    assert c.lengths[1] == 0 and (c.host_block_tables[1] == -1).all() and (c.block_tables[1] == -1).all()
    assert c.num_free_pages == 15
    assert c.allocate(2, 40) == [0, 1, 3]  # the freed pages, lowest first


def test_shared_pages_stay_in_use_until_the_last_row_lets_go():
    c = host_cache()
    c.assign_pages(0, [5, 6])
    c.assign_pages(1, [5])  # prefix sharing
    c.reset(0)
    assert c.num_free_pages == 15  # page 5 is still in row 1
    assert 5 not in c.allocate(2, 16 * 6)  # 6 pages, none of them 5


def test_allocator_errors():
    c = host_cache(num_pages=4)
    with pytest.raises(qattn.QattnError, match="capacity 96"):
        c.allocate(0, 97)
    c.allocate(0, 64)
    with pytest.raises(qattn.QattnError, match="needs 1 more pages but the pool has 0 free"):
        c.allocate(1, 1)
    with pytest.raises(qattn.QattnError, match="seq = 4"):
        c.allocate(4, 1)
    with pytest.raises(qattn.QattnError, match=r"pages\[1\] = 4"):
        c.assign_pages(1, [0, 4])
    with pytest.raises(qattn.QattnError, match="max_pages_per_seq = 6"):
        c.assign_pages(1, [0] * 7)


def test_contiguous_layout():
    c = qattn.KVCache.contiguous(3, 100, heads_kv=2, head_dim=32, format="bf16", device="cpu")
    assert (c.page_size, c.num_pages, c.max_pages_per_seq, c.capacity) == (100, 3, 1, 100)
    assert c.host_block_tables.flatten().tolist() == [0, 1, 2]
    assert torch.equal(c.block_tables, c.host_block_tables)
    assert c.num_free_pages == 0
    c.reset(1)
    assert c.host_block_tables.flatten().tolist() == [0, 1, 2]
    with pytest.raises(qattn.QattnError, match="contiguous"):
        c.assign_pages(0, [1])


def test_construction_errors():
    with pytest.raises(qattn.QattnError, match="format = 'fp4'"):
        host_cache(format="fp4")
    with pytest.raises(qattn.QattnError, match="head_dim = 72"):  # the library's own check
        host_cache(head_dim=72)
    with pytest.raises(qattn.QattnError, match="max_seqs = 0"):
        host_cache(max_seqs=0)
    with pytest.raises(qattn.QattnError, match="device"):
        host_cache(device="meta")


def test_k_smoothing_rules():
    c = host_cache()
    cvec = torch.randn(2, 64)
    c.set_k_smoothing(0, cvec)
    assert torch.equal(c.k_mean[0], cvec)
    with pytest.raises(qattn.QattnError, match=r"\(2, 64\)"):
        c.set_k_smoothing(0, torch.randn(64))
    c._host_lengths[1] = 3
    with pytest.raises(qattn.QattnError, match="already holds 3 tokens"):
        c.set_k_smoothing(1, cvec)
    c.reset(0)
    assert (c.k_mean[0] == 0).all()
    with pytest.raises(qattn.QattnError, match="smoothing=False"):
        host_cache(smoothing=False).set_k_smoothing(0, cvec)


def test_truncate_and_seqs_forms():
    c = host_cache()
    c._host_lengths[2] = 40
    c.device_lengths[2] = 40
    c.truncate(2, 33)  # speculative decoding rejected 7 draft tokens
    assert c.lengths[2] == 33 and c.device_lengths[2] == 33
    with pytest.raises(qattn.QattnError, match="length = 34"):
        c.truncate(2, 34)
    assert c._resolve_seqs("f", range(1, 3), 2, True) == [1, 2]
    assert c._resolve_seqs("f", torch.tensor([3, 0]), 2, True) == [3, 0]
    assert c._resolve_seqs("f", 2, 1, True) == [2]
    with pytest.raises(qattn.QattnError, match="1-D integers"):
        c._resolve_seqs("f", torch.tensor([1.0]), 1, True)
    with pytest.raises(qattn.QattnError, match="batch 5 > max_seqs = 4"):
        c._resolve_seqs("f", None, 5, True)


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_append_and_decode_check_their_arguments():
    c = host_cache()
    k = bf16(2, 2, 3, 64)
    with pytest.raises(qattn.QattnError, match=r"\(B >= 1, heads_kv = 2"):
        c.append(bf16(2, 3, 3, 64), bf16(2, 3, 3, 64))
    with pytest.raises(qattn.QattnError, match="differ"):
        c.append(k, bf16(2, 2, 4, 64))
    with pytest.raises(qattn.QattnError, match="dtype"):
        c.append(k.float(), k.float())
    with pytest.raises(qattn.QattnError, match="names a sequence twice"):
        c.append(k, k, seqs=[1, 1])
    with pytest.raises(qattn.QattnError, match="3 seqs for a batch of 2"):
        c.append(k, k, seqs=[0, 1, 2])
    with pytest.raises(qattn.QattnError, match="no page for its tokens 0..15"):
        c.append(k, k)
    c.allocate(0, 3)
    c.allocate(1, 3)
    with pytest.raises(qattn.QattnError, match="the cache is on cpu"):
        c.append(k, k)
    with pytest.raises(qattn.QattnError, match="exceeds its capacity 96"):
        c.append(bf16(1, 2, 97, 64), bf16(1, 2, 97, 64))
    q = bf16(2, 4, 1, 64)
    for bad, word in ((bf16(2, 3, 1, 64), "multiple of heads_kv = 2"), (bf16(2, 4, 17, 64), "nq = 17"),
                      (bf16(2, 4, 1, 32), "head dim 32")):
        with pytest.raises(qattn.QattnError, match=word):
            qattn.decode(bad, c)
    with pytest.raises(qattn.QattnError, match="sm_scale"):
        qattn.decode(q, c, sm_scale=-1.0)
    with pytest.raises(qattn.QattnError, match="num_splits"):
        qattn.decode(q, c, num_splits=129)
    with pytest.raises(qattn.QattnError, match="seq = 9"):
        qattn.decode(q, c, seqs=[0, 9])
    with pytest.raises(qattn.QattnError, match="the cache is on cpu"):
        qattn.decode(q, c, seqs=[1, 1])  # repeats are fine for a decode


# ---- the reference itself ------------------------------------------------------------------------


def test_e4m3_decoder_matches_torch_float8():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    mine = ref.e4m3_decode(codes)
    theirs = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(torch.isnan(mine), torch.isnan(theirs))
    assert torch.isnan(mine).sum() == 2  # 0x7F and 0xFF
    ok = ~torch.isnan(mine)
    assert torch.equal(mine[ok], theirs[ok]) and mine.abs()[ok].max() == 448


def test_e2m1_decoder():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    got = ref.e2m1_decode(torch.arange(16, dtype=torch.int32).to(torch.uint8)).tolist()
    assert got == want + [-x for x in want]


def test_byte_decoders_round_trip():
    x = torch.randn(1000) * torch.exp(torch.randn(1000) * 10)
    raw = x.view(torch.uint8).reshape(1000, 4)  # little endian on every platform torch runs on
    assert torch.equal(ref.f32_from_le(raw), x)
    xb = x.to(torch.bfloat16)
    assert torch.equal(ref.bf16_from_le(xb.view(torch.uint8).reshape(1, 2000)), xb.float().reshape(1, 1000))


def filled_host_cache(fmt, lens, hkv, d, ps, seed, smoothing=True, bias=0.0):
    g = torch.Generator().manual_seed(seed)
    c = qattn.KVCache(num_pages=sum(-(-n // ps) for n in lens) + 2, page_size=ps, heads_kv=hkv, head_dim=d,
                      max_seqs=len(lens), max_pages_per_seq=max(-(-n // ps) for n in lens) + 1, format=fmt,
                      smoothing=smoothing, device="cpu")
    ks, vs = [], []
    for s, n in enumerate(lens):
        k = torch.randn(hkv, n, d, generator=g) + bias * torch.randn(hkv, 1, d, generator=g)
        k, v = k.to(torch.bfloat16), torch.randn(hkv, n, d, generator=g).to(torch.bfloat16)
        c.allocate(s, n)
        if n:  # two appends, so that the second starts inside a page
            ref.write_tokens(c, s, k[:, : n // 2 + 1], v[:, : n // 2 + 1])
            if n // 2 + 1 < n:
                ref.write_tokens(c, s, k[:, n // 2 + 1:], v[:, n // 2 + 1:])
        ks.append(k)
        vs.append(v)
    return c, ks, vs, g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_reference_is_sdpa(seed, causal):
    # A BF16 cache without smoothing holds K and V exactly (they are bf16 already), so the
    # reference over its bytes is SDPA in float64 on them, to float64 rounding.
    c, ks, vs, g = filled_host_cache("bf16", [1, 37, 80], hkv=2, d=32, ps=16, seed=seed, smoothing=False)
    q = torch.randn(3, 6, 5, 32, generator=g).to(torch.bfloat16)
    o, lse = ref.decode_reference(q, c, causal=causal)
    o2, lse2 = ref.sdpa_reference(q, ks, vs, causal=causal)
    assert (o - o2).abs().max() < 1e-12
    finite = torch.isfinite(lse2)
    assert torch.equal(torch.isfinite(lse), finite)  # causal: rows of sequence 0 past its 1 key
    assert (lse - lse2)[finite].abs().max() < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
def test_reference_folds_q_dot_c_into_the_lse(seed):
    # With smoothing the cache holds K - c. Scores against K - c are those against
    # (K - c) + c shifted by the row constant sm_scale * q.c, which softmax drops and
    # the LSE gets back: the reference equals SDPA on k_hat + c in O and in the LSE.
    c, _, _, g = filled_host_cache("int8", [50, 3], hkv=2, d=64, ps=7, seed=seed, bias=4.0)
    q = torch.randn(2, 4, 3, 64, generator=g).to(torch.bfloat16)
    o, lse = ref.decode_reference(q, c, sm_scale=0.2)
    assert (c.k_mean.abs().amax(-1) > 1).all()  # the bias is in c
    ks, vs = [], []
    for s in range(2):
        k_hat, v_hat, cvec = ref.dequantize(c, s)
        ks.append(k_hat.double() + cvec.double()[:, None, :])
        vs.append(v_hat)
    o2, lse2 = ref.sdpa_reference(q.to(torch.bfloat16), ks, vs, sm_scale=0.2)
    assert (o - o2).abs().max() < 1e-10
    assert (lse - lse2).abs().max() < 1e-10


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_reference_reads_what_the_format_page_describes(fmt):
    # write_tokens (a torch quantizer) and dequantize share only the offsets, which
    # test_page_bytes_are_the_format_pages ties to the library; the round trip bounds
    # each format's element error: INT8 half a step (amax/254), FP8 2^-4 relative (half
    # of 3 mantissa bits) plus the subnormal step, NVFP4 the scale s (half of E2M1's
    # widest step 2) plus amax/16 (E4M3(amax/6) may round the scale down 2^-4, so the
    # largest element saturates at 6s), BF16 2^-8 relative; the 8-bit formats also
    # round x * (scale range / amax) and code * s in FP32: 2^-23 |x| more.
    c, ks, vs, _ = filled_host_cache(fmt, [33, 5], hkv=2, d=64, ps=8, seed=FRESH_SEED)
    for s in range(2):
        k_hat, v_hat, cvec = ref.dequantize(c, s)
        for x, x_hat in ((ks[s].float() - cvec[:, None, :], k_hat), (vs[s].float(), v_hat)):
            err = (x - x_hat).abs()
            if fmt == "int8":
                bound = x.abs().amax(-1, keepdim=True) / 254 + x.abs() * 2.0**-23
            elif fmt == "fp8":
                amax = x.abs().amax(-1, keepdim=True)
                bound = x.abs() * (2.0**-4 + 2.0**-23) + amax / 448 * 2.0**-9
            elif fmt == "nvfp4":
                blocks = x.reshape(*x.shape[:-1], -1, 16).abs().amax(-1, keepdim=True)
                s_hat = ref.e4m3_decode(ref._e4m3_encode(blocks / 6))
                bound = (s_hat + blocks / 16).expand(*blocks.shape[:-1], 16).reshape(x.shape) * (1 + 1e-6)
            else:
                bound = x.abs() * 2.0**-8
            assert (err <= bound).all(), f"{fmt}: {(err - bound).max().item()}"


# ---- on the GPU --------------------------------------------------------------------------------

DEV = "cuda"


def gpu_inputs(lens, hkv, d, seed, dtype=torch.bfloat16, bias=0.0):
    """Per sequence: K, V (1, hkv, L, d) Gaussian (K with a per-channel bias of `bias`
    standard deviations)."""
    print(f"inputs lens {lens} hkv {hkv} d {d} seed {seed}")  # shown by pytest on failure
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for n in lens:
        k = torch.randn(1, hkv, n, d, generator=g, device=DEV)
        k = k + bias * torch.randn(1, hkv, 1, d, generator=g, device=DEV)
        out.append((k.to(dtype), torch.randn(1, hkv, n, d, generator=g, device=DEV).to(dtype)))
    return out, g


def gpu_cache(fmt, lens, hkv, d, ps, smoothing=True, extra_seqs=0):
    pages = sum(-(-n // ps) for n in lens) + 1
    return qattn.KVCache(num_pages=pages, page_size=ps, heads_kv=hkv, head_dim=d, max_seqs=len(lens) + extra_seqs,
                         max_pages_per_seq=max(1, max(-(-n // ps) for n in lens)), format=fmt,
                         smoothing=smoothing, device=DEV)


def fill(cache, kv, prefill_frac=0.75):
    """Each sequence: a prefill of most of its tokens (one append, it fixes c), then the
    rest as single-token appends of a batch of all sequences still growing."""
    lens = [k.shape[2] for k, _ in kv]
    pre = [max(1, int(n * prefill_frac)) if n else 0 for n in lens]
    for s, ((k, v), p) in enumerate(zip(kv, pre)):
        if p:
            cache.allocate(s, p)
            cache.append(k[:, :, :p], v[:, :, :p], seqs=[s])
    for t in range(max(lens)):
        grow = [s for s in range(len(lens)) if pre[s] <= t < lens[s]]
        if not grow:
            continue
        for s in grow:
            cache.allocate(s, 1)
        cache.append(torch.cat([kv[s][0][:, :, t:t + 1] for s in grow]),
                     torch.cat([kv[s][1][:, :, t:t + 1] for s in grow]), seqs=grow)


def check_decode(fmt, lens, hq, hkv, nq, d=128, ps=16, causal=True, splits=(1, 3), seed=0,
                 dtype=torch.bfloat16, sm_scale=None, bias=0.0, cos_bound=True):
    kv, g = gpu_inputs(lens, hkv, d, seed, dtype, bias)
    cache = gpu_cache(fmt, lens, hkv, d, ps)
    fill(cache, kv)
    assert cache.lengths.tolist() == lens
    assert torch.equal(cache.device_lengths.cpu(), cache.lengths)
    q = torch.randn(len(lens), hq, nq, d, generator=g, device=DEV).to(dtype)
    o_ref, lse_ref = ref.decode_reference(q, cache, causal=causal, sm_scale=sm_scale)
    v_max = max(ref.dequantize(cache, s)[1].abs().max().item() for s in range(len(lens)) if lens[s])
    outs = {}
    for s in splits:
        o, lse = qattn.decode(q, cache, causal=causal, sm_scale=sm_scale, num_splits=s, return_lse=True)
        assert o.shape == q.shape and o.dtype == dtype and lse.shape == q.shape[:3]
        ref.assert_matches_reference(o, lse, o_ref, lse_ref, v_max, f"{fmt} num_splits={s}")
        outs[s] = o
    if cos_bound:
        sd, _ = ref.sdpa_reference(q, [k[0] for k, _ in kv], [v[0] for _, v in kv], causal=causal,
                                   sm_scale=sm_scale)
        for s, o in outs.items():
            cs = ref.cossim(o, sd)
            assert cs >= ref.MIN_COSSIM[fmt], f"{fmt} num_splits={s}: CosSim {cs:.6f} < {ref.MIN_COSSIM[fmt]}"
    return cache, q


CASES = [
    # lens, hq, hkv, nq, page size, causal
    ([300, 37], 8, 2, 1, 16, True),             # GQA 4, a partial last page
    ([129, 64, 1], 8, 8, 4, 16, True),          # MHA; a one-token sequence: rows that see no key
    ([1000], 32, 8, 16, 64, True),              # nq = 16 (speculative), big pages
    ([50, 20], 4, 1, 3, 7, False),              # MQA, odd page size, no mask
    ([777, 2, 300, 45], 16, 4, 2, 1, True),     # one token per page
    ([2048], 8, 1, 1, 16, True),                # long enough for a chosen split
]


def case_id(c):
    return f"L{'-'.join(map(str, c[0]))}_h{c[1]}x{c[2]}_nq{c[3]}_p{c[4]}_c{int(c[5])}"


@gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_decode_matches_reference(fmt, case, seed):
    lens, hq, hkv, nq, ps, causal = case
    check_decode(fmt, lens, hq, hkv, nq, ps=ps, causal=causal, splits=(1, 4, 0), seed=seed)


@gpu
@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_decode_fp16_and_head_dims(fmt):
    check_decode(fmt, [200, 17], 8, 2, 2, d=64, dtype=torch.float16, seed=FRESH_SEED)
    check_decode(fmt, [90], 4, 4, 1, d=256, ps=32, sm_scale=0.05, seed=FRESH_SEED + 1)


@gpu
@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_decode_smoothing_on_biased_keys(fmt):
    # K with an 8-sigma channel bias: c holds it, the scores see K - c, and the LSE gets
    # sm_scale * q.c back (checked against the reference, which adds it in float64).
    cache, _ = check_decode(fmt, [400, 60], 8, 2, 4, seed=FRESH_SEED, bias=8.0, cos_bound=False)
    assert (cache.k_mean[:2].abs().amax(-1) > 2).all()


@gpu
def test_many_splits_agree_with_one():
    check_decode("nvfp4", [5000], 8, 8, 1, splits=(1, 2, 7, 64, 128), seed=FRESH_SEED)


@gpu
def test_empty_sequence_gives_zero_and_minus_inf():
    kv, g = gpu_inputs([40], 2, 128, 0)
    cache = gpu_cache("fp8", [40], 2, 128, 16, extra_seqs=1)
    fill(cache, kv)
    q = torch.randn(2, 4, 1, 128, generator=g, device=DEV).to(torch.bfloat16)
    o, lse = qattn.decode(q, cache, seqs=[1, 0], return_lse=True)
    assert (o[0] == 0).all() and (lse[0] == -math.inf).all()
    assert torch.isfinite(lse[1]).all()


def token_bytes(cache, seq):
    return {k: v.cpu() for k, v in ref.row_bytes_of(cache, seq).items()}


@gpu
@pytest.mark.parametrize("smoothing", ["prefill", "preset", "none"])
@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_append_of_n_tokens_equals_n_appends_of_one(fmt, smoothing):
    # Sequences 0 and 1 get the same tokens: 0 as a prefill of 19 then 21 in one call, 1
    # as the same prefill then 21 single-token calls (page size 8: the calls cross
    # pages). With "preset" c comes from set_k_smoothing and the first append is one
    # token. Every byte of every row, the lengths and c must agree.
    hkv, d, n_pre, n = 4, 128, 19, 21
    (kv,), g = gpu_inputs([n_pre + n], hkv, d, FRESH_SEED)
    k, v = kv
    cache = qattn.KVCache(num_pages=16, page_size=8, heads_kv=hkv, head_dim=d, max_seqs=2, max_pages_per_seq=8,
                          format=fmt, smoothing=smoothing != "none", device=DEV)
    for s in range(2):
        cache.allocate(s, n_pre + n)
    if smoothing == "preset":
        c = torch.randn(hkv, d, generator=g, device=DEV)
        for s in range(2):
            cache.set_k_smoothing(s, c)
        for t in range(n_pre):  # one token at a time from the first
            cache.append(torch.cat([k[:, :, t:t + 1]] * 2), torch.cat([v[:, :, t:t + 1]] * 2))
        assert torch.equal(cache.k_mean[0], c) and torch.equal(cache.k_mean[1], c)
    else:
        cache.append(torch.cat([k[:, :, :n_pre]] * 2), torch.cat([v[:, :, :n_pre]] * 2))
    cache.append(k[:, :, n_pre:], v[:, :, n_pre:], seqs=[0])
    for t in range(n_pre, n_pre + n):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1], seqs=[1])
    assert cache.lengths.tolist() == [n_pre + n] * 2
    assert cache.device_lengths.tolist() == [n_pre + n] * 2
    assert torch.equal(cache.k_mean[0], cache.k_mean[1])
    if smoothing == "none":
        assert (cache.k_mean == 0).all()
    a, b = token_bytes(cache, 0), token_bytes(cache, 1)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{fmt} {smoothing}: {key} differ"


@gpu
def test_gathered_sequences_scatter_back():
    # seqs that are not a run 0..B-1: the per-call arrays are gathered copies, and the
    # lengths and c go back to the cache's own rows.
    kv, g = gpu_inputs([30, 30, 30, 30], 2, 64, FRESH_SEED)
    cache = gpu_cache("int8", [30] * 4, 2, 64, 16)
    for s in (3, 1):
        cache.allocate(s, 30)
    cache.append(torch.cat([kv[3][0], kv[1][0]]), torch.cat([kv[3][1], kv[1][1]]), seqs=[3, 1])
    assert cache.lengths.tolist() == [0, 30, 0, 30]
    assert cache.device_lengths.tolist() == [0, 30, 0, 30]
    assert (cache.k_mean[[0, 2]] == 0).all() and (cache.k_mean[[1, 3]] != 0).any()
    torch.testing.assert_close(cache.k_mean[3], kv[3][0][0].float().mean(1), rtol=0, atol=1e-5)
    q = torch.randn(3, 4, 1, 64, generator=g, device=DEV).to(torch.bfloat16)
    o, lse = qattn.decode(q, cache, seqs=[1, 3, 1], return_lse=True)
    o_ref, lse_ref = ref.decode_reference(q, cache, seqs=[1, 3, 1])
    v_max = max(ref.dequantize(cache, s)[1].abs().max().item() for s in (1, 3))
    ref.assert_matches_reference(o, lse, o_ref, lse_ref, v_max, "gathered")


@gpu
def test_append_and_decode_do_not_synchronize():
    # PyTorch's sync debug mode raises on any synchronizing torch call; the library's own
    # CUDA calls are checked by the C++ test gpu_test_no_host_sync.
    kv, g = gpu_inputs([64, 64, 64], 2, 128, 0)
    cache = gpu_cache("nvfp4", [64] * 3, 2, 128, 16)
    for s in range(3):
        cache.allocate(s, 64)
    q = torch.randn(2, 8, 1, 128, generator=g, device=DEV).to(torch.bfloat16)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.append(torch.cat([kv[0][0], kv[1][0]]), torch.cat([kv[0][1], kv[1][1]]))
        cache.append(kv[2][0], kv[2][1], seqs=[2])
        qattn.decode(q, cache, num_splits=2)
        qattn.decode(q, cache, seqs=[2, 0])
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@gpu
def test_decode_in_a_cuda_graph():
    kv, g = gpu_inputs([500, 300], 2, 128, 0)
    cache = gpu_cache("fp8", [500, 300], 2, 128, 16)
    fill(cache, kv)
    q = torch.randn(2, 8, 1, 128, generator=g, device=DEV).to(torch.bfloat16)
    eager = qattn.decode(q, cache, num_splits=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qattn.decode(q, cache, num_splits=3)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = qattn.decode(q, cache, num_splits=3)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
