"""The reference linear: quantize the weight and the activations, then the reference scaled GEMM."""

from __future__ import annotations

import torch

from .gemm import scaled_mm
from .quant import Quantized, quantize
from .schemes import Recipe, W8A8_FP8, get_recipe

__all__ = ["reference_linear", "quantize_weight", "flatten_activations"]


def quantize_weight(w: torch.Tensor | Quantized, recipe: Recipe | str = W8A8_FP8,
                    scale: torch.Tensor | None = None) -> Quantized:
    """Quantize a float weight ``[N, K]`` under ``recipe.weight`` (or check a quantized one)."""
    recipe = get_recipe(recipe)
    if isinstance(w, Quantized):
        if w.scheme != recipe.weight:
            raise ValueError(f"weight was quantized as {w.scheme.short_str()}, recipe {recipe.name} "
                             f"expects {recipe.weight.short_str()}")
        return w
    return quantize(w, recipe.weight, scale)


def flatten_activations(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``[..., K]`` to ``[M, K]``, with the leading shape to restore the output."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K]")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def reference_linear(x: torch.Tensor, w: torch.Tensor | Quantized, bias: torch.Tensor | None = None, *,
                     recipe: Recipe | str = W8A8_FP8, out_dtype: torch.dtype | None = None,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed the FP8 W8A8 way, by the spec.

    Parameters
    ----------
    x : torch.Tensor
        Activations ``[..., K]``.
    w : torch.Tensor or Quantized
        Weight ``[N, K]``, float (quantized here under ``recipe.weight``) or already quantized.
    bias : torch.Tensor, optional
        ``[N]``.
    recipe : Recipe or str
        Default ``W8A8_FP8``: per-channel weights, dynamic per-token activations.
    out_dtype : torch.dtype, optional
        Defaults to ``x.dtype`` (float64 input gives the unrounded float64 result).
    input_scale : torch.Tensor, optional
        Static activation scale, for recipes whose activation scheme is static.

    Examples
    --------
    >>> import torch, fp8ref
    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> fp8ref.reference_linear(x, w).shape
    torch.Size([4, 32])
    """
    recipe = get_recipe(recipe)
    x2, lead = flatten_activations(x)
    qw = quantize_weight(w, recipe)
    qx = quantize(x2, recipe.activation, input_scale)
    y = scaled_mm(qx, qw, bias, out_dtype=x.dtype if out_dtype is None else out_dtype)
    return y.reshape(*lead, y.shape[-1])
