"""tinygrad's FP8 dtypes (``dtypes.fp8e4m3``, ``dtypes.fp8e5m2``): the division and the cast to FP8.

tinygrad ships no FP8 quantizer, only the dtypes and their conversion; as for ONNX's QuantizeLinear,
the scale is fp8ref's dynamic scale and what is certified is tinygrad's ``(x / s).cast(fp8)``:
tinygrad's division, which it lowers to ``x * reciprocal(s)`` (two fp32 roundings: 26 % of fp32
quotients differ from ``x / s`` in the last bit, measured on 5,000 normal pairs), and its float ->
FP8 conversion (``tinygrad.dtype.float_to_fp8``: round to nearest even, saturating at the format's
max). It runs on tinygrad's ``PYTHON`` device, the emulator that executes tinygrad's own ops in
Python: the ``CPU`` device compiles C with clang, which this machine does not have
(``FileNotFoundError: ... 'clang'``). Input enters as fp32 (exact for bf16/fp16), codes leave as
fp32 values and are cast back to FP8 by torch (exact: every FP8 value is an fp32).
"""

from __future__ import annotations

import os

import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E5M2
from ..spec.quant import Quantized, expand_scale
from ..spec.schemes import QuantScheme
from ._base import Peer, spec_or_given_scale

__all__ = ["PEERS"]


class TinygradFp8(Peer):
    name = "tinygrad-fp8"
    project = "tinygrad"
    distribution = "tinygrad"
    entry = "(Tensor(x) / Tensor(s)).cast(dtypes.fp8e4m3 | dtypes.fp8e5m2) on the PYTHON device"
    modules = ("tinygrad",)
    notes = "s given (fp8ref's); codes = float_to_fp8(x * (1/s)) fp32 (tinygrad's division), RNE, saturating"
    ops = ("quantize",)

    def prepare(self) -> str | None:
        # the device is chosen when tinygrad is first imported
        os.environ.setdefault("DEV", "PYTHON")
        return None

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in (E4M3FN, E5M2) or s.qmax != s.format.max:
            return "tinygrad has fp8e4m3 and fp8e5m2, saturating at the format's max"
        if s.scale_dtype != torch.float32:
            return "the division is fp32"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from tinygrad import Tensor, dtypes

        rows, cols = x.shape
        s = spec_or_given_scale(x, scheme, scale, torch.float32)
        full = expand_scale(s, scheme, rows, cols).contiguous()  # one scale per element, exact
        fp8 = dtypes.fp8e4m3 if scheme.format is E4M3FN else dtypes.fp8e5m2
        v = (Tensor(x.to(torch.float32).numpy()) / Tensor(full.numpy())).cast(fp8).cast(dtypes.float32).numpy()
        return Quantized(torch.from_numpy(v).to(scheme.format.torch_dtype), s, scheme)


PEERS = (TinygradFp8(),)
