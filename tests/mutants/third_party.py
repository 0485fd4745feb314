"""Correct kernels written the way a third party writes them: a ``Backend`` subclass that declares
its accumulation and output roundings and nothing else (no ``non_finite``, no ``rejects_non_finite``),
with its own dequantization, sums and epilogues, and no knowledge of the suite's internals. A
rejection of any of them is a false alarm, a failing test of the suite (issue 39).

They differ from the spec where a correct kernel may: the order and blocking of the sums, split-K
with fp32 partials, float64 or compensated accumulation, dequantize-first, the E4M3FN operands
renormalised to E4M3FNUZ with a doubled scale (AMD), an own quantizer (``x / s`` with
``s = clamp(amax, floor) / qmax``); and where the spec's answer is only one of several that are
not defects: a NaN or Inf input propagates (IEEE arithmetic) instead of raising, K = 0 returns the
empty sum (the bias, or zeros) instead of raising.

Every kernel uses ``fp8ref.quantize`` (the spec's quantizer) unless it says otherwise, and only
public data of a ``Quantized`` (``data``, ``scale``, ``scheme.block_shape``).
"""

from __future__ import annotations

import math

import torch

import fp8ref
from fp8ref import Backend
from fp8ref.spec.bounds import Accumulation
from fp8ref.spec.quant import Quantized


def _expand(q: Quantized) -> torch.Tensor:
    """The scale broadcast to every element of ``q.data`` (fp32), as a kernel's prologue does."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    s = q.scale.to(torch.float32)
    return s.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def _deq(q: Quantized, dtype=torch.float32) -> torch.Tensor:
    """code * scale, one rounding to ``dtype``."""
    return q.data.to(dtype) * _expand(q).to(dtype)


def _epilogue(acc: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    return acc.to(out_dtype)


class _ThirdParty(Backend):
    """The declarations a third party writes: accumulation and output roundings, nothing else."""

    accumulation = Accumulation.FP32
    output_roundings = 1
    bug = ""

    def quantize(self, x, scheme, scale=None):
        return fp8ref.quantize(x, scheme, scale)


class PlainDequantMatmul(_ThirdParty):
    name = "tp-plain-dequant-matmul"
    bug = "dequantizes both operands in fp32, one fp32 matmul, bias added in fp32"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return _epilogue(_deq(a) @ _deq(b).T, bias, out_dtype)


class CodesThenScales(_ThirdParty):
    name = "tp-codes-then-scales"
    bug = ("per scale block of K, an fp32 matmul of the codes, then the row scale and the column scale applied "
           "(CUTLASS's epilogue order)")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        K = a.data.shape[1]
        ca = a.scheme.block_shape(*a.data.shape)[1]
        cb = b.scheme.block_shape(*b.data.shape)[1]
        step = math.gcd(ca, cb) if K else 1
        sa, sb = _expand(a), _expand(b)
        acc = torch.zeros(a.data.shape[0], b.data.shape[0])
        for k0 in range(0, K, step):
            s = a.data[:, k0:k0 + step].float() @ b.data[:, k0:k0 + step].float().T
            acc += s * sa[:, k0:k0 + 1] * sb[:, k0].reshape(1, -1)
        return _epilogue(acc, bias, out_dtype)


def _pairwise(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by halving (a tree), fp32 at every level."""
    while p.shape[-1] > 1:
        if p.shape[-1] % 2:
            p = torch.cat([p, torch.zeros_like(p[..., :1])], -1)
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0] if p.shape[-1] else p.sum(-1)


