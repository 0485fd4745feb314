"""``fp8ref.linear`` and ``fp8ref.explain``, and the reference linear.

Every entry point that takes a caller's tensors (``linear``, ``explain``, ``reference_linear``, and
through ``linear`` ``Fp8Linear``) checks them with ``fp8ref.spec.checks`` before any selection,
probe or kernel runs: types, layouts and devices, dtypes, shapes, the output dtype, then NaN/Inf.
Each error names the offending argument. The checks of a weight run once per weight (they are
cached with its quantized form); the per-call checks cost a few microseconds.
"""

from __future__ import annotations

import os as _os
import weakref as _weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import select as _select
from .registry import Backend as _Backend
from .registry import Case as _Case
from .registry import MoeBackend, get_moe_backend
from .select.moe import select_moe
from .spec.checks import X_DTYPES, check_call, check_linear_args, check_values, check_weight, check_x
from .spec.fenv import flushing as _flushing
from .spec.fenv import ieee_subnormals as _ieee_subnormals
from .spec.gemm import scaled_mm
from .spec.moe import MoeScheme, MoeWeights, Routing, check_moe_args
from .spec.quant import Quantized, check_float_input, quantize
from .spec.schemes import W8A8_FP8, Recipe, get_recipe
from .weightcheck import ENV_WEIGHT_CHECK, SAMPLE_ROWS, WEIGHT_CHECKS, MemorySample, tensor_version
from .weightcheck import same_content as _same_content
from .weightcheck import snapshot as _snapshot
from .weightcheck import version as _version
from .weightcheck import weight_check_mode as _weight_check

__all__ = ["reference_linear", "quantize_weight", "flatten_activations", "linear", "explain", "clear_weight_cache",
           "tensor_version", "check_linear_args", "X_DTYPES", "WEIGHT_CHECKS", "ENV_WEIGHT_CHECK", "DispatchKey",
           "MemorySample", "SAMPLE_ROWS", "moe"]



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
# Hot path (after the first call for a weight and a case): one dict lookup for the weight (keyed
# by id, checked against a weakref, the version counters and storage pointers, and under
# weight_check="sample" a sample of its memory, under "content" all of its bytes), one for the
# dispatch (a DispatchKey), then the backend's call.


class DispatchKey(NamedTuple):
    """Everything besides the weight that decides which backend runs a call. The hot path builds
    the plain tuple in this field order (a NamedTuple's constructor costs more than the tuple, and
    equal tuples hash alike); a table miss names it with ``DispatchKey._make``."""

    m_bucket: int  #: bit length of M - 1 (0 for M <= 1): the selector's power-of-two bucket
    x_dtype: torch.dtype
    out_dtype: torch.dtype
    has_bias: bool
    backend: str  #: "auto" or a name
    precision: str
    device: torch.device
    candidates: tuple[str, ...] | None  #: ``candidates=`` of the call
    forced: str | None  #: FP8REF_BACKEND
    env_candidates: str | None  #: FP8REF_CANDIDATES


@dataclass(frozen=True)
class _Request:
    """One checked call, as a (re)selection needs it: built when the dispatch table misses and
    when a backend raises, never on the hot path."""

    x: torch.Tensor  #: the caller's x (errors name its own indices, not the flattened view's)
    x2: torch.Tensor  #: x as [M, K]
    bias: torch.Tensor | None
    out_dtype: torch.dtype
    key: DispatchKey


class _Dispatch:
    __slots__ = ("backend", "prepared", "scheme", "auto", "key", "generation")

    def __init__(self, backend: _Backend, prepared, scheme, decision_key: str | None, generation: int):
        self.backend, self.prepared, self.scheme = backend, prepared, scheme
        self.auto, self.key, self.generation = decision_key is not None, decision_key, generation


class _WeightEntry:
    """One weight under one recipe: its Quantized form, per-backend prepared forms, dispatches, and
    under ``weight_check="sample"`` a ``MemorySample`` of the weight, under ``"content"`` a private
    copy of its bytes. Built whole, then put in the cache (a thread sees the old entry or the new)."""

    __slots__ = ("ref", "version", "recipe", "qw", "N", "K", "prepared", "dispatch", "kept", "sample", "check",
                 "__weakref__")

    def __init__(self, ref, version, recipe: Recipe, qw: Quantized, check: str,
                 kept: tuple[torch.Tensor, ...] | None, sample: MemorySample | None):
        self.ref, self.version, self.recipe, self.qw, self.check = ref, version, recipe, qw, check
        self.kept, self.sample = kept, sample
        self.N, self.K = qw.data.shape
        self.prepared: dict[str, object] = {}
        self.dispatch: dict[tuple, _Dispatch] = {}


