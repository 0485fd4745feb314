"""The floating-point environment fp8ref computes in: IEEE gradual underflow, whatever the caller set.

``torch.set_flush_denormal(True)`` (on x86: MXCSR's flush-to-zero and denormals-are-zero bits, on
the calling thread) makes that thread's SSE/AVX arithmetic return 0 for a subnormal result and read
a subnormal input as 0. Serving stacks set it for speed. fp8ref's numbers are defined without it
(docs/spec.md, "The floating-point environment"): the reference quantizer and GEMM, ``fp8ref.linear``
and fp8ref's own backends compute as if nothing were flushed, and give the caller's thread back its
setting. Left to the environment, the reference rounded a subnormal bf16 or fp32 output to 0 on the
calling thread only, so the same call gave different bits depending on which thread ran a chunk.

``flushing()`` costs one Python float multiplication, so the hot paths check it first and
pay for ``torch.set_flush_denormal`` only when the caller flushes.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import TypeVar

import torch

# 3 * 2**-1074 (a subnormal double) from its bits, never from arithmetic: a module imported while
# the environment flushes would otherwise hold 0 here.
_TINY = struct.unpack("<d", struct.pack("<Q", 3))[0]
_HALF = 0.5

F = TypeVar("F", bound=Callable)


def flushing() -> bool:
    """True where the calling thread's float arithmetic flushes subnormals (FTZ or DAZ).

    ``_TINY * 0.5`` is 1.5 * 2**-1074, inexact and subnormal: IEEE rounds it to 2 * 2**-1074;
    flush-to-zero returns 0, and denormals-are-zero reads ``_TINY`` as 0. CPython multiplies floats
    with the same SSE unit (and MXCSR) as torch's CPU kernels on x86-64.

    Examples
    --------
    >>> from fp8ref.spec.fenv import flushing
    >>> flushing()
    False
    """
    return _TINY * _HALF == 0.0


class ieee_subnormals:
    """Context manager: subnormals kept on this thread inside, the caller's flushing restored after.

    When the thread does not flush (the usual case) it does nothing. When it does, it calls
    ``torch.set_flush_denormal(False)`` and, on exit, ``torch.set_flush_denormal(True)``, which sets
    both FTZ and DAZ (as ``torch.set_flush_denormal`` does; a caller that had set only one of them by
    other means gets both back). fp8ref's C++ kernels save and restore the exact MXCSR themselves.
    Where the flushing cannot be cleared (torch cannot set it on this CPU, and something else did),
    it raises ``RuntimeError`` rather than let fp8ref compute other numbers.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.fenv import flushing, ieee_subnormals
    >>> x = torch.tensor([2.0**-140])
    >>> if torch.set_flush_denormal(True):
    ...     with ieee_subnormals():
    ...         kept = float(x * 1.0)
    ...     after = flushing()
    ...     _ = torch.set_flush_denormal(False)
    ... else:  # a CPU that cannot flush
    ...     kept, after = float(x), True
    >>> kept == 2.0**-140, after
    (True, True)
    """

    __slots__ = ("_was",)

    def __enter__(self) -> ieee_subnormals:
        self._was = flushing()
        if self._was:
            torch.set_flush_denormal(False)
            if flushing():  # e.g. flushing set by other means on a CPU torch cannot unset it on
                raise RuntimeError("this thread flushes subnormal floats to zero and torch.set_flush_denormal(False) "
                                   "did not stop it: fp8ref's numbers keep subnormals (docs/spec.md, 'The "
                                   "floating-point environment'); clear the flush-to-zero setting before "
                                   "calling fp8ref")
        return self

    def __exit__(self, *exc) -> None:
        if self._was:
            torch.set_flush_denormal(True)


def ieee(fn: F) -> F:
    """Decorator: ``fn`` runs inside ``ieee_subnormals()`` when the calling thread flushes (fp8ref's
    backends use it through ``kernels._common.ieee_methods``; a third-party backend may too)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not flushing():
            return fn(*args, **kwargs)
        with ieee_subnormals():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
