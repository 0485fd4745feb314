"""The plan of a call: one weight under one case, resolved once and run by every warm call.

``fp8ref.linear`` keeps its plans in a per-weight table (``fp8ref.api.calls``); ``Fp8Linear`` and
the custom op ``torch.ops.fp8ref.linear`` hold a ``LayerPlans`` per weight. ``Plan.current``
defines whether a plan still holds; ``LayerPlans`` makes the same checks in one call into the
extension where it can (a backend's watched call, ``Backend.bind_watched_linear``, and the
extension's ``WeightWatch``: ``weightcheck.Watch``), and falls back to ``Plan.current`` whenever
one of them says no. The environment (``FP8REF_BACKEND``,
``FP8REF_CANDIDATES``, ``FP8REF_ALLOW_BACKENDS``, ``FP8REF_WEIGHT_CHECK``) is read when a plan is
built, never on a warm call: a change applies to plans built after it, and to every plan after
``fp8ref.select.clear_cache()``.

Imports flow from the spec, the registry, the selector and ``fp8ref.weightcheck`` into this module;
``fp8ref.api.calls`` imports it.
"""

from __future__ import annotations

import weakref as _weakref
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as _replace
from math import prod as _prod

import torch

from .. import select as _select
from ..kernels import native as _native
from ..registry import Backend as _Backend
from ..registry import Case as _Case
from ..registry import bound_call as _bound_call
from ..select import generation as _generation
from ..select.keys import bucket_lo, m_bucket
from ..spec.checks import check_call, check_values, check_weight, check_x
from ..spec.fenv import flushing as _flushing
from ..spec.fenv import ieee_subnormals as _ieee_subnormals
from ..spec.quant import Quantized, quantize
from ..spec.schemes import QuantScheme, Recipe
from ..weightcheck import MemorySample, Watch, pair_version, range_tensors
from ..weightcheck import snapshot as _snapshot
from ..weightcheck import version as _version
from ..weightcheck import weight_check_mode as _weight_check

__all__ = ["Plan", "LayerPlans", "WeightEntry", "Request", "STATS", "new_entry", "make_plan", "check_candidates"]

#: Counts weight quantizations and prepare_weight calls (tests check the cache is used).
STATS = {"quantize_weight": 0, "prepare_weight": 0}


@dataclass(frozen=True)
class Request:
    """One checked call, as a (re)selection needs it: built when a plan is made and when a backend
    raises, never on the warm path."""

    x: torch.Tensor  #: the caller's x (errors name its own indices, not the flattened view's)
    x2: torch.Tensor  #: x as [M, K]
    bias: torch.Tensor | None
    out_dtype: torch.dtype
    backend: str
    precision: str
    candidates: tuple[str, ...] | None


class WeightEntry:
    """One weight under one recipe: its Quantized form, per-backend prepared forms, plans, and
    under ``weight_check="sample"`` a ``MemorySample`` of the weight, under ``"content"`` a private
    copy of its bytes. Built whole, then put in the cache (a thread sees the old entry or the new)."""

    __slots__ = ("ref", "version", "recipe", "qw", "N", "K", "prepared", "plans", "kept", "sample", "check",
                 "__weakref__")

    def __init__(self, ref, version, recipe: Recipe, qw: Quantized, check: str,
                 kept: tuple[torch.Tensor, ...] | None, sample: MemorySample | None):
        self.ref, self.version, self.recipe, self.qw, self.check = ref, version, recipe, qw, check
        self.kept, self.sample = kept, sample
        self.N, self.K = qw.data.shape
        self.prepared: dict[str, object] = {}
        self.plans: dict[tuple, Plan] = {}

    def current(self, version: tuple) -> bool:
        """Whether the weight still is what this entry was built from, as its check sees it: the
        same version (counters, pointers, strides) and, under ``"sample"``, the same sampled memory
        (``"content"``'s byte comparison needs the weight itself: ``_entry`` runs it)."""
        return self.version == version and (self.sample is None or self.sample.same())


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """One weight under one case, resolved: what a warm call runs, and what it was resolved for.

    Built once per weight version and case (by ``fp8ref.linear``, ``Fp8Linear`` and the custom op
    alike), after every check of the case has passed; a warm call that finds it ``current`` runs
    ``backend.linear(x2, prepared, bias, out_dtype, scheme)``, scanning x and the bias for NaN/Inf
    first only where the backend does not (``scan``).
    """

    entry: WeightEntry  #: the weight: its quantized and prepared forms, version and sample
    backend: _Backend
    prepared: object  #: ``backend.prepare_weight(entry.qw)``
    scheme: QuantScheme  #: the activation scheme
    out_dtype: torch.dtype
    scan: bool  #: x and bias are checked for NaN/Inf per call (the backend does not reject them)
    decision_key: str | None  #: the selector's key under "auto" (a backend that raises is marked failed for it)
    generation: int  #: ``fp8ref.select.generation()`` when resolved
    bias: object = None  #: the bias object checked when built (``LayerPlans``; ``fp8ref.linear`` checks per call)
    #: ``backend.bind_linear(prepared, scheme, out_dtype)``: the warm call, ``fast(x2, bias)``, or
    #: None (``backend.linear``); a None result hands that call to ``backend.linear``
    fast: object = None
    #: ``backend.bind_watched_linear(...)`` (``LayerPlans`` only): ``fast`` that also checks that
    #: this plan holds (``Watch``), ``watched(x, bias, weight, scale)``; None where not bound
    watched: object = None

    def current(self, version: tuple) -> bool:
        """Whether the plan still holds for a weight whose ``version`` (``weightcheck.version``) is
        given: no selection changed since, and the weight is the one prepared (the definition the
        extension's checks in ``LayerPlans`` repeat in one call)."""
        return self.generation == _select.generation() and self.entry.current(version)


