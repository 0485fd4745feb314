"""Error bounds derived from floating-point error analysis (docs/spec.md, "Bounds").

Every function returns an elementwise bound as a float64 tensor. Unit roundoffs are written as
powers of two; sums use Higham's gamma_n = n u / (1 - n u) (Accuracy and Stability of Numerical
Algorithms, 2nd ed., Lemma 3.1 and eq. (3.4)), which bounds the relative error of any
product of n factors (1 + delta_i)^{+-1} with |delta_i| <= u, and hence of a sum of n + 1 terms
evaluated in any order: |fl(sum x_i) - sum x_i| <= gamma_n sum |x_i|. When n u >= 1 the bound
is infinite (vacuous), never silently wrong.

Nothing here uses a hand-picked tolerance: each constant is a unit roundoff of a format or a
count of roundings.

Why this module is long: it is the one home of the GEMM and end-to-end tolerance rules (docs/spec.md
§5), so that a checker, the selector and the audits cannot disagree; each bound carries its
derivation in its Notes, and the GEMM, linear and propagated bounds share the pipeline-error core
(``_pipeline_error``) that would otherwise be repeated across modules. The quantization bounds,
which share only the unit roundoffs, live in ``fp8ref.spec.quant_bounds`` and the unit roundoffs
in ``fp8ref.spec.roundoff``; both are re-exported here, the one name checkers import from.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from .fenv import ieee
from .gemm import k_segments, scale_column, scaled_mm_exact
from .quant import Quantized, expand_scale
from .quant_bounds import (
    conforming_quantization_error_bound,
    quantization_error_bound,
    scale_error_bound,
    scale_interval,
)
from .roundoff import U_FP32, U_FP64, gamma, unit_roundoff
from .roundoff import eta as _eta
from .schemes import QuantScheme

__all__ = [
    "gemm_underflow_possible",
    "U_FP64",
    "U_FP32",
    "gamma",
    "Accumulation",
    "PrecisionClass",
    "precision_class",
    "check_output_roundings",
    "unit_roundoff",
    "quantization_error_bound",
    "scale_error_bound",
    "scale_interval",
    "conforming_quantization_error_bound",
    "reference_gemm_error_bound",
    "gemm_error_bound",
    "linear_error_bound",
    "propagated_gemm_bound",
]

@dataclass(frozen=True)
class Accumulation:
    """How a backend's GEMM accumulates products along K (declared by the backend).

    Attributes
    ----------
    name : str
    unit_roundoff : float
        u of the accumulator; 0 means exact (the reference).
    promote_every : int or None
        If set, partial sums of at most this many products are added into an fp32 accumulator
        (CUTLASS-style promotion, N_C in the DeepSeek-V3 report, section 3.3.2).
    operand_dtype : torch.dtype or None
        Dequantize-then-GEMM: each operand is dequantized (``code * scale``) and rounded to this
        dtype (bf16 or fp16) before a GEMM that accumulates with ``unit_roundoff`` (fp32 only) and
        applies no further scale. None (default): the codes reach the GEMM unrounded.
    """

    name: str
    unit_roundoff: float
    promote_every: int | None = None
    operand_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.unit_roundoff < 1):
            raise ValueError(f"unit_roundoff must lie in [0, 1), got {self.unit_roundoff}")
        if self.promote_every is not None and self.promote_every < 1:
            raise ValueError("promote_every must be a positive int")
        if self.operand_dtype is not None:
            if self.operand_dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"operand_dtype must be torch.bfloat16 or torch.float16, got {self.operand_dtype}")
            if self.unit_roundoff != U_FP32 or self.promote_every is not None:
                raise ValueError("dequantize-then-GEMM (operand_dtype) is declared for fp32 accumulation only")

    def error_factor(self, length: int) -> float:
        """g with |fl(sum_k p_k) - sum_k p_k| <= g sum_k |p_k| for ``length`` exact products.

        Notes
        -----
        Without promotion: g = gamma_{L-1}(u) (L - 1 additions). With promotion every N_C:
        g = gamma_{N_C-1}(u) + gamma_{ceil(L/N_C)}(u32) (1 + gamma_{N_C-1}(u)): each chunk sum
        is off by the first term, and adding ceil(L/N_C) chunk sums into an fp32 accumulator that
        starts at 0 makes ceil(L/N_C) roundings on each.
        """
        if self.unit_roundoff == 0:
            return 0.0
        if self.promote_every is None or self.promote_every >= length:
            return gamma(length - 1, self.unit_roundoff)
        g_chunk = gamma(self.promote_every - 1, self.unit_roundoff)
        return g_chunk + gamma(math.ceil(length / self.promote_every), U_FP32) * (1 + g_chunk)

    # Populated below: EXACT, FP32, FAST, BF16, FP16, BF16_OPERANDS, FP16_OPERANDS.
    EXACT = None  # type: ignore[assignment]
    FP32 = None  # type: ignore[assignment]
    FAST = None  # type: ignore[assignment]
    BF16 = None  # type: ignore[assignment]
    FP16 = None  # type: ignore[assignment]
    BF16_OPERANDS = None  # type: ignore[assignment]
    FP16_OPERANDS = None  # type: ignore[assignment]


Accumulation.EXACT = Accumulation("exact", 0.0)
Accumulation.FP32 = Accumulation("fp32", U_FP32)
#: Hopper FP8 tensor-core accumulation without promotion (``use_fast_accum=True``): about 14
#: bits kept (DeepSeek-V3 report, 3.3.2), aligned by truncation, so u = 2**-13 relative.
Accumulation.FAST = Accumulation("fast", 2.0**-13)
Accumulation.BF16 = Accumulation("bf16", 2.0**-8)
Accumulation.FP16 = Accumulation("fp16", 2.0**-11)
#: Dequantize-then-GEMM: operands dequantized and rounded to bf16 (fp16), then an fp32-accumulating
#: GEMM (a bf16 ``F.linear`` on CPU, optimum-quanto and fake-quantized models).
Accumulation.BF16_OPERANDS = Accumulation("bf16-operands-fp32", U_FP32, operand_dtype=torch.bfloat16)
Accumulation.FP16_OPERANDS = Accumulation("fp16-operands-fp32", U_FP32, operand_dtype=torch.float16)


class PrecisionClass(str, enum.Enum):
    """Ordered precision classes: exact < strict < standard < fast (each admits the ones before).

    exact     exact accumulation, float64 epilogue, one rounding to the output (the reference);
    strict    fp32 (or better) accumulation and epilogue, one rounding to the output;
    standard  fp32 accumulation, at most two roundings to the output dtype (e.g. a bf16 GEMM
              result scaled afterwards, or bias added after rounding);
    fast      anything with a lower-precision accumulator (fast accumulation, bf16/fp16), or more
              than two roundings to the output dtype (e.g. product, scale and bias rounded apart).
    """

    EXACT = "exact"
    STRICT = "strict"
    STANDARD = "standard"
    FAST = "fast"

    @property
    def rank(self) -> int:
        return list(PrecisionClass).index(self)

    def admits(self, other: PrecisionClass | str) -> bool:
        """True when a backend of class ``other`` meets this requirement."""
        return PrecisionClass(other).rank <= self.rank


def check_output_roundings(output_roundings: object) -> int:
    """``output_roundings`` if it is a declaration the bounds cover: an int >= 1 (not a bool).

    Raises
    ------
    ValueError
        Naming ``output_roundings`` and the value given.
    """
    if isinstance(output_roundings, bool) or not isinstance(output_roundings, int) or output_roundings < 1:
        raise ValueError("output_roundings (how many times a result is rounded to the output dtype) must be an "
                         f"int >= 1, got {output_roundings!r}")
    return output_roundings


def precision_class(accumulation: Accumulation, output_roundings: int) -> PrecisionClass:
    """The smallest class that contains a backend with this declaration.

    Notes
    -----
    exact: exact accumulation and one rounding; strict: fp32 or better and one rounding; standard:
    fp32 or better and at most two roundings; fast: everything else -- a coarser accumulator, or three
    or more output roundings (each one past the second adds about u_o |acc sa sb| to the bound, beyond
    what a caller asking for ``standard`` accepted; docs/spec.md §5.3).
    """
    check_output_roundings(output_roundings)
    u = accumulation.unit_roundoff
    if u == 0 and output_roundings == 1:
        return PrecisionClass.EXACT
    if (u <= U_FP32 and accumulation.promote_every is None and accumulation.operand_dtype is None
            and output_roundings <= 2):
        return PrecisionClass.STRICT if output_roundings == 1 else PrecisionClass.STANDARD
    return PrecisionClass.FAST


def _mass(a: Quantized, b: Quantized) -> tuple[torch.Tensor, int]:
    """P[m, n] >= sum_g |sa sb| sum_{k in g} |a_k b_k|, and the reference's inexact-addition count.

    P is computed like the reference (exact segment sums, float64 epilogue with nseg + n_add
    roundings per term) and then inflated by (1 + 2 gamma) so that it is an upper bound.
    """
    p, n_add = scaled_mm_exact(a, b, absolute=True)
    n = len(k_segments(a, b)) + n_add
    return p * (1 + 2 * gamma(n + 1, U_FP64)), n_add


def _abs_bias(bias: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if bias is None:
        return torch.zeros((), dtype=torch.float64, device=like.device)
    return bias.to(torch.float64).abs().unsqueeze(0)


def _reference_error(nseg: int, n_add: int, mass: torch.Tensor, abias: torch.Tensor) -> torch.Tensor:
    return gamma(nseg + n_add + 2, U_FP64) * (mass + abias)


@ieee
def reference_gemm_error_bound(a: Quantized, b: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Bound on |y_ref - y*|: the reference's float64 result against the exact value.

    Notes
    -----
    y_ref = ``scaled_mm(a, b, bias, out_dtype=torch.float64)``. The reference makes no error
    accumulating a segment (``fp8ref.spec.gemm.exact_plan``) except n_add float64 additions of exact
    partial sums (0 for E4M3 operands); per segment it multiplies once by the exact float64
    product sa*sb and adds once into y; bias adds once more. So each term of y* meets at most
    nseg + n_add + 2 float64 roundings::

        |y_ref - y*| <= gamma_{nseg + n_add + 2}(u64) (P + |bias|),   P = sum_g |sa sb| sum |a b|
    """
    mass, n_add = _mass(a, b)
    return _reference_error(len(k_segments(a, b)), n_add, mass, _abs_bias(bias, mass))


