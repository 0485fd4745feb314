"""The argument checks of the calling contract: one home, imported downward by every entry point.

``fp8ref.linear``, ``explain``, ``reference_linear``, ``Fp8Linear``, the checkpoint loader and the
backends' own ``check_mm_args`` all check a caller's tensors with these functions, so every entry
point words an error alike and names the offending argument. The order is the order a caller
should hear about problems in: the tensor's kind (type, layout, device: a sparse, mkldnn, nested or
meta tensor never reaches a reduction), then dtype and rank, then shapes and devices against each
other, then NaN/Inf (the only checks that read values). The checks of a weight run once per weight
(``fp8ref.linear`` caches them with its quantized form); the per-call checks cost a few
microseconds.

They belong to the spec because they say which inputs the spec is defined for; like the rest of
the spec, this module imports nothing from fp8ref outside ``fp8ref.spec``.
"""

from __future__ import annotations

import math

import torch

from .dense import check_dense
from .formats import get_format
from .quant import Quantized, check_float_input
from .schemes import W8A8_FP8, Recipe, get_recipe

__all__ = ["X_DTYPES", "OUT_DTYPES", "BIAS_NON_FINITE", "check_dense", "check_x", "check_weight", "check_call",
           "check_values", "check_linear_args", "check_finite", "check_codes", "check_bias", "check_out_dtype",
           "is_fp8"]

#: The activation dtypes a linear takes: the reference quantizer's inputs
#: (``fp8ref.spec.quant.check_float_input``; tests/test_reliability_messages.py keeps them equal).
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: The output dtypes of ``scaled_mm`` and of a linear (the reference rounds its float64 result to one).
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

#: What a non-finite bias does (the tail of its error message).
BIAS_NON_FINITE = "those output columns would be NaN/Inf"


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of torch's FP8 dtypes (a float of one byte)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def check_bias(bias, N: int, device: torch.device | None = None) -> None:
    """A bias ``[N]``: a dense float (not FP8) torch.Tensor of shape ``(N,)``, on ``device`` when
    one is given (``TypeError`` for its type and dtype, ``ValueError`` for its shape and device;
    ``check_finite`` scans its values). ``None`` passes.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.checks import check_bias
    >>> check_bias(torch.zeros(4), 4)
    >>> check_bias(torch.zeros(4, dtype=torch.int32), 4)
    Traceback (most recent call last):
    ...
    TypeError: bias must have a float dtype, got torch.int32
    """
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a float torch.Tensor [N] or None, got {type(bias).__name__}")
    check_dense(bias, "bias")
    if not bias.is_floating_point() or is_fp8(bias.dtype):
        raise TypeError(f"bias must have a float dtype, got {bias.dtype}")
    if tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape ({N},) = [N], got {tuple(bias.shape)}")
    if device is not None and bias.device != device:
        raise ValueError(f"bias is on {bias.device} but x is on {device}")


def check_out_dtype(out_dtype, what: str = "out_dtype", none_is: str | None = None) -> None:
    """``out_dtype`` one of ``OUT_DTYPES`` (``TypeError`` naming ``what`` otherwise; ``none_is`` says
    what None means where None is allowed, and the caller has replaced it)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{what} must be one of {[str(d) for d in OUT_DTYPES]}"
                        f"{f' (or None: {none_is})' if none_is else ''}, got {out_dtype}")


def check_x(x) -> None:
    """Type, layout, dtype and rank of the activations ``x [..., K]`` (cheap: every call)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [..., K], got {type(x).__name__}")
    check_dense(x, "x")
    if x.dtype not in X_DTYPES:
        if is_fp8(x.dtype):
            raise TypeError(f"x is an FP8 tensor ({x.dtype}): fp8ref.linear quantizes float activations itself; "
                            "pass them in float32, float16, bfloat16 or float64 (for quantized operands use "
                            "fp8ref.scaled_mm)")
        raise TypeError(f"x must have a float dtype {[str(d) for d in X_DTYPES]}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K], got a 0-d tensor")


def check_weight(w, recipe: Recipe, what: str = "w") -> None:
    """Type, layout, dtype, shape, device and values of a weight ``[N, K]``: a float tensor, or a
    ``Quantized`` of ``recipe.weight`` whose codes are finite and scales finite and > 0; first, that
    no scheme of the recipe stores a multiplier (a linear takes dequantization scales)."""
    for role, scheme in (("weight", recipe.weight), ("activation", recipe.activation)):
        if scheme.multiplier_scale:
            raise ValueError(f"recipe {recipe.name}'s {role} scheme {scheme.short_str()} stores a multiplier "
                             "(x ~ q / m): a linear takes dequantization scales (x ~ q * s)")
    if isinstance(w, Quantized):
        if w.scheme != recipe.weight:
            raise ValueError(f"{what} was quantized as {w.scheme.short_str()}, recipe {recipe.name} expects "
                             f"{recipe.weight.short_str()}")
        check_dense(w.data, f"{what}.data")
        check_dense(w.scale, f"{what}.scale")
        if w.scale.device != w.data.device:
            raise ValueError(f"{what}.scale is on {w.scale.device} but {what}.data is on {w.data.device}")
        if w.data.shape[1] == 0:
            raise ValueError(f"{what} has 0 columns (shape {tuple(w.data.shape)}): the reduction dim K must be at "
                             "least 1")
        check_codes(w, what)
        return
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what} must be a float torch.Tensor [N, K] or an fp8ref.Quantized, got {type(w).__name__}")
    check_dense(w, what)
    if is_fp8(w.dtype):
        raise TypeError(f"{what} is an FP8 tensor ({w.dtype}) without its scales: pass the float weight "
                        "(fp8ref.linear quantizes it once), or fp8ref.Quantized(codes, scale, recipe.weight)")
    if w.dim() != 2:
        raise ValueError(f"{what} must be 2-D [N, K], got shape {tuple(w.shape)}")
    check_float_input(w, what)


