"""Conformance problems: small, readable descriptions from which the test tensors are built.

A problem (``QuantizeProblem``, ``GemmProblem``, ``LinearProblem``) holds sizes, dtypes, a scheme
or recipe and *descriptions* of its tensors (``TensorSpec``: a value family, a power of two, a
seed and where the extreme value goes; ``CodeSpec``: FP8 codes by bit pattern and their scales),
so a failing example prints and shrinks to something a person can read
(``quantize x[1, 17] bf16 = spike@last(2**0, seed=3) under e4m3fn-row-dyn``).

The tensors themselves -- value and code families, placements, static scales -- are described
and built in ``values.py`` (re-exported here). Imports flow down: the registry, the spec and
``values``.
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

import torch

from ..registry import Case
from ..spec import gemm
from ..spec.formats import Fp8Format, get_format
from ..spec.quant import Quantized, dequantize, quantize
from ..spec.schemes import QuantScheme, Recipe
from .values import (
    BIAS_MODES,
    CODE_FAMILIES,
    EDGE_FAMILIES,
    EXHAUSTIVE_FAMILIES,
    GRID_FAMILIES,
    MAGNITUDES,
    PLACES,
    STATIC_KINDS,
    VALUE_FAMILIES,
    CodeSpec,
    TensorSpec,
    anchor_blocks,
    dname,
    exhaustive_shape,
    make_codes,
    make_tensor,
    place_index,
    static_scale,
    swamp_ok,
)

__all__ = [
    "VALUE_FAMILIES",
    "GRID_FAMILIES",
    "EXHAUSTIVE_FAMILIES",
    "EDGE_FAMILIES",
    "MAGNITUDES",
    "exhaustive_shape",
    "CODE_FAMILIES",
    "PLACES",
    "STATIC_KINDS",
    "BIAS_MODES",
    "TensorSpec",
    "CodeSpec",
    "QuantizeProblem",
    "GemmProblem",
    "LinearProblem",
    "make_tensor",
    "make_codes",
    "anchor_blocks",
    "static_scale",
    "place_index",
    "swamp_ok",
    "problem_to_dict",
    "problem_from_dict",
]

# --------------------------------------------------------------------------------------------
# problems


def _short(scheme: QuantScheme) -> str:
    return scheme.short_str()


def _fmt_static(scheme: QuantScheme, static: str) -> str:
    return f", scale: {static}" if not scheme.dynamic else ""


@dataclass(frozen=True)
class QuantizeProblem:
    """Quantize ``x [rows, cols]`` of ``x_dtype`` under ``scheme`` (static schemes: the scale of
    kind ``static``, from ``static_scale``)."""

    rows: int
    cols: int
    x_dtype: torch.dtype
    scheme: QuantScheme
    x: TensorSpec
    k: int = 0  #: a power of two for the equivariance contract
    static: str = "pow2"

    def build(self) -> torch.Tensor:
        return make_tensor(self.x, self.rows, self.cols, self.x_dtype, self.scheme)

    def scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The caller's scale for ``x`` (None for a dynamic scheme)."""
        return None if self.scheme.dynamic else static_scale(x, self.scheme, self.static)

    def case(self) -> Case:
        recipe = Recipe("quantize", self.scheme, self.scheme)
        return Case(self.rows, self.rows, self.cols, recipe, self.x_dtype, op="quantize")

    def facets(self) -> dict:
        s = self.scheme
        return {"M": self.rows, "K": self.cols, "formats": {s.format.name}, "granularity": {s.granularity.value},
                "scales": {"dynamic" if s.dynamic else f"static:{self.static}"}, "x": {dname(self.x_dtype)},
                "family": {repr(self.x).split("(")[0]}}

    def __repr__(self) -> str:
        return (f"quantize x[{self.rows}, {self.cols}] {dname(self.x_dtype)} = {self.x!r} "
                f"under {_short(self.scheme)}{_fmt_static(self.scheme, self.static)}"
                + (f", k={self.k}" if self.k else ""))


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
    bias_mode: str = "random"

    def build(self) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        a = make_codes(self.a, self.M, self.K, self.recipe.activation)
        b = make_codes(self.b, self.N, self.K, self.recipe.weight)
        bias = None
        if self.has_bias and self.bias_mode == "cancel":
            row0 = Quantized(a.data[:1], a.scale[:1], a.scheme)
            y0, _ = gemm.scaled_mm_exact(row0, b)
            bias = _finite_bias(-y0[0], self.out_dtype)
        elif self.has_bias:
            g = torch.Generator().manual_seed(self.bias_seed)
            bias = torch.randn(self.N, generator=g).to(self.out_dtype)
        return a, b, bias

    def case(self) -> Case:
        return Case(self.M, self.N, self.K, self.recipe, torch.bfloat16, self.out_dtype, has_bias=self.has_bias,
                    op="scaled_mm")

    def facets(self) -> dict:
        r = self.recipe
        return {"M": self.M, "N": self.N, "K": self.K,
                "formats": {r.activation.format.name, r.weight.format.name},
                "granularity": {f"a:{r.activation.granularity.value}", f"w:{r.weight.granularity.value}"},
                "scales": {"dynamic" if r.activation.dynamic else "static"}, "out": {dname(self.out_dtype)},
                "bias": {self.bias_mode if self.has_bias else "none"},
                "family": {repr(self.a).split("(")[0].replace("codes:", "")}}

    def __repr__(self) -> str:
        bias = ""
        if self.has_bias:
            bias = " bias(cancels row 0)" if self.bias_mode == "cancel" else f" bias(seed={self.bias_seed})"
        return (f"scaled_mm M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} "
                f"out={dname(self.out_dtype)} a={self.a!r} b={self.b!r}" + bias + (f", k={self.k}" if self.k else ""))


