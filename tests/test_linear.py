"""fp8ref.linear: results within the spec's bounds, the weight cache, input checks, explain."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import fp8ref
from fp8ref import select as sel
from fp8ref.registry import Backend
from fp8ref.spec import bounds

L = sys.modules["fp8ref.api"]  # fp8ref.linear is the function; the module lives here


class Counting(Backend):
    """The reference with counters (exact class)."""

    name = "t-count"
    accumulation = fp8ref.Accumulation.EXACT

    def __init__(self):
        self.quantize_calls = self.prepare_calls = 0

    def quantize(self, x, scheme):
        self.quantize_calls += 1
        return fp8ref.quantize(x, scheme)

    def prepare_weight(self, w):
        self.prepare_calls += 1
        return ("prepared", w)

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        assert b[0] == "prepared"
        return fp8ref.scaled_mm(a, b[1], bias, out_dtype)


@pytest.fixture()
def iso(tmp_path, monkeypatch):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    monkeypatch.delenv(sel.ENV_CANDIDATES, raising=False)
    sel.clear_cache()
    L.clear_weight_cache()
    b = fp8ref.register_backend(Counting(), replace=True)
    yield b
    fp8ref.unregister_backend(b.name)
    sel.clear_cache()
    L.clear_weight_cache()


def test_reference_backend_equals_reference_linear(iso):
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 3, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    for recipe in (fp8ref.W8A8_FP8, fp8ref.FP8_PER_TENSOR, fp8ref.FP8_BLOCK):
        y = fp8ref.linear(x, w, bias, recipe=recipe, backend="reference")
        assert y.shape == (2, 3, 40)
        assert torch.equal(y, fp8ref.reference_linear(x, w, bias, recipe=recipe))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_within_end_to_end_bound(iso, dtype):
    """Whatever "auto" picks among the real backends, its output meets the end-to-end bound of the
    class it declares."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 256, generator=g) * torch.linspace(0.1, 20, 256)).to(dtype)
    w = (torch.randn(96, 256, generator=g) / 16).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    y = fp8ref.linear(x, w, bias)
    d = fp8ref.explain(x, w, bias)
    b = fp8ref.get_backend(d.chosen)
    qx, qw = b.quantize(x, fp8ref.W8A8_FP8.activation), fp8ref.quantize(w, fp8ref.W8A8_FP8.weight)
    y_true = x.double() @ w.double().T + bias.double()
    bound = bounds.linear_error_bound(x, w, qx, qw, bias, out_dtype=dtype, accumulation=b.accumulation,
                                      output_roundings=b.output_roundings)
    err = (y.double() - y_true).abs()
    assert y.dtype == dtype
    assert bool((err <= bound).all()), float((err / bound).max())


def test_weight_quantized_once_and_invalidated_in_place(iso, monkeypatch):
    monkeypatch.setenv(sel.ENV_CANDIDATES, iso.name)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 64, generator=g), torch.randn(32, 64, generator=g)
    n0, p0 = L.STATS["quantize_weight"], L.STATS["prepare_weight"]
    y1 = fp8ref.linear(x, w)
    for _ in range(3):
        assert torch.equal(fp8ref.linear(x, w), y1)
    fp8ref.linear(torch.randn(100, 64), w)  # another M bucket: still the same cached weight
    assert L.STATS["quantize_weight"] == n0 + 1
    assert L.STATS["prepare_weight"] == p0 + 1  # (the probe prepares its own synthetic weights)
    assert iso.quantize_calls >= 5  # activations are quantized every call, the weight never
    with torch.no_grad():
        w.mul_(-2.0)  # in place: bumps w._version
    y2 = fp8ref.linear(x, w)
    assert L.STATS["quantize_weight"] == n0 + 2 and L.STATS["prepare_weight"] == p0 + 2
    assert torch.equal(y2, fp8ref.reference_linear(x, w))
    assert not torch.equal(y2, y1)


def test_weight_cache_dies_with_the_weight(iso):
    w = torch.randn(32, 64)
    fp8ref.linear(torch.randn(2, 64), w, backend="reference")
    assert any(e.ref() is w for e in L._WEIGHTS.values())
    del w
    gc.collect()
    assert not L._WEIGHTS


def test_prequantized_weight(iso):
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    qw = fp8ref.quantize(w, fp8ref.W8A8_FP8.weight)
    n0 = L.STATS["quantize_weight"]
    y = fp8ref.linear(x, qw, backend="reference")
    assert L.STATS["quantize_weight"] == n0  # nothing to quantize
    assert torch.equal(y, fp8ref.reference_linear(x, w))
    with pytest.raises(ValueError, match="expects"):
        fp8ref.linear(x, qw, recipe=fp8ref.FP8_PER_TENSOR, backend="reference")


def test_bad_inputs_raise(iso):
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"but w is \[32, 64\]"):
        fp8ref.linear(torch.randn(3, 63), w, backend="reference")
    fp8ref.linear(torch.randn(3, 64), w, backend="reference")
    with pytest.raises(ValueError, match=r"but w is \[32, 64\]"):  # also once the dispatch is cached
        fp8ref.linear(torch.randn(3, 65), w, backend="reference")
    with pytest.raises(ValueError, match="bias"):
        fp8ref.linear(torch.randn(3, 64), w, torch.randn(31), backend="reference")
    with pytest.raises(TypeError, match="Quantized"):
        fp8ref.linear(torch.randn(3, 64), [[1.0]], backend="reference")
    with pytest.raises(ValueError, match="2-D"):
        fp8ref.linear(torch.randn(3, 64), torch.randn(2, 32, 64), backend="reference")
    static = fp8ref.Recipe("static", fp8ref.W8A8_FP8.weight, fp8ref.W8A8_FP8.activation.with_(dynamic=False))
    with pytest.raises(ValueError, match="static activation"):
        fp8ref.linear(torch.randn(3, 64), w, recipe=static, backend="reference")


def test_recipe_by_name_and_object_share_nothing_wrong(iso):
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    a = fp8ref.linear(x, w, recipe="fp8", backend="reference")
    b = fp8ref.linear(x, w, recipe=fp8ref.FP8_PER_TENSOR, backend="reference")
    c = fp8ref.linear(x, w, recipe="w8a8_fp8", backend="reference")
    assert torch.equal(a, b) and torch.equal(a, fp8ref.reference_linear(x, w, recipe="fp8"))
    assert torch.equal(c, fp8ref.reference_linear(x, w))


def test_inference_mode_tensors(iso):
    """Inference tensors have no version counter: the cache still works (keyed by identity)."""
    with torch.inference_mode():
        x, w = torch.randn(3, 64), torch.randn(32, 64)
        n0 = L.STATS["quantize_weight"]
        y = fp8ref.linear(x, w, backend="reference")
        assert torch.equal(fp8ref.linear(x, w, backend="reference"), y)
        assert L.STATS["quantize_weight"] == n0 + 1
        assert torch.equal(y, fp8ref.reference_linear(x, w))
