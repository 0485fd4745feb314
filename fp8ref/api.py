"""``fp8ref.linear`` and ``fp8ref.explain``, the reference linear, and the argument checks all three
make first.

Every entry point that takes a caller's tensors (``linear``, ``explain``, ``reference_linear``, and
through ``linear`` ``Fp8Linear``) checks them with the functions of the first section before any
selection, probe or kernel runs: types and dtypes, shapes, the output dtype, whether a gradient is
asked for, then NaN/Inf. Each error names the offending argument. The checks of a weight run once
per weight (they are cached with its quantized form); the per-call checks cost a few microseconds.
"""

from __future__ import annotations

import os as _os
import weakref as _weakref

import torch

from . import select as _select
from .kernels._common import BIAS_NON_FINITE, check_codes, check_finite
from .registry import Backend as _Backend
from .registry import Case as _Case
from .spec.fenv import flushing as _flushing
from .spec.fenv import ieee_subnormals as _ieee_subnormals
from .spec.gemm import OUT_DTYPES, scaled_mm
from .spec.quant import Quantized, check_float_input, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe

__all__ = ["reference_linear", "quantize_weight", "flatten_activations", "linear", "explain", "clear_weight_cache",
           "tensor_version", "check_linear_args", "check_finite", "check_codes", "X_DTYPES"]

#: The activation dtypes ``fp8ref.linear`` takes: the reference quantizer's inputs.
X_DTYPES = _select.X_DTYPES


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


# --------------------------------------------------------------------------------------------
# Argument checks: one set for every entry point, in the order a caller should hear about them
# (check_codes, for a Quantized weight, lives beside check_finite in kernels/_common).


_META = "fp8ref computes on values (the scales depend on them), so there is no shape-only (meta) run"


def _check_x(x) -> None:
    """Type, dtype and rank of the activations (cheap: every call)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [..., K], got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        if _is_fp8(x.dtype):
            raise TypeError(f"x is an FP8 tensor ({x.dtype}): fp8ref.linear quantizes float activations itself; "
                            "pass them in float32, float16, bfloat16 or float64 (for quantized operands use "
                            "fp8ref.scaled_mm)")
        raise TypeError(f"x must have a float dtype {[str(d) for d in X_DTYPES]}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K], got a 0-d tensor")
    if x.device.type == "meta":
        raise ValueError(f"x is on the meta device, which holds no values: {_META}")


def _check_weight(w, recipe: Recipe) -> None:
    """Type, dtype, shape and values of the weight (once per weight: the result is cached)."""
    if isinstance(w, Quantized):
        if w.scheme != recipe.weight:
            raise ValueError(f"w was quantized as {w.scheme.short_str()}, recipe {recipe.name} expects "
                             f"{recipe.weight.short_str()}")
        if w.data.device.type == "meta":
            raise ValueError(f"w is on the meta device, which holds no values: {_META}")
        if w.data.shape[1] == 0:
            raise ValueError(f"w has 0 columns (shape {tuple(w.data.shape)}): the reduction dim K must be at least 1")
        check_codes(w, "w")
        return
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a float torch.Tensor [N, K] or an fp8ref.Quantized, got {type(w).__name__}")
    if _is_fp8(w.dtype):
        raise TypeError(f"w is an FP8 tensor ({w.dtype}) without its scales: pass the float weight (fp8ref.linear "
                        "quantizes it once), or fp8ref.Quantized(codes, scale, recipe.weight)")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.device.type == "meta":
        raise ValueError(f"w is on the meta device, which holds no values: {_META}")
    check_float_input(w, "w")


def _check_call(x: torch.Tensor, N: int, K: int, w_device: torch.device, bias, out_dtype) -> torch.dtype:
    """The per-call checks after the weight's: shapes, devices, bias, output dtype (``_check_values``
    then scans the values). Returns the output dtype."""
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but w is [{N}, {K}]")
    if x.device != w_device:
        raise ValueError(f"x is on {x.device} but the weight is on {w_device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a float torch.Tensor [N] or None, got {type(bias).__name__}")
        if not bias.is_floating_point() or _is_fp8(bias.dtype):
            raise TypeError(f"bias must have a float dtype, got {bias.dtype}")
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},) = [N], got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    od = x.dtype if out_dtype is None else out_dtype
    if od not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]} (or None: x's dtype), got {od}")
    return od


def _check_values(x: torch.Tensor, bias) -> None:
    """NaN/Inf in x or bias: the last of the caller's checks (one reduction each)."""
    check_finite(x, "x", "FP8 quantization of NaN/Inf is undefined")
    if bias is not None:
        check_finite(bias, "bias", BIAS_NON_FINITE)


