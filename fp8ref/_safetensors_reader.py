"""Reading a safetensors file without memory-mapping it, parsed by the ``safetensors`` package.

``_Reader`` reads the whole file with ``pread`` (another program that rewrites a mapped file in
place makes a mapped reader fault with SIGBUS) and hands the bytes to ``safetensors.deserialize``,
so a file is accepted exactly when safetensors accepts it; safetensors' refusals become
``CheckpointError`` naming the file, the tensor and the rule. On top it refuses a key named twice
and dtypes torch cannot hold here. ``fp8ref.checkpoint`` adds the FP8_DYNAMIC layout's rules.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or wrongly typed (the message names it)."""


def _safetensors(what: str):
    """The ``safetensors`` package (a core dependency), or an ImportError that says how to get it
    (an environment installed before it was one, or with ``--no-deps``)."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise ModuleNotFoundError(f"{what} reads and writes .safetensors files and needs the safetensors package, "
                                  "a dependency of fp8ref that this environment lacks: pip install "
                                  "'safetensors>=0.4' (or reinstall fp8ref without --no-deps)",
                                  name="safetensors") from exc
    return safetensors


#: safetensors dtype names (the format's specification) and their torch dtypes; a name safetensors
#: accepts but this table lacks (F4, F6_E2M3, C64, ...) is refused by name.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):  # torch >= 2.7: MX power-of-two scales
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
#: safetensors' own cap on the header length (``MAX_HEADER_SIZE`` in its ``tensor.rs``).
_MAX_HEADER = 100_000_000

#: safetensors' error texts and the rule each one states, in the words of ``CheckpointError``.
_ST_RULES = (
    ("invalid offset for tensor", "its data_offsets break the rule that tensors tile the data region in "
     "order, without holes or overlaps (two tensors sharing bytes included), each span exactly "
     "dtype size x shape bytes"),
    ("incomplete metadata, file not fully covered", "the tensors do not cover the data region exactly: "
     "bytes after the last tensor, a hole, or a key named twice"),
    ("overflow computing buffer size", "a shape whose element count overflows"),
    ("invalid JSON in header", "the header is not a safetensors JSON header"),
    ("invalid UTF-8 in header", "the header is not UTF-8"),
)


class _Reader:
    """A safetensors file read into memory with plain reads (never mapped: another program that
    rewrites a mapped file in place makes the reader fault with SIGBUS) and parsed by the
    ``safetensors`` package itself, so a file loads here exactly when safetensors accepts it;
    fp8ref then refuses what its own layout rules forbid (a key named twice, which safetensors
    resolves silently to the last entry when the bytes still tile)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        st = _safetensors("load_fp8_dynamic")
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot open the checkpoint {path}: {exc.strerror}") from None
        self._fd = fd
        try:
            self._stat = os.fstat(fd)
            if not stat.S_ISREG(self._stat.st_mode):
                raise CheckpointError(f"{path} is not a regular file (mode {stat.filemode(self._stat.st_mode)})")
            size = self._stat.st_size
            if size < 8:
                raise self._unreadable(f"{size} bytes, fewer than the 8 of a header length")
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))
            if n > _MAX_HEADER:
                raise self._unreadable(f"header length {n} exceeds safetensors' cap of {_MAX_HEADER:,} bytes")
            if n > size - 8:
                raise self._unreadable(f"header length {n} does not fit in the file's {size} bytes")
            self._parse(st, self._read_all(fd, size), n)
        except BaseException:
            os.close(fd)
            raise

    def _parse(self, st, data: bytes, n: int) -> None:
        try:
            flat = st.deserialize(data)  # the tensors' bytes, each copied into a bytearray of its own
        except st.SafetensorError as exc:
            raise self._refused(str(exc)) from None
        self._meta = self._metadata(data[8:8 + n])
        del data  # the file's bytes: the peak is twice the file, the steady state once
        self._entries: dict[str, dict] = dict(flat)  # name -> {"dtype", "shape", "data": a bytearray}
        for key, info in flat:
            if info["dtype"] not in _ST_DTYPES:
                raise self._unreadable(f"tensor {key!r} has dtype {info['dtype']}, which fp8ref does not load "
                                       f"(it reads {', '.join(_ST_DTYPES)})")

    def _read_all(self, fd: int, size: int) -> bytes:
        chunks, got = [], 0
        while got < size:
            chunk = os.pread(fd, size - got, got)
            if not chunk:
                raise CheckpointError(f"{self.path}: short read ({got} of {size} bytes): the file was truncated "
                                      "or is being rewritten")
            chunks.append(chunk)
            got += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _unreadable(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({detail})")

    def _refused(self, message: str) -> CheckpointError:
        """safetensors' refusal as a ``CheckpointError`` naming the file, the tensor and the rule."""
        detail = message.removeprefix("Error while deserializing: ")
        tensor = re.search(r"`(.*)`$", detail)
        for text, rule in _ST_RULES:
            if detail.startswith(text):
                where = f"tensor {tensor.group(1)!r}: " if tensor else ""
                return self._unreadable(f"{where}{rule}; safetensors: {detail}")
        return self._unreadable(f"safetensors: {detail}")

    def _metadata(self, header: bytes) -> dict | None:
        """The header's ``__metadata__`` (string to string: safetensors checked it), read by a second
        parse that also refuses a key named twice at the top level or in the metadata (safetensors
        refuses a field named twice inside a tensor's entry itself)."""
        def pairs(items: list[tuple[str, object]]) -> tuple | None:
            for _, value in items:
                if type(value) is list:  # a tensor's entry (shape, data_offsets): safetensors gave its fields
                    return None
            return tuple(items)  # the metadata, or the top level

        try:
            top = json.loads(header, object_pairs_hook=pairs)
        except (ValueError, RecursionError) as exc:  # safetensors accepted it: a disagreement of parsers
            raise self._unreadable(f"header: {type(exc).__name__}: {exc}") from None
        self._once(top, "the header")
        meta = next((v for k, v in top if k == "__metadata__"), None)
        if meta is None:
            return None
        self._once(meta, "__metadata__")
        return dict(meta)

    def _once(self, items: tuple[tuple[str, object], ...], where: str) -> None:
        if len({k for k, _ in items}) != len(items):
            seen: set[str] = set()
            dup = next(k for k, _ in items if k in seen or seen.add(k))
            raise self._unreadable(f"the key {dup!r} is named twice in {where} (safetensors keeps the last "
                                   "entry; a reader that keeps the first loads something else)")

    def metadata(self) -> dict | None:
        return self._meta

    def keys(self) -> set[str]:
        return set(self._entries)

    def dtype_name(self, key: str) -> str:
        """The tensor's safetensors dtype name (``F8_E4M3``, ``F32``, ...)."""
        return self._entries[key]["dtype"]

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self._entries[key]
        dtype, buf = _ST_DTYPES[info["dtype"]], info["data"]
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        if not isinstance(buf, bytearray):  # older safetensors return read-only bytes
            buf = info["data"] = bytearray(buf)
        # The bytes safetensors copied out for this tensor (a bytearray the tensor keeps alive): no copy.
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def check_unchanged(self) -> None:
        """Raise ``CheckpointError`` if the file was rewritten in place since it was opened (its size
        or modification time changed); a file replaced by rename leaves the one read whole."""
        now, then = os.fstat(self._fd), self._stat
        if (now.st_size, now.st_mtime_ns) != (then.st_size, then.st_mtime_ns):
            raise CheckpointError(f"{self.path} changed while it was being read (another program rewrote it); "
                                  "nothing was loaded, read it again")

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        self._entries = {}
        os.close(self._fd)
