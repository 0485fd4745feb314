"""Shapes: degenerate ones (``check_degenerate``: M, N or K = 0 and 1) and sizes past hardware limits
(``SizeProblem``, ``size_sweep``, ``size_problems``, ``check_size_limits``: rows past 65535, K
past 2**16, operands past 2**31 elements in the ``limits`` profile).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from ....registry import Backend, Case, decline_reason
from ... import strategies as fst
from ...profiles import Profile
from ..common import (
    ContractViolation,
    Declined,
    require_supported,
)
from ..linear import check_linear_bound as _linear_bound
from ..quantize import check_quantize_codes as _quantize_codes
from ..quantize import check_quantize_scale as _quantize_scale
from ..scaled_mm import check_scaled_mm_bound as _gemm_bound
from .entry import _Op, _op_of, _premise, _run
from .tensors import _light

#: Rows past the CUDA grid's y/z limit (65535), and K past 2**16.
BIG_ROWS, BIG_K = 65537, 65537


#: Elements of an operand whose last offsets lie past 2**31 (profile ``limits``).
BIG_OFFSET = 2**31 + 2**14


def _empty_args(op: _Op, args, axis: str) -> dict[str, torch.Tensor]:
    """``args`` cut to 0 along ``axis`` (M: activation rows, N: weight rows, K: columns), the
    scales cut to the scheme's scale shape of the new size."""
    p = op.problem
    out = {}
    for k, t in args.items():
        if op.name == "quantize":
            scheme = p.scheme
        else:
            scheme = p.recipe.weight if k.startswith(("b.", "w.")) else p.recipe.activation
        is_w = k.startswith(("b.", "w.")) or k == "bias"
        if k == "bias":
            out[k] = t[:0] if axis == "N" else t
            continue
        rows_cut = (axis == "M" and not is_w) or (axis == "N" and is_w)
        data_key = k.replace("scale", "data") if "." in k else "x"
        R, C = args[data_key].shape
        R2, C2 = (0 if rows_cut else R), (0 if axis == "K" else C)
        if k.endswith("scale") or k == "scale":
            sr, sc = scheme.scale_shape(R2, C2)
            out[k] = t[:sr, :sc] if t.dim() == 2 else t
        else:
            out[k] = t[:R2, :C2]
    return out


