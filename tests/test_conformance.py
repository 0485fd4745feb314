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
from mutants.catalogue import Acc14Bits, Bf16Accumulation, Fp32Base, HonestBf16, ScaleTwice  # noqa: E402


def test_contract_table_is_complete():
    assert len(set(CONTRACT_NAMES)) == len(CONTRACTS)
    assert {c.kind for c in CONTRACTS} == {"exact", "bounded", "probe", "info"}
    for op in ("quantize", "scaled_mm", "linear"):
        assert any(c.op == op for c in CONTRACTS)


def test_accumulator_bits_reads_the_accumulator():
    assert accumulator_bits(get_backend("reference")) == PROBE_MAX_BITS
    assert accumulator_bits(Fp32Base()) == 24
    assert accumulator_bits(Acc14Bits()) == 14
    assert accumulator_bits(Bf16Accumulation()) == 8


def test_probe_contract_compares_with_declaration():
    assert check(HonestBf16(), "dev", seed=0, contracts=["scaled_mm.accumulator_bits"]).passed
    rep = check(Bf16Accumulation(), "dev", seed=0, contracts=["scaled_mm.accumulator_bits"])
    assert not rep.passed and "declares fp32" in rep.results[0].message


def test_failure_has_shrunk_counterexample_and_reproduction():
    rep = check(ScaleTwice(), "dev", seed=7, contracts=["scaled_mm.bound"])
    r = rep.results[0]
    assert r.status == "fail" and not rep.passed
    assert "M=" in r.counterexample and "ratio" in r.message
    assert "--seed 7" in r.reproduce and "--only scaled_mm.bound" in r.reproduce


def test_report_json_roundtrip_and_merge(tmp_path):
    a = check("reference", "dev", seed=1, contracts=["quantize.codes", "scaled_mm.batch_invariant"])
    b = check(ScaleTwice(), "dev", seed=1, contracts=["scaled_mm.bound"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps([a.to_dict(), b.to_dict()]))
    back = load_report(str(path))
    assert [r.backend for r in back] == ["reference", "mutant-scale-twice"]
    assert back[0].passed and not back[1].passed and back[0].batch_invariant == "yes"
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


def test_unavailable_backend_is_reported_with_reason():
    class Gone(Fp32Base):
        name = "gone"

        def available(self):
            return "needs a device this machine lacks"

    rep = check(Gone(), "dev", seed=0)
    assert not rep.available and rep.reason == "needs a device this machine lacks" and rep.passed
    assert "unavailable: needs a device" in rep.to_markdown()


def test_profiles_and_env(monkeypatch):
    from fp8ref.conformance.profiles import default_profile_name

    monkeypatch.setenv("FP8REF_HYPOTHESIS_PROFILE", "ci")
    assert default_profile_name() == "ci" and get_profile(None).name == "ci"
    monkeypatch.setenv("FP8REF_HYPOTHESIS_PROFILE", "nope")
    with pytest.raises(ValueError, match="not a profile"):
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
    assert rc == 0 and "quantize.codes" in capsys.readouterr().out
    assert load_report(str(out))[0].passed and "| quantize.codes |" in md.read_text()
    assert cli_main(["conformance", "--merge", str(out)]) == 0
    assert cli_main(["conformance", "--list"]) == 0


def test_cli_fails_on_a_failing_backend(tmp_path):
    from fp8ref.registry import register_backend, unregister_backend

    register_backend(Bf16Accumulation(), replace=True)
    try:
        rc = cli_main(["conformance", "--backend", Bf16Accumulation.name, "--profile", "dev", "--seed", "0",
                       "--only", "scaled_mm.accumulator_bits", "--known-failures", str(_empty_ledger(tmp_path))])
    finally:
        unregister_backend(Bf16Accumulation.name)
    assert rc == 1


def _empty_ledger(tmp_path):
    p = tmp_path / "kf.py"
    p.write_text("KNOWN_FAILURES = []\n")
    return p


def test_declared_accumulation_respected():
    assert HonestBf16.accumulation is Accumulation.BF16


@pytest.mark.parametrize("name", ["fp8ref.conformance.driver", "fp8ref.conformance.probe",
                                  "fp8ref.conformance.strategies", "fp8ref.conformance.peers"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_certify_fixture_for_a_kernel_repo(fp8ref_certify):  # noqa: F811
    # What a third-party kernel repository writes: an unregistered instance, one contract per test.
    results = fp8ref_certify(Fp32Base(), "quantize.codes")
    assert [r.status for r in results] == ["pass"]
    with pytest.raises(pytest.fail.Exception, match="minimal counterexample"):
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
