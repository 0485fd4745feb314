"""The reference scaled GEMM: y = (a . b^T) (.) scales + bias, accumulated exactly, rounded once.

``a`` holds quantized activations ``[M, K]``, ``b`` quantized weights ``[N, K]``. Along K each
operand's scale is piecewise constant; the union of both operands' block edges cuts K into
*segments* on which both scales are constant. Then, exactly::

    y[m, n] = sum over segments g of  sa[m, g] * sb[n, g] * S_g[m, n]  +  bias[n]
    S_g[m, n] = sum over k in g of  a[m, k] * b[n, k]

``S_g`` is computed exactly with float64 GEMMs: every FP8 value is an integer multiple of the
format's smallest subnormal 2**-p, so every product is a multiple of 2**-(pa+pb), and any partial
sum of such products is a float64 as long as its magnitude stays below 2**(53-pa-pb) (see
docs/spec.md, "Exact accumulation"). Where one GEMM would break that limit (E5M2's 32 binades,
or K beyond ~171k for E4M3), the operands are split by magnitude and K is chunked until each
GEMM is exact; the few exact partial results are then added in float64, whose error
``bounds.reference_gemm_error_bound`` states. The epilogue (scales, segment sum, bias) runs in
float64 and the result is rounded once to ``out_dtype``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .checks import BIAS_NON_FINITE, OUT_DTYPES, check_bias, check_finite, check_out_dtype
from .fenv import ieee
from .formats import Fp8Format
from .quant import Quantized

__all__ = ["scaled_mm", "scaled_mm_exact", "k_segments", "scale_column", "check_operands", "ExactPlan", "exact_plan",
           "OUT_DTYPES"]

_F64_SIGNIFICAND = 53


@dataclass(frozen=True)
class _Part:
    """Values of a format with lo <= |v| < hi: integer multiples of 2**-p, at most vmax."""

    lo: float
    hi: float
    p: int
    vmax: float


def _parts(fmt: Fp8Format) -> tuple[_Part, ...]:
    p_sub = -fmt.min_exponent + fmt.mantissa_bits  # smallest subnormal = 2**-p_sub
    if fmt.exponent_bits <= 4:
        return (_Part(0.0, float("inf"), p_sub, fmt.max),)
    # E5M2 spans 32 binades, too many for one exact float64 product sum: split at 1.0.
    # Values < 1 are multiples of 2**-16 (max 0.875); values >= 1 multiples of 2**-2.
    below_one = 1.0 - 2.0 ** -fmt.mantissa_bits / 2
    return (_Part(0.0, 1.0, p_sub, below_one), _Part(1.0, float("inf"), fmt.mantissa_bits, fmt.max))


@dataclass(frozen=True)
class ExactPlan:
    """How the reference sums one K-segment: operand parts and the chunk length of K."""

    pairs: tuple[tuple[_Part, _Part], ...]
    chunk: int  #: largest K-chunk for which every pair's float64 GEMM is exact


def exact_plan(fa: Fp8Format, fb: Fp8Format) -> ExactPlan:
    """Split and chunk length that make each float64 GEMM exact for formats ``fa`` x ``fb``.

    Notes
    -----
    A pair of parts with spacings 2**-pa, 2**-pb and maxima ma, mb gives products that are
    multiples of 2**-(pa+pb) with magnitude <= ma*mb; a sum of L of them is exact in float64 when
    L * ma * mb <= 2**(53 - pa - pb). chunk is the smallest such L over all pairs.
    """
    pairs = tuple((x, y) for x in _parts(fa) for y in _parts(fb))
    chunk = min(int(2.0 ** (_F64_SIGNIFICAND - x.p - y.p) // (x.vmax * y.vmax)) for x, y in pairs)
    if chunk < 1:
        raise AssertionError(f"no exact float64 plan for {fa.name} x {fb.name}")
    return ExactPlan(pairs, chunk)


def k_segments(a: Quantized, b: Quantized) -> list[tuple[int, int]]:
    """Half-open K ranges on which both operands' scales are constant."""
    K = a.data.shape[1]
    _, ca = a.scheme.block_shape(*a.data.shape)
    _, cb = b.scheme.block_shape(*b.data.shape)
    edges = sorted(set(range(0, K, ca)) | set(range(0, K, cb)) | {K})
    return list(zip(edges[:-1], edges[1:], strict=True))


