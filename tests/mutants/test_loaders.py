"""The loader contracts prove themselves: ``check_loader`` rejects every loader mutant and accepts
every correct variant (``loaders.py``), on seed 0 in the default run and on seeds 1-7 under
``slow``; the search alone finds a fused-partition bug and shrinks it to a short partition list;
fp16 zero weights (sglang#4434) are rejected through the loader path."""

import pytest
import torch

from fp8ref.conformance import LOAD_CONTRACT_NAMES, check_loader, get_profile
from fp8ref.spec.loading import Loaded, LoadLayout, source_slices
from fp8ref.spec.quant import quantize

from .loaders import LOAD_CLASSES, LOAD_CORRECT, LOAD_MUTANTS, ROW, BlockCeilOffset, ZeroWeightsFp16

SLOW_SEEDS = tuple(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 8))
SEEDS = (0, *SLOW_SEEDS)


def test_loader_catalogue():
    assert {f.cls.klass for f in LOAD_MUTANTS} == set(LOAD_CLASSES)  # a mutant per class of issue 41
    assert all(f.cls.upstream and f.cls.trigger for f in LOAD_MUTANTS)
    names = [f.name for f in LOAD_MUTANTS + LOAD_CORRECT]
    assert len(set(names)) == len(names)
    assert set(LOAD_CONTRACT_NAMES) >= {"load.partitions", "load.tp_shards", "load.reload_idempotent",
                                        "load.source_dtypes", "load.no_uninitialised"}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("make", LOAD_MUTANTS, ids=lambda f: f.name)
def test_check_loader_rejects_mutant(make, seed):
    report = check_loader(make(), "ci", seed=seed, fail_fast=True)
    assert report.verdict == "fail", f"{make.name} ({make.cls.upstream}) passed every loader contract at seed {seed}"
    first = report.failures[0]
    assert first.counterexample and first.message and first.examples_to_failure


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("make", LOAD_CORRECT, ids=lambda f: f.name)
def test_check_loader_accepts_correct_variant(make, seed):
    report = check_loader(make(), "ci", seed=seed)
    assert report.passed, report.to_text()
    assert all(r.examples > r.sweep for r in report.results)  # the search ran past the sweep


def test_fp16_zero_weights_rejected_through_the_loader():
    """sglang#4434's symptom: an fp16 source loaded to zero codes; only fp16 sources expose it."""
    report = check_loader(ZeroWeightsFp16(ROW, False), "ci", seed=0)
    failed = {r.contract for r in report.results if r.failed}
    assert failed == {"load.source_dtypes"}
    r = next(r for r in report.results if r.contract == "load.source_dtypes")
    assert "float16" in r.counterexample and r.examples_to_failure == 1


def test_search_alone_shrinks_to_a_short_partition_list():
    from .loaders import BLOCK
    report = check_loader(BlockCeilOffset(BLOCK, True), get_profile("ci"), seed=0, contracts=["load.partitions"],
                          sweep=False)
    r = report.results[0]
    assert r.failed and r.sweep == 0
    parts = r.counterexample.split("[", 1)[1].split("]", 1)[0].split("+")
    assert len(parts) == 2, r.counterexample  # two partitions: the fewest that can share a block


def test_callable_loader_and_error_exits():
    def per_row(source, layout):
        qs = [quantize(w, ROW) for w in source_slices(layout, source.weights)]
        return Loaded(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]))

    assert check_loader(per_row, scheme=ROW, contracts=["load.partitions"]).verdict == "pass"
    with pytest.raises(ValueError, match="scheme="):
        check_loader(per_row)
    with pytest.raises(TypeError, match="loader must be"):
        check_loader(3, scheme=ROW)
    with pytest.raises(ValueError, match="unknown loader contracts"):
        check_loader(per_row, scheme=ROW, contracts=["load.nope"])
    with pytest.raises(ValueError, match="multiple of tp_size"):
        LoadLayout((3,), 16, ROW, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank"):
        LoadLayout((4,), 16, ROW, tp_size=2, tp_rank=2)


def test_a_loader_that_returns_the_wrong_type_fails():
    report = check_loader(lambda source, layout: None, scheme=ROW, contracts=["load.partitions"])
    assert report.verdict == "fail" and "not an fp8ref.spec.loading.Loaded" in report.results[0].message
