"""Scale storage layouts: how kernels hold a ``Quantized`` tensor's scales in memory, with a
reference encoder and decoder for each (docs/spec.md, "Scale storage layouts").

The spec's scales are a *logical* float tensor ``S [R, C]`` (``QuantScheme.scale_shape``: R scale
rows, C scale columns along K), row-major. Kernels consume other forms:

``e8m0``
    One byte per scale, ``[R, C]`` row-major, dtype ``torch.float8_e8m0fnu``: byte b = e + 127 for
    S = 2**e (bias 127, e in [-127, 127]); 0xFF is NaN. Power-of-two scales only.
``mn-major``
    The logical values (same dtype), column-major ("MN-major") with the row count padded to a
    multiple of 4 (16 bytes of fp32: TMA's alignment): element (r, c) at offset c * ld + r,
    ld = 4 * ceil(R / 4) (DeepGEMM's ``get_mn_major_tma_aligned_tensor``). The tensor handed over is
    the ``[R, C]`` view with strides (1, ld); offsets r in [R, ld) are padding.
``ue8m0-packed``
    E8M0 bytes packed 4 per int32 along K, MN-major and TMA-aligned (DeepGEMM's
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` on SM100): word (r, j), j < ceil(C / 4), at
    offset j * ld + r (ld = 4 * ceil(R / 4)) holds in its byte t (bits 8t .. 8t + 7, little-endian)
    the E8M0 byte of S[r, 4j + t]. Bytes with 4j + t >= C and words with r >= R are padding. The
    tensor handed over is the ``[R, ceil(C / 4)]`` int32 view with strides (1, ld).
``mx-swizzled``
    E8M0 bytes in the 128x4 block-scaled layout of cuBLAS and Blackwell's tcgen05 MMA, rows padded
    to a multiple of 128 and columns to a multiple of 4: S[r, c] goes to the flat byte offset
    ``((r // 128) * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``
    (torchao's ``to_blocked``; the cuBLAS documentation's "1D block scaling factors layout").
    Every other byte is padding. A 1-D ``torch.float8_e8m0fnu`` tensor of
    ``512 * ceil(R / 128) * ceil(C / 4)`` bytes.

Encoders fill the padding with zeros (what DeepGEMM and torchao write) or, with ``poison=True``,
with NaN (0xFF bytes, 0xFFFFFFFF words): a kernel that reads padding reads poison. Decoders never
read padding. A backend declares the layouts it consumes and produces
(``fp8ref.Backend.scale_layout``); the conformance suite hands it operands encoded here with the
padding poisoned and decodes what it returns with the decoders here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import Quantized
from .schemes import QuantScheme

__all__ = ["LOGICAL", "E8M0", "MN_MAJOR", "UE8M0_PACKED", "MX_SWIZZLED", "LAYOUTS", "E8M0_LAYOUTS", "ScaleLayout",
           "StoredQuantized", "e8m0_encode", "e8m0_decode", "encode_scale", "decode_scale", "encode", "decode",
           "mn_major_ld", "swizzle_offsets"]

LOGICAL = "logical"
E8M0 = "e8m0"
MN_MAJOR = "mn-major"
UE8M0_PACKED = "ue8m0-packed"
MX_SWIZZLED = "mx-swizzled"
#: Every layout, the logical float tensor first.
LAYOUTS = (LOGICAL, E8M0, MN_MAJOR, UE8M0_PACKED, MX_SWIZZLED)
#: Layouts that hold E8M0 bytes (power-of-two scales and NaN only).
E8M0_LAYOUTS = (E8M0, UE8M0_PACKED, MX_SWIZZLED)

_E8M0_BIAS = 127
_E8M0_NAN = 0xFF
#: Rows of the MN-major layouts are padded to a multiple of this (16 bytes of 4-byte elements).
_TMA_ROWS = 4
_SWIZZLE_ROWS, _SWIZZLE_COLS = 128, 4


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown scale layout {layout!r}; expected one of {LAYOUTS}")


@dataclass(frozen=True)
class ScaleLayout:
    """The scale layouts a backend consumes and produces: ``activation`` for the ``a`` operand of
    ``scaled_mm`` and what ``quantize`` returns, ``weight`` for the ``b`` operand (what
    ``prepare_weight`` receives). Both ``LOGICAL`` by default (a float tensor in
    ``scheme.scale_shape``, ``fp8ref.Quantized``)."""

    activation: str = LOGICAL
    weight: str = LOGICAL

    def __post_init__(self) -> None:
        _check_layout(self.activation)
        _check_layout(self.weight)

    @property
    def logical(self) -> bool:
        return self.activation == LOGICAL and self.weight == LOGICAL


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``torch.uint8``, same shape) of positive power-of-two scales 2**-127 .. 2**127,
    and NaN (0xFF).

    Raises ``ValueError`` naming the first scale that is neither (E8M0 has no mantissa, no zero and
    no infinity: storing anything else would round, a decision the scheme did not make).

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.layouts import e8m0_encode
    >>> e8m0_encode(torch.tensor([1.0, 0.5, 2.0**-127, 2.0**127, float("nan")])).tolist()
    [127, 126, 0, 254, 255]
    """
    s = scale.to(torch.float64)
    m, e = torch.frexp(s)
    byte = e.to(torch.int64) - 1 + _E8M0_BIAS
    nan = torch.isnan(s)
    byte = torch.where(nan, torch.full_like(byte, _E8M0_NAN), byte)
    bad = ~(((m == 0.5) & (byte >= 0) & (byte <= 254)) | nan)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"scale {float(s[idx])!r} at index {idx} is not a power of two in [2**-127, 2**127]: "
                         "E8M0 holds only those and NaN")
    return byte.to(torch.uint8)


