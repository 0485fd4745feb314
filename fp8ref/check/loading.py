"""The loader contracts' checks: a loader's held weight against the spec's Loading rule
(docs/spec.md §8), after one load, after a reload, and on poisoned allocations.

A loader (``WeightLoader``) is driven as a serving stack drives it: ``create`` (allocate the
layer's parameters for a ``LoadLayout``), ``load`` (the weight loader: each partition's weight, or
its checkpoint), ``process`` (post-processing after loading) and ``read`` (what the GEMM will read:
an ``fp8ref.spec.loading.Loaded``). A plain callable ``fn(source, layout) -> Loaded`` is wrapped as
a stateless loader (``FunctionLoader``). ``LoadProblem`` describes one rank's shard and the values
of each partition; the checks raise ``ContractViolation`` locating the worst element (row,
partition, column), or ``Declined`` for a layout the loader does not support.

Imports flow down: the spec and ``common``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..spec.loading import (
    SOURCE_DTYPES,
    Loaded,
    LoadLayout,
    LoadSource,
    checkpoint,
    entry_index,
    expectation,
    loaded_error_bound,
)
from ..spec.schemes import QuantScheme
from .common import ContractViolation, Declined

__all__ = ["WeightLoader", "FunctionLoader", "LoadProblem", "LOAD_FAMILIES", "check_load_values",
           "check_load_reload", "check_load_poison", "poisoned_allocations", "run_loader"]

#: Value families of a partition: ``normal`` (Gaussian times a power of two per partition),
#: ``wide`` (past E4M3's 448: up to fp16's range), ``zero`` (the partition is all zeros), ``tiny``
#: (near the scale floor), ``outlier`` (one large element per partition).
LOAD_FAMILIES = ("normal", "wide", "zero", "tiny", "outlier")


class WeightLoader:
    """A weight loader under test: how a serving stack allocates, loads and post-processes one
    fused linear weight. Subclass it to wrap yours (docs/writing-a-backend.md, "Wrapping a loader").

    Attributes
    ----------
    name : str
    scheme : QuantScheme
        The weight scheme it produces (tensor, row or block).
    offline : bool
        It reads a checkpoint (``LoadSource.codes``/``scales``) rather than quantizing itself.
    source_dtypes : tuple of torch.dtype
        Full-precision dtypes it takes.
    parallel : tuple of str
        ``"column"`` and/or ``"row"``.
    tp_sizes : tuple of int
    """

    name: str = "loader"
    scheme: QuantScheme = QuantScheme()
    offline: bool = False
    source_dtypes: tuple[torch.dtype, ...] = SOURCE_DTYPES
    parallel: tuple[str, ...] = ("column", "row")
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)

    def supports(self, layout: LoadLayout, dtype: torch.dtype) -> str | None:
        """None, or why this loader does not take ``layout`` with ``dtype`` sources."""
        return None

    def create(self, layout: LoadLayout) -> Any:
        """Allocate the layer's state for ``layout`` (``torch.empty`` is poisoned here by the checks)."""
        raise NotImplementedError

    def load(self, state: Any, layout: LoadLayout, source: LoadSource) -> None:
        """Load every partition's weight (or checkpoint) into ``state``."""
        raise NotImplementedError

    def process(self, state: Any, layout: LoadLayout) -> None:
        """Post-processing after loading (requantization, layout changes); default none."""

    def read(self, state: Any, layout: LoadLayout) -> Loaded:
        """What the GEMM reads."""
        raise NotImplementedError