class PairwiseSum(_ThirdParty):
    name = "tp-pairwise-fp32"
    bug = "fp32 products of dequantized values summed pairwise (a reduction tree), a few output rows at a time"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        rows = max(1, (1 << 22) // max(1, B.shape[0] * A.shape[1]))  # products held at once: 4M
        out = [_pairwise(A[m:m + rows, None, :] * B[None, :, :]) for m in range(0, A.shape[0], rows)]
        acc = torch.cat(out) if out else torch.zeros(0, B.shape[0])
        return _epilogue(acc, bias, out_dtype)


class KahanSum(_ThirdParty):
    name = "tp-kahan-fp32"
    bug = "fp32 products of dequantized values summed in K order with Kahan compensation"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        s = torch.zeros(A.shape[0], B.shape[0])
        c = torch.zeros_like(s)
        for k in range(A.shape[1]):
            y = A[:, k, None] * B[None, :, k] - c
            t = s + y
            c = (t - s) - y
            s = t
        return _epilogue(s, bias, out_dtype)


class SplitK(_ThirdParty):
    name = "tp-split-k4"
    bug = "split-K: four K slices (not aligned to the scale blocks), fp32 partials added in slice order"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        K = A.shape[1]
        cuts = [round(i * K / 4) for i in range(5)]
        acc = torch.zeros(A.shape[0], B.shape[0])
        for k0, k1 in zip(cuts[:-1], cuts[1:], strict=True):
            acc = acc + A[:, k0:k1] @ B[:, k0:k1].T
        return _epilogue(acc, bias, out_dtype)


class KBlocked(_ThirdParty):
    name = "tp-k-blocked16"
    bug = "K in tiles of 16, each tile's fp32 dot product added to an fp32 accumulator (a tiled GEMM's main loop)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        acc = torch.zeros(A.shape[0], B.shape[0])
        for k0 in range(0, A.shape[1], 16):
            acc += torch.einsum("mk,nk->mn", A[:, k0:k0 + 16], B[:, k0:k0 + 16])
        return _epilogue(acc, bias, out_dtype)


class Float64Accumulate(_ThirdParty):
    name = "tp-float64"
    bug = "dequantizes in float64, float64 matmul and bias, one rounding to the output dtype (declares fp32)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return _epilogue(_deq(a, torch.float64) @ _deq(b, torch.float64).T, bias, out_dtype)


class NKMLoops(_ThirdParty):
    name = "tp-column-major-loops"
    bug = "the output column by column (n outer), each a matrix-vector product in fp32 of the transposed operands"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        out = torch.empty(B.shape[0], A.shape[0])
        for n in range(B.shape[0]):
            out[n] = A @ B[n]
        return _epilogue(out.T.contiguous(), bias, out_dtype)


class EvenOddK(_ThirdParty):
    name = "tp-even-odd-k"
    bug = "two fp32 accumulators, even and odd k (a two-way unrolled loop), added at the end"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        A, B = _deq(a), _deq(b)
        return _epilogue(A[:, 0::2] @ B[:, 0::2].T + A[:, 1::2] @ B[:, 1::2].T, bias, out_dtype)


def _to_fnuz(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3FN codes as E4M3FNUZ values of the same bits with the scale doubled (the FNUZ exponent
    bias is one more); -0 becomes 0 and the NaN codes become the FNUZ NaN (0x80)."""
    bits = q.data.view(torch.uint8).clone()
    nan = (bits & 0x7F) == 0x7F
    bits[bits == 0x80] = 0
    bits[nan] = 0x80
    return bits.view(torch.float8_e4m3fnuz).to(torch.float32), _expand(q) * 2


class FnuzNormalised(_ThirdParty):
    name = "tp-fnuz-normalised"
    bug = ("E4M3FN operands renormalised to E4M3FNUZ (same bits, scale x2, -0 to 0, NaN to the FNUZ NaN), "
           "as ROCm kernels take them; dequantized in fp32, one fp32 matmul")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        ops = []
        for q in (a, b):
            if q.data.dtype == torch.float8_e4m3fn:
                v, s = _to_fnuz(q)
                ops.append(v * s)
            else:
                ops.append(_deq(q))
        return _epilogue(ops[0] @ ops[1].T, bias, out_dtype)


class BiasAfterRounding(_ThirdParty):
    name = "tp-bias-after-rounding"
    output_roundings = 2
    bug = "the scaled product rounded to the output dtype, the bias added there (declares two output roundings)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = (_deq(a) @ _deq(b).T).to(out_dtype)
        return y if bias is None else (y.float() + bias.float()).to(out_dtype)


class OwnQuantizer(PlainDequantMatmul):
    name = "tp-own-quantizer"
    bug = ("its own dynamic quantizer: s = clamp(amax, floor) / qmax per tensor, row or group, codes = "
           "clamp(x / s) cast (NaN and Inf in x propagate through amax); declines the other schemes")

    def supports(self, case):
        s = case.recipe.activation
        if (not s.dynamic or s.pow2_scale or s.granularity.value == "block" or s.amax_floor == 0
                or torch.float32 != s.scale_dtype or torch.float32 != s.scale_compute_dtype or s.subnormal_scales
                or s.reciprocal_scale or s.multiplier_by_reciprocal or s.multiply_codes or s.multiplier_scale
                or s.qmax != s.format.max):
            return "quantizes per tensor, row or group with fp32 scales amax/qmax only"
        return None

    def quantize(self, x, scheme, scale=None):
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"x must be 2-D with at least one column, got shape {tuple(x.shape)}")
        rows, cols = x.shape
        xf = x.float()
        if scheme.granularity.value == "tensor":
            amax = torch.zeros(1, 1) if rows == 0 else xf.abs().amax().reshape(1, 1)
            c = cols
        else:  # per row, or per group of c columns
            c = scheme.group_size if scheme.granularity.value == "group" else cols
            pad = -cols % c
            amax = torch.nn.functional.pad(xf.abs(), (0, pad)).reshape(rows, (cols + pad) // c, c).amax(-1)
        s = amax.clamp(min=scheme.amax_floor) / scheme.qmax
        v = xf / s.repeat_interleave(c, 1)[:, :cols] if rows else xf
        data = v.clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
        return Quantized(data, s.reshape(scheme.scale_shape(rows, cols)), scheme)


class PretransposedWeight(PlainDequantMatmul):
    name = "tp-pretransposed-weight"
    bug = "prepare_weight stores the dequantized weight transposed ([K, N], fp32) at load; scaled_mm multiplies by it"

    def prepare_weight(self, w):
        return _deq(w).T.contiguous()

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        wt = b if isinstance(b, torch.Tensor) else _deq(b).T
        return _epilogue(_deq(a) @ wt, bias, out_dtype)


THIRD_PARTY = (PlainDequantMatmul, CodesThenScales, PairwiseSum, KahanSum, SplitK, KBlocked, Float64Accumulate,
               NKMLoops, EvenOddK, FnuzNormalised, BiasAfterRounding, OwnQuantizer, PretransposedWeight)

__all__ = [c.__name__ for c in THIRD_PARTY] + ["THIRD_PARTY"]
