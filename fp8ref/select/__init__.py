"""The selector: ``fp8ref.linear(..., backend="auto")`` runs the fastest *compliant* backend.

For one case (device, dtypes, recipe, N, K and a power-of-two bucket of M) the selector takes the
registered backends that are available, support the case and belong to a precision class the
caller admits; runs each through a compliance probe against the spec's bounds at this shape;
times the compliant ones; and picks the fastest. A backend that fails the probe is never chosen,
however fast. Lookup order (docs/selection.md): in-memory dict -> on-disk JSON cache -> probe and
time.

One module per job; this face re-exports the public names. Inside, imports flow from ``keys``,
``decision`` and ``inputs`` to ``timing``, ``compliance`` and ``cache``, and from all of them to
``selector``. The package imports the spec, the registry and the checking core (``fp8ref.check``),
never a backend module or anything above it; ``fp8ref.api`` (``fp8ref.linear``) imports it.

- ``keys``: the cache key (M bucket, device name, versions, candidates' declarations);
- ``decision``: ``Decision``, ``Row``, ``ProbeResult`` and the two errors;
- ``inputs``: the probe's random and adversarial rows;
- ``compliance``: the probe itself (``probe``): the conformance contracts' own checks
  (``fp8ref.check.probe.PROBE_CHECKS``) on its problems; it compares nothing itself;
- ``timing``: medians, the interleaved run-off, the selector's clock;
- ``cache``: memory, disk and run-time failure marks;
- ``trust``: whose cache files are read, and the seal on a probe's verdict (docs/selection.md,
  "The cache's trust model");
- ``selector``: candidates, the selection run, ``select`` and ``resolve``;
- ``dense``: the dense fallback's decision (``dense_fallback="auto"``): whether a layer's call
  at an M bucket runs its original weight instead of FP8, by a paired timing, kept in memory;
- ``choose``: ``choose_backend``, the selection asked with tensors or shapes. Calling the package
  calls it: ``fp8ref.select(x, w)`` (the module object is callable, so the obvious name works
  and ``from fp8ref.select import ...`` keeps working).

Environment variables
---------------------
Read through ``fp8ref._env`` (docs/environment.md: unset or blank is the default, any other value
must parse or the read raises naming the variable).

FP8REF_BACKEND
    Force this backend wherever ``backend="auto"`` (it must be able to run: otherwise the call
    raises; it never falls back silently).
FP8REF_CANDIDATES
    Comma-separated backend names: restrict "auto" to these (the reference is always added, as
    the fallback that is always able).
FP8REF_ALLOW_BACKENDS
    Comma-separated names of entry-point backends "auto" may consider without ``candidates=``
    (``*``: all); by default an installed plug-in is usable by name only.
FP8REF_CACHE_DIR
    Directory of the on-disk cache (default ``~/.cache/fp8ref``; ``~`` expanded). Refused (memory
    only, one warning) when another user owns it or others can write it (``trust``).
FP8REF_CACHE_LOCK_TIMEOUT
    Seconds a write waits for the cache's lock (default 10) before it proceeds without the disk
    cache, with one warning.
"""

import sys as _sys
import types as _types

from .cache import CACHE_SCHEMA, ENV_CACHE_DIR, cache_file, clear_cache, generation, mark_failed
from .choose import choose_backend
from .compliance import probe
from .decision import BackendUnavailableError, Decision, NoCompliantBackendError, ProbeResult, Row
from .keys import device_name, m_bucket, selection_key
from .selector import DEFAULT_PRECISION, ENV_BACKEND, ENV_CANDIDATES, X_DTYPES, check_case, resolve, select

__all__ = [
    "DEFAULT_PRECISION",
    "ENV_BACKEND",
    "ENV_CANDIDATES",
    "ENV_CACHE_DIR",
    "X_DTYPES",
    "check_case",
    "CACHE_SCHEMA",
    "Decision",
    "ProbeResult",
    "Row",
    "NoCompliantBackendError",
    "BackendUnavailableError",
    "m_bucket",
    "device_name",
    "selection_key",
    "select",
    "resolve",
    "probe",
    "cache_file",
    "clear_cache",
    "generation",
    "mark_failed",
    "choose_backend",
]


class _CallableModule(_types.ModuleType):
    """This package's module type: ``fp8ref.select(...)`` is ``choose_backend(...)`` (a module
    that users call by its obvious name raised ``TypeError: 'module' object is not callable``)."""

    def __call__(self, *args, **kwargs) -> Decision:
        return choose_backend(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
