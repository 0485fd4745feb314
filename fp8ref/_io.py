"""Atomic file writes: a file is either the old one or the complete new one, never half-written; and
a check that a file can be written, made before the long work whose result it will hold."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then ``os.replace`` it
    onto ``path``; on any failure the temporary file is removed and ``path`` is left untouched."""
    path = Path(path)
    if path.is_dir():  # os.replace would fail only after the whole file was written beside it
        raise IsADirectoryError(f"{path} is a directory, not a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """``atomic_write`` of a text file."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at ``path``, or None. Creates the missing parent folders and a
    temporary file beside ``path`` (removed), as ``atomic_write`` will: a command checks its output
    files with this before minutes of work, instead of failing with a traceback after them."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory"
    above = next((a for a in path.parents if a.exists()), None)
    if above is not None and not above.is_dir():
        return f"cannot write {path}: {above} is not a directory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    return None
