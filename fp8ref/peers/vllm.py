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

from ..spec.quant import Quantized
from ..spec.schemes import QuantScheme
from ._triton import BlockGemmPeer, GroupQuantPeer, ScaledMMPeer

__all__ = ["PEERS"]

_FP8_UTILS = "vllm.model_executor.layers.quantization.utils.fp8_utils"
_CT_MM = "vllm.model_executor.layers.quantization.compressed_tensors.triton_scaled_mm"


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


PEERS = (VLLMGroupQuant(), VLLMGroupQuantColMajor(), VLLMBlockGemm(), VLLMScaledMM())
