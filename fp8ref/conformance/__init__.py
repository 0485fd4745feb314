"""The conformance suite: certify any FP8 backend against the spec, property by property.

``check(backend)`` runs every contract of ``CONTRACTS`` (quantize, scaled_mm and linear, each
against the reference and the derived bounds of ``fp8ref.spec.bounds``) for the ops the backend
claims -- a deterministic corner sweep, then a Hypothesis search -- and returns a ``Report`` with
the counterexample of each failure, a coverage table and a verdict that is "pass" only when every
claimed contract ran examples. The same machinery
backs ``fp8ref conformance`` (CLI), ``pytest properties`` and the ``fp8ref_certify`` pytest
fixture. See docs/conformance.md.
"""

from . import strategies
from .contracts import CONTRACT_NAMES, CONTRACTS, Contract, ContractViolation, Declined, get_contract
from .driver import ContractResult, Report, apply_known_failures, check, check_contract, load_report, merge_reports
from .probe import PROBE_MAX_BITS, accumulator_bits
from .profiles import ENV_VAR, PROFILES, Profile, get_profile
from .scope import Scope, make_scope
from .sweep import corner_sweep

__all__ = [
    "CONTRACTS",
    "CONTRACT_NAMES",
    "Contract",
    "ContractResult",
    "ContractViolation",
    "Declined",
    "ENV_VAR",
    "PROBE_MAX_BITS",
    "PROFILES",
    "Profile",
    "Report",
    "Scope",
    "accumulator_bits",
    "apply_known_failures",
    "check",
    "check_contract",
    "corner_sweep",
    "get_contract",
    "get_profile",
    "load_report",
    "make_scope",
    "merge_reports",
    "strategies",
]
