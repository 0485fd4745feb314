"""Loading: what a loaded FP8 weight must dequantize to (docs/spec.md §8).

A serving stack holds a *fused* weight: the logical partitions of a layer (``q``, ``k``, ``v`` of
QKV, ``gate`` and ``up`` of gate-up) stacked along the output dimension N, and each tensor-parallel
rank holds a shard of it: column-parallel, a contiguous ``1/tp`` of every partition's rows;
row-parallel, a contiguous ``1/tp`` of the input dimension K. ``LoadLayout`` describes one rank's
shard; ``LoadSource`` is what the loader is given (each partition's full-precision weight, and for
an *offline* loader the checkpoint: the spec's quantization of each full partition);
``Loaded`` is what the loader holds afterwards (codes, stored scales and which scale each element
reads). ``expectation`` is the reference: per element of the rank's shard, the original value,
its *own* scale (the spec's quantization of the matching slice of its partition: the rank's
slice for an online loader, the full partition for a checkpoint), and the bound of
``loaded_error_bound``.

The rule (docs/spec.md §8.2): the scale grid is per partition; a stored scale entry read by the
elements E must lie in ``[s_lo(amax_E), max_E s_hi]`` (no element clips; no coarser than the
largest own scale it serves: a shared scale is the max of the partitions', as
``requantize_with_max_scale`` makes it), and each element must dequantize within the spec's bound
for that interval, plus the first rounding's bound where the entry is coarser than its own scale
(codes requantized from the partition's own). Online per-tensor at TP > 1 a rank may instead hold
the scale its TP group agrees on, its unsharded partition's (what TP 1 holds): the same
inequalities with the whole partition's quantization as the reference
(``agreed_scale_admitted``).

Imports flow down: ``schemes``, ``quant`` and ``bounds`` of the spec, nothing above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .bounds import U_FP32, conforming_quantization_error_bound, gamma, scale_interval
from .quant import Quantized, check_float_input, compute_scale, expand_scale, quantize
from .schemes import Granularity, QuantScheme

__all__ = ["LoadLayout", "LoadSource", "Loaded", "Expectation", "expectation", "checkpoint", "source_slices",
           "loaded_error_bound", "agreed_scale_admitted", "entry_index", "PARALLEL", "SOURCE_DTYPES"]

PARALLEL = ("column", "row")
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_WEIGHT_GRANULARITIES = (Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK)


@dataclass(frozen=True)
class LoadLayout:
    """One rank's shard of a fused linear weight.

    Attributes
    ----------
    partitions : tuple of int
        Rows (output features) of each logical partition of the *full* weight, in fused order
        (QKV: ``(q, k, v)``; gate-up: ``(gate, up)``; a plain layer: one partition).
    k : int
        Input features of the full weight.
    scheme : QuantScheme
        The weight scheme: ``tensor`` (one scale per partition), ``row`` or ``block``.
    tp_size, tp_rank : int
        Tensor-parallel size and this rank.
    parallel : str
        ``"column"`` (every partition split into ``tp_size`` equal row shards; rank r holds shard r
        of each, fused in order) or ``"row"`` (K split into ``tp_size`` equal column shards).
    offline : bool
        The loader reads a checkpoint (``LoadSource.codes``/``scales``: each full partition
        quantized by the spec) instead of quantizing the full-precision weight itself.
    """

    partitions: tuple[int, ...]
    k: int
    scheme: QuantScheme
    tp_size: int = 1
    tp_rank: int = 0
    parallel: str = "column"
    offline: bool = False

    def __post_init__(self) -> None:
        parts = tuple(self.partitions)
        if not parts or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in parts):
            raise ValueError(f"partitions must be a non-empty sequence of positive ints, got {self.partitions!r}")
        object.__setattr__(self, "partitions", parts)
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"k must be a positive int, got {self.k!r}")
        if not isinstance(self.scheme, QuantScheme):
            raise TypeError(f"scheme must be a QuantScheme, got {type(self.scheme).__name__}")
        if self.scheme.granularity not in _WEIGHT_GRANULARITIES or self.scheme.multiplier_scale:
            raise ValueError(f"scheme {self.scheme.short_str()}: a loaded weight takes tensor, row or block "
                             "dequantization scales")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must lie in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.parallel == "column" and any(n % self.tp_size for n in parts):
            raise ValueError(f"column parallel: every partition size {parts} must be a multiple of tp_size "
                             f"{self.tp_size}")
        if self.parallel == "row" and self.k % self.tp_size:
            raise ValueError(f"row parallel: k {self.k} must be a multiple of tp_size {self.tp_size}")
        if not isinstance(self.offline, bool):
            raise ValueError(f"offline must be a bool, got {self.offline!r}")

    @property
    def local_partitions(self) -> tuple[int, ...]:
        """Rows of each partition on this rank."""
        if self.parallel == "column":
            return tuple(n // self.tp_size for n in self.partitions)
        return self.partitions

    @property
    def local_k(self) -> int:
        return self.k // self.tp_size if self.parallel == "row" else self.k

    @property
    def offsets(self) -> tuple[int, ...]:
        """Row offset of each partition in the rank's fused weight."""
        out, o = [], 0
        for n in self.local_partitions:
            out.append(o)
            o += n
        return tuple(out)

    @property
    def shape(self) -> tuple[int, int]:
        """``[n_local, k_local]``: the fused weight this rank holds."""
        return sum(self.local_partitions), self.local_k

    def row_slice(self, p: int) -> slice:
        """The rows of partition ``p`` (of its full weight) that this rank holds."""
        n = self.local_partitions[p]
        r0 = self.tp_rank * n if self.parallel == "column" else 0
        return slice(r0, r0 + n)

    def col_slice(self) -> slice:
        """The columns of the full K that this rank holds."""
        k = self.local_k
        c0 = self.tp_rank * k if self.parallel == "row" else 0
        return slice(c0, c0 + k)

    def short_str(self) -> str:
        parts = "+".join(str(n) for n in self.partitions)
        tp = f"-tp{self.tp_size}r{self.tp_rank}{self.parallel[0]}" if self.tp_size > 1 else ""
        return f"[{parts}]x{self.k}{tp}-{self.scheme.short_str()}{'-offline' if self.offline else ''}"


