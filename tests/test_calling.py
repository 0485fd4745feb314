"""The calling contract's machinery (fp8ref/conformance/contracts/calling.py, docs/spec.md §3.4):
views, storage overlap, in-place updates, the declaration of special values, the size problems.
The contracts themselves are held to their mutants in tests/mutants/test_mutants.py and run on
every registered backend in properties/."""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.conformance import check, get_profile
from fp8ref.conformance import strategies as fst
from fp8ref.conformance.contracts import CALLING_CONTRACT_NAMES, CALLING_DIMENSIONS, calling
from fp8ref.registry import PROPAGATE, RAISE, SPEC_NON_FINITE, NonFinite, get_backend, non_finite_policy


@pytest.mark.parametrize("kind", calling.VIEW_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_views_hold_the_values_in_another_layout(kind, dtype):
    t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5).to(dtype)
    v = calling.as_view(t, kind)
    assert v is not None and v.shape == t.shape and v.dtype == dtype
    if kind == "stride0":
        assert v.stride(0) == 0 and torch.equal(v.float(), t[:1].float().expand(3, 4))
        return
    assert torch.equal(v.float(), t.float())
    assert not v.is_contiguous() or kind == "offset"
    if kind == "offset":
        assert v.storage_offset() > 0 and v.stride(0) > t.shape[1]
    if kind != "transposed":  # the rest of the storage is NaN (the NaN code for FP8): a wrong read shows
        whole = torch.as_strided(v, (v.untyped_storage().nbytes() // v.element_size(),), (1,), 0).float()
        assert int(torch.isnan(whole).sum()) == whole.numel() - t.numel()


def test_storage_overlap():
    base = torch.zeros(8)
    assert calling.storage_overlaps(base[:4], base[4:])  # one storage: an output there aliases
    assert not calling.storage_overlaps(base, base.clone())
    assert not calling.storage_overlaps(torch.zeros(0), base)


@pytest.mark.parametrize("how", calling.UPDATES)
def test_updates_change_values_in_place(how):
    t = torch.tensor([[1.0, -2.0, 3.0]])
    obj, version = id(t), t._version
    calling.tensors._update(t, "x", how)
    assert id(t) == obj and not torch.equal(t, torch.tensor([[1.0, -2.0, 3.0]]))
    if how == "numpy":
        assert t._version == version  # the case a version-keyed cache misses


def test_non_finite_declaration():
    """Undeclared is the default (either conforming answer); the shipped backends declare the
    spec's answers (cpu-fp8: NaN codes raise); ``rejects_non_finite`` promises x and bias raise."""
    assert NonFinite() == NonFinite(x=None, static_scale=None, codes=None, scales=None, bias=None)
    assert SPEC_NON_FINITE == NonFinite(x=RAISE, static_scale=RAISE, codes=PROPAGATE, scales=PROPAGATE, bias=RAISE)
    with pytest.raises(ValueError, match="NonFinite.codes"):
        NonFinite(codes="clamp")
    for info in fp8ref.backends():
        nf = get_backend(info.name).non_finite
        assert isinstance(nf, NonFinite), info.name
        if fp8ref.registry.origin(info.name) == "fp8ref":
            assert None not in vars(nf).values(), info.name
    assert get_backend("reference").non_finite == SPEC_NON_FINITE
    assert get_backend("cpu-fp8").non_finite.codes == RAISE

    class Rejects(fp8ref.Backend):
        name, rejects_non_finite = "h7-rejects", True

    assert non_finite_policy(Rejects()) == NonFinite(x=RAISE, bias=RAISE)


def test_contract_names_per_dimension_and_op():
    assert len(CALLING_CONTRACT_NAMES) == 3 * len(CALLING_DIMENSIONS)
    assert {n.split(".", 1)[1] for n in CALLING_CONTRACT_NAMES} == set(CALLING_DIMENSIONS)


def test_size_problems():
    q = fst.QuantizeProblem(3, 40, torch.bfloat16, fst.QuantScheme(), fst.TensorSpec("normal", 0, 1))
    g = fst.GemmProblem(3, 5, 40, fst.RECIPES["w8a8_fp8"], torch.bfloat16, fst.CodeSpec("bits", 1, -9, False),
                        fst.CodeSpec("bits", 2, -9, False))
    assert calling.SizeProblem(q, "rows").resized().rows > 65535
    assert calling.SizeProblem(g, "n").resized().N > 65535
    assert calling.SizeProblem(g, "k").resized().K > 2**16
    big = calling.SizeProblem(g, "offset").resized()
    assert big.M * big.K > 2**31
    # the search draws the offsets only in the limits profile; the sweep holds the cheap limits
    assert calling.size_problems(fst.gemm_problems, "scaled_mm")(get_profile("ci")).is_empty
    assert not get_profile("ci").huge_sizes and get_profile("limits").huge_sizes
    sweep = calling.size_sweep("scaled_mm")([g, fst.GemmProblem(3, 5, 40, fst.RECIPES["fp8_block"], torch.bfloat16,
                                                                 fst.CodeSpec("bits", 1, -9, False),
                                                                 fst.CodeSpec("bits", 2, -9, False))])
    assert {p.kind for p in sweep} == {"rows", "n", "k"}


def test_offset_path_at_a_small_offset(monkeypatch):
    """The ``offset`` size problem runs the op's bound (BIG_OFFSET lowered so it fits a unit test)."""
    monkeypatch.setattr(calling.shapes, "BIG_OFFSET", 2**16)
    g = fst.GemmProblem(3, 5, 40, fst.RECIPES["w8a8_fp8"], torch.bfloat16, fst.CodeSpec("bits", 1, -9, False),
                        fst.CodeSpec("bits", 2, -9, False))
    sp = calling.SizeProblem(g, "offset")
    assert sp.resized().M * sp.resized().K > 2**16
    assert calling.check_size_limits(get_backend("reference"), sp) <= 1


def test_reference_meets_the_calling_contract():
    report = check("reference", "dev", seed=0, contracts=CALLING_CONTRACT_NAMES)
    assert report.passed, report.to_text()


def test_declarations_must_agree():
    """``rejects_non_finite`` (x and bias raise) and ``non_finite`` cannot say two things."""
    from fp8ref import Backend, register_backend

    class Both(Backend):
        name, rejects_non_finite, non_finite = "h7-both", True, NonFinite(bias=PROPAGATE)

    class NotDeclared(Backend):
        name, non_finite = "h7-not-declared", "propagate"

    with pytest.raises(ValueError, match="rejects_non_finite says"):
        register_backend(Both())
    with pytest.raises(TypeError, match="non_finite must be an fp8ref.NonFinite"):
        register_backend(NotDeclared())
