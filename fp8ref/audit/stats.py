"""Per-layer error statistics of an audit: sums that give rel. L2 / SQNR / cosine, saturation and
flush counts, and the error / bound ratio on a sample of each layer's output."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..registry import Backend
from ..spec import bounds
from ..spec.compare import error_ratio
from ..spec.quant import Quantized, expand_scale, quantize, saturation_threshold
from ..spec.schemes import Granularity
from .report import ErrorStats

__all__ = ["RATIO_BIN_EDGES", "ErrorAccumulator", "LayerAccumulator", "sat_flush", "bound_check"]

#: log10 edges of the error/bound histogram kept per layer: 10**-8 .. 10**2 in quarter decades
#: (ratios outside are counted in the first/last bin).
RATIO_BIN_EDGES = tuple(-8.0 + 0.25 * k for k in range(41))


class ErrorAccumulator:
    """Sums that give rel. L2 error, SQNR, cosine and max |error| of ``y`` against ``r``."""

    def __init__(self) -> None:
        self.err2 = self.ref2 = self.out2 = self.dot = 0.0
        self.max_abs = 0.0
        self.n = 0

    @staticmethod
    def sums(y: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float, float, float, int]:
        """(sum (y-r)^2, sum r^2, sum y^2, sum y r, max |y-r|, n) of one call.

        Computed in fp32 (float64 for float64 inputs) with BLAS dot products: these are
        statistics of an FP8 error of ~2**-5 relative, for which fp32 sums (relative error
        ~ sqrt(n) 2**-24 in practice) are ample, and one pass each keeps the audit cheap.
        """
        wide = torch.float64 if torch.float64 in (y.dtype, r.dtype) else torch.float32
        y = y.detach().reshape(-1).to(wide)
        r = r.detach().reshape(-1).to(wide)
        d = y - r
        if not d.numel():
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0
        return (float(torch.dot(d, d)), float(torch.dot(r, r)), float(torch.dot(y, y)), float(torch.dot(y, r)),
                float(d.abs().max()), d.numel())

    def add(self, y: torch.Tensor, r: torch.Tensor) -> None:
        self.add_sums(self.sums(y, r))

    def add_sums(self, s: tuple[float, float, float, float, float, int]) -> None:
        self.err2 += s[0]
        self.ref2 += s[1]
        self.out2 += s[2]
        self.dot += s[3]
        self.max_abs = s[4] if math.isnan(s[4]) else max(self.max_abs, s[4])
        self.n += s[5]

    def stats(self) -> ErrorStats:
        if self.n == 0:
            return ErrorStats()
        nan = float("nan")
        if math.isnan(self.err2):
            return ErrorStats(nan, nan, nan, nan)
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else (0.0 if self.err2 == 0 else math.inf)
        if self.err2 == 0:
            sqnr = math.inf
        elif self.ref2 == 0:
            sqnr = -math.inf
        else:
            sqnr = 10.0 * math.log10(self.ref2 / self.err2)
        denom = math.sqrt(self.ref2 * self.out2)
        cos = self.dot / denom if denom > 0 else nan
        return ErrorStats(rel, self.max_abs, sqnr, cos)


def _take_rows(q: Quantized, idx: torch.Tensor) -> tuple[Quantized, torch.Tensor]:
    """Rows ``idx`` of a quantized activation tensor, with their own scales (exact: every
    activation scheme but 2-D blocks keeps a row's scales separate). For block scales the
    first block of rows is taken whole; the returned ``idx`` says which rows were used."""
    g = q.scheme.granularity
    if g is Granularity.TENSOR:
        return Quantized(q.data[idx], q.scale, q.scheme), idx
    if g in (Granularity.ROW, Granularity.GROUP):
        return Quantized(q.data[idx], q.scale[idx], q.scheme), idx
    r = q.scheme.block[0]
    idx = torch.arange(min(q.data.shape[0], r), device=q.data.device)
    return Quantized(q.data[idx], q.scale[:1], q.scheme), idx


def sat_flush(x: torch.Tensor, q: Quantized) -> tuple[int, int, int]:
    """(saturated, flushed-to-zero, non-zero) element counts of ``x`` quantized as ``q``.

    Saturated: |x / s| beyond qmax + ulp(qmax)/2 with the scales ``q`` holds (the clamp moved
    it); counted elementwise only in the blocks whose amax can reach that, since a dynamic
    scale almost never lets any element saturate. Flushed: x != 0 but its code is +-0.
    """
    rows, cols = x.shape
    thr = saturation_threshold(q.scheme.format, q.scheme.qmax)
    sat = 0
    if q.n_saturated is not None:
        sat = q.n_saturated
    elif x.numel():
        amax = x.abs().amax().to(torch.float32)
        if float(amax / q.scale.to(torch.float32).min()) > thr:
            s = expand_scale(q.scale.to(torch.float32), q.scheme, rows, cols)
            sat = int((x.to(torch.float32) / s).abs().gt(thr).sum())
    nz = x != 0
    zero_code = (q.data.view(torch.uint8) & 0x7F) == 0  # +0 and -0 (0x80 is NaN in FNUZ formats: never produced)
    return sat, int((nz & zero_code).sum()), int(nz.sum())


@dataclass
class LayerAccumulator:
    """Everything an audit keeps about one layer (one call site) for one backend."""

    name: str
    depth: int
    N: int
    K: int
    own: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    total: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    inp: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    prop: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    ratio_max: float = float("-inf")
    ratio_rows: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * (len(RATIO_BIN_EDGES) - 1))
    w_stats: tuple[float, float, float, float] | None = None  # saturated, flushed, scale min, max
    a_sat: int = 0
    a_flushed: int = 0
    a_nonzero: int = 0
    a_numel: int = 0
    a_smin: float = float("inf")
    a_smax: float = float("-inf")
    backends: set[str] = field(default_factory=set)
    nonfinite_input: int = 0
    bound_calls: int = 0


def _sample(n: int, k: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, min(k, n)).round().long().unique()


def _spec_quantization(t: torch.Tensor, q: Quantized) -> Quantized:
    """The spec's quantization of ``t`` under ``q``'s scheme (a static scheme keeps ``q``'s scale:
    the caller's)."""
    return quantize(t, q.scheme, None if q.scheme.dynamic else q.scale)


def bound_check(acc: LayerAccumulator, x2, w, bias, y, *, qx: Quantized, qw: Quantized, b: Backend, od,
                rows: int, cols: int) -> None:
    """Worst |y - y_true| / linear_error_bound on a rows x cols sample of the output.

    The layer's call (``x2``, ``w``, ``bias``, ``y``) comes by position, its quantized operands,
    the backend that computed ``y``, the output dtype ``od`` and the sample's size by name.

    The bound of element (m, n) depends only on row m of x and row n of w (and their scales),
    so it is computed on the sampled rows of both operands, each kept with its own scales
    (``_take_rows``): exact for every element sampled, at a fraction of the cost of the full
    [M, N] bound (which needs several float64 GEMMs and an elementwise bound on all of w).

    The bound is computed from the spec's own quantization of ``x2`` and ``w`` under the schemes of
    ``qx`` and ``qw`` (a static scheme's scale is the caller's), never from the scales the backend
    chose: a backend scale that clips is outside it (docs/spec.md §5.1).
    """
    qx, qw = _spec_quantization(x2, qx), _spec_quantization(w, qw)
    qxs, ix = _take_rows(qx, _sample(x2.shape[0], rows))
    qws, iw = _take_rows(qw, _sample(w.shape[0], cols))
    xs, ws = x2[ix], w[iw]
    bs = None if bias is None else bias[iw]
    bnd = bounds.linear_error_bound(xs, ws, qxs, qws, bs, out_dtype=od, accumulation=b.accumulation,
                                    output_roundings=b.output_roundings)
    y_true = xs.to(torch.float64) @ ws.to(torch.float64).T
    if bs is not None:
        y_true = y_true + bs.to(torch.float64)
    ratio = error_ratio((y[ix][:, iw].to(torch.float64) - y_true).abs(), bnd)
    worst = float(ratio.max())
    acc.ratio_max = worst if math.isnan(worst) else max(acc.ratio_max, worst)
    acc.ratio_rows += ratio.numel()
    _ratio_hist(ratio, acc.hist)


def _ratio_hist(ratio: torch.Tensor, hist: list[int]) -> None:
    r = ratio[torch.isfinite(ratio)].clamp(min=1e-300)
    lg = torch.log10(r)
    lo, step, nb = RATIO_BIN_EDGES[0], RATIO_BIN_EDGES[1] - RATIO_BIN_EDGES[0], len(hist)
    idx = ((lg - lo) / step).floor().clamp(0, nb - 1).to(torch.int64)
    for i, c in enumerate(torch.bincount(idx, minlength=nb).tolist()):
        hist[i] += c
