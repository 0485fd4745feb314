"""The reference quantizer: what FP8 quantization of a 2-D tensor computes, bit for bit.

For a block B of ``x`` (shape ``[rows, cols]``, blocks from the scheme's granularity)::

    amax  = max |x_i| over B                       (in fp32: exact)
    s     = max(amax, floor) / qmax                (correctly rounded to scale_compute_dtype, fp32
                                                    by default; with reciprocal_scale
                                                    fl32(1 / fl32(qmax / max(amax, floor)));
                                                    s = zero_scale if it is 0)
    s     = 2**ceil(log2 s)                        (only with pow2_scale)
    s     = round(s, scale_dtype)                  (stored scale; at least scale_dtype's smallest
                                                    normal, or subnormal with subnormal_scales)
    v_i   = fl32(x_i / s)                          (a true IEEE division, one rounding; with
                                                    multiply_codes fl32(x_i * m), docs/spec.md §3)
    q_i   = RNE_fmt(clamp(v_i, -qmax, qmax))       (one rounding to the FP8 grid)

and ``x_i ~ q_i * s`` (the *dequantization* scale, the convention of ``torch._scaled_mm``).
NaN or +-Inf anywhere in ``x`` raises ``ValueError``: a quantizer must never return a silent
all-zero or all-NaN result. See docs/spec.md for the derivation of every choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dense import check_dense
from .fenv import ieee
from .formats import Fp8Format
from .schemes import Granularity, QuantScheme

__all__ = [
    "Quantized",
    "quantize",
    "dequantize",
    "compute_scale",
    "expand_scale",
    "round_to_format",
    "check_float_input",
    "saturation_threshold",
]

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Fraction bits of each scale dtype: its smallest subnormal is smallest_normal * 2**-bits.
_SIGNIFICAND_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


@dataclass(frozen=True)
class Quantized:
    """A quantized 2-D tensor: ``x ~ data * expand(scale)``.

    Attributes
    ----------
    data : torch.Tensor
        FP8 codes, ``[rows, cols]``, dtype ``scheme.format.torch_dtype``.
    scale : torch.Tensor
        Dequantization scales, ``scheme.scale_shape(rows, cols)``, dtype ``scheme.scale_dtype``
        (multipliers, ``x ~ data / scale``, when ``scheme.multiplier_scale``).
    scheme : QuantScheme
        The scheme that produced it.
    n_saturated : int or None
        Elements whose value the clamp changed by more than half an FP8 ulp (|x/s| >
        qmax + ulp(qmax)/2); None when the producer did not count (third-party backends).
    """

    data: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    n_saturated: int | None = None

    def __post_init__(self) -> None:
        fmt = self.scheme.format
        if self.data.dtype != fmt.torch_dtype:
            raise TypeError(f"Quantized.data has dtype {self.data.dtype}, scheme {self.scheme.short_str()} "
                            f"needs {fmt.torch_dtype}")
        if self.data.dim() != 2:
            raise ValueError(f"Quantized.data must be 2-D [rows, cols], got shape {tuple(self.data.shape)}")
        want = self.scheme.scale_shape(*self.data.shape)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"Quantized.scale has shape {tuple(self.scale.shape)}, scheme "
                             f"{self.scheme.short_str()} on data {tuple(self.data.shape)} needs {want}")
        if self.scale.dtype != self.scheme.scale_dtype:
            raise TypeError(f"Quantized.scale has dtype {self.scale.dtype}, scheme needs {self.scheme.scale_dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def check_float_input(x: torch.Tensor, what: str = "x") -> None:
    """Raise TypeError/ValueError unless ``x`` is a dense 2-D float tensor with finite values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(x, what)
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{what} must have a float dtype {[str(d) for d in _FLOAT_INPUTS]}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D [rows, cols], got shape {tuple(x.shape)}; "
                         "flatten leading dims first (fp8ref.linear does)")
    if x.shape[1] == 0:
        raise ValueError(f"{what} has 0 columns: the reduction dim K must be at least 1")
    # amax and amin propagate NaN and see +-Inf: two reductions, no full-size temporary.
    if x.numel() and not (bool(torch.isfinite(x.amax())) and bool(torch.isfinite(x.amin()))):
        _raise_non_finite(x, what)


