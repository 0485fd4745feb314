"""How ``fp8ref.linear`` and ``Fp8Linear`` notice that a cached weight changed (``weight_check``).

A cached weight (its quantized and prepared forms) is valid while the caller's tensors hold what
it was built from. Three checks, from cheapest: ``"version"`` (torch's version counters, storage
pointers and strides), ``"sample"`` (the default: also a fixed sample of the weight's memory and
all of its scales, against their values when the cache was built; sees writes torch does not
count when they touch the sample) and ``"content"`` (all of the weight's bytes against a kept
copy). docs/selection.md, "Weights changed in place", gives what each sees and costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _env
from .spec.quant import Quantized

__all__ = ["WEIGHT_CHECKS", "SAMPLE_ROWS", "ENV_WEIGHT_CHECK", "MemorySample", "Watch", "range_tensors",
           "tensor_version", "pair_version",
           "weight_check_mode"]

#: How ``fp8ref.linear`` notices that a cached weight changed: ``"sample"`` (default: identity,
#: torch's version counters and storage pointers, and a fixed sample of the weight's memory plus
#: all of its scales against their values when the cached form was built; a few µs), ``"version"``
#: (the counters and pointers only; O(1)) or ``"content"`` (all of the weight's bytes against a
#: kept copy, every call: sees every write). docs/selection.md, "Weights changed in place".
WEIGHT_CHECKS = ("sample", "version", "content")
#: Rows of a weight the ``"sample"`` check reads (one element each, on a diagonal walk): every row
#: of a weight up to this many rows, evenly spaced rows beyond (docs/selection.md gives the cost).
SAMPLE_ROWS = 512
#: Environment variable giving the default of ``weight_check``.
ENV_WEIGHT_CHECK = "FP8REF_WEIGHT_CHECK"


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``, or -1 for an inference tensor, which has no version counter (an in-place
    change to such a weight inside ``torch.inference_mode`` is not seen under
    ``weight_check="version"``)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def sources(w) -> tuple[torch.Tensor, ...]:
    """The caller's tensors a cached weight is computed from."""
    return (w.data, w.scale) if isinstance(w, Quantized) else (w,)


def version(w) -> tuple:
    """What torch counts about ``w``'s tensors: version counters, storage pointers and strides
    (``.data =``, ``set_`` and ``.to`` change the pointer; in-place ops through w or a view of it,
    ``copy_``, ``load_state_dict`` and optimizer steps bump the counter)."""
    if isinstance(w, Quantized):
        return pair_version(w.data, w.scale)
    return (tensor_version(w), w.data_ptr(), w.stride())


def pair_version(data: torch.Tensor, scale: torch.Tensor) -> tuple:
    """``version`` of a quantized weight held as two tensors (codes, scales)."""
    return (tensor_version(data), tensor_version(scale), data.data_ptr(), scale.data_ptr(), data.stride(),
            scale.stride())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def snapshot(w) -> tuple[torch.Tensor, ...]:
    return tuple(_bytes(t).clone() for t in sources(w))


