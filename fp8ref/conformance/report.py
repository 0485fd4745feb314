"""Conformance reports: a contract's outcome (``ContractResult``), a backend's ``Report`` with its
verdict (``pass`` only when every claimed contract ran examples and none failed), its text,
markdown and JSON forms, the known-failures ledger applied to it, and the merge of many reports
into one table. Imports flow down: ``coverage`` and ``probe`` only; the driver builds reports.
"""

from __future__ import annotations

import enum
import json
import platform
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .coverage import COVERAGE_COLUMNS, Coverage
from .probe import PROBE_MAX_BITS

__all__ = ["Status", "ContractResult", "Report", "merge_reports", "load_report", "apply_known_failures", "PASS", "FAIL",
           "ERROR", "NA", "XFAIL", "XPASS", "YES", "NO", "UNTESTED", "NOT_CLAIMED", "V_PASS", "V_FAIL",
           "V_UNTESTED", "V_UNAVAILABLE"]

#: Statuses of one contract. ``xfail``: a known upstream failure (ledger); ``xpass``: a ledger
#: entry that no longer fails, which fails the report so the entry gets removed. ``untested``: a
#: contract of a claimed op on which no example ran (every one declined): the report is not a
#: pass. ``not claimed``: a contract of an op the backend does not declare (or the check did not
#: claim). ``n/a``: an info contract with no example.
class Status(enum.StrEnum):
    """The status of one contract (a ``str``: JSON and older reports read it as its value)."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    NA = "n/a"
    XFAIL = "xfail"
    XPASS = "xpass"
    YES = "yes"
    NO = "no"
    UNTESTED = "untested"
    NOT_CLAIMED = "not claimed"


PASS, FAIL, ERROR, NA, XFAIL, XPASS, YES, NO = (Status.PASS, Status.FAIL, Status.ERROR, Status.NA, Status.XFAIL,
                                                Status.XPASS, Status.YES, Status.NO)
UNTESTED, NOT_CLAIMED = Status.UNTESTED, Status.NOT_CLAIMED
_FAILING = {FAIL, ERROR, XPASS}
#: Report verdicts.
V_PASS, V_FAIL, V_UNTESTED, V_UNAVAILABLE = "pass", "fail", "untested", "unavailable"


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
    op: str = ""
    sweep: int = 0  #: examples of ``examples`` that came from the pinned examples and the corner sweep
    examples_to_failure: int | None = None  #: examples run until the first failure, the failing one included
    coverage: dict | None = None  #: ``Coverage.to_dict()``: what the examples that ran covered, what was declined
    problem: dict | None = None  #: the counterexample, machine-readable (``fp8ref.conformance.replay`` takes it)

    def detail(self, counterexample_label: str = "", blob: bool = True) -> str:
        """One line for a report table: the counterexample with the message and how to reproduce
        it, else the message, else the note. ``blob=False`` drops the Hypothesis blob."""
        if self.counterexample:
            text = f"{counterexample_label}`{self.counterexample}`: {self.message}"
            if self.reproduce:
                text += f" -- reproduce: `{self.reproduce if blob else self.reproduce.partition('  # or')[0]}`"
            return text
        return self.message or self.note or ""

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
        Why the backend cannot run here (then ``results`` is empty and the verdict is
        "unavailable": nothing is certified).
    precision, accumulation : str
        The backend's declaration.
    claimed : str
        What the certificate covers: the ops (and, for a narrowed check, the schemes).
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
    claimed: str = ""

    @property
    def verdict(self) -> str:
        """``pass`` (every claimed contract ran examples and none failed), ``fail``, ``untested``
        (no failure, but a claimed contract ran no example, or nothing was claimed at all) or
        ``unavailable``."""
        if not self.available:
            return V_UNAVAILABLE
        if any(r.failed for r in self.results):
            return V_FAIL
        if any(r.status == UNTESTED for r in self.results) or not any(r.status == PASS for r in self.results):
            return V_UNTESTED
        return V_PASS

    @property
    def passed(self) -> bool:
        """True only for the verdict ``pass``: never for a backend that was not tested."""
        return self.verdict == V_PASS

    @property
    def failures(self) -> list[ContractResult]:
        return [r for r in self.results if r.failed]

    @property
    def untested(self) -> list[ContractResult]:
        return [r for r in self.results if r.status == UNTESTED]

    @property
    def worst_ratio(self) -> float | None:
        """The largest error/bound over every contract, the failing examples' included."""
        ratios = [r.worst_ratio for r in self.results if r.worst_ratio is not None]
        return max(ratios) if ratios else None

    @property
    def examples_to_detection(self) -> int | None:
        """Examples run, over the contracts in order, until the first failure (None: no failure)."""
        total = 0
        for r in self.results:
            if r.failed and r.examples_to_failure is not None:
                return total + r.examples_to_failure
            total += r.examples
        return None

    def result(self, contract: str) -> ContractResult:
        for r in self.results:
            if r.contract == contract:
                return r
        raise KeyError(contract)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["verdict"] = self.verdict
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        d = dict(d)
        d.pop("passed", None)
        d.pop("verdict", None)
        d["results"] = [ContractResult(**r) for r in d.get("results", [])]
        return cls(**d)

    def _headline(self) -> str:
        word = {V_PASS: "PASSED", V_FAIL: "FAILED", V_UNTESTED: "UNTESTED (not certified)"}[self.verdict]
        why = ""
        if self.verdict == V_UNTESTED:
            names = [r.contract for r in self.untested]
            why = (": no example ran for " + ", ".join(names)) if names else ": no claimed contract ran"
        return word + why

    def to_markdown(self) -> str:
        """The report as a markdown section: a header line, one table row per contract, and the
        coverage table."""
        head = f"### `{self.backend}` ({self.profile} profile, seed {self.seed})\n\n"
        if not self.available:
            return head + f"unavailable: {self.reason} (not certified)\n"
        bits = _fmt_bits(self.accumulator_bits)
        head += (f"{self._headline()} in {self.seconds:.1f} s on {self.host}; certified for {self.claimed}; declares "
                 f"{self.accumulation} accumulation, {self.output_roundings} output rounding(s) "
                 f"[{self.precision}]; accumulator reads {bits} bits; batch-invariant: "
                 f"{self.batch_invariant or 'n/a'}; worst error/bound {_fmt_ratio(self.worst_ratio)}\n\n")
        rows = ["| contract | kind | status | examples (sweep) | declined | worst err/bound | time (s) | detail |",
                "|---|---|---|---|---|---|---|---|"]
        for r in self.results:
            detail = r.detail()
            rows.append(f"| {r.contract} | {r.kind} | {r.status} | {r.examples} ({r.sweep}) | {r.declined} | "
                        f"{_fmt_ratio(r.worst_ratio)} | {r.seconds:.2f} | {_md(detail)} |")
        cov = ["", "Coverage of the examples that ran:", "",
               "| contract | " + " | ".join(h for _, h in COVERAGE_COLUMNS) + " | declined |",
               "|---|" + "---|" * (len(COVERAGE_COLUMNS) + 1)]
        for r in self.results:
            if r.status == NOT_CLAIMED:
                continue
            cells = " | ".join(_md(Coverage.cell(r.coverage, k)) for k, _ in COVERAGE_COLUMNS)
            cov.append(f"| {r.contract} | {cells} | {_md(Coverage.declined_text(r.coverage))} |")
        return head + "\n".join(rows + cov) + "\n"

    def to_text(self) -> str:
        """A terminal table, then the coverage table."""
        lines = [f"{self.backend}  [{self.profile} profile, seed {self.seed}]"]
        if not self.available:
            return lines[0] + f"\n  unavailable: {self.reason} (not certified)\n"
        lines.append(f"  certified for {self.claimed}")
        lines.append(f"  declares {self.accumulation} accumulation, {self.output_roundings} output rounding(s) "
                     f"[{self.precision}]; accumulator reads {_fmt_bits(self.accumulator_bits)} bits; "
                     f"batch-invariant: {self.batch_invariant or 'n/a'}")
        lines.append(f"  {'contract':30} {'kind':8} {'status':11} {'examples':>8} {'sweep':>6} {'declined':>8} "
                     f"{'err/bound':>10} {'time':>7}")
        for r in self.results:
            lines.append(f"  {r.contract:30} {r.kind:8} {r.status:11} {r.examples:8d} {r.sweep:6d} {r.declined:8d} "
                         f"{_fmt_ratio(r.worst_ratio):>10} {r.seconds:6.2f}s")
            if r.failed or r.status in (NO, XFAIL, NA, UNTESTED):
                for extra in (r.counterexample and f"counterexample: {r.counterexample}", r.message, r.note,
                              r.reproduce and f"reproduce: {r.reproduce}",
                              r.problem and f"replay: fp8ref conformance --replay '{json.dumps(r.problem)}' "
                                            f"--write-script repro.py"):
                    if extra:
                        lines.append(f"      {extra}")
        lines.append("  coverage of the examples that ran:")
        widths = {"M": 8, "N": 8, "K": 8, "formats": 21, "granularity": 30, "scales": 25, "x": 14, "out": 14,
                  "bias": 18}
        lines.append(f"    {'contract':30} " + " ".join(f"{h:{widths[k]}}" for k, h in COVERAGE_COLUMNS)
                     + " declined")
        for r in self.results:
            if r.status == NOT_CLAIMED:
                continue
            cells = " ".join(f"{Coverage.cell(r.coverage, k):{widths[k]}}" for k, _ in COVERAGE_COLUMNS)
            lines.append(f"    {r.contract:30} {cells} {Coverage.declined_text(r.coverage, top=1)}")
        lines.append(f"  {self._headline()} in {self.seconds:.1f} s")
        return "\n".join(lines) + "\n"


