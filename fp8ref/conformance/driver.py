"""The conformance driver: run the contract table against a backend and report, without pytest.

``check(backend)`` runs every contract of ``CONTRACTS`` for the ops the backend claims: first the
op's corner sweep (``sweep.py``, deterministic), then a Hypothesis search (no example database,
so nothing is shared between processes) that shrinks a failure to a minimal counterexample. It
returns a ``Report`` (JSON and markdown, mergeable across runs and hosts) whose verdict is
``pass`` only when every claimed contract ran examples and none failed, with a coverage table of
what was tested and what the backend declined. The report classes live in ``report.py``
(re-exported here).
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from hypothesis import Verbosity, given, reject, settings
from hypothesis import seed as hseed
from hypothesis.errors import HypothesisException, Unsatisfiable

from .._progress import progress
from ..registry import Backend, get_backend
from ..spec.schemes import QuantScheme, Recipe
from .contracts import CONTRACTS, Contract, ContractViolation, Declined, get_contract, reference_threads
from .coverage import Coverage
from .probe import accumulator_bits
from .problems import problem_to_dict
from .profiles import Profile, get_profile, hypothesis_settings, resolve_seed
from .report import (
    ERROR,
    FAIL,
    NA,
    NO,
    NOT_CLAIMED,
    PASS,
    UNTESTED,
    XFAIL,
    XPASS,
    YES,
    ContractResult,
    Report,
    apply_known_failures,
    load_report,
    merge_reports,
)
from .scope import Scope, make_scope
from .sweep import corner_sweep, exhaustive

__all__ = ["ContractResult", "Report", "check", "check_contract", "load_backend", "merge_reports", "load_report",
           "apply_known_failures", "reproduce_line", "PASS", "FAIL", "ERROR", "NA", "XFAIL", "XPASS", "YES", "NO",
           "UNTESTED", "NOT_CLAIMED"]


def _blob(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", []) or []:
        if "@reproduce_failure" in note:
            return note.strip().splitlines()[-1].strip()
    return None


def _profile_for(backend: Backend, prof: Profile) -> Profile:
    """The profile for ``backend``: a backend that pays per element (the Triton interpreter) sets
    ``conformance_max_elems``; it then gets operands of at most that many elements and hint/128
    rows (such kernels also pay per row program), the secondary contracts run every fourth sweep
    item, and the search runs ``slow_examples`` examples per contract. A backend's optional
    ``conformance_max_examples`` hint lowers the search's example count further. All of these are
    counts, never times: a derandomized profile checks the same examples on every machine. The
    report says so."""
    hint = getattr(backend, "conformance_max_elems", None)
    if isinstance(hint, int) and 0 < hint < prof.max_elems:
        prof = prof.with_(max_elems=hint, max_rows=min(prof.max_rows, max(1, hint // 128)), sweep_stride=4,
                          max_examples=min(prof.max_examples, prof.slow_examples))
    hint = getattr(backend, "conformance_max_examples", None)
    if isinstance(hint, int) and 0 < hint < prof.max_examples:
        prof = prof.with_(max_examples=hint)
    return prof


def _class_path(backend: Backend) -> str | None:
    """``module:Class`` when ``check`` can rebuild an equal backend from it (an importable class
    whose constructor takes no argument), else None."""
    cls = type(backend)
    if "<" in cls.__qualname__ or cls.__module__ in ("__main__", "builtins"):
        return None
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def load_backend(path: str) -> Backend:
    """The backend named ``module:Class`` (a fresh instance) or ``module:instance``: how a
    reproduce line names a backend that is not registered.

    Examples
    --------
    >>> load_backend("fp8ref.kernels.reference:ReferenceBackend").name
    'reference'
    """
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"backend path must be 'module:Class', got {path!r}")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load backend {path!r}: {exc}") from None
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"{path!r} is {type(backend).__name__}, not an fp8ref.Backend")
    return backend


def _backend_expr(backend: Backend) -> tuple[str, str]:
    """(how the Python reproduce line names the backend, a comment saying what it is)."""
    if _registered(backend):
        return repr(backend.name), ""
    path = _class_path(backend)
    if path is not None:
        return repr(path), ""
    cls = type(backend)
    return "<backend>", (f"  # <backend>: the {cls.__module__}.{cls.__qualname__} instance {backend.name!r} "
                         f"(its class cannot be rebuilt from a path)")


def _registered(backend: Backend) -> bool:
    try:
        return get_backend(backend.name) is backend
    except KeyError:
        return False


def reproduce_line(backend: Backend, profile: str, seed: int, contract: str, scope: Scope | None = None) -> str:
    """The call that reproduces a failure: always the Python call; for a backend registered
    under its name (and a check not narrowed to schemes), the CLI command as well.

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance.driver import reproduce_line
    >>> print(reproduce_line(get_backend("reference"), "ci", 3, "scaled_mm.bound").replace("  or: ", "\\n"))
    fp8ref.conformance.check('reference', profile='ci', seed=3, contracts=['scaled_mm.bound'])
    fp8ref conformance --backend reference --profile ci --seed 3 --only scaled_mm.bound
    """
    who, note = _backend_expr(backend)
    extra = ""
    if scope is not None and tuple(scope.ops) != tuple(backend.ops):
        extra += f", ops={tuple(scope.ops)!r}"
    if scope is not None and scope.narrowed:
        extra += ", schemes=<the same schemes>"
    py = f"fp8ref.conformance.check({who}, profile={profile!r}, seed={seed}, contracts=[{contract!r}]{extra})"
    if who.startswith("<") or (scope is not None and scope.narrowed):
        return py + note
    cli = f"fp8ref conformance --backend {who.strip(chr(39))} --profile {profile} --seed {seed} --only {contract}"
    if scope is not None and tuple(scope.ops) != tuple(backend.ops):
        cli += "".join(f" --ops {o}" for o in scope.ops)
    return f"{py}  or: {cli}"


def _claimed(backend: Backend, scope: Scope) -> str:
    text = scope.describe()
    if tuple(scope.ops) == tuple(backend.ops) and not scope.narrowed:
        text += " (everything the backend declares)"
    return text


def check_contract(backend: Backend, contract: Contract | str, profile: Profile | str | None = "ci",
                   seed: int = 0, max_examples: int | None = None, sweep: bool = True,
                   scope: Scope | None = None) -> ContractResult:
    """Run one contract against ``backend`` and return its result (never raises for a violation).

    First the contract's pinned examples and the op's corner sweep (``sweep=False`` skips both, to
    measure what the search alone finds), then the Hypothesis search. A contract of an op outside
    ``scope.ops`` (default: the backend's declared ops) is "not claimed"; one of a claimed op on
    which no example ran is "untested".

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance import check_contract
    >>> check_contract(get_backend("reference"), "quantize.sign_symmetry", "dev", seed=1).status
    'pass'
    """
    with reference_threads():
        return _check_contract(backend, contract, profile, seed, max_examples, sweep, scope)


def _check_contract(backend, contract, profile, seed, max_examples, sweep, scope) -> ContractResult:
    contract = get_contract(contract) if isinstance(contract, str) else contract
    prof = _profile_for(backend, get_profile(profile))
    scope = scope if scope is not None else make_scope(backend)
    t0 = time.perf_counter()
    res = ContractResult(contract.name, contract.kind, PASS, op=contract.op)
    missing = [op for op in (contract.op, *contract.requires) if op not in scope.ops]
    if missing:
        res.status = NOT_CLAIMED
        why = "not declared by the backend" if missing[0] not in backend.ops else "not among the ops checked"
        res.note = f"op {missing[0]} {why} (backend ops: {', '.join(backend.ops)})"
        return res
    res.reproduce = reproduce_line(backend, prof.name, seed, contract.name, scope)
    cov = Coverage()
    if contract.strategy is None:  # a probe: deterministic, no search
        try:
            contract.check(backend)
            res.examples = res.sweep = 1
        except Declined as exc:
            res.status, res.note = UNTESTED, str(exc)
            cov.decline(str(exc))
        except AssertionError as exc:
            res.status, res.message, res.counterexample = FAIL, str(exc), "accumulator probe (fixed input)"
            res.examples_to_failure = 1
        except Exception as exc:
            res.status, res.message, res.counterexample = ERROR, f"{type(exc).__name__}: {exc}", "probe"
            res.examples_to_failure = 1
        res.coverage = cov.to_dict()
        res.declined = sum(cov.declined.values())
        res.seconds = time.perf_counter() - t0
        if res.status == PASS:
            res.reproduce = None
        return res

    state: dict[str, Any] = {"n": 0, "worst": None, "fail": None, "budget": False, "first_fail_n": None}

    def run_one(problem):
        ratio = contract.check(backend, problem)
        state["n"] += 1
        cov.add(problem.facets())
        if ratio is not None and (state["worst"] is None or ratio > state["worst"]):
            state["worst"] = ratio

    failed_in_sweep = False
    if sweep:
        problems = [e for e in contract.examples if _in_scope(e, scope)] + _op_sweep(backend, contract, prof, seed,
                                                                                      scope)
        for problem in problems:
            try:
                run_one(problem)
            except Declined as exc:
                cov.decline(str(exc))
            except Exception as exc:  # noqa: BLE001 -- a violation or a crash of the backend, reported
                res.status = FAIL if isinstance(exc, AssertionError) else ERROR
                res.counterexample = repr(problem)
                res.problem = problem_to_dict(problem)
                res.message = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
                res.examples_to_failure = state["n"] + 1
                _count_failure(state, cov, problem, exc)
                failed_in_sweep = True
                break
        res.sweep = state["n"]

    if not failed_in_sweep and max_examples != 0:
        _search(backend, contract, prof, seed, max_examples, scope, state, cov, res, t0, run_one)

    res.examples = state["n"]
    if state["budget"] and res.status == PASS:
        res.note = (f"search stopped by the time budget of {prof.time_budget_s:g} s after "
                    f"{state['n'] - res.sweep} examples (the sweep ran {res.sweep})")
    res.declined = sum(cov.declined.values())
    res.coverage = cov.to_dict()
    res.worst_ratio = state["worst"]
    if res.status == PASS and state["n"] == 0:
        reasons = "; ".join(f"{r} (x{n})" for r, n in cov.declined.most_common(3)) or "nothing was drawn"
        if contract.kind == "info":
            res.status, res.note = NA, "no example applies: " + reasons
        else:
            res.status, res.note = UNTESTED, "no example ran (not certified): " + reasons
    if contract.kind == "info" and res.status in (PASS, FAIL):
        res.status = YES if res.status == PASS else NO
    if res.status in (PASS, YES, NA, UNTESTED):
        res.reproduce = None
    res.seconds = time.perf_counter() - t0
    return res


def _in_scope(problem, scope: Scope) -> bool:
    """Whether a pinned example lies within a narrowed claim (always, for an un-narrowed one)."""
    if not scope.narrowed:
        return True
    if hasattr(problem, "scheme"):
        return problem.scheme in scope.schemes
    return problem.recipe in scope.recipes


#: Sweeps generated per (backend, op, profile, seed, scope), shared by the contracts of an op and
#: by separate ``check_contract`` calls (pytest runs one contract per test).
_SWEEPS: OrderedDict = OrderedDict()


def _op_sweep(backend: Backend, contract: Contract, prof: Profile, seed: int, scope: Scope) -> list:
    key = (id(backend), type(backend).__qualname__, backend.name, contract.op, prof, seed, scope)
    problems = _SWEEPS.get(key)
    if problems is None:
        problems = corner_sweep(contract.op, prof, backend, seed, scope)
        _SWEEPS[key] = problems
        if len(_SWEEPS) > 64:
            _SWEEPS.popitem(last=False)
    if not contract.exhaustive:
        problems = [q for q in problems if not exhaustive(q)]
    problems = contract.sweep(problems) if contract.sweep is not None else list(problems)
    if contract.secondary and prof.sweep_stride > 1:
        off = CONTRACTS.index(contract) % prof.sweep_stride if contract in CONTRACTS else 0
        problems = problems[off::prof.sweep_stride]
    return problems


def _count_failure(state: dict, cov: Coverage, problem, exc: BaseException) -> None:
    """Count the failing example among the examples run (and in the coverage) and fold its
    error/bound into the contract's worst: a violation's own ratio, inf for a violation without
    one (a NaN code, differing bits); a crash of the backend has no ratio."""
    state["n"] += 1
    if problem is not None:
        cov.add(problem.facets())
    if isinstance(exc, ContractViolation):
        ratio = math.inf if exc.ratio is None else exc.ratio
        state["worst"] = ratio if state["worst"] is None else max(state["worst"], ratio)
    elif isinstance(exc, AssertionError):
        state["worst"] = math.inf


class _BudgetSpent(BaseException):  # noqa: N818 -- a signal, not an error: Hypothesis lets BaseExceptions through
    """Raised in the search when the time budget is spent; Hypothesis stops without shrinking."""


def _search(backend, contract, prof, seed, max_examples, scope, state, cov, res, t0, run_one) -> None:
    """The Hypothesis phase of ``check_contract`` (updates ``state``, ``cov`` and ``res``)."""
    n_sweep = state["n"]
    t_search = time.perf_counter()

    @settings(hypothesis_settings(prof, max_examples), verbosity=Verbosity.quiet)
    @hseed(seed)
    @given(contract.strategy(prof, scope))
    def run(problem):
        if (prof.time_budget_s is not None and state["fail"] is None and state["n"] > n_sweep
                and time.perf_counter() - t_search > prof.time_budget_s):
            raise _BudgetSpent  # ends the search at once (a failure being shrunk is not cut short)
        try:
            run_one(problem)
        except Declined as exc:
            cov.decline(str(exc))
            reject()
        except HypothesisException:
            raise
        except Exception as exc:
            if state["first_fail_n"] is None:
                state["first_fail_n"] = state["n"] + 1
            state["fail"] = (problem, exc)  # the last failure recorded is the shrunk one, replayed last
            raise

    try:
        run()
    except _BudgetSpent:
        state["budget"] = True
    except Unsatisfiable:
        pass
    except BaseException as exc:  # noqa: B036 -- Hypothesis raises ExceptionGroups / Flaky here too
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        problem, err = state["fail"] if state["fail"] else (None, exc)
        res.status = FAIL if isinstance(err, AssertionError) else ERROR
        res.counterexample = repr(problem) if problem is not None else None
        res.problem = problem_to_dict(problem) if problem is not None else None
        _count_failure(state, cov, problem, err)
        res.message = str(err) if isinstance(err, AssertionError) else f"{type(err).__name__}: {err}"
        res.examples_to_failure = state["first_fail_n"] or state["n"] + 1
        if "Flaky" in type(exc).__name__:
            res.message = "(fails only sometimes: non-deterministic) " + res.message
        blob = _blob(exc)
        if blob:
            res.reproduce = f"{res.reproduce}  # or in a test: {blob}"


def check(backend: Backend | str, profile: Profile | str | None = "ci", seed: int | None = None, *,
          contracts: Sequence[str] | None = None, known_failures: Iterable[dict] | None = None,
          fail_fast: bool = False, max_examples: int | None = None, sweep: bool = True,
          ops: Sequence[str] | None = None, schemes: Sequence[QuantScheme | Recipe] | None = None) -> Report:
    """Certify ``backend`` against every contract of ``CONTRACTS`` (or the named ones).

    Parameters
    ----------
    backend : Backend or str
        An instance (registered or not), a registered name, or ``"module:Class"`` (a class built
        with no argument, as the reproduce line of an unregistered backend names it).
    profile : Profile or str or None
        ``dev``, ``ci`` (default) or ``thorough``; None reads ``$FP8REF_HYPOTHESIS_PROFILE``.
    seed : int, optional
        Hypothesis seed (and the sweep's rotation). If omitted: the profile's fixed seed for a
        derandomized profile (``ci``: the same commit gives the same verdict), else a random one
        (reported with the results).
    contracts : sequence of str, optional
        Only these contracts.
    known_failures : iterable of dict, optional
        Ledger entries ``{"backend", "property", "upstream", "reason"}`` (see
        ``properties/known_failures.py``), applied as strict expected failures.
    fail_fast : bool
        Stop at the first failing contract (the mutant self-test uses it).
    max_examples : int, optional
        Override the profile's search examples per contract (the sweep always runs in full; 0: the
        sweep alone).
    sweep : bool
        Run each contract's pinned examples and the corner sweep before the search (default);
        False measures the search alone.
    ops : sequence of str, optional
        Certify only these of the backend's declared ops (default: all it declares); contracts of
        the others read "not claimed".
    schemes : sequence of QuantScheme or Recipe, optional
        Certify only for these schemes: quantize contracts draw the QuantSchemes (and the recipes'
        activation schemes), GEMM and linear contracts the Recipes (and each QuantScheme as
        activations with its dynamic twin as weights). The report says so.

    Returns
    -------
    Report
        ``report.verdict`` ("pass", "fail", "untested", "unavailable"), ``report.passed`` (True only
        for "pass"), per-contract results with counterexamples and coverage, JSON/markdown output.

    Examples
    --------
    >>> from fp8ref.conformance import check
    >>> report = check("reference", profile="dev", seed=0, contracts=["quantize.codes"])
    >>> report.passed, report.results[0].status
    (True, 'pass')
    """
    if isinstance(backend, str):
        backend = load_backend(backend) if ":" in backend else get_backend(backend)
    if not isinstance(backend, Backend):
        raise TypeError(f"expected an fp8ref.Backend or a registered name, got {type(backend).__name__}")
    prof = get_profile(profile)
    seed = resolve_seed(prof, seed)
    scope = make_scope(backend, ops, schemes)
    rep = Report(backend.name, prof.name, seed, precision=backend.precision.value,
                 accumulation=backend.accumulation.name, output_roundings=backend.output_roundings,
                 claimed=_claimed(backend, scope))
    eff = _profile_for(backend, prof)
    hints = ([f"max {eff.max_elems} elements and {eff.max_rows} rows per operand, secondary contracts on every "
              f"{eff.sweep_stride}th sweep item"] if eff.max_elems != prof.max_elems else []) + (
        [f"{eff.max_examples} search examples per contract"] if eff.max_examples != prof.max_examples else [])
    if hints:
        rep.profile = f"{prof.name} ({', '.join(hints)}, backend hint)"
    try:
        reason = backend.available()
    except Exception as exc:
        reason = f"available() raised {exc!r}"
    if reason is not None:
        rep.available, rep.reason = False, reason
        return rep
    t0 = time.perf_counter()
    selected = CONTRACTS if contracts is None else tuple(get_contract(c) for c in contracts)
    with progress(total=len(selected), desc=f"certifying {backend.name} ({prof.name} profile)",
                  unit="contract") as bar:
        for c in selected:
            bar.set_postfix_str(c.name)
            r = check_contract(backend, c, prof, seed, max_examples, sweep, scope)
            bar.update(1)
            rep.results.append(r)
            if c.name == "scaled_mm.batch_invariant":
                rep.batch_invariant = r.status if r.status in (YES, NO) else None
            if fail_fast and r.failed:
                break
    if any(r.contract == "scaled_mm.accumulator_bits" and r.status != NOT_CLAIMED for r in rep.results):
        try:
            rep.accumulator_bits = accumulator_bits(backend)
        except Exception:  # the probe contract already reported the error
            rep.accumulator_bits = None
    if known_failures is not None:
        apply_known_failures(rep, known_failures)
    rep.seconds = time.perf_counter() - t0
    return rep
