"""Mutants: the correct base with one real upstream bug put back (``upstream`` cites it)."""

from __future__ import annotations

import torch

from fp8ref.spec import quant
from fp8ref.spec.bounds import Accumulation
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import Granularity

from .base import Fp32Base, bf16_round, finish, fp32_mm, reference_quantize, static_divisor, truncating_sum
from .variants import TwoRoundings

# --------------------------------------------------------------------------------------------
# the original catalogue


class ZeroWeightsFp16(Fp32Base):
    name = "mutant-zero-weights-fp16"
    upstream = "sglang#4434"
    klass = "scales and values"
    bug = "fp16 model + w8a8_fp8: quantized tensors come out all zero"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if x.dtype == torch.float16:
            return Quantized(torch.zeros_like(q.data), q.scale, scheme)
        return q


class ScaleTwice(Fp32Base):
    name = "mutant-scale-twice"
    upstream = "sglang PR#28333"
    klass = "scales and values"
    bug = "the weight scale is applied twice"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, scale=lambda S, sa, sb: S * sa[:, None] * sb[None, :] * sb[None, :])


class WeightScaleWrongAxis(Fp32Base):
    name = "mutant-weight-scale-wrong-axis"
    upstream = "vllm PR#12696"
    klass = "scale layouts"
    bug = "weight scales routed along the wrong axis (row m gets scale m of the weight)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        def scale(S, sa, sb):
            idx = torch.arange(S.shape[0]) % sb.shape[0]
            return S * (sa * sb[idx])[:, None]
        return fp32_mm(a, b, bias, out_dtype, scale=scale)


class DropKTail(Fp32Base):
    name = "mutant-drop-k-tail"
    upstream = "FBGEMM#6159"
    klass = "thresholds and tails"
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
    klass = "accumulation precision"
    bug = "the K accumulator is bf16 while the backend declares fp32 accumulation"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        from .base import ml_dtypes, sequential_sum

        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, ml_dtypes.bfloat16))


class Acc14Bits(Fp32Base):
    name = "mutant-14-bit-accumulation"
    upstream = "DeepSeek-V3 report 3.3.2 (Hopper fast accumulation)"
    klass = "accumulation precision"
    bug = "the K accumulator keeps 14 bits (truncating) while the backend declares fp32"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: truncating_sum(A, B, 14))


class NanZeroRow(Fp32Base):
    name = "mutant-nan-zero-row"
    upstream = "pytorch/ao#4713, kernels-community#681"
    klass = "scales and values"
    bug = "no amax floor: an all-zero block gets scale 0 and NaN codes"

    def quantize(self, x, scheme, scale=None):
        if scale is not None:
            return reference_quantize(x, scheme, scale)
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
    klass = "scales and values"
    bug = "one amax for the whole tensor, broadcast into the per-token scale tensor"

    def quantize(self, x, scheme, scale=None):
        if scheme.granularity is Granularity.TENSOR or scale is not None:
            return reference_quantize(x, scheme, scale)
        s = quant.compute_scale(x, scheme.with_(granularity="tensor", group_size=None, block=None))
        s = s.expand(scheme.scale_shape(*x.shape)).contiguous()
        return Quantized(quant.quantize(x, scheme.with_(dynamic=False), s).data, s, scheme)


class Truncation(Fp32Base):
    name = "mutant-truncation"
    upstream = "round-toward-zero cast (triton#8322 class)"
    klass = "format corners"
    bug = "x/s is truncated toward zero instead of rounded to nearest even"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
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
    klass = "thresholds and tails"
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
    klass = "scales and values"
    bug = "scale from the previous call's amax, cast without clamp: values past the range become NaN"

    def __init__(self):
        self._prev: dict = {}

    def quantize(self, x, scheme, scale=None):
        if scale is not None:
            return reference_quantize(x, scheme, scale)
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
    klass = "scales and values"
    bug = "the bias is added twice"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, bias, torch.float32)
        return finish(y, bias, out_dtype)