def check_operands(a: Quantized, b: Quantized, bias: torch.Tensor | None, out_dtype: torch.dtype, *,
                   finite_bias: bool = True) -> None:
    """The argument checks of ``scaled_mm`` (backends reuse them for the same errors and messages);
    ``finite_bias=False`` skips the NaN/Inf scan of the bias (a device sync on hot paths)."""
    if not isinstance(a, Quantized) or not isinstance(b, Quantized):
        raise TypeError("scaled_mm takes two fp8ref.Quantized operands: a [M, K] activations, b [N, K] weights")
    for what, q in (("a", a), ("b", b)):
        if q.scheme.multiplier_scale:
            raise ValueError(f"{what} was quantized as {q.scheme.short_str()}, whose scale is a multiplier "
                             "(x ~ q / m): scaled_mm takes dequantization scales (x ~ q * s)")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"K mismatch: a is {tuple(a.data.shape)} [M, K] but b is {tuple(b.data.shape)} [N, K]")
    if a.data.shape[1] == 0:  # as the quantizer says: K = 0 is the caller's error, not an empty sum
        raise ValueError("a and b have 0 columns: the reduction dim K must be at least 1")
    if a.data.device != b.data.device:
        raise ValueError(f"a is on {a.data.device} but b is on {b.data.device}")
    check_out_dtype(out_dtype)
    check_bias(bias, b.data.shape[0])
    if finite_bias and bias is not None:
        check_finite(bias, "bias", BIAS_NON_FINITE)


#: K tile and N block: the activations are widened to float64 once per K-chunk, the weight one
#: [_BLOCK_N, _TILE] block at a time into a reused buffer, each block multiplied into its column
#: block of the result at once, so that its float64 values (2 MiB) are still in cache when
#: ``addmm_`` reads them (a full float64 copy of the weight had made page faults the dominant cost;
#: [N, 512] tiles, the layout before, were 16 MiB at N = 4096 and came back from memory). Of the
#: tile and block sizes timed against each other, 512 x 512 was the fastest (docs/performance.md,
#: "Figures behind the code").
_TILE = 512
_BLOCK_N = 512
#: The most activation codes widened at once (their buffers: 14 bytes per code, 56 MiB).
_A_PANEL = 1 << 22


