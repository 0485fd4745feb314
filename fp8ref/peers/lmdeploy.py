"""LMDeploy's FP8 path in its PyTorch engine (``lmdeploy`` 0.18.0, installed with ``--no-deps``).

What a served blocked-FP8 model runs (DeepSeek-V3-style checkpoints, Qwen3-FP8, or any fp16/bf16
model loaded with online FP8 quantization): ``lmdeploy/pytorch/nn/linear/blocked_fp8.py``
``BlockedF8Linear`` (128 x 128 weight blocks, fixed in its constructor) and, on a CUDA device
without DeepGEMM or Hopper Gluon kernels, ``lmdeploy/pytorch/backends/cuda/blockedf8_modules.py``
``TritonLinearBlockedF8Impl._gemm``: ``quant_fp8(x, 128, trans_scale=True)`` then
``blocked_gemm_fp8(xq, xs, weight.t(), scale.t(), out_dtype=x.dtype)``, then ``out += bias`` in the
output dtype. Read from ``lmdeploy/pytorch/kernels/cuda/blocked_gemm_fp8.py``:

* ``quant_fp8`` (Triton): per 1 x G group ``amax = max|x|`` (``tl.max`` upcasts to fp32: exact),
  floored at ``1e-6`` (fp32); the stored scale is ``amax * (1 / 448)`` (the rounded reciprocal: one
  fp32 ulp from ``amax / 448`` at most), the codes are ``cast(clamp(x * (448 / amax)))`` (a second
  reciprocal, two roundings); with ``scale_fmt='ue8m0'`` the scale is ``2**ceil(log2(amax * (1/448)))``
  (bit manipulation) and the codes ``x * (1 / scale)`` (exact). The launcher packs
  ``512 // (G * itemsize)`` groups per warp: zero (a division by zero in the launcher) when one group
  is wider than 512 bytes, so a per-token row of K elements is taken only for ``K * itemsize <= 512``.
* ``blocked_gemm_fp8`` (Triton, ``_gemm_fp8_kernel``; Hopper takes the TMA variant with the same
  arithmetic): the fp32 accumulator is kept in units of the current K tile's scale product
  ``s_k = a_s[k] * b_s[k]``: per tile ``acc = dot(a_k, b_k) + acc * (s_(k-1) / s_k)`` and at the end
  ``c = acc * s_last``, rounded once to the output dtype; a zero or tiny scale product makes
  ``1 / s`` infinite and the output NaN (docs/findings.md, finding 21). One weight scale is read per
  BLOCK_N output tile (64 or 128 by autotuning), so weight blocks must span a multiple of 128 rows
  (N); the K tile is the scale block (``max`` of the activation and weight groups, which must agree).

The online weight quantization (``BlockedF8Linear.weight_loader_with_quant``: a checkpoint tensor
whose dtype is not the parameter's FP8 dtype) calls ``quant_blocked_fp8``
(``lmdeploy/lite/quantization/weight/quant_utils.py``, plain torch): the weight zero-padded to
whole 128 x 128 blocks and converted to fp32, ``amax`` per block floored at ``1e-6``,
``s = amax / 448`` (fp32, one rounding; ``ue8m0``: ``2**ceil(log2(amax / 448))``), codes
``cast(x / s)`` (one rounding, no clamp: torch's cast rounds to 448 below 480).

The SmoothQuant W8A8 path with ``--quant-dtype fp8`` (``lmdeploy lite smooth_quant``, then served by
``lmdeploy/pytorch/backends/cuda/qmodules.py`` ``TritonLinearW8A8Impl``), read from
``lmdeploy/pytorch/kernels/cuda/w8a8_triton_kernels.py`` and ``.../kernels/default/w8a8_kernels.py``:

* ``per_channel_quant`` (the offline weight quantizer, ``QLinear.from_float``; plain torch): per output
  channel ``s = amax / 448`` in fp32 with no floor, codes ``cast(clamp(x / s))``;
* ``per_token_quant_int8(x, 1e-7, quant_dtype=fp8)`` (Triton; what ``TritonLinearW8A8Impl`` runs on
  an unquantized input): ``s = max(amax, eps) / 448``, codes ``x / s`` stored to the FP8 output
  (the store's conversion rounds to nearest even and saturates: ``cvt.rn.satfinite`` on a GPU);
* ``matmul_kernel_dynamic_quant`` (Triton): ``acc = dot(a, b)`` over K in fp32, ``acc * s_a * s_w``
  in fp32 (per-token and per-channel scale vectors), stored in the output dtype, then ``c += bias``
  in torch on the rounded output: two roundings with a bias. The static per-tensor FP8 path
  (``matmul_kernel_static_quant``) calls it with both scales expanded to vectors, as the adapter does
  for tensor-wise scales.

Harness needs (docs/certified.md): ``TRITON_INTERPRET=1``; the kernels' module reads CUDA device
properties to size the quantizer's grid (``get_device_props``, which decides how many rows each
program handles and nothing else), answered with an H100's; ``supports_tma`` asks the active
Triton driver (none under the interpreter) and is answered False, the path pre-Hopper GPUs take;
the GEMMs are ``triton.autotune``-d over two tile shapes and the autotuner times each on the active
driver: a stand-in benchmarker reports equal times, so the first configuration runs (blocked GEMM:
BLOCK_M = 64, BLOCK_N = 128; W8A8 GEMM: 128 x 256 x 128), the same on every machine. The blocked
kernels also need the interpreter patch's int1 comparisons (``triton_interpreter.py``: they combine
block masks with scalar conditions, ``m_id < M`` and ``k_start < K``).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import FixedAmaxFloor, Peer, group_width, plain_fp32_scales
from ._triton import TritonPeer

__all__ = ["PEERS"]

_KERNELS = "lmdeploy.pytorch.kernels.cuda.blocked_gemm_fp8"
_W8A8 = "lmdeploy.pytorch.kernels.cuda.w8a8_triton_kernels"
_W8A8_WEIGHTS = "lmdeploy.pytorch.kernels.default.w8a8_kernels"
_UTILS = "lmdeploy.pytorch.kernels.cuda.utils"
_LINEAR = "lmdeploy.pytorch.nn.linear.blocked_fp8"
_QUANT_UTILS = "lmdeploy.lite.quantization.weight.quant_utils"
_BLOCK = 128  #: BlockedF8Linear.block_size, fixed in the constructor
_FORMATS = (E4M3FN, E5M2)

#: an H100's ``get_device_props`` answer (132 SMs, compute capability 9.0): sizes the grid only
_H100_PROPS = {"multi_processor_count": 132, "compute_capability": (9, 0), "warps_per_sm": 64, "blocks_per_sm": 32}


def _equal_times(kernel_call, quantiles):
    """The autotuner's benchmarker under the interpreter: no clock to read, every configuration
    reports the same time (the first one is kept)."""
    return [1.0, 1.0, 1.0]


def _kernels():
    """The kernel module with the CPU harness's answers to its device queries (module docstring)."""
    import importlib

    mod = importlib.import_module(_KERNELS)
    if not torch.cuda.is_available():
        utils = importlib.import_module(_UTILS)
        mod.get_device_props = lambda device=None: dict(_H100_PROPS)
        utils.supports_tma = lambda device=None: False
        mod._gemm_fp8_kernel.__dict__["do_bench"] = _equal_times
    return mod


