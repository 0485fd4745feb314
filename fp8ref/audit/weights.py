"""Weight-only streaming audit of a safetensors checkpoint, one tensor (and one row chunk) at a time.

The checkpoint is never loaded: the safetensors header (8-byte little-endian length, then a
JSON table of ``dtype``, ``shape``, ``data_offsets``) is parsed here and each 2-D float tensor
is read in row chunks with plain file reads (no mmap, so pages of tensors already audited do
not stay in the resident set). Peak memory is one chunk's working set (about 35 bytes per
element of the chunk, ``chunk_elements`` elements) plus the interpreter, whatever the
checkpoint or tensor size. Per-tensor granularity needs the whole tensor's amax first: a first
streaming pass computes it, and the second quantizes each chunk with that exact scale (the same
scale the dynamic quantizer computes on the whole tensor).

FP8 tensors already in the file (``F8_E4M3``/``F8_E5M2``, e.g. an FP8_DYNAMIC checkpoint) are
reported by their codes: the fraction of zero codes, NaN codes and their ``<name>_scale``
sibling's range; an all-zero FP8 weight is flagged (sglang#4434).
"""

from __future__ import annotations

import json
import math
import os
import resource
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..spec.quant import compute_scale, quantize
from ..spec.schemes import W8A8_FP8, Granularity, QuantScheme, Recipe, get_recipe
from .core import _matches
from .report import _dec_float, _enc