@ieee
def gemm_error_bound(a: Quantized, b: Quantized, bias: torch.Tensor | None = None, *,
                     out_dtype: torch.dtype = torch.bfloat16,
                     accumulation: Accumulation = Accumulation.FP32,
                     output_roundings: int = 1,
                     y_ref: torch.Tensor | None = None) -> torch.Tensor:
    """Bound on |y_hat - y_ref| for a backend with the declared accumulation and rounding count.

    ``y_ref`` is the reference's float64 result (``scaled_mm(..., out_dtype=torch.float64)``)
    and ``y_hat`` the backend's output in ``out_dtype``. Pass ``y_ref`` if you already computed
    it (a checker needs it anyway) to save one reference GEMM.

    Notes
    -----
    Let y* be the exact result, P = sum_g |sa_g sb_g| sum_{k in g} |a_k b_k|, L the longest
    K-segment, nseg the number of segments, u_o and eta_o the unit roundoff and smallest
    subnormal of ``out_dtype``.

    Before the output rounding, ``z`` (the backend's value) satisfies |z - y*| <= E with

    * fp32 pipelines (u_acc = u32, no promotion): E = gamma_{K+3}(u32) (P + |bias|). Any
      evaluation in fp32 -- products of raw codes accumulated then scaled, or codes dequantized
      first (a*sa, b*sb, their product), any summation order, bias added last -- subjects each
      term to at most K + 3 roundings (K - 1 additions, 3 multiplications, 1 bias addition;
      scaling per segment takes L + nseg + 1 <= K + 3).
    * other accumulators: E = g_acc(L) P + gamma_{nseg+3}(u32) ((1 + g_acc(L)) P + |bias|),
      with g_acc from ``Accumulation.error_factor`` and an fp32 epilogue.
    * exact accumulation (float64 epilogue): E = gamma_{nseg+2}(u64) (P + |bias|).
    * dequantize-then-GEMM (``operand_dtype`` with unit roundoff u_d, smallest subnormal eta_d):
      each operand is a s (1 + d) + e with |d| <= v = (1 + u32)(1 + u_d) - 1 (an fp32 product
      rounded to the operand dtype, or one rounding) and |e| <= eta_d; with R_a[m] =
      sum_g |sa| sum_k |a_k| and R_b[n] likewise, the rounded products differ from the exact ones by
      D = ((1 + v)^2 - 1) P + eta_d (1 + v)(R_a + R_b) + K eta_d^2, and the fp32 GEMM (K - 1
      additions, one rounding per product, one bias addition) adds gamma_{K+1}(u32) (P + D + |bias|):
      E = D + gamma_{K+1}(u32) (P + D + |bias|).

    Underflow (every accumulation but exact): an fp32 multiplication whose result is below fp32's
    smallest normal errs by up to eta_32/2 absolutely, beyond its relative error (additions are
    exact when their result is subnormal). Each term a_k b_k sa sb meets at most 3 multiplications,
    and an error made at one is afterwards multiplied only by factors of the same term (or by a
    segment's scales after a segment sum S, whose non-zero values are at least min|a| min|b|), so
    with W = sum_g max(1, sa) max(1, sb) sum_{k in g} max(1, |a_k|) max(1, |b_k|) the term
    (eta_32/2)(3 W + 2 nseg)(1 + g)(1 + gamma_{nseg+3}(u32)) is added to E (g the pipeline's
    relative factor: gamma_{K+3}, g_acc(L) or gamma_{K+1}). It is 0 when no product of the
    non-zero codes' and the scales' least values falls below 2**-126 (``_underflow_possible``):
    then no product is subnormal, as on every input whose scales are not tiny. A limited
    accumulator is assumed to have fp32's exponent range (fast, bf16) or to be kept in range by
    its kernel (fp16). Exact accumulation (float64) cannot underflow: the smallest non-zero
    product of two fp32 scales and two FP8 codes is above 2**-330, far above 2**-1022.

    More roundings to the output dtype (``output_roundings = k >= 2``): k - 1 intermediate roundings
    to ``out_dtype`` before the final one, each of a K-segment's accumulator before its scales or of
    the scaled value before the bias (the bias meets the final rounding only). Each multiplies every
    term it rounds by (1 + delta), |delta| <= u_o, and errs by at most eta_o/2 absolutely (times the
    segment's |sa sb| when the scales follow), an error the later ones scale by (1 + u_o) each. With
    s = sum_{i < k-1} (1 + u_o)^i (s = 1 for k = 2; (1 + u_o)^(k-1) - 1 = u_o s) they add
    u_o s (1 + g) P + (eta_o/2)(1 + sum_g |sa sb|) s (u_o s (P + E) for dequantize-then-GEMM; the
    underflow term, where present, joins the rounded magnitude; the absolute term times
    ``_growth``'s 1 + theta past its nseg limits) -- for k = 2 the two-rounding bound term for term
    (docs/spec.md §5.2, "More than one output rounding").
    The final rounding adds u_o (|y*| + E') + eta_o/2, and |y*| <= |y_ref| + E_ref. Finally the
    reference's own deviation E_ref (``reference_gemm_error_bound``) is added, because the
    comparison is against y_ref, not y*.
    """
    check_output_roundings(output_roundings)
    u_o, eta_o = unit_roundoff(out_dtype), _eta(out_dtype)
    M, K = a.data.shape
    segs = k_segments(a, b)
    nseg, L = len(segs), max(k1 - k0 for k0, k1 in segs)
    mass, n_add = _mass(a, b)
    abias = _abs_bias(bias, mass)
    e_ref = _reference_error(nseg, n_add, mass, abias)
    if y_ref is None:
        y_ref, _ = scaled_mm_exact(a, b, bias)
    elif y_ref.dtype != torch.float64 or tuple(y_ref.shape) != tuple(mass.shape):
        raise ValueError(f"y_ref must be the reference's float64 [M, N] result, got {y_ref.dtype} "
                         f"{tuple(y_ref.shape)}")

    def scale_mass() -> torch.Tensor:  # only for two or more output roundings
        return sum((torch.outer(scale_column(a, k0), scale_column(b, k0)).abs() for k0, _ in segs),
                   torch.zeros((), dtype=torch.float64, device=mass.device))

    pre = _pipeline_error(_Pipeline(mass, abias, K, nseg, L), accumulation, out_dtype, output_roundings,
                          row_masses=lambda: (_row_mass(a)[:, None], _row_mass(b)[None, :]),
                          scale_mass=scale_mass, underflow_mass=lambda: _underflow_mass(a, b, segs))
    y_abs = y_ref.abs() + e_ref
    return pre + u_o * (y_abs + pre) + eta_o / 2 + e_ref


