"""Training through qattn: the autograd of qattn.attention / qattn.scaled_dot_product_attention.

CPU parts (any PyTorch build): the ops' registration, the fake implementations under
torch.compile(fullgraph=True) on meta tensors (forward and backward), which op a call
takes with and without autograd, the backward options (the merge-free scales and the
P row maxima they read included), the fallback policy of a declined backward, named
errors, and the exact FP32 backward (the fallback; the op's path off CUDA) against
autograd through PyTorch's SDPA in FP64.

GPU parts (an sm_90 GPU; each skips with the reason elsewhere): SageBwd's dQ, dK, dV
against FP64 autograd on the same inputs, with the per-block scales and with the
merge-free ones (their bounds and the training forward's P row maxima: "GPU: the
merge-free scales" below). Bounds, cosine similarity to the FP64
gradients: dQ >= 0.995, dK >= 0.995, dV >= 0.997. Derivation: the SageBwd emulator
(src/emulate/sagebwd, the kernel's contract) predicts dQ 0.9979, dK 0.9986, dV 0.9990
at N = 1K on the report's generator (issue 19; 0.9973, 0.9980, 0.9986 with the paper's
128-key P/dS blocks); the bounds sit below those by about
twice the emulator's margin to 1, since the random shapes here (tails, GQA, causal,
d = 96) differ from the report's. Relative L1 error: for an error that is a fraction
of each value, rel-L1 is close to the relative L2 error sqrt(2·(1 - cos)); at the cos
bounds that is 0.100 (dQ, dK) and 0.077 (dV); the bounds are 0.10 and 0.08.

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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from qattn import QattnError, QattnFallbackWarning, QattnUnsupportedError, _C, ops, sdpa  # noqa: E402

FRESH_SEED = int(os.environ.get("QATTN_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
print(f"test_backward.py: fresh seed {FRESH_SEED} (QATTN_TEST_SEED={FRESH_SEED} repeats it)")
SEEDS = [1, 2, FRESH_SEED]

COS_MIN = {"dq": 0.995, "dk": 0.995, "dv": 0.997}
REL_L1_MAX = {"dq": 0.10, "dk": 0.10, "dv": 0.08}


@pytest.fixture(autouse=True)
def restore_modes():
    fallback = qattn.get_fallback()
    options = dict(ops._bwd_options)
    sdpa._warned.clear()
    yield
    qattn.set_fallback(fallback)
    ops._bwd_options.update(options)


def meta(*shape, dtype=torch.bfloat16, grad=True):
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)


def shape_of(b, h, n, d, layout):
    return (b, h, n, d) if layout == "HND" else (b, n, h, d)


class OpLog(TorchDispatchMode):
    """Records the qattn ops a call dispatches, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qattn":
            self.calls.append((func.__name__.split(".")[0], args))
        return func(*args, **(kwargs or {}))


# ---- registration and tracing (CPU, meta tensors) ---------------------------------------


