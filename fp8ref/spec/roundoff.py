"""Unit roundoffs and Higham's gamma: the constants every error bound of the spec is built from.

A unit roundoff is written as a power of two (2**-p for a p-bit significand, round to nearest);
``gamma(n, u) = n u / (1 - n u)`` bounds the relative error of a product of n factors
(1 + delta_i)^{+-1} with |delta_i| <= u (Higham, Accuracy and Stability of Numerical Algorithms,
2nd ed., Lemma 3.1). ``fp8ref.spec.bounds`` re-exports them; ``fp8ref.spec.quant_bounds`` and the
GEMM bounds use them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["U_FP64", "U_FP32", "unit_roundoff", "eta", "gamma"]

U_FP64 = 2.0**-53  #: unit roundoff of float64
U_FP32 = 2.0**-24  #: unit roundoff of float32
_U = {torch.float64: U_FP64, torch.float32: U_FP32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a float dtype: 2**-p for a p-bit significand (round to nearest)."""
    return _U[dtype]


def eta(dtype: torch.dtype) -> float:
    """Smallest positive subnormal of ``dtype``: the absolute error of rounding near zero is <= eta/2."""
    return float(torch.finfo(dtype).smallest_normal) * 2.0 * unit_roundoff(dtype)


def gamma(n: int | float, u: float) -> float:
    """Higham's gamma_n(u) = n u / (1 - n u); inf when n u >= 1, 0 when n <= 0 or u == 0."""
    nu = n * u
    if n <= 0 or u == 0:
        return 0.0
    return math.inf if nu >= 1 else nu / (1 - nu)
