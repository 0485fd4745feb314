"""Calls from several threads at once (``check_threads``): each thread on values of its own, rounds
started together, the interpreter's switch interval lowered; every result against the same call
made alone.
"""

from __future__ import annotations

import sys
import threading
import time

from ....registry import Backend
from ..common import (
    ContractViolation,
    Declined,
    backend_threads,
)
from .entry import _clones, _op_of, _premise, _premise_values, _run, _same
from .tensors import _altered, _light

#: Threads that call the backend at once, and the calls each makes.
THREADS, THREAD_CALLS = 4, 8


#: The interpreter's thread switch interval while the threads run (``sys.setswitchinterval``).
SWITCH_INTERVAL_S = 1e-6


class _SpinBarrier:
    """Rounds that start together: a thread that has arrived keeps running (yielding the GIL) until
    all have, instead of sleeping in a futex -- a sleeping thread wakes late on a loaded machine,
    after the first one has finished its call, and the calls no longer overlap."""

    def __init__(self, parties: int) -> None:
        self.parties, self.arrived, self.broken = parties, 0, False
        self._lock = threading.Lock()

    def wait(self, round_: int, timeout_s: float = 60.0) -> None:
        with self._lock:
            self.arrived += 1
        deadline = time.monotonic() + timeout_s
        while self.arrived < self.parties * (round_ + 1):
            if self.broken or time.monotonic() > deadline:
                raise threading.BrokenBarrierError
            time.sleep(0)


def check_threads(backend: Backend, p) -> float:
    """``THREADS`` threads make ``THREAD_CALLS`` rounds of calls, every round started together (a
    barrier), each thread on values of its own (the problem's, altered ``i`` times); each result
    must have the bits of that call made alone, or else lie within the op's bound of the spec on
    its own arguments (a BLAS whose summation order follows the threads free at the call)."""
    op = _op_of(p)
    args = _premise(backend, op)
    variants = [args]
    for _ in range(THREADS - 1):
        variants.append({k: _altered(v, k) for k, v in variants[-1].items()})
    alone = []
    for v in variants:
        try:
            _premise_values(op, v)
            alone.append(_run(backend, op, _clones(v)))
        except (Declined, ValueError):
            alone.append(None)
    if all(a is None for a in alone):
        raise Declined("premise: no variant of the problem runs alone")
    barrier = _SpinBarrier(sum(a is not None for a in alone))
    results: dict[int, list] = {i: [] for i in range(THREADS)}

    rounds = 2 if _light(backend) else THREAD_CALLS

    def work(i):
        mine = [_clones(variants[i]) for _ in range(rounds)]
        for r in range(rounds):
            try:
                barrier.wait(r)  # every round starts together: the calls overlap
                results[i].append(op.call(backend, mine[r]))
            except threading.BrokenBarrierError:
                return
            except BaseException as exc:  # noqa: BLE001 -- reported below, in the calling thread
                results[i].append(exc)
                barrier.broken = True
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS) if alone[i] is not None]
    # The interpreter hands the GIL over every microsecond instead of every five milliseconds, so
    # that Python-level steps of the threads interleave finely (a race shows in a few calls).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with backend_threads():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
    worst = 0.0
    for i in range(THREADS):
        for j, r in enumerate(results[i]):
            if isinstance(r, BaseException):
                raise ContractViolation(f"thread {i} (of {len(threads)} calling at once), call {j + 1}: "
                                        f"{type(r).__name__}: {r} (the same call alone succeeds)")
            diff = _same(r, alone[i])
            if diff is None:
                continue
            # Other bits are not yet a defect: a BLAS picks its blocking, and so its summation order,
            # from the threads free when it is called, which other callers change. Wrong values are:
            # the result is judged against the spec on its own arguments, with the op's bound.
            try:
                worst = max(worst, op.spec(backend, variants[i], r))
            except ContractViolation as exc:
                raise ContractViolation(f"thread {i} (of {len(threads)} calling at once), call {j + 1} differs from "
                                        f"the same call made alone ({diff}) and from the spec: {exc} -- state "
                                        "shared between calls") from None
    return worst
