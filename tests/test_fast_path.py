"""The per-call path of a decode step: cpu-fp8's fused ``linear`` on a prepared weight returns what
the two calls return, bit for bit, and raises what they raise (issue 35)."""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.registry import backend_quantize, get_backend

BACKENDS = ["cpu-fp8", "cpu-fp8-amx"]


pytestmark = pytest.mark.usefixtures("isolated_selection")


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


def _layer(N=24, K=40, bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return fp8ref.Fp8Linear.from_linear(torch.nn.Linear(K, N, bias=bias, dtype=dtype))


@torch.no_grad()
def test_layer_fast_path_is_fp8ref_linear(monkeypatch):
    from fp8ref import api

    q = _layer()
    for shape in ((1, 40), (3, 40), (2, 5, 40), (1, 1, 40), (300, 40)):
        for _ in range(2):  # the binding call and a bound one
            x = torch.randn(*shape, dtype=torch.bfloat16)
            y = q(x)
            ref = fp8ref.linear(x, q.quantized_weight(), q.bias, backend=q.backend)
            assert y.shape == ref.shape and torch.equal(y, ref)
    api.clear_weight_cache()
    q(torch.randn(2, 40, dtype=torch.bfloat16))
    assert not api._WEIGHTS  # bound calls keep no second prepared copy in fp8ref.linear's cache


@torch.no_grad()
def test_layer_fast_path_sees_what_changes(monkeypatch):
    from fp8ref import select as sel

    q = _layer()
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    q(x)
    q.weight.copy_(fp8ref.quantize(torch.randn(24, 40), q.recipe.weight).data)  # in place: a new version
    assert torch.equal(q(x), fp8ref.linear(x, q.quantized_weight(), q.bias, backend="reference"))
    q.bias = torch.nn.Parameter(torch.ones(24, dtype=torch.bfloat16), requires_grad=False)  # a new object
    assert torch.equal(q(x), fp8ref.linear(x, q.quantized_weight(), q.bias, backend="reference"))
    q.backend = "reference"
    q(x)
    assert next(iter(q._plans.plans.values())).backend.name == "reference"
    q.backend = "auto"
    monkeypatch.setenv(sel.ENV_BACKEND, "reference")
    q(x)
    assert all(b.backend.name == "reference" for b in q._plans.plans.values())
    q.out_dtype = torch.float32
    assert q(x).dtype == torch.float32


def test_layer_fast_path_errors_and_gradients():
    q = _layer()
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
        bad = x.clone()
        bad[2, 7] = float("inf")
        with pytest.raises(ValueError, match=r"x contains 1 non-finite value\(s\) \(first: inf at index \(2, 7\)\)"):
            q(bad)
        with pytest.raises(ValueError, match="x has 39 features"):
            q(x[:, :39])
        with pytest.raises(TypeError, match="x must have a float dtype"):
            q(x.to(torch.int32))
    xg = x.float().requires_grad_()
    y = q(xg)
    with pytest.raises(RuntimeError, match="fp8ref computes no gradients"):
        y.sum().backward()


@torch.no_grad()
def test_layer_fast_path_leaves_content_checks_to_linear_and_keeps_candidates():
    q = _layer()
    x = torch.randn(2, 40, dtype=torch.bfloat16)
    q.weight_check = "content"  # fp8ref.linear compares the weight's bytes on every call: no binding
    q(x)
    assert q._plans is None or not q._plans.plans
    q.weight_check = None
    q.candidates = ("reference",)
    assert torch.equal(q(x), fp8ref.linear(x, q.quantized_weight(), q.bias, backend="reference"))
    assert [b.backend.name for b in q._plans.plans.values()] == ["reference"]


@torch.no_grad()
def test_warm_calls_read_no_environment_and_plans_are_shared(monkeypatch):
    """A warm call runs its plan: no environment read, no new plan; the environment applies to plans
    built after a change, and to all after ``fp8ref.select.clear_cache()`` (issue 42)."""
    import os

    from fp8ref import select as sel

    class Counting(dict):
        reads = 0

        def get(self, *a):
            Counting.reads += 1
            return super().get(*a)

        def __getitem__(self, k):
            Counting.reads += 1
            return super().__getitem__(k)

    q = _layer()
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    w = torch.randn(24, 40)
    q(x), fp8ref.linear(x, w)
    plan = q.plan(x)
    monkeypatch.setattr(os, "environ", Counting(os.environ))
    for _ in range(3):
        q(x), fp8ref.linear(x, w)
    assert Counting.reads == 0
    assert q.plan(x) is plan  # the same plan object, reused
    os.environ[sel.ENV_BACKEND] = "reference"
    q(x)
    assert q.plan(x) is plan  # a warm plan keeps the choice it was built with
    sel.clear_cache()
    q(x)
    assert q.plan(x).backend.name == "reference" and Counting.reads > 0
