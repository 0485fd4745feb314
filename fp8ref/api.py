"""The reference linear: quantize the weight and the activations, then the reference scaled GEMM."""

from __future__ import annotations

import os as _os
import weakref as _weakref

import torch

from . import select as _select
from .registry import Backend as _Backend
from .registry import Case as _Case
from .spec.gemm import scaled_mm
from .spec.quant import Quantized, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe

__all__ = ["reference_linear", "quantize_weight", "flatten_activations", "linear", "explain", "clear_weight_cache",
           "tensor_version"]


def quantize_weight(w: torch.Tensor | Quantized, recipe: Recipe | str = W8A8_FP8,
                    scale: torch.Tensor | None = None) -> Quantized:
    """Quantize a float weight ``[N, K]`` under ``recipe.weight`` (or check a quantized one)."""
    recipe = get_recipe(recipe)
    if isinstance(w, Quantized):
        if w.scheme != recipe.weight:
            raise ValueError(f"weight was quantized as {w.scheme.short_str()}, recipe {recipe.name} "
                             f"expects {recipe.weight.short_str()}")
        return w
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
    recipe = get_recipe(recipe)
    x2, lead = flatten_activations(x)
    qw = quantize_weight(w, recipe)
    qx = quantize(x2, recipe.activation, input_scale)
    y = scaled_mm(qx, qw, bias, out_dtype=x.dtype if out_dtype is None else out_dtype)
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
    """Quantize (a float weight) or check (a Quantized one) and cache it against w's identity."""
    is_tensor = isinstance(w, torch.Tensor)
    if not is_tensor and not isinstance(w, Quantized):
        raise TypeError(f"w must be a float torch.Tensor [N, K] or an fp8ref.Quantized, got {type(w).__name__}")
    if is_tensor:
        if w.dim() != 2:
            raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
        with torch.no_grad():
            qw = quantize_weight(w.detach(), recipe)
        STATS["quantize_weight"] += 1
    else:
        qw = quantize_weight(w, recipe)

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
    if x.device != entry.qw.data.device:
        raise ValueError(f"x is on {x.device} but the weight is on {entry.qw.data.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (entry.N,):
            raise ValueError(f"bias must be a tensor of shape ({entry.N},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
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
        ``[..., N]``.

    Notes
    -----
    Under ``"auto"``, a backend that raises at run time is marked failed for this case (with
    one warning per backend) and the call is retried on the next compliant backend.

    Examples
    --------
    >>> import torch, fp8ref
    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> fp8ref.linear(x, w, backend="reference").shape
    torch.Size([4, 32])
    """
    # A Recipe is keyed by id (the entry holds it, so the id stays valid); a preset name by value.
    wkey = (id(w), recipe if recipe.__class__ is str else id(recipe))
    e = _WEIGHTS.get(wkey)
    if e is None or e.ref() is not w or e.version != _version(w):
        e = _weight_entry(w, get_recipe(recipe), wkey)
    shape = x.shape
    K = shape[-1] if shape else -1
    if K != e.K:
        raise ValueError(f"x has {K} features (shape {tuple(shape)}) but w is [{e.N}, {e.K}]")
    x2 = x if len(shape) == 2 else x.reshape(-1, K)
    M = x2.shape[0]
    od = x.dtype if out_dtype is None else out_dtype
    dkey = ((M - 1).bit_length() if M > 1 else 0, x.dtype, od, bias is None, backend, precision, x.device,
            _os.environ.get(_select.ENV_BACKEND), _os.environ.get(_select.ENV_CANDIDATES))
    d = e.dispatch.get(dkey)
    if d is None or d.generation != _select.generation():
        d = _resolve_dispatch(e, x, M, bias, backend, precision, od, dkey)
    elif bias is not None and bias.shape[0] != e.N:
        raise ValueError(f"bias must have shape ({e.N},), got {tuple(bias.shape)}")
    try:
        y = d.backend.linear(x2, d.prepared, bias, od, d.scheme)
    except Exception as exc:
        if not d.auto:
            raise
        y = _fallback(e, x, x2, M, bias, backend, precision, od, dkey, d, exc)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], e.N)


def _fallback(e, x, x2, M, bias, backend, precision, od, dkey, d, exc):
    """The chosen backend raised under "auto": bad input is re-raised as the spec's error; else
    mark the backend failed for this case and retry down the ranking (the reference is last)."""
    from .spec.quant import check_float_input

    check_float_input(x2, "x")  # NaN/Inf or a bad dtype: the caller's error, not the backend's
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
    recipe = get_recipe(recipe)
    if not isinstance(w, (torch.Tensor, Quantized)):
        raise TypeError(f"w must be a float torch.Tensor [N, K] or an fp8ref.Quantized, got {type(w).__name__}")
    N, K = (w.data if isinstance(w, Quantized) else w).shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but w is [{N}, {K}]")
    M = x.numel() // K if K else 0
    case = _Case(M=M, N=N, K=K, recipe=recipe, x_dtype=x.dtype, out_dtype=x.dtype if out_dtype is None else out_dtype,
                 device=str(x.device), has_bias=bias is not None)
    d = _select.select(case, precision, refresh=refresh)
    if print_table:
        print(d.table())
    return d
