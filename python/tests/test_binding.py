"""The binding qattn._C without a GPU and without torch: validation through raw
integers (fake, never-mapped addresses), status codes and messages."""

import pytest

qattn = pytest.importorskip("qattn")
from qattn import _C  # noqa: E402


def fake_tensor(slot, b, h, n, d):
    """(pointer, stride_b, stride_h, stride_n) of a contiguous HND tensor at a fake,
    never-mapped address: validation must not read it."""
    return (slot << 40, h * n * d, n * d, d)


def args(b=2, hq=8, hkv=2, nq=300, nkv=500, d=64, causal=0, scale=0.0, gran=0):
    return (
        fake_tensor(1, b, hq, nq, d),
        fake_tensor(2, b, hkv, nkv, d),
        fake_tensor(3, b, hkv, nkv, d),
        fake_tensor(4, b, hq, nq, d),
        5 << 40,
        _C.DTYPE_BF16,
        (b, hq, hkv, nq, nkv, d),
        causal,
        scale,
        gran,
    )


# ---- the binding ---------------------------------------------------------------------


def test_workspace_size_of_valid_params():
    status, nbytes = _C.workspace_size(*args())
    assert status == _C.OK, _C.last_error_message()
    assert nbytes > 0 and nbytes % 256 == 0


@pytest.mark.parametrize(
    "change,status,words",
    [
        (dict(hkv=3), _C.ERROR_INVALID_ARGUMENT, ["heads_q = 8", "heads_kv = 3"]),
        (dict(d=264), _C.ERROR_UNSUPPORTED, ["head_dim = 264", "1..128", "sage2_wide_sm90",
                                             "129..256"]),
        (dict(causal=2), _C.ERROR_INVALID_ARGUMENT, ["causal = 2"]),
        (dict(scale=float("nan")), _C.ERROR_INVALID_ARGUMENT, ["sm_scale"]),
        (dict(gran=5), _C.ERROR_INVALID_ARGUMENT, ["granularity = 5"]),
        (dict(b=0), _C.ERROR_INVALID_ARGUMENT, ["batch = 0"]),
    ],
)
def test_binding_reports_the_parameter(change, status, words):
    got, _ = _C.workspace_size(*args(**change))
    message = _C.last_error_message()
    assert got == status, message
    for w in words:
        assert w in message, message


def test_forward_stops_before_the_device_without_a_usable_gpu():
    a = args()
    status, nbytes = _C.workspace_size(*a)
    status = _C.forward(*a, 6 << 40, nbytes, 0, False)
    message = _C.last_error_message()
    # No GPU / CPU-only build: no device. A GPU machine: the fake addresses are not
    # device memory. Either way nothing was launched.
    assert status in (_C.ERROR_NO_DEVICE, _C.ERROR_INVALID_ARGUMENT, _C.ERROR_UNSUPPORTED), message
    status = _C.forward(*a, 6 << 40, nbytes - 1, 0, False)
    assert status == _C.ERROR_WORKSPACE_TOO_SMALL
    assert str(nbytes) in _C.last_error_message()


# ---- the masks beyond causal: (kv_lengths, window_left, window_right, alignment,
# attn_mask, attn_mask_stride_b, attn_mask_stride_h, attn_mask_stride_q, attn_mask_stride_k,
# attn_mask_type)


NO_ATTN_MASK = (0, 0, 0, 0, 0, 0)
NO_MASK = (0, -1, -1, 0) + NO_ATTN_MASK


def m(kv_lengths, left, right, alignment):
    """A mask tuple without an attn_mask."""
    return (kv_lengths, left, right, alignment) + NO_ATTN_MASK


def bool_mask(ptr=7 << 40, sb=0, sh=0, sq=500, sk=1):
    """A mask tuple with only an attn_mask (strides in bytes; default a (Nq, Nkv) mask of
    args()'s 300 x 500, broadcast over batch and heads)."""
    return (0, -1, -1, 0, ptr, sb, sh, sq, sk, _C.MASK_BOOL)


