"""The backend API (public and stable) and the registry of backends.

A backend is a real implementation of the two FP8 ops; it declares how it accumulates and how
many times it rounds to the output dtype, which fixes the error bound it is checked against
(``fp8ref.spec.bounds.gemm_error_bound``) and its precision class. It says *why* it cannot take a
case (``supports`` returns a reason string) instead of failing or computing something else.

Third-party backends register with ``register_backend`` or through the entry-point group
``fp8ref.backends`` (each entry point names a Backend subclass or instance). A backend that came
in through an entry point (installing a package is enough) is listed and usable by name, but the
selector's ``auto`` considers it only when the user allows it: by naming it in ``candidates=``
or ``FP8REF_CANDIDATES``, or in the allow-list ``FP8REF_ALLOW_BACKENDS`` (``is_trusted``).

The registry loads once per process, under a lock: every thread that asks for it waits until
every shipped backend and entry point is registered, so no thread ever sees half of it. A load
that is interrupted (``KeyboardInterrupt``) or fails is undone, so the next call loads afresh; a
child forked during a load gets a fresh lock and loads again.

MoE implementations (``MoeBackend``, docs/spec.md §7) have a registry of their own here: a MoE
layer is another op with another declaration (``MoeAccuracy``), not a dense backend's case.

Why this module is long: it holds both registries, which share the loading lock and the rules of
registration.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

import torch

from . import _env
from .spec.bounds import Accumulation, PrecisionClass, check_output_roundings, precision_class
from .spec.layouts import ScaleLayout
from .spec.moe import MoeScheme, MoeWeights, Routing
from .spec.moe_bounds import MoeAccuracy
from .spec.quant import Quantized
from .spec.schemes import QuantScheme, Recipe

__all__ = ["Backend", "Case", "BackendInfo", "NonFinite", "ScaleLayout", "RAISE", "PROPAGATE", "SPEC_NON_FINITE",
           "non_finite_policy", "register_backend", "bound_call",
           "unregister_backend", "get_backend", "backends", "ENTRY_POINT_GROUP", "ENV_ALLOW", "OPS", "decline_reason",
           "backend_quantize", "is_trusted", "origin", "MoeBackend", "register_moe_backend", "get_moe_backend",
           "moe_backends"]

ENTRY_POINT_GROUP = "fp8ref.backends"
#: Comma-separated names of entry-point backends that ``auto`` may consider without being named in
#: ``candidates=`` (``*``: all of them).
ENV_ALLOW = "FP8REF_ALLOW_BACKENDS"

#: The ops a backend can declare (``Backend.ops``) and a case can ask for (``Case.op``).
OPS = ("quantize", "scaled_mm", "linear")

#: Modules of the backends shipped with fp8ref, imported on first use of the registry.
_BUILTIN_MODULES = ("fp8ref.kernels.reference", "fp8ref.kernels.torch_mm", "fp8ref.kernels.cpu",
                    "fp8ref.kernels.triton_kernels", "fp8ref.kernels.sgl",
                    "fp8ref.kernels.cpu_fp8", "fp8ref.kernels.cpu_fp8_amx")


#: The two answers a backend may give to a NaN or +-Inf in an input (``NonFinite``).
RAISE = "raise"
PROPAGATE = "propagate"


@dataclass(frozen=True)
class NonFinite:
    """What a backend promises to do with NaN or +-Inf in each kind of input: ``RAISE``
    (``ValueError`` before any output exists), ``PROPAGATE`` (every output value computed from the
    non-finite input is NaN or +-Inf) or None, the default: not declared, and then either of the two
    is accepted. A finite value standing in for a non-finite one is never on offer: that is the
    defect (docs/spec.md, "The calling contract", special values; docs/conformance.md, "Defects,
    and what a declaration changes"). A declaration narrows what the contracts ``*.non_finite``
    accept to the one answer; it never accepts a defect.

    ``SPEC_NON_FINITE`` holds the spec's own answers (``fp8ref.quantize`` and ``fp8ref.scaled_mm``),
    which the shipped backends declare.

    Attributes
    ----------
    x : str or None
        Activations given to ``quantize`` and ``linear``. Propagating means: the dequantized value
        of a non-finite element (code times scale) is non-finite, and so is every output row of
        ``linear`` whose activation row holds one.
    static_scale : str or None
        The caller's scale of a static scheme (``quantize``/``linear`` ``scale=``); also zero or
        negative there (the spec refuses those too). Propagating: the dequantized values of its
        block are non-finite.
    codes : str or None
        NaN (and E5M2's Inf) codes in a ``Quantized`` operand of ``scaled_mm``.
    scales : str or None
        NaN/Inf in a ``Quantized.scale`` given to ``scaled_mm``.
    bias : str or None
        NaN/Inf in the bias of ``scaled_mm`` and ``linear``.

    Propagating in ``scaled_mm``: y[m, n] is NaN or +-Inf wherever row m of ``a`` (codes or
    scales), row n of ``b`` or ``bias[n]`` holds a non-finite value.
    """

    x: str | None = None
    static_scale: str | None = None
    codes: str | None = None
    scales: str | None = None
    bias: str | None = None

    def __post_init__(self) -> None:
        for k, v in vars(self).items():
            if v not in (RAISE, PROPAGATE, None):
                raise ValueError(f"NonFinite.{k} must be {RAISE!r}, {PROPAGATE!r} or None (not declared), got {v!r}")


#: The spec's own answers: NaN/Inf in x, a static scale or the bias raise ValueError; in the codes
#: and scales of a ``Quantized`` operand they propagate.
SPEC_NON_FINITE = NonFinite(x=RAISE, static_scale=RAISE, codes=PROPAGATE, scales=PROPAGATE, bias=RAISE)


def non_finite_policy(backend: Backend) -> NonFinite:
    """What ``backend`` has promised for non-finite inputs: its ``non_finite`` declaration, with x
    and bias ``RAISE`` where it declares ``rejects_non_finite`` and leaves them undeclared."""
    nf = backend.non_finite
    if backend.rejects_non_finite:
        nf = replace(nf, x=nf.x or RAISE, bias=nf.bias or RAISE)
    return nf


@dataclass(frozen=True)
class Case:
    """One problem a backend is asked to take: y[M, N] = x[M, K] w[N, K]^T under ``recipe``.

    ``op`` says which call the case is for: ``"linear"`` (the default: quantize the activation,
    then scaled_mm), ``"scaled_mm"`` (quantized operands given) or ``"quantize"`` (only the
    activation ``[M, K]`` under ``recipe.activation``; N is unused). A backend takes a case only if
    it declares the op (``Backend.ops``) and ``supports`` returns None; ``decline_reason`` asks both.
    """

    M: int
    N: int
    K: int
    recipe: Recipe
    x_dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    has_bias: bool = False
    op: str = "linear"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Case.op must be one of {OPS}, got {self.op!r}")

    def short_str(self) -> str:
        op = "" if self.op == "linear" else f"{self.op}-"
        return (f"{op}M{self.M}-N{self.N}-K{self.K}-{self.recipe.name}-{str(self.x_dtype)[6:]}"
                f"-{str(self.out_dtype)[6:]}-{self.device}{'-bias' if self.has_bias else ''}")


class Backend:
    """Base class of every backend. Subclasses set ``name`` and ``accumulation`` and implement
    ``quantize`` and ``scaled_mm``; they override ``available`` and ``supports`` to decline.

    Attributes
    ----------
    name : str
        Registry key.
    accumulation : Accumulation
        Declared accumulation along K (``Accumulation.FP32`` unless stated).
    output_roundings : int
        How many times the result is rounded to the output dtype, an int >= 1: 1 for an fp32 (or
        wider) epilogue, 2 when once before (a bf16 GEMM whose output is scaled afterwards, a bias
        added to the rounded product), 3 when the product, the scaled value and the bias sum are each
        rounded (docs/spec.md §5.2, "More than one output rounding", says where the intermediate
        roundings may sit). ``register_backend`` rejects anything else.
    ops : tuple of str
        The ops the backend implements and asks to be certified for (``OPS``); a quantizer-only
        backend declares ``("quantize",)``, a GEMM that takes the reference's codes
        ``("scaled_mm",)``. ``linear`` needs both (the default hook composes them).
    rejects_non_finite : bool
        True when ``quantize`` and ``linear`` raise ``ValueError`` for NaN/Inf in ``x``, and
        ``scaled_mm`` and ``linear`` for NaN/Inf in ``bias``, as the spec does. ``fp8ref.linear``
        then leaves those scans to the backend after a case's first call (they cost a pass over
        ``x`` per call); otherwise it scans before every call. The selector's probe checks the
        claim, and the contracts ``*.non_finite`` hold x and bias to it (``non_finite_policy``).
        Default False.
    non_finite : NonFinite
        What each entry point promises for NaN/Inf in each kind of input (raise or propagate, per
        kind). The default declares nothing: raising ``ValueError`` and propagating are both
        accepted, a finite stand-in never is. The conformance contracts ``*.non_finite`` check it,
        on every entry point the backend claims.
    precision : PrecisionClass
        Derived, not declared: the smallest precision class that holds ``accumulation`` and
        ``output_roundings`` (``fp8ref.spec.bounds.precision_class``).
    conformance_max_elems : int or None
        For a backend that pays per element (an interpreter): the most elements per operand the
        conformance suite gives it; it then also gets fewer rows, the secondary contracts on every
        fourth sweep item and the profile's ``slow_examples`` search examples (the report says so).
        A count, never a time, so a derandomized profile checks the same examples on every machine.
        Default None: the profile's own limits.
    conformance_max_examples : int or None
        The most search examples per contract the conformance suite draws for this backend, when
        fewer than the profile's (pinned examples and the corner sweep always run). Default None.
    time_budget_s : float or None
        A longer per-contract search budget than the profile's, for a backend that compiles per
        shape (jax's XLA jit), so its pinned examples and sweep run; reports say so. Default None.
    bench_skip_reason : str or None
        Why ``fp8ref bench`` leaves this backend out by default (its times would say nothing about
        the kernel, e.g. under an interpreter). Default None: benchmarked.
    float_weight : bool
        True for a layer that takes the *float* weight ``[N, K]`` and quantizes it itself (a
        framework's quantized layer, online weight quantization): ``prepare_weight`` then receives
        that tensor (x's dtype) instead of the spec's ``Quantized``, and the ``linear`` contracts
        judge the layer end to end against ``linear_error_bound`` (computed from the spec's own
        quantization of ``x`` and ``w``, never from the layer's). ``fp8ref.linear``, the selector and
        ``Fp8Linear`` hand backends quantized weights, so ``register_backend`` refuses such a
        backend; it is certified from outside (``fp8ref.conformance.check``, ``fp8ref certify``).
        Default False.
    scale_layout : ScaleLayout
        How the backend holds scales in memory (``fp8ref.spec.layouts``; docs/spec.md, "Scale
        storage layouts"): ``activation`` for ``scaled_mm``'s ``a`` and what ``quantize`` returns,
        ``weight`` for what ``prepare_weight`` receives. Default: the logical float tensor of
        ``fp8ref.Quantized`` on both. A backend declaring another layout receives a
        ``fp8ref.spec.layouts.StoredQuantized`` in that layout (its padding poisoned by the
        conformance suite) and returns one from ``quantize``, which the suite reads through the
        reference decoder. ``fp8ref.linear`` hands backends logical scales, so ``register_backend``
        refuses such a backend; it is certified from outside (``fp8ref.conformance.check``).
    version : str or None
        What the selector's cache key holds of this backend's code beyond its class and
        declaration (a digest of native sources, a library's version): a decision timed on other
        code is not reused. Default None: nothing beyond the class.
    """

    name: str = ""
    accumulation: Accumulation = Accumulation.FP32
    output_roundings: int = 1
    ops: tuple[str, ...] = OPS
    rejects_non_finite: bool = False
    non_finite: NonFinite = NonFinite()
    conformance_max_elems: int | None = None
    conformance_max_examples: int | None = None
    time_budget_s: float | None = None
    bench_skip_reason: str | None = None
    float_weight: bool = False
    scale_layout: ScaleLayout = ScaleLayout()
    version: str | None = None

    @property
    def precision(self) -> PrecisionClass:
        return precision_class(self.accumulation, self.output_roundings)

    def available(self) -> str | None:
        """None if the backend can run on this machine, else the reason it cannot."""
        return None

    def supports(self, case: Case) -> str | None:
        """None if the backend takes ``case``, else the reason it does not."""
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        """Quantize ``x [rows, cols]`` under ``scheme``, as ``fp8ref.quantize`` defines it.

        ``scale`` is the caller's dequantization scale for a static scheme (``scheme.dynamic``
        False; shape ``scheme.scale_shape(rows, cols)``), None for a dynamic one. A backend that
        cannot take static scales declines static schemes in ``supports``.
        """
        raise NotImplementedError(f"backend {self.name!r} does not implement quantize")

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} does not implement scaled_mm")

    def linear(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, scheme: QuantScheme | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """Optional fused hook: ``scaled_mm(quantize(x, scheme, scale), w, bias, out_dtype)`` for a
        2-D ``x`` and a (prepared) weight ``w``; ``scheme`` defaults to ``W8A8_FP8.activation``;
        ``scale`` is the static activation scale of a static scheme.

        ``fp8ref.linear``, the selector's probe and timing, and ``Fp8Linear`` call this, so a
        backend can skip materialising the FP8 activation codes (the CPU backends write the
        quantized values straight into their GEMM's input dtype). An override must return what the
        two calls return, bit for bit: the conformance contract ``linear_matches_two_calls`` and
        the selector's probe check it.
        """
        if scheme is None:
            from .spec.schemes import W8A8_FP8

            scheme = W8A8_FP8.activation
        return self.scaled_mm(backend_quantize(self, x, scheme, scale), w, bias, out_dtype)

    def bind_linear(self, w: Any, scheme: QuantScheme, out_dtype: torch.dtype) -> Callable | None:
        """Optional warm-path hook: a callable ``fn(x, bias)`` for one prepared weight ``w``,
        activation ``scheme`` and ``out_dtype``, or None (the default: calls take ``linear``).

        A plan (``fp8ref.api.plans``) binds once, when it is built, and its warm calls run
        ``fn(x, bias)`` instead of ``linear(x, w, bias, out_dtype, scheme)``: what a backend can
        settle once per plan (its code path, the kernel's fixed arguments) then costs nothing per
        call. ``fn`` returns exactly what ``linear`` returns, bit for bit, or None to hand that call
        to ``linear`` (which raises or handles it); it never raises for a call ``linear`` accepts.
        ``x`` is a tensor of the plan's dtype and device whose last dimension is ``w``'s K (its
        rows are all the others: ``fn`` returns ``[..., N]``), ``bias`` the layer's bias or None.
        """
        return None

    def bind_watched_linear(self, w: Any, scheme: QuantScheme, out_dtype: torch.dtype, watch: Any) -> Callable | None:
        """Optional warm-path hook: ``bind_linear``'s call that also checks, in its own code, that
        the plan still holds: a callable ``fn(x, bias, weight, scale)``, or None (the default).

        ``watch`` (``fp8ref.api.plans.Watch``) says what the plan was built for: x's dtype, the
        range of x's rows (the plan's M bucket), the layer's weight tensors (codes, scales) with
        their versions, and under ``weight_check="sample"`` the sample's byte ranges and bytes
        (``MemorySample.byte_ranges``). ``fn`` returns what ``bind_linear``'s call returns, or None
        (and computes nothing) unless x has that dtype and row count, no gradient is wanted, the
        ``weight`` and ``scale`` passed have the storage, version, sizes and strides watched, the
        sampled bytes are unchanged, and the backend's own kernel settings are those of binding.
        ``Fp8Linear``'s warm call is then ``fn`` alone (``fp8ref.api.plans.LayerPlans.run``)."""
        return None

    def prepare_weight(self, w: Quantized) -> Any:
        """Optional load-time hook: turn a quantized weight into whatever ``scaled_mm`` is fastest
        with (a layout change, a wider copy). The default keeps the Quantized as is. A backend that
        declares ``float_weight`` receives the float weight ``[N, K]`` here instead."""
        return w

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.precision.value}>"


def _takes_scale(backend: Backend) -> bool:
    """Whether ``backend.quantize`` has a ``scale`` parameter (backends written before it had none)."""
    try:
        params = inspect.signature(backend.quantize).parameters
    except (TypeError, ValueError):
        return True
    return "scale" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def backend_quantize(backend: Backend, x: torch.Tensor, scheme: QuantScheme,
                     scale: torch.Tensor | None = None) -> Quantized:
    """``backend.quantize(x, scheme, scale=scale)``; ``scale`` is passed only when given, so a
    backend whose ``quantize(x, scheme)`` predates static scales still runs dynamic schemes."""
    if scale is None:
        return backend.quantize(x, scheme)
    if not _takes_scale(backend):
        raise TypeError(f"backend {backend.name!r}: quantize(x, scheme) takes no scale=, so it cannot run the "
                        f"static scheme {scheme.short_str()}")
    return backend.quantize(x, scheme, scale=scale)


def bound_call(backend: Backend, w: Any, scheme: QuantScheme, out_dtype: torch.dtype) -> Callable | None:
    """``backend.bind_linear(w, scheme, out_dtype)``, or None where the backend binds nothing or
    binding raises: its calls then take ``backend.linear``, which reports whatever is wrong. What a
    plan's warm calls run (``fp8ref.api.plans``) and what the selector times (``fp8ref.select.timing``)."""
    try:
        fast = backend.bind_linear(w, scheme, out_dtype)
    except Exception:
        return None
    return fast if callable(fast) else None


def decline_reason(backend: Backend, case: Case) -> str | None:
    """Why ``backend`` does not take ``case`` (None if it does): the op is not among
    ``backend.ops``, a static scheme meets a ``quantize`` without ``scale=``, or ``supports`` says
    so. A ``supports`` that raises is a decline with the exception as its reason."""
    if case.op not in backend.ops:
        return f"backend {backend.name!r} declares ops {tuple(backend.ops)}, not {case.op}"
    act = case.recipe.activation  # weights reach a backend already quantized; activations it quantizes
    if case.op != "scaled_mm" and not act.dynamic and not _takes_scale(backend):
        return f"backend {backend.name!r}: quantize takes no scale=, so no static scheme ({act.short_str()})"
    try:
        return backend.supports(case)
    except Exception as exc:
        return f"supports() raised {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str | None
    precision: str
    accumulation: str
    output_roundings: int
    #: ``"fp8ref"`` (shipped), ``"registered"`` (``register_backend`` called by the user's code) or
    #: ``"entry-point"`` (installed package; ``auto`` considers it only when allowed).
    origin: str = "fp8ref"
    #: Whether ``auto`` considers it without the backend being named in ``candidates=``.
    trusted: bool = True


_REGISTRY: dict[str, Backend] = {}
#: Names registered from the ``fp8ref.backends`` entry points.
_ENTRY_POINT_NAMES: set[str] = set()
_loaded = False
_loading = False
#: Held while the registry loads: a second thread waits for the whole registry, never half of it.
#: Re-entrant, for a backend module that looks the registry up while it is imported.
_LOAD_LOCK = threading.RLock()


def _ensure_loaded() -> None:
    global _loaded, _loading
    if _loaded:
        return
    with _LOAD_LOCK:
        if _loaded or _loading:  # _loading: this very thread, inside a backend module's import
            return
        _loading = True
        before = set(_REGISTRY)
        modules = [m for m in _BUILTIN_MODULES if m not in sys.modules]
        try:
            _load()
            _loaded = True  # only now: every backend is in
        except BaseException:
            # Interrupted (KeyboardInterrupt, SystemExit) or failed half way: undo what this attempt
            # did, so the next call loads afresh instead of meeting half a registry ("a backend named
            # 'torch' is already registered"): the backends it registered go, and so do the backend
            # modules it imported (importing them again is what registers their backends).
            for name in set(_REGISTRY) - before:
                del _REGISTRY[name]
                _ENTRY_POINT_NAMES.discard(name)
            for mod in modules:
                sys.modules.pop(mod, None)
            raise
        finally:
            _loading = False


def _reset_lock_after_fork() -> None:
    """A child forked while another thread loaded the registry would wait for ever on the lock that
    thread held; the child gets a fresh lock (and loads again if the load had not finished)."""
    global _LOAD_LOCK, _loading
    _LOAD_LOCK = threading.RLock()
    _loading = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def _load() -> None:
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            backend = obj() if isinstance(obj, type) else obj
            if backend.name not in _REGISTRY:
                register_backend(backend)
                _ENTRY_POINT_NAMES.add(backend.name)
        except Exception as exc:  # a broken plug-in must not break fp8ref; say so once
            warnings.warn(f"fp8ref: backend entry point {ep.name!r} failed to load: {exc!r}", stacklevel=2)


def origin(name: str) -> str:
    """Where backend ``name`` came from: ``"fp8ref"``, ``"registered"`` or ``"entry-point"``."""
    b = get_backend(name)
    if name in _ENTRY_POINT_NAMES:
        return "entry-point"
    return "fp8ref" if type(b).__module__.startswith("fp8ref.") else "registered"


def is_trusted(name: str) -> bool:
    """Whether ``auto`` may consider backend ``name`` without the user naming it in ``candidates=``:
    every shipped backend and every one the user's code registered; an entry-point backend only
    when ``FP8REF_ALLOW_BACKENDS`` names it (or is ``*``). Installing a package is not a choice
    to run its kernel in every ``fp8ref.linear`` and audit."""
    if name not in _ENTRY_POINT_NAMES:
        return True
    allow = _env.get(ENV_ALLOW)
    return "*" in allow or name in allow


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry (``replace=True`` to overwrite a name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"expected an fp8ref.Backend instance, got {type(backend).__name__}")
    if not backend.name or not isinstance(backend.name, str):
        raise ValueError("a backend needs a non-empty str name")
    if not isinstance(backend.accumulation, Accumulation):
        raise TypeError(f"backend {backend.name!r}: accumulation must be an fp8ref.Accumulation")
    try:
        check_output_roundings(backend.output_roundings)
    except ValueError as exc:
        raise ValueError(f"backend {backend.name!r}: {exc}") from None
    ops = backend.ops
    if not isinstance(ops, (tuple, list, frozenset, set)) or not ops or not set(ops) <= set(OPS):
        raise ValueError(f"backend {backend.name!r}: ops must be a non-empty collection of {OPS}, got {ops!r}")
    nf = backend.non_finite
    if not isinstance(nf, NonFinite):
        raise TypeError(f"backend {backend.name!r}: non_finite must be an fp8ref.NonFinite, got {type(nf).__name__}")
    if backend.rejects_non_finite and PROPAGATE in (nf.x, nf.bias):
        raise ValueError(f"backend {backend.name!r}: rejects_non_finite says NaN/Inf in x and bias raise, but "
                         f"non_finite declares x={nf.x!r}, bias={nf.bias!r}")
    if backend.float_weight:
        raise ValueError(f"backend {backend.name!r} declares float_weight (it quantizes the float weight itself): "
                         "fp8ref.linear hands backends the spec's quantized weight; certify it with "
                         "fp8ref.conformance.check instead of registering it")
    layout = backend.scale_layout
    if not isinstance(layout, ScaleLayout):
        raise TypeError(f"backend {backend.name!r}: scale_layout must be an fp8ref.ScaleLayout, got "
                        f"{type(layout).__name__}")
    if not layout.logical:
        raise ValueError(f"backend {backend.name!r} declares scale layouts {layout}: fp8ref.linear hands backends "
                         "logical float scales; certify it with fp8ref.conformance.check instead of registering it")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered (pass replace=True)")
    _ENTRY_POINT_NAMES.discard(backend.name)  # the user's own registration: their choice
    _REGISTRY[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    _ensure_loaded()
    if name == "reference":
        raise ValueError("the reference backend cannot be unregistered")
    _REGISTRY.pop(name, None)
    _ENTRY_POINT_NAMES.discard(name)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (KeyError listing the known names otherwise)."""
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no backend named {name!r}; registered: {sorted(_REGISTRY)}") from None


def backends() -> list[BackendInfo]:
    """Every registered backend, with whether it is available here and why not."""
    _ensure_loaded()
    out = []
    for b in list(_REGISTRY.values()):  # a snapshot: another thread may register meanwhile
        try:
            reason = b.available()
        except Exception as exc:
            reason = f"available() raised {exc!r}"
        out.append(BackendInfo(b.name, reason is None, reason, b.precision.value, b.accumulation.name,
                               b.output_roundings, origin(b.name), is_trusted(b.name)))
    return out


class MoeBackend:
    """Base class of an FP8 mixture-of-experts implementation (``fp8ref.moe``; docs/spec.md §7).

    Subclasses set ``name`` and ``accuracy`` (how the layer computes: it fixes the bound
    ``fp8ref.spec.moe_bounds.moe_error_bound`` checks it against) and implement ``moe``; they
    override ``available`` and ``supports`` to decline, with a reason.

    Attributes
    ----------
    name : str
        Key in the MoE registry (its own namespace: the dense backends' names are not MoE ones).
    accuracy : MoeAccuracy
        Declared accumulation, intermediate dtypes and roundings.
    conformance_max_elems : int or None
        For an interpreter: the most elements of x and of one expert's w13 the MoE contracts give it.
    """

    name: str = ""
    accuracy: MoeAccuracy = MoeAccuracy()
    conformance_max_elems: int | None = None

    def available(self) -> str | None:
        """None if the backend can run on this machine, else the reason it cannot."""
        return None

    def supports(self, scheme: MoeScheme, out_dtype: torch.dtype) -> str | None:
        """None if the backend takes this scheme and output dtype, else the reason it does not."""
        return None

    def moe(self, x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The MoE layer ``fp8ref.spec.moe.moe_reference`` defines, computed as ``accuracy`` declares."""
        raise NotImplementedError(f"MoE backend {self.name!r} does not implement moe")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.accuracy.short_str()}>"


_MOE_REGISTRY: dict[str, MoeBackend] = {}
#: Modules of the MoE backends shipped with fp8ref, imported on first use of the MoE registry.
_MOE_MODULES = ("fp8ref.kernels.moe",)


def register_moe_backend(backend: MoeBackend, *, replace: bool = False) -> MoeBackend:
    """Add ``backend`` to the MoE registry (``replace=True`` to overwrite a name)."""
    if not isinstance(backend, MoeBackend):
        raise TypeError(f"expected an fp8ref.MoeBackend instance, got {type(backend).__name__}")
    if not backend.name or not isinstance(backend.name, str):
        raise ValueError("a MoE backend needs a non-empty str name")
    if not isinstance(backend.accuracy, MoeAccuracy):
        raise TypeError(f"MoE backend {backend.name!r}: accuracy must be an fp8ref MoeAccuracy")
    if backend.name in _MOE_REGISTRY and not replace:
        raise ValueError(f"a MoE backend named {backend.name!r} is already registered (pass replace=True)")
    _MOE_REGISTRY[backend.name] = backend
    return backend


def get_moe_backend(name: str) -> MoeBackend:
    """The registered MoE backend called ``name`` (KeyError listing the known names otherwise)."""
    moe_backends()
    try:
        return _MOE_REGISTRY[name]
    except KeyError:
        raise KeyError(f"no MoE backend named {name!r}; registered: {sorted(_MOE_REGISTRY)}") from None


def moe_backends() -> list[str]:
    """The names of every registered MoE backend, the reference first."""
    with _LOAD_LOCK:
        for mod in _MOE_MODULES:
            importlib.import_module(mod)
    return sorted(_MOE_REGISTRY, key=lambda n: (n != "reference", n))
