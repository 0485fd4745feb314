"""NVIDIA Model Optimizer (``nvidia-modelopt``): the FP8 fake quantizer behind its FP8 PTQ recipes.

Read from ``modelopt/torch/quantization/tensor_quant.py``: on a CPU ``scaled_e4m3`` runs
``_fp8_eager(x, amax)``: ``amax`` in fp32; ``amax <= 2**-24`` counts as 1; multiplier
``m = 448 / amax`` and ``scale_inv = 1 / m`` in fp32; ``q = cast(clamp(x.float() * m))``; the output
is ``(q * scale_inv).to(x.dtype)`` (quantize-dequantize). TensorRT-LLM exports ``scale_inv`` as the
checkpoint's dequantization scale.

Adapter: amax per tensor or per row (what the max calibrator computes), passed as modelopt's
``amax``; the codes are recovered from the fake-quantized output as ``cast(out.float() * m)`` --
exact, because q has 4 significant bits and the output keeps at least 8 (bf16, fp32; fp16 input is
declined: its subnormal range would drop bits of small outputs); the dequantization scale is
modelopt's ``scale_inv``.
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer

__all__ = ["PEERS"]

_TQ = "modelopt.torch.quantization.tensor_quant"


class ModelOptFP8(Peer):
    name = "modelopt-fp8"
    project = "NVIDIA Model Optimizer"
    distribution = "nvidia-modelopt"
    entry = f"{_TQ}.scaled_e4m3 (CPU: _fp8_eager), amax per tensor or per row"
    modules = (_TQ,)
    notes = ("amax <= 2**-24 -> 1; m = 448/amax, s = 1/m (fp32); codes = cast(clamp(x.float() * m)); "
             "out = q*s in x's dtype")
    ops = ("quantize",)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max or s.pow2_scale:
            return "E4M3 clamped at 448, plain scales"
        if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
            return "amax per tensor or per channel"
        if case.x_dtype == torch.float16:
            return "codes cannot be recovered exactly from an fp16 fake-quantized output (fp16 subnormals)"
        if not s.dynamic or s.scale_dtype != torch.float32 or not s.standard_scale_rule:
            return "fp32 dequantization scale 1/(448/amax)"
        if s.amax_floor != 0.0:
            return "no amax floor (amax <= 2**-24 is treated as 1)"
        return None

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        return scheme.with_(amax_floor=0.0) if scheme.format == E4M3FN and not scheme.pow2_scale else scheme

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from modelopt.torch.quantization.tensor_quant import scaled_e4m3

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        if scheme.granularity is Granularity.TENSOR:
            amax = x.abs().amax().to(torch.float32)
        else:
            amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
        out = scaled_e4m3(x, amax, None, 4, 3)
        a32 = torch.where(amax <= 2.0**-24, torch.ones_like(amax), amax)  # modelopt's own rule, for m
        m = 448.0 / a32
        codes = (out.to(torch.float32) * m).to(torch.float8_e4m3fn)
        return self._quantized(codes, (1 / m).reshape(scheme.scale_shape(*x.shape)), scheme)


PEERS = (ModelOptFP8(),)
