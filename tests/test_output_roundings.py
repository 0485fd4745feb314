"""More than two output roundings (docs/spec.md §5.2, "More than one output rounding").

The bound of ``output_roundings = k`` is one code path for every k (``bounds._pipeline_error``); the
tests show that it leaves k = 1 and k = 2 as they were, bit for bit, that a kernel which rounds the
product, the scaled value and the bias sum apart is certified when it declares 3 and caught when it
declares fewer, that the k = 3 bound holds (and is nearly reached) on adversarial inputs, and that a
kernel rounding four times is caught when it declares 3.
"""

import hashlib
import sys

import pytest
import torch

import fp8ref
from fp8ref import Accumulation, PrecisionClass, QuantScheme, quantize
from fp8ref.conformance import check, get_profile
from fp8ref.registry import register_backend, unregister_backend
from fp8ref.spec.bounds import gemm_error_bound, linear_error_bound, precision_class
from fp8ref.spec.gemm import scaled_mm_exact
from fp8ref.spec.quant import Quantized

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mutants.catalogue import ThreeRoundings, TwoRoundings  # noqa: E402

ACCUMULATIONS = (Accumulation.EXACT, Accumulation.FP32, Accumulation.FAST, Accumulation.BF16,
                 Accumulation("fast-promote32", 2.0**-13, promote_every=32), Accumulation.BF16_OPERANDS,
                 Accumulation.FP16_OPERANDS)


# --------------------------------------------------------------------------------------------
# k = 1 and k = 2: unchanged


