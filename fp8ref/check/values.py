"""The tensors a conformance problem is built from: float values by family (``TensorSpec``,
``make_tensor``), FP8 codes by bit pattern (``CodeSpec``, ``make_codes``) and static scales
(``static_scale``). Imports flow down: the spec and nothing else from fp8ref; ``problems.py``
builds on this module.

Value families (``VALUE_FAMILIES``):

normal, uniform, zeros, single (one non-zero), constant_rows, zero_rows (all-zero rows; ``place``
first/last puts one at the first/last row), outliers (a few columns 100-1000x larger, as LLM
activations have), heavy (Cauchy tails), dynamic_range (2**-60 .. 2**30 within a row),
spike (normal values and, in every scale block, one value 2**6..2**9 times larger at ``place``:
the block's first element, its last, or the first element past a tile of ``t`` -- so a reduction
that skips a tail, a head or a tile edge misses the block's amax), and the grid families, built on
the quantizing scheme's grid so that the dynamic scale is exactly 2**exp: ties (every value an
FP8 rounding tie), qmax (values at +-qmax), on_grid (lossless) and underflow (one +-qmax per block,
the rest FP8 subnormals, values that round to zero -- including the negative ones that must not
become FNUZ's NaN byte 0x80 -- and ties between subnormals).

FP8 code families (``CODE_FAMILIES``): bits, small, sparse, extremes (+-qmax, the smallest
subnormal, 0), zeros, positive (random magnitudes, all positive: no cancellation, so the sum is as
large as the bound's mass and every rounding of a partial sum shows), spike (small codes and
+-qmax in one K column at ``place``, the dominant product of every dot product) and swamp
(``[L, d, d, ..., d]`` per row with d*d = L*L * 2**-bits: an accumulator with a ``bits``-bit
significand rounds every small product away, one with more bits keeps them -- see
docs/conformance.md, "Precision of declarations").

Edge families (``EDGE_FAMILIES``; drawn by the corner sweep, not by the search): ``pow2_edge``
puts in every scale block one value of magnitude qmax * 2**exp moved k = -2 .. 2 ulps of the input
dtype (k cycling from block to block), the rest below a quarter of it: amax / qmax lies within a
few ulps above or below a power of two, where a power-of-two scale computed with a float
``ceil(log2(.))`` (or ``floor(log2(.)) + 1``) lands on the wrong power.

Static schemes get their scale from the problem (``static``, ``STATIC_KINDS``): ``saturate``
(32x too small: most values clamp at qmax), ``pow2`` (the dynamic scale rounded up to a power of
two: x/s exact, so grid families land exactly on ties), ``pow2_low`` (rounded down: up to 2x
saturation, exact division), ``wide`` (non-power-of-two, distinct per block).

Why this module is long: it is the one table of what the suite feeds kernels -- every value
family, code family and static-scale kind, each built next to the description a failing example
prints -- and a family split from its siblings would be read without the invariants they share
(the grid exponent ranges, the scale blocks they anchor).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..spec.formats import Fp8Format
from ..spec.quant import Quantized, compute_scale
from ..spec.schemes import QuantScheme

__all__ = ["VALUE_FAMILIES", "EXHAUSTIVE_FAMILIES", "EDGE_FAMILIES", "MAGNITUDES", "exhaustive_shape", "GRID_FAMILIES",
           "CODE_FAMILIES", "PLACES", "STATIC_KINDS", "BIAS_MODES", "TensorSpec",
           "CodeSpec", "make_tensor", "make_codes", "anchor_blocks", "static_scale", "place_index", "swamp_ok",
           "dname"]


VALUE_FAMILIES = ("normal", "uniform", "zeros", "single", "constant_rows", "zero_rows", "outliers", "heavy",
                  "dynamic_range", "spike", "ties", "qmax", "on_grid", "underflow")
#: Exhaustive families (never drawn by the search; ``exhaustive_shape`` gives their only shape):
#: ``all_bits`` is every finite bit pattern of a 16-bit dtype, non-negative ones in increasing order
#: on the first half of the rows and their negatives on the second, so each row spans ~16 binades
#: and quantizes at a scale of its own magnitude; ``amax_rows`` has one row per positive finite value
#: v of the dtype, ``[v, -3v/4, 9v/128, v/2**9, v/2**12, -v/3, v/2**20, 0]``: every value is a row's amax.
EXHAUSTIVE_FAMILIES = ("all_bits", "amax_rows")
#: Families the corner sweep draws and the search does not (they need the quantizing scheme).
EDGE_FAMILIES = ("pow2_edge",)
#: Families whose values are built on the scheme's grid: the dynamic scale is exactly 2**exp.
GRID_FAMILIES = ("ties", "qmax", "on_grid", "underflow")
CODE_FAMILIES = ("bits", "small", "sparse", "extremes", "zeros", "positive", "spike", "swamp")
#: Where ``spike``/``zero_rows`` put their value: "" (random), the block's first or last element,
#: or ``edge<t>``: the first element past a tile of t (the last one if the block is shorter).
PLACES = ("", "first", "last")
STATIC_KINDS = ("saturate", "pow2", "pow2_low", "wide")
#: ``random``: randn bias; ``cancel``: bias = -(row 0 of the product), so y[0] is close to 0 while
#: every product is large -- a second rounding of the product is then many ulps of y.
BIAS_MODES = ("random", "cancel")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def dname(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt))


def place_index(place: str, n: int) -> int | None:
    """Index in ``[0, n)`` that ``place`` names (None: random placement).

    Examples
    --------
    >>> from fp8ref.check.values import place_index
    >>> place_index("last", 17), place_index("edge16", 17), place_index("edge16", 9), place_index("first", 5)
    (16, 16, 8, 0)
    """
    if not place:
        return None
    if place == "first":
        return 0
    if place == "last":
        return n - 1
    if place.startswith("edge"):
        t = int(place[4:])
        return t if t < n else n - 1
    raise ValueError(f"unknown place {place!r}; expected '', first, last or edge<t>")


# --------------------------------------------------------------------------------------------
# float tensors


@dataclass(frozen=True)
class TensorSpec:
    """A float tensor: value family, magnitude 2**exp, seed and placement (``make_tensor``)."""

    family: str = "normal"
    exp: int = 0
    seed: int = 0
    place: str = ""

    def __repr__(self) -> str:
        at = f"@{self.place}" if self.place else ""
        return f"{self.family}{at}(2**{self.exp}, seed={self.seed})"


#: Powers of two across the whole exponent range of each input dtype: below the smallest subnormal
#: (2**-149 fp32, 2**-133 bf16, 2**-24 fp16), through the subnormals and the normal range, to near
#: the largest power of two whose normal draws stay finite. amax / qmax underflows in fp32 below
#: 2**-141, in bf16 below 2**-124, in fp16 below 2**-15. The magnitude sweep runs each; the search
#: draws them a quarter of the time.
MAGNITUDES: dict[torch.dtype, tuple[int, ...]] = {
    torch.float32: (-149, -146, -143, -140, -134, -127, -120, -64, 0, 64, 120),
    torch.bfloat16: (-133, -130, -127, -124, -120, -64, 0, 64, 120),
    torch.float16: (-24, -22, -18, -15, -12, -6, 0, 8, 13),
}


def _exp_range(dtype: torch.dtype) -> tuple[int, int]:
    """Powers of two that keep every family finite and mostly normal in ``dtype``."""
    if dtype == torch.float16:
        return -12, 4
    return -130, 40  # down to fp32/bf16 subnormals: tiny scales and their reciprocals


def _grid_exp_range(dtype: torch.dtype, fmt: Fp8Format, extra_low: int = 0) -> tuple[int, int]:
    """2**e such that qmax*2**e, the grid's midpoints*2**e (and ``extra_low`` more bits below the
    smallest subnormal) and the scale 2**e are exact in ``dtype`` and normal in every scale dtype."""
    hi = 15 - math.ceil(math.log2(fmt.max)) if dtype == torch.float16 else 15
    lo = -14 if dtype != torch.float16 else max(-14, -24 - fmt.min_exponent + fmt.mantissa_bits + 1 + extra_low)
    return lo, max(lo, min(hi, 8))


def _grid_values(fmt: Fp8Format, qmax: float) -> torch.Tensor:
    v = _finite_values(fmt.name)
    return v[(v > 0) & (v <= qmax)]


@functools.cache
def _finite_values(name: str) -> torch.Tensor:
    from ..spec.formats import get_format

    return get_format(name).finite_values()


def anchor_blocks(x: torch.Tensor, scheme: QuantScheme, anchor: float) -> torch.Tensor:
    """Set the first column of every scale block of ``x`` to +-anchor, so every block's amax is
    ``anchor`` (then the dynamic scale is anchor/qmax exactly when that is a power of two)."""
    rows, cols = x.shape
    _, c = scheme.block_shape(rows, cols)
    x = x.clone()
    sign = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).to(torch.float64)
    for j in range(0, cols, c):
        x[:, j] = sign * anchor
    return x


def _blocks(rows: int, cols: int, scheme: QuantScheme | None):
    """(row range, col range, block index) of every scale block of a ``[rows, cols]`` tensor."""
    r, c = (rows, cols) if scheme is None else scheme.block_shape(rows, cols)
    i = 0
    for r0 in range(0, rows, r):
        for c0 in range(0, cols, c):
            yield (r0, min(rows, r0 + r)), (c0, min(cols, c0 + c)), i
            i += 1


def _spike(x: torch.Tensor, scheme: QuantScheme | None, place: str, g: torch.Generator) -> torch.Tensor:
    """One value per scale block, 2**6..2**9 times the block's normal values, at ``place``; the
    magnitude changes from block to block so that every block has its own amax (and scale)."""
    rows, cols = x.shape
    x = x.clamp(-8.0, 8.0)
    for (r0, r1), (c0, c1), i in _blocks(rows, cols, scheme):
        pr = place_index(place, r1 - r0)
        pc = place_index(place, c1 - c0)
        if pr is None:
            pr = int(torch.randint(r1 - r0, (1,), generator=g))
            pc = int(torch.randint(c1 - c0, (1,), generator=g))
        sign = 1.0 if (i + int(torch.randint(2, (1,), generator=g))) % 2 else -1.0
        x[r0 + pr, c0 + pc] = sign * 2.0 ** (6 + i % 4)
    return x


def _underflow_points(fmt: Fp8Format) -> torch.Tensor:
    """Values, in units of the scale, around and below the format's subnormals: quarters of the
    smallest subnormal (0, 1/4, 1/2 = a tie to 0, 3/4), subnormals and the ties between them, the
    smallest normals."""
    sub = fmt.smallest_subnormal
    k = torch.arange(0, 2**fmt.mantissa_bits + 2, dtype=torch.float64)
    return torch.cat([torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64), k, k[1:] + 0.5]) * sub


#: The ulp steps of ``pow2_edge``'s anchor, block by block.
_EDGE_STEPS = (1, -1, 0, 2, -2)


def _pow2_edge(rows: int, cols: int, dtype: torch.dtype, scheme: QuantScheme, exp: int,
               g: torch.Generator) -> torch.Tensor:
    """``pow2_edge``: in every block one value qmax * 2**e moved k ulps of ``dtype`` (k from
    ``_EDGE_STEPS``), at a random place with alternating sign; the other values below a quarter of
    it. 2**e is clamped so that qmax * 2**e is exact and normal in ``dtype`` and, two ulps up, below
    the quarter of the dtype's max that ``make_tensor`` clamps to."""
    lo, hi = _grid_exp_range(dtype, scheme.format)
    hi = min(hi, math.floor(math.log2(torch.finfo(dtype).max / 4 / scheme.qmax)) - 1)
    top = scheme.qmax * 2.0 ** max(min(exp, hi), lo)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64).clamp(-1.0, 1.0) * (top / 4)
    anchor = torch.tensor(top, dtype=dtype)
    for (r0, r1), (c0, c1), i in _blocks(rows, cols, scheme):
        k = _EDGE_STEPS[i % len(_EDGE_STEPS)]
        v = anchor
        for _ in range(abs(k)):
            v = torch.nextafter(v, torch.tensor(float("inf") if k > 0 else 0.0, dtype=dtype))
        pr = int(torch.randint(r1 - r0, (1,), generator=g))
        pc = int(torch.randint(c1 - c0, (1,), generator=g))
        x[r0 + pr, c0 + pc] = float(v) * (1.0 if i % 2 == 0 else -1.0)
    return x


