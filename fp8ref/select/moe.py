"""The MoE selector: ``fp8ref.moe(..., backend="auto")`` runs the first *compliant* MoE backend.

Kept simple (docs/selection.md, "MoE"): the candidates are the registered MoE backends other
than the reference, in registration order, then the reference, which is always able. A
candidate that is available and supports the scheme runs the MoE compliance probe -- the MoE
contract's own check (``fp8ref.check.moe.check_moe_problem``) on ``probe_specs``' adversarial
items -- and the first that passes is chosen; the verdict is kept in memory per (backend, its
class, scheme, output dtype). A backend that fails the probe is never chosen. There is no timing:
the shipped fast path is the only non-reference candidate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..check.common import ContractViolation, Declined
from ..check.moe import build_problem, check_moe_problem, probe_specs
from ..registry import get_moe_backend, moe_backends
from ..spec.moe import MoeScheme

__all__ = ["select_moe", "probe_moe", "clear_moe_cache"]

_VERDICTS: dict[tuple, str | None] = {}


def clear_moe_cache() -> None:
    """Forget every MoE probe verdict."""
    _VERDICTS.clear()


def probe_moe(name: str, scheme: MoeScheme, out_dtype: torch.dtype) -> str | None:
    """None when MoE backend ``name`` passes the compliance probe for ``scheme``, else why not."""
    b = get_moe_backend(name)
    reason = b.available() or b.supports(scheme, out_dtype)
    if reason:
        return reason
    key = (name, type(b).__module__, type(b).__qualname__, scheme, out_dtype)
    if key not in _VERDICTS:
        verdict = None
        try:
            for spec in probe_specs(scheme):
                check_moe_problem(b, build_problem(spec, scheme, out_dtype))
        except Declined as exc:
            verdict = f"declined a probe item: {exc}"
        except ContractViolation as exc:
            verdict = f"failed the MoE compliance probe: {exc}"
        except Exception as exc:  # a crash on a probe item is a failure, not a selection error
            verdict = f"raised on a probe item: {exc!r}"
        _VERDICTS[key] = verdict
    return _VERDICTS[key]


def select_moe(scheme: MoeScheme, out_dtype: torch.dtype = torch.bfloat16, *,
               candidates: Sequence[str] | None = None) -> tuple[str, dict[str, str]]:
    """(the chosen MoE backend's name, {name: why it was not chosen}) for ``scheme``."""
    names = list(moe_backends() if candidates is None else candidates)
    for n in names:
        get_moe_backend(n)  # an unknown name raises here, listing the known ones
    why_not: dict[str, str] = {}
    for name in [n for n in names if n != "reference"]:
        reason = probe_moe(name, scheme, out_dtype)
        if reason is None:
            return name, why_not
        why_not[name] = reason
    return "reference", why_not
