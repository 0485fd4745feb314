"""What a contract actually tested: ranges of M, N, K, formats, granularities, scales, dtypes.

Every example that ran (not the declined ones) adds its problem's ``facets()``; the declined ones
add their reason. A report prints one coverage row per contract, so a certificate says what it
covers -- and a narrow one shows it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Coverage", "COVERAGE_COLUMNS"]

#: The columns of the coverage table (facet name, header).
COVERAGE_COLUMNS = (("M", "M"), ("N", "N"), ("K", "K"), ("formats", "formats"), ("granularity", "granularity"),
                    ("scales", "scales"), ("x", "in"), ("out", "out"), ("bias", "bias"))
_RANGES = ("M", "N", "K")


@dataclass
class Coverage:
    """Accumulated facets of the examples that ran, and the reasons of the declined ones."""

    ranges: dict[str, list[int]] = field(default_factory=dict)
    sets: dict[str, set[str]] = field(default_factory=dict)
    declined: Counter = field(default_factory=Counter)

    def add(self, facets: dict[str, Any]) -> None:
        for key, value in facets.items():
            if key in _RANGES:
                if value is None:
                    continue
                lo, hi = self.ranges.get(key, (value, value))
                self.ranges[key] = [min(lo, value), max(hi, value)]
            else:
                self.sets.setdefault(key, set()).update(value)

    def decline(self, reason: str) -> None:
        self.declined[reason] += 1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: list(v) for k, v in self.ranges.items()}
        d.update({k: sorted(v) for k, v in self.sets.items()})
        if self.declined:
            d["declined"] = dict(self.declined.most_common())
        return d

    @staticmethod
    def cell(d: dict[str, Any] | None, key: str) -> str:
        """One cell of the coverage table from a ``to_dict`` (as kept in JSON reports)."""
        if not d or key not in d:
            return "-"
        v = d[key]
        if key in _RANGES:
            return str(v[0]) if v[0] == v[1] else f"{v[0]}..{v[1]}"
        return _grouped([_short(x) for x in v])

    @staticmethod
    def declined_text(d: dict[str, Any] | None, top: int = 2) -> str:
        if not d or not d.get("declined"):
            return ""
        items = sorted(d["declined"].items(), key=lambda kv: -kv[1])
        n = sum(v for _, v in items)
        shown = "; ".join(f"{r} (x{c})" for r, c in items[:top])
        more = f"; {len(items) - top} more reasons" if len(items) > top else ""
        return f"{n} declined: {shown}{more}"


_KINDS = {"saturate": "sat", "pow2": "p2", "pow2_low": "p2low", "wide": "wide"}


def _short(x: str) -> str:
    if x.startswith("static:"):
        return "st:" + _KINDS.get(x[7:], x[7:])
    return {"dynamic": "dyn"}.get(x, x)


def _grouped(items: list[str]) -> str:
    """``a:row, a:group, w:row`` -> ``a:row,group w:row``; ``st:p2, st:sat`` -> ``st:p2,sat``."""
    out: dict[str, list[str]] = {}
    for it in items:
        prefix, _, rest = it.partition(":") if ":" in it else ("", "", it)
        out.setdefault(prefix, []).append(rest)
    return " ".join((f"{p}:" if p else "") + ",".join(v) for p, v in out.items())
