"""Special values (``check_non_finite``): NaN and +-Inf in each kind of input against the backend's
declared ``NonFinite`` (undeclared: a ValueError or propagation), and finite results past the output
dtype's range (+-Inf, never a finite stand-in).
"""

from __future__ import annotations

import math

import torch

from ....registry import PROPAGATE, RAISE, Backend, non_finite_policy
from ....spec import gemm, layouts, quant
from ....spec.bounds import gemm_error_bound
from ....spec.quant import Quantized
from ..common import (
    ContractViolation,
    check_within,
)
from .entry import _clones, _Op, _op_of, _premise, _run


def _nonfinite_values(dtype: torch.dtype) -> tuple[tuple[str, int | float], ...]:
    """``(label, value)`` pairs of NaN and the infinities a tensor of ``dtype`` can hold; for FP8 the
    value is the code's byte (every format has a NaN code; E5M2 also has +-Inf)."""
    if dtype.itemsize != 1:
        return (("nan", math.nan), ("+inf", math.inf), ("-inf", -math.inf))
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    out = []
    for label, hit in (("nan", torch.isnan(vals)), ("+inf", vals == math.inf), ("-inf", vals == -math.inf)):
        if bool(hit.any()):
            out.append((label, int(hit.nonzero()[0])))
    return tuple(out)


def _kind(arg: str) -> str:
    """The ``NonFinite`` field that governs argument ``arg``."""
    if arg == "x" or arg == "bias":
        return arg
    if arg == "scale":
        return "static_scale"
    return "codes" if arg.endswith(".data") else "scales"


def _affected(op: _Op, args, arg: str, idx: tuple[int, ...]) -> torch.Tensor:
    """Where the outputs must be non-finite when ``args[arg][idx]`` is (the mask of the output
    quantize: dequantized values; others: y)."""
    p = op.problem
    if op.name == "quantize":
        x = args["x"]
        mask = torch.zeros(x.shape, dtype=torch.bool)
        if arg == "x":
            mask[idx] = True
        else:  # a static scale's block
            r, c = p.scheme.block_shape(*x.shape)
            mask[idx[0] * r:(idx[0] + 1) * r, idx[1] * c:(idx[1] + 1) * c] = True
        return mask
    a_rows = args["a.data" if op.name == "scaled_mm" else "x"].shape[0]
    w_key = "b" if op.name == "scaled_mm" else "w"
    n_rows = args[f"{w_key}.data"].shape[0]
    mask = torch.zeros(a_rows, n_rows, dtype=torch.bool)
    a_scheme = p.recipe.activation
    w_scheme = p.recipe.weight
    K = args[f"{w_key}.data"].shape[1]
    if arg in ("a.data", "x"):
        mask[idx[0]] = True
    elif arg in ("a.scale", "scale"):
        r, _ = a_scheme.block_shape(a_rows, K)
        mask[idx[0] * r:(idx[0] + 1) * r] = True
    elif arg == f"{w_key}.data":
        mask[:, idx[0]] = True
    elif arg == f"{w_key}.scale":
        r, _ = w_scheme.block_shape(n_rows, K)
        mask[:, idx[0] * r:(idx[0] + 1) * r] = True
    elif arg == "bias":
        mask[:, idx[0]] = True
    return mask


def _e8m0_held(backend: Backend, arg: str) -> bool:
    """Whether ``arg`` is a scale operand the backend takes as E8M0 bytes (``Backend.scale_layout``)."""
    role = {"a.scale": "activation", "b.scale": "weight"}.get(arg)
    return role is not None and getattr(backend.scale_layout, role) in layouts.E8M0_LAYOUTS


def _site(t: torch.Tensor) -> tuple[int, ...]:
    """Where the non-finite value goes: the last row and column, so a kernel that skips the tail of
    a tile or the last block is seen (the sweep's other contracts cover the first ones)."""
    return tuple(s - 1 for s in t.shape)


def _spoiled(t: torch.Tensor, idx, v: int | float) -> torch.Tensor:
    t = t.clone()
    if t.element_size() == 1:  # FP8: the code's byte (a cast would saturate an Inf)
        t.view(torch.uint8)[idx] = v
    else:
        t[idx] = v
    return t


