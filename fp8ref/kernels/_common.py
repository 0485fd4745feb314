"""Helpers shared by the shipped backends: a fast spec-exact quantizer, prepared weights, checks.

Nothing here is part of the spec; every function is checked against ``fp8ref.spec.quant`` /
``fp8ref.spec.gemm`` by ``tests/test_kernels.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..spec import quant
from ..spec.checks import BIAS_NON_FINITE, check_finite
from ..spec.fenv import ieee
from ..spec.gemm import check_operands
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ..weightcheck import range_tensors
from . import native

__all__ = ["ieee_methods", "PreparedWeight", "Shared", "amax_all_finite", "fast_quantize", "fast_scheme",
           "native_quant", "native_rows", "native_format_args", "segment_scale", "standard_scale", "check_mm_args",
           "empty_result", "unwrap", "pad_last", "pad_weight", "zeros", "bias_fp32", "NativeBound", "X_DTYPES",
           "watch_args"]


_IEEE_METHODS = ("quantize", "scaled_mm", "linear", "prepare_weight")


def _ieee_method(fn):
    method = ieee(fn)
    method._ieee = True
    return method


def ieee_methods(cls):
    """Class decorator for fp8ref's own backends: ``quantize``, ``scaled_mm``, ``linear`` and
    ``prepare_weight`` compute with subnormals kept whatever the calling thread flushes
    (``torch.set_flush_denormal``; fp8ref.spec.fenv), so that a backend's bits do not depend on the
    caller's floating-point environment. The check and the wrapper's frame cost about a
    microsecond per call (docs/performance.md, "Figures behind the code"); the C++ kernels also
    guard MXCSR themselves, on every thread they run on. Third-party backends are left as they are:
    ``fp8ref.linear`` guards every call it makes, and the conformance suite runs them as written.
    """
    for name in _IEEE_METHODS:
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "_ieee", False):
            setattr(cls, name, _ieee_method(fn))
    return cls


#: x's dtypes as the extension's bound calls number them (``x_code``).
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def watch_args(watch, epoch: torch.Tensor) -> tuple | None:
    """The trailing arguments of the extension's bound calls (``PlanCheck`` in csrc/linear.cpp) for a
    ``fp8ref.weightcheck.Watch``: ``(x_code, m_lo, m_hi, epoch, tensors, versions, addresses,
    lengths, expected)``; None where they cannot check it (x's dtype not one they take, a sample of
    device memory)."""
    if watch.x_dtype not in X_DTYPES or (watch.byte_ranges is None and watch.sampled):
        return None
    return (X_DTYPES.index(watch.x_dtype), watch.m_lo, watch.m_hi, epoch, list(watch.tensors), list(watch.versions),
            *range_tensors(watch.byte_ranges))


class NativeBound:
    """The warm-call hooks (``Backend.bind_linear``, ``bind_watched_linear``) of a backend whose
    fused ``linear`` is one entry point of the extension (``cpu-fp8``'s ``fp8_linear``,
    ``cpu-bf16``'s and ``cpu-fp32``'s ``wide_linear``; csrc/linear.cpp).

    The backend gives ``_bound_args(w, scheme, out_dtype)``: ``(entry point, its arguments before
    the bias, its arguments after has_bias)``, or None where its fused path does not apply;
    ``_bind_state()``: the settings that pick the kernel; ``_WATCHED``: the extension's class of
    the watched call; and ``_KERNEL_SETTINGS``: the names whose change changes the kernel. Setting
    or deleting one of those bumps ``_epoch``, a one-element counter the watched calls read
    (``WeightWatch`` in csrc/linear.cpp), so that a call bound before hands its calls back.
    """

    #: Names whose change changes the kernel that runs: setting one bumps ``_epoch``.
    _KERNEL_SETTINGS: tuple[str, ...] = ()
    #: The extension's class of the watched call (``BoundLinear``, ``BoundWideLinear``).
    _WATCHED = ""

    def _bound_args(self, w, scheme: QuantScheme, out_dtype: torch.dtype) -> tuple | None:
        raise NotImplementedError

    def _bind_state(self) -> tuple:
        raise NotImplementedError

    def bind_linear(self, w, scheme: QuantScheme, out_dtype: torch.dtype):
        """``linear``'s fused path for one prepared weight, as one call into the extension (the
        same steps in the same order, so the same bits); None where that path does not apply
        (``_bound_args``). The call hands a case back (None) where ``linear`` would leave its fused
        path, and when the settings that pick the kernel (``_bind_state``) changed since binding."""
        bound = self._bound_args(w, scheme, out_dtype)
        if bound is None:
            return None
        fn, args, tail = bound
        sb = args[-1]  # an unread placeholder for the bias (a tensor the entry point accepts)
        state = self._bind_state()

        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
            if self._bind_state() != state:
                return None
            if bias is None:
                return fn(x, *args, sb, False, *tail)
            return fn(x, *args, bias, True, *tail)

        return run

    def bind_watched_linear(self, w, scheme: QuantScheme, out_dtype: torch.dtype, watch):
        """``bind_linear``'s call with the plan's checks in the extension too (``PlanCheck`` in
        csrc/linear.cpp: x's dtype and rows, grad mode, the weight tensors' pointers, versions,
        sizes and strides, the sample's bytes, and this backend's kernel settings through
        ``_epoch``): one call from Python per warm layer call."""
        bound = self._bound_args(w, scheme, out_dtype)
        mod = native.loaded()
        checks = watch_args(watch, self._epoch)
        if bound is None or mod is None or not hasattr(mod, self._WATCHED) or checks is None:
            return None
        _, args, tail = bound
        return getattr(mod, self._WATCHED)(*args, *tail, *checks)

    @property
    def _epoch(self) -> torch.Tensor:
        """A one-element int64 counter of this instance's kernel-setting changes."""
        cell = self.__dict__.get("_epoch_cell")
        if cell is None:
            cell = self.__dict__["_epoch_cell"] = torch.zeros(1, dtype=torch.int64)
        return cell

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in self._KERNEL_SETTINGS:
            self._epoch.add_(1)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        if name in self._KERNEL_SETTINGS:
            self._epoch.add_(1)


