"""The conformance suite: certify any FP8 backend against the spec, property by property.

``check(backend)`` runs every contract of ``CONTRACTS`` (quantize, scaled_mm and linear, each
against the reference and the derived bounds of ``fp8ref.spec.bounds``) for the ops the backend
claims -- a deterministic corner sweep, then a Hypothesis search, every comparison through
``fp8ref.spec.compare`` -- and returns a ``Report`` with
the counterexample of each failure, a coverage table and a verdict that is "pass" only when every
claimed contract ran examples. The same machinery
backs ``fp8ref conformance`` (CLI), ``pytest properties`` and the ``fp8ref_certify`` pytest
fixture. See docs/conformance.md.

What lives where, from the bottom up: ``profiles`` (budgets, boundary sizes), ``scope`` (what a
certificate claims), ``values`` (float values, FP8 codes and static scales by family) and
``problems`` (problem descriptions built from them, and their machine-readable form: both the
checking core's, ``fp8ref.check``, re-exported), ``replay`` (a
counterexample's exact tensors, reference and bound, as a standalone script), ``strategies``
(Hypothesis strategies of problems), ``sweep`` (the corner sweep), ``probe``
(``accumulator_bits``), ``contracts/`` (the table, one module of checks per op: the quantize,
scaled_mm and linear checks are the checking core's, ``fp8ref.check``, which the selector's probe
runs too; the calling contract and the accumulator probe live here), ``coverage`` and
``report`` (what a report holds and how it prints), ``adaptation`` (how a peer's conventions and
reproduce command reach the driver), ``loading`` (the loader contracts and ``check_loader``: how
a serving stack loads a fused, sharded weight), ``reproduce`` (how a report names a backend and the call that
reproduces a failure), ``driver`` (``check``, ``check_contract``), ``peers`` (the peers'
tolerances, for docs/mutants.md). Imports flow one way, down that list: each module imports only
the ones before it, the checking core, the spec and the registry (``fp8ref.kernels`` only lazily,
for ``fp8ref.linear``); nothing here imports the CLI, the selector or ``fp8ref.peers``, which import
this package.
"""

from . import strategies
from .contracts import CONTRACT_NAMES, CONTRACTS, Contract, ContractViolation, Declined, get_contract
from .driver import (
    ContractResult,
    Report,
    apply_known_failures,
    check,
    check_contract,
    load_backend,
    load_report,
    merge_reports,
)
from .loading import LOAD_CONTRACT_NAMES, LOAD_CONTRACTS, check_loader
from .probe import PROBE_MAX_BITS, accumulator_bits
from .profiles import ENV_VAR, PROFILES, Profile, get_profile
from .replay import Replay, replay
from .scope import Scope, make_scope
from .sweep import corner_sweep

__all__ = [
    "CONTRACTS",
    "CONTRACT_NAMES",
    "Contract",
    "LOAD_CONTRACTS",
    "LOAD_CONTRACT_NAMES",
    "ContractResult",
    "ContractViolation",
    "Declined",
    "ENV_VAR",
    "PROBE_MAX_BITS",
    "PROFILES",
    "Profile",
    "Replay",
    "Report",
    "Scope",
    "accumulator_bits",
    "apply_known_failures",
    "check",
    "check_contract",
    "check_loader",
    "corner_sweep",
    "get_contract",
    "get_profile",
    "load_backend",
    "load_report",
    "make_scope",
    "merge_reports",
    "replay",
    "strategies",
]
