"""Where qattn.scaled_dot_product_attention (and the plug-ins built on it) runs training
calls: "sagebwd" (the default: qattn's training forward and SageBwd, its INT8 backward)
or "sdpa" (PyTorch's SDPA, forward and backward, with no fallback warning: the caller's
choice). Inference calls run on qattn in either mode. One setting for the process, as
set_precision's, so that a model patched through SDPA needs no change of its own code.

Why "sdpa": SageBwd is slower than cuDNN's BF16 backward on Hopper today (README,
Training), so a process that fine-tunes and also runs inference can keep qattn's
inference speed and cuDNN's training speed with one patch of
torch.nn.functional.scaled_dot_product_attention. qattn.attention, called directly,
trains with SageBwd whatever this mode."""
from ._setting import Setting

_setting = Setting("QATTN_TRAINING", ("sagebwd", "sdpa"))


def set_training(mode: str) -> str:
    """Where the SDPA drop-in runs training calls (an input that requires grad, with grad
    mode on): "sagebwd" (qattn's training forward and INT8 backward, the default) or
    "sdpa" (PyTorch's SDPA, forward and backward). The environment variable
    QATTN_TRAINING sets the mode at import. Under torch.compile the mode is read at trace
    time (a new mode compiles the graph again). Returns the previous mode, so that a
    caller can restore it."""
    return _setting.set(mode)


def get_training() -> str:
    """The current training mode of the SDPA drop-in ("sagebwd" or "sdpa")."""
    return _setting.value