class FusedLinearBiasTwice(Fp32Base):
    name = "mutant-fused-linear-bias-twice"
    upstream = ("NVIDIA/TensorRT-LLM PR#18321 (a bias fused into the GEMM epilogue must be cleared before "
                "the post-GEMM add)")
    klass = "scales and values"
    bug = "the fused linear() hook adds the bias in the epilogue and again afterwards; scaled_mm is right"

    def linear(self, x, w, bias=None, out_dtype=torch.bfloat16, scheme=None, scale=None):
        y = super().linear(x, w, bias, torch.float32, scheme, scale)
        return finish(y, bias, out_dtype)


class Fp16CodeProducts(Fp32Base):
    name = "mutant-fp16-overflow-at-max"
    upstream = "torch-xpu-ops#1120"
    klass = "scales and values"
    bug = "code products summed in fp16: inputs holding +-max overflow to Inf/NaN"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: (A.half() @ B.half().T).float())


class NanPaddedRows(Fp32Base):
    name = "mutant-nan-padded-rows"
    upstream = "flashinfer PR#3650"
    klass = "thresholds and tails"
    bug = "rows padded to a multiple of 16 with NaN poison the per-tensor amax of the valid rows"

    def quantize(self, x, scheme, scale=None):
        if scheme.granularity is not Granularity.TENSOR or x.shape[0] % 16 == 0 or scale is not None:
            return reference_quantize(x, scheme, scale)
        pad = torch.full((16 - x.shape[0] % 16, x.shape[1]), float("nan"), dtype=torch.float32)
        amax = torch.cat([x.to(torch.float32), pad]).abs().amax()
        s = (torch.clamp(amax, min=scheme.amax_floor) / scheme.qmax).reshape(1, 1).to(scheme.scale_dtype)
        data = (x.to(torch.float32) / s.to(torch.float32)).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)


class TinyScaleReciprocal(Fp32Base):
    name = "mutant-tiny-scale-nan"
    upstream = "flashinfer#2440, #2595"
    klass = "format corners"
    bug = ("scale not clamped to a normal number, quantized with x * (1/s): 1/s overflows for tiny scales "
           "(0 * Inf = NaN)")

    def quantize(self, x, scheme, scale=None):
        if scale is not None:
            return reference_quantize(x, scheme, scale)
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
# thresholds and tails


def _quantize_with_amax_of(x, scheme, seen: torch.Tensor) -> Quantized:
    """The spec's dynamic quantization, except that each block's amax is taken over the elements
    where ``seen`` is True only (what a reduction that skips elements computes)."""
    s = quant.compute_scale(torch.where(seen, x, torch.zeros_like(x)), scheme)
    return Quantized(quant.quantize(x, scheme.with_(dynamic=False), s).data, s, scheme)


