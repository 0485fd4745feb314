"""Bounds: sound on random and adversarial inputs, tight on adversarial families."""

import math

import pytest
import torch

import fp8ref
from fp8ref import Accumulation, PrecisionClass, QuantScheme, quantize
from fp8ref.spec.bounds import gamma, gemm_error_bound, linear_error_bound, precision_class
from fp8ref.spec.gemm import k_segments, scale_column

RECIPES = list(fp8ref.RECIPES.values())


def _families(g, M, K):
    """Random and adversarial activations: normal, outlier channels, heavy tails, zero rows,
    huge in-row dynamic range, constant rows."""
    yield "normal", torch.randn(M, K, generator=g)
    x = torch.randn(M, K, generator=g)
    x[:, :3] *= 500
    yield "outliers", x
    yield "heavy", torch.randn(M, K, generator=g) / (torch.rand(M, K, generator=g) + 1e-3)
    x = torch.randn(M, K, generator=g)
    x[1] = 0
    yield "zero-row", x
    yield "range", torch.randn(M, K, generator=g) * torch.logspace(-6, 4, K)
    yield "constant", torch.full((M, K), -3.7)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_linear_within_end_to_end_bound(recipe, dtype):
    g = torch.Generator().manual_seed(11)
    M, N, K = 6, 10, 200
    w = (torch.randn(N, K, generator=g) / 10).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    for name, x in _families(g, M, K):
        x = x.to(dtype)
        qx, qw = quantize(x, recipe.activation), quantize(w, recipe.weight)
        y = fp8ref.reference_linear(x, w, bias, recipe=recipe)
        y_true = x.double() @ w.double().T + bias.double()
        bound = linear_error_bound(x, w, qx, qw, bias, out_dtype=dtype)
        ratio = (y.double() - y_true).abs() / bound
        assert float(ratio.max()) <= 1.0, f"{name}: worst error/bound {float(ratio.max()):.3f}"


def _midpoints_rounding_up(fmt, qmax):
    """Values half-way between grid neighbours whose round-to-nearest-even goes *up*."""
    grid = fmt.finite_values()
    grid = grid[(grid >= fmt.smallest_normal) & (grid <= qmax)]
    lo, hi = grid[:-1], grid[1:]
    mid = (lo + hi) / 2
    hi_even = (torch.tensor([float(v) for v in hi]).to(fmt.torch_dtype).view(torch.uint8) % 2) == 0
    return mid[hi_even & (mid < qmax)]


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz"])
def test_end_to_end_bound_is_tight_on_aligned_ties(fmt):
    """Every element on a tie that rounds away from zero, all positive: the quantization errors of
    x and w add up with one sign, and the observed error reaches most of the bound."""
    scheme = QuantScheme(format=fmt)
    mids = _midpoints_rounding_up(scheme.format, scheme.qmax)
    mids = mids[mids > scheme.qmax / 64]  # stay where relative errors are large
    K = len(mids) + 1
    row = torch.cat([torch.tensor([scheme.qmax]), mids]).float()  # qmax fixes the row's scale at 1
    x = row[None, :].repeat(3, 1)
    w = row[None, :].repeat(2, 1)
    recipe = fp8ref.Recipe("tight", scheme, scheme)
    qx, qw = quantize(x, scheme), quantize(w, scheme)
    assert bool((qx.scale == 1).all())
    y = fp8ref.reference_linear(x, w, recipe=recipe, out_dtype=torch.float32)
    y_true = x.double() @ w.double().T
    bound = linear_error_bound(x, w, qx, qw, out_dtype=torch.float32)
    ratio = (y.double() - y_true).abs() / bound
    assert float(ratio.max()) <= 1.0
    assert float(ratio.min()) >= 0.25, f"bound vacuous: worst ratio {float(ratio.min()):.3f} with K={K}"


