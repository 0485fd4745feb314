"""Scale soundness (issue 31): fused, ``linear``-only backends whose activation scale is wrong, their
correct twin, a quantizer whose scale computation underflows to 0 and a GEMM that flushes subnormals.

A fused backend quantizes the activations inside ``linear`` with a scale of its own and never
shows it: the bound that judges it must come from the spec's quantization of the same input, not
from anything the backend returns (``linear_error_bound``). Every mutant here is the same fused
pipeline with one wrong way of choosing the activation scale -- over the wrong elements, the wrong
axis, off by a factor, or left over from the previous call -- so the class is covered, not one
instance. ``FusedLinear`` is the correct twin the contracts must accept.
"""

from __future__ import annotations

import torch

from fp8ref.spec import quant
from fp8ref.spec.quant import Quantized
from fp8ref.spec.schemes import W8A8_FP8, Granularity, QuantScheme

from .base import Fp32Base, finish, fp32_mm, reference_quantize, segment_terms


def _quantize_with_scale(x: torch.Tensor, scheme: QuantScheme, s: torch.Tensor) -> Quantized:
    """RNE(clamp(x / s)) with the stored scale ``s`` (in ``scheme.scale_dtype``), as the spec does
    with any scale: only the choice of ``s`` differs between the fused backends."""
    return Quantized(quant.quantize(x, scheme.with_(dynamic=False), s).data, s, scheme)


def _masked_scale(x: torch.Tensor, scheme: QuantScheme, seen: torch.Tensor) -> torch.Tensor:
    """The spec's scale of ``x`` with the elements where ``seen`` is False taken as 0."""
    return quant.compute_scale(torch.where(seen, x, torch.zeros_like(x)), scheme)


