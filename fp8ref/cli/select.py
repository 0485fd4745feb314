"""Subcommands about backends and selection: ``backends`` (what is registered, and why a backend
cannot run here) and ``select`` (the table behind the selector's decision for one shape)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .. import select as sel
from ..registry import ENV_ALLOW, Case, backends
from ..spec.schemes import RECIPES, get_recipe

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _count(low: int):
    """An argparse type: an int >= ``low`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            why = " (the reduction dim K must be at least 1)" if low == 1 else ""
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}{why}")
        return v

    parse.__name__ = f"int >= {low}"
    return parse


def _device(text: str) -> str:
    try:
        torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="list registered backends: availability, reason, precision class")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_backends)
    p = sub.add_parser("select", help="probe and time the backends for one shape; print the decision table")
    p.add_argument("--M", type=_count(0), required=True,
                   help="rows of activations (reduced to its power-of-two bucket)")
    p.add_argument("--N", type=_count(0), required=True, help="output features (0: an empty output, nothing probed)")
    p.add_argument("--K", type=_count(1), required=True, help="input features (at least 1)")
    p.add_argument("--recipe", default="w8a8_fp8", choices=sorted(RECIPES), help="quantization recipe")
    p.add_argument("--precision", default=sel.DEFAULT_PRECISION, choices=["exact", "strict", "standard", "fast"],
                   help="required precision class, see docs/selection.md")
    p.add_argument("--x-dtype", default="bf16", choices=sorted(_DTYPES), help="dtype of the activations")
    p.add_argument("--out-dtype", default=None, choices=sorted(_DTYPES), help="default: --x-dtype")
    p.add_argument("--bias", action="store_true", help="the linear has a bias")
    p.add_argument("--device", default="cpu", type=_device, help="device of the activations and weights")
    p.add_argument("--candidates", default=None, help="comma-separated backend names (the reference is added)")
    p.add_argument("--refresh", action="store_true", help="ignore the caches and probe again")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(func=_select)


def _backends(args: argparse.Namespace) -> int:
    infos = backends()
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], indent=1))
        return 0
    print(f"{'backend':18} {'class':9} {'accumulation':12} {'roundings':>9}  status")
    for i in infos:
        status = "available" if i.available else f"unavailable: {i.reason}"
        if not i.trusted:
            status += f"; {i.origin}: usable by name, auto only when allowed ({ENV_ALLOW} or --candidates)"
        print(f"{i.name:18} {i.precision:9} {i.accumulation:12} {i.output_roundings:>9}  {status}")
    return 0


def _select(args: argparse.Namespace) -> int:
    x_dtype = _DTYPES[args.x_dtype]
    case = Case(M=args.M, N=args.N, K=args.K, recipe=get_recipe(args.recipe), x_dtype=x_dtype,
                out_dtype=_DTYPES[args.out_dtype] if args.out_dtype else x_dtype, device=args.device,
                has_bias=args.bias)
    cands = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    try:
        d = sel.select(case, args.precision, candidates=cands, refresh=args.refresh)
    except (KeyError, TypeError, ValueError) as exc:  # e.g. an unknown --candidates name: say it, no traceback
        print(f"fp8ref select: error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    if args.json:
        out = d.to_json()
        out["source"] = d.source
        out["key"] = d.key
        print(json.dumps(out, indent=1, default=str))
    else:
        print(d.table())
    return 0
