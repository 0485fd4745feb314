"""The ``cpu-fp8`` backend: a C++ kernel that reads the 1-byte FP8 weights directly (decode / small M).

For a few rows (decode) a linear layer is bound by reading the weight; a bf16 copy of the weight costs
two bytes per element, the FP8 codes one. The kernel path is chosen at run time from what this CPU
has (``gemm_path``; ``PATH_FLAGS``), never from the build machine:

``packed`` (avx512_bf16)
    ``prepare_weight`` packs the ``[N, K]`` E4M3FN codes as ``[N/16, K/2, 16, 2]`` (``pack_weight``),
    the kernel decodes 32 codes at a time to their exact bf16 bit patterns (one ``vdpbf16ps``
    operand: 16 output columns x 2 K-steps) and up to 16 activation rows share each decoded vector
    through broadcast pairs.
``avx512`` (AVX-512 + F16C, no avx512_bf16) and ``avx2`` (AVX2 + FMA + F16C)
    The codes are widened to fp16 bit patterns (``(c & 0x7F) << 7 | sign << 15`` is the value
    times 2**-8 for every finite code), converted with ``vcvtph2ps`` and multiplied-added in fp32
    with lanes along K. The AVX2 kernel blocks 4 rows x 2 columns (each decoded vector used by 4
    rows, each activation vector by 2 columns) over K chunks that stay in L1.
``scalar``
    A scalar loop through a 256-entry table.

Every product of two FP8 values is exact in fp32 and each addition rounds once in fp32; the epilogue
``(acc * sa) * sb + bias`` is fp32, and torch rounds the fp32 result once to ``out_dtype``:
``Accumulation.FP32``, ``output_roundings=1`` (strict class), on every path. ``cpu-fp8-amx``
(``fp8ref.kernels.cpu_fp8_amx``) is the same backend on AMX tiles.

The C++ lives in ``fp8ref/kernels/csrc/`` (``gemm_packed.cpp``, ``gemm.cpp``; ``decode.h``); the
same extension holds the fused quantizer and scale epilogue used by ``fast_quantize``,
``cpu-bf16`` and ``cpu-fp32``. ``fp8ref.kernels.native`` builds and loads it: the backend is
available once this environment's build exists, which ``python -m fp8ref.kernels.build`` makes
(one to four minutes on two cores), or ``FP8REF_CPU_FP8=1`` at the first availability check; never a
selection's probe or a timed call.

Declines: other formats than E4M3FN, block/group scales (tensor and row only), non-CPU tensors, and
more rows than its path's limit (``MAX_M`` packed, ``MAX_M_AVX2``, ``MAX_M_FALLBACK``), beyond
which it is compute-bound and oneDNN's GEMMs (``cpu-bf16``, ``cpu-fp32``) are faster.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from .._machine import cpu_flags, cpu_model
from ..registry import RAISE, SPEC_NON_FINITE, Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.checks import BIAS_NON_FINITE as _BIAS_NON_FINITE
from ..spec.checks import check_finite
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from . import native
from ._common import (
    NativeBound,
    PreparedWeight,
    amax_all_finite,
    bias_fp32,
    check_mm_args,
    empty_result,
    fast_quantize,
    fast_scheme,
    ieee_methods,
    native_format_args,
    native_quant,
    unwrap,
)

__all__ = ["CpuFp8Backend", "pack_weight", "gemm_path", "MAX_M", "MAX_M_AVX2", "MAX_M_FALLBACK",
           "PACKED_ROWS", "PATH_FLAGS"]

#: Rows beyond which the packed kernel declines: its lead over bf16 ``F.linear`` shrinks as M grows
#: (the weight's bytes matter less) to about par at 128-256 rows, and beyond, oneDNN's bf16 GEMM
#: (``cpu-bf16``, same strict class) was the faster one (docs/performance.md, "Figures behind the
#: code").
MAX_M = 256
#: Rows beyond which the AVX2 kernel (CPUs without AVX-512: fp16-pattern decoding, fp32 FMAs) declines.
#: Where measured it beat bf16 ``F.linear`` (which has no bf16 arithmetic there) at every M and fp32
#: ``F.linear`` at small M; beyond, ``cpu-fp32`` (oneDNN's fp32 GEMM on the exact values, same strict
#: class) is the faster one (docs/performance.md, "Figures behind the code").
MAX_M_AVX2 = 128
#: Rows beyond which the other fallbacks (AVX-512 without avx512_bf16: fp16 decoding + fp32 FMAs;
#: no AVX2: a scalar loop) decline: the first barely kept up with bf16 ``F.linear`` at M = 4 and fell
#: far behind at M = 16 (docs/performance.md, "Figures behind the code").
MAX_M_FALLBACK = 4
#: Rows per call of the packed kernel: its activation pairs (K/2 x rows x 4 bytes) stay in L2
#: (2 MiB at K = 4096); larger chunks spill them and ran several times slower per row
#: (docs/performance.md, "Figures behind the code").
PACKED_ROWS = 256
#: The kernel paths, best first, and the CPU flags each needs (``/proc/cpuinfo`` names).
PATH_FLAGS = {"packed": ("avx512f", "avx512bw", "avx512_bf16"), "avx512": ("avx512f", "avx512bw", "f16c"),
              "avx2": ("avx2", "fma", "f16c"), "scalar": ()}
_PATH_MAX_M = {"packed": MAX_M, "avx512": MAX_M_FALLBACK, "avx2": MAX_M_AVX2, "scalar": MAX_M_FALLBACK}
#: Output (and bias) dtypes of the fused ``linear``'s fast path; others take the two calls.
_OUT = (torch.float32, torch.bfloat16, torch.float16)
#: The extension's ``fp8_e4m3_gemm`` code path numbers.
_GEMM_ISA = {"avx512": 2, "avx2": 1, "scalar": 0}



def _cpu_has_bf16_dot() -> bool:
    """avx512_bf16 (with avx512f/bw) on this CPU: asked of the loaded extension (what its packed
    path checks; remembered per loaded module), else of /proc/cpuinfo (so that ``supports`` never
    loads or builds anything)."""
    global _has_bf16
    mod = native.loaded()
    if mod is None:
        return set(PATH_FLAGS["packed"]) <= cpu_flags()
    if _has_bf16 is None or _has_bf16[0] is not mod:
        _has_bf16 = (mod, bool(mod.has_bf16_dot()))
    return _has_bf16[1]


_has_bf16: tuple[object, bool] | None = None


def gemm_path(bf16_dot: bool = True) -> str:
    """The kernel path cpu-fp8 runs on this CPU: ``packed`` (avx512_bf16, unless ``bf16_dot`` is
    False), ``avx512``, ``avx2`` or ``scalar``; decided by the loaded extension's own CPU check,
    else by /proc/cpuinfo's flags (never by the build machine)."""
    if bf16_dot and _cpu_has_bf16_dot():
        return "packed"
    mod = native.loaded()
    if mod is not None:
        return {2: "avx512", 1: "avx2", 0: "scalar"}[int(mod.gemm_isa())]
    flags = cpu_flags()
    return next(p for p in ("avx512", "avx2", "scalar") if set(PATH_FLAGS[p]) <= flags)


