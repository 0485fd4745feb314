"""The selector's compliance probe, as a list of the contracts' checks: ``PROBE_CHECKS``.

Each entry names the conformance contract whose check it runs (``fp8ref.conformance.contracts``
has a row of that name calling the same function), the op whose problem it takes and which
backends it applies to. The selector (``fp8ref.select.compliance``) builds the problems -- given
tensors (``given``) at the case's shape -- and runs this list; it compares nothing itself. The
list is small because the probe runs inside ``fp8ref.linear(..., backend="auto")``, on one case,
before timing: the activation quantization (scale and codes), the GEMM's bound, the fused linear
against the two calls it fuses, the end-to-end bound where the linear is the backend's own (a
fused hook, or a backend declaring only the ``linear`` op), and the non-finite refusal the
backend may declare; an op a backend does not declare (``Backend.ops``) is not probed, as the
contract table does not claim it. The rest of the contracts (identities, the
calling contract, the accumulator probe, the Hypothesis search) are the certificate's: ``fp8ref
conformance``. Imports flow down: the registry and the per-op checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..registry import Backend
from .linear import check_linear_bound, check_linear_matches_two_calls, check_linear_refuses_non_finite
from .quantize import check_quantize_codes, check_quantize_scale
from .scaled_mm import check_scaled_mm_bound

__all__ = ["ProbeCheck", "PROBE_CHECKS", "fused_linear"]


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


def _linear_is_its_own(backend: Backend) -> bool:
    """The end-to-end bound applies where the quantize and scaled_mm checks do not already judge the
    linear: a fused hook, or a backend that declares only some of the two ops."""
    return fused_linear(backend) or not {"quantize", "scaled_mm"} <= set(backend.ops)


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
    """

    name: str
    op: str
    check: Callable
    applies: Callable[[Backend], bool] = _always


#: The probe's checks, in the order they run (the probe stops at the first violation).
PROBE_CHECKS: tuple[ProbeCheck, ...] = (
    ProbeCheck("quantize.scale", "quantize", check_quantize_scale, _declares("quantize")),
    ProbeCheck("quantize.codes", "quantize", check_quantize_codes, _declares("quantize")),
    ProbeCheck("scaled_mm.bound", "scaled_mm", check_scaled_mm_bound, _declares("scaled_mm")),
    ProbeCheck("linear.matches_two_calls", "linear", check_linear_matches_two_calls,
               _declares("quantize", "scaled_mm")),
    ProbeCheck("linear.bound", "linear", check_linear_bound, _linear_is_its_own),
    ProbeCheck("linear.non_finite", "linear", check_linear_refuses_non_finite, _declares_rejects_non_finite),
)