def check_non_finite(backend: Backend, p) -> float | None:
    """NaN and +-Inf in each argument in turn (FP8 operands: the format's NaN/Inf codes). Undeclared
    (``NonFinite`` field None), a ValueError and propagation are both accepted; a declaration
    (``non_finite_policy``: ``Backend.non_finite``, and ``rejects_non_finite`` for x and bias)
    accepts its one answer. Propagating means non-finite values wherever the output depends on the
    spoiled element; a finite value there is the defect, declared or not. scaled_mm and linear also
    get finite operands whose exact result passes the output dtype's range: +-Inf there (round to
    nearest), never a finite stand-in."""
    op = _op_of(p)
    args = _premise(backend, op)
    declared = non_finite_policy(backend)
    for arg, t in args.items():
        if t.numel() == 0 or (op.name == "linear" and arg.startswith("w.")):
            continue  # linear's weight reaches the backend through prepare_weight: scaled_mm's contract
        policy = getattr(declared, _kind(arg))
        for label, v in _nonfinite_values(t.dtype):
            if label != "nan" and _e8m0_held(backend, arg):
                continue  # E8M0 has a NaN byte and no infinity: a kernel reading such scales never meets one
            idx = _site(t)
            spoiled = {**_clones(args), arg: _spoiled(t, idx, v)}
            what = (f"{arg}[{', '.join(map(str, idx))}] = {label} (non_finite.{_kind(arg)} "
                    f"{'declared ' + repr(policy) if policy else 'not declared: ValueError or propagation'})")
            try:
                outs = _run(backend, op, spoiled)
            except ValueError:
                if policy != PROPAGATE:
                    continue
                raise ContractViolation(f"{what}: raised ValueError") from None
            if policy == RAISE:
                raise ContractViolation(f"{what}: returned instead of raising ValueError")
            mask = _affected(op, spoiled, arg, idx)
            if op.name == "quantize":
                o = quant.dequantize(Quantized(outs["data"], outs["scale"], p.scheme), torch.float64)
            else:
                o = outs["y"].to(torch.float64)
            finite = torch.isfinite(o) & mask
            if bool(finite.any()):
                at = tuple(int(i) for i in finite.nonzero()[0])
                raise ContractViolation(f"{what}: {int(finite.sum())} of {int(mask.sum())} outputs computed from it "
                                        f"are finite (first at {at}: {o[at].item()!r}): a finite value stands in "
                                        f"for a non-finite one")
    if op.name != "quantize":
        return _check_overflow(backend, op, args)
    return None


def _abs(q: Quantized) -> Quantized:
    return Quantized(q.data.to(torch.float32).abs().to(q.data.dtype), q.scale.abs(), q.scheme)


def _check_overflow(backend: Backend, op: _Op, args) -> float | None:
    """Both operands' scales multiplied by powers of two so that the exact result's largest
    magnitude is 8x the output dtype's maximum: where |y| - bound exceeds the
    rounding threshold the output is +-Inf with y's sign; where |y| + bound stays below the maximum
    (and the terms' absolute sum within fp32's range), finite and within the bound."""
    p = op.problem
    if op.name == "linear":
        return None  # linear's activation scale is the backend's own: the GEMM's operands are scaled_mm's
    a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
    b = op.weight(args)
    y64 = gemm.scaled_mm(a, b, None, out_dtype=torch.float64)
    big = float(y64.abs().max()) if y64.numel() else 0.0
    oi = torch.finfo(p.out_dtype)
    if big == 0.0:
        return None
    k = math.ceil(math.log2(8 * oi.max / big))
    # Half of k on each operand's scales: an fp32 kernel's (acc * sa) * sb then overflows only
    # where the result itself does.
    room_a = math.floor(math.log2(torch.finfo(a.scale.dtype).max / float(a.scale.abs().max()))) - 1
    room_b = math.floor(math.log2(torch.finfo(b.scale.dtype).max / float(b.scale.abs().max()))) - 1
    ka = min(k - k // 2, room_a)
    kb = k - ka
    if kb > room_b:
        return None  # the scale dtypes cannot reach past the output's range
    a2 = Quantized(a.data, a.scale * 2.0**ka, a.scheme)
    b2 = Quantized(b.data, b.scale * 2.0**kb, b.scheme)
    bias = args.get("bias")
    y64 = gemm.scaled_mm(a2, b2, bias, out_dtype=torch.float64)
    bound = gemm_error_bound(a2, b2, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                             output_roundings=backend.output_roundings, y_ref=y64)
    over = oi.max + 2.0 ** (math.frexp(oi.max)[1] - 1) * oi.eps / 2  # max + ulp(max)/2: rounds to Inf
    new = {**_clones(args), "a.scale": a2.scale, "b.scale": b2.scale}
    y = _run(backend, op, new)["y"].to(torch.float64)
    must_inf = (y64.abs() - bound) > over
    # Where the terms' absolute sum passes fp32's range, an fp32 accumulator's partial sums can
    # overflow to either infinity before the terms of the other sign come (or meet both: NaN): any
    # non-finite value is allowed there, never a finite one.
    mass = gemm.scaled_mm(_abs(a2), _abs(b2), None, out_dtype=torch.float64)
    nan_ok = mass > torch.finfo(torch.float32).max
    wrong = must_inf & (y != torch.sign(y64) * math.inf) & ~(nan_ok & ~torch.isfinite(y))
    if bool(wrong.any()):
        at = tuple(int(i) for i in wrong.nonzero()[0])
        raise ContractViolation(f"exact result {y64[at].item():.6g} lies past {p.out_dtype}'s range (max {oi.max:g}) "
                                f"by more than the bound, got {y[at].item()!r} at {at}: must be "
                                f"{'+' if y64[at] > 0 else '-'}Inf (round to nearest; any non-finite value where the "
                                f"terms' absolute sum passes fp32's range), never a finite stand-in")
    # Below the maximum the bound holds only where no fp32 partial sum can overflow (the mass within
    # fp32's range): there the output is finite and within the bound.
    inside = ((y64.abs() + bound) < oi.max) & ~nan_ok
    if bool(inside.any()):
        return check_within(f"scaled_mm with results near {p.out_dtype}'s maximum", torch.where(inside, y, 0.0),
                             torch.where(inside, y64, 0.0), torch.where(inside, bound, 0.0))
    return None