@dataclass(frozen=True)
class _Pipeline:
    """What the GEMM error of a backend needs of its operands: P = sum_g |sa sb| sum |a b| (an upper
    bound), |bias|, K, the number of K-segments and the longest one."""

    mass: torch.Tensor
    abias: torch.Tensor
    K: int
    nseg: int
    L: int


def _pipeline_error(p: _Pipeline, accumulation: Accumulation, out_dtype: torch.dtype, output_roundings: int, *,
                    row_masses, scale_mass, underflow_mass) -> torch.Tensor:
    """E (plus the intermediate output roundings declared) of ``gemm_error_bound``'s Notes: a bound on
    |z - y*| for the value z a backend holds before its final rounding. ``row_masses()`` gives
    (R_a[:, None], R_b[None, :]) (dequantize-then-GEMM only), ``scale_mass()`` sum_g |sa sb| (two or
    more roundings only), ``underflow_mass()`` W or None when no fp32 product can underflow."""
    u_o, eta_o = unit_roundoff(out_dtype), _eta(out_dtype)
    mass, abias, K, nseg, L = p.mass, p.abias, p.K, p.nseg, p.L
    u_acc = accumulation.unit_roundoff
    if accumulation.operand_dtype is not None:
        g = gamma(K + 1, U_FP32)
        pre = _operand_rounding_error(accumulation.operand_dtype, K, mass, abias, *row_masses())
        inter = mass + pre  # bounds |z| before the bias: the rounded products' sum
    else:
        if u_acc == 0:
            g = 0.0
            pre = gamma(nseg + 2, U_FP64) * (mass + abias)
        elif u_acc <= U_FP32 and accumulation.promote_every is None:
            g = gamma(K + 3, U_FP32)
            pre = g * (mass + abias)
        else:
            g = accumulation.error_factor(L)
            pre = g * mass + gamma(nseg + 3, U_FP32) * ((1 + g) * mass + abias)
        inter = (1 + g) * mass
    if u_acc != 0:
        w = underflow_mass()
        if w is not None:
            uf = (_eta(torch.float32) / 2) * (3 * w + 2 * nseg) * (1 + g) * (1 + gamma(nseg + 3, U_FP32))
            pre = pre + uf
            inter = inter + uf  # an intermediate rounding sees the underflow errors too
    if output_roundings > 1:
        # k - 1 intermediate roundings: relative (1 + u_o)^(k-1) - 1 = u_o s on what they round, and
        # eta_o/2 each, carried through the later ones: s = sum_{i < k-1} (1 + u_o)^i (1 when k = 2).
        s = 0.0
        for _ in range(output_roundings - 1):
            s = s * (1 + u_o) + 1
        pre = pre + u_o * s * inter + (eta_o / 2) * (1 + scale_mass()) * s * _growth(u_acc, u_o, nseg)
    return pre


