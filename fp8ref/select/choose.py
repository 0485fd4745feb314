"""``choose_backend``: the selection asked in the caller's terms (tensors or shapes), not a ``Case``.

It is also what calling the package does: ``fp8ref.select(x, w)`` is ``choose_backend(x, w)``
(the package's module object is callable; ``from fp8ref.select import ...`` works as before).
"""

from __future__ import annotations

import torch

from ..registry import Case
from ..spec.quant import Quantized
from ..spec.schemes import W8A8_FP8, Recipe, get_recipe
from .decision import Decision
from .selector import DEFAULT_PRECISION, select

__all__ = ["choose_backend"]


def _shape(v, name: str, what: str) -> tuple[int, ...]:
    if isinstance(v, Quantized):
        return tuple(v.data.shape)
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    if isinstance(v, (tuple, list, torch.Size)) and all(isinstance(d, int) and not isinstance(d, bool) for d in v):
        return tuple(v)
    raise TypeError(f"{name} must be a tensor {what} or its shape (a tuple of ints), got {type(v).__name__}")


def choose_backend(x, w, bias: torch.Tensor | bool | None = None, *, recipe: Recipe | str = W8A8_FP8,
                   precision: str = DEFAULT_PRECISION, out_dtype: torch.dtype | None = None,
                   x_dtype: torch.dtype | None = None, device: str | None = None, refresh: bool = False) -> Decision:
    """Which backend ``fp8ref.linear(x, w, bias, backend="auto")`` runs, and why (the ``Decision``).

    Parameters
    ----------
    x : torch.Tensor or tuple of int
        Activations ``[..., K]``, or their shape.
    w : torch.Tensor, Quantized or tuple of int
        Weight ``[N, K]``, or its shape.
    bias : torch.Tensor, bool or None
        A bias tensor, or whether there is one.
    recipe : Recipe or str
    precision : str
        Required precision class (``exact``, ``strict``, ``standard``, ``fast``).
    out_dtype : torch.dtype, optional
        Default: the activations' dtype.
    x_dtype, device : optional
        For shapes: the activations' dtype (default bfloat16) and device (default ``"cpu"``);
        for a tensor ``x`` they are its own.
    refresh : bool
        Select again instead of reading the caches.

    Returns
    -------
    Decision
        ``.chosen`` names the backend; ``str()`` is the table (backend, class, reason, compliance,
        time). Values are not read: the selection depends on shapes, dtypes and the device only.

    Examples
    --------
    >>> import torch, fp8ref
    >>> d = fp8ref.select((1, 4096), (4096, 4096))      # shapes: bf16 activations on the CPU
    >>> d.chosen in d.ranking
    True
    >>> d = fp8ref.choose_backend(torch.randn(4, 64), torch.randn(32, 64))   # tensors: their dtype, device
    >>> d.chosen == fp8ref.select((4, 64), (32, 64), x_dtype=torch.float32).chosen
    True
    """
    xs, ws = _shape(x, "x", "[..., K]"), _shape(w, "w", "[N, K]")
    if len(xs) < 1:
        raise ValueError("x must have at least one dim [..., K], got a 0-d shape")
    if len(ws) != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {ws}")
    N, K = ws
    if xs[-1] != K:
        raise ValueError(f"x has {xs[-1]} features (shape {xs}) but w is [{N}, {K}]")
    if isinstance(x, torch.Tensor):
        if x_dtype is not None and x_dtype != x.dtype:
            raise ValueError(f"x_dtype={x_dtype} contradicts x's dtype {x.dtype}")
        x_dtype, device = x.dtype, str(x.device) if device is None else device
    x_dtype = torch.bfloat16 if x_dtype is None else x_dtype
    if not isinstance(x_dtype, torch.dtype):
        raise TypeError(f"x_dtype must be a torch.dtype, got {type(x_dtype).__name__}")
    if bias is not None and not isinstance(bias, (bool, torch.Tensor)):
        raise TypeError(f"bias must be a tensor, a bool or None, got {type(bias).__name__}")
    has_bias = bool(bias) if isinstance(bias, bool) else bias is not None
    M = 1
    for d in xs[:-1]:
        M *= d
    case = Case(M=M, N=N, K=K, recipe=get_recipe(recipe), x_dtype=x_dtype,
                out_dtype=x_dtype if out_dtype is None else out_dtype, device="cpu" if device is None else device,
                has_bias=has_bias)
    return select(case, precision, refresh=refresh)
