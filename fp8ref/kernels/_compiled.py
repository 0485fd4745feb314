"""The ``torch.compile``'d pieces of the wide CPU backends (``cpu-bf16``, ``cpu-fp32``), made lazily.

``FP8REF_COMPILE=1`` (or ``CpuWideBackend(compile=True)``) asks for them: the activation
quantization, the widening of codes and the epilogue, each compiled on first use and cached per
process. Any compile or run failure falls back to the eager code for good, with one warning.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _env

__all__ = ["COMPILED", "compile_enabled"]


def compile_enabled() -> bool:
    """Whether ``FP8REF_COMPILE`` asks for the torch.compile'd paths (default: off)."""
    return _env.get("FP8REF_COMPILE")


class Compiled:
    """torch.compile'd versions of the two fused pieces, made on first use; eager on failure."""

    def __init__(self) -> None:
        self._fns: dict[str, Callable] = {}
        self._broken = False
        self._lock = threading.Lock()

    def get(self, key: str, fn: Callable) -> Callable:
        if self._broken:
            return fn
        with self._lock:
            if key not in self._fns:
                try:
                    self._fns[key] = torch.compile(fn, dynamic=True)
                except Exception as exc:  # no compiler, unsupported platform: eager for good
                    self._fail(exc)
                    return fn
            return self._fns[key]

    def run(self, key: str, fn: Callable, *args: Any) -> Any:
        compiled = self.get(key, fn)
        if compiled is fn:
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as exc:  # a compile error surfaces on the first call
            self._fail(exc)
            return fn(*args)

    def _fail(self, exc: Exception) -> None:
        if not self._broken:
            warnings.warn(f"fp8ref cpu backends: torch.compile failed ({exc!r}); using eager code", stacklevel=3)
        self._broken = True


#: The process's compiled pieces (one per key).
COMPILED = Compiled()
