"""Keras 3's float8 ``Dense`` (``Dense.quantize("float8")``), on its torch and jax backends: a layer
that takes float inputs and a float kernel and quantizes both itself.

Read from keras 3.15.1, ``keras/src/layers/core/dense.py`` (``_float8_build``, ``_float8_call``) and
``keras/src/quantizers/quantizers.py``:

* the layer keeps, per operand (inputs, kernel), an fp32 ``scale`` (initially 1) and an fp32 amax
  history (zeros, 1024 long): **delayed scaling**. Only a training step changes them: the custom
  gradient of ``quantized_dequantize_inputs`` returns, in place of the scale's and the history's
  gradients, ``compute_float8_scale(max(history), scale, 448)`` and
  ``compute_float8_amax_history(x, history)``, and the optimizer overwrites the variables with them
  (``overwrite_with_gradient``);
* ``compute_float8_scale``: ``1 / ((448 / amax) / 2**0)`` in fp32 -- the reciprocal form, within one
  ulp of ``amax / 448`` -- and the previous scale where amax is 0 or not finite;
* ``quantize_and_dequantize(x, scale, "float8_e4m3fn", compute_dtype)``: ``x / scale.astype(cdt)``
  in the layer's compute dtype, clip at 448 in that dtype, cast to E4M3FN, cast back and multiply by
  the same ``scale.astype(cdt)``: fake quantization, no codes leave the layer;
* ``ops.matmul`` of the two dequantized operands in the compute dtype (torch's backend casts fp16
  operands to fp32 on a CPU and the result back to fp16; ``torch.matmul`` accumulates bf16 in fp32),
  then ``+ bias`` in the compute dtype -- for an fp32 layer after rounding the bias to bf16 (a
  workaround for a TensorFlow fusion, kept on every backend).

The adapter drives the layer through keras's own API to the state that delayed scaling reaches on a
constant input (and that current scaling computes): the kernel and bias frozen (``trainable =
False``), two ``Model.train_on_batch`` steps on the batch (the first records amax, the second
computes the scale from it), then the inference call ``layer(x, training=False)``. No value of the
adapter's own reaches the output: it assigns the given kernel and bias and reads ``y``.

keras chooses its backend once per process, when first imported: the adapter sets
``KERAS_BACKEND`` before that import, and a row whose backend is not the one loaded declines with
the reason (``fp8ref certify`` runs each peer in its own process). On jax, each new layer's
training step is jit-compiled by XLA (seconds per call: ``time_budget_s``), and inputs and outputs
cross as jax arrays with the same bits (``jax_xla.to_jax``/``from_jax``).

One row per backend and compute dtype (the declaration depends on the dtype): fp32 (operands
dequantized in fp32, fp32 GEMM: ``Accumulation.FP32``, one rounding), bf16 and fp16 (operands
dequantized and rounded to the compute dtype, fp32-accumulating GEMM, result rounded, bias added and
rounded again: ``BF16_OPERANDS`` / ``FP16_OPERANDS``, two roundings); the accumulator probe, read
through ``linear``, measures 24 bits on both backends. Conventions filled in: one scale per tensor,
the reciprocal form (``reciprocal_scale``), no amax floor (an all-zero tensor keeps scale 1, the
spec's ``zero_scale``), subnormal scales kept, the scale applied in the compute dtype
(``scale_dtype``). Not filled in (docs/findings.md 25-28): a scale of 0 for a tiny amax, the fp16
scale underflowing to 0, the fp32 layer's bias rounded to bf16, jax's fp16 division through an
overflowing reciprocal; and the quotient ``x / s`` rounded to bf16/fp16 before the E4M3 cast (two
roundings, as flax's finding 15), which the linear bound absorbs.
"""

from __future__ import annotations

import os
import sys

import torch

from ..registry import Case
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.schemes import FP8_PER_TENSOR, Granularity, QuantScheme
from ._base import Peer

__all__ = ["PEERS", "KerasDenseFloat8"]

_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: How each compute dtype's forward accumulates and rounds (module docstring).
_DECLARATION = {torch.float32: (Accumulation.FP32, 1), torch.bfloat16: (Accumulation.BF16_OPERANDS, 2),
                torch.float16: (Accumulation.FP16_OPERANDS, 2)}
#: Training steps that bring the delayed scale to the current amax (module docstring).
STEPS = 2


