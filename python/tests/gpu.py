"""The guards of the GPU tests: skip, with the reason, unless torch and qattn import,
qattn has its CUDA kernels and the current device is sm_90."""

import pytest


def sm90_missing():
    """None when the GPU tests can run; otherwise why not (torch and qattn must import)."""
    import qattn
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not qattn.built_with_cuda():
        return "qattn was built without CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return (f"needs an sm_90 GPU, found {torch.cuda.get_device_name()} "
                f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    return None


def require_sm90():
    """Returns (torch, qattn), or skips the calling module."""
    torch = pytest.importorskip("torch")
    qattn = pytest.importorskip("qattn")
    reason = sm90_missing()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
    return torch, qattn
