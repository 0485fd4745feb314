"""The reference scaled GEMM against exact rational arithmetic, and its bad-input errors."""

import math
from fractions import Fraction

import pytest
import torch

import fp8ref
from fp8ref import Quantized, QuantScheme, quantize, scaled_mm
from fp8ref.spec.gemm import exact_plan, k_segments, scaled_mm_exact
from fp8ref.spec.quant import expand_scale


def _fraction_gemm(a: Quantized, b: Quantized, bias=None):
    """y = sum_k a_k b_k sa_k sb_k + bias in exact rationals (scales constant per segment)."""
    M, K = a.data.shape
    N = b.data.shape[0]
    av, bv = a.data.double().tolist(), b.data.double().tolist()
    sa = expand_scale(a.scale.double(), a.scheme, M, K).tolist()
    sb = expand_scale(b.scale.double(), b.scheme, N, K).tolist()
    out = []
    for m in range(M):
        row = []
        for n in range(N):
            acc = sum((Fraction(av[m][k]) * Fraction(bv[n][k]) * Fraction(sa[m][k]) * Fraction(sb[n][k])
                       for k in range(K)), Fraction(0))
            if bias is not None:
                acc += Fraction(float(bias[n]))
            row.append(acc)
        out.append(row)
    return out


def _codes(fmt, shape, g):
    """Random finite codes of ``fmt`` drawn by bit pattern."""
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    vals = bits.view(fmt.torch_dtype)
    bad = ~torch.isfinite(vals.float())
    return torch.where(bad, torch.zeros_like(bits), bits).view(fmt.torch_dtype)


@pytest.mark.parametrize("fmt_a,fmt_b", [("e4m3fn", "e4m3fn"), ("e5m2", "e5m2"), ("e4m3fnuz", "e4m3fnuz"),
                                         ("e4m3fn", "e5m2")])
def test_accumulation_is_exact_on_raw_codes(fmt_a, fmt_b):
    """With unit scales the float64 result *is* the exact rational sum (for E5M2 it is the
    float64 sum of at most 4 exact partial sums: checked against the stated bound)."""
    g = torch.Generator().manual_seed(7)
    sa = QuantScheme(format=fmt_a, granularity="tensor", dynamic=False)
    sb = QuantScheme(format=fmt_b, granularity="tensor", dynamic=False)
    a = Quantized(_codes(sa.format, (5, 33), g), torch.ones(1, 1), sa)
    b = Quantized(_codes(sb.format, (4, 33), g), torch.ones(1, 1), sb)
    y, n_inexact = scaled_mm_exact(a, b)
    exact = _fraction_gemm(a, b)
    bound = fp8ref.reference_gemm_error_bound(a, b)
    for m in range(5):
        for n in range(4):
            if n_inexact == 0:
                assert Fraction(float(y[m, n])) == exact[m][n]
            else:
                assert abs(Fraction(float(y[m, n])) - exact[m][n]) <= Fraction(float(bound[m, n]))
    assert n_inexact == (0 if "e5m2" not in (fmt_a, fmt_b) else len(exact_plan(sa.format, sb.format).pairs) - 1)


def test_cancellation_that_fp32_loses_is_exact():
    # 448*448 - 448*448 + 2**-9 * 2**-9: the tiny product survives exactly
    s = QuantScheme(granularity="tensor", dynamic=False)
    a = torch.tensor([[448.0, 2.0**-9, -448.0] * 300])
    b = torch.tensor([[448.0, 2.0**-9, 448.0] * 300])
    qa = quantize(a, s, scale=torch.tensor(1.0))
    qb = quantize(b, s, scale=torch.tensor(1.0))
    y = scaled_mm(qa, qb, out_dtype=torch.float64)
    assert float(y) == 300 * 2.0**-18
    y32 = (a @ b.T).item()
    assert y32 != 300 * 2.0**-18  # fp32 accumulation loses it: the reference must not


