"""The one comparison routine (``fp8ref.spec.compare``) and the scale tolerance (``bounds.scale_error_bound``):
the 0/0 rule, structural mismatches, the worst element, and that the contracts and the selector's probe
judge a scale by the same rule."""

from __future__ import annotations

import math

import pytest
import torch

import fp8ref
from fp8ref.conformance import check
from fp8ref.kernels.reference import ReferenceBackend
from fp8ref.select import probe
from fp8ref.spec import bounds, quant
from fp8ref.spec.compare import Mismatch, compare, compare_bits, error_ratio
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import QuantScheme

f64 = torch.float64


def test_zero_over_zero_is_a_pass_and_error_over_zero_is_infinite():
    err = torch.tensor([0.0, 1.0, float("nan"), 3.0], dtype=f64)
    bnd = torch.tensor([0.0, 0.0, 5.0, 4.0], dtype=f64)
    assert error_ratio(err, bnd).tolist() == [0.0, math.inf, math.inf, 0.75]
    v = compare("exact", torch.zeros(3), torch.zeros(3), 0.0)
    assert v.ok and v.ratio == 0.0 and v.mismatch is Mismatch.NONE
    v = compare("exact", torch.tensor([0.0, 2.0**-30]), torch.zeros(2), 0.0)
    assert not v.ok and v.ratio == math.inf and v.n_bad == 1 and v.worst.index == (1,)


def test_nan_fails_even_against_an_infinite_bound():
    v = compare("y", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]), math.inf)
    assert not v.ok and v.worst.index == (1,) and v.ratio == math.inf


def test_worst_element_is_located():
    ref = torch.zeros(3, 4, dtype=f64)
    val = ref.clone()
    val[1, 2], val[2, 3] = 3.0, 1.0
    bnd = torch.full_like(ref, 2.0)
    v = compare("y", val, ref, bnd)
    assert not v.ok and v.n_bad == 1 and v.numel == 12
    assert (v.worst.index, v.worst.value, v.worst.reference, v.worst.bound) == ((1, 2), 3.0, 0.0, 2.0)
    assert v.ratio == v.worst.ratio == 3.0 / 2.0
    assert "(1, 2)" in v.message() and "1 of 12" in v.message()


@pytest.mark.parametrize("value, dtype, mismatch", [
    ("not a tensor", None, Mismatch.TYPE),
    (torch.zeros(2, 3), None, Mismatch.SHAPE),
    (torch.zeros(3, 2, dtype=torch.bfloat16), torch.float32, Mismatch.DTYPE),
])
def test_structural_mismatches_are_verdicts(value, dtype, mismatch):
    v = compare("y", value, torch.zeros(3, 2), torch.zeros(3, 2), dtype=dtype)
    assert v.mismatch is mismatch and not v.ok and v.ratio == math.inf and v.worst is None
    assert v.message().startswith("y: ")


def test_empty_tensors_pass_with_ratio_zero():
    v = compare("y", torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4))
    assert v.ok and v.ratio == 0.0


def _scales(n: int = 4096) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.exp2(torch.empty(n, dtype=f64).uniform_(-20, 20, generator=gen)).to(torch.float32)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_bound_admits_a_faithful_rounding_and_rejects_two_steps(scale_dtype):
    """A scale rounded to the neighbour on the other side of the quotient passes; two grid steps off fails."""
    scheme = QuantScheme(granularity="row", scale_dtype=scale_dtype)
    amax = _scales()[:, None]
    ref = quant.compute_scale(amax, scheme)
    bound = bounds.scale_error_bound(ref, scheme)
    exact = amax.to(f64) / scheme.qmax
    r64 = ref.to(f64)
    # the other neighbour of the exact quotient on scale_dtype's grid: faithful, not correctly rounded
    up = torch.nextafter(ref, torch.full_like(ref, math.inf))
    down = torch.nextafter(ref, torch.zeros_like(ref))
    other = torch.where(r64 >= exact, down, up)
    assert compare("faithful", other, ref, bound).ok
    assert not compare("two steps", torch.nextafter(up, torch.full_like(up, math.inf)), ref, bound).ok


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_bound_is_one_grid_step_among_subnormal_scales(scale_dtype):
    """Below the smallest normal the grid step is the smallest subnormal: a neighbour one step away
    passes, two steps away fails."""
    scheme = QuantScheme(granularity="row", scale_dtype=scale_dtype)
    fi = torch.finfo(scale_dtype)
    step = fi.tiny * fi.eps
    ref = torch.tensor([[step * 3], [fi.tiny / 2], [fi.tiny - step]], dtype=f64).to(scale_dtype)
    assert bool((ref.to(f64) < fi.tiny).all()) and bool((ref > 0).all())  # all subnormal, exactly stored
    bound = bounds.scale_error_bound(ref, scheme)
    one = torch.nextafter(ref, torch.full_like(ref, math.inf))
    two = torch.nextafter(one, torch.full_like(one, math.inf))
    assert compare("one step", one, ref, bound).ok
    assert not compare("two steps", two, ref, bound).ok


