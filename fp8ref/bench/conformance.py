"""The conformance suite's throughput: examples per second of ``fp8ref.conformance.check`` per backend."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["bench_conformance"]


def bench_conformance(backend_names: Sequence[str] = ("reference",), *, profile: str = "dev",
                      max_examples: int | None = None, log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Examples per second of ``fp8ref.conformance.check(backend, profile)`` for each backend.

    Each row has the examples the report ran (the sum over its contracts), ``examples_per_s`` and
    whether the backend ``passed``. Without the conformance extra (hypothesis) every row is skipped
    with that reason.
    """
    try:
        from .. import conformance
    except ImportError as exc:
        if (exc.name or "").startswith("fp8ref"):
            raise  # our own module: a bug, not a missing extra
        reason = f"fp8ref.conformance needs the conformance extra (pip install 'fp8ref[conformance]'): {exc}"
        return [{"backend": b, "skipped": reason} for b in backend_names]
    rows = []
    for bname in backend_names:
        t0 = time.perf_counter()
        try:
            report = conformance.check(bname, profile, seed=0, max_examples=max_examples)
        except Exception as exc:  # reported per backend, the others still run
            rows.append({"backend": bname, "profile": profile, "error": f"{type(exc).__name__}: {exc}"})
            continue
        dt = time.perf_counter() - t0
        n = sum(r.examples for r in report.results)
        row = {"backend": bname, "profile": profile, "seconds": dt, "examples": n,
               "examples_per_s": (n / dt) if n else None, "passed": report.passed}
        rows.append(row)
        log(f"  conformance {bname:12} {profile}: {n} examples in {dt:.2f} s")
    return rows