RECIPES = list(fp8ref.RECIPES.values())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("K", [1, 17, 130], ids=lambda k: f"K{k}")
def test_scaled_mm_matches_rationals_within_its_own_bound(recipe, K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(3, K, generator=g) * 5
    w = torch.randn(6, K, generator=g)
    bias = torch.randn(6, generator=g)
    qa, qb = quantize(x, recipe.activation), quantize(w, recipe.weight)
    y = scaled_mm(qa, qb, bias, out_dtype=torch.float64)
    exact = _fraction_gemm(qa, qb, bias)
    bound = fp8ref.reference_gemm_error_bound(qa, qb, bias)
    for m in range(3):
        for n in range(6):
            assert abs(Fraction(float(y[m, n])) - exact[m][n]) <= Fraction(float(bound[m, n]))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_output_is_rounded_once(out_dtype):
    g = torch.Generator().manual_seed(2)
    qa, qb = quantize(torch.randn(8, 64, generator=g)), quantize(torch.randn(16, 64, generator=g))
    y64 = scaled_mm(qa, qb, out_dtype=torch.float64)
    assert torch.equal(scaled_mm(qa, qb, out_dtype=out_dtype), y64.to(out_dtype))


def test_segments_are_the_union_of_block_edges():
    a = quantize(torch.randn(2, 300), QuantScheme(granularity="group", group_size=128))
    b = quantize(torch.randn(3, 300), QuantScheme(granularity="block", block=(2, 96)))
    assert k_segments(a, b) == [(0, 96), (96, 128), (128, 192), (192, 256), (256, 288), (288, 300)]
    r = quantize(torch.randn(3, 300), QuantScheme())
    assert k_segments(r, r) == [(0, 300)]


def test_m_zero_and_k_one():
    qa = quantize(torch.zeros(0, 8))
    qb = quantize(torch.randn(4, 8))
    assert scaled_mm(qa, qb).shape == (0, 4)
    p2 = QuantScheme(pow2_scale=True)  # power-of-two scales: every value below is represented exactly
    y = scaled_mm(quantize(torch.tensor([[2.0]]), p2), quantize(torch.tensor([[3.0], [-0.5]]), p2),
                  out_dtype=torch.float32)
    assert y.tolist() == [[6.0, -1.0]]


def test_bad_operands_raise():
    qa = quantize(torch.randn(2, 8))
    qb = quantize(torch.randn(3, 8))
    with pytest.raises(ValueError, match="K mismatch"):
        scaled_mm(qa, quantize(torch.randn(3, 9)))
    with pytest.raises(TypeError, match="Quantized"):
        scaled_mm(torch.randn(2, 8), qb)
    with pytest.raises(ValueError, match="bias must have shape"):
        scaled_mm(qa, qb, torch.randn(2))
    with pytest.raises(ValueError, match="NaN"):
        scaled_mm(qa, qb, torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(TypeError, match="out_dtype"):
        scaled_mm(qa, qb, out_dtype=torch.int32)


def test_e5m2_large_magnitudes_are_exact_where_float64_alone_is_not():
    # 57344^2 ~ 3.3e9 next to 2**-32: 64 binades, beyond one float64; the split keeps it
    s = QuantScheme(format="e5m2", granularity="tensor", dynamic=False)
    a = torch.tensor([[57344.0, 2.0**-16, -57344.0]])
    b = torch.tensor([[57344.0, 2.0**-16, 57344.0]])
    y = scaled_mm(quantize(a, s, scale=torch.tensor(1.0)), quantize(b, s, scale=torch.tensor(1.0)),
                  out_dtype=torch.float64)
    assert float(y) == 2.0**-32


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("route", ["table", "fp16"])
def test_widening_routes_equal_the_cast_on_every_code(fmt, route, monkeypatch):
    """The reference widens codes through fp16's bits or by a 256-entry lookup; either must give
    the cast's bits on every code (NaN codes included: an operand holding one the fp16 route gets
    wrong takes the table) and read strided column slices right."""
    from fp8ref.spec import gemm
    from fp8ref.spec.formats import get_format

    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.uint8).view(f.torch_dtype)
    table = gemm._value_table(f, codes.device)
    cast = codes.to(torch.float64)
    assert torch.equal(table.isnan(), cast.isnan())
    assert torch.equal(table[~cast.isnan()].view(torch.int64), cast[~cast.isnan()].view(torch.int64))
    # The codes the fp16 route gets wrong are found on the 256 codes: E4M3's NaN codes (fp16 reads
    # a number there); E5M2's NaN codes are fp16 NaNs.
    bad = gemm._fp16_route(f, codes.device).mismatch
    assert set(bad) == (set() if fmt == "e5m2" else set(f.nan_codes))
    g = torch.Generator().manual_seed(3)
    pool = torch.tensor([c for c in range(256) if route == "table" or c not in bad], dtype=torch.uint8)
    block = pool[torch.randint(0, len(pool), (7, 300), generator=g)]
    block[0, 37:37 + len(pool)] = pool  # every code of the pool at least once
    block = block.view(f.torch_dtype)
    monkeypatch.setattr(gemm, "_ROUTE_MIN_CODES", 1)  # the route on a small tile too
    widen = gemm._Widener(block, f, 7, 300)
    assert (widen.route is None) == (route == "table" and fmt != "e5m2")
    got = widen(block[:, 37:290]) * 2.0**-widen.log2_scale
    want = block[:, 37:290].to(torch.float64)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int64), want.nan_to_num().view(torch.int64))  # -0 kept


