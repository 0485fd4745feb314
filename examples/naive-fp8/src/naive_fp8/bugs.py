"""Planted bugs: the mistakes the walk-through shows fp8ref catching (docs/writing-a-backend.md).

Each class is ``NaiveFp8Backend`` with one bug. None is registered; certify one with
``fp8ref.conformance.check(NoAmaxFloor())``. ``CAUGHT_BY`` names the contract that rejects each.
"""

from __future__ import annotations

import torch

from fp8ref import Quantized

from .backend import NaiveFp8Backend


class NoAmaxFloor(NaiveFp8Backend):
    """scale = amax / qmax with no floor and no zero_scale: an all-zero row gives 0 / 0 = NaN codes."""

    name = "naive-fp8-no-amax-floor"

    def quantize(self, x, scheme, scale=None):
        x32 = x.float()
        amax = x32.abs().amax(dim=1, keepdim=True) if scheme.granularity.value == "row" \
            else x32.abs().amax().reshape(1, 1)
        s = amax / scheme.qmax
        codes = (x32 / s).clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
        return Quantized(codes, s, scheme)


class ForgottenWeightScale(NaiveFp8Backend):
    """The GEMM applies the activation scale and forgets the weight's."""

    name = "naive-fp8-forgotten-weight-scale"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = (a.data.float() @ b.data.float().T) * a.scale.float().reshape(-1, 1)
        return (y if bias is None else y + bias.float()).to(out_dtype)


class Bf16RunningSum(NaiveFp8Backend):
    """Accumulates along K in bf16 (8 significant bits) while declaring an fp32 accumulator."""

    name = "naive-fp8-bf16-running-sum"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        av, bv = a.data.float(), b.data.float()
        acc = torch.zeros(av.shape[0], bv.shape[0], dtype=torch.bfloat16)
        for k in range(av.shape[1]):
            acc = (acc.float() + av[:, k:k + 1] * bv[:, k]).to(torch.bfloat16)
        y = acc.float() * a.scale.float().reshape(-1, 1) * b.scale.float().reshape(1, -1)
        return (y if bias is None else y + bias.float()).to(out_dtype)


#: The contract that catches each planted bug (the CI test of the example checks this).
CAUGHT_BY = {
    NoAmaxFloor: "quantize.codes",
    ForgottenWeightScale: "scaled_mm.bound",
    Bf16RunningSum: "scaled_mm.bound",
}
