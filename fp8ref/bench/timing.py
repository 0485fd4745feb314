"""Timing for the benchmarks: ``timeit`` (median of samples after a warm-up, CUDA-synchronized),
plus what every section shares: input rotation past the GPU's L2, a run's deadline."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..select import ENV_CACHE_DIR, clear_cache

__all__ = ["Timing", "Paired", "timeit", "paired", "is_cuda", "synchronizer", "rotation", "cycler", "past",
           "PAST_DEADLINE", "throwaway_selector_cache"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call of a timed function.

    Attributes
    ----------
    median_s, min_s : float
        Median and minimum over the samples, per call.
    samples : int
        Number of timed samples (each of ``inner`` back-to-back calls).
    inner : int
        Calls per sample, chosen so that one sample lasts at least ``min_sample_s`` (short calls
        are otherwise dominated by the timer and, on a GPU, by launch gaps).
    first_s : float
        Seconds of the first (warm-up) call: compilation, allocation and cache effects.
    """

    median_s: float
    min_s: float
    samples: int
    inner: int
    first_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    if is_cuda(device):
        return torch.cuda.synchronize
    return lambda: None


def timeit(fn: Callable[[], Any], *, device: str | torch.device = "cpu", warmup: int = 1, repeat: int = 5,
           budget_s: float = 2.0, min_sample_s: float | None = None) -> Timing:
    """Median seconds per call of ``fn()`` after warm-up, synchronizing CUDA around each sample.

    Parameters
    ----------
    fn : callable
        Called with no arguments.
    device : str or torch.device
        Where ``fn`` runs; on CUDA every sample ends with ``torch.cuda.synchronize()``.
    warmup : int
        Untimed calls first (at least 1; the first call's time is reported as ``first_s``).
    repeat : int
        Samples to take (at least 1).
    budget_s : float
        Stop taking samples once this many seconds have passed (at least one is always taken),
        so that a slow backend costs a bounded time.
    min_sample_s : float, optional
        Smallest duration of one sample; shorter calls are repeated ``inner`` times per sample.
        Default 1 ms on CUDA, 5 ms on CPU.

    Returns
    -------
    Timing

    Examples
    --------
    >>> import torch
    >>> from fp8ref.bench import timeit
    >>> t = timeit(lambda: torch.ones(64).sum(), repeat=3)
    >>> t.samples, t.median_s > 0
    (3, True)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if warmup < 1 or repeat < 1:
        raise ValueError(f"warmup and repeat must be >= 1, got warmup={warmup}, repeat={repeat}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    sync = synchronizer(device)
    if min_sample_s is None:
        min_sample_s = 1e-3 if is_cuda(device) else 5e-3
    inner, first = _inner(fn, sync, min_sample_s, budget_s, warmup - 1)
    clock = time.perf_counter
    start = clock()
    samples: list[float] = []
    while len(samples) < repeat:
        samples.append(_sample(fn, inner, sync))
        if clock() - start > budget_s:
            break
    return Timing(statistics.median(samples), min(samples), len(samples), inner, first)


@dataclass(frozen=True)
class Paired:
    """A function timed in rounds that alternate with a baseline's samples (``paired``).

    Attributes
    ----------
    ratio : float
        Median over the rounds of baseline seconds / function seconds (> 1: the function is
        faster), each round's two samples taken back to back.
    timing, base : Timing
        The function's and the baseline's own samples (medians, minima, counts).
    rounds : int
        Rounds taken.
    """

    ratio: float
    timing: Timing
    base: Timing
    rounds: int


def _inner(fn: Callable[[], Any], sync: Callable[[], None], min_sample_s: float, budget_s: float,
           extra_warmup: int = 0) -> tuple[int, float]:
    """(calls per sample, seconds of the first call) for ``fn``: its warm-up call, ``extra_warmup``
    more, then one calibration call unless the first already lasted ``min_sample_s`` (or past the
    budget: a slow backend's calibration would cost as much as a sample)."""
    clock = time.perf_counter
    sync()
    t0 = clock()
    fn()
    sync()
    first = clock() - t0
    for _ in range(extra_warmup):
        fn()
    if first > budget_s or first >= min_sample_s:
        return 1, first
    sync()
    t0 = clock()
    fn()
    sync()
    once = max(clock() - t0, 1e-9)
    return max(1, min(1000, math.ceil(min_sample_s / once))), first


def _sample(fn: Callable[[], Any], inner: int, sync: Callable[[], None]) -> float:
    """Seconds per call of ``inner`` back-to-back calls of ``fn``, synchronized."""
    sync()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - t0) / inner


