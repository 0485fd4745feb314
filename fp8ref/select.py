"""The compliance-gated backend selector behind ``fp8ref.linear(..., backend="auto")``.

For one *case* (device, dtypes, recipe, N, K and a power-of-two bucket of M) the selector
takes the registered backends that are available, support the case and belong to a precision
class the caller admits; runs each through a **compliance probe** against the spec's bounds at
this shape; times the compliant ones (median of several runs after a warm-up); and picks the
fastest. A backend that fails the probe is never chosen, however fast.

Lookup order (docs/selection.md): in-memory dict -> on-disk JSON cache -> probe and time.
The key holds everything that changes the answer: device name and thread count, torch /
triton / fp8ref versions, the candidate backends and their declarations, x and output dtypes,
bias or not, ``recipe.short_str()``, N, K, the M bucket and the required precision class.

Environment variables
---------------------
FP8REF_BACKEND
    Force this backend wherever ``backend="auto"`` (it must be able to run: otherwise the call
    raises; it never falls back silently).
FP8REF_CANDIDATES
    Comma-separated backend names: restrict "auto" to these (the reference is always added, as
    the fallback that is always able).
FP8REF_CACHE_DIR
    Directory of the on-disk cache (default ``~/.cache/fp8ref``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ._io import atomic_write
from ._machine import cpu_model
from .registry import _REGISTRY, Backend, Case, _ensure_loaded, decline_reason, get_backend
from .spec import bounds
from .spec.bounds import PrecisionClass
from .spec.gemm import scaled_mm
from .spec.quant import Quantized, dequantize, quantize
from .spec.schemes import Granularity, QuantScheme

__all__ = [
    "DEFAULT_PRECISION",
    "ENV_BACKEND",
    "ENV_CANDIDATES",
    "ENV_CACHE_DIR",
    "CACHE_SCHEMA",
    "Decision",
    "ProbeResult",
    "Row",
    "NoCompliantBackendError",
    "BackendUnavailableError",
    "m_bucket",
    "device_name",
    "selection_key",
    "select",
    "resolve",
    "probe",
    "cache_file",
    "clear_cache",
]

#: Default required precision class. The FP8 quantization error of a W8A8 linear is ~4e-2
#: relative (e4m3: u = 2**-4 per operand); a second bf16 rounding adds at most 2**-8 ~ 3.9e-3 and
#: ~7e-4 typically, so "standard" (fp32 accumulation, up to two roundings) loses nothing a user
#: of FP8 could notice, while admitting the fast CPU bf16 path. See docs/selection.md.
DEFAULT_PRECISION = "standard"
ENV_BACKEND = "FP8REF_BACKEND"
ENV_CANDIDATES = "FP8REF_CANDIDATES"
ENV_CACHE_DIR = "FP8REF_CACHE_DIR"
#: Version of the on-disk layout; a file with another schema is ignored (with a warning) and rebuilt.
CACHE_SCHEMA = 1
_CACHE_NAME = f"select-v{CACHE_SCHEMA}.json"

#: Probe: 16 rows (random + adversarial), fed to the backend in chunks of min(bucket, 16) rows.
PROBE_ROWS = 16
#: Probe columns: N itself up to this, else PROBE_N_TILE + N % PROBE_N_TILE (keeps N's residue
#: modulo every power-of-two tile width up to 256, so tail tiles are exercised) -- the float64
#: reference and bound at the full N of an LLM layer cost seconds.
PROBE_FULL_N_MAX = 512
PROBE_N_TILE = 256
#: Timing uses min(bucket, TIME_M_CAP) rows and the full N, K.
TIME_M_CAP = 128
#: Per-candidate timing budget in seconds (after the warm-up); at least one timed run.
TIME_BUDGET_S = 0.15
TIME_MAX_RUNS = 7
#: A candidate whose estimated time (from the probe's calls) exceeds this many times the best
#: measured median is not timed: it cannot win.
SKIP_FACTOR = 10.0
#: Contenders whose sequential median is within this factor of the best are re-timed together in
#: interleaved rounds (``_runoff``), at least RUNOFF_MIN_ROUNDS, within RUNOFF_BUDGET_S.
RUNOFF_FACTOR = 2.5
RUNOFF_MIN_ROUNDS = 3
RUNOFF_BUDGET_S = 0.4


class NoCompliantBackendError(RuntimeError):
    """No backend meets the required precision class and the probe (cannot happen while the
    reference is registered, since it is exact)."""


class BackendUnavailableError(RuntimeError):
    """An explicitly named (or FP8REF_BACKEND-forced) backend cannot run this case."""


# --------------------------------------------------------------------------------------------
# Keys


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


def _bucket_lo(b: int) -> int:
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


def _fp8ref_version() -> str:
    from . import __version__

    return __version__


def _declaration(b: Backend) -> str:
    acc = b.accumulation
    # Availability is part of it: e.g. setting TRITON_INTERPRET makes a new candidate appear.
    return (f"{b.name}={type(b).__module__}.{type(b).__qualname__}/{acc.name}:{acc.unit_roundoff!r}:"
            f"{acc.promote_every}/r{b.output_roundings}/{getattr(b, 'version', '')}/"
            f"{'ok' if _available(b) is None else 'no'}")


def selection_key(case: Case, precision: str, candidates: list[Backend]) -> str:
    """The cache key of a selection (a readable string; the candidate set is hashed)."""
    cands = hashlib.sha1("|".join(sorted(_declaration(b) for b in candidates)).encode()).hexdigest()[:12]
    return "|".join([
        device_name(case.device),
        f"torch={torch.__version__}",
        f"triton={_dist_version('triton')}",
        f"fp8ref={_fp8ref_version()}",
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


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    """One line of the table behind a decision."""

    backend: str
    precision: str
    available: str | None = None  #: None, or why the backend cannot run here
    supported: str | None = None  #: None, or why it does not take this case
    admitted: bool = False  #: its precision class meets the requirement
    compliant: bool | None = None  #: None when not probed
    worst_ratio: float | None = None  #: max over the probe of error / bound (<= 1 to comply)
    ratios: dict[str, float] = field(default_factory=dict)  #: worst ratio per check
    detail: str = ""  #: where the worst ratio came from, or the probe's failure
    estimate_s: float | None = None  #: full-shape time extrapolated from the probe's calls
    median_s: float | None = None
    runs: int = 0
    note: str = ""
    chosen: bool = False

    @property
    def status(self) -> str:
        if self.available is not None:
            return f"unavailable: {self.available}"
        if self.supported is not None:
            return f"unsupported: {self.supported}"
        if not self.admitted:
            return "outside required class"
        if self.compliant is None:
            return "not probed"
        return "compliant" if self.compliant else "NON-COMPLIANT"


@dataclass
class Decision:
    """What the selector chose for a key, with the table behind it."""

    key: str
    case: str
    precision: str
    chosen: str
    ranking: list[str]  #: compliant backends, fastest first (the fallback order)
    rows: list[Row] = field(default_factory=list)
    source: str = "probe"  #: "memory", "disk", "probe" or "forced"
    seconds: float = 0.0  #: time the probe-and-time step took

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    @classmethod
    def from_json(cls, key: str, d: dict[str, Any]) -> Decision:
        names = {f.name for f in fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in d["rows"]]
        return cls(key=key, case=str(d["case"]), precision=str(d["precision"]), chosen=str(d["chosen"]),
                   ranking=[str(n) for n in d["ranking"]], rows=rows, source="disk",
                   seconds=float(d.get("seconds", 0.0)))

    def table(self) -> str:
        """The decision as a fixed-width text table."""
        head = (f"{'backend':16} {'class':9} {'status':32} {'err/bound q/mm':>20} {'median':>11} "
                f"{'chosen':>6}")
        lines = [f"case {self.case}  precision>={self.precision}  (source: {self.source}, "
                 f"selection took {self.seconds:.2f} s)", head, "-" * len(head)]
        for r in self.rows:
            ratio = "/".join(f"{r.ratios.get(k, math.nan):.2g}" for k in ("quantize", "scaled_mm")) \
                if r.ratios else ("" if r.worst_ratio is None else f"{r.worst_ratio:.3g}")
            med = f"{r.median_s * 1e3:.3f} ms" if r.median_s is not None else ("-" if r.compliant else "")
            lines.append(f"{r.backend:16} {r.precision:9} {r.status[:32]:32} {ratio:>20} {med:>11} "
                         f"{'  <==' if r.chosen else '':>6}")
        notes = [f"  {r.backend}: {r.note or r.detail}" for r in self.rows if (r.note or r.detail)
                 and (r.compliant is False or r.note)]
        if notes:
            lines.append("notes:")
            lines.extend(notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass
class ProbeResult:
    """Outcome of the compliance probe of one backend at one case."""

    compliant: bool
    worst_ratio: float
    detail: str
    call_seconds: float  #: time of one warm ``Backend.linear`` call at the probe's shape
    call_elements: int  #: M * N of one such call
    ratios: dict[str, float] = field(default_factory=dict)  #: worst error/bound per check


# --------------------------------------------------------------------------------------------
# The compliance probe


def _tie_values(scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """Midpoints between adjacent positive grid values of the format below qmax that are exact in
    ``dtype``: with a block scale of exactly 1 they land on rounding ties."""
    grid = scheme.format.finite_values()
    grid = grid[(grid >= 0) & (grid <= scheme.qmax)]
    mids = (grid[1:] + grid[:-1]) / 2
    exact = mids.to(dtype).to(torch.float64) == mids
    return mids[exact]


def _adversarial(rows: int, cols: int, scheme: QuantScheme, dtype: torch.dtype, gen: torch.Generator,
                 outlier: float) -> torch.Tensor:
    """Random rows plus: outlier channels, an all-zero row, a row of rounding ties (block scale
    exactly 1), a huge-dynamic-range row, a constant row, a single non-zero, +-qmax."""
    qmax = scheme.qmax
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    _, c = scheme.block_shape(rows, cols)
    special = []
    n_out = max(1, min(4, cols // 16))
    cols_out = torch.randperm(cols, generator=gen)[:n_out]
    special.append(lambda row: row.index_fill_(0, cols_out, min(outlier, qmax / 2)))
    special.append(lambda row: row.zero_())

    def ties(row):
        t = _tie_values(scheme, dtype)
        idx = torch.randint(0, len(t), (cols,), generator=gen)
        sign = torch.where(torch.rand(cols, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        row.copy_(t[idx] * sign)
        step = c if scheme.granularity in (Granularity.GROUP, Granularity.BLOCK) else cols
        row[::step] = qmax  # one element at qmax per scale block along K: that block's scale is 1
        return row

    special.append(ties)
    special.append(lambda row: row.mul_(torch.exp2(torch.empty(cols, dtype=torch.float64).uniform_(
        -20, 6, generator=gen))))
    special.append(lambda row: row.fill_(0.3))
    special.append(lambda row: row.zero_().index_fill_(0, cols_out[:1], 1.5))
    special.append(lambda row: row.copy_(torch.where(torch.arange(cols) % 2 == 0, qmax, -qmax)))
    for i, f in enumerate(special[:rows]):
        f(x[i])
    # Every value stays within +-qmax, so the +-qmax row (and the tie row's qmax entries) make a
    # whole-tensor or block scale exactly 1 too.
    return x.clamp(-qmax, qmax).to(dtype)


def _probe_shapes(case: Case) -> tuple[int, int]:
    mp = min(m_bucket(case.M), PROBE_ROWS)
    n_probe = case.N if case.N <= PROBE_FULL_N_MAX else PROBE_N_TILE + case.N % PROBE_N_TILE
    return mp, n_probe


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _check_quantized(q: Any, x: torch.Tensor, scheme: QuantScheme) -> tuple[float, str]:
    """Worst ratio of the backend's activation quantization against the spec (inf on a
    structural violation), and where."""
    if not isinstance(q, Quantized):
        return math.inf, f"quantize returned {type(q).__name__}, not Quantized"
    if q.scheme != scheme:
        return math.inf, f"quantize returned scheme {q.scheme.short_str()}, asked {scheme.short_str()}"
    if tuple(q.data.shape) != tuple(x.shape):
        return math.inf, f"quantize returned data {tuple(q.data.shape)} for x {tuple(x.shape)}"
    ref = quantize(x, scheme)
    s_b, s_r = q.scale.to(torch.float64).cpu(), ref.scale.to(torch.float64).cpu()
    if not bool(torch.isfinite(s_b).all()) or not bool((s_b > 0).all()):
        return math.inf, "quantize returned a non-finite or non-positive scale"
    # A scale computed as amax * (1/qmax) instead of amax / qmax makes two fp32 roundings instead of
    # one; a narrower scale dtype then rounds once more, possibly to the neighbouring value.
    u_sd = 0.0 if scheme.scale_dtype == torch.float32 else bounds.unit_roundoff(scheme.scale_dtype)
    s_bound = (2 * bounds.U_FP32 + 2 * u_sd) * s_r
    s_ratio = float(((s_b - s_r).abs() / s_bound).max()) if s_b.numel() else 0.0
    qb = bounds.quantization_error_bound(x.cpu(), Quantized(q.data.cpu(), q.scale.cpu(), q.scheme))
    err = (dequantize(Quantized(q.data.cpu(), q.scale.cpu(), q.scheme), torch.float64)
           - x.cpu().to(torch.float64)).abs()
    ratio = torch.nan_to_num(err / qb, nan=math.inf)
    q_ratio = float(ratio.max()) if ratio.numel() else 0.0
    if s_ratio >= q_ratio:
        return s_ratio, f"quantize scale vs reference: ratio {s_ratio:.3g}"
    idx = tuple(int(i) for i in (ratio == ratio.max()).nonzero()[0])
    return q_ratio, (f"quantize codes at {idx}: x={float(x[idx]):.6g}, |deq - x| = {float(err[idx]):.3g}, "
                     f"bound {float(qb[idx]):.3g}, ratio {q_ratio:.3g}")


def _ratio(y: Any, y_ref: torch.Tensor, bound: torch.Tensor, out_dtype: torch.dtype, what: str) -> tuple[float, str]:
    if not isinstance(y, torch.Tensor):
        return math.inf, f"{what}: returned {type(y).__name__}"
    if tuple(y.shape) != tuple(y_ref.shape):
        return math.inf, f"{what}: output shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}"
    if y.dtype != out_dtype:
        return math.inf, f"{what}: output dtype {y.dtype}, expected {out_dtype}"
    err = (y.detach().cpu().to(torch.float64) - y_ref).abs()
    ratio = torch.nan_to_num(err / bound, nan=math.inf)
    if ratio.numel() == 0:
        return 0.0, ""
    worst = float(ratio.max())
    idx = tuple(int(i) for i in (ratio == ratio.max()).nonzero()[0])
    return worst, (f"{what} at {idx}: got {float(y[idx]):.6g}, "
                   f"reference {float(y_ref[idx]):.6g}, bound {float(bound[idx]):.3g}, ratio {worst:.3g}")


class _ProbeSet:
    """The probe's inputs and the reference's side of every check, built once per case and shared
    by all the candidates (the bounds cost far more than a backend call)."""

    def __init__(self, case: Case, seed: int = 0):
        self.case = case
        self.mp, self.n_probe = _probe_shapes(case)
        recipe, K = case.recipe, case.K
        gen = torch.Generator().manual_seed(seed)
        self.x = _adversarial(PROBE_ROWS, K, recipe.activation, case.x_dtype, gen, outlier=300.0)
        w = _adversarial(self.n_probe, K, recipe.weight, torch.float32, gen, outlier=30.0).to(torch.float64)
        w[PROBE_ROWS // 2:] /= math.sqrt(K)
        # Keep every output finite in out_dtype (fp16 tops out at 65504): scale the weight by a
        # power of two, which keeps its rounding ties ties (quantization is 2**k-equivariant).
        peak = float((self.x.to(torch.float64).abs() @ w.abs().T).max()) + 4.0
        limit = float(torch.finfo(case.out_dtype).max) / 16
        if peak > limit:
            w = w * 2.0 ** -math.ceil(math.log2(peak / limit))
        self.w = w.to(case.x_dtype)
        self.bias = torch.randn(self.n_probe, generator=gen).to(case.x_dtype) if case.has_bias else None
        self.qw = quantize(self.w, recipe.weight)
        self.chunks = [(r0, min(r0 + self.mp, PROBE_ROWS)) for r0 in range(0, PROBE_ROWS, self.mp)]
        act = recipe.activation
        # Row-independent activation scales: the 16 rows quantized together equal the chunks
        # quantized apart, so the reference side is computed once on all rows.
        self.row_independent = act.granularity in (Granularity.ROW, Granularity.GROUP) or (
            act.granularity is Granularity.BLOCK and act.block[0] == 1)
        self.qa_ref = [quantize(self.x[a:b], act) for a, b in self.chunks]
        self._bounds: dict[tuple, torch.Tensor] = {}
        self._y_ref: dict[int, torch.Tensor] = {}

    def reference_side(self, i: int | None, qa: Quantized, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_ref float64, gemm bound) for activations ``qa``; memoised when ``qa`` is the reference's."""
        key = (i, backend.accumulation, backend.output_roundings)
        if i is not None and key in self._bounds:
            return self._y_ref[i], self._bounds[key]
        y_ref = self._y_ref.get(i) if i is not None else None
        if y_ref is None:
            y_ref = scaled_mm(qa, self.qw, self.bias, out_dtype=torch.float64)
        gb = bounds.gemm_error_bound(qa, self.qw, self.bias, out_dtype=self.case.out_dtype,
                                     accumulation=backend.accumulation, output_roundings=backend.output_roundings,
                                     y_ref=y_ref)
        if i is not None:
            self._y_ref[i], self._bounds[key] = y_ref, gb
        return y_ref, gb