def test_scale_bound_is_zero_for_pow2_and_static_schemes():
    s = torch.tensor([[0.25], [3.0]])
    assert not bool(bounds.scale_error_bound(s, QuantScheme(pow2_scale=True)).any())
    assert not bool(bounds.scale_error_bound(s, QuantScheme(dynamic=False)).any())


class _ScaleTwoStepsUp(ReferenceBackend):
    """The reference, with every dynamic scale stored two fp32 steps above the spec's (codes recomputed
    against the stored scale, so only the scale rule can reject it)."""

    name = "test-scale-two-steps"

    def quantize(self, x, scheme, scale=None):
        if scale is not None or not scheme.dynamic:
            return super().quantize(x, scheme, scale)
        s = quant.compute_scale(x, scheme)
        inf = torch.full_like(s, math.inf)
        s = torch.nextafter(torch.nextafter(s, inf), inf)
        return Quantized(quant.quantize(x, scheme.with_(dynamic=False), s).data, s, scheme)


def test_certificate_and_probe_reject_the_same_scale():
    """The contract quantize.scale and the selector's probe use one scale rule: both reject a scale two
    steps off (the probe's old rule admitted up to two steps near the top of a binade)."""
    b = _ScaleTwoStepsUp()
    rep = check(b, "ci", contracts=["quantize.scale"], max_examples=0)
    assert rep.results[0].status == "fail"
    case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    res = probe(b, case)
    assert not res.compliant and "scale" in res.detail


def test_bit_comparison_sees_the_sign_of_zero_and_nan_payloads():
    a = torch.tensor([0.0, float("nan"), 2.0])
    v = compare_bits("y", a, a.clone())
    assert v.ok and v.ratio == 0.0 and "bit-identical" in v.message()
    v = compare_bits("y", a, torch.tensor([-0.0, float("nan"), 3.0]))
    assert not v.ok and v.n_bad == 2 and v.worst.index == (0,) and v.ratio == math.inf
    assert compare_bits("y", a, a.to(torch.float64)).mismatch is Mismatch.DTYPE
    codes = torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn)
    assert compare_bits("codes", codes, codes.clone()).ok


def test_the_driver_classifies_once_and_adapts_through_one_hook():
    """``classify`` is the one FAIL/ERROR rule; an ``Adaptation`` maps every problem the driver runs and
    names the reproduction (what ``fp8ref.peers.certify`` passes for a peer)."""
    from fp8ref.conformance.driver import ERROR, FAIL, Adaptation, classify
    from fp8ref.conformance.report import NOT_CLAIMED

    assert classify(AssertionError("x"))[0] is FAIL and classify(ValueError("y")) == (ERROR, "ValueError: y")
    seen = []

    def map_problem(p):
        seen.append(p)
        return p

    adapt = Adaptation(map_problem=map_problem, reproduce=lambda prof, seed, c: f"replay {prof} {seed} {c}")
    rep = check(_ScaleTwoStepsUp(), "ci", contracts=["quantize.scale", "scaled_mm.bound"], max_examples=0,
                ops=("quantize",), adapt=adapt)
    scale, mm = rep.results
    assert scale.status == FAIL and scale.reproduce.startswith("replay ci 0 quantize.scale")
    assert mm.status == NOT_CLAIMED
    assert len(seen) >= scale.examples_to_failure >= 1  # every problem that ran went through the mapping