def _finite_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of a 16-bit float dtype, in increasing bit (and value) order."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"exhaustive families take a 16-bit dtype (bfloat16, float16), got {dtype}")
    top = 0x7F7F if dtype == torch.bfloat16 else 0x7BFF  # the largest finite pattern
    return torch.arange(top + 1, dtype=torch.int32).to(torch.int16).view(dtype)


def exhaustive_shape(family: str, dtype: torch.dtype) -> tuple[int, int]:
    """The ``[rows, cols]`` of an exhaustive family in ``dtype`` (32 x 2040 for every bf16 pattern,
    32 x 1984 for fp16; 32639 x 8 and 31743 x 8 for ``amax_rows``)."""
    n = len(_finite_patterns(dtype))
    if family == "all_bits":
        return 32, 2 * n // 32
    if family == "amax_rows":
        return n - 1, 8
    raise ValueError(f"unknown exhaustive family {family!r}; expected one of {EXHAUSTIVE_FAMILIES}")


def _exhaustive(family: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    if (rows, cols) != exhaustive_shape(family, dtype):
        raise ValueError(f"family {family!r} in {dtype} has shape {exhaustive_shape(family, dtype)}, "
                         f"asked for {(rows, cols)}")
    v = _finite_patterns(dtype)
    if family == "all_bits":
        return torch.cat([v, -v]).reshape(rows, cols)
    v = v[1:].to(torch.float64).reshape(-1, 1)
    factors = torch.tensor([1, -0.75, 9 / 128, 2.0**-9, 2.0**-12, -1 / 3, 2.0**-20, 0], dtype=torch.float64)
    return (v * factors).to(dtype)


def make_tensor(spec: TensorSpec, rows: int, cols: int, dtype: torch.dtype,
                scheme: QuantScheme | None = None) -> torch.Tensor:
    """Build the ``[rows, cols]`` tensor of ``dtype`` that ``spec`` describes.

    Grid families (ties, qmax, on_grid, underflow) need the scheme that will quantize the
    tensor: their values are FP8 grid points (or midpoints, or subnormal-range values) of
    ``scheme.format`` times 2**exp, with +-qmax*2**exp in every scale block, so the dynamic scale
    is exactly 2**exp. ``spike`` places one large value per block of ``scheme`` (the whole tensor
    without a scheme).

    Examples
    --------
    >>> import torch
    >>> from fp8ref.check.values import TensorSpec, make_tensor
    >>> make_tensor(TensorSpec("zeros"), 2, 3, torch.float32).abs().sum().item()
    0.0
    >>> from fp8ref import QuantScheme
    >>> x = make_tensor(TensorSpec("spike", 0, 1, "last"), 2, 17, torch.float32, QuantScheme())
    >>> int(x[0].abs().argmax()), int(x[1].abs().argmax())  # per-row scales: each row's last element
    (16, 16)
    """
    if spec.family in EXHAUSTIVE_FAMILIES:
        return _exhaustive(spec.family, rows, cols, dtype)
    g = torch.Generator().manual_seed(spec.seed)
    f64 = torch.float64
    fam = spec.family
    scale = 2.0**spec.exp
    if fam == "normal":
        x = torch.randn(rows, cols, generator=g, dtype=f64)
    elif fam == "uniform":
        x = torch.rand(rows, cols, generator=g, dtype=f64) * 2 - 1
    elif fam == "zeros":
        x = torch.zeros(rows, cols, dtype=f64)
    elif fam == "single":
        x = torch.zeros(rows, cols, dtype=f64)
        i = int(torch.randint(rows * cols, (1,), generator=g))
        x.view(-1)[i] = float(torch.randn(1, generator=g, dtype=f64)) or 1.0
    elif fam == "constant_rows":
        x = torch.randn(rows, 1, generator=g, dtype=f64).expand(rows, cols).clone()
    elif fam == "zero_rows":
        x = torch.randn(rows, cols, generator=g, dtype=f64)
        keep = torch.rand(rows, generator=g) < 0.5
        keep[place_index(spec.place, rows) or 0] = False  # at least one all-zero row, at ``place``
        x[~keep] = 0.0
    elif fam == "outliers":
        x = torch.randn(rows, cols, generator=g, dtype=f64)
        n_out = min(cols, 1 + int(torch.randint(4, (1,), generator=g)))
        idx = torch.randperm(cols, generator=g)[:n_out]
        x[:, idx] *= 100 + 900 * torch.rand(n_out, generator=g, dtype=f64)
    elif fam == "heavy":
        x = torch.empty(rows, cols, dtype=f64).cauchy_(generator=g).clamp_(-1e4, 1e4)
    elif fam == "dynamic_range":
        lo = -20 if dtype == torch.float16 else -60
        hi = 12 if dtype == torch.float16 else 30
        e = torch.randint(lo, hi + 1, (rows, cols), generator=g).to(f64)
        sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0).to(f64)
        x = sign * torch.exp2(e)
        scale = 1.0
    elif fam == "spike":
        x = _spike(torch.randn(rows, cols, generator=g, dtype=f64), scheme, spec.place, g)
        if dtype == torch.float16:
            scale = 2.0 ** min(spec.exp, 4)  # 2**9 * 2**exp stays far below fp16's max
    elif fam == "pow2_edge":
        if scheme is None:
            raise ValueError("family 'pow2_edge' needs the scheme that will quantize the tensor")
        x, scale = _pow2_edge(rows, cols, dtype, scheme, spec.exp, g), 1.0
    elif fam in GRID_FAMILIES:
        if scheme is None:
            raise ValueError(f"family {fam!r} needs the scheme that will quantize the tensor")
        fmt, qmax = scheme.format, scheme.qmax
        lo, hi = _grid_exp_range(dtype, fmt, extra_low=2 if fam == "underflow" else 0)
        scale = 2.0 ** min(max(spec.exp, lo), hi)
        grid = _grid_values(fmt, qmax)
        if fam == "ties":
            # Midpoints of consecutive grid values (and between 0 and the smallest subnormal):
            # x / s lands exactly on a tie; RNE must pick the even neighbour.
            pts = torch.cat([grid[:1] / 2, (grid[1:] + grid[:-1]) / 2])
        elif fam == "qmax":
            pts = grid[-1:].expand(8)
        elif fam == "underflow":
            pts = _underflow_points(fmt)
        else:
            pts = torch.cat([grid, torch.zeros(1, dtype=f64)])
        idx = torch.randint(len(pts), (rows, cols), generator=g)
        sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0).to(f64)
        x = anchor_blocks(sign * pts[idx], scheme, qmax)
    else:
        raise ValueError(f"unknown value family {fam!r}; expected one of {VALUE_FAMILIES + EDGE_FAMILIES}")
    x = x * scale
    big = torch.finfo(dtype).max / 4
    return x.clamp(-big, big).to(dtype)


