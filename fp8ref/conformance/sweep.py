"""The corner sweep: a fixed list of problems per op that reaches every bug class by construction.

Random search finds a bug only if it draws the narrow slice where the kernel breaks. The sweep
does not rely on that: before the search, every contract runs a deterministic list of problems
generated for the profile and the backend, organised in sections, one per class of real bug
(docs/conformance.md, "Where kernels break"):

* **axis boundaries**: every size 1, t-1, t, t+1 for every tile threshold t of the profile, and the
  large row counts / long K, on *each* axis, the other axes small (tall-thin M, long-K single rows);
* **extreme-value placement**: the amax of every scale block at its last element (the tail a
  vector loop or a row chunk drops), its first, and the first element past a tile edge; an
  all-zero row at the end;
* **static scales**: every kind (saturating, power of two, rounded down, wide) under row, tensor,
  group and block schemes of every format;
* **scale layouts**: group and block scales on grids with several rows and columns, every block
  its own scale, so a transposed, column-major or misindexed scale read changes the result;
* **format corners**: per format, subnormals and values that round to zero (FNUZ's -0), exact ties,
  +-qmax, grid values;
* **magnitudes**: amax across the whole exponent range of every input dtype (``MAGNITUDES``: from
  below the smallest subnormal to near the largest power of two), under dynamic schemes without an
  amax floor whose scale computation underflows or lands in the subnormal range (fp32, bf16 and fp16
  scale and compute dtypes, subnormal scales); GEMM outputs in the subnormal range of each output
  dtype (scales near 2**-70, fp16 outputs near 2**-20), also on two whole 128-wide K blocks;
* **repeated calls**: linear items in pairs of one shape and recipe, the second 2**8 times larger
  (a scale kept from the previous call clips it);
* **exhaustive**: every bf16 and fp16 bit pattern through each quantizer (per-row, per-tensor,
  group, E5M2, E4M3FNUZ), and every positive bf16 value as a row's amax under each dynamic per-row
  scheme: one call of up to 261k elements each, run by ``quantize.codes`` and ``quantize.scale``
  only (``Contract.exhaustive``);
* **rounding count**: biases that cancel row 0 of the product, for bf16 and fp16 outputs;
* **accumulation precision**: swamped dot products for every significand width in
  ``SWAMP_BITS``, at K = 64 and at the longest K of the profile;
* **recipes of current kernels**: MX (1x32 power-of-two scales, E4M3, E5M2 and mixed), DeepSeek's
  1x128 activations with 128x128 UE8M0 weight blocks, per-tensor x per-row and per-token x block,
  with N and K not multiples of the block (``CURRENT_RECIPES``, ``RECIPE_SHAPES``); and, under every
  power-of-two scheme, fp32, bf16 and fp16 inputs whose amax / qmax lies a few ulps above or below a
  power of two (the ``pow2_edge`` family), for quantize and linear.

Each item names a preferred scheme (or recipe, output dtype, bias) and, when the backend declines
it, takes the next one in a fixed rotation that it accepts, so a narrow backend still gets every
shape, placement and corner in a scheme it runs. The rotation's starting point moves with the
seed: every seed covers every item, in different pairings.

Why this module is long: the sweep is the suite's argument that each bug class is reached by
construction, section by section (docs/conformance.md follows it); the rotations of schemes and
recipes are shared by the three ops' sections, which would otherwise be split across modules that
import each other's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..check.problems import (
    EXHAUSTIVE_FAMILIES,
    MAGNITUDES,
    STATIC_KINDS,
    CodeSpec,
    GemmProblem,
    LinearProblem,
    QuantizeProblem,
    TensorSpec,
    exhaustive_shape,
    swamp_ok,
)
from ..registry import Backend, decline_reason
from ..spec.formats import E4M3FNUZ, E5M2
from ..spec.schemes import (
    FP8_BLOCK,
    FP8_BLOCK_UE8M0,
    FP8_PER_TENSOR,
    MXFP8,
    MXFP8_E5M2,
    W8A8_FP8,
    W8A8_FP8_ROCM,
    QuantScheme,
    Recipe,
)
from .profiles import Profile, boundary_sizes
from .scope import Scope
from .strategies import INPUT_DTYPES, OUT_DTYPES, SWAMP_BITS

__all__ = ["corner_sweep", "exhaustive", "QUANTIZE_SCHEMES", "GEMM_RECIPES", "CURRENT_RECIPES", "RECIPE_SHAPES",
           "POW2_SCHEMES", "MAGNITUDES"]

_f32, _f16, _bf16 = torch.float32, torch.float16, torch.bfloat16


def _qs(**kw) -> QuantScheme:
    return QuantScheme(**kw)


#: The quantize sweep's scheme rotation: every format, granularity, static/dynamic, scale dtype.
QUANTIZE_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row"),
    _qs(granularity="tensor"),
    _qs(granularity="group", group_size=128),
    _qs(format=E5M2, granularity="row"),
    _qs(format=E4M3FNUZ, granularity="row", qmax=224.0),
    _qs(granularity="group", group_size=32),
    _qs(granularity="block", block=(3, 5)),
    _qs(granularity="row", dynamic=False),
    _qs(granularity="group", group_size=16, scale_dtype=_bf16),
    _qs(granularity="block", block=(16, 16)),
    _qs(granularity="tensor", dynamic=False),
    _qs(granularity="row", pow2_scale=True),
    _qs(granularity="group", group_size=64),
    _qs(format=E4M3FNUZ, granularity="tensor"),
    _qs(granularity="block", block=(128, 128)),
    _qs(granularity="row", amax_floor=0.0, scale_dtype=_f16),
    _qs(format=E5M2, granularity="group", group_size=128, dynamic=False),
)
#: Schemes whose amax runs across rows (a per-tensor reduction over row chunks, R x C blocks).
_ACROSS_ROWS: tuple[QuantScheme, ...] = (
    _qs(granularity="tensor"),
    _qs(granularity="block", block=(16, 16)),
    _qs(format=E5M2, granularity="tensor"),
    _qs(granularity="block", block=(128, 128)),
    _qs(format=E4M3FNUZ, granularity="tensor", qmax=224.0),
    _qs(granularity="block", block=(3, 5)),
)
#: One scheme per format (and FNUZ at the ROCm clamp 224) for the format corners.
_FORMAT_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row"),
    _qs(format=E5M2, granularity="row"),
    _qs(format=E4M3FNUZ, granularity="row", qmax=224.0),
    _qs(format=E4M3FNUZ, granularity="tensor"),
    _qs(granularity="group", group_size=32),
    _qs(format=E5M2, granularity="block", block=(3, 5)),
)
_STATIC_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row", dynamic=False),
    _qs(format=E5M2, granularity="tensor", dynamic=False),
    _qs(format=E4M3FNUZ, granularity="group", group_size=16, qmax=224.0, dynamic=False),
    _qs(granularity="block", block=(3, 5), dynamic=False),
    _qs(granularity="tensor", dynamic=False, scale_dtype=_bf16),
    _qs(format=E5M2, granularity="row", dynamic=False),
    _qs(format=E4M3FNUZ, granularity="tensor", dynamic=False),
)
#: Dynamic schemes with no amax floor: where the scale computation underflows (fp32, bf16 or fp16
#: compute dtype), lands in the subnormal range (subnormal scales kept), or overflows (fp16 scales:
#: the spec refuses, the driver discards).
_MAGNITUDE_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row", amax_floor=0.0),
    _qs(granularity="row", amax_floor=0.0, scale_compute_dtype=_bf16),
    _qs(granularity="tensor", amax_floor=0.0, scale_dtype=_bf16, scale_compute_dtype=_bf16),
    _qs(granularity="row", amax_floor=0.0, subnormal_scales=True),
    _qs(format=E5M2, granularity="group", group_size=16, amax_floor=0.0),
    _qs(granularity="row", amax_floor=0.0, scale_dtype=_f16, scale_compute_dtype=_f16),
    _qs(granularity="row"),
)
#: Schemes of the exhaustive items: every bf16 and fp16 bit pattern through each (``all_bits``),
#: every positive bf16 value as a row's amax under each dynamic per-row scheme (``amax_rows``).
_ALL_BITS_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row"),
    _qs(granularity="tensor"),
    _qs(granularity="group", group_size=32, scale_dtype=_bf16),
    _qs(format=E5M2, granularity="row"),
    _qs(format=E4M3FNUZ, granularity="row", qmax=224.0),
)
_AMAX_ROW_SCHEMES: tuple[QuantScheme, ...] = (
    _qs(granularity="row"),
    _qs(granularity="row", amax_floor=0.0),
    _qs(granularity="row", amax_floor=0.0, scale_compute_dtype=_bf16),
    _qs(granularity="row", amax_floor=0.0, subnormal_scales=True),
    _qs(granularity="row", pow2_scale=True),
    _qs(format=E5M2, granularity="row"),
    _qs(format=E4M3FNUZ, granularity="row", qmax=224.0),
)
#: (scheme, rows, cols): scale grids of several rows and columns.
_Q_LAYOUTS = (
    (_qs(granularity="block", block=(3, 5)), 7, 23),
    (_qs(granularity="block", block=(16, 16)), 33, 50),
    (_qs(granularity="group", group_size=32), 3, 100),
    (_qs(granularity="group", group_size=64), 5, 130),
    (_qs(granularity="group", group_size=128), 2, 300),
    (_qs(granularity="block", block=(32, 64)), 65, 129),
    (_qs(granularity="block", block=(3, 5), dynamic=False), 7, 23),
    (_qs(granularity="group", group_size=32, dynamic=False), 3, 100),
)


#: The exhaustive items run where the profile allows operands this large per example (ci and
#: thorough; not dev, not a backend that pays per element).
_EXHAUSTIVE_MIN_ELEMS = 16384


def exhaustive(problem) -> bool:
    """Whether a sweep problem is one of the exhaustive items (only contracts with ``exhaustive``
    set run them)."""
    return isinstance(problem, QuantizeProblem) and problem.x.family in EXHAUSTIVE_FAMILIES


def _r(name: str, w: QuantScheme, a: QuantScheme) -> Recipe:
    return Recipe(name, w, a)


_ROW, _TENSOR = _qs(granularity="row"), _qs(granularity="tensor")
#: The GEMM sweep's recipe rotation.
GEMM_RECIPES: tuple[Recipe, ...] = (
    W8A8_FP8,
    FP8_PER_TENSOR,
    FP8_BLOCK,
    W8A8_FP8_ROCM,
    _r("e5m2-row", _qs(format=E5M2, granularity="row"), _qs(format=E5M2, granularity="row")),
    _r("w8a8-static", _ROW, _ROW.with_(dynamic=False)),
    _r("e5m2-activations", _ROW, _qs(format=E5M2, granularity="row")),
    _r("tensor-static", _TENSOR, _TENSOR.with_(dynamic=False)),
    _r("group32", _qs(granularity="block", block=(32, 32)), _qs(granularity="group", group_size=32)),
    _r("e4m3fnuz-tensor", _qs(format=E4M3FNUZ, granularity="tensor"), _qs(format=E4M3FNUZ, granularity="tensor")),
    _r("row-bf16-scales", _qs(granularity="row", scale_dtype=_bf16), _qs(granularity="row", scale_dtype=_bf16)),
)
#: One K segment per row: what the swamp needs to stress one accumulator over the whole K.
_SWAMP_RECIPES = (W8A8_FP8, FP8_PER_TENSOR, W8A8_FP8_ROCM, GEMM_RECIPES[4], FP8_BLOCK, GEMM_RECIPES[8])
#: (recipe, M, N, K): scale grids of several rows and columns on both operands.
_G_LAYOUTS = (
    (_r("block3x5", _qs(granularity="block", block=(3, 5)), _qs(granularity="group", group_size=3)), 4, 7, 23),
    (_r("block16", _qs(granularity="block", block=(16, 16)), _qs(granularity="group", group_size=16)), 3, 33, 50),
    (_r("group32", _ROW, _qs(granularity="group", group_size=32)), 3, 5, 100),
    (FP8_BLOCK, 3, 63, 257),
    (_r("block32x64", _qs(granularity="block", block=(32, 64)), _qs(granularity="group", group_size=64)), 2, 65, 129),
    (_r("group64-tensor", _TENSOR, _qs(granularity="group", group_size=64)), 3, 4, 130),
)
_G_FORMATS = (
    _r("e5m2-row", _qs(format=E5M2, granularity="row"), _qs(format=E5M2, granularity="row")),
    W8A8_FP8_ROCM,
    _r("e5m2-activations", _ROW, _qs(format=E5M2, granularity="row")),
    _r("e5m2-weights", _qs(format=E5M2, granularity="row"), _ROW),
    _r("e4m3fnuz-tensor", _qs(format=E4M3FNUZ, granularity="tensor"), _qs(format=E4M3FNUZ, granularity="tensor")),
    _r("e5m2-block", _qs(format=E5M2, granularity="block", block=(3, 5)), _qs(format=E5M2, granularity="group",
                                                                               group_size=5)),
)
_BLOCK128 = _qs(granularity="block", block=(128, 128))
#: The recipes kernels use today (docs/conformance.md, "Where kernels break": recipes of current
#: kernels): MX on E4M3, E5M2 and mixed (E4M3 activations, E5M2 weights), DeepSeek's 1x128 x
#: 128x128 with UE8M0 scales, and mixed granularities.
CURRENT_RECIPES: tuple[Recipe, ...] = (
    MXFP8,
    MXFP8_E5M2,
    FP8_BLOCK_UE8M0,
    _r("mxfp8-e5m2-weights", MXFP8_E5M2.weight, MXFP8.activation),
    _r("row-x-tensor", _ROW, _TENSOR),
    _r("tensor-x-row", _TENSOR, _ROW),
    _r("block128-x-token", _BLOCK128, _ROW),
)
#: (recipe, M, N, K) of the recipe section: N and K not multiples of the block (a partial last
#: 1x32 group, a partial 128-row weight block and a partial 128-wide K block), and whole blocks.
RECIPE_SHAPES: tuple[tuple[Recipe, int, int, int], ...] = (
    (MXFP8, 3, 5, 100),
    (MXFP8, 2, 33, 64),
    (MXFP8_E5M2, 4, 7, 45),
    (CURRENT_RECIPES[3], 2, 6, 96),
    (FP8_BLOCK_UE8M0, 3, 130, 120),
    (FP8_BLOCK_UE8M0, 2, 66, 200),
    (FP8_BLOCK_UE8M0, 5, 40, 256),
    (CURRENT_RECIPES[4], 3, 9, 40),
    (CURRENT_RECIPES[5], 4, 5, 33),
    (CURRENT_RECIPES[6], 3, 129, 100),
)
#: The power-of-two schemes whose scale computation the ``pow2_edge`` items aim at.
POW2_SCHEMES: tuple[QuantScheme, ...] = (MXFP8.activation, MXFP8_E5M2.activation, FP8_BLOCK_UE8M0.activation,
                                         FP8_BLOCK_UE8M0.weight, _qs(granularity="row", pow2_scale=True))
#: Exponents of the ``pow2_edge`` anchors: away from 2**0, where fp32's log2 of 1 + 2**-23 is still
#: above 0 and a float ceil(log2) happens to be right.
_EDGE_EXPS = (8, -9, 5, -14, 3)
_SMALL_ROWS = (1, 2, 3, 5)
_SMALL_MN = ((1, 3), (2, 16), (3, 17), (5, 4))  # (rows of one operand, rows of the other)
_SMALL_NK = ((3, 16), (5, 24), (16, 17), (4, 33), (2, 9))


def _rot(seq: Sequence, start: int) -> list:
    n = len(seq)
    return [seq[(start + j) % n] for j in range(n)]


def _fits(p: Profile, *operands: tuple[int, int]) -> bool:
    return all(r * c <= p.max_elems and r <= p.max_rows for r, c in operands)


def _small_pair(p: Profile, i: int, K: int) -> tuple[int, int] | None:
    """(M, N), small, for a K-boundary item: the first of the rotation that fits the budget."""
    return next(((m, n) for m, n in _rot(_SMALL_MN, i) if _fits(p, (m, K), (n, K))), None)


def _small_other(p: Profile, i: int, R: int) -> tuple[int, int] | None:
    """(other rows, K), small, for an M- or N-boundary item of R rows."""
    return next(((n, k) for n, k in _rot(_SMALL_NK, i) if _fits(p, (R, k), (n, k))), None)


def _row_boundaries(p: Profile) -> Iterable[tuple[int, int, int, int, int]]:
    """``(axis, i, M, N, K)``: every boundary row count on M (axis 0) and on N (axis 1), the other
    operand's rows and K small."""
    for axis in (0, 1):
        for i, R in enumerate(boundary_sizes(p, "rows")):
            other = _small_other(p, i, R)
            if other is not None:
                n, k = other
                yield (axis, i, R, n, k) if axis == 0 else (axis, i, n, R, k)


