"""The MoE catalogue: broken FP8 MoE layers, each modelled on a real upstream bug, and correct
variants that compute differently; ``fp8ref.conformance.moe.check_moe`` must reject every mutant
and accept every variant (test_moe_mutants.py).

Every backend starts from ``MoeBase``: a padded, block-aligned grouped layout like the fused
Triton kernels' (``moe_align_block_size``: each expert's pairs padded to a multiple of ``BLOCK``
rows, padding rows poisoned), the spec's quantizer, fp32 grouped GEMMs, SiLU-and-mul in fp32 and
an fp32 top-k sum; each class changes one step.
"""

from __future__ import annotations

import torch

from fp8ref.kernels.moe import grouped_scaled_mm
from fp8ref.registry import MoeBackend
from fp8ref.spec.bounds import U_FP32, Accumulation
from fp8ref.spec.moe import MoeScheme, MoeWeights, Routing, check_moe_args, local_pairs
from fp8ref.spec.moe_bounds import MoeAccuracy
from fp8ref.spec.quant import Quantized, quantize
from fp8ref.spec.schemes import Granularity

#: Rows of one block of the padded grouped layout (the Triton kernels' BLOCK_SIZE_M).
BLOCK = 16
#: What a padding row holds: stale data from an earlier batch, large enough to move a scale.
POISON = 3.0e4
FP32_ACCURACY = MoeAccuracy(Accumulation.FP32, torch.float32, U_FP32, torch.float32, torch.float32, U_FP32)


def _rows(q: Quantized, rows: torch.Tensor) -> Quantized:
    return Quantized(q.data[rows], q.scale if q.scheme.granularity is Granularity.TENSOR else q.scale[rows], q.scheme)


