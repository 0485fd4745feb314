"""Scale conventions of a scheme (docs/spec.md §3.1) and the dequantize-then-GEMM declaration (§5.2):
the reference implements each convention as written, and the operand-rounding bound is sound on
random and adversarial operands and tight on operands built to round the same way."""

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref import Accumulation, PrecisionClass, Quantized, QuantScheme, quantize
from fp8ref.peers import Peer
from fp8ref.spec.bounds import gemm_error_bound, precision_class, scale_error_bound
from fp8ref.spec.gemm import scaled_mm_exact
from fp8ref.spec.quant import compute_scale

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


def _fp32(v: float) -> np.float32:
    return np.float32(v)


def _reciprocal_scale_np(amax: np.float32, qmax: float, floor: float, zero: float, lowest: float) -> float:
    """1 / (qmax / max(amax, floor)) as the peers evaluate it, in numpy fp32 (written here, not read
    from fp8ref): two IEEE fp32 divisions; an Inf multiplier gives 0, which takes the zero-block scale."""
    with np.errstate(over="ignore", divide="ignore"):
        m = _fp32(qmax) / np.maximum(amax, _fp32(floor))
        s = _fp32(1.0) / m
    return zero if s == 0 else max(float(s), lowest)


# every kind of amax: 0, subnormal, where qmax / amax overflows fp32 (amax < qmax / 2**128) and
# where it does not but 1 / m is subnormal, tiny normal, exactly representable quotients (448, 1),
# a value whose two roundings differ from the quotient's one, and the largest finite fp32.
_EDGE_AMAX = (0.0, 2.0**-149, 2.0**-133, 2.0**-126, 2.0**-119, 2.0**-118, 1e-30, 1e-12, 2.0**-9, 0.1, 1.0, 3.0,
              448.0, 1000.0, 12345.678, 57344.0, 1e30, float(torch.finfo(torch.float32).max))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("floor,subnormal", [(0.0, False), (0.0, True), (1e-12, False)])
def test_reciprocal_scale_is_the_peers_two_roundings_bit_for_bit(fmt, floor, subnormal):
    scheme = QuantScheme(format=fmt, amax_floor=floor, reciprocal_scale=True, subnormal_scales=subnormal)
    qmax = scheme.qmax
    x = torch.tensor(_EDGE_AMAX, dtype=torch.float32)[:, None] * torch.tensor([[1.0, -0.5, 0.0]])
    x[:, 1] = -x[:, 0]  # the amax is the row's first element, also with a negative sign
    got = quantize(x, scheme)
    fi = torch.finfo(torch.float32)
    lowest = fi.smallest_normal * (fi.eps / 2 if subnormal else 1)  # smallest subnormal or normal
    want = [_reciprocal_scale_np(_fp32(a), qmax, floor, 1.0, lowest) for a in _EDGE_AMAX]
    assert got.scale.flatten().tolist() == want
    # the codes divide by the stored scale: x ~ q * s within the quantization bound
    err = (got.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= fp8ref.quantization_error_bound(x, got)).all())


def test_reciprocal_scale_is_within_one_grid_step_of_the_quotient_and_often_not_equal():
    """Every fp32 amax of one binade (2**23 values; scaling amax by a power of two scales both forms
    exactly, so one binade stands for all normal amaxes whose multiplier does not overflow): the two
    roundings move the scale off the correctly rounded quotient on about a quarter of them, never by
    more than the one grid step ``quantize.scale`` admits -- so a bit-exact column is what needs
    the declaration."""
    x = torch.arange(2**23, dtype=torch.int32).bitwise_or(0x3F800000).view(torch.float32)[:, None]  # [1, 2)
    quot = compute_scale(x, QuantScheme(amax_floor=0.0))
    recip = compute_scale(x, QuantScheme(amax_floor=0.0, reciprocal_scale=True))
    steps = (recip.double() - quot.double()).abs() / scale_error_bound(quot, QuantScheme(amax_floor=0.0))
    assert float(steps.max()) == 1.0
    assert 0.2 < float((steps > 0).double().mean()) < 0.35


