"""The error bound of an FP8 MoE layer against the reference (docs/spec.md §7.2): per output
element, through x's quantization, the first GEMM, the gated activation, the re-quantization of
the intermediate, the second GEMM and the top-k combine.

Each stage bounds how far an implementation's value may lie from the reference's own value at
that stage (``fp8ref.spec.moe.moe_trace``), never from a number the implementation reports: the
GEMMs by ``propagated_gemm_bound`` (``linear_error_bound``'s inequality for operands known up to
an error), a quantization by the range of codes any conforming quantizer may give an input known
up to an error with a scale in a derived interval, the rest from unit roundoffs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bounds import (
    U_FP32,
    U_FP64,
    Accumulation,
    _eta,
    _Operand,
    gamma,
    propagated_gemm_bound,
    scale_interval,
    unit_roundoff,
)
from .moe import MoeScheme, MoeTrace, MoeWeights, Routing, check_moe_args, gate_up, moe_trace
from .quant import Quantized, expand_scale, round_to_format
from .schemes import Granularity, QuantScheme

__all__ = ["MoeAccuracy", "REFERENCE_ACCURACY", "SILU_LIPSCHITZ", "ACTIVATION_ROUNDINGS", "moe_error_bound",
           "requantization_deviation"]

#: An upper bound of |silu'(x)| = |s(x)(1 + x(1 - s(x)))|, s the logistic function: its maximum is
#: 1.0998393... at x = 2.3994 (and its minimum -0.0998 at x = -2.3994).
SILU_LIPSCHITZ = 1.1
#: Roundings in an fp32 evaluation of silu(a) * b = a * (1 / (1 + exp(-a))) * b: exp within one ulp
#: (two roundings' worth), the addition, the division, two products. The logistic function passes
#: exp's relative error on at most unchanged (|d log s / d log e| = e / (1 + e) < 1).
ACTIVATION_ROUNDINGS = 6


@dataclass(frozen=True)
class MoeAccuracy:
    """How a MoE implementation computes, as far as its error bound needs it (declared).

    Attributes
    ----------
    accumulation : Accumulation
        Both GEMMs' accumulation along K (and I).
    inter_dtype : torch.dtype
        The first GEMM's output and the activation's output are rounded to it before the
        re-quantization (bf16 in SGLang's and vLLM's fused kernels: their intermediate caches).
    act_unit_roundoff : float
        u of the activation's arithmetic (fp32: 2**-24).
    gemm2_dtype : torch.dtype
        The second GEMM's result is rounded to it before the router weight multiplies it.
    slot_dtype : torch.dtype
        The weighted output of one (token, expert) pair is rounded to it before the combine.
    combine_unit_roundoff : float
        u of the router-weight product and of the top-k sum.
    """

    accumulation: Accumulation = Accumulation.FP32
    inter_dtype: torch.dtype = torch.bfloat16
    act_unit_roundoff: float = U_FP32
    gemm2_dtype: torch.dtype = torch.float32
    slot_dtype: torch.dtype = torch.bfloat16
    combine_unit_roundoff: float = U_FP32

    def short_str(self) -> str:
        d = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
        return (f"{self.accumulation.name}-i{d[self.inter_dtype]}-g{d[self.gemm2_dtype]}-s{d[self.slot_dtype]}")


#: The reference: exact accumulation and float64 everywhere.
REFERENCE_ACCURACY = MoeAccuracy(Accumulation.EXACT, torch.float64, U_FP64, torch.float64, torch.float64, U_FP64)

#: A dynamic scale within this relative distance of max(amax, floor) / qmax: a quotient or a
#: reciprocal of a multiplier, each rounded to fp32 (at most three roundings, gamma_3(u32) < 4 u32).
_SCALE_SLACK = 4 * U_FP32


def _block_max(v: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """max over each of ``scheme``'s blocks of the [S, I] tensor ``v`` (>= 0), in ``scale_shape``."""
    rows, cols = v.shape
    if scheme.granularity is Granularity.TENSOR:
        return v.amax().reshape(1, 1)
    r, c = scheme.block_shape(rows, cols)
    pad = (-cols) % c
    vp = torch.nn.functional.pad(v, (0, pad)) if pad else v
    return vp.reshape(rows, -1, c).amax(dim=2)


