"""Deliberately broken backends, each modelled on a real upstream bug, and correct-but-different
ones: the conformance suite must reject every mutant and accept every correct variant.

Every backend here starts from ``Fp32Base`` -- the reference quantizer and an fp32 scaled GEMM
(per K-segment ``codes @ codes^T`` in fp32, scaled by ``sa sb`` in fp32, bias added last), which
conforms to the ``fp32`` declaration -- and changes one thing.
"""

from __future__ import annotations

import torch

from fp8ref.registry import Backend
from fp8ref.spec import gemm, quant
from fp8ref.spec.bounds import Accumulation
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import Granularity

# --------------------------------------------------------------------------------------------
# building blocks


def _segment_terms(a: Quantized, b: Quantized):
    """(A_seg fp32 codes, B_seg fp32 codes, sa fp32 [M], sb fp32 [N]) for each K-segment."""
    for k0, k1 in gemm.k_segments(a, b):
        yield (a.data[:, k0:k1].to(torch.float32), b.data[:, k0:k1].to(torch.float32),
               gemm.scale_column(a, k0).to(torch.float32), gemm.scale_column(b, k0).to(torch.float32))


def fp32_mm(a: Quantized, b: Quantized, bias, out_dtype, seg_sum=None, scale=None) -> torch.Tensor:
    """The correct fp32 pipeline, with hooks for the mutants: ``seg_sum(A, B) -> S`` and
    ``scale(S, sa, sb) -> scaled S``."""
    M, N = a.data.shape[0], b.data.shape[0]
    y = torch.zeros(M, N, dtype=torch.float32)
    for A, B, sa, sb in _segment_terms(a, b):
        S = A @ B.T if seg_sum is None else seg_sum(A, B)
        y += S * sa[:, None] * sb[None, :] if scale is None else scale(S, sa, sb)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(out_dtype)


def sequential_sum(A: torch.Tensor, B: torch.Tensor, round_acc, reverse: bool = False) -> torch.Tensor:
    """sum_k A[:, k] B[:, k] one k at a time, the accumulator passed through ``round_acc``."""
    acc = torch.zeros(A.shape[0], B.shape[0], dtype=torch.float32)
    ks = range(A.shape[1] - 1, -1, -1) if reverse else range(A.shape[1])
    for k in ks:
        acc = round_acc(acc + A[:, k, None] * B[None, :, k])
    return acc


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _truncate_bits(bits: int):
    def f(t: torch.Tensor) -> torch.Tensor:
        m, e = torch.frexp(t)
        return torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)
    return f


class Fp32Base(Backend):
    """Correct: reference quantizer, fp32 scaled GEMM."""

    name = "correct-fp32-base"
    accumulation = Accumulation.FP32
    output_roundings = 1
    upstream = ""
    bug = "the reference quantizer and an fp32 scaled GEMM (the base every other variant changes)"

    def quantize(self, x, scheme):
        return quant.quantize(x, scheme)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# mutants


class ZeroWeightsFp16(Fp32Base):
    name = "mutant-zero-weights-fp16"
    upstream = "sglang#4434"
    bug = "fp16 model + w8a8_fp8: quantized tensors come out all zero"

    def quantize(self, x, scheme):
        q = quant.quantize(x, scheme)
        if x.dtype == torch.float16:
            return Quantized(torch.zeros_like(q.data), q.scale, scheme)
        return q


class ScaleTwice(Fp32Base):
    name = "mutant-scale-twice"
    upstream = "sglang PR#28333"
    bug = "the weight scale is applied twice"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, scale=lambda S, sa, sb: S * sa[:, None] * sb[None, :] * sb[None, :])


class WeightScaleWrongAxis(Fp32Base):
    name = "mutant-weight-scale-wrong-axis"
    upstream = "vllm PR#12696"
    bug = "weight scales routed along the wrong axis (row m gets scale m of the weight)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        def scale(S, sa, sb):
            idx = torch.arange(S.shape[0]) % sb.shape[0]
            return S * (sa * sb[idx])[:, None]
        return fp32_mm(a, b, bias, out_dtype, scale=scale)


class DropKTail(Fp32Base):
    name = "mutant-drop-k-tail"
    upstream = "FBGEMM#6159"
    bug = "the trailing partial K block (K mod 128) is dropped"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        K = a.data.shape[1]
        kf = (K // 128) * 128
        keep = torch.arange(K) < kf
        a2 = Quantized(torch.where(keep, a.data.to(torch.float32), 0.0).to(a.data.dtype), a.scale, a.scheme)
        return fp32_mm(a2, b, bias, out_dtype)


class Bf16Accumulation(Fp32Base):
    name = "mutant-bf16-accumulation"
    upstream = "declared fp32, accumulates in bf16"
    bug = "the K accumulator is bf16 while the backend declares fp32 accumulation"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, _round_bf16))


