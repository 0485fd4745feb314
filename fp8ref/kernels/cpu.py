"""The ``cpu-bf16`` and ``cpu-fp32`` backends: FP8 W8A8 on a CPU through wide GEMMs of exact values.

Every FP8 value (E4M3FN, E5M2, E4M3FNUZ) is exactly a bfloat16 (at most 4 significant bits, an
exponent range inside bf16's), so a GEMM over the FP8 *values* held in bf16 or fp32 multiplies the
exact codes; only the accumulation and the epilogue round.

``cpu-bf16``
    The weight is stored once (``prepare_weight``) as bf16 holding the exact FP8 values; the
    activations are quantized to FP8 codes and upcast to bf16; oneDNN's bf16 GEMM accumulates in
    fp32 but *returns bf16* (CPU torch has no bf16 x bf16 -> fp32 ``mm``), then the scales and the
    bias are applied in fp32 and the result is rounded to bf16 again: ``Accumulation.FP32``,
    ``output_roundings=2``. Because the intermediate rounding is to bf16, only a bf16 output is
    covered by that declaration; fp16/fp32/fp64 outputs are declined (use ``cpu-fp32``).
``cpu-fp32``
    The same with fp32 copies and an fp32 GEMM: fp32 accumulator, fp32 epilogue, one rounding to
    ``out_dtype``: ``Accumulation.FP32``, ``output_roundings=1`` (the strict class). With
    ``bf16_dot_products = True`` (or ``FP8REF_CPU_BF16_DOT=1``) the GEMM runs with
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` for the call: oneDNN may then feed
    the fp32 operands to bf16 dot-product units (AMX) with an fp32 accumulator, which is exact on
    these operands since they are bf16 values. Off by default: it is a process-wide switch, so
    fp32 GEMMs of other threads would see it while the call runs, and on the CPU without AMX where
    this was written it changed nothing: an fp32 GEMM of non-bf16 inputs came out bit-identical
    with and without it (docs/performance.md, "Figures behind the code").

Block and group recipes run one GEMM per K-segment on which both scales are constant, summing
the scaled segment results in fp32 (``fp8ref.spec.gemm.k_segments``).

Packed weights. Where the weight has one scale along K (per-row, per-tensor), ``prepare_weight``
hands the wide copy to oneDNN once, in oneDNN's own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``), and every call runs oneDNN's linear on it
(``_linear_pointwise``): ``F.linear`` re-lays the weight out on every call (bf16) or runs MKL's
sgemm (fp32). Same operands, same fp32 accumulator, so the same declarations; the summation order
is oneDNN's. Where it was measured it beat ``F.linear`` at every M, most at small M and in fp32
(docs/performance.md, "Figures behind the code"). Decided on this machine: packing is used where
oneDNN is built in (and, for bf16, where it reports bf16 support) and a 16 x 16 trial packs and
multiplies correctly; ``FP8REF_CPU_PACK=0`` turns it off. A packed tensor cannot be copied or
pickled (torch's opaque tensors): ``PreparedWeight`` shares it on ``copy.deepcopy`` (it is never
written).

The activation quantization and the epilogue can be fused with ``torch.compile`` (``compile=True``
or ``FP8REF_COMPILE=1``): compiled lazily on first use, cached per process, and any compile or
run failure falls back to the eager code for good (with one warning).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F

from .. import _env
from ..registry import SPEC_NON_FINITE, Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.gemm import k_segments
from ..spec.quant import Quantized, check_float_input
from ..spec.schemes import Granularity, QuantScheme
from . import native
from ._common import (
    NativeBound,
    PreparedWeight,
    Shared,
    amax_all_finite,
    bias_fp32,
    check_mm_args,
    empty_result,
    fast_quantize,
    ieee_methods,
    native_format_args,
    native_rows,
    segment_scale,
    standard_scale,
    unwrap,
)
from ._compiled import COMPILED as _COMPILED
from ._compiled import compile_enabled

__all__ = ["CpuWideBackend", "compile_enabled"]

_precision_lock = threading.Lock()


@contextlib.contextmanager
def _bf16_dot_products():
    """Let oneDNN run fp32 GEMMs on bf16 dot-product units (fp32 accumulator) for one call."""
    mm = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if mm is None or not hasattr(mm, "fp32_precision"):
        yield
        return
    with _precision_lock:  # a process-wide switch: restore it even if the GEMM raises
        old = mm.fp32_precision
        mm.fp32_precision = "bf16"
        try:
            yield
        finally:
            mm.fp32_precision = old


_pack_lock = threading.Lock()
_PACK_REASON: dict[torch.dtype, str | None] = {}
# A lock another thread held at a fork stays held for ever in the child: the child gets fresh ones.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: globals().update(_precision_lock=threading.Lock(),
                                                                _pack_lock=threading.Lock()))


def pack_reason(wide: torch.dtype) -> str | None:
    """Why weights in ``wide`` are not packed for oneDNN here (None: they are), decided once."""
    with _pack_lock:
        if wide not in _PACK_REASON:
            _PACK_REASON[wide] = _find_pack_reason(wide)
        return _PACK_REASON[wide]


def _find_pack_reason(wide: torch.dtype) -> str | None:
    if not _env.get("FP8REF_CPU_PACK"):
        return "FP8REF_CPU_PACK=0"
    mkldnn = getattr(torch.backends, "mkldnn", None)
    if mkldnn is None or not mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch lacks torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise"
    if wide == torch.bfloat16 and not (hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()):
        return "oneDNN reports no bf16 support on this CPU"
    try:  # a trial: small integers, so every summation order gives the same exact result
        w = torch.arange(-128, 128, dtype=torch.float32).reshape(16, 16).remainder(7).sub(3).to(wide)
        x = torch.arange(48, dtype=torch.float32).reshape(3, 16).remainder(5).sub(2).to(wide)
        got = _packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None))
        if not torch.equal(got.float(), x.float() @ w.float().T):
            return "oneDNN's packed linear gave a wrong result on a 3 x 16 x 16 trial"
    except Exception as exc:  # an op that raises here: no packing, never a crash
        return f"oneDNN's packed linear raised on this machine ({type(exc).__name__}: {exc})"
    return None


def _packed_linear(a: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")


def _row_scale(x: torch.Tensor, qmax: float, floor: float):
    """Per-row amax (fp32, exact) and the spec's dequantization scale."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return standard_scale(amax, qmax, floor), amax


