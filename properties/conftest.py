"""Parametrize the conformance tests over (backend, contract) pairs.

Backends come from ``--fp8ref-backend`` (default: every registered backend). An unavailable
backend's tests are skipped with its reason (never silently dropped); a pair listed in
``known_failures.py`` (or the file ``$FP8REF_KNOWN_FAILURES`` names; an entry with a ``property``
field naming a contract) is a strict xfail
carrying the upstream link, so an upstream fix turns it into a failure that forces removal. A
contract of an op the backend does not declare (``Backend.ops``) is skipped as "not claimed".
"""

from __future__ import annotations

import os

import pytest

from fp8ref import pytest_plugin
from fp8ref.pytest_plugin import fp8ref_backend_names, fp8ref_certify, fp8ref_profile  # noqa: F401 -- fixtures


def pytest_addoption(parser):
    # When fp8ref is installed its pytest11 entry point has added these already (then this is a no-op).
    pytest_plugin.pytest_addoption(parser)


def pytest_configure(config):
    pytest_plugin.pytest_configure(config)  # idempotent: loading a Hypothesis profile twice is harmless


def _known_failures() -> list[dict]:
    """Ledger entries that name a contract: ``$FP8REF_KNOWN_FAILURES`` or known_failures.py here."""
    from fp8ref import _env
    from fp8ref.cli.conformance import load_known_failures

    path = _env.get("FP8REF_KNOWN_FAILURES") or os.path.join(os.path.dirname(__file__), "known_failures.py")
    return [e for e in load_known_failures(path) if e.get("property")]


def pytest_generate_tests(metafunc):
    if not {"backend_name", "contract_name"} <= set(metafunc.fixturenames):
        return
    from fp8ref.conformance import CONTRACTS
    from fp8ref.registry import backends, get_backend

    infos = {b.name: b for b in backends()}
    known = _known_failures()
    params = []
    for name in pytest_plugin.selected_backend_names(metafunc.config):
        marks = []
        if name not in infos:
            get_backend(name)  # raises KeyError listing the registered names
        elif not infos[name].available:
            marks.append(pytest.mark.skip(reason=f"backend {name!r} unavailable: {infos[name].reason}"))
        declared = tuple(get_backend(name).ops) if name in infos else ()
        for c in CONTRACTS:
            contract = c.name
            cmarks = list(marks)
            if name in infos and c.op not in declared:
                cmarks.append(pytest.mark.skip(reason=f"not claimed: {name!r} declares ops {declared}, not {c.op}"))
            for e in known:
                if e["backend"] == name and e["property"] in (contract, "*"):
                    link = e.get("upstream") or e.get("link") or "no upstream link"
                    cmarks.append(pytest.mark.xfail(strict=True, reason=f"known failure {link}: {e.get('reason', '')}"))
            params.append(pytest.param(name, contract, marks=cmarks, id=f"{name}-{contract}"))
    metafunc.parametrize(("backend_name", "contract_name"), params)
