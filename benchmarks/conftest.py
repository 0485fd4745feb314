"""pytest-benchmark set-up for ``benchmarks/``: ``pytest benchmarks --benchmark-enable`` (``tox -e bench``).

- Files named ``bench_*.py`` are collected here (test functions inside are ``test_*`` as usual).
  This directory is not in ``testpaths``, so the default run (``tests/`` and ``properties/``)
  never collects it.
- Benchmarks never assert on time. A benchmark that has a baseline in the same run records
  itself on the ``ratios`` fixture; the terminal summary then prints, per group, each entry's
  throughput as a ratio to the group's baseline (e.g. quantization GB/s over the memory-copy
  GB/s, the reference GEMM's time over fp32 ``F.linear``'s), all measured in this session.
- Without ``--benchmark-enable`` (the project's default is ``--benchmark-disable``) each
  benchmark body runs once as a smoke test and no ratios are printed.
"""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself: only add it when found
    # by walking the directory, or it would run twice.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


class RatioBoard:
    """Medians of benchmarks, grouped, with one baseline per group."""

    def __init__(self):
        self.groups: dict[str, dict] = {}

    def record(self, benchmark, group: str, name: str, *, work: float, unit: str, baseline: bool = False) -> None:
        """Record ``benchmark``'s median for ``name`` in ``group``; ``work`` is the bytes or FLOPs one
        call does (``unit`` says which), so throughput = work / median. Puts the throughput, and the
        ratio to the group's baseline when that ran earlier in the session, into ``extra_info``."""
        stats = getattr(benchmark, "stats", None)
        if stats is None:  # benchmarks disabled: the body ran once, nothing was timed
            return
        median = stats.stats.median
        g = self.groups.setdefault(group, {"baseline": None, "rows": []})
        row = {"name": name, "median_s": median, "throughput": work / median, "unit": unit}
        if baseline:
            g["baseline"] = row
        g["rows"].append(row)
        benchmark.extra_info[f"{unit}_per_s"] = row["throughput"]
        base = g["baseline"]
        if base is not None and base is not row:
            benchmark.extra_info["throughput_over_baseline"] = row["throughput"] / base["throughput"]
            benchmark.extra_info["time_over_baseline"] = median / base["median_s"]
            benchmark.extra_info["baseline"] = base["name"]

    def lines(self) -> list[str]:
        out = []
        for group, g in self.groups.items():
            base = g["baseline"]
            out.append(f"{group}  (baseline: {base['name'] if base else 'none measured'})")
            for r in g["rows"]:
                rel = ""
                if base is not None and base is not r:
                    rel = (f"  throughput x{r['throughput'] / base['throughput']:.3f} of baseline, "
                           f"time x{r['median_s'] / base['median_s']:.3f}")
                out.append(f"  {r['name']:48} {r['median_s'] * 1e3:10.3f} ms  {_si(r['throughput'])}{r['unit']}/s{rel}")
        return out


def _si(v: float) -> str:
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= f:
            return f"{v / f:8.2f} {p}"
    return f"{v:8.2f} "


_BOARD = RatioBoard()


@pytest.fixture(scope="session")
def ratios() -> RatioBoard:
    return _BOARD


def pytest_terminal_summary(terminalreporter):
    lines = _BOARD.lines()
    if lines:
        terminalreporter.section("fp8ref ratios (same run)")
        for ln in lines:
            terminalreporter.write_line(ln)
