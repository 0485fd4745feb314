"""Adapters for sgl-kernel (SGLang's CUDA kernels): ``sgl-kernel`` and ``sgl-kernel-block``.

The package is imported lazily, on the first ``available()``/kernel call, never at
``import fp8ref``; without CUDA or without an importable ``sgl_kernel`` both backends are listed
as unavailable with the reason (the import error itself when the import fails).

What the kernels take (sgl-kernel ``python/sgl_kernel/gemm.py``; checked against SGLang's callers):

``fp8_scaled_mm(mat_a, mat_b, scales_a, scales_b, out_dtype, bias=None)``
    ``mat_a`` [M, K] row-major FP8, ``mat_b`` [K, N] column-major (our [N, K] weight's ``.t()``),
    fp32 scales ``[M]`` and ``[N]`` (a tensor-wise scale is broadcast, exactly), out bf16/fp16,
    ``bias`` in ``out_dtype``; K and N multiples of 16 (zero-padded here otherwise).
``fp8_blockwise_scaled_mm(mat_a, mat_b, scales_a, scales_b, out_dtype)``
    1 x 128 activation groups and 128 x 128 weight blocks: ``scales_a`` [M, K/128] M-major
    (``stride(0) == 1``), ``scales_b`` [K/128, N/128] (the [N/128, K/128] weight scale's ``.t()``);
    no bias (added afterwards in fp32 here); K and N multiples of 128.
``sgl_per_token_quant_fp8(input, output_q, output_s)``
    ``output_s`` [M, 1] fp32; no amax floor (an all-zero row gets scale 0), so rows whose scale
    is below ``floor / qmax`` are re-quantized by the spec's expressions here.
``sgl_per_token_group_quant_fp8(input, output_q, output_s, group_size, eps, fp8_min, fp8_max[, scale_ue8m0])``
    ``output_s`` [M, K/G]; ``eps`` is the amax floor.

Declared numerics (not yet measured on a GPU: the GPU evidence run of the benchmarks issue does
that): CUTLASS's SM90 FP8 GEMMs use the fast-accumulation schedule, so ``sgl-kernel`` declares
``Accumulation.FAST``; the blockwise kernel promotes each 128-wide K block into fp32
(u = 2**-13 inside a block, ``promote_every=128``). Both declare two output roundings: a bias
that is not exactly an ``out_dtype`` value, and the blockwise bias, are added after the kernel's
rounded output.

The layout conversions are plain functions (``scaled_mm_args``, ``blockwise_mm_args``,
``per_token_quant_buffers``, ``group_quant_buffers``) so that CPU tests check them without any
kernel running.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from ..registry import SPEC_NON_FINITE, Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._common import bias_fp32, check_mm_args, empty_result, fast_quantize, ieee_methods, pad_last, pad_weight, unwrap

__all__ = ["SglKernelBackend", "SglBlockwiseBackend", "scaled_mm_args", "blockwise_mm_args",
           "per_token_quant_buffers", "group_quant_buffers", "BLOCKWISE_ACCUMULATION"]

#: fp8_blockwise_scaled_mm: tensor-core partial sums over each 128-wide K block, promoted to fp32.
BLOCKWISE_ACCUMULATION = Accumulation("fp8-tc-promote128", 2.0**-13, promote_every=128)
_ALIGN = 16
_BLOCK = 128
_OUT = (torch.bfloat16, torch.float16)

_module: Any = None
_error: str | None = None


def _sgl() -> Any:
    """The imported ``sgl_kernel`` module, or raise RuntimeError with the reason it is missing."""
    global _module, _error
    if _module is None and _error is None:
        if importlib.util.find_spec("sgl_kernel") is None:
            _error = "sgl_kernel is not installed (pip install 'fp8ref[sgl]' on a CUDA machine)"
        else:
            try:
                _module = importlib.import_module("sgl_kernel")
            except Exception as exc:  # a CUDA-only wheel raises ImportError/OSError on CPU machines
                _error = f"import sgl_kernel failed: {exc!r}"
    if _module is None:
        raise RuntimeError(_error)
    return _module


def _availability() -> str | None:
    if not torch.cuda.is_available():
        # Importing the CUDA-only wheel on a CPU machine is pointless (and slow): name both causes.
        installed = importlib.util.find_spec("sgl_kernel") is not None
        return ("sgl-kernel needs a CUDA device (torch.cuda.is_available() is False)"
                + ("" if installed else "; sgl_kernel is not installed either"))
    try:
        _sgl()
    except RuntimeError as exc:
        return str(exc)
    return None


def _row_vector(q: Quantized, rows: int) -> torch.Tensor:
    """A tensor-wise or per-row scale as the contiguous fp32 ``[rows]`` vector the kernels take."""
    s = q.scale.to(torch.float32).reshape(-1)
    return (s.expand(rows) if s.numel() == 1 else s).contiguous()


def _exact_in(bias: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(bias.to(dtype).to(torch.float64), bias.to(torch.float64)))


def scaled_mm_args(a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, Any], torch.Tensor | None, int]:
    """Arguments of ``sgl_kernel.fp8_scaled_mm`` for ``a`` [M, K] x ``b`` [N, K]^T.

    Returns ``(kwargs, late_bias, N)``: K and N are zero-padded to 16 (slice the output to
    ``[:, :N]``), and a bias that is not exactly representable in ``out_dtype`` is returned as an
    fp32 ``late_bias`` to add after the kernel instead of being rounded.

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.kernels.sgl import scaled_mm_args
    >>> a = fp8ref.quantize(torch.randn(4, 20)); b = fp8ref.quantize(torch.randn(10, 20))
    >>> kw, late, n = scaled_mm_args(a, b)
    >>> tuple(kw["mat_b"].shape), kw["mat_b"].stride(), tuple(kw["scales_a"].shape), n
    ((32, 16), (1, 32), (4,), 10)
    """
    check_mm_args(a, b, bias, out_dtype)
    if out_dtype not in _OUT:
        raise ValueError(f"fp8_scaled_mm returns bf16 or fp16, not {out_dtype}")
    M = a.data.shape[0]
    N = b.data.shape[0]
    mat_a = pad_last(a.data.contiguous(), _ALIGN)
    w = pad_weight(b.data.contiguous(), _ALIGN)
    Np = w.shape[0]
    scales_b = _row_vector(b, N)
    if Np != N:
        scales_b = torch.cat([scales_b, scales_b.new_ones(Np - N)])
    fused, late = None, None
    if bias is not None:
        if _exact_in(bias, out_dtype):
            fused = pad_last(bias.to(out_dtype).reshape(1, -1), _ALIGN).reshape(-1)
        else:
            late = bias_fp32(bias, a.data.device)
    kwargs = {"mat_a": mat_a, "mat_b": w.t(), "scales_a": _row_vector(a, M), "scales_b": scales_b,
              "out_dtype": out_dtype, "bias": fused}
    return kwargs, late, N


def blockwise_mm_args(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Arguments of ``sgl_kernel.fp8_blockwise_scaled_mm`` (1 x 128 activations, 128 x 128 weights).

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.kernels.sgl import blockwise_mm_args
    >>> a = fp8ref.quantize(torch.randn(4, 256), fp8ref.FP8_BLOCK.activation)
    >>> b = fp8ref.quantize(torch.randn(128, 256), fp8ref.FP8_BLOCK.weight)
    >>> kw = blockwise_mm_args(a, b)
    >>> tuple(kw["scales_a"].shape), kw["scales_a"].stride(0), tuple(kw["scales_b"].shape)
    ((4, 2), 1, (2, 1))
    """
    check_mm_args(a, b, None, out_dtype)
    reason = _blockwise_reason(a.scheme, b.scheme, a.data.shape[0], b.data.shape[0], a.data.shape[1])
    if reason:
        raise ValueError(reason)
    if out_dtype not in _OUT:
        raise ValueError(f"fp8_blockwise_scaled_mm returns bf16 or fp16, not {out_dtype}")
    sa = a.scale.to(torch.float32)
    return {"mat_a": a.data.contiguous(), "mat_b": b.data.contiguous().t(),
            "scales_a": sa.t().contiguous().t(),  # M-major: stride(0) == 1
            "scales_b": b.scale.to(torch.float32).contiguous().t(), "out_dtype": out_dtype}