def _check_empty_sum(name: str, y: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A result at K = 0 is the empty sum: y[m, n] = bias[n] rounded to y's dtype, or 0 without a bias
    (values: a zero's sign is the summation order's). Its shape and dtype ``_run`` has checked."""
    want = torch.zeros(y.shape, dtype=torch.float64)
    if bias is not None:
        want = want + bias.to(y.dtype).to(torch.float64)
    got = y.to(torch.float64)
    bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ContractViolation(f"{name} with K = 0 returned {got[at].item()!r} at {at}: the empty sum is "
                                f"{want[at].item()!r} ({'the bias' if bias is not None else 'zero'}); raising "
                                f"ValueError or TypeError is the other accepted answer")


def check_degenerate(backend: Backend, p) -> float:
    """M, N, K = 1 (and all three): within the op's bound; M or N = 0: an empty result of the
    right shape and dtype; K = 0: a ValueError or TypeError (the spec's answer: the reduction dim
    must be at least 1), or the empty sum (scaled_mm, linear: the bias rounded to the output
    dtype, else zeros; quantize: codes of shape [rows, 0]), never another value nor another
    exception. A case the backend declines in ``supports`` is skipped."""
    op = _op_of(p)
    worst, ran = 0.0, 0
    ones = ([dict(rows=1), dict(cols=1), dict(rows=1, cols=1)] if op.name == "quantize"
            else [dict(M=1), dict(N=1), dict(K=1), dict(M=1, N=1, K=1)])
    primary = {"quantize": (_quantize_codes, _quantize_scale), "scaled_mm": (_gemm_bound,),
               "linear": (_linear_bound,)}[op.name]
    for kw in ones:
        q = replace(p, **kw)
        for check in primary:
            try:
                r = check(backend, q)
                ran += 1
                worst = max(worst, r or 0.0)
            except Declined:
                continue
            except ContractViolation as exc:
                raise ContractViolation(f"at {', '.join(f'{k}={v}' for k, v in kw.items())}: {exc}") from None
    args = _premise(backend, op)
    for axis in (("M", "K") if op.name == "quantize" else ("M", "N", "K")):
        e = _empty_args(op, args, axis)
        rows = e["x" if op.name != "scaled_mm" else "a.data"].shape[0]
        cols = e["x" if op.name != "scaled_mm" else "a.data"].shape[1]
        n = 0 if op.name == "quantize" else e["b.data" if op.name == "scaled_mm" else "w.data"].shape[0]
        case = replace(p.case(), M=rows, N=n if op.name != "quantize" else rows, K=cols)
        if decline_reason(backend, case) is not None:
            continue
        try:
            outs = _run(backend, op, e)
        except (ValueError, TypeError):
            if axis == "K":
                ran += 1
                continue
            raise
        ran += 1
        if axis == "K" and op.name != "quantize":
            _check_empty_sum(op.name, outs["y"], e.get("bias"))
    if ran == 0:
        raise Declined("supports declines every degenerate shape")
    return worst


@dataclass(frozen=True)
class SizeProblem:
    """An op problem at a size past a hardware limit: ``kind`` ``rows`` (M past 65535; quantize:
    rows), ``n`` (N past 65535), ``k`` (K past 2**16) or ``offset`` (an operand past 2**31
    elements: profile ``limits``); the other sizes of ``base`` are kept small."""

    base: Any
    kind: str

    def resized(self):
        p, k = self.base, self.kind
        if isinstance(p, fst.QuantizeProblem):
            sizes = {"rows": dict(rows=BIG_ROWS, cols=min(p.cols, 16)), "k": dict(rows=min(p.rows, 2), cols=BIG_K),
                     "offset": dict(rows=BIG_OFFSET // 16384 + 1, cols=16384)}[k]
        else:
            sizes = {"rows": dict(M=BIG_ROWS, N=min(p.N, 8), K=min(p.K, 32)),
                     "n": dict(M=min(p.M, 4), N=BIG_ROWS, K=min(p.K, 32)),
                     "k": dict(M=min(p.M, 2), N=min(p.N, 2), K=BIG_K),
                     "offset": dict(M=BIG_OFFSET // 16384 + 1, N=min(p.N, 4), K=16384)}[k]
        return replace(p, **sizes)

    def case(self) -> Case:
        return self.resized().case()

    def facets(self) -> dict:
        return {**self.resized().facets(), "size limit": {self.kind}}

    def __repr__(self) -> str:
        return f"{self.resized()!r} (size limit: {self.kind})"


#: The size limits every profile checks (from the sweep), per op.
SIZE_KINDS = {"quantize": ("rows", "k"), "scaled_mm": ("rows", "n", "k"), "linear": ("rows", "k")}


def _blocked(p) -> bool:
    """Whether a problem's scheme has groups or blocks (a program per group in a Triton kernel)."""
    schemes = (p.scheme,) if isinstance(p, fst.QuantizeProblem) else (p.recipe.activation, p.recipe.weight)
    return any(s.granularity.value in ("group", "block") for s in schemes)


def size_sweep(op: str) -> Callable[[list], list]:
    """The sweep adapter of ``<op>.size_limits``: each limit of ``SIZE_KINDS`` on two of the sweep's
    problems (the first with a per-row or per-tensor scale, the first with blocks or groups)."""
    def adapt(problems: list) -> list:
        bases = [q for q in (next((p for p in problems if not _blocked(p)), None),
                             next((p for p in problems if _blocked(p)), None)) if q is not None]
        # Past 65535 rows the reference's per-row work dominates (seconds): one problem, plain values.
        tall = [SizeProblem(_plain(bases[0]), k) for k in SIZE_KINDS[op] if k in ("rows", "n")][:len(bases)]
        return tall + [SizeProblem(b, "k") for b in bases]
    return adapt


def _plain(p):
    """``p`` with normally distributed values (the cheapest family to build and check at 65537 rows)."""
    if isinstance(p, fst.GemmProblem):
        return p
    return replace(p, x=fst.TensorSpec("normal", p.x.exp, p.x.seed))


def size_problems(op_strategy, op: str):
    """``strategy(profile, scope)`` of the search of ``<op>.size_limits``: operands past 2**31
    elements in a profile with ``huge_sizes`` (``limits``), nothing otherwise (the sweep holds
    the cheap limits)."""
    def strategy(prof: Profile, scope=None):
        if not prof.huge_sizes:
            return st.nothing()
        small = prof.with_(max_mn=min(prof.max_mn, 16), max_k=min(prof.max_k, 64))
        return st.builds(SizeProblem, op_strategy(small, scope), st.just("offset"))
    return strategy


def check_size_limits(backend: Backend, sp: SizeProblem) -> float:
    """The op's primary bound at the resized problem (the backend may decline the size in
    ``supports``). A backend that pays per element (an interpreter: ``conformance_max_elems``)
    runs only the long K of a per-row or per-tensor scheme here (a program or two): 65537 row
    programs, or 513 group programs, are the device's to run."""
    if _light(backend) and (sp.kind != "k" or _blocked(sp.base)):
        raise Declined("the backend pays per program (conformance_max_elems): 65537 rows or 513 groups run on "
                       "the device; K past 2**16 in one program runs here")
    p = sp.resized()
    require_supported(backend, p.case())
    primary = {fst.QuantizeProblem: (_quantize_codes, _quantize_scale), fst.GemmProblem: (_gemm_bound,),
               fst.LinearProblem: (_linear_bound,)}[type(p)]
    worst = 0.0
    for check in primary:
        worst = max(worst, check(backend, p) or 0.0)
    return worst
