"""SGLang's Triton FP8 kernels (``sglang`` 0.5.23, installed with ``--no-deps``).

Read from ``sglang/kernels/ops/quantization/fp8_kernel.py`` and ``sglang/kernels/ops/gemm/fp8_kernel.py``:

* ``per_token_group_quant_fp8`` (the Triton path SGLang takes when sgl-kernel is absent):
  ``s = max(amax, eps) / 448`` in fp32; row-major scales quantize with ``x * (1 / s)`` (two fp32
  roundings), column-major scales with ``x / s`` (one); clamp then cast.
* ``static_quant_fp8``: a given per-tensor scale, ``x * (1 / s)``, clamp, cast.
* ``per_tensor_quant_mla_fp8``: ``s = max over rows of max(amax_row, eps) / 448`` (an atomic max of
  per-row quotients, equal to max(amax, eps) / 448 because division by 448 is monotonic), then
  ``x * (1 / s)``.
* ``w8a8_block_fp8_matmul_triton``: per K tile ``acc += dot(a, b) * a_s * b_s`` in fp32, one
  rounding to the output dtype.
* ``triton_scaled_mm``: ``acc = dot(a, b)`` over K in fp32, ``acc * scale_a * scale_b`` in fp32,
  rounded to the output dtype, *then* ``+ bias`` in the output dtype: two roundings when there is a
  bias (vLLM's copy of the kernel adds the bias before the rounding).

Harness needs (docs/certified.md): ``TRITON_INTERPRET=1``; the GEMM module imports
``sglang.srt.layers.deep_gemm_wrapper``, whose import chain needs torchvision (a CUDA-built wheel
for another torch), so a stub that refuses every DeepGEMM call stands in when the real module does
not import; ``get_device_name()`` is None on a CPU, which the GEMM's tuned-config lookup cannot
take, so the module's lookup returns ``"cpu"`` (no tuned config exists for it: the default tiles).
"""

from __future__ import annotations

import sys
import types

import torch

from ..registry import Case
from ..spec.quant import Quantized
from ..spec.schemes import QuantScheme
from ._triton import BlockGemmPeer, GivenScaleQuantPeer, GroupQuantPeer, ScaledMMPeer, reference_tensor_scale

__all__ = ["PEERS"]

_QUANT = "sglang.kernels.ops.quantization.fp8_kernel"
_GEMM = "sglang.kernels.ops.gemm.fp8_kernel"
_DEEP_GEMM = "sglang.srt.layers.deep_gemm_wrapper"


def _stub_deep_gemm() -> None:
    """Install a ``deep_gemm_wrapper`` stand-in if the real one does not import (torchvision)."""
    if _DEEP_GEMM in sys.modules:
        return
    try:
        __import__(_DEEP_GEMM)
        return
    except Exception:
        sys.modules.pop(_DEEP_GEMM, None)
    stub = types.ModuleType(_DEEP_GEMM)
    stub.__doc__ = "fp8ref stand-in: DeepGEMM is CUDA-only; its GEMMs raise."
    stub.ENABLE_JIT_DEEPGEMM = False

    def _refuse(*args, **kwargs):
        raise RuntimeError("DeepGEMM is not available (fp8ref's CPU stand-in for deep_gemm_wrapper)")

    stub.gemm_nt_f8f8bf16 = stub.gemm_nt_mxfp8_f8f8bf16 = _refuse  # what the GEMM module calls
    sys.modules[_DEEP_GEMM] = stub
    import sglang.srt.layers as layers

    layers.deep_gemm_wrapper = stub


def _gemm_module():
    _stub_deep_gemm()
    import importlib

    mod = importlib.import_module(_GEMM)
    if not torch.cuda.is_available():
        mod.get_device_name = lambda *args, **kwargs: "cpu"
    return mod


class _SGLang:
    project = "SGLang"
    distribution = "sglang"


