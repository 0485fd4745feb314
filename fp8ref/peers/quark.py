"""AMD Quark's FP8 real quantization (``amd-quark`` 0.13, ``quark.torch``).

Read from ``quark/torch/kernel/__init__.py`` and ``quark/torch/kernel/hw_emulation/
hw_emulation_interface.py``: ``ScaledRealQuantizeFunction.apply("fp8_e4m3" | "fp8_e5m2", x, scale,
zero_point, axis, group_size, quant_min, quant_max, round_mode, qscheme)`` -- what Quark's real
quantizer runs -- dispatches to ``real_quantize_fp8_{e4m3,e5m2}``:

* ``per_tensor``: ``x / scale`` with the scale a 0-d fp32 tensor, so the quotient has x's dtype
  (torch's promotion keeps a dimensioned bf16 tensor in bf16), clamp at the format's max, cast;
* ``per_channel``: the scale is first cast to x's dtype, then the same.

Quark computes its scales in observers (``calculate_fp8_quant_parameters``: amax / max in fp32,
floored at an eps) during calibration; the quantizer takes them as given. As for ONNX's
QuantizeLinear, the adapter gives it fp8ref's dynamic scale (fp32), so what is certified is Quark's
division, clamp and cast. Conventions filled in: none. Not filled in (defects): the division in
bf16/fp16 for bf16/fp16 input, and, per channel, the scale rounded to the input's dtype before the
division while the fp32 scale is the one Quark stores for dequantization.
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer, spec_or_given_scale

__all__ = ["PEERS"]

_KERNEL = "quark.torch.kernel"


class QuarkFp8(Peer):
    name = "quark-fp8"
    project = "AMD Quark"
    distribution = "amd-quark"
    entry = f"{_KERNEL}.ScaledRealQuantizeFunction ('fp8_e4m3' / 'fp8_e5m2', per_tensor or per_channel)"
    modules = (_KERNEL,)
    notes = ("s given (fp8ref's, fp32); per tensor codes = cast(clamp(x / s)) in x's dtype; per channel "
             "s.to(x.dtype) first")
    ops = ("quantize",)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in (E4M3FN, E5M2) or s.qmax != s.format.max:
            return "fp8_e4m3 (e4m3fn) and fp8_e5m2, clamped at the format's max"
        if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
            return "per_tensor or per_channel (one scale per row) for FP8"
        if s.scale_dtype != torch.float32:
            return "Quark's observers store fp32 scales"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from quark.torch.kernel import ScaledRealQuantizeFunction

        s = spec_or_given_scale(x, scheme, scale, torch.float32)
        dtype = "fp8_e4m3" if scheme.format is E4M3FN else "fp8_e5m2"
        qmax = float(scheme.format.max)
        if scheme.granularity is Granularity.TENSOR:
            q = ScaledRealQuantizeFunction.apply(dtype, x, s.reshape(()), None, None, None, -qmax, qmax, None,
                                                 "per_tensor")
        else:
            q = ScaledRealQuantizeFunction.apply(dtype, x, s.reshape(-1), None, 0, None, -qmax, qmax, None,
                                                 "per_channel")
        return self._quantized(q, s, scheme)


PEERS = (QuarkFp8(),)