def test_multiplier_by_reciprocal_is_torchs_float_over_tensor_bit_for_bit():
    """SGLang's ``input_to_float8`` writes ``448 / amax`` with a Python float over a tensor, which torch
    evaluates as ``448 * (1 / amax)``: the spec's scale and codes equal that form computed in numpy,
    and over every fp32 amax of a binade the scale is two grid steps from the quotient on 0.9 % of
    them -- outside the one step ``quantize.scale`` admits for an undeclared quotient."""
    x = _tie_rows(4)
    scheme = QuantScheme(granularity="row", reciprocal_scale=True, multiplier_by_reciprocal=True, multiply_codes=True)
    q = quantize(x, scheme)
    amax = np.maximum(np.abs(x.numpy()).max(axis=1, keepdims=True), np.float32(1e-12))
    m = (np.float32(1.0) / amax) * np.float32(448.0)
    assert q.scale.numpy().tolist() == (np.float32(1.0) / m).tolist()
    assert torch.equal(q.data.view(torch.uint8), _codes_np(x.numpy(), m, 448.0, q.scheme.format).view(torch.uint8))
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= fp8ref.quantization_error_bound(x, q)).all())
    a = torch.arange(2**23, dtype=torch.int32).bitwise_or(0x3F800000).view(torch.float32)[:, None]
    quot = compute_scale(a, QuantScheme(amax_floor=0.0))
    three = compute_scale(a, QuantScheme(amax_floor=0.0, reciprocal_scale=True, multiplier_by_reciprocal=True))
    steps = (three.double() - quot.double()).abs() / scale_error_bound(quot, QuantScheme(amax_floor=0.0))
    assert float(steps.max()) == 2.0 and 0.005 < float((steps == 2).double().mean()) < 0.015
    with pytest.raises(ValueError, match="needs reciprocal_scale or multiplier_scale"):
        QuantScheme(multiplier_by_reciprocal=True)
    assert scheme.short_str() == "e4m3fn-row-dyn-recip-rmul-mul" and not scheme.standard_scale_rule


def test_reciprocal_scale_is_declared_validated_and_named():
    s = QuantScheme(reciprocal_scale=True)
    assert s.short_str() == "e4m3fn-row-dyn-recip" and "recip" in repr(s)
    assert not s.standard_scale_rule and s != QuantScheme() and hash(s) != hash(QuantScheme())
    with pytest.raises(ValueError, match="reciprocal_scale must be a bool"):
        QuantScheme(reciprocal_scale=1)
    with pytest.raises(ValueError, match="static scheme"):
        QuantScheme(reciprocal_scale=True, dynamic=False)
    with pytest.raises(ValueError, match="computed in fp32"):
        QuantScheme(reciprocal_scale=True, scale_compute_dtype=torch.bfloat16)
    from fp8ref.kernels._common import fast_quantize

    x = torch.randn(5, 33)
    assert torch.equal(fast_quantize(x, s).scale, quantize(x, s).scale)  # the fast path defers


class _Reciprocal(Peer):
    """A quantizer that writes its scale as 1 / (qmax / amax) (``wrong``: as amax / qmax instead)."""

    name, project, distribution, entry, notes = "fake-recip", "fake", "torch", "fake", "s = 1 / (qmax / amax)"
    ops = ("quantize",)
    wrong = False

    def conventions(self, scheme, x_dtype):
        ok = scheme.dynamic and scheme.scale_compute_dtype == torch.float32
        return scheme.with_(reciprocal_scale=True) if ok else scheme

    def supports(self, case):
        s = case.recipe.activation
        ok = (s.granularity.value == "row" and s.dynamic and s.reciprocal_scale and s.scale_dtype == torch.float32
              and not s.pow2_scale and s.zero_scale == 1.0 and not s.subnormal_scales and s.amax_floor > 0)
        return None if ok else "row, dynamic, fp32, reciprocal scales with a floor"

    def quantize(self, x, scheme, scale=None):
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=scheme.amax_floor)
        if self.wrong:
            s = amax / scheme.qmax
        else:
            s = 1 / (torch.full_like(amax, scheme.qmax) / amax)
        s = s.clamp(min=torch.finfo(torch.float32).smallest_normal)
        return Quantized((x.float() / s).clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype), s, scheme)