def test_mask_defaults_to_none_and_constants():
    assert (_C.ALIGN_BOTTOM_RIGHT, _C.ALIGN_TOP_LEFT) == (0, 1)
    plain = _C.workspace_size(*args())
    assert _C.workspace_size(*args(), NO_MASK) == plain
    assert _C.workspace_size(*args(), mask=NO_MASK) == plain


@pytest.mark.parametrize(
    "mask",
    [m(7 << 40, -1, -1, 0), m(0, 64, 0, 1), m(0, 0, 0, 0), m(0, -1, 5, 1), m(7 << 40, 100, 100, 1),
     m(0, 2**31 - 1, -1, 0)],
)
def test_valid_masks(mask):
    for causal in (0, 1):
        status, nbytes = _C.workspace_size(*args(causal=causal), mask)
        assert status == _C.OK, _C.last_error_message()
        assert nbytes == _C.workspace_size(*args(causal=causal))[1]  # the masks need no workspace


@pytest.mark.parametrize(
    "mask,words",
    [
        (m(0, -2, -1, 0), ["window_left = -2", "-1 (no bound", "number of keys >= 0"]),
        (m(0, -1, -7, 0), ["window_right = -7"]),
        (m(0, -1, -1, 2), ["alignment = 2", "QATTN_ALIGN_BOTTOM_RIGHT (0)", "QATTN_ALIGN_TOP_LEFT (1)"]),
        (m(0, -1, -1, -1), ["alignment = -1"]),
        (m((7 << 40) + 2, -1, -1, 0), ["kv_lengths", "4-byte aligned", "(batch,) int32"]),
        (m(4 << 40, -1, -1, 0), ["o overlaps kv_lengths"]),  # o's first bytes
        (m(5 << 40, -1, -1, 0), ["lse overlaps kv_lengths"]),
        (bool_mask(sb=-1), ["attn_mask_stride_b = -1", ">= 0"]),
        (bool_mask(sk=-3), ["attn_mask_stride_k = -3"]),
        (bool_mask(ptr=4 << 40), ["o overlaps attn_mask"]),
    ],
)
def test_binding_reports_the_mask_parameter(mask, words):
    got, _ = _C.workspace_size(*args(), mask)
    message = _C.last_error_message()
    assert got == _C.ERROR_INVALID_ARGUMENT, message
    for w in words:
        assert w in message, message


def test_kv_lengths_may_share_an_input_but_not_the_workspace():
    mask = m(1 << 40, -1, -1, 0)  # inside q: inputs are only read
    status, nbytes = _C.workspace_size(*args(), mask)
    assert status == _C.OK, _C.last_error_message()
    status = _C.forward(*args(), 7 << 40, nbytes, 0, False, m(7 << 40, -1, -1, 0))
    assert status == _C.ERROR_INVALID_ARGUMENT
    assert "workspace overlaps kv_lengths" in _C.last_error_message()


@pytest.mark.parametrize("mask", [
    bool_mask(),  # (Nq, Nkv), broadcast over batch and heads
    bool_mask(sb=0, sh=0, sq=0, sk=1),  # one row for every query: (Nkv,)
    bool_mask(sb=8 * 300 * 500, sh=300 * 500),  # (B, Hq, Nq, Nkv), contiguous
    bool_mask(sq=1, sk=300),  # transposed
    bool_mask(ptr=(7 << 40) + 3),  # any alignment
    bool_mask(ptr=1 << 40),  # inside q: inputs are only read
])
def test_valid_attn_masks(mask):
    status, nbytes = _C.workspace_size(*args(), mask)
    assert status == _C.OK, _C.last_error_message()
    assert nbytes > 0


