"""JAX on XLA:CPU: FP8 ``dot_general`` and jax's MXFP8 block quantizer.

* ``jax-xla-dot``: ``lax.dot_general(a_fp8, b_fp8, preferred_element_type=float32)``, jit-compiled.
  XLA:CPU converts both operands to fp32 and runs an fp32 dot (the compiled HLO: ``convert`` then
  ``dot``), so the accumulation is fp32; the epilogue a jax user writes (``y * sa * sb + bias`` in
  fp32, jnp) follows and the fp32 result is rounded once to the output dtype.
* ``jax-mxfp8``: ``jax._src.cudnn.scaled_matmul_stablehlo.quantize(x, config)`` with
  ``jax.nn.get_scaled_dot_general_config("mxfp8")`` (the quantizer behind ``jax.nn.scaled_dot_general``):
  per 1 x 32 block ``amax / 448`` in x's dtype, rounded *up* to an E8M0 power of two
  (``cast_to_e8m0_with_rounding_up``), ``x / scale`` in x's dtype (exact: a power of two), clamp, cast.
  Conventions filled in: scale computed in x's dtype, power-of-two scales, E8M0 code 0 (2**-127) for
  a zero block, kept although subnormal in fp32. Not filled in: XLA:CPU flushes subnormals, so that
  2**-127 (and fp16's 2**-15 stand-in) becomes 0 and a zero block's codes are 0/0 = NaN.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..registry import Case
from ..spec import layouts
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN, E4M3FNUZ, E5M2
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer

__all__ = ["PEERS", "to_jax", "from_jax"]

_MX_BLOCK = 32
_E8M0_ZERO = 2.0**-127  #: the value of E8M0 code 0 (a subnormal fp32)


def to_jax(t: torch.Tensor):
    """A CPU torch tensor as a jax array with the same bits (FP8 and bf16 through ml_dtypes)."""
    import jax.numpy as jnp
    import ml_dtypes

    views = {torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
             torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
             torch.float8_e4m3fnuz: (torch.uint8, ml_dtypes.float8_e4m3fnuz),
             torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
    t = t.detach().contiguous().cpu()
    if t.dtype in views:
        raw, mdt = views[t.dtype]
        return jnp.asarray(t.view(raw).numpy().view(mdt))
    return jnp.asarray(t.numpy())


def from_jax(a, dtype: torch.dtype) -> torch.Tensor:
    """A jax array as a torch tensor of ``dtype`` with the same bits."""
    arr = np.asarray(a)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz):
        return torch.from_numpy(arr.view(np.uint8).copy()).view(dtype)
    if dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr)).to(dtype)


@functools.lru_cache(maxsize=1)
def _jit_dot():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def dot(a, b, sa, sb, bias):
        y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y * sa * sb + bias

    return dot


class JaxXlaDot(Peer):
    name = "jax-xla-dot"
    project = "JAX / XLA:CPU"
    distribution = "jaxlib"
    entry = "jax.lax.dot_general(fp8, fp8, preferred_element_type=float32), jit on XLA:CPU"
    modules = ("jax", "jax.numpy")
    notes = "XLA:CPU converts FP8 to fp32 and runs an fp32 dot; epilogue y*sa*sb + bias in fp32; one rounding"
    ops = ("scaled_mm",)
    accumulation = Accumulation.FP32
    output_roundings = 1
    time_budget_s = 30.0  # one XLA compilation per new shape

    def supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        for s in (a, w):
            if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
                return "the epilogue applies tensor or per-row scales (no K-blocks)"
            if s.format not in (E4M3FN, E5M2, E4M3FNUZ):
                return f"format {s.format.name}"
        if case.out_dtype == torch.float64:
            return "fp32 result"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        sa = a.scale.to(torch.float32).reshape(-1, 1)
        sb = b.scale.to(torch.float32).reshape(1, -1)
        bias32 = torch.zeros(1, b.data.shape[0]) if bias is None else bias.to(torch.float32).reshape(1, -1)
        y = _jit_dot()(to_jax(a.data), to_jax(b.data), to_jax(sa), to_jax(sb), to_jax(bias32))
        return from_jax(y, torch.float32).to(out_dtype)


def _mx_native(scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
    dt = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32
    return scheme.with_(amax_floor=0.0, pow2_scale=True, scale_compute_dtype=dt, zero_scale=_E8M0_ZERO,
                        subnormal_scales=True)


class JaxMXFP8(Peer):
    name = "jax-mxfp8"
    project = "JAX"
    distribution = "jax"
    entry = "jax._src.cudnn.scaled_matmul_stablehlo.quantize(x, get_scaled_dot_general_config('mxfp8'))"
    modules = ("jax", "jax._src.cudnn.scaled_matmul_stablehlo")
    notes = "per 1x32: s = E8M0 round-up of amax/448 in x's dtype; codes = cast(clamp(x / s)) in x's dtype"
    ops = ("quantize",)
    time_budget_s = 30.0  # one XLA compilation per new shape

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        if scheme.granularity is Granularity.GROUP and scheme.group_size == _MX_BLOCK:
            return _mx_native(scheme, x_dtype)
        return scheme

    def map_problem(self, problem):
        """MXFP8 is one scheme: every drawn quantize problem keeps its data family, dtype and rows
        and is asked of 1 x 32 blocks, K rounded to a multiple of 32 (what the quantizer asserts)."""
        if not hasattr(problem, "scheme"):
            return problem
        from dataclasses import replace

        mx = _mx_native(QuantScheme(granularity="group", group_size=_MX_BLOCK), problem.x_dtype)
        cols = _MX_BLOCK * max(1, round(problem.cols / _MX_BLOCK))
        return replace(problem, scheme=mx, cols=cols)

    def supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.granularity is not Granularity.GROUP or s.group_size != _MX_BLOCK:
            return "MXFP8 quantizes 1 x 32 blocks"
        if not s.dynamic:
            return "dynamic scales only (the quantizer computes its E8M0 scales)"
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "the mxfp8 config's data type is e4m3fn (clamped at 448)"
        if case.K % _MX_BLOCK:
            return "the quantizer asserts K % 32 == 0"
        if s.scale_dtype != torch.float32 or s != _mx_native(s, case.x_dtype):
            return "E8M0 scales (rounded up), computed in the input's dtype, no amax floor"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        import jax
        from jax._src.cudnn.scaled_matmul_stablehlo import quantize

        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        q, s = quantize(to_jax(x), jax.nn.get_scaled_dot_general_config("mxfp8"))
        data = from_jax(q, torch.float8_e4m3fn)
        scale = layouts.e8m0_decode(torch.from_numpy(np.asarray(s).view(np.uint8).copy()))
        return self._quantized(data, scale, scheme)


PEERS = (JaxXlaDot(), JaxMXFP8())
