"""Reliability, class 1: nothing kills the interpreter (issue 13).

Every entry point of the C++ extension (``fp8ref/kernels/csrc``, bound in ``bindings.cpp``) checks
the shapes, dtypes and sizes of what it indexes at its top (``TORCH_CHECK``), so a bad argument
raises ``RuntimeError`` instead of reading out of bounds or dividing by zero. The calls run in a
child process: a crash (SIGFPE, SIGSEGV) fails the test with the case that caused it instead of
killing the test run. The child prints one JSON line per case, flushed, so the last line names
the case a crash interrupted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fp8ref.kernels import native

#: (case, expected substring of the RuntimeError, or "" for a call that must succeed, and the code).
#: ``mod`` is the extension, ``z(*shape, dtype=...)`` makes zeros, ``v(n)`` a contiguous fp32 vector.
CASES = [
    # scale_epilogue: N = 0 divided by min(N, C) before the guard (SIGFPE)
    ("epilogue N=0", "", "r = mod.scale_epilogue(z(4, 0), v(4), v(0), v(4), False, True); ok(r.shape == (4, 0))"),
    ("epilogue M=0", "", "r = mod.scale_epilogue(z(0, 8), v(0), v(8), v(0), False, False); ok(r.shape == (0, 8))"),
    ("epilogue M=N=0", "", "r = mod.scale_epilogue(z(0, 0), v(0), v(0), v(0), True, True); ok(r.shape == (0, 0))"),
    ("epilogue sa short", "sa must be", "mod.scale_epilogue(z(4, 8), v(3), v(8), v(8), False, True)"),
    ("epilogue sb short", "sb must be", "mod.scale_epilogue(z(4, 8), v(4), v(7), v(8), False, True)"),
    ("epilogue bias short", "bias must be", "mod.scale_epilogue(z(4, 8), v(4), v(8), v(2), True, True)"),
    ("epilogue sa fp64", "sa must be", "mod.scale_epilogue(z(4, 8), v(4).double(), v(8), v(8), False, True)"),
    ("epilogue sb strided", "not contiguous", "mod.scale_epilogue(z(4, 8), v(4), v(16)[::2], v(8), False, True)"),
    ("epilogue y 1-D", "2-D", "mod.scale_epilogue(z(8), v(1), v(8), v(8), False, True)"),
    ("epilogue y int", "fp32/bf16", "mod.scale_epilogue(z(4, 8, dtype=torch.int32), v(4), v(8), v(8), False, True)"),
    # fp8_e4m3_gemm (cpu-fp8 without avx512_bf16)
    ("gemm M=0", "", "r = mod.fp8_e4m3_gemm(c(0, 16), c(8, 16), v(0), v(8), v(0), False); ok(r.shape == (0, 8))"),
    ("gemm N=0", "", "r = mod.fp8_e4m3_gemm(c(4, 16), c(0, 16), v(4), v(0), v(0), False); ok(r.shape == (4, 0))"),
    ("gemm a 1-D", "must be 2-D", "mod.fp8_e4m3_gemm(c(16), c(8, 16), v(1), v(8), v(8), False)"),
    ("gemm b 3-D", "must be 2-D", "mod.fp8_e4m3_gemm(c(4, 16), c(2, 8, 16), v(4), v(8), v(8), False)"),
    ("gemm K mismatch", "K mismatch", "mod.fp8_e4m3_gemm(c(4, 16), c(8, 15), v(4), v(8), v(8), False)"),
    ("gemm sa short", "sa must be", "mod.fp8_e4m3_gemm(c(4, 16), c(8, 16), v(1), v(8), v(8), False)"),
    ("gemm sb short", "sb must be", "mod.fp8_e4m3_gemm(c(4, 16), c(8, 16), v(4), v(1), v(8), False)"),
    ("gemm bias short", "bias must be", "mod.fp8_e4m3_gemm(c(4, 16), c(8, 16), v(4), v(8), v(1), True)"),
    ("gemm sa bf16", "sa must be", "mod.fp8_e4m3_gemm(c(4, 16), c(8, 16), v(4).bfloat16(), v(8), v(8), False)"),
    ("gemm codes fp32", "uint8", "mod.fp8_e4m3_gemm(z(4, 16), c(8, 16), v(4), v(8), v(8), False)"),
    # fp8_e4m3_gemm_packed: on a CPU without avx512_bf16 its first guard says so
    ("packed N<0", "N >= 0|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(4, 16), c(1, 8, 16, 2), c(1, 8), -5, v(4), v(0), v(0), False)"),
    ("packed sa short", "sa must be|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(4, 16), c(1, 8, 16, 2), c(1, 8), 16, v(1), v(16), v(16), False)"),
    ("packed sb short", "sb must be|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(4, 16), c(1, 8, 16, 2), c(1, 8), 16, v(4), v(3), v(16), False)"),
    ("packed bias short", "bias must be|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(4, 16), c(1, 8, 16, 2), c(1, 8), 16, v(4), v(16), v(3), True)"),
    ("packed a 1-D", "must be 2-D|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(16), c(1, 8, 16, 2), c(1, 8), 16, v(1), v(16), v(16), False)"),
    ("packed shape", "packed shape|avx512_bf16",
     "mod.fp8_e4m3_gemm_packed(c(4, 16), c(1, 7, 16, 2), c(1, 7), 16, v(4), v(16), v(16), False)"),
    # has_nan_e4m3: reads every byte of what it is given
    ("nan scan empty", "", "ok(not mod.has_nan_e4m3(c(0)))"),
    ("nan scan strided", "contiguous uint8", "mod.has_nan_e4m3(c(16, 4).t())"),
    ("nan scan fp32", "contiguous uint8", "mod.has_nan_e4m3(z(16))"),
    # quant_blocks (1 x 16 blocks): the format parameters drive shifts and a division
    ("quant M=0", "", "out, s, a = QB(z(0, 16), 1, 16, 448.0, 1e-12, 3, -6, 7, True, False, 0, -1); "
                      "ok(out.shape == (0, 16))"),
    ("quant mant 0", "mantissa bits", "QB(z(2, 16), 1, 16, 448.0, 1e-12, 0, -6, 7, True, False, 0, -1)"),
    ("quant mant 30", "mantissa bits", "QB(z(2, 16), 1, 16, 448.0, 1e-12, 30, -6, 7, True, False, 0, -1)"),
    ("quant qmax 0", "qmax must be", "QB(z(2, 16), 1, 16, 0.0, 1e-12, 3, -6, 7, True, False, 0, -1)"),
    ("quant qmax nan", "qmax must be", "QB(z(2, 16), 1, 16, float('nan'), 1e-12, 3, -6, 7, True, False, 0, -1)"),
    ("quant floor<0", "floor", "QB(z(2, 16), 1, 16, 448.0, -1.0, 3, -6, 7, True, False, 0, -1)"),
    ("quant mode 3", "mode must be", "QB(z(2, 16), 1, 16, 448.0, 1e-12, 3, -6, 7, True, False, 3, -1)"),
    ("quant x 1-D", "2-D", "QB(z(16), 1, 16, 448.0, 1e-12, 3, -6, 7, True, False, 0, -1)"),
    ("quant x strided", "contiguous", "QB(z(16, 4).t(), 1, 16, 448.0, 1e-12, 3, -6, 7, True, False, 0, -1)"),
    ("quant x int", "fp32/bf16/fp16", "QB(z(2, 16, dtype=torch.int32), 1, 16, 448.0, 1e-12, 3, -6, 7, True, False, 0, "
                                      "-1)"),
]

_CHILD = textwrap.dedent("""
    import json, re, sys, torch
    from fp8ref.kernels import native
    try:  # the harness's own test below runs without a build
        mod = native.require()
    except RuntimeError:
        mod = None
    z = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype)
    c = lambda *s: torch.zeros(*s, dtype=torch.uint8)
    v = lambda n: torch.ones(n, dtype=torch.float32)
    QB = getattr(mod, "quant_blocks", None)  # (x, r, c, qmax, floor, mant, emin, bias, negzero, pow2, mode, isa)
    def ok(cond):
        if not cond:
            raise AssertionError("wrong result")
    for name, expect, code in json.loads(sys.argv[1]):
        print(json.dumps({"case": name, "started": True}), flush=True)
        try:
            exec(code)
            got = {"case": name, "raised": None}
        except Exception as exc:
            got = {"case": name, "raised": type(exc).__name__, "msg": str(exc).splitlines()[0]}
        print(json.dumps(got), flush=True)
