"""The conformance driver, CLI, probe and ledger handling (the properties themselves run in
properties/; the suite's power is tested on mutants in tests/mutants/)."""

import json
import sys

import pytest
import torch

from fp8ref.cli import main as cli_main
from fp8ref.conformance import (
    CONTRACT_NAMES,
    CONTRACTS,
    PROBE_MAX_BITS,
    accumulator_bits,
    apply_known_failures,
    check,
    get_profile,
    load_report,
    merge_reports,
)
from fp8ref.conformance import strategies as fst
from fp8ref.conformance.peers import PEER_CHECKS, peer_accepts
from fp8ref.pytest_plugin import fp8ref_certify  # noqa: F401,F811 -- the fixture, as a kernel repo gets it
from fp8ref.registry import get_backend
from fp8ref.spec.bounds import Accumulation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mutants.catalogue import (  # noqa: E402
    Acc14Bits,
    Bf16Accumulation,
    Fp32Base,
    HonestBf16,
    ScaleTwice,
    StaticNoClamp,
)


def test_contract_table_is_complete():
    assert len(set(CONTRACT_NAMES)) == len(CONTRACTS)
    assert {c.kind for c in CONTRACTS} == {"exact", "bounded", "probe", "info"}
    for op in ("quantize", "scaled_mm", "linear"):
        assert any(c.op == op for c in CONTRACTS)


def test_the_docs_contract_table_is_generated_from_the_code():
    """docs/conformance.md holds the table ``CONTRACTS`` gives (regenerate with ``python -m
    fp8ref.conformance.contract_table --write docs/conformance.md``)."""
    from pathlib import Path

    from fp8ref.conformance.contract_table import BEGIN, END, contract_table, replace_table

    doc = (Path(__file__).parent.parent / "docs" / "conformance.md").read_text()
    assert doc[doc.index(BEGIN) + len(BEGIN):doc.index(END)].strip() == contract_table()
    assert replace_table(doc) == doc
    assert all(f"| {c.name} |" in contract_table() or c.name.split(".")[1] in contract_table() for c in CONTRACTS)


def test_accumulator_bits_reads_the_accumulator():
    assert accumulator_bits(get_backend("reference")) == PROBE_MAX_BITS
    assert accumulator_bits(Fp32Base()) == 24
    assert accumulator_bits(Acc14Bits()) == 14
    assert accumulator_bits(Bf16Accumulation()) == 8


def test_probe_contract_compares_with_declaration():
    assert check(HonestBf16(), "dev", seed=0, contracts=["scaled_mm.accumulator_bits"]).passed
    rep = check(Bf16Accumulation(), "dev", seed=0, contracts=["scaled_mm.accumulator_bits"])
    assert not rep.passed and "declares fp32" in rep.results[0].message


def test_failure_has_counterexample_and_reproduction():
    rep = check(ScaleTwice(), "dev", seed=7, contracts=["scaled_mm.bound"])
    r = rep.results[0]
    assert r.status == "fail" and not rep.passed and rep.verdict == "fail"
    assert "M=" in r.counterexample and "ratio" in r.message
    # an unregistered backend: named by its class path, which check() and the CLI load (issue 31)
    path = f"{ScaleTwice.__module__}:ScaleTwice"
    assert r.reproduce.startswith(f"fp8ref.conformance.check({path!r}, profile='dev', seed=7, "
                                  "contracts=['scaled_mm.bound'])")
    assert f"fp8ref conformance --backend {path} --profile dev --seed 7 --only scaled_mm.bound" in r.reproduce
    again = check(path, "dev", seed=7, contracts=["scaled_mm.bound"]).results[0]
    assert again.status == "fail" and again.counterexample == r.counterexample
    assert r.examples_to_failure >= 1 and rep.examples_to_detection == r.examples_to_failure
    # the failing example is counted and its ratio shown, in the row and in the summary
    assert r.examples == r.examples_to_failure and r.worst_ratio > 1 and rep.worst_ratio == r.worst_ratio


def test_reproduce_line_of_a_class_that_cannot_be_rebuilt_names_the_instance():
    class Local(Fp32Base):
        name = "local-scale-twice"
        scaled_mm = ScaleTwice.scaled_mm

    r = check(Local(), "dev", seed=7, contracts=["scaled_mm.bound"]).results[0]
    assert r.status == "fail" and r.reproduce.startswith("fp8ref.conformance.check(<backend>,")
    assert "Local instance 'local-scale-twice'" in r.reproduce and "--backend" not in r.reproduce