_WEIGHTS: dict[tuple[int, object], _WeightEntry] = {}
#: Counts weight quantizations and prepare_weight calls (tests check the cache is used).
STATS = {"quantize_weight": 0, "prepare_weight": 0}


def clear_weight_cache() -> None:
    """Drop every cached quantized / prepared weight (they are rebuilt on next use)."""
    _WEIGHTS.clear()


def _weight_entry(w, recipe: Recipe, key: tuple, check: str) -> _WeightEntry:
    """Check and quantize (a float weight) or check (a Quantized one), and cache the result against
    w's identity: the weight's checks run once per weight and version (and sample, or content)."""
    check_weight(w, recipe)
    # Both taken before quantizing: a write after them gives a cached form newer than the sample
    # (the next call rebuilds), never one older than it.
    kept = _snapshot(w) if check == "content" else None  # what the cached form is made of
    sample = None
    if check == "sample":
        sample = MemorySample(w.data, (w.scale,)) if isinstance(w, Quantized) else MemorySample(w)
    if isinstance(w, torch.Tensor):
        with torch.no_grad():
            qw = quantize(w.detach() if kept is None else kept[0].view(w.dtype).reshape(w.shape), recipe.weight)
        STATS["quantize_weight"] += 1
    elif kept is not None:  # the backends prepare from the kept copy: one consistent version
        qw = Quantized(kept[0].view(w.data.dtype).reshape(w.data.shape),
                       kept[1].view(w.scale.dtype).reshape(w.scale.shape), w.scheme, w.n_saturated)
    else:
        qw = w

    def _drop(ref, key=key, cache=_WEIGHTS):  # bound now: module globals are gone at interpreter exit
        e = cache.get(key)
        if e is not None and e.ref is ref:
            del cache[key]

    entry = _WeightEntry(_weakref.ref(w, _drop), _version(w), recipe, qw, check, kept, sample)
    _WEIGHTS[key] = entry
    return entry


def _entry(w, recipe, weight_check: str | None) -> _WeightEntry:
    """The cached entry of ``w``, rebuilt when ``w`` changed (as the entry's check sees changes).
    ``weight_check=None`` keeps the entry's mode, read from ``FP8REF_WEIGHT_CHECK`` when the entry
    was made (an environment read per call would cost a microsecond)."""
    # A Recipe is keyed by id (the entry holds it, so the id stays valid); a preset name by value.
    wkey = (id(w), recipe if recipe.__class__ is str else id(recipe))
    e = _WEIGHTS.get(wkey)
    if (e is None or e.ref() is not w or e.version != _version(w)
            or (weight_check is not None and weight_check != e.check)
            or (e.sample is not None and not e.sample.same())
            or (e.kept is not None and not _same_content(w, e.kept))):
        e = _weight_entry(w, get_recipe(recipe), wkey, _weight_check(weight_check))
    return e


def _check_candidates(candidates) -> tuple[str, ...] | None:
    if candidates is None:
        return None
    if isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates):
        raise TypeError(f"candidates must be a sequence of backend names (or None), got {candidates!r}")
    return tuple(candidates)


def _resolve_dispatch(e: _WeightEntry, req: _Request) -> _Dispatch:
    recipe, key = e.recipe, req.key
    if not recipe.activation.dynamic:
        raise ValueError(f"recipe {recipe.name!r} has a static activation scheme; fp8ref.linear quantizes "
                         "activations dynamically (use reference_linear(..., input_scale=) for static scales)")
    case = _Case(M=req.x2.shape[0], N=e.N, K=e.K, recipe=recipe, x_dtype=req.x.dtype, out_dtype=req.out_dtype,
                 device=str(req.x.device), has_bias=req.bias is not None)
    b, decision = _select.resolve(case, key.backend, key.precision, candidates=key.candidates)
    prepared = e.prepared.get(b.name)
    if prepared is None:
        prepared = b.prepare_weight(e.qw)
        STATS["prepare_weight"] += 1
        e.prepared[b.name] = prepared
    d = _Dispatch(b, prepared, recipe.activation, None if decision is None else decision.key, _select.generation())
    e.dispatch[key] = d
    return d


