"""The one comparison of a result with the spec: value, reference and bound in, a typed verdict out.

Every place that judges a number against the spec -- the conformance contracts, the selector's
compliance probe, the peers' certificates, the audits' error/bound ratios -- calls ``compare`` (or,
for a whole ratio tensor, ``error_ratio``), so "within the bound" means one thing everywhere. The
shape of the routine follows ``torch.testing``'s single mismatch path: structural mismatches (not a
tensor, wrong shape, wrong dtype) and value mismatches all come back as a ``Verdict``, whose
``message()`` locates the worst element (index, value, reference, bound, ratio).

The rules, stated once (docs/spec.md §5.5):

* an element passes when ``|value - reference| <= bound``, both in float64; a NaN error fails;
* its ratio is ``|error| / bound``, with ``0 / 0 = 0`` (an exact result where the bound allows no
  error at all is a pass, ratio 0), ``e / 0 = inf`` for ``e > 0`` and ``inf`` for a NaN error;
* a structural mismatch has ratio ``inf`` and no worst element;
* ``compare_bits`` is the same routine for identities that hold bit for bit (determinism, sign
  symmetry, a fused hook against two calls): NaN payloads and the sign of zero count, and the
  worst element is the first that differs.

Imports flow down: torch only (a leaf of the spec).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = ["Mismatch", "Worst", "Verdict", "error_ratio", "compare", "compare_bits", "bit_pattern"]


class Mismatch(enum.Enum):
    """Why a comparison failed (``NONE``: it did not)."""

    NONE = "none"
    TYPE = "type"  #: the value is not a tensor
    SHAPE = "shape"
    DTYPE = "dtype"
    VALUE = "value"  #: some element lies outside its bound


@dataclass(frozen=True)
class Worst:
    """The element with the largest error/bound ratio (the first one, in row-major order, on a tie).

    Attributes
    ----------
    index : tuple of int
    value, reference, error, bound, ratio : float
        ``error = |value - reference|`` in float64; ``ratio`` by the rules of the module docstring.
    """

    index: tuple[int, ...]
    value: float
    reference: float
    error: float
    bound: float
    ratio: float


@dataclass(frozen=True)
class Verdict:
    """The outcome of ``compare``.

    Attributes
    ----------
    what : str
        What was compared, as the caller named it (the start of ``message()``).
    mismatch : Mismatch
        ``NONE`` when every element is within its bound.
    ratio : float
        The worst error/bound ratio (0 for an empty tensor; inf for a structural mismatch).
    n_bad, numel : int
        Elements outside their bound, and elements compared.
    worst : Worst or None
        The worst element (None when nothing was compared elementwise).
    detail : str
        For a structural mismatch: what differs.
    bitwise : bool
        Made by ``compare_bits`` (the worst element is the first whose bits differ).
    """

    what: str
    mismatch: Mismatch
    ratio: float
    n_bad: int = 0
    numel: int = 0
    worst: Worst | None = None
    detail: str = ""
    bitwise: bool = False

    @property
    def ok(self) -> bool:
        return self.mismatch is Mismatch.NONE

    def message(self) -> str:
        """One line: what failed and where (the worst element for a value mismatch)."""
        if self.mismatch in (Mismatch.TYPE, Mismatch.SHAPE, Mismatch.DTYPE):
            return f"{self.what}: {self.detail}"
        w = self.worst
        if self.bitwise and self.ok:
            return f"{self.what}: bit-identical ({self.numel} elements)"
        if w is None:
            return f"{self.what}: within the bound (nothing compared)"
        if self.bitwise:
            return (f"{self.what}: {self.n_bad} of {self.numel} elements differ in their bits; first at {w.index}: "
                    f"got {w.value!r}, reference {w.reference!r}")
        head = (f"{self.n_bad} of {self.numel} elements outside the bound; worst"
                if not self.ok else "within the bound; worst")
        rel = ">" if not self.ok else "<="
        return (f"{self.what}: {head} at {w.index}: got {w.value!r}, reference {w.reference!r}, "
                f"|error| {w.error:.6g} {rel} bound {w.bound:.6g} (ratio {w.ratio:.3g})")


def error_ratio(error: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Elementwise ``error / bound`` by the one rule: 0/0 = 0, e/0 = inf (e > 0), NaN error = inf.

    Parameters
    ----------
    error : Tensor
        ``|value - reference|`` (non-negative or NaN), float64.
    bound : Tensor
        Non-negative, broadcastable to ``error``.

    Examples
    --------
    >>> import torch
    >>> error_ratio(torch.tensor([0.0, 1.0, 1.0, float("nan")], dtype=torch.float64),
    ...             torch.tensor([0.0, 0.0, 2.0, 1.0], dtype=torch.float64)).tolist()
    [0.0, inf, 0.5, inf]
    """
    ratio = torch.where(bound > 0, error / bound, torch.where(error == 0, 0.0, math.inf))
    return torch.where(torch.isnan(error), math.inf, ratio)


