"""What every check shares: the outcomes a check raises (``ContractViolation``, ``Declined``), the
calls into a backend (with its own thread count, outputs poisoned first), bit and bound
comparisons that locate the worst element (``fp8ref.spec.compare``), and the cache of reference
results. Imports flow down: this module imports the registry and the spec only; the per-op
modules (``quantize``, ``scaled_mm``, ``linear``) import it.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..registry import Backend, Case, backend_quantize, decline_reason
from ..spec import layouts, quant
from ..spec.compare import compare, compare_bits
from ..spec.quant import Quantized
from .given import GIVEN_PROBLEMS

__all__ = ["ContractViolation", "Declined", "poison_allocator", "reference_threads", "backend_threads",
           "backend_device", "require_supported", "to_backend_device", "to_host", "call_quantize", "spec_quantize",
           "build_problem", "call_scaled_mm", "same_bits", "first_diff", "check_within", "negate_codes",
           "cached_reference", "copy_quantized", "to_backend_layout", "from_backend_layout"]


class ContractViolation(AssertionError):
    """A backend broke a contract; the message locates the worst element.

    ``ratio`` is the failing example's worst error/bound where the contract compares with a bound
    (None for a structural violation: a NaN code, a wrong shape, differing bits).
    """

    def __init__(self, message: str, ratio: float | None = None):
        super().__init__(message)
        self.ratio = ratio


class Declined(Exception):
    """The example is outside this backend's ``supports`` or outside the contract's premise."""


# --------------------------------------------------------------------------------------------
# helpers


def require_supported(backend: Backend, case: Case) -> None:
    reason = decline_reason(backend, case)
    if reason is not None:
        raise Declined(f"supports: {reason}")


def poison_allocator(shape: tuple[int, ...], device: str | torch.device = "cpu", value: float = float("nan")) -> None:
    """Fill freshly freed memory of the output's size with ``value`` before a backend allocates.

    A caching allocator (CUDA) hands the same block back to the next allocation of that size,
    and glibc's free lists often do on CPU, so an element the backend never writes reads as
    ``value`` instead of a lucky zero. A heuristic, not a guarantee on CPU: the bound contract
    still catches most unwritten elements whose reference value is non-zero.
    """
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = torch.full(shape, value, dtype=dt, device=device)
        del t


#: Threads the backend runs with while the reference and the bounds run single-threaded (see
#: ``reference_threads``); None outside a check.
_BACKEND_THREADS: list[int | None] = [None]


@contextmanager
def reference_threads():
    """Run the reference and the bounds on one thread; the backend's calls (``backend_threads``)
    get the process's thread count back. The reference's many small float64 GEMMs gain nothing
    from threads and lose much to waking them (a ci run took several times the CPU time with two
    threads: docs/performance.md, "Figures behind the code"); the backend is certified as users
    run it."""
    outer = _BACKEND_THREADS[0]
    n = torch.get_num_threads() if outer is None else outer
    _BACKEND_THREADS[0] = n
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _BACKEND_THREADS[0] = outer
        if n != 1:
            torch.set_num_threads(n)


@contextmanager
def backend_threads():
    """The process's thread count for the backend's own calls (inside ``reference_threads``)."""
    n = _BACKEND_THREADS[0]
    if n is None or n == 1:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)


#: The device the backend's calls run on (see ``backend_device``); None: where the problem's tensors are.
_BACKEND_DEVICE: list[torch.device | None] = [None]


@contextmanager
def backend_device(device: str | torch.device | None):
    """Run the backend's calls on ``device`` while the problem, the reference and the bounds stay
    on the CPU: the calls into a backend below move their inputs there and their results back.
    The selector's probe runs a CUDA backend this way; the conformance driver gives a backend the
    problem's own (CPU) tensors and never sets it."""
    outer = _BACKEND_DEVICE[0]
    _BACKEND_DEVICE[0] = None if device is None else torch.device(device)
    try:
        yield
    finally:
        _BACKEND_DEVICE[0] = outer


def to_backend_device(t):
    """A tensor or ``Quantized`` (or None) on the backend's device (itself when already there)."""
    device = _BACKEND_DEVICE[0]
    if t is None or device is None:
        return t
    if isinstance(t, Quantized):
        return t if t.data.device == device else replace(t, data=t.data.to(device), scale=t.scale.to(device))
    return t if t.device == device else t.to(device)