@dataclass(frozen=True, eq=False)
class PreparedWeight(Quantized):
    """A quantized weight plus the per-backend copies ``prepare_weight`` made once at load time.

    It *is* a ``Quantized`` (same data, scale and scheme), so every spec function and every other
    backend accepts it; the backend named ``backend`` finds its cached tensors in ``extra``.
    """

    backend: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def wrap(cls, q: Quantized, backend: str, **extra: Any) -> PreparedWeight:
        return cls(q.data, q.scale, q.scheme, q.n_saturated, backend, dict(extra))


class Shared:
    """A cached tensor that copies share: ``copy.deepcopy`` returns the same object. For torch's
    opaque tensors (oneDNN's packed weights), which cannot be copied, and are never written."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict) -> Shared:
        return self

    def __repr__(self) -> str:
        v = self.value
        return f"Shared({type(v).__name__} {tuple(getattr(v, 'shape', ()))} {getattr(v, 'dtype', '')})"


def unwrap(b: Quantized, backend: str) -> tuple[Quantized, dict[str, Any]]:
    """``(quantized, cached extras)``; the extras are empty unless ``b`` was prepared by ``backend``."""
    if isinstance(b, PreparedWeight) and b.backend == backend:
        return b, b.extra
    return b, {}


def check_mm_args(a: Quantized, b: Quantized, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    """The argument checks of the reference ``scaled_mm`` (same exceptions), the bias's NaN/Inf scan
    included: the spec raises there, and a kernel would return NaN columns (N elements, a
    negligible cost next to the GEMM)."""
    check_operands(a, b, bias, out_dtype, finite_bias=False)
    if bias is not None:
        check_finite(bias, "bias", BIAS_NON_FINITE)


def empty_result(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The reference's result when there is nothing to compute (M = 0 or N = 0: an empty
    ``[M, N]`` tensor), else None. Call it after ``check_mm_args``, before any kernel: a kernel
    launched on an empty operand may divide by zero or concatenate an empty list."""
    M, N = a.data.shape[0], b.data.shape[0]
    if M and N:
        return None
    return torch.empty(M, N, dtype=out_dtype, device=a.data.device)