class Acc14Bits(Fp32Base):
    name = "mutant-14-bit-accumulation"
    upstream = "DeepSeek-V3 report 3.3.2 (Hopper fast accumulation)"
    bug = "the K accumulator keeps 14 bits (truncating) while the backend declares fp32"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, _truncate_bits(14)))


class NanZeroRow(Fp32Base):
    name = "mutant-nan-zero-row"
    upstream = "pytorch/ao#4713, kernels-community#681"
    bug = "no amax floor: an all-zero block gets scale 0 and NaN codes"

    def quantize(self, x, scheme):
        rows, cols = x.shape
        r, c = scheme.block_shape(rows, cols)
        amax = quant._blocks(x.to(torch.float32).abs(), r, c).amax(dim=(1, 3))
        s = (amax / scheme.qmax).to(scheme.scale_dtype)
        v = x.to(torch.float32) / quant.expand_scale(s.to(torch.float32), scheme, rows, cols)
        data = torch.where(torch.isnan(v), v, torch.clamp(v, -scheme.qmax, scheme.qmax)).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)


class PerTensorActivation(Fp32Base):
    name = "mutant-per-tensor-activation"
    upstream = "vLLM per-tensor fallback instead of per-token"
    bug = "one amax for the whole tensor, broadcast into the per-token scale tensor"

    def quantize(self, x, scheme):
        if scheme.granularity is Granularity.TENSOR:
            return quant.quantize(x, scheme)
        s = quant.compute_scale(x, scheme.with_(granularity="tensor", group_size=None, block=None))
        s = s.expand(scheme.scale_shape(*x.shape)).contiguous()
        return Quantized(quant.quantize(x, scheme.with_(dynamic=False), s).data, s, scheme)


class Truncation(Fp32Base):
    name = "mutant-truncation"
    upstream = "round-toward-zero cast (triton#8322 class)"
    bug = "x/s is truncated toward zero instead of rounded to nearest even"

    def quantize(self, x, scheme):
        q = quant.quantize(x, scheme)
        rows, cols = x.shape
        v = x.to(torch.float32) / quant.expand_scale(q.scale.to(torch.float32), scheme, rows, cols)
        bits = q.data.view(torch.uint8).to(torch.int16)
        over = q.data.to(torch.float32).abs() > v.abs()
        mag = bits & 0x7F
        down = torch.where(over & (mag > 0), bits - 1, bits)
        down = torch.where((down & 0x7F) == 0, 0, down)  # never the FNUZ NaN byte 0x80
        return Quantized(down.to(torch.uint8).view(scheme.format.torch_dtype), q.scale, scheme)


class UnwrittenTail(Fp32Base):
    name = "mutant-unwritten-tail"
    upstream = "pytorch#133334"
    bug = "rows past the last full 16-row tile are never written"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        M, N = a.data.shape[0], b.data.shape[0]
        full = fp32_mm(a, b, bias, out_dtype)
        y = torch.empty(M, N, dtype=out_dtype)
        m_full = (M // 16) * 16
        y[:m_full] = full[:m_full]
        return y


class DelayedScalingNoClamp(Fp32Base):
    name = "mutant-delayed-scale-no-clamp"
    upstream = "transformers#42746 (cast without clamp -> NaN)"
    bug = "scale from the previous call's amax, cast without clamp: values past the range become NaN"

    def __init__(self):
        self._prev: dict = {}

    def quantize(self, x, scheme):
        key = (scheme, tuple(x.shape))
        own = quant.compute_scale(x, scheme)
        s = self._prev.get(key, own)
        self._prev[key] = own
        rows, cols = x.shape
        v = x.to(torch.float32) / quant.expand_scale(s.to(torch.float32), scheme, rows, cols)
        fmt = scheme.format
        over = v.abs() > quant.saturation_threshold(fmt, fmt.max)  # the old, non-saturating cast
        data = torch.where(over, float("nan"), v).to(fmt.torch_dtype)
        return Quantized(data, s, scheme)


class BiasTwice(Fp32Base):
    name = "mutant-bias-twice"
    upstream = "fused CUTLASS bias plus a torch epilogue bias (SGLang w8a8 paths)"
    bug = "the bias is added twice"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, bias, torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)