def _pick(backend: Backend | None, candidates: Iterable,
          map_problem: Callable[[Any], Any] | None = None) -> object | None:
    """The first candidate the backend takes, else the first one (its decline is then recorded).

    A candidate is judged as the check will run it: through ``map_problem`` (a peer's declared
    conventions filled in, ``fp8ref.conformance.adaptation``), since a backend that takes only its
    own conventions declines every unmapped candidate. The candidate itself is returned unmapped;
    the adapted contract maps it."""
    cands = list(candidates)
    if not cands:
        return None
    if backend is not None:
        for c in cands:
            if decline_reason(backend, (c if map_problem is None else map_problem(c)).case()) is None:
                return c
    return cands[0]


def _static_kinds(i: int, seed: int) -> list[str]:
    return _rot(STATIC_KINDS, i + seed)


# --------------------------------------------------------------------------------------------
# quantize


def _quantize_items(p: Profile, seed: int, scope: Scope | None) -> Iterable[list[QuantizeProblem]]:
    claimed = scope.schemes if scope is not None and scope.schemes is not None else None
    main = claimed or QUANTIZE_SCHEMES
    across = claimed or _ACROSS_ROWS

    def cands(rows, cols, x: TensorSpec, schemes, i, *, dtypes=INPUT_DTYPES, kinds=None):
        kinds = kinds or _static_kinds(i, seed)
        dt = _rot(dtypes, i + seed)[0]
        return [QuantizeProblem(rows, cols, dt, s, x, 0, kinds[j % len(kinds)])
                for j, s in enumerate(_rot(schemes, i + 3 * seed))]

    # axis boundaries along K, the block's amax at its last element (the tail)
    for i, c in enumerate(boundary_sizes(p, "cols")):
        rows = next((r for r in _rot(_SMALL_ROWS, i) if _fits(p, (r, c))), None)
        if rows is not None:
            yield cands(rows, c, TensorSpec("spike", 0, i, "last"), main, i)
    # axis boundaries along the rows: amax across rows in the last row; a zero row at the end
    for i, r in enumerate(boundary_sizes(p, "rows")):
        cols = next((c for c in _rot((3, 5, 8, 1), i) if _fits(p, (r, c))), None)
        if cols is None:
            continue
        yield cands(r, cols, TensorSpec("spike", 0, 100 + i, "last"), across, i)
        fam = TensorSpec("zero_rows", 0, 200 + i, "last") if i % 2 else TensorSpec("spike", 0, 200 + i, "first")
        yield cands(r, cols, fam, main, i + 1)
    # tile edges: the block's amax at the first element past a tile of t
    for i, t in enumerate(p.thresholds):
        c = 2 * t + 1
        if _fits(p, (2, c)):
            yield cands(2, c, TensorSpec("spike", 0, 300 + i, f"edge{t}"), main, i + 2)
    # format corners: subnormals and values rounding to zero, ties, +-qmax, grid values
    fams = ("underflow", "ties", "qmax", "on_grid")
    for i, s in enumerate(claimed or _FORMAT_SCHEMES):
        for j, fam in enumerate(fams[:2] + (fams[2 + i % 2],)):
            yield cands(3 + j, 40 - 7 * j, TensorSpec(fam, (-3, 0, 2)[j], 400 + 3 * i + j), [s], i + j,
                        kinds=["pow2"])
    # other value families
    misc = ("normal", "outliers", "heavy", "dynamic_range", "single", "constant_rows", "zeros", "uniform")
    for i, fam in enumerate(misc):
        yield cands((4, 1, 17, 2)[i % 4], (33, 160, 16, 64)[i % 4], TensorSpec(fam, (0, -8, 5, 0)[i % 4], 500 + i),
                    main, i + 5)
    # static scales: every kind under several schemes and formats
    statics = [s for s in (claimed or _STATIC_SCHEMES) if not s.dynamic]
    for i, kind in enumerate(STATIC_KINDS):
        for j in range(min(len(statics), 4)):
            s = statics[(i + j + seed) % len(statics)]
            fam = ("normal", "spike", "ties", "underflow")[(i + j) % 4]
            spec = TensorSpec(fam, 0, 600 + 4 * i + j, "last" if fam == "spike" else "")
            yield cands((4, 2, 7, 1)[j], (48, 130, 23, 257)[j], spec, [s], i + j, kinds=[kind])
    # magnitudes: every exponent of every input dtype, first under the schemes whose scale
    # computation underflows there (each dtype's own compute dtype first)
    n = 0
    for dt, exps in MAGNITUDES.items():
        for e in exps:
            first = {_f32: 0, _bf16: 1, _f16: 5}[dt]
            order = claimed or _rot(_MAGNITUDE_SCHEMES, first + (n % 2) * (3 + seed))
            x = TensorSpec(("normal", "single")[n % 2], e, 1300 + n)
            yield [QuantizeProblem((2, 3, 1)[n % 3], (40, 17, 64)[n % 3], dt, s, x) for s in order]
            n += 1
    # exhaustive: every bf16 and fp16 pattern, every bf16 value as a row's amax (one call each, up to
    # 261k elements: run by the contracts that ask for them, skipped for a backend that pays per element)
    if p.max_elems >= _EXHAUSTIVE_MIN_ELEMS:
        for fam, dtypes, schemes in (("all_bits", (_bf16, _f16), _ALL_BITS_SCHEMES),
                                     ("amax_rows", (_bf16,), _AMAX_ROW_SCHEMES)):
            for dt in dtypes:
                rows, cols = exhaustive_shape(fam, dt)
                for i, sch in enumerate(schemes):
                    order = [sch] if claimed is None else claimed
                    yield [QuantizeProblem(rows, cols, dt, s2, TensorSpec(fam, 0, i)) for s2 in order]
    # power-of-two scales: amax / qmax a few ulps above or below a power of two, every input dtype
    for i, s in enumerate(POW2_SCHEMES):
        for j, dt in enumerate((_f32, _bf16, _f16)):
            rows, cols = ((4, 160), (3, 256), (130, 40))[(i + j) % 3] if s.granularity.value == "block" else (
                (5, 100), (2, 70), (9, 33))[(i + j) % 3]
            if _fits(p, (rows, cols)):
                x = TensorSpec("pow2_edge", _EDGE_EXPS[(i + j) % len(_EDGE_EXPS)], 1500 + 3 * i + j)
                yield [QuantizeProblem(rows, cols, dt, s2, x) for s2 in ([s] + _rot(main, i + j + seed)
                                                                        if claimed is None else claimed)]
    # scale layouts: grids of several rows and columns, every block its own amax
    for i, (s, rows, cols) in enumerate(_Q_LAYOUTS):
        if _fits(p, (rows, cols)):
            yield cands(rows, cols, TensorSpec("spike", 0, 700 + i), [s] if claimed is None else claimed, i,
                        kinds=["wide"])


