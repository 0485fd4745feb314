"""pytest plug-in (entry point ``pytest11``): certify FP8 backends with fp8ref from pytest.

Options
-------
``--fp8ref-backend NAME``  certify this backend (repeatable; default: every registered backend,
                           unavailable ones reported as skipped with their reason).
``--fp8ref-profile P``     dev, ci or thorough (default: ``$FP8REF_HYPOTHESIS_PROFILE``, else ci).
``--fp8ref-seed S``        Hypothesis seed (default: the profile's fixed seed for ``ci``, which is
                           derandomized; else one random seed per session, printed in the
                           header and in every failure with the command that reproduces it).

Fixtures
--------
``fp8ref_certify``  a function ``certify(backend, contract=None, ops=None, schemes=None)`` that
                    runs one contract (or all) against a backend instance or registered name and
                    fails the test with the counterexample and the call that reproduces it. A
                    contract of a claimed op on which no example ran ("untested": the backend
                    declined everything) fails too; one of an op the backend does not declare
                    (or ``ops`` leaves out) is skipped as "not claimed". A kernel repository
                    certifies its backend with::

                        import pytest
                        from fp8ref.conformance import CONTRACT_NAMES
                        from mykernels import MyBackend

                        @pytest.mark.parametrize("contract", CONTRACT_NAMES)
                        def test_fp8ref_conformance(fp8ref_certify, contract):
                            fp8ref_certify(MyBackend(), contract)

``fp8ref_profile``  the selected profile name.
``fp8ref_backend_names``  the backend names selected by ``--fp8ref-backend``.

With ``$FP8REF_HYPOTHESIS_PROFILE`` set, the plug-in also loads the Hypothesis settings profile
``fp8ref-<name>`` for every Hypothesis test of the session.

Every contract runs in its own test with no Hypothesis example database, so the tests run under
pytest-xdist (``-n auto``, or ``--tx`` remote workers) with no state shared between workers.
"""

from __future__ import annotations

import pytest

_SESSION_SEED = "_fp8ref_session_seed"
_CERTIFIED = "_fp8ref_contracts_run"


def _add(group, *args, **kwargs) -> None:
    try:
        group.addoption(*args, **kwargs)
    except ValueError:  # already added: the plug-in is both installed and loaded from a conftest
        pass


def pytest_addoption(parser):
    group = parser.getgroup("fp8ref")
    _add(group, "--fp8ref-backend", action="append", default=None,
         help="certify this backend (repeatable); default: every registered backend")
    _add(group, "--fp8ref-profile", default=None, choices=("dev", "ci", "thorough"),
         help="conformance profile: ci (derandomized, finds the bugs), dev (quick), thorough (nightly); "
              "default: $FP8REF_HYPOTHESIS_PROFILE, else ci")
    _add(group, "--fp8ref-seed", type=int, default=None,
         help="Hypothesis seed for the conformance contracts (default: the profile's; ci: fixed at 0)")


_PROFILE_VAR = "FP8REF_HYPOTHESIS_PROFILE"


def pytest_configure(config):
    """With ``$FP8REF_HYPOTHESIS_PROFILE`` set (tox sets ``ci``), every Hypothesis test of the
    session runs under the matching settings profile ``fp8ref-<name>`` (examples per test, no
    example database, no deadline)."""
    import os

    # Whether it is set at all (importing fp8ref only to learn that would slow every pytest session);
    # its value is read, and checked, by get_profile through fp8ref._env.
    if not (os.environ.get(_PROFILE_VAR) or "").strip():
        return
    try:  # the plug-in loads in every pytest session where fp8ref is installed, with or without hypothesis
        from hypothesis import settings
    except ImportError:
        return
    from fp8ref.conformance.profiles import get_profile

    settings.load_profile(f"fp8ref-{get_profile(None).name}")