def e8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """fp32 values of E8M0 bytes (``uint8`` or ``float8_e8m0fnu``): 2**(b - 127), NaN for 0xFF."""
    b = byte.view(torch.uint8) if byte.dtype == torch.float8_e8m0fnu else byte
    if b.dtype != torch.uint8:
        raise TypeError(f"E8M0 bytes must be uint8 or float8_e8m0fnu, got {byte.dtype}")
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float64, device=b.device), b.to(torch.int64) - _E8M0_BIAS)
    return torch.where(b == _E8M0_NAN, torch.full_like(v, float("nan")), v).to(torch.float32)


def mn_major_ld(rows: int) -> int:
    """The leading dimension of the MN-major layouts: ``rows`` rounded up to a multiple of 4."""
    return -(-rows // _TMA_ROWS) * _TMA_ROWS


def swizzle_offsets(rows: int, cols: int, device=None) -> torch.Tensor:
    """``[rows, cols]`` int64: the byte offset of S[r, c] in the ``mx-swizzled`` layout.

    Examples
    --------
    >>> from fp8ref.spec.layouts import swizzle_offsets
    >>> o = swizzle_offsets(130, 5)
    >>> int(o[0, 0]), int(o[0, 3]), int(o[1, 0]), int(o[32, 0]), int(o[0, 4]), int(o[128, 0])
    (0, 3, 16, 4, 512, 1024)
    """
    r = torch.arange(rows, device=device).reshape(-1, 1)
    c = torch.arange(cols, device=device).reshape(1, -1)
    col_blocks = -(-cols // _SWIZZLE_COLS)
    tile = (r // _SWIZZLE_ROWS) * col_blocks + c // _SWIZZLE_COLS
    return tile * 512 + (r % 32) * 16 + ((r % _SWIZZLE_ROWS) // 32) * 4 + c % _SWIZZLE_COLS


def _swizzled_size(rows: int, cols: int) -> int:
    return 512 * -(-rows // _SWIZZLE_ROWS) * -(-cols // _SWIZZLE_COLS)


def encode_scale(scale: torch.Tensor, layout: str, *, poison: bool = False) -> torch.Tensor:
    """The logical scales ``scale [R, C]`` stored in ``layout`` (module docstring); with ``poison``
    the padding holds NaN (0xFF bytes), else zeros. ``ValueError`` for a byte layout and a scale
    that is not a power of two in E8M0's range."""
    _check_layout(layout)
    if scale.dim() != 2:
        raise ValueError(f"scale must be the 2-D logical [R, C] tensor, got shape {tuple(scale.shape)}")
    R, C = scale.shape
    dev = scale.device
    if layout == LOGICAL:
        return scale.clone()
    if layout == E8M0:
        return e8m0_encode(scale).view(torch.float8_e8m0fnu)
    ld = mn_major_ld(R)
    if layout == MN_MAJOR:
        fill = float("nan") if poison else 0.0
        buf = torch.full((C, ld), fill, dtype=scale.dtype, device=dev)
        buf[:, :R] = scale.T
        return buf.T[:R]
    byte = e8m0_encode(scale)
    pad = _E8M0_NAN if poison else 0
    if layout == UE8M0_PACKED:
        words = -(-C // 4)
        padded = torch.full((R, words * 4), pad, dtype=torch.int64, device=dev)
        padded[:, :C] = byte.to(torch.int64)
        g = padded.reshape(R, words, 4)
        packed = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16) | (g[..., 3] << 24)
        buf = torch.full((words, ld), -1 if poison else 0, dtype=torch.int64, device=dev)
        buf[:, :R] = packed.T
        buf = torch.where(buf >= 2**31, buf - 2**32, buf).to(torch.int32)  # the word's bits, as int32
        return buf.T[:R]
    out = torch.full((_swizzled_size(R, C),), pad, dtype=torch.uint8, device=dev)
    out[swizzle_offsets(R, C, dev).reshape(-1)] = byte.reshape(-1)
    return out.view(torch.float8_e8m0fnu)


def _expect(stored: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...] | None, dtypes, layout: str):
    if stored.dtype not in dtypes:
        raise ValueError(f"{layout} scales have dtype {stored.dtype}, expected one of {dtypes}")
    if tuple(stored.shape) != shape:
        raise ValueError(f"{layout} scales have shape {tuple(stored.shape)}, expected {shape}")
    if strides is not None and stored.numel() > 0:  # an empty buffer has no strides to speak of
        got = stored.stride()
        if any(n > 1 and g != w for n, g, w in zip(shape, got, strides, strict=True)):
            raise ValueError(f"{layout} scales have strides {got}, expected {strides}")


def decode_scale(stored: torch.Tensor, layout: str, shape: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The logical ``[R, C]`` scales (``dtype``) of ``stored`` in ``layout``; padding is never read.
    ``ValueError`` when ``stored`` does not have the layout's dtype, shape and strides."""
    _check_layout(layout)
    R, C = shape
    if layout == LOGICAL:
        _expect(stored, (R, C), None, (stored.dtype,) if stored.is_floating_point() else (), layout)
        return stored.to(dtype)
    if layout == E8M0:
        _expect(stored, (R, C), None, (torch.float8_e8m0fnu, torch.uint8), layout)
        return e8m0_decode(stored).to(dtype)
    ld = mn_major_ld(R)
    if layout == MN_MAJOR:
        _expect(stored, (R, C), (1, ld), (torch.float32, torch.bfloat16, torch.float16), layout)
        return stored.to(dtype).contiguous()
    if layout == UE8M0_PACKED:
        words = -(-C // 4)
        _expect(stored, (R, words), (1, ld), (torch.int32,), layout)
        w = stored.to(torch.int64) & 0xFFFFFFFF
        byte = torch.stack([(w >> (8 * t)) & 0xFF for t in range(4)], dim=-1).reshape(R, words * 4)[:, :C]
        return e8m0_decode(byte.to(torch.uint8)).to(dtype)
    _expect(stored, (_swizzled_size(R, C),), None, (torch.float8_e8m0fnu, torch.uint8), layout)
    byte = stored.view(torch.uint8)[swizzle_offsets(R, C, stored.device)]
    return e8m0_decode(byte).to(dtype)


@dataclass(frozen=True)
class StoredQuantized:
    """A quantized tensor whose scales are stored in ``layout``: ``data`` as in ``fp8ref.Quantized``
    (FP8 codes ``[rows, cols]``), ``scale`` the stored buffer (``encode_scale``), ``scheme`` the
    scheme. ``decode()`` gives the ``Quantized`` back through the reference decoder."""

    data: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    layout: str

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        if self.layout == LOGICAL:
            raise ValueError("a logical layout is an fp8ref.Quantized, not a StoredQuantized")
        if not isinstance(self.data, torch.Tensor) or self.data.dim() != 2:
            raise ValueError("StoredQuantized.data must be the 2-D [rows, cols] FP8 codes")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def decode(self) -> Quantized:
        """The ``Quantized`` whose scales the stored buffer holds (``ValueError`` if it holds none)."""
        shape = self.scheme.scale_shape(*self.data.shape)
        return Quantized(self.data, decode_scale(self.scale, self.layout, shape, self.scheme.scale_dtype), self.scheme)


def encode(q: Quantized, layout: str, *, poison: bool = False) -> Quantized | StoredQuantized:
    """``q`` with its scales stored in ``layout`` (``q`` itself for ``LOGICAL``).

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.spec.layouts import UE8M0_PACKED, decode, encode
    >>> q = fp8ref.quantize(torch.randn(3, 300), fp8ref.MXFP8.activation)
    >>> s = encode(q, UE8M0_PACKED, poison=True)
    >>> tuple(s.scale.shape), s.scale.stride()
    ((3, 3), (1, 4))
    >>> torch.equal(decode(s).scale, q.scale)
    True
    """
    _check_layout(layout)
    if layout == LOGICAL:
        return q
    return StoredQuantized(q.data, encode_scale(q.scale, layout, poison=poison), q.scheme, layout)


def decode(q: Quantized | StoredQuantized) -> Quantized:
    """The ``Quantized`` of ``q``: itself, or a ``StoredQuantized`` decoded."""
    return q.decode() if isinstance(q, StoredQuantized) else q