def _block_cols(x, scheme) -> torch.Tensor:
    """For every element, its column index inside its scale block, and the block's width."""
    rows, cols = x.shape
    _, c = scheme.block_shape(rows, cols)
    j = torch.arange(cols)
    width = torch.clamp(cols - (j // c) * c, max=c)
    return (j % c).expand(rows, cols), width.expand(rows, cols)


class VectorTailAmax(Fp32Base):
    name = "mutant-quant-vector-tail-amax"
    upstream = "sglang#8460 / PR#8543 (per_token_quant_fp8 with a hidden dim not divisible by its vector width)"
    klass = "thresholds and tails"
    bug = ("the amax of each scale block runs over whole 8-wide vectors only: the last (width mod 8) elements "
           "of a block are left out of its scale")

    def quantize(self, x, scheme, scale=None):
        if scale is not None or x.shape[1] < 8 or scheme.granularity is Granularity.TENSOR:
            return reference_quantize(x, scheme, scale)
        j, width = _block_cols(x, scheme)
        vector_part = width // 8 * 8
        return _quantize_with_amax_of(x, scheme, (j < vector_part) | (vector_part == 0))


def _tail_rows(n: int, tile: int, to) -> torch.Tensor | None:
    """Index of the scale each of ``n`` rows reads when the rows past the last full ``tile`` read
    ``to(index, first_tail_row)`` instead of their own; None when there is no partial tile."""
    full = n // tile * tile
    if n <= tile or full == n:
        return None
    idx = torch.arange(n)
    return torch.where(idx >= full, to(idx, full), idx)


class NTailWeightScale(Fp32Base):
    name = "mutant-gemm-n-tail-scale"
    upstream = "FBGEMM#6157 / PR#6158 (w_scale loaded unmasked when N is not a multiple of the block)"
    klass = "thresholds and tails"
    bug = "output columns past the last full 16-column tile use the weight scale of the column 16 before"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        idx = _tail_rows(b.data.shape[0], 16, lambda i, full: i - 16)
        if idx is None:
            return fp32_mm(a, b, bias, out_dtype)
        return fp32_mm(a, b, bias, out_dtype, scale=lambda S, sa, sb: S * sa[:, None] * sb[idx][None, :])


class MTileActivationScale(Fp32Base):
    name = "mutant-m-tile-scale"
    upstream = "pytorch#133334 (rowwise scaled_mm reads x_scale wrongly when M % 256 != 0); DeepGEMM#268"
    klass = "thresholds and tails"
    bug = "above M = 64, rows of the last partial 64-row tile all use the activation scale of the tile's first row"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        idx = _tail_rows(a.data.shape[0], 64, lambda i, full: torch.full_like(i, full))
        if idx is None:
            return fp32_mm(a, b, bias, out_dtype)
        return fp32_mm(a, b, bias, out_dtype, scale=lambda S, sa, sb: S * sa[idx][:, None] * sb[None, :])


class SplitKBf16Partials(Fp32Base):
    name = "mutant-split-k-bf16-partials"
    upstream = ("NVIDIA/TransformerEngine PR#3440 (split-K with bf16 partials); modular#7165; "
                "flagos-ai/FlagGems PR#5876")
    klass = "thresholds and tails"
    bug = "for K >= 512 a split-K path rounds each of its 4 fp32 partial sums to bf16 before adding them"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[1] < 512:
            return fp32_mm(a, b, bias, out_dtype)

        def split(A, B):
            parts = torch.tensor_split(torch.arange(A.shape[1]), 4)
            return sum(bf16_round(A[:, p] @ B[:, p].T) for p in parts)
        return fp32_mm(a, b, bias, out_dtype, seg_sum=split)


# --------------------------------------------------------------------------------------------
# static scales


class _StaticBug(Fp32Base):
    """The reference on dynamic schemes; ``static_codes`` on static ones (the caller's scale is
    returned as given)."""

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if scale is None:
            return q
        return Quantized(self.static_codes(x, scheme, q.scale), q.scale, scheme)

    def static_codes(self, x, scheme, stored) -> torch.Tensor:
        raise NotImplementedError


class StaticNoClamp(_StaticBug):
    name = "mutant-static-no-clamp"
    upstream = "huggingface/transformers PR#42775 (static FP8: clamp before the cast); vllm PR#29867"
    klass = "static scales"
    bug = ("static scales: x / s is cast without a clamp; the cast gives NaN past the format's range and "
           "codes beyond a reduced qmax")

    def static_codes(self, x, scheme, stored):
        v = x.to(torch.float32) / static_divisor(x, stored, scheme)
        fmt = scheme.format
        over = v.abs() > quant.saturation_threshold(fmt, fmt.max)
        return torch.where(over, float("nan"), v).to(fmt.torch_dtype)


class StaticFirstScaleOnly(_StaticBug):
    name = "mutant-static-first-scale-only"
    upstream = "vllm PR#20076 (static_scaled_fp8_quant silently used the first element of a scale array)"
    klass = "static scales"
    bug = "static per-token/group/block scales: every element is divided by the first scale"

    def static_codes(self, x, scheme, stored):
        return quant.quantize(x, scheme, stored.flatten()[:1].expand(stored.shape).contiguous()).data


class StaticScaleInverted(_StaticBug):
    name = "mutant-static-scale-inverted"
    upstream = "meta-pytorch/tritonbench PR#1145 (quantization scale direction); vllm PR#36297 (review)"
    klass = "static scales"
    bug = "a static (dequantization) scale is used as the quantization multiplier: x * s instead of x / s"

    def static_codes(self, x, scheme, stored):
        v = x.to(torch.float32) * static_divisor(x, stored, scheme)
        return quant.round_to_format(v, scheme.format, scheme.qmax)


# --------------------------------------------------------------------------------------------
# extreme-value position


class TensorAmaxFirstRows(Fp32Base):
    name = "mutant-tensor-amax-first-rows"
    upstream = "AMD-AGI/Primus-Turbo PR#306 (multi-round amax reduction returned the first tile's amax)"
    klass = "extreme-value position"
    bug = "the per-tensor amax is reduced over the first 256 rows only"

    def quantize(self, x, scheme, scale=None):
        if scale is not None or scheme.granularity is not Granularity.TENSOR or x.shape[0] <= 256:
            return reference_quantize(x, scheme, scale)
        return _quantize_with_amax_of(x, scheme, (torch.arange(x.shape[0]) < 256).reshape(-1, 1).expand_as(x))


class GroupAmaxSkipsLast(Fp32Base):
    name = "mutant-group-amax-skips-last"
    upstream = "vllm-project/vllm-xpu-kernels PR#521 (group absmax reduction wrong for group_size/VEC > 32)"
    klass = "extreme-value position"
    bug = "for groups wider than 32, the group amax misses the group's last element"

    def quantize(self, x, scheme, scale=None):
        if scale is not None or scheme.granularity is not Granularity.GROUP or scheme.group_size <= 32:
            return reference_quantize(x, scheme, scale)
        j, width = _block_cols(x, scheme)
        return _quantize_with_amax_of(x, scheme, (j != scheme.group_size - 1) | (width < scheme.group_size))


# --------------------------------------------------------------------------------------------
# scale layouts


def _column_major(s: torch.Tensor) -> torch.Tensor:
    """A row-major [R, C] scale grid read as if it were stored column-major."""
    R, C = s.shape
    return s.flatten().reshape(C, R).T.contiguous()


class BlockScaleColumnMajor(Fp32Base):
    name = "mutant-block-scale-column-major"
    upstream = "flashinfer#2147 (blockwise FP8 scales: column-major documented, row-major read); cutlass#2405"
    klass = "scale layouts"
    bug = "a weight block-scale grid of several rows and columns is read as if stored column-major"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        s = b.scale
        if b.scheme.granularity is Granularity.BLOCK and s.shape[0] > 1 and s.shape[1] > 1:
            b = Quantized(b.data, _column_major(s), b.scheme)
        return fp32_mm(a, b, bias, out_dtype)


class GroupScaleStride(Fp32Base):
    name = "mutant-group-scale-stride"
    upstream = "vllm PR#49596 (XPU block FP8: group width computed as N / n_blocks instead of the block size)"
    klass = "scale layouts"
    bug = "activation group scales indexed with a group width of K / n_groups instead of the group size"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.scheme.granularity is not Granularity.GROUP:
            return fp32_mm(a, b, bias, out_dtype)
        M, K = a.data.shape
        n_groups = a.scale.shape[1]
        width = K / n_groups
        group = torch.clamp((torch.arange(K) / width).floor().long(), max=n_groups - 1)
        sa_full = a.scale.to(torch.float32)[:, group]  # [M, K]: the (misindexed) scale of every element
        A = a.data.to(torch.float32) * sa_full
        B = b.dequantize(torch.float32)
        y = A @ B.T
        return finish(y, bias, out_dtype)


# --------------------------------------------------------------------------------------------
# format corners


class FnuzNegativeZero(Fp32Base):
    name = "mutant-fnuz-negative-zero"
    upstream = "microsoft/onnxruntime PR#18473, onnx/onnx PR#5764 (near-zero negatives must convert to 0, not NaN)"
    klass = "format corners"
    bug = "E4M3FNUZ: a negative value that rounds to zero keeps its sign bit, giving byte 0x80 (NaN)"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if scheme.format.has_negative_zero:
            return q
        bits = q.data.view(torch.uint8).clone()
        bits[(bits == 0) & (x < 0)] = 0x80
        return Quantized(bits.view(scheme.format.torch_dtype), q.scale, scheme)


class E5M2ClampAt448(Fp32Base):
    name = "mutant-e5m2-clamp-448"
    upstream = "flashinfer#4053 / PR#2612 (FP8 output clamped to the E4M3 range for E5M2)"
    klass = "format corners"
    bug = "E5M2 values are clamped at 448, the E4M3 maximum, instead of 57344"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        if scheme.format.name != "e5m2":
            return q
        v = x.to(torch.float32) / static_divisor(x, q.scale, scheme)
        return Quantized(torch.clamp(v, -448.0, 448.0).to(scheme.format.torch_dtype), q.scale, scheme)


class SubnormalFlush(Fp32Base):
    name = "mutant-fp8-subnormal-flush"
    upstream = "tenstorrent/tt-metal PR#29734 (E4M3 conversion flushes denormals to zero); iree PR#20242"
    klass = "format corners"
    bug = "x / s below the format's smallest normal is flushed to zero instead of rounded to a subnormal"

    def quantize(self, x, scheme, scale=None):
        q = reference_quantize(x, scheme, scale)
        vals = q.data.to(torch.float32)
        flushed = torch.where(vals.abs() < scheme.format.smallest_normal, torch.zeros_like(vals), vals)
        return Quantized(flushed.to(scheme.format.torch_dtype), q.scale, scheme)


# --------------------------------------------------------------------------------------------
# rounding count


class BiasAfterOutputRounding(TwoRoundings):
    name = "mutant-bias-after-output-rounding"
    output_roundings = 1
    upstream = "NVIDIA/TensorRT-LLM PR#17505 (gemm + bias rounded to bf16 twice); FBGEMM PR#4095"
    klass = "rounding count"
    bug = ("the scaled product is rounded to the output dtype, then the bias added and rounded again, while "
           "the backend declares one rounding (correct-two-roundings computes the same and declares two)")


# --------------------------------------------------------------------------------------------
# accumulation precision


class FastAccumLongK(Fp32Base):
    name = "mutant-fast-accum-long-k"
    upstream = ("DeepSeek-V3 report 3.3.2 (14-bit tensor-core accumulation); torchao use_fast_accum=True default "
                "(CONVENTIONS.md)")
    klass = "accumulation precision"
    bug = "declares fp32, but for K > 256 a fast path accumulates 128-product chunks in 14 bits (fp32 promotion)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[1] <= 256:
            return fp32_mm(a, b, bias, out_dtype)
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: truncating_sum(A, B, 14, chunk=128))


class Fp16PartialsDeclaredFast(Fp32Base):
    name = "mutant-fp16-acc-declared-fast"
    accumulation = Accumulation.FAST
    upstream = "flashinfer PR#900 (16-bit split-k partial outputs)"
    klass = "accumulation precision"
    bug = "declares fast accumulation (14 bits), accumulates with an 11-bit (fp16) significand"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: truncating_sum(A, B, 11))


MUTANTS = (
    ZeroWeightsFp16, ScaleTwice, WeightScaleWrongAxis, DropKTail, Bf16Accumulation, Acc14Bits,
    NanZeroRow, PerTensorActivation, Truncation, UnwrittenTail, DelayedScalingNoClamp, BiasTwice,
    Fp16CodeProducts, NanPaddedRows, TinyScaleReciprocal, FusedLinearBiasTwice,
    # issue 11: one or more per class of docs/conformance.md
    VectorTailAmax, NTailWeightScale, MTileActivationScale, SplitKBf16Partials,
    StaticNoClamp, StaticFirstScaleOnly, StaticScaleInverted,
    TensorAmaxFirstRows, GroupAmaxSkipsLast,
    BlockScaleColumnMajor, GroupScaleStride,
    FnuzNegativeZero, E5M2ClampAt448, SubnormalFlush,
    BiasAfterOutputRounding,
    FastAccumLongK, Fp16PartialsDeclaredFast,
)

__all__ = [m.__name__ for m in MUTANTS] + ["MUTANTS"]
