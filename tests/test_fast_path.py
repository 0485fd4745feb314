"""The per-call path of a decode step: cpu-fp8's fused ``linear`` on a prepared weight returns what
the two calls return, bit for bit, and raises what they raise (issue 35)."""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.registry import backend_quantize, get_backend

BACKENDS = ["cpu-fp8", "cpu-fp8-amx"]


def _backend(name):
    b = get_backend(name)
    reason = b.available()
    if reason:
        pytest.skip(f"{name}: {reason}")
    return b


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("recipe", [fp8ref.W8A8_FP8, fp8ref.FP8_PER_TENSOR])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fused_linear_is_the_two_calls(name, recipe, bias_dtype, out_dtype):
    b = _backend(name)
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 48, 80), (5, 17, 33), (300, 16, 64)):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        qw = fp8ref.quantize(torch.randn(N, K, generator=g), recipe.weight)
        bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
        prepared = b.prepare_weight(qw)
        y = b.linear(x, prepared, bias, out_dtype, recipe.activation)
        two = b.scaled_mm(backend_quantize(b, x, recipe.activation), prepared, bias, out_dtype)
        assert y.dtype == two.dtype == out_dtype
        assert torch.equal(y.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                           two.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("name", BACKENDS)
def test_fused_linear_raises_what_the_two_calls_raise(name):
    b = _backend(name)
    scheme = fp8ref.W8A8_FP8.activation
    prepared = b.prepare_weight(fp8ref.quantize(torch.randn(8, 16), fp8ref.W8A8_FP8.weight))
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        b.linear(x, prepared, None, torch.float32, scheme)
    bias = torch.zeros(8)
    bias[5] = float("inf")
    with pytest.raises(ValueError, match="bias"):
        b.linear(torch.randn(2, 16), prepared, bias, torch.float32, scheme)
    with pytest.raises(ValueError):
        b.linear(torch.randn(2, 15), prepared, None, torch.float32, scheme)
    assert b.linear(torch.randn(0, 16), prepared, None, torch.float32, scheme).shape == (0, 8)
