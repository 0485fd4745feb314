"""torchao's float8 quantizer: the scale choice and cast behind ``Float8Tensor.from_hp`` (what
``Float8DynamicActivationFloat8WeightConfig`` runs for activations and weights).

Read from ``torchao/quantization/quant_primitives.py``: ``_choose_scale_float8(x, block_size,
float8_dtype, hp_value_lb=...)`` takes ``amax`` over each block *in x's dtype*, clamps it at
``hp_value_lb`` when given (the config's ``activation_value_lb``, None by default), divides by the
format's max in x's dtype (a bf16 scale for bf16 input) and returns it as fp32; with an E8M0 scale
dtype it rounds ``log2(scale)`` to the *nearest* integer. ``_quantize_affine_float8`` divides the fp32
input by the fp32 scale, clamps at the format's max and casts. Block sizes: the whole tensor
(PerTensor), ``[1, K]`` (PerRow), ``[1, G]`` or ``[R, C]`` (blocks must divide the shape).

Conventions filled in for certification (docs/spec.md §3.1): the scale is computed in the input's
dtype (``scale_compute_dtype``) and kept when it is subnormal (``subnormal_scales``). Not filled in,
because they are defects: an all-zero block with no ``hp_value_lb`` gets scale 0 and NaN codes
(pytorch/ao#4713); power-of-two scales rounded to the nearest power (values up to sqrt(2) * qmax
are clamped).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E4M3FNUZ, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer

__all__ = ["PEERS"]

_QP = "torchao.quantization.quant_primitives"


def _block_size(scheme: QuantScheme, rows: int, cols: int) -> list[int]:
    g = scheme.granularity
    if g is Granularity.TENSOR:
        return [rows, cols]
    if g is Granularity.ROW:
        return [1, cols]
    if g is Granularity.GROUP:
        return [1, scheme.group_size]
    return list(scheme.block)


class TorchAOFloat8(Peer):
    name = "torchao-float8"
    project = "torchao"
    distribution = "torchao"
    entry = f"{_QP}._choose_scale_float8 + _quantize_affine_float8 (Float8Tensor.from_hp)"
    modules = (_QP,)
    notes = "s = amax/max in x's dtype, stored fp32 (E8M0: 2**round(log2 s)); codes = cast(clamp(x.float() / s))"
    ops = ("quantize",)

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        if scheme.scale_dtype != torch.float32:
            return scheme
        dt = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32
        return scheme.with_(scale_compute_dtype=dt, subnormal_scales=True)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in (E4M3FN, E5M2, E4M3FNUZ) or s.qmax != s.format.max:
            return "torchao clamps at torch.finfo(float8_dtype).max"
        if not s.dynamic:
            return "dynamic scales only (Float8Tensor.from_hp)"
        if s.scale_dtype != torch.float32:
            return "torchao stores fp32 scales"
        want = case.x_dtype if case.x_dtype in (torch.bfloat16, torch.float16) else torch.float32
        if s.scale_compute_dtype != want:
            return f"torchao computes the scale in the input's dtype ({want}), not {s.scale_compute_dtype}"
        if s.zero_scale != 1.0 or not s.subnormal_scales:
            return "torchao keeps subnormal scales and has no zero-block rule of its own"
        if s.amax_floor and s.pow2_scale:
            return "hp_value_lb and E8M0 scales together are not a torchao configuration"
        r, c = s.block_shape(case.M, case.K)
        if s.granularity in (Granularity.GROUP, Granularity.BLOCK) and (case.M % r or case.K % c):
            return f"block {r} x {c} must divide [{case.M}, {case.K}] (torchao reshapes by it)"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        rows, cols = x.shape
        fp8 = scheme.format.torch_dtype
        kwargs = {"hp_value_lb": scheme.amax_floor} if scheme.amax_floor > 0 else {}
        if scheme.pow2_scale:
            kwargs["scale_dtype"] = torch.float8_e8m0fnu
        s = _choose_scale_float8(x, _block_size(scheme, rows, cols), fp8, **kwargs)
        q = _quantize_affine_float8(x, s, fp8)
        return self._quantized(q, s, scheme)


PEERS = (TorchAOFloat8(),)
