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

The seed's own path, ``--quantization w8a8_fp8`` on an unquantized (fp16/bf16) checkpoint, read from
``sglang/srt/layers/quantization/w8a8_fp8.py``: ``W8A8Fp8LinearMethod.process_weights_after_loading``
quantizes ``layer.weight`` [N, K] once at load time and stores the codes transposed ([K, N] view):

* without CUTLASS (``cutlass_fp8_supported()`` is False on every non-CUDA device, and on CUDA
  before SM89): ``fp8_utils.input_to_float8`` -- ``amax = max(|min|, |max|)`` in the weight's
  dtype, then fp32, floored at 1e-12; ``m = 448 / amax`` (fp32); codes ``cast(clamp(x.float() * m))``;
  the stored scale is ``m.reciprocal()`` = ``1 / (448 / amax)``, within one ulp of ``amax / 448``;
* with CUTLASS (SM89+ with CUDA 12.4, SM90+ with 12.0): ``per_token_group_quant_fp8(weight, K)``,
  one group per output channel (eps 1e-10), its [N, 1] scales stored transposed as [1, N].

The adapter builds the layer the method expects (a module holding ``weight``) and calls the method
itself; the CUTLASS variant sets the method's ``cutlass_fp8_supported`` attribute, which the
method's constructor fills from the device. Importing ``w8a8_fp8`` pulls in SGLang's model configs,
two of which import torchvision at module level (image preprocessing for vision models); a
torchvision built for this torch is not on PyPI, so when ``import torchvision`` fails a stand-in
whose every attribute refuses to be called goes in first (transformers is asked beforehand, so it
keeps reporting torchvision as absent).

Harness needs (docs/certified.md): ``TRITON_INTERPRET=1``; the GEMM module imports
``sglang.srt.layers.deep_gemm_wrapper``, whose import chain needs torchvision (a CUDA-built wheel
for another torch), so a stub that refuses every DeepGEMM call stands in when the real module does
not import; ``get_device_name()`` is None on a CPU, which the GEMM's tuned-config lookup cannot
take, so the module's lookup returns ``"cpu"`` (no tuned config exists for it: the default tiles).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

from ..registry import Case
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import FixedAmaxFloor, Peer, plain_fp32_scales
from ._triton import (
    BlockGemmPeer,
    GivenScaleQuantPeer,
    GroupQuantPeer,
    ScaledMMPeer,
    TritonPeer,
    reference_tensor_scale,
)

__all__ = ["PEERS"]