# --------------------------------------------------------------------------------------------
# FP8 codes


@dataclass(frozen=True)
class CodeSpec:
    """FP8 codes drawn by bit pattern (family, seed) and their scales 2**exp * (1 + mantissa).

    ``place`` is the spike's K column; ``bits`` the swamp's drop: its small codes are its big one
    times 2**-bits (a GEMM of two swamps has products L*L and L*L*2**-(bits_a + bits_b)), or
    1.75 times that with ``place="7/8"`` (then a product is 7/8 of the ulp a truncating
    accumulator with that many bits keeps, and it loses all of it);
    ``distinct_scales`` gives every scale block its own value (so a transposed or misindexed scale
    read shows).
    """

    family: str = "bits"
    seed: int = 0
    scale_exp: int = -9
    pow2_scales: bool = True
    place: str = ""
    bits: int = 0
    distinct_scales: bool = False

    def __repr__(self) -> str:
        s = "distinct" if self.distinct_scales else ("pow2" if self.pow2_scales else "random")
        if self.family == "swamp":
            arg = f"[2**-{self.bits}" + (" * 1.75]" if self.place == "7/8" else "]")
        else:
            arg = f"@{self.place}" if self.place else ""
        return f"codes:{self.family}{arg}(seed={self.seed}, scales 2**{self.scale_exp} {s})"