def _finite_bias(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    big = torch.finfo(dtype).max / 4
    return b.clamp(-big, big).to(dtype)


@dataclass(frozen=True)
class LinearProblem:
    """``linear(x [M, K], w [N, K], bias)`` end to end under ``recipe`` (a static activation
    scheme takes the scale of kind ``static``; weights are quantized dynamically, as at load)."""

    M: int
    N: int
    K: int
    recipe: Recipe
    x_dtype: torch.dtype
    out_dtype: torch.dtype
    x: TensorSpec
    w: TensorSpec
    has_bias: bool = False
    bias_mode: str = "random"
    static: str = "pow2"

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = make_tensor(self.x, self.M, self.K, self.x_dtype, self.recipe.activation)
        w = make_tensor(self.w, self.N, self.K, self.x_dtype, self.recipe.weight)
        bias = None
        if self.has_bias and self.bias_mode == "cancel":
            qx = quantize(x, self.recipe.activation, self.act_scale(x))
            qw = quantize(w, self.recipe.weight)
            y0 = dequantize(qx, torch.float64)[:1] @ dequantize(qw, torch.float64).T
            bias = _finite_bias(-y0[0], self.x_dtype)
        elif self.has_bias:
            g = torch.Generator().manual_seed(self.w.seed + 1)
            bias = torch.randn(self.N, generator=g).to(self.x_dtype)
        return x, w, bias

    def act_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The caller's activation scale for ``x`` (None for a dynamic activation scheme)."""
        act = self.recipe.activation
        return None if act.dynamic else static_scale(x, act, self.static)

    def case(self) -> Case:
        return Case(self.M, self.N, self.K, self.recipe, self.x_dtype, self.out_dtype, has_bias=self.has_bias)

    def facets(self) -> dict:
        r = self.recipe
        return {"M": self.M, "N": self.N, "K": self.K,
                "formats": {r.activation.format.name, r.weight.format.name},
                "granularity": {f"a:{r.activation.granularity.value}", f"w:{r.weight.granularity.value}"},
                "scales": {"dynamic" if r.activation.dynamic else f"static:{self.static}"},
                "x": {dname(self.x_dtype)}, "out": {dname(self.out_dtype)},
                "bias": {self.bias_mode if self.has_bias else "none"}, "family": {repr(self.x).split("(")[0]}}

    def __repr__(self) -> str:
        bias = (" +bias(cancels row 0)" if self.bias_mode == "cancel" else " +bias") if self.has_bias else ""
        return (f"linear M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} x:{dname(self.x_dtype)} "
                f"out={dname(self.out_dtype)} x={self.x!r} w={self.w!r}" + bias
                + _fmt_static(self.recipe.activation, self.static))


# --------------------------------------------------------------------------------------------
# machine-readable problems: what a report keeps of a counterexample, and ``replay`` reads

_TYPES = {c.__name__: c for c in (QuantizeProblem, GemmProblem, LinearProblem, TensorSpec, CodeSpec, QuantScheme,
                                  Recipe)}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def _enc(v):
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, Fp8Format):
        return {"format": v.name}
    if isinstance(v, enum.Enum):
        return v.value
    if type(v).__name__ in _TYPES and is_dataclass(v):
        return {"type": type(v).__name__, **{f.name: _enc(getattr(v, f.name)) for f in fields(v)
                                             if f.init and not _is_default(f, getattr(v, f.name))}}
    if isinstance(v, tuple):
        return {"tuple": [_enc(x) for x in v]}
    return v


def _is_default(f, value) -> bool:
    """Whether a field holds its default (left out of the dict: ``_dec`` gets it back from the class)."""
    return f.default is not MISSING and type(value) is type(f.default) and value == f.default


def _dec(v):
    if isinstance(v, dict):
        if "type" in v:
            return _TYPES[v["type"]](**{k: _dec(x) for k, x in v.items() if k != "type"})
        if "dtype" in v:
            return _DTYPES[v["dtype"]]
        if "format" in v:
            return get_format(v["format"])
        if "tuple" in v:
            return tuple(_dec(x) for x in v["tuple"])
    return v


def problem_to_dict(problem) -> dict:
    """A problem as a JSON-serializable dict (every field, nested schemes and tensor descriptions
    included); ``problem_from_dict`` rebuilds the equal problem.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.check.problems import QuantizeProblem, TensorSpec, problem_from_dict, problem_to_dict
    >>> from fp8ref import QuantScheme
    >>> p = QuantizeProblem(2, 3, torch.bfloat16, QuantScheme(granularity="tensor"), TensorSpec("normal", -3, 7))
    >>> problem_from_dict(problem_to_dict(p)) == p
    True
    """
    return _enc(problem)


def problem_from_dict(d: dict):
    """The problem ``problem_to_dict`` wrote (``ValueError`` naming what is not a problem)."""
    if not isinstance(d, dict) or d.get("type") not in ("QuantizeProblem", "GemmProblem", "LinearProblem"):
        raise ValueError(f"not a serialized conformance problem (a dict with type QuantizeProblem, GemmProblem or "
                         f"LinearProblem): {str(d)[:80]!r}")
    return _dec(d)
