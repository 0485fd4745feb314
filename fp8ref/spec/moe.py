"""The reference FP8 mixture-of-experts layer: a grouped scaled GEMM, the gated activation, the
re-quantized intermediate and the top-k combine (docs/spec.md §7).

For a token t routed to the experts ``ids[t, j]`` with router weights ``w[t, j]`` (j < top-k), and
an expert e with FP8 weights ``w13[e]`` [2I, K] (gate and up projections stacked) and ``w2[e]``
[K, I]::

    g     = scaled_mm(Q_a(x)[t], w13[e])             [2I]   exact accumulation (spec.gemm)
    gate, up = g[:I], g[I:]   (order "gate_up"; "up_gate" swaps the halves)
    h     = silu(gate) * up                          [I]    float64
    o     = scaled_mm(Q_i(h), w2[e])                 [K]    exact accumulation
    y[t]  = sum over j of  w[t, j] * o_j             [K]    float64, rounded once to out_dtype

``Q_a`` quantizes x under the activation scheme: a dynamic scale is computed over the whole
``x`` [T, K] (per tensor: one amax over all T tokens, as the fused kernels do before routing; per
token; per 1 x G group), a static one is the expert's own ``a1_scale[e]``. ``Q_i`` re-quantizes the
intermediate rows of every routed (token, expert) pair: per tensor over all of them, per row, per
group, or static ``a2_scale[e]``. The float64 intermediate is rounded to fp32 by the quantizer
(``quantize`` does so for float64 input) and nowhere else; real kernels round the first GEMM's
output and the activation's to bf16 before re-quantizing, which their declaration states and the
bound (``moe_bounds``) admits.

Expert-parallel ranks hold a slice of the experts: ``expert_map`` (global id -> local index, -1
where the expert lives elsewhere) makes a non-local pair contribute nothing. A pair's id may repeat
within a token's top-k: each occurrence is a term of the combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import OUT_DTYPES, scaled_mm_exact
from .quant import Quantized, check_float_input, quantize
from .schemes import Granularity, QuantScheme

__all__ = ["ORDERS", "MoeScheme", "MoeWeights", "Routing", "MoeTrace", "quantize_experts", "moe_exact", "moe_trace",
           "moe_reference", "local_pairs", "gate_up", "check_moe_args"]

#: Which half of the first GEMM's 2I outputs is the gate: SGLang's and vLLM's ``silu_and_mul``
#: take ``silu(x[..., :I]) * x[..., I:]`` ("gate_up", w13 = [w1 (gate); w3 (up)]); vLLM's
#: ``MulAndSilu`` takes ``x[..., :I] * silu(x[..., I:])`` ("up_gate").
ORDERS = ("gate_up", "up_gate")


@dataclass(frozen=True)
class MoeScheme:
    """How an FP8 MoE layer quantizes: weights (both projections, per expert), the activations x and
    the re-quantized intermediate, and which half of w13 is the gate.

    A static activation or intermediate scheme must be per tensor: its scales are one per expert
    (``MoeWeights.a1_scale``/``a2_scale``). Dynamic ones are per tensor, per row or per 1 x G group,
    with fp32 scales (the bound's scale interval, docs/spec.md §7.2, is derived for fp32).
    """

    weight: QuantScheme
    activation: QuantScheme
    intermediate: QuantScheme
    order: str = "gate_up"

    def __post_init__(self) -> None:
        for what in ("weight", "activation", "intermediate"):
            if not isinstance(getattr(self, what), QuantScheme):
                raise TypeError(f"MoeScheme.{what} must be a QuantScheme, got {type(getattr(self, what)).__name__}")
        if self.order not in ORDERS:
            raise ValueError(f"MoeScheme.order must be one of {ORDERS}, got {self.order!r}")
        if self.weight.granularity is Granularity.GROUP:
            raise ValueError("MoeScheme.weight: per-group weights are not an FP8 MoE layout; use tensor, row or block")
        for what in ("activation", "intermediate"):
            s = getattr(self, what)
            if s.granularity is Granularity.BLOCK:
                raise ValueError(f"MoeScheme.{what}: activations are scaled per tensor, row or 1 x G group, not "
                                 f"{s.short_str()}")
            if not s.dynamic and s.granularity is not Granularity.TENSOR:
                raise ValueError(f"MoeScheme.{what}: a static scheme is per tensor (one scale per expert), got "
                                 f"{s.short_str()}")
            if s.scale_dtype != torch.float32 or s.pow2_scale or s.multiplier_scale:
                raise ValueError(f"MoeScheme.{what}: fp32 dequantization scales without pow2_scale (the MoE "
                                 f"bound's scale interval assumes them), got {s.short_str()}")

    def short_str(self) -> str:
        return (f"w[{self.weight.short_str()}]-a[{self.activation.short_str()}]-"
                f"i[{self.intermediate.short_str()}]-{self.order}")


@dataclass(frozen=True)
class MoeWeights:
    """The experts' FP8 weights and static activation scales.

    Attributes
    ----------
    w13 : torch.Tensor
        [E, 2I, K] FP8 codes, the gate and up projections stacked (``MoeScheme.order`` says which
        half is the gate).
    w13_scale : torch.Tensor
        [E, *scheme.scale_shape(2I, K)] dequantization scales.
    w2 : torch.Tensor
        [E, K, I] FP8 codes of the down projection.
    w2_scale : torch.Tensor
        [E, *scheme.scale_shape(K, I)].
    scheme : QuantScheme
        The weights' scheme (``MoeScheme.weight``).
    a1_scale, a2_scale : torch.Tensor or None
        [E] static dequantization scales of x and of the intermediate (static schemes only).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    scheme: QuantScheme
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(f"w13 must be [E, 2I, K] and w2 [E, K, I], got {tuple(self.w13.shape)} and "
                             f"{tuple(self.w2.shape)}")
        E, two_i, K = self.w13.shape
        if two_i % 2 or two_i == 0:
            raise ValueError(f"w13 has {two_i} rows per expert: it stacks gate and up, 2I with I >= 1")
        if tuple(self.w2.shape) != (E, K, two_i // 2):
            raise ValueError(f"w2 must be [E, K, I] = {(E, K, two_i // 2)} for w13 {tuple(self.w13.shape)}, got "
                             f"{tuple(self.w2.shape)}")
        for what, s in (("a1_scale", self.a1_scale), ("a2_scale", self.a2_scale)):
            if s is not None and (s.dim() != 1 or s.shape[0] != E or not s.is_floating_point()):
                raise ValueError(f"{what} must be a float [E] = [{E}] tensor of per-expert scales, got "
                                 f"{s.dtype} {tuple(s.shape)}")
        if E:
            self.expert(0)  # checks the codes' dtype and the scales' shape

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    def expert(self, e: int) -> tuple[Quantized, Quantized]:
        """Expert ``e``'s (w13 [2I, K], w2 [K, I]) as Quantized operands."""
        return (Quantized(self.w13[e], self.w13_scale[e], self.scheme),
                Quantized(self.w2[e], self.w2_scale[e], self.scheme))


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme, *,
                     a1_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None) -> MoeWeights:
    """Quantize float expert weights ``w13`` [E, 2I, K] and ``w2`` [E, K, I] expert by expert under
    ``scheme`` (a dynamic scheme: each expert's scales from its own weights)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, K] and w2 [E, K, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    q13 = [quantize(w13[e], scheme) for e in range(w13.shape[0])]
    q2 = [quantize(w2[e], scheme) for e in range(w2.shape[0])]
    return MoeWeights(torch.stack([q.data for q in q13]), torch.stack([q.scale for q in q13]),
                      torch.stack([q.data for q in q2]), torch.stack([q.scale for q in q2]), scheme,
                      a1_scale, a2_scale)


@dataclass(frozen=True)
class Routing:
    """The router's top-k choice: ``ids`` [T, k] (int) and ``weights`` [T, k] (float), and on an
    expert-parallel rank ``expert_map`` [E_global] (global id -> local index, -1 elsewhere)."""

    ids: torch.Tensor
    weights: torch.Tensor
    expert_map: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Routing.ids must be an int [T, k] tensor, got {self.ids.dtype} {tuple(self.ids.shape)}")
        if tuple(self.weights.shape) != tuple(self.ids.shape) or not self.weights.is_floating_point():
            raise ValueError(f"Routing.weights must be a float tensor shaped like ids {tuple(self.ids.shape)}, got "
                             f"{self.weights.dtype} {tuple(self.weights.shape)}")
        if self.ids.shape[1] < 1:
            raise ValueError("Routing.ids has top-k = 0: each token needs at least one expert")
        if self.weights.numel() and not bool(torch.isfinite(self.weights).all()):
            raise ValueError("Routing.weights contains NaN/Inf")
        if self.expert_map is not None and (self.expert_map.dim() != 1
                                            or self.expert_map.dtype not in (torch.int32, torch.int64)):
            raise ValueError("Routing.expert_map must be an int [E_global] tensor")


def local_pairs(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, local expert) of every routed pair this rank computes, in token-major order.

    Raises ``ValueError`` naming the offending id when an id lies outside ``[0, E_global)`` (or
    ``[0, E)`` without an expert map) or the map names a local index outside ``[-1, E)``.
    """
    ids = routing.ids.to(torch.int64)
    n_global = num_experts if routing.expert_map is None else routing.expert_map.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_global):
        bad = ids[(ids < 0) | (ids >= n_global)][0]
        raise ValueError(f"Routing.ids holds expert id {int(bad)} outside [0, {n_global})")
    local = ids
    if routing.expert_map is not None:
        emap = routing.expert_map.to(torch.int64)
        if emap.numel() and (int(emap.min()) < -1 or int(emap.max()) >= num_experts):
            raise ValueError(f"Routing.expert_map must map to [-1, {num_experts}), got values in "
                             f"[{int(emap.min())}, {int(emap.max())}]")
        local = emap[ids]
    t, j = torch.nonzero(local >= 0, as_tuple=True)
    return t, j, local[t, j]


