"""The linear contracts' checks: the end-to-end bound against the unquantized float64 linear, and the
fused ``Backend.linear`` hook against ``scaled_mm(quantize(x))``.

How the backend's linear is called is a hook, ``call_linear`` (``LinearCall``): the checking core
sits below ``fp8ref.linear`` (the selector, which runs these checks as its compliance probe, is
part of ``fp8ref.linear``'s own path), so it cannot call the api itself -- that import would point
up, and while selecting it would recurse into the selection. The default, ``backend_linear``, is
the backend's own ``prepare_weight`` and ``Backend.linear`` (the hook ``fp8ref.linear`` runs once
a backend is chosen); the conformance contracts pass ``fp8ref.linear(..., backend=name)`` for a
registered backend (``fp8ref.conformance.contracts.linear``), so a certificate covers the whole
api path. Imports flow down: the registry, the spec, ``problems`` and ``common``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..registry import Backend
from ..spec.bounds import linear_error_bound
from ..spec.overflow import OVERFLOW_PREMISE, fp32_overflow_possible
from ..spec.quant import Quantized
from ..spec.schemes import Recipe
from .common import (
    ContractViolation,
    Declined,
    backend_threads,
    build_problem,
    cached_reference,
    call_quantize,
    check_within,
    copy_quantized,
    first_diff,
    poison_allocator,
    require_supported,
    same_bits,
    spec_quantize,
    to_backend_device,
    to_backend_layout,
    to_host,
)
from .given import GivenLinear
from .problems import LinearProblem


def _linear_takes_scale(backend: Backend) -> bool:
    """Whether ``backend.linear`` accepts ``scale=`` (hooks written before static scales do not)."""
    try:
        inspect.signature(backend.linear).bind_partial(scale=None)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect: let the call decide
        pass
    return True


def _backend_linear(backend: Backend, x, prepared, bias, out_dtype, scheme, scale):
    if scale is not None and not _linear_takes_scale(backend):
        raise Declined(f"premise: backend {backend.name!r}: linear() takes no scale=, so no static activation "
                       f"scheme ({scheme.short_str()})")
    x, bias, scale = to_backend_device(x), to_backend_device(bias), to_backend_device(scale)
    with backend_threads():
        if scale is None:
            return to_host(backend.linear(x, prepared, bias, out_dtype, scheme))
        return to_host(backend.linear(x, prepared, bias, out_dtype, scheme, scale=scale))


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _linear_inputs(p: LinearProblem | GivenLinear) -> tuple:
    """``(x, w, bias, scale, qx, qw)``: the problem's tensors, the caller's activation scale (None
    for a dynamic scheme) and the spec's quantizations of x and w (the weight's from the problem
    when a given one carries it: the probe's chunks share one weight). Computed once per given
    problem (its memo), afresh for a described one; the caller copies what a backend receives."""
    def compute():
        x, w, bias = build_problem(p)
        scale = p.act_scale(x)
        qx = spec_quantize(x, p.recipe.activation, scale)
        qw = p.qw if isinstance(p, GivenLinear) and p.qw is not None else spec_quantize(w, p.recipe.weight)
        return x, w, bias, scale, qx, qw

    return cached_reference(("linear", p), compute, lru=False)


@dataclass(frozen=True)
class LinearArgs:
    """One call of a backend's linear as a check makes it: ``x``, the unquantized weight ``w`` and its
    reference quantization ``qw`` (quantized once, as at load time), ``bias``, the ``recipe`` and
    ``out_dtype``, and the static activation ``scale`` (None for a dynamic scheme)."""

    x: torch.Tensor
    w: torch.Tensor
    qw: Quantized
    bias: torch.Tensor | None
    recipe: Recipe
    out_dtype: torch.dtype
    scale: torch.Tensor | None = None


#: ``call_linear(backend, args) -> y``: how a check runs the backend's linear (``backend_linear``
#: unless a layer above supplies the api path).
LinearCall = Callable[[Backend, LinearArgs], Any]


def backend_linear(backend: Backend, args: LinearArgs) -> Any:
    """The backend's own linear: ``prepare_weight`` of the reference-quantized weight (of the float
    weight itself for a layer that declares ``float_weight``), then the ``Backend.linear`` hook (a
    fused kernel, or the default ``scaled_mm(quantize(x))``)."""
    prepared = _prepare(backend, args.qw, args.w)
    return _backend_linear(backend, args.x, prepared, args.bias, args.out_dtype, args.recipe.activation, args.scale)


def _linear(backend: Backend, args: LinearArgs, call_linear: LinearCall) -> torch.Tensor:
    """The backend's linear through ``call_linear``, on output memory poisoned first, its result's
    type, shape and dtype checked."""
    x, w, out_dtype = args.x, args.w, args.out_dtype
    poison_allocator((x.shape[0], w.shape[0]), to_backend_device(x).device)
    y = call_linear(backend, args)
    if not isinstance(y, torch.Tensor):
        raise ContractViolation(f"linear returned {type(y).__name__}, not a tensor")
    if tuple(y.shape) != (x.shape[0], w.shape[0]) or y.dtype != out_dtype:
        raise ContractViolation(f"linear returned {tuple(y.shape)} {y.dtype}, expected "
                                f"{(x.shape[0], w.shape[0])} {out_dtype}")
    return y


def check_linear_bound(backend: Backend, p: LinearProblem, *, call_linear: LinearCall = backend_linear) -> float:
    """The backend's linear (run by ``call_linear``) against the float64 linear of the unquantized
    inputs, within the bound computed from the spec's own quantization of x and w
    (``linear_error_bound``): whatever scale the backend chose inside its linear, the bound never
    reads it."""
    require_supported(backend, p.case())
    x, w, bias, scale, qx, qw = _linear_inputs(p)

    def exact():
        y = x.to(torch.float64) @ w.to(torch.float64).T
        y = y if bias is None else y + bias.to(torch.float64)
        if bool((y.abs() > torch.finfo(p.out_dtype).max / 4).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
        # slack 2: the backend's own codes of x are the spec's within one step (<= 1 + 2u, u <= 2**-3)
        # and its scale within the quantizer's tolerance (docs/spec.md §5.2, "overflow")
        if fp32_overflow_possible(qx, qw, bias, slack=2.0):
            raise Declined(OVERFLOW_PREMISE)
        return y

    y_true = cached_reference(("linear_exact", p), exact, lru=False)
    y = _linear(backend, LinearArgs(x.clone(), w.clone(), copy_quantized(qw), _clone(bias), p.recipe, p.out_dtype,
                                    _clone(scale)), call_linear)
    bound = cached_reference(
        ("linear_bound", p, backend.accumulation, backend.output_roundings),
        lambda: linear_error_bound(x, w, qx, qw, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                   output_roundings=backend.output_roundings), lru=False)
    return check_within("linear vs float64 linear of the unquantized inputs (linear_error_bound of the spec's "
                         "quantization)", y, y_true, bound)


def check_linear_matches_two_calls(backend: Backend, p: LinearProblem) -> float:
    """``Backend.linear`` (the fused hook ``fp8ref.linear`` calls) returns what ``scaled_mm(quantize(x))``
    returns, bit for bit, on the weight prepared by ``prepare_weight``; and where the backend binds
    a warm call for a dynamic scheme (``Backend.bind_linear``), that call returns ``linear``'s bits
    (or hands the case back)."""
    require_supported(backend, p.case())
    x, w, bias, scale, _, qw = _linear_inputs(p)
    x, bias, scale = x.clone(), _clone(bias), _clone(scale)
    prepared = _prepare(backend, copy_quantized(qw), w)
    y1 = _backend_linear(backend, x, prepared, bias, p.out_dtype, p.recipe.activation, scale)
    qx = call_quantize(backend, x, p.recipe.activation, scale)
    qx = to_backend_layout(backend, to_backend_device(qx), "activation")
    with backend_threads():
        y2 = to_host(backend.scaled_mm(qx, prepared, to_backend_device(bias), p.out_dtype))
    _require_same_bits(y1, "linear", y2, "scaled_mm(quantize)")
    y3 = _bound_linear(backend, x, prepared, bias, p.out_dtype, p.recipe.activation) if scale is None else None
    if y3 is not None:
        _require_same_bits(y3, "the bound call (bind_linear)", y1, "linear")
    if scale is None:
        _check_watched_linear(backend, x, prepared, bias, p.out_dtype, p.recipe.activation, qw, y1)
    return 0.0


def _require_same_bits(y, what: str, want: torch.Tensor, of: str) -> None:
    """``y`` (what ``what`` returned) is a tensor with ``want``'s shape, dtype and bits (``of``'s)."""
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(want.shape) or y.dtype != want.dtype:
        raise ContractViolation(f"{what} returned {type(y).__name__} {tuple(getattr(y, 'shape', ()))} "
                                f"{getattr(y, 'dtype', '')}, {of} {tuple(want.shape)} {want.dtype}")
    if not same_bits(y, want):
        raise ContractViolation(f"{what} differs from {of}: {first_diff(y, want)}")


def _check_watched_linear(backend: Backend, x, prepared, bias, out_dtype, scheme, qw: Quantized, y1) -> None:
    """The watched call (``Backend.bind_watched_linear``), where the backend binds one: ``linear``'s
    bits on the weight it watches, and None (nothing computed) once that weight's version moved or
    a sampled byte changed behind torch's back, or for x outside the watched rows."""
    from ..weightcheck import MemorySample, Watch

    codes, scales = qw.data.clone(), qw.scale.clone()  # the layer's tensors, which the call watches
    rows = x.shape[0]
    with backend_threads():
        dev_codes, dev_scales = to_backend_device(codes), to_backend_device(scales)
        sample = MemorySample(dev_codes, (dev_scales,))
        watch = Watch.of((dev_codes, dev_scales), sample, x.dtype, rows, rows)
        fn = backend.bind_watched_linear(prepared, scheme, out_dtype, watch)
        if fn is None:
            return
        dx, db = to_backend_device(x), to_backend_device(bias)
        y = fn(dx, db, dev_codes, dev_scales)
        if y is None:
            return
        _require_same_bits(to_host(y), "the watched call (bind_watched_linear)", y1, "linear")
        more = torch.cat([dx, dx[:1]]) if rows else dx
        if fn(more, db, dev_codes, dev_scales) is not None:
            raise ContractViolation(f"the watched call (bind_watched_linear) computed {more.shape[0]} rows; it "
                                    f"watches {rows} to {rows} (it must return None)")
        if dev_codes.device.type == "cpu" and dev_codes.numel():
            raw = dev_codes.view(torch.uint8).numpy()  # a write torch does not count (no version bump)
            raw[0, 0] ^= 1  # the sample's first element
            changed = fn(dx, db, dev_codes, dev_scales)
            raw[0, 0] ^= 1
            if changed is not None:
                raise ContractViolation("the watched call (bind_watched_linear) computed after a sampled weight "
                                        "byte changed behind torch's back (it must return None)")
        dev_scales.add_(0)  # a version bump, same values
        if fn(dx, db, dev_codes, dev_scales) is not None:
            raise ContractViolation("the watched call (bind_watched_linear) computed after the scales' version "
                                    "moved (it must return None)")