def per_token_quant_buffers(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``input``/``output_q``/``output_s`` for ``sgl_per_token_quant_fp8`` (scale [M, 1] fp32)."""
    x = x.contiguous()
    return {"input": x, "output_q": torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            "output_s": torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)}


def group_quant_buffers(x: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Buffers for ``sgl_per_token_group_quant_fp8``: scale [M, K/G] fp32, row-major."""
    if x.shape[1] % group_size:
        raise ValueError(f"sgl_per_token_group_quant_fp8 needs K % group_size == 0, got K={x.shape[1]}, "
                         f"G={group_size}")
    x = x.contiguous()
    return {"input": x, "output_q": torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            "output_s": torch.empty(x.shape[0], x.shape[1] // group_size, dtype=torch.float32, device=x.device)}


def _quant_reason(scheme: QuantScheme) -> str | None:
    if scheme.format != E4M3FN or scheme.qmax != E4M3FN.max:
        return "sgl-kernel quantizes to e4m3fn with qmax 448 only"
    if not scheme.dynamic or scheme.pow2_scale or scheme.scale_dtype != torch.float32 or not scheme.standard_scale_rule:
        return "sgl-kernel computes dynamic fp32 scales only (no pow2_scale)"
    if scheme.granularity not in (Granularity.ROW, Granularity.GROUP):
        return f"sgl-kernel quantizes per token or per 1 x G group, not {scheme.granularity.value}"
    return None


def _blockwise_reason(sa: QuantScheme, sb: QuantScheme, M: int, N: int, K: int) -> str | None:
    if sa.granularity is not Granularity.GROUP or sa.group_size != _BLOCK:
        return "fp8_blockwise_scaled_mm takes 1 x 128 activation groups"
    if sb.granularity is not Granularity.BLOCK or sb.block != (_BLOCK, _BLOCK):
        return "fp8_blockwise_scaled_mm takes 128 x 128 weight blocks"
    if K % _BLOCK or N % _BLOCK:
        return f"fp8_blockwise_scaled_mm needs K and N multiples of 128 (K={K}, N={N})"
    return None


@ieee_methods
class _SglBase(Backend):
    output_roundings = 2
    non_finite = SPEC_NON_FINITE

    def available(self) -> str | None:
        return _availability()

    def _common_reason(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cuda":
            return f"sgl-kernel runs on CUDA tensors only, the case is on {case.device}"
        if case.out_dtype not in _OUT:
            return f"sgl-kernel GEMMs return bf16 or fp16, not {case.out_dtype}"
        if case.recipe.weight.format != E4M3FN:
            return "sgl-kernel GEMMs take e4m3fn weights"
        return _quant_reason(case.recipe.activation)

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        reason = _quant_reason(scheme) or (None if scale is None else "sgl-kernel computes dynamic fp32 scales only")
        if reason:
            raise ValueError(reason)
        sgl = _sgl()
        if scheme.granularity is Granularity.ROW:
            buf = per_token_quant_buffers(x)
            sgl.sgl_per_token_quant_fp8(buf["input"], buf["output_q"], buf["output_s"])
        else:
            buf = group_quant_buffers(x, scheme.group_size)
            args = (buf["input"], buf["output_q"], buf["output_s"], scheme.group_size, scheme.amax_floor,
                    -scheme.qmax, scheme.qmax)
            try:
                sgl.sgl_per_token_group_quant_fp8(*args, False)  # scale_ue8m0=False (newer signature)
            except TypeError:
                sgl.sgl_per_token_group_quant_fp8(*args)
        q, s = buf["output_q"], buf["output_s"]
        low = (s < scheme.amax_floor / scheme.qmax).any(dim=1)
        if bool(low.any()):  # the per-token kernel has no amax floor: redo those rows by the spec
            redo = fast_quantize(buf["input"][low], scheme)
            q.view(torch.uint8)[low] = redo.data.view(torch.uint8)  # index_put on bytes: fp8 lacks it
            s[low] = redo.scale
        return Quantized(q, s, scheme, None)


@ieee_methods
class SglKernelBackend(_SglBase):
    """``sgl_kernel.fp8_scaled_mm`` with per-token/per-tensor x per-channel/per-tensor scales."""

    name = "sgl-kernel"
    accumulation = Accumulation.FAST

    def supports(self, case: Case) -> str | None:
        for s, what in ((case.recipe.weight, "weight"), (case.recipe.activation, "activation")):
            if s.granularity not in (Granularity.ROW, Granularity.TENSOR):
                return f"fp8_scaled_mm takes per-row or per-tensor {what} scales, not {s.granularity.value}"
        return self._common_reason(case)

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, _ = unwrap(b, self.name)
        kwargs, late, N = scaled_mm_args(a, b, bias, out_dtype)
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        y = _sgl().fp8_scaled_mm(**kwargs)[:, :N]
        return y if late is None else (y.float() + late).to(out_dtype)


@ieee_methods
class SglBlockwiseBackend(_SglBase):
    """``sgl_kernel.fp8_blockwise_scaled_mm``: 1 x 128 activation groups, 128 x 128 weight blocks."""

    name = "sgl-kernel-block"
    accumulation = BLOCKWISE_ACCUMULATION

    def supports(self, case: Case) -> str | None:
        reason = _blockwise_reason(case.recipe.activation, case.recipe.weight, case.M, case.N, case.K)
        return reason or self._common_reason(case)

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, _ = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        kwargs = blockwise_mm_args(a, b, out_dtype)
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        y = _sgl().fp8_blockwise_scaled_mm(**kwargs)
        return y if bias is None else (y.float() + bias_fp32(bias, y.device)).to(out_dtype)


register_backend(SglKernelBackend())
register_backend(SglBlockwiseBackend())
