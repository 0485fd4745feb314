"""The selector itself: which backends are candidates, the run that probes, times and ranks them,
the lookup order, and what forcing a backend means.

``select`` looks a decision up in memory, then on disk (``cache``), and only then runs the
selection: every available candidate that supports the case at both ends of its M bucket and
belongs to an admitted precision class is probed (``compliance``), the compliant ones are timed
(``timing``), and the fastest wins; the others are the fallback ranking, the reference last.
``resolve`` is what ``fp8ref.linear`` calls: an explicit name, ``FP8REF_BACKEND``, or ``select``.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Callable

import torch

from .. import _env
from .._progress import progress
from ..check.probe import PROBE_REVISION
from ..registry import _REGISTRY, Backend, Case, _ensure_loaded, decline_reason, get_backend, is_trusted
from ..spec.bounds import PrecisionClass
from ..spec.checks import X_DTYPES
from ..spec.gemm import OUT_DTYPES
from ..spec.schemes import Recipe
from . import cache, timing
from .compliance import ProbeSet, probe, probe_shapes
from .decision import BackendUnavailableError, Decision, NoCompliantBackendError, ProbeResult, Row
from .keys import available_reason, bucket_lo, declaration, m_bucket, selection_key

__all__ = ["DEFAULT_PRECISION", "ENV_BACKEND", "ENV_CANDIDATES", "X_DTYPES", "check_case", "select", "resolve"]

#: Default required precision class. The FP8 quantization error of a W8A8 linear is ~4e-2
#: relative (e4m3: u = 2**-4 per operand); a second bf16 rounding adds at most 2**-8 ~ 3.9e-3 and
#: ~7e-4 typically, so "standard" (fp32 accumulation, up to two roundings) loses nothing a user
#: of FP8 could notice, while admitting the fast CPU bf16 path. See docs/selection.md.
DEFAULT_PRECISION = "standard"
ENV_BACKEND = "FP8REF_BACKEND"
ENV_CANDIDATES = "FP8REF_CANDIDATES"


def _candidates(names: list[str] | tuple[str, ...] | None) -> list[Backend]:
    _ensure_loaded()
    if names is None:
        names = _env.get(ENV_CANDIDATES)
    if names is None:
        # Entry-point backends only when allowed (registry.is_trusted): naming one is the other way.
        return [b for b in list(_REGISTRY.values()) if is_trusted(b.name)]
    out = [get_backend(n) for n in names]
    if not any(b.name == "reference" for b in out):
        out.append(get_backend("reference"))
    return out


def _case_variants(case: Case) -> list[Case]:
    """The Ms at which ``supports`` must hold: both ends of the bucket."""
    b = m_bucket(case.M)
    return [Case(M=m, N=case.N, K=case.K, recipe=case.recipe, x_dtype=case.x_dtype, out_dtype=case.out_dtype,
                 device=case.device, has_bias=case.has_bias) for m in sorted({bucket_lo(b), b})]


def _supports(backend: Backend, case: Case) -> str | None:
    mp, n_probe = probe_shapes(case)
    variants = _case_variants(case)
    variants.append(Case(M=mp, N=n_probe, K=case.K, recipe=case.recipe, x_dtype=case.x_dtype,
                         out_dtype=case.out_dtype, device=case.device, has_bias=case.has_bias))
    for c in variants:
        try:
            reason = decline_reason(backend, c)
        except Exception as exc:
            return f"supports() raised {exc!r}"
        if reason is not None:
            return reason if c.M == case.M or c is variants[0] else f"{reason} (at M={c.M}, N={c.N})"
    return None


def check_case(case: Case) -> None:
    """Raise ``TypeError``/``ValueError`` naming the field of ``case`` that no backend can be selected
    for: M < 0, N < 0, K < 1, a non-float ``x_dtype``, an ``out_dtype`` outside ``OUT_DTYPES``, a
    recipe that is not a ``Recipe``, a device that is not one or is not present here. (``fp8ref.linear``
    checks the caller's tensors before it builds a case; this guards ``select``, ``resolve`` and
    ``fp8ref select``.)"""
    if not isinstance(case, Case):
        raise TypeError(f"case must be an fp8ref.Case, got {type(case).__name__}")
    for field, low in (("M", 0), ("N", 0), ("K", 1)):
        v = getattr(case, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"Case.{field} must be an int >= {low}, got {v!r}"
                             + (" (the reduction dim K must be at least 1)" if field == "K" else ""))
    if not isinstance(case.recipe, Recipe):
        raise TypeError(f"Case.recipe must be an fp8ref.Recipe, got {type(case.recipe).__name__}")
    if case.x_dtype not in X_DTYPES:
        raise TypeError(f"Case.x_dtype must be one of {[str(d) for d in X_DTYPES]}, got {case.x_dtype}")
    if case.out_dtype not in OUT_DTYPES:
        raise TypeError(f"Case.out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {case.out_dtype}")
    _check_device(case.device)


def _check_device(device: str) -> None:
    """``Case.device`` names a device torch knows and this machine has (a probe allocates on it, and
    the cache key asks for its name: both failed inside torch, e.g. ``Torch not compiled with CUDA``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"Case.device must be a torch device string, got {device!r} ({exc})") from None
    if dev.type == "cpu":
        return
    if dev.type == "meta":
        raise ValueError("Case.device is 'meta', which holds no values: there is nothing to probe or time")
    module = getattr(torch, dev.type, None)  # torch.cuda, torch.xpu, torch.mps: each has is_available()
    if module is not None and hasattr(module, "is_available") and not module.is_available():
        raise ValueError(f"Case.device is {device!r}, but torch.{dev.type}.is_available() is False here "
                         f"(torch {torch.__version__})")
    if dev.index is not None and hasattr(module, "device_count") and dev.index >= module.device_count():
        raise ValueError(f"Case.device is {device!r}, but this machine has {module.device_count()} {dev.type} "
                         "device(s)")