def linear(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
           recipe: Recipe | str = W8A8_FP8, backend: str = "auto", precision: str = "standard",
           out_dtype: torch.dtype | None = None, candidates: Sequence[str] | None = None,
           weight_check: str | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` computed in FP8 W8A8 by the fastest compliant backend.

    Parameters
    ----------
    x : torch.Tensor
        Activations ``[..., K]`` (fp32, fp16, bf16, fp64), dense.
    w : torch.Tensor or Quantized
        Weight ``[N, K]``: a float tensor is quantized under ``recipe.weight`` by the reference
        quantizer *once* and cached against the tensor's identity; a ``Quantized`` is used as is.
        The backend's ``prepare_weight`` runs once per weight and backend, and is cached too.
        A change to ``w`` rebuilds both, as ``weight_check`` sees changes.
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
    candidates : sequence of str, optional
        The backends ``"auto"`` chooses among (the reference is always added). By default every
        registered backend except entry-point plug-ins that ``FP8REF_ALLOW_BACKENDS`` does not
        name: installing a package does not put its kernel into every call.
    weight_check : {"sample", "version", "content"}, optional
        How a changed weight is noticed (default ``FP8REF_WEIGHT_CHECK``, else ``"sample"``).
        ``"version"``: by torch's version counters and storage pointers, O(1) per call; it sees
        ``copy_``, ``load_state_dict``, optimizer steps, in-place ops on ``w`` or its views,
        ``.data =``, but not writes torch does not count: in-place ops on ``w.data``, writes
        through ``w.numpy()`` or DLPack, changes to inference tensors. ``"sample"``: also
        compares a fixed sample of the weight's memory (one element in each of up to
        ``SAMPLE_ROWS`` rows, and a ``Quantized`` weight's whole scales) with its values when the
        cached form was built: it sees those uncounted writes when they change a sampled element
        (every bulk change, every row of a weight up to ``SAMPLE_ROWS`` rows), not a write off the
        sample. ``"content"``: compares all of the weight's bytes with a kept copy on every call
        (a read of the weight; every write is seen). docs/selection.md gives the costs.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` (empty when M = 0 or N = 0, as the reference computes it).

    Raises
    ------
    TypeError, ValueError
        The caller's errors, naming the argument, before any selection, probe or kernel (see
        ``check_linear_args``): a non-float, FP8, sparse, mkldnn, nested or meta ``x``, an FP8
        ``w`` without scales, shapes or devices that do not fit, a bias that is not a float
        ``[N]``, an ``out_dtype`` outside ``OUT_DTYPES``, NaN/Inf in ``x``, ``w`` or ``bias``,
        NaN codes in a ``Quantized`` weight, an unknown ``weight_check``.
    BackendUnavailableError
        A named (or ``FP8REF_BACKEND``-forced) backend that cannot run the case.

    Notes
    -----
    Under ``"auto"``, a backend that raises at run time on checked input is marked failed for
    this case (with one warning per backend) and the call is retried on the next compliant backend.

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
            return linear(x, w, bias, recipe=recipe, backend=backend, precision=precision, out_dtype=out_dtype,
                          candidates=candidates, weight_check=weight_check)
    check_x(x)
    if type(backend) is not str:
        raise TypeError(f"backend must be a backend name or 'auto', got {type(backend).__name__}")
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str (exact, strict, standard, fast), got {type(precision).__name__}")
    cands = None if candidates is None else _check_candidates(candidates)
    e = _entry(w, recipe, weight_check)
    od = check_call(x, e.N, e.K, e.qw.data.device, bias, out_dtype)
    shape = x.shape
    x2 = x if len(shape) == 2 else x.reshape(-1, e.K)
    M = x2.shape[0]
    env = _os.environ
    key = ((M - 1).bit_length() if M > 1 else 0, x.dtype, od, bias is not None, backend, precision, x.device, cands,
           env.get(_select.ENV_BACKEND), env.get(_select.ENV_CANDIDATES))  # DispatchKey's fields
    d = e.dispatch.get(key)
    if d is None or d.generation != _select.generation():
        check_values(x, bias)  # before any selection, probe or kernel
        d = _resolve_dispatch(e, _Request(x, x2, bias, od, DispatchKey._make(key)))
    elif not d.backend.rejects_non_finite:
        check_values(x, bias)
    grads = _grad_inputs(x, w, bias)
    if grads is None:
        y = _run(e, d, x, x2, bias, od, key)
    else:
        y = _without_gradient(lambda: _run(e, d, x, x2, bias, od, key), grads)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], e.N)


