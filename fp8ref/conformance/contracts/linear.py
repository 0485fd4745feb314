"""The linear contracts' checks: the end-to-end bound against the unquantized float64 linear, and the
fused ``Backend.linear`` hook against ``scaled_mm(quantize(x))``."""

from __future__ import annotations

import inspect

import torch

from ...registry import Backend
from ...spec.bounds import linear_error_bound
from ...spec.quant import Quantized
from .. import strategies as fst
from .common import (
    ContractViolation,
    Declined,
    _build,
    _check_within,
    _first_diff,
    _quantize,
    _ref_quantize,
    _require,
    _same_bits,
    backend_threads,
    poison_allocator,
)


def _registered(backend: Backend) -> bool:
    from ...registry import get_backend

    try:
        return get_backend(backend.name) is backend
    except KeyError:
        return False


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
    with backend_threads():
        if scale is None:
            return backend.linear(x, prepared, bias, out_dtype, scheme)
        return backend.linear(x, prepared, bias, out_dtype, scheme, scale=scale)


def _linear(backend: Backend, x, qw: Quantized, w, bias, recipe, out_dtype, scale=None) -> torch.Tensor:
    """The backend's linear as its callers run it: the weight quantized once by the reference (load
    time) and the activations by the backend's own ``linear`` (a fused hook, or the default
    ``scaled_mm(quantize(x))``). A registered backend goes through ``fp8ref.linear(...,
    backend=name)`` itself (static activation schemes, which ``fp8ref.linear`` does not take,
    through its ``Backend.linear`` hook); any other through ``prepare_weight`` and ``linear``
    (``prepare_weight`` of the float ``w`` for a backend that declares ``float_weight``)."""
    poison_allocator((x.shape[0], w.shape[0]), x.device)
    if _registered(backend) and scale is None and not backend.float_weight:
        import fp8ref

        with backend_threads():
            y = fp8ref.linear(x, w, bias, recipe=recipe, backend=backend.name, precision="fast",
                              out_dtype=out_dtype)
        what = "fp8ref.linear"
    else:
        prepared = _prepare(backend, qw, w)
        y = _backend_linear(backend, x, prepared, bias, out_dtype, recipe.activation, scale)
        what = "linear"
    if not isinstance(y, torch.Tensor):
        raise ContractViolation(f"{what} returned {type(y).__name__}, not a tensor")
    if tuple(y.shape) != (x.shape[0], w.shape[0]) or y.dtype != out_dtype:
        raise ContractViolation(f"{what} returned {tuple(y.shape)} {y.dtype}, expected "
                                f"{(x.shape[0], w.shape[0])} {out_dtype}")
    return y


def check_linear_bound(backend: Backend, p: fst.LinearProblem) -> float:
    """The backend's linear against the float64 linear of the unquantized inputs, within the bound
    computed from the spec's own quantization of x and w (``linear_error_bound``): whatever scale the
    backend chose inside its linear, the bound never reads it."""
    _require(backend, p.case())
    x, w, bias = _build(p)
    scale = p.act_scale(x)
    qx = _ref_quantize(x, p.recipe.activation, scale)
    qw = _ref_quantize(w, p.recipe.weight)
    from ...kernels import reference  # noqa: F401 -- fp8ref.linear needs the registry loaded
    y_true = x.to(torch.float64) @ w.to(torch.float64).T
    if bias is not None:
        y_true = y_true + bias.to(torch.float64)
    if bool((y_true.abs() > torch.finfo(p.out_dtype).max / 4).any()):
        raise Declined(f"premise: the exact result overflows {p.out_dtype}")
    y = _linear(backend, x, qw, w, bias, p.recipe, p.out_dtype, scale)
    bound = linear_error_bound(x, w, qx, qw, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                               output_roundings=backend.output_roundings)
    return _check_within("linear vs float64 linear of the unquantized inputs (linear_error_bound of the spec's "
                         "quantization)", y, y_true, bound)


def check_linear_matches_two_calls(backend: Backend, p: fst.LinearProblem) -> float:
    """``Backend.linear`` (the fused hook ``fp8ref.linear`` calls) returns what ``scaled_mm(quantize(x))``
    returns, bit for bit, on the weight prepared by ``prepare_weight``."""
    _require(backend, p.case())
    x, w, bias = _build(p)
    scale = p.act_scale(x)
    _ref_quantize(x, p.recipe.activation, scale)
    qw = _ref_quantize(w, p.recipe.weight)
    prepared = _prepare(backend, qw, w)
    y1 = _backend_linear(backend, x, prepared, bias, p.out_dtype, p.recipe.activation, scale)
    qx = _quantize(backend, x, p.recipe.activation, scale)
    with backend_threads():
        y2 = backend.scaled_mm(qx, prepared, bias, p.out_dtype)
    if not isinstance(y1, torch.Tensor) or tuple(y1.shape) != tuple(y2.shape) or y1.dtype != y2.dtype:
        raise ContractViolation(f"linear returned {type(y1).__name__} {tuple(getattr(y1, 'shape', ()))} "
                                f"{getattr(y1, 'dtype', '')}, scaled_mm(quantize) {tuple(y2.shape)} {y2.dtype}")
    if not _same_bits(y1, y2):
        raise ContractViolation(f"linear differs from scaled_mm(quantize): {_first_diff(y1, y2)}")
    return 0.0


def _prepare(backend: Backend, qw: Quantized, w: torch.Tensor):
    """The backend's prepared weight: from the spec's quantization ``qw`` (load time), or from the
    float ``w`` itself for a layer that quantizes its own weight (``Backend.float_weight``)."""
    with backend_threads():
        if backend.float_weight:
            return backend.prepare_weight(w)
        return backend.prepare_weight(_to_device(qw, w.device))


def _to_device(q: Quantized, device) -> Quantized:
    return q if q.data.device == device else Quantized(q.data.to(device), q.scale.to(device), q.scheme)
