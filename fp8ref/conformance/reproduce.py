"""How a report names a backend and the call that reproduces a failure.

A registered backend is named by its registry name; one that is not by its class path
(``module:Class``), which ``load_backend`` (and so ``check`` and ``fp8ref conformance --backend``)
turns back into a fresh instance; a backend whose class cannot be rebuilt from a path is named in a
comment. Imports flow down: the registry and ``scope``.
"""

from __future__ import annotations

import importlib
import inspect

from ..registry import Backend, get_backend
from .scope import Scope

__all__ = ["load_backend", "reproduce_line"]


def _class_path(backend: Backend) -> str | None:
    """``module:Class`` when ``check`` can rebuild an equal backend from it (an importable class
    whose constructor takes no argument), else None."""
    cls = type(backend)
    if "<" in cls.__qualname__ or cls.__module__ in ("__main__", "builtins"):
        return None
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def load_backend(path: str) -> Backend:
    """The backend named ``module:Class`` (a fresh instance) or ``module:instance``: how a
    reproduce line names a backend that is not registered.

    Examples
    --------
    >>> load_backend("fp8ref.kernels.reference:ReferenceBackend").name
    'reference'
    """
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"backend path must be 'module:Class', got {path!r}")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load backend {path!r}: {exc}") from None
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"{path!r} is {type(backend).__name__}, not an fp8ref.Backend")
    return backend


def _backend_expr(backend: Backend) -> tuple[str, str]:
    """(how the Python reproduce line names the backend, a comment saying what it is)."""
    if _registered(backend):
        return repr(backend.name), ""
    path = _class_path(backend)
    if path is not None:
        return repr(path), ""
    cls = type(backend)
    return "<backend>", (f"  # <backend>: the {cls.__module__}.{cls.__qualname__} instance {backend.name!r} "
                         f"(its class cannot be rebuilt from a path)")


def _registered(backend: Backend) -> bool:
    try:
        return get_backend(backend.name) is backend
    except KeyError:
        return False


def reproduce_line(backend: Backend, profile: str, seed: int, contract: str, scope: Scope | None = None) -> str:
    """The call that reproduces a failure: always the Python call; for a backend registered
    under its name (and a check not narrowed to schemes), the CLI command as well.

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance.reproduce import reproduce_line
    >>> print(reproduce_line(get_backend("reference"), "ci", 3, "scaled_mm.bound").replace("  or: ", "\\n"))
    fp8ref.conformance.check('reference', profile='ci', seed=3, contracts=['scaled_mm.bound'])
    fp8ref conformance --backend reference --profile ci --seed 3 --only scaled_mm.bound
    """
    who, note = _backend_expr(backend)
    extra = ""
    if scope is not None and tuple(scope.ops) != tuple(backend.ops):
        extra += f", ops={tuple(scope.ops)!r}"
    if scope is not None and scope.narrowed:
        extra += ", schemes=<the same schemes>"
    py = f"fp8ref.conformance.check({who}, profile={profile!r}, seed={seed}, contracts=[{contract!r}]{extra})"
    if who.startswith("<") or (scope is not None and scope.narrowed):
        return py + note
    cli = f"fp8ref conformance --backend {who.strip(chr(39))} --profile {profile} --seed {seed} --only {contract}"
    if scope is not None and tuple(scope.ops) != tuple(backend.ops):
        cli += "".join(f" --ops {o}" for o in scope.ops)
    return f"{py}  or: {cli}"