def _growth(u_acc: float, u_o: float, nseg: int) -> float:
    """What an intermediate rounding's absolute error may grow by in the pipeline's later arithmetic,
    beyond what the bound already gives it (docs/spec.md §5.2, "more output roundings").

    The error is non-zero only in the output dtype's subnormal range, where that rounding has no
    relative error and errs by at most |v| (0 is a neighbour): its unused relative allowance u_o |v|
    covers the growth theta |error| when theta <= u_o. theta is gamma_{nseg+3}(u32) after an fp32
    epilogue (gamma_{nseg+2}(u64) after the exact pipeline's float64 one); an output dtype at least
    as precise as the pipeline rounds nothing. Otherwise (fp16 with nseg > 8185, bf16 with
    nseg > 65277) the growth is bounded directly: 1 + theta.
    """
    u_pipe, theta = (U_FP64, gamma(nseg + 2, U_FP64)) if u_acc == 0 else (U_FP32, gamma(nseg + 3, U_FP32))
    return 1 + theta if u_o > u_pipe and theta > u_o else 1.0


#: fp32's smallest normal: a product of fp32 numbers at least this large is never subnormal.
_TINY32 = float(torch.finfo(torch.float32).smallest_normal)


def _underflow_possible(min_a: float, min_b: float, min_sa: float, min_sb: float) -> bool:
    """Whether some product of a subset of {|a_k|, |b_k|, sa, sb} (non-zero codes) can fall below
    fp32's smallest normal: the smallest such product is that of every factor below 1 at its least."""
    return min(min_a, 1.0) * min(min_b, 1.0) * min(min_sa, 1.0) * min(min_sb, 1.0) < _TINY32


