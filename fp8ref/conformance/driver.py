"""The conformance driver: run the contract table against a backend and report, without pytest.

``check(backend)`` runs every contract of ``CONTRACTS`` as a Hypothesis search (no example
database, so nothing is shared between processes), captures the shrunk minimal counterexample
of each failure, and returns a ``Report`` (JSON and markdown, mergeable across runs and hosts).
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import example, given, reject
from hypothesis import seed as hseed
from hypothesis.errors import HypothesisException, Unsatisfiable

from .._progress import progress
from ..registry import Backend, get_backend
from .contracts import CONTRACTS, Contract, Declined, get_contract
from .probe import PROBE_MAX_BITS, accumulator_bits
from .profiles import Profile, get_profile, hypothesis_settings, resolve_seed

__all__ = ["ContractResult", "Report", "check", "check_contract", "merge_reports", "load_report",
           "apply_known_failures"]

#: Statuses of one contract. ``xfail``: a known upstream failure (ledger); ``xpass``: a ledger
#: entry that no longer fails, which fails the report so the entry gets removed.
PASS, FAIL, ERROR, NA, XFAIL, XPASS, YES, NO = "pass", "fail", "error", "n/a", "xfail", "xpass", "yes", "no"
_FAILING = {FAIL, ERROR, XPASS}


@dataclass
class ContractResult:
    """The outcome of one contract on one backend."""

    contract: str
    kind: str
    status: str
    examples: int = 0
    declined: int = 0
    worst_ratio: float | None = None
    counterexample: str | None = None
    message: str | None = None
    reproduce: str | None = None
    seconds: float = 0.0
    note: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in _FAILING


@dataclass
class Report:
    """A backend's conformance report.

    Attributes
    ----------
    backend : str
    available : bool
    reason : str or None
        Why the backend cannot run here (then ``results`` is empty and ``passed`` is True:
        nothing failed, and the table says so).
    precision, accumulation : str
        The backend's declaration.
    accumulator_bits : int or None
        The probe's reading (``fp8ref.conformance.accumulator_bits``).
    batch_invariant : str or None
        "yes"/"no" from the ``scaled_mm.batch_invariant`` contract.
    results : list of ContractResult
    """

    backend: str
    profile: str
    seed: int
    available: bool = True
    reason: str | None = None
    precision: str = ""
    accumulation: str = ""
    output_roundings: int = 1
    accumulator_bits: int | None = None
    batch_invariant: str | None = None
    results: list[ContractResult] = field(default_factory=list)
    seconds: float = 0.0
    host: str = field(default_factory=lambda: f"{platform.node()} ({platform.machine()}, torch {torch.__version__})")

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.results)

    @property
    def failures(self) -> list[ContractResult]:
        return [r for r in self.results if r.failed]

    @property
    def worst_ratio(self) -> float | None:
        ratios = [r.worst_ratio for r in self.results if r.worst_ratio is not None and not r.failed]
        return max(ratios) if ratios else None

    def result(self, contract: str) -> ContractResult:
        for r in self.results:
            if r.contract == contract:
                return r
        raise KeyError(contract)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        d = dict(d)
        d.pop("passed", None)
        d["results"] = [ContractResult(**r) for r in d.get("results", [])]
        return cls(**d)

    def to_markdown(self) -> str:
        """The report as a markdown section: a header line and one table row per contract."""
        head = f"### `{self.backend}` ({self.profile} profile, seed {self.seed})\n\n"
        if not self.available:
            return head + f"unavailable: {self.reason}\n"
        bits = _fmt_bits(self.accumulator_bits)
        head += (f"{'PASSED' if self.passed else 'FAILED'} in {self.seconds:.1f} s on {self.host}; declares "
                 f"{self.accumulation} accumulation, {self.output_roundings} output rounding(s) "
                 f"[{self.precision}]; accumulator reads {bits} bits; batch-invariant: "
                 f"{self.batch_invariant or 'n/a'}; worst error/bound {_fmt_ratio(self.worst_ratio)}\n\n")
        rows = ["| contract | kind | status | examples | worst err/bound | time (s) | detail |",
                "|---|---|---|---|---|---|---|"]
        for r in self.results:
            detail = r.note or ""
            if r.counterexample:
                detail = f"`{r.counterexample}`: {r.message}"
                if r.reproduce:
                    detail += f" -- reproduce: `{r.reproduce}`"
            elif r.message:
                detail = r.message
            rows.append(f"| {r.contract} | {r.kind} | {r.status} | {r.examples} | {_fmt_ratio(r.worst_ratio)} | "
                        f"{r.seconds:.2f} | {_md(detail)} |")
        return head + "\n".join(rows) + "\n"

    def to_text(self) -> str:
        """A terminal table."""
        lines = [f"{self.backend}  [{self.profile} profile, seed {self.seed}]"]
        if not self.available:
            return lines[0] + f"\n  unavailable: {self.reason}\n"
        lines.append(f"  declares {self.accumulation} accumulation, {self.output_roundings} output rounding(s) "
                     f"[{self.precision}]; accumulator reads {_fmt_bits(self.accumulator_bits)} bits; "
                     f"batch-invariant: {self.batch_invariant or 'n/a'}")
        lines.append(f"  {'contract':30} {'kind':8} {'status':7} {'examples':>8} {'err/bound':>10} {'time':>7}")
        for r in self.results:
            lines.append(f"  {r.contract:30} {r.kind:8} {r.status:7} {r.examples:8d} {_fmt_ratio(r.worst_ratio):>10} "
                         f"{r.seconds:6.2f}s")
            if r.failed or r.status in (NO, XFAIL, NA):
                for extra in (r.counterexample and f"counterexample: {r.counterexample}", r.message, r.note,
                              r.reproduce and f"reproduce: {r.reproduce}"):
                    if extra:
                        lines.append(f"      {extra}")
        lines.append(f"  {'PASSED' if self.passed else 'FAILED'} in {self.seconds:.1f} s")
        return "\n".join(lines) + "\n"


def _fmt_bits(b: int | None) -> str:
    if b is None:
        return "n/a"
    return f">={b}" if b >= PROBE_MAX_BITS else str(b)


def _fmt_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.3g}"


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _blob(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", []) or []:
        if "@reproduce_failure" in note:
            return note.strip().splitlines()[-1].strip()
    return None


def _profile_for(backend: Backend, prof: Profile) -> Profile:
    """The profile, with the element budget lowered to the backend's optional
    ``conformance_max_elems`` hint (interpreted kernels pay per element) and the example count to
    its optional ``conformance_max_examples`` hint. Both are counts, never times, so a
    derandomized profile checks the same examples on every machine."""
    hint = getattr(backend, "conformance_max_elems", None)
    if isinstance(hint, int) and 0 < hint < prof.max_elems:
        prof = prof.with_(max_elems=hint)
    hint = getattr(backend, "conformance_max_examples", None)
    if isinstance(hint, int) and 0 < hint < prof.max_examples:
        prof = prof.with_(max_examples=hint)
    return prof


def check_contract(backend: Backend, contract: Contract | str, profile: Profile | str | None = "ci",
                   seed: int = 0, max_examples: int | None = None, pinned: bool = True) -> ContractResult:
    """Run one contract against ``backend`` and return its result (never raises for a violation).

    ``pinned=False`` skips the contract's pinned examples (to measure what the search alone finds).

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance import check_contract
    >>> check_contract(get_backend("reference"), "quantize.sign_symmetry", "dev", seed=1).status
    'pass'
    """
    contract = get_contract(contract) if isinstance(contract, str) else contract
    prof = _profile_for(backend, get_profile(profile))
    t0 = time.perf_counter()
    res = ContractResult(contract.name, contract.kind, PASS)
    res.reproduce = (f"fp8ref conformance --backend {backend.name} --profile {prof.name} --seed {seed} "
                     f"--only {contract.name}")
    if contract.strategy is None:  # a probe: deterministic, no search
        try:
            contract.check(backend)
            res.examples = 1
        except Declined as exc:
            res.status, res.note = NA, str(exc)
        except AssertionError as exc:
            res.status, res.message, res.counterexample = FAIL, str(exc), "accumulator probe (fixed input)"
        except Exception as exc:
            res.status, res.message, res.counterexample = ERROR, f"{type(exc).__name__}: {exc}", "probe"
        res.seconds = time.perf_counter() - t0
        if res.status == PASS:
            res.reproduce = None
        return res

    declined: Counter = Counter()
    state: dict[str, Any] = {"n": 0, "worst": None, "fail": None, "budget": False}

    @hypothesis_settings(prof, max_examples)
    @hseed(seed)
    @given(contract.strategy(prof))
    def run(problem):
        if (state["fail"] is None and state["n"] >= 1 and time.perf_counter() - t0 > prof.time_budget_s):
            state["budget"] = True
            reject()  # budget spent: draw no more work (a failure being shrunk is not cut short)
        try:
            ratio = contract.check(backend, problem)
        except Declined as exc:
            declined[str(exc)] += 1
            reject()
        except HypothesisException:
            raise
        except Exception as exc:
            state["fail"] = (problem, exc)  # the last failure recorded is the shrunk one, replayed last
            raise
        state["n"] += 1
        if ratio is not None and (state["worst"] is None or ratio > state["worst"]):
            state["worst"] = ratio

    for ex in contract.examples if pinned else ():
        run = example(ex)(run)
    try:
        run()
    except Unsatisfiable:
        if state["n"] == 0:
            res.status = NA
            res.note = "no example applies: " + "; ".join(f"{r} (x{n})" for r, n in declined.most_common(3))
    except BaseException as exc:  # noqa: B036 -- Hypothesis raises ExceptionGroups / Flaky here too
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        problem, err = state["fail"] if state["fail"] else (None, exc)
        res.status = FAIL if isinstance(err, AssertionError) else ERROR
        res.counterexample = repr(problem) if problem is not None else None
        res.message = str(err) if isinstance(err, AssertionError) else f"{type(err).__name__}: {err}"
        if "Flaky" in type(exc).__name__:
            res.message = "(fails only sometimes: non-deterministic) " + res.message
        blob = _blob(exc)
        if blob:
            res.reproduce = f"{res.reproduce}  # or in a test: {blob}"
    res.examples = state["n"]
    if state["budget"] and res.status == PASS:
        res.note = f"time budget of {prof.time_budget_s:g} s reached after {state['n']} examples"
    res.declined = sum(declined.values())
    res.worst_ratio = state["worst"]
    if contract.kind == "info" and res.status in (PASS, FAIL):
        res.status = YES if res.status == PASS else NO
    if res.status in (PASS, YES) or res.status == NA:
        res.reproduce = None
    res.seconds = time.perf_counter() - t0
    return res


def apply_known_failures(report: Report, known: Iterable[dict]) -> Report:
    """Turn failures listed in a known-failures ledger into ``xfail`` (with the upstream link) and
    listed contracts that pass into ``xpass`` (a failure, so the stale entry gets removed)."""
    for entry in known:
        if entry.get("backend") != report.backend:
            continue
        for r in report.results:
            if entry.get("property") in (r.contract, "*"):
                link = entry.get("upstream", "")
                if r.status in (FAIL, ERROR):
                    r.status = XFAIL
                    r.note = f"known failure: {link} -- {entry.get('reason', '')}"
                elif r.status == PASS:
                    r.status = XPASS
                    r.note = f"listed as a known failure ({link}) but passes: remove the ledger entry"
    return report


def check(backend: Backend | str, profile: Profile | str | None = "ci", seed: int | None = None, *,
          contracts: Sequence[str] | None = None, known_failures: Iterable[dict] | None = None,
          fail_fast: bool = False, max_examples: int | None = None, pinned: bool = True) -> Report:
    """Certify ``backend`` against every contract of ``CONTRACTS`` (or the named ones).

    Parameters
    ----------
    backend : Backend or str
        An instance (registered or not) or a registered name.
    profile : Profile or str or None
        ``dev``, ``ci`` (default) or ``thorough``; None reads ``$FP8REF_HYPOTHESIS_PROFILE``.
    seed : int, optional
        Hypothesis seed. If omitted: the profile's fixed seed for a derandomized profile (``ci``:
        the same commit gives the same verdict), else a random one (reported with the results).
    contracts : sequence of str, optional
        Only these contracts.
    known_failures : iterable of dict, optional
        Ledger entries ``{"backend", "property", "upstream", "reason"}`` (see
        ``properties/known_failures.py``), applied as strict expected failures.
    fail_fast : bool
        Stop at the first failing contract (the mutant self-test uses it).
    max_examples : int, optional
        Override the profile's examples per contract.
    pinned : bool
        Run each contract's pinned examples before the search (default); False measures the
        search alone.

    Returns
    -------
    Report
        ``report.passed``, per-contract results with counterexamples, JSON/markdown output.

    Examples
    --------
    >>> from fp8ref.conformance import check
    >>> report = check("reference", profile="dev", seed=0, contracts=["quantize.codes"])
    >>> report.passed, report.results[0].status
    (True, 'pass')
    """
    if isinstance(backend, str):
        backend = get_backend(backend)
    if not isinstance(backend, Backend):
        raise TypeError(f"expected an fp8ref.Backend or a registered name, got {type(backend).__name__}")
    prof = get_profile(profile)
    seed = resolve_seed(prof, seed)
    rep = Report(backend.name, prof.name, seed, precision=backend.precision.value,
                 accumulation=backend.accumulation.name, output_roundings=backend.output_roundings)
    eff = _profile_for(backend, prof)
    hints = ([f"max {eff.max_elems} elements per operand"] if eff.max_elems != prof.max_elems else []) + (
        [f"{eff.max_examples} drawn examples per contract"] if eff.max_examples != prof.max_examples else [])
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
            r = check_contract(backend, c, prof, seed, max_examples, pinned)
            bar.update(1)
            rep.results.append(r)
            if c.name == "scaled_mm.batch_invariant":
                rep.batch_invariant = r.status if r.status in (YES, NO) else None
            if fail_fast and r.failed:
                break
    if any(r.contract == "scaled_mm.accumulator_bits" for r in rep.results):
        try:
            rep.accumulator_bits = accumulator_bits(backend)
        except Exception:  # the probe contract already reported the error
            rep.accumulator_bits = None
    if known_failures is not None:
        apply_known_failures(rep, known_failures)
    rep.seconds = time.perf_counter() - t0
    return rep


def load_report(path: str) -> list[Report]:
    """Reports from a JSON file written by ``fp8ref conformance --json`` (one report or a list)."""
    with open(path) as f:
        data = json.load(f)
    data = data if isinstance(data, list) else [data]
    return [Report.from_dict(d) for d in data]


def merge_reports(reports: Sequence[Report]) -> str:
    """One markdown table over several reports (e.g. from several hosts or xdist workers):
    a row per backend with its verdict, declaration, probe reading and failing contracts."""
    rows = ["| backend | host | profile | verdict | precision | accumulator bits | batch-invariant | "
            "worst err/bound | failing contracts | time (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        if not r.available:
            rows.append(f"| {r.backend} | {_md(r.host)} | {r.profile} | unavailable: {_md(str(r.reason))} "
                        f"| {r.precision} | | | | | |")
            continue
        failing = ", ".join(f"{x.contract} ({x.status})" for x in r.results if x.failed or x.status == XFAIL)
        rows.append(f"| {r.backend} | {_md(r.host)} | {r.profile} | {'pass' if r.passed else 'FAIL'} | {r.precision} "
                    f"| {_fmt_bits(r.accumulator_bits)} | {r.batch_invariant or 'n/a'} | {_fmt_ratio(r.worst_ratio)} "
                    f"| {failing or '-'} | {r.seconds:.1f} |")
    return "\n".join(rows) + "\n"