def _same_output(y_lin: Any, y: Any, rows: tuple[int, int]) -> tuple[float, str]:
    """``Backend.linear`` must return what ``scaled_mm(quantize(x))`` returns, bit for bit."""
    if not isinstance(y_lin, torch.Tensor) or not isinstance(y, torch.Tensor):
        return 0.0, ""  # a non-tensor y is reported by the scaled_mm check
    if y_lin.shape == y.shape and y_lin.dtype == y.dtype and torch.equal(
            y_lin.detach().cpu().contiguous().view(torch.uint8), y.detach().cpu().contiguous().view(torch.uint8)):
        return 0.0, ""
    return math.inf, (f"linear() differs from scaled_mm(quantize()) on rows {rows}: shape {tuple(y_lin.shape)} "
                      f"{y_lin.dtype} vs {tuple(y.shape)} {y.dtype}")


def _cat(qs: list[Quantized]) -> Quantized:
    return Quantized(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]), qs[0].scheme)


def _same(a: Quantized, b: Quantized) -> bool:
    return a.scheme == b.scheme and torch.equal(a.scale, b.scale) and torch.equal(
        a.data.view(torch.uint8), b.data.view(torch.uint8))


def probe(backend: Backend, case: Case, *, seed: int = 0, _set: _ProbeSet | None = None) -> ProbeResult:
    """Check ``backend`` against the spec's bounds at ``case``'s shape, on random plus adversarial
    inputs, and time its calls.

    Checks 1 and 2 are elementwise against a bound of ``fp8ref.spec.bounds``, whose sum is the
    end-to-end contract (``linear_error_bound`` is built from exactly these two terms):

    1. ``backend.quantize`` of the activations: scales equal the reference's up to the fp32
       roundings of ``amax * (1/qmax)``, and ``|deq(q) - x| <= quantization_error_bound(x, q)``;
    2. ``backend.scaled_mm`` of *its own* quantized activations and the (prepared) reference-
       quantized weight, against the reference's scaled_mm of the same operands, within
       ``gemm_error_bound`` for the backend's declared accumulation and output roundings;
    3. ``backend.linear`` (the fused hook ``fp8ref.linear`` runs) returns the same bits as the
       two calls of 1 and 2.

    Inputs: 16 activation rows (outlier channels, an all-zero row, rounding ties, huge dynamic
    range, a constant row, a single non-zero, +-qmax, random), fed in chunks of
    ``min(bucket(M), 16)`` rows so the backend runs at the bucket's own small M; a weight with
    outlier, all-zero and tie rows; a bias if the case has one. K is the case's K; N is the
    case's N up to 512, else ``256 + N % 256``.

    Returns
    -------
    ProbeResult
        ``compliant`` is True when every ratio error/bound is <= 1 and nothing raised.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.select import probe
    >>> case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    >>> probe(fp8ref.get_backend("reference"), case).compliant
    True
    """
    ps = _ProbeSet(case, seed) if _set is None else _set
    od, act, dev = case.out_dtype, case.recipe.activation, case.device
    worst = {"quantize": 0.0, "scaled_mm": 0.0}
    where = {k: "" for k in worst}
    elements = ps.mp * ps.n_probe

    def note(check: str, ratio_where: tuple[float, str]) -> None:
        if ratio_where[0] > worst[check] or not where[check]:
            worst[check], where[check] = ratio_where

    warm_t = math.inf
    try:
        prepared = backend.prepare_weight(_to(ps.qw, dev))
        bias_d = None if ps.bias is None else ps.bias.to(dev)
        qas, ys = [], []
        for a, b in ps.chunks:
            xc_d = ps.x[a:b].to(dev)
            qa = backend.quantize(xc_d, act)
            y = backend.scaled_mm(qa, prepared, bias_d, od)
            note("quantize", _check_quantized(qa, ps.x[a:b], act))
            if math.isinf(worst["quantize"]):
                break
            note("scaled_mm", _same_output(backend.linear(xc_d, prepared, bias_d, od, act), y, (a, b)))
            qas.append(Quantized(qa.data.cpu(), qa.scale.cpu(), qa.scheme))
            ys.append(y.detach().cpu() if isinstance(y, torch.Tensor) else y)
        # One more call, warm (a first call may compile or autotune): the basis of the estimate
        # that lets the timing skip backends that cannot win.
        xc_d = ps.x[ps.chunks[0][0]:ps.chunks[0][1]].to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        backend.linear(xc_d, prepared, bias_d, od, act)
        _sync(dev)
        warm_t = time.perf_counter() - t0
        if not math.isinf(worst["quantize"]):
            bad = next((y for y in ys if not isinstance(y, torch.Tensor) or y.dim() != 2), None)
            if bad is not None:
                note("scaled_mm", (math.inf, f"scaled_mm returned {type(bad).__name__} "
                                             f"{tuple(getattr(bad, 'shape', ()))}"))
            elif ps.row_independent:
                qa_all = _cat(qas)
                same = all(_same(q, r) for q, r in zip(qas, ps.qa_ref, strict=True))
                y_ref, gb = ps.reference_side(-1 if same else None, qa_all if not same else _cat(ps.qa_ref),
                                              backend)
                note("scaled_mm", _ratio(torch.cat(ys), y_ref, gb, od, "scaled_mm"))
            else:
                for i, (qa, y) in enumerate(zip(qas, ys, strict=True)):
                    same = _same(qa, ps.qa_ref[i])
                    y_ref, gb = ps.reference_side(i if same else None, qa, backend)
                    note("scaled_mm", _ratio(y, y_ref, gb, od, f"scaled_mm (rows {ps.chunks[i]})"))
    except Exception as exc:  # a backend that raises on valid input at its own declared case fails
        return ProbeResult(False, math.inf, f"raised {type(exc).__name__}: {exc}", math.inf, elements,
                           {k: math.inf for k in worst})
    top = max(worst, key=worst.get)
    return ProbeResult(worst[top] <= 1.0, worst[top], where[top], warm_t, elements, worst)