@pytest.mark.parametrize("fmt_a,fmt_b", [("e4m3fn", "e4m3fn"), ("e5m2", "e4m3fnuz"), ("e4m3fn", "e5m2")])
def test_accumulation_is_exact_across_tile_and_block_edges(fmt_a, fmt_b):
    """K over two widening tiles and a tail, N over a weight block edge and a tail (its tail
    block small enough for the table, the others on the fp16 route), against exact integer sums;
    a NaN code in one row of ``a`` (which would keep an E4M3 ``a`` off the route at any size):
    that row is NaN, the other exact."""
    from fp8ref.spec import gemm

    g = torch.Generator().manual_seed(11)
    sa = QuantScheme(format=fmt_a, granularity="tensor", dynamic=False)
    sb = QuantScheme(format=fmt_b, granularity="tensor", dynamic=False)
    M, K, N = 2, 2 * gemm._TILE + 3, gemm._BLOCK_N + 5
    a8, b8 = _codes(sa.format, (M, K), g), _codes(sb.format, (N, K), g)
    nan_code = sa.format.nan_codes[0]
    a8.view(torch.uint8)[1, K - 2] = nan_code
    a, b = Quantized(a8, torch.ones(1, 1), sa), Quantized(b8, torch.ones(1, 1), sb)
    y, n_inexact = scaled_mm_exact(a, b)
    pa = -sa.format.min_exponent + sa.format.mantissa_bits  # values are integers times 2**-p
    pb = -sb.format.min_exponent + sb.format.mantissa_bits
    ia = [[int(v * 2**pa) for v in row] for row in a8[:1].to(torch.float64).tolist()]
    ib = [[int(v * 2**pb) for v in row] for row in b8.to(torch.float64).tolist()]
    bound = fp8ref.reference_gemm_error_bound(a, b)
    for n in range(N):
        exact = Fraction(sum(x * w for x, w in zip(ia[0], ib[n], strict=True)), 2 ** (pa + pb))
        got = Fraction(float(y[0, n]))
        assert got == exact if n_inexact == 0 else abs(got - exact) <= Fraction(float(bound[0, n])), n
    assert bool(y[1].isnan().all())
    # (the routes as the shape's tiles take them: the table for a's E4M3, the fp16 route for b)
    assert (gemm._Widener(a8, sa.format, M, gemm._ROUTE_MIN_CODES).route is None) == (sa.format.exponent_bits == 4)
    assert gemm._Widener(b8, sb.format, gemm._BLOCK_N, gemm._TILE).route is not None