class FusedLinear(Fp32Base):
    """Correct: a fused linear-only backend. ``linear`` quantizes x with the spec's scale
    (``act_scale``) and runs the fp32 GEMM on the prepared weight; no ``quantize`` or
    ``scaled_mm`` is claimed, so only the linear contracts can judge it."""

    name = "correct-fused-linear"
    ops = ("linear",)
    changes = ("linear",)
    bug = "quantizes the activations inside a fused linear (claims only linear), scale computed as the spec does"

    def act_scale(self, x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """The stored activation scale this backend uses for ``x`` (the wrong ones override it)."""
        return quant.compute_scale(x, scheme)

    def linear(self, x, w, bias=None, out_dtype=torch.bfloat16, scheme=None, scale=None):
        scheme = W8A8_FP8.activation if scheme is None else scheme
        if scale is not None:  # a static scheme: the caller's scale
            return fp32_mm(reference_quantize(x, scheme, scale), w, bias, out_dtype)
        return fp32_mm(_quantize_with_scale(x, scheme, self.act_scale(x, scheme)), w, bias, out_dtype)


class FusedTileLocalAmax(FusedLinear):
    name = "mutant-fused-tile-local-amax"
    upstream = ("issue 31 (a linear-only fused kernel certified with each row's amax over its first 64 "
                "columns); Primus-Turbo PR#306, vllm-xpu-kernels PR#521 (partial amax reductions)")
    klass = "extreme-value position"
    bug = "fused linear: each block's activation amax is reduced over the first 64 columns only (one tile)"

    def act_scale(self, x, scheme):
        return _masked_scale(x, scheme, (torch.arange(x.shape[1]) < 64).expand_as(x))


class FusedAmaxRowSubset(FusedLinear):
    name = "mutant-fused-amax-row-subset"
    upstream = "AMD-AGI/Primus-Turbo PR#306 (multi-round amax reduction returned the first tile's amax), fused"
    klass = "extreme-value position"
    bug = "fused linear: a per-tensor activation amax over the first 16 rows only"

    def act_scale(self, x, scheme):
        if scheme.granularity is not Granularity.TENSOR:
            return quant.compute_scale(x, scheme)
        return _masked_scale(x, scheme, (torch.arange(x.shape[0]) < 16).reshape(-1, 1).expand_as(x))


class FusedAmaxWrongAxis(FusedLinear):
    name = "mutant-fused-amax-wrong-axis"
    upstream = "vllm PR#12696 (scales along the wrong axis), in a fused activation quantizer"
    klass = "scale layouts"
    bug = "fused linear: the per-row activation amax is read from the column maxima (row m takes column m's)"

    def act_scale(self, x, scheme):
        if scheme.granularity is not Granularity.ROW:
            return quant.compute_scale(x, scheme)
        col_amax = x.to(torch.float32).abs().amax(dim=0)
        rows = col_amax[torch.arange(x.shape[0]) % x.shape[1]]
        return quant.compute_scale(rows.reshape(-1, 1).to(x.dtype), scheme)


class FusedScaleHalved(FusedLinear):
    name = "mutant-fused-scale-halved"
    upstream = "meta-pytorch/tritonbench PR#1145 (quantization scale direction/factor); a qmax of 2*448"
    klass = "scales and values"
    bug = "fused linear: the activation scale is half the spec's (amax / (2 qmax)): the largest values clip"

    def act_scale(self, x, scheme):
        s = quant.compute_scale(x, scheme)
        return torch.clamp(s.to(torch.float32) / 2, min=float(torch.finfo(scheme.scale_dtype).tiny)).to(s.dtype)


class FusedStaleScale(FusedLinear):
    name = "mutant-fused-stale-scale"
    upstream = "transformers#42746 and delayed scaling (an activation scale from an earlier call), fused"
    klass = "scales and values"
    bug = "fused linear: reuses the activation scale of the previous call of the same shape"

    def __init__(self):
        self._last: dict = {}

    def act_scale(self, x, scheme):
        key = (scheme, tuple(x.shape))
        s = self._last.get(key)
        self._last[key] = quant.compute_scale(x, scheme)
        return self._last[key] if s is None else s


class ScaleUnderflowZero(Fp32Base):
    name = "mutant-scale-underflow-zero"
    upstream = ("pytorch/ao (issue 31: scale 0 when amax / qmax underflows, then NaN codes and +-448); "
                "optimum-quanto; XLA:CPU flushing a subnormal scale (docs/findings.md)")
    klass = "format corners"
    bug = ("dynamic scale amax / qmax computed in scale_compute_dtype with no zero_scale and no floor at the scale "
           "dtype's smallest value: it underflows to 0 for tiny amax, and x / 0 gives NaN and +-qmax codes")

    def quantize(self, x, scheme, scale=None):
        if scale is not None or scheme.pow2_scale:
            return reference_quantize(x, scheme, scale)
        ref = reference_quantize(x, scheme)
        rows, cols = x.shape
        r, c = scheme.block_shape(rows, cols)
        amax = quant._blocks(x.to(torch.float32).abs(), r, c).amax(dim=(1, 3))
        raw = (torch.clamp(amax, min=scheme.amax_floor) / scheme.qmax).to(scheme.scale_compute_dtype)
        under = (raw.to(scheme.scale_dtype) == 0) & (amax > 0)  # amax = 0 takes zero_scale, as the spec
        if not bool(under.any()):
            return ref
        s = torch.where(under, torch.zeros_like(ref.scale), ref.scale)
        v = x.to(torch.float32) / quant.expand_scale(s.to(torch.float32), scheme, rows, cols)
        data = torch.where(torch.isnan(v), v, torch.clamp(v, -scheme.qmax, scheme.qmax)).to(scheme.format.torch_dtype)
        return Quantized(data, s, scheme)


class FlushToZeroGemm(Fp32Base):
    name = "mutant-ftz-gemm"
    upstream = ("torch.set_flush_denormal(True) in serving stacks (FTZ/DAZ); tenstorrent/tt-metal PR#29734 "
                "(denormals flushed); docs/spec.md 3.3")
    klass = "format corners"
    bug = ("the fp32 scaled GEMM runs with flush-to-zero and denormals-are-zero set: subnormal products and "
           "outputs are 0")

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if not torch.set_flush_denormal(True):  # the CPU cannot flush: nothing to model
            return fp32_mm(a, b, bias, out_dtype)
        try:
            return fp32_mm(a, b, bias, out_dtype)
        finally:
            torch.set_flush_denormal(False)


class TileScaleRatioGemm(Fp32Base):
    name = "mutant-tile-scale-ratio"
    upstream = ("LMDeploy 0.18 blocked_gemm_fp8 (docs/findings.md, finding 21: the accumulator is rescaled by "
                "1 / (sa sb) and s_(k-1) / s_k per K tile)")
    klass = "format corners"
    bug = ("a block GEMM that takes whole 128-wide K blocks only and keeps its fp32 accumulator in units of the "
           "current tile's scale product: acc = dot_k + acc * (s_(k-1) / s_k), starting from 0 * (1 / s_0); a "
           "product sa sb <= 2**-128 makes the reciprocal infinite and the output NaN")

    def supports(self, case):
        if case.op == "quantize":
            return None
        a, w = case.recipe.activation, case.recipe.weight
        if a.granularity is not Granularity.GROUP or w.granularity is not Granularity.BLOCK:
            return "1 x 128 activation groups and 128 x 128 weight blocks only"
        if a.group_size != 128 or w.block != (128, 128) or case.K % 128:
            return "whole 128-wide K blocks only"
        return None

    def scaled_mm(self, a, b, bias=None, out_dtype=torch.bfloat16):
        if a.data.shape[1] == 0:  # the spec's argument check, as the base
            raise ValueError("a and b have 0 columns: the reduction dim K must be at least 1")
        terms = list(segment_terms(a, b))
        s = [sa[:, None] * sb[None, :] for _, _, sa, sb in terms] + [torch.ones((), dtype=torch.float32)]
        acc = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32)
        ratio = 1 / s[0]
        for k, (A, B, _, _) in enumerate(terms):
            acc = A @ B.T + acc * ratio
            ratio = s[k] / s[k + 1]
        return finish(acc * (ratio * s[-1]), bias, out_dtype)


