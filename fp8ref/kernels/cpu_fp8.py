"""The ``cpu-fp8`` backend: a C++ kernel that reads the 1-byte FP8 weights directly (decode / small M).

For a few rows (decode) a linear layer is bound by reading the weight; a bf16 copy of the weight costs
two bytes per element, the FP8 codes one. Where the CPU has avx512_bf16, ``prepare_weight`` packs the
``[N, K]`` E4M3FN codes as ``[N/16, K/2, 16, 2]`` (``pack_weight``), the kernel decodes 32 codes at a
time to their exact bf16 bit patterns (one ``vdpbf16ps`` operand: 16 output columns x 2 K-steps) and
up to 16 activation rows share each decoded vector through broadcast pairs. Every product of two FP8
values is exact in fp32 and each addition rounds once in fp32; the epilogue ``(acc * sa) * sb +
bias`` is fp32, and torch rounds the fp32 result once to ``out_dtype``: ``Accumulation.FP32``,
``output_roundings=1`` (strict class). Without avx512_bf16: the codes are widened to fp16 bit patterns
(``(c & 0x7F) << 7 | sign << 15`` is the value times 2**-8 for every finite code) and multiplied-added
in fp32 (AVX-512 + F16C), or a scalar loop; same declaration.

The C++ lives in ``fp8ref/kernels/csrc/`` (``gemm_packed.cpp``, ``gemm.cpp``; ``decode.h``); the
same extension holds the fused per-row quantizer and scale epilogue used by ``fast_quantize``,
``cpu-bf16`` and ``cpu-fp32``. ``fp8ref.kernels.native`` builds and loads it: the backend is
available once this environment's build exists, which ``python -m fp8ref.kernels.cpu_fp8`` makes
(about a minute on two cores), or ``FP8REF_CPU_FP8=1`` at the first availability check; never a
selection's probe or a timed call.

Declines: other formats than E4M3FN, block/group scales (tensor and row only), non-CPU tensors, and
more than ``MAX_M`` rows (``MAX_M_FALLBACK`` without avx512_bf16). The packed kernel is strict-class
and beats bf16 ``F.linear`` up to M = 64 here, ties it at 128-256, and falls behind beyond.
"""

from __future__ import annotations

import sys

import torch

from .._machine import cpu_flags
from ..registry import Backend, Case, register_backend
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from . import native
from ._common import PreparedWeight, bias_fp32, check_mm_args, empty_result, fast_quantize, unwrap

__all__ = ["CpuFp8Backend", "pack_weight", "main", "MAX_M", "MAX_M_FALLBACK", "PACKED_ROWS"]

#: Rows beyond which the packed kernel declines. On this 2-core EPYC (quiet, Llama-3.1-8B shapes) it
#: ran at 1.45-1.8x bf16 ``F.linear``'s speed at M = 16, 1.04-1.17x at 64, 0.95-1.03x at 128,
#: 0.91-0.99x at 256 and 0.70-0.86x at 1024, where oneDNN's bf16 GEMM (cpu-bf16, 0.93-1.0x) wins.
#: The selector times buckets above 128 rows at 128 rows, so a larger limit could pick it there.
MAX_M = 256
#: Rows beyond which the fallback kernels (no avx512_bf16: fp16 decoding + fp32 FMAs, or scalar)
#: decline: one core of this EPYC measured that path at 0.78-1.27x bf16 ``F.linear`` at M = 4 and
#: 0.45x at M = 16.
MAX_M_FALLBACK = 4
#: Rows per call of the packed kernel: its activation pairs (K/2 x rows x 4 bytes) stay in L2
#: (2 MiB at K = 4096); 1024 rows at K = 14336 (29 MiB) ran 4x slower per row than 256.
PACKED_ROWS = 256


def _cpu_has_bf16_dot() -> bool:
    """avx512_bf16 (with avx512f/bw) on this CPU: asked of the loaded extension (what its packed
    path checks), else of /proc/cpuinfo (so that ``supports`` never loads or builds anything)."""
    global _has_bf16
    if _has_bf16 is None:
        mod = native.loaded()
        if mod is None:
            return {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags()  # not cached: the module may load
        _has_bf16 = bool(mod.has_bf16_dot())
    return _has_bf16


_has_bf16: bool | None = None


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
    """E4M3FN's NaN codes (0x7F, 0xFF): the kernel's decoding would read them as 480."""
    return bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any())