def _to(q: Quantized, device: str) -> Quantized:
    if q.data.device == torch.device(device):
        return q
    return Quantized(q.data.to(device), q.scale.to(device), q.scheme, q.n_saturated)


# --------------------------------------------------------------------------------------------
# Timing


_TIMING_WEIGHT: dict[tuple, Quantized] = {}


def _synthetic_weight(case: Case) -> Quantized:
    """A random [N, K] weight straight from codes (no quantization: cheap at any size)."""
    scheme = case.recipe.weight
    key = (case.N, case.K, scheme, case.device)
    q = _TIMING_WEIGHT.get(key)
    if q is None:
        gen = torch.Generator().manual_seed(1)
        # Magnitude codes 1..0x6F are finite and non-zero in every format (E5M2's Inf/NaN start
        # at 0x7C, E4M3FNUZ's NaN is 0x80, i.e. sign with zero magnitude); then a random sign.
        # 64 random rows tiled over N: random enough for timing, one pass to build at any size.
        rows = min(case.N, 64)
        block = torch.randint(1, 0x70, (rows, case.K), generator=gen, dtype=torch.uint8)
        block |= torch.randint(0, 2, (rows, case.K), generator=gen, dtype=torch.uint8) << 7
        codes = block.repeat(-(-case.N // rows), 1)[:case.N].contiguous()
        shape = scheme.scale_shape(case.N, case.K)
        scale = (torch.rand(shape, generator=gen) * 1e-3 + 1e-3).to(scheme.scale_dtype)
        q = Quantized(codes.view(scheme.format.torch_dtype).to(case.device), scale.to(case.device), scheme)
        _TIMING_WEIGHT.clear()  # keep one: a 14336 x 4096 weight is 59 MB
        _TIMING_WEIGHT[key] = q
    return q


def _timer(backend: Backend, case: Case) -> Callable[[], float]:
    """A function timing one ``Backend.linear`` call at min(bucket, TIME_M_CAP) rows, in seconds."""
    mt = min(m_bucket(case.M), TIME_M_CAP)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(mt, case.K, generator=gen).to(case.x_dtype).to(case.device)
    bias = torch.randn(case.N, generator=gen).to(case.x_dtype).to(case.device) if case.has_bias else None
    prepared = backend.prepare_weight(_synthetic_weight(case))
    act, od, dev = case.recipe.activation, case.out_dtype, case.device

    def once() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        backend.linear(x, prepared, bias, od, act)
        _sync(dev)
        return time.perf_counter() - t0

    return once


def _time(backend: Backend, case: Case, best: float | None,
          timers: dict[str, Callable[[], float]] | None = None) -> tuple[float, int, str]:
    """Median seconds of ``Backend.linear`` at min(bucket, TIME_M_CAP) rows, after one warm-up.
    ``timers`` keeps the prepared timer per backend name for the run-off."""
    once = _timer(backend, case)
    if timers is not None:
        timers[backend.name] = once
    once()  # warm-up: compilation, autotuning, first-touch of buffers
    times = [once()]
    if best is not None and times[0] > 3 * best:
        return times[0], 1, "one run: > 3x the best median"
    n = int(max(1, min(TIME_MAX_RUNS, TIME_BUDGET_S / max(times[0], 1e-9))))
    times += [once() for _ in range(n - 1)]
    return statistics.median(times), len(times), ""


def _runoff(rows: list[tuple[Backend, Row]], case: Case,
            timers: dict[str, Callable[[], float]] | None = None) -> None:
    """Re-time the close contenders in interleaved rounds (A, B, C, B, C, A, ...) and keep those
    medians: a burst of load from another process then hits every contender alike, instead of
    deciding the ranking by landing in one backend's timing window (a decision is cached on disk,
    so a wrong one would last)."""
    known = timers or {}
    timers = [(row, known.get(b.name) or _timer(b, case)) for b, row in rows]
    for (b, _), (_, once) in zip(rows, timers, strict=True):
        if b.name not in known:
            once()  # warm-up: a fresh timer (the sequential ones are warm, and their weights prepared)
    per_round = sum(row.median_s or 0.0 for row, _ in timers)
    rounds = int(max(RUNOFF_MIN_ROUNDS, min(TIME_MAX_RUNS, RUNOFF_BUDGET_S / max(per_round, 1e-9))))
    times: dict[int, list[float]] = {i: [] for i in range(len(timers))}
    for r in range(rounds):
        for j in range(len(timers)):
            i = (j + r) % len(timers)  # rotate who goes first
            times[i].append(timers[i][1]())
    for i, (row, _) in enumerate(timers):
        row.median_s = statistics.median(times[i])
        row.runs += rounds
        row.note = (row.note + "; " if row.note else "") + f"run-off: {rounds} interleaved rounds"


# --------------------------------------------------------------------------------------------
# The cache


_MEMORY: dict[str, Decision] = {}
#: (backend name, selection key) pairs whose backend raised at run time under "auto".
_FAILED: set[tuple[str, str]] = set()
_WARNED: set[str] = set()


def cache_file() -> Path:
    """The on-disk cache: ``$FP8REF_CACHE_DIR/select-v1.json`` (default ``~/.cache/fp8ref``)."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "fp8ref")
    return Path(root) / _CACHE_NAME


def clear_cache(*, memory: bool = True, disk: bool = False, failures: bool = True) -> None:
    """Forget decisions in memory (and on disk with ``disk=True``) and run-time failure marks."""
    if memory:
        _MEMORY.clear()
    if failures:
        _FAILED.clear()
        _WARNED.clear()
    if disk:
        with contextlib.suppress(FileNotFoundError):
            cache_file().unlink()
    _bump_generation()


_GENERATION = [0]


def _bump_generation() -> None:
    """Invalidate the per-weight dispatch tables of ``fp8ref.linear``."""
    _GENERATION[0] += 1


def _read_disk(path: Path, *, warn: bool) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if warn:
            warnings.warn(f"fp8ref: cannot read selection cache {path}: {exc}", stacklevel=4)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
    except ValueError as exc:
        if warn:
            warnings.warn(f"fp8ref: ignoring corrupt selection cache {path} ({exc}); it will be rebuilt",
                          stacklevel=4)
        return None
    if data.get("schema") != CACHE_SCHEMA or data.get("fp8ref") != _fp8ref_version():
        if warn:
            warnings.warn(f"fp8ref: ignoring stale selection cache {path} (schema {data.get('schema')!r}, "
                          f"fp8ref {data.get('fp8ref')!r}; expected {CACHE_SCHEMA}, {_fp8ref_version()}); "
                          "it will be rebuilt", stacklevel=4)
        return None
    return data


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive fcntl lock on ``path`` (a no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # Windows: writes stay atomic (os.replace), merges may lose an entry
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_disk(key: str, decision: Decision) -> None:
    """Merge one entry into the cache file under a lock; write a temp file, then os.replace."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            data = _read_disk(path, warn=False) or {"schema": CACHE_SCHEMA, "fp8ref": _fp8ref_version(),
                                                     "entries": {}}
            data["entries"][key] = decision.to_json()

            def _dump(tmp: str) -> None:
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)

            atomic_write(path, _dump)
    except OSError as exc:  # the cache is an optimisation: a read-only home must not break inference
        warnings.warn(f"fp8ref: cannot write selection cache {path}: {exc}", stacklevel=4)


