"""The probe's inputs: random rows plus the rows where FP8 kernels have broken.

Outlier channels, an all-zero row, a row of rounding ties (block scale exactly 1), a huge
dynamic range, a constant row, a single non-zero and +-qmax; each recipe's block shape decides
where the ties' scale-fixing entries go.
"""

from __future__ import annotations

import torch

from ..spec.schemes import Granularity, QuantScheme

__all__ = ["tie_values", "adversarial"]


def tie_values(scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """Midpoints between adjacent positive grid values of the format below qmax that are exact in
    ``dtype``: with a block scale of exactly 1 they land on rounding ties."""
    grid = scheme.format.finite_values()
    grid = grid[(grid >= 0) & (grid <= scheme.qmax)]
    mids = (grid[1:] + grid[:-1]) / 2
    exact = mids.to(dtype).to(torch.float64) == mids
    return mids[exact]


def adversarial(rows: int, cols: int, scheme: QuantScheme, dtype: torch.dtype, gen: torch.Generator,
                 outlier: float) -> torch.Tensor:
    """Random rows plus: outlier channels, an all-zero row, a row of rounding ties (block scale
    exactly 1), a huge-dynamic-range row, a constant row, a single non-zero, +-qmax."""
    qmax = scheme.qmax
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    _, c = scheme.block_shape(rows, cols)
    special = []
    n_out = max(1, min(4, cols // 16))
    cols_out = torch.randperm(cols, generator=gen)[:n_out]
    special.append(lambda row: row.index_fill_(0, cols_out, min(outlier, qmax / 2)))
    special.append(lambda row: row.zero_())

    def ties(row):
        t = tie_values(scheme, dtype)
        idx = torch.randint(0, len(t), (cols,), generator=gen)
        sign = torch.where(torch.rand(cols, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        row.copy_(t[idx] * sign)
        step = c if scheme.granularity in (Granularity.GROUP, Granularity.BLOCK) else cols
        row[::step] = qmax  # one element at qmax per scale block along K: that block's scale is 1
        return row

    special.append(ties)
    special.append(lambda row: row.mul_(torch.exp2(torch.empty(cols, dtype=torch.float64).uniform_(
        -20, 6, generator=gen))))
    special.append(lambda row: row.fill_(0.3))
    special.append(lambda row: row.zero_().index_fill_(0, cols_out[:1], 1.5))
    special.append(lambda row: row.copy_(torch.where(torch.arange(cols) % 2 == 0, qmax, -qmax)))
    for i, f in enumerate(special[:rows]):
        f(x[i])
    # Every value stays within +-qmax, so the +-qmax row (and the tie row's qmax entries) make a
    # whole-tensor or block scale exactly 1 too.
    return x.clamp(-qmax, qmax).to(dtype)