def test_ops_are_registered():
    train = str(torch.ops.qattn.attention_train.default._schema)
    assert train.startswith("qattn::attention_train(Tensor q, Tensor k, Tensor v, bool is_causal")
    assert "-> (Tensor, Tensor, Tensor)" in train  # o, lse, p_max
    bwd = str(torch.ops.qattn.attention_backward.default._schema)
    assert bwd.startswith("qattn::attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, "
                          "Tensor o, Tensor lse, Tensor? grad_lse")
    assert 'bool deterministic, str scales="per_block", Tensor? p_max=None, Tensor? kv_lengths' in bwd
    assert "-> (Tensor, Tensor, Tensor)" in bwd


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d,written", [(64, True), (72, True), (128, True), (192, False)])
def test_training_forward_returns_p_max(layout, d, written):
    # P's row maxima beside the LSE where the SA2-8b kernel writes them (head dims up to
    # 128), an empty float32 tensor elsewhere; never differentiable.
    q = meta(*shape_of(2, 8, 300, d, layout))
    k, v = meta(*shape_of(2, 2, 500, d, layout)), meta(*shape_of(2, 2, 500, d, layout))
    o, lse, p_max = torch.ops.qattn.attention_train(q, k, v, True, None, layout, False)
    assert o.shape == q.shape and lse.shape == (2, 8, 300)
    assert p_max.shape == ((2, 8, 300) if written else (0,)) and p_max.dtype == torch.float32
    assert o.requires_grad and not p_max.requires_grad
    assert ops._writes_p_max(q, layout) is written


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d", [64, 72, 128])
def test_meta_backward_shapes(layout, d):
    q = meta(*shape_of(2, 8, 300, d, layout))
    k, v = meta(*shape_of(2, 2, 500, d, layout)), meta(*shape_of(2, 2, 500, d, layout))
    o, lse = qattn.attention(q, k, v, is_causal=True, layout=layout, return_lse=True)
    assert o.requires_grad and lse.requires_grad and lse.shape == (2, 8, 300)
    (o.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.dtype == q.dtype and k.grad.is_contiguous()


@pytest.mark.parametrize("nq,nkv", [(300, 300), (300, 500), (500, 300)])
def test_compile_fullgraph_traces_forward_and_backward(nq, nkv):
    # Top-left with Nq > Nkv is two kernel calls joined by torch.cat: autograd must
    # flow through the narrow/cat composition in the traced graph too.
    def f(q, k, v):
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o2, lse = qattn.attention(q, k, v, is_causal=True, return_lse=True,
                                  causal_alignment="bottom_right")
        return o.float().sum() + o2.float().sum() + lse.sum()

    q, k, v = meta(2, 8, nq, 128), meta(2, 2, nkv, 128), meta(2, 2, nkv, 128)
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_inference_keeps_the_inference_op_and_training_takes_the_training_op():
    q, k = meta(1, 4, 128, 64, grad=False), meta(1, 4, 128, 64, grad=False)
    with OpLog() as log:
        qattn.attention(q, k, k)
    assert [(n, a[3:]) for n, a in log.calls] == [("attention", (False, None, "HND", False, "per_thread"))]
    q.requires_grad_(True)
    with torch.no_grad(), OpLog() as log:
        qattn.attention(q, k, k, granularity="per_warp")
    assert [n for n, _ in log.calls] == ["attention"] and log.calls[0][1][-1] == "per_warp"
    with OpLog() as log:
        o = qattn.attention(q, k, k, granularity="per_warp")
    # The training forward: LSE written, per-block groups whatever granularity says.
    assert [(n, a[3:]) for n, a in log.calls] == [("attention_train", (False, None, "HND", False))]
    with OpLog() as log:
        o.float().sum().backward()
    assert [n for n, _ in log.calls] == ["attention_backward"]
    assert log.calls[0][1][6] is None  # the LSE was not returned: its zero gradient is not passed


def test_training_refuses_a_bad_granularity():
    q = meta(1, 4, 128, 64)
    with pytest.raises(QattnError, match="granularity"):
        qattn.attention(q, q, q, granularity="per_tensor")


def test_backward_of_the_inference_op_called_directly():
    # torch.ops.qattn.attention without the LSE: the backward runs the per-block
    # training forward again for O and the LSE, then the backward.
    q = meta(1, 4, 128, 64)
    o, _ = torch.ops.qattn.attention(q, q, q, False, None, "HND", False, "per_thread")
    with OpLog() as log:
        o.float().sum().backward()
    names = [n for n, _ in log.calls]
    assert names == ["attention", "attention_backward"]
    assert log.calls[0][1][6:] == (True, "per_block")
    assert q.grad.shape == q.shape


# ---- backward options ----------------------------------------------------------------


DEFAULT_OPTIONS = {"format": "int8", "dov": "16bit", "deterministic": False, "scales": "per_block"}


def test_backward_options_set_get_and_restore(monkeypatch):
    monkeypatch.delenv("QATTN_BWD_DETERMINISTIC", raising=False)
    assert qattn.get_backward_options() == DEFAULT_OPTIONS
    previous = qattn.set_backward_options(format="e4m3", dov="quantized")
    assert qattn.get_backward_options() == {**DEFAULT_OPTIONS, "format": "e4m3", "dov": "quantized"}
    assert previous == {**DEFAULT_OPTIONS, "deterministic": None}  # None: from the environment
    qattn.set_backward_options(deterministic=True)
    assert qattn.get_backward_options()["format"] == "e4m3"  # an argument not given keeps its value
    qattn.set_backward_options(**previous)
    assert qattn.get_backward_options() == DEFAULT_OPTIONS
    monkeypatch.setenv("QATTN_BWD_DETERMINISTIC", "1")  # restored to "from the environment"
    assert qattn.get_backward_options()["deterministic"] is True


def merge_free():
    """The merge-free scales with the format and dov they run."""
    qattn.set_backward_options(format="e4m3", dov="16bit", scales="merge_free")


def test_merge_free_option_set_get_and_restore(monkeypatch):
    monkeypatch.delenv("QATTN_BWD_DETERMINISTIC", raising=False)
    previous = qattn.set_backward_options(format="e4m3", scales="merge_free")
    assert qattn.get_backward_options() == {**DEFAULT_OPTIONS, "format": "e4m3", "scales": "merge_free"}
    assert previous["scales"] == "per_block"
    qattn.set_backward_options(deterministic=True)  # the others still change alone
    assert qattn.get_backward_options()["scales"] == "merge_free"
    qattn.set_backward_options(scales="per_block")  # per-block with E4M3: allowed
    qattn.set_backward_options(format="int8")
    qattn.set_backward_options(**previous)
    assert qattn.get_backward_options() == DEFAULT_OPTIONS
    # An older caller's saved options (no "scales" key) restore what they name.
    qattn.set_backward_options(**{k: v for k, v in previous.items() if k != "scales"})
    assert qattn.get_backward_options() == DEFAULT_OPTIONS


@pytest.mark.parametrize("before,kwargs,match", [
    # The combination left in force is checked: merge-free needs E4M3 and the 16-bit dO·Vᵀ.
    ({}, dict(scales="merge_free"),
     r"scales = 'merge_free' with format = 'int8' \(format already in force\); allowed: the "
     r"merge-free scales with format 'e4m3' and dov '16bit' only"),
    ({}, dict(format="int8", scales="merge_free"), r"scales = 'merge_free' with format = 'int8';"),
    ({}, dict(format="e4m3", dov="quantized", scales="merge_free"),
     r"scales = 'merge_free' with dov = 'quantized';"),
    ({}, dict(dov="quantized", scales="merge_free"),
     r"scales = 'merge_free' with format = 'int8' and dov = 'quantized' \(format already"),
    (dict(format="e4m3", scales="merge_free"), dict(format="int8"),
     r"scales = 'merge_free' with format = 'int8' \(scales already in force\)"),
    (dict(format="e4m3", scales="merge_free"), dict(dov="quantized"),
     r"scales = 'merge_free' with dov = 'quantized' \(scales already in force\)"),
    ({}, dict(scales="merge-free"), r"scales = 'merge-free'; allowed: 'per_block' \(the default\) "
                                    r"or 'merge_free'"),
    ({}, dict(scales=None), r"scales = None"),
    ({}, dict(scales=1), r"scales = 1"),
])
def test_merge_free_option_refuses_what_it_does_not_run(before, kwargs, match):
    qattn.set_backward_options(**before)
    options = qattn.get_backward_options()
    with pytest.raises(ValueError, match=match):
        qattn.set_backward_options(**kwargs)
    assert qattn.get_backward_options() == options  # nothing changed, not even the valid ones


@pytest.mark.parametrize("kwargs,match", [
    (dict(format="int4"), "format = 'int4'; allowed: 'int8'"),
    (dict(format="INT8"), "format"),
    (dict(dov="8bit"), "dov = '8bit'; allowed: '16bit'"),
    (dict(deterministic=1), "deterministic = 1; allowed: True, False or None"),
    (dict(format=None), "format = None"),
])
def test_backward_options_refuse_bad_values(kwargs, match):
    before = qattn.get_backward_options()
    with pytest.raises(ValueError, match=match):
        qattn.set_backward_options(**kwargs)
    assert qattn.get_backward_options() == before  # nothing changed


@pytest.mark.parametrize("value,expect", [("1", True), ("true", True), ("ON", True), ("0", False),
                                          ("no", False), ("", False)])
def test_deterministic_environment_is_read_at_call_time(monkeypatch, value, expect):
    monkeypatch.setenv("QATTN_BWD_DETERMINISTIC", value)
    assert qattn.get_backward_options()["deterministic"] is expect
    q = meta(1, 4, 128, 64)
    o = qattn.attention(q, q, q)
    with OpLog() as log:
        o.float().sum().backward()
    assert log.calls[0][1][10:] == ("int8", "16bit", expect)
    qattn.set_backward_options(deterministic=not expect)  # an explicit setting wins
    assert qattn.get_backward_options()["deterministic"] is (not expect)


def test_deterministic_environment_with_a_bad_value(monkeypatch):
    monkeypatch.setenv("QATTN_BWD_DETERMINISTIC", "maybe")
    with pytest.raises(ValueError, match="QATTN_BWD_DETERMINISTIC = 'maybe'"):
        qattn.get_backward_options()


@pytest.mark.parametrize("d", [64, 128])
def test_merge_free_options_and_p_max_reach_the_backward_op(d):
    from op_log import OpLog as NamedOpLog

    merge_free()
    qattn.set_backward_options(deterministic=True)
    q, k = meta(1, 8, 128, d), meta(1, 2, 200, d)
    with NamedOpLog() as log:
        o, lse = qattn.attention(q, k, k, is_causal=True, return_lse=True,
                                 causal_alignment="bottom_right")
        (o.float().sum() + lse.sum()).backward()
    (train_name, train), (bwd_name, bwd) = log.calls
    assert (train_name, bwd_name) == ("attention_train", "attention_backward")
    assert (bwd["format"], bwd["dov"], bwd["deterministic"], bwd["scales"]) == (
        "e4m3", "16bit", True, "merge_free")
    assert bwd["p_max"].shape == (1, 8, 128) and bwd["p_max"].dtype == torch.float32
    assert bwd["grad_lse"] is not None  # the LSE's gradient, with the same scales
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_merge_free_without_p_max_runs_per_block_with_a_warning():
    # Head dim 192: the training forward runs the head-dim-256 kernel, which writes no row
    # maxima; the backward gets per-block E4M3 scales (and then SageBwd's own decline of
    # the head dim, by the fallback mode) with one warning for the scales.
    from op_log import OpLog as NamedOpLog

    from qattn import fallback

    merge_free()
    fallback._warned.discard("backward scales merge_free without p_max")
    q = meta(1, 4, 128, 192)
    o = qattn.attention(q, q, q)
    with warnings.catch_warnings(record=True) as record, NamedOpLog() as log:
        warnings.simplefilter("always")
        o.float().sum().backward()
        q.grad = None
        qattn.attention(q, q, q).float().sum().backward()
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "merge-free scales need P's row maxima" in msgs[0], msgs
    assert "per-block E4M3 scales instead" in msgs[0]
    bwd = [c for name, c in log.calls if name == "attention_backward"]
    assert [(c["format"], c["scales"], c["p_max"]) for c in bwd] == [("e4m3", "per_block", None)] * 2
    # The same rule for a caller with no p_max at all (qattn.distributed's merged O and LSE).
    assert ops._backward_scales({"scales": "merge_free"}, None) == {}
    assert ops._backward_scales({"scales": "merge_free"}, torch.empty(0)) == {}
    assert ops._backward_scales({"scales": "per_block"}, torch.empty(1, 2, 3)) == {}
    got = ops._backward_scales({"scales": "merge_free"}, torch.empty(1, 2, 3))
    assert got["scales"] == "merge_free" and got["p_max"].shape == (1, 2, 3)


def test_backward_of_the_inference_op_with_merge_free_reruns_the_training_forward():
    # torch.ops.qattn.attention writes no row maxima: the merge-free backward runs the
    # training forward for O, the LSE and p_max, whatever the inference call returned.
    from op_log import OpLog as NamedOpLog

    merge_free()
    q = meta(1, 4, 128, 64)
    o, _ = torch.ops.qattn.attention(q, q, q, True, None, "HND", True, "per_block")
    with NamedOpLog() as log:
        o.float().sum().backward()
    assert [n for n, _ in log.calls] == ["attention_train", "attention_backward"]
    bwd = log.calls[1][1]
    assert bwd["scales"] == "merge_free" and bwd["p_max"].shape == (1, 4, 128)
    assert q.grad.shape == q.shape


def test_compile_fullgraph_traces_merge_free_forward_and_backward():
    merge_free()

    def f(q, k, v):
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o2, lse = qattn.attention(q, k, v, is_causal=True, return_lse=True,
                                  causal_alignment="bottom_right")
        return o.float().sum() + o2.float().sum() + lse.sum()

    for nq, nkv in [(300, 300), (500, 300)]:
        torch._dynamo.reset()
        q, k, v = meta(2, 8, nq, 128), meta(2, 2, nkv, 128), meta(2, 2, nkv, 128)
        with warnings.catch_warnings():
            warnings.simplefilter("error", QattnFallbackWarning)  # p_max reaches the backward
            torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_options_reach_the_backward_op():
    qattn.set_backward_options(format="e4m3", dov="quantized", deterministic=True)
    q = meta(1, 4, 128, 64)
    o = qattn.attention(q, q, q, is_causal=True, scale=0.25, layout="HND")
    with OpLog() as log:
        o.float().sum().backward()
    assert log.calls[0][1][7:] == (True, 0.25, "HND", "e4m3", "quantized", True)


def test_backward_runs_the_options_of_its_forward():
    # The training forward records the options in force; options set between a forward
    # and its backward apply from the next forward on.
    qattn.set_backward_options(format="e4m3", dov="quantized", deterministic=True)
    q = meta(1, 4, 128, 64)
    o = qattn.attention(q, q, q, is_causal=True)
    qattn.set_backward_options(format="int8", dov="16bit", deterministic=False)
    with OpLog() as log:
        o.float().sum().backward()
    assert log.calls[0][1][10:13] == ("e4m3", "quantized", True)


def _cpu_training_forward(monkeypatch):
    """The training forward's launch replaced by exact attention on the CPU (the op runs
    CUDA only), so that torch.compile's default backend compiles and runs real graphs
    here; returns the list of (format, dov) each backward op call was given."""
    def run(q, k, v, is_causal, scale, layout, return_lse, granularity, **_):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        return o, torch.zeros(q.shape[:3], dtype=torch.float32)

    seen, check = [], ops._check_backward

    def recording(*args):
        if not isinstance(args[1], torch._subclasses.FakeTensor):
            seen.append(args[9:11])
        return check(*args)

    monkeypatch.setattr(ops, "_run", run)
    monkeypatch.setattr(ops, "_check_backward", recording)
    return seen


def test_compiled_backward_runs_the_options_of_its_forward(monkeypatch, tmp_path):
    # torch.compile keeps compiled graphs in caches keyed by the traced forward (on disk,
    # across processes). The options are arguments of the training forward, so a change of
    # options is a different graph: never a cached backward traced under other options.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    seen = _cpu_training_forward(monkeypatch)

    def f(q, k, v):
        return qattn.attention(q, k, v, is_causal=True)

    gen = torch.Generator().manual_seed(FRESH_SEED)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).bfloat16().requires_grad_()
               for _ in range(3))
    compiled = torch.compile(f, fullgraph=True)
    for fmt, reset in (("int8", True), ("e4m3", True), ("int8", True), ("e4m3", False)):
        qattn.set_backward_options(format=fmt)
        if reset:  # a fresh trace, which the caches may answer
            torch._dynamo.reset()
        seen.clear()
        compiled(q, k, v).float().sum().backward()
        assert seen == [(fmt, "16bit")], (fmt, reset, seen)


