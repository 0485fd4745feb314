"""Certify one peer: the conformance contracts on the schemes it computes, plus the measurements
the certification matrix reports (expressible schemes, bit-exactness, non-finite inputs).

The contracts run through the conformance driver (``fp8ref.conformance.check``) with the peer's
``adaptation``: its problems pass through ``Peer.map_problem`` (a peer's legitimate scale
conventions filled in, docs/spec.md §3.1) -- never its defects -- and a failure's reproduce line is
an ``fp8ref certify`` command, which works for these unregistered backends. What stays here is
peer-specific: the adaptation, and the measurements below.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from ..conformance import Report
from ..conformance import strategies as fst
from ..conformance.contracts import CALLING_CONTRACT_NAMES, CONTRACTS
from ..conformance.driver import Adaptation, check
from ..registry import Case, decline_reason
from ..spec import gemm, quant
from ..spec.schemes import RECIPES, QuantScheme, Recipe
from ._base import Peer

__all__ = ["Certificate", "certify_peer", "adaptation", "run_contracts", "expressible", "bit_exactness",
           "non_finite_behaviour"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class Certificate:
    """What ``fp8ref certify`` records for one peer (JSON-serialisable through ``to_dict``)."""

    peer: str
    project: str
    version: str | None
    entry: str
    notes: str
    ops: list[str]
    declaration: str
    report: Report
    expressible: str = ""
    exact_label: str = ""
    exact_codes: float | None = None
    exact_scales: float | None = None
    exact_outputs: float | None = None
    exact_samples: int = 0
    non_finite: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["report"] = self.report.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Certificate:
        d = dict(d)
        d["report"] = Report.from_dict(d["report"])
        return cls(**d)


def adaptation(peer: Peer) -> Adaptation:
    """What certifying ``peer`` changes in the driver's run: its problems pass through
    ``peer.map_problem`` (its legitimate conventions, never its defects) and a failure reproduces
    through ``fp8ref certify``, which reaches these unregistered backends."""
    return Adaptation(map_problem=peer.map_problem,
                      reproduce=lambda profile, seed, contract: _reproduce(peer, profile, seed, contract))


def _reproduce(peer: Peer, profile: str, seed: int, contract: str) -> str:
    return f"fp8ref certify --peer {peer.name} --profile {profile} --seed {seed} --only {contract}"


def run_contracts(peer: Peer, profile="ci", seed: int | None = None, contracts: Sequence[str] | None = None,
                  known_failures: Iterable[dict] | None = None,
                  on_contract: Callable[[str], None] | None = None) -> Report:
    """The peer's conformance report over ``contracts`` (default: all but the calling contract's),
    ledger applied: the driver's ``check`` with the peer's ``adaptation``.

    The calling contract (docs/spec.md §3.4) is not applied to peers by default: a peer's adapter
    copies and re-lays out the operands (so layout, aliasing and lifetime would judge the adapter).
    Its special values no longer need a declared ``NonFinite`` (undeclared, a ValueError and
    propagation both pass: docs/conformance.md, "Defects, and what a declaration changes"), but no
    peer's recorded verdict has run them yet."""
    if contracts is None:
        contracts = tuple(c.name for c in CONTRACTS if c.name not in CALLING_CONTRACT_NAMES)
    return check(peer, profile, seed, contracts=contracts, known_failures=known_failures, schemes=peer.recipes,
                 adapt=adaptation(peer), on_contract=on_contract)


# ------------------------------------------------------------------------------------------------
# what the peer can express


def _candidate_schemes() -> list[QuantScheme]:
    out = []
    for fmt in ("e4m3fn", "e5m2", "e4m3fnuz"):
        for gran in ({"granularity": "tensor"}, {"granularity": "row"}, {"granularity": "group", "group_size": 32},
                     {"granularity": "group", "group_size": 128}, {"granularity": "block", "block": (128, 128)}):
            for floor in (1e-12, 0.0):
                for pow2 in (False, True):
                    out.append(QuantScheme(format=fmt, amax_floor=floor, pow2_scale=pow2, **gran))
    return out


def _gran(s: QuantScheme) -> str:
    if s.granularity.value == "group":
        return f"group{s.group_size}"
    if s.granularity.value == "block":
        return f"block{s.block[0]}x{s.block[1]}"
    return s.granularity.value


def _conventions(s: QuantScheme) -> list[str]:
    """The non-default scale conventions of a scheme, in words (docs/spec.md §3.1)."""
    out = []
    if s.scale_compute_dtype != torch.float32:
        out.append(f"scale computed in {_DT[s.scale_compute_dtype]}")
    if s.scale_dtype != torch.float32:
        out.append(f"scale stored in {_DT[s.scale_dtype]}")
    if s.zero_scale != 1.0:
        out.append(f"zero-block scale {s.zero_scale:g}")
    if s.subnormal_scales:
        out.append("subnormal scales kept")
    if s.reciprocal_scale:
        out.append("scale 1/(qmax/amax)")
    if s.multiply_codes:
        out.append("codes x*m")
    if s.multiplier_scale:
        out.append("multiplier stored")
    return out