_QUANT = "sglang.kernels.ops.quantization.fp8_kernel"
_GEMM = "sglang.kernels.ops.gemm.fp8_kernel"
_DEEP_GEMM = "sglang.srt.layers.deep_gemm_wrapper"
_W8A8 = "sglang.srt.layers.quantization.w8a8_fp8"
_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _Refused:
    """An attribute of the torchvision stand-in: any further attribute is another one; calling raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refused(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not available (fp8ref's stand-in for SGLang's imports)")


class _RefusingModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refused(f"{self.__name__}.{name}")


def _stub_torchvision() -> None:
    """Install a torchvision stand-in if the real one does not import (no CPU build for this torch).

    SGLang's model-config package imports ``torchvision.transforms`` for vision preprocessing that
    FP8 weight quantization never runs. transformers is asked first (it caches the answer), so it
    keeps treating torchvision as absent instead of reaching into the stand-in.
    """
    if "torchvision" in sys.modules:
        return
    try:
        __import__("torchvision")
        return
    except Exception:
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                sys.modules.pop(name)
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # transformers absent or laid out differently: nothing cached to protect
        pass
    for name in _TORCHVISION:
        mod = _RefusingModule(name)
        mod.__doc__ = "fp8ref stand-in: torchvision does not import here; every attribute refuses to be called."
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        sys.modules[name] = mod


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
        if not s.dynamic:
            return "dynamic scales only (the kernel computes its scale)"
        if s.format.name != "e4m3fn" or s.qmax != s.format.max:
            return "e4m3fn clamped at 448 only (the module's fp8 dtype on a CPU)"
        if s.amax_floor <= 0:
            return "eps > 0 (the function's default is 1e-12)"
        return plain_fp32_scales(s)

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


class _OnlineW8A8(FixedAmaxFloor):
    """SGLang's online weight quantization: ``W8A8Fp8LinearMethod.process_weights_after_loading`` on
    a layer holding the unquantized weight (``x`` plays the weight [N, K])."""

    ops = ("quantize",)
    cutlass = False

    def prepare(self) -> str | None:
        reason = super().prepare()
        if reason is None:
            _stub_torchvision()
        return reason

    def _supports(self, case: Case, s: QuantScheme | None = None) -> str | None:
        s = self._case_scheme(case) if s is None else s
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "e4m3fn clamped at 448 only (fp8_dtype on a non-ROCm device)"
        if not s.dynamic:
            return "the weight's scale is computed at load time (dynamic)"
        if s.granularity is not self.granularity:
            return f"this path quantizes per {self.granularity.value}"
        return self._load_time_reason(s, case)

    def _process(self, x: torch.Tensor) -> torch.nn.Module:
        from sglang.srt.layers.quantization.w8a8_fp8 import W8A8Fp8Config, W8A8Fp8LinearMethod

        method = W8A8Fp8LinearMethod(W8A8Fp8Config(is_checkpoint_fp8_serialized=False))
        method.cutlass_fp8_supported = self.cutlass
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(x.clone(), requires_grad=False)
        method.process_weights_after_loading(layer)
        return layer

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: the weight's scale is computed at load time")
        layer = self._process(x.contiguous())
        # the method stores qweight.t() (a [K, N] view) and the scale as [] or [1, N]
        return self._quantized(layer.weight.data.t(), layer.weight_scale.data.reshape(-1, 1), scheme)


class SGLangOnlineW8A8(_OnlineW8A8, _SGLang, Peer):
    name = "sglang-online-w8a8"
    entry = f"{_W8A8}.W8A8Fp8LinearMethod.process_weights_after_loading (fp16/bf16 checkpoint, no CUTLASS)"
    modules = (_W8A8,)
    notes = ("input_to_float8: amax = max(|min|, |max|) floored at 1e-12 (fp32); m = 448/amax, which torch "
             "evaluates as 448 * (1/amax); codes = cast(clamp(x.float() * m)); s = 1/m")
    granularity = Granularity.TENSOR
    eps = 1e-12

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        s = super().conventions(scheme, x_dtype)
        if (s is scheme or not s.dynamic or not s.standard_scale_rule or s.pow2_scale
                or s.scale_dtype != torch.float32):
            return s
        # ``fp_max / amax`` (a Python float over a tensor: 448 * (1 / amax)), codes x * m, scale 1 / m
        return s.with_(reciprocal_scale=True, multiplier_by_reciprocal=True, multiply_codes=True)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if not (s.reciprocal_scale and s.multiplier_by_reciprocal and s.multiply_codes):
            return "input_to_float8: scale 1 / (448 * (1 / amax)), codes x * m"
        # the rest of the load-time rule on the scheme without the multiplier form it declares
        return self._supports(case, s.with_(reciprocal_scale=False, multiplier_by_reciprocal=False,
                                            multiply_codes=False))


class SGLangOnlineW8A8Cutlass(_OnlineW8A8, _SGLang, TritonPeer):
    name = "sglang-online-w8a8-cutlass"
    entry = (f"{_W8A8}.W8A8Fp8LinearMethod.process_weights_after_loading (fp16/bf16 checkpoint, CUTLASS: "
             "per_token_group_quant_fp8 per output channel)")
    modules = (_W8A8,)
    notes = "per_token_group_quant_fp8(weight, K): s = max(amax, 1e-10)/448 fp32; codes = cast(clamp(x / s))"
    granularity = Granularity.ROW
    eps = 1e-10
    cutlass = True

    def _process(self, x: torch.Tensor) -> torch.nn.Module:
        return self.call(super()._process, x)


PEERS = (SGLangGroupQuant(), SGLangGroupQuantColMajor(), SGLangStaticQuant(), SGLangMLATensorQuant(),
         SGLangBlockGemm(), SGLangScaledMM(), SGLangOnlineW8A8(), SGLangOnlineW8A8Cutlass())
