"""The kernel author's path, end to end: the example project ``examples/naive-fp8`` is installed
(pip, into a scratch directory) and certified through the three routes of
docs/writing-a-backend.md -- pytest with the ``fp8ref_certify`` fixture, ``check()`` from Python,
and the CLI through the ``fp8ref.backends`` entry point -- and the planted bugs of
``naive_fp8.bugs`` are each rejected by the contract the walk-through names.

Every run uses the derandomized ``ci`` profile (the default), so the verdicts are the same on
every run. Two subprocesses (pytest, the CLI); the rest runs in this process.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "naive-fp8"
DOC = ROOT / "docs" / "writing-a-backend.md"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(project copy, site dir, env): the example pip-installed into a scratch site directory,
    offline, without touching the source tree or this environment."""
    tmp = tmp_path_factory.mktemp("naive-fp8")
    proj = tmp / "naive-fp8"
    shutil.copytree(EXAMPLE, proj, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(proj)], check=True, capture_output=True, text=True, timeout=300)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, FP8REF_HYPOTHESIS_PROFILE="ci", FP8REF_PROGRESS="0",
               FP8REF_CACHE_DIR=str(tmp / "cache"))
    return proj, site, env


def _run(cmd, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def example_importable(installed, monkeypatch):
    """``naive_fp8`` importable in this process, after the registry has loaded: the example's
    entry point must not register it here, where other tests iterate over every backend."""
    from fp8ref import backends

    backends()
    monkeypatch.syspath_prepend(str(installed[1]))
    return installed


def test_installed_entry_point(installed):
    from importlib.metadata import distributions

    (dist,) = [d for d in distributions(path=[str(installed[1])]) if d.metadata["Name"] == "naive-fp8"]
    eps = [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "fp8ref.backends"]
    assert eps == [("naive-fp8", "naive_fp8:NaiveFp8Backend")]


def test_pytest_route(installed):
    """The project's own test suite (tests/conftest.py + the fixture), one test per contract."""
    proj, _, env = installed
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], proj, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    from fp8ref.conformance import CONTRACT_NAMES

    assert f"{len(CONTRACT_NAMES)} passed" in r.stdout, r.stdout[-2000:]
    assert f"fp8ref: {len(CONTRACT_NAMES)} contract run(s) under the ci profile, seed 0" in r.stdout


def test_python_route(example_importable, monkeypatch, capsys):
    """certify.py, run as ``python certify.py`` would run it (in this process: no second torch import)."""
    proj = example_importable[0]
    monkeypatch.setattr(sys, "argv", ["certify.py"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(proj / "certify.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert stop.value.code == 0, out
    assert "naive-fp8  [ci profile, seed 0]" in out and "PASSED" in out, out


def test_cli_route(installed, tmp_path):
    """The backend registered by its entry point, through the CLI (two contracts: the full table
    runs in the other routes); linear.bound then goes through fp8ref.linear(backend="naive-fp8")."""
    proj, _, env = installed
    out = tmp_path / "naive.json"
    r = _run([sys.executable, "-m", "fp8ref", "conformance", "--backend", "naive-fp8", "--only", "scaled_mm.bound",
              "--only", "linear.bound", "--json", str(out)], proj, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    (rep,) = json.loads(out.read_text())
    assert rep["profile"] == "ci" and rep["passed"]
    assert all(c["status"] == "pass" and c["examples"] > 0 for c in rep["results"]), rep["results"]


def test_planted_bugs_are_caught(example_importable):
    """Each bug of naive_fp8.bugs fails the contract named in CAUGHT_BY (so the certification above
    is not vacuous), with a counterexample and a reproduce line."""
    from naive_fp8.bugs import CAUGHT_BY

    from fp8ref.conformance import check

    assert len(CAUGHT_BY) == 3
    for cls, contract in CAUGHT_BY.items():
        rep = check(cls(), "ci", contracts=[contract])
        (res,) = rep.results
        assert res.status == "fail" and res.counterexample and res.reproduce, (cls.__name__, res)


def test_walkthrough_code_is_the_example():
    """Every code block of docs/writing-a-backend.md that names a file of the example project
    (a first line ``# examples/naive-fp8/...``) is that file's content, so the walk-through shows
    exactly what CI installs and certifies."""
    text = DOC.read_text()
    blocks = re.findall(r"```\w*\n(# (examples/naive-fp8/\S+)\n.*?)```", text, flags=re.S)
    names = {name for _, name in blocks}
    assert {"examples/naive-fp8/pyproject.toml", "examples/naive-fp8/src/naive_fp8/backend.py",
            "examples/naive-fp8/tests/test_fp8ref_conformance.py", "examples/naive-fp8/tests/conftest.py"} <= names
    for block, name in blocks:
        body = block.split("\n", 1)[1]
        assert body == (ROOT / name).read_text(), f"{name} differs from its block in {DOC.name}"
