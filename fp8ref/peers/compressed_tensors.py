"""compressed-tensors: the quantizer behind vLLM / llm-compressor "-FP8-dynamic" checkpoints.

Read from ``compressed_tensors/quantization/utils/helpers.py`` and ``lifecycle/forward*.py``:
``compute_dynamic_scales_and_zp`` takes min/max in x's dtype (per token of a ``[batch, seq, hidden]``
activation, per tensor, or per 1 x G group), ``calculate_qparams`` divides ``max(|min|, |max|)`` by
448 in x's dtype and replaces a zero scale by the dtype's eps; ``quantize`` computes ``x / scale`` in
x's dtype (a bf16 quotient for bf16 input), clamps at +-448 and casts to E4M3FN.

Conventions filled in for certification (docs/spec.md §3.1): the scale is computed and stored in the
input's dtype, a zero block's scale is that dtype's eps, no amax floor, subnormal scales kept.
Not filled in: ``x / scale`` rounded to bf16 (or fp16) *before* the FP8 rounding -- two roundings,
a defect (docs/findings.md).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import ModelDtypeScalesPeer

__all__ = ["PEERS"]

_HELPERS = "compressed_tensors.quantization.utils.helpers"
_FORWARD = "compressed_tensors.quantization.lifecycle.forward"


class CompressedTensorsFP8(ModelDtypeScalesPeer):
    name = "compressed-tensors-fp8"
    project = "compressed-tensors"
    distribution = "compressed-tensors"
    entry = f"{_HELPERS}.compute_dynamic_scales_and_zp + {_FORWARD}.quantize (FP8 dynamic, float 8-bit)"
    modules = (_HELPERS, _FORWARD)
    notes = "s = max|x|/448 in x's dtype (0 -> eps); codes = cast(clamp(x / s computed in x's dtype))"
    ops = ("quantize",)

    eps_for_zero = True

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "8-bit float args quantize to e4m3fn clamped at 448"
        if not s.dynamic or s.pow2_scale:
            return "dynamic scales, not power-of-two (FP8 args)"
        if s.granularity is Granularity.BLOCK:
            return "dynamic activations: token, tensor or group strategy (no blocks)"
        if s.granularity is Granularity.GROUP and case.K % s.group_size:
            return "group strategy reshapes K into groups: K % group_size must be 0"
        if s != self.conventions(s, case.x_dtype):
            return ("compressed-tensors computes and stores the scale in the input's dtype, with no amax floor, "
                    "eps for a zero block and subnormal scales kept")
        return None

    def _args(self, scheme: QuantScheme):
        from compressed_tensors.quantization import QuantizationArgs

        names = {Granularity.TENSOR: "tensor", Granularity.ROW: "token", Granularity.GROUP: "group"}
        strategy = names[scheme.granularity]
        kw = {"group_size": scheme.group_size} if strategy == "group" else {}
        return QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=True, symmetric=True, **kw)

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        args = self._args(scheme)
        x3 = x[None]  # activations are [batch, seq, hidden]; the token strategy keeps dims 0 and 1
        s, zp = compute_dynamic_scales_and_zp(x3, args, torch.nn.Module())
        q = quantize(x3, s, zp, args, dtype=torch.float8_e4m3fn)
        return self._quantized(q[0], s, scheme)


PEERS = (CompressedTensorsFP8(),)