class CpuFp8Backend(Backend):
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
    #: use vdpbf16ps where the CPU has avx512_bf16 (else the fp16-decode + fp32 FMA path)
    bf16_dot = True

    def available(self) -> str | None:
        return native.prepare()  # builds here, and only here, when FP8REF_CPU_FP8=1 asks

    @staticmethod
    def _scheme_reason(scheme: QuantScheme, what: str) -> str | None:
        if scheme.format != E4M3FN:
            return f"cpu-fp8 decodes e4m3fn codes only; the {what} scheme is {scheme.format.name}"
        if scheme.granularity not in (Granularity.ROW, Granularity.TENSOR):
            return f"cpu-fp8 takes per-row or per-tensor {what} scales, not {scheme.granularity.value}"
        return None

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"cpu-fp8 runs on CPU tensors only, the case is on {case.device}"
        scheme_reason = (self._scheme_reason(case.recipe.weight, "weight")
                         or self._scheme_reason(case.recipe.activation, "activation"))
        if scheme_reason:  # what the kernel cannot express at all comes before this CPU's M limit
            return scheme_reason
        packed = self.bf16_dot and _cpu_has_bf16_dot()
        if case.M > (MAX_M if packed else MAX_M_FALLBACK):
            limit = MAX_M if packed else MAX_M_FALLBACK
            how = "" if packed else "without avx512_bf16, "
            return (f"{how}cpu-fp8 is a small-M kernel: M={case.M} > {limit} rows is compute-bound; use cpu-bf16 "
                    "or cpu-fp32")
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        return fast_quantize(x, scheme, scale)

    def prepare_weight(self, w: Quantized) -> PreparedWeight:
        """Check the codes once (no NaN codes) so that ``scaled_mm`` need not re-read the weight."""
        reason = self._scheme_reason(w.scheme, "weight")
        if reason:
            raise ValueError(reason)
        if _nan_codes(w.data):
            raise ValueError("the weight holds NaN codes; cpu-fp8 does not propagate NaN")
        codes = w.data.contiguous().view(torch.uint8)
        return PreparedWeight.wrap(w, self.name, codes=codes, packed=pack_weight(codes) if self._packed() else None)

    def _packed(self) -> bool:
        """Whether the packed avx512_bf16 kernel runs (the CPU has the instructions; ``bf16_dot``)."""
        return self.bf16_dot and _cpu_has_bf16_dot()

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        b, extra = unwrap(b, self.name)
        check_mm_args(a, b, bias, out_dtype)
        for q, what in ((a, "activation"), (b, "weight")):
            reason = self._scheme_reason(q.scheme, what)
            if reason:
                raise ValueError(reason)
        if a.data.device.type != "cpu":
            raise ValueError(f"cpu-fp8 runs on CPU tensors only, got {a.data.device}")
        empty = empty_result(a, b, out_dtype)
        if empty is not None:
            return empty
        codes = extra.get("codes")
        if codes is None:
            if _nan_codes(b.data):
                raise ValueError("the weight holds NaN codes; cpu-fp8 does not propagate NaN")
            codes = b.data.contiguous().view(torch.uint8)
        if _nan_codes(a.data):
            raise ValueError("the activations hold NaN codes; cpu-fp8 does not propagate NaN")
        mod = native.require()
        M, N = a.data.shape[0], b.data.shape[0]
        sa = a.scale.to(torch.float32).reshape(-1).expand(M).contiguous()
        sb = b.scale.to(torch.float32).reshape(-1).expand(N).contiguous()
        b32 = bias_fp32(bias, a.data.device)
        if self._packed():
            packed = extra.get("packed")
            if packed is None:
                packed = pack_weight(codes)
            codes_a = a.data.contiguous().view(torch.uint8)
            bias_arg = (b32 if b32 is not None else sa, b32 is not None)
            ys = [mod.fp8_e4m3_gemm_packed(codes_a[r:r + PACKED_ROWS], *packed, N, sa[r:r + PACKED_ROWS], sb,
                                           *bias_arg) for r in range(0, M, PACKED_ROWS)]
            return (ys[0] if len(ys) == 1 else torch.cat(ys)).to(out_dtype)
        y = mod.fp8_e4m3_gemm(a.data.contiguous().view(torch.uint8), codes, sa, sb,
                              b32 if b32 is not None else sa, b32 is not None)
        return y.to(out_dtype)


register_backend(CpuFp8Backend())


def main(argv: list[str] | None = None) -> int:
    """``python -m fp8ref.kernels.cpu_fp8 [-v]``: build this environment's extension (or find it built)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        mod = native.build(verbose="-v" in args)
    except RuntimeError as exc:
        print(f"fp8ref: the cpu-fp8 kernel is unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"cpu-fp8 kernel ready: {native.library_path()} "
          f"(avx512_bf16 dot products on this CPU: {'yes' if mod.has_bf16_dot() else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