def _lookup_disk(key: str) -> Decision | None:
    data = _read_disk(cache_file(), warn=True)
    if data is None or key not in data["entries"]:
        return None
    try:
        return Decision.from_json(key, data["entries"][key])
    except (KeyError, TypeError, ValueError) as exc:
        warnings.warn(f"fp8ref: ignoring malformed cache entry ({exc!r}); it will be rebuilt", stacklevel=3)
        return None


# --------------------------------------------------------------------------------------------
# Selection


def _candidates(names: list[str] | tuple[str, ...] | None) -> list[Backend]:
    _ensure_loaded()
    if names is None:
        env = os.environ.get(ENV_CANDIDATES)
        names = [n.strip() for n in env.split(",") if n.strip()] if env else None
    if names is None:
        return list(_REGISTRY.values())
    out = [get_backend(n) for n in names]
    if not any(b.name == "reference" for b in out):
        out.append(get_backend("reference"))
    return out


def _case_variants(case: Case) -> list[Case]:
    """The Ms at which ``supports`` must hold: both ends of the bucket."""
    b = m_bucket(case.M)
    return [Case(M=m, N=case.N, K=case.K, recipe=case.recipe, x_dtype=case.x_dtype, out_dtype=case.out_dtype,
                 device=case.device, has_bias=case.has_bias) for m in sorted({_bucket_lo(b), b})]


