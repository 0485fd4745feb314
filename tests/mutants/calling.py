"""Mutants and correct variants of the calling contract (docs/spec.md, "The calling contract"):
right values, wrong behaviour towards the caller -- views, writes into arguments, outputs shared
with the caller or between calls, stale prepared weights, state shared between threads,
non-finite values, degenerate and large shapes. The values-only contracts pass most of them.

Each mutant changes the correct base (``Fp32Base``) in one way; each correct variant does the same
job right. ``upstream`` names the class of the issue that asked for them (fp8ref issue 31): these
are kernel habits, not a single upstream report.
"""

from __future__ import annotations

import threading
import time

import torch

from fp8ref.registry import PROPAGATE, NonFinite
from fp8ref.spec import gemm, quant
from fp8ref.spec.quant import Quantized

from .base import GEMM_OPS, Fp32Base, finish, fp32_mm, reference_quantize, static_divisor

_ISSUE = "fp8ref issue 31"


# --------------------------------------------------------------------------------------------
# layout


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` read as a kernel that takes only a pointer reads it: rows of ``cols`` elements one
    after the other from the first element (strides ignored, the offset kept)."""
    if t.dim() != 2:
        return t
    R, C = t.shape
    if t.numel() == 0:
        return t
    return torch.as_strided(t, (R, C), (C, 1), t.storage_offset())


class PointerOnlyOperands(Fp32Base):
    name = "mutant-pointer-only-operands"
    upstream = _ISSUE
    klass = "layout"
    bug = "the GEMM reads its operands' codes and scales from their first element with row stride K (a strided " \
          "or transposed view is read as if contiguous)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        a = Quantized(_row_major(a.data), _row_major(a.scale), a.scheme)
        b = Quantized(_row_major(b.data), _row_major(b.scale), b.scheme)
        return fp32_mm(a, b, bias, out_dtype)


class PointerOnlyActivations(Fp32Base):
    name = "mutant-pointer-only-activations"
    upstream = _ISSUE
    klass = "layout"
    bug = "the quantizer reads x from its first element with row stride cols (strides ignored)"

    def quantize(self, x, scheme, scale=None):
        return reference_quantize(_row_major(x), scheme, scale)


class ContiguousFirst(Fp32Base):
    name = "correct-contiguous-first"
    bug = "makes every operand contiguous before the kernel (the base's kernels, any view in)"

    def quantize(self, x, scheme, scale=None):
        return reference_quantize(x.contiguous(), scheme, None if scale is None else scale.contiguous())

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        a = Quantized(a.data.contiguous(), a.scale.contiguous(), a.scheme)
        b = Quantized(b.data.contiguous(), b.scale.contiguous(), b.scheme)
        return fp32_mm(a, b, None if bias is None else bias.contiguous(), out_dtype)


class RefusesViews(Fp32Base):
    name = "correct-refuses-views"
    bug = "takes contiguous operands only and says so (ValueError naming the argument) for any other layout"

    @staticmethod
    def _need(t: torch.Tensor, what: str) -> None:
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous (strides {tuple(t.stride())})")

    def quantize(self, x, scheme, scale=None):
        self._need(x, "x")
        if scale is not None:
            self._need(scale, "scale")
        return reference_quantize(x, scheme, scale)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        for t, what in ((a.data, "a.data"), (a.scale, "a.scale"), (b.data, "b.data"), (b.scale, "b.scale")):
            self._need(t, what)
        if bias is not None:
            self._need(bias, "bias")
        return fp32_mm(a, b, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# inputs untouched, outputs fresh


class ScaleInPlace(Fp32Base):
    name = "mutant-scale-in-place"
    upstream = _ISSUE
    klass = "inputs and outputs"
    bug = "the quantizer divides x by its scale in place and multiplies it back afterwards (x / s * s is not x)"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if x.dtype.is_floating_point and x.numel():
            s = static_divisor(x, q.scale, scheme).to(x.dtype)
            with torch.no_grad():
                x.div_(s)
                x.mul_(s)
        return q


class ScaleAliasesCaller(Fp32Base):
    name = "mutant-scale-aliases-caller"
    upstream = _ISSUE
    klass = "inputs and outputs"
    bug = "a static scheme's Quantized holds the caller's scale tensor itself (a later update of it changes the " \
          "scale the codes were computed with)"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if scale is None or scale.dtype != q.scale.dtype:
            return q
        return Quantized(q.data, scale.reshape(q.scale.shape), scheme, q.n_saturated)


class ReusedOutput(Fp32Base):
    name = "mutant-reused-output"
    upstream = _ISSUE
    klass = "inputs and outputs"
    bug = "returns its output workspace, kept between calls: the next call of the same shape overwrites the " \
          "caller's earlier result"

    def __init__(self) -> None:
        self._out: dict = {}

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, bias, out_dtype)
        buf = self._out.setdefault((tuple(y.shape), y.dtype), torch.empty_like(y))
        buf.copy_(y)
        return buf


# --------------------------------------------------------------------------------------------
# lifetime


class _Prepared:
    """A prepared weight: the codes widened to fp32 once, with the scales (copies)."""

    def __init__(self, w: Quantized) -> None:
        self.codes = w.data.to(torch.float32)
        self.scale = w.scale.clone()
        self.w = Quantized(w.data.clone(), w.scale.clone(), w.scheme)


class PreparedCacheById(Fp32Base):
    name = "mutant-prepared-cache-by-id"
    upstream = _ISSUE
    klass = "lifetime"
    bug = "prepare_weight caches its copy keyed on id() of the weight: an updated weight is served stale"

    def __init__(self) -> None:
        self._cache: dict = {}

    def prepare_weight(self, w):
        return self._cache.setdefault(id(w), _Prepared(w))

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b.w if isinstance(b, _Prepared) else b, bias, out_dtype)


class PreparedCacheByVersion(PreparedCacheById):
    name = "mutant-prepared-cache-by-version"
    bug = "prepare_weight caches keyed on the storage pointer and version counter of the codes and scales: a " \
          "write that moves no version counter (through a numpy view) is served stale"

    def prepare_weight(self, w):
        key = tuple((t.data_ptr(), t._version) for t in (w.data, w.scale))
        return self._cache.setdefault(key, _Prepared(w))


class QuantizeMemo(Fp32Base):
    name = "mutant-quantize-memo"
    upstream = _ISSUE
    klass = "lifetime"
    bug = "the quantizer memoizes its last result keyed on x's storage pointer and shape (activations updated " \
          "in place come back stale)"

    def __init__(self) -> None:
        self._last = None

    def quantize(self, x, scheme, scale=None):
        key = (x.data_ptr(), tuple(x.shape), x.dtype, scheme)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        q = reference_quantize(x, scheme, scale)
        self._last = (key, q)
        return q


class PreparedCopy(Fp32Base):
    name = "correct-prepared-copy"
    changes = GEMM_OPS
    bug = "prepare_weight makes a widened copy at every call (no cache): an updated weight, prepared again, is seen"

    def prepare_weight(self, w):
        return _Prepared(w)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b.w if isinstance(b, _Prepared) else b, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# concurrency


def _scratch_mm(a: Quantized, b: Quantized, bias, out_dtype, scratch: dict) -> torch.Tensor:
    """The base GEMM through a workspace: the widened activation codes are written to
    ``scratch`` and read back after the weight is widened (a torch op: another thread may run)."""
    key = tuple(a.data.shape)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = torch.empty(a.data.shape, dtype=torch.float32)
    buf.copy_(a.data.to(torch.float32))
    # The window between writing the workspace and reading it back, where a kernel that releases
    # the GIL lets other threads run: opened explicitly, so that the race shows whatever else the
    # machine runs (with only the torch op below there, a loaded machine let it pass the threads
    # contract on 2 of seeds 3-7).
    time.sleep(0)
    wide = Quantized(b.data.to(torch.float32).to(b.data.dtype), b.scale, b.scheme)
    a_back = Quantized(buf.to(a.data.dtype), a.scale, a.scheme)
    return fp32_mm(a_back, wide, bias, out_dtype)


class SharedScratch(Fp32Base):
    name = "mutant-shared-scratch"
    upstream = _ISSUE
    klass = "concurrency"
    bug = "one workspace per shape on the backend object, shared by every thread that calls it"

    def __init__(self) -> None:
        self._scratch: dict = {}

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return _scratch_mm(a, b, bias, out_dtype, self._scratch)


class ThreadLocalScratch(Fp32Base):
    name = "correct-thread-local-scratch"
    changes = GEMM_OPS
    bug = "the same workspace, one per thread (threading.local)"

    def __init__(self) -> None:
        self._local = threading.local()

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if not hasattr(self._local, "scratch"):
            self._local.scratch = {}
        return _scratch_mm(a, b, bias, out_dtype, self._local.scratch)


# --------------------------------------------------------------------------------------------
# special values


def ieee_quantize(x: torch.Tensor, scheme, scale=None) -> Quantized:
    """The spec's quantizer where x and the static scale are finite; elsewhere what IEEE arithmetic
    on its definition gives: a non-finite element's code is NaN, and its block's dynamic scale is
    its magnitude (amax NaN or Inf), so the block dequantizes to NaN."""
    xf = x.to(torch.float32)
    bad = ~torch.isfinite(xf)
    if not bool(bad.any()) and (scale is None or bool(torch.isfinite(scale).all())):
        return reference_quantize(x, scheme, scale)
    if scale is None:
        s = quant.compute_scale(torch.where(bad, torch.zeros_like(xf), xf), scheme).to(torch.float32)
        r, c = scheme.block_shape(*x.shape)
        for i, j in bad.nonzero().tolist():
            s[i // r, j // c] = xf[i, j].abs()
    else:
        s = scale.to(torch.float32, copy=True).reshape(scheme.scale_shape(*x.shape))
    v = xf / quant.expand_scale(s, scheme, *x.shape)
    codes = torch.where(bad, torch.full_like(v, float("nan")), torch.clamp(v, -scheme.qmax, scheme.qmax))
    return Quantized(codes.to(scheme.format.torch_dtype), s.to(scheme.scale_dtype), scheme)


_PROPAGATING = NonFinite(x=PROPAGATE, static_scale=PROPAGATE, bias=PROPAGATE)


class IeeePropagate(Fp32Base):
    name = "correct-ieee-propagate"
    non_finite = _PROPAGATING
    bug = "propagates NaN/Inf from every input as IEEE arithmetic on the spec's definition does (no ValueError)"

    def quantize(self, x, scheme, scale=None):
        return ieee_quantize(x, scheme, scale)


class NanCodesZeroed(IeeePropagate):
    name = "mutant-nan-codes-zeroed"
    upstream = _ISSUE
    klass = "special values"
    bug = "declares propagation, but the quantizer's cast maps NaN to code 0 (NaN in, 0 out)"

    def quantize(self, x, scheme, scale=None):
        return ieee_quantize(torch.nan_to_num(x, nan=0.0, posinf=float("inf"), neginf=float("-inf")), scheme, scale)


class InfSaturates(IeeePropagate):
    name = "mutant-inf-saturates"
    upstream = _ISSUE
    klass = "special values"
    bug = "declares propagation, but the amax skips +-Inf and the clamp saturates them to +-qmax"

    def quantize(self, x, scheme, scale=None):
        xf = x.to(torch.float32)
        if scale is not None or not bool(torch.isinf(xf).any()):
            return ieee_quantize(x, scheme, scale)
        fin = torch.where(torch.isinf(xf), torch.zeros_like(xf), xf)
        s = quant.compute_scale(fin, scheme)
        v = xf / quant.expand_scale(s.to(torch.float32), scheme, *x.shape)
        codes = torch.where(torch.isnan(v), v, torch.clamp(v, -scheme.qmax, scheme.qmax))
        return Quantized(codes.to(scheme.format.torch_dtype), s, scheme)


class NanScaleAsOne(Fp32Base):
    name = "mutant-nan-scale-as-one"
    upstream = _ISSUE
    klass = "special values"
    bug = "the GEMM's scale loads replace a non-finite scale by 1 (nan_to_num on the scales)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        def fix(q):
            s = q.scale.to(torch.float32)
            s = torch.where(torch.isfinite(s), s, torch.ones_like(s)).to(q.scale.dtype)
            return Quantized(q.data, s, q.scheme)
        return fp32_mm(fix(a), fix(b), bias, out_dtype)


class SaturatingEpilogue(Fp32Base):
    name = "mutant-saturating-epilogue"
    upstream = _ISSUE
    klass = "special values"
    bug = "the epilogue clamps to the output dtype's range before the cast (a result past fp16's range comes " \
          "out as +-65504, not +-Inf)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, bias, torch.float32)
        big = torch.finfo(out_dtype).max
        return torch.where(torch.isfinite(y), y.clamp(-big, big), y).to(out_dtype)


# --------------------------------------------------------------------------------------------
# degenerate shapes


class OneRowGrid(Fp32Base):
    name = "mutant-one-row-grid"
    upstream = _ISSUE
    klass = "degenerate shapes"
    bug = "allocates max(M, 1) output rows (a grid of at least one program): M = 0 returns a row of zeros"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[0] == 0:
            return torch.zeros(1, b.data.shape[0], dtype=out_dtype)
        return fp32_mm(a, b, bias, out_dtype)


class EmptyKCrash(Fp32Base):
    name = "mutant-empty-k-crash"
    upstream = _ISSUE
    klass = "degenerate shapes"
    bug = "the K loop's first segment is read unconditionally: K = 0 raises IndexError instead of the spec's " \
          "ValueError"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        first = gemm.k_segments(a, b)[0]
        del first
        return fp32_mm(a, b, bias, out_dtype)


class EmptyKDropsBias(Fp32Base):
    name = "mutant-empty-k-drops-bias"
    upstream = "fp8ref issue 39"
    klass = "degenerate shapes"
    bug = "K = 0 returns early with a zero output, before the epilogue that adds the bias: y = 0, not the bias"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[1] == 0:
            return torch.zeros(a.data.shape[0], b.data.shape[0], dtype=out_dtype)
        return fp32_mm(a, b, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# size limits

#: The CUDA grid's limit on its y and z dimensions.
_GRID_Y = 65535


class GridRowsCapped(Fp32Base):
    name = "mutant-grid-rows-capped"
    upstream = _ISSUE
    klass = "size limits"
    bug = "one program per output row on grid.y, capped at 65535: the rows past it are never written"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        M = a.data.shape[0]
        if M <= _GRID_Y:
            return fp32_mm(a, b, bias, out_dtype)
        y = torch.full((M, b.data.shape[0]), float("nan"), dtype=out_dtype)
        r, _ = a.scheme.block_shape(*a.data.shape)
        rows = _GRID_Y - _GRID_Y % r  # whole scale blocks
        head = Quantized(a.data[:rows], a.scale[:rows // r], a.scheme)
        y[:rows] = fp32_mm(head, b, bias, out_dtype)
        return y


class KOffset16Bit(Fp32Base):
    name = "mutant-k-offset-16-bit"
    upstream = _ISSUE
    klass = "size limits"
    bug = "the K loop counts in 16 bits: K past 65536 wraps, and only the first K mod 65536 columns are summed"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        K = a.data.shape[1]
        if K <= 1 << 16:
            return fp32_mm(a, b, bias, out_dtype)
        k = K % (1 << 16)
        y = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32)
        for k0, k1 in gemm.k_segments(a, b):
            if k0 >= k:
                break
            k1 = min(k1, k)
            A, B = a.data[:, k0:k1].to(torch.float32), b.data[:, k0:k1].to(torch.float32)
            y += (A @ B.T) * gemm.scale_column(a, k0).to(torch.float32)[:, None] * \
                gemm.scale_column(b, k0).to(torch.float32)[None, :]
        return finish(y, bias, out_dtype)


#: Each class of this catalogue and the dimension of the calling contract (``CALLING_DIMENSIONS``) that
#: must reject its mutants.
CALLING_CLASSES = {"layout": "layout", "inputs and outputs": "untouched", "lifetime": "lifetime",
                   "concurrency": "threads", "special values": "non_finite", "degenerate shapes": "degenerate",
                   "size limits": "size_limits"}

CALLING_MUTANTS = (PointerOnlyOperands, PointerOnlyActivations, ScaleInPlace, ScaleAliasesCaller, ReusedOutput,
                   PreparedCacheById, PreparedCacheByVersion, QuantizeMemo, SharedScratch, NanCodesZeroed,
                   InfSaturates, NanScaleAsOne, SaturatingEpilogue, OneRowGrid, EmptyKCrash, EmptyKDropsBias,
                   GridRowsCapped, KOffset16Bit)
CALLING_CORRECT = (ContiguousFirst, RefusesViews, PreparedCopy, ThreadLocalScratch, IeeePropagate)

__all__ = [c.__name__ for c in CALLING_MUTANTS + CALLING_CORRECT] + [
    "CALLING_CLASSES", "CALLING_MUTANTS", "CALLING_CORRECT", "ieee_quantize"]
