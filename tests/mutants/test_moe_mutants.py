"""The MoE contracts prove themselves (docs/spec.md §7): ``check_moe`` rejects every MoE mutant
and accepts every correct variant of tests/mutants/moe.py, in the ``ci`` profile.

The corner sweep is deterministic, so a mutant it catches is caught on every seed; the search is
held to the same standard on its own (``only=("moe.search",)``): each mutant is rejected by the
Hypothesis search alone on each of the seeds 0-7 (about 11 CPU s for the ten mutants).
"""

import pytest

from fp8ref.conformance import get_profile
from fp8ref.conformance.moe import check_moe

from .moe import MOE_CORRECT, MOE_MUTANTS

PROFILE = get_profile("ci").with_(shrink=False)
SEEDS = range(8)


def test_moe_catalogue():
    assert len(MOE_MUTANTS) >= 10 and len(MOE_CORRECT) >= 4
    assert all(m.upstream and m.bug for m in MOE_MUTANTS)
    assert len({m.name for m in MOE_MUTANTS + MOE_CORRECT}) == len(MOE_MUTANTS + MOE_CORRECT)


@pytest.mark.parametrize("cls", MOE_MUTANTS, ids=lambda c: c.name)
def test_moe_contracts_reject_mutant(cls):
    report = check_moe(cls(), PROFILE, seed=0, fail_fast=True)
    assert report.verdict == "fail", f"{cls.name} ({cls.upstream}: {cls.bug}) passed the MoE contracts"
    assert report.failures[0].counterexample and report.failures[0].message


@pytest.mark.parametrize("cls", MOE_MUTANTS, ids=lambda c: c.name)
def test_moe_search_alone_rejects_mutant_on_seeds_0_to_7(cls):
    for seed in SEEDS:
        report = check_moe(cls(), PROFILE, seed=seed, only=("moe.search",))
        assert report.verdict == "fail", f"{cls.name} ({cls.upstream}) passed the MoE search at seed {seed}"


@pytest.mark.parametrize("cls", MOE_CORRECT, ids=lambda c: c.name)
def test_moe_contracts_accept_correct_variant(cls):
    report = check_moe(cls(), PROFILE, seed=0)
    assert report.passed, report.to_text()
