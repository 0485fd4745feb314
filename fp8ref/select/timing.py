"""Timing the compliant candidates: median of several warm calls, then a run-off.

Each candidate is timed at min(bucket, TIME_M_CAP) rows on a synthetic weight of the full N x K,
after one warm-up, within a budget; one that cannot win (estimated from its probe calls) is not
timed. The close contenders are then re-timed together in interleaved rounds (``runoff``), so a
burst of load from another process hits them alike. ``clock`` is the selector's only clock
(tests replace it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..registry import Backend, Case, bound_call
from ..spec.quant import Quantized, quantize
from ..spec.schemes import QuantScheme
from .decision import Row
from .keys import m_bucket

__all__ = ["TIME_M_CAP", "TIME_BUDGET_S", "TIME_MAX_RUNS", "SKIP_FACTOR", "RUNOFF_FACTOR", "RUNOFF_MIN_ROUNDS",
           "RUNOFF_BUDGET_S", "clock", "sync", "synthetic_weight", "warm_call", "timer", "time_backend", "runoff"]

#: Timing uses min(bucket, TIME_M_CAP) rows and the full N, K. 128 until 2026-12-02, when a backend
#: that tied bf16 ``F.linear`` at 128 rows was chosen for the 1024 bucket from that timing, where it
#: was slower than ``cpu-bf16`` (docs/performance.md, "Figures behind the code"): how backends rank
#: changes with M beyond 128, so the bucket is timed at its own size up to 1024.
TIME_M_CAP = 1024
#: Per-candidate timing budget in seconds (after the warm-up); at least one timed run.
TIME_BUDGET_S = 0.15
TIME_MAX_RUNS = 7
#: A candidate whose estimated time (from the probe's calls) exceeds this many times the best
#: measured median is not timed: it cannot win.
SKIP_FACTOR = 10.0
#: Contenders whose sequential median is within this factor of the best are re-timed together in
#: interleaved rounds (``runoff``), at least RUNOFF_MIN_ROUNDS, within RUNOFF_BUDGET_S.
RUNOFF_FACTOR = 2.5
RUNOFF_MIN_ROUNDS = 3
RUNOFF_BUDGET_S = 0.4


def clock() -> float:
    """Seconds, for every duration the selector measures (the probe's warm call, the timings)."""
    return time.perf_counter()


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a timing covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


_TIMING_WEIGHT: dict[tuple, Quantized] = {}


def synthetic_weight(case: Case) -> Quantized:
    """A random [N, K] weight whose codes look like a real one's: 64 rows of a Gaussian quantized
    per row in the scheme's format, tiled over N (cheap at any size), with random scales.

    The codes' distribution matters to a kernel that decodes them: ``cpu-fp8`` takes a slower path
    for a 32-code group that holds a zero or subnormal magnitude. Uniform random codes put one in
    87 % of the groups, real and Gaussian weights in 0.3-2 % (docs/backends.md); timed on uniform
    codes ``cpu-fp8`` lost to ``cpu-bf16`` at M = 64 where on Gaussian weights it was the faster
    of the two (docs/performance.md, "Figures behind the code")."""
    scheme = case.recipe.weight
    key = (case.N, case.K, scheme, case.device)
    q = _TIMING_WEIGHT.get(key)
    if q is None:
        gen = torch.Generator().manual_seed(1)
        rows = min(case.N, 64)
        g = torch.randn(rows, case.K, generator=gen)
        block = quantize(g, QuantScheme(format=scheme.format)).data.view(torch.uint8)
        codes = block.repeat(-(-case.N // rows), 1)[:case.N].contiguous()
        shape = scheme.scale_shape(case.N, case.K)
        scale = (torch.rand(shape, generator=gen) * 1e-3 + 1e-3).to(scheme.scale_dtype)
        q = Quantized(codes.view(scheme.format.torch_dtype).to(case.device), scale.to(case.device), scheme)
        _TIMING_WEIGHT.clear()  # keep one: a 14336 x 4096 weight is 59 MB
        _TIMING_WEIGHT[key] = q
    return q


def warm_call(backend: Backend, prepared, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
              scheme: QuantScheme) -> Callable[[], object]:
    """The call a plan's warm path makes for these operands, as a function of nothing: the
    backend's bound call where it binds one (``Backend.bind_linear``), else ``Backend.linear``; a
    bound call that hands the case back is followed by the ``linear`` call that then runs, as a
    plan's would be. What the selector times (``timer``, and the probe's estimate)."""
    fast = bound_call(backend, prepared, scheme, out_dtype)
    if fast is None:
        return lambda: backend.linear(x, prepared, bias, out_dtype, scheme)

    def call():
        y = fast(x, bias)
        return backend.linear(x, prepared, bias, out_dtype, scheme) if y is None else y

    return call


def timer(backend: Backend, case: Case) -> Callable[[], float]:
    """A function timing one warm call (``warm_call``) at min(bucket, TIME_M_CAP) rows, in seconds."""
    mt = min(m_bucket(case.M), TIME_M_CAP)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(mt, case.K, generator=gen).to(case.x_dtype).to(case.device)
    bias = torch.randn(case.N, generator=gen).to(case.x_dtype).to(case.device) if case.has_bias else None
    prepared = backend.prepare_weight(synthetic_weight(case))
    call, dev = warm_call(backend, prepared, x, bias, case.out_dtype, case.recipe.activation), case.device

    def once() -> float:
        sync(dev)
        t0 = clock()
        call()
        sync(dev)
        return clock() - t0

    return once


def time_backend(backend: Backend, case: Case, best: float | None,
          timers: dict[str, Callable[[], float]] | None = None) -> tuple[float, int, str]:
    """Median seconds of a warm call (``timer``) at min(bucket, TIME_M_CAP) rows, after one warm-up.
    ``timers`` keeps the prepared timer per backend name for the run-off."""
    once = timer(backend, case)
    if timers is not None:
        timers[backend.name] = once
    once()  # warm-up: compilation, autotuning, first-touch of buffers
    times = [once()]
    if best is not None and times[0] > 3 * best:
        return times[0], 1, "one run: > 3x the best median"
    n = int(max(1, min(TIME_MAX_RUNS, TIME_BUDGET_S / max(times[0], 1e-9))))
    times += [once() for _ in range(n - 1)]
    return statistics.median(times), len(times), ""


def runoff(rows: list[tuple[Backend, Row]], case: Case,
            timers: dict[str, Callable[[], float]] | None = None) -> None:
    """Re-time the close contenders in interleaved rounds (A, B, C, B, C, A, ...) and keep those
    medians: a burst of load from another process then hits every contender alike, instead of
    deciding the ranking by landing in one backend's timing window (a decision is cached on disk,
    so a wrong one would last)."""
    known = timers or {}
    timers = [(row, known.get(b.name) or timer(b, case)) for b, row in rows]
    for (b, _), (_, once) in zip(rows, timers, strict=True):
        if b.name not in known:
            once()  # warm-up: a fresh timer (the sequential ones are warm, and their weights prepared)
    per_round = sum(row.median_s or 0.0 for row, _ in timers)
    rounds = int(max(RUNOFF_MIN_ROUNDS, min(TIME_MAX_RUNS, RUNOFF_BUDGET_S / max(per_round, 1e-9))))
    times: dict[int, list[float]] = {i: [] for i in range(len(timers))}
    for r in range(rounds):
        for j in range(len(timers)):
            i = (j + r) % len(timers)  # rotate who goes first
            times[i].append(timers[i][1]())
    for i, (row, _) in enumerate(timers):
        row.median_s = statistics.median(times[i])
        row.runs += rounds
        row.note = (row.note + "; " if row.note else "") + f"run-off: {rounds} interleaved rounds"
