"""The tolerance checks peer projects use on their FP8 GEMMs, for comparison with fp8ref's bounds.

These constants are *descriptions of other projects' tests* (read from their public sources,
see /work/shared/CONVENTIONS.md, "How peers test"), not tolerances fp8ref uses: fp8ref derives
every bound in ``fp8ref.spec.bounds``. ``docs/mutants.md`` runs the mutant catalogue through each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.quant import Quantized

__all__ = ["PeerCheck", "PEER_CHECKS", "peer_accepts"]


@dataclass(frozen=True)
class PeerCheck:
    """``torch.testing.assert_close``-style check: |y - ref| <= atol + rtol |ref|, with ref the
    fp32 dequantized matmul (as the peers compute it)."""

    name: str
    rtol: float
    atol: float
    where: str


PEER_CHECKS: tuple[PeerCheck, ...] = (
    PeerCheck("vLLM", 0.5, 0.15, "tests/kernels/quantization/test_cutlass_scaled_mm.py"),
    PeerCheck("sgl-kernel", 0.02, 1.0, "sgl-kernel tests/test_fp8_gemm.py"),
    PeerCheck("PyTorch", 7e-2, 7e-2, "test/test_scaled_matmul_cuda.py (bf16 output)"),
)


def peer_reference(a: Quantized, b: Quantized, bias: torch.Tensor | None) -> torch.Tensor:
    """The peers' reference: dequantize both operands to fp32 and multiply in fp32."""
    y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
    return y if bias is None else y + bias.to(torch.float32)


def peer_accepts(check: PeerCheck, y: torch.Tensor, a: Quantized, b: Quantized, bias: torch.Tensor | None) -> bool:
    """Whether the peer's tolerance check passes ``y`` (NaN anywhere fails, as in assert_close).

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.conformance.peers import PEER_CHECKS, peer_accepts
    >>> a, b = fp8ref.quantize(torch.ones(2, 16)), fp8ref.quantize(torch.ones(3, 16))
    >>> peer_accepts(PEER_CHECKS[0], fp8ref.scaled_mm(a, b, out_dtype=torch.float32) * 1.4, a, b, None)
    True
    """
    ref = peer_reference(a, b, bias).to(torch.float64)
    got = y.to(torch.float64)
    if got.shape != ref.shape or bool(torch.isnan(got).any()):
        return False
    return bool(((got - ref).abs() <= check.atol + check.rtol * ref.abs()).all())
