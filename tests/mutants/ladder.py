"""The accumulation classes, from exact to bf16: a correct implementation of each, and the next
weaker implementation declaring it (test_mutants.py, make_report.py)."""

from __future__ import annotations

import torch

from fp8ref.conformance import corner_sweep, get_contract, get_profile
from fp8ref.conformance.contracts import Declined
from fp8ref.spec.bounds import Accumulation

from .variants import DeclaredFp16, ExactFloat64, FastPromote32, HonestBf16, SequentialFp32


def swamp_ratio(backend, bits: tuple[int, ...]) -> float:
    """The largest error/bound of ``scaled_mm.bound`` over the ci sweep's swamped dot products with
    an fp32 output whose target width is in ``bits``."""
    contract = get_contract("scaled_mm.bound")
    worst = 0.0
    for p in corner_sweep("scaled_mm", get_profile("ci"), backend):
        if p.a.family != "swamp" or p.out_dtype != torch.float32 or p.a.bits + p.b.bits not in bits:
            continue
        try:
            worst = max(worst, contract.check(backend, p))
        except Declined:
            continue
        except AssertionError:
            return float("inf")
    return worst


def declaring(cls, accumulation):
    return type(f"{cls.__name__}As{accumulation.name}", (cls,), {"accumulation": accumulation,
                                                                   "name": f"{cls.name}-as-{accumulation.name}"})


#: (a correct implementation, the significand widths where it reaches its bound,
#:  the next weaker implementation declaring the same class, the widths where it leaves it)
LADDER = [
    (ExactFloat64, (24, 25), declaring(SequentialFp32, Accumulation.EXACT), (24, 25)),
    (SequentialFp32, (24, 25), declaring(FastPromote32, Accumulation.FP32), (13, 14, 15)),
    (FastPromote32, (13, 14, 15), declaring(DeclaredFp16, FastPromote32.accumulation), (11, 12)),
    (DeclaredFp16, (11, 12), declaring(HonestBf16, Accumulation.FP16), (8, 9)),
    (HonestBf16, (8, 9), None, ()),
]