def to_host(t):
    """A backend's result (a tensor or ``Quantized``; anything else as is) back on the CPU, where
    the reference is, when the backend runs on a device of its own."""
    if _BACKEND_DEVICE[0] is None:
        return t
    if isinstance(t, Quantized) and isinstance(t.data, torch.Tensor) and isinstance(t.scale, torch.Tensor):
        return replace(t, data=t.data.cpu(), scale=t.scale.cpu())
    return t.cpu() if isinstance(t, torch.Tensor) else t


def to_backend_layout(backend: Backend, q: Quantized, role: str):
    """``q`` as ``backend`` consumes it: its scales encoded in the layout it declares for ``role``
    ("activation" or "weight", ``Backend.scale_layout``) with the padding poisoned (NaN, 0xFF bytes),
    so a kernel that reads padding reads poison; ``q`` itself for the logical layout. An operand
    the layout cannot hold (a scale that is not a power of two, for an E8M0 layout) is outside the
    premise: ``Declined``."""
    layout = getattr(backend.scale_layout, role)
    if layout == layouts.LOGICAL:
        return q
    try:
        return layouts.encode(q, layout, poison=True)
    except ValueError as exc:
        raise Declined(f"premise: the {role} operand cannot be stored in the declared layout {layout}: {exc}") from None


def from_backend_layout(backend: Backend, q, role: str, what: str = "quantize"):
    """A ``Quantized`` the backend produced, read through the reference decoder of the layout it
    declares for ``role``; ``ContractViolation`` when it returned another layout or a buffer the
    decoder refuses (wrong dtype, shape or strides). Anything that is not a quantized tensor is
    returned as is (the caller judges it)."""
    layout = getattr(backend.scale_layout, role)
    if layout == layouts.LOGICAL:
        return q
    if not isinstance(q, layouts.StoredQuantized) or q.layout != layout:
        got = q.layout if isinstance(q, layouts.StoredQuantized) else type(q).__name__
        raise ContractViolation(f"{what} returned {got}, but the backend declares {role} scales in the {layout} "
                                "layout (a fp8ref.spec.layouts.StoredQuantized)")
    try:
        return q.decode()
    except (ValueError, TypeError) as exc:
        raise ContractViolation(f"{what} returned {layout} scales the reference decoder refuses: {exc}") from None


def call_quantize(backend: Backend, x: torch.Tensor, scheme, scale: torch.Tensor | None = None) -> Quantized:
    with backend_threads():
        q = to_host(backend_quantize(backend, to_backend_device(x), scheme, to_backend_device(scale)))
    q = from_backend_layout(backend, q, "activation")
    if not isinstance(q, Quantized):
        raise ContractViolation(f"quantize returned {type(q).__name__}, not an fp8ref.Quantized")
    if q.scheme != scheme:
        raise ContractViolation(f"quantize returned scheme {q.scheme.short_str()}, asked for {scheme.short_str()}")
    if tuple(q.data.shape) != tuple(x.shape):
        raise ContractViolation(f"quantize returned data of shape {tuple(q.data.shape)} for x {tuple(x.shape)}")
    return q


def spec_quantize(x: torch.Tensor, scheme, scale: torch.Tensor | None = None) -> Quantized:
    try:
        return quant.quantize(x, scheme, scale)
    except ValueError as exc:  # e.g. a scale overflowing an fp16 scale_dtype: outside the spec's domain
        raise Declined(f"reference refuses the input: {exc}") from None


def build_problem(problem):
    """``problem.build()``, declined when the spec itself refuses the problem's inputs (a bias that
    cancels a row is built from the spec's quantization, which raises, e.g., for a scale that
    overflows an fp16 scale dtype): an input the spec rejects is never a backend's fault."""
    try:
        return problem.build()
    except ValueError as exc:
        raise Declined(f"premise: the spec refuses the input: {exc}") from None


