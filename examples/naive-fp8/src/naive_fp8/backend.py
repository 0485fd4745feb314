"""A naive FP8 W8A8 backend: a per-token/per-channel quantizer and an fp32 GEMM over the FP8 codes.

Written the way a kernel author starts: plain PyTorch, one op per line, the fp8ref spec's
equations in the spec's order. What it does not take, it declines with a reason.
"""

from __future__ import annotations

import torch

from fp8ref import PROPAGATE, Accumulation, Backend, Case, Granularity, NonFinite, Quantized, QuantScheme

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FP32 = torch.finfo(torch.float32)


def _gemm_reason(scheme: QuantScheme) -> str | None:
    """Why the GEMM cannot take operands quantized under ``scheme`` (None if it can)."""
    if scheme.granularity not in (Granularity.TENSOR, Granularity.ROW):
        return f"{scheme.granularity.value} scales (the GEMM takes one scale per tensor or per row)"
    return None


def _quantize_reason(scheme: QuantScheme) -> str | None:
    """Why the quantizer cannot take ``scheme`` (None if it can)."""
    if scheme.granularity not in (Granularity.TENSOR, Granularity.ROW):
        return f"{scheme.granularity.value} scales (the quantizer computes per-tensor or per-row scales)"
    if not scheme.dynamic:
        return "static scales (the quantizer computes its own)"
    if scheme.scale_dtype != torch.float32 or scheme.scale_compute_dtype != torch.float32:
        return "scales not computed and stored in fp32"
    if scheme.pow2_scale:
        return "power-of-two scales"
    return None


class NaiveFp8Backend(Backend):
    """``quantize``: per-token (row) or per-tensor dynamic scales in fp32, any FP8 format.
    ``scaled_mm``: the codes widened to fp32 (exact: every FP8 value is an fp32), one fp32 GEMM,
    then scales and bias applied in fp32 and a single rounding to ``out_dtype``."""

    name = "naive-fp8"
    # torch's CPU fp32 GEMM keeps an fp32 running sum: declare FP32. Declaring more (EXACT) would
    # be a lie the scaled_mm.accumulator_bits probe catches; declaring less (FAST, BF16) would
    # pass but put the backend in a weaker precision class than it earns.
    accumulation = Accumulation.FP32
    # The fp32 result is rounded to out_dtype once, after the scales and the bias.
    output_roundings = 1
    # NaN/Inf: quantize raises for x (as the spec); scaled_mm adds the bias as it is, so a NaN or Inf
    # there reaches its output column. Optional (undeclared, raising and propagating both pass):
    # declared, it is a promise the *.non_finite contracts hold the backend to.
    non_finite = NonFinite(bias=PROPAGATE)

    def available(self) -> str | None:
        return None  # plain PyTorch on the CPU: runs everywhere fp8ref does

    def supports(self, case: Case) -> str | None:
        if case.out_dtype not in _FLOATS:
            return f"out_dtype {case.out_dtype} (takes fp32, fp16, bf16)"
        if case.device != "cpu":
            return f"device {case.device} (CPU only)"
        act, wt = case.recipe.activation, case.recipe.weight
        if case.op in ("quantize", "linear"):  # the backend quantizes the activations
            reason = _quantize_reason(act)
            if reason:
                return f"activation scheme {act.short_str()}: {reason}"
        if case.op in ("scaled_mm", "linear"):  # the GEMM reads both operands' scales
            for role, scheme in (("activation", act), ("weight", wt)):
                reason = _gemm_reason(scheme)
                if reason:
                    return f"{role} scheme {scheme.short_str()}: {reason}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        reason = _quantize_reason(scheme)
        if reason or scale is not None:
            raise ValueError(f"naive-fp8 cannot quantize under {scheme.short_str()}: {reason or 'static scale'}")
        if x.dim() != 2 or x.dtype not in _FLOATS:
            raise ValueError(f"x must be a 2-D fp32/fp16/bf16 tensor, got {x.dtype} {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError("x has 0 columns: the reduction dim K must be at least 1")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf: FP8 quantization of NaN/Inf is undefined")
        x32 = x.float()
        if scheme.granularity is Granularity.TENSOR:
            amax = x32.abs().amax().reshape(1, 1) if x.numel() else x32.new_zeros(1, 1)
        else:
            amax = x32.abs().amax(dim=1, keepdim=True)
        # The spec's scale, step by step: an all-zero block gets the amax floor, a scale that is
        # still 0 (no floor) gets zero_scale, and a tiny one is kept at least fp32's smallest
        # normal. Without these, 0 / 0 = NaN codes (bug 1 of the walk-through).
        s = amax.clamp(min=scheme.amax_floor) / scheme.qmax
        s = torch.where(s == 0, torch.full_like(s, scheme.zero_scale), s)
        lowest = _FP32.smallest_normal * (2.0**-23 if scheme.subnormal_scales else 1.0)
        s = s.clamp(min=lowest)
        # Divide (x * (1/s) rounds twice), clamp to +-qmax *before* the cast (a cast of an
        # out-of-range value is NaN or Inf in some formats), then one round-to-nearest-even.
        v = x32 / s
        codes = v.clamp(-scheme.qmax, scheme.qmax).to(scheme.format.torch_dtype)
        return Quantized(codes, s, scheme)

    def scaled_mm(self, a: Quantized, b: Quantized, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        for role, q in (("a", a), ("b", b)):
            reason = _gemm_reason(q.scheme)
            if reason:
                raise ValueError(f"naive-fp8 scaled_mm: operand {role} has {reason}")
        if a.data.shape[1] != b.data.shape[1]:
            raise ValueError(f"K mismatch: a is {tuple(a.data.shape)} [M, K], b is {tuple(b.data.shape)} [N, K]")
        if a.data.shape[1] == 0:
            raise ValueError("a and b have 0 columns: the reduction dim K must be at least 1")
        acc = a.data.float() @ b.data.float().T  # [M, N], fp32 accumulation
        y = acc * a.scale.float().reshape(-1, 1) * b.scale.float().reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
