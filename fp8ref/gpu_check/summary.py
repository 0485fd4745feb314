"""What the GPU run writes: ``gpu_check.json`` (everything, atomically, after every step) and
``summary.md`` (environment, conformance, accumulator bits, speed, targets)."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["jsonable", "write_json", "write_summary", "summary_markdown", "fmt_num"]


def jsonable(obj: Any, depth: int = 0) -> Any:
    """A JSON-safe rendering of a result: dicts, lists, dataclasses, enums, tensors, non-finite floats."""
    if depth > 6:
        return repr(obj)[:200]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else repr(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() <= 16 else f"<tensor {tuple(obj.shape)} {obj.dtype}>"
    if is_dataclass(obj) and not isinstance(obj, type):
        try:
            return jsonable(asdict(obj), depth + 1)
        except TypeError:
            return repr(obj)[:500]
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in list(obj.items())[:200]}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v, depth + 1) for v in list(obj)[:200]]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value, depth + 1)
    return repr(obj)[:500]


def write_json(res: dict, out_dir: Path) -> Path:
    """Write ``res`` to ``out_dir/gpu_check.json`` (atomically: a cut-off run leaves the last good file).

    Examples
    --------
    >>> import json, tempfile, torch
    >>> from fp8ref.gpu_check import write_json
    >>> with tempfile.TemporaryDirectory() as d:
    ...     json.loads(write_json({"x": torch.tensor([1.5]), "nan": float("nan")}, d).read_text())
    {'x': [1.5], 'nan': 'nan'}
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(res), indent=1))
    os.replace(tmp, path)
    return path


