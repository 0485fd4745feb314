"""Selector benchmarks: dispatch overhead of ``fp8ref.linear(backend="auto")`` after warm-up, the
per-call cost of ``weight_check="content"``, and the time of a first selection for a new shape
bucket.

Run: ``python benchmarks/bench_select.py [--quick]`` (prints a table), or under pytest-benchmark
(``pytest benchmarks/bench_select.py --benchmark-enable``).

The overhead is measured with a *null* backend whose quantize and scaled_mm return precomputed
results: what remains is exactly fp8ref's dispatch (weight-cache and dispatch lookups), compared
with calling the same two methods directly. Timings on a shared machine are noisy: the minimum
over repeats is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import fp8ref
from fp8ref import select as sel
from fp8ref.api import linear


class NullBackend(fp8ref.Backend):
    """The reference, except that for the benchmark's own input it returns precomputed results:
    it passes the compliance probe, and the timed loop measures dispatch, not arithmetic."""

    name = "bench-null"
    accumulation = fp8ref.Accumulation.EXACT
    #: true: any other input goes to the reference, which raises for NaN/Inf (the probe checks it);
    #: so the timed loop measures what fp8ref.linear adds for the shipped backends, which declare it.
    rejects_non_finite = True

    def __init__(self):
        self.x = self.q = self.y = None

    def quantize(self, x, scheme):
        return self.q if x is self.x else fp8ref.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return self.y if a is self.q else fp8ref.scaled_mm(a, b, bias, out_dtype)


#: The clock of ``_best_per_call``: wall time, or with ``--cpu-time`` this thread's CPU time, which
#: other processes' load does not inflate (the loops run on one thread: OMP_NUM_THREADS=1).
_clock = time.perf_counter


def _best_per_call(f, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = _clock()
        for _ in range(n):
            f()
        best = min(best, (_clock() - t0) / n)
    return best


def dispatch_overhead(M: int = 1, N: int = 256, K: int = 256, n: int = 2000, repeats: int = 7) -> dict:
    """Per-call time of ``linear(x, w)`` under "auto" minus calling the chosen backend directly."""
    null = NullBackend()
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    null.x, null.q = x, fp8ref.quantize(x, fp8ref.W8A8_FP8.activation)
    null.y = fp8ref.scaled_mm(null.q, fp8ref.quantize(w, fp8ref.W8A8_FP8.weight))
    fp8ref.register_backend(null, replace=True)
    try:
        # Only the null backend and the reference compete (the reference is never timed, so the
        # null backend wins deterministically).
        os.environ[sel.ENV_CANDIDATES] = null.name
        prep = null.prepare_weight(fp8ref.quantize(w, fp8ref.W8A8_FP8.weight))
        act = fp8ref.W8A8_FP8.activation

        def direct():
            return null.scaled_mm(null.quantize(x, act), prep, None, torch.bfloat16)

        def auto():
            return linear(x, w)

        linear(x, w)  # selection + weight quantization happen here, once
        chosen = sel.resolve(fp8ref.Case(M=M, N=N, K=K, recipe=fp8ref.W8A8_FP8))[0].name
        t_direct = _best_per_call(direct, n, repeats)
        t_auto = _best_per_call(auto, n, repeats)
        return {"chosen": chosen, "direct_us": t_direct * 1e6, "auto_us": t_auto * 1e6,
                "overhead_us": (t_auto - t_direct) * 1e6}
    finally:
        os.environ.pop(sel.ENV_CANDIDATES, None)
        fp8ref.unregister_backend(null.name)
        sel.clear_cache()


def weight_check_cost(N: int, K: int, M: int = 1, backend: str = "cpu-fp8", n: int = 20, repeats: int = 5) -> dict:
    """Per-call time of ``linear(x, w, backend=backend)`` under ``weight_check="version"`` and
    ``"content"`` (the bytes of the weight compared with a kept copy on every call), for a bf16
    float weight and for a ``Quantized`` one (what ``Fp8Linear`` passes: 1-byte codes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g, dtype=torch.bfloat16)
    wf = torch.randn(N, K, generator=g, dtype=torch.bfloat16)
    wq = fp8ref.quantize(wf, fp8ref.W8A8_FP8.weight)
    out = {}
    for kind, w in (("bf16", wf), ("fp8", wq)):
        for mode in ("version", "content"):
            linear(x, w, backend=backend, weight_check=mode)  # quantize/prepare (and keep the copy) once
            out[f"{kind}_{mode}_us"] = _best_per_call(lambda w=w, mode=mode: linear(x, w, backend=backend,
                                                                                      weight_check=mode),
                                                      n, repeats) * 1e6
    return out


