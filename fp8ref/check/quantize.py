"""The quantize contracts' checks: scale, codes, exact values on power-of-two scales, losslessness on the
grid, determinism, equivariance, sign symmetry, bit exactness. The contract table that names them is
``fp8ref.conformance.contracts``; the selector's probe runs some of them (``fp8ref.check.probe``).
Imports flow down: the registry, the spec, ``problems`` and ``common``."""

from __future__ import annotations

import torch

from ..registry import Backend
from ..spec import quant
from ..spec.bounds import conforming_quantization_error_bound, scale_error_bound
from ..spec.quant import Quantized
from .common import (
    ContractViolation,
    Declined,
    build_problem,
    cached_reference,
    call_quantize,
    check_within,
    first_diff,
    require_supported,
    same_bits,
    spec_quantize,
)
from .problems import QuantizeProblem


def _q_inputs(backend: Backend, p: QuantizeProblem) -> tuple[torch.Tensor, torch.Tensor | None, Quantized]:
    """``(x, the caller's scale or None, the reference quantization)`` after the backend's decline
    (x and the scale are fresh copies: the backend may not touch the cached ones)."""
    require_supported(backend, p.case())

    def compute():
        x = build_problem(p)
        scale = p.scale(x)
        return x, scale, spec_quantize(x, p.scheme, scale)

    x, scale, ref = cached_reference(("quantize", p), compute)
    return x.clone(), None if scale is None else scale.clone(), ref


