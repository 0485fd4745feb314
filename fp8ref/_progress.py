"""Progress bars for fp8ref's long steps (selection, certification): tqdm, imported when a bar is made.

A bar shows what is happening and, from the rate so far, how long is left. It appears only on a
terminal (tqdm's ``disable=None``) and only once a step has lasted ``DELAY_S`` seconds, so quick
calls and captured logs stay clean; it is removed when the step ends (``leave=False``), so the
results printed afterwards are not interleaved with it. ``FP8REF_PROGRESS=0`` turns bars off,
``FP8REF_PROGRESS=1`` shows them on any stream (a CI log, say).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["ENV_VAR", "DELAY_S", "progress"]

ENV_VAR = "FP8REF_PROGRESS"
#: Seconds a step runs before its bar appears.
DELAY_S = 2.0

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


class _Quiet:
    """What ``progress`` returns when bars are off or tqdm is missing: the same calls, no output."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None):
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "it",
             leave: bool = False) -> Any:
    """A tqdm bar over ``iterable`` (or updated by hand up to ``total``), or a silent stand-in.

    Examples
    --------
    >>> from fp8ref._progress import progress
    >>> with progress(total=3, desc="probing", unit="backend") as bar:
    ...     for name in ("a", "b", "c"):
    ...         bar.set_postfix_str(name)
    ...         bar.update(1)
    """
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in _OFF:
        return _Quiet(iterable, total)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # installed without its dependencies (--no-deps): work on, silently
        return _Quiet(iterable, total)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, delay=DELAY_S, file=sys.stderr,
                disable=False if setting in _ON else None, dynamic_ncols=True)