def _supports(backend: Backend, case: Case) -> str | None:
    mp, n_probe = _probe_shapes(case)
    variants = _case_variants(case)
    variants.append(Case(M=mp, N=n_probe, K=case.K, recipe=case.recipe, x_dtype=case.x_dtype,
                         out_dtype=case.out_dtype, device=case.device, has_bias=case.has_bias))
    for c in variants:
        try:
            reason = decline_reason(backend, c)
        except Exception as exc:
            return f"supports() raised {exc!r}"
        if reason is not None:
            return reason if c.M == case.M or c is variants[0] else f"{reason} (at M={c.M}, N={c.N})"
    return None


def _available(backend: Backend) -> str | None:
    try:
        return backend.available()
    except Exception as exc:
        return f"available() raised {exc!r}"


def _check_precision(precision: str | PrecisionClass) -> str:
    try:
        return PrecisionClass(precision).value
    except ValueError:
        raise ValueError(f"precision must be one of {[p.value for p in PrecisionClass]}, got {precision!r}") from None


def _run_selection(case: Case, precision: str, cands: list[Backend], key: str) -> Decision:
    t_start = time.perf_counter()
    req = PrecisionClass(precision)
    rows: list[Row] = []
    probed: list[tuple[Backend, Row, ProbeResult]] = []
    probe_set: _ProbeSet | None = None
    for b in cands:
        row = Row(backend=b.name, precision=b.precision.value)
        rows.append(row)
        row.available = _available(b)
        if row.available is not None:
            continue
        row.supported = _supports(b, case)
        if row.supported is not None:
            continue
        row.admitted = req.admits(b.precision)
        if not row.admitted:
            row.note = f"class {b.precision.value} not admitted by precision={precision}"
            continue
        if type(b).__module__ == "fp8ref.kernels.reference" and b.name == "reference":
            # The spec itself: probing it compares it with itself (and costs the most, float64).
            row.compliant, row.detail, row.estimate_s = True, "the spec (compliant by definition, not probed)", math.inf
            probed.append((b, row, None))
            continue
        if probe_set is None:
            probe_set = _ProbeSet(case)
        res = probe(b, case, _set=probe_set)
        row.compliant, row.worst_ratio, row.detail = res.compliant, res.worst_ratio, res.detail
        row.ratios = res.ratios
        if res.compliant:
            mt = min(m_bucket(case.M), TIME_M_CAP)
            row.estimate_s = res.call_seconds * (mt * case.N) / max(res.call_elements, 1)
            probed.append((b, row, res))
    if not probed:
        raise NoCompliantBackendError(f"no backend is compliant at {case.short_str()} with precision>={precision}:\n"
                                      + Decision(key, case.short_str(), precision, "", [], rows).table())
    if len(probed) > 1:
        best: float | None = None
        timers: dict[str, Callable[[], float]] = {}
        for b, row, _ in sorted(probed, key=lambda t: t[1].estimate_s):
            if b.name == "reference":
                # The spec computes in float64 and is never faster than a real kernel: it is the
                # last-resort fallback, ranked last without spending the timing budget on it.
                row.note = "not timed: the reference is the fallback, ranked last"
                continue
            if best is not None and row.estimate_s > SKIP_FACTOR * best:
                row.note = f"not timed: estimated {row.estimate_s:.3g} s > {SKIP_FACTOR:g}x best"
                continue
            try:
                row.median_s, row.runs, row.note = _time(b, case, best, timers)
            except Exception as exc:
                row.note = f"timing raised {type(exc).__name__}: {exc}"
                row.compliant = False
                continue
            best = row.median_s if best is None else min(best, row.median_s)
        if best is not None:
            close = [(b, row) for b, row, _ in probed if row.compliant and row.median_s is not None
                     and row.runs > 1 and row.median_s <= RUNOFF_FACTOR * best]
            if len(close) > 1:
                try:
                    _runoff(close, case, timers)
                except Exception as exc:  # keep the sequential medians; say why
                    for _, row in close:
                        row.note = (row.note + "; " if row.note else "") + f"run-off raised {exc!r}"
    ranked = sorted((r for _, r, _ in probed if r.compliant),
                    key=lambda r: (len(probed) > 1 and r.backend == "reference", r.median_s is None,
                                   r.median_s if r.median_s is not None else r.estimate_s))
    if not ranked:
        raise NoCompliantBackendError(f"every compliant backend failed timing at {case.short_str()}")
    ranked[0].chosen = True
    return Decision(key=key, case=case.short_str(), precision=precision, chosen=ranked[0].backend,
                    ranking=[r.backend for r in ranked], rows=rows, source="probe",
                    seconds=time.perf_counter() - t_start)


