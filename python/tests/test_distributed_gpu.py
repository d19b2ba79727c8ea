"""qattn.distributed on one sm_90 GPU: ring, Ulysses and the hybrid over an NCCL group of
one rank, with qattn's kernels as the local attention (the orchestration the multi-GPU
runs use, at world size 1).

Forward: with one rank each method makes one local call and merges one partial, whose
weight exp(lse − lse) = 1 is exact, so O and the LSE equal one qattn.attention call bit
for bit. Backward: against FP64 autograd on the same inputs, the bounds of
test_backward.py (SageBwd: dQ, dK >= 0.995, dV >= 0.997 CosSim; derived there from the
emulator)."""

import os
import random
import socket

import pytest

from gpu import require_sm90

torch, qattn = require_sm90()
import torch.distributed as dist  # noqa: E402

import qattn.distributed as qd  # noqa: E402

COS_MIN = {"dq": 0.995, "dk": 0.995, "dv": 0.997}
SEEDS = [0, random.randrange(1, 2**31)]


@pytest.fixture(scope="module")
def world_of_one():
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed without NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[var] = val
    dist.init_process_group("nccl", rank=0, world_size=1)
    ulysses_group, ring_group = qd.hybrid_groups(1)
    yield ulysses_group, ring_group
    dist.destroy_process_group()


def inputs(hq, hkv, n, d, seed, dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=dtype, generator=g) + 0.5  # a K bias
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=dtype, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def run(method, q, k, v, causal, groups):
    if method == "ring":
        return qd.ring_attention(q, k, v, is_causal=causal, return_lse=True)
    if method == "ulysses":
        return qd.ulysses_attention(q, k, v, is_causal=causal, return_lse=True)
    return qd.hybrid_attention(q, k, v, *groups, is_causal=causal, return_lse=True)


METHODS = ["ring", "ulysses", "hybrid"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,n,d", [(8, 8, 1000, 128), (8, 2, 777, 64)])
def test_forward_equals_one_call(world_of_one, seed, method, causal, hq, hkv, n, d):
    q, k, v = inputs(hq, hkv, n, d, seed)
    o, lse = run(method, q, k, v, causal, world_of_one)
    o_ref, lse_ref = qattn.attention(q, k, v, is_causal=causal, return_lse=True)
    assert torch.equal(o, o_ref)
    assert torch.equal(lse, lse_ref)


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_within_sagebwd_bounds(world_of_one, seed, method, causal):
    q, k, v = inputs(8, 4, 640, 128, seed, grad=True)
    w = torch.randn(1, 8, 640, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1))
    o, _ = run(method, q, k, v, causal, world_of_one)
    dq, dk, dv = torch.autograd.grad((o.float() * w).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    refs = torch.autograd.grad((o64 * w.double()).sum(), (q64, k64, v64))
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert torch.isfinite(got).all(), name
        assert cos(got, ref) >= COS_MIN[name], f"{name}: CosSim {cos(got, ref):.6f}"
