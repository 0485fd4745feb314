"""The conformance suite proves itself: it rejects every mutant and accepts every correct variant,
in the ``ci`` profile, on 3 seeds.

Shrinking is off: a verdict is all this test needs, and shrinking changes no verdict (it only makes
a counterexample smaller); docs/mutants.md runs the ci profile with shrinking for the
counterexamples. Mutants run with ``fail_fast`` (the report stops at the first failing contract)
and are checked for every op. A correct variant runs every contract of the ops it changes
(``changes``): the variants of the GEMM keep the base's reference quantizer, which the base's own
runs certify, so they are certified for scaled_mm and linear.

The calling contract's catalogue (``calling.py``: views, writes into arguments, shared outputs, stale
prepared weights, shared scratch between threads, non-finite values, degenerate and large shapes)
is held to the contracts of its dimension: each mutant must be rejected by the contracts of its
class's dimension alone (``CALLING_CLASSES``), on 3 seeds; each correct variant passes every calling
contract. Their values are the base's on finite, contiguous operands (which the base's own runs
certify), so the value contracts are not run again for them.

The last part holds the accumulation classes to their bounds: on the sweep's swamped dot
products, a correct implementation of each class reaches at least half of its bound, and an
implementation of the next weaker class is outside it.
"""

from pathlib import Path

import pytest

from fp8ref.conformance import check, get_profile
from fp8ref.conformance.contracts import CALLING_CONTRACT_NAMES, CALLING_DIMENSIONS
from fp8ref.spec.bounds import Accumulation

from .base import CLASSES
from .catalogue import CALLING_CLASSES, CALLING_CORRECT, CALLING_MUTANTS, CORRECT, MUTANTS, claim_of
from .ladder import LADDER, swamp_ratio
from .loaders import LOAD_CORRECT, LOAD_MUTANTS
from .moe import MOE_CORRECT, MOE_MUTANTS
from .third_party import THIRD_PARTY

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
    assert (Accumulation.FP32.unit_roundoff, None, 3) in declared  # product, scale and bias rounded apart
    assert any(u == 2.0**-13 for u, _, _ in declared)  # fast


def test_report_lists_the_catalogue():
    """docs/mutants.md was generated from this catalogue (``python -m tests.mutants.make_report``):
    every mutant, correct variant and third-party kernel of it has a row there."""
    report = (Path(__file__).parents[2] / "docs" / "mutants.md").read_text()
    catalogue = [c for group in (MUTANTS, CORRECT, CALLING_MUTANTS, CALLING_CORRECT, THIRD_PARTY, LOAD_MUTANTS,
                                 LOAD_CORRECT, MOE_MUTANTS, MOE_CORRECT) for c in group]
    missing = [c.name for c in catalogue if f"| `{c.name}` |" not in report]
    assert not missing, f"docs/mutants.md lacks {missing}: run python -m tests.mutants.make_report"


@pytest.mark.parametrize("cls", MUTANTS, ids=lambda c: c.name)
def test_suite_rejects_mutant(cls):
    for seed in SEEDS:
        report = check(cls(), PROFILE, seed=seed, fail_fast=True, schemes=claim_of(cls))
        assert not report.passed and report.verdict == "fail", (
            f"{cls.name} ({cls.upstream}: {cls.bug}) passed every contract at seed {seed}")
        first = report.failures[0]
        assert first.counterexample and first.message and report.examples_to_detection


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cls", CORRECT, ids=lambda c: c.name)
def test_suite_accepts_correct_variant(cls, seed):
    report = check(cls(), PROFILE, seed=seed, ops=cls.changes, schemes=claim_of(cls))
    assert report.passed, report.to_text()


# --------------------------------------------------------------------------------------------
# the calling contract


def test_calling_catalogue():
    assert set(CALLING_CLASSES.values()) == set(CALLING_DIMENSIONS)
    assert {m.klass for m in CALLING_MUTANTS} == set(CALLING_CLASSES)  # a mutant per dimension
    assert all(m.upstream for m in CALLING_MUTANTS)
    assert len({m.name for m in CALLING_MUTANTS + CALLING_CORRECT + MUTANTS + CORRECT}) == len(
        CALLING_MUTANTS + CALLING_CORRECT + MUTANTS + CORRECT)


@pytest.mark.parametrize("cls", CALLING_MUTANTS, ids=lambda c: c.name)
def test_calling_contract_rejects_mutant(cls):
    dim = CALLING_CLASSES[cls.klass]
    names = [n for n in CALLING_CONTRACT_NAMES if n.split(".", 1)[1] == dim]
    for seed in SEEDS:
        report = check(cls(), PROFILE, seed=seed, fail_fast=True, contracts=names)
        assert report.verdict == "fail", f"{cls.name} ({cls.bug}) passed {names} at seed {seed}"
        first = report.failures[0]
        assert first.counterexample and first.message


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cls", CALLING_CORRECT, ids=lambda c: c.name)
def test_calling_contract_accepts_correct_variant(cls, seed):
    report = check(cls(), PROFILE, seed=seed, contracts=CALLING_CONTRACT_NAMES, ops=cls.changes)
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