def _w8a8_kernels():
    """The W8A8 kernel module, its autotuned GEMMs answered by the stand-in benchmarker."""
    import importlib

    mod = importlib.import_module(_W8A8)
    if not torch.cuda.is_available():
        for kernel in (mod._linear, mod._linear_add):
            kernel.__dict__["do_bench"] = _equal_times
    return mod


class _LMDeploy:
    project = "LMDeploy"
    distribution = "lmdeploy"


class LMDeployQuantFp8(_LMDeploy, TritonPeer):
    name = "lmdeploy-quant-fp8"
    entry = f"{_KERNELS}.quant_fp8 (trans_scale=True, as TritonLinearBlockedF8Impl calls it)"
    modules = (_KERNELS,)
    notes = ("amax = max(max|x|, 1e-6) fp32; s = amax * (1/448) fp32; codes = cast(clamp(x * (448/amax))) "
             "[ue8m0: s = 2**ceil(log2(amax * (1/448))), codes = cast(clamp(x * (1/s)))]")
    ops = ("quantize",)
    eps = 1e-6

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        # the floor is fixed in the kernel (1e-6); any positive floor is the same convention at another value
        return scheme.with_(amax_floor=self.eps) if scheme.amax_floor > 0 else scheme

    def _supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in _FORMATS or s.qmax != s.format.max:
            return "e4m3fn or e5m2 (the output tensor's dtype), clamped at the format's max"
        g = group_width(s, case.K)
        if g is None:
            return f"per-token-group kernel: granularity row or 1 x G group, not {s.granularity.value}"
        if case.K % g:
            return f"quant_fp8 asserts K % group_size == 0 (K={case.K}, G={g})"
        if g & (g - 1):
            return f"the group is a tl.arange extent: a power of two (G={g})"
        itemsize = torch.empty((), dtype=case.x_dtype).element_size()
        if g * itemsize > 512:
            return (f"the launcher packs 512 // (G * itemsize) groups per warp: none for G={g} x {itemsize} bytes "
                    "(division by zero)")
        if not s.dynamic:
            return "dynamic scales only"
        if s.amax_floor != self.eps:
            return f"the kernel floors amax at {self.eps:g}"
        if s.scale_dtype != torch.float32 or not s.standard_scale_rule:
            return "fp32 scales computed in fp32"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        g = group_width(scheme, x.shape[1])
        q, s = self.call(_kernels().quant_fp8, x.contiguous(), g, dtype=scheme.format.torch_dtype,
                         trans_scale=True, scale_fmt="ue8m0" if scheme.pow2_scale else None)
        return self._quantized(q, s.contiguous(), scheme)