__all__ = ["TensorStats", "WeightAudit", "audit_safetensors", "safetensors_files", "read_header"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FLOAT = ("F64", "F32", "F16", "BF16")
_FP8 = ("F8_E4M3", "F8_E5M2")
_MAX_HEADER = 100 * 2**20  # the safetensors reference implementation's own limit


@dataclass
class TensorStats:
    """One tensor of the checkpoint.

    ``kind`` is ``quantized`` (a 2-D float tensor quantized under the recipe's weight scheme),
    ``fp8`` (already FP8 codes in the file), or ``skipped`` (with ``note`` saying why).
    """

    name: str
    file: str
    dtype: str
    shape: list[int]
    kind: str
    rel_l2: float = float("nan")
    max_abs: float = float("nan")
    sqnr_db: float = float("nan")
    saturated: float = float("nan")
    flushed: float = float("nan")
    zero_codes: float = float("nan")
    nan_codes: int = 0
    scale_min: float = float("nan")
    scale_max: float = float("nan")
    nbytes: int = 0
    note: str = ""
    flags: list[str] = field(default_factory=list)


@dataclass
class WeightAudit:
    """Result of ``audit_safetensors``."""

    path: str
    recipe: str
    scheme: str
    tensors: list[TensorStats]
    meta: dict = field(default_factory=dict)

    @property
    def flagged(self) -> list[TensorStats]:
        return [t for t in self.tensors if t.flags]

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(_enc(asdict(self)), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.write_text(self.to_json())
        return p

    @classmethod
    def from_json(cls, text: str) -> WeightAudit:
        d = json.loads(text)
        d["tensors"] = [TensorStats(**{k: _dec_float(v) for k, v in t.items()}) for t in d["tensors"]]
        return cls(**d)

    def to_markdown(self) -> str:
        q = [t for t in self.tensors if t.kind == "quantized"]
        out = [f"# Weight audit: {self.path}", "", f"recipe `{self.recipe}`, weight scheme `{self.scheme}`"]
        out += [f"- {k}: {v}" for k, v in self.meta.items()]
        out += ["", f"{len(q)} tensors quantized, {sum(t.kind == 'fp8' for t in self.tensors)} already FP8, "
                    f"{sum(t.kind == 'skipped' for t in self.tensors)} skipped; {len(self.flagged)} flagged.", "",
                "| tensor | dtype | shape | kind | SQNR dB | rel L2 | saturated | flushed | zero codes | scale "
                "| flags |",
                "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
        for t in self.tensors:
            if t.kind == "skipped":
                continue
            out.append(f"| {t.name} | {t.dtype} | {'x'.join(map(str, t.shape))} | {t.kind} | {t.sqnr_db:.2f} | "
                       f"{t.rel_l2:.3g} | {t.saturated:.2g} | {t.flushed:.2g} | {t.zero_codes:.2g} | "
                       f"{t.scale_min:.3g}..{t.scale_max:.3g} | {'; '.join(t.flags) or '-'} |")
        return "\n".join(out) + "\n"


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The shard files of a checkpoint: a ``.safetensors`` file, a ``*.index.json`` (its
    ``weight_map``), or a folder holding ``model.safetensors`` or one index."""
    p = Path(path)
    if p.is_dir():
        idx = sorted(p.glob("*.safetensors.index.json"))
        if len(idx) == 1:
            p = idx[0]
        elif (p / "model.safetensors").is_file():
            return [p / "model.safetensors"]
        else:
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{p}: no .safetensors file or index in this folder")
            return files
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    if p.name.endswith(".json"):
        try:
            wm = json.loads(p.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}: not a safetensors index (needs a 'weight_map'): {exc!r}") from None
        files = [p.parent / f for f in dict.fromkeys(wm.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{p}: shard {f.name} listed in weight_map is missing")
        return files
    return [p]


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header dict without ``__metadata__``, byte offset where the data starts) of one file."""
    p = Path(path)
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{p}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{p}: header length {n} is implausible: not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_rows(f, start: int, dtype: torch.dtype, cols: int, r0: int, r1: int) -> torch.Tensor:
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = (r1 - r0) * cols * esize
    buf = bytearray(nbytes)
    f.seek(start + r0 * cols * esize)
    if f.readinto(buf) != nbytes:
        raise ValueError(f"{f.name}: truncated tensor data")
    return torch.frombuffer(buf, dtype=dtype).reshape(r1 - r0, cols)


def _chunks(rows: int, step: int) -> Iterator[tuple[int, int]]:
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _quantized_stats(f, start: int, dtype: torch.dtype, rows: int, cols: int, scheme: QuantScheme,
                     chunk_elements: int, t: TensorStats) -> None:
    unit = scheme.block_shape(rows, cols)[0] if scheme.granularity is Granularity.BLOCK else 1
    step = max(unit, (chunk_elements // max(cols, 1)) // unit * unit)
    cscheme, scale = scheme, None
    if scheme.granularity is Granularity.TENSOR:
        amax = 0.0
        for r0, r1 in _chunks(rows, step):
            x = _read_rows(f, start, dtype, cols, r0, r1)
            if not bool(torch.isfinite(x).all()):
                t.flags.append("non-finite values in the tensor")
                return
            amax = max(amax, float(x.abs().max()))
        # The dynamic per-tensor scale depends on amax alone; quantize each chunk with it.
        scale = compute_scale(torch.tensor([[amax]], dtype=torch.float32), scheme)
        cscheme = scheme.with_(dynamic=False)
    err2 = ref2 = 0.0
    max_abs = 0.0
    sat = flushed = nonzero = 0
    smin, smax = math.inf, -math.inf
    for r0, r1 in _chunks(rows, step):
        x = _read_rows(f, start, dtype, cols, r0, r1)
        if not bool(torch.isfinite(x).all()):
            t.flags.append("non-finite values in the tensor")
            return
        q = quantize(x, cscheme, scale)
        d = q.dequantize(torch.float64) - x.to(torch.float64)
        err2 += float(d.square().sum())
        ref2 += float(x.to(torch.float64).square().sum())
        max_abs = max(max_abs, float(d.abs().max())) if d.numel() else max_abs
        sat += q.n_saturated or 0
        nz = x != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (q.data.to(torch.float32) == 0)).sum())
        s = q.scale.to(torch.float64)
        smin, smax = min(smin, float(s.min())), max(smax, float(s.max()))
        del x, q, d, nz
    t.rel_l2 = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    t.sqnr_db = math.inf if err2 == 0 else (10 * math.log10(ref2 / err2) if ref2 > 0 else -math.inf)
    t.max_abs, t.saturated = max_abs, sat / max(rows * cols, 1)
    t.flushed = flushed / max(nonzero, 1)
    t.scale_min, t.scale_max = smin, smax


def _fp8_stats(f, start: int, dtype: torch.dtype, rows: int, cols: int, chunk_elements: int,
               t: TensorStats) -> None:
    zeros = nans = 0
    step = max(1, chunk_elements // max(cols, 1))
    for r0, r1 in _chunks(rows, step):
        v = _read_rows(f, start, dtype, cols, r0, r1).to(torch.float32)
        zeros += int((v == 0).sum())
        nans += int(torch.isnan(v).sum())
    n = max(rows * cols, 1)
    t.zero_codes, t.nan_codes = zeros / n, nans
    if zeros == rows * cols and n > 0:
        t.flags.append("every FP8 code is zero (the weight is lost, as in sglang#4434)")
    if nans:
        t.flags.append(f"{nans} NaN code(s)")


def audit_safetensors(path: str | os.PathLike, recipe: Recipe | str = W8A8_FP8, *,
                      skip: Sequence[str] = (), chunk_elements: int = 2**22, min_sqnr_db: float = 10.0,
                      progress: bool = False) -> WeightAudit:
    """Audit the weights of a safetensors checkpoint without loading it.

    Every 2-D float tensor (F32/F16/BF16/F64) is quantized under ``recipe.weight`` with the
    reference quantizer, chunk by chunk, and its quantization error (rel. L2, max abs, SQNR),
    saturated and flushed-to-zero fractions and scale range are reported. FP8 tensors are
    checked by their codes. Other tensors (1-D biases and norms, integer buffers, >2-D) are
    listed as skipped.

    Parameters
    ----------
    path : str or PathLike
        A ``.safetensors`` file, a sharded checkpoint's ``*.index.json``, or a folder with either.
    recipe : Recipe or str
        Its weight scheme is used (default ``W8A8_FP8``: per-output-channel).
    skip : sequence of str
        Tensor names to leave out (exact, dotted suffix or ``fnmatch`` pattern).
    chunk_elements : int
        Elements read and quantized at once (memory ~ 35 bytes each); rounded to whole rows
        (whole scale blocks for block schemes).
    min_sqnr_db : float
        Flag a quantized tensor whose SQNR is below this.
    progress : bool
        tqdm progress bar over tensors.

    Returns
    -------
    WeightAudit
        ``meta`` holds the peak resident set size of this process (``peak_rss_mb``, from
        ``getrusage``: the process's lifetime peak, imports included) and the largest tensor.

    Examples
    --------
    >>> import torch, tempfile, os
    >>> from safetensors.torch import save_file
    >>> from fp8ref.audit import audit_safetensors
    >>> d = tempfile.mkdtemp()
    >>> save_file({"fc.weight": torch.randn(64, 32), "fc.bias": torch.zeros(64)}, os.path.join(d, "m.safetensors"))
    >>> wa = audit_safetensors(os.path.join(d, "m.safetensors"))
    >>> [(t.name, t.kind) for t in wa.tensors]
    [('fc.bias', 'skipped'), ('fc.weight', 'quantized')]
    >>> wa.tensors[1].sqnr_db > 20
    True
    """
    recipe = get_recipe(recipe)
    if not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
    files = safetensors_files(path)
    t0 = time.perf_counter()
    entries = []
    for fp in files:
        header, start = read_header(fp)
        for name in sorted(header):
            entries.append((fp, start, name, header[name]))
    it = entries
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(entries, desc="tensors", unit="tensor")
        except ImportError:
            pass
    out: list[TensorStats] = []
    largest = 0
    fmap = {}
    try:
        for fp, start, name, info in it:
            dt, shape = info.get("dtype"), list(info.get("shape", []))
            b0, b1 = info.get("data_offsets", (0, 0))
            t = TensorStats(name, fp.name, str(dt), shape, "skipped", nbytes=b1 - b0)
            largest = max(largest, b1 - b0)
            if _matches(name, skip):
                t.note = "skipped by request"
            elif dt not in _DTYPES:
                t.note = f"dtype {dt} not handled"
            elif len(shape) != 2 or 0 in shape:
                t.note = f"{len(shape)}-D" if len(shape) != 2 else "empty"
            elif dt in _FLOAT or dt in _FP8:
                f = fmap.get(fp) or fmap.setdefault(fp, open(fp, "rb"))
                if dt in _FLOAT:
                    t.kind = "quantized"
                    _quantized_stats(f, start + b0, _DTYPES[dt], shape[0], shape[1], recipe.weight,
                                     chunk_elements, t)
                    if t.sqnr_db < min_sqnr_db:
                        t.flags.append(f"SQNR {t.sqnr_db:.1f} dB < {min_sqnr_db:g}")
                else:
                    t.kind = "fp8"
                    _fp8_stats(f, start + b0, _DTYPES[dt], shape[0], shape[1], chunk_elements, t)
            else:
                t.note = f"{dt} is not a float weight"
            out.append(t)
    finally:
        for f in fmap.values():
            f.close()
    # Scales of FP8 weights (FP8_DYNAMIC: "<m>.weight_scale" next to "<m>.weight").
    by_name = {t.name: t for t in out}
    for fp, start, name, info in entries:
        base = by_name.get(name[: -len("_scale")]) if name.endswith("_scale") else None
        if base is not None and base.kind == "fp8" and info.get("dtype") in _FLOAT:
            b0, b1 = info["data_offsets"]
            n = math.prod(info["shape"]) if info["shape"] else 1
            with open(fp, "rb") as f:
                s = _read_rows(f, start + b0, _DTYPES[info["dtype"]], 1, 0, n).to(torch.float64)
            base.scale_min, base.scale_max = float(s.min()), float(s.max())
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mb = ru / 2**20 if sys.platform == "darwin" else ru / 1024
    meta = {"files": len(files), "tensors": len(out), "largest_tensor_mb": round(largest / 2**20, 1),
            "chunk_elements": chunk_elements, "peak_rss_mb": round(peak_mb, 1),
            "seconds": round(time.perf_counter() - t0, 2)}
    return WeightAudit(str(path), recipe.name, recipe.weight.short_str(), out, meta)