def _raise_non_finite(x: torch.Tensor, what: str) -> None:
    bad = ~torch.isfinite(x)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    raise ValueError(f"{what} contains {int(bad.sum())} non-finite value(s) (first: {x[idx].item()} "
                     f"at index {idx}); FP8 quantization of NaN/Inf is undefined")


def _blocks(x: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """View ``x`` zero-padded to whole blocks as ``[R, r, C, c]``."""
    rows, cols = x.shape
    pr, pc = (-rows) % r, (-cols) % c
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape(x.shape[0] // r, r, x.shape[1] // c, c)


#: Elements per chunk of the quantizer's elementwise passes. Full-size fp32 temporaries of a
#: large tensor are fresh mmap'd pages every call, whose page faults cost more than the arithmetic
#: (docs/performance.md, "Figures behind the code"); chunks of ~4 MB are reused by the
#: allocator.
_CHUNK_ELEMS = 1 << 20


def _row_chunks(rows: int, cols: int, align: int) -> list[tuple[int, int]]:
    """Row ranges of about ``_CHUNK_ELEMS`` elements, each a multiple of ``align`` rows."""
    step = max(align, (_CHUNK_ELEMS // max(cols, 1)) // align * align)
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def expand_scale(scale: torch.Tensor, scheme: QuantScheme, rows: int, cols: int) -> torch.Tensor:
    """Broadcast a ``scale_shape`` scale tensor to ``[rows, cols]`` (one scale per element)."""
    r, c = scheme.block_shape(rows, cols)
    s = scale if r == 1 else scale.repeat_interleave(r, dim=0)[:rows]
    if s.shape[1] == 1:  # one scale per row: a broadcast view, no [rows, cols] copy
        return s.expand(rows, cols)
    return s.repeat_interleave(c, dim=1)[:, :cols]


def compute_scale(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Dynamic scale per block of the 2-D tensor ``x``, in ``scheme.scale_dtype``: the dequantization
    scale, or with ``multiplier_scale`` the multiplier.

    Notes
    -----
    s = max(amax, floor) / qmax correctly rounded to ``scale_compute_dtype`` (fp32 by default;
    computed in fp32 and rounded once more, which equals the correctly rounded quotient because
    fp32 carries more than 2p + 2 bits of a bf16/fp16 significand) -- or, with ``reciprocal_scale``,
    s = fl32(1 / fl32(qmax / max(amax, floor))) (the multiplier as fl32(qmax * fl32(1 / max(amax,
    floor))) with ``multiplier_by_reciprocal``), where a multiplier that overflows to Inf (amax 0
    with no floor, or amax below qmax / 2**128) gives 0 --, ``zero_scale`` where that is 0, then
    rounded up to a power of two if ``pow2_scale``, then stored in ``scale_dtype``, never below
    that dtype's smallest normal (smallest subnormal with ``subnormal_scales``). Hence
    s > 0 and finite for every finite input. With ``multiplier_scale`` it returns
    m = fl32(qmax / max(amax, floor)) instead, fl32(1 / zero_scale) where that overflows.
    """
    return _dynamic_scale(x, scheme)[0]


def _amax(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """max |x| per block, fp32 (exact), in ``scheme.scale_shape``."""
    rows, cols = x.shape
    r, c = scheme.block_shape(rows, cols)
    if x.numel() == 0:
        return torch.zeros(scheme.scale_shape(rows, cols), dtype=torch.float32, device=x.device)
    if scheme.granularity is Granularity.TENSOR:
        amax = torch.stack([x[r0:r1].abs().amax().to(torch.float32) for r0, r1 in _row_chunks(rows, cols, 1)])
        return amax.amax().reshape(1, 1)
    return torch.cat([_blocks(x[r0:r1].to(torch.float32).abs(), r, c).amax(dim=(1, 3))
                      for r0, r1 in _row_chunks(rows, cols, r)])


@ieee
def _dynamic_scale(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored scale, multiplier): ``compute_scale``'s scale and, where the scheme derives the scale
    from a multiplier (``reciprocal_scale``, ``multiplier_scale``), that fp32 multiplier (else None)."""
    amax = _amax(x, scheme)
    floored = torch.clamp(amax, min=scheme.amax_floor)
    mult = None
    if scheme.multiplier_by_reciprocal:  # torch's ``float / tensor``: qmax * fl32(1 / amax)
        mult = torch.reciprocal(floored) * scheme.qmax
    elif scheme.reciprocal_scale or scheme.multiplier_scale:
        # a tensor numerator: torch evaluates ``float / tensor`` as float * (1 / tensor), a second rounding
        mult = torch.full_like(floored, scheme.qmax) / floored
    if scheme.multiplier_scale:
        m = torch.where(torch.isinf(mult), torch.full_like(mult, 1.0 / scheme.zero_scale), mult)
        if not bool((m > 0).all()):
            raise ValueError(f"a multiplier qmax / amax underflows fp32 (qmax {scheme.qmax:g} / amax "
                             f"{float(amax.max()):g}); use a larger qmax")
        return m, m
    s = torch.reciprocal(mult) if scheme.reciprocal_scale else floored / scheme.qmax
    if scheme.scale_compute_dtype != torch.float32:
        s = s.to(scheme.scale_compute_dtype).to(torch.float32)
    s = torch.where(s == 0, torch.full_like(s, scheme.zero_scale), s)
    if scheme.pow2_scale:
        m, e = torch.frexp(s)  # s = m * 2**e, 0.5 <= m < 1; a power of two has m == 0.5
        s = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
    info = torch.finfo(scheme.scale_dtype)
    lowest = info.smallest_normal * (2.0 ** -_SIGNIFICAND_BITS[scheme.scale_dtype] if scheme.subnormal_scales else 1)
    s = torch.clamp(s, min=lowest).to(scheme.scale_dtype)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"a scale overflows {scheme.scale_dtype} (amax {float(amax.max()):g} / qmax "
                         f"{scheme.qmax:g} > {info.max:g}); use a wider scale_dtype")
    return s, mult


def _code_multiplier(s: torch.Tensor, mult: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """The fp32 m of ``multiply_codes`` per block: the stored multiplier (``multiplier_scale``); the
    multiplier the scale was derived from where the stored scale is exactly its fp32 reciprocal;
    else fl32(1 / s) (Inf where s is subnormal: those blocks divide)."""
    if scheme.multiplier_scale:
        return s.to(torch.float32)
    s32 = s.to(torch.float32)
    inv = torch.reciprocal(s32)
    if mult is None:
        return inv
    return torch.where(torch.reciprocal(mult) == s32, mult, inv)


def saturation_threshold(fmt: Fp8Format, qmax: float) -> float:
    """|v| above which round-to-nearest would leave qmax: qmax + ulp(qmax)/2 (exact in fp32)."""
    return qmax + float(fmt.ulp(torch.tensor(qmax))) / 2


@ieee
def round_to_format(v: torch.Tensor, fmt: Fp8Format, qmax: float) -> torch.Tensor:
    """RNE_fmt(clamp(v, -qmax, qmax)) for fp32 ``v``: clamp explicitly, then one rounding.

    torch >= 2.12's cast rounds to nearest even and saturates; older casts and ml_dtypes give NaN
    on overflow, so the clamp is part of the spec rather than left to the cast.
    """
    return torch.clamp(v, -qmax, qmax).to(fmt.torch_dtype)


def _static_scale(scale, scheme: QuantScheme, rows: int, cols: int, device) -> torch.Tensor:
    want = scheme.scale_shape(rows, cols)
    s = torch.as_tensor(scale, device=device)
    if not s.is_floating_point():
        raise TypeError(f"static scale must be a float tensor, got {s.dtype}")
    if s.numel() == want[0] * want[1] and s.dim() <= 2 and (s.dim() < 2 or tuple(s.shape) == want):
        s = s.reshape(want)
    else:
        raise ValueError(f"static scale has shape {tuple(s.shape)}, scheme {scheme.short_str()} on "
                         f"[{rows}, {cols}] needs {want}")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError("static scale must be finite and > 0 everywhere "
                         f"(min {float(s.min()) if s.numel() else 'n/a'})")
    # A copy even when the dtype matches: the Quantized must not alias the caller's scale, which a
    # calibration loop may update in place after the codes were computed with it.
    stored = s.to(scheme.scale_dtype, copy=True)
    if not torch.equal(stored.to(torch.float64), s.to(torch.float64)):
        raise ValueError(f"static scale is not exactly representable in scale_dtype {scheme.scale_dtype}")
    return stored


@ieee
def quantize(x: torch.Tensor, scheme: QuantScheme | None = None, scale: torch.Tensor | None = None) -> Quantized:
    """Quantize a 2-D float tensor to FP8 under ``scheme`` (the spec; see module docstring).

    Parameters
    ----------
    x : torch.Tensor
        ``[rows, cols]``, fp32/fp16/bf16/fp64 (fp64 is first rounded to fp32), finite.
    scheme : QuantScheme, optional
        Defaults to ``QuantScheme()``: E4M3FN, dynamic per-row.
    scale : torch.Tensor, optional
        The dequantization scale, required for a static scheme and refused for a dynamic one;
        shape ``scheme.scale_shape(rows, cols)`` (a scalar for per-tensor, ``[rows]`` for per-row).

    Returns
    -------
    Quantized
        With ``n_saturated`` counted (non-zero only when a static or rounded scale clips).

    Examples
    --------
    >>> import torch, fp8ref
    >>> q = fp8ref.quantize(torch.tensor([[1.0, -2.0, 448.0]]), fp8ref.QuantScheme())
    >>> q.data.float().tolist(), q.scale.item()
    ([[1.0, -2.0, 448.0]], 1.0)
    """
    scheme = QuantScheme() if scheme is None else scheme
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme must be a QuantScheme, got {type(scheme).__name__}")
    check_float_input(x)
    rows, cols = x.shape
    mult = None
    if scheme.dynamic:
        if scale is not None:
            raise ValueError(f"scheme {scheme.short_str()} is dynamic: pass no scale (or use dynamic=False)")
        s, mult = _dynamic_scale(x, scheme)
    else:
        if scale is None:
            raise ValueError(f"scheme {scheme.short_str()} is static: quantize needs scale=")
        s = _static_scale(scale, scheme, rows, cols, x.device)
    m32 = _code_multiplier(s, mult, scheme) if scheme.multiply_codes else None
    fmt = scheme.format
    threshold = saturation_threshold(fmt, scheme.qmax)
    data = torch.empty(x.shape, dtype=fmt.torch_dtype, device=x.device)
    s32 = s.to(torch.float32)
    r = 1 if scheme.granularity is Granularity.TENSOR else scheme.block_shape(rows, cols)[0]
    n_sat = 0
    for r0, r1 in _row_chunks(rows, cols, r):
        if scheme.granularity is Granularity.TENSOR:
            s_chunk, m_chunk = s32, m32
        else:  # the chunk starts on a block boundary, so its scale rows are whole
            s_chunk = expand_scale(s32[r0 // r:-(-r1 // r)], scheme, r1 - r0, cols)
            m_chunk = None if m32 is None else expand_scale(m32[r0 // r:-(-r1 // r)], scheme, r1 - r0, cols)
        x32 = x[r0:r1].to(torch.float32)
        if m_chunk is None:
            v = x32 / s_chunk
        elif scheme.multiplier_scale:
            v = x32 * m_chunk
        else:  # where 1 / s overflows (a subnormal s) the block divides: 0 * Inf would be NaN
            v = torch.where(torch.isfinite(m_chunk), x32 * m_chunk, x32 / s_chunk)
        n_sat += int((v.abs() > threshold).sum())
        data[r0:r1] = round_to_format(v, fmt, scheme.qmax)
    return Quantized(data, s, scheme, n_sat)


@ieee
def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` per element, computed exactly in fp64 and rounded once to ``dtype``
    (``data / scale`` with ``multiplier_scale``: correctly rounded in fp64, then to ``dtype``).

    The product of a 4-bit FP8 significand and a <= 24-bit scale significand has at most 28
    bits, so the fp64 product is exact. A quotient is not, but rounding it to fp64 and then to
    fp32, bf16 or fp16 is innocuous double rounding (53 >= 2 * 24 + 2 bits).
    """
    rows, cols = q.data.shape
    s = expand_scale(q.scale.to(torch.float64), q.scheme, rows, cols)
    if q.scheme.multiplier_scale:
        return (q.data.to(torch.float64) / s).to(dtype)
    return (q.data.to(torch.float64) * s).to(dtype)