# ---- named errors of the backward op -----------------------------------------------------


def test_backward_op_names_bad_arguments():
    q, lse = meta(1, 4, 128, 64, grad=False), torch.empty(1, 4, 128, device="meta")
    bwd = torch.ops.qattn.attention_backward
    with pytest.raises(QattnError, match="grad_o is"):
        bwd(meta(1, 4, 64, 64, grad=False), q, q, q, q, lse, None, False, None, "HND", "int8", "16bit", False)
    with pytest.raises(QattnError, match="lse is"):
        bwd(q, q, q, q, q, lse.half(), None, False, None, "HND", "int8", "16bit", False)
    with pytest.raises(QattnError, match="grad_lse is"):
        bwd(q, q, q, q, q, lse, lse[:, :2], False, None, "HND", "int8", "16bit", False)
    with pytest.raises(QattnError, match="format"):
        bwd(q, q, q, q, q, lse, None, False, None, "HND", "fp4", "16bit", False)
    with pytest.raises(QattnError, match="dov"):
        bwd(q, q, q, q, q, lse, None, False, None, "HND", "int8", "fp32", False)
    with pytest.raises(QattnError, match="heads_q = 4 is not a multiple of heads_kv = 3"):
        k = meta(1, 3, 128, 64, grad=False)
        bwd(q, q, k, k, q, lse, None, False, None, "HND", "int8", "16bit", False)


