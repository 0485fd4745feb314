"""The arguments' side of the calling contract: views of a tensor (``as_view``), snapshots and
storage overlap (inputs untouched, outputs fresh), the in-place updates a caller makes between
calls, and how much of each a backend that pays per element gets per example.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ....registry import Backend
from ....spec.compare import compare_bits
from ....spec.quant import Quantized
from ..common import (
    ContractViolation,
)

#: The layouts every tensor argument is passed in (``as_view``).
VIEW_KINDS = ("transposed", "offset", "row_stride", "col_stride", "stride0")


#: The ways a caller updates a tensor in place between two calls (``_update``).
UPDATES = ("copy_", "mul_", "setitem", "data", "numpy")


def _light(backend: Backend) -> bool:
    """Whether the backend pays per element (an interpreter: ``Backend.conformance_max_elems``,
    which the driver reads too): each example then takes two view kinds, two updates and two
    rounds of threads instead of all of them, chosen by the problem so the sweep still covers all."""
    hint = backend.conformance_max_elems
    return isinstance(hint, int) and hint > 0


def _pick(options: tuple, p, backend: Backend, n: int = 2) -> tuple:
    """All of ``options``, or (a backend that pays per element) ``n`` of them chosen by the problem."""
    if not _light(backend):
        return options
    i = zlib.crc32(repr(p).encode())
    return tuple(options[(i + j) % len(options)] for j in range(n))


def _poison(dtype: torch.dtype) -> torch.Tensor:
    """The value around a view: NaN (the NaN code for FP8 formats), so that an element read from
    the wrong place shows in the result."""
    return torch.tensor(float("nan")).to(dtype)


def as_view(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """``t`` passed as a view of kind ``kind`` (``VIEW_KINDS``), or None where the kind does not apply.

    The storage around the view holds NaN. ``stride0`` changes the values: rows (or, for one row,
    columns) repeat the first one, through a stride of 0.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.conformance.contracts.calling import as_view
    >>> v = as_view(torch.arange(6.0).reshape(2, 3), "offset")
    >>> v.tolist(), v.stride(), v.storage_offset()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], (6, 1), 9)
    """
    if t.dim() not in (1, 2) or t.numel() == 0:
        return None
    p = _poison(t.dtype)

    def big(*shape):
        return p.expand(*shape).clone()

    if t.dim() == 1:
        (n,) = t.shape
        if kind == "offset":
            b = big(n + 5)
            b[5:] = t
            return b[5:]
        if kind == "row_stride":
            b = big(2 * n)
            b[::2] = t
            return b[::2]
        if kind == "stride0" and n > 1:
            return t[:1].expand(n)
        return None
    R, C = t.shape
    if kind == "transposed":
        return t.t().contiguous().t() if R > 1 and C > 1 else None
    if kind == "offset":
        b = big(R + 1, C + 3)
        b[1:, 3:] = t
        return b[1:, 3:]
    if kind == "row_stride":
        b = big(2 * R, C)
        b[::2] = t
        return b[::2]
    if kind == "col_stride":
        b = big(R, 2 * C)
        b[:, ::2] = t
        return b[:, ::2]
    if kind == "stride0":
        if R > 1:
            return t[:1].expand(R, C)
        return t[:, :1].expand(R, C) if C > 1 else None
    raise ValueError(f"unknown view kind {kind!r}; kinds: {VIEW_KINDS}")


def _tensors_in(obj: Any, name: str, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` (a prepared weight is any object a backend returns):
    tensors, Quantized fields, sequences, mappings and the attributes of other objects, two levels deep."""
    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if depth > 2 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype)):
        return []
    if isinstance(obj, Quantized):
        return [(f"{name}.data", obj.data), (f"{name}.scale", obj.scale)]
    if isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return []
    out = []
    for k, v in items:
        out += _tensors_in(v, f"{name}.{k}" if not isinstance(k, int) else f"{name}[{k}]", depth + 1)
    return out


def _snapshot(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    return [(n, t, t.detach().clone()) for n, t in named]


def _check_unchanged(snap, when: str, rule: str = "an input must never be written") -> None:
    """Each tensor of ``snap`` against its copy, bit for bit (``fp8ref.spec.compare.compare_bits``)."""
    for name, t, before in snap:
        verdict = compare_bits(name, t, before)
        if not verdict.ok:
            raise ContractViolation(f"{when} modified {verdict.message()}: {rule}")


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range of ``t``'s storage (None for an empty one)."""
    s = t.untyped_storage()
    return None if s.nbytes() == 0 else (s.data_ptr(), s.data_ptr() + s.nbytes())


def storage_overlaps(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``u`` and ``v`` share storage (any overlap of the two storages' byte ranges)."""
    su, sv = _span(u), _span(v)
    return su is not None and sv is not None and u.device == v.device and su[0] < sv[1] and sv[0] < su[1]


def _check_fresh(outs: dict[str, torch.Tensor], named_inputs: list[tuple[str, torch.Tensor]], when: str) -> None:
    for on, o in outs.items():
        for n, t in named_inputs:
            if storage_overlaps(o, t):
                raise ContractViolation(f"{when}: output {on} shares storage with the argument {n}; an output "
                                        f"must be fresh memory (the caller may update or free its arguments)")


def _altered(t: torch.Tensor, name: str) -> torch.Tensor:
    """New values for ``t`` of the same shape and dtype, still valid for its role: scales doubled
    (positive, exact), values and codes negated and rolled by one along the last dimension."""
    if name.endswith("scale"):
        return t * 2
    v = -(t.to(torch.float32))  # through float: FNUZ formats have no -0 to flip a sign bit into
    if t.dim() >= 1 and t.shape[-1] > 1:
        v = v.roll(1, dims=-1)
    return v.to(t.dtype)


def _update(t: torch.Tensor, name: str, how: str) -> None:
    """Update ``t`` in place, as a caller does between calls (``UPDATES``)."""
    new = _altered(t, name)
    if how == "copy_":
        t.copy_(new)
    elif how == "mul_":
        with torch.no_grad():
            if t.is_floating_point() and t.element_size() > 1:
                t.mul_(2)
            else:  # FP8 codes have no in-place arithmetic: a caller copies
                t.copy_(new)
    elif how == "setitem":
        with torch.no_grad():
            t[...] = new
    elif how == "data":
        t.data = new  # same tensor object, new storage
    elif how == "numpy":  # a write through a numpy view: the version counter does not move
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t.view(ints).numpy()[...] = new.view(ints).numpy()
    else:
        raise ValueError(f"unknown update {how!r}; updates: {UPDATES}")