def pack_weight(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` uint8 codes -> ``(packed, special)``.

    ``packed`` is ``[ceil(N/16), ceil(K/2), 16, 2]``, zero-padded (zero codes add exact zeros): 32
    consecutive bytes are 16 output columns x 2 K-steps, one ``vdpbf16ps`` operand. ``special``
    is ``[ceil(N/16), ceil(K/2)]`` uint8, 1 where those 32 bytes hold a zero or subnormal magnitude
    (the kernel then decodes them with the table lookup; other groups skip it)."""
    N, K = codes.shape
    c = torch.nn.functional.pad(codes, (0, K % 2, 0, (-N) % 16))
    packed = c.view(c.shape[0] // 16, 16, c.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
    special = ((packed & 0x7F) < 8).view(packed.shape[0], packed.shape[1], 32).any(dim=2).to(torch.uint8)
    return packed, special


def _nan_codes(codes: torch.Tensor) -> bool:
    """E4M3FN's NaN codes (0x7F, 0xFF): the kernel's decoding would read them as 480. One scan in
    the extension where it is loaded (the three torch ops it replaces were a visible share of a
    decode-sized call: docs/performance.md, "Figures behind the code"), else torch."""
    mod = native.loaded()
    u8 = codes.contiguous().view(torch.uint8)
    if mod is not None:
        return bool(mod.has_nan_e4m3(u8))
    return bool(((u8 & 0x7F) == 0x7F).any())


@ieee_methods
class CpuFp8Backend(NativeBound, Backend):
    """FP8 codes read directly by a C++ kernel (see the module docstring).

    Examples
    --------
    >>> import torch, fp8ref
    >>> be = fp8ref.get_backend("cpu-fp8")
    >>> be.supports(fp8ref.Case(16, 4096, 4096, fp8ref.FP8_BLOCK))
    'cpu-fp8 takes per-row or per-tensor weight scales, not block'
    """

    name = "cpu-fp8"
    accumulation = Accumulation.FP32
    output_roundings = 1
    rejects_non_finite = True  # the spec's checks: x via the quantizer, bias via check_mm_args
    #: the kernel decodes NaN codes as 480: scaled_mm scans and refuses them
    non_finite = replace(SPEC_NON_FINITE, codes=RAISE)
    #: use vdpbf16ps where the CPU has avx512_bf16 (else the fp16-decode + fp32 FMA paths)
    bf16_dot = True
    #: force one unpacked path (``"avx512"``, ``"avx2"``, ``"scalar"``; tests); None: the best one
    isa: str | None = None

    @property
    def version(self) -> str:
        """What the selector's cache key holds of this backend's code: the C++ sources' digest."""
        return f"src={native.source_version()}"

    def available(self) -> str | None:
        return native.prepare()  # builds here, and only here, when FP8REF_CPU_FP8=1 asks

    def _scheme_reason(self, scheme: QuantScheme, what: str) -> str | None:
        if scheme.format != E4M3FN:
            return f"{self.name} decodes e4m3fn codes only; the {what} scheme is {scheme.format.name}"
        if scheme.granularity not in (Granularity.ROW, Granularity.TENSOR):
            return f"{self.name} takes per-row or per-tensor {what} scales, not {scheme.granularity.value}"
        return None

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"{self.name} runs on CPU tensors only, the case is on {case.device}"
        scheme_reason = (self._scheme_reason(case.recipe.weight, "weight")
                         or self._scheme_reason(case.recipe.activation, "activation"))
        if scheme_reason:  # what the kernel cannot express at all comes before this CPU's M limit
            return scheme_reason
        path = self._path()
        limit = _PATH_MAX_M[path]
        if case.M > limit:
            how = "" if path == "packed" else f" ({self._why_not_packed()})"
            return (f"cpu-fp8 runs its {path} kernel here{how}, a small-M kernel: M={case.M} > {limit} rows is "
                    "compute-bound; use cpu-bf16 or cpu-fp32")
        return None

    def _path(self) -> str:
        """The kernel path that runs (``gemm_path``), or the one ``isa`` forces (tests)."""
        if self.isa is not None:
            return self.isa
        return gemm_path(self.bf16_dot)

    def _why_not_packed(self) -> str:
        missing = [f for f in PATH_FLAGS["packed"] if f not in cpu_flags()]
        if missing:
            return f"this CPU ({cpu_model()}) lacks {', '.join(missing)}"
        return "bf16_dot is off" if not self.bf16_dot else f"isa={self.isa!r} forces it"

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        return fast_quantize(x, scheme, scale)

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        """Check the codes once (no NaN codes) so that ``scaled_mm`` need not re-read the weight."""
        reason = self._scheme_reason(w.scheme, "weight")
        if reason:
            raise ValueError(reason)
        if w.data.shape[1] == 0:  # before packing, which has no K to pack (the spec's rule and message)
            raise ValueError("w has 0 columns: the reduction dim K must be at least 1")
        if _nan_codes(w.data):
            raise ValueError(f"the weight holds NaN codes; {self.name} does not propagate NaN")
        codes = w.data.contiguous().view(torch.uint8)
        N = codes.shape[0]
        return PreparedWeight.wrap(w, self.name, codes=codes, packed=pack_weight(codes) if self._packed() else None,
                                   sb=w.scale.to(torch.float32).reshape(-1).expand(N).contiguous())

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               scheme: QuantScheme | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``scaled_mm(quantize(x), w, bias, out_dtype)`` in one pass for a weight this backend prepared.

        The same steps as the two calls, minus what a prepared weight and this backend's own
        quantizer make redundant: no ``Quantized`` of the activations, no NaN-code scan of codes
        the quantizer wrote from finite values, the weight's fp32 scales read from the prepared
        copy. Anything else (an unprepared weight, a static scale, another scheme, a shape or dtype
        the checks would refuse, an empty operand) takes the two calls, which raise or handle it.
        Per-call cost this saves on the decode path: docs/performance.md ("per-call path").
        """
        b, extra = unwrap(w, self.name)
        sb = extra.get("sb")
        if (sb is None or scheme is None or scale is not None or type(x) is not torch.Tensor or x.dim() != 2
                or x.shape[1] != b.data.shape[1] or not b.data.shape[0] or x.device.type != "cpu"
                or out_dtype not in _OUT
                or (bias is not None and (type(bias) is not torch.Tensor or bias.dtype not in _OUT
                                          or bias.shape != (b.data.shape[0],) or bias.device.type != "cpu"))
                or self._scheme_reason(scheme, "activation")):
            return super().linear(x, w, bias, out_dtype, scheme, scale)
        got = native_quant(x, scheme, 0)  # None: no extension, an empty x, a scheme it does not take
        if got is None:
            return super().linear(x, w, bias, out_dtype, scheme, scale)
        codes_a, sa, amax = got
        if not amax_all_finite(amax):
            return super().linear(x, w, bias, out_dtype, scheme, scale)  # raises as the quantizer does
        if bias is not None:
            check_finite(bias, "bias", _BIAS_NON_FINITE)
        M = codes_a.shape[0]
        sa = sa.reshape(-1).expand(M).contiguous()  # fp32 already: [M, 1] rows or [1, 1] for the tensor
        b32 = bias_fp32(bias, x.device)
        y = self._gemm(native.require(), codes_a, extra["codes"], extra, sa, sb,
                       (b32 if b32 is not None else sa, b32 is not None), out_dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def _bound_args(self, w, scheme: QuantScheme, out_dtype: torch.dtype) -> tuple | None:
        """``(fp8_linear, its arguments up to sb, its arguments from isa)`` for one prepared weight,
        or None where the bound path does not apply."""
        b, extra = unwrap(w, self.name)
        sb, codes = extra.get("sb"), extra.get("codes")
        mod = native.loaded()
        if (sb is None or codes is None or out_dtype not in _OUT or self._scheme_reason(scheme, "activation")
                or not fast_scheme(scheme) or mod is None or not hasattr(mod, "fp8_linear")):
            return None
        kernel = self._bound_kernel(extra)
        if kernel is None:
            return None
        pb, special, isa, rows = kernel
        args = (scheme.granularity is Granularity.TENSOR, scheme.qmax, scheme.amax_floor, *native_format_args(scheme),
                scheme.pow2_scale, codes, pb, special, sb)
        return mod.fp8_linear, args, (isa, rows, _OUT.index(out_dtype))

    #: Names whose change changes the kernel that runs (``_bind_state``): setting one bumps ``_epoch``.
    _KERNEL_SETTINGS = ("isa", "bf16_dot", "emulate")
    #: The watched call (``bind_watched_linear``): ``fp8_linear`` with the plan's checks.
    _WATCHED = "BoundLinear"

    def _bind_state(self) -> tuple:
        """The settings that pick this backend's kernel (tests force them on the shared instance)."""
        return self.isa, self.bf16_dot

    def _bound_kernel(self, extra: dict) -> tuple | None:
        """``(pb, special, isa, rows)``: ``fp8_linear``'s kernel arguments for the path that runs
        here (``_gemm``'s), or None."""
        path = self._path()
        if path == "packed":
            packed = extra.get("packed")
            return None if packed is None else (*packed, -1, PACKED_ROWS)
        return extra["codes"], extra["codes"], _GEMM_ISA[path], PACKED_ROWS

    def _packed(self) -> bool:
        """Whether the packed avx512_bf16 kernel runs (the CPU has the instructions; ``bf16_dot``)."""
        return self._path() == "packed"

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, extra = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        for q, what in ((a, "activation"), (b, "weight")):
            reason = self._scheme_reason(q.scheme, what)
            if reason:
                raise ValueError(reason)
        if a.data.device.type != "cpu":
            raise ValueError(f"{self.name} runs on CPU tensors only, got {a.data.device}")
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        codes = extra.get("codes")
        if codes is None:
            if _nan_codes(b.data):
                raise ValueError(f"the weight holds NaN codes; {self.name} does not propagate NaN")
            codes = b.data.contiguous().view(torch.uint8)
        if _nan_codes(a.data):
            raise ValueError(f"the activations hold NaN codes; {self.name} does not propagate NaN")
        mod = native.require()
        M, N = a.data.shape[0], b.data.shape[0]
        sa = a.scale.to(torch.float32).reshape(-1).expand(M).contiguous()
        sb = b.scale.to(torch.float32).reshape(-1).expand(N).contiguous()
        b32 = bias_fp32(bias, a.data.device)
        bias_arg = (b32 if b32 is not None else sa, b32 is not None)
        return self._gemm(mod, a.data.contiguous().view(torch.uint8), codes, extra, sa, sb, bias_arg,
                          out_dtype).to(out_dtype)

    def _gemm(self, mod, codes_a: torch.Tensor, codes_b: torch.Tensor, extra: dict, sa: torch.Tensor,
              sb: torch.Tensor, bias_arg: tuple, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The fp32 result ``(acc * sa) * sb (+ bias)`` of the kernel path that runs here (a kernel
        that rounds to ``out_dtype`` itself may return that instead: the same bits)."""
        N = codes_b.shape[0]
        if self._packed():
            packed = extra.get("packed")
            if packed is None:
                packed = pack_weight(codes_b)
            ys = [mod.fp8_e4m3_gemm_packed(codes_a[r:r + PACKED_ROWS], *packed, N, sa[r:r + PACKED_ROWS], sb,
                                           *bias_arg) for r in range(0, codes_a.shape[0], PACKED_ROWS)]
            return ys[0] if len(ys) == 1 else torch.cat(ys)
        return mod.fp8_e4m3_gemm(codes_a, codes_b, sa, sb, *bias_arg, _GEMM_ISA[self._path()])


if __name__ == "__main__":  # the build command's former home: a stale script fails loudly
    sys.exit("fp8ref: the build command is `python -m fp8ref.kernels.build` now")
register_backend(CpuFp8Backend())