class FunctionLoader(WeightLoader):
    """A stateless loader: ``fn(source, layout) -> Loaded`` at every load."""

    def __init__(self, fn: Callable[[LoadSource, LoadLayout], Loaded], scheme: QuantScheme, *,
                 offline: bool = False, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(scheme, QuantScheme):
            raise TypeError(f"scheme must be a QuantScheme, got {type(scheme).__name__}")
        self.fn, self.scheme, self.offline = fn, scheme, offline
        self.name = name or getattr(fn, "__name__", "loader")

    def create(self, layout):
        return {}

    def load(self, state, layout, source):
        state["held"] = self.fn(source, layout)

    def read(self, state, layout):
        return state["held"]


@dataclass(frozen=True)
class LoadProblem:
    """One rank's shard and the values of each partition: ``families[p]`` names partition p's
    values, ``exponents[p]`` its power of two (partitions of different magnitude make a wrong
    partition's scale visible), ``seed`` the draw."""

    layout: LoadLayout
    dtype: torch.dtype
    families: tuple[str, ...]
    exponents: tuple[int, ...]
    seed: int = 0
    reloads: int = 1

    def __post_init__(self) -> None:
        n = len(self.layout.partitions)
        if len(self.families) != n or len(self.exponents) != n:
            raise ValueError(f"families and exponents need one entry per partition ({n})")
        bad = [f for f in self.families if f not in LOAD_FAMILIES]
        if bad:
            raise ValueError(f"unknown families {bad}; known: {LOAD_FAMILIES}")
        if self.dtype not in SOURCE_DTYPES:
            raise ValueError(f"dtype must be one of {SOURCE_DTYPES}, got {self.dtype}")

    def weights(self) -> tuple[torch.Tensor, ...]:
        """Each partition's full weight ``[N_p, K]`` in ``dtype``."""
        g = torch.Generator().manual_seed(self.seed)
        out = []
        big = torch.finfo(self.dtype).max / 2 if self.dtype != torch.float32 else 2.0**20
        for n, fam, e in zip(self.layout.partitions, self.families, self.exponents, strict=True):
            x = torch.randn(n, self.layout.k, generator=g, dtype=torch.float32)
            if fam == "zero":
                x = torch.zeros_like(x)
            elif fam == "wide":  # past E4M3's range, up to half the source dtype's max
                x = x.clamp(-4, 4) / 4 * min(big, 448.0 * 2.0 ** max(e, 4))
            elif fam == "tiny":
                x = x * 2.0 ** (-14 + min(e, 0))
            elif fam == "outlier":
                x = x * 2.0**e
                flat = x.view(-1)
                flat[int(torch.randint(flat.numel(), (1,), generator=g))] = 2.0 ** (e + 6)
            else:
                x = x * 2.0**e
            out.append(x.to(self.dtype))
        return tuple(out)

    def facets(self) -> dict:
        lay = self.layout
        return {"N": sum(lay.partitions), "K": lay.k, "formats": {lay.scheme.format.name},
                "granularity": {lay.scheme.granularity.value}, "x": {str(self.dtype).replace("torch.", "")},
                "scales": {f"tp{lay.tp_size}{lay.parallel[0]}"}, "family": set(self.families)}

    def __repr__(self) -> str:
        fams = ",".join(f"{f}@2**{e}" for f, e in zip(self.families, self.exponents, strict=True))
        again = f", {self.reloads} loads" if self.reloads > 1 else ""
        return (f"load {self.layout.short_str()} rank {self.layout.tp_rank}/{self.layout.tp_size} from "
                f"{str(self.dtype).replace('torch.', '')} [{fams}] seed={self.seed}{again}")


# --------------------------------------------------------------------------------------------
# running a loader


def _nan_byte(dtype: torch.dtype) -> int:
    return 0x80 if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) else 0x7F


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _fill(t: torch.Tensor, value: float | None) -> torch.Tensor:
    if value is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return t
    if t.dtype in _FP8:
        byte = _nan_byte(t.dtype) if value != value else int(torch.tensor(value).to(t.dtype).view(torch.uint8))
        t.view(torch.uint8).fill_(byte)
    elif t.is_floating_point():
        t.fill_(value)
    return t


