"""Hypothesis strategies for FP8 conformance: shapes, dtypes, value families, schemes, fp8 codes.

Every strategy here draws a small, shrinkable *description* (sizes, a family name, a power of
two, a seed; see ``problems.py``) and builds the tensors from it deterministically, so a failing
example shrinks to a readable one (``M=1, N=1, K=17, family='zero_rows', seed=0``) instead of to a
wall of floats.

The draws are stratified: a shape *regime* is drawn first -- small shapes in every dimension, or
one axis from the profile's boundary sizes (1, t-1, t, t+1 for every tile threshold t, and the
large row counts / long K of ``large_rows``/``long_k``) with the other axes small enough for the
element budget -- so the search reaches tall-thin and long-K shapes as often as square ones.
Schemes are static (caller-given scales) a quarter of the time.

Third parties reuse these directly::

    from hypothesis import given
    from fp8ref.conformance import strategies as fst

    @given(fst.linear_problems(profile="ci"))
    def test_my_kernel(p):
        x, w, bias = p.build()
        ...
"""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from ..check.problems import (
    BIAS_MODES,
    CODE_FAMILIES,
    GRID_FAMILIES,
    MAGNITUDES,
    PLACES,
    STATIC_KINDS,
    VALUE_FAMILIES,
    CodeSpec,
    GemmProblem,
    LinearProblem,
    QuantizeProblem,
    TensorSpec,
    anchor_blocks,
    make_codes,
    make_tensor,
    static_scale,
    swamp_ok,
)
from ..check.values import _grid_values
from ..spec.formats import FORMATS, Fp8Format
from ..spec.schemes import RECIPES, Granularity, QuantScheme, Recipe
from .profiles import Profile, boundary_sizes, get_profile
from .scope import Scope

__all__ = [
    "QuantScheme",
    "RECIPES",
    "SPECIAL_SIZES",
    "VALUE_FAMILIES",
    "GRID_FAMILIES",
    "CODE_FAMILIES",
    "STATIC_KINDS",
    "INPUT_DTYPES",
    "OUT_DTYPES",
    "SWAMP_BITS",
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
    "static_scale",
    "quantize_problems",
    "gemm_problems",
    "linear_problems",
]

