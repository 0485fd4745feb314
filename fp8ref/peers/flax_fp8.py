"""flax's FP8 training ops (``flax.linen.fp8_ops``, the quantizer behind ``Fp8DotGeneral`` /
``Fp8DirectDotGeneralOp``), run by jax on XLA:CPU.

Read from ``flax/linen/fp8_ops.py`` (flax 0.12.7):

* ``update_fp8_meta(x, q_dtype, scale, amax_history)`` computes the scale for this step from the
  amax *history* (delayed scaling), then records ``max(|x|)`` (fp32) in the history;
* ``compute_scale(amax, scale, fp8_max)``: ``1 / (fp8_max / amax)`` in fp32 -- two roundings, within
  one ulp of ``amax / fp8_max`` -- and the previous scale when amax is 0 or not finite;
* ``quantize(x, q_dtype, scale, compute_dtype)``: ``scale.astype(compute_dtype)``, then ``x / scale``
  in the *compute dtype* (the layer's dtype: ``k.dtype``, bf16 for a bf16 model), clip at the
  format's max in that dtype, cast; ``dequantize`` multiplies by the same ``scale.astype(dtype)``.

The adapter runs two steps on the same tensor, the steady state of delayed scaling on a constant
input (and what current scaling computes): step 1 starts from scale 1 and an empty (zero) history
and records amax(x); step 2's scale is ``1 / (fp8_max / amax(x))``; ``quantize(x, ..., scale, x.dtype)``
gives the codes; the scale reported is the one quantize and dequantize apply, ``s.astype(x.dtype)``
(flax's own cast, repeated here). Conventions filled in: the scale written as ``1 / (fp8_max / amax)``
in fp32 (``reciprocal_scale``), stored in the model's dtype (bf16/fp16) by ``astype``, which keeps a
subnormal (``subnormal_scales``), and a zero tensor keeps the previous scale, 1 (the spec's
``zero_scale``), with no amax floor. Not filled in: the division in bf16/fp16 for a bf16/fp16 model
(two roundings before the FP8 cast).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.formats import E4M3FN, E4M3FNUZ, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer

__all__ = ["PEERS"]

_MOD = "flax.linen.fp8_ops"


class FlaxFp8Ops(Peer):
    name = "flax-fp8-ops"
    project = "Flax"
    distribution = "flax"
    entry = f"{_MOD}.update_fp8_meta (twice) + {_MOD}.quantize(x, q_dtype, scale, compute_dtype=x.dtype)"
    modules = (_MOD,)
    notes = ("s = 1/(fp8_max/amax) fp32 (amax 0 or non-finite: previous scale, 1); "
             "codes = cast(clip(x / s)) computed in x's dtype")
    ops = ("quantize",)

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        if scheme.granularity is not Granularity.TENSOR or not scheme.dynamic or scheme.pow2_scale:
            return scheme
        # whatever scale dtypes are asked for, flax computes 1 / (fp8_max / amax) in fp32 with no amax
        # floor (a zero tensor keeps the previous scale, 1) and applies it in the model's dtype, where
        # ``astype`` keeps a subnormal
        dt = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32
        return scheme.with_(amax_floor=0.0, scale_dtype=dt, scale_compute_dtype=torch.float32, zero_scale=1.0,
                            reciprocal_scale=True, subnormal_scales=True, multiply_codes=False)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in (E4M3FN, E5M2, E4M3FNUZ) or s.qmax != s.format.max:
            return "flax clips at jnp.finfo(q_dtype).max"
        if not s.dynamic:
            return "the scale comes from the amax history (dynamic)"
        if s.granularity is not Granularity.TENSOR:
            return "one scale per tensor (the layer's input or kernel)"
        if s.amax_floor != 0.0:
            return "no amax floor (a zero tensor keeps the previous scale)"
        want = case.x_dtype if case.x_dtype in (torch.bfloat16, torch.float16) else torch.float32
        if s.scale_dtype != want:
            return f"the scale is applied in the model's dtype ({want})"
        if not s.reciprocal_scale:
            return "the scale is 1 / (fp8_max / amax) (reciprocal_scale)"
        if not s.subnormal_scales:
            return "scale.astype(dtype) keeps a subnormal scale (subnormal_scales)"
        if s.pow2_scale or s.zero_scale != 1.0 or s.scale_compute_dtype != torch.float32 or s.multiply_codes:
            return "plain scales computed in fp32, codes x / s"
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"input dtype {case.x_dtype}"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        import jax.numpy as jnp
        from flax.linen import fp8_ops

        from .jax_xla import from_jax, to_jax

        if scale is not None:
            raise ValueError(f"{self.name}: the scale comes from the amax history")
        q_dtype = {E4M3FN: jnp.float8_e4m3fn, E5M2: jnp.float8_e5m2, E4M3FNUZ: jnp.float8_e4m3fnuz}[scheme.format]
        xj = to_jax(x)
        one, empty = jnp.ones((), jnp.float32), jnp.zeros((1,), jnp.float32)
        _, history = fp8_ops.update_fp8_meta(xj, q_dtype, one, empty)
        s, _ = fp8_ops.update_fp8_meta(xj, q_dtype, one, history)
        q = fp8_ops.quantize(xj, q_dtype, s, xj.dtype)
        applied = s.astype(xj.dtype)  # what quantize divides by and dequantize multiplies by
        return self._quantized(from_jax(q, scheme.format.torch_dtype), from_jax(applied, x.dtype).reshape(1, 1),
                               scheme)


PEERS = (FlaxFp8Ops(),)
