"""What the selector answers: a ``Decision`` (the chosen backend, the fallback ranking and the
table of ``Row``s behind it), a ``ProbeResult``, and the two errors it raises."""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Row", "Decision", "ProbeResult", "NoCompliantBackendError", "BackendUnavailableError"]


class NoCompliantBackendError(RuntimeError):
    """No backend meets the required precision class and the probe (cannot happen while the
    reference is registered, since it is exact)."""


class BackendUnavailableError(RuntimeError):
    """An explicitly named (or FP8REF_BACKEND-forced) backend cannot run this case."""


@dataclass
class Row:
    """One line of the table behind a decision."""

    backend: str
    precision: str
    available: str | None = None  #: None, or why the backend cannot run here
    supported: str | None = None  #: None, or why it does not take this case
    admitted: bool = False  #: its precision class meets the requirement
    compliant: bool | None = None  #: None when not probed
    worst_ratio: float | None = None  #: max over the probe of error / bound (<= 1 to comply)
    #: worst ratio per check of the probe, by contract name (``quantize.codes``, ``scaled_mm.bound``, ...)
    ratios: dict[str, float] = field(default_factory=dict)
    detail: str = ""  #: where the worst ratio came from, or the probe's failure
    estimate_s: float | None = None  #: full-shape time extrapolated from the probe's calls
    median_s: float | None = None
    runs: int = 0
    note: str = ""
    chosen: bool = False

    @property
    def status(self) -> str:
        if self.available is not None:
            return f"unavailable: {self.available}"
        if self.supported is not None:
            return f"unsupported: {self.supported}"
        if not self.admitted:
            return "outside required class"
        if self.compliant is None:
            return "not probed"
        return "compliant" if self.compliant else "NON-COMPLIANT"


def _op_ratio(ratios: dict[str, float], ops: tuple[str, ...]) -> float:
    """The worst of ``ratios`` over the checks of ``ops`` (a check is named ``op.property``; a
    decision cached before the probe ran the contracts is keyed by the op alone); NaN if none ran."""
    hits = [v for k, v in ratios.items() if k.split(".")[0] in ops]
    return max(hits) if hits else math.nan


#: What each field of a ``Row`` read from the cache file may hold (None allowed where listed).
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "backend": (str,), "precision": (str,), "available": (str, type(None)), "supported": (str, type(None)),
    "admitted": (bool,), "compliant": (bool, type(None)), "worst_ratio": (float, type(None)), "ratios": (dict,),
    "detail": (str,), "estimate_s": (float, type(None)), "median_s": (float, type(None)), "runs": (int,),
    "note": (str,), "chosen": (bool,),
}


def _typed(d: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    """``d[name]`` if it has one of ``types`` (an int stands for a float; a bool is no number)."""
    types = types if isinstance(types, tuple) else (types,)
    v = d[name]
    if float in types and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and bool not in types:
        raise TypeError(f"{name!r} must be {' or '.join(t.__name__ for t in types)}, got a bool")
    if not isinstance(v, types):
        raise TypeError(f"{name!r} must be {' or '.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _row(r: Any) -> Row:
    if not isinstance(r, dict):
        raise TypeError(f"a row must be an object, got {type(r).__name__}")
    values = {name: _typed(r, name, types) for name, types in _ROW_TYPES.items() if name in r}
    if "ratios" in values:
        values["ratios"] = {str(k): _typed(values["ratios"], k, float) for k in values["ratios"]}
    return Row(**values)


@dataclass
class Decision:
    """What the selector chose for a key, with the table behind it."""

    key: str
    case: str
    precision: str
    chosen: str
    ranking: list[str]  #: compliant backends, fastest first (the fallback order)
    rows: list[Row] = field(default_factory=list)
    source: str = "probe"  #: "memory", "disk", "probe" or "forced"
    seconds: float = 0.0  #: time the probe-and-time step took

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    @classmethod
    def from_json(cls, key: str, d: dict[str, Any]) -> Decision:
        """The decision a cache entry holds; ``TypeError``/``ValueError`` naming the field when
        the entry is not exactly the layout ``to_json`` writes (the file is not trusted: a wrongly
        typed row must be refused here, not raise later inside ``table()``)."""
        if not isinstance(d, dict):
            raise TypeError(f"a cache entry must be an object, got {type(d).__name__}")
        rows = d["rows"]
        if not isinstance(rows, list):
            raise TypeError(f"'rows' must be a list, got {type(rows).__name__}")
        ranking = d["ranking"]
        if not isinstance(ranking, list) or not all(isinstance(n, str) for n in ranking):
            raise TypeError("'ranking' must be a list of backend names")
        return cls(key=key, case=_typed(d, "case", str), precision=_typed(d, "precision", str),
                   chosen=_typed(d, "chosen", str), ranking=list(ranking), rows=[_row(r) for r in rows],
                   source="disk", seconds=_typed({"seconds": d.get("seconds", 0.0)}, "seconds", float))

    def table(self) -> str:
        """The decision as a fixed-width text table."""
        head = (f"{'backend':16} {'class':9} {'status':32} {'err/bound q/mm':>20} {'median':>11} "
                f"{'chosen':>6}")
        lines = [f"case {self.case}  precision>={self.precision}  (source: {self.source}, "
                 f"selection took {self.seconds:.2f} s)", head, "-" * len(head)]
        for r in self.rows:
            ratio = "/".join(f"{_op_ratio(r.ratios, ops):.2g}" for ops in (("quantize",), ("scaled_mm", "linear"))) \
                if r.ratios else ("" if r.worst_ratio is None else f"{r.worst_ratio:.3g}")
            med = f"{r.median_s * 1e3:.3f} ms" if r.median_s is not None else ("-" if r.compliant else "")
            # A long reason is printed whole: its first words in the column, the rest below it.
            first = (textwrap.wrap(r.status, 32, break_on_hyphens=False) or [""])[0]
            lines.append(f"{r.backend:16} {r.precision:9} {first:32} {ratio:>20} {med:>11} "
                         f"{'  <==' if r.chosen else '':>6}")
            lines.extend(f"{'':26} {more}" for more in textwrap.wrap(r.status[len(first):].strip(), 72))
        notes = [f"  {r.backend}: {r.note or r.detail}" for r in self.rows if (r.note or r.detail)
                 and (r.compliant is False or r.note)]
        if notes:
            lines.append("notes:")
            lines.extend(notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"<Decision {self.chosen!r} for {self.case}, precision>={self.precision}, ranking {self.ranking}, "
                f"source {self.source}; print() it for the table>")


@dataclass
class ProbeResult:
    """Outcome of the compliance probe of one backend at one case."""

    compliant: bool
    worst_ratio: float
    detail: str
    call_seconds: float  #: time of one warm ``Backend.linear`` call at the probe's shape
    call_elements: int  #: M * N of one such call
    ratios: dict[str, float] = field(default_factory=dict)  #: worst error/bound per check, by contract name
