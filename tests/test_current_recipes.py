"""The recipes kernels use today reach every GEMM and linear contract in ``ci``: MX (1x32
power-of-two scales, E4M3 and E5M2), DeepSeek's 1x128 x 128x128 with UE8M0 scales, mixed
granularities, partial blocks on N and K; and the ``pow2_edge`` family puts amax / qmax within a
few ulps of a power of two under every power-of-two scheme."""

import math

import pytest
import torch

import fp8ref
from fp8ref.check.problems import TensorSpec, make_codes, make_tensor
from fp8ref.check.values import CodeSpec
from fp8ref.conformance import corner_sweep
from fp8ref.conformance.profiles import PROFILES
from fp8ref.conformance.sweep import CURRENT_RECIPES, POW2_SCHEMES, RECIPE_SHAPES
from fp8ref.spec.quant import compute_scale


def _is_mx(s) -> bool:
    return s.granularity.value == "group" and s.group_size == 32 and s.pow2_scale


def _is_ue8m0_block(r) -> bool:
    return (r.weight.granularity.value == "block" and r.weight.block == (128, 128) and r.weight.pow2_scale
            and r.activation.group_size == 128 and r.activation.pow2_scale)


@pytest.mark.parametrize("op", ["scaled_mm", "linear"])
def test_ci_draws_mx_and_ue8m0_operands(op):
    probs = corner_sweep(op, PROFILES["ci"], fp8ref.get_backend("reference"))
    mx = [p for p in probs if _is_mx(p.recipe.activation) and _is_mx(p.recipe.weight)]
    ue = [p for p in probs if _is_ue8m0_block(p.recipe)]
    assert {p.recipe.weight.format.name for p in mx} == {"e4m3fn", "e5m2"}
    assert len(ue) >= 3
    # N and K not multiples of the block, on both recipes
    assert any(p.K % 32 for p in mx) and any(p.K % 128 and p.N % 128 for p in ue)
    names = {p.recipe.name for p in probs}
    assert {"row-x-tensor", "tensor-x-row", "block128-x-token"} <= names
    if op == "scaled_mm":  # the operands' scales are powers of two, as E8M0 holds them
        for p in mx + ue:
            a, b, _ = p.build()
            for s in (a.scale, b.scale):
                m, _ = torch.frexp(s)
                assert bool((m == 0.5).all()), p


def test_current_recipes_are_presets_or_named():
    assert {"mxfp8", "mxfp8_e5m2", "fp8_block_ue8m0"} <= set(fp8ref.RECIPES)
    assert fp8ref.MXFP8 in CURRENT_RECIPES and fp8ref.FP8_BLOCK_UE8M0 in CURRENT_RECIPES
    assert {r.name for r, *_ in RECIPE_SHAPES} == {r.name for r in CURRENT_RECIPES}


def _float_log2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The bug the family aims at: 2**ceil(log2(s)) with an fp32 log2."""
    return torch.exp2(torch.ceil(torch.log2(s.to(torch.float32))))


@pytest.mark.parametrize("scheme", POW2_SCHEMES, ids=lambda s: s.short_str())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_pow2_edge_puts_amax_over_qmax_next_to_a_power_of_two(scheme, dtype):
    exp = 8 if dtype != torch.float16 else 3
    x = make_tensor(TensorSpec("pow2_edge", exp, 5), 130, 300, dtype, scheme)
    s = compute_scale(x, scheme.with_(pow2_scale=False))  # amax / qmax, rounded once to fp32
    m, e = torch.frexp(s.to(torch.float64))
    # each block's quotient is a power of two or within 2 ulps of the input dtype from one
    ulp = torch.finfo(dtype).eps
    dist = torch.minimum(m * 2 - 1, 1 - m)  # relative distance above, below
    assert bool((dist <= 2.5 * ulp).all())
    assert bool((m == 0.5).any()) and bool((m > 0.5).any())  # on a power of two, and beside one
    if dtype == torch.float32:  # where a float ceil(log2) lands on the wrong power
        assert not torch.equal(_float_log2_ceil(s), compute_scale(x, scheme))


def test_pow2_schemes_get_pow2_code_scales():
    q = make_codes(CodeSpec("bits", 3, -9, False, distinct_scales=True), 5, 70, fp8ref.MXFP8.activation)
    m, _ = torch.frexp(q.scale)
    assert bool((m == 0.5).all())
    q = make_codes(CodeSpec("bits", 3, -9, False), 5, 70, fp8ref.MXFP8.activation)
    assert bool((torch.frexp(q.scale)[0] == 0.5).all())
    assert math.isclose(float(q.scale.max()), 2.0 ** -7, rel_tol=0) or float(q.scale.max()) <= 2.0 ** -7
