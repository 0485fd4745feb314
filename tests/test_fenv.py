"""fp8ref's numbers do not depend on the caller's floating-point environment (docs/spec.md, "The
floating-point environment"; fp8ref/spec/fenv.py).

Under ``torch.set_flush_denormal(True)`` (FTZ and DAZ on the calling thread) the reference, every
fp8ref backend that runs here and ``fp8ref.linear`` must give the bits they give without it, and
give the thread its flushing back. Before 2026-12-03 none of them did on problems whose outputs are
subnormal bf16 or fp32 values, the reference included (it rounded them to 0): only the C++
quantizer guarded MXCSR.
"""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.registry import Case, backend_quantize, backends, decline_reason
from fp8ref.spec import bounds
from fp8ref.spec.fenv import flushing, ieee_subnormals
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import QuantScheme, Recipe

REC = fp8ref.W8A8_FP8
M, N, K = 5, 40, 96


@pytest.fixture
def flush():
    """A function that runs ``fn()`` with this thread flushing subnormals and says whether the
    flushing was still on afterwards; skips where the CPU cannot flush."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (torch.set_flush_denormal returned False)")
    torch.set_flush_denormal(False)

    def run(fn):
        torch.set_flush_denormal(True)
        try:
            assert flushing()
            # flushing is on: a subnormal fp32 product is 0 here, so the comparisons below mean something
            assert float(torch.tensor([2.0**-140]) * 1.0) == 0.0
            out = fn()
            still = flushing()
        finally:
            torch.set_flush_denormal(False)
        return out, still

    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _operands(sa: float, sb: float) -> tuple[Quantized, Quantized]:
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(M, K, generator=g) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, generator=g) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa_t = torch.full(REC.activation.scale_shape(M, K), sa, dtype=REC.activation.scale_dtype)
    sb_t = torch.full(REC.weight.scale_shape(N, K), sb, dtype=REC.weight.scale_dtype)
    return Quantized(a, sa_t, REC.activation), Quantized(b, sb_t, REC.weight)


# Scales whose products put the outputs among bf16 and fp32 subnormals (|y| ~ 2^-150 .. 2^-120), and
# a subnormal activation scale (kept as given: these operands are built, not quantized).
SCALES = [(2.0**-70, 2.0**-68), (2.0**-130, 1.0)]
OUT = [torch.bfloat16, torch.float32]


def test_flushing_is_seen_and_restored(flush):
    assert not flushing()
    inside, still = flush(lambda: _inside())
    assert inside == (False, 2.0**-140) and still


def _inside():
    with ieee_subnormals():
        return flushing(), float(torch.tensor([2.0**-140], dtype=torch.float64).float() * 1.0)


def test_the_problems_have_subnormal_outputs():
    """The premise: without flushing, the reference's outputs are non-zero subnormals."""
    for sa, sb in SCALES:
        a, b = _operands(sa, sb)
        for od in OUT:
            y = fp8ref.scaled_mm(a, b, out_dtype=od).float().abs()
            tiny = torch.finfo(od).tiny
            assert bool(((y > 0) & (y < tiny)).any()), (sa, sb, od)


@pytest.mark.parametrize(("sa", "sb"), SCALES)
@pytest.mark.parametrize("od", OUT)
def test_reference_and_bounds_ignore_flushing(flush, sa, sb, od):
    a, b = _operands(sa, sb)
    y = fp8ref.scaled_mm(a, b, out_dtype=od)
    bound = bounds.gemm_error_bound(a, b, out_dtype=od)
    (y2, bound2), still = flush(lambda: (fp8ref.scaled_mm(a, b, out_dtype=od),
                                         bounds.gemm_error_bound(a, b, out_dtype=od)))
    assert still
    assert torch.equal(_bits(y2), _bits(y))
    assert torch.equal(bound2, bound)


def _runnable(name: str, od: torch.dtype) -> fp8ref.Backend | None:
    be = fp8ref.get_backend(name)
    if be.available() is not None or decline_reason(be, Case(M, N, K, REC, out_dtype=od, op="scaled_mm")):
        return None
    return be


@pytest.mark.parametrize("name", [i.name for i in backends()])
def test_backend_scaled_mm_ignores_flushing(flush, name):
    ran = 0
    for od in OUT:
        be = _runnable(name, od)
        if be is None:
            continue
        for sa, sb in SCALES:
            a, b = _operands(sa, sb)
            pw = be.prepare_weight(b)
            y = be.scaled_mm(a, pw, None, od)
            y2, still = flush(lambda be=be, a=a, pw=pw, od=od: be.scaled_mm(a, pw, None, od))
            assert still, f"{name} left the thread without its flushing"
            assert torch.equal(_bits(y2), _bits(y)), f"{name} {od} sa={sa} sb={sb}: flushing changed the output"
            ran += 1
    if not ran:
        pytest.skip(f"{name} runs no scaled_mm here")


@pytest.mark.parametrize("name", [i.name for i in backends()])
def test_backend_quantize_ignores_flushing(flush, name):
    """Rows of fp32 subnormals with no amax floor: a DAZ'd input reads as 0 and gives other codes."""
    be = fp8ref.get_backend(name)
    scheme = QuantScheme(amax_floor=0.0)
    case = Case(4, 64, 64, Recipe("fenv", REC.weight, scheme), op="quantize")
    if be.available() is not None or "quantize" not in be.ops or decline_reason(be, case):
        pytest.skip(f"{name} does not quantize this here")
    x = torch.arange(1, 257, dtype=torch.float32).reshape(4, 64) * 2.0**-140
    x[1] *= -1
    q = backend_quantize(be, x, scheme)
    assert bool((q.data.float() != 0).any())
    q2, still = flush(lambda: backend_quantize(be, x, scheme))
    assert still
    assert torch.equal(q2.scale, q.scale) and torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))


@pytest.mark.parametrize("backend", ["auto", "reference", "cpu-fp32"])
def test_linear_ignores_flushing(flush, backend):
    """``fp8ref.linear`` guards the whole call, the selection included (for third-party backends
    too). The default recipe's amax floor keeps activation scales >= 1e-12 / 448, so a pre-quantized
    weight with scales 2^-100 is what gives subnormal fp32 outputs."""
    if backend != "auto" and fp8ref.get_backend(backend).available() is not None:
        pytest.skip(f"{backend} unavailable here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=g) * 2.0**-30
    _, w = _operands(1.0, 2.0**-100)
    y = fp8ref.linear(x, w, backend=backend, out_dtype=torch.float32)
    assert bool(((y != 0) & (y.abs() < torch.finfo(torch.float32).tiny)).any())
    y2, still = flush(lambda: fp8ref.linear(x, w, backend=backend, out_dtype=torch.float32))
    assert still
    assert torch.equal(_bits(y2), _bits(y))


def test_flushing_that_cannot_be_cleared_raises(monkeypatch):
    """A thread that stays flushed (torch cannot clear what something else set) is told so, not given
    other numbers, and never recursed on: the guarded functions call themselves once inside the guard."""
    from fp8ref.spec import fenv

    monkeypatch.setattr(fenv, "flushing", lambda: True)
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: True)
    with pytest.raises(RuntimeError, match="flushes subnormal floats to zero"):
        with ieee_subnormals():
            pass