def _fp32_pipelines(qa, qb, bias):
    """Three fp32 evaluations a correct kernel might use."""
    M, K = qa.data.shape
    out = {}
    acc = torch.zeros(M, qb.data.shape[0])
    for k0, k1 in k_segments(qa, qb):
        s = qa.data[:, k0:k1].float() @ qb.data[:, k0:k1].float().T
        acc += s * scale_column(qa, k0).float()[:, None] * scale_column(qb, k0).float()[None, :]
    out["accumulate-then-scale"] = acc + bias
    out["dequantize-first"] = qa.dequantize() @ qb.dequantize().T + bias
    rev = torch.flip(qa.dequantize(), [1]) @ torch.flip(qb.dequantize(), [1]).T
    out["reversed-order"] = rev + bias
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp32_pipelines_within_the_fp32_bound(recipe, out_dtype):
    g = torch.Generator().manual_seed(4)
    M, N, K = 5, 7, 384
    for name, x in _families(g, M, K):
        w = torch.randn(N, K, generator=g)
        bias = torch.randn(N, generator=g)
        qa, qb = quantize(x, recipe.activation), quantize(w, recipe.weight)
        y_ref = fp8ref.scaled_mm(qa, qb, bias, out_dtype=torch.float64)
        bound = gemm_error_bound(qa, qb, bias, out_dtype=out_dtype, accumulation=Accumulation.FP32)
        for pipe, y in _fp32_pipelines(qa, qb, bias).items():
            ratio = (y.to(out_dtype).double() - y_ref).abs() / bound
            assert float(ratio.max()) <= 1.0, f"{name}/{pipe}: {float(ratio.max()):.3f}"
        # rounding the accumulator to the output dtype first needs the two-rounding bound
        s = (qa.data.float() @ qb.data.float().T).to(out_dtype).float() if len(k_segments(qa, qb)) == 1 else None
        if s is not None:
            y2 = (s * scale_column(qa, 0).float()[:, None] * scale_column(qb, 0).float()[None, :] + bias).to(out_dtype)
            b2 = gemm_error_bound(qa, qb, bias, out_dtype=out_dtype, accumulation=Accumulation.FP32,
                                  output_roundings=2)
            assert float(((y2.double() - y_ref).abs() / b2).max()) <= 1.0


def test_gemm_bound_catches_a_scale_applied_twice():
    g = torch.Generator().manual_seed(9)
    qa, qb = quantize(torch.randn(4, 64, generator=g)), quantize(torch.randn(8, 64, generator=g))
    y_ref = fp8ref.scaled_mm(qa, qb, out_dtype=torch.float64)
    wrong = (qa.dequantize() * qa.scale) @ qb.dequantize().T  # SGLang PR#28333's bug
    bound = gemm_error_bound(qa, qb, out_dtype=torch.float32, accumulation=Accumulation.FP32)
    assert float(((wrong.double() - y_ref).abs() / bound).max()) > 1.0


def test_gemm_bound_separates_bf16_accumulation_from_fp32():
    g = torch.Generator().manual_seed(10)
    qa, qb = quantize(torch.randn(4, 512, generator=g)), quantize(torch.randn(8, 512, generator=g))
    y_ref = fp8ref.scaled_mm(qa, qb, out_dtype=torch.float64)
    # accumulate in bf16, element by element (what a bf16 accumulator does)
    acc = torch.zeros(4, 8, dtype=torch.bfloat16)
    a, b = qa.data.float(), qb.data.float()
    for k in range(512):
        acc = (acc.float() + a[:, k:k + 1] * b[:, k][None, :]).to(torch.bfloat16)
    y = acc.double() * qa.scale.double() * qb.scale.double().T
    fp32 = gemm_error_bound(qa, qb, out_dtype=torch.float32, accumulation=Accumulation.FP32)
    assert float(((y - y_ref).abs() / fp32).max()) > 1.0


def test_gamma_and_classes():
    assert gamma(0, 0.1) == 0 and gamma(3, 0) == 0
    assert gamma(2, 0.25) == 1.0
    assert math.isinf(gamma(4, 0.25))
    assert precision_class(Accumulation.EXACT, 1) is PrecisionClass.EXACT
    assert precision_class(Accumulation.FP32, 1) is PrecisionClass.STRICT
    assert precision_class(Accumulation.FP32, 2) is PrecisionClass.STANDARD
    assert precision_class(Accumulation.FAST, 1) is PrecisionClass.FAST
    assert precision_class(Accumulation.BF16, 1) is PrecisionClass.FAST
    assert PrecisionClass.STANDARD.admits("strict") and not PrecisionClass.STRICT.admits("standard")
    assert precision_class(Accumulation.FP32, 3) is PrecisionClass.FAST  # tests/test_output_roundings.py
    with pytest.raises(ValueError, match="output_roundings"):
        precision_class(Accumulation.FP32, 0)


def test_promoted_accumulation_factor():
    promoted = Accumulation("fp8-promoted", 2.0**-13, promote_every=128)
    # promotion every 128 products beats keeping 14 bits over all of K
    assert promoted.error_factor(4096) < Accumulation.FAST.error_factor(4096)
    assert promoted.error_factor(100) == Accumulation.FAST.error_factor(100)
    with pytest.raises(ValueError):
        Accumulation("bad", 1.5)