def select(case: Case, precision: str | PrecisionClass = DEFAULT_PRECISION, *,
           candidates: list[str] | tuple[str, ...] | None = None, refresh: bool = False) -> Decision:
    """The fastest compliant backend for ``case`` (looked up in memory, then on disk, then probed).

    Parameters
    ----------
    case : Case
        The problem; its M is reduced to its power-of-two bucket.
    precision : str or PrecisionClass
        Required class: ``exact`` < ``strict`` < ``standard`` (default) < ``fast``.
    candidates : sequence of str, optional
        Restrict to these backends (``FP8REF_CANDIDATES`` otherwise); the reference is always added.
    refresh : bool
        Ignore both caches and probe again (the result is stored again).

    Returns
    -------
    Decision
        ``chosen``, the fallback ``ranking`` and the table ``rows``; ``source`` says where it came from.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.select import select
    >>> d = select(fp8ref.Case(M=8, N=32, K=64, recipe=fp8ref.W8A8_FP8), candidates=["reference"])
    >>> d.chosen
    'reference'
    """
    precision = _check_precision(precision)
    cands = _candidates(candidates)
    key = selection_key(case, precision, cands)
    if not refresh:
        d = _MEMORY.get(key)
        if d is not None:
            d.source = "memory"
            return d
        d = _lookup_disk(key)
        if d is not None and all(n in _REGISTRY for n in d.ranking):
            _MEMORY[key] = d
            return d
    d = _run_selection(case, precision, cands, key)
    _MEMORY[key] = d
    _write_disk(key, d)
    return d


