"""Problems on tensors the caller already holds: ``GivenQuantize``, ``GivenGemm``, ``GivenLinear``.

The conformance problems (``problems.py``) describe their tensors, so that a counterexample
prints and shrinks; the selector's probe has its tensors already (adversarial rows at the
case's shape, ``fp8ref.select.inputs``) and hands them to the same checks through these. Each has
the interface the checks read from a problem (``build``, ``case``, the scheme or recipe, the
output dtype) and a ``memo``: the reference results and bounds computed for it, shared by every
backend checked against the same problem object and gone with it (the process-wide cache of
``common`` never holds a caller's tensors). Identity is the object: two given problems are equal
only if they are the same one.

The tensors stay on the CPU, where the reference runs; ``device`` is the device of the case the
backend is asked to run (``common.backend_device`` moves its inputs there). Activation schemes are
dynamic: ``fp8ref.linear``, whose selection the probe serves, takes no static activation scale.
Imports flow down: the registry and the spec only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..registry import Case
from ..spec.quant import Quantized
from ..spec.schemes import QuantScheme, Recipe

__all__ = ["GivenQuantize", "GivenGemm", "GivenLinear", "GIVEN_PROBLEMS"]


def _dynamic(scheme: QuantScheme, what: str) -> None:
    if not scheme.dynamic:
        raise ValueError(f"{what}: the activation scheme must be dynamic (a given problem takes no static scale), "
                         f"got {scheme.short_str()}")


def copy_quantized(q: Quantized) -> Quantized:
    return Quantized(q.data.clone(), q.scale.clone(), q.scheme)


@dataclass(frozen=True, eq=False, kw_only=True)
class GivenQuantize:
    """Quantize the given ``x [rows, cols]`` under the dynamic ``scheme``."""

    x: torch.Tensor
    scheme: QuantScheme
    device: str = "cpu"
    memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _dynamic(self.scheme, "GivenQuantize")

    def build(self) -> torch.Tensor:
        return self.x.clone()

    def scale(self, x: torch.Tensor) -> None:
        """No caller's scale: the scheme is dynamic."""
        return None

    def case(self) -> Case:
        rows, cols = self.x.shape
        return Case(rows, rows, cols, Recipe("quantize", self.scheme, self.scheme), self.x.dtype, device=self.device,
                    op="quantize")

    def __repr__(self) -> str:
        return f"quantize given x{list(self.x.shape)} {self.x.dtype} under {self.scheme.short_str()}"


@dataclass(frozen=True, eq=False, kw_only=True)
class GivenGemm:
    """``scaled_mm(a [M, K], b [N, K], bias)`` on the given quantized operands, for a case whose
    activations are ``x_dtype``."""

    a: Quantized
    b: Quantized
    bias: torch.Tensor | None
    recipe: Recipe
    out_dtype: torch.dtype
    x_dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    #: Call the backend on chunks of this many rows of ``a`` (the selector's M bucket), stacking the
    #: results; the reference and the bound are computed once for all rows. None: one call.
    call_rows: int | None = None
    memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.call_rows is not None and self.call_rows < 1:
            raise ValueError(f"GivenGemm: call_rows must be None or at least 1, got {self.call_rows}")

    @property
    def M(self) -> int:
        return self.a.data.shape[0]

    @property
    def N(self) -> int:
        return self.b.data.shape[0]

    @property
    def K(self) -> int:
        return self.a.data.shape[1]

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def build(self) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        return copy_quantized(self.a), copy_quantized(self.b), None if self.bias is None else self.bias.clone()

    def case(self) -> Case:
        """The case of one call (``call_rows`` rows when the backend is called in chunks)."""
        m = self.M if self.call_rows is None else min(self.call_rows, self.M)
        return Case(m, self.N, self.K, self.recipe, self.x_dtype, self.out_dtype, device=self.device,
                    has_bias=self.has_bias, op="scaled_mm")

    def __repr__(self) -> str:
        return (f"scaled_mm given M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} out={self.out_dtype}"
                + (" +bias" if self.has_bias else ""))


@dataclass(frozen=True, eq=False, kw_only=True)
class GivenLinear:
    """``linear(x [M, K], w [N, K], bias)`` end to end on the given tensors under ``recipe``."""

    x: torch.Tensor
    w: torch.Tensor
    bias: torch.Tensor | None
    recipe: Recipe
    out_dtype: torch.dtype
    device: str = "cpu"
    #: The spec's ``quantize(w, recipe.weight)``, when the caller has it (problems on row chunks of
    #: one x share one weight and its quantization); None: the checks quantize ``w`` themselves.
    qw: Quantized | None = field(default=None, repr=False)
    memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _dynamic(self.recipe.activation, "GivenLinear")
        if self.qw is not None and (self.qw.scheme != self.recipe.weight
                                    or tuple(self.qw.data.shape) != tuple(self.w.shape)):
            raise ValueError(f"GivenLinear: qw must be the quantization of w under recipe.weight "
                             f"({self.recipe.weight.short_str()}, {tuple(self.w.shape)}), got "
                             f"{self.qw.scheme.short_str()} {tuple(self.qw.data.shape)}")

    @property
    def M(self) -> int:
        return self.x.shape[0]

    @property
    def N(self) -> int:
        return self.w.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[1]

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.x.clone(), self.w.clone(), None if self.bias is None else self.bias.clone()

    def act_scale(self, x: torch.Tensor) -> None:
        """No caller's activation scale: the scheme is dynamic."""
        return None

    def case(self) -> Case:
        return Case(self.M, self.N, self.K, self.recipe, self.x.dtype, self.out_dtype, device=self.device,
                    has_bias=self.has_bias)

    def __repr__(self) -> str:
        return (f"linear given M={self.M} N={self.N} K={self.K} {self.recipe.short_str()} x:{self.x.dtype} "
                f"out={self.out_dtype}" + (" +bias" if self.has_bias else ""))


#: The given problem types (``common.cached_reference`` keeps their results in their own ``memo``).
GIVEN_PROBLEMS = (GivenQuantize, GivenGemm, GivenLinear)
