"""``fp8ref.moe``: an FP8 mixture-of-experts layer on the chosen MoE backend (docs/spec.md §7).

The caller's arguments are checked (``fp8ref.spec.moe.check_moe_args``) before any selection,
probe or kernel runs, as for ``fp8ref.linear``.
"""

from __future__ import annotations

import torch

from .. import select as _select
from ..registry import MoeBackend, get_moe_backend
from ..select.moe import select_moe
from ..spec.moe import MoeScheme, MoeWeights, Routing, check_moe_args

__all__ = ["moe"]


def moe(x: torch.Tensor, weights: MoeWeights, routing: Routing, scheme: MoeScheme, *,
        out_dtype: torch.dtype = torch.bfloat16, backend: str | MoeBackend = "auto") -> torch.Tensor:
    """An FP8 mixture-of-experts layer (docs/spec.md §7) on the chosen MoE backend.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, K]`` activations (float).
    weights : MoeWeights
        The experts' FP8 ``w13`` [E, 2I, K] and ``w2`` [E, K, I] with their scales (and static
        activation scales); ``fp8ref.quantize_experts`` makes them from float weights.
    routing : Routing
        The router's top-k ``ids`` and ``weights`` [T, k] (and an expert-parallel ``expert_map``).
    scheme : MoeScheme
        Weight, activation and intermediate schemes and the gate/up order.
    out_dtype : torch.dtype
        bf16 (default), fp16, fp32 or fp64.
    backend : str or MoeBackend
        ``"auto"`` (the first MoE backend that passes the compliance probe for this scheme, else the
        reference: ``fp8ref.select.moe``), a registered MoE backend's name, or an instance.

    Examples
    --------
    >>> import torch, fp8ref
    >>> s = fp8ref.QuantScheme(granularity="tensor")
    >>> scheme = fp8ref.MoeScheme(weight=s, activation=s, intermediate=s)
    >>> w = fp8ref.quantize_experts(torch.randn(4, 16, 32), torch.randn(4, 32, 8), s)
    >>> r = fp8ref.Routing(torch.tensor([[0, 3], [1, 1]]), torch.tensor([[0.7, 0.3], [0.5, 0.5]]))
    >>> fp8ref.moe(torch.randn(2, 32), w, r, scheme, backend="reference").shape
    torch.Size([2, 32])
    """
    check_moe_args(x, weights, routing, scheme, out_dtype)
    if isinstance(backend, MoeBackend):
        b = backend
    elif backend == "auto":
        b = get_moe_backend(select_moe(scheme, out_dtype)[0])
    elif isinstance(backend, str):
        b = get_moe_backend(backend)
    else:
        raise TypeError(f"backend must be 'auto', a MoE backend's name or a MoeBackend, got {type(backend).__name__}")
    reason = b.available() or b.supports(scheme, out_dtype)
    if reason:
        raise _select.BackendUnavailableError(f"MoE backend {b.name!r} cannot take {scheme.short_str()}: {reason}")
    return b.moe(x, weights, routing, scheme, out_dtype)