def _value_table(fmt: Fp8Format, device: torch.device) -> torch.Tensor:
    """The float64 value of each of the 256 codes, indexed by code: torch's own FP8 -> float64
    cast, applied once to the 256 codes (NaN codes give NaN, as the cast does)."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return codes.view(fmt.torch_dtype).to(torch.float64)


@dataclass(frozen=True)
class _Route:
    """How one format's codes become fp16 bits: sign-extended to int16, shifted left by ``shift``,
    bit 14 cleared if ``clear14``; the fp16 value times 2**``log2_factor`` is the code's value,
    except for the codes in ``mismatch`` (the format's NaN codes, where fp16 sees a number)."""

    shift: int
    clear14: bool
    log2_factor: int
    mismatch: tuple[int, ...]


#: Tiles of fewer codes take the table: the route's fixed costs (its checks, three more
#: operations) outweigh what it saves there; at about this size the two took the same time
#: (docs/performance.md, "Figures behind the code").
_ROUTE_MIN_CODES = 1 << 17

#: Codes whose presence one reduction over the operand tells: the int8 maximum (0x7f), the uint8
#: maximum (0xff) and the int8 minimum (0x80).
_EXTREME_CODES = (0x7F, 0x80, 0xFF)


def _fp16_bits(codes: torch.Tensor, route: _Route, x16: torch.Tensor) -> torch.Tensor:
    """``codes`` (FP8, [rows, w]) as the int16 bits of their fp16 images, into ``x16`` [rows, w]."""
    x16.copy_(codes.view(torch.int8))  # sign extension: bits 15..8 are the sign
    x16.bitwise_left_shift_(route.shift)  # |value| <= 128 << 8: never overflows int16
    if route.clear14:
        x16.bitwise_and_(~0x4000)
    return x16


def _denormals_kept() -> bool:
    """False where the floating-point environment flushes subnormals (``torch.set_flush_denormal``)."""
    return float(torch.tensor([2.0**-140], dtype=torch.float32)[0]) != 0.0


def _fp16_route(fmt: Fp8Format, device: torch.device) -> _Route | None:
    """The fp16 route for ``fmt``, checked on all 256 codes against the cast table, or None (the
    check is kept per format, device type and whether subnormals are flushed).

    Notes
    -----
    An FP8 code s|e|m with E = 4 or 5 exponent bits, sign-extended to int16 and shifted left by
    3 + E, puts e and m at the top of fp16's exponent and mantissa fields and s at bit 15 (and, for
    E = 4, at bit 14, which is then cleared). fp16's exponent field is 5 bits with bias 15, so the
    fp16 number is 2**(e - 15) (1 + m 2**-M) for e >= 1 and 2**-14 m 2**-M for e = 0, against the
    format's 2**(e - bias) (1 + m 2**-M) and 2**(1 - bias) m 2**-M: the same value times
    2**(bias - 15) in both cases, subnormals included. fp16 -> fp32 -> float64 is exact. Which
    codes disagree is not assumed but found here on the 256 codes (under the current floating-point
    environment); the route is used only for formats whose disagreeing codes an operand's minimum
    or maximum reveals (``_EXTREME_CODES``), and only for operands that hold none of them.
    """
    return _checked_route(fmt, torch.device(device).type, _denormals_kept())


@functools.cache
def _checked_route(fmt: Fp8Format, device_type: str, denormals_kept: bool) -> _Route | None:
    device = torch.device(device_type)
    if fmt.exponent_bits not in (4, 5):
        return None
    route = _Route(3 + fmt.exponent_bits, fmt.exponent_bits == 4, 15 - fmt.bias, ())
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(fmt.torch_dtype).view(1, 256)
    bits = _fp16_bits(codes, route, torch.empty(1, 256, dtype=torch.int16, device=device))
    got = bits.view(torch.float16).to(torch.float32).to(torch.float64).view(256) * 2.0**route.log2_factor
    want = _value_table(fmt, device)
    same = (got.view(torch.int64) == want.view(torch.int64)) | (got.isnan() & want.isnan())
    mismatch = tuple(int(c) for c in torch.nonzero(~same).flatten().tolist())
    if any(c not in _EXTREME_CODES for c in mismatch):
        return None
    return _Route(route.shift, route.clear14, route.log2_factor, mismatch)


def _holds_any(codes: torch.Tensor, which: tuple[int, ...]) -> bool:
    """Whether ``codes`` (FP8, any shape) holds any of ``which`` (a subset of _EXTREME_CODES)."""
    if codes.numel() == 0 or not which:
        return False
    i8, u8 = codes.view(torch.int8), codes.view(torch.uint8)
    return ((0x7F in which and int(i8.max()) == 127) or (0x80 in which and int(i8.min()) == -128)
            or (0xFF in which and int(u8.max()) == 255))


class _Widener:
    """FP8 codes of one operand -> float64 values times 2**``log2_scale``, tile by tile, into
    buffers reused from tile to tile.

    Two ways, the same values (``test_widening_routes_equal_the_cast_on_every_code``): the fp16
    route (three int16 operations and two vectorised casts, the faster of the two on large tiles),
    for tiles of at least ``_ROUTE_MIN_CODES`` codes where ``_fp16_route`` allows it and the
    operand holds none of its disagreeing codes; otherwise a 256-entry table indexed by the codes
    (an order of magnitude faster than torch's element-wise FP8 -> float64 cast), scaled by the
    same power of two so that the tiles of one operand agree whichever way each took. The timings
    are in docs/performance.md ("Figures behind the code").
    """

    def __init__(self, codes: torch.Tensor, fmt: Fp8Format, rows: int, width: int) -> None:
        dev = codes.device
        n = rows * width
        route = _fp16_route(fmt, dev) if n >= _ROUTE_MIN_CODES else None
        self.route = None if route is None or _holds_any(codes, route.mismatch) else route
        self.log2_scale = 0 if self.route is None else -self.route.log2_factor
        self.width = width
        self.out = torch.empty(n, dtype=torch.float64, device=dev)
        self.table = _value_table(fmt, dev) * 2.0**self.log2_scale  # exact: a power of two, far from the limits
        self.idx = torch.empty(n, dtype=torch.int32, device=dev)
        if self.route is not None:
            self.x16 = torch.empty(n, dtype=torch.int16, device=dev)
            self.f32 = torch.empty(n, dtype=torch.float32, device=dev)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ([rows, w], any strides, within the sizes given) as float64 [rows, w]."""
        rows, w = codes.shape
        n = rows * w
        out = self.out[:n].view(rows, w)
        if self.route is None or n < _ROUTE_MIN_CODES:
            i = self.idx[:n]
            i.view(rows, w).copy_(codes.view(torch.uint8))
            return torch.index_select(self.table, 0, i, out=self.out[:n]).view(rows, w)
        bits = _fp16_bits(codes, self.route, self.x16[:n].view(rows, w))
        f32 = self.f32[:n].view(rows, w)
        f32.copy_(bits.view(torch.float16))
        return out.copy_(f32)


@functools.cache
def _nonfinite_codes(fmt: Fp8Format) -> tuple[int, ...]:
    """The codes of ``fmt`` that decode to NaN or Inf."""
    return tuple(c for c, v in fmt.codes() if not math.isfinite(v))


@functools.cache
def _nonfinite_magnitude(fmt: Fp8Format) -> int | None:
    """t such that a code is NaN or Inf exactly when its low 7 bits are >= t (E5M2: 0x7C; E4M3FN:
    0x7F), 256 if no code is, or None where no such t exists (E4M3FNUZ: 0x80 alone)."""
    bad = set(_nonfinite_codes(fmt))
    if not bad:
        return 256
    t = min(c & 0x7F for c in bad)
    return t if bad == {c for c in range(256) if c & 0x7F >= t} else None


def _holds_nonfinite(codes: torch.Tensor, fmt: Fp8Format) -> bool:
    """Whether ``codes`` (FP8) holds a NaN or an Inf code of ``fmt`` (one mask and one maximum
    where the format allows it; torch.isin otherwise)."""
    if codes.numel() == 0:
        return False
    t = _nonfinite_magnitude(fmt)
    u8 = codes.view(torch.uint8)
    if t is not None:
        return t < 256 and int(torch.bitwise_and(u8, 0x7F).max()) >= t
    bad = torch.tensor(_nonfinite_codes(fmt), dtype=torch.uint8, device=codes.device)
    return bool(torch.isin(u8, bad).any())


def _segment_sum(a8: torch.Tensor, b8: torch.Tensor, plan: ExactPlan, wa: _Widener, wb: _Widener,
                 absolute: bool, nonfinite: bool) -> tuple[torch.Tensor, int]:
    """sum_k a[:, k] b[:, k] over one K-segment as float64, and the count of inexact additions.

    Each (chunk, part-pair) accumulator only ever holds partial sums that are exact float64
    values (see ``exact_plan``), so its ``addmm_`` updates are exact in any order. The widened
    values are the codes' times 2**wa.log2_scale and 2**wb.log2_scale (powers of two: every
    product and partial sum is the exact one scaled, far from float64's limits), undone at the end.

    A split by magnitude (E5M2) puts a NaN or an Inf in no part. With ``nonfinite`` (an operand
    holds such a code) one more float64 GEMM sums the unsplit values: an output is non-finite there
    exactly when one of its terms is, and then it is what IEEE arithmetic gives in any order (NaN
    if a term is NaN or Inf x 0, or if +Inf meets -Inf; else the Inf; finite partial sums never
    overflow); that output is taken from it, every other from the exact parts.
    """
    M, L = a8.shape
    N = b8.shape[0]
    fa, fb = 2.0**wa.log2_scale, 2.0**wb.log2_scale
    split = len(plan.pairs) > 1

    def part(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        return torch.where((v.abs() >= lo) & (v.abs() < hi), v, 0.0)

    accs = []
    # Each accumulator's first addmm_ per column block has beta = 0 (so the buffers start empty,
    # not zeroed: a fill of M x N float64 saved; the sums, zeros and their signs, are the same).
    plain = torch.empty(M, N, dtype=torch.float64, device=a8.device) if split and nonfinite else None
    for c0 in range(0, L, plan.chunk):
        c1 = min(L, c0 + plan.chunk)
        pair_accs = [torch.empty(M, N, dtype=torch.float64, device=a8.device) for _ in plan.pairs]
        for p0 in range(c0, c1, wa.width):  # K panels of the activations, widened once each
            p1 = min(c1, p0 + wa.width)
            a = wa(a8[:, p0:p1])
            if absolute:
                a.abs_()
            a_parts = [part(a, pa.lo * fa, pa.hi * fa) for pa, _ in plan.pairs] if split else [a]
            for n0 in range(0, N, _BLOCK_N):
                n1 = min(N, n0 + _BLOCK_N)
                for t0 in range(p0, p1, _TILE):
                    t1 = min(p1, t0 + _TILE)
                    b = wb(b8[n0:n1, t0:t1])
                    if absolute:
                        b.abs_()
                    for acc, am, (_, pb) in zip(pair_accs, a_parts, plan.pairs, strict=True):
                        bm = part(b, pb.lo * fb, pb.hi * fb) if split else b
                        acc[:, n0:n1].addmm_(am[:, t0 - p0:t1 - p0], bm.T, beta=0.0 if t0 == c0 else 1.0)
                    if plain is not None:
                        plain[:, n0:n1].addmm_(a[:, t0 - p0:t1 - p0], b.T, beta=0.0 if t0 == 0 else 1.0)
        accs.extend(pair_accs)
    total = accs[0]
    for extra in accs[1:]:
        total += extra
    if plain is not None:
        total = torch.where(torch.isfinite(plain), total, plain)
    if wa.log2_scale or wb.log2_scale:
        total.mul_(2.0 ** -(wa.log2_scale + wb.log2_scale))
    return total, len(accs) - 1


def scale_column(q: Quantized, k: int) -> torch.Tensor:
    """The scale of every row of ``q`` at column ``k``, as a float64 vector."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    return q.scale[:, k // c].to(torch.float64).repeat_interleave(r)[:rows]


@ieee
def scaled_mm_exact(a: Quantized, b: Quantized, bias: torch.Tensor | None = None, *,
                    absolute: bool = False) -> tuple[torch.Tensor, int]:
    """The reference result in float64 before the output rounding, and the largest number of
    inexact float64 additions made while accumulating one segment (0 for E4M3 operands whose
    segments are shorter than ``exact_plan(...).chunk``, i.e. ~171k).

    With ``absolute=True`` it computes sum_g |sa sb| sum_k |a_k b_k| instead (bias ignored): the
    magnitude that every error bound in ``fp8ref.spec.bounds`` is proportional to.
    """
    check_operands(a, b, bias, torch.float64)
    M, K = a.data.shape
    N = b.data.shape[0]
    plan = exact_plan(a.scheme.format, b.scheme.format)
    width = min(_TILE, K)
    dev = a.data.device
    # The activations' K panels: all of a chunk where that is at most _A_PANEL codes, else a
    # multiple of _TILE columns (at least one): buffers of 14 bytes per code.
    panel = min(K, plan.chunk, max(_TILE, _A_PANEL // max(M, 1) // _TILE * _TILE))
    wa = _Widener(a.data, a.scheme.format, M, panel)
    wb = _Widener(b.data, b.scheme.format, min(N, _BLOCK_N), width)
    nonfinite = len(plan.pairs) > 1 and (_holds_nonfinite(a.data, a.scheme.format)
                                         or _holds_nonfinite(b.data, b.scheme.format))
    y = torch.zeros(M, N, dtype=torch.float64, device=dev)
    n_inexact = 0
    for k0, k1 in k_segments(a, b):
        s, n = _segment_sum(a.data[:, k0:k1], b.data[:, k0:k1], plan, wa, wb, absolute, nonfinite)
        n_inexact = max(n_inexact, n)
        # sa * sb is exact in float64 (two <= 24-bit significands); the multiply-add rounds once each.
        outer = torch.outer(scale_column(a, k0), scale_column(b, k0))
        y.addcmul_(s, outer.abs() if absolute else outer)
    if bias is not None and not absolute:
        y += bias.to(torch.float64)
    return y, n_inexact


@ieee
def scaled_mm(a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference scaled GEMM: ``(a . b^T) (.) scales + bias``, exact accumulation, one rounding.

    Parameters
    ----------
    a : Quantized
        Activations ``[M, K]``.
    b : Quantized
        Weights ``[N, K]`` (the ``nn.Linear`` layout).
    bias : torch.Tensor, optional
        ``[N]``, any float dtype, added exactly before the single output rounding.
    out_dtype : torch.dtype
        bf16 (default), fp16, fp32 or fp64 (fp64 returns the unrounded float64 result).

    Examples
    --------
    >>> import torch, fp8ref
    >>> p2 = fp8ref.QuantScheme(pow2_scale=True)  # power-of-two scales: these values quantize exactly
    >>> a = fp8ref.quantize(torch.tensor([[1.0, 2.0]]), p2)
    >>> b = fp8ref.quantize(torch.tensor([[3.0, 4.0], [0.5, 0.25]]), p2)
    >>> fp8ref.scaled_mm(a, b, out_dtype=torch.float32).tolist()
    [[11.0, 1.0]]
    """
    check_operands(a, b, bias, out_dtype)
    y, _ = scaled_mm_exact(a, b, bias)
    return y.to(out_dtype)