def check_linear_args(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
                      recipe: Recipe | str = W8A8_FP8,
                      out_dtype: torch.dtype | None = None) -> tuple[Recipe, torch.dtype]:
    """Check the arguments of a linear ``y = x w^T + bias`` and return ``(recipe, out_dtype)``.

    What ``fp8ref.linear``, ``fp8ref.explain`` and ``reference_linear`` check before anything else
    runs, in this order: x's type, dtype (float32/16, bfloat16, float64; not FP8), rank and device
    (not meta); the recipe; w's type, dtype, shape, device, values (float: finite; ``Quantized``: its
    scheme is the recipe's, no NaN/Inf codes, finite positive scales); x's K and device against w's;
    bias's type, dtype, shape [N] and device; ``out_dtype``; NaN/Inf in x and bias.

    Raises
    ------
    TypeError, ValueError
        Naming the offending argument.

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.api import check_linear_args
    >>> check_linear_args(torch.randn(2, 8), torch.randn(4, 8))[1]
    torch.float32
    >>> check_linear_args(torch.randn(2, 8), torch.randn(4, 8), torch.zeros(5))
    Traceback (most recent call last):
    ...
    ValueError: bias must have shape (4,) = [N], got (5,)
    """
    _check_x(x)
    recipe = get_recipe(recipe)
    _check_weight(w, recipe)
    wt = w.data if isinstance(w, Quantized) else w
    N, K = wt.shape
    od = _check_call(x, N, K, wt.device, bias, out_dtype)
    _check_values(x, bias)
    return recipe, od


# --------------------------------------------------------------------------------------------
# Autograd: fp8ref computes no gradients, and says so when one is asked for.


