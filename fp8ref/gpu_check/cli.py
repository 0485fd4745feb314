"""``python -m fp8ref.gpu_check``: the arguments, and the run that calls the steps, evaluates the
targets and writes the files after every step."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..bench import machine_meta, run
from ..cli.bench import _ints, _shape, _workload_args
from . import steps
from .summary import fmt_num, jsonable, summary_markdown, write_json, write_summary
from .targets import TARGETS, evaluate_targets, overall

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_NO_DEVICE", "build_parser", "main"]

EXIT_OK, EXIT_FAILED, EXIT_NO_DEVICE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m fp8ref.gpu_check``."""
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


def _command(args: argparse.Namespace) -> str:
    parts = ["python -m fp8ref.gpu_check", "--out", str(args.out), "--device", args.device,
             "--budget-s", f"{args.budget_s:g}", "--steps", args.steps, "--profile", args.profile]
    if args.quick:
        parts.append("--quick")
    parts += _workload_args(args)
    if args.in_process:
        parts.append("--in-process")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the GPU check; see the module docstring for the steps and the exit status."""
    args = build_parser().parse_args(argv)
    if args.worker:
        task, backend, profile, device = args.worker
        print(json.dumps(jsonable(steps.worker(task, backend, profile, device))))
        return 0
    try:
        wanted = _steps(args.steps)
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
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    res: dict[str, Any] = {"meta": machine_meta(args.device, args.quick), "errors": {}}
    res["meta"].update(dry_run=args.device != "cuda", budget_s=args.budget_s, command=_command(args),
                       targets=TARGETS)
    if args.device == "cuda":
        res["meta"]["capability"] = list(torch.cuda.get_device_capability())
    names, skipped = steps.cuda_backends(args.device, args.backend)
    res["backends"], res["backends_skipped"] = names, skipped
    print(f"gpu_check on {res['meta'].get('gpu', args.device)}: backends {names}; not run: {skipped}", flush=True)

    def save() -> None:
        res["meta"]["elapsed_s"] = time.perf_counter() - t_start
        write_json(res, args.out)
        write_summary(res, args.out)

    save()
    compliant: list[str] | None = None
    if "conformance" in wanted:
        res["conformance"] = []
        for name in names:
            # Keep at least a third of the budget for the benchmarks.
            left = deadline - time.perf_counter() - args.budget_s / 3
            if left < 5:
                res["conformance"].append({"backend": name, "status": "skipped", "reason": "time budget spent"})
                continue
            r = steps.run_task("conformance", name, args.profile, args.device,
                          timeout_s=min(args.conformance_timeout_s, left), in_process=args.in_process)
            left = deadline - time.perf_counter() - args.budget_s / 3
            if r["status"] == "timeout" and args.profile != "dev" and left >= 5:
                # A verdict on fewer examples beats none: retry with the smallest profile.
                retry = steps.run_task("conformance", name, "dev", args.device,
                                  timeout_s=min(args.conformance_timeout_s, left), in_process=args.in_process)
                retry["first_try"] = {k: r.get(k) for k in ("status", "reason", "seconds")} | {"profile": args.profile}
                r = retry
            r.setdefault("profile", args.profile if "first_try" not in r else "dev")
            res["conformance"].append(r)
            print(f"  conformance {name}: {r['status']} passed={r.get('passed')} ({fmt_num(r.get('seconds'), '.1f')} s)"
                  + (f" {r['reason'][:200]}" if r.get("reason") else ""), flush=True)
            save()
        ran = [c for c in res["conformance"] if c["status"] == "ok"]
        if ran and any(c.get("passed") is not None for c in ran):
            compliant = [c["backend"] for c in ran if c.get("passed")]
        res["compliant"] = compliant
    if "accumulator" in wanted:
        res["accumulator_bits"] = []
        for name in ("torch", "torch-fast"):
            if name not in names:
                res["accumulator_bits"].append({"backend": name, "status": "skipped",
                                                "reason": skipped.get(name, "not selected")})
                continue
            left = deadline - time.perf_counter() - args.budget_s / 4
            r = steps.run_task("accumulator_bits", name, args.profile, args.device, timeout_s=min(60.0, max(left, 1.0)),
                          in_process=args.in_process)
            res["accumulator_bits"].append(r)
            print(f"  accumulator_bits {name}: {r.get('bits')} ({r['status']})", flush=True)
            save()
    if "bench" in wanted:
        try:
            res["bench"] = run(args.device, quick=args.quick, backends_only=args.backend, shapes=args.shape,
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
