"""Where decisions are kept: in memory, on disk (one JSON file, merged under a lock), and the
run-time failure marks.

Lookup order (``selector.select``): memory -> disk -> probe and time. The file is
``$FP8REF_CACHE_DIR/select-v1.json`` (default ``~/.cache/fp8ref``); a corrupt (not UTF-8 JSON),
unreadable or stale one (other schema or fp8ref version) is ignored with a warning and rebuilt, and a
cache that cannot be written costs a warning, never an inference. The selector re-checks what it
reads (``selector._stale_reason``): the file is a cache, not a trusted input. ``generation()``
changes whenever a kept decision may have changed, which invalidates ``fp8ref.linear``'s
per-weight dispatch tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from .._io import atomic_write
from .decision import Decision
from .keys import fp8ref_version

__all__ = ["ENV_CACHE_DIR", "CACHE_SCHEMA", "cache_file", "clear_cache", "generation", "bump_generation",
           "read_disk", "write_disk", "lookup_disk", "remember", "recall", "mark_failed", "is_failed"]

ENV_CACHE_DIR = "FP8REF_CACHE_DIR"
#: Version of the on-disk layout; a file with another schema is ignored (with a warning) and rebuilt.
CACHE_SCHEMA = 1
_CACHE_NAME = f"select-v{CACHE_SCHEMA}.json"

_MEMORY: dict[str, Decision] = {}
#: (backend name, selection key) pairs whose backend raised at run time under "auto".
_FAILED: set[tuple[str, str]] = set()
_WARNED: set[str] = set()


def cache_file() -> Path:
    """The on-disk cache: ``$FP8REF_CACHE_DIR/select-v1.json`` (default ``~/.cache/fp8ref``)."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "fp8ref")
    return Path(root) / _CACHE_NAME


def clear_cache(*, memory: bool = True, disk: bool = False, failures: bool = True) -> None:
    """Forget decisions in memory (and on disk with ``disk=True``) and run-time failure marks."""
    if memory:
        _MEMORY.clear()
    if failures:
        _FAILED.clear()
        _WARNED.clear()
    if disk:
        with contextlib.suppress(FileNotFoundError):
            cache_file().unlink()
    bump_generation()


def remember(key: str, decision: Decision) -> None:
    """Keep ``decision`` in memory under ``key``."""
    _MEMORY[key] = decision


def recall(key: str) -> Decision | None:
    """The decision kept in memory under ``key``, or None."""
    return _MEMORY.get(key)


_GENERATION = [0]


def generation() -> int:
    """A counter that changes whenever a kept decision or failure mark may have changed."""
    return _GENERATION[0]


def bump_generation() -> None:
    """Invalidate the per-weight dispatch tables of ``fp8ref.linear``."""
    _GENERATION[0] += 1


def read_disk(path: Path, *, warn: bool) -> dict[str, Any] | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if warn:
            warnings.warn(f"fp8ref: cannot read selection cache {path}: {exc}", stacklevel=4)
        return None
    try:
        data = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError: a corrupt file too
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
    except ValueError as exc:
        if warn:
            warnings.warn(f"fp8ref: ignoring corrupt selection cache {path} ({exc}); it will be rebuilt",
                          stacklevel=4)
        return None
    if data.get("schema") != CACHE_SCHEMA or data.get("fp8ref") != fp8ref_version():
        if warn:
            warnings.warn(f"fp8ref: ignoring stale selection cache {path} (schema {data.get('schema')!r}, "
                          f"fp8ref {data.get('fp8ref')!r}; expected {CACHE_SCHEMA}, {fp8ref_version()}); "
                          "it will be rebuilt", stacklevel=4)
        return None
    return data


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive fcntl lock on ``path`` (a no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # Windows: writes stay atomic (os.replace), merges may lose an entry
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_disk(key: str, decision: Decision) -> None:
    """Merge one entry into the cache file under a lock; write a temp file, then os.replace."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            data = read_disk(path, warn=False) or {"schema": CACHE_SCHEMA, "fp8ref": fp8ref_version(),
                                                     "entries": {}}
            data["entries"][key] = decision.to_json()

            def _dump(tmp: str) -> None:
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)

            atomic_write(path, _dump)
    except OSError as exc:  # the cache is an optimisation: a read-only home must not break inference
        warnings.warn(f"fp8ref: cannot write selection cache {path}: {exc}", stacklevel=4)


def lookup_disk(key: str) -> Decision | None:
    """The decision kept on disk under ``key``, or None (a malformed entry is ignored with a warning)."""
    data = read_disk(cache_file(), warn=True)
    if data is None or key not in data["entries"]:
        return None
    try:
        return Decision.from_json(key, data["entries"][key])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        warnings.warn(f"fp8ref: ignoring malformed cache entry ({exc!r}); it will be rebuilt", stacklevel=3)
        return None


def mark_failed(name: str, key: str, exc: BaseException) -> None:
    """Record that backend ``name`` raised at run time for selection ``key`` (warn once per backend)."""
    _FAILED.add((name, key))
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"fp8ref: backend {name!r} raised {type(exc).__name__}: {exc}; marked failed for this case, "
                      "falling back to the next compliant backend", RuntimeWarning, stacklevel=4)
    bump_generation()


def is_failed(name: str, key: str) -> bool:
    """Whether backend ``name`` was marked failed at run time for selection ``key``."""
    return (name, key) in _FAILED
