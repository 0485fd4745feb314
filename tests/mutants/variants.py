"""Correct but different: backends that compute differently from the base and declare it
honestly. The suite must accept every one. Between them they cover every accumulation class, and
the sequential ones reach at least half of their class's bound on the sweep's swamped dot products
(docs/mutants.md lists each one's worst error/bound)."""

from __future__ import annotations

import numpy as np
import torch

from fp8ref.spec import gemm, quant
from fp8ref.spec.bounds import Accumulation
from fp8ref.spec.quant import Quantized

from .base import (
    GEMM_OPS,
    Fp32Base,
    finish,
    fp32_mm,
    ml_dtypes,
    products,
    sequential_sum,
    static_divisor,
    truncating_sum,
)


class ReverseOrder(Fp32Base):
    name = "correct-reverse-order"
    changes = GEMM_OPS
    bug = "sums K in reverse order, one product at a time, in fp32"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, reverse=True))


class SequentialFp32(Fp32Base):
    name = "correct-sequential-fp32"
    changes = GEMM_OPS
    bug = "sums K in order, one product at a time, in fp32 (the order gamma_K is the worst case of)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=sequential_sum)


class ReciprocalQuantize(Fp32Base):
    name = "correct-reciprocal-quantize"
    bug = ("quantizes with x * (1/s) (two fp32 roundings) instead of x / s, static scales too; divides where 1/s "
           "overflows (a subnormal scale)")

    def quantize(self, x, scheme, scale=None):
        s = quant.quantize(x, scheme, scale).scale  # the spec's scale, and its argument checks
        d = static_divisor(x, s, scheme)
        inv = 1.0 / d
        # 1/s overflows for subnormal scales (subnormal_scales schemes): the magnitude sweep found that
        # x * (1/s) is then 0 * inf = NaN, the class of flashinfer#2440, so a conforming kernel divides there.
        v = torch.where(torch.isfinite(inv), x.to(torch.float32) * inv, x.to(torch.float32) / d)
        return Quantized(quant.round_to_format(v, scheme.format, scheme.qmax), s, scheme)


class DequantizeFirst(Fp32Base):
    name = "correct-dequantize-first"
    changes = GEMM_OPS
    bug = "applies the scales in fp32 before the product: deq(a) @ deq(b)^T in one fp32 GEMM"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        gemm.check_operands(a, b, bias, out_dtype, finite_bias=False)  # K = 0 raises; a NaN bias propagates
        y = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
        return finish(y, bias, out_dtype)


class KSplit(Fp32Base):
    name = "correct-k-split"
    changes = GEMM_OPS
    bug = "splits every K-segment in two halves, two fp32 GEMMs added (split-K with fp32 partials)"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        def halves(A, B):
            h = A.shape[1] // 2
            return A[:, :h] @ B[:, :h].T + A[:, h:] @ B[:, h:].T
        return fp32_mm(a, b, bias, out_dtype, seg_sum=halves)


class ExactFloat64(Fp32Base):
    name = "correct-exact-float64"
    changes = GEMM_OPS
    accumulation = Accumulation.EXACT
    bug = ("one float64 GEMM per K-segment (exact for E4M3 operands: every partial sum is a float64), "
           "float64 epilogue, one rounding; declares exact and declines E5M2, where float64 sums round")

    def supports(self, case):
        if "e5m2" in (case.recipe.activation.format.name, case.recipe.weight.format.name) and case.op != "quantize":
            return "float64 accumulation is exact for E4M3 operands only"
        return None

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        gemm.check_operands(a, b, bias, out_dtype, finite_bias=False)  # K = 0 raises; a NaN bias propagates
        y = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float64)
        for k0, k1 in gemm.k_segments(a, b):
            S = a.data[:, k0:k1].to(torch.float64) @ b.data[:, k0:k1].to(torch.float64).T
            y += S * torch.outer(gemm.scale_column(a, k0), gemm.scale_column(b, k0))
        return finish(y, bias, out_dtype)


class TwoRoundings(Fp32Base):
    name = "correct-two-roundings"
    changes = GEMM_OPS
    output_roundings = 2
    bug = ("rounds the scaled product to the output dtype, then adds the bias and rounds again, and declares "
           "two output roundings")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, None, out_dtype)
        if bias is None:
            return y
        return (y.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)


class ThreeRoundings(TwoRoundings):
    name = "correct-three-roundings"
    output_roundings = 3
    bug = ("rounds each K-segment's fp32 accumulator to the output dtype, applies the scales in fp32 and rounds "
           "again, then adds the bias and rounds a third time (product, scale and bias rounded apart), and declares "
           "three output roundings; declines fp16 outputs")

    def supports(self, case):
        if case.out_dtype == torch.float16 and case.op != "quantize":
            return "the raw accumulator of FP8 codes (up to K * qmax**2) overflows fp16"
        return None

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        y = fp32_mm(a, b, None, out_dtype, seg_sum=lambda A, B: (A @ B.T).to(out_dtype).to(torch.float32))
        if bias is None:
            return y
        return (y.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)


class FastPromote32(Fp32Base):
    name = "correct-fast-promote32"
    changes = GEMM_OPS
    accumulation = Accumulation("fast-promote32", 2.0**-13, promote_every=32)
    bug = ("14-bit truncating accumulation of 32 products at a time, chunk sums added in fp32 (Hopper's "
           "promotion); declares u = 2**-13 with promotion every 32")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: truncating_sum(A, B, 14, chunk=32))


class HonestBf16(Fp32Base):
    name = "correct-declared-bf16"
    changes = GEMM_OPS
    accumulation = Accumulation.BF16
    bug = "accumulates in bf16, one product at a time, and declares bf16 accumulation"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=lambda A, B: sequential_sum(A, B, ml_dtypes.bfloat16))


def _fp16_prescaled(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Sequential fp16 accumulation of each dot product's products pre-scaled by a power of two that
    puts its largest product at most 1 (so partial sums fit fp16's range for K < 65504; products
    below fp16's subnormals, 2**-24 of the largest, are lost: an absolute error far inside the bound)."""
    p = products(A, B)
    if p.shape[-1] == 0:
        return torch.zeros(A.shape[0], B.shape[0])
    big = np.abs(p).max(axis=-1, keepdims=True)
    e = np.where(big > 0, np.ceil(np.log2(np.where(big > 0, big, 1.0))), 0.0).astype(np.float32)
    scaled = (p * np.exp2(-e)).astype(np.float16)
    acc = np.add.accumulate(scaled, axis=-1)[..., -1].astype(np.float32)
    return torch.from_numpy(acc * np.exp2(e[..., 0]))


class DeclaredFp16(Fp32Base):
    name = "correct-declared-fp16"
    changes = GEMM_OPS
    accumulation = Accumulation.FP16
    bug = "accumulates in fp16 (products pre-scaled by a power of two into fp16's range) and declares fp16"

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        return fp32_mm(a, b, bias, out_dtype, seg_sum=_fp16_prescaled)


CORRECT = (Fp32Base, ReverseOrder, SequentialFp32, ReciprocalQuantize, DequantizeFirst, KSplit, ExactFloat64,
           TwoRoundings, ThreeRoundings, FastPromote32, HonestBf16, DeclaredFp16)

__all__ = [c.__name__ for c in CORRECT] + ["CORRECT"]
