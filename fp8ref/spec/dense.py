"""The layout check of every tensor argument: the first of the argument checks, in a module of its
own below the reference quantizer (``quant.check_float_input`` runs it, and ``checks`` builds on
``quant``), so that ``fp8ref.quantize``, ``fp8ref.linear`` and every backend refuse a sparse,
mkldnn, nested or meta tensor with the same words. ``fp8ref.spec.checks`` re-exports it: that
module is the face of the argument checks.
"""

from __future__ import annotations

import torch

__all__ = ["check_dense"]

_META = "fp8ref computes on values (the scales depend on them), so there is no shape-only (meta) run"


def check_dense(t: torch.Tensor, what: str) -> None:
    """Raise naming ``what`` unless ``t`` is a dense (strided, not nested) tensor holding values
    (not on the meta device).

    Sparse (COO, CSR, ...), mkldnn and nested tensors reach torch kernels that do not exist for
    them (``aten::amax`` on SparseCPU) or answer shapes wrongly; a meta tensor has no values to
    scale. Three attribute reads: cheap enough for every call.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.spec.dense import check_dense
    >>> check_dense(torch.eye(3).to_sparse(), "x")
    Traceback (most recent call last):
    ...
    TypeError: x is a torch.sparse_coo tensor: fp8ref takes dense (torch.strided) tensors; convert it with .to_dense()
    """
    if t.is_nested:
        raise TypeError(f"{what} is a nested tensor: fp8ref takes dense (torch.strided) tensors; pad it "
                        "(torch.nested.to_padded_tensor) or pass its components one by one")
    if t.layout is not torch.strided:
        raise TypeError(f"{what} is a {t.layout} tensor: fp8ref takes dense (torch.strided) tensors; convert it "
                        "with .to_dense()")
    if t.device.type == "meta":
        raise ValueError(f"{what} is on the meta device, which holds no values: {_META}")