@pytest.mark.parametrize("causal,mask,what", [
    (1, bool_mask(), "head_dim 64, causal,"),  # the call, as the message describes it
    (0, bool_mask()[:1] + (64, -1, 0) + bool_mask()[4:], "window (64, -1)"),
    (0, (7 << 40,) + bool_mask(ptr=8 << 40)[1:], "key padding"),
])
def test_attn_mask_alone_is_the_librarys_rule(causal, mask, what):
    status, _ = _C.workspace_size(*args(causal=causal), mask)
    message = _C.last_error_message()
    assert status == _C.ERROR_UNSUPPORTED, message
    assert "takes an attn_mask alone" in message and what in message, message


# ---- P's row maxima (forward) and the backward's scales --------------------------------


VARLEN = (10 << 40, 11 << 40, 150, 250)  # a packed batch of 2: (cu_q, cu_k, max_q, max_k)
P_MAX = 9 << 40


def test_forward_p_max_defaults_to_none_and_is_validated():
    plain = _C.workspace_size(*args())
    assert _C.workspace_size(*args(), p_max=0) == plain
    status, nbytes = _C.workspace_size(*args(), p_max=P_MAX)
    assert status == _C.OK, _C.last_error_message()
    assert nbytes == plain[1]  # written by the kernel, no workspace of its own
    for ptr, words in [
        (P_MAX + 2, ["p_max = ", "is not 4-byte aligned", "(B, Hq, Nq) float array"]),
        (4 << 40, ["p_max overlaps o"]),
        (5 << 40, ["p_max overlaps lse"]),
        (1 << 40, ["p_max overlaps q"]),
    ]:
        status, _ = _C.workspace_size(*args(), p_max=ptr)
        message = _C.last_error_message()
        assert status == _C.ERROR_INVALID_ARGUMENT, message
        for w in words:
            assert w in message, message
    # The call: the same checks, then the device (none usable here, or fake addresses).
    status = _C.forward(*args(), 6 << 40, nbytes, 0, False, p_max=P_MAX + 2)
    assert status == _C.ERROR_INVALID_ARGUMENT and "qattn_fwd: p_max" in _C.last_error_message()
    status = _C.forward(*args(), 6 << 40, nbytes, 0, False, p_max=P_MAX)
    assert status in (_C.ERROR_NO_DEVICE, _C.ERROR_INVALID_ARGUMENT), _C.last_error_message()


@pytest.mark.parametrize("scheme,varlen,d,words", [
    (_C.SCHEME_PRECISE16, (0, 0, 0, 0), 64, ["precise16_fwd_sm90: does not write P's row maxima (p_max)"]),
    (_C.SCHEME_SAGE3_NVFP4, (0, 0, 0, 0), 64, ["sage3_nvfp4_fwd_sm90: does not write P's row maxima"]),
    (_C.SCHEME_SAGE2_8B_AUTO, (0, 0, 0, 0), 64, ["sage2_auto_sm90: does not write P's row maxima"]),
    (_C.SCHEME_SAGE2_8B, (0, 0, 0, 0), 192, ["sage2_wide_sm90: does not write P's row maxima"]),
    (_C.SCHEME_SAGE2_8B, VARLEN, 64, ["sage2_fwd_sm90: writes P's row maxima (p_max) outside a "
                                      "packed batch only"]),
])
def test_forward_p_max_is_declined_by_name_where_not_written(scheme, varlen, d, words):
    a = args(d=d)
    status, _ = _C.workspace_size(*a, NO_MASK, scheme, varlen, p_max=P_MAX)
    message = _C.last_error_message()
    assert status == _C.ERROR_UNSUPPORTED, message
    assert "no kernel family runs this call" in message and "p_max written" in message, message
    for w in words:
        assert w in message, message
    status, _ = _C.workspace_size(*a, NO_MASK, scheme, varlen)  # without p_max it runs
    assert status == _C.OK, _C.last_error_message()


