"""Time of a warm eager ``Fp8Linear`` call over its backend's kernel (issue 42's budget).

For each SmolLM2-135M linear shape and M in (1, 64): builds an ``Fp8Linear`` (``weight_check``
given), warms it, then times, alternating in rounds, ``layer(x)`` and the kernel alone: the plan's
bound call (``Backend.bind_linear``: cpu-fp8's single call into its extension) where the backend
binds one, else its ``linear(x2, prepared, bias, out_dtype, scheme)``; "over" is the median of
the differences of a layer call and a kernel call made back to back (order alternating), beside
the difference of the best rounds' per-call times. The layer's warm call runs
the watched call where the backend binds one (``bind_watched_linear``: the bound call with the
plan's checks inside), so the checks are part of the difference. The clock is ``--clock``'s
(``CLOCKS``; wall time by default: run it on a quiet machine). Prints per shape the microseconds
per call of each and the difference, and the distribution of the differences. Run under
``OMP_NUM_THREADS=1`` and ``=2``.

    python benchmarks/call_overhead.py [--iters 2000] [--rounds 5] [--weight-check sample] [--clock wall]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

import fp8ref

#: SmolLM2-135M's linear layers (out, in): q/o, k/v, gate/up, down.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


class _Ready:
    """A backend whose ``linear`` returns a tensor made beforehand: what remains is fp8ref's Python."""

    name, rejects_non_finite = "ready", True

    def __init__(self, y: torch.Tensor):
        self.y = y

    def linear(self, x, prepared, bias, out_dtype, scheme):
        return self.y


#: ``--clock``: wall time (a quiet machine), this thread's CPU time (the Python and the kernel's share
#: on the calling thread; with 2 threads the other thread's part is in neither figure, so the
#: difference is the calling thread's extra work), or the process's CPU time (with 2 threads it counts
#: the worker's spinning at the barrier while the caller runs Python).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}
_clock = time.perf_counter


def _per_call(fn, iters: int) -> float:
    t0 = _clock()
    for _ in range(iters):
        fn()
    return (_clock() - t0) / iters * 1e6


def measure(N: int, K: int, M: int, iters: int, rounds: int, weight_check: str,
            dtype: torch.dtype = torch.bfloat16) -> tuple[str, float, float, float]:
    lin = torch.nn.Linear(K, N, bias=False, dtype=dtype)
    q = fp8ref.Fp8Linear.from_linear(lin, weight_check=weight_check)
    x = torch.randn(M, K, dtype=dtype)
    with torch.no_grad():
        q(x)
        plan = q.plan(x)
        backend, prepared, scheme, od = plan.backend, plan.prepared, plan.scheme, plan.out_dtype

        def layer():
            q(x)

        fast = plan.fast if plan.fast is not None and plan.fast(x, None) is not None else None

        def kernel():  # the plan's bound call (one call into the extension) where there is one
            if fast is not None:
                fast(x, None)
            else:
                backend.linear(x, prepared, None, od, scheme)

        layer(), kernel()
        a, b = [], []
        for _ in range(rounds):
            a.append(_per_call(layer, iters))
            b.append(_per_call(kernel, iters))
        # The difference itself, call by call: a layer call and a kernel call back to back (the
        # order alternating), the median of their differences. The machine's drift between the
        # rounds above is shared by the two calls of a pair, so a few us over a kernel of hundreds
        # stays visible.
        diffs = []
        for i in range(iters * rounds):
            first, second = (layer, kernel) if i % 2 == 0 else (kernel, layer)
            t0 = _clock()
            first()
            t1 = _clock()
            second()
            t2 = _clock()
            d = (t1 - t0) - (t2 - t1)
            diffs.append(d if first is layer else -d)
        plans = q._plans.plans
        key = next(k for k, v in plans.items() if v is plan)
        kernel_out = backend.linear(x, prepared, None, od, scheme)
        assert kernel_out is not None
        # the layer's Python alone: the warm path with a kernel that returns a tensor made beforehand
        # (a watched call where the plan has one: it is the whole warm call then)
        ready = dataclasses.replace(plan, fast=None, backend=_Ready(kernel_out),
                                    watched=None if plan.watched is None else (lambda x, b, w, s: kernel_out))
        plans[key] = ready
        q._plans.last = ready if ready.watched is not None else None
        c = [_per_call(layer, iters * 10) for _ in range(rounds)]
    return backend.name, min(a), min(b), min(c), statistics.median(diffs) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--weight-check", default="sample")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    a = p.parse_args()
    global _clock
    _clock = CLOCKS[a.clock]
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, "
          f"weight_check={a.weight_check}, clock {a.clock}")
    over, python = [], []
    for N, K in SHAPES:
        for M in (1, 64):
            iters = a.iters if M == 1 else max(a.iters // 10, 50)
            name, t_layer, t_kernel, t_py, t_over = measure(N, K, M, iters, a.rounds, a.weight_check)
            over.append(t_over)
            python.append(t_py)
            print(f"{N:5d}x{K:<5d} M={M:<3d} {name:12s} layer {t_layer:8.1f} us  kernel {t_kernel:8.1f} us  "
                  f"over {t_over:6.1f} us (paired; {t_layer - t_kernel:6.1f} from the best rounds)  "
                  f"layer's Python alone {t_py:5.2f} us")
    for what, v in (("over the kernel", over), ("Python alone", python)):
        v.sort()
        print(f"{what}, us: min {v[0]:.2f} median {statistics.median(v):.2f} max {v[-1]:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
