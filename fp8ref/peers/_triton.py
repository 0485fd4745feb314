"""Shared adapters for the Triton FP8 kernels that SGLang and vLLM ship (and copy from each other):
per-token-group quantizers, the DeepSeek-style block GEMM and the per-token/per-channel scaled mm.

Every kernel runs inside ``correct_downcasts()`` (``triton_interpreter.py``) under
``TRITON_INTERPRET=1``, so a wrong code is the kernel's, not the interpreter's. Declarations are
what the kernels do *here*: ``tl.dot`` of FP8 tiles is a numpy fp32 matmul in the interpreter
(fp32 accumulation); on a Hopper GPU the same dot keeps ~14 bits inside one tile (not measured
here, see docs/certified.md).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.bounds import Accumulation
from ..spec.formats import E4M3FN, E5M2
from ..spec.gemm import OUT_DTYPES
from ..spec.quant import Quantized, compute_scale
from ..spec.schemes import Granularity, QuantScheme
from ._base import Peer, group_width, interpreting
from .triton_interpreter import correct_downcasts

__all__ = ["TritonPeer", "GroupQuantPeer", "BlockGemmPeer", "ScaledMMPeer"]

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonPeer(Peer):
    """A peer whose kernels are ``triton.jit`` functions (interpreted on a CPU)."""

    accumulation = Accumulation.FP32
    #: the interpreter runs each program in Python: certify on small operands and 8 drawn examples
    #: per contract besides the pinned ones (counts, not a clock: the same examples on every machine;
    #: reports say so)
    conformance_max_elems = 1024
    conformance_max_examples = 8

    def prepare(self) -> str | None:
        if not interpreting() and not torch.cuda.is_available():
            return ("no CUDA device and TRITON_INTERPRET is not 1: set TRITON_INTERPRET=1 before the first "
                    "import of triton to run the kernels in Triton's CPU interpreter")
        return None

    def supports(self, case: Case) -> str | None:
        if torch.device(case.device).type != "cpu" or torch.cuda.is_available():
            return "fp8ref certifies these Triton kernels under the CPU interpreter only"
        if case.x_dtype not in _X_DTYPES:
            return f"input dtype {case.x_dtype} is not one of {_X_DTYPES}"
        return self._supports(case)

    def _supports(self, case: Case) -> str | None:
        return None

    def call(self, fn, *args, **kwargs):
        with correct_downcasts():
            return fn(*args, **kwargs)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


class GroupQuantPeer(TritonPeer):
    """A per-token-group quantizer ``fn(x, group_size, eps=..., column_major_scales=...)``:
    per token is one group of width K. The amax floor is the kernel's ``eps`` argument (> 0: both
    projects ship 1e-10)."""

    ops = ("quantize",)
    column_major = False
    formats = (E4M3FN,)
    pow2 = False  #: the kernel can round scales up to a power of two (UE8M0)

    def _fn(self):
        raise NotImplementedError

    def _kwargs(self, scheme: QuantScheme) -> dict:
        return {}

    def _supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format not in self.formats or s.qmax != s.format.max:
            return f"the kernel clamps at the format's max and writes {[f.name for f in self.formats]} only"
        g = group_width(s, case.K)
        if g is None:
            return f"per-token-group kernel: granularity row or 1 x G group, not {s.granularity.value}"
        if case.K % g:
            return f"the kernel asserts K % group_size == 0 (K={case.K}, G={g})"
        if not s.dynamic:
            return "dynamic scales only"
        if s.amax_floor <= 0:
            return "the kernel floors amax at eps > 0 (shipped: 1e-10); eps=0 is not a configuration it ships"
        if s.scale_dtype != torch.float32 or not s.standard_scale_rule:
            return "fp32 scales computed in fp32"
        if s.pow2_scale and not self.pow2:
            return "power-of-two (UE8M0) scales need DeepGEMM's layout transform on this path"
        return None

    def quantize(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> Quantized:
        if scale is not None:
            raise ValueError(f"{self.name}: dynamic scales only")
        rows, cols = x.shape
        g = group_width(scheme, cols)
        x = x.contiguous()
        q, s = self.call(self._fn(), x, g, eps=scheme.amax_floor, dtype=scheme.format.torch_dtype,
                         column_major_scales=self.column_major, **self._kwargs(scheme))
        return self._quantized(q, s.contiguous(), scheme)


class GivenScaleQuantPeer(TritonPeer):
    """A quantizer that takes its scale (static per-tensor quantization): the scale is fp8ref's
    dynamic per-tensor scale (``compute_scale``), the kernel does the division, rounding and
    saturation -- what is certified is that part."""

    ops = ("quantize",)

    def _supports(self, case: Case) -> str | None:
        s = self._case_scheme(case)
        if s.format != E4M3FN or s.qmax != E4M3FN.max:
            return "e4m3fn clamped at 448 only"
        if s.granularity is not Granularity.TENSOR:
            return "per-tensor scale only"
        if s.scale_dtype != torch.float32:
            return "fp32 scale only"
        return None


class BlockGemmPeer(TritonPeer):
    """``fn(A [M, K], B [N, K], As [M, ceil(K/bk)], Bs [ceil(N/bn), ceil(K/bk)], [bn, bk], out_dtype)``:
    1 x bk activation groups, bn x bk weight blocks; each K tile's dot is scaled and added into an
    fp32 accumulator, which is rounded once to the output dtype."""

    ops = ("scaled_mm",)
    output_roundings = 1

    def _fn(self):
        raise NotImplementedError

    def _supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        if case.has_bias:
            return "the block GEMM takes no bias"
        if case.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"out_dtype {case.out_dtype}"
        if a.format != w.format or a.format not in (E4M3FN, E5M2):
            return "both operands e4m3fn (or both e5m2)"
        if a.granularity is not Granularity.GROUP or w.granularity is not Granularity.BLOCK:
            return "1 x bk activation groups and bn x bk weight blocks only"
        bn, bk = w.block
        if a.group_size != bk:
            return f"activation group {a.group_size} != weight block width {bk}"
        if not (_pow2(bn) and _pow2(bk)):
            return f"block sizes must be powers of two >= 16 (tile shapes), got {bn} x {bk}"
        if a.scale_dtype != torch.float32 or w.scale_dtype != torch.float32:
            return "fp32 scales only (the kernel asserts As.dtype == torch.float)"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        if bias is not None:
            raise ValueError(f"{self.name}: no bias")
        bn, bk = b.scheme.block
        return self.call(self._fn(), a.data.contiguous(), b.data.contiguous(), a.scale.contiguous(),
                         b.scale.contiguous(), [bn, bk], out_dtype)


class ScaledMMPeer(TritonPeer):
    """``fn(input [M, K], weight [K, N], scale_a [M,1]|[1,1], scale_b [N,1]|[1,1], out_dtype, bias)``:
    tensor-wise or per-row/per-channel dequantization scales applied to the fp32 accumulator."""

    ops = ("scaled_mm",)

    def _fn(self):
        raise NotImplementedError

    def _supports(self, case: Case) -> str | None:
        a, w = case.recipe.activation, case.recipe.weight
        if case.out_dtype not in OUT_DTYPES or case.out_dtype == torch.float64:
            return f"out_dtype {case.out_dtype}"
        if a.format != w.format:
            return "input.dtype == weight.dtype is asserted"
        for s in (a, w):
            if s.granularity not in (Granularity.TENSOR, Granularity.ROW):
                return f"tensor or per-row scales only, not {s.granularity.value}"
        if a.scale_dtype != w.scale_dtype or a.scale_dtype != torch.float32:
            return "fp32 scales on both sides"
        return None

    def scaled_mm(self, a: Quantized, b: Quantized, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
        if bias is not None and bias.dtype != out_dtype:
            bias = bias.to(out_dtype)  # the serving path holds the bias in the output dtype
        sa = a.scale.reshape(-1, 1).contiguous()
        sb = b.scale.reshape(-1, 1).contiguous()
        return self.call(self._fn(), a.data.contiguous(), b.data.t(), sa, sb, out_dtype, bias)


def reference_tensor_scale(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """fp8ref's dynamic per-tensor scale for a given-scale quantizer."""
    return compute_scale(x, scheme.with_(dynamic=True)).reshape(1).to(torch.float32)