def _accepted_quantize(peer: Peer, rows: int = 128, cols: int = 256) -> list[tuple[QuantScheme, torch.dtype]]:
    out = []
    for base in _candidate_schemes():
        for dt in _X_DTYPES:
            s = peer.conventions(base, dt)
            case = Case(rows, rows, cols, Recipe("quantize", s, s), dt, op="quantize")
            if decline_reason(peer, case) is None:
                out.append((s, dt))
    return out


def _candidate_recipes() -> list[Recipe]:
    group64 = Recipe("block64", QuantScheme(granularity="block", block=(64, 64)),
                     QuantScheme(granularity="group", group_size=64))
    # The presets a peer's scope was first claimed from: the pow2 presets added later (mxfp8,
    # mxfp8_e5m2, fp8_block_ue8m0) reach every peer through the corner sweep's recipe section, and
    # widening a recorded claim would change certificates that were never re-run on them.
    return [r for r in RECIPES.values() if not (r.weight.pow2_scale or r.activation.pow2_scale)] + [group64]


def _accepted_gemm(peer: Peer) -> list[tuple[Recipe, torch.dtype, bool]]:
    out = []
    for base in _candidate_recipes():
        problem = fst.GemmProblem(32, 128, 256, base, torch.bfloat16, fst.CodeSpec(), fst.CodeSpec())
        recipe = peer.map_problem(problem).recipe
        for od in _X_DTYPES:
            for bias in (False, True):
                case = Case(32, 128, 256, recipe, torch.bfloat16, od, has_bias=bias, op="scaled_mm")
                if decline_reason(peer, case) is None:
                    out.append((recipe, od, bias))
    return out


def expressible(peer: Peer) -> str:
    """A compact summary of the schemes (or recipes) the peer takes, with its conventions applied."""
    parts = []
    if "quantize" in peer.ops:
        acc = _accepted_quantize(peer)
        if not acc:
            return "none of the candidate schemes"
        fmts = sorted({s.format.name for s, _ in acc})
        grans = sorted({_gran(s) for s, _ in acc}, key=lambda g: ("tensor", "row").index(g) if g in ("tensor", "row")
                       else 2)
        floors = sorted({f"{s.amax_floor:g}" for s, _ in acc})
        conv = sorted({c for s, _ in acc for c in _conventions(s)})
        dts = [_DT[d] for d in _X_DTYPES if any(dt == d for _, dt in acc)]
        parts.append(f"{', '.join(fmts)}; {', '.join(grans)}; amax floor {', '.join(floors)}; "
                     f"{'pow2 scales ok; ' if any(s.pow2_scale for s, _ in acc) else ''}x {', '.join(dts)}"
                     + (f"; conventions: {', '.join(conv)}" if conv else ""))
    if "scaled_mm" in peer.ops:
        acc = _accepted_gemm(peer)
        if not acc:
            parts.append("none of the candidate recipes")
        else:
            recipes = sorted({r.name for r, _, _ in acc})
            outs = [_DT[d] for d in _X_DTYPES if any(od == d for _, od, _ in acc)]
            bias = "bias" if any(b for _, _, b in acc) else "no bias"
            parts.append(f"GEMM: {', '.join(recipes)}; out {', '.join(outs)}; {bias}")
    if peer.ops == ("linear",):
        acc = _accepted_linear(peer)
        if not acc:
            parts.append("none of the candidate recipes")
        else:
            recipes = sorted({p.recipe.name for p in acc})
            xs = [_DT[d] for d in _X_DTYPES if any(p.x_dtype == d for p in acc)]
            outs = [_DT[d] for d in _X_DTYPES if any(p.out_dtype == d for p in acc)]
            conv = sorted({c for p in acc for s in (p.recipe.weight, p.recipe.activation) for c in _conventions(s)})
            bias = "bias" if any(p.has_bias for p in acc) else "no bias"
            parts.append(f"linear: {', '.join(recipes)}; x {', '.join(xs)}; out {', '.join(outs)}; {bias}"
                         + (f"; conventions: {', '.join(conv)}" if conv else ""))
    return " / ".join(parts)


