"""The spec's CLI subcommands: ``fp8ref formats`` and the main job ``fp8ref demo``."""

from fp8ref.cli import main
from fp8ref.cli.spec import demo_linear


def test_formats_table_and_codes(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "e4m3fn" in out and "57344" in out
    assert main(["formats", "--codes", "e4m3fn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 256 and lines[0x7E] == "0x7E  448.0" and lines[0x7F] == "0x7F  nan"


def test_demo_rows_are_within_their_bounds():
    rows = demo_linear(seed=1, M=4, N=32, K=64)
    assert {r["recipe"] for r in rows} >= {"w8a8_fp8", "fp8", "fp8_block"}
    for r in rows:
        assert 0 < r["max_err_over_bound"] <= 1.0
        assert 0 < r["rel_l2"]


def test_demo_main_job_without_conformance(capsys):
    assert main(["demo", "--no-conformance"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "backend='auto') chose" in out and "all checks passed" in out