""")


def _run_child(cases) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, lines


@pytest.fixture(scope="module")
def child():
    if not native.is_built():
        pytest.skip(native.prepare() or "the extension is not built")
    proc, lines = _run_child(CASES)
    last = lines[-1]["case"] if lines else "(before the first case)"
    assert proc.returncode == 0, (f"the child process died with status {proc.returncode} (a negative status is "
                                  f"the signal) during case {last!r}; stderr:\n{proc.stderr[-2000:]}")
    return {d["case"]: d for d in lines if "started" not in d}


@pytest.mark.parametrize("name, expect, code", CASES, ids=[c[0] for c in CASES])
def test_native_entry_point_guards(child, name, expect, code):
    got = child[name]
    if not expect:
        assert got["raised"] is None, f"{name}: {got}"
        return
    assert got["raised"] == "RuntimeError", f"{name}: {got}"
    assert re.search(expect, got["msg"]), f"{name}: {got['msg']!r} does not match {expect!r}"


def test_the_child_reports_a_crash():
    """The harness itself: a case that kills the child is reported with its name, not lost."""
    proc, lines = _run_child([("suicide", "", "import os, signal; os.kill(os.getpid(), signal.SIGFPE)")])
    assert proc.returncode == -8 and lines[-1] == {"case": "suicide", "started": True}


def test_issue_13_reproduction_in_a_child():
    """The reported crash: N = 0 through fp8ref.linear on the CPU backends (cpu-bf16/cpu-fp32 divided
    by zero in the C++ epilogue); now an empty [M, 0] output, as the reference gives."""
    from fp8ref.registry import get_backend

    names = [b for b in ("cpu-bf16", "cpu-fp32", "cpu-fp8") if get_backend(b).available() is None]
    if not names:
        pytest.skip("no CPU backend is available")
    code = ("import torch, fp8ref\n"
            f"for name in {names!r}:\n"
            "    print(name, flush=True)\n"
            "    dt = torch.bfloat16 if name == 'cpu-bf16' else torch.float32\n"
            "    y = fp8ref.linear(torch.randn(4, 16, dtype=dt), torch.randn(0, 16), backend=name)\n"
            "    print(tuple(y.shape), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = proc.stdout.split("\n")[-3:]
    assert proc.returncode == 0, f"status {proc.returncode} after {last}: {proc.stderr[-2000:]}"
    assert proc.stdout.split("\n")[1::2][:len(names)] == ["(4, 0)"] * len(names), proc.stdout
