"""``fp8ref.linear(..., backend="auto")`` against bf16 ``F.linear`` at Llama-3.1-8B shapes (pytest-benchmark).

``benchmarks/bench_kernels.py`` times each backend; this file times what a user calls: the
selector's choice, through ``fp8ref.linear`` with a pre-quantized weight (quantized and prepared
once, cached by ``linear``; the first call, which selects, is the warm-up). The "fp8ref ratios"
section prints auto's throughput over bf16 ``F.linear``'s per shape, in the same run.

    pytest benchmarks/bench_linear.py --benchmark-enable
    FP8REF_BENCH_SHAPES=4096x4096 FP8REF_BENCH_M=1,16 pytest benchmarks/bench_linear.py --benchmark-enable

No timing is asserted.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fp8ref import W8A8_FP8, linear, quantize
from fp8ref.bench import LLAMA3_8B_SHAPES, M_VALUES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _shapes():
    env = os.environ.get("FP8REF_BENCH_SHAPES")
    return [tuple(int(v) for v in s.split("x")) for s in env.split(",")] if env else list(LLAMA3_8B_SHAPES)


def _ms():
    env = os.environ.get("FP8REF_BENCH_M")
    return [int(m) for m in env.split(",")] if env else list(M_VALUES)


_weights: dict = {}


def _weight(K, N):
    if (K, N) not in _weights:
        _weights.clear()  # one shape's weights at a time: 14336 x 4096 is large
        w = (torch.randn(N, K, generator=torch.Generator().manual_seed(0)) / K**0.5).to(torch.bfloat16).to(DEVICE)
        _weights[(K, N)] = (w, quantize(w, W8A8_FP8.weight))
    return _weights[(K, N)]


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("M", _ms())
@pytest.mark.parametrize("shape", _shapes(), ids=lambda s: f"K{s[0]}-N{s[1]}")
@pytest.mark.parametrize("variant", ["bf16-F.linear", "auto"])
def test_linear(benchmark, ratios, variant, shape, M):
    K, N = shape
    w, qw = _weight(K, N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(DEVICE)
    if variant == "bf16-F.linear":
        def run():
            y = F.linear(x, w)
            _sync()
            return y
    else:
        def run():
            y = linear(x, qw, recipe=W8A8_FP8, backend="auto")
            _sync()
            return y

    benchmark.group = f"linear K={K} N={N} M={M}"
    benchmark.extra_info.update(K=K, N=N, M=M, device=DEVICE)
    y = benchmark.pedantic(run, rounds=5 if M < 1024 else 3, warmup_rounds=1)
    assert y.shape == (M, N)
    ratios.record(benchmark, f"linear K={K} N={N} M={M}: auto vs bf16 F.linear", variant,
                  work=2 * M * N * K, unit="FLOP", baseline=variant == "bf16-F.linear")
