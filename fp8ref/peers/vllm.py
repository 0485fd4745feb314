"""vLLM's Triton FP8 kernels (``vllm`` 0.33.0, installed with ``--no-deps``).

Read from ``vllm/model_executor/layers/quantization/utils/fp8_utils.py`` and
``.../compressed_tensors/triton_scaled_mm.py``:

* ``per_token_group_quant_fp8`` (its Triton fallback, taken when the CUDA op is absent):
  ``s = max(amax, eps) * (1 / 448)`` -- a product with the rounded reciprocal, so s can be one fp32
  ulp off max(amax, eps)/448 -- optionally rounded up to a power of two (``use_ue8m0``), then
  ``x / s``, clamp, cast; row- or column-major scales.
* ``w8a8_triton_block_scaled_mm``: per K tile ``acc += dot(a, b) * a_s * b_s`` in fp32, one rounding.
* ``triton_scaled_mm`` (compressed-tensors' W8A8 path): fp32 accumulator, scales and bias applied in
  fp32, one rounding to the output dtype.

The online ``fp8`` path (an unquantized fp16/bf16 checkpoint quantized at load time), read from
``vllm/model_executor/layers/quantization/online/fp8.py``; each ``process_weights_after_loading``
quantizes ``layer.weight`` [N, K] in plain torch:

* ``Fp8PtpcOnlineLinearMethod`` (per-token activations, per-channel weights): ``amax`` per row
  (``aminmax`` in the weight's dtype), ``s = max(amax.float() / 448, 1 / (448 * 512))`` -- the
  same as flooring amax at 1/512, because rounding is monotonic -- then ``x / s`` in fp32, clamp,
  cast; codes stored transposed ([K, N] view), scales [N, 1].
* ``Fp8PerBlockOnlineLinearMethod`` (DeepSeek-style 128 x 128 weight blocks):
  ``deep_gemm.per_block_cast_to_fp8``: the weight zero-padded to whole blocks, ``amax`` per block
  floored at 1e-4, ``s = amax / 448``, codes ``cast(x * (1 / s))`` (the rounded reciprocal: two
  roundings, no clamp -- torch's cast saturates).
* ``Fp8PerTensorOnlineLinearMethod`` quantizes with ``ops.scaled_fp8_quant``, a CUDA custom op
  (``vllm._C``): not run here.

The activation side of those paths, ``QuantFP8.forward_native``
(``vllm/model_executor/layers/quantization/input_quant_fp8.py``: the plain-torch implementation vLLM
runs where its CUDA op is absent and under ``torch.compile``): dynamic per-token or per-tensor
``s = max(amax.float() / 448, 1 / (448 * 512))``, codes ``cast(clamp(x.float() * s.reciprocal()))``
(two roundings); per 1 x G group ``x / s`` (one rounding), optionally ``s = 2**ceil(log2 s)``
(``use_ue8m0``). Its constructor (a ``CustomOp``) needs a ``VllmConfig``: the adapter makes the
module without it and sets the attributes the constructor sets from its arguments.

The methods' constructors and ``create_weights`` read the current ``VllmConfig`` and pick a GEMM
kernel for the device, neither of which exists on a CPU (``VllmConfig()`` raises "Failed to infer
device type"); the adapter makes the method object without its constructor, sets the attributes
``process_weights_after_loading`` reads (no requantization source) and a kernel stand-in whose own
weight post-processing (CUDA layouts) does nothing, and calls the method's
``process_weights_after_loading`` on a layer holding the weight, unsharded (``tp_size`` 1).

Harness needs: ``TRITON_INTERPRET=1`` and, on a machine without CUDA, ``CUDA_VISIBLE_DEVICES=""``
before vLLM is imported (else ``vllm.triton_utils`` finds no active Triton driver and swaps Triton
for a placeholder); vLLM's own distributed start-up sets the same value. The GEMM's tuned-config
lookup calls ``current_platform.get_device_name()``, which raises on vLLM's CPU-less "unspecified"
platform, so it is answered with ``"cpu"`` (no tuned file exists: the default tiles).
"""

from __future__ import annotations

import os
import sys

import torch

from ..registry import Case
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import FixedAmaxFloor, Peer
from ._triton import BlockGemmPeer, GroupQuantPeer, ScaledMMPeer

__all__ = ["PEERS"]

_FP8_UTILS = "vllm.model_executor.layers.quantization.utils.fp8_utils"
_CT_MM = "vllm.model_executor.layers.quantization.compressed_tensors.triton_scaled_mm"
_ONLINE = "vllm.model_executor.layers.quantization.online.fp8"
_QUANT_FP8 = "vllm.model_executor.layers.quantization.input_quant_fp8"


