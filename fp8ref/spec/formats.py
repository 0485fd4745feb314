"""The three FP8 formats fp8ref knows, with exact constants.

Every constant is written exactly (hex float) with its decimal in a comment, and the tests check
them against identities of the format and against ml_dtypes, never against magic numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch

__all__ = ["Fp8Format", "E4M3FN", "E5M2", "E4M3FNUZ", "FORMATS", "get_format"]


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits``.

    Attributes
    ----------
    name : str
        Short name, also used in cache keys and test ids (``"e4m3fn"``).
    exponent_bits, mantissa_bits, bias : int
        Field widths and exponent bias.
    max : float
        Largest finite value.
    smallest_normal, smallest_subnormal : float
        ``2**(1 - bias)`` and ``2**(1 - bias - mantissa_bits)`` (FNUZ formats shift these by one).
    has_inf : bool
        Whether the format encodes infinities.
    nan_codes : tuple of int
        Every bit pattern that decodes to NaN.
    has_negative_zero : bool
        False for the FNUZ formats, where 0x80 is the single NaN.
    torch_dtype, ml_dtype
        The matching ``torch`` and ``ml_dtypes`` dtypes.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    has_inf: bool
    nan_codes: tuple[int, ...]
    has_negative_zero: bool
    torch_dtype: torch.dtype = field(compare=False)
    ml_dtype: type = field(compare=False)

    def __post_init__(self) -> None:
        if self.exponent_bits + self.mantissa_bits != 7:
            raise ValueError(f"{self.name}: 1 + {self.exponent_bits} + {self.mantissa_bits} != 8 bits")
        if self.smallest_subnormal * 2**self.mantissa_bits != self.smallest_normal:
            raise ValueError(f"{self.name}: subnormal spacing inconsistent with smallest normal")

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-(mantissa_bits + 1): the relative error bound of round-to-nearest on normals."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal: smallest_normal == 2**min_exponent."""
        return int(math.log2(self.smallest_normal))

    def short_str(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name

    def ulp(self, v: torch.Tensor) -> torch.Tensor:
        """Spacing of the format's grid at ``|v|`` (v in the quantized domain, any float dtype).

        Notes
        -----
        ulp(v) = 2**(max(floor(log2|v|), min_exponent) - mantissa_bits); for |v| below the
        smallest normal it is the subnormal spacing. Values beyond ``max`` get the spacing of
        the binade they would fall in were the exponent range unbounded.
        """
        a = v.abs().to(torch.float64)
        _, e = torch.frexp(a)  # a = m * 2**e with 0.5 <= m < 1, so floor(log2 a) = e - 1
        e = torch.where(a == 0, self.min_exponent, e.to(torch.float64) - 1)  # frexp(0) gives e = 0
        e = torch.clamp(e, min=self.min_exponent)
        return torch.exp2(e - self.mantissa_bits)

    def code_values(self) -> torch.Tensor:
        """The value of each of the 256 codes as float64 (NaN for NaN codes), indexed by code."""
        codes = np.arange(256, dtype=np.uint8)
        vals = codes.view(self.ml_dtype).astype(np.float64)
        return torch.from_numpy(vals)

    def codes(self) -> list[tuple[int, float]]:
        """Enumerate all 256 codes as ``(code, value)`` pairs."""
        return [(c, float(v)) for c, v in enumerate(self.code_values().tolist())]

    def finite_values(self) -> torch.Tensor:
        """Every distinct finite value, sorted ascending (float64); -0 and +0 merge."""
        v = self.code_values()
        v = v[torch.isfinite(v)]
        return torch.unique(v)


E4M3FN = Fp8Format(
    name="e4m3fn",
    exponent_bits=4,
    mantissa_bits=3,
    bias=7,
    max=float.fromhex("0x1.cp8"),  # 448
    smallest_normal=float.fromhex("0x1p-6"),  # 0.015625
    smallest_subnormal=float.fromhex("0x1p-9"),  # 0.001953125
    has_inf=False,
    nan_codes=(0x7F, 0xFF),
    has_negative_zero=True,
    torch_dtype=torch.float8_e4m3fn,
    ml_dtype=ml_dtypes.float8_e4m3fn,
)

E5M2 = Fp8Format(
    name="e5m2",
    exponent_bits=5,
    mantissa_bits=2,
    bias=15,
    max=float.fromhex("0x1.cp15"),  # 57344
    smallest_normal=float.fromhex("0x1p-14"),  # 6.103515625e-05
    smallest_subnormal=float.fromhex("0x1p-16"),  # 1.52587890625e-05
    has_inf=True,
    nan_codes=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF),
    has_negative_zero=True,
    torch_dtype=torch.float8_e5m2,
    ml_dtype=ml_dtypes.float8_e5m2,
)

E4M3FNUZ = Fp8Format(
    name="e4m3fnuz",
    exponent_bits=4,
    mantissa_bits=3,
    bias=8,
    max=float.fromhex("0x1.ep7"),  # 240
    smallest_normal=float.fromhex("0x1p-7"),  # 0.0078125
    smallest_subnormal=float.fromhex("0x1p-10"),  # 0.0009765625
    has_inf=False,
    nan_codes=(0x80,),
    has_negative_zero=False,
    torch_dtype=torch.float8_e4m3fnuz,
    ml_dtype=ml_dtypes.float8_e4m3fnuz,
)

FORMATS: dict[str, Fp8Format] = {f.name: f for f in (E4M3FN, E5M2, E4M3FNUZ)}


def get_format(fmt: Fp8Format | str | torch.dtype) -> Fp8Format:
    """Look a format up by object, name (``"e4m3fn"``, case-insensitive) or torch dtype."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype == fmt:
                return f
        raise ValueError(f"{fmt} is not an FP8 dtype fp8ref supports; expected one of "
                         f"{[str(f.torch_dtype) for f in FORMATS.values()]}")
    if isinstance(fmt, str):
        key = fmt.lower().replace("float8_", "").replace("_", "")
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}")
    raise TypeError(f"expected an Fp8Format, a name or a torch dtype, got {type(fmt).__name__}")
