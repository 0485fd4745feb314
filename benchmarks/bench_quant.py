"""Quantization throughput per backend (pytest-benchmark), in GB/s against a memory copy of the same run.

``pytest benchmarks/bench_quant.py --benchmark-enable``: activations [1024, 4096] bf16 per
token, per group of 128 and per tensor; weights [4096, 4096] bf16 per channel and per 128x128
block; each on every backend available here. Bytes counted: the input read once, the FP8 codes
and the scales written once (``fp8ref.bench.quant_bytes``). The "fp8ref ratios" section prints
each GB/s over the copy's (bytes read + written). No timing is asserted.
"""

from __future__ import annotations

import pytest
import torch

from fp8ref.bench import QUANT_SCHEMES, available_backends, quant_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"activation": (1024, 4096), "weight": (4096, 4096)}
BACKENDS, SKIPPED = available_backends(DEVICE)
_inputs: dict = {}


def _input(role):
    if role not in _inputs:
        r, c = SHAPES[role]
        _inputs[role] = torch.randn(r, c, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    return _inputs[role]


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def test_copy_bandwidth(benchmark, ratios):
    src = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        _sync()

    benchmark.group = "quantization"
    benchmark.pedantic(copy, rounds=10, warmup_rounds=1)
    ratios.record(benchmark, f"quantization GB/s vs memory copy ({DEVICE})", "copy 256 MiB (read + write)",
                  work=2 * src.numel(), unit="B", baseline=True)


@pytest.mark.parametrize("backend", BACKENDS + sorted(SKIPPED))
@pytest.mark.parametrize("qname, role, scheme", QUANT_SCHEMES, ids=[q for q, _, _ in QUANT_SCHEMES])
def test_quantize(benchmark, ratios, backend, qname, role, scheme):
    if backend in SKIPPED:
        pytest.skip(f"{backend}: {SKIPPED[backend]}")
    from fp8ref import get_backend

    be = get_backend(backend)
    x = _input(role)
    try:
        be.quantize(x, scheme)
    except NotImplementedError as exc:
        pytest.skip(f"{backend} does not quantize {scheme.short_str()}: {exc}")

    def run():
        q = be.quantize(x, scheme)
        _sync()
        return q

    benchmark.group = f"quantize {qname}"
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    ratios.record(benchmark, f"quantization GB/s vs memory copy ({DEVICE})",
                  f"{backend} {qname} {'x'.join(map(str, x.shape))}",
                  work=quant_bytes(*x.shape, x.dtype, scheme), unit="B")
