"""A process-wide setting of the PyTorch layer (the fallback policy, the precision mode,
where training calls run): one of a fixed set of names, read from an environment
variable at import, set and read under a lock. One mechanism for all of them, so each
checks, names its allowed values and restores the same way."""
import os
import threading


class Setting:
    def __init__(self, env: str, modes: tuple):
        self.env, self.modes = env, modes
        self._lock = threading.Lock()
        self.value = self.check(os.environ.get(env) or modes[0], env)

    def check(self, mode, what: str) -> str:
        """`mode` if it is one of the allowed names, else a ValueError that lists them
        (the first is the default)."""
        if mode not in self.modes:
            names = [f"'{m}'" for m in self.modes]
            names[0] += " (the default)"
            allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
            raise ValueError(f"{what} = {mode!r}; allowed: {allowed}")
        return mode

    def set(self, mode) -> str:
        """Sets `mode` (checked) and returns the previous one, so that a caller can restore it."""
        self.check(mode, "mode")
        with self._lock:
            previous, self.value = self.value, mode
        return previous