def _bound_linear(backend: Backend, x, prepared, bias, out_dtype, scheme):
    """What the backend's bound call (``Backend.bind_linear``, a plan's warm call) returns for this
    case, or None where it binds nothing or hands the call back to ``linear``."""
    with backend_threads():
        fast = backend.bind_linear(prepared, scheme, out_dtype)
        if fast is None:
            return None
        y = fast(to_backend_device(x), to_backend_device(bias))
    return None if y is None else to_host(y)


def _prepare(backend: Backend, qw: Quantized, w: torch.Tensor) -> Any:
    """The backend's prepared weight: from the spec's quantization ``qw`` (load time), or from the
    float ``w`` itself for a layer that quantizes its own weight (``Backend.float_weight``)."""
    with backend_threads():
        if backend.float_weight:
            return backend.prepare_weight(to_backend_device(w.clone()))
        return backend.prepare_weight(to_backend_layout(backend, to_backend_device(qw), "weight"))


def check_linear_refuses_non_finite(backend: Backend, p: LinearProblem) -> float:
    """A backend declaring ``rejects_non_finite`` raises ``ValueError`` from its linear for NaN in x
    and for NaN in the bias, as the spec does (``fp8ref.linear`` then skips its own scans of x and
    the bias, so a false declaration would let NaN through unannounced). This is the part of the
    calling contract's ``linear.non_finite`` that the declaration promises (that contract checks
    every declared ``Backend.non_finite`` answer, on every kind of input, with Inf too); premise:
    the backend declares it."""
    if not backend.rejects_non_finite:
        raise Declined(f"premise: backend {backend.name!r} does not declare rejects_non_finite")
    require_supported(backend, p.case())
    x, w, bias, _, _, qw = _linear_inputs(p)
    prepared = _prepare(backend, copy_quantized(qw), w)
    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    bad_bias = torch.zeros(w.shape[0], dtype=x.dtype) if bias is None else bias.clone()
    bad_bias[0] = float("nan")
    for what, xb in (("x", (bad_x, bias)), ("the bias", (x, bad_bias))):
        try:
            _backend_linear(backend, xb[0], prepared, xb[1], p.out_dtype, p.recipe.activation, None)
        except ValueError:
            continue
        raise ContractViolation(f"declares rejects_non_finite, but linear() with NaN in {what} did not raise "
                                "ValueError")
    return 0.0

