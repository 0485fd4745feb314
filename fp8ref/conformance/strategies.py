"""Hypothesis strategies for FP8 conformance: shapes, dtypes, value families, schemes, fp8 codes.

Every strategy here draws a small, shrinkable *description* (sizes, a family name, a power of
two, a seed) and builds the tensors from it deterministically, so a failing example shrinks to a
readable one (``M=1, N=1, K=17, family='zero_rows', seed=0``) instead of to a wall of floats.

Third parties reuse these directly::

    from hypothesis import given
    from fp8ref.conformance import strategies as fst

    @given(fst.linear_problems(profile="ci"))
    def test_my_kernel(p):
        x, w, bias = p.build()
        ...

Value families (``VALUE_FAMILIES``): normal, uniform, zeros, single (one non-zero),
constant_rows, zero_rows, outliers (a few columns 100-1000x larger, as LLM activations have),
heavy (Cauchy tails), dynamic_range (2**-60 .. 2**30 within a row), ties (every value lands on
an FP8 rounding tie after scaling), qmax (values at +-qmax after scaling) and on_grid (values
already on the FP8 grid: quantization is lossless). FP8 codes are drawn by bit pattern
(``CODE_FAMILIES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from ..registry import Case
from ..spec.formats import FORMATS, Fp8Format
from ..spec.quant import Quantized
from ..spec.schemes import RECIPES, Granularity, QuantScheme, Recipe
from .profiles import Profile, get_profile

__all__ = [
    "QuantScheme",
    "RECIPES",
    "SPECIAL_SIZES",
    "VALUE_FAMILIES",
    "CODE_FAMILIES",
    "INPUT_DTYPES",
    "OUT_DTYPES",
    "TensorSpec",
    "CodeSpec",
    "QuantizeProblem",
    "GemmProblem",
    "LinearProblem",
    "sizes",
    "schemes",
    "recipes",
    "fp8_codes",
    "make_tensor",
    "make_codes",
    "anchor_blocks",
    "quantize_problems",
    "gemm_problems",
    "linear_problems",
]

#: Awkward sizes every kernel must survive: 1, odd, one below/above a tile, 4097 (thorough only).
SPECIAL_SIZES = (1, 3, 15, 16, 17, 32, 33, 64, 127, 128, 129, 144, 256, 272, 4097)
VALUE_FAMILIES = ("normal", "uniform", "zeros", "single", "constant_rows", "zero_rows", "outliers", "heavy",
                  "dynamic_range", "ties", "qmax", "on_grid")
#: Families whose values are built on the scheme's grid: the scale is exactly 2**exp.
GRID_FAMILIES = ("ties", "qmax", "on_grid")
CODE_FAMILIES = ("bits", "small", "sparse", "extremes", "zeros")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _dname(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt))


# --------------------------------------------------------------------------------------------
# sizes, dtypes, schemes


def sizes(cap: int, aligned_only: bool = False) -> st.SearchStrategy[int]:
    """A dimension in [1, cap]: special sizes, multiples of 16 and 128, or any integer.

    Shrinks towards 1.
    """
    special = [s for s in SPECIAL_SIZES if s <= cap]
    mult16 = [s for s in range(16, cap + 1, 16)]
    if aligned_only:
        return st.sampled_from(mult16 or [16])
    # Uniform draws stop at 300 so that a large cap (thorough: 4097) keeps big sizes rare.
    return st.one_of(st.sampled_from(special), st.sampled_from(mult16 or [1]), st.integers(1, min(cap, 300)))


def _grid_values(fmt: Fp8Format, qmax: float) -> torch.Tensor:
    v = fmt.finite_values()
    return v[(v > 0) & (v <= qmax)]


def _random_scheme(draw, fmt: Fp8Format | None = None, tiny_blocks: bool = False) -> QuantScheme:
    fmt = draw(st.sampled_from(list(FORMATS.values()))) if fmt is None else fmt
    gran = draw(st.sampled_from(list(Granularity)))
    kw: dict = {}
    if gran is Granularity.GROUP:
        kw["group_size"] = draw(st.sampled_from([128, 3, 16, 32, 64] + ([1, 2] if tiny_blocks else [])))
    elif gran is Granularity.BLOCK:
        blocks = [(128, 128), (16, 16), (3, 5), (128, 1), (1, 128), (32, 64)]
        kw["block"] = draw(st.sampled_from(blocks + ([(1, 1), (2, 1)] if tiny_blocks else [])))
    grid = _grid_values(fmt, fmt.max)
    qmax = draw(st.sampled_from([fmt.max, float(grid[-2]), float(grid[len(grid) * 3 // 4])]))
    return QuantScheme(format=fmt, granularity=gran, amax_floor=draw(st.sampled_from([1e-12, 0.0, 1e-4])),
                       qmax=qmax, scale_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                       pow2_scale=draw(st.booleans()), **kw)


@st.composite
def schemes(draw, tiny_blocks: bool = False) -> QuantScheme:
    """A dynamic QuantScheme: one of the presets' schemes or a random valid one."""
    presets = sorted({s for r in RECIPES.values() for s in (r.weight, r.activation)}, key=QuantScheme.short_str)
    if draw(st.booleans()):
        return draw(st.sampled_from(presets))
    return _random_scheme(draw, tiny_blocks=tiny_blocks)


