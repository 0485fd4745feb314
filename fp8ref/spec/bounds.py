"""Error bounds derived from floating-point error analysis (docs/spec.md, "Bounds").

Every function returns an elementwise bound as a float64 tensor. Unit roundoffs are written as
powers of two; sums use Higham's gamma_n = n u / (1 - n u) (Accuracy and Stability of Numerical
Algorithms, 2nd ed., Lemma 3.1 and eq. (3.4)), which bounds the relative error of any
product of n factors (1 + delta_i)^{+-1} with |delta_i| <= u, and hence of a sum of n + 1 terms
evaluated in any order: |fl(sum x_i) - sum x_i| <= gamma_n sum |x_i|. When n u >= 1 the bound
is infinite (vacuous), never silently wrong.

Nothing here uses a hand-picked tolerance: each constant is a unit roundoff of a format or a
count of roundings.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from .fenv import flushing, ieee_subnormals
from .gemm import k_segments, scale_column, scaled_mm_exact
from .quant import Quantized, expand_scale
from .schemes import QuantScheme

__all__ = [
    "U_FP64",
    "U_FP32",
    "gamma",
    "Accumulation",
    "PrecisionClass",
    "precision_class",
    "unit_roundoff",
    "quantization_error_bound",
    "scale_error_bound",
    "reference_gemm_error_bound",
    "gemm_error_bound",
    "linear_error_bound",
]

U_FP64 = 2.0**-53  #: unit roundoff of float64
U_FP32 = 2.0**-24  #: unit roundoff of float32
_U = {torch.float64: U_FP64, torch.float32: U_FP32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a float dtype: 2**-p for a p-bit significand (round to nearest)."""
    return _U[dtype]


def _eta(dtype: torch.dtype) -> float:
    """Smallest positive subnormal of ``dtype``: the absolute error of rounding near zero is <= eta/2."""
    return float(torch.finfo(dtype).smallest_normal) * 2.0 * unit_roundoff(dtype)


def gamma(n: int | float, u: float) -> float:
    """Higham's gamma_n(u) = n u / (1 - n u); inf when n u >= 1, 0 when n <= 0 or u == 0."""
    nu = n * u
    if n <= 0 or u == 0:
        return 0.0
    return math.inf if nu >= 1 else nu / (1 - nu)


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
    fast      anything with a lower-precision accumulator (fast accumulation, bf16/fp16).
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


def precision_class(accumulation: Accumulation, output_roundings: int) -> PrecisionClass:
    """The smallest class that contains a backend with this declaration."""
    if output_roundings not in (1, 2):
        raise ValueError(f"output_roundings must be 1 or 2, got {output_roundings}")
    u = accumulation.unit_roundoff
    if u == 0 and output_roundings == 1:
        return PrecisionClass.EXACT
    if u <= U_FP32 and accumulation.promote_every is None and accumulation.operand_dtype is None:
        return PrecisionClass.STRICT if output_roundings == 1 else PrecisionClass.STANDARD
    return PrecisionClass.FAST