def _empty_output(case: Case, precision: str, key: str) -> Decision:
    """N = 0: the output ``[M, 0]`` is empty, so there is nothing to probe, time or compare; every
    backend returns the reference's empty result, and the reference is named."""
    row = Row(backend="reference", precision=get_backend("reference").precision.value, admitted=True, compliant=True,
              detail="the spec", note="N = 0: the output is empty, nothing to probe or time", chosen=True)
    return Decision(key=key, case=case.short_str(), precision=precision, chosen="reference", ranking=["reference"],
                    rows=[row], source="probe")


def _stale_reason(d: Decision, precision: str, cands: list[Backend]) -> str | None:
    """Why a decision read from disk cannot be used as it is for ``precision`` and the candidates
    ``cands`` (None if it can): the file is a cache, not a trusted input, so what the selector
    would never choose is re-checked -- every ranked backend must be one of this call's candidates
    (which holds only allowed entry-point backends unless the caller named them), registered as
    that very object, and in an admitted class. Compliance is checked apart (``_from_disk``)."""
    if not d.ranking or d.chosen != d.ranking[0]:
        return f"chosen {d.chosen!r} is not first of its ranking {d.ranking}"
    if len(set(d.ranking)) != len(d.ranking):
        return f"its ranking {d.ranking} names a backend twice"
    if d.precision != precision:
        return f"it was made for precision={d.precision!r}"
    req = PrecisionClass(precision)
    allowed = {b.name: b for b in cands}
    for name in d.ranking:
        b = _REGISTRY.get(name)
        if b is None:
            return f"backend {name!r} is not registered"
        if allowed.get(name) is not b:
            return (f"backend {name!r} is not among this call's candidates {sorted(allowed)} (candidates=, "
                    f"{ENV_CANDIDATES}, or the allow-list FP8REF_ALLOW_BACKENDS for entry-point backends)")
        if not req.admits(b.precision):
            return f"backend {name!r} is in class {b.precision.value}, outside precision={precision!r}"
    return None


def _is_spec(b: Backend) -> bool:
    """The reference backend shipped with fp8ref: the spec itself, compliant by definition."""
    return type(b).__module__ == "fp8ref.kernels.reference" and b.name == "reference"