class Pow2FloatLog2(Fp32Base):
    name = "mutant-pow2-float-log2-ceil"
    upstream = "sglang#29954"
    klass = "scales and values"
    bug = ("power-of-two (UE8M0) scales as 2**ceil(log2(s)) with an fp32 log2: one power low when s is a few ulps "
           "above a power of two (fp32's log2 of 2**8 (1 + 2**-23) is 8)")

    def _pow2(self, s: torch.Tensor) -> torch.Tensor:
        return torch.pow(2.0, torch.ceil(torch.log2(s)))

    def quantize(self, x, scheme, scale=None):
        if not (scheme.pow2_scale and scheme.dynamic and scheme.scale_dtype == torch.float32):
            return reference_quantize(x, scheme, scale)
        s = quant.compute_scale(x, scheme.with_(pow2_scale=False))  # the fp32 quotient max(amax, floor) / qmax
        return _quantize_with_scale(x, scheme, self._pow2(s).clamp(min=torch.finfo(torch.float32).tiny))


class Pow2FrexpDoubles(Pow2FloatLog2):
    name = "mutant-pow2-frexp-doubles"
    upstream = "microsoft/onnxruntime PR#32122 (review)"
    bug = "the power of two taken as 2**e of frexp(s) = m 2**e: a scale that is already a power of two is doubled"

    def _pow2(self, s: torch.Tensor) -> torch.Tensor:
        return torch.ldexp(torch.ones_like(s), torch.frexp(s)[1])


SCALE_MUTANTS = (FusedTileLocalAmax, FusedAmaxRowSubset, FusedAmaxWrongAxis, FusedScaleHalved, FusedStaleScale,
                 ScaleUnderflowZero, FlushToZeroGemm, TileScaleRatioGemm, Pow2FloatLog2, Pow2FrexpDoubles)
SCALE_CORRECT = (FusedLinear,)

__all__ = [c.__name__ for c in SCALE_MUTANTS + SCALE_CORRECT] + ["SCALE_MUTANTS", "SCALE_CORRECT"]