def test_a_declared_reciprocal_scale_is_bit_exact_and_the_quotient_is_not():
    from fp8ref.peers.certify import certify_peer

    right = certify_peer(_Reciprocal(), "dev", seed=0, contracts=["quantize.codes", "quantize.bit_exact"])
    assert right.exact_scales == 100.0 and right.exact_codes == 100.0
    assert right.report.result("quantize.codes").status == "pass"
    assert right.report.result("quantize.bit_exact").status == "yes"
    wrong = _Reciprocal()
    wrong.wrong = True
    cert = certify_peer(wrong, "dev", seed=0, contracts=["quantize.bit_exact"])
    assert cert.exact_scales < 90.0
    assert cert.report.result("quantize.bit_exact").status == "no"


def _codes_np(x: np.ndarray, m: np.ndarray, qmax: float, fmt) -> torch.Tensor:
    """RNE(clamp(fl32(x * m))) with the product in numpy fp32 and torch's saturating RNE cast."""
    v = np.clip(x.astype(np.float32) * m.astype(np.float32), -qmax, qmax)
    return torch.from_numpy(v).to(fmt.torch_dtype)


def _tie_rows(seed: int) -> torch.Tensor:
    """Rows whose x / s sit on or next to FP8 ties: where x * (1 / s) and x / s round apart."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(64, 1, generator=g) * 2.0 ** torch.randint(-20, 20, (64, 1), generator=g).float() + 1e-3
    grid = torch.randint(-447, 448, (64, 63), generator=g).float() + 0.5  # halfway between integers: ties
    x = torch.cat([amax, grid / 448 * amax], dim=1).float()
    return x


@pytest.mark.parametrize("reciprocal", [False, True])
def test_multiply_codes_are_x_times_the_multiplier_bit_for_bit(reciprocal):
    scheme = QuantScheme(amax_floor=0.0, reciprocal_scale=reciprocal, multiply_codes=True)
    x = _tie_rows(1)
    q = quantize(x, scheme)
    xn = x.numpy()
    amax = np.abs(xn).max(axis=1, keepdims=True)
    if reciprocal:  # the multiplier the scale came from: the stored scale is its fp32 reciprocal
        m = np.float32(448.0) / amax
        assert q.scale.numpy().tolist() == (np.float32(1.0) / m).tolist()
    else:  # the reciprocal of the stored (quotient) scale
        assert q.scale.numpy().tolist() == (amax / np.float32(448.0)).tolist()
        m = np.float32(1.0) / q.scale.numpy()
    assert torch.equal(q.data.view(torch.uint8), _codes_np(xn, m, 448.0, q.scheme.format).view(torch.uint8))
    divided = quantize(x, scheme.with_(multiply_codes=False))
    assert torch.equal(q.scale, divided.scale)
    assert not torch.equal(q.data.view(torch.uint8), divided.data.view(torch.uint8))  # the field matters
    for r in (q, divided):  # ...and both are within the one quantization bound (d = 2)
        err = (r.dequantize(torch.float64) - x.double()).abs()
        assert bool((err <= fp8ref.quantization_error_bound(x, r)).all())


def test_multiply_codes_never_multiply_by_an_infinite_reciprocal():
    """A kept subnormal scale has 1 / s = Inf: such blocks divide (0 * Inf would be a NaN code), and an
    all-zero row with no floor gets zero_scale and codes 0."""
    x = torch.tensor([[2.0**-140, 0.0, -2.0**-141], [0.0, 0.0, 0.0], [1.0, 0.5, -0.25]])
    for extra in ({"subnormal_scales": True}, {"reciprocal_scale": True, "subnormal_scales": True}, {}):
        scheme = QuantScheme(amax_floor=0.0, multiply_codes=True, **extra)
        q = quantize(x, scheme)
        ref = quantize(x, scheme.with_(multiply_codes=False))
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), extra
        assert q.scale[1].item() == 1.0 and not bool(torch.isnan(q.data.float()).any())


def test_multiplier_scale_stores_m_and_dequantizes_by_dividing():
    """torchao's float8 training: m = fl32(qmax / max(amax, 1e-12)) (torchao divides in fp64 and rounds
    to fp32, the same number), codes RNE(clamp(fl32(x * m))), x ~ q / m."""
    scheme = QuantScheme(granularity="tensor", multiply_codes=True, multiplier_scale=True)
    for x in (_tie_rows(2), torch.zeros(3, 5), torch.full((2, 2), 1e-14), torch.randn(7, 9, dtype=torch.bfloat16)):
        q = quantize(x, scheme)
        amax = max(float(x.abs().max()), 1e-12)
        m = np.float32(np.float64(448.0) / amax)  # fp64 quotient rounded to fp32: written here, as torchao
        assert q.scale.item() == float(m)
        assert torch.equal(q.data.view(torch.uint8),
                           _codes_np(x.float().numpy(), np.float32(m), 448.0, q.scheme.format).view(torch.uint8))
        deq = q.dequantize(torch.float64)
        assert torch.equal(deq, q.data.double() / float(m))
        assert bool(((deq - x.double()).abs() <= fp8ref.quantization_error_bound(x, q)).all())
    zero = quantize(torch.zeros(2, 3), scheme.with_(amax_floor=0.0, granularity="row"))
    assert zero.scale.flatten().tolist() == [1.0, 1.0] and zero.data.float().abs().sum().item() == 0.0


def test_multiplier_scale_bound_is_tight_and_sound_on_ties():
    scheme = QuantScheme(multiply_codes=True, multiplier_scale=True, amax_floor=0.0)
    x = _tie_rows(3)
    q = quantize(x, scheme)
    ratio = (q.dequantize(torch.float64) - x.double()).abs() / fp8ref.quantization_error_bound(x, q)
    assert 0.99 < float(ratio.max()) <= 1.0


def test_multiplier_schemes_are_validated_and_refused_by_gemm_and_linear():
    mult = QuantScheme(granularity="tensor", multiply_codes=True, multiplier_scale=True)
    assert mult.short_str() == "e4m3fn-tensor-dyn-mul-smult" and not mult.standard_scale_rule
    assert QuantScheme(multiply_codes=True).short_str() == "e4m3fn-row-dyn-mul"
    assert not QuantScheme(multiply_codes=True).standard_scale_rule
    with pytest.raises(ValueError, match="set multiply_codes=True too"):
        QuantScheme(multiplier_scale=True)
    with pytest.raises(ValueError, match="choose one"):
        QuantScheme(multiplier_scale=True, multiply_codes=True, reciprocal_scale=True)
    with pytest.raises(ValueError, match="fp32 multipliers"):
        QuantScheme(multiplier_scale=True, multiply_codes=True, scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiply_codes must be a bool"):
        QuantScheme(multiply_codes="yes")
    a = quantize(torch.randn(4, 16), mult)
    b = quantize(torch.randn(8, 16), QuantScheme(granularity="tensor"))
    with pytest.raises(ValueError, match="a was quantized as e4m3fn-tensor-dyn-mul-smult, whose scale is a multiplier"):
        fp8ref.scaled_mm(a, b)
    with pytest.raises(ValueError, match="b was quantized as .* multiplier"):
        scaled_mm_exact(b.__class__(b.data, b.scale, b.scheme), a)
    recipe = fp8ref.Recipe("torchao-training", mult, mult)
    with pytest.raises(ValueError, match="weight scheme e4m3fn-tensor-dyn-mul-smult stores a multiplier"):
        fp8ref.linear(torch.randn(2, 16), torch.randn(8, 16), recipe=recipe)


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
            # ...and the strict fp32 bound does not cover it: the declaration is needed. Power-of-two
            # scales (MX, UE8M0) make every dequantized operand exact in bf16 and fp16 (a code times
            # 2**e, inside their ranges here), so there the operands' rounding never happens.
            pow2 = recipe.activation.pow2_scale and recipe.weight.pow2_scale
            if out_dtype == torch.float32 and trial == 0:
                strict = gemm_error_bound(qa, qb, bias, out_dtype=out_dtype, y_ref=y_ref)
                assert bool(((y.double() - y_ref).abs() > strict).any()) != pow2


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