def _forced(name: str, case: Case, precision: str, origin: str) -> Backend:
    try:
        b = get_backend(name)
    except KeyError as exc:
        raise BackendUnavailableError(f"{origin}: {exc.args[0]}") from None
    reason = _available(b)
    if reason is not None:
        raise BackendUnavailableError(f"{origin}: backend {name!r} is not available here: {reason}")
    for c in _case_variants(case):
        reason = decline_reason(b, c)
        if reason is not None:
            raise BackendUnavailableError(f"{origin}: backend {name!r} does not support {c.short_str()}: {reason}")
    if not PrecisionClass(precision).admits(b.precision):
        raise BackendUnavailableError(f"{origin}: backend {name!r} is in class {b.precision.value}, outside the "
                                      f"required precision={precision!r}; pass precision={b.precision.value!r} "
                                      "to accept it")
    return b


def resolve(case: Case, backend: str = "auto", precision: str | PrecisionClass = DEFAULT_PRECISION, *,
            candidates: list[str] | tuple[str, ...] | None = None) -> tuple[Backend, Decision | None]:
    """The backend that runs ``case``: an explicit name, ``FP8REF_BACKEND``, or the selector.

    An explicit or forced backend that cannot run (unknown, unavailable, unsupported case,
    outside the precision class) raises ``BackendUnavailableError``: never a silent fallback.
    Under "auto", backends marked failed at run time for this key are skipped.
    """
    precision = _check_precision(precision)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name or 'auto', got {type(backend).__name__}")
    if backend != "auto":
        return _forced(backend, case, precision, f"backend={backend!r}"), None
    env = os.environ.get(ENV_BACKEND)
    if env and env != "auto":
        return _forced(env, case, precision, f"{ENV_BACKEND}={env!r}"), None
    d = select(case, precision, candidates=candidates)
    for name in d.ranking:
        if (name, d.key) not in _FAILED and name in _REGISTRY:
            return _REGISTRY[name], d
    # Every ranked backend failed at run time: the reference is the spec and always able.
    return get_backend("reference"), d


def mark_failed(name: str, key: str, exc: BaseException) -> None:
    """Record that backend ``name`` raised at run time for selection ``key`` (warn once per backend)."""
    _FAILED.add((name, key))
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"fp8ref: backend {name!r} raised {type(exc).__name__}: {exc}; marked failed for this case, "
                      "falling back to the next compliant backend", RuntimeWarning, stacklevel=4)
    _bump_generation()
