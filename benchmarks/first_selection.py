"""First-selection time per Llama-3.1-8B shape and M bucket (probe + timing + run-off, caches empty).

    PYTHONPATH=. python benchmarks/first_selection.py

Prints one line per shape; each ``select(..., refresh=True)`` probes and times every candidate anew,
into a throw-away cache directory. The target (issue 3) is <= 2 s per new shape bucket.
"""

import os
import tempfile
import time

os.environ.setdefault("FP8REF_CACHE_DIR", tempfile.mkdtemp(prefix="fp8ref-first-selection-"))

import fp8ref  # noqa: E402
from fp8ref import bench  # noqa: E402
from fp8ref import select as sel  # noqa: E402
from fp8ref.kernels import native  # noqa: E402


def main() -> None:
    native.get()  # load the extension once, outside the timings
    for K, N in bench.LLAMA3_8B_SHAPES:
        cells = []
        for M in (1, 16, 128, 1024):
            case = fp8ref.Case(M, N, K, fp8ref.W8A8_FP8)
            t0 = time.perf_counter()
            d = sel.select(case, refresh=True)
            cells.append(f"M={M}: {time.perf_counter() - t0:.2f} s ({d.chosen})")
        print(f"K={K} N={N}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