class KerasDenseFloat8(Peer):
    """``keras.layers.Dense(...).quantize("float8")`` in one compute dtype, on one keras backend
    (``"torch"``, or ``"jax"``: XLA, each training step jit-compiled per shape)."""

    project = "Keras"
    distribution = "keras"
    modules = ("keras",)
    ops = ("linear",)
    float_weight = True
    recipes = (FP8_PER_TENSOR,)  # one dynamic scale per tensor for inputs and kernel

    def __init__(self, dtype: torch.dtype, backend: str = "torch"):
        self.dtype, self.backend = dtype, backend
        self.name = f"keras-{'' if backend == 'torch' else backend + '-'}dense-float8-{_SHORT[dtype]}"
        self.accumulation, self.output_roundings = _DECLARATION[dtype]
        if backend == "jax":
            self.time_budget_s = 30.0  # one XLA compilation of the training step per new shape
        self.entry = (f"KERAS_BACKEND={backend}: keras.layers.Dense(N, dtype='{_DTYPE_NAME[dtype]}')"
                      f".quantize('float8'); Model.train_on_batch x{STEPS} (kernel, bias frozen); "
                      "layer(x, training=False)")
        roundings = "in fp32" if dtype == torch.float32 else f"rounded to {_SHORT[dtype]}"
        bias = " + bias rounded to bf16" if dtype == torch.float32 else f" + bias ({_SHORT[dtype]})"
        self.notes = (f"s = 1/(448/amax) fp32 (amax 0 or non-finite: previous scale), per tensor, delayed (amax "
                      f"history); x, w -> cast(clip(v / s)) * s in {_SHORT[dtype]}; operands {roundings}; "
                      f"matmul{bias}")

    def prepare(self) -> str | None:
        # keras picks its backend when first imported; another backend already loaded is declined below
        if "keras" not in sys.modules:
            os.environ["KERAS_BACKEND"] = self.backend
        return None

    def available(self) -> str | None:
        reason = super().available()
        if reason is not None:
            return reason
        import keras

        if keras.config.backend() != self.backend:
            return (f"keras was imported with the {keras.config.backend()} backend in this process (this row needs "
                    f"KERAS_BACKEND={self.backend}; fp8ref certify runs each peer in its own process)")
        return None

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        if (scheme.format is not E4M3FN or scheme.granularity is not Granularity.TENSOR or not scheme.dynamic
                or scheme.pow2_scale or scheme.scale_dtype != torch.float32 or x_dtype != self.dtype):
            return scheme
        # 1 / (448 / amax) in fp32, no amax floor (a zero tensor keeps scale 1), subnormal scales kept
        # (nothing raises them), the fp32 scale applied in the compute dtype
        return scheme.with_(amax_floor=0.0, scale_dtype=self.dtype, reciprocal_scale=True, subnormal_scales=True)

    def supports(self, case: Case) -> str | None:
        if case.x_dtype != self.dtype:
            return f"this row is the {_SHORT[self.dtype]} layer (x and kernel in its compute dtype)"
        if case.out_dtype != self.dtype:
            return f"the layer returns its compute dtype ({_SHORT[self.dtype]})"
        for what, s in (("activation", case.recipe.activation), ("weight", case.recipe.weight)):
            if s.format is not E4M3FN or s.qmax != E4M3FN.max:
                return f"{what}: float8_e4m3fn clipped at its max (448)"
            if s.granularity is not Granularity.TENSOR:
                return f"{what}: one scale per tensor"
            if not s.dynamic:
                return f"{what}: the scale comes from the amax history (dynamic)"
            if (s.pow2_scale or not s.reciprocal_scale or not s.subnormal_scales or s.zero_scale != 1.0
                    or s.scale_compute_dtype != torch.float32):
                return f"{what}: scale 1 / (448 / amax) computed in fp32, subnormal scales kept, 1 for a zero tensor"
            if s.amax_floor != 0.0:
                return f"{what}: no amax floor (a zero tensor keeps scale 1)"
            if s.scale_dtype != self.dtype:
                return f"{what}: the scale is applied in the compute dtype ({_SHORT[self.dtype]})"
        return None

    def prepare_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The float kernel ``[N, K]``, kept as given: each call builds its own layer from it."""
        if not isinstance(w, torch.Tensor) or w.dtype != self.dtype or w.dim() != 2:
            raise TypeError(f"{self.name}: prepare_weight takes the float weight [N, K] in {self.dtype}")
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, scheme: QuantScheme | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        import keras

        if scale is not None:
            raise ValueError(f"{self.name}: the activation scale comes from the amax history (no static scale)")
        if x.dtype != self.dtype or out_dtype != self.dtype:
            raise ValueError(f"{self.name}: x and out_dtype must be {self.dtype}, got {x.dtype}, {out_dtype}")
        M, K = x.shape
        N = w.shape[0]
        dt = _DTYPE_NAME[self.dtype]
        layer = keras.layers.Dense(N, use_bias=bias is not None, dtype=dt)
        model = keras.Sequential([keras.Input((K,), dtype=dt), layer])
        x, w, bias = (self._to_backend(t) for t in (x, w.T, bias))
        layer.kernel.assign(w)
        if bias is not None:
            layer.bias.assign(bias)
        layer.quantize("float8")
        layer.kernel.trainable = False
        if bias is not None:
            layer.bias.trainable = False
        model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
        target = self._to_backend(torch.zeros(M, N, dtype=self.dtype))
        for _ in range(STEPS):
            model.train_on_batch(x, target)
        if self.backend == "jax":
            from .jax_xla import from_jax

            return from_jax(layer(x, training=False), self.dtype)
        with torch.no_grad():
            y = layer(x, training=False)
        return torch.as_tensor(y).detach()

    def _to_backend(self, t: torch.Tensor | None):
        """``t`` as the keras backend's own array, same bits (jax: through ml_dtypes)."""
        if t is None or self.backend == "torch":
            return t
        from .jax_xla import to_jax

        return to_jax(t)


PEERS = tuple(KerasDenseFloat8(dt, backend) for backend in ("torch", "jax")
              for dt in (torch.bfloat16, torch.float16, torch.float32))
