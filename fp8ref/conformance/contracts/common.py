"""What every contract shares: the ``Contract`` row of the table, and -- re-exported from the
checking core, ``fp8ref.check.common`` -- the outcomes a check raises (``ContractViolation``,
``Declined``), the calls into a backend, the comparisons and the cache of reference results.
Imports flow down: the checking core, ``profiles`` and ``scope``; the per-op modules and
``calling`` import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from ...check.common import (  # noqa: F401 -- re-exported: the per-op modules and ``calling`` import them here
    ContractViolation,
    Declined,
    backend_threads,
    build_problem,
    cached_reference,
    call_quantize,
    call_scaled_mm,
    check_within,
    copy_quantized,
    first_diff,
    from_backend_layout,
    negate_codes,
    poison_allocator,
    reference_threads,
    require_supported,
    same_bits,
    spec_quantize,
    to_backend_layout,
)
from ..profiles import Profile
from ..scope import Scope

__all__ = ["Contract", "ContractViolation", "Declined", "poison_allocator", "reference_threads", "backend_threads"]


@dataclass(frozen=True)
class Contract:
    """One row of the contract table.

    Attributes
    ----------
    name : str
        ``op.property``, used in reports, test ids and the known-failures ledger.
    op : str
        ``quantize``, ``scaled_mm`` or ``linear``.
    kind : str
        ``exact``, ``bounded``, ``probe`` or ``info``.
    statement : str
        The property, in one sentence.
    bound : str
        What the error is compared with (a function of ``fp8ref.spec.bounds``, or "bit-exact").
    strategy : callable
        ``strategy(profile, scope) -> SearchStrategy`` of problems (None for probes).
    check : callable
        ``check(backend, problem) -> ratio | None`` (probes: ``check(backend) -> ratio``).
    examples : tuple
        Problems pinned as regression examples: run first on every backend, before the sweep.
    sweep : callable or None
        ``sweep(problems) -> problems``: adapts the op's corner sweep to the contract's premise
        (None: the sweep as generated).
    secondary : bool
        An identity or info contract (determinism, symmetry, equivariance, losslessness on the grid,
        the fused linear against two calls, bit exactness, batch invariance): thinned out of the
        sweep for backends that pay per element.
    exhaustive : bool
        Run the sweep's exhaustive items (every bf16/fp16 bit pattern, every bf16 value as a row's
        amax; up to 261k elements each); the other contracts skip them.
    requires : tuple of str
        Ops besides ``op`` the check calls (the fused linear against ``quantize`` and
        ``scaled_mm``): the contract is "not claimed" by a backend that does not declare them all.
    search_examples : int or None
        At most this many search examples, whatever the profile (the calling contracts make many
        calls per example and vary how the backend is called more than the values); None: the
        profile's count.
    """

    name: str
    op: str
    kind: str
    statement: str
    bound: str
    strategy: Callable[[Profile, Scope | None], st.SearchStrategy] | None
    check: Callable
    examples: tuple = ()  #: pinned problems, run before the sweep
    sweep: Callable[[list], list] | None = None
    secondary: bool = False
    requires: tuple[str, ...] = ()
    exhaustive: bool = False
    search_examples: int | None = None

    @property
    def fails_report(self) -> bool:
        return self.kind != "info"
