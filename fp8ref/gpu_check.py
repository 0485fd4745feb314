"""The prepared GPU evidence run: conformance, accumulator width and speed on a lent NVIDIA GPU.

``python -m fp8ref.gpu_check --out DIR`` (or ``scripts/gpu_check.sh DIR``), with no network and
in under 8 minutes on one GPU:

1. runs the conformance suite (``fp8ref.conformance.check``) on every backend that runs on CUDA
   (``torch`` with and without fast accumulation, ``triton``, ``sgl-kernel`` if importable),
   each in a child process with a time limit, so a hung kernel costs its slot, not the run;
2. measures ``fp8ref.conformance.accumulator_bits`` of ``torch._scaled_mm`` with fast
   accumulation off (``torch``) and on (``torch-fast``);
3. benchmarks FP8 against bf16 GEMM at the Llama-3.1-8B shapes and the quantization kernels
   against a device-to-device copy (``fp8ref.bench``);
4. evaluates the targets (``TARGETS``) as pass/fail and writes ``gpu_check.json`` and
   ``summary.md`` to the output directory after every step, so a cut-off run keeps what it did.

Exit status: 0 when every target passed (or, on ``--device cpu``, the dry run completed), 1 when
a target failed or could not be evaluated or a step errored, 2 when the run could not start (no
CUDA device). ``--device cpu`` runs the same pipeline on the CPU as a dry run: its targets are
printed for the pipeline's sake only, since they are stated for an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .registry import Backend, Case, backend_quantize
from .spec.quant import Quantized

__all__ = ["TARGETS", "build_parser", "evaluate_targets", "write_json", "write_summary", "summary_markdown",
           "cuda_backends", "OnDevice", "main"]

#: The targets of the GPU run (issue 6), stated for an H200.
TARGETS = {
    #: FP8 GEMM (activations already quantized) over bf16 F.linear (cuBLAS) at M >= fp8_gemm_min_m.
    "fp8_gemm_speedup_min": 1.6,
    "fp8_gemm_min_m": 1024,
    #: Activation quantization GB/s over the device-to-device copy GB/s.
    "act_quant_frac_of_copy_min": 0.70,
    #: auto's time over the fastest compliant backend's, per shape.
    "auto_over_fastest_max": 1.05,
}

#: Backends the GPU run certifies when they are registered and available.
GPU_BACKENDS = ("torch", "torch-fast", "triton", "sgl-kernel")
ACT_QUANTS = ("per-token", "per-group128", "per-tensor")
EXIT_OK, EXIT_FAILED, EXIT_NO_DEVICE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m fp8ref.gpu_check``."""
    from .cli.bench import _ints, _shape

    p = argparse.ArgumentParser(prog="python -m fp8ref.gpu_check",
                                description="fp8ref GPU evidence run: conformance, accumulator bits, FP8 vs bf16 speed")
    p.add_argument("--out", type=Path, default=Path("out/gpu_check"), help="output directory (default out/gpu_check)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the real run) or cpu (a dry run of the pipeline)")
    p.add_argument("--quick", action="store_true", help="one shape, M in {1,16}, fewer samples")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds for the whole run (default 420, under the 8-minute limit)")
    p.add_argument("--steps", default="conformance,accumulator,bench",
                   help="comma-separated among conformance,accumulator,bench (default: all)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="only this backend (repeatable); default: every backend available on the device")
    p.add_argument("--profile", default="ci", help="conformance profile: dev, ci (default) or thorough")
    p.add_argument("--conformance-timeout-s", type=float, default=120.0,
                   help="limit for one backend's conformance run (default 120)")
    p.add_argument("--shape", action="append", type=_shape, metavar="KxN", help="linear shape (repeatable)")
    p.add_argument("--m", type=_ints, metavar="M1,M2,..", help="token counts (default 1,16,128,1024)")
    p.add_argument("--in-process", action="store_true",
                   help="run conformance in this process (no per-backend time limit; for tests)")
    p.add_argument("--worker", nargs=4, metavar=("TASK", "BACKEND", "PROFILE", "DEVICE"), help=argparse.SUPPRESS)
    return p


def _steps(text: str) -> list[str]:
    steps = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in steps if s not in ("conformance", "accumulator", "bench")]
    if bad or not steps:
        raise ValueError(f"--steps must be among conformance,accumulator,bench; got {text!r}")
    return steps


