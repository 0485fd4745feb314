"""The scaled_mm contracts' checks: the bound, finiteness, every output written, determinism, sign
symmetry, scale equivariance, batch invariance. The contract table that names them (with the accumulator
probe, which stays with the conformance driver) is ``fp8ref.conformance.contracts``. Imports flow down:
the registry, the spec, ``problems`` and ``common``."""

from __future__ import annotations

import torch

from ..registry import Backend, Case, decline_reason
from ..spec import gemm
from ..spec.bounds import gemm_error_bound, gemm_underflow_possible
from ..spec.overflow import OVERFLOW_PREMISE, fp32_overflow_possible
from ..spec.quant import Quantized
from .common import (
    ContractViolation,
    Declined,
    build_problem,
    cached_reference,
    call_scaled_mm,
    check_within,
    copy_quantized,
    first_diff,
    negate_codes,
    require_supported,
    same_bits,
)
from .given import GivenGemm
from .problems import GemmProblem


def _gemm_ref(p: GemmProblem):
    """``(a, b, bias, y64)``: copies of the operands and the reference's float64 result."""
    def compute():
        a, b, bias = build_problem(p)
        y64 = gemm.scaled_mm(a, b, bias, out_dtype=torch.float64)
        limit = torch.finfo(p.out_dtype).max / 2
        if not bool(torch.isfinite(y64).all()) or bool((y64.abs() > limit).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
        if fp32_overflow_possible(a, b, bias):
            raise Declined(OVERFLOW_PREMISE)
        return a, b, bias, y64

    a, b, bias, y64 = cached_reference(("gemm", p), compute)
    return copy_quantized(a), copy_quantized(b), None if bias is None else bias.clone(), y64


def check_scaled_mm_bound(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, y64 = _gemm_ref(p)
    y = call_scaled_mm(backend, a, b, bias, p.out_dtype, rows=p.call_rows if isinstance(p, GivenGemm) else None)
    bound = cached_reference(
        ("gemm_bound", p, backend.accumulation, backend.output_roundings),
        lambda: gemm_error_bound(a, b, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                 output_roundings=backend.output_roundings, y_ref=y64))
    return check_within(f"scaled_mm vs reference (gemm_error_bound, {backend.accumulation.name} accumulation, "
                         f"{backend.output_roundings} output rounding(s))", y, y64, bound)


def check_scaled_mm_finite(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, _ = _gemm_ref(p)
    y = call_scaled_mm(backend, a, b, bias, p.out_dtype)
    bad = ~torch.isfinite(y)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ContractViolation(f"{int(bad.sum())} non-finite outputs from finite operands "
                                f"(first {y[idx].item()} at {idx})")
    return None


def check_scaled_mm_all_written(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, _ = _gemm_ref(p)
    y1 = call_scaled_mm(backend, a, b, bias, p.out_dtype, poison=float("nan"))
    if bool(torch.isnan(y1).any()):
        idx = tuple(int(i) for i in torch.isnan(y1).nonzero()[0])
        raise ContractViolation(f"{int(torch.isnan(y1).sum())} output elements are NaN after the output memory was "
                                f"poisoned with NaN (first at {idx}): left unwritten")
    y2 = call_scaled_mm(backend, a, b, bias, p.out_dtype, poison=12345.0)
    if not same_bits(y1, y2):
        raise ContractViolation(f"output depends on the previous contents of memory: {first_diff(y1, y2)}")
    return None


def check_scaled_mm_deterministic(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, _ = _gemm_ref(p)
    y1, y2 = call_scaled_mm(backend, a, b, bias, p.out_dtype), call_scaled_mm(backend, a, b, bias, p.out_dtype)
    if not same_bits(y1, y2):
        raise ContractViolation(f"two identical calls differ: {first_diff(y1, y2)}")
    return None


def check_scaled_mm_sign_symmetry(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, _ = _gemm_ref(p)
    y1 = call_scaled_mm(backend, a, b, bias, p.out_dtype)
    y2 = call_scaled_mm(backend, negate_codes(a), b, None if bias is None else -bias, p.out_dtype)
    if not torch.equal(y2.to(torch.float64), -y1.to(torch.float64)):
        return check_within("scaled_mm(-a, b, -bias) must be -scaled_mm(a, b, bias)", y2, -y1.to(torch.float64),
                             torch.zeros_like(y1, dtype=torch.float64))
    return None


def check_scaled_mm_scale_equivariance(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, y64 = _gemm_ref(p)
    f = 2.0**p.k
    s2 = a.scale * f
    info = torch.finfo(a.scale.dtype)
    if not torch.equal(s2 / f, a.scale) or bool((s2 < info.tiny).any()) or not bool(torch.isfinite(s2).all()):
        raise Declined("premise: scale * 2**k leaves the normal range of the scale dtype")
    bias2 = None if bias is None else bias * f
    if bias is not None and not torch.equal(bias2 / f, bias):
        raise Declined("premise: bias * 2**k is not exact")
    if fp32_overflow_possible(Quantized(a.data, s2, a.scheme), b, bias2):
        raise Declined(OVERFLOW_PREMISE)
    y1 = call_scaled_mm(backend, a, b, bias, p.out_dtype)
    y2 = call_scaled_mm(backend, Quantized(a.data, s2, a.scheme), b, bias2, p.out_dtype)
    oi = torch.finfo(p.out_dtype)
    y1d, y2d = y1.to(torch.float64), y2.to(torch.float64)
    # Only where neither result -- nor the product before the bias, which a backend declaring two
    # output roundings may round on its own -- is near the subnormal range or overflow.
    lo, hi = oi.smallest_normal * 2.0 ** (abs(p.k) + 1), oi.max / 2.0 ** (abs(p.k) + 1)

    def in_range(t):
        return ((t.abs() >= lo) & (t.abs() <= hi)) | (t == 0)

    mask = in_range(y1d) & in_range(y2d)
    if bias is not None:
        prod = cached_reference(("gemm_product", p), lambda: gemm.scaled_mm(a, b, None, out_dtype=torch.float64))
        mask &= in_range(prod) & in_range(prod * f)
    if not bool(mask.any()):
        raise Declined("premise: every output is near the subnormal or overflow range")
    if torch.equal(y2d[mask], y1d[mask] * f):
        return None
    what = f"scaled_mm with a.scale*2**{p.k} (and bias*2**{p.k}) must give y*2**{p.k}"
    a2 = Quantized(a.data, s2, a.scheme)
    acc = backend.accumulation
    if not (gemm_underflow_possible(a, b, acc) or gemm_underflow_possible(a2, b, acc)):
        return check_within(what, torch.where(mask, y2d, 0.0), torch.where(mask, y1d * f, 0.0),
                             torch.zeros_like(y1d))
    # A product below fp32's smallest normal errs absolutely (the bound's underflow term), which the
    # scaling does not scale: each result within its own bound of the exact one, and
    # |y2 - f y1| <= B2 + |r2 - f r1| + f B1 (r: the reference's float64 results).
    r2 = gemm.scaled_mm(a2, b, bias2, out_dtype=torch.float64)
    kw = dict(out_dtype=p.out_dtype, accumulation=acc, output_roundings=backend.output_roundings)
    bound = (gemm_error_bound(a2, b, bias2, y_ref=r2, **kw) + (r2 - y64 * f).abs()
             + f * gemm_error_bound(a, b, bias, y_ref=y64, **kw))
    return check_within(what + " (within both results' bounds: an fp32 product can underflow)",
                         torch.where(mask, y2d, 0.0), torch.where(mask, y1d * f, 0.0), torch.where(mask, bound, 0.0))


def _row_slice(q: Quantized, i: int) -> Quantized:
    r, _ = q.scheme.block_shape(*q.data.shape)
    return Quantized(q.data[i:i + 1], q.scale[i // r:i // r + 1], q.scheme)


def check_scaled_mm_batch_invariant(backend: Backend, p: GemmProblem) -> float:
    require_supported(backend, p.case())
    a, b, bias, _ = _gemm_ref(p)
    y = call_scaled_mm(backend, a, b, bias, p.out_dtype)
    for i in sorted({0, p.M // 2, p.M - 1}):
        sub = Case(1, p.N, p.K, p.recipe, torch.bfloat16, p.out_dtype, has_bias=p.has_bias, op="scaled_mm")
        reason = decline_reason(backend, sub)
        if reason is not None:
            raise Declined(f"supports declines M=1: {reason}")
        yi = call_scaled_mm(backend, _row_slice(a, i), b, bias, p.out_dtype)
        # Values, not bits: a zero's sign depends on summation order and matters to no one.
        if not torch.equal(yi[0].to(torch.float64), y[i].to(torch.float64)):
            raise ContractViolation(f"row {i} computed alone differs from row {i} of the batch of {p.M}: "
                                    f"{first_diff(yi[0], y[i])}")
    return None
