"""The conformance suite proves itself: it rejects every mutant and accepts every correct variant.

Profile: ``ci`` with shrinking off and 8 examples per contract (a verdict is all this test needs;
docs/mutants.md runs the full ci profile, with shrinking, for the counterexamples). Seed 0,
fixed so that the test is reproducible; docs/mutants.md reports detection over several seeds.
"""

import pytest

from fp8ref.conformance import check, get_profile

from .catalogue import CORRECT, MUTANTS

PROFILE = get_profile("ci").with_(shrink=False, max_examples=8)


def test_catalogue_size():
    assert len(MUTANTS) >= 12 and len(CORRECT) >= 4
    assert len({m.name for m in MUTANTS + CORRECT}) == len(MUTANTS + CORRECT)
    assert all(m.upstream for m in MUTANTS)


@pytest.mark.parametrize("cls", MUTANTS, ids=lambda c: c.name)
def test_suite_rejects_mutant(cls):
    report = check(cls(), PROFILE, seed=0, fail_fast=True)
    assert not report.passed, f"{cls.name} ({cls.upstream}: {cls.bug}) passed every contract"
    first = report.failures[0]
    assert first.counterexample and first.message


@pytest.mark.parametrize("cls", CORRECT, ids=lambda c: c.name)
def test_suite_accepts_correct_variant(cls):
    report = check(cls(), PROFILE, seed=0)
    assert report.passed, report.to_text()