def _top_pow2(qmax: float) -> float:
    return 2.0 ** math.floor(math.log2(qmax))


def swamp_ok(scheme: QuantScheme, bits: int) -> bool:
    """Whether the swamp codes of ``bits`` (largest power of two <= qmax, and it times 2**-bits,
    or 1.75 times that) are normal values of the scheme's format."""
    return _top_pow2(scheme.qmax) * 2.0**-bits >= scheme.format.smallest_normal


def make_codes(spec: CodeSpec, rows: int, cols: int, scheme: QuantScheme) -> Quantized:
    """A Quantized tensor whose codes are drawn by bit pattern (never NaN, |v| <= qmax) and whose
    scales are positive, finite values of ``scheme.scale_dtype``.

    Examples
    --------
    >>> from fp8ref.check.values import CodeSpec, make_codes
    >>> from fp8ref import QuantScheme
    >>> q = make_codes(CodeSpec("swamp", bits=12), 2, 5, QuantScheme())
    >>> q.data.float().tolist()  # with itself: 256 * 256 = 2**16 and 2**-4 * 2**-4 = 2**-8 = 2**16 * 2**-24
    [[256.0, 0.0625, 0.0625, 0.0625, 0.0625], [-256.0, -0.0625, -0.0625, -0.0625, -0.0625]]
    """
    fmt, qmax = scheme.format, scheme.qmax
    g = torch.Generator().manual_seed(spec.seed)
    vals = fmt.code_values()
    bits = torch.randint(0, 256, (rows, cols), generator=g)
    fam = spec.family
    if fam == "small":  # low exponents only: sums with little magnitude spread
        bits = bits & 0xBF
    elif fam == "sparse":
        bits = torch.where(torch.rand(rows, cols, generator=g) < 0.8, 0, bits)
    elif fam == "extremes":
        pick = torch.randint(0, 4, (rows, cols), generator=g)
        v = torch.stack([torch.full((rows, cols), qmax), torch.full((rows, cols), -qmax),
                         torch.full((rows, cols), fmt.smallest_subnormal), torch.zeros(rows, cols)], 0)
        data = torch.gather(v, 0, pick.unsqueeze(0))[0].to(torch.float32).to(fmt.torch_dtype)
        return Quantized(data, _make_scales(spec, rows, cols, scheme, g), scheme)
    elif fam == "zeros":
        bits = torch.zeros_like(bits)
    elif fam == "positive":
        bits = bits & 0x7F
    elif fam == "swamp":
        big = _top_pow2(qmax)
        small = big * 2.0**-spec.bits * (1.75 if spec.place == "7/8" else 1.0)
        sign = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).reshape(-1, 1)
        v = torch.full((rows, cols), small, dtype=torch.float64)
        v[:, 0] = big
        data = (v * sign).to(torch.float32).to(fmt.torch_dtype)
        if not torch.equal(data.to(torch.float64).abs(), v):
            raise ValueError(f"swamp codes {big:g}, {small:g} are not {fmt.name} values (bits={spec.bits})")
        return Quantized(data, _make_scales(spec, rows, cols, scheme, g), scheme)
    elif fam == "spike":
        bits = bits & 0xBF
    elif fam != "bits":
        raise ValueError(f"unknown code family {fam!r}; expected one of {CODE_FAMILIES}")
    v = vals[bits]
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # NaN codes are never a quantizer's output
    v = torch.clamp(v, -qmax, qmax)
    if fam == "spike":
        k = place_index(spec.place, cols)
        k = int(torch.randint(cols, (1,), generator=g)) if k is None else k
        v[:, k] = torch.where(torch.arange(rows) % 2 == 0, qmax, -qmax).to(v.dtype)
    data = v.to(torch.float32).to(fmt.torch_dtype)
    return Quantized(data, _make_scales(spec, rows, cols, scheme, g), scheme)