def _quant_codes(x: torch.Tensor, qmax: float, floor: float, fp8: torch.dtype):
    """Per-row quantization by the spec's expressions: FP8 codes, fp32 scale, amax."""
    s, amax = _row_scale(x, qmax, floor)
    q = torch.div(x, s).clamp_(-qmax, qmax).to(fp8)  # fp32 quotient (type promotion), clamped in place
    return q, s, amax


def _quant_wide(x: torch.Tensor, qmax: float, floor: float, fp8: torch.dtype, wide: torch.dtype):
    """The same, returning the FP8 *values* in ``wide`` instead of the codes: what the fused
    ``linear`` multiplies. Going through fp32 is exact and, compiled, avoids an FP8 store, which
    inductor's CPU code makes several times slower (docs/performance.md, "Figures behind the code")."""
    s, amax = _row_scale(x, qmax, floor)
    v = torch.div(x, s).clamp_(-qmax, qmax)
    return v.to(fp8).to(torch.float32).to(wide), s, amax


def _widen(q: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """FP8 codes to their exact values in ``wide``. Through fp32: torch's direct fp8 -> bf16 CPU
    conversion is the slower element-wise path, and compiled this is one fused pass
    (docs/performance.md, "Figures behind the code")."""
    return q.to(torch.float32).to(wide)


def _native_epilogue(y: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor | None:
    """``_epilogue`` by the extension (one pass, same fp32 expressions, same single rounding), or
    None where it does not apply (no extension; an output other than bf16/fp32)."""
    if out_dtype not in (torch.bfloat16, torch.float32) or y.dtype not in (torch.bfloat16, torch.float32):
        return None
    mod = native.get()
    if mod is None:
        return None
    M, N = y.shape
    sa = sa.reshape(-1).expand(M).contiguous()
    sb = sb.reshape(-1).expand(N).contiguous()
    return mod.scale_epilogue(y.contiguous(), sa, sb, sa if bias is None else bias.contiguous(), bias is not None,
                              out_dtype == torch.bfloat16, -1)


def _epilogue(y: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    # In place on the GEMM's own output (or its fp32 copy): one buffer instead of one per op.
    y = y.to(torch.float32).mul_(sa).mul_(sb)
    if bias is not None:
        y.add_(bias)
    return y.to(out_dtype)


@ieee_methods
class CpuWideBackend(NativeBound, Backend):
    """FP8 values held exactly in ``wide`` (bf16 or fp32), one wide GEMM, fp32 scales and bias.

    Examples
    --------
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("cpu-bf16")
    >>> qw = be.prepare_weight(fp8ref.quantize(torch.randn(8, 32), fp8ref.W8A8_FP8.weight))
    >>> qx = be.quantize(torch.randn(4, 32), fp8ref.W8A8_FP8.activation)
    >>> be.scaled_mm(qx, qw).dtype
    torch.bfloat16
    """

    def __init__(self, name: str, wide: torch.dtype, compile: bool | None = None) -> None:
        self.name = name
        self.wide = wide
        self.accumulation = Accumulation.FP32
        self.output_roundings = 2 if wide == torch.bfloat16 else 1
        self.rejects_non_finite = True  # x: the quantizers' amax checks; bias: check_mm_args
        self.non_finite = SPEC_NON_FINITE
        self._compile = compile
        #: fp32 GEMMs through oneDNN's bf16 dot products (see the module docstring); cpu-fp32 only
        self.bf16_dot_products = _env.get("FP8REF_CPU_BF16_DOT")

    @property
    def compile(self) -> bool:
        """Whether the torch.compile'd paths are used (default: ``FP8REF_COMPILE``)."""
        return compile_enabled() if self._compile is None else self._compile

    @compile.setter
    def compile(self, value: bool | None) -> None:
        self._compile = value

    @property
    def version(self) -> str:
        """What the selector's cache key holds of this backend's code: whether weights are packed for
        oneDNN here, and the C++ sources' digest (the quantizer and epilogue): a decision timed on
        other code is not reused."""
        return f"pack={'oneDNN' if pack_reason(self.wide) is None else 'off'}/src={native.source_version()}"

    def available(self) -> str | None:
        # The extension is only a fast path here (eager torch computes the same bits), but with
        # FP8REF_CPU_FP8=1 this check is where it gets built: before any probe or timed call.
        native.prepare()
        return None

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"{self.name} runs on CPU tensors only, the case is on {case.device}"
        return self._out_reason(case.out_dtype)

    def _out_reason(self, out_dtype: torch.dtype) -> str | None:
        if self.wide == torch.bfloat16 and out_dtype != torch.bfloat16:
            return (f"{self.name} rounds the GEMM result to bf16 before scaling, which only a bf16 output "
                    f"covers; out_dtype {out_dtype} needs cpu-fp32")
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            return fast_quantize(x, scheme, scale)
        if self.compile and self._fusable(x, scheme):
            q, s, amax = _COMPILED.run("codes", _quant_codes, x, scheme.qmax, scheme.amax_floor,
                                       scheme.format.torch_dtype)
            return self._checked(x, q, s, amax, scheme)
        return fast_quantize(x, scheme)

    @classmethod
    def _fusable(cls, x: torch.Tensor, scheme: QuantScheme) -> bool:
        return (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and cls._fusable_scheme(scheme))

    @staticmethod
    def _fusable_scheme(scheme: QuantScheme) -> bool:
        """Whether ``linear`` fuses the quantization of ``scheme``: per row, dynamic, no power-of-two
        scales, fp32 scales by the standard rule (the extension's ``native_rows`` takes it too)."""
        return (isinstance(scheme, QuantScheme) and scheme.granularity is Granularity.ROW and scheme.dynamic
                and not scheme.pow2_scale and scheme.scale_dtype == torch.float32 and scheme.standard_scale_rule)

    @staticmethod
    def _checked(x, q, s, amax, scheme) -> Quantized:
        if not amax_all_finite(amax):
            check_float_input(x)  # raises, naming the first non-finite element
        return Quantized(q, s, scheme, 0)

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        """The weight's FP8 values in ``wide``: packed for oneDNN where it has one scale along K and
        packing works here (module docstring), else plain (block recipes slice it along K)."""
        if not isinstance(w, Quantized):
            raise TypeError(f"prepare_weight takes an fp8ref.Quantized, got {type(w).__name__}")
        wide = w.data.to(self.wide).contiguous()
        if (w.data.dim() == 2 and w.data.shape[0] > 0 and w.data.shape[1] > 0 and w.data.device.type == "cpu"
                and w.scheme.block_shape(*w.data.shape)[1] >= w.data.shape[1] and pack_reason(self.wide) is None):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(wide, None)
            except Exception:  # a shape oneDNN refuses here: the plain weight computes it
                packed = None
            if packed is not None:
                return PreparedWeight.wrap(w, self.name, packed=Shared(packed))
        return PreparedWeight.wrap(w, self.name, wide=wide)

    def _gemm(self, a: torch.Tensor, b: torch.Tensor | Shared) -> torch.Tensor:
        """``F.linear(a, b)`` without bias; ``b`` plain, or packed for oneDNN (``Shared``)."""
        if isinstance(b, Shared):
            fn, b = _packed_linear, b.value
        else:
            fn = F.linear
        if self.wide == torch.float32 and self.bf16_dot_products:
            with _bf16_dot_products():
                return fn(a, b)
        return fn(a, b)

    def _weight(self, b: Quantized, extra: dict, segmented: bool) -> torch.Tensor | Shared:
        """The weight operand: the packed copy for one K-segment, else plain (made now if needed)."""
        if not segmented and "packed" in extra:
            return extra["packed"]
        w = extra.get("wide")
        return b.data.to(self.wide) if w is None else w

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, extra = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        reason = self._out_reason(out_dtype)
        if reason:
            raise ValueError(reason)
        if a.data.device.type != "cpu":
            raise ValueError(f"{self.name} runs on CPU tensors only, got {a.data.device}")
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        if self.compile:
            a_wide = _COMPILED.run("widen", _widen, a.data, self.wide)
        else:
            a_wide = _widen(a.data, self.wide)
        return self._mm_values(a, a_wide, b, extra, bias, out_dtype)

    def _mm_values(self, a: Quantized, a_wide: torch.Tensor, b: Quantized, extra: dict,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        bias32 = bias_fp32(bias, a_wide.device)
        segs = k_segments(a, b)
        w = self._weight(b, extra, len(segs) > 1)
        if len(segs) == 1:
            sa = segment_scale(a, 0).reshape(-1, 1)
            sb = segment_scale(b, 0).reshape(1, -1)
            return self._finish(self._gemm(a_wide, w), sa, sb, bias32, out_dtype)
        # One GEMM per K-segment; y accumulates the scaled segment sums in fp32.
        y = torch.zeros(a_wide.shape[0], w.shape[0], dtype=torch.float32, device=a_wide.device)
        for k0, k1 in segs:
            part = self._gemm(a_wide[:, k0:k1], w[:, k0:k1]).to(torch.float32)
            y += part * torch.outer(segment_scale(a, k0), segment_scale(b, k0))
        if bias32 is not None:
            y += bias32
        return y.to(out_dtype)

    def linear(self, x: torch.Tensor, w: Quantized, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, scheme: QuantScheme | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """``scaled_mm(quantize(x, scheme, scale), w, bias, out_dtype)``, fused where it can be.

        Bit-identical to the two calls. For a per-row dynamic activation scheme and a weight with
        one scale along K (per-row or per-tensor), the FP8 codes are never materialised: the
        activation values go straight to the wide dtype. Callers that hold a backend (a selector,
        an ``nn.Module``) may call this instead of the two methods when the backend has it.

        Examples
        --------
        >>> import torch, fp8ref
        >>> be = fp8ref.get_backend("cpu-bf16")
        >>> w = be.prepare_weight(fp8ref.quantize(torch.randn(8, 32), fp8ref.W8A8_FP8.weight))
        >>> be.linear(torch.randn(3, 32, dtype=torch.bfloat16), w).shape
        torch.Size([3, 8])
        """
        from ..spec.schemes import W8A8_FP8

        scheme = W8A8_FP8.activation if scheme is None else scheme
        b, extra = unwrap(w, self.name)
        one_k_block = b.scheme.block_shape(*b.data.shape)[1] >= b.data.shape[1]
        if not (scale is None and self._fusable(x, scheme) and one_k_block and isinstance(b, Quantized)
                and x.shape[1] == b.data.shape[1] and b.data.shape[0] > 0):
            return self.scaled_mm(self.quantize(x, scheme, scale), w, bias, out_dtype)
        reason = self._out_reason(out_dtype)
        if reason:
            raise ValueError(reason)
        if x.device.type != "cpu":
            raise ValueError(f"{self.name} runs on CPU tensors only, got {x.device}")
        check_mm_args(b, b, bias, out_dtype)  # bias and out_dtype checks against the weight
        args = (x, scheme.qmax, scheme.amax_floor, scheme.format.torch_dtype, self.wide)
        got = native_rows(x, scheme, 1 if self.wide == torch.bfloat16 else 2)
        if got is not None:
            a_wide, sa, amax = got
        elif self.compile:
            a_wide, sa, amax = _COMPILED.run("wide", _quant_wide, *args)
        else:
            a_wide, sa, amax = _quant_wide(*args)
        if not amax_all_finite(amax):
            check_float_input(x)
        sb = segment_scale(b, 0).reshape(1, -1)
        y = self._gemm(a_wide, self._weight(b, extra, False))
        return self._finish(y, sa, sb, bias_fp32(bias, x.device), out_dtype)

    #: Names whose change changes the kernel that runs (``_bind_state``): setting one bumps ``_epoch``.
    _KERNEL_SETTINGS = ("wide", "bf16_dot_products")
    #: The watched call (``bind_watched_linear``): ``wide_linear`` with the plan's checks.
    _WATCHED = "BoundWideLinear"

    def _bind_state(self) -> tuple:
        """The settings that pick the bound path's kernel (a bound call made under others hands back)."""
        return self.wide, self.bf16_dot_products

    def _bound_args(self, w, scheme: QuantScheme, out_dtype: torch.dtype) -> tuple | None:
        """``(wide_linear, its arguments up to sb, its arguments after has_bias)`` for one prepared
        weight, what ``NativeBound``'s ``bind_linear`` and ``bind_watched_linear`` bind; None where
        the bound path does not apply. It applies where ``linear``'s fused path runs (a per-row
        dynamic scheme, one weight scale along K, the weight prepared here) with the extension's
        quantizer and epilogue (``native_rows``, ``_native_epilogue``: the extension loaded, a bf16
        or fp32 output) and ``_gemm`` without its precision switch (no fp32 GEMM on bf16 dot
        products)."""
        b, extra = unwrap(w, self.name)
        mod = native.loaded()
        if (not extra or mod is None or not hasattr(mod, "wide_linear") or not self._fusable_scheme(scheme)
                or out_dtype not in (torch.bfloat16, torch.float32) or self._out_reason(out_dtype)
                or (self.wide == torch.float32 and self.bf16_dot_products) or b.data.dim() != 2
                or b.data.shape[0] == 0 or b.scheme.block_shape(*b.data.shape)[1] < b.data.shape[1]):
            return None
        packed = extra.get("packed")
        weight = packed.value if packed is not None else extra.get("wide")
        if weight is None:
            return None
        sb = segment_scale(b, 0).contiguous()
        args = (scheme.qmax, scheme.amax_floor, *native_format_args(scheme), weight, packed is not None, sb)
        return mod.wide_linear, args, (1 if self.wide == torch.bfloat16 else 2, out_dtype == torch.bfloat16)

    def _finish(self, y: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias32: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        """The epilogue: the extension's one pass where it applies, else compiled or eager torch."""
        out = _native_epilogue(y, sa, sb, bias32, out_dtype)
        if out is not None:
            return out
        if self.compile:
            return _COMPILED.run("epilogue", _epilogue, y, sa, sb, bias32, out_dtype)
        return _epilogue(y, sa, sb, bias32, out_dtype)


register_backend(CpuWideBackend("cpu-bf16", torch.bfloat16))
register_backend(CpuWideBackend("cpu-fp32", torch.float32))