class _VLLM:
    project = "vLLM"
    distribution = "vllm"

    def prepare(self) -> str | None:
        reason = super().prepare()
        if reason is not None:
            return reason
        if not torch.cuda.is_available() and "vllm" not in sys.modules:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        if "vllm.triton_utils" in sys.modules or "vllm" in sys.modules:
            from vllm.triton_utils import HAS_TRITON

            if not HAS_TRITON:
                return ("vllm was imported before CUDA_VISIBLE_DEVICES was set, and disabled Triton "
                        "(set CUDA_VISIBLE_DEVICES='' before importing vllm on a CPU-only machine)")
        return None


def _patch_device_name() -> None:
    if torch.cuda.is_available():
        return
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not getattr(cls, "_fp8ref_cpu_name", False):
        cls.get_device_name = classmethod(lambda c, device_id=0: "cpu")
        cls._fp8ref_cpu_name = True


class VLLMGroupQuant(_VLLM, GroupQuantPeer):
    name = "vllm-group-quant"
    entry = f"{_FP8_UTILS}.per_token_group_quant_fp8 (Triton fallback, row-major scales)"
    modules = (_FP8_UTILS,)
    pow2 = True
    notes = "s = max(amax, eps) * (1/448) fp32 [ue8m0: 2**ceil(log2 s)]; codes = cast(clamp(x / s))"

    def _fn(self):
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        return per_token_group_quant_fp8

    def _kwargs(self, scheme: QuantScheme) -> dict:
        return {"use_ue8m0": scheme.pow2_scale}


class VLLMGroupQuantColMajor(VLLMGroupQuant):
    name = "vllm-group-quant-colmajor"
    entry = f"{_FP8_UTILS}.per_token_group_quant_fp8 (Triton fallback, column_major_scales=True)"
    column_major = True


class VLLMBlockGemm(_VLLM, BlockGemmPeer):
    name = "vllm-block-gemm"
    entry = f"{_FP8_UTILS}.w8a8_triton_block_scaled_mm"
    modules = (_FP8_UTILS,)
    notes = "per K tile acc += dot(a, b) * a_s * b_s (fp32); one rounding to out_dtype"

    def _fn(self):
        from vllm.model_executor.layers.quantization.utils.fp8_utils import w8a8_triton_block_scaled_mm

        _patch_device_name()
        return w8a8_triton_block_scaled_mm


class VLLMScaledMM(_VLLM, ScaledMMPeer):
    name = "vllm-ct-scaled-mm"
    entry = f"{_CT_MM}.triton_scaled_mm"
    modules = (_CT_MM,)
    output_roundings = 1
    notes = "acc = dot(a, b) fp32; acc * sa * sb + bias in fp32; one rounding to out_dtype"

    def _fn(self):
        from vllm.model_executor.layers.quantization.compressed_tensors.triton_scaled_mm import triton_scaled_mm

        return triton_scaled_mm

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        # vLLM adds the bias to the fp32 accumulator: pass it in its own dtype (no rounding here).
        sa, sb = a.scale.reshape(-1, 1).contiguous(), b.scale.reshape(-1, 1).contiguous()
        return self.call(self._fn(), a.data.contiguous(), b.data.t(), sa, sb, out_dtype, bias)


