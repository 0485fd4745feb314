"""optimum-quanto's ``qfloat8`` (E4M3FN) weights and its ``qbytes_mm`` GEMM on a CPU.

Read from ``optimum/quanto/calibrate.py``, ``library/quantize.py`` and ``library/qbytes_mm.py``:

* ``quanto-qfloat8`` quantize: ``absmax_scale(w, qfloat8, axis=0)`` = ``amax / 448`` in w's dtype
  (per output channel, or per tensor), then ``quantize_symmetric``: ``w / scale`` in w's dtype (a
  bf16 quotient for a bf16 model), clamp at +-448, cast. No floor: an all-zero row gives scale 0.
  Conventions filled in: scale computed and stored in the input's dtype, subnormal scales kept.
  Not filled in (defects): the quotient rounded to bf16 before the FP8 rounding; 0/0 = NaN codes
  for a zero row.
* ``quanto-qbytes-mm`` scaled_mm: ``qbytes_mm(a_codes, b_codes, sa * sb)`` casts the activation
  codes to the scales' dtype (exact), multiplies the weight codes by ``sa * sb`` in that dtype and
  runs ``torch.matmul`` there, bias added after. With bf16 scales (a bf16 model) that is
  dequantize-then-GEMM in bf16: declared ``Accumulation.BF16_OPERANDS`` (the CPU bf16 matmul
  accumulates in fp32) and two output roundings (the bf16 result, then ``+ bias`` in bf16). The
  scale product ``sa * sb`` is itself rounded to bf16 before it meets the codes -- one rounding more
  than the declaration's, which the certificate tests.
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme, Recipe
from ._base import ModelDtypeScalesPeer, Peer

__all__ = ["PEERS"]


class QuantoQFloat8(ModelDtypeScalesPeer):
    name = "quanto-qfloat8"
    project = "optimum-quanto"
    distribution = "optimum-quanto"
    entry = "optimum.quanto.calibrate.absmax_scale + torch.ops.quanto.quantize_symmetric (quantize_weight, qfloat8)"
    modules = ("optimum.quanto",)
    notes = "s = amax/448 in w's dtype (no floor); codes = cast(clamp(w / s computed in w's dtype))"
    ops = ("quantize",)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max or s.pow2_scale:
            return "qfloat8 is e4m3fn clamped at 448 with plain scales"
        if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
            return "8-bit weights are quantized per tensor or per output channel (axis 0)"
        if s.granularity is Granularity.ROW and case.K == 1:
            return "quanto refuses per-axis quantization along an axis of size 1"
        if not s.dynamic or s != self.conventions(s, case.x_dtype):
            return "quanto computes and stores the scale in the input's dtype, with no amax floor"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        from optimum.quanto import qfloat8
        from optimum.quanto.calibrate import absmax_scale

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        axis = None if scheme.granularity is Granularity.TENSOR or x.shape[0] == 1 else 0
        s = absmax_scale(x, qfloat8, axis=axis)
        # WeightQBytesTensor.quantize calls this op with the same arguments
        data = torch.ops.quanto.quantize_symmetric(x, dtype=qfloat8.dtype, axis=axis, scale=s)
        return self._quantized(data, s, scheme)


class QuantoQBytesMM(Peer):
    name = "quanto-qbytes-mm"
    project = "optimum-quanto"
    distribution = "optimum-quanto"
    entry = "torch.ops.quanto.qbytes_mm (CPU, default impl) + bias"
    modules = ("optimum.quanto",)
    notes = "a.to(bf16); w = bf16(sa*sb) * w.to(bf16); torch.matmul in bf16 (fp32 accumulate); + bias in bf16"
    ops = ("scaled_mm",)
    accumulation = Accumulation.BF16_OPERANDS
    output_roundings = 2

    def map_problem(self, problem):
        """quanto's W8A8 scheme for every drawn GEMM problem (its codes, shapes and bias kept): a bf16
        model's scales and output are bf16; activations carry one static scale per tensor, weights one
        per output channel (per tensor if drawn so); qfloat8 is e4m3fn."""
        from dataclasses import replace

        if not hasattr(problem, "recipe"):  # a quantize contract's problem: declined by ops, left as drawn
            return problem
        r = problem.recipe

        def fit(s: QuantScheme, granularity: str) -> QuantScheme:
            return QuantScheme(format=E4M3FN, granularity=granularity, scale_dtype=torch.bfloat16,
                               dynamic=s.dynamic, amax_floor=s.amax_floor)

        w_gran = "tensor" if r.weight.granularity is Granularity.TENSOR else "row"
        recipe = Recipe(r.name, fit(r.weight, w_gran), fit(r.activation, "tensor"))
        return replace(problem, recipe=recipe, out_dtype=torch.bfloat16)

    def supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        if a.scale_dtype != torch.bfloat16 or w.scale_dtype != torch.bfloat16:
            return "certified for a bf16 model: bf16 scales on both operands"
        if a.granularity is not Granularity.TENSOR:
            return "activations carry one (static) scale: sa * sb must broadcast over the weight rows"
        if w.granularity not in (Granularity.TENSOR, Granularity.ROW):
            return "weights per tensor or per output channel"
        if a.format != E4M3FN or w.format != E4M3FN:
            return "qfloat8 (e4m3fn) operands"
        if case.out_dtype != torch.bfloat16:
            return "the result is in the scales' dtype (bf16)"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        import optimum.quanto  # noqa: F401 -- registers torch.ops.quanto

        out = torch.ops.quanto.qbytes_mm(a.data, b.data, a.scale.reshape(1, 1) * b.scale.reshape(-1, 1))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(out_dtype)


PEERS = (QuantoQFloat8(), QuantoQBytesMM())
