"""Backends that hold scales in a declared storage layout (``fp8ref.Backend.scale_layout``,
``fp8ref.spec.layouts``): they receive operands in that layout with the padding poisoned and return
quantized tensors in it. Each reads and writes the layout with its own code (as a kernel does),
not with fp8ref's decoders.

The correct ones ignore the padding and pass; the mutants read it (a leading dimension taken as
the packed row count, a K tile that runs into the padded scale groups) and fail on the poison.
"""

from __future__ import annotations

import torch

from fp8ref.registry import ScaleLayout
from fp8ref.spec import layouts as L
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import FP8_BLOCK_UE8M0, MXFP8, MXFP8_E5M2, Granularity, Recipe

from .base import Fp32Base, finish, fp32_mm, reference_quantize


def _exp2_bytes(byte: torch.Tensor) -> torch.Tensor:
    """fp32 2**(b - 127) of E8M0 bytes, NaN for 0xFF."""
    b = byte.to(torch.int64)
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float64), b - 127)
    return torch.where(b == 0xFF, torch.full_like(v, float("nan")), v).to(torch.float32)


def _bytes_of(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of power-of-two fp32 scales: the biased exponent field (scales here are normal)."""
    return ((s.to(torch.float32).contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64)


def _grid(q) -> tuple[int, int]:
    return q.scheme.scale_shape(*q.data.shape)


def _pow2_reason(case) -> str | None:
    for role, s in (("activation", case.recipe.activation), ("weight", case.recipe.weight)):
        if not s.pow2_scale or s.scale_dtype != torch.float32:
            return f"E8M0 scales: power-of-two fp32 scales only, not the {role} scheme {s.short_str()}"
    if case.op != "scaled_mm" and not case.recipe.activation.dynamic:
        return "E8M0 scales: no caller's (static) scale, which need not be a power of two"
    return None


# --------------------------------------------------------------------------------------------
# MN-major (column-major, TMA-aligned) fp32 activation scales


class MnMajorActivations(Fp32Base):
    name = "correct-mn-major-activation-scales"
    bug = ("activation scales consumed and produced MN-major with the rows padded to 4 (DeepGEMM's TMA-aligned "
           "fp32 layout), read through the buffer's leading dimension: the padding is never read")
    scale_layout = ScaleLayout(activation=L.MN_MAJOR)

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        R, C = q.scale.shape
        ld = -(-R // 4) * 4
        buf = torch.zeros(C, ld, dtype=q.scale.dtype)
        buf[:, :R] = q.scale.T
        return L.StoredQuantized(q.data, buf.T[:R], scheme, L.MN_MAJOR)

    def _leading_dim(self, a) -> int:
        return a.scale.stride(1) if a.scale.shape[1] > 1 else -(-a.scale.shape[0] // 4) * 4

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        R, C = _grid(a)
        sa = torch.as_strided(a.scale, (R, C), (1, self._leading_dim(a))).contiguous()
        return fp32_mm(Quantized(a.data, sa, a.scheme), b, bias, out_dtype)


class MnMajorPackedLd(MnMajorActivations):
    name = "mutant-mn-major-packed-ld"
    upstream = "deepseek-ai/DeepGEMM PR#54"
    klass = "scale layouts"
    bug = ("MN-major activation scales read with the packed row count as leading dimension instead of the "
           "TMA-aligned one (M rounded up to 4): when M % 4 != 0 every K group after the first reads the padding")

    def _leading_dim(self, a) -> int:
        return a.scale.shape[0]


# --------------------------------------------------------------------------------------------
# MX: E8M0 bytes in the 128x4 swizzled layout


def _swizzle(s: torch.Tensor) -> torch.Tensor:
    """The 128x4 swizzle of power-of-two scales ``s [R, C]`` (zeros in the padding)."""
    R, C = s.shape
    rb, cb = -(-R // 128), -(-C // 4)
    grid = torch.zeros(rb * 128, cb * 4, dtype=torch.int64)
    grid[:R, :C] = _bytes_of(s)
    tiles = grid.reshape(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)  # [row tile, col tile, r % 32, r // 32, c]
    return tiles.reshape(-1).to(torch.uint8).view(torch.float8_e8m0fnu)


def _unswizzle(buf: torch.Tensor, R: int, C: int) -> torch.Tensor:
    """The whole padded ``[128 ceil(R/128), 4 ceil(C/4)]`` grid of scales (padding included)."""
    rb, cb = -(-R // 128), -(-C // 4)
    tiles = buf.view(torch.uint8).reshape(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return _exp2_bytes(tiles.reshape(rb * 128, cb * 4))


class CorrectMx(Fp32Base):
    name = "correct-mx-swizzled"
    bug = ("MXFP8: 1x32 E8M0 scales on both operands in the cuBLAS 128x4 swizzled layout, the padded rows and "
           "scale columns never read")
    scale_layout = ScaleLayout(activation=L.MX_SWIZZLED, weight=L.MX_SWIZZLED)
    #: The recipes the backend is certified for (``check(..., schemes=claim)``), as a narrow kernel is.
    claim = (MXFP8, MXFP8_E5M2, Recipe("mxfp8-e5m2-weights", MXFP8_E5M2.weight, MXFP8.activation))

    def supports(self, case):
        for role, s in (("activation", case.recipe.activation), ("weight", case.recipe.weight)):
            if s.granularity is not Granularity.GROUP or s.group_size != 32:
                return f"MX: 1x32 groups only, not the {role} scheme {s.short_str()}"
        return _pow2_reason(case)

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        return L.StoredQuantized(q.data, _swizzle(q.scale), scheme, L.MX_SWIZZLED)

    def _scales(self, q) -> torch.Tensor:
        R, C = _grid(q)
        return _unswizzle(q.scale, R, C)[:R, :C]

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(Quantized(a.data, self._scales(a), a.scheme), Quantized(b.data, self._scales(b), b.scheme),
                       bias, out_dtype)


class MxTileReadsPadding(CorrectMx):
    name = "mutant-mx-k-tile-reads-padding"
    upstream = "triton-lang/triton#10772"
    klass = "scale layouts"
    bug = ("MX GEMM over K tiles of 4 scale groups (128 elements): the last tile multiplies the zero-padded codes "
           "by the padded scale columns it was never given (garbage: NaN here)")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[1] == 0:
            raise ValueError("a and b have 0 columns: the reduction dim K must be at least 1")
        deq = []
        for q in (a, b):
            R, C = _grid(q)
            s = _unswizzle(q.scale, R, C)[:R]  # rows cut, every scale column of the tile kept
            codes = torch.zeros(R, s.shape[1] * 32)
            codes[:, :q.data.shape[1]] = q.data.to(torch.float32)
            deq.append(codes * s.repeat_interleave(32, dim=1))
        return finish(deq[0] @ deq[1].T, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# UE8M0 packed 4 per int32 along K, MN-major (DeepGEMM on SM100)


class CorrectUe8m0Packed(Fp32Base):
    name = "correct-ue8m0-packed"
    bug = ("power-of-two scales as UE8M0 bytes packed 4 per int32 along K, MN-major with the rows padded to 4 "
           "(DeepGEMM's SM100 layout), on both operands; padded rows and bytes never read")
    scale_layout = ScaleLayout(activation=L.UE8M0_PACKED, weight=L.UE8M0_PACKED)
    claim = (FP8_BLOCK_UE8M0, MXFP8)

    def supports(self, case):
        return _pow2_reason(case)

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        R, C = q.scale.shape
        words, ld = -(-C // 4), -(-R // 4) * 4
        byte = torch.zeros(R, 4 * words, dtype=torch.int64)
        byte[:, :C] = _bytes_of(q.scale)
        packed = sum(byte[:, t::4] << (8 * t) for t in range(4))
        buf = torch.zeros(words, ld, dtype=torch.int64)
        buf[:, :R] = packed.T
        buf = torch.where(buf >= 2**31, buf - 2**32, buf).to(torch.int32)
        return L.StoredQuantized(q.data, buf.T[:R], scheme, L.UE8M0_PACKED)

    def _scales(self, q) -> torch.Tensor:
        R, C = _grid(q)
        w = q.scale.to(torch.int64) & 0xFFFFFFFF  # [R, words], read through the view's strides
        byte = torch.stack([(w >> (8 * t)) & 0xFF for t in range(4)], dim=-1).reshape(R, 4 * w.shape[1])[:, :C]
        return _exp2_bytes(byte)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(Quantized(a.data, self._scales(a), a.scheme), Quantized(b.data, self._scales(b), b.scheme),
                       bias, out_dtype)


LAYOUT_MUTANTS = (MnMajorPackedLd, MxTileReadsPadding)
LAYOUT_CORRECT = (MnMajorActivations, CorrectMx, CorrectUe8m0Packed)

__all__ = ["LAYOUT_MUTANTS", "LAYOUT_CORRECT", "MnMajorActivations", "MnMajorPackedLd", "CorrectMx",
           "MxTileReadsPadding", "CorrectUe8m0Packed"]
