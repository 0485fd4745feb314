"""The conformance suite proves itself: it rejects every mutant and accepts every correct variant,
in the ``ci`` profile, on 3 seeds.

Shrinking is off: a verdict is all this test needs, and shrinking changes no verdict (it only makes
a counterexample smaller); docs/mutants.md runs the ci profile with shrinking for the
counterexamples. Mutants run with ``fail_fast`` (the report stops at the first failing contract)
and are checked for every op. A correct variant runs every contract of the ops it changes
(``changes``): the variants of the GEMM keep the base's reference quantizer, which the base's own
runs certify, so they are certified for scaled_mm and linear.

The second half holds the accumulation classes to their bounds: on the sweep's swamped dot
products, a correct implementation of each class reaches at least half of its bound, and an
implementation of the next weaker class is outside it.
"""

import pytest

from fp8ref.conformance import check, get_profile
from fp8ref.spec.bounds import Accumulation

from .base import CLASSES
from .catalogue import CORRECT, MUTANTS
from .ladder import LADDER, swamp_ratio

PROFILE = get_profile("ci").with_(shrink=False)
SEEDS = (0, 1, 2)


def test_catalogue_size():
    assert len(MUTANTS) >= 28 and len(CORRECT) >= 10
    assert len({m.name for m in MUTANTS + CORRECT}) == len(MUTANTS + CORRECT)
    assert all(m.upstream and m.klass in CLASSES for m in MUTANTS)
    assert {m.klass for m in MUTANTS} == set(CLASSES)  # every class of docs/conformance.md has a mutant
    declared = {(c.accumulation.unit_roundoff, c.accumulation.promote_every, c.output_roundings) for c in CORRECT}
    for acc in (Accumulation.EXACT, Accumulation.FP32, Accumulation.BF16, Accumulation.FP16):
        assert (acc.unit_roundoff, None, 1) in declared, acc.name
    assert (Accumulation.FP32.unit_roundoff, None, 2) in declared  # standard: two output roundings
    assert any(u == 2.0**-13 for u, _, _ in declared)  # fast


@pytest.mark.parametrize("cls", MUTANTS, ids=lambda c: c.name)
def test_suite_rejects_mutant(cls):
    for seed in SEEDS:
        report = check(cls(), PROFILE, seed=seed, fail_fast=True)
        assert not report.passed and report.verdict == "fail", (
            f"{cls.name} ({cls.upstream}: {cls.bug}) passed every contract at seed {seed}")
        first = report.failures[0]
        assert first.counterexample and first.message and report.examples_to_detection


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cls", CORRECT, ids=lambda c: c.name)
def test_suite_accepts_correct_variant(cls, seed):
    report = check(cls(), PROFILE, seed=seed, ops=cls.changes)
    assert report.passed, report.to_text()


# --------------------------------------------------------------------------------------------
# precision of declarations


@pytest.mark.parametrize(("correct", "bits", "weaker", "weaker_bits"), LADDER, ids=lambda x: getattr(x, "name", ""))
def test_each_accumulation_class_is_tight(correct, bits, weaker, weaker_bits):
    """A correct implementation of the class reaches at least half of its bound on the sweep; one
    that accumulates like the next weaker class, declaring this one, is outside it."""
    assert 0.5 <= swamp_ratio(correct(), bits) <= 1
    if weaker is not None:
        assert swamp_ratio(weaker(), weaker_bits) > 1