def _run(e: _WeightEntry, d: _Dispatch, x: torch.Tensor, x2: torch.Tensor, bias, od: torch.dtype,
         key: tuple) -> torch.Tensor:
    try:
        return d.backend.linear(x2, d.prepared, bias, od, d.scheme)
    except Exception as exc:
        # A backend that rejects NaN/Inf itself (rejects_non_finite) raised: the caller's error,
        # worded as on a first call (x's own index, not its flattened view's), and never blamed
        # on the backend under "auto". The kind checks again too: a failure on an input no
        # backend should have been given never marks backends failed.
        check_x(x)
        check_call(x, e.N, e.K, e.qw.data.device, bias, od)
        check_values(x, bias)
        if not d.auto:
            raise
        return _fallback(e, d, _Request(x, x2, bias, od, DispatchKey._make(key)), exc)


def _fallback(e: _WeightEntry, d: _Dispatch, req: _Request, exc: Exception) -> torch.Tensor:
    """The chosen backend raised under "auto" on checked input: mark it failed for this case and
    retry down the ranking (the reference is last)."""
    while True:
        _select.mark_failed(d.backend.name, d.key, exc)
        d = _resolve_dispatch(e, req)
        try:
            return d.backend.linear(req.x2, d.prepared, req.bias, req.out_dtype, d.scheme)
        except Exception as exc2:
            if d.backend.name == "reference":
                raise
            exc = exc2


def explain(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
            recipe: Recipe | str = W8A8_FP8, precision: str = "standard", out_dtype: torch.dtype | None = None,
            refresh: bool = False, print_table: bool = False,
            candidates: Sequence[str] | None = None) -> _select.Decision:
    """The table behind the decision ``fp8ref.linear(x, w, bias, ...)`` would make under "auto"
    (``candidates`` as in ``linear``).

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
    d = _select.select(case, precision, candidates=_check_candidates(candidates), refresh=refresh)
    if print_table:
        print(d.table())
    return d


def moe(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme, *,
        out_dtype: torch.dtype = torch.bfloat16, backend: str | MoeBackend = "auto") -> torch.Tensor:
    """An FP8 mixture-of-experts layer (docs/spec.md §7) on the chosen MoE backend.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, K]`` activations (float).
    weights : MoeWeights
        The experts' FP8 ``w13`` [E, 2I, K] and ``w2`` [E, K, I] with their scales (and static
        activation scales); ``fp8ref.quantize_experts`` makes them from float weights.
    routing : Routing
        The router's top-k ``ids`` and ``weights`` [T, k] (and an expert-parallel ``expert_map``).
    scheme : MoeScheme
        Weight, activation and intermediate schemes and the gate/up order.
    out_dtype : torch.dtype
        bf16 (default), fp16, fp32 or fp64.
    backend : str or MoeBackend
        ``"auto"`` (the first MoE backend that passes the compliance probe for this scheme, else the
        reference: ``fp8ref.select.moe``), a registered MoE backend's name, or an instance.

    Examples
    --------
    >>> import torch, fp8ref
    >>> s = fp8ref.QuantScheme(granularity="tensor")
    >>> scheme = fp8ref.MoeScheme(weight=s, activation=s, intermediate=s)
    >>> w = fp8ref.quantize_experts(torch.randn(4, 16, 32), torch.randn(4, 32, 8), s)
    >>> r = fp8ref.Routing(torch.tensor([[0, 3], [1, 1]]), torch.tensor([[0.7, 0.3], [0.5, 0.5]]))
    >>> fp8ref.moe(torch.randn(2, 32), w, r, scheme, backend="reference").shape
    torch.Size([2, 32])
    """
    if isinstance(backend, MoeBackend):
        b = backend
    elif backend == "auto":
        b = get_moe_backend(select_moe(scheme, out_dtype)[0])
    elif isinstance(backend, str):
        b = get_moe_backend(backend)
    else:
        raise TypeError(f"backend must be 'auto', a MoE backend's name or a MoeBackend, got {type(backend).__name__}")
    check_moe_args(x, weights, routing, scheme, out_dtype)
    reason = b.available() or b.supports(scheme, out_dtype)
    if reason:
        raise _select.BackendUnavailableError(f"MoE backend {b.name!r} cannot take {scheme.short_str()}: {reason}")
    return b.moe(x, weights, routing, scheme, out_dtype)