@st.composite
def recipes(draw, tiny_blocks: bool = False) -> Recipe:
    """A preset recipe (more often) or a random one (weight and activation schemes drawn apart)."""
    if draw(st.integers(0, 2)) < 2:
        return draw(st.sampled_from(list(RECIPES.values())))
    w = _random_scheme(draw, tiny_blocks=tiny_blocks)
    a = _random_scheme(draw, w.format if draw(st.booleans()) else None, tiny_blocks)
    return Recipe("random", w, a)


# --------------------------------------------------------------------------------------------
# tensors from a description


@dataclass(frozen=True)
class TensorSpec:
    """A float tensor described by family, magnitude 2**exp and seed (built by ``make_tensor``)."""

    family: str = "normal"
    exp: int = 0
    seed: int = 0

    def __repr__(self) -> str:
        return f"{self.family}(2**{self.exp}, seed={self.seed})"


def _exp_range(dtype: torch.dtype) -> tuple[int, int]:
    """Powers of two that keep every family finite and mostly normal in ``dtype``."""
    if dtype == torch.float16:
        return -12, 4
    return -130, 40  # down to fp32/bf16 subnormals: tiny scales and their reciprocals


def _grid_exp_range(dtype: torch.dtype, fmt: Fp8Format) -> tuple[int, int]:
    """2**e such that qmax*2**e, the grid's midpoints*2**e and the scale 2**e are exact in ``dtype``
    and a normal number of every scale dtype (fp16 scales: 2**-14 .. 2**15)."""
    hi = 15 - math.ceil(math.log2(fmt.max)) if dtype == torch.float16 else 15
    lo = -14 if dtype != torch.float16 else max(-14, -24 - fmt.min_exponent + fmt.mantissa_bits + 1)
    return lo, max(lo, min(hi, 8))


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


def make_tensor(spec: TensorSpec, rows: int, cols: int, dtype: torch.dtype,
                scheme: QuantScheme | None = None) -> torch.Tensor:
    """Build the ``[rows, cols]`` tensor of ``dtype`` that ``spec`` describes.

    Grid families (ties, qmax, on_grid) need the scheme that will quantize the tensor: their
    values are FP8 grid points (or midpoints) of ``scheme.format`` times 2**exp, with +-qmax*2**exp
    in every scale block, so the dynamic scale is exactly 2**exp.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.conformance.strategies import TensorSpec, make_tensor
    >>> make_tensor(TensorSpec("zeros"), 2, 3, torch.float32).abs().sum().item()
    0.0
    """
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
        keep[0] = False  # at least one all-zero row
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
    elif fam in GRID_FAMILIES:
        if scheme is None:
            raise ValueError(f"family {fam!r} needs the scheme that will quantize the tensor")
        fmt, qmax = scheme.format, scheme.qmax
        lo, hi = _grid_exp_range(dtype, fmt)
        scale = 2.0 ** min(max(spec.exp, lo), hi)
        grid = _grid_values(fmt, qmax)
        if fam == "ties":
            # Midpoints of consecutive grid values (and between 0 and the smallest subnormal):
            # x / s lands exactly on a tie; RNE must pick the even neighbour.
            pts = torch.cat([grid[:1] / 2, (grid[1:] + grid[:-1]) / 2])
        elif fam == "qmax":
            pts = grid[-1:].expand(8)
        else:
            pts = torch.cat([grid, torch.zeros(1, dtype=f64)])
        idx = torch.randint(len(pts), (rows, cols), generator=g)
        sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0).to(f64)
        x = anchor_blocks(sign * pts[idx], scheme, qmax)
    else:
        raise ValueError(f"unknown value family {fam!r}; expected one of {VALUE_FAMILIES}")
    x = x * scale
    big = torch.finfo(dtype).max / 4
    return x.clamp(-big, big).to(dtype)


