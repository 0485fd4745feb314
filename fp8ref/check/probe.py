"""The selector's compliance probe, as a list of the contracts' checks: ``PROBE_CHECKS``.

Each entry names the conformance contract whose check it runs (``fp8ref.conformance.contracts``
has a row of that name calling the same function), the op whose problem it takes, which
backends it applies to and on which rows. The selector (``fp8ref.select.compliance``) builds the
problems -- given tensors (``given``) at the case's shape -- and runs this list; it compares
nothing itself. The list is small because the probe runs inside ``fp8ref.linear(...,
backend="auto")``, on one case, before timing: the activation quantization (scale and codes), the
GEMM's bound, the fused linear against the two calls it fuses, the end-to-end bound where the
linear is the backend's own (a fused hook: on the first chunk, the other chunks being tied to the
two calls; a backend declaring only the ``linear`` op: on every chunk), and the non-finite
refusal the backend may declare. An op a backend does not declare (``Backend.ops``) is not
probed, as the contract table does not claim it. The rest of the contracts (identities, the
calling contract, the accumulator probe, the Hypothesis search) are the certificate's:
``fp8ref conformance``. Imports flow down: the registry and the per-op checks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from ..registry import Backend
from .linear import check_linear_bound, check_linear_matches_two_calls, check_linear_refuses_non_finite
from .quantize import check_quantize_codes, check_quantize_scale
from .scaled_mm import check_scaled_mm_bound

__all__ = ["ProbeCheck", "PROBE_CHECKS", "PROBE_REVISION", "fused_linear"]


def _always(backend: Backend) -> bool:
    return True


def fused_linear(backend: Backend) -> bool:
    """Whether ``backend`` overrides ``Backend.linear`` (a fused hook): otherwise its linear is
    ``scaled_mm(quantize(x))``, which the quantize and scaled_mm checks already judge, and whose
    end-to-end bound is the sum of theirs (``linear_error_bound``)."""
    return type(backend).linear is not Backend.linear


def _declares_rejects_non_finite(backend: Backend) -> bool:
    return backend.rejects_non_finite


def _declares(*ops: str) -> Callable[[Backend], bool]:
    """Applies to a backend declaring every op in ``ops`` (``Backend.ops``), as the contract table's
    ``requires`` does: an op a backend does not declare is not claimed, so not probed."""
    def applies(backend: Backend) -> bool:
        return set(ops) <= set(backend.ops)

    return applies


def _fused_beside_its_ops(backend: Backend) -> bool:
    """A fused hook beside declared quantize and scaled_mm, which ``linear.matches_two_calls`` ties
    it to on every chunk."""
    return fused_linear(backend) and {"quantize", "scaled_mm"} <= set(backend.ops)


def _linear_alone(backend: Backend) -> bool:
    """A backend that declares only some of quantize and scaled_mm: its linear has no two calls to
    be tied to, and the end-to-end bound is what judges it."""
    return not {"quantize", "scaled_mm"} <= set(backend.ops)


@dataclass(frozen=True)
class ProbeCheck:
    """One check of the probe.

    Attributes
    ----------
    name : str
        The conformance contract's name (``op.property``); the probe's ratios and reasons use it.
    op : str
        Whose problem the check takes: ``quantize``, ``scaled_mm`` or ``linear``.
    check : callable
        ``check(backend, problem) -> ratio | None``, the contract's own check function.
    applies : callable
        ``applies(backend) -> bool``: whether the backend is probed with it at all (a fused hook, a
        declaration); a check that applies must run: a decline fails the probe.
    rows : str
        ``"each"``: on the problem of every chunk of rows (the backend at the bucket's own M, on
        every adversarial row); ``"all"``: on one problem of all the rows, the backend called on
        the same chunks (``GivenGemm.call_rows``) and judged once (a GEMM bound's cost is mostly
        its weight term, whatever the rows, so each chunk would pay it again); ``"first"``: on the
        first chunk's only (the end-to-end bound of a linear that ``linear.matches_two_calls``
        ties to the two calls on every chunk, for the same cost reason; the non-finite refusal, a
        property of the call, not of the values).
    """

    name: str
    op: str
    check: Callable
    applies: Callable[[Backend], bool] = _always
    rows: str = "each"

    def __post_init__(self) -> None:
        if self.rows not in ("each", "all", "first"):
            raise ValueError(f"ProbeCheck.rows must be 'each', 'all' or 'first', got {self.rows!r}")


#: The probe's checks, in the order they run (the probe stops at the first violation).
PROBE_CHECKS: tuple[ProbeCheck, ...] = (
    ProbeCheck("quantize.scale", "quantize", check_quantize_scale, _declares("quantize")),
    ProbeCheck("quantize.codes", "quantize", check_quantize_codes, _declares("quantize")),
    ProbeCheck("scaled_mm.bound", "scaled_mm", check_scaled_mm_bound, _declares("scaled_mm"), rows="all"),
    ProbeCheck("linear.matches_two_calls", "linear", check_linear_matches_two_calls,
               _declares("quantize", "scaled_mm")),
    ProbeCheck("linear.bound", "linear", check_linear_bound, _fused_beside_its_ops, rows="first"),
    ProbeCheck("linear.bound", "linear", check_linear_bound, _linear_alone),
    ProbeCheck("linear.non_finite", "linear", check_linear_refuses_non_finite, _declares_rejects_non_finite,
               rows="first"),
)

#: Names the probe's list (which contracts, on which rows): part of the selector's cache key, so a
#: decision a different list admitted is probed again rather than reused.
PROBE_REVISION: str = hashlib.sha1(
    "|".join(f"{c.name}:{c.op}:{c.rows}:{c.check.__name__}" for c in PROBE_CHECKS).encode()).hexdigest()[:8]