def check_call(x: torch.Tensor, N: int, K: int, w_device: torch.device, bias, out_dtype) -> torch.dtype:
    """The per-call checks after the weight's: shapes, devices, bias, output dtype (``check_values``
    then scans the values). Returns the output dtype."""
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but w is [{N}, {K}]")
    if x.device != w_device:
        raise ValueError(f"x is on {x.device} but the weight is on {w_device}")
    check_bias(bias, N, x.device)
    od = x.dtype if out_dtype is None else out_dtype
    check_out_dtype(od, none_is="x's dtype")
    return od


def check_values(x: torch.Tensor, bias) -> None:
    """NaN/Inf in x or bias: the last of the caller's checks (one reduction each)."""
    check_finite(x, "x", "FP8 quantization of NaN/Inf is undefined")
    if bias is not None:
        check_finite(bias, "bias", BIAS_NON_FINITE)


def check_linear_args(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
                      recipe: Recipe | str = W8A8_FP8,
                      out_dtype: torch.dtype | None = None) -> tuple[Recipe, torch.dtype]:
    """Check the arguments of a linear ``y = x w^T + bias`` and return ``(recipe, out_dtype)``.

    What ``fp8ref.linear``, ``fp8ref.explain`` and ``reference_linear`` check before anything else
    runs, in this order: x's type, layout (dense: not sparse, mkldnn or nested), device (not meta),
    dtype (float32/16, bfloat16, float64; not FP8) and rank; the recipe (no scheme that stores a
    multiplier); w's type, layout, dtype, shape, device, values (float: finite; ``Quantized``: its
    scheme is the recipe's, codes and scales on one device, no NaN/Inf codes, finite positive
    scales); x's K and device against w's; bias's type, layout, dtype, shape [N] and device;
    ``out_dtype``; NaN/Inf in x and bias.

    Raises
    ------
    TypeError, ValueError
        Naming the offending argument.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.checks import check_linear_args
    >>> check_linear_args(torch.randn(2, 8), torch.randn(4, 8))[1]
    torch.float32
    >>> check_linear_args(torch.randn(2, 8), torch.randn(4, 8), torch.zeros(5))
    Traceback (most recent call last):
    ...
    ValueError: bias must have shape (4,) = [N], got (5,)
    """
    check_x(x)
    recipe = get_recipe(recipe)
    check_weight(w, recipe)
    wt = w.data if isinstance(w, Quantized) else w
    N, K = wt.shape
    od = check_call(x, N, K, wt.device, bias, out_dtype)
    check_values(x, bias)
    return recipe, od


def check_finite(t: torch.Tensor, what: str, consequence: str = "") -> None:
    """Raise ``ValueError`` naming ``what``, the count and the first NaN/Inf of ``t``, if it has one.

    One reduction when ``t`` is finite (its sum, which is finite unless ``t`` holds NaN/Inf or the
    sum overflows; only then is ``t`` scanned elementwise). ``fp8ref.linear``, the checkpoint
    loader and the backends' ``check_mm_args`` share it, so every entry point words it alike.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.checks import check_finite
    >>> check_finite(torch.tensor([1.0, float("inf"), 3.0]), "bias")
    Traceback (most recent call last):
    ...
    ValueError: bias contains 1 non-finite value(s) (first: inf at index (1,))
    """
    if t.numel() == 0:
        return
    # math.isfinite of the Python float: torch.isfinite on a 0-d tensor costs several times more.
    if math.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).item()):
        return
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    if n:
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{what} contains {n} non-finite value(s) (first: {t[idx].item()} at index {idx})"
                         + (f"; {consequence}" if consequence else ""))


def check_codes(q: Quantized, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` if the FP8 codes of ``q`` hold NaN/Inf or its scales are
    not finite and > 0 (a checkpoint or a foreign quantizer can produce either; every backend
    would turn them into NaN outputs)."""
    fmt = get_format(q.data.dtype)
    values = fmt.code_values()
    bad_codes = torch.nonzero(~torch.isfinite(values)).flatten().to(torch.uint8).to(q.data.device)
    if bad_codes.numel():
        bad = torch.isin(q.data.view(torch.uint8), bad_codes)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            code = int(q.data.view(torch.uint8)[idx])
            raise ValueError(f"{what} holds {int(bad.sum())} {fmt.name} code(s) that decode to NaN/Inf (first: "
                             f"0x{code:02x} at index {idx}); a quantized weight must hold finite values")
    s = q.scale
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        idx = tuple(int(i) for i in (~torch.isfinite(s) | (s <= 0)).nonzero()[0])
        raise ValueError(f"{what} has scale {s[idx].item()} at index {idx}: dequantization scales must be finite "
                         "and > 0")
