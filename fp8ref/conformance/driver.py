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

import enum
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hypothesis import Verbosity, given, reject, settings
from hypothesis import seed as hseed
from hypothesis.errors import HypothesisException, Unsatisfiable

from .._progress import progress
from ..check.problems import QuantizeProblem, problem_to_dict
from ..registry import Backend, get_backend
from ..spec.schemes import QuantScheme, Recipe
from .adaptation import Adaptation, adapted
from .contracts import CONTRACTS, Contract, ContractViolation, Declined, get_contract, reference_threads
from .coverage import Coverage
from .probe import accumulator_bits
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
    Status,
    apply_known_failures,
    load_report,
    merge_reports,
)
from .reproduce import load_backend, reproduce_line
from .scope import Scope, make_scope
from .sweep import corner_sweep, exhaustive

__all__ = ["Adaptation", "ExitReason", "Status", "classify", "ContractResult", "Report", "check", "check_contract",
           "load_backend",
           "merge_reports", "load_report",
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
    item, and the search runs ``slow_examples`` examples per contract. A backend's
    ``conformance_max_examples`` hint lowers the search's example count further. All of these are
    counts, never times: a derandomized profile checks the same examples on every machine. A
    backend that compiles per shape declares a longer ``time_budget_s``, which widens a profile's
    finite budget (so its pinned examples run). The report says so."""
    hint = backend.conformance_max_elems
    if isinstance(hint, int) and 0 < hint < prof.max_elems:
        prof = prof.with_(max_elems=hint, max_rows=min(prof.max_rows, max(1, hint // 128)), sweep_stride=4,
                          max_examples=min(prof.max_examples, prof.slow_examples))
    hint = backend.conformance_max_examples
    if isinstance(hint, int) and 0 < hint < prof.max_examples:
        prof = prof.with_(max_examples=hint)
    budget = backend.time_budget_s
    # ci has no time budget (counts bound its work: the verdict must not depend on the machine's
    # speed); the hint only widens the budget of the exploring profiles
    if budget is not None and prof.time_budget_s is not None and budget > prof.time_budget_s:
        prof = prof.with_(time_budget_s=float(budget))
    return prof


def _claimed(backend: Backend, scope: Scope) -> str:
    text = scope.describe()
    if tuple(scope.ops) == tuple(backend.ops) and not scope.narrowed:
        text += " (everything the backend declares)"
    return text


def check_contract(backend: Backend, contract: Contract | str, profile: Profile | str | None = "ci",
                   seed: int = 0, max_examples: int | None = None, sweep: bool = True,
                   scope: Scope | None = None, *, adapt: Adaptation | None = None) -> ContractResult:
    """Run one contract against ``backend`` and return its result (never raises for a violation).

    First the contract's pinned examples and the op's corner sweep (``sweep=False`` skips both, to
    measure what the search alone finds), then the Hypothesis search. A contract of an op outside
    ``scope.ops`` (default: the backend's declared ops) is "not claimed"; one of a claimed op on
    which no example ran is "untested". ``adapt`` maps every problem and names the reproduction
    (``Adaptation``).

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance import check_contract
    >>> print(check_contract(get_backend("reference"), "quantize.sign_symmetry", "dev", seed=1).status)
    pass
    """
    contract = get_contract(contract) if isinstance(contract, str) else contract
    run = _Run(backend, adapted(contract, adapt), _profile_for(backend, get_profile(profile)), seed,
               scope if scope is not None else make_scope(backend), adapt)
    with reference_threads():
        return run.execute(max_examples, sweep)


class ExitReason(enum.Enum):
    """Why a contract's run ended."""

    NOT_CLAIMED = "the contract's op is not claimed"
    FINISHED = "every example ran"
    FAILED = "an example failed or raised"
    BUDGET = "the search's time budget was spent"
    UNSATISFIABLE = "the search drew no example the backend takes"


def classify(exc: BaseException) -> tuple[Status, str]:
    """The status and message of an example that raised: a violation (``AssertionError``, which
    ``ContractViolation`` is) is a failure, anything else an error of the backend."""
    if isinstance(exc, AssertionError):
        return FAIL, str(exc)
    return ERROR, f"{type(exc).__name__}: {exc}"


class _Run:
    """One contract run against one backend: the state the sweep and the search share.

    Attributes
    ----------
    n : int
        Examples run (declined ones not counted).
    worst : float or None
        The largest error/bound ratio a check returned.
    failure : tuple or None
        ``(problem, exception)`` of the last failure recorded (in the search: the shrunk one).
    first_fail_n : int or None
        Examples run up to the first failure, the failing one included.
    exit : ExitReason
    """

    def __init__(self, backend: Backend, contract: Contract, prof: Profile, seed: int, scope: Scope,
                 adapt: Adaptation | None) -> None:
        self.backend, self.contract, self.prof, self.seed, self.scope = backend, contract, prof, seed, scope
        self.adapt = adapt
        self.cov = Coverage()
        self.n = 0
        self.worst: float | None = None
        self.failure: tuple[Any, BaseException] | None = None
        self.first_fail_n: int | None = None
        self.exit = ExitReason.FINISHED
        self.res = ContractResult(contract.name, contract.kind, PASS, op=contract.op)

    def run_one(self, problem) -> None:
        ratio = self.contract.check(self.backend, problem)
        self.n += 1
        self.cov.add(problem.facets())
        if ratio is not None and (self.worst is None or ratio > self.worst):
            self.worst = ratio

    def fail(self, problem, exc: BaseException, counterexample: str | None = None) -> None:
        """Record a failure (or an error) of ``problem``; the one place that classifies it."""
        self.exit = ExitReason.FAILED
        self.failure = (problem, exc)
        if self.first_fail_n is None:
            self.first_fail_n = self.n + 1
        self.res.status, self.res.message = classify(exc)
        self.res.counterexample = counterexample if counterexample is not None else (
            repr(problem) if problem is not None else None)
        self.res.problem = problem_to_dict(problem) if problem is not None else None

    def count_failure(self, problem, exc: BaseException) -> None:
        """Count the failing example among the examples run (and in the coverage) and fold its
        error/bound into the contract's worst: a violation's own ratio, inf for a violation without
        one (a NaN code, differing bits); a crash of the backend has no ratio."""
        self.n += 1
        if problem is not None:
            self.cov.add(problem.facets())
        if isinstance(exc, ContractViolation):
            ratio = math.inf if exc.ratio is None else exc.ratio
        elif isinstance(exc, AssertionError):
            ratio = math.inf
        else:
            return
        self.worst = ratio if self.worst is None else max(self.worst, ratio)

    def execute(self, max_examples: int | None, sweep: bool) -> ContractResult:
        t0 = time.perf_counter()
        contract, res, backend = self.contract, self.res, self.backend
        missing = [op for op in (contract.op, *contract.requires) if op not in self.scope.ops]
        if missing:
            self.exit, res.status = ExitReason.NOT_CLAIMED, NOT_CLAIMED
            why = "not declared by the backend" if missing[0] not in backend.ops else "not among the ops checked"
            res.note = f"op {missing[0]} {why} (backend ops: {', '.join(backend.ops)})"
            return res
        res.reproduce = (reproduce_line(backend, self.prof.name, self.seed, contract.name, self.scope)
                         if self.adapt is None or self.adapt.reproduce is None
                         else self.adapt.reproduce(self.prof.name, self.seed, contract.name))
        if contract.strategy is None:
            self._probe()
        else:
            if sweep:
                self._sweep()
            if self.exit is ExitReason.FINISHED and max_examples != 0:
                self._search(max_examples)
        self._finish()
        res.seconds = time.perf_counter() - t0
        return res

    def _probe(self) -> None:
        """A probe contract: one deterministic measurement, no search."""
        try:
            self.contract.check(self.backend)
            self.n = self.res.sweep = 1
        except Declined as exc:
            self.res.status, self.res.note = UNTESTED, str(exc)
            self.cov.decline(str(exc))
        except Exception as exc:  # noqa: BLE001 -- a violation or a crash of the backend, reported
            self.fail(None, exc, "accumulator probe (fixed input)" if isinstance(exc, AssertionError) else "probe")

    def _sweep(self) -> None:
        scope = self.scope
        problems = [e for e in self.contract.examples if _in_scope(e, scope)] + _op_sweep(
            self.backend, self.contract, self.prof, self.seed, scope, self.adapt)
        for problem in problems:
            try:
                self.run_one(problem)
            except Declined as exc:
                self.cov.decline(str(exc))
            except Exception as exc:  # noqa: BLE001 -- a violation or a crash of the backend, reported
                self.fail(problem, exc)
                self.count_failure(problem, exc)
                break
        self.res.sweep = self.n

    def _search(self, max_examples: int | None) -> None:
        """The Hypothesis phase: draws from the contract's strategy until the profile's count (or
        time budget) is spent or an example fails; a failure is shrunk and replayed last."""
        prof, n_sweep = self.prof, self.n
        t_search = time.perf_counter()
        n = prof.max_examples if max_examples is None else max_examples
        if self.contract.search_examples is not None:  # a contract's own cap (the calling contract's)
            n = min(n, self.contract.search_examples)

        @settings(hypothesis_settings(prof, n), verbosity=Verbosity.quiet)
        @hseed(self.seed)
        @given(self.contract.strategy(prof, self.scope))
        def search(problem):
            if (prof.time_budget_s is not None and self.failure is None and self.n > n_sweep
                    and time.perf_counter() - t_search > prof.time_budget_s):
                raise _BudgetSpent  # ends the search at once (a failure being shrunk is not cut short)
            try:
                self.run_one(problem)
            except Declined as exc:
                self.cov.decline(str(exc))
                reject()
            except HypothesisException:
                raise
            except Exception as exc:
                self.fail(problem, exc)  # the last failure recorded is the shrunk one, replayed last
                raise

        try:
            search()
        except _BudgetSpent:
            self.exit = ExitReason.BUDGET
        except Unsatisfiable:
            self.exit = ExitReason.UNSATISFIABLE
        except BaseException as exc:  # noqa: B036 -- Hypothesis raises ExceptionGroups / Flaky here too
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if self.failure is None:  # raised outside an example (the strategy, Hypothesis itself)
                self.fail(None, exc)
            else:
                self.fail(*self.failure)
                self.count_failure(*self.failure)
            if "Flaky" in type(exc).__name__:
                self.res.message = "(fails only sometimes: non-deterministic) " + self.res.message
            blob = _blob(exc)
            if blob:
                self.res.reproduce = f"{self.res.reproduce}  # or in a test: {blob}"

    def _finish(self) -> None:
        res, cov = self.res, self.cov
        res.examples = self.n
        if self.exit is ExitReason.FAILED:
            res.examples_to_failure = self.first_fail_n
        res.declined = sum(cov.declined.values())
        res.coverage = cov.to_dict()
        if self.contract.strategy is None:  # a probe: its status stands as the measurement left it
            if res.status == PASS:
                res.reproduce = None
            return
        res.worst_ratio = self.worst
        if self.exit is ExitReason.BUDGET and res.status == PASS:
            res.note = (f"search stopped by the time budget of {self.prof.time_budget_s:g} s after "
                        f"{self.n - res.sweep} examples (the sweep ran {res.sweep})")
        if res.status == PASS and self.n == 0:
            reasons = "; ".join(f"{r} (x{n})" for r, n in cov.declined.most_common(3)) or "nothing was drawn"
            if self.contract.kind == "info":
                res.status, res.note = NA, "no example applies: " + reasons
            else:
                res.status, res.note = UNTESTED, "no example ran (not certified): " + reasons
        if self.contract.kind == "info" and res.status in (PASS, FAIL):
            res.status = YES if res.status == PASS else NO
        if res.status in (PASS, YES, NA, UNTESTED):
            res.reproduce = None


def _in_scope(problem, scope: Scope) -> bool:
    """Whether a pinned example lies within a narrowed claim (always, for an un-narrowed one)."""
    if not scope.narrowed:
        return True
    if isinstance(problem, QuantizeProblem):
        return problem.scheme in scope.schemes
    return problem.recipe in scope.recipes


#: Sweeps generated per (backend, op, profile, seed, scope), shared by the contracts of an op and
#: by separate ``check_contract`` calls (pytest runs one contract per test).
_SWEEPS: OrderedDict = OrderedDict()


def _op_sweep(backend: Backend, contract: Contract, prof: Profile, seed: int, scope: Scope,
              adapt: Adaptation | None = None) -> list:
    map_problem = adapt.map_problem if adapt is not None else None
    key = (id(backend), type(backend).__qualname__, backend.name, contract.op, prof, seed, scope, map_problem)
    problems = _SWEEPS.get(key)
    if problems is None:
        problems = corner_sweep(contract.op, prof, backend, seed, scope, map_problem)
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


class _BudgetSpent(BaseException):  # noqa: N818 -- a signal, not an error: Hypothesis lets BaseExceptions through
    """Raised in the search when the time budget is spent; Hypothesis stops without shrinking."""


def check(backend: Backend | str, profile: Profile | str | None = "ci", seed: int | None = None, *,
          contracts: Sequence[str] | None = None, known_failures: Iterable[dict] | None = None,
          fail_fast: bool = False, max_examples: int | None = None, sweep: bool = True,
          ops: Sequence[str] | None = None, schemes: Sequence[QuantScheme | Recipe] | None = None,
          adapt: Adaptation | None = None, on_contract: Callable[[str], None] | None = None) -> Report:
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
        ``fp8ref/conformance/known_failures.py``), applied as strict expected failures.
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
    adapt : Adaptation, optional
        How the contracts meet a backend that is not fp8ref's own: its problem mapping (a peer's
        conventions) and its reproduction command (``fp8ref.peers.certify`` passes one).
    on_contract : callable, optional
        Called with each contract's name once it has run (a caller's progress display).

    Returns
    -------
    Report
        ``report.verdict`` ("pass", "fail", "untested", "unavailable"), ``report.passed`` (True only
        for "pass"), per-contract results with counterexamples and coverage, JSON/markdown output.

    Examples
    --------
    >>> from fp8ref.conformance import check
    >>> report = check("reference", profile="dev", seed=0, contracts=["quantize.codes"])
    >>> print(report.passed, report.results[0].status)
    True pass
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
        [f"{eff.max_examples} search examples per contract"] if eff.max_examples != prof.max_examples else []) + (
        [f"time budget {eff.time_budget_s:g} s per contract"] if eff.time_budget_s != prof.time_budget_s else [])
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
            r = check_contract(backend, c, prof, seed, max_examples, sweep, scope, adapt=adapt)
            bar.update(1)
            if on_contract is not None:
                on_contract(c.name)
            rep.results.append(r)
            if c.name == "scaled_mm.batch_invariant":
                rep.batch_invariant = r.status if r.status in (YES, NO) else None
            if fail_fast and r.failed:
                break
    # a linear-only backend (a layer quantizing its own inputs) has no probe contract: its reading is reported
    linear_only = "linear" in scope.ops and "scaled_mm" not in backend.ops
    if linear_only or any(r.contract == "scaled_mm.accumulator_bits" and r.status != NOT_CLAIMED
                          for r in rep.results):
        try:
            rep.accumulator_bits = accumulator_bits(backend, map_problem=adapt.map_problem if adapt else None)
        except Exception:  # the probe contract already reported the error
            rep.accumulator_bits = None
    if known_failures is not None:
        apply_known_failures(rep, known_failures)
    rep.seconds = time.perf_counter() - t0
    return rep