class _NoKernel:
    """Stands in for the GEMM kernel the method picks in ``create_weights`` (none on a CPU): its
    weight post-processing (CUDA layouts) does nothing and it pre-quantizes no input."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def input_quant_key(self):
        return None


class _VLLMOnline(_VLLM, FixedAmaxFloor, Peer):
    """``<method>.process_weights_after_loading`` on a layer holding ``x`` as its weight [N, K]."""

    ops = ("quantize",)
    method = ""
    #: what the method's constructor sets besides the kernel choice (copied from its source)
    constructor_attrs: dict = {}

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "e4m3fn clamped at 448 only (current_platform.fp8_dtype() off ROCm)"
        if not s.dynamic:
            return "the weight's scale is computed at load time (dynamic)"
        if s.granularity is not self.granularity or (s.granularity is Granularity.BLOCK and s.block != (128, 128)):
            return f"this method quantizes per {self.granularity.value}" + (
                " 128 x 128" if self.granularity is Granularity.BLOCK else "")
        return self._load_time_reason(s, case)

    def _process(self, x: torch.Tensor) -> torch.nn.Module:
        import importlib

        cls = getattr(importlib.import_module(_ONLINE), self.method)
        method = cls.__new__(cls)  # the constructor needs a VllmConfig (none on a CPU)
        method.requantization_source = None
        method.requantization_source_parameters = {}
        method.fp8_linear = _NoKernel()
        for k, v in self.constructor_attrs.items():
            setattr(method, k, list(v))
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(x.clone(), requires_grad=False)
        layer.tp_size = 1
        method.process_weights_after_loading(layer)
        return layer


class VLLMOnlinePtpc(_VLLMOnline):
    name = "vllm-online-fp8-ptpc"
    method = "Fp8PtpcOnlineLinearMethod"
    entry = f"{_ONLINE}.{method}.process_weights_after_loading (fp16/bf16 checkpoint)"
    modules = (_ONLINE,)
    notes = "s = max(amax/448, 1/(448*512)) fp32 per row; codes = cast(clamp(x / s)) in fp32"
    granularity = Granularity.ROW
    eps = 1.0 / 512

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: the weight's scale is computed at load time")
        layer = self._process(x.contiguous())
        return self._quantized(layer.weight.data.t(), layer.weight_scale.data, scheme)


class VLLMOnlineBlock(_VLLMOnline):
    name = "vllm-online-fp8-block"
    method = "Fp8PerBlockOnlineLinearMethod"
    entry = f"{_ONLINE}.{method}.process_weights_after_loading (fp16/bf16 checkpoint; per_block_cast_to_fp8)"
    modules = (_ONLINE,)
    notes = "s = max(amax, 1e-4)/448 fp32 per 128 x 128 block (zero-padded); codes = cast(x * (1/s))"
    granularity = Granularity.BLOCK
    eps = 1e-4
    constructor_attrs = {"weight_block_size": (128, 128)}

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: the weight's scale is computed at load time")
        layer = self._process(x.contiguous())
        return self._quantized(layer.weight.data, layer.weight_scale_inv.data, scheme)


class VLLMQuantFP8Native(_VLLM, Peer):
    name = "vllm-quantfp8-native"
    entry = f"{_QUANT_FP8}.QuantFP8.forward_native (dynamic; per token, per tensor or 1 x G groups)"
    modules = (_QUANT_FP8,)
    notes = ("s = max(amax/448, 1/(448*512)) fp32 [groups, ue8m0: 2**ceil(log2 s)]; codes = cast(clamp(x.float() * "
             "(1/s))) per token/tensor, cast(clamp(x / s)) per group")
    ops = ("quantize",)
    eps = 1.0 / 512

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        # the floor is fixed in the source (_FP8_MIN_SCALING_FACTOR); any positive floor maps to it
        s = scheme.with_(amax_floor=self.eps) if scheme.amax_floor > 0 else scheme
        if s.dynamic and s.granularity in (Granularity.TENSOR, Granularity.ROW) and s.standard_scale_rule:
            return s.with_(multiply_codes=True)  # per token / tensor: x.float() * scale.reciprocal()
        return s

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "e4m3fn clamped at 448 only (current_platform.fp8_dtype() off ROCm)"
        if not s.dynamic:
            return "dynamic scales (a static scale is the caller's)"
        if s.granularity not in (Granularity.TENSOR, Granularity.ROW, Granularity.GROUP):
            return f"per token, per tensor or 1 x G groups, not {s.granularity.value}"
        if s.amax_floor != self.eps:
            return f"the source's floor is amax >= {self.eps:g}"
        if s.multiply_codes != (s.granularity is not Granularity.GROUP):
            return "codes x * (1/s) per token and per tensor (multiply_codes), x / s per group"
        if s.scale_dtype != torch.float32 or not s.with_(multiply_codes=False).standard_scale_rule:
            return "plain fp32 scales"
        if s.pow2_scale and s.granularity is not Granularity.GROUP:
            return "ue8m0 scales on the group path only"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        g = scheme.granularity
        shape = {Granularity.TENSOR: GroupShape.PER_TENSOR, Granularity.ROW: GroupShape.PER_TOKEN}.get(g)
        if shape is None:
            shape = GroupShape(1, scheme.group_size)
        op = QuantFP8.__new__(QuantFP8)  # a CustomOp: its constructor needs a VllmConfig (none on a CPU)
        torch.nn.Module.__init__(op)
        # what QuantFP8.__init__ sets from (static=False, group_shape, use_ue8m0)
        op.static, op.group_shape, op.num_token_padding = False, shape, None
        op.column_major_scales = op.tma_aligned_scales = False
        op.use_ue8m0 = scheme.pow2_scale
        op.use_per_token_if_dynamic = shape == GroupShape.PER_TOKEN
        op.is_group_quant = shape.is_per_group()
        if op.is_group_quant:
            op.group_size = shape.col
        q, s = op.forward_native(x.contiguous())
        return self._quantized(q, s, scheme)


PEERS = (VLLMGroupQuant(), VLLMGroupQuantColMajor(), VLLMBlockGemm(), VLLMScaledMM(), VLLMOnlinePtpc(),
         VLLMOnlineBlock(), VLLMQuantFP8Native())