class LMDeployBlockedGemm(_LMDeploy, TritonPeer):
    name = "lmdeploy-blocked-gemm"
    entry = f"{_KERNELS}.blocked_gemm_fp8 (non-TMA kernel; B = weight.t(), B_scale = scale.t())"
    modules = (_KERNELS,)
    notes = ("acc in units of s_k = a_s[k] * b_s[k]: acc = dot(a_k, b_k) + acc * (s_(k-1)/s_k) per K tile (fp32); "
             "c = acc * s_last, one rounding to out_dtype")
    ops = ("scaled_mm",)
    output_roundings = 1

    def _supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        if case.has_bias:
            return "the GEMM takes no bias (the linear adds it to the rounded output)"
        if case.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"out_dtype {case.out_dtype}"
        if a.format != w.format or a.format not in _FORMATS:
            return "both operands e4m3fn (or both e5m2)"
        if a.granularity is not Granularity.GROUP or w.granularity is not Granularity.BLOCK:
            return "1 x bk activation groups and bn x bk weight blocks only"
        bn, bk = w.block
        if a.group_size != bk:
            return f"activation group {a.group_size} != weight block width {bk} (the K tile is the larger)"
        if bk < 16 or bk & (bk - 1):
            return f"the K tile (the block width) is a tl.arange extent: a power of two >= 16, got {bk}"
        if case.K % bk:
            return (f"K % {bk} != 0 (K={case.K}): the kernel infers the K group as ceil(K / A_scale.size(1)), the "
                    "block only for whole blocks (else a non-power-of-two tile); quant_fp8, which the linear runs "
                    "first, asserts it")
        if bn % _BLOCK:
            return (f"one weight scale is read per BLOCK_N (64 or 128) output tile: blocks must be a multiple of "
                    f"{_BLOCK} high, got {bn}")
        if a.scale_dtype != torch.float32 or w.scale_dtype != torch.float32:
            return "fp32 scales"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        if bias is not None:
            raise ValueError(f"{self.name}: no bias")
        # what TritonLinearBlockedF8Impl._gemm passes: the [N, K] weight and its scales transposed (views)
        return self.call(_kernels().blocked_gemm_fp8, a.data.contiguous(), a.scale.contiguous(), b.data.t(),
                         b.scale.t(), out_dtype=out_dtype)


class LMDeployOnlineBlockedFp8(_LMDeploy, FixedAmaxFloor, Peer):
    """``BlockedF8Linear.weight_loader_with_quant`` on a layer made without its constructor (which
    builds the device backend's GEMM): ``x`` plays an fp16/bf16/fp32 checkpoint weight [N, K]."""

    name = "lmdeploy-online-blocked-fp8"
    entry = (f"{_LINEAR}.BlockedF8Linear.weight_loader_with_quant (fp16/bf16 checkpoint; "
             f"{_QUANT_UTILS}.quant_blocked_fp8)")
    modules = (_LINEAR,)
    notes = ("x.float() zero-padded to 128 x 128 blocks; s = max(amax, 1e-6)/448 fp32 [ue8m0: "
             "2**ceil(log2(amax/448))]; codes = cast(x / s)")
    ops = ("quantize",)
    granularity = Granularity.BLOCK
    eps = 1e-6

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in _FORMATS or s.qmax != s.format.max:
            return "e4m3fn or e5m2 (the layer's fp8_dtype), clamped at the format's max"
        if not s.dynamic:
            return "the weight's scale is computed at load time (dynamic)"
        if s.granularity is not Granularity.BLOCK or s.block != (_BLOCK, _BLOCK):
            return f"BlockedF8Linear quantizes per {_BLOCK} x {_BLOCK} block"
        if s.amax_floor != self.eps:
            return f"amax floor {self.eps:g} is fixed in the source"
        if s.scale_dtype != torch.float32 or not s.standard_scale_rule:
            return "fp32 scales computed in fp32"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"weight dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        import importlib

        if scale is not None:
            raise ValueError(f"{self.name}: the weight's scale is computed at load time")
        cls = importlib.import_module(_LINEAR).BlockedF8Linear
        n, k = x.shape
        layer = cls.__new__(cls)  # the constructor builds the device backend's GEMM (none on a CPU)
        torch.nn.Module.__init__(layer)
        # what the constructor sets that the loader reads (is_tp=False: one rank holds the whole weight)
        layer.is_tp, layer.block_size = False, _BLOCK
        layer.fp8_dtype, layer.scale_fmt = scheme.format.torch_dtype, "ue8m0" if scheme.pow2_scale else None
        weight, scale_inv, _ = layer.create_weights(k, n, False, x.dtype, x.device)
        layer.register_all_parameters(weight, scale_inv)
        layer.weight_loader_with_quant(layer.weight, x.contiguous())
        return self._quantized(layer.weight.data, layer.weight_scale_inv.data, scheme)


