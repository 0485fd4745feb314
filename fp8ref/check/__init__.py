"""The checking core: the conformance contracts' checks, below everything that runs them.

A check takes a backend and a problem and returns the worst error/bound ratio it saw, raises
``ContractViolation`` locating the worst element, or raises ``Declined`` (the backend declines
the case, or the problem lies outside the check's premise). Every comparison is
``fp8ref.spec.compare`` and every tolerance comes from ``fp8ref.spec.bounds``. Two layers run
these checks, so "compliant" means one thing everywhere: the conformance driver
(``fp8ref.conformance``: Hypothesis search, sweeps, the contract table, reports) and the
selector's compliance probe (``fp8ref.select``: the list ``probe.PROBE_CHECKS`` on adversarial
inputs at the case's shape).

Its imports flow down: the registry and the spec, nothing above (not Hypothesis, which the
``conformance`` extra installs: the selector runs without it). Inside, from the bottom up:
``values`` (tensor families and static scales), ``problems`` (``QuantizeProblem``,
``GemmProblem``, ``LinearProblem``: readable descriptions), ``given`` (problems on tensors the
caller already holds), ``common`` (outcomes, calls into a backend, the reference cache), the
per-op checks ``quantize``, ``scaled_mm`` and ``linear``, ``loading`` (the loader contracts' checks:
a loader driven through create, load, process and read), and ``probe`` (the probe's list).
"""

from .common import ContractViolation, Declined
from .linear import LinearArgs, LinearCall, backend_linear, check_linear_bound, check_linear_matches_two_calls
from .probe import PROBE_CHECKS, ProbeCheck
from .quantize import check_quantize_codes, check_quantize_scale
from .scaled_mm import check_scaled_mm_bound

__all__ = ["ContractViolation", "Declined", "LinearArgs", "LinearCall", "backend_linear", "check_quantize_scale",
           "check_quantize_codes", "check_scaled_mm_bound", "check_linear_bound", "check_linear_matches_two_calls",
           "PROBE_CHECKS", "ProbeCheck"]