class _SGLangGemm(_SGLang):
    """The GEMM module's peers: the deep_gemm_wrapper stand-in goes in before the first import."""

    def prepare(self) -> str | None:
        reason = super().prepare()
        if reason is None:
            _stub_deep_gemm()
        return reason


class SGLangGroupQuant(_SGLang, GroupQuantPeer):
    name = "sglang-group-quant"
    entry = f"{_QUANT}.per_token_group_quant_fp8 (row-major scales)"
    modules = (_QUANT,)
    notes = "s = max(amax, eps)/448 fp32; codes = cast(clamp(x * (1/s)))"

    def _fn(self):
        from sglang.kernels.ops.quantization.fp8_kernel import per_token_group_quant_fp8

        return per_token_group_quant_fp8


class SGLangGroupQuantColMajor(SGLangGroupQuant):
    name = "sglang-group-quant-colmajor"
    entry = f"{_QUANT}.per_token_group_quant_fp8 (column_major_scales=True)"
    column_major = True
    notes = "s = max(amax, eps)/448 fp32; codes = cast(clamp(x / s))"


class SGLangStaticQuant(_SGLang, GivenScaleQuantPeer):
    name = "sglang-static-quant"
    entry = f"{_QUANT}.static_quant_fp8"
    modules = (_QUANT,)
    notes = "given per-tensor scale s (fp8ref's); codes = cast(clamp(x * (1/s)))"

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from sglang.kernels.ops.quantization.fp8_kernel import static_quant_fp8

        s = reference_tensor_scale(x, scheme) if scale is None else scale.reshape(1).to(torch.float32)
        q, s_out = self.call(static_quant_fp8, x.contiguous(), s.clone())
        return self._quantized(q, s_out, scheme)


class SGLangMLATensorQuant(_SGLang, GroupQuantPeer):
    name = "sglang-mla-tensor-quant"
    entry = f"{_QUANT}.per_tensor_quant_mla_fp8"
    modules = (_QUANT,)
    notes = "s = atomic max of max(amax_row, eps)/448 fp32; codes = cast(clamp(x * (1/s)))"

    def _supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.granularity.value != "tensor":
            return "per-tensor scale only"
        if s.format.name != "e4m3fn" or s.qmax != s.format.max:
            return "e4m3fn clamped at 448 only (the module's fp8 dtype on a CPU)"
        if s.amax_floor <= 0:
            return "eps > 0 (the function's default is 1e-12)"
        if s.scale_dtype != torch.float32 or s.pow2_scale or not s.standard_scale_rule:
            return "plain fp32 scales"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from sglang.kernels.ops.quantization.fp8_kernel import per_tensor_quant_mla_fp8

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        s_out = torch.zeros(1, dtype=torch.float32)  # the caller's buffer, zeroed as SGLang's callers do
        q, s = self.call(per_tensor_quant_mla_fp8, x.contiguous()[None], s_out, eps=scheme.amax_floor)
        return self._quantized(q[0], s, scheme)


class SGLangBlockGemm(_SGLangGemm, BlockGemmPeer):
    name = "sglang-block-gemm"
    entry = f"{_GEMM}.w8a8_block_fp8_matmul_triton"
    modules = (_GEMM,)
    notes = "per K tile acc += dot(a, b) * a_s * b_s (fp32); one rounding to out_dtype"

    def _fn(self):
        return _gemm_module().w8a8_block_fp8_matmul_triton


class SGLangScaledMM(_SGLangGemm, ScaledMMPeer):
    name = "sglang-scaled-mm"
    entry = f"{_GEMM}.triton_scaled_mm"
    modules = (_GEMM,)
    output_roundings = 2  # bias added after the rounding to out_dtype
    notes = "acc = dot(a, b) fp32; (acc * sa * sb) rounded to out_dtype; + bias in out_dtype (second rounding)"

    def _fn(self):
        return _gemm_module().triton_scaled_mm


PEERS = (SGLangGroupQuant(), SGLangGroupQuantColMajor(), SGLangStaticQuant(), SGLangMLATensorQuant(),
         SGLangBlockGemm(), SGLangScaledMM())