@contextmanager
def poisoned_allocations(value: float | None):
    """While active, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return memory
    filled with ``value`` (NaN: FP8 tensors get their format's NaN byte); None changes nothing.
    An element a loader never writes then reads as the poison instead of a lucky zero."""
    if value is None:
        yield
        return
    e, el, ne = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def empty(*a, **kw):
        return _fill(e(*a, **kw), value)

    def empty_like(*a, **kw):
        return _fill(el(*a, **kw), value)

    def new_empty(self, *a, **kw):
        return _fill(ne(self, *a, **kw), value)

    torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = e, el, ne


def _source(loader: WeightLoader, p: LoadProblem, weights) -> LoadSource:
    if loader.offline:
        return checkpoint(p.layout, weights)
    return LoadSource(tuple(w.clone() for w in weights))


def _require(loader: WeightLoader, p: LoadProblem) -> None:
    lay = p.layout
    if lay.scheme != loader.scheme:
        raise Declined(f"supports: scheme {lay.scheme.short_str()} (the loader makes {loader.scheme.short_str()})")
    if lay.offline != loader.offline:
        raise Declined("supports: " + ("offline" if lay.offline else "online") + " loading")
    if p.dtype not in loader.source_dtypes:
        raise Declined(f"supports: {p.dtype} sources")
    if lay.parallel not in loader.parallel or lay.tp_size not in loader.tp_sizes:
        raise Declined(f"supports: {lay.parallel}-parallel TP {lay.tp_size}")
    why = loader.supports(lay, p.dtype)
    if why is not None:
        raise Declined(f"supports: {why}")


def run_loader(loader: WeightLoader, p: LoadProblem, *, poison: float | None = float("nan"),
               loads: int = 1) -> Loaded:
    """``create``, then ``loads`` times ``load`` + ``process``, then ``read``, with allocations poisoned."""
    _require(loader, p)
    weights = p.weights()
    with poisoned_allocations(poison):
        state = loader.create(p.layout)
        for _ in range(loads):
            loader.load(state, p.layout, _source(loader, p, weights))
            loader.process(state, p.layout)
    held = loader.read(state, p.layout)
    if not isinstance(held, Loaded):
        raise ContractViolation(f"read returned {type(held).__name__}, not an fp8ref.spec.loading.Loaded")
    return held


def _where(p: LoadProblem, i: int, j: int) -> str:
    lay = p.layout
    part = max(q for q, o in enumerate(lay.offsets) if o <= i)
    return f"row {i} (partition {part}, its row {i - lay.offsets[part]}), column {j}"


def _judge(p: LoadProblem, held: Loaded) -> float:
    """Worst error/bound of ``held`` against the Loading rule; raises ``ContractViolation``."""
    lay, scheme = p.layout, p.layout.scheme
    n, k = lay.shape
    if held.data.dtype != scheme.format.torch_dtype or tuple(held.data.shape) != (n, k):
        raise ContractViolation(f"held codes are {held.data.dtype} {tuple(held.data.shape)}; the shard needs "
                                f"{scheme.format.torch_dtype} {(n, k)}")
    try:
        s2, rows, cols = entry_index(lay, held)
    except ValueError as exc:
        raise ContractViolation(str(exc)) from None
    exp = expectation(lay, p.weights())
    codes = held.data.to(torch.float64)
    e = s2.to(torch.float64)[rows][:, cols]
    entries = rows.reshape(-1, 1) * s2.shape[1] + cols.reshape(1, -1)
    lo, hi, bound = loaded_error_bound(exp, entries, e)
    bad = ~torch.isfinite(codes)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ContractViolation(f"{int(bad.sum())} NaN codes (byte {int(held.data.view(torch.uint8)[i, j]):#04x}) "
                                f"first at {_where(p, i, j)}, source value {exp.x[i, j].item()!r}")
    bad = ~torch.isfinite(e) | (e <= 0) | (e < lo) | (e > hi)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ContractViolation(f"{int(bad.sum())} elements read a scale outside the Loading rule's interval; first "
                                f"at {_where(p, i, j)}: scale {e[i, j].item()!r}, allowed [{lo[i, j].item()!r}, "
                                f"{hi[i, j].item()!r}] (its partition's own scale is in [{exp.own_lo[i, j].item()!r}, "
                                f"{exp.own_hi[i, j].item()!r}]{_agreed(exp, i, j)})")
    err = (codes * e - exp.x).abs()
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.full_like(err, float("inf")), 0 * err))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if worst > 1:
        i, j = divmod(int(ratio.argmax()), k)
        raise ContractViolation(f"{int((ratio > 1).sum())} elements dequantize outside the bound; worst at "
                                f"{_where(p, i, j)}: code {codes[i, j].item()!r} x scale {e[i, j].item()!r} = "
                                f"{(codes[i, j] * e[i, j]).item()!r}, source {exp.x[i, j].item()!r}, error "
                                f"{err[i, j].item():.4g} > bound {bound[i, j].item():.4g} (ratio {worst:.4g})",
                                ratio=worst)
    return worst


