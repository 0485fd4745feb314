"""The MoE backends shipped with fp8ref: the reference and a grouped fp32 path on torch ops.

``torch-grouped`` computes each expert's pairs at once: the spec's quantizer for x and the
intermediate (its codes are the spec's), then per K-segment of constant scales an fp32 GEMM of the
codes (exact products, fp32 accumulation), scaled in fp32 and summed over segments; SiLU-and-mul in
fp32, the router weight in fp32, the top-k sum in fp32 (``index_add_`` into zeros) and one rounding
to the output dtype. Its declaration is ``MoeAccuracy(FP32, fp32 intermediates)``; the contracts
and the selector's probe check it against ``moe_error_bound``.
"""

from __future__ import annotations

import torch

from ..registry import MoeBackend, register_moe_backend
from ..spec.bounds import U_FP32, Accumulation
from ..spec.gemm import k_segments
from ..spec.moe import MoeScheme, MoeWeights, Routing, check_moe_args, gate_up, local_pairs, moe_reference
from ..spec.moe_bounds import REFERENCE_ACCURACY, MoeAccuracy
from ..spec.quant import Quantized, quantize
from ..spec.schemes import Granularity

__all__ = ["ReferenceMoe", "TorchGroupedMoe", "grouped_scaled_mm"]


class ReferenceMoe(MoeBackend):
    """The spec itself (``fp8ref.spec.moe.moe_reference``): always available, always able."""

    name = "reference"
    accuracy = REFERENCE_ACCURACY

    def moe(self, x, weights, routing, scheme, out_dtype=torch.bfloat16):
        return moe_reference(x, weights, routing, scheme, out_dtype)


def _scale_rows(q: Quantized, k: int) -> torch.Tensor:
    """The fp32 scale of every row of ``q`` at column ``k``."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    return q.scale[:, k // c].to(torch.float32).repeat_interleave(r)[:rows]


def grouped_scaled_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """fp32 (a . b^T) (.) scales: per K-segment an fp32 GEMM of the codes, scaled, summed in fp32."""
    a32, b32 = a.data.to(torch.float32), b.data.to(torch.float32)
    y = None
    for k0, k1 in k_segments(a, b):
        part = (a32[:, k0:k1] @ b32[:, k0:k1].T) * torch.outer(_scale_rows(a, k0), _scale_rows(b, k0))
        y = part if y is None else y + part
    return y


class TorchGroupedMoe(MoeBackend):
    """Per-expert grouped fp32 GEMMs on torch ops (see the module docstring)."""

    name = "torch-grouped"
    accuracy = MoeAccuracy(Accumulation.FP32, torch.float32, U_FP32, torch.float32, torch.float32, U_FP32)

    def moe(self, x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        check_moe_args(x, weights, routing, scheme, out_dtype)
        T, K = x.shape
        tokens, slots, experts = local_pairs(routing, weights.num_experts)
        S = tokens.numel()
        y = torch.zeros(T, K, dtype=torch.float32, device=x.device)
        if S == 0:
            return y.to(out_dtype)
        act, inter = scheme.activation, scheme.intermediate
        groups = {int(e): torch.nonzero(experts == e).flatten() for e in torch.unique(experts)}
        qx = quantize(x, act) if act.dynamic else None
        h = torch.empty(S, weights.intermediate_size, dtype=torch.float32, device=x.device)
        for e, pairs in groups.items():
            rows = tokens[pairs]
            if qx is None:
                a = quantize(x[rows], act, weights.a1_scale[e])
            else:
                a = Quantized(qx.data[rows], qx.scale if act.granularity is Granularity.TENSOR else qx.scale[rows],
                              act)
            gate, up = gate_up(grouped_scaled_mm(a, weights.expert(e)[0]), scheme.order)
            h[pairs] = torch.nn.functional.silu(gate) * up
        qh = quantize(h, inter) if inter.dynamic else None
        w = routing.weights.to(torch.float32)
        for e, pairs in groups.items():
            if qh is None:
                a = quantize(h[pairs], inter, weights.a2_scale[e])
            else:
                a = Quantized(qh.data[pairs], qh.scale if inter.granularity is Granularity.TENSOR else qh.scale[pairs],
                              inter)
            o = grouped_scaled_mm(a, weights.expert(e)[1])
            y.index_add_(0, tokens[pairs], o * w[tokens[pairs], slots[pairs]][:, None])
        return y.to(out_dtype)


register_moe_backend(ReferenceMoe())
register_moe_backend(TorchGroupedMoe())
