"""The reference quantizer: arithmetic pinned by the spec, edge cases, bad input."""

import math

import pytest
import torch

import fp8ref
from fp8ref import QuantScheme, quantize
from fp8ref.spec.quant import expand_scale

SCHEMES = [
    QuantScheme(),
    QuantScheme(granularity="tensor"),
    QuantScheme(granularity="group", group_size=16),
    QuantScheme(granularity="block", block=(4, 16)),
    QuantScheme(format="e5m2"),
    QuantScheme(format="e4m3fnuz", qmax=224.0),
    QuantScheme(pow2_scale=True),
    QuantScheme(scale_dtype=torch.bfloat16),
    QuantScheme(scale_dtype=torch.float16),
]
IDS = [s.short_str() for s in SCHEMES]


def _spec_quantize(x, scheme):
    """The spec's equations written out a second, independent way (a loop over blocks)."""
    rows, cols = x.shape
    r, c = scheme.block_shape(rows, cols)
    sr, sc = scheme.scale_shape(rows, cols)
    scale = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            blk = x[i * r:(i + 1) * r, j * c:(j + 1) * c].float()
            amax = blk.abs().max() if blk.numel() else torch.tensor(0.0)
            s = torch.maximum(amax, torch.tensor(scheme.amax_floor)) / scheme.qmax
            if float(s) == 0:
                s = torch.tensor(1.0)
            if scheme.pow2_scale:
                s = torch.tensor(2.0 ** math.ceil(math.log2(float(s))))
            s = torch.clamp(s, min=torch.finfo(scheme.scale_dtype).tiny).to(scheme.scale_dtype).float()
            scale[i, j] = s
    v = x.float() / expand_scale(scale, scheme, rows, cols)
    q = torch.clamp(v, -scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
    return q, scale.to(scheme.scale_dtype)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_the_written_out_equations(scheme, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 40, generator=g) * torch.logspace(-3, 2, 40)).to(dtype)
    x[2] = 0  # an all-zero row
    q = quantize(x, scheme)
    q2, s2 = _spec_quantize(x, scheme)
    assert torch.equal(q.scale, s2)
    assert torch.equal(q.data.view(torch.uint8), q2.view(torch.uint8))
    assert q.n_saturated == 0
    assert bool(torch.isfinite(q.data.float()).all())


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_quantization_error_within_bound_and_bound_is_attained(scheme):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g) * torch.logspace(-4, 3, 64)
    q = quantize(x, scheme)
    err = (fp8ref.dequantize(q, torch.float64) - x.double()).abs()
    ratio = err / fp8ref.quantization_error_bound(x, q)
    assert float(ratio.max()) <= 1.0
    # tightness: values exactly half-way between two grid points reach the bound; with qmax in
    # the same block the scale is exactly 1, so x itself sits on the midpoints
    grid = scheme.format.finite_values()
    grid = grid[(grid > 0) & (grid <= scheme.qmax)]
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    xt = torch.cat([torch.tensor([scheme.qmax]), mids])[None, :]
    qt = quantize(xt, QuantScheme(format=scheme.format, granularity="row", qmax=scheme.qmax,
                                  scale_dtype=scheme.scale_dtype, pow2_scale=scheme.pow2_scale))
    if float(qt.scale) == 1.0:
        errt = (fp8ref.dequantize(qt, torch.float64) - xt.double()).abs()
        ratio_t = errt / fp8ref.quantization_error_bound(xt, qt)
        assert float(ratio_t.max()) <= 1.0
        assert float(ratio_t[0, 1:].min()) > 0.99


def test_ties_round_to_even():
    # x / 1 exactly on midpoints: 1.0625 (between 1 and 1.125) -> 1.0; 1.1875 -> 1.25
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, -1.1875, 0.0029296875]])
    q = quantize(x, QuantScheme())
    assert float(q.scale) == 1.0
    assert q.data.float().tolist() == [[448.0, 1.0, 1.25, -1.0, -1.25, 0.00390625]]


def test_zero_rows_never_nan():
    x = torch.zeros(3, 8)
    for scheme in SCHEMES:
        q = quantize(x, scheme)
        assert bool((q.scale > 0).all()) and bool(torch.isfinite(q.scale).all())
        assert bool((q.data.float() == 0).all())
    q = quantize(x, QuantScheme(amax_floor=0.0))
    assert bool((q.scale == 1).all())
    q = quantize(x, QuantScheme())
    assert torch.equal(q.scale, torch.full_like(q.scale, torch.tensor(1e-12) / 448))  # fl32(fl32(1e-12) / 448)