def test_backward_op_names_bad_scales_arguments():
    q, lse = meta(1, 4, 128, 64, grad=False), torch.empty(1, 4, 128, device="meta")
    bwd = torch.ops.qattn.attention_backward
    plain = (q, q, q, q, q, lse, None, False, None, "HND")
    p_max = torch.empty(1, 4, 128, device="meta")
    for args, kwargs, match in [
        (("e4m3", "16bit", False), dict(scales="fixed"),
         r"scales = 'fixed'; allowed: 'per_block', 'merge_free'"),
        (("int8", "16bit", False), dict(scales="merge_free", p_max=p_max),
         r"scales = 'merge_free' with format = 'int8'; allowed: format 'e4m3'"),
        (("e4m3", "quantized", False), dict(scales="merge_free", p_max=p_max),
         r"scales = 'merge_free' with dov = 'quantized'; allowed: dov '16bit'"),
        (("e4m3", "16bit", False), dict(scales="merge_free"),
         r"p_max is None with scales = 'merge_free'; allowed: the training forward's \(1, 4, 128\)"),
        (("e4m3", "16bit", False), dict(scales="merge_free", p_max=p_max[:, :2]),
         r"p_max is \(1, 2, 128\) torch.float32 on meta; allowed: \(1, 4, 128\) torch.float32"),
        (("e4m3", "16bit", False), dict(scales="merge_free", p_max=p_max.half()),
         r"p_max is \(1, 4, 128\) torch.float16"),
        (("e4m3", "16bit", False), dict(scales="merge_free", p_max=torch.empty(0, device="meta")),
         r"p_max is \(0,\)"),
        (("e4m3", "16bit", False), dict(p_max=p_max),
         r"p_max is set with scales = 'per_block'; allowed: None"),
    ]:
        with pytest.raises(QattnError, match=match):
            bwd(*plain, *args, **kwargs)
    # The valid call traces (fake shapes), and a CPU call computes the exact gradients:
    # the scales change nothing there.
    dq, dk, dv = bwd(*plain, "e4m3", "16bit", False, scales="merge_free", p_max=p_max)
    assert dq.shape == q.shape and dk.shape == q.shape
    go, qc, kc, vc = small_problem()
    lse_c, p_c = torch.zeros(1, 2, 40), torch.ones(1, 2, 40)
    got = bwd(go, qc, kc, vc, qc, lse_c, None, True, None, "HND", "e4m3", "16bit", False,
              scales="merge_free", p_max=p_c)
    want = bwd(go, qc, kc, vc, qc, lse_c, None, True, None, "HND", "e4m3", "16bit", False)
    for a, r in zip(got, want):
        assert torch.equal(a, r)
    with pytest.raises(QattnError, match="p_max is on cpu|p_max is .* on meta"):
        bwd(go, qc, kc, vc, qc, lse_c, None, True, None, "HND", "e4m3", "16bit", False,
            scales="merge_free", p_max=torch.ones(1, 2, 40, device="meta"))


# ---- the exact FP32 backward against autograd through SDPA in FP64 (CPU) ------------------


def sdpa_grads(q, k, v, grad_o, is_causal, scale, layout, alignment="bottom_right", grad_lse=None):
    """dq, dk, dv by autograd in FP64 through F.scaled_dot_product_attention (and, with
    grad_lse, through an explicit log-sum-exp), on the same values as q, k, v."""
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    h = lambda t: t if layout == "HND" else t.transpose(1, 2)  # noqa: E731
    qh, kh, vh = h(qq), h(kk), h(vv)
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    nq, nkv, d = qh.shape[2], kh.shape[2], qh.shape[3]
    sm = scale if scale is not None else 1 / math.sqrt(d)
    mask = None
    if is_causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nkv)[None, :]
        mask = j <= i + (nkv - nq if alignment == "bottom_right" else 0)
    seen = mask is None or bool(mask.any(-1).all())
    if seen:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=sm)
    else:  # rows that see no key: output 0 (SDPA's math gives NaN there)
        s = (qh @ kh.transpose(-1, -2) * sm).masked_fill(~mask, -math.inf)
        o = torch.softmax(s, -1).nan_to_num(0.0) @ vh
    loss = (o * h(grad_o.double())).sum()
    if grad_lse is not None:
        s = qh @ kh.transpose(-1, -2) * sm
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(s, -1)
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * grad_lse.double()).sum()
    loss.backward()
    return qq.grad, kk.grad, vv.grad


