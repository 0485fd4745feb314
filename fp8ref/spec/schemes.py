"""Quantization schemes and recipes: frozen, validated on construction, hashable.

A scheme says *how* a 2-D tensor ``[rows, cols]`` is quantized (format, scale granularity,
dynamic or static scale, amax floor, clamp value, scale dtype, power-of-two rounding); a recipe
pairs a weight scheme (weights are ``[N, K]``) with an activation scheme (activations are
``[M, K]``). The numbers behind every default are derived in ``docs/spec.md``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import torch

from .formats import E4M3FN, E4M3FNUZ, E5M2, Fp8Format, get_format

__all__ = [
    "Granularity",
    "QuantScheme",
    "Recipe",
    "DEFAULT_AMAX_FLOOR",
    "W8A8_FP8",
    "FP8_PER_TENSOR",
    "FP8_BLOCK",
    "FP8_DYNAMIC",
    "W8A8_FP8_ROCM",
    "MXFP8",
    "MXFP8_E5M2",
    "FP8_BLOCK_UE8M0",
    "RECIPES",
    "get_recipe",
]

#: Default amax floor: scale = max(amax, 1e-12) / qmax. Why 1e-12 (docs/spec.md, "The amax
#: floor"): it lies below every non-zero fp16 magnitude (smallest subnormal 2**-24 ~ 6e-8), so
#: it changes no fp16 row; it keeps an all-zero block finite (scale = 1e-12/qmax > 0, codes 0);
#: and the smallest possible product of two scales, (1e-12/57344)**2 ~ 3e-31, stays a normal
#: fp32, so the GEMM epilogue never underflows the scale product.
DEFAULT_AMAX_FLOOR = 1e-12

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Granularity(str, enum.Enum):
    """Which elements share one scale."""

    TENSOR = "tensor"  #: one scale for the whole tensor
    ROW = "row"  #: one per row: a token of activations [M, K], an output channel of weights [N, K]
    GROUP = "group"  #: 1 x G groups along the last dim (K)
    BLOCK = "block"  #: R x C blocks


@dataclass(frozen=True)
class QuantScheme:
    """How to quantize a 2-D tensor ``[rows, cols]`` (cols is the reduction dim K).

    Parameters
    ----------
    format : Fp8Format or str
        Target format; ``"e4m3fn"`` by default.
    granularity : Granularity or str
        ``tensor``, ``row``, ``group`` (needs ``group_size``) or ``block`` (needs ``block``).
    group_size : int, optional
        G of the 1 x G groups along K. A trailing partial group is its own group.
    block : (int, int), optional
        R x C of the blocks. Trailing partial blocks are their own blocks.
    dynamic : bool
        True: the scale comes from the data. False: the caller passes it to ``quantize``.
    amax_floor : float
        scale = max(amax, amax_floor) / qmax. 0 means no floor; an all-zero block then gets
        scale 1 (TransformerEngine's convention), never 0 or NaN.
    qmax : float, optional
        Clamp value; the format's max by default. Must be a positive value of the format's grid
        (ROCm stacks use 224 with E4M3FNUZ).
    scale_dtype : torch.dtype
        dtype the scale is stored in (fp32 by default). The quantizer divides by the *stored*
        scale, so x ~ data * scale holds for what is stored.
    pow2_scale : bool
        Round the scale up to a power of two (then x / scale is exact and never exceeds qmax).
        E8M0 scales (MX formats) are such powers of two, stored here as their fp32 values.
    zero_scale : float
        The scale of a block whose computed scale is 0 (an all-zero block with no amax floor, or a
        quotient that underflows ``scale_compute_dtype``): 1 by default (TransformerEngine);
        compressed-tensors uses the scale dtype's eps. Any positive finite value gives the same
        codes (all 0) and the same bound; NaN or 0 is a defect, never a convention.
    scale_compute_dtype : torch.dtype
        dtype in which max(amax, floor) / qmax is evaluated (one rounding to it) before
        ``pow2_scale`` and before storing in ``scale_dtype``: fp32 by default; torchao,
        compressed-tensors and jax compute the scale in the input's dtype (bf16/fp16).
    subnormal_scales : bool
        Keep a stored scale that is subnormal in ``scale_dtype`` (as torch's bf16/fp16 division
        does) instead of raising it to the dtype's smallest normal. Either way the scale is > 0.
    reciprocal_scale : bool
        Compute the dynamic scale as the reciprocal of a multiplier, ``1 / (qmax / max(amax,
        floor))``, each division rounded to ``scale_compute_dtype`` (TransformerEngine, flax's and
        keras' ``compute_scale``, SGLang's ``input_to_float8``), instead of the quotient ``max(amax,
        floor) / qmax`` rounded once. Two roundings: the scale can differ from the quotient's by a
        grid step. Dynamic schemes computed in fp32 only (every peer that uses the form does).
    multiplier_by_reciprocal : bool
        Evaluate the multiplier ``qmax / max(amax, floor)`` of ``reciprocal_scale`` or
        ``multiplier_scale`` as ``fl32(qmax * fl32(1 / max(amax, floor)))``: what torch computes for a
        Python float divided by a tensor (``Tensor.__rtruediv__`` is ``reciprocal() * other``), as in
        SGLang's ``input_to_float8``. With ``reciprocal_scale`` the scale then carries three roundings
        and lies up to two grid steps from the quotient (0.9 % of fp32 amaxes).
    multiply_codes : bool
        Compute the codes as ``RNE(clamp(fl32(x * m)))`` with a multiplier ``m`` instead of
        ``RNE(clamp(fl32(x / s)))`` (SGLang's ``input_to_float8`` and Triton quantizers, vLLM's per-tensor
        path, TransformerEngine, torchao's float8 training). ``m`` is the multiplier the scale was
        derived from where the stored scale is its fp32 reciprocal (``reciprocal_scale``), the stored
        multiplier (``multiplier_scale``), else ``fl32(1 / s)``; a block whose ``1 / s`` overflows
        divides. Both forms are within the same quantization bound (two fp32 roundings, docs/spec.md
        §5.1): this is a bit-exact-reference matter.
    multiplier_scale : bool
        The stored scale is the multiplier ``m = fl32(qmax / max(amax, floor))`` itself and
        ``x ~ data / m`` (torchao's ``Float8TrainingTensor._scale``); needs ``multiply_codes``. A
        block whose multiplier overflows (amax 0 with no floor) stores ``fl32(1 / zero_scale)``.
        fp32 scales only, no power-of-two rounding. Quantization only: ``scaled_mm`` and ``linear``
        take dequantization scales and refuse such operands.

    Examples
    --------
    >>> from fp8ref import QuantScheme
    >>> QuantScheme(granularity="group", group_size=128).short_str()
    'e4m3fn-group128-dyn'
    """

    format: Fp8Format = E4M3FN
    granularity: Granularity = Granularity.ROW
    group_size: int | None = None
    block: tuple[int, int] | None = None
    dynamic: bool = True
    amax_floor: float = DEFAULT_AMAX_FLOOR
    qmax: float | None = None
    scale_dtype: torch.dtype = torch.float32
    pow2_scale: bool = False
    zero_scale: float = 1.0
    scale_compute_dtype: torch.dtype = torch.float32
    subnormal_scales: bool = False
    reciprocal_scale: bool = False
    multiplier_by_reciprocal: bool = False
    multiply_codes: bool = False
    multiplier_scale: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", get_format(self.format))
        try:
            gran = Granularity(self.granularity)
        except ValueError:
            raise ValueError(f"granularity must be one of {[g.value for g in Granularity]}, "
                             f"got {self.granularity!r}") from None
        object.__setattr__(self, "granularity", gran)
        if gran is Granularity.GROUP:
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
                raise ValueError(f"granularity 'group' needs a positive int group_size, got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only meaningful for granularity 'group', not {gran.value!r}")
        if gran is Granularity.BLOCK:
            blk = self.block
            if (not isinstance(blk, (tuple, list)) or len(blk) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blk)):
                raise ValueError(f"granularity 'block' needs block=(R, C) of positive ints, got {blk!r}")
            object.__setattr__(self, "block", (int(blk[0]), int(blk[1])))
        elif self.block is not None:
            raise ValueError(f"block is only meaningful for granularity 'block', not {gran.value!r}")
        floor = self.amax_floor
        if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not math.isfinite(floor) or floor < 0:
            raise ValueError(f"amax_floor must be a finite float >= 0, got {floor!r}")
        object.__setattr__(self, "amax_floor", float(floor))
        fmt = self.format
        qmax = fmt.max if self.qmax is None else self.qmax
        if not isinstance(qmax, (int, float)) or isinstance(qmax, bool) or not (0 < qmax <= fmt.max):
            raise ValueError(f"qmax must lie in (0, {fmt.max}] for {fmt.name}, got {qmax!r}")
        if float(torch.tensor(float(qmax), dtype=torch.float32).to(fmt.torch_dtype).float()) != qmax:
            raise ValueError(f"qmax={qmax} is not a value of the {fmt.name} grid")
        object.__setattr__(self, "qmax", float(qmax))
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, got {self.scale_dtype}")
        if self.scale_compute_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_compute_dtype must be one of {_SCALE_DTYPES}, got {self.scale_compute_dtype}")
        zs = self.zero_scale
        if not isinstance(zs, (int, float)) or isinstance(zs, bool) or not math.isfinite(zs) or zs <= 0:
            raise ValueError(f"zero_scale must be a finite float > 0 (NaN or 0 scales are defects), got {zs!r}")
        object.__setattr__(self, "zero_scale", float(zs))
        for flag in ("dynamic", "pow2_scale", "subnormal_scales", "reciprocal_scale", "multiplier_by_reciprocal",
                     "multiply_codes", "multiplier_scale"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.reciprocal_scale and not self.dynamic:
            raise ValueError("reciprocal_scale is a rule for computing a dynamic scale; a static scheme "
                             "(dynamic=False) takes the caller's scale as given")
        if self.reciprocal_scale and self.scale_compute_dtype != torch.float32:
            raise ValueError("reciprocal_scale is computed in fp32 (scale_compute_dtype=torch.float32): "
                             f"got {self.scale_compute_dtype}, where qmax / amax would overflow for small amax")
        if self.multiplier_by_reciprocal and not (self.reciprocal_scale or self.multiplier_scale):
            raise ValueError("multiplier_by_reciprocal says how the multiplier qmax / amax is evaluated: it needs "
                             "reciprocal_scale or multiplier_scale, the schemes that compute one")
        if self.multiplier_scale:
            if not self.multiply_codes:
                raise ValueError("multiplier_scale stores m and quantizes with x * m: set multiply_codes=True too")
            if self.reciprocal_scale:
                raise ValueError("multiplier_scale stores the multiplier itself; reciprocal_scale stores its "
                                 "reciprocal: choose one")
            if (self.scale_dtype != torch.float32 or self.scale_compute_dtype != torch.float32 or self.pow2_scale
                    or self.subnormal_scales):
                raise ValueError("multiplier_scale takes fp32 multipliers (scale_dtype and scale_compute_dtype "
                                 "torch.float32), no pow2_scale and no subnormal_scales")

    @property
    def standard_scale_rule(self) -> bool:
        """True when the scale follows the default rule: the quotient computed in fp32, 1 for a zero
        block, never subnormal, stored as a dequantization scale, and the codes divide by it (what
        fp8ref's fast kernels implement; other conventions go to the reference)."""
        return (self.zero_scale == 1.0 and self.scale_compute_dtype == torch.float32 and not self.subnormal_scales
                and not self.reciprocal_scale and not self.multiplier_by_reciprocal and not self.multiply_codes
                and not self.multiplier_scale)

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """(r, c): the extent of one scale's block for a ``[rows, cols]`` tensor (at least 1)."""
        g = self.granularity
        if g is Granularity.TENSOR:
            return max(rows, 1), max(cols, 1)
        if g is Granularity.ROW:
            return 1, max(cols, 1)
        if g is Granularity.GROUP:
            return 1, self.group_size
        return self.block

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Shape of the scale tensor for a ``[rows, cols]`` input: ceil(rows/r) x ceil(cols/c)."""
        if self.granularity is Granularity.TENSOR:
            return 1, 1
        r, c = self.block_shape(rows, cols)
        return -(-rows // r), -(-cols // c)

    def short_str(self) -> str:
        g = self.granularity
        gran = {Granularity.TENSOR: "tensor", Granularity.ROW: "row"}.get(g)
        if g is Granularity.GROUP:
            gran = f"group{self.group_size}"
        elif g is Granularity.BLOCK:
            gran = f"block{self.block[0]}x{self.block[1]}"
        parts = [self.format.name, gran, "dyn" if self.dynamic else "static"]
        if self.amax_floor != DEFAULT_AMAX_FLOOR:
            parts.append(f"floor{self.amax_floor:g}")
        if self.qmax != self.format.max:
            parts.append(f"qmax{self.qmax:g}")
        if self.scale_dtype != torch.float32:
            parts.append(str(self.scale_dtype).replace("torch.", "s"))
        if self.pow2_scale:
            parts.append("pow2")
        if self.zero_scale != 1.0:
            parts.append(f"zero{self.zero_scale:g}")
        if self.scale_compute_dtype != torch.float32:
            parts.append(str(self.scale_compute_dtype).replace("torch.", "c"))
        if self.subnormal_scales:
            parts.append("subn")
        if self.reciprocal_scale:
            parts.append("recip")
        if self.multiplier_by_reciprocal:
            parts.append("rmul")
        if self.multiply_codes:
            parts.append("mul")
        if self.multiplier_scale:
            parts.append("smult")
        return "-".join(parts)

    def with_(self, **changes) -> QuantScheme:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def __repr__(self) -> str:
        # short_str names every field that differs from the defaults; the dataclass repr (500+
        # characters, the format's constants included) buried signatures in help().
        return f"<QuantScheme {self.short_str()}>"


@dataclass(frozen=True)
class Recipe:
    """A weight scheme (weights ``[N, K]``) paired with an activation scheme (``[M, K]``)."""

    name: str
    weight: QuantScheme
    activation: QuantScheme

    def __post_init__(self) -> None:
        if not isinstance(self.weight, QuantScheme) or not isinstance(self.activation, QuantScheme):
            raise TypeError("Recipe.weight and Recipe.activation must be QuantScheme instances")

    def short_str(self) -> str:
        return f"{self.name}[w:{self.weight.short_str()},a:{self.activation.short_str()}]"

    def __repr__(self) -> str:
        # Short, so that help(fp8ref.linear) shows the default recipe in one line.
        return f"<Recipe {self.name}: weight {self.weight.short_str()}, activation {self.activation.short_str()}>"


#: SGLang ``--quantization w8a8_fp8``: per-output-channel weights, dynamic per-token activations.
W8A8_FP8 = Recipe("w8a8_fp8", QuantScheme(granularity="row"), QuantScheme(granularity="row"))
#: SGLang/vLLM ``--quantization fp8`` online: one scale for the weight, dynamic per-tensor activations.
FP8_PER_TENSOR = Recipe("fp8", QuantScheme(granularity="tensor"), QuantScheme(granularity="tensor"))
#: DeepSeek-V3 style block FP8: 128x128 weight blocks, 1x128 activation groups.
FP8_BLOCK = Recipe(
    "fp8_block",
    QuantScheme(granularity="block", block=(128, 128)),
    QuantScheme(granularity="group", group_size=128),
)
#: compressed-tensors FP8_DYNAMIC ("-FP8-dynamic" checkpoints): channel weights stored as
#: ``weight`` F8_E4M3 [N, K] + ``weight_scale`` [N, 1]; dynamic per-token activations.
FP8_DYNAMIC = Recipe("fp8_dynamic", QuantScheme(granularity="row"), QuantScheme(granularity="row"))
#: The ROCm variant of w8a8_fp8: E4M3FNUZ clamped at 224.
W8A8_FP8_ROCM = Recipe(
    "w8a8_fp8_rocm",
    QuantScheme(format=E4M3FNUZ, granularity="row", qmax=224.0),
    QuantScheme(format=E4M3FNUZ, granularity="row", qmax=224.0),
)

#: OCP MX FP8 (MXFP8, E4M3 elements): 1x32 groups along K on both operands, power-of-two scales
#: (E8M0 in memory, ``fp8ref.spec.layouts``), rounded up: amax / qmax never clips (NVIDIA's
#: cuBLAS/TransformerEngine MXFP8 recipe; the OCP spec's floor(log2 amax) - emax rule can clip, a
#: defect here: docs/spec.md §3.1).
MXFP8 = Recipe(
    "mxfp8",
    QuantScheme(granularity="group", group_size=32, pow2_scale=True),
    QuantScheme(granularity="group", group_size=32, pow2_scale=True),
)
#: MXFP8 with E5M2 elements on both operands.
MXFP8_E5M2 = Recipe(
    "mxfp8_e5m2",
    QuantScheme(format=E5M2, granularity="group", group_size=32, pow2_scale=True),
    QuantScheme(format=E5M2, granularity="group", group_size=32, pow2_scale=True),
)
#: DeepSeek-V3.1 / DeepGEMM on SM100 (``fp8_block`` with UE8M0 scales): 128x128 weight blocks, 1x128
#: activation groups, every scale a power of two rounded up (vLLM/SGLang ``scale_fmt="ue8m0"``),
#: stored as exponent bytes packed 4 per int32 (``fp8ref.spec.layouts.UE8M0_PACKED``).
FP8_BLOCK_UE8M0 = Recipe(
    "fp8_block_ue8m0",
    QuantScheme(granularity="block", block=(128, 128), pow2_scale=True),
    QuantScheme(granularity="group", group_size=128, pow2_scale=True),
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (W8A8_FP8, FP8_PER_TENSOR, FP8_BLOCK, FP8_DYNAMIC, W8A8_FP8_ROCM,
                                                  MXFP8, MXFP8_E5M2, FP8_BLOCK_UE8M0)}


def get_recipe(recipe: Recipe | str) -> Recipe:
    """A recipe by object or preset name (``w8a8_fp8``, ``fp8``, ``fp8_block``, ``fp8_dynamic``,
    ``w8a8_fp8_rocm``, ``mxfp8``, ``mxfp8_e5m2``, ``fp8_block_ue8m0``)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"unknown recipe {recipe!r}; presets: {sorted(RECIPES)}")
