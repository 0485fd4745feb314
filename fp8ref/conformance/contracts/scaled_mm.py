"""The scaled_mm contracts' checks. The per-problem checks (the bound, finiteness, every output
written, determinism, sign symmetry, scale equivariance, batch invariance) live in the checking
core, ``fp8ref.check.scaled_mm``, and are re-exported here; the accumulator probe against the
declaration stays here, beside the crafted measurement it runs (``..probe``). Imports flow down:
the checking core, the registry and ``..probe``."""

from __future__ import annotations

import math

from ...check.scaled_mm import (  # noqa: F401 -- re-exported: the contract table and tests name them here
    check_scaled_mm_all_written,
    check_scaled_mm_batch_invariant,
    check_scaled_mm_bound,
    check_scaled_mm_deterministic,
    check_scaled_mm_finite,
    check_scaled_mm_scale_equivariance,
    check_scaled_mm_sign_symmetry,
)
from ...registry import Backend
from .common import ContractViolation, Declined, backend_threads


def declared_bits(backend: Backend) -> float:
    """Bits of accumulator precision the backend's declaration promises: -log2(u_acc) (inf if exact)."""
    u = backend.accumulation.unit_roundoff
    return math.inf if u == 0 else -math.log2(u)


def check_accumulator_bits(backend: Backend) -> float:
    from ..probe import PROBE_MAX_BITS, accumulator_bits

    with backend_threads():
        bits = accumulator_bits(backend)
    if bits is None:
        raise Declined("the backend declines every probe case")
    want = min(declared_bits(backend), PROBE_MAX_BITS)
    if bits < want:
        hint = (" (even 2**16 + 2**16 - 2**16 came out wrong: products are dropped or misscaled, not rounded)"
                if bits < 1 else "")
        raise ContractViolation(f"accumulator keeps {bits} bits but the backend declares "
                                f"{backend.accumulation.name} accumulation (>= {want:g} bits){hint}")
    return None