def _dynamic_interval(hmax: torch.Tensor, hmin: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, ...]:
    """[lo, hi] of the fp32 dynamic scales of any intermediate h' with hmin <= |h'| <= hmax."""
    tiny = float(torch.finfo(torch.float32).smallest_normal)
    floored_lo = torch.clamp(_block_max(hmin, scheme), min=scheme.amax_floor)
    floored_hi = torch.clamp(_block_max(hmax, scheme), min=scheme.amax_floor)
    # A block that may be all zero (with no floor) may take zero_scale, or any tiny quotient.
    lo = torch.clamp(floored_lo / scheme.qmax * (1 - _SCALE_SLACK), min=_eta(torch.float32))
    hi = torch.clamp(floored_hi / scheme.qmax * (1 + _SCALE_SLACK), min=tiny)
    hi = torch.where(floored_lo == 0, torch.clamp(hi, min=scheme.zero_scale), hi)
    return lo, hi


def _format_tiny(scheme: QuantScheme) -> float:
    return float(scheme.format.ulp(torch.zeros(1)))


def requantization_deviation(h: torch.Tensor, bh: torch.Tensor, scheme: QuantScheme, lo: torch.Tensor,
                             hi: torch.Tensor, ref: Quantized) -> torch.Tensor:
    """Bound on |deq(q') - deq(ref)| elementwise, for every q' a conforming quantizer gives an input
    h' with |h' - h| <= ``bh`` and a stored scale s' in [``lo``, ``hi``] (``scheme.scale_shape``,
    float64); ``ref`` is the spec's quantization of ``h``.

    Notes
    -----
    The codes are RNE(clamp(fl32(h' / s'))), the quotient evaluated with at most three roundings
    (float64 input rounded to fp32, the quotient or a multiplier and a product), so v' = h' / s'
    (1 + d), |d| <= gamma_3(u32). h' / s' lies between the least and greatest of the four corners
    (h -+ bh) / (lo, hi); rounding to fp32, clamping and rounding to the FP8 grid are monotone, so
    q' lies in [c_min, c_max], the images of the widened extreme corners, and q' s' in
    [min(c_min lo, c_min hi), max(c_max lo, c_max hi)]. The bound is the farther end's distance to
    the reference's value. It is 0 where no corner crosses a rounding boundary and the scale is one
    point (static scales, the caller's input), and one grid step where the input may straddle one.
    """
    rows, cols = h.shape
    fmt, qmax = scheme.format, scheme.qmax
    lo_e, hi_e = expand_scale(lo, scheme, rows, cols), expand_scale(hi, scheme, rows, cols)
    h_lo, h_hi = h - bh, h + bh
    corners = torch.stack([h_lo / lo_e, h_lo / hi_e, h_hi / lo_e, h_hi / hi_e])
    g = gamma(3, U_FP32)
    v_min, v_max = corners.amin(0), corners.amax(0)
    v_min, v_max = v_min - g * v_min.abs(), v_max + g * v_max.abs()

    def code(v: torch.Tensor) -> torch.Tensor:
        return round_to_format(v.to(torch.float32), fmt, qmax).to(torch.float64)

    c_min, c_max = code(v_min), code(v_max)
    low = torch.minimum(c_min * lo_e, c_min * hi_e)
    high = torch.maximum(c_max * lo_e, c_max * hi_e)
    z = ref.dequantize(torch.float64)
    return torch.clamp(torch.maximum(high - z, z - low), min=0)