def test_floor_only_acts_below_it():
    x = torch.full((1, 4), 1e-13)
    q = quantize(x, QuantScheme())
    assert float(q.scale) == pytest.approx(1e-12 / 448, rel=2**-23)
    x = torch.full((1, 4), 6e-8, dtype=torch.float16)  # smallest fp16 magnitudes are above the floor
    q = quantize(x, QuantScheme())
    assert float(q.scale) == float(torch.tensor(float(x[0, 0])) / 448)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(2, 8)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=r"non-finite.*\(1, 3\)"):
        quantize(x, QuantScheme())


def test_bad_inputs_raise_specific_errors():
    with pytest.raises(TypeError, match="float dtype"):
        quantize(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="float dtype"):
        quantize(torch.ones(2, 2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(4))
    with pytest.raises(ValueError, match="0 columns"):
        quantize(torch.ones(2, 0))
    with pytest.raises(TypeError, match="QuantScheme"):
        quantize(torch.ones(2, 2), "row")
    with pytest.raises(ValueError, match="static"):
        quantize(torch.ones(2, 2), QuantScheme(dynamic=False))
    with pytest.raises(ValueError, match="dynamic"):
        quantize(torch.ones(2, 2), QuantScheme(), scale=torch.ones(2, 1))


def test_static_scales_validated_and_saturation_counted():
    st = QuantScheme(granularity="row", dynamic=False)
    x = torch.tensor([[1.0, 500.0, -1000.0], [0.5, 0.25, 464.0]])
    q = quantize(x, st, scale=torch.tensor([1.0, 1.0]))
    assert q.data.float().tolist() == [[1.0, 448.0, -448.0], [0.5, 0.25, 448.0]]
    assert q.n_saturated == 2  # 500 and -1000; 464 is the tie that rounds to 448 anyway
    for bad, msg in [(torch.tensor([1.0, 0.0]), "> 0"), (torch.tensor([1.0, -2.0]), "> 0"),
                     (torch.tensor([1.0, float("nan")]), "finite"), (torch.ones(3), "shape"),
                     (torch.ones(2, 2), "shape"), (torch.tensor([1, 1]), "float")]:
        with pytest.raises((ValueError, TypeError), match=msg):
            quantize(x, st, scale=bad)
    with pytest.raises(ValueError, match="representable"):
        quantize(x, st.with_(scale_dtype=torch.bfloat16), scale=torch.tensor([1.0, 1.0 + 2**-20]))
    qt = quantize(x, QuantScheme(granularity="tensor", dynamic=False), scale=torch.tensor(2.0))
    assert qt.scale.shape == (1, 1) and qt.n_saturated == 1


def test_m_zero_and_partial_groups():
    q = quantize(torch.zeros(0, 40), QuantScheme(granularity="group", group_size=16))
    assert q.data.shape == (0, 40) and q.scale.shape == (0, 3)
    q = quantize(torch.zeros(0, 40), QuantScheme(granularity="tensor"))
    assert q.scale.shape == (1, 1)
    x = torch.ones(2, 40)
    x[:, 32:] = 10.0  # the trailing partial group (8 columns) has its own scale
    q = quantize(x, QuantScheme(granularity="group", group_size=16))
    assert q.scale[:, 2].tolist() == [float(torch.tensor(10.0) / 448)] * 2
    assert q.scale[:, 0].tolist() == [float(torch.tensor(1.0) / 448)] * 2


def test_pow2_scales_are_powers_of_two_and_never_saturate():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=g) * 37
    q = quantize(x, QuantScheme(pow2_scale=True))
    m, _ = torch.frexp(q.scale)
    assert bool((m == 0.5).all())
    assert q.n_saturated == 0
    assert float(q.data.float().abs().max()) <= 448


def test_negative_zero_and_fnuz():
    x = torch.tensor([[-0.0, 1.0]])
    assert int(quantize(x).data.view(torch.uint8)[0, 0]) == 0x80  # e4m3fn keeps -0
    qz = quantize(x, QuantScheme(format="e4m3fnuz"))
    assert int(qz.data.view(torch.uint8)[0, 0]) == 0x00  # fnuz has no -0 (0x80 is its NaN)


def test_quantized_validates_its_fields():
    q = quantize(torch.randn(4, 8))
    with pytest.raises(ValueError, match="scale has shape"):
        fp8ref.Quantized(q.data, q.scale[:2], q.scheme)
    with pytest.raises(TypeError, match="dtype"):
        fp8ref.Quantized(q.data.view(torch.uint8), q.scale, q.scheme)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_chunked_passes_do_not_change_a_bit(scheme, monkeypatch):
    """The quantizer works in row chunks (memory); chunk edges must not show in the result."""
    from fp8ref.spec import quant

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(301, 77, generator=g) * torch.logspace(-3, 3, 77)).to(torch.bfloat16)
    whole = quantize(x, scheme)
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 100)
    pieces = quantize(x, scheme)
    assert torch.equal(whole.data.view(torch.uint8), pieces.data.view(torch.uint8))
    assert torch.equal(whole.scale, pieces.scale) and whole.n_saturated == pieces.n_saturated
