"""The quantize contracts' checks, re-exported from the checking core (``fp8ref.check.quantize``),
where they live so that the selector's probe runs the same checks (docs/architecture.md). Imports
flow down: the checking core only."""

from __future__ import annotations

from ...check.quantize import (  # noqa: F401 -- re-exported: the contract table and tests name them here
    check_quantize_bit_exact,
    check_quantize_codes,
    check_quantize_deterministic,
    check_quantize_exact_on_pow2_scale,
    check_quantize_lossless,
    check_quantize_scale,
    check_quantize_scale_equivariance,
    check_quantize_sign_symmetry,
)