def _scale_range(ref: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] of a conforming stored scale for the caller's input x: the spec's interval
    (``scale_interval``), widened to the reciprocal conventions' three roundings (``_SCALE_SLACK``)."""
    lo, hi = scale_interval(ref)
    if ref.scheme.dynamic:
        lo, hi = lo * (1 - _SCALE_SLACK), hi * (1 + _SCALE_SLACK)
    return lo, hi


def _stage_bounds(tr: MoeTrace, x: torch.Tensor, weights: MoeWeights, scheme: MoeScheme,
                  acc: MoeAccuracy) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bh [S, I], B2 [S, K]): bounds on an implementation's activation output and second GEMM
    output against the reference's h and o (``moe_error_bound``'s Notes, steps 1-4)."""
    S, I = tr.h.shape
    act, inter = scheme.activation, scheme.intermediate
    bh = torch.empty(S, I, dtype=torch.float64)
    g_act = gamma(ACTIVATION_ROUNDINGS, acc.act_unit_roundoff)
    u_i, eta_i = unit_roundoff(acc.inter_dtype), _eta(acc.inter_dtype)
    L = SILU_LIPSCHITZ
    for e, pairs in tr.groups.items():
        q1 = weights.expert(e)[0]
        xr = x[tr.tokens[pairs]].to(torch.float64)
        qx = tr.qx[e]
        lo, hi = _scale_range(qx)
        dx = requantization_deviation(xr, torch.zeros_like(xr), act, lo, hi, qx)
        w13 = q1.dequantize(torch.float64)
        s13 = q1.scale.to(torch.float64)
        b1 = propagated_gemm_bound(qx.dequantize(torch.float64).abs(), dx, w13.abs(), torch.zeros_like(w13),
                                   tr.g[pairs], _Operand(act, lo, hi, _format_tiny(act)),
                                   _Operand(q1.scheme, s13, s13, _format_tiny(q1.scheme)),
                                   out_dtype=acc.inter_dtype, accumulation=acc.accumulation)
        ga, gb = gate_up(tr.g[pairs], scheme.order)
        ba, bb = gate_up(b1, scheme.order)
        sa = torch.nn.functional.silu(ga)
        hm = (sa.abs() + L * ba) * (gb.abs() + bb)
        dh = L * ba * (gb.abs() + bb) + sa.abs() * bb + gamma(ACTIVATION_ROUNDINGS + 1, U_FP64) * tr.h[pairs].abs()
        bh[pairs] = dh + g_act * hm + u_i * (1 + g_act) * hm + eta_i / 2
    if inter.dynamic:
        lo_all, hi_all = _dynamic_interval(tr.h.abs() + bh, torch.clamp(tr.h.abs() - bh, min=0), inter)
    b2 = torch.empty(S, tr.o.shape[1], dtype=torch.float64)
    for e, pairs in tr.groups.items():
        q2 = weights.expert(e)[1]
        qh = tr.qh[e]
        if not inter.dynamic:
            lo = hi = weights.a2_scale[e].to(torch.float64).reshape(1, 1)
        elif inter.granularity is Granularity.TENSOR:
            lo, hi = lo_all, hi_all
        else:
            lo, hi = lo_all[pairs], hi_all[pairs]
        dz = requantization_deviation(tr.h[pairs], bh[pairs], inter, lo, hi, qh)
        w2 = q2.dequantize(torch.float64)
        s2 = q2.scale.to(torch.float64)
        b2[pairs] = propagated_gemm_bound(qh.dequantize(torch.float64).abs(), dz, w2.abs(), torch.zeros_like(w2),
                                          tr.o[pairs], _Operand(inter, lo, hi, _format_tiny(inter)),
                                          _Operand(q2.scheme, s2, s2, _format_tiny(q2.scheme)),
                                          out_dtype=acc.gemm2_dtype, accumulation=acc.accumulation)
    return bh, b2


def moe_error_bound(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme, *,
                    accuracy: MoeAccuracy = MoeAccuracy(), out_dtype: torch.dtype = torch.bfloat16,
                    trace: MoeTrace | None = None) -> torch.Tensor:
    """Bound [T, K] on |y_hat - y_ref|: y_ref the reference's float64 result
    (``fp8ref.spec.moe.moe_exact``), y_hat an implementation's, computed as ``accuracy`` declares and
    rounded to ``out_dtype``. Pass the reference's ``trace`` (``moe_trace``) if you have it.

    Notes
    -----
    Per routed pair (token t, expert e), against the reference's values at each step:

    1. x: the implementation's dequantized x' differs from the spec's by at most dx
       (``requantization_deviation`` of x itself, scales in the spec's interval widened by
       4 u32 for the reciprocal conventions): 0 for static scales.
    2. |g' - g| <= B1 = ``propagated_gemm_bound`` of (|deq(q_x)|, dx) times the exact expert
       weights, rounded to ``inter_dtype`` (g the reference's first GEMM).
    3. With L = ``SILU_LIPSCHITZ`` and a, b the gate and up halves of g (by ``order``),
       Hm = (|silu(a)| + L B1a)(|b| + B1b)::

           |h' - h| <= Bh = L B1a (|b| + B1b) + |silu(a)| B1b + gamma_7(u64) |h|
                           + gamma_6(u_act) Hm + u_i (1 + gamma_6(u_act)) Hm + eta_i / 2

       (the activation evaluated with ``ACTIVATION_ROUNDINGS`` roundings and rounded to
       ``inter_dtype``; gamma_7(u64) the reference's own float64 silu).
    4. The re-quantized intermediate: a dynamic scale lies in [max(amax_lo, floor) / qmax
       (1 - 4 u32), max(amax_hi, floor) / qmax (1 + 4 u32)], amax_lo/hi the block maxima of
       max(|h| - Bh, 0) and |h| + Bh (the expert's scale where static); the dequantized
       intermediate then differs from the reference's by at most dz
       (``requantization_deviation``), and |o' - o| <= B2 = ``propagated_gemm_bound`` of
       (|deq(q_h)|, dz) times the exact w2, rounded to ``gemm2_dtype``.
    5. The combine: v_j = w_j o'_j with one rounding in ``combine_unit_roundoff`` and one to
       ``slot_dtype``: |v_j - w_j o_j| <= Bv = |w| B2 + ((1 + u_c)(1 + u_s) - 1) |w| (|o| + B2)
       + eta_s / 2; the top-k sum adds gamma_{k-1}(u_c) sum_j V_j with V_j = |w|(|o| + B2) + Bv,
       the output rounding u_o (1 + gamma_{k-1}(u_c)) sum_j V_j + eta_o / 2, and the reference's
       own float64 product and sum gamma_{k+1}(u64) sum_j |w_j o_j|.
    """
    check_moe_args(x, weights, routing, scheme, out_dtype)
    tr = moe_trace(x, weights, routing, scheme) if trace is None else trace
    T, K = x.shape
    eta_o = _eta(out_dtype)
    if tr.tokens.numel() == 0:
        return torch.full((T, K), eta_o / 2, dtype=torch.float64)
    acc = accuracy
    _, b2 = _stage_bounds(tr, x, weights, scheme, acc)
    u_c, u_s, eta_s = acc.combine_unit_roundoff, unit_roundoff(acc.slot_dtype), _eta(acc.slot_dtype)
    aw = routing.weights[tr.tokens, tr.slots].to(torch.float64).abs()[:, None]
    vmax = aw * (tr.o.abs() + b2)
    bv = aw * b2 + ((1 + u_c) * (1 + u_s) - 1) * vmax + eta_s / 2
    k = routing.ids.shape[1]
    g_sum = gamma(k - 1, u_c)

    def per_token(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(T, K, dtype=torch.float64).index_add_(0, tr.tokens, v)

    sum_v = per_token(vmax + bv)
    bound = per_token(bv) + g_sum * sum_v + unit_roundoff(out_dtype) * (1 + g_sum) * sum_v + eta_o / 2
    return bound + gamma(k + 1, U_FP64) * per_token(aw * tr.o.abs())
