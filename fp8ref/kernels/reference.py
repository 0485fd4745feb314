"""The ``reference`` backend: the spec itself. Exact, always available, slow."""

from __future__ import annotations

import torch

from ..registry import SPEC_NON_FINITE, Backend, register_backend
from ..spec import gemm, quant
from ..spec.bounds import Accumulation
from ._common import ieee_methods


@ieee_methods
class ReferenceBackend(Backend):
    name = "reference"
    accumulation = Accumulation.EXACT
    output_roundings = 1
    rejects_non_finite = True  # the spec's checks: x via the quantizer, bias via check_mm_args
    non_finite = SPEC_NON_FINITE

    def quantize(self, x, scheme, scale=None):
        return quant.quantize(x, scheme, scale)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return gemm.scaled_mm(a, b, bias, out_dtype)


register_backend(ReferenceBackend())
