"""Where decisions are kept: in memory, on disk (one JSON file, merged under a lock), and the
run-time failure marks.

Lookup order (``selector.select``): memory -> disk -> probe and time. The file is
``$FP8REF_CACHE_DIR/select-v1.json`` (default ``~/.cache/fp8ref``); a corrupt (not UTF-8 JSON),
unreadable or stale one (other schema or fp8ref version) is ignored with a warning and rebuilt, and a
cache that cannot be written costs a warning, never an inference.

The disk cache is optional, and behaves so against other processes: only a regular file of at
most ``MAX_CACHE_BYTES`` is read (a FIFO, a device or a link to an endless file at the path is
ignored with a warning, never opened for a blocking or unbounded read); a write waits at most
``FP8REF_CACHE_LOCK_TIMEOUT`` seconds (default 10) for the lock, then proceeds without the disk
cache and warns once per process (a writer stopped with SIGSTOP, or hung, holds it); and the
temporary files of writers killed mid-write (SIGKILL) are removed by the next writer, which holds
the lock, so no live writer can own them. The selector re-checks what it
reads (``selector._stale_reason``): the file is a cache, not a trusted input, and ``trust`` says
whose files are read at all and which probe verdicts in them carry this user's seal. Content that
is not the layout below (wrong types, nesting too deep to parse) is treated as absent, with one
warning per file. ``generation()``
changes whenever a kept decision may have changed, which invalidates ``fp8ref.linear``'s
per-weight dispatch tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from .. import _env
from .._io import atomic_write
from . import dense, trust
from .decision import Decision
from .keys import fp8ref_version

__all__ = ["ENV_CACHE_DIR", "ENV_LOCK_TIMEOUT", "MAX_CACHE_BYTES", "CACHE_SCHEMA", "lock_timeout",
            "cache_file", "clear_cache", "generation", "bump_generation",
           "read_disk", "write_disk", "lookup_disk", "remember", "recall", "mark_failed", "is_failed"]

ENV_CACHE_DIR = "FP8REF_CACHE_DIR"
ENV_LOCK_TIMEOUT = "FP8REF_CACHE_LOCK_TIMEOUT"
#: Seconds a write waits for the lock when ``FP8REF_CACHE_LOCK_TIMEOUT`` is unset: a selection takes
#: seconds, a merge milliseconds, so a lock held longer is a stopped or hung writer.
DEFAULT_LOCK_TIMEOUT = 10.0
#: The largest cache file read (a decision is ~2 KB; tens of thousands of them fit).
MAX_CACHE_BYTES = 64 * 2**20
#: Version of the on-disk layout; a file with another schema is ignored (with a warning) and rebuilt.
CACHE_SCHEMA = 1
_CACHE_NAME = f"select-v{CACHE_SCHEMA}.json"

_MEMORY: dict[str, Decision] = {}
#: (backend name, selection key) pairs whose backend raised at run time under "auto".
_FAILED: set[tuple[str, str]] = set()
_WARNED: set[str] = set()


def cache_file() -> Path:
    """The on-disk cache: ``$FP8REF_CACHE_DIR/select-v1.json`` (default ``~/.cache/fp8ref``)."""
    root = _env.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "fp8ref")
    return Path(root) / _CACHE_NAME


def clear_cache(*, memory: bool = True, disk: bool = False, failures: bool = True) -> None:
    """Forget decisions in memory (and on disk with ``disk=True``), the dense fallback's timed
    decisions (``dense``) and run-time failure marks."""
    if memory:
        _MEMORY.clear()
        dense.forget()
    if failures:
        _FAILED.clear()
        _WARNED.clear()
        _WARNED_ONCE.clear()
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


def _read_bounded(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``MAX_CACHE_BYTES``, else ``OSError``.
    Opened non-blocking (a FIFO would block ``open`` until a writer appears) and checked with
    ``fstat`` on the open descriptor (no race between a check and the open); at most
    ``MAX_CACHE_BYTES + 1`` bytes are read, whatever the file grows to meanwhile."""
    fd = trust.open_nofollow(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        refusal = trust.fd_refusal(fd, path)
        if refusal is not None:
            raise OSError(refusal)
        st = os.fstat(fd)
        if st.st_size > MAX_CACHE_BYTES:
            raise OSError(f"{st.st_size} bytes, more than the {MAX_CACHE_BYTES} a cache file may hold")
        chunks, size = [], 0
        while size <= MAX_CACHE_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_CACHE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_CACHE_BYTES:
            raise OSError(f"grew past the {MAX_CACHE_BYTES} bytes a cache file may hold while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _refused(directory: Path) -> bool:
    """Whether the disk cache in ``directory`` is refused (another user's, or writable by others):
    then fp8ref keeps decisions in memory only and says so once per directory."""
    reason = trust.dir_refusal(directory)
    if reason is not None:
        _warn_once(f"refuse:{directory}", f"fp8ref: not using the selection cache in {directory}: {reason}; "
                                          "decisions stay in memory (this warning is shown once)")
    return reason is not None


def read_disk(path: Path, *, warn: bool) -> dict[str, Any] | None:
    """The cache file's content, or None when it is missing, refused, unreadable, corrupt or stale
    (with one warning per file and kind when ``warn``)."""
    if _refused(path.parent):
        return None
    try:
        raw = _read_bounded(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if warn:
            _warn_once(f"read:{path}:{exc}", f"fp8ref: cannot read selection cache {path}: {exc}; selecting without it")
        return None
    try:
        data = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError: a corrupt file too
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        if warn:
            _warn_once(f"corrupt:{path}:{len(raw)}", f"fp8ref: ignoring corrupt selection cache {path} "
                       f"({type(exc).__name__}: {str(exc)[:200]}); it will be rebuilt")
        return None
    if data.get("schema") != CACHE_SCHEMA or data.get("fp8ref") != fp8ref_version():
        if warn:
            _warn_once(f"stale:{path}", f"fp8ref: ignoring stale selection cache {path} (schema "
                       f"{str(data.get('schema'))[:40]!r}, fp8ref {str(data.get('fp8ref'))[:40]!r}; expected "
                       f"{CACHE_SCHEMA}, {fp8ref_version()}); it will be rebuilt")
        return None
    return data


class _LockTimeout(OSError):
    """The cache's lock stayed held past the timeout."""


def lock_timeout() -> float:
    """Seconds a write waits for the lock: ``FP8REF_CACHE_LOCK_TIMEOUT`` (finite, > 0, at most an
    hour: ``inf`` would re-open the hang the timeout prevents), else 10. A bad value raises
    ``fp8ref._env.EnvVarError`` (docs/environment.md)."""
    return _env.get(ENV_LOCK_TIMEOUT)


@contextlib.contextmanager
def _locked(path: Path, timeout: float):
    """An exclusive fcntl lock on ``path``, waited for at most ``timeout`` seconds (``_LockTimeout``
    after that); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # Windows: writes stay atomic (os.replace), merges may lose an entry
        yield
        return
    # O_NOFOLLOW: a link planted at the lock's path is refused (ELOOP), never followed to create
    # or lock its target. The lock is shared by every writer, so it is opened, not created exclusively.
    fd = trust.open_nofollow(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0))
    try:
        refusal = trust.fd_refusal(fd, path)
        if refusal is not None:
            raise OSError(f"the lock file {refusal}")
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _LockTimeout(f"its lock {path} stayed held for {timeout:g} s "
                                       f"({ENV_LOCK_TIMEOUT}); a writer is stopped or hung") from None
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_WARNED_ONCE: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _WARNED_ONCE:
        _WARNED_ONCE.add(what)
        warnings.warn(message, stacklevel=5)


def _remove_stale_temps(path: Path) -> None:
    """Remove the temporary files of earlier writes to ``path`` (``atomic_write``'s
    ``.<name>.*.tmp``). Called with the lock held: every writer holds it while its temporary file
    exists, so any such file is a killed writer's."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_disk(key: str, decision: Decision, sealed: dict[str, str] | None = None) -> None:
    """Merge one entry into the cache file under a lock; write a temp file, then os.replace.
    ``sealed``: backend name -> the message its compliance is bound to (``trust.seal``), kept with
    the entry as tags under this user's secret. Never raises ``OSError``: a cache that cannot be
    written (read-only home, lock held past the timeout, a refused directory) costs a warning, and
    the decision stays in memory."""
    path = cache_file()
    timeout = lock_timeout()  # a bad FP8REF_CACHE_LOCK_TIMEOUT is the caller's error: raised, not swallowed
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if _refused(path.parent):
            return
        with _locked(path.with_name(path.name + ".lock"), timeout):
            _remove_stale_temps(path)
            data = read_disk(path, warn=False) or {"schema": CACHE_SCHEMA, "fp8ref": fp8ref_version(),
                                                     "entries": {}}
            entry = decision.to_json()
            if sealed:
                secret = trust.make_secret(path.parent)
                entry["attest"] = {name: trust.seal(secret, msg) for name, msg in sealed.items()}
            data["entries"][key] = entry

            def _dump(tmp: str) -> None:
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)

            atomic_write(path, _dump)
    except _LockTimeout as exc:
        _warn_once("lock", f"fp8ref: not writing the selection cache {path}: {exc}; decisions stay in memory "
                           "(this warning is shown once)")
    except OSError as exc:  # the cache is an optimisation: a read-only home must not break inference
        warnings.warn(f"fp8ref: cannot write selection cache {path}: {exc}", stacklevel=4)


def lookup_disk(key: str, messages: dict[str, str] | None = None) -> tuple[Decision, list[str]] | None:
    """The decision kept on disk under ``key`` and the names of ``messages`` (backend name -> the
    message its compliance is bound to) whose seal is missing or wrong; None when there is no
    usable entry (a malformed one is ignored with one warning)."""
    path = cache_file()
    data = read_disk(path, warn=True)
    if data is None or key not in data["entries"]:
        return None
    entry = data["entries"][key]
    try:
        d = Decision.from_json(key, entry)
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        _warn_once(f"entry:{path}:{key}", f"fp8ref: ignoring malformed cache entry in {path} "
                                          f"({type(exc).__name__}: {str(exc)[:200]}); it will be rebuilt")
        return None
    messages = messages or {}
    return d, trust.unsealed(trust.read_secret(path.parent), messages, entry.get("attest"))


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