def _seal_messages(key: str, names: list[str]) -> dict[str, str]:
    """What each ranked backend's compliance is bound to on disk (``trust``): the key, the
    backend's declaration (identity, version, availability) and the probe's revision."""
    return {n: f"{key}\0{declaration(_REGISTRY[n])}\0probe={PROBE_REVISION}\0compliant" for n in names
            if not _is_spec(_REGISTRY[n])}


def _reprobe(case: Case, precision: str, names: list[str]) -> str | None:
    """Probe again, in this process, the backends a cached decision ranks without a valid seal;
    why one of them cannot stand (None: all are compliant here)."""
    req = PrecisionClass(precision)
    probe_set = None
    for name in names:
        b = _REGISTRY[name]
        why = available_reason(b) or _supports(b, case)
        if why is None and not req.admits(b.precision):
            why = f"class {b.precision.value} not admitted"
        if why is None:
            probe_set = probe_set or ProbeSet(case)
            res = probe(b, case, _set=probe_set)
            why = None if res.compliant else f"the probe rejects it: {res.detail}"
        if why is not None:
            return f"backend {name!r}, ranked without this user's seal, was probed again: {why}"
    return None


def _check_precision(precision: str | PrecisionClass) -> str:
    try:
        return PrecisionClass(precision).value
    except ValueError:
        raise ValueError(f"precision must be one of {[p.value for p in PrecisionClass]}, got {precision!r}") from None


def _run_selection(case: Case, precision: str, cands: list[Backend], key: str) -> Decision:
    # Probing and timing take seconds per backend: a bar says which one (on a terminal, after 2 s).
    with progress(total=len(cands), desc=f"fp8ref: selecting a backend for {case.short_str()}",
                  unit="step") as bar:
        return _probe_time_rank(case, precision, cands, key, bar)


def _probe_time_rank(case: Case, precision: str, cands: list[Backend], key: str, bar) -> Decision:
    t_start = timing.clock()
    req = PrecisionClass(precision)
    rows: list[Row] = []
    probed: list[tuple[Backend, Row, ProbeResult]] = []
    probe_set: ProbeSet | None = None
    for b in cands:
        bar.set_postfix_str(f"probing {b.name}")
        bar.update(1)
        row = Row(backend=b.name, precision=b.precision.value)
        rows.append(row)
        row.available = available_reason(b)
        if row.available is not None:
            continue
        row.supported = _supports(b, case)
        if row.supported is not None:
            continue
        row.admitted = req.admits(b.precision)
        if not row.admitted:
            row.note = f"class {b.precision.value} not admitted by precision={precision}"
            continue
        if _is_spec(b):
            # The spec itself: probing it compares it with itself (and costs the most, float64).
            row.compliant, row.detail, row.estimate_s = True, "the spec (compliant by definition, not probed)", math.inf
            probed.append((b, row, None))
            continue
        if probe_set is None:
            probe_set = ProbeSet(case)
        res = probe(b, case, _set=probe_set)
        row.compliant, row.worst_ratio, row.detail = res.compliant, res.worst_ratio, res.detail
        row.ratios = res.ratios
        if res.compliant:
            mt = min(m_bucket(case.M), timing.TIME_M_CAP)
            row.estimate_s = res.call_seconds * (mt * case.N) / max(res.call_elements, 1)
            probed.append((b, row, res))
    if not probed:
        raise NoCompliantBackendError(f"no backend is compliant at {case.short_str()} with precision>={precision}:\n"
                                      + Decision(key, case.short_str(), precision, "", [], rows).table())
    if len(probed) > 1:
        best: float | None = None
        timers: dict[str, Callable[[], float]] = {}
        bar.total += len(probed)
        for b, row, _ in sorted(probed, key=lambda t: t[1].estimate_s):
            bar.set_postfix_str(f"timing {b.name}")
            bar.update(1)
            if b.name == "reference":
                # The spec computes in float64 and is never faster than a real kernel: it is the
                # last-resort fallback, ranked last without spending the timing budget on it.
                row.note = "not timed: the reference is the fallback, ranked last"
                continue
            if best is not None and row.estimate_s > timing.SKIP_FACTOR * best:
                row.note = f"not timed: estimated {row.estimate_s:.3g} s > {timing.SKIP_FACTOR:g}x best"
                continue
            try:
                row.median_s, row.runs, row.note = timing.time_backend(b, case, best, timers)
            except Exception as exc:
                row.note = f"timing raised {type(exc).__name__}: {exc}"
                row.compliant = False
                continue
            best = row.median_s if best is None else min(best, row.median_s)
        if best is not None:
            close = [(b, row) for b, row, _ in probed if row.compliant and row.median_s is not None
                     and row.runs > 1 and row.median_s <= timing.RUNOFF_FACTOR * best]
            if len(close) > 1:
                try:
                    timing.runoff(close, case, timers)
                except Exception as exc:  # keep the sequential medians; say why
                    for _, row in close:
                        row.note = (row.note + "; " if row.note else "") + f"run-off raised {exc!r}"
    ranked = sorted((r for _, r, _ in probed if r.compliant),
                    key=lambda r: (len(probed) > 1 and r.backend == "reference", r.median_s is None,
                                   r.median_s if r.median_s is not None else r.estimate_s))
    if not ranked:
        raise NoCompliantBackendError(f"every compliant backend failed timing at {case.short_str()}")
    ranked[0].chosen = True
    return Decision(key=key, case=case.short_str(), precision=precision, chosen=ranked[0].backend,
                    ranking=[r.backend for r in ranked], rows=rows, source="probe",
                    seconds=timing.clock() - t_start)


