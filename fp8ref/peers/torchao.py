"""torchao's float8 quantizers: the inference path (``Float8Tensor.from_hp``, what
``Float8DynamicActivationFloat8WeightConfig`` runs for activations and weights) and the training
path (``torchao.float8``: ``Float8Linear``'s casts, ``hp_tensor_to_float8_dynamic``).

Inference path.

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

Training path, read from ``torchao/float8/float8_utils.py`` and ``float8_training_tensor.py``
(0.18.0): ``tensor_to_amax`` takes ``max |x|`` in x's dtype (the whole tensor, or ``amax(dim=-1)``
for AXISWISE, the rowwise recipes' activations; weights use dim 0 of ``w.t()``, the same rows);
``amax_to_scale`` divides ``finfo(float8_dtype).max / clamp(amax, min=EPS)`` in *float64*
(``EPS = 1e-12``) and rounds to fp32 -- the correctly rounded fp32 quotient, since fp64 carries more
than 2 * 24 + 2 bits --, a *multiplier* m; ``_ToFloat8ConstrFunc`` computes ``x.to(float32) * m``,
clamps at the format's max and casts; ``Float8TrainingTensor`` stores ``m`` as ``_scale`` and
dequantizes with ``_data / _scale``. Conventions filled in: the fixed floor 1e-12, codes ``x * m``
(``multiply_codes``), the multiplier stored (``multiplier_scale``). Not taken:
``round_scales_to_power_of_2`` (the rowwise recipes' ``exp2(floor(log2(m)))``, not a declared
convention for stored multipliers).
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
_F8 = "torchao.float8.float8_scaling_utils"
#: ``torchao.float8.float8_utils.EPS``: the amax floor of ``amax_to_scale``.
_TRAINING_EPS = 1e-12


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


class TorchAOFloat8Training(Peer):
    name = "torchao-float8-training"
    project = "torchao"
    distribution = "torchao"
    entry = (f"{_F8}.hp_tensor_to_float8_dynamic (TENSORWISE, or AXISWISE with axiswise_dim=-1) -> "
             "Float8TrainingTensor._data, ._scale")
    modules = (_F8,)
    notes = ("m = fp32(fp64(max / max(amax, 1e-12))) stored as _scale (a multiplier); "
             "codes = cast(clamp(x.float() * m)); x ~ codes / m")
    ops = ("quantize",)

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        plain = (scheme.dynamic and scheme.amax_floor > 0 and scheme.scale_dtype == torch.float32
                 and scheme.scale_compute_dtype == torch.float32 and not scheme.pow2_scale
                 and not scheme.subnormal_scales and not scheme.reciprocal_scale)
        if not plain:
            return scheme
        # any positive floor is the source's EPS at another value; the multiplier is what it stores
        return scheme.with_(amax_floor=_TRAINING_EPS, multiply_codes=True, multiplier_scale=True)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in (E4M3FN, E5M2, E4M3FNUZ) or s.qmax != s.format.max:
            return "torchao clamps at torch.finfo(float8_dtype).max"
        if not s.dynamic:
            return "dynamic scales (hp_tensor_to_float8_dynamic)"
        if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
            return "TENSORWISE or AXISWISE (one scale per row) scaling only"
        if s.pow2_scale:
            return "round_scales_to_power_of_2 rounds the multiplier down: not a declared convention"
        if not (s.multiplier_scale and s.multiply_codes and s.amax_floor == _TRAINING_EPS):
            return "stores the multiplier max / max(amax, 1e-12) and quantizes with x * m"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype} (the amax would be taken before the fp32 rounding)"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        row = scheme.granularity is Granularity.ROW
        t = hp_tensor_to_float8_dynamic(
            x, scheme.format.torch_dtype, LinearMMConfig(),
            scaling_granularity=ScalingGranularity.AXISWISE if row else ScalingGranularity.TENSORWISE,
            axiswise_dim=-1 if row else None)
        return self._quantized(t._data, t._scale, scheme)


PEERS = (TorchAOFloat8(), TorchAOFloat8Training())
