"""What the ``tests/test_reliability_*.py`` files (issue 13) share: an isolated selection cache and
weight cache for every test, and the registry's available backends (the tests parametrise over the
registry, so a backend added later is fed the same bad inputs without a new test)."""

from __future__ import annotations

import sys

import pytest

import fp8ref
from fp8ref import select as sel
from fp8ref.registry import backends, get_backend

L = sys.modules["fp8ref.api"]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Autouse in every module that imports it: a fresh cache directory, no forced backend or
    candidate list, empty in-memory decisions and weight cache, before and after the test."""
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(sel.ENV_BACKEND, raising=False)
    monkeypatch.delenv(sel.ENV_CANDIDATES, raising=False)
    sel.clear_cache()
    L.clear_weight_cache()
    yield
    sel.clear_cache()
    L.clear_weight_cache()


def available() -> list[str]:
    """Names of the registered backends that can run on this machine."""
    return [i.name for i in backends() if i.available]


def taking(name: str, case: fp8ref.Case) -> fp8ref.Backend:
    """The backend, skipping the test (with the backend's reason) where it declines the case."""
    b = get_backend(name)
    reason = b.supports(case)
    if reason:
        pytest.skip(f"{name} declines {case.short_str()}: {reason}")
    return b
