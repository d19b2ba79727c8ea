"""OpLog: a dispatch mode that records the qattn ops a call dispatches, for tests of
which op a call takes and with which arguments."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Records the qattn ops a call dispatches, each with every argument by name (the
    defaults filled in)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "qattn":
            schema = func._schema.arguments
            bound = {a.name: a.default_value for a in schema}
            bound.update(zip([a.name for a in schema], args))
            bound.update(kwargs)
            self.calls.append((func.__name__.split(".")[0], bound))
        return func(*args, **kwargs)