def paired(base: Callable[[], Any], fn: Callable[[], Any], *, device: str | torch.device = "cpu",
           repeat: int = 5, budget_s: float = 2.0, min_sample_s: float | None = None) -> Paired:
    """``fn`` against ``base`` in alternating samples: the speed-up as the median of per-round ratios.

    On a shared machine the memory bandwidth and the clock drift over seconds (docs/performance.md,
    "Figures behind the code": the copy bandwidth nearly doubled between two runs minutes apart),
    so two medians taken one after the other carry that drift into their ratio; a round's two
    samples, taken back to back, see the same machine. Same samples as ``timeit`` (warm-up call,
    calls repeated up to ``min_sample_s``, CUDA-synchronized); rounds stop at ``repeat`` or when
    ``budget_s`` is spent (one round is always taken).

    Examples
    --------
    >>> import torch
    >>> from fp8ref.bench import paired
    >>> p = paired(lambda: torch.ones(4096).sum(), lambda: torch.ones(64).sum(), repeat=3)
    >>> p.rounds, p.ratio > 0
    (3, True)
    """
    if not (callable(base) and callable(fn)):
        raise TypeError("base and fn must be callable")
    if repeat < 1 or not budget_s > 0:
        raise ValueError(f"repeat must be >= 1 and budget_s > 0, got repeat={repeat}, budget_s={budget_s}")
    sync = synchronizer(device)
    if min_sample_s is None:
        min_sample_s = 1e-3 if is_cuda(device) else 5e-3
    inner_b, first_b = _inner(base, sync, min_sample_s, budget_s)
    inner_f, first_f = _inner(fn, sync, min_sample_s, budget_s)
    clock = time.perf_counter
    start = clock()
    tb: list[float] = []
    tf: list[float] = []
    for i in range(repeat):
        # alternate which goes first, so neither always runs on the caches the other left
        order = ((base, inner_b, tb), (fn, inner_f, tf)) if i % 2 == 0 else ((fn, inner_f, tf), (base, inner_b, tb))
        for f, inner, out in order:
            out.append(_sample(f, inner, sync))
        if clock() - start > budget_s:
            break
    ratio = statistics.median(b / f for b, f in zip(tb, tf, strict=True))
    return Paired(ratio, Timing(statistics.median(tf), min(tf), len(tf), inner_f, first_f),
                  Timing(statistics.median(tb), min(tb), len(tb), inner_b, first_b), len(tf))


def rotation(set_bytes: int, device: str) -> int:
    """How many input sets to rotate through so repeated calls do not just measure the GPU's L2."""
    if not is_cuda(device):
        return 1
    return max(1, min(8, math.ceil((256 << 20) / max(set_bytes, 1))))


PAST_DEADLINE = "skipped: the run's time budget was spent"


def past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def cycler(items: Sequence[Any]) -> Callable[[], Any]:
    state = {"i": 0}

    def nxt():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return item

    return nxt


@contextlib.contextmanager
def throwaway_selector_cache() -> Iterator[str]:
    """``FP8REF_CACHE_DIR`` pointed at a fresh temporary directory, the selector's memory cache
    cleared on the way in and out: ``auto`` decides anew, from this code on this machine, and the
    user's on-disk cache is never read or written (a decision cached by an earlier fp8ref, or
    under other load, would otherwise be what the bench times)."""
    old = os.environ.get(ENV_CACHE_DIR)
    try:
        with tempfile.TemporaryDirectory(prefix="fp8ref-bench-") as tmp:
            os.environ[ENV_CACHE_DIR] = tmp
            clear_cache(memory=True, disk=False)  # never the user's on-disk cache
            try:
                yield tmp
            finally:
                # Decisions made against the temporary cache must not outlive it in memory.
                clear_cache(memory=True, disk=False)
    finally:
        if old is None:
            os.environ.pop(ENV_CACHE_DIR, None)
        else:
            os.environ[ENV_CACHE_DIR] = old

