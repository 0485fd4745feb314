"""The spec's own speed: the exact reference ``scaled_mm`` against fp32 ``F.linear``, ``quantize`` in GB/s."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..spec import quant
from ..spec.gemm import scaled_mm
from ..spec.schemes import W8A8_FP8, QuantScheme
from .quantization import quant_bytes
from .timing import timeit

__all__ = ["bench_reference"]


def bench_reference(device: str = "cpu", *, M: int = 128, K: int = 4096, N: int = 4096,
                    quant_shape: tuple[int, int] = (4096, 4096), repeat: int = 3, budget_s: float = 6.0,
                    log: Callable[[str], None] = lambda s: None) -> dict:
    """The spec's own speed: exact ``scaled_mm`` against fp32 ``F.linear``, ``quantize`` in GB/s.

    ``scaled_mm_over_fp32_linear`` is the reference GEMM's time over fp32 ``F.linear`` on the
    same [M, K] x [N, K] problem, both in this run (the spec's target is <= 3). The reference
    quantizer is timed on a bf16 ``quant_shape`` tensor with the default per-row scheme.

    Examples
    --------
    >>> from fp8ref.bench import bench_reference
    >>> r = bench_reference(M=4, K=64, N=32, quant_shape=(64, 64), repeat=1)
    >>> sorted(r)[:2]
    ['fp32_linear_s', 'quantize']
    """
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g)
    w = torch.randn(N, K, device=device, generator=g) / K**0.5
    qa, qb = quant.quantize(x, W8A8_FP8.activation), quant.quantize(w, W8A8_FP8.weight)
    t_ref = timeit(lambda: scaled_mm(qa, qb), device=device, repeat=repeat, budget_s=budget_s)
    t_f32 = timeit(lambda: F.linear(x, w), device=device, repeat=repeat, budget_s=budget_s)
    xq = torch.randn(*quant_shape, device=device, generator=g).to(torch.bfloat16)
    scheme = QuantScheme()
    t_q = timeit(lambda: quant.quantize(xq, scheme), device=device, repeat=repeat, budget_s=budget_s)
    nbytes = quant_bytes(*quant_shape, torch.bfloat16, scheme)
    out = {
        "scaled_mm": {"M": M, "K": K, "N": N, "seconds": t_ref.median_s, "timing": t_ref.as_dict()},
        "fp32_linear_s": t_f32.median_s,
        "scaled_mm_over_fp32_linear": t_ref.median_s / t_f32.median_s,
        "target_scaled_mm_over_fp32_linear": 3.0,
        "quantize": {"shape": list(quant_shape), "dtype": "bfloat16", "scheme": scheme.short_str(),
                     "bytes": nbytes, "seconds": t_q.median_s, "gbps": nbytes / t_q.median_s / 1e9,
                     "timing": t_q.as_dict()},
    }
    log(f"  reference scaled_mm M={M} K={K} N={N}: {t_ref.median_s * 1e3:.1f} ms = "
        f"{out['scaled_mm_over_fp32_linear']:.2f} x fp32 F.linear; quantize {out['quantize']['gbps']:.3f} GB/s")
    return out