def _grad_inputs(x: torch.Tensor, w, bias) -> dict[str, torch.Tensor] | None:
    """The tensor arguments that require grad, by name, in grad mode (None otherwise: the common case)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or getattr(w, "requires_grad", False)
                                         or (bias is not None and bias.requires_grad))):
        return None
    return {n: t for n, t in (("x", x), ("w", w), ("bias", bias)) if isinstance(t, torch.Tensor) and t.requires_grad}


class _NoGradient(torch.autograd.Function):
    """An fp8ref output computed from inputs that require grad: the forward runs as usual (without
    recording the backend's own graph), the backward raises. Never a silently detached output
    (``loss.backward()`` would skip the layer) nor the derivative of the quantizer's internals
    (what the reference's torch ops would record)."""

    @staticmethod
    def forward(ctx, names, run, *inputs):
        ctx.names = names
        return run()

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise RuntimeError(f"fp8ref computes no gradients ({' and '.join(ctx.names)} of an fp8ref linear "
                           f"{'requires' if len(ctx.names) == 1 else 'require'} grad): FP8 quantization is "
                           "piecewise constant and fp8ref is an inference reference (docs/spec.md, 'Autograd'). "
                           "Detach the inputs, or run the forward under torch.no_grad() / torch.inference_mode()")


def _without_gradient(run, inputs: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``run()``, as an output whose backward raises when some ``inputs`` (those requiring grad) exist."""
    return _NoGradient.apply(tuple(inputs), run, *inputs.values()) if inputs else run()


def quantize_weight(w: torch.Tensor | Quantized, recipe: Recipe | str = W8A8_FP8,
                    scale: torch.Tensor | None = None) -> Quantized:
    """Quantize a float weight ``[N, K]`` under ``recipe.weight`` (or check a quantized one)."""
    recipe = get_recipe(recipe)
    if isinstance(w, Quantized):
        if w.scheme != recipe.weight:
            raise ValueError(f"w was quantized as {w.scheme.short_str()}, recipe {recipe.name} "
                             f"expects {recipe.weight.short_str()}")
        return w
    check_float_input(w, "w")  # the spec's quantizer would call it "x"
    return quantize(w, recipe.weight, scale)


def flatten_activations(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``[..., K]`` to ``[M, K]``, with the leading shape to restore the output."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K]")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def reference_linear(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
                     recipe: Recipe | str = W8A8_FP8, out_dtype: torch.dtype | None = None,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed the FP8 W8A8 way, by the spec.

    Parameters
    ----------
    x : torch.Tensor
        Activations ``[..., K]``.
    w : torch.Tensor or Quantized
        Weight ``[N, K]``, float (quantized here under ``recipe.weight``) or already quantized.
    bias : torch.Tensor, optional
        ``[N]``.
    recipe : Recipe or str
        Default ``W8A8_FP8``: per-channel weights, dynamic per-token activations.
    out_dtype : torch.dtype, optional
        Defaults to ``x.dtype`` (float64 input gives the unrounded float64 result).
    input_scale : torch.Tensor, optional
        Static activation scale, for recipes whose activation scheme is static.

    Examples
    --------
    >>> import torch, fp8ref
    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> fp8ref.reference_linear(x, w).shape
    torch.Size([4, 32])
    """
    recipe, out_dtype = check_linear_args(x, w, bias, recipe=recipe, out_dtype=out_dtype)
    x2, lead = flatten_activations(x)

    def run() -> torch.Tensor:
        qw = quantize_weight(w, recipe)
        qx = quantize(x2, recipe.activation, input_scale)
        return scaled_mm(qx, qw, bias, out_dtype=out_dtype)

    y = _without_gradient(run, _grad_inputs(x, w, bias))
    return y.reshape(*lead, y.shape[-1])


# --------------------------------------------------------------------------------------------
# fp8ref.linear: the user-facing call, dispatched to the selected backend.
#
# Hot path (after the first call for a weight and a case): one dict lookup for the weight
# (keyed by id, checked against a weakref and the tensor's version counter), one for the
# dispatch (M bucket, dtypes, bias, backend, precision, env), then the backend's own calls.


class _Dispatch:
    __slots__ = ("backend", "prepared", "scheme", "auto", "key", "generation")

    def __init__(self, backend: _Backend, prepared, scheme, auto: bool, key: str | None, generation: int):
        self.backend, self.prepared, self.scheme = backend, prepared, scheme
        self.auto, self.key, self.generation = auto, key, generation


class _WeightEntry:
    """One weight under one recipe: its Quantized form, per-backend prepared forms, dispatches."""

    __slots__ = ("ref", "version", "recipe", "qw", "N", "K", "prepared", "dispatch", "is_tensor", "__weakref__")

    def __init__(self, ref, version, recipe: Recipe, qw: Quantized, is_tensor: bool):
        self.ref, self.version, self.recipe, self.qw, self.is_tensor = ref, version, recipe, qw, is_tensor
        self.N, self.K = qw.data.shape
        self.prepared: dict[str, object] = {}
        self.dispatch: dict[tuple, _Dispatch] = {}


_WEIGHTS: dict[tuple[int, int], _WeightEntry] = {}
#: Counts weight quantizations and prepare_weight calls (tests check the cache is used).
STATS = {"quantize_weight": 0, "prepare_weight": 0}


def clear_weight_cache() -> None:
    """Drop every cached quantized / prepared weight (they are rebuilt on next use)."""
    _WEIGHTS.clear()


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``, or -1 for an inference tensor, which has no version counter (an in-place
    change to such a weight inside ``torch.inference_mode`` is not seen: call
    ``clear_weight_cache()`` after one)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _version(w) -> object:
    if isinstance(w, Quantized):
        return (tensor_version(w.data), tensor_version(w.scale), w.data.data_ptr(), w.scale.data_ptr())
    return (tensor_version(w), w.data_ptr())


def _weight_entry(w, recipe: Recipe, key: tuple) -> _WeightEntry:
    """Check and quantize (a float weight) or check (a Quantized one), and cache the result against
    w's identity: the weight's checks run once per weight and version."""
    _check_weight(w, recipe)
    is_tensor = isinstance(w, torch.Tensor)
    if is_tensor:
        with torch.no_grad():
            qw = quantize(w.detach(), recipe.weight)
        STATS["quantize_weight"] += 1
    else:
        qw = w

    def _drop(ref, key=key, cache=_WEIGHTS):  # bound now: module globals are gone at interpreter exit
        e = cache.get(key)
        if e is not None and e.ref is ref:
            del cache[key]

    entry = _WeightEntry(_weakref.ref(w, _drop), _version(w), recipe, qw, is_tensor)
    _WEIGHTS[key] = entry
    return entry


def _resolve_dispatch(entry: _WeightEntry, x: torch.Tensor, M: int, bias, backend: str, precision: str,
                      od: torch.dtype, dkey: tuple) -> _Dispatch:
    recipe = entry.recipe
    if not recipe.activation.dynamic:
        raise ValueError(f"recipe {recipe.name!r} has a static activation scheme; fp8ref.linear quantizes "
                         "activations dynamically (use reference_linear(..., input_scale=) for static scales)")
    case = _Case(M=M, N=entry.N, K=entry.K, recipe=recipe, x_dtype=x.dtype, out_dtype=od, device=str(x.device),
                 has_bias=bias is not None)
    b, decision = _select.resolve(case, backend, precision)
    prepared = entry.prepared.get(b.name)
    if prepared is None:
        prepared = b.prepare_weight(entry.qw)
        STATS["prepare_weight"] += 1
        entry.prepared[b.name] = prepared
    d = _Dispatch(b, prepared, recipe.activation, decision is not None, None if decision is None else decision.key,
                  _select.generation())
    entry.dispatch[dkey] = d
    return d


def linear(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
           recipe: Recipe | str = W8A8_FP8, backend: str = "auto", precision: str = "standard",
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` computed in FP8 W8A8 by the fastest compliant backend.

    Parameters
    ----------
    x : torch.Tensor
        Activations ``[..., K]`` (fp32, fp16, bf16).
    w : torch.Tensor or Quantized
        Weight ``[N, K]``: a float tensor is quantized under ``recipe.weight`` by the reference
        quantizer *once* and cached against the tensor's identity and version (an in-place
        change re-quantizes it); a ``Quantized`` is used as is. The backend's
        ``prepare_weight`` runs once per weight and backend, and is cached too.
    bias : torch.Tensor, optional
        ``[N]``.
    recipe : Recipe or str
        Default ``W8A8_FP8`` (per-channel weights, dynamic per-token activations).
    backend : str
        ``"auto"`` (the selector; ``FP8REF_BACKEND`` forces one) or a backend name, which must
        be able to run the case or the call raises ``BackendUnavailableError``.
    precision : str
        Required precision class (``exact``, ``strict``, ``standard``, ``fast``); see
        docs/selection.md for why ``standard`` is the default.
    out_dtype : torch.dtype, optional
        Defaults to ``x.dtype``.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` (empty when M = 0 or N = 0, as the reference computes it).

    Raises
    ------
    TypeError, ValueError
        The caller's errors, naming the argument, before any selection, probe or kernel (see
        ``check_linear_args``): a non-float or FP8 ``x``, an FP8 ``w`` without scales, shapes that
        do not fit, a bias that is not a float ``[N]``, an ``out_dtype`` outside ``OUT_DTYPES``,
        NaN/Inf in ``x``, ``w`` or ``bias``, NaN codes in a ``Quantized`` weight.
    BackendUnavailableError
        A named (or ``FP8REF_BACKEND``-forced) backend that cannot run the case.

    Notes
    -----
    Under ``"auto"``, a backend that raises at run time is marked failed for this case (with
    one warning per backend) and the call is retried on the next compliant backend.

    fp8ref computes no gradients: in grad mode, with an input that requires grad, the output's
    backward raises ``RuntimeError`` (docs/spec.md, "Autograd"); run under ``torch.no_grad()``.

    Examples
    --------
    >>> import torch, fp8ref
    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> fp8ref.linear(x, w, backend="reference").shape
    torch.Size([4, 32])
    """
    if _flushing():  # fp8ref's numbers keep subnormals whatever the caller's thread flushes (spec/fenv.py)
        with _ieee_subnormals():
            return linear(x, w, bias, recipe=recipe, backend=backend, precision=precision, out_dtype=out_dtype)
    _check_x(x)
    if type(backend) is not str:
        raise TypeError(f"backend must be a backend name or 'auto', got {type(backend).__name__}")
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str (exact, strict, standard, fast), got {type(precision).__name__}")
    # A Recipe is keyed by id (the entry holds it, so the id stays valid); a preset name by value.
    wkey = (id(w), recipe if recipe.__class__ is str else id(recipe))
    e = _WEIGHTS.get(wkey)
    if e is None or e.ref() is not w or e.version != _version(w):
        e = _weight_entry(w, get_recipe(recipe), wkey)
    od = _check_call(x, e.N, e.K, e.qw.data.device, bias, out_dtype)
    shape = x.shape
    x2 = x if len(shape) == 2 else x.reshape(-1, e.K)
    M = x2.shape[0]
    dkey = ((M - 1).bit_length() if M > 1 else 0, x.dtype, od, bias is None, backend, precision, x.device,
            _os.environ.get(_select.ENV_BACKEND), _os.environ.get(_select.ENV_CANDIDATES))
    d = e.dispatch.get(dkey)
    if d is None or d.generation != _select.generation():
        _check_values(x, bias)  # before any selection, probe or kernel
        d = _resolve_dispatch(e, x, M, bias, backend, precision, od, dkey)
    elif not d.backend.rejects_non_finite:
        _check_values(x, bias)
    grads = _grad_inputs(x, w, bias)
    if grads is None:
        y = _call(e, x, x2, M, bias, backend, precision, od, dkey, d)
    else:
        y = _without_gradient(lambda: _call(e, x, x2, M, bias, backend, precision, od, dkey, d), grads)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], e.N)


def _call(e, x, x2, M, bias, backend, precision, od, dkey, d):
    try:
        return d.backend.linear(x2, d.prepared, bias, od, d.scheme)
    except Exception as exc:
        # A backend that rejects NaN/Inf itself (rejects_non_finite) raised: the caller's error,
        # worded as on a first call (x's own index, not its flattened view's), and never blamed
        # on the backend under "auto".
        _check_values(x, bias)
        if not d.auto:
            raise
        return _fallback(e, x, x2, M, bias, backend, precision, od, dkey, d, exc)


def _fallback(e, x, x2, M, bias, backend, precision, od, dkey, d, exc):
    """The chosen backend raised under "auto" on checked input: mark it failed for this case and
    retry down the ranking (the reference is last)."""
    while True:
        _select.mark_failed(d.backend.name, d.key, exc)
        d = _resolve_dispatch(e, x, M, bias, backend, precision, od, dkey)
        try:
            return d.backend.linear(x2, d.prepared, bias, od, d.scheme)
        except Exception as exc2:
            if d.backend.name == "reference":
                raise
            exc = exc2


def explain(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
            recipe: Recipe | str = W8A8_FP8, precision: str = "standard", out_dtype: torch.dtype | None = None,
            refresh: bool = False, print_table: bool = False) -> _select.Decision:
    """The table behind the decision ``fp8ref.linear(x, w, bias, ...)`` would make under "auto".

    Returns the ``Decision`` (``str()`` of it is the table: backend, class, supported/reason,
    compliant with the worst error/bound ratio, median time, chosen).

    Examples
    --------
    >>> import torch, fp8ref
    >>> d = fp8ref.explain(torch.randn(4, 64), torch.randn(32, 64))
    >>> d.chosen in d.ranking
    True
    """
    recipe, od = check_linear_args(x, w, bias, recipe=recipe, out_dtype=out_dtype)
    N, K = (w.data if isinstance(w, Quantized) else w).shape
    case = _Case(M=x.numel() // K, N=N, K=K, recipe=recipe, x_dtype=x.dtype, out_dtype=od, device=str(x.device),
                 has_bias=bias is not None)
    d = _select.select(case, precision, refresh=refresh)
    if print_table:
        print(d.table())
    return d
