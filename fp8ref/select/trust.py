"""What the selector may believe of its disk cache: whose files it reads, and the seal on a probe's
verdict.

The disk cache is a hint, never a verdict (docs/selection.md, "The cache's trust model"):

- **Ownership.** The cache directory, the cache file, its lock and the seal's key must belong to
  this process's user and be writable by no one else (no group or other write bit); otherwise the
  disk cache is not used at all (memory only, one warning). A shared or world-writable
  ``FP8REF_CACHE_DIR`` is refused, not used silently. Files are opened with ``O_NOFOLLOW``: a link
  planted at the cache's, the lock's or the key's path is not followed.
- **The seal.** A compliant verdict of the probe is kept on disk with an HMAC-SHA256 tag over the
  selection key, the backend's declaration (module, class, accumulation, output roundings,
  version, availability: ``keys.declaration``) and the probe's revision, keyed by a random
  per-user secret (``select-v1.key``, mode 0600, beside the cache). A cached ranking whose every
  backend carries a valid tag is used as it is; any backend without one is probed again in this
  process before the decision is used (and re-sealed), and one that fails makes the whole decision
  be selected afresh.

What this defends against, and what not: a file another user wrote (refused by ownership), a
file copied from another machine, account or container image, one edited by hand or by a tool
that lacks the secret, and a stale file from another version of a backend (its declaration, hence
its tag, differs). It does **not** defend against code running as the same user: that code can read
the secret -- and could as well edit fp8ref itself or set ``FP8REF_BACKEND``. Whatever the file
says, ``auto`` never runs a backend outside the caller's candidates or the allow-list
(``selector._stale_reason``), whose checks need no secret.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["KEY_NAME", "SECRET_BYTES", "dir_refusal", "fd_refusal", "open_nofollow", "read_secret", "make_secret",
           "seal", "unsealed"]

KEY_NAME = "select-v1.key"
SECRET_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _owner_refusal(st: os.stat_result, what: str, *, private: bool = False) -> str | None:
    """Why a file or directory with status ``st`` is not this user's alone (None if it is).
    ``private``: nobody else may read it either (the secret)."""
    if not hasattr(os, "geteuid"):  # Windows: no POSIX owner or mode bits to check
        return None
    if st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
    mask = 0o077 if private else 0o022
    if st.st_mode & mask:
        who = "readable or writable by others" if private else "writable by group or others"
        return f"{what} is {who} (mode {stat.filemode(st.st_mode)})"
    return None


def dir_refusal(directory: Path) -> str | None:
    """Why the cache directory may not be used (None: it may, or it does not exist yet)."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot stat {directory}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    return _owner_refusal(st, f"the directory {directory}")


def fd_refusal(fd: int, path: Path, *, private: bool = False) -> str | None:
    """Why the open file ``fd`` (at ``path``) may not be trusted (None: it may): not a regular file,
    another user's, or writable by others."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})"
    return _owner_refusal(st, str(path), private=private)


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (``OSError`` saying so)."""
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, which fp8ref does not follow") from None
        raise


def read_secret(directory: Path) -> bytes | None:
    """The seal's secret kept in ``directory``, or None (missing, short, not this user's alone)."""
    try:
        fd = open_nofollow(directory / KEY_NAME, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if fd_refusal(fd, directory / KEY_NAME, private=True) is not None:
            return None
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return data if len(data) == SECRET_BYTES else None


def make_secret(directory: Path) -> bytes:
    """The secret in ``directory``, made if missing or unusable (call with the cache's lock held:
    a replaced secret voids the tags made with the old one, which costs re-probes, never trust).
    Written to a fresh ``mkstemp`` file (``O_EXCL``, mode 0600) and moved into place."""
    secret = read_secret(directory)
    if secret is not None:
        return secret
    secret = os.urandom(SECRET_BYTES)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{KEY_NAME}.", suffix=".tmp")
    try:
        os.write(fd, secret)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, directory / KEY_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return secret


def seal(secret: bytes, message: str) -> str:
    """The tag of ``message`` (what a backend's compliance is bound to) under ``secret``."""
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def unsealed(secret: bytes | None, messages: dict[str, str], tags: object) -> list[str]:
    """The names in ``messages`` whose tag in ``tags`` (a name -> tag mapping read from the file,
    of any type) is missing or wrong; every name when there is no secret."""
    if secret is None or not isinstance(tags, dict):
        return list(messages)
    bad = []
    for name, message in messages.items():
        tag = tags.get(name)
        if not isinstance(tag, str) or not hmac.compare_digest(tag, seal(secret, message)):
            bad.append(name)
    return bad