def new_entry(w, recipe: Recipe, check: str, drop=None) -> WeightEntry:
    """Check and quantize (a float weight) or check (a Quantized one): the weight's checks run once
    per weight and version (and sample, or content). ``drop`` is called with the weakref when
    ``w`` dies."""
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
    return WeightEntry(None if drop is None else _weakref.ref(w, drop), _version(w), recipe, qw, check, kept,
                        sample)


def check_candidates(candidates) -> tuple[str, ...] | None:
    if candidates is None:
        return None
    if isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates):
        raise TypeError(f"candidates must be a sequence of backend names (or None), got {candidates!r}")
    return tuple(candidates)


def make_plan(e: WeightEntry, req: Request, bias: object = None) -> Plan:
    """Resolve the backend of a checked call and prepare the weight for it (once per backend)."""
    recipe = e.recipe
    if not recipe.activation.dynamic:
        raise ValueError(f"recipe {recipe.name!r} has a static activation scheme; fp8ref.linear quantizes "
                         "activations dynamically (use reference_linear(..., input_scale=) for static scales)")
    case = _Case(M=req.x2.shape[0], N=e.N, K=e.K, recipe=recipe, x_dtype=req.x.dtype, out_dtype=req.out_dtype,
                 device=str(req.x.device), has_bias=req.bias is not None)
    gen = _select.generation()  # before resolving: a selection that changes meanwhile makes the plan stale
    b, decision = _select.resolve(case, req.backend, req.precision, candidates=req.candidates)
    prepared = e.prepared.get(b.name)
    if prepared is None:
        prepared = b.prepare_weight(e.qw)
        STATS["prepare_weight"] += 1
        e.prepared[b.name] = prepared
    return Plan(e, b, prepared, recipe.activation, req.out_dtype, not b.rejects_non_finite,
                None if decision is None else decision.key, gen, bias,
                _bound_call(b, prepared, recipe.activation, req.out_dtype))


def _bind_watched(p: Plan, key: tuple, weight: torch.Tensor, weight_scale: torch.Tensor):
    """``p.backend.bind_watched_linear(...)`` for a plan of ``LayerPlans`` (key: M bucket, x's
    dtype, device), or None: where the backend binds none, where binding fails, and where the
    weight is no longer the entry's (its version moved since the entry was built)."""
    e = p.entry
    if e.check not in ("sample", "version") or pair_version(weight, weight_scale) != e.version:
        return None
    bucket, x_dtype, _ = key
    watch = Watch.of((weight, weight_scale), e.sample, x_dtype, bucket_lo(bucket), bucket)
    try:
        fn = p.backend.bind_watched_linear(p.prepared, p.scheme, p.out_dtype, watch)
    except Exception:
        return None
    return fn if callable(fn) else None


