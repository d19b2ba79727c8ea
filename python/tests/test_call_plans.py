"""The plans of the direct call (ops._plan_key, ops._Plan, ops._launch_plan, ops._run_call)
and qattn.attention's path for plain calls, without a GPU: CPU tensors stand in for CUDA
ones and a recording stand-in for the binding's forward, so a planned call's C arguments
are compared with the ones _Call passes, value for value. The GPU side (bit-equal
outputs of first and planned calls, streams, devices) is in test_attention.py."""

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")

from qattn import QattnError, _C, ops  # noqa: E402

STREAM = 1234  # the stand-in current stream
BLOCK = 1 << 20  # the stand-in allocator's block address (256-byte aligned)


class RecordingC:
    """qattn._C with forward() recorded and answering `status`; the rest is the real
    module (workspace_size validates on the CPU)."""

    def __init__(self):
        self.calls = []
        self.status = _C.OK

    def __getattr__(self, name):
        return getattr(_C, name)

    def forward(self, *args, **kwargs):  # keywords (head_dim_v) recorded after the arguments
        self.calls.append(args + tuple(sorted(kwargs.items())))
        return self.status


@pytest.fixture
def device(monkeypatch):
    """(the recording _C, the allocator's log) with an empty plan cache."""
    c = RecordingC()
    log = []
    monkeypatch.setattr(ops, "_C", c)
    monkeypatch.setattr(ops, "_current_stream", lambda index: STREAM)
    monkeypatch.setattr(ops, "_raw_alloc", lambda n, stream: log.append(("alloc", n, stream)) or BLOCK)
    monkeypatch.setattr(ops, "_raw_delete", lambda ptr: log.append(("free", ptr)))
    monkeypatch.setattr(ops, "_plans", {})
    return c, log


