"""A characterization probe: how many significand bits a backend's GEMM accumulator keeps.

Row m of the activations is ``[256, c_m, 0, ..., 0, -256]`` (K = 16, or 128 for a backend that
takes only whole 128-blocks) and weight column n is
``[256, d_n, 0, ..., 0, 256]`` (all scales 1), so the exact result is ``delta = c_m d_n`` while a
K-ordered accumulator first forms ``2**16 + delta``. An accumulator with a p-bit significand
keeps delta exactly when delta >= ulp(2**16) = 2**(17 - p) and loses all of it when delta is at
most half that (powers of two: a tie rounds to the even 2**16). The reading is the largest p
for which every delta >= 2**(17 - p) survived: 24 for fp32 accumulation, about 14 for Hopper's
fast accumulation, 8 for bf16, and ``PROBE_MAX_BITS`` (the probe's range) for exact ones. The
final value is a power of two, so the output rounding loses nothing and does not cap the reading.

A backend that computes ``linear`` only (a layer that quantizes its inputs itself: it has no
``scaled_mm`` to hand codes to) is read through ``linear`` on float operands built the same way
with 448 (E4M3's max) in place of 256: every row's and tensor's amax is 448, so any scale rule
``amax / 448`` (or ``1 / (448 / amax)``) gives scale 1 and every value is on the FP8 grid, so the
quantization is exact and the accumulator alone decides. The large product is then
``448**2 = 49 * 2**12``, whose ulp at p bits is ``2**(18 - p)`` (a tie at half of it rounds to the
even multiple, ``448**2``), so a lost delta reads ``18 - log2(delta)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..registry import Backend, Case, decline_reason
from ..spec import layouts
from ..spec.quant import Quantized
from ..spec.schemes import FP8_BLOCK, FP8_BLOCK_UE8M0, FP8_PER_TENSOR, MXFP8, W8A8_FP8

__all__ = ["accumulator_bits", "PROBE_MAX_BITS"]

_L_CODE = 256.0  # 2**8; the large product is 2**16
_C = [2.0 ** (8 - m) for m in range(18)]  # c_m: 2**8 .. 2**-9 (E4M3 normals and subnormals)
_D = [2.0**8, 1.0, 2.0**-9]  # d_n
#: Bits read from delta = c_m d_n: 17 - log2(delta); the columns read 1..18, 9..26 and 18..35
#: (a reading of 0: even delta = 2**16 was lost, so products are dropped, not rounded).
PROBE_MAX_BITS = 35
_M, _N = 32, 16  # multiples of 16: the alignment every fp8 GEMM accepts
#: K of the probe: 16, or 128 for kernels that take whole 128-blocks only (zeros in between).
_KS = (16, 128)


def _operands(recipe, K: int):
    a = torch.zeros(_M, K)
    for m, c in enumerate(_C):
        a[m, 0], a[m, 1], a[m, K - 1] = _L_CODE, c, -_L_CODE
    b = torch.zeros(_N, K)
    for n, d in enumerate(_D):
        b[n, 0], b[n, 1], b[n, K - 1] = _L_CODE, d, _L_CODE
    qa, qw = recipe.activation, recipe.weight
    return (Quantized(a.to(qa.format.torch_dtype), torch.ones(qa.scale_shape(_M, K), dtype=qa.scale_dtype), qa),
            Quantized(b.to(qw.format.torch_dtype), torch.ones(qw.scale_shape(_N, K), dtype=qw.scale_dtype), qw))


def accumulator_bits(backend: Backend, device: str = "cpu",
                     map_problem: Callable[[Any], Any] | None = None) -> int | None:
    """Estimate the significand bits the backend's accumulator keeps (see the module docstring).

    Parameters
    ----------
    backend : Backend
    device : str
        Where the operands live.
    map_problem : callable, optional
        For a linear-only backend: its conventions mapped into the probe's recipe (a peer's
        ``map_problem``, ``fp8ref.conformance.adaptation.Adaptation``), so that it takes the case.

    Returns
    -------
    int or None
        The reading, capped at ``PROBE_MAX_BITS``; None when the backend declines every E4M3
        recipe and output dtype the probe can use.

    Examples
    --------
    >>> from fp8ref import get_backend
    >>> from fp8ref.conformance import accumulator_bits
    >>> accumulator_bits(get_backend("reference"))
    35
    """
    if "scaled_mm" not in backend.ops and "linear" in backend.ops:
        return _linear_bits(backend, device, map_problem)
    for K in _KS:
        for recipe in (W8A8_FP8, FP8_PER_TENSOR, FP8_BLOCK, MXFP8, FP8_BLOCK_UE8M0):
            for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                # Small-M kernels (decode) decline 32 rows: feed them the probe rows in chunks.
                for rows in (_M, 16, 4, 1):
                    case = Case(rows, _N, K, recipe, torch.bfloat16, out_dtype, device=device, op="scaled_mm")
                    if decline_reason(backend, case) is None:
                        return _read(backend, recipe, out_dtype, rows, device, K)
    return None


def _read(backend: Backend, recipe, out_dtype: torch.dtype, rows: int, device: str, K: int) -> int:
    a, b = _operands(recipe, K)
    b = Quantized(b.data.to(device), b.scale.to(device), b.scheme)
    prepared = backend.prepare_weight(layouts.encode(b, backend.scale_layout.weight, poison=True))
    ys = []
    for m0 in range(0, _M, rows):
        part = Quantized(a.data[m0:m0 + rows].to(device), a.scale[:1].expand(
            a.scheme.scale_shape(rows, K)).contiguous().to(device), a.scheme)
        part = layouts.encode(part, backend.scale_layout.activation, poison=True)
        ys.append(backend.scaled_mm(part, prepared, None, out_dtype).to(torch.float64).cpu())
    y = torch.cat(ys)
    lost = []
    for m, c in enumerate(_C):
        for n, d in enumerate(_D):
            delta = c * d
            if float(y[m, n]) != delta:
                lost.append(int(17 - math.log2(delta)))
    return min(lost) - 1 if lost else PROBE_MAX_BITS


_L_LINEAR = 448.0  # E4M3's max: scale 1 under every amax / 448 rule


def _linear_bits(backend: Backend, device: str, map_problem: Callable[[Any], Any] | None) -> int | None:
    """The reading through ``linear`` for a backend without ``scaled_mm`` (module docstring)."""
    from .problems import LinearProblem, TensorSpec

    for K in _KS:
        for base in (W8A8_FP8, FP8_PER_TENSOR, FP8_BLOCK, MXFP8, FP8_BLOCK_UE8M0):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for out_dtype in dict.fromkeys((torch.float32, dtype)):
                    p = LinearProblem(_M, _N, K, base, dtype, out_dtype, TensorSpec(), TensorSpec())
                    recipe = (p if map_problem is None else map_problem(p)).recipe
                    case = Case(_M, _N, K, recipe, dtype, out_dtype, device=device)
                    if decline_reason(backend, case) is None:
                        return _read_linear(backend, recipe, dtype, out_dtype, device, K)
    return None


def _read_linear(backend: Backend, recipe, dtype: torch.dtype, out_dtype: torch.dtype, device: str, K: int) -> int:
    from ..spec.quant import quantize

    x = torch.zeros(_M, K, dtype=torch.float64)
    for m, c in enumerate(_C):
        x[m, 0], x[m, 1], x[m, K - 1] = _L_LINEAR, c, -_L_LINEAR
    for m in range(len(_C), _M):  # every row's amax is 448 (per-row and per-group scales 1)
        x[m, 0], x[m, K - 1] = _L_LINEAR, -_L_LINEAR
    w = torch.zeros(_N, K, dtype=torch.float64)
    for n in range(_N):
        w[n, 0], w[n, K - 1] = _L_LINEAR, _L_LINEAR
    for n, d in enumerate(_D):
        w[n, 1] = d
    x, w = x.to(dtype).to(device), w.to(dtype).to(device)
    prepared = backend.prepare_weight(w if backend.float_weight else layouts.encode(
        quantize(w, recipe.weight), backend.scale_layout.weight, poison=True))
    y = backend.linear(x, prepared, None, out_dtype, recipe.activation).to(torch.float64).cpu()
    lost = []
    for m, c in enumerate(_C):
        for n, d in enumerate(_D):
            delta = c * d
            if delta > torch.finfo(out_dtype).max:  # 2**16 past fp16's range: that delta reads nothing
                continue
            if float(y[m, n]) != delta:
                lost.append(int(18 - math.log2(delta)))
    return min(lost) - 1 if lost else PROBE_MAX_BITS
