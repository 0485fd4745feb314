"""Scale storage layouts (fp8ref.spec.layouts): every E8M0 byte round-trips; every layout
round-trips on every scale-grid shape up to past one swizzle tile, with and without poisoned
padding; the index maps agree with the published ones (DeepGEMM's packing formula, torchao's
``to_blocked``); decoders never read padding and refuse a buffer of the wrong shape or strides."""

import itertools

import pytest
import torch

import fp8ref
from fp8ref.spec import layouts as L

#: Scale-grid shapes: 1..9 rows and columns (every residue mod 4), and past a 128-row swizzle tile.
SHAPES = [(r, c) for r in range(1, 10) for c in range(1, 10)] + [(127, 3), (128, 4), (129, 5), (130, 9), (257, 2)]


def _pow2_scales(R: int, C: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-127, 128, (R, C), generator=g)
    return torch.ldexp(torch.ones(R, C, dtype=torch.float64), e).to(torch.float32)


def test_every_e8m0_byte_round_trips():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = L.e8m0_decode(b)
    assert torch.isnan(v[255]) and not bool(torch.isnan(v[:255]).any())
    assert torch.equal(L.e8m0_encode(v), b)
    # the same bytes as torch's own float8_e8m0fnu for every finite code
    assert torch.equal(b.view(torch.float8_e8m0fnu).float()[:255], v[:255])


def test_e8m0_refuses_what_it_cannot_hold():
    for bad in (3.0, 0.0, -1.0, float("inf"), 2.0**-128, 2.0**128):
        with pytest.raises(ValueError, match="power of two"):
            L.e8m0_encode(torch.tensor([1.0, bad], dtype=torch.float64))


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_every_layout_round_trips_on_every_grid_shape(layout):
    for i, (R, C) in enumerate(SHAPES):
        s = _pow2_scales(R, C, i)
        for poison in (False, True):
            stored = L.encode_scale(s, layout, poison=poison)
            assert torch.equal(L.decode_scale(stored, layout, (R, C)), s), (layout, R, C, poison)


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every element of ``t``'s storage from its offset on (the padding included)."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.as_strided(t, (n,), (1,))