@pytest.mark.parametrize("fmt_b", ["e5m2", "e4m3fn"])
def test_e5m2_nan_and_inf_codes_propagate_as_ieee(fmt_b):
    """E5M2 operands are split by magnitude, and a split once dropped NaN and Inf (the result was
    finite). Now every output with a non-finite term is what IEEE float64 gives: Inf x finite is
    Inf, Inf x 0 and +Inf + -Inf are NaN, NaN is NaN; the others stay exact."""
    s = QuantScheme(format="e5m2", granularity="tensor", dynamic=False)
    sb = QuantScheme(format=fmt_b, granularity="tensor", dynamic=False)
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([[inf, 1.0, 2.0**-16], [-inf, inf, 1.0], [nan, 1.0, 1.0], [57344.0, 2.0**-16, 3.0]])
    b = torch.tensor([[2.0, 1.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.5]])
    qa = Quantized(a.to(torch.float8_e5m2), torch.ones(1, 1), s)
    qb = Quantized(b.to(sb.format.torch_dtype), torch.ones(1, 1), sb)
    y, _ = scaled_mm_exact(qa, qb)
    want = a.to(torch.float64) @ b.to(torch.float64).T
    assert torch.equal(y[:3].isnan(), want[:3].isnan()) and bool(y[1].isnan().all()) and bool(y[2].isnan().all())
    assert float(y[0, 0]) == inf and math.isnan(float(y[0, 1])) and float(y[0, 2]) == inf
    assert float(y[3, 0]) == 2 * 57344.0 + 2.0**-16 + 3.0  # exact: float64 alone gets this right too,
    assert float(y[3, 2]) == 57344.0 + 2.0**-16 + 1.5  # but it comes from the split parts here


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_blocking_changes_no_bit(fmt, monkeypatch):
    """Tiles, weight blocks and activation panels much smaller than the shape (and not dividing
    it) give the bits of the default blocking, per-group segments and E5M2's split included."""
    from fp8ref.spec import gemm

    g = torch.Generator().manual_seed(5)
    s = QuantScheme(format=fmt, granularity="group", group_size=64)
    a = quantize(torch.randn(37, 300, generator=g), s)
    b = quantize(torch.randn(45, 300, generator=g), s)
    want, n_want = scaled_mm_exact(a, b)
    absolute, _ = scaled_mm_exact(a, b, absolute=True)
    monkeypatch.setattr(gemm, "_TILE", 24)
    monkeypatch.setattr(gemm, "_BLOCK_N", 16)
    monkeypatch.setattr(gemm, "_A_PANEL", 37 * 48)  # two tiles per panel
    got, n_got = scaled_mm_exact(a, b)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64)) and n_got == n_want
    assert torch.equal(scaled_mm_exact(a, b, absolute=True)[0].view(torch.int64), absolute.view(torch.int64))


def test_flushed_subnormals_change_no_bit():
    """The fp16 route reads E4M3's subnormal codes as fp16 subnormals: it is checked under the
    floating-point environment of the call, so with subnormals flushed (torch.set_flush_denormal)
    the reference either still takes it correctly or falls back to the table: the same bits."""
    from fp8ref.spec import gemm

    g = torch.Generator().manual_seed(9)
    s = QuantScheme(granularity="tensor", dynamic=False)
    a8 = torch.randint(0, 16, (4, 512), generator=g, dtype=torch.uint8)  # +-0 and subnormals ...
    a8 |= torch.randint(0, 2, (4, 512), generator=g, dtype=torch.uint8) << 7
    b8 = _codes(s.format, (gemm._ROUTE_MIN_CODES // 512 + 1, 512), g)  # ... against a tile on the route
    a = Quantized(a8.view(s.format.torch_dtype), torch.ones(1, 1), s)
    b = Quantized(b8, torch.ones(1, 1), s)
    want, _ = scaled_mm_exact(a, b)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got, _ = scaled_mm_exact(a, b)
        got_b, _ = scaled_mm_exact(b, b)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert torch.equal(got_b.view(torch.int64), scaled_mm_exact(b, b)[0].view(torch.int64))