def bias_fp32(bias: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The bias as a contiguous fp32 tensor on ``device`` (one rounding for a float64 bias, covered by
    the fp32 bound; contiguous because native kernels take a pointer, and a caller's bias may be a
    strided view)."""
    if bias is None:
        return None
    return bias.to(device=device, dtype=torch.float32).contiguous()


def pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim of a 2-D tensor up to a multiple of ``multiple`` (no copy if aligned).

    Zero FP8 codes add exact zeros to every dot product, so padding K (or N, whose extra outputs
    are sliced off) changes no result.
    """
    extra = (-t.shape[-1]) % multiple
    if not extra:
        return t
    out = zeros(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=t.device)
    _bytes(out)[..., : t.shape[-1]] = _bytes(t)
    return out


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as uint8 views (fill and indexed writes are not implemented for FP8 everywhere)."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros`` that also works for FP8 dtypes on every device (all-zero bytes are +0)."""
    if dtype in _FP8:
        return torch.zeros(*shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)


def pad_weight(data: torch.Tensor, multiple: int) -> torch.Tensor:
    """``[N, K]`` codes zero-padded to ``[N', K']``, both multiples of ``multiple`` (no copy if aligned)."""
    N, K = data.shape
    if N % multiple == 0 and K % multiple == 0:
        return data
    out = zeros(N + (-N) % multiple, K + (-K) % multiple, dtype=data.dtype, device=data.device)
    _bytes(out)[:N, :K] = _bytes(data)
    return out


def native_format_args(scheme: QuantScheme) -> tuple[int, int, int, bool]:
    """``(mantissa bits, exponent of the smallest normal, bias, has -0)`` for ``quant_blocks``."""
    f = scheme.format
    return f.mantissa_bits, int(math.log2(f.smallest_normal)), f.bias, f.has_negative_zero


def native_quant(x: torch.Tensor, scheme: QuantScheme, mode: int, isa: int = -1):
    """Dynamic quantization of a CPU ``x`` by the extension, any granularity: ``(out, scale, amax)``
    with ``out`` the codes (mode 0, uint8) or the FP8 values as bf16 (1) or fp32 (2), ``scale``
    and ``amax`` of ``scheme.scale_shape``; None where the extension or the case does not apply.
    ``amax`` is +inf on a block holding NaN or Inf or whose scale overflows fp32 (the caller then
    asks the spec, which raises). ``isa`` forces a code path (0 scalar, 1 AVX2, 2 AVX-512; tests)."""
    if (not fast_scheme(scheme) or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() != 2 or x.numel() == 0):
        return None
    mod = native.get()
    if mod is None:
        return None
    r, c = scheme.block_shape(*x.shape)
    return mod.quant_blocks(x.contiguous(), r, c, scheme.qmax, scheme.amax_floor, *native_format_args(scheme),
                            scheme.pow2_scale, mode, isa)


def native_rows(x: torch.Tensor, scheme: QuantScheme, mode: int):
    """``native_quant`` for per-row schemes without power-of-two scales (the fused ``linear`` of
    the wide CPU backends), else None."""
    if scheme.granularity is not Granularity.ROW or scheme.pow2_scale:
        return None
    return native_quant(x, scheme, mode)


def fast_scheme(scheme: QuantScheme) -> bool:
    """Whether the extension's quantizer computes ``scheme`` (dynamic, fp32 scales, the standard rule)."""
    return scheme.dynamic and scheme.scale_dtype == torch.float32 and scheme.standard_scale_rule


def amax_all_finite(amax: torch.Tensor) -> bool:
    """Whether every block's amax is finite: one reduction and one ``item()``. The amaxes are
    magnitudes, +inf for a block holding NaN or Inf (or whose scale overflows) in the extension's
    answer; an eager amax over NaN is NaN, which compares false as well. On a call of its own it
    is several times cheaper than ``bool(torch.isfinite(amax).all())``; between back-to-back
    quantizations (threads already awake) the two differ by less than the timing noise
    (docs/performance.md, "Figures behind the code").
    """
    return amax.numel() == 0 or amax.max().item() < math.inf


def standard_scale(amax: torch.Tensor, qmax: float, floor: float, pow2: bool = False) -> torch.Tensor:
    """The spec's dynamic scale for a scheme with ``standard_scale_rule`` and fp32 scales, from the
    fp32 block amaxes: ``s = max(amax, floor) / qmax`` (one fp32 division), 1 where that is 0,
    rounded up to a power of two with ``pow2``, at least fp32's smallest normal
    (``fp8ref.spec.quant.compute_scale`` with the general rule). The torch paths of
    ``fast_quantize`` and of the CPU backends' fused quantizers share it.
    """
    s = torch.clamp(amax, min=floor) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    if pow2:
        m, e = torch.frexp(s)  # s = m * 2**e, 0.5 <= m < 1; a power of two has m == 0.5
        s = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
    return torch.clamp(s, min=torch.finfo(torch.float32).tiny)


def fast_quantize(x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
    """``fp8ref.quantize`` for dynamic schemes with fp32 scales, in fewer passes over ``x``.

    Computes the same expressions as the spec in the same order (amax in fp32 -- exact --,
    ``s = max(amax, floor) / qmax`` in fp32, ``x / s`` as one IEEE division, clamp, one RNE
    cast), so the codes and scales are bit-identical to ``fp8ref.quantize``; what it saves is the
    full fp32 copy of ``x`` and the separate finiteness and saturation passes. On a CPU with the
    extension built, every granularity (tensor, row, 1 x G groups, R x C blocks) runs in C++
    (``native_quant``: each block read for its amax and quantized while in cache; AVX-512, AVX2 or
    scalar code chosen at run time); elsewhere the torch code below. A non-finite input
    still raises ``ValueError``: NaN or Inf in a block makes that block's amax non-finite, which is
    checked on the (small) amax tensor. Other schemes (static ones with their ``scale`` among them)
    go to the reference quantizer.

    ``n_saturated`` is 0: with a dynamic fp32 scale s = fl(max(amax, floor)/qmax), |x/s| <=
    qmax (1 + u32)^2, far below the saturation threshold qmax + ulp(qmax)/2, and pow2 scales only
    round s up.

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.kernels._common import fast_quantize
    >>> x = torch.randn(4, 32)
    >>> q = fast_quantize(x, fp8ref.QuantScheme())
    >>> torch.equal(q.data.view(torch.uint8), fp8ref.quantize(x).data.view(torch.uint8))
    True
    """
    if scale is not None or not fast_scheme(scheme):
        return quant.quantize(x, scheme, scale)
    if (not isinstance(x, torch.Tensor) or x.layout is not torch.strided or x.is_nested or x.device.type == "meta"
            or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return quant.quantize(x, scheme)  # the reference raises the right error (sparse, nested...) or handles fp64
    rows, cols = x.shape
    if x.numel() == 0 or cols == 0:
        return quant.quantize(x, scheme)
    got = native_quant(x, scheme, 0)
    if got is not None:
        codes, s, amax = got
        if not amax_all_finite(amax):
            return quant.quantize(x, scheme)  # raises: NaN/Inf in x, or a scale that overflows
        return Quantized(codes.view(scheme.format.torch_dtype), s, scheme, 0)
    g = scheme.granularity
    if g is Granularity.ROW:
        amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
        expand = lambda s: s  # noqa: E731 - [rows, 1] broadcasts
    elif g is Granularity.TENSOR:
        amax = x.abs().amax().to(torch.float32).reshape(1, 1)
        expand = lambda s: s  # noqa: E731
    elif g is Granularity.GROUP and cols % scheme.group_size == 0:
        G = scheme.group_size
        amax = x.reshape(rows, cols // G, G).abs().amax(dim=2).to(torch.float32)
        expand = lambda s: s.repeat_interleave(G, dim=1)  # noqa: E731
    else:
        return quant.quantize(x, scheme)
    if not amax_all_finite(amax):
        quant.check_float_input(x)  # raises with the location of the first bad element
    s = standard_scale(amax, scheme.qmax, scheme.amax_floor, scheme.pow2_scale)
    # bf16/fp16 / fp32 promotes to fp32 (x widened exactly, one IEEE division): the spec's v, in a
    # single fresh fp32 buffer that the clamp then reuses.
    v = torch.div(x, expand(s))
    data = v.clamp_(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
    return Quantized(data, s, scheme, 0)


def segment_scale(q: Quantized, k0: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scale of every row of ``q`` at column ``k0``, as a ``[rows]`` vector in ``dtype``."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    col = q.scale[:, k0 // c].to(dtype)
    return col if r == 1 else col.repeat_interleave(r)[:rows]
