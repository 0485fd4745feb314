"""What a user meets before any number: the default profile, help pages, reprs, progress bars,
tables that keep their reasons, and a pytest that runs without optional plug-ins (issue 14)."""

from __future__ import annotations

import argparse
import inspect
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

import fp8ref
from fp8ref.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_default_profile_is_ci_unless_the_environment_says(monkeypatch):
    pytest.importorskip("hypothesis")
    from fp8ref.conformance.profiles import default_profile_name, get_profile

    monkeypatch.delenv("FP8REF_HYPOTHESIS_PROFILE", raising=False)
    assert default_profile_name() == "ci" and get_profile(None).name == "ci"
    assert build_parser().parse_args(["conformance"]).profile is None  # None: the default above
    monkeypatch.setenv("FP8REF_HYPOTHESIS_PROFILE", "dev")
    assert default_profile_name() == "dev"


def _pages(parser: argparse.ArgumentParser, path: str = "fp8ref"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _pages(sub, f"{path} {name}")


def test_every_cli_page_has_a_description_and_every_option_help_with_its_default():
    problems = []
    for path, page in _pages(build_parser()):
        text = page.format_help()
        if not page.description:
            problems.append(f"{path}: no description")
        if "``" in text:
            problems.append(f"{path}: reST markup in the help page")
        for a in page._actions:
            if not a.option_strings or a.help is argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if not a.help:
                problems.append(f"{path} {a.option_strings[0]}: no help text")
            elif a.default not in (None, False) and "default" not in page._get_formatter()._get_help_string(a):
                problems.append(f"{path} {a.option_strings[0]}: default {a.default!r} not in its help")
    assert not problems, "\n".join(problems)


def test_select_table_prints_whole_reasons_and_decision_repr_is_short():
    from fp8ref.select.decision import Decision, Row

    reason = ("no CUDA device, and TRITON_INTERPRET is not 1 (set it before triton is first used to run the "
              "kernels in Triton's CPU interpreter)")
    d = Decision("k", "M16-N32-K64", "standard", "reference", ["reference"],
                 rows=[Row("reference", "exact", compliant=True, admitted=True, chosen=True),
                       Row("triton", "strict", available=reason)])
    assert " ".join(d.table().split()).count(" ".join(reason.split())) == 1
    assert len(repr(d)) < 200 and "'reference'" in repr(d) and str(d) == d.table()


def test_help_of_linear_shows_a_short_default_recipe():
    sig = str(inspect.signature(fp8ref.linear))
    # The default recipe's repr once ran to thousands of characters (every format field).
    assert len(repr(fp8ref.W8A8_FP8)) < 80 and len(sig) < 400, sig
    assert "w8a8_fp8" in sig and "Fp8Format(" not in pydoc.render_doc(fp8ref.linear)
    assert repr(fp8ref.W8A8_FP8.activation) == "<QuantScheme e4m3fn-row-dyn>"


def test_progress_bars_say_what_is_happening(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    pytest.importorskip("hypothesis")
    from fp8ref import _progress
    from fp8ref.conformance import check
    from fp8ref.select import select

    monkeypatch.setattr(_progress, "DELAY_S", 0.0)
    monkeypatch.setenv(_progress.ENV_VAR, "1")  # captured stderr is not a terminal: force the bars
    check("reference", "dev", seed=0, contracts=["quantize.sign_symmetry"])
    assert "certifying reference (dev profile)" in capsys.readouterr().err
    select(fp8ref.Case(M=2, N=8, K=16, recipe=fp8ref.W8A8_FP8), candidates=["reference"], refresh=True)
    assert "selecting a backend for M2-N8-K16" in capsys.readouterr().err
    monkeypatch.setenv(_progress.ENV_VAR, "0")
    check("reference", "dev", seed=0, contracts=["quantize.sign_symmetry"])
    assert capsys.readouterr().err == ""


def test_demo_explains_every_column():
    from fp8ref.cli.spec import _DEMO_COLUMNS

    for column in ("class", "quantize, scaled_mm, linear", "acc. bits", "time"):
        assert f"\n  {column}" in "\n" + _DEMO_COLUMNS, column


def test_demo_explains_every_recipe_in_one_line():
    from fp8ref.cli.spec import RECIPE_LINES

    assert set(RECIPE_LINES) == set(fp8ref.RECIPES)
    assert all("\n" not in line and len(line) < 110 for line in RECIPE_LINES.values())


def test_pytest_properties_runs_without_pytest_benchmark():
    """The repository's pytest settings name no option of an optional plug-in (-p no:benchmark
    stands for an environment without pytest-benchmark)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:benchmark", "-p", "no:cacheprovider",
                        "--collect-only", "-q", "properties"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_select_is_callable_by_its_obvious_name(tmp_path, monkeypatch):
    from fp8ref import select as sel
    from fp8ref.select import choose_backend, resolve  # the package's names still import

    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    sel.clear_cache()
    d = fp8ref.select((2, 16), (8, 16))
    assert d.chosen in d.ranking and callable(resolve)
    assert fp8ref.choose_backend is choose_backend
    import torch

    x, w = torch.randn(3, 2, 16), torch.randn(8, 16)
    d2 = fp8ref.select(x, w, torch.zeros(8))
    assert d2.key == fp8ref.select((6, 16), (8, 16), True, x_dtype=torch.float32).key
    with pytest.raises(ValueError, match="x has 15 features"):
        fp8ref.select((2, 15), (8, 16))
    with pytest.raises(TypeError, match="w must be a tensor"):
        fp8ref.select((2, 16), "w")
    with pytest.raises(ValueError, match="x_dtype=torch.float16 contradicts"):
        fp8ref.select(x, w, x_dtype=torch.float16)
    sel.clear_cache()


def test_progress_writes_lines_to_a_log_and_warns_when_oversubscribed(monkeypatch, capsys):
    from fp8ref import _progress

    monkeypatch.delenv(_progress.ENV_VAR, raising=False)
    monkeypatch.setattr(_progress, "LINE_EVERY_S", 0.0)  # captured stderr is not a terminal: lines
    with _progress.progress(total=4, desc="audit passes", unit="pass") as bar:
        for _ in range(2):
            bar.update(1)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("audit passes: 1/4 pass, ") and err[1].startswith("audit passes: 2/4 pass, ")
    assert "s left" in err[1]
    assert list(_progress.progress(range(3), desc="d")) == [0, 1, 2]
    monkeypatch.setattr(_progress.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(_progress.os, "cpu_count", lambda: 2)
    assert "load average 9.0 on 2 CPUs" in _progress.oversubscribed()
    monkeypatch.setattr(_progress.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert _progress.oversubscribed() is None


def test_bench_model_pairs_a_model_with_its_quantized_copy(tiny_bench_model):
    bm = tiny_bench_model
    r = bm.bench_model("llama8b", layers=2, prompt=8, tokens=2, repeat=1, budget_s=0.1)
    assert r["quantized_layers"] == 14 and r["skipped_layers"] == ["lm_head"]
    for phase in ("decode", "prefill"):
        f = r["eager"][phase]
        assert f["ratio"] > 0 and f["bf16_tokens_per_s"] > 0 and f["fp8_tokens_per_s"] > 0
    bd = r["breakdown"]
    assert bd["bf16"]["linear_layers"] == bd["fp8"]["linear_layers"] == 15 and bd["fp8"]["fp8_layers"] == 14
    assert "a decode token's time" in bm.format_model_report({"meta": {}, "models": [r]})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--model", "gpt5"])