# --------------------------------------------------------------------------------------------
# scaled_mm


def _gemm_items(p: Profile, seed: int, scope: Scope | None) -> Iterable[list[GemmProblem]]:
    claimed = scope.recipes if scope is not None and scope.recipes is not None else None
    main = claimed or GEMM_RECIPES
    bias_modes = ((False, "random"), (True, "random"), (True, "cancel"))

    def cands(M, N, K, a: CodeSpec, b: CodeSpec, recipes, i, *, outs=OUT_DTYPES, biases=bias_modes):
        out = []
        for r in _rot(recipes, i + 5 * seed):
            for o in (outs if outs is not OUT_DTYPES else _rot(outs, i + seed)):
                has_bias, mode = _rot(biases, i + 2 * seed)[0]
                if a.family == "swamp" and not (swamp_ok(r.activation, a.bits) and swamp_ok(r.weight, b.bits)):
                    continue
                out.append(GemmProblem(M, N, K, r, o, a, b, has_bias, i, 0, bias_mode=mode))
        return out

    def codes(i: int, place: str | None = None, distinct: bool = False):
        if place is not None:
            return (CodeSpec("spike", 2 * i, -9, i % 2 == 0, place),
                    CodeSpec("spike", 2 * i + 1, -9, i % 2 == 0, place))
        return (CodeSpec("bits", 2 * i, -9, False, distinct_scales=distinct),
                CodeSpec("bits", 2 * i + 1, -9, True, distinct_scales=distinct))

    # K boundaries: the dominant product in the last column, all-positive products (every rounding
    # of a partial sum shows), random codes; beyond the tile thresholds (split-K territory) with an
    # fp32 output, so that the output rounding hides nothing
    top = max(p.thresholds) + 1
    for i, K in enumerate(boundary_sizes(p, "cols")):
        mn = _small_pair(p, i, K)
        if mn is None:
            continue
        fam = ("spike", "positive", "bits")[i % 3]
        if fam == "spike":
            a, b = codes(i, "last")
        else:
            a, b = CodeSpec(fam, 2 * i, -9, True), CodeSpec(fam, 2 * i + 1, -9, False)
        outs = (_f32, _bf16, _f16) if K > top else OUT_DTYPES
        yield cands(mn[0], mn[1], K, a, b, main, i, outs=outs)
    # M and N boundaries (tall-thin activations, tall weights), every row its own scale
    for axis, i, M, N, k in _row_boundaries(p):
        a, b = codes(100 * (axis + 1) + i, distinct=True)
        yield cands(M, N, k, a, b, main, i + axis)
    # tile edges along K: the dominant product just past a tile of t
    for i, t in enumerate(p.thresholds):
        K = 2 * t + 1
        if _fits(p, (2, K), (3, K)):
            a, b = codes(300 + i, f"edge{t}")
            yield cands(2, 3, K, a, b, main, i)
    # accumulation precision: swamped dot products at every significand width, short and long K
    long_k = max([k for k in boundary_sizes(p, "cols") if k % 2 == 0 and _fits(p, (2, k))], default=64)
    for i, t in enumerate(SWAMP_BITS):
        for j, (K, frac) in enumerate(((64, ""), (64, "7/8"), (long_k, ""))):
            if not _fits(p, (2, K)) or (j == 2 and K == 64):
                continue
            a = CodeSpec("swamp", 0, -12, True, frac, bits=(t + 1) // 2)
            b = CodeSpec("swamp", 1, -12, True, bits=t // 2)
            yield cands(2, 2, K, a, b, claimed or _SWAMP_RECIPES, i + j, outs=(_f32, _bf16, _f16),
                        biases=((False, "random"),))
    # magnitudes: outputs in the subnormal range of each output dtype (scales near 2**-70 put
    # sa sb near 2**-140, below fp32's and bf16's smallest normal; fp16 outputs below 2**-14)
    for i, (o, e) in enumerate(((_f32, -70), (_bf16, -70), (_f16, -18), (_f32, -66), (_bf16, -74), (_f16, -14))):
        a = CodeSpec("bits", 1400 + 2 * i, e, i % 2 == 0)
        b = CodeSpec(("bits", "positive")[i % 2], 1401 + 2 * i, e, False)
        yield cands((3, 2, 5)[i % 3], (5, 17, 4)[i % 3], (40, 16, 33)[i % 3], a, b, main, i, outs=(o,),
                    biases=((False, "random"),))
    # the same magnitudes on two whole 128-wide K blocks: a block kernel that takes no partial block
    # (LMDeploy's blocked_gemm_fp8) meets them too, and one that rescales its accumulator by a ratio
    # of scale products per K tile meets 1 / (sa sb) beyond fp32's range
    for i, (o, e) in enumerate(((_f32, -70), (_bf16, -68))):
        if _fits(p, (2, 256), (3, 256)):
            a = CodeSpec("bits", 1420 + 2 * i, e, i % 2 == 0)
            b = CodeSpec("bits", 1421 + 2 * i, e, False)
            yield cands(2, 3, 256, a, b, main, i, outs=(o,), biases=((False, "random"),))
    # rounding count: a bias that cancels row 0 of the product, bf16 and fp16 outputs
    for i, (K, o) in enumerate(((16, _bf16), (100, _f16), (300, _bf16), (64, _f16), (33, _bf16), (130, _f16))):
        if _fits(p, (3, K), (8, K)):
            a, b = codes(400 + i)
            yield cands(3, 8, K, a, b, main, i, outs=(o, _bf16, _f32), biases=((True, "cancel"),))
    # scale layouts: distinct scales on grids of several rows and columns
    for i, (r, M, N, K) in enumerate(_G_LAYOUTS):
        if _fits(p, (M, K), (N, K)):
            a, b = codes(500 + i, distinct=True)
            yield cands(M, N, K, a, b, [r] if claimed is None else claimed, i)
    # formats: e5m2 and e4m3fnuz operands, mixed formats, +-qmax and subnormal codes
    for i, r in enumerate(claimed or _G_FORMATS):
        fam = ("bits", "extremes")[i % 2]
        a = CodeSpec(fam, 600 + 2 * i, -12, True)
        b = CodeSpec(fam, 601 + 2 * i, -12, False)
        yield cands((5, 1, 3)[i % 3], (16, 7, 33)[i % 3], (48, 17, 130)[i % 3], a, b, [r], i)
    # recipes of current kernels: MX, UE8M0 blocks, mixed granularities, partial blocks on N and K;
    # the named recipe first, then (for a backend that declines it) the rest of the section's
    for i, (r, M, N, K) in enumerate(RECIPE_SHAPES):
        if _fits(p, (M, K), (N, K)):
            fam = ("bits", "spike", "positive")[i % 3]
            a = CodeSpec(fam, 1600 + 2 * i, -9, True, "last" if fam == "spike" else "", distinct_scales=fam == "bits")
            b = CodeSpec(fam, 1601 + 2 * i, -9, True, "last" if fam == "spike" else "", distinct_scales=fam == "bits")
            order = [r] + [c for c in _rot(CURRENT_RECIPES, i + seed) if c != r] if claimed is None else claimed
            has_bias, mode = _rot(bias_modes, i + 2 * seed)[0]
            yield [GemmProblem(M, N, K, rr, o, a, b, has_bias, i, 0, bias_mode=mode)
                   for rr in order for o in _rot(OUT_DTYPES, i + seed)]


# --------------------------------------------------------------------------------------------
# linear


def _linear_recipes(recipes: Sequence[Recipe]) -> list[Recipe]:
    """Recipes with dynamic weights (weights are quantized once, at load time)."""
    return [r if r.weight.dynamic else Recipe(r.name, r.weight.with_(dynamic=True), r.activation) for r in recipes]


def _linear_items(p: Profile, seed: int, scope: Scope | None) -> Iterable[list[LinearProblem]]:
    claimed = scope.recipes if scope is not None and scope.recipes is not None else None
    main = _linear_recipes(claimed or GEMM_RECIPES)
    bias_modes = ((False, "random"), (True, "random"), (True, "cancel"))

    def cands(M, N, K, x: TensorSpec, w: TensorSpec, recipes, i, *, kinds=None):
        kinds = kinds or _static_kinds(i, seed)
        has_bias, mode = _rot(bias_modes, i + 2 * seed)[0]
        out = []
        for j, r in enumerate(_rot(recipes, i + 5 * seed)):
            for dt in _rot(INPUT_DTYPES, i + seed):
                for o in ((dt, _f32) if (i + j) % 2 else (_f32, dt)):
                    out.append(LinearProblem(M, N, K, r, dt, o, x, w, has_bias, mode, kinds[j % len(kinds)]))
        return out

    w_spec = TensorSpec("normal", -3, 1)
    for i, K in enumerate(boundary_sizes(p, "cols")):
        mn = _small_pair(p, i, K)
        if mn is not None:
            yield cands(mn[0], mn[1], K, TensorSpec("spike", 0, 800 + i, "last"), w_spec, main, i)
    for axis, i, M, N, k in _row_boundaries(p):
        x = TensorSpec("spike", 0, 900 + 100 * axis + i, ("last", "first")[i % 2])
        yield cands(M, N, k, x, w_spec, main, i + axis)
    statics = [r for r in main if not r.activation.dynamic]
    for i, kind in enumerate(STATIC_KINDS):
        for j, r in enumerate(statics[:2]):
            x = TensorSpec(("normal", "spike", "outliers", "ties")[(i + j) % 4], 0, 1100 + 2 * i + j, "last")
            yield cands((3, 17)[j], (16, 5)[j], (40, 130)[j], x, w_spec, [r], i + j, kinds=[kind])
    for i, fam in enumerate(("underflow", "ties", "qmax", "dynamic_range", "heavy", "zero_rows")):
        yield cands((4, 2, 16)[i % 3], (8, 33, 3)[i % 3], (32, 17, 64)[i % 3], TensorSpec(fam, 0, 1200 + i, "last"),
                    w_spec, main, i + 3)
    # repeated calls: the same shape and recipe twice in a row, the second 2**8 times larger, so a
    # scale (or anything derived from x) kept from the previous call clips the second
    for i, (M, N, K) in enumerate(((3, 5, 40), (16, 4, 130), (1, 8, 64))):
        for exp in (-4, 4):
            yield cands(M, N, K, TensorSpec(("normal", "outliers", "spike")[i], exp, 1300 + i, "last"), w_spec, main,
                        i + 7)
    # recipes of current kernels (the named recipe first), then amax / qmax a few ulps from a power
    # of two under each power-of-two recipe, in every input dtype
    current = _linear_recipes(CURRENT_RECIPES)
    for i, (r, M, N, K) in enumerate(RECIPE_SHAPES):
        if _fits(p, (M, K), (N, K)):
            x = TensorSpec(("spike", "normal", "outliers")[i % 3], 0, 1400 + i, "last")
            order = [r] + [c for c in _rot(current, i + seed) if c != r] if claimed is None else main
            has_bias, mode = _rot(bias_modes, i + 2 * seed)[0]
            dts = _rot(INPUT_DTYPES, i + seed)
            yield [LinearProblem(M, N, K, rr, dt, o, x, w_spec, has_bias, mode) for rr in order for dt in dts
                   for o in (dt, _f32)]
    pow2 = [r for r in current if r.activation.pow2_scale]
    for i, r in enumerate(pow2):
        for j, dt in enumerate((_f32, _bf16, _f16)):
            M, N, K = ((3, 5, 100), (2, 130, 120), (4, 9, 64))[(i + j) % 3]
            if not _fits(p, (M, K), (N, K)):
                continue
            x = TensorSpec("pow2_edge", _EDGE_EXPS[(i + j) % len(_EDGE_EXPS)], 1450 + 3 * i + j)
            w = TensorSpec("pow2_edge", _EDGE_EXPS[(i + j + 2) % len(_EDGE_EXPS)], 1460 + 3 * i + j)
            order = [r] + [c for c in _rot(current, i + j + seed) if c != r] if claimed is None else main
            has_bias, mode = _rot(bias_modes, i + j + 2 * seed)[0]
            yield [LinearProblem(M, N, K, rr, dt, o, x, w, has_bias, mode) for rr in order for o in (dt, _f32)]


# --------------------------------------------------------------------------------------------


_ITEMS: dict[str, Callable] = {"quantize": _quantize_items, "scaled_mm": _gemm_items, "linear": _linear_items}


def corner_sweep(op: str, profile: Profile, backend: Backend | None = None, seed: int = 0,
                 scope: Scope | None = None, map_problem: Callable[[Any], Any] | None = None) -> list:
    """The sweep's problems for ``op`` ("quantize", "scaled_mm" or "linear") under ``profile``.

    With a ``backend``, each item becomes the first of its candidates (schemes, recipes, output
    dtypes in a rotation set by ``seed``) that the backend takes; an item it declines in every
    candidate keeps its first one (the driver records the decline). ``scope`` restricts the
    schemes/recipes to a claim. ``map_problem`` (a peer's conventions) is applied to a candidate
    before asking the backend whether it takes it.

    Examples
    --------
    >>> from fp8ref.conformance.sweep import corner_sweep
    >>> from fp8ref.conformance.profiles import PROFILES
    >>> probs = corner_sweep("quantize", PROFILES["ci"])
    >>> {(p.rows, p.cols) for p in probs} >= {(1, 4097), (1025, 5), (2, 257)}  # long K, tall, a tile edge
    True
    """
    try:
        items = _ITEMS[op]
    except KeyError:
        raise ValueError(f"op must be one of {sorted(_ITEMS)}, got {op!r}") from None
    out = []
    for cands in items(profile, seed, scope):
        chosen = _pick(backend, cands, map_problem)
        if chosen is not None:
            out.append(chosen)
    return out


def with_k(problems: Sequence, ks: Sequence[int] = (3, -2, 5, -7, 1, -1)) -> list:
    """The problems with a nonzero power of two ``k`` each (for the equivariance contracts)."""
    return [replace(pr, k=ks[i % len(ks)]) for i, pr in enumerate(problems)]