def _accepted_linear(peer: Peer, M: int = 32, N: int = 128, K: int = 256,
                     specs: tuple[fst.TensorSpec, fst.TensorSpec] = (fst.TensorSpec(), fst.TensorSpec())
                     ) -> list[fst.LinearProblem]:
    """The linear problems (candidate recipe x input dtype x output dtype x bias) a linear-only peer
    takes, its conventions applied."""
    out = []
    for base in _candidate_recipes():
        for dt in _X_DTYPES:
            for od in _X_DTYPES:
                for bias in (False, True):
                    p = peer.map_problem(fst.LinearProblem(M, N, K, base, dt, od, *specs, has_bias=bias))
                    if decline_reason(peer, p.case()) is None:
                        out.append(p)
    return out


# ------------------------------------------------------------------------------------------------
# bit-exactness against the reference on a fixed corpus


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bit_exactness(peer: Peer, budget_s: float = 60.0) -> tuple[str, float | None, float | None, float | None, int]:
    """(label, codes %, scales %, outputs %, elements compared): the peer's results bit for bit
    against the reference's on a fixed corpus of the schemes it takes (normal, outlier, heavy-tailed
    and tie-valued inputs; bf16, fp16, fp32), its conventions applied."""
    t0 = time.perf_counter()
    if "quantize" in peer.ops:
        same_c = tot_c = same_s = tot_s = 0
        rows, cols = (4, 128) if peer.conformance_max_elems else (32, 256)
        seen = set()
        for scheme, dt in _accepted_quantize(peer, rows, cols):
            key = (scheme, dt)
            if key in seen:
                continue
            seen.add(key)
            for fam, exp in (("normal", 0), ("outliers", 0), ("heavy", -4), ("ties", 0)):
                if time.perf_counter() - t0 > budget_s:
                    break
                x = fst.make_tensor(fst.TensorSpec(fam, exp, 7), rows, cols, dt, scheme)
                try:
                    ref = quant.quantize(x, scheme)
                    got = peer.quantize(x, scheme)
                except Exception:
                    continue
                same_c += int((_bits(got.data) == _bits(ref.data)).sum())
                tot_c += ref.data.numel()
                same_s += int((_bits(got.scale) == _bits(ref.scale)).sum())
                tot_s += ref.scale.numel()
        if not tot_c:
            return "codes, scales", None, None, None, 0
        return "codes, scales", 100 * same_c / tot_c, 100 * same_s / tot_s, None, tot_c
    M, N, K = (16, 32, 256) if peer.conformance_max_elems else (32, 128, 256)
    if peer.ops == ("linear",):
        return _linear_bit_exactness(peer, M, N, K, t0, budget_s)
    same = tot = 0
    for recipe, od, bias in _accepted_gemm(peer):
        if time.perf_counter() - t0 > budget_s:
            break
        for fam_seed in range(2):
            p = fst.GemmProblem(M, N, K, recipe, od, fst.CodeSpec("bits", fam_seed, -9, False),
                                fst.CodeSpec("bits", fam_seed + 10, -9, False), bias, fam_seed)
            a, b, bv = p.build()
            try:
                y = peer.scaled_mm(a, peer.prepare_weight(b), bv, od)
            except Exception:
                continue
            ref = gemm.scaled_mm(a, b, bv, od)
            same += int((_bits(y) == _bits(ref)).sum())
            tot += ref.numel()
    if not tot:
        return "outputs", None, None, None, 0
    return "outputs", None, None, 100 * same / tot, tot


def _linear_bit_exactness(peer: Peer, M: int, N: int, K: int, t0: float, budget_s: float):
    """A linear-only peer's outputs against the reference linear (the spec's quantization of x and w,
    then its scaled_mm) on normal, outlier and heavy-tailed inputs."""
    same = tot = 0
    for base in _accepted_linear(peer, M, N, K):
        for fam, exp in (("normal", 0), ("outliers", 0), ("heavy", -4)):
            if time.perf_counter() - t0 > budget_s:
                break
            p = replace(base, x=fst.TensorSpec(fam, exp, 7), w=fst.TensorSpec(fam, exp, 8))
            x, w, bias = p.build()
            try:
                y = peer.linear(x, peer.prepare_weight(w), bias, p.out_dtype, p.recipe.activation)
            except Exception:
                continue
            qx, qw = quant.quantize(x, p.recipe.activation), quant.quantize(w, p.recipe.weight)
            ref = gemm.scaled_mm(qx, qw, bias, p.out_dtype)
            same += int((_bits(y) == _bits(ref)).sum())
            tot += ref.numel()
    if not tot:
        return "outputs", None, None, None, 0
    return "outputs", None, None, 100 * same / tot, tot


# ------------------------------------------------------------------------------------------------
# non-finite inputs


def _describe(t: torch.Tensor) -> str:
    v = t.to(torch.float32)
    n_nan, n_inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
    bits = []
    if n_nan:
        bits.append(f"{n_nan} NaN")
    if n_inf:
        bits.append(f"{n_inf} Inf")
    return ", ".join(bits) or "finite"