def call_scaled_mm(backend: Backend, a: Quantized, b: Quantized, bias, out_dtype, poison: float = float("nan"), *,
        rows: int | None = None) -> torch.Tensor:
    """``backend.scaled_mm(a, prepare_weight(b), bias)`` on poisoned output memory, its result's type,
    shape and dtype checked; with ``rows``, called on chunks of that many rows of ``a`` (the weight
    prepared once) and the results stacked: the backend runs at a small M of the caller's choice
    while the reference and the bound are computed once for all rows (every output row depends
    only on its own row of ``a``, with that row's scales, and on ``b``)."""
    M, N = a.data.shape[0], b.data.shape[0]
    a, b, bias = to_backend_device(a), to_backend_device(b), to_backend_device(bias)
    b = to_backend_layout(backend, b, "weight")
    with backend_threads():
        prepared = backend.prepare_weight(b)
    ys = []
    for r0 in range(0, max(M, 1), rows or max(M, 1)):
        ai = a if rows is None else _row_chunk(a, r0, min(r0 + rows, M))
        m = ai.data.shape[0]
        ai = to_backend_layout(backend, ai, "activation")
        poison_allocator((m, N), a.data.device, poison)
        with backend_threads():
            y = to_host(backend.scaled_mm(ai, prepared, bias, out_dtype))
        if not isinstance(y, torch.Tensor):
            raise ContractViolation(f"scaled_mm returned {type(y).__name__}, not a tensor")
        if tuple(y.shape) != (m, N):
            raise ContractViolation(f"scaled_mm returned shape {tuple(y.shape)}, expected [M, N] = [{m}, {N}]")
        if y.dtype != out_dtype:
            raise ContractViolation(f"scaled_mm returned dtype {y.dtype}, asked for {out_dtype}")
        ys.append(y)
    return ys[0] if len(ys) == 1 else torch.cat(ys)


def _row_chunk(q: Quantized, r0: int, r1: int) -> Quantized:
    """Rows ``r0:r1`` of ``q`` with the scales that cover them (a scale block of several rows is
    kept whole: each row's scale is the one it was quantized with)."""
    r, _ = q.scheme.block_shape(*q.data.shape)
    return Quantized(q.data[r0:r1], q.scale[r0 // r:(r1 - 1) // r + 1], q.scheme)


def same_bits(u: torch.Tensor, v: torch.Tensor) -> bool:
    return compare_bits("", u, v).ok


def first_diff(u: torch.Tensor, v: torch.Tensor) -> str:
    """Where ``u`` and ``v`` first differ in their bits (``fp8ref.spec.compare.compare_bits``)."""
    verdict = compare_bits("", u, v)
    w = verdict.worst
    if w is None:
        return "shapes or dtypes differ"
    return f"first difference at {w.index}: {w.value!r} vs {w.reference!r} ({verdict.n_bad} elements differ)"


def check_within(what: str, value: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | float, *,
                  dtype: torch.dtype | None = None) -> float:
    """``fp8ref.spec.compare``: raise ``ContractViolation`` with its message unless every element is
    within the bound (and, given ``dtype``, of that dtype); return the worst error/bound ratio."""
    verdict = compare(what, value, ref, bound, dtype=dtype)
    if not verdict.ok:
        raise ContractViolation(verdict.message(), ratio=verdict.ratio)
    return verdict.ratio


def negate_codes(q: Quantized) -> Quantized:
    # Negate through float: FNUZ formats have no -0, so flipping the sign bit of 0 would be NaN.
    return Quantized((-q.data.to(torch.float32)).to(q.data.dtype), q.scale, q.scheme)


# --------------------------------------------------------------------------------------------
# reference results, cached across checks

#: The reference's results for a problem are a pure function of the (frozen) problem, so they are
#: computed once per process and shared by every contract and every backend checked against the
#: same problem (the sweep gives most backends the same problems). Backends get copies.
_CACHE: OrderedDict = OrderedDict()
_CACHE_MAX = 4096


def cached_reference(key, compute, *, lru: bool = True):
    """``compute()``, memoised under ``key`` (whose second entry is the problem): in the problem's
    own ``memo`` for a problem on given tensors (``given``: its results live and die with it, and
    the process-wide cache never holds a caller's tensors), in the process-wide LRU otherwise --
    or, with ``lru=False``, not at all (results whose tensors may be large and which few checks
    share: a described problem recomputes them, as before they were memoised for given ones)."""
    store = key[1].memo if isinstance(key[1], GIVEN_PROBLEMS) else _CACHE if lru else None
    if store is None:
        return compute()
    hit = store.get(key)
    if hit is None:
        try:
            hit = ("ok", compute())
        except Declined as exc:
            hit = ("declined", exc)
        store[key] = hit
        if store is _CACHE and len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    elif store is _CACHE:
        _CACHE.move_to_end(key)
    if hit[0] == "declined":
        raise Declined(str(hit[1]))
    return hit[1]


def copy_quantized(q: Quantized) -> Quantized:
    return Quantized(q.data.clone(), q.scale.clone(), q.scheme)
