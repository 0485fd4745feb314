"""How the driver adapts the contracts to a backend that is not fp8ref's own: ``Adaptation``.

A third-party implementation (a peer, ``fp8ref.peers``) follows legitimate conventions of its own
(docs/spec.md §3.1: a scale computed in the input's dtype, another zero-block scale); its
certificate checks the contracts on problems whose schemes say so, and names its reproduction by
the command that reaches it. Everything else -- the sweep, the search, the statuses, the report --
is the driver's. Imports flow down: the contract table's row type only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .contracts import Contract

__all__ = ["Adaptation", "adapted"]


@dataclass(frozen=True)
class Adaptation:
    """What ``fp8ref.conformance.check`` changes for one backend.

    Attributes
    ----------
    map_problem : callable or None
        ``map_problem(problem) -> problem``: every pinned, swept and drawn problem passes through
        it before the check (a peer's conventions filled into its schemes). None: unchanged.
    reproduce : callable or None
        ``reproduce(profile, seed, contract) -> str``: the command that reproduces a failure (the
        driver appends Hypothesis' ``@reproduce_failure`` blob). None: ``reproduce_line``.
    """

    map_problem: Callable[[Any], Any] | None = None
    reproduce: Callable[[str, int, str], str] | None = None


def adapted(contract: Contract, adapt: Adaptation | None) -> Contract:
    """``contract`` with its drawn, pinned and corner-sweep problems passed through
    ``adapt.map_problem`` (the contract itself when there is nothing to map, or it is a probe)."""
    if adapt is None or adapt.map_problem is None or contract.strategy is None:
        return contract
    fn, strategy, sweep = adapt.map_problem, contract.strategy, contract.sweep

    def mapped_sweep(problems: list) -> list:
        return [fn(p) for p in (sweep(problems) if sweep is not None else problems)]

    return replace(contract, strategy=lambda prof, scope=None: strategy(prof, scope).map(fn),
                   examples=tuple(fn(e) for e in contract.examples), sweep=mapped_sweep)