def session_seed(config) -> int:
    """The seed of this session's contracts: ``--fp8ref-seed``, else the profile's choice (fixed
    for a derandomized profile, random otherwise), drawn once per session."""
    seed = getattr(config, _SESSION_SEED, None)
    if seed is None:
        from fp8ref.conformance.profiles import get_profile, resolve_seed

        seed = resolve_seed(get_profile(selected_profile(config)), config.getoption("--fp8ref-seed", default=None))
        setattr(config, _SESSION_SEED, seed)
    return seed


def pytest_report_header(config):
    try:
        from fp8ref.conformance.profiles import get_profile
    except ImportError:  # the conformance extra (hypothesis) is not installed
        return None
    prof = get_profile(selected_profile(config))
    how = "fixed (derandomized profile)" if prof.derandomize else "random this session"
    return (f"fp8ref: conformance profile {prof.name}, seed {session_seed(config)} ({how}; "
            f"--fp8ref-seed {session_seed(config)} reproduces)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line naming the profile and seed the session's contracts ran under (also under -q,
    where the header is not shown)."""
    n = getattr(config, _CERTIFIED, 0)
    if n:
        prof, seed = selected_profile(config), session_seed(config)
        terminalreporter.write_line(f"fp8ref: {n} contract run(s) under the {prof} profile, seed {seed} "
                                    f"(--fp8ref-seed {seed} reproduces; --fp8ref-profile dev for a quick run)")


def selected_backend_names(config) -> list[str]:
    """The names given with ``--fp8ref-backend``, else every registered backend."""
    names = config.getoption("--fp8ref-backend", default=None)
    if names:
        return list(names)
    from fp8ref.registry import backends

    return [b.name for b in backends()]


def selected_profile(config) -> str:
    from fp8ref.conformance.profiles import default_profile_name

    return config.getoption("--fp8ref-profile", default=None) or default_profile_name()


@pytest.fixture
def fp8ref_profile(request) -> str:
    """The conformance profile selected for this run."""
    return selected_profile(request.config)


@pytest.fixture
def fp8ref_backend_names(request) -> list[str]:
    """The backends selected with ``--fp8ref-backend`` (default: every registered one)."""
    return selected_backend_names(request.config)


@pytest.fixture
def fp8ref_certify(request):
    """``certify(backend, contract=None)``: run fp8ref's contracts, fail with the counterexample.

    ``contract`` None runs the whole table. Info contracts (batch invariance, bit-exact
    quantization) never fail; their yes/no goes to the test's ``user_properties`` (JUnit XML).
    An unavailable backend skips the test with its reason.
    """
    from fp8ref.conformance import CONTRACTS, check_contract, get_contract, make_scope
    from fp8ref.registry import Backend, get_backend

    profile = selected_profile(request.config)
    seed = session_seed(request.config)

    def certify(backend: Backend | str, contract: str | None = None, ops=None, schemes=None) -> list:
        b = get_backend(backend) if isinstance(backend, str) else backend
        reason = b.available()
        if reason is not None:
            pytest.skip(f"backend {b.name!r} unavailable: {reason}")
        scope = make_scope(b, ops, schemes)
        results = []
        for c in CONTRACTS if contract is None else (get_contract(contract),):
            r = check_contract(b, c, profile, seed, scope=scope)
            setattr(request.config, _CERTIFIED, getattr(request.config, _CERTIFIED, 0) + 1)
            request.node.user_properties.append((f"{b.name}:{r.contract}", r.status))
            results.append(r)
        failed = [r for r in results if r.failed]
        if failed:
            msg = "\n".join(f"{r.contract} on {b.name} ({r.status}, {profile} profile, seed {seed}): {r.message}"
                            "\n  counterexample: "
                            f"{r.counterexample}\n  reproduce: {r.reproduce}" for r in failed)
            pytest.fail(msg, pytrace=False)
        untested = [r for r in results if r.status == "untested"]
        if untested:
            pytest.fail("\n".join(f"{r.contract} on {b.name} is untested (not certified): {r.note}" for r in untested),
                        pytrace=False)
        if all(r.status in ("n/a", "not claimed") for r in results):
            pytest.skip("; ".join(f"{r.contract}: {r.status}: {r.note}" for r in results))
        return results

    return certify