@dataclass(frozen=True)
class LoadSource:
    """What a loader is given: each partition's full weight ``[N_p, K]`` (fp32/fp16/bf16) and, for an
    offline loader, the checkpoint: each full partition's codes and dequantization scales (the
    spec's quantization, ``checkpoint``)."""

    weights: tuple[torch.Tensor, ...]
    codes: tuple[torch.Tensor, ...] | None = None
    scales: tuple[torch.Tensor, ...] | None = None


@dataclass
class Loaded:
    """What a loader holds for its rank: ``data`` (FP8 codes ``[n_local, k_local]``) and ``scale``
    (dequantization scales in the loader's own layout); element ``(i, j)`` dequantizes to
    ``data[i, j] * scale2d[scale_rows[i], scale_cols[j]]`` where ``scale2d`` is ``scale`` viewed 2-D.

    ``scale_rows``/``scale_cols`` say which scale the consumer (the GEMM) reads; left None they
    follow from the scheme and the scale's shape (``entry_index``): one scale for all, one per
    partition (``[P]``), one per row (``[n]``/``[n, 1]``), or the fused block grid (row ``i // br``,
    column ``j // bc``), as vLLM's and SGLang's block GEMMs read it.
    """

    data: torch.Tensor
    scale: torch.Tensor
    scale_rows: torch.Tensor | None = None
    scale_cols: torch.Tensor | None = None


def source_slices(layout: LoadLayout, weights) -> list[torch.Tensor]:
    """Each partition's slice that this rank holds (views of ``weights``)."""
    cs = layout.col_slice()
    return [w[layout.row_slice(p), cs] for p, w in enumerate(weights)]


def checkpoint(layout: LoadLayout, weights) -> LoadSource:
    """The offline source: each full partition quantized by the spec (what a checkpoint stores per
    logical layer, with the scheme's grid on the full partition)."""
    qs = [quantize(w, layout.scheme) for w in weights]
    return LoadSource(tuple(weights), tuple(q.data for q in qs), tuple(q.scale for q in qs))