def gemm_underflow_possible(a: Quantized, b: Quantized, accumulation: Accumulation) -> bool:
    """Whether ``gemm_error_bound`` holds an underflow term for these operands under ``accumulation``:
    some fp32 product of their non-zero codes and scales can fall below fp32's smallest normal
    (never for exact accumulation, whose float64 products cannot underflow).

    Notes
    -----
    Where this is False, every rounding of an fp32 (or narrower-significand) pipeline is relative,
    so multiplying a scale by 2**k multiplies every intermediate value, and the result, by exactly
    2**k (away from the output dtype's subnormals and overflow): the exact equivariance of
    ``scaled_mm.scale_equivariance``. Where it is True, the absolute error eta_32/2 of a subnormal
    product is not scaled, and the relation holds only within the two results' bounds.
    """
    if accumulation.unit_roundoff == 0:
        return False
    return _underflow_possible(_min_nonzero(a.data.float()), _min_nonzero(b.data.float()),
                               _min_nonzero(a.scale), _min_nonzero(b.scale))


def _min_nonzero(t: torch.Tensor) -> float:
    a = t.to(torch.float64).abs()
    a = a[a > 0]
    return float(a.min()) if a.numel() else math.inf


def _underflow_mass(a: Quantized, b: Quantized, segs: list[tuple[int, int]]) -> torch.Tensor | None:
    """W[m, n] = sum_g max(1, sa) max(1, sb) sum_{k in g} max(1, |a_k|) max(1, |b_k|), or None when
    no fp32 product of the operands' codes and scales can underflow (``_underflow_possible``)."""
    if not _underflow_possible(_min_nonzero(a.data.float()), _min_nonzero(b.data.float()),
                               _min_nonzero(a.scale), _min_nonzero(b.scale)):
        return None
    A = torch.clamp(a.data.to(torch.float64).abs(), min=1)
    B = torch.clamp(b.data.to(torch.float64).abs(), min=1)
    w = sum((torch.outer(torch.clamp(scale_column(a, k0), min=1), torch.clamp(scale_column(b, k0), min=1))
             * (A[:, k0:k1] @ B[:, k0:k1].T) for k0, k1 in segs),
            torch.zeros((), dtype=torch.float64))
    return w * (1 + gamma(a.data.shape[1] + 2, U_FP64))


