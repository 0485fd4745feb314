"""fp8ref.moe and its selector, and the shipped MoE backends' certificates (fp8ref.conformance.moe)."""

import pytest
import torch

import fp8ref
from fp8ref.conformance.moe import check_moe
from fp8ref.registry import _MOE_REGISTRY
from fp8ref.select.moe import clear_moe_cache, select_moe
from fp8ref.spec.compare import compare
from fp8ref.spec.moe import moe_exact
from fp8ref.spec.moe_bounds import moe_error_bound

S = fp8ref.QuantScheme(granularity="tensor")
SCHEME = fp8ref.MoeScheme(S, S, S)


def _problem():
    gen = torch.Generator().manual_seed(3)
    w = fp8ref.quantize_experts(torch.randn(4, 48, 40, generator=gen) / 8, torch.randn(4, 40, 24, generator=gen) / 8, S)
    r = fp8ref.Routing(torch.randint(0, 4, (5, 2), generator=gen), torch.rand(5, 2, generator=gen))
    return torch.randn(5, 40, generator=gen).to(torch.bfloat16), w, r


def test_auto_runs_the_fast_path_within_the_bound():
    clear_moe_cache()
    assert select_moe(SCHEME) == ("torch-grouped", {})
    x, w, r = _problem()
    y = fp8ref.moe(x, w, r, SCHEME)
    b = moe_error_bound(x, w, r, SCHEME, accuracy=fp8ref.get_moe_backend("torch-grouped").accuracy)
    assert compare("auto", y, moe_exact(x, w, r, SCHEME), b).ok


def test_a_backend_that_fails_the_probe_is_never_chosen():
    from tests.mutants.moe import GateUpSwapped

    bad = GateUpSwapped()
    bad.name = "aaa-gate-up-swapped"
    _MOE_REGISTRY[bad.name] = bad
    try:
        clear_moe_cache()
        name, why_not = select_moe(SCHEME, candidates=[bad.name, "reference"])
        assert name == "reference" and "failed the MoE compliance probe" in why_not[bad.name]
    finally:
        del _MOE_REGISTRY[bad.name]
        clear_moe_cache()


def test_backend_by_name_and_errors():
    x, w, r = _problem()
    assert torch.equal(fp8ref.moe(x, w, r, SCHEME, backend="reference"), fp8ref.moe_reference(x, w, r, SCHEME))
    with pytest.raises(KeyError, match="no MoE backend named 'nope'"):
        fp8ref.moe(x, w, r, SCHEME, backend="nope")
    with pytest.raises(TypeError, match="backend must be"):
        fp8ref.moe(x, w, r, SCHEME, backend=3)


@pytest.mark.parametrize("name", ["torch-grouped", "reference"])
def test_shipped_moe_backends_pass_the_moe_contracts(name):
    report = check_moe(name, "ci", 0)
    assert report.passed, report.to_text()
