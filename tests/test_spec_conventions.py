"""Scale conventions of a scheme (docs/spec.md §3.1) and the dequantize-then-GEMM declaration (§5.2):
the reference implements each convention as written, and the operand-rounding bound is sound on
random and adversarial operands and tight on operands built to round the same way."""

import pytest
import torch

import fp8ref
from fp8ref import Accumulation, PrecisionClass, Quantized, QuantScheme, quantize
from fp8ref.spec.bounds import gemm_error_bound, precision_class
from fp8ref.spec.gemm import scaled_mm_exact

RECIPES = list(fp8ref.RECIPES.values())


# ------------------------------------------------------------------------------------------------
# scale conventions


def test_zero_scale_is_the_scale_of_an_all_zero_block_and_codes_stay_zero():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    x[1] = 1.0
    eps = torch.finfo(torch.bfloat16).eps
    q = quantize(x, QuantScheme(amax_floor=0.0, zero_scale=eps))
    assert q.scale[0].item() == eps and q.scale[1].item() == torch.tensor(1.0 / 448, dtype=torch.float32).item()
    assert q.data[0].float().abs().sum().item() == 0.0
    assert quantize(x, QuantScheme(amax_floor=0.0)).scale[0].item() == 1.0  # TransformerEngine's 1


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -1.0])
def test_nan_or_zero_scales_are_not_a_convention(bad):
    with pytest.raises(ValueError, match="zero_scale"):
        QuantScheme(zero_scale=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_computed_in_the_input_dtype_is_the_correctly_rounded_quotient(dtype):
    """One rounding of amax/qmax to bf16/fp16 (what torch's bf16 division returns), stored as fp32."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 48, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(dtype)
    scheme = QuantScheme(scale_compute_dtype=dtype)
    q = quantize(x, scheme)
    want = (x.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.float32)  # torch divides in `dtype`
    assert q.scale.dtype == torch.float32
    assert torch.equal(q.scale, want)
    # The codes divide by the stored scale: x ~ q * s within the quantization bound.
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= fp8ref.quantization_error_bound(x, q)).all())


def test_pow2_is_applied_after_the_compute_rounding():
    # 448 * (1 + 2**-9): its fp32 quotient 1 + 2**-9 rounds up to 2 as a power of two, but in bf16
    # it first rounds to 1 (ties to even), whose power of two is 1 (jax's MXFP8 order of operations).
    x = torch.tensor([[448.0 * (1 + 2.0**-9)]])
    assert quantize(x, QuantScheme(pow2_scale=True)).scale.item() == 2.0
    assert quantize(x, QuantScheme(pow2_scale=True, scale_compute_dtype=torch.bfloat16)).scale.item() == 1.0


def test_subnormal_scales_kept_or_raised():
    x = torch.full((1, 4), 2.0**-20, dtype=torch.float16)  # amax/448 ~ 2**-28.8: fp16 subnormal
    raised = quantize(x, QuantScheme(scale_dtype=torch.float16))
    kept = quantize(x, QuantScheme(scale_dtype=torch.float16, subnormal_scales=True))
    assert raised.scale.item() == torch.finfo(torch.float16).smallest_normal
    assert 0 < kept.scale.item() < torch.finfo(torch.float16).smallest_normal
    for q in (raised, kept):
        assert bool(((q.dequantize(torch.float64) - x.double()).abs() <= fp8ref.quantization_error_bound(x, q)).all())


def test_conventions_appear_in_short_str_and_fast_paths_defer_to_the_reference():
    s = QuantScheme(zero_scale=0.125, scale_compute_dtype=torch.bfloat16, subnormal_scales=True)
    assert s.short_str() == "e4m3fn-row-dyn-zero0.125-cbfloat16-subn"
    assert not s.standard_scale_rule and QuantScheme().standard_scale_rule
    from fp8ref.kernels._common import fast_quantize

    x = torch.zeros(3, 16)
    x[0] = 1
    floorless = s.with_(amax_floor=0.0)
    assert torch.equal(fast_quantize(x, floorless).scale, quantize(x, floorless).scale)


# ------------------------------------------------------------------------------------------------
# dequantize-then-GEMM


def _dequant_then_gemm(a: Quantized, b: Quantized, bias, out_dtype, op_dtype):
    """The peers' pipeline: operands dequantized in fp32 and rounded to ``op_dtype``, an fp32 GEMM
    of those, bias added in fp32, one output rounding."""
    def deq(q):
        rows, cols = q.data.shape
        s = fp8ref.spec.quant.expand_scale(q.scale.float(), q.scheme, rows, cols)
        return (q.data.float() * s).to(op_dtype).float()

    y = deq(a) @ deq(b).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("op_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dequantize_then_gemm_within_its_bound(recipe, op_dtype):
    acc = Accumulation.BF16_OPERANDS if op_dtype == torch.bfloat16 else Accumulation.FP16_OPERANDS
    g = torch.Generator().manual_seed(5)
    M, N, K = 9, 12, 272
    for trial in range(4):
        x = torch.randn(M, K, generator=g) * (10.0 ** (trial - 1))
        x[:, :2] *= 300  # outlier channels
        w = torch.randn(N, K, generator=g) / 8
        if trial == 3:
            x[2] = 0  # a zero row
        bias = torch.randn(N, generator=g)
        qa, qb = quantize(x, recipe.activation), quantize(w, recipe.weight)
        for out_dtype in (torch.bfloat16, torch.float32):
            y = _dequant_then_gemm(qa, qb, bias, out_dtype, op_dtype)
            y_ref, _ = scaled_mm_exact(qa, qb, bias)
            bound = gemm_error_bound(qa, qb, bias, out_dtype=out_dtype, accumulation=acc, y_ref=y_ref)
            ratio = float(((y.double() - y_ref).abs() / bound).max())
            assert ratio <= 1.0, f"trial {trial} {out_dtype}: worst error/bound {ratio:.3f}"
            # ...and the strict fp32 bound does not cover it: the declaration is needed.
            if out_dtype == torch.float32 and trial == 0:
                strict = gemm_error_bound(qa, qb, bias, out_dtype=out_dtype, y_ref=y_ref)
                assert bool(((y.double() - y_ref).abs() > strict).any())


def test_dequantize_then_gemm_bound_is_tight():
    """Every dequantized operand sits just below a bf16 rounding midpoint, so each is rounded down by
    almost u_bf16 and all products err the same way: the error reaches > 0.95 of the bound."""
    M, N, K = 4, 4, 64
    scheme = QuantScheme(granularity="tensor", dynamic=False)
    s = 1 + 2.0**-8 - 2.0**-20  # exact in fp32; 1 * s rounds down to 1 in bf16
    qa = Quantized(torch.ones(M, K).to(torch.float8_e4m3fn), torch.tensor([[s]]), scheme)
    qb = Quantized(torch.ones(N, K).to(torch.float8_e4m3fn), torch.tensor([[s]]), scheme)
    y = _dequant_then_gemm(qa, qb, None, torch.float32, torch.bfloat16)
    y_ref, _ = scaled_mm_exact(qa, qb)
    bound = gemm_error_bound(qa, qb, out_dtype=torch.float32, accumulation=Accumulation.BF16_OPERANDS, y_ref=y_ref)
    ratio = float(((y.double() - y_ref).abs() / bound).min())
    assert 0.95 < ratio <= 1.0


def test_dequantize_then_gemm_declaration():
    acc = Accumulation.BF16_OPERANDS
    assert precision_class(acc, 1) is PrecisionClass.FAST
    assert acc.operand_dtype == torch.bfloat16 and acc.unit_roundoff == 2.0**-24
    with pytest.raises(ValueError, match="fp32 accumulation only"):
        Accumulation("x", 2.0**-8, operand_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="operand_dtype"):
        Accumulation("x", 2.0**-24, operand_dtype=torch.float32)