#: Awkward sizes every kernel must survive: 1, odd, one below/above a tile, 4097 (thorough only).
SPECIAL_SIZES = (1, 3, 15, 16, 17, 32, 33, 64, 127, 128, 129, 144, 256, 272, 4097)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Significand widths the swamp family targets: 8 (bf16), 11 (fp16), 13/14 (Hopper's fast
#: accumulation, RNE and truncating), 24 (fp32), and one more than each, where the class keeps
#: every product and the next weaker one does not.
SWAMP_BITS = (8, 9, 11, 12, 13, 14, 15, 24, 25)


# --------------------------------------------------------------------------------------------
# sizes, dtypes, schemes


@functools.cache
def sizes(cap: int, aligned_only: bool = False) -> st.SearchStrategy[int]:
    """A dimension in [1, cap]: special sizes, multiples of 16 and 128, or any integer.

    Shrinks towards 1. (Strategies here are cached: building and validating one per draw would
    cost more than the draw.)
    """
    special = [s for s in SPECIAL_SIZES if s <= cap]
    mult16 = [s for s in range(16, cap + 1, 16)]
    if aligned_only:
        return st.sampled_from(mult16 or [16])
    # Uniform draws stop at 300 so that a large cap (thorough: 4097) keeps big sizes rare.
    return st.one_of(st.sampled_from(special or [1]), st.sampled_from(mult16 or [1]),
                     st.integers(1, max(1, min(cap, 300))))


@functools.cache
def _boundary(p: Profile, axis: str, cap: int) -> st.SearchStrategy[int]:
    vals = [v for v in boundary_sizes(p, axis) if v <= cap]
    return st.sampled_from(vals or [1])


@st.composite
def _shape(draw, p: Profile, n_rows: int, aligned: bool = False) -> tuple[int, ...]:
    """``n_rows`` row counts (M, or M and N) and K, from a drawn regime: small everywhere, or one
    axis at a boundary size with the others small (tall-thin rows, long-K single rows)."""
    if aligned:
        rows = [draw(sizes(p.max_mn, True)) for _ in range(n_rows)]
        return (*rows, draw(sizes(_k_cap(p, *rows), True)))
    regime = draw(_I(0, n_rows + 1))  # 0: small; 1..n_rows: that row axis; n_rows + 1: K
    if regime == 0:
        rows = [draw(sizes(p.max_mn)) for _ in range(n_rows)]
        return (*rows, draw(sizes(_k_cap(p, *rows))))
    if regime <= n_rows:
        rows = [draw(sizes(min(p.max_mn, 17))) for _ in range(n_rows)]
        rows[regime - 1] = draw(_boundary(p, "rows", min(p.max_rows, p.max_elems)))
        return (*rows, draw(sizes(min(_k_cap(p, *rows), 33))))
    K = draw(_boundary(p, "cols", p.max_elems))
    rows = [draw(sizes(max(1, min(5, p.max_elems // K)))) for _ in range(n_rows)]
    return (*rows, K)


def _k_cap(p: Profile, *rows: int) -> int:
    """Largest K that keeps every [rows, K] operand within the profile's element budget."""
    return max(1, min(p.max_k, p.max_elems // max(rows)))


_S = functools.lru_cache(maxsize=None)(st.sampled_from)
_I = functools.lru_cache(maxsize=None)(st.integers)
_GROUPS = (128, 3, 16, 32, 64)
_BLOCKS = ((128, 128), (16, 16), (3, 5), (128, 1), (1, 128), (32, 64))
_FLOORS = (1e-12, 0.0, 1e-4)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _random_scheme(draw, fmt: Fp8Format | None = None, tiny_blocks: bool = False) -> QuantScheme:
    fmt = draw(_S(tuple(FORMATS.values()))) if fmt is None else fmt
    gran = draw(_S(tuple(Granularity)))
    kw: dict = {}
    if gran is Granularity.GROUP:
        kw["group_size"] = draw(_S(_GROUPS + ((1, 2) if tiny_blocks else ())))
    elif gran is Granularity.BLOCK:
        kw["block"] = draw(_S(_BLOCKS + (((1, 1), (2, 1)) if tiny_blocks else ())))
    grid = _grid_values(fmt, fmt.max)
    qmax = draw(_S((fmt.max, float(grid[-2]), float(grid[len(grid) * 3 // 4]))))
    return QuantScheme(format=fmt, granularity=gran, amax_floor=draw(_S(_FLOORS)), qmax=qmax,
                       scale_dtype=draw(_S(_SCALE_DTYPES)), pow2_scale=draw(st.booleans()), **kw)


_K_POW = st.integers(-8, 8).filter(bool)


def _maybe_static(draw, s: QuantScheme) -> QuantScheme:
    return s.with_(dynamic=False) if draw(_I(0, 3)) == 0 else s


@functools.cache
def _preset_schemes() -> st.SearchStrategy[QuantScheme]:
    presets = sorted({s for r in RECIPES.values() for s in (r.weight, r.activation)}, key=QuantScheme.short_str)
    return st.sampled_from(presets)


@st.composite
def schemes(draw, tiny_blocks: bool = False, static: bool = True) -> QuantScheme:
    """A QuantScheme: one of the presets' schemes or a random valid one; static (a caller-given
    scale) a quarter of the time unless ``static=False``."""
    s = draw(_preset_schemes()) if draw(st.booleans()) else _random_scheme(draw, tiny_blocks=tiny_blocks)
    return _maybe_static(draw, s) if static else s


@st.composite
def recipes(draw, tiny_blocks: bool = False, static: bool = True) -> Recipe:
    """A preset recipe (more often) or a random one (weight and activation schemes drawn apart);
    the activation scheme static a quarter of the time unless ``static=False``."""
    if draw(_I(0, 2)) < 2:
        r = draw(_S(tuple(RECIPES.values())))
    else:
        w = _random_scheme(draw, tiny_blocks=tiny_blocks)
        a = _random_scheme(draw, w.format if draw(st.booleans()) else None, tiny_blocks)
        r = Recipe("random", w, a)
    if static and not draw(_I(0, 3)):
        r = Recipe(r.name + "-static", r.weight, r.activation.with_(dynamic=False))
    return r


def _scheme_from(draw, p: Profile, scope: Scope | None) -> QuantScheme:
    if scope is not None and scope.schemes is not None:
        return draw(_S(scope.schemes))
    return draw(schemes(p.tiny_blocks))


def _recipe_from(draw, p: Profile, scope: Scope | None) -> Recipe:
    if scope is not None and scope.recipes is not None:
        return draw(_S(scope.recipes))
    return draw(recipes(p.tiny_blocks))


@functools.cache
def _places(p: Profile) -> st.SearchStrategy[str]:
    return st.sampled_from(PLACES + tuple(f"edge{t}" for t in p.thresholds))


# --------------------------------------------------------------------------------------------
# codes


@st.composite
def fp8_codes(draw, fmt: Fp8Format | str = "e4m3fn", max_elems: int = 64) -> torch.Tensor:
    """A 1-D tensor of FP8 values drawn element by element by bit pattern (NaN codes excluded);
    shrinks towards code 0."""
    from ..spec.formats import get_format

    fmt = get_format(fmt)
    bits = draw(st.lists(st.integers(0, 255).filter(lambda b: b not in fmt.nan_codes), min_size=1,
                         max_size=max_elems))
    return torch.tensor(bits, dtype=torch.uint8).view(fmt.torch_dtype)


@functools.cache
def _tensor_specs(p: Profile, dtype: torch.dtype, families=VALUE_FAMILIES):
    from ..check.values import _exp_range

    lo, hi = _exp_range(dtype)
    return st.builds(TensorSpec, st.sampled_from(families),
                     st.one_of(st.just(0), st.integers(-12, 8), st.integers(lo, hi),
                               st.sampled_from(MAGNITUDES[dtype])),
                     st.integers(0, 2**16), _places(p))


@functools.cache
def _seeds():
    return st.integers(0, 2**16)


@st.composite
def _code_pair(draw, p: Profile, out: torch.dtype, recipe: Recipe) -> tuple[CodeSpec, CodeSpec]:
    """Operand descriptions: independent families, or a spike in the same K column of both, or a
    swamp pair whose small products sit ``SWAMP_BITS`` below the large one."""
    e_hi = -6 if out == torch.float16 else 0  # fp16 outputs need smaller products
    kind = draw(_I(0, 3))
    if kind == 2:
        place = draw(_places(p))
        pow2 = draw(st.booleans())
        exp = _I(-20, e_hi)
        return (CodeSpec("spike", draw(_seeds()), draw(exp), pow2, place),
                CodeSpec("spike", draw(_seeds()), draw(exp), pow2, place))
    t = draw(_S(SWAMP_BITS))
    if kind == 3 and swamp_ok(recipe.activation, (t + 1) // 2) and swamp_ok(recipe.weight, t // 2):
        e = draw(_I(-16, e_hi - 10))  # a swamp's large product is 2**16..2**30 in codes
        return CodeSpec("swamp", 0, e, True, bits=(t + 1) // 2), CodeSpec("swamp", 1, e, True, bits=t // 2)
    code = _codes(e_hi)
    return draw(code), draw(code)


@functools.cache
def _codes(e_hi: int) -> st.SearchStrategy[CodeSpec]:
    families = tuple(f for f in CODE_FAMILIES if f not in ("spike", "swamp"))  # those two come in pairs
    return st.builds(CodeSpec, st.sampled_from(families), _seeds(), st.integers(-20, e_hi), st.booleans(),
                     st.just(""), st.just(0), st.booleans())


# --------------------------------------------------------------------------------------------
# problems


@st.composite
def quantize_problems(draw, profile: Profile | str | None = "ci", families=VALUE_FAMILIES,
                      with_k: bool = False, scope: Scope | None = None) -> QuantizeProblem:
    """A quantize problem: a shape regime, input dtype, a scheme (preset, random, or one of the
    scope's), a value family with its placement, a static scale kind."""
    p = get_profile(profile)
    scheme = _scheme_from(draw, p, scope)
    dtype = draw(_S(INPUT_DTYPES))
    k = draw(_K_POW) if with_k else 0
    rows, cols = draw(_shape(p, 1))
    return QuantizeProblem(rows, cols, dtype, scheme, draw(_tensor_specs(p, dtype, families)), k,
                           draw(_S(STATIC_KINDS)))


@st.composite
def gemm_problems(draw, profile: Profile | str | None = "ci", aligned: bool = False, with_k: bool = False,
                  bias: bool | None = None, scope: Scope | None = None) -> GemmProblem:
    """A scaled_mm problem with codes drawn by bit pattern (``aligned``: M, N, K multiples of 16)."""
    p = get_profile(profile)
    recipe = _recipe_from(draw, p, scope)
    out = draw(_S(OUT_DTYPES))
    a, b = draw(_code_pair(p, out, recipe))
    has_bias = draw(st.booleans()) if bias is None else bias
    k = draw(_K_POW) if with_k else 0
    M, N, K = draw(_shape(p, 2, aligned))
    return GemmProblem(M, N, K, recipe, out, a, b, has_bias, draw(_seeds()), k, bias_mode=draw(_S(BIAS_MODES)))


@st.composite
def linear_problems(draw, profile: Profile | str | None = "ci", aligned: bool = False,
                    scope: Scope | None = None) -> LinearProblem:
    """An end-to-end linear problem: float x and w from the value families, a recipe (weights
    always dynamic: they are quantized at load time), dtypes, a bias that may cancel row 0."""
    p = get_profile(profile)
    recipe = _recipe_from(draw, p, scope)
    if not recipe.weight.dynamic:
        recipe = Recipe(recipe.name, recipe.weight.with_(dynamic=True), recipe.activation)
    dtype = draw(_S(INPUT_DTYPES))
    out = draw(_S((dtype, torch.float32)))
    M, N, K = draw(_shape(p, 2, aligned))
    return LinearProblem(M, N, K, recipe, dtype, out, draw(_tensor_specs(p, dtype)), draw(_tensor_specs(p, dtype)),
                         draw(st.booleans()), draw(_S(BIAS_MODES)), draw(_S(STATIC_KINDS)))
