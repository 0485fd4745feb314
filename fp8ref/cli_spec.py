"""Subcommands about the spec itself: ``formats`` (the code tables) and ``demo`` (the main job)."""

from __future__ import annotations

import argparse

import torch

from . import bounds, formats, quant, schemes
from .linear import reference_linear


def add_parser(sub) -> None:
    p = sub.add_parser("formats", help="print the FP8 formats' constants, or all 256 codes of one")
    p.add_argument("--codes", metavar="FORMAT", help="list all 256 codes of this format")
    p.set_defaults(func=_formats)
    p = sub.add_parser("demo", help="the main job on a built-in default: backends, and the reference "
                                    "linear against its derived bound for every recipe")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)


def _formats(args: argparse.Namespace) -> int:
    if args.codes:
        fmt = formats.get_format(args.codes)
        for code, val in fmt.codes():
            print(f"0x{code:02X}  {val!r}")
        return 0
    print(f"{'format':10} {'max':>8} {'min normal':>12} {'min subnormal':>14} {'u':>8}  inf  -0")
    for f in formats.FORMATS.values():
        print(f"{f.name:10} {f.max:8g} {f.smallest_normal:12g} {f.smallest_subnormal:14g} "
              f"{f.unit_roundoff:8g}  {'yes' if f.has_inf else 'no ':3}  {'yes' if f.has_negative_zero else 'no'}")
    return 0


def demo_linear(seed: int = 0, M: int = 16, N: int = 256, K: int = 512) -> list[dict]:
    """Reference linear on LLM-like activations (outlier channels) for every recipe, with the
    derived end-to-end bound: the data behind ``fp8ref demo``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :4] *= 100.0  # outlier channels, as LLM activations have
    w = torch.randn(N, K, generator=g) / K**0.5
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    y_true = x.double() @ w.double().T
    rows = []
    for r in schemes.RECIPES.values():
        qx, qw = quant.quantize(x, r.activation), quant.quantize(w, r.weight)
        y = reference_linear(x, w, recipe=r)
        err = (y.double() - y_true).abs()
        bound = bounds.linear_error_bound(x, w, qx, qw, out_dtype=y.dtype)
        rel = float(err.norm() / y_true.norm())
        rows.append({"recipe": r.name, "rel_l2": rel, "max_err_over_bound": float((err / bound).max())})
    return rows


def _demo(args: argparse.Namespace) -> int:
    from .registry import backends

    print("backends on this machine:")
    for b in backends():
        print(f"  {b.name:14} {'available' if b.available else 'unavailable: ' + str(b.reason)}"
              f"  [{b.precision}]")
    print("\nreference linear, bf16 [16 x 512] x [256 x 512]^T with outlier channels:")
    print(f"  {'recipe':16} {'rel. L2 error':>14} {'max err/bound':>14}")
    ok = True
    for row in demo_linear(args.seed):
        ok &= row["max_err_over_bound"] <= 1.0
        print(f"  {row['recipe']:16} {row['rel_l2']:14.3e} {row['max_err_over_bound']:14.3f}")
    print("\nevery error within its derived bound" if ok else "\nBOUND VIOLATED")
    return 0 if ok else 1
