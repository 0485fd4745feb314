"""The ``torch`` and ``torch-fast`` backends: ``torch._scaled_mm`` on CPU and CUDA.

``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)`` takes ``a`` row-major
``[M, K]``, ``b`` column-major ``[K, N]`` (our ``[N, K]`` weight's ``.t()``) and dequantization
scales that are either both scalars (tensor-wise) or ``[M, 1]`` and ``[1, N]`` fp32 (row-wise).
A tensor-wise scale paired with a row-wise one is broadcast to the row-wise shape (exact).

Numerics (checked against the spec by tests/test_kernels.py):

* CPU (torch 2.13): both operands are widened to fp32 and multiplied with an fp32 GEMM, the
  scales and the bias are applied in fp32 and the result is rounded once to ``out_dtype``
  (measured: a bias that only cancels before the rounding comes out exact), so ``torch`` declares
  ``Accumulation.FP32`` and one output rounding. With tensor-wise scales and a bf16 output it
  flushes subnormal outputs to 0 (IEEE rounding keeps them: docs/spec.md §3.3), so that case asks
  for fp32 and rounds once itself.
* CUDA: cuBLASLt accumulates in fp32 unless ``use_fast_accum=True`` (Hopper's ~14-bit tensor-core
  accumulator, ``Accumulation.FAST``: the ``torch-fast`` variant). cuBLASLt wants K and N
  multiples of 16; both are zero-padded (zero codes add exact zeros), the weight once at
  ``prepare_weight`` time. A bias whose dtype is not ``out_dtype`` is added in fp32 after an fp32
  GEMM so that it is never rounded to ``out_dtype`` first.

What ``torch._scaled_mm`` accepts differs between machines and torch versions (torch 2.13.0+cpu raises
"itensor_view_from_dense expects ... Float8_e4m3fnuz" for E4M3FNUZ operands at every shape on some
CPUs, at M = N = 1 only on others, and computes them on others again; two CPUs of one design have
differed, so not even the design decides it; the known-failures ledger's ``torch-cpu-scaled-mm-fnuz``
records where), so no list of
unsupported cases is written down here: ``supports`` runs the backend's own call once on zero
operands of a tiny shape of the same *class* (formats, scale granularity, output dtype, bias, M
and N capped at 3, K at 32 plus its residue mod 16) and declines, with torch's message as the
reason, whatever raises. The answer is cached per (device, class) for the process.
"""

from __future__ import annotations

import os
import threading

import torch

from ..registry import SPEC_NON_FINITE, Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._common import (
    PreparedWeight,
    bias_fp32,
    check_mm_args,
    empty_result,
    fast_quantize,
    ieee_methods,
    pad_last,
    pad_weight,
    unwrap,
    zeros,
)

__all__ = ["TorchScaledMMBackend"]

_OK_GRANULARITY = (Granularity.TENSOR, Granularity.ROW)
_ALIGN = 16  #: cuBLASLt's alignment for FP8 operands (16 bytes)


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _trial_shape(M: int, N: int, K: int) -> tuple[int, int, int]:
    """The tiny shape standing for ``M x N x K`` in a trial call: M and N capped at 3 (so 0, 1 and
    2 stay themselves: the failures seen so far depend on M = N = 1), K at 32 plus its residue
    mod 16 (the alignment torch's kernels switch on)."""
    return min(M, 3), min(N, 3), (K if K <= 32 else 32 + K % 16)


_TRIALS: dict[tuple, str | None] = {}
_TRIALS_LOCK = threading.Lock()
# A lock another thread held at a fork stays held for ever in the child: the child gets fresh ones.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: globals().update(_TRIALS_LOCK=threading.Lock()))


