"""Where an fp32 evaluation of the scaled GEMM can leave fp32's range (docs/spec.md §5.2, "overflow").

§5.2 admits any fp32 evaluation of ``sum_g sa_g sb_g sum_{k in g} a_k b_k + bias``: products of raw
codes accumulated and then scaled per segment -- one scale after the other, in either order, or by
their product -- or the operands dequantized first, in any summation order, the bias last. Its bound
is the relative rounding model, which holds only while every intermediate value is finite. An
intermediate can pass fp32's range although the result does not: a segment's code sum times one of
its scales (``|S_g| sa_g`` with ``sa_g`` near 2**110 and ``sb_g`` near 2**-20, as in the Triton
blockwise kernels' ``dot(a, b) * a_s[:, None] * b_s[None, :]``), or a partial sum of terms that
cancel later. Such a kernel returns Inf or NaN for a finite result, and that is not a defect of it;
a problem where some admitted evaluation can do so is outside the premise of the contracts that
judge values against the reference (``scaled_mm.bound`` and the properties sharing its problems,
``linear.bound``), as a result past the output dtype's range already is.
"""

from __future__ import annotations

import torch

from .bounds import U_FP32, gamma
from .fenv import ieee
from .gemm import k_segments
from .quant import Quantized

__all__ = ["FP32_OVERFLOW", "OVERFLOW_PREMISE", "fp32_intermediate_max", "fp32_overflow_possible"]

#: The least real number that fp32's round-to-nearest-even takes to infinity: 2**128 (1 - 2**-25).
FP32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)

#: Why a contract declines such a problem.
OVERFLOW_PREMISE = ("premise: an fp32 evaluation docs/spec.md §5.2 admits (e.g. a segment's code sum times one scale) "
                    "can pass fp32's range although the result does not: Inf or NaN there is no defect")


def _scales(q: Quantized) -> torch.Tensor:
    """The dequantization scales of ``q`` in float64, [R, C] (``1/m`` for stored multipliers)."""
    s = q.scale.to(torch.float64).abs()
    return 1 / s if q.scheme.multiplier_scale else s


def _column(q: Quantized, s: torch.Tensor, k: int) -> torch.Tensor:
    """The scale of every row of ``q`` at column ``k`` (``fp8ref.spec.gemm.scale_column`` of ``s``)."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    return s[:, k // c].repeat_interleave(r)[:rows]


@ieee
def fp32_intermediate_max(a: Quantized, b: Quantized, bias: torch.Tensor | None = None) -> float:
    """An upper bound, before rounding, on the magnitude of every intermediate value of the fp32
    evaluations §5.2 admits, in float64.

    Notes
    -----
    The intermediates are the code products ``a_k b_k`` and their partial sums (at most
    ``L qmax_a qmax_b``: never near the range), a segment's code sum times one scale
    (``<= |S_g| max(sa_g, sb_g)``, ``|S_g| = sum_{k in g} |a_k b_k|``), the product of the two scales
    (``sa_g sb_g``), a dequantized operand (``|a_k| sa_g``, ``|b_k| sb_g``), the terms and every
    partial sum of them with the bias (``<= P + |bias|``, ``P = sum_g |sa_g sb_g| |S_g|``). The
    largest of these over every output element is returned. A first bound from the formats' and
    scales' maxima (``L max_a max_b max(sa, sb)``, ...) is returned instead when it is below 2**100:
    then the exact maximum is too, and no code is widened (the common case).
    """
    SA, SB = _scales(a), _scales(b)
    segs = k_segments(a, b)
    L, K = max(k1 - k0 for k0, k1 in segs), a.data.shape[1]
    ma, mb = a.scheme.format.max, b.scheme.format.max  # every finite code's magnitude is at most these
    sa, sb = (float(t.max()) if t.numel() else 0.0 for t in (SA, SB))
    mbias = float(bias.to(torch.float64).abs().max()) if bias is not None and bias.numel() else 0.0
    coarse = max(L * ma * mb * max(sa, sb), sa * sb, ma * sa, mb * sb, K * ma * mb * sa * sb + mbias)
    if coarse < 2.0**100 or a.data.numel() == 0 or b.data.numel() == 0:
        return coarse
    A = a.data.to(torch.float64).abs()
    B = b.data.to(torch.float64).abs()
    worst = 0.0
    P = torch.zeros(A.shape[0], B.shape[0], dtype=torch.float64)
    for k0, k1 in segs:
        ca, cb = _column(a, SA, k0), _column(b, SB, k0)
        S = A[:, k0:k1] @ B[:, k0:k1].T
        P += S * torch.outer(ca, cb)
        worst = max(worst, float((S * torch.maximum(ca[:, None], cb[None, :])).max()),
                    float(ca.max() * cb.max()), float((A[:, k0:k1].amax(1) * ca).max()),
                    float((B[:, k0:k1].amax(1) * cb).max()))
    if bias is not None:
        P += bias.to(torch.float64).abs()
    return max(worst, float(P.max()))


def fp32_overflow_possible(a: Quantized, b: Quantized, bias: torch.Tensor | None = None, *,
                           slack: float = 1.0) -> bool:
    """Whether some fp32 evaluation §5.2 admits can round an intermediate value to infinity: the
    largest intermediate (``fp32_intermediate_max``), grown by the pipeline's K + 3 roundings
    (``1 + gamma_{K+3}(u32)``) and by ``slack`` (>= 1: another quantization of the same input, as a
    linear's own), reaches ``FP32_OVERFLOW``.

    >>> import torch, fp8ref
    >>> x = fp8ref.quantize(torch.full((1, 4), 2.0**120), fp8ref.QuantScheme())
    >>> w = fp8ref.quantize(torch.full((1, 4), 2.0**-12), fp8ref.QuantScheme())
    >>> fp32_overflow_possible(x, w), fp32_overflow_possible(w, w)  # |S| sa = 4 * 448 * 2**120
    (True, False)
    """
    if slack < 1:
        raise ValueError(f"slack must be at least 1, got {slack}")
    if a.data.shape[1] == 0:
        return False
    grow = 1 + gamma(a.data.shape[1] + 3, U_FP32)
    return fp32_intermediate_max(a, b, bias) * grow * slack >= FP32_OVERFLOW