MATH_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, layout)
    (2, 4, 4, 64, 64, 32, True, "HND"),
    (1, 8, 2, 37, 53, 24, True, "NHD"),
    (2, 4, 1, 53, 37, 40, True, "HND"),  # bottom-right: 16 rows see no key
    (1, 6, 3, 77, 77, 72, False, "NHD"),
]


@pytest.mark.parametrize("case", MATH_CASES, ids=[str(c) for c in MATH_CASES])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_lse", [False, True])
def test_exact_backward_matches_sdpa_autograd(case, seed, with_lse, monkeypatch):
    b, hq, hkv, nq, nkv, d, causal, layout = case
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    q, k, v = rnd(*shape_of(b, hq, nq, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout)), rnd(*shape_of(b, hkv, nkv, d, layout))
    grad_o = rnd(*q.shape)
    grad_lse = torch.randn(b, hq, nq, generator=gen) if with_lse else None
    # Small blocks of rows, so that the blocking is exercised too.
    monkeypatch.setattr(ops, "_MATH_CHUNK", 7 * b * hq * nkv)
    lse = torch.zeros(b, hq, nq)
    got = torch.ops.qattn.attention_backward(grad_o, q, k, v, q, lse, grad_lse, causal, 0.2,
                                              layout, "int8", "16bit", False)
    want = sdpa_grads(q, k, v, grad_o, causal, 0.2, layout, grad_lse=grad_lse)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == r.shape and a.dtype == torch.bfloat16 and a.is_contiguous()
        # The FP32 result rounded to BF16: at most half an ulp, 2^-9 of the value, plus
        # FP32 accumulation (~1e-6 relative over these sums).
        err = (a.double() - r).abs()
        assert bool((err <= r.abs() * 2.0**-8 + 1e-4 * r.abs().max()).all()), (name, seed, err.max())


# ---- a declined backward follows the fallback mode ----------------------------------------


def declining(*args, **kwargs):
    raise QattnError(_C.ERROR_UNSUPPORTED, "qattn_bwd: format = E4M3 is not supported (test)")


def small_problem(seed=5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(1, 2, 40, 16, generator=gen).bfloat16() for _ in range(4))
    return go, q, k, v


def test_declined_backward_warns_once_and_gives_the_exact_gradients(monkeypatch):
    monkeypatch.setattr(ops, "_bwd_run", declining)
    qattn.set_fallback("warn")
    go, q, k, v = small_problem()
    lse = torch.zeros(1, 2, 40)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = ops._backward_cuda(go, q, k, v, q, lse, None, True, None, "HND", "e4m3", "16bit", False)
        ops._backward_cuda(go, q, k, v, q, lse, None, True, None, "HND", "e4m3", "16bit", False)
    msgs = [str(w.message) for w in record if issubclass(w.category, QattnFallbackWarning)]
    assert len(msgs) == 1 and "declined the backward" in msgs[0] and "E4M3" in msgs[0]
    want = ops._backward_math(go, q, k, v, None, True, None, "HND")
    for a, r in zip(got, want):
        assert torch.equal(a, r)


def test_declined_backward_raises_in_raise_mode(monkeypatch):
    monkeypatch.setattr(ops, "_bwd_run", declining)
    qattn.set_fallback("raise")
    go, q, k, v = small_problem()
    with pytest.raises(QattnUnsupportedError, match="declined the backward") as info:
        ops._backward_cuda(go, q, k, v, q, torch.zeros(1, 2, 40), None, False, None, "HND", "int8",
                           "16bit", False)
    assert info.value.reason == "backward library QATTN_ERROR_UNSUPPORTED"


def test_other_backward_failures_are_not_hidden(monkeypatch):
    def failing(*args, **kwargs):
        raise QattnError(_C.ERROR_CUDA, "an illegal memory access (test)")

    monkeypatch.setattr(ops, "_bwd_run", failing)
    go, q, k, v = small_problem()
    with pytest.raises(QattnError, match="illegal memory access"):
        ops._backward_cuda(go, q, k, v, q, torch.zeros(1, 2, 40), None, False, None, "HND", "int8",
                           "16bit", False)


# ---- GPU: SageBwd through autograd -------------------------------------------------------


@pytest.fixture
def gpu():
    from gpu import require_sm90

    require_sm90()
    qattn.set_fallback("raise")  # a declined backward fails the GPU tests, never passes them


def metrics(a, r):
    a, r = a.double().flatten(), r.double().flatten()
    cos = (a @ r / (a.norm() * r.norm())).item()
    rel_l1 = ((a - r).abs().sum() / r.abs().sum()).item()
    return cos, rel_l1


def cuda_inputs(b, hq, hkv, nq, nkv, d, layout, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    q = rnd(*shape_of(b, hq, nq, d, layout)).requires_grad_(True)
    k = rnd(*shape_of(b, hkv, nkv, d, layout)).requires_grad_(True)
    v = rnd(*shape_of(b, hkv, nkv, d, layout)).requires_grad_(True)
    return q, k, v, rnd(*q.shape)


def check_grads(got, want, what):
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a is not None and a.shape == r.shape, (what, name)
        assert bool(torch.isfinite(a).all()), (what, name, "non-finite gradient")
        cos, rel = metrics(a, r)
        print(f"{what} {name}: cos {cos:.5f} rel-L1 {rel:.4f}")
        assert cos >= COS_MIN[name] and rel <= REL_L1_MAX[name], (what, name, cos, rel)


GPU_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, alignment, layout, dtype)
    (1, 4, 4, 1024, 1024, 128, False, "top_left", "HND", torch.bfloat16),
    (1, 4, 4, 1024, 1024, 64, True, "top_left", "NHD", torch.float16),
    (2, 8, 2, 1000, 1000, 128, True, "top_left", "HND", torch.float16),  # GQA, tails
    (1, 8, 1, 77, 77, 64, False, "top_left", "NHD", torch.bfloat16),  # MQA, short tail
    (1, 4, 2, 1000, 600, 96, True, "top_left", "HND", torch.bfloat16),  # Nq > Nkv: two calls, d padded
    (1, 4, 2, 600, 1000, 128, True, "top_left", "NHD", torch.bfloat16),
    (1, 4, 2, 1000, 600, 64, True, "bottom_right", "NHD", torch.float16),  # rows with no key
    (1, 4, 4, 300, 1000, 96, True, "bottom_right", "HND", torch.float16),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=[str(c[:9]) + str(c[9])[6:] for c in GPU_CASES])