def same_content(w, kept: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``w``'s tensors hold exactly the bytes kept (a full comparison: no sampling)."""
    for t, k in zip(sources(w), kept, strict=True):
        b = _bytes(t)
        if b.device.type == "cpu":
            # numpy's comparison of two byte arrays runs at memory speed on one thread; torch.equal
            # starts the intra-op pool (docs/selection.md, "Weights changed in place").
            if not _np_equal(b.numpy(), k.numpy()):
                return False
        elif not torch.equal(b, k):
            return False
    return True


def _np_equal(a, b) -> bool:
    """Byte arrays compared as the widest integers their length allows (int64: an eighth of the work)."""
    import numpy

    width = next((w for w in (numpy.int64, numpy.int32, numpy.int16) if a.size % numpy.dtype(w).itemsize == 0),
                 numpy.uint8)
    return a.shape == b.shape and bool(numpy.array_equal(a.view(width), b.view(width)))


class MemorySample:
    """A fixed, deterministic sample of tensors' current memory and the values it held when taken.

    Of a 2-D weight ``[N, K]``: one element in each of ``min(N, SAMPLE_ROWS)`` evenly spaced rows
    (the first included), the column advancing by one from row to row (a diagonal walk, wrapping
    every ``min(N, K, SAMPLE_ROWS)`` rows), plus the last element; of every other tensor given
    (scales), all of it. On the CPU the sample is a numpy view that *aliases* the tensor's storage
    (read by ``tobytes``: no torch dispatch, no intra-op pool), so ``same()`` sees writes torch does
    not count (``.data``, numpy views, inference tensors). A write that changes only elements off
    the sample is not seen: docs/selection.md, "Weights changed in place".

    Parameters
    ----------
    weight : torch.Tensor
        ``[N, K]``, sampled.
    whole : tuple of torch.Tensor
        Read in full (a Quantized weight's scales: small).
    """

    __slots__ = ("views", "kept", "cpu")

    def __init__(self, weight: torch.Tensor, whole: tuple[torch.Tensor, ...] = ()):
        ts = [_int_view(t) for t in (weight, *whole)]
        self.cpu = all(t.device.type == "cpu" for t in ts)
        views = _sample_views(ts[0]) + [t for t in ts[1:] if t.numel()]
        if self.cpu:
            self.views = [v.numpy() for v in views]
            self.kept = [v.tobytes() for v in self.views]
        else:  # no numpy view of device memory: torch views, compared on the device
            self.views = views
            self.kept = [v.clone() for v in views]

    def byte_ranges(self) -> tuple[list[int], list[int], bytes] | None:
        """The sample as byte ranges for a compiled check (``Backend.bind_watched_linear``):
        ``(addresses, lengths, expected)``, one range per contiguous view and one per element of
        any other, ``expected`` the bytes they held when the sample was taken, in order; None for a
        sample of device memory. The addresses lie in the sampled tensors' storage, which the
        views keep alive as long as this sample lives."""
        if not self.cpu:
            return None
        import numpy

        addrs: list[int] = []
        lens: list[int] = []
        for v in self.views:
            base = v.__array_interface__["data"][0]
            if v.flags.c_contiguous:
                addrs.append(base)
                lens.append(v.nbytes)
                continue
            offs = numpy.zeros((), dtype=numpy.int64)
            for n, st in zip(v.shape, v.strides, strict=True):  # C order: tobytes' order
                offs = offs[..., None] + numpy.arange(n, dtype=numpy.int64) * st
            addrs.extend((base + offs.reshape(-1)).tolist())
            lens.extend([v.itemsize] * v.size)
        return addrs, lens, b"".join(self.kept)

    def same(self) -> bool:
        """Whether the sampled memory still holds the values it held when the sample was taken."""
        if self.cpu:
            for v, k in zip(self.views, self.kept, strict=True):
                if v.tobytes() != k:
                    return False
            return True
        return all(torch.equal(v, k) for v, k in zip(self.views, self.kept, strict=True))


#: Integer dtypes by element size: the sample compares bits (bf16 and FP8 have no numpy dtype, and
#: a float comparison would call NaN unequal to itself and -0 equal to +0).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


def _sample_views(t: torch.Tensor) -> list[torch.Tensor]:
    """The sampled elements of a 2-D ``t`` as views of its storage (any strides): rows ``r * q``
    for ``r < R`` (``q = ceil((N - 1) / (SAMPLE_ROWS - 1))`` beyond ``SAMPLE_ROWS`` rows), row
    ``r * q`` at column ``r % C``, as a ``[B, C]`` walk and a tail of the ``R - B * C`` rows
    left, and the last element."""
    N, K = t.shape
    if N == 0 or K == 0:
        return []
    q = 1 if N <= SAMPLE_ROWS else -(-(N - 1) // (SAMPLE_ROWS - 1))  # rows q apart span the weight
    R = min(SAMPLE_ROWS, (N - 1) // q + 1)
    C = min(R, K)
    B, rem = divmod(R, C)
    s0, s1 = t.stride()
    off = t.storage_offset()
    views = [t.as_strided((B, C), (C * q * s0, q * s0 + s1), off)]
    if rem:
        views.append(t.as_strided((rem,), (q * s0 + s1,), off + B * C * q * s0))
    return views + [t[-1:, -1]]


@dataclass(frozen=True, slots=True)
class Watch:
    """What a plan holds for, handed to ``Backend.bind_watched_linear`` so that the backend's bound
    call checks it itself: x's dtype and rows (the plan's M bucket), the weight's tensors (codes,
    scales) as the layer holds them with their versions (their storage pointers, sizes and strides
    are read at binding), and under ``weight_check="sample"`` the sample's byte ranges
    (``MemorySample.byte_ranges``)."""

    x_dtype: torch.dtype
    m_lo: int
    m_hi: int
    tensors: tuple
    versions: tuple
    sampled: bool  #: whether the plan's weight check holds a ``MemorySample``
    byte_ranges: tuple | None  #: ``MemorySample.byte_ranges()``: None without a sample or for device memory

    @classmethod
    def of(cls, tensors: tuple, sample: MemorySample | None, x_dtype: torch.dtype, m_lo: int, m_hi: int) -> Watch:
        """The watch of ``tensors`` as they are now."""
        return cls(x_dtype, m_lo, m_hi, tuple(tensors), tuple(tensor_version(t) for t in tensors),
                   sample is not None, None if sample is None else sample.byte_ranges())


def range_tensors(ranges: tuple[list[int], list[int], bytes] | None) -> tuple[torch.Tensor, ...]:
    """``MemorySample.byte_ranges()`` (None: no sample) as the extension's checks take them:
    addresses and lengths as int64 tensors, the expected bytes as a uint8 tensor."""
    addrs, lens, expected = ranges if ranges is not None else ([], [], b"")
    return (torch.tensor(addrs, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64),
            torch.frombuffer(bytearray(expected), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8))


def weight_check_mode(weight_check: str | None) -> str:
    """``weight_check``, or ``FP8REF_WEIGHT_CHECK``'s value when None, else ``"sample"``, checked."""
    if weight_check is None:
        weight_check = _env.get(ENV_WEIGHT_CHECK)
        origin = ENV_WEIGHT_CHECK
    else:
        origin = "weight_check"
    if weight_check not in WEIGHT_CHECKS:
        raise ValueError(f"{origin} must be one of {WEIGHT_CHECKS}, got {weight_check!r}")
    return weight_check
