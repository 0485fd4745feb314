"""The entry points as named arguments in, named outputs out (``_Op``): the problem's arguments,
the call (``prepare_weight`` first for scaled_mm and linear), the spec's judgement of an output on
the given values, and the premises (inputs the spec refuses are declined, never the backend's fault).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ....registry import Backend
from ....spec import gemm, quant
from ....spec.bounds import (
    conforming_quantization_error_bound,
    gemm_error_bound,
    linear_error_bound,
    scale_error_bound,
)
from ....spec.quant import Quantized
from ... import strategies as fst
from ..common import (
    ContractViolation,
    Declined,
    backend_threads,
    check_within,
    first_diff,
    from_backend_layout,
    poison_allocator,
    require_supported,
    same_bits,
    spec_quantize,
    to_backend_layout,
)
from ..linear import _backend_linear


@dataclass(frozen=True)
class _Op:
    """One entry point with its problem: ``args()`` builds the named argument tensors, ``call``
    runs the backend on them (returning named outputs and the prepared weight, if any), ``spec``
    judges an output against the spec on the given argument values (ratio or ContractViolation)."""

    name: str
    problem: Any

    def args(self) -> dict[str, torch.Tensor]:
        p = self.problem
        if self.name == "quantize":
            x = p.build()
            s = p.scale(x)
            return {"x": x} if s is None else {"x": x, "scale": s}
        if self.name == "scaled_mm":
            a, b, bias = p.build()
            out = {"a.data": a.data, "a.scale": a.scale, "b.data": b.data, "b.scale": b.scale}
            return out if bias is None else {**out, "bias": bias}
        x, w, bias = p.build()
        qw = spec_quantize(w, p.recipe.weight)
        out = {"x": x, "w.data": qw.data, "w.scale": qw.scale}
        if bias is not None:
            out["bias"] = bias
        s = p.act_scale(x)
        return out if s is None else {**out, "scale": s}

    def weight(self, args) -> Quantized | None:
        """The weight operand (the one ``prepare_weight`` takes), None for quantize."""
        if self.name == "scaled_mm":
            return Quantized(args["b.data"], args["b.scale"], self.problem.recipe.weight)
        if self.name == "linear":
            return Quantized(args["w.data"], args["w.scale"], self.problem.recipe.weight)
        return None

    def call(self, backend: Backend, args, weight: Quantized | None = None,
             prepared_hook: Callable[[Any], None] | None = None) -> dict[str, torch.Tensor]:
        """Run the entry point on ``args`` (the weight object ``weight`` if given, so that a caller
        can hand the same object again); ``prepared_hook(prepared)`` sees the prepared weight."""
        p = self.problem
        if self.name == "quantize":
            q = backend.quantize(args["x"], p.scheme) if "scale" not in args else backend.quantize(
                args["x"], p.scheme, scale=args["scale"])
            q = from_backend_layout(backend, q, "activation")
            if not isinstance(q, Quantized):
                raise ContractViolation(f"quantize returned {type(q).__name__}, not an fp8ref.Quantized")
            return {"data": q.data, "scale": q.scale}
        if backend.float_weight:
            raise Declined(f"premise: backend {backend.name!r} takes the float weight (float_weight); the calling "
                           "contract hands prepare_weight the spec's quantized weight")
        w = weight if weight is not None else self.weight(args)
        prepared = backend.prepare_weight(to_backend_layout(backend, w, "weight"))
        if prepared_hook is not None:
            prepared_hook(prepared)
        if self.name == "scaled_mm":
            a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
            a = to_backend_layout(backend, a, "activation")
            y = backend.scaled_mm(a, prepared, args.get("bias"), p.out_dtype)
        else:
            y = _backend_linear(backend, args["x"], prepared, args.get("bias"), p.out_dtype, p.recipe.activation,
                                args.get("scale"))
        if not isinstance(y, torch.Tensor):
            raise ContractViolation(f"{self.name} returned {type(y).__name__}, not a tensor")
        return {"y": y}

    def out_shape_ok(self, args, outs) -> str | None:
        p = self.problem
        if self.name == "quantize":
            x = args["x"]
            if tuple(outs["data"].shape) != tuple(x.shape):
                return f"quantize returned data of shape {tuple(outs['data'].shape)} for x {tuple(x.shape)}"
            return None
        M = args["a.data" if self.name == "scaled_mm" else "x"].shape[0]
        N = args["b.data" if self.name == "scaled_mm" else "w.data"].shape[0]
        y = outs["y"]
        if tuple(y.shape) != (M, N) or y.dtype != p.out_dtype:
            return f"{self.name} returned {tuple(y.shape)} {y.dtype}, expected ({M}, {N}) {p.out_dtype}"
        return None

    def spec(self, backend: Backend, args, outs) -> float:
        """The output judged against the spec on these argument values (contiguous copies)."""
        p = self.problem
        c = {k: v.contiguous() for k, v in args.items()}
        if self.name == "quantize":
            x, s = c["x"], c.get("scale")
            ref = spec_quantize(x, p.scheme, s)
            q = Quantized(outs["data"], outs["scale"], p.scheme)
            # quantize.scale's rule: the caller's scale bit for bit, a dynamic one within scale_error_bound
            check_within("scale", q.scale, ref.scale, scale_error_bound(ref.scale, p.scheme),
                          dtype=ref.scale.dtype if s is not None else None)
            deq = quant.dequantize(q, torch.float64)
            # the spec's bound (its scale, widened to what quantize.scale admits), never the backend's
            return check_within("dequantized value vs x (conforming_quantization_error_bound)", deq,
                                 x.to(torch.float64), conforming_quantization_error_bound(x, ref))
        if self.name == "scaled_mm":
            a = Quantized(c["a.data"], c["a.scale"], p.recipe.activation)
            b = Quantized(c["b.data"], c["b.scale"], p.recipe.weight)
            y64 = gemm.scaled_mm(a, b, c.get("bias"), out_dtype=torch.float64)
            bound = gemm_error_bound(a, b, c.get("bias"), out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                     output_roundings=backend.output_roundings, y_ref=y64)
            return check_within("scaled_mm vs reference (gemm_error_bound)", outs["y"], y64, bound)
        x, bias, s = c["x"], c.get("bias"), c.get("scale")
        qw = Quantized(c["w.data"], c["w.scale"], p.recipe.weight)
        qx = spec_quantize(x, p.recipe.activation, s)
        w = quant.dequantize(qw, torch.float64)  # the unquantized weight is the one these codes are exact for
        y_true = x.to(torch.float64) @ w.T + (0 if bias is None else bias.to(torch.float64))
        bound = linear_error_bound(x, w, qx, qw, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                   output_roundings=backend.output_roundings)
        return check_within("linear vs float64 linear (linear_error_bound)", outs["y"], y_true, bound)


def _op_of(p) -> _Op:
    if isinstance(p, fst.QuantizeProblem):
        return _Op("quantize", p)
    if isinstance(p, fst.GemmProblem):
        return _Op("scaled_mm", p)
    return _Op("linear", p)


def _premise(backend: Backend, op: _Op) -> dict[str, torch.Tensor]:
    """The problem's arguments, after the backend's ``supports`` and the spec's own refusals (an
    input the spec rejects is never the backend's fault)."""
    require_supported(backend, op.problem.case())
    try:
        args = op.args()
    except ValueError as exc:  # building a bias that cancels row 0 quantizes with the spec, which may refuse
        raise Declined(f"reference refuses the input: {exc}") from None
    p = op.problem
    if op.name == "quantize":
        spec_quantize(args["x"], p.scheme, args.get("scale"))
    elif op.name == "linear":
        spec_quantize(args["x"], p.recipe.activation, args.get("scale"))
        limit = torch.finfo(p.out_dtype).max / 4
        y = quant.dequantize(op.weight(args), torch.float64)
        if bool(((args["x"].to(torch.float64) @ y.T).abs() > limit).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
    else:
        a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
        y64 = gemm.scaled_mm(a, op.weight(args), args.get("bias"), out_dtype=torch.float64)
        if not bool(torch.isfinite(y64).all()) or bool((y64.abs() > torch.finfo(p.out_dtype).max / 2).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
    return args


def _premise_values(op: _Op, args) -> None:
    """The spec's refusals of changed argument values (a stride-0 view repeats a row)."""
    p = op.problem
    if op.name == "quantize":
        spec_quantize(args["x"].contiguous(), p.scheme, None if "scale" not in args else args["scale"].contiguous())
    elif op.name == "linear":
        spec_quantize(args["x"].contiguous(), p.recipe.activation,
                      None if "scale" not in args else args["scale"].contiguous())


def _run(backend: Backend, op: _Op, args, **kw) -> dict[str, torch.Tensor]:
    if op.name != "quantize":
        poison_allocator((args["a.data" if op.name == "scaled_mm" else "x"].shape[0],
                          args["b.data" if op.name == "scaled_mm" else "w.data"].shape[0]))
    with backend_threads():
        outs = op.call(backend, args, **kw)
    bad = op.out_shape_ok(args, outs)
    if bad is not None:
        raise ContractViolation(bad)
    return outs


def _same(o1: dict, o2: dict) -> str | None:
    """None if the two calls' outputs have the same bits, else where they differ."""
    for k in o1:
        if not same_bits(o1[k], o2[k]):
            return f"{k}: {first_diff(o1[k], o2[k])}"
    return None


def _clones(args: dict) -> dict:
    return {k: v.clone() for k, v in args.items()}