@pytest.mark.parametrize("seed", [11, FRESH_SEED])
def test_gpu_gradients_match_fp64(gpu, case, seed):
    b, hq, hkv, nq, nkv, d, causal, alignment, layout, dtype = case
    q, k, v, go = cuda_inputs(b, hq, hkv, nq, nkv, d, layout, dtype, seed)
    o = qattn.attention(q, k, v, is_causal=causal, layout=layout, causal_alignment=alignment)
    o.backward(go)
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), causal, None, layout, alignment)
    check_grads([t.grad.cpu() for t in (q, k, v)], want, f"{case} seed {seed}")


@pytest.mark.parametrize("seed", [12, FRESH_SEED])
def test_gpu_sdpa_drop_in_trains_without_a_fallback(gpu, seed):
    q, k, v, go = cuda_inputs(2, 8, 2, 1000, 1000, 128, "HND", torch.bfloat16, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QattnFallbackWarning)
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
        o.backward(go)
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), True, 0.1, "HND")
    check_grads([t.grad.cpu() for t in (q, k, v)], want, f"drop-in seed {seed}")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_lse_gradient(gpu, layout):
    q, k, v, go = cuda_inputs(1, 4, 2, 1000, 1000, 128, layout, torch.bfloat16, 13)
    gl = torch.randn(1, 4, 1000, device="cuda")
    o, lse = qattn.attention(q, k, v, is_causal=True, layout=layout, return_lse=True)
    ((o.float() * go.float()).sum() + (lse * gl).sum()).backward()
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), True, None, layout, grad_lse=gl.cpu())
    check_grads([t.grad.cpu() for t in (q, k, v)], want, f"lse gradient {layout}")


def run_backward(q, k, v, go, **kwargs):
    for t in (q, k, v):
        t.grad = None
    qattn.attention(q, k, v, **kwargs).backward(go)
    return [t.grad.clone() for t in (q, k, v)]


def test_gpu_deterministic_mode_is_bitwise_stable(gpu):
    qattn.set_backward_options(deterministic=True)
    q, k, v, go = cuda_inputs(2, 8, 2, 1000, 1000, 128, "HND", torch.bfloat16, 14)
    first = run_backward(q, k, v, go, is_causal=True)
    for _ in range(2):
        for a, b in zip(first, run_backward(q, k, v, go, is_causal=True)):
            assert torch.equal(a, b)


def check_compiled_equals_eager(seed, seen_scales=None):
    """torch.compile(fullgraph=True) of a causal top-left call with Nq > Nkv (two training
    forwards) gives the eager output and gradients bitwise, in the deterministic mode;
    eager is bitwise stable run to run too. seen_scales: the merge_free_gpu record, whose
    every backward call must have run the merge-free scales."""
    qattn.set_backward_options(deterministic=True)  # so that equal means bitwise
    q, k, v, go = cuda_inputs(1, 8, 2, 1000, 700, 128, "NHD", torch.bfloat16, seed)

    def f(q, k, v):
        return qattn.attention(q, k, v, is_causal=True, layout="NHD")

    eager_o = f(q, k, v)
    eager = run_backward(q, k, v, go, is_causal=True, layout="NHD")
    for a, b in zip(eager, run_backward(q, k, v, go, is_causal=True, layout="NHD")):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for t in (q, k, v):
        t.grad = None
    o = compiled(q, k, v)
    o.backward(go)
    if seen_scales is not None:  # a backward with other options names itself here
        assert set(seen_scales) == {"merge_free"}, seen_scales
    assert torch.equal(o, eager_o)
    for a, b in zip([t.grad for t in (q, k, v)], eager):
        assert torch.equal(a, b)


def test_gpu_compile_fullgraph_equals_eager(gpu):
    check_compiled_equals_eager(15)


def test_gpu_inference_path_is_unchanged(gpu, monkeypatch):
    q, k, v, _ = cuda_inputs(1, 8, 2, 1000, 1000, 128, "HND", torch.bfloat16, 16)
    seen = []
    run = ops._run

    def recording_run(*args, **kwargs):  # _run(q, k, v, is_causal, scale, layout, return_lse, granularity, ...)
        seen.append((args[6], args[7]))
        return run(*args, **kwargs)

    monkeypatch.setattr(ops, "_run", recording_run)
    with torch.no_grad():
        o = qattn.attention(q, k, v, is_causal=True)
        assert ops._direct_call_ok(q, k, v)  # the direct call, no dispatcher
    assert seen == [(False, "per_thread")]  # no LSE computed, per-thread groups
    ref, lse = torch.ops.qattn.attention(q.detach(), k.detach(), v.detach(), True, None, "HND",
                                         False, "per_thread")
    assert torch.equal(o, ref) and lse.numel() == 0
    seen.clear()
    qattn.attention(q, k, v, is_causal=True)
    assert seen == [(True, "per_block")]  # the training forward


def test_gpu_grads_accumulate_and_outputs_are_fully_written(gpu):
    qattn.set_backward_options(deterministic=True)
    q, k, v, go = cuda_inputs(1, 4, 2, 1000, 1000, 96, "NHD", torch.float16, 17)
    fresh = run_backward(q, k, v, go, is_causal=True, layout="NHD")
    # Freed NaN-filled memory: the caching allocator hands it to the backward's outputs,
    # so an element the kernel leaves unwritten shows as NaN.
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    for t in (q, k, v):
        t.grad = torch.ones_like(t)
    qattn.attention(q, k, v, is_causal=True, layout="NHD").backward(go)
    for t, f in zip((q, k, v), fresh):
        assert bool(torch.isfinite(t.grad).all())
        assert torch.equal(t.grad, f + 1)  # autograd's accumulation: grad += new
    for t in (q, k, v):
        t.grad = torch.full_like(t, float("nan"))
    qattn.attention(q, k, v, is_causal=True, layout="NHD").backward(go)
    assert all(bool(torch.isnan(t.grad).all()) for t in (q, k, v))  # NaN + x stays NaN


