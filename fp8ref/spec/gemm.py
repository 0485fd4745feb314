"""The reference scaled GEMM: y = (a . b^T) (.) scales + bias, accumulated exactly, rounded once.

``a`` holds quantized activations ``[M, K]``, ``b`` quantized weights ``[N, K]``. Along K each
operand's scale is piecewise constant; the union of both operands' block edges cuts K into
*segments* on which both scales are constant. Then, exactly::

    y[m, n] = sum over segments g of  sa[m, g] * sb[n, g] * S_g[m, n]  +  bias[n]
    S_g[m, n] = sum over k in g of  a[m, k] * b[n, k]

``S_g`` is computed exactly with float64 GEMMs: every FP8 value is an integer multiple of the
format's smallest subnormal 2**-p, so every product is a multiple of 2**-(pa+pb), and any partial
sum of such products is a float64 as long as its magnitude stays below 2**(53-pa-pb) (see
docs/spec.md, "Exact accumulation"). Where one GEMM would break that limit (E5M2's 32 binades,
or K beyond ~171k for E4M3), the operands are split by magnitude and K is chunked until each
GEMM is exact; the few exact partial results are then added in float64, whose error
``bounds.reference_gemm_error_bound`` states. The epilogue (scales, segment sum, bias) runs in
float64 and the result is rounded once to ``out_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Fp8Format
from .quant import Quantized

__all__ = ["scaled_mm", "scaled_mm_exact", "k_segments", "scale_column", "check_operands", "ExactPlan", "exact_plan",
           "OUT_DTYPES"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_F64_SIGNIFICAND = 53


@dataclass(frozen=True)
class _Part:
    """Values of a format with lo <= |v| < hi: integer multiples of 2**-p, at most vmax."""

    lo: float
    hi: float
    p: int
    vmax: float


def _parts(fmt: Fp8Format) -> tuple[_Part, ...]:
    p_sub = -fmt.min_exponent + fmt.mantissa_bits  # smallest subnormal = 2**-p_sub
    if fmt.exponent_bits <= 4:
        return (_Part(0.0, float("inf"), p_sub, fmt.max),)
    # E5M2 spans 32 binades, too many for one exact float64 product sum: split at 1.0.
    # Values < 1 are multiples of 2**-16 (max 0.875); values >= 1 multiples of 2**-2.
    below_one = 1.0 - 2.0 ** -fmt.mantissa_bits / 2
    return (_Part(0.0, 1.0, p_sub, below_one), _Part(1.0, float("inf"), fmt.mantissa_bits, fmt.max))


@dataclass(frozen=True)
class ExactPlan:
    """How the reference sums one K-segment: operand parts and the chunk length of K."""

    pairs: tuple[tuple[_Part, _Part], ...]
    chunk: int  #: largest K-chunk for which every pair's float64 GEMM is exact


def exact_plan(fa: Fp8Format, fb: Fp8Format) -> ExactPlan:
    """Split and chunk length that make each float64 GEMM exact for formats ``fa`` x ``fb``.

    Notes
    -----
    A pair of parts with spacings 2**-pa, 2**-pb and maxima ma, mb gives products that are
    multiples of 2**-(pa+pb) with magnitude <= ma*mb; a sum of L of them is exact in float64 when
    L * ma * mb <= 2**(53 - pa - pb). chunk is the smallest such L over all pairs.
    """
    pairs = tuple((x, y) for x in _parts(fa) for y in _parts(fb))
    chunk = min(int(2.0 ** (_F64_SIGNIFICAND - x.p - y.p) // (x.vmax * y.vmax)) for x, y in pairs)
    if chunk < 1:
        raise AssertionError(f"no exact float64 plan for {fa.name} x {fb.name}")
    return ExactPlan(pairs, chunk)


def k_segments(a: Quantized, b: Quantized) -> list[tuple[int, int]]:
    """Half-open K ranges on which both operands' scales are constant."""
    K = a.data.shape[1]
    _, ca = a.scheme.block_shape(*a.data.shape)
    _, cb = b.scheme.block_shape(*b.data.shape)
    edges = sorted(set(range(0, K, ca)) | set(range(0, K, cb)) | {K})
    return list(zip(edges[:-1], edges[1:], strict=True))


