"""The MoE check: one backend, one MoE problem, the verdict (docs/spec.md §7).

``check_moe_problem`` runs a ``MoeBackend`` on a ``MoeProblem`` and judges its output against the
reference's float64 result within ``moe_error_bound`` for the backend's declared accuracy, through
``fp8ref.spec.compare``. It checks the calling contract too: the inputs are unchanged after the call,
a second call returns the same bits (state kept between calls), and so does a call on x as a strided
view between poisoned columns. The conformance driver
(``fp8ref.conformance.moe``) and the selector's MoE probe (``fp8ref.select.moe``) both run it.

``build_problem`` makes a problem from a small readable description (``MoeSpec``), so that a
Hypothesis draw, a sweep item and a probe item are the same kind of thing; ``probe_specs`` lists the
probe's items for a scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..registry import MoeBackend
from ..spec.compare import compare, compare_bits
from ..spec.moe import MoeScheme, MoeWeights, Routing, moe_trace, quantize_experts
from ..spec.moe_bounds import moe_error_bound
from .common import ContractViolation, Declined

__all__ = ["MoeSpec", "MoeProblem", "build_problem", "check_moe_problem", "probe_specs"]


@dataclass(frozen=True)
class MoeSpec:
    """A MoE problem in words: sizes, routing pattern and scale pattern (all deterministic in ``seed``).

    Attributes
    ----------
    tokens, hidden, inter, experts, top_k : int
        T, K, I, E, k.
    routing : str
        ``random``; ``skewed`` (every token's first choice is expert 0: the other experts get few or
        no tokens); ``repeat`` (each token's top-k repeats one expert); ``one`` (a single token per
        used expert); ``empty`` (the last half of the experts get no token).
    expert_map : str
        ``none``; ``ep`` (this rank holds the middle experts of 2E global ones: ids at both edges of
        the global range, and the rank's offset); ``shared`` (the last local expert is a shared
        expert every token is routed to with weight 1, appended as top-k slot k-1).
    spread : float
        log2 of the ratio between the experts' weight magnitudes (0: all alike): static scales that
        differ between experts, and experts whose activations differ.
    outlier_rows : bool
        Every third token scaled by 2**6 (per-tensor scales set by outliers; rank-local ones not).
    one_static_scale : bool
        Static schemes: every expert gets the same scale (the largest calibrated one), as the
        projects load per-expert checkpoint scales for kernels that read one scalar.
    seed : int
    order : str
    """

    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: str = "random"
    expert_map: str = "none"
    spread: float = 0.0
    outlier_rows: bool = False
    one_static_scale: bool = False
    seed: int = 0
    order: str = "gate_up"

    def short_str(self) -> str:
        extra = "".join([f"-{self.routing}", f"-{self.expert_map}" if self.expert_map != "none" else "",
                         f"-spread{self.spread:g}" if self.spread else "", "-outliers" if self.outlier_rows else "",
                         "-onescale" if self.one_static_scale else ""])
        return f"T{self.tokens}K{self.hidden}I{self.inter}E{self.experts}k{self.top_k}{extra}-s{self.seed}"


@dataclass(frozen=True)
class MoeProblem:
    """The tensors of one MoE problem, and the spec it was built from."""

    spec: MoeSpec
    x: torch.Tensor
    weights: MoeWeights
    routing: Routing
    scheme: MoeScheme
    out_dtype: torch.dtype = torch.bfloat16
    label: str = field(default="", compare=False)


def _routing(s: MoeSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    T, E, k = s.tokens, s.experts, s.top_k
    n_route = E - 1 if s.expert_map == "shared" and E > 1 else E
    k_route = k - 1 if s.expert_map == "shared" and k > 1 else k
    if s.routing == "empty":
        ids = torch.randint(0, max(1, n_route // 2), (T, k_route), generator=gen)
    elif s.routing == "one":
        ids = (torch.arange(T * k_route).reshape(T, k_route) % n_route)
    else:
        ids = torch.randint(0, n_route, (T, k_route), generator=gen)
    if s.routing == "skewed":
        ids[:, 0] = 0
    if s.routing == "repeat":
        ids[:] = ids[:, :1]
    w = torch.rand(T, k_route, generator=gen) + 0.25
    if s.expert_map == "shared" and k > 1 and E > 1:
        ids = torch.cat([ids, torch.full((T, 1), E - 1)], dim=1)
        w = torch.cat([w, torch.ones(T, 1)], dim=1)
    emap = None
    if s.expert_map == "ep":  # 2E global experts, this rank holds E..: the global ids E-1.. (offset E // 2)
        off = E // 2
        emap = torch.full((2 * E,), -1, dtype=torch.int64)
        emap[off:off + E] = torch.arange(E)
        ids = ids + off
        # and some pairs to the edges of the global range, which live elsewhere
        edge = torch.rand(T, ids.shape[1], generator=gen) < 0.25
        edge[0, -1] = True  # at least one pair to an expert of another rank
        ids = torch.where(edge, torch.where(torch.rand(T, ids.shape[1], generator=gen) < 0.5, 0, 2 * E - 1), ids)
    return ids, w, emap


def build_problem(s: MoeSpec, scheme: MoeScheme, out_dtype: torch.dtype = torch.bfloat16) -> MoeProblem:
    """The tensors of ``s`` under ``scheme``: weights quantized per expert (static schemes get
    per-expert scales from the spec's dynamic rule on the expert's own inputs, so they differ where
    the experts do)."""
    gen = torch.Generator().manual_seed(s.seed)
    T, K, I, E = s.tokens, s.hidden, s.inter, s.experts
    mags = torch.exp2(torch.linspace(0, s.spread, E)) if E > 1 else torch.ones(1)
    w13 = torch.randn(E, 2 * I, K, generator=gen) * (mags[:, None, None] / math.sqrt(K))
    w2 = torch.randn(E, K, I, generator=gen) * (mags[:, None, None] / math.sqrt(I))
    # output channels 2**[-2, 2] apart (channel outliers): neighbouring weight blocks get scales that differ
    w13 = w13 * torch.exp2(torch.rand(E, 2 * I, 1, generator=gen) * 4 - 2)
    w2 = w2 * torch.exp2(torch.rand(E, K, 1, generator=gen) * 4 - 2)
    x = torch.randn(T, K, generator=gen)
    if s.outlier_rows:
        x[::3] *= 64
    x = x.to(torch.bfloat16)
    ids, rw, emap = _routing(s, gen)
    wscheme = scheme.weight.with_(dynamic=True) if not scheme.weight.dynamic else scheme.weight
    qw = quantize_experts(w13, w2, wscheme)
    qw = MoeWeights(qw.w13, qw.w13_scale, qw.w2, qw.w2_scale, scheme.weight)
    a1 = a2 = None
    routing = Routing(ids, rw, emap)
    if not scheme.activation.dynamic or not scheme.intermediate.dynamic:
        # Static scales as a calibration would set them: amax of each expert's own inputs / qmax.
        dyn = MoeScheme(scheme.weight, scheme.activation.with_(dynamic=True), scheme.intermediate.with_(dynamic=True),
                        s.order)
        tr = moe_trace(x, qw, routing, dyn)
        a1, a2 = torch.empty(E), torch.empty(E)
        for e in range(E):
            pairs = tr.groups.get(e)
            ax = x.float().abs().amax() if pairs is None else x[tr.tokens[pairs]].float().abs().amax()
            ah = torch.tensor(1.0) if pairs is None else tr.h[pairs].abs().amax()
            a1[e] = max(float(ax), 1e-6) / scheme.activation.qmax
            a2[e] = max(float(ah), 1e-6) / scheme.intermediate.qmax
        if s.one_static_scale:
            a1, a2 = a1.max().expand(E).clone(), a2.max().expand(E).clone()
        qw = MoeWeights(qw.w13, qw.w13_scale, qw.w2, qw.w2_scale, scheme.weight,
                        None if scheme.activation.dynamic else a1, None if scheme.intermediate.dynamic else a2)
    return MoeProblem(s, x, qw, routing, MoeScheme(scheme.weight, scheme.activation, scheme.intermediate, s.order),
                      out_dtype, s.short_str())


def _clone(p: MoeProblem) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    w, r = p.weights, p.routing
    ts = [p.x, w.w13, w.w13_scale, w.w2, w.w2_scale, r.ids, r.weights]
    ts += [t for t in (w.a1_scale, w.a2_scale, r.expert_map) if t is not None]
    return [t.clone() for t in ts], ts


def check_moe_problem(backend: MoeBackend, p: MoeProblem) -> float:
    """The worst error/bound ratio of ``backend`` on ``p``; raises ``Declined`` when the backend
    declines the scheme, ``ContractViolation`` (with the verdict's message) when an element lies
    outside ``moe_error_bound``, an input changed, or a second call -- or a call on x as a strided view
    (leading dimension K + 2, poisoned columns around it) -- differs in its bits."""
    reason = backend.available() or backend.supports(p.scheme, p.out_dtype)
    if reason:
        raise Declined(reason)
    copies, originals = _clone(p)
    tr = moe_trace(p.x, p.weights, p.routing, p.scheme)
    y = backend.moe(p.x, p.weights, p.routing, p.scheme, p.out_dtype)
    for c, o in zip(copies, originals, strict=True):
        if not compare_bits("input", o, c).ok:
            raise ContractViolation(f"{backend.name} on {p.label}: the call changed an input "
                                    f"({tuple(o.shape)} {o.dtype})")
    bound = moe_error_bound(p.x, p.weights, p.routing, p.scheme, accuracy=backend.accuracy, out_dtype=p.out_dtype,
                            trace=tr)
    verdict = compare(f"{backend.name} moe on {p.label} [{p.scheme.short_str()}]", y, tr.y, bound,
                      dtype=p.out_dtype)
    if not verdict.ok:
        raise ContractViolation(verdict.message())
    again = backend.moe(p.x, p.weights, p.routing, p.scheme, p.out_dtype)
    same = compare_bits(f"{backend.name} moe called twice on {p.label}", again, y)
    if not same.ok:
        raise ContractViolation(same.message())
    # x as a view with a leading dimension larger than K, between poisoned columns
    T, K = p.x.shape
    wide = torch.full((T, K + 2), float("nan"), dtype=p.x.dtype)
    view = wide[:, 1:K + 1]
    view.copy_(p.x)
    strided = compare_bits(f"{backend.name} moe on a strided view of x, {p.label}",
                           backend.moe(view, p.weights, p.routing, p.scheme, p.out_dtype), y)
    if not strided.ok:
        raise ContractViolation(strided.message())
    return verdict.ratio


def probe_specs(scheme: MoeScheme) -> list[MoeSpec]:
    """The selector's probe items: small, adversarial (empty and one-token experts, a repeated
    expert, outlier rows, expert scales apart by 2**4), K and I past one 128-block."""
    return [MoeSpec(5, 136, 72, 4, 2, routing="empty", spread=4.0, outlier_rows=True, seed=1, order=scheme.order),
            MoeSpec(3, 40, 24, 3, 2, routing="repeat", expert_map="shared", seed=2, order=scheme.order)]
