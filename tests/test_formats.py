"""Formats: identities of each format, and all 256 codes / all 16-bit inputs against ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.spec.formats import FORMATS, get_format
from fp8ref.spec.quant import round_to_format

ALL = list(FORMATS.values())


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_constants_match_ml_dtypes_and_identities(fmt):
    fi = ml_dtypes.finfo(fmt.ml_dtype)
    assert fmt.max == float(fi.max)
    assert fmt.smallest_normal == float(fi.smallest_normal)
    assert fmt.smallest_subnormal == float(fi.smallest_subnormal)
    assert fmt.torch_dtype == getattr(torch, "float8_" + fmt.name)
    # identities: the largest finite value has the largest non-NaN significand of the top binade
    vals = fmt.finite_values()
    assert float(vals.max()) == fmt.max and float(vals.min()) == -fmt.max
    positive = vals[vals > 0]
    assert float(positive.min()) == fmt.smallest_subnormal
    assert fmt.unit_roundoff == 2.0 ** -(fmt.mantissa_bits + 1)
    # the spacing just above 1 is 2u
    above_one = positive[positive > 1][0]
    assert float(above_one) - 1 == 2 * fmt.unit_roundoff
    assert float(positive[positive >= fmt.smallest_normal][0]) == fmt.smallest_normal


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_all_256_codes_decode_as_ml_dtypes_and_torch(fmt):
    codes = np.arange(256, dtype=np.uint8)
    ml = codes.view(fmt.ml_dtype).astype(np.float64)
    tv = torch.from_numpy(codes).view(fmt.torch_dtype).to(torch.float64).numpy()
    ours = fmt.code_values().numpy()
    np.testing.assert_array_equal(ours, ml)  # NaN == NaN for assert_array_equal
    np.testing.assert_array_equal(tv, ml)
    assert sorted(np.flatnonzero(np.isnan(ml)).tolist()) == sorted(fmt.nan_codes)
    assert bool(np.isinf(ml).any()) == fmt.has_inf
    assert (np.signbit(ml[0x80]) and ml[0x80] == 0) == fmt.has_negative_zero
    assert len(fmt.codes()) == 256


def _clamped_ml(x32: np.ndarray, fmt) -> np.ndarray:
    """ml_dtypes' cast after the spec's explicit clamp (ml_dtypes overflows to NaN, torch >= 2.12
    saturates: comparing after the clamp makes both defined)."""
    return np.clip(x32, -fmt.max, fmt.max).astype(fmt.ml_dtype).view(np.uint8)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16], ids=str)
def test_every_16bit_pattern_rounds_like_ml_dtypes(fmt, src):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(src).to(torch.float32)
    keep = ~torch.isnan(x)
    x = x[keep]
    ours = round_to_format(x, fmt, fmt.max).view(torch.uint8).numpy()
    theirs = _clamped_ml(x.numpy(), fmt)
    mismatch = np.flatnonzero(ours != theirs)
    assert mismatch.size == 0, (
        f"{mismatch.size} mismatches, first x={x[mismatch[0]].item()!r}: ours 0x{ours[mismatch[0]]:02X} "
        f"ml_dtypes 0x{theirs[mismatch[0]]:02X}")


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_random_fp32_sample_rounds_like_ml_dtypes(fmt):
    g = torch.Generator().manual_seed(1)
    # random bit patterns cover every exponent; restrict to the range that matters around fp8
    mant = torch.randint(0, 2**23, (1_000_000,), generator=g, dtype=torch.int64)
    exp = torch.randint(127 - 24, 127 + 18, (1_000_000,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (1_000_000,), generator=g, dtype=torch.int64)
    bits = (sign << 31) | (exp << 23) | mant
    x = bits.to(torch.int32).view(torch.float32)
    ours = round_to_format(x, fmt, fmt.max).view(torch.uint8).numpy()
    theirs = _clamped_ml(x.numpy(), fmt)
    assert int((ours != theirs).sum()) == 0


def test_get_format_lookup():
    assert get_format("E4M3FN") is fp8ref.E4M3FN
    assert get_format("float8_e5m2") is fp8ref.E5M2
    assert get_format(torch.float8_e4m3fnuz) is fp8ref.E4M3FNUZ
    with pytest.raises(ValueError, match="unknown FP8 format"):
        get_format("e3m4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        get_format(torch.float16)
    with pytest.raises(TypeError):
        get_format(3)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_ulp_is_the_grid_spacing(fmt):
    vals = fmt.finite_values()
    pos = vals[vals >= 0]
    gaps = pos[1:] - pos[:-1]
    # the spacing at each value (to the next one up) is the ulp of that value
    assert torch.equal(fmt.ulp(pos[:-1]), gaps)