def gate_up(g: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the first GEMM's [.., 2I] output into (gate, up) by ``order``."""
    i = g.shape[-1] // 2
    first, second = g[..., :i], g[..., i:]
    return (first, second) if order == "gate_up" else (second, first)


def _rows(q: Quantized, rows: torch.Tensor) -> Quantized:
    """The rows ``rows`` of a row-, group- or tensor-scaled Quantized."""
    scale = q.scale if q.scheme.granularity is Granularity.TENSOR else q.scale[rows]
    return Quantized(q.data[rows], scale, q.scheme)


def check_moe_args(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme,
                   out_dtype: torch.dtype) -> None:
    """The argument checks of ``moe_reference`` (backends reuse them for the same messages)."""
    if not isinstance(weights, MoeWeights) or not isinstance(routing, Routing) or not isinstance(scheme, MoeScheme):
        raise TypeError("moe takes weights=MoeWeights, routing=Routing and scheme=MoeScheme")
    check_float_input(x)
    if x.shape[1] != weights.hidden_size:
        raise ValueError(f"x is [T, K] = {tuple(x.shape)} but the experts take K = {weights.hidden_size}")
    if routing.ids.shape[0] != x.shape[0]:
        raise ValueError(f"Routing.ids has {routing.ids.shape[0]} rows for {x.shape[0]} tokens")
    if weights.scheme != scheme.weight:
        raise ValueError(f"weights were quantized as {weights.scheme.short_str()}, the scheme says "
                         f"{scheme.weight.short_str()}")
    for what, s, st in (("a1_scale", scheme.activation, weights.a1_scale),
                        ("a2_scale", scheme.intermediate, weights.a2_scale)):
        if not s.dynamic and st is None:
            raise ValueError(f"static scheme {s.short_str()} needs MoeWeights.{what} (one scale per expert)")
        if s.dynamic and st is not None:
            raise ValueError(f"MoeWeights.{what} is given but the scheme {s.short_str()} is dynamic")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")


@dataclass(frozen=True)
class MoeTrace:
    """The reference's intermediate values, for the bound (``moe_bounds``): the routed pairs
    (token, slot, local expert), each expert's pairs, each pair's quantized x rows and quantized
    intermediate (per expert), the first GEMM's float64 output g [S, 2I], the intermediate h
    [S, I], the second GEMM's float64 output o [S, K], and y [T, K] before the output rounding."""

    y: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor
    experts: torch.Tensor
    groups: dict
    qx: dict
    qh: dict
    g: torch.Tensor
    h: torch.Tensor
    o: torch.Tensor


def moe_trace(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme) -> MoeTrace:
    """The reference MoE layer in float64, with its intermediates (see the module docstring)."""
    check_moe_args(x, weights, routing, scheme, torch.float64)
    T, K = x.shape
    I = weights.intermediate_size
    tokens, slots, experts = local_pairs(routing, weights.num_experts)
    S = tokens.numel()
    dev = x.device
    y = torch.zeros(T, K, dtype=torch.float64, device=dev)
    g = torch.empty(S, 2 * I, dtype=torch.float64, device=dev)
    h = torch.empty(S, I, dtype=torch.float64, device=dev)
    o = torch.empty(S, K, dtype=torch.float64, device=dev)
    groups = {int(e): torch.nonzero(experts == e).flatten() for e in torch.unique(experts)}
    act, inter = scheme.activation, scheme.intermediate
    qx_all = quantize(x, act) if act.dynamic and S else None
    qx, qh = {}, {}
    for e, pairs in groups.items():
        rows = tokens[pairs]
        qx[e] = _rows(qx_all, rows) if qx_all is not None else quantize(x[rows], act, weights.a1_scale[e])
        g[pairs], _ = scaled_mm_exact(qx[e], weights.expert(e)[0])
        gate, up = gate_up(g[pairs], scheme.order)
        h[pairs] = torch.nn.functional.silu(gate) * up
    qh_all = quantize(h, inter) if inter.dynamic and S else None
    for e, pairs in groups.items():
        qh[e] = _rows(qh_all, pairs) if qh_all is not None else quantize(h[pairs], inter, weights.a2_scale[e])
        o[pairs], _ = scaled_mm_exact(qh[e], weights.expert(e)[1])
    if S:
        y.index_add_(0, tokens, o * routing.weights[tokens, slots].to(torch.float64)[:, None])
    return MoeTrace(y, tokens, slots, experts, groups, qx, qh, g, h, o)


def moe_exact(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme) -> torch.Tensor:
    """The reference MoE layer's float64 result [T, K], before the output rounding: each pair's
    output times its router weight (one float64 rounding), summed over the top-k in token order."""
    return moe_trace(x, weights, routing, scheme).y


def moe_reference(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The reference FP8 MoE layer: ``moe_exact`` rounded once to ``out_dtype``.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.moe import MoeScheme, Routing, moe_reference, quantize_experts
    >>> from fp8ref.spec.schemes import QuantScheme
    >>> s = QuantScheme(granularity="tensor")
    >>> scheme = MoeScheme(weight=s, activation=s, intermediate=s)
    >>> w = quantize_experts(torch.ones(2, 4, 3), torch.ones(2, 3, 2), s)
    >>> r = Routing(torch.tensor([[1]]), torch.tensor([[0.5]]))
    >>> moe_reference(torch.ones(1, 3), w, r, scheme, torch.float32).shape
    torch.Size([1, 3])
    """
    check_moe_args(x, weights, routing, scheme, out_dtype)
    return moe_exact(x, weights, routing, scheme).to(out_dtype)