@dataclass
class Expectation:
    """The reference for one rank: float64 ``[n_local, k_local]`` tensors of the original values
    ``x``, the own scales' interval ``own_lo``/``own_hi``, the own bound (``conforming`` bound of the
    partition's quantization), the partition index of each row, and where the rule admits a scale
    agreed over the TP group, that alternative (``agreed_*``)."""

    x: torch.Tensor
    source: torch.Tensor
    own_lo: torch.Tensor
    own_hi: torch.Tensor
    own_bound: torch.Tensor
    partition_of_row: torch.Tensor
    scheme: QuantScheme = field(repr=False)
    #: The TP-agreed alternative (``agreed_scale_admitted``): per element, its unsharded
    #: partition's amax, scale interval's upper end and bound (the spec's quantization of the
    #: whole partition ``W_p``, what TP 1 holds); None where the rule admits no alternative.
    agreed_amax: torch.Tensor | None = None
    agreed_hi: torch.Tensor | None = None
    agreed_bound: torch.Tensor | None = None


def expectation(layout: LoadLayout, weights) -> Expectation:
    """The spec's quantization of the slices this rank holds: online, each partition's rank slice
    quantized on its own grid; offline, the full partition's checkpoint, sliced.

    Notes
    -----
    For an element x of partition p with own quantization (codes q, scale s, the spec's, on p's
    grid) the own bound is ``conforming_quantization_error_bound`` (the dynamic scale's interval
    of ``scale_interval``; a checkpoint's scale is given: static).
    """
    scheme = layout.scheme
    for p, w in enumerate(weights):
        check_float_input(w, f"weights[{p}]")
        if tuple(w.shape) != (layout.partitions[p], layout.k):
            raise ValueError(f"weights[{p}] has shape {tuple(w.shape)}, layout needs "
                             f"{(layout.partitions[p], layout.k)}")
    agreed = agreed_scale_admitted(layout)
    xs, los, his, bounds, a_amax, a_hi, a_bound = [], [], [], [], [], [], []
    for p, w in enumerate(weights):
        rs, cs = layout.row_slice(p), layout.col_slice()
        if layout.offline:
            full = quantize(w, scheme)
            ckpt = Quantized(full.data, full.scale, scheme.with_(dynamic=False))  # a given scale: static
            lo, hi = scale_interval(ckpt)
            rows, cols = w.shape
            lo, hi = (expand_scale(t, scheme, rows, cols)[rs, cs] for t in (lo, hi))
            bound = conforming_quantization_error_bound(w, ckpt)[rs, cs]
        else:
            xl = w[rs, cs]
            ref = quantize(xl, scheme)
            lo, hi = scale_interval(ref)
            lo, hi = (expand_scale(t, scheme, *xl.shape) for t in (lo, hi))
            bound = conforming_quantization_error_bound(xl, ref)
        if agreed:  # the whole partition quantized: the scale every rank holds at TP 1
            whole = quantize(w, scheme)
            n_l, k_l = rs.stop - rs.start, cs.stop - cs.start
            a_amax.append(w.abs().max().to(torch.float64).expand(n_l, k_l))
            a_hi.append(scale_interval(whole)[1].reshape(()).to(torch.float64).expand(n_l, k_l))
            a_bound.append(conforming_quantization_error_bound(w, whole)[rs, cs].to(torch.float64))
        xs.append(w[rs, cs])
        los.append(lo.to(torch.float64))
        his.append(hi.to(torch.float64))
        bounds.append(bound.to(torch.float64))
    part = torch.cat([torch.full((n,), p, dtype=torch.long) for p, n in enumerate(layout.local_partitions)])
    src = torch.cat(xs)
    alt = (torch.cat(a_amax), torch.cat(a_hi), torch.cat(a_bound)) if agreed else (None, None, None)
    return Expectation(src.to(torch.float64), src, torch.cat(los), torch.cat(his), torch.cat(bounds), part, scheme,
                       *alt)