class MoeBase(MoeBackend):
    """The correct base (fp32 declaration); the hooks below are what mutants change."""

    name = "moe-base"
    accuracy = FP32_ACCURACY
    upstream = ""
    bug = ""

    # -- hooks -------------------------------------------------------------------------------
    def pairs(self, routing: Routing, E: int):
        return local_pairs(routing, E)

    def expert_of_group(self, e: int, used: list[int]) -> int:
        """Which expert's weights the group of expert ``e``'s pairs is multiplied with."""
        return e

    def gate_up(self, g: torch.Tensor, order: str):
        i = g.shape[-1] // 2
        return (g[:, :i], g[:, i:]) if order == "gate_up" else (g[:, i:], g[:, :i])

    def x_scale_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of x a dynamic per-tensor activation scale is computed over."""
        return x

    def static_a1(self, weights: MoeWeights, e: int) -> torch.Tensor:
        return weights.a1_scale[e]

    def input_weight(self, x_rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x_rows

    def output_weight(self, o: torch.Tensor, w: torch.Tensor, wt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return o * w[:, None]

    def weights_for(self, weights: MoeWeights, e: int) -> tuple[Quantized, Quantized]:
        return weights.expert(e)

    def round_h(self, h: torch.Tensor) -> torch.Tensor:
        """The activation's output as stored in the intermediate buffer."""
        return h

    def q(self, scheme):
        """The scheme the layer's quantizer runs (a convention within the spec's bound)."""
        return scheme

    def padded_amax_rows(self, h_padded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The rows of the padded intermediate a per-tensor dynamic scale is computed over."""
        return h_padded[valid]

    # -- the layer ---------------------------------------------------------------------------
    def moe(self, x, weights, routing, scheme: MoeScheme, out_dtype=torch.bfloat16):
        check_moe_args(x, weights, routing, scheme, out_dtype)
        T, K = x.shape
        E, I = weights.num_experts, weights.intermediate_size
        tokens, slots, experts = self.pairs(routing, E)
        y = torch.zeros(T, K, dtype=torch.float32)
        if tokens.numel() == 0:
            return y.to(out_dtype)
        act, inter = scheme.activation, scheme.intermediate
        used = [int(e) for e in torch.unique(experts)]
        # the padded grouped layout: each expert's pairs, padded to a multiple of BLOCK rows
        order, valid, offsets = [], [], {}
        for e in used:
            pairs = torch.nonzero(experts == e).flatten().tolist()
            offsets[e] = len(order)
            pad = -len(pairs) % BLOCK
            order += pairs + [-1] * pad
            valid += [True] * len(pairs) + [False] * pad
        valid_t = torch.tensor(valid)
        h_pad = torch.full((len(order), I), POISON, dtype=torch.float32)
        qa, qi = self.q(act), self.q(inter)
        qx_all = quantize(x, qa) if act.dynamic and act.granularity is not Granularity.TENSOR else None
        x_scale = quantize(self.x_scale_rows(x), qa).scale if act.dynamic and qx_all is None else None
        for e in used:
            pairs = torch.nonzero(experts == e).flatten()
            rows = tokens[pairs]
            x_rows = x[rows].to(torch.float32)
            xr = self.input_weight(x_rows, routing.weights[rows, slots[pairs]].to(torch.float32))
            if not act.dynamic:
                a = quantize(xr, qa, self.static_a1(weights, e))
            elif act.granularity is Granularity.TENSOR:
                a = quantize(xr, qa.with_(dynamic=False), x_scale)
            elif xr is x_rows:
                a = _rows(qx_all, rows)
            else:
                a = quantize(xr, qa)
            w13, _ = self.weights_for(weights, self.expert_of_group(e, used))
            gate, up = self.gate_up(grouped_scaled_mm(a, w13), scheme.order)
            h_pad[offsets[e]:offsets[e] + pairs.numel()] = self.round_h(torch.nn.functional.silu(gate) * up)
        if inter.dynamic and inter.granularity is Granularity.TENSOR:
            s = quantize(self.padded_amax_rows(h_pad, valid_t), qi).scale
        for e in used:
            pairs = torch.nonzero(experts == e).flatten()
            h = h_pad[offsets[e]:offsets[e] + pairs.numel()]
            if not inter.dynamic:
                a = quantize(h, qi, weights.a2_scale[e])
            elif inter.granularity is Granularity.TENSOR:
                a = quantize(h, qi.with_(dynamic=False), s)
            else:
                a = quantize(h, qi)
            _, w2 = self.weights_for(weights, self.expert_of_group(e, used))
            o = grouped_scaled_mm(a, w2)
            rows = tokens[pairs]
            w = routing.weights[rows, slots[pairs]].to(torch.float32)
            y.index_add_(0, rows, self.output_weight(o, w, routing.weights[rows].to(torch.float32), slots[pairs]))
        return y.to(out_dtype)


# ------------------------------------------------------------------------------------------
# mutants


class GateUpSwapped(MoeBase):
    name = "mutant-moe-gate-up-swapped"
    upstream = "sglang#11081"
    bug = "the up half taken as the gate (w13 stacked [up; gate] read as [gate; up]): GSM8K 0.025"

    def gate_up(self, g, order):
        return super().gate_up(g, "up_gate" if order == "gate_up" else "gate_up")


class SharedExpertDropped(MoeBase):
    name = "mutant-moe-shared-expert-dropped"
    upstream = "vllm#51632"
    bug = "pairs routed to the last (shared) expert id dropped: ids past the routed range filtered out"

    def pairs(self, routing, E):
        t, j, e = local_pairs(routing, E)
        keep = e < E - 1 if E > 1 else e >= 0
        return t[keep], j[keep], e[keep]


class PaddingInScale(MoeBase):
    name = "mutant-moe-padding-in-scale"
    upstream = "vllm#49783, sglang#32386"
    bug = "the per-tensor intermediate scale computed over the padded grouped buffer, stale padding rows included"

    def padded_amax_rows(self, h_padded, valid):
        return h_padded


class EmptyExpertShift(MoeBase):
    name = "mutant-moe-empty-expert-shift"
    upstream = "DeepGEMM#268, vllm#49784"
    bug = "expert ids of the grouped layout compacted over non-empty experts: after an empty expert, groups use the "\
          "previous expert's weights"

    def expert_of_group(self, e, used):
        return used.index(e)


class OneStaticInputScale(MoeBase):
    name = "mutant-moe-one-static-input-scale"
    upstream = "TensorRT-LLM#10778"
    bug = "expert 0's static input scale used for every expert"

    def static_a1(self, weights, e):
        return weights.a1_scale[0]


class RankLocalActivationScale(MoeBase):
    name = "mutant-moe-rank-local-activation-scale"
    upstream = "vllm#54683"
    bug = "the per-tensor activation scale of one rank's tokens (the second half) applied to the all-gathered batch"

    def x_scale_rows(self, x):
        return x[x.shape[0] // 2:] if x.shape[0] > 1 else x


class RouterWeightOnInput(MoeBase):
    name = "mutant-moe-router-weight-on-input"
    upstream = "vllm apply_router_weight_on_input (valid for top-1 only)"
    bug = "the router weight multiplies x before the first GEMM instead of the expert output (top-k > 1)"

    def input_weight(self, x_rows, w):
        return x_rows * w[:, None]

    def output_weight(self, o, w, wt, slots):
        return o


class FirstSlotWeight(MoeBase):
    name = "mutant-moe-first-slot-weight"
    upstream = "sglang moe_sum_reduce / topk weight stride bugs"
    bug = "every slot of a token weighted by its first slot's router weight (a stride of 0 over top-k)"

    def output_weight(self, o, w, wt, slots):
        return o * wt[:, 0][:, None]


class ExpertMapIgnored(MoeBase):
    name = "mutant-moe-expert-map-ignored"
    upstream = "vllm expert_map / EP offset bugs (vllm#51632 class)"
    bug = "the rank's expert_map ignored: global ids minus the rank's first id, non-local ids clamped in"

    def pairs(self, routing, E):
        if routing.expert_map is None:
            return local_pairs(routing, E)
        first = int(torch.nonzero(routing.expert_map >= 0).flatten()[0])
        local = torch.clamp(routing.ids.to(torch.int64) - first, 0, E - 1)
        t, j = torch.nonzero(local >= 0, as_tuple=True)
        return t, j, local[t, j]


class PartialBlockScale(MoeBase):
    name = "mutant-moe-partial-block-scale"
    upstream = "FBGEMM#6159 class (trailing block dropped) in block-scaled MoE"
    bug = "the scale blocks counted as floor(N / 128): a trailing partial block of w13 rows uses the previous " \
          "block's scale"

    def weights_for(self, weights, e):
        q1, q2 = weights.expert(e)
        if q1.scheme.granularity is Granularity.BLOCK and q1.scale.shape[0] > 1 and q1.data.shape[0] % 128:
            s = q1.scale.clone()
            s[-1] = s[-2]
            q1 = Quantized(q1.data, s, q1.scheme)
        return q1, q2


MOE_MUTANTS = [GateUpSwapped, SharedExpertDropped, PaddingInScale, EmptyExpertShift, OneStaticInputScale,
               RankLocalActivationScale, RouterWeightOnInput, FirstSlotWeight, ExpertMapIgnored, PartialBlockScale]


# ------------------------------------------------------------------------------------------
# correct variants


class Bf16Pipeline(MoeBase):
    """The fused kernels' arithmetic: g and h rounded to bf16, pair outputs to bf16, the default
    (bf16) declaration."""

    name = "correct-moe-bf16-pipeline"
    accuracy = MoeAccuracy()

    def gate_up(self, g, order):
        return super().gate_up(g.to(torch.bfloat16).to(torch.float32), order)

    def output_weight(self, o, w, wt, slots):
        return (o * w[:, None]).to(torch.bfloat16).to(torch.float32)

    def round_h(self, h):
        return h.to(torch.bfloat16).to(torch.float32)


class ReversedTopK(MoeBase):
    """Top-k slots summed last to first (the order of the combine is free)."""

    name = "correct-moe-reversed-topk"

    def pairs(self, routing, E):
        t, j, e = local_pairs(routing, E)
        idx = torch.argsort(t * routing.ids.shape[1] + (routing.ids.shape[1] - 1 - j))
        return t[idx], j[idx], e[idx]


class MultiplyCodes(MoeBase):
    """x and the intermediate quantized as RNE(clamp(x * fl32(1 / s))) (SGLang's and vLLM's Triton
    quantizers): codes that may differ from the spec's by a rounding, within the bound."""

    name = "correct-moe-multiply-codes"

    def q(self, scheme):
        return scheme.with_(multiply_codes=True)


MOE_CORRECT = [MoeBase, Bf16Pipeline, ReversedTopK, MultiplyCodes]
