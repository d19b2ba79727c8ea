"""qattn.set_training: where the SDPA drop-in runs training calls.

"sagebwd" (the default) runs a call whose inputs require grad on qattn's training forward
and SageBwd; "sdpa" runs it on PyTorch's SDPA, forward and backward, with no fallback
warning and whatever set_fallback says, while inference calls stay on qattn. On the CPU
with meta tensors (qattn's ops have fake implementations, so which op a call dispatches
is visible without a GPU) and CPU tensors (the gradients equal SDPA's own, bit for bit:
the same function runs). The GPU case compares one training step against SDPA.
"""

import os
import subprocess
import sys
import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from qattn import QattnFallbackWarning, sdpa  # noqa: E402


@pytest.fixture(autouse=True)
def restore_modes():
    mode, fallback = qattn.get_training(), qattn.get_fallback()
    sdpa._warned.clear()
    yield
    qattn.set_training(mode)
    qattn.set_fallback(fallback)


class QattnOps(TorchDispatchMode):
    """The names of the qattn ops a call dispatches."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qattn":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def meta(*shape, grad=True):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta").requires_grad_(grad)


def test_set_get_restore_and_refuse():
    assert qattn.get_training() == "sagebwd"
    assert qattn.set_training("sdpa") == "sagebwd"
    assert qattn.get_training() == "sdpa"
    assert qattn.set_training("sagebwd") == "sdpa"
    for bad in ("SDPA", "cudnn", None, 1):
        with pytest.raises(ValueError, match=r"allowed: 'sagebwd' \(the default\) or 'sdpa'"):
            qattn.set_training(bad)
    assert qattn.get_training() == "sagebwd"  # a refused value changes nothing


@pytest.mark.parametrize("value,ok", [("sdpa", True), ("fast", False)])
def test_environment_variable_sets_the_mode_at_import(value, ok):
    r = subprocess.run([sys.executable, "-c", "import qattn; print(qattn.get_training())"],
                       env={**os.environ, "QATTN_TRAINING": value}, capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == value, r.stderr
    else:
        assert r.returncode != 0 and "QATTN_TRAINING = 'fast'" in r.stderr


@pytest.mark.parametrize("mode,train_ops", [("sagebwd", ["attention_train"]), ("sdpa", [])])
def test_training_calls_follow_the_mode_and_inference_stays_on_qattn(mode, train_ops):
    qattn.set_training(mode)
    q, k, v = meta(1, 4, 128, 64), meta(1, 4, 128, 64), meta(1, 4, 128, 64)
    with QattnOps() as log:
        o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert log.names == train_ops
    assert o.shape == (1, 4, 128, 64) and o.requires_grad
    with QattnOps() as log:
        o.float().sum().backward()
    assert log.names == (["attention_backward"] if mode == "sagebwd" else [])
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    # The same call without autograd is qattn's inference op in either mode.
    with torch.no_grad(), QattnOps() as log:
        qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert log.names == ["attention"]


def test_sdpa_mode_is_no_fallback():
    # A training call qattn would decline (dropout) runs on SDPA in "sdpa" mode without the
    # fallback's warning, and set_fallback("raise") does not apply to it.
    qattn.set_training("sdpa")
    qattn.set_fallback("raise")
    q = torch.randn(1, 2, 64, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QattnFallbackWarning)
        o = qattn.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    assert o.shape == q.shape
    # In the default mode the same call is a fallback, and "raise" raises.
    qattn.set_training("sagebwd")
    with pytest.raises(qattn.QattnUnsupportedError, match="dropout"):
        qattn.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize("seed", [3, 4])
def test_sdpa_mode_gradients_are_sdpas(seed):
    # CPU tensors: the drop-in's result and gradients are SDPA's bits (GQA, a boolean mask,
    # a scale: every argument passed on as given).
    qattn.set_training("sdpa")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, 40, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 56, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 56, 32, generator=g, requires_grad=True)
    mask = torch.rand(40, 56, generator=g) > 0.3
    mask[:, 0] = True  # every query sees a key
    dout = torch.randn(2, 8, 40, 32, generator=g)
    kwargs = dict(attn_mask=mask, scale=0.2, enable_gqa=True)
    ours = qattn.scaled_dot_product_attention(q, k, v, **kwargs)
    grads = torch.autograd.grad(ours, (q, k, v), dout)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    want = torch.autograd.grad(theirs, (q, k, v), dout)
    assert torch.equal(ours, theirs)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def test_gpu_sdpa_mode_trains_like_sdpa():
    if not (torch.cuda.is_available() and qattn.built_with_cuda() and qattn.device_supported()):
        pytest.skip("needs a Hopper GPU (sm_90) and a CUDA build of qattn")
    qattn.set_training("sdpa")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_(True) for _ in range(3))
    o = qattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().sum().backward()
    # The same backend on the same inputs: at most its own run-to-run order apart (a BF16
    # ulp, 2^-8 relative, on some elements: relative L1 <= 2^-8), where SageBwd's
    # gradients are 0.05-0.07 from exact (docs/accuracy-report.md).
    for a, t in zip(grads, (q, k, v)):
        rel_l1 = ((a.float() - t.grad.float()).abs().sum() / t.grad.float().abs().sum()).item()
        assert rel_l1 <= 2.0 ** -8, rel_l1
