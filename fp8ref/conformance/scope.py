"""What a certificate claims: the ops and the schemes a backend is certified for.

``check(backend)`` certifies every op the backend declares (``Backend.ops``) under every scheme the
suite draws. A narrow backend (a quantizer only, one scheme only) is certified for what it claims
with ``check(backend, ops=("quantize",), schemes=[...])``; the report then names the ops and the
schemes, and contracts of other ops read "not claimed".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..registry import OPS, Backend
from ..spec.schemes import QuantScheme, Recipe

__all__ = ["Scope", "make_scope"]


@dataclass(frozen=True)
class Scope:
    """The claim under test.

    Attributes
    ----------
    ops : tuple of str
        The ops certified (a subset of the backend's ``ops``).
    schemes : tuple of QuantScheme or None
        Schemes the quantize contracts draw from (None: every scheme the suite draws).
    recipes : tuple of Recipe or None
        Recipes the scaled_mm and linear contracts draw from (None: every recipe).
    """

    ops: tuple[str, ...] = OPS
    schemes: tuple[QuantScheme, ...] | None = None
    recipes: tuple[Recipe, ...] | None = None

    @property
    def narrowed(self) -> bool:
        return self.schemes is not None

    def describe(self) -> str:
        text = "ops " + ", ".join(self.ops)
        if self.schemes is not None:
            text += "; schemes " + ", ".join(s.short_str() for s in self.schemes)
        if self.recipes and {"scaled_mm", "linear"} & set(self.ops):
            text += "; recipes " + ", ".join(r.short_str() for r in self.recipes)
        return text


def _linear_recipe(s: QuantScheme) -> Recipe:
    """The recipe a claimed scheme is certified under in GEMMs: weights quantized at load time by
    the same scheme with a dynamic scale, activations by the scheme itself."""
    return Recipe(f"claimed:{s.short_str()}", s.with_(dynamic=True), s)


def make_scope(backend: Backend, ops: Iterable[str] | None = None,
               schemes: Sequence[QuantScheme | Recipe] | None = None) -> Scope:
    """The Scope of ``check(backend, ops=..., schemes=...)``, validated.

    ``ops`` must be among the backend's declared ops (default: all of them). ``schemes`` mixes
    ``QuantScheme`` (quantize contracts draw it; GEMM contracts use it for activations, with its
    dynamic twin for weights) and ``Recipe`` (GEMM contracts draw it; quantize contracts its
    activation scheme).

    Examples
    --------
    >>> from fp8ref import get_backend, QuantScheme
    >>> from fp8ref.conformance.scope import make_scope
    >>> make_scope(get_backend("reference"), ("quantize",), [QuantScheme()]).describe()
    'ops quantize; schemes e4m3fn-row-dyn'
    """
    declared = tuple(backend.ops)
    if ops is None:
        chosen = declared
    else:
        chosen = tuple(dict.fromkeys(ops))
        bad = [o for o in chosen if o not in OPS]
        if bad:
            raise ValueError(f"ops must be among {OPS}, got {bad}")
        undeclared = [o for o in chosen if o not in declared]
        if undeclared:
            raise ValueError(f"backend {backend.name!r} declares ops {declared}; it cannot be certified for "
                             f"{undeclared}")
        if not chosen:
            raise ValueError("ops is empty: name at least one op to certify")
    if schemes is None:
        return Scope(chosen)
    qs: list[QuantScheme] = []
    rs: list[Recipe] = []
    for s in schemes:
        if isinstance(s, QuantScheme):
            qs.append(s)
            rs.append(_linear_recipe(s))
        elif isinstance(s, Recipe):
            rs.append(s)
            qs.append(s.activation)
        else:
            raise TypeError(f"schemes must hold QuantScheme or Recipe objects, got {type(s).__name__}")
    if not qs:
        raise ValueError("schemes is empty: name at least one scheme, or pass None for all")
    return Scope(chosen, tuple(dict.fromkeys(qs)), tuple(dict.fromkeys(rs)))