def select(case: Case, precision: str | PrecisionClass = DEFAULT_PRECISION, *,
           candidates: list[str] | tuple[str, ...] | None = None, refresh: bool = False) -> Decision:
    """The fastest compliant backend for ``case`` (looked up in memory, then on disk, then probed).

    Parameters
    ----------
    case : Case
        The problem; its M is reduced to its power-of-two bucket.
    precision : str or PrecisionClass
        Required class: ``exact`` < ``strict`` < ``standard`` (default) < ``fast``.
    candidates : sequence of str, optional
        Restrict to these backends (``FP8REF_CANDIDATES`` otherwise); the reference is always added.
        Without either, every registered backend except entry-point ones that
        ``FP8REF_ALLOW_BACKENDS`` does not name (``fp8ref.registry.is_trusted``).
    refresh : bool
        Ignore both caches and probe again (the result is stored again).

    Returns
    -------
    Decision
        ``chosen``, the fallback ``ranking`` and the table ``rows``; ``source`` says where it came from.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.select import select
    >>> d = select(fp8ref.Case(M=8, N=32, K=64, recipe=fp8ref.W8A8_FP8), candidates=["reference"])
    >>> d.chosen
    'reference'
    """
    check_case(case)
    precision = _check_precision(precision)
    cands = _candidates(candidates)
    key = selection_key(case, precision, cands)
    if case.N == 0:
        d = _empty_output(case, precision, key)
        cache.remember(key, d)
        return d
    if not refresh:
        d = cache.recall(key)
        if d is not None:
            d.source = "memory"
            return d
    with _key_lock(key):  # threads asking for one key at once: one selection, the others reuse it
        return _select_locked(case, precision, cands, key, refresh)


#: One lock per selection key (the guard protects the dict): concurrent first calls of one case
#: wait for a single probe-and-time run instead of racing several, whose timings would disagree.
_KEY_LOCKS: dict[str, threading.Lock] = {}
_KEY_LOCKS_GUARD = threading.Lock()


def _reset_locks_after_fork() -> None:
    """In a forked child only the forking thread lives: a lock another thread held at the fork
    would stay held for ever. The child starts with fresh locks (a selection the parent was
    running is simply not in the child's memory: it selects again)."""
    global _KEY_LOCKS, _KEY_LOCKS_GUARD
    _KEY_LOCKS = {}
    _KEY_LOCKS_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)