@dataclass(frozen=True)
class CodeSpec:
    """FP8 codes drawn by bit pattern (family, seed), and their scales 2**exp * (1 + mantissa)."""

    family: str = "bits"
    seed: int = 0
    scale_exp: int = -9
    pow2_scales: bool = True

    def __repr__(self) -> str:
        s = "pow2" if self.pow2_scales else "random"
        return f"codes:{self.family}(seed={self.seed}, scales 2**{self.scale_exp} {s})"


def make_codes(spec: CodeSpec, rows: int, cols: int, scheme: QuantScheme) -> Quantized:
    """A Quantized tensor whose codes are drawn by bit pattern (never NaN, |v| <= qmax) and whose
    scales are positive, finite values of ``scheme.scale_dtype``."""
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
    elif fam != "bits":
        raise ValueError(f"unknown code family {fam!r}; expected one of {CODE_FAMILIES}")
    v = vals[bits]
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # NaN codes are never a quantizer's output
    v = torch.clamp(v, -qmax, qmax)
    data = v.to(torch.float32).to(fmt.torch_dtype)
    return Quantized(data, _make_scales(spec, rows, cols, scheme, g), scheme)


def _make_scales(spec: CodeSpec, rows: int, cols: int, scheme: QuantScheme, g: torch.Generator) -> torch.Tensor:
    shape = scheme.scale_shape(rows, cols)
    e = spec.scale_exp + torch.randint(-2, 3, shape, generator=g).to(torch.float64)
    s = torch.exp2(e)
    if not spec.pow2_scales:
        s = s * (1 + torch.rand(shape, generator=g, dtype=torch.float64))
    info = torch.finfo(scheme.scale_dtype)
    return s.clamp(float(info.tiny), float(info.max) / 2).to(scheme.scale_dtype)


@st.composite
def fp8_codes(draw, fmt: Fp8Format | str = "e4m3fn", max_elems: int = 64) -> torch.Tensor:
    """A 1-D tensor of FP8 values drawn element by element by bit pattern (NaN codes excluded);
    shrinks towards code 0."""
    from ..spec.formats import get_format

    fmt = get_format(fmt)
    bits = draw(st.lists(st.integers(0, 255).filter(lambda b: b not in fmt.nan_codes), min_size=1,
                         max_size=max_elems))
    return torch.tensor(bits, dtype=torch.uint8).view(fmt.torch_dtype)


# --------------------------------------------------------------------------------------------
# problems


def _short(scheme: QuantScheme) -> str:
    return scheme.short_str()


@dataclass(frozen=True)
class QuantizeProblem:
    """Quantize ``x [rows, cols]`` of ``x_dtype`` under ``scheme``."""

    rows: int
    cols: int
    x_dtype: torch.dtype
    scheme: QuantScheme
    x: TensorSpec
    k: int = 0  #: a power of two for the equivariance contract

    def build(self) -> torch.Tensor:
        return make_tensor(self.x, self.rows, self.cols, self.x_dtype, self.scheme)

    def case(self) -> Case:
        recipe = Recipe("quantize", self.scheme, self.scheme)
        return Case(self.rows, self.rows, self.cols, recipe, self.x_dtype, op="quantize")

    def __repr__(self) -> str:
        return (f"quantize x[{self.rows}, {self.cols}] {_dname(self.x_dtype)} = {self.x!r} "
                f"under {_short(self.scheme)}" + (f", k={self.k}" if self.k else ""))


@dataclass(frozen=True)
class GemmProblem:
    """``scaled_mm(a [M, K], b [N, K], bias)`` on operands drawn by bit pattern."""

    M: int
    N: int
    K: int
    recipe: Recipe
    out_dtype: torch.dtype
    a: CodeSpec
    b: CodeSpec
    has_bias: bool = False
    bias_seed: int = 0
    k: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def build(self) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        a = make_codes(self.a, self.M, self.K, self.recipe.activation)
        b = make_codes(self.b, self.N, self.K, self.recipe.weight)
        bias = None
        if self.has_bias:
            g = torch.Generator().manual_seed(self.bias_seed)
            bias = torch.randn(self.N, generator=g).to(self.out_dtype)
        return a, b, bias

    def case(self) -> Case:
        return Case(self.M, self.N, self.K, self.recipe, torch.bfloat16, self.out_dtype, has_bias=self.has_bias,
                    op="scaled_mm")

    def __repr__(self) -> str:
        return (f"scaled_mm M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} "
                f"out={_dname(self.out_dtype)} a={self.a!r} b={self.b!r}"
                + (f" bias(seed={self.bias_seed})" if self.has_bias else "") + (f", k={self.k}" if self.k else ""))