def bwd_args(format=None, dov=None, deterministic=False, b=2, hq=8, hkv=2, nq=300, nkv=500, d=64):
    """The backward's arguments up to deterministic: q, k, v, o, dout at slots 1..5, lse 6,
    dq, dk, dv 7..9."""
    return (
        fake_tensor(1, b, hq, nq, d), fake_tensor(2, b, hkv, nkv, d), fake_tensor(3, b, hkv, nkv, d),
        fake_tensor(4, b, hq, nq, d), fake_tensor(5, b, hq, nq, d), 6 << 40,
        fake_tensor(7, b, hq, nq, d), fake_tensor(8, b, hkv, nkv, d), fake_tensor(9, b, hkv, nkv, d),
        _C.DTYPE_BF16, (b, hq, hkv, nq, nkv, d), 0, 0.0,
        _C.BWD_E4M3 if format is None else format, _C.BWD_DOV_16BIT if dov is None else dov,
        deterministic,
    )


MF_P_MAX = 11 << 40


def test_backward_scales_constants_and_defaults():
    assert (_C.BWD_SCALES_PER_BLOCK, _C.BWD_SCALES_MERGE_FREE) == (0, 1)
    status, plain = _C.bwd_workspace_size(*bwd_args())
    assert status == _C.OK, _C.last_error_message()
    assert _C.bwd_workspace_size(*bwd_args(), scales=_C.BWD_SCALES_PER_BLOCK, p_max=0) == (status, plain)
    status, merge_free = _C.bwd_workspace_size(*bwd_args(), scales=_C.BWD_SCALES_MERGE_FREE,
                                               p_max=MF_P_MAX)
    assert status == _C.OK, _C.last_error_message()
    assert merge_free > 0 and merge_free % 256 == 0
    status = _C.bwd(*bwd_args(), 12 << 40, merge_free, 0, scales=_C.BWD_SCALES_MERGE_FREE,
                    p_max=MF_P_MAX)
    assert status in (_C.ERROR_NO_DEVICE, _C.ERROR_INVALID_ARGUMENT), _C.last_error_message()


@pytest.mark.parametrize("change,words", [
    (dict(scales=2, p_max=0), ["scales = 2", "QATTN_BWD_SCALES_MERGE_FREE (1)"]),
    (dict(format=0), ["scales = QATTN_BWD_SCALES_MERGE_FREE with format = 0", "QATTN_BWD_E4M3"]),
    (dict(dov=1), ["scales = QATTN_BWD_SCALES_MERGE_FREE with dov = 1", "QATTN_BWD_DOV_16BIT"]),
    (dict(p_max=0), ["p_max is NULL", "QATTN_BWD_SCALES_MERGE_FREE"]),
    (dict(scales=0), ["p_max is set with scales = QATTN_BWD_SCALES_PER_BLOCK"]),
    (dict(p_max=MF_P_MAX + 2), ["p_max = ", "4-byte aligned"]),
    (dict(p_max=(7 << 40) + 64), ["dq overlaps p_max"]),
])
def test_backward_scales_are_validated_by_name(change, words):
    opts = {"scales": _C.BWD_SCALES_MERGE_FREE, "p_max": MF_P_MAX, "format": None, "dov": None}
    opts.update(change)
    a = bwd_args(opts.pop("format"), opts.pop("dov"))
    for status in (_C.bwd_workspace_size(*a, **opts)[0],
                   _C.bwd(*a, 12 << 40, 1 << 30, 0, **opts)):
        message = _C.last_error_message()
        assert status == _C.ERROR_INVALID_ARGUMENT, message
        for w in words:
            assert w in message, message


def test_error_type_carries_status_and_message():
    _C.workspace_size(*args(hkv=3))
    with pytest.raises(qattn.QattnError, match="heads_kv = 3") as info:
        qattn.errors.check(_C.ERROR_INVALID_ARGUMENT)
    assert info.value.status == _C.ERROR_INVALID_ARGUMENT
    assert info.value.status_name == "QATTN_ERROR_INVALID_ARGUMENT"


def test_version_and_build():
    assert qattn.__version__ == _C.version()
    assert isinstance(qattn.built_with_cuda(), bool)
    assert isinstance(qattn.device_supported(), bool)
