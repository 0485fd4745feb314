"""Linear layer per backend at Llama-3.1-8B shapes, against bf16 ``F.linear`` (pytest-benchmark).

Run all shapes (long; do it on an otherwise idle machine)::

    pytest benchmarks/bench_kernels.py --benchmark-enable --benchmark-group-by=param:shape,param:M

or one shape / some M for a sanity run::

    FP8REF_BENCH_SHAPES=4096x4096 FP8REF_BENCH_M=1,128 pytest benchmarks/bench_kernels.py --benchmark-enable

Each benchmark is one FP8 W8A8 linear: activation quantization (per-token, dynamic) plus the
scaled GEMM with the weight prepared once (``prepare_weight``), or, for backends that offer it
(``cpu-bf16``/``cpu-fp32``), the fused ``linear`` method. Compare each row with the
``bf16-F.linear`` row of the same group; ratios, not absolute times, are what carries over.
No assertion is made on timings. ``torch._scaled_mm`` on CPU widens both operands to fp32 on
every call, so it is only run at M <= 16 to keep the run bounded.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fp8ref
from fp8ref.registry import Case, get_backend
from fp8ref.spec import quant

#: (K, N) of Llama-3.1-8B's linear layers: o_proj, gate/up_proj, down_proj, fused qkv_proj.
LLAMA_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144)]
MS = [1, 16, 128, 1024]


def _shapes():
    env = os.environ.get("FP8REF_BENCH_SHAPES")
    if not env:
        return LLAMA_SHAPES
    return [tuple(int(v) for v in s.split("x")) for s in env.split(",")]


def _ms():
    env = os.environ.get("FP8REF_BENCH_M")
    return [int(m) for m in env.split(",")] if env else MS


VARIANTS = ["bf16-F.linear", "torch", "torch-fast", "cpu-bf16", "cpu-bf16+compile", "cpu-fp32", "cpu-fp8", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_cache: dict = {}


def _weight(K, N):
    key = (K, N)
    if key not in _cache:
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        w = w.to(torch.bfloat16).to(DEVICE)
        _cache.clear()  # keep one shape's weights alive at a time (14336 x 4096 is large)
        _cache[key] = (w, quant.quantize(w, fp8ref.W8A8_FP8.weight))
    return _cache[key]


def _runner(variant, x, w, qw):
    act = fp8ref.W8A8_FP8.activation
    if variant == "bf16-F.linear":
        return lambda: F.linear(x, w)
    if variant == "cpu-bf16+compile":
        from fp8ref.kernels.cpu import CpuWideBackend

        be = CpuWideBackend("cpu-bf16+compile", torch.bfloat16, compile=True)
    else:
        be = get_backend(variant)
    reason = be.available() or be.supports(Case(x.shape[0], w.shape[0], x.shape[1], fp8ref.W8A8_FP8,
                                                 device=DEVICE))
    if reason:
        pytest.skip(f"{variant}: {reason}")
    if variant == "triton" and DEVICE == "cpu":
        pytest.skip("triton on CPU runs in the interpreter: timing it means nothing")
    if variant.startswith("torch") and DEVICE == "cpu" and x.shape[0] > 16:
        pytest.skip("torch._scaled_mm on CPU widens both operands to fp32 per call; run at M <= 16 only")
    prepared = be.prepare_weight(qw)
    if hasattr(be, "linear"):
        return lambda: be.linear(x, prepared, None, torch.bfloat16, act)
    return lambda: be.scaled_mm(be.quantize(x, act), prepared, None, torch.bfloat16)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M", _ms())
@pytest.mark.parametrize("shape", _shapes(), ids=[f"{k}x{n}" for k, n in _shapes()])
def test_linear(benchmark, shape, M, variant):
    K, N = shape
    w, qw = _weight(K, N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(DEVICE)
    fn = _runner(variant, x, w, qw)
    fn()  # warm-up (and the first torch.compile, outside the timing)
    benchmark.group = f"K{K}-N{N}-M{M}"
    benchmark.extra_info.update(K=K, N=N, M=M, variant=variant, threads=torch.get_num_threads())
    y = benchmark(fn)
    assert y.shape == (M, N)
