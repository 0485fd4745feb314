"""Progress for fp8ref's long steps (selection, certification, audits, benchmarks).

On a terminal, a tqdm bar (imported when a bar is made) shows what is happening and, from the
rate so far, how long is left; it appears only once a step has lasted ``DELAY_S`` seconds, so
quick calls stay clean, and is removed when the step ends (``leave=False``), so the results
printed afterwards are not interleaved with it. When stderr is not a terminal (a log file, a CI
job), a plain line ``desc: n/total, elapsed, left`` is written every ``LINE_EVERY_S`` seconds
instead, so a long run in a log shows it is alive. ``FP8REF_PROGRESS=0`` turns both off,
``FP8REF_PROGRESS=1`` shows the bar on any stream.

``oversubscribed`` says when the machine has more runnable work than cores (the load average
above the CPU count): timings then measure the other work too, and long steps take longer.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["ENV_VAR", "DELAY_S", "LINE_EVERY_S", "progress", "oversubscribed"]

ENV_VAR = "FP8REF_PROGRESS"
#: Seconds a step runs before its bar appears.
DELAY_S = 2.0
#: Seconds between two progress lines when stderr is not a terminal.
LINE_EVERY_S = 30.0


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


class _Lines(_Quiet):
    """Progress as a plain line every ``LINE_EVERY_S`` seconds (stderr is not a terminal)."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str):
        super().__init__(iterable, total)
        self.desc, self.unit, self.postfix = desc, unit, ""
        self.start = self.last = time.monotonic()
        if self.total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)

    def __iter__(self):
        for item in super().__iter__():
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_EVERY_S:
            self.last = now
            print(self.line(now), file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def line(self, now: float) -> str:
        elapsed = now - self.start
        done = f"{self.n}/{self.total}" if self.total else str(self.n)
        left = ""
        if self.total and self.n:
            left = f", about {elapsed / self.n * (self.total - self.n):.0f} s left"
        post = f" ({self.postfix})" if self.postfix else ""
        return f"{self.desc}: {done} {self.unit}{post}, {elapsed:.0f} s{left}"


def oversubscribed() -> str | None:
    """A warning when the 1-minute load average exceeds the CPU count, else None.

    Examples
    --------
    >>> from fp8ref._progress import oversubscribed
    >>> oversubscribed() is None or "load average" in oversubscribed()
    True
    """
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cpus:
        return None
    return (f"warning: this machine is oversubscribed (load average {load:.1f} on {cpus} CPUs): timings include "
            "the other work and long steps take longer; run when it is quiet, or with --threads 1 where offered")


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
    from ._env import get  # a helper beside this one: imported when a bar is made

    setting = get(ENV_VAR)
    if setting is False:
        return _Quiet(iterable, total)
    if setting is None and not _isatty(sys.stderr):
        return _Lines(iterable, total, desc, unit)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # installed without its dependencies (--no-deps): work on, silently
        return _Quiet(iterable, total)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, delay=DELAY_S, file=sys.stderr,
                disable=False if setting else None, dynamic_ncols=True)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False
