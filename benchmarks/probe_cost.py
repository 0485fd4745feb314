"""CPU time of the selector's compliance probe per backend, at two Llama-3.1-8B shapes.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/probe_cost.py [--shared]

Each ``probe(backend, case)`` builds a fresh ``ProbeSet`` (the reference side, as a cold selection
does) after one warm-up call of the same probe (first-call costs of the backend). With
``--shared``, as a selection probes: one fresh ``ProbeSet`` per case shared by the CPU candidates
``SHARED_BACKENDS`` in turn (the first pays most of the reference side), after a warm-up round. CPU time
(``time.process_time``) is printed beside wall time: on a shared machine the wall time says more
about the neighbours than about the probe. Compare two trees by running this with each on
``PYTHONPATH``, alternating, in one session (docs/performance.md).
"""

import json
import sys
import time

import fp8ref
from fp8ref.kernels import native
from fp8ref.select import compliance, probe

CASES = (fp8ref.Case(16, 4096, 4096, fp8ref.W8A8_FP8), fp8ref.Case(1, 14336, 4096, fp8ref.W8A8_FP8))
BACKENDS = ("reference", "cpu-fp32", "cpu-fp8")
SHARED_BACKENDS = ("torch", "cpu-bf16", "cpu-fp32", "cpu-fp8", "cpu-fp8-amx")


def main() -> None:
    native.get()  # load the extension once, outside the timings
    out = {}
    for case in CASES:
        for name in BACKENDS:
            b = fp8ref.get_backend(name)
            probe(b, case)
            t0, c0 = time.perf_counter(), time.process_time()
            res = probe(b, case)
            out[f"M{case.M}-N{case.N}-K{case.K} {name}"] = {
                "wall_s": round(time.perf_counter() - t0, 3), "cpu_s": round(time.process_time() - c0, 3),
                "compliant": res.compliant}
    print(json.dumps(out, indent=1))


def shared() -> None:
    native.get()
    out = {}
    for case in CASES:
        bs = [fp8ref.get_backend(n) for n in SHARED_BACKENDS]
        warm = compliance.ProbeSet(case)
        for b in bs:
            compliance.probe(b, case, _set=warm)
        c0 = time.process_time()
        ps = compliance.ProbeSet(case)
        per = {}
        for b in bs:
            t = time.process_time()
            res = compliance.probe(b, case, _set=ps)
            per[b.name] = {"cpu_s": round(time.process_time() - t, 3), "compliant": res.compliant}
        out[f"M{case.M}-N{case.N}-K{case.K}"] = {"total_cpu_s": round(time.process_time() - c0, 3), "probes": per}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    shared() if "--shared" in sys.argv[1:] else main()