def test_shrunk_counterexample_when_the_search_finds_it():
    rep = check(ScaleTwice(), "dev", seed=7, contracts=["scaled_mm.bound"], sweep=False)
    r = rep.results[0]
    assert r.status == "fail" and r.sweep == 0 and "@reproduce_failure" in r.reproduce


def test_reproduce_line_of_a_registered_backend_has_the_cli_form():
    from fp8ref.conformance.driver import reproduce_line

    line = reproduce_line(get_backend("torch"), "ci", 3, "quantize.codes")
    assert "fp8ref.conformance.check('torch', profile='ci', seed=3, contracts=['quantize.codes'])" in line
    assert "fp8ref conformance --backend torch --profile ci --seed 3 --only quantize.codes" in line


def test_report_json_roundtrip_and_merge(tmp_path):
    a = check("reference", "dev", seed=1, contracts=["quantize.codes", "scaled_mm.batch_invariant"])
    b = check(ScaleTwice(), "dev", seed=1, contracts=["scaled_mm.bound"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps([a.to_dict(), b.to_dict()]))
    back = load_report(str(path))
    assert [r.backend for r in back] == ["reference", "mutant-scale-twice"]
    assert back[0].passed and not back[1].passed and back[0].batch_invariant == "yes"
    assert back[1].verdict == "fail" and json.loads(path.read_text())[1]["verdict"] == "fail"
    table = merge_reports(back)
    assert "| reference |" in table and "scaled_mm.bound (fail)" in table
    assert "FAILED" in b.to_markdown() and "scaled_mm.bound" in b.to_text()


def test_known_failures_are_strict():
    rep = check(ScaleTwice(), "dev", seed=0, contracts=["scaled_mm.bound", "quantize.codes"])
    ledger = [{"backend": ScaleTwice.name, "property": "scaled_mm.bound", "upstream": "https://example.org/1"},
              {"backend": ScaleTwice.name, "property": "quantize.codes", "upstream": "https://example.org/2"}]
    apply_known_failures(rep, ledger)
    assert rep.result("scaled_mm.bound").status == "xfail"
    assert rep.result("quantize.codes").status == "xpass" and not rep.passed


def test_a_known_failure_without_an_upstream_link_names_its_ledger_entry():
    """Most findings have no upstream report: the note names the ledger entry instead of an empty link."""
    rep = check(ScaleTwice(), "dev", seed=0, contracts=["scaled_mm.bound"])
    apply_known_failures(rep, [{"backend": ScaleTwice.name, "property": "scaled_mm.bound", "upstream": "",
                                "id": "scale-twice:scaled_mm.bound", "reason": "no upstream report found"}])
    note = rep.result("scaled_mm.bound").note
    assert note == "known failure: scale-twice:scaled_mm.bound -- no upstream report found"


def test_unavailable_backend_is_reported_with_reason():
    class Gone(Fp32Base):
        name = "gone"

        def available(self):
            return "needs a device this machine lacks"

    rep = check(Gone(), "dev", seed=0)
    assert not rep.available and rep.reason == "needs a device this machine lacks"
    assert not rep.passed and rep.verdict == "unavailable"  # nothing ran: never a certificate
    assert "unavailable: needs a device" in rep.to_markdown()


class _DeclinesAll(Fp32Base):
    name = "test-declines-everything"

    def supports(self, case):
        return "this kernel takes nothing"


class _QuantizerOnly(Fp32Base):
    name = "test-quantizer-only"
    ops = ("quantize",)


def test_a_backend_that_declines_everything_is_untested_not_certified():
    rep = check(_DeclinesAll(), "dev", seed=0, contracts=["quantize.codes", "scaled_mm.bound", "linear.bound"])
    assert rep.verdict == "untested" and not rep.passed
    assert {r.status for r in rep.results} == {"untested"} and all(r.examples == 0 for r in rep.results)
    r = rep.result("quantize.codes")
    assert "this kernel takes nothing" in r.note and r.declined > 0
    assert "this kernel takes nothing" in str(r.coverage["declined"])
    assert "UNTESTED (not certified)" in rep.to_text() and "UNTESTED" in merge_reports([rep])


def test_no_contract_passes_on_zero_examples():
    rep = check(Fp32Base(), "dev", seed=0, max_examples=2)
    assert rep.passed and all(r.examples > 0 for r in rep.results if r.status in ("pass", "yes"))
    assert {r.status for r in rep.results} <= {"pass", "yes", "no"}


def test_a_quantizer_only_backend_is_certified_for_quantize_only():
    rep = check(_QuantizerOnly(), "dev", seed=0)
    assert rep.passed and "ops quantize" in rep.claimed
    for r in rep.results:
        assert (r.status == "not claimed") == (r.op != "quantize"), r
    assert rep.accumulator_bits is None
    text = rep.to_text()
    assert "not claimed" in text and "certified for ops quantize" in text


def test_gemm_contracts_against_a_quantizer_only_claim_are_not_failures():
    rep = check(_QuantizerOnly(), "dev", seed=0, contracts=["scaled_mm.bound", "linear.bound"])
    assert [r.status for r in rep.results] == ["not claimed", "not claimed"]
    assert rep.verdict == "untested" and not rep.passed  # nothing claimed ran: nothing certified


def test_narrow_certificate_ops_and_schemes():
    scheme = fst.QuantScheme(granularity="row")
    rep = check(Fp32Base(), "dev", seed=0, ops=("quantize",), schemes=[scheme],
                contracts=["quantize.codes", "quantize.scale", "scaled_mm.bound"])
    assert rep.passed and rep.claimed == "ops quantize; schemes e4m3fn-row-dyn"
    cov = rep.result("quantize.codes").coverage
    assert cov["formats"] == ["e4m3fn"] and cov["granularity"] == ["row"] and cov["scales"] == ["dynamic"]
    assert rep.result("scaled_mm.bound").status == "not claimed"
    with pytest.raises(ValueError, match="cannot be certified"):
        check(_QuantizerOnly(), "dev", seed=0, ops=("scaled_mm",))


def test_coverage_table_in_text_json_and_markdown(tmp_path):
    rep = check("reference", "dev", seed=0, contracts=["quantize.codes", "scaled_mm.bound"])
    cov = rep.result("scaled_mm.bound").coverage
    assert cov["M"][0] == 1 and cov["K"][1] >= 1024  # the long-K single row of the dev profile
    assert set(cov["formats"]) == {"e4m3fn", "e5m2", "e4m3fnuz"}
    assert {"bf16", "fp16", "fp32"} <= set(cov["out"]) and {"none", "random", "cancel"} <= set(cov["bias"])
    assert any(s.startswith("static") for s in rep.result("quantize.codes").coverage["scales"])
    assert "coverage of the examples that ran" in rep.to_text()
    assert "Coverage of the examples that ran" in rep.to_markdown()
    back = load_report_from(rep, tmp_path)
    assert back.result("scaled_mm.bound").coverage == cov


def load_report_from(rep, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(rep.to_json())
    return load_report(str(path))[0]


def test_sweep_reaches_every_class_by_construction():
    from fp8ref.conformance import corner_sweep
    from fp8ref.conformance.profiles import PROFILES, boundary_sizes
    from fp8ref.conformance.strategies import STATIC_KINDS, SWAMP_BITS

    ci = PROFILES["ci"]
    q = corner_sweep("quantize", ci)
    g = corner_sweep("scaled_mm", ci)
    lin = corner_sweep("linear", ci)
    for axis, probs, get in (("cols", q, lambda p: p.cols), ("rows", q, lambda p: p.rows), ("cols", g, lambda p: p.K),
                             ("rows", g, lambda p: p.M), ("rows", g, lambda p: p.N), ("cols", lin, lambda p: p.K),
                             ("rows", lin, lambda p: p.M), ("rows", lin, lambda p: p.N)):
        assert set(boundary_sizes(ci, axis)) <= {get(p) for p in probs}, axis
    assert {1025, 4097} <= {p.rows for p in q} | {p.cols for p in q}
    # the amax at the tail of every block on every K boundary; static scales of every kind
    assert all(p.x.family == "spike" and p.x.place == "last" for p in q if p.rows <= 5 and p.cols in
               boundary_sizes(ci, "cols") and p.cols > 40 and p.x.seed < 100)
    assert set(STATIC_KINDS) <= {p.static for p in q if not p.scheme.dynamic}
    assert {"e4m3fn", "e5m2", "e4m3fnuz"} <= {p.scheme.format.name for p in q if p.x.family == "underflow"}
    assert {p.scheme.granularity.value for p in q} == {"tensor", "row", "group", "block"}
    grids = [p.scheme.scale_shape(p.rows, p.cols) for p in q]
    assert any(r > 1 and c > 1 and r != c for r, c in grids)  # a non-square scale grid
    assert set(SWAMP_BITS) <= {p.a.bits + p.b.bits for p in g if p.a.family == "swamp"}
    assert any(p.bias_mode == "cancel" and p.out_dtype != torch.float32 for p in g if p.has_bias)
    assert any(p.a.distinct_scales and p.recipe.weight.granularity.value == "block" for p in g)
    # subnormal-range outputs on whole 128-wide K blocks too (block kernels that take no partial block)
    assert any(p.K >= 256 and p.K % 128 == 0 and p.a.scale_exp <= -64 for p in g)


def test_sweep_follows_the_backend_and_the_seed():
    from fp8ref.conformance import corner_sweep
    from fp8ref.conformance.profiles import PROFILES

    be = get_backend("cpu-bf16")
    probs = corner_sweep("scaled_mm", PROFILES["ci"], be)
    assert sum(p.out_dtype == torch.bfloat16 for p in probs) >= len(probs) - 8  # takes bf16 outputs only
    a = corner_sweep("quantize", PROFILES["ci"], seed=0)
    b = corner_sweep("quantize", PROFILES["ci"], seed=1)
    assert [(p.rows, p.cols) for p in a] == [(p.rows, p.cols) for p in b] and a != b


def test_static_scales_are_exercised_and_checked():
    rep = check(StaticNoClamp(), "dev", seed=0, contracts=["quantize.codes"])
    r = rep.results[0]
    assert r.status == "fail" and "static" in r.counterexample and ("NaN" in r.message or "qmax" in r.message)


def test_profiles_and_env(monkeypatch):
    from fp8ref.conformance.profiles import default_profile_name

    monkeypatch.setenv("FP8REF_HYPOTHESIS_PROFILE", "ci")
    assert default_profile_name() == "ci" and get_profile(None).name == "ci"
    monkeypatch.setenv("FP8REF_HYPOTHESIS_PROFILE", "nope")
    with pytest.raises(ValueError, match="^FP8REF_HYPOTHESIS_PROFILE='nope' is not accepted"):
        get_profile(None)


def test_grid_families_land_on_the_grid():
    scheme = fst.QuantScheme(granularity="group", group_size=16)
    for fam in ("on_grid", "qmax"):
        x = fst.make_tensor(fst.TensorSpec(fam, -3, 1), 5, 40, torch.bfloat16, scheme)
        q = __import__("fp8ref").quantize(x, scheme)
        assert torch.equal(q.dequantize(torch.float64), x.double())
    x = fst.make_tensor(fst.TensorSpec("ties", 0, 2), 4, 32, torch.float32, fst.QuantScheme())
    v = x.double() / __import__("fp8ref").quantize(x).scale.double()
    grid = fst.QuantScheme().format.finite_values()
    assert not bool(torch.isin(v[:, 1:].abs(), grid).all())  # midpoints, not grid points


def test_fp8_codes_never_nan():
    vals = fst.make_codes(fst.CodeSpec("bits", 3), 16, 64, fst.RECIPES["w8a8_fp8_rocm"].weight).data.float()
    assert bool(torch.isfinite(vals).all()) and float(vals.abs().max()) <= 224


def test_peer_checks_are_loose():
    a = __import__("fp8ref").quantize(torch.randn(4, 144))
    b = __import__("fp8ref").quantize(torch.randn(8, 144))
    y = __import__("fp8ref").scaled_mm(a, b, out_dtype=torch.float32)
    assert all(peer_accepts(p, y, a, b, None) for p in PEER_CHECKS)
    assert not peer_accepts(PEER_CHECKS[0], torch.full_like(y, float("nan")), a, b, None)


def test_cli_conformance(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = cli_main(["conformance", "--backend", "reference", "--profile", "dev", "--seed", "0", "--only",
                   "quantize.codes", "--json", str(out), "--markdown", str(md)])
    printed = capsys.readouterr().out
    assert rc == 0 and "quantize.codes" in printed and "coverage of the examples that ran" in printed
    assert load_report(str(out))[0].passed and "| quantize.codes |" in md.read_text()
    assert load_report(str(out))[0].results[0].coverage["M"]  # --json keeps the coverage
    assert cli_main(["conformance", "--merge", str(out)]) == 0
    assert cli_main(["conformance", "--list"]) == 0


def test_cli_prints_coverage_and_narrows_ops(capsys):
    rc = cli_main(["conformance", "--backend", "reference", "--profile", "dev", "--seed", "0", "--ops", "quantize",
                   "--only", "quantize.codes", "--only", "scaled_mm.bound"])
    out = capsys.readouterr().out
    assert rc == 0 and "coverage of the examples that ran" in out and "not claimed" in out


def test_cli_exit_status_untested(tmp_path, capsys):
    assert _cli_on(_DeclinesAll(), "quantize.codes", tmp_path) == 1
    assert "UNTESTED (not certified" in capsys.readouterr().err


def _cli_on(backend, contract: str, tmp_path) -> int:
    """``fp8ref conformance`` on ``backend``, registered for the call, one contract, no ledger."""
    from fp8ref.registry import register_backend, unregister_backend

    register_backend(backend, replace=True)
    try:
        return cli_main(["conformance", "--backend", backend.name, "--profile", "dev", "--seed", "0",
                         "--only", contract, "--known-failures", str(_empty_ledger(tmp_path))])
    finally:
        unregister_backend(backend.name)


def test_cli_fails_on_a_failing_backend(tmp_path):
    assert _cli_on(Bf16Accumulation(), "scaled_mm.accumulator_bits", tmp_path) == 1


def _empty_ledger(tmp_path):
    p = tmp_path / "kf.py"
    p.write_text("KNOWN_FAILURES = []\n")
    return p


def test_declared_accumulation_respected():
    assert HonestBf16.accumulation is Accumulation.BF16


@pytest.mark.parametrize("name", ["fp8ref.conformance.driver", "fp8ref.conformance.probe",
                                  "fp8ref.check.values", "fp8ref.conformance.sweep",
                                  "fp8ref.conformance.scope", "fp8ref.conformance.profiles",
                                  "fp8ref.conformance.peers", "fp8ref.conformance.replay",
                                  "fp8ref.check.problems", "fp8ref.conformance.reproduce"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_certify_fixture_for_a_kernel_repo(fp8ref_certify):  # noqa: F811
    # What a third-party kernel repository writes: an unregistered instance, one contract per test.
    results = fp8ref_certify(Fp32Base(), "quantize.codes")
    assert [r.status for r in results] == ["pass"]
    with pytest.raises(pytest.fail.Exception, match="counterexample: scaled_mm M="):
        fp8ref_certify(ScaleTwice(), "scaled_mm.bound")


def test_pytest_properties_applies_the_ledger_strictly(tmp_path):
    # A ledger entry for a contract that passes must fail the run (XPASS strict): a fix upstream
    # forces the entry's removal. One cheap contract, run in a subprocess like CI runs it.
    import os
    import subprocess

    ledger = tmp_path / "kf.py"
    ledger.write_text('KNOWN_FAILURES = [{"backend": "reference", "property": "quantize.sign_symmetry", '
                      '"upstream": "https://example.org/issue/1", "reason": "test"}]\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FP8REF_KNOWN_FAILURES=str(ledger), FP8REF_HYPOTHESIS_PROFILE="dev")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "properties",
                           "--fp8ref-backend", "reference", "-k", "sign_symmetry", "-rX"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "XPASS(strict)" in proc.stdout and "example.org/issue/1" in proc.stdout


def test_ci_verdicts_do_not_depend_on_the_clock(monkeypatch):
    """ci is bounded by counts only: a clock that jumps an hour per reading (a very slow machine)
    runs the same examples and gives the same report as the real one."""
    import itertools

    from fp8ref.conformance import driver

    assert get_profile("ci").time_budget_s == float("inf")
    args = (Fp32Base(), "ci")
    kw = dict(seed=0, contracts=["quantize.sign_symmetry", "scaled_mm.sign_symmetry"])
    real = check(*args, **kw)
    ticks = itertools.count(0, 3600.0)
    monkeypatch.setattr(driver.time, "perf_counter", lambda: float(next(ticks)))
    slow = check(*args, **kw)
    assert real.passed and slow.passed
    def counts(rep):
        return [(r.examples, r.sweep, r.note) for r in rep.results]

    assert counts(real) == counts(slow)
    assert all(r.examples > r.sweep > 0 for r in real.results)


def test_a_per_element_backend_gets_fewer_examples_not_less_time():
    """A backend that pays per element (``conformance_max_elems``) gets a count of search examples
    and a thinned sweep for its secondary contracts, never a time budget, in ci."""
    from fp8ref.conformance.driver import _profile_for

    class Slow(Fp32Base):
        name = "slow-per-element"
        conformance_max_elems = 2048

    ci = get_profile("ci")
    eff = _profile_for(Slow(), ci)
    assert eff.time_budget_s == float("inf") and eff.max_examples == ci.slow_examples < ci.max_examples
    assert eff.max_elems == 2048 and eff.sweep_stride > 1
    assert _profile_for(Fp32Base(), ci) == ci
