"""Errors of the qattn Python layer: every failure of the C library arrives as a
QattnError carrying the library's status and its message (which names the parameter
and the allowed values)."""

from __future__ import annotations

from . import _C

_STATUS_NAMES = {
    _C.OK: "QATTN_OK",
    _C.ERROR_INVALID_ARGUMENT: "QATTN_ERROR_INVALID_ARGUMENT",
    _C.ERROR_UNSUPPORTED: "QATTN_ERROR_UNSUPPORTED",
    _C.ERROR_NO_DEVICE: "QATTN_ERROR_NO_DEVICE",
    _C.ERROR_WORKSPACE_TOO_SMALL: "QATTN_ERROR_WORKSPACE_TOO_SMALL",
    _C.ERROR_CUDA: "QATTN_ERROR_CUDA",
    _C.ERROR_INTERNAL: "QATTN_ERROR_INTERNAL",
}


class QattnError(RuntimeError):
    """A call was refused or failed. `status` is the qattn_status code (an int) and
    `status_name` its name; str(error) is the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.status_name = _STATUS_NAMES.get(status, "QATTN_ERROR_UNKNOWN")


class QattnBackwardNotImplemented(NotImplementedError):
    """Kept for code that catches it: qattn.attention had no backward pass before
    SageBwd. qattn no longer raises it."""


def invalid(message: str) -> QattnError:
    return QattnError(_C.ERROR_INVALID_ARGUMENT, message)


def check(status: int) -> None:
    """Raises the QattnError for a non-OK status of the call that just returned on this
    thread (the message is per thread in the C library)."""
    if status != _C.OK:
        raise QattnError(status, _C.last_error_message())


class QattnUnsupportedError(QattnError, NotImplementedError):
    """Raised by qattn.scaled_dot_product_attention in the "raise" fallback mode when
    qattn cannot run a valid call (qattn.set_fallback). `reason` names the kind of
    call ("attn_mask", "dropout_p", "dtype", ...); str(error) says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(_C.ERROR_UNSUPPORTED, message)
        self.reason = reason


class QattnFallbackWarning(UserWarning):
    """Issued (once per reason) when qattn.scaled_dot_product_attention hands a call to
    torch.nn.functional.scaled_dot_product_attention. Filter it with the warnings
    module, or make it an error with qattn.set_fallback("raise")."""
