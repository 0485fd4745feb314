"""Error bounds of quantization: a conforming quantizer's scale and its dequantized values
(docs/spec.md, "Bounds"; ``fp8ref.spec.bounds`` re-exports them).

Each returns an elementwise float64 bound computed from the spec's own quantization (the reference
scale), never from the quantizer under test. They are built from the unit roundoffs of
``fp8ref.spec.roundoff`` only: the GEMM and end-to-end bounds (``fp8ref.spec.bounds``) share their
pipeline-error core among themselves, not with these.
"""

from __future__ import annotations

import torch

from .fenv import ieee
from .quant import Quantized, expand_scale
from .roundoff import U_FP32, U_FP64, eta, gamma
from .schemes import QuantScheme

__all__ = ["scale_error_bound", "quantization_error_bound", "scale_interval", "conforming_quantization_error_bound"]


def scale_error_bound(reference_scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Elementwise bound on |s - s_ref| for a conforming quantizer's stored scale ``s``.

    ``reference_scale`` is the spec's stored scale (``fp8ref.quantize``) for the same input: the
    bound is computed from it, never from the scale under test.

    Notes
    -----
    A dynamic scale is the quotient ``max(amax, floor) / qmax`` stored in ``scale_dtype``; the spec
    rounds it correctly (once), a conforming quantizer may round it *faithfully* (to either
    neighbour of the exact quotient on the grid of ``scale_dtype``), as ``amax * (1/qmax)`` or a
    quotient computed in a narrower dtype does. A faithful rounding lies within one grid step of
    the correctly rounded one, so with ``ulp(s) = 2^(e - p)`` for ``s = m 2^e``, ``m in [1/2, 1)``,
    and ``p`` the significand bits of ``scale_dtype``::

        |s - s_ref| <= max(ulp(s_ref), tiny * eps)    dynamic scales
        s = s_ref                                     power-of-two scales (pow2_scale) and static
                                                      schemes (the caller's scale is returned)

    ``tiny * eps`` is ``scale_dtype``'s smallest subnormal: below the smallest normal the grid is
    evenly spaced by it (a convention with ``subnormal_scales`` stores such scales), so ``2^(e - p)``
    would be finer than the grid there.

    One grid step is the finest tolerance that admits every faithful rounding (the grid leaves
    nothing between 0 and one step) and the coarsest that still rejects a scale off by a rounding
    the spec does not allow (docs/spec.md §5.1). Power-of-two scales are exact because the
    quotient is rounded *up* to a power of two, and neighbouring powers of two differ by a factor
    of 2, not by a rounding.
    """
    if not scheme.dynamic or scheme.pow2_scale:
        return torch.zeros_like(reference_scale, dtype=torch.float64)
    fi = torch.finfo(scheme.scale_dtype)
    p = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[scheme.scale_dtype]
    _, e = torch.frexp(reference_scale.to(torch.float64))
    return torch.exp2(e.to(torch.float64) - p).clamp_min(fi.tiny * fi.eps)


@ieee
def quantization_error_bound(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Elementwise bound on |dequantize(q) - x| for any conforming quantizer.

    Notes
    -----
    With s the stored scale, v = fl32(x / s) and ulp the FP8 grid spacing::

        |q s - x| <= s ulp(min(|v|, qmax)) / 2  +  gamma_d(u32) |x|  +  max(|x| - qmax s, 0)

    The first term is round-to-nearest on the FP8 grid (normal and subnormal range); the second
    the fp32 evaluation of x / s with d = 2 roundings, which admits x * (1/s) as well as a true
    division (d = 3 for float64 input, which is first rounded to fp32); the third the clamp at
    qmax, non-zero only for saturated elements. With ``multiply_codes`` v = fl32(x m) for m the
    multiplier, and m = (1 / s)(1 + d) (m = fl32(1 / s), or s = fl32(1 / m)): again two roundings.
    With ``multiplier_scale`` (the stored scale is m, x ~ q / m) the bound is
    ``conforming_quantization_error_bound``'s for the single multiplier m.
    """
    if q.scheme.multiplier_scale:  # the dequantization scale 1 / m is not an fp32 number: bracket it
        m = q.scale.to(torch.float64)
        return _interval_bound(x, q.scheme, *_reciprocal_interval(m, m))
    rows, cols = x.shape
    fmt, qmax = q.scheme.format, q.scheme.qmax
    s32 = expand_scale(q.scale.to(torch.float32), q.scheme, rows, cols)
    v = x.to(torch.float32) / s32
    s = s32.to(torch.float64)
    ax = x.to(torch.float64).abs()
    d = 3 if x.dtype == torch.float64 else 2
    half_ulp = fmt.ulp(torch.clamp(v.abs(), max=qmax)) / 2
    return s * half_ulp + gamma(d, U_FP32) * ax + torch.clamp(ax - qmax * s, min=0)


def scale_interval(ref: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_lo, s_hi)``: the stored scales a conforming quantizer may return where the spec stores ``ref.scale``.

    ``ref`` is the spec's own quantization (``fp8ref.quantize``) of the input, under the scheme the
    backend declares (a legitimate convention of docs/spec.md §3.1 is a field of that scheme, so the
    interval follows the convention, computed by the spec). Both are float64 tensors of
    ``ref.scale``'s shape.

    Notes
    -----
    The interval ``scale_error_bound`` admits around the spec's s, kept positive::

        s_lo = max(s - scale_error_bound(s), eta_sd),   s_hi = s + scale_error_bound(s)

    (eta_sd the smallest subnormal of ``scale_dtype``; s_lo = s_hi = s for static and power-of-two
    schemes). Every bound that must hold for a backend's own quantization is computed over this
    interval, never from the scale the backend returns.
    """
    s = ref.scale.to(torch.float64)
    tol = scale_error_bound(ref.scale, ref.scheme)
    return torch.clamp(s - tol, min=eta(ref.scheme.scale_dtype)), s + tol


def _reciprocal_interval(m_lo: torch.Tensor, m_hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(lo, hi)`` with lo <= 1 / m_hi and 1 / m_lo <= hi exactly: the dequantization scales of
    multipliers in [m_lo, m_hi]. Each fp64 reciprocal and product errs by <= u64 relative, so widening
    by 2 u64 outward brackets the exact reciprocal ((1 + u64)^2 (1 - 2 u64) < 1)."""
    return (1.0 / m_hi) * (1 - 2 * U_FP64), (1.0 / m_lo) * (1 + 2 * U_FP64)


def _interval_bound(x: torch.Tensor, scheme: QuantScheme, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``conforming_quantization_error_bound``'s inequality for dequantization scales in [lo, hi] (per
    block, float64), plus, for a stored multiplier, the fp64 rounding of ``q / m`` in ``dequantize``
    (|q| <= qmax, so <= u64 qmax hi)."""
    rows, cols = x.shape
    fmt, qmax = scheme.format, scheme.qmax
    s_lo, s_hi = expand_scale(lo, scheme, rows, cols), expand_scale(hi, scheme, rows, cols)
    ax = x.to(torch.float64).abs()
    g = gamma(3 if x.dtype == torch.float64 else 2, U_FP32)
    v_max = ax / s_lo * (1 + g)
    bound = s_hi * fmt.ulp(torch.clamp(v_max, max=qmax)) / 2 + g * ax + torch.clamp(ax - qmax * s_lo, min=0)
    if scheme.multiplier_scale:
        bound = bound + U_FP64 * qmax * s_hi
    return bound


@ieee
def conforming_quantization_error_bound(x: torch.Tensor, ref: Quantized) -> torch.Tensor:
    """Elementwise bound on |dequantize(q) - x| for *every* q a conforming quantizer may return.

    ``ref`` is the spec's quantization of ``x`` (``fp8ref.quantize(x, scheme[, scale])``). The
    bound depends on ``x`` and the spec's scales only, so a backend's result is judged against a
    number it cannot influence: a quantizer whose scale is too small clips, and the clipping is
    measured against the spec's scale, not against its own.

    Notes
    -----
    A conforming q has a stored scale s' in [s_lo, s_hi] (``scale_interval``) and codes
    RNE(clamp(v')) with v' = fl32(x / s') evaluated with d roundings (d = 2; 3 for float64 input),
    so |v'| <= V := |x| / s_lo (1 + gamma_d(u32)). Then (ulp is non-decreasing in |v|)::

        |q s' - x| <= s_hi ulp(min(V, qmax)) / 2  +  gamma_d(u32) |x|  +  max(|x| - qmax s_lo, 0)

    (unclamped: |q - v'| <= ulp(v')/2 and |v' s' - x| <= gamma_d |x|; clamped with |x| / s' >= qmax:
    the error is |x| - qmax s' <= |x| - qmax s_lo; clamped with |x| / s' < qmax < |v'|: the error
    is at most s' |v' - x / s'|). Where s_lo = s_hi = s (static and power-of-two schemes) this is
    ``quantization_error_bound(x, ref)``. An fp32 quotient that underflows (|x / s'| < 2**-126)
    needs no absolute term: q is then 0 and |x| < s' 2**-126 is far below the first term.

    With ``multiplier_scale`` the stored m' lies in ``scale_interval`` and the dequantization scale
    is s' = 1 / m', bracketed outward in float64; v' = fl32(x m') = (x / s')(1 + d), |d| <= u32, so
    the same inequality holds, plus ``u64 qmax s_hi`` for ``dequantize``'s rounded fp64 quotient
    q / m' (docs/spec.md §5.1).
    """
    lo, hi = scale_interval(ref)
    if ref.scheme.multiplier_scale:  # stored multipliers m in [lo, hi]: dequantization scales 1 / m
        return _interval_bound(x, ref.scheme, *_reciprocal_interval(lo, hi))
    if torch.equal(lo, hi):
        return quantization_error_bound(x, ref)
    return _interval_bound(x, ref.scheme, lo, hi)