def _key_lock(key: str) -> threading.Lock:
    with _KEY_LOCKS_GUARD:
        return _KEY_LOCKS.setdefault(key, threading.Lock())


def _select_locked(case: Case, precision: str, cands: list[Backend], key: str, refresh: bool) -> Decision:
    if not refresh:
        d = cache.recall(key)
        if d is not None:
            d.source = "memory"
            return d
        found = _from_disk(case, precision, cands, key)
        if found is not None:
            return found
    d = _run_selection(case, precision, cands, key)
    cache.remember(key, d)
    cache.write_disk(key, d, _seal_messages(key, d.ranking))
    return d


def _from_disk(case: Case, precision: str, cands: list[Backend], key: str) -> Decision | None:
    """The disk cache's decision for ``key`` if it may be used (a hint, never a verdict: see
    ``trust``): every ranked backend a candidate, allowed and admitted, and compliant by a seal this
    user made or by a probe run now (then sealed anew). None, with a warning saying why, otherwise."""
    # The seal's messages need the ranking, which only the entry knows: ask with every candidate's.
    found = cache.lookup_disk(key, _seal_messages(key, [b.name for b in cands if b.name in _REGISTRY]))
    if found is None:
        return None
    d, unsealed = found
    stale = _stale_reason(d, precision, cands)
    unsealed = [n for n in d.ranking if n in unsealed]
    if stale is None and unsealed:
        stale = _reprobe(case, precision, unsealed)
        if stale is None:
            cache.write_disk(key, d, _seal_messages(key, d.ranking))
    if stale is not None:
        warnings.warn(f"fp8ref: ignoring the cached decision for {case.short_str()} in {cache.cache_file()} "
                      f"({stale}); selecting again", stacklevel=4)
        return None
    cache.remember(key, d)
    return d


def _forced(name: str, case: Case, precision: str, origin: str) -> Backend:
    try:
        b = get_backend(name)
    except KeyError as exc:
        raise BackendUnavailableError(f"{origin}: {exc.args[0]}") from None
    reason = available_reason(b)
    if reason is not None:
        raise BackendUnavailableError(f"{origin}: backend {name!r} is not available here: {reason}")
    for c in _case_variants(case):
        reason = decline_reason(b, c)
        if reason is not None:
            # The caller's case, not the bucket's end that declined (a decision holds for the bucket).
            b_hi = m_bucket(case.M)
            at = "" if c.M == case.M else f" (at M={c.M}: one decision serves M={bucket_lo(b_hi)}..{b_hi})"
            raise BackendUnavailableError(f"{origin}: backend {name!r} does not support {case.short_str()}: "
                                          f"{reason}{at}")
    if not PrecisionClass(precision).admits(b.precision):
        raise BackendUnavailableError(f"{origin}: backend {name!r} is in class {b.precision.value}, outside the "
                                      f"required precision={precision!r}; pass precision={b.precision.value!r} "
                                      "to accept it")
    return b


def resolve(case: Case, backend: str = "auto", precision: str | PrecisionClass = DEFAULT_PRECISION, *,
            candidates: list[str] | tuple[str, ...] | None = None) -> tuple[Backend, Decision | None]:
    """The backend that runs ``case``: an explicit name, ``FP8REF_BACKEND``, or the selector.

    An explicit or forced backend that cannot run (unknown, unavailable, unsupported case,
    outside the precision class) raises ``BackendUnavailableError``: never a silent fallback.
    Under "auto", backends marked failed at run time for this key are skipped.
    """
    check_case(case)
    precision = _check_precision(precision)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name or 'auto', got {type(backend).__name__}")
    if backend != "auto":
        return _forced(backend, case, precision, f"backend={backend!r}"), None
    env = _env.get(ENV_BACKEND)
    if env is not None:
        return _forced(env, case, precision, f"{ENV_BACKEND}={env!r}"), None
    d = select(case, precision, candidates=candidates)
    for name in d.ranking:
        if not cache.is_failed(name, d.key) and name in _REGISTRY:
            return _REGISTRY[name], d
    # Every ranked backend failed at run time: the reference is the spec and always able.
    return get_backend("reference"), d
