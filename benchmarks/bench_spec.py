"""The spec's own speed (pytest-benchmark): the reference quantizer and the exact reference GEMM.

``pytest benchmarks/bench_spec.py --benchmark-enable`` prints, in the "fp8ref ratios" section,
the reference ``scaled_mm`` at M=128, K=N=4096 as a time ratio to fp32 ``F.linear`` on the same
problem in the same run (the spec's target: within 3x), and the reference quantizer on a
[4096, 4096] bf16 tensor in GB/s against a memory copy of the same bytes. No timing is asserted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8ref import W8A8_FP8, QuantScheme, quantize, scaled_mm
from fp8ref.bench import quant_bytes

M, K, N = 128, 4096, 4096


@pytest.fixture(scope="module")
def gemm_operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    return x, w, quantize(x, W8A8_FP8.activation), quantize(w, W8A8_FP8.weight)


def test_fp32_linear_128x4096x4096(benchmark, ratios, gemm_operands):
    x, w, _, _ = gemm_operands
    benchmark.group = "spec: GEMM M=128 K=N=4096"
    benchmark.pedantic(F.linear, (x, w), rounds=7, warmup_rounds=1)
    ratios.record(benchmark, "reference scaled_mm vs fp32 F.linear (target: time <= 3x)", "fp32 F.linear",
                  work=2 * M * N * K, unit="FLOP", baseline=True)


def test_reference_scaled_mm_128x4096x4096(benchmark, ratios, gemm_operands):
    _, _, qa, qb = gemm_operands
    benchmark.group = "spec: GEMM M=128 K=N=4096"
    y = benchmark.pedantic(scaled_mm, (qa, qb), rounds=3, warmup_rounds=1)
    assert y.shape == (M, N)
    ratios.record(benchmark, "reference scaled_mm vs fp32 F.linear (target: time <= 3x)", "reference scaled_mm",
                  work=2 * M * N * K, unit="FLOP")


@pytest.fixture(scope="module")
def big_bf16():
    return torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_copy_4096x4096_bf16(benchmark, ratios, big_bf16):
    dst = torch.empty_like(big_bf16)
    benchmark.group = "spec: quantize [4096, 4096] bf16"
    benchmark.pedantic(dst.copy_, (big_bf16,), rounds=10, warmup_rounds=1)
    ratios.record(benchmark, "reference quantize [4096, 4096] bf16 vs memory copy", "copy (read + write)",
                  work=2 * big_bf16.numel() * big_bf16.element_size(), unit="B", baseline=True)


def test_reference_quantize_4096x4096_bf16(benchmark, ratios, big_bf16):
    scheme = QuantScheme()
    benchmark.group = "spec: quantize [4096, 4096] bf16"
    q = benchmark.pedantic(quantize, (big_bf16, scheme), rounds=3, warmup_rounds=1)
    assert q.data.shape == big_bf16.shape
    ratios.record(benchmark, "reference quantize [4096, 4096] bf16 vs memory copy",
                  f"reference quantize {scheme.short_str()}", work=quant_bytes(4096, 4096, torch.bfloat16, scheme),
                  unit="B")