def _row_mass(q: Quantized) -> torch.Tensor:
    """sum_k |code_k scale_k| per row of ``q`` (float64, exact up to one rounding per term and sum:
    inflated by 1 + gamma_{cols+1}(u64))."""
    rows, cols = q.data.shape
    s = expand_scale(q.scale.to(torch.float64), q.scheme, rows, cols)
    return (q.data.to(torch.float64).abs() * s.abs()).sum(dim=1) * (1 + gamma(cols + 1, U_FP64))


def _operand_rounding_error(dtype: torch.dtype, K: int, mass: torch.Tensor, abias: torch.Tensor,
                            rows_a: torch.Tensor, rows_b: torch.Tensor) -> torch.Tensor:
    """E of a dequantize-then-GEMM with operands rounded to ``dtype`` (see ``gemm_error_bound``);
    ``rows_a`` [M, 1] and ``rows_b`` [1, N] bound R_a and R_b."""
    v = (1 + U_FP32) * (1 + unit_roundoff(dtype)) - 1
    eta = _eta(dtype)
    d = ((1 + v) ** 2 - 1) * mass + eta * (1 + v) * (rows_a + rows_b) + K * eta**2
    return d + gamma(K + 1, U_FP32) * (mass + d + abias)


@ieee
def linear_error_bound(x: torch.Tensor, w: torch.Tensor, qx: Quantized, qw: Quantized,
                       bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                       accumulation: Accumulation = Accumulation.EXACT,
                       output_roundings: int = 1) -> torch.Tensor:
    """End-to-end bound on |y_hat - y_true|: a quantized linear against the unquantized one.

    ``y_true = x.double() @ w.double().T + bias`` (float64) and ``y_hat`` the backend's output.
    ``qx``/``qw`` are the **spec's** quantizations of ``x`` and ``w`` (``fp8ref.quantize`` under
    the schemes the backend declares). The bound holds for a backend that quantized ``x`` and
    ``w`` in *any* conforming way (scales within ``scale_interval``, codes RNE(clamp(x / s))) and
    computed its GEMM as declared, so it never reads a number the backend returns: a fused kernel
    whose scale clips values the spec's scale would not clip exceeds it.

    Notes
    -----
    With e_x = deq(qx') - x, e_w = deq(qw') - w for the backend's (unseen) quantizations, |e_x| <= Q_x
    and |e_w| <= Q_w elementwise (``conforming_quantization_error_bound``), the exact product of the
    backend's operands y_q* satisfies::

        |y_q* - y_exact| = |sum_k (x+e_x)(w+e_w) - x w| <= Q_x |w|^T + |x| Q_w^T + Q_x Q_w^T

    (three non-negative float64 GEMMs, inflated by 1 + gamma_K(u64) to cover their own rounding).
    The float64 y_true is off y_exact by at most gamma_K(u64) |x| |w|^T (products of <= 24-bit
    significands are exact in float64). The backend's GEMM error on its own operands is
    ``gemm_error_bound``'s E with P <= (|x| + Q_x)(|w| + Q_w)^T (inflated by 1 + gamma_{K+2}(u64)),
    R_a <= sum_k (|x| + Q_x), scale products at most s_hi_x s_hi_w, codes at most
    (|x| + Q_x) / s_lo, and |y_q*| <= |y_true| + the two terms above in its final rounding.
    """
    check_output_roundings(output_roundings)
    ax, aw = x.to(torch.float64).abs(), w.to(torch.float64).abs()
    qxb, qwb = conforming_quantization_error_bound(x, qx), conforming_quantization_error_bound(w, qw)
    y_true = x.to(torch.float64) @ w.to(torch.float64).T
    tiny_x, tiny_w = (float(q.scheme.format.ulp(torch.zeros(1))) for q in (qx, qw))
    return propagated_gemm_bound(ax, qxb, aw, qwb, y_true, _Operand(qx.scheme, *scale_interval(qx), tiny_x),
                                 _Operand(qw.scheme, *scale_interval(qw), tiny_w), bias, out_dtype=out_dtype,
                                 accumulation=accumulation, output_roundings=output_roundings)


