"""Subcommands about the spec itself: ``formats`` (the code tables) and ``demo`` (the main job)."""

from __future__ import annotations

import argparse

import torch

from ..api import reference_linear
from ..spec import bounds, formats, quant, schemes


def add_parser(sub) -> None:
    p = sub.add_parser("formats", help="print the FP8 formats' constants, or all 256 codes of one")
    p.add_argument("--codes", metavar="FORMAT", help="list all 256 codes of this format")
    p.set_defaults(func=_formats)
    p = sub.add_parser("demo", help="the main job on a built-in default: backends, and the reference "
                                    "linear against its derived bound for every recipe")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo's data and of the conformance search")
    p.add_argument("--profile", default="dev", choices=("dev", "ci", "thorough"),
                   help="conformance profile for the backends (default: dev, seconds per backend; "
                        "certify a kernel with ci, the default of fp8ref conformance)")
    p.add_argument("--no-conformance", action="store_true", help="skip certifying the backends")
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


#: One line per column of the demo's conformance table.
_DEMO_COLUMNS = """\
  class      the precision class the backend's declaration puts it in: exact < strict (fp32
             accumulation, one output rounding) < standard (fp32, two roundings) < fast (any other)
  quantize, scaled_mm, linear
             worst |error| / derived bound seen by the contracts quantize.codes, scaled_mm.bound and
             linear.bound: <= 1 passes (quantize reads 1: its bound, half an FP8 step, is attained)
  acc. bits  significand bits the accumulator keeps, as the accumulator probe reads them (fp32: 24)
  time       seconds the certification of that backend took"""


#: One line per recipe preset: what it is and who uses it (the demo prints these under its table).
RECIPE_LINES = {
    "w8a8_fp8": "per-output-channel weight scales, dynamic per-token activations (SGLang --quantization w8a8_fp8)",
    "fp8": "one scale for the weight, one dynamic scale for the whole activation (SGLang/vLLM --quantization fp8)",
    "fp8_block": "128x128 weight blocks, dynamic 1x128 activation groups (DeepSeek-V3 style block FP8)",
    "fp8_dynamic": "w8a8_fp8's numbers in the compressed-tensors FP8_DYNAMIC checkpoint layout (-FP8-dynamic models)",
    "w8a8_fp8_rocm": "w8a8_fp8 in E4M3FNUZ clamped at 224 (the ROCm variant)",
    "mxfp8": "MX: 1x32 groups along K on both operands, power-of-two (E8M0) scales rounded up, E4M3",
    "mxfp8_e5m2": "mxfp8 with E5M2 elements",
    "fp8_block_ue8m0": "fp8_block with power-of-two (UE8M0) scales rounded up (DeepSeek-V3.1, DeepGEMM SM100)",
}


def _recipe_line(r) -> str:
    return f"  {r.name:16} {RECIPE_LINES.get(r.name, r.short_str())}"


def _ratio_of(report, contract: str) -> str:
    try:
        r = report.result(contract).worst_ratio
    except KeyError:
        return "-"
    return "-" if r is None else f"{r:.4f}"


def _demo(args: argparse.Namespace) -> int:
    import time

    from ..api import linear
    from ..conformance import check
    from ..registry import backends

    ok = True
    infos = backends()
    if args.no_conformance:
        print("backends on this machine:")
        for b in infos:
            print(f"  {b.name:16} [{b.precision:8}] {'available' if b.available else 'unavailable: ' + str(b.reason)}")
    else:
        print(f"conformance of every backend on this machine (profile {args.profile}, seed {args.seed}):")
        print(_DEMO_COLUMNS)
        print(f"  {'backend':16} {'class':9} {'result':8} {'quantize':>9} {'scaled_mm':>9} {'linear':>7} "
              f"{'acc. bits':>9} {'time':>7}")
        for b in infos:
            if not b.available:
                print(f"  {b.name:16} {b.precision:9} {'skipped':8} unavailable: {b.reason}")
                continue
            rep = check(b.name, profile=args.profile, seed=args.seed)
            ok &= rep.passed
            ratios = [_ratio_of(rep, c) for c in ("quantize.codes", "scaled_mm.bound", "linear.bound")]
            bits = "-" if rep.accumulator_bits is None else str(rep.accumulator_bits)
            verdict = "PASS" if rep.passed else "FAIL: " + ", ".join(r.contract for r in rep.failures)
            print(f"  {b.name:16} {b.precision:9} {verdict:8} {ratios[0]:>9} {ratios[1]:>9} {ratios[2]:>7} "
                  f"{bits:>9} {rep.seconds:6.1f}s")
    print("\nreference linear, bf16 [16 x 512] x [256 x 512]^T with outlier channels, vs the float64 linear")
    print("  (max err/bound: the largest |error| / derived bound over the outputs; <= 1 means within the bound):")
    print("  recipes:")
    for r in schemes.RECIPES.values():
        print(_recipe_line(r))
    print(f"  {'recipe':16} {'rel. L2 error':>14} {'max err/bound':>14}")
    for row in demo_linear(args.seed):
        ok &= row["max_err_over_bound"] <= 1.0
        print(f"  {row['recipe']:16} {row['rel_l2']:14.3e} {row['max_err_over_bound']:14.3f}")
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(16, 1024, generator=g).to(torch.bfloat16)
    w = (torch.randn(1024, 1024, generator=g) / 32).to(torch.bfloat16)
    t0 = time.perf_counter()
    y = linear(x, w)
    t1 = time.perf_counter()
    from .. import explain

    chosen = explain(x, w).chosen
    rel = float((y.double() - x.double() @ w.double().T).norm() / (x.double() @ w.double().T).norm())
    print(f"\nfp8ref.linear(x[16, 1024], w[1024, 1024], backend='auto') chose {chosen!r} "
          f"(first call incl. selection {t1 - t0:.2f} s); relative L2 error vs bf16-exact {rel:.3e}")
    print("\nall checks passed" if ok else "\nSOMETHING FAILED (see above)")
    return 0 if ok else 1
