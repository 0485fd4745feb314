"""Every ``FP8REF_*`` variable is declared in ``fp8ref._env`` and read by one rule (issue 40):
unset or blank is the default; anything else must parse, or the read raises naming the variable.
docs/environment.md is generated from the declarations."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref import _env
from fp8ref import select as sel
from fp8ref.select import cache

ROOT = Path(__file__).resolve().parents[1]
#: The repository's copy (fp8ref may be imported from an installed copy, as under tox).
DOC = ROOT / "docs" / "environment.md"
#: Values each kind refuses (kind -> values); every one must raise, naming the variable.
BAD = {
    "flag": ["maybe", "2", "enabled", "0,1"],
    "names": [" , ,", ",", "a,,b", "a, "],
    "name": ["a,b", ","],
    "choice": ["bogus", "SAMPLE"],
    "seconds": ["inf", "-inf", "nan", "-1", "0", "1e9", "soon", "10s"],
    "path": ["~no-such-user-fp8ref/x"],
}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for v in _env.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)


def test_the_doc_is_generated_from_the_declarations():
    assert DOC.read_text() == _env.document(), "docs/environment.md is stale: run `python -m fp8ref env --write`"


def test_every_variable_in_the_code_is_declared_and_every_declared_one_is_read():
    mentioned: dict[str, set[str]] = {}
    for top in ("fp8ref", "properties"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name == "_env.py":
                continue
            for name in re.findall(r"\bFP8REF_[A-Z0-9_]+", path.read_text()):
                mentioned.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    declared = {v.name for v in _env.VARIABLES}
    assert set(mentioned) - declared == set(), {n: mentioned[n] for n in set(mentioned) - declared}
    assert declared - set(mentioned) == set()


def test_the_readme_names_declared_variables_and_how_many_there_are():
    """README.md lists the most used variables and points to docs/environment.md for all: every
    name it gives is declared, and the count it states is the declarations'."""
    readme = (ROOT / "README.md").read_text()
    declared = {v.name for v in _env.VARIABLES}
    assert set(re.findall(r"\bFP8REF_[A-Z0-9_]+[A-Z0-9]", readme)) <= declared
    assert f"all {len(declared)} `FP8REF_*` variables" in readme and "docs/environment.md" in readme


def test_no_fp8ref_variable_is_read_around_the_module():
    """``os.environ`` reads of an ``FP8REF_*`` name by its literal go through ``_env.get``."""
    raw = re.compile(r"environ(?:\.get\(|\[)\s*[\"']FP8REF_")
    offenders = [str(p.relative_to(ROOT)) for top in ("fp8ref", "properties") for p in (ROOT / top).rglob("*.py")
                 if p.name != "_env.py" and raw.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("var", _env.VARIABLES, ids=lambda v: v.name)
def test_each_variable_refuses_its_bad_values_by_name_and_takes_blank_as_default(var, monkeypatch):
    for bad in BAD[var.kind]:
        monkeypatch.setenv(var.name, bad)
        with pytest.raises(_env.EnvVarError, match=f"^{var.name}={re.escape(repr(bad))} is not accepted: "
                                                  f"{var.name} must be ") as info:
            _env.get(var.name)
        assert info.value.name == var.name and isinstance(info.value, ValueError)
        with pytest.raises(_env.EnvVarError):  # raised again while the bad value stays (nothing cached)
            _env.get(var.name)
    for blank in ("", "  "):
        monkeypatch.setenv(var.name, blank)
        assert _env.get(var.name) == var.default
    monkeypatch.delenv(var.name)
    assert _env.get(var.name) == var.default


def test_the_kinds_parse_what_they_accept(monkeypatch):
    for text, value in (("1", True), ("On", True), (" yes ", True), ("TRUE", True), ("0", False), ("off", False),
                        ("No", False), ("false", False)):
        monkeypatch.setenv("FP8REF_NATIVE", text)
        assert _env.get("FP8REF_NATIVE") is value
    monkeypatch.setenv("FP8REF_CANDIDATES", " cpu-bf16 ,reference")
    assert _env.get("FP8REF_CANDIDATES") == ("cpu-bf16", "reference")
    monkeypatch.setenv("FP8REF_ALLOW_BACKENDS", "*")
    assert _env.get("FP8REF_ALLOW_BACKENDS") == frozenset({"*"})
    monkeypatch.setenv("FP8REF_BACKEND", " auto ")
    assert _env.get("FP8REF_BACKEND") is None
    monkeypatch.setenv("FP8REF_CACHE_LOCK_TIMEOUT", "0.25")
    assert _env.get("FP8REF_CACHE_LOCK_TIMEOUT") == 0.25
    monkeypatch.setenv("FP8REF_CACHE_DIR", "~/fp8ref-x")
    assert _env.get("FP8REF_CACHE_DIR") == os.path.join(os.path.expanduser("~"), "fp8ref-x")


def test_the_profiles_variable_names_the_profiles_there_are():
    from fp8ref.conformance.profiles import PROFILES

    assert set(next(v for v in _env.VARIABLES if v.name == "FP8REF_HYPOTHESIS_PROFILE").choices) == set(PROFILES)


# The cases of the issue, through the code that acts on them.

def test_blank_candidates_do_not_restrict_auto_to_the_reference(monkeypatch, tmp_path):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(sel.ENV_CANDIDATES, " , ,")
    with pytest.raises(ValueError, match="^FP8REF_CANDIDATES=' , ,' is not accepted"):
        sel.select(fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8))


def test_an_infinite_lock_timeout_is_refused_before_any_wait(monkeypatch, tmp_path):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(cache.ENV_LOCK_TIMEOUT, "inf")
    sel.clear_cache()
    with pytest.raises(ValueError, match="^FP8REF_CACHE_LOCK_TIMEOUT='inf' is not accepted"):
        fp8ref.linear(torch.randn(2, 64), torch.randn(16, 64), candidates=["reference"])
    sel.clear_cache()


def test_a_garbage_native_flag_is_an_error_like_every_flag(monkeypatch):
    from fp8ref.kernels import cpu, native

    monkeypatch.setenv(native.ENV_NATIVE, "maybe")
    with pytest.raises(ValueError, match="^FP8REF_NATIVE='maybe'"):
        native._flag(native.ENV_NATIVE)
    monkeypatch.setenv("FP8REF_COMPILE", "maybe")
    with pytest.raises(ValueError, match="^FP8REF_COMPILE='maybe'"):
        cpu.compile_enabled()


def test_a_cache_dir_with_a_tilde_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(sel.ENV_CACHE_DIR, "~/fp8ref-cache")
    assert cache.cache_file() == tmp_path / "fp8ref-cache" / cache.cache_file().name


def test_a_read_costs_one_lookup_when_the_value_did_not_change(monkeypatch):
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference")
    first = _env.get("FP8REF_CANDIDATES")
    assert _env.get("FP8REF_CANDIDATES") is first  # parsed once, kept with its text
    monkeypatch.setenv("FP8REF_CANDIDATES", "reference,cpu-bf16")
    assert _env.get("FP8REF_CANDIDATES") == ("reference", "cpu-bf16")
