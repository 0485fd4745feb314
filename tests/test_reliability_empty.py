"""Reliability, class 2: M = 0 and N = 0 give the reference's empty output everywhere (issue 13).

docs/spec.md section 3: a linear with no rows (M = 0) or no output features (N = 0) returns an
empty ``[M, N]`` tensor of the output dtype, on every backend, through every entry point
(``Backend.quantize/scaled_mm/linear``, ``fp8ref.linear`` with a named backend or "auto",
``explain``, ``reference_linear``); K = 0 is the caller's error. Every *registered* backend that is
available here is fed these shapes, so a backend added later is covered without a new test.
"""

from __future__ import annotations

import pytest
import torch
from reliability_helpers import available, isolated, taking  # noqa: F401 (isolated: an autouse fixture)

import fp8ref
from fp8ref import select as sel
from fp8ref.cli import main
from fp8ref.kernels import cpu_fp8
from fp8ref.registry import get_backend
from fp8ref.select import compliance

SHAPES = [(0, 8), (4, 0), (0, 0)]
K = 32


def _taking(name: str, M: int, N: int, has_bias: bool) -> fp8ref.Backend:
    """The backend, where it takes the case's class (M and N of at least 1)."""
    return taking(name, fp8ref.Case(M=max(M, 1), N=max(N, 1), K=K, recipe=fp8ref.W8A8_FP8, has_bias=has_bias))


def test_every_available_backend_is_exercised():
    """The parametrisation below is over the registry: the reference and the CPU backends are there."""
    assert {"reference", "cpu-bf16", "cpu-fp32", "torch"} <= set(available())


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M, N", SHAPES, ids=[f"M{m}-N{n}" for m, n in SHAPES])
@pytest.mark.parametrize("name", available())
def test_backend_api_returns_the_empty_output(name, M, N, has_bias):
    b = _taking(name, M, N, has_bias)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16) if has_bias else None
    act = fp8ref.W8A8_FP8.activation
    qw = b.prepare_weight(fp8ref.quantize(torch.randn(N, K), fp8ref.W8A8_FP8.weight))
    qx = b.quantize(x, act)
    assert tuple(qx.data.shape) == (M, K)
    for y in (b.scaled_mm(qx, qw, bias, torch.bfloat16), b.linear(x, qw, bias, torch.bfloat16, act)):
        assert tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("M, N", SHAPES, ids=[f"M{m}-N{n}" for m, n in SHAPES])
@pytest.mark.parametrize("name", [*available(), "auto"])
def test_fp8ref_linear_returns_the_empty_output(name, M, N):
    if name != "auto":
        _taking(name, M, N, True)
    x = torch.randn(2, M // 2, K, dtype=torch.bfloat16)  # M rows, leading dims kept: [2, M/2, N]
    w, bias = torch.randn(N, K), torch.randn(N, dtype=torch.bfloat16)
    y = fp8ref.linear(x, w, bias, backend=name, precision="standard" if name == "auto" else "fast")
    assert tuple(y.shape) == (2, M // 2, N) and y.dtype == torch.bfloat16
    assert torch.equal(y, fp8ref.reference_linear(x, w, bias))


def test_n0_under_auto_probes_nothing(monkeypatch):
    """N = 0: nothing to compare, so no backend is probed or timed; the decision names the reference
    and says why, and it is not written to the disk cache."""
    monkeypatch.setattr(compliance, "ProbeSet", None)  # any probe would raise TypeError
    x, w = torch.randn(4, K), torch.randn(0, K)
    d = fp8ref.explain(x, w)
    assert d.chosen == "reference" and "N = 0" in d.table()
    assert tuple(fp8ref.linear(x, w).shape) == (4, 0)
    assert not sel.cache_file().exists()


def test_m0_under_auto_selects_for_the_first_bucket():
    x, w = torch.randn(0, K), torch.randn(8, K)
    d = fp8ref.explain(x, w)
    assert "Mb=1" in d.key and d.chosen in d.ranking


def test_cpu_fp8_packed_path_at_m0(monkeypatch):
    """cpu-fp8's packed path (avx512_bf16) concatenated an empty list of row blocks at M = 0
    (``torch.cat(): expected a non-empty list``); the empty output now returns before any kernel,
    so the path is checked here even on a CPU without the instructions."""
    b = get_backend("cpu-fp8")
    if b.available():
        pytest.skip(b.available())
    monkeypatch.setattr(cpu_fp8, "_cpu_has_bf16_dot", lambda: True)
    qw = b.prepare_weight(fp8ref.quantize(torch.randn(8, K), fp8ref.W8A8_FP8.weight))
    assert qw.extra["packed"] is not None
    qx = b.quantize(torch.randn(0, K), fp8ref.W8A8_FP8.activation)
    assert tuple(b.scaled_mm(qx, qw).shape) == (0, 8)


def test_k0_is_the_callers_error():
    with pytest.raises(ValueError, match=r"w has 0 columns: the reduction dim K must be at least 1"):
        fp8ref.linear(torch.randn(4, 0), torch.randn(8, 0), backend="reference")
    with pytest.raises(ValueError, match=r"x has 0 features .* but w is \[8, 16\]"):
        fp8ref.linear(torch.randn(4, 0), torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"Case\.K must be an int >= 1"):
        sel.select(fp8ref.Case(M=4, N=8, K=0, recipe=fp8ref.W8A8_FP8))


def test_cli_select_n0_prints_the_decision(capsys):
    assert main(["select", "--M", "4", "--N", "0", "--K", "16", "--candidates", "reference"]) == 0
    assert "N = 0: the output is empty" in capsys.readouterr().out