def check_operands(a: Quantized, b: Quantized, bias: torch.Tensor | None, out_dtype: torch.dtype, *,
                   finite_bias: bool = True) -> None:
    """The argument checks of ``scaled_mm`` (backends reuse them for the same errors and messages);
    ``finite_bias=False`` skips the NaN/Inf scan of the bias (a device sync on hot paths)."""
    if not isinstance(a, Quantized) or not isinstance(b, Quantized):
        raise TypeError("scaled_mm takes two fp8ref.Quantized operands: a [M, K] activations, b [N, K] weights")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"K mismatch: a is {tuple(a.data.shape)} [M, K] but b is {tuple(b.data.shape)} [N, K]")
    if a.data.device != b.data.device:
        raise ValueError(f"a is on {a.data.device} but b is on {b.data.device}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a float tensor")
        if tuple(bias.shape) != (b.data.shape[0],):
            raise ValueError(f"bias must have shape [N] = ({b.data.shape[0]},), got {tuple(bias.shape)}")
        if finite_bias and not bool(torch.isfinite(bias).all()):
            raise ValueError("bias contains NaN/Inf")


#: K-tile width: operands are widened to float64 one tile at a time into reused buffers, which
#: avoids a full float64 copy of the weight (page faults made that the dominant cost). 512 rather
#: than 256: half the calls, each big enough for two threads (M=128, K=N=4096 on the 2-vCPU AVX2
#: EPYC, best of 4 under load: 2.55x fp32 F.linear vs 3.15x with 256; 1024 gave 2.68x).
_TILE = 512


def _value_table(fmt: Fp8Format, device: torch.device) -> torch.Tensor:
    """The float64 value of each of the 256 codes, indexed by code: torch's own FP8 -> float64
    cast, applied once to the 256 codes (NaN codes give NaN, as the cast does)."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return codes.view(fmt.torch_dtype).to(torch.float64)


def _widen(codes: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``codes`` (FP8, ``[rows, w]``, any strides) as float64 values, in the front of the flat
    buffers ``idx`` (int32) and ``out`` (float64): a table lookup, the same values as the cast.

    torch's element-wise FP8 -> float64 cast ran at ~0.07 G elements/s on a CPU, 45 % of the
    reference GEMM's time; the int32 copy and the lookup together at ~0.5 G elements/s."""
    rows, w = codes.shape
    i = idx[: rows * w]
    i.view(rows, w).copy_(codes.view(torch.uint8))
    return torch.index_select(table, 0, i, out=out[: rows * w]).view(rows, w)


def _segment_sum(a8: torch.Tensor, b8: torch.Tensor, plan: ExactPlan, bufs: dict,
                 absolute: bool) -> tuple[torch.Tensor, int]:
    """sum_k a[:, k] b[:, k] over one K-segment as float64, and the count of inexact additions.

    Each (chunk, part-pair) accumulator only ever holds partial sums that are exact float64
    values (see ``exact_plan``), so its ``addmm_`` updates are exact in any order.
    """
    M, L = a8.shape
    N = b8.shape[0]
    accs = []
    for c0 in range(0, L, plan.chunk):
        c1 = min(L, c0 + plan.chunk)
        pair_accs = [torch.zeros(M, N, dtype=torch.float64, device=a8.device) for _ in plan.pairs]
        for t0 in range(c0, c1, _TILE):
            t1 = min(c1, t0 + _TILE)
            a = _widen(a8[:, t0:t1], bufs["table_a"], bufs["ia"], bufs["a"])
            b = _widen(b8[:, t0:t1], bufs["table_b"], bufs["ib"], bufs["b"])
            if absolute:
                a.abs_()
                b.abs_()
            if len(plan.pairs) == 1:
                pair_accs[0].addmm_(a, b.T)
                continue
            for acc, (pa, pb) in zip(pair_accs, plan.pairs, strict=True):
                am = torch.where((a.abs() >= pa.lo) & (a.abs() < pa.hi), a, 0.0)
                bm = torch.where((b.abs() >= pb.lo) & (b.abs() < pb.hi), b, 0.0)
                acc.addmm_(am, bm.T)
        accs.extend(pair_accs)
    total = accs[0]
    for extra in accs[1:]:
        total += extra
    return total, len(accs) - 1