def qkv(b=2, hq=4, hkv=2, nq=100, nkv=130, d=64, layout="HND", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(b * 1000 + nq + d)
    qs = (b, hq, nq, d) if layout == "HND" else (b, nq, hq, d)
    ks = (b, hkv, nkv, d) if layout == "HND" else (b, nkv, hkv, d)
    return (torch.randn(qs, generator=g).to(dtype), torch.randn(ks, generator=g).to(dtype),
            torch.randn(ks, generator=g).to(dtype))


def key_of(q, k, v, causal=0, scale=None, layout="HND", return_lse=False, granularity="per_thread",
           scheme=_C.SCHEME_SAGE2_8B, window_left=-1, window_right=-1, alignment="bottom_right",
           p_max=False):
    return ops._plan_key(q, k, v, causal, scale, layout, return_lse, granularity, scheme,
                         window_left, window_right, alignment, p_max)


def first_call(q, k, v, causal=0, scale=None, layout="HND", return_lse=False,
               granularity="per_thread", scheme=_C.SCHEME_SAGE2_8B, p_max=False, **mask):
    key = key_of(q, k, v, causal, scale, layout, return_lse, granularity, scheme,
                 mask.get("window_left", -1), mask.get("window_right", -1),
                 mask.get("alignment", "bottom_right"), p_max)
    out = ops._run_call(key, q, k, v, causal, scale, layout, return_lse, granularity, scheme, True,
                        mask, p_max)
    return key, out


def without_outputs(args):
    """A forward's arguments with the addresses of o, lse and the workspace left out
    (fresh buffers each call)."""
    args = list(args)
    args[3] = args[3][1:]  # o: (ptr, strides) -> strides
    args[4] = args[4] != 0  # lse: given or not
    args[10] = None  # workspace
    return tuple(args)


CASES = [
    dict(),
    dict(causal=1),
    dict(causal=1, return_lse=True),
    dict(layout="NHD"),
    dict(layout="NHD", causal=1, alignment="top_left"),
    dict(scale=0.3, granularity="per_warp"),
    dict(granularity="per_block", return_lse=True),
    dict(window_left=16, window_right=4),
    dict(scheme=_C.SCHEME_SAGE2_8B_AUTO),
    dict(scheme=_C.SCHEME_PRECISE16, causal=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_planned_call_passes_what_the_first_call_passed(device, case):
    c, log = device
    case = dict(case)
    layout = case.get("layout", "HND")
    mask = {name: case.pop(name) for name in ("window_left", "window_right", "alignment") if name in case}
    q, k, v = qkv(layout=layout)
    key, (o1, lse1) = first_call(q, k, v, **case, **mask)
    plan = ops._plans[key]
    o2, lse2 = ops._launch_plan(plan, q, k, v, case.get("return_lse", False), True, 0)
    first, planned = c.calls
    assert without_outputs(planned) == without_outputs(first)
    assert planned[3][0] == o2.data_ptr() and planned[11] == first[11] == plan.ws_bytes
    assert planned[12] == first[12] == STREAM
    assert (o2.shape, o2.stride(), o2.dtype) == (o1.shape, o1.stride(), o1.dtype)
    assert (lse2.shape, lse2.dtype) == (lse1.shape, lse1.dtype)
    assert (planned[4] == lse2.data_ptr()) if case.get("return_lse") else planned[4] == 0
    # The workspace: one block of the plan's size on the call's stream, freed after it
    # (none where the call needs none).
    if plan.ws_bytes:
        assert log == [("alloc", plan.ws_bytes, STREAM), ("free", BLOCK)] and planned[10] == BLOCK
    else:
        assert log == [] and planned[10] == 0


def p_max_of(call):
    """The p_max keyword a recorded forward passed (0: none passed)."""
    return dict(a for a in call if isinstance(a, tuple) and len(a) == 2 and a[0] == "p_max").get("p_max", 0)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_planned_training_call_writes_p_max_as_the_first_did(device, layout):
    # The training forward (per-block groups, the LSE and P's row maxima written): its
    # plan passes a fresh (B, Hq, Nq) float32 p_max each call, as the first call did.
    c, _ = device
    q, k, v = qkv(layout=layout)
    key, (o1, lse1, p1) = first_call(q, k, v, causal=1, layout=layout, return_lse=True,
                                     granularity="per_block", p_max=True)
    assert key != key_of(q, k, v, 1, None, layout, True, "per_block")  # its own plan
    plan = ops._plans[key]
    o2, lse2, p2 = ops._launch_plan(plan, q, k, v, True, True, 0)
    first, planned = c.calls
    assert p1.shape == p2.shape == (2, 4, 100) and p1.dtype == p2.dtype == torch.float32
    assert p_max_of(first) == p1.data_ptr() and p_max_of(planned) == p2.data_ptr() != 0
    strip = lambda call: tuple(a for a in without_outputs(call) if not (isinstance(a, tuple) and a[:1] == ("p_max",)))  # noqa: E731
    assert strip(planned) == strip(first)
    # A call without p_max passes none, planned or not.
    key0, _ = first_call(q, k, v, causal=1, layout=layout, return_lse=True, granularity="per_block")
    assert len(ops._launch_plan(ops._plans[key0], q, k, v, True, True, 0)) == 2
    assert p_max_of(c.calls[-1]) == 0 and p_max_of(c.calls[-2]) == 0


@pytest.mark.parametrize("make", [
    lambda t: t,  # contiguous: O is torch.empty_like(q)
    lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # a view in the other layout
    lambda t: t[:1].expand(1, *t.shape[1:]).as_strided(t[:1].shape, (7,) + t.stride()[1:]),  # odd size-1 stride
])
def test_planned_output_is_contiguous_whatever_q_is(device, make):
    c, _ = device
    q, k, v = qkv(b=1)
    q = make(q)
    key, (o1, _) = first_call(q, k, v)
    o2, _ = ops._launch_plan(ops._plans[key], q, k, v, False, True, 0)
    assert o2.is_contiguous() and o2.stride() == o1.stride() and o2.shape == q.shape
    assert c.calls[1][3][1:] == tuple(o2.stride()[:3])


def test_direct_calls_get_no_lse_tensor_they_did_not_ask_for(device):
    q, k, v = qkv()
    key, _ = first_call(q, k, v)
    assert ops._launch_plan(ops._plans[key], q, k, v, False, False, 0)[1] is None
    o, lse = ops._run_call(key, q, k, v, 0, None, "HND", False, "per_thread", _C.SCHEME_SAGE2_8B,
                           False, {})
    assert lse is None and o.shape == q.shape


def test_keys_tell_apart_everything_the_checks_read():
    q, k, v = qkv()
    base = key_of(q, k, v)
    assert base == key_of(*qkv())  # the same shapes, other values: one plan
    others = [
        key_of(*qkv(nq=101)), key_of(*qkv(nkv=131)), key_of(*qkv(hq=8)), key_of(*qkv(hkv=1)),
        key_of(*qkv(d=128)), key_of(*qkv(dtype=torch.float16)),
        key_of(q, k[:, :1], v[:, :1]),  # k and v's heads
        key_of(q, k.transpose(1, 2).contiguous().transpose(1, 2), v),  # k's strides
        key_of(q, k, v, causal=1), key_of(q, k, v, scale=0.5), key_of(q, k, v, return_lse=True),
        key_of(q, k, v, granularity="per_block"), key_of(q, k, v, scheme=_C.SCHEME_PRECISE16),
        key_of(q, k, v, window_left=8), key_of(q, k, v, window_right=8),
        key_of(q, k, v, alignment="top_left"), key_of(q, k, v, p_max=True),
    ]
    assert base not in others and len(set(others)) == len(others)
    # A key may not mistake a value the checks refuse for one they take.
    assert key_of(q, k, v, scale=True) is None and key_of(q, k, v, scale=torch.tensor(0.5)) is None
    assert key_of(q, k, v, layout=["HND"]) is None and key_of(q, k, v, granularity=None) is None


class OnDevice:
    """A tensor's key-relevant facts on another device."""

    def __init__(self, t, device):
        self.t, self.device = t, torch.device(device)
        self.shape, self.dtype = t.shape, t.dtype

    def stride(self):
        return self.t.stride()


def test_keys_tell_apart_devices():
    q, k, v = qkv()
    on = [key_of(*(OnDevice(t, d) for t in (q, k, v))) for d in ("cuda:0", "cuda:1")]
    assert on[0] != on[1]
    # Each input's device is in the key (the checks refuse inputs on two devices), by
    # type as well as index.
    assert key_of(OnDevice(q, "cuda:0"), OnDevice(k, "cuda:1"), OnDevice(v, "cuda:0")) not in on
    assert key_of(OnDevice(q, "cuda:0"), OnDevice(k, "xpu:0"), OnDevice(v, "cuda:0")) not in on


@pytest.mark.parametrize("make", [
    lambda q, k, v: (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v),  # k's last dim strided
    lambda q, k, v: (q, k[:, :1].expand(k.shape), v),  # stride 0 (expanded heads)
    lambda q, k, v: tuple(t[..., :60] for t in (q, k, v)),  # head_dim 60: padded to 64
])
def test_calls_that_copy_or_pad_keep_no_plan(device, make):
    q, k, v = make(*qkv())
    key, _ = first_call(q, k, v)
    assert key is not None and ops._plans == {}


def test_misaligned_pointers_take_the_general_path(device):
    q, k, v = qkv()
    key, _ = first_call(q, k, v)
    # The same shape and strides, the storage shifted by one element (2 bytes).
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)
    assert key_of(q, shifted, v) == key and shifted.data_ptr() % 16 != 0
    assert ops._launch_plan(ops._plans[key], q, shifted, v, False, True, 0) is None


@pytest.mark.parametrize("bad", [
    dict(granularity="per_row"), dict(scale=-1.0), dict(layout="BSHD"), dict(window_left=-2),
    dict(alignment="middle"),
])
def test_refused_calls_keep_no_plan(device, bad):
    q, k, v = qkv()
    with pytest.raises(QattnError):
        first_call(q, k, v, **bad)
    assert ops._plans == {} and device[0].calls == []


def test_a_failed_launch_frees_the_workspace_and_raises(device):
    c, log = device
    q, k, v = qkv()
    key, _ = first_call(q, k, v)
    log.clear()
    c.status = _C.ERROR_CUDA
    with pytest.raises(QattnError) as info:
        ops._launch_plan(ops._plans[key], q, k, v, False, True, 0)
    assert info.value.status == _C.ERROR_CUDA
    assert log == [("alloc", ops._plans[key].ws_bytes, STREAM), ("free", BLOCK)]


def test_the_plan_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(ops, "_PLANS_MAX", 2)
    keys = [first_call(*qkv(nq=n))[0] for n in (64, 65, 66)]
    assert len(ops._plans) <= 2 and keys[-1] in ops._plans


# ---- qattn.attention's path for plain calls ---------------------------------------------


@pytest.fixture
def run_calls(monkeypatch):
    """Every _run call of qattn.attention, as (positional, keyword) arguments, with the
    direct path open to CPU tensors."""
    calls = []

    def run(q, k, v, *args, **kwargs):
        calls.append((args, kwargs))
        return q, torch.zeros(1)

    monkeypatch.setattr(ops, "_direct_call_ok", lambda q, k, v: True)
    monkeypatch.setattr(ops, "_run", run)
    return calls


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("nkv", [100, 130])
@pytest.mark.parametrize("return_lse", [False, True])
def test_plain_calls_reach_run_as_the_general_path_does(run_calls, layout, is_causal, alignment,
                                                        nkv, return_lse):
    q, k, v = qkv(nq=100, nkv=nkv, layout=layout)
    opts = dict(is_causal=is_causal, layout=layout, return_lse=return_lse, causal_alignment=alignment)
    plain = qattn.attention(q, k, v, **opts)
    # window_size given (a list, not the default object) takes the general path.
    general = qattn.attention(q, k, v, window_size=[-1, -1], **opts)
    assert run_calls[0] == run_calls[1]
    assert type(plain) is type(general)


def test_plain_calls_with_bad_options_get_the_general_errors(run_calls):
    q, k, v = qkv()
    with pytest.raises(QattnError, match="causal_alignment = 'middle'"):
        qattn.attention(q, k, v, is_causal=True, causal_alignment="middle")
    with pytest.raises(QattnError, match="causal_alignment = 'middle'"):
        qattn.attention(q, k, v, causal_alignment="middle")
    assert run_calls == []