class FusedLinearBiasTwice(Fp32Base):
    name = "mutant-fused-linear-bias-twice"
    upstream = ("NVIDIA/TensorRT-LLM PR#18321 (a bias fused into the GEMM epilogue must be cleared before "
                "the post-GEMM add)")
    bug = "the fused linear() hook adds the bias in the epilogue and again afterwards; scaled_mm is right"

    def linear(self, x, w, bias=None, out_dtype=torch.bfloat16, scheme=None):
        y = super().linear(x, w, bias, torch.float32, scheme)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)


class Fp16CodeProducts(Fp32Base):
    name = "mutant-fp16-overflow-at-max"
    upstream = "torch-xpu-ops#1120"
    bug = "code products summed in fp16: inputs holding +-max overflow to Inf/NaN"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: (A.half() @ B.half().T).float())


class NanPaddedRows(Fp32Base):
    name = "mutant-nan-padded-rows"
    upstream = "flashinfer PR#3650"
    bug = "rows padded to a multiple of 16 with NaN poison the per-tensor amax of the valid rows"

    def quantize(self, x, scheme):
        if scheme.granularity is not Granularity.TENSOR or x.shape[0] % 16 == 0:
            return quant.quantize(x, scheme)
        pad = torch.full((16 - x.shape[0] % 16, x.shape[1]), float("nan"), dtype=torch.float32)
        amax = torch.cat([x.to(torch.float32), pad]).abs().amax()
        s = (torch.clamp(amax, min=scheme.amax_floor) / scheme.qmax).reshape(1, 1).to(scheme.scale_dtype)
        data = (x.to(torch.float32) / s.to(torch.float32)).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)


class TinyScaleReciprocal(Fp32Base):
    name = "mutant-tiny-scale-nan"
    upstream = "flashinfer#2440, #2595"
    bug = ("scale not clamped to a normal number, quantized with x * (1/s): 1/s overflows for tiny scales "
           "(0 * Inf = NaN)")

    def quantize(self, x, scheme):
        rows, cols = x.shape
        r, c = scheme.block_shape(rows, cols)
        amax = quant._blocks(x.to(torch.float32).abs(), r, c).amax(dim=(1, 3))
        s = torch.clamp(amax, min=scheme.amax_floor) / scheme.qmax
        s = torch.where(s == 0, torch.ones_like(s), s).to(scheme.scale_dtype)
        inv = 1.0 / quant.expand_scale(s.to(torch.float32), scheme, rows, cols)
        v = x.to(torch.float32) * inv
        data = torch.where(torch.isnan(v), v, torch.clamp(v, -scheme.qmax, scheme.qmax)).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)


# --------------------------------------------------------------------------------------------
# correct but different


class ReverseOrder(Fp32Base):
    name = "correct-reverse-order"
    bug = "sums K in reverse order, one product at a time, in fp32"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, lambda t: t, reverse=True))


class ReciprocalQuantize(Fp32Base):
    name = "correct-reciprocal-quantize"
    bug = "quantizes with x * (1/s) (two fp32 roundings) instead of x / s"

    def quantize(self, x, scheme):
        s = quant.compute_scale(x, scheme)
        rows, cols = x.shape
        v = x.to(torch.float32) * (1.0 / quant.expand_scale(s.to(torch.float32), scheme, rows, cols))
        return Quantized(quant.round_to_format(v, scheme.format, scheme.qmax), s, scheme)


class DequantizeFirst(Fp32Base):
    name = "correct-dequantize-first"
    bug = "applies the scales in fp32 before the product: deq(a) @ deq(b)^T in one fp32 GEMM"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)


class KSplit(Fp32Base):
    name = "correct-k-split"
    bug = "splits every K-segment in two halves, two fp32 GEMMs added"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        def halves(A, B):
            h = A.shape[1] // 2
            return A[:, :h] @ B[:, :h].T + A[:, h:] @ B[:, h:].T
        return fp32_mm(a, b, bias, out_dtype, seg_sum=halves)


class HonestBf16(Fp32Base):
    name = "correct-declared-bf16"
    accumulation = Accumulation.BF16
    bug = "accumulates in bf16 and declares bf16 accumulation (a looser bound, honestly declared)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, _round_bf16))


MUTANTS: tuple[type[Fp32Base], ...] = (
    ZeroWeightsFp16, ScaleTwice, WeightScaleWrongAxis, DropKTail, Bf16Accumulation, Acc14Bits,
    NanZeroRow, PerTensorActivation, Truncation, UnwrittenTail, DelayedScalingNoClamp, BiasTwice,
    Fp16CodeProducts, NanPaddedRows, TinyScaleReciprocal, FusedLinearBiasTwice,
)
CORRECT: tuple[type[Fp32Base], ...] = (Fp32Base, ReverseOrder, ReciprocalQuantize, DequantizeFirst, KSplit, HonestBf16)