class LMDeployW8A8PerTokenQuant(_LMDeploy, TritonPeer):
    name = "lmdeploy-w8a8-per-token-quant"
    entry = f"{_W8A8}.per_token_quant_int8 (quant_dtype=float8_e4m3fn / float8_e5m2, as TritonLinearW8A8Impl calls it)"
    modules = (_W8A8,)
    notes = "s = max(amax, eps)/448 fp32 (eps an argument: 1e-7 in TritonLinearW8A8Impl); codes = x / s, stored to fp8"
    ops = ("quantize",)

    def _supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in _FORMATS or s.qmax != s.format.max:
            return "e4m3fn or e5m2 (quant_dtype), clamped at the format's max"
        if s.granularity is not Granularity.ROW:
            return f"one scale per token (row), not {s.granularity.value}"
        if not s.dynamic:
            return "dynamic scales only"
        if s.amax_floor <= 0:
            return "eps > 0 (TritonLinearW8A8Impl passes 1e-7)"
        return plain_fp32_scales(s)

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        q, s = self.call(_w8a8_kernels().per_token_quant_int8, x.contiguous(), scheme.amax_floor,
                         quant_dtype=scheme.format.torch_dtype)
        return self._quantized(q, s, scheme)


class LMDeployW8A8ScaledMM(_LMDeploy, TritonPeer):
    name = "lmdeploy-w8a8-scaled-mm"
    entry = (f"{_W8A8}.matmul_kernel_dynamic_quant (TritonLinearW8A8Impl; tensor-wise scales expanded as "
             "matmul_kernel_static_quant does)")
    modules = (_W8A8,)
    notes = "acc = dot(a, b) fp32; acc * s_a * s_w fp32, stored in out_dtype; then c += bias in torch (second rounding)"
    ops = ("scaled_mm",)
    output_roundings = 2

    def _supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        if case.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"out_dtype {case.out_dtype}"
        if a.format != w.format or a.format not in _FORMATS:
            return "both operands e4m3fn (or both e5m2): the weight's dtype is the quant_dtype"
        for s in (a, w):
            if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
                return f"per-token / per-channel scale vectors (or one scale expanded), not {s.granularity.value}"
        if a.scale_dtype != torch.float32 or w.scale_dtype != torch.float32:
            return "fp32 scale vectors"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        m, n = a.data.shape[0], b.data.shape[0]
        sa = a.scale.reshape(-1).expand(m).contiguous()
        sb = b.scale.reshape(-1).expand(n).contiguous()
        return self.call(_w8a8_kernels().matmul_kernel_dynamic_quant, a.data.contiguous(), b.data.contiguous(), sa,
                         sb, bias=bias, output_dtype=out_dtype)


class LMDeploySmoothQuantWeights(_LMDeploy, Peer):
    name = "lmdeploy-smooth-quant-fp8-weights"
    entry = (f"{_W8A8_WEIGHTS}.per_channel_quant (QLinear.from_float: lmdeploy lite smooth_quant "
             "--quant-dtype fp8 / float8_e5m2)")
    modules = (_W8A8_WEIGHTS,)
    notes = "x.float(); s = amax/448 fp32 per output channel, no floor; codes = cast(clamp(x / s))"
    ops = ("quantize",)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in _FORMATS or s.qmax != s.format.max:
            return "e4m3fn or e5m2 (quant_dtype), clamped at the format's max"
        if s.granularity is not Granularity.ROW:
            return f"one scale per output channel (row), not {s.granularity.value}"
        if not s.dynamic:
            return "the weight's scale is computed from the weight (dynamic)"
        if s.amax_floor != 0:
            return "no amax floor in the source"
        if (why := plain_fp32_scales(s)) is not None:
            return why
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"weight dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        import importlib

        if scale is not None:
            raise ValueError(f"{self.name}: the weight's scale is computed from the weight")
        per_channel_quant = importlib.import_module(_W8A8_WEIGHTS).per_channel_quant
        q, s = per_channel_quant(x.contiguous(), scheme.format.torch_dtype)
        return self._quantized(q, s, scheme)


PEERS = (LMDeployQuantFp8(), LMDeployBlockedGemm(), LMDeployOnlineBlockedFp8(), LMDeployW8A8PerTokenQuant(),
         LMDeployW8A8ScaledMM(), LMDeploySmoothQuantWeights())
