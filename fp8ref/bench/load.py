"""Whether a run's ratios are results: the load average against the threads the run used.

A ratio taken while other processes compete for the CPUs measures the competition as much as the
code: with a load average above the thread count, some of the run's threads waited for a CPU.
``fp8ref bench`` still prints such ratios, marked unreliable, and records why in its JSON
(``meta["unreliable"]``); docs/performance.md quotes only runs without the mark.
"""

from __future__ import annotations

__all__ = ["unreliable_reason", "mark"]


def unreliable_reason(meta: dict) -> str | None:
    """Why the ratios of a run whose ``machine_meta`` is ``meta`` are not results, or None.

    The highest one-minute load average recorded (at the start and at the end) is compared with
    the run's thread count (``torch_threads``).

    Examples
    --------
    >>> from fp8ref.bench.load import unreliable_reason
    >>> unreliable_reason({"torch_threads": 2, "loadavg_start": [1.1, 0, 0]}) is None
    True
    >>> unreliable_reason({"torch_threads": 2, "loadavg_start": [1.1, 0, 0], "loadavg_end": [9.5, 0, 0]})
    'load average 9.50 > 2 threads: other work shared the CPUs, so these ratios are not results'
    """
    loads = [meta[k][0] for k in ("loadavg_start", "loadavg_end") if meta.get(k)]
    threads = meta.get("torch_threads")
    if not loads or not threads or max(loads) <= threads:
        return None
    return (f"load average {max(loads):.2f} > {threads} threads: other work shared the CPUs, so these ratios are "
            "not results")


def mark(meta: dict) -> str:
    """The suffix a ratio of this run gets in a table: ``""``, or ``"?"`` when it is unreliable."""
    return "?" if unreliable_reason(meta) else ""