@pytest.mark.parametrize("options", [dict(format="e4m3"), dict(dov="quantized")])
def test_gpu_other_formats_run_or_decline_by_the_mode(gpu, options):
    qattn.set_backward_options(**options)
    q, k, v, go = cuda_inputs(1, 4, 4, 1024, 1024, 128, "HND", torch.bfloat16, 18)
    try:
        grads = run_backward(q, k, v, go)
    except QattnUnsupportedError as error:  # raise mode: the library does not run it
        assert "declined the backward" in str(error)
        qattn.set_fallback("warn")
        with pytest.warns(QattnFallbackWarning, match="declined the backward"):
            grads = run_backward(q, k, v, go)
        want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), False, None, "HND")
        for a, r in zip(grads, want):  # the exact FP32 gradients, rounded to BF16
            assert metrics(a.cpu(), r)[0] > 0.99999
        return
    # The library runs it: lower accuracy than INT8 with 16-bit dO·Vᵀ (the paper's
    # ablation), so only finiteness and a loose bound here; the kernel's own suite
    # checks it against the emulator.
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), False, None, "HND")
    for a, r in zip(grads, want):
        assert bool(torch.isfinite(a).all()) and metrics(a.cpu(), r)[0] > 0.98


# ---- GPU: the merge-free scales --------------------------------------------------------
#
# Bounds. Gaussian inputs at N = 1K, d = 128 (the first two cases): CosSim >= 0.998 for
# dQ, dK and dV. The merge-free E4M3 emulation (src/emulate/sagebwd.h, bench/NOTES.md v92)
# gives 0.99829 / 0.99833 / 0.99837 on the report's Gaussian generator at 1K, d 128 (the
# E4M3 scores dominate; per-block E4M3 there: 0.99833 / 0.99833 / 0.99839), and numpy with
# exact scores 0.9993 (v87); 0.998 sits just under the emulation, so a scale off by a
# factor (a missing s_i, a scale applied twice) falls outside it. The other cases (causal,
# GQA, MQA, tails, d 64 and 96, Nq != Nkv, rows with no key) keep this file's per-block
# bounds (COS_MIN, REL_L1_MAX above), as the emulator's merge-free tests keep the
# per-block ones. Relative L1 bounds are REL_L1_MAX everywhere (the emulation: 0.056-0.057).
MERGE_FREE_GAUSSIAN_COS_MIN = 0.998

MERGE_FREE_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, alignment, layout, dtype, gaussian 1K d 128)
    (1, 4, 4, 1024, 1024, 128, False, "top_left", "HND", torch.bfloat16, True),
    (1, 4, 4, 1024, 1024, 128, False, "top_left", "NHD", torch.float16, True),
    (2, 8, 2, 1000, 1000, 128, True, "top_left", "HND", torch.float16, False),  # GQA, tails
    (1, 8, 1, 77, 77, 64, False, "top_left", "NHD", torch.bfloat16, False),  # MQA, short tail
    (1, 4, 2, 1000, 600, 96, True, "top_left", "HND", torch.bfloat16, False),  # two calls, d padded
    (1, 4, 2, 600, 1000, 128, True, "top_left", "NHD", torch.bfloat16, False),  # Nq < Nkv
    (1, 4, 2, 1000, 600, 64, True, "bottom_right", "NHD", torch.float16, False),  # rows with no key
]


@pytest.fixture
def merge_free_gpu(gpu, monkeypatch):
    """The merge-free scales on, and the scales of every SageBwd call recorded: a test
    fails where a call ran per-block scales instead (no p_max reached it), and a
    QattnFallbackWarning is an error."""
    merge_free()
    seen = []
    run = ops._bwd_run

    def recording(*args, **kwargs):
        seen.append(kwargs.get("scales", "per_block"))
        return run(*args, **kwargs)

    monkeypatch.setattr(ops, "_bwd_run", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QattnFallbackWarning)
        yield seen


def check_merge_free_grads(got, want, what, gaussian):
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a is not None and a.shape == r.shape, (what, name)
        assert bool(torch.isfinite(a).all()), (what, name, "non-finite gradient")
        cos, rel = metrics(a, r)
        print(f"{what} {name} (merge-free): cos {cos:.5f} rel-L1 {rel:.4f}")
        cos_min = MERGE_FREE_GAUSSIAN_COS_MIN if gaussian else COS_MIN[name]
        assert cos >= cos_min and rel <= REL_L1_MAX[name], (what, name, cos, rel)


@pytest.mark.parametrize("case", MERGE_FREE_CASES,
                         ids=[str(c[:9]) + str(c[9])[6:] for c in MERGE_FREE_CASES])
@pytest.mark.parametrize("seed", [21, FRESH_SEED])
def test_gpu_merge_free_gradients_match_fp64(merge_free_gpu, case, seed):
    b, hq, hkv, nq, nkv, d, causal, alignment, layout, dtype, gaussian = case
    q, k, v, go = cuda_inputs(b, hq, hkv, nq, nkv, d, layout, dtype, seed)
    o = qattn.attention(q, k, v, is_causal=causal, layout=layout, causal_alignment=alignment)
    o.backward(go)
    assert merge_free_gpu and set(merge_free_gpu) == {"merge_free"}, merge_free_gpu
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), causal, None, layout, alignment)
    check_merge_free_grads([t.grad.cpu() for t in (q, k, v)], want, f"{case} seed {seed}",
                           gaussian)


def p_max_reference(q, k, causal, layout):
    """exp(rowmax(S·scale) − lse) in FP64 from the same values, (B, Hq, Nq); causal
    bottom-right (the training op's alignment); 0 for a row that sees no key."""
    h = lambda t: t if layout == "HND" else t.transpose(1, 2)  # noqa: E731
    qh, kh = h(q.detach().cpu().double()), h(k.detach().cpu().double())
    kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], 1)
    nq, nkv, d = qh.shape[2], kh.shape[2], qh.shape[3]
    s = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    if causal:
        i, j = torch.arange(nq)[:, None], torch.arange(nkv)[None, :]
        s = s.masked_fill(j > i + nkv - nq, -math.inf)
    m, lse = s.amax(-1), torch.logsumexp(s, -1)
    return torch.where(torch.isfinite(m), torch.exp(m - lse), torch.zeros_like(m))