def _agreed(exp, i: int, j: int) -> str:
    """The TP-agreed alternative's upper end at (i, j), where the rule admits one (§8.2)."""
    if exp.agreed_hi is None:
        return ""
    return f"; the unsharded partition's, agreed over the TP group, up to {exp.agreed_hi[i, j].item()!r}"


def _effective(p: LoadProblem, held: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
    """(code bits, per-element scale bits): what the GEMM reads, whatever the storage layout."""
    s2, rows, cols = entry_index(p.layout, held)
    return held.data.view(torch.uint8).clone(), s2[rows][:, cols].to(torch.float64)


def check_load_values(loader: WeightLoader, p: LoadProblem) -> float:
    """One load: every element dequantizes per the Loading rule."""
    return _judge(p, run_loader(loader, p, loads=p.reloads))


def check_load_reload(loader: WeightLoader, p: LoadProblem) -> float:
    """Load + process twice on one layer: the same bits as once, and within the rule."""
    once = run_loader(loader, p)
    ratio = _judge(p, once)
    twice = run_loader(loader, p, loads=2)
    for what, u, v in zip(("codes", "scales"), _effective(p, twice), _effective(p, once), strict=True):
        diff = ~((u == v) | (u.isnan() & v.isnan()))
        if bool(diff.any()):
            i, j = (int(t) for t in diff.nonzero()[0])
            raise ContractViolation(f"a second load and post-processing changed the {what} of {int(diff.sum())} "
                                    f"elements; first at {_where(p, i, j)}: {u[i, j].item()!r} after two, "
                                    f"{v[i, j].item()!r} after one")
    return ratio


#: Two poisons: NaN (an unwritten element is NaN) and a plausible finite value (an unwritten
#: element looks like a weight; the two runs then differ).
POISONS = (float("nan"), 0.5)


def check_load_poison(loader: WeightLoader, p: LoadProblem) -> float:
    """Allocations poisoned with NaN, then with 0.5: the held weight is within the rule and the
    same in both runs (no element keeps what the allocation held)."""
    runs = [run_loader(loader, p, poison=v) for v in POISONS]
    ratio = max(_judge(p, h) for h in runs)
    for what, u, v in zip(("codes", "scales"), _effective(p, runs[0]), _effective(p, runs[1]), strict=True):
        diff = ~((u == v) | (u.isnan() & v.isnan()))
        if bool(diff.any()):
            i, j = (int(t) for t in diff.nonzero()[0])
            raise ContractViolation(f"the {what} of {int(diff.sum())} elements follow the allocation's contents; "
                                    f"first at {_where(p, i, j)}: {u[i, j].item()!r} with NaN-filled memory, "
                                    f"{v[i, j].item()!r} with 0.5-filled")
    return ratio