@pytest.mark.parametrize("layout", [L.MN_MAJOR, L.UE8M0_PACKED, L.MX_SWIZZLED])
def test_padding_is_poisoned_and_never_read(layout):
    for R, C in SHAPES:
        s = _pow2_scales(R, C)
        stored = L.encode_scale(s, layout, poison=True)
        raw = _storage(stored)
        clean = _storage(L.encode_scale(s, layout))
        as_bytes = raw.view(torch.uint8) if raw.dtype != torch.float32 else None
        n_pad = int((raw != clean).sum()) if as_bytes is None else int((as_bytes != clean.view(torch.uint8)).sum())
        if layout == L.MN_MAJOR:
            assert n_pad == (L.mn_major_ld(R) - R) * C and int(torch.isnan(raw).sum()) == n_pad
        elif layout == L.UE8M0_PACKED:
            words = -(-C // 4)
            assert n_pad == 4 * (L.mn_major_ld(R) - R) * words + R * (4 * words - C)
        else:
            assert n_pad == raw.numel() - R * C and int((as_bytes == 0xFF).sum()) == n_pad
        # scribbling over every padding element changes nothing the decoder returns
        junk = _storage(stored)
        pad = (raw.view(torch.uint8) != clean.view(torch.uint8)) if as_bytes is not None else torch.isnan(raw)
        if as_bytes is None:
            junk[pad] = 12345.0
        else:
            junk.view(torch.uint8)[pad] = 0x55
        assert torch.equal(L.decode_scale(stored, layout, (R, C)), s)


def test_ue8m0_packing_is_deepgemms():
    """DeepGEMM's ``transpose_and_pack_fp32_into_ue8m0``: packed = (v0 >> 23) | (v1 >> 15) | (v2 >> 7)
    | (v3 << 1) on the fp32 bits v of four consecutive K groups, stored at out[j * ld + r]."""
    R, C = 6, 7
    s = _pow2_scales(R, C, 3).clamp(min=2.0**-126)  # fp32 normals: v >> 23 is the exponent byte
    stored = L.encode_scale(s, L.UE8M0_PACKED)
    ld = L.mn_major_ld(R)
    bits = torch.nn.functional.pad(s.view(torch.int32).to(torch.int64), (0, 1))  # K padded with 0
    for r, j in itertools.product(range(R), range(2)):
        v = [int(bits[r, 4 * j + t]) for t in range(4)]
        want = ((v[0] >> 23) | (v[1] >> 15) | (v[2] >> 7) | (v[3] << 1)) & 0xFFFFFFFF
        got = int(_storage(stored)[j * ld + r]) & 0xFFFFFFFF
        assert got == want, (r, j)


def test_mx_swizzle_is_torchaos_to_blocked():
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    for R, C in [(1, 1), (5, 3), (128, 4), (130, 9), (257, 2)]:
        s = _pow2_scales(R, C, R + C)
        want = utils.to_blocked(L.e8m0_encode(s))
        assert torch.equal(L.encode_scale(s, L.MX_SWIZZLED).view(torch.uint8), want)


def test_decoders_refuse_the_wrong_buffer():
    s = _pow2_scales(5, 6)
    with pytest.raises(ValueError, match="strides"):
        L.decode_scale(s.contiguous(), L.MN_MAJOR, (5, 6))  # row-major, not MN-major
    with pytest.raises(ValueError, match="shape"):
        L.decode_scale(L.encode_scale(s, L.MX_SWIZZLED)[:-1], L.MX_SWIZZLED, (5, 6))
    with pytest.raises(ValueError, match="dtype"):
        L.decode_scale(s, L.UE8M0_PACKED, (5, 6))
    with pytest.raises(ValueError, match="unknown scale layout"):
        L.encode_scale(s, "col-major")


def test_quantized_operands_round_trip_in_every_layout():
    x = torch.randn(130, 300)
    for recipe in (fp8ref.MXFP8, fp8ref.MXFP8_E5M2, fp8ref.FP8_BLOCK_UE8M0):
        for scheme in (recipe.activation, recipe.weight):
            q = fp8ref.quantize(x, scheme)
            for layout in L.LAYOUTS:
                back = L.decode(L.encode(q, layout, poison=True))
                assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
                assert torch.equal(back.scale, q.scale) and back.scheme == q.scheme


# --------------------------------------------------------------------------------------------
# a backend's declared layout


def test_register_backend_refuses_a_stored_layout():
    class Packed(fp8ref.Backend):
        name = "test-ue8m0-packed"
        scale_layout = fp8ref.ScaleLayout(activation=L.UE8M0_PACKED, weight=L.UE8M0_PACKED)

    with pytest.raises(ValueError, match="logical float scales"):
        fp8ref.register_backend(Packed())
    with pytest.raises(ValueError, match="unknown scale layout"):
        fp8ref.ScaleLayout(activation="row-major-bytes")


def test_the_suite_encodes_with_poison_and_decodes_through_the_reference():
    from fp8ref.check.common import ContractViolation, Declined, from_backend_layout, to_backend_layout

    class Swizzled(fp8ref.Backend):
        name = "test-mx"
        scale_layout = fp8ref.ScaleLayout(activation=L.MX_SWIZZLED, weight=L.MX_SWIZZLED)

    b = Swizzled()
    q = fp8ref.quantize(torch.randn(3, 70), fp8ref.MXFP8.activation)  # 3 x 3 scales: padding on both axes
    stored = to_backend_layout(b, q, "activation")
    assert isinstance(stored, L.StoredQuantized) and int((stored.scale.view(torch.uint8) == 0xFF).sum()) == 512 - 9
    assert torch.equal(from_backend_layout(b, stored, "activation").scale, q.scale)
    with pytest.raises(ContractViolation, match="declares activation scales in the mx-swizzled layout"):
        from_backend_layout(b, q, "activation")  # a logical Quantized from a backend that declared bytes
    with pytest.raises(ContractViolation, match="decoder refuses"):
        from_backend_layout(b, L.StoredQuantized(q.data, stored.scale[:-1], q.scheme, L.MX_SWIZZLED), "activation")
    with pytest.raises(Declined, match="cannot be stored"):  # a scale E8M0 cannot hold: outside the premise
        to_backend_layout(b, fp8ref.quantize(torch.randn(3, 70), fp8ref.QuantScheme(granularity="group",
                                                                                        group_size=32)), "weight")
