"""What a decision is keyed on: the M bucket, the hardware, the versions and the candidates' declarations.

The key holds everything that changes the answer: device name and thread count, torch / triton /
fp8ref versions, the probe's list of contracts (``PROBE_REVISION``), the candidate backends and
their declarations (availability included), x and
output dtypes, bias or not, ``recipe.short_str()``, N, K, the M bucket and the required precision
class.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import metadata

import torch

from .._machine import cpu_model
from .._version import __version__
from ..check.probe import PROBE_REVISION
from ..registry import Backend, Case
from ..spec.bounds import PrecisionClass

__all__ = ["m_bucket", "bucket_lo", "device_name", "available_reason", "fp8ref_version", "selection_key", "declaration"]


def m_bucket(M: int) -> int:
    """The power-of-two bucket holding M rows: the smallest 2**j >= M (1 for M <= 1).

    Examples
    --------
    >>> [m_bucket(m) for m in (0, 1, 2, 3, 16, 17, 1024)]
    [1, 1, 2, 4, 16, 32, 1024]
    """
    if M < 0:
        raise ValueError(f"M must be >= 0, got {M}")
    return 1 << (M - 1).bit_length() if M > 1 else 1


def bucket_lo(b: int) -> int:
    """The smallest M in bucket ``b``."""
    return b // 2 + 1 if b > 1 else 1


def device_name(device: str | torch.device) -> str:
    """What identifies the hardware for timing: CPU model and thread count, or GPU name and SM."""
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return f"cuda:{torch.cuda.get_device_name(idx)}:sm{major}{minor}"
    if dev.type == "cpu":
        return f"cpu:{cpu_model()}:{torch.get_num_threads()}t"
    return str(dev)


@cache
def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def fp8ref_version() -> str:
    """fp8ref's version (a decision made by another version is not reused)."""
    return __version__


def available_reason(backend: Backend) -> str | None:
    """``backend.available()``, with an exception turned into the reason."""
    try:
        return backend.available()
    except Exception as exc:
        return f"available() raised {exc!r}"


def declaration(b: Backend) -> str:
    """What identifies backend ``b``'s code and claims: module, class, accumulation, output
    roundings, version and availability (part of the key, and of the seal on its compliance)."""
    acc = b.accumulation
    # Availability is part of it: e.g. setting TRITON_INTERPRET makes a new candidate appear.
    return (f"{b.name}={type(b).__module__}.{type(b).__qualname__}/{acc.name}:{acc.unit_roundoff!r}:"
            f"{acc.promote_every}/r{b.output_roundings}/{b.version or ''}/"
            f"{'ok' if available_reason(b) is None else 'no'}")


def selection_key(case: Case, precision: str, candidates: list[Backend]) -> str:
    """The cache key of a selection (a readable string; the candidate set is hashed)."""
    cands = hashlib.sha1("|".join(sorted(declaration(b) for b in candidates)).encode()).hexdigest()[:12]
    return "|".join([
        device_name(case.device),
        f"torch={torch.__version__}",
        f"triton={_dist_version('triton')}",
        f"fp8ref={fp8ref_version()}",
        f"probe={PROBE_REVISION}",
        f"x={str(case.x_dtype)[6:]}",
        f"out={str(case.out_dtype)[6:]}",
        "bias" if case.has_bias else "nobias",
        case.recipe.short_str(),
        f"N={case.N}",
        f"K={case.K}",
        f"Mb={m_bucket(case.M)}",
        f"precision={PrecisionClass(precision).value}",
        f"cands={cands}",
    ])