# --------------------------------------------------------------------------------------------
# JSON helpers
# --------------------------------------------------------------------------------------------

def _jsonable(obj: Any, depth: int = 0) -> Any:
    """A JSON-safe rendering of a peer's report object (dataclass, dict, enum, tensor...)."""
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
            return _jsonable(asdict(obj), depth + 1)
        except TypeError:
            return repr(obj)[:500]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in list(obj.items())[:200]}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v, depth + 1) for v in list(obj)[:200]]
    if hasattr(obj, "value") and hasattr(obj, "name"):  # enums
        return _jsonable(obj.value, depth + 1)
    for attr in ("to_dict", "as_dict"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            try:
                return _jsonable(fn(), depth + 1)
            except Exception:  # a peer's serializer failing must not lose the run
                break
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
    tmp.write_text(json.dumps(_jsonable(res), indent=1))
    os.replace(tmp, path)
    return path


def write_summary(res: dict, out_dir: Path) -> Path:
    """Write ``summary_markdown(res)`` to ``out_dir/summary.md``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.md"
    path.write_text(summary_markdown(res))
    return path


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------

def cuda_backends(device: str = "cuda", only: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Backends to certify on ``device`` (the reference excluded: it is the spec) and why others are not.

    Every name in ``GPU_BACKENDS`` appears in one of the two results, registered or not.
    """
    from .bench import _available_backends

    names, skipped = _available_backends(device, only)
    names = [n for n in names if n != "reference"]
    for b in GPU_BACKENDS:
        if (only is None or b in only) and b not in names and b not in skipped:
            skipped[b] = "not registered (its module is missing or failed to import)"
    return names, skipped


class OnDevice(Backend):
    """A backend run on ``device`` for a suite that builds its inputs on the CPU.

    ``fp8ref.conformance.check`` draws its examples as CPU tensors; certifying a CUDA kernel
    needs them on the GPU. This wrapper moves every input to ``device``, calls the wrapped
    backend, and brings the results back, so the CUDA kernel is what the contracts check. It
    keeps the wrapped backend's name and declarations (accumulation, output roundings), and asks
    ``supports`` about the case on ``device``.

    Examples
    --------
    >>> import torch
    >>> from fp8ref import get_backend, quantize
    >>> from fp8ref.gpu_check import OnDevice
    >>> b = OnDevice(get_backend("reference"), "cpu")
    >>> b.name, b.precision.value
    ('reference', 'exact')
    >>> a = quantize(torch.full((2, 16), 448.0))  # scale 1: every product exact
    >>> b.scaled_mm(a, b.prepare_weight(a), None, torch.float32).tolist()
    [[3211264.0, 3211264.0], [3211264.0, 3211264.0]]
    """

    def __init__(self, backend: Backend, device: str):
        self.inner, self.device = backend, torch.device(device)
        self.name, self.accumulation = backend.name, backend.accumulation
        self.output_roundings = backend.output_roundings

    def available(self) -> str | None:
        return self.inner.available()

    def supports(self, case: Case) -> str | None:
        return self.inner.supports(replace(case, device=self.device.type))

    def _to(self, q: Quantized, device) -> Quantized:
        return Quantized(q.data.to(device), q.scale.to(device), q.scheme, q.n_saturated)

    def quantize(self, x: torch.Tensor, scheme, scale=None) -> Quantized:
        scale = None if scale is None else scale.to(self.device)
        return self._to(backend_quantize(self.inner, x.to(self.device), scheme, scale), x.device)

    def prepare_weight(self, w: Quantized) -> Any:
        return self.inner.prepare_weight(self._to(w, self.device))

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if isinstance(b, Quantized):
            b = self._to(b, self.device)
        y = self.inner.scaled_mm(self._to(a, self.device), b, None if bias is None else bias.to(self.device),
                                 out_dtype)
        return y.to(a.data.device)


def _worker(task: str, backend: str, profile: str, device: str) -> dict:
    """One conformance or accumulator-bits measurement, as a JSON-able dict (never raises)."""
    from .bench import _count_examples, _report_passed, peer_api
    from .registry import get_backend

    attr = "check" if task == "conformance" else "accumulator_bits"
    fn, reason = peer_api("fp8ref.conformance", attr)
    if fn is None:
        return {"backend": backend, "status": "not available", "reason": reason}
    t0 = time.perf_counter()
    try:
        if task == "conformance":
            # The suite builds CPU inputs: certify the CUDA kernel, not the backend's CPU path.
            be = get_backend(backend)
            report = fn(be if device == "cpu" else OnDevice(be, device), profile)
        else:
            report = fn(get_backend(backend), device=device)
    except Exception as exc:  # the error is the finding
        return {"backend": backend, "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - t0}
    out = {"backend": backend, "status": "ok", "seconds": time.perf_counter() - t0, "report": _jsonable(report)}
    if task == "conformance":
        out["passed"] = _report_passed(report)
        out["examples"] = _count_examples(report)
        out["failures"] = [f"{r.contract} ({r.status})" for r in getattr(report, "failures", ())
                           if hasattr(r, "contract")]
        bits = getattr(report, "accumulator_bits", None)
        out["accumulator_bits"] = bits if isinstance(bits, int) else None
        if getattr(report, "available", True) is False:
            out["status"], out["reason"] = "unavailable", str(getattr(report, "reason", ""))
    else:
        bits = report if isinstance(report, (int, float)) else None
        for key in ("bits", "accumulator_bits", "mantissa_bits", "effective_bits"):
            if bits is None:
                v = report.get(key) if isinstance(report, dict) else getattr(report, key, None)
                bits = v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        out["bits"] = bits
    return out


def _run_task(task: str, backend: str, profile: str, device: str, *, timeout_s: float, in_process: bool) -> dict:
    if in_process:
        return _worker(task, backend, profile, device)
    cmd = [sys.executable, "-m", "fp8ref.gpu_check", "--worker", task, backend, profile, device]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        return {"backend": backend, "status": "timeout", "reason": f"no answer within {timeout_s:.0f} s",
                "seconds": time.perf_counter() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"backend": backend, "status": "error", "seconds": time.perf_counter() - t0,
                "reason": f"worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------

def _target(name: str, case: str, value: float | None, op: str, threshold: float, detail: str) -> dict:
    if value is None:
        passed = None
    elif op == ">=":
        passed = value >= threshold
    else:
        passed = value <= threshold
    return {"target": name, "case": case, "value": value, "op": op, "threshold": threshold, "passed": passed,
            "detail": detail}


def evaluate_targets(res: dict, compliant: Sequence[str] | None = None, targets: dict | None = None) -> list[dict]:
    """Pass/fail of every target on the figures in ``res`` (the dict ``fp8ref.bench.run`` returns).

    Parameters
    ----------
    res : dict
        Needs ``linear`` and ``quant`` rows as ``fp8ref.bench`` writes them; missing ones give
        targets with ``passed=None`` ("no data"), never a pass.
    compliant : sequence of str, optional
        Backends that passed conformance; only they count. None: every measured backend counts.
        For the ``auto`` target, a backend must also be of a precision class that ``auto``
        admits (the rows' ``precision`` fields, when recorded): ``auto`` at ``standard`` is
        not compared with a ``fast`` backend it may not pick.
    targets : dict, optional
        Thresholds; ``TARGETS`` by default.

    Returns
    -------
    list of dict
        One per (target, case): ``target, case, value, op, threshold, passed, detail``.

    Examples
    --------
    >>> from fp8ref.gpu_check import evaluate_targets
    >>> row = {"K": 8, "N": 8, "M": 1024, "bf16_s": 2.0,
    ...        "backends": {"torch": {"seconds": 1.0, "speedup_vs_bf16": 2.0, "gemm_speedup_vs_bf16": 2.5}}}
    >>> [(t["target"], t["passed"]) for t in evaluate_targets({"linear": [row], "quant": []})][:2]
    [('fp8_gemm_vs_bf16', True), ('act_quant_vs_copy', None)]
    """
    tg = dict(TARGETS if targets is None else targets)
    ok = (lambda b: b != "auto") if compliant is None else (lambda b: b in compliant)
    out = []
    linear = res.get("linear") or []
    big = [r for r in linear if r["M"] >= tg["fp8_gemm_min_m"]]
    if not big:
        out.append(_target("fp8_gemm_vs_bf16", f"M >= {tg['fp8_gemm_min_m']}", None, ">=", tg["fp8_gemm_speedup_min"],
                           "no data: no linear row at this M"))
    for r in big:
        cands = {}
        for b, e in r["backends"].items():
            if not ok(b):
                continue
            if "gemm_speedup_vs_bf16" in e:
                cands[b] = (e["gemm_speedup_vs_bf16"], "GEMM alone")
            elif "speedup_vs_bf16" in e:
                cands[b] = (e["speedup_vs_bf16"], "linear incl. activation quantization")
        case = f"K={r['K']} N={r['N']} M={r['M']}"
        if cands:
            best = max(cands, key=lambda b: cands[b][0])
            out.append(_target("fp8_gemm_vs_bf16", case, cands[best][0], ">=", tg["fp8_gemm_speedup_min"],
                               f"best: {best} ({cands[best][1]})"))
        else:
            out.append(_target("fp8_gemm_vs_bf16", case, None, ">=", tg["fp8_gemm_speedup_min"],
                               "no data: no compliant backend measured"))
    quant_rows = res.get("quant") or []
    for qname in ACT_QUANTS:
        cands = {r["backend"]: r["frac_of_copy"] for r in quant_rows
                 if r.get("quant") == qname and "frac_of_copy" in r and ok(r["backend"])}
        if cands:
            best = max(cands, key=cands.get)
            out.append(_target("act_quant_vs_copy", qname, cands[best], ">=", tg["act_quant_frac_of_copy_min"],
                               f"best: {best}"))
        else:
            out.append(_target("act_quant_vs_copy", qname, None, ">=", tg["act_quant_frac_of_copy_min"],
                               "no data: no compliant backend measured with a copy bandwidth"))
    autos = [r for r in linear if "seconds" in r["backends"].get("auto", {})]
    for r in autos:
        need = r["backends"]["auto"].get("precision")
        times = {b: e["seconds"] for b, e in r["backends"].items()
                 if b != "auto" and "seconds" in e and ok(b) and _admits(need, e.get("precision"))}
        case = f"K={r['K']} N={r['N']} M={r['M']}"
        if not times:
            out.append(_target("auto_vs_fastest", case, None, "<=", tg["auto_over_fastest_max"],
                               "no data: no compliant backend measured"))
            continue
        best = min(times, key=times.get)
        sel = r["backends"]["auto"].get("selected")
        out.append(_target("auto_vs_fastest", case, r["backends"]["auto"]["seconds"] / times[best], "<=",
                           tg["auto_over_fastest_max"], f"fastest: {best}" + (f"; auto picked {sel}" if sel else "")))
    if not autos:
        out.append(_target("auto_vs_fastest", "all shapes", None, "<=", tg["auto_over_fastest_max"],
                           "no data: auto was not measured"))
    return out


def _admits(required: str | None, declared: str | None) -> bool:
    """Whether auto, requiring class ``required``, may pick a backend of class ``declared``
    (True when either is unknown: then every backend counts)."""
    from .spec.bounds import PrecisionClass

    if required is None or declared is None:
        return True
    return PrecisionClass(required).admits(PrecisionClass(declared))


def overall(targets: list[dict]) -> bool | None:
    """True if every target passed, False if one failed, None if none failed but some lack data."""
    if any(t["passed"] is False for t in targets):
        return False
    if not targets or any(t["passed"] is None for t in targets):
        return None
    return True


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def _pf(p: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "NO DATA"}[p]


def _num(v: Any, spec: str = ".3f") -> str:
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
              f"{meta.get('cuda') or '-'}; elapsed {_num(meta.get('elapsed_s'), '.0f')} s of a "
              f"{_num(meta.get('budget_s'), '.0f')} s budget",
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
                note = f"profile {ft['profile']}: {ft['status']} after {_num(ft.get('seconds'), '.0f')} s; {note}"
            lines.append(f"| {c['backend']} | {c.get('profile', '-')} | {c['status']} | {c.get('passed', '-')} | "
                         f"{c.get('examples', '-')} | {_num(c.get('accumulator_bits'), 'g')} | "
                         f"{_num(c.get('seconds'), '.1f')} | {note} |")
        lines.append("")
    if res.get("accumulator_bits"):
        lines += ["## Accumulator bits of FP8 `torch._scaled_mm`", "",
                  "| backend | fast accumulation | bits | status |", "|---|---|---|---|"]
        for a in res["accumulator_bits"]:
            lines.append(f"| {a['backend']} | {'on' if a['backend'].endswith('fast') else 'off'} | "
                         f"{_num(a.get('bits'), 'g')} | {a['status']} {str(a.get('reason', ''))[:100]} |")
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
                cell = _num(e.get("speedup_vs_bf16"), ".2f")
                if "gemm_speedup_vs_bf16" in e:
                    cell += f" ({e['gemm_speedup_vs_bf16']:.2f})"
                cells.append(cell)
            lines.append(f"| {r['K']} | {r['N']} | {r['M']} | {r['bf16_s'] * 1e3:.3f} | " + " | ".join(cells)
                         + f" | {_num(r.get('auto_over_fastest'))} |")
        lines.append("")
    if bench.get("quant"):
        lines += ["## Quantization vs copy bandwidth", "", "| backend | quantization | shape | GB/s | % of copy |",
                  "|---|---|---|---|---|"]
        for q in bench["quant"]:
            frac = q.get("frac_of_copy")
            lines.append(f"| {q['backend']} | {q['quant']} | {'x'.join(map(str, q.get('shape', ())))} | "
                         f"{_num(q.get('gbps'), '.1f')} | {_num(None if frac is None else 100 * frac, '.1f')} |")
        lines.append("")
    sel = bench.get("selector") or {}
    if "first_selection_s" in sel:
        ov = sel.get("dispatch_overhead_s")
        lines += ["## Selector", "",
                  f"- first selection (probe + timing, empty caches) at M={sel['M']} K={sel['K']} N={sel['N']}: "
                  f"{sel['first_selection_s'] * 1e3:.1f} ms; from the disk cache {sel['disk_lookup_s'] * 1e3:.2f} ms",
                  f"- dispatch overhead per call: {_num(None if ov is None else ov * 1e6, '.1f')} us "
                  f"(picks {sel.get('selected', '-')})", ""]
    if res.get("targets") is not None:
        lines += ["## Targets", "", "| target | case | value | required | result | detail |",
                  "|---|---|---|---|---|---|"]
        for t in res["targets"]:
            lines.append(f"| {t['target']} | {t['case']} | {_num(t['value'])} | {t['op']} {t['threshold']:g} | "
                         f"{_pf(t['passed'])} | {t['detail']} |")
        lines += ["", f"**Overall: {_pf(res.get('overall'))}**", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def _command(args: argparse.Namespace) -> str:
    parts = ["python -m fp8ref.gpu_check", "--out", str(args.out), "--device", args.device,
             "--budget-s", f"{args.budget_s:g}", "--steps", args.steps, "--profile", args.profile]
    if args.quick:
        parts.append("--quick")
    for b in args.backend or ():
        parts += ["--backend", b]
    for k, n in args.shape or ():
        parts += ["--shape", f"{k}x{n}"]
    if args.m:
        parts += ["--m", ",".join(map(str, args.m))]
    if args.in_process:
        parts.append("--in-process")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the GPU check; see the module docstring for the steps and the exit status."""
    args = build_parser().parse_args(argv)
    if args.worker:
        task, backend, profile, device = args.worker
        print(json.dumps(_jsonable(_worker(task, backend, profile, device))))
        return 0
    try:
        steps = _steps(args.steps)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_NO_DEVICE
    if args.budget_s <= 0:
        print("gpu_check: --budget-s must be > 0", file=sys.stderr)
        return EXIT_NO_DEVICE
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda}). Run it on a machine with an NVIDIA GPU, or pass --device cpu "
              "for a dry run of the pipeline.", file=sys.stderr)
        return EXIT_NO_DEVICE
    from . import bench

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    res: dict[str, Any] = {"meta": bench._meta(args.device, args.quick), "errors": {}}
    res["meta"].update(dry_run=args.device != "cuda", budget_s=args.budget_s, command=_command(args),
                       targets=TARGETS)
    if args.device == "cuda":
        res["meta"]["capability"] = list(torch.cuda.get_device_capability())
    names, skipped = cuda_backends(args.device, args.backend)
    res["backends"], res["backends_skipped"] = names, skipped
    print(f"gpu_check on {res['meta'].get('gpu', args.device)}: backends {names}; not run: {skipped}", flush=True)

    def save() -> None:
        res["meta"]["elapsed_s"] = time.perf_counter() - t_start
        write_json(res, args.out)
        write_summary(res, args.out)

    save()
    compliant: list[str] | None = None
    if "conformance" in steps:
        res["conformance"] = []
        for name in names:
            # Keep at least a third of the budget for the benchmarks.
            left = deadline - time.perf_counter() - args.budget_s / 3
            if left < 5:
                res["conformance"].append({"backend": name, "status": "skipped", "reason": "time budget spent"})
                continue
            r = _run_task("conformance", name, args.profile, args.device,
                          timeout_s=min(args.conformance_timeout_s, left), in_process=args.in_process)
            left = deadline - time.perf_counter() - args.budget_s / 3
            if r["status"] == "timeout" and args.profile != "dev" and left >= 5:
                # A verdict on fewer examples beats none: retry with the smallest profile.
                retry = _run_task("conformance", name, "dev", args.device,
                                  timeout_s=min(args.conformance_timeout_s, left), in_process=args.in_process)
                retry["first_try"] = {k: r.get(k) for k in ("status", "reason", "seconds")} | {"profile": args.profile}
                r = retry
            r.setdefault("profile", args.profile if "first_try" not in r else "dev")
            res["conformance"].append(r)
            print(f"  conformance {name}: {r['status']} passed={r.get('passed')} ({_num(r.get('seconds'), '.1f')} s)"
                  + (f" {r['reason'][:200]}" if r.get("reason") else ""), flush=True)
            save()
        ran = [c for c in res["conformance"] if c["status"] == "ok"]
        if ran and any(c.get("passed") is not None for c in ran):
            compliant = [c["backend"] for c in ran if c.get("passed")]
        res["compliant"] = compliant
    if "accumulator" in steps:
        res["accumulator_bits"] = []
        for name in ("torch", "torch-fast"):
            if name not in names:
                res["accumulator_bits"].append({"backend": name, "status": "skipped",
                                                "reason": skipped.get(name, "not selected")})
                continue
            left = deadline - time.perf_counter() - args.budget_s / 4
            r = _run_task("accumulator_bits", name, args.profile, args.device, timeout_s=min(60.0, max(left, 1.0)),
                          in_process=args.in_process)
            res["accumulator_bits"].append(r)
            print(f"  accumulator_bits {name}: {r.get('bits')} ({r['status']})", flush=True)
            save()
    if "bench" in steps:
        try:
            res["bench"] = bench.run(args.device, quick=args.quick, backends_only=args.backend, shapes=args.shape,
                                     m_values=args.m, sections=("ceilings", "quant", "linear", "selector"),
                                     gemm_only=True,
                                     deadline_s=max(deadline - time.perf_counter() - 10, 1.0),
                                     log=lambda s: print(s, flush=True))
        except Exception as exc:  # keep the conformance results; the error is reported
            res["errors"]["bench"] = f"{type(exc).__name__}: {exc}"
    res["targets"] = evaluate_targets(res.get("bench") or {}, compliant)
    res["overall"] = overall(res["targets"])
    save()
    print(summary_markdown(res), flush=True)
    print(f"wrote {Path(args.out) / 'gpu_check.json'} and {Path(args.out) / 'summary.md'}")
    if res["errors"] or any(c.get("status") in ("error", "timeout") for c in res.get("conformance", [])):
        return EXIT_FAILED
    if args.device != "cuda":
        return EXIT_OK
    return EXIT_OK if res["overall"] is True else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