def agreed_scale_admitted(layout: LoadLayout) -> bool:
    """Whether a rank's scale may be the one its TP group agrees on (docs/spec.md §8.2, "A scale
    agreed over the TP group"): an online per-tensor scheme at TP > 1, where a stack that reduces
    the amax over the group (``all_reduce(MAX)``) holds the unsharded partition's scale, what TP 1
    holds, and the sharded layer computes what the unsharded one does. A checkpoint's scale is
    already the whole partition's; row and block scales stay the rank slice's own."""
    return not layout.offline and layout.tp_size > 1 and layout.scheme.granularity is Granularity.TENSOR


def entry_index(layout: LoadLayout, loaded: Loaded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale2d, rows, cols)``: the stored scale as a 2-D float64 tensor and the scale row of each
    local row and column the consumer reads (``Loaded``'s defaults where it names none). Raises
    ValueError for a scale whose shape fits no reading of the scheme."""
    n, k = layout.shape
    s = loaded.scale
    g = layout.scheme.granularity
    if loaded.scale_rows is not None or loaded.scale_cols is not None:
        s2 = s.reshape(s.shape[0], -1) if s.dim() >= 1 else s.reshape(1, 1)
        rows = loaded.scale_rows if loaded.scale_rows is not None else torch.zeros(n, dtype=torch.long)
        cols = loaded.scale_cols if loaded.scale_cols is not None else torch.zeros(k, dtype=torch.long)
    elif g is Granularity.TENSOR and s.numel() == 1:
        s2, rows, cols = s.reshape(1, 1), torch.zeros(n, dtype=torch.long), torch.zeros(k, dtype=torch.long)
    elif g is Granularity.TENSOR and s.numel() == len(layout.partitions):
        s2 = s.reshape(-1, 1)
        rows = torch.cat([torch.full((m,), p, dtype=torch.long) for p, m in enumerate(layout.local_partitions)])
        cols = torch.zeros(k, dtype=torch.long)
    elif g is Granularity.ROW and s.numel() == n:
        s2, rows, cols = s.reshape(n, 1), torch.arange(n), torch.zeros(k, dtype=torch.long)
    elif g is Granularity.BLOCK and s.dim() == 2:
        br, bc = layout.scheme.block
        s2, rows, cols = s, torch.arange(n) // br, torch.arange(k) // bc
    else:
        raise ValueError(f"a stored scale of shape {tuple(s.shape)} fits no reading of {layout.scheme.short_str()} "
                         f"on a [{n}, {k}] shard with {len(layout.partitions)} partitions; name scale_rows/scale_cols")
    rows, cols = rows.to(torch.long), cols.to(torch.long)
    if rows.shape != (n,) or cols.shape != (k,):
        raise ValueError(f"scale_rows/scale_cols have shapes {tuple(rows.shape)}/{tuple(cols.shape)}, "
                         f"need ({n},)/({k},)")
    if n and (int(rows.min()) < 0 or int(rows.max()) >= s2.shape[0]):
        raise ValueError(f"scale_rows index outside the stored scale's {s2.shape[0]} rows")
    if k and (int(cols.min()) < 0 or int(cols.max()) >= s2.shape[1]):
        raise ValueError(f"scale_cols index outside the stored scale's {s2.shape[1]} columns")
    return s2, rows, cols


def loaded_error_bound(exp: Expectation, entries: torch.Tensor, held: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lo, hi, bound)``: per element, the interval its stored scale entry must lie in and the
    bound on |q e - x|. ``entries`` ([n, k] long) numbers the stored scale entry each element reads;
    ``held`` ([n, k] float64, optional) is the scale each element reads, which chooses between the
    rule's alternatives where ``exp`` has a TP-agreed one (without it: the own alternative).

    Notes
    -----
    For the elements E reading one entry e, with own intervals [lo_i, hi_i] and own bounds B_i::

        s_lo(E) = the spec's scale interval's lower end for amax_E = max_E |x|   (no element clips)
        e in [s_lo(E), max_E hi_i]                                         (amax_E > 0)
        |q e - x| <= B(x; s_lo(E), max_E hi_i)                            (hi_E = hi_i)
        |q e - x| <= B_i + B(|x| + B_i; s_lo(E), hi_E)                   (hi_E > hi_i: requantized)

    with B(x; lo, hi) = hi ulp(min(|x| (1 + g) / lo, qmax)) / 2 + g |x| + max(|x| - qmax lo, 0),
    g = gamma_2(u32) (``conforming_quantization_error_bound``'s inequality). An entry read only by
    zeros (amax_E = 0) may hold any positive finite scale: its codes must be 0.

    The TP-agreed alternative (``exp.agreed_*``) is the same inequalities with each element's own
    quantization replaced by its unsharded partition's: amax_E the largest amax of the whole
    partitions E reads, hi_i and B_i the whole partition's. An entry is judged by the own
    alternative unless e lies outside its interval and inside the agreed one's (then by that one;
    outside both, the own interval is returned and e fails it): a scale between the two (coarser
    than the rank's own, finer than the whole weight's) lies in neither.
    """
    own = _alternative(exp, entries, exp.x.abs(), exp.own_hi, exp.own_bound)
    if held is None or exp.agreed_amax is None:
        return own
    alt = _alternative(exp, entries, exp.agreed_amax, exp.agreed_hi, exp.agreed_bound)
    by_alt = ~((held >= own[0]) & (held <= own[1])) & (held >= alt[0]) & (held <= alt[1])
    return tuple(torch.where(by_alt, b, a) for a, b in zip(own, alt, strict=True))


def _alternative(exp: Expectation, entries: torch.Tensor, amax_x: torch.Tensor, hi_x: torch.Tensor,
                 bound_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loaded_error_bound``'s inequalities for one reference quantization: per element the amax its
    entry must not clip (``amax_x``), its scale interval's upper end and its bound."""
    scheme = exp.scheme
    flat = entries.reshape(-1)
    m = int(flat.max()) + 1 if flat.numel() else 0
    amax = torch.zeros(m, dtype=torch.float64).scatter_reduce(0, flat, amax_x.reshape(-1), "amax",
                                                              include_self=True)
    hi_e = torch.zeros(m, dtype=torch.float64).scatter_reduce(0, flat, hi_x.reshape(-1), "amax",
                                                               include_self=True)
    dyn = scheme.with_(granularity="row", block=None, dynamic=True)
    s_e = compute_scale(amax.to(torch.float32).reshape(-1, 1), dyn)
    lo_e, _ = scale_interval(Quantized(torch.zeros(m, 1, dtype=scheme.format.torch_dtype), s_e, dyn))
    lo_e = lo_e.reshape(-1)
    # an entry's lower end never exceeds its upper end: a checkpoint's scale can lie below the
    # dynamic quotient's interval when the block was quantized with a floor
    lo_e = torch.minimum(lo_e, hi_e)
    zero = amax == 0
    lo_e = torch.where(zero, torch.zeros_like(lo_e), lo_e)
    hi_e = torch.where(zero, torch.full_like(hi_e, float("inf")), hi_e)
    lo, hi = lo_e[flat].reshape(entries.shape), hi_e[flat].reshape(entries.shape)
    shared = hi > hi_x
    r = torch.where(shared, bound_x, torch.zeros_like(bound_x))
    bound = r + _interval(exp.x.abs() + r, scheme, lo, hi)
    return lo, hi, torch.where(torch.isinf(hi), torch.zeros_like(bound), bound)


def _interval(ax: torch.Tensor, scheme: QuantScheme, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """B(x; lo, hi) elementwise (float64): ``conforming_quantization_error_bound``'s inequality."""
    g = gamma(2, U_FP32)
    safe_lo = torch.where(lo > 0, lo, torch.ones_like(lo))
    v_max = ax / safe_lo * (1 + g)
    fmt, qmax = scheme.format, scheme.qmax
    return hi * fmt.ulp(torch.clamp(v_max, max=qmax)) / 2 + g * ax + torch.clamp(ax - qmax * lo, min=0)