def scale_column(q: Quantized, k: int) -> torch.Tensor:
    """The scale of every row of ``q`` at column ``k``, as a float64 vector."""
    rows, cols = q.data.shape
    r, c = q.scheme.block_shape(rows, cols)
    return q.scale[:, k // c].to(torch.float64).repeat_interleave(r)[:rows]


def scaled_mm_exact(a: Quantized, b: Quantized, bias: torch.Tensor | None = None, *,
                    absolute: bool = False) -> tuple[torch.Tensor, int]:
    """The reference result in float64 before the output rounding, and the largest number of
    inexact float64 additions made while accumulating one segment (0 for E4M3 operands whose
    segments are shorter than ``exact_plan(...).chunk``, i.e. ~171k).

    With ``absolute=True`` it computes sum_g |sa sb| sum_k |a_k b_k| instead (bias ignored): the
    magnitude that every error bound in ``fp8ref.spec.bounds`` is proportional to.
    """
    check_operands(a, b, bias, torch.float64)
    M, K = a.data.shape
    N = b.data.shape[0]
    plan = exact_plan(a.scheme.format, b.scheme.format)
    width = min(_TILE, K)
    dev = a.data.device
    bufs = {"a": torch.empty(M * width, dtype=torch.float64, device=dev),
            "b": torch.empty(N * width, dtype=torch.float64, device=dev),
            "ia": torch.empty(M * width, dtype=torch.int32, device=dev),
            "ib": torch.empty(N * width, dtype=torch.int32, device=dev),
            "table_a": _value_table(a.scheme.format, dev), "table_b": _value_table(b.scheme.format, dev)}
    y = torch.zeros(M, N, dtype=torch.float64, device=dev)
    n_inexact = 0
    for k0, k1 in k_segments(a, b):
        s, n = _segment_sum(a.data[:, k0:k1], b.data[:, k0:k1], plan, bufs, absolute)
        n_inexact = max(n_inexact, n)
        # sa * sb is exact in float64 (two <= 24-bit significands); the multiply-add rounds once each.
        outer = torch.outer(scale_column(a, k0), scale_column(b, k0))
        y.addcmul_(s, outer.abs() if absolute else outer)
    if bias is not None and not absolute:
        y += bias.to(torch.float64)
    return y, n_inexact


def scaled_mm(a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference scaled GEMM: ``(a . b^T) (.) scales + bias``, exact accumulation, one rounding.

    Parameters
    ----------
    a : Quantized
        Activations ``[M, K]``.
    b : Quantized
        Weights ``[N, K]`` (the ``nn.Linear`` layout).
    bias : torch.Tensor, optional
        ``[N]``, any float dtype, added exactly before the single output rounding.
    out_dtype : torch.dtype
        bf16 (default), fp16, fp32 or fp64 (fp64 returns the unrounded float64 result).

    Examples
    --------
    >>> import torch, fp8ref
    >>> p2 = fp8ref.QuantScheme(pow2_scale=True)  # power-of-two scales: these values quantize exactly
    >>> a = fp8ref.quantize(torch.tensor([[1.0, 2.0]]), p2)
    >>> b = fp8ref.quantize(torch.tensor([[3.0, 4.0], [0.5, 0.25]]), p2)
    >>> fp8ref.scaled_mm(a, b, out_dtype=torch.float32).tolist()
    [[11.0, 1.0]]
    """
    check_operands(a, b, bias, out_dtype)
    y, _ = scaled_mm_exact(a, b, bias)
    return y.to(out_dtype)
