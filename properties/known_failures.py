"""The known-failures ledger, which lives in the package (``fp8ref.conformance.known_failures``):
the CLI reads it from there; this module keeps ``properties/`` and the tests that load a ledger by
path working."""

from fp8ref.conformance.known_failures import KNOWN_FAILURES, known_failure, xfail

__all__ = ["KNOWN_FAILURES", "known_failure", "xfail"]
