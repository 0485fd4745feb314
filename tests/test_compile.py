"""A quantized model under ``torch.compile(fullgraph=True)`` and ``torch.export``: one graph, no
break, outputs bit-identical to eager (``fp8ref.ops``: ``torch.ops.fp8ref.linear``).

Cost on 2 shared cores: about 15-25 s for the module. The inductor test compiles a model of two
stacked ``Fp8Linear`` (the graph holds only the two opaque ops, so inductor writes no C++ kernel);
models with elementwise ops between the layers compile with ``aot_eager``, which traces the same
graph (dynamo + AOT autograd) without inductor's C++ build (a minute on a busy 2-core machine).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import fp8ref
from fp8ref import ops
from fp8ref import select as sel

L = sys.modules["fp8ref.api"]


@pytest.fixture(autouse=True)
def iso(tmp_path, monkeypatch):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    sel.clear_cache()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    sel.clear_cache()
    L.clear_weight_cache()


def _model(*mods, dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(*mods).to(dtype)
    fp8ref.quantize_model(m, skip=())
    return m


def _mlp(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    return _model(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False), dtype=dtype)


def _assert_fp8_ops(gm: torch.fx.GraphModule, n: int) -> None:
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.fp8ref.linear.default) == n, targets


@torch.no_grad()
def test_explain_one_graph_no_break():
    m = _mlp()
    e = torch._dynamo.explain(m)(torch.randn(3, 64, dtype=torch.bfloat16))
    assert (e.graph_count, e.graph_break_count) == (1, 0), [r.reason for r in e.break_reasons]
    _assert_fp8_ops(e.graphs[0], 2)


@torch.no_grad()
def test_compile_fullgraph_matches_eager():
    dtype = torch.bfloat16
    m = _mlp(dtype)
    c = torch.compile(m, fullgraph=True, backend="aot_eager")
    for shape in [(3, 64), (1, 64), (2, 5, 64)]:  # prefill, decode, a batch: the dims become dynamic
        x = torch.randn(*shape, dtype=dtype)
        y, yc = m(x), c(x)
        assert yc.dtype == y.dtype and yc.shape == y.shape
        assert torch.equal(yc, y)


@torch.no_grad()
def test_compile_inductor_matches_eager():
    m = _model(nn.Linear(64, 64), nn.Linear(64, 32))
    c = torch.compile(m, fullgraph=True)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(c(x), m(x))


@torch.no_grad()
def test_export_matches_eager():
    m = _mlp()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ep = torch.export.export(m, (x,))
    _assert_fp8_ops(ep.graph_module, 2)
    assert torch.equal(ep.module()(x), m(x))


@torch.no_grad()
def test_export_dynamic_rows_and_out_dtype():
    m = _model(nn.Linear(64, 32))
    m[0].out_dtype = torch.float32
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("M", min=1, max=1024)},))
    for rows in (1, 7):
        xr = torch.randn(rows, 64, dtype=torch.bfloat16)
        y = ep.module()(xr)
        assert y.dtype == torch.float32 and torch.equal(y, m(xr))


def test_fake_gives_shape_and_dtype():
    q = fp8ref.Fp8Linear.from_linear(nn.Linear(16, 8))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(2, 3, 16, dtype=torch.bfloat16))
        y = torch.ops.fp8ref.linear(x, q.weight, q.weight_scale, q.bias, recipe="w8a8_fp8", backend="auto",
                                precision="standard", out_dtype=torch.float16)
    assert (tuple(y.shape), y.dtype) == ((2, 3, 8), torch.float16)


@torch.no_grad()
def test_op_equals_linear_and_checks_arguments():
    q = fp8ref.Fp8Linear.from_linear(nn.Linear(16, 8))
    x = torch.randn(5, 16)
    y = torch.ops.fp8ref.linear(x, q.weight, q.weight_scale, q.bias, recipe="w8a8_fp8", backend="reference",
                                precision="standard", out_dtype=None)
    assert torch.equal(y, fp8ref.linear(x, q.quantized_weight(), q.bias, backend="reference"))
    with pytest.raises(ValueError, match="x has 15 features"):
        torch.ops.fp8ref.linear(x[:, :15], q.weight, q.weight_scale, q.bias, recipe="w8a8_fp8", backend="auto",
                                precision="standard", out_dtype=None)
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        torch.ops.fp8ref.linear(x, q.weight, q.weight_scale, q.bias, recipe="nope", backend="auto",
                                precision="standard", out_dtype=None)


def test_recipe_key_of_a_custom_recipe():
    from fp8ref.spec.schemes import QuantScheme, Recipe

    r = Recipe("mine", QuantScheme(granularity="row"), QuantScheme(granularity="tensor"))
    key = ops.recipe_key(r)
    assert key != r.name and ops._recipe(key) is r
    assert ops.recipe_key(fp8ref.W8A8_FP8) == "w8a8_fp8"
