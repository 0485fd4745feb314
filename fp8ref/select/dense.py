"""The dense fallback's decision: whether a layer's call at an M bucket runs its original weight in
its own dtype (``F.linear``) instead of FP8, where FP8 measured slower.

On a CPU without FP8 arithmetic an FP8 layer decodes its codes and computes a GEMM as large as the
dense one, plus the activations' quantization: once M is large enough for the GEMM to be
compute-bound, FP8 cannot win, while at small M (decode) it wins by reading half the bytes. A
layer built with ``dense_fallback="auto"`` (``fp8ref.Fp8Linear.from_linear``,
``fp8ref.quantize_model``) keeps its original weight and asks ``decide`` once per M bucket: the
layer's own FP8 call and ``F.linear`` on the kept weight are timed in interleaved rounds at
min(bucket, ``timing.TIME_M_CAP``) rows, and the bucket runs dense when FP8's speed is under
``DENSE_BELOW`` of dense's both by the median of the rounds' ratios and by the ratio of the fastest
samples (load from other processes only adds time, so a loss that the fastest samples do not show
is the load's, and the layer stays FP8, as asked).

Lookup order: memory (``_DECIDED``, keyed by ``dense_key``, so a model of thirty identical layers
times each shape once), then the timing. Decisions are kept in memory only: a timing on a loaded
machine could otherwise outlive its load on disk. ``fp8ref.select.clear_cache`` forgets them.
This module imports ``keys`` and ``timing``; ``cache`` imports it (to forget), and ``fp8ref.nn``
uses it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .keys import device_name, fp8ref_version, m_bucket
from .timing import TIME_M_CAP, clock, sync

__all__ = ["DENSE_BELOW", "DENSE_MODES", "MIN_SAMPLE_S", "MIN_ROUNDS", "MAX_ROUNDS", "BUDGET_S", "DenseChoice",
           "check_dense_fallback", "dense_key", "decide", "forced", "forget", "timed_rows"]

#: The values ``dense_fallback=`` takes: None (off, the default) or "auto".
DENSE_MODES = (None, "auto")
#: A bucket runs dense when FP8's speed over dense's (the median of the rounds' ratios) is below
#: this: a tie stays FP8 (what the user asked for), and so does a loss within the rounds' noise.
DENSE_BELOW = 0.95
#: Shortest sample: a call shorter than this is repeated within a sample (a decode-sized call
#: lasts microseconds, of the order of the clock's own jitter).
MIN_SAMPLE_S = 2e-3
#: Interleaved rounds: at least MIN_ROUNDS, at most MAX_ROUNDS, within BUDGET_S seconds. More than
#: the selector's run-off takes: the decision lasts the process, and a wrong one costs every call
#: of its bucket.
MIN_ROUNDS = 5
MAX_ROUNDS = 11
BUDGET_S = 0.5

_DECIDED: dict[str, DenseChoice] = {}


@dataclass(frozen=True)
class DenseChoice:
    """Whether one case (a layer shape, x's dtype, an M bucket) runs dense, and the timing behind it.

    Attributes
    ----------
    bucket : int
        The M bucket (``fp8ref.select.m_bucket``).
    dense : bool
        The bucket's calls run ``F.linear`` on the original weight.
    ratio : float or None
        FP8's speed over dense's (dense seconds / FP8 seconds; below 1: FP8 slower), the median of
        the rounds' ratios; None when forced.
    ratio_min : float or None
        The same from the fastest sample of each.
    fp8_s, dense_s : float or None
        Median seconds per call of each, at ``rows`` rows.
    rows : int
        Rows the timing used (min(bucket, ``TIME_M_CAP``)).
    rounds : int
        Interleaved rounds timed.
    source : str
        ``"timed"``, ``"memory"`` (another layer of the same shape was timed) or ``"forced"``.
    """

    bucket: int
    dense: bool
    ratio: float | None = None
    ratio_min: float | None = None
    fp8_s: float | None = None
    dense_s: float | None = None
    rows: int = 0
    rounds: int = 0
    source: str = "timed"

    def as_dict(self) -> dict:
        return asdict(self)

    def short_str(self) -> str:
        """The bucket, the choice and why: the ratio (FP8's speed over dense's) or ``forced``.

        Examples
        --------
        >>> from fp8ref.select.dense import DenseChoice
        >>> DenseChoice(bucket=128, dense=True, ratio=0.5).short_str()
        'M<=128: dense (fp8/dense speed 0.50)'
        """
        how = "dense" if self.dense else "fp8"
        why = "forced" if self.ratio is None else f"fp8/dense speed {self.ratio:.2f}"
        return f"M<={self.bucket}: {how} ({why})"


def check_dense_fallback(value) -> str | None:
    """``value`` if it is one of ``DENSE_MODES``, else ``ValueError`` naming ``dense_fallback``."""
    if value is not None and not (isinstance(value, str) and value in DENSE_MODES):
        raise ValueError(f"dense_fallback must be one of {list(DENSE_MODES)}, got {value!r}")
    return value


def timed_rows(M: int) -> int:
    """The rows a bucket is timed at: min(bucket, ``TIME_M_CAP``), as the selector times backends."""
    return min(m_bucket(M), TIME_M_CAP)


def dense_key(*, N: int, K: int, M: int, x_dtype: torch.dtype, device: torch.device | str, has_bias: bool,
              fp8: str) -> str:
    """The memory key of a decision: the hardware and thread count (``device_name``), torch and
    fp8ref versions, x's dtype (the kept weight's), bias or not, N, K, the M bucket, and ``fp8``:
    what decides the FP8 side (recipe, backend setting, precision, candidates, out dtype)."""
    return "|".join([device_name(device), f"torch={torch.__version__}", f"fp8ref={fp8ref_version()}",
                     f"x={str(x_dtype)[6:]}", "bias" if has_bias else "nobias", f"N={N}", f"K={K}",
                     f"Mb={m_bucket(M)}", fp8])


def forced(M: int, dense: bool) -> DenseChoice:
    """A decision given rather than measured (tests; a user who knows the answer)."""
    if not isinstance(dense, bool):
        raise TypeError(f"dense must be a bool, got {type(dense).__name__}")
    return DenseChoice(bucket=m_bucket(M), dense=dense, rows=timed_rows(M), source="forced")


def _per_call(fn: Callable[[], object], inner: int, device) -> float:
    sync(device)
    t0 = clock()
    for _ in range(inner):
        fn()
    sync(device)
    return (clock() - t0) / inner


def decide(key: str, M: int, fp8: Callable[[], object], dense: Callable[[], object],
           device: torch.device | str = "cpu") -> DenseChoice:
    """The decision kept under ``key``, or a new one: ``fp8`` and ``dense`` (each one call at
    ``timed_rows(M)`` rows) warmed up once, then timed in ``MIN_ROUNDS`` to ``MAX_ROUNDS``
    interleaved rounds within ``BUDGET_S`` (who goes first alternates, so a burst of load hits both
    alike); each sample repeats a call up to ``MIN_SAMPLE_S``. Dense when both the median of the
    rounds' ratios and the fastest samples' ratio are below ``DENSE_BELOW``."""
    got = _DECIDED.get(key)
    if got is not None:
        return DenseChoice(**{**got.as_dict(), "source": "memory"})
    fp8()  # warm-up: the FP8 side's first call of a case selects its backend and prepares the weight
    dense()
    t_f, t_d = _per_call(fp8, 1, device), _per_call(dense, 1, device)
    inner_f = max(1, min(1000, math.ceil(MIN_SAMPLE_S / max(t_f, 1e-9))))
    inner_d = max(1, min(1000, math.ceil(MIN_SAMPLE_S / max(t_d, 1e-9))))
    per_round = inner_f * t_f + inner_d * t_d
    rounds = int(max(MIN_ROUNDS, min(MAX_ROUNDS, BUDGET_S / max(per_round, 1e-9))))
    tf: list[float] = []
    td: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            tf.append(_per_call(fp8, inner_f, device))
            td.append(_per_call(dense, inner_d, device))
        else:
            td.append(_per_call(dense, inner_d, device))
            tf.append(_per_call(fp8, inner_f, device))
    ratio = statistics.median(d / max(f, 1e-12) for d, f in zip(td, tf, strict=True))
    ratio_min = min(td) / max(min(tf), 1e-12)
    choice = DenseChoice(bucket=m_bucket(M), dense=max(ratio, ratio_min) < DENSE_BELOW, ratio=ratio,
                         ratio_min=ratio_min, fp8_s=statistics.median(tf),
                         dense_s=statistics.median(td), rows=timed_rows(M), rounds=rounds, source="timed")
    _DECIDED[key] = choice
    return choice


def forget() -> None:
    """Drop every kept decision (``fp8ref.select.clear_cache`` calls it); layers keep theirs."""
    _DECIDED.clear()
