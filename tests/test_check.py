"""The checking core (``fp8ref.check``) on given problems: what the selector's probe hands it."""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.check import ContractViolation, Declined
from fp8ref.check.given import GivenGemm, GivenLinear, GivenQuantize
from fp8ref.check.linear import check_linear_bound
from fp8ref.check.quantize import check_quantize_codes, check_quantize_scale
from fp8ref.check.scaled_mm import check_scaled_mm_bound
from fp8ref.registry import Backend

RECIPE = fp8ref.W8A8_FP8


class Counting(Backend):
    """The reference quantizer and an fp32 GEMM (fp32 declaration), counting its calls and their M."""

    name = "t-counting"
    accumulation = fp8ref.Accumulation.FP32
    output_roundings = 1

    def __init__(self, scale_factor: float = 1.0):
        self.calls: list[tuple[str, int]] = []
        self.scale_factor = scale_factor

    def quantize(self, x, scheme):
        self.calls.append(("quantize", x.shape[0]))
        return fp8ref.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        self.calls.append(("scaled_mm", a.data.shape[0]))
        y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T * self.scale_factor
        return (y if bias is None else y + bias.to(torch.float32)).to(out_dtype)


def _operands(m=6, n=24, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / 8).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, w, bias


def test_given_problems_refuse_what_they_cannot_describe():
    x, w, bias = _operands()
    static = fp8ref.QuantScheme(granularity="tensor", dynamic=False)
    with pytest.raises(ValueError, match="GivenQuantize: the activation scheme must be dynamic"):
        GivenQuantize(x=x, scheme=static)
    qw = fp8ref.quantize(w, RECIPE.weight)
    with pytest.raises(ValueError, match="GivenLinear: qw must be the quantization of w"):
        GivenLinear(x=x, w=w[:3], bias=None, recipe=RECIPE, out_dtype=torch.float32, qw=qw)
    with pytest.raises(ValueError, match="call_rows"):
        GivenGemm(a=fp8ref.quantize(x, RECIPE.activation), b=qw, bias=None, recipe=RECIPE, out_dtype=torch.float32,
                  call_rows=0)


def test_a_gemm_called_in_row_chunks_is_judged_once():
    """``call_rows``: the backend runs at the chunk's M (an fp32 GEMM's bits may differ with M, so
    the ratios differ, both within the one bound); a chunk out of bound fails the whole."""
    x, w, bias = _operands(m=7)
    a, b = fp8ref.quantize(x, RECIPE.activation), fp8ref.quantize(w, RECIPE.weight)
    whole = GivenGemm(a=a, b=b, bias=bias, recipe=RECIPE, out_dtype=torch.float32)
    chunked = GivenGemm(a=a, b=b, bias=bias, recipe=RECIPE, out_dtype=torch.float32, call_rows=2)
    be = Counting()
    assert 0.0 < check_scaled_mm_bound(be, whole) <= 1.0
    assert be.calls == [("scaled_mm", 7)]
    be.calls.clear()
    assert 0.0 < check_scaled_mm_bound(be, chunked) <= 1.0
    assert be.calls == [("scaled_mm", 2)] * 3 + [("scaled_mm", 1)]
    assert chunked.case().M == 2
    with pytest.raises(ContractViolation, match="scaled_mm vs reference") as err:
        check_scaled_mm_bound(Counting(scale_factor=1.01), chunked)
    assert err.value.ratio > 1


def test_a_given_problem_keeps_the_reference_side_for_every_backend():
    """The memo holds the reference and the bound per declared accumulation: a second backend of
    the same class adds nothing, one of another class adds its own bound only."""
    x, w, bias = _operands()
    p = GivenGemm(a=fp8ref.quantize(x, RECIPE.activation), b=fp8ref.quantize(w, RECIPE.weight), bias=bias,
                  recipe=RECIPE, out_dtype=torch.float32)
    check_scaled_mm_bound(Counting(), p)
    keys = set(p.memo)
    check_scaled_mm_bound(Counting(), p)
    assert set(p.memo) == keys

    class Bf16(Counting):
        accumulation = fp8ref.Accumulation.BF16

    check_scaled_mm_bound(Bf16(), p)
    assert len(set(p.memo) - keys) == 1


def test_quantize_and_linear_checks_on_given_tensors():
    x, w, bias = _operands()
    be = Counting()
    q = GivenQuantize(x=x, scheme=RECIPE.activation)
    assert check_quantize_scale(be, q) == 0.0
    assert 0.0 < check_quantize_codes(be, q) <= 1.0
    lin = GivenLinear(x=x, w=w, bias=bias, recipe=RECIPE, out_dtype=torch.float32,
                      qw=fp8ref.quantize(w, RECIPE.weight))
    assert 0.0 < check_linear_bound(be, lin) <= 1.0
    with pytest.raises(ContractViolation, match="linear vs float64 linear"):
        check_linear_bound(Counting(scale_factor=2.0), lin)

    class NoBias(Counting):
        def supports(self, case):
            return "no bias" if case.has_bias else None

    with pytest.raises(Declined, match="supports: no bias"):
        check_linear_bound(NoBias(), lin)
