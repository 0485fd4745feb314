"""``fp8ref.linear`` and ``fp8ref.explain``, and the reference linear.

Every entry point that takes a caller's tensors (``linear``, ``explain``, ``reference_linear``, and
through ``linear`` ``Fp8Linear``) checks them with ``fp8ref.spec.checks`` before any selection,
probe or kernel runs: types, layouts and devices, dtypes, shapes, the output dtype, then NaN/Inf.
Each error names the offending argument. The checks of a weight run once per weight (they are
cached with its quantized form); the per-call checks cost a few microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import select as _select
from ..registry import Case as _Case
from ..select.keys import m_bucket
from ..spec.checks import X_DTYPES, check_call, check_linear_args, check_values, check_x
from ..spec.fenv import ieee as _ieee
from ..spec.gemm import scaled_mm
from ..spec.quant import Quantized, check_float_input, quantize
from ..spec.schemes import W8A8_FP8, Recipe, get_recipe
from ..weightcheck import ENV_WEIGHT_CHECK, SAMPLE_ROWS, WEIGHT_CHECKS, MemorySample, tensor_version
from ..weightcheck import same_content as _same_content
from ..weightcheck import version as _version
from ..weightcheck import weight_check_mode as _weight_check
from .plans import STATS, LayerPlans, Plan, Request, WeightEntry, check_candidates, make_plan, new_entry

__all__ = ["reference_linear", "quantize_weight", "flatten_activations", "linear", "explain", "clear_weight_cache",
           "tensor_version", "check_linear_args", "X_DTYPES", "WEIGHT_CHECKS", "ENV_WEIGHT_CHECK", "DispatchKey",
           "MemorySample", "SAMPLE_ROWS", "Plan", "LayerPlans", "STATS"]


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
# fp8ref.linear: the user-facing call, dispatched to the selected backend. Its plans
# (``fp8ref.api.plans``) live in a per-weight table: one dict lookup for the weight (keyed by id,
# checked against a weakref and ``WeightEntry.current``, and under "content" all of its bytes),
# one for the plan (a ``DispatchKey``), then the backend's call.


class DispatchKey(NamedTuple):
    """Everything besides the weight that decides which backend runs an ``fp8ref.linear`` call. The
    hot path builds the plain tuple in this field order (a NamedTuple's constructor costs more than
    the tuple, and equal tuples hash alike); a table miss names it with ``DispatchKey._make``."""

    m_bucket: int  #: ``fp8ref.select.m_bucket(M)``: the selector's power-of-two bucket
    x_dtype: torch.dtype
    out_dtype: torch.dtype
    has_bias: bool
    backend: str  #: "auto" or a name
    precision: str
    device: torch.device
    candidates: tuple[str, ...] | None  #: ``candidates=`` of the call


_WEIGHTS: dict[tuple[int, object], WeightEntry] = {}


def clear_weight_cache() -> None:
    """Drop every cached quantized / prepared weight (they are rebuilt on next use)."""
    _WEIGHTS.clear()


def _weight_entry(w, recipe: Recipe, key: tuple, check: str) -> WeightEntry:
    """``new_entry``, cached in ``_WEIGHTS`` against w's identity."""

    def _drop(ref, key=key, cache=_WEIGHTS):  # bound now: module globals are gone at interpreter exit
        e = cache.get(key)
        if e is not None and e.ref is ref:
            del cache[key]

    entry = new_entry(w, recipe, check, _drop)
    _WEIGHTS[key] = entry
    return entry


def _entry(w, recipe, weight_check: str | None) -> WeightEntry:
    """The cached entry of ``w``, rebuilt when ``w`` changed (as the entry's check sees changes).
    ``weight_check=None`` keeps the entry's mode, read from ``FP8REF_WEIGHT_CHECK`` when the entry
    was made (an environment read per call would cost a microsecond)."""
    # A Recipe is keyed by id (the entry holds it, so the id stays valid); a preset name by value.
    wkey = (id(w), recipe if recipe.__class__ is str else id(recipe))
    e = _WEIGHTS.get(wkey)
    if (e is None or e.ref() is not w or not e.current(_version(w))
            or (weight_check is not None and weight_check != e.check)
            or (e.kept is not None and not _same_content(w, e.kept))):
        e = _weight_entry(w, get_recipe(recipe), wkey, _weight_check(weight_check))
    return e


@_ieee
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
    check_x(x)
    if type(backend) is not str:
        raise TypeError(f"backend must be a backend name or 'auto', got {type(backend).__name__}")
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str (exact, strict, standard, fast), got {type(precision).__name__}")
    cands = None if candidates is None else check_candidates(candidates)
    e = _entry(w, recipe, weight_check)
    od = check_call(x, e.N, e.K, e.qw.data.device, bias, out_dtype)
    shape = x.shape
    x2 = x if len(shape) == 2 else x.reshape(-1, e.K)
    key = (m_bucket(x2.shape[0]), x.dtype, od, bias is not None, backend, precision, x.device, cands)  # DispatchKey
    p = e.plans.get(key)
    if p is None or p.generation != _select.generation():
        check_values(x, bias)  # before any selection, probe or kernel
        p = e.plans[key] = make_plan(e, Request(x, x2, bias, od, backend, precision, cands))
    elif p.scan:
        check_values(x, bias)
    grads = _grad_inputs(x, w, bias)
    if grads is None:
        y = _run(p, key, x, x2, bias, od)
    else:
        y = _without_gradient(lambda: _run(p, key, x, x2, bias, od), grads)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], e.N)


def _run(p: Plan, key: tuple, x: torch.Tensor, x2: torch.Tensor, bias, od: torch.dtype) -> torch.Tensor:
    try:
        fast = p.fast  # the backend's bound call (bind_linear), made for the plan's out_dtype
        y = fast(x2, bias) if fast is not None and od is p.out_dtype else None
        return p.backend.linear(x2, p.prepared, bias, od, p.scheme) if y is None else y
    except Exception as exc:
        # A backend that rejects NaN/Inf itself (rejects_non_finite) raised: the caller's error,
        # worded as on a first call (x's own index, not its flattened view's), and never blamed
        # on the backend under "auto". The kind checks again too: a failure on an input no
        # backend should have been given never marks backends failed.
        e = p.entry
        check_x(x)
        check_call(x, e.N, e.K, e.qw.data.device, bias, od)
        check_values(x, bias)
        if p.decision_key is None:
            raise
        k = DispatchKey._make(key)
        return _fallback(p, key, Request(x, x2, bias, od, k.backend, k.precision, k.candidates), exc)


def _fallback(p: Plan, key: tuple, req: Request, exc: Exception) -> torch.Tensor:
    """The chosen backend raised under "auto" on checked input: mark it failed for this case and
    retry down the ranking (the reference is last)."""
    while True:
        _select.mark_failed(p.backend.name, p.decision_key, exc)
        p = p.entry.plans[key] = make_plan(p.entry, req)
        try:
            return p.backend.linear(req.x2, p.prepared, req.bias, req.out_dtype, p.scheme)
        except Exception as exc2:
            if p.backend.name == "reference":
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
    d = _select.select(case, precision, candidates=check_candidates(candidates), refresh=refresh)
    if print_table:
        print(d.table())
    return d