def _fmt_bits(b: int | None) -> str:
    if b is None:
        return "n/a"
    return f">={b}" if b >= PROBE_MAX_BITS else str(b)


def _fmt_ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.3g}"


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def apply_known_failures(report: Report, known: Iterable[dict]) -> Report:
    """Turn failures listed in a known-failures ledger into ``xfail`` (with the upstream link) and
    listed contracts that pass into ``xpass`` (a failure, so the stale entry gets removed)."""
    for entry in known:
        if entry.get("backend") != report.backend:
            continue
        for r in report.results:
            if entry.get("property") in (r.contract, "*"):
                # the upstream link where there is one, else the ledger's id (an empty link read "known failure:  --")
                where = entry.get("upstream") or entry.get("id", "no upstream link")
                if r.status in (FAIL, ERROR, XFAIL):  # XFAIL: a saved report re-rendered with today's notes
                    r.status = XFAIL
                    r.note = f"known failure: {where} -- {entry.get('reason', '')}"
                elif r.status == PASS:
                    r.status = XPASS
                    r.note = f"listed as a known failure ({where}) but passes: remove the ledger entry"
    return report


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
            rows.append(f"| {r.backend} | {_md(r.host)} | {r.profile} | unavailable (not certified): "
                        f"{_md(str(r.reason))} "
                        f"| {r.precision} | | | | | |")
            continue
        failing = ", ".join(f"{x.contract} ({x.status})" for x in r.results
                            if x.failed or x.status in (XFAIL, UNTESTED))
        rows.append(f"| {r.backend} | {_md(r.host)} | {r.profile} | {r.verdict if r.passed else r.verdict.upper()} "
                    f"| {r.precision} "
                    f"| {_fmt_bits(r.accumulator_bits)} | {r.batch_invariant or 'n/a'} | {_fmt_ratio(r.worst_ratio)} "
                    f"| {failing or '-'} | {r.seconds:.1f} |")
    return "\n".join(rows) + "\n"