def _structural(what: str, value, reference: torch.Tensor, dtype: torch.dtype | None) -> Verdict | None:
    if not isinstance(value, torch.Tensor):
        return Verdict(what, Mismatch.TYPE, math.inf, detail=f"returned {type(value).__name__}, not a tensor")
    if tuple(value.shape) != tuple(reference.shape):
        return Verdict(what, Mismatch.SHAPE, math.inf,
                       detail=f"shape {tuple(value.shape)}, expected {tuple(reference.shape)}")
    if dtype is not None and value.dtype != dtype:
        return Verdict(what, Mismatch.DTYPE, math.inf, detail=f"dtype {value.dtype}, expected {dtype}")
    return None


def compare(what: str, value, reference: torch.Tensor, bound: torch.Tensor | float, *,
            dtype: torch.dtype | None = None) -> Verdict:
    """Judge ``value`` against ``reference`` within ``bound``, elementwise.

    Parameters
    ----------
    what : str
        Names the comparison in the verdict's message.
    value : Tensor (or anything a backend returned)
        The result under test; not a tensor, another shape or (when ``dtype`` is given) another
        dtype is a structural mismatch.
    reference : Tensor
        What the spec says (any float dtype; compared in float64).
    bound : Tensor or float
        Non-negative, broadcastable to ``reference`` (0: bit-exact values, NaN never equal).
    dtype : torch.dtype, optional
        The dtype ``value`` must have.

    Returns
    -------
    Verdict

    Notes
    -----
    Element ``i`` passes when ``|value_i - reference_i| <= bound_i`` (float64). The verdict's ratio
    is the largest ``error_ratio`` (0 for an empty tensor).

    Examples
    --------
    >>> import torch
    >>> v = compare("y", torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.25]))
    >>> v.ok, v.ratio, v.worst.index
    (False, 2.0, (1,))
    >>> compare("y", torch.zeros(3), torch.zeros(2), 0.0).message()
    'y: shape (3,), expected (2,)'
    """
    bad = _structural(what, value, reference, dtype)
    if bad is not None:
        return bad
    v64 = value.detach().to(device="cpu", dtype=torch.float64)
    r64 = reference.detach().to(device="cpu", dtype=torch.float64)
    b64 = torch.as_tensor(bound, dtype=torch.float64).to("cpu").expand_as(r64)
    err = (v64 - r64).abs()
    if err.numel() == 0:
        return Verdict(what, Mismatch.NONE, 0.0)
    ok = err <= b64  # False wherever err is NaN
    ratio = error_ratio(err, b64)
    flat = int(torch.argmax(ratio))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    worst = Worst(idx, v64[idx].item(), r64[idx].item(), err[idx].item(), b64[idx].item(), ratio[idx].item())
    n_bad = int((~ok).sum())
    return Verdict(what, Mismatch.VALUE if n_bad else Mismatch.NONE, worst.ratio, n_bad, err.numel(), worst)


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a contiguous CPU integer tensor of the same element size (what
    ``compare_bits`` compares; a snapshot of it detects any write to ``t``)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare_bits(what: str, value, reference: torch.Tensor) -> Verdict:
    """Judge ``value`` against ``reference`` bit for bit: same type, shape, dtype and bits.

    Returns
    -------
    Verdict
        Ratio 0 when identical, inf otherwise; ``worst`` is the first element (row-major) whose
        bits differ.

    Examples
    --------
    >>> import torch
    >>> compare_bits("y", torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])).message()
    'y: 1 of 2 elements differ in their bits; first at (0,): got 0.0, reference -0.0'
    """
    bad = _structural(what, value, reference, reference.dtype)
    if bad is not None:
        return bad
    diff = bit_pattern(value) != bit_pattern(reference)
    n_bad = int(diff.sum())
    if n_bad == 0:
        return Verdict(what, Mismatch.NONE, 0.0, 0, diff.numel(), bitwise=True)
    idx = tuple(int(i) for i in diff.nonzero()[0])
    v, r = value.detach().cpu()[idx].item(), reference.detach().cpu()[idx].item()
    worst = Worst(idx, v, r, abs(v - r), 0.0, math.inf)
    return Verdict(what, Mismatch.VALUE, math.inf, n_bad, diff.numel(), worst, bitwise=True)