def check_quantize_scale(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, ref = _q_inputs(backend, p)
    q = call_quantize(backend, x, p.scheme, scale)
    if scale is not None:  # the caller's scale comes back, bit for bit (NaN never equals)
        return check_within("static scheme: the returned scale is the caller's", q.scale, ref.scale,
                             scale_error_bound(ref.scale, p.scheme), dtype=ref.scale.dtype)
    what = "pow2 scale (exact)" if p.scheme.pow2_scale else "scale (allowed: 1 ulp of scale_dtype)"
    return check_within(what, q.scale, ref.scale, scale_error_bound(ref.scale, p.scheme))


def check_quantize_codes(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, ref = _q_inputs(backend, p)
    q = call_quantize(backend, x, p.scheme, scale)
    vals = q.data.to(torch.float32)
    if bool(torch.isnan(vals).any()):
        idx = tuple(int(i) for i in torch.isnan(vals).nonzero()[0])
        raise ContractViolation(f"NaN code (byte {int(q.data.view(torch.uint8)[idx]):#04x}) at {idx} from finite "
                                f"input {x[idx].item()!r}")
    if bool((vals.abs() > p.scheme.qmax).any()):
        idx = tuple(int(i) for i in (vals.abs() > p.scheme.qmax).nonzero()[0])
        raise ContractViolation(f"code {vals[idx].item()} at {idx} exceeds qmax {p.scheme.qmax}")
    if bool((~torch.isfinite(q.scale.float()) | (q.scale.float() <= 0)).any()):
        raise ContractViolation(f"scale not finite and positive: {q.scale.flatten()[:8].tolist()}")
    # The bound is the spec's (its scale, widened to every scale quantize.scale admits), never one
    # computed from the scale the backend returned: a scale that clips is measured against the spec's.
    return check_within("dequantized value vs x (conforming_quantization_error_bound)",
                         quant.dequantize(q, torch.float64), x.to(torch.float64),
                         conforming_quantization_error_bound(x, ref))


def _is_pow2(t: torch.Tensor) -> bool:
    m, _ = torch.frexp(t.to(torch.float64))
    return bool((m == 0.5).all())


def check_quantize_exact_on_pow2_scale(backend: Backend, p: QuantizeProblem) -> float:
    """Where the stored scale is a power of two, x / s is exact in fp32 (and x * (1/s) equals it),
    so RNE(clamp(x / s)) is determined: every conforming quantizer returns the reference's codes
    (as values: +0 and -0 alike). Ties, subnormals, saturation and zero all sit on this path."""
    x, scale, ref = _q_inputs(backend, p)
    if not _is_pow2(ref.scale):
        raise Declined("premise: a scale is not a power of two")
    q = call_quantize(backend, x, p.scheme, scale)
    if not torch.equal(q.scale.to(torch.float64), ref.scale.to(torch.float64)):
        raise Declined("premise: the backend's scale differs from the reference's (quantize.scale judges that)")
    got, want = q.data.to(torch.float32), ref.data.to(torch.float32)
    bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        v = x[idx].item() / float(_scale_at(q, idx))
        raise ContractViolation(f"{int(bad.sum())} codes differ from RNE(clamp(x / s)) with a power-of-two scale "
                                f"(x / s exact); first at {idx}: x / s = {v!r}, got code {got[idx].item()!r} (byte "
                                f"{int(q.data.view(torch.uint8)[idx]):#04x}), round-to-nearest-even gives "
                                f"{want[idx].item()!r}")
    return 0.0


def _scale_at(q: Quantized, idx: tuple[int, int]) -> float:
    """The scale that applies to element ``idx`` of ``q``."""
    r, c = q.scheme.block_shape(*q.data.shape)
    return float(q.scale[idx[0] // r, idx[1] // c])


def check_quantize_lossless(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, ref = _q_inputs(backend, p)
    if not torch.equal(ref.dequantize(torch.float64), x.to(torch.float64)):
        raise Declined("premise: the reference quantization of this input is not lossless")
    q = call_quantize(backend, x, p.scheme, scale)
    if not torch.equal(q.scale.to(torch.float64), ref.scale.to(torch.float64)):
        raise ContractViolation(f"scale differs from the reference on grid input: {first_diff(q.scale, ref.scale)}")
    got = q.dequantize(torch.float64)
    if not torch.equal(got, x.to(torch.float64)):
        return check_within("grid input must quantize losslessly", got, x, torch.zeros_like(got))
    return 0.0


def check_quantize_bit_exact(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, ref = _q_inputs(backend, p)
    q = call_quantize(backend, x, p.scheme, scale)
    if not same_bits(q.scale, ref.scale):
        raise ContractViolation(f"scale bits differ from the reference: {first_diff(q.scale, ref.scale)}")
    if not same_bits(q.data, ref.data):
        raise ContractViolation(f"code bits differ from the reference: {first_diff(q.data, ref.data)}")
    return 0.0


def check_quantize_deterministic(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, _ = _q_inputs(backend, p)
    q1 = call_quantize(backend, x, p.scheme, scale)
    q2 = call_quantize(backend, x.clone(), p.scheme, None if scale is None else scale.clone())
    for what, u, v in (("codes", q1.data, q2.data), ("scales", q1.scale, q2.scale)):
        if not same_bits(u, v):
            raise ContractViolation(f"two identical calls gave different {what}: {first_diff(u, v)}")
    return 0.0


def check_quantize_scale_equivariance(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, r1 = _q_inputs(backend, p)
    f = 2.0**p.k
    x2 = x * f
    if not torch.equal(x2 / f, x) or not bool(torch.isfinite(x2).all()):
        raise Declined("premise: x * 2**k is not exact in the input dtype")
    # a stored multiplier (multiplier_scale, x ~ q / m) scales by 2**-k where a scale scales by 2**k
    fs, k_s = (1.0 / f, -p.k) if p.scheme.multiplier_scale else (f, p.k)
    scale2 = None
    if scale is not None:
        scale2 = scale * fs
        info = torch.finfo(scale.dtype)
        if not torch.equal(scale2 / fs, scale) or bool((scale2 < info.tiny).any()) or not bool(
                torch.isfinite(scale2).all()):
            raise Declined("premise: scale * 2**k leaves the normal range of the scale dtype")
    r2 = spec_quantize(x2, p.scheme, scale2)
    # The premise is the spec's own equivariance on this input: no amax floor, no scale clamp.
    if not (torch.equal(r2.scale.double(), r1.scale.double() * fs) and same_bits(r1.data, r2.data)):
        raise Declined("premise: the amax floor or a scale limit applies, so the spec itself is not equivariant")
    q1, q2 = call_quantize(backend, x, p.scheme, scale), call_quantize(backend, x2, p.scheme, scale2)
    if not torch.equal(q2.scale.double(), q1.scale.double() * fs):
        raise ContractViolation(f"scale of x*2**{p.k} is not scale(x)*2**{k_s}: "
                                f"{q2.scale.flatten()[:4].tolist()} vs {q1.scale.flatten()[:4].tolist()}")
    if not same_bits(q1.data, q2.data):
        raise ContractViolation(f"codes of x*2**{p.k} differ from codes of x: {first_diff(q2.data, q1.data)}")
    return 0.0


def check_quantize_sign_symmetry(backend: Backend, p: QuantizeProblem) -> float:
    x, scale, _ = _q_inputs(backend, p)
    q1, q2 = call_quantize(backend, x, p.scheme, scale), call_quantize(backend, -x, p.scheme, scale)
    if not same_bits(q1.scale, q2.scale):
        raise ContractViolation(f"scale of -x differs from scale of x: {first_diff(q2.scale, q1.scale)}")
    v1, v2 = q1.data.to(torch.float32), q2.data.to(torch.float32)
    if not torch.equal(v2, -v1):
        return check_within("codes of -x must be -codes of x", v2, -v1, torch.zeros_like(v1, dtype=torch.float64))
    return 0.0
