"""The overflow premise of the value contracts (docs/spec.md §5.2, "overflow"; fp8ref/spec/overflow.py):
a correct fp32 kernel that scales a segment's code sum by one scale and then the other overflows an
intermediate on inputs near 2**120 although the result is finite (found by ``thorough`` on
``correct-three-roundings``, issue 39); the contracts decline such problems, and only those."""

import pytest
import torch

from fp8ref.check.common import Declined
from fp8ref.check.linear import check_linear_bound
from fp8ref.check.problems import LinearProblem
from fp8ref.check.values import TensorSpec
from fp8ref.spec.gemm import k_segments, scale_column
from fp8ref.spec.overflow import FP32_OVERFLOW, fp32_intermediate_max, fp32_overflow_possible
from fp8ref.spec.quant import quantize
from fp8ref.spec.schemes import RECIPES
from tests.mutants.base import Fp32Base


def _codes_then_scales(a, b) -> torch.Tensor:
    """fp32: per segment, the code sum times a's scale, then b's (the Triton blockwise order)."""
    y = torch.zeros(a.data.shape[0], b.data.shape[0])
    for k0, k1 in k_segments(a, b):
        S = a.data[:, k0:k1].float() @ b.data[:, k0:k1].float().T
        y += S * scale_column(a, k0).float()[:, None] * scale_column(b, k0).float()[None, :]
    return y


def _brute_max(a, b) -> float:
    """max |S_g| max(sa_g, sb_g) over every element and segment, the largest intermediate here."""
    out = 0.0
    for k0, k1 in k_segments(a, b):
        S = a.data[:, k0:k1].double().abs() @ b.data[:, k0:k1].double().abs().T
        ca, cb = scale_column(a, k0).abs(), scale_column(b, k0).abs()
        out = max(out, float((S * torch.maximum(ca[:, None], cb[None, :])).max()))
    return out


def test_an_admitted_evaluation_overflows_where_the_premise_says():
    recipe = RECIPES["fp8_block"]
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 2.0**118
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 2.0**-14
    a, b = quantize(x, recipe.activation), quantize(w, recipe.weight)
    exact = x.double() @ w.double().T
    assert bool((exact.abs() < 2.0**110).all())  # the result is far inside fp32's range
    assert not bool(torch.isfinite(_codes_then_scales(a, b)).all())  # an intermediate is not
    assert fp32_overflow_possible(a, b)
    assert FP32_OVERFLOW <= _brute_max(a, b) <= fp32_intermediate_max(a, b)  # |S_g| sa_g itself overflows
    small = quantize(x * 2.0**-40, recipe.activation)
    assert not fp32_overflow_possible(small, b)
    assert bool(torch.isfinite(_codes_then_scales(small, b)).all())


@pytest.mark.parametrize("exp", [60, 100, 110])
def test_the_maximum_bounds_every_intermediate(exp):
    recipe = RECIPES["fp8_block"]
    g = torch.Generator().manual_seed(exp)
    a = quantize(torch.randn(5, 300, generator=g) * 2.0**exp, recipe.activation)
    b = quantize(torch.randn(7, 300, generator=g), recipe.weight)
    assert fp32_intermediate_max(a, b) >= _brute_max(a, b)


def test_linear_bound_declines_the_overflowing_problem():
    """The thorough counterexample of correct-three-roundings (seed 0): x a spike of 2**120, w near
    2**-12, K = 1, fp32 out: the base's fp32 pipeline returns -inf where the result is -7e33."""
    p = LinearProblem(M=1024, N=17, K=1, recipe=RECIPES["fp8_block"], x_dtype=torch.bfloat16,
                      out_dtype=torch.float32, x=TensorSpec("spike", 120, 2482, "first"),
                      w=TensorSpec("zero_rows", -12, 116, "edge64"), has_bias=True)
    with pytest.raises(Declined, match="fp32's range"):
        check_linear_bound(Fp32Base(), p)
