"""The ``cpu-fp8-amx`` backend: cpu-fp8's packed E4M3FN weights decoded straight into AMX tiles.

On CPUs with AMX (Intel Xeon Sapphire Rapids and later: ``amx_tile``, ``amx_bf16``, and
``avx512_bf16`` for the decoding), the weight packed by ``prepare_weight`` as ``[N/16, K/2, 16,
2]`` (``cpu_fp8.pack_weight``) is, 512 bytes at a time, one TDPBF16PS B tile in the pair ("VNNI")
layout: the kernel decodes it to the exact bf16 bit patterns (1 KiB) one step ahead of the tile
loads, the activations are decoded once per call into their A tiles, and TDPBF16PS accumulates in
fp32 tiles (2 x 2 C tiles per 32 rows x 32 columns, K in chunks of 2048). The C++ is
``csrc/gemm_amx.cpp`` (tile logic, written once as a template over the tile operations) and
``csrc/amx_tiles.h`` (the real instructions and their software emulation).

**Numerics: strict class** (``Accumulation.FP32``, ``output_roundings=1``), as ``cpu-fp8``. Every
E4M3FN value is exactly a normal bf16, a product of two is exact in fp32, and every partial sum
is a multiple of 2**-18, so TDPBF16PS's DAZ and FTZ (it flushes denormal inputs and results,
whatever MXCSR says) never act; each of its additions rounds once to nearest even, so each output
is a sum of its K exact products by a tree of additions each rounded once, which the fp32
accumulation bound covers in any order. The fp32 epilogue ``(acc * sa) * sb + bias`` is rounded
once to ``out_dtype``: to bf16 by the kernel itself (round to nearest even, the bits of torch's
``.to``), to any other dtype by torch. The emulation models the instruction as the Intel SDM
writes it (two fp32 temporaries per output for the even and the odd products of the pairs, each
from zero, added together and then to C; docs/backends.md).

**Safety on the machines we meet.** ``available()`` says None only when (1) the extension is built,
(2) this CPU has the flags and the OS granted AMX tile data to the process (``amx_status()``: the
extension asks with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` when it loads), and (3)
the self-test passed: the real kernel, run once in a child process (so that a fault cannot take
the caller down), gave the exact answer on integer-valued and subnormal-valued problems (where
every summation order is exact) over every tail (M, N, K, one and several K chunks and row
chunks), stayed within the fp32 bound on random ones, and rounded to nearest even. The verdict is
cached next to the build, per CPU model and flags. Where AMX is absent it says which flags are
missing. The same tile logic runs everywhere on the emulated tiles (``emulate = True``;
tests/test_amx.py), which check every configuration, tile shape and instruction operand the way the
hardware would fault on them.

Declines: other formats than E4M3FN, block/group scales, non-CPU tensors. Rows go to the kernel in
chunks of ``AMX_ROWS`` (and inside it in panels of 256); there is no row limit (the selector
times it against oneDNN's GEMMs).

Examples
--------
>>> import fp8ref
>>> be = fp8ref.get_backend("cpu-fp8-amx")
>>> be.supports(fp8ref.Case(16, 4096, 4096, fp8ref.FP8_BLOCK))
'cpu-fp8-amx takes per-row or per-tensor weight scales, not block'
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from .._io import atomic_write
from .._machine import cpu_flags, cpu_model
from ..registry import Case, register_backend
from ..spec import bounds, gemm
from ..spec.compare import compare, compare_bits
from ..spec.quant import Quantized, quantize
from ..spec.schemes import W8A8_FP8, QuantScheme
from . import native
from ._common import ieee_methods
from .cpu_fp8 import CpuFp8Backend, pack_weight

__all__ = ["CpuFp8AmxBackend", "AMX_FLAGS", "AMX_ROWS", "SELF_TEST_SHAPES", "self_test", "self_test_result",
           "self_test_summary"]

#: The CPU flags the kernel needs (``/proc/cpuinfo`` names): the tiles, and AVX-512 BF16 for decoding.
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16")
#: Rows per kernel call (the kernel itself goes in panels of 256 rows, written straight into one
#: output, which saves joining fp32 pieces: docs/performance.md, "Figures behind choices in the
#: code"). Bounds the decoded activations (2 x K bytes per row).
AMX_ROWS = 4096
#: (M, N, K) of the self-test: every M tail (1, 15, 16, 17, 31..33 rows, several row chunks), N
#: tails (1, 17, 45) and K tails (odd K, K < 32, one K chunk of 2048 values and several, with C in
#: the tiles (M <= 32) and in memory between chunks (M > 32)).
SELF_TEST_SHAPES = ((1, 1, 1), (1, 64, 1030), (3, 17, 33), (15, 45, 77), (16, 32, 64), (17, 16, 31),
                    (31, 33, 600), (33, 48, 100), (70, 40, 1030), (20, 17, 2100), (40, 33, 4111))
#: Bumped when the kernel or the self-test changes what they check (invalidates cached verdicts).
_SELF_TEST_VERSION = 2


@ieee_methods
class CpuFp8AmxBackend(CpuFp8Backend):
    """cpu-fp8 on AMX tiles (see the module docstring); ``emulate = True`` runs the same tile
    logic on the software emulation of the tiles (any CPU; for tests)."""

    name = "cpu-fp8-amx"
    #: run the tile logic on the emulated tiles instead of the real ones
    emulate = False

    def available(self) -> str | None:
        reason = native.prepare()
        if reason or self.emulate:
            return reason
        status = native.require().amx_status()
        if status:
            return f"cpu-fp8-amx needs AMX tiles: {status} (CPU: {cpu_model()})"
        return self_test_result()["reason"]

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"{self.name} runs on CPU tensors only, the case is on {case.device}"
        return (self._scheme_reason(case.recipe.weight, "weight")
                or self._scheme_reason(case.recipe.activation, "activation"))

    def _packed(self) -> bool:
        return True

    def _bind_state(self) -> tuple:
        return self.isa, self.bf16_dot, self.emulate

    def _bound_kernel(self, extra: dict) -> tuple | None:
        """``fp8_linear``'s AMX path (-2; -3 on the emulated tiles), ``AMX_ROWS`` rows per call."""
        packed = extra.get("packed")
        return None if packed is None else (*packed, -3 if self.emulate else -2, AMX_ROWS)

    def _gemm(self, mod, codes_a: torch.Tensor, codes_b: torch.Tensor, extra: dict, sa: torch.Tensor,
              sb: torch.Tensor, bias_arg: tuple, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The kernel's result, rounded to bf16 by its epilogue when ``out_dtype`` is bf16 (the bits
        of the fp32 result's ``.to(torch.bfloat16)``, one pass over the output fewer), else fp32."""
        N = codes_b.shape[0]
        packed = extra.get("packed")
        if packed is None:
            packed = pack_weight(codes_b)
        bf16 = out_dtype == torch.bfloat16
        ys = [mod.fp8_e4m3_gemm_amx(codes_a[r:r + AMX_ROWS], *packed, N, sa[r:r + AMX_ROWS], sb, *bias_arg,
                                    self.emulate, bf16) for r in range(0, codes_a.shape[0], AMX_ROWS)]
        return ys[0] if len(ys) == 1 else torch.cat(ys)


register_backend(CpuFp8AmxBackend())


# --------------------------------------------------------------------------------------------
# The self-test
# --------------------------------------------------------------------------------------------

def _tensor(values: torch.Tensor) -> Quantized:
    """Values already on the E4M3FN grid, with one scale of 1."""
    return Quantized(values.to(torch.float8_e4m3fn), torch.ones(1, 1), QuantScheme(granularity="tensor"))


def _exact_operands(kind: str, M: int, N: int, K: int, g: torch.Generator) -> tuple[Quantized, Quantized]:
    """Operands whose every partial sum, in any order, is exact in fp32: integers in [-16, 16]
    (|sum| <= 256 K < 2**24 for K < 65536), or subnormal codes m * 2**-9 (m <= 7) against
    integers (every partial sum a multiple of 2**-9 below 2**24 of them)."""
    a = torch.randint(-16, 17, (M, K), generator=g).float()
    b = torch.randint(-16, 17, (N, K), generator=g).float()
    if kind == "subnormals":
        a = torch.randint(-7, 8, (M, K), generator=g).float() * 2.0**-9
    return _tensor(a), _tensor(b)


def _rne_problems() -> list[tuple[Quantized, Quantized, float]]:
    """64 + m 2**-18 (m/2 fp32 ulps of 64) in both orders within a pair, and the expected RNE sums
    (truncation would give floor(m/2) ulps)."""
    out = []
    for m, ulps in ((3, 2), (5, 2), (7, 4)):  # 1.5 -> 2, 2.5 -> 2, 3.5 -> 4
        for big, small in ((1, 0), (0, 1)):
            a, b = torch.zeros(1, 32), torch.zeros(1, 32)
            a[0, big] = b[0, big] = 8.0
            a[0, small], b[0, small] = m * 2.0**-9, 2.0**-9
            out.append((_tensor(a), _tensor(b), 64.0 + ulps * 2.0**-17))
    return out


def self_test(emulate: bool = False) -> dict:
    """Run the kernel (on the real tiles, or on the emulated ones) against exact answers, the fp32
    bound and round-to-nearest-even; on the real tiles, also compare its bits with the emulation's.

    Returns ``{"reason": None or why it failed, "matches_emulation": bool or None, "checks": n}``.
    The real-tile run is what ``self_test_result`` does once, in a child process.

    Examples
    --------
    >>> from fp8ref.kernels import native
    >>> from fp8ref.kernels.cpu_fp8_amx import self_test
    >>> native.get() is None or self_test(emulate=True)["reason"] is None
    True
    """
    be = CpuFp8AmxBackend()
    be.emulate = emulate
    emu = CpuFp8AmxBackend()
    emu.emulate = True
    g = torch.Generator().manual_seed(0)
    failures: list[str] = []
    same: bool | None = None if emulate else True
    checks = 0
    for M, N, K in SELF_TEST_SHAPES:
        for kind in ("integers", "subnormals"):
            qa, qb = _exact_operands(kind, M, N, K, g)
            y = be.scaled_mm(qa, qb, out_dtype=torch.float32).to(torch.float64)
            exact = qa.data.to(torch.float64) @ qb.data.to(torch.float64).T
            checks += 1
            v = compare(f"{kind} M={M} N={N} K={K} against the exact sum", y, exact, 0.0)
            if not v.ok:
                failures.append(v.message())
        qa = quantize(torch.randn(M, K, generator=g) * 3, W8A8_FP8.activation)
        qb = quantize(torch.randn(N, K, generator=g), W8A8_FP8.weight)
        bias = torch.randn(N, generator=g)
        y = be.scaled_mm(qa, qb, bias, out_dtype=torch.float32)
        ref = gemm.scaled_mm(qa, qb, bias, out_dtype=torch.float64)
        bound = bounds.gemm_error_bound(qa, qb, bias, out_dtype=torch.float32, accumulation=be.accumulation,
                                        output_roundings=be.output_roundings, y_ref=ref)
        checks += 1
        v = compare(f"random M={M} N={N} K={K} against gemm_error_bound", y, ref, bound)
        if not v.ok:
            failures.append(v.message())
        if not emulate:
            same = bool(same and compare_bits("tiles against the emulation", y,
                                              emu.scaled_mm(qa, qb, bias, torch.float32)).ok)
    for qa, qb, want in _rne_problems():
        y = be.scaled_mm(qa, qb, out_dtype=torch.float32)
        checks += 1
        v = compare("rounding of 64 + small products against round-to-nearest-even", y, torch.full_like(y, want), 0.0)
        if not v.ok:
            failures.append(v.message())
    reason = None
    if failures:
        reason = (f"the cpu-fp8-amx self-test failed {len(failures)} of {checks} checks on this CPU "
                  f"({cpu_model()}): " + "; ".join(failures[:3]))
    return {"reason": reason, "matches_emulation": same, "checks": checks}


def _source_digest() -> str:
    """This module's source (the self-test's cases and checks): a changed self-test is a new verdict
    (the C++ sources already key the build directory the verdict lives in)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _cache_path() -> Path:
    key = json.dumps([_SELF_TEST_VERSION, _source_digest(), cpu_model(), sorted(cpu_flags())])
    return native.build_dir() / f"amx-self-test-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


_result: dict | None = None


def self_test_result() -> dict:
    """``self_test()`` on the real tiles, run once per build and CPU in a child process (a fault
    there becomes a reason, not a crash of this process) and cached next to the build."""
    global _result
    if _result is not None:
        return _result
    path = _cache_path()
    try:
        _result = json.loads(path.read_text())
        return _result
    except (OSError, ValueError):
        pass
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    code = "import json; from fp8ref.kernels import cpu_fp8_amx as m; print(json.dumps(m.self_test()))"
    print("fp8ref: running the cpu-fp8-amx self-test once on this CPU (a few seconds)...", file=sys.stderr,
          flush=True)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:  # not cached: a loaded machine may finish it next time
        _result = {"reason": "the cpu-fp8-amx self-test did not finish in 600 s", "matches_emulation": None}
        return _result
    if proc.returncode == 0:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        tail = " ".join(proc.stderr.strip().splitlines()[-2:])
        res = {"reason": f"the cpu-fp8-amx self-test {how} on this CPU ({cpu_model()}): {tail}",
               "matches_emulation": None}
    if proc.returncode == 0 or -proc.returncode in (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE):
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(res)))  # a verdict on this kernel
    _result = res
    return res


def self_test_summary() -> str:
    """One line on the real tiles' self-test, for the bench header and ``python -m
    fp8ref.kernels.build``: passed or why not, and whether the chip's bits equal the emulation's.
    The emulation follows the SDM's pseudocode of TDPBF16PS, whose accumulation order Intel's
    intrinsics guide writes differently; which one the chip follows is unverified until a machine
    with AMX reports it here (a difference is no defect: the self-test checks the bound)."""
    res = self_test_result()
    if res["reason"]:
        return f"self-test failed: {res['reason']}"
    same = {True: "equal", False: "differ from", None: "were not compared with"}[res.get("matches_emulation")]
    return f"self-test passed; the real tiles' bits {same} the emulation's"