def write_summary(res: dict, out_dir: Path) -> Path:
    """Write ``summary_markdown(res)`` to ``out_dir/summary.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.md"
    path.write_text(summary_markdown(res))
    return path


def _pf(p: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "NO DATA"}[p]


def fmt_num(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def summary_markdown(res: dict) -> str:
    """The Markdown summary of a GPU check result: environment, conformance, bits, speed, targets.

    Examples
    --------
    >>> from fp8ref.gpu_check import summary_markdown
    >>> summary_markdown({"meta": {"gpu": "NVIDIA H200"}}).splitlines()[0]
    '# fp8ref GPU check: NVIDIA H200'
    """
    meta = res.get("meta", {})
    lines = [f"# fp8ref GPU check: {meta.get('gpu') or meta.get('device', '?')}", ""]
    if meta.get("dry_run"):
        lines += ["**Dry run on the CPU**: the targets below are stated for an H200 and are shown only to "
                  "exercise the pipeline.", ""]
    lines += [f"- date (UTC): {meta.get('date_utc', '-')}; torch {meta.get('torch', '-')}, CUDA "
              f"{meta.get('cuda') or '-'}; elapsed {fmt_num(meta.get('elapsed_s'), '.0f')} s of a "
              f"{fmt_num(meta.get('budget_s'), '.0f')} s budget",
              f"- command: `{meta.get('command', '-')}`"]
    if res.get("backends_skipped"):
        lines.append("- backends not run: " + "; ".join(f"`{k}`: {v}" for k, v in res["backends_skipped"].items()))
    for step, err in (res.get("errors") or {}).items():
        lines.append(f"- step `{step}` failed: {err}")
    lines.append("")
    if res.get("conformance"):
        lines += ["## Conformance", "",
                  "| backend | profile | status | passed | examples | accumulator bits | seconds | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in res["conformance"]:
            note = str(c.get("reason", ""))[:120]
            if c.get("failures"):
                note = "failing: " + ", ".join(c["failures"]) + (f"; {note}" if note else "")
            if "first_try" in c:
                ft = c["first_try"]
                note = f"profile {ft['profile']}: {ft['status']} after {fmt_num(ft.get('seconds'), '.0f')} s; {note}"
            lines.append(f"| {c['backend']} | {c.get('profile', '-')} | {c['status']} | {c.get('passed', '-')} | "
                         f"{c.get('examples', '-')} | {fmt_num(c.get('accumulator_bits'), 'g')} | "
                         f"{fmt_num(c.get('seconds'), '.1f')} | {note} |")
        lines.append("")
    if res.get("accumulator_bits"):
        lines += ["## Accumulator bits of FP8 `torch._scaled_mm`", "",
                  "| backend | fast accumulation | bits | status |", "|---|---|---|---|"]
        for a in res["accumulator_bits"]:
            lines.append(f"| {a['backend']} | {'on' if a['backend'].endswith('fast') else 'off'} | "
                         f"{fmt_num(a.get('bits'), 'g')} | {a['status']} {str(a.get('reason', ''))[:100]} |")
        lines.append("")
    bench = res.get("bench") or {}
    if "copy" in bench:
        lines += ["## Ceilings", "", f"- device-to-device copy: {bench['copy']['gbps']:.1f} GB/s (read + write)",
                  f"- bf16 GEMM peak: {bench['bf16_peak']['gflops'] / 1e3:.1f} TFLOP/s "
                  f"(n = {bench['bf16_peak']['n']})", ""]
    if bench.get("linear"):
        cols = sorted({b for r in bench["linear"] for b in r["backends"]})
        lines += ["## FP8 linear vs bf16 `F.linear`",
                  "", "Speed-up over bf16 (> 1 is faster); GEMM alone in brackets.", "",
                  "| K | N | M | bf16 ms | " + " | ".join(cols) + " | auto / fastest |",
                  "|---|---|---|---|" + "---|" * len(cols) + "---|"]
        for r in bench["linear"]:
            cells = []
            for c in cols:
                e = r["backends"].get(c, {})
                cell = fmt_num(e.get("speedup_vs_bf16"), ".2f")
                if "gemm_speedup_vs_bf16" in e:
                    cell += f" ({e['gemm_speedup_vs_bf16']:.2f})"
                cells.append(cell)
            lines.append(f"| {r['K']} | {r['N']} | {r['M']} | {r['bf16_s'] * 1e3:.3f} | " + " | ".join(cells)
                         + f" | {fmt_num(r.get('auto_over_fastest'))} |")
        lines.append("")
    if bench.get("quant"):
        lines += ["## Quantization vs copy bandwidth", "", "| backend | quantization | shape | GB/s | % of copy |",
                  "|---|---|---|---|---|"]
        for q in bench["quant"]:
            frac = q.get("frac_of_copy")
            lines.append(f"| {q['backend']} | {q['quant']} | {'x'.join(map(str, q.get('shape', ())))} | "
                         f"{fmt_num(q.get('gbps'), '.1f')} | {fmt_num(None if frac is None else 100 * frac, '.1f')} |")
        lines.append("")
    sel = bench.get("selector") or {}
    if "first_selection_s" in sel:
        ov = sel.get("dispatch_overhead_s")
        lines += ["## Selector", "",
                  f"- first selection (probe + timing, empty caches) at M={sel['M']} K={sel['K']} N={sel['N']}: "
                  f"{sel['first_selection_s'] * 1e3:.1f} ms; from the disk cache {sel['disk_lookup_s'] * 1e3:.2f} ms",
                  f"- dispatch overhead per call: {fmt_num(None if ov is None else ov * 1e6, '.1f')} us "
                  f"(picks {sel.get('selected', '-')})", ""]
    if res.get("targets") is not None:
        lines += ["## Targets", "", "| target | case | value | required | result | detail |",
                  "|---|---|---|---|---|---|"]
        for t in res["targets"]:
            lines.append(f"| {t['target']} | {t['case']} | {fmt_num(t['value'])} | {t['op']} {t['threshold']:g} | "
                         f"{_pf(t['passed'])} | {t['detail']} |")
        lines += ["", f"**Overall: {_pf(res.get('overall'))}**", ""]
    return "\n".join(lines)