P_MAX_CASES = [  # (b, hq, hkv, nq, nkv, d, causal, layout, dtype)
    (1, 4, 4, 1024, 1024, 128, False, "HND", torch.bfloat16),
    (2, 8, 2, 1000, 1000, 128, True, "NHD", torch.float16),
    (1, 4, 1, 300, 700, 64, True, "HND", torch.bfloat16),
    (1, 4, 2, 700, 300, 96, True, "NHD", torch.bfloat16),  # bottom-right: 400 rows see no key
    (1, 2, 2, 77, 1000, 72, False, "HND", torch.float16),
]


# P's row maxima against FP64. The kernel's p_max is exp(m_i − lse_i) of its own INT8
# scores (per-block Q and K), so each row errs by that of its largest score against its
# LSE: a numpy model of those scores (per-64-row Q and per-128-key K groups, K smoothed)
# at these shapes gives a relative error of 0.9% at the median, 3.3% at the 99th
# percentile and 4.7% at most per row, and a relative L1 over all rows of 0.9–1.0%.
# Bounds: relative L1 <= 2%; per row |log(p / p_ref)| <= LSE_ATOL (0.08, the natural-log
# bound of the LSE the same scores give, tolerances.py); exactly 0 where a row sees no key.
P_MAX_REL_L1_MAX = 0.02


@pytest.mark.parametrize("case", P_MAX_CASES, ids=[str(c[:8]) + str(c[8])[6:] for c in P_MAX_CASES])
@pytest.mark.parametrize("seed", [22, FRESH_SEED])
def test_gpu_training_forward_p_max_matches_fp64(gpu, case, seed):
    from tolerances import LSE_ATOL

    b, hq, hkv, nq, nkv, d, causal, layout, dtype = case
    q, k, v, _ = cuda_inputs(b, hq, hkv, nq, nkv, d, layout, dtype, seed)
    with torch.no_grad():
        o, lse, p_max = torch.ops.qattn.attention_train(q, k, v, causal, None, layout, False)
        # Again: the planned call (ops._plans) writes the same row maxima, into a fresh tensor.
        _, _, again = torch.ops.qattn.attention_train(q, k, v, causal, None, layout, False)
    assert p_max.shape == (b, hq, nq) and p_max.dtype == torch.float32
    assert torch.equal(p_max, again) and p_max.data_ptr() != again.data_ptr()
    got, want = p_max.cpu().double(), p_max_reference(q, k, causal, layout)
    seen = want > 0
    assert bool((got[~seen] == 0).all()), "a row that sees no key has p_max 0"
    g, w = got[seen], want[seen]
    # A probability: in (0, 1] (an FP32 rounding of exp(m - lse) may pass 1 by an ulp).
    assert bool(((g > 0) & (g <= 1 + 2.0**-22)).all()), (g.min().item(), g.max().item())
    rel_l1 = ((g - w).abs().sum() / w.sum()).item()
    worst = (g / w).log().abs().max().item()
    print(f"{case} seed {seed}: p_max rel-L1 {rel_l1:.4f}, worst |log ratio| {worst:.4f}")
    assert rel_l1 <= P_MAX_REL_L1_MAX and worst <= LSE_ATOL, (rel_l1, worst)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_merge_free_lse_gradient(merge_free_gpu, layout):
    q, k, v, go = cuda_inputs(1, 4, 2, 1000, 1000, 128, layout, torch.bfloat16, 23)
    gl = torch.randn(1, 4, 1000, device="cuda")
    o, lse = qattn.attention(q, k, v, is_causal=True, layout=layout, return_lse=True)
    ((o.float() * go.float()).sum() + (lse * gl).sum()).backward()
    assert merge_free_gpu == ["merge_free"] * 2  # dO's call and the LSE term's
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), True, None, layout, grad_lse=gl.cpu())
    check_merge_free_grads([t.grad.cpu() for t in (q, k, v)], want, f"lse gradient {layout}",
                           False)


def test_gpu_merge_free_backward_of_the_inference_op(merge_free_gpu):
    # torch.ops.qattn.attention called directly writes no p_max: its backward runs the
    # training forward again and then the merge-free backward.
    q, k, v, go = cuda_inputs(1, 4, 4, 1024, 1024, 128, "HND", torch.bfloat16, 24)
    o, _ = torch.ops.qattn.attention(q, k, v, False, None, "HND", False, "per_thread")
    o.backward(go)
    assert merge_free_gpu == ["merge_free"]
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), False, None, "HND")
    check_merge_free_grads([t.grad.cpu() for t in (q, k, v)], want, "inference op", True)


def test_gpu_merge_free_sdpa_drop_in(merge_free_gpu):
    q, k, v, go = cuda_inputs(2, 8, 2, 1000, 1000, 128, "HND", torch.bfloat16, 25)
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
    o.backward(go)
    assert merge_free_gpu == ["merge_free"]
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), True, 0.1, "HND")
    check_merge_free_grads([t.grad.cpu() for t in (q, k, v)], want, "drop-in", False)


def test_gpu_merge_free_compile_fullgraph_equals_eager(merge_free_gpu):
    check_compiled_equals_eager(26, merge_free_gpu)


def test_gpu_merge_free_above_head_dim_128_runs_per_block(gpu):
    # Head dim 192: the training forward (head-dim-256 kernel) writes no p_max, so the
    # backward gives way to per-block scales with one warning; SageBwd then declines the
    # head dim, by the fallback mode ("warn" here: the exact gradients).
    merge_free()
    qattn.set_fallback("warn")
    from qattn import fallback

    fallback._warned.discard("backward scales merge_free without p_max")
    q, k, v, go = cuda_inputs(1, 2, 2, 256, 256, 192, "HND", torch.bfloat16, 27)
    with pytest.warns(QattnFallbackWarning) as record:
        qattn.attention(q, k, v).backward(go)
    msgs = [str(w.message) for w in record]
    assert any("merge-free scales need P's row maxima" in m for m in msgs), msgs
    want = sdpa_grads(q.cpu(), k.cpu(), v.cpu(), go.cpu(), False, None, "HND")
    for a, r in zip([t.grad.cpu() for t in (q, k, v)], want):
        assert metrics(a, r)[0] > 0.99