@ieee_methods
class TorchScaledMMBackend(Backend):
    """``torch._scaled_mm`` with tensor-wise or row-wise scales (see module docstring).

    Examples
    --------
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("torch")
    >>> qx = be.quantize(torch.randn(4, 32), fp8ref.W8A8_FP8.activation)
    >>> qw = be.prepare_weight(fp8ref.quantize(torch.randn(8, 32), fp8ref.W8A8_FP8.weight))
    >>> be.scaled_mm(qx, qw).shape
    torch.Size([4, 8])
    """

    def __init__(self, name: str = "torch", fast_accum: bool = False) -> None:
        self.name = name
        self.fast_accum = fast_accum
        self.accumulation = Accumulation.FAST if fast_accum else Accumulation.FP32
        self.output_roundings = 1
        self.rejects_non_finite = True  # x: fast_quantize's amax check; bias: check_mm_args
        self.non_finite = SPEC_NON_FINITE
        #: pad K and N to 16 on CPU too (CUDA always pads): lets CPU tests run the padding path
        self.force_pad = False

    def available(self) -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        return None

    def _scheme_reason(self, scheme: QuantScheme, what: str, device: str | torch.device) -> str | None:
        if scheme.granularity not in _OK_GRANULARITY:
            return (f"torch._scaled_mm takes tensor-wise or row-wise scales; the {what} scheme "
                    f"{scheme.short_str()} has {scheme.granularity.value} scales")
        if scheme.format.name == "e4m3fnuz" and _is_cuda(device) and torch.version.hip is None:
            return "e4m3fnuz operands need a ROCm build of torch on CUDA devices"
        return None

    def supports(self, case: Case) -> str | None:
        for scheme, what in ((case.recipe.weight, "weight"), (case.recipe.activation, "activation")):
            reason = self._scheme_reason(scheme, what, case.device)
            if reason:
                return reason
        if _is_cuda(case.device):
            if not torch.cuda.is_available():
                return "case is on CUDA but torch.cuda.is_available() is False"
            rowwise = Granularity.ROW in (case.recipe.weight.granularity, case.recipe.activation.granularity)
            if rowwise and torch.version.hip is None and torch.cuda.get_device_capability() < (9, 0):
                return "row-wise torch._scaled_mm needs CUDA capability >= 9.0"
            if rowwise and case.out_dtype != torch.bfloat16:
                return "row-wise torch._scaled_mm on CUDA returns bfloat16 only"
            if case.out_dtype == torch.float64:
                return "torch._scaled_mm on CUDA has no float64 output"
        return self.trial(case.device, case.recipe.activation, case.recipe.weight, case.M, case.N, case.K,
                          case.out_dtype, case.has_bias)

    def trial(self, device: str | torch.device, a_scheme: QuantScheme, b_scheme: QuantScheme, M: int, N: int,
              K: int, out_dtype: torch.dtype, has_bias: bool) -> str | None:
        """None if this backend's ``torch._scaled_mm`` call runs on this machine for operands of this
        class, else the reason (torch's own message). One call on zero operands of the class's
        ``_trial_shape``, cached per (device, class)."""
        dev = torch.device(device)
        m, n, k = _trial_shape(M, N, K)
        key = (str(dev), self.fast_accum, self.force_pad, a_scheme.format.name, b_scheme.format.name,
               a_scheme.granularity, b_scheme.granularity, m, n, k, out_dtype, has_bias)
        with _TRIALS_LOCK:
            if key in _TRIALS:
                return _TRIALS[key]
        a = Quantized(zeros(m, k, dtype=a_scheme.format.torch_dtype, device=dev),
                      torch.ones(a_scheme.scale_shape(m, k), dtype=a_scheme.scale_dtype, device=dev), a_scheme)
        b = Quantized(zeros(n, k, dtype=b_scheme.format.torch_dtype, device=dev),
                      torch.ones(b_scheme.scale_shape(n, k), dtype=b_scheme.scale_dtype, device=dev), b_scheme)
        bias = torch.zeros(n, dtype=out_dtype, device=dev) if has_bias else None
        try:
            self._call(a, b, bias, out_dtype, None)
            reason = None
        except RuntimeError as exc:  # torch's kernels raise RuntimeError (and its subclasses)
            msg = " ".join(str(exc).split())
            reason = (f"torch._scaled_mm raises on this machine for {a_scheme.format.name} x "
                      f"{b_scheme.format.name} operands at M={m}, N={n}, K={k} "
                      f"({'bias, ' if has_bias else ''}out {str(out_dtype)[6:]}): {msg[:300]}")
        with _TRIALS_LOCK:
            _TRIALS[key] = reason
        return reason

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        return fast_quantize(x, scheme, scale)

    def _weight_operand(self, b: Quantized, pad: bool) -> torch.Tensor:
        """``b`` as the column-major ``[K, N]`` operand (K and N zero-padded to 16 if ``pad``)."""
        # contiguous: torch._scaled_mm on CPU (2.13) reads a strided operand as if it were dense
        return (pad_weight(b.data, _ALIGN) if pad else b.data.contiguous()).t()

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        reason = self._scheme_reason(w.scheme, "weight", w.data.device)
        if reason:
            raise ValueError(f"backend {self.name!r}: {reason}")
        return PreparedWeight.wrap(w, self.name, b_op=self._weight_operand(w, w.data.is_cuda or self.force_pad))

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, extra = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        dev = a.data.device
        for scheme, what in ((b.scheme, "weight"), (a.scheme, "activation")):
            reason = self._scheme_reason(scheme, what, dev)
            if reason:
                raise ValueError(f"backend {self.name!r}: {reason}")
        reason = self.trial(dev, a.scheme, b.scheme, a.data.shape[0], b.data.shape[0], a.data.shape[1], out_dtype,
                            bias is not None)
        if reason:
            raise ValueError(f"backend {self.name!r}: {reason}")
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        return self._call(a, b, bias, out_dtype, extra.get("b_op"))

    def _call(self, a: Quantized, b: Quantized, bias: torch.Tensor | None, out_dtype: torch.dtype,
              b_op: torch.Tensor | None) -> torch.Tensor:
        """The ``torch._scaled_mm`` call itself (arguments already checked)."""
        dev = a.data.device
        cuda = dev.type == "cuda"
        pad = cuda or self.force_pad
        M, K = a.data.shape
        N = b.data.shape[0]
        if b_op is None:
            b_op = self._weight_operand(b, pad)
        a_op = pad_last(a.data, _ALIGN) if pad else a.data.contiguous()
        sa, sb = a.scale.to(torch.float32), b.scale.to(torch.float32)
        if a.scheme.granularity is Granularity.ROW or b.scheme.granularity is Granularity.ROW:
            sa = sa.expand(M, 1).contiguous()
            sb = sb.reshape(1, -1).expand(1, N)
            if b_op.shape[1] != N:  # padded output columns get scale 1 and are sliced off
                sb = torch.cat([sb, sb.new_ones(1, b_op.shape[1] - N)], dim=1)
            sb = sb.contiguous()
        else:
            sa, sb = sa.reshape(()), sb.reshape(())
        fused_bias, late_bias = None, None
        mm_dtype = torch.float32 if out_dtype == torch.float64 else out_dtype
        if not cuda and mm_dtype == torch.bfloat16 and sa.dim() == 0:
            # torch 2.13's CPU _scaled_mm with tensor-wise scales flushes subnormal bf16 outputs to 0
            # (found by the conformance magnitude sweep; row-wise scales and fp16 outputs round them):
            # the fp32 result, rounded once here, has the same bits everywhere else.
            mm_dtype = torch.float32
        if bias is not None:
            if not cuda:
                fused_bias = bias_fp32(bias, dev)  # CPU: added in fp32 before the single rounding
            elif bias.dtype == out_dtype and out_dtype != torch.float64:
                fused_bias = bias
            else:
                late_bias, mm_dtype = bias_fp32(bias, dev), torch.float32
            if fused_bias is not None and b_op.shape[1] != N:
                fused_bias = pad_last(fused_bias.reshape(1, -1), _ALIGN).reshape(-1)
        y = torch._scaled_mm(a_op, b_op, scale_a=sa, scale_b=sb, bias=fused_bias, out_dtype=mm_dtype,
                             use_fast_accum=self.fast_accum)
        if y.shape[1] != N:
            y = y[:, :N]
        if late_bias is not None:
            y = y + late_bias
        return y.to(out_dtype)


register_backend(TorchScaledMMBackend("torch", fast_accum=False))
register_backend(TorchScaledMMBackend("torch-fast", fast_accum=True))