def _ramp(rows, cols, mul, mod, div):
    """Values from IEEE +, *, /, % only: the same bits on every CPU (randn and sin are vectorized
    differently per instruction set, which would change the digest, not the bound's code)."""
    i = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
    return (((i * mul) % mod - mod // 2) / div).to(torch.float32)


def _operand(scheme, rows, cols, mul, mod, div):
    """Codes and scales written directly (no quantizer: the digest is about the bounds alone), large
    codes in the first two columns, positive scales of ``scheme``'s layout and dtype."""
    v = _ramp(rows, cols, mul, mod, div)
    v[:, :2] *= 64
    codes = v.clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
    shape = scheme.scale_shape(rows, cols)
    s = (1 + torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape) * 0.37 % 3) / 1000
    return Quantized(codes, s.to(scheme.scale_dtype), scheme)


def _corpus():
    M, N, K = 3, 5, 160
    e5m2 = QuantScheme(format="e5m2")
    # The presets of 9e6192a, where the digests were taken (later presets would change the corpus).
    presets = ("w8a8_fp8", "fp8", "fp8_block", "fp8_dynamic", "w8a8_fp8_rocm")
    for r in [*(fp8ref.RECIPES[n] for n in presets), fp8ref.Recipe("e5m2", e5m2, e5m2)]:
        qa = _operand(r.activation, M, K, 37, 101, 7.3)
        qa.data[1] = 0  # a zero row
        yield qa, _operand(r.weight, N, K, 53, 89, 6.1), _ramp(1, N, 11, 13, 3.0)[0]


def _digest(k):
    h = hashlib.sha256()
    for qa, qb, bias in _corpus():
        for out in (torch.bfloat16, torch.float16, torch.float32):
            for b in (None, bias.to(out)):
                for acc in ACCUMULATIONS:
                    h.update(gemm_error_bound(qa, qb, b, out_dtype=out, accumulation=acc,
                                              output_roundings=k).numpy().tobytes())
    return h.hexdigest()


#: ``_digest(1)`` and ``_digest(2)`` computed by the bounds before they took k >= 3 (commit 9e6192a,
#: where output_roundings was 1 or 2, run from ``git archive 9e6192a``); the same with AVX-512 and
#: scalar ATen kernels (ATEN_CPU_CAPABILITY) and 1 or 2 threads: the corpus's float64 GEMMs are
#: exact, so nothing in it depends on a BLAS's summation order.
DIGESTS_BEFORE = {1: "a3e82838d49e5850c91babe72c85c85d0d68b3277fa5b536e067fe3afebe4e29",
                  2: "170d5523d6a3a037283701e18614f2ab3cd75ec917d15c4051062dba30825e51"}


@pytest.mark.parametrize("k", [1, 2])
def test_one_and_two_roundings_are_unchanged_bit_for_bit(k):
    assert _digest(k) == DIGESTS_BEFORE[k]


def test_the_corpus_has_no_fp32_underflow():
    """Where fp32 products can underflow, k = 2 now also rounds the underflow term (docs/spec.md): the
    digest is a statement about the inputs where nothing else changed."""
    from fp8ref.spec.bounds import _underflow_mass
    from fp8ref.spec.gemm import k_segments

    for qa, qb, _ in _corpus():
        assert _underflow_mass(qa, qb, k_segments(qa, qb)) is None


# --------------------------------------------------------------------------------------------
# the declaration


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_output_roundings_must_be_an_int_of_at_least_one(bad):
    qa, qb, _ = next(_corpus())
    x, w = qa.dequantize(torch.float32), qb.dequantize(torch.float32)
    with pytest.raises(ValueError, match="output_roundings"):
        precision_class(Accumulation.FP32, bad)
    with pytest.raises(ValueError, match="output_roundings"):
        gemm_error_bound(qa, qb, output_roundings=bad)
    with pytest.raises(ValueError, match="output_roundings"):
        linear_error_bound(x, w, qa, qb, output_roundings=bad)

    class Bad(TwoRoundings):
        name = "test-bad-output-roundings"
        output_roundings = bad

    with pytest.raises(ValueError, match=r"test-bad-output-roundings.*output_roundings"):
        register_backend(Bad())
    with pytest.raises(ValueError, match="output_roundings"):  # unregistered: check() refuses it too
        check(Bad(), "ci", contracts=["scaled_mm.bound"])
    with pytest.raises(KeyError):
        fp8ref.get_backend("test-bad-output-roundings")


def test_a_three_rounding_backend_registers():
    b = register_backend(ThreeRoundings())
    try:
        assert fp8ref.get_backend(b.name).precision is PrecisionClass.FAST
    finally:
        unregister_backend(b.name)


@pytest.mark.parametrize(("acc", "k", "klass"), [
    (Accumulation.EXACT, 1, PrecisionClass.EXACT), (Accumulation.EXACT, 2, PrecisionClass.STANDARD),
    (Accumulation.EXACT, 3, PrecisionClass.FAST), (Accumulation.FP32, 1, PrecisionClass.STRICT),
    (Accumulation.FP32, 2, PrecisionClass.STANDARD), (Accumulation.FP32, 3, PrecisionClass.FAST),
    (Accumulation.FP32, 7, PrecisionClass.FAST), (Accumulation.BF16, 3, PrecisionClass.FAST)])
def test_precision_class_of_k_roundings(acc, k, klass):
    assert precision_class(acc, k) is klass


@pytest.mark.parametrize("acc", ACCUMULATIONS, ids=lambda a: a.name)
def test_each_rounding_widens_the_bound(acc):
    for qa, qb, bias in _corpus():
        for out in (torch.bfloat16, torch.float16):
            b = [gemm_error_bound(qa, qb, bias.to(out), out_dtype=out, accumulation=acc, output_roundings=k)
                 for k in (1, 2, 3, 4)]
            for lo, hi in zip(b[:-1], b[1:], strict=True):  # a zero row: the increment is below its last bit
                assert bool((hi >= lo).all()) and bool((hi > lo).any())


# --------------------------------------------------------------------------------------------
# a kernel that rounds the product, the scaled value and the bias sum apart

PROFILE = get_profile("ci").with_(shrink=False)
CONTRACTS = ["scaled_mm.bound", "linear.bound"]


def test_three_rounding_kernel_is_certified_when_it_declares_three():
    report = check(ThreeRoundings(), PROFILE, seed=0, contracts=CONTRACTS, ops=("scaled_mm", "linear"))
    assert report.passed, report.to_text()


@pytest.mark.parametrize("declared", [1, 2])
def test_three_rounding_kernel_is_caught_when_it_declares_fewer(declared):
    class Undeclared(ThreeRoundings):
        name = f"three-roundings-declared-{declared}"
        output_roundings = declared

    report = check(Undeclared(), PROFILE, seed=0, contracts=CONTRACTS, ops=("scaled_mm", "linear"), fail_fast=True)
    assert report.verdict == "fail"
    assert report.failures[0].contract == "scaled_mm.bound"


E4M3 = QuantScheme(format="e4m3fn", granularity="tensor", dynamic=False)


def _tensor(codes, scale):
    t = torch.tensor(codes, dtype=torch.float32)
    assert torch.equal(t.to(torch.float8_e4m3fn).float(), t)  # codes on the grid
    return Quantized(t.to(torch.float8_e4m3fn), torch.tensor([[scale]], dtype=torch.float32), E4M3)


def _four_roundings(a, b, bias, out_dtype):
    """acc (fp32) -> fl_o -> * sa -> fl_o -> * sb -> fl_o -> + bias -> fl_o: one rounding more than
    ``ThreeRoundings`` (between the two scales, which the k-rounding model of docs/spec.md leaves out)."""
    y = (a.data.float() @ b.data.float().T).to(out_dtype).float()
    y = (y * a.scale.float()).to(out_dtype).float()
    y = (y * b.scale.float()).to(out_dtype).float()
    return (y + bias.float()).to(out_dtype)


def _below_midpoints(out_dtype, scale_b_too):
    """Every rounding of the three-rounding epilogue just below a midpoint above 1, so each loses
    almost u_o, with one sign: the accumulator S = 1 + u_o - u_o/16 (codes 1, 2**-9 * u_o 2**9 and
    -2**-9 * u_o 2**5) rounds to 1; sa = 1 + u_o - 2**-20 makes 1 * sa round to 1 again; a bias of -1
    cancels what is left, so the final rounding is exact and the intermediate errors are the whole
    error. With ``scale_b_too`` sb is sa: the four-rounding kernel loses u_o a third time."""
    u = fp8ref.spec.bounds.unit_roundoff(out_dtype)
    s = 1 + u - 2.0**-20
    a = _tensor([[1.0, 2.0**-9, -(2.0**-9)]], s)
    b = _tensor([[1.0, u * 2.0**9, u * 2.0**5]], s if scale_b_too else 1.0)
    return a, b, torch.tensor([-1.0]).to(out_dtype)


def _ratio(y, a, b, bias, out_dtype, k):
    y_ref, _ = scaled_mm_exact(a, b, bias)
    bound = gemm_error_bound(a, b, bias, out_dtype=out_dtype, output_roundings=k, y_ref=y_ref)
    return float(((y.double() - y_ref).abs() / bound).max())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_three_roundings_exceed_the_two_rounding_bound_and_nearly_reach_their_own(out_dtype):
    a, b, bias = _below_midpoints(out_dtype, scale_b_too=False)
    y = ThreeRoundings().scaled_mm(a, b, bias, out_dtype)
    assert _ratio(y, a, b, bias, out_dtype, 2) > 1.8  # two roundings lost ~u_o each, one was allowed
    assert 0.9 <= _ratio(y, a, b, bias, out_dtype, 3) <= 1.0  # sound, and nearly reached


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_four_roundings_exceed_the_three_rounding_bound(out_dtype):
    a, b, bias = _below_midpoints(out_dtype, scale_b_too=True)
    y = _four_roundings(a, b, bias, out_dtype)
    assert _ratio(y, a, b, bias, out_dtype, 3) > 1.3  # three intermediate roundings lost ~u_o each
    assert _ratio(ThreeRoundings().scaled_mm(a, b, bias, out_dtype), a, b, bias, out_dtype, 3) <= 1.0


@pytest.mark.parametrize("out_dtype", [torch.bfloat16], ids=str)
def test_three_rounding_bound_holds_on_adversarial_inputs(out_dtype):
    """Scales just below a midpoint of the output grid (times powers of two), random codes, a bias
    that cancels the result, several K-segments: the epilogue's roundings are as large as they get,
    and the k = 3 bound still holds for the scaled_mm and for the linear. (bf16 only: the kernel
    declines fp16, whose range the raw accumulator of codes overflows.)"""
    g = torch.Generator().manual_seed(34)
    u = fp8ref.spec.bounds.unit_roundoff(out_dtype)
    be = ThreeRoundings()
    worst = 0.0
    for trial in range(24):
        M, N, K = 4, 6, 96
        recipe = list(fp8ref.RECIPES.values())[trial % len(fp8ref.RECIPES)]
        x = torch.randn(M, K, generator=g) * 2.0 ** (trial % 7 - 3)
        w = torch.randn(N, K, generator=g)
        qa, qb = quantize(x, recipe.activation), quantize(w, recipe.weight)
        e = torch.floor(torch.log2(qa.scale.float()))
        qa = Quantized(qa.data, (torch.exp2(e) * (1 + u - 2.0**-20)).to(qa.scale.dtype), qa.scheme)
        y0, _ = scaled_mm_exact(qa, qb)
        bias = (-y0[trial % M]).to(out_dtype)
        y = be.scaled_mm(qa, qb, bias, out_dtype)
        worst = max(worst, _ratio(y, qa, qb, bias, out_dtype, 3))
        if recipe.activation.dynamic:
            xl = x.to(out_dtype)
            yl = be.linear(xl, be.quantize(w, recipe.weight), bias, out_dtype=out_dtype, scheme=recipe.activation)
            bl = linear_error_bound(xl, w, quantize(xl, recipe.activation), quantize(w, recipe.weight), bias,
                                    out_dtype=out_dtype, accumulation=be.accumulation, output_roundings=3)
            y_true = xl.double() @ w.double().T + bias.double()
            assert float(((yl.double() - y_true).abs() / bl).max()) <= 1.0
    assert worst <= 1.0, f"worst error/bound {worst:.3f}"


E5M2 = QuantScheme(format="e5m2", granularity="tensor", dynamic=False)


def test_an_accumulator_rounded_in_the_subnormal_range_needs_the_absolute_term():
    """E5M2 subnormal codes whose exact accumulator 127 * 2**-32 is just below half of fp16's smallest
    subnormal (2**-25): rounding it to fp16 gives 0, and the scales sa = sb = 2**20 carry that
    absolute error to 32512 -- all of y. The two-rounding bound's eta_o/2 * |sa sb| term covers it,
    nearly reached; the one-rounding bound does not."""
    codes = [3 * 2.0**-16] * 14 + [2.0**-16]
    a = Quantized(torch.tensor([codes]).to(torch.float8_e5m2), torch.tensor([[2.0**20]]), E5M2)
    b = Quantized(torch.tensor([[3 * 2.0**-16] * 14 + [2.0**-16]]).to(torch.float8_e5m2), torch.tensor([[2.0**20]]),
                  E5M2)
    y = ThreeRoundings().scaled_mm(a, b, None, torch.float16)  # no bias: two roundings
    assert float(y) == 0.0
    assert 0.9 <= _ratio(y, a, b, None, torch.float16, 2) <= 1.0
    assert _ratio(y, a, b, None, torch.float16, 1) > 1.0


@pytest.mark.parametrize("exp", [-40, -60, -75])
def test_three_rounding_bound_holds_with_tiny_scales(exp):
    """Scales small enough that fp32 products can underflow (the bound's underflow term is on) and
    bf16 results in or near bf16's subnormal range."""
    g = torch.Generator().manual_seed(exp)
    be = ThreeRoundings()
    for recipe in fp8ref.RECIPES.values():
        x, w = torch.randn(4, 64, generator=g), torch.randn(6, 64, generator=g)
        qa, qb = quantize(x, recipe.activation), quantize(w, recipe.weight)
        qa = Quantized(qa.data, qa.scale * 2.0**exp, qa.scheme)
        qb = Quantized(qb.data, qb.scale * 2.0**exp, qb.scheme)
        bias = (-scaled_mm_exact(qa, qb)[0][0]).to(torch.bfloat16)
        for b in (None, bias):
            assert _ratio(be.scaled_mm(qa, qb, b, torch.bfloat16), qa, qb, b, torch.bfloat16, 3) <= 1.0


def test_growth_beyond_the_unused_allowance():
    """The absolute error of an intermediate rounding needs an explicit growth factor only where the
    fp32 epilogue's gamma_{nseg+3} exceeds u_o (docs/spec.md §5.2)."""
    from fp8ref.spec.bounds import U_FP32, _growth, gamma

    u16, ubf = 2.0**-11, 2.0**-8
    assert _growth(U_FP32, u16, 8185) == 1.0 and _growth(U_FP32, u16, 8186) == 1 + gamma(8189, U_FP32)
    assert _growth(U_FP32, ubf, 65277) == 1.0 and _growth(U_FP32, ubf, 65278) > 1.0
    assert _growth(U_FP32, U_FP32, 10**6) == 1.0  # fp32 out of an fp32 epilogue: exact
    assert _growth(0.0, U_FP32, 10**6) == 1.0  # the exact pipeline's float64 epilogue