@dataclass(frozen=True)
class LinearProblem:
    """``linear(x [M, K], w [N, K], bias)`` end to end under ``recipe``."""

    M: int
    N: int
    K: int
    recipe: Recipe
    x_dtype: torch.dtype
    out_dtype: torch.dtype
    x: TensorSpec
    w: TensorSpec
    has_bias: bool = False

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = make_tensor(self.x, self.M, self.K, self.x_dtype, self.recipe.activation)
        w = make_tensor(self.w, self.N, self.K, self.x_dtype, self.recipe.weight)
        bias = None
        if self.has_bias:
            g = torch.Generator().manual_seed(self.w.seed + 1)
            bias = torch.randn(self.N, generator=g).to(self.x_dtype)
        return x, w, bias

    def case(self) -> Case:
        return Case(self.M, self.N, self.K, self.recipe, self.x_dtype, self.out_dtype, has_bias=self.has_bias)

    def __repr__(self) -> str:
        return (f"linear M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} x:{_dname(self.x_dtype)} "
                f"out={_dname(self.out_dtype)} x={self.x!r} w={self.w!r}" + (" +bias" if self.has_bias else ""))


def _tensor_specs(dtype: torch.dtype, families=VALUE_FAMILIES):
    lo, hi = _exp_range(dtype)
    return st.builds(TensorSpec, st.sampled_from(families),
                     st.one_of(st.just(0), st.integers(-12, 8), st.integers(lo, hi)),
                     st.integers(0, 2**16))


def _seeds():
    return st.integers(0, 2**16)


def _k_cap(p: Profile, *rows: int) -> int:
    """Largest K that keeps every [rows, K] operand within the profile's element budget."""
    return max(1, min(p.max_k, p.max_elems // max(rows)))


@st.composite
def quantize_problems(draw, profile: Profile | str | None = "ci", families=VALUE_FAMILIES,
                      with_k: bool = False) -> QuantizeProblem:
    """A quantize problem: shape, input dtype, a scheme (preset or random), a value family."""
    p = get_profile(profile)
    scheme = draw(schemes(p.tiny_blocks))
    dtype = draw(st.sampled_from(INPUT_DTYPES))
    k = draw(st.integers(-8, 8).filter(bool)) if with_k else 0
    rows = draw(sizes(p.max_mn))
    cols = draw(sizes(_k_cap(p, rows)))
    return QuantizeProblem(rows, cols, dtype, scheme, draw(_tensor_specs(dtype, families)), k)


@st.composite
def gemm_problems(draw, profile: Profile | str | None = "ci", aligned: bool = False, with_k: bool = False,
                  bias: bool | None = None) -> GemmProblem:
    """A scaled_mm problem with codes drawn by bit pattern (``aligned``: M, N, K multiples of 16)."""
    p = get_profile(profile)
    recipe = draw(recipes(p.tiny_blocks))
    out = draw(st.sampled_from(OUT_DTYPES))
    # Scale exponents centred on a realistic amax/qmax; fp16 outputs need smaller products.
    e_hi = -6 if out == torch.float16 else 0
    code = st.builds(CodeSpec, st.sampled_from(CODE_FAMILIES), _seeds(), st.integers(-20, e_hi), st.booleans())
    has_bias = draw(st.booleans()) if bias is None else bias
    k = draw(st.integers(-8, 8).filter(bool)) if with_k else 0
    M, N = draw(sizes(p.max_mn, aligned)), draw(sizes(p.max_mn, aligned))
    K = draw(sizes(_k_cap(p, M, N), aligned))
    return GemmProblem(M, N, K, recipe, out, draw(code), draw(code), has_bias, draw(_seeds()), k)


@st.composite
def linear_problems(draw, profile: Profile | str | None = "ci", aligned: bool = False) -> LinearProblem:
    """An end-to-end linear problem: float x and w from the value families, a recipe, dtypes."""
    p = get_profile(profile)
    recipe = draw(recipes(p.tiny_blocks))
    dtype = draw(st.sampled_from(INPUT_DTYPES))
    out = draw(st.sampled_from((dtype, torch.float32)))
    M, N = draw(sizes(p.max_mn, aligned)), draw(sizes(p.max_mn, aligned))
    K = draw(sizes(_k_cap(p, M, N), aligned))
    return LinearProblem(M, N, K, recipe, dtype, out, draw(_tensor_specs(dtype)), draw(_tensor_specs(dtype)),
                         draw(st.booleans()))
