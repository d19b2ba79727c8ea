"""The module-level guard of the GPU test modules: skip, with the reason, unless torch
and qattn import, qattn has its CUDA kernels and the current device is sm_90."""

import pytest


def require_sm90():
    """Returns (torch, qattn), or skips the calling module."""
    torch = pytest.importorskip("torch")
    qattn = pytest.importorskip("qattn")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    if not qattn.built_with_cuda():
        pytest.skip("qattn was built without CUDA", allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(
            f"needs an sm_90 GPU, found {torch.cuda.get_device_name()} "
            f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})",
            allow_module_level=True,
        )
    return torch, qattn