def _native_watch(e: WeightEntry, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple | None:
    """``(e, WeightWatch)``: the extension's one-call check of what ``e.current`` checks for the
    layer's tensors (their versions, storage, sizes and strides, and the sample's bytes), or None
    where the extension is not loaded, the weight is not on the CPU, or it changed since ``e``."""
    mod = _native.loaded()
    if (mod is None or not hasattr(mod, "WeightWatch") or e.check not in ("sample", "version")
            or weight.device.type != "cpu" or weight_scale.device.type != "cpu"
            or pair_version(weight, weight_scale) != e.version):
        return None
    ranges = e.sample.byte_ranges() if e.sample is not None else None
    if e.sample is not None and ranges is None:
        return None
    try:
        watch = mod.WeightWatch(torch.zeros(1, dtype=torch.int64), [weight, weight_scale], list(e.version[:2]),
                                *range_tensors(ranges))
    except Exception:
        return None
    return e, watch


class LayerPlans:
    """The plans of one quantized weight held as two tensors (codes ``[N, K]``, dequantization
    scales) under one layer's settings: what ``Fp8Linear`` and ``torch.ops.fp8ref.linear`` hold.

    ``run`` is their warm path: a dict lookup of the case (``m_bucket(M)``, x's dtype and device),
    ``Plan.current``, the bias's identity, and the backend's ``linear``. The first call of a case
    checks everything ``fp8ref.linear`` checks and builds the plan (quantized and prepared forms
    are shared by the layer's cases, and rebuilt when the weight changes as ``weight_check``
    sees changes). ``run`` returns None where ``fp8ref.linear`` must take the call instead: a call
    that does not check out (``fp8ref.linear`` raises the error, in its words), grad mode with an
    input that requires grad, ``weight_check="content"``, and a backend that raises (its fallback
    under ``"auto"``).
    """

    __slots__ = ("recipe", "backend", "precision", "out_dtype", "candidates", "weight_check", "entry", "plans",
                 "last", "watch")

    def __init__(self, recipe: Recipe, backend: str = "auto", precision: str = "standard",
                 out_dtype: torch.dtype | None = None, candidates: Sequence[str] | None = None,
                 weight_check: str | None = None):
        self.recipe, self.backend, self.precision, self.out_dtype = recipe, backend, precision, out_dtype
        self.candidates, self.weight_check = candidates, weight_check
        self.entry: WeightEntry | None = None
        self.plans: dict[tuple, Plan] = {}
        #: the plan last run with a ``watched`` call: tried first (it checks its own case)
        self.last: Plan | None = None
        #: ``(entry, WeightWatch)``: the extension's check of the entry's weight (``_native_watch``)
        self.watch: tuple | None = None

    def run(self, x, weight: torch.Tensor, weight_scale: torch.Tensor, bias) -> torch.Tensor | None:
        """``fp8ref.linear(x, Quantized(weight, weight_scale), bias, ...)`` by the plan of x's case,
        or None (see the class)."""
        if type(x) is not torch.Tensor:
            return None
        p = self.last
        if p is not None and p.bias is bias and p.generation == _generation():
            try:  # the watched call checks the rest of the case and the plan itself (Watch)
                y = p.watched(x, bias, weight, weight_scale)
            except Exception:
                y = None
            if y is not None:
                return y
        shape = x.shape
        nd = len(shape)
        if nd == 2:
            M = shape[0]
        elif nd == 3:
            M = shape[0] * shape[1]
        elif nd:
            M = _prod(shape[:-1])
        else:
            return None
        key = (m_bucket(M), x.dtype, x.device)
        p = self.plans.get(key)
        if (p is None or p.bias is not bias or shape[-1] != p.entry.K
                or not self._current(p, weight, weight_scale)):
            p = self._build(x, x if nd == 2 else x.reshape(-1, shape[-1]), key, weight, weight_scale, bias)
            if p is None:
                return None
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return None
        if p.watched is not None:
            self.last = p
        try:
            if _flushing():  # subnormals kept whatever the thread flushes (inline, not @ieee: the warm path)
                with _ieee_subnormals():
                    return self._call(p, x, shape, bias)
            return self._call(p, x, shape, bias)
        except Exception:  # fp8ref.linear, next, raises the caller's error or falls back ("auto")
            return None

    @staticmethod
    def _call(p: Plan, x: torch.Tensor, shape: torch.Size, bias) -> torch.Tensor:
        """The plan's warm call: the scan where the backend does not reject NaN/Inf, then the bound
        call (it takes x as it is), else the backend's ``linear`` on x's rows."""
        if p.scan:
            check_values(x, bias)
        fast = p.fast
        if fast is not None:
            y = fast(x, bias)
            if y is not None:
                return y
        if len(shape) == 2:
            return p.backend.linear(x, p.prepared, bias, p.out_dtype, p.scheme)
        y = p.backend.linear(x.reshape(-1, shape[-1]), p.prepared, bias, p.out_dtype, p.scheme)
        return y.reshape(*shape[:-1], p.entry.N)

    def _current(self, p: Plan, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
        """``p.current(pair_version(weight, weight_scale))``, the weight's part checked by the
        extension's ``WeightWatch`` where the entry has one (the same checks: version, pointers,
        strides, and the sample's bytes, in one call)."""
        watch = self.watch
        if watch is not None and watch[0] is p.entry:
            return p.generation == _generation() and watch[1].current(weight, weight_scale)
        return p.current(pair_version(weight, weight_scale))

    def _build(self, x: torch.Tensor, x2: torch.Tensor, key: tuple, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias) -> Plan | None:
        """Check the call as ``fp8ref.linear`` does and plan it; on any error, plan nothing."""
        self.plans.pop(key, None)
        self.last = None
        try:
            e = self.entry
            if e is None or not e.current(pair_version(weight, weight_scale)):
                self.entry, self.plans = None, {}
                check = _weight_check(self.weight_check)  # the environment, read once per weight version
                if check == "content":  # fp8ref.linear compares the weight's bytes on every call
                    return None
                e = self.entry = new_entry(Quantized(weight, weight_scale, self.recipe.weight), self.recipe, check)
            check_x(x)
            od = check_call(x, e.N, e.K, e.qw.data.device, bias, self.out_dtype)
            check_values(x, bias)
            cands = check_candidates(self.candidates)
            p = make_plan(e, Request(x, x2, bias, od, self.backend, self.precision, cands), bias)
            p = _replace(p, watched=_bind_watched(p, key, weight, weight_scale))
            if self.watch is None or self.watch[0] is not e:  # after the selection, which loads the extension
                self.watch = _native_watch(e, weight, weight_scale)
        except Exception:  # fp8ref.linear, called next, raises it with its own wording
            return None
        self.plans[key] = p
        return p


