"""``fp8ref bench``: speed of every backend as ratios to bf16 and to this machine's ceilings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .._io import unwritable_reason, write_text
from .._progress import oversubscribed
from ..bench import SECTIONS
from ..bench.model import MODELS


def _shape(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be KxN with positive ints, e.g. 4096x14336; "
                                         f"got {text!r}") from None
    if k < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape must be KxN with positive ints, got {text!r}")
    return k, n


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return vals


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _names(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a backend name (or comma-separated names), got {text!r}")
    return vals


def unknown_backends(names, extra: tuple[str, ...] = ()) -> str | None:
    """Why ``names`` (``--backend`` values) cannot run: the registry's message for the first
    unregistered one (it lists the registered names), or None. Checked before any work (a typo
    used to give a benchmark of nothing); ``extra`` are names the command takes besides ("auto")."""
    from ..registry import get_backend

    for n in names or ():
        if n in extra:
            continue
        try:
            get_backend(n)
        except KeyError as exc:
            also = f" (or {', '.join(extra)})" if extra else ""
            return f"{exc.args[0]}{also}; repeat --backend, or separate names with commas"
    return None


def _sections(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in SECTIONS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"sections must be among {','.join(SECTIONS)}; got {text!r}")
    return vals


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark quantization and linear per backend as ratios to bf16 "
                                     "and to the measured copy bandwidth and bf16 GEMM peak")
    p.add_argument("--quick", action="store_true",
                   help="one shape (K=N=4096), M in {1,16}, small tensors: well under a minute on a CPU")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write every figure to FILE as JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device the backends run on")
    p.add_argument("--backend", action="extend", type=_names, metavar="NAME",
                   help="only this backend (repeatable, or NAME1,NAME2); default: every backend available on "
                        "the device")
    p.add_argument("--shape", action="append", type=_shape, metavar="KxN",
                   help="linear shape (repeatable); default: the Llama-3.1-8B shapes")
    p.add_argument("--m", type=_ints, metavar="M1,M2,..", help="token counts; default 1,16,128,1024")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (torch.set_num_threads); default: torch's own choice. On a loaded "
                        "machine 1 thread avoids waiting at parallel barriers for descheduled threads")
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), metavar="S1,S2,..",
                   help=f"what to run, among {','.join(SECTIONS)} (default: all)")
    p.add_argument("--model", action="extend", type=_models, metavar="NAME",
                   help=f"instead of the sections: end-to-end decode and prefill tokens/s of a model "
                        f"({', '.join(MODELS)}) after quantize_model against the same model in bf16, paired "
                        "(repeatable)")
    p.add_argument("--layers", type=_positive_int, default=1, metavar="N",
                   help="decoder layers of the llama8b model (Llama-3.1-8B widths, random weights); default 1")
    p.add_argument("--prompt", type=_positive_int, default=128, metavar="T",
                   help="--model: prompt tokens (the prefill's M); default 128")
    p.add_argument("--tokens", type=_positive_int, default=16, metavar="T",
                   help="--model: greedy tokens decoded per timed call; default 16")
    p.add_argument("--compile", action="store_true",
                   help="--model: also time both models under torch.compile (minutes of compilation on a small CPU)")
    p.add_argument("--dense-fallback", choices=("auto",), default=None,
                   help="--model: quantize with quantize_model(..., dense_fallback='auto'): each layer keeps its "
                        "original weight and runs it in the M buckets where FP8 measured slower (the report "
                        "lists the decisions); default: FP8 throughout")
    p.set_defaults(func=_bench)


def _models(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in MODELS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"models must be among {','.join(MODELS)}; got {text!r}")
    return vals


def _workload_args(args: argparse.Namespace) -> list[str]:
    """``--backend``, ``--shape`` and ``--m`` as given (shared with ``python -m fp8ref.gpu_check``)."""
    parts = []
    for b in args.backend or ():
        parts += ["--backend", b]
    for k, n in args.shape or ():
        parts += ["--shape", f"{k}x{n}"]
    if args.m:
        parts += ["--m", ",".join(map(str, args.m))]
    return parts


def _command_line(args: argparse.Namespace) -> str:
    """The options that shaped this run, as a command to repeat it (recorded in the JSON)."""
    parts = ["fp8ref", "bench", "--device", args.device]
    if args.quick:
        parts.append("--quick")
    if args.threads:
        parts += ["--threads", str(args.threads)]
    parts += _workload_args(args)
    if list(args.sections) != list(SECTIONS):
        parts += ["--sections", ",".join(args.sections)]
    if args.model:
        parts += ["--model", ",".join(args.model), "--layers", str(args.layers), "--prompt", str(args.prompt),
                  "--tokens", str(args.tokens)] + (["--compile"] if args.compile else [])
        if args.dense_fallback:
            parts += ["--dense-fallback", args.dense_fallback]
    if args.json:
        parts += ["--json", str(args.json)]
    return " ".join(parts)


def _bench(args: argparse.Namespace) -> int:
    from .. import bench

    reason = args.json and unwritable_reason(args.json)
    if reason:
        print(f"fp8ref bench: --json: {reason}", file=sys.stderr)
        return 2
    reason = unknown_backends(args.backend)
    if reason:
        print(f"fp8ref bench: --backend: {reason}", file=sys.stderr)
        return 2
    import torch

    busy = oversubscribed()
    if busy:
        print(f"fp8ref bench: {busy}", file=sys.stderr)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        return _bench_models(args, threads)
    try:
        res = bench.run(args.device, quick=args.quick, backends_only=args.backend, shapes=args.shape,
                        m_values=args.m, sections=args.sections,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
    except (RuntimeError, ValueError) as exc:
        print(f"fp8ref bench: {exc}", file=sys.stderr)
        return 2
    finally:  # main() called in a process that goes on (a test, a notebook) keeps its thread count
        torch.set_num_threads(threads)
    res["meta"]["command"] = _command_line(args)
    print(bench.format_report(res))
    if args.json:
        write_text(args.json, json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _bench_models(args: argparse.Namespace, threads: int) -> int:
    """``--model``: end-to-end tokens/s, paired with bf16 (``fp8ref.bench.model``)."""
    import torch

    from ..bench import machine_meta
    from ..bench.model import bench_model, format_model_report

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        meta = machine_meta(args.device, False)
        if args.device != "cpu":
            raise ValueError("--model runs on the CPU only (device 'cpu')")
        rows = [bench_model(name, layers=args.layers, prompt=args.prompt, tokens=args.tokens, compiled=args.compile,
                            dense_fallback=args.dense_fallback, log=log) for name in args.model]
    except (RuntimeError, ValueError, ImportError) as exc:
        print(f"fp8ref bench: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    import os

    if hasattr(os, "getloadavg"):
        meta["loadavg_end"] = list(os.getloadavg())
    from ..bench.load import unreliable_reason

    meta["unreliable"] = unreliable_reason(meta)
    res = {"meta": {**meta, "command": _command_line(args)}, "models": rows}
    print(format_model_report(res))
    if args.json:
        write_text(args.json, json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")
    return 0