def _make_scales(spec: CodeSpec, rows: int, cols: int, scheme: QuantScheme, g: torch.Generator) -> torch.Tensor:
    shape = scheme.scale_shape(rows, cols)
    if spec.distinct_scales:
        i = torch.arange(shape[0]).reshape(-1, 1)
        j = torch.arange(shape[1]).reshape(1, -1)
        e = spec.scale_exp + ((3 * i + 5 * j) % 7 - 3).to(torch.float64)
        s = torch.exp2(e)
        if not scheme.pow2_scale:  # a pow2 scheme's scales are powers of two (E8M0 holds nothing else)
            s = s * (1 + ((i + 2 * j) % 4).to(torch.float64) / 8)
    else:
        e = spec.scale_exp + torch.randint(-2, 3, shape, generator=g).to(torch.float64)
        s = torch.exp2(e)
        if not spec.pow2_scales and not scheme.pow2_scale:
            s = s * (1 + torch.rand(shape, generator=g, dtype=torch.float64))
    info = torch.finfo(scheme.scale_dtype)
    return s.clamp(float(info.tiny), float(info.max) / 2).to(scheme.scale_dtype)


# --------------------------------------------------------------------------------------------
# static scales


def static_scale(x: torch.Tensor, scheme: QuantScheme, kind: str) -> torch.Tensor:
    """The caller's dequantization scale of a static scheme, derived from ``x`` by ``kind``.

    From the dynamic scale s of the same scheme: ``saturate`` s/32 (most values clamp at qmax),
    ``pow2`` 2**ceil(log2 s), ``pow2_low`` 2**floor(log2 s) (up to 2x saturation), ``wide``
    s * (1 + j/8) with j different from block to block. Rounded to ``scheme.scale_dtype`` (the
    value passed is exactly representable there), never below its smallest normal.

    Examples
    --------
    >>> import torch
    >>> from fp8ref import QuantScheme
    >>> from fp8ref.check.values import static_scale
    >>> x = torch.tensor([[448.0, 1.0], [-896.0, 2.0]])
    >>> static_scale(x, QuantScheme(dynamic=False), "pow2").flatten().tolist()
    [1.0, 2.0]
    """
    # The dynamic scale with fp32 storage (a narrow scale dtype may not hold it), then clamped below.
    s = compute_scale(x, scheme.with_(dynamic=True, scale_dtype=torch.float32)).to(torch.float64)
    if kind == "saturate":
        s = s / 32
    elif kind in ("pow2", "pow2_low"):
        m, e = torch.frexp(s)
        up = torch.where(m == 0.5, e - 1, e)
        s = torch.exp2((up if kind == "pow2" else up - (m != 0.5).to(up.dtype)).to(torch.float64))
    elif kind == "wide":
        i = torch.arange(s.shape[0]).reshape(-1, 1)
        j = torch.arange(s.shape[1]).reshape(1, -1)
        s = s * (1 + ((3 * i + 5 * j) % 8).to(torch.float64) / 8)
    else:
        raise ValueError(f"unknown static scale kind {kind!r}; expected one of {STATIC_KINDS}")
    info = torch.finfo(scheme.scale_dtype)
    return s.clamp(float(info.tiny), float(info.max) / 4).to(scheme.scale_dtype)