def scale_error_bound(reference_scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Elementwise bound on |s - s_ref| for a conforming quantizer's stored scale ``s``.

    ``reference_scale`` is the spec's stored scale (``fp8ref.quantize``) for the same input: the
    bound is computed from it, never from the scale under test.

    Notes
    -----
    A dynamic scale is the quotient ``max(amax, floor) / qmax`` stored in ``scale_dtype``; the spec
    rounds it correctly (once), a conforming quantizer may round it *faithfully* (to either
    neighbour of the exact quotient on the grid of ``scale_dtype``), as ``amax * (1/qmax)`` or a
    quotient computed in a narrower dtype does. A faithful rounding lies within one grid step of
    the correctly rounded one, so with ``ulp(s) = 2^(e - p)`` for ``s = m 2^e``, ``m in [1/2, 1)``,
    and ``p`` the significand bits of ``scale_dtype``::

        |s - s_ref| <= ulp(s_ref)                     dynamic scales
        s = s_ref                                     power-of-two scales (pow2_scale) and static
                                                      schemes (the caller's scale is returned)

    One grid step is the finest tolerance that admits every faithful rounding (the grid leaves
    nothing between 0 and one step) and the coarsest that still rejects a scale off by a rounding
    the spec does not allow (docs/spec.md §5.1). Power-of-two scales are exact because the
    quotient is rounded *up* to a power of two, and neighbouring powers of two differ by a factor
    of 2, not by a rounding.
    """
    if not scheme.dynamic or scheme.pow2_scale:
        return torch.zeros_like(reference_scale, dtype=torch.float64)
    p = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[scheme.scale_dtype]
    _, e = torch.frexp(reference_scale.to(torch.float64))
    return torch.exp2(e.to(torch.float64) - p)


def quantization_error_bound(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Elementwise bound on |dequantize(q) - x| for any conforming quantizer.

    Notes
    -----
    With s the stored scale, v = fl32(x / s) and ulp the FP8 grid spacing::

        |q s - x| <= s ulp(min(|v|, qmax)) / 2  +  gamma_d(u32) |x|  +  max(|x| - qmax s, 0)

    The first term is round-to-nearest on the FP8 grid (normal and subnormal range); the second
    the fp32 evaluation of x / s with d = 2 roundings, which admits x * (1/s) as well as a true
    division (d = 3 for float64 input, which is first rounded to fp32); the third the clamp at
    qmax, non-zero only for saturated elements.
    """
    if flushing():  # the spec computes with subnormals kept (fenv.py)
        with ieee_subnormals():
            return quantization_error_bound(x, q)
    rows, cols = x.shape
    fmt, qmax = q.scheme.format, q.scheme.qmax
    s32 = expand_scale(q.scale.to(torch.float32), q.scheme, rows, cols)
    v = x.to(torch.float32) / s32
    s = s32.to(torch.float64)
    ax = x.to(torch.float64).abs()
    d = 3 if x.dtype == torch.float64 else 2
    half_ulp = fmt.ulp(torch.clamp(v.abs(), max=qmax)) / 2
    return s * half_ulp + gamma(d, U_FP32) * ax + torch.clamp(ax - qmax * s, min=0)


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
    if flushing():  # the spec computes with subnormals kept (fenv.py)
        with ieee_subnormals():
            return reference_gemm_error_bound(a, b, bias)
    mass, n_add = _mass(a, b)
    return _reference_error(len(k_segments(a, b)), n_add, mass, _abs_bias(bias, mass))


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

    A second rounding to the output dtype (``output_roundings=2``: the accumulator or the
    pre-bias value rounded to ``out_dtype`` first) adds u_o (1 + g) P + (eta_o/2)(1 + sum_g |sa sb|)
    (u_o (P + D) for dequantize-then-GEMM).
    The final rounding adds u_o (|y*| + E') + eta_o/2, and |y*| <= |y_ref| + E_ref. Finally the
    reference's own deviation E_ref (``reference_gemm_error_bound``) is added, because the
    comparison is against y_ref, not y*.
    """
    if flushing():  # the spec computes with subnormals kept (fenv.py)
        with ieee_subnormals():
            return gemm_error_bound(a, b, bias, out_dtype=out_dtype, accumulation=accumulation,
                                    output_roundings=output_roundings, y_ref=y_ref)
    if output_roundings not in (1, 2):
        raise ValueError(f"output_roundings must be 1 or 2, got {output_roundings}")
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
    u_acc = accumulation.unit_roundoff
    if accumulation.operand_dtype is not None:
        pre = _operand_rounding_error(a, b, accumulation.operand_dtype, mass, abias)
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
    if output_roundings == 2:
        scale_mass = sum(
            (torch.outer(scale_column(a, k0), scale_column(b, k0)).abs() for k0, _ in segs),
            torch.zeros((), dtype=torch.float64, device=mass.device),
        )
        pre = pre + u_o * inter + (eta_o / 2) * (1 + scale_mass)
    y_abs = y_ref.abs() + e_ref
    return pre + u_o * (y_abs + pre) + eta_o / 2 + e_ref


def _row_mass(q: Quantized) -> torch.Tensor:
    """sum_k |code_k scale_k| per row of ``q`` (float64, exact up to one rounding per term and sum:
    inflated by 1 + gamma_{cols+1}(u64))."""
    rows, cols = q.data.shape
    s = expand_scale(q.scale.to(torch.float64), q.scheme, rows, cols)
    return (q.data.to(torch.float64).abs() * s.abs()).sum(dim=1) * (1 + gamma(cols + 1, U_FP64))


def _operand_rounding_error(a: Quantized, b: Quantized, dtype: torch.dtype, mass: torch.Tensor,
                            abias: torch.Tensor) -> torch.Tensor:
    """E of a dequantize-then-GEMM with operands rounded to ``dtype`` (see ``gemm_error_bound``)."""
    K = a.data.shape[1]
    v = (1 + U_FP32) * (1 + unit_roundoff(dtype)) - 1
    eta = _eta(dtype)
    d = ((1 + v) ** 2 - 1) * mass + eta * (1 + v) * (_row_mass(a)[:, None] + _row_mass(b)[None, :]) + K * eta**2
    return d + gamma(K + 1, U_FP32) * (mass + d + abias)


def linear_error_bound(x: torch.Tensor, w: torch.Tensor, qx: Quantized, qw: Quantized,
                       bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                       accumulation: Accumulation = Accumulation.EXACT,
                       output_roundings: int = 1) -> torch.Tensor:
    """End-to-end bound on |y_hat - y_true|: the quantized linear against the unquantized one.

    ``y_true = x.double() @ w.double().T + bias`` (float64), ``qx``/``qw`` the quantized
    activations and weights the backend used, ``y_hat`` its output.

    Notes
    -----
    With e_x = deq(qx) - x, e_w = deq(qw) - w, |e_x| <= Q_x and |e_w| <= Q_w elementwise
    (``quantization_error_bound``), the exact quantized linear y_q* satisfies::

        |y_q* - y_exact| = |sum_k (x+e_x)(w+e_w) - x w| <= Q_x |w|^T + |x| Q_w^T + Q_x Q_w^T

    (three non-negative float64 GEMMs, inflated by 1 + gamma_{K}(u64) to cover their own
    rounding). The float64 y_true is off y_exact by at most gamma_K(u64) |x| |w|^T (products of
    <= 24-bit significands are exact in float64). Adding the backend's ``gemm_error_bound`` and
    the reference's ``reference_gemm_error_bound`` gives the bound.
    """
    if flushing():  # the spec computes with subnormals kept (fenv.py)
        with ieee_subnormals():
            return linear_error_bound(x, w, qx, qw, bias, out_dtype=out_dtype, accumulation=accumulation,
                                      output_roundings=output_roundings)
    K = x.shape[1]
    ax, aw = x.to(torch.float64).abs(), w.to(torch.float64).abs()
    qxb, qwb = quantization_error_bound(x, qx), quantization_error_bound(w, qw)
    prop = (qxb @ aw.T + ax @ qwb.T + qxb @ qwb.T) * (1 + gamma(K, U_FP64))
    true_err = gamma(K, U_FP64) * (ax @ aw.T)
    gemm = gemm_error_bound(qx, qw, bias, out_dtype=out_dtype, accumulation=accumulation,
                            output_roundings=output_roundings)
    return prop + true_err + gemm + reference_gemm_error_bound(qx, qw, bias)