def non_finite_behaviour(peer: Peer) -> str:
    """What the peer does with a NaN and an Inf in its input (the spec raises ValueError): for a
    quantizer, one NaN in row 0 and one +Inf in row 2 of a [4, 128] bf16 tensor; for a GEMM, an FP8
    NaN code at a[0, 0] (formats with one)."""
    if "quantize" in peer.ops:
        acc = [(s, dt) for s, dt in _accepted_quantize(peer, 4, 128)]
        acc.sort(key=lambda p: (p[0].granularity.value != "row", p[1] != torch.bfloat16))
        if not acc:
            return "n/a"
        scheme, dt = acc[0]
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).to(dt)
        x[0, 3] = float("nan")
        x[2, 5] = float("inf")
        try:
            q = peer.quantize(x, scheme)
        except Exception as exc:
            return f"raises {type(exc).__name__}"
        rows = []
        for i, what in ((0, "NaN row"), (2, "Inf row"), (1, "clean row")):
            r0, r1 = (i, i + 1) if q.scale.shape[0] > 1 else (0, 1)
            codes = _describe(q.data[i].to(torch.float32))
            rows.append(f"{what}: scale {_describe(q.scale[r0:r1])}, codes {codes}")
        return f"[{scheme.short_str()}, {_DT[dt]}] " + "; ".join(rows)
    if peer.ops == ("linear",):
        return _linear_non_finite(peer)
    for recipe, od, _ in _accepted_gemm(peer):
        fmt = recipe.activation.format
        if not fmt.nan_codes:
            continue
        p = fst.GemmProblem(4, 16, 64, recipe, od, fst.CodeSpec("bits", 1, -9, True), fst.CodeSpec("bits", 2, -9, True))
        a, b, _ = p.build()
        data = a.data.view(torch.uint8).clone()
        data[0, 0] = fmt.nan_codes[0]
        a = quant.Quantized(data.view(a.data.dtype), a.scale, a.scheme)
        try:
            y = peer.scaled_mm(a, peer.prepare_weight(b), None, od)
        except Exception as exc:
            return f"NaN code: raises {type(exc).__name__}"
        row0, rest = int(torch.isnan(y[0].float()).sum()), int(torch.isnan(y[1:].float()).sum())
        return f"NaN code at a[0,0] ({recipe.name}): {row0}/{y.shape[1]} NaN in row 0, {rest} NaN elsewhere"
    return "n/a"


def _linear_non_finite(peer: Peer) -> str:
    """A linear-only peer's output rows for one NaN in row 0 and one +Inf in row 2 of x [4, 128]."""
    acc = sorted(_accepted_linear(peer, 4, 16, 128), key=lambda p: (p.has_bias, p.x_dtype != torch.bfloat16))
    if not acc:
        return "n/a"
    p = acc[0]
    x, w, bias = p.build()
    x = x.clone()
    x[0, 3] = float("nan")
    x[2, 5] = float("inf")
    try:
        y = peer.linear(x, peer.prepare_weight(w), bias, p.out_dtype, p.recipe.activation)
    except Exception as exc:
        return f"raises {type(exc).__name__}"
    rows = [f"{what}: y {_describe(y[i])}" for i, what in ((0, "NaN row"), (2, "Inf row"), (1, "clean row"))]
    return f"[{p.recipe.name}, x {_DT[p.x_dtype]}] " + "; ".join(rows)


# ------------------------------------------------------------------------------------------------


def certify_peer(peer: Peer, profile="ci", seed: int | None = None, contracts: Sequence[str] | None = None,
                 known_failures: Iterable[dict] | None = None,
                 on_contract: Callable[[str], None] | None = None, measure: bool = True) -> Certificate:
    """The peer's certificate: contracts (ledger applied) and, if it is available and ``measure``,
    the matrix's measurements."""
    t0 = time.perf_counter()
    report = run_contracts(peer, profile, seed, contracts, known_failures, on_contract)
    acc = peer.accumulation
    decl = f"{acc.name} accumulation, {peer.output_roundings} output rounding(s) [{peer.precision.value}]"
    cert = Certificate(peer.name, peer.project, peer.version, peer.entry, peer.notes, list(peer.ops), decl, report)
    if report.available and measure:
        cert.expressible = expressible(peer)
        label, c, s, o, n = bit_exactness(peer)
        cert.exact_label, cert.exact_codes, cert.exact_scales = label, c, s
        cert.exact_outputs, cert.exact_samples = o, n
        cert.non_finite = non_finite_behaviour(peer)
    cert.seconds = time.perf_counter() - t0
    return cert


def fmt_pct(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v == 100:
        return "100"
    return f"{math.floor(v * 100) / 100:.2f}"