def first_selection(M: int, N: int, K: int) -> tuple[float, sel.Decision]:
    """Wall time of a selection for a new bucket (probe + timing, nothing cached)."""
    sel.clear_cache()
    t0 = time.perf_counter()
    d = sel.select(fp8ref.Case(M=M, N=N, K=K, recipe=fp8ref.W8A8_FP8), refresh=True)
    return time.perf_counter() - t0, d


def rounding_cost(seed: int = 0) -> dict:
    """The numbers behind the default precision class: the FP8 quantization error of a W8A8
    linear against one and two bf16 roundings of the reference's result (64 x 1024 x 512)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 1024, generator=g).bfloat16()
    w = (torch.randn(512, 1024, generator=g) / 32).bfloat16()
    qx, qw = fp8ref.quantize(x, fp8ref.W8A8_FP8.activation), fp8ref.quantize(w, fp8ref.W8A8_FP8.weight)
    y64 = fp8ref.scaled_mm(qx, qw, out_dtype=torch.float64)
    one = fp8ref.scaled_mm(qx, qw, out_dtype=torch.bfloat16).double()
    # two roundings, as the cpu-bf16 path: the exact accumulator rounded to bf16, scaled in fp32
    acc = qx.data.double() @ qw.data.double().T
    two = (acc.bfloat16().float() * qx.scale.float() * qw.scale.float().T).bfloat16().double()
    y_true = x.double() @ w.double().T

    def rel_l2(a, b):
        return float((a - b).norm() / b.norm())

    def mean_rel(a):
        return float(((a - y64).abs() / y64.abs()).mean())

    return {"quantization_rel_l2": rel_l2(y64, y_true), "one_rounding_rel_l2": rel_l2(one, y64),
            "two_roundings_rel_l2": rel_l2(two, y64), "one_rounding_mean_rel": mean_rel(one),
            "two_roundings_mean_rel": mean_rel(two)}


def test_dispatch_overhead(benchmark):
    res = benchmark.pedantic(dispatch_overhead, rounds=1, iterations=1)
    assert res["chosen"] == "bench-null"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time per-call loops in this thread's CPU time (a loaded shared machine; OMP_NUM_THREADS=1)")
    args = ap.parse_args(argv)
    global _clock
    if args.cpu_time:
        _clock = time.thread_time
    os.environ.setdefault(sel.ENV_CACHE_DIR, tempfile.mkdtemp(prefix="fp8ref-bench-"))
    rc = rounding_cost()
    print("precision: " + ", ".join(f"{k} {v:.2e}" for k, v in rc.items()))
    res = dispatch_overhead()
    print(f"dispatch: chosen={res['chosen']}  direct {res['direct_us']:.2f} us  auto {res['auto_us']:.2f} us  "
          f"overhead {res['overhead_us']:.2f} us per call")
    for N, K in [(256, 256), (1024, 1024)] if args.quick else [(256, 256), (1024, 4096), (4096, 4096)]:
        c = weight_check_cost(N, K)
        print(f"weight_check at M=1 N={N} K={K} (cpu-fp8): " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()))
    shapes = [(16, 512, 256)] if args.quick else [(1, 4096, 4096), (16, 4096, 4096), (128, 14336, 4096),
                                                  (1024, 4096, 14336)]
    for M, N, K in shapes:
        secs, d = first_selection(M, N, K)
        print(f"first selection M={M} N={N} K={K}: {secs:.2f} s, chosen {d.chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