@dataclass(frozen=True)
class _Operand:
    """What the end-to-end bound needs of how one operand is quantized: its scheme, the interval
    ``[lo, hi]`` of its stored scales (in ``scheme.scale_shape``, float64) and its format's least
    non-zero magnitude."""

    scheme: QuantScheme
    lo: torch.Tensor
    hi: torch.Tensor
    tiny: float


def _segments_of(K: int, x: _Operand, rows_x: int, w: _Operand, rows_w: int) -> list[tuple[int, int]]:
    """``k_segments`` from the two schemes alone: K ranges on which both scales are constant."""
    _, cx = x.scheme.block_shape(rows_x, K)
    _, cw = w.scheme.block_shape(rows_w, K)
    edges = sorted(set(range(0, K, cx)) | set(range(0, K, cw)) | {K})
    return list(zip(edges[:-1], edges[1:], strict=True))


def propagated_gemm_bound(ax: torch.Tensor, qxb: torch.Tensor, aw: torch.Tensor, qwb: torch.Tensor,
                          y_true: torch.Tensor, x: _Operand, w: _Operand, bias: torch.Tensor | None = None, *,
                          out_dtype: torch.dtype, accumulation: Accumulation,
                          output_roundings: int = 1) -> torch.Tensor:
    """``linear_error_bound``'s inequality for operands known only up to an error: |x| = ``ax``
    [M, K] with any conforming quantization off by at most ``qxb``, |w| = ``aw`` [N, K] likewise
    ``qwb``, scales within ``x``'s and ``w``'s intervals; ``y_true`` the float64 product x w^T.
    Returns the bound on |y_hat - y_true| (``y_true`` without bias; the bias joins it here).
    The MoE bound (``fp8ref.spec.moe_bounds``) feeds it the activation's re-quantized
    intermediate, whose error and scale interval it derives itself.
    """
    K = ax.shape[1]
    prop = (qxb @ aw.T + ax @ qwb.T + qxb @ qwb.T) * (1 + gamma(K, U_FP64))
    true_err = gamma(K, U_FP64) * (ax @ aw.T)
    abias = _abs_bias(bias, y_true)
    if bias is not None:
        y_true = y_true + bias.to(torch.float64)
    bx, bw = ax + qxb, aw + qwb  # |deq(q')| of any conforming quantization
    mass = (bx @ bw.T) * (1 + gamma(K + 2, U_FP64))
    segs = _segments_of(K, x, ax.shape[0], w, aw.shape[0])

    def col(s: torch.Tensor, op: _Operand, rows: int, k: int) -> torch.Tensor:
        r, c = op.scheme.block_shape(rows, K)
        return s[:, k // c].repeat_interleave(r)[:rows]

    def scale_mass() -> torch.Tensor:
        return sum((torch.outer(col(x.hi, x, ax.shape[0], k0), col(w.hi, w, aw.shape[0], k0)) for k0, _ in segs),
                   torch.zeros((), dtype=torch.float64))

    def underflow_mass() -> torch.Tensor | None:
        if not _underflow_possible(x.tiny, w.tiny, float(x.lo.min()), float(w.lo.min())):
            return None
        rows, cols = ax.shape
        cx = torch.clamp(bx / expand_scale(x.lo, x.scheme, rows, cols), min=1) * torch.clamp(
            expand_scale(x.hi, x.scheme, rows, cols), min=1)
        cw = torch.clamp(bw / expand_scale(w.lo, w.scheme, *aw.shape), min=1) * torch.clamp(
            expand_scale(w.hi, w.scheme, *aw.shape), min=1)
        return (cx @ cw.T) * (1 + gamma(K + 2, U_FP64))

    g_rows = 1 + gamma(K + 1, U_FP64)
    pre = _pipeline_error(_Pipeline(mass, abias, K, len(segs), max(k1 - k0 for k0, k1 in segs)), accumulation,
                          out_dtype, output_roundings,
                          row_masses=lambda: (bx.sum(1)[:, None] * g_rows, bw.sum(1)[None, :] * g_rows),
                          scale_mass=scale_mass, underflow_mass=underflow_mass)
    y_abs = y_true.abs() + prop + true_err
    return prop + true_err + pre + unit_roundoff(out_dtype) * (y_abs + pre) + _eta(out_dtype) / 2
